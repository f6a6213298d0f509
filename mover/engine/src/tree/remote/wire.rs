//! Entries, errors and open messages on the wire: conversions between the tree walk's
//! types and the protocol's, shared by both sides.

use crate::tree::{
    TreeOptions,
    meta::{Meta, NodeKind, Xattrs},
    source::Listed,
};
use std::{
    ffi::OsString,
    io,
    os::unix::ffi::{OsStrExt, OsStringExt},
    path::Path,
};
use tonic::codegen::Bytes;
use transport::proto::{self, tree_answer::Answer};

/// File data asked for in one call: large enough to amortise a round trip, small
/// enough to stay far below the message limit.
pub(super) const RANGE: u64 = 4 << 20;

/// The copy's rules as the open message carries them.
pub fn open_of(
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
pub fn options_of(open: &proto::TreeOpen) -> TreeOptions {
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

pub(super) fn entry_of(name: &[u8], m: &Meta, link: &[u8], xattrs: &Xattrs) -> proto::Entry {
    proto::Entry {
        name: Bytes::copy_from_slice(name),
        kind: u32::from(m.kind.code()),
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

pub(super) fn meta_of(e: &proto::Entry) -> io::Result<Meta> {
    Ok(Meta {
        kind: u8::try_from(e.kind)
            .ok()
            .and_then(NodeKind::from_code)
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

pub(super) fn xattrs_of(e: &proto::Entry) -> Xattrs {
    e.xattrs
        .iter()
        .map(|x| (OsString::from_vec(x.name.to_vec()), x.value.to_vec()))
        .collect()
}

/// A listed entry from the wire. Its name is one path component, or it is refused: the
/// walk makes every name inside the destination directory it is listing.
pub(super) fn listed_of(e: &proto::Entry) -> io::Result<Listed> {
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

pub(super) fn bad_answer(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

pub(super) fn source_error(e: &io::Error) -> proto::SourceError {
    proto::SourceError {
        errno: e.raw_os_error().unwrap_or(0),
        message: e.to_string(),
        eof: e.kind() == io::ErrorKind::UnexpectedEof,
    }
}

pub(super) fn error_answer(e: &io::Error) -> Answer {
    Answer::Error(source_error(e))
}

pub(super) fn io_error_of(e: proto::SourceError) -> io::Error {
    if e.eof {
        return io::Error::new(io::ErrorKind::UnexpectedEof, e.message);
    }
    let kind = match e.errno {
        0 => io::ErrorKind::Other,
        n => io::Error::from_raw_os_error(n).kind(),
    };
    io::Error::new(kind, format!("on the source: {}", e.message))
}

pub(super) fn rel_bytes(rel: &Path) -> Bytes {
    Bytes::copy_from_slice(rel.as_os_str().as_bytes())
}
