//! The hydrations of an agent: started through its control API, persisted in its state
//! directory (a record and a bitmap per export), resumed when the agent restarts.

use super::{
    HydrateError,
    bitmap::BitmapFile,
    engine::{FillOptions, Hydration, Phase},
    source::{AgentSource, RegionSource, SnapshotSource},
};
use chunker::durable::sync_dir;
use mover_engine::{
    node::{Exports, write_durably},
    remote::{AgentUrl, RemoteOptions},
    snapshot::RepoOptions,
};
use serde::{Deserialize, Serialize};
use std::{
    collections::{HashMap, HashSet},
    io,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

const RECORD_VERSION: u32 = 1;

/// Where a hydration's data comes from, as persisted.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SourceSpec {
    /// An export of a peer agent.
    Agent {
        /// agent://HOST:PORT/VOLUME
        url: String,
        /// An agent of another cluster: the token presented there and that cluster's CA
        /// [default: this agent's own credentials].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        peer: Option<PeerAccess>,
        /// The export is a replica, read at one held cycle.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        replica: Option<ReplicaHold>,
        /// The relationship the export is read for [default: hydrate:VOLUME] (mover's
        /// populator: hydrate:NAMESPACE/PVC, the PVC it fills).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reader: Option<String>,
    },
    /// A block snapshot in a repository (files named are on this agent's node).
    Snapshot {
        /// A directory or s3://BUCKET/PREFIX.
        repo: String,
        /// Snapshot id (or unique prefix).
        snapshot: String,
        /// S3 endpoint.
        s3_endpoint: Option<String>,
        /// S3 region.
        s3_region: Option<String>,
        /// Virtual-host style S3 addressing.
        s3_virtual_host: bool,
        /// Repository password file.
        password_file: Option<PathBuf>,
        /// Repository raw key file.
        key_file: Option<PathBuf>,
        /// The password (or key) and S3 keys given inline instead.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        access: Option<RepoAccess>,
    },
}

/// A replica read as of one of its cycles, which its agent holds for this fill.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ReplicaHold {
    /// The replication relationship whose secondary the export is.
    pub relationship: String,
    /// The hold's name on the source agent (the filled export's).
    pub hold: String,
    /// The cycle held, once the source has said (0: not yet).
    #[serde(default)]
    pub cycle: u64,
}

impl SourceSpec {
    /// Whether `self` and `other` name the same source (a replica's held cycle aside:
    /// a restart asks again without it).
    pub fn same_source(&self, other: &SourceSpec) -> bool {
        let unpinned = |s: &SourceSpec| {
            let mut s = s.clone();
            if let SourceSpec::Agent {
                replica: Some(r), ..
            } = &mut s
            {
                r.cycle = 0;
            }
            s
        };
        unpinned(self) == unpinned(other)
    }
}

/// A repository's password (or raw key) and S3 keys, given to the agent inline (kept in
/// the hydration's record, which only root reads).
#[derive(Clone, Serialize, Deserialize, PartialEq)]
pub struct RepoAccess {
    /// The password, or with `raw_key` the key.
    pub password: Vec<u8>,
    /// `password` is a raw key.
    #[serde(default)]
    pub raw_key: bool,
    /// S3 access key id and secret (None: the standard credential chain).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s3_keys: Option<(String, String)>,
}

impl std::fmt::Debug for RepoAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RepoAccess")
            .field("password", &"(hidden)")
            .field("s3_keys", &self.s3_keys.as_ref().map(|(id, _)| id))
            .finish()
    }
}

/// How to reach an agent of another cluster (kept in the hydration's record, which only
/// root reads, as relationships keep their peer tokens).
#[derive(Clone, Serialize, Deserialize, PartialEq)]
pub struct PeerAccess {
    /// The bearer token presented to it.
    pub token: String,
    /// Its cluster's CA (PEM), trusted alone for it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
}

impl std::fmt::Debug for PeerAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerAccess")
            .field("token", &"(hidden)")
            .field("ca", &self.ca.is_some())
            .finish()
    }
}

/// What to hydrate and how.
#[derive(Clone, Debug)]
pub struct StartRequest {
    /// The export to fill.
    pub export: String,
    /// Where from.
    pub source: SourceSpec,
    /// Region size for an agent source (0: 1 MiB).
    pub region_size: u64,
    /// Filler settings.
    pub bwlimit: Option<u64>,
    /// Filler requests in flight (0: 4).
    pub concurrency: usize,
    /// Replace what the export holds.
    pub overwrite: bool,
}

