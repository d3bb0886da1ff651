//! `[retention]`: how long each kind of row is kept (days; 0 keeps forever) and the hold.

use serde::{Deserialize, Serialize};

/// The `[retention]` section of `config.toml`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// Events (other than `security.*`), in days; 0 keeps them forever.
    #[serde(default = "d90")]
    pub events_days: u32,
    /// Audit rows and `security.*` events, in days; 0 keeps them forever.
    #[serde(default = "d365")]
    pub audit_days: u32,
    /// Decided join requests (approved, rejected, expired, consumed), counted from the decision.
    #[serde(default = "d30")]
    pub join_requests_days: u32,
    /// Node certificates expired for longer than this (a node's newest is always kept).
    #[serde(default = "d30")]
    pub node_certs_days: u32,
    /// Boot leases (who booted what, when).
    #[serde(default = "d30")]
    pub boot_leases_days: u32,
    /// Discovery tokens spent, voided or expired for longer than this (hashes only; a boot flood
    /// mints many).
    #[serde(default = "d1")]
    pub discovery_tokens_days: u32,
    /// An open investigation: prune nothing until this is false again.
    #[serde(default)]
    pub hold: bool,
}

fn d1() -> u32 {
    1
}
fn d30() -> u32 {
    30
}
fn d90() -> u32 {
    90
}
fn d365() -> u32 {
    365
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            events_days: d90(),
            audit_days: d365(),
            join_requests_days: d30(),
            node_certs_days: d30(),
            boot_leases_days: d30(),
            discovery_tokens_days: d1(),
            hold: false,
        }
    }
}

impl RetentionConfig {
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("events_days", self.events_days),
            ("audit_days", self.audit_days),
            ("join_requests_days", self.join_requests_days),
            ("node_certs_days", self.node_certs_days),
            ("boot_leases_days", self.boot_leases_days),
            ("discovery_tokens_days", self.discovery_tokens_days),
        ] {
            if v > 36_500 {
                return Err(format!("retention.{name} must be 0 (keep) to 36500"));
            }
        }
        Ok(())
    }
}
