//! `mover copy` between image files: full, delta, sparse, interrupted, and refusals.

mod common;

use common::*;
use std::path::Path;

fn opts(state: &Path) -> mover::CopyOptions {
    mover::CopyOptions {
        state_dir: Some(state.into()),
        verify: true,
        ..Default::default()
    }
}

#[test]
fn full_copy_to_new_image_is_identical_and_sparse() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src.img"), t.path().join("dst.img"));
    // 3 MiB of data at 5 MiB, 12 KiB near the end, a 2 MiB run of written zeros: 64 MiB.
    make_image(
        &src,
        64 * MIB,
        1,
        &[(5 * MIB, 3 * MIB), (60 * MIB + 8192, 12288)],
    );
    write_zeros(&src, 10 * MIB, 2 * MIB);
    let s = mover::copy_block(&src, &dst, &opts(t.path()), &()).unwrap();
    assert_eq!(blake3_of(&src, 64 * MIB), blake3_of(&dst, 64 * MIB));
    assert_eq!(size_of(&dst), 64 * MIB);
    assert!(s.verified && s.root.is_some());
    assert_eq!(s.bytes_written, 3 * MIB + 12288, "only data is written");
    assert_eq!(s.destination_bytes_read, 0, "a new image is not read");
    assert!(
        allocated(&dst) <= 3 * MIB + 64 * 1024,
        "holes stay holes: {} allocated",
        allocated(&dst)
    );
    assert!(!t.path().join(".dst.img.mover-partial").exists());
}

#[test]
fn delta_copy_writes_only_changed_pages_and_punches_cleared_ones() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("today.img"), t.path().join("yesterday.img"));
    make_image(&src, 48 * MIB, 2, &[(0, 40 * MIB)]);
    std::fs::copy(&src, &dst).unwrap();
    let changed = scribble_pages(&src, 3, 500, 0..40 * MIB);
    // A region cleared in the source (e.g. discarded blocks) must become a hole.
    write_zeros(&src, 20 * MIB, 2 * MIB);
    let before = allocated(&dst);
    let s = mover::copy_block(&src, &dst, &opts(t.path()), &()).unwrap();
    assert_eq!(blake3_of(&src, 48 * MIB), blake3_of(&dst, 48 * MIB));
    // Pages scribbled inside the cleared region are zeroed, not written.
    assert!(
        s.bytes_written <= changed * PAGE,
        "wrote {} for {changed} changed pages",
        s.bytes_written
    );
    assert!(s.bytes_written >= (changed - 60) * PAGE);
    assert!(s.bytes_zeroed >= 2 * MIB);
    assert!(
        allocated(&dst) <= before - 2 * MIB + 64 * 1024,
        "cleared region punched"
    );

    // A second run finds nothing to do.
    let again = mover::copy_block(&src, &dst, &opts(t.path()), &()).unwrap();
    assert_eq!((again.bytes_written, again.bytes_zeroed), (0, 0));
}

#[test]
fn odd_sizes_and_chunk_sizes_copy_exactly() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("odd.img");
    let len = 10 * MIB + 4096 * 3 + 512; // not a multiple of any chunk size or of a page
    make_image(
        &src,
        len,
        4,
        &[(0, 1000), (len - 3000, 3000), (4 * MIB, MIB + 17)],
    );
    for cs in ["64K", "1M", "8M"] {
        let dst = t.path().join(format!("odd-{cs}.img"));
        let mut o = opts(t.path());
        o.chunk_size = cs.parse().unwrap();
        mover::copy_block(&src, &dst, &o, &()).unwrap();
        assert_eq!(
            blake3_of(&src, len),
            blake3_of(&dst, len),
            "chunk size {cs}"
        );
        assert_eq!(size_of(&dst), len);
    }
}

