//! The `mover` binary: parses arguments, sets up logging and progress, calls the engine,
//! and maps errors to exit codes. All the work lives in the `mover` library.

use anyhow::Context;
use clap::{Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use mover::remote::AgentUrl;
use mover::{CopyError, CopyOptions, CopySummary, HashSummary, Progress, TreeSummary};
use std::{io::IsTerminal, path::PathBuf, process::ExitCode, sync::Mutex};

#[path = "hydrate/cli.rs"]
mod hydrate_cli;
#[path = "replicate/cli.rs"]
mod replicate_cli;
#[path = "schedule/cli.rs"]
mod schedule_cli;
#[path = "snapshot/cli.rs"]
mod snapshot_cli;

/// Exit code for refused input (nothing was written) and usage errors.
const EXIT_REFUSED: u8 = 2;
/// Exit code for a copy whose read-back did not match the source.
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
    Copy {
        /// Source: a block device, an image file, a directory, or agent://HOST:PORT/NAME.
        src: PathBuf,
        /// Destination: a block device, an image file (existing or new), a directory
        /// (existing or new) for a tree, or agent://HOST:PORT/NAME.
        dst: PathBuf,
        #[command(flatten)]
        options: CopyOptions,
        #[command(flatten)]
        tree: mover::TreeOptions,
        #[command(flatten)]
        remote: mover::remote::RemoteOptions,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// Run the per-node agent: serve exported volumes to peers over gRPC.
    #[command(
        long_about = "Run the per-node agent. It serves the volumes its config exports \
        (and nothing else) to peers: `mover copy SRC agent://HOST:PORT/NAME` pushes into an \
        export, `mover copy agent://HOST:PORT/NAME DST` pulls from one. Peers authenticate \
        with mutual TLS and/or a bearer token; writes carry a fencing epoch. /metrics and \
        /healthz are served on metrics_listen. Block exports are also served over NBD on a \
        Unix socket (nbd_socket, default STATE_DIR/nbd.sock) for clients on this node, \
        hydrating exports included (`mover hydrate`), and with [tls] on nbd_listen over \
        TCP to clients holding a certificate from the CA (nbds://). Under Kubernetes the controller \
        registers each replicated PersistentVolume as an export named after the PV, at the \
        path the PV names, if that path lies under one of volume_roots (kept across \
        restarts in STATE_DIR/exports.json). Stops gracefully on SIGINT or SIGTERM.\n\n\
        Example agent.toml:\n\n\
        \x20 listen = \"0.0.0.0:7070\"\n\
        \x20 metrics_listen = \"0.0.0.0:9470\"\n\
        \x20 token_file = \"/etc/mover/token\"\n\
        \x20 nbd_socket = \"/run/mover/nbd.sock\"\n\
        \x20 volume_roots = [\"/var/lib/kubelet/plugins/kubernetes.io/csi\", \"/mnt/disks\"]\n\
        \x20 [tls]\n\
        \x20 cert = \"/etc/mover/agent.crt\"\n\
        \x20 key = \"/etc/mover/agent.key\"\n\
        \x20 ca = \"/etc/mover/ca.crt\"\n\
        \x20 [exports.pvc-data]\n\
        \x20 path = \"/dev/vg0/pvc-data\"\n\
        \x20 [exports.golden]\n\
        \x20 path = \"/srv/golden.img\"\n\
        \x20 read_only = true\n\
        \x20 [exports.www]\n\
        \x20 path = \"/srv/www\"   # a directory: a file tree"
    )]
    Agent {
        /// The agent's TOML configuration.
        #[arg(long, value_name = "FILE")]
        config: PathBuf,
    },
    /// Print a block volume's chunk digest (Merkle root over keyed BLAKE3 chunk ids).
    #[command(
        long_about = "Hash a block volume the way mover sees it: fixed chunks, \
        zeros and holes counted apart, a Merkle root over all chunks. Two volumes with \
        the same root (at the same chunk size) hold the same bytes."
    )]
    Hash {
        /// The volume: a block device or an image file.
        volume: PathBuf,
        /// Chunk size: a power of two from 64K to 8M.
        #[arg(long, value_name = "SIZE", default_value_t = chunker::ChunkSize::DEFAULT)]
        chunk_size: chunker::ChunkSize,
        /// Hashing threads [default: one per core].
        #[arg(long, value_name = "N")]
        threads: Option<usize>,
        #[command(flatten)]
        output: OutputArgs,
    },
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
    Replicate(replicate_cli::ReplicateCommand),
    /// Copy-on-demand: an export served over NBD at once while its data arrives.
    #[command(subcommand)]
    Hydrate(hydrate_cli::HydrateCommand),
    /// Manage snapshot repositories (a directory or an S3 bucket).
    #[command(subcommand)]
    Repo(snapshot_cli::RepoCommand),
    /// Snapshots of block volumes: create, list, restore, diff, verify, forget, prune.
    #[command(subcommand)]
    Snapshot(snapshot_cli::SnapshotCommand),
    /// The Kubernetes controller: VolumeReplication resources drive the agents.
    #[cfg(feature = "controller")]
    #[command(subcommand)]
    Controller(ControllerCommand),
}

