//! The controller's Prometheus metrics: reconciles, failures, relationships by state
//! and each one's RPO, in text format on `--metrics-listen` (/metrics, /healthz).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Counters and the last seen state of every VolumeReplication.
#[derive(Default)]
pub struct Metrics {
    /// Reconciles run.
    pub reconciles: AtomicU64,
    /// Reconciles that failed (retried).
    pub failures: AtomicU64,
    /// NAMESPACE/NAME -> (state, RPO seconds).
    seen: Mutex<BTreeMap<String, (String, Option<f64>)>>,
}

impl Metrics {
    /// Records a resource's state after a reconcile.
    pub fn observe(&self, key: String, state: &str, rpo: Option<f64>) {
        self.seen
            .lock()
            .expect("metrics lock")
            .insert(key, (state.into(), rpo));
    }

    /// Forgets a deleted resource.
    pub fn forget(&self, key: &str) {
        self.seen.lock().expect("metrics lock").remove(key);
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        counter(
            &mut out,
            "mover_controller_reconciles_total",
            "Reconciles run.",
            self.reconciles.load(Relaxed),
        );
        counter(
            &mut out,
            "mover_controller_reconcile_failures_total",
            "Reconciles that failed and were retried.",
            self.failures.load(Relaxed),
        );
        let seen = self.seen.lock().expect("metrics lock");
        let mut by_state: BTreeMap<&str, u64> = BTreeMap::new();
        for (state, _) in seen.values() {
            *by_state.entry(state.as_str()).or_default() += 1;
        }
        let _ = writeln!(
            out,
            "# HELP mover_controller_relationships VolumeReplications by status.state.\n\
             # TYPE mover_controller_relationships gauge"
        );
        for (state, n) in by_state {
            let _ = writeln!(
                out,
                "mover_controller_relationships{{state=\"{state}\"}} {n}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP mover_controller_rpo_seconds Now minus the point in time of the last applied cycle.\n\
             # TYPE mover_controller_rpo_seconds gauge"
        );
        for (key, (_, rpo)) in seen.iter() {
            if let (Some(rpo), Some((ns, name))) = (rpo, key.split_once('/')) {
                let _ = writeln!(
                    out,
                    "mover_controller_rpo_seconds{{namespace=\"{ns}\",name=\"{name}\"}} {rpo}"
                );
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_states_and_rpo() {
        let m = Metrics::default();
        m.reconciles.fetch_add(3, Relaxed);
        m.observe("app/pg".into(), "Primary", Some(4.5));
        m.observe("app/web".into(), "Primary", None);
        m.observe("app/db".into(), "Secondary", None);
        m.forget("app/web");
        let text = m.render();
        assert!(
            text.contains("mover_controller_reconciles_total 3\n"),
            "{text}"
        );
        assert!(
            text.contains("mover_controller_reconcile_failures_total 0\n"),
            "{text}"
        );
        assert!(
            text.contains("mover_controller_relationships{state=\"Primary\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("mover_controller_relationships{state=\"Secondary\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("mover_controller_rpo_seconds{namespace=\"app\",name=\"pg\"} 4.5\n"),
            "{text}"
        );
        assert!(!text.contains("web"), "{text}");
    }
}
