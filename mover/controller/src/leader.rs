//! One leader at a time, on the Lease `mover-controller`, as client-go's leader election
//! does it, with one more guard.
//!
//! - **Taking the Lease.** A replica takes it when it is free, or when its record has
//!   not changed for a whole lease duration as *this* replica's clock measures it (the
//!   holder's `renewTime` is another node's clock, never compared with ours). Every
//!   write of the Lease carries the resourceVersion it read: of two replicas taking it
//!   at once, one gets a conflict.
//! - **Holding it.** The leader renews every `retry`. It is the leader until
//!   `renew_deadline` after it *sent* its last successful renewal; the deadline is
//!   shorter than the lease duration, so it stops before any standby may take over,
//!   whatever delayed it (a partition, a long pause, SIGSTOP).
//! - **The guard.** Stopping the reconcilers is not enough: a replica paused past its
//!   deadline wakes with every timer due, its reconcilers included. So every write to
//!   the API server ([`gate`]) and every agent call checks [`Leadership::leading`] when
//!   it is made: past the deadline it is refused in this process, before it leaves.
//!   (A write sent in time but delayed in the network past the deadline is the one case
//!   left; the margin, a third of the lease duration by default, covers it as far as
//!   client-go's does.)

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::api::{Api, ObjectMeta, PostParams};
use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

/// The Lease's name.
pub const LEASE: &str = "mover-controller";

/// Whether this replica may act now.
#[derive(Debug)]
pub struct Leadership {
    start: Instant,
    /// Milliseconds after `start` until which this replica leads; 0: it does not.
    until_ms: AtomicU64,
}

impl Leadership {
    /// A replica that does not lead (yet).
    pub fn follower() -> Arc<Leadership> {
        Arc::new(Leadership {
            start: Instant::now(),
            until_ms: AtomicU64::new(0),
        })
    }

    /// A replica that always leads (`--no-leader-election`: the only one).
    pub fn sole() -> Arc<Leadership> {
        Arc::new(Leadership {
            start: Instant::now(),
            until_ms: AtomicU64::new(u64::MAX),
        })
    }

    /// Whether this replica leads at this instant.
    pub fn leading(&self) -> bool {
        !self.remaining().is_zero()
    }

    /// How long it still leads without another renewal.
    pub fn remaining(&self) -> Duration {
        let until = self.until_ms.load(SeqCst);
        Duration::from_millis(until.saturating_sub(self.start.elapsed().as_millis() as u64))
    }

    /// Leads until `deadline` (never shortened by a renewal that returns late).
    fn lead_until(&self, deadline: Instant) {
        let ms = deadline.saturating_duration_since(self.start).as_millis() as u64;
        self.until_ms.fetch_max(ms, SeqCst);
    }

    /// Leads no more.
    fn resign(&self) {
        self.until_ms.store(0, SeqCst);
    }
}

/// How long the Lease holds and how the leader keeps it.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// A standby takes the Lease once its record has not changed for this long.
    pub lease: Duration,
    /// The leader stops this long after sending its last successful renewal.
    pub renew_deadline: Duration,
    /// Between two attempts to take or renew it.
    pub retry: Duration,
}

impl Timing {
    /// client-go's proportions (15 s, 10 s, 2 s) for a lease of `lease`.
    pub fn for_lease(lease: Duration) -> Timing {
        Timing {
            lease,
            renew_deadline: lease * 2 / 3,
            retry: (lease * 2 / 15).max(Duration::from_millis(100)),
        }
    }
}

/// Takes and keeps the Lease for one replica.
pub struct Elector {
    api: Api<Lease>,
    identity: String,
    timing: Timing,
    leadership: Arc<Leadership>,
    /// The Lease's resourceVersion as last seen held by another, and when it was seen
    /// to change.
    observed: Option<(Option<String>, Instant)>,
}

impl Elector {
    /// The elector of `identity` on the Lease in `namespace`, granting `leadership`
    /// (which the gates check); `client` must not be gated by it.
    pub fn new(
        client: kube::Client,
        namespace: &str,
        identity: String,
        timing: Timing,
        leadership: Arc<Leadership>,
    ) -> Self {
        Elector {
            api: Api::namespaced(client, namespace),
            identity,
            timing,
            leadership,
            observed: None,
        }
    }

