//! Packs: many compressed, encrypted blobs in one object, with an encrypted trailer
//! indexing them.
//!
//! Layout (version 1):
//! ```text
//! "MVPK" u32le(1)                         header
//! blob*                                   nonce(24) || AEAD(flag(1) || payload) ; aad = kind || id
//! sealed trailer                          nonce(24) || AEAD(u32le version, u32le count, entry*)
//! u32le(len of sealed trailer) "MVPK"     footer
//! entry = kind(1) id(32) offset(u32le) length(u32le) [base(32) if kind is delta]
//! ```
//! The trailer is version 1 when no blob is a delta (fixed 41-byte entries) and version 2
//! otherwise (delta entries carry their base); both are read.
//! `flag` is 0 for raw bytes and 1 for zstd (used only when it shrinks the blob). A pack
//! is named by the BLAKE3 of its bytes, so a whole-pack check needs no key.

use crate::{
    crypto::{MasterKey, NONCE, SEAL_OVERHEAD},
    error::{RepoError, Result},
};
use bytes::Bytes;
use chunker::ChunkId;
use std::sync::{Arc, Mutex};

const MAGIC: &[u8; 4] = b"MVPK";
const VERSION: u32 = 1;
/// Trailer (and index) entries: version 2 adds delta entries with a base.
pub(crate) const ENTRIES_V1: u32 = 1;
pub(crate) const ENTRIES_V2: u32 = 2;
const HEADER_LEN: usize = 8;
/// Footer: trailer length and magic.
pub(crate) const FOOTER_LEN: usize = 8;
const ENTRY_LEN: usize = 41;
const TRAILER_AAD: &[u8] = b"mover pack trailer v1";

/// What a blob holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum BlobKind {
    /// A chunk of volume data.
    Data = 0,
    /// A piece of a snapshot's chunk list.
    List = 1,
    /// A chunk of volume data stored as the pages that differ from a base chunk
    /// (see [`crate::make_delta`]); its plaintext is the delta, not the chunk.
    Delta = 2,
}

impl BlobKind {
    pub(crate) fn from_u8(b: u8) -> Option<Self> {
        match b {
            0 => Some(BlobKind::Data),
            1 => Some(BlobKind::List),
            2 => Some(BlobKind::Delta),
            _ => None,
        }
    }
}

/// A pack's name: the BLAKE3 of its bytes.
pub type PackId = [u8; 32];

/// The object key of a pack.
pub fn pack_key(id: &PackId) -> String {
    let h = crate::hex(id);
    format!("packs/{}/{h}", &h[..2])
}

/// One blob in a pack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackEntry {
    /// What it holds.
    pub kind: BlobKind,
    /// The keyed BLAKE3 of its plaintext.
    pub id: ChunkId,
    /// Byte offset of the sealed blob in the pack.
    pub offset: u32,
    /// Length of the sealed blob.
    pub len: u32,
    /// For a delta blob, the data blob it applies to.
    pub base: Option<ChunkId>,
}

/// zstd level of blobs.
const ZSTD_LEVEL: i32 = 3;
/// zstd level of a volume's chunks: 1 MiB of block data (database pages, file system
/// blocks). Measured on the bench's 4 GiB ext4 volume, its 3,271 data chunks each
/// compressed whole (python-zstandard, zstd 1.5.7, one CPU): level 2 2,064.3 MB in
/// 3.9 s, level 3 2,059.6 MB in 5.2 s, level 2 with level 3's hash table (hashLog 17)
/// 2,062.8 MB in 4.5 s. Level 3 was 60% of a first snapshot's CPU; level 1 made the
/// repository 1.3% larger than restic's. A file tree's blobs keep level 3 (a /usr tar:
/// 3.00x against level 1's 2.73x).
pub(crate) const VOLUME_ZSTD_LEVEL: i32 = 2;
// Every blob is compressed whole, and kept raw where that does not shrink it: zstd
// passes incompressible data quickly itself (random 1 MiB blocks at 7-8 GB/s at levels
// 1-3). mover judged large blobs on 16 samples of 4 KiB first, which stored 11 chunks
// of the bench's volume raw whose redundancy lay between the samples (data repeated
// farther apart than a sample, each 64 KiB piece alone incompressible): 3.15 MB more
// packs. Compressing every blob costs a first snapshot of that volume about 0.1 s of
// its 4.7 s (3 runs each way).

