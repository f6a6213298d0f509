//! How calls to an agent fail and are retried: gRPC statuses as [`CopyError`]s, the
//! retry policy with backoff, and the timing of a finished transfer.

use super::AgentUrl;
use crate::error::{CopyError, RemoteCode};
use std::time::Duration;

/// Stamps a finished transfer's wall time and throughput.
pub(crate) fn timed(
    mut sum: crate::CopySummary,
    started: std::time::Instant,
) -> crate::CopySummary {
    sum.duration_secs = started.elapsed().as_secs_f64();
    sum.throughput_bytes_per_sec = sum.volume_bytes as f64 / sum.duration_secs.max(1e-9);
    sum
}

/// The whole chain of an error's sources, for transport errors that hide the cause.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s += &format!(": {c}");
        cur = c.source();
    }
    s
}

/// Maps a gRPC status from `url` to a [`CopyError`] that says what to do.
pub fn status_error(url: &AgentUrl, s: tonic::Status) -> CopyError {
    use tonic::Code;
    let code = match s.code() {
        Code::Unauthenticated => RemoteCode::Unauthenticated,
        Code::PermissionDenied => RemoteCode::PermissionDenied,
        Code::NotFound => RemoteCode::NotFound,
        Code::AlreadyExists => RemoteCode::Exists,
        Code::FailedPrecondition => RemoteCode::Refused,
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Aborted => {
            RemoteCode::Unavailable
        }
        Code::DeadlineExceeded => RemoteCode::Timeout,
        Code::InvalidArgument | Code::OutOfRange => RemoteCode::BadRequest,
        _ => RemoteCode::Error,
    };
    let refusal = transport::refusal::Refusal::of(&s);
    let mut message = s.message().to_string();
    if let Some(src) = std::error::Error::source(&s) {
        message += &format!(" ({})", error_chain(src));
    }
    if let Some(hint) = tls_hint(&s) {
        // Not retried: every attempt would meet the same TLS server.
        return CopyError::Remote {
            url: url.to_string(),
            code: RemoteCode::Refused,
            message: format!("{hint} ({message})"),
            refusal,
        };
    }
    CopyError::Remote {
        url: url.to_string(),
        code,
        message,
        refusal,
    }
}

/// What a plaintext client's error means when the agent speaks TLS: the server's TLS
/// record, read as an HTTP/2 frame, has an impossible size.
pub fn tls_hint(s: &tonic::Status) -> Option<&'static str> {
    transport::tls::is_plaintext_to_tls(s).then_some(
        "the agent requires TLS (it answered in TLS, not plaintext HTTP/2): pass --tls-ca, \
         --tls-cert and --tls-key (or MOVER_TLS_CA, MOVER_TLS_CERT, MOVER_TLS_KEY)",
    )
}

/// The retry policy of every transfer: up to `retries` attempts while the error is
/// retryable, backing off 0.5 s, 1 s, 2 s … (at most 10 s) between them.
pub(crate) struct Backoff {
    retries: u32,
    delay: Duration,
}

impl Backoff {
    pub(crate) fn new(retries: u32) -> Self {
        Backoff {
            retries: retries.max(1),
            delay: Duration::from_millis(500),
        }
    }

    /// After attempt `n` failed with `e`: how long to wait before the next one, or
    /// `None` to give up.
    pub(crate) fn after(&mut self, n: u32, e: &CopyError) -> Option<Duration> {
        if !e.is_retryable() || n >= self.retries {
            return None;
        }
        let wait = self.delay;
        tracing::warn!("attempt {n} failed: {e}; retrying in {wait:?}");
        self.delay = (self.delay * 2).min(Duration::from_secs(10));
        Some(wait)
    }
}

/// Runs `attempt` until it succeeds or [`Backoff`] gives up.
pub(crate) async fn with_retries<T, F, Fut>(retries: u32, mut attempt: F) -> Result<T, CopyError>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<T, CopyError>>,
{
    let mut backoff = Backoff::new(retries);
    for n in 1.. {
        match attempt(n).await {
            Err(e) => match backoff.after(n, &e) {
                Some(wait) => tokio::time::sleep(wait).await,
                None => return Err(e),
            },
            done => return done,
        }
    }
    unreachable!("the loop returns")
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::Code;

    #[test]
    fn statuses_map_to_the_words_they_always_printed() {
        let url = AgentUrl::parse("agent://b:7070/v").unwrap().unwrap();
        for (status, word) in [
            (Code::Unauthenticated, "unauthenticated"),
            (Code::PermissionDenied, "permission denied"),
            (Code::NotFound, "not found"),
            (Code::AlreadyExists, "exists"),
            (Code::FailedPrecondition, "refused"),
            (Code::Unavailable, "unavailable"),
            (Code::Unknown, "unavailable"),
            (Code::Cancelled, "unavailable"),
            (Code::Aborted, "unavailable"),
            (Code::DeadlineExceeded, "timeout"),
            (Code::InvalidArgument, "bad request"),
            (Code::OutOfRange, "bad request"),
            (Code::Internal, "error"),
            (Code::ResourceExhausted, "error"),
            (Code::Unimplemented, "error"),
            (Code::DataLoss, "error"),
        ] {
            let e = status_error(&url, tonic::Status::new(status, "m"));
            let CopyError::Remote { code, message, .. } = &e else {
                panic!("{status:?}: not a remote error: {e}");
            };
            assert_eq!(code.to_string(), word, "{status:?}");
            assert_eq!(message, "m");
            assert!(
                e.to_string()
                    .starts_with(&format!("agent agent://b:7070/v: {word}: m")),
                "{e}"
            );
        }
    }
}
