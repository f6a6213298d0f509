//! Durations as mover's users write them.

use std::time::Duration;

/// The longest duration accepted: a year.
const MAX_DURATION: Duration = Duration::from_secs(366 * 24 * 3600);

/// A duration, the one grammar of every interval mover takes (CLI flags, schedules,
/// the controller's class parameters): Go-style, as csi-addons' `schedulingInterval`
/// is written ("90s", "5m", "1h30m", "500ms"), or a bare number of seconds ("30").
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let mut rest = s.trim();
    if rest.is_empty() {
        return Err("empty; give e.g. 5m".into());
    }
    if let Ok(secs) = rest.parse::<u64>() {
        return Some(Duration::from_secs(secs))
            .filter(|t| *t <= MAX_DURATION)
            .ok_or_else(|| "longer than a year".to_string());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_and_bare_seconds_parse_and_nothing_else() {
        assert_eq!(parse_duration("30"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1h30m"), Ok(Duration::from_secs(5400)));
        for bad in ["", "5 minutes", "1d", "m", "-5s", "400d", "9999999h"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} parsed");
        }
    }
}
