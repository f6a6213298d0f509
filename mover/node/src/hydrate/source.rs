//! Where a hydrating volume's data comes from: a peer agent's export, or a block
//! snapshot in a repository (local or S3). A source answers in whole regions (its chunk
//! size), with only the data: the caller makes the region zero first where it must.

use super::HydrateError;
use chunker::ChunkKind;
use mover_engine::{
    error::RemoteCode,
    remote::{AgentUrl, RemoteOptions, status_error},
};
use snapshots::{Bytes, CHUNKS_PER_LIST, Content as SnapContent, Index, Repository};
use std::{
    collections::HashMap,
    sync::{Arc, Mutex, atomic::Ordering::Relaxed},
};
use tokio_stream::StreamExt;
use transport::{
    frames::{self, Content},
    proto::{self, Access},
};

/// Data at an offset of the volume.
pub type Piece = (u64, Bytes);

/// A volume to hydrate from.
#[tonic::async_trait]
pub trait RegionSource: Send + Sync {
    /// What it is, for status and errors.
    fn describe(&self) -> String;
    /// The volume's size in bytes.
    fn size(&self) -> u64;
    /// The region (chunk) size the source answers in.
    fn region_size(&self) -> u64;
    /// One flag per region: it may hold data (false: a hole, zeros).
    async fn allocation(&self) -> Result<Vec<bool>, HydrateError>;
    /// The data of regions `first .. first + count` (zero pages may be left out);
    /// `urgent`: a client waits for it (it must not queue behind the filler's fetches).
    async fn fetch(&self, first: u64, count: u64, urgent: bool)
    -> Result<Vec<Piece>, HydrateError>;
    /// The hydration is over for now (cancelled) or for good (`complete`): lets the
    /// source release what it holds for it (an agent's session and its open file; once
    /// complete, a replica's held cycle, which a cancelled fill needs to resume).
    async fn close(&self, _complete: bool) {}
    /// A replica's cycle the source reads, held for this fill.
    fn held_cycle(&self) -> Option<u64> {
        None
    }
}

/// An export of a peer agent, read through a ranges-only READ session (no hashing of
/// the volume on the peer); the session is reopened when the peer lost it (restarted).
pub struct AgentSource {
    url: AgentUrl,
    remote: RemoteOptions,
    region: u64,
    size: u64,
    session: tokio::sync::Mutex<Option<(mover_engine::remote::Client, String)>>,
    /// A second connection for fetches a client waits for.
    urgent: tokio::sync::Mutex<Option<mover_engine::remote::Client>>,
    /// A replica, read at the cycle its agent holds for this fill (the cycle learnt
    /// from the first session, or kept from before a restart).
    replica: Option<super::ReplicaHold>,
    /// The relationship it is read for, when not a replica's [default: hydrate:VOLUME].
    reader: Option<String>,
    held: std::sync::atomic::AtomicU64,
}

impl AgentSource {
    /// Connects to `url` and opens a session with `region`-sized chunks; a `replica` is
    /// read at the cycle its agent holds for this fill.
    pub async fn connect(
        url: AgentUrl,
        remote: RemoteOptions,
        region: u64,
        replica: Option<super::ReplicaHold>,
        reader: Option<String>,
    ) -> Result<Self, HydrateError> {
        let held = replica.as_ref().map_or(0, |r| r.cycle);
        let s = AgentSource {
            url,
            remote,
            region,
            size: 0,
            session: tokio::sync::Mutex::new(None),
            urgent: tokio::sync::Mutex::new(None),
            replica,
            reader,
            held: held.into(),
        };
        let (client, id, size) = s.open().await?;
        *s.session.lock().await = Some((client, id));
        Ok(AgentSource { size, ..s })
    }

    async fn open(&self) -> Result<(mover_engine::remote::Client, String, u64), HydrateError> {
        let mut client = self
            .remote
            .connect(&self.url)
            .await
            .map_err(|e| self.err(e))?;
        let held = self.held.load(Relaxed);
        let open = client
            .open(proto::OpenRequest {
                volume: self.url.volume.clone(),
                relationship: match &self.replica {
                    Some(r) => r.relationship.clone(),
                    None => self
                        .reader
                        .clone()
                        .unwrap_or_else(|| format!("hydrate:{}", self.url.volume)),
                },
                access: Access::Read as i32,
                chunk_size: self.region,
                ranges_only: true,
                hold: self
                    .replica
                    .as_ref()
                    .map(|r| r.hold.clone())
                    .unwrap_or_default(),
                held_cycle: held,
                ..Default::default()
            })
            .await
            .map_err(|s| self.err(status_error(&self.url, s)))?
            .into_inner();
        if self.replica.is_some() {
            let now = open.held.as_ref().map_or(0, |h| h.id);
            if now == 0 || (held != 0 && now != held) {
                return Err(HydrateError::Source {
                    source_name: self.describe(),
                    message: format!(
                        "the replica's agent holds cycle {now} for this fill, which read cycle \
                         {held}: it must be filled again from the beginning"
                    ),
                    retryable: false,
                });
            }
            self.held.store(now, Relaxed);
        }
        if self.size != 0 && open.size != self.size {
            return Err(HydrateError::Source {
                source_name: self.describe(),
                message: format!(
                    "the volume is now {} bytes, it was {} when the hydration started",
                    open.size, self.size
                ),
                retryable: false,
            });
        }
        Ok((client, open.session, open.size))
    }

