//! The CSI Controller service: empty volumes on this node, as sparse image files.
//! A volume's id is `v-` and a hash of its name, so a CreateVolume repeated by the
//! provisioner (after a timeout, a restart) finds the volume it made.

use super::{Plugin, required, single_node};
use std::path::PathBuf;
use tonic::{Request, Response, Status};
use transport::csi::{self as proto, controller_server::Controller};

/// A volume without a requested size.
const DEFAULT_SIZE: u64 = 1 << 30;
/// Sizes are whole 4 KiB blocks (what a loop device and a file system need).
const BLOCK: u64 = 4096;

impl Plugin {
    fn volume_path(&self, id: &str) -> PathBuf {
        super::volume_file(&self.volumes, id)
    }

    /// Whether `id` names a volume this plugin made (not another export).
    fn made_here(&self, id: &str) -> bool {
        id.starts_with("v-")
            && self
                .exports
                .registered_path(id)
                .is_some_and(|p| p == self.volume_path(id))
    }
}

/// The size to make: `required` rounded up to whole blocks, within `limit`.
fn size_for(range: Option<&proto::CapacityRange>) -> Result<u64, Status> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if required < 0 || limit < 0 {
        return Err(Status::out_of_range("capacity_range may not be negative"));
    }
    let (required, limit) = (required as u64, limit as u64);
    let want = if required == 0 {
        if limit > 0 {
            limit.min(DEFAULT_SIZE)
        } else {
            DEFAULT_SIZE
        }
    } else {
        required
    };
    let size = want.div_ceil(BLOCK) * BLOCK;
    if limit > 0 && size > limit {
        return Err(Status::out_of_range(format!(
            "{required} bytes rounded up to whole 4 KiB blocks is {size}, over limit_bytes {limit}"
        )));
    }
    Ok(size)
}

#[tonic::async_trait]
impl Controller for Plugin {
    async fn create_volume(
        &self,
        request: Request<proto::CreateVolumeRequest>,
    ) -> Result<Response<proto::CreateVolumeResponse>, Status> {
        let req = request.into_inner();
        let name = required(&req.name, "name")?.to_string();
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        req.volume_capabilities.iter().try_for_each(single_node)?;
        if req.volume_content_source.is_some() {
            return Err(Status::invalid_argument(
                "volume_content_source is not served: a PVC with data comes from mover's \
                 volume populator (spec.dataSourceRef), not from CreateVolume",
            ));
        }
        let size = size_for(req.capacity_range.as_ref())?;
        if let Some(acc) = &req.accessibility_requirements {
            let here = self.topology();
            let reachable = acc.requisite.is_empty() || acc.requisite.contains(&here);
            if !reachable {
                return Err(Status::resource_exhausted(format!(
                    "this plugin makes volumes on node {} only; the requisite topology \
                     names others (run a csi-provisioner with --node-deployment per node)",
                    self.node
                )));
            }
        }
        let id = format!("v-{}", mover_engine::node::name_hash(&name));
        let path = self.volume_path(&id);
        let plugin = self.clone();
        let (id_, path_, name_) = (id.clone(), path.clone(), name.clone());
        super::blocking(move || {
            std::fs::create_dir_all(&plugin.volumes)
                .map_err(|e| Status::internal(format!("{}: {e}", plugin.volumes.display())))?;
            match std::fs::metadata(&path_) {
                Ok(m) if m.len() == size => {}
                Ok(m) => {
                    return Err(Status::already_exists(format!(
                        "volume {name_:?} exists with {} bytes, not {size}",
                        m.len(),
                    )));
                }
                Err(_) => {
                    // Made whole under a temporary name, so a crash never leaves a
                    // volume of the wrong size under the real one.
                    let tmp = path_.with_extension("img.tmp");
                    let f = std::fs::File::create(&tmp)
                        .and_then(|f| f.set_len(size).and(f.sync_all()))
                        .and_then(|()| std::fs::rename(&tmp, &path_));
                    f.map_err(|e| {
                        Status::internal(format!("cannot make {}: {e}", path_.display()))
                    })?;
                }
            }
            plugin
                .exports
                .register(&id_, &path_, false, "", None)
                .map_err(|e| Status::internal(e.to_string()))?;
            Ok(())
        })
        .await?;
        tracing::info!(volume = %id, %name, size, "CSI volume made");
        Ok(Response::new(proto::CreateVolumeResponse {
            volume: Some(proto::Volume {
                capacity_bytes: size as i64,
                volume_id: id,
                volume_context: Default::default(),
                content_source: None,
                accessible_topology: vec![self.topology()],
            }),
        }))
    }

