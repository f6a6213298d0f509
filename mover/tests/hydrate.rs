//! Copy-on-demand with real agents and real NBD clients (qemu-img, qemu-io, nbdinfo,
//! nbdcopy): an export served over the agent's NBD socket while it hydrates from a peer
//! agent or a snapshot; faults (kill -9 of either agent) on the way.

mod common;

use common::{
    MIB,
    agent::{Agent, hydrate, hydration_status},
    blake3_of, make_image,
};
use std::{
    fs::File,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "command failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn control(a: &Agent) -> String {
    format!("agent://127.0.0.1:{}", a.port)
}

/// The NBD URI of `export` on the agent whose test directory is `dir`.
fn uri(dir: &Path, export: &str) -> String {
    format!(
        "nbd+unix:///{export}?socket={}",
        dir.join("agent-state/nbd.sock").display()
    )
}

fn tool(cmd: &str, args: &[&str]) -> Output {
    Command::new(cmd).args(args).output().unwrap_or_else(|e| {
        panic!("{cmd} is needed by this test (apt-get install libnbd-bin nbdkit qemu-utils): {e}")
    })
}

fn qemu_io(uri: &str, cmds: &[&str]) -> Output {
    let mut args = vec!["-f", "raw"];
    for c in cmds {
        args.extend(["-c", c]);
    }
    args.push(uri);
    tool("qemu-io", &args)
}

/// qemu-io output succeeded and reported no error (qemu-io exits 0 on some failures).
fn io_ok(out: Output) -> String {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success() && !text.contains("failed") && !text.contains("error"),
        "qemu-io: {text}"
    );
    text
}

