//! `mover-bench-tree`: file-tree copies, `mover copy DIR DIR` and `mover copy --replica`
//! against `rsync -aHAX`, in one run on the same tree: the initial copy, a rerun with
//! nothing changed, and a delta after a day of edits. Run `mover-bench-tree --help` for
//! what is built and checked.

#[allow(dead_code)] // shared with mover-bench
#[path = "../charts.rs"]
mod charts;
#[allow(dead_code)] // the device floor and --throttle, shared with mover-bench
#[path = "../floor.rs"]
mod floor;
#[allow(dead_code)] // the floor's random bytes
#[path = "../prng.rs"]
mod prng;
#[allow(dead_code)] // the bench's process helpers, shared with mover-bench
#[path = "../process.rs"]
mod process;
#[allow(dead_code)] // the snapshots' parts, shared with mover-bench-snapshot-tree
#[path = "../treefloor.rs"]
mod treefloor;
#[path = "../treefs.rs"]
mod treefs;

use anyhow::{Context, Result, bail};
use clap::Parser;
use floor::{DeviceSpeed, MAX_OVER_FLOOR};
use process::{ThenSync, drop_caches, run_timed};
use serde::Serialize;
use std::{
    fs,
    io::Write,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};
use treefloor::TreeFloor;
use treefs::{
    Rng, Volume, check_identical, copy_sources, default_sources, describe_sources, edit_real_tree,
};

const LONG_ABOUT: &str = "\
Benchmarks `mover copy DIR DIR` (which looks at every destination entry, as rsync does) and
`mover copy --replica DIR DIR` (which compares the source with the record of its last run)
against `rsync -aHAX` on a tree of many small files plus a few large ones:
  --files small files of 0-8 KiB in directories of 1000, 4 large files of 256 MiB,
  a symlink and a hard link per directory, a user xattr on every 100th file.
Each run makes a fresh ext4 filesystem (a sparse image in WORKDIR on a loop device with
direct I/O, like a new volume) and builds the tree and both copies in it, so no run
inherits another's freed inodes or fragmentation; the image is removed at the end.
Three steps, each timed for the three copies from a dropped page cache to a final sync(2):
  initial   into an absent destination: rsync / mover >= 2x;
  no-change the same command again: rsync / mover >= 5x; run --rounds times (each tool in
            turn, every round), each tool's median run counts: mover's is about a second,
            where the host's jitter weighs most;
  delta     after edits (2% of the small files rewritten, 1% deleted, 1000 added, 1 MiB
            inserted in the middle of two large files), with --delete: rsync / mover >= 3x;
            --rounds times, each round after a new day of edits (its own seed), each
            tool's median run counts.
With --real (or --source DIR...), the tree is a real one instead: the given directories
(default /usr/share and the cargo registry: every size of file, deep directories) copied
with `cp -a` onto the fresh filesystem, and the delta step makes a day of real edits (1%
of files appended to, 0.5% overwritten in place, a directory deleted, a copy of another
added with 10% of its files changed); the targets are the same.
`mover copy --replica` runs with --delete in every step, as a mirror does.
Each step also has a floor, measured in the same run on the same filesystem: the least
time this machine allows for what the step must do, the longest of
  walk      a parallel cold statx of every entry the copy compares (the source; for the
            plain mode the destination too): the disk's seeks and the kernel's CPU;
  create    (into an absent destination) the source's directories, empty files and
            symlinks made anew with many threads, synced;
  data      the bytes of the files new or changed (size or time) since the last copy,
            read once and written once at the disk's O_DIRECT speeds (measured first).
A mode meets a step's target when its peer ratio does, or when its time is within 1.3x
of its floor (the floor then leaves no room for the peer ratio).
After each step's three timed runs both of mover's copies are checked identical to the
source by `rsync -aHAXnc --delete -i` (untimed; any itemized line is a failure).
Peak memory (wait4 ru_maxrss) is reported for each run.
--throttle W[:R] makes the workdir's disk slow for the timed runs (see mover-bench --help).
Exit status: 0 all targets met, by plain mover and by --replica alike, 2 some target
missed, 1 error. Needs root and rsync.";

