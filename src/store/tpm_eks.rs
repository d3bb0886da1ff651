//! The `tpm` attestor's EK allow-list, as operators keep it.

use crate::base::clock::rfc3339;
use crate::base::error::ApiResult;
use crate::store::Tx;
use crate::store::{params, OptionalExtension};
use serde_json::{json, Value};

const COLS: &str = "ek_sha256, tenant_id, pool_id, note, created_at, created_by";

fn row(r: &crate::store::Row) -> crate::store::SqlResult<Value> {
    Ok(json!({
        "ekSha256": r.get::<_, String>(0)?,
        "tenantId": r.get::<_, String>(1)?,
        "poolId": r.get::<_, String>(2)?,
        "note": r.get::<_, Option<String>>(3)?,
        "createdAt": rfc3339(r.get(4)?),
        "createdBy": r.get::<_, String>(5)?,
    }))
}

/// An allow-list entry, as `tpmEks.list` shows it.
pub fn get(tx: &Tx<'_>, hash: &str) -> ApiResult<Option<Value>> {
    Ok(crate::store::query_row(
        tx,
        &format!("SELECT {COLS} FROM tpm_eks WHERE ek_sha256 = ?1"),
        [hash],
        row,
    )
    .optional()?)
}

pub fn insert(
    tx: &Tx<'_>,
    hash: &str,
    (tenant, pool): (&str, &str),
    note: Option<&str>,
    (now, by): (i64, &str),
) -> ApiResult<()> {
    crate::store::exec(tx,
        "INSERT INTO tpm_eks (ek_sha256, tenant_id, pool_id, note, created_at, created_by) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
        params![hash, tenant, pool, note, now, by],
    )?;
    Ok(())
}

/// A tenant's entries (of one pool, or all) after `after`, at most `limit`: `(hash, entry)`.
pub fn list(
    tx: &Tx<'_>,
    tenant: &str,
    pool: Option<&str>,
    after: &str,
    limit: i64,
) -> ApiResult<Vec<(String, Value)>> {
    let rows = crate::store::query_all(tx, &format!(
        "SELECT {COLS} FROM tpm_eks WHERE tenant_id = ?1 AND (CAST(?2 AS TEXT) IS NULL OR pool_id = ?2) AND ek_sha256 > ?3
         ORDER BY ek_sha256 LIMIT ?4"
    ), params![tenant, pool, after, limit], |r| {
            Ok((r.get::<_, String>(0)?, row(r)?))
        })?;
    Ok(rows)
}

pub fn remove(tx: &Tx<'_>, hash: &str) -> ApiResult<()> {
    crate::store::exec(tx, "DELETE FROM tpm_eks WHERE ek_sha256 = ?1", [hash])?;
    Ok(())
}
