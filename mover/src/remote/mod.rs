//! Copies to and from a peer agent: `mover copy SRC agent://host:port/NAME` (push) and
//! `mover copy agent://host:port/NAME DST` (pull).
//!
//! Both sides hash their volume into a Merkle summary; the client compares group hashes,
//! then the chunk leaves of differing groups, then the 4 KiB page hashes of differing
//! chunks, and ships only the pages that differ, over several parallel gRPC streams.
//! A transfer cut short (a dropped connection, either side killed) is resumed by the
//! client's retry or a rerun: the comparison finds what is still missing, so at most the
//! data in flight at the cut is sent again.

mod pull;
mod push;
mod tree;
mod units;

pub use pull::pull;
pub use push::{CyclePush, STALE_BASE, push, push_cycle};
pub use tree::{is_tree, pull_tree, push_tree, push_tree_cycle};

use crate::error::CopyError;
use chunker::{
    BlockVolume, ChunkId, ChunkKey, ChunkKind, ChunkSize, Window, cv::CvFile, leaf_hash,
    read_chunks_where, read_window_where,
};
use std::{path::PathBuf, time::Duration};
use tonic::{service::interceptor::InterceptedService, transport::Channel};
use transport::{
    MAX_MESSAGE, auth::AttachToken, control::replication_client::ReplicationClient,
    hydrate::hydration_client::HydrationClient, proto::transfer_client::TransferClient,
    tls::TlsFiles,
};

/// A volume exported by an agent: `agent://host:port/NAME`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentUrl {
    /// Host name or address.
    pub host: String,
    /// gRPC port.
    pub port: u16,
    /// Export name.
    pub volume: String,
}

impl AgentUrl {
    /// Parses `agent://host:port/NAME`; `None` if `s` is not an agent URL at all.
    pub fn parse(s: &str) -> Option<Result<AgentUrl, CopyError>> {
        let rest = s.strip_prefix("agent://")?;
        let bad = |why: &str| CopyError::BadDestination {
            path: s.into(),
            why: format!("{why}; expected agent://HOST:PORT/VOLUME"),
        };
        let parsed = (|| {
            let (authority, volume) = rest.split_once('/').ok_or_else(|| bad("no volume name"))?;
            let (host, port) = authority.rsplit_once(':').ok_or_else(|| bad("no port"))?;
            let port = port.parse().map_err(|_| bad("the port is not a number"))?;
            if host.is_empty() || volume.is_empty() || volume.contains('/') {
                return Err(bad(
                    "empty host or volume name, or a '/' in the volume name",
                ));
            }
            Ok(AgentUrl {
                host: host.trim_matches(['[', ']']).into(),
                port,
                volume: volume.into(),
            })
        })();
        Some(parsed)
    }
}

impl std::fmt::Display for AgentUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "agent://{}:{}/{}", self.host, self.port, self.volume)
    }
}

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
    /// Bandwidth limit in bytes per second on the wire, e.g. 100M [default: none].
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
    /// CA certificate (PEM) that signs the agent's certificate; enables mutual TLS
    /// together with --tls-cert and --tls-key.
    #[arg(long, value_name = "FILE", env = "MOVER_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// This client's certificate (PEM), signed by a CA the agent trusts.
    #[arg(long, value_name = "FILE", env = "MOVER_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// This client's private key (PEM).
    #[arg(long, value_name = "FILE", env = "MOVER_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// Name the agent's certificate must carry [default: the host in the URL].
    #[arg(long, value_name = "NAME")]
    pub tls_server_name: Option<String>,
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
pub(crate) type Client = TransferClient<InterceptedService<Channel, AttachToken>>;

/// A connected client of an agent's hydration control API.
pub type HydrateClient = HydrationClient<InterceptedService<Channel, AttachToken>>;

/// A connected client of an agent's relationship control API.
pub type ControlClient = ReplicationClient<InterceptedService<Channel, AttachToken>>;

/// A connected client of an agent's scheduled-snapshot API.
pub type ScheduleClient = transport::schedule::schedules_client::SchedulesClient<
    InterceptedService<Channel, AttachToken>,
>;

