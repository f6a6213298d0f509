//! Conditions and status, set exactly as csi-addons sets them
//! (internal/controller/replication.storage/status.go and volumereplication_controller.go
//! of kubernetes-csi-addons), so RamenDR reads mover's resources as it reads csi-addons'.
//!
//! Every function here is pure: the caller passes the time and the generation. Each
//! condition carries the generation it was computed for, and a condition's
//! `lastTransitionTime` moves only when its status changes (csi-addons'
//! `setStatusCondition`).

use crate::crd::{ReplicationState, State, VolumeReplicationStatus};
// A primary is late past this many intervals: the agent's bound, and the controller's.
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use std::time::Duration;
use transport::cluster::LATE_INTERVALS;

/// Condition types.
pub mod types {
    /// The requested operation (promote, demote, resync) finished.
    pub const COMPLETED: &str = "Completed";
    /// The volume is not usable as asked.
    pub const DEGRADED: &str = "Degraded";
    /// A resync is running.
    pub const RESYNCING: &str = "Resyncing";
    /// The inputs (class, PVC, PV, node, agent) are usable.
    pub const VALIDATED: &str = "Validated";
    /// The primary ships cycles to the secondary.
    pub const REPLICATING: &str = "Replicating";
    /// mover: the last applied cycle is of one point in time.
    pub const POINT_IN_TIME: &str = "PointInTime";
}

/// Condition reasons (csi-addons' names).
pub mod reasons {
    #![allow(missing_docs)]
    pub const PROMOTED: &str = "Promoted";
    pub const DEMOTED: &str = "Demoted";
    pub const FAILED_TO_PROMOTE: &str = "FailedToPromote";
    pub const FAILED_TO_DEMOTE: &str = "FailedToDemote";
    pub const ERROR: &str = "Error";
    pub const VOLUME_DEGRADED: &str = "VolumeDegraded";
    pub const HEALTHY: &str = "Healthy";
    pub const RESYNC_TRIGGERED: &str = "ResyncTriggered";
    pub const FAILED_TO_RESYNC: &str = "FailedToResync";
    pub const NOT_RESYNCING: &str = "NotResyncing";
    pub const PREREQUISITE_MET: &str = "PrerequisiteMet";
    pub const PREREQUISITE_NOT_MET: &str = "PrerequisiteNotMet";
    pub const REPLICATING: &str = "Replicating";
    pub const NOT_REPLICATING: &str = "NotReplicating";
    /// mover: cycles fail for want of a point in time (see [`super::types::POINT_IN_TIME`]).
    pub const NO_POINT_IN_TIME: &str = "NoPointInTime";
    /// mover: reasons of the PointInTime condition, from the last applied cycle.
    pub const POINT_IN_TIME: &str = "PointInTime";
    pub const CRASH_INCONSISTENT: &str = "CrashInconsistent";
    pub const FILE_CONSISTENT: &str = "FileConsistent";
    pub const NO_CYCLE: &str = "NoCycle";
    /// mover: the controller cannot reach the agent (Degraded and Replicating, once the
    /// requested state was reached: Completed stays as it was).
    pub const UNREACHABLE: &str = "Unreachable";
}

/// Condition messages (csi-addons' texts, after "volume ").
mod messages {
    pub const PROMOTED: &str = "is promoted to primary and replicating to secondary";
    pub const HEALTHY: &str = "is healthy";
    pub const NOT_RESYNCING: &str = "is not resyncing";
    pub const VALIDATED: &str = "is validated and met all prerequisites";
    pub const FAILED_PROMOTED: &str = "failed to promote";
    pub const FAILED_DEMOTED: &str = "failed to demote";
    pub const FAILED_PRECONDITION: &str = "failed to meet prerequisite";
    pub const DEMOTED: &str = "is demoted to secondary";
    pub const DEGRADED: &str = "is degraded";
    pub const RESYNC_TRIGGERED: &str = "is resyncing changes from primary to secondary";
    pub const RESYNC_FAILED: &str = "failed to resync";
    pub const REPLICATING: &str = "is replicating";
    pub const NOT_REPLICATING: &str = "is not replicating";
    pub const UNKNOWN_REPLICATION_STATE: &str = "replication status is unknown";
}

/// The conditions of one resource being recomputed at one generation and time.
pub struct Conditions<'a> {
    list: &'a mut Vec<Condition>,
    generation: i64,
    now: Time,
    /// "volume" for a PVC data source (csi-addons' getSource).
    source: &'static str,
}

impl<'a> Conditions<'a> {
    /// Edits `list` for a resource at `generation` whose dataSource is of `kind`.
    pub fn new(list: &'a mut Vec<Condition>, generation: i64, kind: &str, now: Time) -> Self {
        let source = if kind == "PersistentVolumeClaim" {
            "volume"
        } else {
            ""
        };
        Conditions {
            list,
            generation,
            now,
            source,
        }
    }

    /// csi-addons' setStatusCondition: add, or update in place; the transition time
    /// moves only when the status changes. Every message is put in the reader's words
    /// ([`plain`]).
    fn set(&mut self, type_: &str, status: &str, reason: &str, message: String) {
        let new = Condition {
            type_: type_.into(),
            status: status.into(),
            reason: reason.into(),
            message: plain(&message),
            observed_generation: Some(self.generation),
            last_transition_time: self.now.clone(),
        };
        match self.list.iter_mut().find(|c| c.type_ == type_) {
            None => self.list.push(new),
            Some(old) => {
                if old.status != new.status {
                    old.status = new.status;
                    old.last_transition_time = new.last_transition_time;
                }
                old.message = new.message;
                old.reason = new.reason;
                old.observed_generation = new.observed_generation;
            }
        }
    }

