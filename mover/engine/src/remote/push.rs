//! Push: a local source volume into an agent's export.

use super::{
    AgentUrl, Client, Compress, KnownChunks, RemoteGroups, RemoteOptions, Session, open_session,
    read_groups, status_error, timed, tree, units::units_written, with_retries,
};
use crate::{
    copy::{CopyOptions, CopySummary, Progress},
    error::{CopyError, RemoteCode, Result},
};
use chunker::{
    BlockVolume, ChunkId, ChunkKind, GROUP_CHUNKS, MerkleBuilder, PAGE_HASH_LEN, PAGE_SIZE,
    cv::CvFile, leaf_hash,
};
use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Instant,
};
use tokio::sync::mpsc;
use transport::{
    RateLimiter, frames,
    proto::{self, Access, data_frame::Payload},
};

/// Copies the local block volume `src` into the agent export `url`, sending only the
/// pages that differ; retries (continuing where it stopped) on dropped connections.
pub async fn push(
    src: &Path,
    url: &AgentUrl,
    copy: &CopyOptions,
    remote: &RemoteOptions,
    progress: &dyn Progress,
) -> Result<CopySummary> {
    let (sum, _ids) = push_maybe_cycle(src, url, copy, remote, None, progress).await?;
    Ok(sum)
}

/// A replication cycle to push, and what the previous cycle's index says of the source.
pub struct CyclePush<'a> {
    /// The cycle.
    pub cycle: &'a proto::Cycle,
    /// The previous cycle (id, Merkle root) and the source's chunks as of then: used,
    /// reading only changed chunks, when the secondary holds exactly that cycle.
    pub base: Option<(u64, ChunkId, Arc<KnownChunks>)>,
    /// The source's unit CVs: read so that only the written units of a changed chunk
    /// are read, and renewed for every chunk read.
    pub cvs: Option<Arc<CvFile>>,
}

/// Pushes one replication cycle: like [`push`], but the agent stages what arrives and
/// applies it atomically when the cycle is committed (with the source's Merkle root,
/// returned in the summary's `root`). Also returns the source's chunk ids (32 bytes per
/// chunk, zeros for a zero chunk): the index the next cycle's `base` is made from.
pub async fn push_cycle(
    src: &Path,
    url: &AgentUrl,
    copy: &CopyOptions,
    remote: &RemoteOptions,
    cycle: &CyclePush<'_>,
    progress: &dyn Progress,
) -> Result<(CopySummary, Vec<u8>)> {
    push_maybe_cycle(src, url, copy, remote, Some(cycle), progress).await
}

async fn push_maybe_cycle(
    src: &Path,
    url: &AgentUrl,
    copy: &CopyOptions,
    remote: &RemoteOptions,
    cycle: Option<&CyclePush<'_>>,
    progress: &dyn Progress,
) -> Result<(CopySummary, Vec<u8>)> {
    let started = Instant::now();
    let source = Arc::new(BlockVolume::open(src)?);
    let (mut sum, ids) = with_retries(remote.retries, |n| {
        if n > 1 {
            tracing::info!("attempt {n}: continuing the transfer to {url}");
        }
        attempt(source.clone(), url, copy, remote, cycle, progress)
    })
    .await?;
    sum.source = src.into();
    Ok((timed(sum, started), ids))
}

/// Totals of what was handed to the write streams.
#[derive(Default)]
struct Sent {
    wire: AtomicU64,
    written: AtomicU64,
    zeroed: AtomicU64,
    pages: AtomicU64,
}

/// The stream a finished group task freed, or its error or panic.
fn joined(r: std::result::Result<Result<usize>, tokio::task::JoinError>) -> Result<usize> {
    r.unwrap_or_else(|join| {
        Err(CopyError::Remote {
            url: String::new(),
            code: RemoteCode::Error,
            message: format!("a transfer task failed: {join}"),
            refusal: None,
        })
    })
}

/// What a group task needs to compare one group with the agent's and ship the difference.
struct Ship {
    client: Client,
    url: AgentUrl,
    session: String,
    key: chunker::ChunkKey,
    epoch: u64,
    tx: mpsc::Sender<proto::WriteFrame>,
    limiter: Option<Arc<RateLimiter>>,
    sent: Arc<Sent>,
    compress: Compress,
    backlog: Arc<Backlog>,
    /// The previous cycle's index, trusted: changed pages are known without asking.
    known: Option<Arc<KnownChunks>>,
    /// The secondary's leaves of this group where it holds exactly the previous cycle
    /// (it wrote nothing since): that cycle's, not asked for.
    their_leaves: Option<Vec<ChunkId>>,
}

