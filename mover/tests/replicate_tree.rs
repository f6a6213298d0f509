//! Replication of file-tree volumes between two real agents on 127.0.0.1: cycles are tree
//! copies (deleting what is gone), the secondary is file-consistent; planned failover
//! and back; a forced promote fences the old primary, whose resync needs
//! `--discard-local` because a tree keeps no record of its own writes.

mod common;

use common::{agent::*, tree::*};
use std::{path::Path, process::Output};

fn refused(out: Output, expect: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "wanted a refusal");
    assert!(err.contains(expect), "wanted {expect:?} in {err}");
}

fn status(agent: &Agent) -> serde_json::Value {
    status_of(agent, "r")
}

fn sync(agent: &Agent) -> serde_json::Value {
    ok(replicate(&["sync", "r", "--agent", &control(agent)]));
    status(agent)
}

/// Adds `n` files of 64 KiB (compressible text) under `dir`.
fn add_files(dir: &Path, n: usize) {
    std::fs::create_dir_all(dir).unwrap();
    for i in 0..n {
        let body = format!("file {i} of {}\n", dir.display()).repeat(4096);
        std::fs::write(dir.join(format!("f{i}")), &body.as_bytes()[..65536]).unwrap();
    }
}

#[test]
fn a_tree_replicates_fails_over_and_back_and_a_fenced_side_resyncs() {
    if !is_root() {
        return common::skip_unless_ci("needs root (the trees carry owners and device nodes)");
    }
    let t = tempfile::tempdir().unwrap();
    let (da, db) = (t.path().join("a"), t.path().join("b"));
    let (ta, tb) = (da.join("tree"), db.join("tree"));
    make_tree(&ta, 5);
    std::fs::create_dir_all(&tb).unwrap();
    let img = db.join("vol.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let a = Agent::start(&da, &[("docs", &ta, false)], None);
    let b = Agent::start(&db, &[("docs", &tb, false), ("img", &img, false)], None);
    let create = |extra: &[&str], secondary: &str| {
        let agent = control(&a);
        let mut args = vec![
            "create",
            "r",
            "--agent",
            &agent,
            "--volume",
            "docs",
            "--secondary",
            secondary,
            "--interval",
            "1h",
        ];
        args.extend_from_slice(extra);
        replicate(&args)
    };

    // Bad specs: a tree into a block volume, a freeze of a tree.
    refused(create(&[], &b.url("img")), "it cannot receive a file tree");
    refused(
        create(&["--freeze", ta.to_str().unwrap()], &b.url("docs")),
        "cannot be frozen",
    );

    ok(create(&[], &b.url("docs")));
    let s = sync(&a);
    assert_same_tree(&ta, &tb);
    assert_eq!(s["consistency"], "file-consistent", "{s}");
    assert_eq!(s["state"], "Replicating", "{s}");

    // Changes of every kind; of file data only the two files written are sent
    // ("edited" and "brand new").
    edit_every_kind(&ta);
    let s = sync(&a);
    assert_same_tree(&ta, &tb);
    assert_eq!(s["last_cycle"]["bytes_shipped"], 6 + 9, "{s}");
    let b_side = status(&b);
    assert_eq!(b_side["role"], "secondary", "{b_side}");

    // Planned failover: demote ships a final cycle, the secondary promotes without
    // --force, and its cycles flow back.
    ok(replicate(&["demote", "r", "--agent", &control(&a)]));
    ok(replicate(&["promote", "r", "--agent", &control(&b)]));
    add_files(&tb.join("written-on-b"), 20);
    let s = sync(&b);
    assert_eq!(s["role"], "primary", "{s}");
    assert_same_tree(&tb, &ta);

    // Disaster: a is promoted by force while b is still primary; b's next cycle is
    // refused and b stops as Fenced.
    ok(replicate(&[
        "promote",
        "r",
        "--force",
        "--agent",
        &control(&a),
    ]));
    add_files(&ta.join("written-on-a"), 5);
    add_files(&tb.join("lost-on-b"), 3);
    let out = replicate(&["sync", "r", "--agent", &control(&b)]);
    assert!(!out.status.success(), "a fenced primary's cycle fails");
    let s = status(&b);
    assert_eq!(s["state"], "Fenced", "{s}");

    // A tree keeps no record of its writes: resync needs --discard-local.
    refused(
        replicate(&["resync", "r", "--agent", &control(&b)]),
        "--discard-local",
    );
    ok(replicate(&[
        "resync",
        "r",
        "--discard-local",
        "--agent",
        &control(&b),
    ]));
    sync(&a);
    assert_same_tree(&ta, &tb);
    assert!(
        !tb.join("lost-on-b").exists(),
        "b's own writes were discarded"
    );
    assert_eq!(status(&b)["role"], "secondary");
}

#[test]
fn replicate_run_copies_a_tree_cycle_by_cycle() {
    let t = tempfile::tempdir().unwrap();
    let (src, db) = (t.path().join("src"), t.path().join("b"));
    let tb = db.join("tree");
    add_files(&src.join("one"), 3);
    std::fs::create_dir_all(&tb).unwrap();
    let b = Agent::start(&db, &[("docs", &tb, false)], None);
    let state = t.path().join("state");
    let run = || {
        ok(replicate(&[
            "run",
            src.to_str().unwrap(),
            &b.url("docs"),
            "--cycles",
            "1",
            "--state-dir",
            state.to_str().unwrap(),
        ]))
    };
    let out = run();
    assert!(out.contains("file-consistent"), "{out}");
    assert_same_tree(&src, &tb);
    std::fs::remove_dir_all(src.join("one")).unwrap();
    add_files(&src.join("two"), 2);
    run();
    assert_same_tree(&src, &tb);
}
