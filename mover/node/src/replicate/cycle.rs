//! One replication cycle on the primary: a point in time of the source, the pages that
//! differ from the secondary, shipped and committed there as one atomic cycle.

use super::base;
use super::{
    now_ms,
    store::{CycleRecord, Record},
};
use chunker::{ChunkId, ChunkSize, extents};
use mover_engine::{
    CopyOptions, Progress,
    error::{CopyError, RemoteCode},
    node::{
        freeze::{self, Frozen, check_freeze},
        holders,
    },
    remote::{AgentUrl, CyclePush, RemoteOptions, push_cycle, push_tree_cycle},
};
use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};
use transport::proto;

/// How long a filesystem may stay frozen while a clone is taken: past that the watchdog
/// thaws it and the cycle fails (applications must not hang). A freeze brackets only the
/// taking of a point in time, never a read of the volume.
const FREEZE_FOR_CLONE: Duration = Duration::from_secs(10);

pub use mover_engine::node::point_in_time::{CRASH_INCONSISTENT, FILE_CONSISTENT, POINT_IN_TIME};

/// A point in time of the source: the base's clone brought up to date, a fresh reflink
/// clone (removed when dropped), or the live volume (crash-inconsistent).
struct PointInTime {
    read: PathBuf,
    clone: Option<PathBuf>,
    /// `read` is the base's clone, caught up with the image.
    caught_up: bool,
    at_ms: i64,
    consistency: &'static str,
    /// How long taking it held the volume's writers back, in ms.
    held_ms: u64,
}

impl Drop for PointInTime {
    fn drop(&mut self) {
        if let Some(c) = &self.clone {
            let _ = std::fs::remove_file(c);
        }
    }
}

/// Where the clone of `source` for relationship `name` is made: beside the image (a
/// reflink needs the same filesystem), hidden.
fn clone_path(source: &Path, name: &str) -> PathBuf {
    source.with_file_name(base::hidden_name(source, name, "pit"))
}

fn take_point_in_time(
    source: &Path,
    name: &str,
    freeze: Option<&Path>,
    base: Option<&mut base::Base>,
) -> Result<PointInTime, CopyError> {
    // Unmounted since it was set (a workload stopped for a planned demote): nothing
    // writes through it, so there is nothing to freeze. Skipped, and said.
    let freeze = match freeze {
        Some(m) if !freeze::is_mount_point(m) => {
            tracing::warn!(
                relationship = name,
                mount = %m.display(),
                "the freeze target is not mounted now: nothing writes through it, freeze skipped"
            );
            None
        }
        f => f,
    };
    if let Some(m) = freeze {
        check_freeze(m, source).map_err(|why| CopyError::BadSource {
            path: m.into(),
            why,
        })?;
    }
    // After the check above: a freeze target no longer mounted is not frozen (freezing
    // the directory would freeze whatever file system holds it).
    let freeze_for = |max| {
        freeze
            .map(|m| freeze::freeze(m, max).map_err(|e| freeze_error(m, e)))
            .transpose()
    };
    let is_file = std::fs::metadata(source).is_ok_and(|m| m.is_file());
    if let Some(base) = base.filter(|_| is_file)
        && let Some(pit) = catch_up_still(source, name, freeze, base)?
    {
        return Ok(pit);
    }
    if is_file {
        let clone = clone_path(source, name);
        let held = Instant::now();
        let frozen = freeze_for(FREEZE_FOR_CLONE)?;
        let at_ms = now_ms();
        let cloned = extents::clone_fresh(source, &clone);
        let held_ms = log_hold(name, held, "fresh clone");
        match cloned {
            Ok(true) => {
                // Thawed by the watchdog before the clone was done: not a point in time.
                if let Some(Err(e)) = frozen.map(Frozen::thaw) {
                    let _ = std::fs::remove_file(&clone);
                    return Err(outlasted_freeze(source, "clone", e));
                }
                return Ok(PointInTime {
                    read: clone.clone(),
                    clone: Some(clone),
                    caught_up: false,
                    at_ms,
                    consistency: POINT_IN_TIME,
                    held_ms,
                });
            }
            Ok(false) => {}
            Err(e) => {
                return Err(CopyError::BadSource {
                    path: source.into(),
                    why: format!("cannot clone it for a point in time: {e}"),
                });
            }
        }
    }
    // No reflinks: the live volume. A freeze held for the whole read would stall the
    // application for as long as the read takes, so none is: the cycle is what it is.
    Ok(PointInTime {
        read: source.into(),
        clone: None,
        caught_up: false,
        consistency: CRASH_INCONSISTENT,
        at_ms: now_ms(),
        held_ms: 0,
    })
}

