//! The end-to-end scenarios on real nodes: two clusters started by
//! `deploy/test-cluster/cluster.sh` (kubelet, containerd + runc, kube-proxy, the
//! scheduler; a network and mount namespace per node), mover installed exactly as the
//! README says (`kubectl apply --server-side -k deploy/base` with the image
//! `deploy/image/build.sh` made). Nothing here binds a pod or calls a CSI method: the
//! kubelet, the scheduler and the agents' pods do. The test stands in for the workload
//! only where it writes a volume's bytes from the host (the node's /mnt/disks is a
//! directory the host sees); for node pressure once: it marks a reader pod Failed
//! (Evicted) as the kubelet's eviction manager would (`evict_next_reader`); and for the
//! one network disk, attachable to either node, whose driver does not run here: it
//! plays the external-attacher and the kubelet's map of its device
//! (`a_secondary_follows_its_volume_to_the_node_it_is_attached_to`). Each place says so.
//!
//! Needs root, the binaries of `deploy/test-cluster/build.sh`, the images of
//! `deploy/test-cluster/images.sh` and `MOVER_IMAGE` (`.ci/run` provides all).
#![cfg(feature = "controller")]

mod common;

use common::populate::*;
use common::site::*;
use common::{
    MIB, blake3_of, cluster::CONTROLLER_USER, make_image, nodes::RealCluster, scribble_pages,
};
use k8s_openapi::jiff::Timestamp;
use serde_json::Value;
use std::time::Duration;

/// One test at a time: the clusters' addresses are fixed per index.
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn on_real_nodes_two_clusters_install_replicate_fail_over_and_back() {
    let _one = serial();
    let Some((east, west)) = replicating_pair(("east", 1), ("west", 2)) else {
        return;
    };

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
        // Each signed once, with no failure logged that was none (the approval's own
        // event arriving after the signature).
        let logs = s.c.logs(CONTROLLERS);
        let warned: Vec<_> = logs
            .lines()
            .filter(|l| l.contains("cannot sign") || l.contains("cannot approve"))
            .collect();
        assert!(warned.is_empty(), "{warned:#?}");
    }

    // An agent's /metrics, on its node's address: the scraper's token is let through;
    // no token, or a token whose user may not get /metrics (a tenant's), is refused
    // with what to do. /healthz stays open to the kubelet's probe.
    let agent = format!("{}:9470", east.c.node_ip(1));
    assert!(east.c.agent_metrics(1).contains("mover_"));
    let (status, says) = common::http_get_as(&agent, "/metrics", None);
    assert_eq!(status, 401, "{says}");
    assert!(says.contains("ClusterRole mover-metrics-reader"), "{says}");
    east.c.kubectl_ok(&["create", "namespace", "t1"]);
    east.c
        .kubectl_ok(&["create", "serviceaccount", "app", "-n", "t1"]);
    let tenant = east.c.kubectl_ok(&["create", "token", "app", "-n", "t1"]);
    let (status, says) = common::http_get_as(&agent, "/metrics", Some(tenant.trim()));
    assert_eq!(status, 403, "{says}");
    assert!(
        says.contains("system:serviceaccount:t1:app may not get /metrics"),
        "{says}"
    );
    let (status, says) = common::http_get_as(&agent, "/metrics", Some("forged"));
    assert_eq!(status, 401, "{says}");
    assert_eq!(common::http_get(&agent, "/healthz"), "ok\n");
    // The controller's /metrics, on its pod's address: the same check.
    let pod_ip = east.c.get(
        &["pods", "-n", "mover-system", "-l", CONTROLLERS],
        "{.items[0].status.podIP}",
    );
    let controller = format!("{pod_ip}:9471");
    let (status, says) = common::http_get_as(&controller, "/metrics", None);
    assert_eq!(status, 401, "{says}");
    let (status, says) = common::http_get_as(&controller, "/metrics", Some(tenant.trim()));
    assert_eq!(status, 403, "{says}");
    let scraper = east
        .c
        .kubectl_ok(&["create", "token", "scraper", "-n", "mover-system"]);
    let (status, says) = common::http_get_as(&controller, "/metrics", Some(scraper.trim()));
    assert_eq!(status, 200, "{says}");
    assert!(says.contains("mover_controller_reconciles_total"), "{says}");
    assert_eq!(common::http_get(&controller, "/healthz"), "ok");

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

    // Failback by delta: west's writes reach east, exactly the pages written, then the
    // roles swap back.
    let shipped_before = west.shipped();
    let pages = scribble_pages(&west.image(), 5, 25, 0..VOLUME_LEN);
    in_sync(&west, &east, "west's writes on east");
    west.set_state("secondary");
    west.wait_vr("west demoted", |s| s.completed("Demoted"));
    east.set_state("primary");
    east.wait_vr("east promoted again", |s| s.completed("Promoted"));
    assert_eq!(
        blake3_of(&east.image(), VOLUME_LEN),
        blake3_of(&west.image(), VOLUME_LEN)
    );
    let shipped = west.shipped() - shipped_before;
    assert!(
        shipped >= pages * 4096 && shipped <= pages * 4096 * 2,
        "west shipped {shipped} bytes for {pages} pages written: by delta"
    );
    readme_step_8_the_operators_view(&east);
    // Every request the controllers made was allowed by their RBAC.
    for s in [&east, &west] {
        s.assert_nothing_forbidden();
    }
    refusals_of_the_default_install(&east, &west);
    a_pvc_is_populated_from_the_other_clusters_agent(&east, &west);
    a_secondary_follows_its_volume_to_the_node_it_is_attached_to(&east, &west);
    a_ca_rotation_under_replication_keeps_its_cycles_going(&east, &west);
}

/// The mover CA of `b` rotated while `a` replicates `app/data` into it every 2 s (and
/// `app/moving` beside it), in the three steps of `mover controller rotate-ca`, with
/// `a`'s class secret given `b`'s two CAs between `begin` and `issue` and the new one
/// alone after `finish`, as an administrator does. Cycles go on through every step: the
/// longest stretch without a new cycle during the rotation is at most one interval (2 s)
/// longer than before it, measured the same way in the same run. Every agent of `b`
/// ends holding a certificate of the new CA, and an operator's certificate minted
/// before the rotation, still accepted while the retired CA is trusted, is refused
/// after `finish`: the old CA's certificates are useless.
fn a_ca_rotation_under_replication_keeps_its_cycles_going(a: &Site, b: &Site) {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    use std::time::Instant;
    let mover = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(args)
            .env("KUBECONFIG", &b.c.kubeconfig)
            .env_remove("MOVER_TOKEN")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let operator_cert = |name: &str| {
        let dir = b.c.dir().join(name);
        let (ok, says) = mover(&[
            "controller",
            "operator-cert",
            "--out",
            dir.to_str().unwrap(),
            "--valid",
            "1h",
        ]);
        assert!(ok, "operator-cert: {says}");
        dir
    };
    // `b`'s agent on node `n` asked for the relationship's status with the operator's
    // certificate in `dir`, trusting the CAs in `trust` (or the certificate's ca.crt).
    let both = b.c.dir().join("trust-both.crt");
    let status_with = |dir: &std::path::Path, trust: Option<&std::path::Path>, n: u8| {
        let file = |f: &str| dir.join(f).display().to_string();
        let ca = trust.map_or_else(|| file("ca.crt"), |t| t.display().to_string());
        mover(&[
            "replicate",
            "status",
            "app/data",
            "--json",
            "--agent",
            &b.agent_url(n),
            "--tls-ca",
            &ca,
            "--tls-cert",
            &file("tls.crt"),
            "--tls-key",
            &file("tls.key"),
        ])
    };
    let old = operator_cert("operator-before-rotation");
    let (ok, says) = status_with(&old, None, b.on);
    assert!(ok, "the operator's certificate before the rotation: {says}");
    let rotate = |step: &str, out: Option<&str>| {
        let mut args = vec!["controller", "rotate-ca", step];
        let path = out.map(|o| b.c.dir().join(o).display().to_string());
        if let Some(p) = &path {
            args.extend(["--trust-out", p.as_str()]);
        }
        let (ok, says) = mover(&args);
        assert!(ok, "rotate-ca {step}: {says}");
        eprintln!("rotate-ca {step}:\n{says}");
        path.map(|p| std::fs::read_to_string(p).unwrap())
            .unwrap_or_default()
    };
    let give_a = |ca: &str| {
        let patch = serde_json::json!({ "stringData": { "ca.crt": ca } }).to_string();
        a.c.kubectl_ok(&[
            "-n",
            "mover-system",
            "patch",
            "secret",
            "mover-dr-peer",
            "-p",
            &patch,
        ]);
    };
    let cas = |pem: &str| pem.matches("BEGIN CERTIFICATE").count();
    let old_ca = b.secret("mover-ca", "ca.crt");

    // The longest stretch without a new cycle on `a`'s VR while `during` runs.
    let stopped = AtomicBool::new(false);
    let longest_pause = |during: &dyn Fn()| {
        stopped.store(false, Relaxed);
        std::thread::scope(|scope| {
            let sampler = scope.spawn(|| {
                let (mut last, mut longest, mut cycles) = (None::<(String, Instant)>, 0f64, 0);
                while !stopped.load(Relaxed) {
                    if let Some(t) = a.vr()["status"]["lastSyncTime"].as_str() {
                        match &last {
                            Some((seen, since)) if seen == t => {
                                longest = f64::max(longest, since.elapsed().as_secs_f64())
                            }
                            _ => {
                                cycles += 1;
                                last = Some((t.to_string(), Instant::now()));
                            }
                        }
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
                (longest, cycles)
            });
            during();
            stopped.store(true, Relaxed);
            sampler.join().unwrap()
        })
    };
    let (before, cycles_before) = longest_pause(&|| std::thread::sleep(Duration::from_secs(30)));

    let started = Instant::now();
    let (during, cycles_during) = longest_pause(&|| {
        let two = rotate("begin", Some("trust-both.crt"));
        assert_eq!(cas(&two), 2, "{two}");
        assert!(
            two.contains(old_ca.trim()),
            "the current CA is still trusted"
        );
        let (ok, says) = mover(&["controller", "rotate-ca", "finish"]);
        assert!(
            !ok && says.contains("this step needs the rotation Reissuing"),
            "finish before issue: {says}"
        );
        give_a(&two);
        rotate("issue", None);
        b.c.wait(
            "every agent of b holding a certificate of the new CA",
            WAIT,
            || {
                let (ok, says) = mover(&["controller", "rotate-ca", "status"]);
                ok && says
                    .matches("a certificate of the CA that signs now")
                    .count()
                    == 2
            },
        );
        // The retired CA is still trusted: nothing is cut off mid-rotation (the client
        // trusts both CAs: the agent presents a certificate of the new one now).
        let (ok, says) = status_with(&old, Some(&both), b.on);
        assert!(
            ok,
            "the old certificate while the retired CA is trusted: {says}"
        );
        let new = rotate("finish", Some("trust-new.crt"));
        assert_eq!(cas(&new), 1, "{new}");
        assert!(
            !new.contains(old_ca.trim()),
            "the old CA is not trusted any more"
        );
        give_a(&new);
        // Cycles after the last step, with the new certificates on both ends.
        let seen = a.vr()["status"]["lastSyncTime"].clone();
        a.wait_vr("a cycle after the rotation", |s| {
            s.vr()["status"]["lastSyncTime"] != seen
        });
        std::thread::sleep(Duration::from_secs(8));
    });
    let took = started.elapsed().as_secs_f64();
    eprintln!(
        "CA rotation under replication: {took:.1} s, {cycles_during} cycles; longest stretch \
         without a new cycle {during:.1} s during it, {before:.1} s in the 30 s before \
         ({cycles_before} cycles)"
    );
    assert!(
        during <= before + 2.0 + 0.5,
        "a pause in replication longer than one interval (2 s) during the rotation: \
         {during:.1} s without a cycle, {before:.1} s before it"
    );
    assert!(cycles_during >= 5, "{cycles_during} cycles in {took:.0} s");

    // The old CA's certificates are useless; the new CA's are taken by every agent. The
    // two calls differ in the client's certificate alone (both trust both CAs).
    let new = operator_cert("operator-after-rotation");
    let (ok, says) = status_with(&new, Some(&both), b.on);
    assert!(ok, "an operator's certificate of the new CA: {says}");
    let (ok, says) = status_with(&old, Some(&both), b.on);
    assert!(
        !ok,
        "an operator's certificate of the retired CA after finish: {says}"
    );
    for n in 1..=2 {
        let (ok, says) = status_with(&new, None, n);
        assert!(
            ok || says.contains("no relationship"),
            "node {n}'s agent, with a certificate and trust of the new CA alone: {says}"
        );
        let log = agent_log(&b.c, &b.c.node(n));
        assert!(
            log.contains("asking for a certificate of the new one"),
            "node {n}: {log}"
        );
    }
    // And the data still arrives whole.
    scribble_pages(&a.image(), 13, 20, 0..VOLUME_LEN);
    in_sync(a, b, "writes after the rotation on the replica");
}

/// A secondary whose volume is a network disk, attached to node 2 of `b` and then to
/// node 1: `a`'s cycles reach it through `b`'s Locator on whichever node it is attached
/// to, and none goes to node 2 once the volume left it. `a` is primary of `app/data`
/// (its class `mover-dr` names `b`'s Locator), `b` its secondary.
///
/// Emulated here, and only here: the network disk. It must be attachable to either node;
/// no CSI driver of such a disk runs on this machine (the hostpath driver's volumes live
/// on one node, mover's own are not attachable). So the test plays the external-attacher
/// (a VolumeAttachment marked attached, [`attach`]) and the kubelet's map of the block
/// volume (the disk's one file, hard-linked where the kubelet puts a block volume's
/// device on each node, as a network disk is seen by both). The agents, the Locator and
/// the controllers are the install's pods.
fn a_secondary_follows_its_volume_to_the_node_it_is_attached_to(a: &Site, b: &Site) {
    const LEN: u64 = 32 * MIB;
    const PV: &str = "pv-moving";
    let source = a.c.disks(1).join("moving.img");
    make_image(&source, LEN, 11, &[(0, 2 * MIB), (30 * MIB, MIB)]);
    let disk = b.c.dir().join("network-disk.img");
    make_image(&disk, LEN, 0, &[]);
    for n in 1..=2 {
        let dev = b.c.dir().join(format!(
            "nodes/{}/kubelet/plugins/kubernetes.io/csi/volumeDevices/{PV}/dev",
            b.c.node(n)
        ));
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::hard_link(&disk, dev.join("pod-1")).unwrap();
    }
    let volume = |source: &str| {
        format!(
            "apiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {PV}}}\nspec:\n  capacity: {{storage: 32Mi}}\n  accessModes: [ReadWriteOnce]\n  volumeMode: Block\n  storageClassName: ''\n  persistentVolumeReclaimPolicy: Retain\n{source}---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: moving, namespace: app}}\nspec:\n  accessModes: [ReadWriteOnce]\n  volumeMode: Block\n  storageClassName: ''\n  volumeName: {PV}\n  resources: {{requests: {{storage: 32Mi}}}}\n"
        )
    };
    a.c.apply(&volume(&format!(
        "  local: {{path: /mnt/disks/moving.img}}\n  nodeAffinity:\n    required:\n      nodeSelectorTerms:\n      - matchExpressions:\n        - {{key: kubernetes.io/hostname, operator: In, values: [{}]}}\n",
        a.c.node(1)
    )));
    b.c.apply(&volume(
        "  csi: {driver: disk.example.com, volumeHandle: vol-moving}\n",
    ));
    attach(b, PV, 2);
    let vr = |state: &str| {
        format!(
            "apiVersion: replication.mover/v1alpha1\nkind: VolumeReplication\nmetadata: {{name: moving, namespace: app}}\nspec:\n  volumeReplicationClass: mover-dr\n  replicationState: {state}\n  dataSource: {{kind: PersistentVolumeClaim, name: moving}}\n"
        )
    };
    b.c.apply(&vr("secondary"));
    a.c.apply(&vr("primary"));
    // The last cycle node N of `b` applied (0: none), from its agent's state as the
    // host sees it.
    let applied = |n: u8| {
        let record = b.c.dir().join(format!(
            "nodes/{}/mover/cycles/{}/applied.json",
            b.c.node(n),
            &blake3::hash(b"app/moving").to_hex()[..32]
        ));
        std::fs::read(record)
            .ok()
            .and_then(|r| serde_json::from_slice::<Value>(&r).ok())
            .and_then(|r| r["id"].as_u64())
            .unwrap_or(0)
    };
    let equal = |what: &str| {
        let want = blake3_of(&source, LEN);
        b.c.wait(what, WAIT, || blake3_of(&disk, LEN) == want);
    };
    b.c.wait("a cycle applied on node 2", WAIT, || applied(2) > 0);
    assert_eq!(applied(1), 0, "node 1 has no part in it yet");
    equal("the volume on node 2 equal to the source");

    // The volume moves to node 1: detached from node 2, attached there.
    b.c.kubectl_ok(&[
        "delete",
        "volumeattachment",
        &format!("{PV}-{}", b.c.node(2)),
    ]);
    attach(b, PV, 1);
    scribble_pages(&source, 12, 40, 0..LEN);
    b.c.wait(
        "the relationship following the volume to node 1",
        WAIT,
        || applied(1) > 0,
    );
    let on_node2 = applied(2);
    equal("the volume on node 1 equal to the source");
    // Cycles go on, into node 1 only.
    let seen = applied(1);
    b.c.wait("two more cycles on node 1", WAIT, || applied(1) >= seen + 2);
    assert_eq!(
        applied(2),
        on_node2,
        "a cycle went to node 2 after the volume left it"
    );
    assert_eq!(blake3_of(&disk, LEN), blake3_of(&source, LEN));
}

/// A VolumeAttachment of `pv` to `s`'s node `n`, marked attached: the external-attacher's
/// part, for the one volume whose driver does not run here (see
/// [`a_secondary_follows_its_volume_to_the_node_it_is_attached_to`]).
fn attach(s: &Site, pv: &str, n: u8) {
    let node = s.c.node(n);
    let name = format!("{pv}-{node}");
    s.c.apply(
        &serde_json::json!({"apiVersion": "storage.k8s.io/v1", "kind": "VolumeAttachment",
                "metadata": {"name": name},
                "spec": {"attacher": "disk.example.com", "nodeName": node,
                         "source": {"persistentVolumeName": pv}}})
        .to_string(),
    );
    s.c.kubectl_ok(&[
        "patch",
        "volumeattachment",
        &name,
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status": {"attached": true}}"#,
    ]);
}

/// A PVC on `b` populated from a volume `a`'s agent on node 1 serves (an export of its
/// configuration, for namespace `app` and peer credential `peer`). `b`'s agent reaches
/// it with `a`'s replication token for `peer` and trusts `a`'s CA alone, both from the
/// secret the HydrationSource names (what an administrator copies between clusters),
/// once the secret's annotation lets namespace `app` use it.
/// Without the secret the agents do not trust each other's certificates: the PVC stays
/// unbound and the controller says why.
fn a_pvc_is_populated_from_the_other_clusters_agent(a: &Site, b: &Site) {
    const LEN: u64 = 64 * MIB;
    let img = a.c.disks(1).join("src.img");
    make_image(&img, LEN, 77, &[(0, 8 * MIB), (40 * MIB, 8 * MIB)]);
    add_agent_exports(
        &a.c,
        "[exports.src]\npath = \"/mnt/disks/src.img\"\nread_only = true\nnamespaces = [\"app\"]\npeer_credential = \"peer\"\n",
    );
    let populate = |name: &str, secret: &str| {
        b.c.apply(&format!(
            "apiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata: {{name: {name}, namespace: app}}\nspec:\n  agent: agent://{}@{}:7070/src\n{secret}---\n{}",
            a.c.node(1),
            a.c.node_ip(1),
            populated_pvc(name, "mover-populated", "Block", "64Mi")
        ));
        volume_pod(
            &b.c,
            name,
            2,
            true,
            "echo whole $(sha256sum /dev/v); sleep 3600",
        );
    };
    populate("plain", "");
    b.c.wait(
        "the controller saying why it cannot populate without the secret",
        WAIT,
        || {
            b.c.logs(CONTROLLERS)
                .lines()
                .any(|l| l.contains("cannot populate") && l.contains("app/plain"))
        },
    );
    assert_ne!(
        b.c.get(&["pvc/plain", "-n", "app"], "{.status.phase}"),
        "Bound"
    );
    // The class's secret lies in mover-system: naming it is not enough, its
    // administrator lets namespaces use it.
    populate(
        "peer",
        "  secretRef: {name: mover-dr-peer, namespace: mover-system}\n",
    );
    b.c.wait(
        "the controller refusing a secret not meant for namespace app",
        WAIT,
        || {
            b.c.logs(CONTROLLERS).lines().any(|l| {
                l.contains("app/peer") && l.contains("is not for HydrationSources of namespace app")
            })
        },
    );
    let annotated = std::time::Instant::now();
    b.c.kubectl_ok(&[
        "annotate",
        "secret",
        "-n",
        "mover-system",
        "mover-dr-peer",
        "replication.mover/for-namespaces=app",
    ]);
    assert_eq!(
        logged(&b.c, "peer", "whole "),
        sha256_of(&img),
        "the pod reads cluster A's volume"
    );
    eprintln!(
        "populated from another cluster's agent: read whole by its pod {:.2} s after the \
         secret was annotated (a refused PVC is looked at again every 30 s)",
        annotated.elapsed().as_secs_f64()
    );
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
    let minted = s.c.dir().join("operator");
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
        "replicate",
        "status",
        "app/data",
        "--json",
        "--agent",
        &url,
        "--tls-ca",
        &file("ca.crt"),
        "--tls-cert",
        &file("tls.crt"),
        "--tls-key",
        &file("tls.key"),
    ]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("\"role\""),
        "the agent's view with an operator's certificate: {out:?}"
    );
}

