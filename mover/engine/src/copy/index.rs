//! The saved chunk index of a destination image.
//!
//! After a copy onto an image file, the source's chunk ids are saved with the image's
//! identity (device, inode, size, mtime, ctime as of the end of the copy). The next copy
//! onto the same, untouched image compares the new source's chunk ids with the saved ones
//! and reads from the destination only the chunks that changed, instead of all of it
//! (docs/ARCHITECTURE.md: a local destination is read, or its saved index).
//!
//! Any change to the image (a write updates mtime and ctime; ctime cannot be set back)
//! invalidates the index, and so does a damaged index file (whole-file checksum, checked
//! before any entry is used). Block devices get no index: their writes leave no trace.
//!
//! A local copy also saves the 4 KiB page CVs of every data chunk (`UnitHasher::pages`,
//! merged they give the chunk's id), so the next copy tells which pages of a changed
//! chunk differ from the CVs of the source's pages alone, without reading the
//! destination. Unchanged chunks carry their CVs over from the old index.
//!
//! File layout (version 2): one 32-byte entry per chunk (all zeros for a zero chunk),
//! in a paged index followed, for a data chunk longer than a page, by its page CVs (32
//! bytes each); then a fixed trailer: identity, chunk size, volume size, entry count,
//! flags (1: paged), key fingerprint, the BLAKE3 of everything before it, and the magic.
//! Older versions are not trusted: the destination is then compared in full once.

