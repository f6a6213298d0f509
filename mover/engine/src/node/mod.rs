//! Node state: what every job and the agent share about this node. The volumes it
//! exports, the durable write, failpoints, metric labels, the points in time a job reads
//! (and the filesystem freeze around their taking).
//!
//! The floor under the jobs (docs/ARCHITECTURE.md): nothing here imports a job, the
//! agent or the controller.

mod duration;
pub mod exports;
mod failpoint;
pub mod freeze;
pub mod holders;
mod labels;
pub mod loop_device;
pub mod point_in_time;

pub use chunker::durable::write_durably;
pub use duration::parse_duration;
pub use exports::{Export, ExportError, Exports};
pub use failpoint::{failpoint, pause};
pub use labels::label_value;

/// A name (a relationship's, a schedule's) as a file name or label value: 32 hex digits
/// of its BLAKE3 (names may hold '/', and a label value is at most 63 characters).
pub fn name_hash(name: &str) -> String {
    blake3::hash(name.as_bytes()).to_hex()[..32].to_string()
}

/// Runs a tool of the node (losetup, mount, mkfs); its standard output, or an error
/// that names the command and says what it printed.
pub fn run_tool(cmd: &mut std::process::Command) -> std::io::Result<String> {
    let what = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("cannot run {what}: {e} (is it installed on the node?)"),
        )
    })?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}
