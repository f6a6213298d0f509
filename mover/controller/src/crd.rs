//! The custom resources: `VolumeReplicationClass` and `VolumeReplication`.
//!
//! Field names and types are csi-addons' (api/replication.storage/v1alpha1 of
//! kubernetes-csi-addons), so RamenDR and other csi-addons clients read and write them
//! unchanged; mover adds its own status fields (RPO, epoch, progress, the relationship)
//! next to them. The CRDs are generated from these types ([`crd_yaml`]) for either API
//! group: mover's own, or csi-addons' for clusters without a csi-addons controller.

use k8s_openapi::api::core::v1::TypedLocalObjectReference;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::{CustomResource, CustomResourceExt, KubeSchema};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// mover's own API group (the default).
pub const MOVER_GROUP: &str = "replication.mover";
/// csi-addons' API group: served instead of [`MOVER_GROUP`] where no csi-addons
/// controller runs, so RamenDR drives mover as it is.
pub const CSI_ADDONS_GROUP: &str = "replication.storage.openshift.io";
/// The one version of both kinds.
pub const VERSION: &str = "v1alpha1";

/// Storage-provisioner parameters for replicas, named by `VolumeReplication`s.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[kube(
    group = "replication.mover",
    version = "v1alpha1",
    kind = "VolumeReplicationClass",
    shortname = "vrc",
    status = "VolumeReplicationClassStatus",
    doc = "VolumeReplicationClass is the Schema for the volumereplicationclasses API.",
    printcolumn(
        name = "Provisioner",
        type_ = "string",
        json_path = ".spec.provisioner"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct VolumeReplicationClassSpec {
    /// Provisioner is the name of storage provisioner: the CSI driver of the volumes'
    /// StorageClass (RamenDR picks the class whose provisioner matches it).
    #[x_kube(validation = Rule::new("self == oldSelf").message("provisioner is immutable"))]
    pub provisioner: String,
    /// Parameters is a key-value map with storage provisioner specific configurations for
    /// creating volume replicas: schedulingInterval ("5m"), target (agent://HOST:PORT of
    /// the peer cluster's agents, or a repository URL), bandwidth ("100M" bytes/s),
    /// chunkSize ("1M"), replication.storage.openshift.io/replication-secret-name and
    /// -namespace.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[x_kube(validation = Rule::new("self == oldSelf").message("parameters are immutable"))]
    pub parameters: BTreeMap<String, String>,
}

/// Empty, as csi-addons' (which has the status subresource on classes too).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
pub struct VolumeReplicationClassStatus {}

/// The replication operation asked for.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReplicationState {
    /// Replicate this volume to the peer (promote it if it was a secondary).
    Primary,
    /// Receive cycles from the peer's primary (demote this side if it was primary).
    Secondary,
    /// Throw away this side's divergent writes and follow the primary again.
    Resync,
}

impl ReplicationState {
    /// As written in the spec.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicationState::Primary => "primary",
            ReplicationState::Secondary => "secondary",
            ReplicationState::Resync => "resync",
        }
    }
}

/// The state reached, as csi-addons reports it.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum State {
    /// Replicating to the peer.
    Primary,
    /// Receiving from the peer.
    Secondary,
    /// Not known (nothing done yet, or the last operation failed before any).
    Unknown,
}

