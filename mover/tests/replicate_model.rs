//! A property-based test of continuous replication: random sequences of operations
//! (writes, cycles, a secondary crashing at each failpoint of the apply, kill -9 of either
//! agent or of both in the middle of a cycle, planned failovers, a demote that cannot
//! reach its secondary, forced failovers with writes on the fenced old primary, resyncs,
//! stale-epoch writes) run against two real `mover agent` processes and against a model
//! of the two volumes (their exact bytes), with the invariants checked after every step:
//!
//! - every volume's image equals the model's bytes (the primary's is never touched by
//!   replication; the secondary's is always exactly the content of one completed cycle,
//!   never a mix);
//! - after a cycle both sides are equal and the cycle shipped exactly the pages that
//!   differed (random data does not compress);
//! - roles, states (Replicating, Degraded, Fenced, SplitBrain, Secondary), cycle ids and
//!   epochs are what the model says, and a side's epoch only rises;
//! - writes with an epoch older than one a side has seen are refused;
//! - resync refuses with "split brain" exactly when the old primary was written after
//!   the last cycle both sides hold.
//!
//! Environment:
//! - `MOVER_MODEL_CASES`: sequences to run (default 3);
//! - `MOVER_MODEL_OPS`: operations per sequence (default 12);
//! - `MOVER_MODEL_SEED`: the first sequence's seed (default 1; `random`: from the clock);
//! - `MOVER_MODEL_FS`: where the volumes are: `tmp` (a temp directory under /var/tmp),
//!   `xfs` (a scratch XFS on a loop device, where cycles take reflink clones and read
//!   only the chunks written since the previous cycle; needs root, as CI has), or by
//!   default `xfs` for every seed divisible by 3 and `tmp` for the others.
//!
//! A failure prints the seed and the operations that led to it; rerun one sequence with
//! `MOVER_MODEL_SEED=<seed> MOVER_MODEL_CASES=1 MOVER_MODEL_OPS=<n>`. Operations are a
//! function of the seed; only where `KillBothMidCycle` lands in the cycle is timing (its
//! outcome is logged, and every outcome is checked).

mod common;

use common::{agent::*, *};
use rand::{Rng, RngCore, SeedableRng, rngs::StdRng};
use serde_json::Value;
use std::{
    collections::{BTreeSet, HashSet},
    fmt,
    os::unix::{fs::FileExt, process::ExitStatusExt},
    path::{Path, PathBuf},
    process::Output,
    time::{Duration, Instant},
};

/// Size of each volume.
const LEN: u64 = 8 * MIB;
/// The relationship's name.
const NAME: &str = "r";
/// How long any state may take to be reached.
const DEADLINE: Duration = Duration::from_secs(60);
/// The secondary's failpoints while it applies a cycle, and whether the cycle is on the
/// volume after the restart (committed) or not.
const FAILPOINTS: [(&str, bool); 3] = [
    ("cycle-staged", false),
    ("cycle-committed", true),
    ("cycle-mid-apply", true),
];

// ---------------------------------------------------------------------------------------
// The CLI

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The JSON status a successful `mover replicate … --json` printed.
fn ok_json(what: &str, out: Output) -> Value {
    assert!(
        out.status.success(),
        "{what} failed: {}",
        stderr(&out).trim()
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {:?}", out.stdout))
}

/// Asserts a refusal (exit code 2) whose message contains `expect`.
fn refused(what: &str, out: Output, expect: &str) {
    let err = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{what}: wanted a refusal ({expect:?}); got {:?}: {err}",
        out.status
    );
    assert!(err.contains(expect), "{what}: wanted {expect:?} in {err}");
}

/// `mover replicate VERB NAME --agent … --json EXTRA`.
fn call(agent: &Agent, verb: &str, extra: &[&str]) -> Output {
    let ctl = control(agent);
    let mut args = vec![verb, NAME, "--agent", &ctl, "--json"];
    args.extend_from_slice(extra);
    replicate(&args)
}

fn status(agent: &Agent) -> Value {
    ok_json("status", call(agent, "status", &[]))
}

