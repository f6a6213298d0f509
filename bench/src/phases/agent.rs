//! Copies over the network (127.0.0.1 only): `mover copy` pushing into mover's agent,
//! plain and with mutual TLS, against rsync pushing into an rsync daemon; into an absent
//! destination and onto yesterday's image.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use serde::Serialize;

use super::copy::{Cache, Prepare, Trial, race};
use super::{Ctx, Run};
use crate::daemon::{self, Daemon};
use crate::diff::PageDiff;
use crate::mover::{AgentAuth, agent_copy_command};
use crate::progress::note;
use crate::tls::{self, TlsFiles};

/// Subdirectory of the workdir holding the servers' configuration, logs and destinations.
const AGENT_DIR: &str = "agent";
/// The rsync daemon's module (a directory of the agent subdirectory).
const RSYNC_MODULE: &str = "bench";

/// The copies over the network.
#[derive(Debug, Clone, Serialize)]
pub struct AgentCopy {
    /// Into an absent destination.
    pub full: AgentFull,
    /// Onto a destination holding yesterday's image.
    pub delta: AgentDelta,
    /// Peak RSS of the agent serving plain connections, over the whole phase.
    pub agent_peak_rss_bytes: u64,
    /// Peak RSS of the agent serving mutual TLS, over the whole phase.
    pub agent_tls_peak_rss_bytes: u64,
}

/// Full copies into an absent destination.
#[derive(Debug, Clone, Serialize)]
pub struct AgentFull {
    /// `cp --sparse=always DEVICE WORKDIR/agent/exports/cp.img`: the local reference,
    /// timed in the same race onto the same disk.
    pub cp: Run,
    /// `rsync --stats today.img rsync://127.0.0.1:PORT/bench/dst.img`.
    pub rsync: Run,
    /// rsync's "Total bytes sent".
    pub rsync_bytes_sent: u64,
    /// `mover copy DEVICE agent://127.0.0.1:PORT/full`, bearer token, no TLS.
    pub mover: Run,
    /// Volume bytes mover put on the network (compressed frames), from its report.
    pub mover_wire_bytes: u64,
    /// The same copy to an agent requiring mutual TLS (and the token).
    pub mover_tls: Run,
    /// Volume bytes on the network with TLS, from mover's report.
    pub mover_tls_wire_bytes: u64,
}

/// Delta copies onto a destination holding yesterday's image (copied in by cp, untimed).
#[derive(Debug, Clone, Serialize)]
pub struct AgentDelta {
    /// Pages differing between yesterday's and today's image.
    pub changed: PageDiff,
    /// `rsync --inplace --no-whole-file --stats today.img rsync://…/bench/dst.img`.
    pub rsync: Run,
    /// rsync's "Total bytes sent" (literal data, block checksums' matches, protocol).
    pub rsync_bytes_sent: u64,
    /// rsync's "Total bytes received" (the destination's block checksums, mostly).
    pub rsync_bytes_received: u64,
    /// `mover copy DEVICE agent://127.0.0.1:PORT/delta` onto yesterday's image copied in
    /// by cp: the agent knows nothing about it and hashes all of it.
    pub mover_unindexed: Run,
    /// The same onto yesterday's image pushed by mover through the agent (untimed), as
    /// in repeated replication: the agent compares against the chunk index it saved
    /// then instead of reading the destination. The case judged, as for the local delta.
    pub mover: Run,
    /// Volume bytes mover put on the network (compressed frames), from its report.
    pub mover_wire_bytes: u64,
    /// Bytes the agent wrote, from mover's report.
    pub mover_bytes_written: u64,
}

/// Starts the agents and the rsync daemon, times the full and the delta copies through
/// them, and stops them (also on error).
pub fn agent_copy(ctx: &Ctx) -> Result<AgentCopy> {
    let openssl = ctx
        .tools
        .openssl
        .as_deref()
        .context("the agent phase needs `openssl` (apt install openssl)")?;
    let servers = Servers::start(ctx, openssl)?;
    let full = full(ctx, &servers)?;
    let delta = delta(ctx, &servers)?;
    Ok(AgentCopy {
        full,
        delta,
        agent_peak_rss_bytes: servers.agent.peak_rss().unwrap_or(0),
        agent_tls_peak_rss_bytes: servers.agent_tls.peak_rss().unwrap_or(0),
    })
}

