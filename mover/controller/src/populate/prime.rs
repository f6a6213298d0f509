//! Filled before use: a populated PVC of a StorageClass other than one of mover's CSI
//! driver. Its volume is the storage class's own, so nothing can serve it before its
//! data is there: it is filled first and bound after, as lib-volume-populator does
//! (its prime-PVC-and-rebind pattern; a restore with no hurry).
//!
//! 1. A prime PVC (`prime-UID`) of the same class, size, mode and access modes is made
//!    in the namespace of the HydrationSource's secret (mover-system); in a
//!    WaitForFirstConsumer class, once the scheduler has chosen a node for the user's
//!    PVC, and on that node.
//! 2. A Job there restores the snapshot into it with `mover snapshot restore`: a block
//!    snapshot onto the raw device of a Block PVC, a file tree into the file system of a
//!    Filesystem PVC. The repository's password and S3 keys come from the secret.
//! 3. Once the Job has succeeded, the prime PVC's PV is handed to the user's PVC: its
//!    claimRef is rewritten to name it, and kube-controller-manager binds the two. The
//!    prime PVC (now Lost) and the Job are deleted.
//!
//! A Job that fails for good (a refusal, damaged repository data: exit 2 or 3) leaves
//! the PVC unbound and says why. A user's PVC deleted before its PV was handed over
//! takes its prime PVC and Job with it ([`reconcile_prime`]: they are labelled with its
//! UID and name it).

use super::PopulateError;
use crate::context::{Context, created_or_exists, deleted_or_gone};
use crate::crd::{HydrationSource, RepositorySnapshot, SecretRef};
use k8s_openapi::api::{
    batch::v1::Job,
    core::v1::{PersistentVolume, PersistentVolumeClaim},
    storage::v1::StorageClass,
};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, PropagationPolicy},
    runtime::controller::Action,
};
use serde_json::{Value, json};
use std::{sync::Arc, time::Duration};

/// The label on the prime PVC, its Job and the PV handed over: the user's PVC's UID.
pub const PRIME_FOR: &str = "replication.mover/prime-for";
/// The annotation on a prime PVC naming the user's PVC it is filled for (NAMESPACE/NAME).
pub const PRIME_OF: &str = "replication.mover/prime-of";
/// How soon a prime PVC being filled is looked at again.
const POLL: Duration = Duration::from_secs(3);
/// How often a prime PVC's user's PVC is looked for: its deletion reaches no watch of
/// the prime's.
const OWNER_CHECK: Duration = Duration::from_secs(15);

