//! One hydrating volume: which regions are here, the table of regions being fetched or
//! written (so none is fetched twice, and a fetch never lands on a client's write), the
//! background filler, and the commits that make the bitmap durable after the data.

use super::{
    HydrateError,
    bitmap::{BitmapFile, RegionBitmap},
    source::RegionSource,
};
use mover_engine::copy::zero_range;
use serde::Serialize;
use std::{
    collections::HashMap,
    fs::File,
    io,
    ops::Range,
    os::unix::fs::FileExt,
    path::PathBuf,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
    time::{Duration, Instant},
};
use tokio::{sync::watch, task::JoinSet};
use transport::RateLimiter;

/// Regions the filler fetches in one request.
const FILL_BATCH: u64 = 8;
/// Hole regions the filler marks present in one step.
const HOLE_BATCH: u64 = 4096;
/// A client did I/O this recently: the filler keeps to one region in flight. Long
/// enough to span the pauses of a client working in bursts (a mount, an fsck, a
/// database's lookups), whose next read would otherwise queue behind megabytes of fill.
const CLIENT_QUIET: Duration = Duration::from_secs(1);

/// Settings of a hydration.
#[derive(Clone, Debug)]
pub struct FillOptions {
    /// Filler requests in flight at once (while no client does I/O).
    pub concurrency: usize,
    /// Bytes per second the filler may fetch (client reads are never held back).
    pub bwlimit: Option<u64>,
    /// How often the bitmap is committed while regions arrive.
    pub commit_every: Duration,
}

impl Default for FillOptions {
    fn default() -> Self {
        FillOptions {
            concurrency: 4,
            bwlimit: None,
            commit_every: Duration::from_secs(1),
        }
    }
}

/// Filler fetches in flight and regions per fetch, for `concurrency`, a bandwidth
/// limit and `region`-sized regions. The limit is paid after each fetch, so under one
/// the fetches in flight are what it lets through at once: they are kept to about a
/// second's worth (at least one region).
fn fill_shape(concurrency: usize, bwlimit: Option<u64>, region: u64) -> (usize, u64) {
    let full = (concurrency.max(1), FILL_BATCH);
    let Some(rate) = bwlimit else {
        return full;
    };
    let regions_a_second = (rate / region).max(1);
    let batch = regions_a_second.min(FILL_BATCH);
    let in_flight = (regions_a_second / batch).clamp(1, full.0 as u64) as usize;
    (in_flight, batch)
}

/// Where a hydration is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Phase {
    /// Regions are arriving.
    Hydrating,
    /// The source cannot be reached or fails: missing regions read as EIO, the filler
    /// retries with backoff.
    Degraded,
    /// Every region is here; the volume is an ordinary local volume.
    Complete,
    /// Stopped by the user: nothing more is fetched until it is started again. What
    /// arrived stays served (a device in use keeps working); a missing region reads as
    /// EIO.
    Cancelled,
}

/// What a hydration has done, for status and metrics.
#[derive(Clone, Debug, Serialize)]
pub struct Progress {
    /// The phase.
    pub phase: Phase,
    /// Regions in the volume and those present.
    pub regions: u64,
    /// Regions present (fetched, holes, or written by clients).
    pub present: u64,
    /// Region size in bytes.
    pub region_size: u64,
    /// Volume size in bytes.
    pub size: u64,
    /// Bytes fetched from the source.
    pub bytes_fetched: u64,
    /// Regions fetched because a client needed them.
    pub foreground_fetches: u64,
    /// Regions a client needed whose fetch failed (each attempt; the client got EIO).
    pub foreground_failures: u64,
    /// Regions a client's write covered whole (never fetched).
    pub regions_written: u64,
    /// Seconds since this run of the hydration started.
    pub elapsed_secs: f64,
    /// The last error from the source, while degraded.
    pub last_error: Option<String>,
}

