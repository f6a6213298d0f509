//! Relationship records, kept durably in the agent's state directory (one JSON file per
//! relationship under `STATE/relationships/`, written tmp → fsync → rename → fsync(dir)).

use mover_engine::node::write_durably;
use serde::{Deserialize, Serialize};
use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    sync::Mutex,
};

/// Format version of a relationship record.
pub const RECORD_VERSION: u32 = 1;

/// What a relationship is: the settings users give.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// The relationship's id.
    pub name: String,
    /// This agent's export holding the volume.
    pub volume: String,
    /// The other side's volume, `agent://HOST:PORT/NAME`.
    pub peer: String,
    /// Between the starts of two cycles.
    pub interval_ms: u64,
    /// Bytes per second on the wire (0: none).
    pub bwlimit: u64,
    /// Chunk size in bytes.
    pub chunk_size: u64,
    /// A mount point frozen while the point in time is taken.
    #[serde(default)]
    pub freeze: Option<PathBuf>,
    /// The token presented to the peer's agent for this relationship [default: the
    /// agent's own peer token]. The relationships directory is root's only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_token: Option<PeerToken>,
    /// Refuse cycles that are not of one point in time (see the control API's Spec).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub require_point_in_time: bool,
    /// Points in time are CSI VolumeSnapshots handed over by the controller (see the
    /// control API's Spec): no cycle runs without one.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub snapshots: bool,
    /// The peer credential that alone may act on this relationship here (see the
    /// control API's Spec; `None`: any replication credential).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer_credential: Option<String>,
}

/// A relationship's own token for the peer's agent, and the caller's name for it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PeerToken {
    /// The bearer token.
    pub token: String,
    /// The caller's version of it (a secret's uid/resourceVersion).
    pub version: String,
    /// The peer cluster's CA (PEM), trusted alone for this relationship's peer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca: Option<String>,
}

impl std::fmt::Debug for PeerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "PeerToken({})", self.version)
    }
}

/// Which side of the relationship this agent holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Its volume is written by applications; this agent runs the cycles.
    Primary,
    /// Its volume receives cycles.
    Secondary,
}

impl Role {
    /// The side as the control API names it.
    pub fn side(self) -> transport::states::Side {
        match self {
            Role::Primary => transport::states::Side::Primary,
            Role::Secondary => transport::states::Side::Secondary,
        }
    }
}

/// Why a primary stopped its cycles until someone acts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Halt {
    /// The peer holds a higher epoch: another side was promoted.
    Fenced,
    /// Another side was promoted and this side wrote after the split.
    SplitBrain,
}

/// One completed cycle.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CycleRecord {
    /// Its id: one more than the last, across epochs.
    pub id: u64,
    /// The source's point in time (Unix ms).
    pub point_in_time_ms: i64,
    /// When it started (Unix ms).
    pub started_ms: i64,
    /// How long it took.
    pub duration_ms: u64,
    /// Source bytes read.
    pub bytes_read: u64,
    /// Bytes on the wire.
    pub bytes_shipped: u64,
    /// Hex Merkle root of the volume at this cycle.
    pub root: String,
    /// The last cycle of a demote.
    pub r#final: bool,
    /// "point-in-time", "file-consistent" or "crash-inconsistent".
    pub consistency: String,
    /// The CSI handle of the VolumeSnapshot it read ("": none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub snapshot: String,
    /// How long taking its point in time held the volume's writers back (a freeze, or
    /// the lock a whole-file clone takes): the application's stall. 0: none, or a
    /// record of a side that does not take points in time (the secondary's).
    #[serde(default)]
    pub writers_held_ms: u64,
}

/// An epoch change: the epoch, and the last cycle both sides held when it began.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochChange {
    /// The new epoch.
    pub epoch: u64,
    /// The newest cycle common to both sides then.
    pub last_common_cycle: u64,
    /// Hex Merkle root of that cycle ("" if unknown): how a fenced old primary tells
    /// whether it still holds exactly that cycle.
    #[serde(default)]
    pub root: String,
}

