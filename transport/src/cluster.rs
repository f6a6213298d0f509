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
/// How often an agent reads what its cluster trusts (the controller's ConfigMap
/// `mover-ca-trust`): a step of a CA rotation reaches every agent this soon.
pub const AGENT_TRUST_EVERY: Duration = Duration::from_secs(10);

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
    /// A line that is neither `TOKEN` nor `NAME TOKEN`.
    #[error("token file {path}, line {line}: {why}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// The line's number (from 1).
        line: usize,
        /// What is wrong and what to write instead.
        why: String,
    },
}

/// One line of a replication token file: a token, and the peer credential it is
/// (`None`: an unnamed line, any peer's, as before credentials had names).
#[derive(Clone, PartialEq, Eq)]
pub struct ReplicationToken {
    /// The peer credential's name: relationships bound to it accept this token alone.
    pub name: Option<String>,
    /// The bearer token.
    pub token: String,
}

impl std::fmt::Debug for ReplicationToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReplicationToken({:?})", self.name)
    }
}

/// The name a relationship bound to this cluster's own agents carries: no peer's token
/// acts on it.
pub const LOCAL_CREDENTIAL: &str = "local";

/// Whether `name` may name a peer credential: a DNS-1123 label (what a Secret's name
/// part is), or `NAMESPACE/SECRET` as the controller names a class secret's; never
/// [`LOCAL_CREDENTIAL`].
pub fn check_credential_name(name: &str) -> Result<(), String> {
    let label = |l: &str| {
        !l.is_empty()
            && l.len() <= 253
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            && !l.starts_with(['-', '.'])
            && !l.ends_with(['-', '.'])
    };
    let ok = match name.split_once('/') {
        Some((ns, secret)) => label(ns) && label(secret),
        None => label(name),
    };
    if !ok {
        return Err(format!(
            "{name:?} is no peer credential name: use lowercase letters, digits, '-' and '.' \
             (a Secret's name), optionally NAMESPACE/NAME"
        ));
    }
    if name == LOCAL_CREDENTIAL {
        return Err(format!(
            "{LOCAL_CREDENTIAL:?} is reserved: it names this cluster's own agents"
        ));
    }
    Ok(())
}

/// The replication tokens in `path`: one per line, `TOKEN` (unnamed) or `NAME TOKEN` (a
/// peer credential; a name may repeat, so a rotation overlaps); `#` starts a comment
/// line. A file with none is refused, as is a token under two names.
pub fn read_replication_tokens(path: &Path) -> Result<Vec<ReplicationToken>, TokenFileError> {
    let text = std::fs::read_to_string(path).map_err(|cause| TokenFileError::Read {
        path: path.into(),
        cause,
    })?;
    let invalid = |line: usize, why: String| TokenFileError::Invalid {
        path: path.into(),
        line,
        why,
    };
    let mut tokens: Vec<ReplicationToken> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let t = match fields[..] {
            [token] => ReplicationToken {
                name: None,
                token: token.into(),
            },
            [name, token] => {
                check_credential_name(name).map_err(|why| invalid(i + 1, why))?;
                ReplicationToken {
                    name: Some(name.into()),
                    token: token.into(),
                }
            }
            _ => {
                return Err(invalid(
                    i + 1,
                    "write TOKEN or NAME TOKEN, one per line (a token has no spaces)".into(),
                ));
            }
        };
        if let Some(other) = tokens
            .iter()
            .find(|o| o.token == t.token && o.name != t.name)
        {
            return Err(invalid(
                i + 1,
                format!(
                    "this token is also the line of {}: one token proves one credential",
                    other
                        .name
                        .as_deref()
                        .map_or("an unnamed line".into(), |n| format!("{n:?}"))
                ),
            ));
        }
        tokens.push(t);
    }
    if tokens.is_empty() {
        return Err(TokenFileError::Empty { path: path.into() });
    }
    Ok(tokens)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn read(text: &str) -> Result<Vec<ReplicationToken>, TokenFileError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens");
        std::fs::write(&path, text).unwrap();
        read_replication_tokens(&path)
    }

    #[test]
    fn a_replication_token_file_names_its_peer_credentials() {
        let tokens = read("# the DR site\ndr 11aa\ndr 22bb\n\n  7c2b  \n").unwrap();
        let named = |n: Option<&str>, t: &str| ReplicationToken {
            name: n.map(String::from),
            token: t.into(),
        };
        assert_eq!(
            tokens,
            vec![
                named(Some("dr"), "11aa"),
                named(Some("dr"), "22bb"),
                named(None, "7c2b")
            ]
        );
        let why = |text: &str| match read(text).unwrap_err() {
            TokenFileError::Invalid { line, why, .. } => format!("{line}: {why}"),
            e => panic!("{e}"),
        };
        assert!(why("a b c\n").starts_with("1: write TOKEN or NAME TOKEN"));
        assert!(why("x\nlocal 11\n").contains("2: \"local\" is reserved"));
        assert!(why("DR 11\n").contains("is no peer credential name"));
        assert!(why("dr 11\neu 11\n").contains("also the line of \"dr\""));
        assert!(matches!(
            read("# none\n"),
            Err(TokenFileError::Empty { .. })
        ));
        assert_eq!(check_credential_name("mover-system/mover-dr-peer"), Ok(()));
    }
}
