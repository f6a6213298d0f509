//! Points in time of an image file, and what changed between two of them.
//!
//! Continuous replication of an image file on a reflink file system (XFS, Btrfs) takes
//! each cycle's point in time as a reflink clone of the live image ([`clone_file`]):
//! instant, and no extra space until the live image is written. Because a write to a
//! shared block lands in a fresh block (copy on write), two clones of one image share the
//! physical blocks of every range not written between them, and the file system's extent
//! maps (`FIEMAP`) tell which ranges those are without reading a byte
//! ([`changed_ranges`]). Freezing a file system around the clone, for an application-
//! consistent point in time, is mover's (`mover::node::freeze`): it is about the node,
//! not about chunks.
//!
//! Where reflinks are missing ([`is_no_reflink`]) or `FIEMAP` is (`Ok(None)`), the caller
//! falls back to the saved index or a Merkle comparison.

use std::{
    fs::{File, OpenOptions},
    io,
    ops::Range,
    os::{fd::AsRawFd, unix::fs::OpenOptionsExt},
    path::Path,
};

/// Creates `dst`, which must not exist, as a reflink clone of `src` (mode 0600), and
/// makes it durable: `dst` and its directory are fsynced.
///
/// On failure `dst` is removed. Where the file system cannot share blocks between the two
/// (no reflinks, or `src` and `dst` on different file systems), the error satisfies
/// [`is_no_reflink`].
pub fn clone_file(src: &Path, dst: &Path) -> io::Result<()> {
    let from = File::open(src)?;
    let to = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    let done = rustix::fs::ioctl_ficlone(&to, &from)
        .map_err(io::Error::from)
        .and_then(|()| to.sync_all())
        .and_then(|()| crate::durable::sync_dir(crate::durable::parent_of(dst)));
    if let Err(e) = done {
        drop(to);
        let _ = std::fs::remove_file(dst);
        return Err(e);
    }
    tracing::debug!(src = %src.display(), dst = %dst.display(), "reflink clone taken");
    Ok(())
}

/// Makes `dst` share `src`'s blocks over `ranges` (`FICLONERANGE`, one call per range,
/// holes included): afterwards `dst` reads as `src` there. Ranges must be block aligned,
/// except one that ends at the end of both files. With [`changed_ranges`] this brings an
/// older clone up to date at a cost that grows with what changed, where a fresh clone
/// costs every extent of the file (seconds for a fragmented volume image). Not made
/// durable here: a caller that relies on it after a crash syncs `dst`.
#[allow(unsafe_code)] // rustix wraps only FICLONE; see SAFETY.
pub fn reclone_ranges(src: &File, dst: &File, ranges: &[Range<u64>]) -> io::Result<()> {
    for r in ranges.iter().filter(|r| !r.is_empty()) {
        let arg = libc::file_clone_range {
            src_fd: i64::from(src.as_raw_fd()),
            src_offset: r.start,
            src_length: r.end - r.start,
            dest_offset: r.start,
        };
        // SAFETY: `arg` is a repr(C) `struct file_clone_range` of plain integers that the
        // kernel only reads during the call; both fds are valid for the borrows.
        let rc = unsafe {
            libc::ioctl(
                dst.as_raw_fd(),
                libc::FICLONERANGE as _,
                std::ptr::from_ref(&arg),
            )
        };
        if rc < 0 {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("cannot clone bytes {}..{}: {e}", r.start, r.end),
            ));
        }
    }
    Ok(())
}

/// `ranges` sorted, with overlapping or touching ones merged.
pub fn merge_ranges(mut ranges: Vec<Range<u64>>) -> Vec<Range<u64>> {
    ranges.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match merged.last_mut() {
            Some(m) if r.start <= m.end => m.end = m.end.max(r.end),
            _ => merged.push(r),
        }
    }
    merged
}

