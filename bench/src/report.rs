//! The results: targets checked, the human table, and the JSON document.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

use crate::cpu::{CpuSpeed, CpuWork};
use crate::floor::{DeviceSpeed, MAX_OVER_FLOOR};
use crate::image::Manifest;
use crate::phases::{
    AgentCopy, Cache, DeltaCopy, FullCopy, HashResult, Run, SnapshotPhase, SnapshotStep, SparseCopy,
};

/// Targets mover must meet.
const HASH_MIN_RATIO: f64 = 0.90;
/// Mover's time over cp's: at least as fast as cp, in every run.
const FULL_COPY_MAX_RATIO: f64 = 1.0;
const DELTA_MIN_SPEEDUP: f64 = 8.0;
const DELTA_MAX_WRITE_RATIO: f64 = 1.10;
const MAX_RSS_MIB: f64 = 256.0;
/// The push client (a copy to an agent) holds no more than this.
const PUSH_MAX_RSS_MIB: f64 = 128.0;
const AGENT_FULL_MAX_RATIO: f64 = 1.25;
const AGENT_FULL_MIN_SPEEDUP: f64 = 2.0;
const AGENT_DELTA_MIN_SPEEDUP: f64 = 8.0;
const AGENT_TLS_MIN_RATIO: f64 = 0.85;
const SNAPSHOT_FIRST_MIN_SPEEDUP: f64 = 2.5;
const SNAPSHOT_INCREMENTAL_MIN_SPEEDUP: f64 = 3.0;
const SNAPSHOT_RESTORE_MIN_SPEEDUP: f64 = 3.0;

/// Bytes per MiB.
const MIB: f64 = 1024.0 * 1024.0;

/// Everything measured in one run of the bench.
#[derive(Debug, Serialize)]
pub struct Results {
    /// Version of mover-bench.
    pub bench_version: &'static str,
    /// When the run started, in seconds since the Unix epoch.
    pub started_unix_secs: u64,
    /// `uname -r`.
    pub kernel: String,
    /// CPUs available to the bench.
    pub nproc: usize,
    /// `/proc/loadavg` before the first timed run (other work on the machine skews times).
    pub load_before: String,
    /// `/proc/loadavg` after the last timed run.
    pub load_after: String,
    /// The bench's own peak RSS: the floor of every child's peak RSS figure.
    pub bench_peak_rss_bytes: u64,
    /// The mover binary measured.
    pub mover: PathBuf,
    /// The working directory.
    pub workdir: PathBuf,
    /// The loop device mover read from.
    pub source_device: PathBuf,
    /// How the images were built and what they hold.
    pub images: Manifest,
    /// Hashing, per thread count (empty with --only-snapshot).
    pub hash: Vec<HashResult>,
    /// The full copy, cold then warm (empty with --only-snapshot).
    pub full_copy: Vec<FullCopy>,
    /// The delta copy, cold then warm (empty with --only-snapshot).
    pub delta_copy: Vec<DeltaCopy>,
    /// The sparse 64 GiB copy (absent with --only-snapshot).
    pub sparse_copy: Option<SparseCopy>,
    /// The copies over 127.0.0.1 through mover's agent and an rsync daemon (absent with
    /// --skip-agent).
    pub agent: Option<AgentCopy>,
    /// The snapshots against restic (absent with --skip-snapshot).
    pub snapshot: Option<SnapshotPhase>,
    /// The throttle the run was made under (`--throttle`), if any.
    pub throttle: Option<String>,
    /// The disk's speed, measured before each phase.
    pub floors: Floors,
}

/// The disk's O_DIRECT speed measured right before each phase, which that phase's jobs
/// are judged against.
#[derive(Debug, Default, Serialize)]
pub struct Floors {
    /// Before the cold copies.
    pub copies_cold: Option<DeviceSpeed>,
    /// Before the warm copies.
    pub copies_warm: Option<DeviceSpeed>,
    /// Before the copies through the agent.
    pub agent: Option<DeviceSpeed>,
    /// Before the snapshots.
    pub snapshot: Option<DeviceSpeed>,
    /// Before the snapshots: how fast this machine hashes, compresses and seals.
    pub snapshot_cpu: Option<CpuSpeed>,
}

impl Floors {
    /// The floor of the copies in `cache`.
    fn of_copies(&self, cache: Cache) -> Option<DeviceSpeed> {
        match cache {
            Cache::Cold => self.copies_cold,
            Cache::Warm => self.copies_warm,
        }
    }
}

/// The bytes a full copy must write: the least any tool's copy of today's image occupies
/// (holes and zeros need no write), or the image's own allocation.
fn full_copy_written(results: &Results) -> u64 {
    results
        .full_copy
        .iter()
        .flat_map(|f| [&f.cp, &f.dd, &f.mover])
        .filter_map(|run| run.destination_allocated_bytes)
        .chain([results.images.today_allocated])
        .min()
        .unwrap_or(0)
}

