//! Getting the destination ready: the safety checks that run before anything is written,
//! and the temp-name / marker scheme that keeps an interrupted copy from looking complete.

use super::{CopyOptions, marker::Marker};
use crate::error::{CopyError, Result, write_error};
use chunker::{BlockVolume, VolumeKind};
use std::{
    fs::{self, OpenOptions},
    io::ErrorKind,
    os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt},
    path::{Path, PathBuf},
};

/// A destination opened for writing.
pub struct Destination {
    /// The open volume (the temp file while `partial` is set).
    pub volume: BlockVolume,
    /// The path the user named.
    pub path: PathBuf,
    /// Set when writing a new image under a temp name, renamed over `path` at the end.
    pub partial: Option<PathBuf>,
    /// Newly created and sparse: it reads as zeros, so it need not be read or compared.
    pub fresh: bool,
    /// Set while an in-place copy is under way; removed when it is complete.
    pub(crate) marker: Option<Marker>,
    /// An earlier interrupted copy to this destination is being finished.
    pub resumed: bool,
}

/// Where the data comes from, for the destination's checks.
pub struct Origin<'a> {
    /// Bytes to be copied.
    pub size: u64,
    /// A local source volume (checked not to be the destination), or `None` for data
    /// arriving over the network.
    pub volume: Option<&'a BlockVolume>,
    /// How to name the source in the in-progress marker.
    pub name: &'a Path,
}

impl<'a> Origin<'a> {
    /// A local source volume.
    pub fn local(volume: &'a BlockVolume) -> Self {
        Origin {
            size: volume.size(),
            volume: Some(volume),
            name: volume.path(),
        }
    }
}

/// Opens (or creates) `dst` for a copy from `src`, refusing anything unsafe first.
pub fn prepare(src: Origin<'_>, dst: &Path, opts: &CopyOptions) -> Result<Destination> {
    let size = src.size;
    let meta = match fs::metadata(dst) {
        Ok(m) => m,
        Err(e) if e.kind() == ErrorKind::NotFound => return create_new(size, dst),
        Err(source) => return Err(bad(dst, format!("cannot inspect it: {source}"))),
    };
    let ft = meta.file_type();
    if ft.is_dir() {
        return Err(bad(
            dst,
            "is a directory; name the image file to create inside it (e.g. DIR/disk.img)".into(),
        ));
    }
    if !ft.is_file() && !ft.is_block_device() {
        return Err(bad(
            dst,
            "is neither a block device nor an image file".into(),
        ));
    }
    if let Some(volume) = src.volume {
        check_not_same(volume, dst, &meta)?;
    }
    let mut options = OpenOptions::new();
    options.read(true).write(true);
    if ft.is_block_device() && !opts.force {
        if let Some(mountpoint) = mounted_at(meta.rdev()) {
            return Err(CopyError::DestinationInUse {
                path: dst.into(),
                detail: format!("mounted at {mountpoint}"),
            });
        }
        // O_EXCL on a block device fails with EBUSY while anyone holds it
        // (a mount, device-mapper, md, another exclusive opener).
        options.custom_flags(rustix::fs::OFlags::EXCL.bits() as i32);
    }
    let mut volume = BlockVolume::open_with(dst, &options).map_err(|e| match e {
        chunker::ChunkerError::Open { cause, .. }
            if cause.raw_os_error() == Some(rustix::io::Errno::BUSY.raw_os_error()) =>
        {
            CopyError::DestinationInUse {
                path: dst.into(),
                detail: "in use by another program or holder (LVM, RAID, a mount)".into(),
            }
        }
        other => other.into(),
    })?;
    let too_small = |hint| CopyError::DestinationTooSmall {
        path: dst.into(),
        dst_size: volume.size(),
        src_size: size,
        hint,
    };
    match volume.kind() {
        VolumeKind::BlockDevice if volume.size() < size => {
            return Err(too_small("use a device at least as large as the source"));
        }
        VolumeKind::ImageFile if volume.size() < size && !opts.grow => {
            return Err(too_small("pass --grow to extend the image file"));
        }
        VolumeKind::ImageFile if volume.size() > size => {
            return Err(CopyError::DestinationLarger {
                path: dst.into(),
                dst_size: volume.size(),
                src_size: size,
            });
        }
        VolumeKind::ImageFile if volume.size() < size => {
            volume
                .set_len(size)
                .map_err(|e| write_error("growing", dst, 0, e))?;
        }
        _ => {}
    }
    // A larger device keeps its bytes past the source's end; only the prefix is copied.
    let volume = volume.limited_to_at_most(size);
    let (marker, resumed) = Marker::begin(&opts.state_dir(), dst, src.name)?;
    Ok(Destination {
        volume,
        path: dst.into(),
        partial: None,
        fresh: false,
        marker: Some(marker),
        resumed,
    })
}

