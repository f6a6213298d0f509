//! `snapshot create`: a block volume into the repository, uploading only new chunks.
//!
//! A new chunk whose place held a data chunk in the parent snapshot (the previous one of
//! the same volume) is compared page by page with that chunk (or with its base, when
//! the parent's chunk is itself a delta): if few 4 KiB pages differ it is stored as a
//! delta of those pages (docs/ARCHITECTURE.md), so scattered small writes cost about what
//! they wrote. The parent's chunk list is streamed one list blob at a time.
//!
//! The pages are compared by their BLAKE3 CVs where the local cache kept the base's
//! ([`PageCvs`]), so the base is not read back from the repository; else the base is
//! fetched (a window ahead) and compared byte by byte.

use chunker::{
    BlockVolume, ChunkId, ChunkKind, ChunkSize, Window,
    cv::{Cv, CvFile, UnitHasher},
    for_each_window_at, hash_chunks,
};
use rayon::prelude::*;
use snapshots::{
    BlobKind, BlobLoc, Bytes, CHUNKS_PER_LIST, Content, DELTA_PAGE, FinishedPack, Index, Manifest,
    PackBuilder, PackId, RepoError, Repository, Snapshot, SnapshotSummary, SpareBuffers, Uploader,
    delta_bitmap, encode_delta, encode_list, hex, make_delta, sealed_len,
};
use std::{
    collections::{HashMap, HashSet},
    path::Path,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Instant,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

/// Options of `mover snapshot create`.
#[derive(Clone, Debug, clap::Args)]
pub struct CreateOptions {
    /// Tag the snapshot (repeat for several tags).
    #[arg(long = "tag", value_name = "TAG")]
    pub tags: Vec<String>,
    /// The volume's name in the repository [default: its canonical path]. Snapshots
    /// with one name form that volume's history (parents, retention).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// Pack uploads in flight at once (each holds a 16 MiB pack in memory: with 2, a
    /// first snapshot of a 4 GiB volume into a directory peaked at 191 MiB, restic's at
    /// 120 MiB, in under a quarter of its time; 1 is slower; raise it for a distant S3).
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub uploads: usize,
    /// Store every changed chunk whole, never as a delta of the parent snapshot's chunk.
    #[arg(long)]
    pub no_deltas: bool,
    /// Trees: do not store extended attributes and POSIX ACLs.
    #[arg(long)]
    pub no_xattrs: bool,
    /// Where progress is shown (bytes read).
    #[arg(skip)]
    pub progress: crate::copy::SharedProgress,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            progress: Default::default(),
            tags: Vec::new(),
            name: None,
            uploads: 2,
            no_deltas: false,
            no_xattrs: false,
        }
    }
}

/// What the reading side produced.
struct Produced {
    lists: Vec<String>,
    sum: SnapshotSummary,
    size: u64,
}

/// Takes a snapshot of the block volume at `volume` into `repo` (see the module docs),
/// or of the directory at `volume` ([`super::create_tree_snapshot`]).
pub async fn create_snapshot(
    repo: Arc<Repository>,
    volume: &Path,
    opts: &CreateOptions,
) -> Result<Snapshot, RepoError> {
    if std::fs::metadata(volume).is_ok_and(|m| m.is_dir()) {
        return super::create_tree_snapshot(repo, volume, opts).await;
    }
    let started = Instant::now();
    let vol = BlockVolume::open(volume)?;
    let name = match &opts.name {
        Some(n) => n.clone(),
        None => std::fs::canonicalize(volume)
            .unwrap_or_else(|_| volume.to_path_buf())
            .display()
            .to_string(),
    };
    let (index, parent_snap) = index_and_parent(&repo, &name).await?;
    let parent = parent_snap.as_ref().map(|s| s.id.clone());
    tracing::info!(volume = %name, parent = ?parent, indexed_blobs = index.len(), "snapshot: reading the volume");
    let parent_chunks = parent_snap
        .filter(|_| !opts.no_deltas)
        .and_then(|s| ParentChunks::new(&s.manifest.content, repo.chunk_size()));

    let index = Arc::new(index);
    let name_for_pages = name.clone();
    let (mut produced, packs, bytes) = {
        let (read_repo, index) = (repo.clone(), index.clone());
        let rt = tokio::runtime::Handle::current();
        let progress = opts.progress.clone();
        progress.begin("snapshot", vol.size());
        produce_and_upload(&repo, opts.uploads, move |tx| {
            let pages = PageCvs::open(&read_repo, &name_for_pages);
            produce(
                &read_repo,
                &index,
                vol,
                parent_chunks,
                pages,
                &rt,
                tx,
                progress,
            )
        })
        .await?
    };
    produced.sum.packs = packs;
    produced.sum.stored_bytes = bytes;
    produced.sum.duration_secs = started.elapsed().as_secs_f64();
    let content = Content::Block {
        size: produced.size,
        chunk_size: repo.chunk_size().get(),
        chunks_per_list: CHUNKS_PER_LIST,
        lists: produced.lists,
    };
    save_manifest(
        &repo,
        name,
        opts.tags.clone(),
        parent,
        content,
        produced.sum,
    )
    .await
}

