//! End to end on a real Kubernetes control plane (etcd, kube-apiserver and
//! kube-controller-manager built from their Go modules: `deploy/test-cluster/build.sh`):
//! the install as `kubectl apply --server-side -k` takes it, the API server's own
//! validation of VolumeReplications, the controller's RBAC as the real authorizer sees
//! it, and two clusters replicating a volume through `mover controller run` processes.
//!
//! **No node runs here; its parts are emulated**, which the scenarios of
//! `kube_nodes.rs` (real kubelets, containerd, the scheduler, mover's pods from its
//! image) do not. These scenarios predate the real nodes and are being moved there; what
//! they stand in for, each where it is done:
//! - the kubelet: Node objects created, the agent DaemonSet's pods bound to them and
//!   reported Running with a loopback IP (`run_agent_pods`); each agent a `mover agent`
//!   host process with a pod-bound token from `kubectl create token` (what the kubelet
//!   projects); the controller a host process; CSI Node calls made with grpcurl on the
//!   kubelet's paths (`kubelet_of`, `ReaderKubelet`); workload and Job pods as host
//!   processes, their status reported by the test;
//! - the scheduler: the `selected-node` annotation and pod bindings written by the test;
//! - the external-attacher: VolumeAttachments marked attached (`attach`);
//! - the CSI hostpath driver's sidecars: host processes as system:masters.
//!
//! Covered on real nodes already (`kube_nodes.rs`): the install, the agents' certificates
//! through projected tokens, the CSI plugin's registration, two-cluster replication with
//! planned failover and failback by delta, a populated PVC of the replica read by a real
//! pod (its hold released, a primary refused as a replica), the default install's
//! refusals, the controller's RBAC by the audit log, the copy Job, a StatefulSet's move
//! within a cluster, CSI-snapshot cycles (a hook run in the workload's container, the
//! changed blocks read, the metadata service's streams cut and the service down, a hook
//! refused by RBAC or failing in its pod, a planned failover from the final snapshot,
//! the deletion of what cycles made), a forced failover with the primary cluster gone and
//! its resync, the controller's leader killed, an API server restart, a standby taking
//! over when the leader's node loses power, deletions with the volume's node down, a
//! PostgreSQL volume's move between clusters (planned, then with its old owner fenced),
//! PostgreSQL under pgbench on a CSI volume, frozen by its hooks, populated PVCs (bound
//! at once and read by pods while they arrive: 64 MiB to 1 TiB, Filesystem, from a
//! snapshot in S3, of another driver's class through a restore Job, from another
//! cluster's agent, the agent killed mid-fill). Still only here: the thousand-VR scale
//! run and a secondary followed across nodes.
#![cfg(feature = "controller")]

mod common;

use common::cluster::{CONTROLLER_USER, Cluster};
use common::{MIB, blake3_of, make_image, scribble_pages};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One control plane at a time: they are heavy for a two-core machine.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

fn apply_kustomization(c: &Cluster, dir: &str) {
    let path = repo().join(dir);
    c.kubectl_ok(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-k",
        path.to_str().unwrap(),
    ]);
}

fn wait_established(c: &Cluster, crds: &[&str]) {
    let mut args = vec!["wait", "--for=condition=Established", "--timeout=60s"];
    let names: Vec<String> = crds.iter().map(|n| format!("crd/{n}")).collect();
    args.extend(names.iter().map(String::as_str));
    c.kubectl_ok(&args);
}

