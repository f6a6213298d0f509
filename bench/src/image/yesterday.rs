//! Fills a freshly made ext4 volume with "yesterday's" content.

use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::content::{self, DB_PAGE};
use super::{Layout, share};
use crate::prng::SplitMix64;
use crate::progress::note;

/// What the volume holds, in bytes of file data.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Composition {
    /// Real files copied from the system.
    pub real_files: u64,
    /// Their total size.
    pub real_bytes: u64,
    /// Pages in the database-like file.
    pub db_pages: u64,
    /// Size of the database-like file.
    pub db_bytes: u64,
    /// Size of the incompressible blob.
    pub blob_bytes: u64,
    /// Size of the file that "today" shifts by an insert.
    pub shift_bytes: u64,
    /// Size of the random file written then deleted, leaving garbage in free space.
    pub garbage_bytes: u64,
}

/// Where real files are copied from, in order.
const REAL_SOURCES: [&str; 2] = ["/usr/share", "/usr/lib"];

/// Percent of the volume for each kind of content.
const REAL_PERCENT: u64 = 30;
const DB_PERCENT: u64 = 15;
const BLOB_PERCENT: u64 = 15;
const SHIFT_PERCENT: u64 = 5;
const GARBAGE_PERCENT: u64 = 10;

/// Fills the mounted volume at `root` (of `size` bytes) and syncs it.
pub fn fill(root: &Path, size: u64, seed: u64) -> Result<Composition> {
    let layout = Layout::new(root);
    layout.create_dirs()?;
    note!("  copying real files from {}", REAL_SOURCES.join(" and "));
    let (real_files, real_bytes) = copy_real_files(&layout, share(size, REAL_PERCENT))?;
    let db_pages = share(size, DB_PERCENT) / DB_PAGE as u64;
    note!("  writing a database of {db_pages} pages of 8 KiB");
    content::write_db(&layout.db, db_pages, &mut SplitMix64::new(seed, 1))?;
    let blob_bytes = share(size, BLOB_PERCENT);
    note!("  writing an incompressible blob");
    content::write_random(&layout.blob, blob_bytes, &mut SplitMix64::new(seed, 2))?;
    let shift_bytes = share(size, SHIFT_PERCENT);
    content::write_random(&layout.shift, shift_bytes, &mut SplitMix64::new(seed, 3))?;
    let garbage_bytes = share(size, GARBAGE_PERCENT);
    note!("  writing then deleting garbage");
    write_garbage(root, garbage_bytes, &mut SplitMix64::new(seed, 4))?;
    Ok(Composition {
        real_files,
        real_bytes,
        db_pages,
        db_bytes: db_pages * DB_PAGE as u64,
        blob_bytes,
        shift_bytes,
        garbage_bytes,
    })
}

/// Writes `len` random bytes to a file, syncs, deletes it and syncs again, so free space
/// holds garbage rather than zeros (ext4 does not discard without `-o discard`).
fn write_garbage(root: &Path, len: u64, rng: &mut SplitMix64) -> Result<()> {
    let path = root.join("garbage.tmp");
    content::write_random(&path, len, rng)?;
    rustix::fs::sync();
    fs::remove_file(&path).with_context(|| format!("cannot delete {}", path.display()))?;
    rustix::fs::sync();
    Ok(())
}

/// Copies regular files from [`REAL_SOURCES`] into the volume until `budget` bytes;
/// returns the number of files and bytes copied.
fn copy_real_files(layout: &Layout, budget: u64) -> Result<(u64, u64)> {
    let mut copier = Copier {
        left: budget,
        stop_below: budget / 100,
        files: 0,
        bytes: 0,
    };
    for source in REAL_SOURCES {
        let name = source.trim_start_matches('/').replace('/', "_");
        copier.copy_tree(Path::new(source), &layout.files.join(name))?;
    }
    Ok((copier.files, copier.bytes))
}

/// State of a budgeted recursive copy.
struct Copier {
    /// Bytes still allowed.
    left: u64,
    /// Stop walking once fewer bytes than this are left.
    stop_below: u64,
    /// Files copied so far.
    files: u64,
    /// Bytes copied so far.
    bytes: u64,
}

impl Copier {
    /// Whether the budget is (nearly) spent.
    fn done(&self) -> bool {
        self.left <= self.stop_below
    }

    /// Copies the regular files and directories under `src` to `dst`, in name order,
    /// skipping symlinks, special files and files larger than what is left.
    fn copy_tree(&mut self, src: &Path, dst: &Path) -> Result<()> {
        if self.done() {
            return Ok(());
        }
        fs::create_dir_all(dst).with_context(|| format!("cannot create {}", dst.display()))?;
        let mut entries = fs::read_dir(src)
            .and_then(|dir| dir.collect::<Result<Vec<_>, _>>())
            .with_context(|| format!("cannot list {}", src.display()))?;
        entries.sort_by_key(fs::DirEntry::file_name);
        for entry in entries {
            let meta = entry
                .metadata()
                .with_context(|| format!("cannot stat {}", entry.path().display()))?;
            let target = dst.join(entry.file_name());
            if meta.is_dir() {
                self.copy_tree(&entry.path(), &target)?;
            } else if meta.is_file() && meta.len() <= self.left {
                fs::copy(entry.path(), &target).with_context(|| {
                    format!("cannot copy {} into the volume", entry.path().display())
                })?;
                self.files += 1;
                self.bytes += meta.len();
                self.left -= meta.len();
            }
            if self.done() {
                break;
            }
        }
        Ok(())
    }
}
