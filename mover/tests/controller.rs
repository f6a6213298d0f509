//! Reconcile scenarios against kube's tower-test mock API server (the controller-rs
//! pattern) and a recording double of the agents' control API: the requests the
//! controller sends, the status it applies, and the agent calls it makes.
#![cfg(feature = "controller")]

use http::{Request, Response};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::DynamicObject;
use kube::client::Body;
use kube::runtime::controller::Action;
use mover::controller::agents::{AgentError, Agents};
use mover::controller::crd::{
    CSI_ADDONS_GROUP, MOVER_GROUP, RelationshipRef, ReplicationState, VolumeReplication,
    VolumeReplicationClass, VolumeReplicationClassSpec, VolumeReplicationSpec,
    VolumeReplicationStatus,
};
use mover::controller::reconcile::{Caches, Context, FINALIZER, reconcile};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use transport::control;

/// One request the controller sent.
#[derive(Debug)]
struct Sent {
    method: http::Method,
    uri: String,
    body: Value,
}

/// Answers the next `n` requests with `reply` (as the API server would: the object),
/// and returns what was sent. More requests than `n` fail the reconcile.
fn api_server(
    mut handle: tower_test::mock::Handle<Request<Body>, Response<Body>>,
    n: usize,
    reply: Value,
) -> tokio::task::JoinHandle<Vec<Sent>> {
    tokio::spawn(async move {
        let mut sent = Vec::new();
        for _ in 0..n {
            let request = handle.next_request().await.expect("a request");
            answer(request, &reply, |s| sent.push(s)).await;
        }
        sent
    })
}

/// Answers one request with `reply`, handing what was sent to `record` first (the
/// caller may read the record as soon as its request returns).
async fn answer(
    (req, respond): (
        Request<Body>,
        tower_test::mock::SendResponse<Response<Body>>,
    ),
    reply: &Value,
    record: impl FnOnce(Sent),
) {
    let method = req.method().clone();
    let uri = req.uri().to_string();
    let bytes = req.into_body().collect_bytes().await.unwrap();
    let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
    record(Sent { method, uri, body });
    respond.send_response(
        Response::builder()
            .body(Body::from(serde_json::to_vec(reply).unwrap()))
            .unwrap(),
    );
}

/// The agents as a map of relationships, recording every call.
#[derive(Default)]
struct FakeAgents {
    calls: Mutex<Vec<String>>,
    relationships: Mutex<HashMap<(String, String), control::Status>>,
    /// Refuse a non-forced promote (the peer did not hand over).
    refuse_promote: bool,
    /// (agent, export) -> (path, block), as registered by `export`.
    exports: Mutex<HashMap<(String, String), (String, bool)>>,
    /// Refuse `export` with this message (the agent's volume_roots do not allow it).
    refuse_export: Option<String>,
    /// (agent, name) -> the schedule applied.
    schedules: Mutex<HashMap<(String, String), transport::schedule::Spec>>,
    /// The agents do not answer (the controller's connection is refused).
    down: std::sync::atomic::AtomicBool,
}

/// What the controller's connection to an agent that is down says (its error chain
/// names the TCP error twice, as tonic's and hyper's errors both do).
const REFUSED: &str = "cannot connect: transport error: tcp connect error: tcp connect error: \
                       Connection refused (os error 111)";

fn now_ms() -> i64 {
    k8s_openapi::jiff::Timestamp::now().as_millisecond()
}

fn status(name: &str, role: &str, state: &str, epoch: u64) -> control::Status {
    control::Status {
        spec: Some(control::Spec {
            name: name.into(),
            volume: "pv-1".into(),
            peer: "agent://dr.example:7070/pv-1".into(),
            interval_ms: 60_000,
            ..Default::default()
        }),
        role: role.into(),
        state: state.into(),
        epoch,
        rpo_seconds: 4.0,
        last_cycle: Some(control::CycleReport {
            id: 9,
            // Recent: older than 3 intervals would be late.
            point_in_time_ms: now_ms() - 4_000,
            duration_ms: 1_500,
            bytes_shipped: 8192,
            ..Default::default()
        }),
        ..Default::default()
    }
}

impl FakeAgents {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
    fn record(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }
    fn set(&self, agent: &str, s: control::Status) {
        let name = s.spec.as_ref().unwrap().name.clone();
        self.relationships
            .lock()
            .unwrap()
            .insert((agent.into(), name), s);
    }
    fn change(
        &self,
        op: &'static str,
        agent: &str,
        name: &str,
        f: impl FnOnce(&mut control::Status),
    ) -> Result<control::Status, AgentError> {
        let mut map = self.relationships.lock().unwrap();
        let s = map
            .get_mut(&(agent.to_string(), name.to_string()))
            .ok_or_else(|| AgentError {
                agent: agent.into(),
                op,
                name: name.into(),
                code: tonic::Code::NotFound,
                message: "no such relationship".into(),
                refusal: None,
            })?;
        f(s);
        Ok(s.clone())
    }
}

#[tonic::async_trait]
impl Agents for FakeAgents {
    async fn create(
        &self,
        agent: &str,
        spec: control::Spec,
    ) -> Result<control::Status, AgentError> {
        self.record(format!(
            "create {agent} {} {} -> {} every {}ms",
            spec.name, spec.volume, spec.peer, spec.interval_ms
        ));
        let mut s = status(&spec.name, "primary", "Replicating", 1);
        s.spec = Some(spec);
        self.set(agent, s.clone());
        Ok(s)
    }
    async fn get(&self, agent: &str, name: &str) -> Result<Option<control::Status>, AgentError> {
        self.record(format!("get {agent} {name}"));
        if self.down.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(AgentError {
                agent: agent.into(),
                op: "get",
                name: name.into(),
                code: tonic::Code::Unavailable,
                message: REFUSED.into(),
                refusal: None,
            });
        }
        let map = self.relationships.lock().unwrap();
        Ok(map.get(&(agent.to_string(), name.to_string())).cloned())
    }
    async fn update(
        &self,
        agent: &str,
        req: control::UpdateRequest,
    ) -> Result<control::Status, AgentError> {
        self.record(format!("update {agent} {} {:?}", req.name, req.interval_ms));
        self.change("update", agent, &req.name.clone(), |s| {
            s.spec.as_mut().unwrap().interval_ms = req.interval_ms.unwrap_or(0);
        })
    }
    async fn promote(
        &self,
        agent: &str,
        name: &str,
        force: bool,
    ) -> Result<control::Status, AgentError> {
        self.record(format!("promote {agent} {name} force={force}"));
        if self.refuse_promote && !force {
            return Err(AgentError {
                agent: agent.into(),
                op: "promote",
                name: name.into(),
                code: tonic::Code::FailedPrecondition,
                message: "the last cycle is not a demote's final cycle".into(),
                refusal: None,
            });
        }
        self.change("promote", agent, name, |s| {
            s.role = "primary".into();
            s.state = "Replicating".into();
            s.epoch += 1;
        })
    }
    async fn demote(&self, agent: &str, name: &str) -> Result<control::Status, AgentError> {
        self.record(format!("demote {agent} {name}"));
        self.change("demote", agent, name, |s| {
            s.role = "secondary".into();
            s.state = "Secondary".into();
        })
    }
    async fn resync(
        &self,
        agent: &str,
        name: &str,
        discard_local: bool,
    ) -> Result<control::Status, AgentError> {
        self.record(format!(
            "resync {agent} {name} discard_local={discard_local}"
        ));
        self.change("resync", agent, name, |s| {
            s.role = "secondary".into();
            s.state = "Secondary".into();
        })
    }
    async fn cycle_from(
        &self,
        agent: &str,
        req: control::CycleFromRequest,
    ) -> Result<control::Status, AgentError> {
        self.record(format!("cycle_from {agent} {} {}", req.name, req.export));
        self.change("cycle", agent, &req.name.clone(), |s| {
            s.last_snapshot = req.snapshot.clone();
        })
    }
    async fn freeze(
        &self,
        agent: &str,
        name: &str,
        max: std::time::Duration,
    ) -> Result<control::FreezeResponse, AgentError> {
        self.record(format!("freeze {agent} {name} {}ms", max.as_millis()));
        Ok(control::FreezeResponse::default())
    }
    async fn thaw(&self, agent: &str, name: &str) -> Result<control::FreezeResponse, AgentError> {
        self.record(format!("thaw {agent} {name}"));
        Ok(control::FreezeResponse::default())
    }
    async fn delete(&self, agent: &str, name: &str) -> Result<(), AgentError> {
        self.record(format!("delete {agent} {name}"));
        self.relationships
            .lock()
            .unwrap()
            .remove(&(agent.to_string(), name.to_string()));
        Ok(())
    }
    async fn export(
        &self,
        agent: &str,
        volume: &str,
        path: &str,
        block: bool,
        _relationship: &str,
        _peer_credential: Option<&str>,
    ) -> Result<(), AgentError> {
        if let Some(message) = &self.refuse_export {
            return Err(AgentError {
                agent: agent.into(),
                op: "export",
                name: volume.into(),
                code: tonic::Code::PermissionDenied,
                message: message.clone(),
                refusal: None,
            });
        }
        let key = (agent.to_string(), volume.to_string());
        self.exports
            .lock()
            .unwrap()
            .insert(key, (path.into(), block));
        Ok(())
    }
    async fn unexport(&self, agent: &str, volume: &str) -> Result<(), AgentError> {
        let key = (agent.to_string(), volume.to_string());
        self.exports.lock().unwrap().remove(&key);
        Ok(())
    }
    async fn schedule(
        &self,
        agent: &str,
        name: &str,
    ) -> Result<Option<transport::schedule::Status>, AgentError> {
        let key = (agent.to_string(), name.to_string());
        Ok(self
            .schedules
            .lock()
            .unwrap()
            .get(&key)
            .map(|spec| transport::schedule::Status {
                spec: Some(transport::schedule::Spec {
                    access: None,
                    ..spec.clone()
                }),
                state: "Idle".into(),
                ..Default::default()
            }))
    }
    async fn apply_schedule(
        &self,
        agent: &str,
        spec: transport::schedule::Spec,
    ) -> Result<transport::schedule::Status, AgentError> {
        let key = (agent.to_string(), spec.name.clone());
        self.schedules.lock().unwrap().insert(key, spec.clone());
        Ok(transport::schedule::Status {
            spec: Some(spec),
            state: "Idle".into(),
            ..Default::default()
        })
    }
    async fn delete_schedule(&self, agent: &str, name: &str) -> Result<(), AgentError> {
        let key = (agent.to_string(), name.to_string());
        self.schedules.lock().unwrap().remove(&key);
        Ok(())
    }
}

