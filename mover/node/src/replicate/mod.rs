//! Continuous replication (docs/ARCHITECTURE.md).
//!
//! A relationship pairs a primary volume (an export of the agent that hosts it) with a
//! secondary (`agent://HOST:PORT/NAME`). The primary's agent runs cycles on an interval
//! ([`runner`]): a point in time of the source (a reflink clone of an image, optionally
//! with its filesystem frozen while the clone is taken; else the live volume), the pages
//! that differ from the secondary (Merkle comparison), shipped and committed there as one
//! atomic cycle (the secondary's journal, [`journal`]). Both sides keep a durable
//! record of the relationship ([`store`]); epochs fence a demoted or stale primary.

pub mod base;
pub mod cycle;
pub mod holds;
pub mod journal;
pub mod local;
pub mod runner;
pub mod secondary;
pub mod store;

pub use local::{LocalRun, run_local};
pub use runner::{CycleFailure, CycleOutcome, Runners};
pub use store::{CycleRecord, EpochChange, Halt, Record, Role, Spec, Store, StoreError};

use transport::cluster::LATE_INTERVALS;
use transport::control;
use transport::states::RelationshipState;

/// How to reach a relationship's peer: `remote`, presenting the relationship's own
/// token where it has one, and trusting only the peer cluster's CA where it names one.
pub fn remote_for(
    remote: &mover_engine::remote::RemoteOptions,
    peer: Option<&store::PeerToken>,
) -> mover_engine::remote::RemoteOptions {
    match peer {
        Some(p) => remote.with_peer(&p.token, p.ca.as_deref()),
        None => remote.clone(),
    }
}

pub use mover_engine::node::now_ms;

/// The minimum interval between cycles.
pub const MIN_INTERVAL_MS: u64 = 1000;

/// Refuses an interval shorter than cycles may run ([`MIN_INTERVAL_MS`]).
pub fn check_interval(ms: u64) -> Result<(), String> {
    if ms < MIN_INTERVAL_MS {
        return Err(format!(
            "interval {ms} ms is too short: cycles run at most once a second (give e.g. 30s)"
        ));
    }
    Ok(())
}

/// A relationship's chunk size unless given: small chunks, since a cycle reads every
/// chunk a write touched (128K read a quarter of what 1M did on the bench's database
/// volume, in half the time), but at most 32768 chunks so that the index and the
/// previous cycle's ids stay small (a few MiB) on large volumes.
pub fn default_chunk(size: u64) -> chunker::ChunkSize {
    let wanted = size
        .div_ceil(32768)
        .next_power_of_two()
        .clamp(128 << 10, 8 << 20);
    chunker::ChunkSize::new(wanted).expect("a power of two from 128K to 8M")
}

/// The state status reports, from the record and what this process saw.
pub fn state_of(r: &Record, live: &runner::Live) -> RelationshipState {
    match (r.role, r.halt) {
        (_, Some(Halt::SplitBrain)) => RelationshipState::SplitBrain,
        (_, Some(Halt::Fenced)) => RelationshipState::Fenced,
        (Role::Secondary, None) => RelationshipState::Secondary,
        (Role::Primary, None) if r.paused => RelationshipState::Paused,
        (Role::Primary, None) if live.degraded || late(r).is_some() => RelationshipState::Degraded,
        (Role::Primary, None) if r.last_cycle.is_none() => RelationshipState::Resyncing,
        (Role::Primary, None) => RelationshipState::Replicating,
    }
}

/// Why a primary is late: its RPO (seconds) is past [`LATE_INTERVALS`] intervals.
pub fn late(r: &Record) -> Option<String> {
    let last = r.last_cycle.as_ref()?;
    let rpo_ms = now_ms() - last.point_in_time_ms;
    let bound_ms = (LATE_INTERVALS * r.spec.interval_ms) as i64;
    (r.role == Role::Primary && r.halt.is_none() && !r.paused && rpo_ms > bound_ms).then(|| {
        format!(
            "RPO {}s is past {LATE_INTERVALS} intervals ({}s): no cycle has completed since",
            rpo_ms / 1000,
            bound_ms / 1000
        )
    })
}

