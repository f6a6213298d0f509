//! The `mover` binary: parses arguments, sets up logging and progress, calls the engine,
//! and maps errors to exit codes. Each command's flags and its run are in `cli/`; all
//! the work lives in the library crates.

use clap::{Parser, Subcommand};
use mover::{CopyError, EndpointError};
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
    #[command(
        long_about = "Copy a block volume (a block device such as /dev/loop0 or an \
        image file) or a file tree (a directory) onto another.\n\n\
        Block volumes: if DST does not exist, a sparse image file is created (under a hidden \
        temp name, renamed into place when complete). If DST already holds an older copy, it \
        is read and compared, and only the 4 KiB pages that differ are written. Zero regions \
        and holes of SRC stay holes in DST (punched, not written as zeros).\n\n\
        File trees (SRC is a directory): DST becomes a copy of SRC's contents, like \
        `rsync -aHAXS --numeric-ids SRC/ DST/`: regular files (holes kept), directories, \
        symlinks, hard links, device nodes, FIFOs and sockets, with mode, numeric owner \
        (as root), mtime (ns), xattrs and POSIX ACLs. A new DST is built under \
        .DST.mover-partial and renamed into place when complete. Onto an existing DST, \
        files with the same size and mtime are skipped (--checksum compares content), \
        changed files are rebuilt under a temp name and renamed over the old (large ones \
        from the chunks the old copy already holds, where that saves work: with an agent, \
        or onto a filesystem with reflinks such as XFS or Btrfs), and entries SRC lacks are kept \
        unless --delete. Entries that cannot be copied are listed; the exit status is then 1. \
        With --replica (a DST only mover writes), each run keeps a record of DST and the \
        next compares SRC with it, looking in DST only where SRC changed.\n\n\
        Either side may be an agent's export (agent://HOST:PORT/NAME): a tree is pushed \
        into an export that is a directory (or not made yet), and pulled from one. The \
        side that writes walks both trees, so the rules above hold either way.\n\n\
        An interrupted copy (Ctrl-C, kill -9, power loss) is finished by running the same \
        command again: what is already equal is read, not rewritten.\n\n\
        Refused, with nothing written: a missing SRC, a DST smaller than SRC (see --grow), \
        SRC and DST being the same storage (or one tree inside the other), a DST block device \
        that is mounted or in use (see --force), a tree onto a DST that is not a directory.\n\n\
        Examples:\n  \
        mover copy /dev/vg0/data /dev/sdb            # device to device\n  \
        mover copy /dev/loop0 backup.img --verify    # device to a new sparse image\n  \
        mover copy today.img yesterday.img --json    # delta onto an older copy\n  \
        mover copy /srv/data /mnt/backup/data --delete  # tree, mirrored\n  \
        mover copy --replica --delete /srv/data /mnt/replica/data  # rerun often\n  \
        mover copy /srv/data agent://node-b:7070/data   # tree into node b's export"
    )]
    Copy(cli::copy::CopyArgs),
    /// Run the per-node agent: serve exported volumes to peers over gRPC.
    #[command(
        long_about = "Run the per-node agent. It serves the volumes its config exports \
        (and nothing else) to peers: `mover copy SRC agent://HOST:PORT/NAME` pushes into an \
        export, `mover copy agent://HOST:PORT/NAME DST` pulls from one. Callers prove one of \
        two roles, by a certificate from the agent's CA or a bearer token: control \
        (token_file; the controller's certificate) registers exports and steers \
        relationships, schedules and hydrations; replication (replication_token_file, \
        what peer clusters present; this cluster's agents' certificates) only runs \
        cycles, hydrations and pulls against the exports its relationship names. Writes \
        carry a fencing epoch. /metrics and /healthz (which fails when the state directory \
        is not writable, a cycle is wedged, the gRPC server does not answer or the \
        certificate is near its end) are served on metrics_listen. Block exports are also served over NBD on a \
        Unix socket (nbd_socket, default STATE_DIR/nbd.sock) for clients on this node, \
        hydrating exports included (`mover hydrate`), and with [tls] on nbd_listen over \
        TCP to clients holding a certificate from the CA (nbds://). Under Kubernetes the controller \
        registers each replicated PersistentVolume as an export named after the PV, at the \
        path the PV names, if that path lies under one of volume_roots, for one \
        relationship, and serves it to that relationship only (kept across restarts in \
        STATE_DIR/exports.json). Stops gracefully on SIGINT or SIGTERM.\n\n\
        Example agent.toml:\n\n\
        \x20 listen = \"0.0.0.0:7070\"\n\
        \x20 metrics_listen = \"0.0.0.0:9470\"\n\
        \x20 token_file = \"/etc/mover/token\"\n\
        \x20 replication_token_file = \"/etc/mover/replication/token\"\n\
        \x20 nbd_socket = \"/run/mover/nbd.sock\"\n\
        \x20 volume_roots = [\"/var/lib/kubelet/plugins/kubernetes.io/csi\", \"/mnt/disks\"]\n\
        \x20 [tls]\n\
        \x20 cert = \"/etc/mover/agent.crt\"\n\
        \x20 key = \"/etc/mover/agent.key\"\n\
        \x20 ca = \"/etc/mover/ca.crt\"\n\
        \x20 # or, under Kubernetes: from_kubernetes = true (a certificate for NODE_NAME\n\
        \x20 # from the controller's CA through the CSR API, kept in STATE_DIR/tls)\n\
        \x20 [exports.pvc-data]\n\
        \x20 path = \"/dev/vg0/pvc-data\"\n\
        \x20 [exports.golden]\n\
        \x20 path = \"/srv/golden.img\"\n\
        \x20 read_only = true\n\
        \x20 [exports.www]\n\
        \x20 path = \"/srv/www\"   # a directory: a file tree"
    )]
    Agent(cli::agent::AgentArgs),
    /// Print a block volume's chunk digest (Merkle root over keyed BLAKE3 chunk ids).
    #[command(
        long_about = "Hash a block volume the way mover sees it: fixed chunks, \
        zeros and holes counted apart, a Merkle root over all chunks. Two volumes with \
        the same root (at the same chunk size) hold the same bytes."
    )]
    Hash(cli::copy::HashArgs),
    /// Continuous replication: relationships on agents, failover and failback.
    #[command(
        subcommand,
        long_about = "Continuous replication of block volumes between agents. A relationship \
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
  mover replicate promote pg --agent agent://node-b:7070"
    )]
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

/// The one place where errors become exit codes.
fn exit_code(err: &anyhow::Error) -> u8 {
    let copy_error =
        err.downcast_ref::<CopyError>()
            .or_else(|| match err.downcast_ref::<EndpointError>() {
                Some(EndpointError::Copy(e)) => Some(e),
                _ => None,
            });
    match copy_error {
        Some(CopyError::VerifyFailed { .. } | CopyError::TreeVerifyFailed { .. }) => {
            EXIT_VERIFY_FAILED
        }
        Some(e) if e.is_refusal() => EXIT_REFUSED,
        _ if err
            .downcast_ref::<EndpointError>()
            .is_some_and(EndpointError::is_refusal) =>
        {
            EXIT_REFUSED
        }
        _ => match err.downcast_ref::<snapshots::RepoError>() {
            Some(e) if e.is_corruption() => EXIT_VERIFY_FAILED,
            Some(e) if e.is_refusal() => EXIT_REFUSED,
            _ => EXIT_FAILED,
        },
    }
}

/// Calls the runner of the command.
fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Copy(args) => cli::copy::run_copy(&args),
        Command::Agent(args) => cli::agent::run_agent(&args.config),
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
