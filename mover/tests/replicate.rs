//! Continuous replication between two real `mover agent` processes on 127.0.0.1:
//! cycles, planned failover and back, forced failover with writes on both sides and a
//! failback by delta, fencing, bad specs, and kill -9 of either agent at each step of
//! a cycle.

mod common;

use common::{agent::*, *};
use rand::{RngCore, SeedableRng, rngs::StdRng};
use std::{
    collections::BTreeSet,
    os::unix::fs::FileExt,
    path::Path,
    process::Output,
    time::{Duration, Instant},
};

const LEN: u64 = 32 * MIB;

fn refused(out: Output, expect: &str) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "wanted a refusal: {err}");
    assert!(err.contains(expect), "wanted {expect:?} in {err}");
    err
}

/// Writes new random data into `count` distinct pages of the first 6 MiB of `path` (random
/// data in every image of the pair, so no page written or overwritten compresses or is
/// zeros); returns their indices.
fn scribble(path: &Path, seed: u64, count: usize) -> BTreeSet<u64> {
    let f = std::fs::File::options().write(true).open(path).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut pages = BTreeSet::new();
    while pages.len() < count {
        pages.insert(rng.next_u64() % (6 * MIB / PAGE));
    }
    let mut buf = vec![0u8; PAGE as usize];
    for p in &pages {
        rng.fill_bytes(&mut buf);
        f.write_all_at(&buf, p * PAGE).unwrap();
    }
    f.sync_all().unwrap();
    pages
}

/// Two agents in their own directories, each exporting `vol`; the primary's image holds
/// data, the secondary's does not exist yet.
struct Pair {
    root: std::path::PathBuf,
    a: Agent,
    b: Agent,
    a_img: std::path::PathBuf,
    b_img: std::path::PathBuf,
    // Dropped last: the agents stop before their devices and files go.
    _loop: Option<LoopDevice>,
    _t: Option<tempfile::TempDir>,
    _fs: Option<ScratchFs>,
}

fn pair(b_env: &[(&str, &str)]) -> Pair {
    let t = tempfile::tempdir().unwrap();
    let mut p = pair_in(t.path(), b_env);
    p._t = Some(t);
    p
}

/// A pair whose images live under `root`.
fn pair_in(root: &Path, b_env: &[(&str, &str)]) -> Pair {
    pair_with_env(root, &[], b_env)
}

