//! A FUSE file system of one file, `volume`, whose bytes are an [`NbdVolume`]'s: the
//! same volume the NBD server would serve, so a read of a region still to come fetches
//! it first, as over NBD. Each request runs as a task on the agent's runtime and answers
//! when it is done, so a fetch holds up only the reads that need it.

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, KernelConfig,
    LockOwner, OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyWrite, ReplyXattr, Request, WriteFlags,
};
use std::{
    ffi::OsStr,
    sync::Arc,
    time::{Duration, UNIX_EPOCH},
};
use transport::nbd::NbdVolume;

/// The file's name in the mount.
pub const FILE_NAME: &str = "volume";
const FILE_INO: INodeNo = INodeNo(2);
/// The size never changes while mounted: the kernel may keep attributes.
const TTL: Duration = Duration::from_secs(3600);
/// The largest read or write the kernel sends in one request.
const MAX_IO: u32 = 1 << 20;

/// The file system.
pub struct VolumeFile {
    pub(super) volume: Arc<dyn NbdVolume>,
    pub(super) runtime: tokio::runtime::Handle,
}

impl VolumeFile {
    fn attr(&self, ino: INodeNo) -> Option<FileAttr> {
        let (kind, perm, size, nlink) = match ino {
            INodeNo::ROOT => (FileType::Directory, 0o700, 0, 2),
            FILE_INO => (
                FileType::RegularFile,
                if self.volume.read_only() {
                    0o400
                } else {
                    0o600
                },
                self.volume.size(),
                1,
            ),
            _ => return None,
        };
        Some(FileAttr {
            ino,
            size,
            blocks: size.div_ceil(512),
            atime: UNIX_EPOCH,
            mtime: UNIX_EPOCH,
            ctime: UNIX_EPOCH,
            crtime: UNIX_EPOCH,
            kind,
            perm,
            nlink,
            uid: 0,
            gid: 0,
            rdev: 0,
            flags: 0,
            blksize: 4096,
        })
    }

    /// Runs `op` on the runtime; its result goes to the kernel through `answer`.
    fn spawn<T: Send + 'static>(
        &self,
        op: impl Future<Output = std::io::Result<T>> + Send + 'static,
        answer: impl FnOnce(Result<T, Errno>) + Send + 'static,
    ) {
        self.runtime.spawn(async move {
            // An error without an OS code (a fetch that failed) is EIO.
            answer(op.await.map_err(|e| {
                tracing::debug!("volume file: {e}");
                Errno::from(e)
            }))
        });
    }

    /// `len` bytes at `offset`, cut at the end of the volume.
    fn within(&self, offset: u64, len: u64) -> u64 {
        self.volume.size().saturating_sub(offset).min(len)
    }
}

impl Filesystem for VolumeFile {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Older kernels cap lower; theirs is kept.
        let _ = config.set_max_write(MAX_IO);
        let _ = config.set_max_readahead(MAX_IO);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        match (parent, name.to_str()) {
            (INodeNo::ROOT, Some(FILE_NAME)) => {
                reply.entry(&TTL, &self.attr(FILE_INO).unwrap(), fuser::Generation(0))
            }
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.attr(ino) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<std::time::SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<std::time::SystemTime>,
        _chgtime: Option<std::time::SystemTime>,
        _bkuptime: Option<std::time::SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        match self.attr(ino) {
            // A volume's size is the source's: a truncate would tear it.
            Some(a) if size.is_some_and(|s| s != a.size) => reply.error(Errno::EPERM),
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if ino != FILE_INO {
            return reply.error(Errno::EISDIR);
        }
        if self.volume.read_only() && flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        // Direct I/O: the loop device above keeps the page cache; a second copy here
        // would only halve what the node can cache.
        reply.opened(
            FileHandle(0),
            FopenFlags::FOPEN_DIRECT_IO | FopenFlags::FOPEN_PARALLEL_DIRECT_WRITES,
        );
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let len = self.within(offset, size as u64) as u32;
        if len == 0 {
            return reply.data(&[]);
        }
        let volume = self.volume.clone();
        self.spawn(
            async move { volume.read(offset, len).await },
            move |r| match r {
                Ok(data) => reply.data(&data),
                Err(e) => reply.error(e),
            },
        );
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if self.within(offset, data.len() as u64) < data.len() as u64 {
            return reply.error(Errno::ENOSPC);
        }
        let (volume, data) = (self.volume.clone(), data.to_vec());
        self.spawn(
            async move {
                volume.write(offset, &data, false).await?;
                Ok(data.len() as u32)
            },
            move |r| match r {
                Ok(n) => reply.written(n),
                Err(e) => reply.error(e),
            },
        );
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2): durability is fsync's business.
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // The loop device's flush (a pod's fsync) arrives here.
        let volume = self.volume.clone();
        self.spawn(async move { volume.flush().await }, move |r| match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        });
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        // The loop device's discard and write-zeroes arrive as these.
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
        let len = self.within(offset, length);
        let volume = self.volume.clone();
        match mode {
            // Every byte of the volume is there already.
            0 | libc::FALLOC_FL_KEEP_SIZE if len == length => reply.ok(),
            PUNCH | ZERO | libc::FALLOC_FL_ZERO_RANGE if len == length => self.spawn(
                async move {
                    if mode == PUNCH {
                        volume.trim(offset, len, false).await
                    } else {
                        volume.write_zeroes(offset, len, false, false).await
                    }
                },
                move |r| match r {
                    Ok(()) => reply.ok(),
                    Err(e) => reply.error(e),
                },
            ),
            _ if len < length => reply.error(Errno::ENOSPC),
            _ => reply.error(Errno::EOPNOTSUPP),
        }
    }

    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        // None (security.* and the like are asked on every open).
        reply.error(Errno::ENODATA);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: ReplyXattr) {
        if size == 0 {
            reply.size(0)
        } else {
            reply.data(&[])
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino != INodeNo::ROOT {
            return reply.error(Errno::ENOTDIR);
        }
        let entries = [
            (INodeNo::ROOT, FileType::Directory, "."),
            (INodeNo::ROOT, FileType::Directory, ".."),
            (FILE_INO, FileType::RegularFile, FILE_NAME),
        ];
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(ino, (i + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}
