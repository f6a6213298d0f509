//! Fencing epochs: the highest epoch seen per relationship, kept durably, so a demoted
//! primary (with a lower epoch) can never write over the new one's data.

use std::{
    collections::HashMap,
    fs,
    path::{Path, PathBuf},
    sync::Mutex,
};

/// Format version of an epoch file.
const EPOCH_VERSION: u32 = 1;

/// Durable highest epochs, one small file per relationship.
pub struct EpochStore {
    dir: PathBuf,
    cache: Mutex<HashMap<String, u64>>,
}

/// A write from an older epoch than the highest seen.
#[derive(Debug, thiserror::Error)]
#[error(
    "stale epoch {given} for relationship {relationship:?}: epoch {highest} has been seen; \
     this side was demoted or fenced. Resync from the current primary"
)]
pub struct StaleEpoch {
    /// The relationship.
    pub relationship: String,
    /// The epoch offered.
    pub given: u64,
    /// The highest epoch seen.
    pub highest: u64,
}

/// How far a caller may raise a relationship's highest epoch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Raise {
    /// To any epoch: the control role (Create, Promote, an accepted epoch).
    Any,
    /// By one at most: a peer's cycle (its promotion, forced or not, raised its epoch by
    /// one). On first sight, to at most [`FIRST_SIGHT_MOST`].
    ByOne,
    /// Not at all: a frame of a session opened at its epoch.
    No,
}

/// The highest epoch a peer may bring to a relationship seen here for the first time:
/// far above any real one, far below what would leave no room for promotions.
pub const FIRST_SIGHT_MOST: u64 = 1 << 32;

/// An epoch higher than the caller may raise to.
#[derive(Debug, thiserror::Error)]
#[error(
    "epoch {given} for relationship {relationship:?} refused: the highest epoch seen here is \
     {highest}, and a peer raises it by one at most (a promotion, forced or not, raises it \
     by one). If the peer was promoted more than once while this side was away, accept its \
     epoch here: mover replicate update {relationship} --accept-epoch {given}"
)]
pub struct EpochRaise {
    /// The relationship.
    pub relationship: String,
    /// The epoch offered.
    pub given: u64,
    /// The highest epoch seen.
    pub highest: u64,
}

impl EpochStore {
    /// A store under `state_dir/epochs`.
    pub fn new(state_dir: &Path) -> std::io::Result<Self> {
        let dir = state_dir.join("epochs");
        fs::create_dir_all(&dir)?;
        Ok(EpochStore {
            dir,
            cache: Mutex::new(HashMap::new()),
        })
    }

    fn path(&self, relationship: &str) -> PathBuf {
        let name = mover_engine::node::name_hash(relationship);
        self.dir.join(format!("{name}.json"))
    }

