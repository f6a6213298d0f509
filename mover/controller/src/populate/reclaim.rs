//! A populated volume's end. Its PV carries its StorageClass's reclaim policy, like a
//! provisioned one. mover's CSI driver has no provisioner, so the controller is the
//! PV's external deleter: the PV names the driver in `pv.kubernetes.io/provisioned-by`,
//! which tells kube-controller-manager to leave a released PV to it.
//! - **Released, policy Delete** (its PVC deleted): the agent on its node deletes the
//!   volume (its fill, image and export), then the PV is deleted.
//! - **Deleted by hand** (the finalizer holds the PV): the same when its policy is
//!   Delete. With Retain the image stays on the node: the log says where, and
//!   `mover hydrate delete` removes it.
//!
//! A volume still staged (its pod not yet gone) is retried until it is not. A PV whose
//! node is gone lets go: the image went with the node.

use super::{PopulateError, WAIT};
use crate::context::{Context, deleted_or_gone, node_exists, owned};
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, Patch, PatchParams},
    runtime::controller::Action,
};
use std::sync::Arc;

/// The finalizer on a populated PV: its image is deleted (policy Delete) before it goes.
pub const IMAGE_FINALIZER: &str = "replication.mover/populated-image";
/// The annotation that makes kube-controller-manager leave a released PV to its
/// provisioner (here, the controller).
pub const PROVISIONED_BY: &str = "pv.kubernetes.io/provisioned-by";

/// What a populated PV's end asks of the controller.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// Nothing yet: bound, or released and retained.
    Keep,
    /// Delete the volume on its node, then the PV (`deleting`: already under way).
    Delete { deleting: bool },
    /// Deleted with policy Retain: the image stays; let the PV go.
    LetGo,
}

fn end_of(pv: &PersistentVolume) -> End {
    let deleting = pv.metadata.deletion_timestamp.is_some();
    let held = pv.finalizers().iter().any(|f| f == IMAGE_FINALIZER);
    let phase = pv.status.as_ref().and_then(|s| s.phase.as_deref());
    // A PV deleted while its claim still holds it waits (as kube's pv-protection does)
    // until the claim lets go: its data is not deleted under a bound PVC.
    let released = phase == Some("Released");
    let unbound = phase != Some("Bound");
    let delete = pv
        .spec
        .as_ref()
        .and_then(|s| s.persistent_volume_reclaim_policy.as_deref())
        == Some("Delete");
    match (delete, deleting && held, released, unbound) {
        (true, true, _, true) => End::Delete { deleting: true },
        (true, false, true, _) => End::Delete { deleting },
        (false, true, _, true) => End::LetGo,
        _ => End::Keep,
    }
}

/// The node a populated PV is pinned to.
fn pinned_node(pv: &PersistentVolume) -> Option<String> {
    let terms = &pv
        .spec
        .as_ref()?
        .node_affinity
        .as_ref()?
        .required
        .as_ref()?;
    terms
        .node_selector_terms
        .iter()
        .flat_map(|t| t.match_expressions.iter().flatten())
        .find(|e| e.key == "kubernetes.io/hostname" && e.operator == "In")
        .and_then(|e| e.values.as_ref()?.first().cloned())
}

/// Ends one populated PV as its reclaim policy says.
pub async fn reconcile(
    pv: Arc<PersistentVolume>,
    ctx: Arc<Context>,
) -> Result<Action, PopulateError> {
    let name = pv.name_any();
    let node = pinned_node(&pv).unwrap_or_default();
    let api = Api::<PersistentVolume>::all(ctx.client.clone());
    let kube = |what: String| move |source| PopulateError::Kube { what, source };
    match end_of(&pv) {
        End::Keep => return Ok(Action::await_change()),
        End::LetGo => {
            tracing::info!(pv = %name, %node, "populated PV deleted with policy Retain: its image stays on the node (`mover hydrate delete {name}` there removes it)");
        }
        End::Delete { deleting } => {
            let pods = owned(&ctx.caches.agents);
            match crate::replication::desired::agent_on(&node, &pods, ctx.agent_port) {
                Ok(agent) => match ctx.agents.delete_volume(&agent, &name).await {
                    Ok(deleted) => {
                        tracing::info!(pv = %name, %node, deleted, "populated volume deleted (reclaim policy Delete)")
                    }
                    Err(e) if e.is_precondition() => {
                        tracing::info!(pv = %name, %node, "populated volume not deleted yet: {e}");
                        return Ok(Action::requeue(WAIT));
                    }
                    Err(e) => return Err(e.into()),
                },
                Err(_) if !node_exists(&ctx, &node) => {
                    tracing::warn!(pv = %name, %node, "the node of a populated volume is gone, and its image with it");
                }
                Err(e) => return Err(PopulateError::Invalid(format!("PV {name}: {e}"))),
            }
            if !deleting {
                deleted_or_gone(api.delete(&name, &DeleteParams::default()).await)
                    .map_err(kube(format!("deleting released PV {name}")))?;
                // Its deletion is the next change: the finalizer goes then.
                return Ok(Action::await_change());
            }
        }
    }
    // The finalizer goes last, and only from the version read: a PV changed meanwhile
    // is looked at again.
    let rest: Vec<&String> = pv
        .finalizers()
        .iter()
        .filter(|f| *f != IMAGE_FINALIZER)
        .collect();
    let patch = serde_json::json!({"metadata": {
        "finalizers": rest, "resourceVersion": pv.resource_version(),
    }});
    match api
        .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        r => {
            r.map_err(kube(format!("removing PV {name}'s finalizer")))?;
        }
    }
    Ok(Action::await_change())
}

/// Retries a PV whose end could not be carried out.
pub fn error_policy(pv: Arc<PersistentVolume>, error: &PopulateError, _: Arc<Context>) -> Action {
    tracing::warn!(pv = %pv.name_any(), "cannot end a populated volume: {error}");
    Action::requeue(WAIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pv(policy: &str, phase: &str, deleting: bool, held: bool) -> PersistentVolume {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "pvc-1",
                "deletionTimestamp": deleting.then_some("2026-11-30T00:00:00Z"),
                "finalizers": if held { vec![IMAGE_FINALIZER, "kubernetes.io/pv-protection"] } else { vec!["kubernetes.io/pv-protection"] },
            },
            "spec": {
                "persistentVolumeReclaimPolicy": policy,
                "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n2"]}
                ]}]}},
            },
            "status": {"phase": phase},
        }))
        .unwrap()
    }

    #[test]
    fn a_populated_pv_ends_as_its_reclaim_policy_says() {
        assert_eq!(end_of(&pv("Delete", "Bound", false, true)), End::Keep);
        assert_eq!(
            end_of(&pv("Delete", "Released", false, true)),
            End::Delete { deleting: false }
        );
        assert_eq!(
            end_of(&pv("Delete", "Released", true, true)),
            End::Delete { deleting: true }
        );
        // Deleted while its claim still holds it: the data stays until the claim goes.
        assert_eq!(end_of(&pv("Delete", "Bound", true, true)), End::Keep);
        assert_eq!(end_of(&pv("Retain", "Released", false, true)), End::Keep);
        assert_eq!(end_of(&pv("Retain", "Released", true, true)), End::LetGo);
        // Without the finalizer (a PV made before it, its policy set to Delete by hand):
        // its volume is deleted all the same, as long as the PV is still seen.
        assert_eq!(
            end_of(&pv("Delete", "Released", true, false)),
            End::Delete { deleting: true }
        );
        assert_eq!(
            pinned_node(&pv("Delete", "Bound", false, true)).as_deref(),
            Some("n2")
        );
    }
}
