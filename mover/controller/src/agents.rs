//! The agents' relationship control API, as the reconciler sees it: a small trait, so
//! reconcile tests can record the calls, and its gRPC implementation.

use mover_engine::remote::{
    AgentUrl, ConnectOptions, ControlClient, HydrateClient, RemoteOptions, ScheduleClient,
};
use std::{collections::HashMap, sync::Arc};
use tokio::sync::Mutex;
use tonic::transport::Channel;
use transport::auth::AttachToken;
use transport::control::replication_client::ReplicationClient;
use transport::hydrate::hydration_client::HydrationClient;
use transport::schedule::schedules_client::SchedulesClient;
use transport::tls::TlsPem;
use transport::{control, hydrate, schedule};

/// A failed call to an agent.
#[derive(Clone, Debug, thiserror::Error)]
#[error("agent {agent}: {op} {name}: {message} ({code:?})")]
pub struct AgentError {
    /// HOST:PORT.
    pub agent: String,
    /// The call ("promote").
    pub op: &'static str,
    /// The relationship.
    pub name: String,
    /// The gRPC code: NotFound, FailedPrecondition (refused as things are), Unavailable…
    pub code: tonic::Code,
    /// The agent's explanation.
    pub message: String,
    /// The refusal's kind, when the agent named one: what the controller matches.
    pub refusal: Option<transport::refusal::Refusal>,
}

impl AgentError {
    /// The agent refused as things stand (csi-addons' "known error" for a promotion,
    /// which it retries with force).
    pub fn is_precondition(&self) -> bool {
        self.code == tonic::Code::FailedPrecondition
    }

    /// The agent did not answer (down, or not reachable from the controller).
    pub fn is_unreachable(&self) -> bool {
        matches!(
            self.code,
            tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
        )
    }

    /// The agent answered and said no (rather than not answering).
    pub fn is_refusal(&self) -> bool {
        use tonic::Code::*;
        matches!(
            self.code,
            PermissionDenied | InvalidArgument | FailedPrecondition | NotFound | AlreadyExists
        )
    }
}

