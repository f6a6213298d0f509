//! A HydrationSource's deletion. Its finalizer rolls back what was begun for the PVCs
//! that name it and are not bound yet: the volume an agent made and fills for one
//! (populator), or the prime PVC and restore Job (prime). A PVC already bound keeps its
//! volume: the fill goes on without the HydrationSource (its agent keeps the source),
//! and the PV's reclaim policy decides its end ([`super::reclaim`]). The PVCs left
//! unbound stay Pending and say their source is gone.

use super::{PopulateError, SELECTED_NODE, populator::source_of};
use crate::context::{Context, owned};
use crate::crd::HydrationSource;
use k8s_openapi::api::{core::v1::PersistentVolumeClaim, storage::v1::StorageClass};
use kube::{
    Api, ResourceExt,
    api::ListParams,
    runtime::{
        controller::Action,
        finalizer::{Event, finalizer},
    },
};
use std::sync::Arc;

/// The finalizer on a HydrationSource.
pub const FINALIZER: &str = "replication.mover/hydration-source";

/// Why a HydrationSource's deletion could not finish (yet).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct SourceError(Box<kube::runtime::finalizer::Error<PopulateError>>);

/// Holds a HydrationSource's deletion until what it began for unbound PVCs is undone.
pub async fn reconcile(hs: Arc<HydrationSource>, ctx: Arc<Context>) -> Result<Action, SourceError> {
    let ns = hs.namespace().unwrap_or_default();
    let api = Api::<HydrationSource>::namespaced(ctx.client.clone(), &ns);
    finalizer(&api, FINALIZER, hs, |event| async {
        match event {
            Event::Apply(_) => Ok(Action::await_change()),
            Event::Cleanup(hs) => roll_back(&hs, &ctx).await,
        }
    })
    .await
    .map_err(|e| SourceError(Box::new(e)))
}

/// Undoes the fills of the unbound PVCs naming `hs`.
async fn roll_back(hs: &HydrationSource, ctx: &Context) -> Result<Action, PopulateError> {
    let (ns, name) = (hs.namespace().unwrap_or_default(), hs.name_any());
    let pvcs = Api::<PersistentVolumeClaim>::namespaced(ctx.client.clone(), &ns)
        .list(&ListParams::default())
        .await
        .map_err(|source| PopulateError::Kube {
            what: format!("listing PVCs in {ns}"),
            source,
        })?;
    let unbound = pvcs.items.iter().filter(|p| {
        source_of(p).as_deref() == Some(name.as_str())
            && p.spec
                .as_ref()
                .and_then(|s| s.volume_name.as_deref())
                .unwrap_or("")
                .is_empty()
    });
    for pvc in unbound {
        let uid = pvc.uid().unwrap_or_default();
        let what = format!("PVC {ns}/{}", pvc.name_any());
        let class = pvc
            .spec
            .as_ref()
            .and_then(|s| s.storage_class_name.clone())
            .unwrap_or_default();
        let provisioner = Api::<StorageClass>::all(ctx.client.clone())
            .get_opt(&class)
            .await
            .map_err(|source| PopulateError::Kube {
                what: format!("reading StorageClass {class:?} of {what}"),
                source,
            })?
            .map(|sc| sc.provisioner);
        if provisioner.as_deref() != Some(transport::cluster::CSI_DRIVER) {
            if let Some(secret) = &hs.spec.secret_ref {
                super::prime::roll_back(ctx, &secret.namespace, &uid).await?;
            }
            continue;
        }
        // A fill starts only once the scheduler has chosen the node.
        let Some(node) = pvc.annotations().get(SELECTED_NODE) else {
            continue;
        };
        let pods = owned(&ctx.caches.agents);
        let agent = crate::replication::desired::agent_on(node, &pods, ctx.agent_port)
            .map_err(|e| PopulateError::Invalid(format!("{what}: {e}")))?;
        if ctx
            .agents
            .delete_volume(&agent, &format!("pvc-{uid}"))
            .await?
        {
            tracing::info!(pvc = %what, %node, hydrationsource = %name, "its source deleted: the volume begun for it deleted");
        }
    }
    Ok(Action::await_change())
}

/// Retries a deletion that could not finish.
pub fn error_policy(hs: Arc<HydrationSource>, error: &SourceError, _: Arc<Context>) -> Action {
    tracing::warn!(hydrationsource = %format!("{}/{}", hs.namespace().unwrap_or_default(), hs.name_any()), "{error}");
    Action::requeue(super::WAIT)
}
