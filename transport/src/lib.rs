//! gRPC transport between mover agents (docs/ARCHITECTURE.md).
//!
//! - [`proto`]: the protocol, generated from `proto/transfer.proto` (tonic + prost).
//! - [`control`]: the relationship control API, from `proto/replication.proto`.
//! - [`hydrate`]: the hydration control API, from `proto/hydrate.proto`.
//! - [`locate`]: where a peer cluster keeps a relationship's volume, from `proto/locate.proto`.
//! - [`snapshot_metadata`]: Kubernetes' SnapshotMetadata API, the changed blocks of CSI
//!   snapshots (client side).
//! - [`csi`]: the Container Storage Interface (`proto/csi.proto`), server side, for
//!   mover's CSI plugin.
//! - [`auth`]: the control and replication roles, by bearer token or certificate.
//! - [`cluster`]: what an agent and the controller of one cluster agree on (the CSI
//!   driver's name, the certificate signer, token files, replication bounds).
//! - [`tls`]: TLS configuration from PEM files or memory (rustls).
//! - [`refusal`]: a refusal's kind (stale epoch, no session, no device), carried beside
//!   the status code so callers match a type, not a message.
//! - [`states`]: a relationship's side and state, a schedule's state, as types.
//! - [`frames`]: packing volume data into frames, zstd-compressed only when it shrinks.
//! - [`nbd`]: the NBD protocol, server side, over any byte stream.
//! - [`RateLimiter`]: a token bucket for `--bwlimit`.
//!
//! The service itself (what an agent does with a session) lives in `mover-node`;
//! this crate is the wire and its security.

pub mod auth;
pub mod cluster;
pub mod frames;
pub mod nbd;
mod rate;
pub mod refusal;
pub mod scrape_access;
pub mod states;
pub mod tls;

pub use rate::RateLimiter;

/// The generated protocol types, client and server.
#[allow(missing_docs, clippy::all)]
pub mod proto {
    tonic::include_proto!("mover.transfer.v1");
}

/// The Container Storage Interface v1 (`proto/csi.proto`).
#[allow(missing_docs, clippy::all)]
pub mod csi {
    tonic::include_proto!("csi.v1");
}

/// The relationship control API (`proto/replication.proto`), client and server.
#[allow(missing_docs, clippy::all)]
pub mod control {
    tonic::include_proto!("mover.replication.v1");
}

/// Where a peer cluster keeps a relationship's volume (`proto/locate.proto`).
#[allow(missing_docs, clippy::all)]
pub mod locate {
    tonic::include_proto!("mover.locate.v1");
}

/// The hydration control API (`proto/hydrate.proto`), client and server.
#[allow(missing_docs, clippy::all)]
pub mod hydrate {
    tonic::include_proto!("mover.hydrate.v1");
}

/// The scheduled-snapshot control API (`proto/schedule.proto`), client and server.
#[allow(missing_docs, clippy::all)]
pub mod schedule {
    tonic::include_proto!("mover.schedule.v1");
}

/// The Kubernetes SnapshotMetadata API (KEP-3314, `proto/snapshot_metadata.proto`, the
/// csi-snapshot-metadata sidecar's own schema): which blocks of a CSI VolumeSnapshot are
/// allocated, or changed since another.
#[allow(
    missing_docs,
    clippy::all,
    rustdoc::bare_urls,
    rustdoc::invalid_html_tags
)]
pub mod snapshot_metadata {
    tonic::include_proto!("snapshotmetadata");
}

/// The key under which a relationship's chunks and pages are hashed on both sides.
pub fn relationship_key(relationship: &str) -> chunker::ChunkKey {
    chunker::ChunkKey::from_bytes(blake3::derive_key(
        "mover 2026 relationship chunk key v1",
        relationship.as_bytes(),
    ))
}

/// HTTP/2 flow-control window of each stream, on both sides: the receiver grants this
/// much before the sender must wait for a window update. hyper's default (1 MiB for the
/// whole connection on a server) makes four pushing streams take turns.
pub const STREAM_WINDOW: u32 = 8 << 20;

/// HTTP/2 flow-control window of a whole connection, on both sides.
pub const CONNECTION_WINDOW: u32 = 32 << 20;

/// Largest HTTP/2 frame a side accepts: a whole 1 MiB data frame in one HTTP/2 frame
/// instead of 64 frames of the 16 KiB default.
pub const MAX_FRAME: u32 = (1 << 20) + 1024;

/// HTTP/2 pings on an idle connection, on both sides, and how long an answer may take:
/// a peer that vanished without closing (a cut cable, a frozen node) is noticed, so a
/// transfer waiting on it fails and is retried instead of hanging (and, for a tree push,
/// holding the export).
pub const KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);
/// See [`KEEPALIVE_INTERVAL`].
pub const KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Largest gRPC message either side accepts: a frame of one 8 MiB chunk plus headers,
/// or a batch of page hashes.
pub const MAX_MESSAGE: usize = 16 << 20;
