//! What runs on a node, on its own: the jobs and the agent that serves them.
//!
//! - [`replicate`]: continuous replication, both ends: the primary's cycles and the
//!   secondary's journal and holds;
//! - [`hydrate`]: copy-on-demand, a volume served while its data arrives;
//! - [`schedule`]: snapshots on a schedule;
//! - [`agent`]: the per-node agent, adapters only: gRPC (transfers, relationship and
//!   hydration control), NBD, the CSI plugin and its devices, metrics;
//! - [`fd_store`]: the small process beside the agent that keeps its devices' FUSE
//!   connections across its restarts.
//!
//! Built on `mover-engine`; no Kubernetes client: an agent's certificate request
//! reaches the cluster through [`agent::certificate::Signer`] (docs/ARCHITECTURE.md).

pub mod agent;
pub mod fd_store;
pub mod hydrate;
pub mod replicate;
pub mod schedule;
