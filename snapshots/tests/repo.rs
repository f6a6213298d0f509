//! Repository-level behaviour on the in-memory and local backends: keys and passwords,
//! packs → index → snapshot order, adoption of packs left by an interrupted run,
//! two-phase prune with its re-check, and format versions.

use bytes::Bytes;
use chunker::{ChunkKind, ChunkSize};
use snapshots::{
    Backend, BlobKind, CHUNKS_PER_LIST, Content, Credentials, InitOptions, LocalBackend,
    MANIFEST_VERSION, Manifest, MemoryBackend, PackBuilder, RepoError, Repository, Snapshot,
    SnapshotSummary, Uploader, encode_list, hex,
};
use std::sync::Arc;

fn pw(s: &str) -> Credentials {
    Credentials::Password(s.into())
}

/// Stores `chunks` (1 MiB each in the manifest's eyes) as a snapshot, one pack per
/// `per_pack` chunks, the way the engine does: packs, then index, then manifest.
async fn store(
    repo: &Arc<Repository>,
    volume: &str,
    chunks: &[Vec<u8>],
    per_pack: usize,
) -> Snapshot {
    let index = repo.load_index().await.unwrap();
    let mut up = Uploader::new(repo.clone(), 2);
    let mut kinds = Vec::new();
    let mut pack = PackBuilder::new();
    for (i, c) in chunks.iter().enumerate() {
        let id = repo.chunk_key().chunk_id(c);
        kinds.push(ChunkKind::Data(id));
        if !index.contains(&id) {
            pack.push(BlobKind::Data, id, &repo.seal_blob(BlobKind::Data, &id, c));
        }
        if (i + 1) % per_pack == 0 && !pack.is_empty() {
            up.add(repo.finish_pack(std::mem::take(&mut pack)))
                .await
                .unwrap();
        }
    }
    let list = encode_list(&kinds);
    let lid = repo.chunk_key().chunk_id(&list);
    pack.push(
        BlobKind::List,
        lid,
        &repo.seal_blob(BlobKind::List, &lid, &list),
    );
    up.add(repo.finish_pack(pack)).await.unwrap();
    up.finish().await.unwrap();
    let (time, time_nanos) = snapshots::now_unix_nanos();
    repo.save_snapshot(Manifest {
        version: MANIFEST_VERSION,
        time,
        time_nanos,
        hostname: "test".into(),
        volume: volume.into(),
        tags: vec![],
        parent: None,
        content: Content::Block {
            size: chunks.len() as u64 * (1 << 20),
            chunk_size: 1 << 20,
            chunks_per_list: CHUNKS_PER_LIST,
            lists: vec![hex(&lid.0)],
        },
        summary: SnapshotSummary::default(),
    })
    .await
    .unwrap()
}

fn chunk(seed: u8) -> Vec<u8> {
    (0..4096u32)
        .map(|i| (i as u8).wrapping_mul(seed).wrapping_add(seed))
        .collect()
}

#[tokio::test]
async fn passwords_key_files_and_repository_errors() {
    let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let e = Repository::open(b.clone(), &pw("x")).await.unwrap_err();
    assert!(matches!(e, RepoError::NoRepository { .. }), "{e}");
    assert!(e.to_string().contains("mover repo init"), "{e}");

    let r = Repository::init(b.clone(), &pw("secret"), &InitOptions::default())
        .await
        .unwrap();
    let e = Repository::init(b.clone(), &pw("secret"), &InitOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(e, RepoError::AlreadyExists { .. }), "{e}");
    let e = Repository::open(b.clone(), &pw("wrong")).await.unwrap_err();
    assert!(matches!(e, RepoError::WrongPassword { .. }), "{e}");
    assert!(e.to_string().contains("wrong password"), "{e}");
    let r2 = Repository::open(b.clone(), &pw("secret")).await.unwrap();
    // Same keys: same chunk ids.
    assert_eq!(r.chunk_key().chunk_id(b"x"), r2.chunk_key().chunk_id(b"x"));
    assert_eq!(r2.chunk_size(), ChunkSize::DEFAULT);
    // Chunk ids are keyed: another repository names the same data differently.
    let other = Repository::init(
        Arc::new(MemoryBackend::new()),
        &Credentials::RawKey(vec![9; 32]),
        &InitOptions::default(),
    )
    .await
    .unwrap();
    assert_ne!(
        r.chunk_key().chunk_id(b"x"),
        other.chunk_key().chunk_id(b"x")
    );
    let e = Repository::open(other.backend().clone(), &Credentials::RawKey(vec![8; 32]))
        .await
        .unwrap_err();
    assert!(matches!(e, RepoError::WrongPassword { .. }), "{e}");
    Repository::open(other.backend().clone(), &Credentials::RawKey(vec![9; 32]))
        .await
        .unwrap();

    // Unknown, ambiguous-free and `latest` snapshot lookups.
    let r = Arc::new(r);
    let s = store(&r, "v", &[chunk(1)], 1).await;
    assert_eq!(r.find_snapshot(&s.id[..6]).await.unwrap().id, s.id);
    assert_eq!(r.find_snapshot("latest").await.unwrap().id, s.id);
    let e = r.find_snapshot("deadbeef").await.unwrap_err();
    assert!(matches!(e, RepoError::UnknownSnapshot { .. }), "{e}");
    assert!(e.to_string().contains("mover snapshot list"), "{e}");
}

