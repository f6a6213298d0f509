//! `mover agent` and `mover controller`: bind the listeners, wait for a signal, and
//! run the library's server.

use anyhow::Context;
use std::path::PathBuf;

/// `mover agent`'s arguments.
#[derive(clap::Args)]
pub struct AgentArgs {
    /// The agent's TOML configuration.
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
}

/// `mover fd-store`'s arguments.
#[derive(clap::Args)]
pub struct FdStoreArgs {
    /// The unix socket agents connect to (the agent's `fd_store`).
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/var/lib/mover/fd-store/store.sock"
    )]
    pub socket: PathBuf,
    /// How long connections are kept with no agent to take them; after that they are
    /// closed and their pods' I/O fails instead of waiting.
    #[arg(long, value_name = "DURATION", default_value = "15m", value_parser = mover::node::parse_duration)]
    pub orphan_after: std::time::Duration,
}

pub(crate) const FD_STORE_HELP: &str = "Keep the agent's device connections across its \
        restarts. A pod's volume served by the agent (a populated or moved PVC, until its \
        next stage) is a loop device over a FUSE file; the FUSE connection lives as long as \
        one descriptor of /dev/fuse for it is open. The agent puts each one here; while \
        the agent is gone (killed, restarted, upgraded) the kernel holds the pods' requests, \
        and the next agent takes the descriptors back, has the kernel send again what was \
        read but never answered (FUSE_NOTIFY_RESEND, Linux 6.9 or later; on an older \
        kernel the pods get EIO, as without a store), and serves on: the pods pause, and \
        see no error. Run it \
        beside the agent on each node (deploy/base/fd-store.yaml) and set fd_store in \
        agent.toml to its socket. It holds descriptors only: it reads no volume, needs no \
        privilege and no network. Restarted while the agent runs, it is given every \
        connection again by the agent within about 10 s; a store and an agent down at the \
        same moment lose them (the pods' I/O then fails with EIO).";

/// `mover fd-store`: serves until SIGTERM or SIGINT (as a container's PID 1 it would
/// otherwise ignore them, and a pod's deletion would wait out its grace period).
pub fn run_fd_store(args: &FdStoreArgs) -> anyhow::Result<()> {
    let signals = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    std::thread::spawn(move || {
        signals.block_on(async {
            use tokio::signal::unix::{SignalKind, signal};
            let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
        });
        tracing::warn!("fd store stopping: the connections it keeps for an agent that is down end");
        std::process::exit(0);
    });
    mover::fd_store::serve(&args.socket, args.orphan_after)
        .with_context(|| format!("fd store at {}", args.socket.display()))
}