#[test]
fn refusals_write_nothing_and_exit_2() {
    let t = tempfile::tempdir().unwrap();
    let state = t.path().join("state");
    let src = t.path().join("src.img");
    make_image(&src, 8 * MIB, 5, &[(0, MIB)]);
    let s = src.to_str().unwrap();

    let check = |args: &[&str], expect: &str| {
        let out = mover(&state, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(expect), "{args:?}: wanted {expect:?} in {err}");
    };

    let new_dst = t.path().join("new.img");
    check(
        &[
            "copy",
            t.path().join("missing.img").to_str().unwrap(),
            new_dst.to_str().unwrap(),
        ],
        "No such file",
    );
    assert!(!new_dst.exists() && !t.path().join(".new.img.mover-partial").exists());

    check(&["copy", s, s], "same volume");

    let small = t.path().join("small.img");
    make_image(&small, 4 * MIB, 6, &[(0, 4 * MIB)]);
    let small_hash = blake3_of(&small, 4 * MIB);
    check(&["copy", s, small.to_str().unwrap()], "--grow");
    assert_eq!(
        blake3_of(&small, 4 * MIB),
        small_hash,
        "refused destination untouched"
    );
    assert_eq!(size_of(&small), 4 * MIB);

    let large = t.path().join("large.img");
    make_image(&large, 16 * MIB, 7, &[(0, MIB)]);
    check(
        &["copy", s, large.to_str().unwrap()],
        "larger than the source",
    );

    check(&["copy", s, t.path().to_str().unwrap()], "is a directory");
    check(
        &[
            "copy",
            s,
            t.path().join("no/such/dir.img").to_str().unwrap(),
        ],
        "does not exist",
    );
    check(&["copy", s, "s3://bucket/volume"], "not supported");
    check(&["copy", s, "agent://node-b/vol"], "no port");
    check(
        &[
            "copy",
            s,
            t.path().join("x").to_str().unwrap(),
            "--chunk-size",
            "3M",
        ],
        "power of two",
    );

    // --grow makes the smaller file fit, and the copy is exact.
    let out = mover(
        &state,
        &["copy", s, small.to_str().unwrap(), "--grow", "--verify"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(blake3_of(&src, 8 * MIB), blake3_of(&small, 8 * MIB));
}

#[test]
fn json_summary_reports_the_work_done() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src.img");
    let dst = t.path().join("dst.img");
    make_image(&src, 16 * MIB, 8, &[(MIB, 2 * MIB)]);
    let out = mover(
        t.path(),
        &[
            "copy",
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
            "--json",
            "--verify",
        ],
    );
    let j = json_of(&out);
    assert_eq!(j["volume_bytes"], 16 * MIB);
    assert_eq!(j["bytes_written"], 2 * MIB);
    assert_eq!(j["zero_bytes_skipped"], 14 * MIB);
    assert_eq!(j["pages_written"], 512);
    assert_eq!(j["verified"], true);
    let hash = json_of(&mover(t.path(), &["hash", dst.to_str().unwrap(), "--json"]));
    assert_eq!(
        hash["root"], j["root"],
        "mover hash of the copy equals the copy's verified root"
    );
    assert_eq!(hash["data_chunks"], 2);
}

/// kill -9 in the middle of a copy, then rerun: the destination never looks complete
/// before the rerun, the rerun is byte-identical and rewrites nothing already equal.
#[test]
fn killed_copy_resumes_without_rewriting() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("big.img");
    let dst = t.path().join("copy.img");
    let partial = t.path().join(".copy.img.mover-partial");
    let len = 768 * MIB;
    make_image(&src, len, 9, &[(0, len)]);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
        .args([
            "copy",
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
            "--no-progress",
        ])
        .env("MOVER_STATE_DIR", t.path())
        .spawn()
        .unwrap();
    // Wait until a good part is written, then kill -9.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !(partial.exists() && allocated(&partial) >= 64 * MIB) {
        assert!(
            child.try_wait().unwrap().is_none(),
            "copy finished before it could be killed"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "copy made no progress"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(
        !dst.exists(),
        "an interrupted copy must not appear under the final name"
    );
    let done_before = allocated(&partial);
    assert!(done_before < len, "killed before the end");

    let j = json_of(&mover(
        t.path(),
        &[
            "copy",
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
            "--json",
        ],
    ));
    assert_eq!(j["resumed"], true);
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
    let written = j["bytes_written"].as_u64().unwrap();
    assert!(
        written <= len - done_before + 16 * MIB,
        "rerun wrote {written} bytes though {done_before} were already there"
    );
    assert!(!partial.exists());
}

/// kill -9 of an in-place copy (onto an older image): the marker says the destination
/// is incomplete until a rerun finishes it.
#[test]
fn killed_in_place_copy_leaves_a_marker_until_finished() {
    let t = tempfile::tempdir().unwrap();
    let state = t.path().join("state");
    let src = t.path().join("src.img");
    let dst = t.path().join("old.img");
    let len = 512 * MIB;
    make_image(&src, len, 10, &[(0, len)]);
    make_image(&dst, len, 11, &[(0, len)]);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
        .args([
            "copy",
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
            "--no-progress",
        ])
        .env("MOVER_STATE_DIR", &state)
        .spawn()
        .unwrap();
    let markers = state.join("copies");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    // The marker is written as a temp file, synced and renamed: wait for the final name
    // (a slow disk can take longer over the sync than the test sleeps below).
    let json_markers = || {
        std::fs::read_dir(&markers).map_or(0, |d| {
            d.filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "json"))
            })
            .count()
        })
    };
    while json_markers() == 0 {
        assert!(
            child.try_wait().unwrap().is_none(),
            "copy finished before it could be killed"
        );
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(!status.success());
    assert_eq!(
        std::fs::read_dir(&markers).unwrap().count(),
        1,
        "marker left by the killed copy"
    );

    let j = json_of(&mover(
        &state,
        &[
            "copy",
            src.to_str().unwrap(),
            dst.to_str().unwrap(),
            "--json",
            "--verify",
        ],
    ));
    assert_eq!(j["resumed"], true);
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
    assert_eq!(
        std::fs::read_dir(&markers).unwrap().count(),
        0,
        "marker removed once complete"
    );
}

