//! `snapshot restore`: a snapshot onto a new image file, an older copy, or a device.

use chunker::{BlockVolume, ChunkId, ChunkKind, VolumeKind, Window, hash_chunks, read_window};
use rustix::fs::FallocateFlags;
use serde::Serialize;
use snapshots::{BlobLoc, CHUNKS_PER_LIST, Content, PackId, RepoError, Repository};
use std::{
    collections::HashMap,
    fs::{self, OpenOptions},
    io::ErrorKind,
    os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt},
    path::{Path, PathBuf},
    sync::Arc,
    time::Instant,
};
use tokio::{sync::Semaphore, task::JoinSet};

/// Options of `mover snapshot restore`.
#[derive(Clone, Debug, clap::Args)]
pub struct RestoreOptions {
    /// Write to a DST block device even if it is mounted or held by another user.
    #[arg(long)]
    pub force: bool,
    /// Ranged reads in flight at once.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub reads: usize,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            force: false,
            reads: 8,
        }
    }
}

/// What a restore did.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct RestoreSummary {
    /// The snapshot id.
    pub snapshot: String,
    /// The destination.
    pub destination: PathBuf,
    /// Bytes in the volume.
    pub volume_bytes: u64,
    /// The destination held an older copy (or an interrupted restore) that was compared.
    pub delta: bool,
    /// Chunks fetched from the repository.
    pub chunks_fetched: u64,
    /// Bytes written as data.
    pub bytes_written: u64,
    /// Bytes made zero by punching holes in an existing destination.
    pub bytes_zeroed: u64,
    /// Chunks already equal in the destination.
    pub chunks_unchanged: u64,
    /// Bytes of zero chunks left as holes.
    pub zero_bytes: u64,
    /// Wall time.
    pub duration_secs: f64,
}

struct Dest {
    volume: BlockVolume,
    path: PathBuf,
    partial: Option<PathBuf>,
    /// Newly created: reads as zeros, nothing to compare.
    fresh: bool,
}

fn refused(path: &Path, why: impl Into<String>) -> RepoError {
    RepoError::Refused {
        what: format!("destination {}", path.display()),
        why: why.into(),
    }
}

fn io(what: &'static str, path: &Path, offset: u64, cause: std::io::Error) -> RepoError {
    RepoError::Io {
        what,
        path: path.into(),
        offset,
        cause,
    }
}

/// Opens or creates the destination (new images under a hidden temp name).
fn prepare(dst: &Path, size: u64, force: bool) -> Result<Dest, RepoError> {
    let mut options = OpenOptions::new();
    options.read(true).write(true);
    let meta = match fs::metadata(dst) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let name = dst
                .file_name()
                .ok_or_else(|| refused(dst, "has no file name"))?;
            let parent = match dst.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if !parent.is_dir() {
                return Err(refused(
                    dst,
                    format!(
                        "its directory {} does not exist; create it first",
                        parent.display()
                    ),
                ));
            }
            let partial = parent.join(format!(".{}.mover-partial", name.to_string_lossy()));
            let fresh = !partial.exists();
            if fresh {
                options.create_new(true);
            }
            let mut volume = BlockVolume::open_with(&partial, &options)?;
            if volume.size() != size {
                volume
                    .set_len(size)
                    .map_err(|e| io("sizing", &partial, 0, e))?;
            }
            return Ok(Dest {
                volume,
                path: dst.into(),
                partial: Some(partial),
                fresh,
            });
        }
        Err(e) => return Err(refused(dst, format!("cannot inspect it: {e}"))),
    };
    let ft = meta.file_type();
    if ft.is_dir() {
        return Err(refused(
            dst,
            "is a directory; name the image file to create inside it",
        ));
    }
    if !ft.is_file() && !ft.is_block_device() {
        return Err(refused(dst, "is neither a block device nor an image file"));
    }
    if ft.is_block_device() && !force {
        // O_EXCL on a block device fails with EBUSY while it is mounted or held.
        options.custom_flags(rustix::fs::OFlags::EXCL.bits() as i32);
    }
    let mut volume = BlockVolume::open_with(dst, &options).map_err(|e| match e {
        chunker::ChunkerError::Open { cause, .. }
            if cause.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error()) =>
        {
            refused(
                dst,
                "is mounted or in use; writing under a mounted filesystem corrupts it. Unmount it, or pass --force if you are sure",
            )
        }
        other => other.into(),
    })?;
    match volume.kind() {
        VolumeKind::BlockDevice if volume.size() < size => {
            return Err(refused(
                dst,
                format!(
                    "is smaller than the snapshot ({} < {size} bytes)",
                    volume.size()
                ),
            ));
        }
        VolumeKind::ImageFile if volume.size() > size => {
            return Err(refused(
                dst,
                format!(
                    "is larger than the snapshot ({} > {size} bytes) and would keep stale bytes past its end; truncate it (truncate -s {size}) or remove it",
                    volume.size()
                ),
            ));
        }
        VolumeKind::ImageFile if volume.size() < size => {
            volume.set_len(size).map_err(|e| io("growing", dst, 0, e))?;
        }
        _ => {}
    }
    let volume = if volume.size() > size {
        volume.limited_to(size)
    } else {
        volume
    };
    Ok(Dest {
        volume,
        path: dst.into(),
        partial: None,
        fresh: false,
    })
}