/// A hydrating volume (see the module docs).
pub struct Hydration {
    name: String,
    path: PathBuf,
    file: Arc<File>,
    size: u64,
    region: u64,
    /// The local volume reads as zeros wherever nothing was written (a new sparse image):
    /// holes and zero pages need no write.
    fresh: bool,
    source: Arc<dyn RegionSource>,
    state: Mutex<Regions>,
    bitmap: Arc<Mutex<BitmapFile>>,
    /// Serialises commits (snapshot, fdatasync, bitmap write); held by the blocking
    /// work itself, so a commit whose caller went away still ends before the next.
    committing: Arc<tokio::sync::Mutex<()>>,
    /// True while the filler (`run`) may still write: a new hydration of the same
    /// export waits for it to be false.
    filling: watch::Sender<bool>,
    /// The source's holes, once known.
    allocation: OnceLock<Vec<bool>>,
    started: Instant,
    last_client_io: AtomicU64,
    bytes_fetched: AtomicU64,
    foreground_fetches: AtomicU64,
    foreground_failures: AtomicU64,
    regions_written: AtomicU64,
    /// A client's request was refused for a missing region since the cancel (logged).
    warned_cancelled: AtomicBool,
    health: Mutex<(Phase, Option<String>)>,
    stop: watch::Sender<bool>,
    phase_tx: watch::Sender<Phase>,
    limiter: Option<RateLimiter>,
    opts: FillOptions,
}

struct Regions {
    map: RegionBitmap,
    /// Regions being fetched or written whole; waiters learn when each is released.
    busy: HashMap<u64, watch::Sender<bool>>,
    /// Regions became present since the last commit.
    dirty: bool,
}

/// What claiming a region found.
enum Claim {
    Present,
    Mine,
    Busy(watch::Receiver<bool>),
    /// Missing, and the hydration is cancelled: nothing may fetch it or mark it present
    /// (a new start reloads the bitmap; a change made here would not be in it).
    Stopped,
}

/// Regions this task claimed; released on drop (marked present only if it succeeded),
/// so a cancelled request never leaves a region claimed.
struct Claimed<'a> {
    h: &'a Hydration,
    regions: Vec<u64>,
    present: bool,
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        let mut s = self.h.state.lock().expect("regions lock");
        for &r in &self.regions {
            if self.present && s.map.set(r) {
                s.dirty = true;
            }
            if let Some(tx) = s.busy.remove(&r) {
                let _ = tx.send(true);
            }
        }
    }
}

