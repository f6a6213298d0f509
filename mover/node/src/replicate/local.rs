//! `mover replicate run`: a relationship whose primary is this process rather than an
//! agent (no agent on the primary's node). Its cycles run through the same [`Runners`]
//! as an agent's, so the interval, the overrun accounting and fencing are the same; the
//! relationship's record is kept under `STATE/run/`.

use super::{
    check_interval, default_chunk,
    runner::{CycleOutcome, Runners},
    store::{RECORD_VERSION, Record, Role, Spec, Store},
};
use mover_engine::{
    error::CopyError,
    node::{Export, Exports},
    remote::{AgentUrl, RemoteOptions},
};
use std::{collections::BTreeMap, path::PathBuf, sync::Arc, time::Duration};

/// A relationship run from this process.
#[derive(Clone, Debug)]
pub struct LocalRun {
    /// The primary volume: an image file, a block device, or a directory (a file tree).
    pub src: PathBuf,
    /// The secondary: an agent's export.
    pub peer: AgentUrl,
    /// Time between the starts of two cycles.
    pub interval: Duration,
    /// Stop after this many cycles (failed ones included); `None`: until the caller
    /// drops the future.
    pub cycles: Option<u64>,
    /// Chunk size [default: [`default_chunk`] of the volume; a tree is copied by file].
    pub chunk_size: Option<chunker::ChunkSize>,
    /// Mount point frozen while the point in time is taken.
    pub freeze: Option<PathBuf>,
    /// Where the relationship's record is kept (under `run/`).
    pub state_dir: PathBuf,
    /// How the secondary is reached; its `relationship` names the relationship
    /// [default: `run/EXPORT`] and its `epoch` is a new record's epoch.
    pub remote: RemoteOptions,
}

/// Runs `run`'s cycles, handing each outcome to `report`. Returns after `cycles`
/// cycles, or at the first failure that a retry cannot mend (a refused epoch, a bad
/// volume); failures that may pass (the secondary unreachable) are retried at the next
/// interval.
pub async fn run_local(
    run: LocalRun,
    mut report: impl FnMut(&CycleOutcome),
) -> Result<(), CopyError> {
    check_interval(run.interval.as_millis() as u64).map_err(|why| CopyError::BadSource {
        path: run.src.clone(),
        why,
    })?;
    let name = run
        .remote
        .relationship
        .clone()
        .unwrap_or_else(|| format!("run/{}", run.peer.volume));
    let store_dir = run.state_dir.join("run");
    let store = Arc::new(Store::open(&store_dir).map_err(|e| CopyError::State {
        path: store_dir.clone(),
        cause: std::io::Error::other(e.to_string()),
    })?);
    let volume = run.src.display().to_string();
    let peer = run.peer.to_string();
    let mut record = match store.get(&name) {
        // A new secondary for a relationship this side still runs: its cycles follow
        // DST (never the saved peer, silently). The new secondary holds none of the old
        // one's cycles, so the relationship starts afresh there: a full comparison, and
        // the old clone, whose cycle it never saw, dropped.
        Some(r) if r.spec.peer != peer && r.role == Role::Primary && r.halt.is_none() => {
            let (old, kept) = (&r.spec.peer, r.last_cycle.as_ref().map_or(0, |c| c.id));
            tracing::warn!(
                relationship = %name,
                "the saved relationship ships to {old}, not {peer}: starting it afresh on \
                 {peer} (its first cycle compares every chunk; {old} keeps its replica of \
                 cycle {kept})",
            );
            super::base::forget(&run.src, &name);
            new_record(&run, &name, &volume)?
        }
        Some(r) => r,
        None => new_record(&run, &name, &volume)?,
    };
    if record.role != Role::Primary || record.halt.is_some() {
        return Err(CopyError::BadSource {
            path: run.src.clone(),
            why: format!(
                "relationship {name:?} in {} is {} (its peer: {}): this side no longer runs \
                 its cycles; to replicate {} anew, name another relationship \
                 (--relationship NAME)",
                store_dir.display(),
                record
                    .halt
                    .map_or("a secondary".into(), |h| format!("halted ({h:?})")),
                record.spec.peer,
                run.src.display(),
            ),
        });
    }
    record.spec.volume = volume.clone();
    record.spec.freeze = run.freeze.clone();
    record.spec.interval_ms = run.interval.as_millis() as u64;
    store.put(record).map_err(|e| CopyError::State {
        path: store_dir.clone(),
        cause: std::io::Error::other(e.to_string()),
    })?;

    let export = Export {
        path: run.src.clone(),
        read_only: true,
        namespaces: Vec::new(),
        peer_credential: None,
    };
    let exports = Exports::fixed(BTreeMap::from([(volume, export)]));
    let runners = Runners::new(store, exports, run.remote.clone());
    let mut outcomes = runners.subscribe();
    runners.start(&name);
    let mut done = 0u64;
    let result = loop {
        let outcome = match outcomes.recv().await {
            Ok(o) if o.relationship == name => o,
            Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => continue,
            Err(tokio::sync::broadcast::error::RecvError::Closed) => break Ok(()),
        };
        report(&outcome);
        if let Err(failure) = &outcome.result
            && !failure.retryable
        {
            break Err(failure.clone());
        }
        done += 1;
        if run.cycles.is_some_and(|n| done >= n) {
            break Ok(());
        }
    };
    runners.stop(&name);
    result.map_err(|f| CopyError::CycleFailed {
        relationship: name,
        message: f.error,
        refusal: f.refusal,
    })
}

fn new_record(run: &LocalRun, name: &str, volume: &str) -> Result<Record, CopyError> {
    Ok(Record {
        version: RECORD_VERSION,
        spec: Spec {
            name: name.into(),
            volume: volume.into(),
            peer: run.peer.to_string(),
            interval_ms: run.interval.as_millis() as u64,
            bwlimit: run.remote.bwlimit.unwrap_or(0),
            chunk_size: match run.chunk_size {
                Some(c) => c.get(),
                None if run.src.is_dir() => 0, // a file tree: copied by file
                None => default_chunk(chunker::BlockVolume::open(&run.src)?.size()).get(),
            },
            peer_token: None,
            snapshots: false,
            peer_credential: None,
            freeze: None,
            require_point_in_time: false,
        },
        role: Role::Primary,
        epoch: run.remote.epoch,
        paused: false,
        halt: None,
        last_cycle: None,
        this_side: String::new(),
        history: Vec::new(),
    })
}