/// Fills PVC `pvc` (of StorageClass `sc`, not mover's) from `hs` before it is bound.
/// Idempotent: each pass takes the next step, from what the API server holds.
pub(super) async fn reconcile(
    pvc: &PersistentVolumeClaim,
    hs: &HydrationSource,
    sc: &StorageClass,
    ctx: &Context,
) -> Result<Action, PopulateError> {
    let (ns, name, uid) = (
        pvc.namespace().unwrap_or_default(),
        pvc.name_any(),
        pvc.uid().unwrap_or_default(),
    );
    let (class, provisioner) = (sc.name_any(), &sc.provisioner);
    let invalid = |e: String| PopulateError::Invalid(format!("PVC {ns}/{name}: {e}"));
    let (Some(snap), Some(secret)) = (&hs.spec.snapshot, &hs.spec.secret_ref) else {
        return Err(invalid(format!(
            "its StorageClass {class} ({provisioner}) is not one of mover's CSI driver, so its \
             data is copied before it is bound, which mover does from a snapshot only. For an \
             agent or a VolumeReplication, use a StorageClass of provisioner {}: the PVC is \
             then usable at once, its data arriving behind",
            transport::cluster::CSI_DRIVER
        )));
    };
    let (_, key_file) = super::repository_secret(ctx, secret, &ns)
        .await
        .map_err(invalid)?;
    let kube = |what: String| move |source| PopulateError::Kube { what, source };
    let prime_name = format!("prime-{uid}");
    let pvcs = Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &secret.namespace);
    let jobs = Api::<Job>::namespaced(ctx.client.clone(), &secret.namespace);
    let job_name = format!("populate-{uid}");
    // Handed over already (asked of the API server, not a cache that may lag): the PV is
    // this PVC's and kube-controller-manager binds them; what is left of the prime goes.
    let handed = Api::<PersistentVolume>::all(ctx.client.clone())
        .list(&ListParams::default().labels(&format!("{PRIME_FOR}={uid}")))
        .await
        .map_err(kube("listing PVs handed over".into()))?;
    if !handed.items.is_empty() {
        clean_up(&jobs, &job_name, &pvcs, &prime_name).await?;
        return Ok(Action::requeue(POLL));
    }
    // As lib-volume-populator: in a WaitForFirstConsumer class the volume is made where
    // the user's pod will run, once the scheduler has said where.
    let waits = sc.volume_binding_mode.as_deref() == Some("WaitForFirstConsumer");
    if waits && !pvc.annotations().contains_key(super::SELECTED_NODE) {
        tracing::info!(pvc = %format!("{ns}/{name}"), "waiting for the scheduler to choose a node for a pod using it");
        return Ok(Action::requeue(POLL * 2));
    }
    let Some(prime) = pvcs
        .get_opt(&prime_name)
        .await
        .map_err(kube(format!("reading prime PVC {prime_name}")))?
    else {
        created_or_exists(
            pvcs.create(&PostParams::default(), &prime_pvc(pvc, &prime_name))
                .await,
        )
        .map_err(kube(format!(
            "creating prime PVC {}/{prime_name}",
            secret.namespace
        )))?;
        tracing::info!(pvc = %format!("{ns}/{name}"), prime = %format!("{}/{prime_name}", secret.namespace), %class, "populated PVC filled before use: prime PVC made");
        return Ok(Action::requeue(POLL));
    };
    if prime.metadata.deletion_timestamp.is_some() {
        return Ok(Action::requeue(POLL)); // going: handed over, or deleted by hand
    }
    let job = match jobs
        .get_opt(&job_name)
        .await
        .map_err(kube(format!("reading Job {job_name}")))?
    {
        Some(j) => j,
        None => {
            let job = restore_job(
                &job_name,
                &prime,
                snap,
                secret,
                key_file,
                &uid,
                &ctx.job_image,
            );
            created_or_exists(jobs.create(&PostParams::default(), &job).await).map_err(kube(
                format!("creating Job {}/{job_name}", secret.namespace),
            ))?;
            tracing::info!(pvc = %format!("{ns}/{name}"), job = %format!("{}/{job_name}", secret.namespace), "restoring the snapshot into the prime PVC");
            return Ok(Action::requeue(POLL));
        }
    };
    match job_outcome(&job) {
        Outcome::Running => return Ok(Action::requeue(POLL)),
        Outcome::Failed(why) => {
            return Err(invalid(format!(
                "the Job restoring its snapshot failed ({why}): see `kubectl logs -n {} \
                 job/{job_name}`; fix the cause, then delete the Job to try again",
                secret.namespace
            )));
        }
        Outcome::Succeeded => {}
    }
    let Some(pv) = prime
        .spec
        .as_ref()
        .and_then(|s| s.volume_name.clone())
        .filter(|v| !v.is_empty())
    else {
        return Ok(Action::requeue(POLL)); // bound before its pod ran: not seen yet
    };
    // Rebind: the PV's claimRef names the user's PVC (resourceVersion dropped: it was
    // the prime PVC's), and it is labelled so that a later pass knows it was handed over.
    let rebind = json!({
        "metadata": {"labels": {PRIME_FOR: uid}},
        "spec": {"claimRef": {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "namespace": ns,
            "name": name,
            "uid": uid,
            "resourceVersion": null,
        }},
    });
    Api::<PersistentVolume>::all(ctx.client.clone())
        .patch(&pv, &PatchParams::default(), &Patch::Merge(&rebind))
        .await
        .map_err(kube(format!("handing PV {pv} to it")))?;
    clean_up(&jobs, &job_name, &pvcs, &prime_name).await?;
    tracing::info!(pvc = %format!("{ns}/{name}"), %pv, "filled before use: its PV handed over from the prime PVC");
    Ok(Action::requeue(POLL))
}

/// Undoes the fill of the user's PVC `uid` that has not been handed over (its
/// HydrationSource is deleted): its Job and prime PVC in `namespace` go.
pub(super) async fn roll_back(
    ctx: &Context,
    namespace: &str,
    uid: &str,
) -> Result<(), PopulateError> {
    let jobs = Api::<Job>::namespaced(ctx.client.clone(), namespace);
    let pvcs = Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), namespace);
    clean_up(
        &jobs,
        &format!("populate-{uid}"),
        &pvcs,
        &format!("prime-{uid}"),
    )
    .await
}