/// On the DR side, a PVC populated from the replica, used by a real pod the scheduler
/// places and the kubelet runs: the kubelet stages and publishes it through the
/// registered CSI plugin (the agent's pod), and the pod reads the cycle the fill began
/// at while the next cycles land on the replica.
fn a_pod_reads_one_cycle_of_the_replica_while_replication_goes_on(east: &Site, west: &Site) {
    let held = sha256_of(&west.image());
    // 256 KiB/s: the fill is far from done when the next cycle lands; the pod's reads
    // fetch what they need at once.
    west.c.apply(&format!(
        "{}---\napiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata: {{name: replica-copy, namespace: app}}\nspec:\n  volumeReplication: data\n  bwlimit: 256K\n---\n{}",
        common::POPULATED_STORAGE_CLASS,
        populated_pvc("replica-copy", "mover-populated", "Block", "64Mi")
    ));
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
    // The pod read everything: the fill is complete and the replica's hold released,
    // having kept what the next cycle overwrote.
    let holds = west
        .c
        .dir()
        .join(format!("nodes/{}/mover/holds", west.c.node(west.on)));
    west.c.wait("the replica's hold released", WAIT, || {
        std::fs::read_dir(&holds).map_or(0, |d| d.count()) == 0
    });
    let log = west.c.logs(AGENTS);
    assert!(
        log.lines()
            .any(|l| l.contains("hold released by its reader") && !l.contains("kept=0")),
        "the hold kept what the next cycle overwrote, and was released:\n{log}"
    );
    // A VolumeReplication that is primary here is no replica to populate from.
    east.c.apply(&format!(
        "{}---\napiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata: {{name: primary-copy, namespace: app}}\nspec:\n  volumeReplication: data\n---\n{}",
        common::POPULATED_STORAGE_CLASS,
        populated_pvc("primary-copy", "mover-populated", "Block", "64Mi")
    ));
    east.c.wait(
        "the controller refusing a primary as a replica",
        WAIT,
        || {
            east.c.logs(CONTROLLERS).lines().any(|l| {
                l.contains("app/primary-copy") && l.contains("its volume is the one in use")
            })
        },
    );
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

/// The sha256 each pod of StatefulSet `db` printed on start (`HASH  /dev/data`), by
/// ordinal, with the node it ran on.
fn pods_reads(c: &RealCluster) -> Vec<(String, String)> {
    (0..2)
        .map(|n| {
            let pod = format!("db-{n}");
            let node = c.get(&["pod", &pod, "-n", "app"], "{.spec.nodeName}");
            let out = c.kubectl(&["logs", "-n", "app", &pod]);
            let log = String::from_utf8_lossy(&out.stdout);
            (
                node,
                log.split_whitespace()
                    .next()
                    .unwrap_or_default()
                    .to_string(),
            )
        })
        .collect()
}

#[test]
fn on_real_nodes_a_stateful_sets_volumes_move_to_another_node_with_its_pods() {
    let _one = serial();
    let Some(c) = RealCluster::start("mv", 4, 2) else {
        return;
    };
    c.install("replication-token-of-mv");
    let mut want = Vec::new();
    for n in 0..2u64 {
        let image = c.disks(1).join(format!("db{n}.img"));
        make_image(
            &image,
            VOLUME_LEN,
            40 + n,
            &[(0, 3 * MIB), (20 * MIB, 5 * MIB)],
        );
        want.push(sha256_of(&image));
        local_block_device(&c, 1, &format!("db{n}"));
    }
    c.kubectl_ok(&["create", "namespace", "app"]);
    let mut yaml = format!("{}---\n", common::POPULATED_STORAGE_CLASS);
    yaml += r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: local}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: WaitForFirstConsumer
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: db, namespace: app}
spec:
  replicas: 2
  serviceName: db
  selector: {matchLabels: {app: db}}
  template:
    metadata: {labels: {app: db}}
    spec:
      terminationGracePeriodSeconds: 2
      containers:
      - name: db
        image: localhost/busybox:1
        # What it read on start, then it holds its device open, as a database would.
        command: [sh, -c, "sha256sum /dev/data; exec 3</dev/data; exec sleep 1000000"]
        volumeDevices: [{name: data, devicePath: /dev/data}]
  volumeClaimTemplates:
  - metadata: {name: data}
    spec:
      accessModes: [ReadWriteOnce]
      volumeMode: Block
      storageClassName: local
      resources: {requests: {storage: 64Mi}}
"#;
    for n in 0..2 {
        yaml += &format!(
            r#"---
apiVersion: v1
kind: PersistentVolume
metadata: {{name: pv-db-{n}}}
spec:
  capacity: {{storage: 64Mi}}
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: local
  persistentVolumeReclaimPolicy: Retain
  claimRef: {{namespace: app, name: data-db-{n}}}
  local: {{path: /mnt/disks/db{n}}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {{key: kubernetes.io/hostname, operator: In, values: [{node}]}}
"#,
            node = c.node(1)
        );
    }
    c.apply(&yaml);
    c.wait("both pods Ready on node 1", WAIT, || {
        c.get(&["sts/db", "-n", "app"], "{.status.readyReplicas}") == "2"
    });
    c.wait("both pods' reads done", WAIT, || {
        pods_reads(&c).iter().all(|(_, read)| !read.is_empty())
    });
    let before = pods_reads(&c);
    for (n, (node, read)) in before.iter().enumerate() {
        assert_eq!((node.as_str(), read), (c.node(1).as_str(), &want[n]));
    }

    // Node 1 is to be drained: nothing new goes there, and the volumes move with their
    // pods, which the controller stops (scale to 0: the kubelet ends the containers,
    // which let go of the devices) and starts again once the PVCs are made anew.
    c.kubectl_ok(&["cordon", &c.node(1)]);
    c.apply(
        "apiVersion: replication.mover/v1alpha1\nkind: VolumeMove\nmetadata:\n  name: db\n  namespace: app\nspec:\n  side: Source\n  statefulSet: db\n  storageClassName: mover-populated\n  timeoutSeconds: 120\n",
    );
    c.wait(
        "the move Completed and the StatefulSet scaled back",
        WAIT,
        || {
            c.get(
                &["volumemove/db", "-n", "app"],
                "{.status.phase} {.status.scaledBack}",
            ) == "Completed true"
        },
    );
    c.wait("both pods Ready again", WAIT, || {
        c.get(&["sts/db", "-n", "app"], "{.status.readyReplicas}") == "2"
    });
    // Ready once started: each pod's read of its volume (fetched on demand, while it
    // still arrives) may still be running.
    c.wait("both pods' reads done", WAIT, || {
        pods_reads(&c).iter().all(|(_, read)| !read.is_empty())
    });
    let after = pods_reads(&c);
    for (n, (node, read)) in after.iter().enumerate() {
        assert_eq!(
            (node.as_str(), read),
            (c.node(2).as_str(), &want[n]),
            "db-{n} runs on node 2 and reads its volume's bytes"
        );
    }
    let order = c.get(&["volumemove/db", "-n", "app"], "{.status.volumes[*].pvc}");
    assert_eq!(order, "data-db-0 data-db-1", "ordinal order");
    for n in 0..2 {
        let class = c.get(
            &["pvc", &format!("data-db-{n}"), "-n", "app"],
            "{.spec.storageClassName}",
        );
        assert_eq!(class, "mover-populated");
        assert_eq!(
            c.get(
                &["pv", &format!("pv-db-{n}")],
                "{.spec.persistentVolumeReclaimPolicy}"
            ),
            "Retain",
            "the old volume's own policy again"
        );
        // Its export, served to the fill alone, is withdrawn once the fill completed.
        let exports = c
            .dir()
            .join("nodes")
            .join(c.node(1))
            .join("mover/exports.json");
        let registered = std::fs::read_to_string(&exports).unwrap_or_default();
        assert!(
            !registered.contains(&format!("pv-db-{n}")),
            "the old volume is still exported: {registered}"
        );
    }
    // A completed move deleted: nothing to undo, and nothing holds it.
    c.kubectl_ok(&[
        "delete",
        "volumemove",
        "db",
        "-n",
        "app",
        "--wait",
        "--timeout=60s",
    ]);
    assert_eq!(c.get(&["sts/db", "-n", "app"], "{.spec.replicas}"), "2");

    // A move that fails once it has stopped the workload (to another cluster, through
    // VolumeReplications there are none of), deleted: rolled back, the StatefulSet
    // runs again with its replicas.
    c.apply(
        "apiVersion: replication.mover/v1alpha1\nkind: VolumeMove\nmetadata:\n  name: away\n  namespace: app\nspec:\n  side: Source\n  statefulSet: db\n",
    );
    c.wait("the move Failed", WAIT, || {
        c.get(&["volumemove/away", "-n", "app"], "{.status.phase}") == "Failed"
    });
    assert_eq!(c.get(&["sts/db", "-n", "app"], "{.spec.replicas}"), "0");
    c.kubectl_ok(&[
        "delete",
        "volumemove",
        "away",
        "-n",
        "app",
        "--wait",
        "--timeout=60s",
    ]);
    assert_eq!(
        c.get(
            &["sts/db", "-n", "app"],
            "{.spec.replicas} {.metadata.annotations.replication\\.mover/replicas-before-move}"
        ),
        "2 ",
        "the deleted move gave the StatefulSet its replicas back"
    );
    c.wait("both pods Ready after the rollback", WAIT, || {
        c.get(&["sts/db", "-n", "app"], "{.status.readyReplicas}") == "2"
    });
}

