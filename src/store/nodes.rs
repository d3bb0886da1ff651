//! Node certificates: revoking every live one of a node (a reclaim, `nodes/revoke-identity`,
//! `nodes/delete`), each with its `security.certificate-revoked` event.

use crate::base::error::ApiResult;
use rusqlite::{params, Transaction};
use serde_json::json;

/// Revokes every unrevoked certificate of `node_id` (`reason`, with a
/// `security.certificate-revoked` event for each).
pub fn revoke_all(
    tx: &Transaction<'_>,
    tenant: &str,
    node_id: &str,
    reason: &str,
    now: i64,
) -> ApiResult<Vec<String>> {
    let serials: Vec<String> = tx
        .prepare("SELECT serial FROM node_certs WHERE node_id = ?1 AND revoked_at IS NULL")?
        .query_map([node_id], |row| row.get(0))?
        .collect::<Result<_, _>>()?;
    for serial in &serials {
        crate::store::exec(
            tx,
            "UPDATE node_certs SET revoked_at = ?2, revoke_reason = ?3 WHERE serial = ?1",
            params![serial, now, reason],
        )?;
        crate::store::events::publish(
            tx,
            now,
            tenant,
            "security.certificate-revoked",
            json!({"nodeId": node_id, "serial": serial, "reason": reason}),
        )?;
    }
    Ok(serials)
}
