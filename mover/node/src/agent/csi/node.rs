//! The CSI Node service: what the kubelet calls to give a pod a volume.
//!
//! - NodeStageVolume attaches the export as a block device; for a Filesystem volume it
//!   mounts the device at the staging path, making the file system first on a volume
//!   that holds none (never over one that does).
//! - NodePublishVolume binds the device (Block) or the staging mount (Filesystem) at the
//!   pod's path.
//!
//! Every call is idempotent: the kubelet repeats them after timeouts and restarts.

use super::{Plugin, blocking, controller::unimplemented, required, single_node};
use mover_engine::node::freeze::is_mount_point;
use std::{
    path::{Path, PathBuf},
    process::Command,
};
use tonic::{Request, Response, Status};
use transport::csi::{self as proto, node_server::Node, volume_capability::AccessType};

/// The file system made on a blank Filesystem volume without an `fs_type`.
const DEFAULT_FS: &str = "ext4";

#[tonic::async_trait]
impl Node for Plugin {
    async fn node_stage_volume(
        &self,
        request: Request<proto::NodeStageVolumeRequest>,
    ) -> Result<Response<proto::NodeStageVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume_id")?.to_string();
        let staging = PathBuf::from(required(&req.staging_target_path, "staging_target_path")?);
        let cap = req
            .volume_capability
            .ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        single_node(&cap)?;
        self.exports
            .get(&id)
            .map_err(|e| Status::not_found(e.to_string()))?;
        let plugin = self.clone();
        blocking(move || {
            let device = plugin.devices.attach(&id).map_err(|e| {
                Status::internal(format!("cannot attach volume {id} as a block device: {e}"))
            })?;
            if let Some(AccessType::Mount(m)) = &cap.access_type
                && !is_mount_point(&staging)
            {
                let fs = if m.fs_type.is_empty() {
                    DEFAULT_FS
                } else {
                    &m.fs_type
                };
                make_fs_if_blank(&device, fs)?;
                std::fs::create_dir_all(&staging).map_err(|e| io_status(&staging, e))?;
                let mut cmd = Command::new("mount");
                cmd.args(["-t", fs]);
                if !m.mount_flags.is_empty() {
                    cmd.arg("-o").arg(m.mount_flags.join(","));
                }
                run(cmd.arg(&device).arg(&staging))?;
            }
            Ok(())
        })
        .await?;
        Ok(Response::new(proto::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        request: Request<proto::NodeUnstageVolumeRequest>,
    ) -> Result<Response<proto::NodeUnstageVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume_id")?.to_string();
        let staging = PathBuf::from(required(&req.staging_target_path, "staging_target_path")?);
        let plugin = self.clone();
        blocking(move || {
            unmount_all(&staging)?;
            plugin.devices.detach(&id).map_err(|e| {
                Status::failed_precondition(format!("cannot detach volume {id}: {e}"))
            })?;
            Ok(())
        })
        .await?;
        Ok(Response::new(proto::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        request: Request<proto::NodePublishVolumeRequest>,
    ) -> Result<Response<proto::NodePublishVolumeResponse>, Status> {
        let req = request.into_inner();
        let id = required(&req.volume_id, "volume_id")?.to_string();
        let target = PathBuf::from(required(&req.target_path, "target_path")?);
        let cap = req
            .volume_capability
            .ok_or_else(|| Status::invalid_argument("volume_capability is required"))?;
        single_node(&cap)?;
        let block = matches!(cap.access_type, Some(AccessType::Block(_)));
        let staging = PathBuf::from(&req.staging_target_path);
        if !block && req.staging_target_path.is_empty() {
            return Err(Status::failed_precondition(
                "staging_target_path is required: a Filesystem volume is staged first",
            ));
        }
        let read_only = req.readonly;
        let plugin = self.clone();
        blocking(move || {
            if is_mount_point(&target) {
                return Ok(());
            }
            let source = if block {
                // Staged already, so this is the attached device.
                let device = plugin.devices.attach(&id).map_err(|e| {
                    Status::not_found(format!("volume {id} is not staged and cannot be: {e}"))
                })?;
                if let Some(dir) = target.parent() {
                    std::fs::create_dir_all(dir).map_err(|e| io_status(dir, e))?;
                }
                std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&target)
                    .map_err(|e| io_status(&target, e))?;
                device
            } else {
                if !is_mount_point(&staging) {
                    return Err(Status::failed_precondition(format!(
                        "volume {id} is not staged at {}",
                        staging.display()
                    )));
                }
                std::fs::create_dir_all(&target).map_err(|e| io_status(&target, e))?;
                staging
            };
            run(Command::new("mount")
                .arg("--bind")
                .arg(&source)
                .arg(&target))?;
            if read_only {
                run(Command::new("mount")
                    .args(["-o", "remount,bind,ro"])
                    .arg(&target))?;
            }
            Ok(())
        })
        .await?;
        Ok(Response::new(proto::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        request: Request<proto::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<proto::NodeUnpublishVolumeResponse>, Status> {
        let req = request.into_inner();
        required(&req.volume_id, "volume_id")?;
        let target = PathBuf::from(required(&req.target_path, "target_path")?);
        blocking(move || {
            unmount_all(&target)?;
            // The path the kubelet gave is ours to remove: a file (Block) or a directory.
            let removed = match std::fs::symlink_metadata(&target) {
                Ok(m) if m.is_dir() => std::fs::remove_dir(&target),
                Ok(_) => std::fs::remove_file(&target),
                Err(_) => Ok(()),
            };
            removed.map_err(|e| io_status(&target, e))
        })
        .await?;
        Ok(Response::new(proto::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_capabilities(
        &self,
        _: Request<proto::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<proto::NodeGetCapabilitiesResponse>, Status> {
        use proto::node_service_capability::{Rpc, Type, rpc::Type as R};
        Ok(Response::new(proto::NodeGetCapabilitiesResponse {
            capabilities: vec![proto::NodeServiceCapability {
                r#type: Some(Type::Rpc(Rpc {
                    r#type: R::StageUnstageVolume as i32,
                })),
            }],
        }))
    }

    async fn node_get_info(
        &self,
        _: Request<proto::NodeGetInfoRequest>,
    ) -> Result<Response<proto::NodeGetInfoResponse>, Status> {
        Ok(Response::new(proto::NodeGetInfoResponse {
            node_id: self.node.clone(),
            max_volumes_per_node: 0,
            accessible_topology: Some(self.topology()),
        }))
    }

    async fn node_get_volume_stats(
        &self,
        _: Request<proto::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<proto::NodeGetVolumeStatsResponse>, Status> {
        Err(unimplemented("NodeGetVolumeStats"))
    }

    async fn node_expand_volume(
        &self,
        _: Request<proto::NodeExpandVolumeRequest>,
    ) -> Result<Response<proto::NodeExpandVolumeResponse>, Status> {
        Err(unimplemented("NodeExpandVolume"))
    }
}

/// Makes file system `fs` on `device` unless it holds something blkid knows (a file
/// system, a partition table, LVM): a volume with data is never formatted.
fn make_fs_if_blank(device: &Path, fs: &str) -> Result<(), Status> {
    let probe = Command::new("blkid")
        .args(["-p", "-o", "value", "-s", "TYPE"])
        .arg(device)
        .output()
        .map_err(|e| Status::internal(format!("cannot run blkid (util-linux): {e}")))?;
    match probe.status.code() {
        // 2: nothing found.
        Some(2) => {
            let mut cmd = Command::new(format!("mkfs.{fs}"));
            if fs.starts_with("ext") {
                // No lazy init: the whole volume would be written behind the pod's back.
                cmd.args(["-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0"]);
            } else {
                cmd.arg("-q");
            }
            run(cmd.arg(device))
        }
        Some(0) => Ok(()),
        _ => Err(Status::internal(format!(
            "blkid -p {} failed: {}",
            device.display(),
            String::from_utf8_lossy(&probe.stderr).trim()
        ))),
    }
}

/// Unmounts `path` until it is no mount point (a repeated publish may have stacked
/// two); fine if it never was one.
fn unmount_all(path: &Path) -> Result<(), Status> {
    while is_mount_point(path) {
        rustix::mount::unmount(path, rustix::mount::UnmountFlags::empty())
            .map_err(|e| Status::internal(format!("cannot unmount {}: {e}", path.display())))?;
    }
    Ok(())
}

fn run(cmd: &mut Command) -> Result<(), Status> {
    mover_engine::node::run_tool(cmd)
        .map(drop)
        .map_err(|e| Status::internal(e.to_string()))
}

fn io_status(path: &Path, e: std::io::Error) -> Status {
    Status::internal(format!("{}: {e}", path.display()))
}
