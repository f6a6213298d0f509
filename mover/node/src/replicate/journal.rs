//! Atomic apply of replication cycles on the secondary (docs/ARCHITECTURE.md).
//!
//! A cycle's frames are not written into the volume as they arrive: they are appended
//! to a journal in the state directory. When the primary finishes the cycle, the
//! journal is fsynced, a commit record (cycle id, Merkle root, point in time, epoch) is
//! written durably, and only then is the journal applied in place. The cycle is complete
//! from its commit record on, so the primary is answered once the journal's writes are
//! in the volume; the volume's fsync, the applied record and the journal's removal
//! follow in the background (whatever reads those records waits for them). After a
//! crash, a committed journal is applied again (applying is idempotent: the same bytes
//! at the same offsets) and an uncommitted one is thrown away, so the volume always
//! equals exactly one completed cycle.
//!
//! Layout under `STATE/cycles/<relationship hash>/`:
//! - `journal`: magic `MVJRNL\0\x01`, then records: offset (u64 LE), length (u64 LE),
//!   kind (u64 LE: 0 data, 1 zeros), and for data the bytes.
//! - `commit.json`: the commit record (version 1), present from commit until applied.
//! - `applied.json`: the last applied cycle (version 1).

use super::CycleRecord;
use mover_engine::{
    copy::zero_range,
    node::{failpoint, now_ms, write_durably},
};
use serde::{Deserialize, Serialize};
use std::{
    collections::HashMap,
    fs::{self, File, OpenOptions},
    io::{self, BufReader, BufWriter, Read, Write},
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{Mutex, MutexGuard, OnceLock},
};
use transport::proto;

const MAGIC: &[u8; 8] = b"MVJRNL\0\x01";
pub(crate) const RECORD_VERSION: u32 = 1;
const KIND_DATA: u64 = 0;
const KIND_ZEROS: u64 = 1;

/// What keeps the ranges a cycle's apply onto a volume overwrites, told before each
/// is written (`None`: nothing needs them).
pub(crate) type Keep = Box<dyn Fn(&File, u64, u64)>;

/// Looks at an apply onto `volume` about to start: what must keep what it overwrites.
pub(crate) type Watcher = fn(volume: &Path) -> Option<Keep>;

/// The one watcher of applies: the holds of readers (`super::holds`), set when the
/// first hold is taken (none exists before: holds end with the process).
static WATCHER: OnceLock<Watcher> = OnceLock::new();

/// Has `watcher` told of every apply from now on.
pub(crate) fn watch_applies(watcher: Watcher) {
    // Only one watcher exists; a second registration is the same function.
    let _ = WATCHER.set(watcher);
}

/// A cycle as committed and applied: what the secondary equals afterwards.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppliedCycle {
    /// Format version of the record.
    pub version: u32,
    /// The relationship.
    pub relationship: String,
    /// The cycle's id.
    pub id: u64,
    /// Hex Merkle root of the volume at this cycle.
    pub root: String,
    /// The source's point in time (Unix ms).
    pub point_in_time_ms: i64,
    /// The writer's epoch.
    pub epoch: u64,
    /// The last cycle of a demote.
    pub r#final: bool,
    /// "point-in-time", "file-consistent" or "crash-inconsistent".
    pub consistency: String,
    /// When it was applied (Unix ms).
    pub applied_ms: i64,
    /// Byte ranges written here since (start, end): a former primary that diverged.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dirty: Vec<(u64, u64)>,
}

impl AppliedCycle {
    /// The record of `cycle` of `relationship`, written with `epoch`, with hex Merkle
    /// `root` (empty for a file tree), as applied now.
    pub fn of_cycle(relationship: &str, cycle: &proto::Cycle, epoch: u64, root: String) -> Self {
        AppliedCycle {
            version: RECORD_VERSION,
            relationship: relationship.into(),
            id: cycle.id,
            root,
            point_in_time_ms: cycle.point_in_time_ms,
            epoch,
            r#final: cycle.r#final,
            consistency: cycle.consistency.clone(),
            applied_ms: now_ms(),
            dirty: Vec::new(),
        }
    }