/// Replication of one PVC's volume to a peer.
// clippy takes the repeated `printcolumn(type_ = ...)` for duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "replication.mover",
    version = "v1alpha1",
    kind = "VolumeReplication",
    namespaced,
    shortname = "vr",
    status = "VolumeReplicationStatus",
    doc = "VolumeReplication is the Schema for the volumereplications API.",
    printcolumn(
        name = "Desired",
        type_ = "string",
        json_path = ".spec.replicationState"
    ),
    printcolumn(name = "State", type_ = "string", json_path = ".status.state"),
    printcolumn(name = "PVC", type_ = "string", json_path = ".spec.dataSource.name"),
    printcolumn(name = "Last Sync", type_ = "date", json_path = ".status.lastSyncTime"),
    printcolumn(name = "RPO", type_ = "number", json_path = ".status.rpoSeconds"),
    printcolumn(
        name = "Consistency",
        type_ = "string",
        json_path = ".status.lastSyncConsistency"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct VolumeReplicationSpec {
    /// VolumeReplicationClass is the VolumeReplicationClass name for this
    /// VolumeReplication resource.
    #[x_kube(validation = Rule::new("self == oldSelf").message("volumeReplicationClass is immutable"))]
    pub volume_replication_class: String,
    /// ReplicationState represents the replication operation to be performed on the
    /// volume. Supported operations are "primary", "secondary" and "resync".
    pub replication_state: ReplicationState,
    /// DataSource represents the object associated with the volume (a
    /// PersistentVolumeClaim).
    #[x_kube(validation = Rule::new("self == oldSelf").message("dataSource is immutable"))]
    pub data_source: TypedLocalObjectReference,
    /// AutoResync represents the volume to be auto resynced when ReplicationState is
    /// "secondary".
    #[serde(default)]
    pub auto_resync: bool,
    /// replicationHandle represents an existing (but new) replication id; mover uses it
    /// as the relationship's name when set.
    #[serde(default)]
    pub replication_handle: String,
}

/// What the controller observed. csi-addons' fields first, then mover's own.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeReplicationStatus {
    /// State captures the latest state of the replication operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<State>,
    /// What was done last, or what failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Conditions are the list of conditions and their status.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// observedGeneration is the last generation change the operator has dealt with.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// When the last reconcile that changed the relationship started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_start_time: Option<Time>,
    /// When the last reconcile that changed the relationship completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_completion_time: Option<Time>,
    /// The point in time of the last cycle the secondary applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sync_time: Option<Time>,
    /// Bytes shipped by that cycle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sync_bytes: Option<i64>,
    /// How long that cycle took, as a Go duration ("1m30.5s").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sync_duration: Option<String>,
    /// DestinationVolumeID is the volume ID on the destination/target side (mover: the
    /// peer's agent://HOST:PORT/VOLUME).
    #[serde(
        default,
        rename = "destinationVolumeID",
        skip_serializing_if = "Option::is_none"
    )]
    pub destination_volume_id: Option<String>,
    /// mover: what the last applied cycle is of: `point-in-time` (the volume at one
    /// instant), `crash-inconsistent` (read live: blocks from different instants) or
    /// `file-consistent` (a file tree, each file as it was when read).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_sync_consistency: Option<String>,
    /// mover: seconds between now and the point in time of the last applied cycle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpo_seconds: Option<f64>,
    /// mover: the relationship's fencing epoch (raised on each promote).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<i64>,
    /// mover: the cycle running now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// mover: the relationship this resource drives, as it was set up; the controller
    /// compares the spec with it to refuse changes of immutable fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relationship: Option<RelationshipRef>,
}

/// Bytes compared so far of the running cycle.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Progress {
    /// Compared so far.
    pub bytes_done: i64,
    /// The whole volume.
    pub bytes_total: i64,
}

/// Where a resource's relationship lives and what it was made from.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RelationshipRef {
    /// The relationship's name on both sides' agents.
    pub name: String,
    /// The agent that holds this side: HOST:PORT.
    pub agent: String,
    /// That agent's export holding the volume.
    pub volume: String,
    /// spec.volumeReplicationClass when it was set up.
    pub volume_replication_class: String,
    /// spec.dataSource.name when it was set up.
    pub data_source_name: String,
}

/// The names of a kind in a group: for API paths and dynamic objects.
pub fn api_resource(group: &str, kind: &str) -> kube::core::ApiResource {
    // English plurals, as the CRDs name them: volumereplicationclass-es.
    let lower = kind.to_ascii_lowercase();
    let plural = if lower.ends_with('s') {
        format!("{lower}es")
    } else {
        format!("{lower}s")
    };
    kube::core::ApiResource {
        group: group.into(),
        version: VERSION.into(),
        api_version: format!("{group}/{VERSION}"),
        kind: kind.into(),
        plural,
    }
}

