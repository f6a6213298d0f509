//! The cycles of the relationships an agent is primary of: one task each, on its
//! interval, never two cycles of one relationship at once.
//!
//! A cycle that overruns its interval delays the next one (it starts as soon as the
//! last ends) and the intervals it covered are counted as missed. A failed cycle leaves
//! the relationship Degraded and is retried at the next interval; a cycle refused for a
//! stale epoch halts the relationship as Fenced until someone resyncs it.

use super::{
    cycle,
    store::{CycleRecord, Halt, Role, Store},
};
use mover_engine::{error::CopyError, node::Exports, remote::RemoteOptions};
use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
    time::Duration,
};
use tokio::sync::{broadcast, mpsc, oneshot};
use transport::control;

/// Upper bounds (seconds) of the cycle duration histogram's buckets.
const DURATION_BUCKETS: [f64; 10] = [0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0];

/// What is known of a relationship's cycles in this process (not persisted).
#[derive(Default)]
pub struct Live {
    /// The last cycle failed.
    pub degraded: bool,
    /// Its error.
    pub last_error: String,
    /// Its kind, where a controller acts on it.
    pub last_error_kind: control::ErrorKind,
    /// Intervals that passed while a cycle was still running.
    pub missed_intervals: u64,
    /// Cycles completed.
    pub cycles_ok: u64,
    /// Cycles failed.
    pub cycles_failed: u64,
    /// Bytes shipped by all cycles.
    pub bytes_shipped: u64,
    /// Per bucket of the cycle-duration histogram (and +Inf): cycles that took at most
    /// that long.
    pub duration_counts: [u64; DURATION_BUCKETS.len() + 1],
    /// Sum of cycle durations (seconds).
    pub duration_sum: f64,
    /// The running cycle's progress: bytes compared, of the total.
    pub progress: Arc<CycleProgress>,
    /// When the running cycle started (`None`: none runs).
    pub busy_since: Option<std::time::Instant>,
}

/// A cycle whose progress has not moved for this long is cancelled and retried: a
/// silent network cut (dropped packets, no reset) can outlast the transport's keepalive
/// while a stream waits on flow control.
pub const STALL: std::time::Duration = std::time::Duration::from_secs(120);

/// Resolves once `progress` has not moved for `stall` (never while it moves); returns
/// how long it stood still.
async fn stalled(progress: &CycleProgress, stall: std::time::Duration) -> std::time::Duration {
    let tick = stall / 12;
    let mut seen = (progress.done.load(Relaxed), progress.total.load(Relaxed));
    let mut still = std::time::Duration::ZERO;
    loop {
        tokio::time::sleep(tick).await;
        let now = (progress.done.load(Relaxed), progress.total.load(Relaxed));
        if now == seen {
            still += tick;
            if still >= stall {
                return still;
            }
        } else {
            (seen, still) = (now, std::time::Duration::ZERO);
        }
    }
}

/// Progress of the cycle running now.
#[derive(Default)]
pub struct CycleProgress {
    /// Bytes compared so far.
    pub done: AtomicU64,
    /// Bytes in the volume (0: no cycle running).
    pub total: AtomicU64,
    /// When it last moved (Unix ms).
    pub moved_ms: AtomicU64,
}

impl mover_engine::Progress for CycleProgress {
    fn begin(&self, _phase: &'static str, total: u64) {
        self.total.store(total, Relaxed);
        self.done.store(0, Relaxed);
        self.moved_ms.store(super::now_ms() as u64, Relaxed);
    }
    fn update(&self, done: u64) {
        self.done.store(done, Relaxed);
        self.moved_ms.store(super::now_ms() as u64, Relaxed);
    }
}

enum Command {
    /// Run a cycle now (a final one: then become secondary) and answer with it.
    Cycle {
        last: bool,
        /// The point in time to read, when the controller took it (a CSI snapshot).
        from: Option<cycle::SnapshotRead>,
        reply: oneshot::Sender<Result<CycleRecord, String>>,
    },
    /// The record changed: look again.
    Wake,
}

/// How a cycle ended, as [`Runners::subscribe`] tells it.
#[derive(Clone, Debug)]
pub struct CycleOutcome {
    /// The relationship.
    pub relationship: String,
    /// The committed cycle, or why none was.
    pub result: Result<CycleRecord, CycleFailure>,
}

/// A cycle that failed.
#[derive(Clone, Debug)]
pub struct CycleFailure {
    /// What went wrong.
    pub error: String,
    /// Whether the next cycle may succeed without anyone changing anything.
    pub retryable: bool,
    /// Whether the cycle was refused for bad input (nothing was written).
    pub refusal: bool,
}

