//! Scheduled snapshots (shared/DESIGN.md §6 snapshot): an agent snapshots one of its
//! exports into a repository at set times, forgets old snapshots by a retention policy
//! and prunes at a cadence. A schedule is kept in the agent's state directory as a
//! `schedule.proto` Record (its repository password and keys included: the directory
//! is root's only) and runs as one task ([`Schedules`]).

mod runner;
mod when;

pub use runner::{ApplyError, Schedules};
pub use when::{MIN_INTERVAL, When};

use std::time::Duration;

/// The longest duration accepted: a year.
const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// A Go-style duration: "90s", "5m", "1h30m", "500ms".
pub fn parse_go_duration(s: &str) -> Result<Duration, String> {
    let mut rest = s.trim();
    if rest.is_empty() {
        return Err("empty; give e.g. 5m".into());
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let n = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let value: u64 = rest[..n]
            .parse()
            .map_err(|_| "expected a number followed by h, m, s or ms (e.g. 5m)".to_string())?;
        rest = &rest[n..];
        let u = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = match &rest[..u] {
            "h" => Duration::from_secs(3600),
            "m" => Duration::from_secs(60),
            "s" => Duration::from_secs(1),
            "ms" => Duration::from_millis(1),
            other => {
                return Err(format!(
                    "unknown unit {other:?}: use h, m, s or ms (e.g. 5m)"
                ));
            }
        };
        rest = &rest[u..];
        total = u32::try_from(value)
            .ok()
            .and_then(|v| unit.checked_mul(v))
            .and_then(|d| total.checked_add(d))
            .filter(|t| *t <= MAX_DURATION)
            .ok_or_else(|| "longer than a year".to_string())?;
    }
    Ok(total)
}