/// Times full copies into absent destinations: cp locally (the reference), rsync to its
/// daemon, mover to the agent without and with mutual TLS.
fn full(ctx: &Ctx, servers: &Servers) -> Result<AgentFull> {
    let mut cp = Command::new(&ctx.tools.cp);
    let cp_destination = servers.destinations.exports.join("cp.img");
    cp.arg("--sparse=always")
        .arg(ctx.device)
        .arg(&cp_destination);
    let mut cp = Trial::new("cp --sparse=always, local", cp);
    cp.destination = Some(cp_destination);
    let rsync = servers.rsync_trial(ctx, "rsync to rsync daemon", &[]);
    let plain = servers.mover_trial(ctx, "mover copy to agent", Export::Full);
    let tls = servers.mover_trial(ctx, "mover copy to agent, mutual TLS", Export::FullTls);
    let mut trials = [cp, rsync, plain, tls];
    race(
        ctx,
        "agent full copy",
        &mut trials,
        None,
        &ctx.images.today,
        Cache::Cold,
    )?;
    let [cp, rsync, plain, tls] = trials;
    let volume = ctx.images.manifest.size;
    let (rsync, stdout) = rsync.best();
    let (mover, report) = plain.best_mover(volume)?;
    let (mover_tls, tls_report) = tls.best_mover(volume)?;
    Ok(AgentFull {
        cp: cp.best().0,
        rsync,
        rsync_bytes_sent: rsync_stat(&stdout, "Total bytes sent")?,
        mover,
        mover_wire_bytes: report.wire_bytes,
        mover_tls,
        mover_tls_wire_bytes: tls_report.wire_bytes,
    })
}

/// Times copies onto yesterday's image: rsync (delta transfer, in place) to its daemon, and
/// mover to the agent.
fn delta(ctx: &Ctx, servers: &Servers) -> Result<AgentDelta> {
    let rsync = servers.rsync_trial(
        ctx,
        "rsync --inplace --no-whole-file",
        &["--inplace", "--no-whole-file"],
    );
    let cold = servers.mover_trial(ctx, "mover copy to agent, yesterday by cp", Export::Delta);
    let mut indexed = servers.mover_trial(
        ctx,
        "mover copy to agent, yesterday by mover",
        Export::Delta,
    );
    indexed.prepare_with = Some(servers.push_command(ctx, &ctx.images.yesterday, Export::Delta));
    // Yesterday's push made a new image: the agent hashes its pages in the background,
    // long done by the next day's copy.
    indexed.settle_at = Some(servers.agent_metrics_port);
    let mut trials = [rsync, cold, indexed];
    let yesterday = Some(ctx.images.yesterday.as_path());
    race(
        ctx,
        "agent delta copy",
        &mut trials,
        yesterday,
        &ctx.images.today,
        Cache::Cold,
    )?;
    let [rsync, cold, mover] = trials;
    let (rsync, stdout) = rsync.best();
    let (mover_unindexed, _) = cold.best_mover(ctx.images.manifest.size)?;
    let (mover, report) = mover.best_mover(ctx.images.manifest.size)?;
    Ok(AgentDelta {
        changed: ctx.images.manifest.diff,
        rsync,
        rsync_bytes_sent: rsync_stat(&stdout, "Total bytes sent")?,
        rsync_bytes_received: rsync_stat(&stdout, "Total bytes received")?,
        mover_unindexed,
        mover,
        mover_wire_bytes: report.wire_bytes,
        mover_bytes_written: report.bytes_written,
    })
}

/// The exports of the agents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Export {
    /// `full` on the plain agent.
    Full,
    /// `full` on the mutual-TLS agent.
    FullTls,
    /// `delta` on the plain agent.
    Delta,
}

