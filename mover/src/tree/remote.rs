//! File trees across the network: the side that writes walks both trees (the same walk
//! as a local copy) and asks the other side, its source, for listings and file contents
//! over one bidirectional gRPC stream of calls and answers.
//!
//! - [`RemoteSource`]: a [`TreeSource`] whose every question is a call on the stream.
//!   The walk's threads block on their own calls; one task routes answers back by id.
//! - [`Served`]: answers calls from a local directory, never reaching outside it
//!   (`openat2` with `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`).
//!
//! In a push the agent walks and the client serves; in a pull, the other way round.

use super::{
    TreeOptions,
    content::{self, Written},
    meta::{self, Kind, Meta, Xattrs},
    source::{Listed, TreeSource, list_entries},
};
use rustix::fs::{Mode, OFlags, ResolveFlags};
use std::{
    collections::HashMap,
    ffi::{OsStr, OsString},
    fs::File,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
        unix::ffi::{OsStrExt, OsStringExt},
        unix::fs::FileExt,
    },
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;
use tonic::codegen::Bytes;
use transport::{
    RateLimiter,
    frames::{self, Content},
    proto::{self, tree_answer::Answer, tree_call::Op},
};

/// File data asked for in one call: large enough to amortise a round trip, small
/// enough to stay far below the message limit.
const RANGE: u64 = 4 << 20;
/// Bytes of entries per part of a listing (names, link targets and xattrs can be long).
const LIST_PART_BYTES: usize = 1 << 20;
/// File data one batch call may ask for (the walking side asks for 4 MiB at most).
const BATCH_MAX: u64 = 8 << 20;
/// Calls one side answers at once.
const SERVE_PARALLEL: usize = 32;

/// The copy's rules as the open message carries them.
pub(crate) fn open_of(
    volume: &str,
    relationship: String,
    epoch: u64,
    bwlimit: Option<u64>,
    o: &TreeOptions,
) -> proto::TreeOpen {
    proto::TreeOpen {
        volume: volume.to_string(),
        relationship,
        epoch,
        delete: o.delete,
        checksum: o.checksum,
        no_xattrs: o.no_xattrs,
        verify: o.verify,
        threads: o.tree_threads.unwrap_or(0) as u32,
        bwlimit: bwlimit.unwrap_or(0),
        cycle: None,
    }
}

/// The copy's rules from an open message.
pub(crate) fn options_of(open: &proto::TreeOpen) -> TreeOptions {
    TreeOptions {
        delete: open.delete,
        checksum: open.checksum,
        no_xattrs: open.no_xattrs,
        verify: open.verify,
        tree_threads: (open.threads > 0).then_some((open.threads as usize).min(64)),
        replica: false,
        state_dir: None,
    }
}

// ---- Entries on the wire ----------------------------------------------------------------

fn entry_of(name: &[u8], m: &Meta, link: &[u8], xattrs: &Xattrs) -> proto::Entry {
    proto::Entry {
        name: Bytes::copy_from_slice(name),
        kind: m.kind.code(),
        mode: m.mode,
        uid: m.uid,
        gid: m.gid,
        size: m.size,
        allocated: m.allocated,
        mtime_sec: m.mtime.0,
        mtime_nsec: m.mtime.1,
        ctime_sec: m.ctime.0,
        ctime_nsec: m.ctime.1,
        rdev: m.rdev,
        dev: m.dev,
        ino: m.ino,
        nlink: m.nlink,
        link: Bytes::copy_from_slice(link),
        xattrs: xattrs
            .iter()
            .map(|(n, v)| proto::Xattr {
                name: Bytes::copy_from_slice(n.as_bytes()),
                value: Bytes::copy_from_slice(v),
            })
            .collect(),
    }
}

fn meta_of(e: &proto::Entry) -> io::Result<Meta> {
    Ok(Meta {
        kind: Kind::from_code(e.kind)
            .ok_or_else(|| bad_answer(format!("unknown entry kind {}", e.kind)))?,
        mode: e.mode & 0o7777,
        uid: e.uid,
        gid: e.gid,
        size: e.size,
        allocated: e.allocated,
        mtime: (e.mtime_sec, e.mtime_nsec),
        ctime: (e.ctime_sec, e.ctime_nsec),
        rdev: e.rdev,
        dev: e.dev,
        ino: e.ino,
        nlink: e.nlink,
    })
}

