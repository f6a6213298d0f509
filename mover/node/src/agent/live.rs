//! A session's Merkle summary, known group by group.
//!
//! An agent used to hash its whole volume inside Open, and the peer started reading its
//! own side only afterwards: two full reads in series. Now the summary is filled in by a
//! background thread while the peer already compares the first groups (Tree waits only
//! for the groups it asks about), or known at once: from the volume's saved chunk index
//! (a volume this agent wrote and that is untouched since), or because the volume is a
//! new, empty image.
//!
//! The peer writes a group only after it has compared it, that is after the hasher has
//! read it, so writes never race the hashing of what they change.

use chunker::{
    BlockVolume, ChunkId, ChunkKey, ChunkKind, ChunkSize, GROUP_CHUNKS, MerkleBuilder, Summary,
    Window, for_each_window, hash_chunks, leaf_hash,
};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// Leaves and group hashes known so far.
#[derive(Default)]
struct Known {
    leaves: Vec<ChunkId>,
    groups: Vec<ChunkId>,
    root: Option<ChunkId>,
    failed: Option<String>,
}

/// A summary being computed (or already complete).
pub(super) struct LiveSummary {
    key: ChunkKey,
    chunk: ChunkSize,
    size: u64,
    known: Mutex<Known>,
    /// Bumped whenever `known` grows, for the waiters.
    changed: watch::Sender<u64>,
}

impl LiveSummary {
    fn empty(key: ChunkKey, chunk: ChunkSize, size: u64) -> Arc<Self> {
        Arc::new(LiveSummary {
            key,
            chunk,
            size,
            known: Mutex::new(Known::default()),
            changed: watch::channel(0).0,
        })
    }

    /// A summary never served (a ranges-only session): nothing is hashed, not even the
    /// leaves of a terabyte of zeros.
    pub fn unserved(key: ChunkKey, chunk: ChunkSize, size: u64) -> Arc<Self> {
        Self::empty(key, chunk, size)
    }

    /// Chunks in the volume.
    pub fn chunks(&self) -> u64 {
        self.size.div_ceil(self.chunk.get())
    }

    fn chunk_len(&self, c: u64) -> u64 {
        (self.size - c * self.chunk.get()).min(self.chunk.get())
    }

    /// A complete summary from every chunk's kind, in order.
    pub fn of_kinds(
        key: ChunkKey,
        chunk: ChunkSize,
        size: u64,
        kinds: impl IntoIterator<Item = ChunkKind>,
    ) -> Arc<Self> {
        let s = Self::empty(key, chunk, size);
        let leaves: Vec<ChunkId> = kinds
            .into_iter()
            .enumerate()
            .map(|(c, k)| leaf_hash(&s.key, &k, s.chunk_len(c as u64)))
            .collect();
        s.extend(&leaves);
        s
    }

    /// A complete summary of a volume that reads as zeros (a new image).
    pub fn of_zeros(key: ChunkKey, chunk: ChunkSize, size: u64) -> Arc<Self> {
        let n = size.div_ceil(chunk.get());
        Self::of_kinds(key, chunk, size, (0..n).map(|_| ChunkKind::Zero))
    }

    /// A summary of `volume`, hashed on a thread of its own that stops early once the
    /// session is gone (nobody else holds the summary).
    pub fn hash_in_background(volume: BlockVolume, key: ChunkKey, chunk: ChunkSize) -> Arc<Self> {
        let s = Self::empty(key, chunk, volume.size());
        let live = s.clone();
        std::thread::spawn(move || {
            let r = for_each_window(&volume, chunk, |win: &mut Window| {
                if Arc::strong_count(&live) == 1 {
                    return Err(chunker::ChunkerError::Read {
                        path: volume.path().into(),
                        offset: win.offset,
                        cause: std::io::Error::other("the session was closed"),
                    });
                }
                let kinds = hash_chunks(&live.key, chunk, win);
                let leaves: Vec<ChunkId> = kinds
                    .iter()
                    .zip(win.chunk_ranges(chunk))
                    .map(|(k, r)| leaf_hash(&live.key, k, r.len() as u64))
                    .collect();
                live.extend(&leaves);
                Ok(())
            });
            if let Err(e) = r {
                live.known.lock().expect("summary lock").failed = Some(e.to_string());
                live.changed.send_modify(|n| *n += 1);
            }
        });
        s
    }

