//! A chunk's id from the BLAKE3 chaining values of its units (8 KiB pieces).
//!
//! A chunk id is the keyed BLAKE3 of the chunk, and BLAKE3 is a tree: the id is the root
//! of the chaining values (CVs) of the chunk's aligned power-of-two pieces. Keeping each
//! unit's CV lets a replication cycle find the new id of a chunk of which only a few
//! pages were written by reading and hashing those pages alone, not the whole chunk.
//!
//! Stored CVs need no checksum: merged, they must give the chunk's id as recorded
//! elsewhere, so a stale or torn record is detected and the chunk is read whole.
//!
//! A local copy keeps the CVs of 4 KiB pages instead ([`UnitHasher::pages`]): the page
//! is the unit it writes, so the CVs alone tell which pages of a changed chunk differ.

use crate::{ChunkId, ChunkKey, ChunkKind};
use blake3::hazmat::{
    HasherExt, Mode, left_subtree_len, merge_subtrees_non_root, merge_subtrees_root,
};
use std::{collections::HashMap, fs::File, io, os::unix::fs::FileExt, path::Path};

/// Reads into `buf` at `at` until it is full or the file ends; the bytes read (errors
/// end the read: what was not read counts as never written).
fn read_up_to(file: &File, buf: &mut [u8], at: u64) -> usize {
    let mut got = 0;
    while got < buf.len() {
        match file.read_at(&mut buf[got..], at + got as u64) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    got
}

/// Bytes per unit. 8 KiB: a whole number of 4 KiB pages, and 8 BLAKE3 chunks so the
/// SIMD paths hash a unit as fast as a whole chunk.
pub const UNIT_LEN: usize = 8 << 10;

/// A chaining value.
pub type Cv = [u8; 32];

/// Hashes units and merges their CVs into chunk kinds, under one key.
pub struct UnitHasher {
    key: ChunkKey,
    chunk_len: usize,
    /// Bytes per unit: a power of two of at least one BLAKE3 chunk (1 KiB).
    unit_len: usize,
    /// The CVs of a full chunk of zeros: a chunk is zero iff its CVs are these.
    zero: Vec<Cv>,
}

impl UnitHasher {
    /// A hasher of [`UNIT_LEN`] units for chunks of `chunk_len` bytes, or `None` where a
    /// chunk is one unit or less (its id is not a merge of CVs, so there is nothing to gain).
    pub fn new(key: &ChunkKey, chunk_len: usize) -> Option<UnitHasher> {
        Self::with_unit(key, chunk_len, UNIT_LEN)
    }

    /// A hasher of 4 KiB pages ([`crate::PAGE_SIZE`]) for chunks of `chunk_len` bytes, or
    /// `None` where a chunk is one page or less. [`UnitHasher::cvs`] hashes all of a
    /// chunk's pages in one SIMD pass.
    pub fn pages(key: &ChunkKey, chunk_len: usize) -> Option<UnitHasher> {
        Self::with_unit(key, chunk_len, crate::PAGE_SIZE)
    }

    fn with_unit(key: &ChunkKey, chunk_len: usize, unit_len: usize) -> Option<UnitHasher> {
        debug_assert!(unit_len.is_power_of_two() && unit_len >= 1024);
        (chunk_len > unit_len).then(|| UnitHasher {
            key: key.clone(),
            chunk_len,
            unit_len,
            zero: zero_cvs(key, chunk_len, unit_len),
        })
    }

    /// Whether a chunk of `len` bytes has an id merged from [`UNIT_LEN`] CVs (more than
    /// one unit).
    pub fn covers(len: usize) -> bool {
        len > UNIT_LEN
    }

    /// Whether a chunk of `len` bytes has an id merged from this hasher's unit CVs.
    pub fn merges(&self, len: usize) -> bool {
        len > self.unit_len
    }

    /// Units of a chunk of `len` bytes.
    pub fn units(&self, len: usize) -> usize {
        len.div_ceil(self.unit_len)
    }

    /// Units of a full chunk.
    pub fn units_per_chunk(&self) -> usize {
        self.units(self.chunk_len)
    }

    /// The CV of unit `u` of a chunk, whose bytes are `data`.
    pub fn unit_cv(&self, u: usize, data: &[u8]) -> Cv {
        unit_cv(&self.key, u * self.unit_len, data)
    }

    /// The CVs of every unit of `data` (one chunk): its whole units all at once, in one
    /// SIMD pass over their BLAKE3 chunks, a last shorter one on its own.
    pub fn cvs(&self, data: &[u8]) -> Vec<Cv> {
        let whole = data.len() / self.unit_len * self.unit_len;
        let mut cvs = whole_unit_cvs(&self.key, &data[..whole], self.unit_len);
        if whole < data.len() {
            cvs.push(unit_cv(&self.key, whole, &data[whole..]));
        }
        cvs
    }

    /// The kind of a chunk of `len` bytes (more than one unit) whose unit CVs are `cvs`.
    pub fn kind(&self, cvs: &[Cv], len: usize) -> ChunkKind {
        debug_assert!(self.merges(len) && cvs.len() == self.units(len));
        if cvs == &self.zero_cvs(len)[..] {
            ChunkKind::Zero
        } else {
            let id = merge(&self.key, cvs, len as u64, self.unit_len as u64, true);
            ChunkKind::Data(ChunkId(*id.as_bytes()))
        }
    }

    /// The CVs of a chunk of `len` bytes that is all zeros.
    pub fn zero_cvs(&self, len: usize) -> std::borrow::Cow<'_, [Cv]> {
        if len == self.chunk_len {
            self.zero[..].into()
        } else {
            zero_cvs(&self.key, len, self.unit_len).into()
        }
    }
}

