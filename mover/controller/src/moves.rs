//! VolumeMove: an owned volume follows its workload to another cluster, one owner at a
//! time.
//!
//! Each cluster has its half, and the two meet only through the agents (a multi-cluster
//! orchestrator writes both, as RamenDR writes each cluster's VolumeReplications):
//! - **Source**: the PV is set `Retain`; the pods that use the PVC are deleted (a
//!   StatefulSet is first scaled to 0); the move waits until no pod, no VolumeAttachment
//!   and, as the node's agent confirms, no mount, loop device or open file holds the
//!   volume. Only then is the VolumeReplication set `secondary`: its demote ships a final
//!   cycle, which is the acknowledgement the destination waits for.
//! - **Destination**: the PV is set `Retain`; the move waits until the agent has applied
//!   that final cycle, then sets the VolumeReplication `primary` (a planned promote:
//!   downtime is the final cycle). It waits as long as that takes, unless the move
//!   asks for force (`forceAfterSeconds`: the old owner is known to be unreachable, or
//!   its workload never let go): past that, it promotes by force. That raises the
//!   epoch: the old owner's later cycles are refused as stale (the agent logs and
//!   counts each), so its late writes never land. Status says `fenced`.
//!
//! - **Within a cluster, no VolumeReplication** (`storageClassName`): after the same
//!   release, the old volume is served by its agent to the fill alone, and the PVC is
//!   made again under its name, populated from it (a HydrationSource): usable at once
//!   wherever its next pod runs while the data arrives. The old PV stays `Retain` until
//!   the fill completes.
//!
//! Each PV's reclaim policy goes back to the user's when its volume completes (within a
//! cluster, once the old volume's export is withdrawn). A StatefulSet moves as one such
//! move per PVC, in ordinal order.
//!
//! **Deleting a move** (its finalizer): a volume handed over (the source let go of it,
//! or the destination promoted it) finishes its move first, as that cannot be undone
//! without losing writes; the deletion waits and the status says so. Every volume not
//! handed over is then rolled back: its PV's reclaim policy back to the user's, the
//! export served to the fill withdrawn, and a StatefulSet the move scaled to 0 given
//! its replicas back if none of its volumes was handed over.

use super::context::{Context, created_or_exists, deleted_or_gone, node_exists, owned, typed};
use super::crd::{
    HydrationSource, HydrationSourceSpec, MovePhase, MoveSide, MovedVolume, VolumeMove,
    VolumeMoveStatus, VolumeReplication,
};
use super::populate::SELECTED_NODE;
use super::replication::status::{reasons, types};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams},
    runtime::{
        controller::Action,
        finalizer::{Event, finalizer},
    },
};
use std::{sync::Arc, time::Duration};

/// The annotation on a StatefulSet a move scaled to 0: its replicas before.
const REPLICAS_BEFORE_MOVE: &str = "replication.mover/replicas-before-move";
/// The label on a PVC that a move within a cluster deletes (and makes again).
const MOVING: &str = "replication.mover/moving";
/// How often a move under way looks again.
const POLL: Duration = Duration::from_secs(1);
/// The default bound on detaching (source).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The finalizer on a VolumeMove: its deletion rolls back what is not handed over yet
/// and lets what is finish (see the module's "Deleting a move").
pub const FINALIZER: &str = "replication.mover/volume-move";

/// A call to the API server that failed (the move retries it).
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    /// The call, and the API server's answer.
    #[error("{what}: {source}")]
    Kube {
        /// What was asked.
        what: String,
        /// Its answer.
        source: kube::Error,
    },
    /// Adding or removing the finalizer failed.
    #[error("the finalizer: {0}")]
    Finalizer(String),
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> MoveError {
    let what = what.into();
    move |source| MoveError::Kube { what, source }
}

/// Moves one VolumeMove a step further, or winds down a deleted one; idempotent, each
/// step re-derived from what the cluster and the agents say.
pub async fn reconcile(cached: Arc<VolumeMove>, ctx: Arc<Context>) -> Result<Action, MoveError> {
    let ns = cached.namespace().unwrap_or_default();
    let api = Api::<VolumeMove>::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, cached, |event| async {
        match event {
            Event::Apply(mv) => advance(&mv, &ctx, false).await,
            Event::Cleanup(mv) => wind_down(&mv, &ctx).await,
        }
    })
    .await
    .map_err(|e| match e {
        kube::runtime::finalizer::Error::ApplyFailed(e)
        | kube::runtime::finalizer::Error::CleanupFailed(e) => e,
        other => MoveError::Finalizer(other.to_string()),
    })
}

/// Whether `vol` is past the point of no return: the source let go of it (the
/// VolumeReplication set secondary, or the PVC made again), or the destination set its
/// VolumeReplication primary. Undoing that could lose writes; it finishes instead.
fn handed_over(side: MoveSide, vol: &MovedVolume) -> bool {
    match side {
        MoveSide::Source => vol.released_time.is_some(),
        MoveSide::Destination => matches!(vol.phase, MovePhase::Promoting | MovePhase::Completed),
    }
}

