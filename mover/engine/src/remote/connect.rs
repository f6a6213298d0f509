//! Connecting to an agent: its URL, the options of every call to it, the connected
//! clients of its services, and opening a transfer session on one of its exports.

use super::{AgentUrl, error_chain, status::status_error};
use crate::error::{CopyError, RemoteCode};
use chunker::{ChunkKey, ChunkSize};
use std::{path::PathBuf, time::Duration};
use tonic::{service::interceptor::InterceptedService, transport::Channel};
use transport::{
    MAX_MESSAGE, auth::AttachToken, control::replication_client::ReplicationClient,
    hydrate::hydration_client::HydrationClient, proto::transfer_client::TransferClient,
    tls::TlsFiles,
};

/// How to reach and talk to an agent.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Agent endpoints (agent://HOST:PORT/VOLUME)")]
pub struct RemoteOptions {
    /// Authentication and TLS.
    #[command(flatten)]
    pub connect: ConnectOptions,
    /// Replication relationship id: fencing epochs and chunk keys are per relationship
    /// [default: copy/VOLUME].
    #[arg(long, value_name = "ID")]
    pub relationship: Option<String>,
    /// Fencing epoch of this writer; the agent refuses epochs lower than the highest seen.
    #[arg(long, default_value_t = 1)]
    pub epoch: u64,
    /// Parallel data streams, each over a connection of its own.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub streams: u32,
    /// Bandwidth limit on the wire, in bytes per second with binary units: 100M is
    /// 100 MiB/s (K, M, G: KiB, MiB, GiB). The average over the copy stays under it
    /// [default: none].
    #[arg(long, value_name = "RATE", value_parser = parse_rate)]
    pub bwlimit: Option<u64>,
    /// Attempts on a dropped connection or an unavailable agent, with backoff; each
    /// attempt continues where the last one stopped.
    #[arg(long, default_value_t = 5)]
    pub retries: u32,
    /// zstd on the wire: auto compresses changed pages (deltas onto older data) always,
    /// and whole chunks onto zeros (a new destination) only while a push finds the link
    /// to be the bottleneck (its data streams back up): on a fast link, compressing
    /// costs more time than it saves. never; always. Only data that a sample shows
    /// shrinking is compressed.
    #[arg(long, value_enum, default_value_t = Compress::Auto)]
    pub compress: Compress,
}

impl RemoteOptions {
    /// These options for an agent of another cluster: presenting `token`, and trusting
    /// only that cluster's `ca` (PEM) where given.
    pub fn with_peer(&self, token: &str, ca: Option<&str>) -> RemoteOptions {
        let mut r = self.clone();
        r.connect.token = Some(token.to_string());
        if let Some(ca) = ca {
            r.connect.tls_peer_ca = Some(ca.as_bytes().into());
        }
        r
    }
}

/// When volume data is compressed on the wire (see [`RemoteOptions::compress`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Compress {
    /// Page deltas always; whole chunks onto zeros only while the link is the bottleneck.
    #[default]
    Auto,
    /// Never: every frame raw.
    Never,
    /// Always, where a sample shows it pays.
    Always,
}

impl Compress {
    /// Whether data shipped onto older data (page deltas) is compressed.
    pub(crate) fn deltas(self) -> bool {
        self != Compress::Never
    }
}

