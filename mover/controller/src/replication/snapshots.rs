//! VolumeReplications whose class targets a snapshot repository: a schedule of scheduled
//! snapshots on the agent holding the volume (interval, retention and prune from the
//! class, password and S3 keys from the class's secret), reported as a primary that is
//! replicating: lastSyncTime is the last snapshot's time.

use super::desired::{Desired, RepositoryTarget};
use super::status::{self, Conditions, Health};
use crate::context::Context;
use crate::crd::{ReplicationState, State, VolumeReplicationStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use std::time::Duration;
use transport::schedule;

/// Secret key: the repository password.
pub const SECRET_PASSWORD: &str = "password";
/// Secret key: a raw repository key instead of a password.
pub const SECRET_KEY: &str = "key";
/// Secret keys: S3 credentials.
pub const SECRET_S3_KEYS: [&str; 2] = ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"];

/// The schedule a repository target wants, its access left out.
pub fn schedule_spec(d: &Desired, repo: &RepositoryTarget) -> schedule::Spec {
    let [last, hourly, daily, weekly, monthly] = repo.keep;
    schedule::Spec {
        name: d.name.clone(),
        volume: d.volume.clone(),
        repository: repo.url.clone(),
        schedule: format!("{}s", d.params.interval.as_secs()),
        keep: Some(schedule::Keep {
            last,
            hourly,
            daily,
            weekly,
            monthly,
        }),
        prune_every: repo.prune_every,
        snapshot_name: d.name.clone(),
        access: None,
        access_version: String::new(),
        require_point_in_time: d.params.require_point_in_time,
    }
}

/// Reconciles a VolumeReplication whose class targets a repository.
#[allow(clippy::too_many_arguments)]
pub async fn reconcile(
    ctx: &Context,
    d: &Desired,
    repo: &RepositoryTarget,
    state: ReplicationState,
    mut st: VolumeReplicationStatus,
    generation: i64,
    kind: &str,
    now: Time,
) -> (VolumeReplicationStatus, Option<Duration>) {
    // Promoted already: a failure now is trouble of the schedule, not a failed promotion.
    let done = status::completed(&st, state);
    let mut c = Conditions::new(&mut st.conditions, generation, kind, now.clone());
    if state != ReplicationState::Primary {
        let detail = format!(
            "the class sends snapshots to the repository {}: there is no secondary to \
             become; restore a snapshot with `mover snapshot restore` or `mover hydrate \
             start --from-snapshot`, or set replicationState primary",
            repo.url
        );
        c.failed_validation(state, "unsupported replicationState", &detail);
        c.remove(status::types::REPLICATING);
        st.state = Some(st.state.unwrap_or(State::Unknown));
        st.message = Some(format!("unsupported replicationState: {detail}"));
        return (st, None);
    }
    c.validated();
    let want = |access_version| schedule::Spec {
        access_version,
        ..schedule_spec(d, repo)
    };
    // The secret is read on every look (one request): a rotated password or S3 key
    // reaches the agent at the next look, told by the secret's version.
    let result = match access(ctx, d, repo).await {
        Err(e) => Err((status::reasons::ERROR, e)),
        Ok((access, version)) => match ctx.agents.schedule(&d.agent, &d.name).await {
            Err(e) => Err((super::status::agent_reason(&e), e.to_string())),
            Ok(Some(s)) if s.spec.as_ref() == Some(&want(version.clone())) => Ok(s),
            Ok(_) => {
                let spec = schedule::Spec {
                    access: Some(access),
                    ..want(version)
                };
                ctx.agents
                    .apply_schedule(&d.agent, spec)
                    .await
                    .map_err(|e| (super::status::agent_reason(&e), e.to_string()))
            }
        },
    };
    match result {
        Ok(s) => {
            c.promoted();
            let (health, detail) =
                if s.schedule_state() == Some(transport::states::ScheduleState::Failing) {
                    (
                        Health::Degraded,
                        format!("snapshots failing: {}", s.last_error),
                    )
                } else {
                    (Health::Healthy, format!("snapshots to {}", repo.url))
                };
            c.replicating(health, &detail);
            c.consistency(&s.consistency, &s.last_error, s.no_point_in_time);
            report(&mut st, &s, &repo.url);
            st.state = Some(State::Primary);
            st.message = Some(status::marked(state));
            st.last_completion_time = Some(now);
            (st, Some(d.params.interval))
        }
        Err((reason, e)) if done => {
            c.trouble(reason, &e, true);
            (
                st,
                Some(d.params.interval.min(crate::context::TROUBLE_RETRY)),
            )
        }
        Err((_, e)) => {
            c.failed_promotion("failed to promote volume", &e);
            c.replicating(Health::Unknown, &e);
            st.state = Some(st.state.unwrap_or(State::Unknown));
            st.message = Some(e);
            (st, None)
        }
    }
}

/// The repository's password and S3 keys, from the class's secret, and the secret's
/// version (uid/resourceVersion).
async fn access(
    ctx: &Context,
    d: &Desired,
    repo: &RepositoryTarget,
) -> Result<(schedule::Access, String), String> {
    let (ns, name) =
        d.params.secret.clone().ok_or_else(|| {
            "the class names no secret with the repository's password".to_string()
        })?;
    let what = format!(
        "the repository's `{SECRET_PASSWORD}` (or a raw `{SECRET_KEY}`) and, for S3, {} and {}",
        SECRET_S3_KEYS[0], SECRET_S3_KEYS[1]
    );
    let (data, version) = crate::context::secret_data(ctx, &ns, &name, &what).await?;
    let get = |k: &str| data.get(k).cloned();
    let text = |k: &str| get(k).map(|v| String::from_utf8_lossy(&v).trim().to_string());
    let (password, raw_key) = match (get(SECRET_PASSWORD), get(SECRET_KEY)) {
        (Some(p), _) => (p.trim_ascii().to_vec(), false),
        (None, Some(k)) => (k, true),
        (None, None) => {
            return Err(format!(
                "secret {ns}/{name} has no `{SECRET_PASSWORD}` (or `{SECRET_KEY}`): the agent \
                 could not open the repository"
            ));
        }
    };
    if password.is_empty() {
        return Err(format!("secret {ns}/{name}: `{SECRET_PASSWORD}` is empty"));
    }
    let access = schedule::Access {
        password,
        raw_key,
        s3_endpoint: repo.s3_endpoint.clone(),
        s3_region: repo.s3_region.clone(),
        s3_access_key_id: text(SECRET_S3_KEYS[0]).unwrap_or_default(),
        s3_secret_access_key: text(SECRET_S3_KEYS[1]).unwrap_or_default(),
    };
    Ok((access, version))
}

/// The last snapshot as the last sync: its time, duration, bytes stored (the RPO
/// follows from its time: see `reconcile::decide`).
fn report(st: &mut VolumeReplicationStatus, s: &schedule::Status, url: &str) {
    st.destination_volume_id = Some(url.to_string());
    st.progress = None;
    st.last_sync_consistency = status::last_sync_consistency(&s.consistency);
    if s.last_time_ms > 0 {
        st.last_sync_time = Some(status::time_ms(s.last_time_ms));
        st.last_sync_duration = Some(status::go_duration(Duration::from_millis(
            s.last_duration_ms,
        )));
        st.last_sync_bytes = Some(s.last_bytes_added as i64);
    }
}
