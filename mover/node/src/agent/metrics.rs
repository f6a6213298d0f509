//! Counters exported in Prometheus text format on the agent's metrics port.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// The agent's counters.
#[derive(Default)]
pub struct Metrics {
    /// Sessions opened.
    pub sessions_opened: AtomicU64,
    /// Sessions open now.
    pub sessions_active: AtomicU64,
    /// Bytes written into exported volumes (data and zero runs).
    pub bytes_received: AtomicU64,
    /// Bytes of volume data sent to peers (uncompressed).
    pub bytes_sent: AtomicU64,
    /// Calls refused because of a stale fencing epoch.
    pub stale_epoch_refusals: AtomicU64,
    /// Calls refused for other reasons (unknown export, read-only, bad request).
    pub refusals: AtomicU64,
    /// Sessions whose volume summary came from a saved chunk index, without a read.
    pub indexed_opens: AtomicU64,
    /// Page hashes asked for by deltas and known from earlier writes, without a read.
    pub pages_known: AtomicU64,
    /// Bytes read from volumes to hash pages for deltas.
    pub pages_read_bytes: AtomicU64,
    /// New images whose pages are being hashed in the background now.
    pub pages_filling: AtomicU64,
}

impl Metrics {
    /// Prometheus text exposition of all counters.
    pub fn render(&self) -> String {
        let rows: [(&str, &str, &str, &AtomicU64); 10] = [
            (
                "mover_agent_sessions_opened_total",
                "counter",
                "Transfer sessions opened.",
                &self.sessions_opened,
            ),
            (
                "mover_agent_sessions_active",
                "gauge",
                "Transfer sessions open now.",
                &self.sessions_active,
            ),
            (
                "mover_agent_received_bytes_total",
                "counter",
                "Bytes written into exported volumes.",
                &self.bytes_received,
            ),
            (
                "mover_agent_sent_bytes_total",
                "counter",
                "Volume bytes sent to peers.",
                &self.bytes_sent,
            ),
            (
                "mover_agent_stale_epoch_refusals_total",
                "counter",
                "Writes refused for a stale fencing epoch.",
                &self.stale_epoch_refusals,
            ),
            (
                "mover_agent_refusals_total",
                "counter",
                "Calls refused: unknown export, read-only, bad request.",
                &self.refusals,
            ),
            (
                "mover_agent_indexed_opens_total",
                "counter",
                "Sessions whose volume summary came from a saved chunk index, without reading the volume.",
                &self.indexed_opens,
            ),
            (
                "mover_agent_page_hashes_known_total",
                "counter",
                "Page hashes answered to deltas from the record of earlier writes, without reading the volume.",
                &self.pages_known,
            ),
            (
                "mover_agent_page_hash_read_bytes_total",
                "counter",
                "Bytes read from volumes to hash pages for deltas.",
                &self.pages_read_bytes,
            ),
            (
                "mover_agent_page_hashing_active",
                "gauge",
                "New images whose pages are being hashed in the background for the next delta.",
                &self.pages_filling,
            ),
        ];
        let mut out = String::new();
        for (name, kind, help, v) in rows {
            out += &format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}\n",
                v.load(Relaxed)
            );
        }
        out
    }
}
