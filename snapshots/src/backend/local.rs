//! A repository in a local directory (another disk, an NFS mount).
//!
//! Writes are durable and atomic: the object is written to a temp file in its
//! directory, fsynced, renamed into place, and the directory is fsynced.

use super::{Backend, ObjectInfo, check_key, range_error};
use crate::error::{RepoError, Result};
use bytes::Bytes;
use chunker::durable::{publish, sync_dir};
use std::{
    collections::HashMap,
    fs::{self, File},
    io::ErrorKind,
    ops::Range,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

/// Objects as files under a root directory.
#[derive(Debug, Clone)]
pub struct LocalBackend {
    root: Arc<PathBuf>,
    /// Packs open for ranged reads: a restore reads each pack in many ranges (49k
    /// ranges, so 49k opens, stats and closes, for a 6 GiB tree). A pack's name is the
    /// hash of its bytes, so an open pack never goes stale; `delete` forgets it.
    open_packs: Arc<Mutex<HashMap<String, Arc<File>>>>,
}

/// Packs kept open at most (descriptors; the whole set is dropped when full).
const OPEN_PACKS: usize = 64;

impl LocalBackend {
    /// A backend rooted at `root` (created on the first write if missing).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        LocalBackend {
            root: Arc::new(root.into()),
            open_packs: Arc::default(),
        }
    }

    fn err(&self, op: &'static str, key: &str, e: std::io::Error) -> RepoError {
        if e.kind() == ErrorKind::NotFound && op == "get" {
            return RepoError::NotFound {
                location: self.location(),
                key: key.into(),
            };
        }
        let hint = match e.kind() {
            ErrorKind::StorageFull => "; the repository disk is full: free space and rerun",
            ErrorKind::PermissionDenied => "; check the repository directory's permissions",
            ErrorKind::ReadOnlyFilesystem => "; the repository is on a read-only file system",
            _ => "",
        };
        RepoError::Backend {
            location: self.location(),
            op,
            key: key.into(),
            retryable: matches!(e.kind(), ErrorKind::Interrupted | ErrorKind::TimedOut),
            detail: format!("{e}{hint}"),
        }
    }

    /// Runs blocking file work off the async threads.
    async fn blocking<T: Send + 'static>(
        &self,
        op: &'static str,
        key: &str,
        f: impl FnOnce(&Path) -> std::io::Result<T> + Send + 'static,
    ) -> Result<T> {
        let root = self.root.clone();
        match tokio::task::spawn_blocking(move || f(&root)).await {
            Ok(r) => r.map_err(|e| self.err(op, key, e)),
            Err(join) => Err(self.err(op, key, std::io::Error::other(join.to_string()))),
        }
    }
}

/// The pack `key`, open: from `packs`, or opened and kept there.
fn open_pack(
    packs: &Mutex<HashMap<String, Arc<File>>>,
    root: &Path,
    key: &str,
) -> std::io::Result<Arc<File>> {
    if let Some(f) = packs.lock().expect("open packs lock").get(key) {
        return Ok(f.clone());
    }
    let f = Arc::new(File::open(root.join(key))?);
    let mut packs = packs.lock().expect("open packs lock");
    if packs.len() >= OPEN_PACKS {
        packs.clear();
    }
    packs.insert(key.to_string(), f.clone());
    Ok(f)
}

