//! `mover copy` with real block devices (loop devices): needs root, as CI has.

mod common;

use common::*;

#[test]
fn image_to_loop_device_and_back_is_identical_and_keeps_holes() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.img");
    make_image(&src, 32 * MIB, 20, &[(MIB, 4 * MIB), (30 * MIB, 8192)]);
    // The destination device sits on a sparse file full of old garbage.
    let backing = t.path().join("dev.img");
    make_image(&backing, 32 * MIB, 21, &[(0, 32 * MIB)]);
    let dev = LoopDevice::attach(&backing);

    let j = json_of(&mover(
        t.path(),
        &[
            "copy",
            src.to_str().unwrap(),
            dev.as_str(),
            "--json",
            "--verify",
        ],
    ));
    assert_eq!(blake3_of(&src, 32 * MIB), blake3_of(&dev.path, 32 * MIB));
    assert_eq!(j["verified"], true);
    // Old garbage where the source has holes is punched through the loop device.
    assert!(j["bytes_zeroed"].as_u64().unwrap() >= 27 * MIB);
    assert!(
        allocated(&backing) <= 6 * MIB,
        "holes reached the backing file: {}",
        allocated(&backing)
    );

    // Device to a new image: block devices report no holes, zero detection finds them.
    let back = t.path().join("back.img");
    let j = json_of(&mover(
        t.path(),
        &["copy", dev.as_str(), back.to_str().unwrap(), "--json"],
    ));
    assert_eq!(blake3_of(&src, 32 * MIB), blake3_of(&back, 32 * MIB));
    assert_eq!(j["bytes_written"], 4 * MIB + 8192);
    // The loop device's holes are learned from its backing file: they are not read.
    assert_eq!(
        j["source_bytes_read"],
        5 * MIB,
        "only the chunks holding data are read"
    );
    assert!(allocated(&back) <= 5 * MIB);
}

#[test]
fn loop_to_loop_delta_writes_only_changed_pages() {
    let t = tempfile::tempdir().unwrap();
    let today = t.path().join("today.img");
    let yesterday = t.path().join("yesterday.img");
    make_image(&today, 64 * MIB, 22, &[(0, 48 * MIB)]);
    std::fs::copy(&today, &yesterday).unwrap();
    let changed = scribble_pages(&today, 23, 1000, 0..48 * MIB);
    let (a, b) = (LoopDevice::attach(&today), LoopDevice::attach(&yesterday));
    let j = json_of(&mover(
        t.path(),
        &["copy", a.as_str(), b.as_str(), "--json", "--verify"],
    ));
    assert_eq!(blake3_of(&a.path, 64 * MIB), blake3_of(&b.path, 64 * MIB));
    assert_eq!(
        j["bytes_written"],
        changed * PAGE,
        "exactly the changed pages"
    );
    assert_eq!(j["bytes_zeroed"], 0);
}

#[test]
fn refuses_mounted_same_and_small_devices() {
    let t = tempfile::tempdir().unwrap();
    let state = t.path().join("state");
    let src = t.path().join("src.img");
    make_image(&src, 64 * MIB, 24, &[(0, 8 * MIB)]);
    let s = src.to_str().unwrap();
    let src_hash = blake3_of(&src, 64 * MIB);
    let refused = |args: &[&str], expect: &str| {
        let out = mover(&state, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(expect), "{args:?}: wanted {expect:?} in {err}");
    };

    // A mounted filesystem's device.
    let fs_img = t.path().join("fs.img");
    make_image(&fs_img, 64 * MIB, 25, &[]);
    assert!(
        std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(&fs_img)
            .status()
            .unwrap()
            .success()
    );
    let fs_dev = LoopDevice::attach(&fs_img);
    {
        let _mounted = Mount::new(&fs_dev.path, &t.path().join("mnt"));
        refused(&["copy", s, fs_dev.as_str()], "mounted at");
    }

    // A loop device over the source file itself, in both directions.
    let over_src = LoopDevice::attach(&src);
    refused(&["copy", s, over_src.as_str()], "backed by the source file");
    refused(
        &["copy", over_src.as_str(), s],
        "backed by the destination file",
    );
    refused(
        &["copy", over_src.as_str(), over_src.as_str()],
        "same volume",
    );

    // A device smaller than the source.
    let small = t.path().join("small.img");
    make_image(&small, 16 * MIB, 26, &[(0, 16 * MIB)]);
    let small_dev = LoopDevice::attach(&small);
    let before = blake3_of(&small, 16 * MIB);
    refused(&["copy", s, small_dev.as_str()], "smaller than the source");
    assert_eq!(blake3_of(&small, 16 * MIB), before);
    assert_eq!(
        blake3_of(&src, 64 * MIB),
        src_hash,
        "the source is never written"
    );
}

#[test]
fn larger_destination_device_gets_an_exact_prefix() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.img");
    make_image(&src, 16 * MIB, 27, &[(0, 16 * MIB)]);
    let big = t.path().join("big.img");
    make_image(&big, 32 * MIB, 28, &[(0, 32 * MIB)]);
    let tail_before = {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; 16 * MIB as usize];
        std::fs::File::open(&big)
            .unwrap()
            .read_exact_at(&mut buf, 16 * MIB)
            .unwrap();
        blake3::hash(&buf)
    };
    let dev = LoopDevice::attach(&big);
    let j = json_of(&mover(
        t.path(),
        &[
            "copy",
            src.to_str().unwrap(),
            dev.as_str(),
            "--json",
            "--verify",
        ],
    ));
    assert_eq!(j["verified"], true);
    assert_eq!(blake3_of(&src, 16 * MIB), blake3_of(&dev.path, 16 * MIB));
    let mut buf = vec![0u8; 16 * MIB as usize];
    use std::os::unix::fs::FileExt;
    std::fs::File::open(&dev.path)
        .unwrap()
        .read_exact_at(&mut buf, 16 * MIB)
        .unwrap();
    assert_eq!(
        blake3::hash(&buf),
        tail_before,
        "bytes past the source's end are untouched"
    );
}

/// Regression: data written through a loop device may still sit in the device's page
/// cache, where the backing file's hole map cannot see it. It must be copied, not skipped.
#[test]
fn unflushed_writes_through_a_loop_device_are_not_mistaken_for_holes() {
    let t = tempfile::tempdir().unwrap();
    let backing = t.path().join("sparse.img");
    make_image(&backing, 32 * MIB, 29, &[]);
    let dev = LoopDevice::attach(&backing);
    // Keep the writer open: the kernel flushes a block device on its last close.
    use std::os::unix::fs::FileExt;
    let writer = std::fs::File::options()
        .write(true)
        .open(&dev.path)
        .unwrap();
    writer.write_all_at(&[0xA5; 3 * 4096], 17 * MIB).unwrap(); // no fsync
    let out = t.path().join("out.img");
    let j = json_of(&mover(
        t.path(),
        &["copy", dev.as_str(), out.to_str().unwrap(), "--json"],
    ));
    assert_eq!(j["bytes_written"], 3 * 4096);
    assert_eq!(blake3_of(&dev.path, 32 * MIB), blake3_of(&out, 32 * MIB));
    drop(writer);
}