/// The CV of the unit of `data` that starts `at` bytes into its chunk.
fn unit_cv(key: &ChunkKey, at: usize, data: &[u8]) -> Cv {
    let mut h = blake3::Hasher::new_keyed(key.as_bytes());
    h.set_input_offset(at as u64);
    h.update(data);
    h.finalize_non_root()
}

/// The CVs of the units of `data`, whole units of `unit` bytes from the start of a
/// chunk, computed as BLAKE3 hashes one long input: every 1 KiB BLAKE3 chunk of them in
/// one pass across the SIMD lanes (16 with AVX-512), then the parents a level at a time
/// up to the units. Hashed one by one, a 4 KiB page fills only 4 lanes: BLAKE3 took 18%
/// of a first snapshot's CPU so, 9% this way (the packs' names included).
///
/// This uses `blake3::platform`, public but hidden from blake3's docs (not covered by
/// semver): the lock file pins blake3, and the tests check every CV against
/// [`unit_cv`] and the merged ids against BLAKE3's own keyed hash.
fn whole_unit_cvs(key: &ChunkKey, data: &[u8], unit: usize) -> Vec<Cv> {
    use blake3::{CHUNK_LEN, IncrementCounter::*};
    // BLAKE3's domain flags (the spec's, table 3).
    const CHUNK_START: u8 = 1;
    const CHUNK_END: u8 = 1 << 1;
    const PARENT: u8 = 1 << 2;
    const KEYED_HASH: u8 = 1 << 4;
    debug_assert!(data.len().is_multiple_of(unit) && unit.is_multiple_of(CHUNK_LEN));
    let hash = Lanes::new(key);
    let mut level = hash.all::<CHUNK_LEN>(data, Yes, KEYED_HASH, CHUNK_START, CHUNK_END);
    let mut width = CHUNK_LEN;
    while width < unit {
        level = hash.all::<64>(&level, No, KEYED_HASH | PARENT, 0, 0);
        width *= 2;
    }
    level
        .chunks_exact(32)
        .map(|cv| cv.try_into().expect("exact CVs"))
        .collect()
}

/// blake3's SIMD compression under one key, for [`whole_unit_cvs`].
struct Lanes {
    platform: blake3::platform::Platform,
    key_words: [u32; 8],
}

impl Lanes {
    fn new(key: &ChunkKey) -> Lanes {
        Lanes {
            platform: blake3::platform::Platform::detect(),
            key_words: blake3::platform::words_from_le_bytes_32(key.as_bytes()),
        }
    }

