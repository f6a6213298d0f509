//! `mover controller run`, the manager: one place wires the watch caches, the metrics
//! server, the cluster's CA, the Locator, leader election and the reconcilers (one per
//! kind: `reconcile`, `populate`, `moves`), each a step of [`run`].

use super::agents::GrpcAgents;
use super::crd;
use super::leader::{Elector, Leadership, Timing};
use super::leftovers::Leftovers;
use super::replication::reconcile::{self, Caches, Context};
use super::secrets::SecretWatches;
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;
use kube::api::{Api, DynamicObject};
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{Controller, WatchStreamExt, watcher};
use std::sync::Arc;

/// Options of `mover controller run`.
#[derive(Clone, Debug, clap::Args)]
pub struct RunOptions {
    /// The API group to serve: replication.mover, or replication.storage.openshift.io
    /// where no csi-addons controller runs (RamenDR then drives mover as it is).
    #[arg(long, default_value = crd::MOVER_GROUP, env = "MOVER_GROUP")]
    pub group: String,
    /// The namespace of the agent DaemonSet's pods.
    #[arg(long, default_value = "mover-system", env = "MOVER_AGENT_NAMESPACE")]
    pub agent_namespace: String,
    /// The label selector of the agent pods.
    #[arg(long, default_value = crate::rotation::AGENT_SELECTOR)]
    pub agent_selector: String,
    /// The agents' gRPC port.
    #[arg(long, default_value_t = 7070)]
    pub agent_port: u16,
    /// The namespace of the Lease on which controller replicas elect the one that acts
    /// (the controller's own namespace).
    #[arg(long, default_value = "mover-system", env = "POD_NAMESPACE")]
    pub lease_namespace: String,
    /// Act at once, without electing a leader (one replica only, or outside a cluster).
    #[arg(long)]
    pub no_leader_election: bool,
    /// How long the leader's Lease holds without renewal: a standby replica takes over
    /// this long after the leader died (client-go's default, 15s; it renews well before).
    #[arg(long, default_value = "15s", value_parser = lease_seconds)]
    pub lease_duration: u64,
    /// How long the deletion of a VolumeReplication waits for an agent that does not
    /// answer. Then it finishes, with a Warning event naming what was left on the agent;
    /// the leader removes it once the agent answers again.
    #[arg(long, default_value = "60s", value_parser = mover_engine::node::parse_duration)]
    pub deletion_grace: std::time::Duration,
    /// Where /metrics (Prometheus) and /healthz are served.
    #[arg(long, default_value = "0.0.0.0:9471")]
    pub metrics_listen: std::net::SocketAddr,
    /// Who may read /metrics: `open` (whoever reaches --metrics-listen), or `kubernetes`
    /// (a bearer token the API server authenticates and authorizes for get /metrics: a
    /// ServiceAccount bound to ClusterRole mover-metrics-reader). /healthz stays open.
    #[arg(long, value_enum, default_value_t = MetricsAccess::Open)]
    pub metrics_access: MetricsAccess,
    /// The namespaces whose Secrets classes may name (a Role in each lets the
    /// controller read them; see deploy/README.md) [default: the controller's own].
    #[arg(long = "secret-namespace", value_name = "NAMESPACE")]
    pub secret_namespaces: Vec<String>,
    /// The agents' ServiceAccount (NAMESPACE/NAME is implied by --agent-namespace):
    /// only its pod-bound tokens get agent certificates.
    #[arg(long, default_value = "mover-agent")]
    pub agent_service_account: String,
    /// The controller's own ServiceAccount (in --lease-namespace): it asks for tokens of
    /// it to read changed blocks from CSI drivers' SnapshotMetadata services.
    #[arg(
        long,
        default_value = "mover-controller",
        env = "MOVER_SERVICE_ACCOUNT"
    )]
    pub service_account: String,
    /// The image of the Jobs the controller runs (the populator restores a snapshot with
    /// one into a PVC of a StorageClass that is not mover's CSI driver, before the PVC
    /// is bound) [default: the controller's own, read from its pod (POD_NAME)].
    #[arg(long, value_name = "IMAGE", env = "MOVER_JOB_IMAGE")]
    pub job_image: Option<String>,
    /// Talk to agents in plaintext with --token-file, and sign no certificates. By
    /// default the controller runs the cluster's mover CA (Secret mover-ca in its
    /// namespace): it signs the agents' certificate requests (signer
    /// replication.mover/agent) and reaches agents over TLS with a certificate of its own,
    /// checking each agent's against its node's name.
    #[arg(long)]
    pub insecure_plaintext: bool,
    /// Where the Locator listens: peer clusters' agents ask it which agent holds a
    /// relationship's secondary (their class's target is cluster://ADDRESS; expose it to
    /// them with a LoadBalancer or NodePort Service). Served only with
    /// --replication-token-file.
    #[arg(long, default_value = "0.0.0.0:7471")]
    pub locator_listen: std::net::SocketAddr,
    /// The replication tokens (one per line) peer clusters present to the Locator: the
    /// agents' replication_token_file.
    #[arg(long, value_name = "FILE")]
    pub replication_token_file: Option<std::path::PathBuf>,
    /// Authentication and TLS towards the agents (with --insecure-plaintext, or to
    /// override the cluster CA with files).
    #[command(flatten)]
    pub connect: mover_engine::remote::ConnectOptions,
}

