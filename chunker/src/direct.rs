//! Bulk reads and writes that bypass the page cache.
//!
//! A copy, snapshot or restore touches each byte once, so caching it only costs: the
//! kernel copies every byte through freshly allocated cache pages. Measured on the
//! bench VM, writing 3.3 GB with `dd` took 4.9 s of system time buffered and 0.4 s with
//! `oflag=direct`, and cold buffered reads cost the mover a sixth of its CPU. In a pod
//! those pages are also charged to the mover's memory cgroup and push the workload's own
//! cache out. So large aligned transfers go through a second descriptor of the same file
//! opened with `O_DIRECT`, via a few shared aligned buffers; small transfers (page
//! deltas) and unaligned tails stay buffered, where the kernel batches them. Where a file
//! system refuses `O_DIRECT`, everything is buffered. Durability is unchanged: writers
//! still `fsync` before they report success (`O_DIRECT` does not flush device caches),
//! and the kernel writes back any dirty cached pages of a range before a direct read.

use crate::AlignedBuf;
use std::{
    fs::{File, OpenOptions},
    io,
    os::{
        fd::AsRawFd,
        unix::fs::{FileExt, OpenOptionsExt},
    },
    sync::{
        Condvar, Mutex,
        atomic::{AtomicBool, Ordering::Relaxed},
    },
};

/// Offset, length and memory alignment that `O_DIRECT` accepts on Linux file systems and
/// block devices (logical blocks are 512 B or 4 KiB).
pub const ALIGN: usize = 4096;
/// Transfers below this go through the page cache: a direct transfer waits for the
/// device, which only pays when it is large.
const DIRECT_MIN: usize = 128 << 10;
/// The largest piece moved through the aligned buffer at once: a whole read window, so
/// the device sees deep requests.
const PIECE: usize = 8 << 20;
/// The most [`DirectWriter::write_filled`] writes at once.
pub const FILL_MAX: usize = PIECE;
/// Reads into an aligned buffer are split into pieces of this size, up to
/// [`READ_DEPTH`] of them in flight: one request at a time leaves the device idle
/// between requests (measured on the bench VM: 4 GiB in 4.4 s at depth 1, 3.3 s at 4).
const READ_PIECE: usize = 2 << 20;
/// Direct reads in flight at once for one aligned read.
const READ_DEPTH: usize = 4;

/// Bounce buffers at most, process-wide (each of up to [`PIECE`] bytes): a thread
/// needing one while all are in use waits. They were kept per thread before, and a
/// block restore's dozen blocking threads then held 8 MiB each (measured: about 80 of
/// its 230 MB resident). A restore fills them as it decrypts, so they must be enough
/// for the device to see writes while other buffers are being filled.
const BOUNCES: usize = 4;
/// The bounce buffers not in use, and how many exist.
static BOUNCE: Mutex<(Vec<AlignedBuf>, usize)> = Mutex::new((Vec::new(), 0));
/// Signalled when a bounce buffer is given back.
static BOUNCE_FREED: Condvar = Condvar::new();

/// An `O_DIRECT` twin of an open file, or nothing where the file system has no direct I/O.
#[derive(Debug)]
pub struct DirectFile {
    file: Option<File>,
    /// Cleared for good when the file system refuses a direct transfer.
    usable: AtomicBool,
}

impl DirectFile {
    /// Reopens `file` (the same inode, through `/proc/self/fd`) with `O_DIRECT`, for
    /// reading, or for writing too when `write` is set. A file opened not to update its
    /// access time (`O_NOATIME`) is reopened so too.
    pub fn reopen(file: &File, write: bool) -> DirectFile {
        if !enabled() {
            return DirectFile::none();
        }
        let noatime = rustix::fs::fcntl_getfl(file)
            .is_ok_and(|flags| flags.contains(rustix::fs::OFlags::NOATIME));
        let file = OpenOptions::new()
            .read(true)
            .write(write)
            .custom_flags(libc::O_DIRECT | if noatime { libc::O_NOATIME } else { 0 })
            .open(format!("/proc/self/fd/{}", file.as_raw_fd()))
            .ok();
        DirectFile {
            usable: AtomicBool::new(file.is_some()),
            file,
        }
    }