/// The relationships' tasks of one agent.
pub struct Runners {
    store: Arc<Store>,
    exports: Exports,
    remote: RemoteOptions,
    tasks: Mutex<HashMap<String, mpsc::Sender<Command>>>,
    live: Mutex<HashMap<String, Arc<Mutex<Live>>>>,
    outcomes: broadcast::Sender<CycleOutcome>,
}

impl Runners {
    /// Runners for `store`'s relationships over `exports`, reaching peers with `remote`.
    pub fn new(store: Arc<Store>, exports: Exports, remote: RemoteOptions) -> Arc<Self> {
        Arc::new(Runners {
            store,
            exports,
            remote,
            tasks: Mutex::default(),
            live: Mutex::default(),
            outcomes: broadcast::channel(16).0,
        })
    }

    /// The outcome of every cycle from now on, of every relationship.
    pub fn subscribe(&self) -> broadcast::Receiver<CycleOutcome> {
        self.outcomes.subscribe()
    }

    /// The in-process state of `name`.
    pub fn live(&self, name: &str) -> Arc<Mutex<Live>> {
        self.live
            .lock()
            .expect("live lock")
            .entry(name.into())
            .or_default()
            .clone()
    }

    /// Starts the task of every primary relationship in the store.
    pub fn start_all(self: &Arc<Self>) {
        for r in self.store.all() {
            if r.role == Role::Primary {
                self.start(&r.spec.name);
            }
        }
    }

    /// Starts (or wakes) the task of `name`.
    pub fn start(self: &Arc<Self>, name: &str) {
        let mut tasks = self.tasks.lock().expect("tasks lock");
        if let Some(tx) = tasks.get(name)
            && tx.try_send(Command::Wake).is_ok()
        {
            return;
        }
        let (tx, rx) = mpsc::channel(8);
        tasks.insert(name.into(), tx);
        tokio::spawn(self.clone().run(name.to_string(), rx));
    }

