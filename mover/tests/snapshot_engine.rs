//! The snapshot engine against real image files: round trips (local directory and a
//! real S3 server), incremental snapshots, delta restores, diff, retries under injected
//! faults, damaged packs, concurrent snapshots with prune.

use mover::{RestoreOptions, SnapshotCreateOptions, create_snapshot, restore_snapshot};
use rand::{Rng, SeedableRng, rngs::StdRng};
use snapshots::{
    Backend, Credentials, Fault, FaultBackend, InitOptions, LocalBackend, RepoError, Repository,
    RetryBackend, RetryPolicy, S3Backend, testing::S3Server,
};
use std::{
    fs,
    os::unix::fs::{FileExt, MetadataExt},
    path::Path,
    sync::Arc,
    time::Duration,
};

const MIB: u64 = 1 << 20;

/// A sparse image of `mib` MiB: seeded random chunks, a 3 MiB hole at 2 MiB, a
/// written all-zero MiB at 8 MiB, and a compressible (text-like) MiB at 9 MiB.
fn make_image(path: &Path, mib: u64, seed: u64) {
    let f = fs::File::create(path).unwrap();
    f.set_len(mib * MIB).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut buf = vec![0u8; MIB as usize];
    for c in 0..mib {
        match c {
            2..=4 => continue,
            8 => buf.fill(0),
            9 => buf
                .iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = b"mover text "[i % 11]),
            _ => rng.fill(&mut buf[..]),
        }
        f.write_all_at(&buf, c * MIB).unwrap();
    }
}

/// Overwrites 4 KiB at each given MiB with fresh random bytes.
fn change_chunks(path: &Path, chunks: &[u64], seed: u64) {
    let f = fs::OpenOptions::new().write(true).open(path).unwrap();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut page = [0u8; 4096];
    for c in chunks {
        rng.fill(&mut page[..]);
        f.write_all_at(&page, c * MIB + 8192).unwrap();
    }
}

fn b3(path: &Path) -> blake3::Hash {
    blake3::hash(&fs::read(path).unwrap())
}

fn password() -> Credentials {
    Credentials::Password("correct horse".into())
}

async fn init(backend: Arc<dyn Backend>) -> Arc<Repository> {
    Arc::new(
        Repository::init(backend, &password(), &InitOptions::default())
            .await
            .unwrap(),
    )
}