/// Compresses (when it helps, at the default level) and encrypts a blob.
pub(crate) fn seal_blob(key: &MasterKey, kind: BlobKind, id: &ChunkId, plain: &[u8]) -> Vec<u8> {
    seal_blob_into(key, kind, id, plain, ZSTD_LEVEL, Vec::new())
}

/// Compresses (when it helps, at zstd `level`) and encrypts a blob, into `out`,
/// emptied first (a buffer given back: no allocation when it has room for the sealed
/// plaintext). The level is the writer's choice alone: a zstd frame opens the same
/// whatever level made it.
pub(crate) fn seal_blob_into(
    key: &MasterKey,
    kind: BlobKind,
    id: &ChunkId,
    plain: &[u8],
    level: i32,
    mut out: Vec<u8>,
) -> Vec<u8> {
    // One buffer, built in place: the nonce's room, the flag, the message compressed
    // straight into it (a frame no shorter than the plaintext does not pay), sealed in
    // place with room for the tag. A volume's 1 MiB chunk took three allocations and
    // three copies before.
    out.clear();
    out.reserve(sealed_len(plain.len()));
    out.extend_from_slice(&[0; NONCE]);
    out.push(1);
    let compressed =
        chunker::zstd_ctx::compress_append(plain, level, &mut out).is_ok_and(|n| n < plain.len());
    if !compressed {
        out.truncate(NONCE);
        out.push(0);
        out.extend_from_slice(plain);
    }
    key.seal_in_place(&mut out, &blob_aad(kind, id));
    out
}

/// The most bytes a blob of `plain` bytes takes sealed: stored raw, with its flag.
pub fn sealed_len(plain: usize) -> usize {
    SEAL_OVERHEAD + 1 + plain
}

fn blob_aad(kind: BlobKind, id: &ChunkId) -> [u8; 33] {
    let mut aad = [0u8; 33];
    aad[0] = kind as u8;
    aad[1..].copy_from_slice(&id.0);
    aad
}

/// More than any data blob's plaintext (chunks are at most 8 MiB).
const MAX_BLOB_PLAIN: u64 = 16 << 20;
/// The largest list blob (chunk lists, and tree blobs: a directory of ~1.8 million
/// entries, or a file of ~6 TiB, in one blob); writers refuse larger ones.
pub const MAX_LIST_BLOB: u64 = 256 << 20;

/// Decrypts and decompresses a blob, without hashing it: for a delta's base, whose
/// rebuilt chunk is checked against its own id (the AEAD still binds kind and id).
pub(crate) fn open_blob_unhashed(
    key: &MasterKey,
    kind: BlobKind,
    id: &ChunkId,
    sealed: &[u8],
) -> Option<Bytes> {
    let msg = key.open(sealed, &blob_aad(kind, id))?;
    match msg.split_first()? {
        // The plaintext after the flag byte, in place: no second buffer, no shift.
        (0, _) => Some(Bytes::from(msg).slice(1..)),
        (1, rest) => {
            // One exact-size buffer: the frame records its size (bulk::compress writes it).
            // A size beyond any chunk is damage, never an allocation.
            let size = zstd::zstd_safe::get_frame_content_size(rest).ok()??;
            let max = match kind {
                BlobKind::List => MAX_LIST_BLOB,
                _ => MAX_BLOB_PLAIN,
            };
            if size > max {
                return None;
            }
            chunker::zstd_ctx::decompress(rest, size as usize)
                .ok()
                .map(Bytes::from)
        }
        _ => None,
    }
}

/// Decrypts, decompresses and checks a blob: `None` unless its plaintext hashes to `id`.
/// A delta blob is only authenticated (bound to its kind and id): it is checked when
/// the chunk is rebuilt from it ([`crate::Repository::rebuild_chunk`]).
pub(crate) fn open_blob(
    key: &MasterKey,
    kind: BlobKind,
    id: &ChunkId,
    sealed: &[u8],
) -> Option<Bytes> {
    let plain = open_blob_unhashed(key, kind, id, sealed)?;
    (kind == BlobKind::Delta || key.chunk_key().chunk_id(&plain) == *id).then_some(plain)
}

