//! One-shot copy of a block volume onto another, writing only what differs.
//!
//! Three stages run side by side, a window or two apart: a reader thread reads the
//! source in windows; a second thread classifies (and, when a saved index is kept or
//! `--verify` asked, hashes) each window's chunks in parallel and reads the destination
//! chunks that must be compared: none for a new sparse image, or when the destination's
//! saved index ([`index`]) is valid (its page CVs tell which pages of a changed chunk
//! differ), else all (read beside the source). The writer plans each chunk page by page
//! (`plan`) and applies the merged writes and hole punches in order. An interrupted
//! copy is finished by rerunning it: equal pages are read, never rewritten.

mod dest;
pub mod index;
mod marker;
mod plan;

pub use dest::{Destination, Origin, prepare as prepare_destination};

use crate::error::{CopyError, Result, write_error};
use chunker::{
    BlockVolume, ChunkId, ChunkKey, ChunkKind, ChunkSize, MerkleBuilder, VolumeKind, Window,
    cv::{Cv, UnitHasher},
    direct::DirectWriter,
    hash_volume, is_zero, read_process_ahead, read_window, read_window_where,
};
use index::{Identity, IndexReader, IndexWriter};
use plan::{DstChunk, Op, SrcChunk, plan_chunk, push_merged};
use rayon::prelude::*;
use rustix::fs::FallocateFlags;
use serde::Serialize;
use std::{
    ops::Range,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    time::Instant,
};

/// Options of `mover copy` for block volumes.
#[derive(Clone, Debug, clap::Args)]
pub struct CopyOptions {
    /// Chunk size for reading, comparing and hashing: a power of two from 64K to 8M.
    /// Changed chunks are still compared and written per 4 KiB page.
    #[arg(long, value_name = "SIZE", default_value_t = ChunkSize::DEFAULT)]
    pub chunk_size: ChunkSize,
    /// After copying, drop DST from the page cache, read it back, and prove by
    /// hash that it equals SRC. The copy is only marked complete if it does.
    #[arg(long)]
    pub verify: bool,
    /// Extend an image-file DST that is smaller than SRC (block devices cannot grow).
    #[arg(long)]
    pub grow: bool,
    /// Write to a DST block device even if it is mounted or held by another user.
    /// This corrupts a mounted filesystem: only for devices you know are idle.
    #[arg(long)]
    pub force: bool,
    /// Where markers of unfinished in-place copies and the saved chunk indexes of
    /// destination images are kept
    /// [default: /var/lib/mover as root, else $XDG_STATE_HOME/mover].
    #[arg(long, value_name = "DIR", env = "MOVER_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
}

impl Default for CopyOptions {
    fn default() -> Self {
        CopyOptions {
            chunk_size: ChunkSize::DEFAULT,
            verify: false,
            grow: false,
            force: false,
            state_dir: None,
        }
    }
}

impl CopyOptions {
    /// The state directory in effect.
    pub fn state_dir(&self) -> PathBuf {
        if let Some(dir) = &self.state_dir {
            return dir.clone();
        }
        if rustix::process::geteuid().is_root() {
            return PathBuf::from("/var/lib/mover");
        }
        let base = std::env::var_os("XDG_STATE_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                let home = std::env::var_os("HOME")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| ".".into());
                home.join(".local/state")
            });
        base.join("mover")
    }
}

/// Receives progress of long operations (the binary draws a bar; tests pass `&()`).
pub trait Progress: Sync {
    /// A phase ("copy", "verify") of `total` bytes begins.
    fn begin(&self, _phase: &'static str, _total: u64) {}
    /// `done` bytes of the current phase are finished.
    fn update(&self, _done: u64) {}
}

impl Progress for () {}

impl<P: Progress + Send + ?Sized> Progress for std::sync::Arc<P> {
    fn begin(&self, phase: &'static str, total: u64) {
        (**self).begin(phase, total)
    }
    fn update(&self, done: u64) {
        (**self).update(done)
    }
}

/// A [`Progress`] shared with a job's threads (snapshot create and restore), adding up
/// bytes as they are done; the default shows nothing.
#[derive(Clone, Default)]
pub struct SharedProgress(Option<std::sync::Arc<SharedInner>>);

struct SharedInner {
    show: Box<dyn Progress + Send>,
    done: std::sync::atomic::AtomicU64,
}

impl std::fmt::Debug for SharedProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() { "shown" } else { "none" })
    }
}

