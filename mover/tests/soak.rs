//! mover-soak: two clusters on real nodes replicating a PostgreSQL volume under load,
//! while two nemeses, random from a printed seed, inject faults one after another, and a
//! checker holds the system to what it promises.
//!
//! ```text
//! cargo test -p mover --test soak                          # CI: seed 1, 1 minute of faults
//! cargo test -p mover --test soak -- --minutes 60 --seed 7 # long; the same seed, the same faults
//! ```
//!
//! **Setup.** Clusters `soaka` and `soakb` (`deploy/test-cluster/cluster.sh`, mover
//! installed from `deploy/base`), `app/data` a Block volume on a local disk of each (a
//! loop device over an image on the node's XFS), replicating every 2 s, each cycle a
//! point in time (a reflink clone of the image behind the device). PostgreSQL runs in a
//! pod on the primary's volume with pgbench at 200 transactions a second, plus a writer
//! that inserts rows one transaction at a time and logs each id, with the time, to the
//! node's disk (outside the volume) only after its COMMIT returned: the acknowledged
//! history. On each site's other node, a pod reads a populated volume (16 MiB, filled
//! by that node's agent from its disk and served through the agent's FUSE file) whole,
//! past every cache, every 2 s. A second volume of soaka (on its other node, written by
//! the S3 nemesis) is kept as DR snapshots in S3 (`s3s-fs` on the clusters' bridge) by a
//! class whose target is a repository, every 60 s, through a proxy that nemesis controls.
//!
//! **Nemesis**, one fault at a time with a calm spell (5–15 s) before each:
//! - kill -9 of an agent (either cluster, either node: the database's or the served pod's);
//! - an upgrade of either cluster's agents (the DaemonSet's rolling update: every agent
//!   pod replaced, one node at a time; the same image, the same path as a new one);
//! - kill -9 of either cluster's leading controller;
//! - an API server down for 5–20 s (either cluster);
//! - the network between the clusters cut (packets dropped both ways) for 20–45 s;
//! - a planned failover (the database stopped, the primary demoted, the secondary
//!   promoted, the database started there), which the next one reverses;
//! - a forced failover: the primary's node loses power (every process on it SIGKILLed,
//!   the database mid-transaction), the secondary is promoted alone; then the node comes
//!   back, its side is fenced, made the secondary with autoResync and resynced.
//!
//! **The S3 nemesis**, beside it on a thread of its own (its own seed from the same one):
//! S3 answers 503 SlowDown to every request for 130–150 s (longer than twice the
//! interval), or holds each back 1–3 s for 30–60 s.
//!
//! **Checker:**
//! - after every fault, replication resumes: a cycle newer than the fault's end within
//!   two minutes;
//! - a cut longer than twice the interval is visible in the primary's status while it
//!   lasts: `Degraded`, or a `lastSyncTime` older than twice the interval; so is an S3
//!   refusal in the archive's, and its snapshots resume after each S3 fault;
//! - a planned failover loses no acknowledged write (0, exactly); the new primary's ext4
//!   is fsck-clean, PostgreSQL starts on it, pgbench's balances agree and
//!   `pg_amcheck --heapallindexed` passes;
//! - a forced failover leaves a prefix of the acknowledged history, and what it lost was
//!   acknowledged after the lastSyncTime read just before the loss (it spans at most the
//!   RPO reported then); the replica's ext4 mounts (journal replayed) and checks clean,
//!   PostgreSQL recovers, its transactions are whole;
//! - the served pods never see a failed or wrong read, and run throughout (the same pod,
//!   never restarted) across their agents' kills and upgrades;
//! - the archive's last snapshot, restored from S3, is its volume byte for byte;
//! - no two leaders: no write by a controller after another took its Lease (audit log).
//!   (Not RBAC: an API server just restarted may answer 403 until its caches sync.)
//!
//! When the time is up, each kind of fault not drawn yet is injected once (so CI's short
//! run has them all); a forced failover and then a planned one (onto the side that was
//! lost and resynced) end every run, so every run loses a site and every acknowledged
//! write is checked.

#[cfg(not(feature = "controller"))]
fn main() {}

#[cfg(feature = "controller")]
mod common;

#[cfg(feature = "controller")]
fn main() {
    if let Some(options) = soak::options(std::env::args().skip(1)) {
        soak::run(options);
    }
}