/// The base's clone brought up to date with the image `source`, if that can be one
/// instant: a catch-up reclones range by range, so nothing may write into the image
/// from its comparison to its last reclone. It runs only with every writer held back:
/// the relationship's freeze, or else the file systems mounted from the loop devices
/// over the image when those are its only writers ([`holders::sole_writers`]). And it
/// is kept only if the image's ctime, which any write moves, did not move meanwhile.
/// `None`: no such hold, or the catch-up could not be made or kept; then a fresh clone,
/// which the file system takes under one lock, is the point in time.
///
/// The writers are held back only for the last of two passes: the first, while they
/// write, reclones what changed since the last cycle (most of the work: a remap per
/// changed range, and the flush of the image's dirty pages); the second, frozen, finds
/// and reclones only what was written during the first.
fn catch_up_still(
    source: &Path,
    name: &str,
    freeze: Option<&Path>,
    base: &mut base::Base,
) -> Result<Option<PointInTime>, CopyError> {
    let mounts = match freeze {
        Some(m) => vec![m.to_path_buf()],
        None => match holders::sole_writers(source) {
            Ok(Some(mounts)) => mounts,
            Ok(None) => return Ok(None),
            Err(e) => {
                tracing::debug!(relationship = name, "cannot tell the image's writers: {e}");
                return Ok(None);
            }
        },
    };
    // The first pass, unfrozen: whatever it leaves out, the second finds (it compares the
    // whole extent maps again), and what it recloned is recorded as pending first.
    let ahead = Instant::now();
    match base.catch_up(source, name) {
        Ok(_) => tracing::debug!(
            relationship = name,
            "clone caught up ahead of the freeze in {:.1} ms",
            ahead.elapsed().as_secs_f64() * 1000.0
        ),
        Err(e) => tracing::debug!(
            relationship = name,
            "cannot catch up ahead of the freeze: {e}"
        ),
    }
    mover_engine::node::pause("ahead-of-freeze");
    let held = Instant::now();
    let mut frozen = Vec::with_capacity(mounts.len());
    for m in &mounts {
        match freeze::freeze(m, FREEZE_FOR_CLONE) {
            Ok(f) => frozen.push(f),
            Err(e) if freeze.is_some() => {
                let _ = thaw_all(frozen);
                return Err(freeze_error(m, e));
            }
            Err(e) => {
                let _ = thaw_all(frozen);
                tracing::info!(relationship = name, mount = %m.display(), "cannot freeze the file system on the image ({e}): taking a fresh clone");
                return Ok(None);
            }
        }
    }
    let written = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(source).map(|m| (m.ctime(), m.ctime_nsec(), m.size()))
    };
    let before = written();
    let at_ms = now_ms();
    let caught_up = base.catch_up(source, name);
    let still = before.is_ok() && written().ok() == before.as_ref().ok().copied();
    let thawed = thaw_all(frozen);
    let held_ms = log_hold(name, held, "catch-up under freeze");
    if let Err(e) = thawed {
        return Err(outlasted_freeze(source, "catch-up", e));
    }
    match caught_up {
        Ok(true) if still => Ok(Some(PointInTime {
            read: base.clone_file().into(),
            clone: None,
            caught_up: true,
            at_ms,
            consistency: POINT_IN_TIME,
            held_ms,
        })),
        // The ranges recloned are recorded as pending: the fresh clone's comparison with
        // the base stays right.
        Ok(true) => {
            tracing::warn!(
                relationship = name,
                "the image was written while its clone caught up, though frozen: taking a fresh clone"
            );
            Ok(None)
        }
        // No extent maps.
        Ok(false) => Ok(None),
        Err(e) => {
            tracing::warn!(
                relationship = name,
                "cannot bring the last cycle's clone up to date: {e}; taking a fresh clone"
            );
            Ok(None)
        }
    }
}

