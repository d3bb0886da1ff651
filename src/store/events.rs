//! The event stream and the audit trail: one row each, written inside the caller's transaction.

use crate::base::error::ApiResult;
use crate::base::ids;
use rusqlite::{params, Transaction};
use serde_json::Value;

/// Publishes an event to a tenant's stream.
pub fn publish(
    tx: &Transaction<'_>,
    now: i64,
    tenant: &str,
    kind: &str,
    data: Value,
) -> ApiResult<()> {
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
    tx: &Transaction<'_>,
    now: i64,
    tenant: &str,
    action: &str,
    actor: &str,
    target: &str,
    data: Value,
) -> ApiResult<()> {
    crate::store::exec(tx,
        "INSERT INTO audit (tenant_id, action, actor, target, data, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![tenant, action, actor, target, data.to_string(), now],
    )?;
    Ok(())
}
