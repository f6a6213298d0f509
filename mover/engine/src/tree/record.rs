//! The record of a replica: what the last `--replica` run left in the destination tree.
//!
//! A rerun onto a replica normally looks at every destination entry, which on a cold
//! cache costs as much kernel work as looking at the source. With `--replica` the
//! destination is declared to be written only by mover, and each run saves, in the
//! state directory, the source metadata it made every destination entry equal to. The
//! next run compares the source with that record, and looks in the destination only at
//! the entries whose source changed.
//!
//! What keeps the record honest:
//! - **Source changes** show in the entry's inode and ctime: any write, chmod, chown,
//!   xattr change or rename gives a new ctime, which cannot be set back from user space.
//!   A multiply-linked file is always looked at (its other names can change unseen).
//! - **Names added, removed or renamed in the destination** change their directory's
//!   ctime. Each directory's (inode, ctime) is sealed into the record right after the
//!   run's last change to it (its own metadata, or a hard link made at the end), and a
//!   directory that no longer matches is listed and compared in full. A directory the
//!   run did not seal is not recorded.
//! - **Other mover runs** onto the destination only ever make an entry equal to its
//!   source. Their content writes go through a rename, so they break the directory's
//!   seal; a metadata-only change leaves the entry's old record, which the source no
//!   longer matches or which is still right. A local run without `--replica` (with the
//!   same state directory), or from another source, or with other flags, forgets or
//!   ignores the record. An agent writing into the same directory does not know of it:
//!   a local replica is written by local runs only.
//! - **Damage:** the table and header are checksummed, and so is each directory's part
//!   before it is used. A run with any error saves no record, and the last good one
//!   stays (it is still true: see above).
//!
//! What it cannot see, and the `--replica` help says so: a destination file changed in
//! place (written, truncated, chmod-ed) by someone else. A run without `--replica`
//! checks every entry again. Destinations whose directory ctimes are not trustworthy
//! (network filesystems with attribute caches) should not be replicas.
//!
//! File layout (version 1): a header (magic, flags, the source path), each directory's
//! entries, a table of directories sorted by the hash of their path (where the entries
//! are, their checksum, the seal), and a fixed trailer (where the table is, how many
//! rows, the destination's device, the BLAKE3 of header, table and trailer, magic).
//! Memory: the table (64 bytes a directory) and the directories in progress.

use super::meta::{Entries, Meta, NodeKind};
use std::{
    collections::HashMap,
    ffi::{OsStr, OsString},
    fs::{self, File},
    io::{self, Write},
    os::{
        fd::BorrowedFd,
        unix::{ffi::OsStringExt, fs::FileExt},
    },
    path::{Path, PathBuf},
    sync::Mutex,
};

const MAGIC: &[u8; 8] = b"MVTREE01";
const ROW_LEN: usize = 64;
/// table offset, rows, device (3 × 8), checksum (32), magic (8).
const TRAILER_LEN: usize = 24 + 32 + 8;
/// One entry without its name: name length (2), kind (1), 4 × u64, 2 × (i64, u32), 3 × u32.
const ENTRY_LEN: usize = 2 + 1 + 32 + 24 + 12;

/// Where the record of the replica at the absolute path `dst` lives in the state
/// directory.
pub(crate) fn record_path(state_dir: &Path, dst: &Path) -> PathBuf {
    crate::copy::index::state_file(state_dir, "trees", dst, "record")
}

/// Removes the record of a destination that a run not using it is about to change.
pub(crate) fn forget(path: &Path) {
    match fs::remove_file(path) {
        Ok(()) => tracing::info!(record = %path.display(), "replica record dropped"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(record = %path.display(), "cannot drop the replica record: {e}"),
    }
}

/// What the record was made with: a copy without xattrs says nothing about them, and
/// one without --delete leaves entries in DST that it does not record.
pub(crate) fn flags(xattrs: bool, owners: bool, delete: bool) -> u64 {
    u64::from(xattrs) | (u64::from(owners) << 1) | (u64::from(delete) * DELETE)
}

const DELETE: u64 = 1 << 2;

/// Whether a record made with `saved` flags serves a run with `run` flags: the same
/// xattrs and owners, and a run with --delete needs a record made with it (a record made
/// with it serves a run without).
fn flags_serve(saved: u64, run: u64) -> bool {
    saved & !DELETE == run & !DELETE && (saved & DELETE != 0 || run & DELETE == 0)
}

/// The first 16 bytes of the BLAKE3 of `bytes`: directory keys and checksums.
fn hash16(bytes: &[u8]) -> [u8; 16] {
    blake3::hash(bytes).as_bytes()[..16]
        .try_into()
        .expect("16 bytes")
}

fn dir_key(rel: &Path) -> [u8; 16] {
    hash16(rel.as_os_str().as_encoded_bytes())
}

/// A directory's (inode, ctime): changes with any name added, removed or renamed in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Seal {
    ino: u64,
    ctime: (i64, u32),
}