/// The image of the controller's own container (its pod from POD_NAME, in `namespace`),
/// for the Jobs it runs: whatever registry and tag the install chose. "mover" if it
/// cannot be read (not in a pod), with a warning.
async fn own_image(client: &kube::Client, namespace: &str) -> String {
    let pod = match std::env::var("POD_NAME") {
        Ok(name) => Api::<Pod>::namespaced(client.clone(), namespace)
            .get(&name)
            .await
            .ok(),
        Err(_) => None,
    };
    let image = pod
        .and_then(|p| p.spec)
        .and_then(|s| s.containers.into_iter().find(|c| c.name == "controller"))
        .and_then(|c| c.image);
    image.unwrap_or_else(|| {
        tracing::warn!("cannot read this controller's pod image (POD_NAME): the populator's Jobs use image \"mover\"; set --job-image");
        "mover".into()
    })
}

/// How many VolumeReplications are reconciled at once.
const RECONCILES_AT_ONCE: u16 = 16;

/// Why the controller stopped.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// No kubeconfig or in-cluster configuration.
    #[error(
        "cannot reach the Kubernetes API: run in a pod with a service account, or set \
         KUBECONFIG (or write ~/.kube/config)"
    )]
    Client(#[source] kube::Error),
    /// The metrics port is taken.
    #[error("cannot listen for metrics on {addr}")]
    Listen {
        /// --metrics-listen.
        addr: std::net::SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// `--replication-token-file` cannot be read, or holds no token.
    #[error("--replication-token-file: {0}")]
    Tokens(transport::cluster::TokenFileError),
    /// The cluster's mover CA could not be loaded or made.
    #[error(transparent)]
    Authority(super::issuer::AuthorityError),
    /// A watch cache stopped before its first list arrived.
    #[error("a watch cache stopped before it was filled")]
    CachesStopped,
    /// The lease could not be renewed in time, or another replica took it: this one
    /// stops (and is restarted as a standby) rather than act next to it.
    #[error("lost the leader lease (not renewed in time, or taken by another replica); stopping")]
    LostLease,
    /// The CRDs are not installed in the served group.
    #[error(
        "VolumeReplications in group {group} cannot be listed; install the CRDs: \
         mover controller crds --group {group} --out DIR && kubectl apply -f DIR"
    )]
    NoCrd {
        /// The served group.
        group: String,
        /// What the API server said.
        source: kube::Error,
    },
}

/// Drops what a cached object carries and the controller never reads: managedFields
/// and the last-applied annotation are most of a small object's size (with 10,000 PVCs,
/// most of the controller's memory).
fn slim<K: kube::Resource>(o: &mut K) {
    o.managed_fields_mut().clear();
    o.annotations_mut()
        .remove("kubectl.kubernetes.io/last-applied-configuration");
}

/// A watch cache of `api` kept up to date by the returned future.
fn cache<K>(
    api: Api<K>,
    config: watcher::Config,
    dyntype: K::DynamicType,
) -> (Store<K>, impl std::future::Future<Output = ()> + Send)
where
    K: kube::Resource
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
    K::DynamicType: Clone + Eq + std::hash::Hash + Send + Sync,
{
    let writer = reflector::store::Writer::new(dyntype);
    let reader = writer.as_reader();
    let run = reflector::reflector(writer, watcher(api, config).modify(slim))
        .default_backoff()
        .for_each(|_| futures::future::ready(()));
    (reader, run)
}

