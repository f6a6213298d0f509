//! The primary's base: the reflink clone of the last committed cycle, kept beside the
//! image with that cycle's chunk ids. The next cycle's clone shares every block that was
//! not written since; comparing the two clones' extent maps (FIEMAP) names the chunks
//! that may have changed, and only those are read (the others' ids come from here).
//!
//! Files, beside the image `IMG` of relationship hash `H`:
//! `.IMG.mover-base-H-N` (the clone of cycle N) and `.IMG.mover-base-H.ids` (cycle N's
//! ids). The ids file names its cycle, and is replaced only after the clone of that
//! cycle is in place, so a crash between the two leaves the previous, matching pair.
//! `.IMG.mover-base-H.cvs` holds the chunks' unit CVs, so that of a changed chunk only
//! the written pages are read.
//!
//! A cycle does not take a fresh clone when there is a base: a clone costs every extent
//! of the image (seconds for an image that copy-on-write has fragmented into 100k
//! extents), so the base clone is brought up to date instead, recloning only the ranges
//! where it and the image differ ([`Base::catch_up`]). Those ranges are first added to
//! `.IMG.mover-base-H.pending` (durably, tagged with the base's cycle): the ranges where
//! the clone may differ from that cycle, which the next cycle reads. A commit renames the
//! clone to the new cycle, and the new ids make the pending record stale.

use chunker::{BlockVolume, ChunkId, ChunkKind, ChunkSize, cv::CvFile, extents};
use mover_engine::copy::index::{Identity, IndexReader, IndexWriter, index_path};
use mover_engine::node::write_durably;
use mover_engine::remote::KnownChunks;
use std::{
    fs::File,
    io,
    ops::Range,
    path::{Path, PathBuf},
    sync::Arc,
};

const MAGIC: &[u8; 8] = b"MVBASE1\n";
const HEADER: usize = 8 + 8 + 32 + 8 + 8;
const PENDING_MAGIC: &[u8; 8] = b"MVPEND1\n";

/// A committed cycle's clone and chunk ids.
pub struct Base {
    /// The cycle.
    pub cycle: u64,
    /// Its Merkle root.
    pub root: ChunkId,
    clone: PathBuf,
    kinds: Vec<ChunkKind>,
    /// Byte ranges (sorted, merged) where the clone may no longer hold `cycle`: recloned
    /// from the image for a cycle that did not commit.
    pending: Vec<Range<u64>>,
}

/// The name of relationship `name`'s hidden `what` file beside the image `source`:
/// `.IMG.mover-WHAT-H`, H a hash of the relationship's name (clones need the image's
/// file system, and two relationships must not share them).
pub(crate) fn hidden_name(source: &Path, name: &str, what: &str) -> String {
    let h = blake3::hash(name.as_bytes()).to_hex();
    let file = source
        .file_name()
        .map(|f| f.to_string_lossy().into_owned())
        .unwrap_or_default();
    format!(".{file}.mover-{what}-{}", &h[..12])
}

fn stem(source: &Path, name: &str) -> String {
    hidden_name(source, name, "base")
}

fn ids_path(source: &Path, name: &str) -> PathBuf {
    source.with_file_name(format!("{}.ids", stem(source, name)))
}

/// The unit CVs of the image's chunks (see [`chunker::cv`]): checked against the ids
/// when read, so kept across cycles and never in the way of a crash.
fn cvs_path(source: &Path, name: &str) -> PathBuf {
    source.with_file_name(format!("{}.cvs", stem(source, name)))
}

/// Opens relationship `name`'s CV file beside `source` (`None` for chunks of one unit).
pub fn open_cvs(source: &Path, name: &str, chunk: ChunkSize) -> io::Result<Option<CvFile>> {
    let key = transport::relationship_key(name);
    CvFile::open(&cvs_path(source, name), &key, chunk.bytes())
}

fn clone_path(source: &Path, name: &str, cycle: u64) -> PathBuf {
    source.with_file_name(format!("{}-{cycle}", stem(source, name)))
}

fn pending_path(source: &Path, name: &str) -> PathBuf {
    source.with_file_name(format!("{}.pending", stem(source, name)))
}

