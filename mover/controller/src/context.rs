//! What every reconciler shares: the watch caches, the [`Context`] a reconcile runs
//! with, and the small helpers of API calls (secrets, creates and deletes that may find
//! their work done).

use super::agents::Agents;
use super::crd::{self, VolumeReplicationClass};
use super::leftovers::Leftovers;
use super::secrets::SecretWatches;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod, Secret};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use kube::Resource;
use kube::api::{Api, DynamicObject};
use kube::core::ApiResource;
use kube::runtime::reflector::{ObjectRef, Store};
use std::sync::Arc;
use std::time::Duration;

/// How soon a volume whose replication is in trouble is looked at again (at most; its
/// interval if shorter): often enough that its conditions and RPO follow the trouble.
pub const TROUBLE_RETRY: Duration = Duration::from_secs(10);

/// The watch caches the reconciler reads instead of asking the API server.
#[derive(Clone)]
pub struct Caches {
    /// VolumeReplicationClasses (in the served group).
    pub classes: Store<DynamicObject>,
    /// PersistentVolumeClaims.
    pub pvcs: Store<PersistentVolumeClaim>,
    /// PersistentVolumes.
    pub pvs: Store<PersistentVolume>,
    /// VolumeAttachments.
    pub attachments: Store<VolumeAttachment>,
    /// The agent DaemonSet's pods.
    pub agents: Store<Pod>,
    /// Nodes, their metadata only (names and labels: what node affinities select).
    pub nodes: Store<Node>,
}

impl Caches {
    /// Caches holding just these objects and never updated: for tests, and for
    /// computing desired state without a cluster.
    pub fn fixed(
        group: &str,
        classes: Vec<VolumeReplicationClass>,
        pvcs: Vec<PersistentVolumeClaim>,
        pvs: Vec<PersistentVolume>,
        attachments: Vec<VolumeAttachment>,
        agents: Vec<Pod>,
    ) -> Caches {
        use kube::runtime::reflector::store::Writer;
        use kube::runtime::watcher::Event;
        fn fill<K>(dyntype: K::DynamicType, objs: Vec<K>) -> Store<K>
        where
            K: Resource + Clone + 'static,
            K::DynamicType: Clone + Eq + std::hash::Hash,
        {
            let mut w = Writer::new(dyntype);
            for o in objs {
                w.apply_watcher_event(&Event::Apply(o));
            }
            w.as_reader()
        }
        let ar = crd::api_resource(group, "VolumeReplicationClass");
        let classes = classes
            .into_iter()
            .map(|c| {
                let mut v = serde_json::to_value(&c).expect("a class serializes");
                v["apiVersion"] = ar.api_version.clone().into();
                serde_json::from_value(v).expect("a class is a dynamic object")
            })
            .collect();
        Caches {
            classes: fill(ar, classes),
            pvcs: fill((), pvcs),
            pvs: fill((), pvs),
            attachments: fill((), attachments),
            agents: fill((), agents),
            nodes: fill((), Vec::new()),
        }
    }
}

/// Copies of what a watch cache holds, for the pure functions that take slices.
pub(super) fn owned<K>(store: &Store<K>) -> Vec<K>
where
    K: kube::Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    store.state().iter().map(|o| (**o).clone()).collect()
}

/// Whether the cluster has node `name` (a node gone took what was on it with it).
pub(super) fn node_exists(ctx: &Context, name: &str) -> bool {
    ctx.caches
        .nodes
        .state()
        .iter()
        .any(|n| n.metadata.name.as_deref() == Some(name))
}

/// What every reconcile shares.
pub struct Context {
    /// The API server.
    pub client: kube::Client,
    /// The served API group (crd::MOVER_GROUP or crd::CSI_ADDONS_GROUP).
    pub group: String,
    /// The agents' control API.
    pub agents: Arc<dyn Agents>,
    /// Watch caches.
    pub caches: Caches,
    /// The agents' gRPC port.
    pub agent_port: u16,
    /// Prometheus metrics.
    pub metrics: Arc<super::metrics::Metrics>,
    /// Records events for transitions (none in tests that count requests).
    pub recorder: Option<kube::runtime::events::Recorder>,
    /// How long a deletion waits for an unreachable agent before it finishes anyway,
    /// leaving the relationship in `leftovers` (None: it waits for the agent).
    pub leftovers: Option<(Duration, Arc<Leftovers>)>,
    /// Watches of the secrets classes name (None: each read is a GET).
    pub secrets: Option<Arc<SecretWatches>>,
    /// Cycles from CSI snapshots: the controller's own ServiceAccount (for
    /// SnapshotMetadata tokens), failed snapshots' retry times.
    pub csi: SnapshotSettings,
    /// The image of the Jobs the controller runs (mover's own): the populator's restore
    /// into a PVC of another storage class.
    pub job_image: String,
}