impl Seal {
    fn of(m: &Meta) -> Seal {
        Seal {
            ino: m.ino,
            ctime: m.ctime,
        }
    }
}

/// One directory in the table.
#[derive(Clone, Copy, Debug)]
struct Row {
    key: [u8; 16],
    offset: u64,
    len: u32,
    checksum: [u8; 16],
    seal: Seal,
}

impl Row {
    fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.key);
        out.extend_from_slice(&self.offset.to_le_bytes());
        out.extend_from_slice(&self.len.to_le_bytes());
        out.extend_from_slice(&self.checksum);
        out.extend_from_slice(&self.seal.ino.to_le_bytes());
        out.extend_from_slice(&self.seal.ctime.0.to_le_bytes());
        out.extend_from_slice(&self.seal.ctime.1.to_le_bytes());
    }

    fn decode(b: &[u8]) -> Row {
        let mut r = Reader(b);
        Row {
            key: r.bytes(16).try_into().expect("16 bytes"),
            offset: r.u64(),
            len: r.u32(),
            checksum: r.bytes(16).try_into().expect("16 bytes"),
            seal: Seal {
                ino: r.u64(),
                ctime: (r.i64(), r.u32()),
            },
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        head
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes(8).try_into().expect("8 bytes"))
    }
    fn i64(&mut self) -> i64 {
        self.u64() as i64
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes(4).try_into().expect("4 bytes"))
    }
}

