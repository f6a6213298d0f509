//! A FUSE file system of one file, `volume`, whose bytes are an [`NbdVolume`]'s: the
//! same volume the NBD server would serve, so a read of a region still to come fetches
//! it first, as over NBD. One thread reads the kernel's requests; each read, write or
//! flush runs as a task on the agent's runtime and answers when it is done, so a fetch
//! holds up only the requests that need it.
//!
//! Every request is idempotent (a read, a write of given bytes at a given offset, a
//! flush, a trim): one sent again after a restart ([`serve`] with `resend`) is simply
//! done again.

use super::fuse_wire::{self as wire, Args, Attr, Out};
use rustix::fd::{AsFd, AsRawFd, OwnedFd};
use std::{io, path::Path, sync::Arc};
use transport::nbd::NbdVolume;

/// The file's name in the mount.
pub const FILE_NAME: &str = "volume";
const ROOT_INO: u64 = 1;
const FILE_INO: u64 = 2;
/// The size never changes while mounted: the kernel may keep attributes (seconds).
const TTL: u64 = 3600;
/// The largest read or write the kernel sends in one request.
const MAX_IO: u32 = 1 << 20;
/// How far the kernel reads ahead of a pod's sequential reads: several requests in
/// flight, as a disk's read-ahead keeps its own (the development VM's virtio disk: 8 MiB).
const READ_AHEAD: u32 = 8 * MAX_IO;
/// A request's header and arguments come before a write's data.
const BUFFER: usize = MAX_IO as usize + 4096;

/// Opens `/dev/fuse` and mounts a file system served through it at `dir`; the
/// returned descriptor is the connection (nothing answers the kernel until [`serve`]).
pub fn mount(dir: &Path, name: &str) -> io::Result<OwnedFd> {
    use rustix::{
        fs::{Mode, OFlags},
        mount::MountFlags,
    };
    let fd = rustix::fs::open("/dev/fuse", OFlags::RDWR | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| io::Error::new(e.kind(), format!("cannot open /dev/fuse: {e}")))?;
    let options = std::ffi::CString::new(format!(
        "fd={},rootmode=40000,user_id=0,group_id=0",
        fd.as_raw_fd()
    ))
    .expect("no NUL in the options");
    rustix::mount::mount(
        format!("mover:{name}").as_str(),
        dir,
        "fuse.mover",
        MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC | MountFlags::NOATIME,
        options.as_c_str(),
    )
    .map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("cannot mount FUSE at {}: {e}", dir.display()),
        )
    })?;
    Ok(fd)
}

/// The file system.
pub struct VolumeFile {
    pub(super) volume: Arc<dyn NbdVolume>,
    pub(super) runtime: tokio::runtime::Handle,
}

/// Serves connection `fd` on a thread of its own until the kernel ends it (the file
/// system is unmounted and its last user gone, or the connection aborted). With
/// `resend`, the connection was served before (by an agent since gone): the kernel is
/// first asked to send again every request that agent read but did not answer.
///
/// The kernel caches the file, with its writeback cache, as it caches a plain file
/// under a loop device: a pod's reads of what was read before and its writes run at
/// memory speed; its writes reach the agent when the kernel writes them back (merged,
/// up to [`MAX_IO`] a request) or at the pod's fsync (the loop device's flush), which is
/// answered once they are durable. That cache cannot go stale: the agent's filler
/// writes only regions not here yet, and the kernel holds a page of such a region only
/// once a read of it was answered (after its fetch), or as the pod's own write, which
/// reaches the agent later and lands over the filler's bytes.
pub fn serve(fd: Arc<OwnedFd>, file: Arc<VolumeFile>, resend: bool) -> io::Result<()> {
    if resend {
        let notify = wire::out_header(0, wire::NOTIFY_RESEND, 0);
        rustix::io::write(&*fd, &notify).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot ask the kernel to send its FUSE requests again: {e}"),
            )
        })?;
    }
    std::thread::Builder::new()
        .name("fuse".into())
        .spawn(move || {
            let mut buf = Vec::with_capacity(BUFFER);
            loop {
                buf.clear();
                match rustix::io::read(&*fd, rustix::buffer::spare_capacity(&mut buf)) {
                    Ok(_) => file.dispatch(&fd, &mut buf),
                    // Interrupted, or a request the kernel withdrew while it was read.
                    Err(rustix::io::Errno::INTR | rustix::io::Errno::NOENT) => {}
                    Err(rustix::io::Errno::AGAIN) => {}
                    // The connection is over: unmounted and released, or aborted.
                    Err(rustix::io::Errno::NODEV) => break,
                    // Never left without a reader while the connection lives: its
                    // pods would wait for ever.
                    Err(e) => {
                        tracing::error!("cannot read FUSE requests, trying again: {e}");
                        std::thread::sleep(std::time::Duration::from_secs(1));
                    }
                }
            }
            tracing::debug!("FUSE connection ended");
        })?;
    Ok(())
}

