//! When a schedule runs: every interval, at a minute of every hour, or at a time of
//! every day (UTC).

use std::time::Duration;
use transport::cluster::MIN_SNAPSHOT_INTERVAL;

/// A schedule's times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// The interval between the starts of two runs ("30m", "1h").
    Every(Duration),
    /// At this minute of every hour ("hourly:15").
    Hourly {
        /// 0..=59.
        minute: u32,
    },
    /// At this time of every day, UTC ("daily:02:30").
    Daily {
        /// 0..=23.
        hour: u32,
        /// 0..=59.
        minute: u32,
    },
}

impl When {
    /// Parses "30m" / "1h30m" (an interval), "hourly:MM" or "daily:HH:MM".
    pub fn parse(s: &str) -> Result<When, String> {
        let s = s.trim();
        let number = |t: &str, max: u32, what: &str| -> Result<u32, String> {
            t.parse::<u32>()
                .ok()
                .filter(|n| *n <= max)
                .ok_or_else(|| format!("{what} {t:?} is not a number from 0 to {max}"))
        };
        if let Some(m) = s.strip_prefix("hourly:") {
            return Ok(When::Hourly {
                minute: number(m, 59, "minute")?,
            });
        }
        if let Some(hm) = s.strip_prefix("daily:") {
            let (h, m) = hm
                .split_once(':')
                .ok_or_else(|| format!("{s:?}: write daily:HH:MM (UTC), e.g. daily:02:30"))?;
            return Ok(When::Daily {
                hour: number(h, 23, "hour")?,
                minute: number(m, 59, "minute")?,
            });
        }
        let every = mover_engine::node::parse_duration(s).map_err(|e| {
            format!("{s:?}: {e}; a schedule is an interval (30m, 1h), hourly:MM or daily:HH:MM")
        })?;
        if every < MIN_SNAPSHOT_INTERVAL {
            return Err(format!(
                "{s:?} is shorter than {}s: for tighter recovery points replicate instead \
                 (`mover replicate`)",
                MIN_SNAPSHOT_INTERVAL.as_secs()
            ));
        }
        Ok(When::Every(every))
    }

    /// The next run (Unix ms) after `now`, the last run having started at `last`.
    pub fn next(&self, now_ms: i64, last_ms: Option<i64>) -> i64 {
        let at_offset = |period: i64, offset: i64| {
            let base = now_ms - now_ms.rem_euclid(period) + offset;
            if base > now_ms { base } else { base + period }
        };
        match *self {
            // The first run at once; then one interval after the last start, or at once
            // when that time has passed (an agent down over a run does not wait another
            // whole interval).
            When::Every(d) => last_ms.map_or(now_ms, |l| (l + d.as_millis() as i64).max(now_ms)),
            When::Hourly { minute } => at_offset(3_600_000, i64::from(minute) * 60_000),
            When::Daily { hour, minute } => at_offset(
                86_400_000,
                (i64::from(hour) * 3600 + i64::from(minute) * 60) * 1000,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_computes_the_next_run() {
        assert_eq!(
            When::parse("1h30m").unwrap(),
            When::Every(Duration::from_secs(5400))
        );
        assert_eq!(
            When::parse("hourly:15").unwrap(),
            When::Hourly { minute: 15 }
        );
        assert_eq!(
            When::parse("daily:02:30").unwrap(),
            When::Daily {
                hour: 2,
                minute: 30
            }
        );
        for bad in [
            "10s",
            "hourly:60",
            "daily:24:00",
            "daily:2",
            "weekly",
            "",
            "4294967356s",
            "99999999h",
            "9000h9000h",
        ] {
            assert!(When::parse(bad).is_err(), "{bad}");
        }
        // 2026-11-25 10:20:00 UTC.
        let now = 1_795_602_000_000;
        let hour = When::Hourly { minute: 15 };
        assert_eq!(hour.next(now, None), now + 55 * 60_000, "11:15");
        let day = When::Daily {
            hour: 2,
            minute: 30,
        };
        assert_eq!(
            day.next(now, None),
            now + (16 * 60 + 10) * 60_000,
            "02:30 tomorrow"
        );
        let every = When::Every(Duration::from_secs(3600));
        assert_eq!(every.next(now, None), now, "the first run at once");
        assert_eq!(every.next(now, Some(now - 600_000)), now + 3_000_000);
        assert_eq!(
            every.next(now, Some(now - 7_200_000)),
            now,
            "overdue: at once"
        );
    }
}