/// Where a PVC's data comes from when its `spec.dataSourceRef` names this resource
/// (group replication.mover, kind HydrationSource): mover's volume populator binds the
/// PVC at once to a volume on the node the scheduler chose, and that node's agent fills
/// it from here while the pod uses it.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "replication.mover",
    version = "v1alpha1",
    kind = "HydrationSource",
    namespaced,
    shortname = "hs",
    doc = "HydrationSource is where a PVC populated by mover gets its data.",
    printcolumn(name = "Agent", type_ = "string", json_path = ".spec.agent"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("[has(self.agent), has(self.snapshot), has(self.volumeReplication)].filter(x, x).size() == 1").message("name one of agent, snapshot and volumeReplication"))]
#[x_kube(validation = Rule::new("!has(self.snapshot) || has(self.secretRef)").message("a snapshot needs secretRef: a secret with its repository's password"))]
#[serde(rename_all = "camelCase")]
pub struct HydrationSourceSpec {
    /// A block volume an agent serves, as agent://NODE@HOST:PORT/VOLUME: NODE is the
    /// agent's node, the name its certificate carries (e.g. the node where the volume
    /// was).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new("self.startsWith('agent://')").message("agent must be agent://NODE@HOST:PORT/VOLUME"))]
    pub agent: Option<String>,
    /// A block volume's snapshot in a repository, which the agent of the chosen node
    /// reads (each region a chunk of the snapshot, checked before it is written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<RepositorySnapshot>,
    /// A VolumeReplication of this namespace whose volume here is the replica (state
    /// secondary): the PVC gets the replica as of the cycle last applied when the fill
    /// starts. The replica's agent holds that cycle for the fill while later cycles are
    /// applied; replication goes on, and the hold ends when the fill completes (or the
    /// replica is promoted, which fails the fill).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume_replication: Option<String>,
    /// Bytes per second the background fill may fetch, with binary units (100M is
    /// 100 MiB/s); the pod's own reads are never held back [default: no limit].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bwlimit: Option<String>,
    /// A secret in a namespace the controller reads secrets in (mover-system by
    /// default). For an agent of another cluster: `token` (that cluster's replication
    /// token) and `ca.crt` (its CA). For a snapshot: `password` (or `key`, a raw key)
    /// and, for S3, `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`. The secret must
    /// list this namespace in its annotation `replication.mover/for-namespaces`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretRef>,
}

/// A snapshot in a repository.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RepositorySnapshot {
    /// s3://BUCKET/PREFIX, or a directory on the nodes.
    pub repository: String,
    /// The snapshot: an id, a unique prefix of one, or `latest`.
    pub id: String,
    /// An S3-compatible server's endpoint URL [default: AWS].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3_endpoint: Option<String>,
    /// The S3 region [default: us-east-1].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3_region: Option<String>,
}

/// A secret named by namespace and name.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, schemars::JsonSchema)]
pub struct SecretRef {
    /// Its name.
    pub name: String,
    /// Its namespace.
    pub namespace: String,
}