    /// Returns once this replica leads.
    pub async fn acquire(&mut self) {
        let mut logged = false;
        loop {
            match self.try_once().await {
                Ok(true) => return,
                Ok(false) => {}
                Err(e) if !logged => {
                    tracing::warn!(error = %e, "cannot read or write the Lease {LEASE}; retrying");
                    logged = true;
                }
                Err(_) => {}
            }
            tokio::time::sleep(self.timing.retry).await;
        }
    }

    /// Renews the Lease until it cannot within the renew deadline, or another replica
    /// holds it; returns then, leading no more.
    pub async fn hold(&mut self) {
        loop {
            tokio::time::sleep(self.timing.retry).await;
            let left = self.leadership.remaining();
            if left.is_zero() {
                tracing::error!(
                    "the Lease was not renewed within {:?}: no longer leading",
                    self.timing.renew_deadline
                );
                break;
            }
            match tokio::time::timeout(left, self.try_once()).await {
                Ok(Ok(true)) => {}
                Ok(Ok(false)) => {
                    tracing::error!(
                        "another replica holds the Lease, or it could not be renewed in time: \
                         no longer leading"
                    );
                    break;
                }
                Ok(Err(e)) => tracing::warn!(error = %e, left = ?left, "cannot renew the Lease"),
                Err(_) => {}
            }
        }
        self.leadership.resign();
    }

