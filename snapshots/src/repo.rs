//! An open repository: config, keys, index, snapshots, blob reads and pack uploads.

use crate::{
    backend::Backend,
    crypto::{MasterKey, random},
    error::{RepoError, Result},
    index::{BlobLoc, Index, decode_delta, encode_delta},
    keys::{Config, Credentials, KeyObject, REPO_VERSION, new_key_object, open_key_object},
    manifest::{MANIFEST_VERSION, Manifest, Snapshot, decode_list},
    pack::{
        BlobKind, FOOTER_LEN, FinishedPack, PackBuilder, PackEntry, PackId, SpareBuffers,
        open_blob, pack_key, parse_trailer, seal_blob, seal_blob_into, trailer_len,
    },
};
use bytes::Bytes;
use chunker::{ChunkId, ChunkKey, ChunkKind, ChunkSize};
use std::{
    collections::HashSet,
    sync::Arc,
    time::{SystemTime, UNIX_EPOCH},
};
use tokio::task::JoinSet;

const SNAPSHOT_AAD: &[u8] = b"mover snapshot v1";
/// Longest ranged GET [`Repository::read_sealed`] makes of merged adjacent blobs (a
/// single larger blob is still read whole): bounds a reader's memory per request.
const MAX_MERGED_READ: u64 = 4 << 20;

/// Options of `repo init`.
#[derive(Clone, Debug)]
pub struct InitOptions {
    /// Chunk size for block volumes.
    pub chunk_size: ChunkSize,
    /// Target pack size in bytes (16–64 MiB).
    pub pack_size: u64,
}

impl Default for InitOptions {
    fn default() -> Self {
        InitOptions {
            chunk_size: ChunkSize::DEFAULT,
            pack_size: 16 << 20,
        }
    }
}

/// Now, as seconds since the Unix epoch and nanoseconds within that second (read once,
/// so the two agree).
pub fn now_unix_nanos() -> (i64, u32) {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| (d.as_secs() as i64, d.subsec_nanos()))
        .unwrap_or((0, 0))
}

/// Seconds since the Unix epoch.
pub fn now_unix() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// An open repository.
#[derive(Debug)]
pub struct Repository {
    backend: Arc<dyn Backend>,
    config: Config,
    key: MasterKey,
    /// Local copies of the (immutable) index objects, `<dir>/<repo id>/index/<name>`.
    cache: Option<std::path::PathBuf>,
}

