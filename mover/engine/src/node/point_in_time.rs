//! Points in time of a volume: what a cycle or a scheduled snapshot reads so that it
//! holds the volume as it was at one instant, however long the read takes.
//!
//! A mechanism is a [`Source`]: it takes a point in time of a volume where it applies
//! ([`Source::take`]). [`take`] asks each in order and falls back to the live volume,
//! which is `crash-inconsistent`. The mechanism on a node today is [`ReflinkClone`] (an
//! image file on XFS or Btrfs, or a loop device over one,
//! [`super::loop_device::whole_file_of`]; what changed between two clones comes from
//! their extent maps, `chunker::extents::changed_ranges`). An LVM thin snapshot (`lvcreate -s`, changes from
//! `thin_delta`) is the next one: it fits here, but this machine's kernel has no
//! device-mapper to test it on. A CSI VolumeSnapshot is taken by the controller through
//! the API server, not on the node (`controller::csi_snapshots`; the agent then reads a
//! clone of it, `replicate::cycle::run_from_snapshot`).
//!
//! A filesystem freeze brackets only the taking of a point in time, never a read: a
//! freeze held for a whole read would stall the application for as long as it takes.

use std::{
    io,
    path::{Path, PathBuf},
};

/// Consistency labels, as status and snapshot tags report them: the volume at one
/// instant.
pub const POINT_IN_TIME: &str = "point-in-time";
/// Read live: blocks from different instants, as after a crash or worse.
pub const CRASH_INCONSISTENT: &str = "crash-inconsistent";
/// A file tree: each file as it was when read, not the tree at one instant.
pub const FILE_CONSISTENT: &str = "file-consistent";

/// The words that begin the reason of a run refused for want of a point in time (the
/// refusal itself travels typed: `CopyError::NoPointInTime`, and the agent's status
/// says its kind).
pub const NO_POINT_IN_TIME: &str = "no point in time can be taken of it";

/// What a live read is, in [`refusal`]'s words.
pub const READ_LIVE: &str = "it is read live (it is neither an image file on a file system with reflinks nor a loop device over one)";

/// The reason a job that requires a point in time gives for not running on `volume`:
/// `what` it is, and the ways out.
pub fn refusal(what: &str) -> String {
    format!(
        "{NO_POINT_IN_TIME}: {what}; a point in time is required, so nothing is shipped. \
         Replicate it through CSI VolumeSnapshots (class parameter volumeSnapshotClassName), \
         keep it as an image file on XFS or Btrfs (reflink clones), or accept \
         consistency=crash-inconsistent (class parameter, or `mover replicate update \
         --consistency crash-inconsistent`)"
    )
}

/// A way to take a point in time of a volume.
pub trait Source {
    /// Its name, as logs say it ("reflink").
    fn mechanism(&self) -> &'static str;
    /// A point in time of `volume` taken now, kept under a name derived from `owner`
    /// (a relationship or schedule), or `Ok(None)` where this mechanism does not apply
    /// to the volume.
    fn take(&self, volume: &Path, owner: &str) -> io::Result<Option<Taken>>;
}

/// A point in time: the path to read, its consistency, and what to release after.
pub struct Taken {
    /// What to read: a clone, a snapshot device, or the live volume.
    pub read: PathBuf,
    /// One of the labels above.
    pub consistency: &'static str,
    /// Removed when dropped (a clone).
    remove: Option<PathBuf>,
}

impl Taken {
    /// The live volume: no point in time.
    pub fn live(volume: &Path) -> Taken {
        Taken {
            read: volume.into(),
            consistency: CRASH_INCONSISTENT,
            remove: None,
        }
    }

    /// Whether it is the volume at one instant.
    pub fn is_point_in_time(&self) -> bool {
        self.consistency == POINT_IN_TIME
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some(p) = &self.remove {
            let _ = std::fs::remove_file(p);
        }
    }
}

/// The first point in time any of `sources` takes of `volume`, else the live volume.
pub fn take(sources: &[&dyn Source], volume: &Path, owner: &str) -> io::Result<Taken> {
    for s in sources {
        if let Some(t) = s.take(volume, owner)? {
            tracing::debug!(mechanism = s.mechanism(), volume = %volume.display(), "point in time taken");
            return Ok(t);
        }
    }
    Ok(Taken::live(volume))
}

/// A reflink clone of an image file beside it, on a file system with reflinks (XFS,
/// Btrfs): instant, and no space until the image is written.
pub struct ReflinkClone {
    /// The clone's file name beside the image, from the image and the owner (hidden,
    /// and the job's own: the jobs name their files).
    pub name: fn(&Path, &str) -> String,
}

impl Source for ReflinkClone {
    fn mechanism(&self) -> &'static str {
        "reflink"
    }

    fn take(&self, volume: &Path, owner: &str) -> io::Result<Option<Taken>> {
        // A loop device over a whole image: the image's clone is the device at one instant.
        let image = super::loop_device::cloneable_image_of(volume)
            .ok()
            .flatten();
        let volume = image.as_deref().unwrap_or(volume);
        if !std::fs::metadata(volume).is_ok_and(|m| m.is_file()) {
            return Ok(None);
        }
        let clone = volume.with_file_name((self.name)(volume, owner));
        Ok(
            chunker::extents::clone_fresh(volume, &clone)?.then(|| Taken {
                read: clone.clone(),
                consistency: POINT_IN_TIME,
                remove: Some(clone),
            }),
        )
    }
}
