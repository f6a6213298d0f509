//! The CSI stack of issue 39 on a [`Cluster`]: the hostpath CSI driver with its
//! SnapshotMetadata service, and the real Kubernetes sidecars and controller around it
//! (csi-provisioner, csi-snapshotter, snapshot-controller, csi-snapshot-metadata), all
//! built from their Go modules by `deploy/test-cluster/build.sh` and run as processes
//! here, on 127.0.0.1 and unix sockets, killed on drop.
//!
//! No kubelet runs: [`CsiStack::emulate_kubelet_publish`] makes the driver's own Node
//! calls (NodeStageVolume, NodePublishVolume) on its socket, as a kubelet would for a
//! block volume, through `grpcurl` and the CSI spec's `csi.proto` (both from build.sh:
//! the spec's Go module ships the proto, and grpcurl needs no code generated here).
//!
//! Every sidecar uses the cluster's admin kubeconfig (system:masters). That is a test's
//! shortcut: in a cluster each runs as its own ServiceAccount with the ClusterRoles its
//! repository ships (for csi-snapshot-metadata: TokenReviews and SubjectAccessReviews
//! create, get/list on VolumeSnapshots and VolumeSnapshotContents, SnapshotMetadataServices).

use super::MIB;
use super::agent::free_port;
use super::cluster::Cluster;
use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::{Shutdown, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Output, Stdio},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering::SeqCst},
    },
    time::{Duration, Instant},
};

/// The hostpath driver's name (its `-drivername` default): the StorageClass's
/// provisioner, the VolumeSnapshotClass's driver and the SnapshotMetadataService's name.
pub const DRIVER: &str = "hostpath.csi.k8s.io";
/// The StorageClass [`CsiStack::start`] creates (Immediate binding, reclaim Delete).
pub const STORAGE_CLASS: &str = "csi-hostpath";
/// The VolumeSnapshotClass [`CsiStack::start`] creates (deletionPolicy Delete).
pub const SNAPSHOT_CLASS: &str = "csi-hostpath-snapclass";
/// The block size of the hostpath driver's snapshot metadata (`state.BlockSizeBytes`),
/// in FIXED_LENGTH blocks unless `-snapshot-metadata-block-type=VARIABLE_LENGTH`.
pub const HOSTPATH_BLOCK: u64 = 4096;

const PROGRAMS: [&str; 6] = [
    "hostpathplugin",
    "csi-provisioner",
    "csi-snapshotter",
    "snapshot-controller",
    "csi-snapshot-metadata",
    "grpcurl",
];

const CRDS: [&str; 4] = [
    "snapshot.storage.k8s.io_volumesnapshotclasses.yaml",
    "snapshot.storage.k8s.io_volumesnapshotcontents.yaml",
    "snapshot.storage.k8s.io_volumesnapshots.yaml",
    "cbt.storage.k8s.io_snapshotmetadataservices.yaml",
];

/// Whether `bin` (the cluster's binaries) also holds the CSI stack, and this process may
/// run it (root: the driver attaches loop devices and bind-mounts them). `false` after
/// [`super::skip_unless_ci`] otherwise, so under `CI=true` a missing piece fails.
pub fn available(bin: &Path) -> bool {
    let mut missing: Vec<String> = PROGRAMS
        .iter()
        .filter(|p| !bin.join(p).is_file())
        .map(|p| p.to_string())
        .collect();
    missing.extend(
        CRDS.iter()
            .map(|c| format!("crds/{c}"))
            .chain(["proto/csi.proto".to_string()])
            .filter(|f| !bin.join(f).is_file()),
    );
    if !missing.is_empty() {
        super::skip_unless_ci(&format!(
            "{} not in {}: build them with deploy/test-cluster/build.sh",
            missing.join(", "),
            bin.display()
        ));
        return false;
    }
    if !rustix::process::geteuid().is_root() {
        super::skip_unless_ci("the hostpath CSI driver needs root (loop devices, bind mounts)");
        return false;
    }
    true
}

