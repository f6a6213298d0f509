//! `mover copy DIR DIR`: every kind of entry and its metadata, reruns that write
//! nothing, deltas that write only what changed, interruption, and refusals.
//!
//! Trees are compared by the manifest of `common::tree`, built without the engine's code.

mod common;

use common::{MIB, ScratchFs, tree::*};
use rustix::fs::{self as rfs, Mode};
use std::{
    ffi::OsStr,
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    process::Command,
};

fn copy(src: &Path, dst: &Path, delete: bool) -> mover::TreeSummary {
    let options = mover::TreeOptions {
        delete,
        ..Default::default()
    };
    let s = mover::copy_tree(src, dst, &options, &()).unwrap();
    assert!(s.is_complete(), "errors: {:?}", s.errors);
    s
}

#[test]
fn copies_every_kind_of_entry_with_its_metadata() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    make_tree(&src, 1);
    let s = copy(&src, &dst, false);
    assert_same_tree(&src, &dst);
    assert_eq!(s.files, 200 + 4, "small files, big, sparse, note, weird");
    assert_eq!(s.hard_links, 2);
    assert_eq!(s.symlinks, 2);
    assert_eq!(s.specials, if is_root() { 3 } else { 2 });
    assert!(!t.path().join(".dst.mover-partial").exists());
    let sparse = fs::metadata(dst.join("sparse.img")).unwrap();
    assert!(
        sparse.blocks() * 512 <= 64 * 1024,
        "holes stay holes: {} bytes allocated",
        sparse.blocks() * 512
    );
}

#[test]
fn rerun_changes_nothing_and_writes_nothing() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    make_tree(&src, 2);
    copy(&src, &dst, true);
    let before = ctimes(&dst);
    std::thread::sleep(std::time::Duration::from_millis(20));
    let s = copy(&src, &dst, true);
    assert_eq!(
        (
            s.bytes_written,
            s.entries_copied,
            s.metadata_updated,
            s.entries_deleted
        ),
        (0, 0, 0, 0)
    );
    assert_eq!(
        ctimes(&dst),
        before,
        "nothing in the destination was touched"
    );
    assert_same_tree(&src, &dst);
}

#[test]
fn delta_after_edits_writes_only_what_changed() {
    // ext4 has no reflinks: the changed large file is copied whole, as rsync does locally
    // (a patch would write as much and read the old copy besides).
    let t = tempfile::tempdir().unwrap();
    let fs = ScratchFs::new("ext4", 512 * MIB);
    let (src, dst) = (t.path().join("src"), fs.path().join("dst"));
    make_tree(&src, 3);
    copy(&src, &dst, true);
    let before = ctimes(&dst);
    // Insert 100 bytes in the middle of the 8 MiB file: CDC re-synchronises after it.
    let big = src.join("docs/big.bin");
    let mut data = fs::read(&big).unwrap();
    data.splice(4 * MIB as usize..4 * MIB as usize, random(9, 100));
    fs::write(&big, &data).unwrap();
    edit_every_kind(&src);

    let s = copy(&src, &dst, true);
    assert_same_tree(&src, &dst);
    assert_eq!(s.files_patched, 0, "no reflinks: nothing is patched");
    assert_eq!(s.bytes_reused, 0);
    // The big file, f3 and new.txt: nothing else is written.
    assert_eq!(s.bytes_written, 8 * MIB + 100 + 6 + 9);
    assert_eq!(s.metadata_updated, 2, "f4 mode and f5 xattr");
    // 20 files in small/07, the dir itself, f6, f8 (a file), empty (a dir).
    assert_eq!(s.entries_deleted, 20 + 1 + 1 + 1 + 1);
    // Entries the edits did not touch keep their ctime: nothing was rewritten.
    let after = ctimes(&dst);
    let untouched = ["small/01/f1.txt", "small/09/f19.txt", "sparse.img", "fifo"];
    for p in untouched {
        let k = p.as_bytes().to_vec();
        assert_eq!(before[&k], after[&k], "{p} was touched");
    }
}

