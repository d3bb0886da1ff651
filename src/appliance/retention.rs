//! Retention: what the server prunes, when, and the audit row every pruning leaves behind.
//!
//! Retention is set in `[retention]` of `config.toml` (days; 0 keeps forever). The server applies
//! it at start and then hourly. Nothing is pruned silently: each pruning that removes anything
//! writes one `retention.pruned` audit row with the counts and cut-offs, and a log line. While
//! `hold = true` (an open investigation), nothing at all is pruned and the skip is logged.
//! `security.*` events are kept as long as audit rows, not as long as ordinary events, and a
//! node's newest certificate is never pruned.

use crate::base::error::ApiResult;
use crate::config::RetentionConfig;
use crate::store::Store;
use rusqlite::{params, Transaction};
use serde_json::json;

/// What one pruning removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub events: usize,
    pub audit: usize,
    pub join_requests: usize,
    pub node_certs: usize,
    pub boot_leases: usize,
    pub discovery_tokens: usize,
}

impl Pruned {
    fn total(&self) -> usize {
        self.events
            + self.audit
            + self.join_requests
            + self.node_certs
            + self.boot_leases
            + self.discovery_tokens
    }
}

fn cutoff(now: i64, days: u32) -> Option<i64> {
    (days > 0).then(|| now - days as i64 * 86_400)
}

/// Applies the retention settings in one transaction; `None` while on hold.
pub fn prune(
    tx: &Transaction<'_>,
    cfg: &RetentionConfig,
    root_tenant: &str,
    now: i64,
) -> ApiResult<Option<Pruned>> {
    if cfg.hold {
        return Ok(None);
    }
    let mut p = Pruned::default();
    let audit_cut = cutoff(now, cfg.audit_days);
    if let Some(c) = cutoff(now, cfg.events_days) {
        p.events += tx.execute(
            "DELETE FROM events WHERE created_at < ?1 AND substr(type, 1, 9) != 'security.'",
            params![c],
        )?;
    }
    if let Some(c) = audit_cut {
        p.events += tx.execute(
            "DELETE FROM events WHERE created_at < ?1 AND substr(type, 1, 9) = 'security.'",
            params![c],
        )?;
        p.audit += tx.execute("DELETE FROM audit WHERE created_at < ?1", params![c])?;
    }
    if let Some(c) = cutoff(now, cfg.join_requests_days) {
        p.join_requests += tx.execute(
            "DELETE FROM join_requests WHERE state != 'pending'
               AND coalesce(consumed_at, decided_at, expires_at) < ?1",
            params![c],
        )?;
    }
    if let Some(c) = cutoff(now, cfg.node_certs_days) {
        p.node_certs += tx.execute(
            "DELETE FROM node_certs WHERE not_after < ?1
               AND serial NOT IN (SELECT serial FROM node_certs n
                                  WHERE n.created_at = (SELECT max(created_at) FROM node_certs m
                                                        WHERE m.node_id = n.node_id))",
            params![c],
        )?;
    }
    if let Some(c) = cutoff(now, cfg.boot_leases_days) {
        p.boot_leases += tx.execute("DELETE FROM boot_leases WHERE created_at < ?1", params![c])?;
    }
    if let Some(c) = cutoff(now, cfg.discovery_tokens_days) {
        // Spent, voided or expired before the cut-off; a live token is never pruned.
        p.discovery_tokens += tx.execute(
            "DELETE FROM discovery_tokens WHERE spent_at < ?1 OR voided_at < ?1 OR expires_at < ?1",
            params![c],
        )?;
    }
    if p.total() > 0 {
        crate::store::events::audit(
            tx,
            now,
            root_tenant,
            "retention.pruned",
            "bca",
            "retention",
            json!({
                "events": p.events,
                "audit": p.audit,
                "joinRequests": p.join_requests,
                "nodeCerts": p.node_certs,
                "bootLeases": p.boot_leases,
                "discoveryTokens": p.discovery_tokens,
                "settings": {
                    "eventsDays": cfg.events_days,
                    "auditDays": cfg.audit_days,
                    "joinRequestsDays": cfg.join_requests_days,
                    "nodeCertsDays": cfg.node_certs_days,
                    "bootLeasesDays": cfg.boot_leases_days,
                    "discoveryTokensDays": cfg.discovery_tokens_days,
                },
            }),
        )?;
    }
    Ok(Some(p))
}

/// Runs [`prune`] and logs what it did.
pub fn apply(store: &Store, cfg: &RetentionConfig, root_tenant: &str, now: i64) {
    match store.write(|tx| prune(tx, cfg, root_tenant, now)) {
        Ok(None) => tracing::warn!("retention: on hold (retention.hold = true); nothing pruned"),
        Ok(Some(p)) if p.total() > 0 => tracing::info!(
            events = p.events,
            audit = p.audit,
            join_requests = p.join_requests,
            node_certs = p.node_certs,
            boot_leases = p.boot_leases,
            "retention: pruned (recorded as audit action retention.pruned)"
        ),
        Ok(Some(_)) => {}
        Err(e) => tracing::error!(error = %e, "retention: pruning failed; nothing was removed"),
    }
}