/// A cache as [`cache`] makes that also sends the reference of each object it sees made,
/// changed or deleted, for reconciles of another kind to wait on. At most `buffer` wait:
/// more are dropped (a standby consumes none; whatever they would have started happens
/// at the next retry anyway).
fn cache_with_changes<K>(
    api: Api<K>,
    config: watcher::Config,
    buffer: usize,
) -> (
    Store<K>,
    impl std::future::Future<Output = ()> + Send,
    futures::channel::mpsc::Receiver<ObjectRef<K>>,
)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let writer = reflector::store::Writer::new(());
    let reader = writer.as_reader();
    let (mut changed, changes) = futures::channel::mpsc::channel(buffer);
    let run = reflector::reflector(writer, watcher(api, config).modify(slim))
        .default_backoff()
        .touched_objects()
        .for_each(move |object| {
            if let Ok(object) = object {
                let _ = changed.try_send(ObjectRef::from_obj(&object));
            }
            futures::future::ready(())
        });
    (reader, run, changes)
}

/// The VolumeReplications (of kind `vr`) among `vrs` whose dataSource is `pvc`.
fn naming(
    vrs: &[Arc<DynamicObject>],
    pvc: &ObjectRef<PersistentVolumeClaim>,
    vr: &kube::api::ApiResource,
) -> Vec<ObjectRef<DynamicObject>> {
    vrs.iter()
        .filter(|v| {
            v.namespace() == pvc.namespace
                && v.data["spec"]["dataSource"]["name"].as_str() == Some(&pvc.name)
        })
        .map(|v| ObjectRef::from_obj_with(v.as_ref(), vr.clone()))
        .collect()
}

/// The VolumeReplications of `namespace` whose relationship's name hashes to `hash`
/// (the label of what a cycle from CSI snapshots makes).
fn of_relationship(
    vrs: &[Arc<DynamicObject>],
    namespace: &str,
    hash: &str,
    vr: &kube::api::ApiResource,
) -> Vec<ObjectRef<DynamicObject>> {
    use super::replication::desired::relationship_name_of;
    vrs.iter()
        .filter(|v| v.namespace().as_deref() == Some(namespace))
        .filter(|v| {
            let handle = v.data["spec"]["replicationHandle"].as_str().unwrap_or("");
            mover_engine::node::name_hash(&relationship_name_of(namespace, &v.name_any(), handle))
                == hash
        })
        .map(|v| ObjectRef::from_obj_with(v.as_ref(), vr.clone()))
        .collect()
}

/// A cache of the Nodes' metadata only (names and labels: what node affinities select).
/// A metadata-only watch: a Node's status (images, conditions) is most of its size.
fn node_cache(client: kube::Client) -> (Store<Node>, impl std::future::Future<Output = ()> + Send) {
    use futures::TryStreamExt;
    use watcher::Event;
    let writer = reflector::store::Writer::<Node>::default();
    let reader = writer.as_reader();
    let node = |m: PartialObjectMeta<Node>| Node {
        metadata: ObjectMeta {
            name: m.metadata.name,
            uid: m.metadata.uid,
            resource_version: m.metadata.resource_version,
            labels: m.metadata.labels,
            ..Default::default()
        },
        ..Default::default()
    };
    let api = Api::<PartialObjectMeta<Node>>::all_with(client, &Default::default());
    let events = watcher(api, watcher::Config::default()).map_ok(move |e| match e {
        Event::Apply(m) => Event::Apply(node(m)),
        Event::Delete(m) => Event::Delete(node(m)),
        Event::InitApply(m) => Event::InitApply(node(m)),
        Event::Init => Event::Init,
        Event::InitDone => Event::InitDone,
    });
    let run = reflector::reflector(writer, events)
        .default_backoff()
        .for_each(|_| futures::future::ready(()));
    (reader, run)
}