/// What a job cannot do without: bytes it must read from the disk and write to it, and
/// the CPU work it must do.
#[derive(Debug, Clone, Copy)]
struct Work {
    read: u64,
    write: u64,
    cpu: CpuWork,
}

/// The floors of one phase: its disk, and its CPU: how fast this machine hashes,
/// compresses and seals where the phase measured it (the snapshots), else how fast it
/// hashes (b3sum on every CPU, page-cached, from the hash phase).
#[derive(Debug, Clone, Copy)]
struct PhaseFloor {
    disk: Option<DeviceSpeed>,
    cpu: Option<CpuSpeed>,
    hash_bps: Option<f64>,
    /// What reading the volume costs the disk: its image's allocated bytes (the loop
    /// device reads the image's holes as zeros without touching the disk).
    volume_read: u64,
    /// What writing the volume whole costs: see [`full_copy_written`].
    volume_written: u64,
}

impl PhaseFloor {
    /// What reading the volume costs in `cache`: nothing once the page cache holds it.
    fn source_read(self, cache: Cache) -> u64 {
        match cache {
            Cache::Cold => self.volume_read,
            Cache::Warm => 0,
        }
    }

    /// The least time `work` takes here: its disk floor or its CPU floor, whichever is
    /// longer; none when the disk was not measured.
    fn seconds(self, work: Work) -> Option<f64> {
        self.parts(work).map(|(disk, cpu)| disk.max(cpu))
    }

    /// The disk floor and the CPU floor of `work`, in seconds.
    fn parts(self, work: Work) -> Option<(f64, f64)> {
        let disk = self.disk?.floor_seconds(work.read, work.write);
        let cpu = match self.cpu {
            Some(cpu) => cpu.floor_seconds(work.cpu),
            None => self.hash_bps.map_or(0.0, |bps| work.cpu.hash as f64 / bps),
        };
        Some((disk, cpu))
    }
}

/// How a measured figure is compared with its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// measured >= limit.
    AtLeast,
    /// measured <= limit.
    AtMost,
    /// measured < limit.
    Below,
}

/// The unit a check's figures are in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Unit {
    /// A dimensionless ratio.
    Ratio,
    /// Mebibytes.
    Mib,
    /// A count.
    Count,
}

/// One target and whether it was met.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What is checked.
    pub name: String,
    /// The figure measured.
    pub measured: f64,
    /// How it must compare to `limit`.
    pub rule: Rule,
    /// The limit.
    pub limit: f64,
    /// Unit of `measured` and `limit`.
    pub unit: Unit,
    /// Whether the target is met.
    pub pass: bool,
}

impl Check {
    /// A check of `measured` against `limit`.
    fn new(name: &str, measured: f64, rule: Rule, limit: f64, unit: Unit) -> Self {
        let pass = match rule {
            Rule::AtLeast => measured >= limit,
            Rule::AtMost => measured <= limit,
            Rule::Below => measured < limit,
        };
        Self {
            name: name.to_string(),
            measured,
            rule,
            limit,
            unit,
            pass,
        }
    }

    /// `measured` with its unit.
    fn measured_text(&self) -> String {
        format_value(self.measured, self.unit)
    }

    /// The rule and limit, e.g. `>= 0.90x`.
    fn target_text(&self) -> String {
        let op = match self.rule {
            Rule::AtLeast => ">=",
            Rule::AtMost => "<=",
            Rule::Below => "<",
        };
        format!("{op} {}", format_value(self.limit, self.unit))
    }

    /// `PASS` or `FAIL`.
    fn verdict(&self) -> &'static str {
        if self.pass { "PASS" } else { "FAIL" }
    }
}

/// `value` written in `unit`.
fn format_value(value: f64, unit: Unit) -> String {
    match unit {
        Unit::Ratio => format!("{value:.2}x"),
        Unit::Mib => format!("{value:.1} MiB"),
        Unit::Count => format!("{value:.0}"),
    }
}

/// One line of the timing table.
struct Row<'a> {
    /// Which comparison.
    phase: String,
    /// The timed command.
    run: &'a Run,
    /// The tool's name for the table [default: the run's].
    tool: String,
    /// Logical bytes processed, for the MiB/s column.
    bytes: u64,
    /// The target this row is judged by, if any.
    check: Option<Check>,
    /// The least time the job's bytes take on the phase's disk, if measured.
    floor_seconds: Option<f64>,
    /// The most peak RSS the row may take, if it is judged on memory (MiB).
    rss_limit: Option<f64>,
}

/// The table rows and the checks not tied to a row.
struct Summary<'a> {
    rows: Vec<Row<'a>>,
    other_checks: Vec<Check>,
    /// Each snapshot step's floor: (step, disk seconds, CPU seconds).
    snapshot_floors: Vec<(&'static str, f64, f64)>,
}