/// [`open_blob`] of a data blob into `out`, which must be exactly its plaintext's
/// length: no buffer is allocated for the plaintext. `None` unless it authenticates,
/// fits `out` exactly and hashes to `id`.
pub(crate) fn open_data_into(
    key: &MasterKey,
    id: &ChunkId,
    sealed: &[u8],
    out: &mut [u8],
) -> Option<()> {
    let msg = key.open(sealed, &blob_aad(BlobKind::Data, id))?;
    match msg.split_first()? {
        (0, rest) if rest.len() == out.len() => out.copy_from_slice(rest),
        (1, rest) => {
            let size = zstd::zstd_safe::get_frame_content_size(rest).ok()??;
            if size != out.len() as u64 {
                return None;
            }
            let n = chunker::zstd_ctx::decompress_into(rest, out).ok()?;
            if n != out.len() {
                return None;
            }
        }
        _ => return None,
    }
    (key.chunk_key().chunk_id(out) == *id).then_some(())
}

/// A pack being filled.
#[derive(Debug)]
pub struct PackBuilder {
    buf: Vec<u8>,
    entries: Vec<PackEntry>,
}

/// Pack buffers given back once their packs are uploaded, for the next packs of the
/// same run: a 16 MiB buffer fresh from the allocator is faulted in page by page (4096
/// faults), and allocators hand buffers that large back to the system when freed.
/// Likewise a run's sealed chunks, each copied into its pack and then free. A first
/// snapshot of a 4 GiB volume took 1.04 million page faults with neither given back,
/// 577 thousand with packs, 62 thousand with both. At most
/// the number given to [`SpareBuffers::keeping`] are kept; they go when the last clone
/// is dropped.
#[derive(Clone, Debug)]
pub struct SpareBuffers {
    kept: Arc<Mutex<Vec<Vec<u8>>>>,
    most: usize,
}

impl SpareBuffers {
    /// Spares keeping at most `most` buffers.
    pub fn keeping(most: usize) -> Self {
        Self {
            kept: Arc::default(),
            most,
        }
    }

    /// Keeps `buf` for later, unless enough are kept.
    pub fn give(&self, buf: Vec<u8>) {
        let mut spares = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        if spares.len() < self.most {
            spares.push(buf);
        }
    }

    /// A kept buffer with room for at least `bytes`.
    pub fn take(&self, bytes: usize) -> Option<Vec<u8>> {
        let mut spares = self.kept.lock().unwrap_or_else(|e| e.into_inner());
        let at = spares.iter().position(|b| b.capacity() >= bytes)?;
        Some(spares.swap_remove(at))
    }
}

/// A complete pack, ready to upload.
#[derive(Debug, Clone)]
pub struct FinishedPack {
    /// Its name.
    pub id: PackId,
    /// Its bytes.
    pub data: Bytes,
    /// Its blobs.
    pub entries: Vec<PackEntry>,
}

impl FinishedPack {
    /// The pack's buffer, for [`SpareBuffers::give`], once nothing else holds its bytes
    /// (an upload may still hold a clone: then `None`).
    pub fn take_buffer(&mut self) -> Option<Vec<u8>> {
        std::mem::take(&mut self.data)
            .try_into_mut()
            .ok()
            .map(Vec::from)
    }
}

impl Default for PackBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl PackBuilder {
    /// An empty pack.
    pub fn new() -> Self {
        Self::with_capacity(HEADER_LEN)
    }

    /// An empty pack with room for `bytes`: a pack filled to its size then never
    /// reallocates (a doubling Vec held up to twice the pack, and copied it).
    pub fn with_capacity(bytes: usize) -> Self {
        Self::reusing(Vec::with_capacity(bytes.max(HEADER_LEN)))
    }

    /// An empty pack with room for `bytes`, in a buffer an uploaded pack gave back to
    /// `spares` if one is there.
    pub fn with_capacity_from(spares: &SpareBuffers, bytes: usize) -> Self {
        match spares.take(bytes) {
            Some(buf) => Self::reusing(buf),
            None => Self::with_capacity(bytes),
        }
    }