/// A watch cache's feed, spawned once the context is made.
type Feed = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Runs the controller until SIGINT or SIGTERM, or until it loses the Lease. Every
/// replica keeps its caches warm and serves the Locator; only the Lease holder
/// reconciles, signs the agents' certificates and sweeps leftovers.
///
/// Only the leader writes: every write to the API server and every agent call made for
/// the reconcilers goes through a gate that refuses it once this replica's lease is
/// past its renew deadline ([`super::leader`]).
pub async fn run(options: RunOptions) -> Result<(), RunError> {
    let identity = std::env::var("HOSTNAME").unwrap_or_else(|_| "mover-controller".into());
    let leadership = match options.no_leader_election {
        true => Leadership::sole(),
        false => Leadership::follower(),
    };
    // `client` reads, makes the CA at start and keeps the Lease; `acting` is the gated
    // one, for everything the leader does.
    let (client, acting) = connect(&options.group, leadership.clone()).await?;
    let mut elector = (!options.no_leader_election).then(|| {
        let timing = Timing::for_lease(std::time::Duration::from_secs(options.lease_duration));
        let (namespace, me) = (&options.lease_namespace, identity.clone());
        Elector::new(client.clone(), namespace, me, timing, leadership.clone())
    });
    let (caches, feeds, pvc_changes) = start_caches(&client, &options);
    let metrics = serve_metrics(options.metrics_listen, options.metrics_access).await?;
    let (authority, locator_tls, connect) = identities(&client, &options).await?;
    let agents =
        agents_client(connect, authority.is_some(), &caches.agents).with_leadership(leadership);
    let ctx = Arc::new(context(&acting, &options, caches, agents, metrics).await);
    for feed in feeds {
        tokio::spawn(feed);
    }
    synced(&ctx.caches).await?;
    tracing::info!("watch caches synced");
    if let Some(file) = &options.replication_token_file {
        start_locator(&client, &options, file, locator_tls, ctx.clone()).await?;
    }
    if let Some(e) = &mut elector {
        tracing::info!(%identity, "waiting for the leader lease");
        e.acquire().await;
        tracing::info!(%identity, "holding the leader lease");
    }
    tracing::info!(group = %ctx.group, "controller started");
    start_leader_tasks(&acting, &options, authority, &ctx);
    let reconcilers = reconcilers(&acting, ctx, pvc_changes);
    match &mut elector {
        None => reconcilers.await,
        Some(e) => {
            let lost = tokio::select! {
                _ = reconcilers => false,
                _ = e.hold() => true,
            };
            if lost {
                return Err(RunError::LostLease);
            }
            // Shut down (a signal): a standby takes over at once, not a lease later.
            e.release().await;
        }
    }
    Ok(())
}

/// Two clients of the API server, once it serves `group`'s VolumeReplications: one as
/// it is, and one whose writes pass only while `leadership` leads.
async fn connect(
    group: &str,
    leadership: Arc<Leadership>,
) -> Result<(kube::Client, kube::Client), RunError> {
    // The API server is reached over TLS, and rustls will not pick between the two
    // crypto providers the dependencies bring.
    transport::tls::install_crypto_provider();
    let config = kube::Config::infer()
        .await
        .map_err(|e| RunError::Client(kube::Error::InferConfig(e)))?;
    let build = || kube::client::ClientBuilder::try_from(config.clone()).map_err(RunError::Client);
    let client = build()?.build();
    let acting = build()?
        .with_layer(&super::leader::gate(leadership))
        .build();
    let vr = crd::api_resource(group, "VolumeReplication");
    let vrs: Api<DynamicObject> = Api::all_with(client.clone(), &vr);
    vrs.list(&kube::api::ListParams::default().limit(1))
        .await
        .map_err(|source| RunError::NoCrd {
            group: group.into(),
            source,
        })?;
    Ok((client, acting))
}

/// The watch caches reconciles read, the feeds that fill them, and the PVCs' changes.
fn start_caches(
    client: &kube::Client,
    options: &RunOptions,
) -> (
    Caches,
    Vec<Feed>,
    futures::channel::mpsc::Receiver<ObjectRef<PersistentVolumeClaim>>,
) {
    let class = crd::api_resource(&options.group, "VolumeReplicationClass");
    let (classes, w1) = cache(
        Api::<DynamicObject>::all_with(client.clone(), &class),
        watcher::Config::default(),
        class.clone(),
    );
    let (pvcs, w2, pvc_changes) =
        cache_with_changes(Api::all(client.clone()), watcher::Config::default(), 4096);
    let (pvs, w3) = cache(Api::all(client.clone()), watcher::Config::default(), ());
    let (attachments, w4) = cache(Api::all(client.clone()), watcher::Config::default(), ());
    let (agents, w5) = cache(
        Api::namespaced(client.clone(), &options.agent_namespace),
        watcher::Config::default().labels(&options.agent_selector),
        (),
    );
    let (nodes, w6) = node_cache(client.clone());
    let caches = Caches {
        classes,
        pvcs,
        pvs,
        attachments,
        agents,
        nodes,
    };
    let feeds: Vec<Feed> = vec![
        Box::pin(w1),
        Box::pin(w2),
        Box::pin(w3),
        Box::pin(w4),
        Box::pin(w5),
        Box::pin(w6),
    ];
    (caches, feeds, pvc_changes)
}

/// Who may read the controller's /metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum MetricsAccess {
    /// Whoever reaches the port.
    Open,
    /// A token the API server authenticates and authorizes (`transport::scrape_access`).
    Kubernetes,
}

