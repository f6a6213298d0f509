//! mover's CSI plugin, served by the agent on every node (`csi_socket`): how a pod uses
//! a volume the agent serves, one still arriving included.
//!
//! - Identity: the driver's name ([`CSI_DRIVER`]) and that it has a Controller side and
//!   topology (a volume lives on one node).
//! - Controller (`controller`): empty volumes, as sparse image files in `csi_volumes`,
//!   served as exports by their volume ids. Run with a csi-provisioner per node
//!   (`--node-deployment`): each agent makes the volumes of its own node.
//! - Node (`node`): NodeStage attaches the export as a block device (`device`: a loop
//!   device over the agent's FUSE file here) and, for a Filesystem volume, mounts it at
//!   the staging path (making the file system on a blank volume); NodePublish binds the
//!   device or that mount into the pod's path.
//!
//! A volume id is an export name: a volume mover hydrates (a populated PVC's) is staged
//! like one made here, and its reads of regions still to come wait for them.

mod controller;
mod node;

use super::device::Devices;
use mover_engine::node::Exports;
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
};
use tonic::{Request, Response, Status};
use transport::cluster::CSI_DRIVER;
use transport::csi::{
    self as proto, controller_server::ControllerServer, identity_server::IdentityServer,
    node_server::NodeServer,
};

/// The topology key: the node a volume lives on.
pub const TOPOLOGY_NODE: &str = "topology.replication.mover/node";

/// What the plugin's services share (cheap to clone).
#[derive(Clone)]
pub struct Plugin {
    /// This node's name (NodeGetInfo's node id and topology).
    pub node: String,
    /// The agent's exports: volume ids are their names.
    pub exports: Exports,
    /// The agent's devices.
    pub devices: Arc<Devices>,
    /// Where CreateVolume makes volumes.
    pub volumes: PathBuf,
}

/// The image file of the volume `id` in the plugin's volumes directory `dir`: what
/// CreateVolume makes, and a populated PVC's volume (a hydration started with `create`).
pub fn volume_file(dir: &Path, id: &str) -> PathBuf {
    dir.join(format!("{id}.img"))
}

impl Plugin {
    fn topology(&self) -> proto::Topology {
        proto::Topology {
            segments: HashMap::from([(TOPOLOGY_NODE.to_string(), self.node.clone())]),
        }
    }
}

/// Serves the plugin on the Unix socket `path` until `stopped` resolves.
pub async fn serve(
    plugin: Plugin,
    path: PathBuf,
    stopped: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    // A socket left by a killed agent refuses the bind.
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let listener = tokio::net::UnixListener::bind(&path)?;
    tracing::info!(socket = %path.display(), driver = CSI_DRIVER, "CSI plugin serving");
    let plugin = Arc::new(plugin);
    tonic::transport::Server::builder()
        .add_service(IdentityServer::new(Identity))
        .add_service(ControllerServer::from_arc(plugin.clone()))
        .add_service(NodeServer::from_arc(plugin))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            stopped,
        )
        .await
        .map_err(std::io::Error::other)
}

/// The Identity service.
struct Identity;

#[tonic::async_trait]
impl proto::identity_server::Identity for Identity {
    async fn get_plugin_info(
        &self,
        _: Request<proto::GetPluginInfoRequest>,
    ) -> Result<Response<proto::GetPluginInfoResponse>, Status> {
        Ok(Response::new(proto::GetPluginInfoResponse {
            name: CSI_DRIVER.into(),
            vendor_version: env!("CARGO_PKG_VERSION").into(),
            manifest: Default::default(),
        }))
    }

    async fn get_plugin_capabilities(
        &self,
        _: Request<proto::GetPluginCapabilitiesRequest>,
    ) -> Result<Response<proto::GetPluginCapabilitiesResponse>, Status> {
        use proto::plugin_capability::{Service, Type, service::Type as S};
        let service = |t: S| proto::PluginCapability {
            r#type: Some(Type::Service(Service { r#type: t as i32 })),
        };
        Ok(Response::new(proto::GetPluginCapabilitiesResponse {
            capabilities: vec![
                service(S::ControllerService),
                service(S::VolumeAccessibilityConstraints),
            ],
        }))
    }

    async fn probe(
        &self,
        _: Request<proto::ProbeRequest>,
    ) -> Result<Response<proto::ProbeResponse>, Status> {
        Ok(Response::new(proto::ProbeResponse { ready: Some(true) }))
    }
}

/// InvalidArgument unless `value` is set.
fn required<'a>(value: &'a str, what: &str) -> Result<&'a str, Status> {
    if value.is_empty() {
        Err(Status::invalid_argument(format!("{what} is required")))
    } else {
        Ok(value)
    }
}

/// A volume lives on one node: only single-node access modes are served.
fn single_node(cap: &proto::VolumeCapability) -> Result<(), Status> {
    use proto::volume_capability::access_mode::Mode;
    let mode = cap
        .access_mode
        .as_ref()
        .map(|m| m.mode())
        .ok_or_else(|| Status::invalid_argument("a volume capability needs an access_mode"))?;
    if cap.access_type.is_none() {
        return Err(Status::invalid_argument(
            "a volume capability needs an access type (block or mount)",
        ));
    }
    match mode {
        Mode::SingleNodeWriter
        | Mode::SingleNodeReaderOnly
        | Mode::SingleNodeSingleWriter
        | Mode::SingleNodeMultiWriter => Ok(()),
        other => Err(Status::invalid_argument(format!(
            "access mode {other:?} is not served: a mover volume lives on one node \
             (ReadWriteOnce, ReadWriteOncePod or ReadOnlyMany on one node)"
        ))),
    }
}

/// Runs blocking work (mounts, losetup, mkfs) off the runtime's threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Status::internal(e.to_string()))?
}
