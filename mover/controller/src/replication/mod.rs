//! VolumeReplications: the agents' replication relationships, driven from resources.
//!
//! - [`desired`]: the relationship a resource asks for, from its class, PVC, PV, node
//!   and agent pod (pure).
//! - [`status`]: conditions and status as csi-addons sets them (pure).
//! - [`reconcile`]: finalizer, agent calls, status by server-side apply.
//! - [`csi_snapshots`]: cycles whose point in time is a CSI VolumeSnapshot, read
//!   through a clone on the agent's node.
//! - [`hooks`]: commands run in the workload's pods around a snapshot (`pods/exec`).
//! - [`snapshot_metadata`]: the changed blocks between two CSI VolumeSnapshots
//!   (Kubernetes' SnapshotMetadata API), resumed when a stream is cut.
//! - [`snapshots`]: classes whose target is a repository: scheduled snapshots.

pub mod csi_snapshots;
pub mod desired;
pub mod hooks;
pub mod reconcile;
pub mod snapshot_metadata;
pub mod snapshots;
pub mod status;
