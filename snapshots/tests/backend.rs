//! One conformance suite for every `Backend`: memory, local directory, and S3 against a
//! real `s3s-fs` server on 127.0.0.1; plus the retry and fault-injection wrappers.

use bytes::Bytes;
use rand::{Rng, SeedableRng, rngs::StdRng};
use snapshots::{
    Backend, Fault, FaultBackend, LocalBackend, MemoryBackend, RepoError, RetryBackend,
    RetryPolicy, S3Backend, testing::S3Server,
};
use std::{
    sync::Arc,
    time::{Duration, Instant},
};

fn random_bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill(&mut v[..]);
    v
}

async fn sorted_keys(b: &dyn Backend, prefix: &str) -> Vec<(String, u64)> {
    let mut v: Vec<_> = b
        .list(prefix)
        .await
        .unwrap()
        .into_iter()
        .map(|o| (o.key, o.size))
        .collect();
    v.sort();
    v
}

/// The behaviour every backend must have.
async fn conformance(b: Arc<dyn Backend>) {
    // Missing objects are NotFound, for get; delete of a missing object succeeds.
    let e = b.get("config", None).await.unwrap_err();
    assert!(e.is_not_found(), "{e}");
    b.delete("config").await.unwrap();
    assert!(sorted_keys(&*b, "").await.is_empty());

    // Round trip, overwrite, empty object.
    b.put("config", Bytes::from_static(b"one")).await.unwrap();
    assert_eq!(&b.get("config", None).await.unwrap()[..], b"one");
    b.put("config", Bytes::from_static(b"two!")).await.unwrap();
    assert_eq!(&b.get("config", None).await.unwrap()[..], b"two!");
    b.put("keys/empty", Bytes::new()).await.unwrap();
    assert!(b.get("keys/empty", None).await.unwrap().is_empty());

    // Ranged reads: inside, clamped at the end, and a start past the end is an error.
    let big = random_bytes(1, 5 << 20);
    b.put("packs/ab/abcd", Bytes::from(big.clone()))
        .await
        .unwrap();
    assert_eq!(b.get("packs/ab/abcd", None).await.unwrap(), big);
    let r = b.get("packs/ab/abcd", Some(1000..70_000)).await.unwrap();
    assert_eq!(&r[..], &big[1000..70_000]);
    let n = big.len() as u64;
    let r = b.get("packs/ab/abcd", Some(n - 8..n + 100)).await.unwrap();
    assert_eq!(&r[..], &big[big.len() - 8..]);
    let e = b
        .get("packs/ab/abcd", Some(n + 10..n + 20))
        .await
        .unwrap_err();
    assert!(!e.is_not_found() && !e.is_retryable(), "{e}");

    // Listing by prefix, nested keys, sizes; no temp files or lookalike prefixes.
    b.put("packs/cd/cdef", Bytes::from_static(b"12345"))
        .await
        .unwrap();
    b.put("packsX", Bytes::from_static(b"x")).await.unwrap();
    b.put("index/0001", Bytes::from_static(b"i")).await.unwrap();
    assert_eq!(
        sorted_keys(&*b, "packs/").await,
        vec![("packs/ab/abcd".into(), n), ("packs/cd/cdef".into(), 5)]
    );
    assert_eq!(
        sorted_keys(&*b, "index/").await,
        vec![("index/0001".into(), 1)]
    );
    assert!(sorted_keys(&*b, "snapshots/").await.is_empty());
    assert_eq!(sorted_keys(&*b, "").await.len(), 6);

    // Delete.
    b.delete("packs/cd/cdef").await.unwrap();
    assert!(
        b.get("packs/cd/cdef", None)
            .await
            .unwrap_err()
            .is_not_found()
    );
    assert_eq!(sorted_keys(&*b, "packs/").await.len(), 1);

    // Concurrent puts of different keys all land.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..16u64 {
        let b = b.clone();
        tasks.spawn(async move {
            b.put(
                &format!("snapshots/{i:04}"),
                Bytes::from(random_bytes(i, 10_000)),
            )
            .await
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap().unwrap();
    }
    let snaps = sorted_keys(&*b, "snapshots/").await;
    assert_eq!(snaps.len(), 16);
    for i in 0..16u64 {
        assert_eq!(
            b.get(&format!("snapshots/{i:04}"), None).await.unwrap(),
            random_bytes(i, 10_000)
        );
    }

    // Keys that could escape the root are refused.
    assert!(b.put("../escape", Bytes::new()).await.is_err());
    assert!(b.put("/abs", Bytes::new()).await.is_err());
}

#[tokio::test]
async fn memory_backend_conforms() {
    conformance(Arc::new(MemoryBackend::new())).await;
}

#[tokio::test]
async fn local_backend_conforms_and_leaves_no_temp_files() {
    let dir = tempfile::tempdir().unwrap();
    conformance(Arc::new(LocalBackend::new(dir.path().join("repo")))).await;
    let mut stray = Vec::new();
    for e in walk(&dir.path().join("repo")) {
        if e.file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(".tmp.")
        {
            stray.push(e);
        }
    }
    assert!(stray.is_empty(), "temp files left: {stray:?}");
}

fn walk(p: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(p).unwrap() {
        let e = e.unwrap().path();
        if e.is_dir() {
            out.extend(walk(&e));
        } else {
            out.push(e);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_backend_conforms_against_s3s_fs() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path());
    server.create_bucket("bucket");
    let b = S3Backend::new(&server.options("bucket", "some/prefix")).await;
    conformance(Arc::new(b)).await;
    // The prefix is honoured: objects live under it in the bucket.
    assert!(dir.path().join("bucket/some/prefix/config").is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_missing_bucket_wrong_credentials_and_endpoint_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let server = S3Server::start(dir.path());
    let b = S3Backend::new(&server.options("nobucket", "")).await;
    let e = b.get("config", None).await.unwrap_err();
    assert!(matches!(e, RepoError::NoBucket { .. }), "{e}");
    assert!(
        e.to_string().contains("bucket nobucket does not exist"),
        "{e}"
    );

    server.create_bucket("bkt");
    let mut opts = server.options("bkt", "");
    opts.secret_access_key = Some("wrong".into());
    let e = S3Backend::new(&opts).await.list("").await.unwrap_err();
    assert!(!e.is_retryable(), "{e}");
    assert!(e.to_string().contains("403"), "{e}");

    let mut opts = server.options("bkt", "");
    opts.endpoint = Some("http://127.0.0.1:1".into());
    let e = S3Backend::new(&opts).await.list("").await.unwrap_err();
    assert!(e.is_retryable(), "{e}");
    assert!(
        e.to_string().contains("cannot reach http://127.0.0.1:1"),
        "{e}"
    );
}

fn quick_policy(max_elapsed_ms: u64, attempt_timeout_ms: u64) -> RetryPolicy {
    RetryPolicy {
        initial_delay: Duration::from_millis(10),
        max_delay: Duration::from_millis(100),
        max_elapsed: Duration::from_millis(max_elapsed_ms),
        attempt_timeout: Duration::from_millis(attempt_timeout_ms),
    }
}

#[tokio::test]
async fn retry_rides_out_500_503_and_timeouts() {
    let fault = Arc::new(FaultBackend::new(Arc::new(MemoryBackend::new())));
    let b = RetryBackend::new(fault.clone(), quick_policy(10_000, 200));
    fault.push([
        Fault::Status(503),
        Fault::Status(500),
        Fault::Delay(Duration::from_secs(5)),
        Fault::Status(503),
    ]);
    b.put("config", Bytes::from_static(b"c")).await.unwrap();
    assert_eq!(fault.counts().put, 5);
    assert_eq!(fault.counts().faults, 4);
    fault.push([Fault::Status(503)]);
    assert_eq!(&b.get("config", None).await.unwrap()[..], b"c");
    assert_eq!(fault.counts().get, 2);
}

#[tokio::test]
async fn retry_gives_up_after_bounded_time_and_not_on_permanent_errors() {
    let fault = Arc::new(FaultBackend::new(Arc::new(MemoryBackend::new())));
    let b = RetryBackend::new(fault.clone(), quick_policy(500, 200));
    fault.set_always(Some(Fault::Status(503)));
    let started = Instant::now();
    let e = b.put("config", Bytes::new()).await.unwrap_err();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "took {took:?}");
    assert!(matches!(e, RepoError::RetriesExhausted { .. }), "{e}");
    assert!(e.to_string().contains("gave up after"), "{e}");
    assert!(fault.counts().put >= 3, "{:?}", fault.counts());

    // A permanent error (403) is not retried.
    fault.set_always(None);
    fault.push([Fault::Status(403)]);
    let before = fault.counts().get;
    let e = b.get("config", None).await.unwrap_err();
    assert!(!e.is_retryable(), "{e}");
    assert_eq!(fault.counts().get, before + 1);
    // Neither is a missing object.
    let e = b.get("nothing", None).await.unwrap_err();
    assert!(e.is_not_found());

    // A hung server: every attempt times out, and the whole call is still bounded.
    fault.set_always(Some(Fault::Delay(Duration::from_secs(30))));
    let started = Instant::now();
    let e = b.list("").await.unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert!(e.to_string().contains("no answer within"), "{e}");
}
