//! `snapshot restore` of a tree snapshot: the snapshot is a [`TreeSource`] for the same
//! walk as `mover copy` (so a new DST is built hidden and renamed when complete, an
//! existing one gets only what differs, `--delete` removes what the snapshot lacks, hard
//! links, xattrs, holes and times are kept). Listings come from tree blobs, file
//! contents from packs: a directory's small files with one ranged read per run of
//! nearby blobs, a large file in windows, a changed large file patched from the chunks
//! its old copy already holds. A damaged chunk fails its file only: into an existing
//! directory the rest is restored; a new one stays hidden as `.DST.mover-partial` with
//! the rest in it (the run says so and exits 1: move it into place to accept the loss).

use crate::tree::{
    TreeOptions, TreeSummary,
    content::{Reuse, Written},
    meta::{Meta, Xattrs},
    source::{Listed, TreeSource},
};
use chunker::{
    CdcChunker, CdcParams, ChunkId,
    direct::{ALIGN, DirectFile},
};
use snapshots::{
    BlobLoc, Bytes, FilePiece, Index, NodeKind, PackId, RepoError, Repository, TreeNode,
};
use std::{
    collections::HashMap,
    ffi::{OsStr, OsString},
    fs::File,
    io,
    os::unix::{
        ffi::{OsStrExt, OsStringExt},
        fs::FileExt,
    },
    path::{Component, Path, PathBuf},
    sync::{Arc, Mutex},
};

/// Data a large file's restore fetches at once.
const WINDOW: u64 = 16 << 20;
/// Files from this size are written with direct I/O into a new DST (the walk's large
/// files, each its own task): below it, reopening the file for direct I/O and waiting
/// for the device cost more than the page cache saves.
const DIRECT_FILE_MIN: u64 = 1 << 20;

/// A tree snapshot seen as a source tree.
pub(crate) struct SnapshotTree {
    repo: Arc<Repository>,
    index: Arc<Index>,
    rt: tokio::runtime::Handle,
    label: PathBuf,
    top: TreeNode,
    /// Only these paths (and what is above and below them) are restored; empty: all.
    include: Vec<PathBuf>,
    chunker: CdcChunker,
    /// Chunks of small files fetched ahead, until their batch is done.
    fetched: Arc<Mutex<HashMap<ChunkId, Bytes>>>,
    /// Ranged reads in flight at once, over all threads (`--reads`).
    reads: Arc<tokio::sync::Semaphore>,
    /// Directory metadata looked up by path (deferred hard links ask again and again).
    dir_meta: Mutex<HashMap<PathBuf, (Meta, Xattrs)>>,
}

/// A directory of the snapshot: its path below the top and its entries.
pub(crate) struct SnapDir {
    rel: PathBuf,
    entries: Vec<TreeNode>,
}

/// Chunks fetched for one batch of small files, dropped from the cache with it.
pub(crate) struct Fetched {
    cache: Arc<Mutex<HashMap<ChunkId, Bytes>>>,
    ids: Vec<ChunkId>,
}

impl Drop for Fetched {
    fn drop(&mut self) {
        let mut cache = self.cache.lock().expect("fetched lock");
        for id in &self.ids {
            cache.remove(id);
        }
    }
}

fn io_err(e: RepoError) -> io::Error {
    io::Error::other(e.to_string())
}

impl SnapshotTree {
    /// The tree below `top` (the snapshot's `.` node) of a snapshot, labelled `label`.
    pub(crate) fn new(
        repo: Arc<Repository>,
        index: Arc<Index>,
        rt: tokio::runtime::Handle,
        label: PathBuf,
        top: TreeNode,
        include: Vec<PathBuf>,
        reads: usize,
    ) -> Self {
        let chunker = CdcChunker::new(repo.chunk_key().clone(), CdcParams::default())
            .expect("default CDC parameters");
        SnapshotTree {
            repo,
            index,
            rt,
            label,
            top,
            include,
            chunker,
            fetched: Arc::default(),
            reads: Arc::new(tokio::sync::Semaphore::new(reads.max(1))),
            dir_meta: Mutex::default(),
        }
    }

    fn entries_of(&self, node: &TreeNode) -> io::Result<Vec<TreeNode>> {
        match (node.kind, node.subtree) {
            (NodeKind::Dir, Some(sub)) => self
                .rt
                .block_on(self.repo.read_tree(&self.index, &sub))
                .map_err(io_err),
            _ => Err(io::Error::from(io::ErrorKind::NotADirectory)),
        }
    }

