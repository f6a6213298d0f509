//! `mover-bench-podio`: a pod's I/O on a mover volume (the agent's one-file FUSE file
//! under a loop device, as mover's CSI plugin stages a volume that is still arriving)
//! against a loop device straight over a plain image file of the same volume. Run with
//! `--help` for what is measured and checked.

#[allow(dead_code)] // agents and child processes, shared with mover-bench-hydrate
#[path = "../agents.rs"]
mod agents;
#[allow(dead_code)] // shared with mover-bench
#[path = "../charts.rs"]
mod charts;
#[allow(dead_code)] // the bench's process helpers, shared with mover-bench
#[path = "../process.rs"]
mod process;

use agents::{Agent, TOKEN, fresh_workdir, median, mover_binary, parse_size, sh};
use anyhow::{Context, Result, bail};
use clap::Parser;
use process::{drop_caches, run_checked};
use serde::Serialize;
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

const LONG_ABOUT: &str = "\
Benchmarks a pod's I/O on a mover volume. Two agents on 127.0.0.1: the source exports an
ext4 volume of --size holding a copy of /usr/share; the destination hydrates it, and its
CSI plugin stages it for a pod (NodeStageVolume, NodePublishVolume with a Block
capability), as the kubelet does: a loop device over the agent's FUSE file. fio (O_DIRECT
on the device, libaio) runs the same jobs on three devices:
  (a) plain      a loop device straight over a plain image file of the volume, on the
                 same disk (losetup's defaults, as mover's own for a volume already here);
  (b) complete   mover's device, staged while the volume hydrated, once it is complete
                 (a pod that started during the fill keeps this device for good);
  (c) hydrating  mover's device while its fill runs: a fresh volume for each job, its
                 filler limited to a quarter of the volume per --seconds (a pod's reads
                 of regions not here yet fetch them at once, past the limit).
Jobs: 1 MiB sequential read (cold: page cache dropped, one pass; then warm) and write,
4 KiB random read (cold, then warm) and write at depth 32, 4 KiB random read and write at
depth 1 (latency p50/p99), and `db`: ext4 made on the device, 4 KiB random writes each
followed by fsync (as a database commits). --runs rounds; medians are reported. The
cold sequential read also has its floor: an O_DIRECT read of the device's image file
(the source's for (c)) just before it, on the same disk; each run's time over it.
Targets, (b) over (a): >= 0.8x for sequential throughput, >= 0.5x for 4 KiB random IOPS
at depth 32. Needs root, fio, e2fsprogs, util-linux. Exit status: 0 all targets met, 2
some target missed, 1 error.";

/// Benchmark a pod's I/O on a mover device against a plain loop device.
#[derive(Debug, Parser)]
#[command(name = "mover-bench-podio", version, about, long_about = LONG_ABOUT)]
struct Args {
    /// Size of the volume.
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    size: u64,
    /// Directory for the images (about 4x --size).
    #[arg(long, default_value = "/var/tmp/mover-bench-podio")]
    workdir: PathBuf,
    /// The mover binary [default: beside this one].
    #[arg(long)]
    mover: Option<PathBuf>,
    /// Rounds of every job on every device (medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Seconds of each timed (warm) job.
    #[arg(long, default_value_t = 5)]
    seconds: u64,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write an HTML page with SVG charts into DIR.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["only", "skip_hydrating"])]
    report: Option<PathBuf>,
    /// Run only these jobs (comma-separated names, as the table shows them), to look
    /// closer at a few rows; the page (--report) needs them all.
    #[arg(long, value_delimiter = ',', value_name = "JOB,...")]
    only: Vec<String>,
    /// Skip (c), the device while it hydrates (a fresh fill per job: the slow part).
    #[arg(long)]
    skip_hydrating: bool,
}

/// One fio job.
#[derive(Clone, Copy)]
struct Job {
    name: &'static str,
    /// fio's --rw.
    rw: &'static str,
    block: &'static str,
    depth: u32,
    /// Page cache dropped first, and one pass (`cold_bytes`) instead of a timed run.
    cold: bool,
    /// On a file of an ext4 made on the device, each write followed by fsync.
    db: bool,
    /// The figure judged: throughput (sequential) or IOPS (random).
    throughput: bool,
    /// The least (b) / (a) of this job's figure, if it has a target.
    target: Option<f64>,
}

