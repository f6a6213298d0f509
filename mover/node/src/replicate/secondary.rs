//! The secondary's end of a replication cycle, beside the primary's: which cycle may be
//! written into an export here, the relationship record the secondary keeps (so it can
//! be promoted), and the commit of a cycle (journaled, or in place for a first sync).
//! The agent's transfer service only adapts these to gRPC.

use super::journal::{self, AppliedCycle, Journal};
use super::{Record, Role, Store, StoreError};
use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};
use transport::proto;

/// Where a cycle is written: the relationship, the export, the writer's epoch and the
/// chunk size (0 for a file tree).
pub struct CycleTarget<'a> {
    /// The relationship.
    pub relationship: &'a str,
    /// The export written into.
    pub volume: &'a str,
    /// The writer's fencing epoch.
    pub epoch: u64,
    /// The chunk size (0 for a file tree).
    pub chunk_size: u64,
}

/// Why a cycle may not be written here.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    /// The state here refuses it: what and what to do.
    #[error("{0}")]
    Refused(String),
    /// The relationship record could not be kept.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Checks that a cycle of `r` may be written into `r.volume` here, and records the
/// relationship as this side's secondary (a new record bound to `bound`, the peer
/// credential its export names). Returns whether the relationship was known here before
/// (then the volume holds a complete cycle, or a former primary's data, and must be
/// changed atomically).
pub fn admit(
    store: &Store,
    r: &CycleTarget<'_>,
    bound: Option<&str>,
    cycle: &proto::Cycle,
) -> Result<bool, AdmitError> {
    let known = store.get(r.relationship);
    if let Some(k) = &known {
        if k.role == Role::Primary {
            return Err(AdmitError::Refused(format!(
                "volume {:?} is the primary of relationship {:?} on this agent (epoch {}): \
                 a peer may not write into it. For a planned failover demote it first; \
                 after a forced promote of the peer run `mover replicate resync {}` here",
                k.spec.volume, k.spec.name, k.epoch, k.spec.name
            )));
        }
        if k.spec.volume != r.volume {
            return Err(AdmitError::Refused(format!(
                "relationship {:?} replicates into export {:?} on this agent, not {:?}",
                k.spec.name, k.spec.volume, r.volume
            )));
        }
    }
    if let Some(other) = store
        .all()
        .into_iter()
        .find(|o| o.spec.volume == r.volume && o.spec.name != r.relationship)
    {
        return Err(AdmitError::Refused(format!(
            "export {:?} already belongs to relationship {:?} ({}); one relationship per volume",
            r.volume,
            other.spec.name,
            other.role.side()
        )));
    }
    let record = Record::secondary(
        (r.relationship, r.volume, bound),
        r.epoch,
        r.chunk_size,
        cycle,
        known.as_ref(),
    );
    if known.as_ref() != Some(&record) {
        store.put(record)?;
    }
    Ok(known.is_some())
}

/// The last cycle applied under `state_dir` for `relationship`, as a transfer's Open
/// reports it.
pub fn applied_cycle(state_dir: &Path, relationship: &str) -> Option<proto::AppliedCycle> {
    let a = journal::applied(&journal::cycles_dir(state_dir, relationship))?;
    Some(proto::AppliedCycle {
        id: a.id,
        root: chunker::ChunkId::from_hex(&a.root)
            .map(|id| id.0.to_vec())
            .unwrap_or_default()
            .into(),
        point_in_time_ms: a.point_in_time_ms,
        epoch: a.epoch,
        dirty: a.dirty.iter().flat_map(|&(s, e)| [s, e]).collect(),
    })
}

/// A write session that is a replication cycle.
pub struct CycleSession {
    /// The cycle, as the primary described it.
    pub cycle: proto::Cycle,
    /// The relationship.
    pub relationship: String,
    /// The writer's epoch.
    pub epoch: u64,
    /// The relationship's cycles directory.
    pub dir: PathBuf,
    /// Staged frames; `None` when the session writes in place (a first sync, or a new
    /// image made under a temp name: both are complete only at the end anyway).
    pub(crate) journal: Arc<Mutex<Option<Journal>>>,
}

impl CycleSession {
    /// The cycle as it will be recorded once applied, with the source's `root`.
    pub fn applied(&self, root: &[u8]) -> AppliedCycle {
        let root = chunker::ChunkId(root.try_into().expect("checked by Finish: 32 bytes"));
        AppliedCycle::of_cycle(&self.relationship, &self.cycle, self.epoch, root.to_hex())
    }

    /// Commits the cycle: a staged journal is made durable, committed and written onto
    /// `volume` (its fsync finishing in the background); without one (the data was
    /// written in place and synced) the cycle is only recorded. Called once the volume
    /// is complete at its final path.
    pub fn commit(&self, root: &[u8], volume: &Path) -> std::io::Result<AppliedCycle> {
        let cycle = self.applied(root);
        let staged = self.journal.lock().expect("journal lock").take();
        let applied = match staged {
            Some(j) => {
                let dir = j.commit(cycle, volume)?;
                // Durable from its commit record on: the primary need not wait for the
                // volume's fsync (a crash replays the journal).
                journal::apply_then_sync_in_background(&dir)
            }
            None => {
                journal::record_applied(&self.dir, &cycle)?;
                Ok(cycle)
            }
        }?;
        // The volume equals a cycle again: a reader may hold it.
        super::holds::reopen(volume);
        Ok(applied)
    }
}
