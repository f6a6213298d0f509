//! The walk that makes a destination directory equal to a source directory.
//!
//! Each directory pair is listed once on each side and compared by name; its entries
//! are brought up to date in batches on the rayon pool, and each subdirectory is its own
//! task, so memory grows with the directories in progress, not with the tree. A
//! directory's own metadata (mode, times) is set after its children are done.

use super::{
    content::{PATCH_MIN, Written},
    meta::{self, Entries, Meta, NodeKind, Preserve, Xattrs, list, open_file},
    record::{self, Record, RecordWriter},
    source::{Listed, TreeSource},
};
use crate::Progress;
use rustix::fs::{self, AtFlags, Mode, OFlags};
use std::{
    collections::{HashMap, hash_map::Entry},
    ffi::{OsStr, OsString},
    fs::File,
    io,
    os::{
        fd::{AsFd, BorrowedFd, OwnedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
    sync::{
        Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
};

/// Non-directory entries handled per task: enough to amortise scheduling, small enough
/// to spread one wide directory over every thread.
const BATCH: usize = 32;
/// Error messages kept for the summary (all are counted and logged).
const KEPT_ERRORS: usize = 20;
/// Times a file that changes while it is read is read again.
const RETRIES: u32 = 2;

/// The choices that shape a walk.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Rules {
    /// Delete destination entries the source does not have.
    pub delete: bool,
    /// Compare file contents, not size and mtime.
    pub checksum: bool,
    /// The destination is a hidden partial copy: entries are written under their own
    /// names (nobody sees them until the whole tree is renamed into place) and anything
    /// the source lacks is left over from an earlier attempt, so it is deleted.
    pub hidden: bool,
    /// What metadata to carry.
    pub preserve: Preserve,
    /// Changed large files are patched against their old copy (else copied whole).
    pub patch: bool,
    /// Large new files are copied with direct I/O, not through the page cache. Only
    /// into a fresh hidden tree on a filesystem without reflinks: where extents can be
    /// shared the kernel's copy clones them, and into a live destination the walk is
    /// mostly lookups that would queue behind the direct transfers, while the page cache
    /// takes buffered writes at once and writes them back meanwhile (measured: a delta
    /// run 10-20% slower with direct I/O, a first copy the same either way).
    pub direct: bool,
}

/// Counters of a walk, shared by its threads.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub files: AtomicU64,
    pub dirs: AtomicU64,
    pub symlinks: AtomicU64,
    pub specials: AtomicU64,
    pub hard_links: AtomicU64,
    pub copied: AtomicU64,
    pub patched: AtomicU64,
    pub unchanged: AtomicU64,
    pub metadata_updated: AtomicU64,
    pub deleted: AtomicU64,
    pub source_bytes: AtomicU64,
    pub new_bytes: AtomicU64,
    pub reused_bytes: AtomicU64,
    pub changed_while_read: AtomicU64,
    pub errors: AtomicU64,
    /// Entries the replica record showed unchanged: not looked at in the destination.
    pub from_record: AtomicU64,
    /// Destination directories listed and compared entry by entry.
    pub dst_listed: AtomicU64,
}

/// A hard link to make once the walk is over, when the first link's file is complete.
struct Deferred {
    /// This link, relative to the tree root.
    rel: PathBuf,
    /// The link the file was copied under.
    primary: PathBuf,
}

/// The open pair of directories being synced.
pub(crate) struct DirPair<D> {
    pub src: D,
    pub dst: OwnedFd,
    pub src_path: PathBuf,
    pub dst_path: PathBuf,
    /// Relative to the tree roots.
    pub rel: PathBuf,
}

/// One walk's shared state.
pub(crate) struct Syncer<'a, S: TreeSource> {
    source: &'a S,
    rules: Rules,
    pub stats: Stats,
    /// Source (dev, ino) of files with several links → the first link seen.
    links: Mutex<HashMap<(u64, u64), PathBuf>>,
    deferred: Mutex<Vec<Deferred>>,
    errors: Mutex<Vec<String>>,
    warnings: Mutex<Vec<String>>,
    /// The loss of the source has been reported.
    told_gone: AtomicBool,
    progress: &'a dyn Progress,
    /// The replica record of the last run, and the one this run writes.
    old_record: Option<&'a Record>,
    new_record: Option<&'a RecordWriter>,
    /// This process's effective (uid, gid): what a new file's owner is.
    me: (u32, u32),
}

