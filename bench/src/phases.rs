//! The timed runs: hashing, full copy, delta copy and the sparse-image copy, each pitting
//! mover against its peers in the same run.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::diff::{self, PageDiff};
use crate::image::{self, Images};
use crate::mover::{self, CopyReport, HashReport};
use crate::process::{self, ThenSync, Timed, describe, drop_caches, run_timed};
use crate::progress::note;
use crate::tools::Tools;

/// How many times each hashing command runs; the best time counts.
const HASH_RUNS: usize = 3;

/// What the runs need.
#[derive(Debug)]
pub struct Ctx<'a> {
    /// The peers.
    pub tools: &'a Tools,
    /// The mover binary.
    pub mover: &'a Path,
    /// The images.
    pub images: &'a Images,
    /// Loop device attached read-only to today's image: the source of mover's runs.
    pub device: &'a Path,
    /// The destination of every copy (a file next to the images, so on the same disk).
    pub scratch: PathBuf,
    /// Threads for the multi-threaded hash comparison.
    pub nproc: usize,
}

/// One timed command.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// Short name for the table.
    pub tool: String,
    /// The full command line.
    pub command: String,
    /// Best wall-clock time, including the trailing sync for copies.
    pub seconds: f64,
    /// The part of `seconds` spent in the trailing sync.
    pub sync_seconds: f64,
    /// Every run's time, when the command ran more than once.
    pub all_seconds: Vec<f64>,
    /// Peak RSS of the command's process (wait4 ru_maxrss).
    pub max_rss_bytes: u64,
    /// For copies: bytes the destination occupies on disk afterwards.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub destination_allocated_bytes: Option<u64>,
    /// For copies: 4 KiB pages of the destination differing from the source afterwards
    /// (0 means the copy is exact).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub differing_pages_after: Option<u64>,
    /// For mover: its own `--json` report, verbatim.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mover_report: Option<serde_json::Value>,
}

impl Run {
    /// A run from the best of `timings` (which must not be empty), and the stdout of that
    /// best run.
    fn best(tool: &str, command: String, timings: Vec<Timed>) -> (Self, Vec<u8>) {
        let all_seconds: Vec<f64> = timings.iter().map(|t| t.elapsed.as_secs_f64()).collect();
        let best = timings
            .into_iter()
            .min_by_key(|t| t.elapsed)
            .expect("at least one timing");
        let run = Self {
            tool: tool.to_string(),
            command,
            seconds: best.elapsed.as_secs_f64(),
            sync_seconds: best.sync.as_secs_f64(),
            all_seconds: if all_seconds.len() > 1 { all_seconds } else { Vec::new() },
            max_rss_bytes: best.max_rss_bytes,
            destination_allocated_bytes: None,
            differing_pages_after: None,
            mover_report: None,
        };
        (run, best.stdout)
    }

    /// Whether this copy was checked and found exact.
    pub fn is_exact(&self) -> bool {
        self.differing_pages_after == Some(0)
    }
}

/// Hashing at one thread count.
#[derive(Debug, Clone, Serialize)]
pub struct HashResult {
    /// Threads given to both tools.
    pub threads: usize,
    /// `b3sum --num-threads N today.img`.
    pub b3sum: Run,
    /// `mover hash --threads N /dev/loopX`.
    pub mover: Run,
    /// mover's own measure of its best run (without process start-up).
    pub mover_internal_seconds: f64,
}

