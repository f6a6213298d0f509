//! PostgreSQL under load, replicated and failed over: pgbench writes into a PostgreSQL 15
//! cluster on ext4 inside an image on XFS while a relationship ships a reflink clone of
//! the image, taken with the ext4 frozen, every 2 s. The secondary is then promoted by
//! force, as when the primary's node is lost: its ext4 passes `e2fsck -fn`, PostgreSQL
//! starts on it by crash recovery, and every pgbench transaction in it is whole. And with
//! no freeze set, twenty replicas taken under pgbench each start with every transaction
//! whole (the agent freezes the ext4 it finds mounted from the image).
//!
//! Needs root (loop devices, mounts, FIFREEZE, running PostgreSQL as `postgres`) and
//! PostgreSQL 15, as CI has (.ci/run installs it).

mod common;

use common::pg::{PG_BIN, Postgres, chown_postgres, run_ok};
use common::{agent::*, *};
use rustix::process::Signal;
use std::{
    fs::Permissions,
    os::unix::fs::PermissionsExt,
    path::Path,
    process::Command,
    time::{Duration, Instant, SystemTime},
};

/// pgbench scale: 100000 accounts (15 MiB with their index) per unit.
const SCALE: u64 = 5;
/// How long pgbench writes while the relationship replicates.
const LOAD: Duration = Duration::from_secs(16);
/// Completed cycles whose point in time falls inside the load, at least.
const CYCLES_UNDER_LOAD: usize = 4;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// An ext4 image on a loop device, mounted; thawed (an agent killed mid-cycle leaves it
/// frozen), unmounted and detached on drop.
struct Ext4 {
    mount: Mount,
    _dev: LoopDevice,
}

impl Ext4 {
    fn mount(image: &Path, dir: &Path) -> Ext4 {
        let dev = LoopDevice::attach(image);
        Ext4 {
            mount: Mount::new(&dev.path, dir),
            _dev: dev,
        }
    }
}

impl Drop for Ext4 {
    fn drop(&mut self) {
        let _ = Command::new("fsfreeze")
            .arg("--unfreeze")
            .arg(&self.mount.dir)
            .output();
    }
}

/// `mover replicate create pg` of export pg on `a` into pg on `b`, with `extra` arguments.
fn create_pg(a: &Agent, b: &Agent, extra: &[&str]) {
    let (agent, secondary) = (control(a), b.url("pg"));
    let mut args = vec![
        "create",
        "pg",
        "--agent",
        &agent,
        "--volume",
        "pg",
        "--secondary",
        &secondary,
    ];
    args.extend_from_slice(extra);
    ok(replicate(&args));
}

fn status(agent: &Agent) -> serde_json::Value {
    status_of(agent, "pg")
}