/// Saves the manifest of a new snapshot of volume `name`, stamped with the time now and
/// this host's name, and returns the snapshot.
pub(super) async fn save_manifest(
    repo: &Repository,
    name: String,
    tags: Vec<String>,
    parent: Option<String>,
    content: Content,
    summary: SnapshotSummary,
) -> Result<Snapshot, RepoError> {
    let (time, time_nanos) = snapshots::now_unix_nanos();
    let manifest = Manifest {
        version: 0, // set from the content when saved
        time,
        time_nanos,
        hostname: hostname(),
        volume: name,
        tags,
        parent,
        content,
        summary,
    };
    // The manifest is the commit point: a crash here leaves only packs and their index,
    // which the next run finds (and dedups against) and prune collects.
    crate::node::failpoint("snapshot-before-manifest");
    let snap = repo.save_snapshot(manifest).await?;
    tracing::info!(id = %snap.id, "snapshot saved");
    Ok(snap)
}

/// What a new snapshot of volume `name` dedups against (the index, with packs that
/// an interrupted run uploaded adopted, without those pending deletion), and its parent
/// (the newest snapshot of the volume).
pub(super) async fn index_and_parent(
    repo: &Repository,
    name: &str,
) -> Result<(Index, Option<Snapshot>), RepoError> {
    let mut index = repo.load_dedup_index().await?;
    repo.adopt_unindexed_packs(&mut index).await?;
    let parent = repo
        .snapshots()
        .await?
        .into_iter()
        .rfind(|s| s.manifest.volume == name);
    Ok((index, parent))
}

/// Hands finished packs to the uploader, each only once an upload slot is free: at
/// most `uploads` packs are being uploaded, and a thread that finished a pack holds it
/// until a slot frees (it makes no new one meanwhile). No queue of finished packs builds
/// up between them (measured before: an incremental block snapshot held 4-5 packs of
/// 16 MiB at its peak; now `uploads` + 1).
#[derive(Clone)]
pub(super) struct PackSender {
    tx: mpsc::Sender<(FinishedPack, OwnedSemaphorePermit)>,
    slots: Arc<Semaphore>,
    rt: tokio::runtime::Handle,
    /// Buffers of uploaded packs, for the next ones.
    spares: SpareBuffers,
}

impl PackSender {
    /// An empty pack with room for `bytes`, in an uploaded pack's buffer if one is back.
    pub fn new_pack(&self, bytes: usize) -> PackBuilder {
        PackBuilder::with_capacity_from(&self.spares, bytes)
    }

    /// Waits (blocking the thread) for a free upload slot, then hands `pack` over;
    /// `Err` when the upload has stopped.
    pub fn send(&self, pack: FinishedPack) -> Result<(), RepoError> {
        let stopped = || RepoError::Refused {
            what: "snapshot".into(),
            why: "the upload stopped".into(),
        };
        let slot = self
            .rt
            .block_on(self.slots.clone().acquire_owned())
            .map_err(|_| stopped())?;
        self.tx.blocking_send((pack, slot)).map_err(|_| stopped())
    }
}

/// Runs `produce` on a blocking thread and uploads the packs it sends as they come (at
/// most `uploads` at once, see [`PackSender`]): memory stays a few packs. Returns what
/// it produced, and the packs and bytes uploaded.
pub(super) async fn produce_and_upload<T: Send + 'static>(
    repo: &Arc<Repository>,
    uploads: usize,
    produce: impl FnOnce(PackSender) -> Result<T, RepoError> + Send + 'static,
) -> Result<(T, u64, u64), RepoError> {
    let uploads = uploads.max(1);
    let (tx, mut rx) = mpsc::channel(1);
    let slots = Arc::new(Semaphore::new(uploads));
    // Uploads give a pack back as the producer takes one.
    let spares = SpareBuffers::keeping(2);
    let sender = PackSender {
        tx,
        slots: slots.clone(),
        rt: tokio::runtime::Handle::current(),
        spares: spares.clone(),
    };
    let producer = tokio::task::spawn_blocking(move || produce(sender));
    let mut uploader = Uploader::new(repo.clone(), uploads).returning_buffers_to(spares);
    let mut upload_err = None;
    while let Some((pack, slot)) = rx.recv().await {
        if let Err(e) = uploader.add_holding(pack, slot).await {
            upload_err = Some(e);
            break;
        }
    }
    // A producer waiting for a slot must not wait for uploads that will not end.
    slots.close();
    drop(rx);
    let produced = producer.await.map_err(|e| RepoError::Refused {
        what: "snapshot reader".into(),
        why: format!("failed: {e}"),
    })?;
    if let Some(e) = upload_err {
        return Err(e);
    }
    let produced = produced?;
    let (packs, bytes) = uploader.finish().await?;
    Ok((produced, packs, bytes))
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// How a span of the volume is read: by two stripes at once, one taking its windows from
/// the front and the other from the back, until they meet. A volume holds regions whose
/// data compresses (where the CPUs are the limit) and regions whose data does not
/// (stored raw: every byte read is also written, and the disk is the limit), each
/// hundreds of megabytes. One pass does them one after the other, so the disk idles in
/// the first kind and the CPUs in the second; two passes at different places overlap
/// them where the volume allows, and meeting wherever they meet, neither waits for the
/// other at the end. The bench's 4 GiB first snapshot, cold, alternating runs: 3.75-4.19
/// s against 4.25-4.49 s in one pass.
struct Meeting {
    /// The span's first byte, and its number of windows.
    start: u64,
    windows: u64,
    step: u64,
    /// Windows taken from the front and from the back.
    taken: Mutex<(u64, u64)>,
}

impl Meeting {
    fn new(span: std::ops::Range<u64>, step: u64) -> Self {
        Meeting {
            start: span.start,
            windows: (span.end - span.start).div_ceil(step),
            step,
            taken: Mutex::new((0, 0)),
        }
    }

    /// The offset of the `k`-th window of the stripe reading from the back (or the
    /// front), if the other has not taken it. A stripe's two readers take turns, so its
    /// `k`s come nearly in order; each side's count is the highest it took, so neither
    /// side takes a window below the other's highest.
    fn take(&self, from_back: bool, k: u64) -> Option<u64> {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let (front, back) = &mut *taken;
        let window = if from_back {
            let w = self.windows.checked_sub(k + 1)?;
            if w < *front {
                return None;
            }
            *back = (*back).max(k + 1);
            w
        } else {
            if k + *back >= self.windows {
                return None;
            }
            *front = (*front).max(k + 1);
            k
        };
        Some(self.start + window * self.step)
    }
}

/// Reader threads of a snapshot in all, shared by its stripes. Two keep the disk's queue
/// from running dry at a window's end (one waited for its window's last piece before
/// asking for the next); each holds 16 MiB. A first snapshot's two stripes took as
/// long with one reader each as with two (3.75-4.19 s against 3.99-4.20 s).
const READERS: usize = 2;

/// The parts of a snapshot every stripe shares.
struct Shared<'a> {
    repo: &'a Arc<Repository>,
    index: &'a Index,
    vol: &'a BlockVolume,
    pages: Option<&'a PageCvs>,
    /// The page hasher the chunks' ids are merged from (a first snapshot with a cache).
    hash_pages: Option<&'a UnitHasher>,
    rt: &'a tokio::runtime::Handle,
    tx: &'a PackSender,
    progress: &'a crate::copy::SharedProgress,
    /// The chunk and list ids this snapshot stores: each once, whichever stripe finds
    /// it first.
    seen: Mutex<HashSet<ChunkId>>,
    /// Set by a stripe that failed, so the others stop at their next window.
    failed: AtomicBool,
}