    /// No direct I/O: every transfer is left to the caller's buffered path.
    pub fn none() -> DirectFile {
        DirectFile {
            file: None,
            usable: AtomicBool::new(false),
        }
    }

    /// The file, when a transfer of `len` bytes at `offset` should go direct.
    fn eligible(&self, offset: u64, len: usize) -> Option<&File> {
        let file = self.file.as_ref()?;
        let fits = offset.is_multiple_of(ALIGN as u64) && len >= DIRECT_MIN;
        (fits && self.usable.load(Relaxed)).then_some(file)
    }

    /// Reads the aligned head of `buf` at `offset` directly; returns how many bytes it
    /// read (0 when the transfer is not eligible, fewer at the end of the file). The
    /// caller reads the rest its usual way.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let body = buf.len() / ALIGN * ALIGN;
        let Some(file) = self.eligible(offset, body) else {
            return Ok(0);
        };
        if buf.as_ptr().align_offset(ALIGN) == 0 {
            return self.read_in_place(file, &mut buf[..body], offset);
        }
        let mut done = 0;
        while done < body {
            let want = (body - done).min(PIECE);
            let got = with_bounce(want, |bounce| {
                let n = file.read_at(bounce, offset + done as u64)?;
                buf[done..done + n].copy_from_slice(&bounce[..n]);
                Ok(n)
            });
            match got {
                Ok(0) => break,
                Ok(n) => {
                    done += n;
                    if n < want {
                        break; // the end of the file: the caller sees the short read
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return self.refused(e).map(|()| done),
            }
        }
        Ok(done)
    }

    /// Reads into the aligned `buf` itself, several pieces at once; returns how many
    /// bytes from the start were read (fewer at the end of the file).
    fn read_in_place(&self, file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let read_piece = |piece: &mut [u8], at: u64| read_full(file, piece, at);
        let results: Vec<io::Result<usize>> = if buf.len() <= READ_PIECE {
            vec![read_piece(buf, offset)]
        } else {
            let pieces: Vec<(usize, &mut [u8])> = buf.chunks_mut(READ_PIECE).enumerate().collect();
            crate::pipeline::in_lanes(pieces, READ_DEPTH, |(i, piece)| {
                read_piece(piece, offset + (i * READ_PIECE) as u64)
            })
        };
        // The bytes read from the start: up to the first short or failed piece.
        let mut done = 0;
        for (i, result) in results.into_iter().enumerate() {
            let want = (buf.len() - i * READ_PIECE).min(READ_PIECE);
            match result {
                Ok(n) => {
                    done += n;
                    if n < want {
                        break;
                    }
                }
                Err(e) => return self.refused(e).map(|()| done),
            }
        }
        Ok(done)
    }

    /// Writes the aligned head of the concatenation of `parts` at `offset` directly,
    /// without concatenating them first (adjacent chunks go to the device as one large
    /// request); returns how many bytes it wrote (0 when the transfer is not eligible).
    /// The caller writes the rest.
    pub fn write_parts_at(&self, parts: &[&[u8]], offset: u64) -> io::Result<usize> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let body = total / ALIGN * ALIGN;
        let Some(file) = self.eligible(offset, body) else {
            return Ok(0);
        };
        // One part already aligned in memory (a copy's read window) goes to the device
        // as it is: a bounce copy would cost a memcpy of every byte written.
        if let [only] = parts
            && only.as_ptr().align_offset(ALIGN) == 0
        {
            return match file.write_all_at(&only[..body], offset) {
                Ok(()) => Ok(body),
                Err(e) => self.refused(e).map(|()| 0),
            };
        }
        let (mut part, mut at) = (0, 0);
        let mut done = 0;
        while done < body {
            let len = (body - done).min(PIECE);
            let wrote = with_bounce(len, |bounce| {
                let mut filled = 0;
                while filled < len {
                    let src = &parts[part][at..];
                    let n = src.len().min(len - filled);
                    bounce[filled..filled + n].copy_from_slice(&src[..n]);
                    (filled, at) = (filled + n, at + n);
                    if at == parts[part].len() {
                        (part, at) = (part + 1, 0);
                    }
                }
                file.write_all_at(bounce, offset + done as u64)
            });
            match wrote {
                Ok(()) => done += len,
                Err(e) => return self.refused(e).map(|()| done),
            }
        }
        Ok(done)
    }

