use std::ops::Range;

/// The page size for sub-chunk deltas: a changed chunk is compared page by page and only
/// the differing pages are written or shipped.
pub const PAGE_SIZE: usize = 4096;

/// The byte ranges where `a` and `b` differ, at `page` granularity, adjacent differing
/// pages merged into one range. Both slices must have the same length; the last page
/// may be short.
pub fn differing_pages(a: &[u8], b: &[u8], page: usize) -> Vec<Range<usize>> {
    assert_eq!(
        a.len(),
        b.len(),
        "compared buffers must have the same length"
    );
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (i, (pa, pb)) in a.chunks(page).zip(b.chunks(page)).enumerate() {
        if pa != pb {
            let start = i * page;
            let end = start + pa.len();
            match runs.last_mut() {
                Some(last) if last.end == start => last.end = end,
                _ => runs.push(start..end),
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