/// What is known of the destination where one source entry goes.
#[derive(Clone, Copy)]
enum Known<'e> {
    /// Listed now: the `lstat` of the entry of that name, if there is one.
    Listed(Option<&'e Meta>),
    /// Recorded by the last `--replica` run (the directory still has those names): the
    /// source metadata the entry of that name was made equal to, if it was recorded.
    Recorded(Option<&'e Meta>),
}

/// A directory's source entries paired by name with what is known of the destination's.
struct Joined<'e> {
    /// For each source entry (by position), the destination's entry of that name.
    have: Vec<Option<&'e Meta>>,
    /// Source positions in name order.
    by_name: Vec<usize>,
    /// The destination's entries that have no source entry.
    gone: Vec<&'e (OsString, Meta)>,
}

/// Merges `src` with `there` (sorted by name) in one pass, instead of a binary search per
/// name and side: on an unchanged tree the walk's own work is mostly these comparisons.
fn join<'e>(src: &[Listed], there: &'e Entries) -> Joined<'e> {
    let mut by_name: Vec<usize> = (0..src.len()).collect();
    by_name.sort_unstable_by(|&a, &b| src[a].name.cmp(&src[b].name));
    let mut have = vec![None; src.len()];
    let mut gone = Vec::new();
    let mut theirs = there.iter().peekable();
    for &i in &by_name {
        let name = &src[i].name;
        while let Some(t) = theirs.next_if(|t| t.0 < *name) {
            gone.push(t);
        }
        have[i] = theirs.next_if(|t| t.0 == *name).map(|t| &t.1);
    }
    gone.extend(theirs);
    Joined {
        have,
        by_name,
        gone,
    }
}

/// What the destination holds where an entry goes.
#[derive(Clone, Copy)]
struct Slot {
    /// An entry of the same kind, to compare with.
    have: Option<Meta>,
    /// Whether anything is there (so a new entry is made under a temp name and renamed
    /// over it).
    occupied: bool,
}

impl<'a, S: TreeSource> Syncer<'a, S> {
    pub(crate) fn new(source: &'a S, rules: Rules, progress: &'a dyn Progress) -> Self {
        Syncer {
            source,
            rules,
            stats: Stats::default(),
            links: Mutex::default(),
            deferred: Mutex::default(),
            errors: Mutex::default(),
            warnings: Mutex::default(),
            told_gone: AtomicBool::new(false),
            progress,
            old_record: None,
            new_record: None,
            me: (
                rustix::process::geteuid().as_raw(),
                rustix::process::getegid().as_raw(),
            ),
        }
    }

    /// Compares with the replica record `old` where it still holds, and writes `new`.
    pub(crate) fn with_records(
        mut self,
        old: Option<&'a Record>,
        new: Option<&'a RecordWriter>,
    ) -> Self {
        self.old_record = old;
        self.new_record = new;
        self
    }

    /// The first errors and all warnings, for the summary.
    pub(crate) fn messages(&self) -> (Vec<String>, Vec<String>) {
        (
            self.errors.lock().expect("errors lock").clone(),
            self.warnings.lock().expect("warnings lock").clone(),
        )
    }

    fn fail(&self, path: &Path, what: &str, err: io::Error) {
        self.stats.errors.fetch_add(1, Relaxed);
        // Once the source is gone every entry fails the same way: say it once.
        if self.source.broken() && self.told_gone.swap(true, Relaxed) {
            return;
        }
        let message = format!("{}: {what}: {err}", path.display());
        tracing::error!("{message}");
        let mut kept = self.errors.lock().expect("errors lock");
        if kept.len() < KEPT_ERRORS {
            kept.push(message);
        }
    }

    fn warn(&self, message: String) {
        tracing::warn!("{message}");
        let mut kept = self.warnings.lock().expect("warnings lock");
        if kept.len() < KEPT_ERRORS {
            kept.push(message);
        }
    }

