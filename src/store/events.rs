//! The event stream and the audit trail: one row each, written inside the caller's transaction.

use crate::base::clock::rfc3339;
use crate::base::error::ApiResult;
use crate::base::ids;
use crate::store::params;
use crate::store::Tx;
use serde_json::{json, Value};

/// Publishes an event to a tenant's stream.
pub fn publish(tx: &Tx<'_>, now: i64, tenant: &str, kind: &str, data: Value) -> ApiResult<()> {
    let id = ids::new_id("ev", now * 1000);
    crate::store::exec(
        tx,
        "INSERT INTO events (id, tenant_id, type, data, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![id, tenant, kind, data.to_string(), now],
    )?;
    Ok(())
}

/// Writes an audit row.
pub fn audit(
    tx: &Tx<'_>,
    now: i64,
    tenant: &str,
    action: &str,
    actor: &str,
    target: &str,
    data: Value,
) -> ApiResult<()> {
    crate::store::exec(tx,
        "INSERT INTO audit (tenant_id, action, actor, target, data, created_at, appliance_id) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![tenant, action, actor, target, data.to_string(), now, crate::store::appliances::this()],
    )?;
    Ok(())
}

/// Events before `before` (a `seq`), of a tenant or all, whose type starts with `prefix`, newest
/// first, at most `limit`: `(seq, event)` as `events.list` shows it.
pub fn list(
    tx: &Tx<'_>,
    before: i64,
    tenant: Option<&str>,
    prefix: &str,
    limit: i64,
) -> ApiResult<Vec<(i64, Value)>> {
    let rows = crate::store::query_all(tx, "SELECT seq, id, tenant_id, type, data, created_at FROM events
         WHERE seq < ?1 AND (CAST(?2 AS TEXT) IS NULL OR tenant_id = ?2) AND substr(type, 1, length(?3)) = ?3
         ORDER BY seq DESC LIMIT ?4", params![before, tenant, prefix, limit], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                json!({
                    "id": r.get::<_, String>(1)?,
                    "tenantId": r.get::<_, String>(2)?,
                    "type": r.get::<_, String>(3)?,
                    "data": serde_json::from_str::<Value>(&r.get::<_, String>(4)?).unwrap_or(Value::Null),
                    "createdAt": rfc3339(r.get(5)?),
                }),
            ))
        })?;
    Ok(rows)
}

/// Audit rows before `before`, of a tenant or all, whose action starts with `prefix`, at or
/// after `since`, newest first, at most `limit`: `(seq, row)` as `audit.list` shows it.
pub fn audit_list(
    tx: &Tx<'_>,
    before: i64,
    tenant: Option<&str>,
    prefix: &str,
    since: i64,
    limit: i64,
) -> ApiResult<Vec<(i64, Value)>> {
    let rows = crate::store::query_all(tx, "SELECT seq, tenant_id, action, actor, target, data, created_at, appliance_id FROM audit
         WHERE seq < ?1 AND (CAST(?2 AS TEXT) IS NULL OR tenant_id = ?2) AND substr(action, 1, length(?3)) = ?3
           AND created_at >= ?4
         ORDER BY seq DESC LIMIT ?5", params![before, tenant, prefix, since, limit], |r| {
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
                    "applianceId": r.get::<_, Option<String>>(7)?,
                }),
            ))
        })?;
    Ok(rows)
}
