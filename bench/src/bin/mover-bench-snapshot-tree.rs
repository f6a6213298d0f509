//! `mover-bench-snapshot-tree`: snapshots of a real file tree, `mover snapshot` against
//! `restic`, in one run on the same tree. Run `--help` for what is built and checked.

#[allow(dead_code)] // shared with mover-bench
#[path = "../charts.rs"]
mod charts;
#[allow(dead_code)] // the CPU floor, shared with mover-bench
#[path = "../cpu.rs"]
mod cpu;
#[allow(dead_code)] // the device floor and --throttle, shared with mover-bench
#[path = "../floor.rs"]
mod floor;
#[allow(dead_code)] // the floor's random bytes
#[path = "../prng.rs"]
mod prng;
#[allow(dead_code)] // the bench's process helpers, shared with mover-bench
#[path = "../process.rs"]
mod process;
#[allow(dead_code)] // the programs the CPU floor runs, shared with mover-bench
#[path = "../tools.rs"]
mod tools;
#[allow(dead_code)] // the tree's floor, shared with mover-bench-tree
#[path = "../treefloor.rs"]
mod treefloor;
#[allow(dead_code)] // shared with mover-bench-tree
#[path = "../treefs.rs"]
mod treefs;

use anyhow::{Context, Result, bail};
use clap::Parser;
use cpu::{CpuSpeed, CpuWork};
use floor::{DeviceSpeed, MAX_OVER_FLOOR};
use process::{ThenSync, drop_caches, run_checked, run_timed};
use serde::Serialize;
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
};
use treefloor::TreeFloor;
use treefs::{
    Volume, check_identical, copy_sources, default_sources, describe_sources, edit_real_tree,
};

const LONG_ABOUT: &str = "\
Benchmarks `mover snapshot create` and `mover snapshot restore` of a directory against
`restic backup` and `restic restore`, on a real tree: the --source directories (default
/usr and the cargo registry: hundreds of thousands of files of every size, deep
directories) copied with `cp -a` onto a fresh ext4 filesystem (a sparse image in
WORKDIR on a loop device with direct I/O), both repositories in WORKDIR/repos.
Each round makes both repositories anew and times, from a dropped page cache, each tool:
  first        the first snapshot: restic / mover >= 2x;
  incremental  after a day of real edits (1% of files appended to, 0.5% overwritten in
               place, a directory of the tree deleted, a copy of another one added with
               10% of its files changed): restic / mover >= 3x;
  restore      the latest snapshot into an absent directory on the same filesystem,
               flushed (sync): restic / mover >= 2x;
