//! The Transfer service's gRPC methods (`proto/transfer.proto`): sessions on exported
//! volumes, adapted to the agent's state and rules (`service`) and to the secondary's
//! end of a cycle (`replicate::secondary`).

use super::fencing::Raise;
use super::{
    live::LiveSummary,
    pages::PageIndex,
    session::{Job, SessionWriter},
    session::{Session, chunk_range, kinds},
    status::{ServiceError, answer, internal},
};
use crate::replicate::{
    holds,
    journal::{self, Journal},
    secondary::{self, CycleSession, CycleTarget},
};
use chunker::{
    BlockVolume, ChunkId, ChunkKind, ChunkSize, PAGE_HASH_LEN, PAGE_SIZE, VolumeKind, page_hashes,
};
use mover_engine::copy::{
    CopyOptions, Origin, finish_destination, index, prepare_destination, read_back_root,
};
use std::{
    os::unix::fs::FileExt,
    path::PathBuf,
    sync::{Arc, Mutex, atomic::Ordering::Relaxed},
};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};
use transport::{
    frames,
    proto::{self, Access, transfer_server::Transfer},
};

use super::service::{AgentService, blocking};

/// A read through a hold that failed: an ended hold is the reader's to handle (start
/// its fill again); an I/O error is the agent's.
fn held_err(e: holds::HoldError) -> ServiceError {
    match e {
        holds::HoldError::Io(e) => internal(e),
        e => ServiceError::FailedPrecondition(e.to_string()),
    }
}