    /// The record of cycle `c` of `relationship`, written with `epoch`, as applied now.
    pub fn of(relationship: &str, c: &CycleRecord, epoch: u64) -> Self {
        AppliedCycle {
            version: RECORD_VERSION,
            relationship: relationship.into(),
            id: c.id,
            root: c.root.clone(),
            point_in_time_ms: c.point_in_time_ms,
            epoch,
            r#final: c.r#final,
            consistency: c.consistency.clone(),
            applied_ms: now_ms(),
            dirty: Vec::new(),
        }
    }
}

impl From<&AppliedCycle> for CycleRecord {
    fn from(a: &AppliedCycle) -> Self {
        CycleRecord {
            id: a.id,
            point_in_time_ms: a.point_in_time_ms,
            started_ms: a.applied_ms,
            root: a.root.clone(),
            r#final: a.r#final,
            consistency: a.consistency.clone(),
            ..Default::default()
        }
    }
}

/// The commit record: the cycle, and the volume the journal applies to.
#[derive(Debug, Serialize, Deserialize)]
struct Commit {
    version: u32,
    cycle: AppliedCycle,
    /// The volume's path (an export's), so a restart can finish the apply.
    volume: PathBuf,
    /// Bytes of the journal the commit covers.
    journal_len: u64,
}

/// The directory of a relationship's cycles.
pub(crate) fn cycles_dir(state_dir: &Path, relationship: &str) -> PathBuf {
    state_dir
        .join("cycles")
        .join(mover_engine::node::name_hash(relationship))
}

/// The last cycle applied for the relationship whose cycles are in `dir`, if any (once
/// an apply finishing in the background is done).
pub(crate) fn applied(dir: &Path) -> Option<AppliedCycle> {
    let _settled = settle(dir)
        .inspect_err(|e| tracing::warn!("cannot settle the cycle in {}: {e}", dir.display()));
    read_applied(dir)
}

/// Whether the secondary `r` holds, applied here, the final cycle of its peer's demote,
/// and has shipped nothing of its own since (a side that demoted itself records the
/// final cycle it shipped, not one it applied).
pub(crate) fn handed_over(r: &super::Record, applied: Option<&AppliedCycle>) -> bool {
    r.role == super::Role::Secondary
        && applied.is_some_and(|a| a.r#final && r.last_cycle.as_ref().is_none_or(|c| c.id <= a.id))
}

fn read_applied(dir: &Path) -> Option<AppliedCycle> {
    let text = fs::read_to_string(dir.join("applied.json")).ok()?;
    serde_json::from_str::<AppliedCycle>(&text)
        .ok()
        .filter(|a| a.version == RECORD_VERSION)
}

/// A cycle's journal being written.
pub(crate) struct Journal {
    dir: PathBuf,
    out: BufWriter<File>,
    len: u64,
}

impl Journal {
    /// Starts an empty journal in `dir`, dropping any uncommitted one; a committed one
    /// whose apply failed part way (a full disk, an I/O error) is applied first.
    pub fn create(dir: &Path) -> io::Result<Journal> {
        fs::create_dir_all(dir)?;
        if dir.join("commit.json").exists() {
            apply(dir)?;
        }
        let _settled = settle(dir)?;
        // A new file, not the old one truncated: a superseded session still holding the
        // old one can only ever write into an unlinked file.
        let path = dir.join("journal");
        match fs::remove_file(&path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(MAGIC)?;
        Ok(Journal {
            dir: dir.into(),
            out,
            len: MAGIC.len() as u64,
        })
    }

    fn header(&mut self, offset: u64, len: u64, kind: u64) -> io::Result<()> {
        let mut h = [0u8; 24];
        h[..8].copy_from_slice(&offset.to_le_bytes());
        h[8..16].copy_from_slice(&len.to_le_bytes());
        h[16..].copy_from_slice(&kind.to_le_bytes());
        self.out.write_all(&h)?;
        self.len += 24;
        Ok(())
    }

    /// Stages `data` to be written at `offset`.
    pub fn data(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.header(offset, data.len() as u64, KIND_DATA)?;
        self.out.write_all(data)?;
        self.len += data.len() as u64;
        Ok(())
    }

    /// Stages `len` bytes of zeros at `offset`.
    pub fn zeros(&mut self, offset: u64, len: u64) -> io::Result<()> {
        self.header(offset, len, KIND_ZEROS)
    }

    /// Makes the journal durable and writes the commit record: from here on, the cycle
    /// will be applied even if this process dies. Returns the directory to [`apply`].
    pub fn commit(mut self, cycle: AppliedCycle, volume: &Path) -> io::Result<PathBuf> {
        let t0 = std::time::Instant::now();
        self.out.flush()?;
        self.out.get_ref().sync_all()?;
        tracing::debug!(
            bytes = self.len,
            secs = t0.elapsed().as_secs_f64(),
            "journal synced"
        );
        failpoint("cycle-staged");
        let commit = Commit {
            version: RECORD_VERSION,
            cycle,
            volume: volume.into(),
            journal_len: self.len,
        };
        let body = serde_json::to_vec(&commit).map_err(io::Error::other)?;
        write_durably(&self.dir.join("commit.json"), &body)?;
        failpoint("cycle-committed");
        Ok(self.dir)
    }
}

/// Applies the committed journal in `dir` onto its volume, fsyncs it, records the cycle
/// as applied, and removes the journal. Returns the applied cycle. A journal already
/// applied (by a commit finishing in the background) is not an error.
pub(crate) fn apply(dir: &Path) -> io::Result<AppliedCycle> {
    let _settled = settle(dir)?;
    if !dir.join("commit.json").exists() {
        return read_applied(dir).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("no committed cycle in {}", dir.display()),
            )
        });
    }
    apply_committed(dir)
}

