//! The Transfer service: sessions on exported volumes.

use super::{
    Export,
    cycles::{CycleSession, CycleTarget},
    fencing::{EpochStore, StaleEpochOrIo},
    journal::{self, Journal},
    live::LiveSummary,
    metrics::Metrics,
    pages::PageIndex,
};
use crate::copy::{
    CopyOptions, Destination, Origin, finish_destination,
    index::{self, Identity, IndexReader, IndexWriter},
    prepare_destination, read_back_root, zero_range,
};
use chunker::{
    BlockVolume, ChunkId, ChunkKey, ChunkKind, ChunkSize, PAGE_HASH_LEN, PAGE_SIZE, VolumeKind,
    direct::DirectWriter, page_hashes,
};
use std::{
    collections::HashMap,
    os::unix::fs::FileExt,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use transport::{
    frames::{self, Content},
    proto::{self, Access, transfer_server::Transfer},
};

/// Bytes written between two fsyncs of a destination: what may have to be re-sent after
/// a crash of the receiving machine (a killed process loses nothing: its writes are in
/// the page cache).
const SYNC_EVERY: u64 = 256 << 20;

/// An agent's Transfer service.
pub struct AgentService {
    pub(super) exports: super::Exports,
    state_dir: PathBuf,
    pub(super) epochs: EpochStore,
    /// Replication relationships known here (primary or secondary side).
    pub(super) store: Arc<crate::replicate::Store>,
    pub(super) metrics: Arc<Metrics>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    next_id: AtomicU64,
    /// File-tree exports being pushed into (one writer each).
    pub(super) trees_busy: Arc<Mutex<std::collections::HashSet<String>>>,
    /// Image exports whose page hashes are being filled in after a full copy: set to
    /// stop the fill when a writer opens the export.
    filling: Arc<Mutex<HashMap<String, Arc<AtomicBool>>>>,
    /// Exports being hydrated are incomplete: no peer reads or writes them meanwhile.
    pub(super) hydrations: std::sync::OnceLock<Arc<crate::hydrate::Hydrations>>,
}

/// One open session.
struct Session {
    export: String,
    relationship: String,
    chunk: ChunkSize,
    size: u64,
    key: ChunkKey,
    summary: Arc<LiveSummary>,
    /// READ sessions that read ranges only: `summary` is a placeholder, never served.
    ranges_only: bool,
    /// For reading (READ) or writing (WRITE, through a duplicate of the destination's fd).
    file: std::fs::File,
    path: PathBuf,
    /// WRITE sessions: the destination, made visible on Finish.
    dest: Mutex<Option<Destination>>,
    /// WRITE sessions: the one thread that applies every stream's frames, started by
    /// the first Write.
    writer: Mutex<Option<SessionWriter>>,
    /// Set when a newer session on the export replaces this one: its writer drops the
    /// frames still queued instead of writing under the new session's feet.
    superseded: Arc<std::sync::atomic::AtomicBool>,
    /// WRITE sessions on image files: the page hashes of the image, answered from and
    /// kept up to date by the writer, sealed on Finish.
    pages: Option<Arc<PageIndex>>,
    /// WRITE sessions that are a replication cycle.
    cycle: Option<CycleSession>,
}

impl AgentService {
    /// A service for `exports`, keeping state under `state_dir`.
    pub fn new(
        exports: super::Exports,
        state_dir: PathBuf,
        metrics: Arc<Metrics>,
        store: Arc<crate::replicate::Store>,
    ) -> std::io::Result<Self> {
        Ok(AgentService {
            exports,
            epochs: EpochStore::new(&state_dir)?,
            store,
            state_dir,
            metrics,
            sessions: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            trees_busy: Arc::default(),
            filling: Arc::default(),
            hydrations: std::sync::OnceLock::new(),
        })
    }

    /// Where this agent keeps its state.
    pub(super) fn state_dir(&self) -> &std::path::Path {
        &self.state_dir
    }

    pub(super) fn refuse(&self, status: Status) -> Status {
        self.metrics.refusals.fetch_add(1, Relaxed);
        status
    }

    fn session(&self, id: &str) -> Result<Arc<Session>, Status> {
        self.sessions.lock().expect("sessions lock").get(id).cloned().ok_or_else(|| {
            Status::not_found(format!("no open session {id:?}: it finished, was replaced by a newer one, or the agent restarted; open a new one"))
        })
    }

    /// The export `name`, or a refusal that lists what is exported.
    pub(super) fn export(&self, name: &str) -> Result<Export, Status> {
        let export = self.exports.get(name).map_err(|e| {
            self.refuse(match e {
                super::ExportError::Unknown { .. } => Status::not_found(e.to_string()),
                _ => Status::failed_precondition(e.to_string()),
            })
        })?;
        if let Some(h) = self.hydrations.get().and_then(|hs| hs.get(name))
            && h.progress().phase != crate::hydrate::Phase::Complete
        {
            return Err(self.refuse(Status::failed_precondition(format!(
                "volume {name:?} is being hydrated from {} and is incomplete; it is served over NBD only until `mover hydrate wait` returns",
                h.source()
            ))));
        }
        Ok(export)
    }

    /// Refuses a read-only export as a destination.
    pub(super) fn check_writable(&self, name: &str, export: &Export) -> Result<(), Status> {
        if export.read_only {
            return Err(self.refuse(Status::permission_denied(format!(
                "volume {name:?} is exported read-only; it can be a source, never a destination"
            ))));
        }
        Ok(())
    }

    pub(super) fn check_epoch(&self, relationship: &str, epoch: u64) -> Result<(), Status> {
        match self.epochs.admit(relationship, epoch) {
            Ok(()) => Ok(()),
            Err(StaleEpochOrIo::Stale(e)) => {
                self.metrics.stale_epoch_refusals.fetch_add(1, Relaxed);
                Err(Status::failed_precondition(e.to_string()))
            }
            Err(e @ StaleEpochOrIo::Io(_)) => Err(Status::internal(e.to_string())),
        }
    }

    /// Ends the sessions open on `export` and waits until their writers have stopped:
    /// a frame they were applying must land before a new session compares the volume,
    /// or the new session could skip a page that the old write then changes.
    pub(super) async fn close_sessions_on(&self, export: &str) -> Result<(), Status> {
        let closed: Vec<Arc<Session>> = {
            let mut sessions = self.sessions.lock().expect("sessions lock");
            let ids: Vec<String> = sessions
                .iter()
                .filter(|(_, s)| s.export == export)
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
                        return Err(Status::unavailable(format!(
                            "the previous session on {export} is still writing; retry later"
                        )));
                    }
                }
            }
        }
        Ok(())
    }
}