/// A class with `params`; `consistency: crash-inconsistent` unless they set it: the
/// images here are files on ext4, with no point in time to take (kube_e2e checks the
/// default, point-in-time, refuses them).
fn class(params: &[(&str, &str)]) -> VolumeReplicationClass {
    let mut parameters: std::collections::BTreeMap<String, String> = params
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    parameters
        .entry("consistency".into())
        .or_insert_with(|| "crash-inconsistent".into());
    VolumeReplicationClass::new(
        "mover",
        VolumeReplicationClassSpec {
            provisioner: "topolvm.io".into(),
            parameters,
        },
    )
}

fn good_class() -> VolumeReplicationClass {
    class(&[
        ("target", "agent://dr.example:7070"),
        ("schedulingInterval", "1m"),
    ])
}

fn pvc(bound: bool) -> PersistentVolumeClaim {
    serde_json::from_value(json!({
        "metadata": {"name": "data", "namespace": "app"},
        "spec": {"volumeName": if bound { "pv-1" } else { "" }, "volumeMode": "Block"},
        "status": {"phase": if bound { "Bound" } else { "Pending" }}
    }))
    .unwrap()
}

fn pv() -> PersistentVolume {
    serde_json::from_value(json!({
        "metadata": {"name": "pv-1"},
        "spec": {
            "local": {"path": "/dev/vg0/pv-1"},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["node-a"]}
            ]}]}}
        }
    }))
    .unwrap()
}

fn agent_pod(node: &str) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": format!("mover-agent-{node}"), "namespace": "mover-system"},
        "spec": {"nodeName": node, "containers": []},
        "status": {"phase": "Running", "podIP": "10.0.0.1"}
    }))
    .unwrap()
}

const AGENT: &str = "10.0.0.1:7070";

fn vr(state: ReplicationState, generation: i64, finalized: bool) -> VolumeReplication {
    let mut vr = VolumeReplication::new(
        "pg",
        VolumeReplicationSpec {
            volume_replication_class: "mover".into(),
            replication_state: state,
            data_source: k8s_openapi::api::core::v1::TypedLocalObjectReference {
                api_group: None,
                kind: "PersistentVolumeClaim".into(),
                name: "data".into(),
            },
            auto_resync: false,
            replication_handle: String::new(),
        },
    );
    vr.metadata.namespace = Some("app".into());
    vr.metadata.generation = Some(generation);
    if finalized {
        vr.metadata.finalizers = Some(vec![FINALIZER.into()]);
    }
    vr
}

fn dynamic(vr: &VolumeReplication, group: &str) -> DynamicObject {
    let mut v = serde_json::to_value(vr).unwrap();
    v["apiVersion"] = format!("{group}/v1alpha1").into();
    serde_json::from_value(v).unwrap()
}

struct World {
    classes: Vec<VolumeReplicationClass>,
    pvcs: Vec<PersistentVolumeClaim>,
    agents: Vec<Pod>,
}

impl Default for World {
    fn default() -> Self {
        World {
            classes: vec![good_class()],
            pvcs: vec![pvc(true)],
            agents: vec![agent_pod("node-a")],
        }
    }
}

/// Reconciles `vr` once; the API server answers `n` requests. Returns what was sent.
async fn run_once(
    group: &str,
    world: World,
    agents: Arc<FakeAgents>,
    vr: &VolumeReplication,
    n: usize,
) -> Vec<Sent> {
    run_once_for(group, world, agents, vr, n).await.0
}

/// [`run_once`], and when the controller looks again.
async fn run_once_for(
    group: &str,
    world: World,
    agents: Arc<FakeAgents>,
    vr: &VolumeReplication,
    n: usize,
) -> (Vec<Sent>, Action) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let ctx = Arc::new(Context {
        client,
        group: group.into(),
        agents,
        caches: Caches::fixed(
            group,
            world.classes,
            world.pvcs,
            vec![pv()],
            vec![],
            world.agents,
        ),
        agent_port: 7070,
        csi: Default::default(),
        job_image: "mover".into(),
        metrics: Default::default(),
        recorder: None,
        leftovers: None,
        secrets: None,
    });
    let obj = dynamic(vr, group);
    let server = api_server(handle, n, serde_json::to_value(&obj).unwrap());
    let action = reconcile(Arc::new(obj), ctx).await.expect("reconcile");
    let sent = tokio::time::timeout(std::time::Duration::from_secs(5), server)
        .await
        .expect("the controller sent fewer requests than expected")
        .unwrap();
    (sent, action)
}

/// The status in a server-side apply to the status subresource.
fn applied_status(sent: &Sent, group: &str) -> VolumeReplicationStatus {
    assert_eq!(sent.method, http::Method::PATCH);
    assert_eq!(
        sent.uri,
        format!(
            "/apis/{group}/v1alpha1/namespaces/app/volumereplications/pg/status?&force=true&fieldManager=mover"
        )
    );
    assert_eq!(sent.body["apiVersion"], format!("{group}/v1alpha1"));
    assert_eq!(sent.body["kind"], "VolumeReplication");
    serde_json::from_value(sent.body["status"].clone()).unwrap()
}

fn condition<'a>(st: &'a VolumeReplicationStatus, ty: &str) -> (&'a str, &'a str, &'a str) {
    let c = st
        .conditions
        .iter()
        .find(|c| c.type_ == ty)
        .unwrap_or_else(|| panic!("no {ty} condition in {:#?}", st.conditions));
    (c.status.as_str(), c.reason.as_str(), c.message.as_str())
}

/// rpoSeconds is now minus lastSyncTime (as the status was written: the test reads it
/// within a second).
fn assert_rpo_is_since_last_sync(st: &VolumeReplicationStatus) {
    let since = st.last_sync_time.as_ref().expect("a last sync").0;
    let age = k8s_openapi::jiff::Timestamp::now()
        .duration_since(since)
        .as_secs_f64();
    let rpo = st.rpo_seconds.expect("an RPO");
    assert!(
        rpo <= age + 0.1 && rpo > age - 1.0,
        "rpo {rpo}, since {age}"
    );
}

/// RamenDR's gate: the status and every condition carry the current generation.
fn assert_generation(st: &VolumeReplicationStatus, generation: i64) {
    assert_eq!(st.observed_generation, Some(generation));
    for c in &st.conditions {
        assert_eq!(c.observed_generation, Some(generation), "{c:?}");
    }
}

