//! Snapshots of block volumes and file trees into a repository (local directory or S3),
//! and restores. Trees: see `tree_create` and `tree_restore`; the rest of this
//! page is about block volumes.
//!
//! `create` reads the volume in windows on a blocking thread (read-ahead, parallel
//! hashing), seals only the chunks the repository's index lacks (in parallel), and hands
//! full packs over a bounded channel to the async uploader: memory stays a few packs
//! and windows whatever the volume size. A previous snapshot of the volume is found
//! automatically; dedup against the whole index makes every snapshot incremental.
//! `restore` fetches the chunks a destination lacks with parallel ranged GETs (one per
//! run of nearby blobs in a pack), writes them out of order with `pwrite`, and leaves
//! zero chunks as holes; an existing older copy is compared chunk by chunk first and
//! only differing chunks are fetched and written.

mod create;
mod options;
mod restore;
mod tree_create;
mod tree_restore;

pub use create::{CreateOptions, create_snapshot};
pub use options::{RepoOptions, open_repository, open_repository_with};
pub use restore::{RestoreOptions, RestoreSummary, restore_snapshot};
pub use tree_create::{INCOMPLETE_TAG, create_tree_snapshot};
pub use tree_restore::restore_tree_snapshot;
