//! Snapshots of file trees as a user runs them: every kind of entry restored exactly,
//! incremental snapshots that read only what changed, restore onto an older copy with
//! --delete, single paths, ls and diff, damage named by path, kill -9, files changing
//! while read, and a tree on S3.

mod common;

use common::tree::{assert_same_tree, edit_every_kind, make_tree, random};
use snapshots::{
    Credentials, LocalBackend, Repository, pack_key,
    testing::{ACCESS_KEY, S3Server, SECRET_KEY},
};
use std::{
    fs,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

const PASSWORD: &str = "pw-for-tree-tests";

fn mover() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_mover"));
    c.env("MOVER_PASSWORD", PASSWORD)
        .env("RUST_LOG", "warn")
        .env(
            "MOVER_CACHE_DIR",
            std::env::temp_dir().join("mover-snapshot-tree-test-cache"),
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

/// Runs, expects exit status `code`, returns (stdout, stderr).
fn fails(c: &mut Command, code: i32) -> (String, String) {
    let o = run(c);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    );
    assert_eq!(o.status.code(), Some(code), "{c:?}: {out}\n{err}");
    (out, err)
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s.trim()).unwrap_or_else(|e| panic!("{e}: {s}"))
}

fn create(repo: &Path, dir: &Path) -> serde_json::Value {
    json(&ok(mover()
        .args(["snapshot", "create", "--json"])
        .arg(repo)
        .arg(dir)))
}

/// `mover snapshot restore REPO latest DST`, which must succeed.
fn restore_latest(repo: &Path, dst: &Path) {
    ok(mover()
        .args(["snapshot", "restore"])
        .arg(repo)
        .arg("latest")
        .arg(dst));
}

fn packs(repo: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(dirs) = fs::read_dir(repo.join("packs")) {
        for d in dirs.flatten() {
            for p in fs::read_dir(d.path()).unwrap().flatten() {
                out.push(p.path());
            }
        }
    }
    out
}

