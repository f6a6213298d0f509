//! `snapshot create` of a directory: file contents as FastCDC chunks in the same packs as
//! everything else (deduplicated against the whole repository), metadata in one tree
//! blob per directory (`snapshots::TreeNode`), written bottom-up so a directory's blob
//! names its subdirectories' blobs. An unchanged directory encodes to the same blob as
//! in the parent snapshot and is not stored again.
//!
//! Incremental: the parent snapshot's blob of each directory is read beside the
//! directory, and a file whose inode, ctime, size and mtime are those recorded there
//! (and whose chunks the repository still holds) keeps its recorded content unread;
//! an entry whose inode and ctime match keeps its recorded xattrs (any xattr change
//! moves the ctime). Directories are walked in parallel (rayon), each holding only its
//! own listing: memory follows the largest directory and the depth, not the tree.
//!
//! A file that changes while read is stored as read and counted (never a torn chunk
//! list: every chunk's id is the hash of the bytes stored), with its metadata as of the
//! open, so the next snapshot reads it again; so is a file changed after the run's start
//! (or just before: a later write in the same timestamp tick would not show), and an
//! entry whose xattrs could not be read. Entries that cannot be read are left out and
//! counted; the snapshot is then tagged `incomplete` (restore refuses `--delete` from it).

use super::create::{
    CreateOptions, PackSender, index_and_parent, produce_and_upload, save_manifest,
};
use crate::tree::{
    content::next_data,
    meta::Meta,
    source::{Listed, LocalDir, LocalSource, TreeSource},
};
use chunker::{CdcChunker, CdcParams, ChunkId};
use rayon::prelude::*;
use snapshots::{
    BlobKind, Content, FilePiece, Index, MAX_LIST_BLOB, NodeKind, PackBuilder, RepoError,
    Repository, Snapshot, SnapshotSummary, TreeNode, encode_tree, hex,
};
use std::{
    collections::{HashMap, HashSet},
    fs::File,
    io::{self, Read},
    os::unix::{ffi::OsStrExt, fs::FileExt},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
    time::Instant,
};

/// Files up to this size are read whole into memory and cut there; larger ones stream.
const READ_WHOLE: u64 = 4 << 20;
/// Tag of a snapshot that left out entries it could not read.
pub const INCOMPLETE_TAG: &str = "incomplete";

/// Takes a snapshot of the directory `dir` into `repo`; see the module docs.
pub async fn create_tree_snapshot(
    repo: Arc<Repository>,
    dir: &Path,
    opts: &CreateOptions,
) -> Result<Snapshot, RepoError> {
    let started = Instant::now();
    let root = std::fs::canonicalize(dir).map_err(|e| RepoError::Refused {
        what: format!("snapshot of {}", dir.display()),
        why: format!("cannot open the directory: {e}"),
    })?;
    let name = opts
        .name
        .clone()
        .unwrap_or_else(|| root.display().to_string());
    let (index, parent_snap) = index_and_parent(&repo, &name).await?;
    let parent = parent_snap.as_ref().map(|s| s.id.clone());
    let parent_xattrs = matches!(
        parent_snap.as_ref().map(|s| &s.manifest.content),
        Some(Content::Tree { xattrs: true, .. })
    );
    let parent_top = match &parent_snap {
        Some(s) if matches!(s.manifest.content, Content::Tree { .. }) => {
            match repo.tree_node_at(&index, s, b"").await {
                Ok(top) => top,
                Err(e) => {
                    tracing::warn!(parent = %s.id, error = %e, "cannot read the parent snapshot's tree: reading every file");
                    None
                }
            }
        }
        _ => None,
    };
    tracing::info!(volume = %name, parent = ?parent, incremental = parent_top.is_some(), "snapshot: walking the tree");

    let index = Arc::new(index);
    let ((root_id, counts), packs, bytes) = {
        let (walk_repo, index) = (repo.clone(), index.clone());
        let rt = tokio::runtime::Handle::current();
        let xattrs = !opts.no_xattrs;
        let progress = opts.progress.clone();
        progress.begin("snapshot", 0);
        produce_and_upload(&repo, opts.uploads, move |tx| {
            let mut walk = Walk::new(&walk_repo, &index, &rt, root, xattrs, parent_xattrs, tx);
            walk.progress = progress;
            walk.run(parent_top.as_ref())
        })
        .await?
    };
    let n = |a: &AtomicU64| a.load(Relaxed);
    let mut tags = opts.tags.clone();
    if n(&counts.unreadable) > 0 {
        tags.push(INCOMPLETE_TAG.into());
    }
    let summary = SnapshotSummary {
        data_chunks: n(&counts.data_chunks),
        data_bytes: n(&counts.data_bytes),
        zero_chunks: n(&counts.holes),
        new_chunks: n(&counts.new_chunks),
        new_bytes: n(&counts.new_bytes),
        stored_bytes: bytes,
        packs,
        duration_secs: started.elapsed().as_secs_f64(),
        files_read: n(&counts.files_read),
        files_unchanged: n(&counts.files_unchanged),
        changed_while_read: n(&counts.changed_while_read),
        unreadable: n(&counts.unreadable),
        ..SnapshotSummary::default()
    };
    let content = Content::Tree {
        root: hex(&root_id.0),
        files: n(&counts.files),
        dirs: n(&counts.dirs),
        bytes: n(&counts.file_bytes),
        xattrs: !opts.no_xattrs,
    };
    save_manifest(&repo, name, tags, parent, content, summary).await
}

