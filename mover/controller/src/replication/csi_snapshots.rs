//! Cycles whose point in time is a CSI VolumeSnapshot (class parameter
//! `volumeSnapshotClassName`): any CSI driver with snapshots gives a replica of one
//! instant, whatever the volume is.
//!
//! One step per reconcile, each idempotent, so that a restarted controller (or a new
//! leader) picks up where the last stopped, from what the API server holds:
//! 1. A VolumeSnapshot of the PVC is taken when the last one is one interval old
//!    (labelled with the relationship; named `PVC-mover-UNIXMS`).
//! 2. Once it is ready, a clone PVC of it (same name, `volumeMode: Block`, bound to the
//!    agent's node by `volume.kubernetes.io/selected-node`), and once that is bound a
//!    reader pod using it as a raw device, pinned to that node (`spec.nodeName`). The kubelet publishes the
//!    clone's device under its `volumeDevices/PV/dev` directory, which the agent serves.
//!    This is how VolSync and Velero's data movers reach a snapshot too: a short-lived
//!    pod. mover's pod only holds the device (a pause container); the agent reads it.
//! 3. The changed blocks since the last cycle's snapshot come from the driver's
//!    SnapshotMetadata service ([`super::snapshot_metadata`]); without it, or when it
//!    fails, the cycle compares every chunk: slower, never wrong.
//! 4. The agent runs the cycle (CycleFrom) and reports the snapshot it read as its last
//!    cycle's. That report is the base: older snapshots, the clone and the reader pod
//!    are deleted after it.
//!
//! Each step is taken when the object the last one waits on changes: the snapshots,
//! clones and readers are watched by their label ([`changes`]), not polled.

use super::desired::Desired;
pub use super::desired::Source;
use super::snapshot_metadata::{self, DeltaOf, Retry};
pub use crate::context::SnapshotSettings as Settings;
use crate::context::{Context, created_or_exists};
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams};
use kube::api::{PostParams, ResourceExt};
use mover_engine::node::name_hash;
use std::time::Duration;
use transport::control;

/// Labels what the controller makes for a relationship (its name's hash: names hold '/').
pub const LABEL: &str = "replication.mover/relationship";
/// Marks the snapshot of a demote's final cycle: one taken before the demote was asked
/// for may miss the workload's last writes, so it is not read as the final one.
const FINAL: &str = "replication.mover/final";
/// Where the kubelet binds a block volume's device for each pod using it.
const KUBELET_VOLUME_DEVICES: &str = "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices";
/// The reader pod's image: it only holds the device for the kubelet to publish.
pub const READER_IMAGE: &str = "registry.k8s.io/pause:3.10";
/// How soon a step that waits on the API server (a snapshot becoming ready, a clone
/// binding, the kubelet running the reader) is looked at again if no change of those
/// objects came first: they are watched ([`changes`]), so this is only the fallback of a
/// missed event.
pub const WAITING_FALLBACK: Duration = Duration::from_secs(5);

/// How soon a snapshot that could not be taken (a freeze past its bound, a driver's
/// error) is tried again.
pub const RETRY_TAKE: Duration = Duration::from_secs(10);

/// Where a step left the cycle.
#[derive(Debug)]
pub enum Step {
    /// Waiting on the API server or the kubelet: look again when one of the cycle's
    /// objects changes, or in [`WAITING_FALLBACK`].
    Waiting(String),
    /// A cycle was committed: the agent's status after it.
    Ran(Box<control::Status>),
    /// Nothing to do until the next snapshot is due, in this long.
    Idle(Duration),
    /// A step failed (said in the status); retried at the next reconcile.
    Failed(String),
}

fn resource(kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "snapshot.storage.k8s.io",
        "v1",
        kind,
    ))
}

fn created_ms(o: &DynamicObject) -> i64 {
    o.metadata
        .creation_timestamp
        .as_ref()
        .map_or(0, |t| t.0.as_millisecond())
}

