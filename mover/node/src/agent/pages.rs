//! The agent's saved page hashes of an image export.
//!
//! A delta push asks the agent for the hash of every 4 KiB page of the chunks that differ,
//! so that only changed pages travel. Reading those chunks to hash them is most of what
//! the agent reads in a delta (about 0.9 GB of a 3.5 GB volume in the bench). The agent
//! records the hash of every page a delta writes (hashed while the write is under way)
//! and of every page it had to read for a delta, and answers later sessions from this
//! record instead of from the volume.
//!
//! Trust follows the chunk index ([`mover_engine::copy::index`]): a saved record is used only if
//! it is sealed with the image's identity as it is now (any write since, by anyone,
//! changes its mtime and ctime), the volume size and the relationship's key. A writing
//! session takes the record over under a name of its own and seals it back when the
//! session finishes, so a session that dies leaves nothing anyone trusts. Within a
//! session a page's entry is cleared before its new data is written and set after, so an
//! entry is never older than its page.
//!
//! A new image's pages are not hashed as they are written: on a shared machine that
//! costs the copy a core. Once the copy is finished, [`PageIndex::fill`] reads the image
//! at idle priority and hashes them, so the next delta, which a replication runs minutes
//! or hours later, reads nothing.
//!
//! File layout (version 1): `PAGE_HASH_LEN` bytes per page (all zeros: not known), then
//! a trailer: identity (6 × 8), volume size (8), key fingerprint (32), magic (8).

use chunker::{ChunkKey, PAGE_HASH_LEN, PAGE_SIZE, page_hashes};
use mover_engine::copy::index::{self, Identity};
use rayon::prelude::*;
use std::{
    fs::{self, File},
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::atomic::{AtomicBool, Ordering::Relaxed},
};

const MAGIC: &[u8; 8] = b"MVPGS\0v1";
const TRAILER_LEN: usize = 48 + 8 + 32 + 8;
/// An entry never written: the page is read and hashed when asked for.
const UNKNOWN: [u8; PAGE_HASH_LEN] = [0; PAGE_HASH_LEN];

/// The page hashes of one image, while a writing session holds them.
pub(crate) struct PageIndex {
    file: File,
    /// Where the session keeps them, and where they are sealed to.
    work: PathBuf,
    saved: PathBuf,
    size: u64,
    key: ChunkKey,
    /// The hash of a page of zeros (written zero runs are known without hashing).
    zero_page: [u8; PAGE_HASH_LEN],
    /// An update failed or the record was sealed: it is neither answered from nor sealed.
    done: AtomicBool,
    /// Written pages are hashed (else they become unknown, and [`Self::fill`] hashes
    /// them once the copy is finished).
    hash_writes: bool,
}

/// Where the page hashes of the image whose chunk index is at `chunk_index` are saved.
fn saved_path(chunk_index: &Path) -> PathBuf {
    chunk_index.with_extension("pages")
}