    /// `EINVAL` means the file system takes `O_DIRECT` opens but not these transfers:
    /// stop trying, and let the caller finish buffered. Anything else is a real error.
    fn refused(&self, e: io::Error) -> io::Result<()> {
        match e.raw_os_error() {
            Some(libc::EINVAL) => {
                self.usable.store(false, Relaxed);
                Ok(())
            }
            _ => Err(e),
        }
    }
}

/// Ranges shorter than this are left to the caller's kernel copy: the pipelined copy
/// below starts a thread and waits for the device, which pays only for large files.
const COPY_MIN: u64 = 4 << 20;
/// The piece a pipelined copy reads while it writes the one before; two are in use per
/// copy.
const COPY_PIECE: usize = 4 << 20;
/// Pipelined copies at once, process-wide: each holds two pieces, so memory stays
/// bounded however many large files a tree walk copies in parallel.
const COPY_LANES: usize = 4;
/// Pipelined copies under way.
static COPIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Copies the range of `len` bytes at `offset` (the same offset in both files) from
/// `src` to `dst` with `O_DIRECT` on both sides, reading the next piece while the last
/// is written, so neither side goes through the page cache (on the bench VM a buffered
/// copy of a large file costs its bytes twice in kernel copies and zeroing, and its
/// writeback later). Returns how many bytes from `offset` it copied: 0 when the range is
/// short or unaligned, direct I/O is off or refused, or four such copies are under
/// way already; fewer than `len` for an unaligned tail or a source that ended early. The
/// caller copies the rest its usual way.
pub fn copy_range(src: &File, dst: &File, offset: u64, len: u64) -> io::Result<u64> {
    let body = len / ALIGN as u64 * ALIGN as u64;
    if !offset.is_multiple_of(ALIGN as u64) || body < COPY_MIN {
        return Ok(0);
    }
    let Some(_lane) = Lane::take() else {
        return Ok(0);
    };
    pipelined_copy(src, dst, offset, body)
}

/// One of the [`COPY_LANES`], held while a pipelined copy runs (given back however the
/// copy ends, a panic included).
struct Lane;

impl Lane {
    fn take() -> Option<Lane> {
        if COPIES.fetch_add(1, Relaxed) >= COPY_LANES {
            COPIES.fetch_sub(1, Relaxed);
            return None;
        }
        Some(Lane)
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        COPIES.fetch_sub(1, Relaxed);
    }
}

fn pipelined_copy(src: &File, dst: &File, offset: u64, body: u64) -> io::Result<u64> {
    let (from, to) = (
        DirectFile::reopen(src, false),
        DirectFile::reopen(dst, true),
    );
    let (Some(from), Some(to)) = (from.file.as_ref(), to.file.as_ref()) else {
        return Ok(0);
    };
    // Buffers go round: the reader fills an empty one, the writer empties a full one.
    let (full_tx, full_rx) = std::sync::mpsc::sync_channel::<(u64, AlignedBuf, usize)>(1);
    let (empty_tx, empty_rx) = std::sync::mpsc::sync_channel::<AlignedBuf>(2);
    for _ in 0..2 {
        _ = empty_tx.send(AlignedBuf::new());
    }
    std::thread::scope(|scope| {
        let reader = scope.spawn(move || -> io::Result<()> {
            let mut at = 0;
            while at < body {
                // The writer stopped (it failed, or the source ended): so does the reader.
                let Ok(mut buf) = empty_rx.recv() else {
                    return Ok(());
                };
                let want = (body - at).min(COPY_PIECE as u64) as usize;
                buf.resize(want);
                let got = read_full(from, &mut buf, offset + at)?;
                if full_tx.send((at, buf, got)).is_err() || got < want {
                    return Ok(());
                }
                at += got as u64;
            }
            Ok(())
        });
        let mut done = 0;
        let mut written = Ok(());
        for (at, buf, got) in full_rx {
            // A short read ends the copy; its aligned part is still written.
            let aligned = got / ALIGN * ALIGN;
            if let Err(e) = to.write_all_at(&buf[..aligned], offset + at) {
                written = Err(e);
                break;
            }
            done += aligned as u64;
            if aligned < buf.len() {
                break;
            }
            _ = empty_tx.send(buf);
        }
        // Wakes a reader waiting for a buffer.
        drop(empty_tx);
        let read = reader.join().expect("the direct copy's reader panicked");
        match read.and(written) {
            Ok(()) => Ok(done),
            // Direct transfers refused: the caller copies the rest buffered.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Ok(done),
            Err(e) => Err(e),
        }
    })
}