fn xattrs_of(e: &proto::Entry) -> Xattrs {
    e.xattrs
        .iter()
        .map(|x| (OsString::from_vec(x.name.to_vec()), x.value.to_vec()))
        .collect()
}

/// A listed entry from the wire. Its name is one path component, or it is refused: the
/// walk makes every name inside the destination directory it is listing.
fn listed_of(e: &proto::Entry) -> io::Result<Listed> {
    let name = &e.name[..];
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        return Err(bad_answer(format!(
            "the source listed an entry named {:?}, which is not a file name",
            String::from_utf8_lossy(name)
        )));
    }
    Ok(Listed {
        name: OsString::from_vec(name.to_vec()),
        meta: meta_of(e)?,
        link: e.link.to_vec(),
        xattrs: xattrs_of(e),
    })
}

fn bad_answer(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

fn source_error(e: &io::Error) -> proto::SourceError {
    proto::SourceError {
        errno: e.raw_os_error().unwrap_or(0),
        message: e.to_string(),
        eof: e.kind() == io::ErrorKind::UnexpectedEof,
    }
}

fn error_answer(e: &io::Error) -> Answer {
    Answer::Error(source_error(e))
}

fn io_error_of(e: proto::SourceError) -> io::Error {
    if e.eof {
        return io::Error::new(io::ErrorKind::UnexpectedEof, e.message);
    }
    let kind = match e.errno {
        0 => io::ErrorKind::Other,
        n => io::Error::from_raw_os_error(n).kind(),
    };
    io::Error::new(kind, format!("on the source: {}", e.message))
}

fn rel_bytes(rel: &Path) -> Bytes {
    Bytes::copy_from_slice(rel.as_os_str().as_bytes())
}

// ---- The source side --------------------------------------------------------------------

/// A local directory answering a peer's calls.
pub(crate) struct Served {
    root: OwnedFd,
    /// Bytes of file data sent (for progress; may be shared with other attempts).
    pub sent: Arc<AtomicU64>,
    /// At most this many bytes of file data per second.
    limit: Option<RateLimiter>,
}

impl Served {
    /// Serves the tree at `path`, sending at most `bwlimit` bytes of file data per
    /// second if given.
    pub(crate) fn open(path: &Path, bwlimit: Option<u64>) -> io::Result<Served> {
        Ok(Served {
            root: meta::open_dir_at(rustix::fs::CWD, path.as_os_str())?,
            sent: Arc::default(),
            limit: bwlimit.filter(|&r| r > 0).map(RateLimiter::new),
        })
    }

    /// Opens `rel` (relative to the root) without leaving the tree or following a
    /// symlink anywhere on the way.
    fn open_rel(&self, rel: &[u8], dir: bool) -> io::Result<OwnedFd> {
        let rel: &OsStr = if rel.is_empty() {
            OsStr::new(".")
        } else {
            OsStr::from_bytes(rel)
        };
        let mut flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        if dir {
            flags |= OFlags::DIRECTORY;
        }
        let resolve =
            ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
        let open = |flags| rustix::fs::openat2(&self.root, rel, flags, Mode::empty(), resolve);
        // Files are read without an access-time update, where the kernel lets us (the
        // owner or root): serving a copy is not a use.
        if dir {
            return Ok(open(flags)?);
        }
        match open(flags | OFlags::NOATIME) {
            Err(rustix::io::Errno::PERM) => Ok(open(flags)?),
            other => Ok(other?),
        }
    }

    /// The answers to one call: one, or several parts of a large listing.
    pub(crate) fn answer(&self, call: proto::TreeCall) -> Vec<proto::TreeAnswer> {
        let id = call.id;
        let answers = match self.answer_op(call) {
            Ok(answers) => answers,
            Err(e) => vec![error_answer(&e)],
        };
        answers
            .into_iter()
            .map(|answer| proto::TreeAnswer {
                id,
                answer: Some(answer),
            })
            .collect()
    }

    fn answer_op(&self, call: proto::TreeCall) -> io::Result<Vec<Answer>> {
        let xattrs = call.xattrs;
        match call.op {
            Some(Op::List(rel)) => self.list(&rel, xattrs),
            Some(Op::Stat(rel)) => {
                let dir = self.open_rel(&rel, true)?;
                let m = Meta::of_fd(dir.as_fd())?;
                let x = if xattrs {
                    meta::read_xattrs(&fd_path(dir.as_fd()).join("."))?
                } else {
                    Xattrs::new()
                };
                Ok(vec![Answer::Entry(entry_of(b"", &m, b"", &x))])
            }
            Some(Op::Read(r)) => Ok(vec![Answer::Data(self.read(&r)?)]),
            Some(Op::ReadFiles(batch)) => {
                let asked: u64 = batch.files.iter().map(|r| r.len.min(RANGE)).sum();
                if asked > BATCH_MAX {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("a batch of {asked} bytes is more than {BATCH_MAX}"),
                    ));
                }
                let files = batch
                    .files
                    .iter()
                    .map(|r| proto::FileOrError {
                        result: Some(match self.read(r) {
                            Ok(data) => proto::file_or_error::Result::Data(data),
                            Err(e) => proto::file_or_error::Result::Error(source_error(&e)),
                        }),
                    })
                    .collect();
                Ok(vec![Answer::Files(proto::FileBatchData { files })])
            }
            Some(Op::Chunks(rel)) => Ok(vec![Answer::Chunks(self.chunks(&rel)?)]),
            Some(Op::Hash(rel)) => {
                let file: File = self.open_rel(&rel, false)?.into();
                let hash = content::hash_file(&file)?;
                Ok(vec![Answer::Hash(proto::FileHash {
                    hash: Bytes::copy_from_slice(hash.as_bytes()),
                    after: Some(after(&file)?),
                })])
            }
            Some(Op::Open(_) | Op::Done(_)) | None => Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a call a source answers",
            )),
        }
    }

    fn list(&self, rel: &[u8], xattrs: bool) -> io::Result<Vec<Answer>> {
        let dir = self.open_rel(rel, true)?;
        // xattr calls go by path: through this descriptor, so they stay in the tree.
        let listed = list_entries(dir.as_fd(), &fd_path(dir.as_fd()), xattrs)?;
        let mut parts = Vec::new();
        let (mut part, mut bytes) = (Vec::new(), 0);
        for l in &listed {
            let entry = entry_of(l.name.as_bytes(), &l.meta, &l.link, &l.xattrs);
            bytes += prost::Message::encoded_len(&entry);
            part.push(entry);
            if bytes >= LIST_PART_BYTES {
                parts.push(std::mem::take(&mut part));
                bytes = 0;
            }
        }
        parts.push(part);
        let last = parts.len() - 1;
        Ok(parts
            .into_iter()
            .enumerate()
            .map(|(i, entries)| {
                Answer::Entries(proto::Entries {
                    entries,
                    more: i < last,
                })
            })
            .collect())
    }

    /// The bytes of a file range that are not holes, compressed where it pays.
    fn read(&self, r: &proto::FileRange) -> io::Result<proto::FileData> {
        let file: File = self.open_rel(&r.path, false)?.into();
        let before = Meta::of_fd(file.as_fd())?;
        if before.kind != Kind::File {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file",
            ));
        }
        let end = r.offset.saturating_add(r.len.min(RANGE));
        let mut frames = Vec::new();
        let mut pos = r.offset;
        while pos < end.min(before.size) {
            let Some((data, hole)) = content::next_data(&file, pos, end)? else {
                break;
            };
            let mut buf = vec![0u8; (hole - data) as usize];
            let mut got = 0;
            while got < buf.len() {
                match file.read_at(&mut buf[got..], data + got as u64)? {
                    0 => break,
                    n => got += n,
                }
            }
            buf.truncate(got);
            if !buf.is_empty() {
                frames.push(frames::frame_of(data, Bytes::from(buf), true));
            }
            if data + (got as u64) < hole {
                break; // it shrank
            }
            pos = hole;
        }
        let after = Meta::of_fd(file.as_fd())?;
        Ok(proto::FileData {
            frames,
            eof: after.size < end,
            after: Some(meta_entry(&after)),
        })
    }

    fn chunks(&self, rel: &[u8]) -> io::Result<proto::FileChunks> {
        let file: File = self.open_rel(rel, false)?.into();
        let mut chunks = Vec::new();
        let reader = io::BufReader::with_capacity(1 << 20, &file);
        for item in content::tree_chunker().chunk_stream(reader) {
            let (chunk, data) = item?;
            chunks.push(proto::FileChunk {
                offset: chunk.offset,
                len: chunk.len as u32,
                id: Bytes::copy_from_slice(&chunk.id.0),
                zero: chunker::is_zero(&data),
            });
        }
        Ok(proto::FileChunks {
            chunks,
            after: Some(after(&file)?),
        })
    }
}

