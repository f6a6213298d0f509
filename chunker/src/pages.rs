use std::ops::Range;

/// The page size for sub-chunk deltas: a changed chunk is compared page by page and only
/// the differing pages are written or shipped.
pub const PAGE_SIZE: usize = 4096;

/// Bytes of a page hash: 128 bits, ample to tell changed pages apart under a key.
pub const PAGE_HASH_LEN: usize = 16;

/// One keyed hash per 4 KiB page of `data` (the last page may be short), appended to `out`.
/// Two sides compare these to ship only the pages that differ inside a changed chunk.
pub fn page_hashes(key: &crate::ChunkKey, data: &[u8], out: &mut Vec<u8>) {
    for page in data.chunks(PAGE_SIZE) {
        out.extend_from_slice(&key.tagged_hash(0x50, &[page]).0[..PAGE_HASH_LEN]);
    }
}

/// The byte ranges where `a` and `b` differ, at `page` granularity, adjacent differing
/// pages merged into one range. Both slices must have the same length; the last page
/// may be short.
pub fn differing_pages(a: &[u8], b: &[u8], page: usize) -> Vec<Range<usize>> {
    assert_eq!(
        a.len(),
        b.len(),
        "compared buffers must have the same length"
    );
    page_runs(a.len(), page, |r| a[r.clone()] != b[r])
}

/// The byte ranges of the pages of `len` bytes (the last one may be short) for which
/// `differs` holds, given each page's range, adjacent ones merged into one range.
pub fn page_runs(
    len: usize,
    page: usize,
    differs: impl Fn(Range<usize>) -> bool,
) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for start in (0..len).step_by(page) {
        let this = start..(start + page).min(len);
        if differs(this.clone()) {
            match runs.last_mut() {
                Some(last) if last.end == start => last.end = this.end,
                _ => runs.push(this),
            }
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_and_merges_differing_pages() {
        let a = vec![0u8; 10 * 4096 + 100];
        let mut b = a.clone();
        assert!(differing_pages(&a, &b, 4096).is_empty());
        b[5] = 1; // page 0
        b[4096 * 3 + 4095] = 1; // page 3
        b[4096 * 4] = 1; // page 4, adjacent to 3
        b[10 * 4096 + 99] = 1; // short last page
        assert_eq!(
            differing_pages(&a, &b, 4096),
            vec![0..4096, 3 * 4096..5 * 4096, 10 * 4096..10 * 4096 + 100]
        );
    }
}