/// A pair whose images live under `root`, its agents started with `a_env` and `b_env`.
fn pair_with_env(root: &Path, a_env: &[(&str, &str)], b_env: &[(&str, &str)]) -> Pair {
    let (da, db) = (root.join("a"), root.join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let (a_img, b_img) = (da.join("vol.img"), db.join("vol.img"));
    make_image(&a_img, LEN, 1, &[(0, 6 * MIB), (20 * MIB, 3 * MIB)]);
    let a = Agent::start_with_env(&da, &[("vol", &a_img, false)], a_env);
    let b = Agent::start_with_env(&db, &[("vol", &b_img, false)], b_env);
    Pair {
        root: root.into(),
        a,
        b,
        a_img,
        b_img,
        _loop: None,
        _t: None,
        _fs: None,
    }
}

/// As [`pair_with_env`], but a's `vol` is a loop device over its image (as a local PV
/// over a node's file, or a volume an agent made).
fn pair_over_loop(root: &Path, a_env: &[(&str, &str)]) -> Pair {
    let mut p = pair_with_env(root, a_env, &[]);
    let device = LoopDevice::attach(&p.a_img);
    let da = root.join("a");
    p.a = Agent::start_with_env(&da, &[("vol", &device.path, false)], a_env);
    p._loop = Some(device);
    p
}

impl Pair {
    /// `mover replicate create NAME` of `vol` on a into `vol` on b, every hour, with
    /// `extra` arguments.
    fn create_command(&self, name: &str, extra: &[&str]) -> Output {
        let (agent, secondary) = (control(&self.a), self.b.url("vol"));
        let mut args = vec![
            "create",
            name,
            "--agent",
            &agent,
            "--volume",
            "vol",
            "--secondary",
            &secondary,
            "--interval",
            "1h",
        ];
        args.extend_from_slice(extra);
        replicate(&args)
    }

    /// Creates `name` with `extra` arguments and waits for its first cycle.
    fn create_with(&self, name: &str, extra: &[&str]) {
        ok(self.create_command(name, extra));
        wait_for(&self.a, name, "the first cycle", |s| {
            s["last_cycle"]["id"].as_u64() >= Some(1)
        });
    }

    fn create(&self, name: &str) {
        self.create_with(name, &[]);
    }

    fn same(&self) -> bool {
        blake3_of(&self.a_img, LEN) == blake3_of(&self.b_img, LEN)
    }
}

fn sync(agent: &Agent, name: &str) -> serde_json::Value {
    ok(replicate(&["sync", name, "--agent", &control(agent)]));
    status_of(agent, name)
}

#[test]
fn cycles_ship_changed_pages_and_a_planned_failover_and_back_ships_nothing() {
    let p = pair(&[]);
    p.create("r");
    assert!(p.same(), "the first cycle copies the volume");
    let s = status_of(&p.a, "r");
    assert_eq!(s["role"], "primary");
    assert_eq!(s["state"], "Replicating");
    assert_eq!(s["epoch"], 1);
    assert!(s["rpo_seconds"].as_f64().unwrap() < 60.0, "{s}");
    assert_eq!(status_of(&p.b, "r")["role"], "secondary");

    // A cycle ships exactly the changed pages (random data does not compress).
    let changed = scribble(&p.a_img, 2, 100);
    let s = sync(&p.a, "r");
    assert!(p.same());
    assert_eq!(
        s["last_cycle"]["bytes_shipped"],
        changed.len() as u64 * PAGE
    );
    assert_eq!(
        status_of(&p.b, "r")["last_cycle"]["id"],
        s["last_cycle"]["id"]
    );

    // Planned failover: demote ships a final cycle, promote raises the epoch.
    let changed = scribble(&p.a_img, 3, 10);
    let s = ok(replicate(&["demote", "r", "--agent", &control(&p.a), "--json"]).clone());
    drop(s);
    assert!(p.same(), "the final cycle carried the last writes");
    assert_eq!(status_of(&p.a, "r")["role"], "secondary");
    assert_eq!(
        status_of(&p.a, "r")["last_cycle"]["bytes_shipped"],
        changed.len() as u64 * PAGE
    );
    ok(replicate(&["promote", "r", "--agent", &control(&p.b)]));
    let s = sync(&p.b, "r");
    assert_eq!(
        (s["role"].as_str(), s["epoch"].as_u64()),
        (Some("primary"), Some(2))
    );
    assert_eq!(
        s["last_cycle"]["bytes_shipped"], 0,
        "nothing to ship back: {s}"
    );
    assert_eq!(s["history"][0]["epoch"], 2);

    // The new primary's writes reach the old one; the old epoch is fenced off.
    scribble(&p.b_img, 4, 30);
    sync(&p.b, "r");
    assert!(p.same());
    let stale = copy(
        &p.root,
        &[
            p.a_img.to_str().unwrap(),
            &p.b.url("vol"),
            "--relationship",
            "r",
            "--epoch",
            "1",
        ],
    );
    let err = String::from_utf8_lossy(&stale.stderr);
    assert!(err.contains("stale epoch 1"), "{err}");
    refused(
        replicate(&["sync", "r", "--agent", &control(&p.a)]),
        "secondary",
    );

    // And back again, with nothing extra shipped.
    ok(replicate(&["demote", "r", "--agent", &control(&p.b)]));
    ok(replicate(&["promote", "r", "--agent", &control(&p.a)]));
    let s = sync(&p.a, "r");
    assert_eq!(
        (s["role"].as_str(), s["epoch"].as_u64()),
        (Some("primary"), Some(3))
    );
    assert_eq!(s["last_cycle"]["bytes_shipped"], 0);
    assert!(p.same());

    // Metrics of the relationship on the primary.
    let m = p.a.http_get("/metrics");
    for name in [
        "mover_replication_rpo_seconds{relationship=\"r\",role=\"primary\"}",
        "mover_replication_cycles_total{relationship=\"r\",role=\"primary\",result=\"ok\"}",
        "mover_replication_cycle_duration_seconds_count{relationship=\"r\"",
        "mover_replication_missed_intervals_total",
        "mover_replication_bytes_shipped_total",
        "mover_replication_last_sync_timestamp_seconds",
    ] {
        assert!(m.contains(name), "{name} in {m}");
    }
}

#[test]
fn on_xfs_a_cycle_reads_only_the_chunks_written_since_the_last_one() {
    let fs = ScratchFs::new("xfs", 512 * MIB);
    let mut p = pair_in(fs.path(), &[]);
    p._fs = Some(fs);
    p.create("r");
    let s = sync(&p.a, "r");
    assert_eq!(s["consistency"], "point-in-time", "{s}");
    assert!(p.same());

    // Pages written into three chunks: of those only the written 8 KiB units
    // are read (the others' BLAKE3 chaining values are kept from the last cycle), and
    // exactly the written pages shipped.
    let f = std::fs::File::options().write(true).open(&p.a_img).unwrap();
    let mut rng = StdRng::seed_from_u64(30);
    let mut page = vec![0u8; PAGE as usize];
    let written = [
        MIB + 5 * PAGE,
        MIB + 9 * PAGE,
        4 * MIB,
        21 * MIB + 77 * PAGE,
    ];
    let mut write_pages = |offsets: &[u64]| {
        for &at in offsets {
            rng.fill_bytes(&mut page);
            f.write_all_at(&page, at).unwrap();
        }
        f.sync_all().unwrap();
    };
    write_pages(&written);
    let s = sync(&p.a, "r");
    assert!(p.same(), "the cycle carried every write");
    assert_eq!(s["last_cycle"]["bytes_shipped"], 4 * PAGE, "{s}");
    let read = s["last_cycle"]["bytes_read"].as_u64().unwrap();
    // The 4 written units, the two 8 KiB apart read in one go with the unit between.
    assert_eq!(read, 5 * 8192, "only the written units: {s}");

    // Nothing written: nothing read, nothing shipped.
    let s = sync(&p.a, "r");
    assert_eq!(
        (
            s["last_cycle"]["bytes_read"].as_u64(),
            s["last_cycle"]["bytes_shipped"].as_u64()
        ),
        (Some(0), Some(0)),
        "{s}"
    );

    // Damaged chaining values: the chunk is read whole, and the cycle is still exact.
    let cvs = std::fs::read_dir(p.a_img.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".cvs"))
        .expect("a CV file beside the image");
    let mut bytes = std::fs::read(&cvs).unwrap();
    // The record of the chunk at 1 MiB: 32 bytes per 8 KiB unit.
    let chunk = s["chunk_size"].as_u64().unwrap();
    bytes[(MIB / chunk * (chunk / 8192 * 32)) as usize + 40] ^= 1;
    std::fs::write(&cvs, bytes).unwrap();
    write_pages(&[MIB + 5 * PAGE, 4 * MIB + PAGE]);
    let s = sync(&p.a, "r");
    assert!(p.same(), "the cycle carried every write: {s}");
    assert_eq!(s["last_cycle"]["bytes_shipped"], 2 * PAGE, "{s}");
    assert_eq!(
        s["last_cycle"]["bytes_read"].as_u64(),
        Some(chunk + 8192),
        "the damaged chunk whole, one unit of the other: {s}"
    );

    // The secondary no longer holds the previous cycle (it was restored from elsewhere):
    // the cycle compares every chunk instead of trusting the extent maps.
    make_image(&p.b_img, LEN, 9, &[(0, 2 * MIB)]);
    p.b.kill_and_restart();
    let s = sync(&p.a, "r");
    assert!(p.same(), "a full comparison repaired the secondary: {s}");
    assert!(
        s["last_cycle"]["bytes_read"].as_u64().unwrap() >= 9 * MIB,
        "{s}"
    );
}

