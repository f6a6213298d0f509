//! `snapshot create`: a block volume into the repository, uploading only new chunks.

use chunker::{BlockVolume, ChunkKind, Window, for_each_window, hash_chunks};
use rayon::prelude::*;
use snapshots::{
    BlobKind, CHUNKS_PER_LIST, Content, FinishedPack, Index, MANIFEST_VERSION, Manifest,
    PackBuilder, RepoError, Repository, Snapshot, SnapshotSummary, Uploader, encode_list, hex,
};
use std::{collections::HashSet, path::Path, sync::Arc, time::Instant};
use tokio::sync::mpsc;

/// Options of `mover snapshot create`.
#[derive(Clone, Debug, clap::Args)]
pub struct CreateOptions {
    /// Tag the snapshot (repeat for several tags).
    #[arg(long = "tag", value_name = "TAG")]
    pub tags: Vec<String>,
    /// The volume's name in the repository [default: its canonical path]. Snapshots
    /// with one name form that volume's history (parents, retention).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    /// Pack uploads in flight at once.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub uploads: usize,
}

impl Default for CreateOptions {
    fn default() -> Self {
        CreateOptions {
            tags: Vec::new(),
            name: None,
            uploads: 4,
        }
    }
}

/// What the reading side produced.
struct Produced {
    lists: Vec<String>,
    sum: SnapshotSummary,
    size: u64,
}

/// Takes a snapshot of the block volume at `volume` into `repo`; see the module docs.
pub async fn create_snapshot(
    repo: Arc<Repository>,
    volume: &Path,
    opts: &CreateOptions,
) -> Result<Snapshot, RepoError> {
    let started = Instant::now();
    let vol = BlockVolume::open(volume)?;
    let name = match &opts.name {
        Some(n) => n.clone(),
        None => std::fs::canonicalize(volume)
            .unwrap_or_else(|_| volume.to_path_buf())
            .display()
            .to_string(),
    };
    let mut index = repo.load_dedup_index().await?;
    repo.adopt_unindexed_packs(&mut index).await?;
    let parent = repo
        .snapshots()
        .await?
        .into_iter()
        .rfind(|s| s.manifest.volume == name)
        .map(|s| s.id);
    tracing::info!(volume = %name, parent = ?parent, indexed_blobs = index.len(), "snapshot: reading the volume");

    let (tx, mut rx) = mpsc::channel::<FinishedPack>(2);
    let index = Arc::new(index);
    let producer = {
        let (repo, index) = (repo.clone(), index.clone());
        tokio::task::spawn_blocking(move || produce(&repo, &index, vol, tx))
    };
    let mut uploader = Uploader::new(repo.clone(), opts.uploads);
    let mut upload_err = None;
    while let Some(pack) = rx.recv().await {
        if let Err(e) = uploader.add(pack).await {
            upload_err = Some(e);
            break;
        }
    }
    drop(rx);
    let produced = producer.await.map_err(|e| RepoError::Refused {
        what: "snapshot reader".into(),
        why: format!("failed: {e}"),
    })?;
    if let Some(e) = upload_err {
        return Err(e);
    }
    let mut produced = produced?;
    let (packs, bytes) = uploader.finish().await?;
    produced.sum.packs = packs;
    produced.sum.stored_bytes = bytes;
    produced.sum.duration_secs = started.elapsed().as_secs_f64();
    let (time, time_nanos) = snapshots::now_unix_nanos();
    let manifest = Manifest {
        version: MANIFEST_VERSION,
        time,
        time_nanos,
        hostname: hostname(),
        volume: name,
        tags: opts.tags.clone(),
        parent,
        content: Content::Block {
            size: produced.size,
            chunk_size: repo.chunk_size().get(),
            chunks_per_list: CHUNKS_PER_LIST,
            lists: produced.lists,
        },
        summary: produced.sum,
    };
    let snap = repo.save_snapshot(manifest).await?;
    tracing::info!(id = %snap.id, "snapshot saved");
    Ok(snap)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// The blocking side: reads and hashes windows, seals new chunks into packs, builds the
/// chunk list, and sends full packs to the uploader.
fn produce(
    repo: &Repository,
    index: &Index,
    vol: BlockVolume,
    tx: mpsc::Sender<FinishedPack>,
) -> Result<Produced, RepoError> {
    let chunk = repo.chunk_size();
    let key = repo.chunk_key();
    let size = vol.size();
    let pack_size = repo.pack_size();
    let mut seen = HashSet::new();
    let mut data_pack = PackBuilder::new();
    let mut list_pack = PackBuilder::new();
    let mut kinds_acc: Vec<ChunkKind> = Vec::with_capacity(CHUNKS_PER_LIST as usize);
    let mut lists = Vec::new();
    let mut sum = SnapshotSummary::default();
    let send = |pack: PackBuilder| -> Result<(), RepoError> {
        tx.blocking_send(repo.finish_pack(pack))
            .map_err(|_| RepoError::Refused {
                what: "snapshot".into(),
                why: "the upload stopped".into(),
            })
    };
    let mut flush_list = |kinds: &[ChunkKind],
                          list_pack: &mut PackBuilder,
                          seen: &mut HashSet<chunker::ChunkId>|
     -> Result<(), RepoError> {
        let enc = encode_list(kinds);
        let id = key.chunk_id(&enc);
        lists.push(hex(&id.0));
        if !index.contains(&id) && seen.insert(id) {
            list_pack.push(
                BlobKind::List,
                id,
                &repo.seal_blob(BlobKind::List, &id, &enc),
            );
        }
        if list_pack.len() >= pack_size {
            send(std::mem::take(list_pack))?;
        }
        Ok(())
    };
    for_each_window::<RepoError>(&vol, chunk, |win: &mut Window| {
        let kinds = hash_chunks(key, chunk, win);
        let ranges: Vec<_> = win.chunk_ranges(chunk).collect();
        let mut new = Vec::new();
        for (i, k) in kinds.iter().enumerate() {
            match k {
                ChunkKind::Zero => sum.zero_chunks += 1,
                ChunkKind::Data(id) => {
                    sum.data_chunks += 1;
                    sum.data_bytes += ranges[i].len() as u64;
                    if !index.contains(id) && seen.insert(*id) {
                        new.push((i, *id));
                    }
                }
            }
        }
        let sealed: Vec<Vec<u8>> = new
            .par_iter()
            .map(|(i, id)| repo.seal_blob(BlobKind::Data, id, &win.buf[ranges[*i].clone()]))
            .collect();
        for ((i, id), s) in new.iter().zip(sealed) {
            data_pack.push(BlobKind::Data, *id, &s);
            sum.new_chunks += 1;
            sum.new_bytes += ranges[*i].len() as u64;
            if data_pack.len() >= pack_size {
                send(std::mem::take(&mut data_pack))?;
            }
        }
        for k in kinds {
            kinds_acc.push(k);
            if kinds_acc.len() == CHUNKS_PER_LIST as usize {
                flush_list(&kinds_acc, &mut list_pack, &mut seen)?;
                kinds_acc.clear();
            }
        }
        Ok(())
    })?;
    if !kinds_acc.is_empty() {
        flush_list(&kinds_acc, &mut list_pack, &mut seen)?;
    }
    if !data_pack.is_empty() {
        send(data_pack)?;
    }
    if !list_pack.is_empty() {
        send(list_pack)?;
    }
    Ok(Produced { lists, sum, size })
}