impl Repository {
    /// Creates a repository at an empty location.
    pub async fn init(
        backend: Arc<dyn Backend>,
        creds: &Credentials,
        opts: &InitOptions,
    ) -> Result<Self> {
        let location = backend.location();
        match backend.get("config", None).await {
            Ok(_) => return Err(RepoError::AlreadyExists { location }),
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e),
        }
        let secret: [u8; 32] = random();
        let now = now_unix();
        let config = Config {
            version: REPO_VERSION,
            id: crate::hex(&random::<16>()),
            chunk_size: opts.chunk_size.get(),
            pack_size: opts.pack_size.clamp(1 << 20, 64 << 20),
            cipher: "xchacha20poly1305".into(),
            compression: "zstd-3".into(),
            created: now,
        };
        let ko = new_key_object(creds, &secret, now);
        let kname = format!("keys/{}", crate::hex(&random::<16>()));
        backend.put(&kname, json(&ko).into()).await?;
        // The config is written last: a location without it is not a repository yet.
        backend.put("config", json(&config).into()).await?;
        Ok(Repository {
            backend,
            config,
            key: MasterKey::from_secret(&secret),
            cache: None,
        })
    }

    /// Opens the repository at the backend's location.
    pub async fn open(backend: Arc<dyn Backend>, creds: &Credentials) -> Result<Self> {
        let location = backend.location();
        let raw = match backend.get("config", None).await {
            Ok(b) => b,
            Err(e) if e.is_not_found() => return Err(RepoError::NoRepository { location }),
            Err(e) => return Err(e),
        };
        let config: Config = serde_json::from_slice(&raw).map_err(|e| RepoError::Corrupt {
            key: "config".into(),
            offset: 0,
            what: format!("not a mover repository config: {e}"),
        })?;
        if config.version != REPO_VERSION {
            return Err(RepoError::UnsupportedVersion {
                key: "config".into(),
                found: config.version,
                supported: REPO_VERSION,
            });
        }
        ChunkSize::new(config.chunk_size).map_err(|e| RepoError::Corrupt {
            key: "config".into(),
            offset: 0,
            what: format!("bad chunk size: {e}"),
        })?;
        for obj in backend.list("keys/").await? {
            let b = backend.get(&obj.key, None).await?;
            let Ok(ko) = serde_json::from_slice::<KeyObject>(&b) else {
                tracing::warn!(key = %obj.key, "skipping a key object that does not parse");
                continue;
            };
            let creds = creds.clone();
            let name = obj.key.clone();
            let opened = tokio::task::spawn_blocking(move || open_key_object(&name, &ko, &creds))
                .await
                .map_err(|e| RepoError::Refused {
                    what: obj.key.clone(),
                    why: e.to_string(),
                })??;
            if let Some(secret) = opened {
                return Ok(Repository {
                    backend,
                    config,
                    key: MasterKey::from_secret(&secret),
                    cache: None,
                });
            }
        }
        Err(RepoError::WrongPassword { location })
    }

    /// Where it is.
    pub fn location(&self) -> String {
        self.backend.location()
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }

    /// The config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The key chunk ids are computed with.
    pub fn chunk_key(&self) -> &ChunkKey {
        self.key.chunk_key()
    }

    /// The chunk size of block volumes.
    pub fn chunk_size(&self) -> ChunkSize {
        ChunkSize::new(self.config.chunk_size).expect("checked at open")
    }

    /// Target pack size in bytes.
    pub fn pack_size(&self) -> usize {
        self.config.pack_size as usize
    }

    /// Compresses and encrypts a blob for a [`PackBuilder`] (CPU work: call it from a
    /// blocking thread or rayon).
    pub fn seal_blob(&self, kind: BlobKind, id: &ChunkId, plain: &[u8]) -> Vec<u8> {
        seal_blob(&self.key, kind, id, plain)
    }

    /// Seals a volume's data chunk, at the volume chunks' zstd level (2, where a file
    /// tree's blobs take 3: why is told at `VOLUME_ZSTD_LEVEL` in pack.rs).
    /// It is sealed into `out` (a buffer given back, emptied first; `Vec::new()` for
    /// none).
    pub fn seal_volume_chunk(&self, id: &ChunkId, plain: &[u8], out: Vec<u8>) -> Vec<u8> {
        seal_blob_into(
            &self.key,
            BlobKind::Data,
            id,
            plain,
            crate::pack::VOLUME_ZSTD_LEVEL,
            out,
        )
    }

    /// Seals a pack's trailer and names it.
    pub fn finish_pack(&self, pack: PackBuilder) -> FinishedPack {
        pack.finish(&self.key)
    }

    /// Decrypts and checks one sealed blob.
    pub fn open_blob(&self, id: &ChunkId, loc: &BlobLoc, sealed: &[u8]) -> Result<Bytes> {
        open_blob(&self.key, loc.kind, id, sealed).ok_or_else(|| RepoError::Corrupt {
            key: pack_key(&loc.pack),
            offset: loc.offset as u64,
            what: format!(
                "blob {} ({} bytes) fails authentication or does not match its id",
                id.to_hex(),
                loc.len
            ),
        })
    }

    /// [`Repository::open_blob`] of a data blob into `out`, which must be exactly its
    /// length (a restore fills its write buffer so, with no buffer per chunk).
    pub fn open_data_into(
        &self,
        id: &ChunkId,
        loc: &BlobLoc,
        sealed: &[u8],
        out: &mut [u8],
    ) -> Result<()> {
        crate::pack::open_data_into(&self.key, id, sealed, out).ok_or_else(|| {
            RepoError::Corrupt {
                key: pack_key(&loc.pack),
                offset: loc.offset as u64,
                what: format!(
                    "blob {} ({} bytes) fails authentication, does not match its id, or is not the {} bytes the snapshot holds there",
                    id.to_hex(),
                    loc.len,
                    out.len()
                ),
            }
        })
    }

    /// Decrypts a delta's base blob without hashing it: the chunk rebuilt from it is
    /// checked against its own id by [`Repository::rebuild_chunk`], which is enough (and
    /// saves hashing every base twice).
    pub fn open_base(&self, id: &ChunkId, loc: &BlobLoc, sealed: &[u8]) -> Result<Bytes> {
        crate::pack::open_blob_unhashed(&self.key, loc.kind, id, sealed).ok_or_else(|| {
            RepoError::Corrupt {
                key: pack_key(&loc.pack),
                offset: loc.offset as u64,
                what: format!("base blob {} fails authentication", id.to_hex()),
            }
        })
    }

    /// Keeps local copies of index objects under `dir` (they are immutable and named
    /// by their hash, so a copy is checked by hashing it): later runs then need one LIST
    /// and no GETs for the index. `None` turns the cache off.
    pub fn with_cache_dir(mut self, dir: Option<std::path::PathBuf>) -> Self {
        self.cache = dir.map(|d| d.join(&self.config.id).join("index"));
        self
    }

    /// This repository's local cache directory (`None` with the cache off): the index
    /// copies are in it, and whatever else a client keeps for this repository.
    pub fn cache_dir(&self) -> Option<&std::path::Path> {
        self.cache.as_deref().and_then(|c| c.parent())
    }

    /// Loads every index delta: one LIST, and one GET for each not in the local cache.
    pub async fn load_index(&self) -> Result<Index> {
        // An index object can vanish between LIST and GET when a prune compacts the
        // index; the compacted one is then listed by a second attempt.
        let mut attempt = 0;
        loop {
            match self.load_index_once().await {
                Err(e) if e.is_not_found() && attempt < 3 => attempt += 1,
                r => return r,
            }
        }
    }

    async fn load_index_once(&self) -> Result<Index> {
        let mut index = Index::default();
        let objs = self.backend.list("index/").await?;
        let mut tasks = JoinSet::new();
        let sem = Arc::new(tokio::sync::Semaphore::new(8));
        let listed: HashSet<String> = objs.iter().map(|o| o.key.clone()).collect();
        for obj in objs {
            let backend = self.backend.clone();
            let sem = sem.clone();
            let cache = self.cache.clone();
            tasks.spawn(async move {
                let name = obj.key.trim_start_matches("index/").to_string();
                if let Some(b) = cache.as_ref().and_then(|c| read_cached(c, &name)) {
                    return Ok::<_, RepoError>((obj.key, b));
                }
                let _permit = sem.acquire_owned().await;
                let b = backend.get(&obj.key, None).await?;
                if let Some(c) = &cache {
                    write_cached(c, &name, &b);
                }
                Ok((obj.key, b))
            });
        }
        while let Some(r) = tasks.join_next().await {
            let (name, b) = r.map_err(join_err)??;
            for (pack, e) in decode_delta(&self.key, &name, &b)? {
                index.insert(&pack, &e);
            }
            index.files.push(name);
        }
        // Forget cached objects the repository no longer has (compacted by prune).
        if let Some(c) = &self.cache
            && let Ok(dir) = std::fs::read_dir(c)
        {
            for e in dir.flatten() {
                let n = e.file_name().to_string_lossy().into_owned();
                if !n.starts_with('.') && !listed.contains(&format!("index/{n}")) {
                    let _ = std::fs::remove_file(e.path());
                }
            }
        }
        Ok(index)
    }

    /// Writes an index delta; returns its key.
    pub async fn write_index(&self, entries: &[(PackId, PackEntry)]) -> Result<String> {
        let (name, bytes) = encode_delta(&self.key, entries);
        self.backend.put(&name, bytes.into()).await?;
        Ok(name)
    }

    /// Stores a pack.
    pub async fn put_pack(&self, pack: &FinishedPack) -> Result<()> {
        self.backend
            .put(&pack_key(&pack.id), pack.data.clone())
            .await
    }

    /// Reads a pack's blob entries from its trailer (two ranged GETs).
    pub async fn read_trailer(&self, pack: &PackId, size: u64) -> Result<Vec<PackEntry>> {
        let key = pack_key(pack);
        if size < FOOTER_LEN as u64 {
            return Err(RepoError::Corrupt {
                key,
                offset: 0,
                what: "too short to be a pack".into(),
            });
        }
        let footer = self
            .backend
            .get(&key, Some(size - FOOTER_LEN as u64..size))
            .await?;
        let n = trailer_len(&key, &footer, size)? as u64;
        let start = size - FOOTER_LEN as u64 - n;
        let sealed = self
            .backend
            .get(&key, Some(start..size - FOOTER_LEN as u64))
            .await?;
        parse_trailer(&self.key, &key, &sealed, start)
    }

    /// Finds packs that no index lists (left by an interrupted snapshot), reads their
    /// trailers and indexes them, so their blobs are reused instead of uploaded again.
    /// Packs that a pending prune has marked for deletion are left alone. One LIST of
    /// `packs/`, two small GETs per such pack.
    pub async fn adopt_unindexed_packs(&self, index: &mut Index) -> Result<usize> {
        let known = index.packs();
        let marked = crate::prune::marked_packs(self).await?;
        let mut adopted = Vec::new();
        for obj in self.backend.list("packs/").await? {
            let Some(id) = obj.key.rsplit('/').next().and_then(crate::unhex::<32>) else {
                continue;
            };
            if known.contains(&id) || marked.contains(&id) {
                continue;
            }
            match self.read_trailer(&id, obj.size).await {
                Ok(entries) => {
                    for e in &entries {
                        index.insert(&id, e);
                        adopted.push((id, *e));
                    }
                }
                Err(e) if e.is_corruption() => {
                    tracing::warn!(pack = %obj.key, error = %e, "ignoring an unindexed pack that does not read back");
                }
                Err(e) => return Err(e),
            }
        }
        let packs = adopted
            .iter()
            .map(|(p, _)| *p)
            .collect::<HashSet<_>>()
            .len();
        // A delta adopted from an interrupted run whose base was pruned meanwhile
        // cannot rebuild its chunk: it must not be deduplicated against.
        index.drop_orphan_deltas();
        if !adopted.is_empty() {
            tracing::info!(
                packs,
                blobs = adopted.len(),
                "reusing packs of an interrupted snapshot"
            );
            self.write_index(&adopted).await?;
        }
        Ok(packs)
    }

    /// Reads sealed blobs of one pack with ranged GETs (adjacent blobs merged into one
    /// request when the gap is under 1 MiB), checks and decrypts each.
    pub async fn read_blobs(
        &self,
        pack: &PackId,
        blobs: Vec<(ChunkId, BlobLoc)>,
    ) -> Result<Vec<(ChunkId, Bytes)>> {
        self.read_sealed(pack, blobs)
            .await?
            .into_iter()
            .map(|(id, loc, sealed)| Ok((id, self.open_blob(&id, &loc, &sealed)?)))
            .collect()
    }

    /// Fetches sealed blobs of one pack with ranged GETs (adjacent blobs merged into one
    /// request when the gap is under 1 MiB), without opening them: the caller opens them
    /// with [`Repository::open_blob`], on as many threads as it likes.
    pub async fn read_sealed(
        &self,
        pack: &PackId,
        mut blobs: Vec<(ChunkId, BlobLoc)>,
    ) -> Result<Vec<(ChunkId, BlobLoc, Bytes)>> {
        blobs.sort_by_key(|(_, l)| l.offset);
        let key = pack_key(pack);
        let mut out = Vec::with_capacity(blobs.len());
        let mut i = 0;
        while i < blobs.len() {
            let start = blobs[i].1.offset as u64;
            let mut end = start + blobs[i].1.len as u64;
            let mut j = i + 1;
            while j < blobs.len()
                && (blobs[j].1.offset as u64) <= end + (1 << 20)
                && end - start < MAX_MERGED_READ
            {
                end = end.max(blobs[j].1.offset as u64 + blobs[j].1.len as u64);
                j += 1;
            }
            let data: Bytes = self.backend.get(&key, Some(start..end)).await?;
            for (id, loc) in &blobs[i..j] {
                let s = (loc.offset as u64 - start) as usize;
                let e = s + loc.len as usize;
                if data.len() < e {
                    return Err(RepoError::Corrupt {
                        key: key.clone(),
                        offset: loc.offset as u64,
                        what: "pack is shorter than its index says".into(),
                    });
                }
                out.push((*id, *loc, data.slice(s..e)));
            }
            i = j;
        }
        Ok(out)
    }

    /// Rebuilds chunk `id` from its delta blob's plaintext and its base's plaintext, and
    /// checks the result against `id`.
    pub fn rebuild_chunk(&self, id: &ChunkId, base: &[u8], delta: &[u8]) -> Result<Vec<u8>> {
        crate::delta::apply_delta(self.chunk_key(), id, base, delta).map_err(|why| {
            RepoError::Corrupt {
                key: format!("delta blob {}", id.to_hex()),
                offset: 0,
                what: why,
            }
        })
    }

    /// Reads one blob.
    pub async fn read_blob(&self, index: &Index, id: &ChunkId) -> Result<Bytes> {
        let loc = index
            .get(id)
            .ok_or_else(|| RepoError::MissingBlob { id: id.to_hex() })?;
        let mut v = self.read_blobs(&loc.pack, vec![(*id, loc)]).await?;
        Ok(v.pop().map(|(_, b)| b).unwrap_or_default())
    }

    /// Reads one data chunk's plaintext, rebuilding it from its base when it is stored
    /// as a delta (checked against its id either way).
    pub async fn read_chunk(&self, index: &Index, id: &ChunkId) -> Result<Bytes> {
        let loc = index
            .get(id)
            .ok_or_else(|| RepoError::MissingBlob { id: id.to_hex() })?;
        let plain = self.read_blob(index, id).await?;
        match loc.base {
            None => Ok(plain),
            Some(base) => {
                let b = self.read_blob(index, &base).await?;
                self.rebuild_chunk(id, &b, &plain).map(Bytes::from)
            }
        }
    }

    /// Reads one chunk-list blob.
    pub async fn read_list(&self, index: &Index, id_hex: &str) -> Result<Vec<ChunkKind>> {
        let id = crate::unhex::<32>(id_hex)
            .ok_or_else(|| RepoError::MissingBlob { id: id_hex.into() })?;
        let b = self.read_blob(index, &ChunkId(id)).await?;
        decode_list(&format!("chunk list {id_hex}"), &b)
    }

    /// Every snapshot (one LIST, one GET each), oldest first.
    pub async fn snapshots(&self) -> Result<Vec<Snapshot>> {
        let mut out = Vec::new();
        for obj in self.backend.list("snapshots/").await? {
            let id = obj.key.trim_start_matches("snapshots/").to_string();
            match self.load_snapshot(&id).await {
                Ok(s) => out.push(s),
                Err(e) if e.is_not_found() => {} // forgotten meanwhile
                Err(e) => return Err(e),
            }
        }
        out.sort_by(|a, b| {
            let key = |s: &Snapshot| (s.manifest.time, s.manifest.time_nanos);
            (key(a), &a.id).cmp(&(key(b), &b.id))
        });
        Ok(out)
    }

    async fn load_snapshot(&self, id: &str) -> Result<Snapshot> {
        let key = format!("snapshots/{id}");
        let b = self.backend.get(&key, None).await?;
        let plain = self
            .key
            .open(&b, SNAPSHOT_AAD)
            .ok_or_else(|| RepoError::Corrupt {
                key: key.clone(),
                offset: 0,
                what: "manifest fails authentication".into(),
            })?;
        #[derive(serde::Deserialize)]
        struct V {
            version: u32,
        }
        let v: V = serde_json::from_slice(&plain).map_err(|e| RepoError::Corrupt {
            key: key.clone(),
            offset: 0,
            what: e.to_string(),
        })?;
        if v.version == 0 || v.version > MANIFEST_VERSION {
            return Err(RepoError::UnsupportedVersion {
                key,
                found: v.version,
                supported: MANIFEST_VERSION,
            });
        }
        let manifest = serde_json::from_slice(&plain).map_err(|e| RepoError::Corrupt {
            key,
            offset: 0,
            what: e.to_string(),
        })?;
        Ok(Snapshot {
            id: id.into(),
            manifest,
        })
    }

    /// The snapshot whose id is or starts with `prefix` (at least 4 hex digits), or
    /// `latest` (the newest one).
    pub async fn find_snapshot(&self, prefix: &str) -> Result<Snapshot> {
        let unknown = || RepoError::UnknownSnapshot {
            location: self.location(),
            id: prefix.into(),
        };
        if prefix == "latest" {
            return self.snapshots().await?.pop().ok_or_else(unknown);
        }
        if prefix.len() < 4 || !prefix.bytes().all(|c| c.is_ascii_hexdigit()) {
            return Err(unknown());
        }
        let ids: Vec<String> = self
            .backend
            .list("snapshots/")
            .await?
            .into_iter()
            .map(|o| o.key.trim_start_matches("snapshots/").to_string())
            .filter(|id| id.starts_with(&prefix.to_ascii_lowercase()))
            .collect();
        match ids.len() {
            0 => Err(unknown()),
            1 => self.load_snapshot(&ids[0]).await.map_err(|e| match e {
                e if e.is_not_found() => unknown(),
                e => e,
            }),
            count => Err(RepoError::AmbiguousSnapshot {
                location: self.location(),
                id: prefix.into(),
                count,
            }),
        }
    }

    /// Writes a manifest: the commit point of a snapshot. Returns the new snapshot.
    pub async fn save_snapshot(&self, mut manifest: Manifest) -> Result<Snapshot> {
        manifest.version = manifest.content.format_version();
        let id = crate::hex(&random::<32>());
        let plain = serde_json::to_vec(&manifest).expect("manifest serializes");
        let sealed = self.key.seal(&plain, SNAPSHOT_AAD);
        self.backend
            .put(&format!("snapshots/{id}"), sealed.into())
            .await?;
        Ok(Snapshot { id, manifest })
    }

    /// Removes a snapshot's manifest (its data goes at the next prune).
    pub async fn delete_snapshot(&self, id: &str) -> Result<()> {
        self.backend.delete(&format!("snapshots/{id}")).await
    }

    /// Another handle on the same repository (for tasks that need an owned one).
    pub(crate) fn clone_handle(&self) -> Repository {
        Repository {
            backend: self.backend.clone(),
            config: self.config.clone(),
            key: self.key.clone(),
            cache: self.cache.clone(),
        }
    }

    pub(crate) fn master(&self) -> &MasterKey {
        &self.key
    }
}