impl Hydration {
    /// A hydration of `source` into `file` (at `path`), with `map` loaded from (or just
    /// committed to) `bitmap`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        name: String,
        path: PathBuf,
        file: File,
        fresh: bool,
        source: Arc<dyn RegionSource>,
        bitmap: BitmapFile,
        map: RegionBitmap,
        opts: FillOptions,
    ) -> Arc<Self> {
        let phase = if map.is_complete() {
            Phase::Complete
        } else {
            Phase::Hydrating
        };
        Arc::new(Hydration {
            name,
            path,
            file: Arc::new(file),
            size: source.size(),
            region: source.region_size(),
            fresh,
            state: Mutex::new(Regions {
                map,
                busy: HashMap::new(),
                dirty: false,
            }),
            bitmap: Arc::new(Mutex::new(bitmap)),
            committing: Arc::default(),
            filling: watch::channel(true).0,
            allocation: OnceLock::new(),
            started: Instant::now(),
            last_client_io: AtomicU64::new(0),
            bytes_fetched: AtomicU64::new(0),
            foreground_fetches: AtomicU64::new(0),
            foreground_failures: AtomicU64::new(0),
            regions_written: AtomicU64::new(0),
            warned_cancelled: AtomicBool::new(false),
            health: Mutex::new((phase, None)),
            stop: watch::channel(false).0,
            phase_tx: watch::channel(phase).0,
            limiter: opts.bwlimit.map(RateLimiter::new),
            source,
            opts,
        })
    }

    /// The export's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The source, described.
    pub fn source(&self) -> String {
        self.source.describe()
    }

    /// Volume size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Region size in bytes.
    pub fn region_size(&self) -> u64 {
        self.region
    }

    /// The local file.
    pub(crate) fn file(&self) -> &Arc<File> {
        &self.file
    }

    /// Where the volume is.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// A receiver of phase changes (to wait for completion).
    pub fn watch_phase(&self) -> watch::Receiver<Phase> {
        self.phase_tx.subscribe()
    }

    /// Where the hydration is.
    pub fn progress(&self) -> Progress {
        let (phase, last_error) = self.health.lock().expect("health lock").clone();
        let s = self.state.lock().expect("regions lock");
        Progress {
            phase,
            regions: s.map.regions(),
            present: s.map.present(),
            region_size: self.region,
            size: self.size,
            bytes_fetched: self.bytes_fetched.load(Relaxed),
            foreground_fetches: self.foreground_fetches.load(Relaxed),
            foreground_failures: self.foreground_failures.load(Relaxed),
            regions_written: self.regions_written.load(Relaxed),
            elapsed_secs: self.started.elapsed().as_secs_f64(),
            last_error,
        }
    }

    /// Whether region `r` is present.
    pub fn is_present(&self, r: u64) -> bool {
        self.state.lock().expect("regions lock").map.get(r)
    }

    /// Whether the source says region `r` is a hole (false while that is not known).
    pub fn is_source_hole(&self, r: u64) -> bool {
        self.allocation
            .get()
            .is_some_and(|a| a.get(r as usize) == Some(&false))
    }

    /// The regions `[offset, offset + len)` touches.
    pub fn regions_of(&self, offset: u64, len: u64) -> Range<u64> {
        offset / self.region..(offset + len).div_ceil(self.region)
    }

    /// Byte range of region `r`.
    pub fn region_range(&self, r: u64) -> Range<u64> {
        r * self.region..((r + 1) * self.region).min(self.size)
    }

    fn set_phase(&self, phase: Phase, error: Option<String>) {
        let mut h = self.health.lock().expect("health lock");
        if h.0 == Phase::Cancelled || h.0 == Phase::Complete {
            return;
        }
        *h = (phase, error);
        self.phase_tx.send_replace(phase);
    }

    /// Notes client I/O: the filler backs off while clients are busy.
    pub fn client_io(&self) {
        self.last_client_io
            .store(self.started.elapsed().as_millis() as u64 + 1, Relaxed);
    }

    fn clients_busy(&self) -> bool {
        let last = self.last_client_io.load(Relaxed);
        last != 0
            && (self.started.elapsed().as_millis() as u64 + 1).saturating_sub(last)
                < CLIENT_QUIET.as_millis() as u64
    }

    fn claim(&self, r: u64) -> Claim {
        let mut s = self.state.lock().expect("regions lock");
        if s.map.get(r) {
            Claim::Present
        } else if let Some(tx) = s.busy.get(&r) {
            Claim::Busy(tx.subscribe())
        } else if self.stopped() {
            Claim::Stopped
        } else {
            s.busy.insert(r, watch::channel(false).0);
            Claim::Mine
        }
    }

    /// Makes every region of `regions` present, fetching those that are not (and waiting
    /// for those another task is fetching): what a client's read or CACHE needs.
    pub async fn ensure(&self, regions: Range<u64>) -> io::Result<()> {
        loop {
            let mut mine = Claimed {
                h: self,
                regions: Vec::new(),
                present: false,
            };
            let mut waits = Vec::new();
            for r in regions.clone() {
                match self.claim(r) {
                    Claim::Present => {}
                    Claim::Mine => mine.regions.push(r),
                    Claim::Busy(rx) => waits.push(rx),
                    Claim::Stopped => return Err(self.missing_while_cancelled(r)),
                }
            }
            if mine.regions.is_empty() && waits.is_empty() {
                return Ok(());
            }
            if !mine.regions.is_empty() {
                // Counted once fetched: a source that is down fails every attempt, and
                // those are failures, not fetches.
                let n = mine.regions.len() as u64;
                self.fill(&mine.regions, true).await.map_err(|e| {
                    self.foreground_failures.fetch_add(n, Relaxed);
                    self.set_phase(Phase::Degraded, Some(e.to_string()));
                    io::Error::from_raw_os_error(libc::EIO)
                })?;
                self.foreground_fetches.fetch_add(n, Relaxed);
                mine.present = true;
            }
            drop(mine);
            for mut rx in waits {
                let _ = rx.wait_for(|done| *done).await;
            }
            // Again: a region whose fetch by another task failed is fetched here.
        }
    }

    /// Claims the regions a client's write (or zeroing) covers whole, so no fetch lands
    /// on it, and makes the partly covered ones present first; the returned claim marks
    /// the whole ones present when dropped after the write.
    pub async fn prepare_write(&self, offset: u64, len: u64) -> io::Result<WriteClaim<'_>> {
        let end = offset + len;
        let is_whole = |r: u64| {
            let range = self.region_range(r);
            offset <= range.start && end >= range.end
        };
        // The partly covered regions (at most the first and the last) first, holding no
        // claim meanwhile; then the whole ones in ascending order, so two overlapping
        // writes never wait for each other's claims.
        for r in self.regions_of(offset, len).filter(|&r| !is_whole(r)) {
            self.ensure(r..r + 1).await?;
        }
        let mut whole = Claimed {
            h: self,
            regions: Vec::new(),
            present: false,
        };
        for r in self.regions_of(offset, len).filter(|&r| is_whole(r)) {
            loop {
                match self.claim(r) {
                    Claim::Present => break,
                    Claim::Mine => {
                        whole.regions.push(r);
                        break;
                    }
                    Claim::Busy(mut rx) => {
                        let _ = rx.wait_for(|done| *done).await;
                    }
                    Claim::Stopped => return Err(self.missing_while_cancelled(r)),
                }
            }
        }
        Ok(WriteClaim(whole))
    }

    /// Fetches `regions` (claimed by the caller) from the source and writes them;
    /// returns the bytes fetched.
    async fn fill(&self, regions: &[u64], urgent: bool) -> Result<u64, HydrateError> {
        let mut fetched = 0;
        for run in runs(regions) {
            let bytes = self.region_range(run.start).start..self.region_range(run.end - 1).end;
            if !self.fresh {
                // The local volume holds something else there: zeros first, then the
                // data (the source leaves zero pages out).
                let (file, path, b) = (self.file.clone(), self.path.clone(), bytes.clone());
                blocking(move || {
                    zero_range(&file, &path, b.start, b.end - b.start)
                        .map_err(|e| io::Error::other(e.to_string()))
                })
                .await
                .map_err(|cause| HydrateError::Local {
                    path: self.path.clone(),
                    cause,
                })?;
            }
            let holes = run.clone().all(|r| self.is_source_hole(r));
            if holes {
                continue;
            }
            let pieces = self
                .source
                .fetch(run.start, run.end - run.start, urgent)
                .await?;
            let n: u64 = pieces.iter().map(|(_, b)| b.len() as u64).sum();
            let file = self.file.clone();
            blocking(move || {
                for (off, b) in pieces {
                    file.write_all_at(&b, off)?;
                }
                Ok::<_, io::Error>(())
            })
            .await
            .map_err(|cause| HydrateError::Local {
                path: self.path.clone(),
                cause,
            })?;
            self.bytes_fetched.fetch_add(n, Relaxed);
            fetched += n;
        }
        Ok(fetched)
    }

    /// Makes every write so far durable and commits the bitmap: data first, then the
    /// bitmap that marks it present. A bitmap unchanged since its last commit is not
    /// written: after a cancel, the next start's hydration owns the bitmap file, and a
    /// pod's fsync through this one must not write it.
    pub async fn commit(&self) -> io::Result<()> {
        let one = self.committing.clone().lock_owned().await;
        let map = {
            let mut s = self.state.lock().expect("regions lock");
            let changed = std::mem::take(&mut s.dirty);
            changed.then(|| s.map.clone())
        };
        let (file, bitmap) = (self.file.clone(), self.bitmap.clone());
        let r = blocking(move || {
            let _one = one;
            file.sync_data()?;
            match map {
                Some(map) => bitmap.lock().expect("bitmap lock").commit(&map),
                None => Ok(()),
            }
        })
        .await;
        if r.is_err() {
            self.state.lock().expect("regions lock").dirty = true;
        }
        r
    }

    /// The error of a client request that needs region `r` while the hydration is
    /// cancelled (EIO, as while the source is down); logged once per cancel, so an
    /// operator sees why a pod's I/O fails.
    fn missing_while_cancelled(&self, r: u64) -> io::Error {
        self.foreground_failures.fetch_add(1, Relaxed);
        if !self.warned_cancelled.swap(true, Relaxed) {
            tracing::warn!(
                export = %self.name,
                region = r,
                "a client needs a region that has not arrived, and the hydration is \
                 cancelled: EIO until `mover hydrate start` resumes it"
            );
        }
        io::Error::from_raw_os_error(libc::EIO)
    }

    /// Stops the filler; nothing more is fetched. False if the hydration had already
    /// completed: a complete volume stays complete (its record is being forgotten).
    pub fn cancel(&self) -> bool {
        {
            let mut h = self.health.lock().expect("health lock");
            if h.0 == Phase::Complete {
                return false;
            }
            *h = (Phase::Cancelled, None);
            self.phase_tx.send_replace(Phase::Cancelled);
        }
        self.stop.send_replace(true);
        true
    }

    fn stopped(&self) -> bool {
        *self.stop.borrow()
    }

    /// The next regions for the filler from `next` on, claimed: a run of holes (no fetch)
    /// or of regions to fetch. Empty when nothing is left to claim from `next`.
    fn next_batch(&self, next: &mut u64, fill_max: u64) -> Vec<u64> {
        let mut s = self.state.lock().expect("regions lock");
        let mut r = *next;
        let mut batch = Vec::new();
        while let Some(m) = s.map.next_missing(r) {
            if s.busy.contains_key(&m) {
                r = m + 1;
                continue;
            }
            let hole = self.is_source_hole(m);
            let max = if hole { HOLE_BATCH } else { fill_max };
            let mut e = m;
            while e < s.map.regions()
                && e - m < max
                && !s.map.get(e)
                && !s.busy.contains_key(&e)
                && self.is_source_hole(e) == hole
            {
                batch.push(e);
                e += 1;
            }
            for &b in &batch {
                s.busy.insert(b, watch::channel(false).0);
            }
            *next = e;
            return batch;
        }
        *next = s.map.regions();
        batch
    }

    /// The background filler: learns the source's holes, then fetches every missing
    /// region in order, at most `concurrency` requests at once (one while clients are
    /// busy), retrying a failing source with backoff; commits as it goes; returns when
    /// the volume is complete or the hydration is cancelled.
    pub async fn run(self: Arc<Self>) {
        if !self.stopped() {
            self.fill_until_done().await;
        }
        // Not waited for: a source that is down must not hold up a restart.
        let source = self.source.clone();
        let complete = self.state.lock().expect("regions lock").map.is_complete();
        tokio::spawn(async move { source.close(complete).await });
        self.filling.send_replace(false);
    }

    /// Waits until nothing of this hydration writes to the volume any more: its filler
    /// has returned and no client request holds a region (after [`Hydration::cancel`]).
    pub async fn quiesce(&self) {
        let _ = self.filling.subscribe().wait_for(|f| !*f).await;
        loop {
            let waits: Vec<_> = {
                let s = self.state.lock().expect("regions lock");
                s.busy.values().map(|tx| tx.subscribe()).collect()
            };
            if waits.is_empty() {
                return;
            }
            for mut rx in waits {
                let _ = rx.wait_for(|done| *done).await;
            }
        }
    }

    async fn fill_until_done(self: &Arc<Self>) {
        let mut stop = self.stop.subscribe();
        if self.state.lock().expect("regions lock").map.is_complete() {
            // Complete before a restart that came before the record was dropped.
            self.finish().await;
            return;
        }
        let mut delay = Duration::from_millis(500);
        let alloc = loop {
            match self.source.allocation().await {
                Ok(a) => break a,
                Err(e) => {
                    tracing::warn!(export = %self.name, "cannot learn the source's holes: {e}; retrying in {delay:?}");
                    self.set_phase(Phase::Degraded, Some(e.to_string()));
                    if wait_or_stop(&mut stop, delay).await {
                        return;
                    }
                    delay = (delay * 2).min(Duration::from_secs(10));
                }
            }
        };
        let _ = self.allocation.set(alloc);
        let committer = tokio::spawn(self.clone().commit_loop());
        let mut tasks: JoinSet<Filled> = JoinSet::new();
        let mut next = 0;
        delay = Duration::from_millis(500);
        while !self.stopped() {
            // While clients do I/O: one region at a time, so a client's fetch never
            // queues behind more than a region of the filler's on either disk.
            let (limit, batch_max) = if self.clients_busy() {
                (1, 1)
            } else {
                fill_shape(self.opts.concurrency, self.opts.bwlimit, self.region)
            };
            if tasks.len() >= limit {
                self.settle(tasks.join_next().await, &mut next, &mut delay, &mut stop)
                    .await;
                continue;
            }
            let batch = self.next_batch(&mut next, batch_max);
            if batch.is_empty() {
                if let Some(done) = tasks.join_next().await {
                    self.settle(Some(done), &mut next, &mut delay, &mut stop)
                        .await;
                    continue;
                }
                if self.state.lock().expect("regions lock").map.is_complete() {
                    break;
                }
                // Only regions a client is fetching are left: look again shortly.
                next = 0;
                if wait_or_stop(&mut stop, Duration::from_millis(20)).await {
                    break;
                }
                continue;
            }
            let h = self.clone();
            tasks.spawn(async move {
                let mut claim = Claimed {
                    h: &h,
                    regions: batch.clone(),
                    present: false,
                };
                let r = h.fill(&batch, false).await;
                claim.present = r.is_ok();
                drop(claim);
                // The bandwidth limit is paid after the fetch, with the claim released:
                // a client's read of these regions never waits out the filler's limit.
                if let (Ok(n), Some(l)) = (&r, &h.limiter) {
                    l.take(*n).await;
                }
                (batch, r.map(drop))
            });
        }
        while let Some(done) = tasks.join_next().await {
            let _ = done;
        }
        committer.abort();
        if self.stopped() {
            let _ = self.commit().await;
            return;
        }
        self.finish().await;
    }

    /// Every region is present: commits, and the volume is an ordinary one.
    async fn finish(&self) {
        match self.commit().await {
            Ok(()) => {
                tracing::info!(export = %self.name, fetched = self.bytes_fetched.load(Relaxed), secs = self.started.elapsed().as_secs_f64(), "hydration complete");
                self.set_phase(Phase::Complete, None);
            }
            Err(e) => self.set_phase(
                Phase::Degraded,
                Some(format!("cannot make the hydrated volume durable: {e}")),
            ),
        }
    }

    /// Takes a finished filler task's outcome: on failure, the degraded state, a backoff
    /// pause and a rescan from the failed regions.
    async fn settle(
        &self,
        done: Option<Result<Filled, tokio::task::JoinError>>,
        next: &mut u64,
        delay: &mut Duration,
        stop: &mut watch::Receiver<bool>,
    ) {
        match done {
            Some(Ok((_, Ok(())))) => {
                if *delay > Duration::from_millis(500) {
                    tracing::info!(export = %self.name, "the source answers again");
                }
                *delay = Duration::from_millis(500);
                self.set_phase(Phase::Hydrating, None);
            }
            Some(Ok((batch, Err(e)))) => {
                tracing::warn!(export = %self.name, "fetch of regions {}..={} failed: {e}; retrying in {delay:?}", batch[0], batch[batch.len() - 1]);
                self.set_phase(Phase::Degraded, Some(e.to_string()));
                *next = (*next).min(batch[0]);
                wait_or_stop(stop, *delay).await;
                *delay = (*delay * 2).min(Duration::from_secs(10));
            }
            Some(Err(e)) => tracing::error!(export = %self.name, "filler task failed: {e}"),
            None => {}
        }
    }

    /// Commits every `commit_every` while regions arrive.
    async fn commit_loop(self: Arc<Self>) {
        loop {
            tokio::time::sleep(self.opts.commit_every).await;
            let dirty = self.state.lock().expect("regions lock").dirty;
            if dirty && let Err(e) = self.commit().await {
                tracing::warn!(export = %self.name, "cannot commit the hydration bitmap: {e}");
            }
        }
    }
}