/// An open file's metadata now, for an answer.
fn after(file: &File) -> io::Result<proto::Entry> {
    Ok(meta_entry(&Meta::of_fd(file.as_fd())?))
}

/// Metadata alone (no name, link or xattrs), for an answer.
fn meta_entry(m: &Meta) -> proto::Entry {
    entry_of(b"", m, b"", &Xattrs::new())
}

/// A path that reaches the open `fd` (for calls that only take paths).
fn fd_path(fd: BorrowedFd<'_>) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Answers the calls arriving on `calls` from `served`, several at once, until the
/// stream ends (`Ok(None)`) or the walking side says it is done (`Ok(Some(summary))`).
pub(crate) async fn serve_calls(
    served: Arc<Served>,
    mut calls: impl Stream<Item = Result<proto::TreeCall, Status>> + Unpin,
    answers: mpsc::Sender<proto::TreeAnswer>,
) -> Result<Option<Bytes>, Status> {
    let limit = Arc::new(Semaphore::new(SERVE_PARALLEL));
    while let Some(call) = calls.next().await {
        let call = call?;
        if let Some(Op::Done(summary)) = call.op {
            return Ok(Some(summary));
        }
        let permit = limit.clone().acquire_owned().await.expect("never closed");
        let (served, answers) = (served.clone(), answers.clone());
        tokio::spawn(async move {
            let worker = served.clone();
            let out = tokio::task::spawn_blocking(move || worker.answer(call)).await;
            drop(permit);
            for answer in out.into_iter().flatten() {
                let bytes: u64 = match &answer.answer {
                    Some(Answer::Data(d)) => d.frames.iter().map(frames::wire_len).sum(),
                    Some(Answer::Files(b)) => b
                        .files
                        .iter()
                        .filter_map(|f| match &f.result {
                            Some(proto::file_or_error::Result::Data(d)) => Some(d),
                            _ => None,
                        })
                        .flat_map(|d| d.frames.iter().map(frames::wire_len))
                        .sum(),
                    _ => 0,
                };
                if bytes > 0 {
                    if let Some(limit) = &served.limit {
                        limit.take(bytes).await;
                    }
                    served.sent.fetch_add(bytes, Relaxed);
                }
                if answers.send(answer).await.is_err() {
                    return;
                }
            }
        });
    }
    Ok(None)
}

// ---- The walking side -------------------------------------------------------------------

/// Calls waiting for their answers.
#[derive(Default)]
pub(crate) struct Pending {
    waiting: Mutex<HashMap<u64, Waiting>>,
    broken: AtomicBool,
    why: Mutex<String>,
}

struct Waiting {
    reply: oneshot::Sender<io::Result<Answer>>,
    /// The parts of a listing received so far.
    parts: Vec<proto::Entry>,
}

impl Pending {
    /// Fails every waiting call, and every later one, with `why`.
    fn break_off(&self, why: String) {
        *self.why.lock().expect("why lock") = why.clone();
        self.broken.store(true, Relaxed);
        for (_, w) in self.waiting.lock().expect("waiting lock").drain() {
            _ = w.reply.send(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                why.clone(),
            )));
        }
    }

    fn deliver(&self, answer: proto::TreeAnswer) {
        let mut waiting = self.waiting.lock().expect("waiting lock");
        let Some(w) = waiting.get_mut(&answer.id) else {
            return;
        };
        let result = match answer.answer {
            Some(Answer::Entries(part)) if part.more => {
                w.parts.extend(part.entries);
                return;
            }
            Some(Answer::Entries(mut last)) => {
                let mut all = std::mem::take(&mut w.parts);
                all.append(&mut last.entries);
                Ok(Answer::Entries(proto::Entries {
                    entries: all,
                    more: false,
                }))
            }
            Some(Answer::Error(e)) => Err(io_error_of(e)),
            Some(other) => Ok(other),
            None => Err(bad_answer("an empty answer".into())),
        };
        if let Some(w) = waiting.remove(&answer.id) {
            _ = w.reply.send(result);
        }
    }
}