/// Serves /metrics (to whom `access` says) and /healthz on `listen`.
async fn serve_metrics(
    listen: std::net::SocketAddr,
    access: MetricsAccess,
) -> Result<Arc<super::metrics::Metrics>, RunError> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|source| RunError::Listen {
            addr: listen,
            source,
        })?;
    let metrics = Arc::new(super::metrics::Metrics::default());
    let m = metrics.clone();
    let gate = (access == MetricsAccess::Kubernetes).then(|| {
        Arc::new(transport::scrape_access::Gate::new(Arc::new(
            super::scrape_review::ClusterReviewer,
        )))
    });
    let app = axum::Router::new()
        .route(
            "/metrics",
            axum::routing::get(move |headers: axum::http::HeaderMap| async move {
                transport::scrape_access::answer(gate.as_deref(), &headers, || m.render()).await
            }),
        )
        .route("/healthz", axum::routing::get(|| async { "ok" }));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "metrics server stopped");
        }
    });
    Ok(metrics)
}

/// The cluster's CA (none with --insecure-plaintext), the Locator's certificate, and
/// how agents are reached (with this controller's own certificate).
async fn identities(
    client: &kube::Client,
    options: &RunOptions,
) -> Result<
    (
        Option<super::issuer::LiveAuthority>,
        Option<transport::tls::LiveTls>,
        mover_engine::remote::ConnectOptions,
    ),
    RunError,
> {
    let mut connect = options.connect.clone();
    if options.insecure_plaintext {
        return Ok((None, None, connect));
    }
    let ca_error = |e: rcgen::Error| {
        RunError::Authority(super::issuer::AuthorityError::new(
            &options.lease_namespace,
            e.to_string(),
        ))
    };
    let a = super::issuer::Authority::load_or_create(client, &options.lease_namespace)
        .await
        .map_err(RunError::Authority)?;
    let own = transport::tls::LiveTls::new(a.controller_identity().map_err(ca_error)?);
    let locator = transport::tls::LiveTls::new(a.locator_identity().map_err(ca_error)?);
    connect.tls_pem = Some(own.clone());
    let a = super::issuer::LiveAuthority::new(a);
    tokio::spawn(follow_ca(
        client.clone(),
        options.lease_namespace.clone(),
        a.clone(),
        own,
        locator.clone(),
    ));
    Ok((Some(a), Some(locator), connect))
}

/// Reads the CA's Secret every [`CA_CHECK_EVERY`]: a rotation's step changes what this
/// controller signs with and trusts, and its own certificates are made again from the
/// CA that signs now. They are also made again two thirds of their life on. In place:
/// new connections get them, and they never expire in use.
async fn follow_ca(
    client: kube::Client,
    namespace: String,
    authority: super::issuer::LiveAuthority,
    own: transport::tls::LiveTls,
    locator: transport::tls::LiveTls,
) {
    use super::rotation::CA_CHECK_EVERY;
    let renew_every = transport::cluster::AGENT_CERTIFICATE_LIFETIME * 2 / 3;
    let mut made = tokio::time::Instant::now();
    loop {
        tokio::time::sleep(CA_CHECK_EVERY).await;
        let changed = match super::issuer::Authority::load(&client, &namespace).await {
            Ok(a) => authority.set(a),
            Err(e) => {
                tracing::warn!("cannot read the CA again, tried again in {CA_CHECK_EVERY:?}: {e}");
                false
            }
        };
        if !changed && made.elapsed() < renew_every {
            continue;
        }
        let a = authority.get();
        match (a.controller_identity(), a.locator_identity()) {
            (Ok(mine), Ok(loc)) => {
                own.set(mine);
                locator.set(loc);
                made = tokio::time::Instant::now();
                match changed {
                    true => tracing::info!(
                        "the CA changed (a rotation's step): this controller now signs, \
                         trusts and presents certificates of it"
                    ),
                    false => {
                        tracing::info!("this controller's own certificates renewed (no restart)")
                    }
                }
            }
            (Err(e), _) | (_, Err(e)) => {
                tracing::error!("cannot make this controller's own certificates: {e}")
            }
        }
    }
}

/// The agents' control API, reached with `connect`; over TLS, each agent's
/// certificate is checked against its node's name, found among the agent `pods`.
fn agents_client(
    connect: mover_engine::remote::ConnectOptions,
    tls: bool,
    pods: &Store<Pod>,
) -> GrpcAgents {
    let agents = GrpcAgents::new(connect);
    if !tls {
        return agents;
    }
    // Agents run in the host network: an agent pod's address is its node's.
    let pods = pods.clone();
    agents.with_server_names(Box::new(move |host: &str| {
        pods.state().iter().find_map(|p| {
            let ip = p.status.as_ref()?.pod_ip.as_deref()?;
            (ip == host).then(|| p.spec.as_ref()?.node_name.clone())?
        })
    }))
}

