//! The CRDs: the committed YAML in deploy/ is what the code generates (drift check), and
//! mover's schema keeps every field of csi-addons' upstream CRDs with the same type.
#![cfg(feature = "controller")]

use mover::controller::crd::{self, CSI_ADDONS_GROUP, MOVER_GROUP};
use serde_json::Value;
use std::path::Path;

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap()
}

/// Where each group's CRDs are committed.
fn committed_dir(group: &str) -> std::path::PathBuf {
    match group {
        MOVER_GROUP => repo().join("deploy/crds"),
        _ => repo().join("deploy/overlays/csi-addons/crds"),
    }
}

#[test]
fn committed_crds_equal_the_generated_ones() {
    for group in [MOVER_GROUP, CSI_ADDONS_GROUP] {
        let dir = committed_dir(group);
        for (file, generated) in crd::crd_yaml(group) {
            let path = dir.join(&file);
            let committed = std::fs::read_to_string(&path).unwrap_or_default();
            assert!(
                committed == generated,
                "{} differs from what the code generates; run: \
                 cargo run -p mover -- controller crds --group {group} --out {}",
                path.display(),
                dir.strip_prefix(repo()).unwrap().display()
            );
        }
    }
}

/// The openAPIV3Schema of a CRD's first version, from YAML (with comments).
fn schema_of(yaml: &str) -> Value {
    let crd: Value = serde_saphyr::from_str(yaml).expect("CRD YAML");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

/// Every property path under `upstream` and its type; paths missing or typed otherwise in
/// `ours` are returned.
fn missing(upstream: &Value, ours: &Value, path: &str, out: &mut Vec<String>) {
    let ty = |v: &Value| v.get("type").and_then(Value::as_str).map(str::to_owned);
    if ty(upstream) != ty(ours) {
        out.push(format!(
            "{path}: type {:?} upstream, {:?} in mover",
            ty(upstream),
            ty(ours)
        ));
        return;
    }
    if let Some(props) = upstream.get("properties").and_then(Value::as_object) {
        for (name, sub) in props {
            let p = format!("{path}.{name}");
            match ours.get("properties").and_then(|o| o.get(name)) {
                Some(o) => missing(sub, o, &p, out),
                None => out.push(format!("{p}: missing in mover")),
            }
        }
    }
    if let (Some(u), Some(o)) = (upstream.get("items"), ours.get("items")) {
        missing(u, o, &format!("{path}[]"), out);
    }
    if let Some(u) = upstream.get("additionalProperties") {
        match ours.get("additionalProperties") {
            Some(o) => missing(u, o, &format!("{path}{{}}"), out),
            None => out.push(format!("{path}: a map upstream, not in mover")),
        }
    }
}

#[test]
fn schema_keeps_every_csi_addons_field_and_type() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let crds = crd::crds(CSI_ADDONS_GROUP);
    for (fixture, ours) in [
        ("csi-addons-volumereplicationclasses.yaml", &crds[0]),
        ("csi-addons-volumereplications.yaml", &crds[1]),
    ] {
        let upstream = schema_of(&std::fs::read_to_string(fixtures.join(fixture)).unwrap());
        let ours =
            serde_json::to_value(ours).unwrap()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
                .clone();
        let mut out = Vec::new();
        for part in ["spec", "status"] {
            if let Some(u) = upstream["properties"].get(part) {
                missing(u, &ours["properties"][part], part, &mut out);
            }
        }
        assert!(out.is_empty(), "{fixture}: {out:#?}");
        // The test itself sees the fields it compares.
        assert!(
            upstream["properties"]["spec"]["properties"]
                .as_object()
                .unwrap()
                .len()
                >= 2
        );
    }
    // Names and scope as csi-addons has them.
    let names = |c: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition| {
        (c.spec.names.kind.clone(), c.spec.names.plural.clone(), c.spec.scope.clone())
    };
    assert_eq!(
        names(&crds[1]),
        (
            "VolumeReplication".into(),
            "volumereplications".into(),
            "Namespaced".into()
        )
    );
    assert_eq!(
        names(&crds[0]),
        (
            "VolumeReplicationClass".into(),
            "volumereplicationclasses".into(),
            "Cluster".into()
        )
    );
}

#[test]
fn the_checker_notices_a_missing_or_retyped_field() {
    let upstream = serde_json::json!({"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "object", "properties": {"c": {"type": "integer"}}}}});
    let ours = serde_json::json!({"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "object", "properties": {}}}});
    let mut out = Vec::new();
    missing(&upstream, &ours, "spec", &mut out);
    assert_eq!(
        out,
        [
            "spec.a: type Some(\"string\") upstream, Some(\"integer\") in mover",
            "spec.b.c: missing in mover"
        ]
    );
}

#[test]
fn deploy_agent_configs_load() {
    for file in [
        "deploy/base/agent.toml",
        "deploy/overlays/insecure-plaintext/agent.toml",
    ] {
        let config = mover::agent::AgentConfig::load(&repo().join(file))
            .unwrap_or_else(|e| panic!("{file}: {e}"));
        assert_eq!(
            config.listen.port(),
            7070,
            "{file}: the port the controller calls"
        );
        assert_eq!(
            config.metrics_listen.map(|a| a.port()),
            Some(9470),
            "{file}"
        );
        // The controller registers PVs under the kubelet's CSI directory and local PVs.
        for root in ["/var/lib/kubelet/plugins/kubernetes.io/csi", "/mnt/disks"] {
            assert!(
                config
                    .volume_roots
                    .iter()
                    .any(|r| r == std::path::Path::new(root)),
                "{file}: volume_roots lacks {root}"
            );
        }
        // Peer clusters present a token of the replication role.
        assert!(config.replication_token_file.is_some(), "{file}");
        // The CSI plugin's socket is where agent.yaml's registrar tells the kubelet.
        let agent_yaml = std::fs::read_to_string(repo().join("deploy/base/agent.yaml")).unwrap();
        let socket = config
            .csi_socket
            .as_ref()
            .expect("the agent serves the CSI plugin");
        assert!(
            agent_yaml.contains(&format!("--kubelet-registration-path={}", socket.display())),
            "{file}: csi_socket {} is not the registrar's",
            socket.display()
        );
        // The devices' connections go to the fd store beside the agent: its socket is
        // where fd-store.yaml's store listens, in a directory the agent mounts too.
        let store_yaml = std::fs::read_to_string(repo().join("deploy/base/fd-store.yaml")).unwrap();
        let store = config
            .fd_store
            .as_ref()
            .expect("the agent keeps its devices in the fd store");
        assert!(
            store_yaml.contains(&format!("--socket, {}]", store.display()))
                && store_yaml.contains(&format!(
                    "hostPath: {{path: {}",
                    store.parent().unwrap().display()
                )),
            "{file}: fd_store {} is not where fd-store.yaml's store listens",
            store.display()
        );
        assert!(
            store.starts_with(&config.state_dir)
                && agent_yaml.contains("{name: state, mountPath: /var/lib/mover}"),
            "{file}: the agent does not see the fd store's socket"
        );
    }
    let base = mover::agent::AgentConfig::load(&repo().join("deploy/base/agent.toml")).unwrap();
    assert!(
        base.tls.as_ref().is_some_and(|t| t.from_kubernetes) && base.token_file.is_none(),
        "the base install is TLS with certificates from the cluster's signer, no shared token"
    );
}
