//! What to do with one chunk: a pure function of the source and destination bytes.

use chunker::{PAGE_SIZE, cv::Cv, differing_pages, is_zero, page_runs};
use std::ops::Range;

/// One change to apply to the destination, as a byte range within the chunk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Write the source bytes of this range.
    Write(Range<usize>),
    /// Make this range read as zeros, as a hole where the destination supports it.
    Zero(Range<usize>),
}

/// What the source holds in this chunk.
#[derive(Clone, Copy, Debug)]
pub enum SrcChunk<'a> {
    /// Only zeros (or a hole) of this length.
    Zero(usize),
    /// These bytes, not all zero.
    Data(&'a [u8]),
}

/// What the destination holds where this chunk goes.
#[derive(Clone, Copy, Debug)]
pub enum DstChunk<'a> {
    /// Known to read as zeros (a new sparse file, or a hole) and not read.
    Zeros,
    /// These bytes, read from the destination.
    Bytes(&'a [u8]),
    /// Not all zeros, and known by the CVs of its pages saved in its index (not read):
    /// `saved` are its pages', `source` the source's, page for page. Equal CVs are
    /// equal pages.
    Pages { saved: &'a [Cv], source: &'a [Cv] },
}

/// The ops that make `dst` equal `src`, page by page. Zero pages of the source are
/// never written as data: onto zeros they are skipped, elsewhere they become holes.
pub fn plan_chunk(src: SrcChunk<'_>, dst: DstChunk<'_>, ops: &mut Vec<Op>) {
    match (src, dst) {
        (SrcChunk::Zero(_), DstChunk::Zeros) => {}
        (SrcChunk::Zero(len), DstChunk::Bytes(d)) => {
            if !is_zero(d) {
                ops.push(Op::Zero(0..len));
            }
        }
        (SrcChunk::Zero(len), DstChunk::Pages { .. }) => ops.push(Op::Zero(0..len)),
        (SrcChunk::Data(src), DstChunk::Zeros) => data_pages(src, 0..src.len(), ops),
        (SrcChunk::Data(src), DstChunk::Bytes(d)) => {
            for run in differing_pages(src, d, PAGE_SIZE) {
                split_zero_pages(src, run, ops);
            }
        }
        (SrcChunk::Data(src), DstChunk::Pages { saved, source }) => {
            if saved.len() != source.len() || source.len() != src.len().div_ceil(PAGE_SIZE) {
                debug_assert!(false, "page CVs do not match the chunk");
                return split_zero_pages(src, 0..src.len(), ops);
            }
            let differs =
                |r: Range<usize>| saved[r.start / PAGE_SIZE] != source[r.start / PAGE_SIZE];
            let runs = page_runs(src.len(), PAGE_SIZE, differs);
            for run in runs {
                split_zero_pages(src, run, ops);
            }
        }
    }
}

/// Pushes Write ops for the non-zero pages of `src[range]`, skipping zero pages.
fn data_pages(src: &[u8], range: Range<usize>, ops: &mut Vec<Op>) {
    for_page_runs(src, range, |zero, r| {
        if !zero {
            push_merged(ops, Op::Write(r));
        }
    });
}

/// Pushes Write ops for the non-zero pages of `src[range]` and Zero ops for its zero pages.
fn split_zero_pages(src: &[u8], range: Range<usize>, ops: &mut Vec<Op>) {
    for_page_runs(src, range, |zero, r| {
        push_merged(ops, if zero { Op::Zero(r) } else { Op::Write(r) })
    });
}

/// Calls `f(is_zero, run)` for each maximal run of pages in `range` that are all zero
/// or all non-zero.
fn for_page_runs(src: &[u8], range: Range<usize>, mut f: impl FnMut(bool, Range<usize>)) {
    let mut current: Option<(bool, Range<usize>)> = None;
    let mut start = range.start;
    while start < range.end {
        let end = (start + PAGE_SIZE).min(range.end);
        let zero = is_zero(&src[start..end]);
        match &mut current {
            Some((z, r)) if *z == zero => r.end = end,
            _ => {
                if let Some((z, r)) = current.take() {
                    f(z, r);
                }
                current = Some((zero, start..end));
            }
        }
        start = end;
    }
    if let Some((z, r)) = current {
        f(z, r);
    }
}