/// `kubectl apply --server-side` of `yaml` that must be refused; returns the error.
fn refused(c: &Cluster, yaml: &str) -> String {
    let out = c.kubectl_as(
        &c.kubeconfig,
        &["apply", "--server-side", "-f", "-"],
        Some(yaml),
    );
    assert!(
        !out.status.success(),
        "the API server accepted:\n{yaml}\n{}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn vr_yaml(name: &str, state: &str, class: &str, pvc: Option<&str>) -> String {
    let source = pvc.map_or(String::new(), |p| {
        format!("  dataSource:\n    kind: PersistentVolumeClaim\n    name: {p}\n")
    });
    format!(
        "apiVersion: replication.mover/v1alpha1\nkind: VolumeReplication\nmetadata:\n  name: {name}\n  namespace: app\nspec:\n  volumeReplicationClass: {class}\n  replicationState: {state}\n{source}"
    )
}

#[test]
fn the_install_applies_and_the_api_server_refuses_bad_volume_replications() {
    let _one = serial();
    let t = tempfile::tempdir().unwrap();
    let Some(c) = Cluster::start(t.path(), "install") else {
        return;
    };
    // Where the volume-data-source-validator runs: its CRD, then mover's registration.
    c.kubectl_ok(&[
        "apply",
        "-f",
        repo()
            .join("mover/tests/fixtures/volumepopulators.populator.storage.k8s.io.yaml")
            .to_str()
            .unwrap(),
    ]);
    wait_established(&c, &["volumepopulators.populator.storage.k8s.io"]);
    for dir in [
        "deploy/base",
        "deploy/overlays/insecure-plaintext",
        "deploy/overlays/csi-addons",
        "deploy/overlays/volume-populator",
    ] {
        apply_kustomization(&c, dir);
    }
    let registered = c.kubectl_ok(&[
        "get",
        "volumepopulator",
        "mover-hydration-source",
        "-o",
        "jsonpath={.sourceKind.group}/{.sourceKind.kind}",
    ]);
    assert_eq!(registered, "replication.mover/HydrationSource");
    wait_established(
        &c,
        &[
            "volumereplications.replication.mover",
            "volumereplicationclasses.replication.mover",
            "volumereplications.replication.storage.openshift.io",
            "volumereplicationclasses.replication.storage.openshift.io",
            "hydrationsources.replication.mover",
            "volumemoves.replication.mover",
        ],
    );
    c.kubectl_ok(&["create", "namespace", "app"]);
    apply_kustomization(&c, "deploy/examples");

    // The API server itself refuses what the controller could only mark invalid.
    let bad_state = refused(
        &c,
        &vr_yaml("bad-state", "sideways", "mover-dr", Some("pvc")),
    );
    assert!(
        bad_state.contains("spec.replicationState") && bad_state.contains("\"primary\""),
        "{bad_state}"
    );
    let not_an_agent = refused(
        &c,
        "apiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata:\n  name: bad\n  namespace: app\nspec:\n  agent: https://node-a/pg\n",
    );
    assert!(
        not_an_agent.contains("agent must be agent://NODE@HOST:PORT/VOLUME"),
        "{not_an_agent}"
    );
    let no_password = refused(
        &c,
        "apiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata:\n  name: bad\n  namespace: app\nspec:\n  snapshot: {repository: s3://b/p, id: latest}\n",
    );
    assert!(
        no_password.contains("a snapshot needs secretRef"),
        "{no_password}"
    );
    let neither = refused(
        &c,
        "apiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata:\n  name: bad\n  namespace: app\nspec:\n  bwlimit: 2M\n",
    );
    assert!(
        neither.contains("name one of agent, snapshot and volumeReplication"),
        "{neither}"
    );
    let both = refused(
        &c,
        "apiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata:\n  name: bad\n  namespace: app\nspec:\n  agent: agent://n@h:1/v\n  volumeReplication: data\n",
    );
    assert!(
        both.contains("name one of agent, snapshot and volumeReplication"),
        "{both}"
    );
    let vmove = |name: &str, spec: &str| {
        format!(
            "apiVersion: replication.mover/v1alpha1\nkind: VolumeMove\nmetadata:\n  name: {name}\n  namespace: app\nspec:\n{spec}"
        )
    };
    let both = refused(
        &c,
        &vmove("both", "  side: Source\n  pvc: a\n  statefulSet: b\n"),
    );
    assert!(both.contains("name either pvc or statefulSet"), "{both}");
    let within = refused(
        &c,
        &vmove(
            "within",
            "  side: Destination\n  pvc: a\n  storageClassName: mover-populated\n",
        ),
    );
    assert!(
        within.contains("storageClassName is the source's"),
        "{within}"
    );
    // The example moves exist: their specs stay as they are.
    let changed = refused(
        &c,
        &vmove("pg-to-dr", "  side: Destination\n  pvc: pg-data\n"),
    );
    assert!(changed.contains("spec is immutable"), "{changed}");
    let no_source = refused(&c, &vr_yaml("no-source", "primary", "mover-dr", None));
    assert!(
        no_source.contains("spec.dataSource") && no_source.contains("Required"),
        "{no_source}"
    );
    // The example VolumeReplication (app/pg-data) exists: its immutable fields stay.
    let moved = refused(
        &c,
        &vr_yaml("pg-data", "primary", "mover-dr", Some("other")),
    );
    assert!(moved.contains("dataSource is immutable"), "{moved}");
    let reclassed = refused(
        &c,
        &vr_yaml("pg-data", "primary", "other-class", Some("pg-data")),
    );
    assert!(
        reclassed.contains("volumeReplicationClass is immutable"),
        "{reclassed}"
    );
    // What may change does: the state.
    c.apply(&vr_yaml(
        "pg-data",
        "secondary",
        "mover-dr",
        Some("pg-data"),
    ));
    let state = c.kubectl_ok(&[
        "get",
        "vr",
        "-n",
        "app",
        "pg-data",
        "-o",
        "jsonpath={.spec.replicationState}",
    ]);
    assert_eq!(state, "secondary");
}

/// The rules `kubectl auth can-i --list` gives the controller in mover-system, as
/// deploy/README.md documents them (the block after `<!-- can-i mover-controller -->`).
fn documented_rules() -> Vec<String> {
    let readme = std::fs::read_to_string(repo().join("deploy/README.md")).unwrap();
    let (_, after) = readme
        .split_once("<!-- can-i mover-controller -->")
        .expect("deploy/README.md documents the controller's rules");
    let block = after
        .split("```")
        .nth(1)
        .expect("a fenced block follows the marker");
    normalize(block.trim_start_matches("text"))
}

/// The rule lines of a `can-i --list` table, with single spaces, sorted, without the
/// header.
fn normalize(table: &str) -> Vec<String> {
    let mut rules: Vec<String> = table
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| !l.is_empty() && !l.starts_with("Resources "))
        .collect();
    rules.sort();
    rules
}