#[cfg(feature = "controller")]
mod soak {
    use super::common::{
        MIB, POPULATED_STORAGE_CLASS, blake3_of,
        cluster::CONTROLLER_USER,
        make_image,
        pg::{assert_ext4_clean, assert_ext4_recovers_clean, assert_transactions_whole_by},
        populate::{add_agent_exports, populated_pvc, sha256_of, volume_pod},
        scribble_pages,
        site::*,
        slowdown::{PASS, REFUSE, SlowDown},
    };
    use k8s_openapi::jiff::Timestamp;
    use rand::{Rng, SeedableRng, rngs::StdRng};
    use snapshots::testing::{ACCESS_KEY, S3Server, SECRET_KEY};
    use std::{
        collections::{BTreeMap, BTreeSet},
        sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed},
        time::{Duration, Instant},
    };

    /// The name `cargo test` filters match (`--skip on_real_nodes` skips it, as the
    /// other real-node tests).
    const NAME: &str = "on_real_nodes_soak";
    /// The volume: room for pgbench's tables at scale 2 and hours of history.
    const LEN: u64 = 384 * MIB;
    /// The class's schedulingInterval.
    const INTERVAL: Duration = Duration::from_secs(2);
    /// How long replication may take to resume after a fault.
    const RESUME: Duration = Duration::from_secs(120);
    /// How long a killed container may take to run again: the kubelet holds back a
    /// container that keeps failing (10 s, doubling, at most 300 s, reset after 10
    /// minutes of running), and a kill -9 counts as a failure. The first hour-long run
    /// killed one agent six times in 20 minutes and waited out that back-off.
    const RESTART: Duration = Duration::from_secs(330);

    /// What the command line asks.
    pub struct Options {
        minutes: f64,
        seed: u64,
    }

    /// The options, or `None` when there is nothing to run (filtered out, `--list`,
    /// `--help`). The flags libtest takes are accepted and ignored: `cargo test` passes
    /// them to every test binary.
    pub fn options(args: impl Iterator<Item = String>) -> Option<Options> {
        let mut o = Options {
            minutes: 1.0,
            seed: 1,
        };
        let mut args = args.peekable();
        let mut filters = Vec::new();
        let mut skips = Vec::new();
        while let Some(a) = args.next() {
            let mut value = |what: &str| {
                args.next()
                    .unwrap_or_else(|| panic!("{a} needs a value ({what})"))
            };
            match a.as_str() {
                "--minutes" => o.minutes = value("minutes").parse().expect("--minutes N"),
                "--seed" => o.seed = value("seed").parse().expect("--seed S"),
                "--help" | "-h" => {
                    println!("cargo test -p mover --test soak -- [--minutes N (1)] [--seed S (1)]");
                    return None;
                }
                "--list" => {
                    println!("{NAME}: test");
                    return None;
                }
                "--skip" => skips.push(value("a name")),
                "--test-threads" | "--format" | "--color" | "--logfile" | "-Z" => {
                    value("its value");
                }
                flag if flag.starts_with('-') => {}
                filter => filters.push(filter.to_string()),
            }
        }
        let wanted = filters.iter().all(|f| NAME.contains(f.as_str()))
            && !skips.iter().any(|s| NAME.contains(s.as_str()));
        if !wanted {
            println!("{NAME}: filtered out");
            return None;
        }
        Some(o)
    }

    /// One fault of the nemesis.
    #[derive(Clone, Copy, Debug)]
    enum Fault {
        KillAgent { site: usize, node: u8 },
        UpgradeAgents { site: usize },
        KillLeader { site: usize },
        ApiServerDown { site: usize, secs: u64 },
        Cut { secs: u64 },
        PlannedFailover,
        ForcedFailover,
    }

    impl Fault {
        fn kind(&self) -> &'static str {
            match self {
                Fault::KillAgent { .. } => "agent killed (kill -9)",
                Fault::UpgradeAgents { .. } => "agents upgraded (every agent pod replaced)",
                Fault::KillLeader { .. } => "leading controller killed (kill -9)",
                Fault::ApiServerDown { .. } => "API server down",
                Fault::Cut { .. } => "network cut between the clusters",

                Fault::PlannedFailover => "planned failover",
                Fault::ForcedFailover => {
                    "forced failover (the primary's node lost), return, resync"
                }
            }
        }

        /// One fault of each kind but the failovers (a run ends with those), the agent
        /// killed on the served pod's node.
        fn every(rng: &mut StdRng) -> Vec<Fault> {
            let site = rng.random_range(0..2);
            vec![
                Fault::KillAgent {
                    site,
                    node: if site == 0 { 2 } else { 1 },
                },
                Fault::UpgradeAgents { site: 1 - site },
                Fault::KillLeader { site },
                Fault::ApiServerDown {
                    site: 1 - site,
                    secs: rng.random_range(5..=20),
                },
                Fault::Cut {
                    secs: rng.random_range(20..=45),
                },
            ]
        }

        fn pick(rng: &mut StdRng) -> Fault {
            let site = rng.random_range(0..2);
            match rng.random_range(0..13) {
                0..=2 => Fault::KillAgent {
                    site,
                    node: rng.random_range(1..=2),
                },
                3 => Fault::UpgradeAgents { site },
                4..=5 => Fault::KillLeader { site },
                6..=7 => Fault::ApiServerDown {
                    site,
                    secs: rng.random_range(5..=20),
                },
                8..=9 => Fault::Cut {
                    secs: rng.random_range(20..=45),
                },
                10..=11 => Fault::PlannedFailover,
                _ => Fault::ForcedFailover,
            }
        }
    }

    /// What the run saw, for its report.
    #[derive(Default)]
    struct Report {
        faults: BTreeMap<&'static str, u32>,
        /// Seconds from a fault's end to the next cycle.
        resumed: Vec<f64>,
        /// RPO samples (now - lastSyncTime, s) in calm spells, and the worst in faults.
        rpo_calm: Vec<f64>,
        rpo_worst_in_faults: f64,
        failovers: u32,
        acked_checked: usize,
        acked_lost: usize,
        /// Per forced failover: acknowledged writes lost, the seconds from the first of
        /// them to the loss, and the RPO the primary's status reported just before.
        forced: Vec<(usize, f64, f64)>,
        /// Whole reads by the served pods, and restarts of the agents serving them.
        served_reads: usize,
        served_restarts: u32,
        leader_writes_checked: usize,
    }

    /// The two sites and which one is primary.
    struct Pair {
        sites: [Site; 2],
        /// Which site is primary (the S3 nemesis reads the pair from its own thread).
        primary: AtomicUsize,
        script: String,
        /// The sha256 of each site's served volume's source.
        served: [String; 2],
        archive: Archive,
    }

    pub fn run(o: Options) {
        let started = Instant::now();
        eprintln!(
            "soak: seed {} for {} minutes (rerun: cargo test -p mover --test soak -- --minutes {} --seed {})",
            o.seed, o.minutes, o.minutes, o.seed
        );
        let Some(pair) = setup() else {
            return;
        };
        let stop = AtomicBool::new(false);
        let (mut report, s3) = std::thread::scope(|scope| {
            let s3 = scope.spawn(|| s3_nemesis(&pair, o.seed, &stop));
            let report = nemesis(&pair, &o, started, &s3);
            stop.store(true, Relaxed);
            (report, s3.join())
        });
        let s3 = s3.unwrap_or_else(|e| std::panic::resume_unwind(e));
        for (kind, n) in &s3.faults {
            *report.faults.entry(kind).or_default() += n;
        }
        check_served(&pair, &mut report);
        check_archive(&pair);
        for s in &pair.sites {
            let (doubled, checked) = two_leaders(s);
            assert!(
                doubled.is_empty(),
                "{}: two leaders: {doubled:#?}",
                s.c.name
            );
            assert!(
                checked > 0,
                "{}: the audit log shows no write of a Lease holder: nothing was checked",
                s.c.name
            );
            report.leader_writes_checked += checked;
            // No RBAC check here (kube_nodes makes it): an API server just started
            // may refuse (403) until its RBAC caches have synced, and the soak restarts
            // them (seen once: the controller's Lease get, refused right after).
        }
        print_report(&o, &report, &s3, started.elapsed());
    }

    /// The nemesis of the replicated database: faults one after another for the minutes
    /// asked, then each kind not drawn yet, then a forced and a planned failover. Stops
    /// early if the S3 nemesis failed.
    fn nemesis(
        pair: &Pair,
        o: &Options,
        started: Instant,
        s3: &std::thread::ScopedJoinHandle<'_, S3Report>,
    ) -> Report {
        let mut rng = StdRng::seed_from_u64(o.seed);
        let mut report = Report::default();
        let until = Instant::now() + Duration::from_secs_f64(o.minutes * 60.0);
        let mut n = 0;
        let mut one = |pair: &Pair, rng: &mut StdRng, report: &mut Report, fault: Fault| {
            assert!(
                !s3.is_finished(),
                "the S3 nemesis stopped early (its panic is above)"
            );
            calm(pair, rng, report);
            n += 1;
            eprintln!(
                "soak: [{:>6.1} s] fault {n}: {fault:?}",
                started.elapsed().as_secs_f64()
            );
            inject(pair, fault, report);
            *report.faults.entry(fault.kind()).or_default() += 1;
            match fault {
                Fault::KillAgent { site, node } if node == served_node(&pair.sites[site]) => {
                    report.served_restarts += 1
                }
                Fault::UpgradeAgents { .. } => report.served_restarts += 1,
                _ => {}
            }
        };
        while Instant::now() < until {
            let fault = Fault::pick(&mut rng);
            one(pair, &mut rng, &mut report, fault);
        }
        // Every kind of fault at least once, however short the run (CI's); then every run
        // loses a primary, and every acknowledged write is checked by a last planned
        // failover, onto the side that was lost and resynced.
        eprintln!("soak: closing: every kind of fault not drawn yet, then two failovers");
        for fault in Fault::every(&mut rng) {
            if !report.faults.contains_key(fault.kind()) {
                one(pair, &mut rng, &mut report, fault);
            }
        }
        for fault in [Fault::ForcedFailover, Fault::PlannedFailover] {
            one(pair, &mut rng, &mut report, fault);
        }
        report
    }

    fn setup() -> Option<Pair> {
        let a = Site::start("soaka", 7)?;
        let mut b = Site::start("soakb", 8).expect("the second cluster");
        b.on = 2;
        for s in [&a, &b] {
            add_agent_exports(
                &s.c,
                "[exports.served]\npath = \"/mnt/disks/served.img\"\nread_only = true\nnamespaces = [\"app\"]\n",
            );
            s.database_volume(LEN);
        }
        // A point in time required (the class's default): each cycle clones the image
        // behind the volume's loop device, so a forced failover opens a crash-consistent
        // database.
        replicating(&a, &b, "");
        assert_eq!(a.condition("PointInTime").0, "True", "{}", a.vr()["status"]);
        let served = [serve_a_pod(&a), serve_a_pod(&b)];
        let archive = archive_setup(&a);
        let pair = Pair {
            sites: [a, b],
            primary: AtomicUsize::new(0),
            script: soak_script(),
            served,
            archive,
        };
        db_start_running(pair.p(), "data", &pair.script);
        db_load(pair.p());
        Some(pair)
    }

    impl Pair {
        fn primary(&self) -> usize {
            self.primary.load(Relaxed)
        }

        fn p(&self) -> &Site {
            &self.sites[self.primary()]
        }

        fn s(&self) -> &Site {
            &self.sites[1 - self.primary()]
        }
    }

    /// The node of `s` that serves a pod from a populated volume: the one its database
    /// is not on (it never loses power).
    fn served_node(s: &Site) -> u8 {
        3 - s.on
    }

    /// A populated volume served to a pod by an agent (through its FUSE file, as every
    /// populated PVC is until its pod's next stage), on [`served_node`]: `app/served`,
    /// filled from an export on that node's disk; its pod reads the whole device past
    /// every cache every 2 s and logs each read's sum, or its failure. Returns the
    /// source's sum.
    fn serve_a_pod(s: &Site) -> String {
        const LEN: u64 = 16 * MIB;
        let n = served_node(s);
        let image = s.c.disks(n).join("served.img");
        make_image(&image, LEN, 55, &[(0, 4 * MIB), (LEN - 4 * MIB, 4 * MIB)]);
        s.c.apply(&format!(
            "{POPULATED_STORAGE_CLASS}---\napiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata: {{name: served, namespace: app}}\nspec:\n  agent: agent://{}@{}:7070/served\n---\n{}",
            s.c.node(n),
            s.c.node_ip(n),
            populated_pvc("served", "mover-populated", "Block", &LEN.to_string())
        ));
        volume_pod(
            &s.c,
            "served",
            n,
            true,
            "set -o pipefail; while :; do \
               if h=$(dd if=/dev/v bs=1M iflag=direct 2>/dev/null | sha256sum); then echo \"read ${h%% *}\"; \
               else echo \"failed $(date +%s)\"; fi; sleep 2; done",
        );
        let want = sha256_of(&image);
        s.c.wait("the served pod's first read", WAIT, || {
            served_reads(s, &want).0 > 0
        });
        want
    }

    /// The served pod's reads so far: (whole reads that were the source's, failures and
    /// reads that were not, as lines). The pod must be the first and only one, running.
    fn served_reads(s: &Site, want: &str) -> (usize, Vec<String>) {
        let log = s.c.kubectl(&["logs", "-n", "app", "served"]);
        let log = String::from_utf8_lossy(&log.stdout).into_owned();
        let good = log.lines().filter(|l| *l == format!("read {want}")).count();
        let bad = log
            .lines()
            .filter(|l| !l.is_empty() && *l != format!("read {want}"))
            .map(str::to_string)
            .collect();
        (good, bad)
    }

    /// Every read of each site's served pod was whole and the source's, and the pod ran
    /// throughout (the same pod, its container never restarted).
    fn check_served(pair: &Pair, report: &mut Report) {
        for (s, want) in pair.sites.iter().zip(&pair.served) {
            let (good, bad) = served_reads(s, want);
            assert!(
                bad.is_empty(),
                "{}: the served pod saw {} failed or wrong reads across its agent's restarts: {:?}",
                s.c.name,
                bad.len(),
                &bad[..bad.len().min(10)]
            );
            assert_eq!(
                s.c.get(
                    &["pod/served", "-n", "app"],
                    "{.status.phase} {.status.containerStatuses[0].restartCount}"
                ),
                "Running 0",
                "{}: the served pod did not run throughout",
                s.c.name
            );
            report.served_reads += good;
        }
    }

    /// The archive: a second volume of soaka (on [`served_node`]) kept as DR snapshots in
    /// S3 by a class whose target is a repository, every [`ARCHIVE_INTERVAL`], through a
    /// proxy the nemesis makes refuse every request (503 SlowDown) or hold each back.
    struct Archive {
        image: std::path::PathBuf,
        proxy: SlowDown,
        s3: S3Server,
        dir: tempfile::TempDir,
    }

    const ARCHIVE_LEN: u64 = 64 * MIB;
    const ARCHIVE_INTERVAL: Duration = Duration::from_secs(60);
    const ARCHIVE_REPO: &str = "s3://soak/archive";
    /// How long the archive may take to snapshot again after an S3 fault: its next tick,
    /// the S3 client's back-off, and the controller's next look (one interval apart).
    const ARCHIVE_RESUME: Duration = Duration::from_secs(240);

    /// One fault of the S3 nemesis.
    #[derive(Clone, Copy, Debug)]
    enum S3Fault {
        /// Every request answered 503 SlowDown, longer than twice the interval.
        Down { secs: u64 },
        /// Every request held back `ms`.
        Slow { secs: u64, ms: u64 },
    }

    impl S3Fault {
        fn kind(&self) -> &'static str {
            match self {
                S3Fault::Down { .. } => "S3 answers 503 SlowDown to every request",
                S3Fault::Slow { .. } => "S3 holds every request back 1-3 s",
            }
        }

        fn pick(rng: &mut StdRng, nth: u32) -> S3Fault {
            let down = S3Fault::Down {
                secs: rng.random_range(130..=150),
            };
            let slow = S3Fault::Slow {
                secs: rng.random_range(30..=60),
                ms: rng.random_range(1000..=3000),
            };
            // Each kind first, then either.
            match nth {
                0 => down,
                1 => slow,
                _ if rng.random_bool(0.5) => down,
                _ => slow,
            }
        }
    }

    /// What the S3 nemesis saw.
    #[derive(Default)]
    struct S3Report {
        faults: BTreeMap<&'static str, u32>,
        resumed: Vec<f64>,
        /// Requests the proxy refused, and passed (held back or not), during faults.
        refused: u64,
        passed: u64,
        /// Pages written into the archive's volume.
        pages: u64,
    }

    /// The S3 nemesis, beside the other (its own seed, so each one's faults come in the
    /// same order for the same seed): pages written into the archive's volume, a calm
    /// spell of 20–60 s (5–10 s before the first two), an S3 fault, the archive's snapshots resumed; until `stop` and
    /// each kind done once.
    fn s3_nemesis(pair: &Pair, seed: u64, stop: &AtomicBool) -> S3Report {
        let mut rng = StdRng::seed_from_u64(seed.wrapping_add(0x5333));
        let mut report = S3Report::default();
        let mut nth = 0;
        while !(stop.load(Relaxed) && nth >= 2) {
            report.pages += scribble_pages(
                &pair.archive.image,
                rng.random(),
                rng.random_range(1..=64),
                0..ARCHIVE_LEN,
            );
            // Short calms before the first two (CI's run waits on this nemesis).
            let calm = if nth < 2 { 5..=10 } else { 20..=60 };
            std::thread::sleep(Duration::from_secs(rng.random_range(calm)));
            let fault = S3Fault::pick(&mut rng, nth);
            nth += 1;
            eprintln!("soak: S3 fault {nth}: {fault:?}");
            let (mode, secs) = match fault {
                S3Fault::Down { secs } => (REFUSE, secs),
                S3Fault::Slow { secs, ms } => (ms, secs),
            };
            s3_fault(pair, mode, secs, &mut report);
            archive_resumed(pair, fault.kind(), &mut report);
            *report.faults.entry(fault.kind()).or_default() += 1;
        }
        report
    }

    fn archive_setup(s: &Site) -> Archive {
        let dir = tempfile::tempdir_in("/var/tmp").unwrap();
        let s3 = S3Server::start_on(&dir.path().join("s3"), GATEWAY);
        s3.create_bucket("soak");
        let proxy = SlowDown::controlled(&s3.endpoint, GATEWAY);
        let n = served_node(s);
        let image = s.c.disks(n).join("archive.img");
        make_image(&image, ARCHIVE_LEN, 77, &[(0, 8 * MIB)]);
        local_block_device(&s.c, n, "archive");
        let archive = Archive {
            image,
            proxy,
            s3,
            dir,
        };
        archive.mover(&["repo", "init", ARCHIVE_REPO]);
        s.c.apply(&format!(
            r#"{volume}---
apiVersion: v1
kind: Secret
metadata: {{name: soak-s3, namespace: mover-system}}
stringData: {{password: soak-password, AWS_ACCESS_KEY_ID: {key}, AWS_SECRET_ACCESS_KEY: {secret}}}
---
apiVersion: replication.mover/v1alpha1
kind: VolumeReplicationClass
metadata: {{name: mover-s3}}
spec:
  provisioner: kubernetes.io/no-provisioner
  parameters:
    target: {ARCHIVE_REPO}
    schedulingInterval: {interval}s
    keepLast: "3"
    s3Endpoint: {endpoint}
    s3Region: us-east-1
    replication.storage.openshift.io/replication-secret-name: soak-s3
    replication.storage.openshift.io/replication-secret-namespace: mover-system
---
apiVersion: replication.mover/v1alpha1
kind: VolumeReplication
metadata: {{name: archive, namespace: app}}
spec:
  volumeReplicationClass: mover-s3
  replicationState: primary
  dataSource: {{kind: PersistentVolumeClaim, name: archive}}
"#,
            volume = local_block_volume(
                "pv-archive",
                "archive",
                ARCHIVE_LEN / MIB,
                "/mnt/disks/archive",
                &s.c.node(n)
            ),
            key = ACCESS_KEY,
            secret = SECRET_KEY,
            interval = ARCHIVE_INTERVAL.as_secs(),
            endpoint = archive.proxy.endpoint,
        ));
        s.c.wait("the archive's first snapshot", WAIT, || {
            archive_synced(s).is_some()
        });
        archive
    }

    impl Archive {
        /// `mover ARGS` as an operator on this machine runs it against the repository (S3
        /// itself, not the proxy).
        fn mover(&self, args: &[&str]) {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
                .args(args)
                .env("MOVER_S3_ENDPOINT", &self.s3.endpoint)
                .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
                .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
                .env("AWS_REGION", "us-east-1")
                .env("MOVER_PASSWORD", "soak-password")
                .env("MOVER_CACHE_DIR", self.dir.path().join("cache"))
                .output()
                .unwrap();
            assert!(out.status.success(), "mover {args:?}: {out:?}");
        }
    }

    /// The archive VolumeReplication's status; null while the API server does not
    /// answer (the other nemesis may have stopped it).
    fn archive_status(s: &Site) -> serde_json::Value {
        let out =
            s.c.kubectl(&["get", "vr", "archive", "-n", "app", "-o", "json"]);
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap_or_default()["status"]
            .clone()
    }

    /// The archive's last snapshot's time.
    fn archive_synced(s: &Site) -> Option<Timestamp> {
        archive_status(s)["lastSyncTime"].as_str()?.parse().ok()
    }

    /// S3 in `mode` ([`REFUSE`], or each request held back that many ms) for `secs`.
    /// A refusal longer than twice the interval must show in the archive's status while
    /// it lasts: `Degraded`, or a lastSyncTime older than twice the interval.
    fn s3_fault(pair: &Pair, mode: u64, secs: u64, report: &mut S3Report) {
        let (s, proxy) = (&pair.sites[0], &pair.archive.proxy);
        let (refused, passed) = (proxy.refused.load(Relaxed), proxy.passed.load(Relaxed));
        proxy.set(mode);
        let since = Instant::now();
        let mut seen = None;
        while since.elapsed() < Duration::from_secs(secs) {
            std::thread::sleep(Duration::from_secs(1));
            let st = archive_status(s);
            let degraded = st["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Degraded" && c["status"] == "True");
            let behind = st["lastSyncTime"]
                .as_str()
                .and_then(|t| t.parse::<Timestamp>().ok())
                .map(|t| Timestamp::now().duration_since(t).as_secs_f64())
                .unwrap_or_default();
            if seen.is_none() && (degraded || behind > 2.0 * ARCHIVE_INTERVAL.as_secs_f64()) {
                seen = Some((since.elapsed().as_secs_f64(), degraded, behind));
            }
        }
        proxy.set(PASS);
        report.refused += proxy.refused.load(Relaxed) - refused;
        report.passed += proxy.passed.load(Relaxed) - passed;
        match seen {
            Some((at, degraded, behind)) => eprintln!(
                "soak: the S3 fault showed after {at:.1} s (Degraded {degraded}, last snapshot {behind:.1} s old)"
            ),
            // A slow S3 may keep up: only a refusal past twice the interval must show.
            None if mode == REFUSE && secs > 2 * ARCHIVE_INTERVAL.as_secs() => panic!(
                "S3 refused every request for {secs} s and the archive's status never showed it: {}",
                archive_status(s)
            ),
            None => {
                eprintln!("soak: the slow S3 did not hold the archive back past twice its interval")
            }
        }
    }

    /// Waits until the archive has a snapshot taken after the fault's end.
    fn archive_resumed(pair: &Pair, what: &str, report: &mut S3Report) {
        let (s, after, since) = (&pair.sites[0], Timestamp::now(), Instant::now());
        s.c.wait(
            &format!("the archive's snapshots resumed after {what}"),
            ARCHIVE_RESUME,
            || archive_synced(s).is_some_and(|t| t > after),
        );
        report.resumed.push(since.elapsed().as_secs_f64());
    }

    /// With nothing written since, the archive's next snapshot, restored from S3, is the
    /// volume byte for byte.
    fn check_archive(pair: &Pair) {
        let s = &pair.sites[0];
        let after = Timestamp::now();
        s.c.wait("the archive's snapshot of its last writes", RESUME, || {
            archive_synced(s).is_some_and(|t| t > after)
        });
        let restored = pair.archive.dir.path().join("restored.img");
        pair.archive.mover(&[
            "snapshot",
            "restore",
            ARCHIVE_REPO,
            "latest",
            restored.to_str().unwrap(),
        ]);
        assert_eq!(
            blake3_of(&restored, ARCHIVE_LEN),
            blake3_of(&pair.archive.image, ARCHIVE_LEN),
            "the archive's last snapshot, restored, is not the volume"
        );
    }

    /// [`DB_SCRIPT`] with the acknowledged-history writer beside pgbench: each id is
    /// appended to `/out/acked` (the node's disk) only after its INSERT's COMMIT
    /// returned. A failed insert re-reads where the table is (its COMMIT may have
    /// landed without an answer: such an id is in the table, not in the log).
    fn soak_script() -> String {
        let mut s = DB_SCRIPT.to_string();
        let mut edit = |old: &str, new: &str| {
            assert!(s.contains(old), "DB_SCRIPT changed: no {old:?}");
            s = s.replacen(old, new, 1);
        };
        edit(
            "load=\n",
            r#"sql "create table if not exists acked (id bigint primary key, at timestamptz not null default now())"
writer() {
  i=$(sql "select coalesce(max(id), 0) from acked")
  while :; do
    i=$((i + 1))
    if sql "insert into acked (id) values ($i)" >/dev/null 2>&1; then
      echo "$i $(date +%s.%N)" >>/out/acked
    else
      sleep 0.2
      i=$(sql "select coalesce(max(id), 0) from acked" 2>/dev/null || echo $((i - 1)))
    fi
    sleep 0.05
  done
}
writer_pid=
load=
"#,
        );
        edit(
            "  [ -z \"$load\" ] ||",
            "  [ -z \"$writer_pid\" ] || { kill -TERM \"$writer_pid\"; wait \"$writer_pid\" || true; }\n  [ -z \"$load\" ] ||",
        );
        edit("-T 3600", "-T 86400");
        // Hours of pgbench: the WAL kept small enough for the volume (checkpoints at
        // most a minute and 64 MiB of WAL apart).
        edit(
            "-o \"-c listen_addresses=\"",
            "-o \"-c listen_addresses= -c max_wal_size=64MB -c checkpoint_timeout=60s\"",
        );
        edit("load=$!\n", "load=$!\nwriter &\nwriter_pid=$!\n");
        s
    }

    /// A calm spell of 5–15 s: the primary's RPO sampled each second.
    fn calm(pair: &Pair, rng: &mut StdRng, report: &mut Report) {
        let until = Instant::now() + Duration::from_secs(rng.random_range(5..=15));
        while Instant::now() < until {
            if let Some(rpo) = rpo(pair.p()) {
                report.rpo_calm.push(rpo);
            }
            std::thread::sleep(Duration::from_secs(1));
        }
    }

    /// The primary's RPO as its status tells it: now - lastSyncTime, in seconds.
    fn rpo(s: &Site) -> Option<f64> {
        let out = s.c.kubectl(&[
            "get",
            "vr",
            s.vr,
            "-n",
            "app",
            "-o",
            "jsonpath={.status.lastSyncTime}",
        ]);
        let at: Timestamp = String::from_utf8_lossy(&out.stdout).trim().parse().ok()?;
        Some(Timestamp::now().duration_since(at).as_secs_f64())
    }

    /// The primary's lastSyncTime.
    fn last_sync(s: &Site) -> Option<Timestamp> {
        s.vr()["status"]["lastSyncTime"].as_str()?.parse().ok()
    }

    /// Waits until the primary has a cycle newer than `after`; records how long it took.
    fn resumed(pair: &Pair, after: Timestamp, since: Instant, what: &str, report: &mut Report) {
        let p = pair.p();
        p.c.wait(&format!("replication resumed after {what}"), RESUME, || {
            last_sync(p).is_some_and(|t| t > after)
        });
        report.resumed.push(since.elapsed().as_secs_f64());
    }

    fn inject(pair: &Pair, fault: Fault, report: &mut Report) {
        // The cycle that shows replication resumed begins after this.
        let mut begun = Timestamp::now();
        match fault {
            Fault::KillAgent { site, node } => {
                let s = &pair.sites[site];
                let node = s.c.node(node);
                let env = format!("NODE_NAME={node}");
                let pid = process_of("agent", &env).expect("the agent's process");
                kill(pid, rustix::process::Signal::KILL);
                s.c.wait("the agent started again", RESTART, || {
                    process_of("agent", &env).is_some_and(|p| p != pid)
                });
            }
            Fault::UpgradeAgents { site } => {
                // What an upgrade does: the DaemonSet's rolling update, one node at a time.
                let ds = ["ds/mover-agent", "-n", "mover-system"];
                let c = &pair.sites[site].c;
                c.kubectl_ok(&[&["rollout", "restart"][..], &ds].concat());
                c.kubectl_ok(&[&["rollout", "status"][..], &ds, &["--timeout=600s"]].concat());
            }
            Fault::KillLeader { site } => {
                let s = &pair.sites[site];
                let leading = leader(s);
                let env = format!("HOSTNAME={leading}");
                let pid = process_of("controller", &env).expect("the leader's process");
                kill(pid, rustix::process::Signal::KILL);
                s.c.wait("a leader again", RESTART, || {
                    let now = leader(s);
                    process_of("controller", &format!("HOSTNAME={now}")).is_some_and(|p| p != pid)
                });
            }
            Fault::ApiServerDown { site, secs } => {
                let s = &pair.sites[site];
                s.c.apiserver("stop");
                std::thread::sleep(Duration::from_secs(secs));
                s.c.apiserver("start");
            }
            Fault::Cut { secs } => {
                cut(pair, secs, report);
                // A cycle that began before the cut is no sign of its end.
                begun = Timestamp::now();
            }
            Fault::PlannedFailover => {
                failover(pair, report);
                return;
            }
            Fault::ForcedFailover => {
                forced_failover(pair, report);
                begun = Timestamp::now();
            }
        }
        resumed(pair, begun, Instant::now(), fault.kind(), report);
    }

    fn kill(pid: i32, signal: rustix::process::Signal) {
        let pid = rustix::process::Pid::from_raw(pid).expect("a pid");
        rustix::process::kill_process(pid, signal).expect("kill");
    }

    /// The clusters cut apart for `secs`: every packet between their nodes (and pods)
    /// dropped both ways, in each node's network namespace. While it lasts, the
    /// primary's status must show it once it is longer than twice the interval.
    fn cut(pair: &Pair, secs: u64, report: &mut Report) {
        let rules = |add: bool| {
            for (s, other) in [(pair.p(), pair.s()), (pair.s(), pair.p())] {
                let peer = other.c.node_ip(1);
                let net = peer.rsplit_once('.').unwrap().0;
                let pods = format!("10.{}.0.0/16", 100 + other.c.index);
                for n in 1..=2 {
                    let ns = format!("mover-{}-{n}", s.c.name);
                    for rule in [
                        ["INPUT", "-s", &format!("{net}.0/24")],
                        ["OUTPUT", "-d", &format!("{net}.0/24")],
                        ["INPUT", "-s", &pods],
                        ["OUTPUT", "-d", &pods],
                    ] {
                        let op = if add { "-I" } else { "-D" };
                        let out = std::process::Command::new("ip")
                            .args(["netns", "exec", &ns, "iptables", op, rule[0]])
                            .args(&rule[1..])
                            .args(["-j", "DROP"])
                            .output()
                            .unwrap();
                        assert!(out.status.success(), "iptables in {ns}: {out:?}");
                    }
                }
            }
        };
        rules(true);
        let since = Instant::now();
        let mut seen = None;
        while since.elapsed() < Duration::from_secs(secs) {
            std::thread::sleep(Duration::from_secs(1));
            let p = pair.p();
            let rpo = rpo(p).unwrap_or_default();
            report.rpo_worst_in_faults = report.rpo_worst_in_faults.max(rpo);
            let degraded = p.condition("Degraded").0 == "True";
            if seen.is_none()
                && (degraded || rpo > 2.0 * INTERVAL.as_secs_f64())
                && since.elapsed() > 2 * INTERVAL
            {
                seen = Some((since.elapsed().as_secs_f64(), degraded, rpo));
            }
        }
        rules(false);
        let (at, degraded, rpo) = seen.unwrap_or_else(|| {
            panic!(
                "a {secs} s cut never showed in the primary's status: {}",
                pair.p().vr()["status"]
            )
        });
        eprintln!("soak: the cut showed after {at:.1} s (Degraded {degraded}, RPO {rpo:.1} s)");
    }

    /// The acknowledged history: every id either side's writer logged.
    fn acknowledged(pair: &Pair) -> BTreeSet<i64> {
        pair.sites
            .iter()
            .flat_map(|s| acked_log(s).into_iter().map(|(id, _)| id))
            .collect()
    }

    /// Where `s`'s writer logs what it acknowledged: the node's disk, outside the volume.
    fn acked_log_path(s: &Site) -> std::path::PathBuf {
        s.c.disks(s.on).join("out/acked")
    }

    /// A writer's log: (id, when its COMMIT had returned, Unix seconds).
    type Acked = Vec<(i64, f64)>;

    /// `s`'s writer's log.
    fn acked_log(s: &Site) -> Acked {
        let text = std::fs::read_to_string(acked_log_path(s)).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
            })
            .collect()
    }

    /// The ids the table `acked` holds in the primary's database.
    fn held(p: &Site) -> BTreeSet<i64> {
        db_sql(p, "select id from acked")
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// A planned failover: the database stopped on the primary, which is demoted (its
    /// final cycle ships what was written), the secondary promoted, the database started
    /// there and checked: every acknowledged write is in it, its ext4 was clean, its
    /// transactions whole, its tables and indexes sound.
    fn failover(pair: &Pair, report: &mut Report) {
        let (old, new) = (pair.primary(), 1 - pair.primary());
        let started = Instant::now();
        {
            let (p, s) = (&pair.sites[old], &pair.sites[new]);
            p.c.kubectl_ok(&[
                "delete",
                "pod",
                "db",
                "-n",
                "app",
                "--wait",
                "--timeout=120s",
            ]);
            p.set_state("secondary");
            p.wait_vr("the primary demoted", |v| v.completed("Demoted"));
            s.set_state("primary");
            s.wait_vr("the secondary promoted", |v| v.completed("Promoted"));
            assert_ext4_clean(&s.image());
        }
        pair.primary.store(new, Relaxed);
        let p = pair.p();
        db_start_running(p, "data", &pair.script);
        let downtime = started.elapsed();
        let acked = acknowledged(pair);
        let held = held(p);
        let lost: Vec<i64> = acked.difference(&held).copied().collect();
        report.failovers += 1;
        report.acked_checked = acked.len();
        report.acked_lost += lost.len();
        assert!(
            lost.is_empty(),
            "a planned failover lost {} acknowledged writes of {}: {:?}",
            lost.len(),
            acked.len(),
            &lost[..lost.len().min(20)]
        );
        whole_then_load(p);
        eprintln!(
            "soak: failover to {} in {:.1} s: all {} acknowledged writes there",
            p.c.name,
            downtime.as_secs_f64(),
            acked.len()
        );
    }

    /// A forced failover, as a site's loss: the primary's node loses power (every process
    /// on it SIGKILLed, the database mid-transaction), and the secondary is promoted alone
    /// from its last applied cycle. Checked there: the ext4 mounts and checks clean,
    /// PostgreSQL recovers, the volume holds a prefix of the acknowledged history, and
    /// what it lacks was acknowledged after the lastSyncTime read just before the loss
    /// (so the lost tail spans at most the RPO reported then); its transactions whole.
    ///
    /// Then the old primary comes back (its database's pod deleted first, as a DR
    /// orchestrator removes the application from the lost site): it is fenced, made the
    /// secondary with autoResync, and resynced; its lost tail leaves the history (its
    /// log keeps what the volume held), and a later planned failover onto it checks it.
    fn forced_failover(pair: &Pair, report: &mut Report) {
        let (old, new) = (pair.primary(), 1 - pair.primary());
        let synced = last_sync(pair.p()).expect("a lastSyncTime before the loss");
        let rpo_before = rpo(pair.p()).unwrap_or_default();
        let started = Instant::now();
        let lost_at = Timestamp::now();
        {
            let (p, s) = (&pair.sites[old], &pair.sites[new]);
            p.c.node_power(p.on, "stop");
            s.set_state("primary");
            s.wait_vr("the secondary promoted by force", |v| {
                v.completed("Promoted")
            });
            assert_ext4_recovers_clean(&s.image());
        }
        pair.primary.store(new, Relaxed);
        let p = pair.p();
        db_start_running(p, "data", &pair.script);
        let downtime = started.elapsed();
        let held = held(p);
        let gone = &pair.sites[old];
        let acked = acked_log(gone);
        let (kept, lost): (Acked, Acked) = acked.iter().partition(|(id, _)| held.contains(id));
        let newest_kept = kept.iter().map(|e| e.0).max().unwrap_or(0);
        let not_tail: Vec<i64> = lost
            .iter()
            .map(|e| e.0)
            .filter(|id| *id < newest_kept)
            .collect();
        assert!(
            not_tail.is_empty(),
            "the promoted volume holds no prefix of the history: it holds id {newest_kept} but not {:?}",
            &not_tail[..not_tail.len().min(20)]
        );
        let synced_s = synced.as_millisecond() as f64 / 1000.0;
        let first_lost = lost.iter().map(|e| e.1).fold(f64::INFINITY, f64::min);
        // lastSyncTime is the cycle's point in time, as written (to the second at worst).
        assert!(
            lost.is_empty() || first_lost >= synced_s - 1.0,
            "a write acknowledged {:.1} s before the last cycle's point in time ({synced}) is lost ({} lost)",
            synced_s - first_lost,
            lost.len()
        );
        let lost_at_s = lost_at.as_millisecond() as f64 / 1000.0;
        let span = if lost.is_empty() {
            0.0
        } else {
            lost_at_s - first_lost
        };
        report.forced.push((lost.len(), span, rpo_before));
        whole_then_load(p);
        eprintln!(
            "soak: forced failover to {} in {:.1} s: {} of {} acknowledged writes of the lost side held, {} lost, acknowledged within {span:.1} s of the loss (RPO reported {rpo_before:.1} s)",
            p.c.name,
            downtime.as_secs_f64(),
            kept.len(),
            acked.len(),
            lost.len()
        );
        // The lost tail leaves the history before the site comes back.
        let log: String = kept.iter().map(|(id, at)| format!("{id} {at}\n")).collect();
        std::fs::write(acked_log_path(gone), log).unwrap();
        gone.c.kubectl_ok(&[
            "delete",
            "pod",
            "db",
            "-n",
            "app",
            "--force",
            "--grace-period=0",
        ]);
        gone.c.node_power(gone.on, "start");
        gone.wait_vr("the old primary back and fenced", |v| {
            v.condition("Degraded").0 == "True"
                && v.vr()["status"]["conditions"]
                    .to_string()
                    .contains("Fenced")
        });
        gone.c.kubectl_ok(&[
            "patch",
            "vr",
            gone.vr,
            "-n",
            "app",
            "--type",
            "merge",
            "-p",
            r#"{"spec":{"replicationState":"secondary","autoResync":true}}"#,
        ]);
        gone.wait_vr("the old primary resynced, a healthy secondary", |v| {
            v.vr()["status"]["state"] == "Secondary"
                && v.condition("Degraded") == ("False".into(), "Healthy".into())
        });
        report.failovers += 1;
    }

    /// The database of `p` checked whole (pgbench's balances, `pg_amcheck`), then its
    /// load started again.
    fn whole_then_load(p: &Site) {
        assert_transactions_whole_by(
            |sql| db_sql(p, sql),
            |program, args| {
                db_run(p, program, args);
            },
        );
        db_load(p);
    }

    /// Writes by a controller made after another had taken the Lease: from the audit
    /// log, each write's pod against the Lease's holder as its last successful write
    /// set it; and how many writes were checked so.
    fn two_leaders(s: &Site) -> (Vec<String>, usize) {
        let mut events = s.c.audit(CONTROLLER_USER);
        events.sort_by(|a, b| {
            a["requestReceivedTimestamp"]
                .as_str()
                .cmp(&b["requestReceivedTimestamp"].as_str())
        });
        let mut holder: Option<String> = None;
        let mut doubled = Vec::new();
        let mut checked = 0;
        for e in &events {
            let pod = e["user"]["extra"]["authentication.kubernetes.io/pod-name"][0]
                .as_str()
                .unwrap_or_default()
                .to_string();
            let verb = e["verb"].as_str().unwrap_or_default();
            if matches!(verb, "get" | "list" | "watch") {
                continue;
            }
            let ok = e["responseStatus"]["code"]
                .as_i64()
                .is_some_and(|c| c < 300);
            let lease = e["objectRef"]["resource"] == "leases"
                && e["objectRef"]["name"] == "mover-controller";
            if lease {
                if ok {
                    holder = Some(pod);
                }
                continue;
            }
            // Certificate signing and the agents' CSRs are the leader's too; events and
            // tokens are not writes of replication state.
            let resource = e["objectRef"]["resource"].as_str().unwrap_or_default();
            if matches!(
                resource,
                "events" | "serviceaccounts" | "tokenreviews" | "subjectaccessreviews"
            ) {
                continue;
            }
            checked += holder.is_some() as usize;
            if holder.as_deref().is_some_and(|h| h != pod) {
                doubled.push(format!(
                    "{pod} {verb} {} at {} while {} held the Lease",
                    e["requestURI"],
                    e["requestReceivedTimestamp"],
                    holder.as_deref().unwrap_or_default()
                ));
            }
        }
        (doubled, checked)
    }

    fn percentile(v: &[f64], p: f64) -> f64 {
        if v.is_empty() {
            return 0.0;
        }
        let mut v = v.to_vec();
        v.sort_by(|a, b| a.total_cmp(b));
        v[((v.len() - 1) as f64 * p).round() as usize]
    }

    fn print_report(o: &Options, r: &Report, s3: &S3Report, took: Duration) {
        eprintln!(
            "soak: seed {}, {} minutes asked, {:.1} minutes run",
            o.seed,
            o.minutes,
            took.as_secs_f64() / 60.0
        );
        for (kind, n) in &r.faults {
            eprintln!("soak:   {n:>4} × {kind}");
        }
        eprintln!(
            "soak: {} failovers; {} acknowledged writes checked at the last planned one, {} lost in planned ones",
            r.failovers, r.acked_checked, r.acked_lost
        );
        for (lost, span, rpo) in &r.forced {
            eprintln!(
                "soak: a forced failover lost {lost} acknowledged writes, of the last {span:.1} s before the loss (RPO reported then {rpo:.1} s)"
            );
        }
        eprintln!(
            "soak: RPO outside faults p50 {:.1} s, p99 {:.1} s ({} samples); worst inside a cut {:.1} s",
            percentile(&r.rpo_calm, 0.5),
            percentile(&r.rpo_calm, 0.99),
            r.rpo_calm.len(),
            r.rpo_worst_in_faults
        );
        eprintln!(
            "soak: replication resumed after a fault in p50 {:.1} s, worst {:.1} s",
            percentile(&r.resumed, 0.5),
            percentile(&r.resumed, 1.0)
        );
        eprintln!(
            "soak: the archive: {} pages written; in S3 faults its proxy refused {} requests and passed {}; snapshots resumed after a fault in p50 {:.1} s, worst {:.1} s; its last snapshot restored whole",
            s3.pages,
            s3.refused,
            s3.passed,
            percentile(&s3.resumed, 0.5),
            percentile(&s3.resumed, 1.0)
        );
        eprintln!(
            "soak: the served pods read their devices whole {} times across {} restarts of their agents: 0 failed",
            r.served_reads, r.served_restarts
        );
        eprintln!(
            "soak: {} controller writes checked against the Lease's holder: no two leaders",
            r.leader_writes_checked
        );
    }
}