    /// Drops a condition (csi-addons' removeCondition).
    pub fn remove(&mut self, type_: &str) {
        self.list.retain(|c| c.type_ != type_);
    }

    fn msg(&self, m: &str) -> String {
        format!("{} {m}", self.source)
    }

    fn not_resyncing(&mut self) {
        let m = self.msg(messages::NOT_RESYNCING);
        self.set(types::RESYNCING, "False", reasons::NOT_RESYNCING, m);
    }

    /// Marks the inputs valid. csi-addons sets this only inside a failed promotion;
    /// mover sets it on every successful validation so that it always carries the
    /// current generation (RamenDR checks every condition's generation).
    pub fn validated(&mut self) {
        let m = self.msg(messages::VALIDATED);
        self.set(types::VALIDATED, "True", reasons::PREREQUISITE_MET, m);
    }

    /// setPromotedCondition.
    pub fn promoted(&mut self) {
        let m = self.msg(messages::PROMOTED);
        self.set(types::COMPLETED, "True", reasons::PROMOTED, m);
        let m = self.msg(messages::HEALTHY);
        self.set(types::DEGRADED, "False", reasons::HEALTHY, m);
        self.not_resyncing();
    }

    /// Replication is broken (late, a peer or Locator unreachable, fenced or split):
    /// Degraded, saying what is wrong (and what to do, where the caller knows).
    pub fn degraded(&mut self, detail: &str) {
        self.degraded_for(reasons::VOLUME_DEGRADED, detail);
    }

    /// Degraded=True with `reason`, saying `detail`.
    fn degraded_for(&mut self, reason: &str, detail: &str) {
        let m = format!("{} {}: {detail}", self.source, messages::DEGRADED);
        self.set(types::DEGRADED, "True", reason, m);
    }

    /// Trouble once the requested state was reached (an agent that stopped answering):
    /// Completed stays as it is, since it reports the state change and that happened;
    /// Degraded (and, on a primary, Replicating) say what is wrong now, with `reason`.
    pub fn trouble(&mut self, reason: &str, detail: &str, primary: bool) {
        // What stands (Completed, Resyncing) stands at this generation too: RamenDR
        // reads only conditions of the current one.
        for c in self.list.iter_mut() {
            c.observed_generation = Some(self.generation);
        }
        self.degraded_for(reason, detail);
        if primary {
            let m = format!("{} {}: {detail}", self.source, messages::NOT_REPLICATING);
            self.set(types::REPLICATING, "False", reason, m);
        }
    }

    /// setFailedPromotionCondition.
    pub fn failed_promotion(&mut self, completed: &str, detail: &str) {
        self.set(
            types::COMPLETED,
            "False",
            reasons::FAILED_TO_PROMOTE,
            completed.into(),
        );
        let m = format!("{} {}: {detail}", self.source, messages::FAILED_PROMOTED);
        self.set(types::DEGRADED, "True", reasons::ERROR, m);
        self.not_resyncing();
        self.validated();
    }

    /// setFailedValidationCondition, with Completed's reason following the requested
    /// state (csi-addons validates only on enable, always a promotion).
    pub fn failed_validation(&mut self, state: ReplicationState, degraded: &str, detail: &str) {
        let (reason, what) = match state {
            ReplicationState::Primary => (reasons::FAILED_TO_PROMOTE, messages::FAILED_PROMOTED),
            ReplicationState::Secondary => (reasons::FAILED_TO_DEMOTE, messages::FAILED_DEMOTED),
            ReplicationState::Resync => (reasons::FAILED_TO_RESYNC, messages::RESYNC_FAILED),
        };
        let m = self.msg(what);
        self.set(types::COMPLETED, "False", reason, m);
        self.set(types::DEGRADED, "True", reasons::ERROR, degraded.into());
        self.not_resyncing();
        self.not_validated(detail);
    }

    /// Validated=False, saying what to fix.
    pub fn not_validated(&mut self, detail: &str) {
        let m = format!("{}: {detail}", messages::FAILED_PRECONDITION);
        self.set(types::VALIDATED, "False", reasons::PREREQUISITE_NOT_MET, m);
    }

    /// setNotDegradedCondition: demoted and in sync.
    pub fn not_degraded(&mut self) {
        let m = self.msg(messages::DEMOTED);
        self.set(types::DEGRADED, "False", reasons::HEALTHY, m);
        self.not_resyncing();
    }

    /// setDemotedCondition.
    pub fn demoted(&mut self) {
        let m = self.msg(messages::DEMOTED);
        self.set(types::COMPLETED, "True", reasons::DEMOTED, m);
        let m = self.msg(messages::DEGRADED);
        self.set(types::DEGRADED, "True", reasons::VOLUME_DEGRADED, m);
        self.not_resyncing();
    }

    /// setFailedDemotionCondition.
    pub fn failed_demotion(&mut self, completed: &str, detail: &str) {
        self.set(
            types::COMPLETED,
            "False",
            reasons::FAILED_TO_DEMOTE,
            completed.into(),
        );
        let m = format!("{} {}: {detail}", self.source, messages::FAILED_DEMOTED);
        self.set(types::DEGRADED, "True", reasons::ERROR, m);
        self.not_resyncing();
    }

