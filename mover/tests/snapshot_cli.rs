//! The `mover repo` / `mover snapshot` commands as a user runs them: kill -9 during a
//! snapshot, clear errors for bad input, and the whole command set on S3.

mod common;

use common::{LoopDevice, Mount};
use rand::{Rng, SeedableRng, rngs::StdRng};
use snapshots::testing::{ACCESS_KEY, S3Server, SECRET_KEY};
use std::{
    fs,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    time::{Duration, Instant},
};

const MIB: u64 = 1 << 20;

fn mover() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mover"));
    c.env("MOVER_PASSWORD", "pw-for-tests")
        .env("RUST_LOG", "warn")
        .env(
            "MOVER_CACHE_DIR",
            std::env::temp_dir().join("mover-snapshot-cli-test-cache"),
        )
        .env_remove("MOVER_S3_ENDPOINT")
        .env_remove("MOVER_KEY_FILE")
        .env_remove("MOVER_PASSWORD_FILE");
    c
}

fn run(c: &mut Command) -> Output {
    c.output().expect("run mover")
}

fn ok(c: &mut Command) -> String {
    let o = run(c);
    assert!(
        o.status.success(),
        "{:?} failed: {}\n{}",
        c,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// Runs, expects failure with `code`, returns stderr.
fn fails(c: &mut Command, code: i32) -> String {
    let o = run(c);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(code), "{c:?}: {err}");
    err
}

fn random_image(path: &Path, mib: u64, seed: u64) {
    let f = fs::File::create(path).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut buf = vec![0u8; 4 * MIB as usize];
    for i in 0..mib / 4 {
        rng.fill(&mut buf[..]);
        f.write_all_at(&buf, i * 4 * MIB).unwrap();
    }
}

fn b3(path: &Path) -> blake3::Hash {
    blake3::hash(&fs::read(path).unwrap())
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("{e}: {s}"))
}

fn packs(repo: &Path) -> Vec<PathBuf> {
    let Ok(dirs) = fs::read_dir(repo.join("packs")) else {
        return vec![];
    };
    dirs.flat_map(|d| fs::read_dir(d.unwrap().path()).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| {
            !p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(".tmp.")
        })
        .collect()
}

