//! The CSI stack issue 39 replicates from, run for real: a control plane ([`Cluster`]),
//! the hostpath CSI driver and the csi-provisioner, csi-snapshotter,
//! snapshot-controller and csi-snapshot-metadata processes ([`CsiStack`]); a block PVC,
//! two VolumeSnapshots of it with three 4 KiB blocks changed in between, and the
//! sidecar's `GetMetadataDelta` naming exactly those blocks. The client side is grpcurl
//! with `transport/proto/snapshot_metadata.proto` (the sidecar's own schema, copied),
//! then mover's own client (`mover::controller::snapshot_metadata`): the same blocks, a
//! stream cut twice by a proxy and resumed to the same ranges, a service down or a
//! request refused answered with the error that sends the cycle to a full comparison.
//!
//! What the sidecar (github.com/kubernetes-csi/external-snapshot-metadata v1.1.0) does
//! with a call, read from its source and checked here:
//!
//! - Authentication: it sends `security_token` to the TokenReview API with
//!   `spec.audiences = [audience]`, the audience being its `--audience` flag if set, else
//!   `spec.audience` of the SnapshotMetadataService named after the driver (here: no
//!   flag, the CR's). The token must be authenticated and `status.audiences` must contain
//!   it, else `Unauthenticated`. So the caller's token comes from the TokenRequest API
//!   with that audience (`kubectl create token SA --audience=...`); a token with the API
//!   server's default audience is refused.
//! - Authorization: one SubjectAccessReview for the token's user (username, groups, uid,
//!   extra) on verb `get`, group `snapshot.storage.k8s.io`, version `v1`, resource
//!   `volumesnapshots`, in the request's `namespace` (no resource name: any snapshot of
//!   the namespace). Denied is `PermissionDenied`. A Role granting `get` on
//!   volumesnapshots in that namespace is enough for the caller; the ClusterRole the
//!   sidecar's repository ships for clients (`external-snapshot-metadata-client-runner`)
//!   adds list/watch of VolumeSnapshots and VolumeSnapshotContents, get/list of
//!   SnapshotMetadataServices and create on serviceaccounts/token for the client's own
//!   lookups, not for the sidecar's check.
//! - Request (package `snapshotmetadata`, service `SnapshotMetadata`):
//!   `GetMetadataDeltaRequest { security_token = 1, namespace = 2, base_snapshot_id = 3,
//!   target_snapshot_name = 4, starting_offset = 5, max_results = 6 }`. The base is a CSI
//!   snapshot handle (VolumeSnapshotContent `status.snapshotHandle`), passed to the driver
//!   unchecked; the target is a VolumeSnapshot name in `namespace`, which must be
//!   readyToUse and of this driver, and the sidecar resolves to its handle.
//!   `GetMetadataAllocatedRequest { security_token, namespace, snapshot_name,
//!   starting_offset, max_results }`. `max_results = 0` lets the driver choose
//!   (hostpath: 256 blocks per response). Responses are streamed:
//!   `{ block_metadata_type, volume_capacity_bytes, repeated BlockMetadata { byte_offset,
//!   size_bytes } }`.
//! - hostpath (v1.18.0) compares its two snapshot files (a snapshot of a block volume is
//!   a `cp` of the volume's file) in 4 KiB blocks and answers `FIXED_LENGTH` blocks of
//!   4096 bytes each (`VARIABLE_LENGTH`, merging adjacent blocks, only with
//!   `-snapshot-metadata-block-type=VARIABLE_LENGTH`); `volume_capacity_bytes` is the
//!   volume's size.
#![cfg(feature = "controller")]

mod common;

use common::MIB;
use common::cluster::Cluster;
use common::csi::{CsiStack, CuttingProxy, HOSTPATH_BLOCK};
use mover::controller::snapshot_metadata::{self, DeltaOf, MetadataError, Retry, Service};
use rand::{RngCore, SeedableRng, rngs::StdRng};
use serde_json::{Value, json};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::Ordering;

const NS: &str = "default";
const VOLUME_SIZE: u64 = 64 * MIB;
/// The 4 KiB blocks changed between the two snapshots: the first, one in the middle,
/// the last.
const CHANGED: [u64; 3] = [0, 4242, VOLUME_SIZE / HOSTPATH_BLOCK - 1];

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// `GetMetadataDelta` through grpcurl over TLS, trusting the sidecar's CA: the streamed
/// responses, or the gRPC status's code name and message.
fn get_metadata_delta(stack: &CsiStack, request: &Value) -> Result<Vec<Value>, String> {
    let protos = repo().join("transport/proto");
    let out = stack.grpcurl(
        &[
            "-cacert",
            stack.metadata_ca.to_str().unwrap(),
            "-import-path",
            protos.to_str().unwrap(),
            "-proto",
            "snapshot_metadata.proto",
            &format!("127.0.0.1:{}", stack.metadata_port),
            "snapshotmetadata.SnapshotMetadata/GetMetadataDelta",
        ],
        &request.to_string(),
    );
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    let text = String::from_utf8(out.stdout).unwrap();
    Ok(serde_json::Deserializer::from_str(&text)
        .into_iter::<Value>()
        .map(Result::unwrap)
        .collect())
}