    /// setResyncCondition.
    pub fn resync(&mut self) {
        let m = self.msg(messages::DEMOTED);
        self.set(types::COMPLETED, "True", reasons::DEMOTED, m);
        let m = self.msg(messages::DEGRADED);
        self.set(types::DEGRADED, "True", reasons::VOLUME_DEGRADED, m);
        let m = self.msg(messages::RESYNC_TRIGGERED);
        self.set(types::RESYNCING, "True", reasons::RESYNC_TRIGGERED, m);
    }

    /// setFailedResyncCondition.
    pub fn failed_resync(&mut self, completed: &str, detail: &str) {
        self.set(
            types::COMPLETED,
            "False",
            reasons::FAILED_TO_RESYNC,
            completed.into(),
        );
        let m = format!("{} {}: {detail}", self.source, messages::RESYNC_FAILED);
        self.set(types::DEGRADED, "True", reasons::ERROR, m);
        let m = self.msg(messages::NOT_RESYNCING);
        self.set(types::RESYNCING, "False", reasons::FAILED_TO_RESYNC, m);
    }

    /// setFailureCondition: the failure of whatever `state` asked for.
    pub fn failure(&mut self, state: ReplicationState, completed: &str, detail: &str) {
        match state {
            ReplicationState::Primary => self.failed_promotion(completed, detail),
            ReplicationState::Secondary => self.failed_demotion(completed, detail),
            ReplicationState::Resync => self.failed_resync(completed, detail),
        }
    }

    /// setReplicationCondition from the primary's health; broken replication makes the
    /// volume Degraded too (csi-addons' Degraded: "not usable as asked"), so that
    /// Degraded never says Healthy while Replicating says why not.
    pub fn replicating(&mut self, health: Health, detail: &str) {
        let (status, reason, what) = match health {
            Health::Healthy => ("True", reasons::REPLICATING, messages::REPLICATING),
            Health::Waiting => ("False", reasons::NOT_REPLICATING, messages::NOT_REPLICATING),
            Health::Degraded => {
                self.degraded(detail);
                ("False", reasons::NOT_REPLICATING, messages::NOT_REPLICATING)
            }
            Health::Unknown => (
                "Unknown",
                reasons::REPLICATING,
                messages::UNKNOWN_REPLICATION_STATE,
            ),
        };
        let m = format!("{} {what}: {detail}", self.source);
        self.set(types::REPLICATING, status, reason, m);
    }

    /// mover's PointInTime condition, from the consistency of the last applied cycle
    /// ("" when none is): what RamenDR and `kubectl get` show beside Completed. Where
    /// the agent refused the last run for want of a point in time (`no_point_in_time`),
    /// Degraded too, with its sentence (`last_error`) saying what is missing.
    pub fn consistency(&mut self, consistency: &str, last_error: &str, no_point_in_time: bool) {
        use mover_engine::node::point_in_time::{
            CRASH_INCONSISTENT, FILE_CONSISTENT, POINT_IN_TIME,
        };
        let (status, reason, what) = match consistency {
            POINT_IN_TIME => ("True", reasons::POINT_IN_TIME, "the volume at one instant"),
            CRASH_INCONSISTENT => (
                "False",
                reasons::CRASH_INCONSISTENT,
                "read live, its blocks from different instants",
            ),
            FILE_CONSISTENT => (
                "False",
                reasons::FILE_CONSISTENT,
                "a file tree, each file as it was when read",
            ),
            "" => ("Unknown", reasons::NO_CYCLE, "none yet"),
            _ => ("Unknown", reasons::NO_CYCLE, "of an unknown consistency"),
        };
        let m = format!("{}'s last applied cycle: {what}", self.source);
        self.set(types::POINT_IN_TIME, status, reason, m);
        if no_point_in_time {
            let m = format!("{} {}: {last_error}", self.source, messages::DEGRADED);
            self.set(types::DEGRADED, "True", reasons::NO_POINT_IN_TIME, m);
        }
    }
}

/// `status.lastSyncConsistency` from an agent's report ("": no cycle yet).
pub fn last_sync_consistency(consistency: &str) -> Option<String> {
    (!consistency.is_empty()).then(|| consistency.to_string())
}

/// How a primary's replication is doing (csi-addons' GetVolumeReplicationInfo status).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Health {
    /// Cycles complete.
    Healthy,
    /// Not replicating, and nothing broken: the first cycle under way, or paused.
    Waiting,
    /// Broken: cycles fail or are late, or the relationship is fenced or split.
    Degraded,
    /// The agent could not be asked.
    Unknown,
}

/// The condition reason an agent's failure gives a volume whose requested state was
/// reached: Unreachable when the agent did not answer, else Error.
pub fn agent_reason(e: &crate::agents::AgentError) -> &'static str {
    match e.is_unreachable() {
        true => reasons::UNREACHABLE,
        false => reasons::ERROR,
    }
}