/// A relationship as this agent keeps it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    /// [`RECORD_VERSION`].
    pub version: u32,
    /// The settings.
    pub spec: Spec,
    /// This side's role.
    pub role: Role,
    /// The epoch this side writes (primary) or last accepted (secondary) with.
    pub epoch: u64,
    /// Cycles are paused by the user.
    #[serde(default)]
    pub paused: bool,
    /// Cycles stopped by fencing.
    #[serde(default)]
    pub halt: Option<Halt>,
    /// Primary: the last cycle the secondary committed.
    #[serde(default)]
    pub last_cycle: Option<CycleRecord>,
    /// This side's volume as the peer reaches it: `agent://HOST:PORT/NAME`.
    pub this_side: String,
    /// Epoch changes seen here.
    #[serde(default)]
    pub history: Vec<EpochChange>,
}

impl Record {
    /// A new relationship's record on its primary, at `epoch`, reached by the peer at
    /// `this_side`.
    pub fn primary(spec: Spec, epoch: u64, this_side: String) -> Record {
        Record {
            version: RECORD_VERSION,
            this_side,
            spec,
            role: Role::Primary,
            epoch,
            paused: false,
            halt: None,
            last_cycle: None,
            history: Vec::new(),
        }
    }

    /// The secondary's record of `relationship`, whose cycle (at `epoch`, of chunks of
    /// `chunk_size`) writes into export `volume` (`known`: the record here before it):
    /// what the primary says of the relationship, and what only this side sets kept
    /// (its freeze, its peer token, its point-in-time rule, its history, its binding:
    /// `bound`, the export's, when the record is made).
    pub fn secondary(
        (relationship, volume, bound): (&str, &str, Option<&str>),
        epoch: u64,
        chunk_size: u64,
        cycle: &transport::proto::Cycle,
        known: Option<&Record>,
    ) -> Record {
        Record {
            version: RECORD_VERSION,
            spec: Spec {
                name: relationship.into(),
                volume: volume.into(),
                peer: match (&cycle.primary, known) {
                    (p, Some(k)) if p.is_empty() => k.spec.peer.clone(),
                    (p, _) => p.clone(),
                },
                interval_ms: cycle.interval_ms,
                bwlimit: cycle.bwlimit,
                chunk_size,
                freeze: known.and_then(|k| k.spec.freeze.clone()),
                // Set on this side (for when it is promoted): not the primary's to change.
                peer_token: known.and_then(|k| k.spec.peer_token.clone()),
                require_point_in_time: known.is_some_and(|k| k.spec.require_point_in_time),
                snapshots: known.is_some_and(|k| k.spec.snapshots),
                // Once the record is made, only the control role's Update changes it.
                peer_credential: match known {
                    Some(k) => k.spec.peer_credential.clone(),
                    None => bound.map(String::from),
                },
            },
            role: Role::Secondary,
            epoch,
            paused: false,
            halt: None,
            last_cycle: known.and_then(|k| k.last_cycle.clone()),
            this_side: known
                .map(|k| k.this_side.clone())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| cycle.secondary.clone()),
            history: known.map(|k| k.history.clone()).unwrap_or_default(),
        }
    }

    /// The id of the next cycle this side would run.
    pub fn next_cycle(&self) -> u64 {
        self.last_cycle.as_ref().map_or(1, |c| c.id + 1)
    }
}

/// Why the store could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Reading or writing the state directory failed.
    #[error("relationship store {path}: {cause}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        cause: std::io::Error,
    },
    /// A record is damaged or from a newer build.
    #[error(
        "relationship record {path} is unreadable: {why}; move it away to forget that relationship"
    )]
    Bad {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        why: String,
    },
}

/// The relationships of one agent.
pub struct Store {
    dir: PathBuf,
    records: Mutex<BTreeMap<String, Record>>,
}

