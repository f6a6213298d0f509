use crate::{
    direct::DirectFile,
    error::{ChunkerError, Result},
};
use rustix::fs::SeekFrom;
use std::{
    fs::{File, OpenOptions},
    io::{Seek, SeekFrom as StdSeekFrom},
    os::unix::fs::{FileExt, FileTypeExt, MetadataExt},
    path::{Path, PathBuf},
};

/// What kind of object holds a block volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VolumeKind {
    /// A block device such as `/dev/loop0` or `/dev/sdb`.
    BlockDevice,
    /// A regular file holding a raw image.
    ImageFile,
}

/// An open block volume: a block device or an image file, read by offset.
#[derive(Debug)]
pub struct BlockVolume {
    file: File,
    path: PathBuf,
    kind: VolumeKind,
    size: u64,
    holes: HoleMap,
    /// Large reads bypass the page cache through this (see [`crate::direct`]).
    direct: DirectFile,
}

/// Where the volume's holes can be learned.
#[derive(Debug)]
enum HoleMap {
    /// `SEEK_DATA`/`SEEK_HOLE` on the volume's own file.
    OwnFile,
    /// A loop device: the same calls on its backing file, shifted by the loop offset.
    LoopBacking { file: File, offset: u64 },
    /// A block device that cannot tell: everything counts as data (zero detection
    /// still finds zero chunks, at the cost of reading them).
    None,
}

impl HoleMap {
    /// For a loop device over a regular file, its backing file; else `None`.
    fn for_device(device: &File, rdev: u64) -> HoleMap {
        let sys = format!(
            "/sys/dev/block/{}:{}/loop",
            rustix::fs::major(rdev),
            rustix::fs::minor(rdev)
        );
        let read = |name: &str| std::fs::read_to_string(format!("{sys}/{name}")).ok();
        let (Some(backing), Some(offset)) = (read("backing_file"), read("offset")) else {
            return HoleMap::None;
        };
        let backing = backing.trim_end();
        let Ok(offset) = offset.trim().parse::<u64>() else {
            return HoleMap::None;
        };
        match File::open(backing) {
            Ok(file) if file.metadata().is_ok_and(|m| m.is_file()) => {
                // Writes made through the device may still sit in its page cache, not
                // yet in the backing file's map: flush them so no data looks like a hole.
                if device.sync_all().is_err() {
                    return HoleMap::None;
                }
                HoleMap::LoopBacking { file, offset }
            }
            _ => HoleMap::None,
        }
    }
}

impl BlockVolume {
    /// Opens `path` read-only as a block volume.
    pub fn open(path: &Path) -> Result<Self> {
        Self::open_with(path, OpenOptions::new().read(true))
    }

    /// Opens `path` with the given options (e.g. read-write, `O_EXCL`), and checks that it
    /// is a block device or a regular file.
    pub fn open_with(path: &Path, options: &OpenOptions) -> Result<Self> {
        let open_err = |cause| ChunkerError::Open {
            path: path.to_path_buf(),
            cause,
        };
        let mut file = options.open(path).map_err(open_err)?;
        let meta = file.metadata().map_err(open_err)?;
        let ft = meta.file_type();
        let kind = if ft.is_block_device() {
            VolumeKind::BlockDevice
        } else if ft.is_file() {
            VolumeKind::ImageFile
        } else {
            let what = if ft.is_dir() {
                "a directory (file-tree volumes are copied as trees, not images)"
            } else if ft.is_char_device() {
                "a character device"
            } else if ft.is_fifo() {
                "a FIFO"
            } else if ft.is_socket() {
                "a socket"
            } else {
                "not a regular file"
            };
            return Err(ChunkerError::NotABlockVolume {
                path: path.to_path_buf(),
                what,
            });
        };
        // st_size is 0 for block devices: ask the device by seeking to its end.
        let size = match kind {
            VolumeKind::ImageFile => meta.len(),
            VolumeKind::BlockDevice => file.seek(StdSeekFrom::End(0)).map_err(open_err)?,
        };
        let holes = match kind {
            VolumeKind::ImageFile => HoleMap::OwnFile,
            VolumeKind::BlockDevice => HoleMap::for_device(&file, meta.rdev()),
        };
        Ok(BlockVolume {
            direct: DirectFile::reopen(&file, false),
            file,
            path: path.to_path_buf(),
            kind,
            size,
            holes,
        })
    }

    /// A view of only the first `size` bytes (e.g. of a destination device larger than
    /// its source), for reading and hashing. `size` must not exceed the volume's size.
    pub fn limited_to(mut self, size: u64) -> Self {
        assert!(
            size <= self.size,
            "a volume view cannot be larger than the volume"
        );
        self.size = size;
        self
    }

    /// [`BlockVolume::limited_to`] `size` if the volume is larger, else unchanged.
    pub fn limited_to_at_most(self, size: u64) -> Self {
        if self.size > size {
            self.limited_to(size)
        } else {
            self
        }
    }