const JOBS: [Job; 9] = [
    spec("seq-read-cold", "read", "1M", 32, true, true, Some(0.8)),
    spec("seq-read", "read", "1M", 32, false, true, Some(0.8)),
    spec("seq-write", "write", "1M", 32, false, true, Some(0.8)),
    spec(
        "rand-read-cold-qd32",
        "randread",
        "4k",
        32,
        true,
        false,
        Some(0.5),
    ),
    spec(
        "rand-read-qd32",
        "randread",
        "4k",
        32,
        false,
        false,
        Some(0.5),
    ),
    spec(
        "rand-write-qd32",
        "randwrite",
        "4k",
        32,
        false,
        false,
        Some(0.5),
    ),
    spec("rand-read-qd1", "randread", "4k", 1, false, false, None),
    spec("rand-write-qd1", "randwrite", "4k", 1, false, false, None),
    // Last: it makes a file system over the volume's bytes.
    spec("db-fsync-write", "randwrite", "4k", 1, false, false, None).on_ext4(),
];

#[allow(clippy::too_many_arguments)]
const fn spec(
    name: &'static str,
    rw: &'static str,
    block: &'static str,
    depth: u32,
    cold: bool,
    throughput: bool,
    target: Option<f64>,
) -> Job {
    Job {
        name,
        rw,
        block,
        depth,
        cold,
        db: false,
        throughput,
        target,
    }
}

impl Job {
    const fn on_ext4(mut self) -> Job {
        self.db = true;
        self
    }
}

/// One job's figures on one device.
#[derive(Debug, Clone, Default, Serialize)]
struct Figures {
    iops: f64,
    mib_per_sec: f64,
    p50_us: f64,
    p99_us: f64,
    /// A cold sequential read's floor: the disk's O_DIRECT read of the device's image
    /// file, measured just before (0 for other jobs).
    floor_mib_per_sec: f64,
}

/// The devices, in the report's order.
const DEVICES: [&str; 3] = ["plain", "complete", "hydrating"];

