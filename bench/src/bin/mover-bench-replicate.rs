//! `mover-bench-replicate`: replication cycles of a real volume (ext4 holding a system
//! tree, a package registry and a SQLite database, in an image on XFS) between two
//! `mover agent`s, against the way VolSync replicates (a fresh snapshot rsynced with
//! `--inplace` into an rsync daemon), in one run. Run with `--help` for what is checked.

#[allow(dead_code)] // agents and child processes, shared with mover-bench-hydrate
#[path = "../agents.rs"]
mod agents;
#[allow(dead_code)] // the benches' SVG charts and HTML page
#[path = "../charts.rs"]
mod charts;
#[allow(dead_code)] // the bench's page comparison, shared with mover-bench
#[path = "../diff.rs"]
mod diff;
#[allow(dead_code)] // the device floor, shared with mover-bench
#[path = "../floor.rs"]
mod floor;
#[allow(dead_code)] // the floor's random bytes
#[path = "../prng.rs"]
mod prng;
#[allow(dead_code)] // the bench's process helpers, shared with mover-bench
#[path = "../process.rs"]
mod process;
#[allow(dead_code)] // the bench's TLS files, shared with mover-bench
#[path = "../tls.rs"]
mod tls;
#[allow(dead_code)] // the disk's speed, shared with mover-bench-tree
#[path = "../treefloor.rs"]
mod treefloor;

use agents::{Agent, Killed, TOKEN, median, mover_binary, parse_size, sh};
use anyhow::{Context, Result, bail};
use clap::Parser;
use floor::{DeviceSpeed, MAX_OVER_FLOOR};
use process::{ThenSync, drop_caches, run_checked, run_timed};
use serde::Serialize;
use std::{
    fs,
    io::Read,
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Command, ExitCode, Stdio},
    time::{Duration, Instant},
};