#[tokio::test]
async fn create_adds_the_finalizer_then_creates_the_relationship_and_applies_status() {
    let agents = Arc::new(FakeAgents::default());
    // A new resource: only the finalizer is added, nothing else happens yet.
    let sent = run_once(
        MOVER_GROUP,
        World::default(),
        agents.clone(),
        &vr(ReplicationState::Primary, 1, false),
        1,
    )
    .await;
    assert_eq!(sent[0].method, http::Method::PATCH);
    assert_eq!(
        sent[0].uri,
        "/apis/replication.mover/v1alpha1/namespaces/app/volumereplications/pg?"
    );
    assert_eq!(
        sent[0].body,
        json!([
            {"op": "test", "path": "/metadata/finalizers", "value": null},
            {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]}
        ])
    );
    assert!(agents.calls().is_empty());

    // With the finalizer: the relationship is created and the status applied.
    let sent = run_once(
        MOVER_GROUP,
        World::default(),
        agents.clone(),
        &vr(ReplicationState::Primary, 1, true),
        1,
    )
    .await;
    assert_eq!(
        agents.calls(),
        [
            format!("get {AGENT} app/pg"),
            format!("create {AGENT} app/pg pv-1 -> agent://dr.example:7070/pv-1 every 60000ms"),
        ]
    );
    // The agent was told where the PV is before the relationship was created on it.
    assert_eq!(
        agents.exports.lock().unwrap()[&(AGENT.to_string(), "pv-1".to_string())],
        ("/dev/vg0/pv-1".to_string(), true)
    );
    let st = applied_status(&sent[0], MOVER_GROUP);
    assert_eq!(st.state, Some(mover::controller::crd::State::Primary));
    assert_eq!(st.message.as_deref(), Some("volume is marked primary"));
    assert_eq!(
        condition(&st, "Completed"),
        (
            "True",
            "Promoted",
            "volume is promoted to primary and replicating to secondary"
        )
    );
    assert_eq!(
        condition(&st, "Degraded"),
        ("False", "Healthy", "volume is healthy")
    );
    assert_eq!(condition(&st, "Resyncing").0, "False");
    assert_eq!(
        condition(&st, "Validated"),
        (
            "True",
            "PrerequisiteMet",
            "volume is validated and met all prerequisites"
        )
    );
    assert_eq!(condition(&st, "Replicating").0, "True");
    assert_generation(&st, 1);
    assert_eq!(st.epoch, Some(1));
    assert_eq!(st.last_sync_duration.as_deref(), Some("1.5s"));
    assert_eq!(st.last_sync_bytes, Some(8192));
    assert_rpo_is_since_last_sync(&st);
    assert!(st.last_sync_time.is_some() && st.last_completion_time.is_some());
    assert_eq!(
        st.relationship,
        Some(RelationshipRef {
            name: "app/pg".into(),
            agent: AGENT.into(),
            volume: "pv-1".into(),
            volume_replication_class: "mover".into(),
            data_source_name: "data".into(),
        })
    );
}

#[tokio::test]
async fn a_second_look_with_nothing_changed_sends_no_request() {
    let agents = Arc::new(FakeAgents::default());
    let v = vr(ReplicationState::Primary, 1, true);
    let sent = run_once(MOVER_GROUP, World::default(), agents.clone(), &v, 1).await;
    let mut v2 = v.clone();
    v2.status = Some(applied_status(&sent[0], MOVER_GROUP));
    // The agent is asked, the status would be the same: no write (no request at all).
    let sent = run_once(MOVER_GROUP, World::default(), agents.clone(), &v2, 0).await;
    assert!(sent.is_empty());
    assert_eq!(
        agents.calls().last().unwrap(),
        &format!("get {AGENT} app/pg")
    );
    // A new cycle on the agent is written.
    let cycle = now_ms();
    agents
        .change("test", AGENT, "app/pg", |s| {
            s.last_cycle.as_mut().unwrap().point_in_time_ms = cycle
        })
        .unwrap();
    let sent = run_once(MOVER_GROUP, World::default(), agents.clone(), &v2, 1).await;
    let st = applied_status(&sent[0], MOVER_GROUP);
    // Written to the second.
    assert_eq!(
        st.last_sync_time.map(|t| t.0.as_second()),
        Some(cycle / 1000)
    );
}

#[tokio::test]
async fn bad_input_sets_validated_false_with_what_to_fix_and_calls_no_agent() {
    let moved_class = {
        let mut v = vr(ReplicationState::Primary, 2, true);
        v.spec.volume_replication_class = "other".into();
        v.status = Some(VolumeReplicationStatus {
            relationship: Some(RelationshipRef {
                name: "app/pg".into(),
                agent: AGENT.into(),
                volume: "pv-1".into(),
                volume_replication_class: "mover".into(),
                data_source_name: "data".into(),
            }),
            ..Default::default()
        });
        v
    };
    let cases: Vec<(&str, World, VolumeReplication, &str)> = vec![
        (
            "class missing",
            World {
                classes: vec![],
                ..World::default()
            },
            vr(ReplicationState::Primary, 1, true),
            "VolumeReplicationClass \"mover\" not found: create it",
        ),
        (
            "PVC unbound",
            World {
                pvcs: vec![pvc(false)],
                ..World::default()
            },
            vr(ReplicationState::Primary, 1, true),
            "PersistentVolumeClaim app/data is not bound to a volume yet (phase Pending)",
        ),
        (
            "no agent on the PV's node",
            World {
                agents: vec![agent_pod("node-z")],
                ..World::default()
            },
            vr(ReplicationState::Secondary, 1, true),
            "no running mover agent on node node-a",
        ),
        (
            "unknown target",
            World {
                classes: vec![class(&[("target", "nfs://somewhere")])],
                ..World::default()
            },
            vr(ReplicationState::Primary, 1, true),
            "unknown target \"nfs://somewhere\"",
        ),
        (
            "immutable field changed",
            World::default(),
            moved_class,
            "spec.volumeReplicationClass changed from \"mover\" to \"other\"",
        ),
    ];
    for (case, world, v, fix) in cases {
        let agents = Arc::new(FakeAgents::default());
        let sent = run_once(MOVER_GROUP, world, agents.clone(), &v, 1).await;
        let st = applied_status(&sent[0], MOVER_GROUP);
        let (status, reason, message) = condition(&st, "Validated");
        assert_eq!((status, reason), ("False", "PrerequisiteNotMet"), "{case}");
        assert!(
            message.starts_with("failed to meet prerequisite: "),
            "{case}: {message}"
        );
        assert!(message.contains(fix), "{case}: {message}");
        assert_eq!(condition(&st, "Degraded").0, "True", "{case}");
        assert_eq!(condition(&st, "Completed").0, "False", "{case}");
        assert!(st.message.as_deref().unwrap().contains(fix), "{case}");
        assert_eq!(
            st.state,
            Some(mover::controller::crd::State::Unknown),
            "{case}"
        );
        assert_generation(&st, v.metadata.generation.unwrap());
        assert!(agents.calls().is_empty(), "{case}: {:?}", agents.calls());
    }
}

#[tokio::test]
async fn delete_deletes_the_relationship_then_removes_the_finalizer() {
    let agents = Arc::new(FakeAgents::default());
    agents.set(AGENT, status("app/pg", "primary", "Replicating", 1));
    agents.exports.lock().unwrap().insert(
        (AGENT.to_string(), "pv-1".to_string()),
        ("/dev/vg0/pv-1".into(), true),
    );
    let mut v = vr(ReplicationState::Primary, 1, true);
    v.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2026-01-01T00:00:00Z".parse().unwrap(),
    ));
    let sent = run_once(MOVER_GROUP, World::default(), agents.clone(), &v, 1).await;
    assert_eq!(agents.calls(), [format!("delete {AGENT} app/pg")]);
    assert!(agents.relationships.lock().unwrap().is_empty());
    assert!(
        agents.exports.lock().unwrap().is_empty(),
        "the export is removed"
    );
    assert_eq!(sent[0].method, http::Method::PATCH);
    assert_eq!(
        sent[0].body,
        json!([
            {"op": "test", "path": "/metadata/finalizers/0", "value": FINALIZER},
            {"op": "remove", "path": "/metadata/finalizers/0"}
        ])
    );
}

#[tokio::test]
async fn primary_secondary_primary_demotes_then_promotes_with_a_new_epoch() {
    let agents = Arc::new(FakeAgents::default());
    agents.set(AGENT, status("app/pg", "primary", "Replicating", 1));

    let sent = run_once(
        MOVER_GROUP,
        World::default(),
        agents.clone(),
        &vr(ReplicationState::Secondary, 2, true),
        1,
    )
    .await;
    assert_eq!(
        agents.calls(),
        [
            format!("get {AGENT} app/pg"),
            format!("demote {AGENT} app/pg")
        ]
    );
    let st = applied_status(&sent[0], MOVER_GROUP);
    assert_eq!(st.state, Some(mover::controller::crd::State::Secondary));
    assert_eq!(
        condition(&st, "Completed"),
        ("True", "Demoted", "volume is demoted to secondary")
    );
    assert!(
        st.conditions.iter().all(|c| c.type_ != "Replicating"),
        "a secondary has no Replicating"
    );
    assert_generation(&st, 2);

    // Next look at the secondary: it holds a cycle and follows the primary.
    agents.calls.lock().unwrap().clear();
    let mut v = vr(ReplicationState::Secondary, 2, true);
    v.status = Some(st);
    let sent = run_once(MOVER_GROUP, World::default(), agents.clone(), &v, 1).await;
    assert_eq!(agents.calls(), [format!("get {AGENT} app/pg")]);
    let st = applied_status(&sent[0], MOVER_GROUP);
    assert_eq!(
        condition(&st, "Degraded"),
        ("False", "Healthy", "volume is demoted to secondary")
    );
    assert_eq!(st.message.as_deref(), Some("volume is marked secondary"));

    // Back to primary: promote, under epoch 2.
    agents.calls.lock().unwrap().clear();
    let mut v = vr(ReplicationState::Primary, 3, true);
    v.status = Some(st);
    let sent = run_once(MOVER_GROUP, World::default(), agents.clone(), &v, 1).await;
    assert_eq!(
        agents.calls(),
        [
            format!("get {AGENT} app/pg"),
            format!("promote {AGENT} app/pg force=false")
        ]
    );
    let st = applied_status(&sent[0], MOVER_GROUP);
    assert_eq!(st.state, Some(mover::controller::crd::State::Primary));
    assert_eq!(st.epoch, Some(2));
    assert_eq!(condition(&st, "Completed").1, "Promoted");
    assert_generation(&st, 3);
}