/// The calls the controller makes on an agent (HOST:PORT) about a relationship.
#[tonic::async_trait]
pub trait Agents: Send + Sync {
    /// Creates a relationship with `spec.volume` (an export of `agent`) as primary.
    async fn create(&self, agent: &str, spec: control::Spec)
    -> Result<control::Status, AgentError>;
    /// The relationship's status; `None` if the agent has no such relationship.
    async fn get(&self, agent: &str, name: &str) -> Result<Option<control::Status>, AgentError>;
    /// Changes interval or bandwidth limit.
    async fn update(
        &self,
        agent: &str,
        req: control::UpdateRequest,
    ) -> Result<control::Status, AgentError>;
    /// Makes the secondary on `agent` the primary (epoch + 1).
    async fn promote(
        &self,
        agent: &str,
        name: &str,
        force: bool,
    ) -> Result<control::Status, AgentError>;
    /// Ships a final cycle and makes the primary on `agent` a secondary.
    async fn demote(&self, agent: &str, name: &str) -> Result<control::Status, AgentError>;
    /// Makes a fenced or split-brain side follow the current primary.
    async fn resync(
        &self,
        agent: &str,
        name: &str,
        discard_local: bool,
    ) -> Result<control::Status, AgentError>;
    /// Runs one cycle reading a clone of a CSI snapshot (a relationship created with
    /// `snapshots`), and answers when it has ended.
    async fn cycle_from(
        &self,
        agent: &str,
        req: control::CycleFromRequest,
    ) -> Result<control::Status, AgentError>;
    /// Freezes the file systems mounted from the relationship's volume on `agent`'s
    /// node for at most `max` (its watchdog thaws them then).
    async fn freeze(
        &self,
        agent: &str,
        name: &str,
        max: std::time::Duration,
    ) -> Result<control::FreezeResponse, AgentError>;
    /// Thaws what [`Agents::freeze`] froze; FailedPrecondition if the watchdog had
    /// thawed it first.
    async fn thaw(&self, agent: &str, name: &str) -> Result<control::FreezeResponse, AgentError>;
    /// Forgets the relationship on `agent` (the volume stays); absent is fine.
    async fn delete(&self, agent: &str, name: &str) -> Result<(), AgentError>;
    /// Makes `agent` serve `path` (on its node) as the export `volume`, to the
    /// relationship `relationship` only: idempotent.
    async fn export(
        &self,
        agent: &str,
        volume: &str,
        path: &str,
        block: bool,
        relationship: &str,
        peer_credential: Option<&str>,
    ) -> Result<(), AgentError>;
    /// Makes `agent` stop serving the export `volume` it was given by [`Agents::export`].
    async fn unexport(&self, agent: &str, volume: &str) -> Result<(), AgentError>;
    /// The schedule `name` on `agent` (its spec without access); `None` if there is none.
    async fn schedule(
        &self,
        agent: &str,
        name: &str,
    ) -> Result<Option<schedule::Status>, AgentError>;
    /// Creates or replaces a schedule of scheduled snapshots on `agent`.
    async fn apply_schedule(
        &self,
        agent: &str,
        spec: schedule::Spec,
    ) -> Result<schedule::Status, AgentError>;
    /// Forgets the schedule `name` on `agent` (its snapshots stay); absent is fine.
    async fn delete_schedule(&self, agent: &str, name: &str) -> Result<(), AgentError>;
    /// The hydration of `export` on `agent`; `None` if it has none (or forgot a
    /// finished one).
    async fn hydration(
        &self,
        agent: &str,
        export: &str,
    ) -> Result<Option<hydrate::Status>, AgentError> {
        Err(not_served(agent, "get hydration", export))
    }
    /// Starts (or resumes) a hydration on `agent`.
    async fn hydrate(
        &self,
        agent: &str,
        req: hydrate::StartRequest,
    ) -> Result<hydrate::Status, AgentError> {
        Err(not_served(agent, "start hydration", &req.export))
    }
    /// What on `agent`'s node still holds the export `volume` (empty: released).
    async fn holders(&self, agent: &str, volume: &str) -> Result<Vec<String>, AgentError> {
        Err(not_served(agent, "holders", volume))
    }
    /// Deletes on `agent` the volume a hydration's start made (a populated PV's image):
    /// its fill, image and export; false if it was gone already. FailedPrecondition while
    /// it is staged.
    async fn delete_volume(&self, agent: &str, export: &str) -> Result<bool, AgentError> {
        Err(not_served(agent, "delete volume", export))
    }
}

/// What an [`Agents`] that serves no hydrations or moves answers.
fn not_served(agent: &str, op: &'static str, name: &str) -> AgentError {
    AgentError {
        agent: agent.into(),
        op,
        name: name.into(),
        code: tonic::Code::Unimplemented,
        message: "this implementation serves no hydrations or moves".into(),
        refusal: None,
    }
}

/// `r`, with `Ok(None)` for an agent that answered one of `codes` (nothing of that name
/// there, or a call an older agent does not know).
fn unless<T>(r: Result<T, AgentError>, codes: &[tonic::Code]) -> Result<Option<T>, AgentError> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if codes.contains(&e.code) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A connection to an agent, for a client of any of its services.
type Connection = (Channel, AttachToken);
/// The client certificate a connection was made with (none without `LiveTls`).
type Identity = Option<Arc<TlsPem>>;

/// A client of one of the agent's gRPC APIs, made on a shared connection.
trait AgentApi {
    fn on(channel: Channel, auth: AttachToken) -> Self;
}

impl AgentApi for ControlClient {
    fn on(channel: Channel, auth: AttachToken) -> Self {
        ReplicationClient::with_interceptor(channel, auth)
    }
}

impl AgentApi for ScheduleClient {
    fn on(channel: Channel, auth: AttachToken) -> Self {
        SchedulesClient::with_interceptor(channel, auth)
    }
}

