//! Loop devices over files, through util-linux's `losetup` (what every node image has;
//! its ioctls differ between kernels and it knows them).

use super::run_tool as run;
use std::{
    io,
    path::{Path, PathBuf},
    process::Command,
};

/// Binds a free loop device to `file` and returns it (`/dev/loopN`).
pub fn attach(file: &Path, read_only: bool) -> io::Result<PathBuf> {
    let mut cmd = Command::new("losetup");
    cmd.args(["--find", "--show"]);
    if read_only {
        cmd.arg("--read-only");
    }
    let out = run(cmd.arg(file))?;
    let dev = out.trim();
    if !dev.starts_with("/dev/") {
        return Err(io::Error::other(format!(
            "losetup --find --show {} printed {dev:?}, not a device",
            file.display()
        )));
    }
    Ok(PathBuf::from(dev))
}

/// Unbinds `device`. The kernel lets go of a device still open (a mount, a pod) only when
/// its last user closes it: `losetup -d` then marks it to clear itself.
pub fn detach(device: &Path) -> io::Result<()> {
    run(Command::new("losetup").arg("-d").arg(device)).map(drop)
}

/// The loop devices bound to `file`.
pub fn bound_to(file: &Path) -> io::Result<Vec<PathBuf>> {
    let out = run(Command::new("losetup")
        .args(["--noheadings", "--output", "NAME", "--associated"])
        .arg(file))?;
    Ok(out
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(PathBuf::from)
        .collect())
}
