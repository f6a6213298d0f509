//! The desired relationship of a `VolumeReplication`, from the resources it names.
//!
//! Pure: the caller looks the resources up (from watch caches) and passes them in; the
//! answer is either the relationship to have on which agent, or [`Invalid`] saying what
//! to fix. Nothing here talks to the API server or an agent, so every rule is unit-tested.

use crate::crd::{
    ReplicationState, VolumeReplication, VolumeReplicationClass, VolumeReplicationSpec,
};
use k8s_openapi::api::core::v1::{
    Node, NodeSelectorRequirement, NodeSelectorTerm, PersistentVolume, PersistentVolumeClaim, Pod,
};
use k8s_openapi::api::storage::v1::VolumeAttachment;
use std::time::Duration;

/// Class parameter: time between the starts of two cycles ("5m", "30s").
pub const PARAM_INTERVAL: &str = "schedulingInterval";
/// Class parameter: where replicas go: cluster://HOST:PORT (the peer cluster's Locator,
/// which says which of its agents holds each secondary), `agent://[NODE@]HOST:PORT` (one
/// agent of the peer cluster), or a snapshot repository.
pub const PARAM_TARGET: &str = "target";
/// Class parameter: bytes per second on the wire ("100M").
pub const PARAM_BANDWIDTH: &str = "bandwidth";
/// Class parameter: chunk size of block volumes ("1M").
pub const PARAM_CHUNK_SIZE: &str = "chunkSize";
/// Class parameter: the least consistency a cycle must have to complete:
/// `point-in-time` (the default) or `crash-inconsistent`. Under `point-in-time`, a volume
/// with no way to take one (a clone, a snapshot) is Degraded and its cycles are not
/// shipped; the status says what is missing.
pub const PARAM_CONSISTENCY: &str = "consistency";
/// Class parameter: the VolumeSnapshotClass of each cycle's point in time. The volume
/// (a CSI block volume) is then read through a clone of a VolumeSnapshot taken per
/// cycle, and only the blocks the driver's SnapshotMetadata service names as changed
/// are read (see `controller::csi_snapshots`).
pub const PARAM_SNAPSHOT_CLASS: &str = "volumeSnapshotClassName";
/// Class parameter: how long the file systems on the volume may stay frozen while a
/// VolumeSnapshot is cut ("10s", the default): past it the agent's watchdog thaws them
/// and the cycle fails.
pub const PARAM_FREEZE_TIMEOUT: &str = "freezeTimeout";
/// The default of [`PARAM_FREEZE_TIMEOUT`].
pub const DEFAULT_FREEZE_TIMEOUT: Duration = Duration::from_secs(10);
/// Class parameters of repository targets: how many snapshots retention keeps, per rule
/// (as `mover snapshot forget --keep-*`).
pub const PARAM_KEEP: [&str; 5] = [
    "keepLast",
    "keepHourly",
    "keepDaily",
    "keepWeekly",
    "keepMonthly",
];
/// Class parameter of repository targets: prune after every N snapshots.
pub const PARAM_PRUNE_EVERY: &str = "pruneEvery";
/// Class parameter of s3:// repository targets: the endpoint URL of an S3-compatible
/// server (default AWS).
pub const PARAM_S3_ENDPOINT: &str = "s3Endpoint";
/// Class parameter of s3:// repository targets: the bucket's region.
pub const PARAM_S3_REGION: &str = "s3Region";
/// Reserved class parameters (csi-addons'): the secret with TLS, token or S3 keys.
pub const PARAM_SECRET_NAME: &str = "replication.storage.openshift.io/replication-secret-name";
/// See [`PARAM_SECRET_NAME`].
pub const PARAM_SECRET_NAMESPACE: &str =
    "replication.storage.openshift.io/replication-secret-namespace";
/// The default interval: csi-addons' default schedule is an hour, too long for mover.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(300);

/// A resource that cannot be acted on yet: csi-addons' failure message (`what`) and a
/// sentence saying what is wrong and what to do (`detail`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what}: {detail}")]
pub struct Invalid {
    /// What failed, in csi-addons' words ("failed to get volumeReplication class").
    pub what: &'static str,
    /// What is wrong and how to fix it.
    pub detail: String,
}

fn invalid(what: &'static str, detail: impl Into<String>) -> Invalid {
    Invalid {
        what,
        detail: detail.into(),
    }
}

/// A class's parameters, parsed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClassParams {
    /// Between the starts of two cycles.
    pub interval: Duration,
    /// Where replicas go.
    pub target: Target,
    /// Bytes per second (0: no limit).
    pub bwlimit: u64,
    /// Chunk size in bytes (0: the agent's default).
    pub chunk_size: u64,
    /// The class's secret (namespace, name), if it names one.
    pub secret: Option<(String, String)>,
    /// Cycles that are not of one point in time fail ([`PARAM_CONSISTENCY`]).
    pub require_point_in_time: bool,
    /// The VolumeSnapshotClass of each cycle's point in time ([`PARAM_SNAPSHOT_CLASS`]).
    pub snapshot_class: Option<String>,
    /// The bound of a freeze around a snapshot ([`PARAM_FREEZE_TIMEOUT`]).
    pub freeze_timeout: Duration,
    /// Run in the workload's pods before a snapshot's freeze, and after it is cut
    /// (see `controller::hooks`).
    pub hooks: (Option<super::hooks::Hook>, Option<super::hooks::Hook>),
}

/// Where a class sends a volume.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// Replication to one agent of the peer cluster: `[NODE@]HOST:PORT`.
    Agent(String),
    /// Replication to a peer cluster, its Locator at HOST:PORT.
    Cluster(String),
    /// Scheduled snapshots into a repository.
    Repository(RepositoryTarget),
}

