//! Points in time of a replica, held for the readers that fill a volume from it.
//!
//! A secondary goes on applying cycles while a PVC populated from it fills, for minutes
//! or hours. A fill that read the replica as it changed would mix two cycles in one
//! volume. A hold keeps the cycle applied when it was taken readable: before a cycle's
//! journal overwrites a range of the volume, the bytes there are copied once into the
//! hold's undo file, and a read through the hold takes that range from there (the
//! origin of a dm-snapshot does the same for a block device). Replication is not held
//! back; the undo file grows by what the cycles change while the hold lasts.
//!
//! Holds live in the agent's memory, keyed by the volume's path: a restart ends them
//! (their undo files are removed at start). A reader that comes back then is refused
//! unless the replica is still at the cycle it was reading.

use std::{
    collections::{BTreeMap, HashMap},
    fs::{self, File},
    io,
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    sync::{Arc, LazyLock, Mutex, MutexGuard},
    time::{Duration, Instant},
};

/// A hold no reader has read through for this long is ended: its reader is gone, or
/// will be refused when it comes back (unless the replica has not moved on).
pub const IDLE: Duration = Duration::from_secs(15 * 60);
/// Holds on one volume at most: each may keep up to the volume's size in its undo file.
pub const MAX_PER_VOLUME: usize = 8;

/// The holds of every volume (by canonical path), and the volumes no hold may be taken
/// on until their next cycle is applied, with why.
#[derive(Default)]
struct Registry {
    holds: HashMap<PathBuf, Vec<Arc<Hold>>>,
    closed: HashMap<PathBuf, String>,
}

static REGISTRY: LazyLock<Mutex<Registry>> = LazyLock::new(Default::default);

/// Locks `m` even if a panic poisoned it: a hold's state stays consistent at each
/// step, and the cycles' apply path must never panic for it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One held point in time of a replica.
pub struct Hold {
    /// Who holds it (the reader's identity and its name for the hold).
    pub key: String,
    /// The cycle held.
    pub cycle: u64,
    /// The held cycle's point in time (Unix ms).
    pub point_in_time_ms: i64,
    volume: PathBuf,
    undo_path: PathBuf,
    state: Mutex<State>,
}

struct State {
    /// None once ended: the file is closed as well as removed, so its room is freed
    /// even while a session still refers to the hold.
    undo: Option<File>,
    undo_len: u64,
    /// Ranges of the volume overwritten since the hold was taken, by start: their held
    /// bytes, in the undo file (`None`: they were zeros).
    saved: BTreeMap<u64, Saved>,
    /// Why reads through it are refused (released, ended by a promote, ...).
    ended: Option<String>,
    last_used: Instant,
}

#[derive(Clone, Copy, Debug)]
struct Saved {
    end: u64,
    at: Option<u64>,
}