    /// An empty pack written into `buf`, emptied first.
    fn reusing(mut buf: Vec<u8>) -> Self {
        buf.clear();
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&VERSION.to_le_bytes());
        PackBuilder {
            buf,
            entries: Vec::new(),
        }
    }

    /// Bytes so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether no blob was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Appends a sealed blob (from [`crate::Repository::seal_blob`]).
    pub fn push(&mut self, kind: BlobKind, id: ChunkId, sealed: &[u8]) {
        self.push_entry(kind, id, None, sealed);
    }

    /// Appends a sealed delta blob that rebuilds chunk `id` from data blob `base`.
    pub fn push_delta(&mut self, id: ChunkId, base: ChunkId, sealed: &[u8]) {
        self.push_entry(BlobKind::Delta, id, Some(base), sealed);
    }

    /// Appends a sealed blob of any kind (`base` only for deltas).
    pub fn push_entry(
        &mut self,
        kind: BlobKind,
        id: ChunkId,
        base: Option<ChunkId>,
        sealed: &[u8],
    ) {
        debug_assert_eq!(kind == BlobKind::Delta, base.is_some());
        self.entries.push(PackEntry {
            kind,
            id,
            offset: self.buf.len() as u32,
            len: sealed.len() as u32,
            base,
        });
        self.buf.extend_from_slice(sealed);
    }

    pub(crate) fn finish(mut self, key: &MasterKey) -> FinishedPack {
        let mut t = Vec::with_capacity(8 + self.entries.len() * ENTRY_LEN);
        t.extend_from_slice(&entries_version(&self.entries).to_le_bytes());
        t.extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            encode_entry(e, &mut t);
        }
        let sealed = key.seal(&t, TRAILER_AAD);
        self.buf.extend_from_slice(&sealed);
        self.buf
            .extend_from_slice(&(sealed.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(MAGIC);
        FinishedPack {
            id: *blake3::hash(&self.buf).as_bytes(),
            data: Bytes::from(self.buf),
            entries: self.entries,
        }
    }
}

/// The entry format version a list of entries needs: 1 unless one is a delta.
pub(crate) fn entries_version<'a>(entries: impl IntoIterator<Item = &'a PackEntry>) -> u32 {
    match entries.into_iter().any(|e| e.base.is_some()) {
        true => ENTRIES_V2,
        false => ENTRIES_V1,
    }
}

pub(crate) fn encode_entry(e: &PackEntry, out: &mut Vec<u8>) {
    out.push(e.kind as u8);
    out.extend_from_slice(&e.id.0);
    out.extend_from_slice(&e.offset.to_le_bytes());
    out.extend_from_slice(&e.len.to_le_bytes());
    if let Some(base) = e.base {
        out.extend_from_slice(&base.0);
    }
}

/// Decodes the entry at the start of `b` (format `version`); returns it and its length.
pub(crate) fn decode_entry(b: &[u8], version: u32) -> Option<(PackEntry, usize)> {
    let b41 = b.get(..ENTRY_LEN)?;
    let kind = BlobKind::from_u8(b41[0])?;
    let (base, len) = match kind {
        BlobKind::Delta if version >= ENTRIES_V2 => (
            Some(ChunkId(b.get(ENTRY_LEN..ENTRY_LEN + 32)?.try_into().ok()?)),
            ENTRY_LEN + 32,
        ),
        BlobKind::Delta => return None,
        _ => (None, ENTRY_LEN),
    };
    let e = PackEntry {
        kind,
        id: ChunkId(b41[1..33].try_into().ok()?),
        offset: u32::from_le_bytes(b41[33..37].try_into().ok()?),
        len: u32::from_le_bytes(b41[37..41].try_into().ok()?),
        base,
    };
    Some((e, len))
}

pub(crate) fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// The length of the sealed trailer, from a pack's last [`FOOTER_LEN`] bytes.
pub(crate) fn trailer_len(key: &str, footer: &[u8], pack_len: u64) -> Result<u32> {
    let corrupt = |what: &str| RepoError::Corrupt {
        key: key.into(),
        offset: pack_len.saturating_sub(FOOTER_LEN as u64),
        what: what.into(),
    };
    if footer.len() != FOOTER_LEN || &footer[4..] != MAGIC {
        return Err(corrupt("no pack footer (truncated or not a pack)"));
    }
    let n = u32_at(footer, 0).unwrap_or(0);
    if (n as u64) + (HEADER_LEN + FOOTER_LEN) as u64 > pack_len {
        return Err(corrupt("trailer length points outside the pack"));
    }
    Ok(n)
}

