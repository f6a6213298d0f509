//! The floor of a tree copy: the least time this machine allows for what the copy must
//! do, measured in the same run on the same filesystem. Three parts, each a lower bound
//! of its own, and the floor is the largest:
//! - walk: every entry the copy compares looked at once (a parallel cold `statx` of the
//!   trees: directories read, inodes loaded from the disk, the kernel's CPU counted);
//! - create: the new entries made (directories, empty files, symlinks), synced;
//! - data: the changed files' bytes read once and written once at the disk's direct speed;
//! - cpu: for a snapshot or a restore, those bytes hashed, compressed and sealed at the
//!   fastest speeds measured on this machine (`CpuSpeed` in cpu.rs; none for a copy).
//!
//! A job does at least each of these, so it takes at least the longest one.

use crate::charts::{Bar, bar_chart};
use crate::floor::{DeviceSpeed, MAX_OVER_FLOOR};
use anyhow::{Context, Result};
use serde::Serialize;
use std::{
    collections::VecDeque,
    fs,
    io::Write,
    path::{Path, PathBuf},
    sync::{
        Condvar, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Instant, UNIX_EPOCH},
};

/// One step's floor, in seconds per part.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct TreeFloor {
    pub walk: f64,
    pub create: f64,
    pub data: f64,
    pub cpu: f64,
}

impl TreeFloor {
    /// The least time the step takes: its slowest part.
    pub fn seconds(&self) -> f64 {
        self.walk.max(self.create).max(self.data).max(self.cpu)
    }

    /// `walk 1.20 s, create 2.10 s, data 3.80 s` (and `, cpu 2.40 s` where it counts).
    pub fn describe(&self) -> String {
        let cpu = if self.cpu > 0.0 {
            format!(", cpu {:.2} s", self.cpu)
        } else {
            String::new()
        };
        format!(
            "walk {:.2} s, create {:.2} s, data {:.2} s{cpu}",
            self.walk, self.create, self.data
        )
    }
}

/// A bar chart at `path` of each (label, time / floor) against [`MAX_OVER_FLOOR`].
pub fn over_floor_chart(path: &Path, rows: &[(String, f64)]) -> Result<()> {
    let bars: Vec<Bar> = rows
        .iter()
        .map(|(label, value)| Bar {
            label: label.clone(),
            value: *value,
            target: Some(MAX_OVER_FLOOR),
            pass: *value <= MAX_OVER_FLOOR,
        })
        .collect();
    bar_chart(
        path,
        "time over the floor",
        "x the floor (target: black tick, at most)",
        &bars,
    )
}

/// The disk holding `dir`, measured reading a file of its own: 1 GiB of random bytes
/// written and synced there first, removed afterwards (the tree lies in a sparse image,
/// whose reads would time its holes, not the disk).
pub fn disk_speed(dir: &Path) -> Result<DeviceSpeed> {
    let file = dir.join(".floor-read.tmp");
    let result = (|| -> Result<DeviceSpeed> {
        let mut out = fs::File::create(&file)?;
        let mut buffer = vec![0u8; 4 << 20];
        crate::prng::SplitMix64::new(1, 7).fill(&mut buffer);
        for _ in 0..256 {
            out.write_all(&buffer)?;
        }
        out.sync_all()?;
        DeviceSpeed::measure(dir, &file)
    })();
    _ = fs::remove_file(&file);
    result.with_context(|| format!("cannot measure the disk under {}", dir.display()))
}

/// How many threads the walks may use: the best of a few per core and many per core (a
/// cold walk waits on the disk far more than it computes).
fn thread_counts() -> [usize; 2] {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    [2 * cores, 8 * cores]
}

