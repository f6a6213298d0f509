//! Freezing a file system for an application-consistent point in time: writes block
//! while a clone (or, without reflinks, a whole read) is taken. A watchdog thaws it
//! after a deadline even if the holder is stuck, so applications never hang on mover.

use std::{
    fs::{File, OpenOptions},
    io,
    os::{fd::AsRawFd, unix::fs::OpenOptionsExt},
    path::{Path, PathBuf},
    sync::{Arc, Condvar, Mutex, PoisonError},
    thread::JoinHandle,
    time::{Duration, Instant},
};

/// Whether `path` is where a file system is mounted (its device differs from its
/// parent's, or its parent cannot be read). False once the file system is unmounted,
/// or the directory is gone.
pub fn is_mount_point(path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev());
    let Ok(m) = dev(path) else {
        return false;
    };
    path.parent().map_or(Ok(u64::MAX), dev).unwrap_or(u64::MAX) != m
}

/// Checks that `mount` is the mount point of a file system other than the one holding
/// `source`: freezing a plain directory would freeze whatever file system it is on (the
/// root, say), and freezing the file system that holds the image would block its clone.
pub fn check_freeze(mount: &Path, source: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev());
    let m = dev(mount).map_err(|e| format!("freeze {}: {e}", mount.display()))?;
    if !is_mount_point(mount) {
        return Err(format!(
            "freeze {}: not a mount point; give the directory where the volume's file \
             system is mounted",
            mount.display()
        ));
    }
    if let Some(dir) = source.parent()
        && dev(dir).is_ok_and(|d| d == m)
    {
        return Err(format!(
            "freeze {}: that file system holds the volume {} itself; freeze the file \
             system inside the volume (where the application writes)",
            mount.display(),
            source.display()
        ));
    }
    Ok(())
}

/// Where the file systems on the block device `device` are mounted (this process's
/// mount namespace: the node's, for the agent), from /proc/self/mountinfo. Empty for a
/// device not mounted, or a path that is not a block device.
pub fn mounts_of(device: &Path) -> io::Result<Vec<PathBuf>> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(device)?;
    if !meta.file_type().is_block_device() {
        return Ok(Vec::new());
    }
    let rdev = meta.rdev();
    let want = format!("{}:{}", rustix::fs::major(rdev), rustix::fs::minor(rdev));
    let info = std::fs::read_to_string("/proc/self/mountinfo")?;
    Ok(info
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (f.get(2) == Some(&want.as_str())).then(|| f.get(4).map(|m| unescape(m)))?
        })
        .collect())
}

/// A mountinfo path: spaces, tabs, newlines and backslashes are octal escapes there.
pub(crate) fn unescape(s: &str) -> PathBuf {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(out))
}

/// `FIFREEZE`: `_IOWR('X', 119, int)`.
const FIFREEZE: u32 = 0xC004_5877;
/// `FITHAW`: `_IOWR('X', 120, int)`.
const FITHAW: u32 = 0xC004_5878;