#[test]
fn large_files_are_patched_by_cloning_old_chunks_where_the_filesystem_has_reflinks() {
    let t = tempfile::tempdir().unwrap();
    let fs = ScratchFs::new("xfs", 512 * MIB);
    let (src, dst) = (t.path().join("src"), fs.path().join("dst"));
    fs::create_dir(&src).unwrap();
    let big = src.join("big.bin");
    let mut data = random(21, 64 * MIB as usize);
    fs::write(&big, &data).unwrap();
    copy(&src, &dst, false);
    // Keep the old copy alive, so the space the new one takes shows what it shares.
    let keep = fs.path().join("yesterday.bin");
    fs::hard_link(dst.join("big.bin"), &keep).unwrap();
    // An overwrite in place and a 64 KiB insert (later data moves by whole blocks, as
    // in a database file or a VM image).
    data[10 * MIB as usize..10 * MIB as usize + 4096].copy_from_slice(&random(22, 4096));
    data.splice(40 * MIB as usize..40 * MIB as usize, random(23, 64 << 10));
    fs::write(&big, &data).unwrap();
    let before = fs.used();

    let s = copy(&src, &dst, false);
    let grew = fs.used() - before;
    eprintln!("the patched copy took {grew} bytes beside the old");
    assert_same_tree(&src, &dst);
    assert_eq!(s.files_patched, 1, "XFS clones: the big file is patched");
    assert!(s.bytes_reused >= 56 * MIB, "reused {}", s.bytes_reused);
    assert!(s.bytes_written <= 8 * MIB, "wrote {}", s.bytes_written);
    // A whole copy would take another 64 MiB; the runs of old chunks are shared.
    assert!(
        grew < 12 * MIB,
        "the new copy took {} MiB beside the old",
        grew / MIB
    );
    assert_eq!(fs::read(&keep).unwrap().len(), 64 * MIB as usize);
}

#[test]
fn reading_the_source_leaves_its_access_times_alone() {
    // Access times older than the mtimes: a plain read would update them (relatime).
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    make_tree(&src, 4);
    let old = rfs::Timestamps {
        last_access: rfs::Timespec {
            tv_sec: 1_000_000_000,
            tv_nsec: 0,
        },
        last_modification: rfs::Timespec {
            tv_sec: 0,
            tv_nsec: rfs::UTIME_OMIT,
        },
    };
    let files = ["small/01/f1.txt", "docs/big.bin", "sparse.img"];
    for f in files {
        rfs::utimensat(rfs::CWD, src.join(f), &old, rfs::AtFlags::empty()).unwrap();
    }
    copy(&src, &dst, false);
    for f in files {
        assert_eq!(
            fs::metadata(src.join(f)).unwrap().atime(),
            1_000_000_000,
            "{f} was read with an atime update"
        );
    }
    // (The manifest reads the files: checked after the access times.)
    assert_same_tree(&src, &dst);
}

#[test]
fn extraneous_entries_stay_without_delete_and_go_with_it() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    make_tree(&src, 4);
    copy(&src, &dst, false);
    fs::write(dst.join("mine.txt"), b"keep me").unwrap();
    fs::create_dir(dst.join("docs/my-dir")).unwrap();
    let s = copy(&src, &dst, false);
    assert_eq!(s.entries_deleted, 0);
    assert_eq!(fs::read(dst.join("mine.txt")).unwrap(), b"keep me");
    let s = copy(&src, &dst, true);
    assert_eq!(s.entries_deleted, 2);
    assert_same_tree(&src, &dst);
}