    /// Appends leaves; completes the groups they fill and, at the end, the root.
    fn extend(&self, leaves: &[ChunkId]) {
        let chunks = self.chunks() as usize;
        let mut k = self.known.lock().expect("summary lock");
        k.leaves.extend_from_slice(leaves);
        let mut start = k.groups.len() * GROUP_CHUNKS;
        while start < k.leaves.len()
            && (k.leaves.len() - start >= GROUP_CHUNKS || k.leaves.len() == chunks)
        {
            let end = (start + GROUP_CHUNKS).min(k.leaves.len());
            let g = Summary::group_hash(&self.key, &k.leaves[start..end]);
            k.groups.push(g);
            start = end;
        }
        if k.leaves.len() == chunks && k.root.is_none() {
            let mut m = MerkleBuilder::new(self.key.clone());
            k.leaves.iter().for_each(|l| m.push_leaf(*l));
            k.root = Some(m.finish(self.size, self.chunk));
        }
        drop(k);
        self.changed.send_modify(|n| *n += 1);
    }

    /// Waits until `ready` says what it needs is known, and returns what it returns.
    async fn wait<T>(&self, mut ready: impl FnMut(&Known) -> Option<T>) -> Result<T, String> {
        let mut rx = self.changed.subscribe();
        loop {
            {
                let k = self.known.lock().expect("summary lock");
                if let Some(t) = ready(&k) {
                    return Ok(t);
                }
                if let Some(e) = &k.failed {
                    return Err(format!("hashing the volume failed: {e}"));
                }
            }
            if rx.changed().await.is_err() {
                return Err("the volume's summary was abandoned".into());
            }
        }
    }

    /// Group hashes from `first`: at least that one (waiting for it), then as many of the
    /// next `count - 1` as are known; none if `first` is past the end.
    pub async fn groups(&self, first: u64, count: u32) -> Result<Vec<ChunkId>, String> {
        let total = self.chunks().div_ceil(GROUP_CHUNKS as u64);
        if first >= total || count == 0 {
            return Ok(Vec::new());
        }
        let first = first as usize;
        self.wait(|k| {
            (k.groups.len() > first).then(|| {
                let end = first.saturating_add(count as usize).min(k.groups.len());
                k.groups[first..end].to_vec()
            })
        })
        .await
    }

    /// Chunk leaves `first..first + count` (clipped to the volume), once all are known.
    pub async fn leaves(&self, first: u64, count: u32) -> Result<Vec<ChunkId>, String> {
        let end = first.saturating_add(count as u64).min(self.chunks()) as usize;
        let first = (first as usize).min(end);
        self.wait(|k| (k.leaves.len() >= end).then(|| k.leaves[first..end].to_vec()))
            .await
    }

    /// The root, once the whole volume is hashed.
    pub async fn root(&self) -> Result<ChunkId, String> {
        self.wait(|k| k.root).await
    }

    /// The root if already known.
    pub fn root_now(&self) -> Option<ChunkId> {
        self.known.lock().expect("summary lock").root
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[tokio::test]
    async fn background_summary_equals_the_volume_summary_and_answers_early_groups() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let size = (20 << 20) + 12345;
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(size).unwrap();
        f.write_all_at(&[7; 5000], 3 << 20).unwrap();
        f.write_all_at(&[9; 5000], 19 << 20).unwrap();
        let (key, chunk) = (ChunkKey::local(), ChunkSize::new(1 << 20).unwrap());
        let want =
            Summary::of_volume(&BlockVolume::open(&path).unwrap(), &key, chunk, |_| {}).unwrap();

        let live = LiveSummary::hash_in_background(BlockVolume::open(&path).unwrap(), key, chunk);
        assert_eq!(live.groups(0, 1).await.unwrap(), want.groups[..1]);
        assert_eq!(live.root().await.unwrap(), want.root);
        assert_eq!(live.groups(0, 100).await.unwrap(), want.groups);
        assert_eq!(live.groups(1, 100).await.unwrap(), want.groups[1..]);
        assert!(live.groups(3, 1).await.unwrap().is_empty(), "past the end");
        assert_eq!(live.leaves(16, 8).await.unwrap(), want.leaves[16..]);
    }

    #[tokio::test]
    async fn a_new_image_is_known_without_reading_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::File::create(&path)
            .unwrap()
            .set_len(9 << 20)
            .unwrap();
        let (key, chunk) = (ChunkKey::local(), ChunkSize::new(1 << 20).unwrap());
        let want =
            Summary::of_volume(&BlockVolume::open(&path).unwrap(), &key, chunk, |_| {}).unwrap();
        let zeros = LiveSummary::of_zeros(key, chunk, 9 << 20);
        assert_eq!(zeros.root_now(), Some(want.root));
        assert_eq!(zeros.groups(0, 10).await.unwrap(), want.groups);
    }
}