/// What every reconcile shares.
async fn context(
    client: &kube::Client,
    options: &RunOptions,
    caches: Caches,
    agents: GrpcAgents,
    metrics: Arc<super::metrics::Metrics>,
) -> Context {
    let secret_namespaces = if options.secret_namespaces.is_empty() {
        vec![options.lease_namespace.clone()]
    } else {
        options.secret_namespaces.clone()
    };
    Context {
        client: client.clone(),
        group: options.group.clone(),
        agents: Arc::new(agents),
        caches,
        agent_port: options.agent_port,
        csi: super::context::SnapshotSettings {
            namespace: options.lease_namespace.clone(),
            service_account: options.service_account.clone(),
            failed: Default::default(),
        },
        job_image: match &options.job_image {
            Some(i) => i.clone(),
            None => own_image(client, &options.lease_namespace).await,
        },
        metrics,
        secrets: Some(Arc::new(SecretWatches::new(
            client.clone(),
            secret_namespaces,
        ))),
        leftovers: Some((
            options.deletion_grace,
            Arc::new(Leftovers::new(client.clone(), &options.lease_namespace)),
        )),
        recorder: Some(kube::runtime::events::Recorder::new(
            client.clone(),
            kube::runtime::events::Reporter {
                controller: "mover-controller".into(),
                instance: std::env::var("POD_NAME").ok(),
            },
        )),
    }
}

/// Waits until every cache holds its first full list: a VR looked at with an empty
/// cache would be marked Degraded ("PVC not found") for nothing, with a Warning event
/// and a status write each, on every start and leader change.
async fn synced(caches: &Caches) -> Result<(), RunError> {
    let ready = async {
        caches.classes.wait_until_ready().await?;
        caches.pvcs.wait_until_ready().await?;
        caches.pvs.wait_until_ready().await?;
        caches.attachments.wait_until_ready().await?;
        caches.agents.wait_until_ready().await?;
        caches.nodes.wait_until_ready().await
    };
    ready.await.map_err(|_| RunError::CachesStopped)
}

/// Serves the Locator to peer clusters' agents (every replica, from caches of its own).
async fn start_locator(
    client: &kube::Client,
    options: &RunOptions,
    token_file: &std::path::Path,
    tls: Option<transport::tls::LiveTls>,
    ctx: Arc<Context>,
) -> Result<(), RunError> {
    let vr = crd::api_resource(&options.group, "VolumeReplication");
    let (vrs, w) = cache(
        Api::<DynamicObject>::all_with(client.clone(), &vr),
        watcher::Config::default(),
        vr.clone(),
    );
    tokio::spawn(w);
    vrs.wait_until_ready()
        .await
        .map_err(|_| RunError::CachesStopped)?;
    let service = super::locator::LocatorService { vrs, ctx };
    serve_locator(options.locator_listen, token_file, tls, service).await
}

/// What only the leader does besides reconciling: sign the agents' certificate
/// requests, and remove what deletions left on agents that were down once they answer.
fn start_leader_tasks(
    client: &kube::Client,
    options: &RunOptions,
    authority: Option<super::issuer::LiveAuthority>,
    ctx: &Context,
) {
    if let Some(authority) = authority {
        let user = format!(
            "system:serviceaccount:{}:{}",
            options.agent_namespace, options.agent_service_account
        );
        tokio::spawn(super::issuer::sign_requests(
            client.clone(),
            authority.clone(),
            user,
        ));
        tokio::spawn(publish_trust(
            client.clone(),
            options.agent_namespace.clone(),
            authority,
        ));
    }
    if let Some((grace, leftovers)) = ctx.leftovers.clone() {
        let agents = ctx.agents.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(grace.min(std::time::Duration::from_secs(30)));
            loop {
                every.tick().await;
                if let Err(e) = leftovers.sweep(&*agents).await {
                    tracing::warn!(error = %e, "cannot read or update the leftovers record");
                }
            }
        });
    }
}