/// A cached index object, if present and intact (its name is the BLAKE3 of its bytes).
fn read_cached(dir: &std::path::Path, name: &str) -> Option<Bytes> {
    let b = std::fs::read(dir.join(name)).ok()?;
    (crate::hex(blake3::hash(&b).as_bytes()) == name).then(|| Bytes::from(b))
}

/// Caches an index object; failures only cost a GET next time.
fn write_cached(dir: &std::path::Path, name: &str, data: &[u8]) {
    let tmp = dir.join(format!(".{name}.tmp"));
    let r = std::fs::create_dir_all(dir)
        .and_then(|()| std::fs::write(&tmp, data))
        .and_then(|()| std::fs::rename(&tmp, dir.join(name)));
    if let Err(e) = r {
        tracing::debug!(dir = %dir.display(), error = %e, "cannot cache an index object");
    }
}

fn json<T: serde::Serialize>(v: &T) -> Vec<u8> {
    let mut b = serde_json::to_vec_pretty(v).expect("serializes");
    b.push(b'\n');
    b
}

pub(crate) fn join_err(e: tokio::task::JoinError) -> RepoError {
    RepoError::Refused {
        what: "internal task".into(),
        why: format!("failed: {e}"),
    }
}

/// Uploads packs with a bounded number in flight and writes index deltas for the
/// uploaded ones (packs → index order: an index never names a pack not yet stored).
#[derive(Debug)]
pub struct Uploader {
    repo: Arc<Repository>,
    /// Each upload ends with its pack's name, entries and size: not its bytes, which
    /// are freed as soon as they are stored, not when the upload is joined.
    tasks: JoinSet<Result<(PackId, Vec<PackEntry>, u64)>>,
    max_in_flight: usize,
    /// Where an uploaded pack's buffer goes back, if anywhere.
    spares: Option<SpareBuffers>,
    pending: Vec<(PackId, PackEntry)>,
    /// Packs uploaded.
    pub packs: u64,
    /// Bytes uploaded in packs.
    pub bytes: u64,
}

