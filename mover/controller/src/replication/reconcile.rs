//! Reconciling one `VolumeReplication`: a finalizer, the desired relationship from the
//! watch caches, the agent calls it takes, and the status written back by server-side
//! apply (field manager `mover`) with `observedGeneration = metadata.generation`.
//!
//! The flow follows csi-addons' VolumeReplication controller state by state, so the
//! conditions RamenDR waits for come in the same order.

use super::desired::{self, Desired, Inputs};
use super::status::{self, Conditions, Health};
use crate::agents::{AgentError, Agents};
use crate::crd::{
    self, RelationshipRef, ReplicationState, State, VolumeReplication, VolumeReplicationStatus,
};
use crate::leftovers::Leftover;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::finalizer::{Event as Finalizer, finalizer};
use kube::runtime::reflector::ObjectRef;
use kube::{Resource, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use transport::control;
use transport::states::{RelationshipState, Side};

pub use crate::context::{Caches, Context, TROUBLE_RETRY};
use crate::context::{owned, secret_data, typed};

/// Held on every VolumeReplication the controller set up, until its relationship is
/// deleted from the agent.
pub const FINALIZER: &str = "replication.mover/relationship";
/// The field manager of status writes.
pub const FIELD_MANAGER: &str = "mover";
/// How soon a resource that could not be acted on is looked at again.
pub const RETRY: Duration = Duration::from_secs(30);
/// When a deletion whose agent did not answer is retried.
pub const DELETE_RETRY: Duration = Duration::from_secs(5);

/// Why a reconcile failed (it is retried).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The API server refused or could not be reached.
    #[error("Kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    /// Adding or removing the finalizer, or the reconcile inside it, failed.
    #[error("{0}")]
    Finalizer(#[source] Box<kube::runtime::finalizer::Error<Error>>),
    /// The object does not have the VolumeReplication shape (the CRD is not mover's).
    #[error(
        "VolumeReplication {name}: unreadable: {source}; is the CRD mover's (mover controller crds)?"
    )]
    Parse {
        /// NAMESPACE/NAME.
        name: String,
        /// What serde said.
        source: serde_json::Error,
    },
    /// An agent call failed where the status cannot say it (cleanup).
    #[error(transparent)]
    Agent(#[from] AgentError),
}

/// Reconciles one VolumeReplication (the controller's entry point).
pub async fn reconcile(obj: Arc<DynamicObject>, ctx: Arc<Context>) -> Result<Action, Error> {
    ctx.metrics
        .reconciles
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let ns = obj.namespace().unwrap_or_else(|| "default".into());
    let api: Api<DynamicObject> = Api::namespaced_with(ctx.client.clone(), &ns, &ctx.vr_resource());
    finalizer(&api, FINALIZER, obj, |event| async {
        match event {
            Finalizer::Apply(o) => apply(&o, &ctx, &api).await,
            Finalizer::Cleanup(o) => cleanup(&o, &ctx).await,
        }
    })
    .await
    .map_err(|e| Error::Finalizer(Box::new(e)))
}

/// What to do after a failed reconcile: look again soon.
pub fn error_policy(obj: Arc<DynamicObject>, error: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics
        .failures
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    tracing::warn!(vr = %obj.name_any(), ns = ?obj.namespace(), %error, "reconcile failed");
    // A deletion waiting for its agent looks again soon: it ends within the deletion
    // grace and this.
    if obj.metadata.deletion_timestamp.is_some() {
        return Action::requeue(DELETE_RETRY);
    }
    Action::requeue(RETRY)
}

/// NAMESPACE/NAME, the metrics' key.
fn key(obj: &DynamicObject) -> String {
    format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
}

fn parse(obj: &DynamicObject) -> Result<VolumeReplication, Error> {
    typed(obj).map_err(|source| Error::Parse {
        name: format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any()),
        source,
    })
}

/// The PVC, its PV, the attachments and agent pods, from the caches.
struct Held {
    pvc: Option<Arc<PersistentVolumeClaim>>,
    pv: Option<Arc<PersistentVolume>>,
    attachments: Vec<VolumeAttachment>,
    agents: Vec<Pod>,
    nodes: Vec<Node>,
}

