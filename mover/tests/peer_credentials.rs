//! Peer credentials between real `mover agent` processes on 127.0.0.1: each peer
//! cluster presents its own named token (`NAME TOKEN` lines of
//! `replication_token_file`), a relationship bound to one accepts that token alone, and a
//! peer raises a relationship's fencing epoch by one at most.
//!
//! Sites: agents a and b replicate `r` and accept the tokens of peer credentials `dr` and
//! `eu` and an unnamed, cluster-wide one; they present `dr`'s to each other. Agent c is
//! the `eu` site, which has no business with `r`.

mod common;

use common::{agent::*, *};
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

const LEN: u64 = 16 * MIB;
const DR: &str = "dr-0d1c5e9a7b2f4c3e8a6b";
const EU: &str = "eu-5f8e2d1c0b9a7e6d4c3b";
const UNNAMED: &str = "cluster-wide-3a2b1c0d9e8f";

/// An agent in `dir` exporting `vol` at `image` (bound to peer credential `bound`, if
/// given) that accepts the three tokens and presents `presents` to its peers.
fn start(dir: &Path, image: &Path, bound: Option<&str>, presents: &str) -> Agent {
    std::fs::create_dir_all(dir).unwrap();
    let (tokens, peer) = (dir.join("replication-tokens"), dir.join("peer-token"));
    std::fs::write(
        &tokens,
        format!("# peer clusters\ndr {DR}\neu {EU}\n{UNNAMED}\n"),
    )
    .unwrap();
    std::fs::write(&peer, presents).unwrap();
    let (config, port, metrics_port) = Agent::configure(dir, &[("vol", image, false)], None);
    let mut text = format!(
        "replication_token_file = \"{}\"\npeer_token_file = \"{}\"\n{}",
        tokens.display(),
        peer.display(),
        std::fs::read_to_string(&config).unwrap()
    );
    if let Some(b) = bound {
        // The last table is the export's.
        text += &format!("peer_credential = \"{b}\"\n");
    }
    std::fs::write(&config, text).unwrap();
    Agent::spawn(config, port, metrics_port)
}

/// `mover ARGS` presenting `token`.
fn as_token(token: &str, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mover"))
        .args(args)
        .env("MOVER_TOKEN", token)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap()
}

/// The stderr of a refused run, which must contain each of `expect`.
fn refused(out: Output, expect: &[&str]) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "wanted a refusal, got success");
    for e in expect {
        assert!(err.contains(e), "wanted {e:?} in {err}");
    }
    err
}

struct Sites {
    a: Agent,
    b: Agent,
    a_img: PathBuf,
    b_img: PathBuf,
    root: tempfile::TempDir,
}

/// a and b, both bound to `dr`, with `r` created on a (bound to `dr` there too) and its
/// first cycle in b.
fn replicating() -> Sites {
    let root = tempfile::tempdir().unwrap();
    let (a_img, b_img) = (root.path().join("a.img"), root.path().join("b.img"));
    make_image(&a_img, LEN, 3, &[(0, 4 * MIB), (9 * MIB, 2 * MIB)]);
    let a = start(&root.path().join("a"), &a_img, Some("dr"), DR);
    let b = start(&root.path().join("b"), &b_img, Some("dr"), DR);
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
        "1h",
        "--peer-credential",
        "dr",
    ]));
    wait_for(&a, "r", "the first cycle", |s| {
        s["last_cycle"]["id"].as_u64() >= Some(1)
    });
    Sites {
        a,
        b,
        a_img,
        b_img,
        root,
    }
}

