//! Keys and authenticated encryption.
//!
//! A repository has one random 32-byte master secret. From it, BLAKE3 key derivation
//! gives the encryption key (XChaCha20-Poly1305) and the chunk-id key (keyed BLAKE3),
//! so ids are useless to anyone without the secret. Every sealed object or blob is
//! `nonce (24 random bytes) || ciphertext || tag`: with 192-bit random nonces a repeat is
//! out of reach (2^-96 after 2^48 messages), so no counter state has to be kept.

use chacha20poly1305::{
    KeyInit, XChaCha20Poly1305, XNonce,
    aead::{Aead, Payload},
};
use chunker::ChunkKey;

/// Bytes a seal adds: the nonce and the tag.
pub(crate) const SEAL_OVERHEAD: usize = 24 + 16;

/// The keys of an open repository.
#[derive(Clone)]
pub(crate) struct MasterKey {
    cipher: XChaCha20Poly1305,
    chunk_key: ChunkKey,
}

impl std::fmt::Debug for MasterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MasterKey(..)")
    }
}

impl MasterKey {
    /// The keys derived from a master secret.
    pub fn from_secret(secret: &[u8; 32]) -> Self {
        let enc = blake3::derive_key("mover repository 2026 encryption key v1", secret);
        let id = blake3::derive_key("mover repository 2026 chunk id key v1", secret);
        MasterKey {
            cipher: XChaCha20Poly1305::new(&enc.into()),
            chunk_key: ChunkKey::from_bytes(id),
        }
    }

    /// The chunk-id key.
    pub fn chunk_key(&self) -> &ChunkKey {
        &self.chunk_key
    }

    /// Encrypts `msg`, binding `aad` (not stored) to it.
    pub fn seal(&self, msg: &[u8], aad: &[u8]) -> Vec<u8> {
        seal_with(&self.cipher, msg, aad)
    }

    /// Decrypts a sealed message; `None` if it was altered or sealed with other keys/aad.
    pub fn open(&self, sealed: &[u8], aad: &[u8]) -> Option<Vec<u8>> {
        open_with(&self.cipher, sealed, aad)
    }
}

/// Random bytes from the OS.
pub(crate) fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).expect("the OS random number generator failed");
    b
}

pub(crate) fn seal_with(cipher: &XChaCha20Poly1305, msg: &[u8], aad: &[u8]) -> Vec<u8> {
    let nonce: [u8; 24] = random();
    let ct = cipher
        .encrypt(XNonce::from_slice(&nonce), Payload { msg, aad })
        .expect("XChaCha20-Poly1305 encryption cannot fail for in-memory buffers");
    let mut out = Vec::with_capacity(24 + ct.len());
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&ct);
    out
}

pub(crate) fn open_with(cipher: &XChaCha20Poly1305, sealed: &[u8], aad: &[u8]) -> Option<Vec<u8>> {
    if sealed.len() < SEAL_OVERHEAD {
        return None;
    }
    let (nonce, ct) = sealed.split_at(24);
    cipher
        .decrypt(XNonce::from_slice(nonce), Payload { msg: ct, aad })
        .ok()
}

/// A cipher under a 32-byte wrapping key (for key files).
pub(crate) fn wrapping_cipher(key: &[u8; 32]) -> XChaCha20Poly1305 {
    XChaCha20Poly1305::new(key.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seal_open_round_trip_and_tamper() {
        let k = MasterKey::from_secret(&[7; 32]);
        let s = k.seal(b"hello", b"aad");
        assert_eq!(k.open(&s, b"aad").as_deref(), Some(&b"hello"[..]));
        assert!(k.open(&s, b"other").is_none());
        let mut t = s.clone();
        t[30] ^= 1;
        assert!(k.open(&t, b"aad").is_none());
        assert!(MasterKey::from_secret(&[8; 32]).open(&s, b"aad").is_none());
        // Two seals of the same message differ (fresh nonces).
        assert_ne!(k.seal(b"hello", b"aad"), s);
    }
}