/// `mover controller` subcommands.
#[cfg(feature = "controller")]
#[derive(Subcommand)]
enum ControllerCommand {
    /// Write the CRDs (VolumeReplicationClass, VolumeReplication) as YAML files.
    Crds {
        /// The API group: replication.mover, or replication.storage.openshift.io to
        /// stand in for csi-addons.
        #[arg(long, default_value = mover::controller::crd::MOVER_GROUP)]
        group: String,
        /// The directory to write them into.
        #[arg(long, value_name = "DIR", default_value = "deploy/crds")]
        out: PathBuf,
    },
    /// Run the controller (in the cluster, or with a kubeconfig) until SIGINT or SIGTERM.
    Run(Box<mover::controller::RunOptions>),
}

/// How results are shown.
#[derive(clap::Args)]
struct OutputArgs {
    /// Print one JSON object with the results on stdout instead of text.
    #[arg(long)]
    json: bool,
    /// Never draw a progress bar (it is drawn only when stderr is a terminal).
    #[arg(long)]
    no_progress: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
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
    match err.downcast_ref::<CopyError>() {
        Some(CopyError::VerifyFailed { .. } | CopyError::TreeVerifyFailed { .. }) => {
            EXIT_VERIFY_FAILED
        }
        Some(e) if e.is_refusal() => EXIT_REFUSED,
        _ if err.downcast_ref::<Unsupported>().is_some() => EXIT_REFUSED,
        _ if err.downcast_ref::<Refused>().is_some() => EXIT_REFUSED,
        _ => snapshot_cli::exit_code(err),
    }
}

/// An endpoint kind this build does not handle yet.
#[derive(Debug, thiserror::Error)]
#[error(
    "{0}: not supported by this build; copy endpoints are local devices, image files, or agent://HOST:PORT/VOLUME"
)]
struct Unsupported(String);

/// Options that do not go together; nothing was written.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Refused(String);

fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Copy {
            src,
            dst,
            options,
            tree,
            remote,
            output,
        } => {
            let bar = Bar::new(&output);
            let context = || format!("copy {} -> {}", src.display(), dst.display());
            let url = |p: &std::path::Path| AgentUrl::parse(&p.to_string_lossy()).transpose();
            let (from, to) = (url(&src)?, url(&dst)?);
            if tree.replica && (from.is_some() || to.is_some()) {
                anyhow::bail!(Refused(
                    "--replica is for local DIR to DIR copies only (no record is kept of an \
                     agent's tree yet); drop --replica to copy with an agent"
                        .into()
                ));
            }
            let tree = mover::TreeOptions {
                verify: options.verify,
                state_dir: Some(options.state_dir()),
                ..tree
            };
            let summary = if std::fs::metadata(&src).is_ok_and(|m| m.is_dir()) {
                Some(match &to {
                    Some(to) => mover::remote::push_tree(&src, to, &tree, &remote, &bar),
                    None if dst.to_string_lossy().contains("://") => {
                        anyhow::bail!(Unsupported(dst.display().to_string()))
                    }
                    None => mover::copy_tree(&src, &dst, &tree, &bar),
                })
            } else if let (Some(from), None) = (&from, &to)
                && mover::remote::is_tree(from, &remote).with_context(context)?
            {
                Some(mover::remote::pull_tree(from, &dst, &tree, &remote, &bar))
            } else {
                None
            };
            if let Some(summary) = summary {
                let summary = summary.with_context(context)?;
                bar.done();
                return print_tree(&summary, output.json);
            }
            let summary = copy(&src, &dst, &options, &remote, &bar).with_context(context)?;
            bar.done();
            print_copy(&summary, output.json)
        }
        Command::Agent { config } => run_agent(&config),
        Command::Hash {
            volume,
            chunk_size,
            threads,
            output,
        } => {
            let bar = Bar::new(&output);
            let summary = mover::hash_block(&volume, chunk_size, threads, &bar)
                .with_context(|| format!("hash {}", volume.display()))?;
            bar.done();
            print_hash(&summary, output.json)
        }
        Command::Replicate(cmd) => replicate_cli::run(cmd),
        Command::Hydrate(cmd) => hydrate_cli::run(cmd),
        Command::Repo(cmd) => snapshot_cli::run_repo(cmd),
        Command::Snapshot(cmd) => {
            let restore = matches!(cmd, snapshot_cli::SnapshotCommand::Restore { .. });
            bounded_malloc(!restore);
            snapshot_cli::run_snapshot(cmd)
        }
        #[cfg(feature = "controller")]
        Command::Controller(cmd) => run_controller(cmd),
    }
}

