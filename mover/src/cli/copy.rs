//! `mover copy` and `mover hash`: run the library call, print the summary.

use super::{Bar, OutputArgs, human};
use anyhow::Context;
use mover::{Copied, CopyOptions, CopySummary, HashSummary, TreeOptions, TreeSummary};
use std::path::PathBuf;

/// `mover copy`'s arguments.
#[derive(clap::Args)]
pub struct CopyArgs {
    /// Source: a block device, an image file, a directory, or agent://HOST:PORT/NAME.
    pub src: PathBuf,
    /// Destination: a block device, an image file (existing or new), a directory
    /// (existing or new) for a tree, or agent://HOST:PORT/NAME.
    pub dst: PathBuf,
    #[command(flatten)]
    pub options: CopyOptions,
    #[command(flatten)]
    pub tree: TreeOptions,
    #[command(flatten)]
    pub remote: mover::remote::RemoteOptions,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// `mover hash`'s arguments.
#[derive(clap::Args)]
pub struct HashArgs {
    /// The volume: a block device or an image file.
    pub volume: PathBuf,
    /// Chunk size: a power of two from 64K to 8M.
    #[arg(long, value_name = "SIZE", default_value_t = chunker::ChunkSize::DEFAULT)]
    pub chunk_size: chunker::ChunkSize,
    /// Hashing threads [default: one per core].
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// `mover copy`: one call of the engine, with a progress bar and a summary.
pub fn run_copy(args: &CopyArgs) -> anyhow::Result<()> {
    let CopyArgs {
        src,
        dst,
        options,
        tree,
        remote,
        output,
    } = args;
    let bar = Bar::new(output);
    let copied = mover::copy_endpoints(src, dst, options, tree, remote, &bar);
    let copied = match copied {
        // Refused before anything was looked at: the message says it all.
        Err(e @ mover::EndpointError::Refused(_)) => return Err(e.into()),
        r => r.with_context(|| format!("copy {} -> {}", src.display(), dst.display()))?,
    };
    bar.done();
    match copied {
        Copied::Block(s) => print_copy(&s, output.json),
        Copied::Tree(s) => print_tree(&s, output.json),
    }
}

/// `mover hash VOLUME`.
pub fn run_hash(args: &HashArgs) -> anyhow::Result<()> {
    let HashArgs {
        volume,
        chunk_size,
        threads,
        output,
    } = args;
    let (chunk_size, threads) = (*chunk_size, *threads);
    let bar = Bar::new(output);
    let summary = mover::hash_block(volume, chunk_size, threads, &bar)
        .with_context(|| format!("hash {}", volume.display()))?;
    bar.done();
    print_hash(&summary, output.json)
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
pub fn print_tree(s: &TreeSummary, json: bool) -> anyhow::Result<()> {
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

/// `mover copy --help`: what a copy does, what it refuses, examples.
pub(crate) const COPY_HELP: &str = "Copy a block volume (a block device such as /dev/loop0 or an \
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
        mover copy /srv/data agent://node-b:7070/data   # tree into node b's export";

/// `mover hash --help`.
pub(crate) const HASH_HELP: &str = "Hash a block volume the way mover sees it: fixed chunks, \
        zeros and holes counted apart, a Merkle root over all chunks. Two volumes with \
        the same root (at the same chunk size) hold the same bytes.";