    /// Makes `pair.dst` hold what `pair.src` holds, recursively.
    pub(crate) fn sync_dir(&self, pair: &DirPair<S::Dir>) {
        if self.source.broken() {
            let gone = io::Error::new(io::ErrorKind::ConnectionAborted, "the source is gone");
            return self.fail(&pair.src_path, "not copied", gone);
        }
        let recorded = self
            .old_record
            .and_then(|r| r.entries(&pair.rel, pair.dst.as_fd()));
        // Xattrs of entries the record shows unchanged are not read.
        let xattrs = self.rules.preserve.xattrs && recorded.is_none();
        let src = match self.source.list(&pair.src, xattrs) {
            Ok(v) => v,
            Err(e) => return self.fail(&pair.src_path, "cannot list the source directory", e),
        };
        let as_known: fn(_) -> _ = if recorded.is_some() {
            Known::Recorded
        } else {
            Known::Listed
        };
        let there = match recorded {
            Some(r) => r,
            None => {
                self.stats.dst_listed.fetch_add(1, Relaxed);
                match list(pair.dst.as_fd()) {
                    Ok(v) => Entries::sorted(v),
                    Err(e) => {
                        return self.fail(&pair.dst_path, "cannot list the destination", e);
                    }
                }
            }
        };
        let joined = join(&src, &there);
        for (name, have) in joined.gone.iter().copied() {
            let ours = is_temp_name(name);
            if self.rules.delete || self.rules.hidden || ours {
                match remove_entry(pair.dst.as_fd(), name, have.kind) {
                    Ok(n) if !ours => _ = self.stats.deleted.fetch_add(n, Relaxed),
                    Ok(_) => {}
                    // A recorded entry may be gone already.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => self.fail(&pair.dst_path.join(name), "cannot delete", e),
                }
            }
        }
        let known = |i: usize| as_known(joined.have[i]);
        // Positions, in the listing's (inode) order: reads follow the disk's layout.
        let (dirs, others): (Vec<usize>, Vec<usize>) =
            (0..src.len()).partition(|&i| src[i].meta.kind == NodeKind::Dir);
        // Large files get a task each, so two of them never wait for each other.
        let (large, small): (Vec<usize>, Vec<usize>) = others
            .into_iter()
            .partition(|&i| src[i].meta.size >= PATCH_MIN);
        // What each destination entry is now made equal to (by source position), for the
        // new record.
        let made = Mutex::new(Vec::with_capacity(src.len()));
        rayon::scope(|s| {
            for batch in large.chunks(1).chain(small.chunks(BATCH)) {
                let (src, known, made) = (&src, &known, &made);
                s.spawn(move |_| {
                    let batch: Vec<(usize, Known)> = batch.iter().map(|&i| (i, known(i))).collect();
                    let _fetched = self.prefetch(pair, src, &batch);
                    let mut done = Vec::with_capacity(batch.len());
                    for &(i, known) in &batch {
                        match self.sync_known(pair, &src[i], known) {
                            Ok(m) => done.push((i, m)),
                            Err(e) => self.fail(&pair.src_path.join(&src[i].name), "not copied", e),
                        }
                    }
                    made.lock().expect("made lock").extend(done);
                });
            }
            for i in dirs {
                let (src, known, made) = (&src, &known, &made);
                s.spawn(move |_| match self.sync_subdir(pair, &src[i], known(i)) {
                    Ok(m) => made.lock().expect("made lock").push((i, m)),
                    Err(e) => self.fail(&pair.src_path.join(&src[i].name), "not copied", e),
                });
            }
        });
        if let Some(record) = self.new_record {
            let mut made = made.into_inner().expect("made lock");
            let mut rank = vec![0u32; src.len()];
            for (r, &i) in joined.by_name.iter().enumerate() {
                rank[i] = r as u32;
            }
            made.sort_unstable_by_key(|&(i, _)| rank[i]);
            record.add_dir(
                &pair.rel,
                made.iter().map(|(i, m)| (src[*i].name.as_os_str(), m)),
            );
        }
    }

