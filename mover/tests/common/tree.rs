//! File trees for the tests: a tree with every kind of entry, and a manifest to compare
//! trees by, built on its own (std + raw xattr calls), not by the engine's code: (path,
//! type, mode, uid, gid, mtime, size, xattrs, symlink target, device number, hard-link
//! group, content hash).

use super::MIB;
use rand::{RngCore, SeedableRng, rngs::StdRng};
use rustix::fs::{self as rfs, AtFlags, Mode};
use std::{
    collections::{BTreeMap, HashMap},
    ffi::{OsStr, OsString},
    fs,
    os::unix::{
        ffi::OsStrExt,
        fs::{MetadataExt, PermissionsExt},
    },
    path::Path,
};

pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

pub fn random(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

pub fn set_mtime(path: &Path, secs: i64, nanos: u32) {
    let times = rfs::Timestamps {
        last_access: rfs::Timespec {
            tv_sec: secs,
            tv_nsec: 0,
        },
        last_modification: rfs::Timespec {
            tv_sec: secs,
            tv_nsec: nanos as _,
        },
    };
    rfs::utimensat(rfs::CWD, path, &times, AtFlags::SYMLINK_NOFOLLOW).unwrap();
}

pub fn set_xattr(path: &Path, name: &str, value: &[u8]) {
    rfs::lsetxattr(path, name, value, rfs::XattrFlags::empty()).unwrap();
}

/// A POSIX access ACL in the kernel's xattr format: owner rw, user 1234 r, group r,
/// mask r, other none.
pub fn acl() -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in [
        (0x01u16, 6u16, u32::MAX),
        (0x02, 4, 1234),
        (0x04, 4, u32::MAX),
        (0x10, 4, u32::MAX),
        (0x20, 0, u32::MAX),
    ] {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

/// Builds a tree with every kind of entry mover copies.
pub fn make_tree(root: &Path, seed: u64) {
    fs::create_dir_all(root.join("docs/deep/er")).unwrap();
    fs::create_dir_all(root.join("empty")).unwrap();
    for i in 0..200u64 {
        let dir = root.join(format!("small/{:02}", i % 10));
        fs::create_dir_all(&dir).unwrap();
        fs::write(
            dir.join(format!("f{i}.txt")),
            random(seed + i, (i * 37 % 5000) as usize),
        )
        .unwrap();
    }
    fs::write(root.join("docs/big.bin"), random(seed, 8 * MIB as usize)).unwrap();
    // Sparse: 4 KiB of data at 3 MiB in a 16 MiB file.
    let sparse = fs::File::create(root.join("sparse.img")).unwrap();
    sparse.set_len(16 * MIB).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&sparse, &random(seed + 1, 4096), 3 * MIB).unwrap();
    fs::write(root.join("docs/deep/er/note"), b"hello").unwrap();
    fs::hard_link(root.join("docs/deep/er/note"), root.join("note-link")).unwrap();
    fs::hard_link(
        root.join("docs/deep/er/note"),
        root.join("small/00/note-too"),
    )
    .unwrap();
    std::os::unix::fs::symlink("../docs/big.bin", root.join("empty/../docs/rel-link")).unwrap();
    std::os::unix::fs::symlink("/nowhere/at/all", root.join("dangling")).unwrap();
    rfs::mknodat(
        rfs::CWD,
        root.join("fifo"),
        rfs::FileType::Fifo,
        Mode::from_raw_mode(0o640),
        0,
    )
    .unwrap();
    let _socket = std::os::unix::net::UnixListener::bind(root.join("socket")).unwrap();
    if is_root() {
        rfs::mknodat(
            rfs::CWD,
            root.join("null-dev"),
            rfs::FileType::CharacterDevice,
            Mode::from_raw_mode(0o666),
            rfs::makedev(1, 3),
        )
        .unwrap();
        std::os::unix::fs::chown(root.join("docs"), Some(1234), Some(5678)).unwrap();
        std::os::unix::fs::lchown(root.join("dangling"), Some(42), Some(43)).unwrap();
    }
    let weird = root.join(OsStr::from_bytes(b"caf\xe9 \n name"));
    fs::write(&weird, b"not utf-8").unwrap();
    fs::set_permissions(&weird, fs::Permissions::from_mode(0o4751)).unwrap();
    set_xattr(&root.join("docs/big.bin"), "user.origin", b"camera 7");
    set_xattr(&root.join("docs"), "user.project", b"");
    set_xattr(
        &root.join("docs/deep/er/note"),
        "user.k",
        &random(seed, 3000),
    );
    set_xattr(
        &root.join("docs/big.bin"),
        "system.posix_acl_access",
        &acl(),
    );
    fs::set_permissions(root.join("empty"), fs::Permissions::from_mode(0o1777)).unwrap();
    set_mtime(&root.join("dangling"), 1_000_000_000, 5);
    set_mtime(&root.join("docs/deep"), 1_234_567_890, 123_456_789);
    set_mtime(&root.join("docs/big.bin"), 1_600_000_000, 999_999_999);
}

/// Edits a tree from `make_tree` in every way a delta must carry: f3's content (6
/// bytes), f4's mode, f5's xattrs, f6 deleted, small/07 (20 files) deleted, docs/new.txt
/// added (9 bytes), the file small/08/f8.txt replaced by a directory and the directory
/// `empty` by a symlink.
pub fn edit_every_kind(src: &Path) {
    fs::write(src.join("small/03/f3.txt"), b"edited").unwrap();
    fs::set_permissions(
        src.join("small/04/f4.txt"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    set_xattr(&src.join("small/05/f5.txt"), "user.tag", b"new");
    fs::remove_file(src.join("small/06/f6.txt")).unwrap();
    fs::remove_dir_all(src.join("small/07")).unwrap();
    fs::write(src.join("docs/new.txt"), b"brand new").unwrap();
    fs::remove_file(src.join("small/08/f8.txt")).unwrap();
    fs::create_dir(src.join("small/08/f8.txt")).unwrap();
    fs::remove_dir(src.join("empty")).unwrap();
    std::os::unix::fs::symlink("docs", src.join("empty")).unwrap();
}

/// (path → description) of everything under `root`, the root's own metadata included.
pub fn manifest(root: &Path) -> BTreeMap<Vec<u8>, String> {
    let mut links: HashMap<u64, Vec<Vec<u8>>> = HashMap::new();
    let mut entries = Vec::new();
    walk(root, root, &mut entries);
    for (rel, m) in &entries {
        if !m.is_dir() && m.nlink() > 1 {
            links.entry(m.ino()).or_default().push(rel.clone());
        }
    }
    let mut out = BTreeMap::new();
    for (rel, m) in entries {
        let path = root.join(OsStr::from_bytes(&rel));
        let ft = m.file_type();
        let mut line = format!(
            "type={:o} mode={:o} uid={} gid={} size={} xattrs={}",
            m.mode() & 0o170000,
            m.mode() & 0o7777,
            m.uid(),
            m.gid(),
            if ft.is_dir() { 0 } else { m.size() },
            // Names and a digest of the values: readable when a test fails.
            xattrs(&path)
                .iter()
                .map(|(n, v)| format!("{}:{}", n.to_string_lossy(), blake3::hash(v)))
                .collect::<Vec<_>>()
                .join(","),
        );
        // A directory's mtime is compared except at the root (the copy sets it last).
        line += &format!(" mtime={}.{}", m.mtime(), m.mtime_nsec());
        if ft.is_symlink() {
            line += &format!(" target={:?}", fs::read_link(&path).unwrap());
        } else if ft.is_file() {
            line += &format!(" blake3={}", blake3::hash(&fs::read(&path).unwrap()));
        } else if !ft.is_dir() {
            line += &format!(" rdev={}", m.rdev());
        }
        if let Some(group) = links.get(&m.ino()).filter(|_| !ft.is_dir()) {
            let mut group = group.clone();
            group.sort();
            let group: Vec<_> = group.iter().map(|p| String::from_utf8_lossy(p)).collect();
            line += &format!(" links={group:?}");
        }
        out.insert(rel, line);
    }
    out
}

pub fn walk(root: &Path, dir: &Path, out: &mut Vec<(Vec<u8>, fs::Metadata)>) {
    let rel = dir
        .strip_prefix(root)
        .unwrap()
        .as_os_str()
        .as_bytes()
        .to_vec();
    out.push((rel, fs::symlink_metadata(dir).unwrap()));
    for e in fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let m = fs::symlink_metadata(e.path()).unwrap();
        if m.is_dir() {
            walk(root, &e.path(), out);
        } else {
            let rel = e
                .path()
                .strip_prefix(root)
                .unwrap()
                .as_os_str()
                .as_bytes()
                .to_vec();
            out.push((rel, m));
        }
    }
}

pub fn xattrs(path: &Path) -> Vec<(OsString, Vec<u8>)> {
    let mut names = vec![0u8; 65536];
    let n = rfs::llistxattr(path, &mut names[..]).unwrap_or(0);
    let mut out: Vec<_> = names[..n]
        .split(|b| *b == 0)
        .filter(|n| !n.is_empty())
        .map(|name| {
            let mut value = vec![0u8; 65536];
            let len = rfs::lgetxattr(path, OsStr::from_bytes(name), &mut value[..]).unwrap();
            value.truncate(len);
            (OsStr::from_bytes(name).to_os_string(), value)
        })
        .collect();
    out.sort();
    out
}

/// ctime of every entry: any write, chmod, chown or xattr change moves it.
pub fn ctimes(root: &Path) -> BTreeMap<Vec<u8>, (i64, i64)> {
    let mut entries = Vec::new();
    walk(root, root, &mut entries);
    entries
        .into_iter()
        .map(|(rel, m)| (rel, (m.ctime(), m.ctime_nsec())))
        .collect()
}

pub fn assert_same_tree(src: &Path, dst: &Path) {
    let (a, b) = (manifest(src), manifest(dst));
    for (path, line) in &a {
        assert_eq!(
            Some(line),
            b.get(path),
            "entry {:?} differs",
            String::from_utf8_lossy(path)
        );
    }
    assert_eq!(a.len(), b.len(), "the destination has extra entries");
}