fn wait_until(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A source agent exporting a 64 MiB image (data, a 16 MiB hole, data) and a
/// destination agent exporting `dst` (not created yet).
struct Pair {
    dir: tempfile::TempDir,
    src_img: PathBuf,
    dst_img: PathBuf,
    src: Agent,
    dst: Agent,
}

const SIZE: u64 = 64 * MIB;
/// Where the source holds 4 KiB of 0x77 (unaligned, in the last region but two).
const PATTERN_AT: u64 = 61 * MIB + 333;

impl Pair {
    fn new() -> Pair {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        let src_img = a.join("src.img");
        make_image(&src_img, SIZE, 7, &[(0, 24 * MIB), (40 * MIB, 24 * MIB)]);
        // A known pattern far from the start, for reads ahead of the filler.
        write_at(&src_img, PATTERN_AT, &[0x77; 4096]);
        let dst_img = b.join("dst.img");
        let src = Agent::start(&a, &[("src", &src_img, true)], None);
        let dst = Agent::start(&b, &[("dst", &dst_img, false)], None);
        Pair {
            dir,
            src_img,
            dst_img,
            src,
            dst,
        }
    }

    fn b(&self) -> PathBuf {
        self.dir.path().join("b")
    }

    fn start(&self, extra: &[&str]) -> String {
        let from = self.src.url("src");
        let mut args = vec!["start", "dst", "--from", &from, "--agent"];
        let c = control(&self.dst);
        args.push(&c);
        args.extend(extra);
        ok(hydrate(&args))
    }

    fn wait(&self) {
        ok(hydrate(&["wait", "dst", "--agent", &control(&self.dst)]));
    }
}

/// `nbdinfo --map=mover:present`: (offset, length, flags) of every extent.
fn presence(uri: &str) -> Vec<(u64, u64, u32)> {
    let out = tool("nbdinfo", &["--map=mover:present", uri]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (
                f[0].parse().unwrap(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
            )
        })
        .collect()
}

/// The source's bytes with `writes` applied.
fn expected(src: &Path, writes: &[(u64, Vec<u8>)]) -> Vec<u8> {
    let mut v = std::fs::read(src).unwrap();
    for (off, data) in writes {
        v[*off as usize..*off as usize + data.len()].copy_from_slice(data);
    }
    v
}

#[test]
fn clients_read_and_write_a_volume_while_it_hydrates() {
    let p = Pair::new();
    // Slow enough that the clients below run before the filler is done.
    let out = p.start(&["--bwlimit", "4M", "--concurrency", "1"]);
    assert!(out.contains("nbd+unix:///dst"), "{out}");
    let u = uri(&p.b(), "dst");

    // Served at full size at once; the source's hole shows in the map without a fetch.
    let info = tool("qemu-img", &["info", "--output=json", "-f", "raw", &u]);
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    assert_eq!(info["virtual-size"], SIZE, "{info}");
    let map = String::from_utf8_lossy(&tool("nbdinfo", &["--map", &u]).stdout).into_owned();
    assert!(
        map.lines().any(|l| l.contains("hole")),
        "the 16 MiB hole of the source is reported: {map}"
    );
    // `mover:present` shows what is still to come (flag 1), the hole being here.
    let missing = presence(&u);
    assert!(missing.iter().any(|e| e.2 == 1), "{missing:?}");
    assert_eq!(missing.iter().map(|e| e.1).sum::<u64>(), SIZE);

    // A read far ahead of the filler (unaligned, in a region not fetched yet) returns
    // the source's bytes.
    io_ok(qemu_io(&u, &[&format!("read -P 0x77 {PATTERN_AT} 4096")]));

    // Writes: unaligned inside a region not fetched yet (fetch first), and one whole
    // region (no fetch).
    let mut writes = vec![];
    io_ok(qemu_io(&u, &["write -P 0xab 50001000 5000", "flush"]));
    writes.push((50_001_000u64, vec![0xab; 5000]));
    io_ok(qemu_io(&u, &["write -P 0xcd 58720256 1048576", "flush"]));
    writes.push((56 * MIB, vec![0xcd; MIB as usize]));
    io_ok(qemu_io(&u, &["read -P 0xab 50001000 5000"]));
    // Zeroing part of a region.
    io_ok(qemu_io(&u, &["write -z 1000000 70000"]));
    writes.push((1_000_000, vec![0; 70_000]));

    let s = hydration_status(&p.dst, "dst");
    assert!(s["phase"] == "Hydrating" || s["phase"] == "Complete", "{s}");
    assert!(s["foreground_fetches"].as_u64().unwrap() >= 1, "{s}");
    assert!(s["regions_written"].as_u64().unwrap() >= 1, "{s}");

    // While incomplete, peers cannot read it through the agent.
    let copy_out = common::agent::copy(
        &p.dir.path().join("state-c"),
        &[
            &p.dst.url("dst"),
            p.dir.path().join("peer.img").to_str().unwrap(),
        ],
    );
    if hydration_status(&p.dst, "dst")["phase"] == "Hydrating" {
        assert!(!copy_out.status.success());
        assert!(
            String::from_utf8_lossy(&copy_out.stderr).contains("hydrated"),
            "{}",
            String::from_utf8_lossy(&copy_out.stderr)
        );
    }

    // Hydrating, the missing part only shrinks; once complete nothing is missing.
    let later = presence(&u);
    let missing_bytes =
        |m: &[(u64, u64, u32)]| m.iter().filter(|e| e.2 == 1).map(|e| e.1).sum::<u64>();
    assert!(missing_bytes(&later) <= missing_bytes(&missing));
    p.wait();
    assert_eq!(missing_bytes(&presence(&u)), 0);
    let s = hydration_status(&p.dst, "dst");
    assert_eq!(s["phase"], "Complete");
    assert_eq!(s["present"], s["regions"]);
    assert_eq!(
        p.dst
            .metric("mover_hydration_regions_present{export=\"dst\"}"),
        p.dst.metric("mover_hydration_regions{export=\"dst\"}")
    );
    // The source's sessions (the filler's, the urgent reads') are ended, not leaked.
    wait_until("the source's sessions end", 10, || {
        p.src.metric("mover_agent_sessions_active") == 0
    });
    // The hole (16 MiB) and the region written whole were never fetched.
    assert!(
        s["bytes_fetched"].as_u64().unwrap() <= SIZE - 17 * MIB,
        "{s}"
    );
    let want = expected(&p.src_img, &writes);
    let have = std::fs::read(&p.dst_img).unwrap();
    assert!(
        have == want,
        "the hydrated image is the source plus the clients' writes"
    );
    // The same through NBD, in four connections, and qemu-img compare with a file.
    let copy = p.dir.path().join("out.img");
    let o = tool(
        "nbdcopy",
        &["--connections", "4", &u, copy.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(blake3_of(&copy, SIZE), blake3_of(&p.dst_img, SIZE));
    let o = tool(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            &u,
            copy.to_str().unwrap(),
        ],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stdout));
    // Complete: the record is dropped and peers may read it again.
    assert!(!p.b().join("agent-state/hydrate/dst.json").exists());
}

#[test]
fn bad_starts_are_refused_with_what_to_do() {
    let p = Pair::new();
    let c = control(&p.dst);
    // An existing image is not replaced without --overwrite.
    std::fs::write(&p.dst_img, b"precious").unwrap();
    let out = hydrate(&["start", "dst", "--from", &p.src.url("src"), "--agent", &c]);
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("--overwrite"), "{e}");
    assert_eq!(std::fs::read(&p.dst_img).unwrap(), b"precious");
    // Unknown export, unknown source volume.
    let out = hydrate(&["start", "nope", "--from", &p.src.url("src"), "--agent", &c]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not exported by this agent"));
    let out = hydrate(&[
        "start",
        "dst",
        "--from",
        &p.src.url("nosuch"),
        "--agent",
        &c,
        "--overwrite",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nosuch"));
    assert_eq!(std::fs::read(&p.dst_img).unwrap(), b"precious");
    // A read-only export is served read-only over NBD: a write is refused.
    let u = format!(
        "nbd+unix:///src?socket={}",
        p.dir.path().join("a/agent-state/nbd.sock").display()
    );
    let out = qemu_io(&u, &["write -P 1 0 4096"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("ermission") || text.contains("read-only") || text.contains("read only"),
        "{text}"
    );
    // And a plain export reads back as its file.
    let copy = p.dir.path().join("plain.img");
    let o = tool(
        "nbdcopy",
        &["--connections", "4", &u, copy.to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(blake3_of(&copy, SIZE), blake3_of(&p.src_img, SIZE));
}

#[test]
fn a_killed_destination_agent_resumes_and_keeps_flushed_writes() {
    let mut p = Pair::new();
    p.start(&["--bwlimit", "8M", "--concurrency", "1"]);
    let u = uri(&p.b(), "dst");
    wait_until("some regions", 30, || {
        hydration_status(&p.dst, "dst")["present"].as_u64().unwrap() >= 20
    });
    io_ok(qemu_io(&u, &["write -P 0x5a 45000000 12345", "flush"]));
    let before = hydration_status(&p.dst, "dst");
    p.dst.kill_and_restart();
    let after = hydration_status(&p.dst, "dst");
    // The bitmap reloads: what was committed is still present.
    assert!(
        after["present"].as_u64().unwrap() + 2 >= before["present"].as_u64().unwrap(),
        "before {before} after {after}"
    );
    io_ok(qemu_io(&u, &["read -P 0x5a 45000000 12345"]));
    p.wait();
    let s = hydration_status(&p.dst, "dst");
    // Fetched again at most what arrived after the last commit (1 s at 8 MiB/s, plus
    // one batch in flight).
    let total = before["bytes_fetched"].as_u64().unwrap() + s["bytes_fetched"].as_u64().unwrap();
    assert!(total <= 48 * MIB + 20 * MIB, "fetched {total} in all");
    let want = expected(&p.src_img, &[(45_000_000, vec![0x5a; 12345])]);
    assert!(std::fs::read(&p.dst_img).unwrap() == want);
}

#[test]
fn an_unreachable_source_gives_eio_for_missing_regions_only_then_the_fill_completes() {
    let mut p = Pair::new();
    p.start(&["--bwlimit", "8M", "--concurrency", "1"]);
    let u = uri(&p.b(), "dst");
    wait_until("the first regions", 30, || {
        hydration_status(&p.dst, "dst")["present"].as_u64().unwrap() >= 4
    });
    // The source agent dies.
    p.src.child.kill().unwrap();
    p.src.child.wait().unwrap();
    // A present region (the first) is served; a missing one (the last) is EIO.
    io_ok(qemu_io(&u, &["read 0 65536"]));
    let out = qemu_io(&u, &["read 66060288 65536"]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("Input/output error"), "{text}");
    wait_until("degraded", 30, || {
        hydration_status(&p.dst, "dst")["phase"] == "Degraded"
    });
    // The client's failed read is counted as a failure, not as a fetch.
    let s = hydration_status(&p.dst, "dst");
    let (fetched, failed) = (
        s["foreground_fetches"].as_u64().unwrap(),
        s["foreground_failures"].as_u64().unwrap(),
    );
    assert!(failed >= 1, "{s}");
    assert_eq!(fetched, 0, "nothing was fetched for the client: {s}");
    // It comes back on the same port: the fill completes.
    let fresh = Agent::spawn(p.src.config.clone(), p.src.port, p.src.metrics_port);
    std::mem::forget(std::mem::replace(&mut p.src, fresh));
    p.wait();
    assert_eq!(blake3_of(&p.dst_img, SIZE), blake3_of(&p.src_img, SIZE));
}

#[test]
fn hydrates_from_a_snapshot_in_s3() {
    use snapshots::testing::{ACCESS_KEY, S3Server, SECRET_KEY};
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"));
    server.create_bucket("dr-vols");
    let img = dir.path().join("vol.img");
    make_image(&img, 32 * MIB, 3, &[(0, 10 * MIB), (20 * MIB, 5 * MIB)]);
    write_at(&img, 21_000_000, &[0x77; 4096]);
    std::fs::write(dir.path().join("pw"), "pw-for-tests\n").unwrap();
    let cache = dir.path().join("cache");
    let env = [
        ("MOVER_S3_ENDPOINT", server.endpoint.as_str()),
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
        ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
        ("AWS_REGION", "us-east-1"),
        ("MOVER_PASSWORD", "pw-for-tests"),
        ("MOVER_CACHE_DIR", cache.to_str().unwrap()),
    ];
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(args)
            .envs(env)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        ok(out)
    };
    run(&["repo", "init", "s3://dr-vols/pg"]);
    let snap: serde_json::Value = serde_json::from_str(&run(&[
        "snapshot",
        "create",
        "--json",
        "s3://dr-vols/pg",
        img.to_str().unwrap(),
    ]))
    .unwrap();
    let id = snap["id"].as_str().unwrap().to_string();

    let b = dir.path().join("b");
    std::fs::create_dir_all(&b).unwrap();
    let dst_img = b.join("restored.img");
    let agent = Agent::start_with_env(&b, &[("vol", &dst_img, false)], &env);
    let c = control(&agent);
    let pw = dir.path().join("pw");
    ok(hydrate(&[
        "start",
        "vol",
        "--from-snapshot",
        "s3://dr-vols/pg",
        &id,
        "--password-file",
        pw.to_str().unwrap(),
        "--s3-endpoint",
        &server.endpoint,
        "--agent",
        &c,
    ]));
    // Readable at once, from the snapshot.
    let u = uri(&b, "vol");
    io_ok(qemu_io(&u, &["read -P 0x77 21000000 4096"]));
    ok(hydrate(&["wait", "vol", "--agent", &c]));
    assert_eq!(blake3_of(&dst_img, 32 * MIB), blake3_of(&img, 32 * MIB));
    let s = hydration_status(&agent, "vol");
    assert!(s["bytes_fetched"].as_u64().unwrap() <= 15 * MIB, "{s}");
}

fn write_at(path: &Path, off: u64, data: &[u8]) {
    File::options()
        .write(true)
        .open(path)
        .unwrap()
        .write_all_at(data, off)
        .unwrap();
}

/// nbdfuse serving an NBD export as a file, unmounted on drop.
struct Fuse {
    dir: PathBuf,
    child: std::process::Child,
}

impl Fuse {
    fn new(dir: &Path, uri: &str) -> Fuse {
        std::fs::create_dir_all(dir).unwrap();
        let pid = dir.with_extension("pid");
        let child = Command::new("nbdfuse")
            .args(["-P", pid.to_str().unwrap()])
            .arg(dir.join("disk"))
            .arg(uri)
            .spawn()
            .expect("nbdfuse runs (apt-get install libnbd-bin fuse3)");
        wait_until("nbdfuse to serve", 20, || pid.exists());
        Fuse {
            dir: dir.into(),
            child,
        }
    }
}

impl Drop for Fuse {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3")
            .arg("-u")
            .arg(&self.dir)
            .status();
        let _ = self.child.wait();
    }
}

#[test]
fn an_ext4_volume_is_mounted_and_used_while_it_hydrates() {
    use common::{LoopDevice, Mount};
    let dir = tempfile::tempdir_in("/var/tmp").unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(a.join("tree")).unwrap();
    std::fs::create_dir_all(&b).unwrap();
    // The source: an ext4 volume holding a text file and 20 MiB of random data.
    std::fs::write(a.join("tree/hello.txt"), "hello from the source\n").unwrap();
    make_image(&a.join("tree/big.bin"), 20 * MIB, 11, &[(0, 20 * MIB)]);
    let src_img = a.join("src.img");
    File::create(&src_img).unwrap().set_len(128 * MIB).unwrap();
    let mkfs = Command::new("mkfs.ext4")
        .args(["-q", "-d"])
        .arg(a.join("tree"))
        .arg(&src_img)
        .output()
        .unwrap();
    assert!(mkfs.status.success(), "{mkfs:?}");
    let big = blake3_of(&a.join("tree/big.bin"), 20 * MIB);

    let src = Agent::start(&a, &[("src", &src_img, true)], None);
    let dst_img = b.join("dst.img");
    let dst = Agent::start(&b, &[("vol", &dst_img, false)], None);
    let c = control(&dst);
    ok(hydrate(&[
        "start",
        "vol",
        "--from",
        &src.url("src"),
        "--agent",
        &c,
        "--bwlimit",
        "4M",
        "--concurrency",
        "1",
    ]));
    {
        // Mounted through nbdfuse and a loop device before the data is here.
        let fuse = Fuse::new(&b.join("fuse"), &uri(&b, "vol"));
        let dev = LoopDevice::attach(&fuse.dir.join("disk"));
        let m = Mount::new(&dev.path, &b.join("mnt"));
        assert!(
            hydration_status(&dst, "vol")["phase"] == "Hydrating",
            "the mount ran ahead of the filler"
        );
        assert_eq!(
            std::fs::read_to_string(m.dir.join("hello.txt")).unwrap(),
            "hello from the source\n"
        );
        assert_eq!(blake3_of(&m.dir.join("big.bin"), 20 * MIB), big);
        std::fs::write(m.dir.join("written.txt"), "written while hydrating\n").unwrap();
        let f = File::open(&m.dir).unwrap();
        rustix::fs::syncfs(&f).unwrap();
        drop(f);
        drop(m);
        drop(dev);
        drop(fuse);
    }
    ok(hydrate(&["wait", "vol", "--agent", &c]));
    let fsck = Command::new("e2fsck")
        .args(["-fn"])
        .arg(&dst_img)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "e2fsck -fn is clean: {}",
        String::from_utf8_lossy(&fsck.stdout)
    );
    let dev = LoopDevice::attach(&dst_img);
    let m = Mount::new(&dev.path, &b.join("mnt2"));
    assert_eq!(
        std::fs::read_to_string(m.dir.join("written.txt")).unwrap(),
        "written while hydrating\n"
    );
    assert_eq!(blake3_of(&m.dir.join("big.bin"), 20 * MIB), big);
}

#[test]
fn nbdcopy_into_a_hydrating_export_needs_no_fetch_of_what_it_overwrites() {
    let p = Pair::new();
    // 64 KiB regions: nbdcopy's 256 KiB requests cover them whole.
    p.start(&[
        "--bwlimit",
        "1M",
        "--concurrency",
        "1",
        "--region-size",
        "64K",
    ]);
    let u = uri(&p.b(), "dst");
    let local = p.dir.path().join("local.img");
    make_image(&local, SIZE, 99, &[(0, 30 * MIB), (34 * MIB, 30 * MIB)]);
    let o = tool(
        "nbdcopy",
        &["--connections", "4", local.to_str().unwrap(), &u],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    p.wait();
    assert_eq!(blake3_of(&p.dst_img, SIZE), blake3_of(&local, SIZE));
    let s = hydration_status(&p.dst, "dst");
    // Only what the filler fetched before nbdcopy overwrote it (1 MiB/s).
    assert!(
        s["bytes_fetched"].as_u64().unwrap() < 8 * MIB,
        "the regions nbdcopy wrote whole were not fetched: {s}"
    );
    // Every region is accounted for: written whole by nbdcopy, fetched by the filler
    // before nbdcopy got there, one of the source's 256 hole regions the filler may mark
    // present first (no fetch: how many depends on how soon nbdcopy starts, on a loaded
    // machine late), or one of the 64 of local.img's hole (zeroed, not written).
    let written = s["regions_written"].as_u64().unwrap();
    let fetched = s["bytes_fetched"].as_u64().unwrap() / (64 << 10);
    assert!(written + fetched >= 1024 - 256 - 64, "{s}");
}

#[test]
fn a_cancelled_hydration_stops_serving_and_a_new_start_resumes_it() {
    let p = Pair::new();
    p.start(&["--bwlimit", "4M", "--concurrency", "1"]);
    let u = uri(&p.b(), "dst");
    // A write of a whole region before the cancel: it must survive the restart.
    let region_57 = 57 * MIB;
    io_ok(qemu_io(
        &u,
        &[&format!("write -P 0xe1 {region_57} 1048576"), "flush"],
    ));
    ok(hydrate(&["cancel", "dst", "--agent", &control(&p.dst)]));
    let s = hydration_status(&p.dst, "dst");
    assert_eq!(s["phase"], "Cancelled", "{s}");
    let before = s["present"].as_u64().unwrap();
    assert!(before < s["regions"].as_u64().unwrap(), "{s}");
    // Not served while cancelled: a client gets an error, not stale zeros.
    let out = qemu_io(&u, &[&format!("read -P 0x77 {PATTERN_AT} 4096")]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success() || text.contains("failed") || text.contains("error"),
        "a cancelled export was served: {text}"
    );
    // Another source is refused; the same one resumes where it stopped.
    let other = hydrate(&[
        "start",
        "dst",
        "--from",
        &p.src.url("elsewhere"),
        "--agent",
        &control(&p.dst),
    ]);
    assert_eq!(other.status.code(), Some(2), "{other:?}");
    assert!(
        String::from_utf8_lossy(&other.stderr).contains("another source"),
        "{other:?}"
    );
    p.start(&[]);
    assert!(hydration_status(&p.dst, "dst")["present"].as_u64().unwrap() >= before);
    p.wait();
    let want = expected(&p.src_img, &[(region_57, vec![0xe1; MIB as usize])]);
    assert!(
        std::fs::read(&p.dst_img).unwrap() == want,
        "the resumed hydration is the source plus the write made before the cancel"
    );
    // A cancel that comes after the fill completed (as a late one races it) leaves the
    // volume complete, and a start again from the same source says so: neither is
    // refused, nor does it touch the volume.
    ok(hydrate(&["cancel", "dst", "--agent", &control(&p.dst)]));
    assert_eq!(hydration_status(&p.dst, "dst")["phase"], "Complete");
    p.start(&[]);
    assert_eq!(hydration_status(&p.dst, "dst")["phase"], "Complete");
    assert!(
        std::fs::read(&p.dst_img).unwrap() == want,
        "a start after completion changed the volume"
    );
    // With --overwrite it starts over: the source's data again, the write gone.
    p.start(&["--overwrite"]);
    p.wait();
    assert_eq!(hydration_status(&p.dst, "dst")["phase"], "Complete");
    assert_eq!(
        blake3_of(&p.dst_img, SIZE),
        blake3_of(&p.src_img, SIZE),
        "a start with --overwrite after completion did not replace the volume"
    );
}

#[test]
fn nbd_lists_only_what_opens_and_shows_no_host_paths() {
    let p = Pair::new();
    let list = |dir: &Path| {
        let out = tool("nbdinfo", &["--json", "--list", &uri(dir, "")]);
        assert!(
            out.status.success(),
            "nbdinfo --list: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["exports"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let name = e["export-name"].as_str().unwrap().to_string();
                (name, e["description"].as_str().unwrap_or("").to_string())
            })
            .collect::<Vec<_>>()
    };
    // The destination's image does not exist before its hydration: not listed, and the
    // listing still succeeds.
    assert_eq!(list(&p.b()), []);
    let src = list(&p.dir.path().join("a"));
    assert_eq!(src, [("src".to_string(), "block volume".to_string())]);
    p.start(&["--bwlimit", "1M", "--concurrency", "1"]);
    let dst = list(&p.b());
    assert_eq!(dst.len(), 1, "{dst:?}");
    assert!(dst[0].1.starts_with("hydrating from agent://"), "{dst:?}");
    for (_, description) in src.iter().chain(&dst) {
        assert!(
            !description.contains(p.dir.path().to_str().unwrap()),
            "{description}"
        );
    }
}