/// A protojson int64 (a string; absent when 0).
fn int64(v: &Value) -> u64 {
    match v {
        Value::Null => 0,
        Value::String(s) => s.parse().unwrap(),
        other => other.as_u64().unwrap(),
    }
}

fn token(cluster: &Cluster, sa: &str, audience: Option<&str>) -> String {
    let mut args = vec!["create", "token", sa, "-n", NS, "--duration=10m"];
    let flag;
    if let Some(a) = audience {
        flag = format!("--audience={a}");
        args.push(&flag);
    }
    cluster.kubectl_ok(&args).trim().to_string()
}

#[test]
fn snapshot_metadata_delta_names_exactly_the_changed_blocks() {
    // Both checks before a control plane starts for nothing.
    let Some(bin) = common::cluster::binaries() else {
        return;
    };
    if !common::csi::available(&bin) {
        return;
    }
    let tmp = tempfile::tempdir_in("/var/tmp").unwrap();
    let Some(cluster) = Cluster::start(tmp.path(), "csi") else {
        return;
    };
    let Some(stack) = CsiStack::start(&cluster, tmp.path(), "node-1") else {
        return;
    };

    let handle = stack.create_block_pvc(NS, "data", VOLUME_SIZE);
    let device = stack.emulate_kubelet_publish(&handle, &tmp.path().join("pods/data"));
    assert!(
        device.to_str().unwrap().starts_with("/dev/loop"),
        "{}",
        device.display()
    );
    let dev = std::fs::File::options().write(true).open(&device).unwrap();
    assert_eq!(common::size_of(&device), VOLUME_SIZE);

    // A known pattern over the whole volume, then snapshot 1.
    let mut rng = StdRng::seed_from_u64(39);
    let mut pattern = vec![0u8; VOLUME_SIZE as usize];
    rng.fill_bytes(&mut pattern);
    dev.write_all_at(&pattern, 0).unwrap();
    dev.sync_all().unwrap();
    let base = stack.snapshot(NS, "data", "snap-1");

    // Three blocks rewritten, then snapshot 2.
    for b in CHANGED {
        let mut block = vec![0u8; HOSTPATH_BLOCK as usize];
        rng.fill_bytes(&mut block);
        dev.write_all_at(&block, b * HOSTPATH_BLOCK).unwrap();
    }
    dev.sync_all().unwrap();
    let target = stack.snapshot(NS, "data", "snap-2");
    assert_ne!(base, target);

    // The caller: a ServiceAccount allowed exactly what the sidecar's
    // SubjectAccessReview asks.
    cluster.apply(&format!(
        "apiVersion: v1
kind: ServiceAccount
metadata:
  name: backup
  namespace: {NS}
---
apiVersion: v1
kind: ServiceAccount
metadata:
  name: stranger
  namespace: {NS}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: snapshot-reader
  namespace: {NS}
rules:
- apiGroups: [snapshot.storage.k8s.io]
  resources: [volumesnapshots]
  verbs: [get]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: backup-snapshot-reader
  namespace: {NS}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: snapshot-reader
subjects:
- kind: ServiceAccount
  name: backup
  namespace: {NS}
"
    ));
    let request = |token: &str| {
        json!({
            "securityToken": token,
            "namespace": NS,
            "baseSnapshotId": base,
            "targetSnapshotName": "snap-2",
            "startingOffset": 0,
            "maxResults": 0,
        })
    };

    let responses = get_metadata_delta(
        &stack,
        &request(&token(&cluster, "backup", Some(&stack.audience))),
    )
    .unwrap_or_else(|e| panic!("GetMetadataDelta failed: {e}\n{}", stack.logs()));
    let mut blocks = Vec::new();
    for r in &responses {
        assert_eq!(r["blockMetadataType"], "FIXED_LENGTH", "{r}");
        assert_eq!(int64(&r["volumeCapacityBytes"]), VOLUME_SIZE, "{r}");
        for m in r["blockMetadata"].as_array().into_iter().flatten() {
            blocks.push((int64(&m["byteOffset"]), int64(&m["sizeBytes"])));
        }
    }
    let want: Vec<_> = CHANGED
        .iter()
        .map(|b| (b * HOSTPATH_BLOCK, HOSTPATH_BLOCK))
        .collect();
    assert_eq!(blocks, want, "responses: {responses:?}");

    // A token for the API server's own audience: TokenReview with the
    // SnapshotMetadataService's audience does not accept it.
    let err = get_metadata_delta(&stack, &request(&token(&cluster, "backup", None)))
        .expect_err("a token without the audience is refused");
    assert!(err.contains("Code: Unauthenticated"), "{err}");
    // The right audience, but no `get` on volumesnapshots in the namespace.
    let err = get_metadata_delta(
        &stack,
        &request(&token(&cluster, "stranger", Some(&stack.audience))),
    )
    .expect_err("a caller without get on volumesnapshots is refused");
    assert!(err.contains("Code: PermissionDenied"), "{err}");

    // mover's own client (the controller's), through the SnapshotMetadataService.
    let rt = tokio::runtime::Runtime::new().unwrap();
    transport::tls::install_crypto_provider();
    let client = rt.block_on(cluster.client());
    let service = rt
        .block_on(snapshot_metadata::service(
            client.clone(),
            "hostpath.csi.k8s.io",
        ))
        .unwrap();
    assert_eq!(service.audience, stack.audience);
    let token = rt
        .block_on(snapshot_metadata::token(
            client,
            NS,
            "backup",
            &service.audience,
        ))
        .unwrap();
    let delta = |service: &Service, base: &str, target: &str, retry: Retry| {
        let of = DeltaOf {
            namespace: NS,
            base_snapshot_id: base,
            target_snapshot_name: target,
        };
        rt.block_on(snapshot_metadata::changed(service, &token, of, retry))
    };
    let got = delta(&service, &base, "snap-2", Retry::default()).unwrap();
    let ranges: Vec<_> = want.iter().map(|&(o, l)| o..o + l).collect();
    assert_eq!(got.ranges, ranges);
    assert_eq!((got.capacity, got.calls), (VOLUME_SIZE, 1));

    // Many changed blocks (every third of the first half: a dozen responses), read
    // through a proxy that cuts the first two connections part way: the same ranges,
    // each stream resumed where the last one stopped.
    let blocks = VOLUME_SIZE / HOSTPATH_BLOCK / 2;
    let mut block = vec![0u8; HOSTPATH_BLOCK as usize];
    for b in (0..blocks).step_by(3) {
        rng.fill_bytes(&mut block);
        dev.write_all_at(&block, b * HOSTPATH_BLOCK).unwrap();
    }
    dev.sync_all().unwrap();
    stack.snapshot(NS, "data", "snap-3");
    let direct = delta(&service, &target, "snap-3", Retry::default()).unwrap();
    assert_eq!(direct.bytes(), blocks.div_ceil(3) * HOSTPATH_BLOCK);
    assert_eq!(direct.ranges.len() as u64, blocks.div_ceil(3));
    let proxy = CuttingProxy::start(stack.metadata_port, 2, 8000);
    let through = Service {
        address: format!("127.0.0.1:{}", proxy.port),
        ..service.clone()
    };
    let resumed = delta(&through, &target, "snap-3", Retry::default()).unwrap();
    assert_eq!(resumed.ranges, direct.ranges);
    assert_eq!(resumed.calls, 3, "two cuts, two resumptions");
    assert_eq!(proxy.cut.load(Ordering::SeqCst), 2);

    // The service down: an error after the tries that says the volume is compared in
    // full instead; a refusal is not retried.
    let down = Service {
        address: format!("127.0.0.1:{}", common::agent::free_port()),
        ..service.clone()
    };
    let quick = Retry {
        tries: 3,
        first_backoff: std::time::Duration::from_millis(50),
    };
    let e = delta(&down, &target, "snap-3", quick).unwrap_err();
    assert!(
        matches!(e, MetadataError::Unavailable { tries: 3, .. })
            && e.to_string().contains("compares the whole volume instead"),
        "{e}"
    );
    // The sidecar answers a snapshot it cannot find as Unavailable (it may be on its
    // way): tried again, then the same error, naming it.
    let e = delta(&service, &target, "no-such-snapshot", quick).unwrap_err();
    assert!(
        matches!(e, MetadataError::Unavailable { .. }) && e.to_string().contains("not found"),
        "{e}"
    );
    let of = DeltaOf {
        namespace: NS,
        base_snapshot_id: &target,
        target_snapshot_name: "snap-3",
    };
    let e = rt
        .block_on(snapshot_metadata::changed(
            &service,
            "not-a-token",
            of,
            quick,
        ))
        .unwrap_err();
    assert!(
        matches!(e, MetadataError::Refused { .. }) && e.to_string().contains("Unauthenticated"),
        "{e}"
    );
    let e = rt
        .block_on(snapshot_metadata::service(
            rt.block_on(cluster.client()),
            "other.csi.example.com",
        ))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("other.csi.example.com has no usable SnapshotMetadataService"),
        "{e}"
    );

    drop(dev);
    drop(stack);
    // Nothing of the driver's is left attached.
    let loops = std::process::Command::new("losetup")
        .args(["--list", "--noheadings", "--output", "BACK-FILE"])
        .output()
        .unwrap();
    let loops = String::from_utf8_lossy(&loops.stdout);
    assert!(
        !loops.contains(tmp.path().to_str().unwrap()),
        "loop devices left attached: {loops}"
    );
}