    /// The 32-byte outputs of every `N`-byte input of `inputs`, in one pass across the
    /// lanes, one after the other.
    fn all<const N: usize>(
        &self,
        inputs: &[u8],
        counter: blake3::IncrementCounter,
        flags: u8,
        flags_start: u8,
        flags_end: u8,
    ) -> Vec<u8> {
        let inputs: Vec<&[u8; N]> = inputs
            .chunks_exact(N)
            .map(|i| i.try_into().expect("exact inputs"))
            .collect();
        let mut out = vec![0u8; inputs.len() * 32];
        self.platform.hash_many(
            &inputs,
            &self.key_words,
            0,
            counter,
            flags,
            flags_start,
            flags_end,
            &mut out,
        );
        out
    }
}

fn zero_cvs(key: &ChunkKey, len: usize, unit: usize) -> Vec<Cv> {
    let zeros = vec![0u8; unit];
    (0..len.div_ceil(unit))
        .map(|u| unit_cv(key, u * unit, &zeros[..unit.min(len - u * unit)]))
        .collect()
}

/// Merges the CVs of `len` bytes (more than one unit of `unit` bytes) in BLAKE3's tree
/// shape: the left subtree is the largest power of two below `len`, which is whole units.
fn merge(key: &ChunkKey, cvs: &[Cv], len: u64, unit: u64, root: bool) -> blake3::Hash {
    let left = left_subtree_len(len);
    let n = (left / unit) as usize;
    let side = |cvs: &[Cv], len: u64| match cvs {
        [one] => *one,
        _ => *merge(key, cvs, len, unit, false).as_bytes(),
    };
    let (l, r) = (side(&cvs[..n], left), side(&cvs[n..], len - left));
    let mode = Mode::KeyedHash(key.as_bytes());
    if root {
        merge_subtrees_root(&l, &r, mode)
    } else {
        blake3::Hash::from_bytes(merge_subtrees_non_root(&l, &r, mode))
    }
}

/// The unit CVs of a volume's chunks, in a file: chunk `i`'s at `i × units × 32`.
/// Records are checked against the chunk's id when read, so writes need no ordering.
pub struct CvFile {
    file: File,
    hasher: UnitHasher,
}

impl CvFile {
    /// Opens (creating) the CV file at `path` for chunks of `chunk_len` bytes under `key`;
    /// `None` where such chunks are one unit or less.
    pub fn open(path: &Path, key: &ChunkKey, chunk_len: usize) -> io::Result<Option<CvFile>> {
        Self::with_hasher(path, UnitHasher::new(key, chunk_len))
    }

    /// Opens (creating) a CV file of 4 KiB pages ([`UnitHasher::pages`]) at `path`.
    pub fn open_pages(path: &Path, key: &ChunkKey, chunk_len: usize) -> io::Result<Option<CvFile>> {
        Self::with_hasher(path, UnitHasher::pages(key, chunk_len))
    }

    fn with_hasher(path: &Path, hasher: Option<UnitHasher>) -> io::Result<Option<CvFile>> {
        let Some(hasher) = hasher else {
            return Ok(None);
        };
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        Ok(Some(CvFile { file, hasher }))
    }

    /// The hasher the records are made with.
    pub fn hasher(&self) -> &UnitHasher {
        &self.hasher
    }

    fn at(&self, chunk: u64) -> u64 {
        chunk * (self.hasher.units_per_chunk() * 32) as u64
    }

    /// Chunk `chunk`'s stored CVs, if they merge into `kind` (a chunk of `len` bytes):
    /// anything else (never written, stale, torn) is `None`.
    pub fn get(&self, chunk: u64, len: usize, kind: &ChunkKind) -> Option<Vec<Cv>> {
        self.load([(chunk, len, *kind)], usize::MAX).remove(&chunk)
    }