/// What the walk counted.
#[derive(Default)]
struct Counts {
    files: AtomicU64,
    dirs: AtomicU64,
    file_bytes: AtomicU64,
    data_chunks: AtomicU64,
    data_bytes: AtomicU64,
    holes: AtomicU64,
    new_chunks: AtomicU64,
    new_bytes: AtomicU64,
    files_read: AtomicU64,
    files_unchanged: AtomicU64,
    changed_while_read: AtomicU64,
    unreadable: AtomicU64,
}

/// A multiply-linked file's content, with the ctime it was read at and how many of its
/// names are still to come.
struct LinkedContent {
    ctime: (i64, u32),
    content: Vec<FilePiece>,
    names_left: u64,
}

/// One multiply-linked inode's content, once read.
type LinkSlot = Arc<Mutex<Option<LinkedContent>>>;

/// The blocking side of a tree snapshot.
struct Walk<'a> {
    repo: &'a Repository,
    index: &'a Index,
    rt: &'a tokio::runtime::Handle,
    source: LocalSource,
    chunker: CdcChunker,
    xattrs: bool,
    /// The parent snapshot recorded xattrs (so an unchanged entry's may be taken over).
    reuse_xattrs: bool,
    /// When the walk started (Unix nanoseconds).
    started: i128,
    /// The first error that stops the walk (reported instead of "the upload stopped").
    fatal: Mutex<Option<RepoError>>,
    /// Blobs packed by this run (not in the index yet).
    seen: Mutex<HashSet<ChunkId>>,
    data: Mutex<PackBuilder>,
    trees: Mutex<PackBuilder>,
    tx: PackSender,
    /// The upload stopped (its error is the run's): the walk stops too.
    stopped: AtomicBool,
    /// Contents of multiply-linked files read so far, by (device, inode), with the ctime
    /// they were read at: their other names are not read again. A slot is locked while
    /// its inode is read, so a name met meanwhile on another thread waits for that read
    /// instead of reading the file a second time.
    links: Mutex<HashMap<(u64, u64), LinkSlot>>,
    counts: Counts,
    /// Where the bytes read are shown.
    progress: crate::copy::SharedProgress,
}