impl PageIndex {
    /// Takes over the saved page hashes of the image `file` (chunk index at
    /// `chunk_index`) for the session `session`: kept if they are sealed for the image as
    /// it is now, `size` and `key`; else started with every page unknown. Leftovers of
    /// sessions that did not finish are removed. `hash_writes`: see [`Self::write`].
    pub(crate) fn take_over(
        chunk_index: &Path,
        session: &str,
        file: &File,
        size: u64,
        key: &ChunkKey,
        hash_writes: bool,
    ) -> io::Result<PageIndex> {
        let saved = saved_path(chunk_index);
        let dir = saved.parent().expect("index paths have a parent");
        fs::create_dir_all(dir)?;
        let stem = saved.file_name().expect("a file name").to_os_string();
        for e in fs::read_dir(dir)?.flatten() {
            let name = e.file_name();
            if name != stem && name.as_encoded_bytes().starts_with(stem.as_encoded_bytes()) {
                _ = fs::remove_file(e.path());
            }
        }
        let work = dir.join(format!("{}.{session}", stem.to_string_lossy()));
        let pages = size.div_ceil(PAGE_SIZE as u64);
        let len = pages * PAGE_HASH_LEN as u64;
        let kept = match fs::rename(&saved, &work) {
            Ok(()) => {
                let f = fs::OpenOptions::new().read(true).write(true).open(&work)?;
                let sealed = sealed_for(&f, len, Identity::of(file)?, size, key)?;
                sealed.then_some(f)
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        let file = match kept {
            Some(f) => f,
            None => {
                // New inode: a session this one replaced may still hold the old file.
                _ = fs::remove_file(&work);
                fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(&work)?
            }
        };
        // The trailer goes (a record under work is never trusted anyway) and the
        // entries stay; a new record is all unknown (a sparse file of zeros).
        file.set_len(len)?;
        let mut zero_page = Vec::with_capacity(PAGE_HASH_LEN);
        page_hashes(key, &[0; PAGE_SIZE], &mut zero_page);
        Ok(PageIndex {
            file,
            work,
            saved,
            size,
            key: key.clone(),
            zero_page: zero_page.try_into().expect("one page hash"),
            done: AtomicBool::new(false),
            hash_writes,
        })
    }

    /// The hashes of the `len` bytes at `offset` (whole pages), if every one is known.
    pub(crate) fn get(&self, offset: u64, len: usize) -> Option<Vec<u8>> {
        let (first, n) = self.pages_of(offset, len as u64)?;
        if self.done.load(Relaxed) {
            return None;
        }
        let mut out = vec![0; n * PAGE_HASH_LEN];
        let read = self
            .file
            .read_exact_at(&mut out, first * PAGE_HASH_LEN as u64);
        self.check(read)?;
        out.chunks(PAGE_HASH_LEN)
            .all(|h| h != UNKNOWN)
            .then_some(out)
    }

    /// Records `hashes` of the whole pages at `offset`, just read from the volume. Only
    /// for pages the session is not writing: a client asks for a group's page hashes
    /// before it sends the group, so they are read before anything is written there.
    pub(crate) fn learn(&self, offset: u64, hashes: &[u8]) {
        let len = (hashes.len() / PAGE_HASH_LEN * PAGE_SIZE) as u64;
        let len = len.min(self.size.saturating_sub(offset));
        if self.done.load(Relaxed) {
            return;
        }
        if let Some((first, n)) = self.pages_of(offset, len)
            && n * PAGE_HASH_LEN == hashes.len()
        {
            let set = self.file.write_all_at(hashes, first * PAGE_HASH_LEN as u64);
            self.check(set);
        }
    }

    /// Writes `data` at `offset` with `write`, and records its pages: cleared before,
    /// hashed while it is written (on other cores), set after. Without `hash_writes`
    /// (a whole new image, where hashing every page would cost the agent a core for the
    /// whole copy) they stay unknown until [`Self::fill`] hashes them.
    pub(crate) fn write(
        &self,
        offset: u64,
        data: &[u8],
        write: impl FnOnce() -> io::Result<()> + Send,
    ) -> io::Result<()> {
        let cleared = self.forget(offset, data.len() as u64);
        self.check(cleared);
        if !self.hash_writes {
            return write();
        }
        let (written, hashes) = rayon::join(write, || {
            let mut out = vec![0; data.len().div_ceil(PAGE_SIZE) * PAGE_HASH_LEN];
            const PIECE: usize = 64 * PAGE_SIZE;
            out.par_chunks_mut(PIECE / PAGE_SIZE * PAGE_HASH_LEN)
                .zip(data.par_chunks(PIECE))
                .for_each(|(out, piece)| {
                    let mut h = Vec::with_capacity(out.len());
                    page_hashes(&self.key, piece, &mut h);
                    out.copy_from_slice(&h);
                });
            out
        });
        written?;
        if let Some((first, _)) = self.pages_of(offset, data.len() as u64) {
            let set = self
                .file
                .write_all_at(&hashes, first * PAGE_HASH_LEN as u64);
            self.check(set);
        } // else not whole pages: they stay unknown
        Ok(())
    }

    /// Writes (or punches) `len` bytes of zeros at `offset` with `zero`, and records
    /// their pages.
    pub(crate) fn write_zeros<E>(
        &self,
        offset: u64,
        len: u64,
        zero: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        let cleared = self.forget(offset, len);
        self.check(cleared);
        zero()?;
        self.set_zeros(offset, len);
        Ok(())
    }

    /// Records the `len` bytes at `offset` as zeros (whole pages only).
    fn set_zeros(&self, offset: u64, len: u64) {
        let Some((first, n)) = self.pages_of(offset, len) else {
            return;
        };
        let mut hashes: Vec<u8> = (0..n).flat_map(|_| self.zero_page).collect();
        // The volume's last page may be short: its hash is of fewer zeros.
        let short = (offset + len) % PAGE_SIZE as u64;
        if offset + len == self.size && short != 0 {
            hashes.truncate((n - 1) * PAGE_HASH_LEN);
            page_hashes(&self.key, &[0; PAGE_SIZE][..short as usize], &mut hashes);
        }
        let set = self
            .file
            .write_all_at(&hashes, first * PAGE_HASH_LEN as u64);
        self.check(set);
    }

    /// Makes the pages of `[offset, offset + len)` unknown, partly covered ones too.
    fn forget(&self, offset: u64, len: u64) -> io::Result<()> {
        let first = offset / PAGE_SIZE as u64;
        let end = (offset + len)
            .div_ceil(PAGE_SIZE as u64)
            .min(self.size.div_ceil(PAGE_SIZE as u64));
        if end > first {
            let zeros = vec![0; (end - first) as usize * PAGE_HASH_LEN];
            self.file
                .write_all_at(&zeros, first * PAGE_HASH_LEN as u64)?;
        }
        Ok(())
    }

    /// A failed update ends the record: pages are then read and hashed, as without one.
    fn check<T>(&self, r: io::Result<T>) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                if !self.done.swap(true, Relaxed) {
                    tracing::warn!(record = %self.work.display(), "cannot update the page hashes ({e}); this session reads pages to hash them");
                }
                None
            }
        }
    }

    /// Whether written pages are hashed (else [`Self::fill`] hashes them afterwards).
    pub(crate) fn hashes_writes(&self) -> bool {
        self.hash_writes
    }

    /// Reads the image `image` (in the state `identity`, just finished) and hashes every
    /// page of its data chunks (`zero[i]`: chunk `i` of `chunk` bytes is known to be zeros,
    /// so it is not read), then seals the record. Gives up, leaving nothing trusted, if
    /// the image changes meanwhile or a writing session takes the export over.
    pub(crate) fn fill(
        &self,
        image: &File,
        identity: Identity,
        chunk: u64,
        zero: &[bool],
        taken_over: &AtomicBool,
    ) -> io::Result<()> {
        let mut buf = vec![0u8; chunk as usize];
        let mut hashes = Vec::with_capacity(buf.len() / PAGE_SIZE * PAGE_HASH_LEN);
        for (i, offset) in (0..self.size).step_by(chunk as usize).enumerate() {
            let len = chunk.min(self.size - offset) as usize;
            if zero.get(i).copied().unwrap_or(false) {
                self.set_zeros(offset, len as u64);
                continue;
            }
            let changed = i % 64 == 0 && Identity::of(image)? != identity;
            if changed || taken_over.load(Relaxed) || self.done.load(Relaxed) {
                self.done.store(true, Relaxed);
                return fs::remove_file(&self.work);
            }
            image.read_exact_at(&mut buf[..len], offset)?;
            hashes.clear();
            page_hashes(&self.key, &buf[..len], &mut hashes);
            self.learn(offset, &hashes);
        }
        self.seal(identity)
    }

    /// Seals the hashes for the image in the state `identity` (after the session's last
    /// write is durable) and puts them where the next session looks.
    pub(crate) fn seal(&self, identity: Identity) -> io::Result<()> {
        if self.done.swap(true, Relaxed) {
            return fs::remove_file(&self.work);
        }
        let len = self.size.div_ceil(PAGE_SIZE as u64) * PAGE_HASH_LEN as u64;
        self.file
            .write_all_at(&trailer(identity, self.size, &self.key), len)?;
        chunker::durable::publish(&self.file, &self.work, &self.saved)
    }

    /// The first page and the count of `[offset, offset + len)` when that range is whole
    /// pages (the last one may end the volume).
    fn pages_of(&self, offset: u64, len: u64) -> Option<(u64, usize)> {
        let page = PAGE_SIZE as u64;
        let end = offset.checked_add(len)?;
        let whole = offset.is_multiple_of(page) && (end % page == 0 || end == self.size);
        (whole && end <= self.size && len > 0)
            .then(|| (offset / page, (end.div_ceil(page) - offset / page) as usize))
    }
}