/// An agent-side failure the client cannot fix.
pub(super) fn internal(e: impl std::fmt::Display) -> Status {
    Status::internal(e.to_string())
}

/// Runs blocking volume I/O without stalling the async workers.
pub(super) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

#[tonic::async_trait]
impl Transfer for AgentService {
    async fn open(
        &self,
        req: Request<proto::OpenRequest>,
    ) -> Result<Response<proto::OpenResponse>, Status> {
        let peer = req
            .remote_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|| "a peer".into());
        let r = req.into_inner();
        let export = self.export(&r.volume)?;
        let chunk = ChunkSize::new(r.chunk_size)
            .map_err(|e| self.refuse(Status::invalid_argument(e.to_string())))?;
        if r.relationship.is_empty() {
            return Err(self.refuse(Status::invalid_argument("a relationship id is required")));
        }
        let access = Access::try_from(r.access).unwrap_or(Access::Unspecified);
        let key = transport::relationship_key(&r.relationship);
        let mut known_before = false;
        let (file, size, dest) = match access {
            Access::Read => {
                let v = blocking(|| BlockVolume::open(&export.path)).map_err(internal)?;
                let size = v.size();
                (v.into_file(), size, None)
            }
            Access::Write => {
                self.check_writable(&r.volume, &export)?;
                self.check_epoch(&r.relationship, r.epoch)?;
                if let Some(c) = &r.cycle {
                    let target = CycleTarget {
                        relationship: &r.relationship,
                        volume: &r.volume,
                        epoch: r.epoch,
                        chunk_size: r.chunk_size,
                    };
                    known_before = self.admit_cycle(&target, c)?;
                }
                // One writer per export: a newer session takes over from an abandoned one.
                self.close_sessions_on(&r.volume).await?;
                if let Some(fill) = self.filling.lock().expect("filling lock").remove(&r.volume) {
                    fill.store(true, Relaxed);
                }
                // A committed cycle not yet applied (its apply failed) is applied first,
                // so the summary the primary compares against includes it.
                if r.cycle.is_some() {
                    let dir = journal::cycles_dir(&self.state_dir, &r.relationship);
                    if dir.join("commit.json").exists() {
                        blocking(|| journal::apply(&dir)).map_err(internal)?;
                    }
                }
                let opts = CopyOptions {
                    state_dir: Some(self.state_dir.clone()),
                    ..Default::default()
                };
                let origin_name = PathBuf::from(format!("agent session from {peer}"));
                let origin = Origin {
                    size: r.source_size,
                    volume: None,
                    name: &origin_name,
                };
                let dest = blocking(|| prepare_destination(origin, &export.path, &opts))
                    .map_err(|e| self.refuse(Status::failed_precondition(e.to_string())))?;
                let file = dest.volume.file().try_clone().map_err(internal)?;
                (file, r.source_size, Some(dest))
            }
            Access::Unspecified => {
                return Err(self.refuse(Status::invalid_argument("access must be READ or WRITE")));
            }
        };
        let (summary, indexed) = if r.ranges_only && access == Access::Read {
            // Never asked for (Tree refuses): no hashing of the volume.
            (LiveSummary::unserved(key.clone(), chunk, size), false)
        } else {
            blocking(|| self.summary_of(&export, dest.as_ref(), &key, chunk, size))?
        };
        let id = format!("{}-{}", r.volume, self.next_id.fetch_add(1, Relaxed));
        let cycle = match (&r.cycle, &dest) {
            (Some(c), Some(d)) => {
                let dir = journal::cycles_dir(&self.state_dir, &r.relationship);
                // A volume that held a cycle (or a former primary's data) changes
                // atomically; a first sync or a new image is complete only at the end.
                let staged = known_before && d.partial.is_none() && !d.fresh;
                let j = if staged {
                    Some(blocking(|| Journal::create(&dir)).map_err(internal)?)
                } else {
                    None
                };
                Some(CycleSession {
                    cycle: c.clone(),
                    relationship: r.relationship.clone(),
                    epoch: r.epoch,
                    dir,
                    journal: Arc::new(Mutex::new(j)),
                })
            }
            _ => None,
        };
        // The last applied cycle is vouched for only while the volume is untouched since
        // (its saved index still valid): the primary then trusts it without comparing.
        let applied = cycle
            .as_ref()
            .filter(|_| indexed)
            .and_then(|_| self.applied_cycle(&r.relationship));
        let pages = dest
            .as_ref()
            .filter(|d| d.volume.kind() == VolumeKind::ImageFile && cycle.is_none())
            .and_then(|d| {
                let chunk_index = index::index_path(&self.state_dir, &export.path);
                let file = d.volume.file();
                blocking(|| PageIndex::take_over(&chunk_index, &id, file, size, &key, !d.fresh))
                    .inspect_err(|e| tracing::warn!(export = %r.volume, "cannot keep page hashes ({e}); deltas read pages to hash them"))
                    .ok()
                    .map(Arc::new)
            });
        let response = proto::OpenResponse {
            session: id.clone(),
            size,
            chunks: summary.chunks(),
            root: summary
                .root_now()
                .map(|r| r.0.to_vec())
                .unwrap_or_default()
                .into(),
            group: chunker::GROUP_CHUNKS as u32,
            applied,
        };
        let session = Session {
            export: r.volume.clone(),
            relationship: r.relationship,
            chunk,
            size,
            key,
            summary,
            ranges_only: r.ranges_only,
            file,
            path: export.path.clone(),
            dest: Mutex::new(dest),
            writer: Mutex::new(None),
            superseded: Arc::default(),
            pages,
            cycle,
        };
        self.sessions
            .lock()
            .expect("sessions lock")
            .insert(id, Arc::new(session));
        self.metrics.sessions_opened.fetch_add(1, Relaxed);
        self.metrics.sessions_active.fetch_add(1, Relaxed);
        Ok(Response::new(response))
    }

    async fn tree(
        &self,
        req: Request<proto::TreeRequest>,
    ) -> Result<Response<proto::TreeResponse>, Status> {
        let r = req.into_inner();
        let s = self.session(&r.session)?;
        if s.ranges_only {
            return Err(Status::failed_precondition(
                "this session was opened to read ranges only: it has no summary",
            ));
        }
        // Waits while the background hashing has not reached what is asked.
        let level = match r.level {
            0 => s.summary.leaves(r.first, r.count).await,
            1 => s.summary.groups(r.first, r.count).await,
            _ => {
                return Err(Status::invalid_argument(
                    "tree level must be 0 (chunks) or 1 (groups)",
                ));
            }
        }
        .map_err(Status::internal)?;
        let hashes: Vec<u8> = level.iter().flat_map(|h| h.0).collect();
        Ok(Response::new(proto::TreeResponse {
            hashes: hashes.into(),
        }))
    }

    async fn pages(
        &self,
        req: Request<proto::PagesRequest>,
    ) -> Result<Response<proto::PagesResponse>, Status> {
        let r = req.into_inner();
        let s = self.session(&r.session)?;
        let mut out =
            Vec::with_capacity(r.chunks.len() * s.chunk.bytes() / PAGE_SIZE * PAGE_HASH_LEN);
        // Known from the writes of earlier sessions, or read and hashed.
        let mut answers = Vec::with_capacity(r.chunks.len());
        for &c in &r.chunks {
            let (off, len) = chunk_range(&s, c)?;
            let known = s.pages.as_ref().and_then(|p| blocking(|| p.get(off, len)));
            answers.push((off, len, known));
        }
        // The chunks to read are asked of the disk at once, so it reads them together
        // while the first ones are hashed (one at a time they would wait on each other).
        for (off, len, _) in answers.iter().filter(|a| a.2.is_none()) {
            let len = std::num::NonZeroU64::new(*len as u64);
            _ = rustix::fs::fadvise(&s.file, *off, len, rustix::fs::Advice::WillNeed);
        }
        let mut buf = vec![0u8; s.chunk.bytes()];
        for (off, len, known) in answers {
            match known {
                Some(hashes) => {
                    out.extend_from_slice(&hashes);
                    self.metrics
                        .pages_known
                        .fetch_add(len.div_ceil(PAGE_SIZE) as u64, Relaxed);
                }
                None => {
                    blocking(|| s.file.read_exact_at(&mut buf[..len], off)).map_err(internal)?;
                    let at = out.len();
                    page_hashes(&s.key, &buf[..len], &mut out);
                    if let Some(p) = &s.pages {
                        blocking(|| p.learn(off, &out[at..]));
                    }
                    self.metrics.pages_read_bytes.fetch_add(len as u64, Relaxed);
                }
            }
        }
        Ok(Response::new(proto::PagesResponse { hashes: out.into() }))
    }

    async fn write(
        &self,
        req: Request<Streaming<proto::WriteFrame>>,
    ) -> Result<Response<proto::WriteAck>, Status> {
        let mut stream = req.into_inner();
        let mut session: Option<Arc<Session>> = None;
        // Frames go to the session's writer thread, so the async workers only move bytes
        // off the network and one thread writes the file (parallel buffered writes to one
        // file contend for its inode lock).
        let mut writer: Option<tokio::sync::mpsc::Sender<Job>> = None;
        let mut sent = 0u64;
        while let Some(frame) = stream.next().await {
            let frame = frame?;
            let s = match &session {
                Some(s) => s.clone(),
                None => {
                    let s = self.session(&frame.session)?;
                    if s.dest.lock().expect("dest lock").is_none() {
                        return Err(self.refuse(Status::failed_precondition(
                            "this session was opened for reading",
                        )));
                    }
                    session.insert(s).clone()
                }
            };
            // Checked on every frame: a newer primary may have raised the epoch meanwhile.
            self.check_epoch(&s.relationship, frame.epoch)?;
            let data = frame
                .frame
                .ok_or_else(|| Status::invalid_argument("write frame without data"))?;
            if data
                .offset
                .checked_add(data.len)
                .is_none_or(|end| end > s.size)
            {
                return Err(self.refuse(Status::out_of_range(format!(
                    "write of {} bytes at offset {} is past the end of the volume ({} bytes)",
                    data.len, data.offset, s.size
                ))));
            }
            let tx = match &writer {
                Some(tx) => tx,
                None => {
                    let mut w = s.writer.lock().expect("writer lock");
                    if w.is_none() {
                        *w =
                            Some(SessionWriter::start(&s, self.metrics.clone()).map_err(internal)?);
                    }
                    writer.insert(w.as_ref().expect("just started").tx.clone())
                }
            };
            sent += data.len;
            if tx.send(Job::Frame(data)).await.is_err() {
                return Err(Status::internal("the session's writer stopped"));
            }
        }
        // The stream ended: what it sent is durable once the writer has applied and
        // synced everything queued before this.
        if let Some(tx) = writer {
            let (done, applied) = tokio::sync::oneshot::channel();
            if tx.send(Job::Flush(done)).await.is_err() {
                return Err(Status::internal("the session's writer stopped"));
            }
            applied
                .await
                .map_err(|_| Status::internal("the session's writer stopped"))??;
        }
        Ok(Response::new(proto::WriteAck {
            bytes_applied: sent,
        }))
    }

    type ReadStream = tokio_stream::wrappers::ReceiverStream<Result<proto::DataFrame, Status>>;
    type TreePushStream = super::trees::CallStream;
    type TreePullStream = super::trees::AnswerStream;

    async fn describe(
        &self,
        req: Request<proto::DescribeRequest>,
    ) -> Result<Response<proto::DescribeResponse>, Status> {
        self.describe_export(req).await
    }

    async fn tree_push(
        &self,
        req: Request<Streaming<proto::TreeAnswer>>,
    ) -> Result<Response<Self::TreePushStream>, Status> {
        self.push_tree(req).await
    }

    async fn tree_pull(
        &self,
        req: Request<Streaming<proto::TreeCall>>,
    ) -> Result<Response<Self::TreePullStream>, Status> {
        self.pull_tree(req).await
    }

    async fn read(
        &self,
        req: Request<proto::ReadRequest>,
    ) -> Result<Response<Self::ReadStream>, Status> {
        let r = req.into_inner();
        let s = self.session(&r.session)?;
        if !r.page_hashes.len().is_multiple_of(PAGE_HASH_LEN) {
            return Err(Status::invalid_argument(
                "page hashes must be whole 16-byte hashes",
            ));
        }
        for &c in &r.chunks {
            chunk_range(&s, c)?;
        }
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let metrics = self.metrics.clone();
        tokio::task::spawn_blocking(move || {
            let mut buf = vec![0u8; s.chunk.bytes()];
            let mut theirs = &r.page_hashes[..];
            for c in r.chunks {
                let (off, len) = chunk_range(&s, c).expect("checked above");
                if let Err(e) = s.file.read_exact_at(&mut buf[..len], off) {
                    let _ = tx.blocking_send(Err(internal(e)));
                    return;
                }
                let n_pages = len.div_ceil(PAGE_SIZE);
                let (their_pages, rest) =
                    theirs.split_at((n_pages * PAGE_HASH_LEN).min(theirs.len()));
                theirs = rest;
                let data = tonic::codegen::Bytes::copy_from_slice(&buf[..len]);
                for f in frames::chunk_frames(&s.key, &data, off, their_pages, !r.raw) {
                    metrics.bytes_sent.fetch_add(f.len, Relaxed);
                    if tx.blocking_send(Ok(f)).is_err() {
                        return; // the caller went away
                    }
                }
            }
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(
            rx,
        )))
    }

    async fn allocation(
        &self,
        req: Request<proto::AllocationRequest>,
    ) -> Result<Response<proto::AllocationResponse>, Status> {
        let r = req.into_inner();
        let s = self.session(&r.session)?;
        let chunks = s.size.div_ceil(s.chunk.get());
        if r.count > 8 << 20 || r.first > chunks {
            return Err(Status::out_of_range(format!(
                "chunks {}+{} are not within the volume's {chunks} (at most 8 Mi per call)",
                r.first, r.count
            )));
        }
        let count = r.count.min(chunks - r.first);
        let path = s.path.clone();
        let (cs, size) = (s.chunk.get(), s.size);
        let data = blocking(move || {
            let v = BlockVolume::open(&path)?.limited_to_at_most(size);
            let mut bits = vec![0u8; count.div_ceil(8) as usize];
            // Walk the data extents (SEEK_DATA / SEEK_HOLE): a sparse terabyte is a few
            // seeks, not a read.
            let (start, end) = (r.first * cs, ((r.first + count) * cs).min(size));
            let mut at = start;
            while let Some(d) = v.next_data(at).filter(|&d| d < end) {
                let h = v.next_hole(d).min(end);
                for c in (d / cs)..h.div_ceil(cs) {
                    let i = (c - r.first) as usize;
                    bits[i / 8] |= 1 << (i % 8);
                }
                at = h;
            }
            Ok::<_, chunker::ChunkerError>(bits)
        })
        .map_err(internal)?;
        Ok(Response::new(proto::AllocationResponse {
            data: data.into(),
        }))
    }

    async fn finish(
        &self,
        req: Request<proto::FinishRequest>,
    ) -> Result<Response<proto::FinishResponse>, Status> {
        let r = req.into_inner();
        let s = self.session(&r.session)?;
        if s.cycle.is_some() && r.cycle_root.len() != 32 {
            return Err(Status::invalid_argument(
                "a replication cycle is committed with the source's 32-byte Merkle root",
            ));
        }
        let dest = s.dest.lock().expect("dest lock").take();
        let mut root = match &s.cycle {
            Some(_) => ChunkId(r.cycle_root[..].try_into().expect("checked: 32 bytes")),
            // Nothing was hashed: there is no root to give (and none to wait for).
            None if s.ranges_only => ChunkId([0; 32]),
            None => s.summary.root().await.map_err(Status::internal)?,
        };
        if let Some(dest) = dest {
            blocking(|| dest.volume.file().sync_all()).map_err(internal)?;
            // The writer's chunk ids of what it wrote: saved as the destination's index.
            let mut ids = (!r.chunk_ids.is_empty()).then_some(&r.chunk_ids[..]);
            if ids.is_some_and(|b| b.len() as u64 != s.summary.chunks() * 32) {
                return Err(Status::invalid_argument(format!(
                    "{} bytes of chunk ids for {} chunks",
                    r.chunk_ids.len(),
                    s.summary.chunks()
                )));
            }
            if r.verify {
                let v = blocking(|| BlockVolume::open(dest.volume.path())).map_err(internal)?;
                let v = v.limited_to_at_most(s.size);
                root = blocking(|| read_back_root(&v, &s.key, s.chunk, &())).map_err(internal)?;
                // Ids that do not add up to what was read back are not saved.
                let of_ids =
                    ids.map(|b| LiveSummary::of_kinds(s.key.clone(), s.chunk, s.size, kinds(b)));
                if of_ids.is_some_and(|o| o.root_now() != Some(root)) {
                    tracing::warn!(export = %s.export, "the writer's chunk ids do not match the data read back; no index saved");
                    ids = None;
                }
            }
            let is_image = dest.volume.kind() == VolumeKind::ImageFile;
            let file = blocking(|| finish_destination(dest)).map_err(internal)?;
            if let Some(c) = &s.cycle {
                let applied = blocking(|| c.commit(&r.cycle_root, &s.path)).map_err(|e| {
                    Status::internal(format!(
                        "cannot commit cycle {} of {}: {e}",
                        c.cycle.id, c.relationship
                    ))
                })?;
                tracing::info!(relationship = %c.relationship, cycle = applied.id, "cycle applied");
            }
            if let Some(ids) = ids.filter(|_| is_image) {
                let saved = blocking(|| self.save_index(&s, &file, ids));
                if let Err(e) = saved {
                    tracing::warn!(export = %s.export, "cannot save the chunk index ({e}); the next session hashes the volume");
                }
            }
            if let Some(p) = &s.pages {
                let zero: Option<Vec<bool>> =
                    ids.map(|b| kinds(b).map(|k| k == ChunkKind::Zero).collect());
                self.save_pages(&s, p.clone(), file, zero);
            }
        }
        if self
            .sessions
            .lock()
            .expect("sessions lock")
            .remove(&r.session)
            .is_some()
        {
            self.metrics.sessions_active.fetch_sub(1, Relaxed);
        }
        Ok(Response::new(proto::FinishResponse {
            root: root.0.to_vec().into(),
        }))
    }
}

