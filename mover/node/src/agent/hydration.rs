//! The agent's NBD side: which exports the NBD server offers (plain block exports as
//! they are, hydrating ones through their hydration), and the Hydration control service
//! (`mover hydrate start|status|wait|cancel`).

use super::{
    Exports,
    status::{ServiceError, answer},
};
use crate::hydrate::{
    HydratingVolume, Hydration, Hydrations, LocalVolume, Phase, SourceSpec, StartRequest,
};
use std::{path::PathBuf, sync::Arc};
use tonic::{Request, Response, Status};
use transport::{
    hydrate::{self as proto, hydration_server},
    nbd::{NbdExports, NbdVolume},
};

/// The exports the agent's NBD server offers.
pub struct NbdExportsOf {
    pub(super) exports: Exports,
    pub(super) hydrations: Arc<Hydrations>,
}

impl NbdExports for NbdExportsOf {
    fn list(&self) -> Vec<(String, String)> {
        self.exports
            .names()
            .into_iter()
            .filter_map(|n| Some((self.exports.get(&n).ok()?, n)))
            .filter(|(e, _)| !e.path.is_dir())
            // Only what NBD_OPT_GO would open: a listed export that then refuses to open
            // fails the client's whole listing (`nbdinfo --list` exits 1).
            .filter(|(e, n)| match self.hydrations.get(n) {
                Some(h) => h.progress().phase != Phase::Cancelled,
                None => e.path.exists(),
            })
            .map(|(_, n)| {
                let n = &n;
                // No host paths: they are the node's business, not the client's.
                let what = match self.hydrations.get(n).map(|h| (h.progress(), h.source())) {
                    Some((p, src)) if p.phase != Phase::Complete => {
                        format!("hydrating from {src}: {}/{} regions", p.present, p.regions)
                    }
                    _ => "block volume".to_string(),
                };
                (n.clone(), what)
            })
            .collect()
    }

    fn open(&self, name: &str) -> Result<Arc<dyn NbdVolume>, String> {
        let export = self.exports.get(name).map_err(|e| e.to_string())?;
        if let Some(h) = self.hydrations.get(name) {
            match h.progress().phase {
                Phase::Cancelled => {
                    return Err(format!(
                        "the hydration of {name} was cancelled before it completed; `mover hydrate start` resumes it"
                    ));
                }
                Phase::Complete => {}
                _ => {
                    return Ok(Arc::new(HydratingVolume::new(self.hydrations.clone(), h)));
                }
            }
        }
        if export.path.is_dir() {
            return Err(format!(
                "{name} is a directory (a file tree): NBD serves block exports"
            ));
        }
        LocalVolume::open(&export.path, export.read_only)
            .map(|v| Arc::new(v) as Arc<dyn NbdVolume>)
            .map_err(|e| format!("cannot open {}: {e}", export.path.display()))
    }
}

/// The Hydration control service.
pub struct HydrationControl {
    pub(super) hydrations: Arc<Hydrations>,
    /// The agent's relationships: an export one of them replicates is not hydrated.
    pub(super) store: Arc<crate::replicate::Store>,
    /// The NBD socket clients use (for the URI in status).
    pub(super) nbd_socket: Option<PathBuf>,
    /// The agent's exports, and where it makes those a start asks to create (the CSI
    /// plugin's volumes; `None` without the plugin).
    pub(super) exports: Exports,
    pub(super) volumes: Option<PathBuf>,
    /// The CSI plugin's devices: a volume staged on the node is not deleted.
    pub(super) devices: Option<Arc<super::device::Devices>>,
}

impl HydrationControl {
    fn status(&self, h: &Hydration) -> proto::Status {
        let p = h.progress();
        proto::Status {
            export: h.name().into(),
            source: h.source(),
            phase: format!("{:?}", p.phase),
            size: p.size,
            region_size: p.region_size,
            regions: p.regions,
            present: p.present,
            bytes_fetched: p.bytes_fetched,
            foreground_fetches: p.foreground_fetches,
            foreground_failures: p.foreground_failures,
            regions_written: p.regions_written,
            elapsed_secs: p.elapsed_secs,
            last_error: p.last_error.unwrap_or_default(),
            nbd_uri: self
                .nbd_socket
                .as_ref()
                .map(|s| format!("nbd+unix:///{}?socket={}", h.name(), s.display()))
                .unwrap_or_default(),
        }
    }

    /// Makes `export` a sparse image in the CSI plugin's volumes, served to no
    /// relationship; the hydration sizes it.
    fn create_export(&self, export: &str) -> Result<(), ServiceError> {
        let dir = self.volumes.as_ref().ok_or_else(|| {
            ServiceError::FailedPrecondition(format!(
                "export {export:?} does not exist and this agent makes none: set csi_socket \
                 in agent.toml (its CSI plugin's volumes live in csi_volumes)"
            ))
        })?;
        std::fs::create_dir_all(dir).map_err(|e| {
            ServiceError::FailedPrecondition(format!("cannot make {}: {e}", dir.display()))
        })?;
        let path = super::csi::volume_file(dir, export);
        self.exports
            .register(export, &path, false, "", None)
            .map_err(|e| ServiceError::FailedPrecondition(e.to_string()))?;
        Ok(())
    }

