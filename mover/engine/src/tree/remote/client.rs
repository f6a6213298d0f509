//! The walking side: a [`TreeSource`] whose every question is a call on the stream, and
//! the task that routes the answers back to the calls waiting for them.

use super::wire::{RANGE, bad_answer, io_error_of, listed_of, meta_of, rel_bytes, xattrs_of};
use crate::tree::{
    content::{self, Written},
    meta::{Meta, Xattrs},
    source::{Listed, TreeSource},
};
use std::{
    collections::HashMap,
    ffi::OsStr,
    fs::File,
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
};
use tokio::sync::oneshot;
use tokio_stream::{Stream, StreamExt};
use tonic::Status;
use transport::{
    frames::{self, Content},
    proto::{self, tree_answer::Answer, tree_call::Op},
};

/// Calls waiting for their answers.
#[derive(Default)]
pub struct Pending {
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
pub async fn route_answers(
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
pub type SendCall = Box<dyn Fn(proto::TreeCall) -> bool + Send + Sync>;

/// A tree on the other end of a stream (see the module documentation).
pub struct RemoteSource {
    label: PathBuf,
    send: SendCall,
    pending: Arc<Pending>,
    next_id: AtomicU64,
    /// Small files fetched ahead, by path, until copied.
    fetched: Arc<Mutex<HashMap<PathBuf, proto::FileData>>>,
}

/// The files of one prefetch: forgotten when the batch is done, used or not.
pub struct Fetched {
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
pub struct RemoteFile {
    rel: PathBuf,
    after: Mutex<Option<Meta>>,
}

impl RemoteSource {
    /// A source whose calls go out through `send` and whose answers `pending` receives
    /// (from [`route_answers`]); `label` names it in messages.
    pub fn new(label: PathBuf, send: SendCall, pending: Arc<Pending>) -> Self {
        RemoteSource {
            label,
            send,
            pending,
            next_id: AtomicU64::new(1),
            fetched: Arc::default(),
        }
    }

    /// Why the source is gone, if it is.
    pub fn lost(&self) -> Option<String> {
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