fn wait_for(agent: &Agent, what: &str, cond: impl Fn(&serde_json::Value) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = status(agent);
        if cond(&s) {
            return;
        }
        assert!(Instant::now() < deadline, "waited for {what}: {s}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The scene of these tests: PostgreSQL 15 with pgbench's tables (scale [`SCALE`]) on
/// ext4 in an image on XFS on the primary's node, and both nodes' agents. Fields drop in
/// this order: PostgreSQL, the agents (so none freezes the ext4 once it is unmounted),
/// the ext4, the directories, the XFS.
struct Scene {
    pg_a: Postgres,
    a: Agent,
    b: Agent,
    ext4_a: Ext4,
    b_img: std::path::PathBuf,
    run_b: std::path::PathBuf,
    dirs: tempfile::TempDir,
    xfs: ScratchFs,
}

impl Scene {
    fn new() -> Scene {
        assert!(
            rustix::process::geteuid().is_root(),
            "this test needs root (loop devices, mounts, FIFREEZE), as CI has"
        );
        assert!(
            Path::new(PG_BIN).join("initdb").exists(),
            "PostgreSQL 15 is not installed in {PG_BIN} (.ci/run installs it)"
        );
        // Images on XFS: each cycle reads a reflink clone, a point in time.
        let xfs = ScratchFs::new("xfs", 3 << 30);
        let (da, db) = (xfs.path().join("a"), xfs.path().join("b"));
        std::fs::create_dir_all(&da).unwrap();
        std::fs::create_dir_all(&db).unwrap();
        let (a_img, b_img) = (da.join("pg.img"), db.join("pg.img"));
        std::fs::File::create(&a_img)
            .unwrap()
            .set_len(1 << 30)
            .unwrap();
        run_ok(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&a_img));
        // Mount points and the nodes' run directories, where postgres may enter.
        let dirs = tempfile::tempdir().unwrap();
        std::fs::set_permissions(dirs.path(), Permissions::from_mode(0o755)).unwrap();
        let (run_a, run_b) = (dirs.path().join("run-a"), dirs.path().join("run-b"));
        for d in [&run_a, &run_b] {
            std::fs::create_dir(d).unwrap();
            chown_postgres(d);
        }
        let ext4_a = Ext4::mount(&a_img, &dirs.path().join("mnt-a"));
        let a = Agent::start(&da, &[("pg", &a_img, false)], None);
        let b = Agent::start(&db, &[("pg", &b_img, false)], None);
        let mut pg_a = Postgres::init(ext4_a.mount.dir.join("pgdata"), run_a);
        pg_a.start();
        run_ok(
            pg_a.cmd("pgbench")
                .args(["-i", "-q", "-s", &SCALE.to_string()]),
        );
        Scene {
            pg_a,
            a,
            b,
            ext4_a,
            b_img,
            run_b,
            dirs,
            xfs,
        }
    }
}

#[test]
fn pgbench_on_ext4_in_an_xfs_image_survives_a_forced_failover() {
    let t0 = Instant::now();
    let elapsed = |what: &str| eprintln!("[{:5.1}s] {what}", t0.elapsed().as_secs_f64());
    let mut scene = Scene::new();
    let (a, b, pg_a) = (&scene.a, &scene.b, &mut scene.pg_a);
    let (mnt_a, b_img, run_b, dirs) = (
        scene.ext4_a.mount.dir.clone(),
        &scene.b_img,
        scene.run_b.clone(),
        &scene.dirs,
    );
    elapsed("pgbench initialised");

    create_pg(
        a,
        b,
        &["--interval", "2s", "--freeze", mnt_a.to_str().unwrap()],
    );
    wait_for(a, "the first cycle", |s| {
        s["last_cycle"]["id"].as_u64() >= Some(1)
    });
    assert_eq!(status(a)["freeze"].as_str(), mnt_a.to_str());
    elapsed("first cycle done");

    // The load: 4 clients, each transaction updating 3 balances and adding a history row.
    let load_from = now_ms();
    let mut pgbench = pg_a.load(LOAD);
    let mut cycles = Vec::<serde_json::Value>::new();
    let mut max_rpo = 0f64;
    let ended = loop {
        if let Some(st) = pgbench.0.try_wait().unwrap() {
            break st;
        }
        let s = status(a);
        assert_eq!(
            (s["role"].as_str(), s["state"].as_str()),
            (Some("primary"), Some("Replicating")),
            "{s}"
        );
        assert_eq!(s["consistency"], "point-in-time", "frozen and cloned: {s}");
        max_rpo = max_rpo.max(s["rpo_seconds"].as_f64().unwrap_or(0.0));
        let c = &s["last_cycle"];
        if cycles.last().is_none_or(|l| l["id"] != c["id"]) {
            cycles.push(c.clone());
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let load_to = now_ms();
    let log = std::fs::read_to_string(pg_a.run.join("pgbench")).unwrap();
    assert!(ended.success(), "pgbench: {ended}\n{log}");
    elapsed("pgbench done");
    for c in &cycles {
        eprintln!(
            "cycle {}: at +{} ms, {} ms, {} bytes read, {} shipped",
            c["id"],
            c["point_in_time_ms"].as_i64().unwrap() - load_from,
            c["duration_ms"],
            c["bytes_read"],
            c["bytes_shipped"]
        );
    }
    eprintln!("largest RPO seen: {max_rpo:.1} s");
    let under_load: Vec<_> = cycles
        .iter()
        .filter(|c| (load_from..load_to).contains(&c["point_in_time_ms"].as_i64().unwrap()))
        .collect();
    assert!(
        under_load.len() >= CYCLES_UNDER_LOAD,
        "cycles every 2 s while pgbench ran {} s: {cycles:?}",
        LOAD.as_secs()
    );
    for c in &under_load {
        assert!(c["bytes_shipped"].as_u64() > Some(0), "pgbench wrote: {c}");
    }
    // About two intervals: cycles of a few MiB take well under one.
    assert!(max_rpo < 10.0, "RPO {max_rpo} s with 2 s cycles");
    let ids: Vec<u64> = cycles.iter().map(|c| c["id"].as_u64().unwrap()).collect();
    assert!(
        ids.windows(2).all(|w| w[0] < w[1]),
        "cycle ids advance: {ids:?}"
    );
    let s = status(a);
    assert_eq!(s["cycles_failed"], 0, "{s}");

    // Disaster recovery, the case that matters: the secondary is promoted by force from
    // its last committed cycle, as when the primary's node is lost (a planned failover
    // would demote it first, shipping a final cycle). The primary is left as is, its
    // agent still cycling: the new epoch fences it.
    let written = pg_a.count("select count(*) from pgbench_history");
    ok(replicate(&[
        "promote",
        "pg",
        "--force",
        "--agent",
        &control(b),
    ]));
    let s = status(b);
    assert_eq!(
        (s["role"].as_str(), s["epoch"].as_u64()),
        (Some("primary"), Some(2)),
        "{s}"
    );
    let promoted_from = s["last_cycle"]["id"].as_u64().unwrap();
    assert!(
        promoted_from >= *ids.last().unwrap(),
        "the secondary holds the last cycle seen under load ({ids:?}): {s}"
    );
    wait_for(a, "the old primary fenced", |s| s["state"] == "Fenced");
    elapsed(&format!(
        "promoted from cycle {promoted_from}; the old primary is fenced"
    ));

    // The old primary's postmaster dies with its node; its postmaster.pid in the copy
    // then names no live process, as on another machine.
    assert!(
        pg_a.stop(Signal::QUIT).is_some(),
        "the primary's PostgreSQL was running"
    );

    // Frozen around each clone: clean, the copy's journal flushed.
    common::pg::assert_ext4_clean(b_img);

    let ext4_b = Ext4::mount(b_img, &dirs.path().join("mnt-b"));
    let mut pg_b = Postgres::existing(ext4_b.mount.dir.join("pgdata"), run_b);
    pg_b.start();
    elapsed("PostgreSQL started on the promoted secondary");
    let log = pg_b.log();
    assert!(
        log.contains("database system was not properly shut down; automatic recovery"),
        "a copy of a running cluster starts by crash recovery: {log}"
    );
    let history = common::pg::assert_recovered(&pg_b, SCALE, written);
    // And it takes writes.
    run_ok(pg_b.cmd("pgbench").args(["-n", "-t", "50"]));
    assert_eq!(pg_b.stop(Signal::INT), Some(true), "{}", pg_b.log());
    elapsed(&format!(
        "{history} of {written} transactions on the secondary, all whole"
    ));
}

/// Replicas checked as a forced promotion would find them.
const PROMOTIONS: usize = 20;

/// Regression (issue 52: a forced promotion found a database whose balances did not add
/// up, from a cycle recloned range by range while PostgreSQL wrote). No `--freeze` is
/// set: the agent finds the ext4 mounted from the image's loop device and freezes it for
/// each catch-up of the clone. Twenty cycles under pgbench; after each, the secondary's
/// image (the replica a forced promotion would start from) is cloned, and that copy must
/// pass e2fsck and start PostgreSQL by crash recovery with every transaction whole:
/// history, tellers and branches sum to what the accounts sum to.
#[test]
fn twenty_replicas_of_pgbench_each_start_with_balances_that_add_up() {
    let t0 = Instant::now();
    let elapsed = |what: &str| eprintln!("[{:5.1}s] {what}", t0.elapsed().as_secs_f64());
    let scene = Scene::new();
    let (a, b, pg_a) = (&scene.a, &scene.b, &scene.pg_a);
    let (b_img, run_b, dirs, xfs) = (&scene.b_img, &scene.run_b, &scene.dirs, &scene.xfs);
    // Cycles only when asked: the secondary holds still while its copy is taken.
    create_pg(
        a,
        b,
        &["--interval", "1h", "--consistency", "point-in-time"],
    );
    wait_for(a, "the first cycle", |s| {
        s["last_cycle"]["id"].as_u64() >= Some(1)
    });
    elapsed("pgbench initialised, first cycle done");

    let mut load = pg_a.load(Duration::from_secs(3600));
    let copy = xfs.path().join("promoted.img");
    let mut histories = Vec::new();
    for round in 0..PROMOTIONS {
        std::thread::sleep(Duration::from_millis(300));
        ok(replicate(&["sync", "pg", "--agent", &control(a)]));
        let s = status(a);
        assert_eq!(s["consistency"], "point-in-time", "{s}");
        assert!(
            s["last_cycle"]["bytes_shipped"].as_u64() > Some(0),
            "pgbench wrote: {s}"
        );
        assert!(load.0.try_wait().unwrap().is_none(), "pgbench still runs");
        let written = pg_a.count("select count(*) from pgbench_history");
        let _ = std::fs::remove_file(&copy);
        run_ok(
            Command::new("cp")
                .arg("--reflink=always")
                .arg(b_img)
                .arg(&copy),
        );
        common::pg::assert_ext4_clean(&copy);
        let ext4 = Ext4::mount(&copy, &dirs.path().join("mnt-promoted"));
        let data = ext4.mount.dir.join("pgdata");
        // The primary's postmaster runs on this machine: its pid file in the copy would
        // name a live process, which a promoted node's would not.
        std::fs::remove_file(data.join("postmaster.pid")).unwrap();
        let mut pg = Postgres::existing(data, run_b.clone());
        pg.start();
        let history = common::pg::assert_recovered(&pg, SCALE, written);
        assert!(pg.stop(Signal::QUIT).is_some(), "{}", pg.log());
        drop(ext4);
        histories.push(history);
        elapsed(&format!(
            "replica {round}: {history} whole transactions of {written}"
        ));
    }
    drop(load);
    assert!(
        histories.windows(2).all(|w| w[0] < w[1]),
        "each replica carried the load's progress: {histories:?}"
    );
}