/// Publishes what the cluster trusts for the agents (ConfigMap
/// [`super::issuer::TRUST_CONFIGMAP`]) at start and whenever the CA changes.
async fn publish_trust(
    client: kube::Client,
    namespace: String,
    authority: super::issuer::LiveAuthority,
) {
    let mut published: Option<Arc<super::issuer::Authority>> = None;
    loop {
        let a = authority.get();
        if !published.as_ref().is_some_and(|p| Arc::ptr_eq(p, &a)) {
            match super::rotation::publish_trust(&client, &namespace, &a).await {
                Ok(wrote) => {
                    if wrote {
                        tracing::info!(
                            configmap = super::issuer::TRUST_CONFIGMAP,
                            "published what the cluster trusts for its agents"
                        );
                    }
                    published = Some(a);
                }
                Err(e) => tracing::warn!(
                    "cannot publish the cluster's trust in ConfigMap {}, tried again: {e}",
                    super::issuer::TRUST_CONFIGMAP
                ),
            }
        }
        tokio::time::sleep(super::rotation::CA_CHECK_EVERY).await;
    }
}

/// The reconcilers, one per kind, run together until one ends (a signal):
/// VolumeReplications, and in mover's own group the populator and moves.
async fn reconcilers(
    client: &kube::Client,
    ctx: Arc<Context>,
    pvc_changes: futures::channel::mpsc::Receiver<ObjectRef<PersistentVolumeClaim>>,
) {
    let replications = replications(client, ctx.clone(), pvc_changes);
    // PVCs whose dataSourceRef names a HydrationSource, and moves of owned volumes: the
    // kinds are mover's, served in its own group only.
    let own = async {
        if ctx.group != super::crd::MOVER_GROUP {
            return std::future::pending().await;
        }
        let populator = Controller::new(
            Api::<PersistentVolumeClaim>::all(client.clone()),
            watcher::Config::default(),
        )
        .shutdown_on_signal()
        .run(
            super::populate::populator::reconcile,
            super::populate::populator::error_policy,
            ctx.clone(),
        )
        .for_each(|_| futures::future::ready(()));
        let moves = Controller::new(
            Api::<super::crd::VolumeMove>::all(client.clone()),
            watcher::Config::default(),
        )
        .shutdown_on_signal()
        .run(
            super::moves::reconcile,
            super::moves::error_policy,
            ctx.clone(),
        )
        .for_each(|_| futures::future::ready(()));
        // Populated PVs whose end is the controller's (their reclaim policy, Delete).
        let populated = Controller::new(
            Api::<PersistentVolume>::all(client.clone()),
            watcher::Config::default().labels(super::populate::populator::POPULATED_FROM),
        )
        .shutdown_on_signal()
        .run(
            super::populate::reclaim::reconcile,
            super::populate::reclaim::error_policy,
            ctx.clone(),
        )
        .for_each(|_| futures::future::ready(()));
        let sources = Controller::new(
            Api::<super::crd::HydrationSource>::all(client.clone()),
            watcher::Config::default(),
        )
        .shutdown_on_signal()
        .run(
            super::populate::sources::reconcile,
            super::populate::sources::error_policy,
            ctx.clone(),
        )
        .for_each(|_| futures::future::ready(()));
        // Prime PVCs, whose user's PVC may be deleted before they are filled.
        let primes = Controller::new(
            Api::<PersistentVolumeClaim>::all(client.clone()),
            watcher::Config::default().labels(super::populate::prime::PRIME_FOR),
        )
        .shutdown_on_signal()
        .run(
            super::populate::prime::reconcile_prime,
            super::populate::prime::prime_error_policy,
            ctx.clone(),
        )
        .for_each(|_| futures::future::ready(()));
        futures::join!(populator, moves, populated, sources, primes);
    };
    tokio::select! {
        _ = replications => {}
        _ = own => {}
    }
}