/// Decrypts and parses a pack trailer.
pub(crate) fn parse_trailer(
    mkey: &MasterKey,
    key: &str,
    sealed: &[u8],
    offset: u64,
) -> Result<Vec<PackEntry>> {
    let corrupt = |what: &str| RepoError::Corrupt {
        key: key.into(),
        offset,
        what: what.into(),
    };
    let t = mkey
        .open(sealed, TRAILER_AAD)
        .ok_or_else(|| corrupt("pack trailer fails authentication"))?;
    parse_trailer_plain(key, &t, offset)
}

/// Parses the plaintext of a pack trailer.
pub(crate) fn parse_trailer_plain(key: &str, t: &[u8], offset: u64) -> Result<Vec<PackEntry>> {
    let corrupt = |what: &str| RepoError::Corrupt {
        key: key.into(),
        offset,
        what: what.into(),
    };
    let version = u32_at(t, 0).ok_or_else(|| corrupt("short trailer"))?;
    if !(ENTRIES_V1..=ENTRIES_V2).contains(&version) {
        return Err(RepoError::UnsupportedVersion {
            key: key.into(),
            found: version,
            supported: ENTRIES_V2,
        });
    }
    let count = u32_at(t, 4).ok_or_else(|| corrupt("short trailer"))? as usize;
    let mut out = Vec::with_capacity(count.min(t.len() / ENTRY_LEN));
    let mut at = 8;
    for _ in 0..count {
        let (e, n) = decode_entry(&t[at..], version)
            .ok_or_else(|| corrupt("bad or short entry in trailer"))?;
        out.push(e);
        at += n;
    }
    if at != t.len() {
        return Err(corrupt("trailer length does not match its entry count"));
    }
    Ok(out)
}

