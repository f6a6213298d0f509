//! The Replication service: the agent's relationship control API (create, get, list,
//! update, delete, sync, promote, demote, resync), for the CLI and the controller.

use super::{
    service::{AgentService, blocking},
    status::{ServiceError, answer, internal},
};
use crate::replicate::journal;
use crate::replicate::{
    self, CycleRecord, EpochChange, Halt, MIN_INTERVAL_MS, Record, Role, Runners, Spec,
};
use chunker::{BlockVolume, ChunkSize};
use mover_engine::remote::{AgentUrl, RemoteOptions};
use std::{path::Path, sync::Arc};
use tonic::{Request, Response, Status};
use transport::auth::{Act, check_binding};
use transport::control::{self, replication_server::Replication};

/// Thaws what `held` froze and removes its record; an error if the watchdog had
/// thawed any of it first.
fn thaw_all(held: Freeze) -> std::io::Result<()> {
    let mut result = Ok(());
    for g in held.guards {
        if let Err(e) = g.thaw() {
            result = Err(e);
        }
    }
    let _ = std::fs::remove_file(&held.record);
    result
}

/// The Replication service of one agent.
pub struct Control {
    pub(super) service: Arc<AgentService>,
    pub(super) runners: Arc<Runners>,
    /// `HOST:PORT` peers reach this agent at, from the config (else the caller's view).
    pub(super) advertise: Option<String>,
    /// The name this agent's certificate carries (its node's): peers check it.
    pub(super) tls_name: Option<String>,
    /// How this agent reaches peers.
    pub(super) remote: RemoteOptions,
    /// Scheduled snapshots: an export one of them takes is in use.
    pub(super) schedules: Arc<crate::schedule::Schedules>,
    /// File systems frozen by Freeze, by relationship, until Thaw.
    pub(super) frozen: std::sync::Mutex<std::collections::HashMap<String, Freeze>>,
}

/// What Freeze holds for a relationship.
pub(super) struct Freeze {
    guards: Vec<mover_engine::node::freeze::Frozen>,
    mounts: Vec<std::path::PathBuf>,
    since: std::time::Instant,
    max: std::time::Duration,
    /// Lists the mounts while they may be frozen: an agent killed meanwhile thaws them
    /// when it starts again (the kernel does not).
    record: std::path::PathBuf,
}

/// The peer credential a control call binds a relationship to (`""`: none): a name of
/// `replication_token_file`, or `local`.
fn peer_credential(name: &str) -> Result<Option<String>, ServiceError> {
    if name.is_empty() {
        return Ok(None);
    }
    if name != transport::cluster::LOCAL_CREDENTIAL {
        transport::cluster::check_credential_name(name).map_err(ServiceError::InvalidArgument)?;
    }
    Ok(Some(name.into()))
}

/// The directory of the records of file systems frozen by Freeze.
fn frozen_dir(state_dir: &Path) -> std::path::PathBuf {
    state_dir.join("frozen")
}

/// The mounts a killed agent may have left frozen (their records removed): the agent
/// thaws them at start.
pub(super) fn left_frozen(state_dir: &Path) -> Vec<std::path::PathBuf> {
    let mut mounts = Vec::new();
    for e in std::fs::read_dir(frozen_dir(state_dir))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Ok(text) = std::fs::read_to_string(e.path()) {
            mounts.extend(
                text.lines()
                    .filter(|l| !l.is_empty())
                    .map(std::path::PathBuf::from),
            );
        }
        let _ = std::fs::remove_file(e.path());
    }
    mounts
}

impl Control {
    /// How peers reach `volume` here: `agent://[NAME@]ADDRESS/VOLUME`, with the name
    /// this agent's certificate carries.
    fn side_url(&self, address: &str, volume: &str) -> String {
        match &self.tls_name {
            Some(n) if !address.contains('@') => format!("agent://{n}@{address}/{volume}"),
            _ => format!("agent://{address}/{volume}"),
        }
    }

    fn record(&self, name: &str) -> Result<Record, ServiceError> {
        self.service.store.get(name).ok_or_else(|| {
            ServiceError::NotFound(format!(
                "no relationship {name:?} on this agent (a secondary learns a relationship \
                 from its first cycle); `mover replicate list` shows those it has"
            ))
        })
    }

    /// Status of `r` as this side sees it.
    fn status(&self, r: &Record) -> control::Status {
        let live = self.runners.live(&r.spec.name);
        let live = live.lock().expect("live lock");
        let applied = match r.role {
            Role::Primary => None,
            Role::Secondary => {
                journal::applied(&journal::cycles_dir(self.service.state_dir(), &r.spec.name))
            }
        };
        let last = match (r.role, &applied) {
            (Role::Primary, _) => r.last_cycle.clone(),
            // The applied record is the truth; the relationship's own record has more
            // detail (bytes shipped) when this side shipped that cycle (a demote).
            (Role::Secondary, Some(a)) if r.last_cycle.as_ref().is_some_and(|c| c.id == a.id) => {
                r.last_cycle.clone()
            }
            (Role::Secondary, Some(a)) => Some(CycleRecord::from(a)),
            (Role::Secondary, None) => r.last_cycle.clone(),
        };
        let mut s = replicate::status(r, &live, last.as_ref());
        s.handed_over = journal::handed_over(r, applied.as_ref());
        s
    }

