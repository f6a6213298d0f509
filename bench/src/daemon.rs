//! Servers run in the background for the agent phase (`mover agent`, `rsync --daemon`):
//! started with their output in a log file, waited for until they accept connections, and
//! stopped on drop, so an error anywhere leaves none running. Also stops servers left
//! behind by a run that was killed before its guards ran.

use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use rustix::process::{Pid, Signal, kill_process};

use crate::process::describe;
use crate::progress::note;

/// How long a server may take to start listening.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a server may take to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// A server process listening on a port of 127.0.0.1; stopped on drop.
#[derive(Debug)]
pub struct Daemon {
    /// Short name for messages.
    name: &'static str,
    /// The command line, for messages.
    command: String,
    /// The running process.
    child: Child,
    /// Where its stdout and stderr go.
    log: PathBuf,
}

impl Daemon {
    /// Starts `cmd` with its output appended to `log`, and waits until something accepts
    /// connections on 127.0.0.1:`port`.
    pub fn start(name: &'static str, mut cmd: Command, port: u16, log: &Path) -> Result<Self> {
        let command = describe(&cmd);
        let out = File::options()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("cannot create {}", log.display()))?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("cannot start `{command}`"))?;
        let mut daemon = Self {
            name,
            command,
            child,
            log: log.to_path_buf(),
        };
        daemon.wait_listening(port)?;
        note!(
            "{name} listening on 127.0.0.1:{port} (pid {})",
            daemon.pid()
        );
        Ok(daemon)
    }

    /// Polls until 127.0.0.1:`port` accepts a connection, failing if the server exits or
    /// takes longer than [`START_TIMEOUT`].
    fn wait_listening(&mut self, port: u16) -> Result<()> {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
        let started = Instant::now();
        loop {
            self.ensure_running()?;
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            if started.elapsed() > START_TIMEOUT {
                bail!(
                    "{} did not listen on {addr} within {START_TIMEOUT:?}: `{}`\n{}",
                    self.name,
                    self.command,
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Fails, quoting the server's log, if the server has exited.
    pub fn ensure_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited ({status}): `{}`\n{}",
                self.name,
                self.command,
                self.log_tail()
            );
        }
        Ok(())
    }

    /// The server's process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The server's peak RSS so far (`VmHWM`), in bytes.
    pub fn peak_rss(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let kib = status
            .lines()
            .find_map(|line| line.strip_prefix("VmHWM:"))?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .ok()?;
        Some(kib * 1024)
    }

    /// The last lines of the server's log.
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.trim_end().lines().collect();
        let tail = lines[lines.len().saturating_sub(10)..].join("\n");
        format!("(end of {}:)\n{tail}", self.log.display())
    }

    /// Asks the server to stop (SIGTERM), then kills it if it lingers; reaps it.
    fn stop(&mut self) -> Result<()> {
        if self.child.try_wait()?.is_some() {
            return Ok(());
        }
        if let Some(pid) = i32::try_from(self.pid()).ok().and_then(Pid::from_raw) {
            // It may exit between try_wait and here: ESRCH is fine, wait below reaps it.
            let _ = kill_process(pid, Signal::TERM);
        }
        let asked = Instant::now();
        while asked.elapsed() < STOP_TIMEOUT {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "mover-bench: warning: {} ignored SIGTERM for {STOP_TIMEOUT:?}; killing it",
            self.name
        );
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Err(err) = self.stop() {
            eprintln!(
                "mover-bench: warning: cannot stop {} (pid {}): {err:#}",
                self.name,
                self.pid()
            );
        }
    }
}

/// A TCP port of 127.0.0.1 free right now (the kernel's pick; another process could take
/// it before the server binds it, which then fails to start and says so).
pub fn free_port() -> Result<u16> {
    let listener =
        TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).context("cannot bind a port on 127.0.0.1")?;
    Ok(listener.local_addr()?.port())
}

/// Stops (SIGTERM) every process whose command line names one of `configs`: servers a run
/// killed before its guards ran left behind, which would keep files of the workdir open.
pub fn stop_stale(configs: &[PathBuf]) -> Result<()> {
    let own = std::process::id();
    let entries = std::fs::read_dir("/proc").context("cannot list /proc")?;
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == own {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if !names_any(&cmdline, configs) {
            continue;
        }
        eprintln!("mover-bench: stopping server pid {pid} left by an earlier run");
        if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
            let _ = kill_process(pid, Signal::TERM);
        }
    }
    Ok(())
}

/// Whether a NUL-separated `/proc/PID/cmdline` holds one of `paths` as an argument, alone
/// or after `--config=`.
fn names_any(cmdline: &[u8], paths: &[PathBuf]) -> bool {
    cmdline
        .split(|&b| b == 0)
        .map(|arg| {
            let arg = String::from_utf8_lossy(arg);
            PathBuf::from(arg.strip_prefix("--config=").unwrap_or(&arg))
        })
        .any(|arg| paths.contains(&arg))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines_naming_a_config_are_recognised() {
        let paths = [
            PathBuf::from("/w/agent/plain.toml"),
            PathBuf::from("/w/r.conf"),
        ];
        assert!(names_any(
            b"mover\0agent\0--config\0/w/agent/plain.toml\0",
            &paths
        ));
        assert!(names_any(b"rsync\0--daemon\0--config=/w/r.conf\0", &paths));
        assert!(!names_any(b"vim\0/w/agent/plain.toml.swp\0", &paths));
    }

    #[test]
    fn a_server_is_awaited_and_stopped() {
        let dir = std::env::temp_dir().join(format!("mover-bench-daemon-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("server.log");
        // The test holds the port itself and starts `sleep` as the server: what is tested
        // is the waiting, the stopping and the reaping. A port found free can be taken by
        // a test running beside this one before it is bound again: then another is tried.
        let (port, listener) = (0..20)
            .find_map(|_| {
                let port = free_port().unwrap();
                TcpListener::bind((Ipv4Addr::LOCALHOST, port))
                    .ok()
                    .map(|l| (port, l))
            })
            .expect("no free port in 20 tries");
        let mut sleeper = Command::new("sleep");
        sleeper.arg("600");
        let daemon = Daemon::start("sleeper", sleeper, port, &log).unwrap();
        let pid = daemon.pid();
        assert!(crate::process::process_cpu(pid).is_some());
        drop(daemon);
        drop(listener);
        assert!(!Path::new(&format!("/proc/{pid}")).exists(), "reaped");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_server_that_exits_is_reported_with_its_log() {
        // The port is held, bound but not listening and without SO_REUSEADDR: connecting
        // to it is refused, and no test running beside this one can listen on it (one
        // did, once, and this server was taken for listening before it exited).
        let (port, _held) = reserved_port();
        assert!(TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_err());
        let dir = std::env::temp_dir().join(format!("mover-bench-exit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("server.log");
        let mut failing = Command::new("sh");
        failing.args(["-c", "echo cannot bind >&2; exit 3"]);
        let err = Daemon::start("failing", failing, port, &log)
            .unwrap_err()
            .to_string();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(err.contains("cannot bind"), "{err}");
    }

    /// A port of 127.0.0.1 bound by the returned socket, which does not listen.
    fn reserved_port() -> (u16, rustix::fd::OwnedFd) {
        use rustix::net::{AddressFamily, SocketType, bind, getsockname, socket};
        let socket = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
        bind(&socket, &SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
        let bound = SocketAddr::try_from(getsockname(&socket).unwrap()).unwrap();
        (bound.port(), socket)
    }
}
