//! The `mover` binary: parses arguments, sets up logging and progress, calls the engine,
//! and maps errors to exit codes. Each command's flags and its run are in `cli/`; all
//! the work lives in the library crates.

use clap::{Parser, Subcommand};
use mover::Outcome;
use std::process::ExitCode;

mod cli;

/// Exit code for a failure part way (rerunning resumes).
const EXIT_FAILED: u8 = 1;
/// Exit code for refused input (nothing was written) and usage errors.
const EXIT_REFUSED: u8 = 2;
/// Exit code for a copy whose read-back did not match the source, or damaged data in
/// a repository.
const EXIT_VERIFY_FAILED: u8 = 3;

#[derive(Parser)]
#[command(
    name = "mover",
    version,
    about = "Copy, replicate and snapshot volumes: block devices, images and file trees",
    after_help = "Exit status: 0 done; 1 failed part way (rerun to resume); \
                  2 refused bad input or usage (nothing written); 3 verification failed.\n\
                  Logging: RUST_LOG=debug (default info) on stderr."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Copy a block volume or a file tree onto another, writing only what differs.
    #[command(long_about = cli::copy::COPY_HELP)]
    Copy(cli::copy::CopyArgs),
    /// Run the per-node agent: serve exported volumes to peers over gRPC.
    #[command(long_about = cli::agent::AGENT_HELP)]
    Agent(cli::agent::AgentArgs),
    /// Keep the agent's device connections (FUSE descriptors) across its restarts.
    #[command(long_about = cli::agent::FD_STORE_HELP)]
    FdStore(cli::agent::FdStoreArgs),
    /// Print a block volume's chunk digest (Merkle root over keyed BLAKE3 chunk ids).
    #[command(long_about = cli::copy::HASH_HELP)]
    Hash(cli::copy::HashArgs),
    /// Continuous replication: relationships on agents, failover and failback.
    #[command(subcommand, long_about = cli::replicate::REPLICATE_HELP)]
    Replicate(cli::replicate::ReplicateCommand),
    /// Copy-on-demand: an export served over NBD at once while its data arrives.
    #[command(subcommand)]
    Hydrate(cli::hydrate::HydrateCommand),
    /// Manage snapshot repositories (a directory or an S3 bucket).
    #[command(subcommand)]
    Repo(cli::snapshot::RepoCommand),
    /// Snapshots of block volumes: create, list, restore, diff, verify, forget, prune.
    #[command(subcommand)]
    Snapshot(cli::snapshot::SnapshotCommand),
    /// The Kubernetes controller: VolumeReplication resources drive the agents.
    #[cfg(feature = "controller")]
    #[command(subcommand)]
    Controller(cli::agent::ControllerCommand),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        // Colour for a person at a terminal, never escape codes in a log file.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("mover: error: {err:#}");
            ExitCode::from(exit_code(&err))
        }
    }
}

/// Exit codes from the engine's one classification of errors.
fn exit_code(err: &anyhow::Error) -> u8 {
    match mover::outcome_of(&**err) {
        Outcome::Refused => EXIT_REFUSED,
        Outcome::Damaged => EXIT_VERIFY_FAILED,
        Outcome::Failed => EXIT_FAILED,
    }
}

/// Calls the runner of the command.
fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Copy(args) => cli::copy::run_copy(&args),
        Command::Agent(args) => cli::agent::run_agent(&args.config),
        Command::FdStore(args) => cli::agent::run_fd_store(&args),
        Command::Hash(args) => cli::copy::run_hash(&args),
        Command::Replicate(cmd) => cli::replicate::run(cmd),
        Command::Hydrate(cmd) => cli::hydrate::run(cmd),
        Command::Repo(cmd) => cli::snapshot::run_repo(cmd),
        Command::Snapshot(cmd) => {
            let restore = matches!(cmd, cli::snapshot::SnapshotCommand::Restore { .. });
            cli::bounded_malloc(!restore);
            cli::snapshot::run_snapshot(cmd)
        }
        #[cfg(feature = "controller")]
        Command::Controller(cmd) => cli::agent::run_controller(cmd),
    }
}

#[cfg(test)]
mod tests {
    use super::Cli;
    use clap::CommandFactory;

    /// Every command's help, short and long, at a terminal's width: no line wider, none
    /// ending in blanks, no paragraph continued with a stray indent, examples kept.
    #[test]
    fn every_help_reads_cleanly_at_80_and_120_columns() {
        Cli::command().debug_assert();
        // Each command's path of names, rendered as a user sees it: `mover ... -h`.
        let mut paths = vec![vec![String::from("mover")]];
        let (mut checked, mut problems) = (0, Vec::new());
        while let Some(path) = paths.pop() {
            let mut cmd = &Cli::command();
            for name in &path[1..] {
                cmd = cmd.find_subcommand(name).expect("subcommand");
            }
            for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
                let mut p = path.clone();
                p.push(sub.get_name().into());
                paths.push(p);
            }
            for width in [80, 120] {
                for flag in ["-h", "--help"] {
                    let mut args = path.clone();
                    args.push(flag.into());
                    let e = Cli::command()
                        .term_width(width)
                        .try_get_matches_from(&args)
                        .expect_err("help is an early exit");
                    assert_eq!(e.kind(), clap::error::ErrorKind::DisplayHelp);
                    let text = e.render().to_string();
                    let what = format!("{} at {width}", args.join(" "));
                    problems.extend(check_help(&what, &text, width));
                    checked += 1;
                }
            }
        }
        assert!(checked > 40, "only {checked} helps rendered");
        assert!(problems.is_empty(), "{}", problems.join("\n"));
    }

    /// What is wrong with one rendered help (nothing: it reads cleanly).
    fn check_help(what: &str, text: &str, width: usize) -> Vec<String> {
        let mut bad = Vec::new();
        let lines: Vec<&str> = text.lines().collect();
        for line in &lines {
            let n = line.chars().count();
            if n > width {
                bad.push(format!("{what}: {n} wide: {line}"));
            }
            // (clap pads the blank line before a long help's [default] to the indent.)
            if !line.trim().is_empty() && line.trim_end() != *line {
                bad.push(format!("{what}: ends in blanks: {line:?}"));
            }
        }
        // The description (before "Usage:"): prose starts at column 0, examples at 2
        // or more; an example line clap had to wrap would continue at column 0.
        let usage = lines.iter().position(|l| l.starts_with("Usage:"));
        let about = &lines[..usage.unwrap_or(0)];
        let indent = |l: &str| l.len() - l.trim_start().len();
        for pair in about.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if b.trim().is_empty() {
                continue;
            }
            if indent(a) >= 2 && indent(b) < 2 {
                bad.push(format!("{what}: a wrapped example line:\n{a}\n{b}"));
            }
            if indent(a) == 0 && !a.is_empty() && indent(b) > 0 && !a.ends_with(':') {
                bad.push(format!(
                    "{what}: a paragraph goes on with a stray indent:\n{a}\n{b}"
                ));
            }
        }
        bad
    }
}