/// The full copy to an empty destination.
#[derive(Debug, Clone, Serialize)]
pub struct FullCopy {
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
    /// Pages differing between yesterday's and today's image.
    pub changed: PageDiff,
    /// `rsync --inplace --no-whole-file`.
    pub rsync: Run,
    /// `mover copy`.
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

/// Times hashing of the page-cached image by b3sum and mover, at 1 and `nproc` threads.
pub fn hash(ctx: &Ctx) -> Result<Vec<HashResult>> {
    note!("hash: warming the page cache");
    warm_cache(&ctx.images.today)?;
    warm_cache(ctx.device)?;
    let size = ctx.images.manifest.size;
    let mut counts = vec![1, ctx.nproc];
    counts.dedup();
    counts
        .into_iter()
        .map(|threads| {
            note!("hash: {threads} thread(s), best of {HASH_RUNS}");
            let mut b3sum = Command::new(&ctx.tools.b3sum);
            b3sum
                .args(["--num-threads", &threads.to_string()])
                .arg(&ctx.images.today);
            let (b3sum, _) = best_of(&format!("b3sum --num-threads {threads}"), &mut b3sum)?;
            let mut cmd = mover::hash_command(ctx.mover, ctx.device, threads);
            let (mut mover, stdout) = best_of(&format!("mover hash --threads {threads}"), &mut cmd)?;
            let (report, value) = mover::parse_report::<HashReport>(&stdout, size)?;
            mover.mover_report = Some(value);
            Ok(HashResult {
                threads,
                b3sum,
                mover,
                mover_internal_seconds: report.duration_secs,
            })
        })
        .collect()
}

/// Times full copies of the source device into a new file: cp, dd, then mover.
pub fn full_copy(ctx: &Ctx) -> Result<FullCopy> {
    let dev = ctx.device;
    let mut cp = Command::new(&ctx.tools.cp);
    cp.arg("--sparse=always").arg(dev).arg(&ctx.scratch);
    let mut dd = Command::new(&ctx.tools.dd);
    dd.arg(format!("if={}", dev.display()))
        .arg(format!("of={}", ctx.scratch.display()))
        .args(["bs=4M", "conv=sparse", "status=none"]);
    let mut mover = mover::copy_command(ctx.mover, dev, &ctx.scratch);
    let today = &ctx.images.today;
    Ok(FullCopy {
        cp: time_copy(ctx, "full copy", "cp --sparse=always", &mut cp, None, today)?,
        dd: time_copy(ctx, "full copy", "dd bs=4M conv=sparse", &mut dd, None, today)?,
        mover: time_mover_copy(ctx, "full copy", &mut mover, None, today)?.0,
    })
}

/// Times copies onto a destination holding yesterday's image: rsync, then mover.
pub fn delta_copy(ctx: &Ctx) -> Result<DeltaCopy> {
    let (today, yesterday) = (&ctx.images.today, &ctx.images.yesterday);
    let mut rsync = Command::new(&ctx.tools.rsync);
    rsync
        .args(["--inplace", "--no-whole-file"])
        .arg(today)
        .arg(&ctx.scratch);
    let rsync = time_copy(
        ctx,
        "delta copy",
        "rsync --inplace --no-whole-file",
        &mut rsync,
        Some(yesterday),
        today,
    )?;
    let mut mover = mover::copy_command(ctx.mover, ctx.device, &ctx.scratch);
    let (mover, report) = time_mover_copy(ctx, "delta copy", &mut mover, Some(yesterday), today)?;
    Ok(DeltaCopy {
        changed: ctx.images.manifest.diff,
        rsync,
        mover,
        mover_bytes_written: report.bytes_written,
        mover_bytes_zeroed: report.bytes_zeroed,
        mover_pages_written: report.pages_written,
        mover_destination_bytes_read: report.destination_bytes_read,
    })
}

/// Times copies of the 64 GiB sparse image into a new file: cp, then mover.
pub fn sparse_copy(ctx: &Ctx) -> Result<SparseCopy> {
    let sparse = &ctx.images.sparse;
    let mut cp = Command::new(&ctx.tools.cp);
    cp.arg("--sparse=always").arg(sparse).arg(&ctx.scratch);
    let mut mover = mover::copy_command(ctx.mover, sparse, &ctx.scratch);
    let manifest = &ctx.images.manifest;
    Ok(SparseCopy {
        size: manifest.sparse_size,
        data_bytes: image::data_bytes(&manifest.sparse_regions),
        cp: time_copy(ctx, "sparse copy", "cp --sparse=always", &mut cp, None, sparse)?,
        mover: time_mover_copy(ctx, "sparse copy", &mut mover, None, sparse)?.0,
    })
}

/// Runs `cmd` [`HASH_RUNS`] times; returns the best run and its stdout.
fn best_of(tool: &str, cmd: &mut Command) -> Result<(Run, Vec<u8>)> {
    let timings = (0..HASH_RUNS)
        .map(|_| run_timed(cmd, ThenSync::No))
        .collect::<Result<Vec<_>>>()?;
    Ok(Run::best(tool, describe(cmd), timings))
}

/// Times one mover copy (see [`time_copy`]) and returns its parsed report too.
fn time_mover_copy(
    ctx: &Ctx,
    phase: &str,
    cmd: &mut Command,
    start_from: Option<&Path>,
    source: &Path,
) -> Result<(Run, CopyReport)> {
    let volume_bytes = std::fs::metadata(source)?.len();
    let (mut run, stdout) = time_copy_raw(ctx, phase, "mover copy", cmd, start_from, source)?;
    let (report, value) = mover::parse_report::<CopyReport>(&stdout, volume_bytes)?;
    run.mover_report = Some(value);
    Ok((run, report))
}

/// Times one copy: empties the scratch destination (or makes it a copy of `start_from`),
/// drops the page cache, runs `cmd` plus a sync, then checks the destination against
/// `source` (untimed).
fn time_copy(
    ctx: &Ctx,
    phase: &str,
    tool: &str,
    cmd: &mut Command,
    start_from: Option<&Path>,
    source: &Path,
) -> Result<Run> {
    Ok(time_copy_raw(ctx, phase, tool, cmd, start_from, source)?.0)
}

/// [`time_copy`], also returning the command's stdout.
fn time_copy_raw(
    ctx: &Ctx,
    phase: &str,
    tool: &str,
    cmd: &mut Command,
    start_from: Option<&Path>,
    source: &Path,
) -> Result<(Run, Vec<u8>)> {
    prepare_destination(ctx, start_from)?;
    drop_caches()?;
    note!("{phase}: {tool}");
    let timed = run_timed(cmd, ThenSync::Yes)?;
    let (mut run, stdout) = Run::best(tool, describe(cmd), vec![timed]);
    let diff = diff::compare(source, &ctx.scratch)
        .with_context(|| format!("cannot check the copy made by {tool}"))?;
    if diff.differing_pages != 0 {
        note!(
            "WARNING: after {tool}, {} pages of {} differ from {}",
            diff.differing_pages,
            ctx.scratch.display(),
            source.display()
        );
    }
    run.differing_pages_after = Some(diff.differing_pages);
    run.destination_allocated_bytes = Some(std::fs::metadata(&ctx.scratch)?.blocks() * 512);
    image::remove_if_present(&ctx.scratch)?;
    Ok((run, stdout))
}

/// Makes the scratch destination absent, or a sparse copy of `start_from` (untimed).
fn prepare_destination(ctx: &Ctx, start_from: Option<&Path>) -> Result<()> {
    image::remove_if_present(&ctx.scratch)?;
    if let Some(start_from) = start_from {
        process::run_checked(
            Command::new(&ctx.tools.cp)
                .arg("--sparse=always")
                .arg(start_from)
                .arg(&ctx.scratch),
        )
        .context("cannot prepare the delta destination")?;
    }
    Ok(())
}

/// Reads `path` to its end so its pages are cached.
fn warm_cache(path: &Path) -> Result<()> {
    let mut file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut buf = vec![0u8; 1 << 20];
    while file
        .read(&mut buf)
        .with_context(|| format!("cannot read {}", path.display()))?
        != 0
    {}
    Ok(())
}
