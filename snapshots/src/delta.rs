//! Sub-chunk deltas (docs/ARCHITECTURE.md): a changed chunk stored as the 4 KiB pages that
//! differ from a base chunk, so a scattered 8 KiB page write costs ~8 KiB, not a chunk.
//!
//! A delta blob ([`crate::BlobKind::Delta`]) is stored under the id of the chunk it
//! rebuilds (the keyed BLAKE3 of the whole chunk), so chunk lists and dedup do not change;
//! its index entry names the base, which is always a full data blob (depth 1: a chunk
//! whose parent is itself a delta is compared with that delta's base). A rebuilt chunk is
//! checked against its id before anyone sees it.
//!
//! Plaintext (compressed and sealed like any blob):
//! `"MVDL" u32le(version 1) base(32) u32le(chunk length) bitmap(ceil(pages/8)) page*`,
//! one bit per 4 KiB page (the last page may be short), the differing pages in order.

use chunker::{ChunkId, ChunkKey};

/// The page size deltas work in.
pub const DELTA_PAGE: usize = 4096;
const MAGIC: &[u8; 4] = b"MVDL";
const VERSION: u32 = 1;
const HEADER: usize = 4 + 4 + 32 + 4;

/// A chunk is stored as a delta only when at most this share of its pages differ
/// (1/`DELTA_MAX_SHARE`): beyond it the delta saves little and costs a base read on
/// restore.
pub const DELTA_MAX_SHARE: usize = 2;

/// The delta of `chunk` against `base` (its plaintext), or `None` if the lengths differ
/// or more than 1/[`DELTA_MAX_SHARE`] of the pages differ. Returns the plaintext and
/// the number of differing pages.
pub fn make_delta(base_id: &ChunkId, base: &[u8], chunk: &[u8]) -> Option<(Vec<u8>, usize)> {
    if base.len() != chunk.len() || chunk.is_empty() {
        return None;
    }
    let mut pairs = base.chunks(DELTA_PAGE).zip(chunk.chunks(DELTA_PAGE));
    let (bitmap, differing) = delta_bitmap(chunk.len(), |_| {
        let (a, b) = pairs.next().expect("one pair per page");
        a != b
    })?;
    Some((encode_delta(base_id, chunk, &bitmap), differing))
}

/// Marks which pages of a chunk of `len` bytes differ from its base (`differs`, asked
/// for each page in order): the bitmap a delta carries, and how many differ. `None` as
/// soon as more than 1/[`DELTA_MAX_SHARE`] do (no delta then).
pub fn delta_bitmap(
    len: usize,
    mut differs: impl FnMut(usize) -> bool,
) -> Option<(Vec<u8>, usize)> {
    let pages = len.div_ceil(DELTA_PAGE);
    let limit = pages / DELTA_MAX_SHARE;
    let mut bitmap = vec![0u8; pages.div_ceil(8)];
    let mut differing = 0;
    for p in 0..pages {
        if differs(p) {
            differing += 1;
            if differing > limit {
                return None;
            }
            bitmap[p / 8] |= 1 << (p % 8);
        }
    }
    Some((bitmap, differing))
}

/// The delta plaintext of `chunk` against base `base_id`: the pages `bitmap` marks.
pub fn encode_delta(base_id: &ChunkId, chunk: &[u8], bitmap: &[u8]) -> Vec<u8> {
    let marked = |p: usize| bitmap[p / 8] & (1 << (p % 8)) != 0;
    let differing = (0..chunk.len().div_ceil(DELTA_PAGE))
        .filter(|&p| marked(p))
        .count();
    let mut out = Vec::with_capacity(HEADER + bitmap.len() + differing * DELTA_PAGE);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&base_id.0);
    out.extend_from_slice(&(chunk.len() as u32).to_le_bytes());
    out.extend_from_slice(bitmap);
    for (p, page) in chunk.chunks(DELTA_PAGE).enumerate() {
        if marked(p) {
            out.extend_from_slice(page);
        }
    }
    out
}

/// The base a delta names, if `delta` is one.
pub fn delta_base(delta: &[u8]) -> Option<ChunkId> {
    if delta.get(..4)? != MAGIC {
        return None;
    }
    Some(ChunkId(delta.get(8..40)?.try_into().ok()?))
}

/// Why a delta could not be applied.
pub(crate) fn apply_delta(
    key: &ChunkKey,
    id: &ChunkId,
    base: &[u8],
    delta: &[u8],
) -> Result<Vec<u8>, String> {
    if delta.get(..4) != Some(MAGIC) {
        return Err("not a delta".into());
    }
    let version = crate::pack::u32_at(delta, 4).ok_or("short delta")?;
    if version != VERSION {
        return Err(format!("delta version {version} is not supported"));
    }
    let len = crate::pack::u32_at(delta, 40).ok_or("short delta")? as usize;
    if len != base.len() {
        return Err(format!(
            "delta is for a chunk of {len} bytes, its base has {}",
            base.len()
        ));
    }
    let pages = len.div_ceil(DELTA_PAGE);
    let bitmap = delta
        .get(HEADER..HEADER + pages.div_ceil(8))
        .ok_or("short delta")?;
    let mut at = HEADER + bitmap.len();
    let mut out = base.to_vec();
    for (p, page) in out.chunks_mut(DELTA_PAGE).enumerate() {
        if bitmap[p / 8] & (1 << (p % 8)) != 0 {
            let src = delta.get(at..at + page.len()).ok_or("short delta")?;
            page.copy_from_slice(src);
            at += page.len();
        }
    }
    if at != delta.len() {
        return Err("trailing bytes in delta".into());
    }
    if key.chunk_id(&out) != *id {
        return Err("the rebuilt chunk does not match its id".into());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_round_trip_only_differing_pages() {
        let key = ChunkKey::from_bytes([3; 32]);
        let base: Vec<u8> = (0..(1 << 20) + 100).map(|i| (i * 7 % 251) as u8).collect();
        let mut chunk = base.clone();
        chunk[5 * DELTA_PAGE + 17] ^= 1;
        chunk[200 * DELTA_PAGE] ^= 1;
        *chunk.last_mut().unwrap() ^= 1; // the short last page
        let (bid, id) = (key.chunk_id(&base), key.chunk_id(&chunk));
        let (d, n) = make_delta(&bid, &base, &chunk).unwrap();
        assert_eq!(n, 3);
        assert!(d.len() < 3 * DELTA_PAGE + 200, "{}", d.len());
        assert_eq!(delta_base(&d), Some(bid));
        assert_eq!(apply_delta(&key, &id, &base, &d).unwrap(), chunk);
        // A wrong base or a damaged delta is refused, never returned.
        let mut other = base.clone();
        other[0] ^= 1;
        assert!(apply_delta(&key, &id, &other, &d).is_err());
        assert!(apply_delta(&key, &id, &base, &d[..d.len() - 1]).is_err());
        // Too different: no delta.
        let noise: Vec<u8> = base.iter().map(|b| b ^ 0x55).collect();
        assert!(make_delta(&bid, &base, &noise).is_none());
        assert!(make_delta(&bid, &base, &chunk[..4096]).is_none());
    }
}