#[test]
fn kill_9_during_create_leaves_a_consistent_repository_and_uploads_are_reused() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let img = dir.path().join("vol.img");
    random_image(&img, 160, 11);
    ok(mover().args(["repo", "init"]).arg(&repo));

    let mut child = mover()
        .args(["snapshot", "create"])
        .arg(&repo)
        .arg(&img)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while packs(&repo).len() < 2 {
        assert!(Instant::now() < deadline, "no packs were uploaded");
        assert!(
            child.try_wait().unwrap().is_none(),
            "create finished before it could be killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let uploaded = packs(&repo).len();
    assert!(uploaded >= 2);

    // No snapshot, nothing damaged.
    let list = json(&ok(mover().args(["snapshot", "list", "--json"]).arg(&repo)));
    assert_eq!(list.as_array().unwrap().len(), 0);
    let out = ok(mover()
        .args(["snapshot", "verify", "--read-data"])
        .arg(&repo));
    assert!(out.contains("no problems"), "{out}");

    // The next run reuses the uploaded packs: it stores less than the volume.
    let snap = json(&ok(mover()
        .args(["snapshot", "create", "--json"])
        .arg(&repo)
        .arg(&img)));
    let new_chunks = snap["summary"]["new_chunks"].as_u64().unwrap();
    assert!(
        new_chunks <= 160 - 15 * (uploaded as u64 - 1),
        "{new_chunks} chunks uploaded again after {uploaded} packs were stored"
    );
    let id = snap["id"].as_str().unwrap();
    let restored = dir.path().join("restored.img");
    ok(mover()
        .args(["snapshot", "restore"])
        .arg(&repo)
        .arg(id)
        .arg(&restored));
    assert_eq!(b3(&restored), b3(&img));
    let out = ok(mover()
        .args(["snapshot", "verify", "--read-data"])
        .arg(&repo));
    assert!(out.contains("no problems"), "{out}");
}

#[test]
fn bad_input_gives_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let img = dir.path().join("vol.img");
    random_image(&img, 4, 12);

    // No repository yet.
    let e = fails(mover().args(["snapshot", "list"]).arg(&repo), 2);
    assert!(
        e.contains("no repository here") && e.contains("mover repo init"),
        "{e}"
    );
    ok(mover().args(["repo", "init"]).arg(&repo));
    let e = fails(mover().args(["repo", "init"]).arg(&repo), 2);
    assert!(e.contains("already exists"), "{e}");

    // Wrong or missing password.
    let e = fails(
        mover()
            .env("MOVER_PASSWORD", "nope")
            .args(["snapshot", "list"])
            .arg(&repo),
        2,
    );
    assert!(e.contains("wrong password"), "{e}");
    let e = fails(
        mover()
            .env_remove("MOVER_PASSWORD")
            .args(["snapshot", "list"])
            .arg(&repo),
        2,
    );
    assert!(e.contains("MOVER_PASSWORD"), "{e}");

    // Unknown snapshot id.
    let e = fails(
        mover()
            .args(["snapshot", "restore"])
            .arg(&repo)
            .arg("abcdef12")
            .arg(dir.path().join("x.img")),
        2,
    );
    assert!(e.contains("no snapshot abcdef12"), "{e}");

    // A raw key file works instead of a password; a short one is refused.
    let key = dir.path().join("key");
    fs::write(&key, [7u8; 32]).unwrap();
    let krepo = dir.path().join("krepo");
    ok(mover()
        .env_remove("MOVER_PASSWORD")
        .args(["repo", "init"])
        .arg(&krepo)
        .arg("--key-file")
        .arg(&key));
    ok(mover()
        .env_remove("MOVER_PASSWORD")
        .args(["snapshot", "create"])
        .arg(&krepo)
        .arg(&img)
        .arg("--key-file")
        .arg(&key));
    let e = fails(mover().args(["snapshot", "list"]).arg(&krepo), 2);
    assert!(e.contains("wrong password"), "{e}");
    fs::write(&key, [7u8; 8]).unwrap();
    let e = fails(
        mover()
            .args(["snapshot", "list"])
            .arg(&krepo)
            .arg("--key-file")
            .arg(&key),
        2,
    );
    assert!(e.contains("at least 32"), "{e}");

    // forget without a rule is refused.
    let e = fails(mover().args(["snapshot", "forget"]).arg(&repo), 2);
    assert!(e.contains("--keep"), "{e}");
}

#[test]
fn s3_commands_end_to_end_and_s3_errors() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"));
    server.create_bucket("dr-bucket");
    let s3 = |c: &mut Command| {
        c.env("MOVER_S3_ENDPOINT", &server.endpoint)
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .env("AWS_REGION", "us-east-1")
            .env("MOVER_RETRY_MAX_SECS", "3");
    };
    let img = dir.path().join("vol.img");
    random_image(&img, 24, 13);
    let repo = "s3://dr-bucket/cluster-a";
    let mut c = mover();
    s3(&mut c);
    ok(c.args(["repo", "init", repo]));
    let mut c = mover();
    s3(&mut c);
    let a = json(&ok(c
        .args(["snapshot", "create", "--json", "--tag", "first", repo])
        .arg(&img)));
    // Change 2 MiB and snapshot again.
    let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
    f.write_all_at(&[1u8; 1 << 20], 5 * MIB).unwrap();
    f.write_all_at(&[2u8; 1 << 20], 6 * MIB).unwrap();
    let mut c = mover();
    s3(&mut c);
    let b = json(&ok(c
        .args(["snapshot", "create", "--json", repo])
        .arg(&img)));
    assert_eq!(b["summary"]["new_chunks"], 2);
    let mut c = mover();
    s3(&mut c);
    let d = json(&ok(c
        .args(["snapshot", "diff", "--json", repo])
        .arg(a["id"].as_str().unwrap())
        .arg(b["id"].as_str().unwrap())));
    assert_eq!(d["ranges"], serde_json::json!([[5 * MIB, 7 * MIB]]));
    let mut c = mover();
    s3(&mut c);
    let out = dir.path().join("out.img");
    ok(c.args(["snapshot", "restore", repo, "latest"]).arg(&out));
    assert_eq!(b3(&out), b3(&img));
    let mut c = mover();
    s3(&mut c);
    let list = ok(c.args(["snapshot", "list", repo]));
    assert!(
        list.contains("first") && list.contains("2 snapshot(s)"),
        "{list}"
    );
    let mut c = mover();
    s3(&mut c);
    ok(c.args(["snapshot", "forget", "--keep-last", "1", repo]));
    let mut c = mover();
    s3(&mut c);
    let p = json(&ok(
        c.args(["snapshot", "prune", "--json", "--grace", "0", repo])
    ));
    assert!(p["deleted_packs"].as_u64().unwrap() >= 1, "{p}");
    let mut c = mover();
    s3(&mut c);
    assert!(ok(c.args(["snapshot", "verify", "--read-data", repo])).contains("no problems"));

    // Missing bucket.
    let mut c = mover();
    s3(&mut c);
    let e = fails(c.args(["snapshot", "list", "s3://nosuchbucket/x"]), 2);
    assert!(e.contains("bucket nosuchbucket does not exist"), "{e}");
    // Wrong endpoint: retried for the bounded time, then a clear error.
    let mut c = mover();
    s3(&mut c);
    let started = Instant::now();
    let e = fails(
        c.args([
            "snapshot",
            "list",
            repo,
            "--s3-endpoint",
            "http://127.0.0.1:9",
        ]),
        1,
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(
        e.contains("cannot reach http://127.0.0.1:9") && e.contains("gave up after"),
        "{e}"
    );
}

