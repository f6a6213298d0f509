//! On a real Kubernetes control plane without nodes (etcd, kube-apiserver and
//! kube-controller-manager built from their Go modules: `deploy/test-cluster/build.sh`):
//! the install and its overlays as `kubectl apply --server-side -k` takes them, the API
//! server's own validation of mover's resources, and the controller's RBAC as the real
//! authorizer lists it. None of this involves a node, so nothing here stands in for one:
//! the scenarios that do (replication, failover, populated PVCs, moves, CSI snapshots,
//! Jobs, the thousand-VR scale run) run on real nodes in `kube_nodes.rs`.
#![cfg(feature = "controller")]

mod common;

use common::cluster::Cluster;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

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
    // A VolumeReplication or VolumeMove names a PVC or StatefulSet of its own namespace:
    // there is no field for another's, and the API server refuses one.
    for (kind, yaml) in [
        (
            "VolumeReplication",
            "apiVersion: replication.mover/v1alpha1\nkind: VolumeReplication\nmetadata:\n  name: across\n  namespace: app\nspec:\n  volumeReplicationClass: mover-dr\n  replicationState: primary\n  dataSource:\n    kind: PersistentVolumeClaim\n    name: data\n    namespace: t2\n".to_string(),
        ),
        (
            "VolumeMove",
            vmove("across", "  side: Source\n  pvc: data\n  namespace: t2\n"),
        ),
    ] {
        let across = refused(&c, &yaml);
        assert!(
            across.contains(".namespace") && across.contains("not declared in schema"),
            "{kind} naming namespace t2: {across}"
        );
    }
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
    // A forced promotion is the destination's, asked for by its own field only.
    let old_style = refused(
        &c,
        &vmove(
            "old-style",
            "  side: Destination\n  pvc: a\n  timeoutSeconds: 5\n",
        ),
    );
    assert!(
        old_style.contains("must be asked for with forceAfterSeconds"),
        "{old_style}"
    );
    let forced_source = refused(
        &c,
        &vmove(
            "forced",
            "  side: Source\n  pvc: a\n  forceAfterSeconds: 5\n",
        ),
    );
    assert!(
        forced_source.contains("forceAfterSeconds is the destination's"),
        "{forced_source}"
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

/// The lines of the fenced block after `marker` in deploy/README.md, with single
/// spaces, without empty ones.
fn readme_block(marker: &str) -> Vec<String> {
    let readme = std::fs::read_to_string(repo().join("deploy/README.md")).unwrap();
    let (_, after) = readme
        .split_once(marker)
        .unwrap_or_else(|| panic!("deploy/README.md has no {marker}"));
    let block = after
        .split("```")
        .nth(1)
        .expect("a fenced block follows the marker");
    block
        .trim_start_matches("text")
        .lines()
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| !l.is_empty())
        .collect()
}

