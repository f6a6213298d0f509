//! The bytes of the FUSE protocol (`<linux/fuse.h>`) that a file system of one file
//! needs: a request's header and arguments in, a reply out. Host byte order, as the
//! kernel's; every layout below is the kernel's struct, field for field.
//!
//! mover speaks it itself rather than through a library so that a connection can be
//! served by a process other than the one that mounted it: an agent started again takes
//! the `/dev/fuse` descriptor its predecessor left in the fd store, asks the kernel to
//! send again what was read but never answered (`FUSE_NOTIFY_RESEND`), and goes on.

/// The protocol's major version; minor versions add to it compatibly.
pub const MAJOR: u32 = 7;
/// The highest minor version these layouts follow (the kernel's may be higher; the
/// lower of the two is the connection's).
pub const MINOR: u32 = 36;
/// Bit 63 of `unique` marks a request the kernel sends again after
/// `FUSE_NOTIFY_RESEND`; the reply carries the same `unique`.
pub const UNIQUE_RESEND: u64 = 1 << 63;

pub const LOOKUP: u32 = 1;
pub const FORGET: u32 = 2;
pub const GETATTR: u32 = 3;
pub const SETATTR: u32 = 4;
pub const OPEN: u32 = 14;
pub const READ: u32 = 15;
pub const WRITE: u32 = 16;
pub const STATFS: u32 = 17;
pub const RELEASE: u32 = 18;
pub const FSYNC: u32 = 20;
pub const GETXATTR: u32 = 22;
pub const LISTXATTR: u32 = 23;
pub const FLUSH: u32 = 25;
pub const INIT: u32 = 26;
pub const OPENDIR: u32 = 27;
pub const READDIR: u32 = 28;
pub const RELEASEDIR: u32 = 29;
pub const FSYNCDIR: u32 = 30;
pub const ACCESS: u32 = 34;
pub const INTERRUPT: u32 = 36;
pub const DESTROY: u32 = 38;
pub const BATCH_FORGET: u32 = 42;
pub const FALLOCATE: u32 = 43;

/// `fuse_init_in.flags` / `fuse_init_out.flags` bits this file system asks for.
pub const ASYNC_READ: u32 = 1 << 0;
pub const BIG_WRITES: u32 = 1 << 5;
pub const WRITEBACK_CACHE: u32 = 1 << 16;
pub const MAX_PAGES: u32 = 1 << 22;
/// `fuse_open_out.open_flags`: the file's page cache outlives an open.
pub const FOPEN_KEEP_CACHE: u32 = 1 << 1;
/// `fuse_setattr_in.valid`: the size is to change.
pub const FATTR_SIZE: u32 = 1 << 3;
/// The notification that puts every request read but not answered back in the queue.
pub const NOTIFY_RESEND: i32 = 7;

pub const IN_HEADER: usize = 40;
pub const OUT_HEADER: usize = 16;

/// `fuse_in_header`, with the bytes of the request's arguments after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InHeader {
    pub len: u32,
    pub opcode: u32,
    pub unique: u64,
    pub nodeid: u64,
}

/// Reads a request's fixed-size fields in order.
pub struct Args<'a>(&'a [u8]);

impl<'a> Args<'a> {
    /// The request's header and what follows it; `None` if `buf` is shorter than the
    /// header says (the kernel never sends that; a bug would).
    pub fn request(buf: &'a [u8]) -> Option<(InHeader, Args<'a>)> {
        let mut a = Args(buf);
        let h = InHeader {
            len: a.u32()?,
            opcode: a.u32()?,
            unique: a.u64()?,
            nodeid: a.u64()?,
        };
        if (h.len as usize) < IN_HEADER || buf.len() < h.len as usize {
            return None;
        }
        Some((h, Args(&buf[IN_HEADER..h.len as usize])))
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = (self.0.get(..n)?, &self.0[n..]);
        self.0 = rest;
        Some(head)
    }

    pub fn u32(&mut self) -> Option<u32> {
        Some(u32::from_ne_bytes(self.take(4)?.try_into().ok()?))
    }

    pub fn u64(&mut self) -> Option<u64> {
        Some(u64::from_ne_bytes(self.take(8)?.try_into().ok()?))
    }

    pub fn skip(&mut self, n: usize) -> Option<()> {
        self.take(n).map(|_| ())
    }

    /// What is left (a write's data, a lookup's name).
    pub fn rest(self) -> &'a [u8] {
        self.0
    }
}

/// A reply's body, built field by field in the kernel's layout.
#[derive(Default)]
pub struct Out(pub Vec<u8>);

impl Out {
    pub fn u16(mut self, v: u16) -> Out {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }

    pub fn u32(mut self, v: u32) -> Out {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }

    pub fn u64(mut self, v: u64) -> Out {
        self.0.extend_from_slice(&v.to_ne_bytes());
        self
    }

    pub fn zeros(mut self, n: usize) -> Out {
        self.0.resize(self.0.len() + n, 0);
        self
    }

    pub fn bytes(mut self, b: &[u8]) -> Out {
        self.0.extend_from_slice(b);
        self
    }
}

/// `fuse_out_header` for a reply of `body_len` bytes to `unique` (`error` is 0 or a
/// negated errno).
pub fn out_header(unique: u64, error: i32, body_len: usize) -> [u8; OUT_HEADER] {
    let mut h = [0u8; OUT_HEADER];
    h[..4].copy_from_slice(&((OUT_HEADER + body_len) as u32).to_ne_bytes());
    h[4..8].copy_from_slice(&error.to_ne_bytes());
    h[8..].copy_from_slice(&unique.to_ne_bytes());
    h
}