/// The health of a primary from its agent's relationship state at `now`, and the detail
/// shown. A last cycle older than [`LATE_INTERVALS`] intervals is broken whatever the
/// agent says (the controller's clock judges what the status shows).
pub fn health(s: &transport::control::Status, now: &Time, interval: Duration) -> (Health, String) {
    let last_sync = s
        .last_cycle
        .as_ref()
        .filter(|c| c.point_in_time_ms > 0)
        .map(|c| time_ms(c.point_in_time_ms));
    let bound = interval.as_secs_f64() * LATE_INTERVALS as f64;
    let late = rpo(last_sync.as_ref(), now).is_some_and(|r| r > bound);
    // The agent's sentence for lateness names the RPO, which grows each second: said
    // as the last sync time instead, the message stays the same while nothing else
    // changes, and the status is not rewritten at every look.
    let agents_late = s.last_error_kind() == transport::control::ErrorKind::Late;
    let error = match &last_sync {
        Some(t) if agents_late || (late && s.last_error.is_empty()) => late_since(t, interval),
        _ => s.last_error.clone(),
    };
    use transport::states::RelationshipState as S;
    let state = match s.relationship_state() {
        Some(S::Replicating) if late => Some(S::Degraded),
        state => state,
    };
    let word = match state {
        Some(known) => known.name(),
        None => s.state.as_str(),
    };
    let detail = if error.is_empty() {
        format!("relationship {word}")
    } else {
        format!("relationship {word}: {error}")
    };
    let h = match state {
        Some(S::Replicating) => Health::Healthy,
        Some(S::Resyncing | S::Paused) => Health::Waiting,
        _ => Health::Degraded,
    };
    (h, detail)
}

/// Why a primary is late, naming its last sync (to the second, as the status shows it).
fn late_since(last_sync: &Time, interval: Duration) -> String {
    let whole =
        k8s_openapi::jiff::Timestamp::from_second(last_sync.0.as_second()).unwrap_or(last_sync.0);
    format!(
        "no cycle has completed since {whole}, more than {LATE_INTERVALS} intervals ({}s) ago",
        interval.as_secs() * LATE_INTERVALS
    )
}

/// `status.rpoSeconds`: `now` minus the last sync's point in time, to a tenth of a
/// second (none before a first sync). Computed when the status is written, never copied
/// from an agent: an agent's number is as old as its answer, and an agent that no
/// longer answers would leave it standing still while the RPO grows.
pub fn rpo(last_sync: Option<&Time>, now: &Time) -> Option<f64> {
    let age = now.0.duration_since(last_sync?.0).as_secs_f64().max(0.0);
    Some((age * 10.0).round() / 10.0)
}

/// Whether the state `state` asks for was reached already: the status is in it and
/// Completed says that state change completed. Later trouble does not undo a completed
/// state change, nor does a later generation asking for the same state.
pub fn completed(status: &VolumeReplicationStatus, state: ReplicationState) -> bool {
    let reason = match state {
        ReplicationState::Primary => reasons::PROMOTED,
        ReplicationState::Secondary | ReplicationState::Resync => reasons::DEMOTED,
    };
    status.state == Some(reached(state))
        && status
            .conditions
            .iter()
            .any(|c| c.type_ == types::COMPLETED && c.status == "True" && c.reason == reason)
}

/// A message in the words of the VolumeReplication's reader: the peer cluster's Locator
/// by that name (not as the `agent://` URL an agent dials it by), a fenced side's remedy
/// as the spec fields to set (not a CLI command), no CLI flags, and each cause once (an
/// error's source chain may repeat one: "tcp connect error: tcp connect error").
pub fn plain(text: &str) -> String {
    let mut s = text.to_string();
    // agent://mover-locator@HOST:PORT/- is how an agent names the Locator it dials.
    let locator = format!("agent://{}@", mover_engine::remote::LOCATOR_NAME);
    while let Some(at) = s.find(&locator) {
        let rest = &s[at + locator.len()..];
        let Some(end) = rest.find("/-") else { break };
        let authority = rest[..end].to_string();
        let start = if s[..at].ends_with("agent ") {
            at - "agent ".len()
        } else {
            at
        };
        let stop = at + locator.len() + end + "/-".len();
        s.replace_range(
            start..stop,
            &format!("the peer cluster's Locator at {authority}"),
        );
    }
    // agent://NODE@HOST:PORT/EXPORT is how an agent names a peer's agent it dials.
    let peer = "agent agent://";
    while let Some(at) = s.find(peer) {
        let rest = &s[at + peer.len()..];
        let end = rest.find([' ', ':']).map_or(rest.len(), |e| {
            // HOST:PORT holds a colon: the URL ends at the export's end.
            rest[e..].find([' ', ',']).map_or(rest.len(), |f| e + f)
        });
        let url = rest[..end].trim_end_matches(':').to_string();
        let (node, address) = match url.split_once('@') {
            Some((node, addr)) => (node.to_string(), addr),
            None => (String::new(), url.as_str()),
        };
        let address = address.split('/').next().unwrap_or(address).to_string();
        let named = if node.is_empty() {
            format!("the peer's agent at {address}")
        } else {
            format!("the peer's agent on node {node} ({address})")
        };
        let stop = at + peer.len() + url.len();
        s.replace_range(at..stop, &named);
    }
    // The agents' remedy for a fenced side, as its CLI user would apply it.
    const REMEDY: &str = "set `replicationState: secondary` with `autoResync: true` in this side's \
         VolumeReplication";
    s = s.replace(". Resync from the current primary", &format!(": {REMEDY}"));
    let cli = "run `mover replicate resync ";
    while let Some(at) = s.find(cli) {
        let Some(end) = s[at + cli.len()..].find('`') else {
            break;
        };
        let mut stop = at + cli.len() + end + 1;
        if s[stop..].starts_with(" here") {
            stop += " here".len();
        }
        s.replace_range(at..stop, REMEDY);
    }
    for (flags, api) in [
        (
            " (is the agent running and reachable? rerunning continues the transfer)",
            "",
        ),
        (
            " (check --token-file / MOVER_TOKEN, or the TLS certificates)",
            " (check the token and ca.crt of the class's replication secret)",
        ),
    ] {
        s = s.replace(flags, api);
    }
    let mut parts: Vec<&str> = Vec::new();
    for part in s.split(": ") {
        if parts.last() != Some(&part) {
            parts.push(part);
        }
    }
    parts.join(": ")
}

