//! Drop guards for loop devices and mounts, so an error anywhere leaves nothing attached,
//! and cleanup of what an interrupted earlier run left behind.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::process::run_checked;
use crate::tools::Tools;

/// A loop device attached to an image; detached on drop.
#[derive(Debug)]
pub struct LoopDevice {
    device: PathBuf,
    losetup: PathBuf,
}

impl LoopDevice {
    /// Attaches `image` read-only to the first free loop device, with direct I/O so that
    /// it behaves like a disk: without it the loop device keeps a second page cache over
    /// the image's and serves one request at a time, which no real volume does.
    pub fn attach_read_only(tools: &Tools, image: &Path) -> Result<Self> {
        let out = run_checked(
            Command::new(&tools.losetup)
                .args(["--find", "--show", "--read-only", "--direct-io=on"])
                .arg(image),
        )
        .with_context(|| format!("cannot attach {} to a loop device", image.display()))?;
        let device = PathBuf::from(String::from_utf8_lossy(&out).trim());
        if !device.starts_with("/dev/") {
            bail!("losetup printed `{}`, not a device", device.display());
        }
        Ok(Self {
            device,
            losetup: tools.losetup.clone(),
        })
    }

    /// The device node, e.g. `/dev/loop3`.
    pub fn path(&self) -> &Path {
        &self.device
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        if let Err(err) = run_checked(Command::new(&self.losetup).arg("-d").arg(&self.device)) {
            eprintln!(
                "mover-bench: warning: cannot detach {}: {err:#}",
                self.device.display()
            );
        }
    }
}

/// An image mounted through an auto-clearing loop device; unmounted on drop.
#[derive(Debug)]
pub struct Mount {
    dir: PathBuf,
    umount: PathBuf,
    mounted: bool,
}

impl Mount {
    /// Mounts the filesystem in `image` on `dir` (created if missing).
    pub fn loop_mount(tools: &Tools, image: &Path, dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create mount point {}", dir.display()))?;
        run_checked(
            Command::new(&tools.mount)
                .args(["-o", "loop"])
                .arg(image)
                .arg(dir),
        )
        .with_context(|| format!("cannot mount {}", image.display()))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            umount: tools.umount.clone(),
            mounted: true,
        })
    }

    /// The mount point.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Unmounts now, reporting failure (drop only warns).
    pub fn unmount(mut self) -> Result<()> {
        self.mounted = false;
        run_checked(Command::new(&self.umount).arg(&self.dir))
            .with_context(|| format!("cannot unmount {}", self.dir.display()))?;
        Ok(())
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if !self.mounted {
            return;
        }
        if let Err(err) = run_checked(Command::new(&self.umount).arg(&self.dir)) {
            eprintln!("mover-bench: warning: {err:#}");
        }
    }
}

/// Unmounts `mount_point` and detaches loop devices backed by `images`, left by a run that
/// was killed before its guards ran.
pub fn cleanup_stale(tools: &Tools, mount_point: &Path, images: &[&Path]) -> Result<()> {
    if is_mounted(&read_mountinfo()?, mount_point) {
        eprintln!(
            "mover-bench: unmounting {} left by an earlier run",
            mount_point.display()
        );
        run_checked(Command::new(&tools.umount).arg(mount_point))?;
        if is_mounted(&read_mountinfo()?, mount_point) {
            bail!(
                "{} is still mounted (stacked mounts?): unmount it by hand",
                mount_point.display()
            );
        }
    }
    for image in images.iter().filter(|image| image.exists()) {
        for device in backing_loop_devices(tools, image)? {
            eprintln!("mover-bench: detaching {device} left by an earlier run");
            run_checked(Command::new(&tools.losetup).arg("-d").arg(&device))?;
        }
    }
    Ok(())
}

/// The text of `/proc/self/mountinfo`.
fn read_mountinfo() -> Result<String> {
    std::fs::read_to_string("/proc/self/mountinfo").context("cannot read /proc/self/mountinfo")
}

/// Whether `/proc/self/mountinfo` text lists `dir` as a mount point.
fn is_mounted(mountinfo: &str, dir: &Path) -> bool {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .any(|field| Path::new(&unescape_mountinfo(field)) == dir)
}

/// Undoes the octal escapes (`\040` for a space) of a mountinfo path field.
fn unescape_mountinfo(field: &str) -> String {
    let bytes = field.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|digits| {
            std::str::from_utf8(digits)
                .ok()
                .and_then(|d| u8::from_str_radix(d, 8).ok())
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Loop devices currently backed by `image` (`losetup -j`).
fn backing_loop_devices(tools: &Tools, image: &Path) -> Result<Vec<String>> {
    let out = run_checked(Command::new(&tools.losetup).arg("-j").arg(image))?;
    Ok(String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|line| line.split_once(':').map(|(dev, _)| dev.to_string()))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_paths_are_unescaped_and_matched() {
        let info = "36 35 98:0 / /var/tmp/my\\040bench/mnt rw,noatime - ext4 /dev/loop0 rw\n\
                    37 35 98:1 / /mnt2 rw - ext4 /dev/loop1 rw\n";
        assert!(is_mounted(info, Path::new("/var/tmp/my bench/mnt")));
        assert!(is_mounted(info, Path::new("/mnt2")));
        assert!(!is_mounted(info, Path::new("/var/tmp/my")));
    }
}