impl Store {
    /// Opens (creating) `STATE/relationships` and loads every record.
    pub fn open(state_dir: &Path) -> Result<Store, StoreError> {
        let dir = state_dir.join("relationships");
        let io = |cause| StoreError::Io {
            path: dir.clone(),
            cause,
        };
        fs::create_dir_all(&dir).map_err(io)?;
        // Records may hold a peer token.
        {
            use std::os::unix::fs::PermissionsExt;
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).map_err(io)?;
        }
        let mut records = BTreeMap::new();
        for e in fs::read_dir(&dir).map_err(io)?.flatten() {
            let path = e.path();
            if path.extension().is_none_or(|x| x != "json") {
                continue;
            }
            let text = fs::read_to_string(&path).map_err(|cause| StoreError::Io {
                path: path.clone(),
                cause,
            })?;
            let bad = |why: String| StoreError::Bad {
                path: path.clone(),
                why,
            };
            let r: Record = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
            if r.version != RECORD_VERSION {
                return Err(bad(format!(
                    "format version {} (this build reads {RECORD_VERSION})",
                    r.version
                )));
            }
            records.insert(r.spec.name.clone(), r);
        }
        Ok(Store {
            dir,
            records: Mutex::new(records),
        })
    }

    fn path(&self, name: &str) -> PathBuf {
        let h = mover_engine::node::name_hash(name);
        self.dir.join(format!("{h}.json"))
    }

    /// The record of `name`.
    pub fn get(&self, name: &str) -> Option<Record> {
        self.records.lock().expect("store lock").get(name).cloned()
    }

    /// Every record, by name.
    pub fn all(&self) -> Vec<Record> {
        self.records
            .lock()
            .expect("store lock")
            .values()
            .cloned()
            .collect()
    }

    /// Saves `record` durably, replacing the one of the same name.
    pub fn put(&self, record: Record) -> Result<(), StoreError> {
        let path = self.path(&record.spec.name);
        let body = serde_json::to_vec_pretty(&record).expect("records serialize");
        let mut records = self.records.lock().expect("store lock");
        write_durably(&path, &body).map_err(|cause| StoreError::Io { path, cause })?;
        records.insert(record.spec.name.clone(), record);
        Ok(())
    }

    /// Changes the record of `name` with `f` and saves it; `None` if there is none.
    pub fn update(
        &self,
        name: &str,
        f: impl FnOnce(&mut Record),
    ) -> Result<Option<Record>, StoreError> {
        let Some(mut r) = self.get(name) else {
            return Ok(None);
        };
        f(&mut r);
        self.put(r.clone())?;
        Ok(Some(r))
    }

    /// Forgets `name`.
    pub fn remove(&self, name: &str) -> Result<(), StoreError> {
        let path = self.path(name);
        let mut records = self.records.lock().expect("store lock");
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(StoreError::Io { path, cause: e });
            }
            _ => {}
        }
        records.remove(name);
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A primary's record of `name`, every cycle still to come (shared with the other
    /// tests of `replicate`).
    pub(crate) fn record(name: &str) -> Record {
        Record {
            version: RECORD_VERSION,
            spec: Spec {
                name: name.into(),
                volume: "data".into(),
                peer: "agent://b:7070/data".into(),
                interval_ms: 30_000,
                bwlimit: 0,
                chunk_size: 1 << 20,
                freeze: None,
                require_point_in_time: false,
                peer_token: None,
                snapshots: false,
                peer_credential: None,
            },
            role: Role::Primary,
            epoch: 1,
            paused: false,
            halt: None,
            last_cycle: None,
            this_side: "agent://a:7070/data".into(),
            history: Vec::new(),
        }
    }

    #[test]
    fn records_survive_a_restart_and_damage_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store.put(record("r1")).unwrap();
        store.put(record("r2")).unwrap();
        store
            .update("r1", |r| {
                r.epoch = 4;
                r.role = Role::Secondary;
            })
            .unwrap();
        store.remove("r2").unwrap();
        let again = Store::open(dir.path()).unwrap();
        let all = again.all();
        assert_eq!(all.len(), 1);
        assert_eq!((all[0].epoch, all[0].role), (4, Role::Secondary));
        assert_eq!(all[0].next_cycle(), 1);

        fs::write(dir.path().join("relationships/x.json"), b"{").unwrap();
        let e = Store::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("x.json") && e.contains("unreadable"), "{e}");
    }
}
