//! The Locator a peer cluster's agents ask where this cluster keeps a relationship's
//! volume (`proto/locate.proto`): from the controller's caches, so every replica
//! answers (a standby's caches are warm) and an answer costs the API server nothing.

use super::context::{Context, secret_data, typed};
use super::crd::VolumeReplication;
use super::replication::desired::relationship_name;
use super::replication::reconcile::{peer_credential_of, resolve};
use kube::api::DynamicObject;
use kube::runtime::reflector::Store;
use std::sync::Arc;
use tonic::{Request, Response, Status};
use transport::locate::{LocateRequest, LocateResponse, locator_server::Locator};

/// The Locator of this cluster.
pub struct LocatorService {
    /// The VolumeReplications' cache.
    pub vrs: Store<DynamicObject>,
    /// The caches a relationship's placement is read from.
    pub ctx: Arc<Context>,
}

#[tonic::async_trait]
impl Locator for LocatorService {
    async fn locate(
        &self,
        req: Request<LocateRequest>,
    ) -> Result<Response<LocateResponse>, Status> {
        let caller = req.extensions().get::<transport::auth::Caller>().cloned();
        let name = req.into_inner().relationship;
        let claiming: Vec<VolumeReplication> = self
            .vrs
            .state()
            .iter()
            .filter(|o| o.metadata.deletion_timestamp.is_none())
            .filter_map(|o| typed::<VolumeReplication>(o).ok())
            .filter(|v| relationship_name(v) == name)
            .collect();
        // A replicationHandle is any user's to write: an answer only for one secondary.
        let vr = match claiming.as_slice() {
            [] => {
                return Err(Status::not_found(format!(
                    "no VolumeReplication of relationship {name:?} in this cluster: create the \
                     secondary's (the same replicationHandle, or the same namespace and name)"
                )));
            }
            [one] => one,
            several => {
                return Err(Status::failed_precondition(format!(
                    "{} VolumeReplications claim relationship {name:?} in this cluster: the \
                     Locator answers for one only; give the others another replicationHandle",
                    several.len()
                )));
            }
        };
        // A primary is answered too: its agent refuses the cycle and tells a fenced old
        // primary so (what a forced failover's return needs to learn).
        let d = resolve(vr, &self.ctx).map_err(|i| {
            Status::failed_precondition(format!(
                "the secondary of relationship {name:?} cannot be placed here yet: {i}"
            ))
        })?;
        // A relationship bound to a peer credential (its class secret's
        // peer-credential) is located for that peer's token alone.
        if let Some(c) = &caller {
            let bound = match &d.params.secret {
                Some((ns, secret)) => {
                    let wanted = "the class's peer credential";
                    let (data, _) = secret_data(&self.ctx, ns, secret, wanted)
                        .await
                        .map_err(Status::failed_precondition)?;
                    peer_credential_of(&data, ns, secret).map_err(Status::failed_precondition)?
                }
                None => None,
            };
            transport::auth::check_binding(
                c,
                &name,
                bound.as_deref(),
                transport::auth::Act::Status,
            )
            .map_err(Status::permission_denied)?;
        }
        Ok(Response::new(LocateResponse {
            volume: format!("agent://{}@{}/{}", d.node, d.agent, d.volume),
        }))
    }
}