/// Why a hold cannot be taken or read.
#[derive(Debug, thiserror::Error)]
pub enum HoldError {
    /// The replica is not (or no longer) at the point in time asked for.
    #[error("{0}")]
    Moved(String),
    /// The hold was ended; the reason says by what.
    #[error("{0}")]
    Ended(String),
    /// Its undo file or the volume failed.
    #[error("{0}")]
    Io(#[from] io::Error),
}

/// The registry's key for `volume` (what [`preserve`] is called with): its canonical
/// path, so that a journal's and an export's paths of one file meet.
pub(crate) fn key_of(volume: &Path) -> PathBuf {
    fs::canonicalize(volume).unwrap_or_else(|_| volume.to_path_buf())
}

/// The hold `key` on `volume`, taken now if there is none: at the cycle last applied
/// from the journals in `cycles_dir` (an apply under way finishes first, and none
/// starts while it is taken). `expected`: the cycle its reader read before (it came
/// back); refused if the replica is no longer at it. Without it, a hold of the same
/// key is replaced (a reader starting over). The undo file goes in `undo_dir`.
pub fn take(
    key: &str,
    volume: &Path,
    cycles_dir: &Path,
    undo_dir: &Path,
    expected: Option<u64>,
) -> Result<Arc<Hold>, HoldError> {
    static SWEEPER: std::sync::Once = std::sync::Once::new();
    SWEEPER.call_once(|| {
        std::thread::spawn(|| {
            loop {
                std::thread::sleep(Duration::from_secs(60));
                sweep();
            }
        });
    });
    super::journal::watch_applies(watch);
    let volume = key_of(volume);
    if let Some(h) = find(&volume, key) {
        match expected {
            Some(c) if c == h.cycle => return Ok(h),
            Some(c) => {
                return Err(HoldError::Moved(format!(
                    "the hold {key:?} is at cycle {}, not at cycle {c}",
                    h.cycle
                )));
            }
            None => end(&h, "its reader started over".into()),
        }
    }
    fs::create_dir_all(undo_dir)?;
    // Taken under the journal's lock (then the registry's: the order an apply takes
    // them in), so that no cycle is half applied when it is.
    let taken = super::journal::at_applied_cycle(cycles_dir, |applied| {
        let Some(a) = applied else {
            return Err(HoldError::Moved(
                "no cycle has been applied to this replica yet: it is no point in time of its \
                 primary; wait for its first cycle"
                    .into(),
            ));
        };
        if !a.dirty.is_empty() {
            return Err(HoldError::Moved(format!(
                "this replica was written here after its cycle {} (a former primary that \
                 diverged): it is no point in time until it is resynced",
                a.id
            )));
        }
        if let Some(c) = expected.filter(|&c| c != a.id) {
            return Err(HoldError::Moved(format!(
                "the replica was at cycle {c} when this reader began and is at cycle {} now, \
                 and the hold on cycle {c} is gone (the agent restarted, the hold was idle \
                 for {} min, or the replica was promoted or rewritten): the data read so far \
                 and what is left are two points in time. Start the fill again from the \
                 beginning",
                a.id,
                IDLE.as_secs() / 60
            )));
        }
        let mut r = lock(&REGISTRY);
        if let Some(why) = r.closed.get(&volume) {
            return Err(HoldError::Moved(format!(
                "no hold is taken on this replica until its next cycle is applied: {why}"
            )));
        }
        let held = r.holds.entry(volume.clone()).or_default();
        if let Some(h) = held.iter().find(|h| h.key == key) {
            return Ok(h.clone());
        }
        if held.len() >= MAX_PER_VOLUME {
            return Err(HoldError::Moved(format!(
                "this replica already has {MAX_PER_VOLUME} holds (each may keep up to its \
                 size): wait until a fill from it completes"
            )));
        }
        let undo_path = undo_dir.join(format!(
            "{}.undo",
            mover_engine::node::name_hash(&format!("{}\0{key}", volume.display()))
        ));
        let undo = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&undo_path)?;
        let h = Arc::new(Hold {
            key: key.into(),
            cycle: a.id,
            point_in_time_ms: a.point_in_time_ms,
            volume: volume.clone(),
            undo_path,
            state: Mutex::new(State {
                undo: Some(undo),
                undo_len: 0,
                saved: BTreeMap::new(),
                ended: None,
                last_used: Instant::now(),
            }),
        });
        held.push(h.clone());
        tracing::info!(volume = %volume.display(), hold = key, cycle = a.id, "replica held at a cycle for its reader");
        Ok(h)
    });
    taken.map_err(HoldError::Io)?
}

fn find(volume: &Path, key: &str) -> Option<Arc<Hold>> {
    lock(&REGISTRY)
        .holds
        .get(volume)?
        .iter()
        .find(|h| h.key == key)
        .cloned()
}

/// What keeps the holds on `volume` readable through an apply onto it; `None` when it
/// has none (no hold can be taken while an apply runs: `take` waits for it).
fn watch(volume: &Path) -> Option<super::journal::Keep> {
    let key = key_of(volume);
    lock(&REGISTRY).holds.get(&key).filter(|v| !v.is_empty())?;
    Some(Box::new(move |file, offset, len| {
        preserve(&key, file, offset, len)
    }))
}