/// The VolumeReplications' reconciler, from a cache of their own slimmed as the others
/// (their managedFields, the status the controller applies field by field, were half
/// its memory).
fn replications(
    client: &kube::Client,
    ctx: Arc<Context>,
    pvc_changes: futures::channel::mpsc::Receiver<ObjectRef<PersistentVolumeClaim>>,
) -> impl std::future::Future<Output = ()> {
    let vr = crd::api_resource(&ctx.group, "VolumeReplication");
    let vrs: Api<DynamicObject> = Api::all_with(client.clone(), &vr);
    let writer = reflector::store::Writer::new(vr.clone());
    let vr_cache = writer.as_reader();
    let vr_events = reflector::reflector(
        writer,
        watcher(vrs, watcher::Config::default()).modify(slim),
    )
    .default_backoff()
    .applied_objects();
    // A VolumeReplication is looked at again when its PVC changes: one made with its PVC
    // starts as soon as the PVC binds, not a retry later (1,000 made at once took six
    // minutes to start, waiting on 30 s retries as kube-controller-manager bound them).
    let naming_pvc = {
        let (vrs, vr) = (vr_cache.clone(), vr.clone());
        move |pvc: ObjectRef<PersistentVolumeClaim>| {
            futures::stream::iter(naming(&vrs.state(), &pvc, &vr))
        }
    };
    // And when an object of its cycle from CSI snapshots changes (a snapshot ready, a
    // clone bound, a reader running): the next step is taken then, not at a poll.
    let of_cycle = {
        let (vrs, vr) = (vr_cache.clone(), vr.clone());
        move |(namespace, hash): (String, String)| {
            futures::stream::iter(of_relationship(&vrs.state(), &namespace, &hash, &vr))
        }
    };
    let cycle_changes = super::replication::csi_snapshots::changes(client).flat_map(of_cycle);
    Controller::for_stream_with(vr_events, vr_cache, vr)
        .reconcile_on(pvc_changes.flat_map(naming_pvc))
        .reconcile_on(cycle_changes)
        // A bounded number of reconciles at once: on a start with 1,000 resources, all
        // of them at once held 1,000 agent calls' buffers (a 150 MiB peak).
        .with_config(kube::runtime::controller::Config::default().concurrency(RECONCILES_AT_ONCE))
        .shutdown_on_signal()
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|r| {
            if let Err(e) = r {
                tracing::debug!(error = %e, "reconcile");
            }
            futures::future::ready(())
        })
}

/// Serves the Locator on `addr` (TLS with `tls`), to callers with a token in
/// `token_file`.
async fn serve_locator(
    addr: std::net::SocketAddr,
    token_file: &std::path::Path,
    tls: Option<transport::tls::LiveTls>,
    service: super::locator::LocatorService,
) -> Result<(), RunError> {
    use transport::auth::{Authorize, Credentials, Role};
    let credentials = Arc::new(Credentials {
        replication_tokens: transport::cluster::read_replication_tokens(token_file)
            .map_err(RunError::Tokens)?,
        ..Default::default()
    });
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| RunError::Listen { addr, source })?;
    let router = tonic::transport::Server::builder().add_service(
        tonic::service::interceptor::InterceptedService::new(
            transport::locate::locator_server::LocatorServer::new(service),
            Authorize::new(credentials, Role::Replication, "the Locator"),
        ),
    );
    tracing::info!(%addr, tls = tls.is_some(), "locator serving");
    tokio::spawn(async move {
        // Over TLS it accepts connections itself, so that its renewed certificate
        // reaches new ones (peer clusters' agents present no certificate: optional).
        let served = match tls {
            Some(live) => {
                let incoming = transport::tls::incoming(listener, live, true);
                router.serve_with_incoming(incoming).await
            }
            None => {
                let incoming = tonic::transport::server::TcpIncoming::from(listener);
                router.serve_with_incoming(incoming).await
            }
        };
        if let Err(e) = served {
            tracing::error!(error = %e, "locator stopped");
        }
    });
    Ok(())
}

/// `--lease-duration`: whole seconds, at least 2 (a renewal must fit in it).
fn lease_seconds(s: &str) -> Result<u64, String> {
    let d = mover_engine::node::parse_duration(s)?;
    match d.as_secs() {
        n if n >= 2 => Ok(n),
        _ => Err(format!("{s:?} is shorter than 2 seconds")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pvcs_change_names_the_volume_replications_of_its_namespace_that_replicate_it() {
        let vr = crd::api_resource(crd::MOVER_GROUP, "VolumeReplication");
        let object = |ns: &str, name: &str, pvc: &str| {
            let mut o = DynamicObject::new(name, &vr).within(ns);
            o.data = serde_json::json!({"spec": {"dataSource": {"kind": "PersistentVolumeClaim", "name": pvc}}});
            Arc::new(o)
        };
        let vrs = [
            object("app", "data", "data"),
            object("app", "logs", "logs"),
            object("other", "data", "data"),
            object("app", "data-again", "data"),
        ];
        let pvc = ObjectRef::<PersistentVolumeClaim>::new("data").within("app");
        let mut named: Vec<String> = naming(&vrs, &pvc, &vr)
            .into_iter()
            .map(|r| format!("{}/{}", r.namespace.unwrap(), r.name))
            .collect();
        named.sort();
        assert_eq!(named, ["app/data", "app/data-again"]);
        let unnamed = ObjectRef::<PersistentVolumeClaim>::new("other-0").within("app");
        assert!(naming(&vrs, &unnamed, &vr).is_empty());
    }
}
