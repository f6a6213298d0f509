//! Helpers of the bench binaries that drive agents: a `mover agent` on 127.0.0.1, a
//! child process killed on drop, a shell command.

use crate::process::run_checked;
use anyhow::{Context, Result, bail};
use std::{
    fs,
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// The bearer token of the agents the benches start.
pub const TOKEN: &str = "bench-token";

/// A child process killed when dropped (also on an error's early return).
pub struct Killed(pub Child);
impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs `cmd` with `sh -c`; its stdout, or an error with its stderr.
pub fn sh(cmd: &str) -> Result<Vec<u8>> {
    run_checked(Command::new("sh").arg("-c").arg(cmd))
}

/// A `mover agent` on 127.0.0.1 exporting `exports` (name, image).
pub struct Agent {
    pub child: Child,
    pub port: u16,
    pub config: PathBuf,
}

impl Agent {
    pub fn start(mover: &Path, dir: &Path, exports: &[(&str, &Path)]) -> Result<Agent> {
        Agent::start_tls(mover, dir, exports, None)
    }

    /// [`Agent::start`] with `settings`, more top-level lines of agent.toml.
    pub fn start_with_settings(
        mover: &Path,
        dir: &Path,
        exports: &[(&str, &Path)],
        settings: &str,
    ) -> Result<Agent> {
        Agent::start_configured(mover, dir, exports, None, settings)
    }

    /// [`Agent::start`], serving TLS with `tls` (certificate, key, CA) when given: its
    /// certificate is also what it presents to the agents it pushes cycles to.
    pub fn start_tls(
        mover: &Path,
        dir: &Path,
        exports: &[(&str, &Path)],
        tls: Option<(&Path, &Path, &Path)>,
    ) -> Result<Agent> {
        Agent::start_configured(mover, dir, exports, tls, "")
    }

    fn start_configured(
        mover: &Path,
        dir: &Path,
        exports: &[(&str, &Path)],
        tls: Option<(&Path, &Path, &Path)>,
        settings: &str,
    ) -> Result<Agent> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        fs::write(dir.join("token"), TOKEN)?;
        let config = dir.join("agent.toml");
        let mut text = format!(
            "{settings}listen = \"127.0.0.1:{port}\"\nstate_dir = \"{}\"\ntoken_file = \"{}\"\n",
            dir.join("state").display(),
            dir.join("token").display(),
        );
        if let Some((cert, key, ca)) = tls {
            text += &format!(
                "[tls]\ncert = \"{}\"\nkey = \"{}\"\nca = \"{}\"\n",
                cert.display(),
                key.display(),
                ca.display()
            );
        }
        for (name, image) in exports {
            text += &format!(
                "[exports.{name}]\npath = \"{}\"\nread_only = false\n",
                image.display()
            );
        }
        fs::write(&config, text)?;
        Agent::spawn(mover, config, port)
    }

    pub fn spawn(mover: &Path, config: PathBuf, port: u16) -> Result<Agent> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(config.with_extension("log"))?;
        let child = Command::new(mover)
            .args(["agent", "--config"])
            .arg(&config)
            // MOVER_BENCH_AGENT_LOG=debug shows where a cycle's time goes.
            .env(
                "RUST_LOG",
                std::env::var("MOVER_BENCH_AGENT_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("cannot start mover agent")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!(
                    "mover agent did not listen on {port}: see {}",
                    config.with_extension("log").display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(Agent {
            child,
            port,
            config,
        })
    }

    pub fn url(&self) -> String {
        format!("agent://127.0.0.1:{}", self.port)
    }

    pub fn rss(&self, field: &str) -> u64 {
        fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with(field))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            })
            .map_or(0, |kb| kb * 1024)
    }

    /// CPU seconds (user + system) the agent has used.
    pub fn cpu_seconds(&self) -> f64 {
        // /proc counts in USER_HZ, 100 on every Linux architecture mover runs on.
        let ticks = 100.0;
        fs::read_to_string(format!("/proc/{}/stat", self.child.id()))
            .ok()
            .and_then(|s| {
                // Fields after the parenthesised command name; utime and stime are 14 and 15.
                let rest = s.rsplit_once(')')?.1;
                let f: Vec<&str> = rest.split_whitespace().collect();
                Some((f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?) / ticks)
            })
            .unwrap_or(0.0)
    }

    pub fn read_bytes(&self) -> u64 {
        fs::read_to_string(format!("/proc/{}/io", self.child.id()))
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("read_bytes:"))
                    .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
            })
            .unwrap_or(0)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A size given as bytes, or with a unit: K, M or G (binary: 4G is 4 GiB).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n.parse().map_err(|_| format!("{s:?}: expected e.g. 4G"))?;
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        _ => return Err(format!("{s:?}: unit must be K, M or G")),
    };
    Ok(n << shift)
}

/// The mover binary: `given`, or the one beside this bench.
pub fn mover_binary(given: Option<&Path>) -> Result<PathBuf> {
    match given {
        Some(m) => Ok(m.to_path_buf()),
        None => Ok(std::env::current_exe()?.with_file_name("mover")),
    }
}

/// Empties work directory `w` (unmounting what a killed run left at `w/mnt`) and makes
/// the two agents' directories in it, `w/a` and `w/b`.
pub fn fresh_workdir(w: &Path) -> Result<(PathBuf, PathBuf)> {
    let _ = Command::new("umount").arg(w.join("mnt")).status();
    let _ = fs::remove_dir_all(w);
    let (da, db) = (w.join("a"), w.join("b"));
    fs::create_dir_all(&da)?;
    fs::create_dir_all(&db)?;
    Ok((da, db))
}

/// The median of `v` (0 for none).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