impl<'a> Summary<'a> {
    /// Derives rows and checks from `results`.
    fn new(results: &'a Results) -> Self {
        let size = results.images.size;
        let floors = &results.floors;
        // b3sum on every CPU over a page-cached image: how fast this machine can hash.
        let hash_bps = results
            .hash
            .iter()
            .max_by_key(|h| h.threads)
            .map(|h| size as f64 / h.b3sum.seconds);
        let phase_floor = |disk: Option<DeviceSpeed>| PhaseFloor {
            disk,
            cpu: None,
            hash_bps,
            volume_read: results.images.today_allocated,
            volume_written: full_copy_written(results),
        };
        let mut rows = Vec::new();
        let mut snapshot_floors = Vec::new();
        for hash in &results.hash {
            let phase = format!("hash N={}", hash.threads);
            let ratio = hash.b3sum.seconds / hash.mover.seconds;
            let name = format!("{phase}: mover throughput / b3sum's");
            rows.push(row(&phase, &hash.b3sum, size, None));
            let check = Check::new(&name, ratio, Rule::AtLeast, HASH_MIN_RATIO, Unit::Ratio);
            rows.push(row(&phase, &hash.mover, size, Some(check)));
            rows.push(row(&phase, &hash.mover_on_image_file, size, None));
        }
        for full in &results.full_copy {
            let floor = phase_floor(floors.of_copies(full.cache));
            rows.extend(full_copy_rows(full, size, floor));
        }
        for delta in &results.delta_copy {
            let floor = phase_floor(floors.of_copies(delta.cache));
            rows.extend(delta_copy_rows(delta, size, floor));
        }
        if let Some(sparse) = &results.sparse_copy {
            rows.push(row("sparse 64G", &sparse.cp, sparse.size, None));
            rows.push(row("sparse 64G", &sparse.mover, sparse.size, None));
        }
        if let Some(agent) = &results.agent {
            rows.extend(agent_rows(agent, size, phase_floor(floors.agent)));
        }
        if let Some(snapshot) = &results.snapshot {
            let floor = PhaseFloor {
                cpu: floors.snapshot_cpu,
                ..phase_floor(floors.snapshot)
            };
            let work = snapshot_work(results, snapshot, floor);
            rows.extend(snapshot_rows(snapshot, size, &work));
            snapshot_floors.extend(
                work.iter()
                    .filter_map(|w| w.parts().map(|(disk, cpu)| (w.phase, disk, cpu))),
            );
        }
        let mut other_checks = other_checks(results);
        other_checks.extend(rows.iter().filter_map(Row::floor_check));
        Self {
            rows,
            other_checks,
            snapshot_floors,
        }
    }

    /// Every check, row checks first.
    fn checks(&self) -> Vec<Check> {
        let row_checks = self.rows.iter().filter_map(|r| r.check.clone());
        row_checks
            .chain(self.other_checks.iter().cloned())
            .collect()
    }
}

/// A table row.
fn row<'a>(phase: &str, run: &'a Run, bytes: u64, check: Option<Check>) -> Row<'a> {
    Row {
        phase: phase.to_string(),
        run,
        tool: run.tool.clone(),
        bytes,
        check,
        floor_seconds: None,
        rss_limit: run.tool.starts_with("mover").then_some(MAX_RSS_MIB),
    }
}

impl Row<'_> {
    /// This row with its floor.
    fn floor(mut self, floor: Option<f64>) -> Self {
        self.floor_seconds = floor;
        self
    }

    /// This row judged on memory at `mib`: the push client's tighter bound.
    fn rss_limit(mut self, mib: f64) -> Self {
        self.rss_limit = Some(mib);
        self
    }

    /// Time over the floor.
    fn over_floor(&self) -> Option<f64> {
        self.floor_seconds
            .filter(|f| *f > 0.0)
            .map(|f| self.run.seconds / f)
    }

    /// A judged mover job's time over its floor, checked: at most `MAX_OVER_FLOOR` times
    /// what its bytes take on the disk. None for peers and for rows without a floor.
    fn floor_check(&self) -> Option<Check> {
        if !self.tool.starts_with("mover") || self.check.is_none() {
            return None;
        }
        Some(Check::new(
            &format!("{}: {} time / floor", self.phase, self.tool),
            self.over_floor()?,
            Rule::AtMost,
            MAX_OVER_FLOOR,
            Unit::Ratio,
        ))
    }
}

/// Rows of the full copy: cp, dd, and mover judged against cp.
fn full_copy_rows(full: &FullCopy, size: u64, floor: PhaseFloor) -> Vec<Row<'_>> {
    let phase = full.cache.phase("full copy");
    let floor = floor.seconds(Work {
        read: floor.source_read(full.cache),
        write: floor.volume_written,
        cpu: CpuWork::default(),
    });
    let ratio = full.mover.seconds / full.cp.seconds;
    let check = Check::new(
        &format!("{phase}: mover time / cp --sparse=always time"),
        ratio,
        Rule::AtMost,
        FULL_COPY_MAX_RATIO,
        Unit::Ratio,
    );
    vec![
        row(&phase, &full.cp, size, None).floor(floor),
        row(&phase, &full.dd, size, None).floor(floor),
        row(&phase, &full.mover, size, Some(check)).floor(floor),
    ]
}

