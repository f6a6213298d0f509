use crate::{
    error::{ChunkerError, Result},
    id::{ChunkId, ChunkKey},
};
use fastcdc::v2020::{FastCDC, Normalization, StreamCDC};
use std::io::Read;

/// Sizes for content-defined chunking.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CdcParams {
    /// Smallest chunk (except the last).
    pub min: u32,
    /// Target average.
    pub avg: u32,
    /// Largest chunk.
    pub max: u32,
}

impl Default for CdcParams {
    /// 256 KiB / 1 MiB / 4 MiB: the average matches the block chunk size.
    fn default() -> Self {
        CdcParams {
            min: 256 << 10,
            avg: 1 << 20,
            max: 4 << 20,
        }
    }
}

impl CdcParams {
    /// Checks the sizes against what FastCDC v2020 accepts.
    pub fn validate(&self) -> Result<()> {
        use fastcdc::v2020::{
            AVERAGE_MAX, AVERAGE_MIN, MAXIMUM_MAX, MAXIMUM_MIN, MINIMUM_MAX, MINIMUM_MIN,
        };
        let ok = (MINIMUM_MIN..=MINIMUM_MAX).contains(&self.min)
            && (AVERAGE_MIN..=AVERAGE_MAX).contains(&self.avg)
            && (MAXIMUM_MIN..=MAXIMUM_MAX).contains(&self.max)
            && self.min <= self.avg
            && self.avg <= self.max;
        if ok {
            Ok(())
        } else {
            Err(ChunkerError::InvalidSize {
                given: format!("{self:?}"),
                why: format!(
                    "FastCDC needs min in {MINIMUM_MIN}..={MINIMUM_MAX}, avg in \
                     {AVERAGE_MIN}..={AVERAGE_MAX}, max in {MAXIMUM_MIN}..={MAXIMUM_MAX} \
                     and min <= avg <= max"
                ),
            })
        }
    }
}

/// One content-defined chunk of a byte stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CdcChunk {
    /// Offset in the stream.
    pub offset: u64,
    /// Length in bytes.
    pub len: usize,
    /// Keyed BLAKE3 of the bytes.
    pub id: ChunkId,
}

/// FastCDC v2020 with a gear table seeded from the chunk key.
///
/// Seeding means cut points, like ids, depend on the key, so chunk lengths do not
/// fingerprint known files to an outsider (restic and borg do the same with a
/// secret polynomial / seed).
#[derive(Clone, Debug)]
pub struct CdcChunker {
    key: ChunkKey,
    params: CdcParams,
    seed: u64,
}

impl CdcChunker {
    /// A chunker for `key` with `params` (validated).
    pub fn new(key: ChunkKey, params: CdcParams) -> Result<Self> {
        params.validate()?;
        let derived = key.tagged_hash(0xcd, &[b"fastcdc gear seed"]);
        let seed = u64::from_le_bytes(derived.0[..8].try_into().expect("8 bytes"));
        Ok(CdcChunker { key, params, seed })
    }

    /// Cuts an in-memory buffer, returning the chunks with their ids.
    pub fn chunk_slice(&self, data: &[u8]) -> Vec<CdcChunk> {
        let p = self.params;
        FastCDC::with_level_and_seed(data, p.min, p.avg, p.max, Normalization::Level1, self.seed)
            .map(|c| CdcChunk {
                offset: c.offset as u64,
                len: c.length,
                id: self.key.chunk_id(&data[c.offset..c.offset + c.length]),
            })
            .collect()
    }

    /// Cuts a stream, yielding each chunk with its bytes; memory stays at `max` bytes.
    pub fn chunk_stream<R: Read>(
        &self,
        reader: R,
    ) -> impl Iterator<Item = std::io::Result<(CdcChunk, Vec<u8>)>> + use<'_, R> {
        let p = self.params;
        StreamCDC::with_level_and_seed(
            reader,
            p.min,
            p.avg,
            p.max,
            Normalization::Level1,
            self.seed,
        )
        .map(move |r| {
            let c = r.map_err(std::io::Error::from)?;
            let id = self.key.chunk_id(&c.data);
            Ok((
                CdcChunk {
                    offset: c.offset,
                    len: c.length,
                    id,
                },
                c.data,
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{RngCore, SeedableRng, rngs::StdRng};

    fn small() -> CdcParams {
        CdcParams {
            min: 4096,
            avg: 16384,
            max: 65536,
        }
    }

    #[test]
    fn an_insert_changes_only_nearby_chunks() {
        let mut data = vec![0u8; 2 << 20];
        StdRng::seed_from_u64(7).fill_bytes(&mut data);
        let c = CdcChunker::new(ChunkKey::local(), small()).unwrap();
        let before = c.chunk_slice(&data);
        let mut edited = data.clone();
        edited.splice(1 << 20..1 << 20, [0xAB; 100]);
        let after = c.chunk_slice(&edited);
        let old: std::collections::HashSet<_> = before.iter().map(|c| c.id).collect();
        let new_bytes: usize = after
            .iter()
            .filter(|c| !old.contains(&c.id))
            .map(|c| c.len)
            .sum();
        assert!(
            new_bytes < 4 * 65536,
            "an insert of 100 bytes made {new_bytes} new bytes"
        );
        assert_eq!(after.iter().map(|c| c.len).sum::<usize>(), edited.len());
    }

    #[test]
    fn stream_and_slice_agree_and_seed_depends_on_key() {
        let mut data = vec![0u8; 1 << 20];
        StdRng::seed_from_u64(8).fill_bytes(&mut data);
        let c = CdcChunker::new(ChunkKey::local(), small()).unwrap();
        let streamed: Vec<CdcChunk> = c.chunk_stream(&data[..]).map(|r| r.unwrap().0).collect();
        assert_eq!(streamed, c.chunk_slice(&data));
        let other = CdcChunker::new(ChunkKey::from_bytes([9; 32]), small()).unwrap();
        let cuts = |v: &[CdcChunk]| v.iter().map(|c| c.offset).collect::<Vec<_>>();
        assert_ne!(cuts(&other.chunk_slice(&data)), cuts(&streamed));
    }

    #[test]
    fn rejects_bad_params() {
        assert!(
            CdcChunker::new(
                ChunkKey::local(),
                CdcParams {
                    min: 10,
                    avg: 16384,
                    max: 65536
                }
            )
            .is_err()
        );
        assert!(
            CdcChunker::new(
                ChunkKey::local(),
                CdcParams {
                    min: 65536,
                    avg: 16384,
                    max: 65536
                }
            )
            .is_err()
        );
    }
}
