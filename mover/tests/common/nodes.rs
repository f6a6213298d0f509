//! A Kubernetes cluster with real nodes (`deploy/test-cluster/cluster.sh`): the control
//! plane, and per node containerd + runc, a kubelet and kube-proxy in a network and mount
//! namespace of its own. mover runs there only as the install makes it run: the agent
//! DaemonSet's and the controller Deployment's pods, from the image
//! `deploy/image/build.sh` made (`MOVER_IMAGE`).

use super::cluster::{binaries, run_kubectl};
use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
    time::{Duration, Instant},
};

/// One cluster; `cluster.sh down` on drop.
pub struct RealCluster {
    pub name: String,
    pub index: u8,
    pub nodes: u8,
    pub bin: PathBuf,
    /// The admin kubeconfig, in the cluster's directory.
    pub kubeconfig: PathBuf,
}

/// The repository's root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

fn script(bin: &Path, args: &[&str]) -> Output {
    Command::new(repo().join("deploy/test-cluster/cluster.sh"))
        .args(args)
        .env("MOVER_KUBE_BIN", bin)
        .output()
        .expect("cluster.sh")
}

/// The mover image archive (`MOVER_IMAGE`) and the test images' directory
/// (`deploy/test-cluster/images.sh`), or `None` after [`super::skip_unless_ci`].
pub fn images(bin: &Path) -> Option<(PathBuf, PathBuf)> {
    let image = std::env::var_os("MOVER_IMAGE").map(PathBuf::from);
    let others = bin.join("images");
    match image {
        Some(i) if i.is_file() && others.join("pause.oci.tar").is_file() => Some((i, others)),
        _ => {
            super::skip_unless_ci(
                "MOVER_IMAGE (deploy/image/build.sh) or deploy/test-cluster/images.sh's images are missing",
            );
            None
        }
    }
}

impl RealCluster {
    /// Starts cluster `name` with `nodes` real nodes and loads the images into each;
    /// `None` when something it needs is missing (see [`binaries`], [`images`]).
    pub fn start(name: &str, index: u8, nodes: u8) -> Option<RealCluster> {
        let bin = binaries()?;
        if !bin.join("kubelet").is_file() {
            super::skip_unless_ci("no kubelet in MOVER_KUBE_BIN: run deploy/test-cluster/build.sh");
            return None;
        }
        let (mover, others) = images(&bin)?;
        if !super::tree::is_root() {
            super::skip_unless_ci("real nodes need root (namespaces, mounts, loop devices)");
            return None;
        }
        let out = script(&bin, &["up", name, &index.to_string(), &nodes.to_string()]);
        let c = RealCluster {
            name: name.into(),
            index,
            nodes,
            kubeconfig: PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()),
            bin: bin.clone(),
        };
        assert!(
            out.status.success(),
            "cluster.sh up {name} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut archives: Vec<String> = [
            "pause",
            "pause-3.10",
            "busybox",
            "csi-node-driver-registrar",
        ]
        .iter()
        .map(|i| others.join(format!("{i}.oci.tar")).display().to_string())
        .collect();
        archives.push(mover.display().to_string());
        let mut args = vec!["import", name];
        args.extend(archives.iter().map(String::as_str));
        let out = script(&bin, &args);
        assert!(
            out.status.success(),
            "cluster.sh import failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Some(c)
    }

