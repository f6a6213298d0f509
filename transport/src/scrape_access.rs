//! Who may read an agent's or the controller's /metrics. Outside Kubernetes, anyone who
//! reaches the port (the agent's `metrics_access = "open"`, the default: bind
//! `metrics_listen` to where only the scraper reaches). Under Kubernetes
//! (`"kubernetes"`; the controller's `--metrics-access kubernetes`), the port is on the
//! node's or pod's address, so the caller must present a bearer token that the API
//! server authenticates (TokenReview) and authorizes for `get` on the non-resource URL
//! `/metrics` (SubjectAccessReview), as kube-rbac-proxy does: a scraper's
//! ServiceAccount bound to ClusterRole `mover-metrics-reader`. The reviews go through a
//! [`Reviewer`] (the controller crate's, which speaks Kubernetes), so neither this crate
//! nor the agent's depends on kube. /healthz stays open: the kubelet's probe has no
//! token.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::codegen::http;

/// What the API server said of a token.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Authenticated and allowed to get /metrics.
    Allowed,
    /// Not a token the API server knows (or an expired one).
    Unauthenticated,
    /// Authenticated as this user, who may not get /metrics.
    Forbidden(String),
}

/// A future a [`Reviewer`] answers with; `Err`: the API server could not be asked.
pub type ReviewFuture<'a> = Pin<Box<dyn Future<Output = Result<Verdict, String>> + Send + 'a>>;

/// Who reviews a scraper's token.
pub trait Reviewer: Send + Sync {
    /// Whether the holder of `token` may get `/metrics`.
    fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a>;
}

/// How long a verdict is reused: a scraper calls every 15-60 s, and one review each time
/// would be two API requests per node per scrape.
const REMEMBER: Duration = Duration::from_secs(60);
/// Verdicts kept at most (then all are forgotten): a flood of made-up tokens cannot
/// grow the cache without bound.
const MAX_REMEMBERED: usize = 1024;

/// Lets a /metrics request through, or says why not (an HTTP status and a text that
/// says what to do).
pub struct Gate {
    reviewer: Arc<dyn Reviewer>,
    /// BLAKE3 of a token (the token itself is not kept) → verdict and when it was given.
    seen: Mutex<HashMap<[u8; 32], (Verdict, Instant)>>,
}

impl Gate {
    /// A gate whose tokens `reviewer` checks.
    pub fn new(reviewer: Arc<dyn Reviewer>) -> Gate {
        Gate {
            reviewer,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// `authorization`: the request's Authorization header, if any.
    pub async fn admit(&self, authorization: Option<&str>) -> Result<(), (u16, String)> {
        const HOW: &str = "present a bearer token of a ServiceAccount bound to ClusterRole \
                           mover-metrics-reader (deploy/README.md, \"Metrics\")";
        let Some(token) = authorization
            .and_then(|h| h.strip_prefix("Bearer "))
            .map(str::trim)
            .filter(|t| !t.is_empty())
        else {
            return Err((401, format!("/metrics needs authentication: {HOW}\n")));
        };
        let key = *blake3::hash(token.as_bytes()).as_bytes();
        let known = {
            let seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            seen.get(&key)
                .filter(|(_, at)| at.elapsed() < REMEMBER)
                .map(|(v, _)| v.clone())
        };
        let verdict = match known {
            Some(v) => v,
            None => {
                let v = self.reviewer.review(token).await.map_err(|e| {
                    (
                        503,
                        format!("cannot check the token with the API server: {e}\n"),
                    )
                })?;
                let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
                if seen.len() >= MAX_REMEMBERED {
                    seen.clear();
                }
                seen.insert(key, (v.clone(), Instant::now()));
                v
            }
        };
        match verdict {
            Verdict::Allowed => Ok(()),
            Verdict::Unauthenticated => Err((
                401,
                format!("the API server does not know this token (expired?): {HOW}\n"),
            )),
            Verdict::Forbidden(user) => Err((
                403,
                format!(
                    "{user} may not get /metrics: bind it to ClusterRole mover-metrics-reader\n"
                ),
            )),
        }
    }
}

/// The answer to a /metrics request with `headers`, as an HTTP status and body:
/// `render()` if `gate` (none: open to all) lets its Authorization header through.
pub async fn answer(
    gate: Option<&Gate>,
    headers: &http::HeaderMap,
    render: impl FnOnce() -> String,
) -> (http::StatusCode, String) {
    let authorization = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    let verdict = match gate {
        Some(g) => g.admit(authorization).await,
        None => Ok(()),
    };
    match verdict {
        Ok(()) => (http::StatusCode::OK, render()),
        Err((status, why)) => (
            http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::FORBIDDEN),
            why,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Knows one token of each kind and counts the reviews it was asked for.
    struct Known(AtomicUsize);

    impl Reviewer for Known {
        fn review<'a>(&'a self, token: &'a str) -> ReviewFuture<'a> {
            self.0.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                match token {
                    "prometheus" => Ok(Verdict::Allowed),
                    "tenant" => Ok(Verdict::Forbidden("system:serviceaccount:t1:app".into())),
                    "down" => Err("connection refused".into()),
                    _ => Ok(Verdict::Unauthenticated),
                }
            })
        }
    }

    #[tokio::test]
    async fn a_scraper_needs_a_token_the_api_server_allows() {
        let reviewer = Arc::new(Known(AtomicUsize::new(0)));
        let gate = Gate::new(reviewer.clone());
        let status = |r: Result<(), (u16, String)>| r.err().map(|(s, _)| s);
        assert_eq!(status(gate.admit(None).await), Some(401));
        assert_eq!(status(gate.admit(Some("Basic eDp5")).await), Some(401));
        assert_eq!(status(gate.admit(Some("Bearer ")).await), Some(401));
        assert_eq!(status(gate.admit(Some("Bearer forged")).await), Some(401));
        let forbidden = gate.admit(Some("Bearer tenant")).await.unwrap_err();
        assert_eq!(forbidden.0, 403);
        assert!(
            forbidden.1.contains("system:serviceaccount:t1:app may not"),
            "{}",
            forbidden.1
        );
        assert_eq!(status(gate.admit(Some("Bearer down")).await), Some(503));
        assert_eq!(gate.admit(Some("Bearer prometheus")).await, Ok(()));
        // Reviewed once a minute per token, not per scrape; an API server that did not
        // answer is asked again.
        let asked = reviewer.0.load(Ordering::SeqCst);
        assert_eq!(gate.admit(Some("Bearer prometheus")).await, Ok(()));
        assert_eq!(status(gate.admit(Some("Bearer tenant")).await), Some(403));
        assert_eq!(reviewer.0.load(Ordering::SeqCst), asked);
        assert_eq!(status(gate.admit(Some("Bearer down")).await), Some(503));
        assert_eq!(reviewer.0.load(Ordering::SeqCst), asked + 1);
    }
}