/// For engines that count bytes themselves (a tree copy): passed through.
impl Progress for SharedProgress {
    fn begin(&self, phase: &'static str, total: u64) {
        SharedProgress::begin(self, phase, total)
    }
    fn update(&self, done: u64) {
        if let Some(p) = &self.0 {
            p.show.update(done);
        }
    }
}

impl SharedProgress {
    /// Progress shown by `show`.
    pub fn new(show: impl Progress + Send + 'static) -> Self {
        SharedProgress(Some(std::sync::Arc::new(SharedInner {
            show: Box::new(show),
            done: Default::default(),
        })))
    }

    /// A phase of `total` bytes (0: not known) begins.
    pub fn begin(&self, phase: &'static str, total: u64) {
        if let Some(p) = &self.0 {
            p.done.store(0, std::sync::atomic::Ordering::Relaxed);
            p.show.begin(phase, total);
        }
    }

    /// `bytes` more of the phase are done.
    pub fn add(&self, bytes: u64) {
        if let Some(p) = &self.0 {
            let done = p
                .done
                .fetch_add(bytes, std::sync::atomic::Ordering::Relaxed)
                + bytes;
            p.show.update(done);
        }
    }
}

/// What a copy did, for people and (as JSON) for programs.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct CopySummary {
    /// Source path.
    pub source: PathBuf,
    /// Destination path.
    pub destination: PathBuf,
    /// Bytes in the source volume (and copied to the destination).
    pub volume_bytes: u64,
    /// Chunk size used.
    pub chunk_size: u64,
    /// Source bytes read (holes are not read).
    pub source_bytes_read: u64,
    /// Destination bytes read to compare (zero for a new image).
    pub destination_bytes_read: u64,
    /// Bytes written to the destination as data.
    pub bytes_written: u64,
    /// Bytes made zero in the destination by punching holes (no data written).
    pub bytes_zeroed: u64,
    /// Source bytes in zero chunks or holes, never written as data.
    pub zero_bytes_skipped: u64,
    /// 4 KiB pages written.
    pub pages_written: u64,
    /// Wall time in seconds, verification included.
    pub duration_secs: f64,
    /// `volume_bytes / duration_secs`.
    pub throughput_bytes_per_sec: f64,
    /// The destination was read back and matched the source.
    pub verified: bool,
    /// Merkle root of the source (with `--verify`), equal to the destination's.
    pub root: Option<String>,
    /// This run finished an earlier interrupted copy.
    pub resumed: bool,
    /// The destination's saved index was valid: only changed chunks were read from it.
    pub used_saved_index: bool,
    /// Bytes of volume data on the network (compressed), for copies to or from an agent.
    pub wire_bytes: u64,
}

/// A source window, what is known of its chunks, and the destination bytes to compare.
#[derive(Default)]
struct WindowPair {
    src: Window,
    /// Per chunk: all zeros (or a hole) in the source.
    zero: Vec<bool>,
    /// Per chunk, when hashing: its kind with id (empty when not hashing).
    ids: Vec<ChunkKind>,
    /// Per chunk, when a saved index is kept: the source's page CVs (empty for a zero
    /// chunk, and for an unchanged one whose CVs the saved index has).
    pages: Vec<Vec<Cv>>,
    /// Per chunk, with a valid saved index: its entry (`None`: unreadable) and page CVs.
    saved: Vec<Option<ChunkKind>>,
    saved_pages: Vec<Vec<Cv>>,
    /// Per chunk: what is known of the destination there.
    known: Vec<Known>,
    /// The destination's window; `None` when the destination reads as zeros.
    dst: Option<Window>,
}

/// What is known of a destination chunk before it is compared.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Known {
    /// Equal to the source's (its saved index says so): nothing to do.
    Same,
    /// Reads as zeros (its saved index says so): not read.
    Zeros,
    /// Not all zeros, its pages known by their CVs in its saved index (or the source's
    /// chunk is zero, so its pages do not matter): not read.
    Pages,
    /// As in the destination's window: read there, or zeros where it was not read.
    InWindow,
}