/// Where the torn-cycle writer keeps its counter: two places 19 MiB apart, in data the
/// image already holds (so each cycle's changed ranges are two, far apart).
const FIRST_PLACE: u64 = MIB + 3 * PAGE;
const SECOND_PLACE: u64 = 20 * MIB + 5 * PAGE;

/// The counters at the writer's two places of `image`.
fn counters(image: &Path) -> (u64, u64) {
    let f = std::fs::File::open(image).unwrap();
    let at = |offset| {
        let mut b = [0u8; 8];
        f.read_exact_at(&mut b, offset).unwrap();
        u64::from_le_bytes(b)
    };
    (at(FIRST_PLACE), at(SECOND_PLACE))
}

/// Regression (issue 52, torn cycles from a live catch-up): a writer keeps an invariant
/// across two places of the image far apart (counter n at the first, then n at the
/// second, forever), so every instant of the image holds (n, n) or (n, n - 1). Cycles
/// run while it writes, with the window between the ranges of a catch-up widened by a
/// pause; every replica applied on the secondary must hold one of those states. A
/// catch-up of a live image recloned the first place, then the second 300 ms later, and
/// applied a (n, n + millions) that never existed while calling it point-in-time.
#[test]
fn on_xfs_every_cycle_of_a_live_image_is_one_instant() {
    cycles_under_a_live_writer(&[]);
}

/// As above, with a freeze that does not hold the writer back (it writes into the image
/// itself, not through the frozen file system): the catch-up is taken, and its ctime
/// check sees the writes and takes a fresh clone instead.
#[test]
fn on_xfs_a_catch_up_written_under_is_not_taken_for_one_instant() {
    let elsewhere = ScratchFs::new("ext4", 32 * MIB);
    cycles_under_a_live_writer(&["--freeze", elsewhere.path().to_str().unwrap()]);
}

/// A volume that is a loop device over an image on XFS (a local PV over a node's file,
/// as the soak's database has) is read through the image's clones: every cycle is one
/// instant of the device, written through the device (O_DIRECT, as a file system in a
/// pod writes), not a live read that tears.
#[test]
fn on_xfs_a_loop_device_over_an_image_is_read_at_one_instant() {
    let fs = ScratchFs::new("xfs", 512 * MIB);
    let mut p = pair_over_loop(fs.path(), &[]);
    p._fs = Some(fs);
    let device = p._loop.as_ref().unwrap().path.clone();
    let clones_beside_the_image = || {
        std::fs::read_dir(p.a_img.parent().unwrap())
            .unwrap()
            .filter(|e| {
                e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with('.')
            })
            .count()
    };
    p.create_with("r", &[]);
    assert!(
        clones_beside_the_image() > 0,
        "the cycle's clone is kept beside the image, not under /dev"
    );
    cycles_while_written(&p, &device, true);
}

