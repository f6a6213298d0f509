//! Tree blobs: one directory of a file-tree snapshot.
//!
//! A tree snapshot's manifest names a top blob holding one node, `.`, the snapshotted
//! directory itself; every directory node names the blob of its entries. A blob is the
//! directory's entries sorted by name, each with everything a faithful copy keeps
//! (kind, mode, owner, times in ns, xattrs and so ACLs, inode and link count for hard
//! links, device numbers, symlink target) and, for a regular file, its content as
//! FastCDC chunks and holes. A blob's id is the keyed hash of its plaintext, so an
//! unchanged directory is the same blob in every snapshot and is stored once.
//!
//! Tree blobs are stored as [`crate::BlobKind::List`] blobs: builds that predate tree
//! snapshots still read the packs that hold them (their manifests, version 2, they
//! refuse by version).
//!
//! Plaintext: `"MVTB" u32le(version 1) u32le(count)` then per node: `u16 name_len, name,
//! u8 kind, u32 mode, u32 uid, u32 gid, i64 mtime_s, u32 mtime_ns, i64 ctime_s,
//! u32 ctime_ns, u64 dev, u64 ino, u64 nlink, u64 size, u64 rdev, u16 xattrs, each
//! (u16 name_len, name, u32 value_len, value)`, then by kind: a directory `id(32)` of its
//! blob, a symlink `u16 len, target`, a file `u32 pieces`, each `0 u64 hole_len` or
//! `1 id(32) u32 len`.

use crate::error::{RepoError, Result};
use crate::pack::u32_at;
use chunker::ChunkId;

const TREE_MAGIC: &[u8; 4] = b"MVTB";
const TREE_VERSION: u32 = 1;
/// Longest name, xattr name or symlink target a blob may hold (Linux allows 255, 255
/// and 4095): anything longer is damage.
const MAX_NAME: usize = 4096;
/// Longest xattr value (Linux allows 64 KiB).
const MAX_XATTR_VALUE: usize = 1 << 16;

/// The kinds of tree entries: of a snapshot's trees, and of the engine's tree copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeKind {
    /// A regular file.
    File = 0,
    /// A directory.
    Dir = 1,
    /// A symbolic link.
    Symlink = 2,
    /// A character device.
    CharDevice = 3,
    /// A block device.
    BlockDevice = 4,
    /// A FIFO.
    Fifo = 5,
    /// A Unix socket.
    Socket = 6,
}

impl NodeKind {
    /// The kind with code `c`.
    pub fn from_code(c: u8) -> Option<NodeKind> {
        use NodeKind::*;
        [File, Dir, Symlink, CharDevice, BlockDevice, Fifo, Socket]
            .get(c as usize)
            .copied()
    }

    /// Its code: in tree blobs, on the wire, in replica records.
    pub fn code(self) -> u8 {
        self as u8
    }

    /// The kind of an `lstat`'s file type (anything else is taken as a file).
    pub fn of(file_type: rustix::fs::FileType) -> NodeKind {
        use rustix::fs::FileType;
        match file_type {
            FileType::Directory => NodeKind::Dir,
            FileType::Symlink => NodeKind::Symlink,
            FileType::CharacterDevice => NodeKind::CharDevice,
            FileType::BlockDevice => NodeKind::BlockDevice,
            FileType::Fifo => NodeKind::Fifo,
            FileType::Socket => NodeKind::Socket,
            _ => NodeKind::File,
        }
    }

    /// The file type to give `mknodat` for it.
    pub fn file_type(self) -> rustix::fs::FileType {
        use rustix::fs::FileType;
        match self {
            NodeKind::CharDevice => FileType::CharacterDevice,
            NodeKind::BlockDevice => FileType::BlockDevice,
            NodeKind::Fifo => FileType::Fifo,
            NodeKind::Socket => FileType::Socket,
            NodeKind::Dir => FileType::Directory,
            NodeKind::Symlink => FileType::Symlink,
            NodeKind::File => FileType::RegularFile,
        }
    }
}