fn hold(vr: &VolumeReplication, ctx: &Context) -> Held {
    let ns = vr.namespace().unwrap_or_default();
    let pvc = ctx
        .caches
        .pvcs
        .get(&ObjectRef::new(&vr.spec.data_source.name).within(&ns));
    let pv = pvc
        .as_ref()
        .and_then(|c| c.spec.as_ref()?.volume_name.clone())
        .filter(|n| !n.is_empty())
        .and_then(|n| ctx.caches.pvs.get(&ObjectRef::new(&n)));
    // Attachments are read only for attached volumes: no copy otherwise.
    let attachments = if pv
        .as_ref()
        .is_some_and(|p| p.spec.as_ref().is_some_and(|s| s.csi.is_some()))
    {
        owned(&ctx.caches.attachments)
    } else {
        Vec::new()
    };
    let agents = owned(&ctx.caches.agents);
    let nodes = owned(&ctx.caches.nodes);
    Held {
        pvc,
        pv,
        attachments,
        agents,
        nodes,
    }
}

/// The desired relationship, or why not.
pub(crate) fn resolve(vr: &VolumeReplication, ctx: &Context) -> Result<Desired, desired::Invalid> {
    let class = ctx.class(&vr.spec.volume_replication_class);
    let held = hold(vr, ctx);
    let inputs = Inputs {
        class: class.as_ref(),
        pvc: held.pvc.as_deref(),
        pv: held.pv.as_deref(),
        attachments: &held.attachments,
        nodes: &held.nodes,
        agents: &held.agents,
        agent_port: ctx.agent_port,
    };
    desired::desired(vr, &inputs)
}

/// csi-addons' requeue for a primary: half the interval from two minutes up, so that
/// lastSyncTime keeps up with the storage.
fn info_interval(interval: Duration) -> Duration {
    if interval < Duration::from_secs(120) {
        interval
    } else {
        interval / 2
    }
}

fn now() -> Time {
    Time(k8s_openapi::jiff::Timestamp::now())
}

/// The state shown when an operation failed: the last one reached (csi-addons'
/// GetCurrentReplicationState).
fn current(status: &VolumeReplicationStatus) -> State {
    status.state.unwrap_or(State::Unknown)
}

async fn apply(
    obj: &DynamicObject,
    ctx: &Context,
    api: &Api<DynamicObject>,
) -> Result<Action, Error> {
    let vr = parse(obj)?;
    let (st, action) = decide(&vr, ctx, now()).await;
    // The RPO grows between cycles by itself; it is written when it moved by a whole
    // interval (a cycle is late), so a read RPO is never more than an interval stale.
    // One past its bound is written at once: Degraded and Replicating change with it.
    let rpo_step = ctx
        .class(&vr.spec.volume_replication_class)
        .and_then(|c| desired::class_params(&c).ok())
        .map_or(desired::DEFAULT_INTERVAL, |p| p.interval);
    if !status::unchanged(vr.status.as_ref(), &st, rpo_step) {
        tracing::debug!(vr = %key(obj), changed = ?status::changed_fields(vr.status.as_ref(), &st), "status write");
        write_status(api, &vr, &ctx.group, &st).await?;
        publish_transitions(ctx, obj, &vr, &st).await;
    }
    let state = match st.state.unwrap_or(State::Unknown) {
        State::Primary => "Primary",
        State::Secondary => "Secondary",
        State::Unknown => "Unknown",
    };
    ctx.metrics.observe(key(obj), state, st.rpo_seconds);
    Ok(action)
}

/// Records an event for each condition that changed (best effort: a failed event is
/// logged, never a failed reconcile).
async fn publish_transitions(
    ctx: &Context,
    obj: &DynamicObject,
    vr: &VolumeReplication,
    st: &VolumeReplicationStatus,
) {
    let Some(recorder) = &ctx.recorder else {
        return;
    };
    let action = match vr.spec.replication_state {
        ReplicationState::Primary => "Promote",
        ReplicationState::Secondary => "Demote",
        ReplicationState::Resync => "Resync",
    };
    let reference = obj.object_ref(&ctx.vr_resource());
    for event in status::transitions(vr.status.as_ref(), st, action) {
        publish(recorder, obj, &reference, &event).await;
    }
}