/// A cycle record as the control API reports it.
pub fn cycle_report(c: &CycleRecord) -> control::CycleReport {
    control::CycleReport {
        id: c.id,
        point_in_time_ms: c.point_in_time_ms,
        started_ms: c.started_ms,
        duration_ms: c.duration_ms,
        bytes_read: c.bytes_read,
        bytes_shipped: c.bytes_shipped,
        root: c.root.clone(),
        r#final: c.r#final,
        writers_held_ms: c.writers_held_ms,
    }
}

/// The control API's status of `r`; `last` is the last cycle this side knows of (the
/// secondary's last applied one, the primary's last committed one).
pub fn status(r: &Record, live: &runner::Live, last: Option<&CycleRecord>) -> control::Status {
    // The cycle's own error, else why it is late (one look at the clock for both).
    let (last_error, last_error_kind) = match (live.last_error.is_empty(), late(r)) {
        (true, Some(why)) => (why, control::ErrorKind::Late),
        _ => (live.last_error.clone(), live.last_error_kind),
    };
    let now = now_ms();
    control::Status {
        spec: Some(control::Spec {
            name: r.spec.name.clone(),
            volume: r.spec.volume.clone(),
            peer: r.spec.peer.clone(),
            interval_ms: r.spec.interval_ms,
            bwlimit: r.spec.bwlimit,
            chunk_size: r.spec.chunk_size,
            freeze: r
                .spec
                .freeze
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default(),
            // The token itself never leaves the agent.
            peer_token: String::new(),
            peer_ca: String::new(),
            require_point_in_time: r.spec.require_point_in_time,
            snapshots: r.spec.snapshots,
            peer_credential: r.spec.peer_credential.clone().unwrap_or_default(),
            peer_token_version: r
                .spec
                .peer_token
                .as_ref()
                .map(|t| t.version.clone())
                .unwrap_or_default(),
        }),
        role: r.role.side().name().into(),
        state: state_of(r, live).name().into(),
        epoch: r.epoch,
        last_cycle: last.map(cycle_report),
        rpo_seconds: last.map_or(-1.0, |c| (now - c.point_in_time_ms) as f64 / 1000.0),
        consistency: last.map(|c| c.consistency.clone()).unwrap_or_default(),
        last_error,
        last_error_kind: last_error_kind as i32,
        missed_intervals: live.missed_intervals,
        cycles_ok: live.cycles_ok,
        cycles_failed: live.cycles_failed,
        progress_done: live
            .progress
            .done
            .load(std::sync::atomic::Ordering::Relaxed),
        progress_total: live
            .progress
            .total
            .load(std::sync::atomic::Ordering::Relaxed),
        history: r
            .history
            .iter()
            .map(|h| control::EpochChange {
                epoch: h.epoch,
                last_common_cycle: h.last_common_cycle,
                root: h.root.clone(),
            })
            .collect(),
        paused: r.paused,
        last_snapshot: last.map(|c| c.snapshot.clone()).unwrap_or_default(),
        // Known from the cycles applied here: the agent's answer fills it in.
        handed_over: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn primary(interval_ms: u64, last_cycle_age_ms: Option<i64>) -> Record {
        let mut r = store::tests::record("app/pg");
        r.spec.interval_ms = interval_ms;
        r.last_cycle = last_cycle_age_ms.map(|age| CycleRecord {
            id: 4,
            point_in_time_ms: now_ms() - age,
            ..Default::default()
        });
        r
    }

    #[test]
    fn a_primary_whose_rpo_passes_three_intervals_is_degraded_with_the_reason() {
        let live = runner::Live::default();
        let on_time = primary(10_000, Some(25_000));
        assert_eq!(state_of(&on_time, &live), "Replicating");
        assert!(late(&on_time).is_none());
        let stalled = primary(10_000, Some(31_000));
        assert_eq!(state_of(&stalled, &live), "Degraded");
        let why = late(&stalled).unwrap();
        assert!(why.contains("RPO 31s is past 3 intervals (30s)"), "{why}");
        assert_eq!(status(&stalled, &live, None).last_error, why);
        // Paused or fenced: late by intent, said otherwise.
        let mut paused = primary(10_000, Some(60_000));
        paused.paused = true;
        assert_eq!(state_of(&paused, &live), "Paused");
        // No cycle yet: the first one is running, not late.
        assert_eq!(state_of(&primary(10_000, None), &live), "Resyncing");
    }
}