    /// Brings one non-directory entry up to date, given what is known of the destination;
    /// returns the source metadata the destination entry now matches.
    fn sync_known(&self, pair: &DirPair<S::Dir>, entry: &Listed, known: Known) -> io::Result<Meta> {
        match known {
            Known::Listed(have) => self.sync_entry(pair, entry, have),
            Known::Recorded(recorded) => {
                if recorded.is_some_and(|r| record::unchanged(r, &entry.meta)) {
                    self.count_recorded(&entry.meta);
                    return Ok(entry.meta);
                }
                let entry = match self.with_xattrs(pair, entry) {
                    Ok(e) => e,
                    // Gone since the listing: recorded as listed, which the source no
                    // longer has, so the next run deletes it (with --delete).
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(entry.meta),
                    Err(e) => return Err(e),
                };
                let have = self.look(pair, &entry.name)?;
                self.sync_entry(pair, &entry, have.as_ref())
            }
        }
    }

    /// Counts an entry the record shows unchanged as the walk would have.
    fn count_recorded(&self, m: &Meta) {
        let s = &self.stats;
        match m.kind {
            NodeKind::File => {
                s.files.fetch_add(1, Relaxed);
                s.source_bytes.fetch_add(m.size, Relaxed);
            }
            NodeKind::Symlink => _ = s.symlinks.fetch_add(1, Relaxed),
            _ => _ = s.specials.fetch_add(1, Relaxed),
        }
        s.unchanged.fetch_add(1, Relaxed);
        s.from_record.fetch_add(1, Relaxed);
    }

    /// The entry with its source xattrs, which a listing against the record left out.
    fn with_xattrs(&self, pair: &DirPair<S::Dir>, entry: &Listed) -> io::Result<Listed> {
        let mut entry = entry.clone();
        if self.rules.preserve.xattrs {
            entry.xattrs = self.source.read_xattrs(&pair.src, &entry.name)?;
        }
        Ok(entry)
    }