/// csi-addons' GetReplicationState: the state a successful operation reaches.
pub fn reached(state: ReplicationState) -> State {
    match state {
        ReplicationState::Primary => State::Primary,
        ReplicationState::Secondary | ReplicationState::Resync => State::Secondary,
    }
}

/// The status message after a successful operation (csi-addons' texts).
pub fn marked(state: ReplicationState) -> String {
    match state {
        ReplicationState::Resync => "volume is marked for resyncing".into(),
        s => format!("volume is marked {}", s.as_str()),
    }
}

/// Copies what a primary's agent reports into the status: last sync, epoch, progress;
/// the RPO from the last sync at `now` ([`rpo`]). csi-addons clears
/// lastSyncDuration/Bytes when a new sync time has none.
pub fn apply_report(
    status: &mut VolumeReplicationStatus,
    s: &transport::control::Status,
    now: &Time,
) {
    status.epoch = Some(s.epoch as i64);
    status.last_sync_consistency = last_sync_consistency(&s.consistency);
    status.progress = (s.progress_total > 0).then_some(crate::crd::Progress {
        bytes_done: s.progress_done as i64,
        bytes_total: s.progress_total as i64,
    });
    if let Some(spec) = &s.spec
        && !spec.peer.is_empty()
    {
        status.destination_volume_id = Some(spec.peer.clone());
    }
    if let Some(c) = &s.last_cycle
        && c.point_in_time_ms > 0
    {
        status.last_sync_time = Some(time_ms(c.point_in_time_ms));
        status.last_sync_duration = Some(go_duration(Duration::from_millis(c.duration_ms)));
        status.last_sync_bytes = (c.bytes_shipped != 0).then_some(c.bytes_shipped as i64);
    }
    status.rpo_seconds = rpo(status.last_sync_time.as_ref(), now);
}

/// True when writing `new` over `old` would change nothing but what moves by itself:
/// the times of this reconcile, the running cycle's progress, and the RPO by less than
/// `rpo_step` (the interval, held between [`MIN_RPO_STEP`] and [`MAX_RPO_STEP`]). Such a
/// write is skipped: it would cost an API request per resource per look and, since a
/// status write is itself a watch event, make the controller look again at once. So
/// rpoSeconds is written with each new cycle and, while a cycle is late, once per step:
/// it lags now − lastSyncTime by 30 s at most (a reader acts on it), at the cost of at
/// most six writes per late resource per minute, none between cycles on time.
pub fn unchanged(
    old: Option<&VolumeReplicationStatus>,
    new: &VolumeReplicationStatus,
    rpo_step: Duration,
) -> bool {
    let Some(old) = old else {
        return false;
    };
    let step = rpo_step.clamp(MIN_RPO_STEP, MAX_RPO_STEP).as_secs_f64();
    match (old.rpo_seconds, new.rpo_seconds) {
        (Some(a), Some(b)) if (b - a).abs() >= step => return false,
        (None, Some(_)) | (Some(_), None) => return false,
        _ => {}
    }
    // Compared as written: times have whole seconds there (lastSyncTime is known to
    // the millisecond here), and a write that changes nothing on the server is a
    // request all the same.
    let steady = |s: &VolumeReplicationStatus| {
        serde_json::to_value(VolumeReplicationStatus {
            last_start_time: None,
            last_completion_time: None,
            rpo_seconds: None,
            progress: None,
            ..s.clone()
        })
        .ok()
    };
    steady(old) == steady(new)
}

/// The top-level status fields that differ between `old` and `new` (for the debug log
/// of each status write).
pub fn changed_fields(
    old: Option<&VolumeReplicationStatus>,
    new: &VolumeReplicationStatus,
) -> Vec<String> {
    let old = serde_json::to_value(old.cloned().unwrap_or_default()).unwrap_or_default();
    let new = serde_json::to_value(new).unwrap_or_default();
    let (Some(o), Some(n)) = (old.as_object(), new.as_object()) else {
        return Vec::new();
    };
    let mut keys: Vec<_> = o.keys().chain(n.keys()).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .filter(|k| o.get(*k) != n.get(*k))
        .cloned()
        .collect()
}

/// The smallest RPO change that is written by itself (see [`unchanged`]).
pub const MIN_RPO_STEP: Duration = Duration::from_secs(10);
/// The largest RPO change left unwritten: how far rpoSeconds may lag (see [`unchanged`]).
pub const MAX_RPO_STEP: Duration = Duration::from_secs(30);

