//! `mover replicate ...`: the CLI of the agents' relationship control API, and `run`,
//! the same cycle engine in the foreground for a primary without an agent.

use super::human;
use anyhow::Context;
use mover::remote::{AgentUrl, ConnectOptions, RemoteOptions, parse_rate, status_error};
use mover::replicate;
use std::{path::PathBuf, time::Duration};
use transport::control;

/// The least consistency a relationship's cycles must have to be shipped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Consistency {
    /// The volume at one instant: a clone or snapshot, taken under the freeze if set.
    PointInTime,
    /// Also a live read: blocks from different instants, as after a crash, or worse.
    CrashInconsistent,
}

/// Where the agent is: `agent://HOST:PORT` (a volume part, if given, is ignored).
#[derive(Clone, Debug, clap::Args)]
pub struct AgentArg {
    /// The agent to ask: agent://HOST:PORT (for a relationship: the one that holds it).
    #[arg(long, value_name = "URL", env = "MOVER_AGENT")]
    agent: String,
    #[command(flatten)]
    connect: ConnectOptions,
    /// Print the result (the relationship's status) as JSON instead of text.
    #[arg(long)]
    json: bool,
}

impl AgentArg {
    pub(crate) fn url(&self) -> anyhow::Result<AgentUrl> {
        let s = self.agent.trim_end_matches('/');
        let with_volume = if s.matches('/').count() > 2 {
            s.to_string()
        } else {
            format!("{s}/-")
        };
        Ok(AgentUrl::parse(&with_volume)
            .ok_or_else(|| anyhow::anyhow!("--agent {s:?}: expected agent://HOST:PORT"))??)
    }

    /// How to reach the agent.
    pub(crate) fn remote(&self) -> RemoteOptions {
        RemoteOptions {
            connect: self.connect.clone(),
            ..RemoteOptions::default()
        }
    }

    /// The result is wanted as JSON.
    pub(crate) fn json(&self) -> bool {
        self.json
    }

    async fn client(&self) -> anyhow::Result<(mover::remote::ControlClient, AgentUrl)> {
        let url = self.url()?;
        Ok((self.remote().connect_control(&url).await?, url))
    }
}