    /// The current session, opened anew if there is none.
    async fn session(&self) -> Result<(mover_engine::remote::Client, String), HydrateError> {
        let mut s = self.session.lock().await;
        if s.is_none() {
            let (c, id, _) = self.open().await?;
            *s = Some((c, id));
        }
        Ok(s.clone().expect("set above"))
    }

    /// The connection for urgent fetches (`fallback`, the filler's, until it is made).
    async fn urgent_client(
        &self,
        fallback: mover_engine::remote::Client,
    ) -> mover_engine::remote::Client {
        let mut u = self.urgent.lock().await;
        if u.is_none() {
            match self.remote.connect(&self.url).await {
                Ok(c) => *u = Some(c),
                Err(e) => tracing::debug!("no second connection to {} ({e})", self.url),
            }
        }
        u.clone().unwrap_or(fallback)
    }

    /// Forgets the session after an error, so the next call opens a new one.
    async fn forget(&self, id: &str) {
        let mut s = self.session.lock().await;
        if s.as_ref().is_some_and(|(_, i)| i == id) {
            if let Some((c, id)) = s.take() {
                // Best effort: the source agent may be what failed.
                tokio::spawn(finish_session(c, id, false));
            }
            *self.urgent.lock().await = None;
        }
    }

    fn err(&self, e: mover_engine::CopyError) -> HydrateError {
        HydrateError::Source {
            source_name: self.describe(),
            // A lost session is opened anew.
            retryable: e.is_retryable()
                || matches!(
                    e,
                    mover_engine::CopyError::Remote {
                        refusal: Some(transport::refusal::Refusal::NoSession),
                        ..
                    }
                ),
            message: e.to_string(),
        }
    }

    async fn try_fetch(
        &self,
        client: &mut mover_engine::remote::Client,
        session: &str,
        first: u64,
        count: u64,
    ) -> Result<Vec<Piece>, mover_engine::CopyError> {
        let url = &self.url;
        let mut stream = client
            .read(proto::ReadRequest {
                session: session.into(),
                chunks: (first..first + count).collect(),
                page_hashes: Default::default(),
                raw: false,
            })
            .await
            .map_err(|s| status_error(url, s))?
            .into_inner();
        let (start, end) = (
            first * self.region,
            ((first + count) * self.region).min(self.size),
        );
        let mut out = Vec::new();
        while let Some(frame) = stream.next().await {
            let frame = frame.map_err(|s| status_error(url, s))?;
            let protocol = |message: String| mover_engine::CopyError::Remote {
                url: url.to_string(),
                code: RemoteCode::Protocol,
                message,
                refusal: None,
            };
            if frame.offset < start || frame.offset.saturating_add(frame.len) > end {
                return Err(protocol(format!(
                    "frame at {}+{} is outside the regions asked ({start}..{end})",
                    frame.offset, frame.len
                )));
            }
            match frames::content(&frame).map_err(protocol)? {
                Content::Bytes(b) => out.push((frame.offset, b)),
                Content::Zeros(_) => {} // the caller made the regions zero already
            }
        }
        Ok(out)
    }
}