    /// Resizes an image file (sparse growth or truncation) and records the new size.
    pub fn set_len(&mut self, size: u64) -> std::io::Result<()> {
        if self.kind == VolumeKind::BlockDevice {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Unsupported,
                "a block device cannot be resized",
            ));
        }
        self.file.set_len(size)?;
        self.size = size;
        Ok(())
    }

    /// The path it was opened by.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Block device or image file.
    pub fn kind(&self) -> VolumeKind {
        self.kind
    }

    /// Size in bytes, as of opening.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The open file, for writers and `fsync`.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The open file, giving up the volume.
    pub fn into_file(self) -> File {
        self.file
    }

    /// (device, inode) for regular files, or the device number for block devices:
    /// equal identities mean the same storage.
    pub fn identity(&self) -> Result<(u64, u64)> {
        let meta = self.file.metadata().map_err(|cause| ChunkerError::Open {
            path: self.path.clone(),
            cause,
        })?;
        Ok(match self.kind {
            VolumeKind::BlockDevice => (u64::MAX, meta.rdev()),
            VolumeKind::ImageFile => (meta.dev(), meta.ino()),
        })
    }

    /// Reads exactly `buf.len()` bytes at `offset`; a short read means the volume shrank.
    pub fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let read_error = |at, cause| ChunkerError::Read {
            path: self.path.clone(),
            offset: at,
            cause,
        };
        let mut done = if crate::direct::all_cached(&self.file, offset, buf.len()) {
            0
        } else {
            self.direct
                .read_at(buf, offset)
                .map_err(|e| read_error(offset, e))?
        };
        while done < buf.len() {
            let at = offset + done as u64;
            match self.file.read_at(&mut buf[done..], at) {
                Ok(0) => {
                    return Err(ChunkerError::ShortRead {
                        path: self.path.clone(),
                        offset: at,
                        size: self.size,
                    });
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(cause) => return Err(read_error(at, cause)),
            }
        }
        Ok(())
    }

    /// The start of the next data region at or after `offset`, or `None` when only a
    /// hole follows. Where holes cannot be learned, everything counts as data.
    pub fn next_data(&self, offset: u64) -> Option<u64> {
        let (file, shift) = match &self.holes {
            HoleMap::None => return (offset < self.size).then_some(offset),
            HoleMap::OwnFile => (&self.file, 0),
            HoleMap::LoopBacking { file, offset } => (file, *offset),
        };
        match rustix::fs::seek(file, SeekFrom::Data(offset + shift)) {
            Ok(pos) => Some(pos - shift).filter(|&p| p < self.size),
            Err(rustix::io::Errno::NXIO) => None,
            Err(_) => Some(offset),
        }
    }

    /// The start of the next hole at or after `offset` (the end of the volume counts as a
    /// hole).
    pub fn next_hole(&self, offset: u64) -> u64 {
        let (file, shift) = match &self.holes {
            HoleMap::None => return self.size,
            HoleMap::OwnFile => (&self.file, 0),
            HoleMap::LoopBacking { file, offset } => (file, *offset),
        };
        match rustix::fs::seek(file, SeekFrom::Hole(offset + shift)) {
            Ok(pos) => (pos - shift).min(self.size),
            Err(_) => self.size,
        }
    }

    /// Tells the kernel the volume will be read sequentially, for deeper read-ahead.
    pub fn advise_sequential(&self) {
        let _ = rustix::fs::fadvise(&self.file, 0, None, rustix::fs::Advice::Sequential);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn reports_size_kind_and_holes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let mut f = File::create(&path).unwrap();
        f.set_len(8 << 20).unwrap();
        f.write_all_at(&[7u8; 4096], 4 << 20).unwrap();
        f.flush().unwrap();
        let v = BlockVolume::open(&path).unwrap();
        assert_eq!(v.size(), 8 << 20);
        assert_eq!(v.kind(), VolumeKind::ImageFile);
        // tmpfs, ext4 and xfs all track holes; the data block must be found.
        let data = v.next_data(0).unwrap();
        assert!(data <= 4 << 20);
        assert!(v.next_hole(4 << 20) > 4 << 20);
        assert_eq!(v.next_data((4 << 20) + 4096).filter(|&d| d < 8 << 20), None);
        let mut buf = [0u8; 16];
        v.read_exact_at(&mut buf, 4 << 20).unwrap();
        assert_eq!(buf, [7u8; 16]);
        let err = v.read_exact_at(&mut buf, (8 << 20) - 8).unwrap_err();
        assert!(matches!(err, ChunkerError::ShortRead { .. }), "{err}");
    }

    #[test]
    fn refuses_directories_with_a_reason() {
        let dir = tempfile::tempdir().unwrap();
        let err = BlockVolume::open(dir.path()).unwrap_err().to_string();
        assert!(err.contains("is a directory"), "{err}");
        let err = BlockVolume::open(&dir.path().join("missing"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("cannot open") && err.contains("missing"),
            "{err}"
        );
    }
}