impl Shared<'_> {
    /// Sends `pack` to the uploader, waiting for a free slot.
    fn send(&self, pack: PackBuilder) -> Result<(), RepoError> {
        self.tx.send(self.repo.finish_pack(pack))
    }

    /// Whether `id` is new to the repository and to this snapshot (then it is this
    /// caller's to store).
    fn first_sight(&self, id: &ChunkId) -> bool {
        !self.index.contains(id)
            && self
                .seen
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(*id)
    }
}

/// The blocking side: reads and hashes the volume in spans of one chunk list each, each
/// span by two stripes at once (see [`Meeting`]; each seals new chunks into packs of its
/// own, so a pack holds neighbouring chunks), builds the chunk list, and sends full
/// packs to the uploader.
#[allow(clippy::too_many_arguments)] // the one place a snapshot's parts meet
fn produce(
    repo: &Arc<Repository>,
    index: &Index,
    vol: BlockVolume,
    parent: Option<ParentChunks>,
    pages: Option<PageCvs>,
    rt: &tokio::runtime::Handle,
    tx: PackSender,
    progress: crate::copy::SharedProgress,
) -> Result<Produced, RepoError> {
    let chunk = repo.chunk_size();
    let size = vol.size();
    // Deeper read-ahead for windows read through the page cache, as a single pass had.
    vol.advise_sequential();
    // Without a parent every chunk is new and its page CVs are kept: its id is merged
    // from them, so each byte is hashed once. With one, most chunks are as before, and
    // a whole chunk hashes faster than its pages.
    let hash_pages = pages
        .as_ref()
        .filter(|_| parent.is_none())
        .map(PageCvs::hasher);
    let shared = Shared {
        repo,
        index,
        vol: &vol,
        pages: pages.as_ref(),
        hash_pages,
        rt,
        tx: &tx,
        progress: &progress,
        seen: Mutex::default(),
        failed: AtomicBool::new(false),
    };
    // A first snapshot seals and writes all it reads: two stripes, from the front and
    // from the back, one reader each. With a parent, most chunks are only read and
    // hashed, and one stripe with both readers reads fastest (two stripes of one reader
    // took 2.83-3.19 s against 2.27-2.76 s for the bench's 4 GiB incremental).
    let mut stripes = vec![Stripe::new(&shared, parent.clone())];
    if parent.is_none() {
        stripes.push(Stripe::new(&shared, None));
    }
    let readers = READERS / stripes.len();
    let mut list_pack = PackBuilder::new();
    let mut lists = Vec::new();
    let span_len = CHUNKS_PER_LIST * chunk.get();
    let step = chunker::window_len(chunk) as u64;
    for span_start in (0..size).step_by(span_len as usize) {
        let span_end = (span_start + span_len).min(size);
        let meeting = Meeting::new(span_start..span_end, step);
        let mut windows = std::thread::scope(|scope| {
            let running: Vec<_> = stripes
                .iter_mut()
                .zip([false, true])
                .map(|(stripe, from_back)| {
                    let (shared, meeting) = (&shared, &meeting);
                    scope.spawn(move || {
                        let window_at = |k: usize| meeting.take(from_back, k as u64);
                        stripe.read(shared, readers, window_at).inspect_err(|_| {
                            shared.failed.store(true, Ordering::Relaxed);
                        })
                    })
                })
                .collect();
            let mut windows = Vec::new();
            let (mut first_err, mut stopped) = (None, false);
            for run in running {
                match run.join().expect("a snapshot stripe panicked") {
                    Ok(Some(w)) => windows.extend(w),
                    Ok(None) => stopped = true,
                    Err(e) => {
                        first_err.get_or_insert(e);
                    }
                }
            }
            match (first_err, stopped) {
                (Some(e), _) => Err(e),
                (None, true) => Err(RepoError::Refused {
                    what: "snapshot".into(),
                    why: "a stripe stopped without an error".into(),
                }),
                (None, false) => Ok(windows),
            }
        })?;
        windows.sort_unstable_by_key(|(at, _)| *at);
        let kinds: Vec<ChunkKind> = windows.into_iter().flat_map(|(_, k)| k).collect();
        // A list short of a chunk would restore a wrong volume: refuse to commit it.
        let want = (span_end - span_start).div_ceil(chunk.get());
        if kinds.len() as u64 != want {
            return Err(RepoError::Refused {
                what: "snapshot".into(),
                why: format!(
                    "read {} of the {want} chunks from byte {span_start} (a bug: please report it)",
                    kinds.len()
                ),
            });
        }
        let enc = encode_list(&kinds);
        let id = repo.chunk_key().chunk_id(&enc);
        lists.push(hex(&id.0));
        if shared.first_sight(&id) {
            list_pack.push(
                BlobKind::List,
                id,
                &repo.seal_blob(BlobKind::List, &id, &enc),
            );
        }
        if list_pack.len() >= repo.pack_size() {
            shared.send(std::mem::take(&mut list_pack))?;
        }
    }
    let mut sum = SnapshotSummary::default();
    for stripe in stripes {
        stripe.finish(&shared, &mut sum)?;
    }
    if !list_pack.is_empty() {
        shared.send(list_pack)?;
    }
    Ok(Produced { lists, sum, size })
}