/// Records `event` about `obj` (best effort: a failed event is logged, never a failed
/// reconcile).
async fn publish(
    recorder: &kube::runtime::events::Recorder,
    obj: &DynamicObject,
    reference: &k8s_openapi::api::core::v1::ObjectReference,
    event: &kube::runtime::events::Event,
) {
    if let Err(e) = recorder.publish(event, reference).await {
        tracing::warn!(vr = %key(obj), error = %e, "cannot record an event");
    }
}

/// Computes the new status, calling the agent as the spec asks.
pub async fn decide(
    vr: &VolumeReplication,
    ctx: &Context,
    now: Time,
) -> (VolumeReplicationStatus, Action) {
    let (mut st, action) = decide_by_state(vr, ctx, now.clone()).await;
    // Whatever path was taken (an agent that did not answer too), the RPO is that of
    // the lastSyncTime written with it.
    st.rpo_seconds = status::rpo(st.last_sync_time.as_ref(), &now);
    st.message = st.message.as_deref().map(status::plain);
    (st, action)
}

/// A failed agent call once the requested state was reached: sets the conditions of
/// trouble (see [`Conditions::trouble`]) and returns the detail for the status message,
/// which names the agent's node when it did not answer.
fn trouble(c: &mut Conditions, d: &Desired, e: &AgentError, primary: bool) -> String {
    let detail = if e.is_unreachable() {
        format!(
            "the agent on node {} ({}) does not answer: {} {}: {}",
            d.node, e.agent, e.op, e.name, e.message
        )
    } else {
        e.to_string()
    };
    c.trouble(status::agent_reason(e), &detail, primary);
    detail
}

