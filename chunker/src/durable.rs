//! Durable writes: a file is written under a temporary name, fsynced, renamed into
//! place, and its directory fsynced, so a crash leaves the old file or the new one,
//! never a torn one (docs/ARCHITECTURE.md).
//!
//! The one implementation for the workspace: chunker is the root of the crate graph,
//! so snapshots' local backend and every state file of mover use these.

use std::{
    fs::{self, File},
    io::{self, Write},
    path::Path,
};

/// Writes `bytes` to `path` durably: `path.tmp`, fsync, rename, fsync(dir). Creates the
/// directory if missing.
pub fn write_durably(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = parent_of(path);
    fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    let mut f = File::create(&tmp)?;
    f.write_all(bytes)?;
    publish(&f, &tmp, path)
}

/// Makes `file`, already written at `tmp`, durable and puts it at `path` (in the same
/// directory), durably too: fsync, rename, fsync(dir). For writers that stream into
/// the temporary file themselves.
pub fn publish(file: &File, tmp: &Path, path: &Path) -> io::Result<()> {
    file.sync_all()?;
    fs::rename(tmp, path)?;
    sync_dir(parent_of(path))
}

/// Fsyncs a directory, so the entries just made, renamed or removed in it survive a
/// crash.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// The directory holding `path` (`.` for a bare name).
pub fn parent_of(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_durable_write_replaces_the_file_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state/record.json");
        write_durably(&path, b"one").unwrap();
        write_durably(&path, b"two").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"two");
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["record.json"]);
    }

    #[test]
    fn a_durable_write_into_a_missing_place_fails() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        fs::write(&blocker, b"x").unwrap();
        let err = write_durably(&blocker.join("under/a/file"), b"y").unwrap_err();
        assert!(
            matches!(
                err.kind(),
                io::ErrorKind::NotADirectory | io::ErrorKind::AlreadyExists
            ),
            "{err:?}"
        );
        assert_eq!(fs::read(&blocker).unwrap(), b"x");
    }
}
