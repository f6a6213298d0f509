//! The source side: a local directory answering the walking side's calls.

use super::wire::{RANGE, entry_of, error_answer, source_error};
use crate::tree::{
    content,
    meta::{self, Meta, NodeKind, Xattrs},
    source::list_entries,
};
use rustix::fs::{Mode, OFlags, ResolveFlags};
use std::{
    ffi::OsStr,
    fs::File,
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd},
        unix::ffi::OsStrExt,
        unix::fs::FileExt,
    },
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering::Relaxed},
    },
};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;
use tonic::codegen::Bytes;
use transport::{
    RateLimiter, frames,
    proto::{self, tree_answer::Answer, tree_call::Op},
};

/// Bytes of entries per part of a listing (names, link targets and xattrs can be long).
const LIST_PART_BYTES: usize = 1 << 20;
/// File data one batch call may ask for (the walking side asks for 4 MiB at most).
const BATCH_MAX: u64 = 8 << 20;
/// Calls one side answers at once.
const SERVE_PARALLEL: usize = 32;

/// A local directory answering a peer's calls.
pub struct Served {
    root: OwnedFd,
    /// Bytes of file data sent (for progress; may be shared with other attempts).
    pub sent: Arc<AtomicU64>,
    /// At most this many bytes of file data per second.
    limit: Option<RateLimiter>,
}

impl Served {
    /// Serves the tree at `path`, sending at most `bwlimit` bytes of file data per
    /// second if given.
    pub fn open(path: &Path, bwlimit: Option<u64>) -> io::Result<Served> {
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
    pub fn answer(&self, call: proto::TreeCall) -> Vec<proto::TreeAnswer> {
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
        if before.kind != NodeKind::File {
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
pub async fn serve_calls(
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