async fn decide_by_state(
    vr: &VolumeReplication,
    ctx: &Context,
    now: Time,
) -> (VolumeReplicationStatus, Action) {
    let generation = vr.meta().generation.unwrap_or(0);
    let state = vr.spec.replication_state;
    let mut st = vr.status.clone().unwrap_or_default();
    // Completed reports the requested state change: once it happened, a failed call is
    // news of the replication (Degraded), not a failed promotion or demotion.
    let done = status::completed(&st, state);
    let kind = vr.spec.data_source.kind.clone();
    st.observed_generation = Some(generation);
    let not_valid = |mut st: VolumeReplicationStatus, invalid: desired::Invalid| {
        let mut c = Conditions::new(&mut st.conditions, generation, &kind, now.clone());
        let primary = state == ReplicationState::Primary;
        let retry = if done {
            // Reached already: what is missing now (an agent pod gone) is trouble of
            // the replication, not a failed state change.
            let reason = match invalid.what {
                desired::NO_AGENT => status::reasons::UNREACHABLE,
                _ => status::reasons::ERROR,
            };
            c.trouble(reason, &invalid.detail, primary);
            c.not_validated(&invalid.detail);
            TROUBLE_RETRY
        } else {
            c.failed_validation(state, invalid.what, &invalid.detail);
            if primary {
                c.replicating(Health::Unknown, &invalid.detail);
            }
            RETRY
        };
        if !primary {
            c.remove(status::types::REPLICATING);
        }
        st.state = Some(current(&st));
        st.message = Some(invalid.to_string());
        (st, Action::requeue(retry))
    };
    let mut d = match resolve(vr, ctx) {
        Ok(d) => d,
        Err(invalid) => return not_valid(st, invalid),
    };
    // A class replicating to an agent may name a secret with the token for the peer's
    // agents (read on every look: a rotated token reaches the agent at the next one).
    if let (desired::Target::Agent(_) | desired::Target::Cluster(_), Some((ns, name))) =
        (&d.params.target, &d.params.secret)
    {
        let wanted = "`token`: the peer cluster's replication token (and `ca.crt`, its CA)";
        let token = secret_data(ctx, ns, name, wanted)
            .await
            .and_then(|(data, version)| match data.get("token") {
                Some(t) => Ok((
                    (String::from_utf8_lossy(t).trim().to_string(), version),
                    data.get("ca.crt")
                        .map(|c| String::from_utf8_lossy(c).into_owned()),
                    peer_credential_of(&data, ns, name)?,
                )),
                None => Err(format!("secret {ns}/{name} has no {wanted}")),
            });
        match token {
            Ok((t, ca, bound)) => {
                d.peer_token = Some(t);
                d.peer_ca = ca;
                d.peer_credential = bound;
            }
            Err(detail) => {
                let what = "failed to get replication secret";
                return not_valid(st, desired::Invalid { what, detail });
            }
        }
    }
    let agents = &*ctx.agents;
    // The agent serves the volume from where the kubelet put it (both sides: the
    // secondary's agent must take cycles into it before the first arrives).
    match agents
        .export(
            &d.agent,
            &d.volume,
            &d.path,
            d.block,
            &d.name,
            d.peer_credential.as_deref(),
        )
        .await
    {
        Ok(()) => {}
        // Refused (outside volume_roots, in use elsewhere): the setup is wrong.
        Err(e) if e.is_refusal() => {
            let invalid = desired::Invalid {
                what: "failed to export volume",
                detail: e.to_string(),
            };
            return not_valid(st, invalid);
        }
        // Unreachable: the calls below say so in the conditions they set.
        Err(e) => tracing::debug!("{e}"),
    }
    st.last_start_time = Some(now.clone());
    st.relationship = Some(RelationshipRef {
        name: d.name.clone(),
        agent: d.agent.clone(),
        volume: d.volume.clone(),
        volume_replication_class: vr.spec.volume_replication_class.clone(),
        data_source_name: vr.spec.data_source.name.clone(),
    });
    if let desired::Target::Repository(repo) = &d.params.target {
        let (st, next) =
            super::snapshots::reconcile(ctx, &d, repo, state, st, generation, &kind, now).await;
        let next = next.map_or(RETRY, info_interval);
        return (st, Action::requeue(next));
    }
    let mut c = Conditions::new(&mut st.conditions, generation, &kind, now.clone());
    c.validated();
    match state {
        ReplicationState::Primary => {
            let result = match agents.get(&d.agent, &d.name).await {
                Err(e) => Err(e),
                Ok(None) => agents.create(&d.agent, spec_of(&d)).await,
                Ok(Some(s)) if s.side() == Some(Side::Secondary) => {
                    // csi-addons: a refused promotion (the peer did not hand over with a
                    // final cycle) is retried with force.
                    match agents.promote(&d.agent, &d.name, false).await {
                        Err(e) if e.is_precondition() => {
                            agents.promote(&d.agent, &d.name, true).await
                        }
                        r => r,
                    }
                }
                Ok(Some(s)) => update_if_changed(agents, &d, s).await,
            };
            // Cycles from CSI snapshots advance one step per reconcile.
            let (result, next) = match (result, &d.snapshots) {
                (Ok(s), Some(src)) => {
                    let (s, next) = snapshot_step(ctx, &d, src, s, false).await;
                    (Ok(s), next)
                }
                (r, _) => (r, info_interval(d.params.interval)),
            };
            match result {
                Ok(s) => {
                    c.promoted();
                    let (h, detail) = status::health(&s, &now, d.params.interval);
                    c.replicating(h, &detail);
                    c.consistency(
                        &s.consistency,
                        &s.last_error,
                        s.last_error_kind() == transport::control::ErrorKind::NoPointInTime,
                    );
                    if is_split(&s) {
                        c.degraded(&format!(
                            "relationship {}: another cluster's side was promoted past this \
                             one; set `replicationState: secondary` with `autoResync: true` in \
                             this VolumeReplication to follow it, discarding the writes made \
                             here since",
                            s.state
                        ));
                    }
                    status::apply_report(&mut st, &s, &now);
                    st.state = Some(State::Primary);
                    st.message = Some(status::marked(state));
                    st.last_completion_time = Some(now);
                    // A late cycle (or worse) is looked at often, so that the RPO and the
                    // conditions follow it.
                    let late = st
                        .rpo_seconds
                        .is_some_and(|rpo| rpo > d.params.interval.as_secs_f64());
                    let next = match h {
                        Health::Degraded => next.min(TROUBLE_RETRY),
                        _ if late => next.min(TROUBLE_RETRY),
                        _ => next,
                    };
                    (st, Action::requeue(next))
                }
                Err(e) if done => {
                    st.message = Some(trouble(&mut c, &d, &e, true));
                    (st, Action::requeue(next.min(TROUBLE_RETRY)))
                }
                Err(e) => {
                    c.failed_promotion("failed to promote volume", &e.to_string());
                    c.replicating(Health::Unknown, &e.to_string());
                    st.state = Some(current(&st));
                    st.message = Some(e.to_string());
                    (st, Action::requeue(RETRY))
                }
            }
        }
        ReplicationState::Secondary => {
            c.remove(status::types::REPLICATING);
            let outcome = match agents.get(&d.agent, &d.name).await {
                Err(e) => Err(e),
                // No cycle has arrived yet: a secondary waiting for its first cycle.
                Ok(None) => Ok(None),
                // A primary fenced or split by the peer's promotion has no final cycle to
                // hand over: it is a split secondary (resynced with autoResync).
                Ok(Some(s)) if s.side() == Some(Side::Primary) && !is_split(&s) => {
                    match &d.snapshots {
                        None => agents.demote(&d.agent, &d.name).await.map(|_| None),
                        // The final cycle reads a snapshot taken now, as every cycle does.
                        Some(src) => {
                            let (s, next) = snapshot_step(ctx, &d, src, s, true).await;
                            if s.side() == Some(Side::Primary) {
                                st.message = Some(format!(
                                    "demoting: the final cycle from a VolumeSnapshot: {}",
                                    if s.last_error.is_empty() {
                                        "under way"
                                    } else {
                                        &s.last_error
                                    }
                                ));
                                return (st, Action::requeue(next));
                            }
                            Ok(None)
                        }
                    }
                }
                Ok(Some(s)) => update_if_changed(agents, &d, s).await.map(Some),
            };
            st.last_sync_time = None;
            match outcome {
                Err(e) if done => {
                    st.message = Some(trouble(&mut c, &d, &e, false));
                    let next = info_interval(d.params.interval).min(TROUBLE_RETRY);
                    (st, Action::requeue(next))
                }
                Err(e) => {
                    c.failed_demotion("failed to demote volume", &e.to_string());
                    st.state = Some(current(&st));
                    st.message = Some(e.to_string());
                    (st, Action::requeue(RETRY))
                }
                Ok(None) => {
                    // Demoted now (or not yet reached by a cycle): degraded until a
                    // cycle is applied, as csi-addons marks a fresh secondary.
                    c.demoted();
                    st.state = Some(State::Secondary);
                    st.message = Some("volume is marked secondary and is degraded".into());
                    (st, Action::requeue(RETRY))
                }
                Ok(Some(s)) => secondary(st, generation, &kind, agents, &d, s, now).await,
            }
        }
        ReplicationState::Resync => {
            c.remove(status::types::REPLICATING);
            // Discard this side's data only where it is not the volume of record: an
            // active primary is refused, as csi-addons refuses it (agent/control.rs
            // guards the same, but the controller must not ask it to skip the guard).
            let resynced = match agents.get(&d.agent, &d.name).await {
                Ok(Some(s)) => match resync_discards(&s) {
                    Ok(discard) => agents.resync(&d.agent, &d.name, discard).await,
                    Err(refused) => {
                        c.failed_resync("failed to resync volume", &refused);
                        st.state = Some(current(&st));
                        st.message = Some(refused);
                        return (st, Action::requeue(RETRY));
                    }
                },
                Ok(None) => agents.resync(&d.agent, &d.name, false).await,
                Err(e) => Err(e),
            };
            match resynced {
                Err(e) if done => {
                    st.message = Some(trouble(&mut c, &d, &e, false));
                    (st, Action::requeue(TROUBLE_RETRY))
                }
                Err(e) => {
                    c.failed_resync("failed to resync volume", &e.to_string());
                    st.state = Some(current(&st));
                    st.message = Some(e.to_string());
                    (st, Action::requeue(RETRY))
                }
                Ok(s) => {
                    c.resync();
                    st.epoch = Some(s.epoch as i64);
                    if in_sync(&s) {
                        c.not_degraded();
                        st.state = Some(State::Secondary);
                        st.message = Some(status::marked(state));
                        st.last_completion_time = Some(now);
                    } else {
                        st.message = Some("volume is degraded".into());
                    }
                    (st, Action::requeue(RETRY))
                }
            }
        }
    }
}