#[test]
fn a_directory_in_the_way_is_replaced_only_with_delete() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("x"), b"file").unwrap();
    fs::create_dir_all(dst.join("x/inner")).unwrap();
    let options = mover::TreeOptions::default();
    let s = mover::copy_tree(&src, &dst, &options, &()).unwrap();
    assert!(!s.is_complete());
    assert!(s.errors[0].contains("--delete"), "{:?}", s.errors);
    assert!(
        dst.join("x/inner").is_dir(),
        "nothing destroyed without --delete"
    );
    copy(&src, &dst, true);
    assert_eq!(fs::read(dst.join("x")).unwrap(), b"file");
}

#[test]
fn interrupted_new_copy_stays_hidden_and_the_rerun_finishes_it() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    make_tree(&src, 5);
    for i in 0..5_000 {
        let dir = src.join(format!("many/{}", i % 50));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join(i.to_string()), i.to_string()).unwrap();
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_mover"))
        .args(["copy", "--tree-threads", "1"])
        .arg(&src)
        .arg(&dst)
        .env("RUST_LOG", "error")
        .spawn()
        .unwrap();
    let partial = t.path().join(".dst.mover-partial");
    let started = std::time::Instant::now();
    while fs::read_dir(partial.join("many")).map_or(0, |d| d.count()) < 5 {
        assert!(started.elapsed().as_secs() < 60, "the copy never started");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    assert!(
        !dst.exists(),
        "a half-made copy is never visible under its name"
    );
    // The rerun finishes the hidden copy, whatever state the kill left it in.
    let s = copy(&src, &dst, false);
    assert!(s.resumed);
    assert!(!partial.exists());
    assert_same_tree(&src, &dst);
}

#[test]
fn paths_longer_than_path_max_are_copied() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    fs::create_dir(&src).unwrap();
    let name = "d".repeat(250);
    // 20 levels of 250-byte names: about 5 KiB, beyond PATH_MAX (4096).
    let mut dir = rfs::open(&src, rfs::OFlags::DIRECTORY, Mode::empty()).unwrap();
    for _ in 0..20 {
        rfs::mkdirat(&dir, name.as_str(), Mode::from_raw_mode(0o755)).unwrap();
        dir = rfs::openat(&dir, name.as_str(), rfs::OFlags::DIRECTORY, Mode::empty()).unwrap();
    }
    let leaf = rfs::openat(
        &dir,
        "leaf",
        rfs::OFlags::CREATE | rfs::OFlags::WRONLY,
        Mode::from_raw_mode(0o640),
    )
    .unwrap();
    rustix::io::write(&leaf, b"deep").unwrap();
    rfs::fsetxattr(&leaf, "user.deep", b"yes", rfs::XattrFlags::empty()).unwrap();
    copy(&src, &dst, false);
    let mut dir = rfs::open(&dst, rfs::OFlags::DIRECTORY, Mode::empty()).unwrap();
    for _ in 0..20 {
        dir = rfs::openat(&dir, name.as_str(), rfs::OFlags::DIRECTORY, Mode::empty()).unwrap();
    }
    let leaf = rfs::openat(&dir, "leaf", rfs::OFlags::RDONLY, Mode::empty()).unwrap();
    let mut buf = [0u8; 16];
    let n = rustix::io::read(&leaf, &mut buf[..]).unwrap();
    assert_eq!(&buf[..n], b"deep");
    let mut value = [0u8; 8];
    let n = rfs::fgetxattr(&leaf, "user.deep", &mut value[..]).unwrap();
    assert_eq!(&value[..n], b"yes");
    assert_eq!(rfs::fstat(&leaf).unwrap().st_mode & 0o7777, 0o640);
}

