//! File trees to and from a real `mover agent` over gRPC on 127.0.0.1: every kind of
//! entry both ways, reruns that write nothing, deltas, refusals, and kill -9 of either
//! side mid-copy. Trees are compared by the manifest of `common::tree`.

mod common;

use common::{MIB, agent::*, json_of, tree::*};
use std::{
    fs,
    path::{Path, PathBuf},
    process::Stdio,
    time::{Duration, Instant},
};

fn ok(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "mover failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    json_of(out)
}

/// A source tree, an agent exporting `data` (writable, not made yet) and `golden` (the
/// source, read-only), and `back`, where pulls go. Fields drop in order: the agent
/// stops before its directory goes.
struct Exports {
    agent: Agent,
    src: PathBuf,
    exported: PathBuf,
    back: PathBuf,
    state: PathBuf,
    _t: tempfile::TempDir,
}

fn exports(make: impl FnOnce(&Path)) -> Exports {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    make(&src);
    let exported = t.path().join("exported");
    let agent = Agent::start(
        t.path(),
        &[("data", &exported, false), ("golden", &src, true)],
        None,
    );
    Exports {
        agent,
        src,
        exported,
        back: t.path().join("back"),
        state: t.path().join("state"),
        _t: t,
    }
}

#[test]
fn push_and_pull_copy_every_kind_of_entry_and_reruns_write_nothing() {
    let Exports {
        _t,
        src,
        exported,
        back,
        state,
        agent,
    } = exports(|src| make_tree(src, 7));

    // Push into an export that does not exist yet; the agent verifies by content.
    let first = ok(&copy(
        &state,
        &[src.to_str().unwrap(), &agent.url("data"), "--verify"],
    ));
    assert_same_tree(&src, &exported);
    assert_eq!(first["verified"], true);
    assert!(first["bytes_written"].as_u64().unwrap() >= 8 * MIB);
    assert_eq!(first["failed"], 0);

    // Again: nothing to write.
    let again = ok(&copy(&state, &[src.to_str().unwrap(), &agent.url("data")]));
    assert_eq!(again["bytes_written"], 0);
    assert_eq!(again["entries_copied"], 0);
    assert_eq!(again["metadata_updated"], 0);
    assert_same_tree(&src, &exported);

    // Pull from a read-only export into a new local directory, with --verify.
    let pulled = ok(&copy(
        &state,
        &[&agent.url("golden"), back.to_str().unwrap(), "--verify"],
    ));
    assert_eq!(pulled["verified"], true);
    assert_same_tree(&src, &back);
    let again = ok(&copy(
        &state,
        &[&agent.url("golden"), back.to_str().unwrap()],
    ));
    assert_eq!(again["bytes_written"], 0);

    // The agent counted both directions, and closed its sessions (the last one just
    // after the client saw its end).
    assert!(agent.metric("mover_agent_received_bytes_total") >= 8 * MIB);
    assert!(agent.metric("mover_agent_sent_bytes_total") >= 8 * MIB);
    let deadline = Instant::now() + Duration::from_secs(5);
    while agent.metric("mover_agent_sessions_active") != 0 {
        assert!(Instant::now() < deadline, "a tree session stayed open");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn deltas_both_ways_ship_only_what_changed_and_delete_with_delete() {
    let Exports {
        _t,
        src,
        exported,
        back,
        state,
        agent,
    } = exports(|src| make_tree(src, 11));
    ok(&copy(&state, &[src.to_str().unwrap(), &agent.url("data")]));
    ok(&copy(
        &state,
        &[&agent.url("golden"), back.to_str().unwrap()],
    ));

    // 64 KiB inserted in the middle of the 8 MiB file; one small file gone.
    let big = src.join("docs/big.bin");
    let mut data = fs::read(&big).unwrap();
    let tail = data.split_off(4 * MIB as usize);
    data.extend_from_slice(&random(99, 64 << 10));
    data.extend_from_slice(&tail);
    fs::write(&big, &data).unwrap();
    fs::remove_file(src.join("small/03/f3.txt")).unwrap();

    for (from, to, dir) in [
        (
            src.to_str().unwrap().to_string(),
            agent.url("data"),
            &exported,
        ),
        (
            agent.url("golden"),
            back.to_str().unwrap().to_string(),
            &back,
        ),
    ] {
        let delta = ok(&copy(&state, &[&from, &to, "--delete"]));
        assert_same_tree(&src, dir);
        assert_eq!(delta["files_patched"], 1, "{delta}");
        assert_eq!(delta["entries_deleted"], 1, "{delta}");
        let written = delta["bytes_written"].as_u64().unwrap();
        assert!(
            (64 << 10..4 * MIB).contains(&written),
            "wrote {written} bytes for a 64 KiB insert"
        );
        assert!(delta["bytes_reused"].as_u64().unwrap() >= 4 * MIB);
    }
}

#[test]
fn refusals_say_what_and_write_nothing() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    make_tree(&src, 3);
    let image = t.path().join("disk.img");
    fs::write(&image, vec![0u8; 1 << 20]).unwrap();
    let exported = t.path().join("exported");
    let agent = Agent::start(
        t.path(),
        &[
            ("data", &exported, false),
            ("golden", &src, true),
            ("disk", &image, false),
        ],
        None,
    );
    let state = t.path().join("state");
    let s = src.to_str().unwrap();
    let refused = |out: std::process::Output, says: &str| {
        assert_eq!(out.status.code(), Some(2), "{out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "expected {says:?} in: {err}");
    };
    refused(copy(&state, &[s, &agent.url("golden")]), "read-only");
    refused(copy(&state, &[s, &agent.url("nothing")]), "not exported");
    refused(copy(&state, &[s, &agent.url("disk")]), "not a file tree");
    let wrong_token = copy_command(&state, &[s, &agent.url("data")])
        .env("MOVER_TOKEN", "wrong")
        .output()
        .unwrap();
    refused(wrong_token, "token");
    ok(&copy(&state, &[s, &agent.url("data"), "--epoch", "5"]));
    fs::write(src.join("new-file"), b"from a fenced writer").unwrap();
    refused(
        copy(&state, &[s, &agent.url("data"), "--epoch", "4"]),
        "stale epoch",
    );
    assert!(!exported.join("new-file").exists());
    // The block image export was left alone.
    assert_eq!(fs::read(&image).unwrap(), vec![0u8; 1 << 20]);
}

/// A tree big enough that a copy takes a while: `n` files of 1 MiB.
fn make_heavy_tree(root: &Path, n: u64) {
    for i in 0..n {
        let dir = root.join(format!("d{:02}", i % 16));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(format!("f{i}")), random(1000 + i, MIB as usize)).unwrap();
    }
}

/// Waits until `dir` holds an entry: given a directory of the copy, files are arriving.
fn wait_for_entries(dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while fs::read_dir(dir).map_or(true, |mut d| d.next().is_none()) {
        assert!(Instant::now() < deadline, "the copy never started");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn spawn_copy(state: &Path, args: &[&str]) -> std::process::Child {
    copy_command(state, args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

#[test]
fn killed_client_or_agent_mid_push_leaves_nothing_visible_and_the_rerun_finishes() {
    let t = tempfile::tempdir().unwrap();
    let (src, exported) = (t.path().join("src"), t.path().join("exported"));
    make_heavy_tree(&src, 200);
    let mut agent = Agent::start(t.path(), &[("data", &exported, false)], None);
    let state = t.path().join("state");
    let partial = t.path().join(".exported.mover-partial");

    // kill -9 of the client: the agent's walk stops, the new tree stays hidden.
    let mut push = spawn_copy(&state, &[src.to_str().unwrap(), &agent.url("data")]);
    wait_for_entries(&partial.join("d00"));
    push.kill().unwrap();
    push.wait().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(!exported.exists(), "a half-copied tree became visible");

    // kill -9 of the agent during the rerun.
    let mut push = spawn_copy(
        &state,
        &[src.to_str().unwrap(), &agent.url("data"), "--retries", "1"],
    );
    std::thread::sleep(Duration::from_millis(300));
    agent.kill_and_restart();
    _ = push.wait();
    assert!(!exported.exists() || push_finished_first(&src, &exported));

    let done = ok(&copy(&state, &[src.to_str().unwrap(), &agent.url("data")]));
    assert_eq!(done["failed"], 0);
    assert_same_tree(&src, &exported);
    // Files that arrived before the kills were not sent again.
    assert!(
        done["bytes_written"].as_u64().unwrap() < 200 * MIB,
        "{done}"
    );
    assert!(!partial.exists());
}

/// A push that won the race against the kill is complete.
fn push_finished_first(src: &Path, dst: &Path) -> bool {
    assert_same_tree(src, dst);
    true
}

#[test]
fn a_pull_retries_through_an_agent_restart_and_finishes() {
    let t = tempfile::tempdir().unwrap();
    let (src, back) = (t.path().join("src"), t.path().join("back"));
    make_heavy_tree(&src, 200);
    let mut agent = Agent::start(t.path(), &[("golden", &src, true)], None);
    let state = t.path().join("state");
    let out = t.path().join("pull.json");
    let args = [
        &agent.url("golden"),
        back.to_str().unwrap(),
        "--retries",
        "20",
    ];
    let pull = copy_command(&state, &args)
        .stdout(fs::File::create(&out).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_entries(&t.path().join(".back.mover-partial/d00"));
    agent.kill_and_restart();
    let status = pull.wait_with_output().unwrap().status;
    assert!(status.success(), "the pull did not survive the restart");
    let summary: serde_json::Value = serde_json::from_slice(&fs::read(&out).unwrap()).unwrap();
    assert_eq!(summary["failed"], 0);
    assert_same_tree(&src, &back);
}

#[test]
fn bwlimit_caps_the_rate_of_pushes_and_pulls() {
    let Exports {
        _t,
        src,
        exported,
        back,
        state,
        agent,
    } = exports(|src| make_heavy_tree(src, 8)); // 8 MiB that does not compress
    // 2 MiB/s with a one-second burst: the 6 MiB after the burst take 3 s.
    let started = Instant::now();
    let args = [src.to_str().unwrap(), &agent.url("data"), "--bwlimit", "2M"];
    ok(&copy(&state, &args));
    let took = started.elapsed().as_secs_f64();
    assert!(took >= 2.5, "8 MiB pushed at 2 MiB/s in {took:.2}s");
    assert_same_tree(&src, &exported);
    // The pull asks the agent for the same limit.
    let started = Instant::now();
    let args = [
        &agent.url("golden"),
        back.to_str().unwrap(),
        "--bwlimit",
        "2M",
    ];
    ok(&copy(&state, &args));
    let took = started.elapsed().as_secs_f64();
    assert!(took >= 2.5, "8 MiB pulled at 2 MiB/s in {took:.2}s");
    assert_same_tree(&src, &back);
}

#[test]
fn a_frozen_client_is_dropped_by_keepalive_and_the_export_freed() {
    let t = tempfile::tempdir().unwrap();
    let (src, exported) = (t.path().join("src"), t.path().join("exported"));
    make_heavy_tree(&src, 200);
    let agent = Agent::start(t.path(), &[("data", &exported, false)], None);
    let state = t.path().join("state");
    let s = src.to_str().unwrap();
    // Frozen mid-push, its connection open but silent (as behind a cut cable).
    let mut frozen = spawn_copy(&state, &[s, &agent.url("data"), "--bwlimit", "20M"]);
    wait_for_entries(&t.path().join(".exported.mover-partial/d00"));
    let pid = rustix::process::Pid::from_child(&frozen);
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
    // Meanwhile the export is held; once keepalive gives up on the frozen peer, a new
    // push takes over and finishes.
    let deadline = Instant::now() + Duration::from_secs(120);
    let done = loop {
        let out = copy(&state, &[s, &agent.url("data"), "--retries", "1"]);
        if out.status.success() {
            break json_of(&out);
        }
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(err.contains("another push"), "{err}");
        assert!(Instant::now() < deadline, "the frozen push held the export");
        std::thread::sleep(Duration::from_secs(3));
    };
    frozen.kill().unwrap();
    frozen.wait().unwrap();
    assert_eq!(done["failed"], 0);
    assert_same_tree(&src, &exported);
}

#[test]
fn a_directory_listed_in_several_parts_arrives_whole() {
    let t = tempfile::tempdir().unwrap();
    let (src, exported) = (t.path().join("src"), t.path().join("exported"));
    // About 1.7 MB of listing: more than one part (1 MiB) of an answer.
    let wide = src.join("wide");
    fs::create_dir_all(&wide).unwrap();
    for i in 0..15_000 {
        fs::write(
            wide.join(format!("a-rather-long-file-name-number-{i:06}")),
            b"",
        )
        .unwrap();
    }
    let agent = Agent::start(t.path(), &[("data", &exported, false)], None);
    let state = t.path().join("state");
    let done = ok(&copy(&state, &[src.to_str().unwrap(), &agent.url("data")]));
    assert_eq!(done["files"], 15_000);
    assert_same_tree(&src, &exported);
}