/// Puts the calling thread at the idle I/O class and the lowest CPU priority, so that a
/// background fill yields to transfers.
#[allow(unsafe_code)] // ioprio_set has no wrapper in libc or rustix; see SAFETY.
pub(crate) fn lower_priority() {
    const IOPRIO_WHO_PROCESS: libc::c_int = 1;
    const IOPRIO_CLASS_IDLE: libc::c_int = 3;
    // SAFETY: both calls take plain integers and touch no memory of ours; `0` names the
    // calling thread. A failure only leaves the priority as it was.
    unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            0,
            IOPRIO_CLASS_IDLE << 13,
        );
        libc::setpriority(libc::PRIO_PROCESS, 0, 19);
    }
}

fn trailer(identity: Identity, size: u64, key: &ChunkKey) -> Vec<u8> {
    let mut t = Vec::with_capacity(TRAILER_LEN);
    for w in identity.words() {
        t.extend_from_slice(&w.to_le_bytes());
    }
    t.extend_from_slice(&size.to_le_bytes());
    t.extend_from_slice(&index::key_fingerprint(key));
    t.extend_from_slice(MAGIC);
    t
}

/// Whether `f` holds `len` bytes of entries sealed for this image state, size and key.
fn sealed_for(
    f: &File,
    len: u64,
    identity: Identity,
    size: u64,
    key: &ChunkKey,
) -> io::Result<bool> {
    if f.metadata()?.len() != len + TRAILER_LEN as u64 {
        return Ok(false);
    }
    let mut t = vec![0; TRAILER_LEN];
    f.read_exact_at(&mut t, len)?;
    Ok(t == trailer(identity, size, key))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(dir: &Path, len: u64) -> File {
        let f = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.join("img"))
            .unwrap();
        f.set_len(len).unwrap();
        f
    }

    #[test]
    fn written_pages_are_known_after_sealing_and_only_for_that_image_state() {
        let dir = tempfile::tempdir().unwrap();
        let idx = dir.path().join("index/x.idx");
        let size = 5 * PAGE_SIZE as u64 + 100; // a short last page
        let img = image(dir.path(), size);
        let key = ChunkKey::local();
        let data: Vec<u8> = (0..size).map(|i| (i * 7 % 251) as u8).collect();
        let mut want = Vec::new();
        page_hashes(&key, &data, &mut want);

        let p = PageIndex::take_over(&idx, "s1", &img, size, &key, true).unwrap();
        assert_eq!(p.get(0, size as usize), None, "all unknown at first");
        let split = 3 * PAGE_SIZE;
        p.write(0, &data[..split], || img.write_all_at(&data[..split], 0))
            .unwrap();
        let rest = &data[split..];
        p.write(split as u64, rest, || img.write_all_at(rest, split as u64))
            .unwrap();
        assert_eq!(p.get(0, size as usize).unwrap(), want);
        // Hashes of a read are kept too.
        p.write(0, &data, || Ok(())).unwrap();
        p.forget(0, size).unwrap();
        p.learn(0, &want);
        assert_eq!(p.get(0, size as usize).unwrap(), want);
        // Not whole pages: never answered, and a write there makes its pages unknown.
        assert_eq!(p.get(10, 4096), None);
        p.write(10, b"ab", || img.write_all_at(b"ab", 10)).unwrap();
        assert_eq!(p.get(0, 4096), None);
        p.write(0, &data[..4096], || img.write_all_at(&data[..4096], 0))
            .unwrap();
        p.seal(Identity::of(&img).unwrap()).unwrap();

        // The next session sees them; a different key or size does not.
        let p = PageIndex::take_over(&idx, "s2", &img, size, &key, true).unwrap();
        assert_eq!(
            p.get(PAGE_SIZE as u64, 2 * PAGE_SIZE).unwrap(),
            want[PAGE_HASH_LEN..3 * PAGE_HASH_LEN]
        );
        p.seal(Identity::of(&img).unwrap()).unwrap();
        let other = ChunkKey::from_bytes([7; 32]);
        let p = PageIndex::take_over(&idx, "s3", &img, size, &other, true).unwrap();
        assert_eq!(p.get(0, size as usize), None, "another key");
        drop(p);

        // A session that never seals leaves nothing trusted.
        let p = PageIndex::take_over(&idx, "s4", &img, size, &key, true).unwrap();
        assert_eq!(p.get(0, size as usize), None, "s3 did not seal");
        p.write(0, &data, || Ok(())).unwrap();
        p.seal(Identity::of(&img).unwrap()).unwrap();
        let p = PageIndex::take_over(&idx, "s5", &img, size, &key, true).unwrap();
        assert!(p.get(0, size as usize).is_some());
        drop(p);
        let p = PageIndex::take_over(&idx, "s6", &img, size, &key, true).unwrap();
        assert_eq!(p.get(0, size as usize), None, "s5 died unsealed");
        p.write(0, &data, || Ok(())).unwrap();
        p.seal(Identity::of(&img).unwrap()).unwrap();

        // Written behind the agent's back: the image's identity moved on.
        std::thread::sleep(std::time::Duration::from_millis(10));
        img.write_all_at(b"x", 0).unwrap();
        let p = PageIndex::take_over(&idx, "s7", &img, size, &key, true).unwrap();
        assert_eq!(p.get(0, size as usize), None, "stale");
        // Zero runs are known without reading, the short last page included.
        p.write_zeros(0, size, || Ok::<(), io::Error>(())).unwrap();
        let mut zeros = Vec::new();
        page_hashes(&key, &vec![0; size as usize], &mut zeros);
        assert_eq!(p.get(0, size as usize).unwrap(), zeros);
        let left = fs::read_dir(dir.path().join("index")).unwrap().count();
        assert_eq!(left, 1, "only the live session's record is left");
        p.seal(Identity::of(&img).unwrap()).unwrap();

        // A new image's writes are not hashed: its pages stay unknown until filled in.
        let p = PageIndex::take_over(&idx, "s8", &img, size, &key, false).unwrap();
        p.write(0, &data, || img.write_all_at(&data, 0)).unwrap();
        assert_eq!(p.get(0, size as usize), None);
        let stop = AtomicBool::new(false);
        let id = Identity::of(&img).unwrap();
        p.fill(&img, id, 2 * PAGE_SIZE as u64, &[], &stop).unwrap();
        let p = PageIndex::take_over(&idx, "s9", &img, size, &key, false).unwrap();
        assert_eq!(p.get(0, size as usize).unwrap(), want, "filled and sealed");

        // A chunk marked zero is not read; a change meanwhile leaves nothing sealed.
        let chunk = 2 * PAGE_SIZE as u64;
        img.write_all_at(&vec![0; chunk as usize], 0).unwrap();
        let id = Identity::of(&img).unwrap();
        p.fill(&img, id, chunk, &[true], &stop).unwrap();
        let p = PageIndex::take_over(&idx, "s10", &img, size, &key, false).unwrap();
        assert_eq!(
            p.get(0, chunk as usize).unwrap(),
            zeros[..2 * PAGE_HASH_LEN]
        );
        let id = Identity::of(&img).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
        img.write_all_at(b"y", 0).unwrap();
        p.fill(&img, id, chunk, &[], &stop).unwrap();
        let p = PageIndex::take_over(&idx, "s11", &img, size, &key, false).unwrap();
        assert_eq!(p.get(0, size as usize), None, "changed while filled");
    }
}