#[tonic::async_trait]
impl Transfer for AgentService {
    async fn open(
        &self,
        req: Request<proto::OpenRequest>,
    ) -> Result<Response<proto::OpenResponse>, Status> {
        answer(async {
            let peer = req
                .remote_addr()
                .map(|a| a.to_string())
                .unwrap_or_else(|| "a peer".into());
            let caller = req.extensions().get::<transport::auth::Caller>().cloned();
            let r = req.into_inner();
            // `write`: Some(whether it is a replication cycle) for a WRITE session.
            let write = (r.access == Access::Write as i32).then_some(r.cycle.is_some());
            self.check_served(&r.volume, &r.relationship, write, caller.as_ref())?;
            let export = self.export(&r.volume)?;
            let chunk = ChunkSize::new(r.chunk_size)
                .map_err(|e| self.refuse(ServiceError::InvalidArgument(e.to_string())))?;
            if r.relationship.is_empty() {
                return Err(self.refuse(ServiceError::InvalidArgument(
                    "a relationship id is required".into(),
                )));
            }
            let access = Access::try_from(r.access).unwrap_or(Access::Unspecified);
            let key = transport::relationship_key(&r.relationship);
            let mut known_before = false;
            if !r.hold.is_empty() && access != Access::Read {
                return Err(self.refuse(ServiceError::InvalidArgument(
                    "a hold is taken by a READ session".into(),
                )));
            }
            let (file, size, dest) = match access {
                Access::Read => {
                    let v = blocking(|| BlockVolume::open(&export.path)).map_err(internal)?;
                    let size = v.size();
                    (v.into_file(), size, None)
                }
                Access::Write => {
                    self.check_writable(&r.volume, &export)?;
                    self.check_epoch(&r.relationship, r.epoch, caller.as_ref(), Raise::ByOne)?;
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
                        let dir = journal::cycles_dir(self.state_dir(), &r.relationship);
                        if dir.join("commit.json").exists() {
                            blocking(|| journal::apply(&dir)).map_err(internal)?;
                        }
                    }
                    let opts = CopyOptions {
                        state_dir: Some(self.state_dir().to_path_buf()),
                        ..Default::default()
                    };
                    let origin_name = PathBuf::from(format!("agent session from {peer}"));
                    let origin = Origin {
                        size: r.source_size,
                        volume: None,
                        name: &origin_name,
                    };
                    let dest = blocking(|| prepare_destination(origin, &export.path, &opts))
                        .map_err(|e| self.refuse(ServiceError::FailedPrecondition(e.to_string())))?;
                    let file = dest.volume.file().try_clone().map_err(internal)?;
                    (file, r.source_size, Some(dest))
                }
                Access::Unspecified => {
                    return Err(self.refuse(ServiceError::InvalidArgument(
                        "access must be READ or WRITE".into(),
                    )));
                }
            };
            let (summary, indexed) = if r.ranges_only && access == Access::Read {
                // Never asked for (Tree refuses): no hashing of the volume.
                (LiveSummary::unserved(key.clone(), chunk, size), false)
            } else {
                blocking(|| self.summary_of(&export, dest.as_ref(), &key, chunk, size))?
            };
            let id = self.session_id(&r.volume);
            let cycle = match (&r.cycle, &dest) {
                (Some(c), Some(d)) => {
                    let dir = journal::cycles_dir(self.state_dir(), &r.relationship);
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
                .and_then(|_| secondary::applied_cycle(self.state_dir(), &r.relationship));
            let hold = match r.hold.is_empty() {
                true => None,
                false => Some(self.hold(&r, &export.path, caller.as_ref())?),
            };
            let pages = dest
                .as_ref()
                .filter(|d| d.volume.kind() == VolumeKind::ImageFile && cycle.is_none())
                .and_then(|d| {
                    let chunk_index = index::index_path(self.state_dir(), &export.path);
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
                held: hold.as_ref().map(|h| proto::AppliedCycle {
                    id: h.cycle,
                    point_in_time_ms: h.point_in_time_ms,
                    ..Default::default()
                }),
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
                hold,
            };
            if session.writes_in_place() {
                holds::end_all(
                    &export.path,
                    "the volume is being written in place (a first sync, a resync or a copy)",
                );
            }
            self.sessions
                .lock()
                .expect("sessions lock")
                .insert(id, Arc::new(session));
            self.metrics.sessions_opened.fetch_add(1, Relaxed);
            self.metrics.sessions_active.fetch_add(1, Relaxed);
            Ok(response)
        })
        .await
    }

    async fn tree(
        &self,
        req: Request<proto::TreeRequest>,
    ) -> Result<Response<proto::TreeResponse>, Status> {
        answer(async {
            let r = req.into_inner();
            let s = self.session(&r.session)?;
            if s.ranges_only {
                return Err(ServiceError::FailedPrecondition(
                    "this session was opened to read ranges only: it has no summary".into(),
                ));
            }
            // Waits while the background hashing has not reached what is asked.
            let level = match r.level {
                0 => s.summary.leaves(r.first, r.count).await,
                1 => s.summary.groups(r.first, r.count).await,
                _ => {
                    return Err(ServiceError::InvalidArgument(
                        "tree level must be 0 (chunks) or 1 (groups)".into(),
                    ));
                }
            }
            .map_err(ServiceError::Internal)?;
            let hashes: Vec<u8> = level.iter().flat_map(|h| h.0).collect();
            Ok(proto::TreeResponse {
                hashes: hashes.into(),
            })
        })
        .await
    }

    async fn pages(
        &self,
        req: Request<proto::PagesRequest>,
    ) -> Result<Response<proto::PagesResponse>, Status> {
        answer(async {
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
                        blocking(|| s.file.read_exact_at(&mut buf[..len], off))
                            .map_err(internal)?;
                        let at = out.len();
                        page_hashes(&s.key, &buf[..len], &mut out);
                        if let Some(p) = &s.pages {
                            blocking(|| p.learn(off, &out[at..]));
                        }
                        self.metrics.pages_read_bytes.fetch_add(len as u64, Relaxed);
                    }
                }
            }
            Ok(proto::PagesResponse { hashes: out.into() })
        })
        .await
    }

    async fn write(
        &self,
        req: Request<Streaming<proto::WriteFrame>>,
    ) -> Result<Response<proto::WriteAck>, Status> {
        answer(async {
            let caller = req.extensions().get::<transport::auth::Caller>().cloned();
            let mut stream = req.into_inner();
            let mut session: Option<Arc<Session>> = None;
            // Frames go to the session's writer thread, so the async workers only move bytes
            // off the network and one thread writes the file (parallel buffered writes to one
            // file contend for its inode lock).
            let mut writer: Option<tokio::sync::mpsc::Sender<Job>> = None;
            let mut sent = 0u64;
            while let Some(frame) = stream.next().await {
                let frame = frame.map_err(ServiceError::Stream)?;
                let s = match &session {
                    Some(s) => s.clone(),
                    None => {
                        let s = self.session(&frame.session)?;
                        if s.dest.lock().expect("dest lock").is_none() {
                            return Err(self.refuse(ServiceError::FailedPrecondition(
                                "this session was opened for reading".into(),
                            )));
                        }
                        session.insert(s).clone()
                    }
                };
                // Checked on every frame: a newer primary may have raised the epoch meanwhile.
                // A frame raises none: its session's Open did.
                self.check_epoch(&s.relationship, frame.epoch, caller.as_ref(), Raise::No)?;
                let data = frame.frame.ok_or_else(|| {
                    ServiceError::InvalidArgument("write frame without data".into())
                })?;
                if data
                    .offset
                    .checked_add(data.len)
                    .is_none_or(|end| end > s.size)
                {
                    return Err(self.refuse(ServiceError::OutOfRange(format!(
                        "write of {} bytes at offset {} is past the end of the volume ({} bytes)",
                        data.len, data.offset, s.size
                    ))));
                }
                let tx = match &writer {
                    Some(tx) => tx,
                    None => {
                        let mut w = s.writer.lock().expect("writer lock");
                        if w.is_none() {
                            *w = Some(
                                SessionWriter::start(&s, self.metrics.clone()).map_err(internal)?,
                            );
                        }
                        writer.insert(w.as_ref().expect("just started").tx.clone())
                    }
                };
                sent += data.len;
                if tx.send(Job::Frame(data)).await.is_err() {
                    return Err(ServiceError::Internal(
                        "the session's writer stopped".into(),
                    ));
                }
            }
            // The stream ended: what it sent is durable once the writer has applied and
            // synced everything queued before this.
            if let Some(tx) = writer {
                let (done, applied) = tokio::sync::oneshot::channel();
                if tx.send(Job::Flush(done)).await.is_err() {
                    return Err(ServiceError::Internal(
                        "the session's writer stopped".into(),
                    ));
                }
                applied
                    .await
                    .map_err(|_| ServiceError::Internal("the session's writer stopped".into()))??;
            }
            Ok(proto::WriteAck {
                bytes_applied: sent,
            })
        })
        .await
    }

    type ReadStream = tokio_stream::wrappers::ReceiverStream<Result<proto::DataFrame, Status>>;
    type TreePushStream = super::trees::CallStream;
    type TreePullStream = super::trees::AnswerStream;

    async fn describe(
        &self,
        req: Request<proto::DescribeRequest>,
    ) -> Result<Response<proto::DescribeResponse>, Status> {
        answer(self.describe_export(req)).await
    }

    async fn tree_push(
        &self,
        req: Request<Streaming<proto::TreeAnswer>>,
    ) -> Result<Response<Self::TreePushStream>, Status> {
        answer(self.push_tree(req)).await
    }

    async fn tree_pull(
        &self,
        req: Request<Streaming<proto::TreeCall>>,
    ) -> Result<Response<Self::TreePullStream>, Status> {
        answer(self.pull_tree(req)).await
    }

    async fn read(
        &self,
        req: Request<proto::ReadRequest>,
    ) -> Result<Response<Self::ReadStream>, Status> {
        answer(async {
            let r = req.into_inner();
            let s = self.session(&r.session)?;
            if !r.page_hashes.len().is_multiple_of(PAGE_HASH_LEN) {
                return Err(ServiceError::InvalidArgument(
                    "page hashes must be whole 16-byte hashes".into(),
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
                    let read = match &s.hold {
                        Some(h) => h.read_at(&s.file, &mut buf[..len], off).map_err(held_err),
                        None => s.file.read_exact_at(&mut buf[..len], off).map_err(internal),
                    };
                    if let Err(e) = read {
                        let _ = tx.blocking_send(Err(e.into()));
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
            Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
        })
        .await
    }

    async fn allocation(
        &self,
        req: Request<proto::AllocationRequest>,
    ) -> Result<Response<proto::AllocationResponse>, Status> {
        answer(async {
            let r = req.into_inner();
            let s = self.session(&r.session)?;
            let chunks = s.size.div_ceil(s.chunk.get());
            if r.count > 8 << 20 || r.first > chunks {
                return Err(ServiceError::OutOfRange(format!(
                    "chunks {}+{} are not within the volume's {chunks} (at most 8 Mi per call)",
                    r.first, r.count
                )));
            }
            let count = r.count.min(chunks - r.first);
            let path = s.path.clone();
            let (cs, size) = (s.chunk.get(), s.size);
            let hold = s.hold.clone();
            let data = blocking(move || {
                let v = BlockVolume::open(&path)?.limited_to_at_most(size);
                let mut bits = vec![0u8; count.div_ceil(8) as usize];
                // Walk the data extents (SEEK_DATA / SEEK_HOLE): a sparse terabyte is a few
                // seeks, not a read.
                let (start, end) = (r.first * cs, ((r.first + count) * cs).min(size));
                let mut at = start;
                let mut mark = |from: u64, to: u64| {
                    for c in (from / cs)..to.div_ceil(cs) {
                        let i = (c - r.first) as usize;
                        bits[i / 8] |= 1 << (i % 8);
                    }
                };
                while let Some(d) = v.next_data(at).filter(|&d| d < end) {
                    let h = v.next_hole(d).min(end);
                    mark(d, h);
                    at = h;
                }
                // Where later cycles overwrote a held point it may have data the volume
                // no longer has. Asked after the scan: a range punched since was kept
                // before it was punched.
                let overwritten = hold.map(|h| h.overwritten()).unwrap_or_default();
                for (d, h) in overwritten
                    .into_iter()
                    .filter(|&(d, h)| d < end && h > start)
                {
                    mark(d.max(start), h.min(end));
                }
                Ok::<_, chunker::ChunkerError>(bits)
            })
            .map_err(internal)?;
            Ok(proto::AllocationResponse { data: data.into() })
        })
        .await
    }

    async fn finish(
        &self,
        req: Request<proto::FinishRequest>,
    ) -> Result<Response<proto::FinishResponse>, Status> {
        answer(async {
            let r = req.into_inner();
            let s = self.session(&r.session)?;
            if s.cycle.is_some() && r.cycle_root.len() != 32 {
                return Err(ServiceError::InvalidArgument(
                    "a replication cycle is committed with the source's 32-byte Merkle root"
                        .into(),
                ));
            }
            let dest = s.dest.lock().expect("dest lock").take();
            let mut root = match &s.cycle {
                Some(_) => ChunkId(r.cycle_root[..].try_into().expect("checked: 32 bytes")),
                // Nothing was hashed: there is no root to give (and none to wait for).
                None if s.ranges_only => ChunkId([0; 32]),
                None => s.summary.root().await.map_err(ServiceError::Internal)?,
            };
            if let Some(dest) = dest {
                blocking(|| dest.volume.file().sync_all()).map_err(internal)?;
                // The writer's chunk ids of what it wrote: saved as the destination's index.
                let mut ids = (!r.chunk_ids.is_empty()).then_some(&r.chunk_ids[..]);
                if ids.is_some_and(|b| b.len() as u64 != s.summary.chunks() * 32) {
                    return Err(ServiceError::InvalidArgument(format!(
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
                        ServiceError::Internal(format!(
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
            if let Some(h) = s.hold.as_ref().filter(|_| r.release_hold) {
                holds::release(&s.path, &h.key);
                tracing::info!(export = %s.export, hold = %h.key, cycle = h.cycle, kept = h.kept_bytes(), "hold released by its reader");
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
            Ok(proto::FinishResponse {
                root: root.0.to_vec().into(),
            })
        })
        .await
    }
}