/// A ready snapshot's CSI handle and when the driver took it (Unix ms), from its
/// VolumeSnapshotContent.
async fn content_of(
    client: &kube::Client,
    snapshot: &DynamicObject,
) -> Result<Option<(String, i64)>, String> {
    let Some(content) = snapshot.data["status"]["boundVolumeSnapshotContentName"].as_str() else {
        return Ok(None);
    };
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource("VolumeSnapshotContent"));
    let c = api
        .get_opt(content)
        .await
        .map_err(|e| format!("cannot read VolumeSnapshotContent {content}: {e}"))?;
    let Some(c) = c else { return Ok(None) };
    let handle = c.data["status"]["snapshotHandle"]
        .as_str()
        .map(str::to_string);
    // creationTime is in nanoseconds since the epoch.
    let at = c.data["status"]["creationTime"]
        .as_i64()
        .map_or_else(|| created_ms(snapshot), |ns| ns / 1_000_000);
    Ok(handle.map(|h| (h, at)))
}

/// The changes of what cycles from CSI snapshots make (VolumeSnapshots, clone PVCs,
/// reader pods, all labelled [`LABEL`]), each as (namespace, the label: the
/// relationship's name hash). Its VolumeReplication is looked at again at each, so a
/// step is taken as soon as the snapshot is ready, the clone bound or the reader
/// running. Three label-selected watches (the clones and readers metadata only): the
/// API server sends nothing about other objects. Without the VolumeSnapshot CRD, its
/// watch retries with back-off, quietly.
pub fn changes(
    client: &kube::Client,
) -> impl futures::Stream<Item = (String, String)> + Send + 'static {
    use futures::StreamExt;
    use kube::core::PartialObjectMeta;
    use kube::runtime::{WatchStreamExt, watcher};
    fn key<K: ResourceExt>(o: &K) -> Option<(String, String)> {
        Some((o.namespace()?, o.labels().get(LABEL)?.clone()))
    }
    fn keys<K: ResourceExt, E>(
        events: impl futures::Stream<Item = Result<K, E>> + Send + 'static,
    ) -> futures::stream::BoxStream<'static, (String, String)> {
        events
            .filter_map(|o| std::future::ready(o.ok().and_then(|o| key(&o))))
            .boxed()
    }
    let labelled = || kube::runtime::watcher::Config::default().labels(LABEL);
    let snapshots: Api<DynamicObject> = Api::all_with(client.clone(), &resource("VolumeSnapshot"));
    futures::stream::select_all([
        keys(
            watcher(snapshots, labelled())
                .default_backoff()
                .applied_objects(),
        ),
        keys(
            watcher(
                Api::<PartialObjectMeta<PersistentVolumeClaim>>::all(client.clone()),
                labelled(),
            )
            .default_backoff()
            .applied_objects(),
        ),
        keys(
            watcher(
                Api::<PartialObjectMeta<Pod>>::all(client.clone()),
                labelled(),
            )
            .default_backoff()
            .applied_objects(),
        ),
    ])
}

/// Lists what carries relationship `name`'s label: its snapshots, clones and readers.
fn labelled(name: &str) -> ListParams {
    ListParams::default().labels(&format!("{LABEL}={}", name_hash(name)))
}

/// Deletes `name`'s clone PVC and reader pod (absent is fine).
async fn remove_reader(client: &kube::Client, ns: &str, name: &str) -> Result<(), String> {
    remove_pod(&Api::namespaced(client.clone(), ns), ns, name).await?;
    remove_clone(&Api::namespaced(client.clone(), ns), ns, name).await
}

/// Deletes the clone PVC `name` (absent is fine).
async fn remove_clone(
    pvcs: &Api<PersistentVolumeClaim>,
    ns: &str,
    name: &str,
) -> Result<(), String> {
    match pvcs.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(format!("cannot delete the clone PVC {ns}/{name}: {e}")),
    }
}