/// Cycles of a relationship created with `extra` arguments while a writer keeps its
/// invariant across the image's two places; every replica must hold one of its states.
fn cycles_under_a_live_writer(extra: &[&str]) {
    let fs = ScratchFs::new("xfs", 512 * MIB);
    let mut p = pair_with_env(fs.path(), &[("MOVER_PAUSE", "catch-up-range=300")], &[]);
    p._fs = Some(fs);
    p.create_with("r", extra);
    let image = p.a_img.clone();
    cycles_while_written(&p, &image, false);
}

/// Six cycles of `r` while a writer keeps its invariant across two places of `target`
/// (the image, or a loop device over it written with O_DIRECT); every replica must hold
/// one of its states and carry the writer's progress. The (cycle, counters) seen.
fn cycles_while_written(p: &Pair, target: &Path, direct: bool) -> Vec<(u64, (u64, u64))> {
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (stop, target) = (stop.clone(), target.to_path_buf());
        std::thread::spawn(move || {
            use std::os::unix::fs::OpenOptionsExt;
            let flags = if direct { libc::O_DIRECT } else { 0 };
            let f = std::fs::File::options()
                .write(true)
                .custom_flags(flags)
                .open(target)
                .unwrap();
            // O_DIRECT writes whole aligned pages from an aligned buffer.
            #[repr(align(4096))]
            struct Page([u8; PAGE as usize]);
            let mut page = Box::new(Page([0; PAGE as usize]));
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                n += 1;
                page.0[..8].copy_from_slice(&n.to_le_bytes());
                let len = if direct { PAGE as usize } else { 8 };
                f.write_all_at(&page.0[..len], FIRST_PLACE).unwrap();
                f.write_all_at(&page.0[..len], SECOND_PLACE).unwrap();
            }
            n
        })
    };
    let mut seen = Vec::new();
    for _ in 0..6 {
        std::thread::sleep(Duration::from_millis(50));
        let s = sync(&p.a, "r");
        assert_eq!(s["consistency"], "point-in-time", "{s}");
        seen.push((s["last_cycle"]["id"].as_u64().unwrap(), counters(&p.b_img)));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let written = writer.join().unwrap();
    let torn: Vec<_> = seen
        .iter()
        .filter(|(_, (first, second))| !(first == second || *first == second + 1))
        .collect();
    assert!(
        torn.is_empty(),
        "cycles (id, (first, second)) holding a state that never existed: {torn:?} of {seen:?}"
    );
    assert!(
        seen.windows(2).all(|w| w[0].1.0 < w[1].1.0) && seen[0].1.0 > 0,
        "each cycle carried the writer's progress ({written} writes): {seen:?}"
    );
    seen
}

#[test]
fn on_xfs_writes_of_a_cycle_that_failed_after_its_point_in_time_go_with_the_next() {
    let fs = ScratchFs::new("xfs", 512 * MIB);
    let mut p = pair_in(fs.path(), &[("MOVER_FAILPOINT", "cycle-staged")]);
    p._fs = Some(fs);
    // A cycle catches the last one's clone up only with every writer held back: here
    // the relationship's freeze, which says so of a file system of its own (the test
    // writes into the image between cycles, never during one).
    let held = ScratchFs::new("ext4", 32 * MIB);
    // The first cycle fills a new image under a temp name: no journal, no failpoint.
    p.create_with("r", &["--freeze", held.path().to_str().unwrap()]);
    let base_files = |p: &Pair| {
        let mut names: Vec<String> = std::fs::read_dir(p.a_img.parent().unwrap())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".mover-"))
            .collect();
        names.sort();
        names
    };
    let shipped = |s: &serde_json::Value| s["last_cycle"]["bytes_shipped"].as_u64().unwrap();

    // The secondary dies after staging: the primary's clone was already brought up to
    // date with these writes, and must not forget them.
    let mut pages = scribble(&p.a_img, 40, 30);
    assert!(
        !replicate(&["sync", "r", "--agent", &control(&p.a)])
            .status
            .success()
    );
    let _ = p.b.child.wait();
    p.b = Agent::spawn(p.b.config.clone(), p.b.port, p.b.metrics_port);
    pages.extend(scribble(&p.a_img, 41, 30));
    let s = sync(&p.a, "r");
    assert!(p.same(), "both cycles' writes arrived: {s}");
    assert_eq!(shipped(&s), pages.len() as u64 * PAGE, "{s}");

    // The primary dies between recording the ranges to reclone and recloning them. (An
    // agent runs a cycle as it starts: wait for it, so the writes land after it.)
    let started = |a: &Agent| {
        wait_for(a, "r", "the cycle an agent runs as it starts", |s| {
            s["cycles_ok"].as_u64() >= Some(1)
        })
    };
    p.a.child.kill().unwrap();
    p.a.child.wait().unwrap();
    let (config, port, metrics) = (p.a.config.clone(), p.a.port, p.a.metrics_port);
    p.a = Agent::spawn_with_env(
        config.clone(),
        port,
        metrics,
        &[("MOVER_FAILPOINT", "catch-up-recorded")],
    );
    started(&p.a);
    let pages = scribble(&p.a_img, 42, 30);
    assert!(
        !replicate(&["sync", "r", "--agent", &control(&p.a)])
            .status
            .success()
    );
    let _ = p.a.child.wait();
    // Restarted, its first cycle reads the recorded ranges: the writes go with it.
    p.a = Agent::spawn(config, port, metrics);
    started(&p.a);
    let s = status_of(&p.a, "r");
    assert!(p.same(), "the writes arrived: {s}");
    assert_eq!(shipped(&s), pages.len() as u64 * PAGE, "{s}");

    // One clone is kept (named for the last cycle), no fresh one left behind, and no
    // pending record once a cycle committed.
    let names = base_files(&p);
    let clones: Vec<_> = names
        .iter()
        .filter(|n| !n.ends_with(".ids") && !n.ends_with(".cvs"))
        .collect();
    let cycle = s["last_cycle"]["id"].as_u64().unwrap();
    assert_eq!(clones.len(), 1, "{names:?}");
    assert!(clones[0].ends_with(&format!("-{cycle}")), "{names:?}");
}

