//! The end-to-end scenarios on real nodes: two clusters started by
//! `deploy/test-cluster/cluster.sh` (kubelet, containerd + runc, kube-proxy, the
//! scheduler; a network and mount namespace per node), mover installed exactly as the
//! README says (`kubectl apply --server-side -k deploy/base` with the image
//! `deploy/image/build.sh` made). Nothing here writes a pod's status, binds a pod, calls
//! a CSI method or patches a VolumeAttachment: the kubelet, the scheduler and the agents'
//! pods do. The test stands in for the workload only where it writes a volume's bytes
//! from the host (the node's /mnt/disks is a directory the host sees), and says so.
//!
//! Needs root, the binaries of `deploy/test-cluster/build.sh`, the images of
//! `deploy/test-cluster/images.sh` and `MOVER_IMAGE` (`.ci/run` provides all).
#![cfg(feature = "controller")]

mod common;

use common::{MIB, blake3_of, make_image, nodes::RealCluster, scribble_pages};
use serde_json::Value;
use std::time::Duration;

/// One test at a time: the clusters' addresses are fixed per index.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

const VOLUME_LEN: u64 = 64 * MIB;
const WAIT: Duration = Duration::from_secs(120);

/// A cluster with mover installed, an `app` namespace and the PVC `app/data` on a local
/// PV of node `on`: `/mnt/disks/data.img` there, a Block volume as a local disk's
/// partition would be.
struct Site {
    c: RealCluster,
    on: u8,
}

impl Site {
    fn start(name: &str, index: u8) -> Option<Site> {
        let c = RealCluster::start(name, index, 2)?;
        c.install(&format!("replication-token-of-{name}"));
        Some(Site { c, on: 1 })
    }

    fn image(&self) -> std::path::PathBuf {
        self.c.disks(self.on).join("data.img")
    }

    fn volume(&self, seed: u64) {
        let extents: &[(u64, u64)] = if seed == 0 {
            &[]
        } else {
            &[(0, 4 * MIB), (20 * MIB, 2 * MIB), (60 * MIB, MIB)]
        };
        make_image(&self.image(), VOLUME_LEN, seed, extents);
        self.c.kubectl_ok(&["create", "namespace", "app"]);
        self.c.apply(&format!(
            r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: local
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: Immediate
---
apiVersion: v1
kind: PersistentVolume
metadata:
  name: pv-data
spec:
  capacity:
    storage: 64Mi
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  persistentVolumeReclaimPolicy: Retain
  local:
    path: /mnt/disks/data.img
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - key: kubernetes.io/hostname
          operator: In
          values: [{node}]
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: data
  namespace: app
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  resources:
    requests:
      storage: 64Mi
"#,
            node = self.c.node(self.on)
        ));
        self.c.wait("the PVC Bound", WAIT, || {
            self.c.get(&["pvc/data", "-n", "app"], "{.status.phase}") == "Bound"
        });
    }

    /// README step 5: the Locator as a NodePort; its port.
    fn expose_locator(&self) -> String {
        self.c.kubectl_ok(&[
            "-n",
            "mover-system",
            "patch",
            "svc",
            "mover-locator",
            "-p",
            r#"{"spec":{"type":"NodePort"}}"#,
        ]);
        self.c.get(
            &["svc/mover-locator", "-n", "mover-system"],
            "{.spec.ports[0].nodePort}",
        )
    }

    /// README step 7: the class replicating to `peer`, its secret holding what the
    /// administrator copies from the peer (its replication token and mover CA, read
    /// there with the commands of deploy/examples/class-peer-cluster.yaml).
    fn class_to(&self, peer: &Site, peer_locator_port: &str) {
        let read = |secret: &str, key: &str| {
            peer.c.kubectl_ok(&[
                "-n",
                "mover-system",
                "get",
                "secret",
                secret,
                "-o",
                &format!("go-template={{{{index .data \"{key}\" | base64decode}}}}"),
            ])
        };
        let token = read("mover-replication-token", "token");
        let ca = read("mover-ca", "ca.crt");
        self.c.kubectl_ok(&[
            "-n",
            "mover-system",
            "create",
            "secret",
            "generic",
            "mover-dr-peer",
            &format!("--from-literal=token={token}"),
            &format!("--from-literal=ca.crt={ca}"),
        ]);
        self.c.apply(&format!(
            r#"apiVersion: replication.mover/v1alpha1
kind: VolumeReplicationClass
metadata:
  name: mover-dr
spec:
  provisioner: kubernetes.io/no-provisioner
  parameters:
    schedulingInterval: 2s
    target: cluster://{ip}:{peer_locator_port}
    replication.storage.openshift.io/replication-secret-name: mover-dr-peer
    replication.storage.openshift.io/replication-secret-namespace: mover-system
"#,
            ip = peer.c.node_ip(2)
        ));
    }