/// `mover controller` subcommands.
#[cfg(feature = "controller")]
#[derive(clap::Subcommand)]
pub enum ControllerCommand {
    /// Write the CRDs (VolumeReplicationClass, VolumeReplication; HydrationSource and VolumeMove in replication.mover) as YAML files.
    Crds {
        /// The API group: replication.mover, or replication.storage.openshift.io to
        /// stand in for csi-addons.
        #[arg(long, default_value = mover::controller::crd::MOVER_GROUP)]
        group: String,
        /// The directory to write them into.
        #[arg(long, value_name = "DIR", default_value = "deploy/crds")]
        out: PathBuf,
    },
    /// Run the controller (in the cluster, or with a kubeconfig) until SIGINT or SIGTERM.
    Run(Box<mover::controller::RunOptions>),
    /// Rotate the cluster's mover CA, one step at a time (begin, issue, finish; status).
    #[command(
        long_about = "Rotate the cluster's mover CA, so that every certificate \
        it signed before (agents', operators', one that leaked) stops being accepted, \
        without a pause in replication. Three steps, each a change of Secret mover-ca \
        (made with your kubeconfig: whoever may write that Secret may do this); the \
        controller takes each within 5 s and publishes what the cluster trusts in \
        ConfigMap mover-ca-trust, which the agents read every 10 s.\n\n\
        1. begin: a next CA is trusted beside the current one; it signs nothing yet. \
        Give each peer cluster the two CAs now (--trust-out FILE; the peer's class \
        secret's ca.crt): a peer that does not trust the next CA cannot reach this \
        cluster's agents once step 2 is taken.\n\
        2. issue: the next CA signs; the current one is retired but still trusted. Every \
        agent asks for a certificate of the new CA within 10 s, the controller makes \
        its own again.\n\
        3. finish: refused until every agent holds a certificate of the new CA (--force \
        to drop the retired CA anyway); then nothing the retired CA signed is accepted. \
        Give the peers the new CA alone.\n\n\
        Example:\n  mover controller rotate-ca begin --trust-out both.crt\n  \
        # on each peer: kubectl -n mover-system patch secret CLASS_SECRET ... ca.crt=both.crt\n  \
        mover controller rotate-ca issue\n  mover controller rotate-ca status\n  \
        mover controller rotate-ca finish --trust-out new.crt"
    )]
    RotateCa {
        /// begin, issue, finish, or status.
        #[arg(value_enum)]
        step: RotateStep,
        /// Write what the cluster trusts after the step (PEM: what peers' class secrets'
        /// ca.crt must hold) into FILE.
        #[arg(long, value_name = "FILE")]
        trust_out: Option<PathBuf>,
        /// The controller's namespace, where the CA's Secret is.
        #[arg(long, default_value = "mover-system")]
        namespace: String,
        /// The agents' namespace, where ConfigMap mover-ca-trust is published.
        #[arg(long, default_value = "mover-system")]
        agent_namespace: String,
        /// finish: drop the retired CA even though some agents hold no certificate of
        /// the new one (they are cut off until they get one).
        #[arg(long)]
        force: bool,
    },
    /// Mint a short-lived client certificate for an operator, from the cluster's mover CA.
    #[command(long_about = "Mint a short-lived client certificate for an operator, \
        signed by the cluster's mover CA (Secret mover-ca, read with your kubeconfig: \
        whoever may read that Secret may do this). Agents take it as an operator's own: \
        the control role (status, sync, promote, demote), as the controller's.\n\n\
        Example:\n  mover controller operator-cert --out ~/.mover/prod\n  \
        mover replicate status NAME --agent agent://NODE@NODE_IP:7070 \\\n      \
        --tls-ca ~/.mover/prod/ca.crt --tls-cert ~/.mover/prod/tls.crt \
        --tls-key ~/.mover/prod/tls.key")]
    OperatorCert {
        /// Where to write tls.crt, tls.key (mode 0600) and ca.crt.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// How long it is valid (at most 24h).
        #[arg(long, default_value = "1h", value_parser = mover::node::parse_duration)]
        valid: std::time::Duration,
        /// The controller's namespace, where the CA's Secret is.
        #[arg(long, default_value = "mover-system")]
        namespace: String,
        /// Who it is for (its common name) [default: $USER].
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
    },
}

/// `mover agent`: serves until SIGINT or SIGTERM.
pub fn run_agent(config_path: &std::path::Path) -> anyhow::Result<()> {
    let config = mover::agent::AgentConfig::load(config_path)?;
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        let metrics = match config.metrics_listen {
            Some(addr) => Some(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen for metrics on {addr}"))?,
            ),
            None => None,
        };
        let shutdown = async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {},
                _ = term.recv() => {},
            }
            tracing::info!("shutting down: finishing calls in flight");
        };
        #[cfg(feature = "controller")]
        let signer = Some(&ClusterSigner as &dyn mover::agent::certificate::Signer);
        #[cfg(not(feature = "controller"))]
        let signer = None;
        #[cfg(feature = "controller")]
        let reviewer =
            Some(std::sync::Arc::new(mover::controller::scrape_review::ClusterReviewer) as _);
        #[cfg(not(feature = "controller"))]
        let reviewer = None;
        mover::agent::serve(config, listener, metrics, shutdown, signer, reviewer).await?;
        Ok(())
    })
}

/// The agent's certificate requests, sent to the cluster's CertificateSigningRequest API
/// by the controller crate (the one that speaks Kubernetes).
#[cfg(feature = "controller")]
struct ClusterSigner;

#[cfg(feature = "controller")]
impl mover::agent::certificate::Signer for ClusterSigner {
    fn sign<'a>(
        &'a self,
        name: &'a str,
        request: String,
        wait: std::time::Duration,
    ) -> mover::agent::certificate::SignFuture<'a> {
        Box::pin(mover::controller::agent_csr::sign(name, request, wait))
    }

    fn trust(&self) -> mover::agent::certificate::TrustFuture<'_> {
        Box::pin(async {
            let got = mover::controller::agent_csr::trust().await?;
            Ok(
                got.map(|(trust, signer)| mover::agent::certificate::ClusterTrust {
                    trust,
                    signer,
                }),
            )
        })
    }
}