    /// Relationships whose running cycle neither moved nor ended for `bound`: the stall
    /// watchdog cancels a cycle after [`STALL`], so past twice that the task is wedged.
    pub fn stuck(&self, bound: Duration) -> Vec<String> {
        let now_ms = super::now_ms() as u64;
        let live = self.live.lock().expect("live lock");
        live.iter()
            .filter(|(_, l)| {
                let l = l.lock().expect("live lock");
                let Some(since) = l.busy_since else {
                    return false;
                };
                let moved_ago = now_ms.saturating_sub(l.progress.moved_ms.load(Relaxed));
                since.elapsed() > bound && Duration::from_millis(moved_ago) > bound
            })
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Stops the task of `name` (a cycle under way is abandoned: the secondary drops it).
    pub fn stop(&self, name: &str) {
        self.tasks.lock().expect("tasks lock").remove(name);
    }

    /// Runs a cycle of `name` now (`last`: the final one of a demote), reading `from`
    /// if given, and waits for it.
    pub async fn cycle_now(
        self: &Arc<Self>,
        name: &str,
        last: bool,
        from: Option<cycle::SnapshotRead>,
    ) -> Result<CycleRecord, String> {
        self.start(name);
        let tx = self.tasks.lock().expect("tasks lock").get(name).cloned();
        let tx = tx.ok_or("the relationship's task is not running")?;
        let (reply, answer) = oneshot::channel();
        tx.send(Command::Cycle { last, from, reply })
            .await
            .map_err(|_| "the relationship's task stopped")?;
        answer
            .await
            .map_err(|_| "the relationship's task stopped".to_string())?
    }

    async fn run(self: Arc<Self>, name: String, mut rx: mpsc::Receiver<Command>) {
        // The next cycle is due one interval after the last timed one started: read
        // from the record each time, so a changed interval applies at once.
        let mut last_start: Option<tokio::time::Instant> = None;
        while let Some(rec) = self.store.get(&name) {
            let interval = Duration::from_millis(rec.spec.interval_ms.max(1));
            let next = last_start.map_or_else(tokio::time::Instant::now, |t| t + interval);
            // A relationship read from CSI snapshots cycles only when handed one.
            let active = rec.role == Role::Primary
                && !rec.paused
                && rec.halt.is_none()
                && !rec.spec.snapshots;
            let command = if active {
                tokio::select! {
                    _ = tokio::time::sleep_until(next) => None,
                    c = rx.recv() => match c { Some(c) => Some(c), None => break },
                }
            } else {
                match rx.recv().await {
                    Some(c) => Some(c),
                    None => break,
                }
            };
            match command {
                Some(Command::Wake) => continue,
                Some(Command::Cycle { last, from, reply }) => {
                    let r = self.cycle(&name, last, from).await;
                    let _ = reply.send(r);
                }
                None => {
                    let started = tokio::time::Instant::now();
                    let _ = self.cycle(&name, false, None).await;
                    last_start = Some(started);
                    let now = tokio::time::Instant::now();
                    if now > started + interval {
                        // Overran: the next cycle starts now, and the intervals it
                        // covered without a cycle are counted.
                        let missed = (now - started).as_millis() / interval.as_millis().max(1);
                        self.live(&name).lock().expect("live lock").missed_intervals +=
                            missed as u64;
                        last_start = Some(now - interval);
                    }
                }
            }
        }
        tracing::debug!(relationship = %name, "relationship task ended");
    }

    /// One cycle of `name`; its outcome is recorded in the store and in [`Live`], and
    /// told to subscribers.
    async fn cycle(
        &self,
        name: &str,
        last: bool,
        from: Option<cycle::SnapshotRead>,
    ) -> Result<CycleRecord, String> {
        let result = self.run_cycle(name, last, from).await;
        let _ = self.outcomes.send(CycleOutcome {
            relationship: name.into(),
            result: result.clone(),
        });
        result.map_err(|f| f.error)
    }

    async fn run_cycle(
        &self,
        name: &str,
        last: bool,
        from: Option<cycle::SnapshotRead>,
    ) -> Result<CycleRecord, CycleFailure> {
        let permanent = |error: String| CycleFailure {
            error,
            retryable: false,
            refusal: false,
        };
        let rec = self
            .store
            .get(name)
            .ok_or_else(|| permanent(format!("relationship {name:?} is gone")))?;
        if rec.role != Role::Primary {
            return Err(permanent(format!(
                "this side of {name:?} is the secondary: cycles run on the primary"
            )));
        }
        if let Some(halt) = rec.halt {
            return Err(permanent(format!(
                "{name:?} is halted ({halt:?}): another side was promoted; run `mover \
                 replicate resync {name}` here to make this side its secondary"
            )));
        }
        if rec.spec.snapshots && from.is_none() {
            return Err(permanent(format!(
                "{name:?} reads its points in time from CSI VolumeSnapshots, which the \
                 controller takes and hands over (CycleFrom): it runs no cycle of its own"
            )));
        }
        let export = self
            .exports
            .get(&rec.spec.volume)
            .map_err(|e| permanent(e.to_string()))?;
        let live = self.live(name);
        let progress = live.lock().expect("live lock").progress.clone();
        let remote = super::remote_for(&self.remote, rec.spec.peer_token.as_ref());
        let run = async {
            match &from {
                Some(from) => {
                    cycle::run_from_snapshot(&rec, from, &remote, last, progress.as_ref()).await
                }
                None => cycle::run(&rec, &export.path, &remote, last, progress.as_ref()).await,
            }
        };
        live.lock().expect("live lock").busy_since = Some(std::time::Instant::now());
        let result = tokio::select! {
            r = run => r,
            stalled = stalled(&progress, STALL) => Err(mover_engine::CopyError::Remote {
                url: rec.spec.peer.clone(),
                code: mover_engine::RemoteCode::Unavailable,
                message: format!(
                    "the cycle made no progress for {}s (the peer is unreachable, or the \
                     network cut without a reset); cancelled, it is retried",
                    stalled.as_secs()
                ),
                refusal: None,
            }),
        };
        progress.total.store(0, Relaxed);
        let mut l = live.lock().expect("live lock");
        l.busy_since = None;
        match result {
            Ok(c) => {
                l.degraded = false;
                l.last_error.clear();
                l.last_error_kind = control::ErrorKind::Unspecified;
                l.cycles_ok += 1;
                l.bytes_shipped += c.bytes_shipped;
                let secs = c.duration_ms as f64 / 1000.0;
                l.duration_sum += secs;
                let b = DURATION_BUCKETS
                    .iter()
                    .position(|&ub| secs <= ub)
                    .unwrap_or(DURATION_BUCKETS.len());
                l.duration_counts[b] += 1;
                drop(l);
                self.store
                    .update(name, |r| {
                        r.last_cycle = Some(c.clone());
                        if last {
                            r.role = Role::Secondary;
                        }
                    })
                    .map_err(|e| permanent(e.to_string()))?;
                tracing::info!(relationship = %name, cycle = c.id, read = c.bytes_read, shipped = c.bytes_shipped, ms = c.duration_ms, "cycle committed");
                Ok(c)
            }
            Err(e) => {
                let msg = e.to_string();
                let (retryable, refusal) = (e.is_retryable(), e.is_refusal());
                l.degraded = true;
                l.last_error = msg.clone();
                l.last_error_kind = match e {
                    CopyError::NoPointInTime { .. } => control::ErrorKind::NoPointInTime,
                    _ => control::ErrorKind::Unspecified,
                };
                l.cycles_failed += 1;
                drop(l);
                if is_stale_epoch(&e) {
                    tracing::warn!(relationship = %name, "fenced: {msg}");
                    self.store
                        .update(name, |r| r.halt = Some(Halt::Fenced))
                        .map_err(|e| permanent(e.to_string()))?;
                } else {
                    tracing::warn!(relationship = %name, "cycle failed: {msg}");
                }
                Err(CycleFailure {
                    error: msg,
                    retryable,
                    refusal,
                })
            }
        }
    }

    /// Prometheus text of every relationship's replication metrics.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mut series: BTreeMap<&str, (&str, &str, Vec<String>)> = BTreeMap::new();
        let mut add =
            |metric: &'static str, kind: &'static str, help: &'static str, line: String| {
                series
                    .entry(metric)
                    .or_insert((kind, help, Vec::new()))
                    .2
                    .push(line);
            };
        let now = super::now_ms();
        for r in self.store.all() {
            let name = &r.spec.name;
            let label = format!(
                "relationship=\"{}\",role=\"{}\"",
                mover_engine::node::label_value(name),
                r.role.side().name()
            );
            let live = self.live(name);
            let l = live.lock().expect("live lock");
            if let Some(c) = &r.last_cycle {
                add(
                    "mover_replication_rpo_seconds",
                    "gauge",
                    "Now minus the point in time of the last cycle the secondary applied.",
                    format!("{{{label}}} {}", (now - c.point_in_time_ms) as f64 / 1000.0),
                );
                add(
                    "mover_replication_last_sync_timestamp_seconds",
                    "gauge",
                    "Unix time at which the last cycle was committed.",
                    format!(
                        "{{{label}}} {}",
                        (c.started_ms + c.duration_ms as i64) as f64 / 1000.0
                    ),
                );
                add(
                    "mover_replication_writers_held_seconds",
                    "gauge",
                    "How long the last cycle's point in time held the volume's writers back (a freeze, or the lock a whole-file clone takes).",
                    format!("{{{label}}} {}", c.writers_held_ms as f64 / 1000.0),
                );
            }
            let mut cum = 0;
            for (i, n) in l.duration_counts.iter().enumerate() {
                cum += n;
                let le = DURATION_BUCKETS
                    .get(i)
                    .map_or("+Inf".to_string(), |b| b.to_string());
                add(
                    "mover_replication_cycle_duration_seconds",
                    "histogram",
                    "Duration of completed cycles.",
                    format!("_bucket{{{label},le=\"{le}\"}} {cum}"),
                );
            }
            add(
                "mover_replication_cycle_duration_seconds",
                "histogram",
                "",
                format!("_sum{{{label}}} {}", l.duration_sum),
            );
            add(
                "mover_replication_cycle_duration_seconds",
                "histogram",
                "",
                format!("_count{{{label}}} {cum}"),
            );
            add(
                "mover_replication_bytes_shipped_total",
                "counter",
                "Bytes of volume data sent to the secondary (on the wire).",
                format!("{{{label}}} {}", l.bytes_shipped),
            );
            for (result, n) in [("ok", l.cycles_ok), ("failed", l.cycles_failed)] {
                add(
                    "mover_replication_cycles_total",
                    "counter",
                    "Cycles ended, by result.",
                    format!("{{{label},result=\"{result}\"}} {n}"),
                );
            }
            add(
                "mover_replication_missed_intervals_total",
                "counter",
                "Intervals that passed while a cycle was still running.",
                format!("{{{label}}} {}", l.missed_intervals),
            );
        }
        for (metric, (kind, help, lines)) in series {
            out += &format!("# HELP {metric} {help}\n# TYPE {metric} {kind}\n");
            for l in lines {
                // Histogram lines carry their suffix before the labels.
                if let Some(rest) = l.strip_prefix('_') {
                    out += &format!("{metric}_{rest}\n");
                } else {
                    out += &format!("{metric}{l}\n");
                }
            }
        }
        out
    }
}

/// Whether `e` is the peer refusing this side's epoch as stale (another side promoted).
fn is_stale_epoch(e: &CopyError) -> bool {
    matches!(
        e,
        CopyError::Remote {
            refusal: Some(transport::refusal::Refusal::StaleEpoch),
            ..
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[tokio::test]
    async fn a_cycle_is_called_stalled_only_once_its_progress_stands_still() {
        let progress = Arc::new(CycleProgress::default());
        let stall = Duration::from_millis(240);
        // Moving for 0.6 s: not stalled; then still: stalled one `stall` later.
        let p = progress.clone();
        let mover = tokio::spawn(async move {
            for i in 1..=30 {
                p.done.store(i, Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        let started = Instant::now();
        let still = stalled(&progress, stall).await;
        let waited = started.elapsed();
        mover.await.unwrap();
        assert!(still >= stall);
        assert!(
            waited >= Duration::from_millis(600) + stall - Duration::from_millis(40),
            "called stalled while it moved: after {waited:?}"
        );
    }
}
