//! Node state: what every job and the agent share about this node. The volumes it
//! exports, the durable write, failpoints, metric labels, the points in time a job reads
//! (and the filesystem freeze around their taking).
//!
//! The floor under the jobs (shared/DESIGN.md §2): nothing here imports a job, the
//! agent or the controller.

mod duration;
pub mod exports;
mod failpoint;
pub mod freeze;
mod labels;
pub mod point_in_time;

pub use chunker::durable::write_durably;
pub use duration::parse_duration;
pub use exports::{Export, ExportError, Exports};
pub use failpoint::failpoint;
pub use labels::label_value;

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
