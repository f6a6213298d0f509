//! Failpoints: how the tests crash a process exactly at a named step.

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
