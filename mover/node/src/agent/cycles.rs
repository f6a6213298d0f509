//! The secondary's side of a replication cycle: who may write a cycle into an export,
//! the relationship record the secondary keeps (so it can be promoted), and the commit
//! of a cycle (journaled, or direct for the first sync).

use super::{service::AgentService, status::ServiceError};
use crate::replicate::journal::{self, AppliedCycle, Journal};
use crate::replicate::{Record, Role, Spec, store::RECORD_VERSION};
use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};
use transport::proto;

/// Where a cycle is written: the relationship, the export, the writer's epoch and the
/// chunk size (0 for a file tree).
pub(super) struct CycleTarget<'a> {
    pub relationship: &'a str,
    pub volume: &'a str,
    pub epoch: u64,
    pub chunk_size: u64,
}

/// A WRITE session that is a replication cycle.
pub(super) struct CycleSession {
    pub cycle: proto::Cycle,
    pub relationship: String,
    pub epoch: u64,
    pub dir: PathBuf,
    /// Staged frames; `None` when the session writes in place (a first sync, or a new
    /// image made under a temp name: both are complete only at the end anyway).
    pub journal: Arc<Mutex<Option<Journal>>>,
}

impl AgentService {
    /// Checks that a cycle of relationship `r` may be written into `r.volume` here, and
    /// records the relationship as this side's secondary. Returns whether the relationship
    /// was known here before (then the volume holds a complete cycle, or a former
    /// primary's data, and must be changed atomically).
    pub(super) fn admit_cycle(
        &self,
        r: &CycleTarget<'_>,
        cycle: &proto::Cycle,
    ) -> Result<bool, ServiceError> {
        let known = self.store.get(r.relationship);
        if let Some(k) = &known {
            if k.role == Role::Primary {
                return Err(self.refuse(ServiceError::FailedPrecondition(format!(
                    "volume {:?} is the primary of relationship {:?} on this agent (epoch {}): \
                     a peer may not write into it. For a planned failover demote it first; \
                     after a forced promote of the peer run `mover replicate resync {}` here",
                    k.spec.volume, k.spec.name, k.epoch, k.spec.name
                ))));
            }
            if k.spec.volume != r.volume {
                return Err(self.refuse(ServiceError::FailedPrecondition(format!(
                    "relationship {:?} replicates into export {:?} on this agent, not {:?}",
                    k.spec.name, k.spec.volume, r.volume
                ))));
            }
        }
        if let Some(other) = self
            .store
            .all()
            .into_iter()
            .find(|o| o.spec.volume == r.volume && o.spec.name != r.relationship)
        {
            return Err(self.refuse(ServiceError::FailedPrecondition(format!(
                "export {:?} already belongs to relationship {:?} ({}); one relationship per volume",
                r.volume,
                other.spec.name,
                crate::replicate::runner::role_str(other.role)
            ))));
        }
        let record = Record {
            version: RECORD_VERSION,
            spec: Spec {
                name: r.relationship.into(),
                volume: r.volume.into(),
                peer: match (&cycle.primary, &known) {
                    (p, Some(k)) if p.is_empty() => k.spec.peer.clone(),
                    (p, _) => p.clone(),
                },
                interval_ms: cycle.interval_ms,
                bwlimit: cycle.bwlimit,
                chunk_size: r.chunk_size,
                freeze: known.as_ref().and_then(|k| k.spec.freeze.clone()),
                // Set on this side (for when it is promoted): not the primary's to change.
                peer_token: known.as_ref().and_then(|k| k.spec.peer_token.clone()),
                require_point_in_time: known.as_ref().is_some_and(|k| k.spec.require_point_in_time),
                snapshots: known.as_ref().is_some_and(|k| k.spec.snapshots),
            },
            role: Role::Secondary,
            epoch: r.epoch,
            paused: false,
            halt: None,
            last_cycle: known.as_ref().and_then(|k| k.last_cycle.clone()),
            this_side: known
                .as_ref()
                .map(|k| k.this_side.clone())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| cycle.secondary.clone()),
            history: known
                .as_ref()
                .map(|k| k.history.clone())
                .unwrap_or_default(),
        };
        if known.as_ref() != Some(&record) {
            self.store
                .put(record)
                .map_err(|e| ServiceError::Internal(e.to_string()))?;
        }
        Ok(known.is_some())
    }

    /// The last cycle applied here for `relationship`, as Open reports it.
    pub(super) fn applied_cycle(&self, relationship: &str) -> Option<proto::AppliedCycle> {
        let a = journal::applied(&journal::cycles_dir(self.state_dir(), relationship))?;
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
}

impl CycleSession {
    /// The cycle as it will be recorded once applied, with the source's `root`.
    pub fn applied(&self, root: &[u8]) -> AppliedCycle {
        let root = chunker::ChunkId(root.try_into().expect("checked by Finish: 32 bytes"));
        AppliedCycle::of_cycle(&self.relationship, &self.cycle, self.epoch, root.to_hex())
    }

    /// Commits the cycle: a staged journal is made durable, committed and written onto
    /// `volume` (its fsync finishing in the background); without one (the data was written in place and synced) the cycle is
    /// only recorded. Called once the volume is complete at its final path.
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
        crate::replicate::holds::reopen(volume);
        Ok(applied)
    }
}
