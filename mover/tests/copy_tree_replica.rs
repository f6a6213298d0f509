//! `mover copy --replica DIR DIR`: reruns compare the source with the record of the last
//! run instead of looking at every destination entry, and still end with a destination
//! equal to the source; what the record cannot see is the documented limit.
//!
//! Trees are compared by the manifest of `common::tree`, built without the engine's code.

mod common;

use common::tree::*;
use std::{
    fs,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    process::Command,
};

struct Replica {
    _dir: tempfile::TempDir,
    src: PathBuf,
    dst: PathBuf,
    state: PathBuf,
}

impl Replica {
    /// A source tree and its first replica copy.
    fn new(seed: u64) -> Replica {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst, state) = (
            dir.path().join("src"),
            dir.path().join("dst"),
            dir.path().join("state"),
        );
        make_tree(&src, seed);
        let r = Replica {
            _dir: dir,
            src,
            dst,
            state,
        };
        let first = r.copy(true);
        assert_eq!(first.entries_from_record, 0, "nothing is recorded yet");
        r
    }

    fn copy(&self, replica: bool) -> mover::TreeSummary {
        self.copy_with(replica, true)
    }

    fn copy_with(&self, replica: bool, delete: bool) -> mover::TreeSummary {
        let options = mover::TreeOptions {
            delete,
            replica,
            state_dir: Some(self.state.clone()),
            ..Default::default()
        };
        let s = mover::copy_tree(&self.src, &self.dst, &options, &()).unwrap();
        assert!(s.is_complete(), "errors: {:?}", s.errors);
        s
    }

    fn record(&self) -> Option<PathBuf> {
        let dir = self.state.join("trees");
        let mut found: Vec<PathBuf> = fs::read_dir(&dir)
            .map(|d| d.map(|e| e.unwrap().path()).collect())
            .unwrap_or_default();
        assert!(found.len() <= 1, "one record, no temp files: {found:?}");
        found.pop()
    }
}

/// Entries a record can vouch for: neither directories nor multiply-linked files.
fn recordable(root: &Path) -> u64 {
    let mut entries = Vec::new();
    walk(root, root, &mut entries);
    entries
        .iter()
        .filter(|(_, m)| !m.is_dir() && m.nlink() == 1)
        .count() as u64
}

#[test]
fn a_rerun_takes_unchanged_entries_from_the_record_and_touches_nothing() {
    let r = Replica::new(21);
    assert!(r.record().is_some(), "the first run saved a record");
    let before = ctimes(&r.dst);
    let s = r.copy(true);
    assert_eq!(s.entries_from_record, recordable(&r.src));
    assert_eq!(
        (s.entries_copied, s.metadata_updated, s.entries_deleted),
        (0, 0, 0)
    );
    assert_eq!(
        ctimes(&r.dst),
        before,
        "nothing in the destination was touched"
    );
    assert_same_tree(&r.src, &r.dst);
}

#[test]
fn a_delta_carries_every_kind_of_edit() {
    let r = Replica::new(22);
    let src = &r.src;
    edit_every_kind(src);
    // Besides: a rename, and a hard link removed.
    fs::rename(src.join("small/09/f9.txt"), src.join("small/09/renamed")).unwrap();
    fs::remove_file(src.join("note-link")).unwrap();

    let s = r.copy(true);
    assert_same_tree(&r.src, &r.dst);
    assert!(s.entries_from_record > 0);
    assert_eq!(
        s.bytes_written,
        6 + 9 + fs::metadata(src.join("small/09/renamed")).unwrap().len()
    );
    assert_eq!(s.metadata_updated, 2, "f4 mode and f5 xattr");
    // small/07 (20 files and itself), f6, f9's old name, f8 (a file), empty (a dir),
    // note-link.
    assert_eq!(s.entries_deleted, 21 + 1 + 1 + 1 + 1 + 1);

    // And the record written by the delta vouches for everything after it.
    let again = r.copy(true);
    assert_eq!(again.entries_from_record, recordable(&r.src));
    assert_eq!((again.entries_copied, again.entries_deleted), (0, 0));
}

#[test]
fn names_added_or_removed_in_the_destination_are_noticed() {
    let r = Replica::new(23);
    fs::write(r.dst.join("small/02/intruder"), b"not from the source").unwrap();
    fs::remove_file(r.dst.join("small/03/f3.txt")).unwrap();
    fs::write(r.dst.join("top-level-intruder"), b"x").unwrap();
    let s = r.copy(true);
    assert_same_tree(&r.src, &r.dst);
    assert_eq!(s.entries_deleted, 2, "both intruders");
    assert_eq!(s.entries_copied, 1, "f3 again");
}

