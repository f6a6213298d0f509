//! File contents: a whole copy that keeps holes, and a patch that reuses the chunks an
//! older copy already holds (FastCDC, so an insert in the middle shifts nothing).
//!
//! A patch pays across a network (only new chunks travel) and, locally, only where the
//! destination can share the old copy's extents (reflinks): elsewhere it writes as much
//! as a whole copy and reads twice as much, which is why rsync copies local files whole.

use chunker::{CdcChunker, CdcParams, ChunkId, ChunkKey};
use rustix::fs::{self, SeekFrom};
use std::{
    collections::HashMap,
    fs::File,
    io::{self, BufReader},
    os::unix::fs::FileExt,
    sync::atomic::{AtomicBool, Ordering},
};

/// Files at least this large are patched by chunk when an older copy exists; smaller
/// ones are rewritten whole (cheaper than reading the old copy to compare).
pub(crate) const PATCH_MIN: u64 = 1 << 20;

/// The unit in which filesystems share extents: a reused run is cloned from its first
/// boundary on, when the old and the new offset agree within it.
const CLONE_BLOCK: u64 = 4096;

/// Cleared when the kernel has no `copy_file_range`, so later files go straight to
/// read/write. Other refusals (two filesystems, a file it cannot copy) hold for one pair
/// of files only: the same walk also copies within one filesystem, where it clones.
static KERNEL_COPY: AtomicBool = AtomicBool::new(true);

/// What writing one file cost.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Written {
    /// Bytes of source data written.
    pub new_bytes: u64,
    /// Bytes taken from the older copy of the file (cloned or copied in the kernel).
    pub reused_bytes: u64,
}

/// Copies all of `src` (`size` bytes) into the empty file `dst`; holes stay holes. Large
/// data runs go with `direct` I/O, the rest in the kernel (see [`copy_new`]).
pub(crate) fn copy_whole(
    src: &File,
    dst: &File,
    size: u64,
    sparse: bool,
    direct: bool,
) -> io::Result<Written> {
    let mut written = 0;
    if sparse {
        let mut pos = 0;
        while let Some((data, hole)) = next_data(src, pos, size)? {
            copy_new(src, dst, data, hole - data, direct)?;
            written += hole - data;
            pos = hole;
        }
        // A trailing hole: the length is set, not written.
        dst.set_len(size)?;
    } else {
        copy_new(src, dst, 0, size, direct)?;
        written = size;
    }
    Ok(Written {
        new_bytes: written,
        reused_bytes: 0,
    })
}

/// The next run of data (not a hole) of `file` in `[pos, end)`, as `(start, stop)`;
/// `None` when only holes (or the end of the file) follow.
pub(crate) fn next_data(file: &File, pos: u64, end: u64) -> io::Result<Option<(u64, u64)>> {
    let data = match fs::seek(file, SeekFrom::Data(pos)) {
        Ok(d) if d < end => d,
        Ok(_) | Err(rustix::io::Errno::NXIO) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let hole = fs::seek(file, SeekFrom::Hole(data))?.min(end);
    Ok(Some((data, hole)))
}

/// Copies `len` bytes at `at` from `src` into the same place of the new file `dst`: with
/// `direct`, large ranges with direct I/O on both sides (which spares the page cache's
/// copies and zeroing), and the rest in the kernel.
fn copy_new(src: &File, dst: &File, at: u64, len: u64, direct: bool) -> io::Result<()> {
    let done = if direct {
        chunker::direct::copy_range(src, dst, at, len)?
    } else {
        0
    };
    copy_range(src, at + done, dst, at + done, len - done)
}

/// Copies `len` bytes from `src` at `from` to `dst` at `to`, in the kernel where it can
/// (which shares extents on filesystems with reflinks). A source that ends early (it
/// shrank while being read) is an error, so the caller can retry it.
pub(crate) fn copy_range(src: &File, from: u64, dst: &File, to: u64, len: u64) -> io::Result<()> {
    let (mut from, mut to, mut left) = (from, to, len);
    if KERNEL_COPY.load(Ordering::Relaxed) {
        while left > 0 {
            let chunk = left.min(1 << 30) as usize;
            match fs::copy_file_range(src, Some(&mut from), dst, Some(&mut to), chunk) {
                Ok(0) => return Err(shrank()),
                Ok(n) => left -= n as u64,
                Err(rustix::io::Errno::NOSYS) => {
                    KERNEL_COPY.store(false, Ordering::Relaxed);
                    break;
                }
                Err(
                    rustix::io::Errno::XDEV
                    | rustix::io::Errno::OPNOTSUPP
                    | rustix::io::Errno::INVAL,
                ) if left == len => break,
                Err(e) => return Err(e.into()),
            }
        }
        if left == 0 {
            return Ok(());
        }
    }
    let mut buf = vec![0u8; left.min(1 << 20) as usize];
    while left > 0 {
        let want = left.min(buf.len() as u64) as usize;
        let n = src.read_at(&mut buf[..want], from)?;
        if n == 0 {
            return Err(shrank());
        }
        dst.write_all_at(&buf[..n], to)?;
        (from, to, left) = (from + n as u64, to + n as u64, left - n as u64);
    }
    Ok(())
}

fn shrank() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the file shrank while being read",
    )
}