/// The running servers and what clients need to reach them. Dropping it stops the servers,
/// then removes the destinations (field order).
struct Servers {
    /// `mover agent`, bearer token only.
    agent: Daemon,
    /// `mover agent`, mutual TLS and the bearer token.
    agent_tls: Daemon,
    /// `rsync --daemon`.
    rsyncd: Daemon,
    /// Port of `agent`.
    agent_port: u16,
    /// The plain agent's /metrics port.
    agent_metrics_port: u16,
    /// Port of `agent_tls`.
    agent_tls_port: u16,
    /// Port of `rsyncd`.
    rsync_port: u16,
    /// The bearer token's file.
    token_file: PathBuf,
    /// Certificates and keys.
    tls: TlsFiles,
    /// The agents' export files and the rsync module, removed on drop.
    destinations: Destinations,
}

impl Servers {
    /// Writes the configuration and TLS files into WORKDIR/agent and starts the servers.
    fn start(ctx: &Ctx, openssl: &Path) -> Result<Self> {
        let dir = ctx.workdir.join(AGENT_DIR);
        let [agent_conf, agent_tls_conf, rsyncd_conf] =
            ["agent.toml", "agent-tls.toml", "rsyncd.conf"].map(|name| dir.join(name));
        daemon::stop_stale(&[
            agent_conf.clone(),
            agent_tls_conf.clone(),
            rsyncd_conf.clone(),
        ])?;
        if dir.exists() {
            std::fs::remove_dir_all(&dir)
                .with_context(|| format!("cannot remove {}", dir.display()))?;
        }
        let destinations = Destinations {
            exports: dir.join("exports"),
            module: dir.join("rsync-module"),
        };
        for sub in [
            &destinations.exports,
            &destinations.module,
            &dir.join("tls"),
        ] {
            std::fs::create_dir_all(sub)
                .with_context(|| format!("cannot create {}", sub.display()))?;
        }
        let token_file = dir.join("token");
        write_private(&token_file, &random_token()?)?;
        let tls = tls::generate(openssl, &dir.join("tls"))?;
        let ports = [
            daemon::free_port()?,
            daemon::free_port()?,
            daemon::free_port()?,
            daemon::free_port()?,
        ];
        let [agent_port, agent_tls_port, rsync_port, agent_metrics_port] = ports;
        let distinct: std::collections::HashSet<u16> = ports.into_iter().collect();
        if distinct.len() != ports.len() {
            bail!("the kernel handed out the same free port twice: {ports:?}");
        }

        let exports = &destinations.exports;
        let plain_toml = agent_toml(
            agent_port,
            Some(agent_metrics_port),
            &dir.join("state"),
            &token_file,
            None,
            &[
                ("full", &exports.join("full.img")),
                ("delta", &exports.join("delta.img")),
            ],
        );
        let tls_toml = agent_toml(
            agent_tls_port,
            None,
            &dir.join("state-tls"),
            &token_file,
            Some(&tls),
            &[("full", &exports.join("full-tls.img"))],
        );
        let rsync_log = dir.join("rsyncd.log");
        let rsyncd_text = format!(
            "use chroot = false\nuid = root\ngid = root\nnumeric ids = true\n\
             log file = {}\n[{RSYNC_MODULE}]\npath = {}\nread only = false\n",
            rsync_log.display(),
            destinations.module.display()
        );
        for (path, text) in [
            (&agent_conf, &plain_toml),
            (&agent_tls_conf, &tls_toml),
            (&rsyncd_conf, &rsyncd_text),
        ] {
            std::fs::write(path, text)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }

        let agent_cmd = |conf: &Path| {
            let mut cmd = Command::new(ctx.mover);
            cmd.arg("agent")
                .arg("--config")
                .arg(conf)
                .env("NO_COLOR", "1");
            cmd
        };
        let agent = Daemon::start(
            "mover agent",
            agent_cmd(&agent_conf),
            agent_port,
            &dir.join("agent.log"),
        )?;
        let agent_tls = Daemon::start(
            "mover agent (mutual TLS)",
            agent_cmd(&agent_tls_conf),
            agent_tls_port,
            &dir.join("agent-tls.log"),
        )?;
        let mut rsyncd_cmd = Command::new(&ctx.tools.rsync);
        rsyncd_cmd
            .args(["--daemon", "--no-detach"])
            .arg(format!("--config={}", rsyncd_conf.display()))
            .arg(format!("--port={rsync_port}"))
            .arg("--address=127.0.0.1");
        let rsyncd = Daemon::start("rsync daemon", rsyncd_cmd, rsync_port, &rsync_log)?;
        note!("agent phase: servers' files in {}", dir.display());
        Ok(Self {
            agent,
            agent_tls,
            rsyncd,
            agent_port,
            agent_metrics_port,
            agent_tls_port,
            rsync_port,
            token_file,
            tls,
            destinations,
        })
    }