#[test]
fn the_controller_may_do_what_deploy_documents_and_no_more() {
    let _one = serial();
    let t = tempfile::tempdir().unwrap();
    let Some(c) = Cluster::start(t.path(), "rbac") else {
        return;
    };
    apply_kustomization(&c, "deploy/base");
    let listed = c.kubectl_ok(&[
        "auth",
        "can-i",
        "--list",
        "--as=system:serviceaccount:mover-system:mover-controller",
        "-n",
        "mover-system",
    ]);
    assert_eq!(
        normalize(&listed),
        documented_rules(),
        "the controller's rules differ from deploy/README.md's; the real list:\n{listed}"
    );
    // Secrets: in its own namespace, nowhere else unless an administrator adds a Role.
    let can = |verb: &str, ns: &str| {
        let out = c.kubectl(&[
            "auth",
            "can-i",
            verb,
            "secrets",
            "-n",
            ns,
            "--as=system:serviceaccount:mover-system:mover-controller",
        ]);
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(can("get", "default"), "no");
    assert_eq!(can("list", "default"), "no");
    assert_eq!(can("list", "mover-system"), "yes");
    c.kubectl_ok(&["create", "namespace", "dr-secrets"]);
    c.apply(
        "apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: mover-controller-secrets, namespace: dr-secrets}\nrules:\n  - {apiGroups: [\"\"], resources: [secrets], verbs: [list, watch]}\n---\napiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: mover-controller-secrets, namespace: dr-secrets}\nroleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: mover-controller-secrets}\nsubjects: [{kind: ServiceAccount, name: mover-controller, namespace: mover-system}]\n",
    );
    assert_eq!(
        can("list", "dr-secrets"),
        "yes",
        "the Role deploy/README.md gives"
    );
    assert_eq!(can("list", "default"), "no");
    // The agents' ServiceAccount may ask for certificates and nothing else.
    let agent = c.kubectl_ok(&[
        "auth",
        "can-i",
        "--list",
        "--as=system:serviceaccount:mover-system:mover-agent",
    ]);
    let own: Vec<String> = agent
        .lines()
        .filter(|l| {
            !l.contains("selfsubject")
                && !l.trim_start().starts_with('[')
                && !l.starts_with("Resources")
        })
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .collect();
    assert_eq!(
        own,
        ["certificatesigningrequests.certificates.k8s.io [] [] [create get]"],
        "{agent}"
    );
}

// ---------------------------------------------------------------------------------------
// Two clusters.

const VOLUME_LEN: u64 = 32 * MIB;
/// The kubelet's directory of CSI volumes (a volume attached to a node appears there).
const KUBELET_CSI: &str = "/var/lib/kubelet/plugins/kubernetes.io/csi";

/// A class's parameters naming the secret `dr-peer` (the peer cluster's replication
/// token and CA).
const SECRET_PARAMS: &str = "    replication.storage.openshift.io/replication-secret-name: dr-peer\n    replication.storage.openshift.io/replication-secret-namespace: mover-system\n";

/// The secret `dr-peer` with `token` and, for a peer cluster, its CA.
fn peer_secret(token: &str, ca: Option<&str>) -> String {
    let mut data = json!({"token": token});
    if let Some(ca) = ca {
        data["ca.crt"] = json!(ca);
    }
    json!({"apiVersion": "v1", "kind": "Secret",
           "metadata": {"name": "dr-peer", "namespace": "mover-system"},
           "stringData": data})
    .to_string()
}

/// The controllers' `--lease-duration` here.
const LEASE: Duration = Duration::from_secs(6);
/// The controllers' `--deletion-grace` here.
const DELETION_GRACE: Duration = Duration::from_secs(5);
/// A real `mover agent` on a "node": its own loopback address, the cluster's agent port,
/// TLS with a certificate from its cluster's controller (through the CSR API, with a
/// ServiceAccount token bound to its pod, as the kubelet projects it).
struct NodeAgent {
    child: Child,
    ip: String,
    node: String,
    dir: PathBuf,
    /// Earlier starts in its log (each says "agent serving").
    starts: usize,
}

impl NodeAgent {
    /// Starts the agent of `node` (its pod's token in DIR/agent.kubeconfig) with `extra`
    /// appended to its config (e.g. `[exports.NAME]` sections), without waiting for its
    /// certificate: see [`NodeAgent::wait_ready`].
    fn spawn(dir: &Path, ip: &str, node: &str, port: u16, extra: &str) -> NodeAgent {
        std::fs::create_dir_all(dir).unwrap();
        // The operator's token (the control role), for `mover replicate status` here.
        std::fs::write(dir.join("token"), common::agent::TOKEN).unwrap();
        let metrics_port = common::agent::free_port();
        let config = dir.join("agent.toml");
        std::fs::write(
            &config,
            format!(
                "listen = \"{ip}:{port}\"\nmetrics_listen = \"{ip}:{metrics_port}\"\nstate_dir = \"{}\"\ntoken_file = \"{}\"\nreplication_token_file = \"{}\"\nnode_name = \"{node}\"\nvolume_roots = [\"{}\", \"{KUBELET_CSI}\"]\n{extra}\n[tls]\nfrom_kubernetes = true\n",
                dir.join("state").display(),
                dir.join("token").display(),
                dir.parent().unwrap().join("replication-token").display(),
                dir.display()
            ),
        )
        .unwrap();
        let starts = std::fs::read_to_string(dir.join("agent.log"))
            .map(|l| l.matches("agent serving").count())
            .unwrap_or(0);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("agent.log"))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(["agent", "--config", config.to_str().unwrap()])
            .env("RUST_LOG", "info")
            .env("KUBECONFIG", dir.join("agent.kubeconfig"))
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        NodeAgent {
            child,
            ip: ip.into(),
            node: node.into(),
            dir: dir.into(),
            starts,
        }
    }

    /// Waits until it serves (its certificate signed; its ports are bound before).
    fn wait_ready(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let serving = |a: &NodeAgent| {
            std::fs::read_to_string(a.dir.join("agent.log"))
                .is_ok_and(|log| log.matches("agent serving").count() > a.starts)
        };
        while !serving(self) {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "agent {} exited ({status}):\n{}",
                    self.node,
                    std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "agent {} did not start:\n{}",
                self.node,
                std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Its URL as peers and the controller reach it: the name its certificate carries.
    fn url(&self, port: u16) -> String {
        format!("agent://{}@{}:{port}", self.node, self.ip)
    }

    /// The CA it trusts (its cluster's), as it keeps it.
    fn ca(&self) -> PathBuf {
        self.dir.join("state/tls/ca.crt")
    }

    /// `mover replicate status NAME` on this agent, as [`NodeAgent::relationship`].
    fn relationship_named(&self, name: &str, port: u16) -> Result<String, String> {
        let out = Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(["replicate", "status", name, "--json", "--agent"])
            .arg(self.url(port))
            .arg("--tls-ca")
            .arg(self.ca())
            .env("MOVER_TOKEN", common::agent::TOKEN)
            .output()
            .unwrap();
        match out.status.success() {
            true => Ok(String::from_utf8_lossy(&out.stdout).into()),
            false => Err(String::from_utf8_lossy(&out.stderr).into()),
        }
    }
}

impl Drop for NodeAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Registers a Node per agent (`NAME-node1`, ...) and runs the DaemonSet's agent
/// pods on them; returns each node's pod.
fn run_agent_pods(
    cluster: &Cluster,
    name: &str,
    nodes: &[(String, String, String)],
) -> std::collections::HashMap<String, String> {
    let mut ips = std::collections::HashMap::new();
    let mut names = std::collections::HashMap::new();
    for (i, (node, ip, _)) in nodes.iter().enumerate() {
        let n = i + 1;
        // The kubelet's part: register the Node.
        cluster.apply(&format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {node}\n  labels:\n    kubernetes.io/hostname: {node}\n    topology.kubernetes.io/zone: {name}-zone{n}\n"
        ));
        ips.insert(node.clone(), ip.clone());
    }
    // kube-controller-manager's DaemonSet controller makes an agent pod per node.
    // No scheduler or kubelet runs: bind each to its node (the scheduler's part)
    // and report it Running with the node's address (the kubelet's part; the agents
    // run in the host network). The agent processes themselves are real.
    let deadline = Instant::now() + Duration::from_secs(60);
    let pods = loop {
        let out = cluster.kubectl_ok(&[
            "get",
            "pods",
            "-n",
            "mover-system",
            "-l",
            "app.kubernetes.io/name=mover-agent",
            "-o",
            "json",
        ]);
        let list: Value = serde_json::from_str(&out).unwrap();
        let pods = list["items"].as_array().cloned().unwrap_or_default();
        if pods.len() == nodes.len() {
            break pods;
        }
        assert!(
            Instant::now() < deadline,
            "the DaemonSet made {} agent pods, not {}\n{}",
            pods.len(),
            nodes.len(),
            cluster.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    for pod in pods {
        let name = pod["metadata"]["name"].as_str().unwrap();
        let node = pod["spec"]["affinity"]["nodeAffinity"]
            ["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
            ["matchFields"][0]["values"][0]
            .as_str()
            .expect("a DaemonSet pod names its node in its affinity")
            .to_string();
        cluster.kubectl_as(
            &cluster.kubeconfig,
            &["create", "-f", "-"],
            Some(
                &json!({
                    "apiVersion": "v1", "kind": "Binding",
                    "metadata": {"name": name, "namespace": "mover-system"},
                    "target": {"apiVersion": "v1", "kind": "Node", "name": node}
                })
                .to_string(),
            ),
        );
        let ip = &ips[&node];
        names.insert(node.clone(), name.to_string());
        cluster.kubectl_ok(&[
            "patch",
            "pod",
            name,
            "-n",
            "mover-system",
            "--subresource=status",
            "--type=merge",
            "-p",
            &json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}],
                               "hostIP": ip,
                               "conditions": [{"type": "Ready", "status": "True"}]}})
            .to_string(),
        ]);
    }
    names
}