impl AgentApi for HydrateClient {
    fn on(channel: Channel, auth: AttachToken) -> Self {
        HydrationClient::with_interceptor(channel, auth)
    }
}

/// The name an agent's certificate must carry, from its host (its node's name).
pub type ServerNames = Box<dyn Fn(&str) -> Option<String> + Send + Sync>;

/// [`Agents`] over gRPC, one cached connection per agent.
pub struct GrpcAgents {
    remote: RemoteOptions,
    /// Each agent's connection, and the certificate it was made with: a channel
    /// reconnects with the identity it was made with, so one made before a renewal is
    /// made again.
    clients: Mutex<HashMap<String, (Connection, Identity)>>,
    server_names: Option<ServerNames>,
    /// Calls are made only while this leads (none: always).
    leadership: Option<Arc<crate::leader::Leadership>>,
}

impl GrpcAgents {
    /// Connects with `connect`'s token and TLS files.
    pub fn new(connect: ConnectOptions) -> Self {
        GrpcAgents {
            remote: RemoteOptions {
                connect,
                ..RemoteOptions::default()
            },
            clients: Mutex::new(HashMap::new()),
            server_names: None,
            leadership: None,
        }
    }

    /// Makes calls only while `leadership` leads: a replica past its lease's renew
    /// deadline calls no agent, as it writes nothing to the API server.
    pub fn with_leadership(mut self, leadership: Arc<crate::leader::Leadership>) -> Self {
        self.leadership = Some(leadership);
        self
    }

    /// Checks each agent's certificate against the name `names` gives for its host.
    pub fn with_server_names(mut self, names: ServerNames) -> Self {
        self.server_names = Some(names);
        self
    }

    async fn client(
        &self,
        agent: &str,
        op: &'static str,
        name: &str,
    ) -> Result<Connection, AgentError> {
        let identity = self.remote.connect.tls_pem.as_ref().map(|live| live.get());
        let same = |made: &Identity| match (made, &identity) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            (None, None) => true,
            _ => false,
        };
        if let Some((c, made)) = self.clients.lock().await.get(agent)
            && same(made)
        {
            return Ok(c.clone());
        }
        let fail = |message: String| AgentError {
            agent: agent.into(),
            op,
            name: name.into(),
            code: tonic::Code::Unavailable,
            message,
            refusal: None,
        };
        // The control API ignores the volume part of an agent URL.
        let mut url = AgentUrl::parse(&format!("agent://{agent}/-"))
            .ok_or_else(|| fail("not HOST:PORT".into()))?
            .map_err(|e| fail(e.to_string()))?;
        if let Some(names) = &self.server_names {
            url.tls_name = Some(names(&url.host).ok_or_else(|| {
                fail("no agent pod has this address: its certificate's name is unknown".into())
            })?);
        }
        // The connection's own message: this error names the agent already.
        let c = self.remote.channel(&url).await.map_err(|e| match e {
            mover_engine::error::CopyError::Remote { message, .. } => fail(message),
            e => fail(e.to_string()),
        })?;
        self.clients
            .lock()
            .await
            .insert(agent.into(), (c.clone(), identity));
        Ok(c)
    }

    /// Runs one call of one of the agent's APIs (the client type `C` says which) on
    /// the agent's connection; a transport failure drops the connection.
    async fn call<C: AgentApi, T, F, Fut>(
        &self,
        agent: &str,
        op: &'static str,
        name: &str,
        f: F,
    ) -> Result<T, AgentError>
    where
        F: FnOnce(C) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        if self.leadership.as_ref().is_some_and(|l| !l.leading()) {
            return Err(AgentError {
                agent: agent.into(),
                op,
                name: name.into(),
                code: tonic::Code::FailedPrecondition,
                message: "not made: this controller replica no longer holds the leader lease"
                    .into(),
                refusal: None,
            });
        }
        let (channel, auth) = self.client(agent, op, name).await?;
        f(C::on(channel, auth))
            .await
            .map(|r| r.into_inner())
            .map_err(|s| AgentError {
                agent: agent.into(),
                op,
                name: name.into(),
                code: s.code(),
                refusal: transport::refusal::Refusal::of(&s),
                message: match mover_engine::remote::tls_hint(&s) {
                    Some(hint) => format!("{hint} ({})", s.message()),
                    None => s.message().into(),
                },
            })
            .inspect_err(|e| {
                if e.code == tonic::Code::Unavailable {
                    // Reconnect next time (the pod may have moved).
                    if let Ok(mut m) = self.clients.try_lock() {
                        m.remove(agent);
                    }
                }
            })
    }
}