/// [`clone_file`] into `dst`, replacing what a killed run left there; `Ok(false)` where
/// the file system has no reflinks (see [`is_no_reflink`]), so the caller reads the live
/// file instead.
pub fn clone_fresh(src: &Path, dst: &Path) -> io::Result<bool> {
    let _ = std::fs::remove_file(dst);
    match clone_file(src, dst) {
        Ok(()) => Ok(true),
        Err(e) if is_no_reflink(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether an error from [`clone_file`] means "no reflinks here" (the file system has
/// none, or source and destination are on different ones), as opposed to a real failure.
pub fn is_no_reflink(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::Unsupported
        || matches!(
            e.raw_os_error(),
            // ENOTTY: a file system (e.g. some FUSE ones) that does not know the ioctl.
            Some(libc::EOPNOTSUPP | libc::EXDEV | libc::EINVAL | libc::ENOTTY)
        )
}

/// The byte ranges (logical offsets, sorted, merged) where `new` does not share the
/// physical blocks of `old` at the same offset, over `0..max(len(old), len(new))`: what
/// was written between two reflink clones of one image (or since a clone, if `new` is the
/// live image). `Ok(None)` when the file system has no `FIEMAP`.
///
/// A hole on both sides is unchanged, as is the part of a file past its end (it reads as
/// zeros): growing a file by a hole reports nothing, growing it with data reports the
/// data, shrinking it reports the data cut off; the caller applies `new`'s length itself.
/// A hole on one side and data on the other is changed, and so is every extent whose
/// physical place the file system does not vouch for (unknown, delayed allocation,
/// encoded (compressed), inline, not block aligned), or whose unwritten state differs.
/// Ranges are block aligned except at the end of a file.
///
/// Only meaningful where writes never land in place in a shared block: between reflink
/// clones on a copy-on-write file system. Two unrelated files always differ in full
/// (they share nothing), which is correct but useless.
pub fn changed_ranges(old: &File, new: &File) -> io::Result<Option<Vec<Range<u64>>>> {
    let old_len = old.metadata()?.len();
    let new_len = new.metadata()?.len();
    let unsupported = |e: io::Error| match e.raw_os_error() {
        Some(libc::EOPNOTSUPP | libc::ENOTTY) => Ok(None),
        _ => Err(e),
    };
    let old_map = match ExtentMap::new(old, old_len) {
        Ok(map) => map,
        Err(e) => return unsupported(e),
    };
    let new_map = match ExtentMap::new(new, new_len) {
        Ok(map) => map,
        Err(e) => return unsupported(e),
    };
    diff_maps(old_map, new_map, old_len.max(new_len)).map(Some)
}

/// One extent of a file: `len` bytes at `logical` in the file live at `physical` on the
/// device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Extent {
    logical: u64,
    physical: u64,
    len: u64,
    flags: u32,
}

impl Extent {
    fn end(&self) -> u64 {
        self.logical + self.len
    }

    /// Whether the file system gives no stable physical place for it, so it cannot be
    /// proven shared.
    fn unsure(&self) -> bool {
        self.flags & UNSURE != 0
    }

    /// Whether `self` and `other`, both covering `pos`, hold the same block there.
    fn same_block_at(&self, other: &Extent, pos: u64) -> bool {
        !self.unsure()
            && !other.unsure()
            && self.flags & FIEMAP_EXTENT_UNWRITTEN == other.flags & FIEMAP_EXTENT_UNWRITTEN
            && self.physical.checked_add(pos - self.logical)
                == other.physical.checked_add(pos - other.logical)
    }
}

/// Walks two sorted extent maps side by side and collects the ranges of `0..end` where
/// they do not hold the same block at the same offset. Extents of each map must be sorted
/// and not overlap; the two maps may split the same blocks differently.
fn diff_maps(
    old: impl Iterator<Item = io::Result<Extent>>,
    new: impl Iterator<Item = io::Result<Extent>>,
    end: u64,
) -> io::Result<Vec<Range<u64>>> {
    let mut old = old.peekable();
    let mut new = new.peekable();
    let mut changed: Vec<Range<u64>> = Vec::new();
    let mut pos = 0;
    while pos < end {
        let a = current(&mut old, pos)?;
        let b = current(&mut new, pos)?;
        // Each side at `pos`: the extent covering it, else a hole until the next extent.
        let side = |e: Option<Extent>| match e {
            Some(e) if e.logical <= pos => (Some(e), e.end()),
            Some(e) => (None, e.logical),
            None => (None, end),
        };
        let ((a, a_until), (b, b_until)) = (side(a), side(b));
        let until = a_until.min(b_until).min(end);
        let same = match (a, b) {
            (None, None) => true,
            (Some(a), Some(b)) => a.same_block_at(&b, pos),
            _ => false,
        };
        if !same {
            match changed.last_mut() {
                Some(last) if last.end == pos => last.end = until,
                _ => changed.push(pos..until),
            }
        }
        pos = until;
    }
    Ok(changed)
}

/// The first extent of `map` that ends after `pos` (dropping those before), if any.
fn current(
    map: &mut std::iter::Peekable<impl Iterator<Item = io::Result<Extent>>>,
    pos: u64,
) -> io::Result<Option<Extent>> {
    loop {
        match map.peek() {
            None => return Ok(None),
            Some(Ok(e)) if e.end() > pos => return Ok(Some(*e)),
            Some(Ok(_)) => {
                map.next();
            }
            Some(Err(_)) => return Err(map.next().and_then(Result::err).expect("peeked")),
        }
    }
}

/// `FS_IOC_FIEMAP`: `_IOWR('f', 11, struct fiemap)`.
const FS_IOC_FIEMAP: u32 = 0xC020_660B;
/// Flush delayed allocations first, so dirty data has its final place.
const FIEMAP_FLAG_SYNC: u32 = 0x1;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
const FIEMAP_EXTENT_UNKNOWN: u32 = 0x2;
const FIEMAP_EXTENT_DELALLOC: u32 = 0x4;
const FIEMAP_EXTENT_ENCODED: u32 = 0x8;
const FIEMAP_EXTENT_NOT_ALIGNED: u32 = 0x100;
const FIEMAP_EXTENT_DATA_INLINE: u32 = 0x200;
const FIEMAP_EXTENT_DATA_TAIL: u32 = 0x400;
const FIEMAP_EXTENT_UNWRITTEN: u32 = 0x800;
/// Flags under which an extent's physical address does not identify its blocks.
const UNSURE: u32 = FIEMAP_EXTENT_UNKNOWN
    | FIEMAP_EXTENT_DELALLOC
    | FIEMAP_EXTENT_ENCODED
    | FIEMAP_EXTENT_NOT_ALIGNED
    | FIEMAP_EXTENT_DATA_INLINE
    | FIEMAP_EXTENT_DATA_TAIL;
/// Extents asked for per `FIEMAP` call (28 KiB of buffer).
const BATCH: usize = 512;

/// `struct fiemap` without its trailing array (linux/fiemap.h).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct FiemapHeader {
    fm_start: u64,
    fm_length: u64,
    fm_flags: u32,
    fm_mapped_extents: u32,
    fm_extent_count: u32,
    fm_reserved: u32,
}

/// `struct fiemap_extent` (linux/fiemap.h).
#[repr(C)]
#[derive(Clone, Copy)]
struct FiemapExtent {
    fe_logical: u64,
    fe_physical: u64,
    fe_length: u64,
    fe_reserved64: [u64; 2],
    fe_flags: u32,
    fe_reserved: [u32; 3],
}

/// A `struct fiemap` with room for [`BATCH`] extents, laid out as the kernel expects:
/// the extent array directly follows the 32-byte header.
#[repr(C)]
struct FiemapBuf {
    header: FiemapHeader,
    extents: [FiemapExtent; BATCH],
}

const _: () = {
    assert!(size_of::<FiemapHeader>() == 32);
    assert!(size_of::<FiemapExtent>() == 56);
    assert!(std::mem::offset_of!(FiemapBuf, extents) == 32);
};

/// Calls `FS_IOC_FIEMAP` on `file` with `buf`, whose header the caller has filled in.
#[allow(unsafe_code)] // libc and rustix wrap no FIEMAP; see SAFETY.
fn fiemap(file: &File, buf: &mut FiemapBuf) -> io::Result<()> {
    debug_assert!(buf.header.fm_extent_count as usize <= BATCH);
    // SAFETY: `buf` is an exclusive borrow of a repr(C) `struct fiemap` (header layout
    // checked above) followed by room for `fm_extent_count` (at most BATCH)
    // `struct fiemap_extent`s, suitably aligned since it is a Rust value of that type.
    // The kernel reads the header and writes at most `fm_extent_count` extents plus the
    // header's counters into it, all plain integers for which any bit pattern is valid,
    // and keeps no reference past the call. The fd is valid for the borrow of `file`.
    let rc = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            FS_IOC_FIEMAP as _,
            std::ptr::from_mut::<FiemapBuf>(buf),
        )
    };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// A file's extents in `0..len`, sorted, fetched [`BATCH`] at a time (bounded memory),
/// each cut to the file's length and to not overlap the previous one.
struct ExtentMap<'a> {
    file: &'a File,
    len: u64,
    buf: Box<FiemapBuf>,
    /// Index of the next unread extent in `buf`, and how many it holds.
    next: usize,
    count: usize,
    /// Where the next batch starts.
    fetch_from: u64,
    /// No batch follows the one in `buf`.
    last_batch: bool,
    /// End of the extent handed out last.
    pos: u64,
}