fn encode_entry(name: &OsStr, m: &Meta, out: &mut Vec<u8>) {
    let name = name.as_encoded_bytes();
    out.extend_from_slice(&(name.len() as u16).to_le_bytes());
    out.extend_from_slice(name);
    out.push(m.kind.code());
    for w in [m.ino, m.size, m.rdev, m.nlink] {
        out.extend_from_slice(&w.to_le_bytes());
    }
    for (s, ns) in [m.mtime, m.ctime] {
        out.extend_from_slice(&s.to_le_bytes());
        out.extend_from_slice(&ns.to_le_bytes());
    }
    for w in [m.mode, m.uid, m.gid] {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// Parses a directory's entries; `None` if they are malformed.
fn decode_entries(mut b: &[u8]) -> Option<Entries> {
    let mut out = Vec::new();
    while !b.is_empty() {
        let name_len = u16::from_le_bytes(b.get(..2)?.try_into().ok()?) as usize;
        if b.len() < ENTRY_LEN + name_len {
            return None;
        }
        let mut r = Reader(&b[2..ENTRY_LEN + name_len]);
        let name = OsString::from_vec(r.bytes(name_len).to_vec());
        let kind = NodeKind::from_code(r.bytes(1)[0])?;
        let (ino, size, rdev, nlink) = (r.u64(), r.u64(), r.u64(), r.u64());
        let (mtime, ctime) = ((r.i64(), r.u32()), (r.i64(), r.u32()));
        let (mode, uid, gid) = (r.u32(), r.u32(), r.u32());
        out.push((
            name,
            Meta {
                kind,
                mode,
                uid,
                gid,
                size,
                // Not recorded: only what `unchanged` compares, and the kind, is.
                allocated: 0,
                mtime,
                ctime,
                rdev,
                dev: 0,
                ino,
                nlink,
            },
        ));
        b = &b[ENTRY_LEN + name_len..];
    }
    // Written sorted; sorting again costs little when they are.
    Some(Entries::sorted(out))
}

/// Whether a source entry is exactly as recorded, so its destination copy (which the
/// record says was made equal to it) needs no look. Directories are always walked, and
/// a multiply-linked file is always looked at.
pub(crate) fn unchanged(recorded: &Meta, now: &Meta) -> bool {
    now.kind != NodeKind::Dir
        && now.nlink == 1
        && recorded.kind == now.kind
        && recorded.ino == now.ino
        && recorded.ctime == now.ctime
        && recorded.mtime == now.mtime
        && recorded.size == now.size
        && recorded.mode == now.mode
        && (recorded.uid, recorded.gid) == (now.uid, now.gid)
        && recorded.rdev == now.rdev
        && recorded.nlink == now.nlink
}

fn header(src: &Path, flags: u64) -> Vec<u8> {
    let src = src.as_os_str().as_encoded_bytes();
    let mut h = Vec::with_capacity(20 + src.len());
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&flags.to_le_bytes());
    h.extend_from_slice(&(src.len() as u32).to_le_bytes());
    h.extend_from_slice(src);
    h
}

/// A saved record, opened for a run that uses it.
pub(crate) struct Record {
    file: File,
    path: PathBuf,
    /// Sorted by key.
    rows: Vec<Row>,
}

impl Record {
    /// Opens the record at `path` if it is intact, was made from `src` with `flags`, and
    /// the destination root (open as `dst_root`) is as the record left it; `None`
    /// otherwise (then every destination entry is looked at).
    pub(crate) fn open(
        path: &Path,
        src: &Path,
        flags: u64,
        dst_root: BorrowedFd<'_>,
    ) -> Option<Record> {
        let record = Record::read(path, src, flags, dst_root);
        if record.is_none() && path.exists() {
            tracing::info!(
                record = %path.display(),
                "the replica record does not match the destination; looking at every entry"
            );
        }
        record
    }

    fn read(path: &Path, src: &Path, flags: u64, dst_root: BorrowedFd<'_>) -> Option<Record> {
        let file = File::open(path).ok()?;
        // The rows are read one directory at a time, in the walk's order, not the file's:
        // from a cold cache that was a small read waiting on the disk per directory. The
        // whole record is read ahead at once instead.
        let _ = rustix::fs::fadvise(&file, 0, None, rustix::fs::Advice::WillNeed);
        let len = file.metadata().ok()?.len();
        let want = header(src, flags);
        if len < (want.len() + TRAILER_LEN) as u64 {
            return None;
        }
        let mut head = vec![0u8; want.len()];
        file.read_exact_at(&mut head, 0).ok()?;
        let saved = u64::from_le_bytes(head[8..16].try_into().expect("8 bytes"));
        let mut trailer = [0u8; TRAILER_LEN];
        file.read_exact_at(&mut trailer, len - TRAILER_LEN as u64)
            .ok()?;
        let mut t = Reader(&trailer);
        let (table_at, rows, dev) = (t.u64(), t.u64(), t.u64());
        let (checksum, magic) = (t.bytes(32), t.bytes(8));
        let root = Meta::of_fd(dst_root).ok()?;
        let table_len = rows.checked_mul(ROW_LEN as u64)?;
        // Magic, flags, then the source path: the same source, and flags that serve.
        if head[..8] != want[..8]
            || head[16..] != want[16..]
            || !flags_serve(saved, flags)
            || magic != MAGIC
            || dev != root.dev
            || table_at
                .checked_add(table_len)?
                .checked_add(TRAILER_LEN as u64)?
                != len
        {
            return None;
        }
        let mut table = vec![0u8; table_len as usize];
        file.read_exact_at(&mut table, table_at).ok()?;
        let mut hasher = blake3::Hasher::new();
        hasher.update(&head);
        hasher.update(&table);
        hasher.update(&trailer[..24]);
        if hasher.finalize().as_bytes() != checksum {
            tracing::warn!(record = %path.display(), "the replica record is damaged; looking at every entry");
            return None;
        }
        let rows: Vec<Row> = table.chunks(ROW_LEN).map(Row::decode).collect();
        let record = Record {
            file,
            path: path.to_path_buf(),
            rows,
        };
        // A destination root that changed is not the one the record describes.
        record.row(Path::new(""), &root)?;
        Some(record)
    }

    fn row(&self, rel: &Path, dst_dir: &Meta) -> Option<Row> {
        let key = dir_key(rel);
        let i = self.rows.binary_search_by(|r| r.key.cmp(&key)).ok()?;
        let row = self.rows[i];
        (row.seal == Seal::of(dst_dir)).then_some(row)
    }

    /// The recorded entries of the directory `rel`, if the destination directory (open as
    /// `dst_dir`) still has the names it had when recorded.
    pub(crate) fn entries(&self, rel: &Path, dst_dir: BorrowedFd<'_>) -> Option<Entries> {
        let row = self.row(rel, &Meta::of_fd(dst_dir).ok()?)?;
        let mut buf = vec![0u8; row.len as usize];
        self.file.read_exact_at(&mut buf, row.offset).ok()?;
        let entries = (hash16(&buf) == row.checksum)
            .then(|| decode_entries(&buf))
            .flatten();
        if entries.is_none() {
            tracing::warn!(record = %self.path.display(), dir = %rel.display(), "damaged replica record entries; looking at the directory");
        }
        entries
    }
}

/// Bytes of a new record gathered before they are written.
const RECORD_BUFFER: usize = 1 << 20;

/// A new record, written as a run goes; saved by [`RecordWriter::commit`] only.
pub(crate) struct RecordWriter {
    header: Vec<u8>,
    tmp: PathBuf,
    path: PathBuf,
    out: Mutex<Out>,
}

struct Out {
    /// Buffered: one small write per directory was a syscall per directory.
    file: io::BufWriter<File>,
    at: u64,
    /// Each directory written, by its path relative to the root.
    dirs: Vec<(PathBuf, Row)>,
    /// Each directory's state after the run's last change to it.
    seals: HashMap<PathBuf, Seal>,
    /// The first write error: the record is then not saved.
    failed: Option<io::Error>,
}

impl RecordWriter {
    /// Starts a new record beside `path` (the old one stays until this one is saved).
    pub(crate) fn create(path: &Path, src: &Path, flags: u64) -> io::Result<RecordWriter> {
        fs::create_dir_all(path.parent().expect("record paths have a parent"))?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let mut file = File::create(&tmp)?;
        let header = header(src, flags);
        file.write_all(&header)?;
        Ok(RecordWriter {
            out: Mutex::new(Out {
                file: io::BufWriter::with_capacity(RECORD_BUFFER, file),
                at: header.len() as u64,
                dirs: Vec::new(),
                seals: HashMap::new(),
                failed: None,
            }),
            header,
            tmp,
            path: path.to_path_buf(),
        })
    }

    /// Records what the destination directory `rel` now holds: each name (in name order)
    /// with the source metadata its entry was made equal to.
    pub(crate) fn add_dir<'n>(
        &self,
        rel: &Path,
        entries: impl ExactSizeIterator<Item = (&'n OsStr, &'n Meta)>,
    ) {
        let mut buf = Vec::with_capacity(entries.len() * (ENTRY_LEN + 16));
        for (name, m) in entries {
            encode_entry(name, m, &mut buf);
        }
        let mut out = self.out.lock().expect("record lock");
        if out.failed.is_some() {
            return;
        }
        let at = out.at;
        if let Err(e) = out.file.write_all(&buf) {
            out.failed = Some(e);
            return;
        }
        out.at += buf.len() as u64;
        let row = Row {
            key: dir_key(rel),
            offset: at,
            len: buf.len() as u32,
            checksum: hash16(&buf),
            seal: Seal {
                ino: 0,
                ctime: (0, 0),
            },
        };
        out.dirs.push((rel.to_path_buf(), row));
    }

    /// Seals the destination directory `rel` with its state `dst_dir`, taken right after
    /// the run's last change to it: a later change by anyone breaks the seal.
    pub(crate) fn seal(&self, rel: &Path, dst_dir: &Meta) {
        let mut out = self.out.lock().expect("record lock");
        out.seals.insert(rel.to_path_buf(), Seal::of(dst_dir));
    }

    /// Saves the record durably in place of the old one, with the directories the run
    /// sealed (the others are listed by the next run), for the destination now at
    /// `dst_root`.
    pub(crate) fn commit(mut self, dst_root: &Path) -> io::Result<()> {
        let out = self.out.get_mut().expect("record lock");
        if let Some(e) = out.failed.take() {
            return Err(e);
        }
        let root = Meta::from_stat(&rustix::fs::lstat(dst_root)?);
        let mut rows = Vec::with_capacity(out.dirs.len());
        for (rel, mut row) in out.dirs.drain(..) {
            if let Some(seal) = out.seals.get(&rel) {
                row.seal = *seal;
                rows.push(row);
            }
        }
        rows.sort_unstable_by_key(|r| r.key);
        let mut tail = Vec::with_capacity(rows.len() * ROW_LEN + TRAILER_LEN);
        for r in &rows {
            r.encode(&mut tail);
        }
        for w in [out.at, rows.len() as u64, root.dev] {
            tail.extend_from_slice(&w.to_le_bytes());
        }
        let mut hasher = blake3::Hasher::new();
        hasher.update(&self.header);
        hasher.update(&tail);
        tail.extend_from_slice(hasher.finalize().as_bytes());
        tail.extend_from_slice(MAGIC);
        out.file.write_all(&tail)?;
        out.file.flush()?;
        chunker::durable::publish(out.file.get_ref(), &self.tmp, &self.path)
    }
}

impl Drop for RecordWriter {
    fn drop(&mut self) {
        // Not committed (or committed: then the temp name is gone already).
        _ = fs::remove_file(&self.tmp);
    }
}