/// Whether the link is the bottleneck: a moving share of the frames that found their
/// stream's queue full, while the bytes go out slower than [`FAST_LINK`]. Full queues
/// alone also mean a receiver whose disk is slow: compressing for it only took CPU from
/// both ends (measured over 127.0.0.1 into a disk writing ~1.3 GB/s: 2.7 of the 3.4 GiB
/// compressed, the client at 8.2 CPU-s, the copy 1.34x a local cp).
struct Backlog {
    share: std::sync::Mutex<f32>,
    started: Instant,
}

/// Bytes per second on the wire above which no link is taken for the bottleneck: a
/// 1.6 Gbit/s flow is faster than compressing pays for on a couple of cores.
const FAST_LINK: f64 = 200e6;

impl Backlog {
    fn new() -> Self {
        Self {
            share: std::sync::Mutex::new(0.0),
            started: Instant::now(),
        }
    }

    fn record(&self, full: bool) {
        let mut share = self.share.lock().expect("backlog lock");
        *share = *share * 0.97 + if full { 0.03 } else { 0.0 };
    }

    /// Whether to compress, `wire` bytes having gone out since the push began.
    fn link_bound(&self, wire: u64) -> bool {
        let rate = wire as f64 / self.started.elapsed().as_secs_f64().max(1e-3);
        *self.share.lock().expect("backlog lock") > 0.5 && rate < FAST_LINK
    }
}

impl Ship {
    /// Builds group `g`'s frames and queues them on stream `stream`, returned once the
    /// stream has taken them all. A closed stream is not an error here: the stream's own
    /// error is collected when it ends.
    async fn group(
        mut self,
        g: u64,
        stream: usize,
        win: chunker::Window,
        leaves: Option<Vec<ChunkId>>,
        chunk: chunker::ChunkSize,
    ) -> Result<usize> {
        let (client, url, key) = (&mut self.client, &self.url, &self.key);
        let compress = Compression {
            whole: match self.compress {
                Compress::Always => true,
                Compress::Never => false,
                Compress::Auto => self.backlog.link_bound(self.sent.wire.load(Relaxed)),
            },
            deltas: self.compress.deltas(),
        };
        let frames = group_frames(
            client,
            url,
            &self.session,
            key,
            g,
            win,
            leaves.as_deref(),
            chunk,
            compress,
            self.known.as_deref().map(|k| &k.ranges[..]),
            self.their_leaves.take(),
        )
        .await?;
        for f in frames {
            let wire = frames::wire_len(&f);
            if let Some(l) = &self.limiter {
                l.take(wire).await;
            }
            self.sent.wire.fetch_add(wire, Relaxed);
            match &f.payload {
                Some(Payload::Zeros(n)) => {
                    self.sent.zeroed.fetch_add(*n, Relaxed);
                }
                _ => {
                    self.sent.written.fetch_add(f.len, Relaxed);
                    self.sent
                        .pages
                        .fetch_add(f.len.div_ceil(PAGE_SIZE as u64), Relaxed);
                }
            }
            let frame = proto::WriteFrame {
                session: self.session.clone(),
                epoch: self.epoch,
                frame: Some(f),
            };
            self.backlog.record(self.tx.capacity() == 0);
            if self.tx.send(frame).await.is_err() {
                return Ok(stream);
            }
        }
        // A raw frame is a slice of the group's 8 MiB window: the window is freed only
        // once the stream has encoded the last of them. Waiting for that here, before the
        // stream takes its next group, keeps one window per stream, not two (h2's own
        // buffer keeps the connection busy meanwhile).
        let _ = self.tx.reserve_many(self.tx.max_capacity()).await;
        Ok(stream)
    }
}