    /// Loads test image `name` of `deploy/test-cluster/images.sh` (`localhost/NAME:…`,
    /// from `NAME.oci.tar`) into every node, for the tests that run it.
    pub fn import_test_image(&self, name: &str) {
        let archive = self.bin.join("images").join(format!("{name}.oci.tar"));
        let out = script(
            &self.bin,
            &["import", &self.name, archive.to_str().unwrap()],
        );
        assert!(
            out.status.success(),
            "cluster.sh import {}: {}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Node `n`'s name.
    pub fn node(&self, n: u8) -> String {
        format!("{}-{n}", self.name)
    }

    /// Node `n`'s address.
    pub fn node_ip(&self, n: u8) -> String {
        format!("10.250.{}.{n}", self.index)
    }

    /// The cluster's directory (logs under `log/`, each node under `nodes/NAME-N`):
    /// where `cluster.sh up` wrote the kubeconfig it printed.
    pub fn dir(&self) -> &Path {
        self.kubeconfig.parent().unwrap_or(Path::new(""))
    }

    /// Node `n`'s /mnt/disks as the host sees it.
    pub fn disks(&self, n: u8) -> PathBuf {
        self.dir().join("nodes").join(self.node(n)).join("disks")
    }

    pub fn kubectl(&self, args: &[&str]) -> Output {
        run_kubectl(&self.bin, &self.kubeconfig, args, None)
    }

    /// kubectl's stdout; panics with its stderr (and the cluster's logs) if it fails.
    pub fn kubectl_ok(&self, args: &[&str]) -> String {
        let out = self.kubectl(args);
        assert!(
            out.status.success(),
            "cluster {}: kubectl {} failed: {}{}",
            self.name,
            args.join(" "),
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// `kubectl apply --server-side` of `yaml`.
    pub fn apply(&self, yaml: &str) -> String {
        let args = ["apply", "--server-side", "--force-conflicts", "-f", "-"];
        let out = run_kubectl(&self.bin, &self.kubeconfig, &args, Some(yaml));
        assert!(
            out.status.success(),
            "cluster {}: apply failed: {}\n{yaml}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// JSONPath `path` of `what` (e.g. `vr/data -n app`).
    pub fn get(&self, what: &[&str], path: &str) -> String {
        let mut args = vec!["get"];
        args.extend(what);
        let jp = format!("jsonpath={path}");
        args.extend(["-o", &jp]);
        let out = self.kubectl(&args);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits until `check` holds, up to `within`; panics with `what`, the mover pods'
    /// state and logs otherwise.
    pub fn wait(&self, what: &str, within: Duration, mut check: impl FnMut() -> bool) {
        let deadline = Instant::now() + within;
        while !check() {
            if Instant::now() > deadline {
                panic!(
                    "cluster {}: {what} not within {within:?}\n{}",
                    self.name,
                    self.diagnostics()
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The pods, recent events and the mover pods' last log lines, for a failure.
    pub fn diagnostics(&self) -> String {
        let text = |args: &[&str]| {
            let o = self.kubectl(args);
            format!(
                "$ kubectl {}\n{}{}",
                args.join(" "),
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            )
        };
        let mut out = text(&["get", "pods", "-A", "-o", "wide"]);
        // Claims and snapshots with what holds them (a finalizer, a deletion under way).
        let held = "custom-columns=NAMESPACE:.metadata.namespace,NAME:.metadata.name,\
                    PHASE:.status.phase,READY:.status.readyToUse,\
                    DELETING:.metadata.deletionTimestamp,FINALIZERS:.metadata.finalizers";
        for kind in ["pvc", "pv", "volumesnapshots", "volumesnapshotcontents"] {
            out += &text(&["get", kind, "-A", "-o", held]);
        }
        out += &text(&["get", "events", "-A", "--sort-by=.lastTimestamp"]);
        for sel in [
            "app.kubernetes.io/name=mover-agent",
            "app.kubernetes.io/name=mover-controller",
        ] {
            out += &text(&[
                "logs",
                "-n",
                "mover-system",
                "-l",
                sel,
                "--all-containers",
                "--prefix",
                "--tail=30",
            ]);
        }
        out
    }

    /// The README's install, step for step: this cluster's replication token, then
    /// `kubectl apply --server-side -k deploy/base`, the CRDs Established, every agent
    /// and controller pod Ready.
    pub fn install(&self, replication_token: &str) {
        self.install_from("deploy/base", replication_token)
    }

    /// [`RealCluster::install`] of the kustomization `dir` (of the repository), e.g. an
    /// overlay of the base.
    pub fn install_from(&self, dir: &str, replication_token: &str) {
        self.kubectl_ok(&["create", "namespace", "mover-system"]);
        self.kubectl_ok(&[
            "-n",
            "mover-system",
            "create",
            "secret",
            "generic",
            "mover-replication-token",
            &format!("--from-literal=token={replication_token}"),
        ]);
        let base = repo().join(dir);
        self.kubectl_ok(&["apply", "--server-side", "-k", base.to_str().unwrap()]);
        // A scraper, as Prometheus's ServiceAccount would be bound (deploy/README.md,
        // "Metrics"): the agents' /metrics answer its token only.
        self.apply(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: scraper, namespace: mover-system}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: ClusterRoleBinding\nmetadata: {name: scraper}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: mover-metrics-reader}\nsubjects: [{kind: ServiceAccount, name: scraper, namespace: mover-system}]\n",
        );
        self.kubectl_ok(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/volumereplications.replication.mover",
        ]);
        let nodes = self.nodes.to_string();
        self.wait(
            "the agents Ready on every node",
            Duration::from_secs(180),
            || {
                self.get(
                    &["ds/mover-agent", "-n", "mover-system"],
                    "{.status.numberReady}",
                ) == nodes
            },
        );
        self.wait("the controller Ready", Duration::from_secs(120), || {
            self.get(
                &["deploy/mover-controller", "-n", "mover-system"],
                "{.status.readyReplicas}",
            ) == "2"
        });
    }

    /// The /metrics of the agent on node `node`, read with the scraper's token.
    pub fn agent_metrics(&self, node: u8) -> String {
        let token = self.kubectl_ok(&["create", "token", "scraper", "-n", "mover-system"]);
        let addr = format!("{}:9470", self.node_ip(node));
        let (status, body) = super::http_get_as(&addr, "/metrics", Some(token.trim()));
        assert_eq!(status, 200, "GET {addr}/metrics as the scraper: {body}");
        body
    }

    /// The hostpath CSI driver, its sidecars and the snapshot-controller as pods
    /// (`deploy/test-cluster/csi-hostpath/up.sh`), the driver on node 1.
    pub fn csi_hostpath(&self) {
        let out = Command::new(repo().join("deploy/test-cluster/csi-hostpath/up.sh"))
            .arg(&self.name)
            .env("MOVER_KUBE_BIN", &self.bin)
            .output()
            .expect("csi-hostpath/up.sh");
        assert!(
            out.status.success(),
            "csi-hostpath/up.sh {} failed: {}",
            self.name,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Kills every process of the cluster, as a site losing power; its state is kept
    /// (`cluster.sh stop`).
    pub fn stop(&self) {
        let out = script(&self.bin, &["stop", &self.name]);
        assert!(out.status.success(), "cluster.sh stop: {out:?}");
    }

    /// Starts a stopped cluster again over its state, until its nodes are Ready
    /// (`cluster.sh start`); the kubelets then start the pods again.
    pub fn start_again(&self) {
        let out = script(&self.bin, &["start", &self.name]);
        assert!(out.status.success(), "cluster.sh start: {out:?}");
    }

    /// Kills the API server (SIGKILL) or starts it again until ready (`cluster.sh
    /// apiserver NAME stop|start`).
    pub fn apiserver(&self, what: &str) {
        let out = script(&self.bin, &["apiserver", &self.name, what]);
        assert!(out.status.success(), "cluster.sh apiserver {what}: {out:?}");
    }

    /// Node `n` loses power (`"stop"`: its kubelet, containerd, kube-proxy and every
    /// container SIGKILLed; its disks kept) or comes back until Ready (`"start"`).
    pub fn node_power(&self, n: u8, what: &str) {
        let out = script(&self.bin, &["node", &self.name, &n.to_string(), what]);
        assert!(out.status.success(), "cluster.sh node {n} {what}: {out:?}");
    }

    /// The audit log's completed requests made by `user` (e.g.
    /// `system:serviceaccount:mover-system:mover-controller`): cluster.sh audits what
    /// service accounts do.
    pub fn audit(&self, user: &str) -> Vec<serde_json::Value> {
        super::cluster::audit_of(&self.dir().join("log/audit.log"), user)
    }

    /// The mover pods' logs (every container, the previous run's too where one restarted).
    pub fn logs(&self, selector: &str) -> String {
        let out = self.kubectl(&[
            "logs",
            "-n",
            "mover-system",
            "-l",
            selector,
            "--all-containers",
            "--prefix",
            "--tail=-1",
        ]);
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for RealCluster {
    fn drop(&mut self) {
        if std::env::var_os("MOVER_KEEP_CLUSTERS").is_some() {
            eprintln!("MOVER_KEEP_CLUSTERS: {} left running", self.name);
            return;
        }
        let out = script(&self.bin, &["down", &self.name]);
        if !out.status.success() {
            eprintln!(
                "cluster.sh down {} failed: {}",
                self.name,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}
