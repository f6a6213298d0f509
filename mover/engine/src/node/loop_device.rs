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

/// The file `device` is bound to, as `(device number "MAJ:MIN", inode)`; an error if it
/// is bound to none. A path can name another file by now; these cannot.
pub fn backing_file_id(device: &Path) -> io::Result<(String, u64)> {
    let out = run(Command::new("losetup")
        .args([
            "--list",
            "--noheadings",
            "--output",
            "BACK-MAJ:MIN,BACK-INO",
        ])
        .arg(device))?;
    let mut fields = out.split_whitespace();
    match (fields.next(), fields.next().and_then(|i| i.parse().ok())) {
        (Some(dev), Some(ino)) => Ok((dev.to_string(), ino)),
        _ => Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "{} is bound to no file (losetup: {out:?})",
                device.display()
            ),
        )),
    }
}

/// `file`'s id in the form [`backing_file_id`] gives.
pub fn file_id(file: &Path) -> io::Result<(String, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(file)?;
    let dev = m.dev();
    Ok((
        format!("{}:{}", libc::major(dev), libc::minor(dev)),
        m.ino(),
    ))
}