    /// Whether the entry at `rel` is restored (see `include`).
    fn wanted(&self, rel: &Path) -> bool {
        self.include.is_empty()
            || self
                .include
                .iter()
                .any(|i| i.starts_with(rel) || rel.starts_with(i))
    }

    /// Fetches chunks' plaintext: blobs of one pack with merged ranged reads, the packs
    /// concurrently; chunks stored as deltas one by one (rebuilt on their base).
    fn fetch(&self, ids: &[ChunkId]) -> io::Result<HashMap<ChunkId, Bytes>> {
        let mut by_pack: HashMap<PackId, Vec<(ChunkId, BlobLoc)>> = HashMap::new();
        let mut deltas = Vec::new();
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        for id in &ids {
            let loc = self
                .index
                .get(id)
                .ok_or_else(|| io_err(RepoError::MissingBlob { id: id.to_hex() }))?;
            match loc.base {
                Some(_) => deltas.push(*id),
                None => by_pack.entry(loc.pack).or_default().push((*id, loc)),
            }
        }
        self.rt.block_on(async {
            let mut reads = tokio::task::JoinSet::new();
            for (pack, blobs) in by_pack {
                let (repo, limit) = (self.repo.clone(), self.reads.clone());
                reads.spawn(async move {
                    let _permit = limit.acquire_owned().await;
                    repo.read_blobs(&pack, blobs).await
                });
            }
            let mut out = HashMap::with_capacity(ids.len());
            while let Some(r) = reads.join_next().await {
                out.extend(r.map_err(io::Error::other)?.map_err(io_err)?);
            }
            for id in deltas {
                let plain = self
                    .repo
                    .read_chunk(&self.index, &id)
                    .await
                    .map_err(io_err)?;
                out.insert(id, plain);
            }
            Ok(out)
        })
    }

    /// Writes the data pieces of `f` that `skip` does not claim, fetching them in
    /// windows; returns the bytes written.
    fn write_pieces(
        &self,
        f: &TreeNode,
        dst: &File,
        direct: Option<&DirectFile>,
        mut skip: impl FnMut(&ChunkId, u64, u32) -> io::Result<bool>,
    ) -> io::Result<u64> {
        let mut want: Vec<(u64, ChunkId, u32)> = Vec::new();
        let mut at = 0;
        for p in &f.content {
            if let FilePiece::Data { id, len } = p
                && !skip(id, at, *len)?
            {
                want.push((at, *id, *len));
            }
            at += p.len();
        }
        let mut written = 0;
        let mut out = RunWriter {
            dst,
            direct,
            run: Vec::new(),
            run_at: 0,
            run_len: 0,
        };
        let mut rest = &want[..];
        while !rest.is_empty() {
            let mut bytes = 0;
            let n = rest
                .iter()
                .take_while(|(_, _, len)| {
                    bytes += *len as u64;
                    bytes <= WINDOW
                })
                .count()
                .max(1);
            let (window, later) = rest.split_at(n);
            rest = later;
            let ahead: Vec<ChunkId> = {
                let cache = self.fetched.lock().expect("fetched lock");
                window
                    .iter()
                    .filter(|(_, id, _)| !cache.contains_key(id))
                    .map(|(_, id, _)| *id)
                    .collect()
            };
            let mut got = self.fetch(&ahead)?;
            for (at, id, len) in window {
                let data = match got.get(id) {
                    Some(d) => d.clone(),
                    None => match self.fetched.lock().expect("fetched lock").get(id) {
                        Some(d) => d.clone(),
                        None => {
                            let one = self.fetch(&[*id])?;
                            got.extend(one);
                            got[id].clone()
                        }
                    },
                };
                if data.len() != *len as usize {
                    return Err(io::Error::other(format!(
                        "chunk {} holds {} bytes where the tree blob says {len}",
                        id.to_hex(),
                        data.len()
                    )));
                }
                written += data.len() as u64;
                out.push(*at, data)?;
            }
            out.flush(rest.is_empty())?;
        }
        Ok(written)
    }
}