/// Writes the committed journal in `dir` onto its volume and finishes it (the caller
/// holds the directory's lock).
fn apply_committed(dir: &Path) -> io::Result<AppliedCycle> {
    let (commit, volume) = open_commit(dir)?;
    write_journal(dir, &commit, &volume)?;
    finish(dir, commit, &volume)
}

/// Runs `f` with the last cycle applied from `dir` while no apply runs (one committed
/// but not applied is applied first): the volume equals that cycle throughout `f`.
pub(crate) fn at_applied_cycle<T>(
    dir: &Path,
    f: impl FnOnce(Option<&AppliedCycle>) -> T,
) -> io::Result<T> {
    let _settled = settle(dir)?;
    if dir.join("commit.json").exists() {
        apply_committed(dir)?;
    }
    Ok(f(read_applied(dir).as_ref()))
}

/// Writes the committed journal in `dir` onto its volume and returns at once with the
/// cycle it applies: the volume reads as that cycle from now on. Its fsync, the applied
/// record and the journal's removal follow on a background thread; until they are done
/// the commit record stands (a crash replays it), and whatever reads or replaces this
/// directory's records first finishes them.
pub(crate) fn apply_then_sync_in_background(dir: &Path) -> io::Result<AppliedCycle> {
    let mut written = settle(dir)?;
    if !dir.join("commit.json").exists() {
        // Applied whole already, by whoever took the lock first (a hold being taken).
        if let Some(applied) = read_applied(dir) {
            return Ok(applied);
        }
    }
    let (commit, volume) = open_commit(dir)?;
    write_journal(dir, &commit, &volume)?;
    *written = true;
    let mut cycle = commit.cycle.clone();
    cycle.applied_ms = now_ms();
    drop(written);
    let dir = dir.to_path_buf();
    std::thread::spawn(move || {
        failpoint("cycle-applied-unsynced");
        if let Err(e) = settle(&dir) {
            tracing::error!(
                "cannot finish the apply of the committed cycle in {} (the next cycle or a \
                 restart applies it again): {e}",
                dir.display()
            );
        }
    });
    Ok(cycle)
}

