//! The `mover repo` and `mover snapshot` subcommands (part of the binary: argument
//! parsing and printing; the work is in `mover::snapshot` and the `snapshots` crate).

use super::{copy::print_tree, human};
use anyhow::Context;
use mover::{RepoOptions, RestoreOptions, RestoreSummary, SnapshotCreateOptions};
use snapshots::{Content, InitOptions, RepoError, Repository, Snapshot, retention::KeepPolicy};
use std::path::PathBuf;

/// `mover repo …`
#[derive(clap::Subcommand)]
pub enum RepoCommand {
    /// Create a snapshot repository in a directory or an S3 bucket.
    #[command(long_about = "Create a snapshot repository.\n\n\
        REPO is a directory (created if missing) or s3://BUCKET[/PREFIX] (the bucket must \
        exist; endpoint by --s3-endpoint or MOVER_S3_ENDPOINT, credentials from \
        AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the usual AWS chain).\n\n\
        The data is encrypted with a random master key, wrapped by the password \
        (MOVER_PASSWORD or --password-file, stretched with argon2id) or by a raw key \
        file (--key-file). Losing it loses the repository.\n\n\
        Examples:\n  \
        MOVER_PASSWORD=… mover repo init /mnt/backup/repo\n  \
        mover repo init s3://dr-bucket/cluster-a --s3-endpoint http://minio:9000 --key-file /etc/mover/key")]
    Init {
        /// The repository: a directory or s3://BUCKET[/PREFIX].
        repo: String,
        /// Chunk size for block volumes: a power of two from 64K to 8M.
        #[arg(long, value_name = "SIZE", default_value_t = chunker::ChunkSize::DEFAULT)]
        chunk_size: chunker::ChunkSize,
        #[command(flatten)]
        opts: RepoOptions,
    },
}