/// A window's offset and its chunks' kinds.
type WindowKinds = (u64, Vec<ChunkKind>);

/// One stripe's state, kept from span to span: the data pack it is filling, the
/// chunks it sealed but has not packed yet, the chunks waiting for their bases, and its
/// share of the summary.
struct Stripe {
    parent: Option<ParentChunks>,
    data_pack: PackBuilder,
    /// The batch sealed last, packed with the next one (or at the end).
    unpacked: Vec<SealedChunk>,
    waiting: Option<Waiting>,
    /// Sealed chunks' buffers, given back once packed.
    sealed_spares: SpareBuffers,
    sum: SnapshotSummary,
}

impl Stripe {
    fn new(shared: &Shared<'_>, parent: Option<ParentChunks>) -> Self {
        let chunk = shared.repo.chunk_size();
        Stripe {
            parent,
            data_pack: shared.tx.new_pack(data_pack_room(shared.repo)),
            unpacked: Vec::new(),
            waiting: None,
            // 16 MiB of them, two windows' worth of 1 MiB chunks (one window sealed
            // while the one before is packed).
            sealed_spares: SpareBuffers::keeping(((16 << 20) / chunk.bytes()).max(2)),
            sum: SnapshotSummary::default(),
        }
    }

    /// Reads, hashes and stores the windows `window_at` gives (see
    /// [`chunker::for_each_window_at`]); returns each one's offset and chunks' kinds, or
    /// `None` where it stopped because another stripe failed (whose error is the cause).
    fn read(
        &mut self,
        shared: &Shared<'_>,
        readers: usize,
        window_at: impl Fn(usize) -> Option<u64> + Sync,
    ) -> Result<Option<Vec<WindowKinds>>, RepoError> {
        let chunk = shared.repo.chunk_size();
        let mut windows = Vec::new();
        let mut stopped = false;
        let read = for_each_window_at::<RepoError>(
            shared.vol,
            chunk,
            readers,
            window_at,
            |win: &mut Window| {
                if shared.failed.load(Ordering::Relaxed) {
                    stopped = true;
                    return Err(RepoError::Refused {
                        what: "snapshot".into(),
                        why: "stopped: another stripe failed".into(),
                    });
                }
                let kinds = self.window(shared, win)?;
                windows.push((win.offset, kinds));
                Ok(())
            },
        );
        match read {
            Err(_) if stopped => Ok(None),
            Err(e) => Err(e),
            Ok(()) => Ok(Some(windows)),
        }
    }

    /// Hashes window `win`, stores its new chunks (or leaves them waiting for their
    /// bases), and returns its chunks' kinds.
    fn window(&mut self, shared: &Shared<'_>, win: &Window) -> Result<Vec<ChunkKind>, RepoError> {
        let (repo, chunk) = (shared.repo, shared.repo.chunk_size());
        let (kinds, mut cvs) = hash_window(repo.chunk_key(), chunk, win, shared.hash_pages);
        let ranges: Vec<_> = win.chunk_ranges(chunk).collect();
        shared
            .progress
            .add(ranges.iter().map(|r| r.len() as u64).sum());
        let mut new = Vec::new();
        for (i, k) in kinds.iter().enumerate() {
            match k {
                ChunkKind::Zero => self.sum.zero_chunks += 1,
                ChunkKind::Data(id) => {
                    self.sum.data_chunks += 1;
                    self.sum.data_bytes += ranges[i].len() as u64;
                    if shared.first_sight(id) {
                        new.push((i, *id));
                    }
                }
            }
        }
        // The base each new chunk may be a delta of: known by its page CVs where
        // this host kept them, else its sealed blob is fetched.
        let first = win.offset / chunk.get();
        let chunks: Vec<NewChunk> = new
            .iter()
            .map(|(i, id)| NewChunk {
                at: first + *i as u64,
                id: *id,
                plain: &win.buf[ranges[*i].clone()],
                cvs: cvs[*i].take(),
            })
            .collect();
        let bases: Vec<Option<(ChunkId, BlobLoc)>> = chunks
            .iter()
            .map(|c| {
                self.parent
                    .as_mut()?
                    .base_at(repo, shared.index, shared.rt, c.at)
            })
            .collect();
        let bases = match shared.pages {
            Some(p) => p.known_bases(&chunks, bases),
            None => bases.into_iter().map(Base::from).collect(),
        };
        let fetch = start_fetch(repo, shared.rt, &bases);
        // The window before's new chunks first (their bases were fetched while this
        // window was hashed), so chunks go into packs in the stripe's order.
        self.store_waiting(shared)?;
        match fetch {
            // Nothing to fetch (a first snapshot, new data, bases known by their
            // page CVs): sealed at once, no copy.
            None => self.store(shared, &chunks, &bases, &HashMap::new())?,
            // The bases are read while the next window is hashed; the chunks wait
            // for them, copied out of the window the reader will reuse.
            Some(fetch) => {
                let chunks = chunks
                    .into_iter()
                    .map(|c| (c.at, c.id, c.plain.to_vec(), c.cvs))
                    .collect();
                self.waiting = Some((chunks, bases, fetch));
            }
        }
        Ok(kinds)
    }