/// Writes a file's chunks a window at a time. Each window's contiguous run goes out in
/// one direct write of its aligned head when the file has a direct twin (restoring
/// large files through the page cache cost a copy of every byte and its writeback); the
/// unaligned rest (under 4 KiB) is carried into the next window's run, and written
/// buffered where the run ends (a hole, the end of the file).
struct RunWriter<'a> {
    dst: &'a File,
    direct: Option<&'a DirectFile>,
    /// The run not written yet, at `run_at`, `run_len` bytes.
    run: Vec<Bytes>,
    run_at: u64,
    run_len: u64,
}

impl RunWriter<'_> {
    fn push(&mut self, at: u64, data: Bytes) -> io::Result<()> {
        if at != self.run_at + self.run_len {
            self.write_buffered()?;
            self.run_at = at;
        }
        self.run_len += data.len() as u64;
        self.run.push(data);
        Ok(())
    }

    /// The end of a window (`last`: of the file): what can go direct goes.
    fn flush(&mut self, last: bool) -> io::Result<()> {
        let mut done = match self.direct {
            Some(d) => {
                let parts: Vec<&[u8]> = self.run.iter().map(|b| &b[..]).collect();
                d.write_parts_at(&parts, self.run_at)? as u64
            }
            None => 0,
        };
        self.run_at += done;
        self.run_len -= done;
        while done > 0 {
            let head = self.run[0].len() as u64;
            if head <= done {
                self.run.remove(0);
                done -= head;
            } else {
                self.run[0] = self.run[0].slice(done as usize..);
                done = 0;
            }
        }
        if last || self.run_len >= ALIGN as u64 {
            self.write_buffered()?;
        }
        Ok(())
    }

    fn write_buffered(&mut self) -> io::Result<()> {
        for part in self.run.drain(..) {
            self.dst.write_all_at(&part, self.run_at)?;
            self.run_at += part.len() as u64;
        }
        self.run_len = 0;
        Ok(())
    }
}

/// The metadata a walk compares and applies, from a tree node.
fn meta_of(n: &TreeNode) -> Meta {
    let holes: u64 = n
        .content
        .iter()
        .filter_map(|p| match p {
            FilePiece::Hole(h) => Some(*h),
            FilePiece::Data { .. } => None,
        })
        .sum();
    Meta {
        kind: n.kind,
        mode: n.mode,
        uid: n.uid,
        gid: n.gid,
        size: n.size,
        allocated: n.size - holes.min(n.size),
        mtime: n.mtime,
        ctime: n.ctime,
        rdev: n.rdev,
        dev: n.dev,
        ino: n.ino,
        nlink: n.nlink,
    }
}

/// Where the last data piece of `f` ends.
fn data_end(f: &TreeNode) -> u64 {
    let mut at = 0;
    let mut end = 0;
    for p in &f.content {
        at += p.len();
        if matches!(p, FilePiece::Data { .. }) {
            end = at;
        }
    }
    end
}

fn xattrs_of(n: &TreeNode) -> Xattrs {
    n.xattrs
        .iter()
        .map(|(k, v)| (OsString::from_vec(k.clone()), v.clone()))
        .collect()
}

impl TreeSource for SnapshotTree {
    type Dir = SnapDir;
    type File = TreeNode;
    type Prefetch = Fetched;

    fn root_path(&self) -> &Path {
        &self.label
    }

    fn open_root(&self) -> io::Result<SnapDir> {
        Ok(SnapDir {
            rel: PathBuf::new(),
            entries: self.entries_of(&self.top)?,
        })
    }

    fn open_dir(&self, parent: &SnapDir, name: &OsStr) -> io::Result<SnapDir> {
        let node = find(&parent.entries, name)?;
        Ok(SnapDir {
            rel: parent.rel.join(name),
            entries: self.entries_of(node)?,
        })
    }

    fn list(&self, dir: &SnapDir, xattrs: bool) -> io::Result<Vec<Listed>> {
        Ok(dir
            .entries
            .iter()
            .filter(|n| self.wanted(&dir.rel.join(OsStr::from_bytes(&n.name))))
            .map(|n| Listed {
                name: OsString::from_vec(n.name.clone()),
                meta: meta_of(n),
                link: n.link.clone(),
                xattrs: if xattrs { xattrs_of(n) } else { Xattrs::new() },
            })
            .collect())
    }

    fn read_xattrs(&self, dir: &SnapDir, name: &OsStr) -> io::Result<Xattrs> {
        Ok(xattrs_of(find(&dir.entries, name)?))
    }

