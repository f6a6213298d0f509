//! The huge, mostly-hole image used to bound mover's memory on large volumes.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::prng::SplitMix64;

/// Logical size of the sparse image.
pub const SPARSE_SIZE: u64 = 64 << 30;
/// Number of data regions.
const REGIONS: u64 = 20;
/// Size of each data region.
const REGION_LEN: u64 = 16 << 20;
/// Regions start on multiples of this.
const ALIGN: u64 = 1 << 20;
/// Bytes generated and written at a time (divides [`REGION_LEN`]).
const BLOCK: usize = 1 << 20;

/// One written range of the sparse image.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// Byte offset.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Creates `path` as a [`SPARSE_SIZE`] file of holes with [`REGIONS`] random data regions
/// at scattered offsets (one per equal slot, so they never overlap); syncs it.
pub fn build(path: &Path, seed: u64) -> Result<Vec<Region>> {
    let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    file.set_len(SPARSE_SIZE)
        .with_context(|| format!("cannot size {}", path.display()))?;
    let mut rng = SplitMix64::new(seed, 21);
    let regions = layout(&mut rng);
    // Small blocks keep the bench's own peak RSS low: a child's ru_maxrss starts from it.
    let mut block = vec![0u8; BLOCK];
    for region in &regions {
        for offset in (region.offset..region.offset + region.len).step_by(BLOCK) {
            rng.fill(&mut block);
            file.write_all_at(&block, offset)
                .with_context(|| format!("cannot write {} at {offset}", path.display()))?;
        }
    }
    file.sync_all()?;
    Ok(regions)
}

/// Picks the regions: one per slot of `SPARSE_SIZE / REGIONS`, at a random aligned offset.
fn layout(rng: &mut SplitMix64) -> Vec<Region> {
    let slot = SPARSE_SIZE / REGIONS / ALIGN * ALIGN;
    (0..REGIONS)
        .map(|i| Region {
            offset: i * slot + rng.below((slot - REGION_LEN) / ALIGN) * ALIGN,
            len: REGION_LEN,
        })
        .collect()
}

/// Total data bytes in `regions`.
pub fn data_bytes(regions: &[Region]) -> u64 {
    regions.iter().map(|r| r.len).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_are_aligned_in_bounds_and_disjoint() {
        let regions = layout(&mut SplitMix64::new(3, 21));
        assert_eq!(regions.len() as u64, REGIONS);
        for pair in regions.windows(2) {
            assert!(pair[0].offset + pair[0].len <= pair[1].offset);
        }
        for r in &regions {
            assert_eq!(r.offset % ALIGN, 0);
            assert!(r.offset + r.len <= SPARSE_SIZE);
        }
    }
}