#[tokio::test]
async fn objects_carry_versions_and_a_newer_config_is_refused() {
    let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    Repository::init(b.clone(), &pw("p"), &InitOptions::default())
        .await
        .unwrap();
    let cfg = b.get("config", None).await.unwrap();
    let mut v: serde_json::Value = serde_json::from_slice(&cfg).unwrap();
    assert_eq!(v["version"], 1);
    v["version"] = 2.into();
    b.put("config", Bytes::from(serde_json::to_vec(&v).unwrap()))
        .await
        .unwrap();
    let e = Repository::open(b, &pw("p")).await.unwrap_err();
    assert!(
        matches!(e, RepoError::UnsupportedVersion { found: 2, .. }),
        "{e}"
    );
}

/// Regression: snapshots taken within the same second (as a quick create after a create)
/// used to tie on their whole-second time, so `latest` could be the older one.
#[tokio::test]
async fn latest_is_the_newest_even_within_one_second() {
    let dir = tempfile::tempdir().unwrap();
    let b: Arc<dyn Backend> = Arc::new(LocalBackend::new(dir.path()));
    let repo = Arc::new(
        Repository::init(b, &pw("p"), &InitOptions::default())
            .await
            .unwrap(),
    );
    for n in 0..6u8 {
        store(&repo, &format!("v{n}"), &[chunk(n + 1)], 1).await;
    }
    let all = repo.snapshots().await.unwrap();
    let order: Vec<&str> = all.iter().map(|s| s.manifest.volume.as_str()).collect();
    assert_eq!(order, ["v0", "v1", "v2", "v3", "v4", "v5"]);
    assert_eq!(
        repo.find_snapshot("latest").await.unwrap().manifest.volume,
        "v5"
    );
}

#[tokio::test]
async fn packs_without_index_are_adopted_not_uploaded_again() {
    let dir = tempfile::tempdir().unwrap();
    let b: Arc<dyn Backend> = Arc::new(LocalBackend::new(dir.path()));
    let repo = Arc::new(
        Repository::init(b.clone(), &pw("p"), &InitOptions::default())
            .await
            .unwrap(),
    );
    // An interrupted run: a pack stored, no index, no snapshot.
    let c = chunk(3);
    let id = repo.chunk_key().chunk_id(&c);
    let mut p = PackBuilder::new();
    p.push(BlobKind::Data, id, &repo.seal_blob(BlobKind::Data, &id, &c));
    repo.put_pack(&repo.finish_pack(p)).await.unwrap();
    let mut index = repo.load_index().await.unwrap();
    assert!(!index.contains(&id));
    assert_eq!(repo.adopt_unindexed_packs(&mut index).await.unwrap(), 1);
    assert!(index.contains(&id));
    // The adoption was written down: a fresh load sees it, and a second run adopts nothing.
    let mut fresh = repo.load_index().await.unwrap();
    assert!(fresh.contains(&id));
    assert_eq!(repo.adopt_unindexed_packs(&mut fresh).await.unwrap(), 0);
    assert_eq!(repo.read_blob(&fresh, &id).await.unwrap(), c);
    assert!(repo.verify(true).await.unwrap().problems.is_empty());
}

