//! `mover-bench-hydrate`: copy-on-demand between two `mover agent`s on 127.0.0.1, with a
//! real volume (ext4 holding a system tree, a package registry and a SQLite database)
//! and a 1 TiB sparse one. Run with `--help` for what is measured and checked.

#[allow(dead_code)] // agents and child processes, shared with mover-bench-replicate
#[path = "../agents.rs"]
mod agents;
#[allow(dead_code)] // shared with mover-bench
#[path = "../charts.rs"]
mod charts;
#[allow(dead_code)] // the device floor, shared with mover-bench
#[path = "../floor.rs"]
mod floor;
#[allow(dead_code)] // the floor's random bytes
#[path = "../prng.rs"]
mod prng;
#[allow(dead_code)] // the bench's process helpers, shared with mover-bench
#[path = "../process.rs"]
mod process;
#[allow(dead_code)] // the disk's speed, shared with mover-bench-tree
#[path = "../treefloor.rs"]
mod treefloor;

use agents::{Agent, Killed, TOKEN, fresh_workdir, median, mover_binary, parse_size, sh};
use anyhow::{Context, Result, bail};
use clap::Parser;
use floor::{DeviceSpeed, MAX_OVER_FLOOR};
use process::{drop_caches, run_checked};
use serde::Serialize;
use std::{
    fs,
    io::{Read, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    process::{Command, ExitCode},
    time::{Duration, Instant},
};

const LONG_ABOUT: &str = "\
Benchmarks `mover hydrate` (copy-on-demand): two agents on 127.0.0.1; the source exports
a --size ext4 volume (a copy of /usr/share, the cargo registry where present, a SQLite
database) and a 1 TiB sparse ext4 volume; the destination serves its exports over its NBD
socket while they hydrate. Page cache dropped before every timed step. Steps:
  ttfb      `mover hydrate start` -> the first 4 KiB READ answered over NBD, for the
            volume and the 1 TiB one. Target <= 1 s each.
  fill      full hydration of the volume (start -> Complete) against `mover copy
            agent://... FILE` pulling the same volume, --runs times each, medians.
            Target: hydration <= 1.2x the pull, and <= 1.3x its floor: the volume's
            data read once and written once at the disk's direct speed (measured in
            the work directory first, as mover-bench does).
  missing   4 KiB reads of regions not here yet (from the end of the volume, the filler
            running from the start at full speed), one at a time over NBD. Target p99
            <= 50 ms.
  present   the same reads once the volume is complete (page cache warm) against
            `nbdkit file` serving the same image. Target: p99 and mean within 1.5x.
Needs root, e2fsprogs, nbdkit, python3. Exit status: 0 all targets met, 2 some target
missed, 1 error.";

/// Benchmark copy-on-demand against a plain pull and nbdkit.
#[derive(Debug, Parser)]
#[command(name = "mover-bench-hydrate", version, about, long_about = LONG_ABOUT)]
struct Args {
    /// Size of the real volume.
    #[arg(long, default_value = "4G", value_parser = parse_size)]
    size: u64,
    /// Directory for the images (sparse; about 3x --size).
    #[arg(long, default_value = "/var/tmp/mover-bench-hydrate")]
    workdir: PathBuf,
    /// The mover binary [default: beside this one].
    #[arg(long)]
    mover: Option<PathBuf>,
    /// Timed runs of the fill step (medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// 4 KiB reads in the missing and present steps.
    #[arg(long, default_value_t = 300)]
    reads: usize,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write an HTML page with SVG charts into DIR (every figure against its
    /// target, the read latencies).
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
}

#[derive(Debug, Default, Serialize)]
struct Latency {
    count: usize,
    p50_ms: f64,
    p99_ms: f64,
    mean_ms: f64,
    max_ms: f64,
}

impl Latency {
    fn of(mut v: Vec<f64>) -> Latency {
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() as f64 * q).ceil() as usize).clamp(1, v.len()) - 1];
        Latency {
            count: v.len(),
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            mean_ms: v.iter().sum::<f64>() / v.len() as f64,
            max_ms: v[v.len() - 1],
        }
    }
}