async fn round_trip(repo: Arc<Repository>, dir: &Path) {
    let img = dir.join("vol.img");
    make_image(&img, 40, 1);
    let opts = SnapshotCreateOptions::default();
    let s1 = create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    let sum = &s1.manifest.summary;
    assert_eq!(
        sum.zero_chunks, 4,
        "the hole and the zero chunk are not data"
    );
    assert_eq!(sum.data_chunks, 36);
    assert_eq!(sum.new_chunks, 36);
    // Packs close once they pass 16 MiB, and the two stripes of a first snapshot fill
    // their own: three data packs for 36 chunks wherever the stripes meet (the front's
    // 0, 5, 12, 20, 28 or 36 data chunks and the back's rest), and one pack of lists.
    assert_eq!(sum.packs, 4);
    assert!(sum.stored_bytes < 36 * MIB, "the text chunk was compressed");

    // Full restore to a new file: identical, and the zero chunks are holes.
    let out = dir.join("restored.img");
    let r = restore_snapshot(repo.clone(), &s1.id[..10], &out, &RestoreOptions::default())
        .await
        .unwrap();
    assert_eq!(b3(&out), b3(&img));
    assert!(!r.delta);
    assert_eq!(r.chunks_fetched, 36);
    assert_eq!(r.zero_bytes, 4 * MIB);
    assert!(fs::metadata(&out).unwrap().blocks() * 512 <= 36 * MIB + 64 * 1024);

    // Incremental: change 3 chunks; only those are uploaded.
    let older = dir.join("older.img");
    fs::copy(&out, &older).unwrap();
    change_chunks(&img, &[0, 17, 33], 2);
    let s2 = create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    assert_eq!(s2.manifest.summary.new_chunks, 3);
    assert_eq!(s2.manifest.parent.as_deref(), Some(s1.id.as_str()));
    assert!(s2.manifest.summary.stored_bytes < 4 * MIB);

    // Diff names exactly the changed chunks.
    let index = repo.load_index().await.unwrap();
    let ranges = repo.diff(&index, &s1, &s2).await.unwrap();
    assert_eq!(ranges, vec![0..MIB, 17 * MIB..18 * MIB, 33 * MIB..34 * MIB]);

    // Delta restore onto the older copy writes only the 3 changed chunks.
    let r = restore_snapshot(repo.clone(), "latest", &older, &RestoreOptions::default())
        .await
        .unwrap();
    assert!(r.delta);
    assert_eq!(r.chunks_fetched, 3);
    assert_eq!(r.bytes_written, 3 * MIB);
    assert_eq!(r.chunks_unchanged, 37);
    assert_eq!(b3(&older), b3(&img));

    // Verify with data: clean.
    let rep = repo.verify(true).await.unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);
    assert_eq!(rep.snapshots, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_incremental_and_delta_restore_local() {
    let dir = tempfile::tempdir().unwrap();
    let repo = init(Arc::new(LocalBackend::new(dir.path().join("repo")))).await;
    round_trip(repo, dir.path()).await;
}

/// A restore writes each run of adjacent chunks from one buffer filled in place: a
/// chunk held at several offsets (adjacent, apart, in one run and across runs) and a
/// short last chunk of a size that is no multiple of 4 KiB must all land exactly, on a
/// new file and onto a damaged copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_chunks_and_an_odd_tail_restore_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let repo = init(Arc::new(LocalBackend::new(dir.path().join("repo")))).await;
    let img = dir.path().join("vol.img");
    let mut rng = StdRng::seed_from_u64(7);
    let mut chunk = |_: u8| {
        let mut c = vec![0u8; MIB as usize];
        rng.fill(&mut c[..]);
        c
    };
    let (a, b) = (chunk(0), chunk(1));
    let mut data = Vec::new();
    for c in [&a, &a, &a, &b, &a, &vec![0; MIB as usize], &b] {
        data.extend_from_slice(c);
    }
    for i in 0..12 {
        data.extend_from_slice(&chunk(i));
    }
    data.extend_from_slice(&a); // chunk 19: far from the others, in another run
    data.extend_from_slice(&chunk(20)[..12_345]);
    fs::write(&img, &data).unwrap();

    let s = create_snapshot(repo.clone(), &img, &SnapshotCreateOptions::default())
        .await
        .unwrap();
    assert_eq!(s.manifest.summary.data_chunks, 20);
    assert_eq!(
        s.manifest.summary.new_chunks, 15,
        "a and b are stored once each"
    );

    let out = dir.path().join("restored.img");
    let r = restore_snapshot(repo.clone(), "latest", &out, &RestoreOptions::default())
        .await
        .unwrap();
    assert_eq!(fs::read(&out).unwrap(), data);
    assert_eq!(r.chunks_fetched, 20, "every place of every data chunk");
    assert_eq!(r.bytes_written, data.len() as u64 - MIB);

    // Onto a copy with a repeated chunk, the odd tail and a middle chunk damaged.
    let f = fs::OpenOptions::new().write(true).open(&out).unwrap();
    for at in [MIB + 100, 4 * MIB, 10 * MIB + 5, 20 * MIB + 12_000] {
        f.write_all_at(b"damage", at).unwrap();
    }
    drop(f);
    let r = restore_snapshot(repo.clone(), "latest", &out, &RestoreOptions::default())
        .await
        .unwrap();
    assert!(r.delta);
    assert_eq!(r.chunks_fetched, 4);
    assert_eq!(fs::read(&out).unwrap(), data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trip_incremental_and_delta_restore_s3() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(&dir.path().join("s3"));
    server.create_bucket("dr-bucket");
    let counted = Arc::new(FaultBackend::new(Arc::new(
        S3Backend::new(&server.options("dr-bucket", "cluster-a")).await,
    )));
    let repo = init(counted.clone()).await;
    round_trip(repo, dir.path()).await;
    // At most one PUT per 16 MiB stored, plus per snapshot one partly filled data pack
    // and three small objects (list pack, index delta, manifest), plus config and key;
    // never one per chunk (43 chunks were stored).
    let c = counted.counts();
    let allowed = c.put_bytes.div_ceil(16 * MIB) + 2 * 4 + 2;
    assert!(c.put <= allowed, "{c:?}, allowed {allowed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn injected_500_503_and_timeouts_are_retried() {
    let dir = tempfile::tempdir().unwrap();
    let fault = Arc::new(FaultBackend::new(Arc::new(LocalBackend::new(
        dir.path().join("repo"),
    ))));
    let policy = RetryPolicy {
        initial_delay: Duration::from_millis(5),
        max_delay: Duration::from_millis(50),
        max_elapsed: Duration::from_secs(20),
        attempt_timeout: Duration::from_millis(500),
    };
    let backend: Arc<dyn Backend> = Arc::new(RetryBackend::new(fault.clone(), policy));
    let repo = init(backend).await;
    let img = dir.path().join("vol.img");
    make_image(&img, 20, 3);
    // Every third call fails in one of the ways S3 fails.
    let faults: Vec<Fault> = (0..60)
        .map(|i| match i % 6 {
            0 => Fault::Status(503),
            2 => Fault::Status(500),
            4 => Fault::Delay(Duration::from_secs(3)),
            _ => Fault::Delay(Duration::ZERO),
        })
        .collect();
    fault.push(faults);
    let s = create_snapshot(repo.clone(), &img, &SnapshotCreateOptions::default())
        .await
        .unwrap();
    let out = dir.path().join("out.img");
    restore_snapshot(repo.clone(), &s.id, &out, &RestoreOptions::default())
        .await
        .unwrap();
    assert_eq!(b3(&out), b3(&img));
    assert!(fault.counts().faults >= 20, "{:?}", fault.counts());

    // A backend that keeps failing: a clear error after the bounded time, no snapshot.
    fault.set_always(Some(Fault::Status(503)));
    let started = std::time::Instant::now();
    let e = create_snapshot(repo.clone(), &img, &SnapshotCreateOptions::default())
        .await
        .unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(40));
    assert!(matches!(e, RepoError::RetriesExhausted { .. }), "{e}");
    assert!(e.to_string().contains("503"), "{e}");
    fault.set_always(None);
    assert_eq!(repo.snapshots().await.unwrap().len(), 1);
}

/// A backend whose reads of more than 64 KiB of a pack fail, once `fail` is set: the
/// bases an incremental snapshot fetches (1 MiB chunks of random bytes), not the chunk
/// lists it reads (a few KiB).
#[derive(Debug)]
struct BaseReadsFail {
    inner: Arc<dyn Backend>,
    fail: std::sync::atomic::AtomicBool,
}

impl BaseReadsFail {
    /// A local repository at `dir`, its base reads working until `fail` is set.
    fn local(dir: &Path) -> Arc<BaseReadsFail> {
        Arc::new(BaseReadsFail {
            inner: Arc::new(LocalBackend::new(dir)),
            fail: false.into(),
        })
    }
}

#[async_trait::async_trait]
impl Backend for BaseReadsFail {
    fn location(&self) -> String {
        self.inner.location()
    }

    async fn list(&self, prefix: &str) -> snapshots::Result<Vec<snapshots::ObjectInfo>> {
        self.inner.list(prefix).await
    }

    async fn get(
        &self,
        key: &str,
        range: Option<std::ops::Range<u64>>,
    ) -> snapshots::Result<snapshots::Bytes> {
        let big = range.as_ref().is_some_and(|r| r.end - r.start > 64 * 1024);
        if big && self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(RepoError::Backend {
                location: self.location(),
                op: "get",
                key: key.into(),
                retryable: false,
                detail: "injected: no base reads".into(),
            });
        }
        self.inner.get(key, range).await
    }

    async fn put(&self, key: &str, data: snapshots::Bytes) -> snapshots::Result<()> {
        self.inner.put(key, data).await
    }

    async fn delete(&self, key: &str) -> snapshots::Result<()> {
        self.inner.delete(key).await
    }
}

