//! The local volume read group by group into Merkle leaves ([`read_groups`], with what
//! an earlier cycle knows: [`KnownChunks`]), and the remote summary's group hashes it is
//! compared with ([`RemoteGroups`]).

use super::{AgentUrl, Client, status_error, units};
use crate::error::{CopyError, RemoteCode};
use chunker::{
    BlockVolume, ChunkId, ChunkKey, ChunkKind, ChunkSize, Window, cv::CvFile, leaf_hash,
    read_chunks_where, read_window_where,
};

/// One group of a local volume as read.
pub(crate) struct Group {
    /// Its bytes: none where no chunk was read (every chunk known from an earlier cycle).
    pub win: Window,
    /// Its length in bytes.
    pub len: usize,
    /// Per chunk: zeros or a hole.
    pub zero: Vec<bool>,
    /// Per chunk: its Merkle leaf.
    pub leaves: Vec<ChunkId>,
    /// Per chunk: its kind.
    pub kinds: Vec<ChunkKind>,
    /// Bytes read from the volume for this group.
    pub bytes_read: u64,
}

impl Group {
    /// Sets the group's chunk kinds, and so its leaves.
    fn set_kinds(&mut self, key: &ChunkKey, chunk: ChunkSize, kinds: Vec<ChunkKind>) {
        self.leaves = kinds
            .iter()
            .zip(self.chunk_ranges(chunk))
            .map(|(k, r)| leaf_hash(key, k, r.len() as u64))
            .collect();
        self.kinds = kinds;
    }

    /// The byte ranges (within the group) of its chunks, in order.
    pub(crate) fn chunk_ranges(
        &self,
        chunk: ChunkSize,
    ) -> impl Iterator<Item = std::ops::Range<usize>> + use<> {
        chunker::chunk_ranges(self.len, chunk)
    }

    /// The group hash the agent reports for this group when it holds only zeros.
    pub(crate) fn zero_group_hash(&self, key: &ChunkKey, chunk: ChunkSize) -> ChunkId {
        let zeros: Vec<ChunkId> = self
            .chunk_ranges(chunk)
            .map(|r| leaf_hash(key, &ChunkKind::Zero, r.len() as u64))
            .collect();
        chunker::Summary::group_hash(key, &zeros)
    }
}

/// Reader threads of [`read_groups`]: three groups' reads in flight kept a delta push
/// reading about 15% faster than one on the bench's loop device (four did no better).
const READERS: u64 = 3;
/// Reader threads when only changed chunks are read: scattered small reads, where what
/// counts is how many the disk has in flight, not their size.
const SPARSE_READERS: u64 = 16;

/// What an earlier cycle's index says about a volume's chunks: their kinds then, and
/// which chunks may have changed since (from the file system's extent maps). Chunks not
/// marked changed are not read: their kind is taken from `base`.
#[derive(Clone, Debug)]
pub struct KnownChunks {
    /// Per chunk: its kind at the earlier cycle.
    pub base: Vec<ChunkKind>,
    /// Per chunk: whether it may differ from `base`.
    pub changed: Vec<bool>,
    /// The byte ranges written since (sorted, not overlapping): within a changed chunk,
    /// the only pages that may differ.
    pub ranges: Vec<std::ops::Range<u64>>,
}

impl KnownChunks {
    /// Chunks whose kinds were `base`, of which those touching `ranges` (bytes written
    /// since, in any order) may have changed.
    pub fn new(base: Vec<ChunkKind>, ranges: Vec<std::ops::Range<u64>>, chunk: ChunkSize) -> Self {
        let ranges = chunker::extents::merge_ranges(ranges);
        let n = base.len();
        let mut changed = vec![false; n];
        for r in &ranges {
            let first = ((r.start / chunk.get()) as usize).min(n);
            let end = (r.end.div_ceil(chunk.get()) as usize).min(n);
            changed[first..end].fill(true);
        }
        KnownChunks {
            base,
            changed,
            ranges,
        }
    }

    /// These chunks, with the byte ranges `dirty` (start, end pairs, e.g. a secondary's
    /// own writes since the cycle) also marked changed.
    pub fn with_dirty(&self, dirty: &[u64], chunk: ChunkSize) -> KnownChunks {
        let mut ranges = self.ranges.clone();
        ranges.extend(dirty.chunks_exact(2).map(|p| p[0]..p[1].max(p[0])));
        KnownChunks::new(self.base.clone(), ranges, chunk)
    }
}

