//! Retention: which snapshots `forget` keeps.
//!
//! Snapshots are grouped by volume. Within a group, newest first, a snapshot is kept
//! by `last` if it is among the newest `last`, and by `hourly`/`daily`/`weekly`/
//! `monthly` if it is the newest of its hour/day/ISO week/month (UTC) and fewer than
//! that many such periods have been kept. The newest snapshot of every group is
//! always kept.

use crate::manifest::Snapshot;
use std::collections::BTreeMap;

/// How many snapshots to keep, per rule.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct KeepPolicy {
    /// The newest N.
    pub last: u32,
    /// The newest of each of the last N hours that have snapshots.
    pub hourly: u32,
    /// The newest of each of the last N days.
    pub daily: u32,
    /// The newest of each of the last N weeks.
    pub weekly: u32,
    /// The newest of each of the last N months.
    pub monthly: u32,
}

impl KeepPolicy {
    /// Whether no rule is set (forget would keep only the newest of each volume).
    pub fn is_empty(&self) -> bool {
        *self == KeepPolicy::default()
    }
}

/// A snapshot and why it is kept (empty: forgotten).
#[derive(Clone, Debug)]
pub struct Decision {
    /// The snapshot.
    pub snapshot: Snapshot,
    /// The rules that keep it, e.g. `["last", "daily"]`.
    pub reasons: Vec<&'static str>,
}

/// Days since 1970-01-01 → (year, month).
fn year_month(days: i64) -> (i64, u32) {
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + if m <= 2 { 1 } else { 0 };
    (y, m)
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) for Unix seconds.
pub fn format_time(t: i64) -> String {
    let days = t.div_euclid(86_400);
    let secs = t.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let (y, m) = year_month(days);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

/// Applies `policy` to `snapshots`; returns every snapshot with its reasons.
pub fn apply(snapshots: &[Snapshot], policy: &KeepPolicy) -> Vec<Decision> {
    let mut groups: BTreeMap<&str, Vec<&Snapshot>> = BTreeMap::new();
    for s in snapshots {
        groups.entry(&s.manifest.volume).or_default().push(s);
    }
    let mut out = Vec::new();
    for (_, mut snaps) in groups {
        // Newest first, to the nanosecond: two snapshots within one second are not
        // ordered by their (random) ids.
        let key = |s: &Snapshot| (s.manifest.time, s.manifest.time_nanos);
        snaps.sort_by(|a, b| (key(b), &b.id).cmp(&(key(a), &a.id)));
        type Bucket = fn(i64) -> i64;
        let rules: [(&'static str, u32, Bucket); 4] = [
            ("hourly", policy.hourly, |t| t.div_euclid(3600)),
            ("daily", policy.daily, |t| t.div_euclid(86_400)),
            // ISO weeks start on Monday; 1970-01-01 was a Thursday.
            ("weekly", policy.weekly, |t| {
                (t.div_euclid(86_400) + 3).div_euclid(7)
            }),
            ("monthly", policy.monthly, |t| {
                let (y, m) = year_month(t.div_euclid(86_400));
                y * 12 + m as i64
            }),
        ];
        let mut left: Vec<u32> = rules.iter().map(|r| r.1).collect();
        let mut last_bucket: Vec<Option<i64>> = vec![None; rules.len()];
        for (i, s) in snaps.iter().enumerate() {
            let mut reasons = Vec::new();
            if i == 0 {
                reasons.push("newest");
            }
            if (i as u32) < policy.last {
                reasons.push("last");
            }
            for (r, (name, _, bucket)) in rules.iter().enumerate() {
                let b = bucket(s.manifest.time);
                if left[r] > 0 && last_bucket[r] != Some(b) {
                    last_bucket[r] = Some(b);
                    left[r] -= 1;
                    reasons.push(name);
                }
            }
            out.push(Decision {
                snapshot: (*s).clone(),
                reasons,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{Content, MANIFEST_VERSION, Manifest, SnapshotSummary};

    fn snap(id: &str, time: i64) -> Snapshot {
        Snapshot {
            id: id.into(),
            manifest: Manifest {
                version: MANIFEST_VERSION,
                time,
                time_nanos: 0,
                hostname: "h".into(),
                volume: "v".into(),
                tags: vec![],
                parent: None,
                content: Content::Block {
                    size: 0,
                    chunk_size: 1 << 20,
                    chunks_per_list: 1,
                    lists: vec![],
                },
                summary: SnapshotSummary::default(),
            },
        }
    }

    #[test]
    fn time_format() {
        assert_eq!(format_time(0), "1970-01-01 00:00:00");
        assert_eq!(format_time(1_763_728_200), "2025-11-21 12:30:00");
        assert_eq!(format_time(951_782_400), "2000-02-29 00:00:00");
    }

    #[test]
    fn daily_keeps_newest_per_day_and_last_n() {
        let day = 86_400;
        // Three snapshots a day for 5 days.
        let snaps: Vec<_> = (0..15)
            .map(|i| {
                snap(
                    &format!("{i:02}"),
                    10 * day + (i / 3) * day + (i % 3) * 3600,
                )
            })
            .collect();
        let policy = KeepPolicy {
            last: 2,
            daily: 3,
            ..Default::default()
        };
        let kept: Vec<String> = apply(&snaps, &policy)
            .into_iter()
            .filter(|d| !d.reasons.is_empty())
            .map(|d| d.snapshot.id)
            .collect();
        // Newest two (14, 13), and the newest of the last three days (14, 11, 8).
        assert_eq!(kept, vec!["14", "13", "11", "08"]);
        let monthly = apply(
            &snaps,
            &KeepPolicy {
                monthly: 5,
                ..Default::default()
            },
        );
        assert_eq!(monthly.iter().filter(|d| !d.reasons.is_empty()).count(), 1);
    }

    #[test]
    fn snapshots_within_one_second_are_ordered_by_nanoseconds() {
        let mut older = snap("ff", 100);
        older.manifest.time_nanos = 100;
        let mut newer = snap("00", 100);
        newer.manifest.time_nanos = 900;
        let policy = KeepPolicy {
            last: 1,
            ..Default::default()
        };
        let kept: Vec<String> = apply(&[older, newer], &policy)
            .into_iter()
            .filter(|d| !d.reasons.is_empty())
            .map(|d| d.snapshot.id)
            .collect();
        assert_eq!(kept, vec!["00"]);
    }
}
