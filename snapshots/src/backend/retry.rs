//! Retries of transient backend failures with exponential backoff and jitter.

use super::{Backend, ObjectInfo};
use crate::error::{RepoError, Result};
use bytes::Bytes;
use std::{
    future::Future,
    ops::Range,
    sync::Arc,
    time::{Duration, Instant},
};

/// How [`RetryBackend`] retries.
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    /// Delay before the first retry; doubled after each attempt.
    pub initial_delay: Duration,
    /// Longest delay between two attempts.
    pub max_delay: Duration,
    /// No attempt starts later than this after the first one.
    pub max_elapsed: Duration,
    /// One attempt taking longer than this is abandoned as a timeout (and retried).
    pub attempt_timeout: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            initial_delay: Duration::from_millis(200),
            max_delay: Duration::from_secs(10),
            max_elapsed: Duration::from_secs(120),
            attempt_timeout: Duration::from_secs(300),
        }
    }
}

impl RetryPolicy {
    /// The wait before attempt `attempt + 1`: exponential, with "equal jitter"
    /// (half fixed, half random) so many clients do not retry in lockstep.
    fn delay(&self, attempt: u32) -> Duration {
        let exp = self
            .initial_delay
            .saturating_mul(1u32 << attempt.min(20))
            .min(self.max_delay);
        let mut r = [0u8; 8];
        let _ = getrandom::fill(&mut r);
        let frac = u64::from_le_bytes(r) as f64 / u64::MAX as f64;
        exp / 2 + exp.mul_f64(frac / 2.0)
    }
}

/// Wraps a backend and retries operations that fail with a retryable error
/// ([`RepoError::is_retryable`]); other errors are returned at once.
#[derive(Debug)]
pub struct RetryBackend {
    inner: Arc<dyn Backend>,
    policy: RetryPolicy,
}

impl RetryBackend {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Backend>, policy: RetryPolicy) -> Self {
        RetryBackend { inner, policy }
    }

    async fn retry<T, F, Fut>(&self, op: &'static str, key: &str, mut f: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T>>,
    {
        let started = Instant::now();
        let mut attempt = 0u32;
        loop {
            let result = match tokio::time::timeout(self.policy.attempt_timeout, f()).await {
                Ok(r) => r,
                Err(_) => Err(RepoError::Backend {
                    location: self.inner.location(),
                    op,
                    key: key.into(),
                    retryable: true,
                    detail: format!(
                        "no answer within {:.1}s",
                        self.policy.attempt_timeout.as_secs_f64()
                    ),
                }),
            };
            let err = match result {
                Ok(v) => return Ok(v),
                Err(e) if !e.is_retryable() => return Err(e),
                Err(e) => e,
            };
            attempt += 1;
            let delay = self.policy.delay(attempt - 1);
            if started.elapsed() + delay > self.policy.max_elapsed {
                return Err(RepoError::RetriesExhausted {
                    source: Box::new(err),
                    attempts: attempt,
                    elapsed_secs: started.elapsed().as_secs_f64(),
                });
            }
            tracing::warn!(op, key, attempt, delay_ms = delay.as_millis() as u64, error = %err, "retrying");
            tokio::time::sleep(delay).await;
        }
    }
}

#[async_trait::async_trait]
impl Backend for RetryBackend {
    fn location(&self) -> String {
        self.inner.location()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.retry("list", prefix, || self.inner.list(prefix)).await
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes> {
        self.retry("get", key, || self.inner.get(key, range.clone()))
            .await
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        self.retry("put", key, || self.inner.put(key, data.clone()))
            .await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.retry("delete", key, || self.inner.delete(key)).await
    }
}