/// Deletes the reader pod `name` at once (absent is fine).
async fn remove_pod(pods: &Api<Pod>, ns: &str, name: &str) -> Result<(), String> {
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    match pods.delete(name, &now).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(format!("cannot delete the reader pod {ns}/{name}: {e}")),
    }
}

/// How a pod ended ("Failed: reason: message"), if it did.
fn ended(pod: &Pod) -> Option<String> {
    let st = pod.status.as_ref()?;
    let phase = st
        .phase
        .as_deref()
        .filter(|p| *p == "Failed" || *p == "Succeeded")?;
    let exit = st
        .container_statuses
        .iter()
        .flatten()
        .find_map(|c| c.state.as_ref()?.terminated.as_ref())
        .map(|t| match &t.reason {
            Some(r) => format!("its container exited {} ({r})", t.exit_code),
            None => format!("its container exited {}", t.exit_code),
        });
    let why = [st.reason.clone(), st.message.clone(), exit]
        .into_iter()
        .flatten()
        .collect::<Vec<_>>()
        .join(": ");
    Some(if why.is_empty() {
        phase.to_string()
    } else {
        format!("{phase}: {why}")
    })
}

/// Deletes the snapshot `name` with its clone and reader.
async fn remove_snapshot(client: &kube::Client, ns: &str, name: &str) -> Result<(), String> {
    remove_reader(client, ns, name).await?;
    delete_snapshot(client, ns, name).await
}

/// Deletes the VolumeSnapshot `name` alone (absent is fine).
async fn delete_snapshot(client: &kube::Client, ns: &str, name: &str) -> Result<(), String> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &resource("VolumeSnapshot"));
    match api.delete(name, &DeleteParams::default()).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(format!("cannot delete VolumeSnapshot {ns}/{name}: {e}")),
    }
}

/// Deletes every snapshot, clone and reader of relationship `name` in `ns` (the
/// VolumeReplication is deleted).
pub async fn remove_all(client: &kube::Client, ns: &str, name: &str) -> Result<(), String> {
    // By label, each after what reads it: the readers, then the clones (those of a
    // snapshot already going too, a deletion cut short before it reached them), then
    // the snapshots.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let readers = pods
        .list(&labelled(name))
        .await
        .map_err(|e| format!("cannot list the reader pods in {ns}: {e}"))?;
    for pod in readers.items {
        remove_pod(&pods, ns, &pod.name_any()).await?;
    }
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let clones = pvcs
        .list(&labelled(name))
        .await
        .map_err(|e| format!("cannot list the clone PVCs in {ns}: {e}"))?;
    for pvc in clones.items {
        remove_clone(&pvcs, ns, &pvc.name_any()).await?;
    }
    for s in snapshots(client, ns, name).await? {
        delete_snapshot(client, ns, &s.name_any()).await?;
    }
    Ok(())
}

/// The relationship's snapshots not being deleted, oldest first.
async fn snapshots(
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Result<Vec<DynamicObject>, String> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &resource("VolumeSnapshot"));
    let mut list = api
        .list(&labelled(name))
        .await
        .map_err(|e| {
            format!(
                "cannot list VolumeSnapshots in {ns}: {e}; are the snapshot CRDs installed \
                 (external-snapshotter), and may the controller read them?"
            )
        })?
        .items;
    // One being deleted (its finalizers not yet removed) is gone already.
    list.retain(|s| s.metadata.deletion_timestamp.is_none());
    list.sort_by_key(|s| (created_ms(s), s.name_any()));
    Ok(list)
}

/// One step of `d`'s cycle from snapshots, the agent's relationship being `s`; `last`:
/// a demote's final cycle (a snapshot is taken now, whatever the interval).
pub async fn step(
    ctx: &Context,
    d: &Desired,
    src: &Source,
    s: &control::Status,
    last: bool,
) -> Step {
    match run_step(ctx, d, src, s, last).await {
        Ok(step) => step,
        Err(why) => Step::Failed(why),
    }
}

