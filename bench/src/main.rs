//! `mover-bench`: builds a realistic volume, attaches it to a loop device, and times
//! `mover hash` and `mover copy` (full and delta, locally and through mover's agent over
//! 127.0.0.1) against b3sum, cp, dd, rsync and an rsync daemon in the same run, printing a
//! table of ratios and writing every figure as JSON.
//!
//! Run `mover-bench --help` for what is measured and which targets are checked.

mod charts;
mod cli;
mod cpu;
mod daemon;
mod diff;
mod floor;
mod guard;
mod image;
mod mover;
mod phases;
mod prng;
mod process;
mod progress;
mod report;
mod tls;
mod tools;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, bail};
use clap::Parser;

use crate::cli::Args;
use crate::floor::{DeviceSpeed, Throttle};
use crate::guard::LoopDevice;
use crate::image::CachePaths;
use crate::phases::{Cache, Ctx};
use crate::progress::note;
use crate::report::{Floors, Results};
use crate::tools::Tools;

/// Exit status when the run completed but some target was missed.
const EXIT_TARGET_MISSED: u8 = 2;

fn main() -> ExitCode {
    let args = Args::parse();
    progress::start();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(EXIT_TARGET_MISSED),
        Err(err) => {
            eprintln!("mover-bench: error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the whole bench; returns whether every target was met.
fn run(args: &Args) -> Result<bool> {
    tools::ensure_root()?;
    let chosen = Phases {
        copies: !args.only_snapshot && !args.only_agent,
        agent: !args.skip_agent && !args.only_snapshot,
        snapshot: !args.skip_snapshot && !args.only_agent,
    };
    let tools = Tools::find(chosen.agent, chosen.snapshot)?;
    let mover = tools::resolve_mover(args.mover.as_deref())?;
    let workdir = prepare_workdir(&args.workdir)?;
    let cache = CachePaths::new(&workdir);
    guard::cleanup_stale(&tools, &cache.mount_point, &cache.images())?;
    ensure_free_space(&workdir, args.size, args.skip_build)?;
    let json_path = args
        .json
        .clone()
        .unwrap_or_else(|| workdir.join("results.json"));

    let images = image::prepare(&tools, &cache, args.size, args.skip_build)?;
    let scratch = workdir.join("destination.img");
    // After the images are built (that is not what is measured), until the results are
    // out; lifted on drop, errors included.
    let throttle = Throttle::from_arg(&workdir, args.throttle, "mover-bench")?;
    let outcome = measure_and_publish(
        &tools,
        &mover,
        &images,
        Places {
            workdir: &workdir,
            scratch: scratch.clone(),
            json: &json_path,
            report: args.report.as_deref(),
        },
        chosen,
        throttle.as_ref().map(Throttle::describe),
    );
    drop(throttle);
    image::remove_if_present(&scratch)?;
    if !args.keep {
        note!("removing the images (pass --keep to reuse them with --skip-build)");
        cache.remove()?;
    }
    outcome
}

/// Where the phases work and the results go.
struct Places<'a> {
    /// The working directory.
    workdir: &'a Path,
    /// The local copies' destination.
    scratch: PathBuf,
    /// The JSON results.
    json: &'a Path,
    /// Where the HTML report goes, if anywhere.
    report: Option<&'a Path>,
}

/// Which phases run.
#[derive(Debug, Clone, Copy)]
struct Phases {
    /// Hashing, the local copies and the sparse copy.
    copies: bool,
    /// The copies through mover's agent.
    agent: bool,
    /// The snapshots against restic.
    snapshot: bool,
}

/// Attaches today's image to a loop device, runs the chosen phases, and publishes the
/// results.
fn measure_and_publish(
    tools: &Tools,
    mover: &Path,
    images: &image::Images,
    places: Places,
    chosen: Phases,
    throttle: Option<String>,
) -> Result<bool> {
    let started_unix_secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let device = LoopDevice::attach_read_only(tools, &images.today)?;
    note!(
        "source: {} on {}",
        images.today.display(),
        device.path().display()
    );
    let ctx = Ctx {
        tools,
        mover,
        images,
        device: device.path(),
        scratch: places.scratch,
        workdir: places.workdir,
        nproc: std::thread::available_parallelism().map_or(1, usize::from),
    };
    let mut results = Results {
        bench_version: env!("CARGO_PKG_VERSION"),
        started_unix_secs,
        kernel: kernel_release(),
        nproc: ctx.nproc,
        mover: mover.to_path_buf(),
        workdir: images
            .today
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
        source_device: device.path().to_path_buf(),
        images: images.manifest.clone(),
        hash: Vec::new(),
        full_copy: Vec::new(),
        delta_copy: Vec::new(),
        sparse_copy: None,
        agent: None,
        snapshot: None,
        bench_peak_rss_bytes: 0,
        load_before: load_average(),
        load_after: String::new(),
        throttle,
        floors: Floors::default(),
    };
    // The disk's speed right before each phase: what that phase's jobs are judged by.
    let floor = || -> Result<Option<DeviceSpeed>> {
        let speed = DeviceSpeed::measure(places.workdir, &images.today)?;
        note!(
            "disk under {}: {}",
            places.workdir.display(),
            speed.describe()
        );
        Ok(Some(speed))
    };
    // The JSON is rewritten after every phase, so a run stopped (or failed) midway keeps
    // the figures of the phases it finished.
    let save = |r: &Results| report::save_unfinished(r, places.json);
    if chosen.copies {
        results.hash = phases::hash(&ctx)?;
        save(&results)?;
        for cache in [Cache::Cold, Cache::Warm] {
            let speed = floor()?;
            match cache {
                Cache::Cold => results.floors.copies_cold = speed,
                Cache::Warm => results.floors.copies_warm = speed,
            }
            results.full_copy.push(phases::full_copy(&ctx, cache)?);
            save(&results)?;
            results.delta_copy.push(phases::delta_copy(&ctx, cache)?);
            save(&results)?;
        }
        results.sparse_copy = Some(phases::sparse_copy(&ctx)?);
        save(&results)?;
    }
    if chosen.agent {
        results.floors.agent = floor()?;
        results.agent = Some(phases::agent_copy(&ctx)?);
        save(&results)?;
    }
    if chosen.snapshot {
        results.floors.snapshot = floor()?;
        let cpu = cpu::CpuSpeed::measure(tools, &images.today, ctx.nproc, cpu::VOLUME_LEVEL)?;
        note!("CPU: {}", cpu.describe());
        results.floors.snapshot_cpu = Some(cpu);
        results.snapshot = Some(phases::snapshot(&ctx)?);
    }
    results.load_after = load_average();
    results.bench_peak_rss_bytes = process::own_peak_rss();
    drop(device);
    report::publish(&results, places.json, places.report)
}

/// Creates the working directory and returns its canonical path (mount points are matched
/// against /proc/self/mountinfo, which lists canonical paths).
fn prepare_workdir(workdir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(workdir)
        .with_context(|| format!("cannot create the workdir {}", workdir.display()))?;
    workdir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", workdir.display()))
}

/// Refuses to start when the workdir's filesystem cannot hold the images and a copy.
fn ensure_free_space(workdir: &Path, size: u64, reuse: bool) -> Result<()> {
    let stat = rustix::fs::statvfs(workdir)
        .with_context(|| format!("cannot statvfs {}", workdir.display()))?;
    let free = stat.f_bavail * stat.f_frsize;
    // Images are ~80% allocated: yesterday + today + one copy, plus the sparse image and
    // its copy; reusing images only needs room for the copies.
    let copies = size + (1 << 30);
    let needed = if reuse { copies } else { 2 * size + copies };
    if free < needed {
        bail!(
            "{} has {:.1} GiB free but the bench needs about {:.1} GiB at --size {size}",
            workdir.display(),
            free as f64 / f64::from(1 << 30),
            needed as f64 / f64::from(1 << 30)
        );
    }
    Ok(())
}

/// The 1, 5 and 15 minute load averages from `/proc/loadavg`, or `unknown`.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").map_or_else(
        |_| "unknown".to_string(),
        |s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "),
    )
}

/// The running kernel's release, or `unknown`.
fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map_or_else(|_| "unknown".to_string(), |s| s.trim().to_string())
}