/// One piece of a file's content.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilePiece {
    /// A data chunk of `len` bytes.
    Data {
        /// Its id.
        id: ChunkId,
        /// Its length.
        len: u32,
    },
    /// A hole (not stored; restored as a hole).
    Hole(u64),
}

impl FilePiece {
    /// Bytes of the file it covers.
    pub fn len(&self) -> u64 {
        match self {
            FilePiece::Data { len, .. } => *len as u64,
            FilePiece::Hole(n) => *n,
        }
    }

    /// Whether it covers nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One entry of a directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeNode {
    /// The name (any bytes but `/` and NUL).
    pub name: Vec<u8>,
    /// What it is.
    pub kind: NodeKind,
    /// Permission bits with set-uid, set-gid and sticky.
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Modification time (s, ns).
    pub mtime: (i64, u32),
    /// Change time (s, ns): with the inode, size and mtime, what tells an incremental
    /// snapshot that a file is unchanged. Not restored (it cannot be).
    pub ctime: (i64, u32),
    /// Device of the source filesystem (with `ino`: which names are hard links).
    pub dev: u64,
    /// Inode number in the source.
    pub ino: u64,
    /// Link count in the source.
    pub nlink: u64,
    /// Size in bytes (files: the content's length).
    pub size: u64,
    /// Device number of a device node.
    pub rdev: u64,
    /// Extended attributes (POSIX ACLs included), sorted by name.
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// A symlink's target.
    pub link: Vec<u8>,
    /// A directory's blob.
    pub subtree: Option<ChunkId>,
    /// A file's content.
    pub content: Vec<FilePiece>,
}

impl TreeNode {
    /// A node of `kind` named `name` with everything else zero or empty.
    pub fn new(name: Vec<u8>, kind: NodeKind) -> TreeNode {
        TreeNode {
            name,
            kind,
            mode: 0,
            uid: 0,
            gid: 0,
            mtime: (0, 0),
            ctime: (0, 0),
            dev: 0,
            ino: 0,
            nlink: 1,
            size: 0,
            rdev: 0,
            xattrs: Vec::new(),
            link: Vec::new(),
            subtree: None,
            content: Vec::new(),
        }
    }

    /// Whether what a restore applies besides content (mode, owner, mtime, xattrs,
    /// symlink target, device number) is the same in both.
    pub fn same_metadata(&self, other: &TreeNode) -> bool {
        (self.mode, self.uid, self.gid, self.mtime, self.rdev)
            == (other.mode, other.uid, other.gid, other.mtime, other.rdev)
            && self.xattrs == other.xattrs
            && self.link == other.link
    }

    /// The data chunks of a file's content.
    pub fn chunks(&self) -> impl Iterator<Item = ChunkId> + '_ {
        self.content.iter().filter_map(|p| match p {
            FilePiece::Data { id, .. } => Some(*id),
            FilePiece::Hole(_) => None,
        })
    }
}