async fn run_step(
    ctx: &Context,
    d: &Desired,
    src: &Source,
    s: &control::Status,
    last: bool,
) -> Result<Step, String> {
    let client = &ctx.client;
    let ns = &src.namespace;
    let all = snapshots(client, ns, &d.name).await?;
    // Each snapshot's handle and time, read once (only when there is a base to find).
    let mut contents = vec![None; all.len()];
    // The base: the snapshot the agent's last committed cycle read.
    let mut base: Option<(usize, String)> = None;
    if !s.last_snapshot.is_empty() {
        for (i, snap) in all.iter().enumerate() {
            contents[i] = content_of(client, snap).await?;
            if let Some((handle, _)) = &contents[i]
                && *handle == s.last_snapshot
            {
                base = Some((i, handle.clone()));
            }
        }
    }
    // What is older than the base is of no use any more; so is a snapshot taken for a
    // cycle that never reached the agent, once a newer one exists.
    let keep_from = base
        .as_ref()
        .map_or(all.len().saturating_sub(1), |(i, _)| *i);
    for old in &all[..keep_from.min(all.len())] {
        remove_snapshot(client, ns, &old.name_any()).await?;
    }
    let base_at = base.as_ref().map(|(i, _)| created_ms(&all[*i]));
    let pending = all
        .iter()
        .enumerate()
        .skip(keep_from)
        .find(|(i, _)| base.as_ref().is_none_or(|(b, _)| i > b));
    let (pending_at, pending) = pending.unzip();
    if let Some(p) = pending.filter(|p| last && p.annotations().get(FINAL).is_none()) {
        remove_snapshot(client, ns, &p.name_any()).await?;
        let name = take(ctx, d, src, last).await?;
        return Ok(Step::Waiting(format!(
            "VolumeSnapshot {ns}/{name} taken for the final cycle"
        )));
    }
    let Some(pending) = pending else {
        let interval = d.params.interval.as_millis() as i64;
        let due_in = base_at.map_or(0, |at| at + interval - mover_engine::node::now_ms());
        if due_in > 0 && !last {
            return Ok(Step::Idle(Duration::from_millis(due_in as u64)));
        }
        let name = take(ctx, d, src, last).await?;
        return Ok(Step::Waiting(format!("VolumeSnapshot {ns}/{name} taken")));
    };
    let name = pending.name_any();
    if pending.data["status"]["readyToUse"].as_bool() != Some(true) {
        let error = pending.data["status"]["error"]["message"].as_str();
        return Ok(Step::Waiting(match error {
            Some(e) => format!("VolumeSnapshot {ns}/{name} is not ready: {e}"),
            None => format!("VolumeSnapshot {ns}/{name} is not ready yet"),
        }));
    }
    let content = match pending_at.and_then(|i| contents[i].take()) {
        Some(c) => Some(c),
        None => content_of(client, pending).await?,
    };
    let Some((handle, taken_ms)) = content else {
        return Ok(Step::Waiting(format!(
            "VolumeSnapshot {ns}/{name} has no snapshot handle yet"
        )));
    };
    let size = pending.data["status"]["restoreSize"]
        .as_str()
        .map(str::to_string);
    let (clone_pv, stages) = match reader(client, d, src, &name, size).await? {
        Some(ready) => ready,
        None => {
            return Ok(Step::Waiting(format!(
                "the clone of VolumeSnapshot {ns}/{name} is not bound, or its reader pod not \
                 running, yet"
            )));
        }
    };
    let devices = format!("{KUBELET_VOLUME_DEVICES}/{clone_pv}/dev");
    ctx.agents
        .export(
            &d.agent,
            &clone_pv,
            &devices,
            true,
            &d.name,
            d.peer_credential.as_deref(),
        )
        .await
        .map_err(|e| e.to_string())?;
    // Changed blocks since the base, from the driver; any failure: compare everything.
    let changed = match &base {
        None => None,
        Some((_, base_handle)) => match delta(ctx, src, base_handle, &name).await {
            Ok(c) => {
                tracing::info!(relationship = %d.name, snapshot = %name, ranges = c.ranges.len(), bytes = c.bytes(), calls = c.calls, "changed blocks from SnapshotMetadata");
                Some(c.ranges)
            }
            Err(e) => {
                tracing::warn!(relationship = %d.name, snapshot = %name, "{e}");
                None
            }
        },
    };
    let req = control::CycleFromRequest {
        name: d.name.clone(),
        export: clone_pv.clone(),
        snapshot: handle,
        point_in_time_ms: taken_ms,
        base_snapshot: base.map(|(_, h)| h).unwrap_or_default(),
        changed_known: changed.is_some(),
        changed: changed
            .unwrap_or_default()
            .into_iter()
            .map(|r| control::ByteRange {
                offset: r.start,
                length: r.end - r.start,
            })
            .collect(),
        r#final: last,
    };
    let agent_started = std::time::Instant::now();
    let ran = ctx.agents.cycle_from(&d.agent, req).await;
    if let Err(e) = &ran
        && e.refusal == Some(transport::refusal::Refusal::NoDevice)
    {
        return Ok(Step::Waiting(format!(
            "the clone of VolumeSnapshot {ns}/{name} is not published on node {} yet (its \
             reader pod {ns}/{name} is not running)",
            d.node
        )));
    }
    let status = ran.map_err(|e| e.to_string())?;
    // What the cycle took from the snapshot's creation, when its clone and reader came
    // to be and ran (to the second), and the agent's part: the rest is the driver, the
    // snapshot controller, the kubelet and this controller.
    let taken = created_ms(pending);
    let since = |at: i64| if at > 0 { at - taken } else { -1 };
    tracing::info!(
        relationship = %d.name,
        snapshot = %name,
        since_taken_ms = mover_engine::node::now_ms() - taken,
        clone_at_ms = since(stages.clone_created),
        reader_at_ms = since(stages.reader_created),
        running_at_ms = since(stages.reader_running),
        agent_ms = agent_started.elapsed().as_millis() as u64,
        "cycle from a VolumeSnapshot committed"
    );
    // Committed: the clone is read; the snapshot stays as the next cycle's base.
    if let Err(e) = ctx.agents.unexport(&d.agent, &clone_pv).await {
        tracing::warn!(relationship = %d.name, "{e}");
    }
    remove_reader(client, ns, &name).await?;
    Ok(Step::Ran(Box::new(status)))
}