/// `mover controller ...`.
#[cfg(feature = "controller")]
fn run_controller(cmd: ControllerCommand) -> anyhow::Result<()> {
    match cmd {
        ControllerCommand::Crds { group, out } => {
            for path in mover::controller::write_crds(&group, &out)
                .with_context(|| format!("cannot write the CRDs into {}", out.display()))?
            {
                println!("{}", path.display());
            }
            Ok(())
        }
        ControllerCommand::Run(options) => {
            let runtime =
                tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            runtime.block_on(mover::controller::run(*options))?;
            Ok(())
        }
    }
}

/// Dispatches a copy by the kinds of its endpoints: local, or to/from an agent.
fn copy(
    src: &std::path::Path,
    dst: &std::path::Path,
    options: &CopyOptions,
    remote: &mover::remote::RemoteOptions,
    bar: &Bar,
) -> anyhow::Result<CopySummary> {
    let url = |p: &std::path::Path| AgentUrl::parse(&p.to_string_lossy()).transpose();
    let (from, to) = (url(src)?, url(dst)?);
    for p in [src, dst] {
        let s = p.to_string_lossy();
        if s.contains("://") && !s.starts_with("agent://") {
            return Err(Unsupported(s.into_owned()).into());
        }
    }
    let runtime = || tokio::runtime::Runtime::new().context("cannot start the async runtime");
    Ok(match (from, to) {
        (None, None) => mover::copy_block(src, dst, options, bar)?,
        (None, Some(to)) => {
            runtime()?.block_on(mover::remote::push(src, &to, options, remote, bar))?
        }
        (Some(from), None) => {
            runtime()?.block_on(mover::remote::pull(&from, dst, options, remote, bar))?
        }
        (Some(_), Some(_)) => {
            anyhow::bail!(Unsupported(
                "agent-to-agent copies: run the copy on one of the two nodes".into()
            ))
        }
    })
}

/// `mover agent`: serves until SIGINT or SIGTERM.
fn run_agent(config_path: &std::path::Path) -> anyhow::Result<()> {
    let config = mover::agent::AgentConfig::load(config_path)?;
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let metrics = match config.metrics_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen for metrics on {addr}"))?,
            ),
            None => None,
        };
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
            tracing::info!("shutting down: finishing calls in flight");
        };
        mover::agent::serve(config, listener, metrics, shutdown).await?;
        Ok(())
    })
}

/// Keeps a snapshot's memory to what it holds: glibc would otherwise give each of the
/// walk's threads an arena that keeps freed chunk and pack buffers, and serve those
/// megabyte buffers from arenas that never shrink (measured on /usr/share: 230 MB peak,
/// 129 MB with two arenas and buffers of 1 MiB and more mapped and unmapped whole, for
/// the same time). A restore (`map_big: false`) keeps glibc's own threshold, which
/// rises to the sizes freed: its chunk and read buffers are then reused, where mapping
/// each one anew cost a page fault and a zeroed page per 4 KiB (a third more system
/// time on a 6 GiB tree). Settings made in the environment (`MALLOC_ARENA_MAX`,
/// `MALLOC_MMAP_THRESHOLD_`) win.
#[allow(unsafe_code)] // mallopt(3) has no safe wrapper; see SAFETY.
fn bounded_malloc(map_big: bool) {
    let set = |var: &str| std::env::var_os(var).is_some();
    // SAFETY: mallopt only changes allocator parameters; it is called before the
    // snapshot's threads start, and any value is valid for these two parameters.
    unsafe {
        if !set("MALLOC_ARENA_MAX") {
            libc::mallopt(libc::M_ARENA_MAX, 2);
        }
        if map_big && !set("MALLOC_MMAP_THRESHOLD_") {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 20);
        }
    }
}