    fn load(&self, relationship: &str) -> u64 {
        let text = fs::read_to_string(self.path(relationship)).unwrap_or_default();
        serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["epoch"].as_u64())
            .unwrap_or(0)
    }

    /// The highest epoch seen for `relationship`.
    pub fn highest(&self, relationship: &str) -> u64 {
        let mut cache = self.cache.lock().expect("epoch cache lock");
        *cache
            .entry(relationship.to_string())
            .or_insert_with(|| self.load(relationship))
    }

    /// Admits `epoch` if it is at least the highest seen, raising (durably) the highest.
    pub fn admit(&self, relationship: &str, epoch: u64) -> Result<(), StaleEpochOrIo> {
        self.admit_bounded(relationship, epoch, Raise::Any)
    }

    /// Admits `epoch` if it is at least the highest seen and within what `raise` allows,
    /// raising (durably) the highest; the check and the raise are one step.
    pub fn admit_bounded(
        &self,
        relationship: &str,
        epoch: u64,
        raise: Raise,
    ) -> Result<(), StaleEpochOrIo> {
        let mut cache = self.cache.lock().expect("epoch cache lock");
        let highest = *cache
            .entry(relationship.to_string())
            .or_insert_with(|| self.load(relationship));
        if epoch < highest {
            return Err(StaleEpochOrIo::Stale(StaleEpoch {
                relationship: relationship.into(),
                given: epoch,
                highest,
            }));
        }
        let most = match raise {
            Raise::Any => u64::MAX,
            Raise::ByOne if highest == 0 => FIRST_SIGHT_MOST,
            Raise::ByOne => highest.saturating_add(1),
            Raise::No => highest,
        };
        if epoch > most {
            return Err(StaleEpochOrIo::Raise(EpochRaise {
                relationship: relationship.into(),
                given: epoch,
                highest,
            }));
        }
        if epoch > highest {
            self.persist(relationship, epoch)
                .map_err(StaleEpochOrIo::Io)?;
            cache.insert(relationship.to_string(), epoch);
        }
        Ok(())
    }

    /// Writes the epoch file durably: tmp, fsync, rename, fsync(dir).
    fn persist(&self, relationship: &str, epoch: u64) -> std::io::Result<()> {
        let body = serde_json::json!({"version": EPOCH_VERSION, "relationship": relationship, "epoch": epoch});
        mover_engine::node::write_durably(&self.path(relationship), body.to_string().as_bytes())
    }
}

/// [`EpochStore::admit`]'s failure.
#[derive(Debug, thiserror::Error)]
pub enum StaleEpochOrIo {
    /// The epoch is stale.
    #[error(transparent)]
    Stale(StaleEpoch),
    /// The epoch is higher than the caller may raise to.
    #[error(transparent)]
    Raise(EpochRaise),
    /// The new epoch could not be recorded.
    #[error("cannot record the fencing epoch: {0}")]
    Io(std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epochs_only_rise_and_survive_restarts() {
        let dir = tempfile::tempdir().unwrap();
        let store = EpochStore::new(dir.path()).unwrap();
        store.admit("rel-a", 3).unwrap();
        store.admit("rel-a", 3).unwrap();
        assert!(matches!(
            store.admit("rel-a", 2),
            Err(StaleEpochOrIo::Stale(StaleEpoch { highest: 3, .. }))
        ));
        store.admit("rel-b", 1).unwrap();
        drop(store);
        let again = EpochStore::new(dir.path()).unwrap();
        assert_eq!(again.highest("rel-a"), 3);
        let err = again.admit("rel-a", 1).unwrap_err().to_string();
        assert!(
            err.contains("stale epoch 1") && err.contains("epoch 3"),
            "{err}"
        );
        again.admit("rel-a", 7).unwrap();
        assert_eq!(EpochStore::new(dir.path()).unwrap().highest("rel-a"), 7);
    }

    #[test]
    fn a_peer_raises_an_epoch_by_one_at_most() {
        let dir = tempfile::tempdir().unwrap();
        let store = EpochStore::new(dir.path()).unwrap();
        let raised = |r: Result<(), StaleEpochOrIo>| match r {
            Err(StaleEpochOrIo::Raise(e)) => e.to_string(),
            other => panic!("{other:?}"),
        };
        raised(store.admit_bounded("r", FIRST_SIGHT_MOST + 1, Raise::ByOne));
        store.admit_bounded("r", 3, Raise::ByOne).unwrap();
        let refused = raised(store.admit_bounded("r", 5, Raise::ByOne));
        assert!(
            refused.contains("highest epoch seen here is 3"),
            "{refused}"
        );
        assert!(refused.contains("update r --accept-epoch 5"), "{refused}");
        assert_eq!(store.highest("r"), 3);
        raised(store.admit_bounded("r", 4, Raise::No));
        store.admit_bounded("r", 3, Raise::No).unwrap();
        store.admit_bounded("r", 4, Raise::ByOne).unwrap();
        store.admit_bounded("r", 9, Raise::Any).unwrap();
        assert_eq!(store.highest("r"), 9);
    }
}
