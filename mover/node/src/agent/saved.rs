//! What a session opens with and leaves behind: the volume's summary (from a valid
//! saved index, or hashed in the background), its saved chunk index and page hashes.

use super::{
    Export,
    live::LiveSummary,
    pages::PageIndex,
    session::{Session, kinds},
    status::{ServiceError, internal},
};
use chunker::{BlockVolume, ChunkKind, ChunkSize, VolumeKind};
use mover_engine::copy::index;
use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering::Relaxed},
};

use super::service::{AgentService, blocking};
use chunker::ChunkKey;
use mover_engine::copy::{
    Destination,
    index::{Identity, IndexReader, IndexWriter},
};

impl AgentService {
    /// The summary of the volume a session opens: known at once for a new image or from a
    /// valid saved index, else hashed in the background; and whether the index gave it.
    pub(super) fn summary_of(
        &self,
        export: &Export,
        dest: Option<&Destination>,
        key: &ChunkKey,
        chunk: ChunkSize,
        size: u64,
    ) -> Result<(Arc<LiveSummary>, bool), ServiceError> {
        if dest.is_some_and(|d| d.fresh) {
            return Ok((LiveSummary::of_zeros(key.clone(), chunk, size), false));
        }
        let volume = match dest {
            Some(d) => BlockVolume::open(d.volume.path()),
            None => BlockVolume::open(&export.path),
        }
        .map_err(internal)?
        .limited_to_at_most(size);
        let index_path = index::index_path(self.state_dir(), &export.path);
        let in_place = dest.is_none_or(|d| d.partial.is_none());
        if volume.kind() == VolumeKind::ImageFile && in_place {
            let saved = Identity::of(volume.file())
                .ok()
                .and_then(|id| IndexReader::open_valid(&index_path, id, chunk, size, key));
            if let Some(mut saved) = saved {
                let n = size.div_ceil(chunk.get());
                let kinds: std::io::Result<Vec<ChunkKind>> =
                    (0..n).map(|_| saved.next_kind()).collect();
                if let Ok(kinds) = kinds {
                    self.metrics.indexed_opens.fetch_add(1, Relaxed);
                    if dest.is_some() {
                        // The volume is about to change: the index will not describe it.
                        remove_index(&index_path)?;
                    }
                    return Ok((LiveSummary::of_kinds(key.clone(), chunk, size, kinds), true));
                }
            }
        }
        if dest.is_some() {
            remove_index(&index_path)?;
        }
        Ok((
            LiveSummary::hash_in_background(volume, key.clone(), chunk),
            false,
        ))
    }

    /// Seals the session's page hashes for `file` as it is now; for a new image, first
    /// hashes its pages (those of the chunks `zero` does not mark) on a thread of its own.
    pub(super) fn save_pages(
        &self,
        s: &Session,
        pages: Arc<PageIndex>,
        file: std::fs::File,
        zero: Option<Vec<bool>>,
    ) {
        let export = s.export.clone();
        let identity = match Identity::of(&file) {
            Ok(id) => id,
            Err(e) => {
                tracing::warn!(%export, "cannot save the page hashes ({e}); the next delta reads pages to hash them");
                return;
            }
        };
        if pages.hashes_writes() {
            if let Err(e) = blocking(|| pages.seal(identity)) {
                tracing::warn!(%export, "cannot save the page hashes ({e}); the next delta reads pages to hash them");
            }
            return;
        }
        let stop = Arc::new(AtomicBool::new(false));
        self.filling
            .lock()
            .expect("filling lock")
            .insert(export.clone(), stop.clone());
        let (metrics, filling) = (self.metrics.clone(), self.filling.clone());
        let chunk = s.chunk.get();
        metrics.pages_filling.fetch_add(1, Relaxed);
        std::thread::spawn(move || {
            super::pages::lower_priority();
            let zero = zero.unwrap_or_default();
            if let Err(e) = pages.fill(&file, identity, chunk, &zero, &stop) {
                tracing::warn!(%export, "cannot hash the pages of the new image ({e}); the next delta reads them");
            }
            let mut filling = filling.lock().expect("filling lock");
            if filling.get(&export).is_some_and(|f| Arc::ptr_eq(f, &stop)) {
                filling.remove(&export);
            }
            metrics.pages_filling.fetch_sub(1, Relaxed);
        });
    }

    /// Saves `ids` (32 bytes per chunk, zeros for a zero chunk) as the index of the
    /// session's export, sealed with the identity of `file` as it is now.
    pub(super) fn save_index(
        &self,
        s: &Session,
        file: &std::fs::File,
        ids: &[u8],
    ) -> std::io::Result<()> {
        let mut w = IndexWriter::create(index::index_path(self.state_dir(), &s.path))?;
        for k in kinds(ids) {
            w.push(&k)?;
        }
        w.commit(Identity::of(file)?, s.chunk, s.size, &s.key)
    }
}

/// Removes a saved index that is about to go stale.
fn remove_index(path: &std::path::Path) -> Result<(), ServiceError> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(internal(format!(
            "cannot remove the stale chunk index {}: {e}",
            path.display()
        ))),
        _ => Ok(()),
    }
}