/// `mover snapshot …`
#[derive(clap::Subcommand)]
pub enum SnapshotCommand {
    /// Take a snapshot of a block volume or a directory; only new chunks are uploaded.
    #[command(
        long_about = "Take a snapshot of a block volume (device or image file) or of a \
        directory tree.\n\n\
        The volume is read and hashed in full; only chunks the repository does not hold \
        yet are compressed, encrypted and uploaded, so every snapshot after the first is \
        incremental. A changed chunk that differs from the previous snapshot's chunk at the \
        same place in at most half of its 4 KiB pages is stored as those pages only \
        (--no-deltas turns this off). Zero regions and holes are not stored. An interrupted run leaves no \
        snapshot; the next run reuses the packs it had uploaded.\n\n\
        A directory is stored as content-defined chunks of its files and one tree blob \
        per directory holding everything `mover copy` keeps (modes, owners, times in ns, \
        xattrs and ACLs, hard links, symlinks, devices, FIFOs, holes, any file name). \
        After the first snapshot only files whose inode, ctime, size or mtime changed \
        are read. A file that changes while read is stored as read and reported; \
        entries that cannot be read are reported, left out, and the snapshot is tagged \
        `incomplete` (exit status 1).\n\n\
        Examples:\n  \
        mover snapshot create /mnt/backup/repo /dev/vg0/data --tag nightly\n  \
        mover snapshot create s3://dr/cluster-a /var/lib/postgresql --name pg"
    )]
    Create {
        /// The repository.
        repo: String,
        /// The volume: a block device, an image file, or a directory.
        volume: PathBuf,
        #[command(flatten)]
        create: SnapshotCreateOptions,
        #[command(flatten)]
        opts: RepoOptions,
        #[command(flatten)]
        output: super::OutputArgs,
    },
    /// List snapshots, oldest first.
    List {
        /// The repository.
        repo: String,
        #[command(flatten)]
        opts: RepoOptions,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Restore a snapshot to an image file, a block device, or a directory.
    #[command(long_about = "Restore a snapshot to DST.\n\n\
        Block snapshots: \
        A new DST image is written sparse under a hidden temp name and renamed into place \
        when complete. An existing DST (an older copy, or a block device) is read and \
        compared first: only chunks that differ are fetched and written, zero chunks are \
        punched as holes. Every chunk is authenticated and checked against its id before \
        it is written; damaged repository data stops the restore with an error.\n\n\
        Tree snapshots: DST is a directory. A new one is built under a hidden name and \
        renamed into place when complete; in an existing one only entries that differ \
        (size, mtime, metadata) are written, --delete removes what the snapshot lacks, \
        and --include restores single paths. A damaged file fails alone (exit status \
        1): into an existing DST the rest is restored; a new DST stays hidden as \
        .DST.mover-partial with the rest in it (move it into place to accept the loss). \
        --delete is refused from a snapshot tagged `incomplete`.\n\n\
        SNAPSHOT is an id, a unique prefix of at least 4 hex digits, or `latest`.")]
    Restore {
        /// The repository.
        repo: String,
        /// Snapshot id, unique id prefix, or `latest`.
        snapshot: String,
        /// Destination image file, block device, or directory (tree snapshots).
        dst: PathBuf,
        #[command(flatten)]
        restore: RestoreOptions,
        #[command(flatten)]
        opts: RepoOptions,
        #[command(flatten)]
        output: super::OutputArgs,
    },
    /// Print what differs between two snapshots: byte ranges, or paths for trees.
    #[command(long_about = "Print what differs between two snapshots.\n\n\
        Block snapshots: the byte ranges that differ. Tree snapshots: one line per entry, \
        `+` added, `-` removed, `M` content changed, `m` metadata only, `T` replaced by \
        another kind; directories equal in both are not read.")]
    Diff {
        /// The repository.
        repo: String,
        /// The older snapshot.
        snap1: String,
        /// The newer snapshot.
        snap2: String,
        #[command(flatten)]
        opts: RepoOptions,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// List the entries of a tree snapshot below PATH (all by default).
    Ls {
        /// The repository.
        repo: String,
        /// Snapshot id, unique id prefix, or `latest`.
        snapshot: String,
        /// A path in the snapshot, relative to its top.
        path: Option<PathBuf>,
        #[command(flatten)]
        opts: RepoOptions,
        /// Print one JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// Check the repository: structure, and with --read-data every stored byte.
    Verify {
        /// The repository.
        repo: String,
        /// Download and check every blob of every pack.
        #[arg(long)]
        read_data: bool,
        #[command(flatten)]
        opts: RepoOptions,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Forget snapshots by a retention policy (their data goes at the next prune).
    #[command(long_about = "Forget snapshots by a retention policy, per volume.\n\n\
        Kept: the newest N (--keep-last), and the newest snapshot of each of the last N \
        hours/days/weeks/months (UTC) that have snapshots. The newest snapshot of every \
        volume is always kept. Storage is freed by `mover snapshot prune`.")]
    Forget {
        /// The repository.
        repo: String,
        #[command(flatten)]
        keep: KeepArgs,
        /// Only print what would be forgotten.
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        opts: RepoOptions,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove data no snapshot needs (two-phase, safe alongside running snapshots).
    #[command(long_about = "Remove packs that no snapshot needs.\n\n\
        Lock-free and two-phase: a run deletes the packs an earlier run marked unused at \
        least --grace seconds ago (after checking again that no snapshot uses them), then \
        marks what is unused now. Snapshots running meanwhile never dedup against marked \
        packs, so they never lose data; the grace period must exceed the longest snapshot \
        run. --grace 0 deletes at once: only when nothing else writes to the repository.")]
    Prune {
        /// The repository.
        repo: String,
        /// Seconds a pack stays marked before it is deleted.
        #[arg(long, value_name = "SECS", default_value_t = 3600)]
        grace: u64,
        #[command(flatten)]
        opts: RepoOptions,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Snapshots taken by an agent on a schedule, with retention and prune.
    #[command(subcommand)]
    Schedule(super::schedule::ScheduleCommand),
}

/// Retention rules (`snapshot forget`, `snapshot schedule create`).
#[derive(Clone, Debug, clap::Args)]
pub struct KeepArgs {
    /// Keep the newest N snapshots.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_last: u32,
    /// Keep the newest snapshot of each of the last N hours.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_hourly: u32,
    /// Keep the newest snapshot of each of the last N days.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_daily: u32,
    /// Keep the newest snapshot of each of the last N weeks.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_weekly: u32,
    /// Keep the newest snapshot of each of the last N months.
    #[arg(long, value_name = "N", default_value_t = 0)]
    keep_monthly: u32,
}

impl KeepArgs {
    /// The rules as a policy.
    pub fn policy(&self) -> KeepPolicy {
        KeepPolicy {
            last: self.keep_last,
            hourly: self.keep_hourly,
            daily: self.keep_daily,
            weekly: self.keep_weekly,
            monthly: self.keep_monthly,
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// Runs `mover repo …`.
pub fn run_repo(cmd: RepoCommand) -> anyhow::Result<()> {
    let RepoCommand::Init {
        repo,
        chunk_size,
        opts,
    } = cmd;
    runtime()?.block_on(async {
        let creds = opts.credentials()?;
        let backend = opts.backend(&repo).await?;
        let r = Repository::init(
            backend,
            &creds,
            &InitOptions {
                chunk_size,
                ..Default::default()
            },
        )
        .await
        .with_context(|| format!("repo init {repo}"))?;
        println!("created repository {} at {}", r.config().id, r.location());
        Ok(())
    })
}

/// Runs `mover snapshot …`.
pub fn run_snapshot(cmd: SnapshotCommand) -> anyhow::Result<()> {
    runtime()?.block_on(run_snapshot_async(cmd))
}

async fn run_snapshot_async(cmd: SnapshotCommand) -> anyhow::Result<()> {
    match cmd {
        SnapshotCommand::Schedule(cmd) => super::schedule::run(cmd).await?,
        SnapshotCommand::Create {
            repo,
            volume,
            mut create,
            opts,
            output,
        } => {
            let json = output.json;
            let r = mover::open_repository(&repo, &opts).await?;
            let bar = std::sync::Arc::new(super::Bar::new(&output));
            create.progress = mover::SharedProgress::new(bar.clone());
            let snap = mover::create_snapshot(r, &volume, &create)
                .await
                .with_context(|| format!("snapshot create {} {}", repo, volume.display()))?;
            bar.done();
            let s = &snap.manifest.summary;
            if json {
                println!("{}", snapshot_json(&snap));
            } else if let Content::Tree {
                files, dirs, bytes, ..
            } = &snap.manifest.content
            {
                println!("snapshot {} saved ({})", snap.short_id(), snap.id);
                println!(
                    "  {files} files ({}), {dirs} dirs; read {} files, {} unchanged since the parent; new: {} chunks, {}, {} stored in {} packs; {:.2}s",
                    human(*bytes),
                    s.files_read,
                    s.files_unchanged,
                    s.new_chunks,
                    human(s.new_bytes),
                    human(s.stored_bytes),
                    s.packs,
                    s.duration_secs
                );
                if s.changed_while_read > 0 {
                    eprintln!(
                        "mover: warning: {} files changed while read: stored as read, the next snapshot reads them again",
                        s.changed_while_read
                    );
                }
            } else {
                println!("snapshot {} saved ({})", snap.short_id(), snap.id);
                println!(
                    "  {} data in {} chunks ({} zero chunks skipped); new: {} chunks, {} ({} as deltas of {} changed pages), {} stored in {} packs; {:.2}s",
                    human(s.data_bytes),
                    s.data_chunks,
                    s.zero_chunks,
                    s.new_chunks,
                    human(s.new_bytes),
                    s.delta_chunks,
                    human(s.delta_bytes),
                    human(s.stored_bytes),
                    s.packs,
                    s.duration_secs
                );
            }
            if s.unreadable > 0 {
                anyhow::bail!(
                    "{} entries could not be read (warnings above) and are not in snapshot {}, tagged `{}`",
                    s.unreadable,
                    snap.short_id(),
                    mover::INCOMPLETE_TAG
                );
            }
        }
        SnapshotCommand::List { repo, opts, json } => {
            let r = mover::open_repository(&repo, &opts).await?;
            let snaps = r.snapshots().await.context("snapshot list")?;
            if json {
                let v: Vec<_> = snaps.iter().map(snapshot_json).collect();
                println!("[{}]", v.join(","));
            } else {
                println!(
                    "{:<8}  {:<19}  {:<5}  {:>10}  {:<12}  volume",
                    "id", "time (UTC)", "kind", "size", "tags"
                );
                for s in &snaps {
                    println!(
                        "{:<8}  {:<19}  {:<5}  {:>10}  {:<12}  {}",
                        s.short_id(),
                        snapshots::retention::format_time(s.manifest.time),
                        s.manifest.content.kind(),
                        human(s.manifest.content.size()),
                        s.manifest.tags.join(","),
                        s.manifest.volume
                    );
                }
                println!("{} snapshot(s)", snaps.len());
            }
        }
        SnapshotCommand::Restore {
            repo,
            snapshot,
            dst,
            mut restore,
            opts,
            output,
        } => {
            let json = output.json;
            let r = mover::open_repository(&repo, &opts).await?;
            let context = || format!("snapshot restore {snapshot} -> {}", dst.display());
            let snap = r.find_snapshot(&snapshot).await.with_context(context)?;
            let bar = std::sync::Arc::new(super::Bar::new(&output));
            restore.progress = mover::SharedProgress::new(bar.clone());
            if let Content::Tree { .. } = snap.manifest.content {
                let s = mover::restore_tree_snapshot(r, &snap, &dst, &restore)
                    .await
                    .with_context(context)?;
                bar.done();
                return print_tree(&s, json);
            }
            let s = mover::restore_snapshot(r, &snap.id, &dst, &restore)
                .await
                .with_context(context)?;
            bar.done();
            print_restore(&s, json)?;
        }
        SnapshotCommand::Diff {
            repo,
            snap1,
            snap2,
            opts,
            json,
        } => {
            let r = mover::open_repository(&repo, &opts).await?;
            let a = r.find_snapshot(&snap1).await?;
            let b = r.find_snapshot(&snap2).await?;
            let index = r.load_index().await?;
            if let (Content::Tree { .. }, Content::Tree { .. }) =
                (&a.manifest.content, &b.manifest.content)
            {
                let changes = r
                    .diff_trees(&index, &a, &b)
                    .await
                    .context("snapshot diff")?;
                print_tree_diff(&a, &b, &changes, json)?;
                return Ok(());
            }
            let ranges = r.diff(&index, &a, &b).await.context("snapshot diff")?;
            let total: u64 = ranges.iter().map(|x| x.end - x.start).sum();
            if json {
                let v: Vec<_> = ranges.iter().map(|x| [x.start, x.end]).collect();
                println!(
                    "{}",
                    serde_json::json!({"from": a.id, "to": b.id, "changed_bytes": total, "ranges": v})
                );
            } else {
                for x in &ranges {
                    println!("{}..{}  ({})", x.start, x.end, human(x.end - x.start));
                }
                println!(
                    "{} -> {}: {} changed in {} range(s)",
                    a.short_id(),
                    b.short_id(),
                    human(total),
                    ranges.len()
                );
            }
        }
        SnapshotCommand::Ls {
            repo,
            snapshot,
            path,
            opts,
            json,
        } => {
            let r = mover::open_repository(&repo, &opts).await?;
            let snap = r.find_snapshot(&snapshot).await?;
            let index = r.load_index().await?;
            let rel = path
                .as_deref()
                .map(|p| p.as_os_str().as_encoded_bytes().to_vec())
                .unwrap_or_default();
            let rel: Vec<u8> = rel
                .split(|&c| c == b'/')
                .filter(|c| !c.is_empty() && *c != b".")
                .collect::<Vec<_>>()
                .join(&b'/');
            let node = r
                .tree_node_at(&index, &snap, &rel)
                .await
                .context("snapshot ls")?
                .ok_or_else(|| RepoError::Refused {
                    what: format!("snapshot ls {}", String::from_utf8_lossy(&rel)),
                    why: format!("snapshot {} has no such path", snap.short_id()),
                })?;
            list_tree(&r, &index, rel, node, json).await?;
        }
        SnapshotCommand::Verify {
            repo,
            read_data,
            opts,
            json,
        } => {
            let r = mover::open_repository(&repo, &opts).await?;
            let rep = r.verify(read_data).await.context("snapshot verify")?;
            if json {
                println!("{}", serde_json::to_string(&rep)?);
            } else {
                for p in &rep.problems {
                    println!("problem: {p}");
                }
                for d in rep.damaged.iter().filter(|d| !d.paths.is_empty()) {
                    for (path, why) in &d.paths {
                        println!("damaged: snapshot {} ({}): {path}: {why}", d.id, d.volume);
                    }
                }
                for d in rep.damaged.iter().filter(|d| !d.ranges.is_empty()) {
                    let ranges: Vec<String> = d
                        .ranges
                        .iter()
                        .map(|x| format!("{}..{}", x.start, x.end))
                        .collect();
                    println!(
                        "damaged: snapshot {} ({}): bytes {}",
                        d.id,
                        d.volume,
                        ranges.join(", ")
                    );
                }
                println!(
                    "checked {} snapshot(s), {} pack(s){}: {}",
                    rep.snapshots,
                    rep.packs,
                    if read_data {
                        format!(
                            ", {} blobs ({} read)",
                            rep.blobs_read,
                            human(rep.bytes_read)
                        )
                    } else {
                        String::new()
                    },
                    if rep.problems.is_empty() {
                        "no problems"
                    } else {
                        "PROBLEMS FOUND"
                    }
                );
            }
            if !rep.problems.is_empty() {
                return Err(RepoError::VerifyFailed {
                    problems: rep.problems.len(),
                }
                .into());
            }
        }
        SnapshotCommand::Forget {
            repo,
            keep,
            dry_run,
            opts,
            json,
        } => {
            let policy = keep.policy();
            if policy.is_empty() {
                return Err(RepoError::Refused {
                    what: "snapshot forget".into(),
                    why: "no --keep-* rule given; refusing to forget all but the newest snapshot of each volume".into(),
                }
                .into());
            }
            let r = mover::open_repository(&repo, &opts).await?;
            let snaps = r.snapshots().await?;
            let decisions = snapshots::retention::apply(&snaps, &policy);
            let mut forgotten = Vec::new();
            for d in &decisions {
                if d.reasons.is_empty() {
                    if !dry_run {
                        r.delete_snapshot(&d.snapshot.id).await?;
                    }
                    forgotten.push(d.snapshot.id.clone());
                }
                if !json {
                    println!(
                        "{} {}  {}  {}",
                        if d.reasons.is_empty() {
                            "forget"
                        } else {
                            "keep  "
                        },
                        d.snapshot.short_id(),
                        snapshots::retention::format_time(d.snapshot.manifest.time),
                        d.reasons.join(",")
                    );
                }
            }
            if json {
                println!(
                    "{}",
                    serde_json::json!({"forgotten": forgotten, "dry_run": dry_run})
                );
            } else {
                println!(
                    "{} {} snapshot(s); run `mover snapshot prune` to free their space",
                    if dry_run { "would forget" } else { "forgot" },
                    forgotten.len()
                );
            }
        }
        SnapshotCommand::Prune {
            repo,
            grace,
            opts,
            json,
        } => {
            let r = mover::open_repository(&repo, &opts).await?;
            let rep = r.prune(grace).await.context("snapshot prune")?;
            if json {
                println!("{}", serde_json::to_string(&rep)?);
            } else {
                println!(
                    "deleted {} pack(s) ({}); repacked {} mostly unused pack(s) ({} copied); marked {} pack(s) for deletion after {grace}s; {} kept after re-check; {} mark(s) pending; {} partly used pack(s) hold {} unused",
                    rep.deleted_packs,
                    human(rep.deleted_bytes),
                    rep.repacked_packs,
                    human(rep.repacked_bytes),
                    rep.marked_packs,
                    rep.kept_after_recheck,
                    rep.pending_marks,
                    rep.partly_used_packs,
                    human(rep.partly_used_waste_bytes)
                );
            }
        }
    }
    Ok(())
}

fn snapshot_json(s: &Snapshot) -> String {
    let mut v = serde_json::json!({
        "id": s.id,
        "time": s.manifest.time,
        "hostname": s.manifest.hostname,
        "volume": s.manifest.volume,
        "tags": s.manifest.tags,
        "parent": s.manifest.parent,
        "kind": s.manifest.content.kind(),
        "size": s.manifest.content.size(),
        "summary": s.manifest.summary,
    });
    match &s.manifest.content {
        Content::Block { chunk_size, .. } => v["chunk_size"] = (*chunk_size).into(),
        Content::Tree { files, dirs, .. } => {
            v["files"] = (*files).into();
            v["dirs"] = (*dirs).into();
        }
    }
    v.to_string()
}

fn print_tree_diff(
    a: &Snapshot,
    b: &Snapshot,
    changes: &[snapshots::TreeChange],
    json: bool,
) -> anyhow::Result<()> {
    if json {
        println!(
            "{}",
            serde_json::json!({"from": a.id, "to": b.id, "changes": changes})
        );
        return Ok(());
    }
    let mut counts = std::collections::BTreeMap::new();
    for c in changes {
        let mark = match c.what {
            "added" => "+",
            "removed" => "-",
            "changed" => "M",
            "metadata" => "m",
            _ => "T",
        };
        println!("{mark} {}", String::from_utf8_lossy(&c.path));
        *counts.entry(c.what).or_insert(0u64) += 1;
    }
    let counts: Vec<String> = counts.iter().map(|(w, n)| format!("{n} {w}")).collect();
    println!(
        "{} -> {}: {}",
        a.short_id(),
        b.short_id(),
        if counts.is_empty() {
            "no differences".into()
        } else {
            counts.join(", ")
        }
    );
    Ok(())
}

/// Prints `node` (at `path`) and everything below it, depth first, one directory's
/// blob in memory per level.
async fn list_tree(
    r: &Repository,
    index: &snapshots::Index,
    path: Vec<u8>,
    node: snapshots::TreeNode,
    json: bool,
) -> anyhow::Result<()> {
    let mut stack = vec![(path, node)];
    while let Some((path, n)) = stack.pop() {
        let shown = if path.is_empty() {
            b".".to_vec()
        } else {
            path.clone()
        };
        let shown = String::from_utf8_lossy(&shown);
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "path": shown, "kind": n.kind, "mode": n.mode, "uid": n.uid,
                    "gid": n.gid, "size": n.size, "mtime": n.mtime.0,
                    "mtime_nanos": n.mtime.1, "link": String::from_utf8_lossy(&n.link),
                })
            );
        } else {
            let kind = match n.kind {
                snapshots::NodeKind::File => '-',
                snapshots::NodeKind::Dir => 'd',
                snapshots::NodeKind::Symlink => 'l',
                snapshots::NodeKind::CharDevice => 'c',
                snapshots::NodeKind::BlockDevice => 'b',
                snapshots::NodeKind::Fifo => 'p',
                snapshots::NodeKind::Socket => 's',
            };
            let link = if n.link.is_empty() {
                String::new()
            } else {
                format!(" -> {}", String::from_utf8_lossy(&n.link))
            };
            println!(
                "{kind}{:04o} {:>6} {:>6} {:>12}  {}  {shown}{link}",
                n.mode,
                n.uid,
                n.gid,
                n.size,
                snapshots::retention::format_time(n.mtime.0),
            );
        }
        if let Some(sub) = n.subtree {
            let mut children = r.read_tree(index, &sub).await?;
            while let Some(c) = children.pop() {
                stack.push((snapshots::join_path(&path, &c.name), c));
            }
        }
    }
    Ok(())
}

fn print_restore(s: &RestoreSummary, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(s)?);
        return Ok(());
    }
    println!(
        "restored {} -> {}: {} in {:.2}s{}",
        &s.snapshot[..8],
        s.destination.display(),
        human(s.volume_bytes),
        s.duration_secs,
        if s.delta {
            " (onto an existing copy)"
        } else {
            ""
        }
    );
    println!(
        "  fetched {} chunks, wrote {}, zeroed {}, {} chunks already equal, {} of zeros left as holes",
        s.chunks_fetched,
        human(s.bytes_written),
        human(s.bytes_zeroed),
        s.chunks_unchanged,
        human(s.zero_bytes)
    );
    Ok(())
}