use chunker::durable::publish;
use chunker::{ChunkId, ChunkKey, ChunkKind, ChunkSize, PAGE_SIZE, cv::Cv};
use std::{
    fs::{self, File},
    io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

const MAGIC: &[u8; 8] = b"MVIDX\0v2";
/// identity (6 × 8) + chunk + volume + count + flags (4 × 8) + key fingerprint (32) +
/// checksum (32) + magic (8)
const TRAILER_LEN: usize = 48 + 32 + 32 + 32 + 8;
/// The flag of an index that holds page CVs.
const PAGED: u64 = 1;

/// How many page CVs a paged index holds for a data chunk of `len` bytes: none for a
/// chunk of one page or less, whose id is not a merge of CVs.
pub fn page_count(len: usize) -> usize {
    if len > PAGE_SIZE {
        len.div_ceil(PAGE_SIZE)
    } else {
        0
    }
}

/// What identifies an image's exact state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity([i64; 6]);

impl Identity {
    /// Its words, for a record that seals with it.
    pub fn words(self) -> [i64; 6] {
        self.0
    }

    /// The identity of an open image file as it is now.
    pub fn of(file: &File) -> std::io::Result<Identity> {
        let m = file.metadata()?;
        Ok(Identity([
            m.dev() as i64,
            m.ino() as i64,
            m.size() as i64,
            m.mtime() * 1_000_000_000 + m.mtime_nsec(),
            m.ctime() * 1_000_000_000 + m.ctime_nsec(),
            0,
        ]))
    }
}

/// Where the index for `dst` lives in the state directory.
pub fn index_path(state_dir: &Path, dst: &Path) -> PathBuf {
    // The same absolute name whether or not the image exists yet (a new image is named
    // before it is created), and whatever the working directory.
    let abs = fs::canonicalize(dst).unwrap_or_else(|_| {
        let parent = dst
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        match (fs::canonicalize(parent), dst.file_name()) {
            (Ok(dir), Some(name)) => dir.join(name),
            _ => dst.to_path_buf(),
        }
    });
    state_file(state_dir, "index", &abs, "idx")
}

/// The state file in `state_dir/kind/` for the destination at the absolute path `abs`
/// (or any name, such as a snapshot's volume name): named by a hash of it, so any path
/// gives a short, safe name.
pub fn state_file(state_dir: &Path, kind: &str, abs: &Path, ext: &str) -> PathBuf {
    let name = blake3::hash(abs.as_os_str().as_encoded_bytes()).to_hex();
    state_dir.join(kind).join(format!("{}.{ext}", &name[..32]))
}

/// The fingerprint of a chunk key kept in an index: a different key makes the index stale.
pub fn key_fingerprint(key: &ChunkKey) -> [u8; 32] {
    *blake3::keyed_hash(key.as_bytes(), b"mover index key fingerprint").as_bytes()
}

/// Reads a saved index entry by entry, in chunk order.
pub struct IndexReader {
    /// The entries, not the trailer.
    entries: BufReader<std::io::Take<File>>,
    /// Entries not read yet.
    remaining: u64,
    chunk: u64,
    size: u64,
    paged: bool,
}

impl IndexReader {
    /// Opens the index at `path` if it is intact and describes exactly this image state,
    /// chunk size, volume size and key; `None` otherwise (then the image is compared in full).
    pub fn open_valid(
        path: &Path,
        identity: Identity,
        chunk: ChunkSize,
        size: u64,
        key: &ChunkKey,
    ) -> Option<IndexReader> {
        let mut f = File::open(path).ok()?;
        let len = f.metadata().ok()?.len();
        if len < TRAILER_LEN as u64 {
            return None;
        }
        let mut t = [0u8; TRAILER_LEN];
        f.seek(SeekFrom::Start(len - TRAILER_LEN as u64)).ok()?;
        f.read_exact(&mut t).ok()?;
        let word = |i: usize| i64::from_le_bytes(t[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let saved = Identity([word(0), word(1), word(2), word(3), word(4), word(5)]);
        let (saved_chunk, saved_size, count) = (word(6) as u64, word(7) as u64, word(8) as u64);
        let flags = word(9) as u64;
        let fingerprint = &t[80..112];
        let checksum = &t[112..144];
        let entries = len - TRAILER_LEN as u64;
        let ok = &t[144..152] == MAGIC
            && saved == identity
            && saved_chunk == chunk.get()
            && saved_size == size
            && count == size.div_ceil(chunk.get())
            && flags & !PAGED == 0
            && fingerprint == key_fingerprint(key)
            && (entries == count * 32 || (flags & PAGED != 0 && entries >= count * 32));
        if !ok {
            return None;
        }
        // Check the whole file before trusting any entry: a damaged index must not make
        // a changed chunk look unchanged.
        f.seek(SeekFrom::Start(0)).ok()?;
        let mut hasher = blake3::Hasher::new();
        std::io::copy(&mut (&mut f).take(len - 40), &mut hasher).ok()?;
        if hasher.finalize().as_bytes() != checksum {
            tracing::warn!(index = %path.display(), "saved index is damaged; comparing the destination in full");
            return None;
        }
        f.seek(SeekFrom::Start(0)).ok()?;
        Some(IndexReader {
            entries: BufReader::with_capacity(1 << 16, f.take(entries)),
            remaining: count,
            chunk: chunk.get(),
            size,
            paged: flags & PAGED != 0,
        })
    }

    /// Whether the index holds the page CVs of its data chunks.
    pub fn has_pages(&self) -> bool {
        self.paged
    }

    /// The saved kind of the next chunk.
    pub fn next_kind(&mut self) -> std::io::Result<ChunkKind> {
        let (kind, pages) = self.next_entry()?;
        let skip = pages as u64 * 32;
        if std::io::copy(&mut (&mut self.entries).take(skip), &mut std::io::sink())? != skip {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok(kind)
    }

    /// The saved kind of the next chunk, and in `pages` its page CVs (none for a zero
    /// chunk, a chunk of one page, or an index without them).
    pub fn next_with_pages(&mut self, pages: &mut Vec<Cv>) -> std::io::Result<ChunkKind> {
        pages.clear();
        let (kind, n) = self.next_entry()?;
        pages.resize(n, [0; 32]);
        self.entries.read_exact(pages.as_flattened_mut())?;
        Ok(kind)
    }

    /// The next entry's kind, and how many page CVs follow it.
    fn next_entry(&mut self) -> std::io::Result<(ChunkKind, usize)> {
        let count = self.size.div_ceil(self.chunk);
        if self.remaining == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "index has fewer entries than chunks",
            ));
        }
        let at = (count - self.remaining) * self.chunk;
        self.remaining -= 1;
        let mut e = [0u8; 32];
        self.entries.read_exact(&mut e)?;
        Ok(if e == [0; 32] {
            (ChunkKind::Zero, 0)
        } else {
            let len = self.chunk.min(self.size - at) as usize;
            let pages = if self.paged { page_count(len) } else { 0 };
            (ChunkKind::Data(ChunkId(e)), pages)
        })
    }
}

/// Writes a new index while a copy runs; it becomes valid only on [`IndexWriter::commit`].
pub struct IndexWriter {
    out: BufWriter<File>,
    hasher: blake3::Hasher,
    tmp: RemoveOnDrop,
    path: PathBuf,
    count: u64,
    paged: bool,
}

impl IndexWriter {
    /// Removes any index at `path` (the destination is about to change) and starts a new
    /// one, of chunk ids alone.
    pub fn create(path: PathBuf) -> std::io::Result<IndexWriter> {
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        fs::create_dir_all(path.parent().expect("index paths have a parent"))?;
        let tmp = path.with_extension("tmp");
        let out = BufWriter::with_capacity(1 << 16, File::create(&tmp)?);
        Ok(IndexWriter {
            out,
            hasher: blake3::Hasher::new(),
            tmp: RemoveOnDrop(tmp),
            path,
            count: 0,
            paged: false,
        })
    }

    /// Like [`IndexWriter::create`], for an index that also holds page CVs
    /// ([`IndexWriter::push_paged`]).
    pub fn create_paged(path: PathBuf) -> std::io::Result<IndexWriter> {
        let mut w = Self::create(path)?;
        w.paged = true;
        Ok(w)
    }

    /// Appends the next chunk's kind, in an index without page CVs.
    pub fn push(&mut self, kind: &ChunkKind) -> std::io::Result<()> {
        debug_assert!(!self.paged, "a paged index needs push_paged");
        self.entry(kind, &[])
    }

    /// Appends the next chunk's kind (a chunk of `len` bytes) and, for a data chunk, its
    /// page CVs ([`page_count`] of them), in a paged index.
    pub fn push_paged(
        &mut self,
        kind: &ChunkKind,
        len: usize,
        pages: &[Cv],
    ) -> std::io::Result<()> {
        let want = match kind {
            ChunkKind::Zero => 0,
            ChunkKind::Data(_) => page_count(len),
        };
        if !self.paged || pages.len() != want {
            // A wrong count would shift every later entry: refuse, and the index is dropped.
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{} page CVs given for a chunk of {len} bytes", pages.len()),
            ));
        }
        self.entry(kind, pages)
    }

    fn entry(&mut self, kind: &ChunkKind, pages: &[Cv]) -> std::io::Result<()> {
        let e = match kind {
            ChunkKind::Zero => [0u8; 32],
            ChunkKind::Data(id) => id.0,
        };
        self.hasher.update(&e);
        self.hasher.update(pages.as_flattened());
        self.count += 1;
        self.out.write_all(&e)?;
        self.out.write_all(pages.as_flattened())
    }

    /// Seals the index for the image in the state `identity` and makes it durable.
    pub fn commit(
        mut self,
        identity: Identity,
        chunk: ChunkSize,
        size: u64,
        key: &ChunkKey,
    ) -> std::io::Result<()> {
        let mut t = Vec::with_capacity(TRAILER_LEN);
        for w in identity.0 {
            t.extend_from_slice(&w.to_le_bytes());
        }
        let flags = if self.paged { PAGED } else { 0 };
        for w in [chunk.get(), size, self.count, flags] {
            t.extend_from_slice(&w.to_le_bytes());
        }
        t.extend_from_slice(&key_fingerprint(key));
        self.hasher.update(&t);
        t.extend_from_slice(self.hasher.finalize().as_bytes());
        t.extend_from_slice(MAGIC);
        self.out.write_all(&t)?;
        let f = self.out.into_inner().map_err(|e| e.into_error())?;
        publish(&f, &self.tmp.0, &self.path)
    }
}