/// Encodes a directory's entries (sorted by name, names unique) as a tree blob.
pub fn encode_tree(nodes: &[TreeNode]) -> Vec<u8> {
    let mut out = Vec::with_capacity(12 + nodes.len() * 128);
    out.extend_from_slice(TREE_MAGIC);
    out.extend_from_slice(&TREE_VERSION.to_le_bytes());
    out.extend_from_slice(&(nodes.len() as u32).to_le_bytes());
    for n in nodes {
        debug_assert!(n.name.len() <= MAX_NAME && n.link.len() <= MAX_NAME);
        out.extend_from_slice(&(n.name.len() as u16).to_le_bytes());
        out.extend_from_slice(&n.name);
        out.push(n.kind as u8);
        for v in [n.mode, n.uid, n.gid] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for (s, ns) in [n.mtime, n.ctime] {
            out.extend_from_slice(&s.to_le_bytes());
            out.extend_from_slice(&ns.to_le_bytes());
        }
        for v in [n.dev, n.ino, n.nlink, n.size, n.rdev] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&(n.xattrs.len() as u16).to_le_bytes());
        for (k, v) in &n.xattrs {
            out.extend_from_slice(&(k.len() as u16).to_le_bytes());
            out.extend_from_slice(k);
            out.extend_from_slice(&(v.len() as u32).to_le_bytes());
            out.extend_from_slice(v);
        }
        match n.kind {
            NodeKind::Dir => out.extend_from_slice(&n.subtree.unwrap_or(ChunkId([0; 32])).0),
            NodeKind::Symlink => {
                out.extend_from_slice(&(n.link.len() as u16).to_le_bytes());
                out.extend_from_slice(&n.link);
            }
            NodeKind::File => {
                out.extend_from_slice(&(n.content.len() as u32).to_le_bytes());
                for p in &n.content {
                    match p {
                        FilePiece::Hole(len) => {
                            out.push(0);
                            out.extend_from_slice(&len.to_le_bytes());
                        }
                        FilePiece::Data { id, len } => {
                            out.push(1);
                            out.extend_from_slice(&id.0);
                            out.extend_from_slice(&len.to_le_bytes());
                        }
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// Reads a tree blob's plaintext, refusing anything malformed; every allocation is
/// bounded by the input's length.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
    key: &'a str,
}

impl<'a> Reader<'a> {
    fn corrupt(&self, what: &str) -> RepoError {
        RepoError::Corrupt {
            key: self.key.into(),
            offset: self.at as u64,
            what: what.into(),
        }
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        let s = self
            .b
            .get(self.at..self.at.saturating_add(n))
            .ok_or_else(|| self.corrupt("short tree blob"))?;
        self.at += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.bytes(1)?[0])
    }

    fn u16(&mut self) -> Result<usize> {
        Ok(u16::from_le_bytes(self.bytes(2)?.try_into().expect("2")) as usize)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes(4)?.try_into().expect("4")))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes(8)?.try_into().expect("8")))
    }

    fn time(&mut self) -> Result<(i64, u32)> {
        let s = self.u64()? as i64;
        let ns = self.u32()?;
        if ns >= 1_000_000_000 {
            return Err(self.corrupt("nanoseconds beyond a second"));
        }
        Ok((s, ns))
    }

    fn name(&mut self, max: usize) -> Result<Vec<u8>> {
        let n = self.u16()?;
        if n > max {
            return Err(self.corrupt("name longer than any allowed"));
        }
        Ok(self.bytes(n)?.to_vec())
    }

    fn id(&mut self) -> Result<ChunkId> {
        Ok(ChunkId(self.bytes(32)?.try_into().expect("32 bytes")))
    }

    fn left(&self) -> usize {
        self.b.len() - self.at
    }
}