/// A hydration's record in the state directory.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Record {
    version: u32,
    export: String,
    path: PathBuf,
    source: SourceSpec,
    size: u64,
    region_size: u64,
    fresh: bool,
    bwlimit: Option<u64>,
    concurrency: usize,
    cancelled: bool,
}

/// A metric: name, help, and its value from a hydration's progress.
type Series = (&'static str, &'static str, fn(&super::Progress) -> f64);

/// The agent's hydrations.
pub struct Hydrations {
    dir: PathBuf,
    exports: Exports,
    remote: RemoteOptions,
    /// Each known hydration with the source it was started from (a complete one has no
    /// record to say it).
    active: Mutex<HashMap<String, (Arc<Hydration>, SourceSpec)>>,
    /// Exports a start is under way for: two starts of one export never race.
    starting: Mutex<HashSet<String>>,
}

/// An export reserved by a start; released when the start returns.
struct Starting<'a>(&'a Hydrations, String);

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        self.0
            .starting
            .lock()
            .expect("starting lock")
            .remove(&self.1);
    }
}

impl Hydrations {
    /// The hydrations kept under `state_dir`, for `exports`, reaching peers with `remote`.
    pub fn new(state_dir: &Path, exports: Exports, remote: RemoteOptions) -> io::Result<Arc<Self>> {
        let dir = state_dir.join("hydrate");
        std::fs::create_dir_all(&dir)?;
        Ok(Arc::new(Hydrations {
            dir,
            exports,
            remote,
            active: Mutex::default(),
            starting: Mutex::default(),
        }))
    }

    fn record_path(&self, export: &str) -> PathBuf {
        self.dir.join(format!("{export}.json"))
    }

    fn bitmap_path(&self, export: &str) -> PathBuf {
        self.dir.join(format!("{export}.bitmap"))
    }

    /// The hydration of `export`, if one is known (running, cancelled or complete).
    pub fn get(&self, export: &str) -> Option<Arc<Hydration>> {
        self.active
            .lock()
            .expect("hydrations lock")
            .get(export)
            .map(|(h, _)| h.clone())
    }

    /// Whether the known hydration of `export` was started from `source`.
    fn started_from(&self, export: &str, source: &SourceSpec) -> bool {
        self.active
            .lock()
            .expect("hydrations lock")
            .get(export)
            .is_some_and(|(_, s)| s.same_source(source))
    }

    /// Every hydration known, by export name.
    pub fn all(&self) -> Vec<Arc<Hydration>> {
        let mut v: Vec<_> = self
            .active
            .lock()
            .expect("hydrations lock")
            .values()
            .map(|(h, _)| h.clone())
            .collect();
        v.sort_by(|a, b| a.name().cmp(b.name()));
        v
    }

    /// Prometheus text for every hydration: regions present and in all, bytes
    /// fetched, and whether it is degraded.
    pub fn render(&self) -> String {
        let all = self.all();
        if all.is_empty() {
            return String::new();
        }
        let mut out = String::new();
        let series: [Series; 4] = [
            (
                "mover_hydration_regions_present",
                "Regions of the export that are here.",
                |p| p.present as f64,
            ),
            ("mover_hydration_regions", "Regions of the export.", |p| {
                p.regions as f64
            }),
            (
                "mover_hydration_fetched_bytes",
                "Bytes fetched from the source by this run of the agent.",
                |p| p.bytes_fetched as f64,
            ),
            (
                "mover_hydration_degraded",
                "1 while the source cannot be reached or fails.",
                |p| (p.phase == Phase::Degraded) as u8 as f64,
            ),
        ];
        for (name, help, value) in series {
            out += &format!("# HELP {name} {help}\n# TYPE {name} gauge\n");
            for h in &all {
                let export = mover_engine::node::label_value(h.name());
                out += &format!("{name}{{export=\"{export}\"}} {}\n", value(&h.progress()));
            }
        }
        out
    }