/// Parses a whole pack: its entries from the trailer, checking header and bounds.
pub(crate) fn parse_pack(mkey: &MasterKey, key: &str, data: &[u8]) -> Result<Vec<PackEntry>> {
    let len = data.len() as u64;
    if data.len() < HEADER_LEN + FOOTER_LEN || &data[..4] != MAGIC {
        return Err(RepoError::Corrupt {
            key: key.into(),
            offset: 0,
            what: "no pack header".into(),
        });
    }
    let n = trailer_len(key, &data[data.len() - FOOTER_LEN..], len)? as usize;
    let start = data.len() - FOOTER_LEN - n;
    let entries = parse_trailer(
        mkey,
        key,
        &data[start..data.len() - FOOTER_LEN],
        start as u64,
    )?;
    for e in &entries {
        if (e.offset as usize) < HEADER_LEN || e.offset as usize + e.len as usize > start {
            return Err(RepoError::Corrupt {
                key: key.into(),
                offset: e.offset as u64,
                what: "trailer entry points outside the blob area".into(),
            });
        }
    }
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_round_trip_compressed_and_raw() {
        let k = MasterKey::from_secret(&[1; 32]);
        let zeros_ish = vec![7u8; 100_000];
        let random: Vec<u8> = (0..50_000u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let mut p = PackBuilder::new();
        for plain in [&zeros_ish, &random] {
            let id = k.chunk_key().chunk_id(plain);
            p.push(
                BlobKind::Data,
                id,
                &seal_blob(&k, BlobKind::Data, &id, plain),
            );
        }
        let f = p.finish(&k);
        assert_eq!(f.id, *blake3::hash(&f.data).as_bytes());
        // The repetitive blob was compressed.
        assert!(f.entries[0].len < 1000);
        let entries = parse_pack(&k, "p", &f.data).unwrap();
        assert_eq!(entries, f.entries);
        for (e, plain) in entries.iter().zip([&zeros_ish, &random]) {
            let s = &f.data[e.offset as usize..(e.offset + e.len) as usize];
            assert_eq!(open_blob(&k, e.kind, &e.id, s).as_deref(), Some(&plain[..]));
            assert!(open_blob(&k, BlobKind::List, &e.id, s).is_none());
        }
        let mut bad = f.data.to_vec();
        bad[entries[1].offset as usize + 100] ^= 0x10;
        let e = entries[1];
        assert!(
            open_blob(
                &k,
                e.kind,
                &e.id,
                &bad[e.offset as usize..(e.offset + e.len) as usize]
            )
            .is_none()
        );
    }

    #[test]
    fn a_blob_sealed_into_a_given_back_buffer_opens_as_its_plaintext() {
        use rand::{RngCore, SeedableRng, rngs::StdRng};
        let k = MasterKey::from_secret(&[3; 32]);
        let mut random = vec![0u8; 300_000];
        StdRng::seed_from_u64(3).fill_bytes(&mut random);
        let text: Vec<u8> = b"a page of a database ".repeat(15_000);
        let spares = SpareBuffers::keeping(1);
        // A raw blob first, then a compressed one and an empty one in its buffer (more
        // room than they need, stale bytes in it), then the raw one again in the
        // compressed one's, each level.
        for (plain, level) in [(&random, 2), (&text, 2), (&Vec::new(), 3), (&random, 3)] {
            let out = spares.take(0).unwrap_or_default();
            let id = k.chunk_key().chunk_id(plain);
            let sealed = seal_blob_into(&k, BlobKind::Data, &id, plain, level, out);
            assert!(sealed.len() <= sealed_len(plain.len()));
            assert_eq!(open_blob(&k, BlobKind::Data, &id, &sealed).unwrap(), plain);
            spares.give(sealed);
        }
        // The buffer went round: one kept, no more.
        spares.give(Vec::with_capacity(10));
        assert!(spares.take(300_000).is_some() && spares.take(0).is_none());
    }

    #[test]
    fn large_blobs_are_stored_raw_only_where_compressing_them_whole_does_not_pay() {
        use rand::{RngCore, SeedableRng, rngs::StdRng};
        let k = MasterKey::from_secret(&[2; 32]);
        let mut random = vec![0u8; 1 << 20];
        StdRng::seed_from_u64(1).fill_bytes(&mut random);
        // Random: stored raw (a flag byte and the seal more).
        let id = k.chunk_key().chunk_id(&random);
        assert_eq!(
            seal_blob(&k, BlobKind::Data, &id, &random).len(),
            random.len() + 1 + 40
        );
        // Every random 8 KiB block twice in a row: no 4 KiB piece of it compresses, the
        // whole does to half (a sampler of 4 KiB pieces stored it raw).
        let mut repeated = random.clone();
        for at in (0..repeated.len()).step_by(16 << 10) {
            repeated.copy_within(at..at + (8 << 10), at + (8 << 10));
        }
        let id = k.chunk_key().chunk_id(&repeated);
        for level in [VOLUME_ZSTD_LEVEL, ZSTD_LEVEL] {
            let sealed = seal_blob_into(&k, BlobKind::Data, &id, &repeated, level, Vec::new());
            assert!(sealed.len() < repeated.len() * 5 / 8, "{}", sealed.len());
            assert_eq!(
                open_blob(&k, BlobKind::Data, &id, &sealed).unwrap(),
                repeated
            );
        }
    }

    #[test]
    fn delta_entries_need_trailer_version_2_and_v1_still_reads() {
        let k = MasterKey::from_secret(&[4; 32]);
        let chunk = vec![9u8; 5000];
        let id = k.chunk_key().chunk_id(&chunk);
        let mut p = PackBuilder::new();
        p.push(
            BlobKind::Data,
            id,
            &seal_blob(&k, BlobKind::Data, &id, &chunk),
        );
        let v1 = p.finish(&k);
        assert_eq!(entries_version(&v1.entries), ENTRIES_V1);
        assert_eq!(parse_pack(&k, "v1", &v1.data).unwrap(), v1.entries);

        let did = ChunkId([7; 32]);
        let mut p = PackBuilder::new();
        p.push(
            BlobKind::Data,
            id,
            &seal_blob(&k, BlobKind::Data, &id, &chunk),
        );
        p.push_delta(did, id, &seal_blob(&k, BlobKind::Delta, &did, b"delta"));
        let v2 = p.finish(&k);
        assert_eq!(entries_version(&v2.entries), ENTRIES_V2);
        let entries = parse_pack(&k, "v2", &v2.data).unwrap();
        assert_eq!(entries, v2.entries);
        assert_eq!(entries[1].base, Some(id));
        assert_eq!(entries[1].kind, BlobKind::Delta);
        // A delta blob opens without an id check (its chunk is checked when rebuilt).
        let e = entries[1];
        let s = &v2.data[e.offset as usize..(e.offset + e.len) as usize];
        assert_eq!(
            open_blob(&k, BlobKind::Delta, &did, s).unwrap(),
            &b"delta"[..]
        );
        assert!(open_blob(&k, BlobKind::Data, &did, s).is_none());
    }
}
