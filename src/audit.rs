//! The audit trail (`audit/list`, `bca audit list`) and retention: what the server prunes, when,
//! and the audit row every pruning leaves behind.
//!
//! Retention is set in `[retention]` of `config.toml` (days; 0 keeps forever). The server applies
//! it at start and then hourly. Nothing is pruned silently: each pruning that removes anything
//! writes one `retention.pruned` audit row with the counts and cut-offs, and a log line. While
//! `hold = true` (an open investigation), nothing at all is pruned and the skip is logged.
//! `security.*` events are kept as long as audit rows, not as long as ordinary events, and a
//! node's newest certificate is never pruned.

use crate::api::{page, Ctx};
use crate::clock::rfc3339;
use crate::config::RetentionConfig;
use crate::error::{ApiError, ApiResult};
use crate::store::Store;
use crate::validate;
use rusqlite::{params, Transaction};
use serde::Deserialize;
use serde_json::{json, Value};

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

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AuditListInput {
    tenant_id: Option<String>,
    /// Only actions starting with this (`joinTokens.`, `retention.pruned`).
    action: Option<String>,
    /// Only rows at or after this time (RFC 3339).
    since: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

pub fn dispatch(
    store: &Store,
    _ctx: &Ctx<'_>,
    path: &str,
    body: &[u8],
) -> Option<ApiResult<Value>> {
    match path {
        "audit/list" => Some(crate::api::parse(body).and_then(|i| store.read(|tx| list(tx, i)))),
        _ => None,
    }
}

/// An age such as `90m`, `24h` or `7d`, in seconds (for `--since`).
pub fn parse_age(s: &str) -> Option<i64> {
    let unit = s.chars().last()?;
    let n: i64 = s[..s.len() - unit.len_utf8()]
        .parse()
        .ok()
        .filter(|n| (1..=1_000_000).contains(n))?;
    Some(
        n * match unit {
            's' => 1,
            'm' => 60,
            'h' => 3_600,
            'd' => 86_400,
            _ => return None,
        },
    )
}

/// Parses an RFC 3339 time (`2026-12-03T10:00:00Z`, offsets allowed) into Unix seconds.
pub fn parse_time(field: &str, s: &str) -> ApiResult<i64> {
    time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .map(|t| t.unix_timestamp())
        .map_err(|_| {
            ApiError::invalid_input(format!(
                "{field} must be an RFC 3339 time such as 2026-12-03T10:00:00Z"
            ))
        })
}

fn list(tx: &Transaction<'_>, i: AuditListInput) -> ApiResult<Value> {
    if let Some(t) = &i.tenant_id {
        validate::tenant_id("tenantId", t)?;
    }
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    if let Some(a) = &i.action {
        validate::prefix("action", a, 1)?;
    }
    let since = match &i.since {
        Some(s) => parse_time("since", s)?,
        None => i64::MIN,
    };
    let before = crate::api::seq_cursor(i.cursor.as_deref(), "audit.list")?;
    let prefix = i.action.unwrap_or_default();
    let mut st = tx.prepare(
        "SELECT seq, tenant_id, action, actor, target, data, created_at FROM audit
         WHERE seq < ?1 AND (?2 IS NULL OR tenant_id = ?2) AND substr(action, 1, length(?3)) = ?3
           AND created_at >= ?4
         ORDER BY seq DESC LIMIT ?5",
    )?;
    let rows = st
        .query_map(params![before, i.tenant_id, prefix, since, limit + 1], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                json!({
                    "seq": r.get::<_, i64>(0)?,
                    "tenantId": r.get::<_, String>(1)?,
                    "action": r.get::<_, String>(2)?,
                    "actor": r.get::<_, String>(3)?,
                    "target": r.get::<_, String>(4)?,
                    "data": serde_json::from_str::<Value>(&r.get::<_, String>(5)?).unwrap_or(Value::Null),
                    "createdAt": rfc3339(r.get(6)?),
                }),
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(page(rows, limit, |seq| seq.to_string()))
}