impl RemoteOptions {
    fn relationship_for(&self, url: &AgentUrl) -> String {
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
                code: "token".into(),
                message: format!("cannot read the token file: {e}"),
            })?;
            return Ok(Some(t.trim().to_string()));
        }
        Ok(std::env::var("MOVER_TOKEN")
            .ok()
            .map(|t| t.trim().to_string()))
    }

    /// Connects to the agent at `url`.
    pub(crate) async fn connect(&self, url: &AgentUrl) -> Result<Client, CopyError> {
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
        let remote = |code: &str, message: String| CopyError::Remote {
            url: url.to_string(),
            code: code.into(),
            message,
        };
        let tls = match (
            &self.connect.tls_ca,
            &self.connect.tls_cert,
            &self.connect.tls_key,
        ) {
            (Some(ca), Some(cert), Some(key)) => {
                let files = TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    ca: ca.clone(),
                };
                let name = self.connect.tls_server_name.as_deref().unwrap_or(&url.host);
                Some(
                    files
                        .client(name)
                        .map_err(|e| remote("tls", e.to_string()))?,
                )
            }
            _ => None,
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut endpoint = Channel::from_shared(format!("{scheme}://{}:{}", url.host, url.port))
            .map_err(|e| remote("url", e.to_string()))?
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
                .map_err(|e| remote("tls", e.to_string()))?;
        }
        let channel = endpoint.connect().await.map_err(|e| {
            remote(
                "unavailable",
                format!("cannot connect: {}", error_chain(&e)),
            )
        })?;
        let auth = AttachToken::new(self.token()?.as_deref())
            .map_err(|s| remote("token", s.message().into()))?;
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

/// Stamps a finished transfer's wall time and throughput.
pub(crate) fn timed(
    mut sum: crate::CopySummary,
    started: std::time::Instant,
) -> crate::CopySummary {
    sum.duration_secs = started.elapsed().as_secs_f64();
    sum.throughput_bytes_per_sec = sum.volume_bytes as f64 / sum.duration_secs.max(1e-9);
    sum
}

/// The whole chain of an error's sources, for transport errors that hide the cause.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s += &format!(": {c}");
        cur = c.source();
    }
    s
}

/// Maps a gRPC status from `url` to a [`CopyError`] that says what to do.
pub fn status_error(url: &AgentUrl, s: tonic::Status) -> CopyError {
    use tonic::Code;
    let code = match s.code() {
        Code::Unauthenticated => "unauthenticated",
        Code::PermissionDenied => "permission denied",
        Code::NotFound => "not found",
        Code::AlreadyExists => "exists",
        Code::FailedPrecondition => "refused",
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Aborted => "unavailable",
        Code::DeadlineExceeded => "timeout",
        Code::InvalidArgument | Code::OutOfRange => "bad request",
        _ => "error",
    };
    let mut message = s.message().to_string();
    if let Some(src) = std::error::Error::source(&s) {
        message += &format!(" ({})", error_chain(src));
    }
    CopyError::Remote {
        url: url.to_string(),
        code: code.into(),
        message,
    }
}

/// The retry policy of every transfer: up to `retries` attempts while the error is
/// retryable, backing off 0.5 s, 1 s, 2 s … (at most 10 s) between them.
pub(crate) struct Backoff {
    retries: u32,
    delay: Duration,
}

impl Backoff {
    pub(crate) fn new(retries: u32) -> Self {
        Backoff {
            retries: retries.max(1),
            delay: Duration::from_millis(500),
        }
    }

    /// After attempt `n` failed with `e`: how long to wait before the next one, or
    /// `None` to give up.
    pub(crate) fn after(&mut self, n: u32, e: &CopyError) -> Option<Duration> {
        if !e.is_retryable() || n >= self.retries {
            return None;
        }
        let wait = self.delay;
        tracing::warn!("attempt {n} failed: {e}; retrying in {wait:?}");
        self.delay = (self.delay * 2).min(Duration::from_secs(10));
        Some(wait)
    }
}

/// Runs `attempt` until it succeeds or [`Backoff`] gives up.
pub(crate) async fn with_retries<T, F, Fut>(retries: u32, mut attempt: F) -> Result<T, CopyError>
where
    F: FnMut(u32) -> Fut,
    Fut: std::future::Future<Output = Result<T, CopyError>>,
{
    let mut backoff = Backoff::new(retries);
    for n in 1.. {
        match attempt(n).await {
            Err(e) => match backoff.after(n, &e) {
                Some(wait) => tokio::time::sleep(wait).await,
                None => return Err(e),
            },
            done => return done,
        }
    }
    unreachable!("the loop returns")
}