/// One step of a cycle from CSI snapshots (see [`super::csi_snapshots`]): the agent's
/// status after it (a failed step is its last error, and makes it Degraded), and when
/// to look again.
async fn snapshot_step(
    ctx: &Context,
    d: &Desired,
    src: &super::desired::Source,
    s: control::Status,
    last: bool,
) -> (control::Status, Duration) {
    use super::csi_snapshots::{Step, WAITING_FALLBACK, step};
    match step(ctx, d, src, &s, last).await {
        // The next step (the old snapshot and the reader removed) at once.
        Step::Ran(after) => (*after, Duration::ZERO),
        Step::Idle(due) => (s, due.min(info_interval(d.params.interval))),
        Step::Waiting(what) => {
            tracing::debug!(relationship = %d.name, "{what}");
            (s, WAITING_FALLBACK)
        }
        Step::Failed(why) => {
            tracing::warn!(relationship = %d.name, "{why}");
            let mut s = s;
            // The controller's own failure replaces the agent's error, and its kind: an
            // agent's lateness must not speak for it.
            s.last_error = why;
            s.last_error_kind = control::ErrorKind::Unspecified as i32;
            if s.relationship_state() == Some(RelationshipState::Replicating) {
                s.state = RelationshipState::Degraded.name().into();
            }
            (s, RETRY.min(d.params.interval))
        }
    }
}