/// A deleted move: its handed-over volumes finish their move (the deletion waits and
/// says so), then every volume not handed over is rolled back: its PV's reclaim policy
/// back to the user's, the export served to the fill withdrawn, and a StatefulSet the
/// move scaled to 0 given its replicas back if none of its volumes was handed over.
async fn wind_down(cached: &VolumeMove, ctx: &Arc<Context>) -> Result<Action, MoveError> {
    let (ns, name) = (cached.namespace().unwrap_or_default(), cached.name_any());
    advance(cached, ctx, true).await?;
    let api = Api::<VolumeMove>::namespaced(ctx.client.clone(), &ns);
    let Some(mv) = api
        .get_opt(&name)
        .await
        .map_err(kube_err(format!("reading VolumeMove {ns}/{name}")))?
    else {
        return Ok(Action::await_change());
    };
    let mut st = mv.status.clone().unwrap_or_default();
    let before = st.clone();
    let side = mv.spec.side;
    let finishing: Vec<String> = st
        .volumes
        .iter()
        .filter(|v| {
            handed_over(side, v) && !matches!(v.phase, MovePhase::Completed | MovePhase::Failed)
        })
        .map(|v| v.pvc.clone())
        .collect();
    let step = Step {
        ctx,
        ns: &ns,
        timeout: DEFAULT_TIMEOUT,
        force_after: None,
        now: Time(k8s_openapi::jiff::Timestamp::now()),
        class: mv.spec.storage_class_name.as_deref(),
    };
    let mut unfinished = Vec::new();
    if finishing.is_empty() {
        for vol in st.volumes.iter_mut() {
            if handed_over(side, vol) || vol.phase == MovePhase::Completed {
                continue;
            }
            if let Err(why) = step.roll_back(vol).await? {
                unfinished.push(format!("{}: {why}", vol.pvc));
            }
        }
        let none_handed_over = !st.volumes.iter().any(|v| handed_over(side, v));
        if let (Some(sts), true, MoveSide::Source) = (&mv.spec.stateful_set, none_handed_over, side)
        {
            scale_back(ctx, &ns, sts).await?;
        }
    }
    let done = finishing.is_empty() && unfinished.is_empty();
    st.message = Some(if !finishing.is_empty() {
        format!(
            "deleting: {} finish their move first (handed over, which cannot be undone); \
             then the rest is rolled back",
            finishing.join(", ")
        )
    } else if !unfinished.is_empty() {
        format!("deleting: cannot roll back yet: {}", unfinished.join("; "))
    } else {
        "deleted: what was not handed over is rolled back".into()
    });
    if st != before && !done {
        write_status(&api, &ns, &name, &st).await?;
    }
    if done {
        tracing::info!(volumemove = %format!("{ns}/{name}"), "move deleted: what was not handed over is rolled back");
        return Ok(Action::await_change());
    }
    Ok(Action::requeue(POLL))
}

/// A StatefulSet a move scaled to 0 (its replicas recorded on it) scaled back.
async fn scale_back(ctx: &Context, ns: &str, sts: &str) -> Result<(), MoveError> {
    let recorded = Api::<StatefulSet>::namespaced(ctx.client.clone(), ns)
        .get_opt(sts)
        .await
        .map_err(kube_err(format!("reading StatefulSet {ns}/{sts}")))?
        .and_then(|s| {
            s.annotations()
                .get(REPLICAS_BEFORE_MOVE)?
                .parse::<i32>()
                .ok()
        });
    if let Some(replicas) = recorded {
        scale(ctx, ns, sts, replicas, None).await?;
    }
    Ok(())
}

/// Moves one VolumeMove a step further (`winding_down`: its handed-over volumes only).
async fn advance(
    cached: &VolumeMove,
    ctx: &Arc<Context>,
    winding_down: bool,
) -> Result<Action, MoveError> {
    let ns = cached.namespace().unwrap_or_default();
    let name = cached.name_any();
    if cached
        .status
        .as_ref()
        .is_some_and(|s| matches!(s.phase, Some(MovePhase::Completed | MovePhase::Failed)))
    {
        return Ok(Action::await_change());
    }
    // Read afresh: the watch cache may not hold this move's last status write yet (a
    // step that advanced is looked at again at once), and what only the status records
    // (fenced, the user's reclaim policy) must not be written over with an older one.
    let Some(mv) = Api::<VolumeMove>::namespaced(ctx.client.clone(), &ns)
        .get_opt(&name)
        .await
        .map_err(kube_err(format!("reading VolumeMove {ns}/{name}")))?
    else {
        return Ok(Action::await_change());
    };
    let mut st = mv.status.clone().unwrap_or_default();
    if matches!(st.phase, Some(MovePhase::Completed | MovePhase::Failed))
        || winding_down && st.volumes.is_empty()
    {
        return Ok(Action::await_change());
    }
    let before = st.clone();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    st.start_time.get_or_insert_with(|| now.clone());
    if let Some(why) = misplaced_field(&mv.spec) {
        st.phase = Some(MovePhase::Failed);
        st.message = Some(why);
    } else if st.volumes.is_empty() {
        match volumes_of(&mv, ctx, &ns, &mut st).await? {
            Ok(pvcs) => {
                st.volumes = pvcs
                    .into_iter()
                    .map(|pvc| MovedVolume {
                        pvc,
                        ..Default::default()
                    })
                    .collect()
            }
            Err(why) => {
                st.phase = Some(MovePhase::Failed);
                st.message = Some(why);
            }
        }
    }
    let timeout = mv
        .spec
        .timeout_seconds
        .map_or(DEFAULT_TIMEOUT, Duration::from_secs);
    let step = Step {
        ctx,
        ns: &ns,
        timeout,
        force_after: mv.spec.force_after_seconds.map(Duration::from_secs),
        now: now.clone(),
        class: mv.spec.storage_class_name.as_deref(),
    };
    // In order: a volume waits for the ones before it, except behind one that is
    // already usable at its new place (Filling).
    let mut advanced = false;
    for vol in st.volumes.iter_mut() {
        if vol.phase == MovePhase::Completed || winding_down && !handed_over(mv.spec.side, vol) {
            continue;
        }
        let was = vol.phase;
        match (mv.spec.side, step.class) {
            (MoveSide::Source, None) => step.source(vol).await?,
            (MoveSide::Source, Some(class)) => step.on_demand(vol, class).await?,
            (MoveSide::Destination, _) => step.destination(vol).await?,
        }
        advanced |= vol.phase != was;
        if !matches!(vol.phase, MovePhase::Completed | MovePhase::Filling) {
            break;
        }
    }
    let mut next = Action::requeue(if advanced { Duration::ZERO } else { POLL });
    if let Some(vol) = st.volumes.iter().find(|v| v.phase != MovePhase::Completed) {
        st.phase = Some(vol.phase);
        st.message = vol.message.as_ref().map(|m| format!("{}: {m}", vol.pvc));
    } else if st.phase != Some(MovePhase::Failed) {
        st.phase = Some(MovePhase::Completed);
        st.message = Some(format!("{} volume(s) moved", st.volumes.len()));
        st.completion_time = Some(now);
        next = Action::await_change();
        tracing::info!(volumemove = %format!("{ns}/{name}"), side = ?mv.spec.side, fenced = st.fenced, "move completed");
    }
    // Within a cluster, the StatefulSet starts again once every PVC is made again: its
    // pods use them at once, wherever they are scheduled.
    let handed_over = !st.volumes.is_empty()
        && st
            .volumes
            .iter()
            .all(|v| matches!(v.phase, MovePhase::Completed | MovePhase::Filling));
    if let (Some(sts), Some(_), Some(replicas), false, true) = (
        &mv.spec.stateful_set,
        step.class,
        st.replicas,
        st.scaled_back,
        handed_over,
    ) {
        scale(ctx, &ns, sts, replicas, None).await?;
        st.scaled_back = true;
    }
    st.fenced = st.volumes.iter().any(|v| v.fenced);
    if st.phase == Some(MovePhase::Failed) {
        next = Action::await_change();
    }
    if st != before {
        let api = Api::<VolumeMove>::namespaced(ctx.client.clone(), &ns);
        write_status(&api, &ns, &name, &st).await?;
    }
    Ok(next)
}

