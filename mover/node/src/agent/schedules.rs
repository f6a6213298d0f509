//! The Schedules service: scheduled snapshots of this agent's exports (`mover snapshot
//! schedule ...`, and the controller for classes whose target is a repository).

use super::status::{ServiceError, answer};
use crate::schedule::Schedules;
use std::sync::Arc;
use tonic::{Request, Response, Status};
use transport::schedule::{self as proto, schedules_server};

/// The Schedules service of one agent.
pub struct ScheduleControl {
    pub(super) schedules: Arc<Schedules>,
    /// The agent's relationships: an export one of them replicates into is not the
    /// source of a schedule (it is rewritten by cycles).
    pub(super) store: Arc<crate::replicate::Store>,
}

fn not_found(name: &str) -> ServiceError {
    ServiceError::NotFound(format!(
        "no schedule {name:?} on this agent; `mover snapshot schedule status` lists them"
    ))
}

#[tonic::async_trait]
impl schedules_server::Schedules for ScheduleControl {
    async fn apply(&self, req: Request<proto::Spec>) -> Result<Response<proto::Status>, Status> {
        answer(async {
            let spec = req.into_inner();
            let secondary = self.store.all().into_iter().find(|r| {
                r.spec.volume == spec.volume && r.role == crate::replicate::Role::Secondary
            });
            if let Some(r) = secondary {
                return Err(ServiceError::FailedPrecondition(format!(
                    "export {:?} is the secondary of relationship {:?}: snapshot its primary \
                     instead",
                    spec.volume, r.spec.name
                )));
            }
            let status = self.schedules.apply(spec)?;
            Ok(status)
        })
        .await
    }

    async fn get(
        &self,
        req: Request<proto::NameRequest>,
    ) -> Result<Response<proto::Status>, Status> {
        answer(async {
            let name = req.into_inner().name;
            let status = self
                .schedules
                .status(&name)
                .ok_or_else(|| not_found(&name))?;
            Ok(status)
        })
        .await
    }

    async fn list(
        &self,
        _req: Request<proto::ListRequest>,
    ) -> Result<Response<proto::ListResponse>, Status> {
        Ok(Response::new(proto::ListResponse {
            schedules: self.schedules.list(),
        }))
    }

    async fn delete(
        &self,
        req: Request<proto::NameRequest>,
    ) -> Result<Response<proto::Status>, Status> {
        answer(async {
            let name = req.into_inner().name;
            match self.schedules.delete(&name).await {
                Ok(Some(status)) => Ok(status),
                Ok(None) => Err(not_found(&name)),
                Err(e) => Err(ServiceError::Internal(e)),
            }
        })
        .await
    }

    async fn run(
        &self,
        req: Request<proto::NameRequest>,
    ) -> Result<Response<proto::Status>, Status> {
        answer(async {
            let name = req.into_inner().name;
            if self.schedules.status(&name).is_none() {
                return Err(not_found(&name));
            }
            let status = self
                .schedules
                .run(&name)
                .await
                .map_err(ServiceError::Internal)?;
            Ok(status)
        })
        .await
    }
}