/// Takes a VolumeSnapshot of the PVC (`last`: for a demote's final cycle), with the
/// file systems mounted from it on its node frozen until the driver has cut it; returns
/// its name. A snapshot not cut within the class's freeze timeout is deleted: the
/// watchdog thawed the file systems before it was taken.
async fn take(ctx: &Context, d: &Desired, src: &Source, last: bool) -> Result<String, String> {
    // The same reason again while it waits: the status does not change meanwhile.
    if let Some((at, why)) = ctx.csi.failed.lock().expect("lock").get(&d.name)
        && at.elapsed() < RETRY_TAKE
    {
        return Err(why.clone());
    }
    let taken = take_hooked(ctx, d, src, last).await;
    let mut failed = ctx.csi.failed.lock().expect("lock");
    match &taken {
        Ok(_) => failed.remove(&d.name),
        Err(why) => failed.insert(d.name.clone(), (std::time::Instant::now(), why.clone())),
    };
    taken
}

/// The class's pre-hook, the frozen snapshot, then its post-hook: after any pre-hook
/// that was tried, it undoes what the pre-hook did, whether the snapshot or the
/// pre-hook itself failed (a pre-hook may have done its work in one pod and failed in
/// the next, or answered too late; and a controller stopped between the two hooks left
/// a workload frozen that only the next post-hook lets go).
async fn take_hooked(
    ctx: &Context,
    d: &Desired,
    src: &Source,
    last: bool,
) -> Result<String, String> {
    let (pre, post) = &d.params.hooks;
    let prepared = match pre {
        Some(h) => super::hooks::run(&ctx.client, &src.namespace, &src.pvc, h)
            .await
            .map(|pods| tracing::info!(relationship = %d.name, ?pods, "pre-snapshot hook ran")),
        None => Ok(()),
    };
    let taken = match prepared {
        Ok(()) => take_frozen(ctx, d, src, last).await,
        Err(e) => Err(e),
    };
    if let Some(h) = post {
        match super::hooks::run(&ctx.client, &src.namespace, &src.pvc, h).await {
            Ok(pods) => tracing::info!(relationship = %d.name, ?pods, "post-snapshot hook ran"),
            Err(e) => tracing::warn!(relationship = %d.name, "post-snapshot {e}"),
        }
    }
    taken
}

