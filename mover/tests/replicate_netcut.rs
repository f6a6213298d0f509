//! A network cut in the middle of a replication cycle: two real `mover agent` processes,
//! each in a network namespace of its own made by the test and joined by a veth pair.
//! The link goes down while a cycle ships data: the cycle fails, the relationship goes
//! Degraded, the secondary keeps exactly the previous cycle; the link comes back up: the
//! cycle is retried and the relationship is Replicating again, the secondary equal to
//! the primary.
//!
//! Needs root and `ip netns` (as CI has); skipped with a message otherwise. The agents
//! log at `warn`, or at the level in `MOVER_NETCUT_LOG` (a `RUST_LOG` filter).

mod common;

use common::{agent::TOKEN, *};
use rand::{RngCore, SeedableRng, rngs::StdRng};
use std::{
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    process::{Child, Command, Output},
    time::{Duration, Instant},
};

const LEN: u64 = 64 * MIB;
/// Data of the first cycle; the rest of the volume is written before the cut one.
const FIRST: u64 = 8 * MIB;
/// The gRPC port of both agents (each in its own namespace, so they cannot clash).
const PORT: u16 = 7070;
/// Their metrics port.
const METRICS_PORT: u16 = 9090;
/// How long the relationship may take to notice the dead link and go Degraded. Nothing
/// fails on a dead link (no RST, writes just queue): only the HTTP/2 keep-alive finds it,
/// a ping sent `transport::KEEPALIVE_INTERVAL` (15 s) after the last frame read, and
/// unanswered for `KEEPALIVE_TIMEOUT` (20 s): up to 35 s now, plus the retries.
const DETECT: Duration = Duration::from_secs(25);

/// Two network namespaces joined by a veth pair (`a_if` in `a`, `b_if` in `b`),
/// deleted on drop (which also removes the veth pair).
struct NetPair {
    a: String,
    b: String,
    a_if: String,
    b_if: String,
    a_ip: String,
    b_ip: String,
}

