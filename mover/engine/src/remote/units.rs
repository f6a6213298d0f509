//! How each chunk of a group is read when an earlier cycle's index is trusted: not at
//! all (unchanged), whole, or only its written units, the others' chaining values coming
//! from the cycle's CV file (see [`chunker::cv`]).

use super::KnownChunks;
use chunker::{
    BlockVolume, ChunkKey, ChunkKind, ChunkSize, Window, classify,
    cv::{Cv, CvFile, UNIT_LEN, UnitHasher},
};
use rayon::prelude::*;
use std::{collections::HashMap, ops::Range};

/// How one chunk is read.
pub(crate) enum Read {
    /// Not read: unchanged since the known cycle, its kind is the known one.
    Known,
    /// Read whole.
    Whole,
    /// Only the units flagged in `written` are read; `cvs` are the chunk's unit CVs at
    /// the known cycle.
    Units { cvs: Vec<Cv>, written: Vec<bool> },
}

/// Per unit of `unit` bytes of the `len` bytes at `at`: whether any of `written` (sorted,
/// not overlapping) touches it.
pub(crate) fn units_written(written: &[Range<u64>], at: u64, len: usize, unit: usize) -> Vec<bool> {
    let unit = unit as u64;
    let mut out = vec![false; len.div_ceil(unit as usize)];
    let end = at + len as u64;
    let first = written.partition_point(|r| r.end <= at);
    for r in written[first..].iter().take_while(|r| r.start < end) {
        let (s, e) = (r.start.max(at) - at, r.end.min(end) - at);
        out[(s / unit) as usize..e.div_ceil(unit) as usize]
            .iter_mut()
            .for_each(|w| *w = true);
    }
    out
}

/// Records of unit CVs kept in memory for one pass at most: past that, changed chunks
/// are read whole.
const RECORDS_BUDGET: usize = 32 << 20;

/// The stored unit CVs of the changed chunks of `known` that are still valid, read from
/// `file` before the pass in a few large reads (one small read per chunk would cost more
/// than reading the chunk).
pub(crate) fn load_records(
    known: &KnownChunks,
    file: &CvFile,
    chunk: ChunkSize,
    size: u64,
) -> HashMap<u64, Vec<Cv>> {
    let wanted = known
        .changed
        .iter()
        .enumerate()
        .filter(|(_, c)| **c)
        .map(|(i, _)| {
            let len = chunk.get().min(size - i as u64 * chunk.get()) as usize;
            (i as u64, len, known.base[i])
        })
        .filter(|(_, len, _)| UnitHasher::covers(*len));
    file.load(wanted, RECORDS_BUDGET)
}

/// The plan for the chunks of the group at `offset` (`len` bytes, its first chunk
/// `first`). Without `known`, every chunk is read whole; with `records` (see
/// [`load_records`]), changed chunks that have one are read by unit.
pub(crate) fn plan(
    known: Option<&KnownChunks>,
    records: Option<&HashMap<u64, Vec<Cv>>>,
    chunk: ChunkSize,
    first: usize,
    offset: u64,
    len: usize,
) -> Vec<Read> {
    let cs = chunk.bytes();
    (0..len.div_ceil(cs))
        .map(|i| {
            let Some(k) = known else { return Read::Whole };
            let c = first + i;
            if !k.changed[c] {
                return Read::Known;
            }
            let Some(cvs) = records.and_then(|r| r.get(&(c as u64))) else {
                return Read::Whole;
            };
            let (at, clen) = (offset + (i * cs) as u64, cs.min(len - i * cs));
            let written = units_written(&k.ranges, at, clen, UNIT_LEN);
            // Reading most of the chunk anyway: read all of it, and renew its record.
            if written.iter().filter(|w| **w).count() * 2 > written.len() {
                return Read::Whole;
            }
            Read::Units {
                cvs: cvs.clone(),
                written,
            }
        })
        .collect()
}