    /// The cycle the peer was promoted from when it fenced this side's epoch, from the
    /// peer's history (`None` if the peer cannot be asked or does not say).
    async fn promoted_from(&self, r: &Record) -> Option<CycleRecord> {
        let remote = replicate::remote_for(&self.remote, r.spec.peer_token.as_ref());
        let peer = mover_engine::remote::locate(&r.spec.peer, &r.spec.name, &remote)
            .await
            .ok()?;
        let mut c = remote.connect_control(&peer).await.ok()?;
        let s = c
            .get(control::NameRequest {
                name: r.spec.name.clone(),
            })
            .await
            .ok()?
            .into_inner();
        let h = s
            .history
            .iter()
            .filter(|h| h.epoch > r.epoch && !h.root.is_empty())
            .min_by_key(|h| h.epoch)?;
        Some(CycleRecord {
            id: h.last_common_cycle,
            root: h.root.clone(),
            ..Default::default()
        })
    }

    /// The last cycle both sides hold, by hashing this side's volume: the last cycle it
    /// committed, or the one the peer was promoted from (which this side may have shipped
    /// without hearing back: the secondary committed it, the reply was lost).
    async fn common_by_hashing(
        &self,
        r: &Record,
        export: &mover_engine::node::Export,
    ) -> Result<Option<CycleRecord>, ServiceError> {
        let key = transport::relationship_key(&r.spec.name);
        let local_root = blocking(|| -> Result<String, String> {
            let v = BlockVolume::open(&export.path).map_err(|e| e.to_string())?;
            let chunk = ChunkSize::new(r.spec.chunk_size).map_err(|e| e.to_string())?;
            let s =
                chunker::Summary::of_volume(&v, &key, chunk, |_| {}).map_err(|e| e.to_string())?;
            Ok(s.root.to_hex())
        })
        .map_err(internal)?;
        if let Some(c) = r.last_cycle.clone().filter(|c| c.root == local_root) {
            return Ok(Some(c));
        }
        Ok(self.promoted_from(r).await.filter(|c| c.root == local_root))
    }

    /// A former primary's writes since its last committed cycle (see
    /// `replicate::base::settle`), or `None` if that cannot be told cheaply.
    async fn settle(&self, r: &Record) -> Option<Vec<std::ops::Range<u64>>> {
        let path = &self.service.export(&r.spec.volume).ok()?.path;
        let chunk = ChunkSize::new(r.spec.chunk_size).ok()?;
        let cycle = r.last_cycle.as_ref()?.id;
        let state = self.service.state_dir();
        blocking(|| replicate::base::settle(state, path, &r.spec.name, chunk, cycle)).unwrap_or_else(|e| {
            tracing::warn!(relationship = %r.spec.name, "cannot tell the writes since the last cycle from the clones: {e}");
            None
        })
    }

    /// Drops the primary's kept clone of its last cycle (see `replicate::base`).
    fn forget_base(&self, r: &Record) {
        if let Ok(e) = self.service.export(&r.spec.volume) {
            replicate::base::forget(&e.path, &r.spec.name);
        }
    }

    /// What uses the export `volume` here: a relationship, a hydration or a schedule
    /// (None: nothing).
    fn user_of(&self, volume: &str) -> Option<String> {
        if let Some(r) = self
            .service
            .store
            .all()
            .into_iter()
            .find(|r| r.spec.volume == volume)
        {
            return Some(format!("relationship {:?}", r.spec.name));
        }
        let hydrating = self.service.hydrations.get().and_then(|h| h.get(volume));
        if let Some(h) = hydrating.filter(|h| h.progress().phase != crate::hydrate::Phase::Complete)
        {
            return Some(format!("a hydration from {}", h.source()));
        }
        self.schedules
            .list()
            .into_iter()
            .filter_map(|s| s.spec)
            .find(|s| s.volume == volume)
            .map(|s| format!("snapshot schedule {:?}", s.name))
    }

    fn export_reply(&self, name: &str, registered: bool) -> control::ExportResponse {
        control::ExportResponse {
            name: name.into(),
            path: self
                .service
                .exports
                .get(name)
                .map(|e| e.path.display().to_string())
                .unwrap_or_default(),
            registered,
        }
    }

    /// The export `name` as this node maps it now; `None` for a block PV's kubelet
    /// directory with no device entry left: no pod maps the volume here, so nothing
    /// holds it or writes to it.
    fn mapped_export(
        &self,
        name: &str,
    ) -> Result<Option<mover_engine::node::Export>, ServiceError> {
        if let Err(crate::agent::ExportError::NoDevice { .. }) = self.service.exports.get(name) {
            return Ok(None);
        }
        self.service.export(name).map(Some)
    }

    fn reply(&self, name: &str) -> Result<control::Status, ServiceError> {
        Ok(self.status(&self.record(name)?))
    }