/// Benchmark `mover copy` of file trees against rsync.
#[derive(Debug, Parser)]
#[command(name = "mover-bench-tree", version, about, long_about = LONG_ABOUT)]
struct Args {
    /// Directory for the filesystem image (sparse; about 4.5 times the tree), its mount,
    /// and the replica record (in WORKDIR/state).
    #[arg(long, default_value = "/var/tmp/mover-bench-tree")]
    workdir: PathBuf,
    /// Number of small files in the source tree.
    #[arg(long, default_value_t = 200_000)]
    files: u64,
    /// Size of each of the 4 large files, in MiB.
    #[arg(long, default_value_t = 256)]
    large_mib: u64,
    /// Leave the filesystem mounted at WORKDIR/mnt at the end, with the source tree and
    /// the three copies (the next run replaces it).
    #[arg(long)]
    keep: bool,
    /// Rounds of the no-change and delta steps (rsync, mover, --replica in each; a delta
    /// round after new edits); the median run of each tool counts.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// The mover binary [default: `mover` next to this executable].
    #[arg(long)]
    mover: Option<PathBuf>,
    /// Copy a real tree instead of the synthetic one: /usr/share and the cargo registry,
    /// or the --source directories.
    #[arg(long)]
    real: bool,
    /// A directory to copy into the real tree (repeat; implies --real).
    #[arg(long = "source", value_name = "DIR")]
    sources: Vec<PathBuf>,
    /// Also write an HTML page with SVG charts into DIR (each tool's I/O over time in
    /// each step, the speed-ups against the targets, peak memory).
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
    /// Throttle the workdir's disk for the timed runs, as on a slow day: `WRITE[:READ]`
    /// bytes per second (`400M`, `400M:900M`), through the block cgroup.
    #[arg(long, value_name = "WRITE[:READ]", value_parser = floor::parse_throttle)]
    throttle: Option<(u64, u64)>,
}

/// One step, timed for rsync and both of mover's modes.
#[derive(Debug, Serialize)]
struct Step {
    name: &'static str,
    target: f64,
    rsync: Timed,
    mover: Timed,
    /// `mover copy --replica`.
    replica: Timed,
    /// rsync time / mover time.
    speedup: f64,
    /// rsync time / `--replica` time.
    replica_speedup: f64,
    /// Bytes of files new or changed since the last copy (the first round's).
    changed_bytes: u64,
    /// The plain mode's floor: the source and its destination walked.
    floor: TreeFloor,
    /// `--replica`'s floor: the source walked.
    replica_floor: TreeFloor,
    /// mover's time / its floor.
    over_floor: f64,
    /// `--replica`'s time / its floor.
    replica_over_floor: f64,
    /// Both modes met the target (the peer ratio, or within `MAX_OVER_FLOOR` of the
    /// floor).
    pass: bool,
}

