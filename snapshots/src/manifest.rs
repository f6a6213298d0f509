//! Snapshot manifests and chunk lists.
//!
//! A manifest (`snapshots/<id>`, sealed JSON, `"version": 1`) names the volume, time,
//! host, tags and parent, and its content. Block content does not list its chunks
//! inline: the chunk list is cut into list blobs of [`CHUNKS_PER_LIST`] chunks each,
//! stored in packs like data, and the manifest holds only their ids. A 1 TiB volume at
//! 1 MiB chunks needs 16 list blobs; memory stays one list blob at a time.
//!
//! List blob plaintext: `"MVCL" u32le(version 1) u32le(chunks)` then records:
//! `0 u32le(n)` for n zero chunks, `1 id(32)` for a data chunk.

use crate::error::{RepoError, Result};
use crate::pack::u32_at;
use chunker::{ChunkId, ChunkKind};
use serde::{Deserialize, Serialize};

/// Chunks described by one list blob.
pub const CHUNKS_PER_LIST: u64 = 65536;
/// The newest manifest format version this build reads: 1 for block snapshots, 2 for
/// tree snapshots (so builds that predate trees refuse them by version, not by a parse
/// error). See [`Content::format_version`].
pub const MANIFEST_VERSION: u32 = 2;
const LIST_MAGIC: &[u8; 4] = b"MVCL";
const LIST_VERSION: u32 = 1;

/// A snapshot's manifest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Manifest {
    /// Format version ([`MANIFEST_VERSION`]).
    pub version: u32,
    /// When the snapshot was taken (Unix seconds, UTC).
    pub time: i64,
    /// Nanoseconds within that second: orders snapshots taken in the same second, so
    /// `latest` is never a coin toss. Absent (0) in manifests written before it existed.
    #[serde(default)]
    pub time_nanos: u32,
    /// The host that took it.
    pub hostname: String,
    /// The volume's name (by default its path): snapshots of one volume share it.
    pub volume: String,
    /// User tags.
    #[serde(default)]
    pub tags: Vec<String>,
    /// The previous snapshot of the same volume, if any.
    pub parent: Option<String>,
    /// What was captured.
    pub content: Content,
    /// Figures of the run that made it.
    pub summary: SnapshotSummary,
}

/// What a snapshot holds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Content {
    /// A block volume (device or image): fixed chunks, zero chunks not stored.
    Block {
        /// Volume size in bytes.
        size: u64,
        /// Chunk size in bytes.
        chunk_size: u64,
        /// Chunks per list blob.
        chunks_per_list: u64,
        /// List blob ids (hex), in volume order.
        lists: Vec<String>,
    },
    /// A file tree: one tree blob per directory (see [`crate::TreeNode`]).
    Tree {
        /// The top tree blob (hex): one node, `.`, the snapshotted directory.
        root: String,
        /// Regular files (each name of a hard-linked file counted).
        files: u64,
        /// Directories, the top one not counted.
        dirs: u64,
        /// Bytes in regular files.
        bytes: u64,
        /// Extended attributes and ACLs were read (not `--no-xattrs`): a later snapshot
        /// may take an unchanged entry's over.
        #[serde(default)]
        xattrs: bool,
    },
}

impl Content {
    /// The manifest version that describes this content: 1 for block snapshots (which
    /// every build reads), 2 for trees.
    pub fn format_version(&self) -> u32 {
        match self {
            Content::Block { .. } => 1,
            Content::Tree { .. } => 2,
        }
    }

    /// The volume's size in bytes (a tree's: its files' bytes).
    pub fn size(&self) -> u64 {
        match self {
            Content::Block { size, .. } => *size,
            Content::Tree { bytes, .. } => *bytes,
        }
    }

    /// `block` or `tree`.
    pub fn kind(&self) -> &'static str {
        match self {
            Content::Block { .. } => "block",
            Content::Tree { .. } => "tree",
        }
    }
}