    /// The destination's `lstat` of `name`, if it exists.
    fn look(&self, pair: &DirPair<S::Dir>, name: &OsStr) -> io::Result<Option<Meta>> {
        match Meta::at(pair.dst.as_fd(), name) {
            Ok(m) => Ok(Some(m)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Lets the source fetch ahead the small files of `batch` (positions in `src`) that
    /// will be copied whole.
    fn prefetch(
        &self,
        pair: &DirPair<S::Dir>,
        src: &[Listed],
        batch: &[(usize, Known)],
    ) -> S::Prefetch {
        let files: Vec<(&OsStr, u64)> = batch
            .iter()
            .filter(|&&(i, known)| {
                // Files that may be unchanged are not fetched.
                let m = &src[i].meta;
                m.kind == NodeKind::File
                    && m.size < PATCH_MIN
                    && !match known {
                        Known::Listed(have) => have
                            .is_some_and(|h| h.kind == NodeKind::File && h.same_size_and_mtime(m)),
                        Known::Recorded(recorded) => {
                            recorded.is_some_and(|r| record::unchanged(r, m))
                        }
                    }
            })
            .map(|&(i, _)| (src[i].name.as_os_str(), src[i].meta.size))
            .collect();
        self.source.prefetch(&pair.src, &files)
    }

    fn sync_subdir(
        &self,
        pair: &DirPair<S::Dir>,
        entry: &Listed,
        known: Known,
    ) -> io::Result<Meta> {
        self.stats.dirs.fetch_add(1, Relaxed);
        let (have, entry) = match known {
            Known::Listed(have) => (have.copied(), entry),
            Known::Recorded(_) => (
                self.look(pair, &entry.name)?,
                &self.with_xattrs(pair, entry)?,
            ),
        };
        let name = entry.name.as_os_str();
        let have = self.clear_for(pair, name, have, NodeKind::Dir)?;
        if have.is_none() {
            fs::mkdirat(pair.dst.as_fd(), name, Mode::from_raw_mode(0o700))?;
        }
        let child = DirPair {
            src: self.source.open_dir(&pair.src, name)?,
            dst: meta::open_dir_at(&pair.dst, name)?,
            src_path: pair.src_path.join(name),
            dst_path: pair.dst_path.join(name),
            rel: pair.rel.join(name),
        };
        self.sync_dir(&child);
        // Its children changed its times: compare with what it is now.
        let now = Meta::of_fd(child.dst.as_fd())?;
        let dst_x = self.dst_xattrs(pair, name, have.is_some())?;
        self.apply(pair, name, &entry.meta, &entry.xattrs, Some((&now, &dst_x)))?;
        if let Some(record) = self.new_record {
            record.seal(&child.rel, &Meta::of_fd(child.dst.as_fd())?);
        }
        Ok(entry.meta)
    }

    /// Makes room for a `kind` entry at `name`: an entry of another kind there is removed
    /// (only with --delete when it is a directory). Returns what stays.
    fn clear_for(
        &self,
        pair: &DirPair<S::Dir>,
        name: &OsStr,
        have: Option<Meta>,
        kind: NodeKind,
    ) -> io::Result<Option<Meta>> {
        match have {
            Some(h) if h.kind != kind && h.kind == NodeKind::Dir => {
                if !(self.rules.delete || self.rules.hidden) {
                    return Err(io::Error::other(format!(
                        "the destination has a directory where the source has a {kind:?}; \
                         rerun with --delete to replace it"
                    )));
                }
                let n = remove_entry(pair.dst.as_fd(), name, NodeKind::Dir)?;
                self.stats.deleted.fetch_add(n, Relaxed);
                Ok(None)
            }
            Some(h) if h.kind != kind && kind == NodeKind::Dir => {
                fs::unlinkat(pair.dst.as_fd(), name, AtFlags::empty())?;
                self.stats.deleted.fetch_add(1, Relaxed);
                Ok(None)
            }
            other => Ok(other),
        }
    }

    fn sync_entry(
        &self,
        pair: &DirPair<S::Dir>,
        entry: &Listed,
        have: Option<&Meta>,
    ) -> io::Result<Meta> {
        let kind = entry.meta.kind;
        let there = self.clear_for(pair, &entry.name, have.copied(), kind)?;
        // An entry of another kind is replaced by the rename that puts the new one there.
        let slot = Slot {
            have: there.filter(|h| h.kind == kind),
            occupied: there.is_some(),
        };
        match kind {
            NodeKind::File => self.sync_file(pair, entry, slot),
            NodeKind::Symlink => self.sync_symlink(pair, entry, slot),
            _ => self.sync_special(pair, entry, slot),
        }
    }

    fn sync_file(&self, pair: &DirPair<S::Dir>, entry: &Listed, slot: Slot) -> io::Result<Meta> {
        let (name, m, have) = (entry.name.as_os_str(), &entry.meta, slot.have);
        if m.nlink > 1 {
            let rel = pair.rel.join(name);
            match self.links.lock().expect("links lock").entry((m.dev, m.ino)) {
                Entry::Occupied(first) => {
                    self.deferred.lock().expect("deferred lock").push(Deferred {
                        rel,
                        primary: first.get().clone(),
                    });
                    return Ok(*m);
                }
                Entry::Vacant(slot) => _ = slot.insert(rel),
            }
        }
        self.stats.files.fetch_add(1, Relaxed);
        self.stats.source_bytes.fetch_add(m.size, Relaxed);
        // A destination inode shared with another name the source no longer links is
        // copied anew: changing its metadata in place would change the other name too.
        if let Some(h) = have
            && h.same_size_and_mtime(m)
            && !(h.nlink > 1 && m.nlink == 1)
            && (!self.rules.checksum || self.same_content(pair, name)?)
        {
            let dst_x = self.dst_xattrs(pair, name, true)?;
            self.settle(self.apply(pair, name, m, &entry.xattrs, Some((&h, &dst_x)))?);
            return Ok(*m);
        }
        let src = self.source.open_file(&pair.src, name)?;
        let (target, final_name) = self.target(name, slot.occupied);
        // In a hidden tree a file that will be ours is made with its final permissions,
        // which spares a chmod (nobody can read it meanwhile who could not read it when
        // done); anything else is private until complete.
        let create_mode = if final_name && (m.uid, m.gid) == self.me {
            m.mode & 0o777
        } else {
            0o600
        };
        let dst: File = fs::openat(
            pair.dst.as_fd(),
            &target,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(create_mode),
        )?
        .into();
        let old = match have {
            Some(h) if self.rules.patch && h.size > 0 && m.size >= PATCH_MIN => {
                Some(open_file(pair.dst.as_fd(), name)?)
            }
            _ => None,
        };
        // The listing's lstat is the baseline: a change since then shows as a difference.
        let mut seen = *m;
        let mut attempt = 0;
        let mut changed_while_read = false;
        let written = loop {
            let result = match &old {
                Some(old) => self.source.patch(&src, old, &dst, seen.size),
                None => {
                    let sparse = seen.allocated < seen.size;
                    self.source
                        .copy_whole(&src, &dst, seen.size, sparse, self.rules.direct)
                }
            };
            let after = self.source.stat(&src)?;
            let changed = seen.content_changed(&after);
            match result {
                Ok(w) if !changed => break w,
                Err(e) if !changed && e.kind() != io::ErrorKind::UnexpectedEof => {
                    return Err(e);
                }
                _ if attempt < RETRIES => {
                    attempt += 1;
                    seen = after;
                    dst.set_len(0)?;
                }
                Ok(w) => {
                    // Copied as read, with the mtime from before the read: the next run
                    // sees the source's newer mtime and copies it again.
                    self.stats.changed_while_read.fetch_add(1, Relaxed);
                    changed_while_read = true;
                    self.warn(format!(
                        "{}: changed while being read; copied as read (rerun to pick up the change)",
                        pair.src_path.join(name).display()
                    ));
                    break w;
                }
                Err(e) => return Err(e),
            }
        };
        // The metadata seen when the content was read (the listing may be older).
        let xattr_path = meta::xattr_path(&pair.dst_path, pair.dst.as_fd(), &target);
        meta::apply_new_file(&dst, &xattr_path, &seen, &entry.xattrs, self.rules.preserve)?;
        drop(dst);
        if !final_name {
            fs::renameat(pair.dst.as_fd(), &target, pair.dst.as_fd(), name)?;
        }
        let counter = if old.is_some() {
            &self.stats.patched
        } else {
            &self.stats.copied
        };
        counter.fetch_add(1, Relaxed);
        self.record(written);
        // Changed while read (copied as read), or retried (the xattrs are the listing's):
        // the listing's metadata, which the source no longer has, so the next run looks
        // at it again.
        Ok(if changed_while_read || attempt > 0 {
            *m
        } else {
            seen
        })
    }

    fn record(&self, w: Written) {
        let before = self.stats.new_bytes.fetch_add(w.new_bytes, Relaxed);
        self.stats.reused_bytes.fetch_add(w.reused_bytes, Relaxed);
        let done = before + w.new_bytes;
        // Redraw about every 8 MiB: a lock per small file would serialise the threads.
        if (before >> 23) != (done >> 23) {
            self.progress.update(done);
        }
    }

    fn settle(&self, metadata_changed: bool) {
        let counter = if metadata_changed {
            &self.stats.metadata_updated
        } else {
            &self.stats.unchanged
        };
        counter.fetch_add(1, Relaxed);
    }

    fn sync_symlink(&self, pair: &DirPair<S::Dir>, entry: &Listed, slot: Slot) -> io::Result<Meta> {
        self.stats.symlinks.fetch_add(1, Relaxed);
        let (name, have) = (entry.name.as_os_str(), slot.have);
        let target = OsStr::from_bytes(&entry.link);
        if let Some(h) = have
            && fs::readlinkat(pair.dst.as_fd(), name, Vec::new())?.as_bytes() == entry.link
        {
            let dst_x = self.dst_xattrs(pair, name, true)?;
            self.settle(self.apply(pair, name, &entry.meta, &entry.xattrs, Some((&h, &dst_x)))?);
            return Ok(entry.meta);
        }
        let (tmp, final_name) = self.target(name, slot.occupied);
        fs::symlinkat(target, pair.dst.as_fd(), &tmp)?;
        self.finish_new(pair, entry, &tmp, final_name)
    }

    fn sync_special(&self, pair: &DirPair<S::Dir>, entry: &Listed, slot: Slot) -> io::Result<Meta> {
        self.stats.specials.fetch_add(1, Relaxed);
        let (name, m, have) = (entry.name.as_os_str(), &entry.meta, slot.have);
        if let Some(h) = have
            && h.rdev == m.rdev
        {
            let dst_x = self.dst_xattrs(pair, name, true)?;
            self.settle(self.apply(pair, name, m, &entry.xattrs, Some((&h, &dst_x)))?);
            return Ok(*m);
        }
        let (tmp, final_name) = self.target(name, slot.occupied);
        fs::mknodat(
            pair.dst.as_fd(),
            &tmp,
            m.kind.file_type(),
            Mode::from_raw_mode(0o600),
            m.rdev,
        )?;
        self.finish_new(pair, entry, &tmp, final_name)
    }

    /// Gives a just-made entry its metadata and renames it into place.
    fn finish_new(
        &self,
        pair: &DirPair<S::Dir>,
        entry: &Listed,
        made: &OsStr,
        final_name: bool,
    ) -> io::Result<Meta> {
        self.apply(pair, made, &entry.meta, &entry.xattrs, None)?;
        if !final_name {
            fs::renameat(pair.dst.as_fd(), made, pair.dst.as_fd(), &entry.name)?;
        }
        self.stats.copied.fetch_add(1, Relaxed);
        Ok(entry.meta)
    }

    /// Where a new version of `name` is made, and whether that is its final name: its own
    /// name in a hidden tree where nothing is there yet, else a temp name renamed over it
    /// when complete. (A crash's leftover temp was already removed when the directory was
    /// listed.)
    fn target(&self, name: &OsStr, exists: bool) -> (OsString, bool) {
        if self.rules.hidden && !exists {
            (name.to_os_string(), true)
        } else {
            (temp_name(name), false)
        }
    }

    fn apply(
        &self,
        pair: &DirPair<S::Dir>,
        name: &OsStr,
        m: &Meta,
        src_x: &Xattrs,
        have: Option<(&Meta, &Xattrs)>,
    ) -> io::Result<bool> {
        meta::apply(
            pair.dst.as_fd(),
            &pair.dst_path,
            name,
            m,
            src_x,
            have,
            self.rules.preserve,
        )
    }

    /// The destination's xattrs of `name` (none if it does not exist or they are not
    /// carried).
    fn dst_xattrs(&self, pair: &DirPair<S::Dir>, name: &OsStr, exists: bool) -> io::Result<Xattrs> {
        if !self.rules.preserve.xattrs || !exists {
            return Ok(Xattrs::new());
        }
        meta::read_xattrs_at(pair.dst.as_fd(), &pair.dst_path, name)
    }

    fn same_content(&self, pair: &DirPair<S::Dir>, name: &OsStr) -> io::Result<bool> {
        let src = self.source.open_file(&pair.src, name)?;
        self.source
            .same_content(&src, &open_file(pair.dst.as_fd(), name)?)
    }

    /// Makes the hard links found during the walk, now that every first link is
    /// complete. A link that is already right is left alone.
    pub(crate) fn link_deferred(&self, dst_root: &Path) {
        let deferred = std::mem::take(&mut *self.deferred.lock().expect("deferred lock"));
        for d in deferred {
            self.stats.hard_links.fetch_add(1, Relaxed);
            if let Err(e) = self.link_one(dst_root, &d) {
                let path = self.source.root_path().join(&d.rel);
                self.fail(&path, "hard link not made", e);
            }
        }
    }

    fn link_one(&self, dst_root: &Path, d: &Deferred) -> io::Result<()> {
        let (path, primary) = (dst_root.join(&d.rel), dst_root.join(&d.primary));
        let first = std::fs::symlink_metadata(&primary)?;
        let parent = path.parent().unwrap_or(dst_root);
        let name = path.file_name().unwrap_or_default();
        let dir: OwnedFd = File::open(parent)?.into();
        let have = match Meta::at(dir.as_fd(), name) {
            Ok(h) => Some(h),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        use std::os::unix::fs::MetadataExt;
        if let Some(h) = have
            && (h.dev, h.ino) == (first.dev(), first.ino())
        {
            return Ok(());
        }
        let have = match have {
            Some(h) if h.kind == NodeKind::Dir => {
                if !(self.rules.delete || self.rules.hidden) {
                    return Err(io::Error::other(
                        "the destination has a directory where the source has a hard link; \
                         rerun with --delete to replace it",
                    ));
                }
                let n = remove_entry(dir.as_fd(), name, NodeKind::Dir)?;
                self.stats.deleted.fetch_add(n, Relaxed);
                None
            }
            other => other,
        };
        if have.is_none() {
            fs::linkat(&dir, &primary, &dir, name, AtFlags::empty())?;
        } else {
            let tmp = temp_name(name);
            fs::linkat(&dir, &primary, &dir, &tmp, AtFlags::empty())?;
            fs::renameat(&dir, &tmp, &dir, name)?;
        }
        // The new name changed the directory's mtime: give it back the source's.
        let (src_dir, _) = self
            .source
            .stat_dir(d.rel.parent().unwrap_or(Path::new("")), false)?;
        meta::set_mtime(dir.as_fd(), OsStr::new("."), src_dir.mtime)?;
        if let Some(record) = self.new_record {
            let rel = d.rel.parent().unwrap_or(Path::new(""));
            record.seal(rel, &Meta::of_fd(dir.as_fd())?);
        }
        Ok(())
    }
}

/// Removes an entry, a directory with everything in it; returns how many entries went.
pub(crate) fn remove_entry(dir: BorrowedFd<'_>, name: &OsStr, kind: NodeKind) -> io::Result<u64> {
    let mut removed = 1;
    if kind == NodeKind::Dir {
        let fd = meta::open_dir_at(dir, name)?;
        for (name, meta) in list(fd.as_fd())? {
            removed += remove_entry(fd.as_fd(), &name, meta.kind)?;
        }
        fs::unlinkat(dir, name, AtFlags::REMOVEDIR)?;
    } else {
        fs::unlinkat(dir, name, AtFlags::empty())?;
    }
    Ok(removed)
}

/// The temp name a new version of `name` is written under: short whatever `name` is, and
/// recognisable, so a crash's leftovers are cleaned up by the next run.
fn temp_name(name: &OsStr) -> OsString {
    let hash = blake3::hash(name.as_bytes());
    format!(".mover-{}.tmp", &hash.to_hex()[..16]).into()
}

fn is_temp_name(name: &OsStr) -> bool {
    let b = name.as_bytes();
    b.len() == 27 && b.starts_with(b".mover-") && b.ends_with(b".tmp")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    fn meta(ino: u64) -> Meta {
        Meta {
            kind: NodeKind::File,
            mode: 0o644,
            uid: 0,
            gid: 0,
            size: 0,
            allocated: 0,
            mtime: (0, 0),
            ctime: (0, 0),
            rdev: 0,
            dev: 0,
            ino,
            nlink: 1,
        }
    }

    fn listed(name: &[u8], ino: u64) -> Listed {
        Listed {
            name: OsString::from_vec(name.to_vec()),
            meta: meta(ino),
            link: Vec::new(),
            xattrs: Xattrs::new(),
        }
    }

    #[test]
    fn join_pairs_entries_by_name_and_finds_the_ones_gone() {
        // Source in listing (inode) order, not name order; a name that is not UTF-8.
        let src = [
            listed(b"m", 1),
            listed(b"\xff\xfe", 2),
            listed(b"b", 3),
            listed(b"z", 4),
        ];
        let there = Entries::sorted(
            [
                (&b"a"[..], 10),
                (b"b", 11),
                (b"c", 12),
                (b"z", 13),
                (b"\xff", 14),
            ]
            .iter()
            .map(|&(n, ino)| (OsString::from_vec(n.to_vec()), meta(ino)))
            .collect(),
        );
        let j = join(&src, &there);
        let have: Vec<Option<u64>> = j.have.iter().map(|h| h.map(|m| m.ino)).collect();
        assert_eq!(have, [None, None, Some(11), Some(13)]);
        let names: Vec<&[u8]> = j.by_name.iter().map(|&i| src[i].name.as_bytes()).collect();
        assert_eq!(names, [&b"b"[..], b"m", b"z", b"\xff\xfe"]);
        let gone: Vec<u64> = j.gone.iter().map(|(_, m)| m.ino).collect();
        assert_eq!(gone, [10, 12, 14]);

        let empty = join(&[], &there);
        assert_eq!(empty.gone.len(), 5);
        let nothing = Entries::sorted(Vec::new());
        let all_new = join(&src, &nothing);
        assert!(all_new.have.iter().all(Option::is_none) && all_new.gone.is_empty());
    }
}