/// Writes VolumeMove `ns/name`'s status.
async fn write_status(
    api: &Api<VolumeMove>,
    ns: &str,
    name: &str,
    st: &VolumeMoveStatus,
) -> Result<(), MoveError> {
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({ "status": st })),
    )
    .await
    .map_err(kube_err(format!(
        "writing the status of VolumeMove {ns}/{name}"
    )))?;
    Ok(())
}

/// The PVCs a move names, in the order they move: its PVC, or its StatefulSet's claims
/// in ordinal order (the source records the replicas, then scales it to 0).
async fn volumes_of(
    mv: &VolumeMove,
    ctx: &Context,
    ns: &str,
    st: &mut VolumeMoveStatus,
) -> Result<Result<Vec<String>, String>, MoveError> {
    let Some(sts_name) = &mv.spec.stateful_set else {
        return Ok(Ok(mv.spec.pvc.iter().cloned().collect()));
    };
    let api = Api::<StatefulSet>::namespaced(ctx.client.clone(), ns);
    let Some(sts) = api
        .get_opt(sts_name)
        .await
        .map_err(kube_err(format!("reading StatefulSet {ns}/{sts_name}")))?
    else {
        return Ok(Err(format!(
            "no StatefulSet {sts_name:?} in namespace {ns}"
        )));
    };
    // The source records its replicas on the StatefulSet as it scales it to 0, so a
    // look after a lost status write still finds them. The destination's may not run
    // yet (0 replicas): its claims are those already there, ordinal after ordinal.
    let spec_replicas = sts.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
    let recorded = sts
        .annotations()
        .get(REPLICAS_BEFORE_MOVE)
        .and_then(|r| r.parse::<i32>().ok());
    let replicas = match mv.spec.side {
        MoveSide::Source => recorded.unwrap_or(spec_replicas),
        MoveSide::Destination => {
            let pvcs = ctx.caches.pvcs.state();
            let exists = |claim: &String| {
                pvcs.iter()
                    .any(|p| p.namespace().as_deref() == Some(ns) && &p.name_any() == claim)
            };
            let mut n = spec_replicas.max(0);
            while stateful_set_claims(&sts, n + 1).iter().all(exists) {
                n += 1;
            }
            n
        }
    };
    let claims = stateful_set_claims(&sts, replicas);
    if claims.is_empty() {
        return Ok(Err(format!(
            "StatefulSet {ns}/{sts_name} has no volumeClaimTemplates (or 0 replicas): \
             nothing to move"
        )));
    }
    if mv.spec.side == MoveSide::Source {
        st.replicas = Some(replicas);
        scale(ctx, ns, sts_name, 0, Some(replicas)).await?;
    }
    Ok(Ok(claims))
}

/// Sets StatefulSet `ns/name`'s replicas, recording `before` on it (None: the record
/// is removed).
async fn scale(
    ctx: &Context,
    ns: &str,
    name: &str,
    replicas: i32,
    before: Option<i32>,
) -> Result<(), MoveError> {
    let patch = serde_json::json!({
        "metadata": {"annotations": {REPLICAS_BEFORE_MOVE: before.map(|b| b.to_string())}},
        "spec": {"replicas": replicas},
    });
    Api::<StatefulSet>::namespaced(ctx.client.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .map_err(kube_err(format!(
            "scaling StatefulSet {ns}/{name} to {replicas}"
        )))?;
    tracing::info!(statefulset = %format!("{ns}/{name}"), replicas, "scaled for a move");
    Ok(())
}

/// The PVCs of `sts`'s first `replicas` pods, ordinal by ordinal: `TEMPLATE-STS-N`, as
/// the StatefulSet controller names them.
pub fn stateful_set_claims(sts: &StatefulSet, replicas: i32) -> Vec<String> {
    let name = sts.name_any();
    let spec = sts.spec.clone().unwrap_or_default();
    let start = spec.ordinals.and_then(|o| o.start).unwrap_or(0);
    let templates: Vec<String> = spec
        .volume_claim_templates
        .unwrap_or_default()
        .iter()
        .map(|t| t.name_any())
        .collect();
    (start..start + replicas.max(0))
        .flat_map(|i| {
            let name = &name;
            templates.iter().map(move |t| format!("{t}-{name}-{i}"))
        })
        .collect()
}

/// What one step of a volume's move works with.
struct Step<'a> {
    ctx: &'a Context,
    ns: &'a str,
    /// Source: how long the workload has to let go.
    timeout: Duration,
    /// Destination: when to promote by force (never unless the move says).
    force_after: Option<Duration>,
    now: Time,
    /// Within a cluster: the StorageClass of the PVCs made again.
    class: Option<&'a str>,
}