/// Index entries gathered before an index delta is written mid-run.
const INDEX_FLUSH_ENTRIES: usize = 65536;

impl Uploader {
    /// An uploader with up to `max_in_flight` concurrent PUTs.
    pub fn new(repo: Arc<Repository>, max_in_flight: usize) -> Self {
        Uploader {
            repo,
            tasks: JoinSet::new(),
            max_in_flight: max_in_flight.max(1),
            spares: None,
            pending: Vec::new(),
            packs: 0,
            bytes: 0,
        }
    }

    /// Gives each pack's buffer back to `spares` once the pack is stored, for the
    /// producer's next packs ([`PackBuilder::with_capacity_from`]).
    pub fn returning_buffers_to(mut self, spares: SpareBuffers) -> Self {
        self.spares = Some(spares);
        self
    }

    /// Starts uploading a pack, first waiting while too many are in flight.
    pub async fn add(&mut self, pack: FinishedPack) -> Result<()> {
        self.add_holding(pack, ()).await
    }

    /// Like [`Uploader::add`], and keeps `hold` until the upload ends (a permit that
    /// bounds how many finished packs the caller has made).
    pub async fn add_holding(
        &mut self,
        pack: FinishedPack,
        hold: impl Send + 'static,
    ) -> Result<()> {
        while self.tasks.len() >= self.max_in_flight {
            self.join_one().await?;
        }
        let (repo, spares) = (self.repo.clone(), self.spares.clone());
        self.tasks.spawn(async move {
            let _hold = hold;
            repo.put_pack(&pack).await?;
            let mut pack = pack;
            let len = pack.data.len() as u64;
            if let (Some(spares), Some(buf)) = (spares, pack.take_buffer()) {
                spares.give(buf);
            }
            Ok((pack.id, pack.entries, len))
        });
        Ok(())
    }

    async fn join_one(&mut self) -> Result<()> {
        if let Some(r) = self.tasks.join_next().await {
            let (id, entries, len) = r.map_err(join_err)??;
            self.packs += 1;
            self.bytes += len;
            self.pending.extend(entries.into_iter().map(|e| (id, e)));
            if self.pending.len() >= INDEX_FLUSH_ENTRIES {
                self.repo.write_index(&self.pending).await?;
                self.pending.clear();
            }
        }
        Ok(())
    }

    /// Waits for every upload and writes the last index delta.
    pub async fn finish(mut self) -> Result<(u64, u64)> {
        while !self.tasks.is_empty() {
            self.join_one().await?;
        }
        if !self.pending.is_empty() {
            self.repo.write_index(&self.pending).await?;
        }
        Ok((self.packs, self.bytes))
    }
}