    /// Stores the chunks that were waiting for their bases, if any.
    fn store_waiting(&mut self, shared: &Shared<'_>) -> Result<(), RepoError> {
        if let Some((chunks, bases, fetch)) = self.waiting.take() {
            let fetched = finish_fetch(shared.rt, fetch)?;
            let chunks: Vec<_> = chunks.iter().map(NewChunk::from).collect();
            self.store(shared, &chunks, &bases, &fetched)?;
        }
        Ok(())
    }

    /// Seals new chunks (as deltas of their bases where that pays) on every CPU while
    /// the batch sealed before goes into packs: putting a batch into a pack copies it,
    /// and with the sealing waiting for it the CPUs idled a sixth of a first snapshot.
    /// The batch sealed now is packed with the next one (or at the end), so chunks
    /// still go into packs in the stripe's order (the volume's, or for the stripe from
    /// the back, window by window the reverse).
    fn store(
        &mut self,
        shared: &Shared<'_>,
        chunks: &[NewChunk<'_>],
        bases: &[Base],
        fetched: &Fetched,
    ) -> Result<(), RepoError> {
        let before = std::mem::take(&mut self.unpacked);
        let spares = &self.sealed_spares;
        let (data_pack, sum) = (&mut self.data_pack, &mut self.sum);
        let (packed, sealed) = rayon::join(
            || pack(shared, spares, before, data_pack, sum),
            || {
                chunks
                    .par_iter()
                    .zip(bases)
                    .map(|(c, base)| {
                        let out = spares.take(sealed_len(c.plain.len()));
                        seal_new(shared.repo, shared.pages, c, base, fetched, out)
                    })
                    .collect()
            },
        );
        self.unpacked = sealed;
        packed
    }

    /// Stores what is still waiting or unpacked, sends the last data pack, and adds
    /// this stripe's figures to `sum`.
    fn finish(mut self, shared: &Shared<'_>, sum: &mut SnapshotSummary) -> Result<(), RepoError> {
        self.store_waiting(shared)?;
        let last = std::mem::take(&mut self.unpacked);
        pack(
            shared,
            &self.sealed_spares,
            last,
            &mut self.data_pack,
            &mut self.sum,
        )?;
        if !self.data_pack.is_empty() {
            shared.send(self.data_pack)?;
        }
        let s = self.sum;
        sum.data_chunks += s.data_chunks;
        sum.data_bytes += s.data_bytes;
        sum.zero_chunks += s.zero_chunks;
        sum.new_chunks += s.new_chunks;
        sum.new_bytes += s.new_bytes;
        sum.delta_chunks += s.delta_chunks;
        sum.delta_bytes += s.delta_bytes;
        Ok(())
    }
}

/// A data pack closes at the first blob past its size: room for that blob and the
/// pack's trailer.
fn data_pack_room(repo: &Repository) -> usize {
    repo.pack_size() + repo.chunk_size().bytes() + (64 << 10)
}

/// Puts a batch of sealed chunks into `data_pack`, sending it when full, and keeps the
/// page CVs of what the next snapshot compares each place with.
fn pack(
    shared: &Shared<'_>,
    spares: &SpareBuffers,
    batch: Vec<SealedChunk>,
    data_pack: &mut PackBuilder,
    sum: &mut SnapshotSummary,
) -> Result<(), RepoError> {
    for s in batch {
        match s.delta {
            Some((base, differing)) => {
                data_pack.push_delta(s.id, base, &s.sealed);
                sum.delta_chunks += 1;
                sum.delta_bytes += (differing * DELTA_PAGE) as u64;
            }
            None => data_pack.push(BlobKind::Data, s.id, &s.sealed),
        }
        if let (Some(p), Some(cvs)) = (shared.pages, &s.keep) {
            p.put(s.at, cvs);
        }
        spares.give(s.sealed);
        sum.new_chunks += 1;
        sum.new_bytes += s.plain_len as u64;
        if data_pack.len() >= shared.repo.pack_size() {
            let full =
                std::mem::replace(data_pack, shared.tx.new_pack(data_pack_room(shared.repo)));
            shared.send(full)?;
        }
    }
    Ok(())
}

/// The parent snapshot's chunk list, read one list blob at a time as the volume is
/// (each stripe its own copy).
#[derive(Clone)]
struct ParentChunks {
    lists: Vec<String>,
    per_list: u64,
    /// The list blob loaded, and its chunks.
    loaded: Option<(usize, Vec<ChunkKind>)>,
}

impl ParentChunks {
    /// The parent's chunks, if they are comparable (same chunk size).
    fn new(content: &Content, chunk: ChunkSize) -> Option<Self> {
        let Content::Block {
            chunk_size,
            chunks_per_list,
            lists,
            ..
        } = content
        else {
            return None;
        };
        (*chunk_size == chunk.get() && *chunks_per_list > 0).then(|| ParentChunks {
            lists: lists.clone(),
            per_list: *chunks_per_list,
            loaded: None,
        })
    }

