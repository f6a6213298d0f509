//! Chunking and hashing of volumes.
//!
//! Everything mover ships, stores or compares is cut into chunks first:
//! - **Block volumes** (a block device or an image file) are cut into fixed, aligned
//!   chunks ([`ChunkSize`], a power of two from 64 KiB to 8 MiB, default 1 MiB).
//!   Holes (found with `SEEK_DATA`/`SEEK_HOLE`) and all-zero chunks become
//!   [`ChunkKind::Zero`] and are never hashed as data ([`BlockVolume`], [`hash_chunks`]).
//! - **Byte streams** (file contents in tree volumes, repository blobs) are cut with
//!   FastCDC v2020 over a gear table seeded from the key ([`CdcChunker`]).
//! - Every data chunk is named by a [`ChunkId`]: the keyed BLAKE3 of its plaintext.
//!   The key ([`ChunkKey`]) belongs to a repository or a replication relationship, so an
//!   outsider cannot confirm content by hash.
//! - A volume's chunk list folds into a Merkle summary ([`MerkleBuilder`]) in O(log n)
//!   memory, and [`differing_pages`] finds the 4 KiB pages that differ inside a chunk.
//! - [`extents`]: reflink clones of image files, the ranges written between two.
//! - [`durable`]: the workspace's one durable write (tmp, fsync, rename, fsync(dir)).
//!
//! The crate is synchronous (no tokio): hashing runs on rayon, reads on a read-ahead
//! thread ([`read_ahead`], or [`read_process_ahead`] with several readers and a middle
//! stage of its own; [`read_in_turns`] is those readers alone) so I/O overlaps hashing
//! with bounded memory.

mod aligned;
mod block;
mod cdc;
pub mod cv;
pub mod direct;
pub mod durable;
mod error;
pub mod extents;
mod id;
mod merkle;
mod pages;
mod pipeline;
mod size;
mod summary;
mod volume;
mod zero;
pub mod zstd_ctx;

pub use aligned::AlignedBuf;
pub use block::{
    ChunkKind, VolumeDigest, Window, chunk_ranges, classify, for_each_window, for_each_window_at,
    hash_chunks, hash_volume, hash_volume_leaves, read_chunks_where, read_window,
    read_window_where, window_len,
};
pub use cdc::{CdcChunk, CdcChunker, CdcParams};
pub use error::{ChunkerError, Result};
pub use id::{ChunkId, ChunkKey};
pub use merkle::{MerkleBuilder, leaf_hash};
pub use pages::{PAGE_HASH_LEN, PAGE_SIZE, differing_pages, page_hashes, page_runs};
pub use pipeline::{Turns, read_ahead, read_in_turns, read_process_ahead};
pub use size::{ChunkSize, parse_size};
pub use summary::{GROUP_CHUNKS, Summary};
pub use volume::{BlockVolume, VolumeKind};
pub use zero::is_zero;