/// Reads `buf.len()` bytes at `offset`, or fewer at the end of the file.
pub fn read_full(file: &File, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], offset + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Set once `cachestat` is found missing (kernels before 6.5).
static CACHESTAT_MISSING: AtomicBool = AtomicBool::new(false);

/// Whether every page of `len` bytes at `offset` of `file` is in the page cache (Linux
/// 6.5's `cachestat`, which neither reads nor starts readahead; `false` where the
/// kernel lacks it). Such a range is read from the cache: a direct read would fetch
/// from the device what memory holds already (measured: a cached 4 GiB volume copied
/// at the disk's speed, not the cache's).
#[allow(unsafe_code)]
pub fn all_cached(file: &File, offset: u64, len: usize) -> bool {
    /// `cachestat` has one number on every architecture.
    const SYS_CACHESTAT: libc::c_long = 451;
    #[repr(C)]
    struct Range {
        off: u64,
        len: u64,
    }
    #[repr(C)]
    #[derive(Default)]
    struct Stat {
        nr_cache: u64,
        nr_dirty: u64,
        nr_writeback: u64,
        nr_evicted: u64,
        nr_recently_evicted: u64,
    }
    if len == 0 || CACHESTAT_MISSING.load(Relaxed) {
        return false;
    }
    let page = 4096u64;
    let (first, end) = (offset / page, (offset + len as u64).div_ceil(page));
    let range = Range {
        off: first * page,
        len: (end - first) * page,
    };
    let mut stat = Stat::default();
    // SAFETY: cachestat reads `range` and writes `stat`, both valid, properly laid out
    // (the kernel's struct cachestat_range and struct cachestat) and live for the call.
    let r = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const Range,
            &mut stat as *mut Stat,
            0u32,
        )
    };
    if r != 0 {
        if io::Error::last_os_error().raw_os_error() == Some(libc::ENOSYS) {
            CACHESTAT_MISSING.store(true, Relaxed);
        }
        return false;
    }
    stat.nr_cache >= end - first
}

/// Direct I/O is on unless `MOVER_DIRECT_IO` is `0` or `off` (an escape hatch for file
/// systems that accept `O_DIRECT` but handle it badly).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        !matches!(
            std::env::var("MOVER_DIRECT_IO").as_deref(),
            Ok("0" | "off" | "false" | "no")
        )
    })
}

/// Runs `f` on the first `len` bytes (at most [`PIECE`]) of a bounce buffer, waiting for
/// one if all [`BOUNCES`] are in use.
fn with_bounce<T>(len: usize, f: impl FnOnce(&mut [u8]) -> io::Result<T>) -> io::Result<T> {
    let mut bounce = Bounce::take(len);
    f(&mut bounce.0[..len])
}

/// A bounce buffer taken from the pool, given back when dropped (a panic included).
struct Bounce(AlignedBuf);

impl Bounce {
    /// A buffer of at least `len` bytes (grown to the largest length asked of it, so a
    /// restore of small chunks does not hold [`PIECE`]s).
    fn take(len: usize) -> Bounce {
        let mut pool = BOUNCE.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(mut buf) = pool.0.pop() {
                drop(pool);
                if buf.len() < len {
                    buf.resize(len);
                }
                return Bounce(buf);
            }
            if pool.1 < BOUNCES {
                pool.1 += 1;
                drop(pool);
                let mut buf = AlignedBuf::new();
                buf.resize(len);
                return Bounce(buf);
            }
            pool = BOUNCE_FREED.wait(pool).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.0);
        BOUNCE.lock().unwrap_or_else(|e| e.into_inner()).0.push(buf);
        BOUNCE_FREED.notify_one();
    }
}