/// What a reader of [`read_groups`] hands on for one group: its window, the plan it was
/// read by, the bytes read, and its chunks' kinds where the reader hashed them already.
type ReadGroup = (Window, Vec<units::Read>, u64, Option<Vec<ChunkKind>>);

/// Reads a local volume group by group (GROUP_CHUNKS chunks) on a blocking thread,
/// finding zero chunks and hashing every chunk into its Merkle leaf;
/// groups arrive in order on the returned channel, a few ahead of the consumer.
/// With `known`, only changed chunks are read (the others keep their known kinds), and
/// with a CV file only the written units of those: see [`units`].
pub(crate) fn read_groups(
    volume: std::sync::Arc<BlockVolume>,
    chunk: ChunkSize,
    key: ChunkKey,
    size: u64,
    known: Option<std::sync::Arc<KnownChunks>>,
    cvs: Option<std::sync::Arc<CvFile>>,
) -> tokio::sync::mpsc::Receiver<Result<Group, CopyError>> {
    // One group queued: the readers hold the groups read ahead already (each group is a
    // window of 8 MiB, and every one queued here is memory the push client holds).
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    std::thread::spawn(move || {
        if known.is_none() {
            volume.advise_sequential(); // not for scattered changed chunks: no readahead
        }
        let group_len = chunk.get() * chunker::GROUP_CHUNKS as u64;
        let groups = size.div_ceil(group_len);
        let t0 = std::time::Instant::now();
        let records = match (&known, &cvs) {
            (Some(k), Some(f)) => Some(units::load_records(k, f, chunk, size)),
            _ => None,
        };
        let loading = t0.elapsed();
        // Where a pass's time goes (debug log): reading and hashing, each summed over the
        // threads doing it.
        let reading = std::sync::atomic::AtomicU64::new(0);
        let hashing = std::sync::atomic::AtomicU64::new(0);
        // The kinds of group `g`'s chunks, as read into `win` (see units::kinds).
        let hash = |win: &Window, plans: &[units::Read], g: u64, parallel: bool| {
            let started = std::time::Instant::now();
            let kinds = units::kinds(
                &key,
                chunk,
                win,
                plans,
                known.as_deref(),
                g as usize * chunker::GROUP_CHUNKS,
                cvs.as_deref(),
                parallel,
            );
            hashing.fetch_add(
                started.elapsed().as_micros() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            kinds
        };
        let readers = if known.is_some() {
            SPARSE_READERS
        } else {
            READERS
        };
        // Group `g`, read (and with `known`, hashed) by reader `g % readers`; `None` past
        // the last group. Windows are not reused: each goes on to the consumer.
        let read = |g: usize, _: Option<ReadGroup>| -> Option<Result<ReadGroup, CopyError>> {
            let g = g as u64;
            if g >= groups {
                return None;
            }
            let offset = g * group_len;
            let len = group_len.min(size - offset) as usize;
            let first_chunk = g as usize * chunker::GROUP_CHUNKS;
            let plans = units::plan(
                known.as_deref(),
                records.as_ref(),
                chunk,
                first_chunk,
                offset,
                len,
            );
            let mut win = Window::default();
            let started = std::time::Instant::now();
            let wanted = |i: usize| matches!(plans[i], units::Read::Whole);
            let whole = (0..plans.len()).any(wanted);
            let units = plans.iter().any(|p| matches!(p, units::Read::Units { .. }));
            // Scattered changed chunks are read without a hole search (see
            // read_chunks_where); a group with nothing to read gets no buffer at all.
            let r = if known.is_none() {
                read_window_where(&volume, chunk, offset, len, wanted, &mut win)
            } else if whole || units {
                read_chunks_where(&volume, chunk, offset, len, wanted, &mut win)
            } else {
                win.offset = offset;
                win.unread = vec![true; plans.len()];
                Ok(())
            }
            .map_err(CopyError::from)
            .and_then(|()| {
                let whole = (0..plans.len())
                    .filter(|&i| !win.unread[i])
                    .map(|i| chunk.get().min(len as u64 - i as u64 * chunk.get()))
                    .sum::<u64>();
                let units = units::read_units(&volume, chunk, &plans, &mut win).map_err(|e| {
                    chunker::ChunkerError::Read {
                        path: volume.path().into(),
                        offset,
                        cause: e,
                    }
                })?;
                Ok(whole + units)
            });
            reading.fetch_add(
                started.elapsed().as_micros() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            // Scattered chunks are hashed here, by the readers side by side, not one group
            // at a time by the thread that orders them.
            let kinds = (known.is_some() && r.is_ok()).then(|| hash(&win, &plans, g, false));
            Some(r.map(|read| (win, plans, read, kinds)))
        };
        // Readers take turns by group, each holding the group it read until this thread
        // takes it (depth 0: a window each, not two, for the push client's memory), so the disk
        // always has several groups' reads in flight while this one finds zeros and hashes
        // (whole groups, in parallel on the rayon pool; the few scattered chunks of a
        // cycle are hashed by their readers instead). A reader stops at its first error,
        // or when this thread stops taking groups (dropping `turns`).
        chunker::read_in_turns(0, readers as usize, read, |mut turns| {
            for g in 0..groups {
                let (win, plans, bytes_read, kinds) = match turns.next() {
                    Some(Ok(read)) => read,
                    Some(Err(e)) => {
                        let _ = tx.blocking_send(Err(e));
                        return;
                    }
                    None => {
                        // A reader died: say so, or the consumer would take the end of
                        // the channel for the end of the volume.
                        let died = chunker::ChunkerError::Read {
                            path: volume.path().into(),
                            offset: g * group_len,
                            cause: std::io::Error::other("the reader thread failed"),
                        };
                        let _ = tx.blocking_send(Err(CopyError::from(died)));
                        return;
                    }
                };
                let mut group = Group {
                    win,
                    len: group_len.min(size - g * group_len) as usize,
                    zero: Vec::new(),
                    leaves: Vec::new(),
                    kinds: Vec::new(),
                    bytes_read,
                };
                let kinds = kinds.unwrap_or_else(|| hash(&group.win, &plans, g, true));
                group.zero = kinds.iter().map(|k| *k == ChunkKind::Zero).collect();
                group.set_kinds(&key, chunk, kinds);
                // The consumer went away: stop reading (its own error explains why).
                if tx.blocking_send(Ok(group)).is_err() {
                    return;
                }
            }
        });
        tracing::debug!(
            records_secs = loading.as_secs_f64(),
            reading_secs = reading.into_inner() as f64 / 1e6,
            readers,
            hashing_secs = hashing.into_inner() as f64 / 1e6,
            "volume read"
        );
    });
    rx
}

/// Group hashes of the remote summary, fetched in batches as the pass reaches them.
pub(crate) struct RemoteGroups {
    session: String,
    first: u64,
    hashes: Vec<ChunkId>,
}

const GROUP_BATCH: u32 = 4096;

impl RemoteGroups {
    pub(crate) fn new(session: String) -> Self {
        RemoteGroups {
            session,
            first: 0,
            hashes: Vec::new(),
        }
    }

    /// The remote hash of group `g`.
    pub(crate) async fn get(
        &mut self,
        client: &mut Client,
        url: &AgentUrl,
        g: u64,
    ) -> Result<ChunkId, CopyError> {
        if g < self.first || g >= self.first + self.hashes.len() as u64 {
            self.hashes = tree(client, url, &self.session, 1, g, GROUP_BATCH).await?;
            self.first = g;
        }
        self.hashes
            .get((g - self.first) as usize)
            .copied()
            .ok_or_else(|| CopyError::Remote {
                url: url.to_string(),
                code: RemoteCode::Protocol,
                message: format!(
                    "the agent has no group {g}: do both sides agree on the volume size?"
                ),
                refusal: None,
            })
    }
}

/// Node hashes of the remote summary at `level`.
pub(crate) async fn tree(
    client: &mut Client,
    url: &AgentUrl,
    session: &str,
    level: u32,
    first: u64,
    count: u32,
) -> Result<Vec<ChunkId>, CopyError> {
    let r = client
        .tree(transport::proto::TreeRequest {
            session: session.into(),
            level,
            first,
            count,
        })
        .await
        .map_err(|s| status_error(url, s))?
        .into_inner();
    Ok(r.hashes
        .chunks_exact(32)
        .map(|c| ChunkId(c.try_into().expect("32 bytes")))
        .collect())
}