impl<'a> Walk<'a> {
    fn new(
        repo: &'a Repository,
        index: &'a Index,
        rt: &'a tokio::runtime::Handle,
        root: PathBuf,
        xattrs: bool,
        reuse_xattrs: bool,
        tx: PackSender,
    ) -> Self {
        Walk {
            repo,
            index,
            rt,
            source: LocalSource::new(root),
            chunker: CdcChunker::new(repo.chunk_key().clone(), CdcParams::default())
                .expect("default CDC parameters"),
            xattrs,
            reuse_xattrs: xattrs && reuse_xattrs,
            started: {
                let (s, ns) = snapshots::now_unix_nanos();
                s as i128 * 1_000_000_000 + ns as i128
            },
            fatal: Mutex::default(),
            seen: Mutex::default(),
            data: Mutex::default(),
            trees: Mutex::default(),
            tx,
            stopped: AtomicBool::new(false),
            links: Mutex::default(),
            counts: Counts::default(),
            progress: Default::default(),
        }
    }

    /// Walks the tree; returns the top blob's id and the counts.
    fn run(self, parent_top: Option<&TreeNode>) -> Result<(ChunkId, Counts), RepoError> {
        let root_path = self.source.root_path().to_path_buf();
        let refused = |e: io::Error| RepoError::Refused {
            what: format!("snapshot of {}", root_path.display()),
            why: format!("cannot read the directory: {e}"),
        };
        let (meta, xattrs) = self
            .source
            .stat_dir(Path::new(""), self.xattrs)
            .map_err(refused)?;
        let root = self.source.open_root().map_err(refused)?;
        let threads = std::thread::available_parallelism()
            .map_or(2, |n| n.get() * 4)
            .min(16);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .stack_size(32 << 20)
            .thread_name(|i| format!("mover-snap-{i}"))
            .build()
            .map_err(|e| refused(io::Error::other(e)))?;
        let listed = Listed {
            name: ".".into(),
            meta,
            link: Vec::new(),
            xattrs,
        };
        let subtree = pool.install(|| self.dir_blob(&root, &root_path, parent_top));
        let mut top = node_of(&listed);
        top.subtree = subtree;
        if let Some(e) = self.fatal.lock().expect("fatal lock").take() {
            return Err(e);
        }
        if self.stopped.load(Relaxed) {
            return Err(self.upload_stopped());
        }
        if top.subtree.is_none() {
            return Err(refused(io::Error::other("its listing failed")));
        }
        let top_id = self.store_tree(&[top], &root_path)?;
        for pack in [&self.data, &self.trees] {
            let pack = std::mem::take(&mut *pack.lock().expect("pack lock"));
            if !pack.is_empty() {
                self.send(pack)?;
            }
        }
        Ok((top_id, self.counts))
    }

    fn upload_stopped(&self) -> RepoError {
        RepoError::Refused {
            what: "snapshot".into(),
            why: "the upload stopped".into(),
        }
    }

    fn send(&self, pack: PackBuilder) -> Result<(), RepoError> {
        self.tx.send(self.repo.finish_pack(pack)).inspect_err(|_| {
            self.stopped.store(true, Relaxed);
        })
    }

    /// Seals and packs a blob the repository lacks; returns whether it was new.
    fn store(&self, kind: BlobKind, id: ChunkId, plain: &[u8]) -> Result<bool, RepoError> {
        if self.index.contains(&id) || !self.seen.lock().expect("seen lock").insert(id) {
            return Ok(false);
        }
        let sealed = self.repo.seal_blob(kind, &id, plain);
        let pack = if kind == BlobKind::Data {
            &self.data
        } else {
            &self.trees
        };
        let full = {
            let mut p = pack.lock().expect("pack lock");
            p.push(kind, id, &sealed);
            (p.len() >= self.repo.pack_size()).then(|| std::mem::take(&mut *p))
        };
        if let Some(p) = full {
            self.send(p)?;
        }
        Ok(true)
    }

    fn store_tree(&self, nodes: &[TreeNode], path: &Path) -> Result<ChunkId, RepoError> {
        let plain = encode_tree(nodes);
        if plain.len() as u64 > MAX_LIST_BLOB {
            return Err(RepoError::Refused {
                what: format!("snapshot of {}", path.display()),
                why: format!(
                    "its {} entries (or a file's chunk list) take {} MiB, more than one tree \
                     blob may hold ({} MiB)",
                    nodes.len(),
                    plain.len() >> 20,
                    MAX_LIST_BLOB >> 20
                ),
            });
        }
        let id = self.repo.chunk_key().chunk_id(&plain);
        // Tree blobs travel as list blobs (see snapshots::TreeNode).
        self.store(BlobKind::List, id, &plain)?;
        Ok(id)
    }