    /// Checks a new relationship's spec; returns it with defaults filled in.
    async fn check_spec(&self, spec: control::Spec) -> Result<Spec, ServiceError> {
        let bad = ServiceError::InvalidArgument;
        if spec.name.is_empty() || spec.name.chars().any(|c| c.is_control()) {
            return Err(bad(
                "a relationship needs a name without control characters".into(),
            ));
        }
        let export = self.service.export(&spec.volume)?;
        replicate::check_interval(spec.interval_ms).map_err(bad)?;
        if !spec.peer.starts_with(mover_engine::remote::CLUSTER_SCHEME) {
            AgentUrl::parse(&spec.peer)
                .ok_or_else(|| {
                    bad(format!(
                        "secondary {:?} is neither agent://HOST:PORT/VOLUME nor \
                         cluster://HOST:PORT",
                        spec.peer
                    ))
                })?
                .map_err(|e| bad(e.to_string()))?;
        }
        // A file tree replicates file by file: no chunk size, nothing to freeze (a
        // freeze would stop the application for the whole walk).
        let tree = std::fs::metadata(&export.path).is_ok_and(|m| m.is_dir());
        let chunk_size = if tree {
            if !spec.freeze.is_empty() {
                return Err(bad(format!(
                    "export {:?} is a file tree: its cycles are file-consistent and cannot be \
                     frozen; drop --freeze (or replicate the block volume it lives on)",
                    spec.volume
                )));
            }
            0
        } else {
            let size = blocking(|| BlockVolume::open(&export.path))
                .map_err(|e| ServiceError::FailedPrecondition(format!("the primary volume: {e}")))?
                .size();
            if spec.chunk_size == 0 {
                replicate::default_chunk(size)
            } else {
                ChunkSize::new(spec.chunk_size).map_err(|e| bad(e.to_string()))?
            }
            .get()
        };
        if let Some(other) = self
            .service
            .store
            .all()
            .into_iter()
            .find(|o| o.spec.volume == spec.volume)
        {
            return Err(ServiceError::FailedPrecondition(format!(
                "export {:?} is already the {} of relationship {:?}; a volume belongs to one \
                 relationship",
                spec.volume,
                other.role.side().name(),
                other.spec.name
            )));
        }
        // The secondary must be reachable and accept writes now, not at the first cycle.
        let peer_token = (!spec.peer_token.is_empty()).then(|| replicate::store::PeerToken {
            token: spec.peer_token.clone(),
            version: spec.peer_token_version.clone(),
            ca: (!spec.peer_ca.is_empty()).then(|| spec.peer_ca.clone()),
        });
        let remote = replicate::remote_for(&self.remote, peer_token.as_ref());
        let unreachable = |e: mover_engine::CopyError| {
            ServiceError::FailedPrecondition(format!("secondary unreachable: {e}"))
        };
        let peer = mover_engine::remote::locate(&spec.peer, &spec.name, &remote)
            .await
            .map_err(unreachable)?;
        let mut client = remote.connect(&peer).await.map_err(unreachable)?;
        let d = client
            .describe(transport::proto::DescribeRequest {
                volume: peer.volume.clone(),
                relationship: spec.name.clone(),
            })
            .await
            .map_err(|s| {
                ServiceError::FailedPrecondition(format!("secondary {peer}: {}", s.message()))
            })?
            .into_inner();
        let kind = |t: bool| if t { "a file tree" } else { "a block volume" };
        if d.tree != tree || d.read_only {
            return Err(ServiceError::FailedPrecondition(format!(
                "secondary {peer} is {}: it cannot receive {}",
                if d.read_only {
                    "exported read-only"
                } else {
                    kind(d.tree)
                },
                kind(tree)
            )));
        }
        if !spec.freeze.is_empty() {
            mover_engine::node::freeze::check_freeze(Path::new(&spec.freeze), &export.path)
                .map_err(bad)?;
        }
        Ok(Spec {
            name: spec.name,
            volume: spec.volume,
            peer: spec.peer,
            interval_ms: spec.interval_ms,
            bwlimit: spec.bwlimit,
            chunk_size,
            freeze: (!spec.freeze.is_empty()).then(|| spec.freeze.into()),
            peer_token,
            require_point_in_time: spec.require_point_in_time,
            snapshots: spec.snapshots,
            peer_credential: peer_credential(&spec.peer_credential)?,
        })
    }

    /// Raises the highest epoch this side admits for `r` to `epoch`, as an operator does
    /// after the peer was promoted more than once while this side was away (a peer
    /// raises it by one at most). An active primary's epoch rises by its promotes alone.
    fn accept_epoch(&self, r: &Record, epoch: u64) -> Result<(), ServiceError> {
        if r.role == Role::Primary && r.halt.is_none() {
            return Err(ServiceError::FailedPrecondition(format!(
                "this side is the active primary of {:?}: its epoch rises when it is \
                 promoted, not by --accept-epoch",
                r.spec.name
            )));
        }
        self.service
            .check_epoch(&r.spec.name, epoch, None, super::fencing::Raise::Any)?;
        tracing::info!(relationship = %r.spec.name, epoch, "epoch accepted by the control role");
        Ok(())
    }