/// How a client proves itself to an agent and checks the agent: what every call to an
/// agent needs, transfers and the control API alike.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct ConnectOptions {
    /// File holding the agent's bearer token [env: MOVER_TOKEN_FILE; or the token itself in MOVER_TOKEN].
    #[arg(long, value_name = "FILE", env = "MOVER_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
    /// CA certificate (PEM) that signs the agent's certificate: enables TLS. With
    /// --tls-cert and --tls-key, this client proves itself by certificate (mutual TLS);
    /// without, by its bearer token.
    #[arg(long, value_name = "FILE", env = "MOVER_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), signed by a CA the agent trusts.
    #[arg(long, value_name = "FILE", env = "MOVER_TLS_CERT", requires_all = ["tls_ca", "tls_key"])]
    pub tls_cert: Option<PathBuf>,
    /// This client's private key (PEM).
    #[arg(long, value_name = "FILE", env = "MOVER_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Name the agent's certificate must carry: its node's, as in
    /// `agent://NODE@HOST:PORT/VOLUME` [default: the URL's NODE, else its HOST].
    #[arg(long, value_name = "NAME")]
    pub tls_server_name: Option<String>,
    /// TLS material in memory, given by a caller in the process (an agent's certificate
    /// from its cluster's signer, the controller's own), renewed in place; before the
    /// --tls-* files.
    #[arg(skip)]
    pub tls_pem: Option<transport::tls::LiveTls>,
    /// A peer cluster's CA (PEM), given by a relationship: trust it alone and present no
    /// certificate (the relationship's token authenticates); before everything else.
    #[arg(skip)]
    pub tls_peer_ca: Option<std::sync::Arc<[u8]>>,
    /// The token itself, given by a caller in the process (a relationship's own token);
    /// before --token-file.
    #[arg(skip)]
    pub token: Option<String>,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        RemoteOptions {
            connect: ConnectOptions::default(),
            relationship: None,
            epoch: 1,
            streams: 4,
            bwlimit: None,
            retries: 5,
            compress: Compress::Auto,
        }
    }
}

/// Parses a bandwidth limit: a size per second, `100M` or `100M/s`.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    chunker::parse_size(s.trim_end_matches("/s")).map_err(|e| e.to_string())
}

/// A connected client with the token attached.
pub type Client = TransferClient<InterceptedService<Channel, AttachToken>>;

/// A connected client of an agent's hydration control API.
pub type HydrateClient = HydrationClient<InterceptedService<Channel, AttachToken>>;

/// A connected client of an agent's relationship control API.
pub type ControlClient = ReplicationClient<InterceptedService<Channel, AttachToken>>;

/// A connected client of an agent's scheduled-snapshot API.
pub type ScheduleClient = transport::schedule::schedules_client::SchedulesClient<
    InterceptedService<Channel, AttachToken>,
>;

impl RemoteOptions {
    pub(super) fn relationship_for(&self, url: &AgentUrl) -> String {
        self.relationship
            .clone()
            .unwrap_or_else(|| format!("copy/{}", url.volume))
    }

    fn token(&self) -> Result<Option<String>, CopyError> {
        if let Some(t) = &self.connect.token {
            return Ok(Some(t.clone()));
        }
        if let Some(path) = &self.connect.token_file {
            let t = std::fs::read_to_string(path).map_err(|e| CopyError::Remote {
                url: path.display().to_string(),
                code: RemoteCode::Token,
                message: format!("cannot read the token file: {e}"),
                refusal: None,
            })?;
            return Ok(Some(t.trim().to_string()));
        }
        Ok(std::env::var("MOVER_TOKEN")
            .ok()
            .map(|t| t.trim().to_string()))
    }

    /// Connects to the agent at `url`.
    pub async fn connect(&self, url: &AgentUrl) -> Result<Client, CopyError> {
        let channel = self.channel(url).await?;
        Ok(TransferClient::with_interceptor(channel.0, channel.1)
            .max_decoding_message_size(MAX_MESSAGE)
            .max_encoding_message_size(MAX_MESSAGE))
    }

    /// Connects to the relationship control API of the agent at `url` (its volume part
    /// is not used).
    pub async fn connect_control(&self, url: &AgentUrl) -> Result<ControlClient, CopyError> {
        let (channel, auth) = self.channel(url).await?;
        Ok(ReplicationClient::with_interceptor(channel, auth))
    }

    /// Connects to the scheduled-snapshot API of the agent at `url`.
    pub async fn connect_schedules(&self, url: &AgentUrl) -> Result<ScheduleClient, CopyError> {
        let (channel, auth) = self.channel(url).await?;
        Ok(transport::schedule::schedules_client::SchedulesClient::with_interceptor(channel, auth))
    }

    /// Connects to the hydration control API of the agent at `url`.
    pub async fn connect_hydrate(&self, url: &AgentUrl) -> Result<HydrateClient, CopyError> {
        let (channel, auth) = self.channel(url).await?;
        Ok(HydrationClient::with_interceptor(channel, auth))
    }

