//! File-tree volumes: `mover copy DIR DIR`, as faithful as `rsync -aHAXS --numeric-ids`.
//!
//! A new destination is built whole under a hidden `.NAME.mover-partial` directory and
//! renamed into place when complete, so nobody sees a half-copied tree and no file needs
//! a temp name of its own. An existing destination is updated in place: unchanged files
//! (same size and mtime, or same content with `--checksum`) are left alone, changed ones
//! are rebuilt under a temp name (large ones from the chunks the old version already
//! holds, where that saves work: see `content`) and renamed over the old, so no reader
//! ever sees a half-written file.

pub(crate) mod content;
pub(crate) mod meta;
mod record;
pub mod remote;
pub(crate) mod source;
pub(crate) mod sync;

use crate::{CopyError, Progress, Result};
use rustix::fs::{self, RenameFlags};
use serde::Serialize;
use source::{LocalSource, TreeSource};
use std::{
    ffi::OsString,
    os::fd::AsFd,
    path::{Path, PathBuf},
    sync::atomic::Ordering::Relaxed,
    time::Instant,
};
use sync::{DirPair, Rules, Syncer};

/// Options of `mover copy` for file trees.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct TreeOptions {
    /// File trees: delete destination entries that are not in the source (off by
    /// default: a one-shot copy never removes what it did not write).
    #[arg(long)]
    pub delete: bool,
    /// File trees: compare files by content (BLAKE3 of both sides) instead of by size
    /// and modification time.
    #[arg(long)]
    pub checksum: bool,
    /// File trees: do not copy extended attributes and POSIX ACLs (for destination
    /// filesystems without xattr support).
    #[arg(long)]
    pub no_xattrs: bool,
    /// File trees: threads walking and copying [default: 4 per core, at most 16].
    #[arg(long, value_name = "N")]
    pub tree_threads: Option<usize>,
    /// File trees: DST is a replica that only mover writes. Each run saves a record of
    /// what it left in DST (in --state-dir), and the next run compares SRC with that
    /// record instead of looking at every DST entry: only entries whose source changed
    /// are looked at. Names added, removed or renamed in DST by anyone are still noticed
    /// (each DST directory is checked); a DST file changed in place by someone else is
    /// not: run once without --replica (or with --checksum) to check every entry.
    /// Local trees only (DIR to DIR).
    #[arg(long)]
    pub replica: bool,
    /// Where replica records are kept (set from `--state-dir`; None: keep none and drop
    /// none).
    #[arg(skip)]
    pub state_dir: Option<PathBuf>,
    /// After copying, compare every entry again, file contents by BLAKE3 read back from
    /// the destination (set from `--verify`).
    #[arg(skip)]
    pub verify: bool,
}

/// Makes an OS error on the tree's top-level `path` a [`CopyError::Tree`].
pub(crate) fn tree_error<E: Into<std::io::Error>>(
    path: &Path,
    what: &'static str,
) -> impl FnOnce(E) -> CopyError {
    let path = path.to_path_buf();
    move |cause| CopyError::Tree {
        path,
        what,
        cause: cause.into(),
    }
}

/// Walks the source into `work` on `pool`, then makes the deferred hard links.
fn pass<S: TreeSource>(
    pool: &rayon::ThreadPool,
    syncer: &Syncer<'_, S>,
    source: &S,
    work: &Path,
) -> Result<DirPair<S::Dir>> {
    let src_path = source.root_path();
    let root = DirPair {
        src: source
            .open_root()
            .map_err(tree_error(src_path, "cannot open the source"))?,
        dst: meta::open_dir_at(rustix::fs::CWD, work.as_os_str())
            .map_err(tree_error(work, "cannot open the destination"))?,
        src_path: src_path.to_path_buf(),
        dst_path: work.to_path_buf(),
        rel: PathBuf::new(),
    };
    pool.install(|| syncer.sync_dir(&root));
    syncer.link_deferred(work);
    Ok(root)
}