/// Copies the block volume `src` onto `dst` (created if missing), writing only the pages
/// that differ. See the module docs.
pub fn copy_block(
    src: &Path,
    dst: &Path,
    opts: &CopyOptions,
    progress: &dyn Progress,
) -> Result<CopySummary> {
    let started = Instant::now();
    let source = BlockVolume::open(src)?;
    warn_if_source_mounted(&source);
    let dest = dest::prepare(dest::Origin::local(&source), dst, opts)?;
    if dest.resumed {
        tracing::info!(destination = %dst.display(), "finishing an interrupted copy: equal pages are kept");
    }
    let chunk = opts.chunk_size;
    let key = ChunkKey::local();
    let size = source.size();

    // Image files keep a saved index of their chunks, so the next copy onto them reads
    // only the chunks that changed. Block devices cannot: writes to them leave no trace.
    let index_path = index::index_path(&opts.state_dir(), &dest.path);
    let is_image = dest.volume.kind() == VolumeKind::ImageFile;
    let mut saved = (is_image && !dest.fresh && dest.partial.is_none())
        .then(|| Identity::of(dest.volume.file()).ok())
        .flatten()
        .and_then(|id| IndexReader::open_valid(&index_path, id, chunk, size, &key));
    let mut new_index = if is_image {
        IndexWriter::create_paged(index_path.clone())
            .inspect_err(warn_no_index)
            .ok()
    } else {
        None
    };
    let hashing = opts.verify || new_index.is_some() || saved.is_some();
    let mut merkle = opts.verify.then(|| MerkleBuilder::new(key.clone()));
    let mut sum = CopySummary {
        source: src.into(),
        destination: dst.into(),
        volume_bytes: size,
        chunk_size: chunk.get(),
        resumed: dest.resumed,
        used_saved_index: saved.is_some(),
        ..Default::default()
    };
    source.advise_sequential();
    dest.volume.advise_sequential();
    let writer = DirectWriter::new(dest.volume.file())
        .map_err(|e| write_error("open of", dest.volume.path(), 0, e))?;
    progress.begin("copy", size);
    let window_len = chunker::window_len(chunk) as u64;
    let unindexed = saved.is_none();
    let plan = ReadPlan {
        source: &source,
        dest: &dest,
        chunk,
        key: &key,
        hashing,
        pager: is_image
            .then(|| UnitHasher::pages(&key, chunk.bytes()))
            .flatten(),
        carry: saved.as_ref().is_some_and(|s| s.has_pages()),
    };
    // Three stages, so the source is read while the last window is hashed and the one
    // before is written. Where little is written (a destination that holds an earlier
    // copy), two readers take turns, so the device always has a window's reads queued
    // (measured on the bench VM, cold: 1.2 GB/s with one reader waiting for the last
    // piece of each window, 1.5-1.6 GB/s with reads kept in flight). A new image is
    // written whole: its writes keep the device busy, and a second reader only takes
    // bandwidth from them and costs 16 MiB more (bench, cold full copy, best of 2:
    // 3.6-3.9 s with one reader, 3.8-4.3 s with two; by hand, equal within noise).
    let readers = if dest.fresh { 1 } else { READERS };
    read_process_ahead(
        1,
        readers,
        |k, recycled: Option<WindowPair>| {
            let offset = k as u64 * window_len;
            if offset >= size {
                return None;
            }
            let mut pair = recycled.unwrap_or_default();
            let len = window_len.min(size - offset) as usize;
            let r = plan.read(unindexed, offset, len, &mut pair);
            Some(r.map(|()| pair))
        },
        |pair: &mut WindowPair| plan.examine(saved.as_mut(), pair),
        |pair: &mut WindowPair| {
            let mut ops = Vec::new();
            for (i, r) in pair.src.chunk_ranges(chunk).enumerate() {
                let len = r.len() as u64;
                if !pair.src.unread[i] {
                    sum.source_bytes_read += len;
                }
                if pair.dst.as_ref().is_some_and(|d| !d.unread[i]) {
                    sum.destination_bytes_read += len;
                }
                if pair.zero[i] {
                    sum.zero_bytes_skipped += len;
                }
                if let Some(kind) = pair.ids.get(i) {
                    if let Some(m) = merkle.as_mut() {
                        m.push(kind, len);
                    }
                    // An unchanged chunk's page CVs come from the saved index.
                    let pages = match (kind, pair.known[i]) {
                        (ChunkKind::Zero, _) => &[][..],
                        (_, Known::Same) if plan.carry => &pair.saved_pages[i][..],
                        _ => &pair.pages[i][..],
                    };
                    if let Some(w) = &mut new_index
                        && let Err(e) = w.push_paged(kind, r.len(), pages)
                    {
                        warn_no_index(&e);
                        new_index = None;
                    }
                }
                let src_chunk = if pair.zero[i] {
                    SrcChunk::Zero(r.len())
                } else {
                    SrcChunk::Data(&pair.src.buf[r.clone()])
                };
                let dst_chunk = match pair.known[i] {
                    Known::Same => continue,
                    Known::Zeros => DstChunk::Zeros,
                    Known::Pages => DstChunk::Pages {
                        saved: &pair.saved_pages[i],
                        source: &pair.pages[i],
                    },
                    Known::InWindow => match &pair.dst {
                        Some(d) if !d.unread[i] => DstChunk::Bytes(&d.buf[r.clone()]),
                        _ => DstChunk::Zeros,
                    },
                };
                let mut chunk_ops = Vec::new();
                plan_chunk(src_chunk, dst_chunk, &mut chunk_ops);
                for op in chunk_ops {
                    push_merged(&mut ops, shift(op, r.start));
                }
            }
            apply_ops(&writer, dest.volume.path(), &pair.src, &ops, &mut sum)?;
            progress.update(pair.src.offset + pair.src.buf.len() as u64);
            Ok(())
        },
    )?;
    let file = dest.volume.file();
    file.sync_all()
        .map_err(|e| write_error("sync of", dest.volume.path(), 0, e))?;

    if let Some(m) = merkle {
        let root = m.finish(size, chunk);
        verify(&source, &dest.volume, &key, chunk, root, dst, progress)?;
        sum.verified = true;
        sum.root = Some(root.to_hex());
    }
    let final_file = finish_destination(dest)?;
    if let Some(w) = new_index {
        // Sealed with the image's identity as it is now, after the final sync and rename.
        let sealed = Identity::of(&final_file).and_then(|id| w.commit(id, chunk, size, &key));
        if let Err(e) = sealed {
            warn_no_index(&e);
        }
    }
    sum.duration_secs = started.elapsed().as_secs_f64();
    sum.throughput_bytes_per_sec = sum.volume_bytes as f64 / sum.duration_secs.max(1e-9);
    Ok(sum)
}

