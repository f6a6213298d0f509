//! The saved chunk index of a destination image.
//!
//! After a copy onto an image file, the source's chunk ids are saved with the image's
//! identity (device, inode, size, mtime, ctime as of the end of the copy). The next copy
//! onto the same, untouched image compares the new source's chunk ids with the saved ones
//! and reads from the destination only the chunks that changed, instead of all of it
//! (shared/DESIGN.md §1: "a local destination is hashed, or its saved index is read").
//!
//! Any change to the image (a write updates mtime and ctime; ctime cannot be set back)
//! invalidates the index, and so does a damaged index file (whole-file checksum, checked
//! before any entry is used). Block devices get no index: their writes leave no trace.
//!
//! File layout (version 1): one 32-byte entry per chunk (all zeros for a zero chunk),
//! then a fixed trailer: identity, chunk size, volume size, entry count, key
//! fingerprint, the BLAKE3 of everything before it, and the magic.

use chunker::{ChunkId, ChunkKey, ChunkKind, ChunkSize};
use std::{
    fs::{self, File},
    io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

const MAGIC: &[u8; 8] = b"MVIDX\0v1";
/// identity (6 × 8) + chunk + volume + count (3 × 8) + key fingerprint (32) + checksum (32) + magic (8)
const TRAILER_LEN: usize = 48 + 24 + 32 + 32 + 8;

/// What identifies an image's exact state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Identity([i64; 6]);

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
pub(crate) fn index_path(state_dir: &Path, dst: &Path) -> PathBuf {
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

/// The state file in `state_dir/kind/` for the destination at the absolute path `abs`:
/// named by a hash of the path, so any path gives a short, safe name.
pub(crate) fn state_file(state_dir: &Path, kind: &str, abs: &Path, ext: &str) -> PathBuf {
    let name = blake3::hash(abs.as_os_str().as_encoded_bytes()).to_hex();
    state_dir.join(kind).join(format!("{}.{ext}", &name[..32]))
}

pub(crate) fn key_fingerprint(key: &ChunkKey) -> [u8; 32] {
    *blake3::keyed_hash(key.as_bytes(), b"mover index key fingerprint").as_bytes()
}

/// Reads a saved index entry by entry, in chunk order.
pub(crate) struct IndexReader {
    entries: BufReader<File>,
    remaining: u64,
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
        let fingerprint = &t[72..104];
        let checksum = &t[104..136];
        let ok = &t[136..144] == MAGIC
            && saved == identity
            && saved_chunk == chunk.get()
            && saved_size == size
            && count == size.div_ceil(chunk.get())
            && fingerprint == key_fingerprint(key)
            && len == count * 32 + TRAILER_LEN as u64;
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
            entries: BufReader::with_capacity(1 << 16, f),
            remaining: count,
        })
    }

    /// The saved kind of the next chunk.
    pub fn next(&mut self) -> std::io::Result<ChunkKind> {
        if self.remaining == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "index has fewer entries than chunks",
            ));
        }
        self.remaining -= 1;
        let mut e = [0u8; 32];
        self.entries.read_exact(&mut e)?;
        Ok(if e == [0; 32] {
            ChunkKind::Zero
        } else {
            ChunkKind::Data(ChunkId(e))
        })
    }
}

/// Writes a new index while a copy runs; it becomes valid only on [`IndexWriter::commit`].
pub(crate) struct IndexWriter {
    out: BufWriter<File>,
    hasher: blake3::Hasher,
    tmp: PathBuf,
    path: PathBuf,
    count: u64,
}

impl IndexWriter {
    /// Removes any index at `path` (the destination is about to change) and starts a new one.
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
            tmp,
            path,
            count: 0,
        })
    }

    /// Appends the next chunk's kind.
    pub fn push(&mut self, kind: &ChunkKind) -> std::io::Result<()> {
        let e = match kind {
            ChunkKind::Zero => [0u8; 32],
            ChunkKind::Data(id) => id.0,
        };
        self.hasher.update(&e);
        self.count += 1;
        self.out.write_all(&e)
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
        for w in [chunk.get(), size, self.count] {
            t.extend_from_slice(&w.to_le_bytes());
        }
        t.extend_from_slice(&key_fingerprint(key));
        self.hasher.update(&t);
        t.extend_from_slice(self.hasher.finalize().as_bytes());
        t.extend_from_slice(MAGIC);
        self.out.write_all(&t)?;
        let f = self.out.into_inner().map_err(|e| e.into_error())?;
        publish(&f, &self.tmp, &self.path)
    }
}

/// Makes the state record `file`, written at `tmp`, durable and puts it at `path` (in
/// the same directory), durably too.
pub(crate) fn publish(file: &File, tmp: &Path, path: &Path) -> std::io::Result<()> {
    file.sync_all()?;
    fs::rename(tmp, path)?;
    File::open(path.parent().expect("index paths have a parent"))?.sync_all()
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
            assert_eq!(&r.next().unwrap(), k);
        }
        assert!(r.next().is_err());

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