    /// A channel to the agent at `url` with its token interceptor, from which a client
    /// of any of its services is made.
    pub async fn channel(&self, url: &AgentUrl) -> Result<(Channel, AttachToken), CopyError> {
        let remote = |code, message| CopyError::Remote {
            url: url.to_string(),
            code,
            message,
            refusal: None,
        };
        let c = &self.connect;
        let name = c
            .tls_server_name
            .as_deref()
            .or(url.tls_name.as_deref())
            .unwrap_or(&url.host);
        let read = |path: &PathBuf| {
            std::fs::read(path).map_err(|e| {
                remote(
                    RemoteCode::Tls,
                    format!("cannot read TLS file {}: {e}", path.display()),
                )
            })
        };
        let tls = if let Some(ca) = &c.tls_peer_ca {
            Some(transport::tls::client_trusting(ca, name))
        } else if let Some(pem) = &c.tls_pem {
            Some(pem.get().client(name))
        } else {
            match (&c.tls_ca, &c.tls_cert, &c.tls_key) {
                (Some(ca), Some(cert), Some(key)) => {
                    let files = TlsFiles {
                        cert: cert.clone(),
                        key: key.clone(),
                        ca: ca.clone(),
                    };
                    let pem = files
                        .load()
                        .map_err(|e| remote(RemoteCode::Tls, e.to_string()))?;
                    Some(pem.client(name))
                }
                (Some(ca), _, _) => Some(transport::tls::client_trusting(&read(ca)?, name)),
                _ => None,
            }
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut endpoint = Channel::from_shared(format!("{scheme}://{}:{}", url.host, url.port))
            .map_err(|e| remote(RemoteCode::Url, e.to_string()))?
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .initial_stream_window_size(transport::STREAM_WINDOW)
            .initial_connection_window_size(transport::CONNECTION_WINDOW)
            .http2_keep_alive_interval(transport::KEEPALIVE_INTERVAL)
            .keep_alive_timeout(transport::KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        if let Some(tls) = tls {
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| remote(RemoteCode::Tls, e.to_string()))?;
        }
        let channel = endpoint.connect().await.map_err(|e| {
            let chain = error_chain(&e);
            // A certificate refused is not a network failure: retrying cannot help.
            if transport::tls::is_certificate_refused(&e) {
                remote(
                    RemoteCode::Tls,
                    format!(
                        "the agent's certificate is not accepted ({chain}): it must be signed \
                         by the CA given (--tls-ca; for a peer cluster, the ca.crt of the \
                         class's secret) and carry the name {name:?}"
                    ),
                )
            } else {
                remote(RemoteCode::Unavailable, format!("cannot connect: {chain}"))
            }
        })?;
        let auth = AttachToken::new(self.token()?.as_deref())
            .map_err(|s| remote(RemoteCode::Token, s.message().into()))?;
        Ok((channel, auth))
    }
}

/// An open session on an agent's export.
pub(crate) struct Session {
    pub client: Client,
    pub key: ChunkKey,
    pub open: transport::proto::OpenResponse,
}

/// Connects to `url` and opens a session for `access`; `source_size` is the size of the
/// data a WRITE session will receive; `cycle` makes it a replication cycle.
pub(crate) async fn open_session(
    url: &AgentUrl,
    remote: &RemoteOptions,
    access: transport::proto::Access,
    chunk: ChunkSize,
    source_size: u64,
    cycle: Option<transport::proto::Cycle>,
) -> Result<Session, CopyError> {
    let mut client = remote.connect(url).await?;
    let relationship = remote.relationship_for(url);
    let key = transport::relationship_key(&relationship);
    let open = client
        .open(transport::proto::OpenRequest {
            volume: url.volume.clone(),
            relationship,
            epoch: remote.epoch,
            access: access as i32,
            chunk_size: chunk.get(),
            source_size,
            cycle,
            ..Default::default()
        })
        .await
        .map_err(|s| status_error(url, s))?
        .into_inner();
    Ok(Session { client, key, open })
}
