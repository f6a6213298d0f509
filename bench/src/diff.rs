//! Sparse-aware comparison of two images, 4 KiB page by 4 KiB page.
//!
//! Used to count the pages a "day of changes" touched (the floor for a delta copy's writes)
//! and to check every copy is byte-identical to its source. Only ranges holding data in at
//! least one file are read; ranges that are holes in both are zeros in both.

use std::fs::File;
use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, Result, bail};
use rustix::fs::SeekFrom;
use serde::{Deserialize, Serialize};

/// The page size the comparison works in.
pub const PAGE: u64 = 4096;

/// How much is read per `pread`.
const BLOCK: usize = 1 << 20;

/// The result of comparing two equally long images.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageDiff {
    /// Pages in each image.
    pub total_pages: u64,
    /// Pages read and compared (holding data in at least one image).
    pub compared_pages: u64,
    /// Pages whose bytes differ.
    pub differing_pages: u64,
}

impl PageDiff {
    /// Bytes in the differing pages.
    pub fn differing_bytes(&self) -> u64 {
        self.differing_pages * PAGE
    }
}

/// Compares `a` and `b`, which must have the same length.
pub fn compare(a: &Path, b: &Path) -> Result<PageDiff> {
    let open =
        |path: &Path| File::open(path).with_context(|| format!("cannot open {}", path.display()));
    let (fa, fb) = (open(a)?, open(b)?);
    let len = fa.metadata()?.len();
    let len_b = fb.metadata()?.len();
    if len != len_b {
        bail!(
            "{} is {len} bytes but {} is {len_b}",
            a.display(),
            b.display()
        );
    }
    let ranges = union(data_extents(&fa, len)?, data_extents(&fb, len)?);
    let mut diff = PageDiff {
        total_pages: len.div_ceil(PAGE),
        compared_pages: 0,
        differing_pages: 0,
    };
    let (mut buf_a, mut buf_b) = (vec![0u8; BLOCK], vec![0u8; BLOCK]);
    for range in ranges {
        let mut offset = range.start;
        while offset < range.end {
            let n = (range.end - offset).min(BLOCK as u64) as usize;
            read_at(&fa, a, &mut buf_a[..n], offset)?;
            read_at(&fb, b, &mut buf_b[..n], offset)?;
            diff.compared_pages += (n as u64).div_ceil(PAGE);
            diff.differing_pages += differing_pages(&buf_a[..n], &buf_b[..n]);
            offset += n as u64;
        }
    }
    Ok(diff)
}

/// Reads exactly `buf.len()` bytes of `file` at `offset`.
fn read_at(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<()> {
    file.read_exact_at(buf, offset)
        .with_context(|| format!("cannot read {} at offset {offset}", path.display()))
}

/// Number of [`PAGE`]-sized pages (the last may be short) that differ between `a` and `b`.
fn differing_pages(a: &[u8], b: &[u8]) -> u64 {
    a.chunks(PAGE as usize)
        .zip(b.chunks(PAGE as usize))
        .filter(|(x, y)| x != y)
        .count() as u64
}

/// The byte ranges of `file` holding data, from `SEEK_DATA`/`SEEK_HOLE`, widened to whole
/// pages. Files (or filesystems) without hole support count as one data range.
fn data_extents(file: &File, len: u64) -> Result<Vec<Range<u64>>> {
    let mut extents = Vec::new();
    let mut offset = 0;
    while offset < len {
        let start = match rustix::fs::seek(file, SeekFrom::Data(offset)) {
            Ok(start) => start,
            Err(rustix::io::Errno::NXIO) => break,
            Err(rustix::io::Errno::INVAL) if offset == 0 => {
                extents.push(0..len);
                break;
            }
            Err(err) => return Err(err).context("SEEK_DATA failed"),
        };
        let end = rustix::fs::seek(file, SeekFrom::Hole(start)).context("SEEK_HOLE failed")?;
        extents.push(start / PAGE * PAGE..end.div_ceil(PAGE).saturating_mul(PAGE).min(len));
        offset = end;
    }
    Ok(extents)
}

/// The sorted union of two sorted lists of ranges, with overlapping or touching ranges
/// merged.
fn union(a: Vec<Range<u64>>, b: Vec<Range<u64>>) -> Vec<Range<u64>> {
    let mut all = a;
    all.extend(b);
    all.sort_by_key(|range| range.start);
    let mut merged: Vec<Range<u64>> = Vec::with_capacity(all.len());
    for range in all {
        match merged.last_mut() {
            Some(last) if range.start <= last.end => last.end = last.end.max(range.end),
            _ => merged.push(range),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn union_merges_overlaps_and_keeps_gaps() {
        assert_eq!(
            union(vec![0..10, 50..60], vec![5..20, 20..30, 70..80]),
            vec![0..30, 50..60, 70..80]
        );
    }

    #[test]
    fn counts_differing_pages_including_a_short_last_page() {
        let a = vec![0u8; 3 * 4096 + 100];
        let mut b = a.clone();
        b[5000] = 1;
        b[3 * 4096 + 99] = 1;
        assert_eq!(differing_pages(&a, &b), 2);
    }

    #[test]
    fn compares_sparse_files_by_page() {
        let dir = std::env::temp_dir().join(format!("mover-bench-diff-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (pa, pb) = (dir.join("a"), dir.join("b"));
        let len = 64 << 20;
        for path in [&pa, &pb] {
            let file = File::create(path).unwrap();
            file.set_len(len).unwrap();
            file.write_all_at(&[7u8; 8192], 10 << 20).unwrap();
        }
        // Same data in both, then one page changed and one page written only in b.
        File::options()
            .write(true)
            .open(&pb)
            .unwrap()
            .write_all_at(&[9u8; 1], (10 << 20) + 4096)
            .unwrap();
        let mut fb = File::options().write(true).open(&pb).unwrap();
        std::io::Seek::seek(&mut fb, std::io::SeekFrom::Start(40 << 20)).unwrap();
        fb.write_all(&[1u8; 10]).unwrap();
        let diff = compare(&pa, &pb).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(diff.total_pages, len / PAGE);
        assert_eq!(diff.differing_pages, 2);
        assert!(diff.compared_pages < 1024, "holes are skipped: {diff:?}");
    }
}
