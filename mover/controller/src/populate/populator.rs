//! The copy-on-demand populator: a PVC whose `spec.dataSourceRef` names a
//! [`HydrationSource`] of mover's own class is usable at once.
//!
//! Once the scheduler has chosen the pod's node (`volume.kubernetes.io/selected-node`,
//! a WaitForFirstConsumer StorageClass), the agent on that node makes a volume
//! (`pvc-UID`, a sparse image in its CSI volumes) and starts filling it from the source.
//! The populator then creates a PV of mover's CSI driver for it, pre-bound to the PVC
//! and pinned to the node; kube-controller-manager binds the two, and the kubelet
//! stages the volume through the agent's CSI plugin while regions still arrive: a read
//! of one still to come fetches it first.
//!
//! Unlike lib-volume-populator's prime PVC, nothing is copied before the pod starts:
//! that is the point. The PV has its StorageClass's reclaim policy; the controller
//! deletes the volume of a released one whose policy is Delete ([`super::reclaim`]).
//! A HydrationSource being deleted populates nothing more ([`super::sources`]).

use super::reclaim::{IMAGE_FINALIZER, PROVISIONED_BY};
use super::{PopulateError, SELECTED_NODE, WAIT, repository_secret, source_secret};
use crate::context::Context;
use crate::crd::{
    HydrationSource, MOVER_GROUP, ReplicationState, RepositorySnapshot, SecretRef,
    VolumeReplication,
};
use k8s_openapi::api::{
    core::v1::{PersistentVolume, PersistentVolumeClaim},
    storage::v1::StorageClass,
};
use kube::{Api, ResourceExt, api::PostParams, runtime::controller::Action};
use std::sync::Arc;
use transport::hydrate;

/// The label on a populated PV: the HydrationSource it was filled from.
pub const POPULATED_FROM: &str = "replication.mover/populated-from";

/// The HydrationSource a PVC names, if it names one.
pub fn source_of(pvc: &PersistentVolumeClaim) -> Option<String> {
    let r = pvc.spec.as_ref()?.data_source_ref.as_ref()?;
    (r.api_group.as_deref() == Some(MOVER_GROUP) && r.kind == "HydrationSource")
        .then(|| r.name.clone())
}

/// Bytes of a Kubernetes quantity of storage ("4Gi", "500M", "1073741824").
pub fn bytes_of(quantity: &str) -> Option<u64> {
    let q = quantity.trim();
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (n, unit) = q.split_at(split);
    let n: u64 = n.parse().ok()?;
    let times: u64 = match unit {
        "" => 1,
        "k" => 1000,
        "M" => 1000u64.pow(2),
        "G" => 1000u64.pow(3),
        "T" => 1000u64.pow(4),
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "Pi" => 1 << 50,
        _ => return None,
    };
    n.checked_mul(times)
}