/// Runs `cmd ARGS`; its output, or why it would not run.
fn run(cmd: &str, args: &[&str]) -> Result<Output, String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd} {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(out)
    } else {
        Err(format!(
            "{cmd} {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl NetPair {
    /// Makes the namespaces and the link, both ends up; `Err` if that is not possible
    /// here (not root, no `ip`, no namespaces).
    fn new() -> Result<NetPair, String> {
        let pid = std::process::id();
        let x = pid % 250 + 1;
        let pair = NetPair {
            a: format!("mover-netcut-{pid}-a"),
            b: format!("mover-netcut-{pid}-b"),
            // Interface names have at most 15 bytes.
            a_if: format!("mvA{pid}"),
            b_if: format!("mvB{pid}"),
            a_ip: format!("10.201.{x}.1"),
            b_ip: format!("10.201.{x}.2"),
        };
        // From here on, dropping `pair` cleans up whatever was made.
        run("ip", &["netns", "add", &pair.a])?;
        run("ip", &["netns", "add", &pair.b])?;
        run(
            "ip",
            &[
                "link", "add", &pair.a_if, "netns", &pair.a, "type", "veth", "peer", "name",
                &pair.b_if, "netns", &pair.b,
            ],
        )?;
        for (ns, dev, ip) in [
            (&pair.a, &pair.a_if, &pair.a_ip),
            (&pair.b, &pair.b_if, &pair.b_ip),
        ] {
            pair.ip(ns, &["link", "set", "lo", "up"])?;
            pair.ip(ns, &["addr", "add", &format!("{ip}/24"), "dev", dev])?;
            pair.ip(ns, &["link", "set", dev, "up"])?;
        }
        Ok(pair)
    }

    /// `ip ARGS` inside namespace `ns`.
    fn ip(&self, ns: &str, args: &[&str]) -> Result<Output, String> {
        let mut all = vec!["netns", "exec", ns, "ip"];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// Takes both ends of the link down (`false`) or up (`true`). Both ends: a peer
    /// whose own end is down has no route to the other side, so reconnecting fails at
    /// once instead of waiting for a connect timeout.
    fn link(&self, up: bool) {
        let state = if up { "up" } else { "down" };
        for (ns, dev) in [(&self.a, &self.a_if), (&self.b, &self.b_if)] {
            self.ip(ns, &["link", "set", dev, state]).unwrap();
        }
    }
}

impl Drop for NetPair {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}

/// A `mover agent` running in a network namespace, listening on every address of it
/// (the peer reaches it over the veth, the test's commands over the namespace's
/// loopback, which the cut does not touch); killed on drop.
struct NsAgent {
    child: Child,
    ns: String,
}

impl NsAgent {
    /// Starts an agent in `ns` exporting `image` as `vol`, advertised at `ip`.
    fn start(ns: &str, ip: &str, dir: &Path, image: &Path) -> NsAgent {
        std::fs::write(dir.join("token"), TOKEN).unwrap();
        let config = dir.join("agent.toml");
        std::fs::write(
            &config,
            format!(
                "listen = \"0.0.0.0:{PORT}\"\nmetrics_listen = \"127.0.0.1:{METRICS_PORT}\"\n\
                 advertise = \"{ip}:{PORT}\"\nstate_dir = \"{}\"\ntoken_file = \"{}\"\n\
                 [exports.vol]\npath = \"{}\"\nread_only = false\n",
                dir.join("agent-state").display(),
                dir.join("token").display(),
                image.display()
            ),
        )
        .unwrap();
        // `ip netns exec` execs the agent in place: the child is the agent itself.
        let child = Command::new("ip")
            .args(["netns", "exec", ns, env!("CARGO_BIN_EXE_mover"), "agent"])
            .arg("--config")
            .arg(&config)
            .env(
                "RUST_LOG",
                std::env::var("MOVER_NETCUT_LOG").unwrap_or("warn".into()),
            )
            .spawn()
            .unwrap();
        let mut agent = NsAgent {
            child,
            ns: ns.into(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !agent.replicate(&["list"]).status.success() {
            assert!(
                agent.child.try_wait().unwrap().is_none(),
                "the agent in {ns} exited"
            );
            assert!(Instant::now() < deadline, "the agent in {ns} did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
        agent
    }

    /// `mover replicate ARGS --agent` this agent, run in its namespace.
    fn replicate(&mut self, args: &[&str]) -> Output {
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns,
                env!("CARGO_BIN_EXE_mover"),
                "replicate",
            ])
            .args(args)
            .args(["--agent", &format!("agent://127.0.0.1:{PORT}")])
            .env("MOVER_TOKEN", TOKEN)
            .env("RUST_LOG", "warn")
            .output()
            .unwrap()
    }

    /// Like [`NsAgent::replicate`], which must succeed; its stdout.
    fn ok(&mut self, args: &[&str]) -> String {
        let out = self.replicate(args);
        assert!(
            out.status.success(),
            "mover replicate {args:?} in {} failed: {}",
            self.ns,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn status(&mut self, name: &str) -> serde_json::Value {
        serde_json::from_str(&self.ok(&["status", name, "--json"])).unwrap()
    }
}

impl Drop for NsAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Overwrites `range` of `path` with seeded random data.
fn fill(path: &Path, seed: u64, range: std::ops::Range<u64>) {
    let f = std::fs::File::options().write(true).open(path).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut buf = vec![0u8; MIB as usize];
    for off in range.step_by(MIB as usize) {
        rng.fill_bytes(&mut buf);
        f.write_all_at(&buf, off).unwrap();
    }
    f.sync_all().unwrap();
}

fn cycle_id(s: &serde_json::Value) -> u64 {
    s["last_cycle"]["id"].as_u64().unwrap_or(0)
}

/// The test's namespaces, agents and files, torn down in this order (agents first,
/// while their files still exist; the namespaces once nothing runs in them).
struct Setup {
    a: NsAgent,
    b: NsAgent,
    _net: NetPair,
    _dir: tempfile::TempDir,
    a_img: PathBuf,
    b_img: PathBuf,
    b_url: String,
}

fn setup() -> Option<Setup> {
    if !rustix::process::geteuid().is_root() {
        common::skip_unless_ci("the network-cut test needs root (network namespaces)");
        return None;
    }
    let net = match NetPair::new() {
        Ok(n) => n,
        Err(e) => {
            common::skip_unless_ci(&format!(
                "cannot make network namespaces with `ip netns`: {e}"
            ));
            return None;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let (da, db) = (dir.path().join("a"), dir.path().join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let (a_img, b_img) = (da.join("vol.img"), db.join("vol.img"));
    make_image(&a_img, LEN, 1, &[(0, FIRST)]);
    let a = NsAgent::start(&net.a, &net.a_ip, &da, &a_img);
    let b = NsAgent::start(&net.b, &net.b_ip, &db, &b_img);
    let b_url = format!("agent://{}:{PORT}/vol", net.b_ip);
    Some(Setup {
        a,
        b,
        _net: net,
        _dir: dir,
        a_img,
        b_img,
        b_url,
    })
}

#[test]
fn a_network_cut_mid_cycle_degrades_the_relationship_and_the_retried_cycle_completes() {
    let t0 = Instant::now();
    let Some(mut s) = setup() else { return };
    let net = &s._net;
    let elapsed = |what: &str| eprintln!("[{:5.1}s] {what}", t0.elapsed().as_secs_f64());

    // 4 MiB/s on the wire: the first cycle (8 MiB of data) takes about 2 s, the one
    // that is cut (56 MiB more) about 14 s.
    s.a.ok(&[
        "create",
        "r",
        "--volume",
        "vol",
        "--secondary",
        &s.b_url,
        "--interval",
        "2s",
        "--bwlimit",
        "4M",
    ]);
    let deadline = Instant::now() + Duration::from_secs(30);
    while cycle_id(&s.a.status("r")) < 1 {
        assert!(
            Instant::now() < deadline,
            "the first cycle did not complete"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    elapsed("first cycle committed");

    // Hold the cycles while the primary is written; a cycle run now (after any under
    // way, cycles of a relationship never overlap) leaves none running.
    s.a.ok(&["update", "r", "--pause"]);
    s.a.ok(&["sync", "r"]);
    let before = s.a.status("r");
    assert_eq!(before["state"], "Paused", "{before}");
    let prev = cycle_id(&before);
    let prev_hash = blake3_of(&s.a_img, LEN);
    assert_eq!(blake3_of(&s.b_img, LEN), prev_hash, "cycle {prev} applied");
    fill(&s.a_img, 2, FIRST..LEN);
    let new_hash = blake3_of(&s.a_img, LEN);

    // Resume: the next cycle starts at once (its interval is long past) and ships 56
    // MiB in about 14 s. Cut the link 2 s into its transfer.
    s.a.ok(&["update", "r", "--resume"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = s.a.status("r");
        if st["progress"]["total"].as_u64() > Some(0) {
            break;
        }
        assert!(Instant::now() < deadline, "the cycle did not start: {st}");
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_secs(2));
    let st = s.a.status("r");
    assert_eq!(
        (cycle_id(&st), st["progress"]["total"].as_u64()),
        (prev, Some(LEN)),
        "the cycle is still under way: {st}"
    );
    elapsed("cycle under way: cutting the link");
    net.link(false);
    let cut = Instant::now();

    // The cycle fails (however its retries go) and the relationship is Degraded; all
    // the while the secondary holds exactly the previous cycle, nothing of this one.
    let degraded = loop {
        let st = s.a.status("r");
        if st["state"] == "Degraded" && st["cycles_failed"].as_u64() >= Some(1) {
            break st;
        }
        // Before the cycle itself fails, the relationship may already be Degraded for
        // being late: its RPO past 3 intervals.
        let late = st["state"] == "Degraded"
            && st["last_error"]
                .as_str()
                .is_some_and(|e| e.contains("past 3 intervals"));
        assert!(st["state"] == "Replicating" || late, "{st}");
        assert_eq!(
            cycle_id(&st),
            prev,
            "no cycle completes over a dead link: {st}"
        );
        assert!(
            cut.elapsed() < DETECT,
            "the cycle did not notice the dead link within {DETECT:?}: {st}"
        );
        assert_eq!(
            blake3_of(&s.b_img, LEN),
            prev_hash,
            "the secondary holds cycle {prev}, not part of the next"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    let detect = cut.elapsed();
    elapsed(&format!(
        "Degraded {:.1}s after the cut: {}",
        detect.as_secs_f64(),
        degraded["last_error"]
    ));
    let err = degraded["last_error"].as_str().unwrap();
    assert!(err.contains(&net.b_ip), "the error names the peer: {err}");
    assert!(degraded["cycles_failed"].as_u64() >= Some(1), "{degraded}");
    assert_eq!(cycle_id(&degraded), prev, "{degraded}");
    assert_eq!(blake3_of(&s.b_img, LEN), prev_hash, "no half-applied cycle");
    let b_says = s.b.status("r");
    assert_eq!(
        (b_says["role"].as_str(), cycle_id(&b_says)),
        (Some("secondary"), prev),
        "{b_says}"
    );

    // Still down: the cycles retried on the interval fail too, the state stays. (They
    // now run at full speed, to keep the test short once the link is back.)
    s.a.ok(&["update", "r", "--bwlimit", "0"]);
    std::thread::sleep(Duration::from_secs(3));
    let st = s.a.status("r");
    assert_eq!(st["state"], "Degraded", "{st}");
    assert!(
        st["cycles_failed"].as_u64() > degraded["cycles_failed"].as_u64(),
        "the cycle is retried on its interval: {st}"
    );
    assert_eq!(blake3_of(&s.b_img, LEN), prev_hash);

    // The link comes back: the retried cycle completes and the relationship is
    // Replicating again.
    net.link(true);
    let up = Instant::now();
    elapsed("link up");
    let deadline = Instant::now() + Duration::from_secs(30);
    let back = loop {
        let st = s.a.status("r");
        if st["state"] == "Replicating" {
            break st;
        }
        assert!(Instant::now() < deadline, "not Replicating again: {st}");
        std::thread::sleep(Duration::from_millis(200));
    };
    elapsed(&format!(
        "Replicating {:.1}s after the link came back",
        up.elapsed().as_secs_f64()
    ));
    assert!(cycle_id(&back) > prev, "a new cycle completed: {back}");
    assert_eq!(back["last_error"], "", "{back}");
    assert_eq!(
        blake3_of(&s.b_img, LEN),
        new_hash,
        "the secondary caught up"
    );
    assert_eq!(blake3_of(&s.a_img, LEN), new_hash);
    let b_says = s.b.status("r");
    assert!(cycle_id(&b_says) > prev, "{b_says}");
    elapsed("done");
}