/// The rules `kubectl auth can-i --list` gives the controller in mover-system, as
/// deploy/README.md documents them (the block after `<!-- can-i mover-controller -->`).
fn documented_rules() -> Vec<String> {
    normalize(&readme_block("<!-- can-i mover-controller -->").join("\n"))
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
    // The agents' ServiceAccount may ask for certificates, and about the tokens callers
    // of their /metrics present, and nothing else.
    let agent = c.kubectl_ok(&[
        "auth",
        "can-i",
        "--list",
        "--as=system:serviceaccount:mover-system:mover-agent",
        "-n",
        "mover-system",
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
        readme_block("<!-- can-i mover-agent -->"),
        "deploy/README.md's rules of the agents:\n{agent}"
    );
}

/// The controller's ServiceAccount, as `kubectl --as` names it.
const CONTROLLER: &str = "--as=system:serviceaccount:mover-system:mover-controller";

/// Runs kubectl as the controller (impersonated: the API server authorizes and admits
/// the request as it would one made with the controller's token) with `stdin`; until
/// the admission policies are in force (they load a moment after they are applied),
/// again while the answer lacks `says`. Returns what kubectl printed.
fn as_controller(c: &Cluster, args: &[&str], stdin: Option<&str>, says: &str) -> String {
    // Before the arguments: `exec`'s end with the command.
    let args: Vec<&str> = [CONTROLLER]
        .into_iter()
        .chain(args.iter().copied())
        .collect();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let out = c.kubectl_as(&c.kubeconfig, &args, stdin);
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if printed.contains(says) {
            return printed;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "kubectl {args:?} as the controller: want {says:?}, got:\n{printed}"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
}

/// Whoever holds the controller's token (stolen from its pod, say) can do no more than
/// the controller does: the API server's admission (deploy/base/controller-admission.yaml,
/// and the hooks overlay's policy) refuses, with a message that says what the
/// controller may do, everything else its broad RBAC would let through. And what the
/// controller does make in a user's namespace passes Pod Security `restricted` and a
/// ResourceQuota.
#[test]
fn a_stolen_controller_token_can_do_no_more_than_the_controller_does() {
    let _one = serial();
    let t = tempfile::tempdir().unwrap();
    let Some(c) = Cluster::start(t.path(), "admission") else {
        return;
    };
    apply_kustomization(&c, "deploy/overlays/snapshot-hooks");
    // The user's namespace enforces `restricted`, with a quota on requests and limits.
    c.apply(
        r#"apiVersion: v1
kind: Namespace
metadata:
  name: app
  labels: {pod-security.kubernetes.io/enforce: restricted}
---
apiVersion: v1
kind: ResourceQuota
metadata: {name: quota, namespace: app}
spec:
  hard: {requests.cpu: "1", requests.memory: 1Gi, limits.cpu: "1", limits.memory: 1Gi, requests.storage: 10Gi}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: db, namespace: app}
spec:
  accessModes: [ReadWriteOnce]
  resources: {requests: {storage: 1Gi}}
---
apiVersion: v1
kind: PersistentVolume
metadata: {name: db}
spec:
  capacity: {storage: 1Gi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Delete
  hostPath: {path: /srv/db}
  claimRef: {namespace: app, name: db}
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: db, namespace: app}
spec:
  replicas: 0
  serviceName: db
  selector: {matchLabels: {app: db}}
  template:
    metadata: {labels: {app: db}}
    spec: {containers: [{name: db, image: postgres:15}]}
"#,
    );

    // What the controller makes is admitted: its reader pod (server-side dry run: the
    // same admission, nothing stored), in a namespace that enforces `restricted`.
    // The policies installed are the ones deploy/README.md lists.
    let listed = readme_block("<!-- policies mover-controller -->");
    let mut documented: Vec<&str> = listed
        .iter()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    documented.sort();
    let installed = c.kubectl_ok(&["get", "validatingadmissionpolicies", "-o", "name"]);
    let mut installed: Vec<&str> = installed
        .lines()
        .filter_map(|l| l.rsplit('/').next())
        .collect();
    installed.sort();
    assert_eq!(installed, documented, "deploy/README.md's list of policies");

    let reader =
        mover_controller::replication::csi_snapshots::reader_pod("db-mover-1", "app/db", "node-1");
    let reader = serde_json::to_string(&reader).unwrap();
    let create = ["create", "-n", "app", "--dry-run=server", "-f", "-"];
    as_controller(
        &c,
        &create,
        Some(&reader),
        "pod/db-mover-1 created (server dry run)",
    );
    // The same pod without its securityContext or its limits: Pod Security and the
    // quota refuse it (so the admission above was theirs to refuse).
    let mut bare: serde_json::Value = serde_json::from_str(&reader).unwrap();
    bare["spec"]["containers"][0]["securityContext"] =
        serde_json::json!({"allowPrivilegeEscalation": false});
    as_controller(
        &c,
        &create,
        Some(&bare.to_string()),
        "violates PodSecurity \"restricted:latest\"",
    );
    let mut unlimited: serde_json::Value = serde_json::from_str(&reader).unwrap();
    unlimited["spec"]["containers"][0]["resources"] = serde_json::json!({});
    as_controller(
        &c,
        &create,
        Some(&unlimited.to_string()),
        "failed quota: quota",
    );

    // What it never makes is refused, in every namespace.
    c.kubectl_ok(&["create", "namespace", "other"]);
    as_controller(
        &c,
        &[
            "run",
            "-n",
            "other",
            "shell",
            "--image=busybox",
            "--privileged",
        ],
        None,
        "ValidatingAdmissionPolicy 'mover-controller-pods' with binding 'mover-controller-pods' denied request: the controller creates only reader pods",
    );
    let mut host: serde_json::Value = serde_json::from_str(&reader).unwrap();
    host["metadata"]["namespace"] = "other".into();
    host["spec"]["volumes"] = serde_json::json!([{"name": "clone", "hostPath": {"path": "/"}}]);
    host["spec"]["containers"][0]
        .as_object_mut()
        .unwrap()
        .remove("volumeDevices");
    as_controller(
        &c,
        &["create", "-f", "-"],
        Some(&host.to_string()),
        "holds one volume: its clone PVC",
    );
    let mut shell: serde_json::Value = serde_json::from_str(&reader).unwrap();
    shell["metadata"]["namespace"] = "other".into();
    shell["spec"]["containers"][0]["image"] = "busybox".into();
    as_controller(
        &c,
        &["create", "-f", "-"],
        Some(&shell.to_string()),
        "runs the pause image alone",
    );
    // A PVC it did not make: not deleted, and its PV not handed to another claim nor
    // deleted.
    as_controller(
        &c,
        &["delete", "pvc", "-n", "app", "db", "--wait=false"],
        None,
        "the controller deletes only PVCs it made or marked for a move",
    );
    as_controller(
        &c,
        &[
            "patch",
            "pv",
            "db",
            "--type=merge",
            "-p",
            r#"{"spec":{"claimRef":{"namespace":"other","name":"theirs","uid":null}}}"#,
        ],
        None,
        "its claim only where a prime PVC in mover-system held it",
    );
    as_controller(
        &c,
        &["delete", "pv", "db", "--wait=false"],
        None,
        "only volumes of mover's CSI driver",
    );
    // A StatefulSet: its replicas, not its pods' image.
    let patch_db = |patch: &str, says: &str| {
        let args = [
            "patch",
            "statefulset",
            "-n",
            "app",
            "db",
            "--type=merge",
            "-p",
            patch,
        ];
        as_controller(&c, &args, None, says);
    };
    patch_db(
        r#"{"spec":{"template":{"spec":{"containers":[{"name":"db","image":"evil"}]}}}}"#,
        "the controller changes only spec.replicas",
    );
    patch_db(r#"{"spec":{"replicas":1}}"#, "statefulset.apps/db patched");
    // In mover-system: no Job as another ServiceAccount (the agents' is privileged), no
    // token Secret of another identity, no other ConfigMap.
    as_controller(
        &c,
        &["create", "-n", "mover-system", "-f", "-"],
        Some(
            r#"{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "labels": {"replication.mover/prime-for": "x"}},
                 "spec": {"template": {"spec": {"serviceAccountName": "mover-agent", "restartPolicy": "Never",
                          "containers": [{"name": "c", "image": "localhost/mover:0.1.0", "securityContext": {"allowPrivilegeEscalation": false}}]}}}}"#,
        ),
        "the controller creates only restore Jobs",
    );
    as_controller(
        &c,
        &["create", "-n", "mover-system", "-f", "-"],
        Some(
            r#"{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "mover-ca", "annotations": {"kubernetes.io/service-account.name": "mover-agent"}}, "type": "kubernetes.io/service-account-token"}"#,
        ),
        "the controller creates only its own Secret mover-ca (type Opaque)",
    );
    as_controller(
        &c,
        &["create", "configmap", "-n", "mover-system", "anything"],
        None,
        "the controller creates only its own ConfigMap",
    );
    // Exec (the hooks overlay) only in a namespace its owner opted in.
    c.apply("apiVersion: v1\nkind: Pod\nmetadata: {name: web, namespace: other}\nspec: {containers: [{name: web, image: busybox}]}\n");
    as_controller(
        &c,
        &["exec", "-n", "other", "web", "--", "true"],
        None,
        "the controller runs snapshot hooks only in namespaces labelled replication.mover/hooks=allowed, and other is not",
    );
    c.kubectl_ok(&[
        "label",
        "namespace",
        "other",
        "replication.mover/hooks=allowed",
    ]);
    // Admitted now: the exec fails further on (no node runs the pod).
    let opted_in = as_controller(
        &c,
        &["exec", "-n", "other", "web", "--", "true"],
        None,
        "error",
    );
    assert!(
        !opted_in.contains("ValidatingAdmissionPolicy"),
        "{opted_in}"
    );
}