    async fn delete_volume(
        &self,
        request: Request<proto::DeleteVolumeRequest>,
    ) -> Result<Response<proto::DeleteVolumeResponse>, Status> {
        let id = required(&request.get_ref().volume_id, "volume_id")?.to_string();
        if self.devices.device(&id).is_some() {
            return Err(Status::failed_precondition(format!(
                "volume {id} is staged on node {}: NodeUnstageVolume first",
                self.node
            )));
        }
        if self.exports.get(&id).is_ok() && !self.made_here(&id) {
            return Err(Status::failed_precondition(format!(
                "{id} is an export this plugin did not make; it deletes only its own volumes"
            )));
        }
        let plugin = self.clone();
        super::blocking(move || {
            let path = plugin.volume_path(&id);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Status::internal(format!(
                        "cannot remove {}: {e}",
                        path.display()
                    )));
                }
                _ => {}
            }
            plugin
                .exports
                .unregister(&id)
                .map_err(|e| Status::internal(e.to_string()))?;
            Ok(())
        })
        .await?;
        // An unknown id is deleted already (CSI: DeleteVolume is idempotent).
        Ok(Response::new(proto::DeleteVolumeResponse {}))
    }

    async fn validate_volume_capabilities(
        &self,
        request: Request<proto::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<proto::ValidateVolumeCapabilitiesResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume_id")?;
        if req.volume_capabilities.is_empty() {
            return Err(Status::invalid_argument("volume_capabilities are required"));
        }
        if self.exports.get(id).is_err() {
            return Err(Status::not_found(format!(
                "no volume {id} on node {}",
                self.node
            )));
        }
        Ok(Response::new(
            match req.volume_capabilities.iter().try_for_each(single_node) {
                Ok(()) => proto::ValidateVolumeCapabilitiesResponse {
                    confirmed: Some(proto::validate_volume_capabilities_response::Confirmed {
                        volume_context: req.volume_context,
                        volume_capabilities: req.volume_capabilities,
                        parameters: req.parameters,
                        mutable_parameters: req.mutable_parameters,
                    }),
                    message: String::new(),
                },
                Err(why) => proto::ValidateVolumeCapabilitiesResponse {
                    confirmed: None,
                    message: why.message().to_string(),
                },
            },
        ))
    }

    async fn controller_get_capabilities(
        &self,
        _: Request<proto::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<proto::ControllerGetCapabilitiesResponse>, Status> {
        use proto::controller_service_capability::{Rpc, Type, rpc::Type as R};
        Ok(Response::new(proto::ControllerGetCapabilitiesResponse {
            capabilities: vec![proto::ControllerServiceCapability {
                r#type: Some(Type::Rpc(Rpc {
                    r#type: R::CreateDeleteVolume as i32,
                })),
            }],
        }))
    }

    async fn controller_publish_volume(
        &self,
        _: Request<proto::ControllerPublishVolumeRequest>,
    ) -> Result<Response<proto::ControllerPublishVolumeResponse>, Status> {
        Err(unimplemented("ControllerPublishVolume"))
    }

    async fn controller_unpublish_volume(
        &self,
        _: Request<proto::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<proto::ControllerUnpublishVolumeResponse>, Status> {
        Err(unimplemented("ControllerUnpublishVolume"))
    }

    async fn list_volumes(
        &self,
        _: Request<proto::ListVolumesRequest>,
    ) -> Result<Response<proto::ListVolumesResponse>, Status> {
        Err(unimplemented("ListVolumes"))
    }

    async fn get_capacity(
        &self,
        _: Request<proto::GetCapacityRequest>,
    ) -> Result<Response<proto::GetCapacityResponse>, Status> {
        Err(unimplemented("GetCapacity"))
    }

    async fn create_snapshot(
        &self,
        _: Request<proto::CreateSnapshotRequest>,
    ) -> Result<Response<proto::CreateSnapshotResponse>, Status> {
        Err(unimplemented("CreateSnapshot"))
    }

    async fn delete_snapshot(
        &self,
        _: Request<proto::DeleteSnapshotRequest>,
    ) -> Result<Response<proto::DeleteSnapshotResponse>, Status> {
        Err(unimplemented("DeleteSnapshot"))
    }

    async fn list_snapshots(
        &self,
        _: Request<proto::ListSnapshotsRequest>,
    ) -> Result<Response<proto::ListSnapshotsResponse>, Status> {
        Err(unimplemented("ListSnapshots"))
    }

    async fn get_snapshot(
        &self,
        _: Request<proto::GetSnapshotRequest>,
    ) -> Result<Response<proto::GetSnapshotResponse>, Status> {
        Err(unimplemented("GetSnapshot"))
    }

    async fn controller_expand_volume(
        &self,
        _: Request<proto::ControllerExpandVolumeRequest>,
    ) -> Result<Response<proto::ControllerExpandVolumeResponse>, Status> {
        Err(unimplemented("ControllerExpandVolume"))
    }

    async fn controller_get_volume(
        &self,
        _: Request<proto::ControllerGetVolumeRequest>,
    ) -> Result<Response<proto::ControllerGetVolumeResponse>, Status> {
        Err(unimplemented("ControllerGetVolume"))
    }

    async fn controller_modify_volume(
        &self,
        _: Request<proto::ControllerModifyVolumeRequest>,
    ) -> Result<Response<proto::ControllerModifyVolumeResponse>, Status> {
        Err(unimplemented("ControllerModifyVolume"))
    }
}

/// A call for a capability the plugin does not declare.
pub(super) fn unimplemented(call: &str) -> Status {
    Status::unimplemented(format!(
        "{call} is not served by {}",
        transport::cluster::CSI_DRIVER
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(required: i64, limit: i64) -> proto::CapacityRange {
        proto::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        }
    }

    #[test]
    fn sizes_are_whole_blocks_within_the_limit() {
        assert_eq!(size_for(None).unwrap(), DEFAULT_SIZE);
        assert_eq!(size_for(Some(&range(1, 0))).unwrap(), BLOCK);
        assert_eq!(size_for(Some(&range(0, 8192))).unwrap(), 8192);
        assert_eq!(
            size_for(Some(&range(10 << 30, 10 << 30))).unwrap(),
            10 << 30
        );
        let e = size_for(Some(&range(4097, 5000))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange);
        assert!(
            e.message().contains("over limit_bytes 5000"),
            "{}",
            e.message()
        );
        assert_eq!(
            size_for(Some(&range(-1, 0))).unwrap_err().code(),
            tonic::Code::OutOfRange
        );
    }
}