/// Polls `agent`'s status until `cond` holds; returns that status.
fn wait_for(agent: &Agent, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let s = status(agent);
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "waited for {what}: {s}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until a (re)started agent serves its control API: it applied or dropped the
/// journals a crash left before serving (its port is bound before that).
fn wait_ready(agent: &Agent) {
    let deadline = Instant::now() + DEADLINE;
    while !call(agent, "status", &[]).status.success() {
        assert!(
            Instant::now() < deadline,
            "agent on {} never served",
            agent.port
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn id_of(s: &Value) -> u64 {
    s["last_cycle"]["id"].as_u64().unwrap_or(0)
}

fn counts(s: &Value) -> (u64, u64) {
    (
        s["cycles_ok"].as_u64().unwrap(),
        s["cycles_failed"].as_u64().unwrap(),
    )
}

/// Waits until the cycle a primary starts by itself (when promoted or restarted) has
/// ended, given its counters and last cycle before; returns the status and whether the
/// cycle succeeded. (A success counts before the record is saved: wait for both.)
fn settle(agent: &Agent, before: (u64, u64), last_id: u64) -> (Value, bool) {
    let s = wait_for(agent, "the primary's own first cycle to end", |s| {
        let (ok, failed) = counts(s);
        failed > before.1 || (ok > before.0 && id_of(s) > last_id)
    });
    let ok = counts(&s).0 > before.0;
    (s, ok)
}

/// Starts `agent` again on its config and ports (its process is dead), with `env`.
fn respawn(agent: &mut Agent, env: &[(&str, &str)]) {
    let fresh = Agent::spawn_with_env(agent.config.clone(), agent.port, agent.metrics_port, env);
    drop(std::mem::replace(agent, fresh)); // reaped already: kill and wait are no-ops
    wait_ready(agent);
}

fn kill(agent: &mut Agent) {
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
}

// ---------------------------------------------------------------------------------------
// The model

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    A,
    B,
}

impl Side {
    fn other(self) -> Side {
        match self {
            Side::A => Side::B,
            Side::B => Side::A,
        }
    }
    fn i(self) -> usize {
        self as usize
    }
}

/// A forced failover not yet resolved: the old primary is down, or up and fenced.
#[derive(Clone, Debug)]
struct Split {
    old: Side,
    up: bool,
    /// The epoch the old primary still holds.
    old_epoch: u64,
    /// BLAKE3 of the last cycle both sides hold: the promoted side's volume then.
    common: String,
    /// That cycle committed on the promoted side while the old primary saw it fail.
    unacknowledged: bool,
}

struct Model {
    /// Each volume's bytes.
    vol: [Vec<u8>; 2],
    primary: Side,
    /// The primary's epoch.
    epoch: u64,
    /// The highest epoch each side's fencing store has seen.
    seen: [u64; 2],
    /// The highest epoch each side's status reported (they only rise).
    observed: [u64; 2],
    /// BLAKE3 of the content of every cycle a secondary committed.
    cycles: HashSet<String>,
    /// Whether each side was written after the last cycle both sides hold.
    wrote: [bool; 2],
    /// The primary's last cycle failed.
    degraded: bool,
    /// The secondary committed a cycle the primary saw fail (and none succeeded since).
    unacknowledged: bool,
    split: Option<Split>,
}

impl Model {
    fn secondary(&self) -> Side {
        self.primary.other()
    }

    fn hash(&self, side: Side) -> String {
        blake3::hash(&self.vol[side.i()]).to_hex().to_string()
    }

    /// Pages that differ between the two volumes.
    fn diff_pages(&self) -> u64 {
        let (a, b) = (&self.vol[0], &self.vol[1]);
        a.chunks(PAGE as usize)
            .zip(b.chunks(PAGE as usize))
            .filter(|(x, y)| x != y)
            .count() as u64
    }

    /// A cycle from the primary was committed on the secondary.
    fn cycle_committed(&mut self) {
        let (p, s) = (self.primary.i(), self.secondary().i());
        self.vol[s] = self.vol[p].clone();
        self.cycles.insert(self.hash(self.primary));
        self.wrote = [false; 2];
        self.seen[s] = self.seen[s].max(self.epoch);
    }
}

#[derive(Clone, Debug)]
enum Op {
    /// The application writes `pages` random pages on `side` (the primary, or a fenced
    /// or dead old primary).
    Write { side: Side, pages: usize },
    /// `sync`: one cycle now.
    Sync,
    /// Writes `pages` pages on the primary, then the secondary dies at `failpoint` while
    /// applying the cycle; it is restarted without the failpoint.
    CrashSecondary {
        failpoint: &'static str,
        pages: usize,
    },
    /// kill -9 of an agent, and a restart.
    KillRestart(Side),
    /// Writes `pages` pages on the primary and starts a cycle; after `delay_ms` both
    /// agents are killed -9 (the secondary maybe in the middle of applying it); both
    /// are restarted.
    KillBothMidCycle { delay_ms: u64, pages: usize },
    /// Demote the primary (a final cycle), promote the secondary.
    PlannedFailover,
    /// Demote while the secondary's agent is down: the final cycle fails, the primary
    /// stays primary; the secondary is restarted.
    DemoteUnreachable,
    /// The primary's node is lost (its agent killed); the secondary is promoted --force.
    ForcePromote,
    /// The old primary's agent comes back; it must find itself fenced.
    RestartOld,
    /// A cycle of the new primary while the old one is not its secondary: it fails.
    SyncSplit,
    /// `resync` on the fenced old primary (with --discard-local if it wrote, or if
    /// `discard` anyway), then a cycle from the new primary.
    Resync { discard: bool },
    /// A write into `side` with an epoch older than the highest it has seen.
    StaleWrite(Side),
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// Picks an operation valid in the model's state.
fn choose(m: &Model, rng: &mut StdRng) -> Op {
    let pages = |rng: &mut StdRng| rng.random_range(1..=48);
    let mut ops: Vec<(f64, Op)> = Vec::new();
    let stale: Vec<Side> = [Side::A, Side::B]
        .into_iter()
        .filter(|s| m.seen[s.i()] >= 2 && m.split.as_ref().is_none_or(|x| x.old != *s || x.up))
        .collect();
    match &m.split {
        None => {
            let p = m.primary;
            ops.push((
                4.0,
                Op::Write {
                    side: p,
                    pages: pages(rng),
                },
            ));
            ops.push((3.0, Op::Sync));
            let (failpoint, _) = FAILPOINTS[rng.random_range(0..FAILPOINTS.len())];
            ops.push((
                1.5,
                Op::CrashSecondary {
                    failpoint,
                    pages: pages(rng),
                },
            ));
            ops.push((0.8, Op::KillRestart(p)));
            ops.push((0.8, Op::KillRestart(p.other())));
            ops.push((
                0.8,
                Op::KillBothMidCycle {
                    delay_ms: rng.random_range(0..600),
                    pages: pages(rng),
                },
            ));
            ops.push((1.5, Op::PlannedFailover));
            ops.push((0.4, Op::DemoteUnreachable));
            ops.push((1.2, Op::ForcePromote));
        }
        Some(s) => {
            ops.push((
                2.0,
                Op::Write {
                    side: m.primary,
                    pages: pages(rng),
                },
            ));
            ops.push((
                2.0,
                Op::Write {
                    side: s.old,
                    pages: pages(rng),
                },
            ));
            ops.push((0.7, Op::SyncSplit));
            ops.push((0.6, Op::KillRestart(m.primary)));
            if s.up {
                ops.push((0.6, Op::KillRestart(s.old)));
                ops.push((
                    3.0,
                    Op::Resync {
                        discard: rng.random_bool(0.3),
                    },
                ));
            } else {
                ops.push((3.0, Op::RestartOld));
            }
        }
    }
    if !stale.is_empty() {
        ops.push((0.6, Op::StaleWrite(stale[rng.random_range(0..stale.len())])));
    }
    let total: f64 = ops.iter().map(|(w, _)| w).sum();
    let mut x = rng.random_range(0.0..total);
    for (w, op) in ops {
        if x < w {
            return op;
        }
        x -= w;
    }
    unreachable!("the weights add up")
}

// ---------------------------------------------------------------------------------------
// The world: two agents, each exporting `vol`

struct World {
    agents: [Agent; 2],
    imgs: [PathBuf; 2],
    /// The source of stale-epoch writes, and `mover copy`'s state directory.
    scratch: PathBuf,
    dir: PathBuf,
    _fs: Option<ScratchFs>,
    _t: Option<tempfile::TempDir>,
}

/// The seed, the operations so far and what each found: printed if the case fails.
struct Trace {
    seed: u64,
    fs: &'static str,
    ops: Vec<String>,
}

impl Drop for Trace {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "\n=== replicate_model FAILED: seed {} after {} operations ===\n{}\n\
                 rerun: MOVER_MODEL_SEED={} MOVER_MODEL_CASES=1 MOVER_MODEL_OPS={} \
                 MOVER_MODEL_FS={} cargo test -p mover --test replicate_model -- --nocapture\n",
                self.seed,
                self.ops.len(),
                self.ops
                    .iter()
                    .enumerate()
                    .map(|(i, o)| format!("  #{i:<3} {o}"))
                    .collect::<Vec<_>>()
                    .join("\n"),
                self.seed,
                env_u64("MOVER_MODEL_OPS", 12),
                self.fs,
            );
        }
    }
}

struct Case {
    w: World,
    m: Model,
    rng: StdRng,
}

impl Case {
    fn agent(&self, side: Side) -> &Agent {
        &self.w.agents[side.i()]
    }

    fn agent_mut(&mut self, side: Side) -> &mut Agent {
        &mut self.w.agents[side.i()]
    }

    fn img(&self, side: Side) -> &Path {
        &self.w.imgs[side.i()]
    }

    /// Two agents; A's volume holds random data; B's holds other random data, the same,
    /// or does not exist yet. The relationship is created on A and its first cycle done.
    fn new(seed: u64, on_xfs: bool) -> Case {
        let mut rng = StdRng::seed_from_u64(seed);
        let (fs, t) = if on_xfs {
            (Some(ScratchFs::new("xfs", 512 * MIB)), None)
        } else {
            (None, Some(tempfile::tempdir_in("/var/tmp").unwrap()))
        };
        let dir = match (&fs, &t) {
            (Some(fs), _) => fs.path().to_path_buf(),
            (_, Some(t)) => t.path().to_path_buf(),
            _ => unreachable!(),
        };
        let (da, db) = (dir.join("a"), dir.join("b"));
        std::fs::create_dir_all(&da).unwrap();
        std::fs::create_dir_all(&db).unwrap();
        let imgs = [da.join("vol.img"), db.join("vol.img")];
        let mut a = vec![0u8; LEN as usize];
        rng.fill_bytes(&mut a);
        std::fs::write(&imgs[0], &a).unwrap();
        let b_start = rng.random_range(0..3);
        match b_start {
            0 => {} // no image: the first cycle makes it
            1 => {
                let mut b = vec![0u8; LEN as usize];
                rng.fill_bytes(&mut b);
                std::fs::write(&imgs[1], &b).unwrap();
            }
            _ => std::fs::write(&imgs[1], &a).unwrap(),
        }
        let scratch = dir.join("stale.img");
        make_image(&scratch, LEN, seed ^ 0x57a1e, &[(0, LEN)]);
        let agent_a = Agent::start(&da, &[("vol", &imgs[0], false)], None);
        let agent_b = Agent::start(&db, &[("vol", &imgs[1], false)], None);
        let w = World {
            agents: [agent_a, agent_b],
            imgs,
            scratch,
            dir,
            _fs: fs,
            _t: t,
        };
        let out = replicate(&[
            "create",
            NAME,
            "--agent",
            &control(&w.agents[0]),
            "--volume",
            "vol",
            "--secondary",
            &w.agents[1].url("vol"),
            "--interval",
            "1h",
            "--json",
        ]);
        ok_json("create", out);
        let s = wait_for(&w.agents[0], "the first cycle", |s| id_of(s) >= 1);
        assert_eq!(id_of(&s), 1, "{s}");
        eprintln!(
            "[seed {seed}] B starts {}; on {}",
            ["absent", "with other data", "equal to A"][b_start],
            if on_xfs { "xfs" } else { "the temp dir" }
        );
        let mut m = Model {
            vol: [a.clone(), a],
            primary: Side::A,
            epoch: 1,
            seen: [1, 1],
            observed: [0, 0],
            cycles: HashSet::new(),
            wrote: [false; 2],
            degraded: false,
            unacknowledged: false,
            split: None,
        };
        m.cycles.insert(m.hash(Side::A));
        Case { w, m, rng }
    }

    /// Writes `count` distinct random pages into `side`'s image and the model.
    fn write(&mut self, side: Side, count: usize) -> BTreeSet<u64> {
        let f = std::fs::File::options()
            .write(true)
            .open(self.img(side))
            .unwrap();
        let mut chosen = BTreeSet::new();
        while chosen.len() < count {
            chosen.insert(self.rng.random_range(0..LEN / PAGE));
        }
        let mut buf = vec![0u8; PAGE as usize];
        for p in &chosen {
            self.rng.fill_bytes(&mut buf);
            f.write_all_at(&buf, p * PAGE).unwrap();
            let at = (p * PAGE) as usize;
            self.m.vol[side.i()][at..at + PAGE as usize].copy_from_slice(&buf);
        }
        f.sync_all().unwrap();
        self.m.wrote[side.i()] = true;
        chosen
    }

    fn file_hash(&self, side: Side) -> String {
        blake3_of(self.img(side), LEN)
    }

    /// A successful cycle's status on the primary: the secondary now equals the primary,
    /// the cycle shipped exactly the pages that differed, and both sides report it.
    fn check_cycle(&mut self, what: &str, s: &Value, before_id: u64) {
        self.check_cycle_ids(what, s, &[before_id + 1]);
    }

    /// [`Case::check_cycle`], where the cycle's id may be any of `ids`.
    fn check_cycle_ids(&mut self, what: &str, s: &Value, ids: &[u64]) {
        let diff = self.m.diff_pages();
        self.m.cycle_committed();
        self.m.unacknowledged = false;
        let c = &s["last_cycle"];
        assert!(
            ids.contains(&id_of(s)),
            "{what}: the cycle id, one of {ids:?}: {s}"
        );
        assert_eq!(
            c["bytes_shipped"].as_u64(),
            Some(diff * PAGE),
            "{what}: a cycle ships exactly the {diff} pages that differ: {s}"
        );
        let sec = status(self.agent(self.m.secondary()));
        assert_eq!(
            (id_of(&sec), &sec["last_cycle"]["root"]),
            (id_of(s), &c["root"]),
            "{what}: the secondary reports the cycle the primary committed: {sec}"
        );
        let (p, q) = (
            self.file_hash(self.m.primary),
            self.file_hash(self.m.secondary()),
        );
        assert_eq!(p, q, "{what}: after a cycle both sides are equal");
    }

    fn primary_status(&self) -> Value {
        status(self.agent(self.m.primary))
    }

    // -----------------------------------------------------------------------------------
    // Operations

    fn run(&mut self, op: &Op) -> String {
        let m = &self.m;
        match *op {
            Op::Write { side, pages } => {
                assert!(side == m.primary || m.split.as_ref().is_some_and(|s| s.old == side));
                self.write(side, pages);
                String::new()
            }
            Op::Sync => {
                let before = id_of(&self.primary_status());
                let s = ok_json("sync", call(self.agent(self.m.primary), "sync", &[]));
                self.m.degraded = false;
                self.check_cycle("sync", &s, before);
                cycle_line(&s)
            }
            Op::CrashSecondary { failpoint, pages } => self.crash_secondary(failpoint, pages),
            Op::KillRestart(side) => self.kill_restart(side),
            Op::KillBothMidCycle { delay_ms, pages } => self.kill_both_mid_cycle(delay_ms, pages),
            Op::PlannedFailover => self.planned_failover(),
            Op::DemoteUnreachable => {
                let (p, s) = (self.m.primary, self.m.secondary());
                kill(self.agent_mut(s));
                let out = call(self.agent(p), "demote", &[]);
                let err = stderr(&out);
                assert!(!out.status.success(), "demote without a secondary");
                assert!(err.contains("still primary"), "{err}");
                self.m.degraded = true;
                respawn(self.agent_mut(s), &[]);
                "refused: still primary".into()
            }
            Op::ForcePromote => self.force_promote(),
            Op::RestartOld => {
                let split = self.m.split.clone().expect("a split");
                respawn(self.agent_mut(split.old), &[]);
                self.m.split.as_mut().unwrap().up = true;
                // Its first cycle is refused for its stale epoch: it halts, Fenced.
                let s = wait_for(self.agent(split.old), "the old primary fenced", |s| {
                    s["state"] == "Fenced"
                });
                assert_eq!(s["role"], "primary", "{s}");
                assert_eq!(s["epoch"].as_u64(), Some(split.old_epoch), "{s}");
                let out = call(self.agent(split.old), "sync", &[]);
                assert!(!out.status.success(), "a fenced side runs no cycle");
                assert!(stderr(&out).contains("halted"), "{}", stderr(&out));
                "Fenced".into()
            }
            Op::SyncSplit => {
                let split = self.m.split.clone().expect("a split");
                let out = call(self.agent(self.m.primary), "sync", &[]);
                let err = stderr(&out);
                assert!(!out.status.success(), "no secondary to cycle into");
                if split.up {
                    assert!(
                        err.contains("is the primary of relationship"),
                        "the fenced old primary refuses the new one's cycles: {err}"
                    );
                    // It saw the new epoch before refusing the cycle.
                    self.m.seen[split.old.i()] = self.m.epoch;
                }
                self.m.degraded = true;
                if split.up {
                    "failed: the fenced old primary refuses".into()
                } else {
                    "failed: the old primary is down".into()
                }
            }
            Op::Resync { discard } => self.resync(discard),
            Op::StaleWrite(side) => {
                let epoch = self.m.seen[side.i()] - 1;
                let e = epoch.to_string();
                std::fs::create_dir_all(self.w.dir.join("copy-state")).unwrap();
                let out = copy(
                    &self.w.dir.join("copy-state"),
                    &[
                        self.w.scratch.to_str().unwrap(),
                        &self.agent(side).url("vol"),
                        "--relationship",
                        NAME,
                        "--epoch",
                        &e,
                    ],
                );
                let err = stderr(&out);
                assert!(!out.status.success(), "a stale epoch {epoch} wrote");
                assert!(err.contains(&format!("stale epoch {epoch}")), "{err}");
                format!("epoch {epoch} refused")
            }
        }
    }

    fn crash_secondary(&mut self, failpoint: &str, pages: usize) -> String {
        let committed = FAILPOINTS.iter().find(|f| f.0 == failpoint).unwrap().1;
        let (p, s) = (self.m.primary, self.m.secondary());
        let before = id_of(&self.primary_status());
        let sec_before = id_of(&status(self.agent(s)));
        self.write(p, pages);
        kill(self.agent_mut(s));
        respawn(self.agent_mut(s), &[("MOVER_FAILPOINT", failpoint)]);
        let out = call(self.agent(p), "sync", &[]);
        assert!(
            !out.status.success(),
            "{failpoint}: the secondary died in the cycle, yet sync succeeded"
        );
        // The secondary aborted at the failpoint (and nothing else failed).
        let deadline = Instant::now() + DEADLINE;
        let exit = loop {
            if let Some(e) = self.agent_mut(s).child.try_wait().unwrap() {
                break e;
            }
            assert!(
                Instant::now() < deadline,
                "{failpoint}: the secondary did not abort; sync said {}",
                stderr(&out)
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert_eq!(exit.signal(), Some(libc_sigabrt()), "{failpoint}: {exit:?}");
        self.m.seen[s.i()] = self.m.epoch;
        self.m.degraded = true;
        respawn(self.agent_mut(s), &[]);
        let want_id = if committed {
            self.m.cycle_committed();
            self.m.unacknowledged = true;
            before + 1
        } else {
            sec_before
        };
        let now = self.file_hash(s);
        assert_eq!(
            now,
            self.m.hash(s),
            "{failpoint}: the secondary equals cycle {} after the restart, never a mix",
            if committed { "N" } else { "N-1" }
        );
        let st = status(self.agent(s));
        assert_eq!(id_of(&st), want_id, "{failpoint}: the applied cycle: {st}");
        let ps = self.primary_status();
        assert_eq!(id_of(&ps), before, "the primary saw the cycle fail: {ps}");
        format!(
            "secondary at cycle {want_id} ({})",
            if committed { "new" } else { "previous" }
        )
    }

    fn kill_restart(&mut self, side: Side) -> String {
        let is_primary = side == self.m.primary;
        let before = id_of(&status(self.agent(side)));
        self.agent_mut(side).kill_and_restart();
        wait_ready(self.agent(side));
        if !is_primary {
            // A secondary, or a fenced old primary: it stays as it was.
            if let Some(split) = &self.m.split {
                let s = status(self.agent(split.old));
                assert_eq!(s["state"], "Fenced", "a halt survives a restart: {s}");
            }
            return String::new();
        }
        // A primary starts a cycle at once.
        let (s, ok) = settle(self.agent(side), (0, 0), before);
        match &self.m.split {
            None => {
                assert!(ok, "the restarted primary's cycle failed: {s}");
                self.m.degraded = false;
                self.check_cycle("restart", &s, before);
                cycle_line(&s)
            }
            Some(split) => {
                assert!(!ok, "no secondary to cycle into: {s}");
                assert_eq!(s["state"], "Degraded", "{s}");
                if split.up {
                    self.m.seen[split.old.i()] = self.m.epoch;
                }
                self.m.degraded = true;
                "its cycle failed: no secondary".into()
            }
        }
    }

    fn kill_both_mid_cycle(&mut self, delay_ms: u64, pages: usize) -> String {
        let (p, s) = (self.m.primary, self.m.secondary());
        let before = id_of(&self.primary_status());
        self.write(p, pages);
        let (old, new) = (self.m.hash(s), self.m.hash(p));
        let mut sync = std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
            .args([
                "replicate",
                "sync",
                NAME,
                "--agent",
                &control(self.agent(p)),
            ])
            .env("MOVER_TOKEN", TOKEN)
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        kill(self.agent_mut(p));
        kill(self.agent_mut(s));
        let synced = sync.wait().unwrap().success();
        // Recovery applies a committed journal or drops an uncommitted one.
        respawn(self.agent_mut(s), &[]);
        let now = self.file_hash(s);
        let committed = now == new;
        if committed {
            self.m.cycle_committed();
        } else {
            assert_eq!(
                now, old,
                "the secondary equals the cycle before or this one, never a mix"
            );
            assert!(
                !synced,
                "sync succeeded, yet the secondary does not hold its cycle"
            );
        }
        self.m.seen[s.i()] = self.m.epoch;
        // The primary's first cycle after the restart completes the replication.
        respawn(self.agent_mut(p), &[]);
        let (st, ok) = settle(self.agent(p), (0, 0), before);
        assert!(ok, "the restarted primary's cycle failed: {st}");
        let sec = id_of(&status(self.agent(s)));
        let st = wait_for(self.agent(p), "the primary's record of its cycle", |x| {
            id_of(x) == sec
        });
        self.m.degraded = false;
        let ids = if committed {
            vec![before + 1, before + 2]
        } else {
            vec![before + 1]
        };
        self.check_cycle_ids("the cycle after a kill mid-cycle", &st, &ids);
        format!(
            "sync {}, the killed cycle {}; then {}",
            if synced { "succeeded" } else { "failed" },
            if committed { "committed" } else { "dropped" },
            cycle_line(&st)
        )
    }

    fn planned_failover(&mut self) -> String {
        let (p, s) = (self.m.primary, self.m.secondary());
        let before = id_of(&self.primary_status());
        let diff = self.m.diff_pages();
        let d = ok_json("demote", call(self.agent(p), "demote", &[]));
        assert_eq!(d["role"], "secondary", "{d}");
        let c = &d["last_cycle"];
        assert_eq!(c["final"], true, "{d}");
        assert_eq!(c["id"].as_u64(), Some(before + 1), "{d}");
        assert_eq!(
            c["bytes_shipped"].as_u64(),
            Some(diff * PAGE),
            "the final cycle ships exactly the {diff} pages that differ: {d}"
        );
        self.m.cycle_committed();
        self.m.unacknowledged = false;
        assert_eq!(self.file_hash(p), self.file_hash(s), "the final cycle");
        let ss = status(self.agent(s));
        assert_eq!(ss["last_cycle"]["final"], true, "{ss}");
        let (counts0, id0) = (counts(&ss), id_of(&ss));
        let pr = ok_json("promote", call(self.agent(s), "promote", &[]));
        self.promoted(s, &pr);
        // The new primary's own first cycle: nothing to ship.
        let (st, ok) = settle(self.agent(s), counts0, id0);
        assert!(ok, "the new primary's first cycle: {st}");
        self.m.degraded = false;
        self.check_cycle("promote", &st, id0);
        assert_eq!(
            st["last_cycle"]["bytes_shipped"], 0,
            "no writes since the demote"
        );
        let h = st["history"].as_array().unwrap();
        assert_eq!(
            h.last().map(|h| (&h["epoch"], &h["last_common_cycle"])),
            Some((&Value::from(self.m.epoch), &Value::from(id0))),
            "{st}"
        );
        format!(
            "epoch {}, final cycle shipped {}",
            self.m.epoch,
            diff * PAGE
        )
    }

    /// The model after `s` was promoted, which answered `pr`: a new epoch, `s` primary.
    fn promoted(&mut self, s: Side, pr: &Value) {
        self.m.epoch += 1;
        self.m.primary = s;
        self.m.seen[s.i()] = self.m.epoch;
        assert_eq!(
            (pr["role"].as_str(), pr["epoch"].as_u64()),
            (Some("primary"), Some(self.m.epoch)),
            "{pr}"
        );
    }

    fn force_promote(&mut self) -> String {
        let (p, s) = (self.m.primary, self.m.secondary());
        kill(self.agent_mut(p));
        let ss = status(self.agent(s));
        if ss["last_cycle"]["final"] != true {
            refused(
                "promote without --force",
                call(self.agent(s), "promote", &[]),
                "not the final cycle of a demote",
            );
        }
        let (counts0, id0) = (counts(&ss), id_of(&ss));
        let pr = ok_json(
            "promote --force",
            call(self.agent(s), "promote", &["--force"]),
        );
        self.m.split = Some(Split {
            old: p,
            up: false,
            old_epoch: self.m.epoch,
            common: self.m.hash(s),
            unacknowledged: self.m.unacknowledged,
        });
        self.promoted(s, &pr);
        // Its first cycle cannot reach the old primary.
        let (st, ok) = settle(self.agent(s), counts0, id0);
        assert!(!ok, "the old primary is down: {st}");
        self.m.degraded = true;
        assert_eq!(st["state"], "Degraded", "{st}");
        assert_eq!(
            id_of(&st),
            id0,
            "promoted from its last applied cycle: {st}"
        );
        format!("epoch {} from cycle {id0}", self.m.epoch)
    }

    fn resync(&mut self, discard: bool) -> String {
        let split = self.m.split.clone().expect("a split");
        let (old, new) = (split.old, self.m.primary);
        let wrote = self.m.wrote[old.i()];
        assert_eq!(
            wrote,
            self.m.hash(old) != split.common,
            "the model's own bookkeeping: written since the last common cycle"
        );
        let mut said = String::new();
        if split.unacknowledged {
            said += "peer promoted from a cycle this side did not hear back about; ";
        }
        // Not written since the cycle the peer was promoted from (even one this side
        // shipped without hearing back, `split.unacknowledged`): a plain resync works.
        if wrote {
            refused(
                "resync of a written old primary",
                call(self.agent(old), "resync", &[]),
                "split brain",
            );
            let s = status(self.agent(old));
            assert_eq!(s["state"], "SplitBrain", "{s}");
            said += "split brain; ";
        }
        let args: &[&str] = if wrote || discard {
            &["--discard-local"]
        } else {
            &[]
        };
        let r = ok_json("resync", call(self.agent(old), "resync", args));
        assert_eq!(
            (r["role"].as_str(), r["state"].as_str()),
            (Some("secondary"), Some("Secondary")),
            "{r}"
        );
        // The new primary's next cycle makes both sides equal.
        let before = id_of(&self.primary_status());
        let s = ok_json("sync after resync", call(self.agent(new), "sync", &[]));
        self.m.split = None;
        self.m.degraded = false;
        self.check_cycle("failback", &s, before);
        said += &format!(
            "{}failback shipped {}",
            if args.is_empty() {
                ""
            } else {
                "--discard-local; "
            },
            s["last_cycle"]["bytes_shipped"]
        );
        said
    }

    // -----------------------------------------------------------------------------------
    // Invariants

    fn check(&mut self) {
        for side in [Side::A, Side::B] {
            assert_eq!(
                self.file_hash(side),
                self.m.hash(side),
                "{side:?}'s volume holds exactly what the model says"
            );
        }
        let up = |side: Side| self.m.split.as_ref().is_none_or(|s| s.old != side || s.up);
        for side in [Side::A, Side::B] {
            if !up(side) {
                continue;
            }
            let s = status(self.agent(side));
            let epoch = s["epoch"].as_u64().unwrap();
            assert!(
                epoch >= self.m.observed[side.i()],
                "{side:?}'s epoch went down from {}: {s}",
                self.m.observed[side.i()]
            );
            self.m.observed[side.i()] = epoch;
            let old = self.m.split.as_ref().filter(|x| x.old == side);
            if side == self.m.primary {
                let state = if self.m.degraded {
                    "Degraded"
                } else {
                    "Replicating"
                };
                assert_eq!(
                    (s["role"].as_str(), s["state"].as_str(), epoch),
                    (Some("primary"), Some(state), self.m.epoch),
                    "the primary {side:?}: {s}"
                );
            } else if let Some(old) = old {
                assert_eq!(
                    (s["role"].as_str(), s["state"].as_str(), epoch),
                    (Some("primary"), Some("Fenced"), old.old_epoch),
                    "the fenced old primary {side:?}: {s}"
                );
            } else {
                assert_eq!(
                    (s["role"].as_str(), s["state"].as_str()),
                    (Some("secondary"), Some("Secondary")),
                    "the secondary {side:?}: {s}"
                );
                assert!(epoch <= self.m.epoch, "{s}");
                assert!(
                    self.m.cycles.contains(&self.m.hash(side)),
                    "the secondary {side:?} equals a completed cycle"
                );
            }
        }
    }

    /// Brings a split to an end and runs a last cycle: both sides end equal.
    fn finish(&mut self, trace: &mut Trace) {
        let mut tail = Vec::new();
        if let Some(s) = &self.m.split {
            if !s.up {
                tail.push(Op::RestartOld);
            }
            tail.push(Op::Resync { discard: false });
        }
        tail.push(Op::Sync);
        for op in tail {
            self.step(trace, op);
        }
        assert_eq!(self.file_hash(Side::A), self.file_hash(Side::B));
    }

    fn step(&mut self, trace: &mut Trace, op: Op) {
        let t0 = Instant::now();
        trace.ops.push(format!("{op}"));
        let said = self.run(&op);
        self.check();
        let line = format!("{op} -> {said} [{} ms]", t0.elapsed().as_millis());
        eprintln!("[seed {}] #{:<3} {line}", trace.seed, trace.ops.len() - 1);
        *trace.ops.last_mut().unwrap() = line;
    }
}

/// A cycle, as the operation log shows it.
fn cycle_line(s: &Value) -> String {
    let c = &s["last_cycle"];
    format!(
        "cycle {} shipped {} read {}",
        c["id"], c["bytes_shipped"], c["bytes_read"]
    )
}

fn libc_sigabrt() -> i32 {
    6 // SIGABRT on Linux
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn random_operation_sequences_keep_both_volumes_equal_to_the_model() {
    let cases = env_u64("MOVER_MODEL_CASES", 3);
    let ops = env_u64("MOVER_MODEL_OPS", 12);
    let first = match std::env::var("MOVER_MODEL_SEED").as_deref() {
        Ok("random") => {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                % 1_000_000
        }
        Ok(s) => s.parse().expect("MOVER_MODEL_SEED is a number or `random`"),
        Err(_) => 1,
    };
    let fs = std::env::var("MOVER_MODEL_FS").unwrap_or_default();
    assert!(
        ["", "tmp", "xfs"].contains(&fs.as_str()),
        "MOVER_MODEL_FS is tmp or xfs"
    );
    let started = Instant::now();
    for seed in first..first + cases {
        let t0 = Instant::now();
        let on_xfs = fs == "xfs" || (fs.is_empty() && seed % 3 == 0);
        let mut trace = Trace {
            seed,
            fs: if on_xfs { "xfs" } else { "tmp" },
            ops: Vec::new(),
        };
        let mut case = Case::new(seed, on_xfs);
        case.check();
        for _ in 0..ops {
            let op = choose(&case.m, &mut case.rng);
            case.step(&mut trace, op);
        }
        case.finish(&mut trace);
        eprintln!(
            "[seed {seed}] passed: {} operations in {:.1}s",
            trace.ops.len(),
            t0.elapsed().as_secs_f64()
        );
    }
    eprintln!(
        "{cases} sequences of {ops} operations in {:.1}s",
        started.elapsed().as_secs_f64()
    );
}