#[test]
fn every_kind_of_entry_round_trips_and_increments_read_only_what_changed() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, src) = (dir.path().join("repo"), dir.path().join("src"));
    make_tree(&src, 7);
    ok(mover().args(["repo", "init"]).arg(&repo));

    let first = create(&repo, &src);
    assert_eq!(first["kind"], "tree");
    let files = first["files"].as_u64().unwrap();
    assert!(files >= 200, "{first}");
    assert_eq!(
        first["summary"]["files_read"].as_u64().unwrap(),
        files - 2,
        "hard links are read once: {first}"
    );
    let out = dir.path().join("out");
    restore_latest(&repo, &out);
    assert_same_tree(&src, &out);

    // Nothing changed: nothing read, nothing stored.
    let again = create(&repo, &src);
    assert_eq!(again["summary"]["files_read"], 0, "{again}");
    assert_eq!(again["summary"]["new_chunks"], 0, "{again}");
    assert_eq!(again["parent"], first["id"]);

    // Edits of every kind: only the files whose inode, ctime, size or mtime moved are
    // read (f3 rewritten, f4 chmod-ed, f5's xattr, docs/new.txt).
    edit_every_kind(&src);
    let third = create(&repo, &src);
    let read = third["summary"]["files_read"].as_u64().unwrap();
    assert!((1..=4).contains(&read), "{read} files read: {third}");
    assert!(
        third["summary"]["new_bytes"].as_u64().unwrap() < 64 << 10,
        "{third}"
    );

    // diff names the edits by path.
    let diff = ok(mover()
        .args(["snapshot", "diff"])
        .arg(&repo)
        .arg(first["id"].as_str().unwrap())
        .arg(third["id"].as_str().unwrap()));
    for line in [
        "M small/03/f3.txt",
        "m small/04/f4.txt",
        "m small/05/f5.txt",
        "- small/06/f6.txt",
        "- small/07",
        "- small/07/f7.txt",
        "+ docs/new.txt",
        "T small/08/f8.txt",
        "T empty",
    ] {
        assert!(diff.lines().any(|l| l == line), "no {line:?} in:\n{diff}");
    }
    assert!(!diff.contains("docs/big.bin"), "{diff}");

    // Restore onto the older copy: only what differs is written, --delete removes the rest.
    let restored = json(&ok(mover()
        .args(["snapshot", "restore", "--json", "--delete"])
        .arg(&repo)
        .arg(third["id"].as_str().unwrap())
        .arg(&out)));
    assert_same_tree(&src, &out);
    assert!(
        restored["entries_unchanged"].as_u64().unwrap() > 150,
        "{restored}"
    );
    assert!(
        restored["bytes_written"].as_u64().unwrap() < 64 << 10,
        "{restored}"
    );
    assert!(
        restored["entries_deleted"].as_u64().unwrap() >= 20,
        "{restored}"
    );

    // A single path, kept below DST.
    let part = dir.path().join("part");
    ok(mover()
        .args(["snapshot", "restore", "--include", "docs/deep"])
        .arg(&repo)
        .arg("latest")
        .arg(&part));
    assert_eq!(fs::read(part.join("docs/deep/er/note")).unwrap(), b"hello");
    assert!(!part.join("docs/big.bin").exists() && !part.join("small").exists());
    let (_, err) = fails(
        mover()
            .args(["snapshot", "restore", "--include", "no/such"])
            .arg(&repo)
            .arg("latest")
            .arg(dir.path().join("none")),
        2,
    );
    assert!(err.contains("has no such path"), "{err}");
    assert!(!dir.path().join("none").exists());

    // ls: a path and everything below it.
    let ls = ok(mover()
        .args(["snapshot", "ls"])
        .arg(&repo)
        .arg("latest")
        .arg("docs"));
    let paths: Vec<&str> = ls.lines().map(|l| l.rsplit("  ").next().unwrap()).collect();
    assert!(paths.contains(&"docs/deep/er/note"), "{ls}");
    assert!(paths.contains(&"docs/rel-link -> ../docs/big.bin"), "{ls}");
    assert!(!paths.iter().any(|p| p.starts_with("small")), "{ls}");

    // Forget the first two (the second and third taken within a second, they are ordered
    // to the nanosecond) and prune at once: the latest still restores whole.
    ok(mover()
        .args(["snapshot", "forget", "--keep-last", "1"])
        .arg(&repo));
    ok(mover()
        .args(["snapshot", "prune", "--grace", "0"])
        .arg(&repo));
    let fresh = dir.path().join("fresh");
    restore_latest(&repo, &fresh);
    assert_same_tree(&src, &fresh);
    let out = ok(mover()
        .args(["snapshot", "verify", "--read-data"])
        .arg(&repo));
    assert!(out.contains("no problems"), "{out}");
}

/// Flips a byte inside the stored blob `id` of the repository at `repo`.
fn damage_blob(repo: &Path, id: &chunker::ChunkId) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let r = rt
        .block_on(Repository::open(
            Arc::new(LocalBackend::new(repo)),
            &Credentials::Password(PASSWORD.into()),
        ))
        .unwrap();
    let index = rt.block_on(r.load_index()).unwrap();
    let loc = index.get(id).unwrap();
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(repo.join(pack_key(&loc.pack)))
        .unwrap();
    let at = loc.offset as u64 + loc.len as u64 / 2;
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x40], at).unwrap();
}

/// The node at `path` of the newest snapshot.
fn node_at(repo: &Path, path: &str) -> snapshots::TreeNode {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let r = Repository::open(
            Arc::new(LocalBackend::new(repo)),
            &Credentials::Password(PASSWORD.into()),
        )
        .await
        .unwrap();
        let index = r.load_index().await.unwrap();
        let snap = r.find_snapshot("latest").await.unwrap();
        r.tree_node_at(&index, &snap, path.as_bytes())
            .await
            .unwrap()
            .unwrap()
    })
}