fn mover_cli(args: &[&OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_mover"))
        .args(args)
        .env("RUST_LOG", "error")
        .output()
        .unwrap()
}

#[test]
fn refusals_say_what_and_write_nothing() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    fs::create_dir_all(src.join("sub")).unwrap();
    fs::write(t.path().join("file"), b"x").unwrap();
    let cases: [(PathBuf, &str); 4] = [
        (t.path().join("file"), "is not a directory"),
        (src.join("sub/copy"), "one tree contains the other"),
        (t.path().join("no/such/parent/dst"), "create it first"),
        (src.clone(), "one tree contains the other"),
    ];
    for (dst, message) in cases {
        let out = mover_cli(&["copy".as_ref(), src.as_os_str(), dst.as_os_str()]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{}: {stderr}", dst.display());
        assert!(stderr.contains(message), "{}: {stderr}", dst.display());
    }
    assert!(!src.join("sub/copy").exists());
    assert_eq!(fs::read(t.path().join("file")).unwrap(), b"x");
}

#[test]
fn a_destination_without_xattr_support_fails_clearly_unless_told_to_drop_them() {
    if !is_root() {
        return common::skip_unless_ci("needs root for a ramfs mount");
    }
    let t = tempfile::tempdir().unwrap();
    let (src, mnt) = (t.path().join("src"), t.path().join("ramfs"));
    fs::create_dir_all(&src).unwrap();
    fs::create_dir_all(&mnt).unwrap();
    fs::write(src.join("tagged"), b"data").unwrap();
    set_xattr(&src.join("tagged"), "user.tag", b"v");
    rustix::mount::mount(
        "none",
        &mnt,
        "ramfs",
        rustix::mount::MountFlags::empty(),
        None,
    )
    .unwrap();
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            _ = rustix::mount::unmount(self.0, rustix::mount::UnmountFlags::DETACH);
        }
    }
    let _unmount = Unmount(&mnt);
    let dst = mnt.join("dst");
    let out = mover_cli(&["copy".as_ref(), src.as_os_str(), dst.as_os_str()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("--no-xattrs"), "{stderr}");
    assert!(!dst.exists(), "an incomplete copy stays hidden");
    let out = mover_cli(&[
        "copy".as_ref(),
        "--no-xattrs".as_ref(),
        src.as_os_str(),
        dst.as_os_str(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(fs::read(dst.join("tagged")).unwrap(), b"data");
}

#[test]
fn verify_reads_contents_back_and_catches_silent_corruption() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    make_tree(&src, 6);
    let options = mover::TreeOptions {
        verify: true,
        ..Default::default()
    };
    let s = mover::copy_tree(&src, &dst, &options, &()).unwrap();
    assert!(s.verified && s.is_complete());
    // Bit rot: same size, same mtime, different bytes. Size + mtime cannot see it.
    let victim = dst.join("small/02/f2.txt");
    let m = fs::metadata(&victim).unwrap();
    let mut bytes = fs::read(&victim).unwrap();
    bytes[0] ^= 0xff;
    fs::write(&victim, &bytes).unwrap();
    set_mtime(&victim, m.mtime(), m.mtime_nsec() as u32);
    let err = mover::copy_tree(&src, &dst, &options, &()).unwrap_err();
    assert!(
        matches!(err, mover::CopyError::TreeVerifyFailed { differing: 1, .. }),
        "{err}"
    );
    // The verify pass repaired it: the next verified copy is clean.
    let s = mover::copy_tree(&src, &dst, &options, &()).unwrap();
    assert!(s.verified);
    assert_same_tree(&src, &dst);
}

#[test]
fn resuming_over_an_entry_of_another_kind_replaces_it() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src"), t.path().join("dst"));
    fs::create_dir_all(&src).unwrap();
    fs::write(src.join("x"), b"a file now").unwrap();
    std::os::unix::fs::symlink("elsewhere", src.join("y")).unwrap();
    // An earlier attempt left a symlink where x goes and a file where y goes.
    let partial = t.path().join(".dst.mover-partial");
    fs::create_dir_all(&partial).unwrap();
    std::os::unix::fs::symlink("stale", partial.join("x")).unwrap();
    fs::write(partial.join("y"), b"stale").unwrap();
    let s = copy(&src, &dst, false);
    assert!(s.resumed);
    assert_same_tree(&src, &dst);
}