/// Registers the nodes (NAME, IP, extra config), runs the agent pods on them and starts
/// their agents, each with a ServiceAccount token bound to its pod (the kubelet's
/// projected token). They serve once a controller has signed their certificates.
fn start_agents(
    cluster: &Cluster,
    name: &str,
    nodes: &[(String, String, String)],
    port: u16,
) -> Vec<NodeAgent> {
    std::fs::write(
        cluster.dir.join("replication-token"),
        format!("repl-{name}"),
    )
    .unwrap();
    let pods = run_agent_pods(cluster, name, nodes);
    nodes
        .iter()
        .map(|(node, ip, extra)| {
            let dir = cluster.dir.join(node);
            std::fs::create_dir_all(&dir).unwrap();
            cluster.pod_kubeconfig(
                "mover-system",
                "mover-agent",
                &pods[node],
                &dir.join("agent.kubeconfig"),
            );
            NodeAgent::spawn(&dir, ip, node, port, extra)
        })
        .collect()
}

/// A `mover controller run` process with the mover-controller ServiceAccount's token.
struct Controller {
    child: Child,
    log: PathBuf,
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One cluster: its control plane with mover installed, two nodes with an agent each,
/// a PVC `app/data` bound to a local PV on the first node, a class replicating to the
/// peer's first node.
struct Site {
    cluster: Cluster,
    agents: Vec<NodeAgent>,
    port: u16,
    image: PathBuf,
    controllers: Vec<Controller>,
    /// The first controller's Locator port (what peer clusters' classes name).
    locator: u16,
}

impl Site {
    /// `subnet` picks the agents' loopback addresses: 127.0.SUBNET.1 and .2.
    fn start(dir: &Path, name: &str, subnet: u8) -> Option<Site> {
        Site::start_with(dir, name, subnet, ["", ""])
    }

    /// A site whose node agents have `extra` added to their configs (node 1's first).
    fn start_with(dir: &Path, name: &str, subnet: u8, extra: [&str; 2]) -> Option<Site> {
        let cluster = Cluster::start(dir, name)?;
        apply_kustomization(&cluster, "deploy/base");
        wait_established(&cluster, &["volumereplications.replication.mover"]);
        let port = common::agent::free_port();
        let nodes: Vec<(String, String, String)> = (1..=2)
            .map(|n| {
                let node = format!("{name}-node{n}");
                (
                    node,
                    format!("127.0.{subnet}.{n}"),
                    extra[n - 1].to_string(),
                )
            })
            .collect();
        let agents = start_agents(&cluster, name, &nodes, port);
        let mut site = Site {
            cluster,
            agents,
            port,
            image: PathBuf::new(),
            controllers: Vec::new(),
            locator: common::agent::free_port(),
        };
        site.image = site.agents[0].dir.join("data.img");
        site.cluster.kubectl_ok(&["create", "namespace", "app"]);
        // A local PV on node 1, bound by kube-controller-manager's PV binder. Named alike
        // in both clusters, as RamenDR restores PVs: the class's target is the peer
        // agent, and the export there is named after the PV.
        site.cluster.apply(&format!(
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
    storage: 32Mi
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  persistentVolumeReclaimPolicy: Retain
  local:
    path: {image}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - key: kubernetes.io/hostname
          operator: In
          values: [{name}-node1]
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
      storage: 32Mi
"#,
            image = site.image.display()
        ));
        site.wait("the PVC bound by kube-controller-manager", |s| {
            s.get("pvc", "app", "data")["status"]["phase"] == "Bound"
        });
        Some(site)
    }