#[test]
fn a_file_changed_in_place_behind_movers_back_is_the_documented_limit() {
    let r = Replica::new(24);
    let victim = r.dst.join("small/01/f1.txt");
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o666)).unwrap();
    // --replica trusts the record for entries whose source did not change...
    let s = r.copy(true);
    assert_eq!(s.metadata_updated, 0);
    assert_eq!(fs::metadata(&victim).unwrap().mode() & 0o777, 0o666);
    // ...a run without it looks at every entry, repairs, and drops the record...
    let s = r.copy(false);
    assert_eq!(s.metadata_updated, 1);
    assert_same_tree(&r.src, &r.dst);
    assert!(
        r.record().is_none(),
        "a run without --replica drops the record"
    );
    // ...so the next --replica run looks at everything again before it trusts anything.
    let s = r.copy(true);
    assert_eq!(s.entries_from_record, 0);
    assert!(r.record().is_some());
}

#[test]
fn a_damaged_record_is_not_trusted() {
    let r = Replica::new(25);
    let record = r.record().unwrap();
    let mut bytes = fs::read(&record).unwrap();
    // Flip a byte in every directory's entries: they sit between the header and the
    // table, whose offset opens the 64-byte trailer.
    let trailer = bytes.len() - 64;
    let table = u64::from_le_bytes(bytes[trailer..trailer + 8].try_into().unwrap()) as usize;
    for i in (64..table).step_by(40) {
        bytes[i] ^= 0x40;
    }
    fs::write(&record, &bytes).unwrap();
    let victim = r.dst.join("small/01/f1.txt");
    fs::set_permissions(&victim, fs::Permissions::from_mode(0o666)).unwrap();
    let s = r.copy(true);
    assert_eq!(s.metadata_updated, 1, "the damaged directory was looked at");
    assert_same_tree(&r.src, &r.dst);

    // A record cut short is not used at all.
    let record = r.record().unwrap();
    let len = fs::metadata(&record).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&record)
        .unwrap()
        .set_len(len - 1)
        .unwrap();
    let s = r.copy(true);
    assert_eq!(s.entries_from_record, 0);
}

#[test]
fn replica_with_an_agent_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_mover"))
        .args(["copy", "--replica"])
        .arg(t.path())
        .arg("agent://127.0.0.1:1/data")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--replica is for local DIR to DIR"),
        "{stderr}"
    );
}

#[test]
fn a_record_made_without_delete_does_not_hide_what_delete_must_remove() {
    let r = Replica::new(26);
    fs::remove_file(r.src.join("small/02/f2.txt")).unwrap();
    // A change elsewhere, so that the run saves a record.
    fs::write(r.src.join("small/05/f5.txt"), b"changed").unwrap();
    // Without --delete the copy stays in DST, unrecorded, and the directory is sealed
    // as it is.
    let s = r.copy_with(true, false);
    assert_eq!(s.entries_copied, 1);
    assert!(
        s.entries_from_record > 0,
        "a record made with --delete serves a run without"
    );
    assert!(r.dst.join("small/02/f2.txt").exists());
    let s = r.copy_with(true, true);
    assert_eq!(
        s.entries_from_record, 0,
        "one made without it does not serve a run with it"
    );
    assert_eq!(s.entries_deleted, 1);
    assert_same_tree(&r.src, &r.dst);
}

#[test]
fn a_hard_link_the_source_broke_is_not_changed_through_its_other_name() {
    let r = Replica::new(27);
    // docs/deep/er/note has three names; the source replaces one by an equal copy with
    // the same mtime (cp -p a t && mv t b): DST still links all three.
    let (a, b) = (r.src.join("docs/deep/er/note"), r.src.join("note-link"));
    let tmp = r.src.join("tmp");
    fs::copy(&a, &tmp).unwrap();
    let mtime = fs::metadata(&a).unwrap();
    set_mtime(&tmp, mtime.mtime(), mtime.mtime_nsec() as u32);
    for (name, value) in xattrs(&a) {
        set_xattr(&tmp, &name.to_string_lossy(), &value);
    }
    fs::rename(&tmp, &b).unwrap();
    r.copy(true);
    assert_same_tree(&r.src, &r.dst);
    // Now a metadata change to the other names must not reach note-link's copy.
    fs::set_permissions(&a, fs::Permissions::from_mode(0o600)).unwrap();
    r.copy(true);
    assert_same_tree(&r.src, &r.dst);
}
