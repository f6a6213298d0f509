//! The Kubernetes controller (docs/ARCHITECTURE.md): `VolumeReplication` resources drive
//! the agents' replication relationships.
//!
//! The manager and what every reconciler shares:
//! - [`run()`]: the manager (`mover controller run`): watch caches, metrics, the CA,
//!   the Locator, leader election, and the reconcilers, one per kind;
//! - [`leader`]: one leader at a time: the Lease, its renew deadline, and the gate
//!   that refuses a write or an agent call once this replica is past it;
//! - [`context`]: watch caches, the reconcile context, API helpers;
//! - [`crd`]: the custom resources, with csi-addons' field names, and their CRDs;
//! - [`agents`]: the agents' control API behind a small trait;
//! - [`secrets`]: the secrets classes name, each watched, read from the cache;
//! - [`metrics`]: reconciles, failures, relationships by state, RPO (Prometheus);
//! - [`issuer`] and [`agent_csr`]: the cluster's CA, the agents' certificates (the
//!   signer's side and the agent's request);
//! - [`leftovers`]: what a deletion left on an agent that was down, removed when it
//!   answers again;
//! - [`locator`]: where a peer cluster's relationship has its volume, for its agents.
//!
//! One folder or file per kind:
//! - [`replication`]: VolumeReplications (desired state, status, the reconcile, cycles
//!   from CSI snapshots and their hooks, scheduled snapshots);
//! - [`populate`]: PVCs whose `dataSourceRef` names a HydrationSource: bound at once to
//!   a volume its node's agent fills while the pod uses it (`populator`), or, for other
//!   storage classes, filled before they are bound (`prime`);
//! - [`moves`]: VolumeMoves, owned volumes that follow their workload.
//!
//! The only crate of the workspace that depends on kube-rs. The `mover` binary includes
//! it with its `controller` cargo feature (on by default); an agent-only build leaves it
//! out, kube with it.

pub mod agent_csr;
pub mod agents;
pub mod context;
pub mod crd;
pub mod issuer;
pub mod leader;
pub mod leftovers;
pub mod locator;
pub mod metrics;
pub mod moves;
pub mod populate;
pub mod replication;
pub mod rotation;
mod run;
pub mod scrape_review;
pub mod secrets;

// The replication modules as they were named before the folder (the tests use them).
pub use replication::{desired, reconcile, snapshot_metadata, status};
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