    fn stat_dir(&self, rel: &Path, xattrs: bool) -> io::Result<(Meta, Xattrs)> {
        if let Some((m, x)) = self.dir_meta.lock().expect("dir_meta lock").get(rel) {
            return Ok((*m, if xattrs { x.clone() } else { Xattrs::new() }));
        }
        let mut node = self.top.clone();
        for c in rel.components() {
            let Component::Normal(name) = c else { continue };
            let entries = self.entries_of(&node)?;
            node = find(&entries, name)?.clone();
        }
        let found = (meta_of(&node), xattrs_of(&node));
        self.dir_meta
            .lock()
            .expect("dir_meta lock")
            .insert(rel.to_path_buf(), found.clone());
        Ok((found.0, if xattrs { found.1 } else { Xattrs::new() }))
    }

    fn open_file(&self, dir: &SnapDir, name: &OsStr) -> io::Result<TreeNode> {
        find(&dir.entries, name).cloned()
    }

    fn copy_whole(
        &self,
        f: &TreeNode,
        dst: &File,
        size: u64,
        _sparse: bool,
        direct: bool,
    ) -> io::Result<Written> {
        let twin = (direct && size >= DIRECT_FILE_MIN).then(|| DirectFile::reopen(dst, true));
        let new_bytes = self.write_pieces(f, dst, twin.as_ref(), |_, _, _| Ok(false))?;
        // `dst` is new (or emptied for a retry): only a trailing hole leaves it short.
        // (A truncate per file was 4% of a restore's time.)
        if data_end(f) != size {
            dst.set_len(size)?;
        }
        Ok(Written {
            new_bytes,
            reused_bytes: 0,
        })
    }

    fn patch(&self, f: &TreeNode, old: &File, dst: &File, size: u64) -> io::Result<Written> {
        let mut have = HashMap::new();
        for item in self
            .chunker
            .chunk_stream(io::BufReader::with_capacity(1 << 20, old))
        {
            let (c, _) = item?;
            have.entry(c.id).or_insert((c.offset, c.len));
        }
        let mut reuse = Reuse::new(old, dst);
        let new_bytes = self.write_pieces(f, dst, None, |id, at, len| match have.get(id) {
            Some(&(from, l)) if l == len as usize => {
                reuse.take(from, at, len as u64)?;
                Ok(true)
            }
            _ => Ok(false),
        })?;
        let reused_bytes = reuse.finish()?;
        dst.set_len(size)?;
        Ok(Written {
            new_bytes,
            reused_bytes,
        })
    }

    fn stat(&self, f: &TreeNode) -> io::Result<Meta> {
        Ok(meta_of(f))
    }

    /// Compares chunk ids; a file with holes is taken to differ (rewritten).
    fn same_content(&self, f: &TreeNode, other: &File) -> io::Result<bool> {
        if f.content.iter().any(|p| matches!(p, FilePiece::Hole(_))) {
            return Ok(false);
        }
        let mut want = f.chunks();
        for item in self
            .chunker
            .chunk_stream(io::BufReader::with_capacity(1 << 20, other))
        {
            if want.next() != Some(item?.0.id) {
                return Ok(false);
            }
        }
        Ok(want.next().is_none())
    }

    fn prefetch(&self, dir: &SnapDir, files: &[(&OsStr, u64)]) -> Fetched {
        let ids: Vec<ChunkId> = files
            .iter()
            .filter_map(|(name, _)| find(&dir.entries, name).ok())
            .flat_map(|n| n.chunks())
            .collect();
        let mut fetched = Fetched {
            cache: self.fetched.clone(),
            ids: Vec::new(),
        };
        // A failed fetch is not an error here: each file then fetches its own chunks,
        // and fails alone if one is damaged.
        if let Ok(got) = self.fetch(&ids) {
            fetched.ids = got.keys().copied().collect();
            self.fetched.lock().expect("fetched lock").extend(got);
        }
        fetched
    }
}

fn find<'a>(entries: &'a [TreeNode], name: &OsStr) -> io::Result<&'a TreeNode> {
    entries
        .binary_search_by(|n| n.name.as_slice().cmp(name.as_bytes()))
        .map(|i| &entries[i])
        .map_err(|_| io::Error::from(io::ErrorKind::NotFound))
}

