//! What a tree entry is besides its content: kind, mode, owner, times, xattrs (POSIX ACLs
//! are the `system.posix_acl_*` xattrs), and how to read and apply them.

use rustix::fs::{self, AtFlags, FileType, Mode, Timespec, Timestamps};
use std::{
    ffi::{OsStr, OsString},
    io,
    os::{
        fd::{AsFd, AsRawFd, BorrowedFd},
        unix::ffi::OsStrExt,
    },
    path::{Path, PathBuf},
};

/// The kinds of entries a tree holds: the repository's, so a snapshot records them as
/// they are.
pub(crate) use snapshots::NodeKind;

/// One entry's `lstat`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Meta {
    pub kind: NodeKind,
    /// Permission bits with set-uid, set-gid and sticky (07777).
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    /// Bytes allocated (st_blocks × 512): less than `size` means the file has holes.
    pub allocated: u64,
    pub mtime: (i64, u32),
    pub ctime: (i64, u32),
    pub rdev: u64,
    pub dev: u64,
    pub ino: u64,
    pub nlink: u64,
}

impl Meta {
    pub(crate) fn from_stat(st: &fs::Stat) -> Meta {
        Meta {
            kind: NodeKind::of(FileType::from_raw_mode(st.st_mode)),
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            size: st.st_size as u64,
            allocated: st.st_blocks as u64 * 512,
            mtime: (st.st_mtime, st.st_mtime_nsec as u32),
            ctime: (st.st_ctime, st.st_ctime_nsec as u32),
            rdev: st.st_rdev,
            dev: st.st_dev,
            ino: st.st_ino,
            nlink: st.st_nlink,
        }
    }

    /// `lstat` of `name` in the directory `dir`.
    pub(crate) fn at(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<Meta> {
        Ok(Meta::from_stat(&fs::statat(
            dir,
            name,
            AtFlags::SYMLINK_NOFOLLOW,
        )?))
    }

    /// `fstat` of an open file.
    pub(crate) fn of_fd(fd: BorrowedFd<'_>) -> io::Result<Meta> {
        Ok(Meta::from_stat(&fs::fstat(fd)?))
    }

    /// Whether a destination file with this metadata is taken to hold `src`'s content
    /// (same size and mtime; `--checksum` then compares the bytes).
    pub(crate) fn same_size_and_mtime(&self, src: &Meta) -> bool {
        self.size == src.size && self.mtime == src.mtime
    }

    /// Whether a file's content may have changed between two looks at it.
    pub(crate) fn content_changed(&self, later: &Meta) -> bool {
        self.size != later.size || self.mtime != later.mtime || self.ctime != later.ctime
    }
}

/// A directory's entries with their metadata, sorted by name (found by binary search:
/// cheaper than hashing every name of a large tree).
#[derive(Debug, Default)]
pub(crate) struct Entries(Vec<(OsString, Meta)>);

impl Entries {
    pub(crate) fn sorted(mut entries: Vec<(OsString, Meta)>) -> Entries {
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Entries(entries)
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &(OsString, Meta)> {
        self.0.iter()
    }
}

/// An entry's extended attributes, sorted by name.
pub(crate) type Xattrs = Vec<(OsString, Vec<u8>)>;

/// Where xattr calls reach an entry: by path (they have no `*at` form), shortened through
/// the directory's descriptor when the full path would exceed PATH_MAX.
pub(crate) fn xattr_path(dir_path: &Path, dir: BorrowedFd<'_>, name: &OsStr) -> PathBuf {
    let full = dir_path.join(name);
    if full.as_os_str().len() < 4000 {
        full
    } else {
        PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name)
    }
}

/// Reads the xattrs of `name` in `dir` (at `dir_path`) without following a symlink.
///
/// Most entries have none: `listxattrat(2)` (Linux 6.13) answers that with a lookup of
/// one name in an open directory instead of a walk of the whole path, which is most of
/// the cost of an unchanged file. Entries with xattrs, and older kernels, take the path.
pub(crate) fn read_xattrs_at(
    dir: BorrowedFd<'_>,
    dir_path: &Path,
    name: &OsStr,
) -> io::Result<Xattrs> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static HAVE_LISTXATTRAT: AtomicBool = AtomicBool::new(true);
    if HAVE_LISTXATTRAT.load(Ordering::Relaxed) {
        match listxattrat_len(dir, name) {
            Ok(0) => return Ok(Xattrs::new()),
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
                HAVE_LISTXATTRAT.store(false, Ordering::Relaxed)
            }
            Err(e) if e.raw_os_error().is_some_and(|c| c == libc::EOPNOTSUPP) => {
                return Ok(Xattrs::new());
            }
            Err(e) => return Err(e),
        }
    }
    read_xattrs(&xattr_path(dir_path, dir, name))
}