    /// Where the chunk ids of `name`'s last cycle from a snapshot are kept.
    fn snapshot_ids_file(&self, name: &str) -> std::path::PathBuf {
        let dir = self.service.state_dir().join("snapshot-ids");
        dir.join(mover_engine::node::name_hash(name))
    }

    /// After a demote's final cycle `last`: this side is the secondary now.
    async fn demoted(&self, name: &str, last: CycleRecord) -> Result<(), ServiceError> {
        self.runners.stop(name);
        // This side now holds the final cycle (and whatever was written after its clone:
        // shipped back by the new primary): later cycles into it are staged.
        let r = self.record(name)?;
        let written = self.settle(&r).await;
        self.forget_base(&r);
        let dir = journal::cycles_dir(self.service.state_dir(), name);
        let mut applied = journal::AppliedCycle::of(name, &last, r.epoch);
        applied.dirty = written
            .unwrap_or_default()
            .iter()
            .map(|w| (w.start, w.end))
            .collect();
        journal::record_applied(&dir, &applied).map_err(internal)?;
        tracing::info!(relationship = %name, cycle = last.id, "demoted after a final cycle");
        Ok(())
    }
}

#[tonic::async_trait]
impl Replication for Control {
    async fn create(
        &self,
        req: Request<control::CreateRequest>,
    ) -> Result<Response<control::Status>, Status> {
        super::control_only(&req, "create")?;
        answer(async {
            let r = req.into_inner();
            let spec = r.spec.ok_or_else(|| {
                ServiceError::InvalidArgument("a relationship spec is required".into())
            })?;
            if self.service.store.get(&spec.name).is_some() {
                return Err(ServiceError::AlreadyExists(format!(
                    "relationship {:?} exists on this agent; `mover replicate status {}` shows it",
                    spec.name, spec.name
                )));
            }
            let spec = self.check_spec(spec).await?;
            let address = self.advertise.clone().unwrap_or(r.self_address);
            if address.is_empty() {
                return Err(ServiceError::InvalidArgument(
                    "this agent's address is unknown: set `advertise` in its config".into(),
                ));
            }
            // A relationship re-created under an old name continues its epochs.
            let epoch = self.service.epochs.highest(&spec.name).max(1);
            self.service
                .check_epoch(&spec.name, epoch, None, super::fencing::Raise::Any)?;
            let this_side = self.side_url(&address, &spec.volume);
            let record = Record::primary(spec, epoch, this_side);
            let name = record.spec.name.clone();
            self.service.store.put(record).map_err(internal)?;
            self.runners.start(&name);
            tracing::info!(relationship = %name, "relationship created");
            self.reply(&name)
        })
        .await
    }

    async fn get(
        &self,
        req: Request<control::NameRequest>,
    ) -> Result<Response<control::Status>, Status> {
        let caller = req.extensions().get::<transport::auth::Caller>().cloned();
        answer(async {
            let name = req.into_inner().name;
            // A peer sees only the relationships bound to it (the control role: all).
            if let (Some(c), Some(r)) = (&caller, self.service.store.get(&name)) {
                let bound = r.spec.peer_credential.as_deref();
                check_binding(c, &name, bound, Act::Status)
                    .map_err(|e| self.service.refuse(ServiceError::PermissionDenied(e)))?;
            }
            self.reply(&name)
        })
        .await
    }

    async fn list(
        &self,
        req: Request<control::ListRequest>,
    ) -> Result<Response<control::ListResponse>, Status> {
        super::control_only(&req, "list")?;
        let relationships = self
            .service
            .store
            .all()
            .iter()
            .map(|r| self.status(r))
            .collect();
        Ok(Response::new(control::ListResponse { relationships }))
    }

