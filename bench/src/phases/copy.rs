//! Copies timed from a dropped page cache, and the full and delta copies again with their
//! source in it: full, delta and sparse, mover against its peers.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde::Serialize;

use super::{Ctx, Run, RunOutput};
use crate::diff::{self, PageDiff};
use crate::image;
use crate::mover::{self, CopyReport};
use crate::process::{self, ThenSync, describe, drop_caches, run_timed, warm_cache};
use crate::progress::note;

/// How many times each copy command runs; the best time counts.
const COPY_RUNS: usize = 2;

/// The page cache a copy starts from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cache {
    /// Dropped: every source byte comes from the disk.
    Cold,
    /// Dropped, then the source (the loop device and today's image file) read into it: a
    /// copy right after the workload wrote, or a second copy of the same volume.
    Warm,
}

impl Cache {
    /// The phase name with this state: `full copy`, `full copy warm`.
    pub fn phase(self, name: &str) -> String {
        match self {
            Cache::Cold => name.to_string(),
            Cache::Warm => format!("{name} warm"),
        }
    }
}

/// The full copy to an empty destination.
#[derive(Debug, Clone, Serialize)]
pub struct FullCopy {
    /// The page cache the copies started from.
    pub cache: Cache,
    /// `cp --sparse=always`.
    pub cp: Run,
    /// `dd bs=4M conv=sparse`.
    pub dd: Run,
    /// `mover copy`.
    pub mover: Run,
}

/// The delta copy onto yesterday's image.
#[derive(Debug, Clone, Serialize)]
pub struct DeltaCopy {
    /// The page cache the copies started from.
    pub cache: Cache,
    /// Pages differing between yesterday's and today's image.
    pub changed: PageDiff,
    /// `rsync --inplace --no-whole-file`.
    pub rsync: Run,
    /// `mover copy` onto a copy made by cp: mover compares the whole destination.
    pub mover_unindexed: Run,
    /// `mover copy` onto a copy made by mover, whose saved chunk index spares reading
    /// unchanged chunks of the destination: the normal case, and the one judged.
    pub mover: Run,
    /// Bytes mover wrote, from its report.
    pub mover_bytes_written: u64,
    /// Bytes mover zeroed, from its report.
    pub mover_bytes_zeroed: u64,
    /// Pages mover wrote, from its report.
    pub mover_pages_written: u64,
    /// Bytes mover read from the destination, from its report.
    pub mover_destination_bytes_read: u64,
}

/// The copy of the 64 GiB sparse image.
#[derive(Debug, Clone, Serialize)]
pub struct SparseCopy {
    /// Logical size.
    pub size: u64,
    /// Bytes of data in it.
    pub data_bytes: u64,
    /// `cp --sparse=always`, for reference.
    pub cp: Run,
    /// `mover copy`.
    pub mover: Run,
}

/// Times full copies of the source device into a new file: cp, dd and mover.
pub fn full_copy(ctx: &Ctx, cache: Cache) -> Result<FullCopy> {
    let (dev, dst) = (ctx.device, &ctx.scratch);
    let mut cp = Command::new(&ctx.tools.cp);
    cp.arg("--sparse=always").arg(dev).arg(dst);
    let mut dd = Command::new(&ctx.tools.dd);
    dd.arg(format!("if={}", dev.display()))
        .arg(format!("of={}", dst.display()))
        .args(["bs=4M", "conv=sparse", "status=none"]);
    let mut trials = [
        Trial::new("cp --sparse=always", cp),
        Trial::new("dd bs=4M conv=sparse", dd),
        Trial::new("mover copy", mover::copy_command(ctx.mover, dev, dst)),
    ];
    let phase = cache.phase("full copy");
    race(ctx, &phase, &mut trials, None, &ctx.images.today, cache)?;
    let [cp, dd, mover] = trials;
    Ok(FullCopy {
        cache,
        cp: cp.best().0,
        dd: dd.best().0,
        mover: mover.best_mover(ctx.images.manifest.size)?.0,
    })
}