/// A client write's claim on the regions it covers whole; [`WriteClaim::done`] after
/// the write succeeded marks them present.
pub struct WriteClaim<'a>(Claimed<'a>);

impl WriteClaim<'_> {
    /// The write is in the file: its whole regions are present (and never fetched).
    pub fn done(mut self) {
        self.0
            .h
            .regions_written
            .fetch_add(self.0.regions.len() as u64, Relaxed);
        self.0.present = true;
    }
}

/// A filler task's regions and how their fetch went.
type Filled = (Vec<u64>, Result<(), HydrateError>);

/// Consecutive runs of sorted region numbers.
fn runs(regions: &[u64]) -> Vec<Range<u64>> {
    let mut out: Vec<Range<u64>> = Vec::new();
    for &r in regions {
        match out.last_mut() {
            Some(last) if last.end == r => last.end = r + 1,
            _ => out.push(r..r + 1),
        }
    }
    out
}

/// Sleeps `d`; true if the hydration was stopped meanwhile.
async fn wait_or_stop(stop: &mut watch::Receiver<bool>, d: Duration) -> bool {
    let woken = tokio::select! {
        _ = tokio::time::sleep(d) => false,
        _ = stop.wait_for(|s| *s) => true,
    };
    woken || *stop.borrow()
}