/// Populates one PVC: idempotent, each step skipped when done.
pub async fn reconcile(
    pvc: Arc<PersistentVolumeClaim>,
    ctx: Arc<Context>,
) -> Result<Action, PopulateError> {
    let Some(source) = source_of(&pvc) else {
        return Ok(Action::await_change());
    };
    let spec = pvc.spec.clone().unwrap_or_default();
    if spec.volume_name.as_deref().is_some_and(|v| !v.is_empty()) {
        return Ok(Action::await_change());
    }
    let (ns, name) = (pvc.namespace().unwrap_or_default(), pvc.name_any());
    let uid = pvc.uid().unwrap_or_default();
    let what = |w: &str| format!("{w} for PVC {ns}/{name}");
    let class = spec.storage_class_name.clone().unwrap_or_default();
    if class.is_empty() {
        return Err(PopulateError::Invalid(format!(
            "PVC {ns}/{name} names no StorageClass: name one of provisioner {} (usable at \
             once, filled behind) or any other (filled before it is bound)",
            transport::cluster::CSI_DRIVER
        )));
    }
    let sc = Api::<StorageClass>::all(ctx.client.clone())
        .get_opt(&class)
        .await
        .map_err(|source| PopulateError::Kube {
            what: what("reading its StorageClass"),
            source,
        })?
        .ok_or_else(|| {
            PopulateError::Invalid(format!("PVC {ns}/{name}: no StorageClass {class:?}"))
        })?;
    let hs = hydration_source(&ctx, &ns, &name, &source).await?;
    // A VolumeReplication that is no replica here never will be one for this PVC: said
    // now, not once a pod of it is scheduled.
    let replica =
        match &hs.spec.volume_replication {
            None => None,
            Some(vr) => Some(secondary_here(&ctx, &ns, vr).await.map_err(|e| {
                PopulateError::Invalid(format!("HydrationSource {ns}/{source}: {e}"))
            })?),
        };
    if sc.provisioner != transport::cluster::CSI_DRIVER {
        return super::prime::reconcile(&pvc, &hs, &sc, &ctx).await;
    }
    let Some(node) = pvc.annotations().get(SELECTED_NODE).cloned() else {
        tracing::info!(pvc = %format!("{ns}/{name}"), "waiting for the scheduler to choose a node (the PVC's StorageClass must be WaitForFirstConsumer)");
        return Ok(Action::requeue(WAIT));
    };
    let pods = crate::context::owned(&ctx.caches.agents);
    let agent = crate::replication::desired::agent_on(&node, &pods, ctx.agent_port)
        .map_err(|e| PopulateError::Invalid(e.to_string()))?;
    let export = format!("pvc-{uid}");
    let status = match ctx.agents.hydration(&agent, &export).await? {
        Some(s) => s,
        None => {
            let bwlimit = match hs.spec.bwlimit.as_deref() {
                None => 0,
                Some(b) => mover_engine::remote::parse_rate(b).map_err(|e| {
                    PopulateError::Invalid(format!("HydrationSource {ns}/{source}: bwlimit: {e}"))
                })?,
            };
            let invalid =
                |e: String| PopulateError::Invalid(format!("HydrationSource {ns}/{source}: {e}"));
            let mut req = hydrate::StartRequest {
                export: export.clone(),
                bwlimit,
                create: true,
                ..Default::default()
            };
            let from = &hs.spec;
            match (
                replica.as_ref(),
                &from.agent,
                &from.snapshot,
                &from.secret_ref,
            ) {
                (Some(vr), ..) => {
                    let (url, relationship) = replica_of(&ctx, vr).map_err(invalid)?;
                    req.source = Some(hydrate::start_request::Source::Agent(url));
                    req.replica_of = relationship;
                }
                (None, Some(url), _, r) => {
                    req.source = Some(hydrate::start_request::Source::Agent(url.clone()));
                    // Read for this PVC: the source serves a volume only to the fills of
                    // the namespaces it is for (a move's, to its own PVC alone).
                    req.reader = format!("hydrate:{ns}/{name}");
                    if let Some(r) = r {
                        (req.peer_token, req.peer_ca) =
                            peer_access(&ctx, r, &ns).await.map_err(invalid)?;
                    }
                }
                (None, None, Some(snap), Some(r)) => {
                    let s = snapshot_access(&ctx, snap, r, &ns).await.map_err(invalid)?;
                    req.source = Some(hydrate::start_request::Source::Snapshot(s));
                }
                _ => {
                    return Err(invalid(
                        "names no agent, no VolumeReplication and no snapshot with its \
                         secretRef"
                            .into(),
                    ));
                }
            }
            ctx.agents.hydrate(&agent, req).await?
        }
    };
    let requested = spec
        .resources
        .as_ref()
        .and_then(|r| r.requests.as_ref())
        .and_then(|r| r.get("storage"))
        .and_then(|q| bytes_of(&q.0))
        .unwrap_or(0);
    if requested > status.size {
        return Err(PopulateError::Invalid(format!(
            "PVC {ns}/{name} asks for {requested} bytes; its source {} holds {}: ask for at \
             most that",
            status.source, status.size
        )));
    }
    // Like a provisioned volume's, what happens to its data when the PVC goes is the
    // class's to say (reclaim.rs carries it out).
    let policy = sc.reclaim_policy.as_deref().unwrap_or("Delete");
    let pv = persistent_volume(&pvc, &export, &node, status.size, policy);
    match Api::<PersistentVolume>::all(ctx.client.clone())
        .create(&PostParams::default(), &pv)
        .await
    {
        Ok(_) => {
            tracing::info!(pvc = %format!("{ns}/{name}"), pv = %export, %node, size = status.size, "populated PVC bound to a volume that is still arriving")
        }
        Err(kube::Error::Api(e)) if e.code == 409 => {}
        Err(source) => {
            return Err(PopulateError::Kube {
                what: what("creating its PV"),
                source,
            });
        }
    }
    Ok(Action::await_change())
}

