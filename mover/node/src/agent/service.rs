//! The agent's transfer service: its state (exports, epochs, relationships, open
//! sessions) and the rules every call goes through (exports, refusals, epochs, the
//! secondary's admission of a cycle). The gRPC methods are in `transfer`.

use super::{
    Export,
    fencing::{EpochStore, Raise, StaleEpochOrIo},
    metrics::Metrics,
    session::Job,
    session::Session,
    status::{ServiceError, internal},
};
use crate::replicate::{
    Role, holds,
    journal::{self},
    secondary::{self, AdmitError, CycleTarget},
};
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering::Relaxed},
    },
};
use transport::auth::{Act, Credential, check_binding};
use transport::proto;

/// An agent's Transfer service.
pub struct AgentService {
    pub(super) exports: super::Exports,
    state_dir: PathBuf,
    pub(super) epochs: EpochStore,
    /// Replication relationships known here (primary or secondary side).
    pub(super) store: Arc<crate::replicate::Store>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) sessions: Mutex<HashMap<String, Arc<Session>>>,
    next_id: AtomicU64,
    /// Keys session ids (SipHash with keys from the OS's randomness).
    id_key: std::collections::hash_map::RandomState,
    /// File-tree exports being pushed into (one writer each).
    pub(super) trees_busy: Arc<Mutex<std::collections::HashSet<String>>>,
    /// Image exports whose page hashes are being filled in after a full copy: set to
    /// stop the fill when a writer opens the export.
    pub(super) filling: Arc<Mutex<HashMap<String, Arc<AtomicBool>>>>,
    /// Exports being hydrated are incomplete: no peer reads or writes them meanwhile.
    pub(super) hydrations: std::sync::OnceLock<Arc<crate::hydrate::Hydrations>>,
}

impl AgentService {
    /// A service for `exports`, keeping state under `state_dir`.
    pub fn new(
        exports: super::Exports,
        state_dir: PathBuf,
        metrics: Arc<Metrics>,
        store: Arc<crate::replicate::Store>,
    ) -> std::io::Result<Self> {
        Ok(AgentService {
            exports,
            epochs: EpochStore::new(&state_dir)?,
            store,
            state_dir,
            metrics,
            sessions: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
            id_key: std::collections::hash_map::RandomState::new(),
            trees_busy: Arc::default(),
            filling: Arc::default(),
            hydrations: std::sync::OnceLock::new(),
        })
    }

    /// Where this agent keeps its state.
    pub(super) fn state_dir(&self) -> &std::path::Path {
        &self.state_dir
    }

    pub(super) fn refuse(&self, e: ServiceError) -> ServiceError {
        self.metrics.refusals.fetch_add(1, Relaxed);
        e
    }

    /// The export `name`, or a refusal that lists what is exported.
    pub(super) fn export(&self, name: &str) -> Result<Export, ServiceError> {
        let export = self.exports.get(name).map_err(|e| {
            self.refuse(match e {
                super::ExportError::Unknown { .. } => ServiceError::NotFound(e.to_string()),
                super::ExportError::NoDevice { .. } => {
                    ServiceError::Refused(transport::refusal::Refusal::NoDevice, e.to_string())
                }
                _ => ServiceError::FailedPrecondition(e.to_string()),
            })
        })?;
        if let Some(h) = self.hydrations.get().and_then(|hs| hs.get(name))
            && h.progress().phase != crate::hydrate::Phase::Complete
        {
            return Err(self.refuse(ServiceError::FailedPrecondition(format!(
                "volume {name:?} is being hydrated from {} and is incomplete; it is served over NBD only until `mover hydrate wait` returns",
                h.source()
            ))));
        }
        Ok(export)
    }

    /// The open session `id`.
    pub(super) fn session(&self, id: &str) -> Result<Arc<Session>, ServiceError> {
        self.sessions.lock().expect("sessions lock").get(id).cloned().ok_or_else(|| {
            ServiceError::Refused(transport::refusal::Refusal::NoSession, format!("no open session {id:?}: it finished, was replaced by a newer one, or the agent restarted; open a new one"))
        })
    }