#[derive(Debug, Default, Serialize)]
struct Results {
    volume_bytes: u64,
    runs: usize,
    /// job -> device -> each run's figures.
    runs_by_job: BTreeMap<String, BTreeMap<String, Vec<Figures>>>,
    /// job -> device -> the medians.
    medians: BTreeMap<String, BTreeMap<String, Figures>>,
    /// job -> (b) / (a) and (c) / (a) of the judged figure.
    complete_over_plain: BTreeMap<String, f64>,
    hydrating_over_plain: BTreeMap<String, f64>,
    /// job -> how much of (c)'s volume had arrived when the job ended, each run.
    hydrating_arrived_fraction: BTreeMap<String, Vec<f64>>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("mover-bench-podio: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(args: &Args) -> Result<bool> {
    if !rustix::process::geteuid().is_root() {
        bail!("needs root (loop devices, mounts, the CSI plugin's FUSE mounts)");
    }
    for tool in ["fio", "mkfs.ext4", "losetup"] {
        if run_checked(
            Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {tool}")),
        )
        .is_err()
        {
            bail!("{tool} is not installed (apt-get install fio e2fsprogs util-linux)");
        }
    }
    let jobs: Vec<&Job> = JOBS
        .iter()
        .filter(|j| args.only.is_empty() || args.only.iter().any(|n| n == j.name))
        .collect();
    if let Some(unknown) = args.only.iter().find(|n| JOBS.iter().all(|j| j.name != *n)) {
        let names: Vec<_> = JOBS.iter().map(|j| j.name).collect();
        bail!("--only: no job {unknown:?}; the jobs: {}", names.join(", "));
    }
    let mover = mover_binary(args.mover.as_deref())?;
    let w = &args.workdir;
    let (da, db) = fresh_workdir(w)?;

    eprintln!(
        "== setup: ext4 of {} MiB holding a copy of /usr/share",
        args.size >> 20
    );
    let src = da.join("src.img");
    fs::File::create(&src)?.set_len(args.size)?;
    sh(&format!("mkfs.ext4 -q -F {}", src.display()))?;
    let mnt = w.join("mnt");
    fs::create_dir_all(&mnt)?;
    sh(&format!(
        "mount -o loop {} {}",
        src.display(),
        mnt.display()
    ))?;
    // As much of the tree as fits: a full volume is fine.
    let _ = sh(&format!("cp -a /usr/share {}/share", mnt.display()));
    sh(&format!("umount {}", mnt.display()))?;
    let plain = db.join("plain.img");

    let a = Agent::start(&mover, &da, &[("src", &src)])?;
    let b = Agent::start_with_settings(
        &mover,
        &db,
        &[],
        &format!(
            "node_name = \"bench\"\ncsi_socket = \"{}\"\ncsi_volumes = \"{}\"\n",
            db.join("csi.sock").display(),
            db.join("volumes").display()
        ),
    )?;
    let csi = Csi::connect(&db.join("csi.sock"))?;
    let from = format!("{}/src", a.url());

    // (b): staged while it hydrates slowly, then filled at full speed to the end.
    hydrate(
        &mover,
        &b,
        &[
            "start",
            "complete",
            "--from",
            &from,
            "--create",
            "--bwlimit",
            "1M",
        ],
    )?;
    let complete = csi.publish(&db, "complete")?;
    hydrate(&mover, &b, &["cancel", "complete"])?;
    hydrate(&mover, &b, &["start", "complete", "--from", &from])?;
    hydrate(&mover, &b, &["wait", "complete"])?;

    let mut r = Results {
        volume_bytes: args.size,
        runs: args.runs,
        ..Default::default()
    };
    // Each job of (c) has a fill of its own that would outlast it four times over.
    let bwlimit = format!("{}K", (args.size / (4 * args.seconds)).max(1 << 20) >> 10);
    for run in 1..=args.runs {
        eprintln!("== run {run} of {}", args.runs);
        // The volume's bytes, as (b)'s hydration brought them.
        sh(&format!(
            "cp --sparse=always {} {}",
            src.display(),
            plain.display()
        ))?;
        let device = Loop::attach(&plain)?;
        for j in &jobs {
            eprintln!(
                "{}",
                job(&mut r, "plain", &device.0, &plain, &mnt, j, args)?
            );
        }
        drop(device);
        for j in &jobs {
            let image = db.join("volumes/complete.img");
            eprintln!(
                "{}",
                job(&mut r, "complete", &complete, &image, &mnt, j, args)?
            );
        }

        for (i, j) in jobs.iter().enumerate().filter(|_| !args.skip_hydrating) {
            let name = format!("hydrating-{run}-{i}");
            hydrate(
                &mover,
                &b,
                &[
                    "start",
                    &name,
                    "--from",
                    &from,
                    "--create",
                    "--bwlimit",
                    &bwlimit,
                ],
            )?;
            let device = csi.publish(&db, &name)?;
            // Its floor is the source's read, on the same disk.
            let f = job(&mut r, "hydrating", &device, &src, &mnt, j, args)?;
            let status = hydrate(&mover, &b, &["status", &name])?;
            let arrived = status["present"].as_f64().unwrap_or(0.0)
                / status["regions"].as_f64().unwrap_or(0.0).max(1.0);
            eprintln!("{f}, {:.0}% arrived at its end", arrived * 100.0);
            r.hydrating_arrived_fraction
                .entry(j.name.into())
                .or_default()
                .push(arrived);
            csi.unpublish(&db, &name)?;
            hydrate(&mover, &b, &["cancel", &name])?;
            hydrate(&mover, &b, &["delete", &name])?;
        }
    }
    csi.unpublish(&db, "complete")?;

    let mut ok = true;
    let mut table = String::from(
        "job                  device     IOPS       MiB/s    p50 us   p99 us   / plain\n",
    );
    for j in &jobs {
        let by_device = r.runs_by_job.get(j.name).cloned().unwrap_or_default();
        let mut meds = BTreeMap::new();
        for d in DEVICES {
            let runs = by_device.get(d).cloned().unwrap_or_default();
            let m = Figures {
                iops: median(runs.iter().map(|f| f.iops).collect()),
                mib_per_sec: median(runs.iter().map(|f| f.mib_per_sec).collect()),
                p50_us: median(runs.iter().map(|f| f.p50_us).collect()),
                p99_us: median(runs.iter().map(|f| f.p99_us).collect()),
                floor_mib_per_sec: median(runs.iter().map(|f| f.floor_mib_per_sec).collect()),
            };
            meds.insert(d.to_string(), m);
        }
        let judged = |f: &Figures| if j.throughput { f.mib_per_sec } else { f.iops };
        let plain = judged(&meds["plain"]).max(f64::MIN_POSITIVE);
        let b_ratio = judged(&meds["complete"]) / plain;
        let c_ratio = judged(&meds["hydrating"]) / plain;
        r.complete_over_plain.insert(j.name.into(), b_ratio);
        if by_device.contains_key("hydrating") {
            r.hydrating_over_plain.insert(j.name.into(), c_ratio);
        }
        let met = j.target.is_none_or(|t| b_ratio >= t);
        ok &= met;
        for d in DEVICES.into_iter().filter(|d| by_device.contains_key(*d)) {
            let f = &meds[d];
            let ratio = match d {
                "complete" => format!(
                    "{b_ratio:.2}x{}",
                    j.target.map_or(String::new(), |t| format!(
                        " (target >= {t}: {})",
                        if met { "met" } else { "MISSED" }
                    ))
                ),
                "hydrating" => format!("{c_ratio:.2}x"),
                _ => String::new(),
            };
            // Each run's time over the floor measured just before it, the median.
            let over_floor = median(
                by_device
                    .get(d)
                    .into_iter()
                    .flatten()
                    .filter(|f| f.floor_mib_per_sec > 0.0)
                    .map(|f| f.floor_mib_per_sec / f.mib_per_sec.max(f64::MIN_POSITIVE))
                    .collect(),
            );
            let floor = match over_floor {
                0.0 => String::new(),
                x => format!("  time/floor {x:.2}"),
            };
            table += &format!(
                "{:<20} {d:<10} {:>9.0} {:>9.1} {:>8.0} {:>8.0}   {ratio}{floor}\n",
                j.name, f.iops, f.mib_per_sec, f.p50_us, f.p99_us
            );
        }
        r.medians.insert(j.name.into(), meds);
    }
    println!("{table}");
    if let Some(path) = &args.json {
        fs::write(path, serde_json::to_string_pretty(&r)?)?;
    }
    if let Some(dir) = &args.report {
        write_report(dir, &r, &table)?;
        eprintln!("report: {}", dir.join("index.html").display());
    }
    Ok(ok)
}

/// Runs job `j` on `device` (named `label` in the results), whose bytes are in file
/// `image`; `mnt` is where the `db` job mounts the ext4 it makes. Its figures, as a
/// line to show.
fn job(
    r: &mut Results,
    label: &str,
    device: &Path,
    image: &Path,
    mnt: &Path,
    j: &Job,
    args: &Args,
) -> Result<String> {
    let f = if j.db {
        db_job(device, mnt, j, args.seconds)?
    } else {
        // A warm job reads a volume all in the page cache, but (c)'s would then be
        // complete.
        if !j.cold && j.rw.contains("read") && label != "hydrating" {
            run_checked(
                Command::new("dd")
                    .arg(format!("if={}", device.display()))
                    .args(["of=/dev/null", "bs=1M"]),
            )?;
        }
        let floor = if j.cold && j.throughput {
            disk_read(image, args.size)?
        } else {
            0.0
        };
        Figures {
            floor_mib_per_sec: floor,
            ..fio(device, j, args)?
        }
    };
    let mut line = format!(
        "   {label:<10} {:<20} {:>9.0} IOPS {:>8.1} MiB/s  p50 {:>6.0} us  p99 {:>6.0} us",
        j.name, f.iops, f.mib_per_sec, f.p50_us, f.p99_us
    );
    if f.floor_mib_per_sec > 0.0 {
        line += &format!(
            "  (disk floor {:.0} MiB/s: {:.2}x the floor's time)",
            f.floor_mib_per_sec,
            f.floor_mib_per_sec / f.mib_per_sec.max(f64::MIN_POSITIVE)
        );
    }
    r.runs_by_job
        .entry(j.name.into())
        .or_default()
        .entry(label.into())
        .or_default()
        .push(f);
    Ok(line)
}

/// MiB/s of a cold O_DIRECT read of `bytes` of `file` in 4 MiB requests, 8 in flight:
/// what the disk gives for those bytes now.
fn disk_read(file: &Path, bytes: u64) -> Result<f64> {
    drop_caches()?;
    let out = run_checked(
        Command::new("fio")
            .args(["--name=floor", "--output-format=json", "--ioengine=libaio"])
            .args(["--direct=1", "--rw=read", "--bs=4M", "--iodepth=8"])
            .arg(format!("--filename={}", file.display()))
            .arg(format!("--io_size={bytes}")),
    )?;
    Ok(figures(&out, "read")?.mib_per_sec)
}

/// fio's figures of job `j` on device `target`.
fn fio(target: &Path, j: &Job, args: &Args) -> Result<Figures> {
    let mut cmd = Command::new("fio");
    cmd.args([
        "--name=job",
        "--output-format=json",
        "--ioengine=libaio",
        "--direct=1",
    ])
    .arg(format!("--filename={}", target.display()))
    .arg(format!("--rw={}", j.rw))
    .arg(format!("--bs={}", j.block))
    .arg(format!("--iodepth={}", j.depth));
    if j.cold {
        drop_caches()?;
        // One pass over the volume, or a quarter of it in random 4 KiB reads.
        let bytes = if j.rw == "read" {
            args.size
        } else {
            args.size / 4
        };
        cmd.arg(format!("--io_size={bytes}"));
    } else {
        cmd.args(["--time_based", &format!("--runtime={}", args.seconds)]);
    }
    figures(&run_checked(&mut cmd)?, j.rw)
}

/// The `db` job: ext4 made on `device`, 4 KiB random writes to a 64 MiB file, each
/// followed by fsync.
fn db_job(device: &Path, mnt: &Path, j: &Job, seconds: u64) -> Result<Figures> {
    // No discard: it would punch the device's image full of holes, and the next run's
    // cold-read floor (an O_DIRECT read of that image) would time holes, not the disk.
    sh(&format!(
        "mkfs.ext4 -q -F -E nodiscard {}",
        device.display()
    ))?;
    sh(&format!("mount {} {}", device.display(), mnt.display()))?;
    let out = run_checked(
        Command::new("fio")
            .args([
                "--name=db",
                "--output-format=json",
                "--ioengine=psync",
                "--fsync=1",
            ])
            .arg(format!("--filename={}", mnt.join("db").display()))
            .args([
                "--size=64M",
                "--time_based",
                &format!("--runtime={seconds}"),
            ])
            .arg(format!("--rw={}", j.rw))
            .arg(format!("--bs={}", j.block)),
    );
    sh(&format!("umount {}", mnt.display()))?;
    figures(&out?, j.rw)
}

fn figures(json: &[u8], rw: &str) -> Result<Figures> {
    let v: serde_json::Value = serde_json::from_slice(json).context("fio's JSON output")?;
    let side = if rw.contains("read") { "read" } else { "write" };
    let s = &v["jobs"][0][side];
    let pct = |p: &str| s["clat_ns"]["percentile"][p].as_f64().unwrap_or(0.0) / 1000.0;
    Ok(Figures {
        iops: s["iops"].as_f64().unwrap_or(0.0),
        mib_per_sec: s["bw_bytes"].as_f64().unwrap_or(0.0) / (1 << 20) as f64,
        p50_us: pct("50.000000"),
        p99_us: pct("99.000000"),
        floor_mib_per_sec: 0.0,
    })
}

/// `mover hydrate ARGS --agent B --json`'s answer.
fn hydrate(mover: &Path, b: &Agent, args: &[&str]) -> Result<serde_json::Value> {
    let out = run_checked(
        Command::new(mover)
            .arg("hydrate")
            .args(args)
            .args(["--agent", &b.url(), "--json"])
            .env("MOVER_TOKEN", TOKEN),
    )?;
    let text = String::from_utf8_lossy(&out);
    Ok(serde_json::from_str(text.lines().last().unwrap_or("{}")).unwrap_or_default())
}

/// A loop device over a file, detached when dropped.
struct Loop(PathBuf);

impl Loop {
    fn attach(file: &Path) -> Result<Loop> {
        let out = sh(&format!("losetup --find --show {}", file.display()))?;
        Ok(Loop(PathBuf::from(String::from_utf8_lossy(&out).trim())))
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.0).status();
    }
}