/// A secondary the agent knows: healthy, resyncing, or fenced/split (auto-resynced when
/// the spec says so).
async fn secondary(
    mut st: VolumeReplicationStatus,
    generation: i64,
    kind: &str,
    agents: &dyn Agents,
    d: &Desired,
    s: control::Status,
    now: Time,
) -> (VolumeReplicationStatus, Action) {
    let mut c = Conditions::new(&mut st.conditions, generation, kind, now.clone());
    st.epoch = Some(s.epoch as i64);
    st.state = Some(State::Secondary);
    let split = is_split(&s);
    if split && !d.auto_resync {
        c.demoted();
        let advice = format!(
            "relationship {}: set `autoResync: true` (or `replicationState: resync`) to \
             discard this side's writes since the last common cycle and follow the primary",
            s.state
        );
        c.degraded(&advice);
        st.message = Some(format!("volume is degraded: {advice}"));
        return (st, Action::requeue(RETRY));
    }
    let s = if split {
        match agents.resync(&d.agent, &d.name, true).await {
            Ok(s) => s,
            Err(e) => {
                c.failed_resync("failed to resync volume", &e.to_string());
                st.message = Some(e.to_string());
                return (st, Action::requeue(RETRY));
            }
        }
    } else {
        s
    };
    c.demoted();
    c.resync();
    c.consistency(
        &s.consistency,
        &s.last_error,
        s.last_error_kind() == transport::control::ErrorKind::NoPointInTime,
    );
    st.last_sync_consistency = status::last_sync_consistency(&s.consistency);
    if in_sync(&s) {
        c.not_degraded();
        st.message = Some(status::marked(ReplicationState::Secondary));
        st.last_completion_time = Some(now);
        (st, Action::requeue(info_interval(d.params.interval)))
    } else {
        st.message = Some("volume is degraded".into());
        (st, Action::requeue(RETRY))
    }
}

/// Whether `replicationState: resync` may discard this side's writes: yes on a demoted
/// secondary, or a primary that was fenced or split from its peer (it is no longer the
/// volume of record); an active primary is refused with what to do instead.
pub fn resync_discards(s: &control::Status) -> Result<bool, String> {
    let name = s.spec.as_ref().map(|s| s.name.as_str()).unwrap_or_default();
    match s.side() == Some(Side::Secondary) || is_split(s) {
        true => Ok(true),
        false => Err(format!(
            "relationship {name} is the active primary here: replicationState resync would \
             throw its data away for the peer's, so it is refused (as csi-addons refuses it). \
             For a planned failover set replicationState: secondary; to follow the peer after \
             a split, set secondary (with autoResync) once the peer is primary"
        )),
    }
}