    /// The stored CVs of `chunks` (index, length, kind as recorded elsewhere, in
    /// ascending order) that merge into their kinds, read with a few large reads (nearby
    /// records in one), up to `budget` bytes of records.
    pub fn load(
        &self,
        chunks: impl IntoIterator<Item = (u64, usize, ChunkKind)>,
        budget: usize,
    ) -> HashMap<u64, Vec<Cv>> {
        /// Records closer than this are read in one go: a seek costs more.
        const BRIDGE: u64 = 256 << 10;
        /// The most one read takes (it is the memory the reads need).
        const MAX_READ: u64 = 1 << 20;
        let record = (self.hasher.units_per_chunk() * 32) as u64;
        let mut out = HashMap::new();
        let mut wanted = Vec::new();
        let mut spent = 0;
        for (chunk, len, kind) in chunks {
            if kind == ChunkKind::Zero {
                out.insert(chunk, self.hasher.zero_cvs(len).into_owned());
                continue;
            }
            spent += record as usize;
            if spent > budget {
                break;
            }
            wanted.push((chunk, len, kind));
        }
        let mut buf = Vec::new();
        let mut i = 0;
        while i < wanted.len() {
            // One read from the first record to the last one within BRIDGE of the previous.
            let mut j = i + 1;
            let start = self.at(wanted[i].0);
            while j < wanted.len()
                && self.at(wanted[j].0) - self.at(wanted[j - 1].0) <= BRIDGE
                && self.at(wanted[j].0) + record - start <= MAX_READ
            {
                j += 1;
            }
            buf.resize((self.at(wanted[j - 1].0) + record - start) as usize, 0);
            let got = read_up_to(&self.file, &mut buf, start);
            for &(chunk, len, kind) in &wanted[i..j] {
                let at = (self.at(chunk) - start) as usize;
                let n = self.hasher.units(len) * 32;
                if at + n > got {
                    continue; // past the end of the file: never written
                }
                let cvs: Vec<Cv> = buf[at..at + n]
                    .chunks_exact(32)
                    .map(|c| c.try_into().expect("32 bytes"))
                    .collect();
                if self.hasher.kind(&cvs, len) == kind {
                    out.insert(chunk, cvs);
                }
            }
            i = j;
        }
        out
    }