/// The pending ranges recorded for base cycle `cycle`; none if the record is of another
/// cycle (a commit made it stale) or absent. `None` if it is damaged.
fn load_pending(path: &Path, cycle: u64) -> Option<Vec<Range<u64>>> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Some(Vec::new()),
        Err(_) => return None,
    };
    let body = unseal(&bytes, PENDING_MAGIC, 8)?;
    let words: Vec<u64> = body
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .collect();
    if words[0] != cycle {
        return Some(Vec::new());
    }
    Some(words[1..].chunks_exact(2).map(|p| p[0]..p[1]).collect())
}

fn save_pending(path: &Path, cycle: u64, ranges: &[Range<u64>]) -> io::Result<()> {
    let mut body = Vec::with_capacity(16 + ranges.len() * 16 + 32);
    body.extend_from_slice(PENDING_MAGIC);
    body.extend_from_slice(&cycle.to_le_bytes());
    for r in ranges {
        body.extend_from_slice(&r.start.to_le_bytes());
        body.extend_from_slice(&r.end.to_le_bytes());
    }
    write_durably(path, &sealed(body))
}

/// `body` (starting with its magic) followed by its BLAKE3 sum, as the base's records
/// are saved.
fn sealed(mut body: Vec<u8>) -> Vec<u8> {
    let sum = *blake3::hash(&body).as_bytes();
    body.extend_from_slice(&sum);
    body
}

/// What follows `magic` in a record saved by [`sealed`], if its sum is right, its magic
/// is `magic` and it has at least `min` bytes after it.
fn unseal<'a>(bytes: &'a [u8], magic: &[u8; 8], min: usize) -> Option<&'a [u8]> {
    let (body, sum) = bytes.split_at_checked(bytes.len().checked_sub(32)?)?;
    let rest = body.strip_prefix(magic)?;
    (blake3::hash(body).as_bytes() == sum && rest.len() >= min).then_some(rest)
}

impl Base {
    /// The base of relationship `name` for the image `source`, if one matches the
    /// volume's geometry and is intact.
    pub fn load(source: &Path, name: &str, chunk: ChunkSize, size: u64) -> Option<Base> {
        let CycleIds { cycle, root, kinds } = CycleIds::load(&ids_path(source, name), chunk, size)?;
        let clone = clone_path(source, name, cycle);
        let pending = load_pending(&pending_path(source, name), cycle)?;
        clone.exists().then_some(Base {
            cycle,
            root,
            clone,
            kinds,
            pending,
        })
    }

    /// The base's clone: after [`Base::catch_up`], a point in time of the image.
    pub fn clone_file(&self) -> &Path {
        &self.clone
    }

    /// Brings the clone up to date with the image `source` (which must not change
    /// meanwhile: its file system frozen, or nothing writing): the ranges where they differ
    /// are recorded as pending, then recloned. `Ok(false)` where the file system cannot
    /// compare extents (no FIEMAP).
    pub fn catch_up(&mut self, source: &Path, name: &str) -> io::Result<bool> {
        let image = File::open(source)?;
        let clone = std::fs::OpenOptions::new().write(true).open(&self.clone)?;
        let Some(differ) = extents::changed_ranges(&clone, &image)? else {
            return Ok(false);
        };
        if differ.is_empty() {
            return Ok(true);
        }
        // Recorded first: a crash mid-reclone leaves the clone differing from the base
        // cycle only in ranges the next cycle reads.
        let pending = extents::merge_ranges([&self.pending[..], &differ].concat());
        save_pending(&pending_path(source, name), self.cycle, &pending)?;
        self.pending = pending;
        mover_engine::node::failpoint("catch-up-recorded");
        for range in &differ {
            extents::reclone_ranges(&image, &clone, std::slice::from_ref(range))?;
            mover_engine::node::pause("catch-up-range");
        }
        tracing::debug!(
            relationship = name,
            ranges = differ.len(),
            "clone caught up"
        );
        Ok(true)
    }

    /// What this base says of the image at the last [`Base::catch_up`]: its chunks at the
    /// base cycle, and which may have changed since.
    pub fn known_pending(&self, chunk: ChunkSize) -> Arc<KnownChunks> {
        self.known_from(self.pending.clone(), chunk)
    }