/// The second pass of `--verify`: the same walk comparing contents, which must find the
/// copy complete. Whatever it finds different is repaired, and reported as a failure.
fn verify<S: TreeSource>(
    pool: &rayon::ThreadPool,
    source: &S,
    dst: &Path,
    rules: Rules,
    progress: &dyn Progress,
) -> Result<()> {
    progress.begin("verify", 0);
    let dest = Destination::prepare(dst, None)?;
    let rules = Rules {
        checksum: true,
        hidden: false,
        delete: rules.delete,
        ..rules
    };
    let syncer = Syncer::new(source, rules, progress);
    pass(pool, &syncer, source, &dest.work)?;
    let s = &syncer.stats;
    let differing = s.copied.load(Relaxed)
        + s.patched.load(Relaxed)
        + s.metadata_updated.load(Relaxed)
        + s.deleted.load(Relaxed)
        + s.errors.load(Relaxed);
    if differing > 0 {
        return Err(CopyError::TreeVerifyFailed {
            src: source.root_path().to_path_buf(),
            dst: dst.to_path_buf(),
            differing,
        });
    }
    Ok(())
}

/// What a tree copy did, for people and (as JSON) for programs.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize, PartialEq)]
pub struct TreeSummary {
    /// Source directory.
    pub source: PathBuf,
    /// Destination directory.
    pub destination: PathBuf,
    /// Regular files in the source (each multiply-linked file once).
    pub files: u64,
    /// Directories in the source, the top one not counted.
    pub dirs: u64,
    /// Symbolic links.
    pub symlinks: u64,
    /// Device nodes, FIFOs and sockets.
    pub specials: u64,
    /// Extra names of multiply-linked files (made as hard links).
    pub hard_links: u64,
    /// Files and other entries written whole.
    pub entries_copied: u64,
    /// Large files rebuilt from the chunks their older copy already held.
    pub files_patched: u64,
    /// Entries left as they were.
    pub entries_unchanged: u64,
    /// Entries whose content was equal but whose metadata was updated.
    pub metadata_updated: u64,
    /// Destination entries deleted (with --delete, or left over from an interrupted copy),
    /// the contents of deleted directories and entries replaced by another kind included.
    pub entries_deleted: u64,
    /// Bytes in the source's regular files.
    pub source_bytes: u64,
    /// Bytes of file data written from the source.
    pub bytes_written: u64,
    /// Bytes taken from older copies of patched files instead (shared where the
    /// filesystem has reflinks, copied in the kernel elsewhere).
    pub bytes_reused: u64,
    /// Files that kept changing while read: copied as read, picked up by the next run.
    pub changed_while_read: u64,
    /// Unchanged entries known from the replica record (`--replica`), not looked at in
    /// the destination.
    #[serde(default)]
    pub entries_from_record: u64,
    /// Entries that could not be copied (see `errors`); the copy is incomplete.
    pub failed: u64,
    /// The first error messages.
    pub errors: Vec<String>,
    /// Warnings (files changing while read).
    pub warnings: Vec<String>,
    /// This run finished an earlier interrupted copy into a new destination.
    pub resumed: bool,
    /// A second pass compared every entry, file contents read back from the destination
    /// by BLAKE3, and found nothing to change.
    pub verified: bool,
    /// Wall time in seconds.
    pub duration_secs: f64,
}

impl TreeSummary {
    /// Whether every entry was copied.
    pub fn is_complete(&self) -> bool {
        self.failed == 0
    }
}

/// Copies the tree `src` onto `dst` (which becomes a copy of `src`, like
/// `rsync -a SRC/ DST/`). See the module documentation for how.
pub fn copy_tree(
    src: &Path,
    dst: &Path,
    options: &TreeOptions,
    progress: &dyn Progress,
) -> Result<TreeSummary> {
    let src_abs = std::fs::canonicalize(src).map_err(tree_error(src, "cannot open the source"))?;
    let dest = Destination::prepare(dst, Some(&src_abs))?;
    let record = RecordUse::of(options, &dest, options.replica);
    let source = LocalSource::new(src_abs);
    let mut summary = copy_tree_from(&source, dest, dst, options, record, progress)?;
    summary.source = src.to_path_buf();
    Ok(summary)
}

