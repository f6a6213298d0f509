//! The timed runs: hashing, full copy, delta copy, the sparse-image copy and copies over
//! the network through mover's agent, each pitting mover against its peers in the same run.

mod agent;
mod copy;
mod hash;
mod snapshot;

use std::path::{Path, PathBuf};

use serde::Serialize;

pub use agent::{AgentCopy, agent_copy};
pub use copy::{Cache, DeltaCopy, FullCopy, SparseCopy, delta_copy, full_copy, sparse_copy};
pub use hash::{HashResult, hash};
pub use snapshot::{SnapshotPhase, SnapshotStep, snapshot};

use crate::image::Images;
use crate::process::Timed;
use crate::tools::Tools;

/// What the runs need.
#[derive(Debug)]
pub struct Ctx<'a> {
    /// The peers.
    pub tools: &'a Tools,
    /// The mover binary.
    pub mover: &'a Path,
    /// The images.
    pub images: &'a Images,
    /// Loop device attached read-only to today's image: the source of mover's runs.
    pub device: &'a Path,
    /// The destination of every local copy (a file next to the images, so on the same disk).
    pub scratch: PathBuf,
    /// The working directory (the agent phase keeps its servers' files in a subdirectory).
    pub workdir: &'a Path,
    /// Threads for the multi-threaded hash comparison.
    pub nproc: usize,
}

/// A run and what the command printed on stdout.
type RunOutput = (Run, Vec<u8>);

/// One timed command.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// Short name for the table.
    pub tool: String,
    /// The full command line.
    pub command: String,
    /// Best wall-clock time, including the trailing sync for copies.
    pub seconds: f64,
    /// The part of `seconds` spent in the trailing sync.
    pub sync_seconds: f64,
    /// Every run's time, when the command ran more than once.
    pub all_seconds: Vec<f64>,
    /// Peak RSS of the command's process (wait4 ru_maxrss).
    pub max_rss_bytes: u64,
    /// CPU time (user + system) of the command and the children it waited for, in the
    /// best run.
    pub cpu_seconds: f64,
    /// For copies to a server (agent, rsync daemon): the CPU time the server used during
    /// the best run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_cpu_seconds: Option<f64>,
    /// For copies to a server: the bytes the server read from storage during the best
    /// run (its `/proc/PID/io` read_bytes; page-cache hits do not count).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_read_bytes: Option<u64>,
    /// For copies: bytes the destination occupies on disk afterwards.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub destination_allocated_bytes: Option<u64>,
    /// For copies: 4 KiB pages of the destination differing from the source afterwards
    /// (0 means the copy is exact).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub differing_pages_after: Option<u64>,
    /// For mover: its own `--json` report, verbatim.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mover_report: Option<serde_json::Value>,
    /// The best run's I/O over time: (seconds, bytes read and written so far).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub io_samples: Vec<(f64, u64)>,
}

impl Run {
    /// A run from the best of `timings` (which must not be empty), and the stdout of that
    /// best run.
    pub(super) fn best(tool: &str, command: String, timings: Vec<Timed>) -> RunOutput {
        let all_seconds: Vec<f64> = timings.iter().map(|t| t.elapsed.as_secs_f64()).collect();
        let best = timings
            .into_iter()
            .min_by_key(|t| t.elapsed)
            .expect("at least one timing");
        let run = Self {
            tool: tool.to_string(),
            command,
            seconds: best.elapsed.as_secs_f64(),
            sync_seconds: best.sync.as_secs_f64(),
            all_seconds: if all_seconds.len() > 1 {
                all_seconds
            } else {
                Vec::new()
            },
            max_rss_bytes: best.max_rss_bytes,
            cpu_seconds: best.cpu.as_secs_f64(),
            server_cpu_seconds: None,
            server_read_bytes: None,
            destination_allocated_bytes: None,
            differing_pages_after: None,
            mover_report: None,
            io_samples: best.io_samples,
        };
        (run, best.stdout)
    }

    /// Whether this copy was checked and found exact.
    pub fn is_exact(&self) -> bool {
        self.differing_pages_after == Some(0)
    }
}