    /// What this base says of `now` (a newer clone of the same image): its chunks then,
    /// and which may have changed. `None` where the file system cannot tell (no FIEMAP).
    pub fn known(&self, now: &Path, chunk: ChunkSize) -> io::Result<Option<Arc<KnownChunks>>> {
        let (old, new) = (File::open(&self.clone)?, File::open(now)?);
        let Some(ranges) = extents::changed_ranges(&old, &new)? else {
            return Ok(None);
        };
        let ranges = [&ranges[..], &self.pending].concat();
        Ok(Some(self.known_from(ranges, chunk)))
    }

    fn known_from(&self, ranges: Vec<Range<u64>>, chunk: ChunkSize) -> Arc<KnownChunks> {
        Arc::new(KnownChunks::new(self.kinds.clone(), ranges, chunk))
    }
}

/// A committed cycle's chunk ids, as kept in a file (sealed with its BLAKE3).
pub struct CycleIds {
    /// The cycle.
    pub cycle: u64,
    /// Its Merkle root.
    pub root: ChunkId,
    /// Its chunks.
    pub kinds: Vec<ChunkKind>,
}

impl CycleIds {
    /// The ids kept in `path`, if intact and of this geometry.
    pub fn load(path: &Path, chunk: ChunkSize, size: u64) -> Option<CycleIds> {
        let bytes = std::fs::read(path).ok()?;
        // After the magic: cycle, root, chunk size, volume size, ids.
        let body = unseal(&bytes, MAGIC, HEADER - MAGIC.len())?;
        let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
        let cycle = u64_at(0);
        let root = ChunkId(body[8..40].try_into().expect("32 bytes"));
        if u64_at(40) != chunk.get() || u64_at(48) != size {
            return None;
        }
        let ids = &body[HEADER - MAGIC.len()..];
        if ids.len() as u64 != size.div_ceil(chunk.get()) * 32 {
            return None;
        }
        let kinds = ids
            .chunks_exact(32)
            .map(|id| match id {
                z if z.iter().all(|b| *b == 0) => ChunkKind::Zero,
                id => ChunkKind::Data(ChunkId(id.try_into().expect("32 bytes"))),
            })
            .collect();
        Some(CycleIds { cycle, root, kinds })
    }

    /// Keeps cycle `cycle`'s `ids` (32 bytes per chunk, zeros for a zero chunk) in
    /// `path`, durably.
    pub fn save(
        path: &Path,
        cycle: u64,
        root: &ChunkId,
        chunk: ChunkSize,
        size: u64,
        ids: &[u8],
    ) -> io::Result<()> {
        let mut body = Vec::with_capacity(HEADER + ids.len() + 32);
        body.extend_from_slice(MAGIC);
        body.extend_from_slice(&cycle.to_le_bytes());
        body.extend_from_slice(&root.0);
        body.extend_from_slice(&chunk.get().to_le_bytes());
        body.extend_from_slice(&size.to_le_bytes());
        body.extend_from_slice(ids);
        write_durably(path, &sealed(body))
    }
}

/// Makes `clone` (of `source`, cycle `cycle` just committed with `root` and chunk
/// `ids`) the base of the next cycle, and removes the previous base.
#[allow(clippy::too_many_arguments)]
pub fn save(
    source: &Path,
    name: &str,
    clone: &Path,
    cycle: u64,
    root: &ChunkId,
    chunk: ChunkSize,
    size: u64,
    ids: &[u8],
) -> io::Result<()> {
    let kept = clone_path(source, name, cycle);
    if clone != kept {
        std::fs::rename(clone, &kept)?;
    }
    CycleIds::save(&ids_path(source, name), cycle, root, chunk, size, ids)?;
    // Stale now (it names the previous cycle): the clone holds this one exactly.
    let _ = std::fs::remove_file(pending_path(source, name));
    remove(source, name, Some(&kept));
    Ok(())
}

/// Removes relationship `name`'s base files beside `source` (they hold blocks the image
/// no longer shares): when the relationship is deleted or this side stops being primary.
pub fn forget(source: &Path, name: &str) {
    remove(source, name, None);
}