/// Routes the answers arriving on `answers` to the calls waiting for them; when the
/// stream ends or fails, every call fails (the walk then stops).
pub(crate) async fn route_answers(
    pending: Arc<Pending>,
    mut answers: impl Stream<Item = Result<proto::TreeAnswer, Status>> + Unpin,
) {
    let why = loop {
        match answers.next().await {
            Some(Ok(answer)) => pending.deliver(answer),
            Some(Err(status)) => break format!("the connection failed: {}", status.message()),
            None => break "the connection closed".to_string(),
        }
    };
    pending.break_off(why);
}

/// Puts a call on the stream (from a thread outside the async runtime); false when the
/// stream is gone.
pub(crate) type SendCall = Box<dyn Fn(proto::TreeCall) -> bool + Send + Sync>;

/// A tree on the other end of a stream (see the module documentation).
pub(crate) struct RemoteSource {
    label: PathBuf,
    send: SendCall,
    pending: Arc<Pending>,
    next_id: AtomicU64,
    /// Small files fetched ahead, by path, until copied.
    fetched: Arc<Mutex<HashMap<PathBuf, proto::FileData>>>,
}

/// The files of one prefetch: forgotten when the batch is done, used or not.
pub(crate) struct Fetched {
    cache: Arc<Mutex<HashMap<PathBuf, proto::FileData>>>,
    paths: Vec<PathBuf>,
}