/// An owned volume following its workload to another cluster: one VolumeMove on each
/// side, both naming the same PVC (or StatefulSet), whose VolumeReplication pairs the
/// two. The source detaches the workload, waits until its agent sees nothing holding
/// the volume, and demotes (a final cycle). The destination promotes once that final
/// cycle is applied, however long that takes; only if the move asks for it
/// (`forceAfterSeconds`) does it promote by force without it, fencing the old owner:
/// its agent's later writes are refused for their stale epoch. The PVs are `Retain`
/// until the move completes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "replication.mover",
    version = "v1alpha1",
    kind = "VolumeMove",
    namespaced,
    shortname = "vmove",
    status = "VolumeMoveStatus",
    doc = "VolumeMove moves an owned volume (or a StatefulSet's) between two clusters.",
    printcolumn(name = "Side", type_ = "string", json_path = ".spec.side"),
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Fenced", type_ = "boolean", json_path = ".status.fenced"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[x_kube(validation = Rule::new("has(self.pvc) != has(self.statefulSet)").message("name either pvc or statefulSet, not both"))]
#[x_kube(validation = Rule::new("self.side == oldSelf.side && (has(self.pvc) ? has(oldSelf.pvc) && self.pvc == oldSelf.pvc : !has(oldSelf.pvc)) && (has(self.statefulSet) ? has(oldSelf.statefulSet) && self.statefulSet == oldSelf.statefulSet : !has(oldSelf.statefulSet)) && (has(self.timeoutSeconds) ? has(oldSelf.timeoutSeconds) && self.timeoutSeconds == oldSelf.timeoutSeconds : !has(oldSelf.timeoutSeconds)) && (has(self.storageClassName) ? has(oldSelf.storageClassName) && self.storageClassName == oldSelf.storageClassName : !has(oldSelf.storageClassName))").message("a VolumeMove's spec is immutable but for forceAfterSeconds: delete it and create another"))]
#[x_kube(validation = Rule::new("!has(self.timeoutSeconds) || self.side == 'Source'").message("timeoutSeconds is the source's (how long the workload has to let go); on the destination, a forced promotion must be asked for with forceAfterSeconds"))]
#[x_kube(validation = Rule::new("!has(self.forceAfterSeconds) || self.side == 'Destination'").message("forceAfterSeconds is the destination's (when to promote by force, fencing the source)"))]
#[x_kube(validation = Rule::new("!has(self.storageClassName) || self.side == 'Source'").message("storageClassName is the source's: a move within one cluster is one VolumeMove"))]
#[serde(rename_all = "camelCase")]
pub struct VolumeMoveSpec {
    /// Source: the workload leaves this cluster. Destination: it arrives here.
    pub side: MoveSide,
    /// The PVC that moves: its VolumeReplication (the one whose dataSource names it)
    /// is the pair's relationship.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pvc: Option<String>,
    /// A StatefulSet whose PVCs move one after another, in ordinal order, named as its
    /// volumeClaimTemplates name them. The source scales it to 0 first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stateful_set: Option<String>,
    /// Source only: how long the workload has to let go of the volume before the move
    /// fails here, saying what holds it [default: 300].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_seconds: Option<u64>,
    /// Destination only: promote by force, fencing the source by epoch, if the source's
    /// final cycle has not been applied this many seconds after the move started. A
    /// forced promotion drops what the source wrote after its last cycle, so it is
    /// never the default: without this field the destination waits for the final cycle
    /// as long as it takes and says what it waits for. Set it (or patch it in while the
    /// move waits) only once the source is known to be gone or stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub force_after_seconds: Option<u64>,
    /// A move within this cluster, with no VolumeReplication: once released, the PVC is
    /// made again under its name in this StorageClass (mover's CSI driver,
    /// WaitForFirstConsumer), usable at once wherever its next pod runs while its data
    /// arrives from the old volume, which stays `Retain` until the fill completes. A
    /// StatefulSet is scaled back up once all its PVCs are made again. Source only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_class_name: Option<String>,
}

/// Which end of a move a VolumeMove is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, schemars::JsonSchema)]
pub enum MoveSide {
    /// The workload leaves this cluster.
    Source,
    /// The workload arrives in this cluster.
    Destination,
}

/// Where a move, or one of its volumes, stands.
#[derive(
    Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, schemars::JsonSchema,
)]
pub enum MovePhase {
    /// Not started.
    #[default]
    Pending,
    /// Source: waiting for the workload to let go of the volume.
    Detaching,
    /// Source: the final cycle is shipping.
    Demoting,
    /// Destination: waiting for the source's final cycle.
    Waiting,
    /// Destination: becoming the owner.
    Promoting,
    /// Within a cluster: the old PVC is replaced by one filled on demand.
    Recreating,
    /// Within a cluster: the new PVC is usable; its data still arrives.
    Filling,
    /// Done: the source released the volume, or the destination owns it.
    Completed,
    /// Stopped: the message says why and what to do.
    Failed,
}