/// The cycle `record` ships next to `peer`: at `point_in_time_ms`, of `consistency`;
/// `last` marks a demote's final cycle.
fn next_cycle(
    record: &Record,
    peer: &AgentUrl,
    point_in_time_ms: i64,
    consistency: &str,
    last: bool,
) -> proto::Cycle {
    proto::Cycle {
        id: record.next_cycle(),
        point_in_time_ms,
        consistency: consistency.into(),
        r#final: last,
        primary: record.this_side.clone(),
        secondary: peer.to_string(),
        interval_ms: record.spec.interval_ms,
        bwlimit: record.spec.bwlimit,
    }
}

/// When a cycle began: the wall clock for its record, a steady clock for its duration.
#[derive(Clone, Copy)]
struct Began {
    ms: i64,
    at: Instant,
}

/// A cycle begins: where `record`'s secondary is now (a peer cluster's Locator may have
/// moved it), and when.
async fn begin(record: &Record, remote: &RemoteOptions) -> Result<(AgentUrl, Began), CopyError> {
    let peer = mover_engine::remote::locate(&record.spec.peer, &record.spec.name, remote).await?;
    let began = Began {
        ms: now_ms(),
        at: Instant::now(),
    };
    Ok((peer, began))
}

/// What the primary records of `cycle` once the secondary committed it: when it
/// `began`, what it read and shipped, its root and the CSI snapshot it read.
fn shipped(
    cycle: &proto::Cycle,
    began: Began,
    (bytes_read, bytes_shipped): (u64, u64),
    root: String,
    snapshot: String,
) -> CycleRecord {
    CycleRecord {
        id: cycle.id,
        point_in_time_ms: cycle.point_in_time_ms,
        started_ms: began.ms,
        duration_ms: began.at.elapsed().as_millis() as u64,
        bytes_read,
        bytes_shipped,
        root,
        r#final: cycle.r#final,
        consistency: cycle.consistency.clone(),
        snapshot,
        // The caller that took the point in time says how long it held writers.
        writers_held_ms: 0,
    }
}

/// Says how long taking a point in time held the volume's writers back (a freeze, or
/// the image's lock that a whole-file clone holds): what bench/pit-cost.sh reads.
/// Returns it in ms, rounded up (0 stays for no hold at all), for the cycle's record.
fn log_hold(name: &str, since: Instant, how: &str) -> u64 {
    let ms = since.elapsed().as_secs_f64() * 1000.0;
    tracing::debug!(
        relationship = name,
        "held writers back for {ms:.1} ms ({how})"
    );
    ms.ceil() as u64
}

/// The error of a point in time (`what`: the clone, the catch-up) that the freeze's
/// watchdog cut short: not one instant.
fn outlasted_freeze(source: &Path, what: &str, e: std::io::Error) -> CopyError {
    CopyError::BadSource {
        path: source.into(),
        why: format!("the {what} outlasted the freeze ({e}); the next cycle tries again"),
    }
}

/// The error of a relationship's freeze that failed.
fn freeze_error(mount: &Path, e: std::io::Error) -> CopyError {
    CopyError::BadSource {
        path: mount.into(),
        why: format!(
            "cannot freeze the filesystem mounted there ({e}); fix the relationship's \
             freeze setting or drop it"
        ),
    }
}