/// The HydrationSource `source` that PVC `ns/name` names.
async fn hydration_source(
    ctx: &Context,
    ns: &str,
    name: &str,
    source: &str,
) -> Result<HydrationSource, PopulateError> {
    Api::<HydrationSource>::namespaced(ctx.client.clone(), ns)
        .get_opt(source)
        .await
        .map_err(|e| PopulateError::Kube {
            what: format!("reading its HydrationSource for PVC {ns}/{name}"),
            source: e,
        })?
        .filter(|hs| hs.metadata.deletion_timestamp.is_none())
        .ok_or_else(|| {
            PopulateError::Invalid(format!(
                "PVC {ns}/{name}: no HydrationSource {source:?} in namespace {ns} (or it is \
                 being deleted)"
            ))
        })
}

/// The agent URL of the replica that VolumeReplication `vr` (the secondary side here,
/// see [`secondary_here`]) keeps in this cluster, and its relationship.
fn replica_of(ctx: &Context, vr: &VolumeReplication) -> Result<(String, String), String> {
    let (ns, name) = (vr.namespace().unwrap_or_default(), vr.name_any());
    let d = crate::replication::reconcile::resolve(vr, ctx)
        .map_err(|e| format!("VolumeReplication {ns}/{name}: {e}"))?;
    Ok((
        format!("agent://{}@{}/{}", d.node, d.agent, d.volume),
        d.name,
    ))
}

/// VolumeReplication `ns/name`, if its state here is secondary (it keeps a replica).
async fn secondary_here(ctx: &Context, ns: &str, name: &str) -> Result<VolumeReplication, String> {
    let vr = Api::<VolumeReplication>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(|e| format!("reading VolumeReplication {ns}/{name}: {e}"))?
        .ok_or_else(|| format!("no VolumeReplication {name:?} in namespace {ns}"))?;
    if vr.spec.replication_state != ReplicationState::Secondary {
        return Err(format!(
            "VolumeReplication {ns}/{name} is {:?} here: its volume is the one in use. A \
             populated PVC reads a replica (a VolumeReplication whose state here is \
             secondary); for a copy of this volume use its agent, or a snapshot",
            vr.spec.replication_state
        ));
    }
    Ok(vr)
}

/// The token and CA (PEM, or empty) in the secret `r` names.
async fn peer_access(ctx: &Context, r: &SecretRef, user: &str) -> Result<(String, String), String> {
    let wanted = "`token` (the other cluster's replication token) and `ca.crt` (its CA)";
    let data = source_secret(ctx, r, user, wanted).await?;
    let text = |k: &str| {
        data.get(k)
            .map(|v| String::from_utf8_lossy(v).trim().to_string())
    };
    let token = text("token").ok_or_else(|| {
        format!(
            "secret {}/{} has no `token`: it needs {wanted}",
            r.namespace, r.name
        )
    })?;
    Ok((token, text("ca.crt").unwrap_or_default()))
}

/// The snapshot `snap` as the agent opens it, with the password (or raw key) and S3 keys
/// of the secret `r` names.
async fn snapshot_access(
    ctx: &Context,
    snap: &RepositorySnapshot,
    r: &SecretRef,
    user: &str,
) -> Result<hydrate::SnapshotSource, String> {
    let (data, key) = repository_secret(ctx, r, user).await?;
    let text = |k: &str| {
        data.get(k)
            .map(|v| String::from_utf8_lossy(v).trim().to_string())
            .unwrap_or_default()
    };
    let raw_key = key == "key";
    let password = match raw_key {
        true => data[key].clone(),
        false => text(key).into_bytes(),
    };
    Ok(hydrate::SnapshotSource {
        repo: snap.repository.clone(),
        snapshot: snap.id.clone(),
        s3_endpoint: snap.s3_endpoint.clone().unwrap_or_default(),
        s3_region: snap.s3_region.clone().unwrap_or_default(),
        password,
        raw_key,
        s3_access_key_id: text("AWS_ACCESS_KEY_ID"),
        s3_secret_access_key: text("AWS_SECRET_ACCESS_KEY"),
        ..Default::default()
    })
}