    async fn update(
        &self,
        req: Request<control::UpdateRequest>,
    ) -> Result<Response<control::Status>, Status> {
        super::control_only(&req, "update")?;
        answer(async {
            let u = req.into_inner();
            let r = self.record(&u.name)?;
            if let Some(m) = u.freeze.as_deref().filter(|m| !m.is_empty()) {
                let export = self.service.export(&r.spec.volume)?;
                if export.path.is_dir() {
                    return Err(ServiceError::InvalidArgument(
                        "a file tree's cycles are file-consistent and cannot be frozen".into(),
                    ));
                }
                mover_engine::node::freeze::check_freeze(Path::new(m), &export.path)
                    .map_err(ServiceError::InvalidArgument)?;
            }
            let bind = u
                .peer_credential
                .as_deref()
                .map(peer_credential)
                .transpose()?;
            if u.interval_ms.is_some_and(|i| i < MIN_INTERVAL_MS) {
                return Err(ServiceError::InvalidArgument(
                    "interval too short: cycles run at most once a second".into(),
                ));
            }
            if let Some(n) = u.accept_epoch {
                self.accept_epoch(&r, n)?;
            }
            self.service
                .store
                .update(&u.name, |r| {
                    if let Some(i) = u.interval_ms {
                        r.spec.interval_ms = i;
                    }
                    if let Some(b) = u.bwlimit {
                        r.spec.bwlimit = b;
                    }
                    if let Some(p) = u.paused {
                        r.paused = p;
                    }
                    if let Some(m) = &u.freeze {
                        r.spec.freeze = (!m.is_empty()).then(|| m.into());
                    }
                    if let Some(p) = u.require_point_in_time {
                        r.spec.require_point_in_time = p;
                    }
                    if let Some(s) = u.snapshots {
                        r.spec.snapshots = s;
                    }
                    if let Some(b) = &bind {
                        r.spec.peer_credential = b.clone();
                    }
                    if let Some(t) = &u.peer_token {
                        r.spec.peer_token = (!t.is_empty()).then(|| replicate::store::PeerToken {
                            token: t.clone(),
                            version: u.peer_token_version.clone().unwrap_or_default(),
                            ca: u.peer_ca.clone().filter(|c| !c.is_empty()),
                        });
                    }
                })
                .map_err(internal)?;
            if self.record(&u.name)?.role == Role::Primary {
                self.runners.start(&u.name);
            }
            self.reply(&u.name)
        })
        .await
    }

    async fn delete(
        &self,
        req: Request<control::NameRequest>,
    ) -> Result<Response<control::Status>, Status> {
        super::control_only(&req, "delete")?;
        answer(async {
            let name = req.into_inner().name;
            let r = self.record(&name)?;
            let status = self.status(&r);
            self.runners.stop(&name);
            self.forget_base(&r);
            let ids = self.snapshot_ids_file(&name);
            let _ = std::fs::remove_file(ids.with_extension("cvs"));
            let _ = std::fs::remove_file(ids);
            self.service
                .end_holds(&r.spec.volume, "its replication relationship was deleted");
            self.service.close_sessions_on(&r.spec.volume).await?;
            self.service.store.remove(&name).map_err(internal)?;
            let dir = journal::cycles_dir(self.service.state_dir(), &name);
            journal::discard(&dir);
            let _ = std::fs::remove_dir_all(&dir);
            tracing::info!(relationship = %name, "relationship deleted");
            Ok(status)
        })
        .await
    }

    async fn sync(
        &self,
        req: Request<control::NameRequest>,
    ) -> Result<Response<control::Status>, Status> {
        super::control_only(&req, "sync")?;
        answer(async {
            let name = req.into_inner().name;
            let r = self.record(&name)?;
            if r.role != Role::Primary {
                return Err(ServiceError::FailedPrecondition(format!(
                    "this side of {name:?} is the secondary; cycles run on the primary ({})",
                    r.spec.peer
                )));
            }
            self.runners
                .cycle_now(&name, false, None)
                .await
                .map_err(ServiceError::Aborted)?;
            self.reply(&name)
        })
        .await
    }

