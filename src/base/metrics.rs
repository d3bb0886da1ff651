//! Process-wide counters for `GET /metrics` (Prometheus text format) and the health checks.
//!
//! The counters are plain atomics bumped where the work happens (the JoinService writer, the DHCP
//! and TFTP loops); refusals are counted by their reason. Nothing here holds a secret: a reason is
//! one of the fixed strings of `admission::Reason` or `renewal::RenewReason`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, OnceLock};

#[derive(Default)]
pub struct Metrics {
    pub joins_issued: AtomicU64,
    pub joins_deferred: AtomicU64,
    pub joins_refused: AtomicU64,
    pub joins_busy: AtomicU64,
    pub renewals_issued: AtomicU64,
    pub renewals_refused: AtomicU64,
    pub dhcp_requests: AtomicU64,
    pub dhcp_answers: AtomicU64,
    pub tftp_transfers: AtomicU64,
    pub tftp_failures: AtomicU64,
    pub tftp_refused_busy: AtomicU64,
    pub tftp_bytes: AtomicU64,
    pub boot_http_requests: AtomicU64,
    /// Restarts of the network child (`privsep`).
    pub privsep_restarts: AtomicU64,
    /// DHCP sightings the core recorded (a MAC seen at an address: `boot::gate`).
    pub boot_sightings: AtomicU64,
    /// Jobs handed to the JoinService writer and not yet taken by it.
    pub queue_depth: AtomicI64,
    pub commits: AtomicU64,
    pub commit_seconds_micros: AtomicU64,
    pub commit_max_micros: AtomicU64,
    refusals: Mutex<BTreeMap<&'static str, u64>>,
    skews: Mutex<Skews>,
}

/// The clock differences (peer minus appliance, seconds) that agents reported in signed renewals:
/// the latest per node, for the most recent [`SKEW_NODES`] nodes. One sample per node, so that
/// one node (even a revoked one, whose certificate still passes TLS) cannot move the median.
#[derive(Default)]
struct Skews {
    by_node: std::collections::HashMap<String, (i64, u64)>,
    seq: u64,
}

const SKEW_NODES: usize = 256;

/// The edge's counters (DHCP, TFTP, boot HTTP) as the network child reports them with a
/// `/metrics` request: they live in its memory, and restart from zero with it (a counter reset,
/// which Prometheus expects).
#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EdgeCounts {
    pub dhcp_requests: u64,
    pub dhcp_answers: u64,
    pub tftp_transfers: u64,
    pub tftp_failures: u64,
    pub tftp_refused_busy: u64,
    pub tftp_bytes: u64,
    pub boot_http_requests: u64,
}

pub fn get() -> &'static Metrics {
    static M: OnceLock<Metrics> = OnceLock::new();
    M.get_or_init(Metrics::default)
}

impl Metrics {
    pub fn refused(&self, reason: &'static str) {
        *self
            .refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(reason)
            .or_default() += 1;
    }

    pub fn commit(&self, micros: u64) {
        self.commits.fetch_add(1, Relaxed);
        self.commit_seconds_micros.fetch_add(micros, Relaxed);
        self.commit_max_micros.fetch_max(micros, Relaxed);
    }

    /// Records how far a node's signed clock is from ours.
    pub fn skew(&self, node: &str, peer_minus_ours: i64) {
        let mut s = self.skews.lock().unwrap_or_else(|p| p.into_inner());
        s.seq += 1;
        let seq = s.seq;
        s.by_node.insert(node.to_string(), (peer_minus_ours, seq));
        if s.by_node.len() > SKEW_NODES {
            if let Some(oldest) = s
                .by_node
                .iter()
                .min_by_key(|(_, (_, q))| *q)
                .map(|(k, _)| k.clone())
            {
                s.by_node.remove(&oldest);
            }
        }
    }

    /// The median over nodes and how many nodes it covers.
    pub fn median_skew(&self) -> Option<(i64, usize)> {
        let s = self.skews.lock().unwrap_or_else(|p| p.into_inner());
        if s.by_node.is_empty() {
            return None;
        }
        let mut v: Vec<i64> = s.by_node.values().map(|(k, _)| *k).collect();
        v.sort_unstable();
        Some((v[v.len() / 2], v.len()))
    }

    /// The Prometheus text exposition (format 0.0.4).
    /// This process's edge counters.
    pub fn edge_counts(&self) -> EdgeCounts {
        EdgeCounts {
            dhcp_requests: self.dhcp_requests.load(Relaxed),
            dhcp_answers: self.dhcp_answers.load(Relaxed),
            tftp_transfers: self.tftp_transfers.load(Relaxed),
            tftp_failures: self.tftp_failures.load(Relaxed),
            tftp_refused_busy: self.tftp_refused_busy.load(Relaxed),
            tftp_bytes: self.tftp_bytes.load(Relaxed),
            boot_http_requests: self.boot_http_requests.load(Relaxed),
        }
    }

