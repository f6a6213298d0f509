use crate::{
    BlockVolume, ChunkId, ChunkKey, ChunkSize, Result, block::hash_volume_leaves,
    merkle::MerkleBuilder,
};

/// Chunks per group in a [`Summary`]: one window of reads, one round of comparison.
pub const GROUP_CHUNKS: usize = 8;

const TAG_GROUP: u8 = 4;

/// A volume's Merkle summary as two sides of a transfer exchange it: a hash per group of
/// [`GROUP_CHUNKS`] chunks, the chunks' leaves, and the root (equal to
/// [`crate::hash_volume`]'s). Comparing groups first, then the leaves of only the groups
/// that differ, finds the changed chunks with O(n/8 + changes·8) hashes on the wire.
#[derive(Clone, Debug)]
pub struct Summary {
    /// One leaf per chunk ([`crate::leaf_hash`]).
    pub leaves: Vec<ChunkId>,
    /// One hash per group of leaves ([`Summary::group_hash`]).
    pub groups: Vec<ChunkId>,
    /// The Merkle root, bound to size and chunk size.
    pub root: ChunkId,
}

impl Summary {
    /// Reads and hashes `volume` into its summary.
    pub fn of_volume(
        volume: &BlockVolume,
        key: &ChunkKey,
        chunk: ChunkSize,
        progress: impl FnMut(u64),
    ) -> Result<Summary> {
        let (digest, leaves) = hash_volume_leaves(volume, key, chunk, progress)?;
        let groups = leaves
            .chunks(GROUP_CHUNKS)
            .map(|g| Self::group_hash(key, g))
            .collect();
        Ok(Summary {
            leaves,
            groups,
            root: digest.root,
        })
    }

    /// The hash of one group's leaves.
    pub fn group_hash(key: &ChunkKey, leaves: &[ChunkId]) -> ChunkId {
        let parts: Vec<&[u8]> = leaves.iter().map(|l| &l.0[..]).collect();
        key.tagged_hash(TAG_GROUP, &parts)
    }

    /// The root over `leaves` for a volume of `size` bytes.
    pub fn root_of(key: &ChunkKey, leaves: &[ChunkId], size: u64, chunk: ChunkSize) -> ChunkId {
        let mut m = MerkleBuilder::new(key.clone());
        leaves.iter().for_each(|l| m.push_leaf(*l));
        m.finish(size, chunk)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{fs::File, os::unix::fs::FileExt};

    #[test]
    fn summary_root_equals_the_volume_digest_and_groups_locate_changes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let f = File::create(&path).unwrap();
        f.set_len(20 << 20).unwrap();
        f.write_all_at(&[1; 5000], 3 << 20).unwrap();
        let key = ChunkKey::local();
        let v = BlockVolume::open(&path).unwrap();
        let s = Summary::of_volume(&v, &key, ChunkSize::DEFAULT, |_| {}).unwrap();
        let d = crate::hash_volume(&v, &key, ChunkSize::DEFAULT, |_| {}).unwrap();
        assert_eq!(s.root, d.root);
        assert_eq!((s.leaves.len(), s.groups.len()), (20, 3));
        assert_eq!(
            Summary::root_of(&key, &s.leaves, 20 << 20, ChunkSize::DEFAULT),
            s.root
        );

        f.write_all_at(&[2], 17 << 20).unwrap();
        let t = Summary::of_volume(
            &BlockVolume::open(&path).unwrap(),
            &key,
            ChunkSize::DEFAULT,
            |_| {},
        )
        .unwrap();
        let changed: Vec<usize> = (0..3).filter(|&g| s.groups[g] != t.groups[g]).collect();
        assert_eq!(changed, vec![2]);
        let leaves: Vec<usize> = (0..20).filter(|&i| s.leaves[i] != t.leaves[i]).collect();
        assert_eq!(leaves, vec![17]);
    }
}