/// Rows of the delta copy: rsync, and mover judged by its speed-up over rsync.
fn delta_copy_rows(delta: &DeltaCopy, size: u64, floor: PhaseFloor) -> Vec<Row<'_>> {
    let phase = delta.cache.phase("delta copy");
    // The source is read whole (cold) and hashed; only the changed pages are written.
    // The destination need not be read: mover's index of it spares that.
    let floor = floor.seconds(Work {
        read: floor.source_read(delta.cache),
        write: delta.changed.differing_bytes(),
        cpu: CpuWork::hashing(size),
    });
    let speedup = delta.rsync.seconds / delta.mover.seconds;
    let check = Check::new(
        &format!("{phase}: rsync time / mover time"),
        speedup,
        Rule::AtLeast,
        DELTA_MIN_SPEEDUP,
        Unit::Ratio,
    );
    vec![
        row(&phase, &delta.rsync, size, None).floor(floor),
        row(&phase, &delta.mover_unindexed, size, None).floor(floor),
        row(&phase, &delta.mover, size, Some(check)).floor(floor),
    ]
}

/// Rows of the copies over the network: local cp for reference, rsync to its daemon, and
/// mover to the agent judged against cp and, with mutual TLS, against itself without;
/// then the delta copies, mover judged by its speed-up over rsync.
fn agent_rows(agent: &AgentCopy, size: u64, floor: PhaseFloor) -> Vec<Row<'_>> {
    let (full, delta) = (&agent.full, &agent.delta);
    // Both ends are on the one disk: the full copy reads the device and writes its data;
    // the delta reads and hashes the source and writes the changed pages.
    let full_floor = floor.seconds(Work {
        read: floor.volume_read,
        write: floor.volume_written,
        cpu: CpuWork::default(),
    });
    let delta_floor = floor.seconds(Work {
        read: floor.volume_read,
        write: delta.changed.differing_bytes(),
        cpu: CpuWork::hashing(size),
    });
    let local_cp = &full.cp;
    let vs_cp = Check::new(
        "agent full copy: mover time / local cp --sparse=always time",
        full.mover.seconds / local_cp.seconds,
        Rule::AtMost,
        AGENT_FULL_MAX_RATIO,
        Unit::Ratio,
    );
    let tls = Check::new(
        "agent full copy: mutual TLS throughput / plain throughput",
        full.mover.seconds / full.mover_tls.seconds,
        Rule::AtLeast,
        AGENT_TLS_MIN_RATIO,
        Unit::Ratio,
    );
    let speedup = Check::new(
        "agent delta copy: rsync daemon time / mover time",
        delta.rsync.seconds / delta.mover.seconds,
        Rule::AtLeast,
        AGENT_DELTA_MIN_SPEEDUP,
        Unit::Ratio,
    );
    vec![
        row("agent full", local_cp, size, None).floor(full_floor),
        row("agent full", &full.rsync, size, None).floor(full_floor),
        row("agent full", &full.mover, size, Some(vs_cp))
            .floor(full_floor)
            .rss_limit(PUSH_MAX_RSS_MIB),
        row("agent full", &full.mover_tls, size, Some(tls)).floor(full_floor),
        row("agent delta", &delta.rsync, size, None).floor(delta_floor),
        row("agent delta", &delta.mover_unindexed, size, None).floor(delta_floor),
        row("agent delta", &delta.mover, size, Some(speedup)).floor(delta_floor),
    ]
}

/// Checks of the copies over the network not shown on a row: mover's speed-up over the
/// rsync daemon on the full copy, and the bytes each put on the wire for the delta.
fn agent_checks(agent: &AgentCopy) -> Vec<Check> {
    vec![
        Check::new(
            "agent full copy: rsync daemon time / mover time",
            agent.full.rsync.seconds / agent.full.mover.seconds,
            Rule::AtLeast,
            AGENT_FULL_MIN_SPEEDUP,
            Unit::Ratio,
        ),
        Check::new(
            "agent delta copy: mover wire bytes vs rsync bytes sent",
            agent.delta.mover_wire_bytes as f64 / MIB,
            Rule::Below,
            agent.delta.rsync_bytes_sent as f64 / MIB,
            Unit::Mib,
        ),
    ]
}

/// What each snapshot step must do, and its floor: the first snapshot reads the volume,
/// hashes it, compresses it and seals what it stores; the incremental one reads and
/// hashes the volume again but compresses only the changed pages and seals what it adds;
/// the restore reads the repository, opens (decrypts) it and writes the volume. A
/// restore's decompression is left out: zstd opens many times faster than it packs.
struct StepWork {
    phase: &'static str,
    work: Work,
    floor: PhaseFloor,
}

impl StepWork {
    /// The floor's disk and CPU parts, in seconds.
    fn parts(&self) -> Option<(f64, f64)> {
        self.floor.parts(self.work)
    }

    /// The floor: the larger part.
    fn seconds(&self) -> Option<f64> {
        self.floor.seconds(self.work)
    }
}