#[tokio::test]
async fn resync_on_an_active_primary_is_refused_and_a_fenced_side_is_discarded() {
    // An active primary: its data is the volume of record, so nothing is thrown away.
    let agents = Arc::new(FakeAgents::default());
    agents.set(AGENT, status("app/pg", "primary", "Replicating", 3));
    let sent = run_once(
        MOVER_GROUP,
        World::default(),
        agents.clone(),
        &vr(ReplicationState::Resync, 2, true),
        1,
    )
    .await;
    assert_eq!(agents.calls(), [format!("get {AGENT} app/pg")]);
    let st = applied_status(&sent[0], MOVER_GROUP);
    let (completed, reason, _) = condition(&st, "Completed");
    assert_eq!((completed, reason), ("False", "FailedToResync"));
    let message = st.message.as_deref().unwrap_or_default();
    assert!(
        message.contains("active primary") && message.contains("replicationState: secondary"),
        "{message}"
    );
    assert!(condition(&st, "Degraded").2.contains("active primary"));

    // The same side once fenced by the peer's promotion: resync discards its writes.
    let agents = Arc::new(FakeAgents::default());
    agents.set(AGENT, status("app/pg", "primary", "Fenced", 3));
    run_once(
        MOVER_GROUP,
        World::default(),
        agents.clone(),
        &vr(ReplicationState::Resync, 2, true),
        1,
    )
    .await;
    assert_eq!(
        agents.calls(),
        [
            format!("get {AGENT} app/pg"),
            format!("resync {AGENT} app/pg discard_local=true")
        ]
    );
}

#[tokio::test]
async fn a_refused_promotion_is_forced_as_csi_addons_does_in_the_csi_addons_group() {
    let agents = Arc::new(FakeAgents {
        refuse_promote: true,
        ..Default::default()
    });
    agents.set(AGENT, status("app/pg", "secondary", "Secondary", 4));
    let sent = run_once(
        CSI_ADDONS_GROUP,
        World::default(),
        agents.clone(),
        &vr(ReplicationState::Primary, 5, true),
        1,
    )
    .await;
    assert_eq!(
        agents.calls(),
        [
            format!("get {AGENT} app/pg"),
            format!("promote {AGENT} app/pg force=false"),
            format!("promote {AGENT} app/pg force=true"),
        ]
    );
    let st = applied_status(&sent[0], CSI_ADDONS_GROUP);
    assert_eq!(st.epoch, Some(5));
    assert_generation(&st, 5);
}

/// A primary VolumeReplication (generation 1) as the controller last wrote it, with the
/// relationship the agents hold for it in `state`, its last error `error` and its last
/// cycle `age_ms` old.
async fn primary_with(
    agents: &Arc<FakeAgents>,
    state: &str,
    error: &str,
    age_ms: i64,
) -> VolumeReplicationStatus {
    let mut s = status("app/pg", "primary", state, 1);
    s.last_error = error.into();
    // The agent's sentence for lateness (replicate::late) comes with its kind.
    if error.starts_with("RPO ") {
        s.last_error_kind = transport::control::ErrorKind::Late as i32;
    }
    s.last_cycle.as_mut().unwrap().point_in_time_ms = now_ms() - age_ms;
    agents.set(AGENT, s);
    let v = vr(ReplicationState::Primary, 1, true);
    let sent = run_once(MOVER_GROUP, World::default(), agents.clone(), &v, 1).await;
    applied_status(&sent[0], MOVER_GROUP)
}

/// Every message of the status: the conditions' and status.message.
fn messages(st: &VolumeReplicationStatus) -> Vec<String> {
    let mut all: Vec<String> = st.conditions.iter().map(|c| c.message.clone()).collect();
    all.extend(st.message.clone());
    all
}

#[tokio::test]
async fn a_promoted_volume_whose_agent_stops_answering_stays_completed_and_is_degraded() {
    use mover::controller::crd::State;
    let agents = Arc::new(FakeAgents::default());
    let mut st = primary_with(&agents, "Replicating", "", 4_000).await;
    assert_eq!(condition(&st, "Completed").1, "Promoted");
    // Minutes later the agent stops answering; the last sync was 100 s ago.
    agents
        .down
        .store(true, std::sync::atomic::Ordering::Relaxed);
    st.last_sync_time = Some(mover::controller::status::time_ms(now_ms() - 100_000));
    let mut v = vr(ReplicationState::Primary, 1, true);
    v.status = Some(st);
    let (sent, action) = run_once_for(MOVER_GROUP, World::default(), agents.clone(), &v, 1).await;
    let st = applied_status(&sent[0], MOVER_GROUP);
    // The promotion happened: Completed still says so.
    assert_eq!(
        condition(&st, "Completed"),
        (
            "True",
            "Promoted",
            "volume is promoted to primary and replicating to secondary"
        )
    );
    assert_eq!(st.state, Some(State::Primary));
    let (status, reason, message) = condition(&st, "Degraded");
    assert_eq!((status, reason), ("True", "Unreachable"), "{message}");
    assert!(
        message.contains("the agent on node node-a (10.0.0.1:7070) does not answer"),
        "{message}"
    );
    let (status, reason, _) = condition(&st, "Replicating");
    assert_eq!((status, reason), ("False", "Unreachable"));
    for m in messages(&st) {
        assert!(!m.contains("failed to promote"), "{m}");
        assert!(m.matches("tcp connect error").count() <= 1, "{m}");
    }
    assert_generation(&st, 1);
    // The RPO grew with the time since the last sync, though the agent said nothing.
    assert_rpo_is_since_last_sync(&st);
    assert!(st.rpo_seconds.unwrap() >= 100.0, "{:?}", st.rpo_seconds);
    // Looked at again within the interval and 10 s.
    assert_eq!(action, Action::requeue(std::time::Duration::from_secs(10)));

    // A later generation asking for the same state (autoResync edited) does not undo it.
    let mut v = vr(ReplicationState::Primary, 2, true);
    v.status = Some(st);
    let st = applied_status(
        &run_once(MOVER_GROUP, World::default(), agents.clone(), &v, 1).await[0],
        MOVER_GROUP,
    );
    assert_eq!(condition(&st, "Completed").0, "True");
    assert_generation(&st, 2);

    // Its agent pod gone from the node: the same.
    let mut v = vr(ReplicationState::Primary, 2, true);
    v.status = Some(st);
    let world = World {
        agents: vec![],
        ..World::default()
    };
    let st = applied_status(
        &run_once(MOVER_GROUP, world, agents.clone(), &v, 1).await[0],
        MOVER_GROUP,
    );
    assert_eq!(condition(&st, "Completed").0, "True");
    assert_eq!(condition(&st, "Degraded").1, "Unreachable");
    assert_eq!(condition(&st, "Validated").0, "False");

    // A promotion that never completed did fail, and says so once.
    let st = applied_status(
        &run_once(
            MOVER_GROUP,
            World::default(),
            agents.clone(),
            &vr(ReplicationState::Primary, 1, true),
            1,
        )
        .await[0],
        MOVER_GROUP,
    );
    assert_eq!(
        condition(&st, "Completed"),
        ("False", "FailedToPromote", "failed to promote volume")
    );
    let (_, _, message) = condition(&st, "Degraded");
    assert_eq!(message.matches("tcp connect error").count(), 1, "{message}");
}

#[tokio::test]
async fn an_rpo_past_its_bound_is_degraded_in_a_message_that_stays_the_same() {
    // The agent's sentence, as replicate::late writes it (interval 1m: bound 180 s).
    let late =
        |rpo: u32| format!("RPO {rpo}s is past 3 intervals (180s): no cycle has completed since");
    let agents = Arc::new(FakeAgents::default());
    let st = primary_with(&agents, "Degraded", &late(200), 200_000).await;
    assert_eq!(condition(&st, "Completed").0, "True");
    let (status, reason, message) = condition(&st, "Degraded");
    assert_eq!((status, reason), ("True", "VolumeDegraded"), "{message}");
    assert!(
        message.contains("no cycle has completed since")
            && message.contains("more than 3 intervals (180s) ago"),
        "{message}"
    );
    assert_eq!(condition(&st, "Replicating").0, "False");
    assert!(messages(&st).iter().all(|m| !m.contains("RPO 200s")));
    assert_rpo_is_since_last_sync(&st);
    assert!(st.rpo_seconds.unwrap() >= 200.0);

    // A second later the agent says 201 s: nothing to write (the RPO is written by the
    // interval, the message does not tick).
    agents
        .change("test", AGENT, "app/pg", |s| s.last_error = late(201))
        .unwrap();
    let mut v = vr(ReplicationState::Primary, 1, true);
    v.status = Some(st);
    let (sent, action) = run_once_for(MOVER_GROUP, World::default(), agents.clone(), &v, 0).await;
    assert!(sent.is_empty());
    assert_eq!(action, Action::requeue(std::time::Duration::from_secs(10)));

    // An agent that still says Replicating (its clock behind): late by the controller's.
    let agents = Arc::new(FakeAgents::default());
    let st = primary_with(&agents, "Replicating", "", 200_000).await;
    let (status, _, message) = condition(&st, "Degraded");
    assert_eq!(status, "True", "{message}");
    assert!(
        message.contains("no cycle has completed since"),
        "{message}"
    );
    assert_eq!(condition(&st, "Replicating").0, "False");
}

