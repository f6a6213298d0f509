//! The per-session state of the Transfer service: an open session on an export, the
//! registry of open sessions, and what a session opens with (the volume's summary) and
//! leaves behind (the saved chunk index and page hashes).

use super::{
    Export,
    cycles::CycleSession,
    live::LiveSummary,
    pages::PageIndex,
    service::{AgentService, blocking},
    session_writer::{Job, SessionWriter},
    status::{ServiceError, internal},
};
use chunker::{BlockVolume, ChunkId, ChunkKey, ChunkKind, ChunkSize, VolumeKind};
use mover_engine::copy::{
    Destination,
    index::{self, Identity, IndexReader, IndexWriter},
};
use std::{
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering::Relaxed},
    },
};

/// One open session.
pub(super) struct Session {
    pub(super) export: String,
    pub(super) relationship: String,
    pub(super) chunk: ChunkSize,
    pub(super) size: u64,
    pub(super) key: ChunkKey,
    pub(super) summary: Arc<LiveSummary>,
    /// READ sessions that read ranges only: `summary` is a placeholder, never served.
    pub(super) ranges_only: bool,
    /// For reading (READ) or writing (WRITE, through a duplicate of the destination's fd).
    pub(super) file: std::fs::File,
    pub(super) path: PathBuf,
    /// WRITE sessions: the destination, made visible on Finish.
    pub(super) dest: Mutex<Option<Destination>>,
    /// WRITE sessions: the one thread that applies every stream's frames, started by
    /// the first Write.
    pub(super) writer: Mutex<Option<SessionWriter>>,
    /// Set when a newer session on the export replaces this one: its writer drops the
    /// frames still queued instead of writing under the new session's feet.
    pub(super) superseded: Arc<std::sync::atomic::AtomicBool>,
    /// WRITE sessions on image files: the page hashes of the image, answered from and
    /// kept up to date by the writer, sealed on Finish.
    pub(super) pages: Option<Arc<PageIndex>>,
    /// WRITE sessions that are a replication cycle.
    pub(super) cycle: Option<CycleSession>,
    /// READ sessions of a replica at a held cycle: reads go through it.
    pub(super) hold: Option<Arc<crate::replicate::holds::Hold>>,
}

impl Session {
    /// A WRITE session that writes into the volume in place (a first sync, a resync, a
    /// copy) rather than into a cycle's journal. A journal busy committing is still one.
    pub(super) fn writes_in_place(&self) -> bool {
        self.dest.lock().expect("dest lock").is_some()
            && self
                .cycle
                .as_ref()
                .is_none_or(|c| c.journal.try_lock().is_ok_and(|j| j.is_none()))
    }
}

impl AgentService {
    /// The open session `id`.
    pub(super) fn session(&self, id: &str) -> Result<Arc<Session>, ServiceError> {
        self.sessions.lock().expect("sessions lock").get(id).cloned().ok_or_else(|| {
            ServiceError::Refused(transport::refusal::Refusal::NoSession, format!("no open session {id:?}: it finished, was replaced by a newer one, or the agent restarted; open a new one"))
        })
    }

    /// Ends the sessions open on `export` and waits until their writers have stopped:
    /// a frame they were applying must land before a new session compares the volume,
    /// or the new session could skip a page that the old write then changes.
    pub(super) async fn close_sessions_on(&self, export: &str) -> Result<(), ServiceError> {
        let closed: Vec<Arc<Session>> = {
            let mut sessions = self.sessions.lock().expect("sessions lock");
            let ids: Vec<String> = sessions
                .iter()
                // A reader of a held cycle reads through its hold, which later writes
                // do not change; one whose hold ended goes here.
                .filter(|(_, s)| s.export == export && s.hold.as_ref().is_none_or(|h| h.is_ended()))
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| sessions.remove(id)).collect()
        };
        self.metrics
            .sessions_active
            .fetch_sub(closed.len() as u64, Relaxed);
        for s in closed {
            s.superseded.store(true, Relaxed);
            let writer = s
                .writer
                .lock()
                .expect("writer lock")
                .as_ref()
                .map(|w| w.tx.clone());
            if let Some(tx) = writer {
                // Frames queued behind this are dropped: its answer means "stopped".
                let (done, stopped) = tokio::sync::oneshot::channel();
                if tx.send(Job::Flush(done)).await.is_ok() {
                    let wait = tokio::time::timeout(std::time::Duration::from_secs(60), stopped);
                    if wait.await.is_err() {
                        return Err(ServiceError::Unavailable(format!(
                            "the previous session on {export} is still writing; retry later"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

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

/// Chunk kinds from their wire form: 32 bytes each, all zeros for a zero chunk.
pub(super) fn kinds(ids: &[u8]) -> impl Iterator<Item = ChunkKind> + '_ {
    ids.chunks_exact(32).map(|b| {
        if b.iter().all(|&x| x == 0) {
            ChunkKind::Zero
        } else {
            ChunkKind::Data(ChunkId(b.try_into().expect("32 bytes")))
        }
    })
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

/// Byte range of chunk `c` in the session's volume.
pub(super) fn chunk_range(s: &Session, c: u64) -> Result<(u64, usize), ServiceError> {
    let off = c
        .checked_mul(s.chunk.get())
        .filter(|&o| o < s.size)
        .ok_or_else(|| {
            ServiceError::OutOfRange(format!(
                "chunk {c} is past the end of the volume ({} bytes)",
                s.size
            ))
        })?;
    Ok((off, (s.size - off).min(s.chunk.get()) as usize))
}