/// The work of the first snapshot, the incremental one and the restore.
fn snapshot_work(results: &Results, snapshot: &SnapshotPhase, floor: PhaseFloor) -> [StepWork; 3] {
    let (first, incr) = (&snapshot.first, &snapshot.incremental);
    let size = results.images.size;
    let added = incr.mover_repo_bytes.saturating_sub(first.mover_repo_bytes);
    let step = |phase, read, write, cpu| StepWork {
        phase,
        work: Work { read, write, cpu },
        floor,
    };
    [
        step(
            "snap first",
            floor.volume_read,
            first.mover_repo_bytes,
            CpuWork {
                hash: size,
                compress: size,
                seal: first.mover_repo_bytes,
            },
        ),
        step(
            "snap incr",
            floor.volume_read,
            added,
            CpuWork {
                hash: size,
                compress: results.images.diff.differing_pages * 4096,
                seal: added,
            },
        ),
        step(
            "snap restore",
            incr.mover_repo_bytes,
            floor.volume_written,
            CpuWork {
                seal: incr.mover_repo_bytes,
                ..CpuWork::default()
            },
        ),
    ]
}

/// Rows of the snapshots: restic, and mover judged by its speed-up over restic, for the
/// first snapshot, the incremental one and the restore.
fn snapshot_rows<'a>(snapshot: &'a SnapshotPhase, size: u64, work: &[StepWork; 3]) -> Vec<Row<'a>> {
    let steps: [(&SnapshotStep, f64); 3] = [
        (&snapshot.first, SNAPSHOT_FIRST_MIN_SPEEDUP),
        (&snapshot.incremental, SNAPSHOT_INCREMENTAL_MIN_SPEEDUP),
        (&snapshot.restore, SNAPSHOT_RESTORE_MIN_SPEEDUP),
    ];
    let mut rows = Vec::new();
    for ((step, limit), work) in steps.into_iter().zip(work) {
        let (phase, floor) = (work.phase, work.seconds());
        let check = Check::new(
            &format!("{phase}: restic time / mover time"),
            step.restic.seconds / step.mover.seconds,
            Rule::AtLeast,
            limit,
            Unit::Ratio,
        );
        rows.push(row(phase, &step.restic, size, None).floor(floor));
        rows.push(row(phase, &step.mover, size, Some(check)).floor(floor));
    }
    rows
}

/// Checks of the snapshots not shown on a row: the repositories' size after the first
/// snapshot, and what the incremental snapshot added to each.
fn snapshot_checks(snapshot: &SnapshotPhase) -> Vec<Check> {
    let (first, incr) = (&snapshot.first, &snapshot.incremental);
    vec![
        Check::new(
            "snapshot: mover repository vs restic's, first snapshot",
            first.mover_repo_bytes as f64 / MIB,
            Rule::AtMost,
            first.restic_repo_bytes as f64 / MIB,
            Unit::Mib,
        ),
        Check::new(
            "snapshot: bytes the incremental added, mover vs restic",
            incr.mover_repo_bytes.saturating_sub(first.mover_repo_bytes) as f64 / MIB,
            Rule::AtMost,
            incr.restic_repo_bytes
                .saturating_sub(first.restic_repo_bytes) as f64
                / MIB,
            Unit::Mib,
        ),
    ]
}

/// Checks not tied to a timing: bytes written, memory, exactness of mover's copies and
/// restores.
fn other_checks(results: &Results) -> Vec<Check> {
    let mut checks = Vec::new();
    let mut mover_copies = Vec::new();
    for delta in &results.delta_copy {
        let changed = delta.changed.differing_bytes().max(1) as f64;
        checks.push(Check::new(
            &format!(
                "{}: mover bytes written / changed 4 KiB pages",
                delta.cache.phase("delta copy")
            ),
            delta.mover_bytes_written as f64 / changed,
            Rule::AtMost,
            DELTA_MAX_WRITE_RATIO,
            Unit::Ratio,
        ));
        mover_copies.extend([&delta.mover_unindexed, &delta.mover]);
    }
    for full in &results.full_copy {
        checks.push(Check::new(
            &format!("peak RSS of mover, {}", full.cache.phase("full copy")),
            full.mover.max_rss_bytes as f64 / MIB,
            Rule::Below,
            MAX_RSS_MIB,
            Unit::Mib,
        ));
        mover_copies.push(&full.mover);
    }
    if let Some(sparse) = &results.sparse_copy {
        checks.push(Check::new(
            "peak RSS of mover, 64 GiB sparse copy",
            sparse.mover.max_rss_bytes as f64 / MIB,
            Rule::Below,
            MAX_RSS_MIB,
            Unit::Mib,
        ));
        mover_copies.push(&sparse.mover);
    }
    if let Some(agent) = &results.agent {
        checks.push(Check::new(
            "peak RSS of mover, push client of the agent full copy",
            agent.full.mover.max_rss_bytes as f64 / MIB,
            Rule::AtMost,
            PUSH_MAX_RSS_MIB,
            Unit::Mib,
        ));
        mover_copies.extend([
            &agent.full.mover,
            &agent.full.mover_tls,
            &agent.delta.mover_unindexed,
            &agent.delta.mover,
        ]);
    }
    if let Some(snapshot) = &results.snapshot {
        mover_copies.push(&snapshot.restore.mover);
    }
    let inexact = mover_copies.iter().filter(|run| !run.is_exact()).count();
    checks.push(Check::new(
        "mover copies and restores differing from their source",
        inexact as f64,
        Rule::AtMost,
        0.0,
        Unit::Count,
    ));
    if let Some(agent) = &results.agent {
        checks.extend(agent_checks(agent));
    }
    if let Some(snapshot) = &results.snapshot {
        checks.extend(snapshot_checks(snapshot));
    }
    checks
}