async fn take_frozen(
    ctx: &Context,
    d: &Desired,
    src: &Source,
    last: bool,
) -> Result<String, String> {
    let bound = d.params.freeze_timeout;
    let frozen = ctx
        .agents
        .freeze(&d.agent, &d.name, bound)
        .await
        .map_err(|e| e.to_string())?;
    let created = create(&ctx.client, d, src, last).await;
    // Whatever holds the workload still (the agent's freeze, or the class's hooks: a
    // pre-hook's `fsfreeze -f` in the pod) is let go only once the driver has cut the
    // snapshot, not when its object is made: a driver cuts it later, and a cut after the
    // post-hook's thaw would not be the instant the hooks made.
    let held = !frozen.mounts.is_empty() || d.params.hooks.1.is_some();
    let cut = match &created {
        Ok(name) if held => wait_cut(&ctx.client, &src.namespace, name, bound).await,
        _ => Ok(()),
    };
    let thawed = match frozen.mounts.is_empty() {
        true => Ok(()),
        false => ctx.agents.thaw(&d.agent, &d.name).await.map(|t| {
            tracing::info!(relationship = %d.name, mounts = ?t.mounts, held_ms = t.held_ms, "VolumeSnapshot cut while frozen");
        }),
    };
    let name = created?;
    if let Err(e) = thawed.map_err(|e| e.message).and(cut) {
        remove_snapshot(&ctx.client, &src.namespace, &name).await?;
        let still = match frozen.mounts.is_empty() {
            true => "the workload stayed as its pre-snapshot hook left it".to_string(),
            false => format!("{} stayed frozen", frozen.mounts.join(", ")),
        };
        return Err(format!(
            "VolumeSnapshot {}/{name} was not cut while {still} (freezeTimeout {}ms): \
             {e}; it is deleted and the next cycle tries again (raise the class's \
             freezeTimeout if the driver is slow to cut snapshots)",
            src.namespace,
            bound.as_millis()
        ));
    }
    Ok(name)
}

/// Waits until the driver has cut snapshot `name` (its `status.creationTime` is set),
/// for at most `bound`. Watched, not polled: the pod stays frozen until this returns,
/// so it returns on the event that says the cut is taken (or failed).
async fn wait_cut(
    client: &kube::Client,
    ns: &str,
    name: &str,
    bound: Duration,
) -> Result<(), String> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns, &resource("VolumeSnapshot"));
    let status = |s: &DynamicObject| s.data["status"].clone();
    let cut_or_failed = move |s: Option<&DynamicObject>| {
        s.map(status)
            .is_some_and(|st| st["creationTime"].is_string() || st["error"]["message"].is_string())
    };
    let waited = tokio::time::timeout(
        bound,
        kube::runtime::wait::await_condition(api, name, cut_or_failed),
    )
    .await
    .map_err(|_| "not cut in time".to_string())?
    .map_err(|e| e.to_string())?;
    let st = waited.as_ref().map(status).unwrap_or_default();
    match st["error"]["message"].as_str() {
        Some(e) if !st["creationTime"].is_string() => Err(format!("the driver failed it: {e}")),
        _ => Ok(()),
    }
}