impl Drop for Fetched {
    fn drop(&mut self) {
        let mut cache = self.cache.lock().expect("fetched lock");
        for p in &self.paths {
            cache.remove(p);
        }
    }
}

/// File data fetched ahead in one call at most (well below the message limit).
const PREFETCH_BYTES: u64 = 4 << 20;

/// A file of a [`RemoteSource`]: its path, and its metadata as the last read saw it.
pub(crate) struct RemoteFile {
    rel: PathBuf,
    after: Mutex<Option<Meta>>,
}

impl RemoteSource {
    /// A source whose calls go out through `send` and whose answers `pending` receives
    /// (from [`route_answers`]); `label` names it in messages.
    pub(crate) fn new(label: PathBuf, send: SendCall, pending: Arc<Pending>) -> Self {
        RemoteSource {
            label,
            send,
            pending,
            next_id: AtomicU64::new(1),
            fetched: Arc::default(),
        }
    }

    /// Why the source is gone, if it is.
    pub(crate) fn lost(&self) -> Option<String> {
        self.broken()
            .then(|| self.pending.why.lock().expect("why lock").clone())
    }

    /// Makes a call and waits for its answer (from a thread outside the async runtime).
    fn call(&self, op: Op, xattrs: bool) -> io::Result<Answer> {
        let id = self.next_id.fetch_add(1, Relaxed);
        let (reply, answer) = oneshot::channel();
        {
            let mut waiting = self.pending.waiting.lock().expect("waiting lock");
            if self.broken() {
                let why = self.pending.why.lock().expect("why lock").clone();
                return Err(io::Error::new(io::ErrorKind::ConnectionAborted, why));
            }
            waiting.insert(
                id,
                Waiting {
                    reply,
                    parts: Vec::new(),
                },
            );
        }
        let call = proto::TreeCall {
            id,
            op: Some(op),
            xattrs,
        };
        if !(self.send)(call) {
            self.pending.break_off("the connection closed".into());
        }
        answer
            .blocking_recv()
            .unwrap_or_else(|_| Err(io::Error::from(io::ErrorKind::ConnectionAborted)))
    }