#[test]
fn damage_is_named_by_path_and_restore_restores_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, src) = (dir.path().join("repo"), dir.path().join("src"));
    fs::create_dir_all(src.join("a")).unwrap();
    fs::create_dir_all(src.join("b/inner")).unwrap();
    fs::write(src.join("a/hurt.bin"), random(1, 300_000)).unwrap();
    fs::write(src.join("a/fine.bin"), random(2, 200_000)).unwrap();
    fs::write(src.join("b/inner/lost.txt"), b"under a damaged directory").unwrap();
    fs::write(src.join("top.txt"), b"top").unwrap();
    ok(mover().args(["repo", "init"]).arg(&repo));
    let snap = create(&repo, &src);
    let id = snap["id"].as_str().unwrap();

    let hurt = node_at(&repo, "a/hurt.bin");
    damage_blob(&repo, &hurt.chunks().next().unwrap());
    let inner = node_at(&repo, "b/inner");
    damage_blob(&repo, &inner.subtree.unwrap());

    let (out, _) = fails(
        mover()
            .args(["snapshot", "verify", "--read-data"])
            .arg(&repo),
        3,
    );
    let damaged: Vec<&str> = out.lines().filter(|l| l.starts_with("damaged:")).collect();
    assert_eq!(damaged.len(), 2, "{out}");
    assert!(
        damaged[0].contains(&id[..8]) && damaged[0].contains("a/hurt.bin: chunk"),
        "{out}"
    );
    assert!(
        damaged[1].contains("b/inner: directory unreadable"),
        "{out}"
    );

    // Restore into an existing directory: the damaged paths fail, the rest is there.
    let dst = dir.path().join("dst");
    fs::create_dir(&dst).unwrap();
    let (_, err) = fails(
        mover()
            .args(["snapshot", "restore"])
            .arg(&repo)
            .arg(id)
            .arg(&dst),
        1,
    );
    assert!(err.contains("could not be copied"), "{err}");
    assert!(err.contains("hurt.bin"), "{err}");
    assert!(!dst.join("a/hurt.bin").exists());
    assert!(!dst.join("b/inner/lost.txt").exists());
    assert_eq!(
        fs::read(dst.join("a/fine.bin")).unwrap(),
        random(2, 200_000)
    );
    assert_eq!(fs::read(dst.join("top.txt")).unwrap(), b"top");
}

/// Large files go to a new DST with direct writes, window by window, with the
/// unaligned end of each window carried into the next: odd sizes, data after holes at
/// odd places and trailing holes must all come back byte for byte, and holes as holes.
#[test]
fn large_files_of_odd_sizes_and_holes_restore_byte_for_byte() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, src) = (dir.path().join("repo"), dir.path().join("src"));
    fs::create_dir_all(&src).unwrap();
    const MIB: u64 = 1 << 20;
    // Three 16 MiB windows and an odd tail.
    fs::write(src.join("odd.bin"), random(7, (37 * MIB + 12_345) as usize)).unwrap();
    // Data, a hole, data from an odd offset, a trailing hole.
    let holey = fs::File::create(src.join("holey.img")).unwrap();
    holey.set_len(30 * MIB).unwrap();
    holey
        .write_all_at(&random(8, (5 * MIB) as usize), 0)
        .unwrap();
    holey
        .write_all_at(&random(9, (3 * MIB + 1) as usize), 13 * MIB + 777)
        .unwrap();
    drop(holey);
    // Just above the size that goes direct, and just below.
    fs::write(src.join("just-above"), random(10, (MIB + 1) as usize)).unwrap();
    fs::write(src.join("just-below"), random(11, (MIB - 1) as usize)).unwrap();
    ok(mover().args(["repo", "init"]).arg(&repo));
    create(&repo, &src);
    let out = dir.path().join("out");
    restore_latest(&repo, &out);
    assert_same_tree(&src, &out);
    for name in ["odd.bin", "holey.img", "just-above", "just-below"] {
        assert!(
            fs::read(src.join(name)).unwrap() == fs::read(out.join(name)).unwrap(),
            "{name} differs"
        );
    }
    use std::os::unix::fs::MetadataExt;
    let blocks = fs::metadata(out.join("holey.img")).unwrap().blocks() * 512;
    assert!(
        blocks < 10 * MIB,
        "holey.img restored with {blocks} bytes allocated: its holes were written"
    );
}