/// A repository target: snapshots on the class's interval, kept by its retention rules.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RepositoryTarget {
    /// s3://BUCKET[/PREFIX], or a directory on the volume's node.
    pub url: String,
    /// keepLast, keepHourly, keepDaily, keepWeekly, keepMonthly.
    pub keep: [u32; 5],
    /// Prune after every N snapshots (0: never).
    pub prune_every: u32,
    /// S3 endpoint URL ("": AWS).
    pub s3_endpoint: String,
    /// S3 region ("": the agent's default).
    pub s3_region: String,
}

/// Parses and checks a class's parameters.
pub fn class_params(class: &VolumeReplicationClass) -> Result<ClassParams, Invalid> {
    let name = kube::ResourceExt::name_any(class);
    let what = "failed to validate parameters of volumeReplicationClass";
    let p = &class.spec.parameters;
    let interval = match p.get(PARAM_INTERVAL) {
        None => DEFAULT_INTERVAL,
        Some(s) => parse_interval(s).map_err(|why| {
            invalid(
                what,
                format!("VolumeReplicationClass {name}: {PARAM_INTERVAL} {s:?}: {why}"),
            )
        })?,
    };
    let target = match p.get(PARAM_TARGET).map(|s| s.trim()) {
        None | Some("") => {
            return Err(invalid(
                what,
                format!(
                    "VolumeReplicationClass {name} has no {PARAM_TARGET} parameter: set it to \
                     cluster://HOST:PORT of the peer cluster's mover Locator, or to a snapshot \
                     repository (s3://BUCKET/PREFIX, or a directory on the nodes)"
                ),
            ));
        }
        Some(t) if t.starts_with("s3://") || t.starts_with('/') => {
            Target::Repository(repository_target(&name, t, p)?)
        }
        Some(t)
            if t.starts_with("cluster://") && valid_host_port(t[10..].trim_end_matches('/')) =>
        {
            Target::Cluster(t[10..].trim_end_matches('/').to_string())
        }
        Some(t) => match t.strip_prefix("agent://") {
            Some(hp) if valid_host_port(hp.trim_end_matches('/')) => {
                Target::Agent(hp.trim_end_matches('/').to_string())
            }
            _ => {
                return Err(invalid(
                    what,
                    format!(
                        "VolumeReplicationClass {name}: unknown {PARAM_TARGET} {t:?}: use \
                         cluster://HOST:PORT (the peer cluster's Locator), agent://HOST:PORT \
                         (one of its agents), s3://BUCKET/PREFIX or an absolute directory (a \
                         snapshot repository)"
                    ),
                ));
            }
        },
    };
    if let Target::Repository(_) = &target
        && interval < transport::cluster::MIN_SNAPSHOT_INTERVAL
    {
        return Err(invalid(
            what,
            format!(
                "VolumeReplicationClass {name}: {PARAM_INTERVAL} is shorter than {}s, too \
                 often for snapshots into a repository: replicate to an agent instead",
                transport::cluster::MIN_SNAPSHOT_INTERVAL.as_secs()
            ),
        ));
    }
    let secret = match (p.get(PARAM_SECRET_NAMESPACE), p.get(PARAM_SECRET_NAME)) {
        (Some(ns), Some(n)) if !ns.is_empty() && !n.is_empty() => Some((ns.clone(), n.clone())),
        (None, None) => None,
        _ => {
            return Err(invalid(
                what,
                format!(
                    "VolumeReplicationClass {name}: set both {PARAM_SECRET_NAME} and \
                     {PARAM_SECRET_NAMESPACE}, or neither"
                ),
            ));
        }
    };
    if matches!(target, Target::Repository(_)) && secret.is_none() {
        return Err(invalid(
            what,
            format!(
                "VolumeReplicationClass {name}: a repository target needs a secret with the \
                 repository's password (key `password`) and, for S3, AWS_ACCESS_KEY_ID and \
                 AWS_SECRET_ACCESS_KEY: name it in {PARAM_SECRET_NAME} and \
                 {PARAM_SECRET_NAMESPACE}"
            ),
        ));
    }
    let size = |key: &str| -> Result<u64, Invalid> {
        match p.get(key) {
            None => Ok(0),
            Some(s) => chunker::parse_size(s.trim_end_matches("/s")).map_err(|e| {
                invalid(
                    what,
                    format!("VolumeReplicationClass {name}: {key} {s:?}: {e}"),
                )
            }),
        }
    };
    let bwlimit = size(PARAM_BANDWIDTH)?;
    let require_point_in_time = match p.get(PARAM_CONSISTENCY).map(|s| s.trim()) {
        None | Some("point-in-time") => true,
        Some("crash-inconsistent") => false,
        Some(other) => {
            return Err(invalid(
                what,
                format!(
                    "VolumeReplicationClass {name}: {PARAM_CONSISTENCY} {other:?}: use \
                     point-in-time (the default: cycles without one fail and the volume is \
                     Degraded) or crash-inconsistent (such cycles complete, labelled so)"
                ),
            ));
        }
    };
    let chunk_size = match p.get(PARAM_CHUNK_SIZE) {
        None => 0,
        Some(s) => s
            .parse::<chunker::ChunkSize>()
            .map_err(|e| {
                invalid(
                    what,
                    format!("VolumeReplicationClass {name}: {PARAM_CHUNK_SIZE} {s:?}: {e}"),
                )
            })?
            .get(),
    };
    let snapshot_class = p
        .get(PARAM_SNAPSHOT_CLASS)
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty());
    if snapshot_class.is_some() && matches!(target, Target::Repository(_)) {
        return Err(invalid(
            what,
            format!(
                "VolumeReplicationClass {name}: {PARAM_SNAPSHOT_CLASS} is for replication to \
                 a peer; scheduled snapshots into a repository do not read CSI snapshots yet"
            ),
        ));
    }
    let freeze_timeout = match p.get(PARAM_FREEZE_TIMEOUT) {
        None => DEFAULT_FREEZE_TIMEOUT,
        Some(s) => mover_engine::node::parse_duration(s)
            .ok()
            .filter(|d| !d.is_zero() && *d <= Duration::from_secs(60))
            .ok_or_else(|| {
                invalid(
                    what,
                    format!(
                        "VolumeReplicationClass {name}: {PARAM_FREEZE_TIMEOUT} {s:?}: give a \
                         duration up to 60s (\"10s\", \"500ms\"): applications block while \
                         frozen"
                    ),
                )
            })?,
    };
    let container = p.get(super::hooks::PARAM_CONTAINER).map(String::as_str);
    let hook = |key: &str| {
        p.get(key)
            .map(|v| {
                super::hooks::parse(v, container)
                    .map_err(|e| invalid(what, format!("VolumeReplicationClass {name}: {key} {e}")))
            })
            .transpose()
    };
    let hooks = (
        hook(super::hooks::PARAM_PRE)?,
        hook(super::hooks::PARAM_POST)?,
    );
    if (hooks.0.is_some() || hooks.1.is_some()) && snapshot_class.is_none() {
        return Err(invalid(
            what,
            format!(
                "VolumeReplicationClass {name}: {} and {} bracket each cycle's \
                 VolumeSnapshot: set {PARAM_SNAPSHOT_CLASS} too",
                super::hooks::PARAM_PRE,
                super::hooks::PARAM_POST
            ),
        ));
    }
    Ok(ClassParams {
        interval,
        target,
        bwlimit,
        chunk_size,
        secret,
        require_point_in_time,
        snapshot_class,
        freeze_timeout,
        hooks,
    })
}

