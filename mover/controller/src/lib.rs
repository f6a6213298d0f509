//! The Kubernetes controller (docs/ARCHITECTURE.md): `VolumeReplication` resources drive
//! the agents' replication relationships.
//!
//! - [`crd`]: the custom resources, with csi-addons' field names, and their CRDs.
//! - [`desired`]: the relationship a resource asks for, from its class, PVC, PV, node
//!   and agent pod (pure).
//! - [`status`]: conditions and status as csi-addons sets them (pure).
//! - [`agents`]: the agents' relationship control API behind a small trait.
//! - [`metrics`]: reconciles, failures, relationships by state, RPO (Prometheus).
//! - [`context`]: what every reconciler shares: watch caches, the reconcile context,
//!   API helpers.
//! - [`reconcile`]: finalizer, agent calls, status by server-side apply.
//! - [`csi_snapshots`]: cycles whose point in time is a CSI VolumeSnapshot, read
//!   through a clone on the agent's node.
//! - [`hooks`]: commands run in the workload's pods around a snapshot (`pods/exec`).
//! - [`secrets`]: the secrets classes name, each watched, read from the cache.
//! - [`snapshot_metadata`]: the changed blocks between two CSI VolumeSnapshots
//!   (Kubernetes' SnapshotMetadata API), resumed when a stream is cut.
//! - [`populate`]: PVCs whose `dataSourceRef` names a HydrationSource: bound at once to
//!   a volume its node's agent fills while the pod uses it (`populator`), or, for other
//!   storage classes, filled before they are bound (`prime`).
//! - [`leftovers`]: what a deletion left on an agent that was down, removed when it
//!   answers again.
//! - [`agent_csr`]: an agent's certificate request, sent to the cluster and awaited.
//! - [`run()`]: watch caches and the controller loop (`mover controller run`).
//!
//! The only crate of the workspace that depends on kube-rs. The `mover` binary includes
//! it with its `controller` cargo feature (on by default); an agent-only build leaves it
//! out, kube with it.

pub mod agent_csr;
pub mod agents;
pub mod context;
pub mod crd;
pub mod csi_snapshots;
pub mod desired;
pub mod hooks;
pub mod issuer;
pub mod leftovers;
pub mod locator;
pub mod metrics;
pub mod moves;
pub mod populate;
pub mod reconcile;
mod run;
pub mod secrets;
pub mod snapshot_metadata;
pub mod snapshots;
pub mod status;

pub use run::{RunError, RunOptions, run};

use std::path::Path;

/// Writes both CRDs of `group` into `dir` (`mover controller crds`); returns the paths.
pub fn write_crds(group: &str, dir: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(dir)?;
    crd::crd_yaml(group)
        .into_iter()
        .map(|(file, yaml)| {
            let path = dir.join(file);
            std::fs::write(&path, yaml)?;
            Ok(path)
        })
        .collect()
}