/// Thaws every file system in `frozen`; the first error, if any (all are thawed).
fn thaw_all(frozen: Vec<Frozen>) -> std::io::Result<()> {
    frozen
        .into_iter()
        .map(Frozen::thaw)
        .fold(Ok(()), std::io::Result::and)
}

/// The error of a cycle that a relationship requiring a point in time must not ship:
/// what was missing, and the two ways out.
fn no_point_in_time(source: &Path, what: &str) -> CopyError {
    CopyError::NoPointInTime {
        path: source.into(),
        what: what.into(),
    }
}

/// A cycle of a file tree: the tree copied into the secondary's, deleting what is gone
/// there; only files whose size or modification time differ are sent (by chunk). The
/// point in time is the cycle's start: no file was read before it.
async fn run_tree(
    record: &Record,
    source: &Path,
    peer: &AgentUrl,
    began: Began,
    remote: &RemoteOptions,
    last: bool,
) -> Result<CycleRecord, CopyError> {
    let spec = &record.spec;
    if spec.require_point_in_time {
        return Err(no_point_in_time(
            source,
            "a file tree is read file by file, each file as it was when read",
        ));
    }
    let cycle = next_cycle(record, peer, began.ms, FILE_CONSISTENT, last);
    let mut remote = remote.clone();
    remote.relationship = Some(spec.name.clone());
    remote.epoch = record.epoch;
    remote.bwlimit = (spec.bwlimit > 0).then_some(spec.bwlimit);
    let options = mover_engine::TreeOptions {
        delete: true,
        ..Default::default()
    };
    let (summary, sent) = push_tree_cycle(source, peer, &options, &remote, &cycle).await?;
    if summary.changed_while_read > 0 {
        tracing::info!(relationship = %spec.name, files = summary.changed_while_read, "files changed while they were read: each is on the secondary as read");
    }
    Ok(shipped(
        &cycle,
        began,
        (sent, sent),
        String::new(),
        String::new(),
    ))
}

/// Pushes the cycle `push` of `record` read from `read` to `peer`; a secondary that no
/// longer holds the base cycle gets every chunk compared instead. Returns the summary
/// and the chunk ids, as [`push_cycle`].
async fn ship(
    record: &Record,
    read: &Path,
    peer: &AgentUrl,
    remote: &RemoteOptions,
    mut push: CyclePush<'_>,
    progress: &dyn Progress,
) -> Result<(mover_engine::CopySummary, Vec<u8>), CopyError> {
    let spec = &record.spec;
    let copy = CopyOptions {
        chunk_size: ChunkSize::new(spec.chunk_size).map_err(CopyError::from)?,
        ..Default::default()
    };
    let mut remote = remote.clone();
    remote.relationship = Some(spec.name.clone());
    remote.epoch = record.epoch;
    remote.bwlimit = (spec.bwlimit > 0).then_some(spec.bwlimit);
    match push_cycle(read, peer, &copy, &remote, &push, progress).await {
        Err(CopyError::Remote {
            code: RemoteCode::StaleBase,
            message,
            ..
        }) => {
            tracing::warn!(relationship = %spec.name, "{message}: comparing every chunk");
            push.base = None;
            push_cycle(read, peer, &copy, &remote, &push, progress).await
        }
        r => r,
    }
}

/// A cycle's point in time taken by the controller: a clone of a CSI VolumeSnapshot,
/// exported on this node, and what changed since the last cycle's snapshot.
#[derive(Clone, Debug)]
pub struct SnapshotRead {
    /// The clone's device.
    pub path: PathBuf,
    /// The snapshot's CSI handle.
    pub snapshot: String,
    /// When it was taken (Unix ms).
    pub point_in_time_ms: i64,
    /// The handle of the snapshot `changed` is counted from.
    pub base_snapshot: String,
    /// The byte ranges that changed since `base_snapshot` (None: unknown, compare all).
    pub changed: Option<Vec<std::ops::Range<u64>>>,
    /// Where the chunk ids of the last committed cycle are kept between cycles (and,
    /// with extension `cvs`, the chunks' unit CVs).
    pub ids_file: PathBuf,
}

