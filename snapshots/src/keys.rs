//! Repository config and key objects.
//!
//! `config` is plain JSON (nothing secret: id, format version, chunk size, cipher).
//! `keys/<id>` is JSON holding the 32-byte master secret sealed under a wrapping key,
//! derived from a password with argon2id, or from a raw key (file or env var) with
//! BLAKE3 key derivation. Any key object that opens gives the repository's keys.

use crate::{
    crypto::{SEAL_OVERHEAD, XChaCha, random},
    error::{RepoError, Result},
};
use serde::{Deserialize, Serialize};

/// The repository format version this build writes and reads.
pub const REPO_VERSION: u32 = 1;
const KEY_VERSION: u32 = 1;
const KEY_AAD: &[u8] = b"mover repository key v1";

/// What opens a repository.
#[derive(Clone)]
pub enum Credentials {
    /// A password (wrapped with argon2id).
    Password(String),
    /// Raw key material, at least 32 bytes (a key file's contents).
    RawKey(Vec<u8>),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Password(_) => f.write_str("Password(..)"),
            Credentials::RawKey(_) => f.write_str("RawKey(..)"),
        }
    }
}

/// The `config` object.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Config {
    /// Format version ([`REPO_VERSION`]).
    pub version: u32,
    /// Random repository id (hex).
    pub id: String,
    /// Chunk size of block volumes, in bytes.
    pub chunk_size: u64,
    /// Target pack size in bytes.
    pub pack_size: u64,
    /// Blob cipher.
    pub cipher: String,
    /// Blob compression.
    pub compression: String,
    /// When it was created (Unix seconds).
    pub created: i64,
}

/// A `keys/<id>` object.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct KeyObject {
    pub version: u32,
    /// "argon2id" or "raw".
    pub kdf: String,
    /// argon2 memory in KiB, iterations, lanes (ignored for raw keys).
    #[serde(default)]
    pub m_cost: u32,
    #[serde(default)]
    pub t_cost: u32,
    #[serde(default)]
    pub p_cost: u32,
    /// Salt (hex).
    pub salt: String,
    /// The sealed master secret (hex).
    pub wrapped: String,
    pub created: i64,
}

fn wrapping_key(
    creds: &Credentials,
    kdf: &str,
    salt: &[u8],
    m: u32,
    t: u32,
    p: u32,
) -> Option<[u8; 32]> {
    match (creds, kdf) {
        (Credentials::Password(pw), "argon2id") => {
            let params = argon2::Params::new(m, t, p, Some(32)).ok()?;
            let a =
                argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
            let mut out = [0u8; 32];
            a.hash_password_into(pw.as_bytes(), salt, &mut out).ok()?;
            Some(out)
        }
        (Credentials::RawKey(k), "raw") => {
            let mut h = blake3::Hasher::new_derive_key("mover repository raw key v1");
            h.update(salt);
            h.update(k);
            Some(*h.finalize().as_bytes())
        }
        _ => None,
    }
}

/// Seals `secret` under `creds`.
pub(crate) fn new_key_object(creds: &Credentials, secret: &[u8; 32], now: i64) -> KeyObject {
    let salt: [u8; 16] = random();
    let (kdf, m, t, p) = match creds {
        Credentials::Password(_) => ("argon2id", 64 * 1024, 3, 1),
        Credentials::RawKey(_) => ("raw", 0, 0, 0),
    };
    let wk = wrapping_key(creds, kdf, &salt, m, t, p).expect("valid argon2 parameters");
    let sealed = XChaCha::new(wk).seal(secret, KEY_AAD);
    KeyObject {
        version: KEY_VERSION,
        kdf: kdf.into(),
        m_cost: m,
        t_cost: t,
        p_cost: p,
        salt: crate::hex(&salt),
        wrapped: crate::hex(&sealed),
        created: now,
    }
}

/// The master secret, if `creds` open this key object.
pub(crate) fn open_key_object(
    name: &str,
    ko: &KeyObject,
    creds: &Credentials,
) -> Result<Option<[u8; 32]>> {
    if ko.version != KEY_VERSION {
        return Err(RepoError::UnsupportedVersion {
            key: name.into(),
            found: ko.version,
            supported: KEY_VERSION,
        });
    }
    let Some(salt) = unhex_vec(&ko.salt) else {
        return Ok(None);
    };
    let Some(wrapped) = unhex_vec(&ko.wrapped).filter(|w| w.len() == 32 + SEAL_OVERHEAD) else {
        return Ok(None);
    };
    // Refuse absurd argon2 costs from a tampered key object instead of exhausting memory.
    if ko.m_cost > 4 * 1024 * 1024 || ko.t_cost > 100 {
        return Ok(None);
    }
    let Some(wk) = wrapping_key(creds, &ko.kdf, &salt, ko.m_cost, ko.t_cost, ko.p_cost) else {
        return Ok(None);
    };
    Ok(XChaCha::new(wk)
        .open(&wrapped, KEY_AAD)
        .and_then(|s| <[u8; 32]>::try_from(s.as_slice()).ok()))
}

fn unhex_vec(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}