/// `mover replicate` subcommands.
#[derive(clap::Subcommand)]
pub enum ReplicateCommand {
    /// Create a relationship on the primary's agent: its export replicates to a secondary.
    #[command(
        // clap does not wrap a usage line: this one, unwrapped, is 96 columns.
        override_usage = "mover replicate create [OPTIONS] --volume <VOLUME> \
                          --secondary <URL>\n       --agent <URL> <NAME>",
        long_about = "Create a relationship on the agent that holds the primary \
        volume (--agent). The agent checks that VOLUME is one of its exports, that the \
        secondary is reachable and writable, and starts cycles at once: the first copies \
        the whole volume (sparse, zeros never shipped), later ones only the pages that \
        changed. The secondary always equals one completed cycle.\n\nExample:\n  \
        mover replicate create pg-data --agent agent://node-a:7070 --volume pg \\\n      \
        --secondary agent://node-b:7070/pg-replica --interval 30s"
    )]
    Create {
        /// The relationship's name (fencing epochs and chunk keys are per name).
        name: String,
        /// The primary volume: an export of the agent.
        #[arg(long)]
        volume: String,
        /// The secondary volume: agent://HOST:PORT/EXPORT.
        #[arg(long, value_name = "URL")]
        secondary: String,
        /// Time between the starts of two cycles (e.g. 30s, 5m); the RPO is about twice this.
        #[arg(long, default_value = "30s", value_parser = mover::node::parse_duration)]
        interval: Duration,
        /// Bandwidth limit on the wire, in bytes per second with binary units: 100M is
        /// 100 MiB/s (K, M, G: KiB, MiB, GiB). The average over a cycle stays under it
        /// [default: none].
        #[arg(long, value_name = "RATE", value_parser = parse_rate)]
        bwlimit: Option<u64>,
        /// Chunk size (a power of two from 64K to 8M) [default: 128K, larger from 4 GiB
        /// up so that a volume has at most 32768 chunks].
        #[arg(long)]
        chunk_size: Option<chunker::ChunkSize>,
        /// Mount point of the filesystem inside the volume, frozen (FIFREEZE) while the
        /// point in time is taken: application-consistent cycles.
        #[arg(long, value_name = "MOUNT")]
        freeze: Option<PathBuf>,
        /// The least consistency a cycle must have to be shipped. point-in-time: a cycle
        /// of a volume that cannot be cloned (an image file on XFS or Btrfs can) fails
        /// and says so; crash-inconsistent: it is read live and shipped, labelled so.
        #[arg(long, value_enum, default_value_t = Consistency::CrashInconsistent)]
        consistency: Consistency,
        /// The peer credential that alone may act on this relationship here: a NAME of
        /// this agent's replication_token_file (`NAME TOKEN` lines), or `local` (this
        /// cluster's agents). Bind the secondary's side too (`mover replicate update`
        /// there, or its export's `peer_credential`) [default: any replication token].
        #[arg(long, value_name = "NAME")]
        peer_credential: Option<String>,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Show one relationship: role, state, last cycle, RPO, errors.
    Status {
        /// The relationship.
        name: String,
        /// Redraw every N seconds until interrupted.
        #[arg(long, value_name = "SECS")]
        watch: Option<u64>,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// List the relationships an agent holds (either side).
    List {
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Change a relationship's interval or bandwidth limit, or pause/resume its cycles.
    Update {
        /// The relationship.
        name: String,
        /// Time between the starts of two cycles.
        #[arg(long, value_parser = mover::node::parse_duration)]
        interval: Option<Duration>,
        /// Bandwidth limit on the wire, in bytes per second with binary units: 100M is
        /// 100 MiB/s (0: none).
        #[arg(long, value_name = "RATE", value_parser = parse_rate)]
        bwlimit: Option<u64>,
        /// Stop running cycles until --resume.
        #[arg(long, conflicts_with = "resume")]
        pause: bool,
        /// Run cycles again.
        #[arg(long)]
        resume: bool,
        /// Freeze this mount point around each cycle's point in time (as for create;
        /// after a failover the new primary needs its own, mount points are per node).
        #[arg(long, value_name = "MOUNT", conflicts_with = "no_freeze")]
        freeze: Option<PathBuf>,
        /// Stop freezing.
        #[arg(long)]
        no_freeze: bool,
        /// The least consistency a cycle must have to be shipped (as for create).
        #[arg(long, value_enum)]
        consistency: Option<Consistency>,
        /// Bind the relationship on this side to a peer credential (as for create; ""
        /// unbinds it): that credential's token alone then acts on it here.
        #[arg(long, value_name = "NAME")]
        peer_credential: Option<String>,
        /// Admit the peer's fencing epoch N, more than one above the highest seen here
        /// (the peer was promoted more than once while this side was away; a peer raises
        /// the epoch by one at most otherwise). Not on an active primary.
        #[arg(long, value_name = "N")]
        accept_epoch: Option<u64>,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Run one cycle now on the primary and wait for it.
    Sync {
        /// The relationship.
        name: String,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Make the secondary the primary, under a new fencing epoch.
    #[command(
        long_about = "Make this agent's side (the secondary) the primary under a \
        new epoch: the old primary's writes are refused from then on. Without --force \
        the last applied cycle must be the final cycle of a demote (planned failover); \
        with --force (the primary is gone) the volume stays at its last committed cycle."
    )]
    Promote {
        /// The relationship.
        name: String,
        /// The primary is unreachable: promote from the last committed cycle.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Ship a final cycle from the primary and make it the secondary (planned failover).
    Demote {
        /// The relationship.
        name: String,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Make a fenced old primary the secondary of the current one (failback by delta).
    #[command(
        long_about = "After a forced promote of the peer, make this (old, fenced) \
        primary its secondary: the new primary's next cycle brings it up to date, shipping \
        only the pages that differ. If this side was written after the last common cycle, \
        that is a split brain: resync refuses unless --discard-local."
    )]
    Resync {
        /// The relationship.
        name: String,
        /// Throw away what this side wrote after the split.
        #[arg(long)]
        discard_local: bool,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Stop and forget a relationship on this agent; the volume stays as it is.
    Delete {
        /// The relationship.
        name: String,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Replicate a local volume from this process (no agent on the primary's node).
    #[command(
        long_about = "Run cycles of SRC (an image file or block device) into a \
        secondary agent's export, in the foreground, every --interval. Each cycle takes a \
        point in time (a reflink clone of an image on XFS/Btrfs, else the live volume: \
        crash-inconsistent), ships the pages that differ, and commits them atomically on \
        the secondary. A directory SRC replicates as a file tree into a tree export: each \
        cycle copies the files that changed and deletes what is gone (file-consistent). \
        The relationship's epoch and last cycle are kept in --state-dir."
    )]
    Run {
        /// The primary volume: an image file, a block device, or a directory.
        src: PathBuf,
        /// The secondary volume: agent://HOST:PORT/EXPORT. A DST other than the one the
        /// saved relationship of the same name ships to starts it afresh there (its first
        /// cycle compares every chunk); the old secondary keeps its last cycle.
        dst: String,
        /// Time between the starts of two cycles.
        #[arg(long, default_value = "30s", value_parser = mover::node::parse_duration)]
        interval: Duration,
        /// Stop after this many cycles [default: run until interrupted].
        #[arg(long)]
        cycles: Option<u64>,
        /// Chunk size [default: as for `create`].
        #[arg(long)]
        chunk_size: Option<chunker::ChunkSize>,
        /// Mount point frozen while the point in time is taken.
        #[arg(long, value_name = "MOUNT")]
        freeze: Option<PathBuf>,
        /// Where the relationship's record is kept.
        #[arg(
            long,
            value_name = "DIR",
            env = "MOVER_STATE_DIR",
            default_value = "/var/lib/mover"
        )]
        state_dir: PathBuf,
        #[command(flatten)]
        remote: RemoteOptions,
    },
}

/// Runs a `mover replicate` subcommand.
pub fn run(cmd: ReplicateCommand) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    rt.block_on(run_async(cmd))
}