/// Source windows read at once, each by a reader thread of its own, where the
/// destination is not new.
const READERS: usize = 2;

/// The saved index is an optimisation: failing to write it never fails a copy.
fn warn_no_index(e: &std::io::Error) {
    tracing::warn!(
        "cannot save the destination's chunk index ({e}); the next copy will compare it in full"
    );
}

/// How the read-ahead thread fills a [`WindowPair`].
struct ReadPlan<'a> {
    source: &'a BlockVolume,
    dest: &'a dest::Destination,
    chunk: ChunkSize,
    key: &'a ChunkKey,
    hashing: bool,
    /// Hashes page CVs for the saved index (image destinations).
    pager: Option<UnitHasher>,
    /// The saved index has page CVs: unchanged chunks carry theirs over.
    carry: bool,
}

impl ReadPlan<'_> {
    /// Reads the source window at `offset` and, when the destination must be compared
    /// in full (it is not new, and `unindexed`: it has no valid saved index), the
    /// destination's window beside it.
    fn read(&self, unindexed: bool, offset: u64, len: usize, pair: &mut WindowPair) -> Result<()> {
        let (chunk, dest) = (self.chunk, self.dest);
        if dest.fresh || !unindexed {
            // A new image has nothing to compare; with an index, `examine` reads only
            // what the index cannot tell.
            read_window(self.source, chunk, offset, len, &mut pair.src)?;
            return Ok(());
        }
        let dst_win = pair.dst.get_or_insert_with(Window::default);
        let (a, b) = rayon::join(
            || read_window(self.source, chunk, offset, len, &mut pair.src),
            || read_window(&dest.volume, chunk, offset, len, dst_win),
        );
        a?;
        b?;
        Ok(())
    }

    /// Classifies (and when hashing, hashes) the chunks of a window [`ReadPlan::read`]
    /// filled, in parallel; with a saved index, tells from it what is known of each
    /// destination chunk, and reads the few it cannot tell.
    fn examine(&self, saved: Option<&mut IndexReader>, pair: &mut WindowPair) -> Result<()> {
        let (chunk, dest) = (self.chunk, self.dest);
        let n = pair.src.chunk_ranges(chunk).count();
        pair.saved.clear();
        pair.saved_pages.resize_with(n, Vec::new);
        let indexed = saved.is_some();
        match saved {
            // An unreadable index entry just means: compare this chunk.
            Some(saved) => pair.saved.extend(
                (pair.saved_pages.iter_mut().take(n)).map(|p| saved.next_with_pages(p).ok()),
            ),
            None => pair.saved.resize(n, None),
        }
        let (src, saved, saved_pages) = (&pair.src, &pair.saved, &pair.saved_pages);
        let classify =
            |(i, r): (usize, Range<usize>)| -> (bool, Option<ChunkKind>, Vec<Cv>, Known) {
                let data = &src.buf[r];
                let zero = src.unread[i] || is_zero(data);
                if !self.hashing {
                    return (zero, None, Vec::new(), Known::InWindow);
                }
                let (kind, pages) = self.hash(data, zero, saved[i]);
                let pager = self.pager.as_ref();
                let known = known(pager, data.len(), saved[i], &saved_pages[i], kind, &pages);
                (zero, Some(kind), pages, known)
            };
        let ranges = src.chunk_ranges(chunk).enumerate();
        // Hashing needs every core. Without it, classifying is a zero check per chunk:
        // run it inline, since idle rayon workers spinning between windows would steal
        // the CPU that the kernel's writeback and loop-device threads need.
        let classified: Vec<_> = match self.hashing {
            true => ranges
                .collect::<Vec<_>>()
                .into_par_iter()
                .map(classify)
                .collect(),
            false => ranges.map(classify).collect(),
        };
        pair.zero.clear();
        pair.ids.clear();
        pair.pages.clear();
        pair.known.clear();
        for (zero, kind, pages, known) in classified {
            pair.zero.push(zero);
            pair.ids.extend(kind);
            pair.pages.push(pages);
            pair.known.push(known);
        }
        if indexed && pair.known.contains(&Known::InWindow) {
            let known = &pair.known;
            let (offset, len) = (pair.src.offset, pair.src.buf.len());
            let dst_win = pair.dst.get_or_insert_with(Window::default);
            read_window_where(
                &dest.volume,
                chunk,
                offset,
                len,
                |i| known[i] == Known::InWindow,
                dst_win,
            )?;
        } else if indexed {
            // Nothing to read: no window (its buffer would be cleared for nothing).
            pair.dst = None;
        }
        Ok(())
    }

    /// A source chunk's kind and, for the saved index, its page CVs: computed in the
    /// same pass (merged, they give its id), except that with a saved index that has
    /// them an unchanged chunk's are carried over, so only changed chunks cost a page
    /// by page hash.
    fn hash(&self, data: &[u8], zero: bool, saved: Option<ChunkKind>) -> (ChunkKind, Vec<Cv>) {
        if zero {
            return (ChunkKind::Zero, Vec::new());
        }
        match self.pager.as_ref().filter(|p| p.merges(data.len())) {
            Some(p) if !(self.carry && saved.is_some()) => {
                let pages = p.cvs(data);
                (p.kind(&pages, data.len()), pages)
            }
            pager => {
                let kind = ChunkKind::Data(self.key.chunk_id(data));
                let pages = match pager {
                    Some(p) if saved != Some(kind) => p.cvs(data),
                    _ => Vec::new(),
                };
                (kind, pages)
            }
        }
    }
}