/// The PV of export `export` on `node`, pre-bound to `pvc`, with reclaim policy `policy`.
fn persistent_volume(
    pvc: &PersistentVolumeClaim,
    export: &str,
    node: &str,
    size: u64,
    policy: &str,
) -> PersistentVolume {
    let spec = pvc.spec.clone().unwrap_or_default();
    let block = spec.volume_mode.as_deref() == Some("Block");
    serde_json::from_value(serde_json::json!({
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {
            "name": export,
            "labels": {POPULATED_FROM: source_of(pvc).unwrap_or_default()},
            "annotations": {PROVISIONED_BY: transport::cluster::CSI_DRIVER},
            "finalizers": [IMAGE_FINALIZER],
        },
        "spec": {
            "capacity": {"storage": size.to_string()},
            "accessModes": spec.access_modes.unwrap_or_else(|| vec!["ReadWriteOnce".into()]),
            "volumeMode": if block { "Block" } else { "Filesystem" },
            "storageClassName": spec.storage_class_name.unwrap_or_default(),
            "persistentVolumeReclaimPolicy": policy,
            "claimRef": {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "namespace": pvc.namespace(),
                "name": pvc.name_any(),
                "uid": pvc.uid(),
            },
            "csi": {
                "driver": transport::cluster::CSI_DRIVER,
                "volumeHandle": export,
                "fsType": if block { serde_json::Value::Null } else { "ext4".into() },
            },
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
            ]}]}},
        },
    }))
    .expect("a PV")
}

/// Retries a PVC the populator could not finish after a pause that grows with nothing.
pub fn error_policy(
    pvc: Arc<PersistentVolumeClaim>,
    error: &PopulateError,
    _: Arc<Context>,
) -> Action {
    tracing::warn!(pvc = %format!("{}/{}", pvc.namespace().unwrap_or_default(), pvc.name_any()), "cannot populate: {error}");
    Action::requeue(match error {
        PopulateError::Invalid(_) => WAIT * 6,
        _ => WAIT,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_are_bytes() {
        assert_eq!(bytes_of("4Gi"), Some(4 << 30));
        assert_eq!(bytes_of("1Ti"), Some(1 << 40));
        assert_eq!(bytes_of("500M"), Some(500_000_000));
        assert_eq!(bytes_of("1073741824"), Some(1 << 30));
        assert_eq!(bytes_of("1.5Gi"), None);
        assert_eq!(bytes_of("4Gb"), None);
    }

    #[test]
    fn only_a_hydration_source_of_movers_group_is_ours() {
        let pvc = |group: &str, kind: &str| -> PersistentVolumeClaim {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "p", "namespace": "app", "uid": "u1"},
                "spec": {"dataSourceRef": {"apiGroup": group, "kind": kind, "name": "src"},
                         "volumeMode": "Block", "storageClassName": "wffc"},
            }))
            .unwrap()
        };
        assert_eq!(
            source_of(&pvc(MOVER_GROUP, "HydrationSource")).as_deref(),
            Some("src")
        );
        assert_eq!(source_of(&pvc("other.io", "HydrationSource")), None);
        assert_eq!(source_of(&pvc(MOVER_GROUP, "VolumeReplication")), None);
        let pv = persistent_volume(
            &pvc(MOVER_GROUP, "HydrationSource"),
            "pvc-u1",
            "n1",
            4096,
            "Delete",
        );
        assert_eq!(pv.finalizers(), [IMAGE_FINALIZER]);
        assert_eq!(
            pv.annotations().get(PROVISIONED_BY).map(String::as_str),
            Some(transport::cluster::CSI_DRIVER)
        );
        let spec = pv.spec.unwrap();
        assert_eq!(spec.claim_ref.unwrap().uid.as_deref(), Some("u1"));
        assert_eq!(spec.csi.as_ref().unwrap().volume_handle, "pvc-u1");
        assert_eq!(spec.csi.unwrap().fs_type, None);
        assert_eq!(
            spec.persistent_volume_reclaim_policy.as_deref(),
            Some("Delete")
        );
        assert_eq!(spec.storage_class_name.as_deref(), Some("wffc"));
    }
}