/// Keeps what the holds on `volume` read in `offset .. offset + len` before a cycle
/// overwrites it through `file`. A hold that cannot keep it (a full disk) is ended,
/// so its reader fails instead of reading the new bytes; the cycle goes on.
fn preserve(volume: &Path, file: &File, offset: u64, len: u64) {
    let holds: Vec<Arc<Hold>> = match lock(&REGISTRY).holds.get(volume) {
        Some(v) if !v.is_empty() => v.clone(),
        _ => return,
    };
    for h in holds {
        if let Err(e) = h.save(file, offset, len) {
            tracing::error!(volume = %volume.display(), hold = %h.key, cycle = h.cycle, "hold ended: cannot keep what a newer cycle overwrites: {e}");
            end(
                &h,
                format!(
                    "the hold on cycle {} could not keep the data a newer cycle overwrote ({e})",
                    h.cycle
                ),
            );
        }
    }
}

/// Ends the hold `key` on `volume` (its reader is done).
pub fn release(volume: &Path, key: &str) -> bool {
    match find(&key_of(volume), key) {
        Some(h) => {
            end(&h, "the hold was released by its reader".into());
            true
        }
        None => false,
    }
}

/// Ends every hold on `volume` and refuses new ones until [`reopen`], saying `why` to
/// their readers: it is about to change other than by a cycle's journal (a promote, a
/// resync, a copy into it, a deletion).
pub fn end_all(volume: &Path, why: &str) {
    let volume = key_of(volume);
    let holds = {
        let mut r = lock(&REGISTRY);
        r.closed.insert(volume.clone(), why.to_string());
        r.holds.remove(&volume).unwrap_or_default()
    };
    for h in holds {
        tracing::warn!(volume = %volume.display(), hold = %h.key, cycle = h.cycle, "hold ended: {why}");
        end(&h, why.into());
    }
}

/// `volume` equals a cycle again (one was applied and recorded): holds may be taken.
pub fn reopen(volume: &Path) {
    lock(&REGISTRY).closed.remove(&key_of(volume));
}

/// Removes the undo files a previous run left (its holds ended with it).
pub fn clear_leftovers(undo_dir: &Path) {
    if let Ok(entries) = fs::read_dir(undo_dir) {
        for e in entries.flatten() {
            _ = fs::remove_file(e.path());
        }
    }
}

fn end(h: &Arc<Hold>, why: String) {
    {
        let mut s = lock(&h.state);
        if s.ended.is_none() {
            s.ended = Some(why);
        }
        s.saved.clear();
        s.undo = None;
    }
    _ = fs::remove_file(&h.undo_path);
    let mut r = lock(&REGISTRY);
    if let Some(v) = r.holds.get_mut(&h.volume) {
        v.retain(|x| !Arc::ptr_eq(x, h));
        if v.is_empty() {
            r.holds.remove(&h.volume);
        }
    }
}

/// Ends the holds no reader has read through for [`IDLE`].
fn sweep() {
    let all: Vec<Arc<Hold>> = lock(&REGISTRY).holds.values().flatten().cloned().collect();
    for h in all {
        if lock(&h.state).last_used.elapsed() > IDLE {
            tracing::info!(hold = %h.key, cycle = h.cycle, "hold ended: idle");
            end(
                &h,
                format!("the hold was idle for {} min", IDLE.as_secs() / 60),
            );
        }
    }
}