/// The attributes of one inode (`fuse_attr`).
#[derive(Debug, Clone, Copy)]
pub struct Attr {
    pub ino: u64,
    pub size: u64,
    /// File type and permission bits (`S_IFREG | 0o600`).
    pub mode: u32,
    pub nlink: u32,
}

impl Attr {
    fn write(&self, out: Out) -> Out {
        out.u64(self.ino)
            .u64(self.size)
            .u64(self.size.div_ceil(512))
            .zeros(3 * 8 + 3 * 4) // atime, mtime, ctime and their nanoseconds: the epoch
            .u32(self.mode)
            .u32(self.nlink)
            .u32(0) // uid
            .u32(0) // gid
            .u32(0) // rdev
            .u32(4096) // blksize
            .u32(0) // flags
    }
}

/// `fuse_entry_out`: `attr` named, both valid for `ttl_secs`.
pub fn entry_out(attr: &Attr, ttl_secs: u64) -> Out {
    let out = Out::default()
        .u64(attr.ino)
        .u64(0) // generation
        .u64(ttl_secs)
        .u64(ttl_secs)
        .u32(0)
        .u32(0);
    attr.write(out)
}

/// `fuse_attr_out`.
pub fn attr_out(attr: &Attr, ttl_secs: u64) -> Out {
    attr.write(Out::default().u64(ttl_secs).u32(0).u32(0))
}

/// `fuse_open_out`.
pub fn open_out(open_flags: u32) -> Out {
    Out::default().u64(0).u32(open_flags).u32(0)
}

/// One `fuse_dirent`, padded to 8 bytes.
pub fn dirent(out: Out, ino: u64, next_offset: u64, kind: u32, name: &str) -> Out {
    let out = out
        .u64(ino)
        .u64(next_offset)
        .u32(name.len() as u32)
        .u32(kind)
        .bytes(name.as_bytes());
    let pad = (8 - name.len() % 8) % 8;
    out.zeros(pad)
}

/// `fuse_init_out`, the answer to the kernel's `fuse_init_in` (`minor`, `max_readahead`,
/// `flags` as the kernel sent them): what both sides support, with writes of up to
/// `max_write` bytes.
pub fn init_out(kernel_minor: u32, max_readahead: u32, kernel_flags: u32, max_write: u32) -> Out {
    let wanted = ASYNC_READ | BIG_WRITES | MAX_PAGES | WRITEBACK_CACHE;
    Out::default()
        .u32(MAJOR)
        .u32(kernel_minor.min(MINOR))
        .u32(max_readahead.min(max_write))
        .u32(kernel_flags & wanted)
        .u16(16) // max_background, as libfuse's default
        .u16(12) // congestion_threshold
        .u32(max_write)
        .u32(1) // time_gran
        .u16((max_write / 4096) as u16) // max_pages
        .u16(0) // map_alignment
        .u32(0) // flags2
        .u32(0) // max_stack_depth
        .zeros(2 + 11 * 2) // request_timeout, unused
}

/// `fuse_kstatfs` of a file system of one file of `size` bytes.
pub fn statfs_out(size: u64) -> Out {
    let blocks = size.div_ceil(4096);
    Out::default()
        .u64(blocks)
        .u64(0)
        .u64(0)
        .u64(2)
        .u64(0)
        .u32(4096) // bsize
        .u32(255) // namelen
        .u32(4096) // frsize
        .zeros(4 + 6 * 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reply_structs_are_the_kernels_sizes() {
        let attr = Attr {
            ino: 2,
            size: 1 << 20,
            mode: libc::S_IFREG | 0o600,
            nlink: 1,
        };
        // sizeof(struct fuse_*) in <linux/fuse.h>.
        assert_eq!(entry_out(&attr, 1).0.len(), 128);
        assert_eq!(attr_out(&attr, 1).0.len(), 104);
        assert_eq!(open_out(0).0.len(), 16);
        assert_eq!(init_out(44, 1 << 20, u32::MAX, 1 << 20).0.len(), 64);
        assert_eq!(statfs_out(1 << 20).0.len(), 80);
        assert_eq!(dirent(Out::default(), 2, 1, 8, "volume").0.len(), 24 + 8);
    }

    #[test]
    fn a_request_is_cut_at_the_length_its_header_gives() {
        let mut buf = Out::default()
            .u32(IN_HEADER as u32 + 8)
            .u32(READ)
            .u64(7 | UNIQUE_RESEND)
            .u64(2)
            .zeros(16) // uid, gid, pid, total_extlen, padding
            .u64(4096)
            .0;
        buf.extend_from_slice(b"trailing bytes of a longer buffer");
        let (h, mut args) = Args::request(&buf).unwrap();
        assert_eq!((h.opcode, h.unique, h.nodeid), (READ, 7 | UNIQUE_RESEND, 2));
        assert_eq!(args.u64(), Some(4096));
        assert_eq!(args.u32(), None, "read past the request's own length");
        // A header that claims more than was read is refused.
        assert!(Args::request(&buf[..IN_HEADER]).is_none());
    }

    #[test]
    fn init_offers_only_what_the_kernel_has() {
        let out = init_out(44, 128 << 10, ASYNC_READ, 1 << 20).0;
        let word = |i: usize| u32::from_ne_bytes(out[i * 4..i * 4 + 4].try_into().unwrap());
        assert_eq!(word(0), MAJOR);
        assert_eq!(word(1), MINOR, "the lower minor of the two");
        assert_eq!(
            word(2),
            128 << 10,
            "the kernel's readahead is kept when lower"
        );
        assert_eq!(
            word(3),
            ASYNC_READ,
            "flags the kernel did not offer are not taken"
        );
        assert_eq!(word(5), 1 << 20, "max_write");
    }
}