    /// The data blob that chunk `n` of the new snapshot may be stored as a delta of:
    /// the parent's chunk at the same place, or its base if that one is a delta itself.
    /// A parent list that cannot be read turns deltas off for its range (with a warning).
    fn base_at(
        &mut self,
        repo: &Repository,
        index: &Index,
        rt: &tokio::runtime::Handle,
        n: u64,
    ) -> Option<(ChunkId, BlobLoc)> {
        let li = (n / self.per_list) as usize;
        if self.loaded.as_ref().is_none_or(|(l, _)| *l != li) {
            let list = self.lists.get(li)?;
            let kinds = rt.block_on(repo.read_list(index, list)).unwrap_or_else(|e| {
                tracing::warn!(list = %list, error = %e, "cannot read the parent's chunk list: no deltas for its chunks");
                Vec::new()
            });
            self.loaded = Some((li, kinds));
        }
        let (_, kinds) = self.loaded.as_ref()?;
        let ChunkKind::Data(pid) = kinds.get((n % self.per_list) as usize)? else {
            return None;
        };
        let loc = index.get(pid)?;
        let base = match (loc.kind, loc.base) {
            (BlobKind::Data, None) => *pid,
            (BlobKind::Delta, Some(b)) => b,
            _ => return None,
        };
        let bloc = index.get(&base)?;
        (bloc.kind == BlobKind::Data && bloc.base.is_none()).then_some((base, bloc))
    }
}

/// The sealed blobs of bases, by id.
type Fetched = HashMap<ChunkId, (BlobLoc, Bytes)>;
/// A fetch of bases under way.
type FetchTask = tokio::task::JoinHandle<Result<Fetched, RepoError>>;
/// A window's new chunks waiting for their bases: each chunk's place, id, bytes
/// (copied out of the window) and page CVs if known, their bases, and the fetch of
/// those.
type Waiting = (Vec<CopiedChunk>, Vec<Base>, FetchTask);
type CopiedChunk = (u64, ChunkId, Vec<u8>, Option<Vec<Cv>>);

/// A chunk to store: its place in the volume (in chunks), id, bytes, and page CVs if
/// its id was merged from them.
struct NewChunk<'a> {
    at: u64,
    id: ChunkId,
    plain: &'a [u8],
    cvs: Option<Vec<Cv>>,
}

impl<'a> From<&'a CopiedChunk> for NewChunk<'a> {
    fn from((at, id, plain, cvs): &'a CopiedChunk) -> Self {
        NewChunk {
            at: *at,
            id: *id,
            plain,
            cvs: cvs.clone(),
        }
    }
}

/// The kinds of a window's chunks and, with `pages`, the page CVs of each chunk holding
/// data, its id merged from them (a chunk in a hole is zero without being hashed).
fn hash_window(
    key: &chunker::ChunkKey,
    chunk: ChunkSize,
    win: &Window,
    pages: Option<&UnitHasher>,
) -> (Vec<ChunkKind>, Vec<Option<Vec<Cv>>>) {
    let Some(h) = pages else {
        let kinds = hash_chunks(key, chunk, win);
        let none = vec![None; kinds.len()];
        return (kinds, none);
    };
    let ranges: Vec<_> = win.chunk_ranges(chunk).collect();
    ranges
        .into_par_iter()
        .enumerate()
        .map(|(i, r)| {
            let data = &win.buf[r];
            if win.unread[i] || !h.merges(data.len()) || chunker::is_zero(data) {
                return (chunker::classify(key, data, win.unread[i]), None);
            }
            let cvs = h.cvs(data);
            (h.kind(&cvs, data.len()), Some(cvs))
        })
        .unzip()
}

/// What a new chunk may be stored as a delta of.
enum Base {
    /// Nothing: stored whole.
    None,
    /// A data blob whose page CVs this host kept: the pages that differ are found
    /// without reading it.
    Pages(ChunkId, Vec<Cv>),
    /// A data blob to fetch and compare with.
    Sealed(ChunkId, BlobLoc),
}

impl From<Option<(ChunkId, BlobLoc)>> for Base {
    fn from(b: Option<(ChunkId, BlobLoc)>) -> Self {
        b.map_or(Base::None, |(id, loc)| Base::Sealed(id, loc))
    }
}

/// The page CVs of the chunks a volume's next snapshot compares with, kept in the
/// repository's local cache: chunk `i`'s record holds the CVs of the data blob last
/// stored whole at place `i` (or read there as a base). A record is used only if its
/// CVs merge into the id of the base it stands for (see [`CvFile`]), so a stale, torn
/// or lost one costs the base's read, never a wrong delta.
struct PageCvs {
    file: CvFile,
    path: std::path::PathBuf,
    /// A write failed (logged once): the next snapshot reads more bases.
    failed: std::sync::atomic::AtomicBool,
}