    /// `mover copy SOURCE agent://…/EXPORT`.
    fn push_command(&self, ctx: &Ctx, source: &Path, export: Export) -> Command {
        let (port, name, tls) = match export {
            Export::Full => (self.agent_port, "full", None),
            Export::Delta => (self.agent_port, "delta", None),
            Export::FullTls => (self.agent_tls_port, "full", Some(&self.tls)),
        };
        let auth = AgentAuth {
            token_file: &self.token_file,
            tls,
        };
        agent_copy_command(ctx.mover, source, port, name, auth)
    }

    /// A trial of `mover copy` from the source device into `export`.
    fn mover_trial(&self, ctx: &Ctx, tool: &'static str, export: Export) -> Trial {
        let exports = &self.destinations.exports;
        let (daemon, port, name, file, tls) = match export {
            Export::Full => (&self.agent, self.agent_port, "full", "full.img", None),
            Export::Delta => (&self.agent, self.agent_port, "delta", "delta.img", None),
            Export::FullTls => {
                let tls = Some(&self.tls);
                (
                    &self.agent_tls,
                    self.agent_tls_port,
                    "full",
                    "full-tls.img",
                    tls,
                )
            }
        };
        let auth = AgentAuth {
            token_file: &self.token_file,
            tls,
        };
        let mut trial = Trial::new(
            tool,
            agent_copy_command(ctx.mover, ctx.device, port, name, auth),
        );
        trial.prepare = Prepare::Cp;
        trial.destination = Some(exports.join(file));
        trial.server_pid = Some(daemon.pid());
        trial
    }

    /// A trial of `rsync --stats EXTRA today.img rsync://127.0.0.1:PORT/bench/dst.img`.
    fn rsync_trial(&self, ctx: &Ctx, tool: &'static str, extra: &[&str]) -> Trial {
        let mut rsync = Command::new(&ctx.tools.rsync);
        rsync
            .arg("--stats")
            .args(extra)
            .arg(&ctx.images.today)
            .arg(format!(
                "rsync://127.0.0.1:{}/{RSYNC_MODULE}/dst.img",
                self.rsync_port
            ));
        let mut trial = Trial::new(tool, rsync);
        trial.destination = Some(self.destinations.module.join("dst.img"));
        trial.server_pid = Some(self.rsyncd.pid());
        trial
    }
}

/// The directories the servers write copies into; removed on drop.
struct Destinations {
    /// The agents' export files.
    exports: PathBuf,
    /// The rsync daemon's module.
    module: PathBuf,
}

impl Drop for Destinations {
    fn drop(&mut self) {
        for dir in [&self.exports, &self.module] {
            if let Err(err) = std::fs::remove_dir_all(dir) {
                eprintln!(
                    "mover-bench: warning: cannot remove {}: {err}",
                    dir.display()
                );
            }
        }
    }
}