    /// Resumes the hydrations left by the previous run of the agent (their sources are
    /// reached lazily: a source that is down leaves the export served, Degraded).
    pub async fn resume_all(self: &Arc<Self>) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let record = match load_record(&p) {
                Ok(r) if r.version == RECORD_VERSION => r,
                Ok(r) => {
                    tracing::error!(record = %p.display(), version = r.version, "hydration record of an unknown version: left alone");
                    continue;
                }
                Err(e) => {
                    tracing::error!(record = %p.display(), "unreadable hydration record ({e}): left alone");
                    continue;
                }
            };
            let name = record.export.clone();
            match self.launch(record, None).await {
                Ok(h) => {
                    let p = h.progress();
                    tracing::info!(export = %name, present = p.present, regions = p.regions, "hydration resumed");
                }
                Err(e) => tracing::error!(export = %name, "cannot resume the hydration: {e}"),
            }
        }
    }

    /// Starts (or resumes) a hydration.
    pub async fn start(
        self: &Arc<Self>,
        req: StartRequest,
    ) -> Result<Arc<Hydration>, HydrateError> {
        let refused = |why: String| HydrateError::Refused {
            what: format!("hydration of export {}", req.export),
            why,
        };
        let export = self
            .exports
            .get(&req.export)
            .map_err(|e| refused(e.to_string()))?;
        if export.read_only {
            return Err(refused("the export is read-only".into()));
        }
        if export.path.is_dir() {
            return Err(refused(format!(
                "{} is a directory (a file tree); hydration serves block volumes",
                export.path.display()
            )));
        }
        if !self
            .starting
            .lock()
            .expect("starting lock")
            .insert(req.export.clone())
        {
            return Err(refused("another start of it is under way".into()));
        }
        let _reserved = Starting(self, req.export.clone());
        if let Some(h) = self.get(&req.export) {
            let p = h.progress();
            // Started again after it completed (a cancel that came too late, or a
            // retried start): the volume is already whole from that source. With
            // overwrite the caller wants the source's data again, over what clients
            // wrote since: a fresh hydration (a complete one left no record).
            if p.phase == Phase::Complete
                && !req.overwrite
                && self.started_from(&req.export, &req.source)
            {
                return Ok(h);
            }
            if p.phase != Phase::Complete && p.phase != Phase::Cancelled {
                return Err(refused(format!(
                    "it is already hydrating from {} ({}/{} regions)",
                    h.source(),
                    p.present,
                    p.regions
                )));
            }
            // A cancelled one's last fetches and commit must land before a new object
            // takes over the volume and its bitmap: a region a client's request marked
            // present after the cancel's commit would otherwise be fetched again, over
            // what the client wrote.
            h.quiesce().await;
            h.commit().await.map_err(|e| self.state_err(e))?;
        }
        // A record left by a cancel or a crash: resumed if the source is the same.
        if let Ok(mut old) = load_record(&self.record_path(&req.export)) {
            if !old.source.same_source(&req.source) {
                return Err(refused(format!(
                    "an unfinished hydration from another source ({:?}) holds it; start it again from that source, or remove {} to start over",
                    old.source,
                    self.record_path(&req.export).display()
                )));
            }
            old.cancelled = false;
            old.bwlimit = req.bwlimit;
            if req.concurrency > 0 {
                old.concurrency = req.concurrency;
            }
            self.save(&old).map_err(|e| self.state_err(e))?;
            let source = self.connect(&old.source, old.region_size).await?;
            return self.launch(old, Some(source)).await;
        }
        let region = if req.region_size == 0 {
            1 << 20
        } else {
            req.region_size
        };
        let source = self.connect(&req.source, region).await?;
        let (size, region) = (source.size(), source.region_size());
        // A replica's held cycle is kept with the record: a fill resumed after a restart
        // reads that cycle, or none.
        let mut spec = req.source.clone();
        if let SourceSpec::Agent {
            replica: Some(r), ..
        } = &mut spec
        {
            r.cycle = source.held_cycle().unwrap_or(0);
        }
        let fresh = prepare_local(&export.path, size, req.overwrite).map_err(refused)?;
        let record = Record {
            version: RECORD_VERSION,
            export: req.export.clone(),
            path: export.path.clone(),
            source: spec,
            size,
            region_size: region,
            fresh,
            bwlimit: req.bwlimit,
            concurrency: if req.concurrency == 0 {
                4
            } else {
                req.concurrency
            },
            cancelled: false,
        };
        BitmapFile::create(
            &self.bitmap_path(&req.export),
            size.div_ceil(region),
            region,
        )
        .map_err(|e| self.state_err(e))?;
        self.save(&record).map_err(|e| self.state_err(e))?;
        self.launch(record, Some(source)).await
    }

    /// Stops a hydration: nothing more is fetched until it is started again (it resumes
    /// where it stopped). NBD opens no new connection to it meanwhile; a device in use
    /// keeps serving what arrived.
    pub async fn cancel(&self, export: &str) -> Result<Arc<Hydration>, HydrateError> {
        let h = self.get(export).ok_or_else(|| HydrateError::Refused {
            what: format!("cancel of export {export}"),
            why: "it is not hydrating".into(),
        })?;
        // The phase changes first, under the lock the filler's completion takes: a fill
        // that completes meanwhile keeps its Complete (and forgets its record), and one
        // cancelled never completes, so the record saved below is not removed.
        if !h.cancel() {
            return Ok(h);
        }
        if let Ok(mut r) = load_record(&self.record_path(export)) {
            r.cancelled = true;
            self.save(&r).map_err(|e| self.state_err(e))?;
        }
        let _ = h.commit().await;
        Ok(h)
    }

    /// Forgets the hydration of `export`, if it has one: its fill is stopped and waited
    /// for, and its record and bitmap removed (the export and its image are the
    /// caller's). False if it had none.
    pub async fn forget(&self, export: &str) -> Result<bool, HydrateError> {
        if self
            .starting
            .lock()
            .expect("starting lock")
            .contains(export)
        {
            return Err(HydrateError::Refused {
                what: format!("deletion of export {export}"),
                why: "a start of its hydration is under way; try again once it returns".into(),
            });
        }
        let Some(h) = self.get(export) else {
            return Ok(false);
        };
        h.cancel();
        h.quiesce().await;
        self.active.lock().expect("hydrations lock").remove(export);
        self.forget_files(export);
        Ok(true)
    }

    fn state_err(&self, cause: io::Error) -> HydrateError {
        HydrateError::Local {
            path: self.dir.clone(),
            cause,
        }
    }

    async fn connect(
        &self,
        spec: &SourceSpec,
        region: u64,
    ) -> Result<Arc<dyn RegionSource>, HydrateError> {
        match spec {
            SourceSpec::Agent {
                url,
                peer,
                replica,
                reader,
            } => {
                let u = parse_agent_url(url)?;
                let remote = match peer {
                    Some(p) => self.remote.with_peer(&p.token, p.ca.as_deref()),
                    None => self.remote.clone(),
                };
                if let Err(e) = chunker::ChunkSize::new(region) {
                    return Err(HydrateError::Refused {
                        what: format!("region size {region}"),
                        why: e.to_string(),
                    });
                }
                Ok(Arc::new(
                    AgentSource::connect(u, remote, region, replica.clone(), reader.clone())
                        .await?,
                ))
            }
            SourceSpec::Snapshot {
                repo,
                snapshot,
                access,
                ..
            } => {
                let opts = repo_options(spec);
                let opened = match access {
                    None => mover_engine::snapshot::open_repository(repo, &opts).await,
                    Some(a) => {
                        let creds = if a.raw_key {
                            snapshots::Credentials::RawKey(a.password.clone())
                        } else {
                            snapshots::Credentials::Password(
                                String::from_utf8_lossy(&a.password).into_owned(),
                            )
                        };
                        let keys = a.s3_keys.clone();
                        mover_engine::snapshot::open_repository_with(repo, &opts, &creds, keys)
                            .await
                    }
                };
                let r = opened.map_err(|e| HydrateError::Source {
                    source_name: repo.clone(),
                    message: e.to_string(),
                    retryable: e.is_retryable(),
                })?;
                Ok(Arc::new(SnapshotSource::open(r, snapshot).await?))
            }
        }
    }

    /// Opens the bitmap, makes the hydration and runs its filler (which returns at once
    /// if the record says cancelled).
    async fn launch(
        self: &Arc<Self>,
        record: Record,
        source: Option<Arc<dyn RegionSource>>,
    ) -> Result<Arc<Hydration>, HydrateError> {
        let regions = record.size.div_ceil(record.region_size);
        let bp = self.bitmap_path(&record.export);
        let (bitmap, map) =
            BitmapFile::open(&bp, regions, record.region_size).map_err(|cause| {
                HydrateError::Local {
                    path: bp.clone(),
                    cause,
                }
            })?;
        let source = match source {
            Some(s) => s,
            None => Arc::new(super::source::Lazy::new(
                record.source.clone(),
                record.size,
                record.region_size,
                self.clone(),
            )),
        };
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&record.path)
            .map_err(|cause| HydrateError::Local {
                path: record.path.clone(),
                cause,
            })?;
        let h = Hydration::new(
            record.export.clone(),
            record.path.clone(),
            file,
            record.fresh,
            source,
            bitmap,
            map,
            FillOptions {
                concurrency: record.concurrency,
                bwlimit: record.bwlimit,
                ..Default::default()
            },
        );
        if record.cancelled {
            h.cancel();
        }
        self.active
            .lock()
            .expect("hydrations lock")
            .insert(record.export.clone(), (h.clone(), record.source.clone()));
        let (me, h2) = (self.clone(), h.clone());
        tokio::spawn(async move {
            h2.clone().run().await;
            if h2.progress().phase == Phase::Complete {
                me.forget_files(h2.name());
            }
        });
        Ok(h)
    }

    /// A complete hydration leaves no record: the export is an ordinary volume.
    fn forget_files(&self, export: &str) {
        for p in [self.record_path(export), self.bitmap_path(export)] {
            if let Err(e) = std::fs::remove_file(&p)
                && e.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(path = %p.display(), "cannot remove: {e}");
            }
        }
        if let Err(e) = sync_dir(&self.dir) {
            tracing::warn!(dir = %self.dir.display(), "cannot sync: {e}");
        }
    }

    /// Writes a record atomically (temporary file, fsync, rename, fsync of the directory).
    fn save(&self, r: &Record) -> io::Result<()> {
        let body = serde_json::to_vec_pretty(r).map_err(io::Error::other)?;
        write_durably(&self.record_path(&r.export), &body)
    }

    /// Opens the source a resumed hydration names (for [`super::source::Lazy`]).
    pub(super) async fn reopen(
        &self,
        spec: &SourceSpec,
        region: u64,
    ) -> Result<Arc<dyn RegionSource>, HydrateError> {
        self.connect(spec, region).await
    }
}

