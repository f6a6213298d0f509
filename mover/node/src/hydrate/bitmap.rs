//! Which regions of a hydrating volume are present, in memory and on disk.
//!
//! On disk the bitmap has two slots (A/B). A commit writes the older slot with the next
//! sequence number and a BLAKE3 checksum, then fdatasyncs it; loading takes the valid
//! slot with the highest sequence. A torn commit therefore leaves the previous one in
//! force. The caller fdatasyncs the volume *before* committing a bitmap that marks its
//! regions present, so a region is never marked present on disk before its data is.

use std::{
    fs::{File, OpenOptions},
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

const MAGIC: &[u8; 8] = b"MVHYDRB1";
/// magic, seq, regions, region size, present count, then the checksum.
const HEADER: usize = 8 + 8 + 8 + 8 + 8 + 32;

/// One bit per region: set = the region's data is here (fetched or written by a client).
#[derive(Clone, Debug, PartialEq)]
pub struct RegionBitmap {
    words: Vec<u64>,
    regions: u64,
}

impl RegionBitmap {
    /// No region present.
    pub fn new(regions: u64) -> Self {
        RegionBitmap {
            words: vec![0; regions.div_ceil(64) as usize],
            regions,
        }
    }

    /// Regions in the volume.
    pub fn regions(&self) -> u64 {
        self.regions
    }

    /// Regions present (counted: a terabyte's million regions are 16 K words).
    pub fn present(&self) -> u64 {
        self.words.iter().map(|w| w.count_ones() as u64).sum()
    }

    /// Every region is present.
    pub fn is_complete(&self) -> bool {
        self.next_missing(0).is_none()
    }

    /// Whether region `r` is present.
    pub fn get(&self, r: u64) -> bool {
        self.words[(r / 64) as usize] & (1 << (r % 64)) != 0
    }

    /// Marks region `r` present; whether it was not before.
    pub fn set(&mut self, r: u64) -> bool {
        let (i, bit) = ((r / 64) as usize, 1u64 << (r % 64));
        let new = self.words[i] & bit == 0;
        self.words[i] |= bit;
        new
    }

    /// The first missing region at or after `from`, if any: whole present words are
    /// skipped, so a scan of a terabyte's million regions is a few thousand compares.
    pub fn next_missing(&self, from: u64) -> Option<u64> {
        let mut r = from;
        while r < self.regions {
            let w = self.words[(r / 64) as usize] | ((1u64 << (r % 64)) - 1);
            if w == u64::MAX {
                r = (r / 64 + 1) * 64;
                continue;
            }
            let found = (r / 64) * 64 + w.trailing_ones() as u64;
            return (found < self.regions).then_some(found);
        }
        None
    }

    fn to_bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    fn from_bytes(regions: u64, bytes: &[u8]) -> Self {
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        RegionBitmap { words, regions }
    }
}

/// The bitmap's file: two slots, each a header and the bitmap's words.
pub struct BitmapFile {
    file: File,
    path: PathBuf,
    slot: u64,
    seq: u64,
    regions: u64,
    region_size: u64,
}

impl BitmapFile {
    /// Creates (or truncates) the file for a hydration starting from nothing, with slot A
    /// committed empty.
    pub fn create(path: &Path, regions: u64, region_size: u64) -> io::Result<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)?;
        let mut f = BitmapFile::with(file, path, regions, region_size);
        f.commit(&RegionBitmap::new(regions))?;
        Ok(f)
    }

    /// Opens the file of a hydration in progress and loads its newest valid slot.
    pub fn open(path: &Path, regions: u64, region_size: u64) -> io::Result<(Self, RegionBitmap)> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let mut f = BitmapFile::with(file, path, regions, region_size);
        let mut best: Option<(u64, RegionBitmap)> = None;
        for s in 0..2 {
            if let Some((seq, map)) = f.read_slot(s)?
                && best.as_ref().is_none_or(|(b, _)| seq > *b)
            {
                best = Some((seq, map));
            }
        }
        let (seq, map) = best.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "hydration bitmap {} has no valid slot (or is for another volume size or region size)",
                    path.display()
                ),
            )
        })?;
        f.seq = seq;
        Ok((f, map))
    }

    fn with(file: File, path: &Path, regions: u64, region_size: u64) -> Self {
        let bytes = regions.div_ceil(64) * 8;
        BitmapFile {
            file,
            path: path.into(),
            slot: (HEADER as u64 + bytes).next_multiple_of(4096),
            seq: 0,
            regions,
            region_size,
        }
    }

    /// Where the file is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `map` durably as the newest slot.
    pub fn commit(&mut self, map: &RegionBitmap) -> io::Result<()> {
        let seq = self.seq + 1;
        let body = map.to_bytes();
        let mut buf = Vec::with_capacity(HEADER + body.len());
        buf.extend_from_slice(MAGIC);
        for v in [seq, self.regions, self.region_size, map.present()] {
            buf.extend_from_slice(&v.to_le_bytes());
        }
        let sum = checksum(&buf[8..], &body);
        buf.extend_from_slice(&sum);
        buf.extend_from_slice(&body);
        self.file.write_all_at(&buf, (seq % 2) * self.slot)?;
        self.file.sync_data()?;
        self.seq = seq;
        Ok(())
    }

    fn read_slot(&self, s: u64) -> io::Result<Option<(u64, RegionBitmap)>> {
        let mut buf = vec![0u8; HEADER + (self.regions.div_ceil(64) * 8) as usize];
        match self.file.read_exact_at(&mut buf, s * self.slot) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        let num = |i: usize| u64::from_le_bytes(buf[8 + i * 8..16 + i * 8].try_into().unwrap());
        let (body, sum) = (&buf[HEADER..], &buf[HEADER - 32..HEADER]);
        if &buf[..8] != MAGIC
            || num(1) != self.regions
            || num(2) != self.region_size
            || checksum(&buf[8..HEADER - 32], body) != sum
        {
            return Ok(None);
        }
        let map = RegionBitmap::from_bytes(self.regions, body);
        if map.present() != num(3) || num(0) % 2 != s {
            return Ok(None);
        }
        Ok(Some((num(0), map)))
    }
}