/// One group of a local volume as read.
pub(crate) struct Group {
    /// Its bytes: none where no chunk was read (every chunk known from an earlier cycle).
    pub win: Window,
    /// Its length in bytes.
    pub len: usize,
    /// Per chunk: zeros or a hole.
    pub zero: Vec<bool>,
    /// Per chunk: its Merkle leaf.
    pub leaves: Vec<ChunkId>,
    /// Per chunk: its kind.
    pub kinds: Vec<ChunkKind>,
    /// Bytes read from the volume for this group.
    pub bytes_read: u64,
}

impl Group {
    /// Sets the group's chunk kinds, and so its leaves.
    fn set_kinds(&mut self, key: &ChunkKey, chunk: ChunkSize, kinds: Vec<ChunkKind>) {
        self.leaves = kinds
            .iter()
            .zip(self.chunk_ranges(chunk))
            .map(|(k, r)| leaf_hash(key, k, r.len() as u64))
            .collect();
        self.kinds = kinds;
    }

    /// The byte ranges (within the group) of its chunks, in order.
    pub(crate) fn chunk_ranges(
        &self,
        chunk: ChunkSize,
    ) -> impl Iterator<Item = std::ops::Range<usize>> + use<> {
        chunker::chunk_ranges(self.len, chunk)
    }

    /// The group hash the agent reports for this group when it holds only zeros.
    pub(crate) fn zero_group_hash(&self, key: &ChunkKey, chunk: ChunkSize) -> ChunkId {
        let zeros: Vec<ChunkId> = self
            .chunk_ranges(chunk)
            .map(|r| leaf_hash(key, &ChunkKind::Zero, r.len() as u64))
            .collect();
        chunker::Summary::group_hash(key, &zeros)
    }
}

/// Reader threads of [`read_groups`]: three groups' reads in flight kept a delta push
/// reading about 15% faster than one on the bench's loop device (four did no better).
const READERS: u64 = 3;
/// Reader threads when only changed chunks are read: scattered small reads, where what
/// counts is how many the disk has in flight, not their size.
const SPARSE_READERS: u64 = 16;

/// What an earlier cycle's index says about a volume's chunks: their kinds then, and
/// which chunks may have changed since (from the file system's extent maps). Chunks not
/// marked changed are not read: their kind is taken from `base`.
#[derive(Clone, Debug)]
pub struct KnownChunks {
    /// Per chunk: its kind at the earlier cycle.
    pub base: Vec<ChunkKind>,
    /// Per chunk: whether it may differ from `base`.
    pub changed: Vec<bool>,
    /// The byte ranges written since (sorted, not overlapping): within a changed chunk,
    /// the only pages that may differ.
    pub ranges: Vec<std::ops::Range<u64>>,
}

impl KnownChunks {
    /// Chunks whose kinds were `base`, of which those touching `ranges` (bytes written
    /// since, in any order) may have changed.
    pub fn new(base: Vec<ChunkKind>, ranges: Vec<std::ops::Range<u64>>, chunk: ChunkSize) -> Self {
        let ranges = chunker::extents::merge_ranges(ranges);
        let n = base.len();
        let mut changed = vec![false; n];
        for r in &ranges {
            let first = ((r.start / chunk.get()) as usize).min(n);
            let end = (r.end.div_ceil(chunk.get()) as usize).min(n);
            changed[first..end].fill(true);
        }
        KnownChunks {
            base,
            changed,
            ranges,
        }
    }

    /// These chunks, with the byte ranges `dirty` (start, end pairs, e.g. a secondary's
    /// own writes since the cycle) also marked changed.
    pub fn with_dirty(&self, dirty: &[u64], chunk: ChunkSize) -> KnownChunks {
        let mut ranges = self.ranges.clone();
        ranges.extend(dirty.chunks_exact(2).map(|p| p[0]..p[1].max(p[0])));
        KnownChunks::new(self.base.clone(), ranges, chunk)
    }
}