/// Appends `op`, merging it into the last op when they are the same kind and adjacent.
pub fn push_merged(ops: &mut Vec<Op>, op: Op) {
    match (ops.last_mut(), &op) {
        (Some(Op::Write(last)), Op::Write(r)) | (Some(Op::Zero(last)), Op::Zero(r))
            if last.end == r.start =>
        {
            last.end = r.end;
        }
        _ => ops.push(op),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: usize = PAGE_SIZE;

    fn page_image(pages: &[u8]) -> Vec<u8> {
        pages
            .iter()
            .flat_map(|&b| std::iter::repeat_n(b, P))
            .collect()
    }

    fn plan(src: &[u8], dst: DstChunk<'_>) -> Vec<Op> {
        let mut ops = vec![];
        let src = if is_zero(src) {
            SrcChunk::Zero(src.len())
        } else {
            SrcChunk::Data(src)
        };
        plan_chunk(src, dst, &mut ops);
        ops
    }

    #[test]
    fn onto_zeros_writes_only_data_pages() {
        let src = page_image(&[1, 1, 0, 0, 2]);
        assert_eq!(
            plan(&src, DstChunk::Zeros),
            vec![Op::Write(0..2 * P), Op::Write(4 * P..5 * P)]
        );
        assert!(plan(&page_image(&[0, 0]), DstChunk::Zeros).is_empty());
    }

    #[test]
    fn onto_old_copy_writes_changed_pages_and_zeroes_cleared_ones() {
        let src = page_image(&[1, 9, 0, 3, 4, 8]);
        let dst = page_image(&[1, 2, 7, 3, 4, 5]);
        assert_eq!(
            plan(&src, DstChunk::Bytes(&dst)),
            vec![
                Op::Write(P..2 * P),
                Op::Zero(2 * P..3 * P),
                Op::Write(5 * P..6 * P)
            ]
        );
        assert!(plan(&src, DstChunk::Bytes(&src.clone())).is_empty());
    }

    #[test]
    fn a_zero_chunk_clears_only_a_nonzero_destination() {
        let src = page_image(&[0, 0]);
        assert_eq!(
            plan(&src, DstChunk::Bytes(&page_image(&[0, 5]))),
            vec![Op::Zero(0..2 * P)]
        );
        assert!(plan(&src, DstChunk::Bytes(&page_image(&[0, 0]))).is_empty());
    }

    #[test]
    fn by_page_cvs_writes_the_pages_whose_cvs_differ_and_zeroes_cleared_ones() {
        let key = chunker::ChunkKey::local();
        let h = chunker::cv::UnitHasher::pages(&key, 6 * P).unwrap();
        let mut src = page_image(&[1, 9, 0, 3, 4, 8]);
        src.truncate(5 * P + 100); // a short last page
        let mut dst = page_image(&[1, 2, 7, 3, 4, 5]);
        dst.truncate(5 * P + 100);
        let (saved, source) = (h.cvs(&dst), h.cvs(&src));
        let by_cvs = plan(
            &src,
            DstChunk::Pages {
                saved: &saved,
                source: &source,
            },
        );
        assert_eq!(by_cvs, plan(&src, DstChunk::Bytes(&dst)), "as if read");
        assert_eq!(
            by_cvs,
            vec![
                Op::Write(P..2 * P),
                Op::Zero(2 * P..3 * P),
                Op::Write(5 * P..5 * P + 100)
            ]
        );
        let same = plan(
            &src,
            DstChunk::Pages {
                saved: &source,
                source: &source,
            },
        );
        assert!(same.is_empty());
        let zero = vec![0u8; src.len()];
        assert_eq!(
            plan(
                &zero,
                DstChunk::Pages {
                    saved: &saved,
                    source: &[]
                }
            ),
            vec![Op::Zero(0..src.len())]
        );
    }

    #[test]
    fn short_last_page_is_handled() {
        let mut src = page_image(&[1]);
        src.extend([7u8; 100]);
        let mut dst = page_image(&[1]);
        dst.extend([6u8; 100]);
        assert_eq!(
            plan(&src, DstChunk::Bytes(&dst)),
            vec![Op::Write(P..P + 100)]
        );
    }
}