#[tokio::test]
async fn an_unreachable_peer_locator_is_degraded_and_named_as_the_peer_clusters_locator() {
    let error = "agent agent://mover-locator@dr.example:7471/-: unavailable: cannot connect: \
                 transport error: tcp connect error: tcp connect error: Connection refused (os \
                 error 111) (is the agent running and reachable? rerunning continues the \
                 transfer)";
    let agents = Arc::new(FakeAgents::default());
    let st = primary_with(&agents, "Degraded", error, 4_000).await;
    assert_eq!(condition(&st, "Completed").0, "True");
    let (status, reason, message) = condition(&st, "Degraded");
    assert_eq!((status, reason), ("True", "VolumeDegraded"));
    assert_eq!(
        message,
        "volume is degraded: relationship Degraded: the peer cluster's Locator at \
         dr.example:7471: unavailable: cannot connect: transport error: tcp connect error: \
         Connection refused (os error 111)"
    );
    assert_eq!(condition(&st, "Replicating").0, "False");
    for m in messages(&st) {
        assert!(!m.contains("agent://") && !m.contains("rerunning"), "{m}");
        assert!(m.matches("tcp connect error").count() <= 1, "{m}");
    }
}

#[tokio::test]
async fn a_fenced_side_is_told_to_set_secondary_with_auto_resync_not_a_command() {
    let error = "\"app/pg\" is halted (Fenced): another side was promoted; run `mover replicate \
                 resync app/pg` here to make this side its secondary";
    let agents = Arc::new(FakeAgents::default());
    let st = primary_with(&agents, "Fenced", error, 4_000).await;
    let (status, reason, message) = condition(&st, "Degraded");
    assert_eq!((status, reason), ("True", "VolumeDegraded"));
    assert!(
        message.contains("`replicationState: secondary`") && message.contains("`autoResync: true`"),
        "{message}"
    );
    assert_eq!(condition(&st, "Replicating").0, "False");
    for m in messages(&st) {
        assert!(!m.contains("mover replicate"), "{m}");
    }

    // Made secondary without autoResync: Degraded says to set it.
    let mut v = vr(ReplicationState::Secondary, 2, true);
    v.status = Some(st);
    let st = applied_status(
        &run_once(MOVER_GROUP, World::default(), agents.clone(), &v, 1).await[0],
        MOVER_GROUP,
    );
    let (status, _, message) = condition(&st, "Degraded");
    assert_eq!(status, "True");
    assert!(message.contains("`autoResync: true`"), "{message}");
}

#[tokio::test]
async fn an_export_the_agent_refuses_is_a_failed_validation_and_nothing_is_created() {
    let refusal = "cannot export \"pv-1\" at /dev/vg0/pv-1: it is under none of agent.toml's \
                   volume_roots (/var/lib/kubelet)";
    let agents = Arc::new(FakeAgents {
        refuse_export: Some(refusal.into()),
        ..Default::default()
    });
    let sent = run_once(
        MOVER_GROUP,
        World::default(),
        agents.clone(),
        &vr(ReplicationState::Primary, 1, true),
        1,
    )
    .await;
    assert!(agents.calls().is_empty(), "{:?}", agents.calls());
    let st = applied_status(&sent[0], MOVER_GROUP);
    let (status, reason, message) = condition(&st, "Validated");
    assert_eq!((status, reason), ("False", "PrerequisiteNotMet"));
    assert!(message.contains(refusal), "{message}");
    assert!(
        st.message
            .as_deref()
            .unwrap()
            .starts_with("failed to export volume: agent "),
        "{:?}",
        st.message
    );
    assert_generation(&st, 1);
}

// ---------------------------------------------------------------------------------------
// End to end: the mocked API server, two real agents on 127.0.0.1, real image files.

mod common;

use common::agent::Agent;
use common::{MIB, PAGE, blake3_of, make_image, scribble_pages};
use mover::controller::agents::GrpcAgents;
use mover::controller::crd::State;
use mover::remote::ConnectOptions;
use std::path::Path;
use std::time::{Duration, Instant};

const E2E_LEN: u64 = 32 * MIB;

/// An API server that answers every request with `reply` and records what was sent.
fn recording_api_server(
    handle: tower_test::mock::Handle<Request<Body>, Response<Body>>,
    reply: Value,
    sent: Arc<Mutex<Vec<Sent>>>,
) {
    api_server_with_secret(handle, reply, None, sent);
}

/// An API server that answers a GET of `secret`'s path with its object, anything else
/// with `reply`, and records what was sent.
fn api_server_with_secret(
    mut handle: tower_test::mock::Handle<Request<Body>, Response<Body>>,
    reply: Value,
    secret: Option<(String, Value)>,
    sent: Arc<Mutex<Vec<Sent>>>,
) {
    tokio::spawn(async move {
        while let Some(request) = handle.next_request().await {
            let body = match &secret {
                Some((path, object)) if request.0.uri().path() == path => object,
                _ => &reply,
            };
            answer(request, body, |s| sent.lock().unwrap().push(s)).await;
        }
    });
}

/// Reconciles `v` once as the controller of a cluster whose caches hold `classes`, the
/// bound PVC, `pv` and the agent pod `pod` (agents on `port`), against the API server of
/// [`api_server_with_secret`]; returns what was sent.
async fn reconcile_in(
    agents: Arc<GrpcAgents>,
    classes: Vec<VolumeReplicationClass>,
    (pv, pod): (PersistentVolume, Pod),
    port: u16,
    v: &VolumeReplication,
    secret: Option<(String, Value)>,
) -> Vec<Sent> {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let ctx = Arc::new(Context {
        client: kube::Client::new(service, "default"),
        group: MOVER_GROUP.into(),
        agents,
        caches: Caches::fixed(
            MOVER_GROUP,
            classes,
            vec![pvc(true)],
            vec![pv],
            vec![],
            vec![pod],
        ),
        agent_port: port,
        csi: Default::default(),
        job_image: "mover".into(),
        metrics: Default::default(),
        recorder: None,
        leftovers: None,
        secrets: None,
    });
    let obj = dynamic(v, MOVER_GROUP);
    let sent = Arc::new(Mutex::new(Vec::new()));
    api_server_with_secret(
        handle,
        serde_json::to_value(&obj).unwrap(),
        secret,
        sent.clone(),
    );
    reconcile(Arc::new(obj), ctx).await.expect("reconcile");
    std::mem::take(&mut *sent.lock().unwrap())
}

/// One cluster as its controller sees it: the PVC `app/data` bound to a local PV
/// `pv-1` at `image` on `node`, whose agent is `agent`; the class replicates to `peer`.
struct Cluster {
    agents: Arc<GrpcAgents>,
    world: (Vec<VolumeReplicationClass>, PersistentVolume, Pod),
    port: u16,
}

/// A local PV `pv-1` at `image` on `node`, and the running agent pod there (127.0.0.1).
fn on_node(node: &str, image: &Path) -> (PersistentVolume, Pod) {
    let pv = serde_json::from_value(json!({
        "metadata": {"name": "pv-1"},
        "spec": {
            "local": {"path": image},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}
            ]}]}}
        }
    }))
    .unwrap();
    let mut pod = agent_pod(node);
    pod.status.as_mut().unwrap().pod_ip = Some("127.0.0.1".into());
    (pv, pod)
}

impl Cluster {
    fn new(dir: &Path, agent: &Agent, peer: &Agent, node: &str, image: &Path) -> Cluster {
        let (pv, pod) = on_node(node, image);
        let target = format!("agent://127.0.0.1:{}", peer.port);
        Cluster {
            agents: Arc::new(GrpcAgents::new(ConnectOptions {
                token_file: Some(dir.join("token")),
                ..Default::default()
            })),
            world: (
                vec![class(&[("target", &target), ("schedulingInterval", "1s")])],
                pv,
                pod,
            ),
            port: agent.port,
        }
    }

    /// Reconciles `vr` once; returns the status written (or the old one if none was).
    async fn reconcile(&self, vr: &VolumeReplication) -> VolumeReplicationStatus {
        let (classes, pv, pod) = self.world.clone();
        let agents = self.agents.clone();
        let sent = reconcile_in(agents, classes, (pv, pod), self.port, vr, None).await;
        match sent.last() {
            Some(s) => applied_status(s, MOVER_GROUP),
            None => vr.status.clone().unwrap(),
        }
    }

