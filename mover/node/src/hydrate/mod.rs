//! Copy-on-demand (docs/ARCHITECTURE.md, hydrate): an export served over NBD at once,
//! while its data arrives from a peer agent or a snapshot.
//!
//! - `bitmap`: which regions are present, committed crash-safely (A/B slots).
//! - `source`: where regions come from (a peer agent, a repository snapshot).
//! - `engine`: one hydration: claims (nothing fetched twice, no fetch over a client's
//!   write), the background filler, commits (data fdatasync'd before its bitmap).
//! - `volume`: what the NBD server serves: a plain export or a hydrating one.
//! - `registry`: an agent's hydrations: start, cancel, persist, resume.

mod bitmap;
mod engine;
mod registry;
mod source;
mod volume;

pub use engine::{FillOptions, Hydration, Phase, Progress};
pub use registry::{Hydrations, PeerAccess, ReplicaHold, RepoAccess, SourceSpec, StartRequest};
pub use source::{AgentSource, RegionSource, SnapshotSource};
pub use volume::{HydratingVolume, LocalVolume};

use std::path::PathBuf;

/// Why a hydration cannot start or go on.
#[derive(Debug, thiserror::Error)]
pub enum HydrateError {
    /// Bad input: refused before anything was changed.
    #[error("{what}: {why}")]
    Refused {
        /// What was asked.
        what: String,
        /// Why not, and what to do.
        why: String,
    },
    /// The source failed or cannot be reached.
    #[error("source {source_name}: {message}")]
    Source {
        /// The source.
        source_name: String,
        /// What it said.
        message: String,
        /// Trying again later may work.
        retryable: bool,
    },
    /// The local volume or the state directory failed.
    #[error("{}: {cause}", path.display())]
    Local {
        /// The file.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
}