impl Context {
    /// The VolumeReplication kind in the served group.
    pub fn vr_resource(&self) -> ApiResource {
        crd::api_resource(&self.group, "VolumeReplication")
    }

    pub(super) fn class(&self, name: &str) -> Option<VolumeReplicationClass> {
        let ar = crd::api_resource(&self.group, "VolumeReplicationClass");
        let obj = self.caches.classes.get(&ObjectRef::new_with(name, ar))?;
        match typed::<VolumeReplicationClass>(&obj) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::warn!(class = name, error = %e, "unreadable VolumeReplicationClass");
                None
            }
        }
    }
}

pub(super) fn typed<K: serde::de::DeserializeOwned>(
    obj: &DynamicObject,
) -> Result<K, serde_json::Error> {
    serde_json::to_value(obj).and_then(serde_json::from_value)
}

/// What the controller keeps for cycles from snapshots.
#[derive(Debug)]
pub struct SnapshotSettings {
    /// The namespace of the controller's own ServiceAccount: its audience-scoped tokens
    /// are what the SnapshotMetadata service authenticates.
    pub namespace: String,
    /// That ServiceAccount's name.
    pub service_account: String,
    /// When each relationship's last snapshot failed to be taken: the next try waits
    /// `csi_snapshots::RETRY_TAKE`, however often its VolumeReplication is reconciled (each failure
    /// writes its status, which reconciles it again).
    pub failed: std::sync::Mutex<std::collections::HashMap<String, (std::time::Instant, String)>>,
}

impl Default for SnapshotSettings {
    fn default() -> Self {
        SnapshotSettings {
            namespace: "mover-system".into(),
            service_account: "mover-controller".into(),
            failed: Default::default(),
        }
    }
}

/// The secret `ns/name`; `wanted` says what to put in it when it is missing.
pub(super) async fn secret(
    ctx: &Context,
    ns: &str,
    name: &str,
    wanted: &str,
) -> Result<Secret, String> {
    // From its watch (no request at rest); without one (tests), asked for.
    match &ctx.secrets {
        Some(watches) => watches.get(ns, name).await?,
        None => Api::<Secret>::namespaced(ctx.client.clone(), ns)
            .get_opt(name)
            .await
            .map_err(|e| format!("cannot read secret {ns}/{name}: {e}"))?,
    }
    .ok_or_else(|| format!("secret {ns}/{name} not found: create it with {wanted}"))
}

/// A secret's data and its version (uid/resourceVersion); `wanted` says what to put in
/// it when it is missing.
pub(super) async fn secret_data(
    ctx: &Context,
    ns: &str,
    name: &str,
    wanted: &str,
) -> Result<(std::collections::BTreeMap<String, Vec<u8>>, String), String> {
    let secret = secret(ctx, ns, name, wanted).await?;
    let version = format!(
        "{}/{}",
        secret.metadata.uid.as_deref().unwrap_or_default(),
        secret
            .metadata
            .resource_version
            .as_deref()
            .unwrap_or_default()
    );
    Ok((data_of(secret), version))
}

/// A create's outcome, the object existing already counted as done (an earlier pass
/// made it).
pub(super) fn created_or_exists<T>(r: Result<T, kube::Error>) -> Result<(), kube::Error> {
    match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// A delete's outcome, the object gone already counted as done.
pub(super) fn deleted_or_gone<T>(r: Result<T, kube::Error>) -> Result<(), kube::Error> {
    match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
        Err(e) => Err(e),
    }
}

/// A secret's data, each value as bytes.
pub(super) fn data_of(secret: Secret) -> std::collections::BTreeMap<String, Vec<u8>> {
    let data = secret.data.unwrap_or_default();
    data.into_iter().map(|(k, v)| (k, v.0)).collect()
}