/// Runs one cycle of `record` from the snapshot clone `from`: only the chunks in its
/// changed ranges are read when the ids kept from the last cycle are of the base
/// snapshot, else every chunk is compared with the secondary's.
pub async fn run_from_snapshot(
    record: &Record,
    from: &SnapshotRead,
    remote: &RemoteOptions,
    last: bool,
    progress: &dyn Progress,
) -> Result<CycleRecord, CopyError> {
    let spec = &record.spec;
    let (peer, began) = begin(record, remote).await?;
    let chunk = ChunkSize::new(spec.chunk_size).map_err(CopyError::from)?;
    let size = chunker::BlockVolume::open(&from.path)
        .map_err(CopyError::from)?
        .size();
    // The kept ids count only if they are of the cycle that read the base snapshot.
    let base = match (&record.last_cycle, &from.changed) {
        (Some(last), Some(changed)) if last.snapshot == from.base_snapshot => {
            base::CycleIds::load(&from.ids_file, chunk, size)
                .filter(|ids| ids.cycle == last.id)
                .map(|ids| {
                    let known =
                        mover_engine::remote::KnownChunks::new(ids.kinds, changed.clone(), chunk);
                    (ids.cycle, ids.root, std::sync::Arc::new(known))
                })
        }
        _ => None,
    };
    if base.is_none() {
        tracing::info!(relationship = %spec.name, snapshot = %from.snapshot, "no changed blocks from the last cycle's snapshot: comparing every chunk");
    }
    let cycle = next_cycle(record, &peer, from.point_in_time_ms, POINT_IN_TIME, last);
    // The chunks' unit CVs, kept beside the ids: of a changed chunk only the pages the
    // driver names as changed are read (the CVs are checked against the ids when read).
    let cvs = chunker::cv::CvFile::open(
        &from.ids_file.with_extension("cvs"),
        &transport::relationship_key(&spec.name),
        chunk.bytes(),
    )
    .unwrap_or_else(|e| {
        tracing::warn!(relationship = %spec.name, "cannot open the CV file: {e}; changed chunks are read whole");
        None
    })
    .map(std::sync::Arc::new);
    let push = CyclePush {
        cycle: &cycle,
        base,
        cvs,
    };
    let (sum, ids) = ship(record, &from.path, &peer, remote, push, progress).await?;
    let root = sum.root.clone().unwrap_or_default();
    // Kept for the next cycle; without them it compares every chunk, nothing worse.
    let kept = match ChunkId::from_hex(&root) {
        Some(r) => base::CycleIds::save(&from.ids_file, cycle.id, &r, chunk, size, &ids),
        None => Err(std::io::Error::other(format!("bad cycle root {root:?}"))),
    };
    if let Err(e) = kept {
        tracing::warn!(relationship = %spec.name, "cannot keep the cycle's chunk ids: {e}; the next cycle compares every chunk");
    }
    Ok(shipped(
        &cycle,
        began,
        (sum.source_bytes_read, sum.wire_bytes),
        root,
        from.snapshot.clone(),
    ))
}

/// What a cycle reads `source` through: the image file behind it when it is a loop
/// device over a whole file on XFS or Btrfs (its clones are points in time of the
/// device: every write the device completed is in the file), else `source` itself.
fn image_behind(source: &Path) -> PathBuf {
    match mover_engine::node::loop_device::cloneable_image_of(source) {
        Ok(Some(image)) => {
            tracing::debug!(device = %source.display(), image = %image.display(), "a loop device over an image: its points in time are the image's clones");
            image
        }
        Ok(None) => source.into(),
        Err(e) => {
            tracing::debug!(device = %source.display(), "cannot tell the file behind it: {e}");
            source.into()
        }
    }
}