async fn run_async(cmd: ReplicateCommand) -> anyhow::Result<()> {
    use ReplicateCommand as C;
    let call = |url: &AgentUrl, s: tonic::Status| anyhow::Error::from(status_error(url, s));
    match cmd {
        C::Create {
            name,
            volume,
            secondary,
            interval,
            bwlimit,
            chunk_size,
            freeze,
            consistency,
            peer_credential,
            agent,
        } => {
            let (mut c, url) = agent.client().await?;
            let spec = control::Spec {
                name,
                volume,
                peer: secondary,
                interval_ms: interval.as_millis() as u64,
                bwlimit: bwlimit.unwrap_or(0),
                chunk_size: chunk_size.map_or(0, |c| c.get()),
                freeze: freeze.map(|p| p.display().to_string()).unwrap_or_default(),
                require_point_in_time: consistency == Consistency::PointInTime,
                peer_credential: peer_credential.unwrap_or_default(),
                // The agent's own peer token (the controller sets one per class).
                ..Default::default()
            };
            let s = c
                .create(control::CreateRequest {
                    spec: Some(spec),
                    self_address: format!("{}:{}", url.host, url.port),
                })
                .await
                .map_err(|s| call(&url, s))?
                .into_inner();
            print_status(&s, agent.json);
        }
        C::Status { name, watch, agent } => {
            let json = agent.json;
            let (mut c, url) = agent.client().await?;
            loop {
                let s = c
                    .get(control::NameRequest { name: name.clone() })
                    .await
                    .map_err(|s| call(&url, s))?
                    .into_inner();
                if watch.is_some() && !json {
                    print!("\x1b[2J\x1b[H"); // clear the screen for the next view
                }
                print_status(&s, json);
                match watch {
                    Some(secs) => tokio::time::sleep(Duration::from_secs(secs.max(1))).await,
                    None => break,
                }
            }
        }
        C::List { agent } => {
            let json = agent.json;
            let (mut c, url) = agent.client().await?;
            let l = c
                .list(control::ListRequest {})
                .await
                .map_err(|s| call(&url, s))?
                .into_inner();
            if json {
                let all: Vec<_> = l.relationships.iter().map(status_json).collect();
                println!("{}", serde_json::Value::Array(all));
            } else if l.relationships.is_empty() {
                println!("no relationships on {}:{}", url.host, url.port);
            } else {
                println!(
                    "{:<24} {:<10} {:<12} {:>6} {:>10} {:>8}  PEER",
                    "NAME", "ROLE", "STATE", "EPOCH", "LAST", "RPO"
                );
                for s in &l.relationships {
                    let spec = s.spec.clone().unwrap_or_default();
                    println!(
                        "{:<24} {:<10} {:<12} {:>6} {:>10} {:>8}  {}",
                        spec.name,
                        s.role,
                        s.state,
                        s.epoch,
                        s.last_cycle
                            .as_ref()
                            .map_or("-".into(), |c| c.id.to_string()),
                        rpo(s),
                        spec.peer
                    );
                }
            }
        }
        C::Update {
            name,
            interval,
            bwlimit,
            pause,
            resume,
            freeze,
            no_freeze,
            consistency,
            peer_credential,
            accept_epoch,
            agent,
        } => {
            status_call(&agent, |mut c| async move {
                c.update(control::UpdateRequest {
                    name,
                    interval_ms: interval.map(|d| d.as_millis() as u64),
                    bwlimit,
                    paused: (pause || resume).then_some(pause),
                    freeze: match (freeze, no_freeze) {
                        (Some(m), _) => Some(m.display().to_string()),
                        (None, true) => Some(String::new()),
                        (None, false) => None,
                    },
                    require_point_in_time: consistency.map(|c| c == Consistency::PointInTime),
                    peer_credential,
                    accept_epoch,
                    ..Default::default()
                })
                .await
            })
            .await?;
        }
        C::Sync { name, agent } => {
            status_call(&agent, |mut c| async move {
                c.sync(control::NameRequest { name }).await
            })
            .await?;
        }
        C::Promote { name, force, agent } => {
            status_call(&agent, |mut c| async move {
                c.promote(control::PromoteRequest { name, force }).await
            })
            .await?;
        }
        C::Demote { name, agent } => {
            status_call(&agent, |mut c| async move {
                c.demote(control::NameRequest { name }).await
            })
            .await?;
        }
        C::Resync {
            name,
            discard_local,
            agent,
        } => {
            status_call(&agent, |mut c| async move {
                c.resync(control::ResyncRequest {
                    name,
                    discard_local,
                })
                .await
            })
            .await?;
        }
        C::Delete { name, agent } => {
            let (mut c, url) = agent.client().await?;
            c.delete(control::NameRequest { name: name.clone() })
                .await
                .map_err(|s| call(&url, s))?;
            if agent.json {
                println!("{}", serde_json::json!({ "deleted": name }));
            } else {
                println!("deleted relationship {name} on {}:{}", url.host, url.port);
            }
        }
        C::Run {
            src,
            dst,
            interval,
            cycles,
            chunk_size,
            freeze,
            state_dir,
            remote,
        } => {
            run_foreground(
                src, dst, interval, cycles, chunk_size, freeze, state_dir, remote,
            )
            .await?
        }
    }
    Ok(())
}