    /// Counts an entry left out and says why.
    fn unreadable(&self, path: &Path, what: &str, e: &dyn std::fmt::Display) {
        self.counts.unreadable.fetch_add(1, Relaxed);
        tracing::warn!(path = %path.display(), "{what}: {e}; left out of the snapshot");
    }

    /// The blob of the directory `dir` (at `path`), given its node in the parent
    /// snapshot; `None` if it could not be listed (or the walk stopped).
    fn dir_blob(&self, dir: &LocalDir, path: &Path, old: Option<&TreeNode>) -> Option<ChunkId> {
        if self.stopped.load(Relaxed) {
            return None;
        }
        let mut listed = match self.source.list(dir, false) {
            Ok(l) => l,
            Err(e) => {
                self.unreadable(path, "cannot list the directory", &e);
                return None;
            }
        };
        listed.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        let old_entries = old
            .and_then(|o| o.subtree.filter(|_| o.kind == NodeKind::Dir))
            .and_then(|sub| {
                self.rt
                    .block_on(self.repo.read_tree(self.index, &sub))
                    .inspect_err(|e| tracing::warn!(path = %path.display(), error = %e, "cannot read the parent snapshot's directory: reading its files"))
                    .ok()
            })
            .unwrap_or_default();
        let find = |name: &[u8]| {
            old_entries
                .binary_search_by(|n| n.name.as_slice().cmp(name))
                .ok()
                .map(|i| &old_entries[i])
        };
        let nodes: Vec<Option<TreeNode>> = listed
            .par_iter()
            .with_max_len(16)
            .map(|l| self.entry(dir, path, l, find(l.name.as_bytes())))
            .collect();
        drop(old_entries);
        let nodes: Vec<TreeNode> = nodes.into_iter().flatten().collect();
        match self.store_tree(&nodes, path) {
            Ok(id) => Some(id),
            Err(e) => {
                self.fatal.lock().expect("fatal lock").get_or_insert(e);
                self.stopped.store(true, Relaxed);
                None
            }
        }
    }

    /// The node of one entry; `None` if it vanished or could not be read.
    fn entry(
        &self,
        dir: &LocalDir,
        dir_path: &Path,
        l: &Listed,
        old: Option<&TreeNode>,
    ) -> Option<TreeNode> {
        if self.stopped.load(Relaxed) {
            return None;
        }
        let path = dir_path.join(&l.name);
        let m = &l.meta;
        let mut n = node_of(l);
        // Recorded ctimes of (0, 0) never match: they mark what must be read again.
        let same_inode = old.filter(|o| o.kind == m.kind && o.ino == m.ino && o.ctime == m.ctime);
        let gone = |e: &io::Error| e.kind() == io::ErrorKind::NotFound;
        if let Some(o) = same_inode.filter(|_| self.reuse_xattrs) {
            n.xattrs = o.xattrs.clone();
        } else if self.xattrs {
            match self.source.read_xattrs(dir, &l.name) {
                Ok(x) => {
                    n.xattrs = x
                        .into_iter()
                        .map(|(k, v)| (k.as_bytes().to_vec(), v))
                        .collect()
                }
                Err(e) if gone(&e) => return None,
                Err(e) => {
                    self.unreadable(&path, "cannot read xattrs (kept without them)", &e);
                    n.ctime = (0, 0);
                }
            }
        }
        match m.kind {
            NodeKind::Dir => {
                self.counts.dirs.fetch_add(1, Relaxed);
                let sub = match self.source.open_dir(dir, &l.name) {
                    Ok(d) => d,
                    Err(e) if gone(&e) => return None,
                    Err(e) => {
                        self.unreadable(&path, "cannot open the directory", &e);
                        return None;
                    }
                };
                n.subtree = Some(self.dir_blob(&sub, &path, old)?);
            }
            NodeKind::File => {
                let unchanged = same_inode.filter(|o| {
                    o.size == m.size
                        && o.mtime == m.mtime
                        && o.chunks().all(|c| self.index.contains(&c))
                });
                if let Some(o) = unchanged {
                    n.content = o.content.clone();
                    self.counts.files_unchanged.fetch_add(1, Relaxed);
                } else {
                    match self.file_content(dir, &path, l) {
                        Ok((content, read)) => {
                            if read.ino != m.ino {
                                // Another file was renamed over the name: what was read is
                                // recorded with its own metadata.
                                let xattrs = std::mem::take(&mut n.xattrs);
                                n = node_of(&Listed {
                                    meta: read,
                                    ..l.clone()
                                });
                                n.xattrs = xattrs;
                                n.ctime = (0, 0);
                            }
                            n.content = content;
                            if self.racy(&read) {
                                n.ctime = (0, 0);
                            }
                        }
                        Err(e) if gone(&e) => return None,
                        Err(e) => {
                            self.unreadable(&path, "cannot read the file", &e);
                            return None;
                        }
                    }
                }
                n.size = n.content.iter().map(FilePiece::len).sum();
                self.counts.files.fetch_add(1, Relaxed);
                self.counts.file_bytes.fetch_add(n.size, Relaxed);
            }
            _ => {}
        }
        Some(n)
    }