/// Copies a peer's tree (`source`) onto `dst` here: the agent's side of a push, the
/// client's side of a pull.
pub fn copy_remote_tree(
    source: &remote::RemoteSource,
    dst: &Path,
    options: &TreeOptions,
    progress: &dyn Progress,
) -> Result<TreeSummary> {
    let dest = Destination::prepare(dst, None)?;
    // Records are kept of local copies only: this copy forgets one.
    let record = RecordUse::of(options, &dest, false);
    copy_tree_from(source, dest, dst, options, record, progress)
}

/// What a tree copy does with the destination's replica record.
pub(crate) enum RecordUse {
    /// Nothing (no state directory).
    None,
    /// Removes it: this copy changes the destination without keeping it up to date.
    Forget(PathBuf),
    /// Compares with it where it holds, and saves a new one (`--replica`).
    Keep(PathBuf),
}

impl RecordUse {
    /// Keeps the record of `dest` (in `options.state_dir`) if `keep`, else forgets it.
    fn of(options: &TreeOptions, dest: &Destination, keep: bool) -> RecordUse {
        let Some(dir) = &options.state_dir else {
            return RecordUse::None;
        };
        let path = record::record_path(dir, &dest.target());
        if keep {
            RecordUse::Keep(path)
        } else {
            RecordUse::Forget(path)
        }
    }
}

/// Copies the tree `source` onto `dst`, prepared as `dest`: the walk behind every tree
/// copy, local or with a peer agent on either side.
pub(crate) fn copy_tree_from<S: TreeSource>(
    source: &S,
    dest: Destination,
    dst: &Path,
    options: &TreeOptions,
    record: RecordUse,
    progress: &dyn Progress,
) -> Result<TreeSummary> {
    let started = Instant::now();
    let clone = content::can_clone(&dest.work);
    let rules = Rules {
        delete: options.delete,
        checksum: options.checksum,
        hidden: dest.hidden,
        preserve: meta::Preserve {
            owners: meta::can_chown(),
            xattrs: !options.no_xattrs,
        },
        patch: source.patch_pays(clone),
        direct: dest.hidden && !clone,
    };
    let threads = options.tree_threads.unwrap_or_else(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores * 4).min(16)
    });
    raise_open_files_limit();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        // Waiting tasks run others on their stack: deep trees need room.
        .stack_size(32 << 20)
        .thread_name(|i| format!("mover-tree-{i}"))
        .build()
        .map_err(std::io::Error::other)
        .map_err(tree_error(source.root_path(), "cannot start threads"))?;
    let (old_record, new_record) = open_records(record, source, &dest, rules);
    progress.begin("copy", 0);
    let syncer =
        Syncer::new(source, rules, progress).with_records(old_record.as_ref(), new_record.as_ref());
    let root = pass(&pool, &syncer, source, &dest.work)?;
    dest.finish(&root, &syncer, source, rules.preserve)?;
    if let Some(new) = &new_record
        && let Ok(top) = rustix::fs::lstat(dest.target())
    {
        // After its metadata and (for a new tree) the rename into place.
        new.seal(Path::new(""), &meta::Meta::from_stat(&top));
    }
    let verified = options.verify && syncer.stats.errors.load(Relaxed) == 0;
    if verified {
        verify(&pool, source, dst, rules, progress)?;
    }
    let s = &syncer.stats;
    let (errors, warnings) = syncer.messages();
    let summary = TreeSummary {
        source: source.root_path().to_path_buf(),
        destination: dst.to_path_buf(),
        files: s.files.load(Relaxed),
        dirs: s.dirs.load(Relaxed),
        symlinks: s.symlinks.load(Relaxed),
        specials: s.specials.load(Relaxed),
        hard_links: s.hard_links.load(Relaxed),
        entries_copied: s.copied.load(Relaxed),
        files_patched: s.patched.load(Relaxed),
        entries_unchanged: s.unchanged.load(Relaxed),
        metadata_updated: s.metadata_updated.load(Relaxed),
        entries_deleted: s.deleted.load(Relaxed),
        source_bytes: s.source_bytes.load(Relaxed),
        bytes_written: s.new_bytes.load(Relaxed),
        bytes_reused: s.reused_bytes.load(Relaxed),
        changed_while_read: s.changed_while_read.load(Relaxed),
        entries_from_record: s.from_record.load(Relaxed),
        failed: s.errors.load(Relaxed),
        errors,
        warnings,
        resumed: dest.resumed,
        verified,
        duration_secs: started.elapsed().as_secs_f64(),
    };
    let all_recorded = old_record.is_some() && s.dst_listed.load(Relaxed) == 0;
    drop(syncer);
    if let Some(new) = new_record {
        save_record(new, all_recorded, &summary, &dest.target());
    }
    Ok(summary)
}