/// A volume [`CsiStack::emulate_kubelet_publish`] staged and published, undone on drop.
struct Published {
    volume: String,
    staging: PathBuf,
    target: PathBuf,
}

/// The driver and its sidecars against one cluster; processes killed on drop, their logs
/// in `dir/<program>.log`.
pub struct CsiStack {
    /// Sockets, the driver's state, logs, the sidecar's certificate.
    pub dir: PathBuf,
    /// The node id the driver reports (`-nodeid`).
    pub node: String,
    /// The driver's CSI endpoint (a unix socket).
    pub socket: PathBuf,
    /// The driver's state directory: its volumes and snapshots are files here.
    pub state: PathBuf,
    /// The csi-snapshot-metadata sidecar's gRPC port. It listens on `:PORT`, every
    /// address (v1.1.0 has no flag to narrow it); the SnapshotMetadataService and the
    /// tests name 127.0.0.1.
    pub metadata_port: u16,
    /// The CA (here the self-signed certificate itself) a client of the sidecar trusts:
    /// the SnapshotMetadataService's `spec.caCert`.
    pub metadata_ca: PathBuf,
    /// The SnapshotMetadataService's `spec.audience`: the audience the sidecar asks
    /// TokenReview to find in a caller's token.
    pub audience: String,
    bin: PathBuf,
    kubeconfig: PathBuf,
    procs: Vec<(String, Child)>,
    published: Mutex<Vec<Published>>,
}

impl CsiStack {
    /// Applies the CRDs, starts the driver and the sidecars in `dir/csi` for node `node`,
    /// and creates the StorageClass, the VolumeSnapshotClass and the
    /// SnapshotMetadataService. `None` when [`available`] says no.
    pub fn start(cluster: &Cluster, dir: &Path, node: &str) -> Option<CsiStack> {
        if !available(&cluster.bin) {
            return None;
        }
        let dir = dir.join("csi");
        let state = dir.join("state");
        std::fs::create_dir_all(&state).unwrap();
        let socket = dir.join("csi.sock");
        assert!(
            socket.as_os_str().len() < 100,
            "unix socket path too long: {}",
            socket.display()
        );
        let mut stack = CsiStack {
            node: node.into(),
            socket,
            state,
            metadata_port: free_port(),
            metadata_ca: dir.join("snapshot-metadata.crt"),
            audience: "mover-snapshot-metadata".into(),
            bin: cluster.bin.clone(),
            kubeconfig: cluster.kubeconfig.clone(),
            procs: Vec::new(),
            published: Mutex::new(Vec::new()),
            dir,
        };
        stack.apply_crds(cluster);
        stack.start_driver();
        stack.start_sidecars();
        stack.create_classes(cluster);
        Some(stack)
    }