/// A prime PVC whose user's PVC is gone (or going, or another of the same name): its
/// restore Job and itself are deleted, as the user's deletion asks. Runs over the PVCs
/// labelled [`PRIME_FOR`].
pub async fn reconcile_prime(
    prime: Arc<PersistentVolumeClaim>,
    ctx: Arc<Context>,
) -> Result<Action, PopulateError> {
    let uid = prime.labels().get(PRIME_FOR).cloned().unwrap_or_default();
    // A prime made before it named its PVC: left to its fill, as then.
    let Some((ns, name)) = prime
        .annotations()
        .get(PRIME_OF)
        .and_then(|o| o.split_once('/'))
    else {
        return Ok(Action::await_change());
    };
    if prime.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let kube = |what: String| move |source| PopulateError::Kube { what, source };
    let user = Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), ns)
        .get_opt(name)
        .await
        .map_err(kube(format!("reading PVC {ns}/{name}")))?;
    if !orphaned(user.as_ref(), &uid) {
        return Ok(Action::requeue(OWNER_CHECK));
    }
    // Whether or not its PV was handed over meanwhile (then the PV is the deleted PVC's
    // and goes as its policy says), the prime PVC and the Job have no one to fill.
    let here = prime.namespace().unwrap_or_default();
    roll_back(&ctx, &here, &uid).await?;
    tracing::info!(pvc = %format!("{ns}/{name}"), prime = %format!("{here}/{}", prime.name_any()), "the PVC was deleted before it was filled: its prime PVC and restore Job deleted");
    Ok(Action::await_change())
}

/// Whether the user's PVC `user` (as read now) no longer wants the fill of PVC `uid`.
fn orphaned(user: Option<&PersistentVolumeClaim>, uid: &str) -> bool {
    match user {
        None => true,
        Some(p) => p.uid().as_deref() != Some(uid) || p.metadata.deletion_timestamp.is_some(),
    }
}

/// Retries a prime PVC that could not be looked at.
pub fn prime_error_policy(
    prime: Arc<PersistentVolumeClaim>,
    error: &PopulateError,
    _: Arc<Context>,
) -> Action {
    tracing::warn!(prime = %prime.name_any(), "cannot check the prime PVC's user: {error}");
    Action::requeue(OWNER_CHECK)
}

/// Deletes the Job (its pods with it) and then the prime PVC, once the PV is handed
/// over; either gone already is fine.
async fn clean_up(
    jobs: &Api<Job>,
    job: &str,
    pvcs: &Api<PersistentVolumeClaim>,
    prime: &str,
) -> Result<(), PopulateError> {
    let background = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Background),
        ..Default::default()
    };
    deleted_or_gone(jobs.delete(job, &background).await).map_err(|source| PopulateError::Kube {
        what: format!("deleting Job {job}"),
        source,
    })?;
    deleted_or_gone(pvcs.delete(prime, &DeleteParams::default()).await).map_err(|source| {
        PopulateError::Kube {
            what: format!("deleting prime PVC {prime}"),
            source,
        }
    })
}

/// The prime PVC for `pvc`: its class, size, mode and access modes, on the node the
/// scheduler chose for it (if any).
fn prime_pvc(pvc: &PersistentVolumeClaim, name: &str) -> PersistentVolumeClaim {
    let spec = pvc.spec.clone().unwrap_or_default();
    let mut annotations = serde_json::Map::new();
    if let Some(node) = pvc.annotations().get(super::SELECTED_NODE) {
        annotations.insert(super::SELECTED_NODE.into(), node.clone().into());
    }
    let of = format!("{}/{}", pvc.namespace().unwrap_or_default(), pvc.name_any());
    annotations.insert(PRIME_OF.into(), of.into());
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {
            "name": name,
            "labels": {PRIME_FOR: pvc.uid()},
            "annotations": annotations,
        },
        "spec": {
            "accessModes": spec.access_modes,
            "resources": spec.resources,
            "volumeMode": spec.volume_mode,
            "storageClassName": spec.storage_class_name,
        },
    }))
    .expect("a PVC")
}

