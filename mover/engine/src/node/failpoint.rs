//! Failpoints: how the tests crash a process exactly at a named step, or widen the
//! window between two steps.

/// Aborts the process (as `kill -9` would) at a named step, when the environment
/// variable `MOVER_FAILPOINT` names it: how the tests crash an agent exactly there.
pub fn failpoint(step: &str) {
    static WANTED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    let wanted = WANTED.get_or_init(|| std::env::var("MOVER_FAILPOINT").ok());
    if wanted.as_deref() == Some(step) {
        eprintln!("mover: failpoint {step}: aborting");
        std::process::abort();
    }
}

/// Sleeps at a named step for as long as the environment variable `MOVER_PAUSE`
/// (`STEP=MILLISECONDS`) says: how the tests widen a race window (a write landing
/// between two steps that must look like one instant) until it cannot be missed.
pub fn pause(step: &str) {
    static WANTED: std::sync::OnceLock<Option<(String, u64)>> = std::sync::OnceLock::new();
    let wanted = WANTED.get_or_init(|| {
        let v = std::env::var("MOVER_PAUSE").ok()?;
        let (step, ms) = v.split_once('=')?;
        Some((step.to_string(), ms.parse().ok()?))
    });
    if let Some((_, ms)) = wanted.as_ref().filter(|(s, _)| s == step) {
        std::thread::sleep(std::time::Duration::from_millis(*ms));
    }
}