impl PageCvs {
    /// The page CVs of volume `name` in `repo`'s cache; `None` without a cache (or
    /// where a chunk is one page).
    fn open(repo: &Repository, name: &str) -> Option<PageCvs> {
        let path = crate::copy::index::state_file(
            repo.cache_dir()?,
            "pages",
            std::path::Path::new(name),
            "cvs",
        );
        let dir = path.parent().expect("state files are in a directory");
        let (key, chunk) = (repo.chunk_key(), repo.chunk_size().bytes());
        let opened =
            std::fs::create_dir_all(dir).and_then(|()| CvFile::open_pages(&path, key, chunk));
        match opened {
            Ok(file) => Some(PageCvs {
                file: file?,
                path,
                failed: Default::default(),
            }),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot keep page hashes: changed chunks are compared by reading their bases");
                None
            }
        }
    }

    /// The hasher of the records.
    fn hasher(&self) -> &UnitHasher {
        self.file.hasher()
    }

    /// `bases` (one per chunk of `chunks`) with those whose page CVs are kept known by
    /// them.
    fn known_bases(
        &self,
        chunks: &[NewChunk<'_>],
        bases: Vec<Option<(ChunkId, BlobLoc)>>,
    ) -> Vec<Base> {
        let hasher = self.hasher();
        let wanted = chunks.iter().zip(&bases).filter_map(|(c, b)| {
            let (bid, _) = b.as_ref()?;
            hasher
                .merges(c.plain.len())
                .then_some((c.at, c.plain.len(), ChunkKind::Data(*bid)))
        });
        let mut kept = self.file.load(wanted, usize::MAX);
        chunks
            .iter()
            .zip(bases)
            .map(|(c, b)| match (b, kept.remove(&c.at)) {
                (Some((bid, _)), Some(cvs)) => Base::Pages(bid, cvs),
                (b, _) => Base::from(b),
            })
            .collect()
    }

    /// Keeps `cvs` as place `at`'s record.
    fn put(&self, at: u64, cvs: &[Cv]) {
        if let Err(e) = self.file.put(at, cvs)
            && !self.failed.swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(path = %self.path.display(), error = %e, "cannot keep page hashes: the next snapshot reads more bases");
        }
    }
}

/// Starts fetching the sealed blobs of the distinct bases (ranged reads grouped by pack,
/// the packs' reads concurrently) on the runtime; `None` when there are none.
fn start_fetch(
    repo: &Arc<Repository>,
    rt: &tokio::runtime::Handle,
    bases: &[Base],
) -> Option<FetchTask> {
    let mut by_pack: HashMap<PackId, Vec<(ChunkId, BlobLoc)>> = HashMap::new();
    let mut seen = HashSet::new();
    for b in bases {
        let Base::Sealed(id, loc) = b else { continue };
        if seen.insert(*id) {
            by_pack.entry(loc.pack).or_default().push((*id, *loc));
        }
    }
    if by_pack.is_empty() {
        return None;
    }
    let repo = repo.clone();
    Some(rt.spawn(async move {
        let mut reads = tokio::task::JoinSet::new();
        for (pack, blobs) in by_pack {
            let repo = repo.clone();
            reads.spawn(async move { repo.read_sealed(&pack, blobs).await });
        }
        let mut out = HashMap::new();
        while let Some(r) = reads.join_next().await {
            let got = r.map_err(|e| RepoError::Refused {
                what: "snapshot base read".into(),
                why: format!("failed: {e}"),
            })??;
            out.extend(got.into_iter().map(|(id, loc, sealed)| (id, (loc, sealed))));
        }
        Ok(out)
    }))
}

/// Waits for a fetch of bases (on a blocking thread).
fn finish_fetch(rt: &tokio::runtime::Handle, fetch: FetchTask) -> Result<Fetched, RepoError> {
    rt.block_on(fetch).map_err(|e| RepoError::Refused {
        what: "snapshot base read".into(),
        why: format!("failed: {e}"),
    })?
}

/// A new chunk sealed.
struct SealedChunk {
    /// Its place in the volume, in chunks.
    at: u64,
    id: ChunkId,
    /// Bytes of its plaintext.
    plain_len: usize,
    sealed: Vec<u8>,
    /// For a delta: its base and number of differing pages.
    delta: Option<(ChunkId, usize)>,
    /// The page CVs to keep for its place: of the chunk stored whole, or of the base it
    /// was read as a delta of (`None`: the record there is right already).
    keep: Option<Vec<Cv>>,
}