/// The replica record to compare with (if it still describes the destination) and the
/// one to write, as `record` says.
fn open_records<S: TreeSource>(
    record: RecordUse,
    source: &S,
    dest: &Destination,
    rules: Rules,
) -> (Option<record::Record>, Option<record::RecordWriter>) {
    let path = match record {
        RecordUse::None => return (None, None),
        RecordUse::Forget(path) => {
            record::forget(&path);
            return (None, None);
        }
        RecordUse::Keep(path) => path,
    };
    let flags = record::flags(rules.preserve.xattrs, rules.preserve.owners, rules.delete);
    let src = source.root_path();
    // --checksum looks at every file by design; a new tree has nothing recorded.
    let old = if rules.checksum || dest.hidden {
        None
    } else {
        meta::open_dir_at(rustix::fs::CWD, dest.work.as_os_str())
            .ok()
            .and_then(|root| record::Record::open(&path, src, flags, root.as_fd()))
    };
    let new = record::RecordWriter::create(&path, src, flags)
        .inspect_err(|e| {
            tracing::warn!(record = %path.display(), "cannot write the replica record ({e}); the next run looks at every entry")
        })
        .ok();
    (old, new)
}

/// Saves the record a run wrote, unless the run failed somewhere (the last good record
/// stays: mover's own writes never make it wrong) or found every directory recorded
/// (`all_recorded`) and changed nothing.
fn save_record(new: record::RecordWriter, all_recorded: bool, s: &TreeSummary, dst: &Path) {
    if !s.is_complete() {
        return;
    }
    let changed = s.entries_copied + s.files_patched + s.metadata_updated + s.entries_deleted;
    if all_recorded && changed == 0 {
        return;
    }
    if let Err(e) = new.commit(dst) {
        tracing::warn!("cannot save the replica record ({e}); the next run looks at every entry");
    }
}

/// Where the copy is written and how it is finished.
pub(crate) struct Destination {
    /// The directory written into: DST itself, or the hidden partial copy.
    work: PathBuf,
    /// DST's parent, and DST's name in it.
    parent: PathBuf,
    name: OsString,
    /// Writing a hidden partial copy, renamed to DST at the end.
    hidden: bool,
    /// The partial copy was there already, from an interrupted run.
    resumed: bool,
}

impl Destination {
    /// The destination directory, as it is named when the copy is complete.
    pub(crate) fn target(&self) -> PathBuf {
        self.parent.join(&self.name)
    }

