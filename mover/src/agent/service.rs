//! The Transfer service: sessions on exported volumes.

use super::{
    config::Export,
    fencing::{EpochStore, StaleEpochOrIo},
    metrics::Metrics,
};
use crate::copy::{
    CopyOptions, Destination, Origin, finish_destination, prepare_destination, read_back_root,
    zero_range,
};
use chunker::{BlockVolume, ChunkKey, ChunkSize, PAGE_HASH_LEN, PAGE_SIZE, Summary, page_hashes};
use std::{
    collections::{BTreeMap, HashMap},
    os::unix::fs::FileExt,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering::Relaxed},
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
    exports: BTreeMap<String, Export>,
    state_dir: PathBuf,
    epochs: EpochStore,
    metrics: Arc<Metrics>,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    next_id: AtomicU64,
}

/// One open session.
struct Session {
    export: String,
    relationship: String,
    chunk: ChunkSize,
    size: u64,
    key: ChunkKey,
    summary: Summary,
    /// For reading (READ) or writing (WRITE, through a duplicate of the destination's fd).
    file: std::fs::File,
    path: PathBuf,
    /// WRITE sessions: the destination, made visible on Finish.
    dest: Mutex<Option<Destination>>,
    unsynced: AtomicU64,
}

impl AgentService {
    /// A service for `exports`, keeping state under `state_dir`.
    pub fn new(
        exports: BTreeMap<String, Export>,
        state_dir: PathBuf,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Self> {
        Ok(AgentService {
            exports,
            epochs: EpochStore::new(&state_dir)?,
            state_dir,
            metrics,
            sessions: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        })
    }

    fn refuse(&self, status: Status) -> Status {
        self.metrics.refusals.fetch_add(1, Relaxed);
        status
    }

    fn session(&self, id: &str) -> Result<Arc<Session>, Status> {
        self.sessions.lock().expect("sessions lock").get(id).cloned().ok_or_else(|| {
            Status::not_found(format!("no open session {id:?}: it finished, was replaced by a newer one, or the agent restarted; open a new one"))
        })
    }

    fn check_epoch(&self, relationship: &str, epoch: u64) -> Result<(), Status> {
        match self.epochs.admit(relationship, epoch) {
            Ok(()) => Ok(()),
            Err(StaleEpochOrIo::Stale(e)) => {
                self.metrics.stale_epoch_refusals.fetch_add(1, Relaxed);
                Err(Status::failed_precondition(e.to_string()))
            }
            Err(e @ StaleEpochOrIo::Io(_)) => Err(Status::internal(e.to_string())),
        }
    }

    fn close_sessions_on(&self, export: &str) {
        let mut sessions = self.sessions.lock().expect("sessions lock");
        let before = sessions.len();
        sessions.retain(|_, s| s.export != export);
        let closed = (before - sessions.len()) as u64;
        self.metrics.sessions_active.fetch_sub(closed, Relaxed);
    }
}

fn internal(e: impl std::fmt::Display) -> Status {
    Status::internal(e.to_string())
}

/// Runs blocking volume I/O without stalling the async workers.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
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
        let export = self.exports.get(&r.volume).ok_or_else(|| {
            self.refuse(Status::not_found(format!(
                "volume {:?} is not exported by this agent (exports: {})",
                r.volume,
                self.exports.keys().cloned().collect::<Vec<_>>().join(", ")
            )))
        })?;
        let chunk = ChunkSize::new(r.chunk_size)
            .map_err(|e| self.refuse(Status::invalid_argument(e.to_string())))?;
        if r.relationship.is_empty() {
            return Err(self.refuse(Status::invalid_argument("a relationship id is required")));
        }
        let access = Access::try_from(r.access).unwrap_or(Access::Unspecified);
        let key = transport::relationship_key(&r.relationship);
        let (file, size, dest) = match access {
            Access::Read => {
                let v = blocking(|| BlockVolume::open(&export.path)).map_err(internal)?;
                let size = v.size();
                (v.into_file(), size, None)
            }
            Access::Write => {
                if export.read_only {
                    return Err(self.refuse(Status::permission_denied(format!(
                        "volume {:?} is exported read-only; it can be a source, never a destination",
                        r.volume
                    ))));
                }
                self.check_epoch(&r.relationship, r.epoch)?;
                // One writer per export: a newer session takes over from an abandoned one.
                self.close_sessions_on(&r.volume);
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
        let summary = {
            let v = match &dest {
                Some(d) => blocking(|| BlockVolume::open(d.volume.path())),
                None => blocking(|| BlockVolume::open(&export.path)),
            }
            .map_err(internal)?;
            let v = v.limited_to_at_most(size);
            blocking(|| Summary::of_volume(&v, &key, chunk, |_| {})).map_err(internal)?
        };
        let id = format!("{}-{}", r.volume, self.next_id.fetch_add(1, Relaxed));
        let response = proto::OpenResponse {
            session: id.clone(),
            size,
            chunks: summary.leaves.len() as u64,
            root: summary.root.0.to_vec().into(),
            group: chunker::GROUP_CHUNKS as u32,
        };
        let session = Session {
            export: r.volume.clone(),
            relationship: r.relationship,
            chunk,
            size,
            key,
            summary,
            file,
            path: export.path.clone(),
            dest: Mutex::new(dest),
            unsynced: AtomicU64::new(0),
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
        let level = match r.level {
            0 => &s.summary.leaves,
            1 => &s.summary.groups,
            _ => {
                return Err(Status::invalid_argument(
                    "tree level must be 0 (chunks) or 1 (groups)",
                ));
            }
        };
        let first = r.first as usize;
        let end = first.saturating_add(r.count as usize).min(level.len());
        let hashes: Vec<u8> = level
            .get(first..end)
            .unwrap_or_default()
            .iter()
            .flat_map(|h| h.0)
            .collect();
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
        let mut buf = vec![0u8; s.chunk.bytes()];
        for c in r.chunks {
            let (off, len) = chunk_range(&s, c)?;
            blocking(|| s.file.read_exact_at(&mut buf[..len], off)).map_err(internal)?;
            page_hashes(&s.key, &buf[..len], &mut out);
        }
        Ok(Response::new(proto::PagesResponse { hashes: out.into() }))
    }

    async fn write(
        &self,
        req: Request<Streaming<proto::WriteFrame>>,
    ) -> Result<Response<proto::WriteAck>, Status> {
        let mut stream = req.into_inner();
        let mut session: Option<Arc<Session>> = None;
        // Decompression and writes run on a thread of this stream's own, so the async
        // workers only move bytes off the network.
        let mut writer: Option<(tokio::sync::mpsc::Sender<proto::DataFrame>, StreamWriter)> = None;
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
            let (tx, _) =
                writer.get_or_insert_with(|| StreamWriter::start(s.clone(), self.metrics.clone()));
            if tx.send(data).await.is_err() {
                break; // the writer failed: its error is returned below
            }
        }
        let applied = match writer {
            Some((tx, w)) => {
                drop(tx);
                w.finish().await?
            }
            None => 0,
        };
        Ok(Response::new(proto::WriteAck {
            bytes_applied: applied,
        }))
    }

    type ReadStream = tokio_stream::wrappers::ReceiverStream<Result<proto::DataFrame, Status>>;

    async fn read(
        &self,
        req: Request<proto::ReadRequest>,
    ) -> Result<Response<Self::ReadStream>, Status> {
        let r = req.into_inner();
        let s = self.session(&r.session)?;
        if r.page_hashes.len() % PAGE_HASH_LEN != 0 {
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
                for f in frames::chunk_frames(&s.key, &data, off, their_pages) {
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

    async fn finish(
        &self,
        req: Request<proto::FinishRequest>,
    ) -> Result<Response<proto::FinishResponse>, Status> {
        let r = req.into_inner();
        let s = self.session(&r.session)?;
        let dest = s.dest.lock().expect("dest lock").take();
        let mut root = s.summary.root;
        if let Some(dest) = dest {
            blocking(|| dest.volume.file().sync_all()).map_err(internal)?;
            if r.verify {
                let v = blocking(|| BlockVolume::open(dest.volume.path())).map_err(internal)?;
                let v = v.limited_to_at_most(s.size);
                root = blocking(|| read_back_root(&v, &s.key, s.chunk, &())).map_err(internal)?;
            }
            blocking(|| finish_destination(dest)).map_err(internal)?;
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

/// The thread that applies one Write stream's frames to the destination.
struct StreamWriter(std::thread::JoinHandle<Result<u64, Status>>);

impl StreamWriter {
    fn start(
        s: Arc<Session>,
        metrics: Arc<Metrics>,
    ) -> (tokio::sync::mpsc::Sender<proto::DataFrame>, StreamWriter) {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<proto::DataFrame>(8);
        let thread = std::thread::spawn(move || {
            let mut applied = 0u64;
            while let Some(data) = rx.blocking_recv() {
                match frames::content(&data).map_err(Status::invalid_argument)? {
                    Content::Bytes(b) => s.file.write_all_at(&b, data.offset).map_err(internal)?,
                    Content::Zeros(n) => {
                        zero_range(&s.file, &s.path, data.offset, n).map_err(internal)?
                    }
                }
                applied += data.len;
                metrics.bytes_received.fetch_add(data.len, Relaxed);
                if s.unsynced.fetch_add(data.len, Relaxed) + data.len >= SYNC_EVERY {
                    s.unsynced.store(0, Relaxed);
                    s.file.sync_data().map_err(internal)?;
                }
            }
            // The stream ended: make what it wrote durable before acknowledging.
            s.file.sync_data().map_err(internal)?;
            Ok(applied)
        });
        (tx, StreamWriter(thread))
    }

    /// Waits for the writer; its result is the stream's.
    async fn finish(self) -> Result<u64, Status> {
        tokio::task::spawn_blocking(move || self.0.join())
            .await
            .map_err(internal)?
            .map_err(|_| Status::internal("the stream writer panicked"))?
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