/// An incremental snapshot fetches its new chunks' bases a window ahead, on the runtime:
/// a base that cannot be fetched fails the snapshot with the backend's own error, saves
/// no snapshot, and the next run (bases readable again) stores the chunks as deltas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incremental_whose_bases_cannot_be_read_fails_with_the_read_error() {
    let dir = tempfile::tempdir().unwrap();
    let backend = BaseReadsFail::local(&dir.path().join("repo"));
    let repo = init(backend.clone()).await;
    let img = dir.path().join("vol.img");
    make_image(&img, 40, 5);
    let opts = SnapshotCreateOptions::default();
    create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    // Every window's chunks changed: each of them waits for bases.
    let changed: Vec<u64> = (0..40).filter(|c| !(2..=4).contains(c)).collect();
    change_chunks(&img, &changed, 6);

    backend
        .fail
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let e = create_snapshot(repo.clone(), &img, &opts)
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("injected: no base reads"),
        "the read's error, not the sealer's: {e}"
    );
    assert_eq!(repo.snapshots().await.unwrap().len(), 1);

    backend
        .fail
        .store(false, std::sync::atomic::Ordering::SeqCst);
    let s = create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    // Every changed chunk is new; all but the one that was zeros are deltas of their
    // parent chunk (one page of 256 differs).
    let sum = &s.manifest.summary;
    assert_eq!(sum.new_chunks, changed.len() as u64, "{sum:?}");
    assert_eq!(sum.delta_chunks, changed.len() as u64 - 1, "{sum:?}");
    let out = dir.path().join("out.img");
    restore_snapshot(repo.clone(), "latest", &out, &RestoreOptions::default())
        .await
        .unwrap();
    assert_eq!(b3(&out), b3(&img));
}