/// A step of `mover controller rotate-ca`.
#[cfg(feature = "controller")]
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum RotateStep {
    /// Trust a next CA beside the current one.
    Begin,
    /// Sign with the next CA; the current one is retired, still trusted.
    Issue,
    /// Drop the retired CA.
    Finish,
    /// Show the step and which agents hold a certificate of the CA that signs.
    Status,
}

/// `mover controller ...`.
#[cfg(feature = "controller")]
pub fn run_controller(cmd: ControllerCommand) -> anyhow::Result<()> {
    match cmd {
        ControllerCommand::Crds { group, out } => {
            for path in mover::controller::write_crds(&group, &out)
                .with_context(|| format!("cannot write the CRDs into {}", out.display()))?
            {
                println!("{}", path.display());
            }
            Ok(())
        }
        ControllerCommand::OperatorCert {
            out,
            valid,
            namespace,
            name,
        } => {
            let runtime =
                tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            runtime.block_on(operator_cert(&out, valid, &namespace, name))
        }
        ControllerCommand::RotateCa {
            step,
            trust_out,
            namespace,
            agent_namespace,
            force,
        } => {
            let runtime =
                tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            runtime.block_on(rotate_ca(
                step,
                trust_out.as_deref(),
                &namespace,
                &agent_namespace,
                force,
            ))
        }
        ControllerCommand::Run(options) => {
            let runtime =
                tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            let ran = runtime.block_on(mover::controller::run(*options));
            // A replica that lost its Lease exits now: nothing still running (a watch, a
            // call to an agent, a blocking task) holds up its exit.
            runtime.shutdown_background();
            Ok(ran?)
        }
    }
}

/// `mover controller operator-cert`: a client certificate of the cluster's CA for an
/// operator, written into `out`.
#[cfg(feature = "controller")]
async fn operator_cert(
    out: &std::path::Path,
    valid: std::time::Duration,
    namespace: &str,
    name: Option<String>,
) -> anyhow::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    const LONGEST: std::time::Duration = std::time::Duration::from_secs(24 * 3600);
    anyhow::ensure!(
        valid <= LONGEST,
        "--valid {valid:?}: at most 24h (a certificate cannot be revoked; mint another \
         when it expires)"
    );
    let who = name
        .or_else(|| std::env::var("USER").ok())
        .unwrap_or_else(|| "operator".into());
    let ca = mover::controller::issuer::Authority::load_from_cluster(namespace).await?;
    let pem = ca
        .operator_identity(&who, valid)
        .context("cannot sign the certificate")?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    for (file, bytes, mode) in [
        ("tls.key", &pem.key, 0o600),
        ("tls.crt", &pem.cert, 0o600),
        ("ca.crt", &pem.ca, 0o644),
    ] {
        let path = out.join(file);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&path)
            .with_context(|| format!("cannot write {}", path.display()))?;
        std::io::Write::write_all(&mut f, bytes)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    println!(
        "{}/tls.crt: for {who}, valid {}; use with --tls-ca {0}/ca.crt --tls-cert {0}/tls.crt \
         --tls-key {0}/tls.key",
        out.display(),
        mover::controller::status::go_duration(valid)
    );
    Ok(())
}