/// Gives the FUSE file system mounted at `mount` a disk's limits on dirty pages, and
/// a disk's read-ahead ([`READ_AHEAD`]). The kernel holds a FUSE file
/// system's dirty pages to a strict 1% share of the node's dirty memory
/// (`strict_limit`, `max_ratio` 1), as a guard against servers it cannot trust; that
/// held a pod's sequential writes to 0.2x of a loop device over a plain file. The
/// agent is trusted as a disk's driver is: its share then follows how fast it writes
/// back, as a disk's does. FUSE's read-ahead (128 KiB) cut a pod's 1 MiB reads of
/// pages not cached into eight requests in a row, each waiting for the last. Call once
/// the connection is served (the mount's attributes come from it).
pub fn tune_as_a_disk(mount: &Path) -> io::Result<()> {
    let st = rustix::fs::stat(mount)?;
    let bdi = format!(
        "/sys/class/bdi/{}:{}",
        rustix::fs::major(st.st_dev),
        rustix::fs::minor(st.st_dev)
    );
    let read_ahead_kb = (READ_AHEAD / 1024).to_string();
    for (knob, value) in [
        ("strict_limit", "0"),
        ("max_ratio", "100"),
        ("read_ahead_kb", &read_ahead_kb),
    ] {
        std::fs::write(format!("{bdi}/{knob}"), value)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot set {bdi}/{knob}: {e}")))?;
    }
    Ok(())
}

/// Answers request `unique` with `body` (or an errno).
fn reply(fd: &OwnedFd, unique: u64, answer: Result<&[&[u8]], i32>) {
    let (error, parts) = match answer {
        Ok(parts) => (0, parts),
        Err(errno) => (-errno, &[][..]),
    };
    let len = parts.iter().map(|p| p.len()).sum();
    let header = wire::out_header(unique, error, len);
    let mut iov = vec![io::IoSlice::new(&header)];
    iov.extend(parts.iter().map(|p| io::IoSlice::new(p)));
    match rustix::io::writev(fd.as_fd(), &iov) {
        Ok(_) => {}
        // The request was interrupted (and withdrawn) meanwhile.
        Err(rustix::io::Errno::NOENT) => {}
        Err(e) => tracing::warn!("cannot answer a FUSE request: {e}"),
    }
}

fn errno(e: &io::Error) -> i32 {
    // An error without an OS code (a fetch that failed) is EIO.
    e.raw_os_error().unwrap_or(libc::EIO)
}

impl VolumeFile {
    fn attr(&self, ino: u64) -> Option<Attr> {
        match ino {
            ROOT_INO => Some(Attr {
                ino,
                size: 0,
                mode: libc::S_IFDIR | 0o700,
                nlink: 2,
            }),
            FILE_INO => Some(Attr {
                ino,
                size: self.volume.size(),
                mode: libc::S_IFREG
                    | if self.volume.read_only() {
                        0o400
                    } else {
                        0o600
                    },
                nlink: 1,
            }),
            _ => None,
        }
    }

    /// `len` bytes at `offset`, cut at the end of the volume.
    fn within(&self, offset: u64, len: u64) -> u64 {
        self.volume.size().saturating_sub(offset).min(len)
    }