#[tokio::test]
async fn prune_is_two_phase_and_rechecks_before_deleting() {
    let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let repo = Arc::new(
        Repository::init(b.clone(), &pw("p"), &InitOptions::default())
            .await
            .unwrap(),
    );
    let old = store(&repo, "v", &[chunk(1), chunk(2)], 1).await;
    let keep = store(&repo, "v", &[chunk(2), chunk(3)], 1).await;
    let packs_before = b.list("packs/").await.unwrap().len();
    repo.delete_snapshot(&old.id).await.unwrap();

    // Phase 1 only: chunk(1)'s pack and old's list pack are marked, nothing deleted.
    let r = repo.prune(3600).await.unwrap();
    assert_eq!(r.marked_packs, 2, "{r:?}");
    assert_eq!(r.deleted_packs, 0);
    assert_eq!(b.list("packs/").await.unwrap().len(), packs_before);
    // A new snapshot does not dedup against marked packs: chunk(1) is stored again.
    let dedup = repo.load_dedup_index().await.unwrap();
    assert!(!dedup.contains(&repo.chunk_key().chunk_id(&chunk(1))));

    // A snapshot that had deduped against a marked pack before the mark (simulated by
    // writing its manifest straight onto the old list) makes the re-check keep it.
    let mut m = old.manifest.clone();
    m.volume = "w".into();
    let revived = repo.save_snapshot(m).await.unwrap();
    let r = repo.prune(0).await.unwrap();
    assert_eq!(r.kept_after_recheck, 2, "{r:?}");
    assert_eq!(r.deleted_packs, 0, "{r:?}");
    repo.delete_snapshot(&revived.id).await.unwrap();
    let r = repo.prune(0).await.unwrap();
    assert_eq!(r.deleted_packs, 2, "{r:?}");
    assert_eq!(b.list("packs/").await.unwrap().len(), packs_before - 2);
    assert!(b.list("prune/").await.unwrap().is_empty());
    // What is left is complete and compacted into one index.
    let rep = repo.verify(true).await.unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);
    assert_eq!(rep.snapshots, 1);
    assert_eq!(b.list("index/").await.unwrap().len(), 1);
    let index = repo.load_index().await.unwrap();
    let Content::Block { lists, .. } = &keep.manifest.content else {
        panic!("a block snapshot")
    };
    assert_eq!(repo.read_list(&index, &lists[0]).await.unwrap().len(), 2);
}

#[tokio::test]
async fn index_cache_replaces_gets_and_follows_compaction() {
    let dir = tempfile::tempdir().unwrap();
    let fault = Arc::new(snapshots::FaultBackend::new(Arc::new(MemoryBackend::new())));
    let b: Arc<dyn Backend> = fault.clone();
    let repo = Repository::init(b.clone(), &pw("p"), &InitOptions::default())
        .await
        .unwrap();
    let repo = Arc::new(repo.with_cache_dir(Some(dir.path().to_path_buf())));
    let old = store(&repo, "v", &[chunk(1)], 1).await;
    store(&repo, "v", &[chunk(2)], 1).await;
    let first = repo.load_index().await.unwrap();
    let gets = fault.counts().get;
    let second = repo.load_index().await.unwrap();
    assert_eq!(fault.counts().get, gets, "the cached index needs no GET");
    assert_eq!(first.len(), second.len());
    assert_eq!(second.len(), 4);
    // A damaged cache file is not trusted.
    let cached: Vec<_> = std::fs::read_dir(dir.path().join(&repo.config().id).join("index"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(cached.len(), 2);
    std::fs::write(&cached[0], b"garbage").unwrap();
    assert_eq!(repo.load_index().await.unwrap().len(), 4);
    assert_eq!(fault.counts().get, gets + 1);
    // After a prune compacts the index, stale cache entries go.
    repo.delete_snapshot(&old.id).await.unwrap();
    repo.prune(0).await.unwrap();
    assert_eq!(repo.load_index().await.unwrap().len(), 2);
    let left = std::fs::read_dir(dir.path().join(&repo.config().id).join("index"))
        .unwrap()
        .count();
    assert_eq!(left, 1);
}

#[tokio::test]
async fn prune_repacks_mostly_unused_packs() {
    let b: Arc<dyn Backend> = Arc::new(MemoryBackend::new());
    let repo = Arc::new(
        Repository::init(b.clone(), &pw("p"), &InitOptions::default())
            .await
            .unwrap(),
    );
    let chunks: Vec<Vec<u8>> = (1..=4).map(chunk).collect();
    let old = store(&repo, "v", &chunks, 4).await;
    let keep = store(&repo, "v", &chunks[..1], 1).await;
    repo.delete_snapshot(&old.id).await.unwrap();
    let r = repo.prune(0).await.unwrap();
    // The data pack is 3/4 unused: chunk 1 moves to a new pack, the old one goes, and
    // so does the old snapshot's list pack.
    assert_eq!(r.repacked_packs, 1, "{r:?}");
    assert_eq!(r.deleted_packs, 2, "{r:?}");
    assert_eq!(r.kept_after_recheck, 0, "{r:?}");
    let index = repo.load_index().await.unwrap();
    assert_eq!(index.len(), 2, "chunk 1 and keep's list");
    let id = repo.chunk_key().chunk_id(&chunks[0]);
    assert_eq!(repo.read_blob(&index, &id).await.unwrap(), chunks[0]);
    let rep = repo.verify(true).await.unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);
    let Content::Block { lists, .. } = &keep.manifest.content else {
        panic!("a block snapshot")
    };
    assert_eq!(repo.read_list(&index, &lists[0]).await.unwrap().len(), 1);
    // Nothing left to do.
    let r = repo.prune(0).await.unwrap();
    assert_eq!(
        (r.marked_packs, r.deleted_packs, r.repacked_packs),
        (0, 0, 0),
        "{r:?}"
    );
}
