//! `mover snapshot schedule ...`: the CLI of an agent's scheduled snapshots.

use super::human;
use super::replicate::AgentArg;
use mover::remote::status_error;
use std::path::PathBuf;
use transport::schedule as proto;

/// `mover snapshot schedule` subcommands.
// Parsed once per process: the size of the largest variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(clap::Subcommand)]
pub enum ScheduleCommand {
    /// Create a schedule on the agent holding the volume, or change it.
    #[command(
        // clap does not wrap a usage line: this one, unwrapped, is 118 columns.
        override_usage = "mover snapshot schedule create [OPTIONS] --volume <EXPORT> \
                          --repo <REPO>\n       --schedule <WHEN> --agent <URL> <NAME>",
        long_about = "Create (or change) a schedule on the agent that holds the \
        volume: the agent snapshots the export into the repository at the times given \
        (--schedule), forgets old snapshots by the --keep-* rules (this schedule's only) \
        and prunes every --prune-every snapshots. The first run of an interval schedule \
        is at once. The repository must exist (`mover repo init`). The password or key \
        file, and S3 keys from AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, are sent to \
        the agent, which keeps them in its state directory readable by root only."
    )]
    Create {
        /// The schedule's name (also the snapshots' volume name, unless --snapshot-name).
        name: String,
        /// The agent's export to snapshot (a block volume).
        #[arg(long, value_name = "EXPORT")]
        volume: String,
        /// The repository as the agent's node sees it: a directory, or s3://BUCKET[/PREFIX].
        #[arg(long, value_name = "REPO")]
        repo: String,
        /// When: an interval ("30m", "6h"; at least 1m), "hourly:MM" or "daily:HH:MM"
        /// (UTC). Refused input exits 2, as any bad argument.
        #[arg(long, value_name = "WHEN", value_parser = checked_schedule)]
        schedule: String,
        #[command(flatten)]
        keep: super::snapshot::KeepArgs,
        /// Prune the repository after every N snapshots (0: never).
        #[arg(long, value_name = "N", default_value_t = 0)]
        prune_every: u32,
        /// The snapshots' volume name in the repository [default: the schedule's name].
        #[arg(long, value_name = "NAME")]
        snapshot_name: Option<String>,
        /// The repository password, from this file (first line) [or MOVER_PASSWORD].
        #[arg(long, value_name = "FILE", env = "MOVER_PASSWORD_FILE")]
        password_file: Option<PathBuf>,
        /// A raw key file instead of a password.
        #[arg(long, value_name = "FILE", conflicts_with = "password_file")]
        key_file: Option<PathBuf>,
        /// Endpoint URL of an S3-compatible server, as the agent reaches it.
        #[arg(long, value_name = "URL", env = "MOVER_S3_ENDPOINT")]
        s3_endpoint: Option<String>,
        /// Region of the S3 bucket.
        #[arg(long, value_name = "REGION", env = "MOVER_S3_REGION")]
        s3_region: Option<String>,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Show schedules: last snapshot, next run, failures.
    Status {
        /// One schedule [default: all of the agent's].
        name: Option<String>,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Take a schedule's snapshot now and wait for it.
    Run {
        /// The schedule.
        name: String,
        #[command(flatten)]
        agent: AgentArg,
    },
    /// Stop a schedule and forget it (its snapshots stay in the repository).
    Delete {
        /// The schedule.
        name: String,
        #[command(flatten)]
        agent: AgentArg,
    },
}

/// Runs a `mover snapshot schedule` subcommand.
pub async fn run(cmd: ScheduleCommand) -> anyhow::Result<()> {
    let agent = match &cmd {
        ScheduleCommand::Create { agent, .. }
        | ScheduleCommand::Status { agent, .. }
        | ScheduleCommand::Run { agent, .. }
        | ScheduleCommand::Delete { agent, .. } => agent.clone(),
    };
    let call = agent.url()?;
    let mut c = agent.remote().connect_schedules(&call).await?;
    let fail = |e: tonic::Status| anyhow::Error::from(status_error(&call, e));
    let statuses = match cmd {
        ScheduleCommand::Create {
            name,
            volume,
            repo,
            schedule,
            keep,
            prune_every,
            snapshot_name,
            password_file,
            key_file,
            s3_endpoint,
            s3_region,
            agent: _,
        } => {
            let (password, raw_key) = secret(password_file, key_file)?;
            let env = |k: &str| std::env::var(k).unwrap_or_default();
            let spec = proto::Spec {
                name,
                volume,
                repository: repo,
                schedule,
                keep: Some({
                    let p = keep.policy();
                    proto::Keep {
                        last: p.last,
                        hourly: p.hourly,
                        daily: p.daily,
                        weekly: p.weekly,
                        monthly: p.monthly,
                    }
                }),
                prune_every,
                snapshot_name: snapshot_name.unwrap_or_default(),
                access: Some(proto::Access {
                    password,
                    raw_key,
                    s3_endpoint: s3_endpoint.unwrap_or_default(),
                    s3_region: s3_region.unwrap_or_default(),
                    s3_access_key_id: env("AWS_ACCESS_KEY_ID"),
                    s3_secret_access_key: env("AWS_SECRET_ACCESS_KEY"),
                }),
                access_version: String::new(),
                // A live read is taken and tagged crash-inconsistent, as it always was
                // here; the controller's classes require a point in time by default.
                require_point_in_time: false,
            };
            vec![c.apply(spec).await.map_err(fail)?.into_inner()]
        }
        ScheduleCommand::Status {
            name: Some(name), ..
        } => {
            vec![
                c.get(proto::NameRequest { name })
                    .await
                    .map_err(fail)?
                    .into_inner(),
            ]
        }
        ScheduleCommand::Status { name: None, .. } => {
            c.list(proto::ListRequest {})
                .await
                .map_err(fail)?
                .into_inner()
                .schedules
        }
        ScheduleCommand::Run { name, .. } => {
            vec![
                c.run(proto::NameRequest { name })
                    .await
                    .map_err(fail)?
                    .into_inner(),
            ]
        }
        ScheduleCommand::Delete { name, .. } => {
            c.delete(proto::NameRequest { name: name.clone() })
                .await
                .map_err(fail)?;
            println!("schedule {name} deleted; its snapshots stay in the repository");
            return Ok(());
        }
    };
    if agent.json() {
        let all: Vec<_> = statuses.iter().map(json).collect();
        println!("{}", serde_json::Value::Array(all));
    } else {
        for s in &statuses {
            print_status(s);
        }
    }
    if statuses.iter().any(|s| s.state == "Failing") {
        anyhow::bail!("a schedule is failing (see last error above)");
    }
    Ok(())
}

/// The password (or key) to send: from a file, else MOVER_PASSWORD.
fn secret(password: Option<PathBuf>, key: Option<PathBuf>) -> anyhow::Result<(Vec<u8>, bool)> {
    let opts = mover::RepoOptions {
        password_file: password,
        key_file: key,
        ..Default::default()
    };
    Ok(match opts.credentials()? {
        snapshots::Credentials::Password(p) => (p.into_bytes(), false),
        snapshots::Credentials::RawKey(k) => (k, true),
    })
}

fn time(ms: i64) -> String {
    if ms <= 0 {
        "-".into()
    } else {
        snapshots::retention::format_time(ms / 1000)
    }
}

fn print_status(s: &proto::Status) {
    let spec = s.spec.clone().unwrap_or_default();
    println!(
        "{}: {} -> {} at {}: {}",
        spec.name, spec.volume, spec.repository, spec.schedule, s.state
    );
    if s.last_time_ms > 0 {
        println!(
            "  last snapshot {} at {} ({:.1}s, {} added, {})",
            &s.last_snapshot[..s.last_snapshot.len().min(8)],
            time(s.last_time_ms),
            s.last_duration_ms as f64 / 1000.0,
            human(s.last_bytes_added),
            s.consistency
        );
    }
    println!(
        "  next run {}; {} taken, {} failed, {} forgotten, {} packs pruned",
        time(s.next_run_ms),
        s.runs_ok,
        s.runs_failed,
        s.forgotten,
        s.pruned_packs
    );
    if !s.last_error.is_empty() {
        println!("  last error: {}", s.last_error);
    }
}

fn json(s: &proto::Status) -> serde_json::Value {
    let spec = s.spec.clone().unwrap_or_default();
    let keep = spec.keep.unwrap_or_default();
    serde_json::json!({
        "name": spec.name,
        "volume": spec.volume,
        "repository": spec.repository,
        "schedule": spec.schedule,
        "keep": {"last": keep.last, "hourly": keep.hourly, "daily": keep.daily,
                 "weekly": keep.weekly, "monthly": keep.monthly},
        "prune_every": spec.prune_every,
        "state": s.state,
        "last_snapshot": s.last_snapshot,
        "last_time_ms": s.last_time_ms,
        "last_duration_ms": s.last_duration_ms,
        "last_bytes_added": s.last_bytes_added,
        "next_run_ms": s.next_run_ms,
        "runs_ok": s.runs_ok,
        "runs_failed": s.runs_failed,
        "forgotten": s.forgotten,
        "pruned_packs": s.pruned_packs,
        "last_error": s.last_error,
        "consistency": s.consistency,
    })
}

/// `--schedule`, checked as the agent will parse it: a bad one is a usage error (exit 2)
/// before anything is sent.
fn checked_schedule(s: &str) -> Result<String, String> {
    mover::schedule::When::parse(s).map(|_| s.to_string())
}