/// Creates the VolumeSnapshot of the PVC; returns its name.
async fn create(
    client: &kube::Client,
    d: &Desired,
    src: &Source,
    last: bool,
) -> Result<String, String> {
    let ns = &src.namespace;
    let now = mover_engine::node::now_ms();
    let name = format!("{}-mover-{now}", src.pvc);
    let name = name[name.len().saturating_sub(253)..].to_string();
    let ar = resource("VolumeSnapshot");
    let mut object = DynamicObject::new(&name, &ar)
        .within(ns)
        .data(serde_json::json!({
            "spec": {
                "volumeSnapshotClassName": src.class,
                "source": {"persistentVolumeClaimName": src.pvc},
            },
        }));
    object.metadata.labels = Some([(LABEL.to_string(), name_hash(&d.name))].into());
    let mut annotations = std::collections::BTreeMap::from([(LABEL.to_string(), d.name.clone())]);
    if last {
        annotations.insert(FINAL.into(), "true".into());
    }
    object.metadata.annotations = Some(annotations);
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    match api.create(&PostParams::default(), &object).await {
        Ok(_) => {}
        Err(kube::Error::Api(s)) if s.code == 409 => {}
        Err(e) => {
            return Err(format!(
                "cannot create VolumeSnapshot {ns}/{name} of class {}: {e}",
                src.class
            ));
        }
    }
    tracing::info!(relationship = %d.name, snapshot = %name, "VolumeSnapshot taken");
    Ok(name)
}

/// When a cycle's objects came to be (Unix ms, to the second as the API server keeps
/// them): what its log line tells of where a cycle's time goes.
struct Stages {
    clone_created: i64,
    reader_created: i64,
    reader_running: i64,
}

/// Makes sure the clone PVC of snapshot `name` and its reader pod exist; returns the
/// clone's PV once it is bound and its reader pod runs, and when they came to be.
async fn reader(
    client: &kube::Client,
    d: &Desired,
    src: &Source,
    name: &str,
    size: Option<String>,
) -> Result<Option<(String, Stages)>, String> {
    let ns = &src.namespace;
    let pvcs: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), ns);
    let labels = serde_json::json!({LABEL: name_hash(&d.name)});
    let pvc = match pvcs.get_opt(name).await.map_err(|e| e.to_string())? {
        Some(p) => p,
        None => {
            let size = match size {
                Some(s) => s,
                None => pvcs
                    .get(&src.pvc)
                    .await
                    .ok()
                    .and_then(|p| p.spec?.resources?.requests?.get("storage").cloned())
                    .map(|q| q.0)
                    .ok_or_else(|| format!("cannot tell the size of PVC {ns}/{}", src.pvc))?,
            };
            let clone: PersistentVolumeClaim = serde_json::from_value(serde_json::json!({
                "metadata": {
                    "name": name,
                    "labels": labels,
                    // The scheduler's choice, made here: the clone is read on this node.
                    "annotations": {"volume.kubernetes.io/selected-node": d.node},
                },
                "spec": {
                    "accessModes": ["ReadWriteOnce"],
                    "volumeMode": "Block",
                    "storageClassName": src.storage_class,
                    "resources": {"requests": {"storage": size}},
                    "dataSource": {
                        "apiGroup": "snapshot.storage.k8s.io",
                        "kind": "VolumeSnapshot",
                        "name": name,
                    },
                },
            }))
            .map_err(|e| e.to_string())?;
            created_or_exists(pvcs.create(&PostParams::default(), &clone).await)
                .map_err(|e| format!("cannot create the clone PVC {ns}/{name}: {e}"))?;
            return Ok(None);
        }
    };
    // The reader is made once the clone is bound (its watch says when): a pod whose PVC
    // is not bound yet fails the kubelet's first look and waits out its retry back-off
    // (18 s of a 20 s cycle here, with the pod made at once).
    let bound = pvc.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Bound");
    if !bound {
        return Ok(None);
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    // The kubelet publishes the clone's device before it starts the pod's container: a
    // running reader is a device the agent can open.
    let existing = pods.get_opt(name).await.map_err(|e| e.to_string())?;
    if let Some(pod) = &existing
        && let Some(ended) = ended(pod)
    {
        // Its container ended (killed, evicted, its node restarted): a pod that never
        // restarts never runs again. Deleted, it is made anew at the next look.
        if pod.metadata.deletion_timestamp.is_none() {
            tracing::warn!(relationship = %d.name, pod = %format!("{ns}/{name}"), "reader pod ended before it was read ({ended}); making it again");
            remove_pod(&pods, ns, name).await?;
        }
        return Ok(None);
    }
    let running = existing
        .as_ref()
        .and_then(|p| p.status.as_ref()?.phase.as_deref())
        == Some("Running");
    if existing.is_none() {
        let pod = reader_pod(name, &d.name, &d.node);
        created_or_exists(pods.create(&PostParams::default(), &pod).await)
            .map_err(|e| format!("cannot create the reader pod {ns}/{name}: {e}"))?;
    }
    let ms = |t: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>| {
        t.map_or(0, |t| t.0.as_millisecond())
    };
    let stages = Stages {
        clone_created: ms(pvc.metadata.creation_timestamp.as_ref()),
        reader_created: ms(existing
            .as_ref()
            .and_then(|p| p.metadata.creation_timestamp.as_ref())),
        reader_running: ms(existing.as_ref().and_then(|p| {
            let status = p.status.as_ref()?.container_statuses.as_ref()?.first()?;
            status.state.as_ref()?.running.as_ref()?.started_at.as_ref()
        })),
    };
    Ok(pvc
        .spec
        .and_then(|s| s.volume_name)
        .filter(|v| running && !v.is_empty())
        .map(|pv| (pv, stages)))
}

