//! PostgreSQL for the tests that replicate a database under load: a cluster run as the
//! `postgres` user, its commands, and what checks a copy of it.

use rustix::process::Signal;
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    time::{Duration, Instant},
};

/// PostgreSQL 15's programs (Debian's layout; .ci/run installs it).
pub const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

pub fn run_ok(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", failure(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn failure(out: &Output) -> String {
    format!(
        "{}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A PostgreSQL cluster in `data`, run as the `postgres` user (the server refuses root)
/// with its socket and log in `run`, a directory of this node's own. The postmaster is
/// this test's child, not pg_ctl's: stopped, it is also reaped, so the pid in the
/// copy's postmaster.pid names no process (pg_ctl stop returns once the pid file is
/// gone, a moment before the process, and an orphan waits for init to reap it).
/// Stopped (immediate) on drop.
pub struct Postgres {
    /// The data directory.
    pub data: PathBuf,
    /// Its socket and log.
    pub run: PathBuf,
    server: Option<Child>,
}

impl Postgres {
    /// A PostgreSQL 15 program run as `postgres`, talking to this cluster.
    pub fn cmd(&self, program: &str) -> Command {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .arg(Path::new(PG_BIN).join(program))
        // The test's own directories are root's: postgres may not enter them.
        .current_dir(&self.run)
        .env("HOME", &self.run)
        .env("PGHOST", &self.run)
        .env("PGDATABASE", "postgres")
        .env("PGUSER", "postgres")
        .env("LC_ALL", "C");
        c
    }

    /// A new cluster in `data`.
    pub fn init(data: PathBuf, run: PathBuf) -> Postgres {
        std::fs::create_dir_all(&data).unwrap();
        chown_postgres(&data);
        let pg = Postgres::existing(data, run);
        run_ok(
            pg.cmd("initdb")
                .args(["--no-locale", "-E", "UTF8", "-A", "trust", "-U", "postgres"])
                .arg("-D")
                .arg(&pg.data),
        );
        // In the data directory, so the secondary's copy runs with them too. A small
        // max_wal_size: checkpoints (and WAL recycling) happen during the load.
        let conf = pg.data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf).unwrap();
        text += "listen_addresses = ''\nmax_wal_size = '64MB'\nmin_wal_size = '32MB'\n";
        std::fs::write(&conf, text).unwrap();
        pg
    }

    /// A cluster in `data` as it is (a copy on another node).
    pub fn existing(data: PathBuf, run: PathBuf) -> Postgres {
        Postgres {
            data,
            run,
            server: None,
        }
    }

    /// Starts the postmaster and waits until it accepts connections.
    pub fn start(&mut self) {
        let log = std::fs::File::create(self.run.join("log")).unwrap();
        let server = self
            .cmd("postgres")
            .arg("-D")
            .arg(&self.data)
            .arg("-k")
            .arg(&self.run)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.server = Some(server);
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            if let Some(st) = self.server.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "PostgreSQL on {} exited ({st}):\n{}",
                    self.data.display(),
                    self.log()
                );
            }
            if self.cmd("pg_isready").arg("-q").status().unwrap().success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "PostgreSQL on {} not ready:\n{}",
                self.data.display(),
                self.log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Stops the postmaster with `signal` (QUIT: immediate, INT: fast) and reaps it;
    /// whether it exited 0, or `None` if it was not running.
    pub fn stop(&mut self, signal: Signal) -> Option<bool> {
        let mut server = self.server.take()?;
        let pid = rustix::process::Pid::from_raw(server.id() as i32).unwrap();
        let _ = rustix::process::kill_process(pid, signal);
        Some(server.wait().unwrap().success())
    }

    /// The result of one SQL statement, unaligned, without headers.
    pub fn sql(&self, sql: &str) -> String {
        run_ok(
            self.cmd("psql")
                .args(["-XAtq", "-v", "ON_ERROR_STOP=1", "-c", sql]),
        )
        .trim()
        .to_string()
    }

    pub fn count(&self, sql: &str) -> i64 {
        let v = self.sql(sql);
        v.parse().unwrap_or_else(|_| panic!("{sql}: {v:?}"))
    }

    /// pgbench writing for `time` (4 clients, each transaction updating 3 balances and
    /// adding a history row), its output in `run/pgbench`; killed on drop.
    pub fn load(&self, time: Duration) -> Running {
        let out = std::fs::File::create(self.run.join("pgbench")).unwrap();
        Running(
            self.cmd("pgbench")
                .args([
                    "-n",
                    "-c",
                    "4",
                    "-j",
                    "2",
                    "-T",
                    &time.as_secs().to_string(),
                ])
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .unwrap(),
        )
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.run.join("log")).unwrap_or_default()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop(Signal::QUIT);
    }
}