/// A catch-up holds the writers back only for its second pass: the first reclones what
/// changed since the last cycle while they write, the second, frozen, what they wrote
/// during the first. Writes that land between the two (a window widened by a pause) go
/// with the cycle, and the pause is not in the hold the cycle reports.
#[test]
fn on_xfs_writes_after_the_unfrozen_catch_up_go_with_the_cycle_and_only_the_last_pass_holds_writers()
 {
    const AHEAD_MS: u64 = 3000;
    let fs = ScratchFs::new("xfs", 512 * MIB);
    let pause = format!("ahead-of-freeze={AHEAD_MS}");
    let mut p = pair_with_env(fs.path(), &[("MOVER_PAUSE", &pause)], &[]);
    p._fs = Some(fs);
    // The freeze holds back a file system of its own: the test writes into the image
    // only while the cycle waits between the passes, never while it is frozen.
    let held = ScratchFs::new("ext4", 32 * MIB);
    p.create_with("r", &["--freeze", held.path().to_str().unwrap()]);
    let mut pages = scribble(&p.a_img, 60, 30);
    let started = Instant::now();
    let cycle = {
        let agent = control(&p.a);
        std::thread::spawn(move || replicate(&["sync", "r", "--agent", &agent]))
    };
    std::thread::sleep(Duration::from_millis(AHEAD_MS / 2));
    pages.extend(scribble(&p.a_img, 61, 30));
    ok(cycle.join().unwrap());
    assert!(
        started.elapsed() >= Duration::from_millis(AHEAD_MS),
        "the cycle waited between its passes"
    );
    let s = status_of(&p.a, "r");
    assert!(p.same(), "the writes of both moments arrived: {s}");
    let c = &s["last_cycle"];
    assert_eq!(c["bytes_shipped"], pages.len() as u64 * PAGE, "{s}");
    let held_ms = c["writers_held_ms"].as_u64().unwrap();
    assert!(
        (1..AHEAD_MS).contains(&held_ms),
        "writers held back for the frozen pass only, not the wait before it: {s}"
    );
    let m = p.a.http_get("/metrics");
    let gauge = "mover_replication_writers_held_seconds{relationship=\"r\",role=\"primary\"} ";
    let reported: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix(gauge))
        .unwrap_or_else(|| panic!("{gauge} in {m}"))
        .parse()
        .unwrap();
    assert_eq!(reported, held_ms as f64 / 1000.0, "{m}");
}

