//! Scheduled snapshots on a real agent into a real S3 server (s3s-fs): the first run at
//! once, incremental runs, retention, a restart, a failing repository, bad input, a file
//! tree through a storm of `503 SlowDown`.

mod common;

use common::agent::{Agent, TOKEN, control};
use common::{MIB, ScratchFs, blake3_of, make_image, scribble_pages};
use snapshots::testing::{ACCESS_KEY, S3Server, SECRET_KEY};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const SIZE: u64 = 24 * MIB;
const REPO: &str = "s3://dr-vols/pg";

/// `mover ARGS` as an operator runs it: the agent's token, the repository's S3 keys
/// and password in the environment (the agent itself has neither).
fn mover(s3: &S3Server, pw: &Path, args: &[&str]) -> Output {
    mover_at(&s3.endpoint, pw, args)
}

/// `mover ARGS` as [`mover`] with the S3 endpoint `endpoint`.
fn mover_at(endpoint: &str, pw: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mover"))
        .args(args)
        .env("MOVER_TOKEN", TOKEN)
        .env("MOVER_S3_ENDPOINT", endpoint)
        .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        .env("AWS_REGION", "us-east-1")
        .env("MOVER_PASSWORD_FILE", pw)
        .env("MOVER_CACHE_DIR", pw.with_extension("cache"))
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "mover failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn status(s3: &S3Server, pw: &Path, agent: &Agent, name: &str) -> serde_json::Value {
    let out = mover(
        s3,
        pw,
        &[
            "snapshot",
            "schedule",
            "status",
            name,
            "--json",
            "--agent",
            &control(agent),
        ],
    );
    let all: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|_| panic!("{}", String::from_utf8_lossy(&out.stderr)));
    all[0].clone()
}

fn snapshots_of(s3: &S3Server, pw: &Path, volume: &str) -> Vec<serde_json::Value> {
    let list: serde_json::Value =
        serde_json::from_str(&ok(mover(s3, pw, &["snapshot", "list", REPO, "--json"]))).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .filter(|s| s["volume"] == volume)
        .cloned()
        .collect()
}

/// An S3 server under `dir` with the repository REPO in it, and its password file.
fn repository(dir: &Path) -> (S3Server, PathBuf) {
    let s3 = S3Server::start(&dir.join("s3"));
    s3.create_bucket("dr-vols");
    let pw = dir.join("pw");
    std::fs::write(&pw, "pw-for-tests\n").unwrap();
    ok(mover(&s3, &pw, &["repo", "init", REPO]));
    (s3, pw)
}