/// Runs blocking file work off the async threads.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(io::Error::other(format!("blocking task failed: {e}"))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hydrate::source::Piece;
    use snapshots::Bytes;

    #[test]
    fn under_a_bandwidth_limit_the_filler_lets_through_about_a_second_at_once() {
        const MIB: u64 = 1 << 20;
        assert_eq!(
            fill_shape(4, None, MIB),
            (4, FILL_BATCH),
            "no limit: full speed"
        );
        assert_eq!(
            fill_shape(4, Some(256 << 10), MIB),
            (1, 1),
            "one region, then wait"
        );
        assert_eq!(fill_shape(4, Some(4 * MIB), MIB), (1, 4));
        assert_eq!(fill_shape(4, Some(20 * MIB), MIB), (2, FILL_BATCH));
        assert_eq!(fill_shape(4, Some(1 << 40), MIB), (4, FILL_BATCH));
        assert_eq!(fill_shape(1, Some(512 << 10), 64 << 10), (1, FILL_BATCH));
    }

    /// An in-memory source that counts how often each region is fetched.
    struct Counting {
        data: Vec<u8>,
        region: u64,
        fetched: Mutex<Vec<u32>>,
    }

    #[tonic::async_trait]
    impl RegionSource for Counting {
        fn describe(&self) -> String {
            "memory".into()
        }
        fn size(&self) -> u64 {
            self.data.len() as u64
        }
        fn region_size(&self) -> u64 {
            self.region
        }
        async fn allocation(&self) -> Result<Vec<bool>, HydrateError> {
            // The last two regions are holes.
            let n = self.size().div_ceil(self.region) as usize;
            Ok((0..n).map(|r| r + 2 < n).collect())
        }
        async fn fetch(&self, first: u64, count: u64, _: bool) -> Result<Vec<Piece>, HydrateError> {
            tokio::time::sleep(Duration::from_millis(2)).await;
            let mut out = Vec::new();
            for r in first..first + count {
                self.fetched.lock().unwrap()[r as usize] += 1;
                let (s, e) = (r * self.region, ((r + 1) * self.region).min(self.size()));
                out.push((
                    s,
                    Bytes::copy_from_slice(&self.data[s as usize..e as usize]),
                ));
            }
            Ok(out)
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn no_region_is_fetched_twice_and_writes_are_never_overwritten_by_a_fetch() {
        let dir = tempfile::tempdir().unwrap();
        let region = 64 << 10;
        let regions = 64u64;
        let size = region * regions - 1000; // a short last region
        let mut data = vec![0u8; size as usize];
        for (i, b) in data.iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8 + 1;
        }
        for b in &mut data[(region * (regions - 2)) as usize..] {
            *b = 0; // the holes
        }
        let src = Arc::new(Counting {
            data: data.clone(),
            region,
            fetched: Mutex::new(vec![0; regions as usize]),
        });
        let path = dir.path().join("v.img");
        let file = File::create(&path).unwrap();
        file.set_len(size).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap();
        let bp = dir.path().join("v.bitmap");
        let bitmap = BitmapFile::create(&bp, regions, region).unwrap();
        let h = Hydration::new(
            "v".into(),
            path.clone(),
            file,
            true,
            src.clone(),
            bitmap,
            RegionBitmap::new(regions),
            FillOptions {
                concurrency: 3,
                ..Default::default()
            },
        );
        let filler = tokio::spawn(h.clone().run());
        let mut want = data.clone();
        let mut clients = JoinSet::new();
        for i in 0..24u64 {
            let h = h.clone();
            // Reads from the end (ahead of the filler), whole-region writes, and
            // partial ones across two regions; none overlapping another.
            let r = regions - 3 - 2 * i;
            let (off, len, fill) = match i % 4 {
                0 => (r * region, region, 0xa0 + i as u8),
                1 => (r * region + 100, region, 0xb0 + i as u8),
                _ => (r * region + 17, 0, 0),
            };
            if len > 0 {
                want[off as usize..(off + len) as usize].fill(fill);
            }
            clients.spawn(async move {
                if len == 0 {
                    h.ensure(h.regions_of(off, 1)).await.unwrap();
                    return;
                }
                let claim = h.prepare_write(off, len).await.unwrap();
                h.file()
                    .write_all_at(&vec![fill; len as usize], off)
                    .unwrap();
                claim.done();
            });
        }
        while let Some(r) = clients.join_next().await {
            r.unwrap();
        }
        filler.await.unwrap();
        assert_eq!(h.progress().phase, Phase::Complete);
        let fetched = src.fetched.lock().unwrap().clone();
        assert!(
            fetched.iter().all(|&n| n <= 1),
            "fetched twice: {fetched:?}"
        );
        assert_eq!(
            &fetched[regions as usize - 2..],
            &[0, 0],
            "holes are never fetched"
        );
        assert!(
            std::fs::read(&path).unwrap() == want,
            "the source plus the writes"
        );
        // The bitmap on disk says complete.
        let (_, map) = BitmapFile::open(&bp, regions, region).unwrap();
        assert!(map.is_complete());
    }
}