/// With the repository's local cache, a snapshot keeps the page hashes (BLAKE3 CVs) of
/// the chunks it stores whole, and the next one finds a changed chunk's differing pages
/// from them: it reads no base (base reads fail here), stores the same deltas, and
/// restores exactly. A kept record that does not match its base (damaged here) costs
/// the base's read, never a wrong delta, and is written anew from the base read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_incremental_finds_changed_pages_from_kept_page_hashes_without_reading_bases() {
    use std::sync::atomic::Ordering::SeqCst;
    let dir = tempfile::tempdir().unwrap();
    let backend = BaseReadsFail::local(&dir.path().join("repo"));
    let cache = dir.path().join("cache");
    let repo = Arc::new(
        Repository::init(backend.clone(), &password(), &InitOptions::default())
            .await
            .unwrap()
            .with_cache_dir(Some(cache.clone())),
    );
    let img = dir.path().join("vol.img");
    make_image(&img, 40, 5);
    let opts = SnapshotCreateOptions::default();
    create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    // The first snapshot merged its chunk ids from the page CVs it keeps; the next one
    // hashes whole chunks: the same ids, so nothing is new.
    let again = create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    assert_eq!(
        again.manifest.summary.new_chunks, 0,
        "{:?}",
        again.manifest.summary
    );
    let changed: Vec<u64> = (0..40).filter(|c| !(2..=4).contains(c)).collect();
    let restores_exactly = || async {
        let out = dir.path().join("out.img");
        _ = fs::remove_file(&out);
        restore_snapshot(repo.clone(), "latest", &out, &RestoreOptions::default())
            .await
            .unwrap();
        assert_eq!(b3(&out), b3(&img));
    };

    change_chunks(&img, &changed, 6);
    backend.fail.store(true, SeqCst);
    let s = create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    let sum = &s.manifest.summary;
    assert_eq!(sum.new_chunks, changed.len() as u64, "{sum:?}");
    // All but the chunk that was zeros (it has no base) are one-page deltas.
    assert_eq!(sum.delta_chunks, changed.len() as u64 - 1, "{sum:?}");
    assert_eq!(
        sum.delta_bytes,
        (changed.len() as u64 - 1) * 4096,
        "{sum:?}"
    );
    backend.fail.store(false, SeqCst);
    restores_exactly().await;

    // Damage every kept record of a changed place: its CVs no longer merge into the id
    // of the base, so the base is read (and with reads failing, the snapshot fails).
    let kept: Vec<_> = fs::read_dir(repo.cache_dir().unwrap().join("pages"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(kept.len(), 1, "one record file per volume: {kept:?}");
    let f = fs::OpenOptions::new().write(true).open(&kept[0]).unwrap();
    for c in &changed {
        f.write_all_at(&[0xa5; 32], c * 256 * 32 + 64).unwrap();
    }
    change_chunks(&img, &changed, 7);
    backend.fail.store(true, SeqCst);
    let e = create_snapshot(repo.clone(), &img, &opts)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("injected: no base reads"), "{e}");
    backend.fail.store(false, SeqCst);
    let s = create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    assert_eq!(s.manifest.summary.delta_chunks, changed.len() as u64);
    restores_exactly().await;

    // The base reads wrote the records anew: no base is read again.
    change_chunks(&img, &changed, 8);
    backend.fail.store(true, SeqCst);
    let s = create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    assert_eq!(s.manifest.summary.delta_chunks, changed.len() as u64);
    backend.fail.store(false, SeqCst);
    restores_exactly().await;
}

