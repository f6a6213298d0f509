//! `mover hash`: a block volume's chunk digest.

use crate::{copy::Progress, error::Result};
use chunker::{BlockVolume, ChunkKey, ChunkSize, hash_volume};
use serde::Serialize;
use std::{path::Path, path::PathBuf, time::Instant};

/// The digest of a volume, for people and (as JSON) for programs.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct HashSummary {
    /// The volume's path.
    pub volume: PathBuf,
    /// Its size in bytes.
    pub volume_bytes: u64,
    /// Chunk size used.
    pub chunk_size: u64,
    /// Chunks holding data.
    pub data_chunks: u64,
    /// Chunks that are zeros or holes.
    pub zero_chunks: u64,
    /// Bytes in data chunks.
    pub data_bytes: u64,
    /// Bytes in zero chunks.
    pub zero_bytes: u64,
    /// Merkle root (hex): equal roots mean equal volumes.
    pub root: String,
    /// Wall time in seconds.
    pub duration_secs: f64,
    /// `volume_bytes / duration_secs`.
    pub throughput_bytes_per_sec: f64,
}

/// Hashes the block volume at `path` with `threads` hashing threads (all cores if `None`).
pub fn hash_block(
    path: &Path,
    chunk: ChunkSize,
    threads: Option<usize>,
    progress: &dyn Progress,
) -> Result<HashSummary> {
    let started = Instant::now();
    let volume = BlockVolume::open(path)?;
    progress.begin("hash", volume.size());
    let run = || {
        hash_volume(&volume, &ChunkKey::local(), chunk, |done| {
            progress.update(done)
        })
    };
    let digest = match threads {
        Some(n) => rayon::ThreadPoolBuilder::new()
            .num_threads(n.max(1))
            .build()
            .expect("a rayon pool of a few threads can always be built")
            .install(run)?,
        None => run()?,
    };
    let secs = started.elapsed().as_secs_f64();
    Ok(HashSummary {
        volume: path.into(),
        volume_bytes: digest.size,
        chunk_size: chunk.get(),
        data_chunks: digest.data_chunks,
        zero_chunks: digest.zero_chunks,
        data_bytes: digest.data_bytes,
        zero_bytes: digest.size - digest.data_bytes,
        root: digest.root.to_hex(),
        duration_secs: secs,
        throughput_bytes_per_sec: digest.size as f64 / secs.max(1e-9),
    })
}
