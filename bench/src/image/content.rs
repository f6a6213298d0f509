//! Generated file contents: database pages and incompressible bytes, written in 1 MiB
//! blocks.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};

use crate::prng::SplitMix64;

/// Size of a database page.
pub const DB_PAGE: usize = 8192;

/// Bytes generated and written per `write`.
const BLOCK: usize = 1 << 20;

/// Marks the start of every database page.
const DB_MAGIC: &[u8; 8] = b"MVBDPG01";

/// Bytes of page header: magic, page number, LSN, checksum.
const DB_HEADER: usize = 32;

/// Bytes per row.
const DB_ROW: usize = 64;

/// Rows per page: a quarter of each page stays free (zeroed), as in real B-tree pages.
const DB_ROWS: usize = (DB_PAGE - DB_HEADER) * 3 / 4 / DB_ROW;

/// The letters row text is drawn from (4 bits of entropy per byte: compressible-ish).
const ALPHABET: &[u8; 16] = b"etaoinshrdlucmfw";

/// Fills `page` with page `page_no` of the database as of log sequence number `lsn`: a
/// header, rows of a key, a random value and low-entropy text, then zeroed free space.
pub fn db_page(page: &mut [u8], page_no: u64, lsn: u64, rng: &mut SplitMix64) {
    assert_eq!(page.len(), DB_PAGE, "a database page is {DB_PAGE} bytes");
    page.fill(0);
    page[0..8].copy_from_slice(DB_MAGIC);
    page[8..16].copy_from_slice(&page_no.to_le_bytes());
    page[16..24].copy_from_slice(&lsn.to_le_bytes());
    let rows = &mut page[DB_HEADER..DB_HEADER + DB_ROWS * DB_ROW];
    for (i, row) in rows.chunks_exact_mut(DB_ROW).enumerate() {
        let key = page_no * DB_ROWS as u64 + i as u64;
        row[0..8].copy_from_slice(&key.to_le_bytes());
        row[8..16].copy_from_slice(&rng.next_u64().to_le_bytes());
        for text in row[16..].chunks_exact_mut(16) {
            let bits = rng.next_u64();
            for (j, byte) in text.iter_mut().enumerate() {
                *byte = ALPHABET[(bits >> (4 * j)) as usize & 15];
            }
        }
    }
    let checksum = page.chunks_exact(8).fold(0u64, |acc, word| {
        let word = u64::from_le_bytes(word.try_into().expect("8-byte chunk"));
        (acc ^ word).rotate_left(5)
    });
    page[24..32].copy_from_slice(&checksum.to_le_bytes());
}

/// Writes a new file at `path` holding `pages` database pages at LSN 1; syncs it.
pub fn write_db(path: &Path, pages: u64, rng: &mut SplitMix64) -> Result<()> {
    let mut page_no = 0;
    write_generated(path, pages * DB_PAGE as u64, |block| {
        for page in block.chunks_exact_mut(DB_PAGE) {
            db_page(page, page_no, 1, rng);
            page_no += 1;
        }
    })
}

/// Writes a new file at `path` holding `len` random bytes; syncs it.
pub fn write_random(path: &Path, len: u64, rng: &mut SplitMix64) -> Result<()> {
    write_generated(path, len, |block| rng.fill(block))
}

/// Writes a new file of `len` bytes at `path`, each block produced by `generate`, then
/// syncs it. Blocks are whole multiples of [`DB_PAGE`] except possibly the last.
fn write_generated(path: &Path, len: u64, mut generate: impl FnMut(&mut [u8])) -> Result<()> {
    let mut file =
        File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut block = vec![0u8; BLOCK];
    let mut left = len;
    while left > 0 {
        let n = left.min(BLOCK as u64) as usize;
        generate(&mut block[..n]);
        file.write_all(&block[..n])
            .with_context(|| format!("cannot write {}", path.display()))?;
        left -= n as u64;
    }
    file.sync_all()
        .with_context(|| format!("cannot sync {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn db_pages_have_header_text_and_free_space() {
        let mut page = vec![0u8; DB_PAGE];
        db_page(&mut page, 42, 7, &mut SplitMix64::new(1, 2));
        assert_eq!(&page[0..8], DB_MAGIC);
        assert_eq!(u64::from_le_bytes(page[8..16].try_into().unwrap()), 42);
        assert_eq!(u64::from_le_bytes(page[16..24].try_into().unwrap()), 7);
        assert!(
            page[DB_HEADER + 16..DB_HEADER + DB_ROW]
                .iter()
                .all(|b| ALPHABET.contains(b))
        );
        assert!(page[DB_PAGE - 1024..].iter().all(|&b| b == 0));
    }

    #[test]
    fn a_rewritten_page_differs_in_both_halves() {
        let (mut old, mut new) = (vec![0u8; DB_PAGE], vec![0u8; DB_PAGE]);
        db_page(&mut old, 3, 1, &mut SplitMix64::new(1, 1));
        db_page(&mut new, 3, 2, &mut SplitMix64::new(1, 2));
        assert_ne!(old[..4096], new[..4096]);
        assert_ne!(old[4096..], new[4096..]);
    }
}
