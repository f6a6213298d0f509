//! `agent.toml`: what an agent listens on, how peers authenticate, and what it exports.

use mover_engine::node::Export;
use serde::Deserialize;
use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf};

/// Who may read an agent's /metrics (see `agent::scrape_access`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum MetricsAccess {
    /// Anyone who reaches `metrics_listen`.
    #[default]
    Open,
    /// A bearer token the API server authenticates and authorizes for `get` on /metrics.
    Kubernetes,
}

/// The agent's configuration file.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// gRPC address, e.g. "0.0.0.0:7070".
    pub listen: SocketAddr,
    /// Address of the HTTP endpoint serving /metrics and /healthz, e.g. "127.0.0.1:9470".
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
    /// Who may read /metrics: "open" (anyone who reaches `metrics_listen`) or
    /// "kubernetes" (a bearer token the API server authenticates and authorizes for
    /// `get` on /metrics: ClusterRole mover-metrics-reader) [default: open]. /healthz
    /// is always open.
    #[serde(default)]
    pub metrics_access: MetricsAccess,
    /// Where fencing epochs and copy markers are kept.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// A file holding the bearer token of the control role: registering exports,
    /// relationships, schedules, hydrations (an operator; the controller proves the role
    /// with its certificate instead).
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// A file of bearer tokens of the replication role, one per line (a second line lets
    /// a rotation overlap): what peer clusters' agents present. They may run cycles,
    /// hydrations and pulls against the exports their relationship names, nothing else.
    /// A line is `TOKEN` (unnamed: any unbound relationship) or `NAME TOKEN` (peer
    /// credential NAME: only the relationships bound to NAME).
    #[serde(default)]
    pub replication_token_file: Option<PathBuf>,
    /// TLS: this agent's certificate and key and the CA that signs its cluster's, from
    /// files or from the cluster's signer.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// This agent's node: the name its certificate carries and peers check
    /// [default: env NODE_NAME].
    #[serde(default)]
    pub node_name: Option<String>,
    /// Volumes peers may read or write, by name. Nothing else is reachable, except what
    /// the controller registers under `volume_roots`.
    #[serde(default)]
    pub exports: BTreeMap<String, Export>,
    /// Directories under which the controller may register volumes as exports (the
    /// kubelet's CSI directory, local PV directories) [default: none]. Any holder of the
    /// token may register a path under them: directories of volumes only, written by
    /// the node's administrator alone.
    #[serde(default)]
    pub volume_roots: Vec<PathBuf>,
    /// `HOST:PORT` at which peers reach this agent (how a promoted secondary finds this
    /// side to replicate back to) [default: the address the relationship's creator used].
    #[serde(default)]
    pub advertise: Option<String>,
    /// The bearer token this agent presents to peers when it replicates to them
    /// [default: its own token_file]. Mutual TLS uses `[tls]` both ways.
    #[serde(default)]
    pub peer_token_file: Option<PathBuf>,
    /// Unix socket of the NBD server (every block export, hydrating ones included, as
    /// `nbd+unix:///NAME?socket=PATH`) [default: STATE_DIR/nbd.sock]. Only processes on
    /// this node that may open the socket reach it: keep its directory private.
    #[serde(default)]
    pub nbd_socket: Option<PathBuf>,
    /// TCP address of the NBD server for clients on other nodes, e.g. "0.0.0.0:10809"
    /// [default: none]. Needs `[tls]`: clients must start TLS with a certificate from
    /// the CA (`nbds://`), since NBD has no token.
    #[serde(default)]
    pub nbd_listen: Option<SocketAddr>,
    /// Unix socket of mover's CSI plugin (Identity, Controller, Node), e.g.
    /// "/var/lib/kubelet/plugins/csi.replication.mover/csi.sock" [default: not served].
    /// Its Node side makes a served volume (one still hydrating included) a block
    /// device for a pod; its Controller side makes empty volumes on this node.
    #[serde(default)]
    pub csi_socket: Option<PathBuf>,
    /// Where the CSI plugin creates volumes (sparse image files) [default:
    /// STATE_DIR/volumes]. The agent serves them as exports by their volume ids.
    #[serde(default)]
    pub csi_volumes: Option<PathBuf>,
    /// Unix socket of the fd store (`mover fd-store`), e.g.
    /// "/var/lib/mover/fd-store/store.sock" [default: none]. The CSI plugin's devices
    /// keep their FUSE connections there, so that a pod's I/O only pauses while this
    /// agent restarts or is upgraded; without it, a restart fails their I/O (EIO).
    #[serde(default)]
    pub fd_store: Option<PathBuf>,
}

