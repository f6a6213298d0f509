//! Prometheus label values, shared by every job's metrics and the agent's.

/// A Prometheus label value, escaped (backslash, double quote, newline).
pub fn label_value(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