/// A VolumeReplication as the move sees it.
struct Pair {
    vr: VolumeReplication,
    name: String,
}

impl Pair {
    /// The VR has finished the transition to `reason` (Promoted or Demoted) for its
    /// current spec.
    fn completed(&self, reason: &str) -> bool {
        let generation = self.vr.metadata.generation.unwrap_or(0);
        let status = self.vr.status.clone().unwrap_or_default();
        status.observed_generation == Some(generation)
            && status.conditions.iter().any(|c| {
                c.type_ == types::COMPLETED
                    && c.status == "True"
                    && c.reason == reason
                    && c.observed_generation == Some(generation)
            })
    }

    /// What the VR's own status says (its message).
    fn said(&self) -> &str {
        self.vr
            .status
            .as_ref()
            .and_then(|s| s.message.as_deref())
            .unwrap_or_default()
    }

    fn wants(&self) -> &'static str {
        self.vr.spec.replication_state.as_str()
    }
}

impl Step<'_> {
    fn elapsed(&self, since: &Option<Time>) -> Duration {
        since.as_ref().map_or(Duration::ZERO, |t| {
            let d = self.now.0.duration_since(t.0);
            Duration::try_from(d).unwrap_or(Duration::ZERO)
        })
    }

    /// The VolumeReplication whose dataSource is `pvc`, if one is.
    async fn pair(&self, pvc: &str) -> Result<Option<Pair>, MoveError> {
        let api = Api::<DynamicObject>::namespaced_with(
            self.ctx.client.clone(),
            self.ns,
            &self.ctx.vr_resource(),
        );
        let list = api
            .list(&ListParams::default())
            .await
            .map_err(kube_err(format!(
                "listing VolumeReplications in {}",
                self.ns
            )))?;
        Ok(list.items.iter().find_map(|o| {
            let vr: VolumeReplication = typed(o).ok()?;
            (vr.spec.data_source.name == pvc).then(|| Pair {
                name: o.name_any(),
                vr,
            })
        }))
    }

    /// The VolumeReplication of `vol`'s PVC and its PV (set `Retain`), with the step's
    /// start recorded; `None` once `vol` failed for want of either (`which`: the
    /// VolumeReplication the side needs).
    async fn paired(
        &self,
        vol: &mut MovedVolume,
        which: &str,
    ) -> Result<Option<(Pair, String)>, MoveError> {
        let Some(pair) = self.pair(&vol.pvc).await? else {
            let why = format!(
                "no VolumeReplication names this PVC: a move hands over through one ({which})"
            );
            fail(vol, &why)?;
            return Ok(None);
        };
        let pv = match self.retain(vol).await? {
            Ok(pv) => pv,
            Err(why) => {
                fail(vol, &why)?;
                return Ok(None);
            }
        };
        vol.start_time.get_or_insert_with(|| self.now.clone());
        Ok(Some((pair, pv)))
    }

    /// Sets the VR's replicationState (the one field a move writes of it).
    async fn set_state(&self, pair: &Pair, state: &str) -> Result<(), MoveError> {
        Api::<DynamicObject>::namespaced_with(
            self.ctx.client.clone(),
            self.ns,
            &self.ctx.vr_resource(),
        )
        .patch(
            &pair.name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({"spec": {"replicationState": state}})),
        )
        .await
        .map_err(kube_err(format!(
            "setting VolumeReplication {}/{} {state}",
            self.ns, pair.name
        )))?;
        tracing::info!(vr = %format!("{}/{}", self.ns, pair.name), state, "move: replicationState set");
        Ok(())
    }

    /// The PV bound to `pvc` (its name), set `Retain` with the user's policy recorded in
    /// `vol` the first time. Err: why the move cannot go on.
    async fn retain(&self, vol: &mut MovedVolume) -> Result<Result<String, String>, MoveError> {
        let Some(pv) = self.bound_pv(&vol.pvc) else {
            return Ok(Err(format!(
                "PVC {}/{} not found or not bound: a move needs a bound PVC on both sides",
                self.ns, vol.pvc
            )));
        };
        self.set_policy(&pv, vol, None).await?;
        Ok(Ok(pv))
    }

    /// The PV the PVC `pvc` is bound to.
    fn bound_pv(&self, pvc: &str) -> Option<String> {
        let claim = self
            .ctx
            .caches
            .pvcs
            .state()
            .into_iter()
            .find(|p| p.namespace().as_deref() == Some(self.ns) && p.name_any() == pvc)?;
        claim.spec.as_ref()?.volume_name.clone()
    }

    /// Undoes what the move did to `vol`, which was not handed over: its PV's reclaim
    /// policy back to the user's, the export served to the fill withdrawn. Err: why
    /// not yet.
    async fn roll_back(&self, vol: &mut MovedVolume) -> Result<Result<(), String>, MoveError> {
        let pv = vol
            .previous_volume
            .clone()
            .or_else(|| self.bound_pv(&vol.pvc));
        if let (Some(pv), Some(_)) = (pv, &vol.reclaim_policy) {
            self.set_policy(&pv, vol, Some(())).await?;
        }
        Ok(self.withdraw(vol).await)
    }

    /// Within a cluster: the old volume's export, served to the fill, withdrawn from its
    /// agent. A node gone took the export with it. Err: why not yet.
    async fn withdraw(&self, vol: &MovedVolume) -> Result<(), String> {
        let (Some(pv), Some(node)) = (&vol.previous_volume, &vol.previous_node) else {
            return Ok(());
        };
        let pods = owned(&self.ctx.caches.agents);
        let agent = match super::replication::desired::agent_on(node, &pods, self.ctx.agent_port) {
            Ok(a) => a,
            Err(_) if !node_exists(self.ctx, node) => return Ok(()),
            Err(e) => return Err(format!("withdrawing export {pv} on {node}: {e}")),
        };
        self.ctx
            .agents
            .unexport(&agent, pv)
            .await
            .map_err(|e| format!("withdrawing export {pv} on {node}: {e}"))?;
        tracing::info!(pv, node, "the old volume's export withdrawn");
        Ok(())
    }

    /// Sets the PV's reclaim policy to `Retain` (`restore`: None), recording the user's
    /// first; or back to the recorded one.
    async fn set_policy(
        &self,
        pv: &str,
        vol: &mut MovedVolume,
        restore: Option<()>,
    ) -> Result<(), MoveError> {
        let api = Api::<PersistentVolume>::all(self.ctx.client.clone());
        let current = self
            .ctx
            .caches
            .pvs
            .state()
            .into_iter()
            .find(|p| p.name_any() == pv)
            .and_then(|p| p.spec.as_ref()?.persistent_volume_reclaim_policy.clone())
            .unwrap_or_else(|| "Delete".into());
        let want = match restore {
            None => {
                vol.reclaim_policy.get_or_insert_with(|| current.clone());
                "Retain".to_string()
            }
            Some(()) => vol
                .reclaim_policy
                .clone()
                .unwrap_or_else(|| current.clone()),
        };
        if current != want {
            api.patch(
                pv,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": {"persistentVolumeReclaimPolicy": want}})),
            )
            .await
            .map_err(kube_err(format!(
                "setting PV {pv}'s reclaim policy to {want}"
            )))?;
        }
        Ok(())
    }

    /// The source: detach, wait for the agent's acknowledgement, demote.
    async fn source(&self, vol: &mut MovedVolume) -> Result<(), MoveError> {
        let which = "create it in both clusters, replicating, then move";
        let Some((pair, pv)) = self.paired(vol, which).await? else {
            return Ok(());
        };
        if pair.wants() == "secondary" {
            vol.phase = MovePhase::Demoting;
            if !pair.completed(reasons::DEMOTED) {
                vol.message = Some(format!("the final cycle is shipping ({})", pair.said()));
                return Ok(());
            }
            self.set_policy(&pv, vol, Some(())).await?;
            vol.phase = MovePhase::Completed;
            vol.completion_time = Some(self.now.clone());
            vol.message =
                Some("released: the final cycle is shipped and this side is secondary".into());
            return Ok(());
        }
        vol.phase = MovePhase::Detaching;
        let Some(r) = pair.vr.status.as_ref().and_then(|s| s.relationship.clone()) else {
            vol.message = Some(format!(
                "VolumeReplication {} has no relationship yet",
                pair.name
            ));
            return Ok(());
        };
        let held = match self.held(vol, &pv, &r.agent, &r.volume).await? {
            Ok(held) => held,
            Err(why) => return fail(vol, &why),
        };
        if !self.released(vol, held) {
            return Ok(());
        }
        self.set_state(&pair, "secondary").await?;
        vol.phase = MovePhase::Demoting;
        vol.message = Some("released; the final cycle is shipping".into());
        Ok(())
    }

    /// Within a cluster, no VolumeReplication: detach, wait for the agent's
    /// acknowledgement, then make the PVC again in `class`, filled on demand from the
    /// old volume (kept `Retain` until the fill completes).
    async fn on_demand(&self, vol: &mut MovedVolume, class: &str) -> Result<(), MoveError> {
        match vol.phase {
            MovePhase::Recreating => return self.recreate(vol, class).await,
            MovePhase::Filling => return self.filling(vol).await,
            _ => {}
        }
        let pv = match self.retain(vol).await? {
            Ok(pv) => pv,
            Err(why) => return fail(vol, &why),
        };
        vol.previous_volume = Some(pv.clone());
        vol.start_time.get_or_insert_with(|| self.now.clone());
        vol.phase = MovePhase::Detaching;
        let (node, agent, placement) = match self.place(&vol.pvc, &pv) {
            Ok(p) => p,
            Err(why) => return fail(vol, &why),
        };
        vol.previous_node = Some(node.clone());
        // Served to the fill of the PVC made again (the populator reads for
        // hydrate:NAMESPACE/PVC), and to nothing else.
        let reader = format!("hydrate:{}/{}", self.ns, vol.pvc);
        match self
            .ctx
            .agents
            .export(&agent, &pv, &placement.path, placement.block, &reader, None)
            .await
        {
            Ok(()) => {}
            Err(e) if e.is_refusal() => return fail(vol, &e.to_string()),
            Err(e) => {
                vol.message = Some(format!("waiting for the agent on {node}: {e}"));
                return Ok(());
            }
        }
        let held = match self.held(vol, &pv, &agent, &pv).await? {
            Ok(held) => held,
            Err(why) => return fail(vol, &why),
        };
        if !self.released(vol, held) {
            return Ok(());
        }
        let source = HydrationSource::new(
            &hydration_source_name(&vol.pvc),
            HydrationSourceSpec {
                agent: Some(format!("agent://{node}@{agent}/{pv}")),
                snapshot: None,
                volume_replication: None,
                bwlimit: None,
                secret_ref: None,
            },
        );
        created_or_exists(
            Api::<HydrationSource>::namespaced(self.ctx.client.clone(), self.ns)
                .create(&PostParams::default(), &source)
                .await,
        )
        .map_err(kube_err(format!(
            "creating HydrationSource {}/{}",
            self.ns,
            source.name_any()
        )))?;
        vol.phase = MovePhase::Recreating;
        vol.message = Some(format!(
            "released; the PVC is made again in {class}, filled from {pv} on {node}"
        ));
        Ok(())
    }

    /// The node holding PV `pv` (bound to `pvc`), its agent, and where the volume is.
    fn place(
        &self,
        pvc: &str,
        pv: &str,
    ) -> Result<(String, String, super::replication::desired::Placement), String> {
        let caches = &self.ctx.caches;
        let claim = caches
            .pvcs
            .state()
            .into_iter()
            .find(|p| p.namespace().as_deref() == Some(self.ns) && p.name_any() == pvc);
        let volume = caches.pvs.state().into_iter().find(|p| p.name_any() == pv);
        let (Some(claim), Some(volume)) = (claim, volume) else {
            return Err(format!("PVC {}/{pvc} or its PV {pv} not found", self.ns));
        };
        let (attachments, nodes, pods) = (
            owned(&caches.attachments),
            owned(&caches.nodes),
            owned(&caches.agents),
        );
        let placement =
            super::replication::desired::placement(&claim, &volume, &attachments, &nodes)
                .map_err(|e| e.to_string())?;
        let agent =
            super::replication::desired::agent_on(&placement.node, &pods, self.ctx.agent_port)
                .map_err(|e| e.to_string())?;
        Ok((placement.node.clone(), agent, placement))
    }

    /// Replaces the old PVC by one of the same name in `class` that names the
    /// HydrationSource: made from the old PV (its modes and size), so a restart between
    /// the deletion and the creation loses nothing.
    async fn recreate(&self, vol: &mut MovedVolume, class: &str) -> Result<(), MoveError> {
        let api = Api::<PersistentVolumeClaim>::namespaced(self.ctx.client.clone(), self.ns);
        let source = hydration_source_name(&vol.pvc);
        let what = format!("PVC {}/{}", self.ns, vol.pvc);
        if let Some(pvc) = api
            .get_opt(&vol.pvc)
            .await
            .map_err(kube_err(format!("reading {what}")))?
        {
            if super::populate::populator::source_of(&pvc).as_deref() == Some(source.as_str()) {
                vol.phase = MovePhase::Filling;
                vol.message = Some("made again; usable where its next pod runs".into());
                return Ok(());
            }
            if pvc.metadata.deletion_timestamp.is_none() {
                // Marked first: the controller may delete only PVCs that carry one of its
                // labels (deploy/base/controller-admission.yaml).
                let mark = serde_json::json!({"metadata": {"labels": {MOVING: source}}});
                api.patch(&vol.pvc, &PatchParams::default(), &Patch::Merge(mark))
                    .await
                    .map_err(kube_err(format!("marking {what} for the move")))?;
                api.delete(&vol.pvc, &DeleteParams::default())
                    .await
                    .map_err(kube_err(format!("deleting {what} (its PV is Retain)")))?;
                tracing::info!(pvc = %format!("{}/{}", self.ns, vol.pvc), "old PVC deleted for a move; its PV is Retain");
            }
            vol.message = Some("waiting for the old PVC to go (its PV is kept)".into());
            return Ok(());
        }
        let Some(pv) = vol.previous_volume.clone().and_then(|pv| {
            self.ctx
                .caches
                .pvs
                .state()
                .into_iter()
                .find(|p| p.name_any() == pv)
        }) else {
            return fail(vol, "the old PV is gone: nothing to fill the PVC from");
        };
        let spec = pv.spec.clone().unwrap_or_default();
        let size = spec
            .capacity
            .as_ref()
            .and_then(|c| c.get("storage"))
            .map(|q| q.0.clone())
            .unwrap_or_default();
        let pvc: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": vol.pvc, "namespace": self.ns,
                         "labels": {"replication.mover/moved-from": pv.name_any()}},
            "spec": {
                "accessModes": spec.access_modes.unwrap_or_else(|| vec!["ReadWriteOnce".into()]),
                "volumeMode": spec.volume_mode.unwrap_or_else(|| "Filesystem".into()),
                "storageClassName": class,
                "resources": {"requests": {"storage": size}},
                "dataSourceRef": {"apiGroup": super::crd::MOVER_GROUP, "kind": "HydrationSource", "name": source},
            }
        }))
        .expect("a PVC");
        created_or_exists(api.create(&PostParams::default(), &pvc).await)
            .map_err(kube_err(format!("creating {what}")))?;
        tracing::info!(pvc = %format!("{}/{}", self.ns, vol.pvc), "made again, filled on demand");
        vol.phase = MovePhase::Filling;
        vol.message = Some("made again; usable where its next pod runs".into());
        Ok(())
    }

    /// The new PVC's fill: Completed (the old PV back to the user's policy) once its
    /// agent has every region.
    async fn filling(&self, vol: &mut MovedVolume) -> Result<(), MoveError> {
        let pvc = Api::<PersistentVolumeClaim>::namespaced(self.ctx.client.clone(), self.ns)
            .get_opt(&vol.pvc)
            .await
            .map_err(kube_err(format!("reading PVC {}/{}", self.ns, vol.pvc)))?;
        let bound_to = pvc.as_ref().and_then(|p| {
            let volume = p.spec.as_ref()?.volume_name.clone()?;
            let node = p.annotations().get(SELECTED_NODE)?.clone();
            Some((volume, node))
        });
        let Some((volume, node)) = bound_to else {
            vol.message = Some(
                "made again; usable at once where its next pod runs: start the workload".into(),
            );
            return Ok(());
        };
        let pods = owned(&self.ctx.caches.agents);
        let agent = match super::replication::desired::agent_on(&node, &pods, self.ctx.agent_port) {
            Ok(a) => a,
            Err(e) => {
                vol.message = Some(format!("in use on {node}; its fill: {e}"));
                return Ok(());
            }
        };
        let done = match self.ctx.agents.hydration(&agent, &volume).await {
            // Forgotten: finished before its agent restarted.
            Ok(None) => true,
            Ok(Some(h)) if h.phase == "Complete" => true,
            Ok(Some(h)) => {
                vol.message = Some(format!(
                    "in use on {node}; {} of {} regions arrived{}",
                    h.present,
                    h.regions,
                    if h.last_error.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", h.last_error)
                    }
                ));
                false
            }
            Err(e) => {
                vol.message = Some(format!("in use on {node}; its fill: {e}"));
                false
            }
        };
        if done {
            if let Err(why) = self.withdraw(vol).await {
                vol.message = Some(format!("filled on {node}; {why}"));
                return Ok(());
            }
            if let Some(pv) = vol.previous_volume.clone() {
                self.set_policy(&pv, vol, Some(())).await?;
            }
            vol.phase = MovePhase::Completed;
            vol.completion_time = Some(self.now.clone());
            vol.message = Some(format!("filled on {node}"));
        }
        Ok(())
    }

    /// What still holds the source's volume: pods using the PVC (deleted here), its
    /// VolumeAttachments, then what `agent` sees holding its export `export` on the
    /// node. Err: why the move cannot go on.
    async fn held(
        &self,
        vol: &MovedVolume,
        pv: &str,
        agent: &str,
        export: &str,
    ) -> Result<Result<Vec<String>, String>, MoveError> {
        let pods = Api::<Pod>::namespaced(self.ctx.client.clone(), self.ns);
        let list = pods
            .list(&ListParams::default())
            .await
            .map_err(kube_err(format!("listing pods in {}", self.ns)))?;
        let mut held = Vec::new();
        for pod in list.items.iter().filter(|p| uses_claim(p, &vol.pvc)) {
            let name = pod.name_any();
            if let Some(owner) = pod
                .owner_references()
                .iter()
                .find(|o| o.controller == Some(true) && o.kind != "StatefulSet")
            {
                return Ok(Err(format!(
                    "pod {name} is run by {} {}, which would start it again: scale that to 0 \
                     first",
                    owner.kind, owner.name
                )));
            }
            if pod.metadata.deletion_timestamp.is_none() {
                deleted_or_gone(pods.delete(&name, &DeleteParams::default()).await)
                    .map_err(kube_err(format!("deleting pod {name}")))?;
                tracing::info!(pod = %format!("{}/{name}", self.ns), "deleted for a move");
            }
            held.push(format!("pod {name} is still there"));
        }
        for va in self.ctx.caches.attachments.state() {
            if va.spec.source.persistent_volume_name.as_deref() == Some(pv) {
                held.push(format!("VolumeAttachment {} is still there", va.name_any()));
            }
        }
        if !held.is_empty() {
            return Ok(Ok(held));
        }
        Ok(Ok(match self.ctx.agents.holders(agent, export).await {
            Ok(h) => h.into_iter().map(|h| format!("on its node, {h}")).collect(),
            Err(e) => vec![format!("its agent cannot say what holds it: {e}")],
        }))
    }

    /// Waits while `held` names something, failing `vol` past the timeout; true once
    /// nothing holds the volume.
    fn released(&self, vol: &mut MovedVolume, held: Vec<String>) -> bool {
        if held.is_empty() {
            vol.released_time = Some(self.now.clone());
            tracing::info!(pvc = %format!("{}/{}", self.ns, vol.pvc), "released: nothing holds the volume");
            return true;
        }
        let what = held.join("; ");
        if self.elapsed(&vol.start_time) > self.timeout {
            vol.phase = MovePhase::Failed;
            vol.message = Some(format!(
                "not released within {} s: {what}. Stop what holds it and create the move \
                 again; a destination fences this side after its own timeout",
                self.timeout.as_secs()
            ));
        } else {
            vol.message = Some(format!("waiting for the workload to let go: {what}"));
        }
        false
    }

    /// The destination: wait for the final cycle (or the timeout), promote.
    async fn destination(&self, vol: &mut MovedVolume) -> Result<(), MoveError> {
        let Some((pair, pv)) = self.paired(vol, "the secondary of the source's").await? else {
            return Ok(());
        };
        if pair.wants() == "primary" {
            vol.phase = MovePhase::Promoting;
            if !pair.completed(reasons::PROMOTED) {
                vol.message = Some(format!("promoting ({})", pair.said()));
                return Ok(());
            }
            vol.epoch = pair
                .vr
                .status
                .as_ref()
                .and_then(|s| s.epoch)
                .map(|e| e as u64);
            self.set_policy(&pv, vol, Some(())).await?;
            vol.phase = MovePhase::Completed;
            vol.completion_time = Some(self.now.clone());
            vol.message = Some(if vol.fenced {
                "owned here, promoted by force: the old owner is fenced".into()
            } else {
                "owned here, from the source's final cycle".into()
            });
            return Ok(());
        }
        vol.phase = MovePhase::Waiting;
        let Some(r) = pair.vr.status.as_ref().and_then(|s| s.relationship.clone()) else {
            vol.message = Some(format!(
                "VolumeReplication {} has no relationship yet",
                pair.name
            ));
            return Ok(());
        };
        let status = self.ctx.agents.get(&r.agent, &r.name).await;
        let last = status
            .as_ref()
            .ok()
            .and_then(|s| s.as_ref()?.last_cycle.clone());
        // The handover: the source's final cycle, applied here (not one this side
        // shipped when it was demoted itself).
        if status
            .as_ref()
            .is_ok_and(|s| s.as_ref().is_some_and(|s| s.handed_over))
        {
            tracing::info!(pvc = %format!("{}/{}", self.ns, vol.pvc), cycle = last.map(|c| c.id), "the source's final cycle is applied: promoting");
            vol.message = Some("the final cycle is applied; promoting".into());
        } else if let Some(after) = self
            .force_after
            .filter(|after| self.elapsed(&vol.start_time) > *after)
        {
            vol.fenced = true;
            let applied = last.map_or("none".to_string(), |c| format!("cycle {}", c.id));
            tracing::warn!(pvc = %format!("{}/{}", self.ns, vol.pvc), "no final cycle from the source within forceAfterSeconds ({} s; last applied: {applied}): promoting by force, fencing the old owner", after.as_secs());
            vol.message = Some(format!(
                "no final cycle from the source within forceAfterSeconds ({} s; last applied: \
                 {applied}): promoting by force; the old owner is fenced and its later writes \
                 are refused",
                after.as_secs()
            ));
        } else {
            let waiting = match status {
                Ok(Some(s)) => format!(
                    "waiting for the source's final cycle (last applied: {})",
                    s.last_cycle
                        .map_or("none".into(), |c| format!("cycle {}", c.id))
                ),
                Ok(None) => "waiting for the source's final cycle (none applied yet)".into(),
                Err(e) => format!("waiting for the source's final cycle: {e}"),
            };
            vol.message = Some(match self.force_after {
                Some(after) => format!("{waiting}; promoting by force after {} s", after.as_secs()),
                None => format!(
                    "{waiting}, as long as it takes: if the source is gone for good, set \
                     forceAfterSeconds to promote by force (what it wrote after its last \
                     cycle is lost)"
                ),
            });
            return Ok(());
        }
        self.set_state(&pair, "primary").await?;
        vol.phase = MovePhase::Promoting;
        Ok(())
    }
}