/// The peer was promoted past this side (fenced) or both wrote (split brain).
fn is_split(s: &control::Status) -> bool {
    matches!(
        s.relationship_state(),
        Some(RelationshipState::Fenced | RelationshipState::SplitBrain)
    )
}

/// A secondary holding a complete cycle and following the primary.
fn in_sync(s: &control::Status) -> bool {
    s.side() == Some(Side::Secondary)
        && s.relationship_state() == Some(RelationshipState::Secondary)
        && s.last_cycle.is_some()
}

/// The peer credential a class secret's `peer-credential` binds its relationships to
/// (`None`: the key is absent; they stay unbound).
pub(crate) fn peer_credential_of(
    data: &std::collections::BTreeMap<String, Vec<u8>>,
    ns: &str,
    name: &str,
) -> Result<Option<String>, String> {
    let Some(b) = data.get("peer-credential") else {
        return Ok(None);
    };
    let b = String::from_utf8_lossy(b).trim().to_string();
    transport::cluster::check_credential_name(&b)
        .map_err(|e| format!("secret {ns}/{name}, key peer-credential: {e}"))?;
    Ok(Some(b))
}

fn spec_of(d: &Desired) -> control::Spec {
    control::Spec {
        name: d.name.clone(),
        volume: d.volume.clone(),
        peer: d.peer.clone(),
        interval_ms: d.params.interval.as_millis() as u64,
        bwlimit: d.params.bwlimit,
        chunk_size: d.params.chunk_size,
        freeze: String::new(),
        peer_token: d.peer_token.clone().map(|t| t.0).unwrap_or_default(),
        peer_token_version: d.peer_token.clone().map(|t| t.1).unwrap_or_default(),
        peer_ca: d.peer_ca.clone().unwrap_or_default(),
        require_point_in_time: d.params.require_point_in_time,
        snapshots: d.snapshots.is_some(),
        peer_credential: d.peer_credential.clone().unwrap_or_default(),
    }
}

/// A relationship already there: on a primary, its interval, bandwidth or consistency if
/// the class changed them; on either side, the peer token if the class secret's changed (a
/// secondary keeps it for when it is promoted and replicates back).
async fn update_if_changed(
    agents: &dyn Agents,
    d: &Desired,
    s: control::Status,
) -> Result<control::Status, AgentError> {
    let have = s.spec.clone().unwrap_or_default();
    let want = spec_of(d);
    let primary = s.side() == Some(Side::Primary);
    let schedule = primary
        && (
            have.interval_ms,
            have.bwlimit,
            have.require_point_in_time,
            have.snapshots,
        ) != (
            want.interval_ms,
            want.bwlimit,
            want.require_point_in_time,
            want.snapshots,
        );
    let token = d.peer_token.is_some() && have.peer_token_version != want.peer_token_version;
    // Bound from the class secret, which may bind it later or to another credential.
    let bind = d.params.secret.is_some() && have.peer_credential != want.peer_credential;
    if !schedule && !token && !bind {
        return Ok(s);
    }
    agents
        .update(
            &d.agent,
            control::UpdateRequest {
                name: d.name.clone(),
                interval_ms: primary.then_some(want.interval_ms),
                bwlimit: primary.then_some(want.bwlimit),
                paused: None,
                // The controller sets no freeze (it does not know the mount point).
                freeze: None,
                peer_token: token.then_some(want.peer_token),
                peer_token_version: token.then_some(want.peer_token_version),
                peer_ca: token.then_some(want.peer_ca),
                require_point_in_time: primary.then_some(want.require_point_in_time),
                snapshots: primary.then_some(want.snapshots),
                peer_credential: bind.then_some(want.peer_credential),
                accept_epoch: None,
            },
        )
        .await
}