/// Runs one call of the control API that answers with a relationship's status, on the
/// agent `agent` names, and prints that status.
async fn status_call<F, Fut>(agent: &AgentArg, f: F) -> anyhow::Result<()>
where
    F: FnOnce(mover::remote::ControlClient) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<control::Status>, tonic::Status>>,
{
    let (c, url) = agent.client().await?;
    let s = f(c)
        .await
        .map_err(|s| anyhow::Error::from(status_error(&url, s)))?
        .into_inner();
    print_status(&s, agent.json);
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn run_foreground(
    src: PathBuf,
    dst: String,
    interval: Duration,
    cycles: Option<u64>,
    chunk_size: Option<chunker::ChunkSize>,
    freeze: Option<PathBuf>,
    state_dir: PathBuf,
    remote: RemoteOptions,
) -> anyhow::Result<()> {
    let peer = AgentUrl::parse(&dst).ok_or_else(|| {
        anyhow::anyhow!("{dst}: the secondary must be agent://HOST:PORT/EXPORT")
    })??;
    let run = replicate::LocalRun {
        src,
        peer,
        interval,
        cycles,
        chunk_size,
        freeze,
        state_dir,
        remote,
    };
    replicate::run_local(run, |outcome| match &outcome.result {
        Ok(c) => println!(
            "cycle {}: {} read, {} shipped in {:.2}s ({}); RPO {:.1}s",
            c.id,
            human(c.bytes_read),
            human(c.bytes_shipped),
            c.duration_ms as f64 / 1000.0,
            c.consistency,
            (mover::node::now_ms() - c.point_in_time_ms) as f64 / 1000.0
        ),
        Err(f) if f.retryable => {
            eprintln!("mover: cycle failed, retrying next interval: {}", f.error)
        }
        Err(_) => {}
    })
    .await?;
    Ok(())
}

fn rpo(s: &control::Status) -> String {
    if s.rpo_seconds < 0.0 {
        "-".into()
    } else {
        format!("{:.1}s", s.rpo_seconds)
    }
}

/// A status as JSON, with the field names of the control API.
fn status_json(s: &control::Status) -> serde_json::Value {
    let spec = s.spec.clone().unwrap_or_default();
    serde_json::json!({
        "name": spec.name,
        "volume": spec.volume,
        "peer": spec.peer,
        "interval_ms": spec.interval_ms,
        "bwlimit": spec.bwlimit,
        "chunk_size": spec.chunk_size,
        "freeze": spec.freeze,
        "require_point_in_time": spec.require_point_in_time,
        "snapshots": spec.snapshots,
        "peer_credential": spec.peer_credential,
        "last_snapshot": s.last_snapshot,
        "role": s.role,
        "state": s.state,
        "epoch": s.epoch,
        "paused": s.paused,
        "consistency": s.consistency,
        "rpo_seconds": (s.rpo_seconds >= 0.0).then_some(s.rpo_seconds),
        "last_cycle": s.last_cycle.as_ref().map(|c| serde_json::json!({
            "id": c.id,
            "point_in_time_ms": c.point_in_time_ms,
            "started_ms": c.started_ms,
            "duration_ms": c.duration_ms,
            "bytes_read": c.bytes_read,
            "bytes_shipped": c.bytes_shipped,
            "root": c.root,
            "final": c.r#final,
            "writers_held_ms": c.writers_held_ms,
        })),
        "last_error": s.last_error,
        "missed_intervals": s.missed_intervals,
        "cycles_ok": s.cycles_ok,
        "cycles_failed": s.cycles_failed,
        "progress": {"done": s.progress_done, "total": s.progress_total},
        "history": s.history.iter().map(|h| serde_json::json!({
            "epoch": h.epoch, "last_common_cycle": h.last_common_cycle
        })).collect::<Vec<_>>(),
    })
}

fn print_status(s: &control::Status, json: bool) {
    if json {
        println!("{}", status_json(s));
        return;
    }
    let spec = s.spec.clone().unwrap_or_default();
    println!(
        "{}: {} ({}), epoch {}, {} -> {}",
        spec.name, s.state, s.role, s.epoch, spec.volume, spec.peer
    );
    if !spec.peer_credential.is_empty() {
        println!(
            "  bound to peer credential {:?}: only its token acts on it here",
            spec.peer_credential
        );
    }
    match &s.last_cycle {
        Some(c) => println!(
            "  last cycle {}: {} read, {} shipped in {:.2}s; RPO {}; {}{}{}",
            c.id,
            human(c.bytes_read),
            human(c.bytes_shipped),
            c.duration_ms as f64 / 1000.0,
            rpo(s),
            s.consistency,
            match c.writers_held_ms {
                0 => String::new(),
                ms => format!(" (writers held back {ms} ms)"),
            },
            if c.r#final {
                " (final cycle of a demote)"
            } else {
                ""
            }
        ),
        None => println!("  no cycle completed yet"),
    }
    if spec.snapshots {
        println!(
            "  points in time: CSI VolumeSnapshots the controller takes (last read: {})",
            if s.last_snapshot.is_empty() {
                "none yet"
            } else {
                &s.last_snapshot
            }
        );
    }
    if s.progress_total > 0 {
        println!(
            "  cycle running: {} of {} compared",
            human(s.progress_done),
            human(s.progress_total)
        );
    }
    let limit = match spec.bwlimit {
        0 => "no bandwidth limit".to_string(),
        b => format!("bandwidth limit {}/s", human(b)),
    };
    println!(
        "  cycles: {} ok, {} failed, {} intervals missed; every {:.1}s; {limit}",
        s.cycles_ok,
        s.cycles_failed,
        s.missed_intervals,
        spec.interval_ms as f64 / 1000.0
    );
    if !s.last_error.is_empty() {
        println!("  last error: {}", s.last_error);
    }
}

/// `mover replicate --help`: relationships, failover and failback, examples.
pub(crate) const REPLICATE_HELP: &str =
    "Continuous replication of block volumes between agents. A relationship \
lives on the agent of the primary's node, which runs a cycle every interval: a point in time \
of the volume, the pages that changed, shipped and applied atomically on the secondary (it \
always equals one completed cycle).

Planned failover: `demote` on the primary (ships a final cycle), then `promote` on the \
secondary. Forced failover: `promote --force` on the secondary; when the old primary returns \
it is fenced, and `resync` there makes it the new secondary, brought up to date by delta.

Examples:
  mover replicate create pg --agent agent://node-a:7070 --volume pg \\
      --secondary agent://node-b:7070/pg --interval 30s
  mover replicate status pg --agent agent://node-a:7070 --watch 2
  mover replicate demote pg --agent agent://node-a:7070
  mover replicate promote pg --agent agent://node-b:7070";