    /// The relationship on this cluster's agent once `cond` holds.
    async fn wait_for(
        &self,
        what: &str,
        cond: impl Fn(&control::Status) -> bool,
    ) -> control::Status {
        let deadline = Instant::now() + Duration::from_secs(60);
        let agent = format!("127.0.0.1:{}", self.port);
        loop {
            let s = self.agents.get(&agent, "app/pg").await.unwrap();
            if let Some(s) = s.filter(|s| cond(s)) {
                return s;
            }
            assert!(Instant::now() < deadline, "waited for {what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// `vr` at `state` with `generation`, carrying the status last written.
fn next(
    state: ReplicationState,
    generation: i64,
    st: VolumeReplicationStatus,
) -> VolumeReplication {
    let mut v = vr(state, generation, true);
    v.status = Some(st);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_a_volume_replication_replicates_fails_over_and_back_by_delta() {
    let t = tempfile::tempdir().unwrap();
    let (da, db) = (t.path().join("a"), t.path().join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let (a_img, b_img) = (da.join("vol.img"), db.join("vol.img"));
    make_image(&a_img, E2E_LEN, 3, &[(0, 4 * MIB), (20 * MIB, 2 * MIB)]);
    // The agents export nothing by config: each controller registers its PV, found
    // from the PV's spec, under the agent's volume_roots (the agents' directories).
    let a = Agent::start(&da, &[], None);
    let b = Agent::start(&db, &[], None);
    let main = Cluster::new(&da, &a, &b, "node-a", &a_img);
    let dr = Cluster::new(&db, &b, &a, "node-b", &b_img);

    // The DR cluster's VolumeReplication comes first (RamenDR creates both): its agent
    // is told to serve the PV, and waits for the first cycle.
    let dr_first = dr
        .reconcile(&vr(ReplicationState::Secondary, 1, true))
        .await;
    assert_eq!(
        dr_first.state,
        Some(State::Secondary),
        "{:?}",
        dr_first.message
    );
    assert_eq!(condition(&dr_first, "Validated").0, "True");

    // A new VolumeReplication goes primary: the relationship is created on node-a's
    // agent, its first cycle fills the DR cluster's volume.
    let started = Instant::now();
    let st = main
        .reconcile(&vr(ReplicationState::Primary, 1, true))
        .await;
    assert_eq!(st.state, Some(State::Primary), "{:?}", st.message);
    assert_eq!(condition(&st, "Completed").1, "Promoted");
    main.wait_for("the first cycle", |s| {
        s.state == "Replicating"
            && s.last_cycle
                .as_ref()
                .is_some_and(|c| c.point_in_time_ms > 0)
    })
    .await;
    eprintln!(
        "primary on a new VolumeReplication -> first completed cycle ({} MiB): {:.2} s",
        E2E_LEN / MIB,
        started.elapsed().as_secs_f64()
    );
    let st = main
        .reconcile(&next(ReplicationState::Primary, 1, st))
        .await;
    assert!(st.last_sync_time.is_some(), "lastSyncTime set: {st:?}");
    assert!(st.last_sync_bytes.unwrap_or(0) > 0, "{st:?}");
    assert!(st.last_sync_duration.is_some(), "{st:?}");
    assert_eq!(blake3_of(&b_img, E2E_LEN), blake3_of(&a_img, E2E_LEN));

    // The DR cluster's VolumeReplication, secondary: healthy once a cycle is applied.
    let dr_st = dr
        .reconcile(&next(ReplicationState::Secondary, 1, dr_first))
        .await;
    assert_eq!(dr_st.state, Some(State::Secondary), "{:?}", dr_st.message);
    assert_eq!(condition(&dr_st, "Degraded").0, "False");

    // Planned failover, as RamenDR flips both sides: the primary is demoted (a final
    // cycle ships what was written since), then the DR side is promoted.
    scribble_pages(&a_img, 11, 40, 0..E2E_LEN);
    let st = main
        .reconcile(&next(ReplicationState::Secondary, 2, st))
        .await;
    assert_eq!(st.state, Some(State::Secondary), "{:?}", st.message);
    assert_eq!(condition(&st, "Completed").1, "Demoted");
    let dr_st = dr
        .reconcile(&next(ReplicationState::Primary, 2, dr_st))
        .await;
    assert_eq!(dr_st.state, Some(State::Primary), "{:?}", dr_st.message);
    assert_eq!(dr_st.epoch, Some(2), "the promotion raised the epoch");
    assert_eq!(blake3_of(&b_img, E2E_LEN), blake3_of(&a_img, E2E_LEN));

    // The new primary's writes come back to the old one by delta: exactly the pages
    // written, nothing else (the counter of the new primary's agent).
    dr.wait_for("a promoted primary", |s| s.role == "primary")
        .await;
    let counter = r#"mover_replication_bytes_shipped_total{relationship="app/pg",role="primary"}"#;
    let shipped_before = b.metric(counter);
    let pages = scribble_pages(&b_img, 12, 25, 0..E2E_LEN);
    let want = blake3_of(&b_img, E2E_LEN);
    let deadline = Instant::now() + Duration::from_secs(60);
    while blake3_of(&a_img, E2E_LEN) != want || b.metric(counter) - shipped_before < pages * PAGE {
        assert!(
            Instant::now() < deadline,
            "the writes never reached the old primary"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(b.metric(counter) - shipped_before, pages * PAGE, "by delta");
    let back = dr
        .reconcile(&next(ReplicationState::Primary, 2, dr_st))
        .await;
    assert!(back.last_sync_time.is_some());
    let st = main
        .reconcile(&next(ReplicationState::Secondary, 2, st))
        .await;
    assert_eq!(condition(&st, "Degraded").0, "False", "{:?}", st.message);

    // An agent keeps an export its relationship uses, and exports nothing outside its
    // volume_roots; once the relationship is gone the export goes, the data stays.
    let agent_a = format!("127.0.0.1:{}", a.port);
    let e = main.agents.unexport(&agent_a, "pv-1").await.unwrap_err();
    assert_eq!(e.code, tonic::Code::FailedPrecondition, "{e}");
    assert!(e.message.contains("relationship \"app/pg\""), "{e}");
    let e = main
        .agents
        .export(&agent_a, "pv-2", "/etc", false, "app/pg2", None)
        .await
        .unwrap_err();
    assert_eq!(e.code, tonic::Code::PermissionDenied, "{e}");
    assert!(e.message.contains("volume_roots"), "{e}");
    let kept = blake3_of(&a_img, E2E_LEN);
    main.agents.delete(&agent_a, "app/pg").await.unwrap();
    main.agents.unexport(&agent_a, "pv-1").await.unwrap();
    let e = main
        .agents
        .create(
            &agent_a,
            control::Spec {
                name: "again".into(),
                volume: "pv-1".into(),
                peer: format!("agent://127.0.0.1:{}/pv-1", b.port),
                interval_ms: 60_000,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(e.message.contains("not exported"), "{e}");
    assert_eq!(blake3_of(&a_img, E2E_LEN), kept);
}

/// The controller's resident set (VmRSS), in MiB.
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb / 1024.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_volume_replications_cost_one_request_each_per_new_cycle_and_none_at_rest() {
    const N: usize = 1000;
    let agents = Arc::new(FakeAgents::default());
    let rss_before = rss_mib();
    let (mut pvcs, mut pvs, mut vrs) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..N {
        let mut c = pvc(true);
        c.metadata.name = Some(format!("data-{i}"));
        c.spec.as_mut().unwrap().volume_name = Some(format!("pv-{i}"));
        pvcs.push(c);
        let mut v = pv();
        v.metadata.name = Some(format!("pv-{i}"));
        pvs.push(v);
        let mut r = vr(ReplicationState::Primary, 1, true);
        r.metadata.name = Some(format!("pg-{i}"));
        r.spec.data_source.name = format!("data-{i}");
        vrs.push(r);
    }
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let ctx = Arc::new(Context {
        client: kube::Client::new(service, "default"),
        group: MOVER_GROUP.into(),
        agents: agents.clone(),
        caches: Caches::fixed(
            MOVER_GROUP,
            vec![good_class()],
            pvcs,
            pvs,
            vec![],
            vec![agent_pod("node-a")],
        ),
        agent_port: 7070,
        csi: Default::default(),
        job_image: "mover".into(),
        metrics: Default::default(),
        recorder: None,
        leftovers: None,
        secrets: None,
    });
    let sent = Arc::new(Mutex::new(Vec::new()));
    recording_api_server(handle, json!({}), sent.clone());
    // One pass over every VolumeReplication, each with the status it was last given.
    let pass = |vrs: Vec<VolumeReplication>| {
        let (ctx, sent) = (ctx.clone(), sent.clone());
        async move {
            sent.lock().unwrap().clear();
            let mut out = Vec::new();
            for mut v in vrs {
                let before = sent.lock().unwrap().len();
                reconcile(Arc::new(dynamic(&v, MOVER_GROUP)), ctx.clone())
                    .await
                    .expect("reconcile");
                if let Some(s) = sent.lock().unwrap().get(before) {
                    v.status = Some(serde_json::from_value(s.body["status"].clone()).unwrap());
                }
                out.push(v);
            }
            (out, sent.lock().unwrap().len())
        }
    };
    let (vrs, created) = pass(vrs).await;
    assert_eq!(created, N, "one status write per new VolumeReplication");
    let (vrs, at_rest) = pass(vrs).await;
    assert_eq!(at_rest, 0, "nothing changed: no request");
    // A cycle completes on every relationship: one status write each.
    let cycle = now_ms();
    for i in 0..N {
        agents
            .change("test", AGENT, &format!("app/pg-{i}"), |s| {
                s.last_cycle.as_mut().unwrap().point_in_time_ms = cycle
            })
            .unwrap();
    }
    let (_, per_cycle) = pass(vrs).await;
    assert_eq!(
        per_cycle, N,
        "one request per VolumeReplication per new cycle"
    );
    eprintln!(
        "{N} VolumeReplications: {created} requests to set up, {at_rest} at rest, {per_cycle} \
         per cycle; resident {:.0} MiB ({:+.0} MiB for them)",
        rss_mib(),
        rss_mib() - rss_before
    );
}

#[tokio::test]
async fn transitions_are_recorded_as_events_and_a_failure_as_a_warning() {
    let agents = Arc::new(FakeAgents::default());
    agents.set(AGENT, status("app/pg", "primary", "Replicating", 1));
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let client = kube::Client::new(service, "default");
    let recorder = kube::runtime::events::Recorder::new(
        client.clone(),
        kube::runtime::events::Reporter {
            controller: "mover-controller".into(),
            instance: None,
        },
    );
    let ctx = Arc::new(Context {
        client,
        group: MOVER_GROUP.into(),
        agents: agents.clone(),
        caches: Caches::fixed(
            MOVER_GROUP,
            vec![good_class()],
            vec![pvc(true)],
            vec![pv()],
            vec![],
            vec![agent_pod("node-a")],
        ),
        agent_port: 7070,
        csi: Default::default(),
        job_image: "mover".into(),
        metrics: Default::default(),
        recorder: Some(recorder),
        leftovers: None,
        secrets: None,
    });
    let sent = Arc::new(Mutex::new(Vec::new()));
    let obj = dynamic(&vr(ReplicationState::Secondary, 2, true), MOVER_GROUP);
    recording_api_server(handle, serde_json::to_value(&obj).unwrap(), sent.clone());
    reconcile(Arc::new(obj), ctx.clone()).await.unwrap();
    let events = |sent: &[Sent]| -> Vec<(String, String, String)> {
        sent.iter()
            .filter(|s| {
                s.uri
                    .starts_with("/apis/events.k8s.io/v1/namespaces/app/events")
            })
            .map(|s| {
                assert_eq!(s.body["regarding"]["name"], "pg");
                assert_eq!(s.body["reportingController"], "mover-controller");
                (
                    s.body["type"].as_str().unwrap().into(),
                    s.body["reason"].as_str().unwrap().into(),
                    s.body["action"].as_str().unwrap().into(),
                )
            })
            .collect()
    };
    let first = events(&sent.lock().unwrap());
    assert!(
        first.contains(&("Normal".into(), "Demoted".into(), "Demote".into())),
        "{first:?}"
    );
    // The same outcome again is not news; a failure is a Warning.
    let st = applied_status(&sent.lock().unwrap()[0], MOVER_GROUP);
    sent.lock().unwrap().clear();
    let mut v = vr(ReplicationState::Primary, 3, true);
    v.status = Some(st);
    let mut failing = World::default();
    failing.agents.clear();
    let ctx = Arc::new(Context {
        caches: Caches::fixed(
            MOVER_GROUP,
            failing.classes,
            failing.pvcs,
            vec![pv()],
            vec![],
            vec![],
        ),
        ..Arc::try_unwrap(ctx).ok().unwrap()
    });
    reconcile(Arc::new(dynamic(&v, MOVER_GROUP)), ctx)
        .await
        .unwrap();
    let second = events(&sent.lock().unwrap());
    assert!(
        second.contains(&(
            "Warning".into(),
            "PrerequisiteNotMet".into(),
            "Promote".into()
        )),
        "{second:?}"
    );
    assert!(!second.iter().any(|e| e.1 == "Demoted"), "{second:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_a_repository_class_snapshots_the_volume_into_s3_on_schedule() {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Secret;
    use snapshots::testing::{ACCESS_KEY, S3Server, SECRET_KEY};
    let t = tempfile::tempdir().unwrap();
    let s3 = S3Server::start(&t.path().join("s3"));
    s3.create_bucket("dr-snaps");
    let repo = "s3://dr-snaps/k8s";
    let operator = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(args)
            .env("MOVER_S3_ENDPOINT", &s3.endpoint)
            .env("AWS_ACCESS_KEY_ID", ACCESS_KEY)
            .env("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
            .env("AWS_REGION", "us-east-1")
            .env("MOVER_PASSWORD", "repo-pw")
            .env("MOVER_CACHE_DIR", t.path().join("cache"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    operator(&["repo", "init", repo]);
    let da = t.path().join("a");
    std::fs::create_dir_all(&da).unwrap();
    let img = da.join("vol.img");
    make_image(&img, E2E_LEN, 21, &[(0, 5 * MIB), (16 * MIB, 3 * MIB)]);
    // The agent has no S3 keys and no password: they come from the class's secret.
    let a = Agent::start(&da, &[], None);
    let class = class(&[
        ("target", repo),
        ("schedulingInterval", "1h"),
        ("keepLast", "3"),
        ("s3Endpoint", &s3.endpoint),
        ("s3Region", "us-east-1"),
        (
            "replication.storage.openshift.io/replication-secret-name",
            "dr-s3",
        ),
        (
            "replication.storage.openshift.io/replication-secret-namespace",
            "mover-system",
        ),
    ]);
    let secret_with = |password: &str, version: &str| Secret {
        metadata: kube::api::ObjectMeta {
            uid: Some("5ec2e7".into()),
            resource_version: Some(version.into()),
            ..Default::default()
        },
        data: Some(
            [
                ("password", password),
                ("AWS_ACCESS_KEY_ID", ACCESS_KEY),
                ("AWS_SECRET_ACCESS_KEY", SECRET_KEY),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), ByteString(v.as_bytes().to_vec())))
            .collect(),
        ),
        ..Default::default()
    };
    let secret = Mutex::new(secret_with("repo-pw\n", "1"));
    let (pv, pod) = on_node("node-a", &img);
    let agents = Arc::new(GrpcAgents::new(ConnectOptions {
        token_file: Some(da.join("token")),
        ..Default::default()
    }));
    let reconcile_once = |v: VolumeReplication| {
        let secret = serde_json::to_value(&*secret.lock().unwrap()).unwrap();
        let secret = (
            "/api/v1/namespaces/mover-system/secrets/dr-s3".into(),
            secret,
        );
        let (agents, world) = (agents.clone(), (pv.clone(), pod.clone()));
        let classes = vec![class.clone()];
        async move { reconcile_in(agents, classes, world, a.port, &v, Some(secret)).await }
    };
    let secret_reads = |sent: &[Sent]| sent.iter().filter(|s| s.uri.contains("/secrets/")).count();

    // Primary: a schedule on the volume's agent, with the secret's password and keys; the
    // first snapshot is taken at once.
    let sent = reconcile_once(vr(ReplicationState::Primary, 1, true)).await;
    assert_eq!(secret_reads(&sent), 1);
    let st = applied_status(sent.last().unwrap(), MOVER_GROUP);
    assert_eq!(st.state, Some(State::Primary), "{:?}", st.message);
    assert_eq!(condition(&st, "Completed").1, "Promoted");
    let agent = format!("127.0.0.1:{}", a.port);
    let deadline = Instant::now() + Duration::from_secs(60);
    let taken = loop {
        let s = agents
            .schedule(&agent, "app/pg")
            .await
            .unwrap()
            .expect("a schedule");
        if s.runs_ok == 1 {
            break s;
        }
        assert_eq!(s.runs_failed, 0, "{}", s.last_error);
        assert!(Instant::now() < deadline, "no snapshot taken");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let spec = taken.spec.clone().unwrap();
    assert_eq!(
        (spec.volume.as_str(), spec.schedule.as_str()),
        ("pv-1", "3600s")
    );
    assert_eq!(spec.keep.unwrap().last, 3);
    assert!(
        spec.access.is_none(),
        "the agent never answers the secret back"
    );

    // The next look reports the snapshot as the last sync; the agent's access is the
    // secret's (one read of the secret per look, nothing applied).
    let mut v = vr(ReplicationState::Primary, 1, true);
    v.status = Some(st);
    let sent = reconcile_once(v.clone()).await;
    assert_eq!(secret_reads(&sent), 1);
    let again = agents.schedule(&agent, "app/pg").await.unwrap().unwrap();
    assert_eq!(again.spec.unwrap().access_version, "5ec2e7/1");
    assert_eq!(again.next_run_ms, taken.next_run_ms);
    let st = applied_status(sent.last().unwrap(), MOVER_GROUP);
    assert!(st.last_sync_time.is_some(), "{st:?}");
    assert!(st.last_sync_bytes.unwrap() >= 8 * MIB as i64, "{st:?}");
    assert_eq!(st.destination_volume_id.as_deref(), Some(repo));
    assert_eq!(condition(&st, "Degraded").0, "False");

    // The snapshot in S3 restores to the volume's bytes.
    let restored = t.path().join("restored.img");
    operator(&[
        "snapshot",
        "restore",
        repo,
        &taken.last_snapshot,
        restored.to_str().unwrap(),
    ]);
    assert_eq!(blake3_of(&restored, E2E_LEN), blake3_of(&img, E2E_LEN));

    // A rotated secret reaches the agent at the next look: here a wrong password, which
    // the next run proves the agent uses; then the right one again.
    let run_now = || {
        std::process::Command::new(env!("CARGO_BIN_EXE_mover"))
            .args(["snapshot", "schedule", "run", "app/pg", "--agent"])
            .arg(format!("agent://{agent}"))
            .env("MOVER_TOKEN", common::agent::TOKEN)
            .output()
            .unwrap()
    };
    *secret.lock().unwrap() = secret_with("rotated-but-wrong", "2");
    reconcile_once(v.clone()).await;
    let rotated = agents.schedule(&agent, "app/pg").await.unwrap().unwrap();
    assert_eq!(rotated.spec.unwrap().access_version, "5ec2e7/2");
    let out = run_now();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("wrong password"),
        "{out:?}"
    );
    *secret.lock().unwrap() = secret_with("repo-pw\n", "3");
    reconcile_once(v.clone()).await;
    assert!(run_now().status.success());

    // A repository has no secondary: Validated=False, nothing changes on the agent.
    let mut sec = vr(ReplicationState::Secondary, 2, true);
    sec.status = v.status.clone();
    let sent = reconcile_once(sec).await;
    let st = applied_status(sent.last().unwrap(), MOVER_GROUP);
    let (status, _, message) = condition(&st, "Validated");
    assert_eq!(status, "False");
    assert!(message.contains("no secondary"), "{message}");

    // Deleted: the schedule goes, the snapshots stay.
    let mut gone = vr(ReplicationState::Primary, 2, true);
    gone.metadata.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        "2026-01-01T00:00:00Z".parse().unwrap(),
    ));
    reconcile_once(gone).await;
    assert!(agents.schedule(&agent, "app/pg").await.unwrap().is_none());
    operator(&[
        "snapshot",
        "restore",
        repo,
        &taken.last_snapshot,
        restored.to_str().unwrap(),
    ]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_class_secret_token_is_what_the_primary_presents_to_the_peer_agent() {
    use k8s_openapi::ByteString;
    use k8s_openapi::api::core::v1::Secret;
    let t = tempfile::tempdir().unwrap();
    let (da, db) = (t.path().join("a"), t.path().join("b"));
    std::fs::create_dir_all(&da).unwrap();
    std::fs::create_dir_all(&db).unwrap();
    let (a_img, b_img) = (da.join("vol.img"), db.join("vol.img"));
    make_image(&a_img, E2E_LEN, 5, &[(0, 3 * MIB), (9 * MIB, MIB)]);
    // Agent A's own token for peers is wrong: only the class secret's gets it through.
    let wrong = da.join("wrong-token");
    std::fs::write(&wrong, "not-the-peers-token").unwrap();
    let a = Agent::start_with_settings(
        &da,
        &[],
        None,
        &format!("peer_token_file = \"{}\"", wrong.display()),
    );
    let b = Agent::start(&db, &[], None);
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            uid: Some("70ce2".into()),
            resource_version: Some("7".into()),
            ..Default::default()
        },
        data: Some(
            [
                (
                    "token".to_string(),
                    ByteString(common::agent::TOKEN.as_bytes().to_vec()),
                ),
                // The peer credential the relationship is bound to on this side.
                ("peer-credential".to_string(), ByteString(b"dr\n".to_vec())),
            ]
            .into(),
        ),
        ..Default::default()
    };
    let agents = Arc::new(GrpcAgents::new(ConnectOptions {
        token_file: Some(da.join("token")),
        ..Default::default()
    }));
    let reconcile_on = |node: &str,
                        port: u16,
                        image: &Path,
                        class: VolumeReplicationClass,
                        v: VolumeReplication| {
        let world = on_node(node, image);
        let secret = serde_json::to_value(&secret).unwrap();
        let secret = (
            "/api/v1/namespaces/mover-system/secrets/peer".into(),
            secret,
        );
        let agents = agents.clone();
        async move {
            let sent = reconcile_in(agents, vec![class], world, port, &v, Some(secret)).await;
            applied_status(sent.last().unwrap(), MOVER_GROUP)
        }
    };
    let to = |agent: &Agent| format!("agent://127.0.0.1:{}", agent.port);
    let main_class = class(&[
        ("target", &to(&b)),
        ("schedulingInterval", "1s"),
        (
            "replication.storage.openshift.io/replication-secret-name",
            "peer",
        ),
        (
            "replication.storage.openshift.io/replication-secret-namespace",
            "mover-system",
        ),
    ]);
    let dr_class = class(&[("target", &to(&a)), ("schedulingInterval", "1s")]);

    // The DR side first (it registers its PV), then the primary with the class secret.
    let dr = reconcile_on(
        "node-b",
        b.port,
        &b_img,
        dr_class,
        vr(ReplicationState::Secondary, 1, true),
    )
    .await;
    assert_eq!(dr.state, Some(State::Secondary), "{:?}", dr.message);
    let st = reconcile_on(
        "node-a",
        a.port,
        &a_img,
        main_class,
        vr(ReplicationState::Primary, 1, true),
    )
    .await;
    assert_eq!(st.state, Some(State::Primary), "{:?}", st.message);
    let agent_a = format!("127.0.0.1:{}", a.port);
    let deadline = Instant::now() + Duration::from_secs(60);
    let s = loop {
        let s = agents.get(&agent_a, "app/pg").await.unwrap().unwrap();
        if s.last_cycle
            .as_ref()
            .is_some_and(|c| c.point_in_time_ms > 0)
        {
            break s;
        }
        assert!(Instant::now() < deadline, "no cycle: {}", s.last_error);
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(blake3_of(&b_img, E2E_LEN), blake3_of(&a_img, E2E_LEN));
    let spec = s.spec.unwrap();
    assert_eq!(spec.peer_token_version, "70ce2/7");
    assert_eq!(spec.peer_credential, "dr", "bound from the class secret");
    assert!(
        spec.peer_token.is_empty(),
        "the token is never answered back"
    );

    // Without the class's token, agent A's own cannot reach B.
    let other = da.join("other.img");
    make_image(&other, MIB, 6, &[(0, MIB)]);
    let other_path = other.to_str().unwrap();
    agents
        .export(&agent_a, "pv-2", other_path, true, "no-secret", None)
        .await
        .unwrap();
    let e = agents
        .create(
            &agent_a,
            control::Spec {
                name: "no-secret".into(),
                volume: "pv-2".into(),
                peer: format!("{}/pv-2", to(&b)),
                interval_ms: 60_000,
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert!(
        e.message.contains("secondary unreachable") || e.message.contains("token"),
        "{e}"
    );
}

/// The controller's connections to an agent follow its renewed client certificate: a
/// channel reconnects with the identity it was made with, so the cached one is made
/// again once the certificate changes. Shown by a certificate the agent refuses (another
/// CA's): the next call fails, where the old connection would have carried on; a
/// renewed one from the agent's CA is accepted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controllers_agent_connections_follow_its_renewed_certificate() {
    use transport::tls::{LiveTls, TlsPem};
    let t = tempfile::tempdir().unwrap();
    let [ca, server_cert, server_key, client_cert, client_key] =
        common::agent::make_pki(t.path(), "good");
    let [other_ca, _, _, other_cert, other_key] = common::agent::make_pki(t.path(), "other");
    let a = Agent::start(t.path(), &[], Some((&server_cert, &server_key, &ca)));
    let pem = |cert: &Path, key: &Path, ca: &Path| TlsPem {
        cert: std::fs::read(cert).unwrap(),
        key: std::fs::read(key).unwrap(),
        ca: std::fs::read(ca).unwrap(),
    };
    let live = LiveTls::new(pem(&client_cert, &client_key, &ca));
    let agents = GrpcAgents::new(ConnectOptions {
        token_file: Some(t.path().join("token")),
        tls_pem: Some(live.clone()),
        tls_server_name: Some("localhost".into()),
        ..Default::default()
    });
    let agent = format!("127.0.0.1:{}", a.port);
    let get = || agents.get(&agent, "app/none");
    assert_eq!(
        get().await.unwrap(),
        None,
        "the first certificate is accepted"
    );
    assert_eq!(get().await.unwrap(), None, "on the cached connection");
    live.set(pem(&other_cert, &other_key, &other_ca));
    let refused = get()
        .await
        .expect_err("another CA's certificate is refused");
    assert_eq!(refused.code, tonic::Code::Unavailable, "{refused:?}");
    // Renewed from the agent's CA (a new key, the same name): accepted.
    common::agent::reissue_client_cert(t.path(), "good");
    live.set(pem(&client_cert, &client_key, &ca));
    assert_eq!(
        get().await.unwrap(),
        None,
        "the renewed certificate is accepted"
    );
}