    async fn promote(
        &self,
        req: Request<control::PromoteRequest>,
    ) -> Result<Response<control::Status>, Status> {
        super::control_only(&req, "promote")?;
        answer(async {
            let p = req.into_inner();
            let r = self.record(&p.name)?;
            if r.role == Role::Primary && r.halt.is_none() {
                return self.reply(&p.name); // already primary: promote is idempotent
            }
            // No writer may be half way through a cycle while the roles change; a
            // promoted replica is written by its workload, not cycle by cycle.
            self.service
                .end_holds(&r.spec.volume, "the replica was promoted to primary");
            self.service.close_sessions_on(&r.spec.volume).await?;
            let dir = journal::cycles_dir(self.service.state_dir(), &p.name);
            journal::discard(&dir);
            if dir.join("commit.json").exists() {
                journal::apply(&dir).map_err(|e| {
                    ServiceError::Internal(format!(
                        "cannot apply the committed cycle in {}: {e}",
                        dir.display()
                    ))
                })?;
            }
            let applied = journal::applied(&dir);
            match (&applied, p.force) {
                (None, false) => {
                    return Err(ServiceError::FailedPrecondition(format!(
                        "{:?} has no complete cycle here yet: the volume is not a point in time of \
                         the primary. Wait for the first cycle, or promote --force to use it as is",
                        p.name
                    )));
                }
                (Some(a), false) if !journal::handed_over(&r, Some(a)) => {
                    return Err(ServiceError::FailedPrecondition(format!(
                        "the last cycle applied here ({}) is not the final cycle of a demote: the \
                         primary may still be writing. Demote it first (planned failover), or \
                         promote --force if it is gone",
                        a.id
                    )));
                }
                _ => {}
            }
            let epoch = self
                .service
                .epochs
                .highest(&p.name)
                .max(r.epoch)
                .checked_add(1)
                .ok_or_else(|| {
                    ServiceError::FailedPrecondition(format!(
                        "relationship {:?} has reached the highest epoch: delete and create it \
                         again",
                        p.name
                    ))
                })?;
            self.service
                .check_epoch(&p.name, epoch, None, super::fencing::Raise::Any)?;
            let common = applied.as_ref().map_or(0, |a| a.id);
            self.service
                .store
                .update(&p.name, |rec| {
                    rec.role = Role::Primary;
                    rec.epoch = epoch;
                    rec.halt = None;
                    rec.last_cycle = applied.as_ref().map(CycleRecord::from);
                    rec.history.push(EpochChange {
                        epoch,
                        last_common_cycle: common,
                        root: applied.as_ref().map(|a| a.root.clone()).unwrap_or_default(),
                    });
                    // How peers reach this side: `advertise` if set, else the address the
                    // old primary used (recorded with its cycles).
                    if let Some(a) = &self.advertise {
                        rec.this_side = self.side_url(a, &rec.spec.volume);
                    }
                })
                .map_err(internal)?;
            // Its first cycle as primary reads only what is written from now on.
            if let (Some(a), Ok(e), Ok(chunk)) = (
                &applied,
                self.service.export(&r.spec.volume),
                ChunkSize::new(r.spec.chunk_size),
            ) {
                let state = self.service.state_dir();
                let cycle = a.id;
                match blocking(|| {
                    replicate::base::adopt(state, &e.path, &p.name, chunk, cycle, &a.root)
                }) {
                    Ok(true) => {
                        tracing::debug!(relationship = %p.name, cycle, "kept a clone of the cycle promoted from");
                        // Unit CVs for its cycles (a secondary keeps none), in the background.
                        let (path, name) = (e.path.clone(), p.name.clone());
                        std::thread::spawn(move || {
                            super::pages::lower_priority();
                            match replicate::base::record_cvs(&path, &name, chunk) {
                                Ok(n) => {
                                    tracing::debug!(relationship = %name, chunks = n, "unit CVs recorded")
                                }
                                Err(e) => {
                                    tracing::warn!(relationship = %name, "cannot record unit CVs ({e}); changed chunks are read whole")
                                }
                            }
                        });
                    }
                    Ok(false) => {}
                    Err(e) => {
                        tracing::warn!(relationship = %p.name, "cannot keep a clone of the cycle promoted from: {e}")
                    }
                }
            }
            self.runners.start(&p.name);
            tracing::info!(relationship = %p.name, epoch, force = p.force, "promoted");
            self.reply(&p.name)
        })
        .await
    }

    async fn demote(
        &self,
        req: Request<control::NameRequest>,
    ) -> Result<Response<control::Status>, Status> {
        super::control_only(&req, "demote")?;
        answer(async {
            let name = req.into_inner().name;
            let r = self.record(&name)?;
            if r.role == Role::Secondary {
                return self.reply(&name); // already secondary
            }
            let last = self
                .runners
                .cycle_now(&name, true, None)
                .await
                .map_err(|e| {
                    ServiceError::Aborted(format!("the final cycle failed, still primary: {e}"))
                })?;
            self.demoted(&name, last).await?;
            self.reply(&name)
        })
        .await
    }

    async fn cycle_from(
        &self,
        req: Request<control::CycleFromRequest>,
    ) -> Result<Response<control::Status>, Status> {
        super::control_only(&req, "cycle_from")?;
        answer(async {
            let q = req.into_inner();
            let r = self.record(&q.name)?;
            if r.role != Role::Primary {
                return Err(ServiceError::FailedPrecondition(format!(
                    "this side of {:?} is the secondary; cycles run on the primary ({})",
                    q.name, r.spec.peer
                )));
            }
            if !r.spec.snapshots {
                return Err(ServiceError::FailedPrecondition(format!(
                    "{:?} takes its own points in time: it was not created to read snapshots \
                     (Spec snapshots)",
                    q.name
                )));
            }
            // The clone must be on this node already (the kubelet publishes it for the
            // reader pod): until then the export is refused and the caller waits.
            let clone = self.service.export(&q.export)?;
            let ids_file = self.snapshot_ids_file(&q.name);
            if let Some(dir) = ids_file.parent() {
                std::fs::create_dir_all(dir).map_err(internal)?;
            }
            let from = replicate::cycle::SnapshotRead {
                path: clone.path,
                snapshot: q.snapshot,
                point_in_time_ms: q.point_in_time_ms,
                base_snapshot: q.base_snapshot,
                changed: q.changed_known.then(|| {
                    q.changed
                        .iter()
                        .map(|b| b.offset..b.offset.saturating_add(b.length))
                        .collect()
                }),
                ids_file,
            };
            let last = self
                .runners
                .cycle_now(&q.name, q.r#final, Some(from))
                .await
                .map_err(ServiceError::Aborted)?;
            if q.r#final {
                self.demoted(&q.name, last).await?;
            }
            self.reply(&q.name)
        })
        .await
    }

