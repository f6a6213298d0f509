use std::fmt;

/// The 32-byte key under which chunk ids are computed.
///
/// A repository or a replication relationship has its own key, so chunk ids leak
/// nothing to someone without it. A plain local copy uses [`ChunkKey::local`].
#[derive(Clone, PartialEq, Eq)]
pub struct ChunkKey([u8; 32]);

impl ChunkKey {
    /// A key from raw bytes.
    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        ChunkKey(bytes)
    }

    /// The fixed key for local copies, where no secret is at stake and both sides
    /// are on this machine.
    pub fn local() -> Self {
        ChunkKey(blake3::derive_key(
            "mover 2026 local copy chunk key v1",
            b"",
        ))
    }

    /// The raw key bytes.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The keyed BLAKE3 id of `data`.
    pub fn chunk_id(&self, data: &[u8]) -> ChunkId {
        ChunkId(*blake3::keyed_hash(&self.0, data).as_bytes())
    }

    /// A keyed hash over several parts with a one-byte domain tag, used for Merkle nodes
    /// and summaries so they can never collide with a chunk id.
    pub(crate) fn tagged_hash(&self, tag: u8, parts: &[&[u8]]) -> ChunkId {
        let mut hasher = blake3::Hasher::new_keyed(&self.0);
        hasher.update(&[tag]);
        for part in parts {
            hasher.update(part);
        }
        ChunkId(*hasher.finalize().as_bytes())
    }
}

impl fmt::Debug for ChunkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never print key material.
        f.write_str("ChunkKey(..)")
    }
}

/// A chunk's identity: the keyed BLAKE3 of its plaintext.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

impl ChunkId {
    /// The id as 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses 64 hex digits (as [`ChunkId::to_hex`] writes them).
    pub fn from_hex(s: &str) -> Option<ChunkId> {
        if s.len() != 64 || !s.is_ascii() {
            return None;
        }
        let mut id = [0u8; 32];
        for (i, b) in id.iter_mut().enumerate() {
            *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(ChunkId(id))
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", &self.to_hex()[..16])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_depend_on_the_key() {
        let a = ChunkKey::from_bytes([1; 32]);
        let b = ChunkKey::from_bytes([2; 32]);
        assert_ne!(a.chunk_id(b"data"), b.chunk_id(b"data"));
        assert_eq!(a.chunk_id(b"data"), a.chunk_id(b"data"));
        assert_eq!(
            a.chunk_id(b"data").0,
            *blake3::keyed_hash(&[1; 32], b"data").as_bytes()
        );
    }

    #[test]
    fn tagged_hashes_differ_from_chunk_ids() {
        let k = ChunkKey::local();
        assert_ne!(k.tagged_hash(1, &[b"data"]), k.chunk_id(b"data"));
        assert_eq!(k.chunk_id(b"x").to_hex().len(), 64);
    }
}