/// Writes into the empty file `dst` the content of `src`, taking every chunk that `old`
/// (the destination's previous version) already holds from `old`, and only the rest
/// from `src`. Zero chunks are left as holes.
pub(crate) fn patch(src: &File, old: &File, dst: &File, size: u64) -> io::Result<Written> {
    let chunker = tree_chunker();
    let have = chunks_held(old)?;
    let mut reuse = Reuse::new(old, dst);
    let mut new_bytes = 0;
    let mut end = 0;
    for item in chunker.chunk_stream(BufReader::with_capacity(1 << 20, src)) {
        let (chunk, data) = item?;
        end = chunk.offset + chunk.len as u64;
        match have.get(&chunk.id) {
            Some(&(at, len)) if len == chunk.len => reuse.take(at, chunk.offset, len as u64)?,
            _ if chunker::is_zero(&data) => {}
            _ => {
                dst.write_all_at(&data, chunk.offset)?;
                new_bytes += chunk.len as u64;
            }
        }
    }
    check_whole(end, size)?;
    dst.set_len(size)?;
    Ok(Written {
        new_bytes,
        reused_bytes: reuse.finish()?,
    })
}

/// A patch that read `end` bytes of a file listed with `size`: anything else means the
/// file changed size meanwhile (the caller reads it again).
pub(crate) fn check_whole(end: u64, size: u64) -> io::Result<()> {
    if end == size {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::UnexpectedEof,
        format!("the file changed size while being read ({end} of {size} bytes)"),
    ))
}

/// Ranges of an old copy placed into the new file, merged while they follow each other
/// in both. Chunk boundaries fall anywhere, so chunk by chunk a filesystem could never
/// share extents; a merged run is one kernel copy whose block-aligned middle it clones.
pub(crate) struct Reuse<'a> {
    old: &'a File,
    dst: &'a File,
    /// The run being gathered: (offset in `old`, offset in `dst`, length).
    run: Option<(u64, u64, u64)>,
    bytes: u64,
}

impl<'a> Reuse<'a> {
    pub(crate) fn new(old: &'a File, dst: &'a File) -> Self {
        Reuse {
            old,
            dst,
            run: None,
            bytes: 0,
        }
    }

    /// Places `len` bytes of `old` at `from` into `dst` at `to`.
    pub(crate) fn take(&mut self, from: u64, to: u64, len: u64) -> io::Result<()> {
        self.bytes += len;
        match &mut self.run {
            Some((f, t, l)) if *f + *l == from && *t + *l == to => *l += len,
            _ => {
                self.flush()?;
                self.run = Some((from, to, len));
            }
        }
        Ok(())
    }

    /// Copies what is gathered; returns all the bytes reused.
    pub(crate) fn finish(mut self) -> io::Result<u64> {
        self.flush()?;
        Ok(self.bytes)
    }

    fn flush(&mut self) -> io::Result<()> {
        let Some((from, to, len)) = self.run.take() else {
            return Ok(());
        };
        // Clones need both offsets on a block boundary: copy up to the first one, then
        // the rest in one call (the kernel clones whole blocks and copies the tail).
        let head = if from % CLONE_BLOCK == to % CLONE_BLOCK {
            ((CLONE_BLOCK - to % CLONE_BLOCK) % CLONE_BLOCK).min(len)
        } else {
            len
        };
        if head > 0 {
            copy_range(self.old, from, self.dst, to, head)?;
        }
        if head < len {
            copy_range(self.old, from + head, self.dst, to + head, len - head)?;
        }
        Ok(())
    }
}

/// Whether files in the directory `dir` can share extents (reflinks: XFS, Btrfs, bcachefs),
/// tried on two unnamed files that vanish when closed.
pub(crate) fn can_clone(dir: &std::path::Path) -> bool {
    let unnamed = || {
        fs::open(
            dir,
            fs::OFlags::TMPFILE | fs::OFlags::RDWR | fs::OFlags::CLOEXEC,
            fs::Mode::from_raw_mode(0o600),
        )
    };
    let (Ok(a), Ok(b)) = (unnamed(), unnamed()) else {
        return false;
    };
    let a = File::from(a);
    a.write_all_at(&[0x5a; CLONE_BLOCK as usize], 0).is_ok() && fs::ioctl_ficlone(&b, &a).is_ok()
}

/// Where `old`'s chunks are, by id (the first place each occurs).
pub(crate) fn chunks_held(old: &File) -> io::Result<HashMap<ChunkId, (u64, usize)>> {
    let mut have = HashMap::new();
    for item in tree_chunker().chunk_stream(BufReader::with_capacity(1 << 20, old)) {
        let (chunk, _) = item?;
        have.entry(chunk.id).or_insert((chunk.offset, chunk.len));
    }
    Ok(have)
}

/// Content-defined chunking of file contents (DESIGN §3: FastCDC, ~1 MiB average).
pub(crate) fn tree_chunker() -> CdcChunker {
    CdcChunker::new(ChunkKey::local(), CdcParams::default()).expect("default CDC parameters")
}

/// Whether two open files of equal length hold the same bytes (`--checksum`). `b`, the
/// destination, is dropped from the page cache first where it is clean, so it is read
/// from storage.
pub(crate) fn same_content(a: &File, b: &File) -> io::Result<bool> {
    _ = fs::fadvise(b, 0, None, fs::Advice::DontNeed);
    Ok(hash_file(a)? == hash_file(b)?)
}

/// The BLAKE3 of a file's whole content.
pub(crate) fn hash_file(f: &File) -> io::Result<blake3::Hash> {
    let mut hasher = blake3::Hasher::new();
    io::copy(&mut BufReader::with_capacity(1 << 20, f), &mut hasher)?;
    Ok(hasher.finalize())
}