impl Hold {
    /// Copies the bytes of `offset .. offset + len` not yet kept into the undo file.
    fn save(&self, file: &File, offset: u64, len: u64) -> io::Result<()> {
        let mut s = lock(&self.state);
        let State {
            undo: Some(undo),
            undo_len,
            saved,
            ..
        } = &mut *s
        else {
            return Ok(()); // ended
        };
        let mut buf = Vec::new();
        for (start, end) in gaps(saved, offset, offset + len) {
            let mut at = start;
            while at < end {
                // A hole (a trim's punched range, say) is known to be zeros unread.
                let data = data_from(file, at).unwrap_or(end).min(end);
                if data > at {
                    saved.insert(
                        at,
                        Saved {
                            end: data,
                            at: None,
                        },
                    );
                    at = data;
                    continue;
                }
                // In pieces of at most 8 MiB: a cycle's zero run may cover gigabytes.
                let stop = match hole_from(file, at).min(end) {
                    h if h > at => h,
                    _ => end,
                };
                let n = (stop - at).min(8 << 20);
                buf.resize(n as usize, 0);
                let got = chunker::direct::read_full(file, &mut buf, at)?;
                buf[got..].fill(0); // past the end of the volume: zeros
                let entry = if buf.iter().all(|&b| b == 0) {
                    Saved {
                        end: at + n,
                        at: None,
                    }
                } else {
                    undo.write_all_at(&buf, *undo_len)?;
                    *undo_len += n;
                    Saved {
                        end: at + n,
                        at: Some(*undo_len - n),
                    }
                };
                saved.insert(at, entry);
                at += n;
            }
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes of the held point in time at `offset`: from the undo
    /// file where a newer cycle overwrote them, else from the volume (`file`).
    pub fn read_at(&self, file: &File, buf: &mut [u8], offset: u64) -> Result<(), HoldError> {
        let mut s = lock(&self.state);
        let ended = |why: &str| {
            HoldError::Ended(format!(
                "the replica's cycle {} is no longer held: {why}",
                self.cycle
            ))
        };
        if let Some(why) = &s.ended {
            return Err(ended(why));
        }
        s.last_used = Instant::now();
        let Some(undo) = &s.undo else {
            return Err(ended("its undo file is gone"));
        };
        let end = offset + buf.len() as u64;
        let mut at = offset;
        for (start, e) in overlapping(&s.saved, offset, end) {
            if start > at {
                file.read_exact_at(
                    &mut buf[(at - offset) as usize..(start - offset) as usize],
                    at,
                )?;
                at = start;
            }
            let upto = e.end.min(end);
            let part = &mut buf[(at - offset) as usize..(upto - offset) as usize];
            match e.at {
                Some(pos) => undo.read_exact_at(part, pos + (at - start))?,
                None => part.fill(0),
            }
            at = upto;
        }
        if at < end {
            file.read_exact_at(&mut buf[(at - offset) as usize..], at)?;
        }
        Ok(())
    }

    /// The ranges newer cycles overwrote: they may hold the held point's data even
    /// where the volume has a hole now.
    pub fn overwritten(&self) -> Vec<(u64, u64)> {
        let s = lock(&self.state);
        s.saved
            .iter()
            .filter(|(_, e)| e.at.is_some())
            .map(|(&start, e)| (start, e.end))
            .collect()
    }

    /// Whether it was ended (its readers are refused).
    pub fn is_ended(&self) -> bool {
        lock(&self.state).ended.is_some()
    }

    /// Bytes kept in its undo file.
    pub fn kept_bytes(&self) -> u64 {
        lock(&self.state).undo_len
    }
}

/// Where data starts at or after `at` (None: only a hole follows). A device, or a file
/// system without SEEK_DATA, has data everywhere.
fn data_from(file: &File, at: u64) -> Option<u64> {
    match rustix::fs::seek(file, rustix::fs::SeekFrom::Data(at)) {
        Ok(d) => Some(d),
        Err(rustix::io::Errno::NXIO) => None,
        Err(_) => Some(at),
    }
}

/// Where the hole after the data at `at` starts (u64::MAX: not known).
fn hole_from(file: &File, at: u64) -> u64 {
    rustix::fs::seek(file, rustix::fs::SeekFrom::Hole(at)).unwrap_or(u64::MAX)
}

/// The saved entries that overlap `start .. end`, in order (entries never overlap).
fn overlapping(saved: &BTreeMap<u64, Saved>, start: u64, end: u64) -> Vec<(u64, Saved)> {
    let before = saved
        .range(..start)
        .next_back()
        .filter(|(_, e)| e.end > start)
        .map(|(&s, &e)| (s, e));
    before
        .into_iter()
        .chain(saved.range(start..end).map(|(&s, &e)| (s, e)))
        .collect()
}

/// The parts of `start .. end` no saved entry covers.
fn gaps(saved: &BTreeMap<u64, Saved>, start: u64, end: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = start;
    for (s, e) in overlapping(saved, start, end) {
        if s > at {
            out.push((at, s));
        }
        at = at.max(e.end);
    }
    if at < end {
        out.push((at, end));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved(entries: &[(u64, u64)]) -> BTreeMap<u64, Saved> {
        entries
            .iter()
            .map(|&(s, e)| (s, Saved { end: e, at: None }))
            .collect()
    }

    #[test]
    fn gaps_are_what_no_entry_covers() {
        let m = saved(&[(10, 20), (30, 40)]);
        assert_eq!(gaps(&m, 0, 50), [(0, 10), (20, 30), (40, 50)]);
        assert_eq!(gaps(&m, 15, 35), [(20, 30)]);
        assert_eq!(gaps(&m, 12, 18), []);
        assert_eq!(gaps(&m, 40, 45), [(40, 45)]);
        assert_eq!(gaps(&BTreeMap::new(), 5, 6), [(5, 6)]);
    }

    #[test]
    fn a_hold_reads_its_cycle_while_newer_cycles_overwrite_the_volume() {
        let t = tempfile::tempdir().unwrap();
        let (volume, cycles) = (t.path().join("replica.img"), t.path().join("cycles"));
        fs::create_dir_all(&cycles).unwrap();
        let len = 64 << 10;
        let held: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        let mut at_hold = held.clone();
        at_hold[40 << 10..48 << 10].fill(0); // a hole that a newer cycle fills
        fs::write(&volume, &at_hold).unwrap();
        let cycle = super::super::journal::AppliedCycle {
            version: super::super::journal::RECORD_VERSION,
            relationship: "r".into(),
            id: 7,
            root: String::new(),
            point_in_time_ms: 1,
            epoch: 1,
            r#final: false,
            consistency: "crash-inconsistent".into(),
            applied_ms: 1,
            dirty: vec![],
        };
        super::super::journal::record_applied(&cycles, &cycle).unwrap();
        let undo = t.path().join("holds");
        let h = take("reader-1", &volume, &cycles, &undo, None).unwrap();
        assert_eq!(h.cycle, 7);
        assert!(matches!(
            take("reader-1", &volume, &cycles, &undo, Some(6)),
            Err(HoldError::Moved(_))
        ));

        // Two newer cycles, as a journal writes them: kept first, then overwritten.
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&volume)
            .unwrap();
        let key = key_of(&volume);
        for (off, n, byte) in [
            (4096u64, 8192u64, 0xAAu8),
            (6144, 32 << 10, 0xBB),
            (40 << 10, 8 << 10, 0xCC),
        ] {
            preserve(&key, &file, off, n);
            file.write_all_at(&vec![byte; n as usize], off).unwrap();
        }
        let mut view = vec![0u8; len];
        h.read_at(&file, &mut view, 0).unwrap();
        assert!(view == at_hold, "the hold reads cycle 7 whole");
        let mut part = vec![0u8; 10_000];
        h.read_at(&file, &mut part, 5000).unwrap();
        assert!(part[..] == at_hold[5000..15_000]);
        // The zeros of the filled hole took no room; the rest was kept once.
        assert_eq!(h.kept_bytes(), (6144 + (32 << 10)) - 4096);
        assert!(
            h.overwritten()
                .iter()
                .all(|&(s, e)| e <= (40 << 10) || s >= 48 << 10),
            "{:?}",
            h.overwritten()
        );

        // A second reader's hold is taken at the volume as it is now.
        assert!(release(&volume, "reader-1"));
        let err = h.read_at(&file, &mut part, 0).unwrap_err().to_string();
        assert!(
            err.contains("no longer held") && err.contains("released"),
            "{err}"
        );
        assert!(
            !lock(&REGISTRY).holds.contains_key(&key_of(&volume)),
            "none left"
        );
        assert_eq!(
            fs::read_dir(&undo).unwrap().count(),
            0,
            "its undo file went"
        );

        let h2 = take("reader-2", &volume, &cycles, &undo, None).unwrap();
        end_all(&volume, "the replica was promoted");
        let err = h2.read_at(&file, &mut part, 0).unwrap_err().to_string();
        assert!(err.contains("promoted"), "{err}");
        assert!(h2.is_ended());
        // No new hold until the volume equals a cycle again.
        let refused = take("reader-3", &volume, &cycles, &undo, None)
            .err()
            .unwrap()
            .to_string();
        assert!(
            refused.contains("until its next cycle is applied"),
            "{refused}"
        );
        reopen(&volume);
        let h3 = take("reader-3", &volume, &cycles, &undo, None).unwrap();
        // The same reader starting over (no cycle given) replaces its hold.
        let h4 = take("reader-3", &volume, &cycles, &undo, None).unwrap();
        assert!(h3.is_ended() && !h4.is_ended());
        release(&volume, "reader-3");
    }
}
