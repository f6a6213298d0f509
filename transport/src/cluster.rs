//! What the agents and the controller of one cluster agree on: the CSI driver's name,
//! the signer of the agents' certificates, the token files, and the replication bounds
//! both ends check. The agent (`mover-node`) and the controller (`mover-controller`)
//! both depend on this crate and on neither of each other.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The CSI driver's name (CSIDriver, StorageClass provisioner, PV `spec.csi.driver`).
pub const CSI_DRIVER: &str = "csi.replication.mover";

/// The signerName of agents' certificates; the mover controller signs them.
pub const AGENT_SIGNER: &str = "replication.mover/agent";
/// How long an agent's certificate is asked for.
pub const AGENT_CERTIFICATE_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);

/// Seconds of life left and in all of the first certificate in `pem`, and whether it
/// names `node`.
pub fn certificate_life(pem: &[u8], node: &str) -> Option<(i64, i64, bool)> {
    let f = crate::tls::Facts::of_pem(pem)?;
    let now = ::x509_parser::time::ASN1Time::now().timestamp();
    Some((
        f.not_after - now,
        f.not_after - f.not_before,
        f.dns.iter().any(|d| d == node),
    ))
}

/// The shortest interval of scheduled snapshots: a snapshot is not a replication cycle.
pub const MIN_SNAPSHOT_INTERVAL: Duration = Duration::from_secs(60);

/// A primary whose last cycle is older than this many intervals is `Degraded`, whatever
/// the cycle in flight says about itself (a silent network cut stalls it quietly).
pub const LATE_INTERVALS: u64 = 3;

/// Why a token file gives no token.
#[derive(Debug, thiserror::Error)]
pub enum TokenFileError {
    /// The file could not be read.
    #[error("cannot read token file {path}: {cause}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The file holds no token.
    #[error("token file {path} is empty")]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// The bearer tokens in `path`, one per line (a second line lets a rotation overlap);
/// a file with none is refused.
pub fn read_tokens(path: &Path) -> Result<Vec<String>, TokenFileError> {
    let text = std::fs::read_to_string(path).map_err(|cause| TokenFileError::Read {
        path: path.into(),
        cause,
    })?;
    let tokens: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(String::from)
        .collect();
    if tokens.is_empty() {
        return Err(TokenFileError::Empty { path: path.into() });
    }
    Ok(tokens)
}