#[tonic::async_trait]
impl RegionSource for AgentSource {
    fn describe(&self) -> String {
        self.url.to_string()
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn region_size(&self) -> u64 {
        self.region
    }

    async fn allocation(&self) -> Result<Vec<bool>, HydrateError> {
        let regions = self.size.div_ceil(self.region);
        let (mut client, id) = self.session().await?;
        let mut out = Vec::with_capacity(regions as usize);
        while (out.len() as u64) < regions {
            let first = out.len() as u64;
            let count = (regions - first).min(8 << 20);
            let r = client
                .allocation(proto::AllocationRequest {
                    session: id.clone(),
                    first,
                    count,
                })
                .await;
            let bits = match r {
                Ok(r) => r.into_inner().data,
                Err(s) => {
                    self.forget(&id).await;
                    return Err(self.err(status_error(&self.url, s)));
                }
            };
            out.extend((0..count).map(|i| {
                bits.get((i / 8) as usize)
                    .is_some_and(|b| b & (1 << (i % 8)) != 0)
            }));
        }
        Ok(out)
    }

    async fn fetch(
        &self,
        first: u64,
        count: u64,
        urgent: bool,
    ) -> Result<Vec<Piece>, HydrateError> {
        let (mut client, id) = self.session().await?;
        if urgent {
            // Its own connection: HTTP/2 would interleave it with the filler's megabytes.
            client = self.urgent_client(client).await;
        }
        match self.try_fetch(&mut client, &id, first, count).await {
            Ok(p) => Ok(p),
            Err(e) => {
                self.forget(&id).await;
                Err(self.err(e))
            }
        }
    }

    async fn close(&self, complete: bool) {
        *self.urgent.lock().await = None;
        let session = self.session.lock().await.take();
        let release = complete && self.replica.is_some();
        match session {
            Some((c, id)) => finish_session(c, id, release).await,
            // The held cycle is released through a session of its own.
            None if release => {
                if let Ok((c, id, _)) = self.open().await {
                    finish_session(c, id, true).await;
                }
            }
            None => {}
        }
    }

    fn held_cycle(&self) -> Option<u64> {
        self.replica.as_ref().map(|_| self.held.load(Relaxed))
    }
}

/// A block snapshot in a repository. Chunk lists are read as regions are asked for and
/// the last few are kept, so memory does not grow with the volume.
pub struct SnapshotSource {
    repo: Arc<Repository>,
    index: Arc<Index>,
    snapshot: String,
    size: u64,
    region: u64,
    lists: Vec<String>,
    per_list: u64,
    cached: Mutex<HashMap<usize, Arc<Vec<ChunkKind>>>>,
}

impl SnapshotSource {
    /// Opens snapshot `snap` (an id or unique prefix) of `repo`.
    pub async fn open(repo: Arc<Repository>, snap: &str) -> Result<Self, HydrateError> {
        let e = |e: snapshots::RepoError| HydrateError::Source {
            source_name: format!("{} snapshot {snap}", repo.location()),
            retryable: false,
            message: e.to_string(),
        };
        let s = repo.find_snapshot(snap).await.map_err(e)?;
        let index = Arc::new(repo.load_index().await.map_err(e)?);
        let SnapContent::Block {
            size,
            chunk_size,
            chunks_per_list,
            lists,
        } = s.manifest.content
        else {
            return Err(HydrateError::Source {
                source_name: format!("{} snapshot {}", repo.location(), s.id),
                retryable: false,
                message: "is a file tree's snapshot; hydrate serves block volumes (restore \
                    a tree with `mover snapshot restore`)"
                    .into(),
            });
        };
        if chunks_per_list != CHUNKS_PER_LIST && lists.len() > 1 {
            return Err(HydrateError::Source {
                source_name: format!("{} snapshot {}", repo.location(), s.id),
                retryable: false,
                message: format!("unexpected chunks per list {chunks_per_list}"),
            });
        }
        Ok(SnapshotSource {
            repo,
            index,
            snapshot: s.id,
            size,
            region: chunk_size,
            lists,
            per_list: chunks_per_list.max(1),
            cached: Mutex::default(),
        })
    }

    fn err(&self, e: snapshots::RepoError) -> HydrateError {
        HydrateError::Source {
            source_name: self.describe(),
            retryable: e.is_retryable(),
            message: e.to_string(),
        }
    }

    async fn list(&self, li: usize) -> Result<Arc<Vec<ChunkKind>>, HydrateError> {
        if let Some(l) = self.cached.lock().expect("list cache").get(&li) {
            return Ok(l.clone());
        }
        let name = self.lists.get(li).ok_or_else(|| HydrateError::Source {
            source_name: self.describe(),
            retryable: false,
            message: format!("the snapshot has no chunk list {li}"),
        })?;
        let l = Arc::new(
            self.repo
                .read_list(&self.index, name)
                .await
                .map_err(|e| self.err(e))?,
        );
        let mut c = self.cached.lock().expect("list cache");
        if c.len() >= 4 {
            c.clear();
        }
        c.insert(li, l.clone());
        Ok(l)
    }