/// The status of schedule `name` once it has taken `runs` snapshots, none failing.
fn after_runs(s3: &S3Server, pw: &Path, agent: &Agent, name: &str, runs: u64) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = status(s3, pw, agent, name);
        if s["runs_ok"] == runs {
            return s;
        }
        assert_eq!(s["runs_failed"], 0, "{s}");
        assert!(
            Instant::now() < deadline,
            "{runs} snapshot(s) not taken: {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn an_agent_snapshots_on_schedule_keeps_what_retention_says_and_survives_a_restart() {
    let t = tempfile::tempdir().unwrap();
    let (s3, pw) = repository(t.path());
    // On XFS: each snapshot reads a reflink clone taken at its start.
    let xfs = ScratchFs::new("xfs", 512 * MIB);
    let img = xfs.path().join("vol.img");
    make_image(&img, SIZE, 8, &[(0, 6 * MIB), (12 * MIB, 4 * MIB)]);
    let state = t.path().join("agent");
    std::fs::create_dir_all(&state).unwrap();
    let agent = Agent::start(&state, &[("pg", &img, false)], None);
    let at = control(&agent);

    // Bad input is refused with what to fix; nothing is created.
    // Refused input exits 2, as `--help` says: a bad schedule before anything is sent,
    // a volume the agent does not export with the agent's reason.
    for (args, want, code) in [
        (
            vec!["--volume", "nope", "--schedule", "1h"],
            "not exported",
            2,
        ),
        (
            vec!["--volume", "pg", "--schedule", "10s"],
            "shorter than 60s",
            2,
        ),
        (
            vec!["--volume", "pg", "--schedule", "weekly"],
            "hourly:MM or daily:HH:MM",
            2,
        ),
    ] {
        let mut all = vec![
            "snapshot", "schedule", "create", "bad", "--repo", REPO, "--agent", &at,
        ];
        all.extend(args);
        let out = mover(&s3, &pw, &all);
        let e = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{e}");
        assert!(e.contains(want), "{want}: {e}");
    }

    // An interval schedule runs at once.
    ok(mover(
        &s3,
        &pw,
        &[
            "snapshot",
            "schedule",
            "create",
            "pg-dr",
            "--volume",
            "pg",
            "--repo",
            REPO,
            "--schedule",
            "6h",
            "--keep-last",
            "2",
            "--prune-every",
            "2",
            "--agent",
            &at,
        ],
    ));
    let first = after_runs(&s3, &pw, &agent, "pg-dr", 1);
    assert_eq!(first["state"], "Idle");
    assert_eq!(first["consistency"], "point-in-time");
    let left: Vec<_> = std::fs::read_dir(xfs.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left, ["vol.img"], "the clone is removed after the snapshot");
    assert!(
        first["last_bytes_added"].as_u64().unwrap() >= 10 * MIB,
        "{first}"
    );
    let next = first["next_run_ms"].as_i64().unwrap() - first["last_time_ms"].as_i64().unwrap();
    assert_eq!(
        next,
        6 * 3600 * 1000,
        "the next run one interval after the first"
    );

    // The snapshot restores to the volume's bytes.
    let restores_to_the_volume = |snapshot: &serde_json::Value, file: &str| {
        let restored = t.path().join(file);
        let (id, to) = (snapshot.as_str().unwrap(), restored.to_str().unwrap());
        ok(mover(&s3, &pw, &["snapshot", "restore", REPO, id, to]));
        assert_eq!(blake3_of(&restored, SIZE), blake3_of(&img, SIZE));
    };
    restores_to_the_volume(&first["last_snapshot"], "restored.img");

    // A snapshot of the same volume name taken by hand is not the schedule's to forget.
    ok(mover(
        &s3,
        &pw,
        &[
            "snapshot",
            "create",
            "--name",
            "pg-dr",
            REPO,
            img.to_str().unwrap(),
        ],
    ));

    // Runs on demand after writes are incremental; retention keeps the newest two.
    for seed in [1, 2, 3] {
        let written = scribble_pages(&img, seed, 20, 0..SIZE);
        let s: serde_json::Value = serde_json::from_str(&ok(mover(
            &s3,
            &pw,
            &[
                "snapshot", "schedule", "run", "pg-dr", "--json", "--agent", &at,
            ],
        )))
        .unwrap();
        let added = s[0]["last_bytes_added"].as_u64().unwrap();
        // The pages written (as deltas of the parent's chunks), a chunk list, a trailer.
        let bound = written * 4096 * 2 + 256 * 1024;
        assert!(
            added > 0 && added <= bound,
            "{added} bytes stored for {written} pages"
        );
    }
    let s = status(&s3, &pw, &agent, "pg-dr");
    assert_eq!(
        (s["runs_ok"].as_u64(), s["forgotten"].as_u64()),
        (Some(4), Some(2)),
        "{s}"
    );
    let all = snapshots_of(&s3, &pw, "pg-dr");
    let by_hand = |k: &&serde_json::Value| k["tags"].as_array().unwrap().is_empty();
    assert_eq!(all.iter().filter(by_hand).count(), 1, "{all:?}");
    let kept: Vec<_> = all.iter().filter(|k| !by_hand(k)).collect();
    assert_eq!(kept.len(), 2, "{kept:?}");
    assert!(kept.iter().any(|k| k["id"] == s["last_snapshot"]));
    restores_to_the_volume(&s["last_snapshot"], "latest.img");

    // The agent restarts: the schedule is still there, with its history and next run.
    let config = agent.config.clone();
    let (port, metrics_port) = (agent.port, agent.metrics_port);
    drop(agent);
    let agent = Agent::spawn(config, port, metrics_port);
    let again = status(&s3, &pw, &agent, "pg-dr");
    assert_eq!(again["runs_ok"], 4);
    assert_eq!(again["next_run_ms"], s["next_run_ms"]);
    assert!(agent.metric(r#"mover_schedule_runs_ok_total{schedule="pg-dr"}"#) >= 4);

    // A wrong password: the run fails loudly, the state says so, nothing is written.
    let bad_pw = t.path().join("bad-pw");
    std::fs::write(&bad_pw, "wrong\n").unwrap();
    ok(mover(
        &s3,
        &bad_pw,
        &[
            "snapshot",
            "schedule",
            "create",
            "broken",
            "--volume",
            "pg",
            "--repo",
            REPO,
            "--schedule",
            "daily:03:00",
            "--agent",
            &at,
        ],
    ));
    let out = mover(
        &s3,
        &pw,
        &["snapshot", "schedule", "run", "broken", "--agent", &at],
    );
    assert!(!out.status.success(), "a failing run exits non-zero");
    let s = status(&s3, &pw, &agent, "broken");
    assert_eq!(s["state"], "Failing");
    assert!(
        s["last_error"].as_str().unwrap().contains("password"),
        "{s}"
    );
    assert!(snapshots_of(&s3, &pw, "broken").is_empty());

    // Deleted: gone from the agent, its snapshots stay.
    ok(mover(
        &s3,
        &pw,
        &["snapshot", "schedule", "delete", "pg-dr", "--agent", &at],
    ));
    let out = mover(
        &s3,
        &pw,
        &["snapshot", "schedule", "status", "pg-dr", "--agent", &at],
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no schedule"),
        "{out:?}"
    );
    assert_eq!(snapshots_of(&s3, &pw, "pg-dr").len(), 3);
}

#[test]
fn an_agent_killed_before_the_manifest_leaves_no_snapshot_and_its_rerun_reuses_the_data() {
    let t = tempfile::tempdir().unwrap();
    let (s3, pw) = repository(t.path());
    let img = t.path().join("vol.img");
    make_image(&img, SIZE, 9, &[(0, 8 * MIB), (16 * MIB, 4 * MIB)]);
    let state = t.path().join("agent");
    std::fs::create_dir_all(&state).unwrap();
    // This agent aborts (as kill -9 would) after the data is uploaded and indexed,
    // before the snapshot's manifest is written.
    let agent = Agent::start_with_env(
        &state,
        &[("pg", &img, false)],
        &[("MOVER_FAILPOINT", "snapshot-before-manifest")],
    );
    let at = control(&agent);
    ok(mover(
        &s3,
        &pw,
        &[
            "snapshot",
            "schedule",
            "create",
            "pg-dr",
            "--volume",
            "pg",
            "--repo",
            REPO,
            "--schedule",
            "1h",
            "--agent",
            &at,
        ],
    ));
    let (config, port, metrics_port) = (agent.config.clone(), agent.port, agent.metrics_port);
    let mut agent = agent;
    let deadline = Instant::now() + Duration::from_secs(60);
    while agent.child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the failpoint never fired");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        snapshots_of(&s3, &pw, "pg-dr").is_empty(),
        "no manifest, no snapshot"
    );

    // Restarted: the interrupted run is taken again at once; the data is already there.
    drop(agent);
    let agent = Agent::spawn(config, port, metrics_port);
    let s = after_runs(&s3, &pw, &agent, "pg-dr", 1);
    assert_eq!(snapshots_of(&s3, &pw, "pg-dr").len(), 1);
    let stored = s["last_bytes_added"].as_u64().unwrap();
    assert!(
        stored < MIB,
        "the rerun stored {stored} bytes for 12 MiB already uploaded"
    );
    let restored = t.path().join("restored.img");
    let id = s["last_snapshot"].as_str().unwrap();
    ok(mover(
        &s3,
        &pw,
        &["snapshot", "restore", REPO, id, restored.to_str().unwrap()],
    ));
    assert_eq!(blake3_of(&restored, SIZE), blake3_of(&img, SIZE));
}

#[test]
fn a_file_tree_snapshots_on_schedule_through_a_storm_of_503_slowdown() {
    use common::{slowdown::SlowDown, tree};
    let t = tempfile::tempdir().unwrap();
    let (s3, pw) = repository(t.path());
    let web = t.path().join("vols/web");
    tree::make_tree(&web, 3);
    let state = t.path().join("agent");
    std::fs::create_dir_all(&state).unwrap();
    let agent = Agent::start(&state, &[("web", &web, false)], None);
    let at = control(&agent);
    // Requests in bursts: 2 refused, 2 passed, over and over.
    let storm = SlowDown::start(&s3.endpoint, |n| n % 4 < 2);
    let create = [
        "snapshot",
        "schedule",
        "create",
        "web-dr",
        "--volume",
        "web",
        "--repo",
        REPO,
        "--schedule",
        "6h",
        "--keep-last",
        "3",
        "--agent",
        &at,
    ];
    ok(mover_at(&storm.endpoint, &pw, &create));
    let first = after_runs(&s3, &pw, &agent, "web-dr", 1);
    assert_eq!(first["consistency"], "crash-inconsistent", "{first}");
    let refused = storm.refused.load(std::sync::atomic::Ordering::Relaxed);
    assert!(refused >= 8, "only {refused} requests were refused");

    let restored = t.path().join("restored");
    let id = first["last_snapshot"].as_str().unwrap();
    ok(mover(
        &s3,
        &pw,
        &["snapshot", "restore", REPO, id, restored.to_str().unwrap()],
    ));
    tree::assert_same_tree(&web, &restored);

    // The next run, after edits, reads only the changed files.
    tree::edit_every_kind(&web);
    ok(mover(
        &s3,
        &pw,
        &["snapshot", "schedule", "run", "web-dr", "--agent", &at],
    ));
    let second = after_runs(&s3, &pw, &agent, "web-dr", 2);
    let snaps = snapshots_of(&s3, &pw, "web-dr");
    let last = snaps.last().unwrap();
    assert_eq!(last["id"], second["last_snapshot"]);
    let read = last["summary"]["files_read"].as_u64().unwrap();
    assert!((1..=4).contains(&read), "{read} files read: {last}");
    ok(mover(
        &s3,
        &pw,
        &[
            "snapshot",
            "restore",
            "--delete",
            REPO,
            "latest",
            restored.to_str().unwrap(),
        ],
    ));
    tree::assert_same_tree(&web, &restored);
}