    fn set_state(&self, state: &str) {
        self.c.apply(&format!(
            "apiVersion: replication.mover/v1alpha1\nkind: VolumeReplication\nmetadata:\n  name: data\n  namespace: app\nspec:\n  volumeReplicationClass: mover-dr\n  replicationState: {state}\n  dataSource:\n    kind: PersistentVolumeClaim\n    name: data\n"
        ));
    }

    fn vr(&self) -> Value {
        let out = self
            .c
            .kubectl(&["get", "vr", "data", "-n", "app", "-o", "json"]);
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }

    /// Condition `ty`'s (status, reason).
    fn condition(&self, ty: &str) -> (String, String) {
        let vr = self.vr();
        let c = vr["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == ty).cloned())
            .unwrap_or(Value::Null);
        (
            c["status"].as_str().unwrap_or_default().into(),
            c["reason"].as_str().unwrap_or_default().into(),
        )
    }

    fn completed(&self, reason: &str) -> bool {
        self.condition("Completed") == ("True".into(), reason.into())
    }

    fn wait_vr(&self, what: &str, check: impl Fn(&Site) -> bool) {
        self.c.wait(what, WAIT, || check(self));
    }
}

/// Waits until `b`'s image equals `a`'s as it is now.
fn in_sync(a: &Site, b: &Site, what: &str) {
    let want = blake3_of(&a.image(), VOLUME_LEN);
    b.c.wait(what, WAIT, || blake3_of(&b.image(), VOLUME_LEN) == want);
}

#[test]
fn on_real_nodes_two_clusters_install_replicate_fail_over_and_back() {
    let _one = serial();
    let Some(east) = Site::start("east", 1) else {
        return;
    };
    let Some(mut west) = Site::start("west", 2) else {
        return;
    };
    west.on = 2;

    // What the install did by itself on real nodes: each registrar registered the CSI
    // plugin with its kubelet, each agent got its certificate through the CSR API with
    // the token its kubelet projected (the controller checks the node it names).
    for s in [&east, &west] {
        for n in 1..=2 {
            let node = s.c.node(n);
            s.c.wait(
                &format!("{node}'s kubelet registering the CSI plugin"),
                WAIT,
                || {
                    s.c.get(&["csinode", &node], "{.spec.drivers[*].name}")
                        == "csi.replication.mover"
                },
            );
        }
        let csrs = s.c.kubectl_ok(&["get", "csr", "-o", "json"]);
        let csrs: Value = serde_json::from_str(&csrs).unwrap();
        let issued: Vec<_> = csrs["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["spec"]["signerName"] == "replication.mover/agent")
            .filter(|c| c["status"]["certificate"].is_string())
            .map(|c| {
                assert_eq!(
                    c["spec"]["username"],
                    "system:serviceaccount:mover-system:mover-agent"
                );
                c["spec"]["extra"]["authentication.kubernetes.io/node-name"][0]
                    .as_str()
                    .unwrap()
                    .to_string()
            })
            .collect();
        for n in 1..=2 {
            assert!(
                issued.contains(&s.c.node(n)),
                "no certificate issued to {}'s agent: {issued:?}",
                s.c.node(n)
            );
        }
    }

    east.volume(7);
    west.volume(0);
    let east_locator = east.expose_locator();
    let west_locator = west.expose_locator();
    east.class_to(&west, &west_locator);
    west.class_to(&east, &east_locator);

    // RamenDR's order: the secondary first, then the primary.
    west.set_state("secondary");
    west.wait_vr("the secondary VR Secondary", |s| {
        s.vr()["status"]["state"] == "Secondary"
    });
    east.set_state("primary");
    east.wait_vr("the primary Promoted with a lastSyncTime", |s| {
        s.completed("Promoted") && s.vr()["status"]["lastSyncTime"].is_string()
    });
    // An image file on XFS with no writer holding it: each cycle is a reflink clone of
    // one instant.
    assert_eq!(
        east.condition("PointInTime").0,
        "True",
        "{}",
        east.vr()["status"]
    );
    in_sync(&east, &west, "the first cycle on the replica");
    a_pod_reads_one_cycle_of_the_replica_while_replication_goes_on(&east, &west);

    // Planned failover: a final cycle ships what was written, then the roles swap.
    scribble_pages(&east.image(), 4, 20, 0..VOLUME_LEN);
    let want = blake3_of(&east.image(), VOLUME_LEN);
    east.set_state("secondary");
    east.wait_vr("east demoted", |s| s.completed("Demoted"));
    west.set_state("primary");
    west.wait_vr("west promoted", |s| s.completed("Promoted"));
    assert_eq!(
        blake3_of(&west.image(), VOLUME_LEN),
        want,
        "the final cycle arrived"
    );
    assert_eq!(
        west.vr()["status"]["epoch"],
        2,
        "the promotion raised the epoch"
    );

    // Failback: west's writes reach east, then the roles swap back.
    scribble_pages(&west.image(), 5, 25, 0..VOLUME_LEN);
    in_sync(&west, &east, "west's writes on east");
    west.set_state("secondary");
    west.wait_vr("west demoted", |s| s.completed("Demoted"));
    east.set_state("primary");
    east.wait_vr("east promoted again", |s| s.completed("Promoted"));
    assert_eq!(
        blake3_of(&east.image(), VOLUME_LEN),
        blake3_of(&west.image(), VOLUME_LEN)
    );
    readme_step_8_the_operators_view(&east);
}

/// README install step 8: `kubectl get vr` shows the state, the last sync and the RPO;
/// an operator's certificate from `mover controller operator-cert` opens the agent's
/// own view (the default install has no control token: the certificate is the one
/// factor).
fn readme_step_8_the_operators_view(s: &Site) {
    let columns = s.c.kubectl_ok(&["get", "vr", "-A"]);
    let header = columns.lines().next().unwrap_or_default();
    assert!(
        header.contains("STATE") && header.contains("LAST SYNC") && header.contains("RPO"),
        "{columns}"
    );
    assert!(columns.contains("Primary"), "{columns}");
    let minted = s.c.dir.join("operator");
    let mover = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(args)
            .env("KUBECONFIG", &s.c.kubeconfig)
            .env_remove("MOVER_TOKEN")
            .output()
            .unwrap()
    };
    let out = mover(&[
        "controller",
        "operator-cert",
        "--out",
        minted.to_str().unwrap(),
        "--valid",
        "10m",
    ]);
    assert!(out.status.success(), "operator-cert: {out:?}");
    let file = |f: &str| minted.join(f).display().to_string();
    let url = format!("agent://{}@{}:7070", s.c.node(s.on), s.c.node_ip(s.on));
    let out = mover(&[
        "replicate", "status", "app/data", "--json", "--agent", &url, "--tls-ca",
        &file("ca.crt"), "--tls-cert", &file("tls.crt"), "--tls-key", &file("tls.key"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("\"role\""),
        "the agent's view with an operator's certificate: {out:?}"
    );
}

/// sha256 of the first `len` bytes of `path`, as busybox's sha256sum prints it.
fn sha256_of(path: &std::path::Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// On the DR side, a PVC populated from the replica, used by a real pod the scheduler
/// places and the kubelet runs: the kubelet stages and publishes it through the
/// registered CSI plugin (the agent's pod), and the pod reads the cycle the fill began
/// at while the next cycles land on the replica.
fn a_pod_reads_one_cycle_of_the_replica_while_replication_goes_on(east: &Site, west: &Site) {
    let held = sha256_of(&west.image());
    // 256 KiB/s: the fill is far from done when the next cycle lands; the pod's reads
    // fetch what they need at once.
    west.c.apply(
        r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: mover-populated
provisioner: csi.replication.mover
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: replication.mover/v1alpha1
kind: HydrationSource
metadata:
  name: replica-copy
  namespace: app
spec:
  volumeReplication: data
  bwlimit: 256K
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: replica-copy
  namespace: app
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: mover-populated
  resources:
    requests:
      storage: 64Mi
  dataSourceRef:
    apiGroup: replication.mover
    kind: HydrationSource
    name: replica-copy
"#,
    );
    // The pod waits for a word from the test (through `kubectl exec`, which the API
    // server passes to its kubelet) before it reads.
    west.c.apply(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: reader
  namespace: app
spec:
  restartPolicy: Never
  containers:
  - name: reader
    image: localhost/busybox:1
    command: [sh, -c, "until [ -e /tmp/go ]; do sleep 0.2; done; sha256sum /dev/replica"]
    volumeDevices: [{name: replica, devicePath: /dev/replica}]
  volumes:
  - name: replica
    persistentVolumeClaim: {claimName: replica-copy}
"#,
    );
    west.c
        .wait("the reader pod Running on its populated PVC", WAIT, || {
            west.c.get(&["pod/reader", "-n", "app"], "{.status.phase}") == "Running"
        });
    // The workload's writes (made from the host into the node's disk) go on.
    let first_sync = east.vr()["status"]["lastSyncTime"].clone();
    scribble_pages(&east.image(), 3, 30, 0..VOLUME_LEN);
    east.wait_vr("lastSyncTime to advance", |s| {
        s.vr()["status"]["lastSyncTime"] != first_sync
    });
    in_sync(east, west, "the writes on the replica");
    assert_ne!(sha256_of(&west.image()), held);
    west.c
        .kubectl_ok(&["exec", "-n", "app", "reader", "--", "touch", "/tmp/go"]);
    west.c.wait("the reader pod Succeeded", WAIT, || {
        west.c.get(&["pod/reader", "-n", "app"], "{.status.phase}") == "Succeeded"
    });
    let read = west.c.kubectl_ok(&["logs", "-n", "app", "reader"]);
    assert_eq!(
        read.split_whitespace().next().unwrap_or_default(),
        held,
        "the pod reads the cycle its fill began at, none of the next"
    );
    west.c
        .kubectl_ok(&["delete", "pod", "reader", "-n", "app", "--wait"]);
}

/// A local PV of node 1 of `c`: the directory `/mnt/disks/DIR`, a file system.
fn local_fs_pv(c: &RealCluster, dir: &str, claim: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: PersistentVolume
metadata:
  name: pv-{dir}
spec:
  capacity:
    storage: 1Gi
  accessModes: [ReadWriteOnce]
  volumeMode: Filesystem
  storageClassName: local
  persistentVolumeReclaimPolicy: Retain
  claimRef: {{namespace: app, name: {claim}}}
  local:
    path: /mnt/disks/{dir}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - key: kubernetes.io/hostname
          operator: In
          values: [{node}]
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {claim}
  namespace: app
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: local
  resources:
    requests:
      storage: 1Gi
"#,
        node = c.node(1)
    )
}

#[test]
fn on_real_nodes_the_copy_job_of_the_examples_runs_from_the_image() {
    let _one = serial();
    let Some(c) = RealCluster::start("jobs", 3, 1) else {
        return;
    };
    c.install("replication-token-of-jobs");
    // A real tree (the host's /usr/include) and one with every kind of entry and
    // metadata mover keeps (hard links, xattrs, ACLs, odd names).
    let disks = c.disks(1);
    let src = disks.join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(disks.join("dst")).unwrap();
    let cp = std::process::Command::new("cp")
        .args(["-a", "/usr/include"])
        .arg(src.join("include"))
        .status()
        .unwrap();
    assert!(cp.success());
    common::tree::make_tree(&src.join("made"), 11);
    c.kubectl_ok(&["create", "namespace", "app"]);
    c.apply(&format!(
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: local\nprovisioner: kubernetes.io/no-provisioner\nvolumeBindingMode: WaitForFirstConsumer\n---\n{}---\n{}",
        local_fs_pv(&c, "src", "data"),
        local_fs_pv(&c, "dst", "data-copy")
    ));
    // The Job as the examples render it (README: "apply the one you want").
    let rendered = c.kubectl_ok(&[
        "kustomize",
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/examples/jobs")
            .to_str()
            .unwrap(),
    ]);
    let job = rendered
        .split("\n---\n")
        .find(|d| d.contains("name: mover-copy-pvc-to-pvc"))
        .expect("the copy Job in deploy/examples/jobs");
    let out = common::cluster::run_kubectl(
        &c.bin,
        &c.kubeconfig,
        &["apply", "-n", "app", "-f", "-"],
        Some(job),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    c.wait("the copy Job complete", Duration::from_secs(300), || {
        let failed = c.get(
            &["job/mover-copy-pvc-to-pvc", "-n", "app"],
            "{.status.failed}",
        );
        assert!(
            failed.is_empty() || failed == "0",
            "the Job's pod failed:\n{}",
            c.kubectl_ok(&["logs", "-n", "app", "job/mover-copy-pvc-to-pvc"])
        );
        c.get(
            &["job/mover-copy-pvc-to-pvc", "-n", "app"],
            "{.status.succeeded}",
        ) == "1"
    });
    common::tree::assert_same_tree(&src, &disks.join("dst"));
    let log = c.kubectl_ok(&["logs", "-n", "app", "job/mover-copy-pvc-to-pvc"]);
    assert!(!log.trim().is_empty(), "the Job's pod says what it did");
}