/// The saved index of a destination image (chunk ids and page CVs) lets a delta copy
/// write the changed pages without reading the destination at all; any outside write to the image, or damage to the index, makes the next copy
/// compare in full instead of trusting it.
#[test]
fn saved_index_limits_destination_reads_and_is_never_trusted_when_stale() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src.img"), t.path().join("dst.img"));
    let len = 64 * MIB;
    make_image(&src, len, 30, &[(0, 60 * MIB)]);
    let copy = || {
        json_of(&mover(
            t.path(),
            &[
                "copy",
                src.to_str().unwrap(),
                dst.to_str().unwrap(),
                "--json",
            ],
        ))
    };
    let first = copy();
    assert_eq!(first["used_saved_index"], false);

    // 40 pages changed inside the first 4 MiB: at most 4 chunks differ.
    let changed = scribble_pages(&src, 31, 40, 0..4 * MIB);
    let second = copy();
    assert_eq!(second["used_saved_index"], true);
    assert_eq!(second["destination_bytes_read"], 0, "the page CVs tell");
    assert_eq!(second["bytes_written"], changed * PAGE);
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));

    // Someone writes to the copy behind mover's back: the index is stale.
    std::thread::sleep(std::time::Duration::from_millis(20));
    write_zeros(&dst, 50 * MIB, PAGE);
    let third = copy();
    assert_eq!(
        third["used_saved_index"], false,
        "a modified image must be compared in full"
    );
    assert_eq!(
        third["bytes_written"], PAGE,
        "the outside write is repaired"
    );
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));

    // A damaged index is refused (its checksum), and the copy is still exact.
    scribble_pages(&src, 32, 10, 8 * MIB..12 * MIB);
    let index_dir = t.path().join("index");
    let idx = std::fs::read_dir(&index_dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let mut bytes = std::fs::read(&idx).unwrap();
    bytes[9 * (32 + 256 * 32)] ^= 0x40; // the entry of chunk 9, inside the changed range
    std::fs::write(&idx, bytes).unwrap();
    let fourth = copy();
    assert_eq!(fourth["used_saved_index"], false);
    assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
}