/// Runs one cycle of `record` from the export at `source`; `last` marks a demote's
/// final cycle. `remote` carries how to reach the peer (auth, streams, retries).
pub async fn run(
    record: &Record,
    source: &Path,
    remote: &RemoteOptions,
    last: bool,
    progress: &dyn Progress,
) -> Result<CycleRecord, CopyError> {
    let spec = &record.spec;
    let (peer, began) = begin(record, remote).await?;
    if source.is_dir() {
        return run_tree(record, source, &peer, began, remote, last).await;
    }
    let image = image_behind(source);
    let source_path = image.as_path();
    let source = image.clone();
    let chunk = ChunkSize::new(spec.chunk_size).map_err(CopyError::from)?;
    let (name, freeze) = (spec.name.clone(), spec.freeze.clone());
    let (mut pit, base) = tokio::task::spawn_blocking(move || {
        // The last committed cycle's clone, if it still matches the image's geometry.
        let mut base = std::fs::metadata(&source)
            .ok()
            .filter(|m| m.is_file())
            .and_then(|m| base::Base::load(&source, &name, chunk, m.len()));
        take_point_in_time(&source, &name, freeze.as_deref(), base.as_mut()).map(|p| (p, base))
    })
    .await
    .map_err(|e| CopyError::BadSource {
        path: spec.volume.clone().into(),
        why: e.to_string(),
    })??;
    if spec.require_point_in_time && pit.consistency != POINT_IN_TIME {
        return Err(no_point_in_time(
            source_path,
            mover_engine::node::point_in_time::READ_LIVE,
        ));
    }
    let cycle = next_cycle(record, &peer, pit.at_ms, pit.consistency, last);
    let size = chunker::BlockVolume::open(&pit.read)
        .map_err(CopyError::from)?
        .size();
    // Between two clones, only chunks in extents no longer shared may have changed: the
    // ranges the catch-up recloned, or those where a fresh clone and the base differ.
    let base = match (&pit.clone, base) {
        (_, Some(b)) if pit.caught_up => Some((b.cycle, b.root, b.known_pending(chunk))),
        (Some(clone), Some(b)) => match b.known(clone, chunk) {
            Ok(k) => k.map(|k| (b.cycle, b.root, k)),
            Err(e) => {
                tracing::warn!(relationship = %spec.name, "cannot compare extent maps: {e}");
                None
            }
        },
        _ => None,
    };
    // Only with clones: the live volume changes under the read, so its CVs would not
    // match any cycle's ids.
    let cvs = (pit.clone.is_some() || pit.caught_up)
        .then_some(())
        .and_then(|_| match base::open_cvs(source_path, &spec.name, chunk) {
            Ok(f) => f.map(std::sync::Arc::new),
            Err(e) => {
                tracing::warn!(relationship = %spec.name, "cannot open the CV file: {e}; changed chunks are read whole");
                None
            }
        });
    let push = CyclePush {
        cycle: &cycle,
        base,
        cvs,
    };
    let (sum, ids) = ship(record, &pit.read, &peer, remote, push, progress).await?;
    let clone = match pit.clone.take() {
        Some(fresh) => Some(fresh),
        None => pit.caught_up.then(|| pit.read.clone()),
    };
    if let (Some(clone), Some(root)) = (clone, &sum.root) {
        let saved = match ChunkId::from_hex(root) {
            Some(root) => base::save(
                source_path,
                &spec.name,
                &clone,
                cycle.id,
                &root,
                chunk,
                size,
                &ids,
            ),
            None => Err(std::io::Error::other(format!("bad cycle root {root:?}"))),
        };
        if let Err(e) = saved {
            let _ = std::fs::remove_file(&clone);
            tracing::warn!(relationship = %spec.name, "cannot keep the cycle's clone: {e}; the next cycle reads every chunk");
        }
    }
    Ok(CycleRecord {
        writers_held_ms: pit.held_ms,
        ..shipped(
            &cycle,
            began,
            (sum.source_bytes_read, sum.wire_bytes),
            sum.root.unwrap_or_default(),
            String::new(),
        )
    })
}