#[test]
fn a_peer_token_acts_only_on_the_relationships_bound_to_it() {
    let s = replicating();
    assert_eq!(blake3_of(&s.a_img, LEN), blake3_of(&s.b_img, LEN));
    // b's record took the binding of the export it replicates into.
    for agent in [&s.a, &s.b] {
        assert_eq!(status_of(agent, "r")["peer_credential"], "dr");
    }
    let (a, b) = (control(&s.a), control(&s.b));

    // The status: dr's token sees it, eu's and the cluster-wide one do not.
    ok(as_token(DR, &["replicate", "status", "r", "--agent", &b]));
    refused(
        as_token(EU, &["replicate", "status", "r", "--agent", &b]),
        &[
            "the token of peer credential \"eu\" may not see relationship \"r\"",
            "it is bound to peer credential \"dr\"",
            "a peer's token acts only on the relationships bound to it",
        ],
    );
    refused(
        as_token(UNNAMED, &["replicate", "status", "r", "--agent", &b]),
        &[
            "a cluster-wide replication token",
            "give the peer its own token",
        ],
    );

    // Reading a's primary for r: dr's token reads the volume whole; eu's leaves nothing.
    let copy_as = |token: &str, dest: &Path| {
        as_token(
            token,
            &[
                "copy",
                &s.a.url("vol"),
                dest.to_str().unwrap(),
                "--relationship",
                "r",
            ],
        )
    };
    let read = s.root.path().join("read-by-dr.img");
    ok(copy_as(DR, &read));
    assert_eq!(blake3_of(&read, LEN), blake3_of(&s.a_img, LEN));
    let stolen = s.root.path().join("read-by-eu.img");
    refused(
        copy_as(EU, &stolen),
        &["the token of peer credential \"eu\" may not read relationship \"r\""],
    );
    assert!(!stolen.exists(), "a refused read left {}", stolen.display());

    // A peer learns of an export only what it may open: not the names of the others.
    let err = refused(
        as_token(
            EU,
            &[
                "copy",
                &format!("{}/secret-volume", s.b.url("vol").trim_end_matches("/vol")),
                stolen.to_str().unwrap(),
                "--relationship",
                "r",
            ],
        ),
        &["\"secret-volume\" is not exported by this agent"],
    );
    assert!(!err.contains("exports:"), "{err}");

    // The eu site (its own agent, presenting eu's token) cannot make b's replica its own
    // secondary: refused when it checks the secondary, before any cycle.
    let c_img = s.root.path().join("c.img");
    make_image(&c_img, LEN, 9, &[(0, MIB)]);
    let c = start(&s.root.path().join("c"), &c_img, None, EU);
    let before = (status_of(&s.b, "r"), blake3_of(&s.b_img, LEN));
    refused(
        replicate(&[
            "create",
            "r",
            "--agent",
            &control(&c),
            "--volume",
            "vol",
            "--secondary",
            &s.b.url("vol"),
            "--interval",
            "1h",
        ]),
        &[
            "the token of peer credential \"eu\" may not",
            "relationship \"r\"",
        ],
    );
    let after = (status_of(&s.b, "r"), blake3_of(&s.b_img, LEN));
    assert_eq!(before.0["epoch"], after.0["epoch"]);
    assert_eq!(before.0["last_cycle"], after.0["last_cycle"]);
    assert_eq!(before.1, after.1, "b's replica changed");

    // Unbinding b (the control role) serves r to any replication credential again.
    ok(replicate(&[
        "update",
        "r",
        "--peer-credential",
        "",
        "--agent",
        &b,
    ]));
    ok(as_token(
        UNNAMED,
        &["replicate", "status", "r", "--agent", &b],
    ));
    // a presents dr's token, which acts on relationships bound to dr alone: its next
    // cycle is refused, and b stays unbound (the export's binding made the record's
    // only when the record was made).
    refused(
        replicate(&["sync", "r", "--agent", &a]),
        &["may not write into relationship \"r\": it is bound to no peer credential"],
    );
    assert_eq!(status_of(&s.b, "r")["peer_credential"], "");
    // eu's named token still acts only where it is bound.
    refused(
        as_token(EU, &["replicate", "status", "r", "--agent", &b]),
        &["bound to no peer credential"],
    );
    // The binding is kept across a restart.
    ok(replicate(&[
        "update",
        "r",
        "--peer-credential",
        "dr",
        "--agent",
        &a,
    ]));
    let mut s = s;
    s.a.kill_and_restart();
    refused(
        as_token(EU, &["replicate", "status", "r", "--agent", &a]),
        &["bound to peer credential \"dr\""],
    );
    // A name that is no peer credential is refused.
    refused(
        replicate(&["update", "r", "--peer-credential", "DR!", "--agent", &a]),
        &["is no peer credential name"],
    );
}