    /// Ends the sessions open on `export` and waits until their writers have stopped:
    /// a frame they were applying must land before a new session compares the volume,
    /// or the new session could skip a page that the old write then changes.
    pub(super) async fn close_sessions_on(&self, export: &str) -> Result<(), ServiceError> {
        let closed: Vec<Arc<Session>> = {
            let mut sessions = self.sessions.lock().expect("sessions lock");
            let ids: Vec<String> = sessions
                .iter()
                // A reader of a held cycle reads through its hold, which later writes
                // do not change; one whose hold ended goes here.
                .filter(|(_, s)| s.export == export && s.hold.as_ref().is_none_or(|h| h.is_ended()))
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| sessions.remove(id)).collect()
        };
        self.metrics
            .sessions_active
            .fetch_sub(closed.len() as u64, Relaxed);
        for s in closed {
            s.superseded.store(true, Relaxed);
            let writer = s
                .writer
                .lock()
                .expect("writer lock")
                .as_ref()
                .map(|w| w.tx.clone());
            if let Some(tx) = writer {
                // Frames queued behind this are dropped: its answer means "stopped".
                let (done, stopped) = tokio::sync::oneshot::channel();
                if tx.send(Job::Flush(done)).await.is_ok() {
                    let wait = tokio::time::timeout(std::time::Duration::from_secs(60), stopped);
                    if wait.await.is_err() {
                        return Err(ServiceError::Unavailable(format!(
                            "the previous session on {export} is still writing; retry later"
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// A new session's id: the export's name and 128 bits no caller can guess (a
    /// session is reached by its id alone, so another caller's must stay unknown).
    pub(super) fn session_id(&self, volume: &str) -> String {
        use std::hash::{BuildHasher, Hasher};
        let n = self.next_id.fetch_add(1, Relaxed);
        let half = |salt: u64| {
            let mut h = self.id_key.build_hasher();
            h.write_u64(n);
            h.write_u64(salt);
            h.finish()
        };
        format!("{volume}-{:016x}{:016x}", half(1), half(2))
    }

    /// Whether `caller` may open the export `name` for `relationship` (see
    /// `Exports::check_served_for`): a volume the controller registered for no
    /// relationship is the control role's alone; a relationship this agent holds on the
    /// volume vouches for it too (one registered before exports named their relationship).
    /// `write`: for a session that writes, whether it is a replication cycle.
    pub(super) fn check_served(
        &self,
        name: &str,
        relationship: &str,
        write: Option<bool>,
        caller: Option<&transport::auth::Caller>,
    ) -> Result<(), ServiceError> {
        let control = caller.is_none_or(|c| c.role == transport::auth::Role::Control);
        if !control && relationship.is_empty() {
            return Err(self.refuse(ServiceError::PermissionDenied(
                "a relationship is required: the replication role reaches an export only \
                 for the relationship it is served to"
                    .into(),
            )));
        }
        // A peer writes only replication cycles (staged, checked against the roles and
        // epochs): never straight into a volume, a primary's least of all.
        if !control && write == Some(false) {
            return Err(self.refuse(ServiceError::PermissionDenied(format!(
                "{} may write into {name:?} only as a replication cycle: the replication \
                 role writes nothing else",
                caller.map_or("the caller", |c| c.who.as_str())
            ))));
        }
        let record = self.store.get(relationship);
        if let Some(c) = caller {
            let act = if write.is_some() {
                Act::Write
            } else {
                Act::Read
            };
            // The record's binding, else its export's.
            let bound = match &record {
                Some(r) => r.spec.peer_credential.clone(),
                None => self.exports.peer_credential_for(name, relationship),
            };
            check_binding(c, relationship, bound.as_deref(), act)
                .map_err(|e| self.refuse(ServiceError::PermissionDenied(e)))?;
        }
        let registered_for_none = self.exports.registered_for(name).as_deref() == Some("");
        let held = record.is_some_and(|r| r.spec.volume == name);
        if held || (control && registered_for_none) {
            return Ok(());
        }
        self.exports
            .check_served_for(name, relationship)
            .map_err(|e| self.refuse(ServiceError::PermissionDenied(e)))
    }

    /// Ends the holds on export `name`, whose volume is about to change other than by
    /// a cycle: their readers are refused from now on, with `why`.
    pub(super) fn end_holds(&self, name: &str, why: &str) {
        if let Ok(e) = self.export(name) {
            holds::end_all(&e.path, why);
        }
    }

    /// The hold a READ session of the replica `r.volume` asks for (`r.hold`): the
    /// caller's own, at the cycle the replica is at, or the one it read before.
    pub(super) fn hold(
        &self,
        r: &proto::OpenRequest,
        path: &Path,
        caller: Option<&transport::auth::Caller>,
    ) -> Result<Arc<holds::Hold>, ServiceError> {
        let rec = self
            .store
            .get(&r.relationship)
            .filter(|x| x.spec.volume == r.volume)
            .ok_or_else(|| {
                self.refuse(ServiceError::FailedPrecondition(format!(
                    "export {:?} holds no replica of relationship {:?} here: only a \
                     replica's cycle can be held",
                    r.volume, r.relationship
                )))
            })?;
        if rec.role != Role::Secondary {
            return Err(self.refuse(ServiceError::FailedPrecondition(format!(
                "export {:?} is the primary of relationship {:?} here: it changes with every \
                 write, not cycle by cycle; read a replica (a secondary), or a snapshot",
                r.volume, r.relationship
            ))));
        }
        if !r.ranges_only {
            return Err(self.refuse(ServiceError::InvalidArgument(
                "a hold is read through a ranges-only session (its summary would be the \
                 live volume's)"
                    .into(),
            )));
        }
        if caller.is_some_and(|c| matches!(c.credential, Credential::Peer(_) | Credential::Unnamed))
        {
            return Err(self.refuse(ServiceError::PermissionDenied(
                "a peer cluster's replication token cannot hold a replica's cycle: holds are \
                 for this cluster's agents and operators"
                    .into(),
            )));
        }
        // A volume written in place (a first sync, a resync, a copy) is no cycle yet.
        let open: Vec<Arc<Session>> = self
            .sessions
            .lock()
            .expect("sessions lock")
            .values()
            .filter(|s| s.export == r.volume)
            .cloned()
            .collect();
        if open.iter().any(|s| s.writes_in_place()) {
            return Err(self.refuse(ServiceError::FailedPrecondition(format!(
                "export {:?} is being written in place (a first sync, a resync or a copy): it \
                 is no cycle to hold until that is done",
                r.volume
            ))));
        }
        // Each caller's names are its own: one reader never releases another's hold.
        let key = format!("{}/{}", caller.map_or("local", |c| c.who.as_str()), r.hold);
        let dir = journal::cycles_dir(&self.state_dir, &r.relationship);
        let expected = (r.held_cycle != 0).then_some(r.held_cycle);
        blocking(|| holds::take(&key, path, &dir, &holds_dir(&self.state_dir), expected)).map_err(
            |e| match e {
                holds::HoldError::Io(e) => internal(e),
                e => self.refuse(ServiceError::FailedPrecondition(format!(
                    "export {:?}: {e}",
                    r.volume
                ))),
            },
        )
    }

    /// Refuses a read-only export as a destination.
    pub(super) fn check_writable(&self, name: &str, export: &Export) -> Result<(), ServiceError> {
        if export.read_only {
            return Err(self.refuse(ServiceError::PermissionDenied(format!(
                "volume {name:?} is exported read-only; it can be a source, never a destination"
            ))));
        }
        Ok(())
    }

    /// Admits a cycle of `r` into its export (the rule is the secondary's, in
    /// `replicate::secondary`; a new record takes the export's peer credential): whether
    /// the relationship was known here before.
    pub(super) fn admit_cycle(
        &self,
        r: &CycleTarget<'_>,
        cycle: &transport::proto::Cycle,
    ) -> Result<bool, ServiceError> {
        let bound = self.exports.peer_credential_for(r.volume, r.relationship);
        secondary::admit(&self.store, r, bound.as_deref(), cycle).map_err(|e| match e {
            AdmitError::Refused(m) => self.refuse(ServiceError::FailedPrecondition(m)),
            AdmitError::Store(e) => internal(e),
        })
    }

    /// Admits a writer's fencing `epoch` for `relationship`, raising the highest seen
    /// as far as `raise` lets the caller (the control role: any).
    pub(super) fn check_epoch(
        &self,
        relationship: &str,
        epoch: u64,
        caller: Option<&transport::auth::Caller>,
        raise: Raise,
    ) -> Result<(), ServiceError> {
        let control = caller.is_none_or(|c| c.role == transport::auth::Role::Control);
        let raise = if control { Raise::Any } else { raise };
        match self.epochs.admit_bounded(relationship, epoch, raise) {
            Ok(()) => Ok(()),
            Err(StaleEpochOrIo::Stale(e)) => {
                self.metrics.stale_epoch_refusals.fetch_add(1, Relaxed);
                // A fenced old owner still writing: each refusal is logged, as the
                // counter says how many.
                tracing::warn!(
                    relationship,
                    given = e.given,
                    highest = e.highest,
                    "write refused: stale fencing epoch"
                );
                Err(ServiceError::Refused(
                    transport::refusal::Refusal::StaleEpoch,
                    e.to_string(),
                ))
            }
            Err(StaleEpochOrIo::Raise(e)) => {
                tracing::warn!(
                    relationship,
                    given = e.given,
                    highest = e.highest,
                    "write refused: epoch raised by more than one"
                );
                Err(self.refuse(ServiceError::FailedPrecondition(e.to_string())))
            }
            Err(e @ StaleEpochOrIo::Io(_)) => Err(ServiceError::Internal(e.to_string())),
        }
    }
}

/// Where the undo files of held replica cycles are kept (emptied at start: holds end
/// with the process).
pub(super) fn holds_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("holds")
}

/// Runs blocking volume I/O without stalling the async workers.
pub(super) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}
