//! Volumes an agent populates, and the pods that use them, as the real-node scenarios and
//! the soak make them: exports added to the agents' configuration, a populated PVC, a
//! busybox pod on its device or file system.

use super::{nodes::RealCluster, site::WAIT};

/// The sha256 of the file at `path`, as sha256sum (busybox's too, in the pods) prints it.
pub fn sha256_of(path: &std::path::Path) -> String {
    first_word_of(std::process::Command::new("sha256sum").arg(path))
}

/// The first word `cmd` prints (a checksum tool's sum).
pub fn first_word_of(cmd: &mut std::process::Command) -> String {
    let out = cmd.output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Adds `exports` (`[exports.NAME]` tables) to the agents' configuration (the install's
/// ConfigMap, the same on every node) and restarts them until every one is Ready again.
/// An export's path is opened only when it is used: one that is on node 1's disk alone
/// is no trouble to node 2's agent.
pub fn add_agent_exports(c: &RealCluster, exports: &str) {
    let ns = ["-n", "mover-system"];
    let name = c.get(
        &["ds/mover-agent", ns[0], ns[1]],
        r#"{.spec.template.spec.volumes[?(@.name=="config")].configMap.name}"#,
    );
    let config = c.get(&["cm", &name, ns[0], ns[1]], r"{.data.agent\.toml}");
    let cm = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "mover-system"},
        "data": {"agent.toml": format!("{config}\n{exports}")},
    });
    c.apply(&cm.to_string());
    c.kubectl_ok(&["rollout", "restart", "ds/mover-agent", ns[0], ns[1]]);
    c.kubectl_ok(&[
        "rollout",
        "status",
        "ds/mover-agent",
        ns[0],
        ns[1],
        "--timeout=180s",
    ]);
}

/// A pod `app/NAME` on node `node` of the PVC `app/NAME`, running `script` with the
/// volume as the device /dev/v (Block) or mounted at /data (Filesystem).
pub fn volume_pod(c: &RealCluster, name: &str, node: u8, block: bool, script: &str) {
    let (use_it, key) = match block {
        true => (
            serde_json::json!([{"name": "v", "devicePath": "/dev/v"}]),
            "volumeDevices",
        ),
        false => (
            serde_json::json!([{"name": "v", "mountPath": "/data"}]),
            "volumeMounts",
        ),
    };
    let mut container = serde_json::json!({
        "name": "use",
        "image": "localhost/busybox:1",
        "command": ["sh", "-c", script],
    });
    container[key] = use_it;
    let pod = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "app"},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "nodeSelector": {"kubernetes.io/hostname": c.node(node)},
            "containers": [container],
            "volumes": [{"name": "v", "persistentVolumeClaim": {"claimName": name}}],
        },
    });
    c.apply(&pod.to_string());
}

/// A PVC `app/NAME` of `size` and volume mode `mode` in StorageClass `class`, filled
/// from the HydrationSource of the same name.
pub fn populated_pvc(name: &str, class: &str, mode: &str, size: &str) -> String {
    format!(
        "apiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {{name: {name}, namespace: app}}\nspec:\n  accessModes: [ReadWriteOnce]\n  volumeMode: {mode}\n  storageClassName: {class}\n  resources: {{requests: {{storage: \"{size}\"}}}}\n  dataSourceRef: {{apiGroup: replication.mover, kind: HydrationSource, name: {name}}}\n"
    )
}

/// Waits until pod `app/NAME`'s log has a line starting with `prefix`; that line.
pub fn log_line(c: &RealCluster, pod: &str, prefix: &str) -> String {
    let mut line = String::new();
    c.wait(&format!("pod {pod} to log {prefix:?}"), WAIT, || {
        let log = c.kubectl(&["logs", "-n", "app", pod]);
        let log = String::from_utf8_lossy(&log.stdout).into_owned();
        match log.lines().find(|l| l.starts_with(prefix)) {
            Some(l) => {
                line = l.to_string();
                true
            }
            None => false,
        }
    });
    line
}