/// Flips one byte inside a data blob of the first data pack on disk.
fn flip_byte_in_a_pack(repo_dir: &Path) -> std::path::PathBuf {
    let mut packs: Vec<_> = fs::read_dir(repo_dir.join("packs"))
        .unwrap()
        .flat_map(|d| fs::read_dir(d.unwrap().path()).unwrap())
        .map(|e| e.unwrap().path())
        .collect();
    packs.sort_by_key(|p| std::cmp::Reverse(fs::metadata(p).unwrap().len()));
    let p = packs[0].clone();
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 5000).unwrap();
    b[0] ^= 0x40;
    f.write_all_at(&b, 5000).unwrap();
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flipped_byte_is_found_by_verify_and_refused_by_restore() {
    let dir = tempfile::tempdir().unwrap();
    let repo_dir = dir.path().join("repo");
    let repo = init(Arc::new(LocalBackend::new(&repo_dir))).await;
    let img = dir.path().join("vol.img");
    // One 8 MiB window, so one stripe reads it all and its chunks go into one data pack
    // in volume order (with two windows, the stripe from the back may take both).
    make_image(&img, 8, 4);
    let s = create_snapshot(repo.clone(), &img, &SnapshotCreateOptions::default())
        .await
        .unwrap();
    // Structure alone does not read data: clean.
    assert!(repo.verify(false).await.unwrap().problems.is_empty());
    flip_byte_in_a_pack(&repo_dir);
    let rep = repo.verify(true).await.unwrap();
    assert!(!rep.problems.is_empty());
    assert_eq!(rep.damaged.len(), 1);
    assert_eq!(rep.damaged[0].id, s.id);
    // Offset 5000 of the first pack is in its first blob: the volume's first chunk.
    assert_eq!(rep.damaged[0].ranges, vec![0..MIB]);

    let out = dir.path().join("out.img");
    let e = restore_snapshot(repo.clone(), &s.id, &out, &RestoreOptions::default())
        .await
        .unwrap_err();
    assert!(e.is_corruption(), "{e}");
    assert!(e.to_string().contains("fails authentication"), "{e}");
    assert!(!out.exists(), "no restored image may appear");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creates_and_prune_lose_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let repo = init(Arc::new(LocalBackend::new(dir.path().join("repo")))).await;
    let (a, b) = (dir.path().join("a.img"), dir.path().join("b.img"));
    make_image(&a, 24, 5);
    make_image(&b, 24, 6);
    // Some history to forget, so prune has work.
    let old = create_snapshot(repo.clone(), &a, &SnapshotCreateOptions::default())
        .await
        .unwrap();
    repo.delete_snapshot(&old.id).await.unwrap();
    change_chunks(&a, &[1, 5], 7);
    let opts = SnapshotCreateOptions::default();
    let (ra, rb, rp) = tokio::join!(
        create_snapshot(repo.clone(), &a, &opts),
        create_snapshot(repo.clone(), &b, &opts),
        repo.prune(3600),
    );
    let (sa, sb) = (ra.unwrap(), rb.unwrap());
    rp.unwrap();
    // A later prune after the grace period (simulated by 0) re-checks and deletes only
    // what no snapshot uses.
    let rep = repo.prune(0).await.unwrap();
    assert!(rep.deleted_packs >= 1, "{rep:?}");
    for (s, img) in [(&sa, &a), (&sb, &b)] {
        let out = dir.path().join(format!("{}.out", s.short_id()));
        restore_snapshot(repo.clone(), &s.id, &out, &RestoreOptions::default())
            .await
            .unwrap();
        assert_eq!(b3(&out), b3(img));
    }
    assert!(repo.verify(true).await.unwrap().problems.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interrupted_restore_is_finished_by_rerunning_it() {
    let dir = tempfile::tempdir().unwrap();
    let repo = init(Arc::new(LocalBackend::new(dir.path().join("repo")))).await;
    let img = dir.path().join("vol.img");
    make_image(&img, 12, 8);
    let s = create_snapshot(repo.clone(), &img, &SnapshotCreateOptions::default())
        .await
        .unwrap();
    // What an interrupted restore leaves: the hidden temp file, partly written, with
    // garbage where a zero chunk belongs and no file at the destination's name.
    let out = dir.path().join("out.img");
    let partial = dir.path().join(".out.img.mover-partial");
    fs::copy(&img, &partial).unwrap();
    change_chunks(&partial, &[1, 3, 8, 11], 9);
    let r = restore_snapshot(repo.clone(), &s.id, &out, &RestoreOptions::default())
        .await
        .unwrap();
    assert!(r.delta, "the partial file is compared, not rewritten");
    assert_eq!(r.chunks_fetched, 2, "chunks 1 and 11 hold data");
    assert_eq!(
        r.bytes_zeroed,
        2 * MIB,
        "chunks 3 and 8 are zero in the snapshot"
    );
    assert_eq!(b3(&out), b3(&img));
    assert!(!partial.exists());
}

/// Writes `count` fresh random 8 KiB pages (8 KiB aligned, like a database's) at seeded
/// random places of the image; returns the distinct 1 MiB chunks touched.
fn write_db_pages(path: &Path, count: usize, seed: u64) -> std::collections::BTreeSet<u64> {
    let f = fs::OpenOptions::new().write(true).open(path).unwrap();
    let pages = f.metadata().unwrap().len() / 8192;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut page = [0u8; 8192];
    let mut touched = std::collections::BTreeSet::new();
    let mut done = std::collections::BTreeSet::new();
    while done.len() < count {
        let p = rng.random_range(0..pages);
        // Data chunks only (the hole and the zero chunk have no parent data).
        if !(2..=4).contains(&(p * 8192 / MIB)) && p * 8192 / MIB != 8 && done.insert(p) {
            rng.fill(&mut page[..]);
            f.write_all_at(&page, p * 8192).unwrap();
            touched.insert(p * 8192 / MIB);
        }
    }
    touched
}

/// Regression test named after the bench's miss: scattered 8 KiB page writes stored a
/// whole new 1 MiB chunk each (the incremental of a database volume was larger than
/// restic's). Now they are stored as the changed pages, deltas of deltas rebuild on the
/// first base, and prune keeps the bases a newer snapshot needs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scattered_page_writes_store_only_the_pages() {
    let dir = tempfile::tempdir().unwrap();
    let repo = init(Arc::new(LocalBackend::new(dir.path().join("repo")))).await;
    let img = dir.path().join("vol.img");
    make_image(&img, 40, 11);
    let opts = SnapshotCreateOptions::default();
    let s1 = create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    let v1 = b3(&img);

    // 24 pages of 8 KiB (incompressible) scattered over the volume.
    const K: usize = 24;
    let touched = write_db_pages(&img, K, 12);
    let s2 = create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    let sum = &s2.manifest.summary;
    assert_eq!(sum.new_chunks, touched.len() as u64);
    assert_eq!(sum.delta_chunks, touched.len() as u64, "{sum:?}");
    assert_eq!(
        sum.delta_bytes,
        (K * 8192) as u64,
        "two 4 KiB pages per write"
    );
    // What was written, plus per chunk a seal and a bitmap, plus the list pack and
    // pack trailers: far below one chunk per write.
    let bound = (K * 8192) as u64 + touched.len() as u64 * 200 + 8192;
    assert!(sum.stored_bytes <= bound, "{} > {bound}", sum.stored_bytes);
    let v2 = b3(&img);

    // A second day: the same chunks change again (now deltas of the first base).
    write_db_pages(&img, K, 13);
    let s3 = create_snapshot(repo.clone(), &img, &opts).await.unwrap();
    assert!(s3.manifest.summary.delta_chunks > 0);
    let v3 = b3(&img);

    for (s, want) in [(&s1, v1), (&s2, v2), (&s3, v3)] {
        let out = dir.path().join(format!("{}.img", s.short_id()));
        let r = restore_snapshot(repo.clone(), &s.id, &out, &RestoreOptions::default())
            .await
            .unwrap();
        assert_eq!(b3(&out), want, "restore of {}", s.short_id());
        assert_eq!(r.chunks_fetched, 36);
    }
    let rep = repo.verify(true).await.unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);

    // Forget the first two snapshots: the third's deltas still need their bases.
    repo.delete_snapshot(&s1.id).await.unwrap();
    repo.delete_snapshot(&s2.id).await.unwrap();
    repo.prune(0).await.unwrap();
    let out = dir.path().join("after-prune.img");
    restore_snapshot(repo.clone(), &s3.id, &out, &RestoreOptions::default())
        .await
        .unwrap();
    assert_eq!(b3(&out), v3);
    let rep = repo.verify(true).await.unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);

    // --no-deltas stores changed chunks whole.
    write_db_pages(&img, 4, 14);
    let whole = SnapshotCreateOptions {
        no_deltas: true,
        ..Default::default()
    };
    let s4 = create_snapshot(repo.clone(), &img, &whole).await.unwrap();
    assert_eq!(s4.manifest.summary.delta_chunks, 0);
    assert!(s4.manifest.summary.new_chunks > 0);
}