#[test]
fn a_restarted_agent_thaws_the_file_system_a_killed_one_left_frozen() {
    let p = pair(&[]);
    let fs = ScratchFs::new("ext4", 64 * MIB);
    let mount = fs.path().to_str().unwrap().to_string();
    p.create_with("r", &["--freeze", &mount]);
    let s = sync(&p.a, "r");
    assert_eq!(
        s["consistency"], "crash-inconsistent",
        "no reflinks on ext4: a freeze brackets only the taking of a clone, never a read: {s}"
    );
    assert!(p.same());
    let cycle = s["last_cycle"]["id"].clone();

    // Required, the point in time this volume cannot give fails the cycle: nothing is
    // shipped, and the error says what is missing and the ways out.
    let consistency = |c: &str| {
        ok(replicate(&[
            "update",
            "r",
            "--consistency",
            c,
            "--agent",
            &control(&p.a),
        ]))
    };
    consistency("point-in-time");
    let e = sync_err(&p.a);
    assert!(
        e.contains("no point in time can be taken of it: it is read live")
            && e.contains("volumeSnapshotClassName")
            && e.contains("consistency=crash-inconsistent"),
        "{e}"
    );
    let s = status_of(&p.a, "r");
    assert_eq!(s["require_point_in_time"], true, "{s}");
    assert_eq!(s["state"], "Degraded", "{s}");
    assert_eq!(s["last_cycle"]["id"], cycle, "no cycle shipped: {s}");
    consistency("crash-inconsistent");

    // As if the agent died between FIFREEZE and FITHAW (paused, so that no cycle of the
    // restarted agent freezes it again while the test looks).
    ok(replicate(&[
        "update",
        "r",
        "--pause",
        "--agent",
        &control(&p.a),
    ]));
    let mut p = p;
    p.a.child.kill().unwrap();
    p.a.child.wait().unwrap();
    let fsfreeze = |arg: &str| {
        std::process::Command::new("fsfreeze")
            .args([arg, &mount])
            .status()
            .unwrap()
            .success()
    };
    assert!(fsfreeze("--freeze"));
    p.a = Agent::spawn(p.a.config.clone(), p.a.port, p.a.metrics_port);
    status_of(&p.a, "r");
    assert!(
        fsfreeze("--freeze"),
        "the restarted agent thawed it, so it can be frozen again"
    );
    assert!(fsfreeze("--unfreeze"));

    // A freeze setting that is not a mount point is refused at create.
    refused(
        replicate(&[
            "create",
            "other",
            "--agent",
            &control(&p.b),
            "--volume",
            "vol",
            "--secondary",
            &p.a.url("vol"),
            "--freeze",
            p.root.to_str().unwrap(),
        ]),
        "",
    );

    // The freeze setting changes with update (a promoted secondary sets its own).
    let update = |extra: &[&str]| {
        let agent = control(&p.a);
        let mut args = vec!["update", "r", "--agent", &agent, "--json"];
        args.extend_from_slice(extra);
        replicate(&args)
    };
    let s: serde_json::Value = serde_json::from_str(&ok(update(&["--no-freeze"]))).unwrap();
    assert_eq!(s["freeze"], "", "{s}");
    refused(
        update(&["--freeze", p.root.to_str().unwrap()]),
        "not a mount point",
    );
    let s: serde_json::Value = serde_json::from_str(&ok(update(&["--freeze", &mount]))).unwrap();
    assert_eq!(s["freeze"], mount.as_str(), "{s}");
}

#[test]
fn forced_failover_then_failback_ships_the_union_of_both_sides_changes() {
    forced_failover_and_failback(pair(&[]));
}

#[test]
fn on_xfs_a_failback_reads_only_the_chunks_either_side_changed() {
    let fs = ScratchFs::new("xfs", 512 * MIB);
    let mut p = pair_in(fs.path(), &[]);
    p._fs = Some(fs);
    let (read, union_chunks) = forced_failover_and_failback(p);
    // Not even those chunks whole: the promoted side recorded its chunks' unit CVs in the
    // background, so of a changed chunk only the written units are read.
    assert!(
        read < union_chunks * 128 * 1024,
        "the new primary read {read} bytes for {union_chunks} chunks written on either side"
    );
}

/// Forced failover with writes on both sides, then failback; returns the bytes the new
/// primary read for the failback cycle and how many (128 KiB) chunks either side wrote.
fn forced_failover_and_failback(mut p: Pair) -> (u64, u64) {
    p.create("r");
    sync(&p.a, "r");
    assert!(p.same());

    // The primary's node is lost; the secondary is promoted by force and written.
    p.a.child.kill().unwrap();
    p.a.child.wait().unwrap();
    refused(
        replicate(&["promote", "r", "--agent", &control(&p.b)]),
        "not the final cycle of a demote",
    );
    ok(replicate(&[
        "promote",
        "r",
        "--force",
        "--agent",
        &control(&p.b),
    ]));
    let on_b = scribble(&p.b_img, 10, 60);
    wait_for(&p.b, "r", "Degraded: the old primary is unreachable", |s| {
        s["state"] == "Degraded"
    });

    // The old primary comes back having written too: it is fenced by the new epoch.
    let on_a = scribble(&p.a_img, 11, 40);
    p.a.kill_and_restart();
    wait_for(&p.a, "r", "Fenced", |s| s["state"] == "Fenced");
    let b_says = status_of(&p.b, "r");
    assert_eq!(b_says["state"], "Degraded");
    let err = sync_err(&p.b);
    assert!(err.contains("is the primary of relationship"), "{err}");

    // Both wrote after the split: resync refuses without --discard-local.
    refused(
        replicate(&["resync", "r", "--agent", &control(&p.a)]),
        "split brain",
    );
    assert_eq!(status_of(&p.a, "r")["state"], "SplitBrain");
    ok(replicate(&[
        "resync",
        "r",
        "--discard-local",
        "--agent",
        &control(&p.a),
    ]));
    let s = sync(&p.b, "r");
    assert!(p.same(), "failback made the old primary equal the new one");
    let union: BTreeSet<u64> = on_a.union(&on_b).copied().collect();
    assert_eq!(
        s["last_cycle"]["bytes_shipped"],
        union.len() as u64 * PAGE,
        "exactly the union of the pages either side changed"
    );
    assert_eq!(status_of(&p.a, "r")["role"], "secondary");
    let chunks: BTreeSet<u64> = union
        .iter()
        .map(|page| page * PAGE / (128 * 1024))
        .collect();
    (
        s["last_cycle"]["bytes_read"].as_u64().unwrap(),
        chunks.len() as u64,
    )
}