    /// Answers request `buf`: at once, or from a task once its I/O is done. A write
    /// takes `buf` with it (its data is not copied) and leaves an empty one.
    fn dispatch(&self, fd: &Arc<OwnedFd>, buf: &mut Vec<u8>) {
        let Some((h, mut args)) = Args::request(buf) else {
            tracing::error!(len = buf.len(), "a FUSE request shorter than its header");
            return;
        };
        let unique = h.unique;
        if unique & wire::UNIQUE_RESEND != 0 {
            tracing::info!(
                opcode = h.opcode,
                "answering a FUSE request the last agent left unanswered"
            );
        }
        let done = |answer: Result<Out, i32>| match answer {
            Ok(out) => reply(fd, unique, Ok(&[&out.0])),
            Err(e) => reply(fd, unique, Err(e)),
        };
        let ok = || reply(fd, unique, Ok(&[]));
        match h.opcode {
            // No answer is expected to these.
            wire::FORGET | wire::BATCH_FORGET | wire::INTERRUPT => {}
            wire::INIT => {
                let parsed = (|| Some((args.u32()?, args.u32()?, args.u32()?, args.u32()?)))();
                match parsed {
                    Some((wire::MAJOR, minor, readahead, flags)) => {
                        done(Ok(wire::init_out(minor, readahead, flags, MAX_IO)))
                    }
                    _ => done(Err(libc::EPROTO)),
                }
            }
            wire::DESTROY => ok(),
            wire::LOOKUP => {
                let name = args.rest().split(|&b| b == 0).next().unwrap_or_default();
                match (h.nodeid, name) {
                    (ROOT_INO, n) if n == FILE_NAME.as_bytes() => done(Ok(wire::entry_out(
                        &self.attr(FILE_INO).expect("the file's attributes"),
                        TTL,
                    ))),
                    _ => done(Err(libc::ENOENT)),
                }
            }
            wire::GETATTR => done(
                self.attr(h.nodeid)
                    .map(|a| wire::attr_out(&a, TTL))
                    .ok_or(libc::ENOENT),
            ),
            wire::SETATTR => {
                let valid = args.u32().unwrap_or(0);
                let size = (|| {
                    args.skip(4 + 8)?;
                    args.u64()
                })();
                done(match self.attr(h.nodeid) {
                    // A volume's size is the source's: a truncate would tear it.
                    Some(a) if valid & wire::FATTR_SIZE != 0 && size != Some(a.size) => {
                        Err(libc::EPERM)
                    }
                    Some(a) => Ok(wire::attr_out(&a, TTL)),
                    None => Err(libc::ENOENT),
                })
            }
            wire::OPEN => {
                let flags = args.u32().unwrap_or(0) as i32;
                done(if h.nodeid != FILE_INO {
                    Err(libc::EISDIR)
                } else if self.volume.read_only() && flags & libc::O_ACCMODE != libc::O_RDONLY {
                    Err(libc::EROFS)
                } else {
                    // Cached, as a plain file under a loop device is. See `serve`.
                    Ok(wire::open_out(wire::FOPEN_KEEP_CACHE))
                })
            }
            wire::OPENDIR if h.nodeid == ROOT_INO => done(Ok(wire::open_out(0))),
            wire::OPENDIR => done(Err(libc::ENOTDIR)),
            wire::READDIR => {
                let parsed = (|| Some((args.u64()?, args.u64()?, args.u32()?)))();
                let Some((_fh, offset, size)) = parsed else {
                    return done(Err(libc::EINVAL));
                };
                let entries = [
                    (ROOT_INO, libc::DT_DIR, "."),
                    (ROOT_INO, libc::DT_DIR, ".."),
                    (FILE_INO, libc::DT_REG, FILE_NAME),
                ];
                let mut out = Out::default();
                for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize)
                {
                    let entry = wire::dirent(Out::default(), ino, i as u64 + 1, kind as u32, name);
                    if out.0.len() + entry.0.len() > size as usize {
                        break;
                    }
                    out = out.bytes(&entry.0);
                }
                done(Ok(out))
            }
            wire::STATFS => done(Ok(wire::statfs_out(self.volume.size()))),
            // close(2) and friends: durability is fsync's business.
            wire::RELEASE | wire::RELEASEDIR | wire::FLUSH | wire::FSYNCDIR | wire::ACCESS => ok(),
            // No extended attributes. ENOSYS, not ENODATA: the kernel then stops asking.
            // It asked for security.capability before every write (to clear setuid
            // bits), a round trip that held each write up.
            wire::GETXATTR | wire::LISTXATTR => done(Err(libc::ENOSYS)),
            wire::READ => {
                let parsed = (|| Some((args.u64()?, args.u64()?, args.u32()?)))();
                let Some((_fh, offset, size)) = parsed else {
                    return done(Err(libc::EINVAL));
                };
                let len = self.within(offset, size as u64) as u32;
                if len == 0 {
                    return ok();
                }
                let (volume, fd) = (self.volume.clone(), fd.clone());
                self.runtime.spawn(async move {
                    match volume.read(offset, len).await {
                        Ok(data) => reply(&fd, unique, Ok(&[&data])),
                        Err(e) => {
                            tracing::debug!("volume file: read at {offset}: {e}");
                            reply(&fd, unique, Err(errno(&e)))
                        }
                    }
                });
            }
            wire::WRITE => {
                let parsed = (|| {
                    let (_fh, offset, size) = (args.u64()?, args.u64()?, args.u32()?);
                    args.skip(4 + 8 + 4 + 4)?;
                    Some((offset, size))
                })();
                let Some((offset, size)) = parsed else {
                    return done(Err(libc::EINVAL));
                };
                let rest = args.rest();
                if rest.len() < size as usize {
                    return done(Err(libc::EINVAL));
                }
                if self.within(offset, size as u64) < size as u64 {
                    return done(Err(libc::ENOSPC));
                }
                let data =
                    (h.len as usize - rest.len())..(h.len as usize - rest.len() + size as usize);
                let request = std::mem::replace(buf, Vec::with_capacity(BUFFER));
                let data = bytes::Bytes::from(request).slice(data);
                let (volume, fd) = (self.volume.clone(), fd.clone());
                self.runtime.spawn(async move {
                    match volume.write(offset, data, false).await {
                        Ok(()) => {
                            let out = Out::default().u32(size).u32(0);
                            reply(&fd, unique, Ok(&[&out.0]))
                        }
                        Err(e) => {
                            tracing::debug!("volume file: write at {offset}: {e}");
                            reply(&fd, unique, Err(errno(&e)))
                        }
                    }
                });
            }
            // The loop device's flush (a pod's fsync) arrives here.
            wire::FSYNC => {
                let (volume, fd) = (self.volume.clone(), fd.clone());
                self.runtime.spawn(async move {
                    let answer = volume.flush().await.map_err(|e| errno(&e));
                    reply(&fd, unique, answer.map(|()| &[][..]))
                });
            }
            // The loop device's discard and write-zeroes arrive as these.
            wire::FALLOCATE => {
                let parsed = (|| Some((args.u64()?, args.u64()?, args.u64()?, args.u32()?)))();
                let Some((_fh, offset, length, mode)) = parsed else {
                    return done(Err(libc::EINVAL));
                };
                self.fallocate(fd, unique, offset, length, mode as i32);
            }
            _ => done(Err(libc::ENOSYS)),
        }
    }

    fn fallocate(&self, fd: &Arc<OwnedFd>, unique: u64, offset: u64, length: u64, mode: i32) {
        const PUNCH: i32 = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        const ZERO: i32 = libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE;
        let len = self.within(offset, length);
        match mode {
            // Every byte of the volume is there already.
            0 | libc::FALLOC_FL_KEEP_SIZE if len == length => reply(fd, unique, Ok(&[])),
            PUNCH | ZERO | libc::FALLOC_FL_ZERO_RANGE if len == length => {
                let (volume, fd) = (self.volume.clone(), fd.clone());
                self.runtime.spawn(async move {
                    let done = if mode == PUNCH {
                        volume.trim(offset, len, false).await
                    } else {
                        volume.write_zeroes(offset, len, false, false).await
                    };
                    reply(&fd, unique, done.map(|()| &[][..]).map_err(|e| errno(&e)))
                });
            }
            _ if len < length => reply(fd, unique, Err(libc::ENOSPC)),
            _ => reply(fd, unique, Err(libc::EOPNOTSUPP)),
        }
    }
}