/// Writes to one destination file, large aligned pieces with `O_DIRECT`.
#[derive(Debug)]
pub struct DirectWriter {
    buffered: File,
    direct: DirectFile,
    /// Taken around [`DirectWriter::write_filled`]'s buffered writes: parallel buffered
    /// writes to one file contend for its inode lock, and the kernel spins on it
    /// (measured in restores: more system time than all the decryption).
    turn: Mutex<()>,
}

impl DirectWriter {
    /// A writer for `file` (see [`DirectFile::reopen`]).
    pub fn new(file: &File) -> io::Result<DirectWriter> {
        Ok(DirectWriter {
            buffered: file.try_clone()?,
            direct: DirectFile::reopen(file, true),
            turn: Mutex::new(()),
        })
    }

    /// Writes all of `data` at `offset`.
    pub fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        self.write_all_parts_at(&[data], offset)
    }

    /// Writes the concatenation of `parts` at `offset`.
    pub fn write_all_parts_at(&self, parts: &[&[u8]], offset: u64) -> io::Result<()> {
        let mut skip = self.direct.write_parts_at(parts, offset)?;
        let mut at = offset + skip as u64;
        for part in parts {
            let rest = &part[skip.min(part.len())..];
            skip -= skip.min(part.len());
            self.buffered.write_all_at(rest, at)?;
            at += rest.len() as u64;
        }
        Ok(())
    }

    /// Lets `fill` write `len` bytes (at most [`FILL_MAX`]) into an aligned buffer (it
    /// must write every byte: the buffer is reused), then writes them at `offset`: the
    /// aligned head directly, without a copy. So a writer
    /// that produces its data piece by piece (a restore opening chunks) holds one piece,
    /// not its data and a bounce copy of it. Callers may fill in parallel; buffered
    /// writes take turns. The outer error is the write's; the inner, `fill`'s (then
    /// nothing is written).
    pub fn write_filled<E>(
        &self,
        offset: u64,
        len: usize,
        fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
    ) -> io::Result<Result<(), E>> {
        assert!(len <= FILL_MAX, "write_filled takes at most FILL_MAX bytes");
        let mut bounce = Bounce::take(len);
        let buf = &mut bounce.0[..len];
        if let Err(e) = fill(buf) {
            return Ok(Err(e));
        }
        let body = len / ALIGN * ALIGN;
        let mut done = 0;
        if let Some(file) = self.direct.eligible(offset, body) {
            match file.write_all_at(&buf[..body], offset) {
                Ok(()) => done = body,
                Err(e) => self.direct.refused(e)?,
            }
        }
        if done < len {
            let _turn = self.turn.lock().unwrap_or_else(|e| e.into_inner());
            self.buffered
                .write_all_at(&buf[done..], offset + done as u64)?;
        }
        Ok(Ok(()))
    }

    /// The file, for everything but data writes (hole punching, syncs).
    pub fn file(&self) -> &File {
        &self.buffered
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
    }

    /// A directory on the repository's own disk (/tmp may be a tmpfs without
    /// O_DIRECT), removed when dropped.
    fn scratch_dir() -> tempfile::TempDir {
        tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap()
    }

    /// A new empty file `name` in `dir`, open for reading and writing.
    fn new_file(dir: &tempfile::TempDir, name: &str) -> File {
        File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .open(dir.path().join(name))
            .unwrap()
    }

    /// A new empty file in a [`scratch_dir`], and the directory.
    fn scratch_file() -> (tempfile::TempDir, File) {
        let dir = scratch_dir();
        let file = new_file(&dir, "img");
        (dir, file)
    }

    #[test]
    fn large_small_and_unaligned_writes_and_reads_all_land() {
        let (_dir, file) = scratch_file();
        file.set_len((32 << 20) + 1000).unwrap();
        let w = DirectWriter::new(&file).unwrap();
        // Direct with an unaligned tail, small, unaligned offset, a piece boundary.
        let writes = [
            (0u64, pattern((5 << 20) + 100, 1)),
            (6 << 20, pattern(4096, 2)),
            ((7 << 20) + 3, pattern(1 << 20, 3)),
            (9 << 20, pattern((7 << 20) + 1000, 4)),
        ];
        for (off, data) in &writes {
            w.write_all_at(data, *off).unwrap();
        }
        // Parts of odd sizes, written as one run past a piece boundary.
        let parts = [
            pattern(3 << 20, 5),
            pattern(5000, 6),
            pattern((6 << 20) - 5000, 7),
        ];
        let run: Vec<u8> = parts.concat();
        let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
        w.write_all_parts_at(&refs, 1 << 20).unwrap();
        let mut back = vec![0u8; run.len()];
        file.read_exact_at(&mut back, 1 << 20).unwrap();
        assert!(back == run, "the run of parts differs");
        // One part aligned in memory, with an unaligned tail: its body goes in place.
        let expect = pattern((3 << 20) + 777, 8);
        let mut aligned = crate::AlignedBuf::new();
        aligned.resize(expect.len());
        aligned.copy_from_slice(&expect);
        w.write_all_at(&aligned, 10 << 20).unwrap();
        let mut back = vec![0u8; expect.len()];
        file.read_exact_at(&mut back, 10 << 20).unwrap();
        assert!(back == expect, "the aligned part differs");
        let writes = writes.map(|(off, data)| (off + (16 << 20), data));
        for (off, data) in &writes {
            w.write_all_at(data, *off).unwrap();
        }
        let direct = DirectFile::reopen(&file, false);
        for (off, data) in &writes {
            let mut back = vec![0u8; data.len()];
            let n = direct.read_at(&mut back, *off).unwrap();
            file.read_exact_at(&mut back[n..], off + n as u64).unwrap();
            assert!(back == *data, "bytes at {off} differ");
        }
        // A direct read that runs into the end of the file stops there.
        let mut tail = vec![0u8; 2 << 20];
        let n = direct.read_at(&mut tail, 31 << 20).unwrap();
        assert!(n <= (1 << 20) + 1000, "{n}");
        assert_eq!(tail[..1000], writes[3].1[(6 << 20)..(6 << 20) + 1000]);
        // Into an aligned buffer: read in place, pieces in parallel, the last one short
        // at the end of the file.
        let mut whole = crate::AlignedBuf::new();
        whole.resize(33 << 20);
        let n = direct.read_at(&mut whole, 0).unwrap();
        assert_eq!(
            n,
            (32 << 20) + 1000,
            "up to the end of the file, no further"
        );
        let mut expect = vec![0u8; (32 << 20) + 1000];
        file.read_exact_at(&mut expect, 0).unwrap();
        assert!(whole[..n] == expect[..n], "the in-place read differs");
        let mut odd = crate::AlignedBuf::new();
        odd.resize((5 << 20) + 3 * ALIGN);
        let n = direct.read_at(&mut odd, 8 << 20).unwrap();
        assert_eq!(n, odd.len());
        assert!(
            odd[..] == expect[8 << 20..(8 << 20) + n],
            "an odd-sized read differs"
        );
        // The direct path was taken on this file system (else the test proves little).
        assert!(direct.usable.load(Relaxed) && w.direct.usable.load(Relaxed));
    }

    #[test]
    fn filled_writes_land_from_many_threads_and_a_failed_fill_writes_nothing() {
        let (_dir, file) = scratch_file();
        let w = DirectWriter::new(&file).unwrap();
        // Three times as many writers as bounce buffers, each filling pieces of odd
        // lengths at its own offsets (an aligned one, a short one, an unaligned one).
        let pieces: Vec<(u64, Vec<u8>)> = (0..3 * BOUNCES as u64)
            .flat_map(|t| {
                let base = t * (24 << 20);
                [
                    (base, pattern(FILL_MAX, t as u8)),
                    (base + (9 << 20), pattern((1 << 20) + 123, t as u8 ^ 1)),
                    (base + (12 << 20) + 7, pattern(300_000, t as u8 ^ 2)),
                ]
            })
            .collect();
        std::thread::scope(|scope| {
            for chunk in pieces.chunks(3) {
                let w = &w;
                scope.spawn(move || {
                    for (off, data) in chunk {
                        w.write_filled(*off, data.len(), |buf| {
                            buf.copy_from_slice(data);
                            Ok::<(), ()>(())
                        })
                        .unwrap()
                        .unwrap();
                    }
                });
            }
        });
        for (off, data) in &pieces {
            let mut back = vec![0u8; data.len()];
            file.read_exact_at(&mut back, *off).unwrap();
            assert!(back == *data, "bytes at {off} differ");
        }
        let len = file.metadata().unwrap().len();
        let failed = w.write_filled(len, 1 << 20, |buf| {
            buf.fill(9);
            Err("the chunk failed to open")
        });
        assert_eq!(failed.unwrap(), Err("the chunk failed to open"));
        assert_eq!(file.metadata().unwrap().len(), len, "nothing was written");
        assert!(w.direct.usable.load(Relaxed), "the direct path was taken");
    }

    #[test]
    fn cached_ranges_are_told_from_ranges_on_the_device() {
        let (_dir, file) = scratch_file();
        file.write_all_at(&pattern(8 << 20, 3), 0).unwrap();
        file.sync_all().unwrap();
        // Just written: every page is cached, an unaligned range's too.
        let cached = all_cached(&file, 0, 8 << 20);
        if !cached && CACHESTAT_MISSING.load(Relaxed) {
            eprintln!("this kernel has no cachestat: every range reads as not cached");
            return;
        }
        assert!(cached);
        assert!(all_cached(&file, 4097, 100_000));
        // Dropped from the cache (clean pages go at once): the device holds them.
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::DontNeed).unwrap();
        assert!(!all_cached(&file, 0, 8 << 20));
        assert!(!all_cached(&file, 1 << 20, 4096));
        // One page read back: cached again, its neighbours not (no readahead counted).
        let mut page = [0u8; 4096];
        rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::Random).unwrap();
        file.read_at(&mut page, 2 << 20).unwrap();
        assert!(all_cached(&file, 2 << 20, 4096));
        assert!(!all_cached(&file, 2 << 20, 2 << 20));
    }

    #[test]
    fn a_pipelined_copy_moves_the_aligned_body_and_leaves_the_rest() {
        let dir = scratch_dir();
        let open = |name: &str| new_file(&dir, name);
        let (src, dst) = (open("src"), open("dst"));
        // Several pieces, an odd last one, and an unaligned tail.
        let data = pattern((3 * COPY_PIECE) + (5 << 10) + 123, 9);
        src.write_all_at(&data, 0).unwrap();
        let body = (data.len() / ALIGN * ALIGN) as u64;
        assert_eq!(copy_range(&src, &dst, 0, data.len() as u64).unwrap(), body);
        let mut back = vec![0u8; body as usize];
        dst.read_exact_at(&mut back, 0).unwrap();
        assert!(back[..] == data[..body as usize], "the copied body differs");
        // From an aligned offset inside the file, to the same place.
        let dst2 = open("dst2");
        let at = COPY_PIECE as u64 - ALIGN as u64;
        let n = copy_range(&src, &dst2, at, data.len() as u64 - at).unwrap();
        assert_eq!(n, body - at);
        let mut back = vec![0u8; n as usize];
        dst2.read_exact_at(&mut back, at).unwrap();
        assert!(back[..] == data[at as usize..(at + n) as usize]);
        // A source shorter than the range asked for: its aligned part, no more.
        let dst3 = open("dst3");
        let n = copy_range(&src, &dst3, 0, data.len() as u64 + (8 << 20)).unwrap();
        assert_eq!(n, body);
        // Too short, or unaligned: left to the caller.
        let dst4 = open("dst4");
        assert_eq!(copy_range(&src, &dst4, 0, COPY_MIN - 1).unwrap(), 0);
        assert_eq!(copy_range(&src, &dst4, 100, COPY_MIN * 2).unwrap(), 0);
        assert_eq!(dst4.metadata().unwrap().len(), 0);
    }
}