/// The name of the agent's pod on `node`.
fn agent_pod(c: &RealCluster, node: &str) -> String {
    c.kubectl_ok(&[
        "get",
        "pods",
        "-n",
        "mover-system",
        "-l",
        AGENTS,
        "--field-selector",
        &format!("spec.nodeName={node}"),
        "-o",
        "jsonpath={.items[0].metadata.name}",
    ])
}

/// The log of the agent on `node` (its container's current run).
fn agent_log(c: &RealCluster, node: &str) -> String {
    c.kubectl_ok(&[
        "logs",
        "-n",
        "mover-system",
        &agent_pod(c, node),
        "-c",
        "agent",
    ])
}

/// The `read=` figure of each "cycle committed" line of relationship `rel` in the logs of
/// the agent on `node`, in order: what each cycle read of the volume.
fn cycles_read(c: &RealCluster, node: &str, rel: &str) -> Vec<u64> {
    let log = agent_log(c, node);
    log.lines()
        .filter(|l| l.contains("cycle committed") && l.contains(&format!("relationship={rel}")))
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|w| w.strip_prefix("read="))
                .and_then(|n| n.parse().ok())
        })
        .collect()
}

#[test]
fn on_real_nodes_a_csi_volume_replicates_through_volume_snapshots_with_a_hook_in_its_pod() {
    let _one = serial();
    // The primary cluster: the install with the hooks' rights (the overlay), and the
    // hostpath CSI driver with its sidecars and the snapshot-controller as pods.
    let Some(mut east) = Site::start_from("east", 1, "deploy/overlays/snapshot-hooks") else {
        return;
    };
    east.c.csi_hostpath();
    let Some(mut west) = Site::start("west", 2) else {
        return;
    };
    for s in [&mut east, &mut west] {
        s.vr = "vol";
        s.class = "csi-dr";
    }
    east.c.kubectl_ok(&["create", "namespace", "app"]);
    west.c.kubectl_ok(&["create", "namespace", "app"]);
    // The workload: a pod the scheduler places (on the driver's node) on a Block PVC the
    // driver provisions; it holds its device as a database would.
    east.c.apply(
        r#"apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: vol, namespace: app}
spec:
  accessModes: [ReadWriteOnce]
  volumeMode: Block
  storageClassName: csi-hostpath
  resources: {requests: {storage: 64Mi}}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: app}
spec:
  terminationGracePeriodSeconds: 2
  containers:
  - name: db
    image: localhost/busybox:1
    command: [sh, -c, "exec sleep 1000000"]
    volumeDevices: [{name: vol, devicePath: /dev/vol}]
  volumes:
  - name: vol
    persistentVolumeClaim: {claimName: vol}
"#,
    );
    east.c.wait("the workload Running", WAIT, || {
        east.c.get(&["pod/db", "-n", "app"], "{.status.phase}") == "Running"
    });
    // From now on the namespace admits only pods of Pod Security `restricted` with
    // requests and limits (a ResourceQuota): what the controller makes there each cycle
    // (a reader pod, a clone PVC, a VolumeSnapshot) must pass. The hooks run in it, as
    // its administrator opted in.
    east.c.kubectl_ok(&[
        "label",
        "namespace",
        "app",
        "pod-security.kubernetes.io/enforce=restricted",
        "replication.mover/hooks=allowed",
    ]);
    let privileged = east.c.kubectl(&[
        "run",
        "-n",
        "app",
        "probe",
        "--image=localhost/busybox:1",
        "--privileged",
    ]);
    assert!(
        String::from_utf8_lossy(&privileged.stderr).contains("violates PodSecurity"),
        "{privileged:?}"
    );
    east.c.apply(
        "apiVersion: v1\nkind: ResourceQuota\nmetadata: {name: quota, namespace: app}\nspec:\n  hard: {requests.cpu: '1', requests.memory: 1Gi, limits.cpu: '1', limits.memory: 1Gi, requests.storage: 4Gi}\n",
    );
    let exec = |script: &str| {
        east.c
            .kubectl_ok(&["exec", "-n", "app", "db", "--", "sh", "-c", script])
    };
    exec("dd if=/dev/urandom of=/dev/vol bs=1M count=8 conv=fsync 2>/dev/null");
    exec("dd if=/dev/urandom of=/dev/vol bs=1M seek=40 count=4 conv=fsync 2>/dev/null");
    // The hook (below) stamps the sector at 16 MiB before each snapshot: the volume and
    // the replica are compared without it, since the next cycle's hook may have run.
    const MASKED: &str =
        "(dd if=$V bs=512 count=32768; dd if=$V bs=512 skip=32769) 2>/dev/null | sha256sum";
    let volume_hash = || {
        exec(&MASKED.replace("$V", "/dev/vol"))
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string()
    };

    // The DR side: a local PV of the same name (as RamenDR restores it) on west's node 1.
    let pv = east.c.get(&["pvc/vol", "-n", "app"], "{.spec.volumeName}");
    let replica = west.c.disks(1).join("vol.img");
    make_image(&replica, VOLUME_LEN, 0, &[]);
    west.c.apply(&format!(
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {{name: local}}\nprovisioner: kubernetes.io/no-provisioner\nvolumeBindingMode: Immediate\n---\n{}",
        local_block_volume(&pv, "vol", 64, "/mnt/disks/vol.img", &west.c.node(1))
    ));
    let east_locator = east.expose_locator();
    let west_locator = west.expose_locator();
    west.class_named("csi-dr", &east, &east_locator, "");
    // Before each snapshot, the class's hook runs in the workload's container (through
    // pods/exec, which the API server hands to the kubelet): it stamps a sector of the
    // volume, so the replica shows each cycle's snapshot came after it.
    east.class_named(
        "csi-dr",
        &west,
        &west_locator,
        r#"    volumeSnapshotClassName: csi-hostpath-snapclass
    preSnapshotHook: '["/bin/sh", "-c", "date +hook-%s | dd of=/dev/vol bs=512 seek=32768 conv=notrunc,fsync 2>/dev/null"]'
"#,
    );
    start_replicating(&east, &west);
    let stamped = |path: &std::path::Path| {
        let mut b = vec![0u8; 5];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(path).unwrap(),
            &mut b,
            16 * MIB,
        )
        .unwrap();
        b == b"hook-"
    };
    west.c.wait("the hook's stamp on the replica", WAIT, || {
        stamped(&replica)
    });
    let replica_hash = || {
        let out = std::process::Command::new("sh")
            .args(["-c", &MASKED.replace("$V", &replica.display().to_string())])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_string()
    };
    let want = volume_hash();
    west.c.wait("the replica equal to the volume", WAIT, || {
        replica_hash() == want
    });

    // The workload's writes: 30 scattered pages, through its own device. The next cycles
    // read the blocks the driver's SnapshotMetadata service says changed, not the volume.
    let before = cycles_read(&east.c, &east.c.node(1), "app/vol").len();
    exec(
        "for i in $(seq 1 30); do dd if=/dev/urandom of=/dev/vol bs=4096 count=1 seek=$((i * 401)) conv=notrunc 2>/dev/null; done; sync",
    );
    let written = volume_hash();
    assert_ne!(written, want);
    west.c.wait("the writes on the replica", WAIT, || {
        replica_hash() == written
    });
    east.c.wait("a cycle after the writes", WAIT, || {
        cycles_read(&east.c, &east.c.node(1), "app/vol").len() > before + 1
    });
    let reads = cycles_read(&east.c, &east.c.node(1), "app/vol");
    let last = *reads.last().unwrap();
    assert!(
        last < VOLUME_LEN / 8,
        "a cycle read {last} bytes of a {VOLUME_LEN}-byte volume: the changed blocks only ({reads:?})"
    );
    let cycles = || cycles_read(&east.c, &east.c.node(1), "app/vol");
    let controllers = || east.c.logs(CONTROLLERS);
    // What a cycle took from its snapshot's creation, and the agent's part of it (the
    // controller's log): the rest is the driver, the snapshot controller, the kubelet
    // starting the reader, and the controller's steps, each taken on a watch event.
    const STAGES: [&str; 5] = [
        "clone_at_ms",
        "reader_at_ms",
        "running_at_ms",
        "since_taken_ms",
        "agent_ms",
    ];
    let figures: Vec<Vec<f64>> = controllers()
        .lines()
        .filter(|l| l.contains("cycle from a VolumeSnapshot committed"))
        .filter_map(|l| {
            let field = |k: &str| -> Option<f64> {
                let v = l
                    .split(&format!(" {k}="))
                    .nth(1)?
                    .split_whitespace()
                    .next()?;
                Some(v.parse::<f64>().ok()? / 1000.0)
            };
            STAGES.iter().map(|k| field(k)).collect()
        })
        .collect();
    assert!(
        figures.len() >= 2,
        "the controller logs its cycles' figures"
    );
    let median = |i: usize| {
        let mut v: Vec<f64> = figures.iter().map(|f| f[i]).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    eprintln!(
        "cycles from VolumeSnapshots: {} committed; medians from the snapshot's creation \
         (to the second): clone PVC made {:.0} s, reader pod made {:.0} s, running {:.0} s, \
         cycle committed {:.1} s; the agent's part {:.2} s",
        figures.len(),
        median(0),
        median(1),
        median(2),
        median(3),
        median(4),
    );
    let in_sync_now = |what: &str| {
        let want = volume_hash();
        west.c.wait(what, WAIT, || replica_hash() == want);
    };

    // The sidecar's streams cut twice part way (a proxy on the host, between the
    // controller's pod and the sidecar's): resumed, the same replica. A cycle may start
    // while the pages are written and split them over two deltas of a few KB each, so
    // the cut comes after 2,000 bytes: either delta is long enough for both.
    let metadata = |address: &str| {
        east.c.kubectl_ok(&[
            "patch",
            "snapshotmetadataservice",
            "hostpath.csi.k8s.io",
            "--type=merge",
            "-p",
            &format!(r#"{{"spec": {{"address": "{address}"}}}}"#),
        ]);
    };
    let sidecar = east.c.get(
        &[
            "pods",
            "-n",
            "csi-hostpath",
            "-l",
            "app.kubernetes.io/name=csi-hostpathplugin",
        ],
        "{.items[0].status.podIP}",
    );
    let proxy = common::csi::CuttingProxy::between(GATEWAY, (sidecar, 50051), 2, 2000);
    metadata(&format!("{GATEWAY}:{}", proxy.port));
    let before = cycles().len();
    exec(
        "for i in $(seq 1 1500); do dd if=/dev/urandom of=/dev/vol bs=4096 count=1 seek=$((8192 + i * 2)) conv=notrunc 2>/dev/null; done; sync",
    );
    in_sync_now("1500 pages written through a cutting proxy");
    let after = cycles()[before..].to_vec();
    assert_eq!(
        proxy.cut.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "the streams were cut"
    );
    assert!(
        after.iter().sum::<u64>() <= 16 * MIB,
        "1500 pages in 12 MiB: cycles read {after:?}"
    );
    let log = controllers();
    assert!(
        log.lines()
            .any(|l| l.contains("changed blocks from SnapshotMetadata") && !l.contains("calls=1")),
        "a delta took more than one call:\n{log}"
    );

    // The service down: each cycle compares the whole volume, still exact.
    let closed = std::net::TcpListener::bind((GATEWAY, 0)).unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    metadata(&format!("{GATEWAY}:{port}"));
    let before = cycles().len();
    exec(
        "for i in $(seq 1 40); do dd if=/dev/urandom of=/dev/vol bs=4096 count=1 seek=$((12800 + i)) conv=notrunc 2>/dev/null; done; sync",
    );
    in_sync_now("40 pages written with the SnapshotMetadata service down");
    east.c.wait("a full comparison", WAIT, || {
        cycles()[before..].contains(&VOLUME_LEN)
    });
    assert!(
        controllers().contains("is unavailable after"),
        "the controller says why"
    );
    metadata("10.96.0.100:6443");
    // Up to here, nothing the controller asked was forbidden (the hooks' rights are
    // taken away next, on purpose).
    east.assert_nothing_forbidden();

    // The hook's rights taken away: the cycle fails before a snapshot, naming the
    // overlay that grants them. Given back, a hook that fails in the pod stops the
    // cycles before a snapshot too, saying so.
    let reclass = |hook: &str| {
        east.c
            .kubectl_ok(&["delete", "volumereplicationclass", "csi-dr", "--wait"]);
        east.class_named(
            "csi-dr",
            &west,
            &west_locator,
            &format!("    volumeSnapshotClassName: csi-hostpath-snapclass\n{hook}"),
        );
    };
    let hook_failed = |says: &str| east.message("Replicating").contains(says);
    let rights = common::nodes::repo().join("deploy/overlays/snapshot-hooks/hooks-rbac.yaml");
    let rights = rights.to_str().unwrap();
    // The namespace's opt-in taken back: the overlay's admission policy refuses the
    // exec, and the condition says how to opt in.
    east.c
        .kubectl_ok(&["label", "namespace", "app", "replication.mover/hooks-"]);
    east.wait_vr(
        "the hook refused where its namespace is not opted in",
        |_| hook_failed("kubectl label namespace app replication.mover/hooks=allowed"),
    );
    east.c.kubectl_ok(&[
        "label",
        "namespace",
        "app",
        "replication.mover/hooks=allowed",
    ]);
    east.c.kubectl_ok(&["delete", "-f", rights]);
    east.wait_vr("the hook refused by RBAC, naming the overlay", |_| {
        hook_failed("deploy/overlays/snapshot-hooks")
    });
    east.c.kubectl_ok(&["apply", "--server-side", "-f", rights]);
    // Its post-hook runs all the same, to undo what part of it was done.
    reclass(
        "    preSnapshotHook: '[\"/bin/sh\", \"-c\", \"exit 3\"]'\n    postSnapshotHook: '[\"touch\", \"/tmp/undone\"]'\n",
    );
    east.wait_vr("the hook failing in the workload's pod", |_| {
        hook_failed(r#"hook ["/bin/sh", "-c", "exit 3"] in pod app/db"#)
    });
    east.c
        .wait("the post-hook run after the failed pre-hook", WAIT, || {
            east.c
                .kubectl(&["exec", "-n", "app", "db", "--", "test", "-e", "/tmp/undone"])
                .status
                .success()
        });
    let snapshots = || {
        east.c
            .kubectl_ok(&["get", "volumesnapshots", "-n", "app", "-o", "name"])
    };
    let kept = snapshots();
    std::thread::sleep(Duration::from_secs(12));
    assert_eq!(snapshots(), kept, "no snapshot without its pre-hook");

    // Planned failover: east's final cycle reads a snapshot taken after the demote was
    // asked for, so west is promoted without force and holds east's last writes.
    // (Cycles again: a new lastSyncTime, not `Replicating` True, which a cycle here (a
    // reader pod started each time, 15-20 s) outlasts: 3 intervals of 2 s make it late.)
    let failed_at = east.vr()["status"]["lastSyncTime"].clone();
    reclass("");
    east.wait_vr("cycles again without the hook", |s| {
        let t = &s.vr()["status"]["lastSyncTime"];
        t.is_string() && *t != failed_at
    });
    exec(
        "dd if=/dev/urandom of=/dev/vol bs=4096 count=40 seek=5120 conv=notrunc,fsync 2>/dev/null",
    );
    let want = volume_hash();
    east.set_state("secondary");
    east.wait_vr("east demoted after a final cycle", |s| {
        s.completed("Demoted")
    });
    west.set_state("primary");
    west.wait_vr("west promoted", |s| s.completed("Promoted"));
    assert_eq!(
        replica_hash(),
        want,
        "the final cycle carried east's last writes"
    );
    let log = west.c.logs(AGENTS);
    assert!(
        log.lines().any(|l| l.contains("promoted")
            && l.contains("relationship=app/vol")
            && l.contains("force=false")),
        "promoted from the final cycle, without force:\n{log}"
    );

    // Deleting the VolumeReplication deletes its snapshots, clones and readers.
    east.c
        .kubectl_ok(&["delete", "vr", "-n", "app", "vol", "--wait=true"]);
    // NAME DELETING per line, of `kind` in app.
    let listed = |kind: &str| {
        east.c.kubectl_ok(&[
            "get",
            kind,
            "-n",
            "app",
            "-o",
            "custom-columns=NAME:.metadata.name,DELETING:.metadata.deletionTimestamp",
            "--no-headers",
        ])
    };
    let kept = |kind: &str| {
        listed(kind)
            .lines()
            .filter(|l| l.ends_with("<none>"))
            .count()
    };
    // Mover's part: every one asked to go (the workload's pod and its PVC stay).
    east.c
        .wait("the snapshots, clones and readers deleted", WAIT, || {
            kept("volumesnapshots") == 0 && kept("pods") == 1 && kept("pvc") == 1
        });
    // The CSI sidecars' part: gone for good. The external-provisioner removes its
    // finalizer from a snapshot a clone was made of once, without a retry when that
    // update conflicts, then in a sweep every 5 minutes (kubernetes-csi/
    // external-provisioner#1507); a CI run once waited past 120 s here, most likely for it.
    east.c.wait(
        "the snapshots' deletions finished",
        Duration::from_secs(360),
        || {
            listed("volumesnapshots").is_empty()
                && listed("pods").lines().count() == 1
                && listed("pvc").lines().count() == 1
        },
    );
}

#[test]
fn on_real_nodes_a_forced_failover_with_the_primary_cluster_gone_then_its_return_and_resync() {
    let _one = serial();
    let Some((north, south)) = replicating_pair(("north", 5), ("south", 6)) else {
        return;
    };
    let replicated = blake3_of(&south.image(), VOLUME_LEN);
    // The primary site loses power: every process of its cluster killed at once (its
    // control plane, kubelets, runtimes, mover's pods); its disks and etcd kept.
    north.c.stop();
    // RamenDR promotes the DR side alone: no final cycle can come, so it is forced.
    south.set_state("primary");
    south.wait_vr("south promoted without its peer", |s| {
        s.completed("Promoted")
    });
    assert_eq!(south.vr()["status"]["epoch"], 2);
    assert_eq!(
        blake3_of(&south.image(), VOLUME_LEN),
        replicated,
        "south holds the last cycle"
    );
    scribble_pages(&south.image(), 21, 40, 0..VOLUME_LEN);
    south.wait_vr(
        "south degraded, not replicating, still promoted while its peer is gone",
        |s| {
            s.condition("Replicating").0 == "False"
                && s.condition("Degraded").0 == "True"
                && s.completed("Promoted")
        },
    );
    // rpoSeconds is that of lastSyncTime when written, and written often enough to
    // follow it (30 s at most behind).
    let st = south.vr()["status"].clone();
    let last_sync: k8s_openapi::jiff::Timestamp =
        st["lastSyncTime"].as_str().unwrap().parse().unwrap();
    let behind = k8s_openapi::jiff::Timestamp::now()
        .duration_since(last_sync)
        .as_secs_f64();
    let rpo = st["rpoSeconds"].as_f64().unwrap();
    assert!(
        rpo <= behind + 1.0 && behind - rpo <= 31.0,
        "rpoSeconds {rpo} with the last sync {behind:.1} s ago: {st}"
    );

    // The old primary comes back as it was, primary in its own eyes, with writes of its
    // own: the kubelets start mover's pods again, its cycles are refused for their
    // epoch, and its VolumeReplication says it is fenced.
    scribble_pages(&north.image(), 22, 10, 0..VOLUME_LEN);
    north.c.start_again();
    north.wait_vr("north degraded and not replicating: fenced by south", |s| {
        s.condition("Degraded").0 == "True"
            && s.condition("Replicating").0 == "False"
            && s.vr()["status"]["conditions"]
                .to_string()
                .contains("Fenced")
    });
    // What to do, said in the VolumeReplication's terms (not a CLI command).
    let degraded = north.message("Degraded");
    assert!(
        degraded.contains("autoResync") && !degraded.contains("mover replicate"),
        "{degraded}"
    );
    // RamenDR makes it the secondary with autoResync: its own writes are discarded and
    // south's volume comes back to it.
    north.c.apply(
        "apiVersion: replication.mover/v1alpha1\nkind: VolumeReplication\nmetadata:\n  name: data\n  namespace: app\nspec:\n  volumeReplicationClass: mover-dr\n  replicationState: secondary\n  autoResync: true\n  dataSource:\n    kind: PersistentVolumeClaim\n    name: data\n"
    );
    in_sync(&south, &north, "north resynced from south");
    north.wait_vr("north healthy as south's secondary", |s| {
        s.vr()["status"]["state"] == "Secondary"
            && s.condition("Degraded") == ("False".into(), "Healthy".into())
    });
    south.wait_vr("south replicating again", |s| {
        s.condition("Replicating").0 == "True"
    });
}

/// The default install's agents answer only TLS, checked by name against their
/// cluster's mover CA, and refuse a wrong CA, a wrong name, an expired certificate of
/// the right CA, a peer cluster's replication token on the control API, and a peer
/// reading an export for another relationship; none of them writes anything.
fn refusals_of_the_default_install(a: &Site, b: &Site) {
    let url = a.agent_url(a.on);
    let (ca, ca_key) = a.ca();
    let (other_ca, _) = b.ca();
    let ca = ca.to_str().unwrap();
    let mover = |args: &[&str], token: &str| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(args)
            .env("MOVER_TOKEN", token)
            .output()
            .unwrap();
        match out.status.success() {
            true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
            false => Err(String::from_utf8_lossy(&out.stderr).into_owned()),
        }
    };
    let status = |url: &str, tls: &[&str], token: &str| {
        let mut args = vec!["replicate", "status", "app/data", "--json", "--agent", url];
        args.extend_from_slice(tls);
        mover(&args, token)
    };
    // Plaintext: no answer.
    let plain = format!("agent://{}:7070", a.c.node_ip(a.on));
    let e = status(&plain, &[], "").unwrap_err();
    assert!(
        !e.contains("\"role\""),
        "a plaintext client was answered: {e}"
    );
    // The peer cluster's CA does not vouch for this cluster's agents.
    let e = status(&url, &["--tls-ca", other_ca.to_str().unwrap()], "").unwrap_err();
    assert!(
        e.contains("UnknownIssuer") && e.contains("not accepted"),
        "wrong CA: {e}"
    );
    // The certificate of this node is not the other node's.
    let other = 3 - a.on;
    let wrong_name = format!("agent://{}@{}:7070", a.c.node(other), a.c.node_ip(a.on));
    let e = status(&wrong_name, &["--tls-ca", ca], "").unwrap_err();
    assert!(
        e.contains(&format!("not valid for name \"{}\"", a.c.node(other))),
        "wrong name: {e}"
    );
    // An expired certificate of the right CA: refused.
    let ca_crt = std::fs::read_to_string(ca).unwrap();
    let issuer =
        rcgen::Issuer::from_ca_cert_pem(&ca_crt, rcgen::KeyPair::from_pem(&ca_key).unwrap())
            .unwrap();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    p.subject_alt_names.push(rcgen::SanType::URI(
        transport::auth::CONTROLLER_URI.try_into().unwrap(),
    ));
    p.not_before = rcgen::date_time_ymd(2020, 1, 1);
    p.not_after = rcgen::date_time_ymd(2021, 1, 1);
    let cert = p.signed_by(&key, &issuer).unwrap();
    let dir = a.c.dir().join("expired");
    std::fs::create_dir_all(&dir).unwrap();
    let (crt, key_file) = (dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&crt, cert.pem()).unwrap();
    std::fs::write(&key_file, key.serialize_pem()).unwrap();
    let expired = [
        "--tls-ca",
        ca,
        "--tls-cert",
        crt.to_str().unwrap(),
        "--tls-key",
        key_file.to_str().unwrap(),
    ];
    let e = status(&url, &expired, "").unwrap_err();
    assert!(
        !e.contains("\"role\""),
        "an expired certificate was answered: {e}"
    );
    // This cluster's replication token (what its peer holds) may not register an
    // export, and nothing is registered.
    let exports =
        a.c.dir()
            .join(format!("nodes/{}/mover/exports.json", a.c.node(a.on)));
    let before = std::fs::read_to_string(&exports).unwrap();
    let token = a.replication_token(Some("peer"));
    let rt = tokio::runtime::Runtime::new().unwrap();
    let peer = mover::controller::agents::GrpcAgents::new(mover::remote::ConnectOptions {
        token: Some(token.clone()),
        tls_ca: Some(ca.into()),
        tls_server_name: Some(a.c.node(a.on)),
        ..Default::default()
    });
    let e = rt
        .block_on(mover::controller::agents::Agents::export(
            &peer,
            &format!("{}:7070", a.c.node_ip(a.on)),
            "stolen",
            "/etc",
            false,
            "app/data",
            None,
        ))
        .unwrap_err();
    assert_eq!(e.code, tonic::Code::PermissionDenied, "{e}");
    assert!(e.message.contains("may not call export"), "{e}");
    assert_eq!(std::fs::read_to_string(&exports).unwrap(), before);
    // A peer may read the PV only for the relationship it is registered for (shown with
    // the cluster-wide token, which acts on unbound relationships).
    let dest = a.c.dir().join("stolen.img");
    let source = format!("{url}/pv-data");
    let copy = |relationship: &str, token: &str| {
        let dest = dest.to_str().unwrap();
        let args = ["copy", &source, dest, "--relationship", relationship];
        mover(&[&args[..], &["--tls-ca", ca]].concat(), token).unwrap_err()
    };
    let wide = a.replication_token(None);
    let e = copy("other", &wide);
    assert!(
        e.contains("only to the relationship it was registered for"),
        "{e}"
    );
    // The peer's token acts only on what is bound to it: not on another relationship.
    let e = copy("other", &token);
    assert!(
        e.contains("the token of peer credential \"peer\" may not read relationship \"other\""),
        "{e}"
    );
    // Another peer cluster's token, or the cluster-wide one, may not act on a relationship
    // bound to this peer (its class secret's peer-credential): not read its PV, not see
    // its status, not locate it.
    let eu = a.replication_token(Some("eu"));
    let e = copy("app/data", &eu);
    assert!(
        e.contains(
            "the token of peer credential \"eu\" may not read relationship \"app/data\": it \
             is bound to peer credential \"peer\""
        ),
        "{e}"
    );
    let e = copy("app/data", &wide);
    assert!(e.contains("give the peer its own token"), "{e}");
    assert!(!dest.exists(), "a refused copy left {}", dest.display());
    let e = status(&url, &["--tls-ca", ca], &eu).unwrap_err();
    assert!(e.contains("may not see relationship \"app/data\""), "{e}");
    let answered = status(&url, &["--tls-ca", ca], &token).unwrap();
    assert!(
        answered.contains("\"peer_credential\":\"peer\""),
        "{answered}"
    );
    // a's Locator (the target of b's class) answers the peer's token alone.
    let locator = b.c.get(
        &["volumereplicationclass", "mover-dr"],
        "{.spec.parameters.target}",
    );
    let locate = |token: &str| {
        let remote = mover::remote::RemoteOptions {
            connect: mover::remote::ConnectOptions {
                token: Some(token.into()),
                tls_ca: Some(ca.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        rt.block_on(mover::remote::locate(&locator, "app/data", &remote))
    };
    let found = locate(&token).unwrap();
    assert_eq!(found.volume, "pv-data");
    let e = locate(&eu).unwrap_err().to_string();
    assert!(
        e.contains("the token of peer credential \"eu\" may not see relationship \"app/data\""),
        "{e}"
    );
}

/// The controller pod not holding the Lease (the install runs two).
fn standby_of(s: &Site) -> String {
    let leading = leader(s);
    controller_pods(s)
        .into_iter()
        .find(|p| *p != leading)
        .expect("a second controller replica")
}

/// The VolumeReplication's conditions as (type, status, reason, lastTransitionTime).
fn conditions(s: &Site) -> Vec<(String, String, String, String)> {
    let vr = s.vr();
    let mut all: Vec<_> = vr["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let f = |k: &str| c[k].as_str().unwrap_or("").to_string();
            (f("type"), f("status"), f("reason"), f("lastTransitionTime"))
        })
        .collect();
    all.sort();
    all
}

/// Ends the next reader pod the controller makes on `s` before it runs, as the kubelet's
/// eviction manager ends a pod under node pressure (phase Failed, reason Evicted: the
/// kubelet then stops it; this machine cannot be put under pressure on demand, and a
/// container killed after it starts races the controller's read); the pod's name.
fn evict_next_reader(s: &Site) -> String {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        // A reader waits for its clone to be provisioned (seconds): Pending, not deleted.
        let pending = s.c.get(
            &["pods", "-n", "app"],
            r#"{range .items[?(@.status.phase=="Pending")]}{.metadata.name} {.metadata.resourceVersion} {.metadata.deletionTimestamp}{"\n"}{end}"#,
        );
        let reader = pending.lines().find_map(|l| {
            let mut w = l.split_whitespace();
            let (name, version) = (w.next()?, w.next()?);
            (name.starts_with("vol-mover-") && w.next().is_none()).then_some((name, version))
        });
        if let Some((name, version)) = reader {
            // Only the pod as it was seen, still Pending: a pod the kubelet has reported
            // Running since may have been read already (the patch is then refused, 409).
            let evicted = serde_json::json!({
                "metadata": {"resourceVersion": version},
                "status": {"phase": "Failed", "reason": "Evicted",
                           "message": "The node was low on resource: memory."},
            });
            let out = s.c.kubectl(&[
                "patch",
                "pod",
                name,
                "-n",
                "app",
                "--subresource",
                "status",
                "--type",
                "merge",
                "-p",
                &evicted.to_string(),
            ]);
            if out.status.success() {
                return name.to_string();
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no reader pod made within {WAIT:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The relationship's record in the state of `s`'s agent on node `n`, as the host sees it.
fn relationship_record(s: &Site, n: u8) -> std::path::PathBuf {
    s.c.dir().join(format!(
        "nodes/{}/mover/relationships/{}.json",
        s.c.node(n),
        &blake3::hash(b"app/data").to_hex()[..32]
    ))
}

#[test]
fn on_real_nodes_the_controller_outlives_its_leaders_death_an_api_server_restart_and_nodes_down() {
    let _one = serial();
    let Some((alpha, beta)) = replicating_pair(("alpha", 7), ("beta", 8)) else {
        return;
    };
    // The install runs two controller replicas, one per node: one leads, one waits.
    let pods = alpha.c.get(
        &["pods", "-n", "mover-system", "-l", CONTROLLERS],
        "{.items[*].spec.nodeName}",
    );
    let nodes: std::collections::BTreeSet<_> = pods.split_whitespace().collect();
    assert_eq!(nodes.len(), 2, "the replicas share a node: {nodes:?}");
    let leading = leader(&alpha);
    let log = alpha
        .c
        .kubectl_ok(&["logs", "-n", "mover-system", &standby_of(&alpha)]);
    assert!(log.contains("waiting for the leader lease"), "{log}");
    let before = conditions(&alpha);

    // kill -9 the leader's process. The kubelet starts its container again at once, and
    // the pod, the Lease's holder by name, leads again without waiting for the Lease to
    // run out; a standby would have waited for that (15 s, the install's default).
    let pid =
        process_of("controller", &format!("HOSTNAME={leading}")).expect("the leader's process");
    let killed = std::time::Instant::now();
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    alpha.c.wait(
        "a controller leading again",
        Duration::from_secs(40),
        || {
            let now = leader(&alpha);
            process_of("controller", &format!("HOSTNAME={now}")).is_some_and(|p| p != pid)
                && alpha
                    .c
                    .kubectl(&["logs", "-n", "mover-system", &now])
                    .stdout
                    .windows(b"holding the leader lease".len())
                    .any(|w| w == b"holding the leader lease")
        },
    );
    let back = killed.elapsed();
    eprintln!(
        "a controller leads {:.1} s after kill -9 of the leader ({} now)",
        back.as_secs_f64(),
        leader(&alpha)
    );
    assert!(back <= Duration::from_secs(15 + 5), "{back:?}");
    let sync = alpha.vr()["status"]["lastSyncTime"].clone();
    scribble_pages(&alpha.image(), 9, 10, 0..VOLUME_LEN);
    alpha.wait_vr("lastSyncTime to advance under the new leader", |s| {
        s.vr()["status"]["lastSyncTime"] != sync
    });
    in_sync(
        &alpha,
        &beta,
        "the writes on the replica under the new leader",
    );
    assert_eq!(
        conditions(&alpha),
        before,
        "the conditions moved across the kill"
    );

    // The API server restarts (SIGKILL) while cycles run: the watches resume and the
    // status keeps up, with no more writes than cycles.
    let writes = |s: &Site| {
        s.c.audit(CONTROLLER_USER)
            .iter()
            .filter(|e| e["verb"] == "patch" && e["objectRef"]["subresource"] == "status")
            .count()
    };
    let writes_before = writes(&alpha);
    alpha.c.apiserver("stop");
    std::thread::sleep(Duration::from_secs(3));
    alpha.c.apiserver("start");
    let restarted = std::time::Instant::now();
    let sync = alpha.vr()["status"]["lastSyncTime"].clone();
    scribble_pages(&alpha.image(), 10, 10, 0..VOLUME_LEN);
    alpha.wait_vr(
        "lastSyncTime to advance after the API server restart",
        |s| s.vr()["status"]["lastSyncTime"] != sync,
    );
    std::thread::sleep(Duration::from_secs(4));
    let cycles = restarted.elapsed().as_secs() / 2 + 2;
    let written = writes(&alpha) - writes_before;
    assert!(
        written as u64 <= cycles,
        "{written} status writes for about {cycles} cycles after the restart"
    );
    assert_eq!(
        conditions(&alpha),
        before,
        "the conditions moved across the restart"
    );

    // The leader stops (SIGSTOP) as a partitioned or paused process does, past its
    // Lease: the standby takes over, and the old leader, resumed with every timer due,
    // writes nothing more. Its renew deadline (10 s after its last renewal was sent)
    // comes before the standby may take over (15 s after it saw the last renewal).
    let paused = leader(&alpha);
    let pid =
        process_of("controller", &format!("HOSTNAME={paused}")).expect("the leader's process");
    let pid = rustix::process::Pid::from_raw(pid).unwrap();
    let old_writes = |s: &Site, after: Option<Timestamp>| -> Vec<String> {
        s.c.audit(CONTROLLER_USER)
            .iter()
            .filter(|e| e["user"]["extra"]["authentication.kubernetes.io/pod-name"][0] == *paused)
            .filter(|e| !matches!(e["verb"].as_str(), Some("get" | "list" | "watch")))
            .filter(|e| {
                let at = e["requestReceivedTimestamp"]
                    .as_str()
                    .and_then(|t| t.parse().ok());
                after.is_none_or(|after| at.is_some_and(|at: Timestamp| at > after))
            })
            .map(|e| {
                format!(
                    "{} {} at {}",
                    e["verb"], e["requestURI"], e["requestReceivedTimestamp"]
                )
            })
            .collect()
    };
    assert!(
        !old_writes(&alpha, None).is_empty(),
        "the audit log names no write of the leader's pod {paused}: its requests cannot be told apart"
    );
    let restarts = |s: &Site| {
        s.c.get(
            &["pod", &paused, "-n", "mover-system"],
            "{.status.containerStatuses[0].restartCount}",
        )
    };
    let restarts_before = restarts(&alpha);
    let stopped_at = Timestamp::now();
    let stopped = std::time::Instant::now();
    rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
    alpha
        .c
        .wait("the standby leading", Duration::from_secs(40), || {
            leader(&alpha) != paused
        });
    eprintln!(
        "the standby leads {:.1} s after the leader stopped",
        stopped.elapsed().as_secs_f64()
    );
    let sync = alpha.vr()["status"]["lastSyncTime"].clone();
    scribble_pages(&alpha.image(), 11, 10, 0..VOLUME_LEN);
    alpha.wait_vr("lastSyncTime to advance under the standby", |s| {
        s.vr()["status"]["lastSyncTime"] != sync
    });
    rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
    alpha.c.wait(
        "the resumed old leader ended",
        Duration::from_secs(30),
        || restarts(&alpha) != restarts_before,
    );
    let deadline = stopped_at.checked_add(Duration::from_secs(10)).unwrap();
    let late = old_writes(&alpha, Some(deadline));
    assert!(
        late.is_empty(),
        "the old leader wrote after its renew deadline: {late:#?}"
    );
    // It ended by itself for its lost Lease (exit status 1, RunError::LostLease), not
    // killed (137).
    let ended = alpha.c.get(
        &["pod", &paused, "-n", "mover-system"],
        "{.status.containerStatuses[0].lastState.terminated.exitCode}",
    );
    assert_eq!(
        ended, "1",
        "the resumed old leader did not stop for its deadline"
    );
    assert_eq!(
        conditions(&alpha),
        before,
        "the conditions moved across the leader's pause"
    );

    // The leader's node loses power, with the primary's volume on it: the standby takes
    // over once the Lease runs out. (The leader is moved there first if it is not: its
    // pod deleted, as a rolling update does, the standby there takes over.)
    while alpha.c.get(
        &["pod", &leader(&alpha), "-n", "mover-system"],
        "{.spec.nodeName}",
    ) != alpha.c.node(alpha.on)
    {
        let was = leader(&alpha);
        alpha
            .c
            .kubectl_ok(&["delete", "pod", "-n", "mover-system", &was, "--wait=false"]);
        alpha
            .c
            .wait("another pod leading", Duration::from_secs(60), || {
                let now = leader(&alpha);
                now != was && process_of("controller", &format!("HOSTNAME={now}")).is_some()
            });
    }
    alpha.c.wait("two controller replicas Ready", WAIT, || {
        controller_pods(&alpha).len() == 2
            && alpha.c.get(
                &["deploy/mover-controller", "-n", "mover-system"],
                "{.status.readyReplicas}",
            ) == "2"
    });
    let standby = standby_of(&alpha);
    // beta's secondary loses its node at the same time. Then alpha's VolumeReplication
    // is deleted, and beta's namespace with its own in it. Each deletion finishes after
    // the grace (60 s, the install's default), a Warning event naming what was left.
    alpha.c.node_power(alpha.on, "stop");
    beta.c.node_power(beta.on, "stop");
    let lost = std::time::Instant::now();
    alpha.c.wait(
        "the standby holding the Lease",
        Duration::from_secs(40),
        || leader(&alpha) == standby,
    );
    let takeover = lost.elapsed();
    eprintln!(
        "the standby leads {:.1} s after the leader's node lost power",
        takeover.as_secs_f64()
    );
    assert!(takeover <= Duration::from_secs(15 + 5), "{takeover:?}");
    let asked = std::time::Instant::now();
    alpha
        .c
        .kubectl_ok(&["delete", "vr", "-n", "app", "data", "--wait=false"]);
    beta.c
        .kubectl_ok(&["delete", "namespace", "app", "--wait=false"]);
    let bound = Duration::from_secs(60 + 15 + 30);
    alpha.c.wait("the VolumeReplication deleted", bound, || {
        alpha.vr().is_null()
    });
    eprintln!(
        "deletion with the volume's node down: {:.1} s",
        asked.elapsed().as_secs_f64()
    );
    let events = alpha.c.kubectl_ok(&[
        "get",
        "events",
        "-n",
        "app",
        "--field-selector",
        "reason=LeftOnAgent",
        "-o",
        "json",
    ]);
    assert!(
        events.contains("relationship app/data") && events.contains("Warning"),
        "a Warning event names what was left: {events}"
    );
    beta.c.wait("namespace app deleted", bound, || {
        !beta
            .c
            .kubectl(&["get", "namespace", "app"])
            .status
            .success()
    });
    eprintln!(
        "namespace deletion with the volume's node down: {:.1} s",
        asked.elapsed().as_secs_f64()
    );

    // The nodes come back: the kubelets start the agents again and the leaders remove
    // what was left on them, and only that.
    for s in [&alpha, &beta] {
        let record = relationship_record(s, s.on);
        assert!(
            record.exists(),
            "the relationship was left: {}",
            record.display()
        );
        s.c.node_power(s.on, "start");
    }
    for s in [&alpha, &beta] {
        let record = relationship_record(s, s.on);
        s.c.wait("the leftover removed", Duration::from_secs(120), || {
            !record.exists()
        });
        let left = s.c.get(
            &["configmap/mover-controller-leftovers", "-n", "mover-system"],
            "{.data}",
        );
        assert!(
            left.is_empty() || left == "{}",
            "the record is emptied: {left}"
        );
        assert!(s.image().exists(), "the volume itself is kept");
    }
}

/// A VolumeMove `name` of `app/data`, this cluster's `side` of it, with `more` (YAML
/// lines of its spec).
fn volume_move(s: &Site, name: &str, side: &str, more: &str) {
    s.c.apply(&format!(
        "apiVersion: replication.mover/v1alpha1\nkind: VolumeMove\nmetadata:\n  name: {name}\n  namespace: app\nspec:\n  side: {side}\n  pvc: data\n{more}"
    ));
}

/// The status of VolumeMove `name` in `app`.
fn move_status(s: &Site, name: &str) -> Value {
    let out =
        s.c.kubectl(&["get", "volumemove", name, "-n", "app", "-o", "json"]);
    serde_json::from_slice::<Value>(&out.stdout).unwrap_or(Value::Null)["status"].clone()
}

/// Moves of a PostgreSQL volume between two clusters, each cluster's half a VolumeMove.
///
/// Planned: pgbench writes in a pod on A; A's move deletes the pod (the kubelet stops
/// it: pgbench, then PostgreSQL), waits until A's agent sees nothing holding the volume
/// and demotes; B's move promotes once the final cycle is applied. PostgreSQL in a pod
/// on B then holds every transaction committed on A, each whole. Both PVs are `Retain`
/// while the move runs and the user's `Delete` after.
///
/// Fenced: the database now on B and writing, B's agent stops answering (SIGSTOP). A's
/// move waits for a final cycle and says so, never forcing on its own; asked to
/// (`forceAfterSeconds: 5`), it promotes by force and says `fenced`. When B's
/// agent runs again its cycles (the late writes) are refused for their stale epoch: A's
/// agent logs and counts each, and A's volume is unchanged.
#[test]
fn on_real_nodes_a_postgres_volume_moves_between_clusters_planned_then_with_its_old_owner_fenced() {
    const LEN: u64 = 192 * MIB;
    let _one = serial();
    let Some(a) = Site::start("pga", 9) else {
        return;
    };
    let mut b = Site::start("pgb", 3).unwrap();
    b.on = 2;
    for s in [&a, &b] {
        s.database_volume(LEN);
        // The user's policy, which the moves keep at Retain while they run.
        s.c.kubectl_ok(&[
            "patch",
            "pv",
            "pv-data",
            "-p",
            r#"{"spec":{"persistentVolumeReclaimPolicy":"Delete"}}"#,
        ]);
    }
    replicating_live(&a, &b);

    // The database on A, written by pgbench.
    db_start(&a, "data");
    db_load(&a);
    let synced = a.vr()["status"]["lastSyncTime"].clone();
    a.wait_vr("a cycle of the loaded database", |s| {
        s.vr()["status"]["lastSyncTime"] != synced
    });

    // The planned move; both PVs' policies sampled while it runs.
    let moving = std::time::Instant::now();
    volume_move(&a, "to-b", "Source", "  timeoutSeconds: 120\n");
    volume_move(&b, "from-a", "Destination", "");
    let reclaim = |s: &Site| {
        s.c.get(&["pv/pv-data"], "{.spec.persistentVolumeReclaimPolicy}")
    };
    // Each side's policy while its own half runs (B's half may end before A's says so),
    // read between two reads of that half's phase: a policy read after the half had
    // begun (past Pending, its PV set Retain) and before it completed.
    let mut while_moving = Vec::new();
    let halves = [("A", &a, "to-b"), ("B", &b, "from-a")];
    a.c.wait(
        "B's half of the move Completed",
        Duration::from_secs(240),
        || {
            for (side, s, name) in halves {
                let phase = move_status(s, name)["phase"].clone();
                if !phase.is_string() || phase == "Completed" {
                    continue;
                }
                let policy = reclaim(s);
                if move_status(s, name)["phase"] != "Completed" {
                    while_moving.push((side, phase.to_string(), policy));
                }
            }
            move_status(&b, "from-a")["phase"] == "Completed"
        },
    );
    let downtime = moving.elapsed();
    a.c.wait("A's half of the move Completed", WAIT, || {
        move_status(&a, "to-b")["phase"] == "Completed"
    });
    let (ma, mb) = (move_status(&a, "to-b"), move_status(&b, "from-a"));
    eprintln!(
        "planned move: {:.1} s from the moves' creation to B owning the volume\nA: {ma}\nB: {mb}\nwhile moving (side, phase, its PV's policy): {while_moving:?}",
        downtime.as_secs_f64()
    );
    assert!(!while_moving.is_empty(), "the move was seen running");
    for (side, phase, policy) in &while_moving {
        if phase != "\"Pending\"" {
            assert_eq!(policy, "Retain", "{side} {phase}: Retain while moving");
        }
    }
    assert_eq!(mb["fenced"], false, "{mb}");
    assert_eq!(mb["volumes"][0]["epoch"], 2, "{mb}");
    assert!(ma["volumes"][0]["releasedTime"].is_string(), "{ma}");
    assert_eq!(a.vr()["status"]["state"], "Secondary");
    assert!(
        !a.c.kubectl(&["get", "pod", "db", "-n", "app"])
            .status
            .success(),
        "the move deleted A's database pod"
    );
    for s in [&a, &b] {
        assert_eq!(
            reclaim(s),
            "Delete",
            "{}: the user's policy again",
            s.c.name
        );
    }
    let committed: i64 = std::fs::read_to_string(a.c.disks(1).join("out/committed"))
        .expect("A's database wrote its count as it stopped")
        .trim()
        .parse()
        .unwrap();
    assert!(committed > 0, "pgbench committed on A");

    // The database on B holds every transaction committed on A, each whole.
    db_start(&b, "data");
    assert_eq!(
        db_history(&b),
        committed,
        "every committed transaction moved"
    );
    common::pg::assert_transactions_whole_by(
        |sql| db_sql(&b, sql),
        |program, args| {
            db_run(&b, program, args);
        },
    );
    eprintln!("{committed} committed transactions on A, all of them on B");

    // The database writes on B; then B's agent stops answering.
    db_load(&b);
    let synced = b.vr()["status"]["lastSyncTime"].clone();
    b.wait_vr("a cycle of B's applied at A", |s| {
        let t = &s.vr()["status"]["lastSyncTime"];
        t.is_string() && *t != synced
    });
    let b_agent = process_of("agent", &format!("NODE_NAME={}", b.c.node(2)))
        .and_then(rustix::process::Pid::from_raw)
        .expect("B's agent's process");
    use rustix::process::{Signal, kill_process};
    kill_process(b_agent, Signal::STOP).unwrap();
    // Without forceAfterSeconds the move never forces: it waits, and says so.
    volume_move(&a, "back-to-a", "Destination", "");
    a.c.wait("the move waiting for the final cycle", WAIT, || {
        move_status(&a, "back-to-a")["volumes"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("as long as it takes"))
    });
    std::thread::sleep(Duration::from_secs(8));
    let waiting = move_status(&a, "back-to-a");
    assert_eq!(waiting["volumes"][0]["phase"], "Waiting", "{waiting}");
    assert_eq!(a.vr()["spec"]["replicationState"], "secondary");
    // Asked for, it promotes by force 5 s after the move started: at once by now.
    volume_move(&a, "back-to-a", "Destination", "  forceAfterSeconds: 5\n");
    a.c.wait("A owning the volume, its old owner fenced", WAIT, || {
        move_status(&a, "back-to-a")["phase"] == "Completed"
    });
    let back = move_status(&a, "back-to-a");
    assert_eq!(back["fenced"], true, "{back}");
    assert_eq!(back["volumes"][0]["epoch"], 3, "{back}");
    assert!(
        back["volumes"][0]["message"]
            .as_str()
            .is_some_and(|m| m.contains("old owner is fenced")),
        "{back}"
    );
    let owned = blake3_of(&a.image(), LEN);
    let refusals = || -> u64 {
        a.c.agent_metrics(1)
            .lines()
            .find_map(|l| l.strip_prefix("mover_agent_stale_epoch_refusals_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0) as u64
    };
    let before = refusals();
    // (The kubelet may have restarted it meanwhile, its liveness probe unanswered: the
    // new process ships B's late writes just the same.)
    let _ = kill_process(b_agent, Signal::CONT);
    a.c.wait("B's late writes refused at A", WAIT, || refusals() > before);
    let log = agent_log(&a.c, &a.c.node(1));
    assert!(
        log.contains("write refused: stale fencing epoch")
            && log.contains("given=2")
            && log.contains("highest=3"),
        "A's agent log says why:\n{log}"
    );
    assert_eq!(
        blake3_of(&a.image(), LEN),
        owned,
        "nothing of B's landed on A"
    );
    for s in [&a, &b] {
        s.assert_nothing_forbidden();
    }
}

/// PostgreSQL under pgbench in a pod on a Block PVC of the hostpath CSI driver, its ext4
/// mounted inside the pod (where the node cannot see it, so the agent cannot freeze it):
/// the class's hooks freeze it (`fsfreeze -f` before each VolumeSnapshot, `-u` once the
/// driver has cut it), cycles run every 2 s under the load, and the DR cluster promoted
/// by force opens the last applied cycle as a database: its ext4 clean, every
/// transaction in it whole, none the primary had not committed.
#[test]
fn on_real_nodes_pgbench_in_a_csi_block_volume_replicates_through_snapshots_its_hooks_freeze() {
    const SCALE: i64 = 2;
    const LEN: u64 = 256 * MIB;
    let _one = serial();
    let Some(mut east) = Site::start_from("east", 1, "deploy/overlays/snapshot-hooks") else {
        return;
    };
    east.c.csi_hostpath();
    let mut west = Site::start("west", 2).unwrap();
    for s in [&mut east, &mut west] {
        s.vr = "vol";
        s.class = "csi-dr";
        s.c.import_test_image("postgres");
        s.c.kubectl_ok(&["create", "namespace", "app"]);
    }
    // The hooks run only in a namespace an administrator opted in.
    east.c.kubectl_ok(&[
        "label",
        "namespace",
        "app",
        "replication.mover/hooks=allowed",
    ]);
    east.c.apply(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: vol, namespace: app}\nspec:\n  accessModes: [ReadWriteOnce]\n  volumeMode: Block\n  storageClassName: csi-hostpath\n  resources: {requests: {storage: 256Mi}}\n",
    );
    db_start(&east, "vol");

    // The DR side: a local PV of the same name (as RamenDR restores it) on west's node 1,
    // a device node as in the move test (the database's pod there is privileged too).
    let pv = east.c.get(&["pvc/vol", "-n", "app"], "{.spec.volumeName}");
    let replica = west.c.disks(1).join("vol.img");
    make_image(&replica, LEN, 0, &[]);
    local_block_device(&west.c, 1, "vol");
    west.c.apply(&format!(
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {{name: local}}\nprovisioner: kubernetes.io/no-provisioner\nvolumeBindingMode: Immediate\n---\napiVersion: v1\nkind: PersistentVolume\nmetadata: {{name: {pv}}}\nspec:\n  capacity: {{storage: 256Mi}}\n  accessModes: [ReadWriteOnce]\n  volumeMode: Block\n  storageClassName: local\n  persistentVolumeReclaimPolicy: Retain\n  local: {{path: /mnt/disks/vol}}\n  nodeAffinity:\n    required:\n      nodeSelectorTerms:\n      - matchExpressions:\n        - {{key: kubernetes.io/hostname, operator: In, values: [{node}]}}\n---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: vol, namespace: app}}\nspec:\n  accessModes: [ReadWriteOnce]\n  volumeMode: Block\n  storageClassName: local\n  volumeName: {pv}\n  resources: {{requests: {{storage: 256Mi}}}}\n",
        node = west.c.node(1)
    ));
    let (east_locator, west_locator) = (east.expose_locator(), west.expose_locator());
    west.class_named("csi-dr", &east, &east_locator, "");
    let hooked = |extra: &str| {
        east.class_named(
            "csi-dr",
            &west,
            &west_locator,
            &format!(
                r#"    volumeSnapshotClassName: csi-hostpath-snapclass
    preSnapshotHook: '["fsfreeze", "-f", "/pg"]'
    postSnapshotHook: '["fsfreeze", "-u", "/pg"]'
{extra}"#
            ),
        )
    };
    hooked("");
    start_replicating(&east, &west);

    // The load, with a cycle due every 2 s: each a snapshot cut with the ext4 frozen.
    const LOAD: Duration = Duration::from_secs(60);
    let before_load = east.vr()["status"]["lastSyncTime"].clone();
    db_load(&east);
    let load = std::time::Instant::now();
    let mut synced = std::collections::BTreeSet::new();
    while load.elapsed() < LOAD {
        let t = east.vr()["status"]["lastSyncTime"].clone();
        if t.is_string() && t != before_load {
            synced.insert(t.as_str().unwrap_or_default().to_string());
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let during = db_history(&east);
    eprintln!(
        "{} cycles while pgbench ran {} s ({during} transactions): {synced:?}",
        synced.len(),
        LOAD.as_secs()
    );
    // A cycle is a hook, a snapshot, a clone, its reader pod started by the kubelet, the
    // delta: about 16 s here (the reader pod's start the most of it) on two cores that
    // also run both clusters and the database, so 3 or 4 in the minute.
    assert!(
        synced.len() >= 2,
        "cycles due every 2 s under load: {synced:?}\n{}",
        east.c.logs(CONTROLLERS)
    );
    let log = east.c.logs(CONTROLLERS);
    let (pre, post) = (
        log.matches("pre-snapshot hook ran").count(),
        log.matches("post-snapshot hook ran").count(),
    );
    assert!(
        pre > synced.len() && post >= pre - 1,
        "every freeze undone: {pre} pre, {post} post"
    );
    // A post-hook that failed is a warning naming it ("post-snapshot hook [...] in pod").
    assert!(!log.contains("post-snapshot hook ["), "{log}");

    // A snapshot the driver does not cut within freezeTimeout: deleted, the cycle failed
    // and said so, the post-hook run all the same (the database writes on).
    let reclass = |extra: &str| {
        east.c
            .kubectl_ok(&["delete", "volumereplicationclass", "csi-dr", "--wait"]);
        hooked(extra);
    };
    reclass("    freezeTimeout: 1ms\n");
    east.wait_vr("a cycle failed for a snapshot not cut in time", |s| {
        let m = s.message("Replicating");
        m.contains("freezeTimeout 1ms") && m.contains("pre-snapshot hook left it")
    });
    let before = db_history(&east);
    east.c.wait("pgbench writing, thawed", WAIT, || {
        db_history(&east) > before
    });
    let failed_at = east.vr()["status"]["lastSyncTime"].clone();
    reclass("");
    // (Not `Degraded` False: a cycle here takes longer than the 3 intervals of 2 s after
    // which the condition says the relationship is behind.)
    east.wait_vr("cycles again", |s| {
        let t = &s.vr()["status"]["lastSyncTime"];
        t.is_string() && *t != failed_at
    });

    // A reader pod that ended before it ran (evicted) never runs again: the controller
    // makes it anew and the cycles go on. (Its line need not say "Evicted": the kubelet,
    // seeing a terminal phase it did not set, may write the pod's status again without
    // the reason before the controller looks.)
    let evicted = evict_next_reader(&east);
    east.wait_vr(&format!("the evicted reader {evicted} made again"), |s| {
        s.c.logs(CONTROLLERS).lines().any(|l| {
            l.contains("reader pod ended before it was read")
                && l.contains(&format!("app/{evicted}"))
                && l.contains("Failed")
        })
    });
    let remade_at = east.vr()["status"]["lastSyncTime"].clone();
    east.wait_vr("a cycle after the reader was made again", |s| {
        s.vr()["status"]["lastSyncTime"] != remade_at
    });

    // Disaster recovery: west promoted by force from its last applied cycle.
    west.set_state("primary");
    west.wait_vr("west promoted", |s| s.completed("Promoted"));
    let written = db_history(&east);
    // Frozen around each snapshot: clean, its journal flushed.
    common::pg::assert_ext4_clean(&replica);
    db_start(&west, "vol");
    assert_eq!(
        db_sql(&west, "select count(*) from pgbench_accounts"),
        (SCALE * 100_000).to_string()
    );
    let history = db_history(&west);
    assert!(
        0 < history && history <= written,
        "{history} transactions on the replica, {written} on the primary"
    );
    common::pg::assert_transactions_whole_by(
        |sql| db_sql(&west, sql),
        |program, args| {
            db_run(&west, program, args);
        },
    );
    eprintln!("{history} of {written} transactions on the replica, all whole");
    east.assert_nothing_forbidden();
}

/// The SHA-256 of `count` MiB of `path` from MiB `skip` on.
fn sha256_of_mib(path: &std::path::Path, skip: u64, count: u64) -> String {
    first_word_of(std::process::Command::new("sh").arg("-c").arg(format!(
        "dd if='{}' bs=1M skip={skip} count={count} status=none | sha256sum",
        path.display()
    )))
}

/// The word after `prefix` in pod `app/NAME`'s log, once it is there.
fn logged(c: &RealCluster, pod: &str, prefix: &str) -> String {
    let line = log_line(c, pod, prefix);
    line[prefix.len()..]
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn on_real_nodes_populated_pvcs_are_bound_at_once_and_their_pods_read_the_sources_while_they_arrive()
 {
    let _one = serial();
    let Some(c) = RealCluster::start("pop", 9, 2) else {
        return;
    };
    c.install("replication-token-of-pop");
    c.kubectl_ok(&["create", "namespace", "app"]);
    c.apply(common::POPULATED_STORAGE_CLASS);
    // The same class keeping its volumes (the other one's policy is Kubernetes'
    // default, Delete).
    c.apply(&format!(
        "{}reclaimPolicy: Retain\n",
        common::POPULATED_STORAGE_CLASS
            .replace("name: mover-populated", "name: mover-populated-retain")
    ));
    // The sources, on node 1's disk: data at both ends, a hole between for the big ones.
    let sources: [(&str, u64); 3] = [("small", 64 * MIB), ("four-gib", 4 << 30), ("tib", 1 << 40)];
    let mut exports = String::new();
    for (name, len) in sources {
        let data = (8 * MIB).min(len / 2);
        let img = c.disks(1).join(format!("{name}.img"));
        make_image(&img, len, len % 97, &[(0, data), (len - data, data)]);
        exports += &format!(
            "[exports.{name}]\npath = \"/mnt/disks/{name}.img\"\nread_only = true\nnamespaces = [\"app\"]\n"
        );
    }
    // An ext4 volume of files, for a Filesystem PVC.
    let t = tempfile::tempdir().unwrap();
    let tree = t.path().join("tree");
    common::csi::source_tree(&tree);
    let files_img = c.disks(1).join("files.img");
    let made = std::process::Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&tree)
        .arg(&files_img)
        .arg("256M")
        .output()
        .unwrap();
    assert!(made.status.success(), "mkfs.ext4 -d: {made:?}");
    exports += "[exports.files]\npath = \"/mnt/disks/files.img\"\nread_only = true\nnamespaces = [\"app\"]\n";
    add_agent_exports(&c, &exports);
    let source = |name: &str| {
        format!(
            "apiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata: {{name: {name}, namespace: app}}\nspec:\n  agent: agent://{}@{}:7070/{name}\n  bwlimit: 2M\n",
            c.node(1),
            c.node_ip(1)
        )
    };

    // A tenant of another namespace naming the same volume: the agents' configuration
    // lets only namespace app fill PVCs from it, so the fill is refused, saying so, and
    // the PVC stays unbound.
    c.kubectl_ok(&["create", "namespace", "t2"]);
    c.apply(&format!(
        "apiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata: {{name: stolen, namespace: t2}}\nspec:\n  agent: agent://{}@{}:7070/files\n---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: stolen, namespace: t2}}\nspec:\n  accessModes: [ReadWriteOnce]\n  storageClassName: mover-populated\n  resources: {{requests: {{storage: 256Mi}}}}\n  dataSourceRef: {{apiGroup: replication.mover, kind: HydrationSource, name: stolen}}\n---\napiVersion: v1\nkind: Pod\nmetadata: {{name: stolen, namespace: t2}}\nspec:\n  nodeSelector: {{kubernetes.io/hostname: {}}}\n  containers: [{{name: c, image: localhost/busybox:1, command: [sleep, '3600'], volumeMounts: [{{name: v, mountPath: /v}}]}}]\n  volumes: [{{name: v, persistentVolumeClaim: {{claimName: stolen}}}}]\n",
        c.node(1),
        c.node_ip(1),
        c.node(2),
    ));
    c.wait("the fill for namespace t2 refused", WAIT, || {
        c.logs(CONTROLLERS).lines().any(|l| {
            l.contains("t2/stolen")
                && l.contains("is not for HydrationSources of namespace")
                && l.contains("exports.files.namespaces")
        })
    });
    assert_ne!(
        c.get(&["pvc", "stolen", "-n", "t2"], "{.status.phase}"),
        "Bound"
    );

    // Block PVCs used by pods on node 2, at 2 MiB/s: each pod reads its device's last
    // MiB (a region the fill reaches last), then waits.
    for (name, len) in sources {
        let last = len / MIB - 1;
        let created = std::time::Instant::now();
        let (class, policy) = match name {
            "four-gib" => ("mover-populated-retain", "Retain"),
            _ => ("mover-populated", "Delete"),
        };
        c.apply(&format!(
            "{}---\n{}",
            source(name),
            populated_pvc(name, class, "Block", &len.to_string())
        ));
        volume_pod(
            &c,
            name,
            2,
            true,
            &format!("echo last $(dd if=/dev/v bs=1M skip={last} count=1 | sha256sum); sleep 3600"),
        );
        c.wait("the populated PVC bound", WAIT, || {
            c.get(&["pvc", name, "-n", "app"], "{.status.phase}") == "Bound"
        });
        let bound = created.elapsed();
        let read = logged(&c, name, "last ");
        let readable = created.elapsed();
        let src = c.disks(1).join(format!("{name}.img"));
        assert_eq!(
            read,
            sha256_of_mib(&src, last, 1),
            "{name}: the pod's last MiB is the source's"
        );
        let pv = c.get(&["pvc", name, "-n", "app"], "{.spec.volumeName}");
        assert_eq!(
            c.get(
                &["pv", &pv],
                "{.spec.csi.driver} {.spec.persistentVolumeReclaimPolicy} {.spec.csi.volumeHandle}"
            ),
            format!("csi.replication.mover {policy} {pv}")
        );
        eprintln!(
            "populated PVC of {} MiB: bound {:.2} s after its creation, its pod's read of the last MiB done {:.2} s after",
            len / MIB,
            bound.as_secs_f64(),
            readable.as_secs_f64()
        );
        if name == "small" {
            a_populated_pods_io_goes_on_across_its_agents_kill_and_upgrade(&c, &src);
        }
        c.kubectl_ok(&["delete", "pod", name, "-n", "app", "--wait"]);
        a_populated_volume_ends_as_its_class_says(&c, name, &pv, policy);
    }

    // A Filesystem PVC of an ext4 source: mounted while its regions still arrive, every
    // file read through the pod's path as the source has it.
    let created = std::time::Instant::now();
    c.apply(&format!(
        "{}---\n{}",
        source("files"),
        populated_pvc("files", "mover-populated", "Filesystem", "256Mi")
    ));
    volume_pod(
        &c,
        "files",
        2,
        false,
        "cd /data && find . -type f | sort | while read f; do echo \"file $(sha256sum \"$f\")\"; done; echo done; sleep 3600",
    );
    log_line(&c, "files", "done");
    let read = created.elapsed();
    let log = c.kubectl_ok(&["logs", "-n", "app", "files"]);
    let seen: std::collections::BTreeMap<String, String> = log
        .lines()
        .filter_map(|l| {
            let mut w = l.strip_prefix("file ")?.split_whitespace();
            let hash = w.next()?.to_string();
            Some((w.next()?.trim_start_matches("./").to_string(), hash))
        })
        .collect();
    let want: std::collections::BTreeMap<String, String> = seen
        .keys()
        .map(|rel| (rel.clone(), sha256_of(&tree.join(rel))))
        .collect();
    assert_eq!(seen.len(), 8, "the pod read every file: {log}");
    assert_eq!(seen, want, "a file read through the populated PVC differs");
    eprintln!(
        "populated Filesystem PVC of 256 MiB: mounted and every file read {:.2} s after its creation",
        read.as_secs_f64()
    );
    c.kubectl_ok(&["delete", "pod", "files", "-n", "app", "--wait"]);

    populated_from_a_snapshot_in_s3(&c, t.path());
}

/// The PVC `name` (its pod gone) deleted: with policy Delete its PV and its volume on
/// node 2 (image, fill, export) go, the 1 TiB one's mid-fill; with Retain both stay
/// until the PV is deleted by hand, and then the image still stays. Its
/// HydrationSource's deletion then leaves nothing held.
fn a_populated_volume_ends_as_its_class_says(c: &RealCluster, name: &str, pv: &str, policy: &str) {
    let state = c.dir().join("nodes").join(c.node(2)).join("mover");
    let image = state.join(format!("volumes/{pv}.img"));
    assert!(image.exists(), "{name}: no image at {}", image.display());
    let registered = || std::fs::read_to_string(state.join("exports.json")).unwrap_or_default();
    assert!(registered().contains(pv), "{name}: {pv} is not registered");
    if name == "tib" {
        assert!(
            state.join(format!("hydrate/{pv}.json")).exists(),
            "{name}: its fill should still be under way"
        );
    }
    c.kubectl_ok(&["delete", "pvc", name, "-n", "app", "--wait"]);
    let gone = |what: &[&str]| {
        let out = c.kubectl(&[&["get"], what, &["--ignore-not-found", "-o", "name"]].concat());
        out.status.success() && out.stdout.is_empty()
    };
    if policy == "Delete" {
        c.wait(&format!("{name}: its released PV deleted"), WAIT, || {
            gone(&["pv", pv])
        });
        assert!(
            !image.exists(),
            "{name}: the image of a deleted volume is still there"
        );
        assert!(
            !registered().contains(pv),
            "{name}: {pv} is still registered"
        );
        assert!(
            !state.join(format!("hydrate/{pv}.json")).exists(),
            "{name}: its fill is still recorded"
        );
    } else {
        c.wait(&format!("{name}: its PV Released"), WAIT, || {
            c.get(&["pv", pv], "{.status.phase}") == "Released"
        });
        std::thread::sleep(Duration::from_secs(3));
        assert!(
            image.exists(),
            "{name}: a Retain volume's image was removed"
        );
        c.kubectl_ok(&["delete", "pv", pv, "--wait"]);
        assert!(
            image.exists(),
            "{name}: a Retain volume's image was removed with its PV"
        );
    }
    c.kubectl_ok(&["delete", "hydrationsource", name, "-n", "app", "--wait"]);
}

/// Node 2's agent killed (kill -9), then upgraded (a rolling update of the agents'
/// DaemonSet: a new pod, a new process), while the pod of the PVC `small` reads its whole
/// device again and again past every cache. The fd store keeps the device's FUSE
/// connection, so the pod only pauses: no read fails, each is the source's, and the
/// same pod (not a new one) goes on after both.
fn a_populated_pods_io_goes_on_across_its_agents_kill_and_upgrade(
    c: &RealCluster,
    src: &std::path::Path,
) {
    let node = c.node(2);
    let want = sha256_of(src);
    let pod_uid = c.get(&["pod", "small", "-n", "app"], "{.metadata.uid}");
    let script = "set -o pipefail; rm -f /tmp/stop; n=0; \
        while [ ! -e /tmp/stop ]; do \
          s=$(date +%s); h=$(dd if=/dev/v bs=1M iflag=direct 2>/dev/null | sha256sum) \
            || { echo failed after $n reads; exit 1; }; \
          n=$((n+1)); echo read $(( $(date +%s) - s )) $h; \
        done; echo done $n";
    let agent = process_of("agent", &format!("NODE_NAME={node}")).expect("node 2's agent process");
    let (log, killed_for) = std::thread::scope(|scope| {
        let reads =
            scope.spawn(|| c.kubectl(&["exec", "-n", "app", "small", "--", "sh", "-c", script]));
        std::thread::sleep(Duration::from_secs(3));
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(agent).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
        let killed = std::time::Instant::now();
        c.wait("node 2's agent started again and Ready", WAIT, || {
            process_of("agent", &format!("NODE_NAME={node}")).is_some_and(|p| p != agent)
                && c.get(
                    &["ds/mover-agent", "-n", "mover-system"],
                    "{.status.numberReady}",
                ) == "2"
        });
        let killed_for = killed.elapsed();
        assert!(
            agent_log(c, &node).contains("device adopted from the fd store"),
            "the restarted agent did not adopt the pod's device"
        );
        // An upgrade: every agent pod replaced, one node at a time.
        c.kubectl_ok(&["rollout", "restart", "ds/mover-agent", "-n", "mover-system"]);
        c.kubectl_ok(&[
            "rollout",
            "status",
            "ds/mover-agent",
            "-n",
            "mover-system",
            "--timeout=300s",
        ]);
        assert!(
            agent_log(c, &node).contains("device adopted from the fd store"),
            "the upgraded agent did not adopt the pod's device"
        );
        std::thread::sleep(Duration::from_secs(2));
        c.kubectl_ok(&["exec", "-n", "app", "small", "--", "touch", "/tmp/stop"]);
        (reads.join().unwrap(), killed_for)
    });
    let said = String::from_utf8_lossy(&log.stdout).into_owned();
    assert!(
        log.status.success() && said.contains("done "),
        "the pod's reads failed across its agent's restart and upgrade: {said}{}",
        String::from_utf8_lossy(&log.stderr)
    );
    let reads: Vec<(u64, String)> = said
        .lines()
        .filter_map(|l| {
            let mut w = l.strip_prefix("read ")?.split_whitespace();
            Some((w.next()?.parse().ok()?, w.next()?.to_string()))
        })
        .collect();
    assert!(reads.len() >= 3, "too few reads: {said}");
    for (_, h) in &reads {
        assert_eq!(
            h, &want,
            "a read across the agent's restart is not the source's"
        );
    }
    assert_eq!(
        c.get(
            &["pod", "small", "-n", "app"],
            "{.metadata.uid} {.status.phase}"
        ),
        format!("{pod_uid} Running"),
        "the pod was not the same one, running, after its agent's restarts"
    );
    eprintln!(
        "populated PVC, its agent killed then upgraded under the pod's reads: {} whole reads \
         of the device, none failed, each the source's; the longest took {} s (the agent \
         was back and Ready {:.1} s after its kill)",
        reads.len(),
        reads.iter().map(|(s, _)| *s).max().unwrap_or(0),
        killed_for.as_secs_f64()
    );
}

/// A PVC of a snapshot in S3 (an s3s-fs on the host's bridge address, which the nodes
/// reach), its password and keys from the secret the HydrationSource names: in mover's
/// class, its pod reads the snapshot whole; in another driver's class (the hostpath
/// driver's, WaitForFirstConsumer), it is filled before it is bound, by a prime PVC and
/// a restore Job, then its PV handed over.
fn populated_from_a_snapshot_in_s3(c: &RealCluster, dir: &std::path::Path) {
    use snapshots::testing::{ACCESS_KEY, S3Server, SECRET_KEY};
    let s3 = S3Server::start_on(&dir.join("s3"), GATEWAY);
    s3.create_bucket("snaps");
    let password = dir.join("repo-password");
    std::fs::write(&password, "pop-password\n").unwrap();
    let small = c.disks(1).join("small.img");
    for args in [
        vec!["repo", "init", "s3://snaps/pop"],
        vec![
            "snapshot",
            "create",
            "s3://snaps/pop",
            small.to_str().unwrap(),
        ],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(&args)
            .env("MOVER_S3_ENDPOINT", &s3.endpoint)
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .env("MOVER_PASSWORD_FILE", &password)
            .env("MOVER_CACHE_DIR", dir.join("cache"))
            .output()
            .unwrap();
        assert!(out.status.success(), "mover {args:?}: {out:?}");
    }
    let snapshot_source = |name: &str, extra: &str| {
        format!(
            "apiVersion: replication.mover/v1alpha1\nkind: HydrationSource\nmetadata: {{name: {name}, namespace: app}}\nspec:\n  snapshot:\n    repository: s3://snaps/pop\n    id: latest\n    s3Endpoint: {}\n  secretRef: {{name: pop-repository, namespace: mover-system}}\n{extra}",
            s3.endpoint
        )
    };
    c.apply(&format!(
        "apiVersion: v1\nkind: Secret\nmetadata:\n  name: pop-repository\n  namespace: mover-system\n  annotations: {{replication.mover/for-namespaces: app}}\nstringData: {{password: pop-password, AWS_ACCESS_KEY_ID: {ACCESS_KEY}, AWS_SECRET_ACCESS_KEY: {SECRET_KEY}}}\n---\n{}---\n{}",
        snapshot_source("from-snapshot", "  bwlimit: 2M\n"),
        populated_pvc("from-snapshot", "mover-populated", "Block", "64Mi"),
    ));
    let created = std::time::Instant::now();
    volume_pod(
        c,
        "from-snapshot",
        2,
        true,
        "echo whole $(sha256sum /dev/v); sleep 3600",
    );
    assert_eq!(
        logged(c, "from-snapshot", "whole "),
        sha256_of(&small),
        "the pod reads the snapshot"
    );
    eprintln!(
        "populated from a snapshot in S3 (64 MiB): read whole by its pod {:.2} s after the PVC's creation",
        created.elapsed().as_secs_f64()
    );
    c.kubectl_ok(&["delete", "pod", "from-snapshot", "-n", "app", "--wait"]);

    // Another driver's class: the hostpath driver (on node 1), WaitForFirstConsumer.
    c.csi_hostpath();
    c.apply(&format!(
        "apiVersion: storage.k8s.io/v1\nkind: StorageClass\nmetadata: {{name: hostpath-wffc}}\nprovisioner: hostpath.csi.k8s.io\nvolumeBindingMode: WaitForFirstConsumer\n---\n{}---\n{}",
        snapshot_source("restored", ""),
        populated_pvc("restored", "hostpath-wffc", "Block", "64Mi"),
    ));
    volume_pod(
        c,
        "restored",
        1,
        true,
        "echo whole $(sha256sum /dev/v); sleep 3600",
    );
    let uid = c.get(&["pvc", "restored", "-n", "app"], "{.metadata.uid}");
    let prime = format!("prime-{uid}");
    c.wait("the prime PVC", WAIT, || {
        !c.get(&["pvc", &prime, "-n", "mover-system"], "{.metadata.name}")
            .is_empty()
    });
    assert_eq!(
        c.get(
            &["pvc", &prime, "-n", "mover-system"],
            r"{.spec.storageClassName} {.spec.volumeMode} {.metadata.annotations.volume\.kubernetes\.io/selected-node}"
        ),
        format!("hostpath-wffc Block {}", c.node(1))
    );
    // The restore Job's pod (mover's image) fills the prime volume; only then is the
    // user's PVC bound, to the filled PV. Its log is followed from its start (the Job
    // and its pod are deleted once the PV is handed over).
    let selector = format!("replication.mover/prime-for={uid}");
    let job_pod = || {
        c.get(
            &["pods", "-n", "mover-system", "-l", &selector],
            "{.items[0].metadata.name} {.items[0].status.phase}",
        )
    };
    let deadline = std::time::Instant::now() + WAIT;
    let pod = loop {
        let now = job_pod();
        if let Some((name, "Running" | "Succeeded")) = now.split_once(' ') {
            break name.to_string();
        }
        assert!(
            !now.ends_with("Failed"),
            "the restore Job's pod failed: {now}"
        );
        assert!(
            std::time::Instant::now() < deadline,
            "the restore Job's pod never ran: {now}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let job_log = c.kubectl_ok(&["logs", "-f", "-n", "mover-system", &pod]);
    assert!(
        job_log.contains("restore: done") && job_log.contains("restored"),
        "progress and a summary in the Job's log: {job_log}"
    );
    // Bound only once the pod is done: the PVC's phase first, then the pod's.
    c.wait("the PVC bound to the filled volume", WAIT, || {
        let bound = c.get(&["pvc", "restored", "-n", "app"], "{.status.phase}") == "Bound";
        let running = job_pod().ends_with("Running");
        assert!(
            !(bound && running),
            "bound while the restore Job's pod still ran"
        );
        bound
    });
    assert_eq!(
        logged(c, "restored", "whole "),
        sha256_of(&small),
        "the PVC of the other class holds the snapshot"
    );
    let prime_and_job = |prime: &str, selector: &str| {
        let prime = c.get(&["pvc", prime, "-n", "mover-system"], "{.metadata.name}");
        let job = c.get(
            &["jobs", "-n", "mover-system", "-l", selector],
            "{.items[*].metadata.name}",
        );
        (!prime.is_empty(), !job.is_empty())
    };
    c.wait("the prime PVC and the Job gone", WAIT, || {
        prime_and_job(&prime, &selector) == (false, false)
    });

    // A PVC of that class deleted before it is filled takes its prime PVC and Job with
    // it. Its node, as the scheduler would choose it, is one that does not exist (set by
    // hand), so its fill cannot finish first.
    c.apply(&format!(
        "{}---\n{}",
        snapshot_source("abandoned", ""),
        populated_pvc("abandoned", "hostpath-wffc", "Block", "64Mi"),
    ));
    c.kubectl_ok(&[
        "annotate",
        "pvc",
        "abandoned",
        "-n",
        "app",
        "volume.kubernetes.io/selected-node=nowhere",
    ]);
    let uid = c.get(&["pvc", "abandoned", "-n", "app"], "{.metadata.uid}");
    let (prime, selector) = (
        format!("prime-{uid}"),
        format!("replication.mover/prime-for={uid}"),
    );
    c.wait("the abandoned PVC's prime PVC and Job", WAIT, || {
        prime_and_job(&prime, &selector) == (true, true)
    });
    c.kubectl_ok(&["delete", "pvc", "abandoned", "-n", "app", "--wait"]);
    c.wait(
        "the abandoned PVC's prime PVC and Job gone with it",
        WAIT,
        || prime_and_job(&prime, &selector) == (false, false),
    );
    assert!(
        c.logs(CONTROLLERS)
            .contains("the PVC was deleted before it was filled"),
        "the controller's log says why they went"
    );
}

/// The CPU time process `pid` used so far (user + system), in seconds.
fn cpu_secs(pid: i32) -> f64 {
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

/// A size line of /proc/PID/status (e.g. `VmHWM:`, the peak resident size), in MiB.
fn proc_status_mib(pid: i32, field: &str) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    kib / 1024.0
}

/// A thousand VolumeReplications (`MOVER_E2E_VRS`: fewer, to look at the costs by hand)
/// on node 1's local PVs, each replicating every minute into an export of node 2's
/// agent: what the controller asks of the API server at rest, and what it holds, as the
/// install runs it (the release build in its pod, under the Deployment's memory limit,
/// which the kubelet enforces).
#[test]
fn on_real_nodes_a_thousand_volume_replications_cost_few_requests_and_fit_the_controllers_memory() {
    let n: usize = std::env::var("MOVER_E2E_VRS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    const INTERVAL: Duration = Duration::from_secs(60);
    let _one = serial();
    let Some(s) = Site::start("scale", 4) else {
        return;
    };
    let c = &s.c;
    // Node 1 holds the volumes (sparse images on its disk); node 2's agent serves their
    // copies as exports of its config (what a secondary cluster's controller would
    // register), so each relationship cycles for real. The one ConfigMap configures both
    // agents: the copies are at the volumes' paths on node 2, so that node 1's agent
    // takes its own volume's registration under the same name.
    let mut exports = String::new();
    let mut objects = String::new();
    for i in 0..n {
        for k in [1, 2] {
            let image = c.disks(k).join(format!("v{i}.img"));
            std::fs::File::create(image).unwrap().set_len(MIB).unwrap();
        }
        exports += &format!("[exports.pv-{i}]\npath = \"/mnt/disks/v{i}.img\"\n");
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
  local: {{path: /mnt/disks/v{i}.img}}
  nodeAffinity:
    required:
      nodeSelectorTerms:
      - matchExpressions:
        - {{key: kubernetes.io/hostname, operator: In, values: [{node}]}}
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
            node = c.node(1)
        );
    }
    add_agent_exports(c, &exports);
    // The class names node 2's agent; the secret holds this cluster's own replication
    // token (its agents trust its own CA).
    let token = s.replication_token(None);
    c.kubectl_ok(&["create", "namespace", "app"]);
    c.kubectl_ok(&[
        "-n",
        "mover-system",
        "create",
        "secret",
        "generic",
        "mover-dr-peer",
        &format!("--from-literal=token={token}"),
    ]);
    c.apply(&format!(
        r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {{name: local}}
provisioner: kubernetes.io/no-provisioner
volumeBindingMode: Immediate
---
apiVersion: replication.mover/v1alpha1
kind: VolumeReplicationClass
metadata: {{name: dr}}
spec:
  provisioner: kubernetes.io/no-provisioner
  parameters:
    schedulingInterval: {}s
    target: {}
    consistency: crash-inconsistent
    replication.storage.openshift.io/replication-secret-name: mover-dr-peer
    replication.storage.openshift.io/replication-secret-namespace: mover-system
"#,
        INTERVAL.as_secs(),
        s.agent_url(2)
    ));
    let created = std::time::Instant::now();
    c.apply(&objects);
    eprintln!(
        "{} objects applied in {:.0} s",
        3 * n,
        created.elapsed().as_secs_f64()
    );
    let synced = || {
        c.get(
            &["vr", "-n", "app"],
            "{range .items[*]}{.status.lastSyncTime}{\"\\n\"}{end}",
        )
        .lines()
        .filter(|l| !l.is_empty())
        .count()
    };
    c.wait(
        &format!("{n} VolumeReplications synced"),
        Duration::from_secs(900),
        || synced() >= n,
    );
    let leading = leader(&s);
    let pid =
        process_of("controller", &format!("HOSTNAME={leading}")).expect("the leader's process");
    let agent = |k: u8| {
        process_of("agent", &format!("NODE_NAME={}", c.node(k))).expect("an agent's process")
    };
    eprintln!(
        "{n} VolumeReplications created and first synced in {:.0} s; CPU s: controller {:.1}, agents {:.1} + {:.1}",
        created.elapsed().as_secs_f64(),
        cpu_secs(pid),
        cpu_secs(agent(1)),
        cpu_secs(agent(2)),
    );

    // At rest: the controllers' requests over two intervals, from the API server's own
    // audit log (the standby's Lease reads included).
    let requests = || {
        c.audit(CONTROLLER_USER)
            .iter()
            .filter(|e| e["verb"] != "watch")
            .count()
    };
    let before = requests();
    std::thread::sleep(2 * INTERVAL);
    let made = requests() - before;
    let per_vr_per_interval = made as f64 / n as f64 / 2.0;
    let rss = proc_status_mib(pid, "VmHWM:");
    let file = proc_status_mib(pid, "RssFile:");
    eprintln!(
        "{n} VolumeReplications: {made} controller requests in two intervals of {} s: {per_vr_per_interval:.2} per VR per interval; the leader's RSS now {:.0} MiB ({file:.0} MiB of its binary and files), peak {rss:.0} MiB",
        INTERVAL.as_secs(),
        proc_status_mib(pid, "VmRSS:"),
    );
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for e in c.audit(CONTROLLER_USER).iter().skip(before) {
        let key = format!(
            "{} {} {} {}",
            e["verb"],
            e["objectRef"]["resource"],
            e["objectRef"]["subresource"],
            e["responseStatus"]["code"]
        );
        *kinds.entry(key).or_default() += 1;
    }
    assert!(
        per_vr_per_interval <= 2.0,
        "{per_vr_per_interval:.2} requests per VR per interval: {kinds:#?}"
    );
    assert!(
        rss - file <= 100.0,
        "the controller's peak RSS {rss:.0} MiB ({file:.0} MiB of them its binary) with {n} VolumeReplications"
    );

    // A cluster of 10,000 PVCs: 9,000 more that no VolumeReplication names (pending, no
    // volume). The controller caches them (slimmed) within the Deployment's memory limit.
    let others = n * 9;
    let mut pvcs = String::new();
    for i in 0..others {
        pvcs += &format!(
            "---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: other-{i}, namespace: app}}\nspec:\n  accessModes: [ReadWriteOnce]\n  storageClassName: none\n  resources: {{requests: {{storage: 1Gi}}}}\n"
        );
    }
    let applying = std::time::Instant::now();
    c.apply(&pvcs);
    eprintln!(
        "{others} PVCs applied in {:.0} s",
        applying.elapsed().as_secs_f64()
    );
    // Its cache holds them once it has seen the last one: give the watch time to
    // deliver them all.
    std::thread::sleep(Duration::from_secs(20));
    let peak = proc_status_mib(pid, "VmHWM:");
    eprintln!(
        "with {} PVCs in the cluster: the leader's peak RSS {peak:.0} MiB",
        n + others
    );
    let limit = c.get(
        &["deploy/mover-controller", "-n", "mover-system"],
        "{.spec.template.spec.containers[0].resources.limits.memory}",
    );
    let limit_mib: f64 = limit
        .strip_suffix("Mi")
        .and_then(|m| m.parse().ok())
        .unwrap_or_else(|| panic!("the Deployment's memory limit {limit:?} in Mi"));
    assert!(
        peak <= limit_mib,
        "the controller's peak RSS {peak:.0} MiB with {} PVCs: over the Deployment's {limit}",
        n + others
    );
    assert_eq!(
        process_of("controller", &format!("HOSTNAME={leading}")),
        Some(pid),
        "the leader's container was restarted (killed at its memory limit?):\n{}",
        c.get(
            &["pods", "-n", "mover-system", "-l", CONTROLLERS],
            "{range .items[*]}{.metadata.name} {.status.containerStatuses[0].restartCount} {.status.containerStatuses[0].lastState}{\"\\n\"}{end}"
        )
    );
}