/// Regression: the index of a new image was saved under its name as given (relative),
/// and looked up by its absolute name next time, so relative paths never used it.
#[test]
fn saved_index_is_found_with_relative_paths() {
    let t = tempfile::tempdir().unwrap();
    make_image(&t.path().join("src.img"), 16 * MIB, 33, &[(0, 16 * MIB)]);
    let copy = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(["copy", "src.img", "dst.img", "--json", "--no-progress"])
            .current_dir(t.path())
            .env("MOVER_STATE_DIR", t.path().join("state"))
            .output()
            .unwrap();
        json_of(&out)
    };
    assert_eq!(copy()["used_saved_index"], false);
    scribble_pages(&t.path().join("src.img"), 34, 3, 0..MIB);
    let second = copy();
    assert_eq!(second["used_saved_index"], true);
    assert_eq!(second["destination_bytes_read"], 0);
}

/// Copy after copy onto the same image, the saved page CVs alone decide which pages are
/// written: changed pages, cleared pages and chunks, zero chunks that gain data, a short
/// last chunk. Each copy must be exact and write no more than what changed.
#[test]
fn generations_of_deltas_by_saved_page_cvs_stay_exact() {
    let t = tempfile::tempdir().unwrap();
    let (src, dst) = (t.path().join("src.img"), t.path().join("dst.img"));
    let len = 40 * MIB + 5000; // the last chunk: a page and a short one
    make_image(&src, len, 40, &[(0, 24 * MIB), (32 * MIB, 8 * MIB + 5000)]);
    let copy = || {
        let s = json_of(&mover(
            t.path(),
            &[
                "copy",
                src.to_str().unwrap(),
                dst.to_str().unwrap(),
                "--json",
            ],
        ));
        assert_eq!(blake3_of(&src, len), blake3_of(&dst, len));
        s
    };
    assert_eq!(copy()["destination_bytes_read"], 0);
    for generation in 0..4u64 {
        let seed = 41 + generation * 10;
        let mut changed = scribble_pages(&src, seed, 50, 0..24 * MIB);
        // Pages cleared inside a data chunk, and a whole chunk cleared.
        write_zeros(&src, (generation + 2) * MIB + 8192, 3 * PAGE);
        write_zeros(&src, (10 + generation) * MIB, MIB);
        // A zero chunk (never written) gains data; the short last page changes.
        changed += scribble_pages(
            &src,
            seed + 1,
            5,
            (25 + generation) * MIB..(26 + generation) * MIB,
        );
        make_image_part(&src, len - 100, 100, seed + 2);
        changed += 1;
        let s = copy();
        assert_eq!(s["used_saved_index"], true, "generation {generation}");
        assert_eq!(s["destination_bytes_read"], 0, "generation {generation}");
        let written = s["bytes_written"].as_u64().unwrap();
        assert!(
            written <= changed * PAGE && written > 0,
            "generation {generation}: wrote {written} for {changed} changed pages"
        );
        assert!(
            s["bytes_zeroed"].as_u64().unwrap() >= MIB,
            "generation {generation}"
        );
        let again = copy();
        assert_eq!(
            (
                again["bytes_written"].as_u64(),
                again["bytes_zeroed"].as_u64()
            ),
            (Some(0), Some(0))
        );
    }
}

/// Overwrites `n` bytes at `offset` with seeded random data.
fn make_image_part(path: &Path, offset: u64, n: usize, seed: u64) {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; n];
    let mut x = seed | 1;
    for b in &mut buf {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.write_all_at(&buf, offset).unwrap();
}