    fn apply_crds(&self, cluster: &Cluster) {
        let crds = self.bin.join("crds");
        for crd in CRDS {
            let path = crds.join(crd);
            cluster.kubectl_ok(&[
                "apply",
                "--server-side",
                "--force-conflicts",
                "-f",
                path.to_str().unwrap(),
            ]);
        }
        cluster.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/volumesnapshotclasses.snapshot.storage.k8s.io",
            "crd/volumesnapshotcontents.snapshot.storage.k8s.io",
            "crd/volumesnapshots.snapshot.storage.k8s.io",
            "crd/snapshotmetadataservices.cbt.storage.k8s.io",
        ]);
    }

    fn spawn(&mut self, program: &str, args: &[String]) {
        let log = std::fs::File::create(self.dir.join(format!("{program}.log"))).unwrap();
        let child = Command::new(self.bin.join(program))
            .args(args)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
        self.procs.push((program.into(), child));
    }

    fn start_driver(&mut self) {
        let args = vec![
            format!("--endpoint=unix://{}", self.socket.display()),
            format!("--drivername={DRIVER}"),
            format!("--nodeid={}", self.node),
            format!("--statedir={}", self.state.display()),
            // The CSI SnapshotMetadata service (GetMetadataAllocated/GetMetadataDelta)
            // on the same socket; FIXED_LENGTH blocks of 4 KiB by default.
            "--enable-snapshot-metadata".into(),
            // With topology the provisioner wants a CSINode per node, which only a
            // kubelet registers.
            "--enable-topology=false".into(),
            "--v=4".into(),
        ];
        self.spawn("hostpathplugin", &args);
        self.wait_for("hostpathplugin's socket", Duration::from_secs(30), |s| {
            s.socket.exists()
        });
    }

    fn start_sidecars(&mut self) {
        let csi = format!("--csi-address={}", self.socket.display());
        let kubeconfig = format!("--kubeconfig={}", self.kubeconfig.display());
        let common = [csi.clone(), kubeconfig.clone(), "--v=4".to_string()];
        let with = |extra: &[&str]| -> Vec<String> {
            common
                .iter()
                .cloned()
                .chain(extra.iter().map(|s| s.to_string()))
                .collect()
        };
        self.spawn("csi-provisioner", &with(&["--leader-election=false"]));
        self.spawn("csi-snapshotter", &with(&["--leader-election=false"]));
        self.spawn(
            "snapshot-controller",
            &[kubeconfig, "--leader-election=false".into(), "--v=4".into()],
        );
        let (cert, key) = self.write_metadata_certificate();
        let port = self.metadata_port;
        self.spawn(
            "csi-snapshot-metadata",
            &with(&[
                &format!("--port={port}"),
                &format!("--tls-cert={}", cert.display()),
                &format!("--tls-key={}", key.display()),
                // Its default, :8080, is anyone's; nothing scrapes it here.
                &format!("--http-endpoint=127.0.0.1:{}", free_port()),
            ]),
        );
        self.wait_for(
            "csi-snapshot-metadata's gRPC port",
            Duration::from_secs(60),
            |s| std::net::TcpStream::connect(("127.0.0.1", s.metadata_port)).is_ok(),
        );
    }

    /// A self-signed serving certificate for 127.0.0.1 (rcgen), as PEM files; the
    /// certificate doubles as the CA clients trust.
    fn write_metadata_certificate(&self) -> (PathBuf, PathBuf) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut params =
            rcgen::CertificateParams::new(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "csi-snapshot-metadata");
        let cert = params.self_signed(&key).unwrap();
        let key_path = self.dir.join("snapshot-metadata.key");
        std::fs::write(&self.metadata_ca, cert.pem()).unwrap();
        std::fs::write(&key_path, key.serialize_pem()).unwrap();
        (self.metadata_ca.clone(), key_path)
    }

    fn create_classes(&self, cluster: &Cluster) {
        // The SnapshotMetadataService's caCert: standard base64 with padding.
        let ca = {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD
                .encode(std::fs::read(&self.metadata_ca).unwrap())
        };
        cluster.apply(&format!(
            "apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: {STORAGE_CLASS}
provisioner: {DRIVER}
volumeBindingMode: Immediate
reclaimPolicy: Delete
---
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshotClass
metadata:
  name: {SNAPSHOT_CLASS}
driver: {DRIVER}
deletionPolicy: Delete
---
apiVersion: cbt.storage.k8s.io/v1beta1
kind: SnapshotMetadataService
metadata:
  name: {DRIVER}
spec:
  address: 127.0.0.1:{port}
  caCert: {ca}
  audience: {audience}
",
            port = self.metadata_port,
            audience = self.audience,
        ));
    }

    fn wait_for(&self, what: &str, within: Duration, ready: impl Fn(&CsiStack) -> bool) {
        let deadline = Instant::now() + within;
        while !ready(self) {
            if Instant::now() > deadline {
                panic!(
                    "CSI stack: {what} not ready within {within:?}\n{}",
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The last lines of every component's log, for a failure message.
    pub fn logs(&self) -> String {
        super::cluster::log_tails(&self.dir, PROGRAMS.into_iter().filter(|p| *p != "grpcurl"))
    }

    fn kubectl(&self, args: &[&str], stdin: Option<&str>) -> Output {
        super::cluster::run_kubectl(&self.bin, &self.kubeconfig, args, stdin)
    }

    fn kubectl_ok(&self, args: &[&str], stdin: Option<&str>) -> String {
        let out = self.kubectl(args, stdin);
        assert!(
            out.status.success(),
            "kubectl {} failed: {}{}\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout),
            self.logs()
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// A `jsonpath` of `kind/name` in `ns`, empty while it is not set.
    fn jsonpath(&self, ns: &str, object: &str, path: &str) -> String {
        let out = self.kubectl(
            &["get", object, "-n", ns, &format!("-o=jsonpath={{{path}}}")],
            None,
        );
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn wait_jsonpath(&self, ns: &str, object: &str, path: &str, want: Option<&str>) -> String {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let got = self.jsonpath(ns, object, path);
            if want.map_or(!got.is_empty(), |w| got == w) {
                return got;
            }
            if Instant::now() > deadline {
                let yaml = self.kubectl(&["get", object, "-n", ns, "-o=yaml"], None);
                panic!(
                    "{ns}/{object}: {path} is {got:?}, not {want:?}, after 120 s\n{}\n{}",
                    String::from_utf8_lossy(&yaml.stdout),
                    self.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// Creates a PVC of `size` bytes with `volumeMode: Block` in the stack's StorageClass,
    /// waits until it is Bound (csi-provisioner's CreateVolume, the controller manager's
    /// binding) and returns its PV's CSI volume handle.
    pub fn create_block_pvc(&self, ns: &str, name: &str, size: u64) -> String {
        self.kubectl_ok(
            &["apply", "--server-side", "-f", "-"],
            Some(&format!(
                "apiVersion: v1
kind: PersistentVolumeClaim
metadata:
  name: {name}
  namespace: {ns}
spec:
  storageClassName: {STORAGE_CLASS}
  volumeMode: Block
  accessModes: [ReadWriteOnce]
  resources:
    requests:
      storage: \"{size}\"
"
            )),
        );
        let pvc = format!("pvc/{name}");
        self.wait_jsonpath(ns, &pvc, ".status.phase", Some("Bound"));
        let pv = self.jsonpath(ns, &pvc, ".spec.volumeName");
        self.wait_jsonpath(ns, &format!("pv/{pv}"), ".spec.csi.volumeHandle", None)
    }

    /// Creates VolumeSnapshot `ns/name` of PVC `pvc` in the stack's VolumeSnapshotClass,
    /// waits until it is readyToUse and returns its CSI snapshot handle (the bound
    /// VolumeSnapshotContent's `status.snapshotHandle`).
    pub fn snapshot(&self, ns: &str, pvc: &str, name: &str) -> String {
        self.kubectl_ok(
            &["apply", "--server-side", "-f", "-"],
            Some(&format!(
                "apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata:
  name: {name}
  namespace: {ns}
spec:
  volumeSnapshotClassName: {SNAPSHOT_CLASS}
  source:
    persistentVolumeClaimName: {pvc}
"
            )),
        );
        let vs = format!("volumesnapshot/{name}");
        self.wait_jsonpath(ns, &vs, ".status.readyToUse", Some("true"));
        let content = self.jsonpath(ns, &vs, ".status.boundVolumeSnapshotContentName");
        self.wait_jsonpath(
            ns,
            &format!("volumesnapshotcontent/{content}"),
            ".status.snapshotHandle",
            None,
        )
    }

    /// Runs grpcurl with `args`, the request `json` on its standard input (`-d @`).
    pub fn grpcurl(&self, args: &[&str], json: &str) -> Output {
        grpcurl(&self.bin, args, json)
    }

    /// One call of the driver's CSI service `method` (e.g. `csi.v1.Node/NodeStageVolume`)
    /// on its socket, as grpcurl ran it.
    fn csi_output(&self, method: &str, request: &serde_json::Value) -> Output {
        csi_output(&self.bin, &self.socket, method, request)
    }

    /// One call of the driver's CSI service `method`; its answer, or a panic if it fails.
    pub fn csi_call(&self, method: &str, request: &serde_json::Value) -> serde_json::Value {
        let out = self.csi_output(method, request);
        assert!(
            out.status.success(),
            "{method} failed: {}{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout),
            self.logs()
        );
        serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null)
    }

    /// What a kubelet does for a block volume on this node, with the driver's own Node
    /// calls: NodeStageVolume (staging path under `dir/staging`), then NodePublishVolume
    /// at `target_path`, which the driver makes a bind mount of the volume's loop device.
    /// Returns that device (`/dev/loopN`), found from the published file's device number.
    /// Unpublished and unstaged on drop.
    pub fn emulate_kubelet_publish(&self, volume_handle: &str, target_path: &Path) -> PathBuf {
        let staging = self.dir.join("staging").join(volume_handle);
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::create_dir_all(target_path.parent().unwrap()).unwrap();
        let capability = serde_json::json!({
            "block": {},
            "accessMode": {"mode": "SINGLE_NODE_WRITER"},
        });
        self.csi_call(
            "csi.v1.Node/NodeStageVolume",
            &serde_json::json!({
                "volumeId": volume_handle,
                "stagingTargetPath": staging,
                "volumeCapability": capability,
            }),
        );
        self.csi_call(
            "csi.v1.Node/NodePublishVolume",
            &serde_json::json!({
                "volumeId": volume_handle,
                "stagingTargetPath": staging,
                "targetPath": target_path,
                "volumeCapability": capability,
            }),
        );
        self.published.lock().unwrap().push(Published {
            volume: volume_handle.into(),
            staging,
            target: target_path.into(),
        });
        device_of(target_path)
    }

    /// What a kubelet does when the pod using a volume published at `target_path` is
    /// gone: NodeUnpublishVolume and NodeUnstageVolume (failures ignored, as on drop).
    pub fn emulate_kubelet_unpublish(&self, target_path: &Path) {
        let mut published = self.published.lock().unwrap();
        let (gone, kept) = std::mem::take(&mut *published)
            .into_iter()
            .partition(|p| p.target == target_path);
        *published = kept;
        drop(published);
        self.unpublish(gone);
    }

    /// NodeUnpublishVolume and NodeUnstageVolume of what was published, newest first;
    /// failures are ignored (drop).
    fn unpublish_all(&self) {
        let published = std::mem::take(&mut *self.published.lock().unwrap());
        self.unpublish(published);
    }

    fn unpublish(&self, published: Vec<Published>) {
        let call = |method: &str, request: serde_json::Value| {
            let _ = self.csi_output(method, &request);
        };
        for p in published.iter().rev() {
            call(
                "csi.v1.Node/NodeUnpublishVolume",
                serde_json::json!({"volumeId": p.volume, "targetPath": p.target}),
            );
            call(
                "csi.v1.Node/NodeUnstageVolume",
                serde_json::json!({"volumeId": p.volume, "stagingTargetPath": p.staging}),
            );
            // Whatever the driver left mounted.
            let _ = Command::new("umount").arg(&p.target).output();
        }
    }
}

/// The block device whose node `path` is (a bind mount of it counts): `/dev/<name>` from
/// its device number's entry in /sys/dev/block.
fn device_of(path: &Path) -> PathBuf {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(path).unwrap();
    assert!(
        meta.file_type().is_block_device(),
        "{} is not a block device after NodePublishVolume",
        path.display()
    );
    let rdev = meta.rdev();
    let (major, minor) = (rustix::fs::major(rdev), rustix::fs::minor(rdev));
    let uevent = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/uevent")).unwrap();
    let name = uevent
        .lines()
        .find_map(|l| l.strip_prefix("DEVNAME="))
        .unwrap_or_else(|| panic!("no DEVNAME for block device {major}:{minor}"));
    PathBuf::from("/dev").join(name)
}

impl Drop for CsiStack {
    fn drop(&mut self) {
        self.unpublish_all();
        // Sidecars first, the driver (the first started) last.
        for (_, p) in self.procs.iter_mut().rev() {
            let _ = p.kill();
            let _ = p.wait();
        }
        // The driver attaches a loop device to each block volume's file and detaches it
        // only on DeleteVolume: detach those of its state directory.
        let out = Command::new("losetup")
            .args(["--list", "--noheadings", "--output", "NAME,BACK-FILE"])
            .output();
        if let Ok(out) = out {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let mut cols = line.split_whitespace();
                if let (Some(dev), Some(file)) = (cols.next(), cols.next())
                    && Path::new(file).starts_with(&self.state)
                {
                    let _ = Command::new("losetup").args(["-d", dev]).output();
                }
            }
        }
    }
}

/// Runs `bin`'s grpcurl with `args`, the request `json` on its standard input (`-d @`).
pub fn grpcurl(bin: &Path, args: &[&str], json: &str) -> Output {
    let mut child = Command::new(bin.join("grpcurl"))
        .args(["-d", "@"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("grpcurl");
    let mut input = child.stdin.take().unwrap();
    input.write_all(json.as_bytes()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

/// One call of CSI `method` (e.g. `csi.v1.Node/NodeStageVolume`) on the plugin socket
/// `socket`, through `bin`'s grpcurl and the spec's csi.proto.
pub fn csi_output(bin: &Path, socket: &Path, method: &str, request: &serde_json::Value) -> Output {
    let proto = bin.join("proto");
    grpcurl(
        bin,
        &[
            "-plaintext",
            "-unix",
            "-import-path",
            proto.to_str().unwrap(),
            "-proto",
            "csi.proto",
            socket.to_str().unwrap(),
            method,
        ],
        &request.to_string(),
    )
}

/// The standard output of a command that must succeed (`what` names it in the panic).
pub fn ok(out: Output, what: &str) -> String {
    assert!(
        out.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The kubelet's calls for one volume of one pod, made with the plugin's own Node RPCs
/// (no kubelet runs here); unpublished and unstaged on drop.
pub struct Kubelet<'a> {
    /// build.sh's binaries (grpcurl, proto/csi.proto).
    pub bin: &'a Path,
    /// The plugin's socket.
    pub socket: PathBuf,
    /// The volume id (a PV's volumeHandle).
    pub volume: String,
    /// The kubelet's staging path of the volume.
    pub staging: PathBuf,
    /// The pod's path of it.
    pub target: PathBuf,
    /// The volume capability (block or mount, and the access mode), as JSON.
    pub capability: serde_json::Value,
}

impl Kubelet<'_> {
    pub fn call(&self, method: &str, request: serde_json::Value) -> Output {
        csi_output(self.bin, &self.socket, method, &request)
    }

    /// NodeStageVolume, then NodePublishVolume; both must succeed.
    pub fn stage_and_publish(&self) {
        std::fs::create_dir_all(&self.staging).unwrap();
        ok(
            self.call(
                "csi.v1.Node/NodeStageVolume",
                serde_json::json!({
                    "volumeId": self.volume,
                    "stagingTargetPath": self.staging,
                    "volumeCapability": self.capability,
                }),
            ),
            "NodeStageVolume",
        );
        ok(
            self.call(
                "csi.v1.Node/NodePublishVolume",
                serde_json::json!({
                    "volumeId": self.volume,
                    "stagingTargetPath": self.staging,
                    "targetPath": self.target,
                    "volumeCapability": self.capability,
                }),
            ),
            "NodePublishVolume",
        );
    }

    /// NodeUnpublishVolume and NodeUnstageVolume, as grpcurl ran them.
    pub fn unpublish_and_unstage(&self) -> (Output, Output) {
        let a = self.call(
            "csi.v1.Node/NodeUnpublishVolume",
            serde_json::json!({"volumeId": self.volume, "targetPath": self.target}),
        );
        let b = self.call(
            "csi.v1.Node/NodeUnstageVolume",
            serde_json::json!({"volumeId": self.volume, "stagingTargetPath": self.staging}),
        );
        (a, b)
    }
}

impl Drop for Kubelet<'_> {
    fn drop(&mut self) {
        let _ = self.unpublish_and_unstage();
    }
}

/// A TCP proxy to 127.0.0.1:`to` that cuts connections once `after` bytes came back
/// from the server, until it has cut `cuts` of them: a stream cut part way, for real.
pub struct CuttingProxy {
    /// Where it listens.
    pub port: u16,
    /// Connections cut so far.
    pub cut: Arc<AtomicU32>,
}

impl CuttingProxy {
    /// Starts it on 127.0.0.1, in the background (its threads end with the process).
    pub fn start(to: u16, cuts: u32, after: usize) -> CuttingProxy {
        CuttingProxy::between("127.0.0.1", ("127.0.0.1".into(), to), cuts, after)
    }

    /// A proxy listening on `ip` (a free port) to the server at `to`.
    pub fn between(ip: &str, to: (String, u16), cuts: u32, after: usize) -> CuttingProxy {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let cut = Arc::new(AtomicU32::new(0));
        let counter = cut.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { return };
                let Ok(server) = TcpStream::connect((to.0.as_str(), to.1)) else {
                    continue;
                };
                let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut &c2, &mut &s2);
                });
                let counter = counter.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; 4096];
                    let mut sent = 0;
                    while let Ok(k) = (&server).read(&mut buf) {
                        if k == 0 || (&client).write_all(&buf[..k]).is_err() {
                            break;
                        }
                        sent += k;
                        if sent >= after
                            && counter
                                .fetch_update(SeqCst, SeqCst, |n| (n < cuts).then_some(n + 1))
                                .is_ok()
                        {
                            break;
                        }
                    }
                    let _ = client.shutdown(Shutdown::Both);
                    let _ = server.shutdown(Shutdown::Both);
                });
            }
        });
        CuttingProxy { port, cut }
    }
}

/// A source tree: files of several sizes and kinds, with their BLAKE3s by path.
pub fn source_tree(root: &Path) -> BTreeMap<String, String> {
    use rand::{RngCore, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(40);
    let mut files = BTreeMap::new();
    for (i, size) in [0u64, 1, 4095, 4096, 65_537, MIB + 7, 9 * MIB, 17 * MIB + 3]
        .into_iter()
        .enumerate()
    {
        let rel = format!("d{}/f{i}.bin", i % 3);
        let path = root.join(&rel);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        let mut data = vec![0u8; size as usize];
        rng.fill_bytes(&mut data);
        std::fs::write(&path, &data).unwrap();
        files.insert(rel, blake3::hash(&data).to_hex().to_string());
    }
    files
}

/// The BLAKE3 of every file under `root` (relative paths).
pub fn hashes_under(root: &Path, names: impl Iterator<Item = String>) -> BTreeMap<String, String> {
    names
        .map(|rel| {
            let data = std::fs::read(root.join(&rel))
                .unwrap_or_else(|e| panic!("cannot read {rel} through the volume: {e}"));
            (rel, blake3::hash(&data).to_hex().to_string())
        })
        .collect()
}