/// What the destination's saved index (entry `saved`, page CVs `saved_pages`) tells
/// of a chunk of `len` bytes where the source holds `kind`, with page CVs `pages`
/// (made by `pager`).
fn known(
    pager: Option<&UnitHasher>,
    len: usize,
    saved: Option<ChunkKind>,
    saved_pages: &[Cv],
    kind: ChunkKind,
    pages: &[Cv],
) -> Known {
    match saved {
        None => Known::InWindow,
        Some(old) if old == kind => Known::Same,
        Some(ChunkKind::Zero) => Known::Zeros,
        // Not all zeros: a zero source chunk clears it whatever its pages hold.
        Some(_) if kind == ChunkKind::Zero => Known::Pages,
        // The saved CVs are used only if they merge into the saved id: a record
        // that does not is never trusted to skip a page.
        Some(old) => match pager {
            Some(p)
                if !pages.is_empty()
                    && saved_pages.len() == pages.len()
                    && p.kind(saved_pages, len) == old =>
            {
                Known::Pages
            }
            _ => Known::InWindow,
        },
    }
}

fn shift(op: Op, by: usize) -> Op {
    match op {
        Op::Write(r) => Op::Write(r.start + by..r.end + by),
        Op::Zero(r) => Op::Zero(r.start + by..r.end + by),
    }
}