/// The JSON document: the results, every check, and the overall verdict.
#[derive(Debug, Serialize)]
struct Document<'a> {
    #[serde(flatten)]
    results: &'a Results,
    checks: Vec<Check>,
    all_passed: bool,
    /// Every chosen phase ran (false while the bench runs, or if it stopped midway).
    finished: bool,
}

/// Writes the JSON of the phases finished so far, marked unfinished.
pub fn save_unfinished(results: &Results, json_path: &Path) -> Result<()> {
    write_document(results, &Summary::new(results), json_path, false).map(|_| ())
}

/// Writes the JSON document to `json_path`; returns whether every target was met.
fn write_document(
    results: &Results,
    summary: &Summary,
    json_path: &Path,
    finished: bool,
) -> Result<bool> {
    let checks = summary.checks();
    let all_passed = checks.iter().all(|c| c.pass);
    let document = Document {
        results,
        checks,
        all_passed,
        finished,
    };
    write_json_file(json_path, &document)?;
    Ok(all_passed)
}

/// Prints the tables and writes the JSON to `json_path`; returns whether every target was
/// met.
pub fn publish(results: &Results, json_path: &Path, report_dir: Option<&Path>) -> Result<bool> {
    let summary = Summary::new(results);
    let table = render(results, &summary);
    print!("{table}");
    if let Some(dir) = report_dir {
        write_html(dir, &summary, &table)?;
        println!("\nHTML report: {}", dir.join("index.html").display());
    }
    let all_passed = write_document(results, &summary, json_path, true)?;
    println!("\nJSON results: {}", json_path.display());
    Ok(all_passed)
}

/// The HTML report in `dir`: the table, then per phase a chart of each tool's I/O over
/// time, the ratios against their targets, and each run's peak memory.
fn write_html(dir: &Path, summary: &Summary, table: &str) -> Result<()> {
    use crate::charts::{Bar, Figure, Series, bar_chart, rates, slug, throughput_chart};
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut figures = Vec::new();
    let mut phases: Vec<&str> = Vec::new();
    for r in &summary.rows {
        if !phases.contains(&r.phase.as_str()) {
            phases.push(&r.phase);
        }
    }
    for phase in phases {
        let series: Vec<Series> = summary
            .rows
            .iter()
            .filter(|r| r.phase == phase && !r.run.io_samples.is_empty())
            .map(|r| Series {
                label: format!("{} ({:.1} s)", r.tool, r.run.seconds),
                points: rates(&r.run.io_samples),
            })
            .collect();
        if series.is_empty() {
            continue;
        }
        let file = format!("{}.svg", slug(phase));
        let floor = summary
            .rows
            .iter()
            .find(|r| r.phase == phase)
            .and_then(|r| r.floor_seconds);
        throughput_chart(&dir.join(&file), phase, &series, floor)?;
        figures.push(Figure {
            file,
            caption: format!("{phase}: each tool's I/O over time (its best run)"),
        });
    }
    let ratios: Vec<Bar> = summary
        .checks()
        .into_iter()
        .filter(|c| c.unit == Unit::Ratio)
        .map(|c| Bar {
            label: format!("{} {}", c.name, c.target_text()),
            value: c.measured,
            target: Some(c.limit),
            pass: c.pass,
        })
        .collect();
    let mut bars = |file: &str, title: &str, x_desc: &str, bars: &[Bar], caption: &str| {
        if bars.is_empty() {
            return Ok(());
        }
        bar_chart(&dir.join(file), title, x_desc, bars)?;
        figures.push(Figure {
            file: file.into(),
            caption: caption.into(),
        });
        Ok::<_, anyhow::Error>(())
    };
    bars(
        "ratios.svg",
        "ratios against targets",
        "ratio (target: black tick)",
        &ratios,
        "every ratio the bench checks: green met, red missed",
    )?;
    // Every job against the disk: time over its floor, the target marked on the judged
    // mover jobs.
    let floors: Vec<Bar> = summary
        .rows
        .iter()
        .filter_map(|r| {
            let check = r.floor_check();
            Some(Bar {
                label: format!("{}: {}", r.phase, r.tool),
                value: r.over_floor()?,
                target: check.as_ref().map(|c| c.limit),
                pass: check.is_none_or(|c| c.pass),
            })
        })
        .collect();
    bars(
        "floor.svg",
        "time over the floor (1.0 = the disk's or the CPUs' own speed)",
        "time / floor (target for judged mover jobs: black tick, 1.3)",
        &floors,
        "each job's time over the least its bytes take on the disk measured right before \
         its phase",
    )?;
    let memory: Vec<Bar> = summary
        .rows
        .iter()
        .filter(|r| r.run.max_rss_bytes > 0)
        .map(|r| Bar {
            label: format!("{}: {}", r.phase, r.tool),
            value: r.run.max_rss_bytes as f64 / MIB,
            target: r.rss_limit,
            pass: r
                .rss_limit
                .is_none_or(|limit| r.run.max_rss_bytes as f64 / MIB <= limit),
        })
        .collect();
    bars(
        "memory.svg",
        "peak memory (RSS)",
        "MiB",
        &memory,
        "peak resident memory of every timed run",
    )?;
    crate::charts::write_page(dir, "mover-bench: mover against its peers", table, &figures)
}