/// An `agent.toml`: listening on 127.0.0.1:`port`, /metrics on `metrics_port`, the bearer
/// token, mutual TLS if `tls`, and `exports` as (name, file).
fn agent_toml(
    port: u16,
    metrics_port: Option<u16>,
    state_dir: &Path,
    token_file: &Path,
    tls: Option<&TlsFiles>,
    exports: &[(&str, &Path)],
) -> String {
    let mut text = format!(
        "listen = \"127.0.0.1:{port}\"\nstate_dir = {}\ntoken_file = {}\n",
        toml_path(state_dir),
        toml_path(token_file)
    );
    if let Some(m) = metrics_port {
        text += &format!("metrics_listen = \"127.0.0.1:{m}\"\n");
    }
    if let Some(tls) = tls {
        text += &format!(
            "[tls]\ncert = {}\nkey = {}\nca = {}\n",
            toml_path(&tls.server_cert),
            toml_path(&tls.server_key),
            toml_path(&tls.ca)
        );
    }
    for (name, path) in exports {
        text += &format!("[exports.{name}]\npath = {}\n", toml_path(path));
    }
    text
}

/// `path` as a TOML basic string (JSON's string escapes are valid TOML).
fn toml_path(path: &Path) -> String {
    serde_json::to_string(&path.to_string_lossy()).expect("a string serialises")
}

/// A fresh bearer token: 32 hex digits from /dev/urandom.
fn random_token() -> Result<String> {
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("cannot read /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes `text` to a new file only its owner may read.
fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(text.as_bytes()))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// The number on the line `label: 1,234,567 bytes` of rsync's `--stats` output.
fn rsync_stat(stdout: &[u8], label: &str) -> Result<u64> {
    let text = String::from_utf8_lossy(stdout);
    text.lines()
        .find_map(|line| line.trim().strip_prefix(label)?.strip_prefix(':'))
        .and_then(|rest| {
            let digits: String = rest
                .split_whitespace()
                .next()?
                .chars()
                .filter(char::is_ascii_digit)
                .collect();
            digits.parse().ok()
        })
        .with_context(|| format!("rsync --stats printed no `{label}:` figure:\n{text}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATS: &str = "\nNumber of files: 1 (reg: 1)\nLiteral data: 329,711,616 bytes\n\
                         Total bytes sent: 330,034,226\nTotal bytes received: 524,355\n\n\
                         sent 330,034,226 bytes  received 524,355 bytes  1.00 bytes/sec\n";

    #[test]
    fn rsync_stats_are_parsed_with_thousands_separators() {
        assert_eq!(
            rsync_stat(STATS.as_bytes(), "Total bytes sent").unwrap(),
            330_034_226
        );
        assert_eq!(
            rsync_stat(STATS.as_bytes(), "Total bytes received").unwrap(),
            524_355
        );
        assert!(rsync_stat(b"sent 5 bytes", "Total bytes sent").is_err());
    }

    #[test]
    fn agent_config_quotes_paths_and_lists_exports() {
        let tls = TlsFiles {
            ca: "/w/tls/ca.pem".into(),
            server_cert: "/w/tls/server.pem".into(),
            server_key: "/w/tls/server.key".into(),
            client_cert: "/w/tls/client.pem".into(),
            client_key: "/w/tls/client.key".into(),
        };
        let text = agent_toml(
            7070,
            Some(9470),
            Path::new("/w/state"),
            Path::new("/w/my \"token\""),
            Some(&tls),
            &[("full", Path::new("/w/exports/full.img"))],
        );
        assert!(text.contains("listen = \"127.0.0.1:7070\""), "{text}");
        assert!(
            text.contains("metrics_listen = \"127.0.0.1:9470\""),
            "{text}"
        );
        assert!(text.contains(r#"token_file = "/w/my \"token\"""#), "{text}");
        assert!(
            text.contains("[tls]\ncert = \"/w/tls/server.pem\""),
            "{text}"
        );
        assert!(
            text.ends_with("[exports.full]\npath = \"/w/exports/full.img\"\n"),
            "{text}"
        );
    }

    #[test]
    fn tokens_are_fresh_hex() {
        let (a, b) = (random_token().unwrap(), random_token().unwrap());
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
    }
}