/// Restores the tree snapshot `snap` onto the directory `dst` (see the module docs);
/// with `--include`, only those paths (relative to the snapshot's top).
pub async fn restore_tree_snapshot(
    repo: Arc<Repository>,
    snap: &snapshots::Snapshot,
    dst: &Path,
    opts: &super::RestoreOptions,
) -> anyhow::Result<TreeSummary> {
    let refused = |what: String, why: String| RepoError::Refused { what, why };
    if opts.delete
        && snap
            .manifest
            .tags
            .iter()
            .any(|t| t == super::INCOMPLETE_TAG)
    {
        return Err(refused(
            format!("--delete from snapshot {}", snap.short_id()),
            "it is incomplete (entries that could not be read were left out of it): \
             --delete would remove them from DST; restore without --delete"
                .into(),
        )
        .into());
    }
    if opts.delete && !opts.include.is_empty() {
        return Err(refused(
            "--delete with --include".into(),
            "would delete everything in DST outside the included paths; restore them \
             without --delete"
                .into(),
        )
        .into());
    }
    let index = Arc::new(repo.load_index().await?);
    let mut include = Vec::new();
    for p in &opts.include {
        let rel: PathBuf = p
            .components()
            .filter(|c| !matches!(c, Component::RootDir | Component::CurDir))
            .collect();
        if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
            return Err(refused(
                format!("--include {}", p.display()),
                "may not contain `..`".into(),
            )
            .into());
        }
        if repo
            .tree_node_at(&index, snap, rel.as_os_str().as_bytes())
            .await?
            .is_none()
        {
            return Err(refused(
                format!("--include {}", p.display()),
                format!(
                    "snapshot {} has no such path (list it with `mover snapshot ls`)",
                    snap.short_id()
                ),
            )
            .into());
        }
        include.push(rel);
    }
    let top = repo
        .tree_node_at(&index, snap, b"")
        .await?
        .ok_or_else(|| RepoError::Corrupt {
            key: format!("snapshots/{}", snap.id),
            offset: 0,
            what: "no top directory".into(),
        })?;
    let options = TreeOptions {
        delete: opts.delete,
        no_xattrs: opts.no_xattrs,
        ..TreeOptions::default()
    };
    let label = PathBuf::from(format!("snapshot {}", snap.short_id()));
    let rt = tokio::runtime::Handle::current();
    let dst = dst.to_path_buf();
    let reads = opts.reads.unwrap_or(super::restore::TREE_READS);
    let progress = Restoring(opts.progress.clone());
    let summary = tokio::task::spawn_blocking(move || {
        let source = SnapshotTree::new(repo, index, rt, label, top, include, reads);
        let _flusher = Flusher::start(&dst);
        let dest = crate::tree::Destination::prepare(&dst, None)?;
        crate::tree::copy_tree_from(
            &source,
            dest,
            &dst,
            &options,
            crate::tree::RecordUse::None,
            &progress,
        )
    })
    .await??;
    Ok(summary)
}

/// The tree engine's progress, shown as the restore it is (the engine calls its phase a
/// copy).
struct Restoring(crate::copy::SharedProgress);

impl crate::Progress for Restoring {
    fn begin(&self, _phase: &'static str, total: u64) {
        self.0.begin("restore", total)
    }
    fn update(&self, done: u64) {
        crate::Progress::update(&self.0, done)
    }
}

/// Flushes the destination's file system every [`FLUSH_EVERY`] while a restore writes,
/// from a thread of its own: left to the kernel, small files' data stays dirty until
/// the restore's final sync, which then writes gigabytes while the CPUs wait.
struct Flusher {
    /// Dropped to stop the thread at once (a restore that ends within a wait must not
    /// wait it out).
    stop: Option<std::sync::mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

impl Flusher {
    /// A flusher of the file system of `dst` (or of its parent, while DST is absent).
    fn start(dst: &Path) -> Option<Flusher> {
        let on = File::open(dst)
            .or_else(|_| match dst.parent() {
                Some(p) if !p.as_os_str().is_empty() => File::open(p),
                _ => File::open("."),
            })
            .ok()?;
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("mover-flush".into())
            .spawn(move || {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(FLUSH_EVERY)
                {
                    // Errors surface in the final sync; this one only starts early.
                    _ = rustix::fs::syncfs(&on);
                }
            })
            .ok()?;
        Some(Flusher {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            _ = t.join();
        }
    }
}
