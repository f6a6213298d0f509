//! Preflight: root, the external programs the bench drives, and the mover binary.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Absolute paths of every external program the bench runs.
#[derive(Debug, Clone)]
pub struct Tools {
    /// GNU `cp` (peer: full copy, sparse copy; also builds images).
    pub cp: PathBuf,
    /// GNU `dd` (peer: full copy).
    pub dd: PathBuf,
    /// `rsync` (peer: delta copy).
    pub rsync: PathBuf,
    /// `b3sum` (peer: hashing).
    pub b3sum: PathBuf,
    /// `mkfs.ext4` (builds the volume).
    pub mkfs_ext4: PathBuf,
    /// `losetup` (attaches the source loop device).
    pub losetup: PathBuf,
    /// `mount` (fills the volume).
    pub mount: PathBuf,
    /// `umount`.
    pub umount: PathBuf,
    /// `openssl` (makes the agent phase's TLS certificates; measures the snapshots' CPU
    /// floor); looked for only when one of those phases runs.
    pub openssl: Option<PathBuf>,
    /// `restic` (peer: snapshots); looked for only when the snapshot phase runs.
    pub restic: Option<PathBuf>,
    /// `zstd` (the snapshots' CPU floor); looked for only when the snapshot phase runs.
    pub zstd: Option<PathBuf>,
}

/// Directories searched after `$PATH`, since `sudo` or cron may leave the sbins out.
const EXTRA_DIRS: [&str; 4] = ["/usr/local/sbin", "/usr/sbin", "/sbin", "/usr/bin"];

impl Tools {
    /// Finds every program (`openssl` only if `agent_phase` or `snapshot_phase`, `restic`
    /// and `zstd` only if `snapshot_phase`), or fails naming each missing one and its
    /// Debian/Ubuntu package.
    pub fn find(agent_phase: bool, snapshot_phase: bool) -> Result<Self> {
        let mut missing = Vec::new();
        let mut find = |name: &str, package: &str| {
            find_program(name).unwrap_or_else(|| {
                missing.push(format!("`{name}` (apt install {package})"));
                PathBuf::new()
            })
        };
        let tools = Self {
            cp: find("cp", "coreutils"),
            dd: find("dd", "coreutils"),
            rsync: find("rsync", "rsync"),
            b3sum: find("b3sum", "b3sum"),
            mkfs_ext4: find("mkfs.ext4", "e2fsprogs"),
            losetup: find("losetup", "mount"),
            mount: find("mount", "mount"),
            umount: find("umount", "mount"),
            openssl: (agent_phase || snapshot_phase).then(|| find("openssl", "openssl")),
            restic: snapshot_phase.then(|| find("restic", "restic")),
            zstd: snapshot_phase.then(|| find("zstd", "zstd")),
        };
        if !missing.is_empty() {
            bail!("missing required programs: {}", missing.join(", "));
        }
        Ok(tools)
    }
}

/// Refuses to run unless root: the bench mounts images, drives loop devices and drops the
/// page cache.
pub fn ensure_root() -> Result<()> {
    if !rustix::process::geteuid().is_root() {
        bail!(
            "mover-bench must run as root: it mounts images, attaches loop devices and drops \
             the page cache (try `sudo mover-bench ...`)"
        );
    }
    Ok(())
}

/// The mover binary: `explicit` if given, else `mover` next to the running executable.
pub fn resolve_mover(explicit: Option<&Path>) -> Result<PathBuf> {
    let path = match explicit {
        Some(path) => path.to_path_buf(),
        None => std::env::current_exe()
            .context("cannot locate the running mover-bench executable")?
            .with_file_name("mover"),
    };
    if !is_executable(&path) {
        bail!(
            "no mover binary at {}: build it with `cargo build --release -p mover` \
             (it lands next to mover-bench) or pass --mover PATH",
            path.display()
        );
    }
    path.canonicalize()
        .with_context(|| format!("cannot resolve {}", path.display()))
}

/// The first executable called `name` in `$PATH` or [`EXTRA_DIRS`].
pub fn find_program(name: &str) -> Option<PathBuf> {
    let path_var = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path_var)
        .chain(EXTRA_DIRS.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable(candidate))
}

/// Whether `path` is a regular file with an execute bit set.
fn is_executable(path: &Path) -> bool {
    path.metadata()
        .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_sh_but_not_nonsense() {
        assert!(find_program("sh").is_some_and(|p| p.is_absolute()));
        assert!(find_program("no-such-program-mover-bench").is_none());
    }

    #[test]
    fn missing_mover_explains_how_to_build_it() {
        let err = resolve_mover(Some(Path::new("/nonexistent/mover")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("cargo build --release -p mover"), "{err}");
    }
}
