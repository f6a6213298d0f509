//! Freezing a file system (mover::node::freeze) on a real XFS on a loop device: writes
//! block until the freeze is dropped, thawed, or its watchdog's deadline passes. Needs
//! root, as CI has.

mod common;

use common::{MIB, ScratchFs};
use mover::node::freeze::{freeze, is_mount_point};
use std::{
    fs::OpenOptions,
    io,
    os::unix::fs::FileExt,
    path::PathBuf,
    sync::mpsc,
    thread,
    time::{Duration, Instant},
};

/// Writes and fsyncs `path` on another thread; the receiver gets the time it took.
fn write_elsewhere(path: PathBuf) -> mpsc::Receiver<Duration> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let started = Instant::now();
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .unwrap();
        file.write_all_at(b"after the freeze", 0).unwrap();
        file.sync_all().unwrap();
        let _ = tx.send(started.elapsed());
    });
    rx
}

#[test]
fn freeze_blocks_writes_until_dropped_or_the_deadline() {
    let fs = ScratchFs::new("xfs", 320 * MIB);
    let at = |name: &str| fs.path().join(name);
    // Thawed before the unmount even if an assertion fails while frozen.
    struct ThawOnDrop<'a>(&'a std::path::Path);
    impl Drop for ThawOnDrop<'_> {
        fn drop(&mut self) {
            let _ = mover::node::freeze::thaw(self.0);
        }
    }
    let _thaw = ThawOnDrop(fs.path());
    std::fs::write(at("before"), b"x").unwrap();

    // Thawed on drop.
    let frozen = freeze(fs.path(), Duration::from_secs(30)).unwrap();
    assert!(frozen.is_frozen());
    let done = write_elsewhere(at("one"));
    assert!(
        done.recv_timeout(Duration::from_millis(300)).is_err(),
        "a write went through a frozen file system"
    );
    // A second freeze of a frozen file system is refused and leaves it frozen.
    let again = freeze(fs.path(), Duration::from_secs(30)).unwrap_err();
    assert_eq!(again.raw_os_error(), Some(libc::EBUSY), "{again:?}");
    drop(frozen);
    done.recv_timeout(Duration::from_secs(5))
        .expect("the write completes once thawed");
    assert_eq!(std::fs::read(at("one")).unwrap(), b"after the freeze");

    // Leaked: the watchdog thaws it after `max`.
    let started = Instant::now();
    std::mem::forget(freeze(fs.path(), Duration::from_millis(200)).unwrap());
    let took = write_elsewhere(at("two"))
        .recv_timeout(Duration::from_secs(5))
        .expect("the watchdog thaws a leaked freeze");
    // Not the write's own wait: on a loaded machine its thread may start late, even
    // after the thaw. A write that went through at once would finish before 200 ms.
    assert!(
        started.elapsed() >= Duration::from_millis(200),
        "the write finished {:?} after the freeze (it waited {took:?}): was it frozen at all?",
        started.elapsed()
    );

    // Held too long: thawing reports that the watchdog got there first.
    let frozen = freeze(fs.path(), Duration::from_millis(50)).unwrap();
    thread::sleep(Duration::from_millis(150));
    assert!(!frozen.is_frozen());
    let err = frozen.thaw().unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err:?}");
    // Thawed in time: no error.
    freeze(fs.path(), Duration::from_secs(30))
        .unwrap()
        .thaw()
        .unwrap();
    std::fs::write(at("three"), b"y").unwrap();
}

#[test]
fn a_freeze_target_is_a_mount_point_only_while_mounted() {
    // A cycle skips (and says so) a freeze target that is no longer mounted: the
    // workload stopped and unmounted it for a planned demote.
    let fs = ScratchFs::new("xfs", 320 * MIB);
    let mount = fs.path().to_path_buf();
    assert!(is_mount_point(&mount));
    let plain = tempfile::tempdir().unwrap();
    assert!(!is_mount_point(plain.path()), "a plain directory");
    assert!(!is_mount_point(&plain.path().join("gone")), "a missing one");
    drop(fs);
    assert!(!is_mount_point(&mount), "unmounted");
}

/// What a replication cycle freezes for a catch-up of an image's clone (issue 52): the
/// file systems mounted from the loop devices over the image, and only when those are
/// its only writers; anything else takes a fresh clone instead.
#[test]
fn the_only_writers_of_an_image_are_the_file_systems_mounted_from_it() {
    use mover::node::holders::sole_writers;
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let image = dir.path().join("vol.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(64 * MIB)
        .unwrap();
    let mkfs = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&image)
        .output()
        .unwrap();
    assert!(mkfs.status.success(), "{mkfs:?}");
    assert_eq!(
        sole_writers(&image).unwrap(),
        None,
        "no loop device: any process may open it and write"
    );
    let dev = common::LoopDevice::attach(&image);
    assert_eq!(
        sole_writers(&image).unwrap(),
        None,
        "a loop device not mounted is used raw: nothing to freeze"
    );
    let mount = common::Mount::new(&dev.path, &dir.path().join("mnt"));
    assert_eq!(
        sole_writers(&image).unwrap(),
        Some(vec![mount.dir.clone()]),
        "the ext4 mounted from it is its only writer"
    );
    let held = std::fs::File::open(&image).unwrap();
    assert_eq!(
        sole_writers(&image).unwrap(),
        None,
        "a process holding the image may write around a freeze"
    );
    drop(held);
    assert!(sole_writers(&image).unwrap().is_some());
}