/// Applies a window's ops to the destination, in order.
fn apply_ops(
    dst: &DirectWriter,
    path: &Path,
    src: &Window,
    ops: &[Op],
    sum: &mut CopySummary,
) -> Result<()> {
    for op in ops {
        match op {
            Op::Write(r) => {
                let at = src.offset + r.start as u64;
                dst.write_all_at(&src.buf[r.clone()], at)
                    .map_err(|e| write_error("write to", path, at, e))?;
                sum.bytes_written += r.len() as u64;
                sum.pages_written += r.len().div_ceil(chunker::PAGE_SIZE) as u64;
            }
            Op::Zero(r) => {
                zero_range(
                    dst.file(),
                    path,
                    src.offset + r.start as u64,
                    r.len() as u64,
                )?;
                sum.bytes_zeroed += r.len() as u64;
            }
        }
    }
    Ok(())
}

/// Makes a range read as zeros: a punched hole where the file system or device can
/// (loop devices pass it to their backing file), else explicit zeros.
pub fn zero_range(file: &std::fs::File, path: &Path, offset: u64, len: u64) -> Result<()> {
    use rustix::io::Errno;
    for flags in [
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE,
    ] {
        match rustix::fs::fallocate(file, flags, offset, len) {
            Ok(()) => return Ok(()),
            Err(Errno::OPNOTSUPP | Errno::INVAL | Errno::NODEV | Errno::NOTTY) => continue,
            Err(e) => return Err(write_error("zeroing of", path, offset, e.into())),
        }
    }
    let zeros = vec![0u8; len.min(1 << 20) as usize];
    let mut at = offset;
    while at < offset + len {
        let n = zeros.len().min((offset + len - at) as usize);
        file.write_all_at(&zeros[..n], at)
            .map_err(|e| write_error("write to", path, at, e))?;
        at += n as u64;
    }
    Ok(())
}

/// Reads the destination back from disk and checks its Merkle root against the source's.
fn verify(
    source: &BlockVolume,
    dst: &BlockVolume,
    key: &ChunkKey,
    chunk: ChunkSize,
    src_root: ChunkId,
    shown_dst: &Path,
    progress: &dyn Progress,
) -> Result<()> {
    if read_back_root(dst, key, chunk, progress)? == src_root {
        return Ok(());
    }
    let offset = first_difference(source, dst, chunk)?.unwrap_or(0);
    Err(CopyError::VerifyFailed {
        src: source.path().into(),
        dst: shown_dst.into(),
        offset,
    })
}

/// The Merkle root of a volume just written, read back from disk: its pages are dropped
/// from the cache first, so the check reads the disk, not memory.
pub fn read_back_root(
    volume: &BlockVolume,
    key: &ChunkKey,
    chunk: ChunkSize,
    progress: &dyn Progress,
) -> Result<ChunkId> {
    let _ = rustix::fs::fadvise(volume.file(), 0, None, rustix::fs::Advice::DontNeed);
    progress.begin("verify", volume.size());
    Ok(hash_volume(volume, key, chunk, |done| progress.update(done))?.root)
}

/// The offset of the first chunk where two volumes differ, by direct comparison.
fn first_difference(a: &BlockVolume, b: &BlockVolume, chunk: ChunkSize) -> Result<Option<u64>> {
    let (mut wa, mut wb) = (Window::default(), Window::default());
    let mut off = 0;
    while off < a.size() {
        let len = (8u64 << 20).min(a.size() - off) as usize;
        read_window(a, chunk, off, len, &mut wa)?;
        read_window(b, chunk, off, len, &mut wb)?;
        for (i, r) in wa.chunk_ranges(chunk).enumerate() {
            let za = wa.unread[i] || is_zero(&wa.buf[r.clone()]);
            let zb = wb.unread[i] || is_zero(&wb.buf[r.clone()]);
            let equal = match (za, zb) {
                (true, true) => true,
                (false, false) => wa.buf[r.clone()] == wb.buf[r.clone()],
                _ => false,
            };
            if !equal {
                return Ok(Some(off + r.start as u64));
            }
        }
        off += len as u64;
    }
    Ok(None)
}