/// Calls `FIFREEZE` or `FITHAW` on an fd of the file system.
#[allow(unsafe_code)] // libc and rustix wrap neither ioctl; see SAFETY.
fn freeze_ioctl(dir: &File, request: u32) -> io::Result<()> {
    // SAFETY: FIFREEZE and FITHAW take no argument (the kernel ignores the third one, so
    // no memory is read or written through it); the fd is valid for the borrow of `dir`.
    let rc = unsafe { libc::ioctl(dir.as_raw_fd(), request as _, 0) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Thaws the file system holding `mount_point`; one that is not frozen is left alone.
///
/// For recovery: an agent killed while holding a [`Frozen`] leaves its file system frozen
/// (the kernel does not thaw it when the process dies), so the agent thaws the file
/// systems it may have frozen when it starts again.
pub fn thaw(mount_point: &Path) -> io::Result<()> {
    let dir = File::open(mount_point)?;
    match freeze_ioctl(&dir, FITHAW) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
        other => other,
    }
}

/// A frozen file system: writes to it block until it is thawed, which happens when this
/// is dropped or [thawed](Frozen::thaw), or by a watchdog thread once the deadline given
/// to [`freeze`] passes, whichever comes first.
#[must_use = "the file system is thawed as soon as this is dropped"]
pub struct Frozen {
    shared: Arc<FreezeState>,
    watchdog: Option<JoinHandle<()>>,
}

/// What the guard and its watchdog share.
struct FreezeState {
    mount_point: PathBuf,
    hold: Mutex<Hold>,
    wake: Condvar,
}

/// Whether the freeze is still held.
enum Hold {
    /// Frozen, through this fd of the file system.
    Frozen(File),
    /// Thawed, by whichever side got there first. The fd is closed by then, so a leaked
    /// guard does not keep the file system busy (it could not be unmounted).
    Thawed(ThawedBy),
}

/// Who thawed the file system.
#[derive(Clone, Copy, PartialEq, Eq)]
enum ThawedBy {
    Holder,
    Watchdog,
}

impl FreezeState {
    /// Thaws unless already thawed (never twice: the second would thaw a freeze that
    /// someone else has taken since). Returns who had thawed it and the thaw's error.
    fn thaw(&self, by: ThawedBy) -> (ThawedBy, io::Result<()>) {
        let mut hold = self.hold.lock().unwrap_or_else(PoisonError::into_inner);
        let dir = match std::mem::replace(&mut *hold, Hold::Thawed(by)) {
            Hold::Frozen(dir) => dir,
            Hold::Thawed(first) => {
                *hold = Hold::Thawed(first);
                return (first, Ok(()));
            }
        };
        self.wake.notify_all();
        let result = match freeze_ioctl(&dir, FITHAW) {
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(()),
            other => other,
        };
        (by, result)
    }

    fn is_frozen(&self) -> bool {
        let hold = self.hold.lock().unwrap_or_else(PoisonError::into_inner);
        matches!(*hold, Hold::Frozen(_))
    }
}

/// Freezes the file system mounted at `mount_point` (any directory on it will do), for
/// an application-consistent point in time: the kernel flushes it and blocks new writes
/// until the returned guard thaws it. A watchdog thaws it after `max` whatever the
/// guard's holder does, so a stuck or leaking holder cannot leave it frozen for longer.
/// `max` counts from the start of the call: the flush that freezing starts with already
/// holds writers back.
///
/// Needs `CAP_SYS_ADMIN`. A file system already frozen by someone else fails with
/// `EBUSY` and is left as it is.
pub fn freeze(mount_point: &Path, max: Duration) -> io::Result<Frozen> {
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY)
        .open(mount_point)?;
    let started = Instant::now();
    freeze_ioctl(&dir, FIFREEZE)?;
    let shared = Arc::new(FreezeState {
        mount_point: mount_point.to_path_buf(),
        hold: Mutex::new(Hold::Frozen(dir)),
        wake: Condvar::new(),
    });
    let watched = Arc::clone(&shared);
    let watchdog = std::thread::Builder::new()
        .name("thaw-watchdog".into())
        .spawn(move || watchdog(&watched, started + max));
    match watchdog {
        Ok(handle) => {
            tracing::debug!(mount_point = %mount_point.display(), "file system frozen");
            Ok(Frozen {
                shared,
                watchdog: Some(handle),
            })
        }
        Err(e) => {
            let _ = shared.thaw(ThawedBy::Holder);
            Err(e)
        }
    }
}

/// Waits until `state` is thawed or `deadline` passes, and thaws it in the latter case.
fn watchdog(state: &FreezeState, deadline: Instant) {
    let mut hold = state.hold.lock().unwrap_or_else(PoisonError::into_inner);
    while matches!(*hold, Hold::Frozen(_)) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            drop(hold);
            if let (ThawedBy::Watchdog, result) = state.thaw(ThawedBy::Watchdog) {
                tracing::warn!(
                    mount_point = %state.mount_point.display(),
                    error = result.err().map(tracing::field::display),
                    "file system held frozen past its deadline: thawed by the watchdog"
                );
            }
            return;
        }
        hold = state
            .wake
            .wait_timeout(hold, left)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

impl Frozen {
    /// Whether the file system is still frozen by this guard (the watchdog has not
    /// thawed it).
    pub fn is_frozen(&self) -> bool {
        self.shared.is_frozen()
    }

    /// Thaws the file system now. Fails with [`io::ErrorKind::TimedOut`] if the watchdog
    /// had already thawed it: whatever was taken under the freeze may then not be
    /// consistent, and should be taken again.
    pub fn thaw(mut self) -> io::Result<()> {
        let (by, result) = self.shared.thaw(ThawedBy::Holder);
        self.join_watchdog();
        if by == ThawedBy::Watchdog {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "{} was thawed by the watchdog before its holder was done",
                    self.shared.mount_point.display()
                ),
            ));
        }
        result
    }

    fn join_watchdog(&mut self) {
        if let Some(handle) = self.watchdog.take() {
            let _ = handle.join();
        }
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        if let (ThawedBy::Holder, Err(e)) = self.shared.thaw(ThawedBy::Holder) {
            tracing::warn!(
                mount_point = %self.shared.mount_point.display(),
                error = %e,
                "cannot thaw file system"
            );
        }
        self.join_watchdog();
    }
}

impl std::fmt::Debug for Frozen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frozen")
            .field("mount_point", &self.shared.mount_point)
            .field("frozen", &self.is_frozen())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_paths_are_unescaped_and_non_devices_have_no_mounts() {
        assert_eq!(
            unescape(r"/var/lib/kubelet/pods/a\040b/vol\134x"),
            PathBuf::from(r"/var/lib/kubelet/pods/a b/vol\x")
        );
        assert_eq!(unescape(r"/no\escape\9"), PathBuf::from(r"/no\escape\9"));
        // A directory, a regular file: not block devices.
        assert!(mounts_of(Path::new("/")).unwrap().is_empty());
        assert!(
            mounts_of(Path::new("/proc/self/mountinfo"))
                .unwrap()
                .is_empty()
        );
        assert!(mounts_of(Path::new("/no/such/device")).is_err());
    }
}