    fn read(&self, f: &RemoteFile, offset: u64, len: u64) -> io::Result<proto::FileData> {
        let op = Op::Read(proto::FileRange {
            path: rel_bytes(&f.rel),
            offset,
            len,
        });
        match self.call(op, false)? {
            Answer::Data(d) => {
                let after = d
                    .after
                    .as_ref()
                    .ok_or_else(|| bad_answer("no metadata".into()))?;
                *f.after.lock().expect("after lock") = Some(meta_of(after)?);
                Ok(d)
            }
            _ => Err(bad_answer("expected file data".into())),
        }
    }

    /// Reads `len` bytes at `offset` of `f` into `dst` at the same offset; holes are
    /// skipped. Returns the bytes written.
    fn fetch(&self, f: &RemoteFile, offset: u64, len: u64, dst: &File) -> io::Result<u64> {
        let mut written = 0;
        let end = offset + len;
        let mut pos = offset;
        while pos < end {
            let want = (end - pos).min(RANGE);
            let data = self.read(f, pos, want)?;
            written += apply_data(&data, pos, want, dst)?;
            pos += want;
        }
        Ok(written)
    }
}

/// Writes the frames of `data`, the answer for `want` bytes at `pos`, into `dst`;
/// returns the bytes written. A file that ended early is an error (the walk retries it).
fn apply_data(data: &proto::FileData, pos: u64, want: u64, dst: &File) -> io::Result<u64> {
    let mut written = 0;
    for frame in &data.frames {
        if frame.offset < pos || frame.offset + frame.len > pos + want {
            return Err(bad_answer("file data outside the range asked".into()));
        }
        match frames::content(frame).map_err(bad_answer)? {
            Content::Bytes(b) => {
                dst.write_all_at(&b, frame.offset)?;
                written += b.len() as u64;
            }
            Content::Zeros(_) => {}
        }
    }
    if data.eof {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the file shrank while being read",
        ));
    }
    Ok(written)
}

impl TreeSource for RemoteSource {
    type Dir = PathBuf;
    type File = RemoteFile;
    type Prefetch = Fetched;

    fn prefetch(&self, dir: &PathBuf, files: &[(&OsStr, u64)]) -> Fetched {
        let mut fetched = Fetched {
            cache: self.fetched.clone(),
            paths: Vec::new(),
        };
        let mut rest = files;
        while !rest.is_empty() {
            // As many files as fit in one answer, at least one.
            let mut bytes = 0;
            let n = rest
                .iter()
                .take_while(|(_, size)| {
                    bytes += size;
                    bytes <= PREFETCH_BYTES
                })
                .count()
                .max(1);
            let (group, later) = rest.split_at(n);
            rest = later;
            let paths: Vec<PathBuf> = group.iter().map(|(name, _)| dir.join(name)).collect();
            let batch = proto::FileBatch {
                files: paths
                    .iter()
                    .zip(group)
                    .map(|(p, (_, size))| proto::FileRange {
                        path: rel_bytes(p),
                        offset: 0,
                        len: *size,
                    })
                    .collect(),
            };
            // A failed batch is not an error here: each file is then read on its own,
            // which reports what is wrong.
            let Ok(Answer::Files(answer)) = self.call(Op::ReadFiles(batch), false) else {
                continue;
            };
            let mut cache = self.fetched.lock().expect("fetched lock");
            for (path, file) in paths.into_iter().zip(answer.files) {
                if let Some(proto::file_or_error::Result::Data(data)) = file.result {
                    cache.insert(path.clone(), data);
                    fetched.paths.push(path);
                }
            }
        }
        fetched
    }

    fn root_path(&self) -> &Path {
        &self.label
    }

    fn open_root(&self) -> io::Result<PathBuf> {
        Ok(PathBuf::new())
    }

    fn open_dir(&self, parent: &PathBuf, name: &OsStr) -> io::Result<PathBuf> {
        Ok(parent.join(name))
    }

    fn list(&self, dir: &PathBuf, xattrs: bool) -> io::Result<Vec<Listed>> {
        match self.call(Op::List(rel_bytes(dir)), xattrs)? {
            Answer::Entries(e) => e.entries.iter().map(listed_of).collect(),
            _ => Err(bad_answer("expected a listing".into())),
        }
    }