/// One tool's run of a step (its median run, when the step has several rounds).
#[derive(Debug, Serialize)]
struct Timed {
    seconds: f64,
    /// Every round's seconds, in the order run.
    rounds: Vec<f64>,
    cpu_seconds: f64,
    max_rss_bytes: u64,
    /// mover's JSON summary.
    report: serde_json::Value,
    /// (seconds, bytes read and written so far) while it ran.
    io_samples: Vec<(f64, u64)>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("mover-bench-tree: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<bool> {
    if !rustix::process::geteuid().is_root() {
        bail!("run as root (drop_caches, ownership)");
    }
    let mover = match &args.mover {
        Some(m) => m.clone(),
        None => std::env::current_exe()?.with_file_name("mover"),
    };
    fs::create_dir_all(&args.workdir)?;
    let sources = match (args.real, args.sources.is_empty()) {
        (_, false) => args.sources.clone(),
        (true, true) => default_sources(&["/usr/share"]),
        (false, true) => Vec::new(),
    };
    // Four trees (source and three copies), small files taking a block or two each.
    let (size, inodes) = if sources.is_empty() {
        let tree = args.files * 8192 + 4 * (args.large_mib << 20);
        let inodes = 5 * (args.files + args.files / 1000 * 10 + 1000);
        (tree * 9 / 2 + (1 << 30), inodes)
    } else {
        let (files, bytes) = describe_sources(&sources)?;
        (
            (bytes + files * 4096) * 9 / 2 + (2 << 30),
            files * 5 + 100_000,
        )
    };
    let volume = Volume::make(&args.workdir, size, inodes)?;
    let src = volume.mnt.join("src");
    if sources.is_empty() {
        build_tree(&src, args.files, args.large_mib)?;
    } else {
        copy_sources(&sources, &src)?;
    }
    let state = args.workdir.join("state");
    _ = fs::remove_dir_all(&state);
    // The tree is built at full speed; the copies run on the slow disk. Lifted on drop.
    let _throttle = floor::Throttle::from_arg(&args.workdir, args.throttle, "mover-bench-tree")?;
    eprintln!("measuring the disk under {}", args.workdir.display());
    let disk = treefloor::disk_speed(&args.workdir)?;
    eprintln!("disk: {}", disk.describe());
    let dsts = Dsts {
        rsync: volume.mnt.join("rsync-dst"),
        mover: volume.mnt.join("mover-dst"),
        replica: volume.mnt.join("replica-dst"),
        state,
        scratch: volume.mnt.join("floor-skeleton"),
        disk,
    };
    let mut steps = Vec::new();
    let no_edit = |_| Ok(());
    steps.push(step(
        "initial", 2.0, &mover, &src, &dsts, false, 1, &no_edit,
    )?);
    let rounds = args.rounds as usize;
    steps.push(step(
        "no-change",
        5.0,
        &mover,
        &src,
        &dsts,
        false,
        rounds,
        &no_edit,
    )?);
    // Each round's edits are new ones (their own seed), made before any tool runs.
    let edit = |round: u64| {
        if sources.is_empty() {
            edit_tree(&src, args.files, args.large_mib, round)
        } else {
            edit_real_tree(&src, round)
        }
    };
    steps.push(step(
        "delta", 3.0, &mover, &src, &dsts, true, rounds, &edit,
    )?);

    let mut table = String::from(
        "step        rsync -aHAX   mover (rsync/mover)   --replica (rsync/mover)  target  \
         peak RSS rsync / mover / --replica\n",
    );
    let mib = |b: u64| b as f64 / 1048576.0;
    for s in &steps {
        table.push_str(&format!(
            "{:<10} {:>9.2}s {:>8.2}s ({:>5.2}x) {:>10.2}s ({:>5.2}x) {:>8.1}x  \
             {:.1} / {:.1} / {:.1} MiB  {}\n",
            s.name,
            s.rsync.seconds,
            s.mover.seconds,
            s.speedup,
            s.replica.seconds,
            s.replica_speedup,
            s.target,
            mib(s.rsync.max_rss_bytes),
            mib(s.mover.max_rss_bytes),
            mib(s.replica.max_rss_bytes),
            if s.pass { "PASS" } else { "FAIL" }
        ));
    }
    if rounds > 1 {
        table.push_str(&format!(
            "no-change and delta: each tool's median of {rounds} rounds (all in the results \
             file)\n"
        ));
    }
    table.push_str(&format!(
        "\nfloors (disk: {}; a mode passes by its peer ratio or within {MAX_OVER_FLOOR}x \
         of its floor)\n\
         step         changed   mover floor (time/floor)   --replica floor (time/floor)\n",
        disk.describe()
    ));
    for s in &steps {
        table.push_str(&format!(
            "{:<10} {:>8.1} MiB {:>10.2}s ({:>5.2}x) {:>14.2}s ({:>5.2}x)\n",
            s.name,
            mib(s.changed_bytes),
            s.floor.seconds(),
            s.over_floor,
            s.replica_floor.seconds(),
            s.replica_over_floor,
        ));
    }
    for s in &steps {
        table.push_str(&format!(
            "  {:<10} mover: {}; --replica: {}\n",
            s.name,
            s.floor.describe(),
            s.replica_floor.describe()
        ));
    }
    print!("\n{table}");
    let json = args.workdir.join("results.json");
    fs::write(&json, serde_json::to_vec_pretty(&steps)?)?;
    println!("results: {}", json.display());
    if let Some(dir) = &args.report {
        write_report(dir, &steps, &sources, &table)?;
        println!("report: {}", dir.join("index.html").display());
    }
    if args.keep {
        volume.keep();
    } else {
        volume.remove()?;
    }
    Ok(steps.iter().all(|s| s.pass))
}

/// The HTML report: each step's I/O over time per tool, the speed-ups, the memory.
fn write_report(dir: &Path, steps: &[Step], sources: &[PathBuf], table: &str) -> Result<()> {
    use charts::{Bar, Figure, Series, bar_chart, rates, throughput_chart, write_page};
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut figures = Vec::new();
    let mut speedups = Vec::new();
    let mut memory = Vec::new();
    let mib = |b: u64| b as f64 / 1048576.0;
    for s in steps {
        let runs = [
            ("rsync -aHAX", &s.rsync),
            ("mover", &s.mover),
            ("mover --replica", &s.replica),
        ];
        let series: Vec<Series> = runs
            .iter()
            .map(|(tool, t)| Series {
                label: format!("{tool} ({:.1} s)", t.seconds),
                points: rates(&t.io_samples),
            })
            .collect();
        let file = format!("{}.svg", s.name);
        throughput_chart(&dir.join(&file), s.name, &series, None)?;
        figures.push(Figure {
            file,
            caption: format!(
                "{}: each tool's I/O over time (median run, page cache dropped first)",
                s.name
            ),
        });
        for (label, value) in [("mover", s.speedup), ("mover --replica", s.replica_speedup)] {
            speedups.push(Bar {
                label: format!("{}: {label} (rsync / mover time)", s.name),
                value,
                target: Some(s.target),
                pass: value >= s.target,
            });
        }
        for (tool, t) in runs {
            memory.push(Bar {
                label: format!("{}: {tool}", s.name),
                value: mib(t.max_rss_bytes),
                target: None,
                pass: true,
            });
        }
    }
    bar_chart(
        &dir.join("speedup.svg"),
        "speed-up over rsync -aHAX",
        "x faster (target: black tick)",
        &speedups,
    )?;
    bar_chart(&dir.join("memory.svg"), "peak memory (RSS)", "MiB", &memory)?;
    let over_floor: Vec<(String, f64)> = steps
        .iter()
        .flat_map(|s| {
            [
                ("mover", s.over_floor),
                ("mover --replica", s.replica_over_floor),
            ]
            .map(|(label, value)| (format!("{}: {label}", s.name), value))
        })
        .collect();
    treefloor::over_floor_chart(&dir.join("floor.svg"), &over_floor)?;
    figures.push(Figure {
        file: "speedup.svg".into(),
        caption: "rsync's time / mover's in each step".into(),
    });
    figures.push(Figure {
        file: "floor.svg".into(),
        caption: "each mode's time / its floor (the cold walk, the entries made, the \
                  changed bytes at the disk's speed: the longest)"
            .into(),
    });
    figures.push(Figure {
        file: "memory.svg".into(),
        caption: "peak resident memory of each run".into(),
    });
    let what = if sources.is_empty() {
        "the synthetic tree".to_string()
    } else {
        sources
            .iter()
            .map(|s| s.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    write_page(
        dir,
        &format!("mover-bench-tree: mover copy against rsync on {what}"),
        table,
        &figures,
    )
}

/// Where the three copies go, the replica record, and what the floors need.
struct Dsts {
    rsync: PathBuf,
    mover: PathBuf,
    replica: PathBuf,
    /// mover's --state-dir.
    state: PathBuf,
    /// Where the create floor makes the source's skeleton (on the copies' filesystem).
    scratch: PathBuf,
    /// The disk's speeds, for the data floor.
    disk: DeviceSpeed,
}

/// Times rsync, mover and `mover --replica` on the same step (`rounds` times, in turn,
/// each round after `edit(round)`), checks mover's copies, and compares each tool's
/// median run.
#[allow(clippy::too_many_arguments)]
fn step(
    name: &'static str,
    target: f64,
    mover: &Path,
    src: &Path,
    dsts: &Dsts,
    delete: bool,
    rounds: usize,
    edit: &dyn Fn(u64) -> Result<()>,
) -> Result<Step> {
    let rsync_run = || -> Result<Timed> {
        eprintln!("== {name}: rsync");
        let mut rsync = Command::new("rsync");
        rsync.arg("-aHAX");
        if delete {
            rsync.arg("--delete");
        }
        rsync.arg(format!("{}/", src.display()));
        rsync.arg(format!("{}/", dsts.rsync.display()));
        timed(&mut rsync)
    };
    let mover_run = |dst: &Path, replica: bool| -> Result<Timed> {
        eprintln!(
            "== {name}: mover{}",
            if replica { " --replica" } else { "" }
        );
        let mut cmd = Command::new(mover);
        cmd.args(["copy", "--json", "--no-progress"]);
        cmd.arg("--state-dir").arg(&dsts.state);
        // A replica mirrors: --delete on every run (more work than rsync's steps without
        // it, never less), so one record serves them all.
        if delete || replica {
            cmd.arg("--delete");
        }
        if replica {
            cmd.arg("--replica");
        }
        cmd.arg(src).arg(dst);
        timed(&mut cmd)
    };
    let (mut rsync, mut plain, mut replica) = (Vec::new(), Vec::new(), Vec::new());
    let mut floors = None;
    for round in 0..rounds {
        edit(round as u64)?;
        if round == 0 {
            floors = Some(step_floors(name, src, dsts)?);
        }
        rsync.push(rsync_run()?);
        plain.push(mover_run(&dsts.mover, false)?);
        replica.push(mover_run(&dsts.replica, true)?);
    }
    let (rsync, plain, replica) = (median(rsync), median(plain), median(replica));
    // Checked once all three are timed: the check reads both whole trees, which would
    // leave whatever runs after it colder than what ran before (the VM's disk has a
    // cache of its own that drop_caches cannot reach).
    check_identical(src, &dsts.mover)?;
    check_identical(src, &dsts.replica)?;
    let speedup = rsync.seconds / plain.seconds;
    let replica_speedup = rsync.seconds / replica.seconds;
    let (changed_bytes, floor, replica_floor) = floors.context("no round ran")?;
    let over_floor = plain.seconds / floor.seconds();
    let replica_over_floor = replica.seconds / replica_floor.seconds();
    let on_target = |ratio: f64, over: f64| ratio >= target || over <= MAX_OVER_FLOOR;
    Ok(Step {
        name,
        target,
        rsync,
        mover: plain,
        replica,
        speedup,
        replica_speedup,
        changed_bytes,
        floor,
        replica_floor,
        over_floor,
        replica_over_floor,
        // Both modes: a plain rerun is what most users type.
        pass: on_target(speedup, over_floor) && on_target(replica_speedup, replica_over_floor),
    })
}

/// The step's floors before any tool runs it: the bytes to copy, and (plain mode,
/// `--replica`) each mode's floor.
fn step_floors(name: &str, src: &Path, dsts: &Dsts) -> Result<(u64, TreeFloor, TreeFloor)> {
    eprintln!("== {name}: floors");
    let changed = treefloor::changed_bytes(src, &dsts.rsync)?;
    let data = dsts.disk.floor_seconds(changed, changed);
    // Into an absent destination every entry is made.
    let create = if dsts.mover.exists() {
        0.0
    } else {
        treefloor::create_seconds(src, &dsts.scratch)?
    };
    let replica = TreeFloor {
        walk: treefloor::walk_seconds(&[src])?,
        create,
        data,
        cpu: 0.0,
    };
    let plain = if dsts.mover.exists() {
        TreeFloor {
            walk: treefloor::walk_seconds(&[src, &dsts.mover])?,
            ..replica
        }
    } else {
        replica
    };
    eprintln!(
        "   changed {changed} bytes; mover: {}; --replica: {}",
        plain.describe(),
        replica.describe()
    );
    Ok((changed, plain, replica))
}

/// The run with the median time (the upper one of an even count), with every run's time
/// and the highest peak memory of any.
fn median(mut runs: Vec<Timed>) -> Timed {
    let all: Vec<f64> = runs.iter().map(|t| t.seconds).collect();
    let peak = runs.iter().map(|t| t.max_rss_bytes).max().unwrap_or(0);
    runs.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
    let mut m = runs.swap_remove(runs.len() / 2);
    m.rounds = all;
    m.max_rss_bytes = peak;
    m
}

/// Runs `cmd` from a dropped page cache to a final sync(2).
fn timed(cmd: &mut Command) -> Result<Timed> {
    drop_caches()?;
    let r = run_timed(cmd, ThenSync::Yes)?;
    Ok(Timed {
        seconds: r.elapsed.as_secs_f64(),
        rounds: Vec::new(),
        cpu_seconds: r.cpu.as_secs_f64(),
        max_rss_bytes: r.max_rss_bytes,
        report: serde_json::from_slice(&r.stdout).unwrap_or_default(),
        io_samples: r.io_samples,
    })
}

fn small_path(root: &Path, i: u64) -> PathBuf {
    root.join(format!(
        "d{:03}/s{:02}/f{i}.dat",
        i / 10_000,
        (i / 1000) % 10
    ))
}

/// Builds the source tree.
fn build_tree(root: &Path, files: u64, large_mib: u64) -> Result<()> {
    eprintln!(
        "building {files} small files and 4 large ones in {}",
        root.display()
    );
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut buf = vec![0u8; 8192];
    for i in 0..files {
        let path = small_path(root, i);
        if i % 1000 == 0 {
            let dir = path.parent().context("parent")?;
            fs::create_dir_all(dir)?;
            symlink(format!("f{i}.dat"), dir.join("latest"))?;
        }
        let len = (rng.next() % 8192) as usize;
        rng.fill(&mut buf[..len]);
        fs::write(&path, &buf[..len])?;
        if i % 1000 == 1 {
            fs::hard_link(&path, path.with_extension("link"))?;
        }
        if i % 100 == 0 {
            rustix::fs::setxattr(
                &path,
                "user.origin",
                b"bench",
                rustix::fs::XattrFlags::empty(),
            )?;
        }
    }
    let mut big = vec![0u8; 1 << 20];
    for n in 0..4 {
        let path = root.join(format!("large-{n}.bin"));
        let mut f = std::io::BufWriter::new(fs::File::create(&path)?);
        for _ in 0..large_mib {
            rng.fill(&mut big);
            f.write_all(&big)?;
        }
    }
    Ok(())
}

/// A day of edits: 2% of the small files rewritten, 1% deleted, 1000 added, and 1 MiB
/// inserted in the middle of two large files; each `round` picks other small files.
fn edit_tree(root: &Path, files: u64, large_mib: u64, round: u64) -> Result<()> {
    eprintln!("editing the source tree");
    let mut rng = Rng(0x1234_5678_9abc_def1 + round * 7919);
    let mut buf = vec![0u8; 8192];
    for i in (0..files).step_by(50) {
        let len = (rng.next() % 8192) as usize;
        rng.fill(&mut buf[..len]);
        fs::write(small_path(root, (i + 7 + round) % files), &buf[..len])?;
    }
    for i in (0..files).step_by(100) {
        _ = fs::remove_file(small_path(root, (i + 13 + 3 * round) % files));
    }
    for i in 0..1000 {
        let path =
            small_path(root, i * (files / 1000)).with_file_name(format!("new{round}-{i}.dat"));
        fs::write(path, format!("new file {i}"))?;
    }
    for n in 0..2 {
        // Streamed through a new file: the bench's own memory is every child's RSS floor.
        let path = root.join(format!("large-{n}.bin"));
        let edited = path.with_extension("edited");
        let mut from = std::io::BufReader::new(fs::File::open(&path)?);
        let mut to = std::io::BufWriter::new(fs::File::create(&edited)?);
        std::io::copy(
            &mut std::io::Read::take(&mut from, (large_mib / 2) << 20),
            &mut to,
        )?;
        let mut insert = vec![0u8; 1 << 20];
        rng.fill(&mut insert);
        to.write_all(&insert)?;
        std::io::copy(&mut from, &mut to)?;
        to.flush()?;
        drop(to);
        fs::rename(&edited, &path)?;
    }
    Ok(())
}