/// Locks `dir` (one lock per cycles directory) and finishes a commit whose journal is
/// written but whose fsync and records are left. The lock's flag says one is.
fn settle(dir: &Path) -> io::Result<MutexGuard<'static, bool>> {
    static LOCKS: OnceLock<Mutex<HashMap<PathBuf, &'static Mutex<bool>>>> = OnceLock::new();
    let lock: &'static Mutex<bool> = LOCKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(dir.to_path_buf())
        // One per relationship that ever had a cycle here: leaked, never many.
        .or_insert_with(|| Box::leak(Box::default()));
    let mut written = lock.lock().unwrap_or_else(|e| e.into_inner());
    if *written {
        // Cleared first: if this fails, the next one writes the journal again.
        *written = false;
        if dir.join("commit.json").exists() {
            let (commit, volume) = open_commit(dir)?;
            finish(dir, commit, &volume)?;
        }
    }
    Ok(written)
}

/// The commit record in `dir` and its volume, opened for writing.
fn open_commit(dir: &Path) -> io::Result<(Commit, File)> {
    let text = fs::read_to_string(dir.join("commit.json"))?;
    let commit: Commit = serde_json::from_str(&text).map_err(io::Error::other)?;
    if commit.version != RECORD_VERSION {
        return Err(io::Error::other(format!(
            "commit record version {} in {} (this build reads {RECORD_VERSION})",
            commit.version,
            dir.display()
        )));
    }
    // Read too: a hold keeps what the journal overwrites (super::holds).
    let volume = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&commit.volume)?;
    Ok((commit, volume))
}

/// Writes the journal's records onto `volume` (not synced).
fn write_journal(dir: &Path, commit: &Commit, volume: &File) -> io::Result<()> {
    let journal = File::open(dir.join("journal"))?;
    if journal.metadata()?.len() < commit.journal_len {
        return Err(io::Error::other(format!(
            "the journal in {} is shorter than its commit record says: the state \
             directory was damaged; resync this secondary",
            dir.display()
        )));
    }
    let mut input = BufReader::with_capacity(1 << 20, journal.take(commit.journal_len));
    let mut magic = [0u8; 8];
    input.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(io::Error::other(format!(
            "{} is not a mover journal",
            dir.display()
        )));
    }
    let t0 = std::time::Instant::now();
    let mut buf = Vec::new();
    let mut records = 0u64;
    // A reader holding the cycle the volume is at keeps what this one overwrites.
    let keep = WATCHER.get().and_then(|watch| watch(&commit.volume));
    let keep = |offset, len| {
        if let Some(keep) = &keep {
            keep(volume, offset, len)
        }
    };
    loop {
        let mut h = [0u8; 24];
        match input.read_exact(&mut h) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e),
        }
        let word = |i: usize| u64::from_le_bytes(h[i * 8..i * 8 + 8].try_into().expect("8"));
        let (offset, len, kind) = (word(0), word(1), word(2));
        match kind {
            KIND_DATA => {
                buf.resize(len as usize, 0);
                input.read_exact(&mut buf)?;
                keep(offset, len);
                volume.write_all_at(&buf, offset)?;
            }
            KIND_ZEROS => {
                keep(offset, len);
                zero_range(volume, &commit.volume, offset, len)
                    .map_err(|e| io::Error::other(e.to_string()))?
            }
            other => {
                return Err(io::Error::other(format!(
                    "unknown record kind {other} in {}",
                    dir.display()
                )));
            }
        }
        records += 1;
        if records == 1 {
            failpoint("cycle-mid-apply");
        }
    }
    tracing::debug!(
        records,
        secs = t0.elapsed().as_secs_f64(),
        "journal written"
    );
    Ok(())
}

/// Fsyncs the written `volume`, records the commit's cycle as applied, and removes the
/// commit record and the journal.
fn finish(dir: &Path, commit: Commit, volume: &File) -> io::Result<AppliedCycle> {
    let t0 = std::time::Instant::now();
    // Data only: the size never changes, and the inode's times need no log force.
    volume.sync_data()?;
    tracing::debug!(secs = t0.elapsed().as_secs_f64(), "volume synced");
    let mut cycle = commit.cycle;
    cycle.applied_ms = now_ms();
    write_applied(dir, &cycle)?;
    fs::remove_file(dir.join("commit.json"))?;
    let _ = fs::remove_file(dir.join("journal"));
    File::open(dir)?.sync_all()?;
    Ok(cycle)
}