/// The destination agent's CSI node service, called as the kubelet calls it.
struct Csi {
    runtime: tokio::runtime::Runtime,
    channel: tonic::transport::Channel,
}

impl Csi {
    fn connect(socket: &Path) -> Result<Csi> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let path = socket.to_path_buf();
        let deadline = Instant::now() + Duration::from_secs(30);
        while !path.exists() {
            if Instant::now() > deadline {
                bail!("the agent's CSI socket {} did not appear", path.display());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let channel = runtime.block_on(
            tonic::transport::Endpoint::from_static("http://csi.invalid").connect_with_connector(
                tower::service_fn(move |_: http::Uri| {
                    let path = path.clone();
                    async move {
                        let s = tokio::net::UnixStream::connect(path).await?;
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                    }
                }),
            ),
        )?;
        Ok(Csi { runtime, channel })
    }

    fn paths(dir: &Path, volume: &str) -> (PathBuf, PathBuf) {
        (
            dir.join("kubelet/staging").join(volume),
            dir.join("kubelet/pods/bench/volumes").join(volume),
        )
    }

    /// NodeStageVolume and NodePublishVolume of `volume` as a Block volume: the path of
    /// the pod's device.
    fn publish(&self, dir: &Path, volume: &str) -> Result<PathBuf> {
        use transport::csi::{self as proto, volume_capability as cap};
        let (staging, target) = Self::paths(dir, volume);
        fs::create_dir_all(&staging)?;
        let capability = proto::VolumeCapability {
            access_type: Some(cap::AccessType::Block(cap::BlockVolume {})),
            access_mode: Some(cap::AccessMode {
                mode: cap::access_mode::Mode::SingleNodeWriter as i32,
            }),
        };
        let mut node = proto::node_client::NodeClient::new(self.channel.clone());
        self.runtime.block_on(async {
            node.node_stage_volume(proto::NodeStageVolumeRequest {
                volume_id: volume.into(),
                staging_target_path: staging.display().to_string(),
                volume_capability: Some(capability.clone()),
                ..Default::default()
            })
            .await
            .with_context(|| format!("NodeStageVolume {volume}"))?;
            node.node_publish_volume(proto::NodePublishVolumeRequest {
                volume_id: volume.into(),
                staging_target_path: staging.display().to_string(),
                target_path: target.display().to_string(),
                volume_capability: Some(capability),
                ..Default::default()
            })
            .await
            .with_context(|| format!("NodePublishVolume {volume}"))?;
            anyhow::Ok(())
        })?;
        Ok(target)
    }

    /// NodeUnpublishVolume and NodeUnstageVolume of `volume`.
    fn unpublish(&self, dir: &Path, volume: &str) -> Result<()> {
        use transport::csi as proto;
        let (staging, target) = Self::paths(dir, volume);
        let mut node = proto::node_client::NodeClient::new(self.channel.clone());
        self.runtime.block_on(async {
            node.node_unpublish_volume(proto::NodeUnpublishVolumeRequest {
                volume_id: volume.into(),
                target_path: target.display().to_string(),
            })
            .await
            .with_context(|| format!("NodeUnpublishVolume {volume}"))?;
            node.node_unstage_volume(proto::NodeUnstageVolumeRequest {
                volume_id: volume.into(),
                staging_target_path: staging.display().to_string(),
            })
            .await
            .with_context(|| format!("NodeUnstageVolume {volume}"))?;
            anyhow::Ok(())
        })
    }
}

/// The HTML report: each job's (b) / (a) and (c) / (a) against its target, and the
/// depth-1 latencies.
fn write_report(dir: &Path, r: &Results, table: &str) -> Result<()> {
    use charts::{Bar, Figure, bar_chart, write_page};
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut ratios = Vec::new();
    for j in &JOBS {
        for (what, map) in [
            ("(b) complete", &r.complete_over_plain),
            ("(c) hydrating", &r.hydrating_over_plain),
        ] {
            let value = map.get(j.name).copied().unwrap_or(0.0);
            let target = j.target.filter(|_| what.starts_with("(b)"));
            ratios.push(Bar {
                label: format!("{} {what}", j.name),
                value,
                target,
                pass: target.is_none_or(|t| value >= t),
            });
        }
    }
    bar_chart(
        &dir.join("ratios.svg"),
        "mover's device over a plain loop device (same jobs, same disk)",
        "x of (a) plain (target: black tick, at least)",
        &ratios,
    )?;
    let mut latency = Vec::new();
    for name in ["rand-read-qd1", "rand-write-qd1"] {
        for d in DEVICES {
            let f = &r.medians[name][d];
            for (q, v) in [("p50", f.p50_us), ("p99", f.p99_us)] {
                latency.push(Bar {
                    label: format!("{name} {d} {q}"),
                    value: v,
                    target: None,
                    pass: true,
                });
            }
        }
    }
    bar_chart(
        &dir.join("latency.svg"),
        "4 KiB I/O at depth 1",
        "microseconds",
        &latency,
    )?;
    write_page(
        dir,
        "mover-bench-podio: a pod's I/O on a mover device",
        table,
        &[
            Figure {
                file: "ratios.svg".into(),
                caption: "each job on mover's device, complete (b) and hydrating (c), over the same job on a loop device straight over a plain image file (a); green met, red missed".into(),
            },
            Figure {
                file: "latency.svg".into(),
                caption: "completion latency of single 4 KiB reads and writes (fio clat)".into(),
            },
        ],
    )
}