pub fn chown_postgres(path: &Path) {
    run_ok(Command::new("chown").arg("postgres:postgres").arg(path));
}

/// A child process killed on drop.
pub struct Running(pub Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Every pgbench transaction in `pg` is whole (each adds its delta to one account,
/// teller and branch and records it in the history), and no page of a table or index
/// is torn or stale (pg_amcheck).
pub fn assert_transactions_whole(pg: &Postgres) {
    assert_transactions_whole_by(
        |sql| pg.sql(sql),
        |program, args| {
            run_ok(pg.cmd(program).args(args));
        },
    );
}

/// [`assert_transactions_whole`] of a database reached through `sql` (an answer to a
/// query) and `run` (a program of its server, with arguments, run as postgres): a pod's.
pub fn assert_transactions_whole_by(sql: impl Fn(&str) -> String, run: impl Fn(&str, &[&str])) {
    let sums = sql(
        "select (select coalesce(sum(delta), 0) from pgbench_history) || ' ' || \
     (select sum(abalance) from pgbench_accounts) || ' ' || \
     (select sum(tbalance) from pgbench_tellers) || ' ' || \
     (select sum(bbalance) from pgbench_branches)",
    );
    let sums: Vec<&str> = sums.trim().split(' ').collect();
    assert!(
        sums.len() == 4 && sums.iter().all(|s| *s == sums[0]),
        "history, accounts, tellers, branches: {sums:?}"
    );
    // No torn or stale page in tables or indexes.
    run(
        "pg_amcheck",
        &["--install-missing", "--heapallindexed", "postgres"],
    );
}

/// The copy `pg` of a cluster that ran pgbench at `scale` holds all its accounts, at
/// most the `written` transactions of the primary and at least one, each whole; returns
/// how many it holds.
pub fn assert_recovered(pg: &Postgres, scale: u64, written: i64) -> i64 {
    assert_eq!(
        pg.count("select count(*) from pgbench_accounts"),
        scale as i64 * 100_000
    );
    let history = pg.count("select count(*) from pgbench_history");
    assert!(
        0 < history && history <= written,
        "{history} pgbench transactions on the copy, {written} on the primary"
    );
    assert_transactions_whole(pg);
    history
}

/// The ext4 in `image` passes `e2fsck -fn`, and its journal needs no replay (it was
/// frozen, so flushed, when its point in time was taken).
pub fn assert_ext4_clean(image: &Path) {
    let fsck = Command::new("e2fsck")
        .arg("-fn")
        .arg(image)
        .output()
        .unwrap();
    assert!(
        fsck.status.success(),
        "e2fsck -fn {}: {}",
        image.display(),
        failure(&fsck)
    );
    let sb = run_ok(Command::new("dumpe2fs").arg("-h").arg(image));
    assert!(
        !sb.lines()
            .any(|l| l.starts_with("Filesystem features:") && l.contains("needs_recovery")),
        "{sb}"
    );
}

/// The ext4 in `image` as after a crash: a reflink copy of it is mounted (the kernel
/// replays its journal, as a pod's mount does) and unmounted, then it must be clean
/// ([`assert_ext4_clean`]). The image itself is not touched.
pub fn assert_ext4_recovers_clean(image: &Path) {
    let copy = image.with_extension("fsck.img");
    run_ok(
        Command::new("cp")
            .arg("--reflink=always")
            .arg(image)
            .arg(&copy),
    );
    let mnt = tempfile::tempdir().unwrap();
    run_ok(
        Command::new("mount")
            .args(["-o", "loop"])
            .arg(&copy)
            .arg(mnt.path()),
    );
    let unmounted = Command::new("umount").arg(mnt.path()).output().unwrap();
    assert!(
        unmounted.status.success(),
        "umount: {}",
        failure(&unmounted)
    );
    assert_ext4_clean(&copy);
    std::fs::remove_file(&copy).unwrap();
}