/// The Job that restores `snap` into the prime PVC, as deploy/examples/jobs do by hand.
fn restore_job(
    name: &str,
    prime: &PersistentVolumeClaim,
    snap: &RepositorySnapshot,
    secret: &SecretRef,
    key_file: &str,
    uid: &str,
    image: &str,
) -> Job {
    let block = prime.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some("Block");
    let target = if block {
        "/dev/mover-target"
    } else {
        "/mnt/target"
    };
    let from_secret = |var: &str| json!({"name": var, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": var, "optional": true}}});
    let mut env = vec![
        from_secret("AWS_ACCESS_KEY_ID"),
        from_secret("AWS_SECRET_ACCESS_KEY"),
        json!({"name": if key_file == "key" { "MOVER_KEY_FILE" } else { "MOVER_PASSWORD_FILE" },
               "value": format!("/etc/mover/repository/{key_file}")}),
        json!({"name": "MOVER_CACHE_DIR", "value": "/mnt/cache"}),
    ];
    for (var, value) in [
        ("MOVER_S3_ENDPOINT", &snap.s3_endpoint),
        ("MOVER_S3_REGION", &snap.s3_region),
    ] {
        if let Some(v) = value {
            env.push(json!({"name": var, "value": v}));
        }
    }
    let mut mounts = vec![
        json!({"name": "repository", "mountPath": "/etc/mover/repository", "readOnly": true}),
        json!({"name": "cache", "mountPath": "/mnt/cache"}),
    ];
    let mut container = json!({
        "name": "restore",
        "image": image,
        "args": ["snapshot", "restore", snap.repository, snap.id, target, "--progress-every", "30s"],
        "env": env,
        "securityContext": {
            // Root restores a file tree's owners and modes; nothing else is needed.
            "runAsUser": 0,
            "allowPrivilegeEscalation": false,
            "capabilities": {"drop": ["ALL"], "add": ["CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "MKNOD"]},
        },
        "resources": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    });
    if block {
        container["volumeDevices"] = json!([{"name": "target", "devicePath": target}]);
    } else {
        mounts.push(json!({"name": "target", "mountPath": target}));
    }
    container["volumeMounts"] = Value::Array(mounts);
    serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "labels": {PRIME_FOR: uid}},
        "spec": {
            "backoffLimit": 4,
            // 2: refused (no such snapshot, a wrong password); 3: damaged data. Retrying
            // changes neither; 1 (failed part way) is retried and resumes.
            "podFailurePolicy": {"rules": [{"action": "FailJob", "onExitCodes": {
                "containerName": "restore", "operator": "In", "values": [2, 3]}}]},
            "template": {
                "metadata": {"labels": {PRIME_FOR: uid}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [container],
                    "volumes": [
                        {"name": "target", "persistentVolumeClaim": {"claimName": prime.name_any()}},
                        {"name": "repository", "secret": {"secretName": secret.name,
                            "items": [{"key": key_file, "path": key_file}]}},
                        {"name": "cache", "emptyDir": {}},
                    ],
                },
            },
        },
    }))
    .expect("a Job")
}

#[derive(Debug, PartialEq)]
enum Outcome {
    Running,
    Succeeded,
    Failed(String),
}