/// Writes the whole status by server-side apply.
async fn write_status(
    api: &Api<DynamicObject>,
    vr: &VolumeReplication,
    group: &str,
    st: &VolumeReplicationStatus,
) -> Result<(), Error> {
    let patch = Patch::Apply(serde_json::json!({
        "apiVersion": format!("{group}/{}", crd::VERSION),
        "kind": "VolumeReplication",
        "status": st,
    }));
    api.patch_status(
        &vr.name_any(),
        &PatchParams::apply(FIELD_MANAGER).force(),
        &patch,
    )
    .await?;
    Ok(())
}

/// How long ago the resource's deletion was asked for.
fn deleting_for(obj: &DynamicObject) -> Duration {
    obj.metadata
        .deletion_timestamp
        .as_ref()
        .and_then(|t| {
            let since = k8s_openapi::jiff::Timestamp::now().duration_since(t.0);
            Duration::try_from(since).ok()
        })
        .unwrap_or_default()
}

/// The resource is being deleted: forget the relationship on the agent that holds it.
async fn cleanup(obj: &DynamicObject, ctx: &Context) -> Result<Action, Error> {
    let vr = parse(obj)?;
    let recorded = vr.status.as_ref().and_then(|s| s.relationship.clone());
    // Where it is now (the agent pod may have a new address), else where it was.
    let target = match resolve(&vr, ctx) {
        Ok(d) => Some((d.agent, d.name, d.volume)),
        Err(_) => recorded.map(|r| (r.agent, r.name, r.volume)),
    };
    // Its VolumeSnapshots, clones and readers (a class gone, or unreadable, may have
    // made some too).
    let snapshot_class = ctx
        .class(&vr.spec.volume_replication_class)
        .map(|c| desired::class_params(&c).map(|p| p.snapshot_class.is_some()));
    if !matches!(snapshot_class, Some(Ok(false))) {
        let ns = vr.namespace().unwrap_or_else(|| "default".into());
        let name = desired::relationship_name(&vr);
        if let Err(e) = super::csi_snapshots::remove_all(&ctx.client, &ns, &name).await {
            tracing::warn!(vr = %key(obj), "{e}");
        }
    }
    if let Some((agent, name, volume)) = target {
        // Whichever the class was: a relationship, or a schedule (its snapshots stay).
        let deleted = async {
            ctx.agents.delete(&agent, &name).await?;
            ctx.agents.delete_schedule(&agent, &name).await
        };
        match (deleted.await, &ctx.leftovers) {
            (Ok(()), _) => {}
            // The agent is down past the grace: finish the deletion, and leave the
            // relationship to the sweep that removes it once the agent is back.
            (Err(e), Some((grace, leftovers)))
                if !e.is_refusal() && deleting_for(obj) >= *grace =>
            {
                let left = Leftover {
                    agent: agent.clone(),
                    relationship: name.clone(),
                    export: volume.clone(),
                    owner: key(obj),
                };
                leftovers.record(&left).await?;
                let note = format!(
                    "relationship {name} and export {volume} are left on agent {agent}, which \
                     did not answer for {}s ({e}); the controller removes them when it answers \
                     again (ConfigMap {})",
                    grace.as_secs(),
                    crate::leftovers::CONFIGMAP
                );
                tracing::warn!(vr = %key(obj), "{note}");
                if let Some(recorder) = &ctx.recorder {
                    let event = kube::runtime::events::Event {
                        type_: kube::runtime::events::EventType::Warning,
                        reason: "LeftOnAgent".into(),
                        note: Some(note),
                        action: "Delete".into(),
                        secondary: None,
                    };
                    let reference = obj.object_ref(&ctx.vr_resource());
                    publish(recorder, obj, &reference, &event).await;
                }
                ctx.metrics.forget(&key(obj));
                return Ok(Action::await_change());
            }
            (Err(e), _) => return Err(e.into()),
        }
        tracing::info!(%agent, relationship = %name, "relationship deleted");
        // Best effort: another relationship or a hydration may still use the export.
        match ctx.agents.unexport(&agent, &volume).await {
            Ok(()) => tracing::info!(%agent, export = %volume, "export removed"),
            Err(e) => tracing::warn!(%agent, export = %volume, "export kept: {e}"),
        }
    }
    ctx.metrics.forget(&key(obj));
    Ok(Action::await_change())
}