async fn attempt(
    source: Arc<BlockVolume>,
    url: &AgentUrl,
    copy: &CopyOptions,
    remote: &RemoteOptions,
    push: Option<&CyclePush<'_>>,
    progress: &dyn Progress,
) -> Result<(CopySummary, Vec<u8>)> {
    let chunk = copy.chunk_size;
    let size = source.size();
    let t0 = Instant::now();
    let cycle = push.map(|p| p.cycle);
    let Session {
        mut client,
        key,
        open,
    } = open_session(url, remote, Access::Write, chunk, size, cycle.cloned()).await?;
    tracing::debug!(
        secs = t0.elapsed().as_secs_f64(),
        "session open: the agent hashed its copy"
    );
    let session = open.session.clone();
    // The previous cycle's index stands in for unchanged chunks only if the secondary
    // holds exactly that cycle: their pages are then not compared, so not shipped.
    let mut theirs_known = false;
    let known = push
        .and_then(|p| p.base.as_ref())
        .and_then(|(id, root, known)| {
            let a = open.applied.as_ref()?;
            let same = a.id == *id
                && a.root[..] == root.0[..]
                && known.base.len() as u64 == size.div_ceil(chunk.get());
            if !same {
                tracing::info!(
                    cycle = id,
                    secondary = a.id,
                    "the secondary does not hold the previous cycle: comparing every chunk"
                );
            }
            theirs_known = same && a.dirty.is_empty();
            same.then(|| match a.dirty.is_empty() {
                true => known.clone(),
                false => Arc::new(known.with_dirty(&a.dirty, chunk)),
            })
        });

    // Data streams: each takes frames from a bounded channel, so a slow link slows the
    // reader instead of filling memory. Each has a connection of its own (the first the
    // session's), as do the comparisons of the groups it carries: one HTTP/2 connection
    // is one task, which alone encrypts (TLS) everything it sends, and one TCP flow,
    // which alone backs off on a lossy link.
    let limiter = remote.bwlimit.map(|r| Arc::new(RateLimiter::new(r)));
    let mut senders = Vec::new();
    let mut streams = Vec::new();
    let mut clients = vec![client.clone()];
    for _ in 1..remote.streams {
        clients.push(remote.connect(url).await?);
    }
    for c in &clients {
        // Two frames queued per stream: a raw frame is a slice that keeps its whole 8 MiB
        // window alive, so a deeper queue is windows of memory (8 held the push client at
        // 209 MiB), and h2's own window keeps the connection busy meanwhile.
        let (tx, rx) = mpsc::channel::<proto::WriteFrame>(2);
        senders.push(tx);
        let mut c = c.clone();
        streams.push(tokio::spawn(async move {
            c.write(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
        }));
    }

    let mut groups = RemoteGroups::new(session.clone());
    // Every chunk is hashed (on the reader thread, ahead of the comparison), also onto
    // zeros: the ids go to the agent with Finish, which saves them as the volume's index
    // so that the next push need not read the destination to compare.
    let mut reader = read_groups(
        source.clone(),
        chunk,
        key.clone(),
        size,
        known.clone(),
        push.and_then(|p| p.cvs.clone()),
    );
    let mut ids = Vec::with_capacity(size.div_ceil(chunk.get()) as usize * 32);
    let mut merkle = MerkleBuilder::new(key.clone());
    let sent = Arc::new(Sent::default());
    let backlog = Arc::new(Backlog::new());
    let mut inflight = tokio::task::JoinSet::new();
    let mut sum = CopySummary {
        destination: url.to_string().into(),
        volume_bytes: size,
        chunk_size: chunk.get(),
        ..Default::default()
    };
    progress.begin("push", size);
    let mut g = 0u64;
    // Streams without a group task: each takes one group at a time.
    let mut free: Vec<usize> = (0..senders.len()).rev().collect();
    let pass: Result<()> = async {
        while let Some(item) = reader.recv().await {
            let group = item?;
            sum.source_bytes_read += group.bytes_read;
            for (i, r) in group.chunk_ranges(chunk).enumerate() {
                if group.zero[i] {
                    sum.zero_bytes_skipped += r.len() as u64;
                }
            }
            let done = group.win.offset + group.len as u64;
            for k in &group.kinds {
                ids.extend_from_slice(match k {
                    ChunkKind::Zero => &[0; 32],
                    ChunkKind::Data(id) => &id.0,
                });
            }
            let theirs = groups.get(&mut client, url, g).await?;
            let onto_zeros = theirs == group.zero_group_hash(&key, chunk);
            group.leaves.iter().for_each(|l| merkle.push_leaf(*l));
            let differs = chunker::Summary::group_hash(&key, &group.leaves) != theirs;
            if differs {
                // Where the secondary holds exactly the previous cycle, its leaves are
                // that cycle's; its group hash must say so too: else it changed behind
                // the index it vouched for, and this cycle compares every chunk instead.
                let their_leaves = known.as_ref().filter(|_| theirs_known).map(|k| {
                    let first = g as usize * GROUP_CHUNKS;
                    group
                        .chunk_ranges(chunk)
                        .enumerate()
                        .map(|(i, r)| leaf_hash(&key, &k.base[first + i], r.len() as u64))
                        .collect::<Vec<_>>()
                });
                if their_leaves
                    .as_ref()
                    .is_some_and(|l| chunker::Summary::group_hash(&key, l) != theirs)
                {
                    return Err(not_read(url, g));
                }
                // Groups are compared and framed concurrently (one in flight per
                // stream), so round trips and compression overlap the reading.
                while free.is_empty() {
                    let busy = inflight.join_next().await;
                    free.push(joined(busy.expect("a task for every busy stream"))?);
                }
                let stream = free.pop().expect("a free stream, waited for above");
                let ship = Ship {
                    client: clients[stream].clone(),
                    url: url.clone(),
                    session: session.clone(),
                    key: key.clone(),
                    epoch: remote.epoch,
                    tx: senders[stream].clone(),
                    limiter: limiter.clone(),
                    sent: sent.clone(),
                    compress: remote.compress,
                    backlog: backlog.clone(),
                    known: known.clone(),
                    their_leaves,
                };
                let leaves = (!onto_zeros).then_some(group.leaves);
                let unread_data =
                    (0..group.zero.len()).any(|i| group.win.unread[i] && !group.zero[i]);
                if leaves.is_none() && unread_data {
                    return Err(not_read(url, g));
                }
                let mut win = group.win;
                // Not read at all (known from the previous cycle): only known zeros can
                // be shipped from it (checked in group_frames), so zeros stand in.
                if win.buf.len() < group.len {
                    win.buf.resize(group.len);
                }
                inflight.spawn(ship.group(g, stream, win, leaves, chunk));
            }
            g += 1;
            progress.update(done);
        }
        while let Some(r) = inflight.join_next().await {
            joined(r)?;
        }
        Ok(())
    }
    .await;
    inflight.abort_all();
    tracing::debug!(secs = t0.elapsed().as_secs_f64(), "source pass done");
    drop(senders);
    // A failed stream explains a failed pass better than the pass's own error.
    for s in streams {
        match s.await {
            Ok(Ok(_ack)) => {}
            Ok(Err(status)) => return Err(status_error(url, status)),
            Err(join) => {
                return Err(CopyError::Remote {
                    url: url.to_string(),
                    code: RemoteCode::Error,
                    message: join.to_string(),
                    refusal: None,
                });
            }
        }
    }
    pass?;
    let root = merkle.finish(size, chunk);
    let complete = ids.len() as u64 == size.div_ceil(chunk.get()) * 32;
    let ids = tonic::codegen::Bytes::from(if complete { ids } else { Vec::new() });
    // Ids that would not fit a message are not sent: the agent then keeps no index.
    let fits = ids.len() <= transport::MAX_MESSAGE / 2;
    let fin = client
        .finish(proto::FinishRequest {
            session,
            verify: copy.verify,
            chunk_ids: if fits {
                ids.clone()
            } else {
                Default::default()
            },
            cycle_root: cycle.map(|_| root.0.to_vec().into()).unwrap_or_default(),
            release_hold: false,
        })
        .await
        .map_err(|s| status_error(url, s))?
        .into_inner();
    if copy.verify {
        if fin.root[..] != root.0[..] {
            return Err(CopyError::VerifyFailed {
                src: source.path().into(),
                dst: url.to_string().into(),
                offset: 0,
            });
        }
        sum.verified = true;
    }
    if copy.verify || cycle.is_some() {
        sum.root = Some(root.to_hex());
    }
    sum.bytes_written = sent.written.load(Relaxed);
    sum.bytes_zeroed = sent.zeroed.load(Relaxed);
    sum.pages_written = sent.pages.load(Relaxed);
    sum.wire_bytes = sent.wire.load(Relaxed);
    Ok((sum, ids.into()))
}

/// The secondary differs in a chunk this cycle did not read (it trusted the previous
/// cycle's index): the cycle fails rather than ship what it has not read.
fn not_read(url: &AgentUrl, g: u64) -> CopyError {
    CopyError::Remote {
        url: url.to_string(),
        code: RemoteCode::StaleBase,
        message: format!(
            "group {g} differs on the secondary in a chunk this cycle did not read: the \
             secondary changed after the previous cycle was applied"
        ),
        refusal: None,
    }
}

/// Which frames of a group are compressed (where a sample shows it pays).
#[derive(Clone, Copy)]
struct Compression {
    /// Whole chunks onto zeros.
    whole: bool,
    /// Changed pages onto older data.
    deltas: bool,
}

/// Frames that bring the remote copy of group `g` up to date: the remote leaves tell
/// which chunks differ, the remote page hashes which of their pages.
#[allow(clippy::too_many_arguments)]
async fn group_frames(
    client: &mut Client,
    url: &AgentUrl,
    session: &str,
    key: &chunker::ChunkKey,
    g: u64,
    win: chunker::Window,
    leaves: Option<&[ChunkId]>,
    chunk: chunker::ChunkSize,
    compress: Compression,
    changed: Option<&[std::ops::Range<u64>]>,
    their_leaves: Option<Vec<ChunkId>>,
) -> Result<Vec<proto::DataFrame>> {
    let first = g * GROUP_CHUNKS as u64;
    let ranges: Vec<_> = win.chunk_ranges(chunk).collect();
    let mut onto_zeros = Vec::new();
    let mut onto_data = Vec::new();
    // Without leaves, the agent's group is all zeros: every chunk goes onto zeros. Its
    // leaves are asked for only where they are not known already.
    let theirs = match (leaves, their_leaves) {
        (None, _) => Vec::new(),
        (Some(_), Some(t)) => t,
        (Some(l), None) => tree(client, url, session, 0, first, l.len() as u32).await?,
    };
    for (i, r) in ranges.iter().enumerate() {
        let Some(leaves) = leaves else {
            onto_zeros.push(i);
            continue;
        };
        let their = theirs.get(i).copied();
        if their == Some(leaves[i]) {
            continue;
        }
        if their == Some(leaf_hash(key, &ChunkKind::Zero, r.len() as u64)) {
            onto_zeros.push(i);
        } else {
            onto_data.push(i);
        }
    }
    // A chunk taken from the previous cycle's index was not read: it cannot be shipped.
    let zero_leaf = |i: usize| leaf_hash(key, &ChunkKind::Zero, ranges[i].len() as u64);
    if let Some(l) = leaves
        && onto_zeros
            .iter()
            .chain(&onto_data)
            .any(|&i| win.unread[i] && l[i] != zero_leaf(i))
    {
        return Err(not_read(url, g));
    }
    // Where the secondary holds the previous cycle, a changed chunk differs from it only
    // in the extents written since: those pages are shipped without asking it to read
    // and hash its copy.
    let known_pages: Option<Vec<Vec<bool>>> = changed.map(|written| {
        onto_data
            .iter()
            .map(|&i| {
                units_written(
                    written,
                    win.offset + ranges[i].start as u64,
                    ranges[i].len(),
                    PAGE_SIZE,
                )
            })
            .collect()
    });
    let their_pages = if onto_data.is_empty() || known_pages.is_some() {
        Default::default()
    } else {
        let chunks = onto_data.iter().map(|&i| first + i as u64).collect();
        client
            .pages(proto::PagesRequest {
                session: session.into(),
                chunks,
            })
            .await
            .map_err(|s| status_error(url, s))?
            .into_inner()
            .hashes
    };
    let key = key.clone();
    let data: Vec<(usize, std::ops::Range<usize>)> = ranges.into_iter().enumerate().collect();
    let (buf, offset) = (tonic::codegen::Bytes::from_owner(win.buf), win.offset);
    // Page hashing and compression are CPU work: keep them off the async workers.
    let frames = tokio::task::spawn_blocking(move || {
        let mut frames = Vec::new();
        for &i in &onto_zeros {
            let r = data[i].1.clone();
            frames.extend(frames::chunk_frames(
                &key,
                &buf.slice(r.clone()),
                offset + r.start as u64,
                &[],
                compress.whole,
            ));
        }
        let mut pages = &their_pages[..];
        for (j, &i) in onto_data.iter().enumerate() {
            let r = data[i].1.clone();
            let (chunk_data, at) = (buf.slice(r.clone()), offset + r.start as u64);
            if let Some(written) = &known_pages {
                frames.extend(frames::written_frames(
                    &chunk_data,
                    at,
                    &written[j],
                    compress.deltas,
                ));
                continue;
            }
            let n = r.len().div_ceil(PAGE_SIZE) * PAGE_HASH_LEN;
            let (mine, rest) = pages.split_at(n.min(pages.len()));
            pages = rest;
            frames.extend(frames::chunk_frames(
                &key,
                &chunk_data,
                at,
                mine,
                // No page hashes: the agent holds zeros there, the whole chunk goes.
                if mine.is_empty() {
                    compress.whole
                } else {
                    compress.deltas
                },
            ));
        }
        frames
    })
    .await
    .map_err(|e| CopyError::Remote {
        url: url.to_string(),
        code: RemoteCode::Error,
        message: e.to_string(),
        refusal: None,
    })?;
    Ok(frames)
}