/// Figures of a snapshot run.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct SnapshotSummary {
    /// Data (non-zero) chunks in the volume.
    pub data_chunks: u64,
    /// Bytes in data chunks.
    pub data_bytes: u64,
    /// Zero chunks and holes (not stored).
    pub zero_chunks: u64,
    /// Data chunks that were not in the repository yet and were uploaded.
    pub new_chunks: u64,
    /// Plaintext bytes of the new chunks.
    pub new_bytes: u64,
    /// New chunks stored as a delta on the parent snapshot's chunk at the same place
    /// (included in `new_chunks`).
    #[serde(default)]
    pub delta_chunks: u64,
    /// Plaintext bytes of the pages those deltas hold.
    #[serde(default)]
    pub delta_bytes: u64,
    /// Bytes uploaded in packs (compressed, encrypted, with trailers).
    pub stored_bytes: u64,
    /// Packs uploaded.
    pub packs: u64,
    /// Wall time.
    pub duration_secs: f64,
    /// Trees: files read (new or changed since the parent snapshot).
    #[serde(default)]
    pub files_read: u64,
    /// Trees: files taken from the parent snapshot unread (same inode, ctime, size and
    /// mtime).
    #[serde(default)]
    pub files_unchanged: u64,
    /// Trees: files that changed while read (stored as read; the next snapshot reads
    /// them again).
    #[serde(default)]
    pub changed_while_read: u64,
    /// Trees: entries that could not be read and were left out (the snapshot is then
    /// tagged `incomplete`).
    #[serde(default)]
    pub unreadable: u64,
}

/// A snapshot: its id and manifest.
#[derive(Clone, Debug, PartialEq)]
pub struct Snapshot {
    /// The id (64 hex digits).
    pub id: String,
    /// The manifest.
    pub manifest: Manifest,
}

impl Snapshot {
    /// The first 8 hex digits of the id, as shown in lists.
    pub fn short_id(&self) -> &str {
        &self.id[..8.min(self.id.len())]
    }
}

/// Encodes chunk kinds as a list blob.
pub fn encode_list(kinds: &[ChunkKind]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + kinds.len() * 33);
    out.extend_from_slice(LIST_MAGIC);
    out.extend_from_slice(&LIST_VERSION.to_le_bytes());
    out.extend_from_slice(&(kinds.len() as u32).to_le_bytes());
    let mut i = 0;
    while i < kinds.len() {
        match kinds[i] {
            ChunkKind::Data(id) => {
                out.push(1);
                out.extend_from_slice(&id.0);
                i += 1;
            }
            ChunkKind::Zero => {
                let start = i;
                while i < kinds.len() && kinds[i] == ChunkKind::Zero {
                    i += 1;
                }
                out.push(0);
                out.extend_from_slice(&((i - start) as u32).to_le_bytes());
            }
        }
    }
    out
}

/// Decodes a list blob.
pub fn decode_list(key: &str, b: &[u8]) -> Result<Vec<ChunkKind>> {
    let corrupt = |what: &str| RepoError::Corrupt {
        key: key.into(),
        offset: 0,
        what: what.into(),
    };
    if b.get(..4) != Some(LIST_MAGIC) {
        return Err(corrupt("not a chunk list"));
    }
    let v = u32_at(b, 4).ok_or_else(|| corrupt("short chunk list"))?;
    if v != LIST_VERSION {
        return Err(RepoError::UnsupportedVersion {
            key: key.into(),
            found: v,
            supported: LIST_VERSION,
        });
    }
    let n = u32_at(b, 8).ok_or_else(|| corrupt("short chunk list"))? as usize;
    // A list holds at most CHUNKS_PER_LIST chunks: a bigger count is damage, and must
    // not size an allocation.
    if n as u64 > CHUNKS_PER_LIST {
        return Err(corrupt("chunk list count beyond any list's"));
    }
    let mut out = Vec::with_capacity(n);
    let mut at = 12;
    while at < b.len() {
        match b[at] {
            0 => {
                let run = u32_at(b, at + 1).ok_or_else(|| corrupt("short chunk list"))?;
                if out.len() + run as usize > n {
                    return Err(corrupt("chunk list longer than its count"));
                }
                out.extend(std::iter::repeat_n(ChunkKind::Zero, run as usize));
                at += 5;
            }
            1 => {
                let id = b
                    .get(at + 1..at + 33)
                    .ok_or_else(|| corrupt("short chunk list"))?;
                out.push(ChunkKind::Data(ChunkId(id.try_into().expect("32 bytes"))));
                at += 33;
            }
            _ => return Err(corrupt("bad record in chunk list")),
        }
        if out.len() > n {
            return Err(corrupt("chunk list longer than its count"));
        }
    }
    if out.len() != n {
        return Err(corrupt("chunk list shorter than its count"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn list_round_trip_with_zero_runs() {
        let id = |b| ChunkKind::Data(ChunkId([b; 32]));
        let kinds = vec![
            ChunkKind::Zero,
            ChunkKind::Zero,
            id(1),
            id(2),
            ChunkKind::Zero,
            id(1),
        ];
        let e = encode_list(&kinds);
        assert_eq!(e.len(), 12 + 5 + 33 * 2 + 5 + 33);
        assert_eq!(decode_list("x", &e).unwrap(), kinds);
        assert!(decode_list("x", &e[..e.len() - 1]).is_err());
    }
}
