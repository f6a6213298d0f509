//! The snapshot repository: content-addressed, compressed, encrypted storage of volume
//! snapshots on a local directory or S3 (docs/ARCHITECTURE.md).
//!
//! - [`Backend`]: the object-store seam (list, ranged get, put, delete), with
//!   [`LocalBackend`] (durable writes), [`S3Backend`], [`MemoryBackend`], and the
//!   wrappers [`RetryBackend`] (backoff with jitter, bounded time) and [`FaultBackend`]
//!   (fault injection and operation counts for tests).
//! - [`Repository`]: `config` (plain JSON, versioned), `keys/<id>` (the master secret
//!   sealed under argon2id(password) or a raw key), `packs/<xx>/<id>` (16–64 MiB of
//!   zstd-compressed, XChaCha20-Poly1305-sealed blobs and a sealed trailer indexing them,
//!   see [`PackBuilder`]), `index/<id>` (immutable sealed deltas: blob → pack, offset,
//!   length), `snapshots/<id>` (sealed [`Manifest`]s whose chunk lists are stored as
//!   list blobs), `prune/<id>` (prune marks).
//! - Write order is packs → index → snapshot; the snapshot write is the commit point.
//!   Dedup is answered from the in-memory [`Index`], never by per-chunk requests.
//! - Sub-chunk deltas ([`make_delta`]): a chunk that differs from its parent's in few
//!   4 KiB pages is stored as those pages on top of the parent's chunk (a
//!   [`BlobKind::Delta`] blob whose index entry names its base).
//! - [`Repository::verify`], [`Repository::diff`], [`Repository::prune`] (two-phase,
//!   lock-free) and [`retention`] (the `forget` rules).

mod backend;
mod crypto;
mod delta;
mod error;
#[cfg(test)]
mod fuzz;
mod index;
mod keys;
mod manifest;
mod pack;
mod prune;
mod repo;
pub mod retention;
pub mod testing;
mod tree;
mod tree_walk;
mod verify;

pub use backend::{
    Backend, Fault, FaultBackend, LocalBackend, MemoryBackend, ObjectInfo, OpCounts, RetryBackend,
    RetryPolicy, S3Backend, S3Options,
};
/// The byte buffer blobs are read into ([`Repository::read_sealed`]).
pub use bytes::Bytes;
pub use delta::{DELTA_MAX_SHARE, DELTA_PAGE, delta_base, delta_bitmap, encode_delta, make_delta};
pub use error::{RepoError, Result};
pub use index::{BlobLoc, Index};
pub use keys::{Config, Credentials, REPO_VERSION};
pub use manifest::{
    CHUNKS_PER_LIST, Content, MANIFEST_VERSION, Manifest, Snapshot, SnapshotSummary, decode_list,
    encode_list,
};
pub use pack::{
    BlobKind, FinishedPack, MAX_LIST_BLOB, PackBuilder, PackEntry, PackId, SpareBuffers, pack_key,
    sealed_len,
};
pub use prune::PruneReport;
pub use repo::{InitOptions, Repository, Uploader, now_unix, now_unix_nanos};
pub use tree::{FilePiece, NodeKind, TreeNode, decode_tree, encode_tree};
pub use tree_walk::{TreeChange, join_path, tree_root};
pub use verify::{DamagedSnapshot, VerifyReport};

/// Lowercase hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(D[(b >> 4) as usize] as char);
        s.push(D[(b & 15) as usize] as char);
    }
    s
}

/// Bytes from hex, `None` if it is not hex of the right length.
pub fn unhex<const N: usize>(s: &str) -> Option<[u8; N]> {
    let b = s.as_bytes();
    if b.len() != N * 2 {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        let v = |c: u8| (c as char).to_digit(16);
        *o = (v(b[2 * i])? * 16 + v(b[2 * i + 1])?) as u8;
    }
    Some(out)
}
