//! `mover agent`: serves exported volumes to peers over gRPC (push into them, pull from
//! them), with mTLS and/or a bearer token, fencing epochs, and /metrics + /healthz on a
//! separate HTTP port; and to local clients over NBD on a Unix socket, hydrating
//! exports included (copy-on-demand).

pub mod certificate;
mod config;
mod control;
pub mod csi;
pub mod device;
mod fencing;
mod health;
mod hydration;
mod live;
mod metrics;
mod pages;
mod saved;
mod schedules;
pub use transport::scrape_access;
mod service;
mod session;
mod status;
mod transfer;
mod trees;

use crate::replicate::journal;
pub use config::{AgentConfig, ConfigError, MetricsAccess, TlsConfig};
pub use control::Control;
pub use fencing::{EpochStore, StaleEpoch};
pub use metrics::Metrics;
pub use mover_engine::node::{Export, ExportError, Exports};
pub use service::AgentService;

use std::{future::Future, sync::Arc};
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use transport::{
    MAX_MESSAGE,
    auth::{Authorize, Caller, Credentials, Role},
    control::replication_server::ReplicationServer,
    hydrate::hydration_server::HydrationServer,
    proto::transfer_server::TransferServer,
    tls::TlsPem,
};

/// Why the agent could not run.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// TLS files could not be loaded.
    #[error(transparent)]
    Tls(#[from] transport::tls::TlsError),
    /// No certificate from the cluster's signer.
    #[error(transparent)]
    Certificate(#[from] certificate::CertificateError),
    /// The server failed.
    #[error("agent server: {0}")]
    Serve(String),
    /// The state directory is unusable.
    #[error("agent state directory {path}: {cause}")]
    State {
        /// The directory.
        path: std::path::PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
}

/// Serves `config`'s exports on `listener` (and metrics on `metrics_listener`) until
/// `shutdown` resolves; in-flight calls are allowed to finish. `signer` answers the
/// certificate request of `[tls] from_kubernetes` (none in an agent-only build).
pub async fn serve(
    config: AgentConfig,
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
    signer: Option<&'static dyn certificate::Signer>,
    reviewer: Option<Arc<dyn scrape_access::Reviewer>>,
) -> Result<(), AgentError> {
    let gate = match (config.metrics_access, reviewer) {
        (MetricsAccess::Open, _) => None,
        (MetricsAccess::Kubernetes, Some(r)) => Some(Arc::new(scrape_access::Gate::new(r))),
        (MetricsAccess::Kubernetes, None) => {
            return Err(AgentError::Serve(
                "metrics_access = \"kubernetes\" needs a mover built with its Kubernetes \
                 part (the default `controller` feature)"
                    .into(),
            ));
        }
    };
    let credentials = Arc::new(Credentials {
        control_token: config.token()?,
        replication_tokens: config.replication_tokens()?,
        client_certificates: config.tls.is_some(),
    });
    let tls: Option<TlsPem> = match &config.tls {
        None => None,
        Some(t) => match t.files() {
            Some(files) => Some(files.load()?),
            None => {
                let node = config.node_name().ok_or_else(|| ConfigError::Invalid {
                    path: "agent.toml".into(),
                    why: "[tls] from_kubernetes needs the node's name: set node_name or the \
                          NODE_NAME environment variable (the downward API's spec.nodeName)"
                        .into(),
                })?;
                let trust = cluster_trust(signer).await;
                Some(
                    certificate::obtain(
                        &config.state_dir,
                        &node,
                        CERTIFICATE_WAIT,
                        signer,
                        trust.as_ref(),
                    )
                    .await?,
                )
            }
        },
    };
    // Renewed in place: new connections, both ways, get the renewed certificate.
    let tls = tls.map(transport::tls::LiveTls::new);
    if let (Some(live), Some(t)) = (&tls, &config.tls) {
        tokio::spawn(renew_certificate(
            live.clone(),
            t.clone(),
            config.state_dir.clone(),
            config.node_name(),
            signer,
        ));
    }
    let metrics = Arc::new(Metrics::default());
    let state_err = |cause| AgentError::State {
        path: config.state_dir.clone(),
        cause,
    };
    // Holds ended with the process that took them.
    crate::replicate::holds::clear_leftovers(&service::holds_dir(&config.state_dir));
    // Cycles committed before a crash are applied before anything else is served.
    for (dir, r) in journal::recover(&config.state_dir) {
        match r {
            Ok(c) => {
                tracing::info!(relationship = %c.relationship, cycle = c.id, "applied a committed cycle left by a crash")
            }
            Err(e) => {
                return Err(state_err(std::io::Error::other(format!(
                    "cannot apply the committed cycle in {}: {e}",
                    dir.display()
                ))));
            }
        }
    }
    let store = Arc::new(
        crate::replicate::Store::open(&config.state_dir)
            .map_err(|e| state_err(std::io::Error::other(e.to_string())))?,
    );
    // The CSI plugin's volumes are exports by their ids.
    let mut roots = config.volume_roots.clone();
    if config.csi_socket.is_some() {
        roots.push(config.csi_volumes());
    }
    let exports =
        Exports::open(config.exports.clone(), roots, &config.state_dir).map_err(state_err)?;
    let service = Arc::new(
        AgentService::new(
            exports.clone(),
            config.state_dir.clone(),
            metrics.clone(),
            store.clone(),
        )
        .map_err(state_err)?,
    );
    let remote = config.peer_options(tls.as_ref())?;
    // An agent killed while a file system was frozen for a cycle's clone left it frozen
    // (the kernel does not thaw it when the process dies): thaw those of its
    // relationships before anything else, or their applications stay blocked.
    let left_frozen = control::left_frozen(&config.state_dir);
    for m in store
        .all()
        .iter()
        .filter_map(|r| r.spec.freeze.clone())
        .chain(left_frozen)
    {
        let m = &m;
        match mover_engine::node::freeze::thaw(m) {
            Ok(()) => tracing::debug!(mount = %m.display(), "thawed (if it was frozen)"),
            Err(e) => tracing::warn!(mount = %m.display(), "cannot thaw: {e}"),
        }
    }
    let hydrations =
        crate::hydrate::Hydrations::new(&config.state_dir, exports.clone(), remote.clone())
            .map_err(state_err)?;
    let _ = service.hydrations.set(hydrations.clone());
    hydrations.resume_all().await;
    let runners = crate::replicate::Runners::new(store.clone(), exports.clone(), remote.clone());
    runners.start_all();
    let schedules =
        crate::schedule::Schedules::open(&config.state_dir, exports.clone()).map_err(state_err)?;
    schedules.start_all();
    let schedule_control = schedules::ScheduleControl {
        schedules: schedules.clone(),
        store: store.clone(),
    };
    let control = Control {
        service: service.clone(),
        runners: runners.clone(),
        advertise: config.advertise.clone(),
        tls_name: tls.as_ref().and_then(|_| config.node_name()),
        remote,
        schedules: schedules.clone(),
        frozen: Default::default(),
    };
    let server = TransferServer::from_arc(service)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let mut builder = tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(transport::STREAM_WINDOW)
        .initial_connection_window_size(transport::CONNECTION_WINDOW)
        .max_frame_size(transport::MAX_FRAME)
        .http2_keepalive_interval(Some(transport::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(transport::KEEPALIVE_TIMEOUT));
    // Peer clusters' agents carry certificates of their own cluster's CA: they connect
    // without one and prove themselves with a replication token.
    let client_auth_optional = !credentials.replication_tokens.is_empty();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let nbd_socket = config.nbd_socket();
    // The volumes as NBD serves them: what the NBD servers and the CSI devices open.
    let served = Arc::new(hydration::NbdExportsOf {
        exports: exports.clone(),
        hydrations: hydrations.clone(),
    });
    let stopped = || {
        let mut stop = stop_rx.clone();
        async move {
            let _ = stop.changed().await;
        }
    };
    {
        let (exports, stopped) = (served.clone(), stopped());
        let path = nbd_socket.clone();
        tokio::spawn(async move {
            if let Err(e) = transport::nbd::serve_unix(&path, exports, stopped).await {
                tracing::error!(socket = %path.display(), "cannot serve NBD: {e}");
            }
        });
    }
    if let (Some(addr), Some(pem)) = (config.nbd_listen, &tls) {
        // Refused at start if the certificate does not serve; renewed ones reach each
        // new connection.
        pem.get().acceptor()?;
        let live = pem.clone();
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| AgentError::Serve(format!("cannot listen for NBD on {addr}: {e}")))?;
        let (exports, stopped) = (served.clone(), stopped());
        tokio::spawn(async move {
            if let Err(e) = transport::nbd::serve_tcp(listener, exports, Some(live), stopped).await
            {
                tracing::error!(%addr, "cannot serve NBD: {e}");
            }
        });
    }
    let mut staged = None;
    if let Some(socket) = &config.csi_socket {
        let node = config.node_name().ok_or_else(|| ConfigError::Invalid {
            path: "agent.toml".into(),
            why: "csi_socket needs the node's name: set node_name or the NODE_NAME \
                  environment variable (the downward API's spec.nodeName)"
                .into(),
        })?;
        let store = match &config.fd_store {
            Some(socket) => {
                let socket = socket.clone();
                let connected = tokio::task::spawn_blocking(move || {
                    crate::fd_store::FdStore::connect(&socket, FD_STORE_WAIT)
                })
                .await
                .map_err(|e| AgentError::Serve(e.to_string()))?;
                Some(connected.map_err(|e| AgentError::Serve(e.to_string()))?)
            }
            None => None,
        };
        let frontend = device::FuseLoop::new(
            &config.state_dir.join("devices"),
            tokio::runtime::Handle::current(),
            store,
        )
        .map_err(state_err)?;
        let opened = served.clone();
        let devices =
            tokio::task::spawn_blocking(move || device::Devices::new(Box::new(frontend), opened))
                .await
                .map_err(|e| AgentError::Serve(e.to_string()))?;
        staged = Some(devices.clone());
        let plugin = csi::Plugin {
            node,
            exports: exports.clone(),
            devices,
            volumes: config.csi_volumes(),
        };
        let (path, stopped) = (socket.clone(), stopped());
        tokio::spawn(async move {
            if let Err(e) = csi::serve(plugin, path.clone(), stopped).await {
                tracing::error!(socket = %path.display(), "cannot serve the CSI plugin: {e}");
            }
        });
    }
    let hydration_control = hydration::HydrationControl {
        hydrations: hydrations.clone(),
        store: store.clone(),
        nbd_socket: Some(nbd_socket.clone()),
        exports: exports.clone(),
        volumes: config.csi_socket.as_ref().map(|_| config.csi_volumes()),
        devices: staged,
    };
    if let Some(l) = metrics_listener {
        let mut stop = stop_rx.clone();
        let health = Arc::new(health::Health {
            state_dir: config.state_dir.clone(),
            grpc: listener
                .local_addr()
                .map_err(|e| AgentError::Serve(e.to_string()))?,
            tls: tls.clone(),
            node: config.node_name(),
            runners: runners.clone(),
        });
        let scraped = Scraped {
            metrics,
            runners: runners.clone(),
            hydrations: hydrations.clone(),
            schedules: schedules.clone(),
        };
        tokio::spawn(serve_metrics(
            l,
            gate,
            Arc::new(scraped),
            health,
            async move {
                let _ = stop.changed().await;
            },
        ));
    }
    tracing::info!(addr = %listener.local_addr().map(|a| a.to_string()).unwrap_or_default(), exports = exports.names().len(), tls = tls.is_some(), nbd = %nbd_socket.display(), "agent serving");
    let authorize = |needs, service| Authorize::new(credentials.clone(), needs, service);
    let router = builder
        .add_service(InterceptedService::new(
            server,
            authorize(Role::Replication, "transfers"),
        ))
        // Its calls check the control role themselves, but for Get (a peer asks what
        // the other side of its relationship holds).
        .add_service(InterceptedService::new(
            ReplicationServer::new(control),
            authorize(Role::Replication, "the relationship control API"),
        ))
        .add_service(InterceptedService::new(
            HydrationServer::new(hydration_control),
            authorize(Role::Control, "the hydration control API"),
        ))
        .add_service(InterceptedService::new(
            transport::schedule::schedules_server::SchedulesServer::new(schedule_control),
            authorize(Role::Control, "the scheduled-snapshot API"),
        ));
    let result = match tls {
        // The agent accepts TLS itself, so that a renewed certificate reaches new
        // connections without a restart (tonic's own TLS keeps the one it started with).
        Some(live) => {
            let incoming = transport::tls::incoming(listener, live, client_auth_optional);
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
        None => {
            // The builder's tcp_nodelay does not reach connections from a given listener:
            // without it, Nagle's algorithm and the peer's delayed ACK hold small replies
            // for ~40 ms (the tail of a copy-on-demand read of a missing region).
            let incoming =
                tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
            router
                .serve_with_incoming_shutdown(incoming, shutdown)
                .await
        }
    }
    .map_err(|e| AgentError::Serve(e.to_string()));
    let _ = stop_tx.send(true);
    result
}

/// What the cluster trusts now, from `signer` (`None` if it cannot tell: the agent
/// then keeps what it trusts).
async fn cluster_trust(
    signer: Option<&dyn certificate::Signer>,
) -> Option<certificate::ClusterTrust> {
    match signer?.trust().await {
        Ok(trust) => trust,
        Err(e) => {
            tracing::warn!("cannot read what the cluster trusts now (kept what it trusted): {e}");
            None
        }
    }
}

/// Looks for a renewed certificate and puts it in `live`: the files read again every
/// `tls.renew_every`, or from the cluster, every [`AGENT_TRUST_EVERY`] at most: what it
/// trusts now, and a certificate from its signer once a third of the current one's life
/// is left or a CA rotation made another CA the signer ([`certificate::obtain`]). One
/// that does not load is not taken.
///
/// [`AGENT_TRUST_EVERY`]: transport::cluster::AGENT_TRUST_EVERY
async fn renew_certificate(
    live: transport::tls::LiveTls,
    tls: config::TlsConfig,
    state_dir: std::path::PathBuf,
    node: Option<String>,
    signer: Option<&'static dyn certificate::Signer>,
) {
    let every = match tls.files() {
        Some(_) => tls.renew_every,
        None => tls.renew_every.min(transport::cluster::AGENT_TRUST_EVERY),
    };
    loop {
        tokio::time::sleep(every).await;
        let fresh = match (tls.files(), &node) {
            (Some(files), _) => files.load().map_err(|e| e.to_string()),
            (None, Some(node)) => {
                let trust = cluster_trust(signer).await;
                certificate::obtain(&state_dir, node, CERTIFICATE_WAIT, signer, trust.as_ref())
                    .await
                    .map_err(|e| e.to_string())
            }
            (None, None) => return,
        };
        let checked = fresh.and_then(|pem| {
            pem.grpc_acceptor(false).map_err(|e| e.to_string())?;
            Ok(pem)
        });
        match checked {
            Ok(pem) => {
                if live.set(pem) {
                    tracing::info!(
                        "certificate or trust renewed: new connections get it (no restart)"
                    );
                }
            }
            Err(e) => tracing::warn!(
                "cannot renew the agent's certificate, tried again in {every:?}: {e}"
            ),
        }
    }
}

/// How long an agent waits at start for the fd store: it may be starting beside it, or
/// still serving the agent this one replaces, while that one exits. Then it exits with
/// the reason, to be started again (within the liveness probe's minute: /healthz is not
/// served yet).
const FD_STORE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long an agent waits at start for its certificate from the cluster's signer.
const CERTIFICATE_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

/// Refuses a call of the relationship control API from a caller without the control
/// role (the service admits the replication role for Get alone).
pub(super) fn control_only<T>(req: &tonic::Request<T>, call: &str) -> Result<(), tonic::Status> {
    match req.extensions().get::<Caller>() {
        Some(c) if c.role < Role::Control => Err(tonic::Status::permission_denied(format!(
            "{} may not call {call} of the relationship control API: the replication role \
             only runs cycles, hydrations and pulls against the exports its relationship \
             names; this takes the control role (the controller's certificate, or the \
             agent's token_file)",
            c.who
        ))),
        _ => Ok(()),
    }
}

/// What /metrics renders: the agent's own series, then its relationships',
/// hydrations' and schedules'.
struct Scraped {
    metrics: Arc<Metrics>,
    runners: Arc<crate::replicate::Runners>,
    hydrations: Arc<crate::hydrate::Hydrations>,
    schedules: Arc<crate::schedule::Schedules>,
}

impl Scraped {
    fn render(&self) -> String {
        self.metrics.render()
            + &self.runners.render()
            + &self.hydrations.render()
            + &self.schedules.render()
    }
}

/// /metrics (Prometheus text, behind `gate` if any) and /healthz on their own port.
async fn serve_metrics(
    listener: TcpListener,
    gate: Option<Arc<scrape_access::Gate>>,
    scraped: Arc<Scraped>,
    health: Arc<health::Health>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    use axum::{Router, routing::get};
    let app = Router::new()
        .route(
            "/metrics",
            get(move |headers: axum::http::HeaderMap| {
                let (scraped, gate) = (scraped.clone(), gate.clone());
                async move {
                    scrape_access::answer(gate.as_deref(), &headers, || scraped.render()).await
                }
            }),
        )
        .route(
            "/healthz",
            get(move || {
                let health = health.clone();
                async move { health.check().await }
            }),
        );
    if let Err(e) = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
    {
        tracing::error!("metrics server failed: {e}");
    }
}