const LONG_ABOUT: &str = "\
Benchmarks `mover replicate` on a real volume: an ext4 filesystem in a --size image on
XFS (so cycles take reflink clones; the XFS is on a loop device in direct-I/O mode, which
queues requests to the host's disk like a disk would), holding a copy of /usr/share, the
cargo registry (where present) and a SQLite database; the filesystem stays mounted and is
frozen while each cycle's clone is taken. Two agents on 127.0.0.1 (primary and secondary images on
the same XFS). Steps:
  cycles    --rounds times: the database and files change (SQLite updates and inserts,
            a log appended, files rewritten: about --change-percent of the volume's pages),
            then from a dropped page cache `mover replicate sync` (timed) against
            VolSync's way: a reflink snapshot (frozen) rsynced --inplace --no-whole-file
            into an rsync daemon holding the previous state (timed). Targets: mover's
            cycle <= 1.5 s at 4G, and <= 1.3x its floor (a point in time taken as
            VolSync takes it, timed just before, then the changed pages read once and
            written once at the disk's direct speed, measured in the work directory
            first), reads <= 5% of the volume, rsync / mover >= 10x (medians of the
            rounds). mover's replica is checked clean by e2fsck -fn.
  rpo       the database written continuously for --rpo-seconds with a 5 s interval:
            RPO (now - point in time of the last applied cycle) sampled every 250 ms,
            p99 <= 15 s.
  failback  the primary's agent killed, the secondary promoted by force and written
            (--change-percent), the old primary written too, restarted, resynced with
            --discard-local, and the new primary's cycle timed: bytes shipped <= 1.2x
            the union of the pages either side changed; reads reported.
The primary agent's peak RSS is reported (target <= 128 MiB) with its RSS after each
round (it must not grow with cycles). Needs root, xfsprogs, e2fsprogs, rsync, python3.
Exit status: 0 all targets met, 2 some target missed, 1 error.";

/// Benchmark replication cycles against VolSync's rsync.
#[derive(Debug, Parser)]
#[command(name = "mover-bench-replicate", version, about, long_about = LONG_ABOUT)]
struct Args {
    /// Size of the replicated volume.
    #[arg(long, default_value = "4G", value_parser = parse_size)]
    size: u64,
    /// Directory for the XFS image and mounts (sparse; about 3.5x --size).
    #[arg(long, default_value = "/var/tmp/mover-bench-replicate")]
    workdir: PathBuf,
    /// Rounds of change + cycle + rsync.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Share of the volume's pages each change writes, in percent (about).
    #[arg(long, default_value_t = 1.0)]
    change_percent: f64,
    /// How long the RPO step writes and samples, in seconds.
    #[arg(long, default_value_t = 60)]
    rpo_seconds: u64,
    /// The relationship's chunk size [default: mover's].
    #[arg(long)]
    chunk_size: Option<String>,
    /// The mover binary [default: `mover` beside this program].
    #[arg(long)]
    mover: Option<PathBuf>,
    /// Both agents serve TLS (certificates made with openssl) and the primary pushes its
    /// cycles over TLS with a client certificate: the cost of TLS, against a run without.
    #[arg(long)]
    tls: bool,
    /// Also write the results as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Also write an HTML page with SVG charts into DIR: every figure against its target,
    /// and each round's cycle time beside VolSync's.
    #[arg(long, value_name = "DIR")]
    report: Option<PathBuf>,
}

const PAGE: u64 = 4096;

#[derive(Debug, Serialize)]
struct Round {
    changed_pages: u64,
    changed_percent: f64,
    mover_seconds: f64,
    /// A point in time taken (frozen, cloned, thawed), then the changed pages read once
    /// and written once at the disk's direct speed.
    floor_seconds: f64,
    /// mover's cycle / its floor.
    over_floor: f64,
    mover_cycle_ms: u64,
    /// How long mover's cycle held the volume's writers back (its freeze), and how long
    /// VolSync's point in time does (frozen, the image cloned, thawed: the floor's).
    mover_writers_held_ms: u64,
    volsync_writers_held_ms: u64,
    mover_bytes_read: u64,
    mover_read_percent: f64,
    mover_bytes_shipped: u64,
    /// CPU seconds (user + system) the primary's and the secondary's agents spent on
    /// the cycle.
    primary_cpu_seconds: f64,
    secondary_cpu_seconds: f64,
    volsync_seconds: f64,
    rsync_bytes_sent: u64,
    ratio: f64,
    agent_rss_bytes: u64,
    replica_pages_apart_from_rsyncs: u64,
}

#[derive(Debug, Serialize)]
struct Failback {
    pages_changed_on_new_primary: u64,
    pages_changed_on_old_primary: u64,
    union_pages: u64,
    seconds: f64,
    bytes_shipped: u64,
    shipped_over_union: f64,
    new_primary_bytes_read: u64,
    old_primary_read_bytes: u64,
}

#[derive(Debug, Serialize)]
struct Results {
    size: u64,
    rounds: Vec<Round>,
    median_ratio: f64,
    median_cycle_seconds: f64,
    /// The disk under the work directory, with O_DIRECT.
    disk: DeviceSpeed,
    median_over_floor: f64,
    max_read_percent: f64,
    rpo_p99_seconds: f64,
    rpo_samples: usize,
    failback: Failback,
    agent_peak_rss_bytes: u64,
    targets_met: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("mover-bench-replicate: error: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Unmounts and detaches what a previous run left.
fn cleanup(w: &Path) {
    for m in ["vol", "b-vol", "xfs"] {
        let _ = Command::new("umount")
            .arg(w.join(m))
            .stderr(Stdio::null())
            .status();
    }
}

struct Guard(PathBuf);
impl Drop for Guard {
    fn drop(&mut self) {
        cleanup(&self.0);
    }
}

/// The client's TLS files (`--tls`), as environment variables of a `mover` command.
static CLIENT_TLS: std::sync::OnceLock<Vec<(&'static str, PathBuf)>> = std::sync::OnceLock::new();

/// `mover` with the token and, with `--tls`, the client's TLS files.
fn mover_command(mover: &Path) -> Command {
    let mut c = Command::new(mover);
    c.env("MOVER_TOKEN", TOKEN);
    for (k, v) in CLIENT_TLS.get().into_iter().flatten() {
        c.env(k, v);
    }
    c
}

fn replicate(mover: &Path, args: &[&str]) -> Result<serde_json::Value> {
    let out = run_checked(
        mover_command(mover)
            .arg("replicate")
            .args(args)
            .arg("--json"),
    )?;
    Ok(serde_json::from_slice(&out)?)
}

/// The change workload: SQLite updates and inserts, a log appended, files rewritten,
/// about `bytes` in all; then everything flushed.
fn change(vol: &Path, bytes: u64, seed: u64) -> Result<()> {
    let script = format!(
        r#"
import os, random, sqlite3
random.seed({seed})
budget = {bytes}
db = sqlite3.connect("{vol}/db.sqlite")
n = db.execute("select count(*) from t").fetchone()[0]
# Updates of random rows: about half the budget (a 4 KiB page each, plus the WAL).
for _ in range(budget // 2 // 4096 // 4):
    db.execute("update t set v = ? where id = ?", (os.urandom(300), random.randrange(1, n + 1)))
db.execute("insert into t(v) select randomblob(300) from t limit ?", (budget // 8 // 300,))
db.commit(); db.close()
with open("{vol}/app.log", "ab") as f:
    f.write(os.urandom(budget // 8))
files = [os.path.join(d, x) for d, _, xs in os.walk("{vol}/share") for x in xs]
files = [p for p in files if os.path.isfile(p) and not os.path.islink(p)]
random.shuffle(files)
left = budget // 4
for p in files:
    if left <= 0: break
    size = os.path.getsize(p)
    with open(p, "r+b") as f:
        f.write(os.urandom(min(size, 65536)))
    left -= min(size, 65536) + 4096
"#,
        vol = vol.display()
    );
    run_checked(Command::new("python3").arg("-c").arg(script))?;
    sh("sync")?;
    Ok(())
}

/// The time to take a point in time of the volume mounted at `vol` as VolSync does (and
/// a cycle must, before it can read a byte): frozen, its image cloned to `clone`, thawed.
/// The clone is removed.
fn point_in_time_seconds(vol: &Path, image: &Path, clone: &Path) -> Result<f64> {
    let started = Instant::now();
    sh(&format!(
        "fsfreeze -f {v} && cp --reflink=always {i} {c}; fsfreeze -u {v}",
        v = vol.display(),
        i = image.display(),
        c = clone.display()
    ))?;
    let seconds = started.elapsed().as_secs_f64();
    fs::remove_file(clone)
        .with_context(|| format!("cannot remove the floor's clone {}", clone.display()))?;
    Ok(seconds)
}

/// 4 KiB pages where `a` and `b` (the same length) differ.
fn differing_pages(a: &Path, b: &Path) -> Result<u64> {
    Ok(diff::compare(a, b)?.differing_pages)
}

fn read_full(f: &mut fs::File, buf: &mut [u8]) -> Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read(&mut buf[got..])? {
            0 => break,
            n => got += n,
        }
    }
    Ok(got)
}

fn run(args: &Args) -> Result<bool> {
    if !rustix::process::geteuid().is_root() {
        bail!("needs root (loop devices, mounts, fsfreeze)");
    }
    let mover = mover_binary(args.mover.as_deref())?;
    let w = &args.workdir;
    cleanup(w);
    let _ = fs::remove_dir_all(w);
    fs::create_dir_all(w)?;
    let _guard = Guard(w.clone());
    let size = args.size;

    eprintln!(
        "== setup: XFS for the images, ext4 with real data in a {} MiB volume",
        mib(size)
    );
    let xfs_img = w.join("xfs.img");
    fs::File::create(&xfs_img)?.set_len(size * 7 / 2 + (2 << 30))?;
    sh(&format!("mkfs.xfs -q {}", xfs_img.display()))?;
    let xfs = w.join("xfs");
    fs::create_dir_all(&xfs)?;
    sh(&format!(
        "mount -o loop {} {}",
        xfs_img.display(),
        xfs.display()
    ))?;
    // The XFS stands for a disk: in direct-I/O mode its loop device passes requests on to
    // the host's disk side by side, as a disk's queue does, instead of one at a time
    // through the host's page cache (where every random read waits for the one before).
    sh(&format!(
        "losetup --direct-io=on $(findmnt -n -o SOURCE {})",
        xfs.display()
    ))?;
    let (da, db, dr) = (xfs.join("a"), xfs.join("b"), xfs.join("rsync"));
    for d in [&da, &db, &dr] {
        fs::create_dir_all(d)?;
    }
    let (a_img, b_img, r_img) = (da.join("vol.img"), db.join("vol.img"), dr.join("vol.img"));
    fs::File::create(&a_img)?.set_len(size)?;
    // No lazy inode-table init: the kernel would keep writing the volume in the background.
    sh(&format!(
        "mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 {}",
        a_img.display()
    ))?;
    let vol = w.join("vol");
    fs::create_dir_all(&vol)?;
    sh(&format!(
        "mount -o loop {} {}",
        a_img.display(),
        vol.display()
    ))?;
    let fill = size * 45 / 100;
    sh(&format!(
        "cp -a /usr/share {v}/share; [ -d /root/.cargo/registry ] && [ {fill} -gt 2000000000 ] && cp -a /root/.cargo/registry {v}/registry; true",
        v = vol.display()
    ))?;
    let db_bytes = fill.saturating_sub(1_100_000_000).max(fill / 5);
    run_checked(Command::new("python3").arg("-c").arg(format!(
        "import sqlite3\ndb = sqlite3.connect('{}/db.sqlite')\ndb.execute('create table t(id integer primary key, v blob)')\n\
         db.execute('with recursive c(x) as (select 1 union all select x+1 from c limit {}) insert into t(v) select randomblob(300) from c')\ndb.commit()",
        vol.display(),
        db_bytes / 330
    )))?;
    sh("sync")?;

    let tls_files = if args.tls {
        let dir = w.join("tls");
        fs::create_dir_all(&dir)?;
        let files = tls::generate(Path::new("openssl"), &dir)?;
        let _ = CLIENT_TLS.set(vec![
            ("MOVER_TLS_CA", files.ca.clone()),
            ("MOVER_TLS_CERT", files.client_cert.clone()),
            ("MOVER_TLS_KEY", files.client_key.clone()),
        ]);
        Some(files)
    } else {
        None
    };
    let agent_tls = tls_files.as_ref().map(|f| {
        (
            f.server_cert.as_path(),
            f.server_key.as_path(),
            f.ca.as_path(),
        )
    });
    let a = Agent::start_tls(&mover, &da, &[("vol", &a_img)], agent_tls)?;
    let b = Agent::start_tls(&mover, &db, &[("vol", &b_img)], agent_tls)?;
    let secondary = format!("{}/vol", b.url());
    let a_url = a.url();
    eprintln!("== first cycle (the whole volume)");
    let t = Instant::now();
    let vol_arg = vol.to_string_lossy().into_owned();
    let mut create = vec![
        "create",
        "r",
        "--agent",
        &a_url,
        "--volume",
        "vol",
        "--secondary",
        &secondary,
        "--interval",
        "1h",
        "--freeze",
        &vol_arg,
    ];
    if let Some(c) = &args.chunk_size {
        create.extend(["--chunk-size", c]);
    }
    replicate(&mover, &create)?;
    loop {
        let s = replicate(&mover, &["status", "r", "--agent", &a.url()])?;
        if s["last_cycle"]["id"].as_u64() >= Some(1) {
            break;
        }
        if !s["last_error"].as_str().unwrap_or("").is_empty()
            && t.elapsed() > Duration::from_secs(600)
        {
            bail!("the first cycle failed: {}", s["last_error"]);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("   {:.1} s", t.elapsed().as_secs_f64());
    // The rsync daemon's copy starts where the secondary is.
    sh(&format!(
        "cp --reflink=always {} {}",
        b_img.display(),
        r_img.display()
    ))?;
    let rport = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let rconf = w.join("rsyncd.conf");
    fs::write(
        &rconf,
        format!(
            "use chroot = no\nuid = root\ngid = root\n[bench]\npath = {}\nread only = no\n",
            dr.display()
        ),
    )?;
    let rsyncd = Command::new("rsync")
        .args(["--daemon", "--no-detach", "--address=127.0.0.1"])
        .arg(format!("--port={rport}"))
        .arg(format!("--config={}", rconf.display()))
        .stderr(Stdio::null())
        .spawn()
        .context("cannot start the rsync daemon (apt-get install rsync)")?;
    let rsyncd = Killed(rsyncd);
    while TcpStream::connect(("127.0.0.1", rport)).is_err() {
        std::thread::sleep(Duration::from_millis(50));
    }

    eprintln!("== the floor: the disk under {}", w.display());
    let disk = treefloor::disk_speed(w)?;
    eprintln!("   {}", disk.describe());
    let budget = (size as f64 * args.change_percent / 100.0) as u64;
    let mut rounds = Vec::new();
    for round in 1..=args.rounds {
        eprintln!("== round {round}: change, mover cycle, VolSync rsync");
        change(&vol, budget, round as u64)?;
        let changed = differing_pages(&a_img, &r_img)?;
        let point_in_time = point_in_time_seconds(&vol, &a_img, &da.join("floor-clone.img"))?;
        drop_caches()?;
        let cpu_before = (a.cpu_seconds(), b.cpu_seconds());
        let m = run_timed(
            mover_command(&mover).args(["replicate", "sync", "r", "--json", "--agent", &a.url()]),
            ThenSync::No,
        )?;
        let cpu = (
            a.cpu_seconds() - cpu_before.0,
            b.cpu_seconds() - cpu_before.1,
        );
        let s: serde_json::Value = serde_json::from_slice(&m.stdout)?;
        let c = &s["last_cycle"];
        drop_caches()?;
        let snap = da.join("snap.img");
        let v = vol.display();
        let cmd = format!(
            "fsfreeze -f {v} && cp --reflink=always {a} {s}; fsfreeze -u {v}; \
             rsync --inplace --no-whole-file --stats {s} rsync://127.0.0.1:{rport}/bench/vol.img",
            a = a_img.display(),
            s = snap.display()
        );
        let r = run_timed(Command::new("sh").arg("-c").arg(&cmd), ThenSync::Yes)?;
        fs::remove_file(&snap)?;
        let sent = String::from_utf8_lossy(&r.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("Total bytes sent: "))
            .map(|n| n.replace(',', "").trim().parse().unwrap_or(0))
            .unwrap_or(0);
        // Each replica is a frozen point in time of a mounted filesystem, taken moments
        // apart (each freeze commits ext4's journal): they may differ in a few metadata
        // pages, but mover's must be a clean filesystem.
        let apart = differing_pages(&b_img, &r_img)?;
        let fsck = Command::new("e2fsck").args(["-fn"]).arg(&b_img).output()?;
        if !fsck.status.success() {
            bail!(
                "round {round}: e2fsck -fn of mover's replica failed: {}",
                String::from_utf8_lossy(&fsck.stdout)
            );
        }
        let read = c["bytes_read"].as_u64().unwrap_or(0);
        let floor_seconds = point_in_time + disk.floor_seconds(changed * PAGE, changed * PAGE);
        let row = Round {
            changed_pages: changed,
            changed_percent: changed as f64 * PAGE as f64 * 100.0 / size as f64,
            mover_seconds: m.elapsed.as_secs_f64(),
            floor_seconds,
            over_floor: m.elapsed.as_secs_f64() / floor_seconds,
            mover_cycle_ms: c["duration_ms"].as_u64().unwrap_or(0),
            mover_writers_held_ms: c["writers_held_ms"].as_u64().unwrap_or(0),
            volsync_writers_held_ms: (point_in_time * 1000.0).ceil() as u64,
            mover_bytes_read: read,
            mover_read_percent: read as f64 * 100.0 / size as f64,
            mover_bytes_shipped: c["bytes_shipped"].as_u64().unwrap_or(0),
            primary_cpu_seconds: cpu.0,
            secondary_cpu_seconds: cpu.1,
            volsync_seconds: r.elapsed.as_secs_f64(),
            rsync_bytes_sent: sent,
            ratio: r.elapsed.as_secs_f64() / m.elapsed.as_secs_f64(),
            agent_rss_bytes: a.rss("VmRSS:"),
            replica_pages_apart_from_rsyncs: apart,
        };
        eprintln!(
            "   changed {:.2}%: mover {:.2} s ({:.1}x its floor; cycle {} ms, writers held {} ms against VolSync's {} ms, read {:.2}%, shipped {:.1} MiB, CPU {:.2} + {:.2} s), VolSync {:.2} s (sent {:.1} MiB): {:.1}x; agent RSS {:.0} MiB",
            row.changed_percent,
            row.mover_seconds,
            row.over_floor,
            row.mover_cycle_ms,
            row.mover_writers_held_ms,
            row.volsync_writers_held_ms,
            row.mover_read_percent,
            mib(row.mover_bytes_shipped),
            row.primary_cpu_seconds,
            row.secondary_cpu_seconds,
            row.volsync_seconds,
            mib(sent),
            row.ratio,
            mib(row.agent_rss_bytes)
        );
        rounds.push(row);
    }
    drop(rsyncd);

    eprintln!(
        "== RPO under load: interval 5 s, {} s of writes",
        args.rpo_seconds
    );
    replicate(
        &mover,
        &["update", "r", "--interval", "5s", "--agent", &a.url()],
    )?;
    let writer = Command::new("python3")
        .arg("-c")
        .arg(format!(
            "import os, random, sqlite3, time\ndb = sqlite3.connect('{}/db.sqlite')\n\
             n = db.execute('select count(*) from t').fetchone()[0]\nwhile True:\n\
             \x20   for _ in range(200): db.execute('update t set v = ? where id = ?', (os.urandom(300), random.randrange(1, n + 1)))\n\
             \x20   db.commit(); time.sleep(0.05)",
            vol.display()
        ))
        .spawn()?;
    let writer = Killed(writer);
    // Sampling starts from a cycle taken under the load, not from the last round's.
    replicate(&mover, &["sync", "r", "--agent", &a.url()])?;
    let mut rpo = Vec::new();
    let until = Instant::now() + Duration::from_secs(args.rpo_seconds);
    while Instant::now() < until {
        let s = replicate(&mover, &["status", "r", "--agent", &a.url()])?;
        if let Some(x) = s["rpo_seconds"].as_f64() {
            rpo.push(x);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    drop(writer);
    replicate(
        &mover,
        &["update", "r", "--interval", "1h", "--agent", &a.url()],
    )?;
    replicate(&mover, &["sync", "r", "--agent", &a.url()])?;
    rpo.sort_by(|x, y| x.total_cmp(y));
    let p99 = rpo
        .get((rpo.len() * 99 / 100).min(rpo.len().saturating_sub(1)))
        .copied()
        .unwrap_or(f64::NAN);
    eprintln!("   RPO p99 {p99:.1} s over {} samples", rpo.len());

    eprintln!("== failback after a forced failover, both sides written");
    let peak = a.rss("VmHWM:");
    // The common cycle C is where both replicas are now.
    sh(&format!(
        "cp --reflink=always {} {}",
        b_img.display(),
        r_img.display()
    ))?;
    let (a_port, a_config) = (a.port, a.config.clone());
    drop(a);
    replicate(&mover, &["promote", "r", "--force", "--agent", &b.url()])?;
    change(&vol, budget, 100)?;
    sh(&format!("umount {}", vol.display()))?;
    let b_vol = w.join("b-vol");
    fs::create_dir_all(&b_vol)?;
    sh(&format!(
        "mount -o loop {} {}",
        b_img.display(),
        b_vol.display()
    ))?;
    change(&b_vol, budget, 200)?;
    sh(&format!("umount {}", b_vol.display()))?;
    let on_b = differing_pages(&b_img, &r_img)?;
    let on_a = differing_pages(&a_img, &r_img)?;
    let union = {
        // Pages where either side differs from C.
        let (mut fa, mut fb, mut fc) = (
            fs::File::open(&a_img)?,
            fs::File::open(&b_img)?,
            fs::File::open(&r_img)?,
        );
        let (mut x, mut y, mut z) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
        let mut n = 0u64;
        loop {
            let k = read_full(&mut fc, &mut z)?;
            read_full(&mut fa, &mut x)?;
            read_full(&mut fb, &mut y)?;
            if k == 0 {
                break n;
            }
            for p in 0..k / PAGE as usize {
                let r = p * PAGE as usize..(p + 1) * PAGE as usize;
                if x[r.clone()] != z[r.clone()] || y[r.clone()] != z[r] {
                    n += 1;
                }
            }
        }
    };
    let a = Agent::spawn(&mover, a_config, a_port)?;
    replicate(
        &mover,
        &["resync", "r", "--discard-local", "--agent", &a.url()],
    )?;
    drop_caches()?;
    let a_read0 = a.read_bytes();
    let t = Instant::now();
    let s = replicate(&mover, &["sync", "r", "--agent", &b.url()])?;
    let secs = t.elapsed().as_secs_f64();
    let shipped = s["last_cycle"]["bytes_shipped"].as_u64().unwrap_or(0);
    let failback = Failback {
        pages_changed_on_new_primary: on_b,
        pages_changed_on_old_primary: on_a,
        union_pages: union,
        seconds: secs,
        bytes_shipped: shipped,
        shipped_over_union: shipped as f64 / (union * PAGE).max(1) as f64,
        new_primary_bytes_read: s["last_cycle"]["bytes_read"].as_u64().unwrap_or(0),
        old_primary_read_bytes: a.read_bytes() - a_read0,
    };
    if differing_pages(&a_img, &b_img)? != 0 {
        bail!("after the failback the two replicas differ");
    }
    eprintln!(
        "   union {} pages ({:.1} MiB): shipped {:.1} MiB = {:.2}x, {:.2} s; read {:.0}% on the new primary, {:.0}% on the old",
        union,
        mib(union * PAGE),
        mib(shipped),
        failback.shipped_over_union,
        secs,
        failback.new_primary_bytes_read as f64 * 100.0 / size as f64,
        failback.old_primary_read_bytes as f64 * 100.0 / size as f64
    );

    let median_ratio = median(rounds.iter().map(|r| r.ratio).collect());
    let median_cycle = median(rounds.iter().map(|r| r.mover_seconds).collect());
    let median_over_floor = median(rounds.iter().map(|r| r.over_floor).collect());
    let max_read = rounds
        .iter()
        .map(|r| r.mover_read_percent)
        .fold(0.0, f64::max);
    let scale = size as f64 / (4u64 << 30) as f64;
    let checks = [
        (
            "cycle time <= 1.5 s (scaled to 4G)",
            median_cycle <= 1.5 * scale.max(1.0),
        ),
        (
            "cycle <= 1.3x its floor (a point in time, the changed pages read and written once)",
            median_over_floor <= MAX_OVER_FLOOR,
        ),
        ("cycle reads <= 5% of the volume", max_read <= 5.0),
        ("rsync / mover >= 10x", median_ratio >= 10.0),
        ("RPO p99 <= 15 s", p99 <= 15.0),
        (
            "failback ships <= 1.2x the union",
            failback.shipped_over_union <= 1.2,
        ),
        ("agent peak RSS <= 128 MiB", peak <= 128 << 20),
    ];
    let mut summary = format!(
        "mover-bench-replicate, {} MiB volume, {} rounds\n",
        mib(size),
        rounds.len()
    );
    summary += &format!(
        "  median cycle {median_cycle:.2} s ({median_over_floor:.1}x its floor), VolSync/mover \
         {median_ratio:.1}x, max read {max_read:.2}%\n  disk: {}\n",
        disk.describe()
    );
    summary += &format!(
        "  RPO p99 {p99:.1} s; failback shipped {:.2}x the union; agent peak RSS {:.0} MiB\n",
        failback.shipped_over_union,
        mib(peak)
    );
    let mut met = true;
    for (what, ok) in checks {
        summary += &format!("  [{}] {what}\n", if ok { "ok" } else { "MISSED" });
        met &= ok;
    }
    print!("\n{summary}");
    let results = Results {
        size,
        rounds,
        median_ratio,
        median_cycle_seconds: median_cycle,
        disk,
        median_over_floor,
        max_read_percent: max_read,
        rpo_p99_seconds: p99,
        rpo_samples: rpo.len(),
        failback,
        agent_peak_rss_bytes: peak,
        targets_met: met,
    };
    if let Some(p) = &args.json {
        fs::write(p, serde_json::to_vec_pretty(&results)?)?;
    }
    if let Some(dir) = &args.report {
        write_report(dir, &results, scale.max(1.0), &summary)?;
        eprintln!("report: {}", dir.join("index.html").display());
    }
    drop(b);
    Ok(met)
}

/// Bytes in MiB.
fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

/// The HTML report: every figure against its target, and each round's cycle beside
/// VolSync's rsync of the same change.
fn write_report(dir: &Path, r: &Results, scale: f64, text: &str) -> Result<()> {
    use charts::{Bar, Figure, bar_chart, write_page};
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let bar = |label: &str, value: f64, limit: f64, pass: bool| Bar {
        label: label.to_string(),
        value,
        target: Some(limit),
        pass,
    };
    let cycle_limit = 1.5 * scale;
    let rss = mib(r.agent_peak_rss_bytes);
    let targets = [
        bar(
            &format!("median cycle (s) <= {cycle_limit:.1}"),
            r.median_cycle_seconds,
            cycle_limit,
            r.median_cycle_seconds <= cycle_limit,
        ),
        bar(
            "cycle / floor <= 1.3",
            r.median_over_floor,
            MAX_OVER_FLOOR,
            r.median_over_floor <= MAX_OVER_FLOOR,
        ),
        bar(
            "cycle reads (% of volume) <= 5",
            r.max_read_percent,
            5.0,
            r.max_read_percent <= 5.0,
        ),
        bar(
            "VolSync / mover time >= 10",
            r.median_ratio,
            10.0,
            r.median_ratio >= 10.0,
        ),
        bar(
            "RPO p99 (s) <= 15",
            r.rpo_p99_seconds,
            15.0,
            r.rpo_p99_seconds <= 15.0,
        ),
        bar(
            "failback shipped / union <= 1.2",
            r.failback.shipped_over_union,
            1.2,
            r.failback.shipped_over_union <= 1.2,
        ),
        bar("agent peak RSS (MiB) <= 128", rss, 128.0, rss <= 128.0),
    ];
    bar_chart(
        &dir.join("targets.svg"),
        "replication against its targets",
        "value (target: black tick)",
        &targets,
    )?;
    let mut rounds = Vec::new();
    for (i, round) in r.rounds.iter().enumerate() {
        for (who, secs) in [
            ("mover cycle", round.mover_seconds),
            ("VolSync rsync", round.volsync_seconds),
        ] {
            rounds.push(Bar {
                label: format!("round {}: {who}", i + 1),
                value: secs,
                target: None,
                pass: true,
            });
        }
    }
    bar_chart(
        &dir.join("rounds.svg"),
        "each round: the same change shipped by mover and by VolSync's rsync",
        "seconds",
        &rounds,
    )?;
    write_page(
        dir,
        "mover-bench-replicate: replication cycles",
        text,
        &[
            Figure {
                file: "targets.svg".into(),
                caption: "each figure against its target: green met, red missed".into(),
            },
            Figure {
                file: "rounds.svg".into(),
                caption: "seconds per round: a mover cycle and VolSync's snapshot + rsync of the same change".into(),
            },
        ],
    )
}