/// `mover controller rotate-ca STEP`.
#[cfg(feature = "controller")]
async fn rotate_ca(
    step: RotateStep,
    trust_out: Option<&std::path::Path>,
    namespace: &str,
    agent_namespace: &str,
    force: bool,
) -> anyhow::Result<()> {
    use mover::controller::rotation::Rotation;
    let rotation = Rotation::of_cluster(namespace, agent_namespace).await?;
    let (trust, next) = match step {
        RotateStep::Begin => (
            rotation.begin().await?,
            "Give each peer cluster these two CAs (its class secret's ca.crt), then run \
             `mover controller rotate-ca issue`.",
        ),
        RotateStep::Issue => {
            eprintln!("waiting until the agents have read the next CA's trust…");
            (
                rotation.issue().await?,
                "The agents ask for certificates of the new CA now. `mover controller \
                 rotate-ca status` shows which hold one; then `rotate-ca finish`.",
            )
        }
        RotateStep::Finish => (
            rotation.finish(force).await?,
            "Nothing the retired CA signed is accepted any more. Give each peer cluster \
             the new CA alone (its class secret's ca.crt).",
        ),
        RotateStep::Status => {
            let report = rotation.status().await?;
            println!("rotation: {}", report.step);
            println!(
                "trust published for the agents (ConfigMap mover-ca-trust): {}",
                if report.published { "yes" } else { "not yet" }
            );
            for (node, done) in &report.agents {
                let has = if *done {
                    "a certificate of the CA that signs now"
                } else {
                    "none of the CA that signs now yet"
                };
                println!("agent on {node}: {has}");
            }
            (report.trust_pem, "")
        }
    };
    let cas = trust.matches("BEGIN CERTIFICATE").count();
    match trust_out {
        Some(path) => {
            std::fs::write(path, &trust)
                .with_context(|| format!("cannot write {}", path.display()))?;
            println!("{}: what the cluster trusts now ({cas} CA)", path.display());
        }
        None if !matches!(step, RotateStep::Status) => {
            println!("what the cluster trusts now ({cas} CA):\n{trust}")
        }
        None => {}
    }
    if !next.is_empty() {
        println!("{next}");
    }
    Ok(())
}

/// `mover agent --help`: what the agent serves, to whom, and an example config.
pub(crate) const AGENT_HELP: &str = "Run the per-node agent. It serves the volumes its config exports \
        (and nothing else) to peers: `mover copy SRC agent://HOST:PORT/NAME` pushes into an \
        export, `mover copy agent://HOST:PORT/NAME DST` pulls from one. Callers prove one of \
        two roles, by a certificate from the agent's CA or a bearer token: control \
        (token_file; the controller's certificate) registers exports and steers \
        relationships, schedules and hydrations; replication (replication_token_file, \
        what peer clusters present; this cluster's agents' certificates) only runs \
        cycles, hydrations and pulls against the exports its relationship names. Writes \
        carry a fencing epoch. /metrics and /healthz (which fails when the state directory \
        is not writable, a cycle is wedged, the gRPC server does not answer or the \
        certificate is near its end: it is renewed in place, see [tls] renew_every) are served on metrics_listen. Block exports are also served over NBD on a \
        Unix socket (nbd_socket, default STATE_DIR/nbd.sock) for clients on this node, \
        hydrating exports included (`mover hydrate`), and with [tls] on nbd_listen over \
        TCP to clients holding a certificate from the CA (nbds://). Under Kubernetes the controller \
        registers each replicated PersistentVolume as an export named after the PV, at the \
        path the PV names, if that path lies under one of volume_roots, for one \
        relationship, and serves it to that relationship only (kept across restarts in \
        STATE_DIR/exports.json). Stops gracefully on SIGINT or SIGTERM.\n\n\
        Example agent.toml:\n\n\
        \x20 listen = \"0.0.0.0:7070\"\n\
        \x20 metrics_listen = \"0.0.0.0:9470\"\n\
        \x20 token_file = \"/etc/mover/token\"\n\
        \x20 replication_token_file = \"/etc/mover/replication/token\"\n\
        \x20 nbd_socket = \"/run/mover/nbd.sock\"\n\
        \x20 volume_roots = [\"/var/lib/kubelet/plugins/kubernetes.io/csi\", \"/mnt/disks\"]\n\
        \x20 [tls]\n\
        \x20 cert = \"/etc/mover/agent.crt\"\n\
        \x20 key = \"/etc/mover/agent.key\"\n\
        \x20 ca = \"/etc/mover/ca.crt\"\n\
        \x20 # or, under Kubernetes: from_kubernetes = true (a certificate for NODE_NAME\n\
        \x20 # from the controller's CA through the CSR API, kept in STATE_DIR/tls)\n\
        \x20 [exports.pvc-data]\n\
        \x20 path = \"/dev/vg0/pvc-data\"\n\
        \x20 [exports.golden]\n\
        \x20 path = \"/srv/golden.img\"\n\
        \x20 read_only = true\n\
        \x20 namespaces = [\"app\"]   # populated PVCs of these namespaces may be filled from it\n\
        \x20 [exports.www]\n\
        \x20 path = \"/srv/www\"   # a directory: a file tree";
