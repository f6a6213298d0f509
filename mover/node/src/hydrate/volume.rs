//! Volumes as the NBD server sees them ([`transport::nbd::NbdVolume`]): a plain local
//! export, and a hydrating one whose reads wait for their regions.

use super::{
    Hydrations,
    engine::{Hydration, blocking},
};
use bytes::Bytes;
use std::{
    fs::File,
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::Arc,
};
use transport::nbd::{NbdVolume, STATE_HOLE, STATE_MISSING, STATE_ZERO};

/// At most this many extents answer one BLOCK_STATUS.
const MAX_EXTENTS: usize = 1024;

/// A block export (device or image file) served as it is.
pub struct LocalVolume {
    file: Arc<File>,
    path: PathBuf,
    size: u64,
    read_only: bool,
}

impl LocalVolume {
    /// Opens the device or image at `path`.
    pub fn open(path: &Path, read_only: bool) -> io::Result<Self> {
        let size = chunker::BlockVolume::open(path)
            .map_err(|e| io::Error::other(e.to_string()))?
            .size();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)?;
        Ok(LocalVolume {
            file: Arc::new(file),
            path: path.into(),
            size,
            read_only,
        })
    }
}

#[tonic::async_trait]
impl NbdVolume for LocalVolume {
    fn size(&self) -> u64 {
        self.size
    }

    fn local_file(&self) -> Option<PathBuf> {
        Some(self.path.clone())
    }

    fn read_only(&self) -> bool {
        self.read_only
    }

    fn preferred_block(&self) -> u32 {
        4096
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Vec<u8>> {
        pread(&self.file, offset, len).await
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
        pwrite(&self.file, offset, data, fua).await
    }

    async fn flush(&self) -> io::Result<()> {
        let f = self.file.clone();
        blocking(move || f.sync_data()).await
    }

    async fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        zero(&self.file, &self.path, offset, len, true, fua).await
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
        fua: bool,
    ) -> io::Result<()> {
        zero(&self.file, &self.path, offset, len, may_trim, fua).await
    }

    async fn block_status(&self, offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        let f = self.file.clone();
        let end = offset + len;
        blocking(move || Ok(local_extents(&f, offset, end))).await
    }

    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        // Into the page cache ahead of the reads.
        let _ = rustix::fs::fadvise(
            &*self.file,
            offset,
            std::num::NonZeroU64::new(len),
            rustix::fs::Advice::WillNeed,
        );
        Ok(())
    }
}

/// An export being hydrated: a read of a missing region fetches it first; a write
/// covering a region whole needs no fetch.
///
/// It follows the export, not one run of its hydration: each request goes to the
/// hydration the agent knows for the export now. A client that keeps it open (a pod's
/// device) across `hydrate cancel` and `hydrate start`, which makes a new [`Hydration`]
/// from the saved bitmap, goes on with the new one: what arrived stays readable while
/// cancelled, and missing regions are fetched again once the fill resumes.
pub struct HydratingVolume {
    hydrations: Arc<Hydrations>,
    /// The hydration it was opened on (its name is the export's): used until the
    /// registry knows a newer one.
    opened: Arc<Hydration>,
}

impl HydratingVolume {
    /// The volume of `export`, hydrating as `opened`.
    pub fn new(hydrations: Arc<Hydrations>, opened: Arc<Hydration>) -> Self {
        HydratingVolume { hydrations, opened }
    }

    /// The export's hydration now.
    fn current(&self) -> Arc<Hydration> {
        self.hydrations
            .get(self.opened.name())
            .unwrap_or_else(|| self.opened.clone())
    }