/// The observed state of a VolumeMove.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VolumeMoveStatus {
    /// The phase of the whole move: the first volume's that is not Completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<MovePhase>,
    /// What the move is doing or waiting for, or why it stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Destination: a volume was promoted by force (its old owner fenced).
    #[serde(default)]
    pub fenced: bool,
    /// When the move was first looked at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// When its last volume completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// Source of a StatefulSet: its replicas before the move scaled it to 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,
    /// Within a cluster: the StatefulSet is scaled back to `replicas` (its PVCs made
    /// again).
    #[serde(default)]
    pub scaled_back: bool,
    /// Each volume, in the order they move.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<MovedVolume>,
}

/// One volume of a move.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MovedVolume {
    /// The PVC.
    pub pvc: String,
    /// Where it stands.
    pub phase: MovePhase,
    /// What it waits for, or why it failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The PV's reclaim policy before the move set `Retain`; set back at completion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim_policy: Option<String>,
    /// When this volume's step began (source: detaching; destination: waiting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// Source: when the agent found nothing holding the volume any more.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub released_time: Option<Time>,
    /// When it completed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub completion_time: Option<Time>,
    /// Destination: promoted by force, fencing the old owner.
    #[serde(default)]
    pub fenced: bool,
    /// Destination: the epoch it was promoted at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub epoch: Option<u64>,
    /// Within a cluster: the PV the PVC was bound to, which the new one fills from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_volume: Option<String>,
    /// Within a cluster: the node of that PV, whose agent serves it to the fill (the
    /// export is withdrawn when the fill completes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_node: Option<String>,
}

/// Both CRDs, for `group` instead of the group the types were derived with.
pub fn crds(group: &str) -> Vec<CustomResourceDefinition> {
    [VolumeReplicationClass::crd(), VolumeReplication::crd()]
        .into_iter()
        .map(|mut crd| {
            crd.spec.group = group.into();
            crd.metadata.name = Some(format!("{}.{group}", crd.spec.names.plural));
            crd
        })
        .collect()
}

/// The file name and YAML of each CRD, as `mover controller crds` writes them: the
/// populator's HydrationSource and the VolumeMove are mover's own, in its group alone.
pub fn crd_yaml(group: &str) -> Vec<(String, String)> {
    let own = (group == MOVER_GROUP)
        .then(|| [HydrationSource::crd(), VolumeMove::crd()])
        .into_iter()
        .flatten();
    crds(group)
        .into_iter()
        .chain(own)
        .map(|crd| {
            let name = crd.metadata.name.clone().unwrap_or_default();
            let body = serde_saphyr::to_string(&crd).expect("a CRD serializes");
            (
                format!("{name}.yaml"),
                format!("# Generated by `mover controller crds`: edit mover/controller/src/crd.rs, not this file.\n---\n{body}"),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_group_is_rewritten_everywhere_it_appears() {
        for group in [MOVER_GROUP, CSI_ADDONS_GROUP] {
            let crds = crds(group);
            let names: Vec<_> = crds
                .iter()
                .map(|c| c.metadata.name.clone().unwrap())
                .collect();
            assert_eq!(
                names,
                [
                    format!("volumereplicationclasses.{group}"),
                    format!("volumereplications.{group}")
                ]
            );
            for (file, yaml) in crd_yaml(group) {
                let other = if group == MOVER_GROUP {
                    CSI_ADDONS_GROUP
                } else {
                    MOVER_GROUP
                };
                // "replication.mover" is a substring of nothing in the csi-addons group and
                // vice versa, so any leftover shows up. (The class documents csi-addons'
                // reserved secret parameters by name, in either group.)
                let yaml = yaml.replace("replication.storage.openshift.io/replication-secret", "");
                assert!(!yaml.contains(other), "{file} mentions {other}");
            }
        }
        // The paths the controller uses are the plurals the CRDs serve.
        for crd in crds(MOVER_GROUP) {
            let ar = api_resource(MOVER_GROUP, &crd.spec.names.kind);
            assert_eq!(ar.plural, crd.spec.names.plural);
        }
        assert_eq!(crds(MOVER_GROUP)[0].spec.scope, "Cluster");
        assert_eq!(crds(MOVER_GROUP)[1].spec.scope, "Namespaced");
    }
}