    /// Checks `dst` and makes or finds where the copy is written. `src_abs`, a local
    /// source, must neither contain nor be inside it.
    pub(crate) fn prepare(dst: &Path, src_abs: Option<&Path>) -> Result<Destination> {
        let bad = |why: String| CopyError::BadDestination {
            path: dst.to_path_buf(),
            why,
        };
        // A symlink to a directory is followed, as the user named it.
        let (parent, name, exists) = match std::fs::metadata(dst) {
            Ok(m) if m.is_dir() => {
                let abs = std::fs::canonicalize(dst).map_err(|e| bad(e.to_string()))?;
                let parent = abs.parent().unwrap_or(Path::new("/")).to_path_buf();
                let name = abs
                    .file_name()
                    .map(|n| n.to_os_string())
                    .unwrap_or_default();
                (parent, name, true)
            }
            Ok(_) => {
                return Err(bad(
                    "exists and is not a directory; a file tree is copied into a directory \
                     (remove it, or choose another path)"
                        .into(),
                ));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let parent = match dst.parent() {
                    Some(p) if !p.as_os_str().is_empty() => p,
                    _ => Path::new("."),
                };
                let parent = std::fs::canonicalize(parent).map_err(|e| {
                    bad(format!(
                        "its parent directory {} cannot be used ({e}); create it first",
                        parent.display()
                    ))
                })?;
                let name = dst.file_name().map(|n| n.to_os_string()).ok_or_else(|| {
                    bad("names no directory to create; give a path such as backup/data".into())
                })?;
                (parent, name, false)
            }
            Err(e) => return Err(bad(e.to_string())),
        };
        let target = parent.join(&name);
        if let Some(src_abs) = src_abs
            && (target.starts_with(src_abs) || src_abs.starts_with(&target))
        {
            return Err(CopyError::SameVolume {
                src: src_abs.to_path_buf(),
                dst: dst.to_path_buf(),
                detail: " (one tree contains the other)".into(),
            });
        }
        if exists {
            return Ok(Destination {
                work: target,
                parent,
                name,
                hidden: false,
                resumed: false,
            });
        }
        let mut partial = OsString::from(".");
        partial.push(&name);
        partial.push(".mover-partial");
        let work = parent.join(&partial);
        let resumed = match std::fs::create_dir(&work) {
            Ok(()) => false,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && work.is_dir() => true,
            Err(e) => return Err(tree_error(&work, "cannot create the partial copy")(e)),
        };
        if resumed {
            tracing::info!("finishing the interrupted copy in {}", work.display());
        }
        Ok(Destination {
            work,
            parent,
            name,
            hidden: true,
            resumed,
        })
    }

    /// Gives the top directory its metadata, makes everything durable, and renames a
    /// hidden copy into place (only if every entry was copied).
    fn finish<S: TreeSource>(
        &self,
        root: &DirPair<S::Dir>,
        syncer: &Syncer<'_, S>,
        source: &S,
        preserve: meta::Preserve,
    ) -> Result<()> {
        let err = |what| tree_error(&self.work, what);
        let (src_meta, src_x) = source
            .stat_dir(Path::new(""), preserve.xattrs)
            .map_err(tree_error(source.root_path(), "cannot stat the source"))?;
        let parent = meta::open_dir_at(rustix::fs::CWD, self.parent.as_os_str())
            .map_err(err("cannot open the parent of"))?;
        let work_name = self.work.file_name().unwrap_or_default();
        let have = meta::Meta::of_fd(root.dst.as_fd()).map_err(err("cannot stat"))?;
        let have_x = if preserve.xattrs {
            meta::read_xattrs(&self.work).map_err(err("cannot read xattrs of"))?
        } else {
            Vec::new()
        };
        meta::apply(
            parent.as_fd(),
            &self.parent,
            work_name,
            &src_meta,
            &src_x,
            Some((&have, &have_x)),
            preserve,
        )
        .map_err(err("cannot set the metadata of"))?;
        fs::syncfs(&root.dst).map_err(tree_error(&self.work, "cannot flush"))?;
        if !self.hidden {
            return Ok(());
        }
        if syncer.stats.errors.load(Relaxed) > 0 {
            tracing::warn!(
                "the copy is incomplete and stays hidden in {}; fix the errors and rerun",
                self.work.display()
            );
            return Ok(());
        }
        fs::renameat_with(
            &parent,
            work_name,
            &parent,
            &self.name,
            RenameFlags::NOREPLACE,
        )
        .map_err(|e| CopyError::BadDestination {
            path: self.parent.join(&self.name),
            why: format!(
                "appeared while the copy was made ({e}); the copy is complete in {}",
                self.work.display()
            ),
        })?;
        fs::fsync(&parent).map_err(tree_error(&self.work, "cannot flush the parent of"))?;
        Ok(())
    }
}

/// Lifts the soft limit on open files to the hard one: threads keep batches of source
/// files open while their reads are under way (see `LocalSource::prefetch`), up to 512
/// at once, and a soft limit of 1024 is common. Left as it is when that fails.
fn raise_open_files_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let mut limit = getrlimit(Resource::Nofile);
    if limit.current < limit.maximum {
        limit.current = limit.maximum;
        _ = setrlimit(Resource::Nofile, limit);
    }
}