#[tonic::async_trait]
impl Agents for GrpcAgents {
    async fn create(
        &self,
        agent: &str,
        spec: control::Spec,
    ) -> Result<control::Status, AgentError> {
        let name = spec.name.clone();
        let req = control::CreateRequest {
            spec: Some(spec),
            self_address: agent.into(),
        };
        self.call(agent, "create", &name, |mut c: ControlClient| async move {
            c.create(req).await
        })
        .await
    }

    async fn get(&self, agent: &str, name: &str) -> Result<Option<control::Status>, AgentError> {
        let req = control::NameRequest { name: name.into() };
        let got = self
            .call(agent, "get", name, |mut c: ControlClient| async move {
                c.get(req).await
            })
            .await;
        unless(got, &[tonic::Code::NotFound])
    }

    async fn update(
        &self,
        agent: &str,
        req: control::UpdateRequest,
    ) -> Result<control::Status, AgentError> {
        let name = req.name.clone();
        self.call(agent, "update", &name, |mut c: ControlClient| async move {
            c.update(req).await
        })
        .await
    }

    async fn promote(
        &self,
        agent: &str,
        name: &str,
        force: bool,
    ) -> Result<control::Status, AgentError> {
        let req = control::PromoteRequest {
            name: name.into(),
            force,
        };
        self.call(agent, "promote", name, |mut c: ControlClient| async move {
            c.promote(req).await
        })
        .await
    }

    async fn demote(&self, agent: &str, name: &str) -> Result<control::Status, AgentError> {
        let req = control::NameRequest { name: name.into() };
        self.call(agent, "demote", name, |mut c: ControlClient| async move {
            c.demote(req).await
        })
        .await
    }

    async fn resync(
        &self,
        agent: &str,
        name: &str,
        discard_local: bool,
    ) -> Result<control::Status, AgentError> {
        let req = control::ResyncRequest {
            name: name.into(),
            discard_local,
        };
        self.call(agent, "resync", name, |mut c: ControlClient| async move {
            c.resync(req).await
        })
        .await
    }

    async fn cycle_from(
        &self,
        agent: &str,
        req: control::CycleFromRequest,
    ) -> Result<control::Status, AgentError> {
        let name = req.name.clone();
        self.call(agent, "cycle", &name, |mut c: ControlClient| async move {
            c.cycle_from(req).await
        })
        .await
    }

    async fn freeze(
        &self,
        agent: &str,
        name: &str,
        max: std::time::Duration,
    ) -> Result<control::FreezeResponse, AgentError> {
        let req = control::FreezeRequest {
            name: name.into(),
            max_ms: max.as_millis() as u64,
        };
        self.call(agent, "freeze", name, |mut c: ControlClient| async move {
            c.freeze(req).await
        })
        .await
    }

    async fn thaw(&self, agent: &str, name: &str) -> Result<control::FreezeResponse, AgentError> {
        let req = control::NameRequest { name: name.into() };
        self.call(agent, "thaw", name, |mut c: ControlClient| async move {
            c.thaw(req).await
        })
        .await
    }

    async fn delete(&self, agent: &str, name: &str) -> Result<(), AgentError> {
        let req = control::NameRequest { name: name.into() };
        let deleted = self
            .call(agent, "delete", name, |mut c: ControlClient| async move {
                c.delete(req).await
            })
            .await;
        unless(deleted, &[tonic::Code::NotFound]).map(drop)
    }