/// A field set on the side it does not apply to, which would not do what its writer
/// expects: the move fails at once and says so. The CRD's rules refuse these when a
/// move is written; this catches the moves written before those rules (a destination's
/// `timeoutSeconds` used to force, and would now be ignored without a word).
fn misplaced_field(spec: &crate::crd::VolumeMoveSpec) -> Option<String> {
    match spec.side {
        MoveSide::Destination if spec.timeout_seconds.is_some() => Some(
            "timeoutSeconds bounds the source's release and does nothing on the destination; \
             a forced promotion, which fences the source, must be asked for with \
             forceAfterSeconds"
                .into(),
        ),
        MoveSide::Source if spec.force_after_seconds.is_some() => Some(
            "forceAfterSeconds is the destination's (when to promote by force); on the \
             source, timeoutSeconds bounds how long the workload has to let go"
                .into(),
        ),
        _ => None,
    }
}

/// The HydrationSource a PVC made again within a cluster is filled from.
fn hydration_source_name(pvc: &str) -> String {
    format!("moved-{pvc}")
}

/// Marks `vol` failed with `why`, the user's to fix.
fn fail(vol: &mut MovedVolume, why: &str) -> Result<(), MoveError> {
    vol.phase = MovePhase::Failed;
    vol.message = Some(why.to_string());
    Ok(())
}