/// Whether files `a` and `b` hold the same bytes, read 8 MiB at a time (for volumes
/// too big to hash in memory).
fn same_bytes(a: &Path, b: &Path) -> bool {
    let (fa, fb) = (fs::File::open(a).unwrap(), fs::File::open(b).unwrap());
    let len = fa.metadata().unwrap().len();
    if fb.metadata().unwrap().len() != len {
        return false;
    }
    let (mut x, mut y) = (vec![0u8; 8 << 20], vec![0u8; 8 << 20]);
    let mut at = 0;
    while at < len {
        let n = (len - at).min(x.len() as u64) as usize;
        fa.read_exact_at(&mut x[..n], at).unwrap();
        fb.read_exact_at(&mut y[..n], at).unwrap();
        if x[..n] != y[..n] {
            return false;
        }
        at += n as u64;
    }
    true
}

/// A first snapshot reads each chunk list's span from both ends at once (two stripes
/// that meet where they meet). On a sparse volume of two lists (64 KiB chunks: 4 GiB a
/// list), with data at both ends of the first span, near its middle and in the second,
/// and chunks repeated within a span and across spans: the lists hold every chunk in
/// its place, a repeated chunk is stored once, and the restore is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_of_two_chunk_lists_read_from_both_ends_restores_exactly() {
    const GIB: u64 = 1 << 30;
    const CHUNK: u64 = 64 << 10;
    let dir = tempfile::tempdir().unwrap();
    let init_opts = InitOptions {
        chunk_size: chunker::ChunkSize::new(CHUNK).unwrap(),
        ..Default::default()
    };
    let repo = Arc::new(
        Repository::init(
            Arc::new(LocalBackend::new(dir.path().join("repo"))),
            &password(),
            &init_opts,
        )
        .await
        .unwrap(),
    );
    let img = dir.path().join("vol.img");
    let f = fs::File::create(&img).unwrap();
    f.set_len(4 * GIB + 20 * MIB).unwrap();
    let mut rng = StdRng::seed_from_u64(21);
    let mut random = |len: u64| {
        let mut b = vec![0u8; len as usize];
        rng.fill(&mut b[..]);
        b
    };
    let (a, b, c, d, e) = (
        random(MIB),
        random(CHUNK),
        random(MIB),
        random(CHUNK),
        random(MIB),
    );
    for (at, data) in [
        (0, &a),
        (2 * GIB - CHUNK, &b),
        (4 * GIB - MIB, &c),
        (100 * MIB, &d),
        (4 * GIB - 100 * MIB, &d),
        (4 * GIB + 5 * MIB, &e),
        (4 * GIB + 12 * MIB, &a),
    ] {
        f.write_all_at(data, at).unwrap();
    }
    drop(f);

    let s = create_snapshot(repo.clone(), &img, &SnapshotCreateOptions::default())
        .await
        .unwrap();
    let sum = &s.manifest.summary;
    assert_eq!(sum.data_chunks, 16 + 1 + 16 + 2 + 16 + 16);
    assert_eq!(sum.new_chunks, 16 + 1 + 16 + 1 + 16, "repeated chunks once");
    assert_eq!(
        sum.zero_chunks,
        (4 * GIB + 20 * MIB) / CHUNK - sum.data_chunks
    );
    let snapshots::Content::Block { lists, .. } = &s.manifest.content else {
        panic!("a block snapshot");
    };
    assert_eq!(lists.len(), 2, "one list per 65536 chunks");

    let out = dir.path().join("restored.img");
    let r = restore_snapshot(repo.clone(), "latest", &out, &RestoreOptions::default())
        .await
        .unwrap();
    assert_eq!(r.chunks_fetched, sum.data_chunks);
    assert!(
        same_bytes(&out, &img),
        "the restore differs from the volume"
    );
    let rep = repo.verify(true).await.unwrap();
    assert!(rep.problems.is_empty(), "{:?}", rep.problems);
}