fn print_copy(s: &CopySummary, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    println!(
        "copied {} -> {}: {} in {:.2}s ({}/s){}",
        s.source.display(),
        s.destination.display(),
        human(s.volume_bytes),
        s.duration_secs,
        human(s.throughput_bytes_per_sec as u64),
        if s.resumed {
            ", finishing an interrupted copy"
        } else {
            ""
        }
    );
    println!(
        "  read {} of source, {} of destination; wrote {} ({} pages), zeroed {}; {} of zeros skipped",
        human(s.source_bytes_read),
        human(s.destination_bytes_read),
        human(s.bytes_written),
        s.pages_written,
        human(s.bytes_zeroed),
        human(s.zero_bytes_skipped),
    );
    if let Some(root) = &s.root {
        println!("  verified: destination read back equals source (root {root})");
    }
    Ok(())
}

/// Prints a tree copy's summary; an incomplete copy is an error (exit 1) after it.
fn print_tree(s: &TreeSummary, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
    } else {
        println!(
            "copied tree {} -> {}: {} files ({}), {} dirs, {} symlinks, {} hard links, {} special in {:.2}s{}",
            s.source.display(),
            s.destination.display(),
            s.files,
            human(s.source_bytes),
            s.dirs,
            s.symlinks,
            s.hard_links,
            s.specials,
            s.duration_secs,
            if s.resumed {
                ", finishing an interrupted copy"
            } else {
                ""
            }
        );
        println!(
            "  {} entries written whole, {} files patched, {} unchanged, {} with new metadata, {} deleted; \
             wrote {} of file data, reused {} from older copies",
            s.entries_copied,
            s.files_patched,
            s.entries_unchanged,
            s.metadata_updated,
            s.entries_deleted,
            human(s.bytes_written),
            human(s.bytes_reused),
        );
        for w in &s.warnings {
            eprintln!("mover: warning: {w}");
        }
    }
    if !s.is_complete() {
        anyhow::bail!(
            "{} entries could not be copied (errors above); fix them and rerun: \
             what is already copied is not copied again{}",
            s.failed,
            if s.destination.exists() {
                ""
            } else {
                "; until then the copy stays hidden under .NAME.mover-partial"
            }
        );
    }
    Ok(())
}

fn print_hash(s: &HashSummary, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    println!("{}  {}", s.root, s.volume.display());
    println!(
        "  {} in {} chunks of {}: {} data chunks ({}), {} zero chunks; {:.2}s ({}/s)",
        human(s.volume_bytes),
        s.data_chunks + s.zero_chunks,
        human(s.chunk_size),
        s.data_chunks,
        human(s.data_bytes),
        s.zero_chunks,
        s.duration_secs,
        human(s.throughput_bytes_per_sec as u64)
    );
    Ok(())
}

/// Bytes in binary units, e.g. "1.50 GiB".
fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit < UNITS.len() - 1 {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[unit])
    }
}

/// A progress bar on stderr, drawn only on a terminal.
struct Bar(Option<Mutex<ProgressBar>>);

impl Bar {
    fn new(output: &OutputArgs) -> Self {
        let show = !output.no_progress && std::io::stderr().is_terminal();
        Bar(show.then(|| Mutex::new(ProgressBar::hidden())))
    }

    fn done(&self) {
        if let Some(bar) = &self.0 {
            bar.lock().expect("progress bar lock").finish_and_clear();
        }
    }
}

impl Progress for Bar {
    fn begin(&self, phase: &'static str, total: u64) {
        if let Some(bar) = &self.0 {
            let mut bar = bar.lock().expect("progress bar lock");
            bar.finish_and_clear();
            // A total of 0 means unknown (a tree is copied as it is walked): no bar, no eta.
            let template = if total == 0 {
                "{prefix:>7} {spinner} {binary_bytes} written {binary_bytes_per_sec} {elapsed}"
            } else {
                "{prefix:>7} [{bar:40}] {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}"
            };
            *bar = ProgressBar::new(total).with_style(
                ProgressStyle::with_template(template)
                    .expect("valid template")
                    .progress_chars("=> "),
            );
            if total == 0 {
                bar.enable_steady_tick(std::time::Duration::from_millis(200));
            }
            bar.set_prefix(phase);
        }
    }

    fn update(&self, done: u64) {
        if let Some(bar) = &self.0 {
            bar.lock().expect("progress bar lock").set_position(done);
        }
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