/// The reader pod of clone `name` (a PVC of that name) for relationship `relationship`,
/// on `node`: it holds the clone's device, published there, for the agent to read.
/// Pod Security `restricted`, with requests and limits for a namespace's ResourceQuota,
/// and the shape the controller's admission policy allows
/// (deploy/base/controller-admission.yaml).
pub fn reader_pod(name: &str, relationship: &str, node: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {
            "name": name,
            "labels": {LABEL: name_hash(relationship)},
            "annotations": {LABEL: relationship},
        },
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65535, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "hold",
                "image": READER_IMAGE,
                "volumeDevices": [{"name": "clone", "devicePath": "/dev/mover-clone"}],
                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
                "resources": {
                    "requests": {"cpu": "1m", "memory": "8Mi"},
                    "limits": {"cpu": "10m", "memory": "16Mi"},
                },
            }],
            "volumes": [{"name": "clone", "persistentVolumeClaim": {"claimName": name, "readOnly": true}}],
        },
    }))
    .expect("a Pod")
}

/// The ranges changed from the snapshot `base` (a CSI handle) to the VolumeSnapshot
/// `target`, from the driver's SnapshotMetadata service.
async fn delta(
    ctx: &Context,
    src: &Source,
    base: &str,
    target: &str,
) -> Result<snapshot_metadata::Changed, snapshot_metadata::MetadataError> {
    let service = snapshot_metadata::service(ctx.client.clone(), &src.driver).await?;
    let me = &ctx.csi;
    let token = snapshot_metadata::token(
        ctx.client.clone(),
        &me.namespace,
        &me.service_account,
        &service.audience,
    )
    .await?;
    let of = DeltaOf {
        namespace: &src.namespace,
        base_snapshot_id: base,
        target_snapshot_name: target,
    };
    let retry = Retry {
        tries: 5,
        first_backoff: Duration::from_millis(200),
    };
    snapshot_metadata::changed(&service, &token, of, retry).await
}
