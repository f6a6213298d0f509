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

/// The image file that the loop device `device` maps whole (offset 0, no size limit),
/// as this process can open it; `None` for anything else (not a loop device, a part of
/// a file, a file deleted or out of this mount namespace's reach). Writes through the
/// device land in that file, so a reflink clone of it is the device at one instant.
///
/// The kernel names the backing file by a path that need not exist here (as the
/// process that attached it saw it: the host's, for an agent in a container). So the
/// name is only a hint: the file is looked for under each mount of its file system, by
/// the name's tails, and taken only where (device, inode) are the loop device's own.
pub fn whole_file_of(device: &Path) -> io::Result<Option<PathBuf>> {
    use std::os::unix::fs::FileTypeExt;
    let meta = std::fs::metadata(device)?;
    if !meta.file_type().is_block_device() {
        return Ok(None);
    }
    let rdev = std::os::unix::fs::MetadataExt::rdev(&meta);
    let sys = PathBuf::from(format!(
        "/sys/dev/block/{}:{}/loop",
        libc::major(rdev),
        libc::minor(rdev)
    ));
    let read =
        |name: &str| std::fs::read_to_string(sys.join(name)).map(|s| s.trim_end().to_string());
    let (Ok(backing), Ok(offset), Ok(limit)) =
        (read("backing_file"), read("offset"), read("sizelimit"))
    else {
        return Ok(None);
    };
    if offset != "0" || limit != "0" || backing.ends_with(" (deleted)") {
        return Ok(None);
    }
    let id = backing_file_id(device)?;
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    let mounts = info.lines().filter_map(|l| {
        let f: Vec<&str> = l.split(' ').collect();
        (f.get(2) == Some(&id.0.as_str())).then(|| {
            Some((
                super::freeze::unescape(f.get(3)?),
                super::freeze::unescape(f.get(4)?),
            ))
        })?
    });
    // The name's tails: /a/b/c.img, /b/c.img, /c.img.
    let name = Path::new(&backing);
    let tails: Vec<PathBuf> = (0..name.components().count())
        .map(|skip| Path::new("/").join(name.components().skip(skip + 1).collect::<PathBuf>()))
        .filter(|t| t != Path::new("/"))
        .collect();
    let mut candidates = vec![name.to_path_buf()];
    for (root, mount_point) in mounts {
        candidates.extend(
            tails
                .iter()
                .filter_map(|t| t.strip_prefix(&root).ok())
                .map(|under| mount_point.join(under)),
        );
    }
    Ok(candidates
        .into_iter()
        .find(|c| file_id(c).is_ok_and(|f| f == id)))
}

/// [`whole_file_of`] `device`, where that file lies on a file system with reflinks (XFS,
/// Btrfs): a loop device whose point in time is a clone of its image. Elsewhere (ext4,
/// the agent's own FUSE file) the device itself is read, as before.
pub fn cloneable_image_of(device: &Path) -> io::Result<Option<PathBuf>> {
    /// `statfs` magic numbers (linux/magic.h).
    const XFS: i64 = 0x5846_5342;
    const BTRFS: i64 = 0x9123_683E;
    let Some(image) = whole_file_of(device)? else {
        return Ok(None);
    };
    let kind = rustix::fs::statfs(&image).map_err(io::Error::from)?.f_type as i64;
    Ok(matches!(kind, XFS | BTRFS).then_some(image))
}