    async fn freeze(
        &self,
        req: Request<control::FreezeRequest>,
    ) -> Result<Response<control::FreezeResponse>, Status> {
        super::control_only(&req, "freeze")?;
        answer(async {
            let q = req.into_inner();
            let r = self.record(&q.name)?;
            let max = std::time::Duration::from_millis(q.max_ms.clamp(1, 60_000));
            // An earlier freeze not thawed (its caller gone): thawed first.
            if let Some(old) = self.frozen.lock().expect("frozen lock").remove(&q.name) {
                let _ = thaw_all(old);
            }
            let mounts = match &r.spec.freeze {
                Some(m) => vec![m.clone()],
                // No device under the kubelet's directory: no pod uses the volume on
                // this node (a workload scaled down before a demote), so nothing
                // writes to it and there is nothing to freeze.
                None => match self.mapped_export(&r.spec.volume)? {
                    None => Vec::new(),
                    Some(export) => {
                        mover_engine::node::freeze::mounts_of(&export.path).map_err(internal)?
                    }
                },
            };
            // Nothing mounted: nothing to record, hold, or thaw later.
            if mounts.is_empty() {
                return Ok(control::FreezeResponse::default());
            }
            let dir = frozen_dir(self.service.state_dir());
            std::fs::create_dir_all(&dir).map_err(internal)?;
            let record = dir.join(mover_engine::node::name_hash(&q.name));
            let text: String = mounts.iter().map(|m| format!("{}\n", m.display())).collect();
            mover_engine::node::write_durably(&record, text.as_bytes()).map_err(internal)?;
            let since = std::time::Instant::now();
            let mut guards = Vec::new();
            for m in &mounts {
                match mover_engine::node::freeze::freeze(m, max) {
                    Ok(g) => guards.push(g),
                    Err(e) => {
                        drop(guards);
                        let _ = std::fs::remove_file(&record);
                        return Err(ServiceError::FailedPrecondition(format!(
                            "cannot freeze {} (mounted from the volume of {:?}): {e}",
                            m.display(),
                            q.name
                        )));
                    }
                }
            }
            tracing::info!(relationship = %q.name, mounts = ?mounts, max_ms = max.as_millis() as u64, "frozen for a point in time");
            let answer = control::FreezeResponse {
                mounts: mounts.iter().map(|m| m.display().to_string()).collect(),
                held_ms: 0,
            };
            let held = Freeze {
                guards,
                mounts,
                since,
                max,
                record,
            };
            self.frozen
                .lock()
                .expect("frozen lock")
                .insert(q.name, held);
            Ok(answer)
        })
        .await
    }

    async fn holders(
        &self,
        req: Request<control::NameRequest>,
    ) -> Result<Response<control::HoldersResponse>, Status> {
        super::control_only(&req, "holders")?;
        answer(async {
            let name = req.into_inner().name;
            let Some(export) = self.mapped_export(&name)? else {
                return Ok(control::HoldersResponse::default());
            };
            let path = export.path.clone();
            let holders = super::service::blocking(|| {
                mover_engine::node::holders::holders(&path, std::process::id())
            })
            .map_err(|e| internal(format!("looking for what holds {}: {e}", path.display())))?;
            Ok(control::HoldersResponse {
                path: path.display().to_string(),
                holders,
            })
        })
        .await
    }

    async fn thaw(
        &self,
        req: Request<control::NameRequest>,
    ) -> Result<Response<control::FreezeResponse>, Status> {
        super::control_only(&req, "thaw")?;
        answer(async {
            let name = req.into_inner().name;
            let Some(held) = self.frozen.lock().expect("frozen lock").remove(&name) else {
                return Ok(control::FreezeResponse::default());
            };
            let (mounts, max) = (held.mounts.clone(), held.max);
            let held_ms = held.since.elapsed().as_millis() as u64;
            let answer = control::FreezeResponse {
                mounts: mounts.iter().map(|m| m.display().to_string()).collect(),
                held_ms,
            };
            match thaw_all(held) {
                Ok(()) => {
                    tracing::info!(relationship = %name, held_ms, "thawed");
                    Ok(answer)
                }
                Err(e) => Err(ServiceError::FailedPrecondition(format!(
                    "the freeze of {} outlasted its bound of {} ms ({e}): the watchdog \
                     thawed it, so what was taken meanwhile is not of a frozen file system",
                    mounts
                        .iter()
                        .map(|m| m.display().to_string())
                        .collect::<Vec<_>>()
                        .join(", "),
                    max.as_millis()
                ))),
            }
        })
        .await
    }