    async fn export(
        &self,
        agent: &str,
        volume: &str,
        path: &str,
        block: bool,
        relationship: &str,
        peer_credential: Option<&str>,
    ) -> Result<(), AgentError> {
        let req = control::ExportRequest {
            name: volume.into(),
            path: path.into(),
            block,
            relationship: relationship.into(),
            peer_credential: peer_credential.unwrap_or_default().into(),
        };
        let exported = self
            .call(agent, "export", volume, |mut c: ControlClient| async move {
                c.export(req).await
            })
            .await;
        // An agent older than registered exports serves what its agent.toml lists: the
        // relationship calls that follow say whether the volume is among them.
        unless(exported, &[tonic::Code::Unimplemented]).map(drop)
    }

    async fn schedule(
        &self,
        agent: &str,
        name: &str,
    ) -> Result<Option<schedule::Status>, AgentError> {
        let req = schedule::NameRequest { name: name.into() };
        let got = self
            .call(
                agent,
                "get schedule",
                name,
                |mut c: ScheduleClient| async move { c.get(req).await },
            )
            .await;
        unless(got, &[tonic::Code::NotFound])
    }

    async fn hydration(
        &self,
        agent: &str,
        export: &str,
    ) -> Result<Option<hydrate::Status>, AgentError> {
        let req = hydrate::NameRequest {
            export: export.into(),
        };
        let got = self
            .call(
                agent,
                "get hydration",
                export,
                |mut c: HydrateClient| async move { c.get(req).await },
            )
            .await;
        unless(got, &[tonic::Code::NotFound])
    }

    async fn holders(&self, agent: &str, volume: &str) -> Result<Vec<String>, AgentError> {
        let req = control::NameRequest {
            name: volume.into(),
        };
        self.call(
            agent,
            "holders",
            volume,
            |mut c: ControlClient| async move { c.holders(req).await },
        )
        .await
        .map(|r| r.holders)
    }

    async fn delete_volume(&self, agent: &str, export: &str) -> Result<bool, AgentError> {
        let req = hydrate::NameRequest {
            export: export.into(),
        };
        self.call(
            agent,
            "delete volume",
            export,
            |mut c: HydrateClient| async move { c.delete(req).await },
        )
        .await
        .map(|r| r.deleted)
    }

    async fn hydrate(
        &self,
        agent: &str,
        req: hydrate::StartRequest,
    ) -> Result<hydrate::Status, AgentError> {
        let export = req.export.clone();
        self.call(
            agent,
            "start hydration",
            &export,
            |mut c: HydrateClient| async move { c.start(req).await },
        )
        .await
    }

    async fn apply_schedule(
        &self,
        agent: &str,
        spec: schedule::Spec,
    ) -> Result<schedule::Status, AgentError> {
        let name = spec.name.clone();
        self.call(
            agent,
            "apply schedule",
            &name,
            |mut c: ScheduleClient| async move { c.apply(spec).await },
        )
        .await
    }

    async fn delete_schedule(&self, agent: &str, name: &str) -> Result<(), AgentError> {
        let req = schedule::NameRequest { name: name.into() };
        let deleted = self
            .call(
                agent,
                "delete schedule",
                name,
                |mut c: ScheduleClient| async move { c.delete(req).await },
            )
            .await;
        // No such schedule, or an agent older than schedules: nothing to forget.
        let nothing = [tonic::Code::NotFound, tonic::Code::Unimplemented];
        unless(deleted, &nothing).map(drop)
    }

    async fn unexport(&self, agent: &str, volume: &str) -> Result<(), AgentError> {
        let req = control::NameRequest {
            name: volume.into(),
        };
        self.call(
            agent,
            "unexport",
            volume,
            |mut c: ControlClient| async move { c.unexport(req).await },
        )
        .await
        .map(|_| ())
    }
}