    /// The Prometheus text; `edge` adds the network child's counters to this process's.
    pub fn render(&self, sessions: usize, edge: Option<&EdgeCounts>) -> String {
        let own = self.edge_counts();
        let child = edge.copied().unwrap_or_default();
        let e = |f: fn(&EdgeCounts) -> u64| f(&own).saturating_add(f(&child)) as f64;
        let mut o = String::new();
        // A summary's `_count` and `_sum` ride in the label slot as name suffixes.
        let mut counter = |name: &str, help: &str, kind: &str, samples: &[(String, f64)]| {
            let _ = writeln!(o, "# HELP bca_{name} {help}\n# TYPE bca_{name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(o, "bca_{name}{labels} {v}");
            }
        };
        let l = |v: &AtomicU64| v.load(Relaxed) as f64;
        counter(
            "joins_total",
            "Joins answered, by outcome.",
            "counter",
            &[
                ("{outcome=\"issued\"}".into(), l(&self.joins_issued)),
                ("{outcome=\"deferred\"}".into(), l(&self.joins_deferred)),
                ("{outcome=\"refused\"}".into(), l(&self.joins_refused)),
                ("{outcome=\"busy\"}".into(), l(&self.joins_busy)),
            ],
        );
        let refusals: Vec<(String, f64)> = self
            .refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(r, n)| (format!("{{reason=\"{r}\"}}"), *n as f64))
            .collect();
        counter(
            "refusals_total",
            "Refused joins and renewals, by reason.",
            "counter",
            &refusals,
        );
        counter(
            "renewals_total",
            "Renewals answered, by outcome.",
            "counter",
            &[
                ("{outcome=\"issued\"}".into(), l(&self.renewals_issued)),
                ("{outcome=\"refused\"}".into(), l(&self.renewals_refused)),
            ],
        );
        counter(
            "sessions",
            "Live node sessions on the gateway.",
            "gauge",
            &[(String::new(), sessions as f64)],
        );
        counter(
            "dhcp_requests_total",
            "DHCP packets received.",
            "counter",
            &[(String::new(), e(|c| c.dhcp_requests))],
        );
        counter(
            "dhcp_answers_total",
            "DHCP answers sent.",
            "counter",
            &[(String::new(), e(|c| c.dhcp_answers))],
        );
        counter(
            "tftp_transfers_total",
            "TFTP transfers, by result.",
            "counter",
            &[
                ("{result=\"complete\"}".into(), e(|c| c.tftp_transfers)),
                ("{result=\"failed\"}".into(), e(|c| c.tftp_failures)),
                ("{result=\"busy\"}".into(), e(|c| c.tftp_refused_busy)),
            ],
        );
        counter(
            "tftp_bytes_total",
            "Bytes of file data sent over TFTP.",
            "counter",
            &[(String::new(), e(|c| c.tftp_bytes))],
        );
        counter(
            "boot_http_requests_total",
            "Boot scripts and files served over HTTP.",
            "counter",
            &[(String::new(), e(|c| c.boot_http_requests))],
        );
        counter(
            "boot_sightings_total",
            "DHCP sightings recorded: a MAC seen at an address by a broadcast or a listed relay.",
            "counter",
            &[(String::new(), l(&self.boot_sightings))],
        );
        counter(
            "privsep_child_restarts_total",
            "Restarts of the network child after it ended unasked.",
            "counter",
            &[(String::new(), l(&self.privsep_restarts))],
        );
        counter(
            "queue_depth",
            "Work waiting for the JoinService writer.",
            "gauge",
            &[(String::new(), self.queue_depth.load(Relaxed).max(0) as f64)],
        );
        let commits = self.commits.load(Relaxed);
        counter(
            "commit_seconds",
            "Durable commits of the JoinService writer: count, total and largest duration.",
            "summary",
            &[
                ("_count".into(), commits as f64),
                (
                    "_sum".into(),
                    self.commit_seconds_micros.load(Relaxed) as f64 / 1e6,
                ),
            ],
        );
        let _ = writeln!(
            o,
            "# HELP bca_commit_seconds_max The longest durable commit since start.\n# TYPE bca_commit_seconds_max gauge\nbca_commit_seconds_max {}",
            self.commit_max_micros.load(Relaxed) as f64 / 1e6
        );
        o
    }
}

pub fn count_privsep_restart() {
    get().privsep_restarts.fetch_add(1, Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_node_cannot_move_the_clock_median() {
        let m = Metrics::default();
        for i in 0..9 {
            m.skew(&format!("node_{i}"), 1);
        }
        for _ in 0..1000 {
            m.skew("node_liar", -3600);
        }
        assert_eq!(m.median_skew(), Some((1, 10)));
        for i in 0..(SKEW_NODES + 50) {
            m.skew(&format!("n{i}"), 2);
        }
        assert_eq!(m.median_skew().unwrap().1, SKEW_NODES);
    }
}