/// `pod` mounts the PVC `claim`.
fn uses_claim(pod: &Pod, claim: &str) -> bool {
    pod.spec
        .iter()
        .flat_map(|s| s.volumes.iter().flatten())
        .any(|v| {
            v.persistent_volume_claim
                .as_ref()
                .is_some_and(|c| c.claim_name == claim)
        })
}

/// Retries after a failed API call.
pub fn error_policy(mv: Arc<VolumeMove>, error: &MoveError, _: Arc<Context>) -> Action {
    tracing::warn!(volumemove = %format!("{}/{}", mv.namespace().unwrap_or_default(), mv.name_any()), "{error}");
    Action::requeue(POLL * 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stateful_sets_claims_come_ordinal_by_ordinal() {
        let sts: StatefulSet = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "db", "namespace": "app"},
            "spec": {
                "selector": {}, "serviceName": "db", "template": {},
                "ordinals": {"start": 1},
                "volumeClaimTemplates": [{"metadata": {"name": "data"}}, {"metadata": {"name": "wal"}}],
            }
        }))
        .unwrap();
        assert_eq!(
            stateful_set_claims(&sts, 2),
            ["data-db-1", "wal-db-1", "data-db-2", "wal-db-2"]
        );
        assert!(stateful_set_claims(&sts, 0).is_empty());
    }

    #[test]
    fn a_pod_uses_a_claim_only_through_a_pvc_volume_of_that_name() {
        let pod = |claim: &str| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p"},
                "spec": {"containers": [], "volumes": [
                    {"name": "tmp", "emptyDir": {}},
                    {"name": "v", "persistentVolumeClaim": {"claimName": claim}},
                ]}
            }))
            .unwrap()
        };
        assert!(uses_claim(&pod("data"), "data"));
        assert!(!uses_claim(&pod("data-2"), "data"));
    }

    #[test]
    fn a_destination_forces_only_when_asked_and_each_side_refuses_the_others_field() {
        let spec =
            |yaml: &str| -> crate::crd::VolumeMoveSpec { serde_saphyr::from_str(yaml).unwrap() };
        assert_eq!(
            misplaced_field(&spec("side: Destination\npvc: data\n")),
            None
        );
        assert_eq!(
            misplaced_field(&spec(
                "side: Destination\npvc: data\nforceAfterSeconds: 60\n"
            )),
            None
        );
        assert_eq!(
            misplaced_field(&spec("side: Source\npvc: data\ntimeoutSeconds: 60\n")),
            None
        );
        let old_style =
            misplaced_field(&spec("side: Destination\npvc: data\ntimeoutSeconds: 300\n"));
        assert!(old_style.is_some_and(|m| m.contains("forceAfterSeconds")));
        let wrong_side = misplaced_field(&spec("side: Source\npvc: data\nforceAfterSeconds: 5\n"));
        assert!(wrong_side.is_some_and(|m| m.contains("destination's")));
    }
}