/// Where the agent's TLS certificate comes from: PEM files, or the cluster's signer.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Certificate chain (with `key` and `ca`).
    #[serde(default)]
    pub cert: Option<PathBuf>,
    /// Private key.
    #[serde(default)]
    pub key: Option<PathBuf>,
    /// CA certificate that signs the cluster's certificates (its agents', its
    /// controller's).
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// Obtain a certificate for this node from the mover controller through the
    /// Kubernetes CSR API (signer `replication.mover/agent`), kept in STATE_DIR/tls and
    /// requested again when a third of its life is left, or when a rotation of the
    /// cluster's CA made another CA the signer; trust what the cluster publishes in
    /// ConfigMap mover-ca-trust (checked at start and every 10 s, or `renew_every` if
    /// shorter). Needs `node_name` and a ServiceAccount token bound to the agent's pod.
    #[serde(default)]
    pub from_kubernetes: bool,
    /// How often the agent looks for a renewed certificate: reads the files again (as
    /// cert-manager rewrites them), or asks the cluster's signer once a third of its
    /// life is left. New connections get the renewed one; no restart [default: "10m"].
    #[serde(default = "default_renew_every", with = "duration_text")]
    pub renew_every: std::time::Duration,
}

fn default_renew_every() -> std::time::Duration {
    std::time::Duration::from_secs(600)
}

/// A duration written as text ("10m", "1s") in agent.toml.
mod duration_text {
    pub fn deserialize<'de, D: serde::Deserializer<'de>>(
        d: D,
    ) -> Result<std::time::Duration, D::Error> {
        let text: String = serde::Deserialize::deserialize(d)?;
        match mover_engine::node::parse_duration(&text) {
            Ok(d) if d.is_zero() => Err(serde::de::Error::custom("must be more than 0s")),
            Ok(d) => Ok(d),
            Err(e) => Err(serde::de::Error::custom(e)),
        }
    }
}

impl TlsConfig {
    /// The files, when the certificate comes from files.
    pub fn files(&self) -> Option<transport::tls::TlsFiles> {
        Some(transport::tls::TlsFiles {
            cert: self.cert.clone()?,
            key: self.key.clone()?,
            ca: self.ca.clone()?,
        })
    }
}

fn default_state_dir() -> PathBuf {
    PathBuf::from("/var/lib/mover")
}

/// Why a configuration is refused.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read agent config {path}: {cause}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
    /// The file is not valid.
    #[error("agent config {path} is invalid: {why}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

/// A token file's error said as the agent's configuration's.
fn token_file_error(e: transport::cluster::TokenFileError) -> ConfigError {
    use transport::cluster::TokenFileError;
    match e {
        TokenFileError::Read { path, cause } => ConfigError::Read { path, cause },
        TokenFileError::Empty { path } => ConfigError::Invalid {
            path,
            why: "the token file is empty".into(),
        },
        TokenFileError::Invalid { path, line, why } => ConfigError::Invalid {
            path,
            why: format!("line {line}: {why}"),
        },
    }
}