    fn stat_dir(&self, rel: &Path, xattrs: bool) -> io::Result<(Meta, Xattrs)> {
        match self.call(Op::Stat(rel_bytes(rel)), xattrs)? {
            Answer::Entry(e) => Ok((meta_of(&e)?, xattrs_of(&e))),
            _ => Err(bad_answer("expected an entry".into())),
        }
    }

    fn open_file(&self, dir: &PathBuf, name: &OsStr) -> io::Result<RemoteFile> {
        Ok(RemoteFile {
            rel: dir.join(name),
            after: Mutex::new(None),
        })
    }

    fn copy_whole(
        &self,
        f: &RemoteFile,
        dst: &File,
        size: u64,
        _sparse: bool,
        _direct: bool,
    ) -> io::Result<Written> {
        let ahead = self.fetched.lock().expect("fetched lock").remove(&f.rel);
        let new_bytes = match ahead {
            Some(data) => {
                let after = data
                    .after
                    .as_ref()
                    .ok_or_else(|| bad_answer("no metadata".into()))?;
                *f.after.lock().expect("after lock") = Some(meta_of(after)?);
                apply_data(&data, 0, size, dst)?
            }
            None => self.fetch(f, 0, size, dst)?,
        };
        dst.set_len(size)?;
        Ok(Written {
            new_bytes,
            reused_bytes: 0,
        })
    }

    fn patch(&self, f: &RemoteFile, old: &File, dst: &File, size: u64) -> io::Result<Written> {
        let have = content::chunks_held(old)?;
        let chunks = match self.call(Op::Chunks(rel_bytes(&f.rel)), false)? {
            Answer::Chunks(c) => c,
            _ => return Err(bad_answer("expected chunks".into())),
        };
        let mut reuse = content::Reuse::new(old, dst);
        // Runs of chunks the old copy lacks, fetched after the rest is in place.
        let mut missing: Vec<(u64, u64)> = Vec::new();
        let mut end = 0;
        for c in &chunks.chunks {
            let id = chunker::ChunkId(
                c.id[..]
                    .try_into()
                    .map_err(|_| bad_answer("a chunk id is not 32 bytes".into()))?,
            );
            let len = c.len as usize;
            if c.offset != end {
                return Err(bad_answer("chunks do not follow each other".into()));
            }
            end = c.offset + len as u64;
            match have.get(&id) {
                Some(&(at, l)) if l == len => reuse.take(at, c.offset, len as u64)?,
                _ if c.zero => {}
                _ => match missing.last_mut() {
                    Some((start, l)) if *start + *l == c.offset => *l += len as u64,
                    _ => missing.push((c.offset, len as u64)),
                },
            }
        }
        if let Some(after) = &chunks.after {
            *f.after.lock().expect("after lock") = Some(meta_of(after)?);
        }
        content::check_whole(end, size)?;
        let reused_bytes = reuse.finish()?;
        let mut new_bytes = 0;
        for (offset, len) in missing {
            new_bytes += self.fetch(f, offset, len, dst)?;
        }
        dst.set_len(size)?;
        Ok(Written {
            new_bytes,
            reused_bytes,
        })
    }

    fn stat(&self, f: &RemoteFile) -> io::Result<Meta> {
        if let Some(m) = f.after.lock().expect("after lock").take() {
            return Ok(m);
        }
        self.read(f, 0, 0)?;
        Ok(f.after
            .lock()
            .expect("after lock")
            .take()
            .expect("set by read"))
    }

    fn same_content(&self, f: &RemoteFile, other: &File) -> io::Result<bool> {
        let theirs = match self.call(Op::Hash(rel_bytes(&f.rel)), false)? {
            Answer::Hash(h) => h,
            _ => return Err(bad_answer("expected a hash".into())),
        };
        _ = rustix::fs::fadvise(other, 0, None, rustix::fs::Advice::DontNeed);
        Ok(theirs.hash[..] == content::hash_file(other)?.as_bytes()[..])
    }

    fn broken(&self) -> bool {
        self.pending.broken.load(Relaxed)
    }
}