fn sync_err(agent: &Agent) -> String {
    let out = replicate(&["sync", "r", "--agent", &control(agent)]);
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_secondary_killed_at_any_step_of_apply_equals_one_cycle_after_restart() {
    for (step, committed) in [
        ("cycle-staged", false),
        ("cycle-committed", true),
        ("cycle-mid-apply", true),
        // After the primary was answered (or while it is): the volume's fsync is left.
        ("cycle-applied-unsynced", true),
    ] {
        let mut p = pair(&[("MOVER_FAILPOINT", step)]);
        // The first cycle fills a new image under a temp name: no journal, no failpoint.
        p.create("r");
        let before = blake3_of(&p.b_img, LEN);
        scribble(&p.a_img, 20, 200);
        let after = blake3_of(&p.a_img, LEN);
        let out = replicate(&["sync", "r", "--agent", &control(&p.a)]);
        // The last step dies after the cycle was committed and written: its answer may
        // or may not have reached the primary.
        assert!(
            !out.status.success() || step == "cycle-applied-unsynced",
            "{step}: the secondary died mid-cycle"
        );
        let exit = p.b.child.wait().unwrap();
        assert!(!exit.success(), "{step}: the secondary aborted there");
        // Restart without the failpoint: recovery applies or drops the journal.
        p.b = Agent::spawn(p.b.config.clone(), p.b.port, p.b.metrics_port);
        // Answered only once recovery is done (the port accepts connections before).
        let applied = status_of(&p.b, "r")["last_cycle"]["id"].as_u64().unwrap();
        let now = blake3_of(&p.b_img, LEN);
        let want = if committed { &after } else { &before };
        assert_eq!(
            &now, want,
            "{step}: the secondary equals cycle N or N-1, never a mix"
        );
        assert_eq!(applied, if committed { 2 } else { 1 }, "{step}");
        // The next cycle completes the replication.
        sync(&p.a, "r");
        assert!(p.same(), "{step}");
    }
}

#[test]
fn a_primary_killed_mid_cycle_completes_the_next_one() {
    let t = tempfile::tempdir().unwrap();
    let (da, db) = (t.path().join("a"), t.path().join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let (a_img, b_img) = (da.join("vol.img"), db.join("vol.img"));
    let len = 64 * MIB;
    make_image(&a_img, len, 5, &[(0, len)]);
    let mut a = Agent::start(&da, &[("vol", &a_img, false)], None);
    let b = Agent::start(&db, &[("vol", &b_img, false)], None);
    // 16 MiB/s: the first cycle takes about 4 s, and is killed in the middle.
    ok(replicate(&[
        "create",
        "r",
        "--agent",
        &control(&a),
        "--volume",
        "vol",
        "--secondary",
        &b.url("vol"),
        "--interval",
        "2s",
        "--bwlimit",
        "16M",
    ]));
    std::thread::sleep(Duration::from_millis(1500));
    assert!(status_of(&a, "r")["last_cycle"].is_null(), "still copying");
    a.kill_and_restart();
    wait_for(&a, "r", "a completed cycle after the restart", |s| {
        s["last_cycle"]["id"].as_u64() >= Some(1)
    });
    assert_eq!(blake3_of(&a_img, len), blake3_of(&b_img, len));
}

#[test]
fn bad_relationship_specs_are_refused_with_what_to_fix() {
    let p = pair(&[]);
    let create = |extra: &[&str]| {
        let mut args = vec!["create", "bad", "--agent"];
        let c = control(&p.a);
        args.push(&c);
        args.extend_from_slice(extra);
        replicate(&args)
    };
    let sec = p.b.url("vol");
    refused(
        create(&["--volume", "nope", "--secondary", &sec]),
        "not exported",
    );
    refused(
        create(&["--volume", "vol", "--secondary", &sec, "--interval", "0s"]),
        "too short",
    );
    let (dead_port, _held) = common::agent::refusing_port();
    let dead = format!("agent://127.0.0.1:{dead_port}/vol");
    refused(
        create(&["--volume", "vol", "--secondary", &dead]),
        "secondary unreachable",
    );
    refused(
        create(&["--volume", "vol", "--secondary", &p.b.url("missing")]),
        "not exported",
    );
    assert!(ok(replicate(&["list", "--agent", &control(&p.a)])).contains("no relationships"));

    // B's export becomes a secondary; it cannot also be a primary.
    p.create("r");
    refused(
        replicate(&[
            "create",
            "r2",
            "--agent",
            &control(&p.b),
            "--volume",
            "vol",
            "--secondary",
            &p.a.url("vol"),
        ]),
        "already the secondary of relationship \"r\"",
    );
    refused(p.create_command("r", &[]), "exists");
    refused(
        replicate(&["status", "ghost", "--agent", &control(&p.a)]),
        "no relationship \"ghost\"",
    );
    let out = ok(replicate(&["delete", "r", "--agent", &control(&p.a)]));
    assert!(out.contains("deleted"), "{out}");
}

#[test]
fn a_fill_from_a_replica_reads_the_cycle_held_for_it_while_later_cycles_are_applied() {
    let p = pair(&[]);
    p.create("r");
    let at_first_cycle = blake3_of(&p.b_img, LEN);
    let dc = p.root.join("c");
    std::fs::create_dir_all(&dc).unwrap();
    let (copy1, copy2) = (dc.join("copy1.img"), dc.join("copy2.img"));
    let c = Agent::start(
        &dc,
        &[("copy1", &copy1, false), ("copy2", &copy2, false)],
        None,
    );
    let fill = |export: &str, rate: &str| {
        let from = p.b.url("vol");
        ok(hydrate(&[
            "start",
            export,
            "--from",
            &from,
            "--replica-of",
            "r",
            "--bwlimit",
            rate,
            "--region-size",
            "64K",
            "--concurrency",
            "1",
            "--agent",
            &control(&c),
        ]));
    };
    // Slow enough (9 MiB of data at 512 KiB/s, in batches of 512 KiB) to be filling when
    // the next cycle lands.
    fill("copy1", "512K");
    let changed = scribble(&p.a_img, 9, 300);
    let s = sync(&p.a, "r");
    assert_eq!(
        s["last_cycle"]["bytes_shipped"],
        changed.len() as u64 * PAGE
    );
    assert!(p.same(), "the replica went on to the next cycle");
    assert_ne!(blake3_of(&p.b_img, LEN), at_first_cycle);
    let during = hydration_status(&c, "copy1");
    assert_eq!(during["phase"], "Hydrating", "still filling: {during}");
    ok(hydrate(&["wait", "copy1", "--agent", &control(&c)]));
    assert_eq!(
        blake3_of(&copy1, LEN),
        at_first_cycle,
        "the fill holds the cycle it began at, and nothing of the next one"
    );
    // Released with the fill: its undo file is gone.
    let holds = p.root.join("b/agent-state/holds");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::read_dir(&holds).map_or(0, |d| d.count()) > 0 {
        assert!(Instant::now() < deadline, "the hold outlived its fill");
        std::thread::sleep(Duration::from_millis(100));
    }

    // A replica promoted under a fill: the fill is refused from then on, and says why;
    // it never reads the promoted volume's writes.
    fill("copy2", "64K");
    std::thread::sleep(Duration::from_secs(1));
    ok(replicate(&[
        "promote",
        "r",
        "--force",
        "--agent",
        &control(&p.b),
    ]));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = hydration_status(&c, "copy2");
        let err = s["last_error"].as_str().unwrap_or_default();
        // Its reads through the ended hold, or a new session's hold, are refused.
        if err.contains("promoted") || err.contains("is the primary of relationship") {
            assert_eq!(s["phase"], "Degraded", "{s}");
            assert!(s["present"].as_u64() < s["regions"].as_u64(), "{s}");
            break;
        }
        assert!(Instant::now() < deadline, "the fill never failed: {s}");
        std::thread::sleep(Duration::from_millis(200));
    }
    ok(hydrate(&["cancel", "copy2", "--agent", &control(&c)]));
}

/// Regression (issue 52): `replicate run SRC DST` with a DST other than the saved
/// relationship's peer shipped its cycles to the old peer, said nothing and exited 0.
#[test]
fn replicate_run_follows_a_new_dst_and_says_so() {
    let t = tempfile::tempdir().unwrap();
    let (db, dc) = (t.path().join("b"), t.path().join("c"));
    std::fs::create_dir_all(&db).unwrap();
    std::fs::create_dir_all(&dc).unwrap();
    let (src, b_img, c_img) = (
        t.path().join("src.img"),
        db.join("rep.img"),
        dc.join("rep.img"),
    );
    make_image(&src, LEN, 41, &[(0, 4 * MIB), (12 * MIB, 2 * MIB)]);
    // Both export "rep": the relationship's default name, run/rep, is the same for both.
    let b = Agent::start(&db, &[("rep", &b_img, false)], None);
    let c = Agent::start(&dc, &[("rep", &c_img, false)], None);
    let state = t.path().join("state");
    let run = |to: &Agent| {
        let out = replicate(&[
            "run",
            src.to_str().unwrap(),
            &to.url("rep"),
            "--cycles",
            "2",
            "--interval",
            "1s",
            "--state-dir",
            state.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    run(&b);
    assert_eq!(blake3_of(&b_img, LEN), blake3_of(&src, LEN));
    scribble(&src, 42, 50);
    let said = run(&c);
    assert_eq!(
        blake3_of(&c_img, LEN),
        blake3_of(&src, LEN),
        "the cycles went to the new DST"
    );
    assert!(
        said.contains(&b.url("rep")) && said.contains("afresh"),
        "the change of secondary is said: {said}"
    );
    assert_ne!(
        blake3_of(&b_img, LEN),
        blake3_of(&src, LEN),
        "the old secondary kept its last cycle"
    );
}