    /// Runs a write-like operation: claims the whole regions, makes the partial ones
    /// present, runs `op`, then marks the whole ones present.
    async fn write_with(
        &self,
        h: &Hydration,
        offset: u64,
        len: u64,
        fua: bool,
        op: impl std::future::Future<Output = io::Result<()>> + Send,
    ) -> io::Result<()> {
        h.client_io();
        let claim = h.prepare_write(offset, len).await?;
        op.await?;
        claim.done();
        if fua {
            h.commit().await?;
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl NbdVolume for HydratingVolume {
    fn size(&self) -> u64 {
        self.opened.size()
    }

    fn read_only(&self) -> bool {
        false
    }

    fn preferred_block(&self) -> u32 {
        self.opened.region_size().min(32 << 20) as u32
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Vec<u8>> {
        let h = self.current();
        h.client_io();
        h.ensure(h.regions_of(offset, len as u64)).await?;
        pread(h.file(), offset, len).await
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
        let h = self.current();
        let file = h.file().clone();
        self.write_with(&h, offset, data.len() as u64, fua, async move {
            pwrite(&file, offset, data, false).await
        })
        .await
    }

    async fn flush(&self) -> io::Result<()> {
        self.current().commit().await
    }

    async fn trim(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        self.write_zeroes(offset, len, true, fua).await
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_trim: bool,
        fua: bool,
    ) -> io::Result<()> {
        let h = self.current();
        let (file, path) = (h.file().clone(), h.path().to_path_buf());
        self.write_with(&h, offset, len, fua, async move {
            zero(&file, &path, offset, len, may_trim, false).await
        })
        .await
    }

    async fn block_status(&self, offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        let h = self.current();
        let end = offset + len;
        blocking(move || {
            let mut out: Vec<(u64, u32)> = Vec::new();
            let mut at = offset;
            while at < end && out.len() < MAX_EXTENTS {
                let r = at / h.region_size();
                let stop = h.region_range(r).end.min(end);
                let here = if h.is_present(r) {
                    local_extents(h.file(), at, stop)
                } else if h.is_source_hole(r) {
                    vec![(stop - at, STATE_HOLE | STATE_ZERO)]
                } else {
                    vec![(stop - at, 0)]
                };
                for (l, f) in here {
                    match out.last_mut() {
                        Some(last) if last.1 == f => last.0 += l,
                        _ => out.push((l, f)),
                    }
                }
                at = stop;
            }
            Ok(out)
        })
        .await
    }

    async fn cache(&self, offset: u64, len: u64) -> io::Result<()> {
        let h = self.current();
        h.ensure(h.regions_of(offset, len)).await
    }

    async fn presence(&self, offset: u64, len: u64) -> io::Result<Vec<(u64, u32)>> {
        // Missing: a region a read would fetch first (a hole of the source never is).
        let h = self.current();
        let end = offset + len;
        let mut out: Vec<(u64, u32)> = Vec::new();
        let mut at = offset;
        while at < end && out.len() < MAX_EXTENTS {
            let r = at / h.region_size();
            let stop = h.region_range(r).end.min(end);
            let here = h.is_present(r) || h.is_source_hole(r);
            let flags = if here { 0 } else { STATE_MISSING };
            match out.last_mut() {
                Some(last) if last.1 == flags => last.0 += stop - at,
                _ => out.push((stop - at, flags)),
            }
            at = stop;
        }
        Ok(out)
    }
}

async fn pread(file: &Arc<File>, offset: u64, len: u32) -> io::Result<Vec<u8>> {
    // What the page cache holds is read here at once (RWF_NOWAIT never waits for the
    // disk); only the rest pays for a hop to a blocking thread.
    let mut buf = vec![0u8; len as usize];
    let cached = rustix::io::preadv2(
        &**file,
        &mut [std::io::IoSliceMut::new(&mut buf)],
        offset,
        rustix::io::ReadWriteFlags::NOWAIT,
    );
    if cached.is_ok_and(|n| n == len as usize) {
        return Ok(buf);
    }
    let f = file.clone();
    blocking(move || {
        f.read_exact_at(&mut buf, offset)?;
        Ok(buf)
    })
    .await
}

async fn pwrite(file: &Arc<File>, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
    let f = file.clone();
    blocking(move || {
        f.write_all_at(&data, offset)?;
        if fua {
            f.sync_data()?;
        }
        Ok(())
    })
    .await
}

/// Makes `[offset, offset + len)` read as zeros: a hole where allowed (`may_trim`), else
/// zeroed in place; written zeros where the file system or device can do neither.
async fn zero(
    file: &Arc<File>,
    path: &Path,
    offset: u64,
    len: u64,
    may_trim: bool,
    fua: bool,
) -> io::Result<()> {
    use rustix::fs::{FallocateFlags as F, fallocate};
    let (f, path) = (file.clone(), path.to_path_buf());
    blocking(move || {
        let mut ways = vec![F::ZERO_RANGE | F::KEEP_SIZE];
        if may_trim {
            ways.insert(0, F::PUNCH_HOLE | F::KEEP_SIZE);
        }
        let done = ways
            .into_iter()
            .any(|w| fallocate(&*f, w, offset, len).is_ok());
        if !done {
            let zeros = vec![0u8; (len.min(1 << 20)) as usize];
            let mut at = offset;
            while at < offset + len {
                let n = (offset + len - at).min(zeros.len() as u64) as usize;
                f.write_all_at(&zeros[..n], at).map_err(|e| {
                    io::Error::new(e.kind(), format!("zeroing {}: {e}", path.display()))
                })?;
                at += n as u64;
            }
        }
        if fua {
            f.sync_data()?;
        }
        Ok(())
    })
    .await
}

/// The allocation of `[offset, end)` of a local file, from SEEK_DATA / SEEK_HOLE (a
/// device, where the kernel cannot tell, is all data).
fn local_extents(file: &File, offset: u64, end: u64) -> Vec<(u64, u32)> {
    use rustix::fs::{SeekFrom, seek};
    let mut out = Vec::new();
    let mut at = offset;
    while at < end && out.len() < MAX_EXTENTS {
        let data = match seek(file, SeekFrom::Data(at)) {
            Ok(d) => d.min(end),
            Err(rustix::io::Errno::NXIO) => end,
            Err(_) => at,
        };
        if data > at {
            out.push((data - at, STATE_HOLE | STATE_ZERO));
            at = data;
            continue;
        }
        let hole = seek(file, SeekFrom::Hole(at))
            .map_or(end, |h| h.min(end))
            .max(at + 1);
        out.push((hole - at, 0));
        at = hole;
    }
    out
}