/// Reads `r` of `file` (less where the file ends first) into a fresh buffer that is
/// not zeroed first: restores read gigabytes this way, and zeroing, or faulting in
/// zeroed pages, cost as much as the read.
fn read_range(file: &File, r: Range<u64>) -> std::io::Result<Vec<u8>> {
    let want = (r.end - r.start) as usize;
    let mut buf = Vec::with_capacity(want);
    while buf.len() < want {
        let at = r.start + buf.len() as u64;
        match rustix::io::pread(file, rustix::buffer::spare_capacity(&mut buf), at) {
            Ok(0) => break,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(buf)
}

/// Creates `dir` and any missing parents, fsyncing each parent that gained an entry.
fn create_dirs(root: &Path, dir: &Path) -> std::io::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    if let Some(parent) = dir.parent()
        && parent != root
        && !parent.as_os_str().is_empty()
    {
        create_dirs(root, parent)?;
    } else if !root.is_dir() {
        fs::create_dir_all(root)?;
    }
    match fs::create_dir(dir) {
        Ok(()) => sync_dir(dir.parent().unwrap_or(root)),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

fn list_dir(
    root: &Path,
    dir: &Path,
    prefix: &str,
    out: &mut Vec<ObjectInfo>,
) -> std::io::Result<()> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(".tmp.") {
            continue;
        }
        let path = entry.path();
        let ft = entry.file_type()?;
        let rel = path
            .strip_prefix(root)
            .map_err(std::io::Error::other)?
            .to_string_lossy()
            .into_owned();
        if ft.is_dir() {
            if rel.starts_with(prefix) || prefix.starts_with(&format!("{rel}/")) {
                list_dir(root, &path, prefix, out)?;
            }
        } else if ft.is_file() && rel.starts_with(prefix) {
            out.push(ObjectInfo {
                key: rel,
                size: entry.metadata()?.len(),
            });
        }
    }
    Ok(())
}

#[async_trait::async_trait]
impl Backend for LocalBackend {
    fn location(&self) -> String {
        self.root.display().to_string()
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let prefix = prefix.to_string();
        self.blocking("list", &prefix.clone(), move |root| {
            // Start at the deepest directory the prefix names.
            let start = match prefix.rfind('/') {
                Some(i) => root.join(&prefix[..i]),
                None => root.to_path_buf(),
            };
            let mut out = Vec::new();
            list_dir(root, &start, &prefix, &mut out)?;
            Ok(out)
        })
        .await
    }

    async fn get(&self, key: &str, range: Option<Range<u64>>) -> Result<Bytes> {
        check_key(&self.location(), "get", key)?;
        let k = key.to_string();
        let location = self.location();
        let r = range.clone();
        let packs = (range.is_some() && key.starts_with("packs/")).then(|| self.open_packs.clone());
        self.blocking("get", key, move |root| {
            let file = match &packs {
                Some(packs) => open_pack(packs, root, &k)?,
                None => Arc::new(File::open(root.join(&k))?),
            };
            let r = match r {
                Some(r) => r,
                None => 0..file.metadata()?.len(),
            };
            // A reversed range reads nothing, and is refused below.
            let buf = read_range(&file, r.start..r.end.max(r.start))?;
            // Only an empty read needs the length (one stat fewer per read).
            if buf.is_empty() {
                let len = file.metadata()?.len();
                if (r.start >= len && !(r.start == 0 && len == 0)) || r.end < r.start {
                    return Ok(Err(range_error(&location, &k, &r, len)));
                }
            }
            Ok(Ok(Bytes::from(buf)))
        })
        .await?
    }

    async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        check_key(&self.location(), "put", key)?;
        let k = key.to_string();
        self.blocking("put", key, move |root| {
            let path = root.join(&k);
            let dir = path.parent().unwrap_or(root).to_path_buf();
            create_dirs(root, &dir)?;
            let mut nonce = [0u8; 8];
            getrandom::fill(&mut nonce).map_err(std::io::Error::other)?;
            let name = path.file_name().unwrap_or_default().to_string_lossy();
            let tmp = dir.join(format!(".tmp.{name}.{}", crate::hex(&nonce)));
            let write = || -> std::io::Result<()> {
                let f = File::create_new(&tmp)?;
                // Packs are written once and read rarely: their pages leave the cache
                // once stored. (Not O_DIRECT: the pack's bytes are not page-aligned in
                // memory, and a direct write would copy them into an 8 MiB aligned
                // buffer, measured as 8 MiB of a snapshot's peak memory.)
                std::io::Write::write_all(&mut &f, &data)?;
                publish(&f, &tmp, &path)?;
                let _ = rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed);
                Ok(())
            };
            write().inspect_err(|_| {
                let _ = fs::remove_file(&tmp);
            })
        })
        .await
    }

    async fn delete(&self, key: &str) -> Result<()> {
        check_key(&self.location(), "delete", key)?;
        let k = key.to_string();
        self.open_packs.lock().expect("open packs lock").remove(key);
        self.blocking("delete", key, move |root| {
            let path = root.join(&k);
            match fs::remove_file(&path) {
                Ok(()) => sync_dir(path.parent().unwrap_or(root)),
                Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            }
        })
        .await
    }
}
