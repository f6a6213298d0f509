//! A backend wrapper that injects failures and counts operations, for tests.

use super::{Backend, ObjectInfo};
use crate::error::{RepoError, Result};
use bytes::Bytes;
use std::{
    collections::VecDeque,
    ops::Range,
    sync::{Arc, Mutex},
    time::Duration,
};

/// One injected failure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Fail with this HTTP status (5xx is retryable, 4xx is not), doing nothing.
    Status(u16),
    /// Stall this long before doing the operation (a slow or hung server).
    Delay(Duration),
}

/// Operations seen by a [`FaultBackend`], failed or not.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpCounts {
    /// `list` calls.
    pub list: u64,
    /// `get` calls.
    pub get: u64,
    /// `put` calls.
    pub put: u64,
    /// `delete` calls.
    pub delete: u64,
    /// Bytes passed to successful `put`s.
    pub put_bytes: u64,
    /// Calls that got an injected fault.
    pub faults: u64,
}

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<Fault>,
    always: Option<Fault>,
    counts: OpCounts,
}

/// Wraps a backend: the next calls get the queued faults, then every call gets the
/// `always` fault if set, and all calls are counted.
#[derive(Debug)]
pub struct FaultBackend {
    inner: Arc<dyn Backend>,
    state: Mutex<State>,
}

impl FaultBackend {
    /// Wraps `inner` with no faults.
    pub fn new(inner: Arc<dyn Backend>) -> Self {
        FaultBackend {
            inner,
            state: Mutex::default(),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues faults for the next calls, in order.
    pub fn push(&self, faults: impl IntoIterator<Item = Fault>) {
        self.state().queue.extend(faults);
    }

    /// Drops the queued faults and sets (or clears) a fault for every call.
    pub fn set_always(&self, fault: Option<Fault>) {
        let mut s = self.state();
        s.queue.clear();
        s.always = fault;
    }

    /// The operations seen so far.
    pub fn counts(&self) -> OpCounts {
        self.state().counts
    }

    async fn before(&self, op: &'static str, key: &str) -> Result<()> {
        let fault = {
            let mut s = self.state();
            match op {
                "list" => s.counts.list += 1,
                "get" => s.counts.get += 1,
                "put" => s.counts.put += 1,
                _ => s.counts.delete += 1,
            }
            let f = s.queue.pop_front().or_else(|| s.always.clone());
            if f.is_some() {
                s.counts.faults += 1;
            }
            f
        };
        match fault {
            None => Ok(()),
            Some(Fault::Delay(d)) => {
                tokio::time::sleep(d).await;
                Ok(())
            }
            Some(Fault::Status(code)) => Err(RepoError::Backend {
                location: self.inner.location(),
                op,
                key: key.into(),
                retryable: code >= 500 || code == 429,
                detail: format!("injected HTTP {code}"),
            }),
        }
    }
}

#[async_trait::async_trait]
impl Backend for FaultBackend {
    fn location(&self) -> String {
        self.inner.location()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        self.before("list", prefix).await?;
        self.inner.list(prefix).await
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes> {
        self.before("get", key).await?;
        self.inner.get(key, range).await
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        self.before("put", key).await?;
        let n = data.len() as u64;
        self.inner.put(key, data).await?;
        self.state().counts.put_bytes += n;
        Ok(())
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.before("delete", key).await?;
        self.inner.delete(key).await
    }
}