    /// Gives the Lease up (on shutdown), so a standby takes it at once.
    pub async fn release(&mut self) {
        if !self.leadership.leading() {
            return;
        }
        self.leadership.resign();
        let Ok(Some(mut lease)) = self.api.get_opt(LEASE).await else {
            return;
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(&self.identity) {
            return;
        }
        spec.holder_identity = None;
        match self
            .api
            .replace(LEASE, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => tracing::info!("released the Lease"),
            Err(e) => tracing::warn!(error = %e, "cannot release the Lease"),
        }
    }

    /// One attempt to take or renew the Lease: true if this replica holds it now.
    async fn try_once(&mut self) -> Result<bool, kube::Error> {
        let sent = Instant::now();
        let lease_secs = self.timing.lease.as_secs().max(1) as i32;
        let now = Some(MicroTime(Timestamp::now()));
        let Some(mut lease) = self.api.get_opt(LEASE).await? else {
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(LEASE.into()),
                    ..Default::default()
                },
                spec: Some(LeaseSpec {
                    holder_identity: Some(self.identity.clone()),
                    lease_duration_seconds: Some(lease_secs),
                    acquire_time: now.clone(),
                    renew_time: now,
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return self.written(self.api.create(&PostParams::default(), &lease).await, sent);
        };
        let spec = lease.spec.get_or_insert_with(Default::default);
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let mine = holder.as_deref() == Some(&self.identity);
        if let Some(other) = holder.as_deref().filter(|_| !mine) {
            let version = lease.metadata.resource_version.clone();
            let seen_since = match &self.observed {
                Some((v, at)) if *v == version => *at,
                _ => {
                    let now = Instant::now();
                    self.observed = Some((version, now));
                    now
                }
            };
            let their = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(0).max(0) as u64)
                .max(self.timing.lease);
            if seen_since.elapsed() < their {
                self.leadership.resign();
                return Ok(false);
            }
            tracing::info!(
                holder = other,
                "the Lease has not been renewed for {their:?}: taking it"
            );
        }
        // A read that came back after the deadline (this process was paused, or the
        // API server slow) says nothing about now: nothing is written on it.
        if sent.elapsed() >= self.timing.renew_deadline {
            return Ok(false);
        }
        if !mine {
            spec.acquire_time = now.clone();
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
        }
        spec.holder_identity = Some(self.identity.clone());
        spec.lease_duration_seconds = Some(lease_secs);
        spec.renew_time = now;
        // The resourceVersion read above is kept: a write racing ours conflicts.
        self.written(
            self.api
                .replace(LEASE, &PostParams::default(), &lease)
                .await,
            sent,
        )
    }

    /// The outcome of a write of the Lease sent at `sent`.
    fn written(&self, r: Result<Lease, kube::Error>, sent: Instant) -> Result<bool, kube::Error> {
        match r {
            Ok(_) => {
                self.leadership
                    .lead_until(sent + self.timing.renew_deadline);
                Ok(true)
            }
            // Another replica wrote it first.
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// A layer for the API client of everything that acts as the leader: each request that
/// is not a read is refused (in this process, before it is sent) unless `leadership`
/// leads at that instant.
pub fn gate(
    leadership: Arc<Leadership>,
) -> tower::filter::FilterLayer<
    impl Fn(
        http::Request<kube::client::Body>,
    ) -> Result<http::Request<kube::client::Body>, tower::BoxError>
    + Clone,
> {
    tower::filter::FilterLayer::new(move |req: http::Request<kube::client::Body>| {
        let read = matches!(*req.method(), http::Method::GET | http::Method::HEAD);
        if read || leadership.leading() {
            Ok(req)
        } else {
            Err(NotLeading {
                method: req.method().clone(),
                uri: req.uri().path().to_string(),
            }
            .into())
        }
    })
}

/// A write refused by [`gate`].
#[derive(Debug, thiserror::Error)]
#[error(
    "{method} {uri} refused: this controller replica no longer holds the Lease {LEASE} (it could not renew it in time); another replica acts now"
)]
pub struct NotLeading {
    method: http::Method,
    uri: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_renew_deadline_falls_before_a_standby_may_take_over() {
        for secs in [2, 15, 60] {
            let t = Timing::for_lease(Duration::from_secs(secs));
            assert!(t.renew_deadline < t.lease, "{t:?}");
            assert!(t.retry * 2 <= t.renew_deadline, "two renewals fit: {t:?}");
        }
        let t = Timing::for_lease(Duration::from_secs(15));
        assert_eq!(
            (t.renew_deadline, t.retry),
            (Duration::from_secs(10), Duration::from_secs(2))
        );
    }

    #[test]
    fn leadership_ends_at_its_deadline_and_a_late_renewal_never_shortens_it() {
        let l = Leadership::follower();
        assert!(!l.leading());
        l.lead_until(Instant::now() + Duration::from_secs(60));
        assert!(l.leading());
        l.lead_until(Instant::now() + Duration::from_secs(1));
        assert!(l.remaining() > Duration::from_secs(50));
        l.resign();
        assert!(!l.leading());
        l.lead_until(Instant::now());
        assert!(!l.leading(), "a deadline now is past");
        assert!(Leadership::sole().leading());
    }

    #[tokio::test]
    async fn the_gate_lets_reads_through_always_and_writes_only_while_leading() {
        use tower::{Layer, ServiceExt};
        let leadership = Leadership::follower();
        let sent = Arc::new(AtomicU64::new(0));
        let counted = sent.clone();
        let server = tower::service_fn(move |_req: http::Request<kube::client::Body>| {
            counted.fetch_add(1, SeqCst);
            async { Ok::<_, tower::BoxError>(http::Response::new(())) }
        });
        let service = gate(leadership.clone()).layer(server);
        let request = |method: http::Method| {
            http::Request::builder()
                .method(method)
                .uri("/apis/replication.mover/v1alpha1/namespaces/app/volumereplications/data/status")
                .body(kube::client::Body::empty())
                .unwrap()
        };
        let get = service.clone().oneshot(request(http::Method::GET)).await;
        assert!(get.is_ok());
        let patch = service.clone().oneshot(request(http::Method::PATCH)).await;
        let refused = patch.expect_err("a write while not leading was sent");
        assert!(
            refused.to_string().contains("no longer holds the Lease"),
            "{refused}"
        );
        assert_eq!(sent.load(SeqCst), 1, "the refused write reached the server");
        leadership.lead_until(Instant::now() + Duration::from_secs(60));
        assert!(
            service
                .clone()
                .oneshot(request(http::Method::PATCH))
                .await
                .is_ok()
        );
        leadership.resign();
        assert!(
            service
                .oneshot(request(http::Method::DELETE))
                .await
                .is_err()
        );
        assert_eq!(sent.load(SeqCst), 2);
    }
}