/// Removes the base files of `name` but `keep` (and the ids file, if `keep` is given).
fn remove(source: &Path, name: &str, keep: Option<&Path>) {
    let stem = stem(source, name);
    let clones = format!("{stem}-");
    let Some(dir) = source.parent() else { return };
    let Ok(entries) = std::fs::read_dir(if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    }) else {
        return;
    };
    for e in entries.flatten() {
        let file = e.file_name().to_string_lossy().into_owned();
        let ours = match keep {
            Some(k) => {
                file.starts_with(&clones) && k.file_name() != Some(e.file_name().as_os_str())
            }
            None => file.starts_with(&stem),
        };
        if ours {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The chunk kinds of the image `source` from the agent's saved index in `state_dir`,
/// if that index is valid for the image as it is now.
fn saved_kinds(
    state_dir: &Path,
    source: &Path,
    name: &str,
    chunk: ChunkSize,
    size: u64,
) -> Option<Vec<ChunkKind>> {
    let file = File::open(source).ok()?;
    let key = transport::relationship_key(name);
    let mut r = IndexReader::open_valid(
        &index_path(state_dir, source),
        Identity::of(&file).ok()?,
        chunk,
        size,
        &key,
    )?;
    (0..size.div_ceil(chunk.get()))
        .map(|_| r.next_kind().ok())
        .collect()
}

/// On a secondary being promoted: makes the image `source`, which holds cycle `cycle`
/// (hex `root`) with a valid saved index, the base of its first cycle as primary, so
/// that cycle reads only what is written from now on. `Ok(false)` where it cannot be
/// (no valid index, no reflinks).
pub fn adopt(
    state_dir: &Path,
    source: &Path,
    name: &str,
    chunk: ChunkSize,
    cycle: u64,
    root: &str,
) -> io::Result<bool> {
    let size = std::fs::metadata(source)?.len();
    let (Some(kinds), Some(root)) = (
        saved_kinds(state_dir, source, name, chunk, size),
        ChunkId::from_hex(root),
    ) else {
        return Ok(false);
    };
    let tmp = source.with_file_name(format!("{}.adopting", stem(source, name)));
    if !extents::clone_fresh(source, &tmp)? {
        return Ok(false);
    }
    let ids: Vec<u8> = kinds
        .iter()
        .flat_map(|k| match k {
            ChunkKind::Zero => [0u8; 32],
            ChunkKind::Data(id) => id.0,
        })
        .collect();
    let saved = save(source, name, &tmp, cycle, &root, chunk, size, &ids);
    let _ = std::fs::remove_file(&tmp);
    saved.map(|()| true)
}

/// On a promoted secondary, which kept no unit CVs: records those of every data chunk of
/// the base's clone, so that its cycles read only the written units of a changed chunk
/// (failback included) instead of the whole chunk. Reads the volume's data once: run it
/// off the request path. A record made while a cycle recloned the clone under it merges
/// into no chunk id, so it is ignored when read. Returns the chunks recorded.
pub fn record_cvs(source: &Path, name: &str, chunk: ChunkSize) -> io::Result<u64> {
    use rayon::prelude::*;
    /// Chunks per read: large reads of what is mostly contiguous data.
    const SPAN: usize = 64;
    let size = std::fs::metadata(source)?.len();
    let (Some(base), Some(cvs)) = (
        Base::load(source, name, chunk, size),
        open_cvs(source, name, chunk)?,
    ) else {
        return Ok(0);
    };
    let volume = BlockVolume::open(&base.clone).map_err(io::Error::other)?;
    volume.advise_sequential();
    let mut win = chunker::Window::default();
    let mut recorded = 0;
    for first in (0..base.kinds.len()).step_by(SPAN) {
        let n = SPAN.min(base.kinds.len() - first);
        let at = first as u64 * chunk.get();
        let len = (n as u64 * chunk.get()).min(size - at) as usize;
        let data = |i: usize| base.kinds[first + i] != ChunkKind::Zero;
        chunker::read_window_where(&volume, chunk, at, len, data, &mut win)
            .map_err(io::Error::other)?;
        let ranges: Vec<_> = win.chunk_ranges(chunk).enumerate().collect();
        recorded += ranges
            .into_par_iter()
            .filter(|(i, r)| !win.unread[*i] && chunker::cv::UnitHasher::covers(r.len()))
            .map(|(i, r)| {
                let unit_cvs = cvs.hasher().cvs(&win.buf[r]);
                cvs.put((first + i) as u64, &unit_cvs).map(|()| 1)
            })
            .sum::<io::Result<u64>>()?;
    }
    Ok(recorded)
}

/// On a former primary becoming a secondary (demote, resync): the byte ranges written
/// into the image since its base cycle `cycle` (the clone its last committed cycle
/// left), and its saved index sealed for what it holds now (the base's chunk ids, the
/// written chunks hashed again), so that the new primary's first cycle need not read
/// or compare the rest. `None` where there is no such base (then nothing is sealed).
pub fn settle(
    state_dir: &Path,
    source: &Path,
    name: &str,
    chunk: ChunkSize,
    cycle: u64,
) -> io::Result<Option<Vec<Range<u64>>>> {
    let size = std::fs::metadata(source)?.len();
    let Some(base) = Base::load(source, name, chunk, size).filter(|b| b.cycle == cycle) else {
        tracing::debug!(
            relationship = name,
            cycle,
            "no clone of the last cycle to settle from"
        );
        return Ok(None);
    };
    let Some(known) = base.known(source, chunk)? else {
        return Ok(None);
    };
    let key = transport::relationship_key(name);
    let volume = BlockVolume::open(source).map_err(io::Error::other)?;
    let file = File::open(source)?;
    let identity = Identity::of(&file)?;
    let mut w = IndexWriter::create(index_path(state_dir, source))?;
    let mut win = chunker::Window::default();
    for (i, kind) in known.base.iter().enumerate() {
        let kind = if known.changed[i] {
            let at = i as u64 * chunk.get();
            let len = chunk.get().min(size - at) as usize;
            chunker::read_window(&volume, chunk, at, len, &mut win).map_err(io::Error::other)?;
            chunker::hash_chunks(&key, chunk, &win)[0]
        } else {
            *kind
        };
        w.push(&kind)?;
    }
    // Sealed only if nothing was written while the index was made.
    if Identity::of(&file)? != identity {
        return Ok(None);
    }
    w.commit(identity, chunk, size, &key)?;
    Ok(Some(known.ranges.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_saved_base_loads_and_a_damaged_one_does_not() {
        let t = tempfile::tempdir().unwrap();
        let src = t.path().join("vol.img");
        let chunk = ChunkSize::new(128 << 10).unwrap();
        let size = 1 << 20;
        std::fs::File::create(&src).unwrap().set_len(size).unwrap();
        let clone = t.path().join("clone");
        std::fs::write(&clone, b"").unwrap();
        let mut ids = vec![0u8; 8 * 32];
        ids[32] = 7;
        save(&src, "r", &clone, 5, &ChunkId([9; 32]), chunk, size, &ids).unwrap();
        let b = Base::load(&src, "r", chunk, size).expect("loads");
        assert_eq!((b.cycle, b.root), (5, ChunkId([9; 32])));
        assert_eq!(b.kinds[0], ChunkKind::Zero);
        assert!(matches!(b.kinds[1], ChunkKind::Data(_)));
        assert!(Base::load(&src, "r", chunk, size * 2).is_none());
        let p = ids_path(&src, "r");
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[70] ^= 1;
        std::fs::write(&p, bytes).unwrap();
        assert!(Base::load(&src, "r", chunk, size).is_none());
        forget(&src, "r");
        assert_eq!(std::fs::read_dir(t.path()).unwrap().count(), 1);
    }

    #[test]
    fn pending_ranges_count_only_for_their_cycle_and_a_damaged_record_for_none() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("pending");
        assert_eq!(load_pending(&p, 5), Some(vec![]), "absent: nothing pending");
        let ranges = [0..4096, 1 << 20..(1 << 20) + 8192];
        save_pending(&p, 5, &ranges).unwrap();
        assert_eq!(load_pending(&p, 5).as_deref(), Some(&ranges[..]));
        assert_eq!(load_pending(&p, 6), Some(vec![]), "of an older base: stale");
        let mut bytes = std::fs::read(&p).unwrap();
        bytes[20] ^= 1;
        std::fs::write(&p, bytes).unwrap();
        assert_eq!(
            load_pending(&p, 5),
            None,
            "damaged: the base is not trusted"
        );
    }
}