/// A new image file: written under a hidden temp name in the same directory and renamed
/// into place only once complete, so a crash never leaves a file that looks like a copy.
fn create_new(size: u64, dst: &Path) -> Result<Destination> {
    let name = dst
        .file_name()
        .ok_or_else(|| bad(dst, "has no file name".into()))?;
    let parent = match dst.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !parent.is_dir() {
        return Err(bad(
            dst,
            format!(
                "its directory {} does not exist; create it first",
                parent.display()
            ),
        ));
    }
    let partial = parent.join(format!(".{}.mover-partial", name.to_string_lossy()));
    let mut options = OpenOptions::new();
    options.read(true).write(true);
    let (file_existed, mut volume) = match BlockVolume::open_with(&partial, &options) {
        Ok(v) => (true, v),
        Err(chunker::ChunkerError::Open { cause, .. }) if cause.kind() == ErrorKind::NotFound => {
            options.create_new(true);
            (false, BlockVolume::open_with(&partial, &options)?)
        }
        Err(e) => return Err(e.into()),
    };
    if volume.size() != size {
        volume
            .set_len(size)
            .map_err(|e| write_error("sizing", &partial, 0, e))?;
    }
    Ok(Destination {
        volume,
        path: dst.into(),
        partial: Some(partial),
        fresh: !file_existed,
        marker: None,
        resumed: file_existed,
    })
}

/// Refuses a destination that is the source itself, directly or through a loop device.
fn check_not_same(src: &BlockVolume, dst: &Path, dst_meta: &fs::Metadata) -> Result<()> {
    let same = |detail: &str| CopyError::SameVolume {
        src: src.path().into(),
        dst: dst.into(),
        detail: detail.into(),
    };
    let src_meta = src
        .file()
        .metadata()
        .map_err(|e| bad(src.path(), e.to_string()))?;
    let is_blk = |m: &fs::Metadata| m.file_type().is_block_device();
    if is_blk(&src_meta) && is_blk(dst_meta) && src_meta.rdev() == dst_meta.rdev() {
        return Err(same(""));
    }
    if !is_blk(&src_meta)
        && !is_blk(dst_meta)
        && (src_meta.dev(), src_meta.ino()) == (dst_meta.dev(), dst_meta.ino())
    {
        return Err(same(""));
    }
    // A loop device over the other side's image file is the same storage too.
    if is_blk(dst_meta) && loop_backs(dst_meta.rdev(), &src_meta) {
        return Err(same(
            " (the destination loop device is backed by the source file)",
        ));
    }
    if is_blk(&src_meta) && loop_backs(src_meta.rdev(), dst_meta) {
        return Err(same(
            " (the source loop device is backed by the destination file)",
        ));
    }
    Ok(())
}

/// Whether the loop device `rdev` is backed by the file `file`.
fn loop_backs(rdev: u64, file: &fs::Metadata) -> bool {
    let sys = format!(
        "/sys/dev/block/{}:{}/loop/backing_file",
        rustix::fs::major(rdev),
        rustix::fs::minor(rdev)
    );
    let Ok(backing) = fs::read_to_string(sys) else {
        return false;
    };
    let backing = backing.trim_end().trim_end_matches(" (deleted)");
    fs::metadata(backing).is_ok_and(|m| (m.dev(), m.ino()) == (file.dev(), file.ino()))
}

/// Where the block device `rdev` is mounted, if anywhere (from /proc/self/mountinfo).
pub fn mounted_at(rdev: u64) -> Option<String> {
    let want = format!("{}:{}", rustix::fs::major(rdev), rustix::fs::minor(rdev));
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|line| {
        let mut fields = line.split(' ');
        let dev = fields.nth(2)?;
        let mountpoint = fields.nth(1)?;
        (dev == want).then(|| mountpoint.to_string())
    })
}

fn bad(path: &Path, why: String) -> CopyError {
    CopyError::BadDestination {
        path: path.into(),
        why,
    }
}