/// Records `cycle` as the last one applied in `dir`.
pub(crate) fn record_applied(dir: &Path, cycle: &AppliedCycle) -> io::Result<()> {
    let _settled = settle(dir)?;
    write_applied(dir, cycle)
}

fn write_applied(dir: &Path, cycle: &AppliedCycle) -> io::Result<()> {
    let body = serde_json::to_vec(cycle).map_err(io::Error::other)?;
    write_durably(&dir.join("applied.json"), &body)
}

/// Forgets the last applied cycle in `dir`: the volume is about to be changed in place
/// (a file-tree cycle, a resync without a common cycle) and equals none until recorded.
pub(crate) fn forget_applied(dir: &Path) -> io::Result<()> {
    let _settled = settle(dir)?;
    match fs::remove_file(dir.join("applied.json")) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    fs::File::open(dir).and_then(|d| d.sync_all()).or_else(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            Ok(())
        } else {
            Err(e)
        }
    })
}

/// Drops an uncommitted journal in `dir` (a cycle that will not be finished).
pub(crate) fn discard(dir: &Path) {
    let _settled = settle(dir);
    if !dir.join("commit.json").exists() {
        let _ = fs::remove_file(dir.join("journal"));
    }
}

/// At start-up: applies every committed journal under `state_dir` and drops the
/// uncommitted ones. Returns what was applied, and errors by directory.
pub(crate) fn recover(state_dir: &Path) -> Vec<(PathBuf, io::Result<AppliedCycle>)> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir(state_dir.join("cycles")) else {
        return out;
    };
    for e in entries.flatten() {
        let dir = e.path();
        if dir.join("commit.json").exists() {
            let r = apply(&dir);
            out.push((dir, r));
        } else {
            discard(&dir);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_final_cycle_applied_here_and_not_shipped_past_is_a_handover() {
        use super::super::{CycleRecord, Role};
        let applied = |id, last| AppliedCycle {
            r#final: last,
            ..cycle(id)
        };
        let mut r = super::super::store::tests::record("r");
        r.role = Role::Secondary;
        r.last_cycle = Some(CycleRecord {
            id: 10,
            ..Default::default()
        });
        assert!(handed_over(&r, Some(&applied(10, true))));
        assert!(!handed_over(&r, Some(&applied(10, false))), "not final");
        assert!(!handed_over(&r, None), "nothing applied here");
        // This side shipped cycle 21 as primary, then demoted itself: the final cycle it
        // applied long ago (10) hands nothing over now.
        r.last_cycle = Some(CycleRecord {
            id: 21,
            r#final: true,
            ..Default::default()
        });
        assert!(!handed_over(&r, Some(&applied(10, true))));
        r.role = Role::Primary;
        assert!(!handed_over(&r, Some(&applied(21, true))), "a primary");
    }

    fn cycle(id: u64) -> AppliedCycle {
        AppliedCycle {
            version: RECORD_VERSION,
            relationship: "r".into(),
            id,
            root: "00".into(),
            point_in_time_ms: 5,
            epoch: 1,
            r#final: false,
            consistency: "point-in-time".into(),
            applied_ms: 0,
            dirty: Vec::new(),
        }
    }

    #[test]
    fn a_committed_journal_is_applied_and_an_uncommitted_one_dropped() {
        let state = tempfile::tempdir().unwrap();
        let img = state.path().join("vol.img");
        fs::write(&img, vec![1u8; 64 << 10]).unwrap();

        // Uncommitted: nothing reaches the volume.
        let dir = cycles_dir(state.path(), "r");
        let mut j = Journal::create(&dir).unwrap();
        j.data(4096, &[9; 4096]).unwrap();
        drop(j);
        assert!(recover(state.path()).is_empty());
        assert!(!dir.join("journal").exists(), "dropped");
        assert_eq!(fs::read(&img).unwrap(), vec![1u8; 64 << 10]);
        assert_eq!(applied(&dir), None);

        // Committed: applied by recovery, twice over if need be (idempotent).
        let mut j = Journal::create(&dir).unwrap();
        j.data(4096, &[9; 4096]).unwrap();
        j.zeros(32 << 10, 8192).unwrap();
        j.commit(cycle(7), &img).unwrap();
        let commit = fs::read(dir.join("commit.json")).unwrap();
        let journal = fs::read(dir.join("journal")).unwrap();
        let r = recover(state.path());
        assert_eq!(r.len(), 1);
        assert_eq!(r[0].1.as_ref().unwrap().id, 7);
        let mut want = vec![1u8; 64 << 10];
        want[4096..8192].fill(9);
        want[32 << 10..40 << 10].fill(0);
        assert_eq!(fs::read(&img).unwrap(), want);
        assert_eq!(applied(&dir).unwrap().id, 7);
        // A crash after the apply but before the commit record was removed.
        fs::write(dir.join("commit.json"), commit).unwrap();
        fs::write(dir.join("journal"), journal).unwrap();
        recover(state.path());
        assert_eq!(fs::read(&img).unwrap(), want);
        assert!(!dir.join("commit.json").exists() && !dir.join("journal").exists());
    }

    #[test]
    fn a_commit_answered_before_its_fsync_reads_as_the_cycle_and_settles() {
        let state = tempfile::tempdir().unwrap();
        let img = state.path().join("vol.img");
        fs::write(&img, vec![1u8; 64 << 10]).unwrap();
        let dir = cycles_dir(state.path(), "r");
        record_applied(&dir, &cycle(6)).unwrap();
        let mut j = Journal::create(&dir).unwrap();
        j.data(0, &[7; 4096]).unwrap();
        let dir = j.commit(cycle(7), &img).unwrap();
        let done = apply_then_sync_in_background(&dir).unwrap();
        assert_eq!(done.id, 7);
        // The volume reads as the cycle at once.
        assert_eq!(fs::read(&img).unwrap()[..4096], [7; 4096]);
        // Whoever reads the records waits for the background's fsync and records.
        assert_eq!(applied(&dir).unwrap().id, 7);
        assert!(!dir.join("commit.json").exists() && !dir.join("journal").exists());
        // The next cycle starts from there; a second apply finds nothing left to do.
        assert_eq!(apply(&dir).unwrap().id, 7);
        let mut j = Journal::create(&dir).unwrap();
        j.data(4096, &[8; 4096]).unwrap();
        let dir = j.commit(cycle(8), &img).unwrap();
        apply_then_sync_in_background(&dir).unwrap();
        // A new journal waits for the last one to be settled, not to be removed by it.
        let next = Journal::create(&dir).unwrap();
        assert_eq!(applied(&dir).unwrap().id, 8);
        assert!(dir.join("journal").exists() && !dir.join("commit.json").exists());
        drop(next);
        assert_eq!(fs::read(&img).unwrap()[4096..8192], [8; 4096]);
    }

    #[test]
    fn a_truncated_journal_is_refused_not_half_applied() {
        let state = tempfile::tempdir().unwrap();
        let img = state.path().join("vol.img");
        fs::write(&img, vec![1u8; 16 << 10]).unwrap();
        let dir = cycles_dir(state.path(), "r");
        let mut j = Journal::create(&dir).unwrap();
        j.data(0, &[9; 8192]).unwrap();
        j.commit(cycle(1), &img).unwrap();
        let f = OpenOptions::new()
            .write(true)
            .open(dir.join("journal"))
            .unwrap();
        f.set_len(100).unwrap();
        let e = apply(&dir).unwrap_err().to_string();
        assert!(e.contains("shorter than its commit record"), "{e}");
        assert_eq!(fs::read(&img).unwrap(), vec![1u8; 16 << 10]);
    }
}