    /// Whether a file's times are too close to this run's start to tell a later write
    /// in the same timestamp tick (file times come from a clock that may lag by a tick,
    /// a few ms): recorded so the next snapshot reads it again (git's "racy clean").
    fn racy(&self, m: &Meta) -> bool {
        const MARGIN: i128 = 50_000_000;
        let ns = |(s, n): (i64, u32)| s as i128 * 1_000_000_000 + n as i128;
        ns(m.ctime) >= self.started - MARGIN || ns(m.mtime) >= self.started - MARGIN
    }

    /// Reads a file's content into chunks (new ones packed); returns them with the
    /// metadata of the file actually read. A multiply-linked file already read under
    /// another name is not read again.
    fn file_content(
        &self,
        dir: &LocalDir,
        path: &Path,
        l: &Listed,
    ) -> io::Result<(Vec<FilePiece>, Meta)> {
        let m = &l.meta;
        let link_key = (m.dev, m.ino);
        let slot = (m.nlink > 1).then(|| {
            let mut links = self.links.lock().expect("links lock");
            links.entry(link_key).or_default().clone()
        });
        let mut linked = slot.as_ref().map(|s| s.lock().expect("link slot lock"));
        if let Some(Some(seen)) = linked.as_deref_mut()
            && seen.ctime == m.ctime
        {
            let content = seen.content.clone();
            // Forgotten once its last name is met: memory follows the links open.
            seen.names_left = seen.names_left.saturating_sub(1);
            if seen.names_left == 0 {
                self.links.lock().expect("links lock").remove(&link_key);
            }
            return Ok((content, *m));
        }
        let f = self.source.open_file(dir, &l.name)?;
        let read = self.source.stat(&f)?;
        if read.kind != NodeKind::File {
            // Replaced by something else since the listing: the next snapshot sees it.
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        self.counts.files_read.fetch_add(1, Relaxed);
        let pieces = self.read_pieces(&f, &read)?;
        let after = self.source.stat(&f)?;
        if read.content_changed(&after) {
            self.counts.changed_while_read.fetch_add(1, Relaxed);
            tracing::warn!(file = %path.display(), "changed while read: stored as read, read again by the next snapshot");
        }
        if let Some(linked) = linked.as_deref_mut()
            && read.nlink > 1
            && read.ino == m.ino
        {
            *linked = Some(LinkedContent {
                ctime: m.ctime,
                content: pieces.clone(),
                names_left: read.nlink - 1,
            });
        }
        Ok((pieces, read))
    }

    /// The content of `f` (listed as `m`) as chunks and holes, up to the listed size or
    /// the end of what can be read.
    fn read_pieces(&self, f: &File, m: &Meta) -> io::Result<Vec<FilePiece>> {
        let mut pieces = Vec::new();
        let mut pos = 0;
        let sparse = m.allocated < m.size;
        while pos < m.size {
            let (start, stop) = if sparse {
                match next_data(f, pos, m.size)? {
                    Some(r) => r,
                    None => break,
                }
            } else {
                (pos, m.size)
            };
            if start > pos {
                pieces.push(FilePiece::Hole(start - pos));
                self.counts.holes.fetch_add(1, Relaxed);
            }
            let read = self.chunk_range(f, start, stop - start, &mut pieces)?;
            pos = start + read;
            if read < stop - start {
                return Ok(pieces); // the file shrank while read
            }
        }
        if pos < m.size && sparse {
            pieces.push(FilePiece::Hole(m.size - pos));
            self.counts.holes.fetch_add(1, Relaxed);
        }
        Ok(pieces)
    }

    /// Cuts `len` bytes of `f` at `at` into chunks, packing new ones; returns the bytes
    /// read (fewer if the file ended early).
    fn chunk_range(
        &self,
        f: &File,
        at: u64,
        len: u64,
        pieces: &mut Vec<FilePiece>,
    ) -> io::Result<u64> {
        let mut add = |id: ChunkId, data: &[u8]| -> io::Result<()> {
            self.counts.data_chunks.fetch_add(1, Relaxed);
            self.counts.data_bytes.fetch_add(data.len() as u64, Relaxed);
            self.progress.add(data.len() as u64);
            if self
                .store(BlobKind::Data, id, data)
                .map_err(io::Error::other)?
            {
                self.counts.new_chunks.fetch_add(1, Relaxed);
                self.counts.new_bytes.fetch_add(data.len() as u64, Relaxed);
            }
            pieces.push(FilePiece::Data {
                id,
                len: data.len() as u32,
            });
            Ok(())
        };
        if len <= READ_WHOLE {
            let mut buf = vec![0u8; len as usize];
            let mut got = 0;
            while got < buf.len() {
                match f.read_at(&mut buf[got..], at + got as u64) {
                    Ok(0) => break,
                    Ok(n) => got += n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            buf.truncate(got);
            for c in self.chunker.chunk_slice(&buf) {
                add(c.id, &buf[c.offset as usize..c.offset as usize + c.len])?;
            }
            return Ok(got as u64);
        }
        let reader = ReadAt { f, at }.take(len);
        let mut read = 0;
        for item in self
            .chunker
            .chunk_stream(std::io::BufReader::with_capacity(1 << 20, reader))
        {
            let (c, data) = item?;
            read += data.len() as u64;
            add(c.id, &data)?;
        }
        Ok(read)
    }
}

/// Sequential reads of a file from an offset, with `pread` (the descriptor's own offset
/// is left alone).
struct ReadAt<'f> {
    f: &'f File,
    at: u64,
}

impl Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.f.read_at(buf, self.at)?;
        self.at += n as u64;
        Ok(n)
    }
}

/// A tree node with the listed metadata (content, xattrs and subtree to be filled).
fn node_of(l: &Listed) -> TreeNode {
    let m = &l.meta;
    let mut n = TreeNode::new(l.name.as_bytes().to_vec(), m.kind);
    n.mode = m.mode;
    n.uid = m.uid;
    n.gid = m.gid;
    n.mtime = m.mtime;
    n.ctime = m.ctime;
    n.dev = m.dev;
    n.ino = m.ino;
    n.nlink = m.nlink;
    n.size = if m.kind == NodeKind::File { m.size } else { 0 };
    n.rdev = m.rdev;
    n.link = l.link.clone();
    n.xattrs = l
        .xattrs
        .iter()
        .map(|(k, v)| (k.as_bytes().to_vec(), v.clone()))
        .collect();
    n
}
