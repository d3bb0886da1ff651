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
use crate::store::maintenance::Cutoffs;
use crate::store::Store;
use crate::store::Tx;
use serde_json::json;

pub use crate::store::maintenance::Pruned;

fn cutoff(now: i64, days: u32) -> Option<i64> {
    (days > 0).then(|| now - days as i64 * 86_400)
}

/// Applies the retention settings in one transaction; `None` while on hold.
pub fn prune(
    tx: &Tx<'_>,
    cfg: &RetentionConfig,
    root_tenant: &str,
    now: i64,
) -> ApiResult<Option<Pruned>> {
    if cfg.hold {
        return Ok(None);
    }
    let p = crate::store::maintenance::prune(
        tx,
        &Cutoffs {
            events: cutoff(now, cfg.events_days),
            audit: cutoff(now, cfg.audit_days),
            join_requests: cutoff(now, cfg.join_requests_days),
            node_certs: cutoff(now, cfg.node_certs_days),
            boot_leases: cutoff(now, cfg.boot_leases_days),
            discovery_tokens: cutoff(now, cfg.discovery_tokens_days),
        },
    )?;
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