/// Makes the finished copy visible (renames a new image into place, or clears the
/// marker) and returns the destination's open file.
pub fn finish_destination(dest: dest::Destination) -> Result<std::fs::File> {
    if let Some(partial) = &dest.partial {
        rename_no_replace(partial, &dest.path)?;
        let dir = dest
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| write_error("sync of directory", dir, 0, e))?;
    }
    if let Some(marker) = dest.marker {
        marker.finish()?;
    }
    Ok(dest.volume.into_file())
}

/// Renames without replacing: if something appeared at `to` during the copy, keep both.
fn rename_no_replace(from: &Path, to: &Path) -> Result<()> {
    use rustix::fs::{CWD, RenameFlags, renameat_with};
    match renameat_with(CWD, from, CWD, to, RenameFlags::NOREPLACE) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::EXIST) => Err(CopyError::BadDestination {
            path: to.into(),
            why: format!(
                "was created by someone else during the copy; the complete copy is kept at {}",
                from.display()
            ),
        }),
        // File systems without RENAME_NOREPLACE: the existence check at the start stands.
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOSYS) => {
            std::fs::rename(from, to).map_err(|e| write_error("rename onto", to, 0, e))
        }
        Err(e) => Err(write_error("rename onto", to, 0, e.into())),
    }
}

/// Copying a mounted, writable filesystem gives a torn image: say so, but proceed
/// (it is how people copy a frozen or quiesced volume).
fn warn_if_source_mounted(source: &BlockVolume) {
    use std::os::unix::fs::MetadataExt;
    if source.kind() != chunker::VolumeKind::BlockDevice {
        return;
    }
    if let Ok(meta) = source.file().metadata()
        && let Some(mountpoint) = dest::mounted_at(meta.rdev())
    {
        tracing::warn!(
            source = %source.path().display(),
            %mountpoint,
            "the source is mounted: unless it is frozen (fsfreeze) or read-only, the copy may not be consistent"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_page_cvs_are_trusted_only_when_they_merge_into_the_saved_id() {
        let key = ChunkKey::local();
        let len = 64 << 10;
        let pager = UnitHasher::pages(&key, len).unwrap();
        let (old, new) = (vec![1u8; len], vec![2u8; len]);
        let (old_pages, new_pages) = (pager.cvs(&old), pager.cvs(&new));
        let old_kind = pager.kind(&old_pages, len);
        let new_kind = pager.kind(&new_pages, len);
        let p = Some(&pager);
        let known = |saved, saved_pages: &[Cv], kind, pages: &[Cv]| {
            known(p, len, saved, saved_pages, kind, pages)
        };
        assert_eq!(known(None, &[], new_kind, &new_pages), Known::InWindow);
        assert_eq!(known(Some(new_kind), &[], new_kind, &[]), Known::Same);
        assert_eq!(
            known(Some(ChunkKind::Zero), &[], new_kind, &new_pages),
            Known::Zeros
        );
        assert_eq!(
            known(Some(old_kind), &old_pages, new_kind, &new_pages),
            Known::Pages
        );
        assert_eq!(
            known(Some(old_kind), &[], ChunkKind::Zero, &[]),
            Known::Pages
        );
        // A page CV that does not merge into the saved id: the chunk is read.
        let mut torn = old_pages.clone();
        torn[3][0] ^= 1;
        assert_eq!(
            known(Some(old_kind), &torn, new_kind, &new_pages),
            Known::InWindow
        );
        // No CVs saved (an index written by an agent), or none hashed: read.
        assert_eq!(
            known(Some(old_kind), &[], new_kind, &new_pages),
            Known::InWindow
        );
        assert_eq!(
            known(Some(old_kind), &old_pages, new_kind, &[]),
            Known::InWindow
        );
        assert_eq!(
            super::known(None, len, Some(old_kind), &old_pages, new_kind, &new_pages),
            Known::InWindow
        );
    }
}