/// Decodes a tree blob (`key` names it in errors).
pub fn decode_tree(key: &str, b: &[u8]) -> Result<Vec<TreeNode>> {
    let mut r = Reader { b, at: 0, key };
    if r.bytes(4)? != TREE_MAGIC {
        return Err(r.corrupt("not a tree blob"));
    }
    let v = u32_at(b, 4).ok_or_else(|| r.corrupt("short tree blob"))?;
    if v != TREE_VERSION {
        return Err(RepoError::UnsupportedVersion {
            key: key.into(),
            found: v,
            supported: TREE_VERSION,
        });
    }
    r.at = 8;
    let count = r.u32()? as usize;
    // A node takes at least 80 bytes: a bigger count is damage, and must not size an
    // allocation.
    if count > r.left() / 80 {
        return Err(r.corrupt("tree blob count beyond its length"));
    }
    let mut nodes: Vec<TreeNode> = Vec::with_capacity(count);
    for _ in 0..count {
        let name = r.name(MAX_NAME)?;
        if name.is_empty() || name.contains(&b'/') || name.contains(&0) {
            return Err(r.corrupt("bad entry name"));
        }
        if nodes.last().is_some_and(|p| p.name >= name) {
            return Err(r.corrupt("entries out of order"));
        }
        let kind = NodeKind::from_code(r.u8()?).ok_or_else(|| r.corrupt("bad entry kind"))?;
        let mut n = TreeNode::new(name, kind);
        n.mode = r.u32()?;
        n.uid = r.u32()?;
        n.gid = r.u32()?;
        n.mtime = r.time()?;
        n.ctime = r.time()?;
        n.dev = r.u64()?;
        n.ino = r.u64()?;
        n.nlink = r.u64()?;
        n.size = r.u64()?;
        n.rdev = r.u64()?;
        let xattrs = r.u16()?;
        if xattrs > r.left() / 6 {
            return Err(r.corrupt("xattr count beyond the blob's length"));
        }
        n.xattrs.reserve_exact(xattrs);
        for _ in 0..xattrs {
            let k = r.name(MAX_NAME)?;
            let len = r.u32()? as usize;
            if len > MAX_XATTR_VALUE {
                return Err(r.corrupt("xattr value longer than any allowed"));
            }
            n.xattrs.push((k, r.bytes(len)?.to_vec()));
        }
        match kind {
            NodeKind::Dir => n.subtree = Some(r.id()?),
            NodeKind::Symlink => n.link = r.name(MAX_NAME)?,
            NodeKind::File => {
                let pieces = r.u32()? as usize;
                if pieces > r.left() / 9 {
                    return Err(r.corrupt("piece count beyond the blob's length"));
                }
                n.content.reserve_exact(pieces);
                let mut total = 0u64;
                for _ in 0..pieces {
                    let p = match r.u8()? {
                        0 => FilePiece::Hole(r.u64()?),
                        1 => FilePiece::Data {
                            id: r.id()?,
                            len: r.u32()?,
                        },
                        _ => return Err(r.corrupt("bad file piece")),
                    };
                    total = total.saturating_add(p.len());
                    n.content.push(p);
                }
                if total != n.size {
                    return Err(r.corrupt("file content does not add up to its size"));
                }
            }
            _ => {}
        }
        nodes.push(n);
    }
    if r.left() != 0 {
        return Err(r.corrupt("bytes after the last entry"));
    }
    Ok(nodes)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A blob with a node of every kind, xattrs, a sparse file and a non-UTF-8 name.
    pub(crate) fn sample() -> Vec<TreeNode> {
        let mut file = TreeNode::new(b"a\xffb".to_vec(), NodeKind::File);
        file.content = vec![
            FilePiece::Data {
                id: ChunkId([1; 32]),
                len: 100,
            },
            FilePiece::Hole(4096),
            FilePiece::Data {
                id: ChunkId([2; 32]),
                len: 7,
            },
        ];
        file.size = 4203;
        file.xattrs = vec![(b"user.x".to_vec(), b"1".to_vec())];
        file.mtime = (-5, 999_999_999);
        let mut dir = TreeNode::new(b"dir".to_vec(), NodeKind::Dir);
        dir.subtree = Some(ChunkId([3; 32]));
        let mut link = TreeNode::new(b"link".to_vec(), NodeKind::Symlink);
        link.link = b"../x".to_vec();
        let mut dev = TreeNode::new(b"null".to_vec(), NodeKind::CharDevice);
        dev.rdev = 0x103;
        vec![
            file,
            dir,
            link,
            dev,
            TreeNode::new(b"pipe".to_vec(), NodeKind::Fifo),
        ]
    }

    #[test]
    fn tree_round_trip_and_refusals() {
        let nodes = sample();
        let e = encode_tree(&nodes);
        assert_eq!(decode_tree("t", &e).unwrap(), nodes);
        assert!(decode_tree("t", &e[..e.len() - 1]).is_err());
        let mut unsorted = nodes.clone();
        unsorted.swap(0, 1);
        assert!(decode_tree("t", &encode_tree(&unsorted)).is_err());
        let mut wrong_size = nodes.clone();
        wrong_size[0].size += 1;
        assert!(decode_tree("t", &encode_tree(&wrong_size)).is_err());
        let mut newer = e.clone();
        newer[4] = 2;
        assert!(matches!(
            decode_tree("t", &newer),
            Err(RepoError::UnsupportedVersion { found: 2, .. })
        ));
        assert_eq!(decode_tree("t", &encode_tree(&[])).unwrap(), vec![]);
    }
}
