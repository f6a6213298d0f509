//! Applies "a day of changes" to a mounted copy of yesterday's volume.

use std::fs::{self, File};
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::content::{self, DB_PAGE};
use super::{Layout, share};
use crate::prng::SplitMix64;
use crate::progress::note;

/// What the day changed.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DayChanges {
    /// Database pages rewritten in place.
    pub db_pages_rewritten: u64,
    /// Bytes inserted in the middle of the shift file (not a multiple of 4 KiB, so
    /// everything after the insert point moves by an odd amount).
    pub shift_insert_bytes: u64,
    /// New files written.
    pub new_files: u64,
    /// Their total size.
    pub new_bytes: u64,
    /// Real files deleted.
    pub deleted_files: u64,
    /// Their total size.
    pub deleted_bytes: u64,
}

/// Percent of database pages rewritten.
const DB_REWRITE_PERCENT: u64 = 5;
/// Bytes inserted into the shift file: ~1 MiB, deliberately not page aligned.
const SHIFT_INSERT: u64 = (1 << 20) + 1000;
/// Number of new files and their share of the volume, in percent.
const NEW_FILES: u64 = 8;
const NEW_PERCENT: u64 = 2;
/// Chance, in percent, that a real file is deleted.
const DELETE_PERCENT: u64 = 1;

/// Changes the mounted volume at `root` (of `size` bytes) and syncs it.
pub fn apply(root: &Path, size: u64, seed: u64) -> Result<DayChanges> {
    let layout = Layout::new(root);
    note!("  rewriting ~{DB_REWRITE_PERCENT}% of the database pages in place");
    let db_pages_rewritten = rewrite_db_pages(&layout.db, &mut SplitMix64::new(seed, 11))?;
    note!("  inserting {SHIFT_INSERT} bytes in the middle of the shift file");
    insert_in_middle(&layout.shift, SHIFT_INSERT, &mut SplitMix64::new(seed, 12))?;
    let (new_files, new_bytes) = add_files(&layout.new, size, &mut SplitMix64::new(seed, 13))?;
    let (deleted_files, deleted_bytes) =
        delete_some_files(&layout.files, &mut SplitMix64::new(seed, 14))?;
    rustix::fs::sync();
    Ok(DayChanges {
        db_pages_rewritten,
        shift_insert_bytes: SHIFT_INSERT,
        new_files,
        new_bytes,
        deleted_files,
        deleted_bytes,
    })
}

/// Rewrites a random ~[`DB_REWRITE_PERCENT`]% of the pages of the database at `path` in
/// place (open for write without truncation, like `conv=notrunc`) with LSN 2; returns how
/// many.
fn rewrite_db_pages(path: &Path, rng: &mut SplitMix64) -> Result<u64> {
    let file = File::options()
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open {} for writing", path.display()))?;
    let pages = file.metadata()?.len() / DB_PAGE as u64;
    let mut page = vec![0u8; DB_PAGE];
    let mut rewritten = 0;
    for page_no in 0..pages {
        if rng.chance(DB_REWRITE_PERCENT) {
            content::db_page(&mut page, page_no, 2, rng);
            file.write_all_at(&page, page_no * DB_PAGE as u64)
                .with_context(|| format!("cannot rewrite page {page_no} of {}", path.display()))?;
            rewritten += 1;
        }
    }
    file.sync_all()?;
    Ok(rewritten)
}

/// Inserts `len` random bytes in the middle of the file at `path` the way editors do:
/// write a new file, sync, rename it over the old one.
fn insert_in_middle(path: &Path, len: u64, rng: &mut SplitMix64) -> Result<()> {
    let tmp = path.with_extension("new");
    let mut old = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut new = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let half = old.metadata()?.len() / 2;
    io::copy(&mut Read::by_ref(&mut old).take(half), &mut new)?;
    let mut insert = vec![0u8; len as usize];
    rng.fill(&mut insert);
    new.write_all(&insert)?;
    io::copy(&mut old, &mut new)?;
    new.sync_all()?;
    fs::rename(&tmp, path).with_context(|| format!("cannot replace {}", path.display()))
}

/// Writes [`NEW_FILES`] random files totalling [`NEW_PERCENT`]% of the volume into `dir`.
fn add_files(dir: &Path, size: u64, rng: &mut SplitMix64) -> Result<(u64, u64)> {
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let each = share(size, NEW_PERCENT) / NEW_FILES;
    for i in 0..NEW_FILES {
        content::write_random(&dir.join(format!("new-{i}.bin")), each, rng)?;
    }
    Ok((NEW_FILES, NEW_FILES * each))
}

/// Deletes about [`DELETE_PERCENT`]% of the regular files under `dir`, chosen at random;
/// returns how many files and bytes.
fn delete_some_files(dir: &Path, rng: &mut SplitMix64) -> Result<(u64, u64)> {
    let mut files = Vec::new();
    list_files(dir, &mut files)?;
    let (mut count, mut bytes) = (0, 0);
    for (path, len) in files {
        if rng.chance(DELETE_PERCENT) {
            fs::remove_file(&path).with_context(|| format!("cannot delete {}", path.display()))?;
            count += 1;
            bytes += len;
        }
    }
    Ok((count, bytes))
}

/// Appends the regular files under `dir` (recursively, in name order) and their sizes.
fn list_files(dir: &Path, out: &mut Vec<(PathBuf, u64)>) -> Result<()> {
    let mut entries = fs::read_dir(dir)
        .and_then(|d| d.collect::<Result<Vec<_>, _>>())
        .with_context(|| format!("cannot list {}", dir.display()))?;
    entries.sort_by_key(fs::DirEntry::file_name);
    for entry in entries {
        let meta = entry.metadata()?;
        if meta.is_dir() {
            list_files(&entry.path(), out)?;
        } else if meta.is_file() {
            out.push((entry.path(), meta.len()));
        }
    }
    Ok(())
}