/// Reads the written units of the `Units` chunks into `win`; the rest of those chunks
/// is not shipped (only written pages are). Runs closer than a seek's worth are read in
/// one go, across chunks. Returns the bytes read.
pub(crate) fn read_units(
    volume: &BlockVolume,
    chunk: ChunkSize,
    plans: &[Read],
    win: &mut Window,
) -> std::io::Result<u64> {
    /// Gaps up to this are read through: one read of a few more bytes beats two.
    const BRIDGE: usize = 64 << 10;
    let len = win.buf.len();
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (i, p) in plans.iter().enumerate() {
        let Read::Units { written, .. } = p else {
            continue;
        };
        win.unread[i] = false;
        let base = i * chunk.bytes();
        for (u, w) in written.iter().enumerate() {
            if !w {
                continue;
            }
            let (s, e) = (base + u * UNIT_LEN, (base + (u + 1) * UNIT_LEN).min(len));
            match runs.last_mut() {
                Some(r) if s <= r.end + BRIDGE => r.end = e,
                _ => runs.push(s..e),
            }
        }
    }
    let mut read = 0;
    for r in runs {
        volume
            .read_exact_at(&mut win.buf[r.clone()], win.offset + r.start as u64)
            .map_err(std::io::Error::other)?;
        read += r.len() as u64;
    }
    Ok(read)
}

/// The kinds of a group's chunks (in parallel on the rayon pool, or on this thread where
/// the caller is one of many doing this side by side): known ones as they were, the
/// others from what was read; with a CV file, every chunk read gets its record renewed
/// there.
#[allow(clippy::too_many_arguments)]
pub(crate) fn kinds(
    key: &ChunkKey,
    chunk: ChunkSize,
    win: &Window,
    plans: &[Read],
    known: Option<&KnownChunks>,
    first: usize,
    cvs: Option<&CvFile>,
    parallel: bool,
) -> Vec<ChunkKind> {
    // Nothing read (and no buffer): every kind is the known one.
    if let Some(k) = known
        && plans.iter().all(|p| matches!(p, Read::Known))
    {
        return (first..first + plans.len()).map(|c| k.base[c]).collect();
    }
    let kind = |(i, r): (usize, Range<usize>)| {
        let c = first + i;
        let data = &win.buf[r.clone()];
        let hole = win.unread[i];
        let unit_cvs = match (&plans[i], cvs) {
            (Read::Known, _) => return known.expect("Known needs an index").base[c],
            (Read::Whole, None) => return classify(key, data, hole),
            (Read::Whole, Some(_)) if !UnitHasher::covers(r.len()) => {
                return classify(key, data, hole);
            }
            (Read::Whole, Some(f)) if hole => f.hasher().zero_cvs(r.len()).into_owned(),
            (Read::Whole, Some(f)) => f.hasher().cvs(data),
            (Read::Units { cvs, written }, Some(f)) => {
                let mut cvs = cvs.clone();
                for (u, piece) in data.chunks(UNIT_LEN).enumerate() {
                    if written[u] {
                        cvs[u] = f.hasher().unit_cv(u, piece);
                    }
                }
                cvs
            }
            (Read::Units { .. }, None) => unreachable!("units are planned from a CV file"),
        };
        let f = cvs.expect("CVs come from a CV file");
        if let Err(e) = f.put(c as u64, &unit_cvs) {
            // A missing record only costs a whole read of the chunk next time.
            tracing::debug!(chunk = c, "cannot record the chunk's CVs: {e}");
        }
        f.hasher().kind(&unit_cvs, r.len())
    };
    let ranges = win.chunk_ranges(chunk).enumerate();
    match parallel {
        true => ranges
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(kind)
            .collect(),
        false => ranges.map(kind).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_written_flags_every_unit_a_range_touches() {
        let w = [10..20, 8192..8193, 40_000..50_000];
        assert_eq!(
            units_written(&w, 0, 65536, 8192),
            [true, true, false, false, true, true, true, false]
        );
        assert_eq!(units_written(&w, 32768, 8192, 4096), [false, true]);
        assert_eq!(units_written(&[], 0, 100, 4096), [false]);
    }
}