and records each repository's size after the incremental step (mover <= restic) and
each run's peak memory (wait4 ru_maxrss; mover <= restic). The tools run in turn, the
order swapped every round; each step's median of --rounds rounds counts. Every restore
is compared with the source by `rsync -aHAXnc --delete -i` (untimed; any itemized line
is a failure). The edits of each round differ (seeded by the round).
Each step also has a floor, measured in the same run: the largest of
  walk    a parallel cold statx of the tree (first and incremental);
  create  the tree's directories, empty files and symlinks made anew and synced (restore);
  data    the bytes read and written, at the disk's direct speed (files read, mover's
          packs written; a restore reads the packs and writes the files);
  cpu     those bytes hashed (b3sum), the new ones compressed (zstd -3, a tree's level)
          and sealed (ChaCha20-Poly1305), at the fastest speeds measured on this machine,
          on a sample of the tree's own files, spread over every CPU.
A step passes by its restic ratio or within 1.3x of its floor (the floor may leave no
room for the ratio), and by mover's memory.
Exit status: 0 all targets met, 2 some target missed, 1 error. Needs root, restic, rsync.";

/// Benchmark tree snapshots against restic.
#[derive(Debug, Parser)]
#[command(name = "mover-bench-snapshot-tree", version, about, long_about = LONG_ABOUT)]
struct Args {
    /// Directory for the filesystem image, its mount, and both repositories.
    #[arg(long, default_value = "/var/tmp/mover-bench-snapshot-tree")]
    workdir: PathBuf,
    /// Directories to copy into the tree (repeat) [default: /usr and the cargo registry].
    #[arg(long = "source", value_name = "DIR")]
    sources: Vec<PathBuf>,
    /// Rounds; each step's median run of each tool counts.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    rounds: u32,
    /// The mover binary [default: `mover` next to this executable].
    #[arg(long)]
    mover: Option<PathBuf>,
    /// The restic binary.
    #[arg(long, default_value = "restic")]
    restic: PathBuf,
    /// Where to write the results [default: WORKDIR/results.json].
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write an HTML page with SVG charts into DIR (I/O over time of each tool in
    /// each step's median round, speed-up and memory against the targets).
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
    /// Throttle the workdir's disk for the timed runs, as on a slow day: `WRITE[:READ]`
    /// bytes per second (`400M`, `400M:900M`), through the block cgroup.
    #[arg(long, value_name = "WRITE[:READ]", value_parser = floor::parse_throttle)]
    throttle: Option<(u64, u64)>,
}

/// One tool's run.
#[derive(Debug, Clone, Serialize)]
struct Run {
    seconds: f64,
    cpu_seconds: f64,
    max_rss_bytes: u64,
    /// (seconds, bytes read and written so far) while it ran.
    io_samples: Vec<(f64, u64)>,
    /// What it printed (mover's snapshot JSON: what it read, stored and compressed).
    #[serde(skip)]
    stdout: Vec<u8>,
}

/// One step: each tool's median run, every round's seconds, and the ratios.
#[derive(Debug, Serialize)]
struct Step {
    name: &'static str,
    target: f64,
    restic: Run,
    mover: Run,
    restic_rounds: Vec<f64>,
    mover_rounds: Vec<f64>,
    /// restic's time / mover's.
    speedup: f64,
    /// mover's peak RSS / restic's (at most 1 is the target).
    memory_ratio: f64,
    /// The floor of mover's median round.
    floor: TreeFloor,
    /// mover's time / its floor.
    over_floor: f64,
    /// restic's time / the same floor.
    restic_over_floor: f64,
    /// The restic ratio or the floor met, and the memory.
    pass: bool,
}

#[derive(Debug, Serialize)]
struct Results {
    sources: Vec<PathBuf>,
    files: u64,
    bytes: u64,
    steps: Vec<Step>,
    /// Repository sizes after the incremental step (median round), bytes.
    restic_repo_bytes: u64,
    mover_repo_bytes: u64,
    repo_size_pass: bool,
    /// The speeds the floors are made of.
    disk: DeviceSpeed,
    cpu: CpuSpeed,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("mover-bench-snapshot-tree: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

const PASSWORD: &str = "bench-password";
/// zstd level of the CPU floor: the level of a tree's blobs (`ZSTD_LEVEL` in snapshots'
/// pack.rs; a /usr tar at level 1 came out 10% larger).
const TREE_ZSTD_LEVEL: u32 = 3;

/// The paths of one round.
struct Paths {
    src: PathBuf,
    restic_repo: PathBuf,
    restic_cache: PathBuf,
    mover_repo: PathBuf,
    mover_cache: PathBuf,
    restic_restore: PathBuf,
    mover_restore: PathBuf,
}

fn run(args: &Args) -> Result<bool> {
    if !rustix::process::geteuid().is_root() {
        bail!("run as root (drop_caches, loop devices, ownership)");
    }
    let mover = match &args.mover {
        Some(m) => m.clone(),
        None => std::env::current_exe()?.with_file_name("mover"),
    };
    let sources = if args.sources.is_empty() {
        default_sources(&["/usr"])
    } else {
        args.sources.clone()
    };
    let (files, bytes) = describe_sources(&sources)?;
    fs::create_dir_all(&args.workdir)?;
    // The source, one restore at a time, and room for the edits.
    let volume = Volume::make(
        &args.workdir,
        bytes * 5 / 2 + (2 << 30),
        files * 3 + 100_000,
    )?;
    let src = volume.mnt.join("src");
    copy_sources(&sources, &src)?;
    let repos = args.workdir.join("repos");
    // The tree is copied in at full speed; the snapshots run on the slow disk.
    let _throttle =
        floor::Throttle::from_arg(&args.workdir, args.throttle, "mover-bench-snapshot-tree")?;
    let speeds = Speeds::measure(&args.workdir, &src, &volume.mnt.join("floor-skeleton"))?;
    let paths = Paths {
        src: src.clone(),
        restic_repo: repos.join("restic"),
        restic_cache: repos.join("restic-cache"),
        mover_repo: repos.join("mover"),
        mover_cache: repos.join("mover-cache"),
        restic_restore: volume.mnt.join("restore-restic"),
        mover_restore: volume.mnt.join("restore-mover"),
    };
    let mut runs: [[Vec<Run>; 2]; 3] = Default::default();
    let mut floors: [Vec<TreeFloor>; 3] = Default::default();
    let mut sizes = Vec::new();
    for round in 0..args.rounds {
        eprintln!("== round {} of {}", round + 1, args.rounds);
        _ = fs::remove_dir_all(&repos);
        fs::create_dir_all(&repos)?;
        run_checked(restic(&args.restic, &paths).arg("init"))?;
        run_checked(
            Command::new(&mover)
                .env("MOVER_PASSWORD", PASSWORD)
                .args(["repo", "init"])
                .arg(&paths.mover_repo),
        )?;
        let swap = round % 2 == 1;
        let restic_first = || -> Result<Run> {
            timed(
                restic(&args.restic, &paths)
                    .args(["backup", "--quiet"])
                    .arg(&paths.src),
            )
        };
        let mover_first = || -> Result<Run> {
            timed(
                mover_cmd(&mover, &paths)
                    .args(["snapshot", "create", "--json"])
                    .arg(&paths.mover_repo)
                    .arg(&paths.src),
            )
        };
        let before = treefloor::stamps(&paths.src)?;
        let (r, m) = in_turn(swap, "first", restic_first, mover_first)?;
        floors[0].push(speeds.snapshot_floor(before.values().map(|s| s.0).sum(), &m)?);
        runs[0][0].push(r);
        runs[0][1].push(m);
        edit_real_tree(&paths.src, round as u64)?;
        let changed = treefloor::bytes_changed_since(&paths.src, &before)?;
        let (r, m) = in_turn(swap, "incremental", restic_first, mover_first)?;
        floors[1].push(speeds.snapshot_floor(changed, &m)?);
        runs[1][0].push(r);
        runs[1][1].push(m);
        sizes.push((du(&paths.restic_repo)?, du(&paths.mover_repo)?));
        let tree_bytes = treefloor::bytes_changed_since(&paths.src, &Default::default())?;
        floors[2].push(speeds.restore_floor(sizes[sizes.len() - 1].1, tree_bytes));
        let restic_restore = || -> Result<Run> {
            _ = fs::remove_dir_all(&paths.restic_restore);
            timed(
                restic(&args.restic, &paths)
                    .args(["restore", "latest", "--target"])
                    .arg(&paths.restic_restore),
            )
        };
        let mover_restore = || -> Result<Run> {
            _ = fs::remove_dir_all(&paths.mover_restore);
            timed(
                mover_cmd(&mover, &paths)
                    .args(["snapshot", "restore", "--json"])
                    .arg(&paths.mover_repo)
                    .arg("latest")
                    .arg(&paths.mover_restore),
            )
        };
        let (r, m) = in_turn(swap, "restore", restic_restore, mover_restore)?;
        runs[2][0].push(r);
        runs[2][1].push(m);
        let restic_tree = paths
            .restic_restore
            .join(paths.src.strip_prefix("/").unwrap_or(&paths.src));
        check_identical(&paths.src, &paths.mover_restore)?;
        check_identical(&paths.src, &restic_tree)?;
        fs::remove_dir_all(&paths.mover_restore)?;
        fs::remove_dir_all(&paths.restic_restore)?;
    }
    let names = ["first", "incremental", "restore"];
    let targets = [2.0, 3.0, 2.0];
    let mut steps = Vec::new();
    for (i, [restic_runs, mover_runs]) in runs.into_iter().enumerate() {
        let rounds = |v: &[Run]| v.iter().map(|r| r.seconds).collect::<Vec<_>>();
        let (restic_rounds, mover_rounds) = (rounds(&restic_runs), rounds(&mover_runs));
        let floor = floors[i][median_index(&mover_rounds)];
        let (restic, mover) = (median(restic_runs), median(mover_runs));
        let speedup = restic.seconds / mover.seconds;
        let memory_ratio = mover.max_rss_bytes as f64 / restic.max_rss_bytes.max(1) as f64;
        let over_floor = mover.seconds / floor.seconds();
        steps.push(Step {
            name: names[i],
            target: targets[i],
            pass: (speedup >= targets[i] || over_floor <= MAX_OVER_FLOOR) && memory_ratio <= 1.0,
            restic_over_floor: restic.seconds / floor.seconds(),
            restic,
            mover,
            restic_rounds,
            mover_rounds,
            speedup,
            memory_ratio,
            floor,
            over_floor,
        });
    }
    sizes.sort_by_key(|&(r, m)| m as i128 - r as i128);
    let (restic_repo_bytes, mover_repo_bytes) = sizes[sizes.len() / 2];
    let results = Results {
        sources,
        files,
        bytes,
        steps,
        restic_repo_bytes,
        mover_repo_bytes,
        repo_size_pass: mover_repo_bytes <= restic_repo_bytes,
        disk: speeds.disk,
        cpu: speeds.cpu,
    };
    let mib = |b: u64| b as f64 / 1048576.0;
    let mut table = String::new();
    use std::fmt::Write as _;
    writeln!(
        table,
        "step          restic      mover  restic/mover  target    floor  mover/floor  \
         peak RSS restic / mover (mover/restic)"
    )?;
    for s in &results.steps {
        writeln!(
            table,
            "{:<12} {:>7.2}s {:>8.2}s {:>11.2}x {:>6.1}x {:>7.2}s {:>11.2}x   \
             {:.0} / {:.0} MiB ({:.2})  {}",
            s.name,
            s.restic.seconds,
            s.mover.seconds,
            s.speedup,
            s.target,
            s.floor.seconds(),
            s.over_floor,
            mib(s.restic.max_rss_bytes),
            mib(s.mover.max_rss_bytes),
            s.memory_ratio,
            if s.pass { "PASS" } else { "FAIL" }
        )?;
    }
    writeln!(
        table,
        "floors (a step passes by its restic ratio or within {MAX_OVER_FLOOR}x of its floor; \
         restic's time / floor in brackets):"
    )?;
    for s in &results.steps {
        writeln!(
            table,
            "  {:<12} {} ({:.2}x)",
            s.name,
            s.floor.describe(),
            s.restic_over_floor
        )?;
    }
    writeln!(table, "  disk: {}", results.disk.describe())?;
    writeln!(table, "  CPU: {}", results.cpu.describe())?;
    writeln!(
        table,
        "repository after the incremental step: restic {:.0} MiB, mover {:.0} MiB  {}",
        mib(results.restic_repo_bytes),
        mib(results.mover_repo_bytes),
        if results.repo_size_pass {
            "PASS"
        } else {
            "FAIL"
        }
    )?;
    if args.rounds > 1 {
        writeln!(
            table,
            "each tool's median of {} rounds (all in the results file)",
            args.rounds
        )?;
    }
    print!("\n{table}");
    let json = args
        .json
        .clone()
        .unwrap_or_else(|| args.workdir.join("results.json"));
    fs::write(&json, serde_json::to_vec_pretty(&results)?)?;
    println!("results: {}", json.display());
    if let Some(dir) = &args.report {
        write_report(dir, &results, &table)?;
        println!("report: {}", dir.join("index.html").display());
    }
    volume.remove()?;
    _ = fs::remove_dir_all(&repos);
    Ok(results.repo_size_pass && results.steps.iter().all(|s| s.pass))
}

/// The HTML report: one I/O-over-time chart per step, the speed-ups, the times over the
/// floors and the memory.
fn write_report(dir: &Path, results: &Results, table: &str) -> Result<()> {
    use charts::{Bar, Figure, Series, bar_chart, rates, throughput_chart, write_page};
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut figures = Vec::new();
    for s in &results.steps {
        let file = format!("{}.svg", s.name);
        throughput_chart(
            &dir.join(&file),
            &format!(
                "{}: restic {:.1} s, mover {:.1} s",
                s.name, s.restic.seconds, s.mover.seconds
            ),
            &[
                Series {
                    label: "restic".into(),
                    points: rates(&s.restic.io_samples),
                },
                Series {
                    label: "mover".into(),
                    points: rates(&s.mover.io_samples),
                },
            ],
            Some(s.floor.seconds()),
        )?;
        figures.push(Figure {
            file,
            caption: format!(
                "{}: I/O of each tool over time (median round, page cache dropped first; \
                 dashed: the floor)",
                s.name
            ),
        });
    }
    let speedups: Vec<Bar> = results
        .steps
        .iter()
        .map(|s| Bar {
            label: format!("{} (restic / mover time)", s.name),
            value: s.speedup,
            target: Some(s.target),
            pass: s.speedup >= s.target,
        })
        .collect();
    bar_chart(
        &dir.join("speedup.svg"),
        "speed-up over restic",
        "x faster (target: black tick)",
        &speedups,
    )?;
    figures.push(Figure {
        file: "speedup.svg".into(),
        caption: "restic's time / mover's, each step's median of the rounds".into(),
    });
    let over_floor: Vec<(String, f64)> = results
        .steps
        .iter()
        .map(|s| (format!("{}: mover", s.name), s.over_floor))
        .collect();
    treefloor::over_floor_chart(&dir.join("floor.svg"), &over_floor)?;
    figures.push(Figure {
        file: "floor.svg".into(),
        caption: "mover's time / its floor (the cold walk or the entries made, the bytes at \
                  the disk's speed, the CPU's hashing, compressing and sealing), median round"
            .into(),
    });
    let mib = |b: u64| b as f64 / 1048576.0;
    let mut memory = Vec::new();
    for s in &results.steps {
        memory.push(Bar {
            label: format!("{} restic", s.name),
            value: mib(s.restic.max_rss_bytes),
            target: None,
            pass: true,
        });
        memory.push(Bar {
            label: format!("{} mover", s.name),
            value: mib(s.mover.max_rss_bytes),
            target: Some(mib(s.restic.max_rss_bytes)),
            pass: s.memory_ratio <= 1.0,
        });
    }
    bar_chart(
        &dir.join("memory.svg"),
        "peak memory (RSS)",
        "MiB (mover's target: restic's)",
        &memory,
    )?;
    figures.push(Figure {
        file: "memory.svg".into(),
        caption: "peak resident memory of each tool in each step".into(),
    });
    write_page(
        dir,
        "mover-bench-snapshot-tree: mover snapshot against restic",
        table,
        &figures,
    )
}

fn restic(bin: &Path, p: &Paths) -> Command {
    let mut c = Command::new(bin);
    c.env("RESTIC_PASSWORD", PASSWORD)
        .arg("--repo")
        .arg(&p.restic_repo)
        .arg("--cache-dir")
        .arg(&p.restic_cache);
    c
}

fn mover_cmd(bin: &Path, p: &Paths) -> Command {
    let mut c = Command::new(bin);
    c.env("MOVER_PASSWORD", PASSWORD)
        .env("MOVER_CACHE_DIR", &p.mover_cache)
        .env("RUST_LOG", "warn");
    c
}

/// Runs restic's and mover's run of a step, in turn (mover first if `swap`).
fn in_turn(
    swap: bool,
    step: &str,
    restic: impl Fn() -> Result<Run>,
    mover: impl Fn() -> Result<Run>,
) -> Result<(Run, Run)> {
    let say = |tool: &str, r: &Run| {
        eprintln!(
            "   {step}: {tool} {:.2}s, {:.0} MiB",
            r.seconds,
            r.max_rss_bytes as f64 / 1048576.0
        )
    };
    if swap {
        let m = mover()?;
        say("mover", &m);
        let r = restic()?;
        say("restic", &r);
        Ok((r, m))
    } else {
        let r = restic()?;
        say("restic", &r);
        let m = mover()?;
        say("mover", &m);
        Ok((r, m))
    }
}

/// Runs `cmd` from a dropped page cache to a final sync(2).
fn timed(cmd: &mut Command) -> Result<Run> {
    drop_caches()?;
    let r = run_timed(cmd, ThenSync::Yes)?;
    Ok(Run {
        seconds: r.elapsed.as_secs_f64(),
        cpu_seconds: r.cpu.as_secs_f64(),
        max_rss_bytes: r.max_rss_bytes,
        io_samples: r.io_samples,
        stdout: r.stdout,
    })
}

/// What every round's floors are made of, measured once, on the disk as throttled.
struct Speeds {
    disk: DeviceSpeed,
    cpu: CpuSpeed,
    /// A cold walk of the tree.
    walk: f64,
    /// The tree's entries made.
    create: f64,
}

impl Speeds {
    /// Measures the disk under `workdir`, the CPU on a sample of `src`'s files, a cold
    /// walk of `src` and its skeleton made under `scratch`.
    fn measure(workdir: &Path, src: &Path, scratch: &Path) -> Result<Self> {
        eprintln!(
            "== the floor: the disk, the CPU on the tree's files, a cold walk, its entries made"
        );
        let disk = treefloor::disk_speed(workdir)?;
        eprintln!("   disk: {}", disk.describe());
        let cpu = tree_cpu_speed(workdir, src)?;
        eprintln!("   CPU: {}", cpu.describe());
        let walk = treefloor::walk_seconds(&[src])?;
        let create = treefloor::create_seconds(src, scratch)?;
        eprintln!("   walk {walk:.2} s, create {create:.2} s");
        Ok(Self {
            disk,
            cpu,
            walk,
            create,
        })
    }

    /// A snapshot's floor: the tree walked, `read` bytes of files read and hashed, and
    /// what mover's `run` reports it stored: the new bytes compressed, the packs sealed
    /// and written.
    fn snapshot_floor(&self, read: u64, run: &Run) -> Result<TreeFloor> {
        let (new, stored) = stored_bytes(run)?;
        Ok(TreeFloor {
            walk: self.walk,
            create: 0.0,
            data: self.disk.floor_seconds(read, stored),
            cpu: self.cpu.floor_seconds(CpuWork {
                hash: read,
                compress: new,
                seal: stored,
            }),
        })
    }

    /// A restore's floor: the tree's entries made, `repo` bytes of packs read and opened,
    /// `tree` bytes of files written and hashed (decompressing left out: a floor may be
    /// low, never high).
    fn restore_floor(&self, repo: u64, tree: u64) -> TreeFloor {
        TreeFloor {
            walk: 0.0,
            create: self.create,
            data: self.disk.floor_seconds(repo, tree),
            cpu: self.cpu.floor_seconds(CpuWork {
                hash: tree,
                compress: 0,
                seal: repo,
            }),
        }
    }
}

/// The CPU's speeds on a sample of `src`'s own files (up to 1 GiB of them, written to
/// `workdir` and removed afterwards), compressing at a tree's zstd level.
fn tree_cpu_speed(workdir: &Path, src: &Path) -> Result<CpuSpeed> {
    // openssl with the agent phase's tools; zstd is the snapshot phase's, without restic
    // (this bench takes restic from --restic).
    let mut tools = tools::Tools::find(true, false)?;
    tools.zstd =
        Some(tools::find_program("zstd").context("the CPU floor needs `zstd` (apt install zstd)")?);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let sample = workdir.join(".cpu-sample.tmp");
    let speed = treefloor::sample_contents(src, &sample, 1 << 30)
        .and_then(|_| CpuSpeed::measure(&tools, &sample, threads, TREE_ZSTD_LEVEL));
    _ = fs::remove_file(&sample);
    speed
}

/// What mover's snapshot JSON says it did: (new plaintext bytes, bytes stored in packs).
fn stored_bytes(run: &Run) -> Result<(u64, u64)> {
    let json: serde_json::Value = serde_json::from_slice(&run.stdout)
        .context("`mover snapshot create --json` printed no JSON")?;
    let field = |name: &str| {
        json["summary"][name]
            .as_u64()
            .with_context(|| format!("no summary.{name} in mover's snapshot JSON: {json}"))
    };
    Ok((field("new_bytes")?, field("stored_bytes")?))
}

/// The round of the median of `seconds`, as [`median`] picks it.
fn median_index(seconds: &[f64]) -> usize {
    let mut order: Vec<usize> = (0..seconds.len()).collect();
    order.sort_by(|&a, &b| seconds[a].total_cmp(&seconds[b]));
    order[order.len() / 2]
}

/// The median run by time (the upper of an even count), with the highest peak memory.
fn median(mut runs: Vec<Run>) -> Run {
    let peak = runs.iter().map(|r| r.max_rss_bytes).max().unwrap_or(0);
    runs.sort_by(|a, b| a.seconds.total_cmp(&b.seconds));
    let mut m = runs.swap_remove(runs.len() / 2);
    m.max_rss_bytes = peak;
    m
}

/// Bytes a directory occupies (`du -sb`).
fn du(dir: &Path) -> Result<u64> {
    let out = run_checked(Command::new("du").arg("-sb").arg(dir))?;
    String::from_utf8_lossy(&out)
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .context("du printed no size")
}
