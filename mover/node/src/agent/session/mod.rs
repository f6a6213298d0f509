//! The per-session state of the Transfer service: an open session on an export, the
//! registry of open sessions, and what a session opens with (the volume's summary) and
//! leaves behind (the saved chunk index and page hashes).

mod writer;

use super::{live::LiveSummary, pages::PageIndex, status::ServiceError};
use crate::replicate::secondary::CycleSession;
use chunker::{ChunkId, ChunkKey, ChunkKind, ChunkSize};
use mover_engine::copy::Destination;
use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
};
pub(super) use writer::{Job, SessionWriter};

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