#[test]
fn block_devices_snapshot_and_delta_restore_and_a_mounted_destination_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    ok(mover().args(["repo", "init"]).arg(&repo));
    let (src_img, dst_img) = (dir.path().join("src.img"), dir.path().join("dst.img"));
    random_image(&src_img, 32, 21);
    fs::File::create(&dst_img)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    let (src, dst) = (LoopDevice::attach(&src_img), LoopDevice::attach(&dst_img));
    let dev_b3 = |p: &Path| blake3::hash(&fs::read(p).unwrap());

    ok(mover()
        .args(["snapshot", "create", "--name", "vol"])
        .arg(&repo)
        .arg(&src.path));
    let r = json(&ok(mover()
        .args(["snapshot", "restore", "--json"])
        .arg(&repo)
        .arg("latest")
        .arg(&dst.path)));
    assert_eq!(r["chunks_fetched"], 32);
    assert_eq!(dev_b3(&dst.path), dev_b3(&src.path));

    // One chunk changes on the source device: the next snapshot uploads it alone, and
    // the delta restore onto the device fetches and writes it alone.
    let f = fs::OpenOptions::new().write(true).open(&src.path).unwrap();
    f.write_all_at(&[0xa5; 4096], 7 * MIB + 4096).unwrap();
    f.sync_all().unwrap();
    let s = json(&ok(mover()
        .args(["snapshot", "create", "--json", "--name", "vol"])
        .arg(&repo)
        .arg(&src.path)));
    assert_eq!(s["summary"]["new_chunks"], 1);
    let r = json(&ok(mover()
        .args(["snapshot", "restore", "--json"])
        .arg(&repo)
        .arg("latest")
        .arg(&dst.path)));
    assert_eq!(r["chunks_fetched"], 1);
    assert_eq!(r["chunks_unchanged"], 31);
    assert_eq!(dev_b3(&dst.path), dev_b3(&src.path));

    // A mounted destination device is refused, and nothing is written to it.
    let fs_img = dir.path().join("fs.img");
    fs::File::create(&fs_img)
        .unwrap()
        .set_len(32 * MIB)
        .unwrap();
    let mkfs = Command::new("mkfs.ext4")
        .args(["-q", "-F"])
        .arg(&fs_img)
        .status()
        .unwrap();
    assert!(mkfs.success());
    let fs_dev = LoopDevice::attach(&fs_img);
    let mount = Mount::new(&fs_dev.path, &dir.path().join("mnt"));
    let e = fails(
        mover()
            .args(["snapshot", "restore"])
            .arg(&repo)
            .arg("latest")
            .arg(&fs_dev.path),
        2,
    );
    assert!(e.contains("is mounted at"), "{e}");
    drop(mount);
    // The refusal comes from opening the device exclusively, before any write: the file
    // system is still intact (mounting it changed its superblock, so no hash compare).
    let fsck = Command::new("e2fsck")
        .args(["-n", "-f"])
        .arg(&fs_img)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "{}",
        String::from_utf8_lossy(&fsck.stdout)
    );
}