/// Where a Job is, by its conditions.
fn job_outcome(job: &Job) -> Outcome {
    let conditions = job
        .status
        .as_ref()
        .and_then(|s| s.conditions.clone())
        .unwrap_or_default();
    for c in conditions.iter().filter(|c| c.status == "True") {
        match c.type_.as_str() {
            "Complete" => return Outcome::Succeeded,
            "Failed" => {
                return Outcome::Failed(
                    [c.reason.as_deref(), c.message.as_deref()]
                        .into_iter()
                        .flatten()
                        .collect::<Vec<_>>()
                        .join(": "),
                );
            }
            _ => {}
        }
    }
    Outcome::Running
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pvc(mode: &str) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "db", "namespace": "app", "uid": "u1",
                         "annotations": {"volume.kubernetes.io/selected-node": "n2"}},
            "spec": {"accessModes": ["ReadWriteOnce"], "volumeMode": mode,
                     "storageClassName": "fast",
                     "resources": {"requests": {"storage": "4Gi"}},
                     "dataSourceRef": {"apiGroup": "replication.mover", "kind": "HydrationSource", "name": "s"}},
        }))
        .unwrap()
    }

    #[test]
    fn the_prime_pvc_is_the_users_without_its_data_source_on_its_node() {
        let p = prime_pvc(&pvc("Block"), "prime-u1");
        let spec = p.spec.clone().unwrap();
        assert_eq!(spec.storage_class_name.as_deref(), Some("fast"));
        assert_eq!(spec.volume_mode.as_deref(), Some("Block"));
        assert!(spec.data_source_ref.is_none(), "no populator of its own");
        assert_eq!(p.annotations()["volume.kubernetes.io/selected-node"], "n2");
        assert_eq!(p.labels()[PRIME_FOR], "u1");
        assert_eq!(p.annotations()[PRIME_OF], "app/db");
    }

    #[test]
    fn a_prime_pvc_is_orphaned_once_its_users_pvc_is_gone_going_or_another() {
        let user = pvc("Block");
        assert!(!orphaned(Some(&user), "u1"));
        assert!(orphaned(None, "u1"));
        assert!(
            orphaned(Some(&user), "u0"),
            "a PVC made again under the same name"
        );
        let mut going = user.clone();
        going.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                "2026-11-30T00:00:00Z".parse().unwrap(),
            ));
        assert!(orphaned(Some(&going), "u1"));
    }

    #[test]
    fn the_job_restores_onto_the_device_or_into_the_file_system() {
        let snap = RepositorySnapshot {
            repository: "s3://dr/pg".into(),
            id: "latest".into(),
            s3_endpoint: Some("http://s3:9000".into()),
            s3_region: None,
        };
        let secret = SecretRef {
            name: "repo".into(),
            namespace: "mover-system".into(),
        };
        let block = prime_pvc(&pvc("Block"), "prime-u1");
        let job = serde_json::to_value(restore_job(
            "populate-u1",
            &block,
            &snap,
            &secret,
            "key",
            "u1",
            "mover:1",
        ))
        .unwrap();
        let c = &job["spec"]["template"]["spec"]["containers"][0];
        assert_eq!(
            c["args"].as_array().unwrap()[..5],
            json!([
                "snapshot",
                "restore",
                "s3://dr/pg",
                "latest",
                "/dev/mover-target"
            ])
            .as_array()
            .unwrap()[..]
        );
        assert_eq!(c["volumeDevices"][0]["devicePath"], "/dev/mover-target");
        assert_eq!(c["image"], "mover:1");
        let env = c["env"].as_array().unwrap();
        assert!(env.iter().any(|e| e["name"] == "MOVER_KEY_FILE" && e["value"] == "/etc/mover/repository/key"));
        assert!(env.iter().any(|e| e["name"] == "MOVER_S3_ENDPOINT"));
        assert!(!env.iter().any(|e| e["name"] == "MOVER_S3_REGION"));
        let fs = prime_pvc(&pvc("Filesystem"), "prime-u1");
        let job = serde_json::to_value(restore_job(
            "populate-u1",
            &fs,
            &snap,
            &secret,
            "password",
            "u1",
            "mover",
        ))
        .unwrap();
        let c = &job["spec"]["template"]["spec"]["containers"][0];
        assert!(c["volumeDevices"].is_null());
        assert!(
            c["volumeMounts"]
                .as_array()
                .unwrap()
                .iter()
                .any(|m| m["mountPath"] == "/mnt/target")
        );
    }

    #[test]
    fn a_job_is_done_when_a_condition_says_so() {
        let job = |conditions: Value| -> Job {
            serde_json::from_value(
                json!({"metadata": {"name": "j"}, "status": {"conditions": conditions}}),
            )
            .unwrap()
        };
        assert_eq!(job_outcome(&job(json!([]))), Outcome::Running);
        assert_eq!(
            job_outcome(&job(json!([{"type": "Complete", "status": "True"}]))),
            Outcome::Succeeded
        );
        assert_eq!(
            job_outcome(&job(
                json!([{"type": "Failed", "status": "True", "reason": "PodFailurePolicy", "message": "exit code 2"}])
            )),
            Outcome::Failed("PodFailurePolicy: exit code 2".into())
        );
        assert_eq!(
            job_outcome(&job(json!([{"type": "Failed", "status": "False"}]))),
            Outcome::Running
        );
    }
}