    /// The class replicating to the cluster `peer` (its Locator), with the peer
    /// cluster's replication token and CA in the secret it names (read through a watch):
    /// what an administrator copies between clusters, and nothing else. `consistency`:
    /// the class's parameter (None: the default, point-in-time).
    fn class_to(&self, peer: &Site, consistency: Option<&str>) -> String {
        let params = consistency.map_or(String::new(), |c| format!("    consistency: {c}\n"));
        self.class_named("dr", peer, &params)
    }

    /// A class `name` as [`Site::class_to`] makes, with `params` (YAML lines, indented
    /// four spaces) added to its parameters.
    fn class_named(&self, name: &str, peer: &Site, params: &str) -> String {
        let ca = std::fs::read_to_string(peer.agents[0].ca()).unwrap_or_else(|e| {
            panic!(
                "{}: {e}\n{}",
                peer.agents[0].ca().display(),
                std::fs::read_to_string(peer.agents[0].dir.join("agent.log")).unwrap_or_default()
            )
        });
        let token = format!("repl-{}", peer.cluster.name);
        format!(
            "{}\n---\napiVersion: replication.mover/v1alpha1\nkind: VolumeReplicationClass\nmetadata:\n  name: {name}\nspec:\n  provisioner: kubernetes.io/no-provisioner\n  parameters:\n    schedulingInterval: 2s\n    target: cluster://127.0.0.1:{}\n{params}{SECRET_PARAMS}",
            peer_secret(&token, Some(&ca)),
            peer.locator,
        )
    }

    /// Starts a controller replica named `identity` (leader election on).
    fn start_controller(&mut self, identity: &str) {
        let kubeconfig = self.cluster.dir.join(format!("{identity}.kubeconfig"));
        self.cluster
            .service_account_kubeconfig("mover-system", "mover-controller", &kubeconfig);
        let log = self.cluster.dir.join(format!("{identity}.log"));
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(["controller", "run"])
            .args(["--agent-port", &self.port.to_string()])
            .args([
                "--metrics-listen",
                &format!("127.0.0.1:{}", common::agent::free_port()),
            ])
            .arg("--replication-token-file")
            .arg(self.cluster.dir.join("replication-token"))
            .args([
                "--locator-listen",
                &format!(
                    "127.0.0.1:{}",
                    if self.controllers.is_empty() {
                        self.locator
                    } else {
                        common::agent::free_port()
                    }
                ),
            ])
            // Short bounds, so the takeover and deletion tests finish soon.
            .args(["--lease-duration", &format!("{}s", LEASE.as_secs())])
            .args([
                "--deletion-grace",
                &format!("{}s", DELETION_GRACE.as_secs()),
            ])
            .env("KUBECONFIG", &kubeconfig)
            .env("HOSTNAME", identity)
            .env("POD_NAME", identity)
            .env(
                "RUST_LOG",
                "info,kube=warn,mover::controller::reconcile=debug",
            )
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        self.controllers.push(Controller { child, log });
        // The first one signs the agents' certificates: they serve from then on.
        for a in &mut self.agents {
            a.wait_ready();
        }
    }

    fn get(&self, kind: &str, namespace: &str, name: &str) -> Value {
        let out = self
            .cluster
            .kubectl(&["get", kind, "-n", namespace, name, "-o", "json"]);
        if !out.status.success() {
            return Value::Null;
        }
        serde_json::from_slice(&out.stdout).unwrap()
    }

    fn vr(&self) -> Value {
        self.get("volumereplication", "app", "data")
    }

    fn set_state(&self, state: &str) {
        self.cluster
            .apply(&vr_yaml("data", state, "dr", Some("data")));
    }