impl AgentService {
    /// The summary of the volume a session opens: known at once for a new image or from a
    /// valid saved index, else hashed in the background; and whether the index gave it.
    fn summary_of(
        &self,
        export: &Export,
        dest: Option<&Destination>,
        key: &ChunkKey,
        chunk: ChunkSize,
        size: u64,
    ) -> Result<(Arc<LiveSummary>, bool), Status> {
        if dest.is_some_and(|d| d.fresh) {
            return Ok((LiveSummary::of_zeros(key.clone(), chunk, size), false));
        }
        let volume = match dest {
            Some(d) => BlockVolume::open(d.volume.path()),
            None => BlockVolume::open(&export.path),
        }
        .map_err(internal)?
        .limited_to_at_most(size);
        let index_path = index::index_path(&self.state_dir, &export.path);
        let in_place = dest.is_none_or(|d| d.partial.is_none());
        if volume.kind() == VolumeKind::ImageFile && in_place {
            let saved = Identity::of(volume.file())
                .ok()
                .and_then(|id| IndexReader::open_valid(&index_path, id, chunk, size, key));
            if let Some(mut saved) = saved {
                let n = size.div_ceil(chunk.get());
                let kinds: std::io::Result<Vec<ChunkKind>> = (0..n).map(|_| saved.next()).collect();
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
    fn save_pages(
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
    fn save_index(&self, s: &Session, file: &std::fs::File, ids: &[u8]) -> std::io::Result<()> {
        let mut w = IndexWriter::create(index::index_path(&self.state_dir, &s.path))?;
        for k in kinds(ids) {
            w.push(&k)?;
        }
        w.commit(Identity::of(file)?, s.chunk, s.size, &s.key)
    }
}

/// Chunk kinds from their wire form: 32 bytes each, all zeros for a zero chunk.
fn kinds(ids: &[u8]) -> impl Iterator<Item = ChunkKind> + '_ {
    ids.chunks_exact(32).map(|b| {
        if b.iter().all(|&x| x == 0) {
            ChunkKind::Zero
        } else {
            ChunkKind::Data(ChunkId(b.try_into().expect("32 bytes")))
        }
    })
}

/// Removes a saved index that is about to go stale.
fn remove_index(path: &std::path::Path) -> Result<(), Status> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(internal(format!(
            "cannot remove the stale chunk index {}: {e}",
            path.display()
        ))),
        _ => Ok(()),
    }
}

/// What a Write stream hands the session's writer.
enum Job {
    /// Apply this frame.
    Frame(proto::DataFrame),
    /// Make everything applied so far durable, then answer (a stream's end).
    Flush(tokio::sync::oneshot::Sender<Result<(), Status>>),
}

/// The thread that applies a WRITE session's frames, from all its streams, in arrival
/// order; a second thread makes them durable every [`SYNC_EVERY`] bytes without holding
/// up the writes.
struct SessionWriter {
    tx: tokio::sync::mpsc::Sender<Job>,
}

impl SessionWriter {
    fn start(s: &Session, metrics: Arc<Metrics>) -> std::io::Result<SessionWriter> {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Job>(16);
        let (file, path) = (DirectWriter::new(&s.file)?, s.path.clone());
        let sync_file = s.file.try_clone()?;
        let (kick, kicks) = std::sync::mpsc::sync_channel::<()>(1);
        let sync_failed: Arc<Mutex<Option<String>>> = Arc::default();
        let failed = sync_failed.clone();
        let superseded = s.superseded.clone();
        let pages = s.pages.clone();
        // A cycle's frames are staged in its journal, not written (see agent::journal).
        let journal = s.cycle.as_ref().map(|c| c.journal.clone());
        std::thread::spawn(move || {
            while kicks.recv().is_ok() {
                if let Err(e) = sync_file.sync_data() {
                    *failed.lock().expect("sync error lock") = Some(e.to_string());
                }
            }
        });
        std::thread::spawn(move || {
            let mut unsynced = 0u64;
            // The first failure fails every later flush: the stream that hit it, and any
            // other, learn that their data may not have been applied.
            let mut failure: Option<Status> = None;
            while let Some(job) = rx.blocking_recv() {
                if failure.is_none() && superseded.load(Relaxed) {
                    failure = Some(Status::aborted(
                        "this session was replaced by a newer one on the same volume; its \
                         remaining writes were dropped",
                    ));
                }
                match job {
                    Job::Frame(data) if failure.is_none() => {
                        let at = data.offset;
                        let mut staged = journal.as_ref().map(|j| j.lock().expect("journal lock"));
                        let applied = match (
                            frames::content(&data),
                            staged.as_mut().and_then(|j| j.as_mut()),
                        ) {
                            (Err(e), _) => Err(Status::invalid_argument(e)),
                            (Ok(Content::Bytes(b)), Some(j)) => j.data(at, &b).map_err(internal),
                            (Ok(Content::Zeros(n)), Some(j)) => j.zeros(at, n).map_err(internal),
                            (Ok(Content::Bytes(b)), None) => {
                                let write = || file.write_all_at(&b, at);
                                match &pages {
                                    Some(p) => p.write(at, &b, write),
                                    None => write(),
                                }
                                .map_err(internal)
                            }
                            (Ok(Content::Zeros(n)), None) => {
                                let zero = || zero_range(file.file(), &path, at, n);
                                match &pages {
                                    Some(p) => p.write_zeros(at, n, zero),
                                    None => zero(),
                                }
                                .map_err(internal)
                            }
                        };
                        if let Err(e) = applied {
                            failure = Some(e);
                            continue;
                        }
                        metrics.bytes_received.fetch_add(data.len, Relaxed);
                        unsynced += data.len;
                        if unsynced >= SYNC_EVERY {
                            unsynced = 0;
                            let _ = kick.try_send(()); // a sync under way covers this too
                        }
                    }
                    Job::Frame(_) => {}
                    Job::Flush(done) => {
                        let r = match (
                            &failure,
                            sync_failed.lock().expect("sync error lock").clone(),
                        ) {
                            (Some(f), _) => Err(f.clone()),
                            (None, Some(e)) => Err(Status::internal(e)),
                            (None, None) => file.file().sync_data().map_err(internal),
                        };
                        let _ = done.send(r);
                    }
                }
            }
        });
        Ok(SessionWriter { tx })
    }
}

/// Byte range of chunk `c` in the session's volume.
fn chunk_range(s: &Session, c: u64) -> Result<(u64, usize), Status> {
    let off = c
        .checked_mul(s.chunk.get())
        .filter(|&o| o < s.size)
        .ok_or_else(|| {
            Status::out_of_range(format!(
                "chunk {c} is past the end of the volume ({} bytes)",
                s.size
            ))
        })?;
    Ok((off, (s.size - off).min(s.chunk.get()) as usize))
}