/// Times copies onto a destination holding yesterday's image: rsync and mover.
pub fn delta_copy(ctx: &Ctx, cache: Cache) -> Result<DeltaCopy> {
    let (today, yesterday) = (&ctx.images.today, &ctx.images.yesterday);
    let mut rsync = Command::new(&ctx.tools.rsync);
    rsync
        .args(["--inplace", "--no-whole-file"])
        .arg(today)
        .arg(&ctx.scratch);
    let mut indexed = Trial::new(
        "mover copy, yesterday's copy by mover",
        mover::copy_command(ctx.mover, ctx.device, &ctx.scratch),
    );
    indexed.prepare = Prepare::Mover;
    let mut trials = [
        Trial::new("rsync --inplace --no-whole-file", rsync),
        Trial::new(
            "mover copy, yesterday's copy by cp",
            mover::copy_command(ctx.mover, ctx.device, &ctx.scratch),
        ),
        indexed,
    ];
    let phase = cache.phase("delta copy");
    race(ctx, &phase, &mut trials, Some(yesterday), today, cache)?;
    let [rsync, unindexed, indexed] = trials;
    let (unindexed, _) = unindexed.best_mover(ctx.images.manifest.size)?;
    let (mover, report) = indexed.best_mover(ctx.images.manifest.size)?;
    Ok(DeltaCopy {
        cache,
        changed: ctx.images.manifest.diff,
        rsync: rsync.best().0,
        mover_unindexed: unindexed,
        mover,
        mover_bytes_written: report.bytes_written,
        mover_bytes_zeroed: report.bytes_zeroed,
        mover_pages_written: report.pages_written,
        mover_destination_bytes_read: report.destination_bytes_read,
    })
}

/// Times copies of the 64 GiB sparse image into a new file: cp and mover.
pub fn sparse_copy(ctx: &Ctx) -> Result<SparseCopy> {
    let (sparse, manifest) = (&ctx.images.sparse, &ctx.images.manifest);
    let mut cp = Command::new(&ctx.tools.cp);
    cp.arg("--sparse=always").arg(sparse).arg(&ctx.scratch);
    let mut trials = [
        Trial::new("cp --sparse=always", cp),
        Trial::new(
            "mover copy",
            mover::copy_command(ctx.mover, sparse, &ctx.scratch),
        ),
    ];
    race(ctx, "sparse copy", &mut trials, None, sparse, Cache::Cold)?;
    let [cp, mover] = trials;
    Ok(SparseCopy {
        size: manifest.sparse_size,
        data_bytes: image::data_bytes(&manifest.sparse_regions),
        cp: cp.best().0,
        mover: mover.best_mover(manifest.sparse_size)?.0,
    })
}

/// One copy command and its timed runs.
pub(super) struct Trial {
    /// Short name for the table.
    tool: &'static str,
    /// The command.
    cmd: Command,
    /// How a delta destination is made before each run.
    pub(super) prepare: Prepare,
    /// Where the command writes [default: the scratch destination].
    pub(super) destination: Option<PathBuf>,
    /// The server receiving the copy, whose CPU time each run also records.
    pub(super) server_pid: Option<u32>,
    /// For a delta destination: the command that writes yesterday's image into it
    /// instead of [`Trial::prepare`]'s (e.g. a push through mover's agent).
    pub(super) prepare_with: Option<Command>,
    /// After `prepare_with`: the /metrics port of the agent it pushed into, which is
    /// waited for until it has no background work left.
    pub(super) settle_at: Option<u16>,
    /// Each run and its stdout.
    runs: Vec<RunOutput>,
}

/// Who made yesterday's copy in the delta destination.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Prepare {
    /// `cp --sparse=always`: mover knows nothing about the destination and reads it all.
    Cp,
    /// `mover copy`: as in real use, mover saved the copy's chunk index and reads only
    /// the chunks that changed.
    Mover,
}

impl Trial {
    /// A trial of `cmd`, not run yet.
    pub(super) fn new(tool: &'static str, cmd: Command) -> Self {
        Self {
            tool,
            cmd,
            prepare: Prepare::Cp,
            destination: None,
            server_pid: None,
            prepare_with: None,
            settle_at: None,
            runs: Vec::new(),
        }
    }

    /// Where this trial's command writes.
    fn destination<'a>(&'a self, ctx: &'a Ctx) -> &'a Path {
        self.destination.as_deref().unwrap_or(&ctx.scratch)
    }

    /// The fastest run, listing every run's time, and reporting the worst exactness check;
    /// with its stdout.
    pub(super) fn best(self) -> RunOutput {
        let all_seconds: Vec<f64> = self.runs.iter().map(|(run, _)| run.seconds).collect();
        let worst_diff = self
            .runs
            .iter()
            .filter_map(|(run, _)| run.differing_pages_after)
            .max();
        let (mut best, stdout) = self
            .runs
            .into_iter()
            .min_by(|(a, _), (b, _)| a.seconds.total_cmp(&b.seconds))
            .expect("every trial runs at least once");
        best.all_seconds = all_seconds;
        best.differing_pages_after = worst_diff;
        (best, stdout)
    }

    /// [`Trial::best`] for a mover copy of a `volume_bytes` volume, with its report parsed
    /// and kept in the run.
    pub(super) fn best_mover(self, volume_bytes: u64) -> Result<(Run, CopyReport)> {
        let (mut run, stdout) = self.best();
        let (report, value) = mover::parse_report::<CopyReport>(&stdout, volume_bytes)?;
        run.mover_report = Some(value);
        Ok((run, report))
    }
}