/// The fastest cold walk of `roots` (absent ones skipped): each attempt from a dropped
/// page cache, every entry's inode loaded (`statx` through its directory, as `find -ls`).
pub fn walk_seconds(roots: &[&Path]) -> Result<f64> {
    let roots: Vec<PathBuf> = roots
        .iter()
        .filter(|r| r.is_dir())
        .map(|r| r.to_path_buf())
        .collect();
    let mut best = f64::INFINITY;
    for threads in thread_counts() {
        crate::process::drop_caches()?;
        let started = Instant::now();
        for_each_dir(&roots, threads, |dir| {
            let mut subdirs = Vec::new();
            for entry in fs::read_dir(dir)? {
                let entry = entry?;
                if entry.metadata()?.is_dir() {
                    subdirs.push(entry.path());
                }
            }
            Ok(subdirs)
        })?;
        best = best.min(started.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// An entry of a tree's skeleton.
enum Skeleton {
    Dir(PathBuf),
    File(PathBuf),
    Symlink(PathBuf, PathBuf),
}

/// The time to make `src`'s skeleton (every directory, every file empty, every symlink)
/// anew under `scratch` (on the same filesystem as the copies) with many threads, then
/// sync the filesystem. The listing is read before the clock starts; `scratch` is
/// removed afterwards.
pub fn create_seconds(src: &Path, scratch: &Path) -> Result<f64> {
    let seconds = make_skeleton(src, scratch);
    fs::remove_dir_all(scratch)
        .with_context(|| format!("cannot remove the floor's scratch {}", scratch.display()))?;
    seconds
}

/// Makes `src`'s skeleton under `scratch` (see [`create_seconds`]); the time it took.
fn make_skeleton(src: &Path, scratch: &Path) -> Result<f64> {
    let entries = Mutex::new(Vec::new());
    for_each_dir(&[src.to_path_buf()], thread_counts()[1], |dir| {
        let mut subdirs = Vec::new();
        let mut found = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let path = entry.path();
            let to = scratch.join(path.strip_prefix(src)?);
            let kind = entry.file_type()?;
            if kind.is_dir() {
                subdirs.push(path);
                found.push(Skeleton::Dir(to));
            } else if kind.is_symlink() {
                found.push(Skeleton::Symlink(fs::read_link(&path)?, to));
            } else {
                found.push(Skeleton::File(to));
            }
        }
        entries.lock().unwrap().extend(found);
        Ok(subdirs)
    })?;
    let mut entries = entries.into_inner().unwrap();
    // Parents before children: by depth, the directories first.
    entries.sort_by_key(|e| match e {
        Skeleton::Dir(p) => (0, p.components().count()),
        _ => (1, 0),
    });
    _ = fs::remove_dir_all(scratch);
    let started = Instant::now();
    fs::create_dir_all(scratch)?;
    // One level of directories at a time (each needs its parent), then everything else.
    let mut rest = &entries[..];
    while !rest.is_empty() {
        let level = match &rest[0] {
            Skeleton::Dir(p) => {
                let depth = p.components().count();
                rest.iter()
                    .take_while(
                        |e| matches!(e, Skeleton::Dir(p) if p.components().count() == depth),
                    )
                    .count()
            }
            _ => rest.len(),
        };
        in_parallel(&rest[..level], thread_counts()[1], |e| match e {
            Skeleton::Dir(p) => fs::create_dir(p),
            Skeleton::File(p) => fs::File::create(p).map(drop),
            Skeleton::Symlink(target, p) => std::os::unix::fs::symlink(target, p),
        })?;
        rest = &rest[level..];
    }
    rustix::fs::syncfs(fs::File::open(scratch)?)?;
    Ok(started.elapsed().as_secs_f64())
}

/// The bytes of `src`'s regular files that a copy into `dst` must write: those absent
/// there, or there with another size or modification time.
pub fn changed_bytes(src: &Path, dst: &Path) -> Result<u64> {
    bytes_unlike(src, |rel, meta| {
        fs::symlink_metadata(dst.join(rel)).is_ok_and(|t| t.is_file() && same_stamp(&t, meta))
    })
}

/// A tree's regular files by path (relative to its root): size and modification time.
pub type Stamps = std::collections::HashMap<PathBuf, (u64, Option<std::time::Duration>)>;

/// The size and modification time of every regular file under `root`.
pub fn stamps(root: &Path) -> Result<Stamps> {
    let found = Mutex::new(Stamps::new());
    for_each_file(root, |rel, meta| {
        let stamp = (meta.len(), mtime(meta));
        found.lock().unwrap().insert(rel.to_path_buf(), stamp);
    })?;
    Ok(found.into_inner().unwrap())
}

/// The bytes of `root`'s regular files new or changed since `before` was taken: what an
/// incremental snapshot must read.
pub fn bytes_changed_since(root: &Path, before: &Stamps) -> Result<u64> {
    bytes_unlike(root, |rel, meta| {
        before.get(rel) == Some(&(meta.len(), mtime(meta)))
    })
}

/// Writes to `out` a sample of `root`'s file contents for the CPU floor's speeds: every
/// regular file if they come to at most `max_bytes`, else an even share of them (every
/// k-th in path order), concatenated. Returns the bytes written.
pub fn sample_contents(root: &Path, out: &Path, max_bytes: u64) -> Result<u64> {
    let mut files: Vec<(PathBuf, u64)> = stamps(root)?
        .into_iter()
        .map(|(rel, (len, _))| (rel, len))
        .collect();
    files.sort();
    let total: u64 = files.iter().map(|f| f.1).sum();
    let stride = total.div_ceil(max_bytes.max(1)).max(1) as usize;
    let mut sample = fs::File::create(out)
        .with_context(|| format!("cannot create the CPU floor's sample {}", out.display()))?;
    let mut written = 0;
    for (rel, _) in files.iter().step_by(stride) {
        let path = root.join(rel);
        let mut file =
            fs::File::open(&path).with_context(|| format!("cannot read {}", path.display()))?;
        written += std::io::copy(&mut file, &mut sample)?;
    }
    sample.sync_all()?;
    Ok(written)
}

fn same_stamp(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    a.len() == b.len() && mtime(a) == mtime(b)
}

/// The total size of `root`'s regular files for which `unchanged(path relative to root,
/// its metadata)` is false.
fn bytes_unlike(
    root: &Path,
    unchanged: impl Fn(&Path, &fs::Metadata) -> bool + Sync,
) -> Result<u64> {
    let total = AtomicU64::new(0);
    for_each_file(root, |rel, meta| {
        if !unchanged(rel, meta) {
            total.fetch_add(meta.len(), Ordering::Relaxed);
        }
    })?;
    Ok(total.into_inner())
}

/// Calls `visit(path relative to root, its metadata)` for every regular file under
/// `root`, from several threads.
fn for_each_file(root: &Path, visit: impl Fn(&Path, &fs::Metadata) + Sync) -> Result<()> {
    for_each_dir(&[root.to_path_buf()], thread_counts()[0], |dir| {
        let mut subdirs = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            let meta = entry.metadata()?;
            if meta.is_dir() {
                subdirs.push(entry.path());
            } else if meta.is_file() {
                visit(entry.path().strip_prefix(root)?, &meta);
            }
        }
        Ok(subdirs)
    })
}

fn mtime(meta: &fs::Metadata) -> Option<std::time::Duration> {
    meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()
}

/// Runs `make` on every item with `threads` threads; the first error, if any.
fn in_parallel<T: Sync>(
    items: &[T],
    threads: usize,
    make: impl Fn(&T) -> std::io::Result<()> + Sync,
) -> Result<()> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    while let Some(item) = items.get(next.fetch_add(1, Ordering::Relaxed)) {
                        make(item)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for w in workers {
            w.join().expect("floor worker panicked")?;
        }
        Ok(())
    })
}