impl AgentConfig {
    /// Reads and checks a configuration file.
    pub fn load(path: &std::path::Path) -> Result<AgentConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read {
            path: path.into(),
            cause,
        })?;
        let invalid = |why: String| ConfigError::Invalid {
            path: path.into(),
            why,
        };
        let config: AgentConfig = toml::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        if config.token_file.is_none() && config.tls.is_none() {
            return Err(invalid(
                "neither token_file nor [tls] is set: an agent never serves volumes to unauthenticated peers".into(),
            ));
        }
        if let Some(tls) = &config.tls {
            let files = [&tls.cert, &tls.key, &tls.ca]
                .iter()
                .filter(|f| f.is_some())
                .count();
            match (tls.from_kubernetes, files) {
                (true, 0) | (false, 3) => {}
                (true, _) => {
                    return Err(invalid(
                        "[tls] sets from_kubernetes and files: choose one".into(),
                    ));
                }
                (false, _) => {
                    return Err(invalid(
                        "[tls] needs cert, key and ca (or from_kubernetes = true)".into(),
                    ));
                }
            }
        }
        if config.nbd_listen.is_some() && config.tls.as_ref().is_some_and(|t| t.from_kubernetes) {
            return Err(invalid(
                "nbd_listen cannot use a from_kubernetes certificate: NBD checks only that a \
                 client's certificate comes from the CA, and every agent of the cluster holds \
                 one; give [tls] files of a CA for NBD clients alone, or use the node-local \
                 nbd_socket"
                    .into(),
            ));
        }
        if config.nbd_listen.is_some() && config.tls.is_none() {
            return Err(invalid(
                "nbd_listen needs [tls]: NBD carries no token, so over TCP only clients \
                 with a certificate from the CA are served (or drop nbd_listen and use the \
                 node-local nbd_socket)"
                    .into(),
            ));
        }
        if config.exports.is_empty()
            && config.volume_roots.is_empty()
            && config.csi_socket.is_none()
        {
            return Err(invalid(
                "no [exports.NAME] sections, no volume_roots and no csi_socket: the agent would \
                 serve nothing"
                    .into(),
            ));
        }
        if let Some(root) = config.volume_roots.iter().find(|r| {
            !r.is_absolute()
                || r.components().any(|c| c == std::path::Component::ParentDir)
                || r.parent().is_none()
        }) {
            return Err(invalid(format!(
                "volume_roots entry {} must be an absolute directory other than / and \
                 without '..'",
                root.display()
            )));
        }
        for (name, export) in &config.exports {
            if name.is_empty() || name.contains('/') {
                return Err(invalid(format!(
                    "export name {name:?} must be non-empty and contain no '/'"
                )));
            }
            if !export.path.is_absolute() {
                return Err(invalid(format!(
                    "export {name}: path {} must be absolute",
                    export.path.display()
                )));
            }
        }
        Ok(config)
    }

    /// This agent's node name (`node_name`, else env NODE_NAME).
    pub fn node_name(&self) -> Option<String> {
        self.node_name
            .clone()
            .or_else(|| std::env::var("NODE_NAME").ok())
            .filter(|n| !n.is_empty())
    }

    /// The replication role's tokens, from `replication_token_file` (`TOKEN` or `NAME
    /// TOKEN` lines: see `transport::cluster::read_replication_tokens`).
    pub fn replication_tokens(
        &self,
    ) -> Result<Vec<transport::cluster::ReplicationToken>, ConfigError> {
        self.replication_token_file
            .as_deref()
            .map_or(Ok(Vec::new()), |p| {
                transport::cluster::read_replication_tokens(p).map_err(token_file_error)
            })
    }

    /// Where the CSI plugin creates volumes.
    pub fn csi_volumes(&self) -> PathBuf {
        self.csi_volumes
            .clone()
            .unwrap_or_else(|| self.state_dir.join("volumes"))
    }

    /// Where the NBD server listens.
    pub fn nbd_socket(&self) -> PathBuf {
        self.nbd_socket
            .clone()
            .unwrap_or_else(|| self.state_dir.join("nbd.sock"))
    }

    /// How this agent reaches peers when it replicates to them: its certificate (`tls`)
    /// to peers of its cluster; a relationship's own token and CA to another cluster's.
    pub fn peer_options(
        &self,
        tls: Option<&transport::tls::LiveTls>,
    ) -> Result<mover_engine::remote::RemoteOptions, ConfigError> {
        let token_file = self.peer_token_file.clone().or(self.token_file.clone());
        if let Some(path) = &token_file {
            std::fs::metadata(path).map_err(|cause| ConfigError::Read {
                path: path.clone(),
                cause,
            })?;
        }
        Ok(mover_engine::remote::RemoteOptions {
            connect: mover_engine::remote::ConnectOptions {
                token_file,
                tls_pem: tls.cloned(),
                ..Default::default()
            },
            retries: 3,
            ..Default::default()
        })
    }

    /// The bearer token, read from `token_file` (surrounding whitespace trimmed).
    pub fn token(&self) -> Result<Option<String>, ConfigError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let t = std::fs::read_to_string(path).map_err(|cause| ConfigError::Read {
            path: path.clone(),
            cause,
        })?;
        let t = t.trim().to_string();
        if t.is_empty() {
            return Err(ConfigError::Invalid {
                path: path.clone(),
                why: "the token file is empty".into(),
            });
        }
        Ok(Some(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<AgentConfig, String> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("agent.toml");
        std::fs::write(&p, text).unwrap();
        AgentConfig::load(&p).map_err(|e| e.to_string())
    }

    #[test]
    fn accepts_a_full_config_and_refuses_unsafe_ones() {
        let ok = load(
            r#"listen = "127.0.0.1:7070"
               token_file = "/etc/mover/token"
               [exports.data]
               path = "/dev/loop3"
               [exports.golden]
               path = "/srv/golden.img"
               read_only = true"#,
        )
        .unwrap();
        assert_eq!(ok.exports.len(), 2);
        assert!(ok.exports["golden"].read_only && !ok.exports["data"].read_only);

        let e = load("listen = \"127.0.0.1:1\"\n[exports.a]\npath = \"/x\"").unwrap_err();
        assert!(e.contains("unauthenticated"), "{e}");
        let e =
            load("listen = \"127.0.0.1:1\"\ntoken_file = \"/t\"\n[exports.a]\npath = \"x.img\"")
                .unwrap_err();
        assert!(e.contains("absolute"), "{e}");
        let e = load("listen = \"127.0.0.1:1\"\ntoken_file = \"/t\"\nexprots = 1").unwrap_err();
        assert!(e.contains("unknown field"), "{e}");
        let e = load("listen = \"127.0.0.1:1\"\ntoken_file = \"/t\"").unwrap_err();
        assert!(e.contains("serve nothing"), "{e}");
        let e = load("listen = \"127.0.0.1:1\"\ntoken_file = \"/t\"\nvolume_roots = [\"/\"]")
            .unwrap_err();
        assert!(e.contains("other than /"), "{e}");
        let e = load("listen = \"127.0.0.1:1\"\ntoken_file = \"/t\"\nnbd_listen = \"0.0.0.0:10809\"\n[exports.a]\npath = \"/x\"")
            .unwrap_err();
        assert!(e.contains("nbd_listen needs [tls]"), "{e}");
        let roots =
            load("listen = \"127.0.0.1:1\"\ntoken_file = \"/t\"\nvolume_roots = [\"/dev\"]");
        assert_eq!(roots.unwrap().volume_roots, vec![PathBuf::from("/dev")]);
    }
}