/// Runs every trial [`COPY_RUNS`] times, round-robin, each from the same starting point
/// and page cache (see [`time_copy`]).
pub(super) fn race(
    ctx: &Ctx,
    phase: &str,
    trials: &mut [Trial],
    start_from: Option<&Path>,
    source: &Path,
    cache: Cache,
) -> Result<()> {
    for _ in 0..COPY_RUNS {
        for trial in trials.iter_mut() {
            let run = time_copy(ctx, phase, trial, start_from, source, cache)?;
            trial.runs.push(run);
        }
    }
    Ok(())
}

/// Times one run of `trial`: empties its destination (or makes it a copy of
/// `start_from`), drops the page cache (and for a warm run reads the source back into
/// it), runs the command plus a sync, then checks the destination against `source`
/// (untimed). Returns the run and the command's stdout.
fn time_copy(
    ctx: &Ctx,
    phase: &str,
    trial: &mut Trial,
    start_from: Option<&Path>,
    source: &Path,
    cache: Cache,
) -> Result<RunOutput> {
    let (tool, dst) = (trial.tool, trial.destination(ctx).to_path_buf());
    match (&mut trial.prepare_with, start_from) {
        (Some(cmd), Some(_)) => {
            image::remove_if_present(&dst)?;
            process::run_checked(cmd).context("cannot prepare the delta destination")?;
            if let Some(port) = trial.settle_at {
                wait_for_idle_agent(port)?;
            }
        }
        _ => prepare_destination(ctx, &dst, start_from.map(|p| (p, trial.prepare)))?,
    }
    drop_caches()?;
    // Held open through the run: the last close of a block device drops its cache.
    let _cached = match cache {
        Cache::Cold => Vec::new(),
        Cache::Warm => vec![warm_cache(ctx.device)?, warm_cache(&ctx.images.today)?],
    };
    note!("{phase}: {tool}");
    let server = trial.server_pid;
    let server_before =
        server.map(|pid| (process::process_cpu(pid), process::process_read_bytes(pid)));
    let timed = run_timed(&mut trial.cmd, ThenSync::Yes)?;
    let server_after =
        server.map(|pid| (process::process_cpu(pid), process::process_read_bytes(pid)));
    let (mut run, stdout) = Run::best(tool, describe(&trial.cmd), vec![timed]);
    if let (Some((cpu0, read0)), Some((cpu1, read1))) = (server_before, server_after) {
        run.server_cpu_seconds = cpu0
            .zip(cpu1)
            .map(|(a, b)| b.saturating_sub(a).as_secs_f64());
        run.server_read_bytes = read0.zip(read1).map(|(a, b)| b.saturating_sub(a));
    }
    let diff = diff::compare(source, &dst)
        .with_context(|| format!("cannot check the copy made by {tool}"))?;
    if diff.differing_pages != 0 {
        note!(
            "WARNING: after {tool}, {} pages of {} differ from {}",
            diff.differing_pages,
            dst.display(),
            source.display()
        );
    }
    run.differing_pages_after = Some(diff.differing_pages);
    run.destination_allocated_bytes = Some(std::fs::metadata(&dst)?.blocks() * 512);
    image::remove_if_present(&dst)?;
    Ok((run, stdout))
}

/// Waits until the agent with /metrics on 127.0.0.1:`port` hashes no new image's pages in
/// the background.
fn wait_for_idle_agent(port: u16) -> Result<()> {
    use std::io::{Read, Write};
    const GAUGE: &str = "mover_agent_page_hashing_active ";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(600);
    loop {
        let mut conn = std::net::TcpStream::connect(("127.0.0.1", port))
            .with_context(|| format!("cannot reach the agent's metrics on port {port}"))?;
        conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut text = String::new();
        conn.read_to_string(&mut text)?;
        let active = text
            .lines()
            .find_map(|l| l.strip_prefix(GAUGE))
            .with_context(|| format!("the agent's metrics lack {GAUGE}"))?;
        if active.trim() == "0" {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            bail!("the agent was still hashing pages in the background after 10 minutes");
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

/// Makes the destination `dst` absent, or a sparse copy of `start_from` made by cp or by
/// mover (untimed).
fn prepare_destination(ctx: &Ctx, dst: &Path, start_from: Option<(&Path, Prepare)>) -> Result<()> {
    image::remove_if_present(dst)?;
    let mut cmd = match start_from {
        None => return Ok(()),
        Some((from, Prepare::Cp)) => {
            let mut cp = Command::new(&ctx.tools.cp);
            cp.arg("--sparse=always").arg(from).arg(dst);
            cp
        }
        Some((from, Prepare::Mover)) => mover::copy_command(ctx.mover, from, dst),
    };
    process::run_checked(&mut cmd).context("cannot prepare the delta destination")?;
    Ok(())
}
