//! The mover engine: what every job is made of, and the jobs that run once.
//!
//! Every job is one pipeline: read a source volume in chunks, learn what the sink
//! already holds, and write or ship only the difference. This crate holds, lowest
//! first (no module imports one above it; `mover/tests/layers.rs` checks it):
//! - [`node`]: node state: exports, durable writes, failpoints, metric labels,
//!   filesystem freeze, what holds a volume, loop devices, durations, the clock;
//! - [`error`], [`copy`], [`hash`]: the block copy ([`copy_block`]: only the 4 KiB
//!   pages that differ are written, holes kept as holes) and a volume's digest;
//! - [`tree`], [`remote`]: file-tree copies, and copies to and from an agent;
//! - [`snapshot`], [`endpoints`]: snapshots in a repository, and `mover copy` as one
//!   call ([`copy_endpoints`]);
//! - [`outcome`]: what a failed job means (refused, damaged, failed part way), from the
//!   errors of this crate and the repository's.
//!
//! What runs on its own on a node (the agent, replication, copy-on-demand, schedules)
//! is `mover-node`; the Kubernetes controller is `mover-controller`
//! (docs/ARCHITECTURE.md).

pub mod copy;
pub mod endpoints;
pub mod error;
pub mod hash;
pub mod node;
pub mod outcome;
pub mod remote;
pub mod snapshot;
pub mod tree;

pub use copy::{CopyOptions, CopySummary, Progress, SharedProgress, copy_block};
pub use endpoints::{Copied, EndpointError, copy_endpoints};
pub use error::{CopyError, RemoteCode, Result};
pub use hash::{HashSummary, hash_block};
pub use outcome::{Outcome, outcome_of};
pub use snapshot::{
    CreateOptions as SnapshotCreateOptions, INCOMPLETE_TAG, RepoOptions, RestoreOptions,
    RestoreSummary, create_snapshot, create_tree_snapshot, open_repository, restore_snapshot,
    restore_tree_snapshot,
};
pub use tree::{TreeOptions, TreeSummary, copy_tree};