/// Removes its file when dropped: an index never committed (a failed copy, a full disk)
/// leaves no partial file behind (once committed, the file is gone from there already).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        _ = fs::remove_file(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, image: &File, kinds: &[ChunkKind]) -> PathBuf {
        let path = dir.join("index/x.idx");
        let mut w = IndexWriter::create(path.clone()).unwrap();
        kinds.iter().for_each(|k| w.push(k).unwrap());
        w.commit(
            Identity::of(image).unwrap(),
            ChunkSize::DEFAULT,
            kinds.len() as u64 * (1 << 20),
            &ChunkKey::local(),
        )
        .unwrap();
        path
    }

    #[test]
    fn a_paged_index_round_trips_its_page_cvs_and_refuses_a_wrong_count() {
        let dir = tempfile::tempdir().unwrap();
        let image = File::create(dir.path().join("img")).unwrap();
        let key = ChunkKey::local();
        let chunk: ChunkSize = "64K".parse().unwrap();
        let size = (64 << 10) * 2 + 5000; // a last chunk of a page and a short one
        let cv = |b: u8| [b; 32];
        let entries = [
            (ChunkKind::Data(key.chunk_id(b"a")), vec![cv(1); 16]),
            (ChunkKind::Zero, vec![]),
            (ChunkKind::Data(key.chunk_id(b"b")), vec![cv(2), cv(3)]),
        ];
        let path = dir.path().join("index/p.idx");
        let mut w = IndexWriter::create_paged(path.clone()).unwrap();
        let lens = [64 << 10, 64 << 10, 5000];
        assert!(
            w.push_paged(&entries[0].0, lens[0], &[cv(1)]).is_err(),
            "count"
        );
        for ((kind, pages), len) in entries.iter().zip(lens) {
            w.push_paged(kind, len, pages).unwrap();
        }
        w.commit(Identity::of(&image).unwrap(), chunk, size, &key)
            .unwrap();
        let open = || {
            IndexReader::open_valid(&path, Identity::of(&image).unwrap(), chunk, size, &key)
                .unwrap()
        };
        let mut r = open();
        assert!(r.has_pages());
        let mut pages = vec![cv(9)];
        for (kind, want) in &entries {
            assert_eq!(&r.next_with_pages(&mut pages).unwrap(), kind);
            assert_eq!(&pages, want);
        }
        assert!(r.next_with_pages(&mut pages).is_err());
        // Read without pages, they are skipped.
        let mut r = open();
        for (kind, _) in &entries {
            assert_eq!(&r.next_kind().unwrap(), kind);
        }
        assert!(r.next_kind().is_err());

        // A writer dropped before its commit (a failed copy) leaves nothing behind.
        let mut w = IndexWriter::create_paged(path.clone()).unwrap();
        w.push_paged(&entries[0].0, lens[0], &entries[0].1).unwrap();
        drop(w);
        assert_eq!(fs::read_dir(path.parent().unwrap()).unwrap().count(), 0);
    }

    #[test]
    fn round_trips_and_refuses_anything_stale_or_damaged() {
        let dir = tempfile::tempdir().unwrap();
        let image = File::create(dir.path().join("img")).unwrap();
        let key = ChunkKey::local();
        let kinds = [
            ChunkKind::Data(key.chunk_id(b"a")),
            ChunkKind::Zero,
            ChunkKind::Data(key.chunk_id(b"b")),
        ];
        let path = write(dir.path(), &image, &kinds);
        let id = Identity::of(&image).unwrap();
        let size = 3 << 20;
        let mut r = IndexReader::open_valid(&path, id, ChunkSize::DEFAULT, size, &key).unwrap();
        for k in &kinds {
            assert_eq!(&r.next_kind().unwrap(), k);
        }
        assert!(r.next_kind().is_err());

        assert!(
            IndexReader::open_valid(&path, id, "4M".parse().unwrap(), size, &key).is_none(),
            "chunk size"
        );
        assert!(
            IndexReader::open_valid(&path, id, ChunkSize::DEFAULT, size + 1, &key).is_none(),
            "volume size"
        );
        assert!(
            IndexReader::open_valid(
                &path,
                id,
                ChunkSize::DEFAULT,
                size,
                &ChunkKey::from_bytes([3; 32])
            )
            .is_none(),
            "key"
        );

        // Any write to the image changes its identity.
        std::thread::sleep(std::time::Duration::from_millis(10));
        (&image).write_all(b"x").unwrap();
        let changed = Identity::of(&image).unwrap();
        assert_ne!(changed, id);
        assert!(
            IndexReader::open_valid(&path, changed, ChunkSize::DEFAULT, size, &key).is_none(),
            "stale"
        );

        // A flipped bit in an entry is caught by the checksum.
        let mut bytes = fs::read(&path).unwrap();
        bytes[40] ^= 1;
        fs::write(&path, &bytes).unwrap();
        assert!(
            IndexReader::open_valid(&path, id, ChunkSize::DEFAULT, size, &key).is_none(),
            "damaged"
        );
    }
}