/// The size of the xattr name list of `name` in `dir` (0: no xattrs).
#[allow(unsafe_code)] // A raw syscall libc and rustix do not wrap yet; see SAFETY.
fn listxattrat_len(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<usize> {
    const SYS_LISTXATTRAT: libc::c_long = 465; // the same number on every architecture
    let name = std::ffi::CString::new(name.as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: listxattrat(dfd, path, at_flags, list, size) reads the NUL-terminated `name`
    // and, with a NULL list and size 0, writes no memory: it returns the list's size.
    let ret = unsafe {
        libc::syscall(
            SYS_LISTXATTRAT,
            dir.as_raw_fd(),
            name.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
            std::ptr::null_mut::<libc::c_char>(),
            0usize,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as usize)
    }
}

/// Reads the xattrs of `path` without following a symlink.
pub(crate) fn read_xattrs(path: &Path) -> io::Result<Xattrs> {
    let mut small = [0u8; 4096];
    let mut large = Vec::new();
    let names = match fs::llistxattr(path, &mut small[..]) {
        Ok(len) => &small[..len],
        Err(rustix::io::Errno::RANGE) => {
            large.resize(fs::llistxattr_query(path)?, 0);
            let len = fs::llistxattr(path, &mut large[..])?;
            &large[..len]
        }
        Err(e) if unsupported(e) => &[][..],
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let name = OsStr::from_bytes(name);
        out.push((name.to_os_string(), get_xattr(path, name)?));
    }
    out.sort();
    Ok(out)
}

fn get_xattr(path: &Path, name: &OsStr) -> io::Result<Vec<u8>> {
    let mut buf = [0u8; 1024];
    match fs::lgetxattr(path, name, &mut buf[..]) {
        Ok(len) => Ok(buf[..len].to_vec()),
        Err(rustix::io::Errno::RANGE) => {
            let size = fs::lgetxattr_query(path, name)?;
            let mut big = vec![0u8; size];
            let len = fs::lgetxattr(path, name, &mut big[..])?;
            big.truncate(len);
            Ok(big)
        }
        Err(e) => Err(e.into()),
    }
}

/// A filesystem (or an entry kind, such as a symlink for `user.*`) without xattrs.
fn unsupported(e: rustix::io::Errno) -> bool {
    e == rustix::io::Errno::OPNOTSUPP || e == rustix::io::Errno::NOTSUP
}

/// Makes the xattrs of `path` equal to `want`, given what it has now.
pub(crate) fn apply_xattrs(path: &Path, want: &Xattrs, have: &Xattrs) -> io::Result<()> {
    for (name, value) in want {
        let same = have.iter().any(|(n, v)| n == name && v == value);
        if !same {
            fs::lsetxattr(path, name, value, fs::XattrFlags::empty()).map_err(|e| {
                if unsupported(e) {
                    io::Error::new(
                        io::ErrorKind::Unsupported,
                        format!(
                            "the destination filesystem does not support the extended \
                             attribute {} (copy with --no-xattrs to drop xattrs and ACLs)",
                            name.to_string_lossy()
                        ),
                    )
                } else {
                    e.into()
                }
            })?;
        }
    }
    for (name, _) in have {
        if !want.iter().any(|(n, _)| n == name) {
            fs::lremovexattr(path, name)?;
        }
    }
    Ok(())
}

/// What `apply` should set: ownership only when the process may (root).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Preserve {
    pub owners: bool,
    pub xattrs: bool,
}

/// Gives the entry `name` in `dir` the metadata of `src`, changing only what differs from
/// `have` (None: a new entry, set everything). The order matters: chown clears set-uid
/// bits and file capabilities, so it comes first; times come last.
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply(
    dir: BorrowedFd<'_>,
    dir_path: &Path,
    name: &OsStr,
    src: &Meta,
    src_xattrs: &Xattrs,
    have: Option<(&Meta, &Xattrs)>,
    preserve: Preserve,
) -> io::Result<bool> {
    let mut changed = false;
    let owner_differs = have.is_none_or(|(m, _)| (m.uid, m.gid) != (src.uid, src.gid));
    if preserve.owners && owner_differs {
        fs::chownat(
            dir,
            name,
            Some(fs::Uid::from_raw(src.uid)),
            Some(fs::Gid::from_raw(src.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )?;
        changed = true;
    }
    if preserve.xattrs {
        let empty = Xattrs::new();
        let have_x = have.map_or(&empty, |(_, x)| x);
        if src_xattrs != have_x {
            apply_xattrs(&xattr_path(dir_path, dir, name), src_xattrs, have_x)?;
            changed = true;
        }
    }
    // After chown (clears set-uid) or an ACL change (sets the group bits), mode is redone.
    if src.kind != NodeKind::Symlink && (changed || have.is_none_or(|(m, _)| m.mode != src.mode)) {
        fs::chmodat(dir, name, Mode::from_raw_mode(src.mode), AtFlags::empty())?;
        changed = true;
    }
    if have.is_none_or(|(m, _)| m.mtime != src.mtime) {
        set_mtime(dir, name, src.mtime)?;
        changed = true;
    }
    Ok(changed)
}

/// Gives a file this run just created (open as `file`, reachable for xattr calls at
/// `path`) the metadata of `src`: through the descriptor, so no name is looked up again.
/// Owner and mode are set only where the new file's differ (a file made with its final
/// permissions by the process's own user needs neither: two journaled inode updates
/// per file fewer).
pub(crate) fn apply_new_file(
    file: &std::fs::File,
    path: &Path,
    src: &Meta,
    src_xattrs: &Xattrs,
    preserve: Preserve,
) -> io::Result<()> {
    let made = Meta::of_fd(file.as_fd())?;
    let mut redo_mode = made.mode != src.mode;
    if preserve.owners && (made.uid, made.gid) != (src.uid, src.gid) {
        fs::fchown(
            file,
            Some(fs::Uid::from_raw(src.uid)),
            Some(fs::Gid::from_raw(src.gid)),
        )?;
        redo_mode = true;
    }
    if preserve.xattrs && !src_xattrs.is_empty() {
        apply_xattrs(path, src_xattrs, &Xattrs::new())?;
        redo_mode = true;
    }
    // After chown (clears set-uid) or an ACL (sets the group bits), mode is redone.
    if redo_mode {
        fs::fchmod(file, Mode::from_raw_mode(src.mode))?;
    }
    fs::futimens(file, &mtime_only(src.mtime))?;
    Ok(())
}

fn mtime_only(mtime: (i64, u32)) -> Timestamps {
    Timestamps {
        last_access: Timespec {
            tv_sec: 0,
            tv_nsec: fs::UTIME_OMIT,
        },
        last_modification: Timespec {
            tv_sec: mtime.0,
            tv_nsec: mtime.1 as _,
        },
    }
}

/// Sets the modification time of `name` (not following a symlink); atime is left alone.
pub(crate) fn set_mtime(dir: BorrowedFd<'_>, name: &OsStr, mtime: (i64, u32)) -> io::Result<()> {
    fs::utimensat(dir, name, &mtime_only(mtime), AtFlags::SYMLINK_NOFOLLOW)?;
    Ok(())
}

/// Whether this process can give files away (chown to any uid/gid).
pub(crate) fn can_chown() -> bool {
    rustix::process::geteuid().is_root()
}

/// Opens a directory entry without following symlinks.
pub(crate) fn open_dir_at(dir: impl AsFd, name: &OsStr) -> io::Result<std::os::fd::OwnedFd> {
    Ok(fs::openat(
        dir,
        name,
        fs::OFlags::RDONLY | fs::OFlags::DIRECTORY | fs::OFlags::NOFOLLOW | fs::OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}

/// Bytes of directory entries read per getdents call: about a thousand names.
const LIST_BUFFER: usize = 32 << 10;

/// Lists a directory's entries with their `lstat`, skipping entries that vanish meanwhile.
///
/// Entries are stat'ed in inode order, not readdir's hash order: on a cold cache that
/// reads the inode table in one pass instead of seeking across it for every entry.
pub(crate) fn list(dir: BorrowedFd<'_>) -> io::Result<Vec<(OsString, Meta)>> {
    // getdents on `dir` itself, from its start: `fs::Dir` would open "." again, three
    // more syscalls a directory (fcntl, openat, close); a rerun of the real tree bench
    // made 264k calls this way against 302k.
    fs::seek(dir, fs::SeekFrom::Start(0))?;
    let mut buf = Vec::with_capacity(LIST_BUFFER);
    let mut entries = fs::RawDir::new(dir, buf.spare_capacity_mut());
    let mut names = Vec::new();
    while let Some(entry) = entries.next() {
        let entry = entry?;
        let name = OsStr::from_bytes(entry.file_name().to_bytes());
        if name != "." && name != ".." {
            names.push((entry.ino(), name.to_os_string()));
        }
    }
    names.sort_unstable();
    let mut out = Vec::with_capacity(names.len());
    for (_, name) in names {
        match Meta::at(dir, &name) {
            Ok(meta) => out.push((name, meta)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    Ok(out)
}

/// Opens the regular file `name` in `dir` for reading, never through a symlink.
pub(crate) fn open_file(dir: BorrowedFd<'_>, name: &OsStr) -> io::Result<std::fs::File> {
    Ok(fs::openat(
        dir,
        name,
        fs::OFlags::RDONLY | fs::OFlags::NOFOLLOW | fs::OFlags::CLOEXEC,
        Mode::empty(),
    )?
    .into())
}