impl<'a> ExtentMap<'a> {
    /// Opens the map and fetches its first batch, so an unsupported file system shows here.
    fn new(file: &'a File, len: u64) -> io::Result<Self> {
        const EMPTY: FiemapExtent = FiemapExtent {
            fe_logical: 0,
            fe_physical: 0,
            fe_length: 0,
            fe_reserved64: [0; 2],
            fe_flags: 0,
            fe_reserved: [0; 3],
        };
        let mut map = ExtentMap {
            file,
            len,
            buf: Box::new(FiemapBuf {
                header: FiemapHeader::default(),
                extents: [EMPTY; BATCH],
            }),
            next: 0,
            count: 0,
            fetch_from: 0,
            last_batch: len == 0,
            pos: 0,
        };
        if !map.last_batch {
            map.fetch()?;
        }
        Ok(map)
    }

    fn fetch(&mut self) -> io::Result<()> {
        let start = self.fetch_from;
        self.buf.header = FiemapHeader {
            fm_start: start,
            fm_length: self.len - start,
            fm_flags: FIEMAP_FLAG_SYNC,
            fm_extent_count: BATCH as u32,
            ..FiemapHeader::default()
        };
        fiemap(self.file, &mut self.buf)?;
        self.count = (self.buf.header.fm_mapped_extents as usize).min(BATCH);
        self.next = 0;
        let Some(last) = self.count.checked_sub(1).map(|i| self.buf.extents[i]) else {
            self.last_batch = true;
            return Ok(());
        };
        let last_end = last.fe_logical.saturating_add(last.fe_length);
        self.fetch_from = last_end;
        self.last_batch =
            last.fe_flags & FIEMAP_EXTENT_LAST != 0 || self.count < BATCH || last_end >= self.len;
        if last_end <= start {
            // A file system that makes no progress: count the rest as changed rather than
            // loop forever.
            self.buf.extents[0] = FiemapExtent {
                fe_logical: start,
                fe_length: self.len - start,
                fe_flags: FIEMAP_EXTENT_UNKNOWN,
                ..last
            };
            self.count = 1;
            self.last_batch = true;
        }
        Ok(())
    }
}