/// Chunks per planning window.
const WINDOW_CHUNKS: usize = 64;

/// Restores snapshot `snap` (an id, id prefix or `latest`) from `repo` to `dst`.
pub async fn restore_snapshot(
    repo: Arc<Repository>,
    snap: &str,
    dst: &Path,
    opts: &RestoreOptions,
) -> Result<RestoreSummary, RepoError> {
    let started = Instant::now();
    let snap = repo.find_snapshot(snap).await?;
    let Content::Block {
        size,
        chunk_size,
        chunks_per_list,
        lists,
    } = &snap.manifest.content;
    let (size, cs) = (*size, *chunk_size);
    if *chunks_per_list != CHUNKS_PER_LIST && lists.len() > 1 {
        return Err(RepoError::Corrupt {
            key: format!("snapshots/{}", snap.id),
            offset: 0,
            what: format!("unexpected chunks per list {chunks_per_list}"),
        });
    }
    let chunk = chunker::ChunkSize::new(cs).map_err(RepoError::from)?;
    let index = Arc::new(repo.load_index().await?);
    let dest = Arc::new(prepare(dst, size, opts.force)?);
    let mut sum = RestoreSummary {
        snapshot: snap.id.clone(),
        destination: dst.into(),
        volume_bytes: size,
        delta: !dest.fresh,
        ..Default::default()
    };
    let sem = Arc::new(Semaphore::new(opts.reads.max(1)));
    let mut tasks: JoinSet<Result<(u64, u64), RepoError>> = JoinSet::new();
    for (li, list) in lists.iter().enumerate() {
        let kinds = repo.read_list(&index, list).await?;
        for (wi, wk) in kinds.chunks(WINDOW_CHUNKS).enumerate() {
            let first = li as u64 * chunks_per_list + (wi * WINDOW_CHUNKS) as u64;
            let offset = first * cs;
            // Which chunks of this window must change, and how.
            let want: Vec<(u64, ChunkKind)> = if dest.fresh {
                wk.iter()
                    .enumerate()
                    .map(|(i, k)| (offset + i as u64 * cs, *k))
                    .collect()
            } else {
                let (dest, key, wk) = (dest.clone(), repo.chunk_key().clone(), wk.to_vec());
                let len = (wk.len() as u64 * cs).min(size - offset) as usize;
                tokio::task::spawn_blocking(move || {
                    let mut win = Window::default();
                    read_window(&dest.volume, chunk, offset, len, &mut win)?;
                    let have = hash_chunks(&key, chunk, &win);
                    Ok::<_, RepoError>(
                        wk.iter()
                            .zip(have)
                            .enumerate()
                            .filter(|(_, (want, have))| **want != *have)
                            .map(|(i, (want, _))| (offset + i as u64 * cs, *want))
                            .collect(),
                    )
                })
                .await
                .map_err(join)??
            };
            sum.chunks_unchanged += wk.len() as u64 - want.len() as u64;
            let mut by_pack: HashMap<PackId, Vec<(ChunkId, BlobLoc)>> = HashMap::new();
            let mut at: HashMap<ChunkId, Vec<u64>> = HashMap::new();
            for (off, k) in want {
                let len = cs.min(size - off);
                match k {
                    ChunkKind::Zero if dest.fresh => sum.zero_bytes += len,
                    ChunkKind::Zero => {
                        zero_range(&dest.volume, off, len)?;
                        sum.bytes_zeroed += len;
                    }
                    ChunkKind::Data(id) => {
                        let offs = at.entry(id).or_default();
                        if offs.is_empty() {
                            let loc = index.get(&id).ok_or_else(|| RepoError::MissingBlob {
                                id: format!("{} (volume bytes {off}..{})", id.to_hex(), off + len),
                            })?;
                            by_pack.entry(loc.pack).or_default().push((id, loc));
                        }
                        offs.push(off);
                    }
                }
            }
            let at = Arc::new(at);
            for (pack, blobs) in by_pack {
                let permit = sem
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|e| RepoError::Refused {
                        what: "restore".into(),
                        why: e.to_string(),
                    })?;
                while let Some(r) = tasks.try_join_next() {
                    let (n, b) = r.map_err(join)??;
                    sum.chunks_fetched += n;
                    sum.bytes_written += b;
                }
                let (repo, dest, at) = (repo.clone(), dest.clone(), at.clone());
                tasks.spawn(async move {
                    let _permit = permit;
                    let blobs = repo.read_blobs(&pack, blobs).await.map_err(|e| match e {
                        RepoError::Corrupt { key, offset, what } => RepoError::Corrupt {
                            key,
                            offset,
                            what: format!(
                                "{what}; the restore stopped, nothing corrupt was written"
                            ),
                        },
                        e => e,
                    })?;
                    tokio::task::spawn_blocking(move || {
                        let (mut n, mut bytes) = (0, 0);
                        for (id, data) in blobs {
                            for off in at.get(&id).into_iter().flatten() {
                                dest.volume
                                    .file()
                                    .write_all_at(&data, *off)
                                    .map_err(|e| io("write to", &dest.path, *off, e))?;
                                n += 1;
                                bytes += data.len() as u64;
                            }
                        }
                        Ok((n, bytes))
                    })
                    .await
                    .map_err(join)?
                });
            }
        }
    }
    while let Some(r) = tasks.join_next().await {
        let (n, b) = r.map_err(join)??;
        sum.chunks_fetched += n;
        sum.bytes_written += b;
    }
    let dest = Arc::try_unwrap(dest).map_err(|_| RepoError::Refused {
        what: "restore".into(),
        why: "internal: destination still shared".into(),
    })?;
    dest.volume
        .file()
        .sync_all()
        .map_err(|e| io("sync of", &dest.path, 0, e))?;
    if let Some(partial) = &dest.partial {
        if dest.path.exists() {
            return Err(refused(
                &dest.path,
                format!(
                    "was created by someone else during the restore; the restored image is kept at {}",
                    partial.display()
                ),
            ));
        }
        fs::rename(partial, &dest.path).map_err(|e| io("rename onto", &dest.path, 0, e))?;
        let dir = dest
            .path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io("sync of directory", dir, 0, e))?;
    }
    sum.duration_secs = started.elapsed().as_secs_f64();
    Ok(sum)
}

fn join(e: tokio::task::JoinError) -> RepoError {
    RepoError::Refused {
        what: "restore task".into(),
        why: format!("failed: {e}"),
    }
}

/// Makes a range read as zeros: a punched hole where possible, else written zeros.
/// (The same policy as `mover copy`'s; kept here until copy's destination helpers are
/// shared with the snapshot engine.)
fn zero_range(dst: &BlockVolume, offset: u64, len: u64) -> Result<(), RepoError> {
    use rustix::io::Errno;
    for flags in [
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE,
    ] {
        match rustix::fs::fallocate(dst.file(), flags, offset, len) {
            Ok(()) => return Ok(()),
            Err(Errno::OPNOTSUPP | Errno::INVAL | Errno::NODEV | Errno::NOTTY) => continue,
            Err(e) => return Err(io("zeroing of", dst.path(), offset, e.into())),
        }
    }
    let zeros = vec![0u8; len as usize];
    dst.file()
        .write_all_at(&zeros, offset)
        .map_err(|e| io("write to", dst.path(), offset, e))
}