/// Seals a new chunk: as a delta of its base when few pages differ, else whole (into
/// `out`, a buffer given back, if any). A base that does not open is only logged: the
/// chunk is then stored whole.
fn seal_new(
    repo: &Repository,
    pages: Option<&PageCvs>,
    c: &NewChunk<'_>,
    base: &Base,
    fetched: &Fetched,
    out: Option<Vec<u8>>,
) -> SealedChunk {
    let hasher = pages
        .map(PageCvs::hasher)
        .filter(|h| h.merges(c.plain.len()));
    let page_cvs = |plain: &[u8]| hasher.map(|h| h.cvs(plain));
    // Known when the id was merged from them.
    let own_cvs = || c.cvs.clone().or_else(|| page_cvs(c.plain));
    let as_delta =
        |bid: &ChunkId, plain: Vec<u8>, pages: usize, keep: Option<Vec<Cv>>| SealedChunk {
            at: c.at,
            id: c.id,
            plain_len: c.plain.len(),
            sealed: repo.seal_blob(BlobKind::Delta, &c.id, &plain),
            delta: Some((*bid, pages)),
            keep,
        };
    let mut cvs = None;
    match base {
        Base::Pages(bid, base_cvs) => {
            let mine = own_cvs().expect("kept CVs come with a hasher");
            let differ = |p: usize| mine[p] != base_cvs[p];
            if let Some((bitmap, n)) = delta_bitmap(c.plain.len(), differ) {
                return as_delta(bid, encode_delta(bid, c.plain, &bitmap), n, None);
            }
            cvs = Some(mine);
        }
        Base::Sealed(bid, _) => {
            if let Some((loc, sealed)) = fetched.get(bid) {
                let opened = repo.open_base(bid, loc, sealed).inspect_err(|e| {
                    tracing::warn!(base = %bid.to_hex(), error = %e, "cannot read a base chunk: storing the chunk whole");
                });
                if let Ok(base_plain) = opened
                    && let Some((d, n)) = make_delta(bid, &base_plain, c.plain)
                {
                    return as_delta(bid, d, n, page_cvs(&base_plain));
                }
            }
        }
        Base::None => {}
    }
    SealedChunk {
        at: c.at,
        id: c.id,
        plain_len: c.plain.len(),
        sealed: repo.seal_volume_chunk(&c.id, c.plain, out.unwrap_or_default()),
        delta: None,
        keep: cvs.or_else(own_cvs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use snapshots::{Credentials, Fault, FaultBackend, InitOptions, MemoryBackend};
    use std::time::Duration;

    /// The two stripes of a span, each with two readers taking turns as
    /// `chunker::for_each_window_at`'s do, racing: every window is read exactly once,
    /// the front's in rising order and the back's in falling order.
    #[test]
    fn two_stripes_meet_and_read_every_window_once() {
        for windows in [0u64, 1, 2, 3, 7, 64, 513] {
            for round in 0..20 {
                let step = 8 << 20;
                let meeting = Meeting::new(step * 3..step * (3 + windows), step);
                let taken: Vec<Vec<u64>> = std::thread::scope(|scope| {
                    let sides: Vec<_> = [false, true]
                        .into_iter()
                        .map(|from_back| {
                            let meeting = &meeting;
                            scope.spawn(move || {
                                // Reader r takes items r, r + 2, ... and stops at its
                                // first `None`; the stripe takes items in order until
                                // the one whose turn it is is missing.
                                let per_reader: Vec<Vec<u64>> = std::thread::scope(|inner| {
                                    let readers: Vec<_> = (0..2u64)
                                        .map(|r| {
                                            inner.spawn(move || {
                                                let mut got = Vec::new();
                                                let mut k = r;
                                                while let Some(at) = meeting.take(from_back, k) {
                                                    got.push(at);
                                                    if (k + round) % 3 == 0 {
                                                        std::thread::yield_now();
                                                    }
                                                    k += 2;
                                                }
                                                got
                                            })
                                        })
                                        .collect();
                                    readers.into_iter().map(|h| h.join().unwrap()).collect()
                                });
                                let mut items = Vec::new();
                                for k in 0.. {
                                    match per_reader[k % 2].get(k / 2) {
                                        Some(at) => items.push(*at),
                                        None => break,
                                    }
                                }
                                // A reader never takes past a gap its partner left.
                                assert_eq!(
                                    items.len(),
                                    per_reader[0].len() + per_reader[1].len(),
                                    "no window taken past the end of its stripe"
                                );
                                items
                            })
                        })
                        .collect();
                    sides.into_iter().map(|h| h.join().unwrap()).collect()
                });
                let (front, back) = (&taken[0], &taken[1]);
                assert!(front.is_sorted(), "{front:?}");
                assert!(back.iter().rev().is_sorted(), "{back:?}");
                let mut all: Vec<u64> = front.iter().chain(back).copied().collect();
                all.sort_unstable();
                let want: Vec<u64> = (0..windows).map(|w| step * (3 + w)).collect();
                assert_eq!(all, want, "{windows} windows, round {round}");
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_finished_pack_waits_for_a_free_upload_slot() {
        let backend = Arc::new(FaultBackend::new(Arc::new(MemoryBackend::new())));
        let creds = Credentials::Password("pw".into());
        let opts = InitOptions::default();
        let repo = Arc::new(
            Repository::init(backend.clone(), &creds, &opts)
                .await
                .unwrap(),
        );
        // Slow uploads: a producer that did not wait would run ahead of them.
        backend.set_always(Some(Fault::Delay(Duration::from_millis(40))));
        let stored_before = backend.counts().put_bytes;
        let (seal_repo, counts) = (repo.clone(), backend.clone());
        let ((sizes, stored_at_send), packs, _) = produce_and_upload(&repo, 1, move |tx| {
            let (mut sizes, mut stored_at_send) = (Vec::new(), Vec::new());
            for n in 0..4u8 {
                let mut pack = PackBuilder::new();
                let plain = vec![n; 1000 + usize::from(n)];
                let id = seal_repo.chunk_key().chunk_id(&plain);
                let sealed = seal_repo.seal_blob(BlobKind::Data, &id, &plain);
                pack.push(BlobKind::Data, id, &sealed);
                let pack = seal_repo.finish_pack(pack);
                sizes.push(pack.data.len() as u64);
                tx.send(pack)?;
                stored_at_send.push(counts.counts().put_bytes - stored_before);
            }
            Ok((sizes, stored_at_send))
        })
        .await
        .unwrap();
        assert_eq!(packs, 4);
        // With one upload slot, pack n is handed over only once packs 0..n are stored,
        // and pack n itself (40 ms to store) is not yet.
        let stored_before_each: Vec<u64> = (0..4).map(|n| sizes[..n].iter().sum()).collect();
        assert_eq!(stored_at_send, stored_before_each);
    }
}