    /// Deletes `export`, a volume [`Self::create_export`] made: its hydration, image and
    /// registration. False if nothing of it was left.
    async fn delete_created(&self, export: &str) -> Result<bool, ServiceError> {
        let refused = |why: String| ServiceError::FailedPrecondition(why);
        let Some(dir) = &self.volumes else {
            return Err(refused(
                "this agent makes no volumes (no csi_socket in agent.toml), so it deletes none"
                    .into(),
            ));
        };
        let image = super::csi::volume_file(dir, export);
        let made_by_create = match self.exports.registered_path(export) {
            Some(path) => path == image,
            // Unknown (gone already), or named in agent.toml.
            None => self.exports.get(export).is_err(),
        };
        if !made_by_create {
            return Err(refused(format!(
                "export {export:?} was not made by a hydration's start (create): this deletes \
                 only those; unexport it instead"
            )));
        }
        if let Some(devices) = self.devices.clone() {
            let name = export.to_string();
            let attached = tokio::task::spawn_blocking(move || devices.attached_to(&name))
                .await
                .map_err(|e| ServiceError::Internal(e.to_string()))?;
            if let Some(device) = attached {
                return Err(refused(format!(
                    "volume {export} is staged on this node as {}: its pod still uses it \
                     (NodeUnstageVolume first)",
                    device.display()
                )));
            }
        }
        let forgotten = self.hydrations.forget(export).await?;
        let removed = match std::fs::remove_file(&image) {
            Ok(()) => true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => {
                return Err(ServiceError::Internal(format!(
                    "cannot remove {}: {e}",
                    image.display()
                )));
            }
        };
        let unregistered = self
            .exports
            .unregister(export)
            .map_err(|e| ServiceError::Internal(e.to_string()))?;
        let deleted = forgotten || removed || unregistered;
        if deleted {
            tracing::info!(export, image = %image.display(), "volume deleted");
        }
        Ok(deleted)
    }

    fn get(&self, export: &str) -> Result<Arc<Hydration>, ServiceError> {
        self.hydrations.get(export).ok_or_else(|| {
            ServiceError::NotFound(format!(
                "export {export:?} has no hydration on this agent (finished ones are forgotten when the agent restarts)"
            ))
        })
    }
}

#[tonic::async_trait]
impl hydration_server::Hydration for HydrationControl {
    async fn start(
        &self,
        req: Request<proto::StartRequest>,
    ) -> Result<Response<proto::Status>, Status> {
        answer(async {
            let r = req.into_inner();
            if let Some(rel) = self.store.all().iter().find(|x| x.spec.volume == r.export) {
                return Err(ServiceError::FailedPrecondition(format!(
                    "export {} is the volume of replication relationship {}: delete it first (`mover replicate delete`)",
                    r.export, rel.spec.name
                )));
            }
            let opt = |s: String| (!s.is_empty()).then_some(s);
            let source = match r.source {
                Some(proto::start_request::Source::Agent(url)) => SourceSpec::Agent {
                    url,
                    peer: opt(r.peer_token.clone()).map(|token| crate::hydrate::PeerAccess {
                        token,
                        ca: opt(r.peer_ca.clone()),
                    }),
                    replica: opt(r.replica_of.clone()).map(|relationship| {
                        crate::hydrate::ReplicaHold {
                            relationship,
                            hold: r.export.clone(),
                            cycle: 0,
                        }
                    }),
                    reader: opt(r.reader.clone()),
                },
                Some(proto::start_request::Source::Snapshot(s)) => SourceSpec::Snapshot {
                    repo: s.repo,
                    snapshot: s.snapshot,
                    s3_endpoint: opt(s.s3_endpoint),
                    s3_region: opt(s.s3_region),
                    s3_virtual_host: s.s3_virtual_host,
                    password_file: opt(s.password_file).map(PathBuf::from),
                    key_file: opt(s.key_file).map(PathBuf::from),
                    access: (!s.password.is_empty()).then(|| crate::hydrate::RepoAccess {
                        password: s.password,
                        raw_key: s.raw_key,
                        s3_keys: opt(s.s3_access_key_id).map(|id| (id, s.s3_secret_access_key)),
                    }),
                },
                None => {
                    return Err(ServiceError::InvalidArgument(
                        "no source: give an agent URL or a snapshot".into(),
                    ));
                }
            };
            if r.create && self.exports.get(&r.export).is_err() {
                self.create_export(&r.export)?;
            }
            let h = self
                .hydrations
                .start(StartRequest {
                    export: r.export,
                    source,
                    region_size: r.region_size,
                    bwlimit: (r.bwlimit > 0).then_some(r.bwlimit),
                    concurrency: r.concurrency as usize,
                    overwrite: r.overwrite,
                })
                .await?;
            Ok(self.status(&h))
        })
        .await
    }

    async fn get(
        &self,
        req: Request<proto::NameRequest>,
    ) -> Result<Response<proto::Status>, Status> {
        answer(async {
            let h = self.get(&req.into_inner().export)?;
            Ok(self.status(&h))
        })
        .await
    }

    async fn list(
        &self,
        _req: Request<proto::ListRequest>,
    ) -> Result<Response<proto::ListResponse>, Status> {
        Ok(Response::new(proto::ListResponse {
            hydrations: self
                .hydrations
                .all()
                .iter()
                .map(|h| self.status(h))
                .collect(),
        }))
    }

    async fn cancel(
        &self,
        req: Request<proto::NameRequest>,
    ) -> Result<Response<proto::Status>, Status> {
        answer(async {
            let h = self.hydrations.cancel(&req.into_inner().export).await?;
            Ok(self.status(&h))
        })
        .await
    }

    async fn delete(
        &self,
        req: Request<proto::NameRequest>,
    ) -> Result<Response<proto::DeleteResponse>, Status> {
        answer(async {
            let deleted = self.delete_created(&req.into_inner().export).await?;
            Ok(proto::DeleteResponse { deleted })
        })
        .await
    }
}