/// A repository target's own parameters.
fn repository_target(
    name: &str,
    url: &str,
    p: &std::collections::BTreeMap<String, String>,
) -> Result<RepositoryTarget, Invalid> {
    let what = "failed to validate parameters of volumeReplicationClass";
    let count = |key: &str| -> Result<u32, Invalid> {
        p.get(key).map_or(Ok(0), |v| {
            v.trim().parse().map_err(|_| {
                invalid(
                    what,
                    format!("VolumeReplicationClass {name}: {key} {v:?} is not a count"),
                )
            })
        })
    };
    let mut keep = [0; 5];
    for (k, key) in keep.iter_mut().zip(PARAM_KEEP) {
        *k = count(key)?;
    }
    if url.starts_with("s3://") && url.trim_start_matches("s3://").is_empty() {
        return Err(invalid(
            what,
            format!("VolumeReplicationClass {name}: {PARAM_TARGET} {url:?} names no bucket"),
        ));
    }
    Ok(RepositoryTarget {
        url: url.into(),
        keep,
        prune_every: count(PARAM_PRUNE_EVERY)?,
        s3_endpoint: p.get(PARAM_S3_ENDPOINT).cloned().unwrap_or_default(),
        s3_region: p.get(PARAM_S3_REGION).cloned().unwrap_or_default(),
    })
}

fn valid_host_port(s: &str) -> bool {
    s.rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && !h.contains('/') && p.parse::<u16>().is_ok())
}

/// A Go-style duration as csi-addons' schedulingInterval uses: "90s", "5m", "1h30m".
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let total = mover_engine::node::parse_duration(s)?;
    if total < Duration::from_secs(1) {
        return Err("shorter than 1s: cycles run at most once a second".into());
    }
    Ok(total)
}

/// Where a PersistentVolume's data is: the node, and the device or directory there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The node that holds (or has attached) the volume.
    pub node: String,
    /// The block device or directory on that node.
    pub path: String,
    /// The PersistentVolume's name: also the export name on the agent.
    pub pv: String,
    /// A block volume (`volumeMode: Block`): `path` may be the kubelet's directory of
    /// per-pod device entries, which the agent resolves to one.
    pub block: bool,
}

/// The kubelet's directory of CSI volumes on a node.
const KUBELET_CSI: &str = "/var/lib/kubelet/plugins/kubernetes.io/csi";

/// Finds where a bound PVC's volume lives: on the one node its node affinity selects
/// (any term, any label: `kubernetes.io/hostname` for local PVs, a CSI driver's own
/// topology key such as TopoLVM's, matched against the Node labels), else on the node
/// of its attached VolumeAttachment (CSI volumes whose affinity selects several nodes,
/// or none).
pub fn placement(
    pvc: &PersistentVolumeClaim,
    pv: &PersistentVolume,
    attachments: &[VolumeAttachment],
    nodes: &[Node],
) -> Result<Placement, Invalid> {
    let pv_name = kube::ResourceExt::name_any(pv);
    let spec = pv.spec.clone().unwrap_or_default();
    let block = pvc.spec.as_ref().and_then(|s| s.volume_mode.as_deref()) == Some("Block");
    let terms = spec
        .node_affinity
        .as_ref()
        .and_then(|a| a.required.as_ref())
        .map(|r| r.node_selector_terms.as_slice())
        .unwrap_or_default();
    let selected: Vec<String> = nodes
        .iter()
        .filter(|n| terms.iter().any(|t| term_selects(t, n)))
        .map(kube::ResourceExt::name_any)
        .collect();
    // Without Node objects to match (a cache not yet filled, a test), a hostname term
    // names its node by itself.
    let hostname = || {
        terms.iter().find_map(|t| {
            t.match_expressions.iter().flatten().find_map(|e| {
                (e.key == "kubernetes.io/hostname" && e.operator == "In")
                    .then(|| e.values.as_ref().and_then(|v| v.first().cloned()))
                    .flatten()
            })
        })
    };
    let affinity_node = match selected.as_slice() {
        [one] => Some(one.clone()),
        [] if nodes.is_empty() => hostname(),
        _ => None,
    };
    let attached_node = || {
        attachments
            .iter()
            .filter(|a| a.spec.source.persistent_volume_name.as_deref() == Some(&pv_name))
            .find(|a| a.status.as_ref().is_some_and(|s| s.attached))
            .map(|a| a.spec.node_name.clone())
    };
    let (path, node) = if let Some(local) = &spec.local {
        (local.path.clone(), affinity_node)
    } else if let Some(host) = &spec.host_path {
        (host.path.clone(), affinity_node)
    } else if let Some(csi) = &spec.csi {
        // The kubelet's per-volume paths: a block volume's device is bound under
        // volumeDevices/PV/dev (one entry per pod using it; the agent takes the first),
        // a file system is staged at DRIVER/sha256(volumeHandle)/globalmount (the
        // kubelet's layout since 1.24; before it, pv/PV/globalmount).
        let path = if block {
            format!("{KUBELET_CSI}/volumeDevices/{pv_name}/dev")
        } else {
            use sha2::Digest;
            let hash = sha2::Sha256::digest(csi.volume_handle.as_bytes());
            let hex: String = hash.iter().map(|b| format!("{b:02x}")).collect();
            format!("{KUBELET_CSI}/{}/{hex}/globalmount", csi.driver)
        };
        (path, affinity_node.or_else(attached_node))
    } else {
        return Err(invalid(
            "failed to find PVC",
            format!(
                "PersistentVolume {pv_name} is neither local, hostPath nor CSI: mover cannot \
                 find its data on a node"
            ),
        ));
    };
    let node = node.ok_or_else(|| {
        let affinity = match selected.len() {
            0 => "its node affinity selects no node".to_string(),
            n => format!(
                "its node affinity selects {n} nodes ({})",
                selected.join(", ")
            ),
        };
        invalid(
            "failed to find PVC",
            format!(
                "PersistentVolume {pv_name} is on no node: {affinity} and it has no attached \
                 VolumeAttachment; start a pod that uses the PersistentVolumeClaim so that it \
                 is attached"
            ),
        )
    })?;
    Ok(Placement {
        node,
        path,
        pv: pv_name,
        block,
    })
}

