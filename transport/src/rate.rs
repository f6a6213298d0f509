use std::time::{Duration, Instant};
use tokio::sync::Mutex;

/// A token bucket: at most `rate` bytes per second on average over any span from the
/// start, with bursts of up to one second's worth after idle time. It starts empty: a
/// full bucket at the start let a transfer run a second's worth over its limit (200 MiB
/// at 20 MiB/s took 9.1 s, not 10). Shared by all streams of a transfer.
pub struct RateLimiter {
    rate: f64,
    state: Mutex<(f64, Instant)>,
}

impl RateLimiter {
    /// A limiter of `bytes_per_sec` (must be > 0).
    pub fn new(bytes_per_sec: u64) -> Self {
        let rate = bytes_per_sec.max(1) as f64;
        RateLimiter {
            rate,
            state: Mutex::new((0.0, Instant::now())),
        }
    }

    /// Waits until `bytes` may be sent.
    pub async fn take(&self, bytes: u64) {
        let wait = {
            let mut s = self.state.lock().await;
            let now = Instant::now();
            let (tokens, last) = &mut *s;
            *tokens =
                (*tokens + now.duration_since(*last).as_secs_f64() * self.rate).min(self.rate);
            *last = now;
            *tokens -= bytes as f64;
            // In debt: wait until the bucket is back at zero.
            (*tokens < 0.0).then(|| Duration::from_secs_f64(-*tokens / self.rate))
        };
        if let Some(d) = wait {
            tokio::time::sleep(d).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn limits_the_average_rate() {
        let limiter = RateLimiter::new(10 << 20); // 10 MiB/s
        let start = Instant::now();
        for _ in 0..30 {
            limiter.take(1 << 20).await;
        }
        // 30 MiB at 10 MiB/s: 3 s at the least, never faster than the limit on average
        // (the last MiB is taken once 29 have been earned: 2.9 s).
        let took = start.elapsed().as_secs_f64();
        assert!((2.9..3.6).contains(&took), "took {took}s");
        // After a second idle, a second's worth goes at once, and no more.
        tokio::time::sleep(Duration::from_millis(1100)).await;
        let burst = Instant::now();
        for _ in 0..10 {
            limiter.take(1 << 20).await;
        }
        assert!(burst.elapsed().as_secs_f64() < 0.2);
        limiter.take(5 << 20).await;
        assert!(burst.elapsed().as_secs_f64() >= 0.45);
    }
}