/// Reads a local volume group by group (GROUP_CHUNKS chunks) on a blocking thread,
/// finding zero chunks and hashing every chunk into its Merkle leaf;
/// groups arrive in order on the returned channel, a few ahead of the consumer.
/// With `known`, only changed chunks are read (the others keep their known kinds), and
/// with a CV file only the written units of those: see [`units`].
pub(crate) fn read_groups(
    volume: std::sync::Arc<BlockVolume>,
    chunk: ChunkSize,
    key: ChunkKey,
    size: u64,
    known: Option<std::sync::Arc<KnownChunks>>,
    cvs: Option<std::sync::Arc<CvFile>>,
) -> tokio::sync::mpsc::Receiver<Result<Group, CopyError>> {
    let (tx, rx) = tokio::sync::mpsc::channel(3);
    std::thread::spawn(move || {
        if known.is_none() {
            volume.advise_sequential(); // not for scattered changed chunks: no readahead
        }
        let group_len = chunk.get() * chunker::GROUP_CHUNKS as u64;
        let groups = size.div_ceil(group_len);
        let t0 = std::time::Instant::now();
        let records = match (&known, &cvs) {
            (Some(k), Some(f)) => Some(units::load_records(k, f, chunk, size)),
            _ => None,
        };
        let loading = t0.elapsed();
        // Where a pass's time goes (debug log): reading and hashing, each summed over the
        // threads doing it.
        let reading = std::sync::atomic::AtomicU64::new(0);
        let hashing = std::sync::atomic::AtomicU64::new(0);
        // The kinds of group `g`'s chunks, as read into `win` (see units::kinds).
        let hash = |win: &Window, plans: &[units::Read], g: u64, parallel: bool| {
            let started = std::time::Instant::now();
            let kinds = units::kinds(
                &key,
                chunk,
                win,
                plans,
                known.as_deref(),
                g as usize * chunker::GROUP_CHUNKS,
                cvs.as_deref(),
                parallel,
            );
            hashing.fetch_add(
                started.elapsed().as_micros() as u64,
                std::sync::atomic::Ordering::Relaxed,
            );
            kinds
        };
        // Readers take turns by group, each a group ahead of this thread, so the disk
        // always has several groups' reads in flight while this one finds zeros and hashes
        // (whole groups, in parallel on the rayon pool; the few scattered chunks of a
        // cycle are hashed by their readers instead).
        std::thread::scope(|scope| {
            let readers = if known.is_some() {
                SPARSE_READERS
            } else {
                READERS
            };
            let turns: Vec<_> = (0..readers)
                .map(|first| {
                    let (read_tx, read_rx) = std::sync::mpsc::sync_channel(1);
                    let (volume, known, records, reading) = (&volume, &known, &records, &reading);
                    let hash = &hash;
                    scope.spawn(move || {
                        for g in (first..groups).step_by(readers as usize) {
                            let offset = g * group_len;
                            let len = group_len.min(size - offset) as usize;
                            let first_chunk = g as usize * chunker::GROUP_CHUNKS;
                            let plans = units::plan(
                                known.as_deref(),
                                records.as_ref(),
                                chunk,
                                first_chunk,
                                offset,
                                len,
                            );
                            let mut win = Window::default();
                            let started = std::time::Instant::now();
                            let wanted = |i: usize| matches!(plans[i], units::Read::Whole);
                            let whole = (0..plans.len()).any(wanted);
                            let units =
                                plans.iter().any(|p| matches!(p, units::Read::Units { .. }));
                            // Scattered changed chunks are read without a hole search
                            // (see read_chunks_where); a group with nothing to read gets
                            // no buffer at all.
                            let r = if known.is_none() {
                                read_window_where(volume, chunk, offset, len, wanted, &mut win)
                            } else if whole || units {
                                read_chunks_where(volume, chunk, offset, len, wanted, &mut win)
                            } else {
                                win.offset = offset;
                                win.unread = vec![true; plans.len()];
                                Ok(())
                            }
                            .map_err(CopyError::from)
                            .and_then(|()| {
                                let whole = (0..plans.len())
                                    .filter(|&i| !win.unread[i])
                                    .map(|i| chunk.get().min(len as u64 - i as u64 * chunk.get()))
                                    .sum::<u64>();
                                let units = units::read_units(volume, chunk, &plans, &mut win)
                                    .map_err(|e| chunker::ChunkerError::Read {
                                        path: volume.path().into(),
                                        offset,
                                        cause: e,
                                    })?;
                                Ok(whole + units)
                            });
                            reading.fetch_add(
                                started.elapsed().as_micros() as u64,
                                std::sync::atomic::Ordering::Relaxed,
                            );
                            // Scattered chunks are hashed here, by the readers side by
                            // side, not one group at a time by the thread that orders them.
                            let kinds = (known.is_some() && r.is_ok())
                                .then(|| hash(&win, &plans, g, false));
                            let failed = r.is_err();
                            // The consumer went away, or this read failed: stop.
                            if read_tx
                                .send(r.map(|read| (win, plans, read, kinds)))
                                .is_err()
                                || failed
                            {
                                break;
                            }
                        }
                    });
                    read_rx
                })
                .collect();
            for g in 0..groups {
                let (win, plans, bytes_read, kinds) = match turns[(g % readers) as usize].recv() {
                    Ok(Ok(read)) => read,
                    Ok(Err(e)) => {
                        let _ = tx.blocking_send(Err(e));
                        return;
                    }
                    Err(_) => {
                        // A reader died: say so, or the consumer would take the end of
                        // the channel for the end of the volume.
                        let died = chunker::ChunkerError::Read {
                            path: volume.path().into(),
                            offset: g * group_len,
                            cause: std::io::Error::other("the reader thread failed"),
                        };
                        let _ = tx.blocking_send(Err(CopyError::from(died)));
                        return;
                    }
                };
                let mut group = Group {
                    win,
                    len: group_len.min(size - g * group_len) as usize,
                    zero: Vec::new(),
                    leaves: Vec::new(),
                    kinds: Vec::new(),
                    bytes_read,
                };
                let kinds = kinds.unwrap_or_else(|| hash(&group.win, &plans, g, true));
                group.zero = kinds.iter().map(|k| *k == ChunkKind::Zero).collect();
                group.set_kinds(&key, chunk, kinds);
                // The consumer went away: stop reading (its own error explains why).
                if tx.blocking_send(Ok(group)).is_err() {
                    return;
                }
            }
        });
        tracing::debug!(
            records_secs = loading.as_secs_f64(),
            reading_secs = reading.into_inner() as f64 / 1e6,
            readers = if known.is_some() {
                SPARSE_READERS
            } else {
                READERS
            },
            hashing_secs = hashing.into_inner() as f64 / 1e6,
            "volume read"
        );
        // Dropping the receivers stops the readers.
    });
    rx
}