/// Whether a node selector term selects `node`: every expression on its labels and
/// every field (`metadata.name`) holds.
fn term_selects(term: &NodeSelectorTerm, node: &Node) -> bool {
    let labels = node.metadata.labels.as_ref();
    let name = kube::ResourceExt::name_any(node);
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    // An empty term selects nothing, as the scheduler reads it.
    (!exprs.is_empty() || !fields.is_empty())
        && exprs
            .iter()
            .all(|e| requirement_holds(e, labels.and_then(|l| l.get(&e.key)).map(String::as_str)))
        && fields
            .iter()
            .all(|f| f.key == "metadata.name" && requirement_holds(f, Some(name.as_str())))
}

/// A node selector requirement on `value` (the label's, or None where it is unset).
fn requirement_holds(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|w| w == v)),
        "NotIn" => value.is_none_or(|v| values.iter().all(|w| w != v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => match (
            value.and_then(number),
            values.first().and_then(|w| number(w)),
        ) {
            (Some(v), Some(w)) => (r.operator == "Gt" && v > w) || (r.operator == "Lt" && v < w),
            _ => false,
        },
        _ => false,
    }
}

/// What a volume whose node runs no agent pod fails.
pub const NO_AGENT: &str = "failed to find agent";

/// The address (HOST:PORT) of the running agent pod on `node`.
pub fn agent_on(node: &str, pods: &[Pod], port: u16) -> Result<String, Invalid> {
    let running = pods.iter().find(|p| {
        p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
            && p.metadata.deletion_timestamp.is_none()
    });
    let ip = running
        .and_then(|p| p.status.as_ref())
        .and_then(|s| s.pod_ip.clone())
        .ok_or_else(|| {
            invalid(
                NO_AGENT,
                format!(
                    "no running mover agent on node {node}: the agent DaemonSet must run there \
                     (check its node selector, tolerations and pod status)"
                ),
            )
        })?;
    Ok(if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    })
}

/// Everything the reconciler acts on for one `VolumeReplication`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    /// The relationship's name: the same on both clusters' agents.
    pub name: String,
    /// The agent of the node holding the volume: HOST:PORT.
    pub agent: String,
    /// That node: the name the agent's certificate carries.
    pub node: String,
    /// The export on that agent (named after the PersistentVolume).
    pub volume: String,
    /// The volume's device or directory on the node.
    pub path: String,
    /// A block volume (see [`Placement::block`]).
    pub block: bool,
    /// The peer's volume: agent://HOST:PORT/VOLUME, or the repository of a repository
    /// target.
    pub peer: String,
    /// Class parameters.
    pub params: ClassParams,
    /// What the spec asks for.
    pub state: ReplicationState,
    /// Resync by itself when this side is a fenced or split-brain secondary.
    pub auto_resync: bool,
    /// The token this side's agent presents to the peer's, and its version (the class
    /// secret's uid/resourceVersion): read by the reconciler, not here.
    pub peer_token: Option<(String, String)>,
    /// The peer cluster's CA (PEM), from the same secret (`ca.crt`).
    pub peer_ca: Option<String>,
    /// The peer credential (a name of the agents' `replication_token_file`) that alone
    /// may act on the relationship on this side, from the same secret
    /// (`peer-credential`; `None`: bound to none).
    pub peer_credential: Option<String>,
    /// Where each cycle's CSI VolumeSnapshot is taken from (the class names a
    /// VolumeSnapshotClass).
    pub snapshots: Option<Source>,
}

/// The resources a `VolumeReplication` names, as found (None: not found).
pub struct Inputs<'a> {
    /// spec.volumeReplicationClass.
    pub class: Option<&'a VolumeReplicationClass>,
    /// spec.dataSource.
    pub pvc: Option<&'a PersistentVolumeClaim>,
    /// The PVC's volume.
    pub pv: Option<&'a PersistentVolume>,
    /// Every VolumeAttachment (only read for attached volumes).
    pub attachments: &'a [VolumeAttachment],
    /// Every Node (their names and labels: what node affinities select).
    pub nodes: &'a [Node],
    /// The agent DaemonSet's pods.
    pub agents: &'a [Pod],
    /// The agents' gRPC port.
    pub agent_port: u16,
}