    async fn resync(
        &self,
        req: Request<control::ResyncRequest>,
    ) -> Result<Response<control::Status>, Status> {
        super::control_only(&req, "resync")?;
        answer(async {
            let q = req.into_inner();
            let r = self.record(&q.name)?;
            if r.role == Role::Secondary {
                return self.reply(&q.name);
            }
            if r.halt.is_none() && !q.discard_local {
                return Err(ServiceError::FailedPrecondition(format!(
                    "this side is the active primary of {:?}; for a planned failover demote it, \
                     or resync --discard-local to throw its data away for the peer's",
                    q.name
                )));
            }
            self.runners.stop(&q.name);
            let export = self.service.export(&r.spec.volume)?;
            // Did this side write after the last cycle both sides hold? Its clone of that
            // cycle says where, without reading the volume (and seals an index for it).
            if export.path.is_dir() && !q.discard_local {
                return Err(ServiceError::FailedPrecondition(format!(
                    "this side of {:?} is a file tree: mover cannot tell whether it was written \
                     since its last cycle. Save what you need from it, then `resync \
                     --discard-local`: the peer's cycles then make it equal to the peer's tree \
                     (only files that differ are sent)",
                    q.name
                )));
            }
            let settled = self.settle(&r).await;
            let mut dirty = Vec::new();
            let common = match (settled, &r.last_cycle) {
                _ if export.path.is_dir() => None,
                (Some(written), Some(c)) if written.is_empty() => Some(c.clone()),
                (Some(written), Some(c)) if q.discard_local => {
                    // The new primary ships these back with its own changes.
                    dirty = written.iter().map(|w| (w.start, w.end)).collect();
                    Some(c.clone())
                }
                _ => self.common_by_hashing(&r, &export).await?,
            };
            let unchanged = common.is_some();
            if !unchanged && !q.discard_local {
                self.service
                    .store
                    .update(&q.name, |rec| rec.halt = Some(Halt::SplitBrain))
                    .map_err(internal)?;
                return Err(ServiceError::FailedPrecondition(format!(
                    "split brain: this side of {:?} was written after its last common cycle with \
                     the peer ({}), and the peer was promoted since. Save what you need from this \
                     volume, then `resync --discard-local` to replace it with the peer's data",
                    q.name,
                    r.last_cycle
                        .as_ref()
                        .map_or("none".into(), |c| c.id.to_string())
                )));
            }
            // From here on this side is the secondary: its clone of its last cycle goes (kept
            // until now for a retry after a refusal).
            self.forget_base(&r);
            let dir = journal::cycles_dir(self.service.state_dir(), &q.name);
            if let Some(c) = &common {
                let mut applied = journal::AppliedCycle::of(&q.name, c, r.epoch);
                applied.dirty = dirty;
                journal::record_applied(&dir, &applied).map_err(internal)?;
            } else {
                journal::forget_applied(&dir).map_err(internal)?;
            }
            self.service
                .store
                .update(&q.name, |rec| {
                    rec.role = Role::Secondary;
                    rec.halt = None;
                })
                .map_err(internal)?;
            tracing::info!(relationship = %q.name, discard_local = q.discard_local, "resynced: now secondary");
            self.reply(&q.name)
        })
        .await
    }

    async fn export(
        &self,
        req: Request<control::ExportRequest>,
    ) -> Result<Response<control::ExportResponse>, Status> {
        super::control_only(&req, "export")?;
        answer(async {
            let q = req.into_inner();
            let path = std::path::PathBuf::from(&q.path);
            let exports = &self.service.exports;
            // A registration moved to another path while in use would pull the volume from
            // under its relationship: refused until that is deleted.
            if let Some(was) = exports.registered_path(&q.name).filter(|p| *p != path)
                && let Some(user) = self.user_of(&q.name)
            {
                return Err(ServiceError::FailedPrecondition(format!(
                    "export {:?} is registered at {} and used by {user}: delete that first to \
                     register it at {}",
                    q.name,
                    was.display(),
                    path.display()
                )));
            }
            if let Some(was) = exports
                .registered_for(&q.name)
                .filter(|r| *r != q.relationship)
                && let Some(user) = self.user_of(&q.name)
            {
                return Err(ServiceError::FailedPrecondition(format!(
                    "export {:?} is registered for relationship {was:?} and used by {user}: \
                     delete that first to register it for {:?}",
                    q.name, q.relationship
                )));
            }
            let before = exports.registered_path(&q.name);
            let bound = peer_credential(&q.peer_credential)?;
            let registered = exports
                .register(&q.name, &path, q.block, &q.relationship, bound.as_deref())
                .map_err(|e| match e {
                    crate::agent::ExportError::Save { .. } => internal(e),
                    _ => ServiceError::PermissionDenied(e.to_string()),
                })?;
            // Registered again on every look of the controller: only a change is news.
            if registered && before.as_deref() != Some(path.as_path()) {
                tracing::info!(export = %q.name, path = %path.display(), block = q.block, "export registered");
            }
            Ok(self.export_reply(&q.name, registered))
        })
        .await
    }

    async fn unexport(
        &self,
        req: Request<control::NameRequest>,
    ) -> Result<Response<control::ExportResponse>, Status> {
        super::control_only(&req, "unexport")?;
        answer(async {
            let name = req.into_inner().name;
            let exports = &self.service.exports;
            if exports.registered_path(&name).is_none() {
                // Named in agent.toml, or not registered (any more): nothing to do.
                return Ok(self.export_reply(&name, false));
            }
            if let Some(user) = self.user_of(&name) {
                return Err(ServiceError::FailedPrecondition(format!(
                    "export {name:?} is used by {user}: delete that first"
                )));
            }
            exports.unregister(&name).map_err(internal)?;
            tracing::info!(export = %name, "export unregistered");
            Ok(control::ExportResponse {
                name,
                path: String::new(),
                registered: false,
            })
        })
        .await
    }
}