/// A hydration record as saved (any version: the callers decide what they accept).
fn load_record(path: &Path) -> Result<Record, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    serde_json::from_slice(&bytes).map_err(|e| e.to_string())
}

fn parse_agent_url(url: &str) -> Result<AgentUrl, HydrateError> {
    match AgentUrl::parse(url) {
        Some(Ok(u)) => Ok(u),
        Some(Err(e)) => Err(HydrateError::Refused {
            what: format!("source {url}"),
            why: e.to_string(),
        }),
        None => Err(HydrateError::Refused {
            what: format!("source {url}"),
            why: "not an agent URL; write agent://HOST:PORT/VOLUME".into(),
        }),
    }
}

fn repo_options(spec: &SourceSpec) -> RepoOptions {
    let SourceSpec::Snapshot {
        s3_endpoint,
        s3_region,
        s3_virtual_host,
        password_file,
        key_file,
        ..
    } = spec
    else {
        return RepoOptions::default();
    };
    RepoOptions {
        s3_endpoint: s3_endpoint.clone(),
        s3_region: s3_region.clone(),
        s3_virtual_host: *s3_virtual_host,
        password_file: password_file.clone(),
        key_file: key_file.clone(),
        retry_max_secs: 30,
        ..Default::default()
    }
}

/// Makes the local volume ready to receive `size` bytes; whether it reads as zeros
/// everywhere (a new sparse image). An image or device that may hold data is replaced
/// only with `overwrite`.
fn prepare_local(path: &Path, size: u64, overwrite: bool) -> Result<bool, String> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata(path) {
        Ok(m) if m.file_type().is_block_device() => {
            if !overwrite {
                return Err(format!(
                    "{} is a block device and may hold data: pass --overwrite to replace it",
                    path.display()
                ));
            }
            let have = chunker::BlockVolume::open(path)
                .map_err(|e| e.to_string())?
                .size();
            if have < size {
                return Err(format!(
                    "{} holds {have} bytes; the source is {size}",
                    path.display()
                ));
            }
            Ok(false)
        }
        Ok(m) if m.is_file() => {
            if m.len() > 0 && !overwrite {
                return Err(format!(
                    "{} exists ({} bytes): pass --overwrite to replace it",
                    path.display(),
                    m.len()
                ));
            }
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
            f.set_len(0)
                .and_then(|()| f.set_len(size))
                .and_then(|()| f.sync_all())
                .map_err(|e| format!("cannot size {}: {e}", path.display()))?;
            Ok(true)
        }
        Ok(_) => Err(format!(
            "{} is neither an image file nor a block device",
            path.display()
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            let f = std::fs::File::create(path)
                .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
            f.set_len(size)
                .and_then(|()| f.sync_all())
                .map_err(|e| format!("cannot size {}: {e}", path.display()))?;
            sync_dir(chunker::durable::parent_of(path))
                .map_err(|e| format!("cannot sync the directory of {}: {e}", path.display()))?;
            Ok(true)
        }
        Err(e) => Err(format!("cannot inspect {}: {e}", path.display())),
    }
}