/// The relationship's name: replicationHandle, else NAMESPACE/NAME (RamenDR gives a
/// VolumeReplication the same name and namespace in both clusters).
pub fn relationship_name(vr: &VolumeReplication) -> String {
    relationship_name_of(
        vr.metadata.namespace.as_deref().unwrap_or("default"),
        &kube::ResourceExt::name_any(vr),
        &vr.spec.replication_handle,
    )
}

/// The relationship's name of VolumeReplication `namespace/name` with
/// `replicationHandle` `handle` (may be empty).
pub fn relationship_name_of(namespace: &str, name: &str, handle: &str) -> String {
    match handle.is_empty() {
        false => handle.to_string(),
        true => format!("{namespace}/{name}"),
    }
}

/// Checks the spec's immutable fields against what the relationship was set up from.
pub fn check_immutable(vr: &VolumeReplication) -> Result<(), Invalid> {
    let Some(r) = vr.status.as_ref().and_then(|s| s.relationship.as_ref()) else {
        return Ok(());
    };
    let VolumeReplicationSpec {
        volume_replication_class: class,
        data_source,
        ..
    } = &vr.spec;
    let changed = |field: &str, was: &str, now: &str| {
        invalid(
            "immutable field changed",
            format!(
                "spec.{field} changed from {was:?} to {now:?} after replication was set up; it \
                 is immutable: set it back to {was:?}, or delete this VolumeReplication and \
                 create a new one"
            ),
        )
    };
    if *class != r.volume_replication_class {
        return Err(changed(
            "volumeReplicationClass",
            &r.volume_replication_class,
            class,
        ));
    }
    if data_source.name != r.data_source_name {
        return Err(changed(
            "dataSource.name",
            &r.data_source_name,
            &data_source.name,
        ));
    }
    Ok(())
}

/// The desired relationship, or what to fix first.
pub fn desired(vr: &VolumeReplication, input: &Inputs<'_>) -> Result<Desired, Invalid> {
    let ns = vr.metadata.namespace.as_deref().unwrap_or("default");
    let ds = &vr.spec.data_source;
    if ds.kind != "PersistentVolumeClaim" || ds.api_group.as_deref().is_some_and(|g| !g.is_empty())
    {
        return Err(invalid(
            "unsupported datasource",
            format!(
                "spec.dataSource is a {} {}: mover replicates PersistentVolumeClaims (kind \
                 PersistentVolumeClaim, no apiGroup)",
                ds.api_group.as_deref().unwrap_or("core"),
                ds.kind
            ),
        ));
    }
    check_immutable(vr)?;
    let class_name = &vr.spec.volume_replication_class;
    let class = input.class.ok_or_else(|| {
        invalid(
            "failed to get volumeReplication class",
            format!(
                "VolumeReplicationClass {class_name:?} not found: create it, or name an \
                 existing one in spec.volumeReplicationClass"
            ),
        )
    })?;
    let params = class_params(class)?;
    let pvc_name = format!("{ns}/{}", ds.name);
    let pvc = input.pvc.ok_or_else(|| {
        invalid(
            "failed to find PVC",
            format!(
                "PersistentVolumeClaim {pvc_name} not found: create it, or fix spec.dataSource.name"
            ),
        )
    })?;
    let phase = pvc.status.as_ref().and_then(|s| s.phase.as_deref());
    let volume_name = pvc.spec.as_ref().and_then(|s| s.volume_name.as_deref());
    let (Some("Bound"), Some(volume_name)) = (phase, volume_name) else {
        return Err(invalid(
            "failed to find PVC",
            format!(
                "PersistentVolumeClaim {pvc_name} is not bound to a volume yet (phase {}): \
                 wait until it binds (a WaitForFirstConsumer class binds when a pod uses it)",
                phase.unwrap_or("unknown")
            ),
        ));
    };
    let pv = input.pv.ok_or_else(|| {
        invalid(
            "failed to find PVC",
            format!("PersistentVolume {volume_name} of PersistentVolumeClaim {pvc_name} not found"),
        )
    })?;
    let place = placement(pvc, pv, input.attachments, input.nodes)?;
    let agent = agent_on(&place.node, input.agents, input.agent_port)?;
    let snapshots = match &params.snapshot_class {
        None => None,
        Some(snapshot_class) => {
            let driver = pv.spec.as_ref().and_then(|s| s.csi.as_ref());
            let (Some(csi), true) = (driver, place.block) else {
                return Err(invalid(
                    "failed to validate parameters of volumeReplicationClass",
                    format!(
                        "VolumeReplicationClass {}: {PARAM_SNAPSHOT_CLASS} {snapshot_class}: \
                         PersistentVolumeClaim {pvc_name} is not a CSI volume of volumeMode \
                         Block; snapshots are read as block devices. Use a class without \
                         {PARAM_SNAPSHOT_CLASS} for it",
                        kube::ResourceExt::name_any(class)
                    ),
                ));
            };
            Some(Source {
                class: snapshot_class.clone(),
                driver: csi.driver.clone(),
                namespace: ns.to_string(),
                pvc: ds.name.clone(),
                storage_class: pvc.spec.as_ref().and_then(|s| s.storage_class_name.clone()),
            })
        }
    };
    Ok(Desired {
        name: relationship_name(vr),
        agent,
        node: place.node.clone(),
        peer: match &params.target {
            Target::Agent(hp) => format!("agent://{hp}/{}", place.pv),
            Target::Cluster(hp) => format!("cluster://{hp}"),
            Target::Repository(r) => r.url.clone(),
        },
        volume: place.pv,
        path: place.path,
        block: place.block,
        params,
        state: vr.spec.replication_state,
        auto_resync: vr.spec.auto_resync,
        peer_token: None,
        peer_ca: None,
        peer_credential: None,
        snapshots,
    })
}