    /// Records chunk `chunk`'s CVs.
    pub fn put(&self, chunk: u64, cvs: &[Cv]) -> io::Result<()> {
        self.file.write_all_at(cvs.as_flattened(), self.at(chunk))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cvs_merge_into_the_chunk_id_for_every_length() {
        let key = ChunkKey::from_bytes([7; 32]);
        let h = UnitHasher::new(&key, 128 << 10).unwrap();
        let data: Vec<u8> = (0..(128u32 << 10)).map(|i| (i * 31 % 251) as u8).collect();
        for len in [
            128 << 10,
            UNIT_LEN + 1,
            3 * UNIT_LEN,
            100_000,
            (64 << 10) + 4096,
        ] {
            let d = &data[..len];
            assert_eq!(
                h.kind(&h.cvs(d), len),
                ChunkKind::Data(key.chunk_id(d)),
                "len {len}"
            );
        }
        assert!(UnitHasher::new(&key, UNIT_LEN).is_none());
    }

    #[test]
    fn page_cvs_merge_into_the_chunk_id_and_tell_which_pages_differ() {
        let key = ChunkKey::from_bytes([9; 32]);
        let h = UnitHasher::pages(&key, 64 << 10).unwrap();
        let data: Vec<u8> = (0..(64u32 << 10)).map(|i| (i * 17 % 253) as u8).collect();
        for len in [64 << 10, 4097, 3 * 4096, 50_000] {
            let d = &data[..len];
            let cvs = h.cvs(d);
            assert_eq!(cvs.len(), len.div_ceil(4096));
            assert_eq!(
                h.kind(&cvs, len),
                ChunkKind::Data(key.chunk_id(d)),
                "len {len}"
            );
        }
        let mut changed = data.clone();
        changed[5 * 4096 + 7] ^= 1;
        let (a, b) = (h.cvs(&data), h.cvs(&changed));
        let differ: Vec<usize> = (0..a.len()).filter(|&p| a[p] != b[p]).collect();
        assert_eq!(differ, [5]);
        // The same bytes at another place in the chunk have another CV.
        assert_ne!(h.unit_cv(0, &data[..4096]), h.unit_cv(1, &data[..4096]));
        assert!(UnitHasher::pages(&key, 4096).is_none());
        assert_eq!(h.kind(&h.cvs(&[0; 20_000]), 20_000), ChunkKind::Zero);
    }

    #[test]
    fn units_hashed_together_have_the_cvs_of_units_hashed_one_by_one() {
        use rand::{RngCore, SeedableRng, rngs::StdRng};
        let key = ChunkKey::from_bytes([3; 32]);
        let mut data = vec![0u8; 1 << 20];
        StdRng::seed_from_u64(3).fill_bytes(&mut data);
        for (h, unit) in [
            (UnitHasher::pages(&key, 1 << 20).unwrap(), 4096),
            (UnitHasher::new(&key, 1 << 20).unwrap(), UNIT_LEN),
        ] {
            for len in [1 << 20, (1 << 20) - 1, 5 * unit, 2 * unit + 1024, unit + 1] {
                let d = &data[..len];
                let one_by_one: Vec<Cv> = d
                    .chunks(unit)
                    .enumerate()
                    .map(|(u, p)| unit_cv(&key, u * unit, p))
                    .collect();
                assert_eq!(h.cvs(d), one_by_one, "unit {unit}, len {len}");
                assert_eq!(h.kind(&h.cvs(d), len), ChunkKind::Data(key.chunk_id(d)));
            }
        }
    }

    #[test]
    fn a_zero_chunk_is_known_by_its_cvs() {
        let key = ChunkKey::local();
        let h = UnitHasher::new(&key, 64 << 10).unwrap();
        assert_eq!(h.kind(&h.cvs(&[0; 64 << 10]), 64 << 10), ChunkKind::Zero);
        assert_eq!(h.kind(&h.cvs(&[0; 20_000]), 20_000), ChunkKind::Zero);
        let mut one = vec![0u8; 64 << 10];
        one[40_000] = 1;
        assert!(matches!(h.kind(&h.cvs(&one), 64 << 10), ChunkKind::Data(_)));
    }

    #[test]
    fn a_stored_record_is_used_only_if_it_merges_into_the_kind() {
        let t = tempfile::tempdir().unwrap();
        let key = ChunkKey::local();
        let f = CvFile::open(&t.path().join("cvs"), &key, 32 << 10)
            .unwrap()
            .unwrap();
        let data = vec![5u8; 32 << 10];
        let kind = ChunkKind::Data(key.chunk_id(&data));
        assert_eq!(f.get(3, data.len(), &kind), None, "never written");
        let cvs = f.hasher().cvs(&data);
        f.put(3, &cvs).unwrap();
        assert_eq!(f.get(3, data.len(), &kind), Some(cvs.clone()));
        let other = ChunkKind::Data(key.chunk_id(&[6u8; 32 << 10]));
        assert_eq!(f.get(3, data.len(), &other), None, "stale");
        let mut torn = cvs;
        torn[2][0] ^= 1;
        f.put(3, &torn).unwrap();
        assert_eq!(f.get(3, data.len(), &kind), None, "torn");
        assert!(
            CvFile::open(&t.path().join("x"), &key, UNIT_LEN)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn load_reads_near_and_far_records_and_skips_the_bad() {
        let t = tempfile::tempdir().unwrap();
        let key = ChunkKey::local();
        let len = 64 << 10;
        let f = CvFile::open(&t.path().join("cvs"), &key, len)
            .unwrap()
            .unwrap();
        let chunk = |i: u64| vec![i as u8 + 1; len];
        let kind = |i: u64| ChunkKind::Data(key.chunk_id(&chunk(i)));
        // Near each other (one read), far apart (other reads, past 1 MiB of records).
        let written = [0u64, 3, 4, 5000, 90_000];
        for &i in &written {
            f.put(i, &f.hasher().cvs(&chunk(i))).unwrap();
        }
        let stale = ChunkKind::Data(key.chunk_id(b"other"));
        let asked = written
            .iter()
            .map(|&i| (i, len, if i == 4 { stale } else { kind(i) }))
            .chain([(7, len, ChunkKind::Zero), (200_000, len, kind(1))]);
        let got = f.load(asked, usize::MAX);
        let mut found: Vec<u64> = got.keys().copied().collect();
        found.sort();
        assert_eq!(
            found,
            [0, 3, 7, 5000, 90_000],
            "stale and never written are left out"
        );
        assert_eq!(got[&5000], f.hasher().cvs(&chunk(5000)));
        assert_eq!(got[&7][..], *f.hasher().zero_cvs(len));
        assert_eq!(
            f.load([(3, len, kind(3)), (5000, len, kind(5000))], 256)
                .len(),
            1
        );
    }
}
