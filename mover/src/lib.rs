//! The mover engine.
//!
//! Every job is one pipeline: read a source volume in chunks, learn what the sink
//! already holds, and write or ship only the difference (shared/DESIGN.md §1). This
//! crate holds the jobs; the `mover` binary (src/main.rs) only parses arguments, sets
//! up tracing and the progress bar, and maps errors to exit codes.
//!
//! Built so far: [`copy_block`], the one-shot copy of a block volume (block device or
//! image file) onto another, writing only the 4 KiB pages that differ and keeping holes
//! as holes; [`hash_block`], a volume's chunk digest; [`agent`], the per-node agent
//! serving exported volumes over gRPC and NBD; [`remote`], copies to and from an agent;
//! [`replicate`], continuous replication; and [`hydrate`], volumes served over NBD
//! while their data arrives.

pub mod agent;
#[cfg(feature = "controller")]
pub mod controller;
mod copy;
mod endpoints;
mod error;
mod hash;
pub mod hydrate;
pub mod node;
pub mod remote;
pub mod replicate;
pub mod schedule;
mod snapshot;
mod tree;

pub use copy::{CopyOptions, CopySummary, Progress, SharedProgress, copy_block};
pub use endpoints::{Copied, EndpointError, copy_endpoints};
pub use error::{CopyError, RemoteCode, Result};
pub use hash::{HashSummary, hash_block};
pub use snapshot::{
    CreateOptions as SnapshotCreateOptions, INCOMPLETE_TAG, RepoOptions, RestoreOptions,
    RestoreSummary, create_snapshot, create_tree_snapshot, open_repository, restore_snapshot,
    restore_tree_snapshot,
};
pub use tree::{TreeOptions, TreeSummary, copy_tree};