/// Where a relationship read from snapshots is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// The VolumeSnapshotClass.
    pub class: String,
    /// The PVC's CSI driver.
    pub driver: String,
    /// The PVC's namespace and name.
    pub namespace: String,
    /// The PVC.
    pub pvc: String,
    /// The PVC's StorageClass (the clone's).
    pub storage_class: Option<String>,
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::crd::{RelationshipRef, VolumeReplicationClassSpec, VolumeReplicationStatus};
    use k8s_openapi::api::core::v1::TypedLocalObjectReference;
    use serde_json::json;

    /// Test resources, shared with the reconcile tests.
    pub(crate) fn class(params: &[(&str, &str)]) -> VolumeReplicationClass {
        VolumeReplicationClass::new(
            "mover",
            VolumeReplicationClassSpec {
                provisioner: "topolvm.io".into(),
                parameters: params
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            },
        )
    }

    pub(crate) fn vr(state: ReplicationState) -> VolumeReplication {
        let mut vr = VolumeReplication::new(
            "pg",
            VolumeReplicationSpec {
                volume_replication_class: "mover".into(),
                replication_state: state,
                data_source: TypedLocalObjectReference {
                    api_group: None,
                    kind: "PersistentVolumeClaim".into(),
                    name: "data".into(),
                },
                auto_resync: false,
                replication_handle: String::new(),
            },
        );
        vr.metadata.namespace = Some("app".into());
        vr.metadata.generation = Some(1);
        vr
    }

    pub(crate) fn pvc(bound: bool) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": "data", "namespace": "app"},
            "spec": {"volumeName": if bound { "pv-1" } else { "" }, "volumeMode": "Block"},
            "status": {"phase": if bound { "Bound" } else { "Pending" }}
        }))
        .unwrap()
    }

    pub(crate) fn local_pv() -> PersistentVolume {
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

    fn csi_pv() -> PersistentVolume {
        serde_json::from_value(json!({
            "metadata": {"name": "pv-1"},
            "spec": {"csi": {"driver": "rbd.csi.ceph.com", "volumeHandle": "0001-abc"}}
        }))
        .unwrap()
    }

    fn attachment(node: &str, attached: bool) -> VolumeAttachment {
        serde_json::from_value(json!({
            "metadata": {"name": format!("csi-{node}")},
            "spec": {"attacher": "rbd.csi.ceph.com", "nodeName": node,
                     "source": {"persistentVolumeName": "pv-1"}},
            "status": {"attached": attached}
        }))
        .unwrap()
    }

    pub(crate) fn agent_pod(node: &str, ip: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": format!("mover-agent-{node}"), "namespace": "mover-system"},
            "spec": {"nodeName": node, "containers": []},
            "status": {"phase": "Running", "podIP": ip}
        }))
        .unwrap()
    }

    fn inputs<'a>(
        class: Option<&'a VolumeReplicationClass>,
        pvc: Option<&'a PersistentVolumeClaim>,
        pv: Option<&'a PersistentVolume>,
        agents: &'a [Pod],
    ) -> Inputs<'a> {
        Inputs {
            class,
            pvc,
            pv,
            attachments: &[],
            nodes: &[],
            agents,
            agent_port: 7070,
        }
    }

    #[test]
    fn local_pv_resolves_to_its_node_agent_and_peer() {
        let c = class(&[
            ("schedulingInterval", "1m30s"),
            ("target", "agent://dr.example:7070"),
            ("bandwidth", "100M"),
            ("chunkSize", "256K"),
        ]);
        let (claim, pv) = (pvc(true), local_pv());
        let agents = [
            agent_pod("node-b", "10.0.0.2"),
            agent_pod("node-a", "10.0.0.1"),
        ];
        let d = desired(
            &vr(ReplicationState::Primary),
            &inputs(Some(&c), Some(&claim), Some(&pv), &agents),
        )
        .unwrap();
        assert_eq!(
            d,
            Desired {
                name: "app/pg".into(),
                agent: "10.0.0.1:7070".into(),
                node: "node-a".into(),
                volume: "pv-1".into(),
                path: "/dev/vg0/pv-1".into(),
                block: true,
                peer: "agent://dr.example:7070/pv-1".into(),
                params: ClassParams {
                    interval: Duration::from_secs(90),
                    target: Target::Agent("dr.example:7070".into()),
                    bwlimit: 100 << 20,
                    chunk_size: 256 << 10,
                    secret: None,
                    require_point_in_time: true,
                    snapshot_class: None,
                    freeze_timeout: DEFAULT_FREEZE_TIMEOUT,
                    hooks: (None, None),
                },
                state: ReplicationState::Primary,
                auto_resync: false,
                peer_token: None,
                peer_ca: None,
                peer_credential: None,
                snapshots: None,
            }
        );
    }

    #[test]
    fn a_snapshot_class_reads_csi_block_volumes_and_says_why_not_others() {
        let c = class(&[
            ("target", "agent://dr.example:7070"),
            (PARAM_SNAPSHOT_CLASS, "csi-rbd-snap"),
        ]);
        let agents = [
            agent_pod("node-c", "10.0.0.3"),
            agent_pod("node-a", "10.0.0.1"),
        ];
        let vas = [attachment("node-c", true)];
        let (claim, pv) = (pvc(true), csi_pv());
        let mut input = inputs(Some(&c), Some(&claim), Some(&pv), &agents);
        input.attachments = &vas;
        let d = desired(&vr(ReplicationState::Primary), &input).unwrap();
        assert_eq!(
            d.snapshots,
            Some(Source {
                class: "csi-rbd-snap".into(),
                driver: "rbd.csi.ceph.com".into(),
                namespace: "app".into(),
                pvc: "data".into(),
                storage_class: None,
            })
        );
        // A local PV has no CSI snapshots; a file system is not read as a device.
        let local = local_pv();
        let e = desired(
            &vr(ReplicationState::Primary),
            &inputs(Some(&c), Some(&claim), Some(&local), &agents),
        )
        .unwrap_err();
        assert!(
            e.detail.contains("is not a CSI volume of volumeMode Block"),
            "{e}"
        );
        let mut fs_claim = claim.clone();
        fs_claim.spec.as_mut().unwrap().volume_mode = Some("Filesystem".into());
        let mut input = inputs(Some(&c), Some(&fs_claim), Some(&pv), &agents);
        input.attachments = &vas;
        assert!(desired(&vr(ReplicationState::Primary), &input).is_err());
        // Not for repository targets yet.
        let repo = class(&[
            ("target", "/srv/repo"),
            (PARAM_SNAPSHOT_CLASS, "csi-rbd-snap"),
            (PARAM_SECRET_NAME, "s"),
            (PARAM_SECRET_NAMESPACE, "n"),
        ]);
        let e = class_params(&repo).unwrap_err();
        assert!(e.detail.contains("do not read CSI snapshots yet"), "{e}");
    }

    #[test]
    fn attached_csi_volume_is_on_the_node_of_its_attachment() {
        let (claim, pv) = (pvc(true), csi_pv());
        let vas = [attachment("node-x", false), attachment("node-c", true)];
        let p = placement(&claim, &pv, &vas, &[]).unwrap();
        assert_eq!(p.node, "node-c");
        assert_eq!(
            p.path,
            "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/pv-1/dev"
        );
        let e = placement(&claim, &pv, &vas[..1], &[]).unwrap_err();
        assert!(e.detail.contains("is on no node"), "{e}");
        // A file system: the kubelet's staging directory, named by the volume handle's
        // SHA-256 (`printf 0001-abc | sha256sum`).
        let mut fs_claim = claim.clone();
        fs_claim.spec.as_mut().unwrap().volume_mode = Some("Filesystem".into());
        let p = placement(&fs_claim, &pv, &vas, &[]).unwrap();
        assert!(!p.block);
        assert_eq!(
            p.path,
            "/var/lib/kubelet/plugins/kubernetes.io/csi/rbd.csi.ceph.com/\
             67f422977015836e425cb2f4ab79118b5bc14dcab64698c1d1040d1b77359fb3/globalmount"
        );
    }

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        let labels: serde_json::Map<String, serde_json::Value> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), json!(v)))
            .collect();
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
    }

    fn pv_with_affinity(source: serde_json::Value, terms: serde_json::Value) -> PersistentVolume {
        let mut spec = json!({"nodeAffinity": {"required": {"nodeSelectorTerms": terms}}});
        spec.as_object_mut()
            .unwrap()
            .extend(source.as_object().unwrap().clone());
        serde_json::from_value(json!({"metadata": {"name": "pv-1"}, "spec": spec})).unwrap()
    }

    #[test]
    fn a_volume_is_on_the_one_node_any_affinity_term_selects() {
        let nodes = [
            node(
                "node-a",
                &[
                    ("kubernetes.io/hostname", "node-a"),
                    ("topology.topolvm.io/node", "a"),
                    ("zone", "z1"),
                ],
            ),
            node(
                "node-b",
                &[
                    ("kubernetes.io/hostname", "node-b"),
                    ("topology.topolvm.io/node", "b"),
                    ("zone", "z1"),
                ],
            ),
            node(
                "node-c",
                &[
                    ("kubernetes.io/hostname", "node-c"),
                    ("zone", "z2"),
                    ("disks", "8"),
                ],
            ),
        ];
        let csi = json!({"csi": {"driver": "topolvm.io", "volumeHandle": "h"}});
        let claim = pvc(true);
        // TopoLVM: its own topology key, no VolumeAttachment (attachRequired: false).
        let topolvm = pv_with_affinity(
            csi.clone(),
            json!([{"matchExpressions": [
                {"key": "topology.topolvm.io/node", "operator": "In", "values": ["b"]}
            ]}]),
        );
        assert_eq!(
            placement(&claim, &topolvm, &[], &nodes).unwrap().node,
            "node-b"
        );
        // The second term selects; the first selects nothing.
        let second = pv_with_affinity(
            csi.clone(),
            json!([
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z9"]}]},
                {"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["z1"]},
                                      {"key": "disks", "operator": "Gt", "values": ["4"]}]}
            ]),
        );
        assert_eq!(
            placement(&claim, &second, &[], &nodes).unwrap().node,
            "node-c"
        );
        // By field: metadata.name.
        let by_name = pv_with_affinity(
            csi.clone(),
            json!([{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": ["node-a"]}
            ]}]),
        );
        assert_eq!(
            placement(&claim, &by_name, &[], &nodes).unwrap().node,
            "node-a"
        );
        // A zone selects two nodes: the attachment says which one has it.
        let zonal = pv_with_affinity(
            csi,
            json!([{"matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["z1"]},
                {"key": "topology.topolvm.io/node", "operator": "Exists"}
            ]}]),
        );
        let e = placement(&claim, &zonal, &[], &nodes).unwrap_err();
        assert!(e.detail.contains("selects 2 nodes (node-a, node-b)"), "{e}");
        let va = attachment("node-b", true);
        assert_eq!(
            placement(&claim, &zonal, &[va], &nodes).unwrap().node,
            "node-b"
        );
        // A local PV whose term selects no node says so.
        let nowhere = pv_with_affinity(
            json!({"local": {"path": "/mnt/disks/x"}}),
            json!([{"matchExpressions": [
                {"key": "kubernetes.io/hostname", "operator": "In", "values": ["gone"]}
            ]}]),
        );
        let e = placement(&claim, &nowhere, &[], &nodes).unwrap_err();
        assert!(e.detail.contains("selects no node"), "{e}");
    }

    #[test]
    fn bad_inputs_say_what_to_fix() {
        let good = class(&[("target", "agent://dr:7070")]);
        let (bound, pv) = (pvc(true), local_pv());
        let agents = [agent_pod("node-a", "10.0.0.1")];
        let v = vr(ReplicationState::Primary);
        let err = |i: Inputs<'_>| desired(&v, &i).unwrap_err().to_string();

        let e = err(inputs(None, Some(&bound), Some(&pv), &agents));
        assert!(
            e.contains("VolumeReplicationClass \"mover\" not found: create it"),
            "{e}"
        );
        let unbound = pvc(false);
        let e = err(inputs(Some(&good), Some(&unbound), Some(&pv), &agents));
        assert!(
            e.contains("app/data is not bound to a volume yet (phase Pending)"),
            "{e}"
        );
        let e = err(inputs(Some(&good), None, None, &agents));
        assert!(
            e.contains("PersistentVolumeClaim app/data not found"),
            "{e}"
        );
        let e = err(inputs(Some(&good), Some(&bound), Some(&pv), &agents[..0]));
        assert!(e.contains("no running mover agent on node node-a"), "{e}");
        let ftp = class(&[("target", "ftp://bucket/prefix")]);
        let e = err(inputs(Some(&ftp), Some(&bound), Some(&pv), &agents));
        assert!(e.contains("unknown target \"ftp://bucket/prefix\""), "{e}");
        let s3 = class(&[("target", "s3://bucket/prefix")]);
        let e = err(inputs(Some(&s3), Some(&bound), Some(&pv), &agents));
        assert!(e.contains("a repository target needs a secret"), "{e}");
        let secret_ns = (PARAM_SECRET_NAMESPACE, "mover-system");
        let secret_name = (PARAM_SECRET_NAME, "s3");
        let half = class(&[("target", "s3://bucket/prefix"), secret_name]);
        let e = err(inputs(Some(&half), Some(&bound), Some(&pv), &agents));
        assert!(e.contains("or neither"), "{e}");
        let often = class(&[
            ("target", "s3://bucket/prefix"),
            ("schedulingInterval", "30s"),
            secret_ns,
            secret_name,
        ]);
        let e = err(inputs(Some(&often), Some(&bound), Some(&pv), &agents));
        assert!(e.contains("too often for snapshots"), "{e}");
        let bad_keep = class(&[
            ("target", "s3://bucket/prefix"),
            ("keepDaily", "seven"),
            secret_ns,
            secret_name,
        ]);
        let e = err(inputs(Some(&bad_keep), Some(&bound), Some(&pv), &agents));
        assert!(e.contains("keepDaily \"seven\" is not a count"), "{e}");
        let good_s3 = class(&[
            ("target", "s3://bucket/prefix"),
            ("schedulingInterval", "1h"),
            ("keepLast", "3"),
            ("keepDaily", "7"),
            ("pruneEvery", "24"),
            ("s3Endpoint", "http://minio:9000"),
            secret_ns,
            secret_name,
        ]);
        let d = desired(
            &v,
            &inputs(Some(&good_s3), Some(&bound), Some(&pv), &agents),
        )
        .unwrap();
        assert_eq!(
            d.params.target,
            Target::Repository(RepositoryTarget {
                url: "s3://bucket/prefix".into(),
                keep: [3, 0, 7, 0, 0],
                prune_every: 24,
                s3_endpoint: "http://minio:9000".into(),
                s3_region: String::new(),
            })
        );
        assert_eq!(
            d.params.secret,
            Some(("mover-system".to_string(), "s3".to_string()))
        );
        assert_eq!(d.peer, "s3://bucket/prefix");
        let none = class(&[]);
        let e = err(inputs(Some(&none), Some(&bound), Some(&pv), &agents));
        assert!(e.contains("has no target parameter"), "{e}");
        let fast = class(&[
            ("target", "agent://dr:7070"),
            ("schedulingInterval", "10ms"),
        ]);
        let e = err(inputs(Some(&fast), Some(&bound), Some(&pv), &agents));
        assert!(e.contains("shorter than 1s"), "{e}");
        let sloppy = class(&[
            ("target", "agent://dr:7070"),
            ("consistency", "best-effort"),
        ]);
        let e = err(inputs(Some(&sloppy), Some(&bound), Some(&pv), &agents));
        assert!(
            e.contains("consistency \"best-effort\": use point-in-time"),
            "{e}"
        );
        let torn = class(&[
            ("target", "agent://dr:7070"),
            ("consistency", "crash-inconsistent"),
        ]);
        let d = desired(&v, &inputs(Some(&torn), Some(&bound), Some(&pv), &agents)).unwrap();
        assert!(!d.params.require_point_in_time);

        let mut moved = v.clone();
        moved.spec.volume_replication_class = "other".into();
        moved.status = Some(VolumeReplicationStatus {
            relationship: Some(RelationshipRef {
                volume_replication_class: "mover".into(),
                data_source_name: "data".into(),
                ..Default::default()
            }),
            ..Default::default()
        });
        let e = desired(
            &moved,
            &inputs(Some(&good), Some(&bound), Some(&pv), &agents),
        )
        .unwrap_err();
        assert_eq!(e.what, "immutable field changed");
        assert!(
            e.detail
                .contains("spec.volumeReplicationClass changed from \"mover\" to \"other\"")
        );
    }

    #[test]
    fn intervals_parse_like_go_durations() {
        assert_eq!(parse_interval("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_interval("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse_interval("1500ms"), Ok(Duration::from_millis(1500)));
        assert!(
            parse_interval("5 minutes")
                .unwrap_err()
                .contains("unknown unit")
        );
        assert!(parse_interval("").is_err());
        assert_eq!(relationship_name(&vr(ReplicationState::Primary)), "app/pg");
    }
}