impl Iterator for ExtentMap<'_> {
    type Item = io::Result<Extent>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.next == self.count {
                if self.last_batch {
                    return None;
                }
                if let Err(e) = self.fetch() {
                    self.last_batch = true;
                    self.count = 0;
                    return Some(Err(e));
                }
                continue;
            }
            let raw = self.buf.extents[self.next];
            self.next += 1;
            let start = raw.fe_logical.max(self.pos);
            let end = raw.fe_logical.saturating_add(raw.fe_length).min(self.len);
            if start >= end {
                continue;
            }
            self.pos = end;
            return Some(Ok(Extent {
                logical: start,
                physical: raw.fe_physical.saturating_add(start - raw.fe_logical),
                len: end - start,
                flags: raw.fe_flags,
            }));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};
    use std::path::PathBuf;
    use std::{
        os::unix::fs::{FileExt, MetadataExt},
        process::Command,
    };

    const BLOCK: u64 = 4096;

    /// A file system on a loop device over a sparse image in a temporary directory,
    /// mounted on another; unmounted and detached on drop, even after a panic.
    struct Scratch {
        mount: PathBuf,
        device: Option<PathBuf>,
        mounted: bool,
        _dir: tempfile::TempDir,
    }

    impl Scratch {
        /// `None` (the test is skipped) when not root or `mkfs_tool` is missing.
        fn new(mkfs_tool: &str, mkfs_args: &[&str]) -> Option<Scratch> {
            // Under CI=true a missing prerequisite fails: .ci/run provides them all.
            let skip = |why: String| {
                if std::env::var("CI").is_ok_and(|v| v == "true") {
                    panic!("{why}; CI=true, so this fails rather than skip");
                }
                eprintln!("SKIPPED: {why}");
            };
            if !rustix::process::geteuid().is_root() {
                skip("needs root for loop devices and mounts".into());
                return None;
            }
            if Command::new(mkfs_tool).arg("-V").output().is_err() {
                skip(format!("{mkfs_tool} is not installed"));
                return None;
            }
            let dir = tempfile::tempdir().unwrap();
            let image = dir.path().join("fs.img");
            // 320 MiB: mkfs.xfs refuses file systems under 300 MB. Sparse, so it costs
            // only what is written.
            File::create(&image).unwrap().set_len(320 << 20).unwrap();
            run(Command::new(mkfs_tool).args(mkfs_args).arg(&image));
            let mut scratch = Scratch {
                mount: dir.path().join("mnt"),
                device: None,
                mounted: false,
                _dir: dir,
            };
            std::fs::create_dir(&scratch.mount).unwrap();
            let out = run(Command::new("losetup")
                .args(["--find", "--show"])
                .arg(&image));
            scratch.device = Some(PathBuf::from(out.trim()));
            run(Command::new("mount")
                .arg(scratch.device.as_ref().unwrap())
                .arg(&scratch.mount));
            scratch.mounted = true;
            Some(scratch)
        }

        fn xfs() -> Option<Scratch> {
            Scratch::new("mkfs.xfs", &["-q", "-m", "reflink=1"])
        }

        fn path(&self, name: &str) -> PathBuf {
            self.mount.join(name)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            if self.mounted {
                let _ = Command::new("umount").arg(&self.mount).status();
            }
            if let Some(device) = &self.device {
                let _ = Command::new("losetup").arg("-d").arg(device).status();
            }
        }
    }

    /// Runs a command, panicking with its stderr if it fails; returns its stdout.
    fn run(cmd: &mut Command) -> String {
        let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        assert!(
            out.status.success(),
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// A live image of `len` bytes: seeded random data in `data`, holes elsewhere.
    fn live_image(path: &Path, len: u64, data: Range<u64>, seed: u64) -> File {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .unwrap();
        file.set_len(len).unwrap();
        let mut bytes = vec![0u8; (data.end - data.start) as usize];
        StdRng::seed_from_u64(seed).fill(&mut bytes[..]);
        file.write_all_at(&bytes, data.start).unwrap();
        file.sync_all().unwrap();
        file
    }

    /// Clones `live` to `name` next to it and opens the clone.
    fn snapshot(scratch: &Scratch, live: &str, name: &str) -> File {
        clone_file(&scratch.path(live), &scratch.path(name)).unwrap();
        File::open(scratch.path(name)).unwrap()
    }

    fn punch(file: &File, range: &Range<u64>) {
        rustix::fs::fallocate(
            file,
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            range.start,
            range.end - range.start,
        )
        .unwrap();
    }

    fn total(ranges: &[Range<u64>]) -> u64 {
        ranges.iter().map(|r| r.end - r.start).sum()
    }

    fn covers(ranges: &[Range<u64>], bytes: &Range<u64>) -> bool {
        let mut pos = bytes.start;
        for r in ranges {
            if r.start <= pos && pos < r.end {
                pos = r.end;
            }
        }
        pos >= bytes.end
    }

    fn assert_sorted_merged(ranges: &[Range<u64>]) {
        for r in ranges {
            assert!(r.start < r.end, "empty range in {ranges:?}");
        }
        for w in ranges.windows(2) {
            assert!(w[0].end < w[1].start, "not sorted and merged: {ranges:?}");
        }
    }

    /// Everything outside `ranges` reads the same in both files.
    fn assert_same_outside(a: &File, b: &File, ranges: &[Range<u64>]) {
        let len = a.metadata().unwrap().len().max(b.metadata().unwrap().len());
        let read = |f: &File| {
            let mut bytes = vec![0u8; len as usize];
            let mut done = 0;
            while done < bytes.len() {
                match f.read_at(&mut bytes[done..], done as u64).unwrap() {
                    0 => break, // past the end reads as zeros
                    n => done += n,
                }
            }
            bytes
        };
        let (a, b) = (read(a), read(b));
        let mut pos = 0;
        for r in ranges.iter().chain([&(len..len)]) {
            assert!(
                a[pos..r.start as usize] == b[pos..r.start as usize],
                "unchanged range {pos}..{} differs",
                r.start
            );
            pos = r.end as usize;
        }
    }

    #[test]
    fn scattered_writes_between_clones_are_found_to_the_block() {
        let Some(fs) = Scratch::xfs() else { return };
        // 24 MiB of data, then a 8 MiB hole.
        let live = live_image(&fs.path("live"), 32 << 20, 0..24 << 20, 1);
        let one = snapshot(&fs, "live", "one");
        let mut rng = StdRng::seed_from_u64(2);
        let mut written = Vec::new();
        for i in 0..40u64 {
            let len = match i % 4 {
                0 => 64 << 10,
                1 => 4096,
                2 => rng.random_range(1..9000), // unaligned, may cross a block
                _ => rng.random_range(4096..70_000),
            };
            let at = rng.random_range(0..(32 << 20) - len);
            let at = if i % 4 < 2 { at / BLOCK * BLOCK } else { at };
            let mut bytes = vec![0u8; len as usize];
            rng.fill(&mut bytes[..]);
            live.write_all_at(&bytes, at).unwrap();
            written.push(at..at + len);
        }
        live.sync_all().unwrap();
        let two = snapshot(&fs, "live", "two");
        let three = snapshot(&fs, "live", "three");

        let changed = changed_ranges(&one, &two).unwrap().expect("XFS has FIEMAP");
        assert_sorted_merged(&changed);
        for w in &written {
            assert!(covers(&changed, w), "write {w:?} not in {changed:?}");
        }
        let mut blocks: Vec<u64> = written
            .iter()
            .flat_map(|w| w.start / BLOCK..w.end.div_ceil(BLOCK))
            .collect();
        blocks.sort_unstable();
        blocks.dedup();
        let bound = blocks.len() as u64 * BLOCK;
        assert!(
            total(&changed) <= bound,
            "{} bytes changed, written blocks {bound}: {changed:?}",
            total(&changed)
        );
        assert_same_outside(&one, &two, &changed);

        assert_eq!(changed_ranges(&two, &three).unwrap(), Some(vec![]));
        assert_eq!(changed_ranges(&one, &one).unwrap(), Some(vec![]));
        // The other way round, the same ranges differ.
        assert_eq!(changed_ranges(&two, &one).unwrap(), Some(changed));
    }

    #[test]
    fn growing_and_shrinking_report_the_tail() {
        let Some(fs) = Scratch::xfs() else { return };
        let live = live_image(&fs.path("live"), 1 << 20, 0..1 << 20, 3);
        let one = snapshot(&fs, "live", "one");
        let tail = vec![0x5a; 300_000];
        live.write_all_at(&tail, 1 << 20).unwrap();
        live.sync_all().unwrap();
        let two = snapshot(&fs, "live", "two");
        let grown = (1 << 20)..(1 << 20) + 300_000;
        assert_eq!(
            changed_ranges(&one, &two).unwrap(),
            Some(vec![grown.clone()])
        );

        // Growing by a hole adds nothing but zeros, yet XFS zeroes the rest of the old
        // last block on the way (a write, so a fresh block): that one block is reported.
        live.set_len(8 << 20).unwrap();
        live.sync_all().unwrap();
        let three = snapshot(&fs, "live", "three");
        let changed = changed_ranges(&two, &three).unwrap().unwrap();
        let eof_block = grown.end / BLOCK * BLOCK..grown.end.next_multiple_of(BLOCK);
        assert!(changed.is_empty() || changed == [eof_block], "{changed:?}");
        assert_same_outside(&two, &three, &changed);

        // Shrinking reports the data cut off, up to the end of the old data (a whole
        // block: the one XFS zeroed above), from the new end or the start of its block
        // (XFS zeroes the rest of the new last block too).
        live.set_len(600_000).unwrap();
        live.sync_all().unwrap();
        let four = snapshot(&fs, "live", "four");
        let changed = changed_ranges(&three, &four).unwrap().unwrap();
        assert_eq!(changed.len(), 1, "{changed:?}");
        assert!((600_000 / BLOCK * BLOCK..=600_000).contains(&changed[0].start));
        assert_eq!(changed[0].end, grown.end.next_multiple_of(BLOCK));
        assert_same_outside(&three, &four, &changed);
    }

    #[test]
    fn recloning_the_changed_ranges_brings_an_old_clone_up_to_date() {
        let Some(fs) = Scratch::xfs() else { return };
        let live = live_image(&fs.path("live"), 8 << 20, 0..6 << 20, 5);
        let old = snapshot(&fs, "live", "old");
        let mut rng = StdRng::seed_from_u64(6);
        for _ in 0..30 {
            let at = rng.random_range(0..(8 << 20) - 9000);
            let mut bytes = vec![0u8; rng.random_range(1..9000)];
            rng.fill(&mut bytes[..]);
            live.write_all_at(&bytes, at).unwrap();
        }
        // A hole where the old clone has data: recloning must punch it there too.
        let punched = (1 << 20)..(1 << 20) + (128 << 10);
        punch(&live, &punched);
        live.sync_all().unwrap();
        let changed = changed_ranges(&old, &live).unwrap().unwrap();
        assert!(covers(&changed, &punched), "{changed:?}");
        let writable = OpenOptions::new().write(true).open(fs.path("old")).unwrap();
        reclone_ranges(&live, &writable, &changed).unwrap();
        assert_eq!(changed_ranges(&old, &live).unwrap(), Some(vec![]));
        assert_same_outside(&old, &live, &[]);
    }

    #[test]
    fn merged_ranges_are_sorted_and_overlapping_or_touching_ones_joined() {
        assert_eq!(
            merge_ranges(vec![20..30, 5..12, 0..10, 40..41, 30..31]),
            [0..12, 20..31, 40..41]
        );
    }

    #[test]
    fn punched_hole_is_changed() {
        let Some(fs) = Scratch::xfs() else { return };
        let live = live_image(&fs.path("live"), 4 << 20, 0..4 << 20, 4);
        let one = snapshot(&fs, "live", "one");
        let punched = (1 << 20)..(1 << 20) + (256 << 10);
        punch(&live, &punched);
        live.sync_all().unwrap();
        let two = snapshot(&fs, "live", "two");
        assert_eq!(changed_ranges(&one, &two).unwrap(), Some(vec![punched]));
    }

    #[test]
    fn no_reflinks_on_ext4_tmpfs_or_across_file_systems() {
        let Some(ext4) = Scratch::new("mkfs.ext4", &["-q", "-F"]) else {
            return;
        };
        let src = ext4.path("src");
        live_image(&src, 1 << 20, 0..1 << 20, 5);
        let err = clone_file(&src, &ext4.path("dst")).unwrap_err();
        assert!(is_no_reflink(&err), "{err:?}");
        assert!(!ext4.path("dst").exists());
        // FIEMAP works on ext4, but copies share nothing: all of it differs.
        std::fs::copy(&src, ext4.path("copy")).unwrap();
        let (a, b) = (
            File::open(&src).unwrap(),
            File::open(ext4.path("copy")).unwrap(),
        );
        let everything = 0..1 << 20;
        assert_eq!(changed_ranges(&a, &b).unwrap(), Some(vec![everything]));

        // Across file systems: EXDEV.
        if let Some(xfs) = Scratch::xfs() {
            let err = clone_file(&src, &xfs.path("dst")).unwrap_err();
            assert!(is_no_reflink(&err), "{err:?}");
            assert_eq!(err.raw_os_error(), Some(libc::EXDEV));
            assert!(!xfs.path("dst").exists());
        }

        // tmpfs has neither reflinks nor FIEMAP.
        let dir = tempfile::tempdir().unwrap();
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs"])
            .arg(dir.path()));
        let result = std::panic::catch_unwind(|| {
            let src = dir.path().join("src");
            let file = live_image(&src, 1 << 20, 0..4096, 6);
            let err = clone_file(&src, &dir.path().join("dst")).unwrap_err();
            assert!(is_no_reflink(&err), "{err:?}");
            assert!(!dir.path().join("dst").exists());
            assert_eq!(changed_ranges(&file, &file).unwrap(), None);
        });
        let _ = Command::new("umount").arg(dir.path()).status();
        if let Err(panic) = result {
            std::panic::resume_unwind(panic);
        }
    }

    fn ext(logical: u64, physical: u64, len: u64) -> io::Result<Extent> {
        Ok(Extent {
            logical,
            physical,
            len,
            flags: 0,
        })
    }

    #[test]
    fn extents_split_differently_compare_piecewise() {
        // old: one extent 0..100 at 1000. new: the same blocks in three pieces, except
        // 40..60 moved, and a new extent 150..170 over old's hole; old's 200..230
        // punched in new.
        let old = vec![ext(0, 1000, 100), ext(200, 5000, 30)];
        let new = vec![
            ext(0, 1000, 40),
            ext(40, 9000, 20),
            ext(60, 1060, 40),
            ext(150, 7000, 20),
        ];
        let changed = diff_maps(old.into_iter(), new.into_iter(), 300).unwrap();
        assert_eq!(changed, vec![40..60, 150..170, 200..230]);

        // Same blocks, different splits on each side: nothing changed.
        let old = vec![ext(0, 1000, 30), ext(30, 1030, 70)];
        let new = vec![ext(0, 1000, 60), ext(60, 1060, 40)];
        assert!(
            diff_maps(old.into_iter(), new.into_iter(), 100)
                .unwrap()
                .is_empty()
        );

        // Unsure and unwritten-state mismatches count as changed; adjacent ranges merge.
        let unknown = Extent {
            flags: FIEMAP_EXTENT_DELALLOC,
            ..ext(0, 1000, 10).unwrap()
        };
        let unwritten = Extent {
            flags: FIEMAP_EXTENT_UNWRITTEN,
            ..ext(10, 1010, 10).unwrap()
        };
        let old = vec![ext(0, 1000, 20)];
        let new = vec![Ok(unknown), Ok(unwritten)];
        let changed = diff_maps(old.into_iter(), new.into_iter(), 20).unwrap();
        assert_eq!(changed, vec![0..20]);
    }

    #[test]
    fn clone_refuses_an_existing_destination_and_keeps_it() {
        let Some(fs) = Scratch::xfs() else { return };
        live_image(&fs.path("live"), 1 << 20, 0..1 << 20, 7);
        std::fs::write(fs.path("taken"), b"mine").unwrap();
        let err = clone_file(&fs.path("live"), &fs.path("taken")).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert!(!is_no_reflink(&err));
        assert_eq!(std::fs::read(fs.path("taken")).unwrap(), b"mine");
        let clone = snapshot(&fs, "live", "clone");
        let live = File::open(fs.path("live")).unwrap();
        let (a, b) = (clone.metadata().unwrap(), live.metadata().unwrap());
        assert_ne!((a.dev(), a.ino()), (b.dev(), b.ino()));
        assert_eq!(clone.metadata().unwrap().mode() & 0o777, 0o600);
        assert_eq!(
            std::fs::read(fs.path("clone")).unwrap(),
            std::fs::read(fs.path("live")).unwrap()
        );
    }
}