/// The events a status change is worth: one per condition whose status or reason
/// changed (a promotion, a failed demotion, a volume going degraded and back), as
/// `kubectl describe` shows them; a Warning where the new reason is a failure.
/// `action` is what the controller was doing ("Promote", "Demote", "Resync").
pub fn transitions(
    old: Option<&VolumeReplicationStatus>,
    new: &VolumeReplicationStatus,
    action: &str,
) -> Vec<kube::runtime::events::Event> {
    use kube::runtime::events::{Event, EventType};
    let before = |type_: &str| {
        old.and_then(|o| o.conditions.iter().find(|c| c.type_ == type_))
            .map(|c| (c.status.as_str(), c.reason.as_str()))
    };
    new.conditions
        .iter()
        .filter(|c| before(&c.type_) != Some((c.status.as_str(), c.reason.as_str())))
        // What is merely so from the start is not news.
        .filter(|c| {
            old.is_some()
                || !matches!(
                    c.reason.as_str(),
                    reasons::PREREQUISITE_MET | reasons::NOT_RESYNCING | reasons::HEALTHY
                )
        })
        .map(|c| {
            let failure = matches!(
                c.reason.as_str(),
                reasons::FAILED_TO_PROMOTE
                    | reasons::FAILED_TO_DEMOTE
                    | reasons::FAILED_TO_RESYNC
                    | reasons::ERROR
                    | reasons::VOLUME_DEGRADED
                    | reasons::PREREQUISITE_NOT_MET
                    | reasons::NOT_REPLICATING
                    | reasons::UNREACHABLE
            );
            Event {
                type_: if failure {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: c.reason.clone(),
                note: Some(
                    format!("{}: {}", c.type_, c.message)
                        .chars()
                        .take(1024)
                        .collect(),
                ),
                action: action.into(),
                secondary: None,
            }
        })
        .collect()
}

/// A Kubernetes time from milliseconds since the epoch.
pub fn time_ms(ms: i64) -> Time {
    Time(
        k8s_openapi::jiff::Timestamp::from_millisecond(ms)
            .unwrap_or(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
    )
}

/// A duration as Go's `time.Duration.String()` writes it ("1h2m3.5s", "1.5ms", "0s"):
/// the form of csi-addons' `lastSyncDuration` (a metav1.Duration).
pub fn go_duration(d: Duration) -> String {
    let ns = d.as_nanos();
    if ns == 0 {
        return "0s".into();
    }
    // Below a second: one unit with a decimal fraction.
    if ns < 1_000 {
        return format!("{ns}ns");
    }
    if ns < 1_000_000 {
        return format!("{}µs", frac(ns, 3));
    }
    if ns < 1_000_000_000 {
        return format!("{}ms", frac(ns, 6));
    }
    let secs = ns / 1_000_000_000;
    let sub = ns % 1_000_000_000;
    let s = frac(u128::from((secs % 60) as u64) * 1_000_000_000 + sub, 9);
    let mins = secs / 60;
    match (mins / 60, mins % 60) {
        (0, 0) => format!("{s}s"),
        (0, m) => format!("{m}m{s}s"),
        (h, m) => format!("{h}h{m}m{s}s"),
    }
}

/// `v / 10^prec` with the fraction's trailing zeros (and a bare point) dropped.
fn frac(v: u128, prec: u32) -> String {
    let p = 10u128.pow(prec);
    let (int, f) = (v / p, v % p);
    if f == 0 {
        return int.to_string();
    }
    let digits = format!("{f:0width$}", width = prec as usize);
    format!("{int}.{}", digits.trim_end_matches('0'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(s).unwrap())
    }

    #[test]
    fn only_moving_fields_changed_is_unchanged() {
        let old = VolumeReplicationStatus {
            state: Some(State::Primary),
            rpo_seconds: Some(3.0),
            last_start_time: Some(t(1)),
            observed_generation: Some(1),
            ..Default::default()
        };
        let minute = Duration::from_secs(60);
        let mut new = old.clone();
        new.rpo_seconds = Some(9.0);
        new.last_start_time = Some(t(2));
        assert!(unchanged(Some(&old), &new, minute));
        assert!(!unchanged(None, &new, minute));
        // A late cycle: the RPO has grown by a whole interval, and is written.
        new.rpo_seconds = Some(63.0);
        assert!(
            !unchanged(Some(&old), &new, minute),
            "a stale RPO is written"
        );
        // Long intervals: the RPO lags by 30 s at most, whatever the interval.
        assert!(!unchanged(Some(&old), &new, Duration::from_secs(300)));
        new.rpo_seconds = Some(32.0);
        assert!(unchanged(Some(&old), &new, Duration::from_secs(300)));
        // Short intervals: at most one RPO-only write per 10 s.
        new.rpo_seconds = Some(12.0);
        assert!(unchanged(Some(&old), &new, Duration::from_secs(5)));
        new.rpo_seconds = Some(13.0);
        assert!(!unchanged(Some(&old), &new, Duration::from_secs(5)));
        new.rpo_seconds = Some(9.0);
        new.observed_generation = Some(2);
        assert!(
            !unchanged(Some(&old), &new, minute),
            "a new generation is always written"
        );
        new.observed_generation = Some(1);
        new.last_sync_time = Some(t(5));
        assert!(
            !unchanged(Some(&old), &new, minute),
            "a new cycle is written"
        );
        // The same cycle known to the millisecond here, read back in whole seconds.
        let mut read_back = new.clone();
        new.last_sync_time = Some(time_ms(5_250));
        assert!(
            unchanged(Some(&read_back), &new, minute),
            "written as it was"
        );
        read_back.last_sync_time = Some(time_ms(4_000));
        assert!(!unchanged(Some(&read_back), &new, minute));
    }

    #[test]
    fn go_duration_matches_go() {
        // Expected values from Go's time.Duration.String().
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_nanos(1), "1ns"),
            (Duration::from_nanos(1_100), "1.1µs"),
            (Duration::from_micros(2_200), "2.2ms"),
            (Duration::from_millis(500), "500ms"),
            (Duration::from_millis(1_500), "1.5s"),
            (Duration::from_millis(90_500), "1m30.5s"),
            (Duration::from_secs(60), "1m0s"),
            (Duration::from_secs(3_600), "1h0m0s"),
            (Duration::from_millis(3_723_004), "1h2m3.004s"),
            (Duration::from_secs(100 * 3_600 + 1), "100h0m1s"),
            (Duration::new(1, 1), "1.000000001s"),
        ];
        for (d, want) in cases {
            assert_eq!(go_duration(d), want, "{d:?}");
        }
    }

    #[test]
    fn promoted_then_failed_demotion_keep_transition_times_of_unchanged_statuses() {
        let mut list = Vec::new();
        Conditions::new(&mut list, 1, "PersistentVolumeClaim", t(100)).promoted();
        let find = |l: &[Condition], ty: &str| l.iter().find(|c| c.type_ == ty).unwrap().clone();
        assert_eq!(list.len(), 3);
        let c = find(&list, types::COMPLETED);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.message.as_str()),
            (
                "True",
                "Promoted",
                "volume is promoted to primary and replicating to secondary"
            )
        );
        assert_eq!(find(&list, types::DEGRADED).reason, "Healthy");

        Conditions::new(&mut list, 2, "PersistentVolumeClaim", t(200))
            .failed_demotion("failed to demote volume", "agent unreachable");
        let c = find(&list, types::COMPLETED);
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "FailedToDemote")
        );
        assert_eq!(c.message, "failed to demote volume");
        assert_eq!(c.last_transition_time, t(200), "status changed: time moves");
        let d = find(&list, types::DEGRADED);
        assert_eq!(d.message, "volume failed to demote: agent unreachable");
        assert_eq!(d.reason, "Error");
        let r = find(&list, types::RESYNCING);
        assert_eq!(r.last_transition_time, t(100), "still False: time kept");
        assert!(list.iter().all(|c| c.observed_generation == Some(2)));
    }

    #[test]
    fn failed_validation_says_what_to_fix_and_resync_then_in_sync() {
        let mut list = Vec::new();
        let mut c = Conditions::new(&mut list, 7, "PersistentVolumeClaim", t(1));
        c.failed_validation(
            ReplicationState::Primary,
            "failed to find PVC",
            "PersistentVolumeClaim ns/data not found",
        );
        let v = list.iter().find(|c| c.type_ == types::VALIDATED).unwrap();
        assert_eq!(v.status, "False");
        assert_eq!(v.reason, "PrerequisiteNotMet");
        assert_eq!(
            v.message,
            "failed to meet prerequisite: PersistentVolumeClaim ns/data not found"
        );

        let mut list = Vec::new();
        let mut c = Conditions::new(&mut list, 3, "PersistentVolumeClaim", t(1));
        c.resync();
        c.not_degraded();
        let get = |ty| list.iter().find(|c| c.type_ == ty).unwrap();
        assert_eq!(get(types::COMPLETED).reason, "Demoted");
        assert_eq!(get(types::DEGRADED).status, "False");
        assert_eq!(
            get(types::DEGRADED).message,
            "volume is demoted to secondary"
        );
        assert_eq!(get(types::RESYNCING).reason, "NotResyncing");
    }

    #[test]
    fn report_fills_sync_fields_and_health() {
        let s = transport::control::Status {
            state: "Degraded".into(),
            last_error: "secondary unreachable".into(),
            epoch: 3,
            rpo_seconds: 12.34,
            progress_done: 5,
            progress_total: 10,
            last_cycle: Some(transport::control::CycleReport {
                point_in_time_ms: 1_700_000_000_000,
                duration_ms: 90_500,
                bytes_shipped: 4096,
                ..Default::default()
            }),
            ..Default::default()
        };
        let mut st = VolumeReplicationStatus::default();
        // The RPO is the controller's: now minus the cycle's point in time, whatever
        // the agent said.
        let now = time_ms(1_700_000_020_040);
        apply_report(&mut st, &s, &now);
        assert_eq!(st.epoch, Some(3));
        assert_eq!(st.rpo_seconds, Some(20.0));
        assert_eq!(st.last_sync_duration.as_deref(), Some("1m30.5s"));
        assert_eq!(st.last_sync_bytes, Some(4096));
        assert_eq!(st.last_sync_time, Some(time_ms(1_700_000_000_000)));
        assert_eq!(
            st.progress,
            Some(crate::crd::Progress {
                bytes_done: 5,
                bytes_total: 10
            })
        );
        assert_eq!(
            health(&s, &now, Duration::from_secs(60)),
            (
                Health::Degraded,
                "relationship Degraded: secondary unreachable".into()
            )
        );
        assert_eq!(reached(ReplicationState::Resync), State::Secondary);
        assert_eq!(
            marked(ReplicationState::Resync),
            "volume is marked for resyncing"
        );
        assert_eq!(
            marked(ReplicationState::Primary),
            "volume is marked primary"
        );
    }

    #[test]
    fn rpo_is_now_minus_the_last_sync() {
        let last = time_ms(1_700_000_000_000);
        assert_eq!(rpo(Some(&last), &time_ms(1_700_000_036_260)), Some(36.3));
        assert_eq!(rpo(None, &time_ms(1_700_000_036_260)), None);
        // A clock behind the agent's: no negative RPO.
        assert_eq!(rpo(Some(&last), &time_ms(1_699_999_999_000)), Some(0.0));
    }

    fn report(state: &str, error: &str, age_ms: i64, now_ms: i64) -> transport::control::Status {
        // The agent's sentence for lateness (`replicate::late`) comes with its kind.
        let late = error.starts_with("RPO ");
        transport::control::Status {
            state: state.into(),
            last_error: error.into(),
            last_error_kind: if late {
                transport::control::ErrorKind::Late as i32
            } else {
                0
            },
            last_cycle: Some(transport::control::CycleReport {
                point_in_time_ms: now_ms - age_ms,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_late_primary_is_degraded_in_words_that_do_not_tick() {
        let (now, ten) = (1_700_000_036_000, Duration::from_secs(10));
        let agents_late = report(
            "Degraded",
            "RPO 36s is past 3 intervals (30s): no cycle has completed since",
            36_000,
            now,
        );
        let want = "relationship Degraded: no cycle has completed since \
                    2023-11-14T22:13:20Z, more than 3 intervals (30s) ago";
        assert_eq!(
            health(&agents_late, &time_ms(now), ten),
            (Health::Degraded, want.to_string())
        );
        // A second later: the same sentence (no status write for it).
        let later = report(
            "Degraded",
            "RPO 37s is past 3 intervals (30s): no cycle has completed since",
            37_000,
            now + 1_000,
        );
        assert_eq!(health(&later, &time_ms(now + 1_000), ten).1, want);
        // The agent says Replicating, the controller's clock says late.
        let replicating = report("Replicating", "", 36_000, now);
        assert_eq!(
            health(&replicating, &time_ms(now), ten),
            (Health::Degraded, want.to_string())
        );
        let on_time = report("Replicating", "", 25_000, now);
        assert_eq!(health(&on_time, &time_ms(now), ten).0, Health::Healthy);
        // The first cycle under way is not broken.
        let first = transport::control::Status {
            state: "Resyncing".into(),
            ..Default::default()
        };
        assert_eq!(health(&first, &time_ms(now), ten).0, Health::Waiting);

        // Broken replication makes the volume Degraded, not Healthy.
        let mut list = Vec::new();
        let mut c = Conditions::new(&mut list, 1, "PersistentVolumeClaim", t(1));
        c.promoted();
        c.replicating(Health::Degraded, want);
        let get = |ty| list.iter().find(|c| c.type_ == ty).unwrap();
        assert_eq!(get(types::DEGRADED).status, "True");
        assert_eq!(get(types::DEGRADED).reason, reasons::VOLUME_DEGRADED);
        assert_eq!(
            get(types::DEGRADED).message,
            format!("volume is degraded: {want}")
        );
        assert_eq!(get(types::REPLICATING).status, "False");
        assert_eq!(get(types::COMPLETED).status, "True");
    }

    #[test]
    fn trouble_after_a_promotion_keeps_completed() {
        let mut st = VolumeReplicationStatus::default();
        Conditions::new(&mut st.conditions, 1, "PersistentVolumeClaim", t(1)).promoted();
        assert!(!completed(&st, ReplicationState::Primary), "no state yet");
        st.state = Some(State::Primary);
        assert!(completed(&st, ReplicationState::Primary));
        assert!(!completed(&st, ReplicationState::Secondary));
        let mut c = Conditions::new(&mut st.conditions, 2, "PersistentVolumeClaim", t(2));
        c.trouble(reasons::UNREACHABLE, "the agent does not answer", true);
        assert!(
            st.conditions
                .iter()
                .all(|c| c.observed_generation == Some(2))
        );
        let get = |ty| st.conditions.iter().find(|c| c.type_ == ty).unwrap();
        assert_eq!(
            (
                get(types::COMPLETED).status.as_str(),
                get(types::COMPLETED).reason.as_str()
            ),
            ("True", reasons::PROMOTED)
        );
        assert_eq!(
            (
                get(types::DEGRADED).status.as_str(),
                get(types::DEGRADED).reason.as_str()
            ),
            ("True", reasons::UNREACHABLE)
        );
        assert_eq!(get(types::REPLICATING).status, "False");
        assert!(completed(&st, ReplicationState::Primary), "still");
    }

    #[test]
    fn messages_are_in_the_readers_words() {
        assert_eq!(
            plain(
                "relationship Degraded: agent agent://mover-locator@dr.example:7471/-: \
                 unavailable: cannot connect: transport error: tcp connect error: tcp connect \
                 error: Connection refused (os error 111) (is the agent running and \
                 reachable? rerunning continues the transfer)"
            ),
            "relationship Degraded: the peer cluster's Locator at dr.example:7471: \
             unavailable: cannot connect: transport error: tcp connect error: Connection \
             refused (os error 111)"
        );
        assert_eq!(
            plain("agent://mover-locator@[fd00::1]:7471/- refused"),
            "the peer cluster's Locator at [fd00::1]:7471 refused"
        );
        assert_eq!(
            plain(
                "\"app/pg\" is halted (Fenced): another side was promoted; run `mover \
                 replicate resync app/pg` here to make this side its secondary"
            ),
            "\"app/pg\" is halted (Fenced): another side was promoted; set \
             `replicationState: secondary` with `autoResync: true` in this side's \
             VolumeReplication to make this side its secondary"
        );
        // A peer's agent by its node and address; a cause said twice apart stays.
        assert_eq!(
            plain("agent agent://node-b@10.0.0.2:7070/pv-1: refused: no: yes: no"),
            "the peer's agent on node node-b (10.0.0.2:7070): refused: no: yes: no"
        );
        assert_eq!(
            plain(
                "agent agent://b-node1@127.0.20.1:41267/pv-data: refused: stale epoch 1: \
                 this side was demoted or fenced. Resync from the current primary"
            ),
            "the peer's agent on node b-node1 (127.0.20.1:41267): refused: stale epoch 1: \
             this side was demoted or fenced: set `replicationState: secondary` with \
             `autoResync: true` in this side's VolumeReplication"
        );
        let kept = "the agent on node a (10.0.0.1:7070) does not answer";
        assert_eq!(plain(kept), kept);
    }
}