    fn wait(&self, what: &str, cond: impl Fn(&Site) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(120);
        while !cond(self) {
            if Instant::now() > deadline {
                let logs: String = self
                    .controllers
                    .iter()
                    .map(|c| {
                        let text = std::fs::read_to_string(&c.log).unwrap_or_default();
                        let lines: Vec<_> = text.lines().collect();
                        lines[lines.len().saturating_sub(20)..].join("\n")
                    })
                    .collect();
                let pods = self
                    .cluster
                    .kubectl(&["get", "pods", "-A", "-o", "wide"])
                    .stdout;
                panic!(
                    "cluster {}: waited 120 s for {what}\nVR: {}\npods:\n{}\ncontroller log:\n{logs}\n{}",
                    self.cluster.name,
                    serde_json::to_string_pretty(&self.vr()["status"]).unwrap(),
                    String::from_utf8_lossy(&pods),
                    self.cluster.logs()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// The VR's condition `ty` (null when it has none).
    fn condition_of(&self, ty: &str) -> Value {
        condition_in(&self.vr(), ty)
    }

    /// The VR's condition `ty`: (status, reason).
    fn condition(&self, ty: &str) -> (String, String) {
        let c = self.condition_of(ty);
        (
            c["status"].as_str().unwrap_or("").into(),
            c["reason"].as_str().unwrap_or("").into(),
        )
    }
}

/// The condition `ty` of the VolumeReplication `vr` (null when it has none).
fn condition_in(vr: &Value, ty: &str) -> Value {
    vr["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == ty)
        .cloned()
        .unwrap_or(Value::Null)
}

fn completed(s: &Site, reason: &str) -> bool {
    s.condition("Completed") == ("True".into(), reason.into())
}

/// Two clusters with mover installed and a controller each; A's VR primary and B's
/// secondary, replicating (`None` when the control plane is not built).
fn replicating_pair(dir: &Path) -> Option<(Site, Site)> {
    let mut a = Site::start(dir, "a", 10)?;
    // B's node 2 runs the CSI plugin: a PVC populated from B's replica lives there.
    let csi = format!(
        "csi_socket = \"{}\"",
        dir.join("b/b-node2/csi.sock").display()
    );
    let mut b = Site::start_with(dir, "b", 20, ["", &csi])?;
    make_image(
        &a.image,
        VOLUME_LEN,
        7,
        &[(0, 4 * MIB), (20 * MIB, 2 * MIB)],
    );
    make_image(&b.image, VOLUME_LEN, 0, &[]);
    a.start_controller("a-controller-1");
    b.start_controller("b-controller-1");
    // The images are files on ext4: no reflinks, no CSI snapshots, so no point in time.
    // The default class requires one: A's cycles fail and its VR says so.
    a.cluster.apply(&a.class_to(&b, None));
    let torn = Some("crash-inconsistent");
    b.cluster.apply(&b.class_to(&a, torn));

    // RamenDR creates the secondary first, then the primary.
    b.set_state("secondary");
    b.wait("the secondary VR marked Secondary", |s| {
        s.vr()["status"]["state"] == "Secondary"
    });
    a.set_state("primary");
    a.wait("the primary VR Degraded for want of a point in time", |s| {
        s.condition("Degraded") == ("True".into(), "NoPointInTime".into())
    });
    let vr = a.vr();
    let degraded = a.condition_of("Degraded")["message"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(
        degraded.contains("no point in time can be taken of it")
            && degraded.contains("volumeSnapshotClassName")
            && degraded.contains("consistency=crash-inconsistent"),
        "{degraded}"
    );
    assert!(
        vr["status"]["lastSyncTime"].is_null(),
        "nothing shipped: {vr}"
    );
    assert_eq!(
        a.condition("PointInTime"),
        ("Unknown".into(), "NoCycle".into())
    );
    assert_ne!(
        b.condition("PointInTime").0,
        "True",
        "nothing claims a point in time"
    );

    // Accepting less (class parameters are immutable: the class is made again): cycles
    // complete, labelled as what they are.
    a.cluster
        .kubectl_ok(&["delete", "volumereplicationclass", "dr", "--wait"]);
    a.cluster.apply(&a.class_to(&b, torn));
    a.wait("the primary VR Promoted with a lastSyncTime", |s| {
        completed(s, "Promoted") && s.vr()["status"]["lastSyncTime"].is_string()
    });
    b.wait("the secondary healthy once a cycle is applied", |s| {
        s.condition("Degraded") == ("False".into(), "Healthy".into())
    });
    for s in [&a, &b] {
        assert_eq!(
            s.vr()["status"]["lastSyncConsistency"],
            "crash-inconsistent"
        );
        assert_eq!(
            s.condition("PointInTime"),
            ("False".into(), "CrashInconsistent".into())
        );
    }
    let columns = a.cluster.kubectl_ok(&["get", "vr", "-A"]);
    assert!(
        columns.contains("CONSISTENCY") && columns.contains("crash-inconsistent"),
        "{columns}"
    );
    assert_eq!(
        blake3_of(&b.image, VOLUME_LEN),
        blake3_of(&a.image, VOLUME_LEN)
    );
    Some((a, b))
}

/// The last cycle a relationship's side applied or shipped (0: none), from `status`.
fn last_cycle(status: &str) -> u64 {
    serde_json::from_str::<Value>(status).unwrap()["last_cycle"]["id"]
        .as_u64()
        .unwrap_or(0)
}

/// A VolumeAttachment of `pv` to `node`, attached (the external-attacher's part: no
/// CSI driver runs here).
fn attach(s: &Site, pv: &str, node: &str) {
    let name = format!("{pv}-{node}");
    s.cluster.apply(
        &json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment",
                "metadata": {"name": name},
                "spec": {"attacher": "disk.example.com", "nodeName": node,
                         "source": {"persistentVolumeName": pv}}})
        .to_string(),
    );
    s.cluster.kubectl_ok(&[
        "patch",
        "volumeattachment",
        &name,
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status": {"attached": true}}"#,
    ]);
}

/// Why this one stays emulated: it needs a volume that can be attached to either node
/// (a network disk), detached from one and attached to the other. No CSI driver of such a
/// disk runs on this machine (the hostpath driver's volumes live on one node, mover's
/// own are not attachable), so the external-attacher's part is played by [`attach`].
#[test]
fn a_secondary_on_any_node_of_the_peer_cluster_is_found_and_followed_when_it_moves() {
    if !rustix::process::geteuid().is_root() {
        // The kubelet's directory of CSI volumes is root's.
        return common::skip_unless_ci("the attached volume lives under /var/lib/kubelet");
    }
    let _one = serial();
    let t = tempfile::tempdir().unwrap();
    let Some((a, b)) = replicating_pair(t.path()) else {
        return;
    };
    const NAME: &str = "app/moving";
    // A: a local PV on node 1. B: a CSI block PV, attached to node 2: the kubelet puts
    // its device under volumeDevices/PV/dev on whichever node it is attached to (here
    // one directory both "nodes" see, as a network disk is seen by both).
    let a_image = a.agents[0].dir.join("moving.img");
    make_image(&a_image, VOLUME_LEN, 11, &[(0, 2 * MIB), (30 * MIB, MIB)]);
    let pv_b = format!("pv-moving-{}", std::process::id());
    let device_dir = PathBuf::from(KUBELET_CSI)
        .join("volumeDevices")
        .join(&pv_b)
        .join("dev");
    std::fs::create_dir_all(&device_dir).unwrap();
    let b_device = device_dir.join("pod-1");
    make_image(&b_device, VOLUME_LEN, 0, &[]);
    struct Cleanup(PathBuf);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _cleanup = Cleanup(device_dir.parent().unwrap().to_path_buf());
    let claim = |pv: &str| {
        format!(
            "apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: moving, namespace: app}}
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: ''
  volumeName: {pv}
  resources: {{requests: {{storage: 32Mi}}}}
"
        )
    };
    // A block PV `name` of `source` (its YAML under spec), and the PVC `moving` on it.
    let volume = |name: &str, source: &str| {
        format!(
            "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {name}}}\nspec:\n  capacity: {{storage: 32Mi}}\n  accessModes: [ReadWriteOnce]\n  volumeMode: Block\n  storageClassName: ''\n  persistentVolumeReclaimPolicy: Retain\n{source}---\n{}",
            claim(name)
        )
    };
    a.cluster.apply(&volume(
        "pv-moving-a",
        &format!(
            "  local: {{path: {}}}\n  nodeAffinity:\n    required:\n      nodeSelectorTerms:\n      - matchExpressions:\n        - {{key: kubernetes.io/hostname, operator: In, values: [a-node1]}}\n",
            a_image.display()
        ),
    ));
    b.cluster.apply(&volume(
        &pv_b,
        "  csi: {driver: disk.example.com, volumeHandle: vol-moving}\n",
    ));
    attach(&b, &pv_b, "b-node2");
    for s in [&a, &b] {
        s.wait("the PVC moving bound", |s| {
            s.get("pvc", "app", "moving")["status"]["phase"] == "Bound"
        });
    }
    let vr = |state: &str| vr_yaml("moving", state, "dr", Some("moving"));
    b.cluster.apply(&vr("secondary"));
    a.cluster.apply(&vr("primary"));
    let (node1, node2, port) = (&b.agents[0], &b.agents[1], b.port);
    // Waits until a cycle of the relationship reached `node`.
    let reached = |node: &NodeAgent, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(120);
        while node
            .relationship_named(NAME, port)
            .map_or(true, |s| last_cycle(&s) == 0)
        {
            assert!(
                Instant::now() < deadline,
                "{what}: {:?}\nA: {}",
                node.relationship_named(NAME, port),
                serde_json::to_string_pretty(&a.get("vr", "app", "moving")["status"]).unwrap()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    // The class names cluster B only; B's Locator sends the cycles to node 2.
    reached(node2, "no cycle reached node 2");
    assert!(
        node1.relationship_named(NAME, port).is_err(),
        "node 1 has no part in it yet"
    );
    let wait_equal = |what: &str| {
        let deadline = Instant::now() + Duration::from_secs(120);
        while blake3_of(&b_device, VOLUME_LEN) != blake3_of(&a_image, VOLUME_LEN) {
            assert!(
                Instant::now() < deadline,
                "{what}: B's volume never equalled A's"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    wait_equal("on node 2");

    // The volume moves to node 1 (detached from node 2, attached to node 1): the next
    // cycles go there, a full comparison, and none goes to node 2 any more.
    b.cluster
        .kubectl_ok(&["delete", "volumeattachment", &format!("{pv_b}-b-node2")]);
    attach(&b, &pv_b, "b-node1");
    scribble_pages(&a_image, 12, 40, 0..VOLUME_LEN);
    reached(
        node1,
        "the relationship did not follow the volume to node 1",
    );
    let on_node2 = last_cycle(&node2.relationship_named(NAME, port).unwrap());
    wait_equal("on node 1");
    // Cycles go on, into node 1 only.
    let seen = last_cycle(&node1.relationship_named(NAME, port).unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    while last_cycle(&node1.relationship_named(NAME, port).unwrap()) < seen + 2 {
        assert!(Instant::now() < deadline, "cycles stopped after the move");
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(
        last_cycle(&node2.relationship_named(NAME, port).unwrap()),
        on_node2,
        "a cycle went to node 2 after the volume left it"
    );
    assert_eq!(
        blake3_of(&b_device, VOLUME_LEN),
        blake3_of(&a_image, VOLUME_LEN)
    );
}

fn controller_log(c: &Controller) -> String {
    std::fs::read_to_string(&c.log).unwrap_or_default()
}

/// The CPU time process `pid` used so far (user + system), in seconds.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// The peak resident size of process `pid` (VmHWM), in MiB.
fn peak_rss_mib(pid: u32) -> f64 {
    proc_status_mib(pid, "VmHWM:")
}

/// A size line of /proc/PID/status (e.g. `VmRSS:`), in MiB.
fn proc_status_mib(pid: u32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib / 1024.0
}

#[test]
fn a_thousand_volume_replications_on_a_real_api_server() {
    // MOVER_E2E_VRS: fewer, to look at the costs by hand.
    let n: usize = std::env::var("MOVER_E2E_VRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    const INTERVAL: Duration = Duration::from_secs(60);
    let _one = serial();
    let t = tempfile::tempdir().unwrap();
    let Some(cluster) = Cluster::start(t.path(), "scale") else {
        return;
    };
    apply_kustomization(&cluster, "deploy/base");
    wait_established(&cluster, &["volumereplications.replication.mover"]);
    // node1 holds the volumes (small sparse images); node2's agent serves the peers'
    // copies as exports of its own config (what the secondary cluster's controller
    // would register), so each relationship cycles for real.
    let port = common::agent::free_port();
    let (src, dst) = (
        cluster.dir.join("scale-node1"),
        cluster.dir.join("scale-node2"),
    );
    std::fs::create_dir_all(&src).unwrap();
    std::fs::create_dir_all(&dst).unwrap();
    let mut peer_exports = String::new();
    let mut objects = String::new();
    for i in 0..n {
        for dir in [&src, &dst] {
            std::fs::File::create(dir.join(format!("v{i}.img")))
                .unwrap()
                .set_len(MIB)
                .unwrap();
        }
        peer_exports += &format!(
            "[exports.pv-{i}]\npath = \"{}\"\n",
            dst.join(format!("v{i}.img")).display()
        );
        objects += &format!(
            r#"---
apiVersion: v1
kind: PersistentVolume
metadata: {{name: pv-{i}}}
spec:
  capacity: {{storage: 1Mi}}
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  claimRef: {{namespace: app, name: data-{i}}}
  local: {{path: {path}}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {{key: kubernetes.io/hostname, operator: In, values: [scale-node1]}}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {{name: data-{i}, namespace: app}}
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  volumeName: pv-{i}
  resources: {{requests: {{storage: 1Mi}}}}
---
apiVersion: replication.mover/v1alpha1
kind: VolumeReplication
metadata: {{name: vr-{i}, namespace: app}}
spec:
  volumeReplicationClass: dr
  replicationState: primary
  dataSource: {{kind: PersistentVolumeClaim, name: data-{i}}}
"#,
            path = src.join(format!("v{i}.img")).display()
        );
    }
    let nodes = [
        (
            "scale-node1".to_string(),
            "127.0.30.1".to_string(),
            String::new(),
        ),
        (
            "scale-node2".to_string(),
            "127.0.30.2".to_string(),
            peer_exports,
        ),
    ];
    let agents = start_agents(&cluster, "scale", &nodes, port);
    let mut site = Site {
        cluster,
        agents,
        port,
        image: src.join("v0.img"),
        controllers: Vec::new(),
        locator: common::agent::free_port(),
    };
    site.cluster.kubectl_ok(&["create", "namespace", "app"]);
    site.cluster.apply(&format!(
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata:\n  name: local\nprovisioner: kubernetes.io/no-provisioner\nvolumeBindingMode: Immediate\n---\napiVersion: replication.mover/v1alpha1\nkind: VolumeReplicationClass\nmetadata:\n  name: dr\nspec:\n  provisioner: kubernetes.io/no-provisioner\n  parameters:\n    schedulingInterval: {}s\n    target: agent://scale-node2@127.0.30.2:{port}\n    consistency: crash-inconsistent\n{SECRET_PARAMS}---\n{}",
        INTERVAL.as_secs(),
        peer_secret("repl-scale", None)
    ));
    let created = Instant::now();
    site.cluster.apply(&objects);
    site.start_controller("scale-controller");
    let synced = |s: &Site| {
        let out = s.cluster.kubectl_ok(&[
            "get",
            "vr",
            "-n",
            "app",
            "-o",
            "jsonpath={range .items[*]}{.status.lastSyncTime}{\"\\n\"}{end}",
        ]);
        out.lines().filter(|l| !l.is_empty()).count()
    };
    let deadline = Instant::now() + Duration::from_secs(900);
    while synced(&site) < n {
        assert!(
            Instant::now() < deadline,
            "{} of {n} VolumeReplications synced",
            synced(&site)
        );
        std::thread::sleep(Duration::from_secs(2));
    }
    eprintln!(
        "{n} VolumeReplications created and first synced in {:.0} s; CPU s: controller {:.1}, agents {:.1} + {:.1}",
        created.elapsed().as_secs_f64(),
        cpu_secs(site.controllers[0].child.id()),
        cpu_secs(site.agents[0].child.id()),
        cpu_secs(site.agents[1].child.id()),
    );

    // Steady state: count the controller's requests over two intervals, from the API
    // server's own audit log.
    let requests = |s: &Site| {
        s.cluster
            .audit(CONTROLLER_USER)
            .iter()
            .filter(|e| e["verb"] != "watch")
            .count()
    };
    let before = requests(&site);
    std::thread::sleep(2 * INTERVAL);
    let made = requests(&site) - before;
    let per_vr_per_interval = made as f64 / n as f64 / 2.0;
    let pid = site.controllers[0].child.id();
    let rss = peak_rss_mib(pid);
    let now = proc_status_mib(pid, "VmRSS:");
    let (anon, file) = (
        proc_status_mib(pid, "RssAnon:"),
        proc_status_mib(pid, "RssFile:"),
    );
    eprintln!(
        "controller RSS now {now:.0} MiB ({anon:.0} MiB anonymous, {file:.0} MiB of the binary and files), peak {rss:.0} MiB"
    );
    eprintln!(
        "{n} VolumeReplications: {made} controller requests in two intervals of {} s: {per_vr_per_interval:.2} per VR per interval; controller peak RSS {rss:.0} MiB",
        INTERVAL.as_secs()
    );
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for e in site.cluster.audit(CONTROLLER_USER).iter().skip(before) {
        let key = format!(
            "{} {} {} {}",
            e["verb"],
            e["objectRef"]["resource"],
            e["objectRef"]["subresource"],
            e["responseStatus"]["code"]
        );
        *kinds.entry(key).or_default() += 1;
    }
    let log = controller_log(&site.controllers[0]);
    let writes: Vec<_> = log.lines().filter(|l| l.contains("status write")).collect();
    assert!(
        per_vr_per_interval <= 2.0,
        "{per_vr_per_interval:.2} requests per VR per interval: {kinds:#?}\nlast status writes:\n{}",
        writes[writes.len().saturating_sub(30)..].join("\n")
    );
    // The test runs the debug build, whose code alone maps about 35 MiB more than the
    // release build the deployment runs; the bound is on what the controller holds:
    // its peak less the pages of its binary and files.
    assert!(
        rss - file <= 100.0,
        "controller peak RSS {rss:.0} MiB ({file:.0} MiB of them its binary) with {n} VolumeReplications"
    );

    // A cluster of 10,000 PVCs: 9,000 more that no VolumeReplication names (pending, no
    // volume). The controller caches them (slimmed); the Deployment's limit is 256 MiB.
    let others = n * 9;
    let mut pvcs = String::new();
    for i in 0..others {
        pvcs += &format!(
            "---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: other-{i}, namespace: app}}\nspec:\n  accessModes: [ReadWriteOnce]\n  storageClassName: none\n  resources: {{requests: {{storage: 1Gi}}}}\n"
        );
    }
    site.cluster.apply(&pvcs);
    // Its cache holds them once it has seen the last one: a reconcile of a VR reads it
    // then. Give the watch time to deliver them all.
    std::thread::sleep(Duration::from_secs(20));
    let (peak, file) = (peak_rss_mib(pid), proc_status_mib(pid, "RssFile:"));
    eprintln!(
        "with {} PVCs in the cluster: controller peak RSS {peak:.0} MiB ({file:.0} MiB of them its binary)",
        n + others
    );
    const LIMIT_MIB: f64 = 256.0; // deploy/base/controller.yaml
    assert!(
        peak <= LIMIT_MIB,
        "controller peak RSS {peak:.0} MiB with {} PVCs: over the Deployment's {LIMIT_MIB} MiB",
        n + others
    );
}