/// Visits every directory below (and including) `roots` with `threads` threads:
/// `visit(dir)` returns the subdirectories to visit next. The first error stops the walk.
fn for_each_dir(
    roots: &[PathBuf],
    threads: usize,
    visit: impl Fn(&Path) -> Result<Vec<PathBuf>> + Sync,
) -> Result<()> {
    // The directories not yet taken, and how many are taken but not done (their
    // subdirectories may still come).
    let queue = Mutex::new((roots.iter().cloned().collect::<VecDeque<_>>(), 0usize));
    let changed = Condvar::new();
    let failed: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let worker = || loop {
        let dir = {
            let mut q = queue.lock().unwrap();
            loop {
                if failed.lock().unwrap().is_some() {
                    return;
                }
                if let Some(dir) = q.0.pop_front() {
                    q.1 += 1;
                    break dir;
                }
                if q.1 == 0 {
                    return;
                }
                q = changed.wait(q).unwrap();
            }
        };
        let found = visit(&dir).with_context(|| format!("cannot walk {}", dir.display()));
        let mut q = queue.lock().unwrap();
        q.1 -= 1;
        match found {
            Ok(subdirs) => q.0.extend(subdirs),
            Err(e) => {
                failed.lock().unwrap().get_or_insert(e);
            }
        }
        changed.notify_all();
    };
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(worker);
        }
    });
    match failed.into_inner().unwrap() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small tree: two levels of directories, files of known sizes, a symlink.
    fn tree(root: &Path) {
        for d in ["a/b", "c"] {
            fs::create_dir_all(root.join(d)).unwrap();
        }
        fs::write(root.join("a/one"), vec![1u8; 100]).unwrap();
        fs::write(root.join("a/b/two"), vec![2u8; 200]).unwrap();
        fs::write(root.join("c/three"), vec![3u8; 300]).unwrap();
        std::os::unix::fs::symlink("a/one", root.join("link")).unwrap();
    }

    #[test]
    fn every_directory_is_visited_once() {
        let t = tempfile::tempdir().unwrap();
        tree(t.path());
        let seen = Mutex::new(Vec::new());
        for_each_dir(&[t.path().to_path_buf()], 4, |dir| {
            seen.lock()
                .unwrap()
                .push(dir.strip_prefix(t.path())?.to_path_buf());
            Ok(fs::read_dir(dir)?
                .filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect())
        })
        .unwrap();
        let mut seen = seen.into_inner().unwrap();
        seen.sort();
        let want: Vec<PathBuf> = ["", "a", "a/b", "c"].iter().map(PathBuf::from).collect();
        assert_eq!(seen, want);
    }

    #[test]
    fn a_walk_error_names_the_directory() {
        let t = tempfile::tempdir().unwrap();
        tree(t.path());
        let err = for_each_dir(&[t.path().to_path_buf()], 3, |dir| {
            if dir.ends_with("c") {
                anyhow::bail!("refused");
            }
            Ok(fs::read_dir(dir)?
                .filter_map(|e| e.ok())
                .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                .map(|e| e.path())
                .collect())
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("/c: refused"), "{err:#}");
    }

    #[test]
    fn changed_bytes_counts_files_new_or_differing_in_size_or_time() {
        let (src, dst) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        tree(src.path());
        assert_eq!(changed_bytes(src.path(), dst.path()).unwrap(), 600);
        // A copy that keeps times: nothing to write.
        let status = std::process::Command::new("cp")
            .arg("-a")
            .arg(format!("{}/.", src.path().display()))
            .arg(dst.path())
            .status()
            .unwrap();
        assert!(status.success());
        assert_eq!(changed_bytes(src.path(), dst.path()).unwrap(), 0);
        fs::write(src.path().join("a/b/two"), vec![9u8; 250]).unwrap();
        fs::remove_file(dst.path().join("c/three")).unwrap();
        assert_eq!(changed_bytes(src.path(), dst.path()).unwrap(), 550);
    }

    #[test]
    fn bytes_changed_since_counts_new_and_rewritten_files() {
        let t = tempfile::tempdir().unwrap();
        tree(t.path());
        let before = stamps(t.path()).unwrap();
        assert_eq!(before.len(), 3, "regular files only: {before:?}");
        assert_eq!(bytes_changed_since(t.path(), &before).unwrap(), 0);
        fs::write(t.path().join("a/one"), vec![5u8; 120]).unwrap();
        fs::write(t.path().join("c/four"), vec![4u8; 40]).unwrap();
        fs::remove_file(t.path().join("a/b/two")).unwrap();
        assert_eq!(bytes_changed_since(t.path(), &before).unwrap(), 160);
    }

    #[test]
    fn the_sample_takes_every_file_or_an_even_share() {
        let (src, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        tree(src.path());
        let out = work.path().join("sample");
        assert_eq!(sample_contents(src.path(), &out, 1 << 20).unwrap(), 600);
        assert_eq!(fs::metadata(&out).unwrap().len(), 600);
        // 600 bytes in at most 300: every second file in path order (a/b/two, c/three).
        assert_eq!(sample_contents(src.path(), &out, 300).unwrap(), 500);
    }

    #[test]
    fn the_skeleton_has_every_directory_empty_file_and_symlink_and_is_removed() {
        let (src, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        tree(src.path());
        let scratch = work.path().join("skeleton");
        make_skeleton(src.path(), &scratch).unwrap();
        for d in ["a", "a/b", "c"] {
            assert!(scratch.join(d).is_dir(), "{d}");
        }
        for f in ["a/one", "a/b/two", "c/three"] {
            assert_eq!(fs::metadata(scratch.join(f)).unwrap().len(), 0, "{f}");
        }
        assert_eq!(
            fs::read_link(scratch.join("link")).unwrap(),
            PathBuf::from("a/one")
        );
        create_seconds(src.path(), &scratch).unwrap();
        assert!(!scratch.exists(), "the scratch skeleton is removed");
    }
}