#[test]
fn a_peer_raises_an_epoch_by_one_at_most_and_more_is_accepted_by_hand() {
    let mut s = replicating();
    let (a, b) = (control(&s.a), control(&s.b));
    // The primary's site is lost. b is promoted by force, made the secondary again, and
    // (as if its site had been through more failovers while a was away: an operator
    // accepts epoch 5 there) promoted again: epoch 1 → 6.
    s.a.child.kill().unwrap();
    s.a.child.wait().unwrap();
    ok(replicate(&["promote", "r", "--force", "--agent", &b]));
    ok(replicate(&[
        "resync",
        "r",
        "--discard-local",
        "--agent",
        &b,
    ]));
    ok(replicate(&[
        "update",
        "r",
        "--accept-epoch",
        "5",
        "--agent",
        &b,
    ]));
    ok(replicate(&["promote", "r", "--force", "--agent", &b]));
    assert_eq!(status_of(&s.b, "r")["epoch"], 6);

    // a comes back fenced, and is made b's secondary.
    s.a.kill_and_restart();
    wait_for(&s.a, "r", "Fenced", |st| st["state"] == "Fenced");
    ok(replicate(&[
        "resync",
        "r",
        "--discard-local",
        "--agent",
        &a,
    ]));
    assert_eq!(status_of(&s.a, "r")["role"], "secondary");

    // b's cycle at epoch 6 into a, whose highest is 1 (or 2, if b's cycle of epoch 2
    // still retrying reached it): refused, not fenced; b says why.
    let out = replicate(&["sync", "r", "--agent", &b]);
    refused(
        out,
        &[
            "epoch 6 for relationship \"r\" refused",
            "a peer raises it by one at most",
            "--accept-epoch 6",
        ],
    );
    let st = status_of(&s.b, "r");
    assert_eq!(st["role"], "primary");
    assert_ne!(st["state"], "Fenced", "{st}");
    // An active primary's epoch is not raised by hand.
    refused(
        replicate(&["update", "r", "--accept-epoch", "9", "--agent", &b]),
        &["active primary"],
    );

    // The operator accepts b's epoch on a: the next cycle makes a equal b.
    ok(replicate(&[
        "update",
        "r",
        "--accept-epoch",
        "6",
        "--agent",
        &a,
    ]));
    let synced = status_of(&s.b, "r")["last_cycle"]["id"]
        .as_u64()
        .unwrap_or(0);
    ok(replicate(&["sync", "r", "--agent", &b]));
    assert!(
        status_of(&s.b, "r")["last_cycle"]["id"]
            .as_u64()
            .unwrap_or(0)
            > synced
    );
    assert_eq!(blake3_of(&s.a_img, LEN), blake3_of(&s.b_img, LEN));
    assert_eq!(status_of(&s.a, "r")["epoch"], 6);

    // A planned failover back raises by one, which a peer may do.
    ok(replicate(&["demote", "r", "--agent", &b]));
    ok(replicate(&["promote", "r", "--agent", &a]));
    assert_eq!(status_of(&s.a, "r")["epoch"], 7);
    std::fs::File::options()
        .write(true)
        .open(&s.a_img)
        .and_then(|f| {
            use std::os::unix::fs::FileExt;
            f.write_all_at(&[7u8; 4096], 5 * MIB)?;
            f.sync_all()
        })
        .unwrap();
    ok(replicate(&["sync", "r", "--agent", &a]));
    assert_eq!(blake3_of(&s.a_img, LEN), blake3_of(&s.b_img, LEN));
    assert_eq!(status_of(&s.b, "r")["epoch"], 7);
}
