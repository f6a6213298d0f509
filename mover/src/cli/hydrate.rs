//! `mover hydrate ...`: the CLI of the agents' hydration control API.

use super::{human, replicate::AgentArg};
use anyhow::Context;
use mover::remote::{AgentUrl, parse_rate, status_error};
use std::{path::PathBuf, time::Duration};
use transport::hydrate as proto;

/// `mover hydrate` subcommands.
#[derive(clap::Subcommand)]
pub enum HydrateCommand {
    /// Start filling an export of an agent from a peer agent's volume or a snapshot;
    /// from the moment this returns the export is served over NBD at full size.
    #[command(
        long_about = "Start filling an export of an agent (--agent, the node where the \
workload runs) from a peer agent's volume (--from) or a snapshot (--from-snapshot). When this \
returns, the export is served over NBD at full size (the URI is printed): a read of data not \
yet here fetches it first, a background filler copies the rest. A hydration interrupted by a \
restart or a cancel resumes where it stopped when started again with the same source.

Examples:
  mover hydrate start pg --agent agent://node-b:7070 --from agent://node-a:7070/pg
  mover hydrate start pg-test --agent agent://node-b:7070 \\
      --from agent://dr-node:7070/pg --replica-of prod/pg   # a replica, held at a cycle
  mover hydrate start pg --agent agent://node-b:7070 \\
      --from-snapshot s3://dr/pg 4f2a9c --password-file /etc/mover/repo-pass
  qemu-img info 'nbd+unix:///pg?socket=/var/lib/mover/nbd.sock'
  mover hydrate wait pg --agent agent://node-b:7070"
    )]
    Start {
        /// The export to fill: a block export in the agent's agent.toml (or a new one,
        /// with --create).
        export: String,
        /// Hydrate from a peer agent's export: agent://HOST:PORT/VOLUME.
        #[arg(long, value_name = "URL", required_unless_present = "from_snapshot")]
        from: Option<String>,
        /// Hydrate from a block snapshot: REPO (directory or s3://BUCKET/PREFIX, as the
        /// agent's node sees it) and SNAPSHOT (id or unique prefix).
        #[arg(long, num_args = 2, value_names = ["REPO", "SNAPSHOT"], conflicts_with = "from")]
        from_snapshot: Option<Vec<String>>,
        /// --from is the replica (secondary) of this replication relationship: it is read
        /// as of the cycle it is at now, which its agent holds for this fill while later
        /// cycles are applied (replication goes on). The hold ends when the fill
        /// completes, after 15 minutes with no reads (a cancelled fill started again
        /// within them resumes), or when the replica is promoted (the fill then fails).
        #[arg(long, value_name = "RELATIONSHIP", requires = "from")]
        replica_of: Option<String>,
        /// Region size: the unit fetched and tracked (power of two, 64K to 8M; a
        /// snapshot's chunk size is used for snapshots).
        #[arg(long, value_name = "SIZE", default_value = "1M")]
        region_size: chunker::ChunkSize,
        /// Bandwidth limit of the background filler, in bytes per second with binary
        /// units: 100M is 100 MiB/s (K, M, G: KiB, MiB, GiB); a client's reads are never
        /// held back.
        #[arg(long, value_name = "RATE", value_parser = parse_rate)]
        bwlimit: Option<u64>,
        /// Filler requests in flight.
        #[arg(long, value_name = "N", default_value_t = 4)]
        concurrency: u32,
        /// The export's image or device holds data: replace it. A hydration of it that
        /// completed is started over, even from the same source (without --overwrite,
        /// a start again from that source returns at once and leaves the volume as it
        /// is, so a retried start is harmless).
        #[arg(long)]
        overwrite: bool,
        /// Make the export if the agent has none of that name: a sparse image in the
        /// agent's csi_volumes, the source's size, that `mover hydrate delete` removes
        /// (needs the agent's CSI plugin: csi_socket).
        #[arg(long)]
        create: bool,
        /// S3 endpoint of an s3:// repository (as the agent reaches it).
        #[arg(long, value_name = "URL")]
        s3_endpoint: Option<String>,
        /// S3 region of an s3:// repository.
        #[arg(long, value_name = "REGION")]
        s3_region: Option<String>,
        /// Virtual-host style S3 addressing.
        #[arg(long)]
        s3_virtual_host: bool,
        /// The repository's password file, on the agent's node.
        #[arg(long, value_name = "FILE")]
        password_file: Option<PathBuf>,
        /// The repository's raw key file, on the agent's node.
        #[arg(long, value_name = "FILE", conflicts_with = "password_file")]
        key_file: Option<PathBuf>,
        /// Wait until the hydration is complete (as `mover hydrate wait`).
        #[arg(long)]
        wait: bool,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Show hydrations: phase, regions present, bytes fetched, the NBD URI.
    Status {
        /// Only this export.
        export: Option<String>,
        /// Refresh every SECS seconds.
        #[arg(long, value_name = "SECS")]
        watch: Option<u64>,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Wait until a hydration is complete, showing its progress; fails if it is
    /// cancelled, or degraded for longer than --degraded-timeout.
    Wait {
        /// The export.
        export: String,
        /// Give up after the source has failed for this many seconds in a row.
        #[arg(long, value_name = "SECS", default_value_t = 600)]
        degraded_timeout: u64,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Stop fetching; the export is not served until `start` resumes it.
    Cancel {
        /// The export.
        export: String,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Delete a volume a populated PVC's hydration made on the agent (its image, its
    /// fill and its export); refused while a pod's device is staged from it.
    #[command(
        long_about = "Delete a volume the agent made for a hydration started with create (mover's populator makes one per populated PVC, `pvc-UID`, in the agent's csi_volumes): its fill is stopped, its image removed and its export forgotten. The data is gone for good. Refused while a device of it is staged on the node (a pod still uses it), and for any other export (an export agent.toml names, or one the controller registered, is never deleted). mover's controller does this itself when a populated PV whose reclaim policy is Delete is released; use this for a Retain PV's volume you no longer want.

Example:
  mover hydrate delete pvc-6f1c0b2e-… --agent agent://node-b:7070"
    )]
    Delete {
        /// The export (a populated PV's name, `pvc-UID`).
        export: String,
        #[command(flatten)]
        agent: AgentArg,
    },
}

/// Runs a `mover hydrate` command.
pub fn run(cmd: HydrateCommand) -> anyhow::Result<()> {
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    rt.block_on(run_async(cmd))
}

async fn run_async(cmd: HydrateCommand) -> anyhow::Result<()> {
    use HydrateCommand as C;
    let call = |url: &AgentUrl, s: tonic::Status| anyhow::Error::from(status_error(url, s));
    match cmd {
        C::Start {
            export,
            from,
            from_snapshot,
            replica_of,
            region_size,
            bwlimit,
            concurrency,
            overwrite,
            create,
            s3_endpoint,
            s3_region,
            s3_virtual_host,
            password_file,
            key_file,
            wait,
            agent,
        } => {
            let url = agent.url()?;
            let mut c = agent.remote().connect_hydrate(&url).await?;
            let path = |p: Option<PathBuf>| p.map(|p| p.display().to_string()).unwrap_or_default();
            let source = match (from, from_snapshot) {
                (Some(u), _) => proto::start_request::Source::Agent(u),
                (None, Some(v)) => proto::start_request::Source::Snapshot(proto::SnapshotSource {
                    repo: v[0].clone(),
                    snapshot: v[1].clone(),
                    s3_endpoint: s3_endpoint.unwrap_or_default(),
                    s3_region: s3_region.unwrap_or_default(),
                    s3_virtual_host,
                    password_file: path(password_file),
                    key_file: path(key_file),
                    ..Default::default()
                }),
                (None, None) => anyhow::bail!(
                    "give --from agent://HOST:PORT/VOLUME or --from-snapshot REPO SNAPSHOT"
                ),
            };
            let s = c
                .start(proto::StartRequest {
                    export: export.clone(),
                    source: Some(source),
                    region_size: region_size.get(),
                    bwlimit: bwlimit.unwrap_or(0),
                    concurrency,
                    overwrite,
                    create,
                    replica_of: replica_of.unwrap_or_default(),
                    ..Default::default()
                })
                .await
                .map_err(|s| call(&url, s))?
                .into_inner();
            print_status(&s, agent.json());
            if wait {
                wait_for(&mut c, &url, &export, 600, agent.json()).await?;
            }
        }
        C::Status {
            export,
            watch,
            agent,
        } => {
            let url = agent.url()?;
            let mut c = agent.remote().connect_hydrate(&url).await?;
            loop {
                let all = match &export {
                    Some(e) => vec![
                        c.get(proto::NameRequest { export: e.clone() })
                            .await
                            .map_err(|s| call(&url, s))?
                            .into_inner(),
                    ],
                    None => {
                        c.list(proto::ListRequest {})
                            .await
                            .map_err(|s| call(&url, s))?
                            .into_inner()
                            .hydrations
                    }
                };
                if watch.is_some() && !agent.json() {
                    print!("\x1b[2J\x1b[H");
                }
                if all.is_empty() && !agent.json() {
                    println!("no hydrations on {url}");
                }
                for s in &all {
                    print_status(s, agent.json());
                }
                match watch {
                    Some(secs) => tokio::time::sleep(Duration::from_secs(secs.max(1))).await,
                    None => break,
                }
            }
        }
        C::Wait {
            export,
            degraded_timeout,
            agent,
        } => {
            let url = agent.url()?;
            let mut c = agent.remote().connect_hydrate(&url).await?;
            wait_for(&mut c, &url, &export, degraded_timeout, agent.json()).await?;
        }
        C::Cancel { export, agent } => {
            let url = agent.url()?;
            let mut c = agent.remote().connect_hydrate(&url).await?;
            let s = c
                .cancel(proto::NameRequest { export })
                .await
                .map_err(|s| call(&url, s))?
                .into_inner();
            print_status(&s, agent.json());
        }
        C::Delete { export, agent } => {
            let url = agent.url()?;
            let mut c = agent.remote().connect_hydrate(&url).await?;
            let r = c
                .delete(proto::NameRequest {
                    export: export.clone(),
                })
                .await
                .map_err(|s| call(&url, s))?
                .into_inner();
            match (agent.json(), r.deleted) {
                (true, deleted) => println!("{}", serde_json::json!({ "deleted": deleted })),
                (false, true) => println!("deleted {export}: its image, fill and export"),
                (false, false) => println!("nothing of {export} was left on the agent"),
            }
        }
    }
    Ok(())
}

/// Polls until the hydration is complete; a progress line on a terminal.
async fn wait_for(
    c: &mut mover::remote::HydrateClient,
    url: &AgentUrl,
    export: &str,
    degraded_timeout: u64,
    json: bool,
) -> anyhow::Result<()> {
    let mut degraded_since: Option<std::time::Instant> = None;
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    loop {
        let s = c
            .get(proto::NameRequest {
                export: export.into(),
            })
            .await
            .map_err(|s| anyhow::Error::from(status_error(url, s)))?
            .into_inner();
        if tty && !json {
            eprint!(
                "\r{}: {} {:.1}% ({} of {} regions, {} fetched)   ",
                s.export,
                s.phase,
                100.0 * s.present as f64 / s.regions.max(1) as f64,
                s.present,
                s.regions,
                human(s.bytes_fetched)
            );
        }
        match s.phase.as_str() {
            "Complete" => {
                if tty && !json {
                    eprintln!();
                }
                print_status(&s, json);
                return Ok(());
            }
            "Cancelled" => anyhow::bail!(
                "the hydration of {export} was cancelled at {}/{} regions; `mover hydrate start` resumes it",
                s.present,
                s.regions
            ),
            "Degraded" => {
                let since = *degraded_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() > Duration::from_secs(degraded_timeout) {
                    anyhow::bail!(
                        "the hydration of {export} has been degraded for {degraded_timeout} s: {}",
                        s.last_error
                    );
                }
            }
            _ => degraded_since = None,
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn print_status(s: &proto::Status, json: bool) {
    if json {
        let v = serde_json::json!({
            "export": s.export,
            "source": s.source,
            "phase": s.phase,
            "size": s.size,
            "region_size": s.region_size,
            "regions": s.regions,
            "present": s.present,
            "bytes_fetched": s.bytes_fetched,
            "foreground_fetches": s.foreground_fetches,
            "foreground_failures": s.foreground_failures,
            "regions_written": s.regions_written,
            "elapsed_secs": s.elapsed_secs,
            "last_error": s.last_error,
            "nbd_uri": s.nbd_uri,
        });
        println!("{v}");
        return;
    }
    println!(
        "{}: {} from {}\n  {}/{} regions of {} ({:.1}%), {} fetched ({} regions for clients{}, {} written whole by clients), {:.1} s",
        s.export,
        s.phase,
        s.source,
        s.present,
        s.regions,
        human(s.region_size),
        100.0 * s.present as f64 / s.regions.max(1) as f64,
        human(s.bytes_fetched),
        s.foreground_fetches,
        match s.foreground_failures {
            0 => String::new(),
            n => format!(", {n} failed"),
        },
        s.regions_written,
        s.elapsed_secs
    );
    if !s.last_error.is_empty() {
        println!("  last error: {}", s.last_error);
    }
    if !s.nbd_uri.is_empty() {
        println!("  nbd: {}", s.nbd_uri);
    }
}