    async fn kind(&self, chunk: u64) -> Result<ChunkKind, HydrateError> {
        let l = self.list((chunk / self.per_list) as usize).await?;
        l.get((chunk % self.per_list) as usize)
            .copied()
            .ok_or_else(|| HydrateError::Source {
                source_name: self.describe(),
                retryable: false,
                message: format!("chunk {chunk} is missing from the snapshot's lists"),
            })
    }
}

#[tonic::async_trait]
impl RegionSource for SnapshotSource {
    fn describe(&self) -> String {
        format!("{} snapshot {}", self.repo.location(), self.snapshot)
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn region_size(&self) -> u64 {
        self.region
    }

    async fn allocation(&self) -> Result<Vec<bool>, HydrateError> {
        let regions = self.size.div_ceil(self.region);
        let mut out = Vec::with_capacity(regions as usize);
        for li in 0..self.lists.len() {
            let l = self.list(li).await?;
            out.extend(l.iter().map(|k| matches!(k, ChunkKind::Data(_))));
        }
        out.resize(regions as usize, true);
        Ok(out)
    }

    async fn fetch(
        &self,
        first: u64,
        count: u64,
        _urgent: bool,
    ) -> Result<Vec<Piece>, HydrateError> {
        let mut out = Vec::new();
        for c in first..first + count {
            if let ChunkKind::Data(id) = self.kind(c).await? {
                let b = self
                    .repo
                    .read_chunk(&self.index, &id)
                    .await
                    .map_err(|e| self.err(e))?;
                out.push((c * self.region, b));
            }
        }
        Ok(out)
    }
}

/// The source of a hydration resumed after a restart: opened on first use, so a source
/// that is down does not keep the export from being served (its missing regions read
/// as EIO until the source is back).
pub struct Lazy {
    spec: super::SourceSpec,
    size: u64,
    region: u64,
    owner: std::sync::Weak<super::Hydrations>,
    cell: tokio::sync::OnceCell<Arc<dyn RegionSource>>,
}

impl Lazy {
    /// A source that `owner` opens from `spec` when first asked.
    pub(super) fn new(
        spec: super::SourceSpec,
        size: u64,
        region: u64,
        owner: Arc<super::Hydrations>,
    ) -> Self {
        Lazy {
            spec,
            size,
            region,
            owner: Arc::downgrade(&owner),
            cell: tokio::sync::OnceCell::new(),
        }
    }

    async fn get(&self) -> Result<&Arc<dyn RegionSource>, HydrateError> {
        self.cell
            .get_or_try_init(|| async {
                let owner = self.owner.upgrade().ok_or_else(|| HydrateError::Source {
                    source_name: self.describe(),
                    message: "the agent is shutting down".into(),
                    retryable: false,
                })?;
                let s = owner.reopen(&self.spec, self.region).await?;
                if s.size() != self.size || s.region_size() != self.region {
                    return Err(HydrateError::Source {
                        source_name: self.describe(),
                        message: format!(
                            "it is now {} bytes in regions of {}; the hydration started with {} in regions of {}",
                            s.size(),
                            s.region_size(),
                            self.size,
                            self.region
                        ),
                        retryable: false,
                    });
                }
                Ok(s)
            })
            .await
    }
}

/// Ends a ranges-only session on the source agent (it holds the volume open).
/// Ends a source session, and with `release` the replica's cycle it held.
async fn finish_session(mut client: mover_engine::remote::Client, session: String, release: bool) {
    let finish = client.finish(proto::FinishRequest {
        session,
        release_hold: release,
        ..Default::default()
    });
    if let Ok(Err(e)) = tokio::time::timeout(std::time::Duration::from_secs(10), finish).await {
        tracing::debug!("cannot end the source session: {e}");
    }
}

#[tonic::async_trait]
impl RegionSource for Lazy {
    fn describe(&self) -> String {
        match &self.spec {
            super::SourceSpec::Agent { url, .. } => url.clone(),
            super::SourceSpec::Snapshot { repo, snapshot, .. } => {
                format!("{repo} snapshot {snapshot}")
            }
        }
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn region_size(&self) -> u64 {
        self.region
    }

    async fn allocation(&self) -> Result<Vec<bool>, HydrateError> {
        self.get().await?.allocation().await
    }

    async fn fetch(
        &self,
        first: u64,
        count: u64,
        urgent: bool,
    ) -> Result<Vec<Piece>, HydrateError> {
        self.get().await?.fetch(first, count, urgent).await
    }

    async fn close(&self, complete: bool) {
        if let Some(s) = self.cell.get() {
            s.close(complete).await;
        }
    }

    fn held_cycle(&self) -> Option<u64> {
        self.cell.get().and_then(|s| s.held_cycle())
    }
}