/// Group hashes of the remote summary, fetched in batches as the pass reaches them.
pub(crate) struct RemoteGroups {
    session: String,
    first: u64,
    hashes: Vec<ChunkId>,
}

const GROUP_BATCH: u32 = 4096;

impl RemoteGroups {
    pub(crate) fn new(session: String) -> Self {
        RemoteGroups {
            session,
            first: 0,
            hashes: Vec::new(),
        }
    }

    /// The remote hash of group `g`.
    pub(crate) async fn get(
        &mut self,
        client: &mut Client,
        url: &AgentUrl,
        g: u64,
    ) -> Result<ChunkId, CopyError> {
        if g < self.first || g >= self.first + self.hashes.len() as u64 {
            self.hashes = tree(client, url, &self.session, 1, g, GROUP_BATCH).await?;
            self.first = g;
        }
        self.hashes
            .get((g - self.first) as usize)
            .copied()
            .ok_or_else(|| CopyError::Remote {
                url: url.to_string(),
                code: "protocol".into(),
                message: format!(
                    "the agent has no group {g}: do both sides agree on the volume size?"
                ),
            })
    }
}

/// Node hashes of the remote summary at `level`.
pub(crate) async fn tree(
    client: &mut Client,
    url: &AgentUrl,
    session: &str,
    level: u32,
    first: u64,
    count: u32,
) -> Result<Vec<ChunkId>, CopyError> {
    let r = client
        .tree(transport::proto::TreeRequest {
            session: session.into(),
            level,
            first,
            count,
        })
        .await
        .map_err(|s| status_error(url, s))?
        .into_inner();
    Ok(r.hashes
        .chunks_exact(32)
        .map(|c| ChunkId(c.try_into().expect("32 bytes")))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_agent_urls() {
        assert_eq!(
            AgentUrl::parse("agent://node-b:7070/pvc-data")
                .unwrap()
                .unwrap(),
            AgentUrl {
                host: "node-b".into(),
                port: 7070,
                volume: "pvc-data".into()
            }
        );
        assert_eq!(
            AgentUrl::parse("agent://[::1]:7070/v")
                .unwrap()
                .unwrap()
                .host,
            "::1"
        );
        assert!(AgentUrl::parse("/dev/sda").is_none());
        for bad in [
            "agent://host/v",
            "agent://host:x/v",
            "agent://host:1/",
            "agent://host:1",
            "agent://:1/v",
        ] {
            assert!(AgentUrl::parse(bad).unwrap().is_err(), "{bad}");
        }
    }
}