#[test]
fn kill_9_mid_snapshot_leaves_no_snapshot_and_the_rerun_adopts_the_upload() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, src) = (dir.path().join("repo"), dir.path().join("src"));
    for i in 0..48u64 {
        let d = src.join(format!("d{}", i % 6));
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join(format!("f{i}")), random(100 + i, 2 << 20)).unwrap();
    }
    ok(mover().args(["repo", "init"]).arg(&repo));
    let mut child = mover()
        .args(["snapshot", "create", "--uploads", "1"])
        .arg(&repo)
        .arg(&src)
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
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let uploaded = packs(&repo).len() as u64;
    let list = json(&ok(mover().args(["snapshot", "list", "--json"]).arg(&repo)));
    assert_eq!(list.as_array().unwrap().len(), 0);

    let snap = create(&repo, &src);
    let new = snap["summary"]["new_bytes"].as_u64().unwrap();
    assert!(
        new <= (96 << 20) - (uploaded - 1) * (14 << 20),
        "{new} bytes uploaded again after {uploaded} packs were stored"
    );
    let out = dir.path().join("out");
    restore_latest(&repo, &out);
    assert_same_tree(&src, &out);
}

#[test]
fn a_file_changing_while_read_is_stored_as_read_and_read_again_next_time() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, src) = (dir.path().join("repo"), dir.path().join("src"));
    fs::create_dir(&src).unwrap();
    let busy = src.join("busy.db");
    fs::write(&busy, random(5, 96 << 20)).unwrap();
    fs::write(src.join("calm.txt"), b"calm").unwrap();
    ok(mover().args(["repo", "init"]).arg(&repo));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (stop, busy) = (stop.clone(), busy.clone());
        std::thread::spawn(move || {
            let f = fs::OpenOptions::new().write(true).open(&busy).unwrap();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                f.write_all_at(&[i as u8; 4096], (i * 7919 % 24_000) * 4096)
                    .unwrap();
                i += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    let snap = create(&repo, &src);
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    assert!(
        snap["summary"]["changed_while_read"].as_u64().unwrap() >= 1,
        "{snap}"
    );
    // Stored as read: every chunk is what was read, so it restores (ids are checked).
    let out = dir.path().join("out");
    restore_latest(&repo, &out);
    assert_eq!(fs::metadata(out.join("busy.db")).unwrap().len(), 96 << 20);

    // The next snapshot reads it again (its ctime moved) and restores it exactly.
    let next = create(&repo, &src);
    assert_eq!(next["summary"]["files_read"], 1, "{next}");
    assert_eq!(next["summary"]["changed_while_read"], 0, "{next}");
    let out2 = dir.path().join("out2");
    restore_latest(&repo, &out2);
    assert_eq!(
        fs::read(out2.join("busy.db")).unwrap(),
        fs::read(&busy).unwrap()
    );
}

#[test]
fn a_tree_on_s3_snapshots_restores_and_diffs() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"));
    server.create_bucket("trees");
    fn with<'c>(c: &'c mut Command, endpoint: &str) -> &'c mut Command {
        c.env("MOVER_S3_ENDPOINT", endpoint)
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .env("AWS_REGION", "us-east-1")
    }
    let endpoint = server.endpoint.clone();
    let s3 = || {
        let mut c = mover();
        with(&mut c, &endpoint);
        c
    };
    let src = dir.path().join("src");
    make_tree(&src, 21);
    let repo = "s3://trees/a";
    ok(s3().args(["repo", "init", repo]));
    let a = json(&ok(s3()
        .args(["snapshot", "create", "--json", repo])
        .arg(&src)));
    fs::write(src.join("docs/added.txt"), b"x").unwrap();
    ok(s3().args(["snapshot", "create", repo]).arg(&src));
    let out = dir.path().join("out");
    ok(s3().args(["snapshot", "restore", repo, "latest"]).arg(&out));
    assert_same_tree(&src, &out);

    let diff = ok(s3().args([
        "snapshot",
        "diff",
        repo,
        a["id"].as_str().unwrap(),
        "latest",
    ]));
    assert!(diff.contains("+ docs/added.txt\n"), "{diff}");
    assert!(diff.ends_with("1 added, 1 metadata\n"), "{diff}");
}