/// The human-readable report.
fn render(results: &Results, summary: &Summary) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "\n{}", headline(results));
    let _ = writeln!(
        out,
        "\n{:<12} {:<34} {:>9} {:>7} {:>10} {:>10} {:>11} {:>7} {:>9} {:>6}",
        "phase",
        "tool",
        "seconds",
        "/floor",
        "MiB/s",
        "peak RSS",
        "CPU s",
        "ratio",
        "target",
        "result"
    );
    for row in &summary.rows {
        let _ = writeln!(out, "{}", render_row(row).trim_end());
    }
    let _ = writeln!(
        out,
        "\n{:<56} {:>12} {:>12} {:>6}",
        "check", "measured", "target", "result"
    );
    for check in &summary.other_checks {
        let _ = writeln!(
            out,
            "{:<56} {:>12} {:>12} {:>6}",
            check.name,
            check.measured_text(),
            check.target_text(),
            check.verdict()
        );
    }
    let _ = writeln!(
        out,
        "(peak RSS is the child's ru_maxrss, which starts from the bench's own peak, {:.1} MiB)",
        results.bench_peak_rss_bytes as f64 / MIB
    );
    if let Some(agent) = &results.agent {
        out += &agent_notes(agent);
    }
    if let Some(snapshot) = &results.snapshot {
        out += &snapshot_notes(snapshot, &summary.snapshot_floors);
    }
    let failed = summary.checks().iter().filter(|c| !c.pass).count();
    let _ = match failed {
        0 => writeln!(out, "\nall targets met"),
        n => writeln!(out, "\n{n} target(s) missed"),
    };
    out
}

/// What the agent phase put on the wire and what the servers cost.
fn agent_notes(agent: &AgentCopy) -> String {
    let (full, delta) = (&agent.full, &agent.delta);
    let mib = |bytes: u64| bytes as f64 / MIB;
    format!(
        "agent phase, over 127.0.0.1 (CPU s: the client's + the server's):\n  \
         on the wire, full copy: mover {:.1} MiB (with mutual TLS {:.1} MiB), rsync sent \
         {:.1} MiB\n  \
         on the wire, delta copy: mover {:.1} MiB, rsync sent {:.1} MiB and received {:.1} MiB\n  \
         read from disk by the server, delta copy: agent {:.1} MiB (yesterday by cp: \
         {:.1} MiB), rsync daemon {:.1} MiB\n  \
         agent peak RSS: {:.1} MiB, with mutual TLS {:.1} MiB\n",
        mib(full.mover_wire_bytes),
        mib(full.mover_tls_wire_bytes),
        mib(full.rsync_bytes_sent),
        mib(delta.mover_wire_bytes),
        mib(delta.rsync_bytes_sent),
        mib(delta.rsync_bytes_received),
        mib(delta.mover.server_read_bytes.unwrap_or(0)),
        mib(delta.mover_unindexed.server_read_bytes.unwrap_or(0)),
        mib(delta.rsync.server_read_bytes.unwrap_or(0)),
        mib(agent.agent_peak_rss_bytes),
        mib(agent.agent_tls_peak_rss_bytes),
    )
}

/// The repositories' size after each snapshot, and each step's floor.
fn snapshot_notes(snapshot: &SnapshotPhase, floors: &[(&str, f64, f64)]) -> String {
    let mib = |bytes: u64| bytes as f64 / MIB;
    let (first, incr) = (&snapshot.first, &snapshot.incremental);
    let mut floor_lines = String::new();
    for (step, disk, cpu) in floors {
        let _ = writeln!(
            floor_lines,
            "  floor of {step}: disk {disk:.2} s, CPU {cpu:.2} s (hash, compress, seal on \
             every CPU): {:.2} s",
            disk.max(*cpu)
        );
    }
    format!(
        "snapshot phase, local-directory repositories on the workdir's disk:\n  \
         repository after the first snapshot: mover {:.1} MiB, restic {:.1} MiB\n  \
         added by the incremental snapshot: mover {:.1} MiB, restic {:.1} MiB\n",
        mib(first.mover_repo_bytes),
        mib(first.restic_repo_bytes),
        mib(incr.mover_repo_bytes.saturating_sub(first.mover_repo_bytes)),
        mib(incr
            .restic_repo_bytes
            .saturating_sub(first.restic_repo_bytes)),
    ) + &floor_lines
}