#[derive(Debug, Default, Serialize)]
struct Results {
    volume_bytes: u64,
    volume_data_bytes: u64,
    ttfb_volume_secs: f64,
    ttfb_1tib_secs: f64,
    hydrate_1tib_secs: f64,
    fill_secs: Vec<f64>,
    pull_secs: Vec<f64>,
    fill_over_pull: f64,
    /// The disk under the work directory, with O_DIRECT.
    disk: Option<DeviceSpeed>,
    /// The volume's data read and written once at that speed.
    fill_floor_secs: f64,
    fill_over_floor: f64,
    pull_over_floor: f64,
    missing_reads: Latency,
    missing_reads_done_before_complete: usize,
    present_reads: Latency,
    nbdkit_reads: Latency,
    present_over_nbdkit_p99: f64,
    present_over_nbdkit_mean: f64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("mover-bench-hydrate: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn hydrate(mover: &Path, args: &[&str]) -> Result<serde_json::Value> {
    let out = run_checked(
        Command::new(mover)
            .arg("hydrate")
            .args(args)
            .arg("--json")
            .env("MOVER_TOKEN", TOKEN),
    )?;
    let line = String::from_utf8_lossy(&out);
    Ok(serde_json::from_str(line.lines().last().unwrap_or("{}"))?)
}

/// Polls until the hydration of `export` is complete; its duration from `t0`.
fn wait_complete(mover: &Path, agent: &Agent, export: &str, t0: Instant) -> Result<f64> {
    loop {
        let s = hydrate(mover, &["status", export, "--agent", &agent.url()])?;
        if s["phase"] == "Complete" {
            return Ok(t0.elapsed().as_secs_f64());
        }
        if t0.elapsed() > Duration::from_secs(1800) {
            bail!("hydration of {export} did not complete: {s}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn run(args: &Args) -> Result<bool> {
    if !rustix::process::geteuid().is_root() {
        bail!("needs root (loop mounts, dropping the page cache)");
    }
    let mover = mover_binary(args.mover.as_deref())?;
    let w = &args.workdir;
    let (da, db) = fresh_workdir(w)?;
    let mut r = Results {
        volume_bytes: args.size,
        ..Default::default()
    };

    eprintln!(
        "== setup: ext4 with real data in {} MiB, and a sparse 1 TiB ext4",
        args.size >> 20
    );
    let vol = da.join("vol.img");
    fs::File::create(&vol)?.set_len(args.size)?;
    sh(&format!(
        "mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 {}",
        vol.display()
    ))?;
    let mnt = w.join("mnt");
    fs::create_dir_all(&mnt)?;
    sh(&format!(
        "mount -o loop {} {}",
        vol.display(),
        mnt.display()
    ))?;
    let fill = args.size * 45 / 100;
    let copied = sh(&format!(
        "cp -a /usr/share {m}/share; [ -d /root/.cargo/registry ] && [ {fill} -gt 2000000000 ] && cp -a /root/.cargo/registry {m}/registry; true",
        m = mnt.display()
    ));
    let db_bytes = fill.saturating_sub(1_100_000_000).max(fill / 5);
    let sqlite = run_checked(Command::new("python3").arg("-c").arg(format!(
        "import sqlite3\ndb = sqlite3.connect('{}/db.sqlite')\ndb.execute('create table t(id integer primary key, v blob)')\n\
         db.execute('with recursive c(x) as (select 1 union all select x+1 from c limit {}) insert into t(v) select randomblob(300) from c')\ndb.commit()",
        mnt.display(),
        db_bytes / 330
    )));
    sh(&format!("umount {}", mnt.display()))?;
    copied?;
    sqlite?;
    r.volume_data_bytes = data_bytes(&vol)?;
    eprintln!("== the floor: the disk under {}", w.display());
    let disk = treefloor::disk_speed(w)?;
    eprintln!("   {}", disk.describe());
    r.fill_floor_secs = disk.floor_seconds(r.volume_data_bytes, r.volume_data_bytes);
    r.disk = Some(disk);
    let big = da.join("sparse.img");
    fs::File::create(&big)?.set_len(1 << 40)?;
    sh(&format!("mkfs.ext4 -q -F {}", big.display()))?;

    let a = Agent::start(&mover, &da, &[("vol", &vol), ("sparse", &big)])?;
    // Each fill run hydrates an export of its own: one started again from the same source
    // after it completed is already whole (a retried start returns at once), so a run
    // into "vol" again would time nothing.
    let fills: Vec<String> = (1..=args.runs).map(|i| format!("fill-{i}")).collect();
    let dsts: Vec<(String, PathBuf)> = ["vol", "sparse", "lat"]
        .into_iter()
        .map(String::from)
        .chain(fills.iter().cloned())
        .map(|n| {
            let image = db.join(format!("{n}.img"));
            (n, image)
        })
        .collect();
    let exports: Vec<(&str, &Path)> = dsts
        .iter()
        .map(|(n, p)| (n.as_str(), p.as_path()))
        .collect();
    let b = Agent::start(&mover, &db, &exports)?;
    let sock = db.join("state/nbd.sock");
    let mut ok = true;

    eprintln!("== ttfb: hydrate start -> first 4 KiB READ answered");
    for (export, src) in [("vol", "vol"), ("sparse", "sparse")] {
        drop_caches()?;
        let t0 = Instant::now();
        hydrate(
            &mover,
            &[
                "start",
                export,
                "--from",
                &format!("{}/{src}", a.url()),
                "--agent",
                &b.url(),
                "--overwrite",
            ],
        )?;
        let mut c = NbdClient::connect(&sock, export)?;
        c.read(0, 4096)?;
        let ttfb = t0.elapsed().as_secs_f64();
        eprintln!("   {export}: {ttfb:.3} s");
        if export == "vol" {
            r.ttfb_volume_secs = ttfb;
        } else {
            r.ttfb_1tib_secs = ttfb;
            r.hydrate_1tib_secs = wait_complete(&mover, &b, export, t0)?;
            eprintln!("   1 TiB sparse hydrated in {:.1} s", r.hydrate_1tib_secs);
        }
        ok &= ttfb <= 1.0;
    }
    wait_complete(&mover, &b, "vol", Instant::now())?;

    eprintln!(
        "== fill: full hydration against a pull by mover copy ({} runs)",
        args.runs
    );
    let pulled = db.join("pulled.img");
    for (i, fill_export) in fills.iter().enumerate() {
        let _ = fs::remove_file(&pulled);
        drop_caches()?;
        let t0 = Instant::now();
        run_checked(
            Command::new(&mover)
                .args(["copy", &format!("{}/vol", a.url())])
                .arg(&pulled)
                .args(["--no-progress", "--json"])
                .env("MOVER_TOKEN", TOKEN)
                .env("MOVER_STATE_DIR", w.join("copy-state")),
        )?;
        let pull = t0.elapsed().as_secs_f64();
        drop_caches()?;
        let t0 = Instant::now();
        hydrate(
            &mover,
            &[
                "start",
                fill_export,
                "--from",
                &format!("{}/vol", a.url()),
                "--agent",
                &b.url(),
                "--overwrite",
            ],
        )?;
        let fill = wait_complete(&mover, &b, fill_export, t0)?;
        eprintln!("   run {}: pull {pull:.2} s, hydrate {fill:.2} s", i + 1);
        r.pull_secs.push(pull);
        r.fill_secs.push(fill);
    }
    let pulled_hash = hash(&pulled)?;
    for (export, image) in &dsts {
        if (export == "vol" || fills.contains(export)) && hash(image)? != pulled_hash {
            bail!("the hydrated volume {export} differs from the pulled one");
        }
    }
    r.fill_over_pull = median(r.fill_secs.clone()) / median(r.pull_secs.clone());
    r.fill_over_floor = median(r.fill_secs.clone()) / r.fill_floor_secs;
    r.pull_over_floor = median(r.pull_secs.clone()) / r.fill_floor_secs;
    ok &= r.fill_over_pull <= 1.2 && r.fill_over_floor <= MAX_OVER_FLOOR;

    eprintln!("== missing: 4 KiB reads ahead of the filler");
    let offsets = data_offsets(&vol, args.reads)?;
    drop_caches()?;
    hydrate(
        &mover,
        &[
            "start",
            "lat",
            "--from",
            &format!("{}/vol", a.url()),
            "--agent",
            &b.url(),
            "--overwrite",
        ],
    )?;
    let mut c = NbdClient::connect(&sock, "lat")?;
    let mut lat = Vec::new();
    let mut before = 0;
    for &off in offsets.iter().rev() {
        let t = Instant::now();
        c.read(off, 4096)?;
        lat.push(t.elapsed().as_secs_f64() * 1000.0);
        if before == lat.len() - 1 {
            let s = hydrate(&mover, &["status", "lat", "--agent", &b.url()])?;
            if s["phase"] != "Complete" {
                before += 1;
            }
        }
    }
    r.missing_reads_done_before_complete = before;
    r.missing_reads = Latency::of(lat);
    ok &= r.missing_reads.p99_ms <= 50.0;
    wait_complete(&mover, &b, "lat", Instant::now())?;

    eprintln!("== present: the same reads, complete, against nbdkit file");
    let ksock = w.join("nbdkit.sock");
    let nbdkit = Command::new("nbdkit")
        .args(["-f", "-U"])
        .arg(&ksock)
        .arg("file")
        .arg(&dsts[2].1)
        .spawn()
        .context("cannot start nbdkit (apt-get install nbdkit)")?;
    let _nbdkit = Killed(nbdkit);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ksock.exists() {
        if Instant::now() > deadline {
            bail!("nbdkit did not listen on {}", ksock.display());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let measure = |c: &mut NbdClient| -> Result<Latency> {
        for &off in &offsets {
            c.read(off, 4096)?; // warm
        }
        let mut v = Vec::new();
        for _ in 0..3 {
            for &off in &offsets {
                let t = Instant::now();
                c.read(off, 4096)?;
                v.push(t.elapsed().as_secs_f64() * 1000.0);
            }
        }
        Ok(Latency::of(v))
    };
    r.present_reads = measure(&mut NbdClient::connect(&sock, "lat")?)?;
    r.nbdkit_reads = measure(&mut NbdClient::connect(&ksock, "")?)?;
    r.present_over_nbdkit_p99 = r.present_reads.p99_ms / r.nbdkit_reads.p99_ms;
    r.present_over_nbdkit_mean = r.present_reads.mean_ms / r.nbdkit_reads.mean_ms;
    ok &= r.present_over_nbdkit_p99 <= 1.5 && r.present_over_nbdkit_mean <= 1.5;
    drop(a);
    drop(b);

    let text = serde_json::to_string_pretty(&r)?;
    println!("{text}");
    if let Some(p) = &args.json {
        fs::write(p, &text)?;
    }
    let summary = format!(
        "ttfb {:.3} s / 1 TiB {:.3} s (<= 1); fill / pull {:.2} (<= 1.2; {:.2} s vs {:.2} s); \
         fill / floor {:.2} (<= {MAX_OVER_FLOOR}; floor {:.2} s, pull / floor {:.2}); \
         missing p99 {:.1} ms (<= 50); present / nbdkit p99 {:.2}, mean {:.2} (<= 1.5)",
        r.ttfb_volume_secs,
        r.ttfb_1tib_secs,
        r.fill_over_pull,
        median(r.fill_secs.clone()),
        median(r.pull_secs.clone()),
        r.fill_over_floor,
        r.fill_floor_secs,
        r.pull_over_floor,
        r.missing_reads.p99_ms,
        r.present_over_nbdkit_p99,
        r.present_over_nbdkit_mean
    );
    eprintln!("{summary}");
    if let Some(dir) = &args.report {
        write_report(dir, &r, &format!("{text}\n\n{summary}"))?;
        eprintln!("report: {}", dir.join("index.html").display());
    }
    Ok(ok)
}

/// The HTML report: each figure against its target (at most: a bar within its tick
/// passes), and the latencies of the three kinds of 4 KiB reads.
fn write_report(dir: &Path, r: &Results, text: &str) -> Result<()> {
    use charts::{Bar, Figure, bar_chart, write_page};
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let at_most = |label: &str, value: f64, limit: f64| Bar {
        label: format!("{label} <= {limit}"),
        value,
        target: Some(limit),
        pass: value <= limit,
    };
    let targets = [
        at_most("time to first byte, volume (s)", r.ttfb_volume_secs, 1.0),
        at_most("time to first byte, 1 TiB (s)", r.ttfb_1tib_secs, 1.0),
        at_most("fill / pull time", r.fill_over_pull, 1.2),
        at_most("fill / floor time", r.fill_over_floor, MAX_OVER_FLOOR),
        at_most("present / nbdkit p99", r.present_over_nbdkit_p99, 1.5),
        at_most("present / nbdkit mean", r.present_over_nbdkit_mean, 1.5),
    ];
    bar_chart(
        &dir.join("targets.svg"),
        "copy-on-demand against its targets",
        "value (target: black tick)",
        &targets,
    )?;
    let mut latency = Vec::new();
    for (what, l, limit) in [
        ("missing (fetched on demand)", &r.missing_reads, Some(50.0)),
        ("present (hydrated)", &r.present_reads, None),
        ("nbdkit file", &r.nbdkit_reads, None),
    ] {
        for (q, v) in [("p50", l.p50_ms), ("p99", l.p99_ms)] {
            latency.push(Bar {
                label: format!("{what} {q}"),
                value: v,
                target: limit.filter(|_| q == "p99"),
                pass: limit.is_none_or(|m| q != "p99" || v <= m),
            });
        }
    }
    bar_chart(
        &dir.join("latency.svg"),
        "4 KiB reads over NBD",
        "milliseconds",
        &latency,
    )?;
    write_page(
        dir,
        "mover-bench-hydrate: copy-on-demand",
        text,
        &[
            Figure {
                file: "targets.svg".into(),
                caption: "each figure against its target: green met, red missed".into(),
            },
            Figure {
                file: "latency.svg".into(),
                caption: "latency of single 4 KiB reads: regions not here yet, the volume once complete, and nbdkit serving the same image".into(),
            },
        ],
    )
}

fn hash(path: &Path) -> Result<blake3::Hash> {
    let mut h = blake3::Hasher::new();
    std::io::copy(&mut fs::File::open(path)?, &mut h)?;
    Ok(h.finalize())
}

/// Bytes of the image in data extents (SEEK_DATA / SEEK_HOLE).
fn data_bytes(path: &Path) -> Result<u64> {
    Ok(extents(path)?.iter().map(|(s, e)| e - s).sum())
}

fn extents(path: &Path) -> Result<Vec<(u64, u64)>> {
    use rustix::fs::{SeekFrom, seek};
    let f = fs::File::open(path)?;
    let size = f.metadata()?.len();
    let mut out = Vec::new();
    let mut at = 0;
    while at < size {
        let Ok(d) = seek(&f, SeekFrom::Data(at)) else {
            break;
        };
        let h = seek(&f, SeekFrom::Hole(d)).map_or(size, |h| h.min(size));
        out.push((d, h));
        at = h;
    }
    Ok(out)
}

/// `n` 4 KiB-aligned offsets spread over the image's data, one per MiB region at most.
fn data_offsets(path: &Path, n: usize) -> Result<Vec<u64>> {
    let mut regions: Vec<u64> = Vec::new();
    for (s, e) in extents(path)? {
        let mut r = s >> 20;
        while r << 20 < e {
            if regions.last() != Some(&r) {
                regions.push(r);
            }
            r += 1;
        }
    }
    if regions.is_empty() {
        bail!("{} holds no data", path.display());
    }
    let step = (regions.len() / n).max(1);
    Ok(regions
        .iter()
        .step_by(step)
        .take(n)
        .enumerate()
        .map(|(i, r)| (r << 20) + ((i as u64 * 7919) % 256) * 4096)
        .collect())
}

/// A minimal NBD client (fixed newstyle, OPT_GO, simple replies): one request at a time,
/// to time single reads.
struct NbdClient {
    s: UnixStream,
    cookie: u64,
}

impl NbdClient {
    fn connect(sock: &Path, export: &str) -> Result<NbdClient> {
        let mut s =
            UnixStream::connect(sock).with_context(|| format!("connect {}", sock.display()))?;
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello)?;
        if &hello[..8] != b"NBDMAGIC" {
            bail!("not an NBD server");
        }
        s.write_all(&3u32.to_be_bytes())?; // FIXED_NEWSTYLE | NO_ZEROES
        let mut data = (export.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        let mut opt = 0x49484156454F5054u64.to_be_bytes().to_vec();
        opt.extend_from_slice(&7u32.to_be_bytes()); // NBD_OPT_GO
        opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
        opt.extend_from_slice(&data);
        s.write_all(&opt)?;
        loop {
            let mut h = [0u8; 20];
            s.read_exact(&mut h)?;
            let kind = u32::from_be_bytes(h[12..16].try_into()?);
            let len = u32::from_be_bytes(h[16..20].try_into()?);
            let mut body = vec![0u8; len as usize];
            s.read_exact(&mut body)?;
            match kind {
                1 => break, // ACK
                3 => {}     // INFO
                _ => bail!(
                    "export {export:?} refused: {}",
                    String::from_utf8_lossy(&body)
                ),
            }
        }
        Ok(NbdClient { s, cookie: 0 })
    }

    fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>> {
        self.cookie += 1;
        let mut req = 0x25609513u32.to_be_bytes().to_vec();
        req.extend_from_slice(&0u16.to_be_bytes());
        req.extend_from_slice(&0u16.to_be_bytes()); // NBD_CMD_READ
        req.extend_from_slice(&self.cookie.to_be_bytes());
        req.extend_from_slice(&offset.to_be_bytes());
        req.extend_from_slice(&len.to_be_bytes());
        self.s.write_all(&req)?;
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h)?;
        let error = u32::from_be_bytes(h[4..8].try_into()?);
        if error != 0 {
            bail!("read at {offset}: NBD error {error}");
        }
        let mut buf = vec![0u8; len as usize];
        self.s.read_exact(&mut buf)?;
        Ok(buf)
    }
}
