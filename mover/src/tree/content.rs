//! File contents: a whole copy that keeps holes, and a patch that reuses the chunks an
//! older copy already holds (FastCDC, so an insert in the middle shifts nothing).

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

/// Cleared the first time `copy_file_range` is refused (another filesystem, old kernel),
/// so later files go straight to read/write.
static KERNEL_COPY: AtomicBool = AtomicBool::new(true);

/// What writing one file cost.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Written {
    /// Bytes of source data written.
    pub new_bytes: u64,
    /// Bytes taken from the older copy of the file (cloned or copied in the kernel).
    pub reused_bytes: u64,
}

/// Copies all of `src` (`size` bytes) into the empty file `dst`; holes stay holes.
pub(crate) fn copy_whole(src: &File, dst: &File, size: u64, sparse: bool) -> io::Result<Written> {
    let mut written = 0;
    if sparse {
        let mut pos = 0;
        while let Some((data, hole)) = next_data(src, pos, size)? {
            copy_range(src, data, dst, data, hole - data)?;
            written += hole - data;
            pos = hole;
        }
        // A trailing hole: the length is set, not written.
        dst.set_len(size)?;
    } else {
        copy_range(src, 0, dst, 0, size)?;
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
                Err(
                    rustix::io::Errno::XDEV
                    | rustix::io::Errno::NOSYS
                    | rustix::io::Errno::OPNOTSUPP
                    | rustix::io::Errno::INVAL,
                ) if left == len => {
                    KERNEL_COPY.store(false, Ordering::Relaxed);
                    break;
                }
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
    let mut out = Written::default();
    let mut end = 0;
    for item in chunker.chunk_stream(BufReader::with_capacity(1 << 20, src)) {
        let (chunk, data) = item?;
        end = chunk.offset + chunk.len as u64;
        match have.get(&chunk.id) {
            Some(&(at, len)) if len == chunk.len => {
                copy_range(old, at, dst, chunk.offset, len as u64)?;
                out.reused_bytes += len as u64;
            }
            _ if chunker::is_zero(&data) => {}
            _ => {
                dst.write_all_at(&data, chunk.offset)?;
                out.new_bytes += chunk.len as u64;
            }
        }
    }
    if end != size {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("the file changed size while being read ({end} of {size} bytes)"),
        ));
    }
    dst.set_len(size)?;
    Ok(out)
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