fn checksum(header: &[u8], body: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(header);
    h.update(body);
    *h.finalize().as_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_missing_skips_present_words_and_stops_at_the_end() {
        let mut m = RegionBitmap::new(200);
        assert_eq!(m.next_missing(0), Some(0));
        for r in 0..130 {
            m.set(r);
        }
        assert_eq!(m.next_missing(0), Some(130));
        assert_eq!(m.next_missing(131), Some(131));
        for r in 130..200 {
            m.set(r);
        }
        assert!(m.is_complete());
        assert_eq!(m.next_missing(0), None);
        assert!(!m.set(5), "setting twice counts once");
        assert_eq!(m.present(), 200);
    }

    #[test]
    fn the_newest_valid_slot_wins_and_a_torn_one_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b");
        let mut f = BitmapFile::create(&p, 1000, 1 << 20).unwrap();
        let mut m = RegionBitmap::new(1000);
        m.set(3);
        f.commit(&m).unwrap(); // seq 2, slot 0
        m.set(999);
        f.commit(&m).unwrap(); // seq 3, slot 1
        let (_, got) = BitmapFile::open(&p, 1000, 1 << 20).unwrap();
        assert_eq!(got, m);

        // Tear the newest slot (slot 1): the one before is loaded.
        let raw = OpenOptions::new().write(true).open(&p).unwrap();
        raw.write_all_at(&[0xff; 16], f.slot + HEADER as u64)
            .unwrap();
        let (mut f2, got) = BitmapFile::open(&p, 1000, 1 << 20).unwrap();
        assert!(got.get(3) && !got.get(999), "slot 0 (seq 2) is in force");
        // The next commit overwrites the torn slot, not the good one.
        m.set(500);
        f2.commit(&m).unwrap();
        let (_, got) = BitmapFile::open(&p, 1000, 1 << 20).unwrap();
        assert_eq!(got, m);

        // Another volume size or region size does not load.
        assert!(BitmapFile::open(&p, 1001, 1 << 20).is_err());
        assert!(BitmapFile::open(&p, 1000, 1 << 21).is_err());
    }
}