/// The line describing the volume and the machine.
fn headline(results: &Results) -> String {
    let images = &results.images;
    let diff = &images.diff;
    let mut disk = String::new();
    if let Some(throttle) = &results.throttle {
        let _ = writeln!(disk, "{throttle}");
    }
    let floors = &results.floors;
    for (phase, speed) in [
        ("copies, cold", floors.copies_cold),
        ("copies, warm", floors.copies_warm),
        ("agent", floors.agent),
        ("snapshots", floors.snapshot),
    ] {
        if let Some(speed) = speed {
            let _ = writeln!(disk, "disk before the {phase}: {}", speed.describe());
        }
    }
    if let Some(cpu) = floors.snapshot_cpu {
        let _ = writeln!(disk, "CPU before the snapshots: {}", cpu.describe());
    }
    let _ = write!(
        disk,
        "/floor: time over the least the job takes here: its bytes on that disk, or its CPU \
         work (hashing at b3sum's speed; for snapshots also compressing at zstd's and \
         sealing at OpenSSL's), whichever is longer"
    );
    let head = format!(
        "mover-bench: {:.2} GiB volume ({:.2} GiB allocated), {} CPUs, kernel {}\n\
         load average before/after the timed runs: {} / {}\n\
         day of changes: {} of {} 4 KiB pages differ ({:.1}% of the volume, {:.1}% of pages \
         holding data)",
        images.size as f64 / (MIB * 1024.0),
        images.today_allocated as f64 / (MIB * 1024.0),
        results.nproc,
        results.kernel,
        results.load_before,
        results.load_after,
        diff.differing_pages,
        diff.total_pages,
        percent(diff.differing_pages, diff.total_pages),
        percent(diff.differing_pages, diff.compared_pages),
    );
    format!("{head}\n{disk}")
}

/// `part` as a percentage of `whole`.
fn percent(part: u64, whole: u64) -> f64 {
    100.0 * part as f64 / whole.max(1) as f64
}

/// One line of the timing table.
fn render_row(row: &Row) -> String {
    let run = row.run;
    let (ratio, target, verdict) = match &row.check {
        Some(check) => (check.measured_text(), check.target_text(), check.verdict()),
        None => (String::new(), String::new(), ""),
    };
    let mut tool = row.tool.clone();
    if run.differing_pages_after.is_some_and(|pages| pages != 0) {
        tool.push_str(" (INEXACT)");
    }
    let cpu = match run.server_cpu_seconds {
        Some(server) => format!("{:.1}+{server:.1}", run.cpu_seconds),
        None => format!("{:.1}", run.cpu_seconds),
    };
    let over_floor = row
        .over_floor()
        .map_or_else(String::new, |r| format!("{r:.2}x"));
    format!(
        "{:<12} {:<34} {:>9.3} {:>7} {:>10.1} {:>10} {:>11} {:>7} {:>9} {:>6}",
        row.phase,
        tool,
        run.seconds,
        over_floor,
        row.bytes as f64 / MIB / run.seconds,
        format!("{:.1} MiB", run.max_rss_bytes as f64 / MIB),
        cpu,
        ratio,
        target,
        verdict
    )
}

/// Writes `value` as pretty JSON to `path` durably: temporary file, fsync, rename.
pub fn write_json_file(path: &Path, value: &impl Serialize) -> Result<()> {
    let mut tmp_name = path.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    let mut text = serde_json::to_string_pretty(value).context("cannot serialise JSON")?;
    text.push('\n');
    let mut file =
        File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_compare_as_named() {
        assert!(Check::new("a", 0.9, Rule::AtLeast, 0.9, Unit::Ratio).pass);
        assert!(!Check::new("b", 1.11, Rule::AtMost, 1.1, Unit::Ratio).pass);
        assert!(!Check::new("c", 256.0, Rule::Below, 256.0, Unit::Mib).pass);
        assert!(Check::new("d", 0.0, Rule::AtMost, 0.0, Unit::Count).pass);
    }

    #[test]
    fn figures_render_with_units() {
        let check = Check::new("rss", 34.25, Rule::Below, 256.0, Unit::Mib);
        assert_eq!(check.measured_text(), "34.2 MiB");
        assert_eq!(check.target_text(), "< 256.0 MiB");
        let ratio = Check::new("r", 0.951, Rule::AtLeast, 0.9, Unit::Ratio);
        assert_eq!(ratio.target_text(), ">= 0.90x");
        assert_eq!(ratio.verdict(), "PASS");
    }
}
