use crate::{block::ChunkKind, id::ChunkId, id::ChunkKey, size::ChunkSize};

const TAG_ZERO_LEAF: u8 = 0;
const TAG_DATA_LEAF: u8 = 1;
const TAG_NODE: u8 = 2;
const TAG_ROOT: u8 = 3;

/// Folds a volume's chunk list, in order, into a Merkle root in O(log n) memory.
///
/// The tree has the shape of RFC 6962's: the left subtree of every node is the largest
/// complete power of two. Leaves are domain-tagged (zero chunks by their length, data
/// chunks by id), so a hole and written zeros give the same root, and the final root binds
/// the volume size and chunk size.
pub struct MerkleBuilder {
    key: ChunkKey,
    /// Roots of complete subtrees, (height, hash), heights strictly decreasing.
    stack: Vec<(u32, ChunkId)>,
    leaves: u64,
}

impl MerkleBuilder {
    /// An empty builder under `key`.
    pub fn new(key: ChunkKey) -> Self {
        MerkleBuilder {
            key,
            stack: Vec::with_capacity(64),
            leaves: 0,
        }
    }

    /// Appends the next chunk; `len` is its length in bytes.
    pub fn push(&mut self, kind: &ChunkKind, len: u64) {
        self.push_leaf(leaf_hash(&self.key, kind, len));
    }

    /// Appends the next chunk by its leaf hash ([`leaf_hash`]).
    pub fn push_leaf(&mut self, leaf: ChunkId) {
        self.leaves += 1;
        let mut node = (0u32, leaf);
        while let Some(&(h, left)) = self.stack.last() {
            if h != node.0 {
                break;
            }
            self.stack.pop();
            node = (h + 1, self.node(&left, &node.1));
        }
        self.stack.push(node);
    }

    /// Number of chunks pushed so far.
    pub fn leaves(&self) -> u64 {
        self.leaves
    }

    /// The root of everything pushed, bound to the volume size and chunk size.
    pub fn finish(self, volume_size: u64, chunk: ChunkSize) -> ChunkId {
        let tree = self
            .stack
            .iter()
            .rev()
            .map(|(_, h)| *h)
            .reduce(|right, left| self.node(&left, &right))
            .unwrap_or(ChunkId([0; 32]));
        self.key.tagged_hash(
            TAG_ROOT,
            &[
                &volume_size.to_le_bytes(),
                &chunk.get().to_le_bytes(),
                &tree.0,
            ],
        )
    }

    fn node(&self, left: &ChunkId, right: &ChunkId) -> ChunkId {
        self.key.tagged_hash(TAG_NODE, &[&left.0, &right.0])
    }
}

/// The Merkle leaf of a chunk: zero chunks by their length, data chunks by id, each
/// domain-tagged so a leaf can never equal a chunk id or an inner node.
pub fn leaf_hash(key: &ChunkKey, kind: &ChunkKind, len: u64) -> ChunkId {
    match kind {
        ChunkKind::Zero => key.tagged_hash(TAG_ZERO_LEAF, &[&len.to_le_bytes()]),
        ChunkKind::Data(id) => key.tagged_hash(TAG_DATA_LEAF, &[&id.0]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The recursive definition the streaming builder must agree with.
    fn reference(b: &MerkleBuilder, leaves: &[ChunkId]) -> ChunkId {
        if leaves.len() == 1 {
            return leaves[0];
        }
        let split = leaves.len().next_power_of_two() / 2;
        b.node(
            &reference(b, &leaves[..split]),
            &reference(b, &leaves[split..]),
        )
    }

    #[test]
    fn streaming_root_matches_recursive_definition() {
        let key = ChunkKey::local();
        for n in [1usize, 2, 3, 5, 8, 13, 64, 100] {
            let kinds: Vec<ChunkKind> = (0..n)
                .map(|i| {
                    if i % 3 == 0 {
                        ChunkKind::Zero
                    } else {
                        ChunkKind::Data(key.chunk_id(&i.to_le_bytes()))
                    }
                })
                .collect();
            let mut b = MerkleBuilder::new(key.clone());
            let leaves: Vec<ChunkId> = kinds
                .iter()
                .map(|k| match k {
                    ChunkKind::Zero => key.tagged_hash(TAG_ZERO_LEAF, &[&7u64.to_le_bytes()]),
                    ChunkKind::Data(id) => key.tagged_hash(TAG_DATA_LEAF, &[&id.0]),
                })
                .collect();
            for k in &kinds {
                b.push(k, 7);
            }
            assert_eq!(b.leaves(), n as u64);
            let tree = reference(&b, &leaves);
            let want = key.tagged_hash(
                TAG_ROOT,
                &[
                    &1u64.to_le_bytes(),
                    &ChunkSize::DEFAULT.get().to_le_bytes(),
                    &tree.0,
                ],
            );
            assert_eq!(b.finish(1, ChunkSize::DEFAULT), want, "n={n}");
        }
    }

    #[test]
    fn order_matters() {
        let key = ChunkKey::local();
        let (a, z) = (ChunkKind::Data(key.chunk_id(b"a")), ChunkKind::Zero);
        let root = |kinds: &[ChunkKind]| {
            let mut b = MerkleBuilder::new(key.clone());
            kinds.iter().for_each(|k| b.push(k, 4096));
            b.finish(8192, ChunkSize::DEFAULT)
        };
        assert_ne!(root(&[a, z]), root(&[z, a]));
        assert_eq!(root(&[a, z]), root(&[a, z]));
    }
}
