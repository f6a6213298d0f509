//! Helpers shared by the integration tests: seeded images, hashes, loop devices, the binary.
#![allow(dead_code, missing_docs)]

pub mod agent;
#[cfg(feature = "controller")]
pub mod cluster;
#[cfg(feature = "controller")]
pub mod csi;
#[cfg(feature = "controller")]
pub mod nodes;
pub mod pg;
#[cfg(feature = "controller")]
pub mod populate;
#[cfg(feature = "controller")]
pub mod site;
pub mod slowdown;
pub mod tree;

use rand::{RngCore, SeedableRng, rngs::StdRng};
use std::{
    fs::File,
    os::unix::fs::{FileExt, MetadataExt},
    path::{Path, PathBuf},
    process::{Command, Output},
};

pub const MIB: u64 = 1 << 20;

/// mover's populated StorageClass (its CSI driver; a PVC is bound where its first pod
/// runs) as every Kubernetes test names it, a YAML document.
pub const POPULATED_STORAGE_CLASS: &str = "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: mover-populated\nprovisioner: csi.replication.mover\nvolumeBindingMode: WaitForFirstConsumer\n";

/// A test's prerequisite (root, a tool, a kernel feature) is missing: under `CI=true`
/// the test fails (`.ci/run` installs and allows everything the tests need), elsewhere
/// it says so and the caller returns. Call as `if !have { return skip_unless_ci(..) }`.
pub fn skip_unless_ci(why: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{why}; CI=true, so this fails rather than skip (.ci/run provides it)");
    }
    eprintln!("SKIPPED: {why}");
}
pub const PAGE: u64 = 4096;

/// Creates a sparse image of `len` bytes with seeded random data at each (offset, length).
pub fn make_image(path: &Path, len: u64, seed: u64, extents: &[(u64, u64)]) {
    let f = File::create(path).unwrap();
    f.set_len(len).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    for &(off, n) in extents {
        let mut buf = vec![0u8; n as usize];
        rng.fill_bytes(&mut buf);
        f.write_all_at(&buf, off).unwrap();
    }
    f.sync_all().unwrap();
}

/// Writes explicit zeros (allocated, not a hole) over a range.
pub fn write_zeros(path: &Path, offset: u64, len: u64) {
    let f = File::options().write(true).open(path).unwrap();
    f.write_all_at(&vec![0u8; len as usize], offset).unwrap();
    f.sync_all().unwrap();
}

/// Overwrites `count` scattered 4 KiB pages (never the same page twice) with new random
/// data; returns how many pages now differ.
pub fn scribble_pages(path: &Path, seed: u64, count: u64, within: std::ops::Range<u64>) -> u64 {
    let f = File::options().write(true).open(path).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let pages = (within.end - within.start) / PAGE;
    let mut chosen = std::collections::BTreeSet::new();
    while (chosen.len() as u64) < count {
        chosen.insert(rng.next_u64() % pages);
    }
    let mut buf = vec![0u8; PAGE as usize];
    for p in &chosen {
        rng.fill_bytes(&mut buf);
        f.write_all_at(&buf, within.start + p * PAGE).unwrap();
    }
    chosen.len() as u64
}

/// GET `path` from the HTTP server at `addr` (HOST:PORT); the body of its 200 answer.
pub fn http_get(addr: &str, path: &str) -> String {
    let (status, body) = http_get_as(addr, path, None);
    assert_eq!(status, 200, "GET {addr}{path}: {body}");
    body
}

/// GET `path` from `addr` with a bearer `token` if any: the status and the body.
pub fn http_get_as(addr: &str, path: &str, token: Option<&str>) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let authorization = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{authorization}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// BLAKE3 of the first `len` bytes of a file or device.
pub fn blake3_of(path: &Path, len: u64) -> String {
    use std::io::Read;
    let mut h = blake3::Hasher::new();
    let mut r = File::open(path).unwrap().take(len);
    std::io::copy(&mut r, &mut h).unwrap();
    h.finalize().to_hex().to_string()
}

/// Size of a file or block device.
pub fn size_of(path: &Path) -> u64 {
    use std::io::Seek;
    File::open(path)
        .unwrap()
        .seek(std::io::SeekFrom::End(0))
        .unwrap()
}

/// Bytes actually allocated on disk for a file.
pub fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

/// Runs the `mover` binary under test with a private state directory.
pub fn mover(state: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mover"))
        .args(args)
        .env("MOVER_STATE_DIR", state)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

/// Parses the JSON summary of a successful `mover … --json` run.
pub fn json_of(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "mover failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A loop device attached to an image file, detached on drop. Panics (fails the test)
/// when loop devices cannot be used: these tests need root, as CI has.
pub struct LoopDevice {
    pub path: PathBuf,
}

impl LoopDevice {
    pub fn attach(image: &Path) -> Self {
        let out = Command::new("losetup")
            .args(["-f", "--show"])
            .arg(image)
            .output()
            .expect("losetup runs");
        assert!(
            out.status.success(),
            "cannot attach a loop device (these tests need root and /dev/loop*): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        LoopDevice {
            path: PathBuf::from(String::from_utf8(out.stdout).unwrap().trim()),
        }
    }

    pub fn as_str(&self) -> &str {
        self.path.to_str().unwrap()
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.path).status();
    }
}

/// A mounted filesystem, unmounted on drop.
pub struct Mount {
    pub dir: PathBuf,
}

impl Mount {
    pub fn new(dev: &Path, dir: &Path) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount")
            .arg(dev)
            .arg(dir)
            .status()
            .unwrap()
            .success();
        assert!(ok, "mount {} failed", dev.display());
        Mount { dir: dir.into() }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

/// A fresh filesystem of `kind` (`ext4`, `xfs`) on a loop device over a sparse image,
/// mounted at `dir`; unmounted, detached and removed on drop (fields drop in order).
pub struct ScratchFs {
    pub mount: Mount,
    dev: LoopDevice,
    _image: tempfile::TempDir,
}

impl ScratchFs {
    pub fn new(kind: &str, size: u64) -> Self {
        let image_dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let image = image_dir.path().join(format!("{kind}.img"));
        File::create(&image).unwrap().set_len(size).unwrap();
        let mkfs = Command::new(format!("mkfs.{kind}"))
            .arg("-q")
            .arg(&image)
            .output()
            .unwrap_or_else(|e| panic!("mkfs.{kind} runs (.ci/run installs it): {e}"));
        assert!(mkfs.status.success(), "mkfs.{kind}: {mkfs:?}");
        let dev = LoopDevice::attach(&image);
        let mount = Mount::new(&dev.path, &image_dir.path().join("mnt"));
        ScratchFs {
            mount,
            dev,
            _image: image_dir,
        }
    }

    pub fn path(&self) -> &Path {
        &self.mount.dir
    }

    /// The loop device the filesystem is mounted from.
    pub fn device(&self) -> &Path {
        &self.dev.path
    }

    /// Bytes in use on the filesystem, after flushing it.
    pub fn used(&self) -> u64 {
        let f = File::open(self.path()).unwrap();
        rustix::fs::syncfs(&f).unwrap();
        let s = rustix::fs::fstatvfs(&f).unwrap();
        (s.f_blocks - s.f_bfree) * s.f_frsize
    }
}
