//! Join requests, as the `discovery` and `tpm` attestors keep them and operators decide them.

use crate::base::clock::rfc3339;
use crate::base::error::ApiResult;
use crate::store::Tx;
use crate::store::{params, OptionalExtension};
use serde_json::{json, Value};

/// Marks requests past their expiry `expired`.
pub fn expire(tx: &Tx<'_>, now: i64) -> ApiResult<()> {
    crate::store::exec(tx,
        "UPDATE join_requests SET state = 'expired', updated_at = ?1 WHERE state IN ('pending', 'approved') AND expires_at <= ?1",
        [now],
    )?;
    Ok(())
}

/// Whether an operator rejected this machine's request for this CSR.
pub fn rejected(tx: &Tx<'_>, machine_key: &str, csr_hex: &str) -> ApiResult<bool> {
    Ok(crate::store::query_row(tx,
            "SELECT id FROM join_requests WHERE machine_key = ?1 AND state = 'rejected' AND csr_sha256 = ?2",
            params![machine_key, csr_hex],
            |x| x.get::<_, String>(0),
        )
        .optional()?
        .is_some())
}

/// A machine's open request: id, state (`pending` or `approved`), pool, CSR hash.
pub type Open = (String, String, Option<String>, String);

/// A machine's newest open request.
pub fn open(tx: &Tx<'_>, machine_key: &str) -> ApiResult<Option<Open>> {
    Ok(crate::store::query_row(tx,
            "SELECT id, state, pool_id, csr_sha256 FROM join_requests WHERE machine_key = ?1 AND state IN ('pending', 'approved')
             ORDER BY created_at DESC LIMIT 1",
            [machine_key],
            |x| Ok((x.get(0)?, x.get(1)?, x.get(2)?, x.get(3)?)),
        )
        .optional()?)
}

/// Whether a discovery token already stands for another machine's request.
pub fn token_taken_by_other(tx: &Tx<'_>, token_id: &str, machine_key: &str) -> ApiResult<bool> {
    Ok(crate::store::query_row(
        tx,
        "SELECT id FROM join_requests WHERE token_id = ?1 AND machine_key != ?2 LIMIT 1",
        params![token_id, machine_key],
        |x| x.get::<_, String>(0),
    )
    .optional()?
    .is_some())
}

/// The MAC and address a request came from.
pub fn origin(tx: &Tx<'_>, id: &str) -> ApiResult<(Option<String>, Option<String>)> {
    Ok(crate::store::query_row(
        tx,
        "SELECT mac, ip FROM join_requests WHERE id = ?1",
        [id],
        |x| Ok((x.get(0)?, x.get(1)?)),
    )?)
}

/// What a machine's join writes into its request.
pub struct Seen<'a> {
    pub csr_sha256: &'a str,
    pub claims_json: &'a str,
    pub ip: &'a str,
    pub expires_at: i64,
}

/// A discovery request pending again (refreshed by the machine's new join).
pub fn refresh_discovery(
    tx: &Tx<'_>,
    id: &str,
    s: &Seen<'_>,
    (mac, boot_lease_epoch, token_id): (&str, Option<i64>, &str),
    now: i64,
) -> ApiResult<()> {
    crate::store::exec(tx,
        "UPDATE join_requests SET state = 'pending', pool_id = NULL, decided_at = NULL, decided_by = NULL, reason = NULL,
         csr_sha256 = ?2, claims_json = ?3, ip = ?4, mac = ?5, boot_lease_epoch = ?6, updated_at = ?7, expires_at = ?8,
         token_id = ?9 WHERE id = ?1",
        params![id, s.csr_sha256, s.claims_json, s.ip, mac, boot_lease_epoch, now, s.expires_at, token_id],
    )?;
    Ok(())
}

/// A `tpm` request pending again.
pub fn refresh_tpm(
    tx: &Tx<'_>,
    id: &str,
    s: &Seen<'_>,
    ek_certified: bool,
    now: i64,
) -> ApiResult<()> {
    crate::store::exec(tx,
        "UPDATE join_requests SET state = 'pending', pool_id = NULL, decided_at = NULL, decided_by = NULL, reason = NULL,
         csr_sha256 = ?2, claims_json = ?3, ip = ?4, updated_at = ?5, expires_at = ?6, ek_certified = ?7 WHERE id = ?1",
        params![id, s.csr_sha256, s.claims_json, s.ip, now, s.expires_at, ek_certified as i64],
    )?;
    Ok(())
}

/// A new pending request.
pub struct New<'a> {
    pub id: &'a str,
    pub site_id: &'a str,
    /// `discovery` or `tpm`.
    pub attestor: &'a str,
    pub machine_key: &'a str,
    pub hardware_key: Option<&'a str>,
    pub hardware_key_trusted: bool,
    pub seen: Seen<'a>,
    pub vouched_by: &'a str,
    pub mac: Option<&'a str>,
    pub boot_lease_epoch: Option<i64>,
    pub token_id: Option<&'a str>,
    /// `tpm` only (`NULL` for discovery).
    pub ek_certified: Option<bool>,
}

pub fn insert(tx: &Tx<'_>, n: &New<'_>, now: i64) -> ApiResult<()> {
    crate::store::exec(tx,
        "INSERT INTO join_requests (id, site_id, attestor, machine_key, hardware_key, hardware_key_trusted, claims_json, mac, ip,
         vouched_by, boot_lease_epoch, csr_sha256, state, created_at, updated_at, expires_at, token_id, ek_certified)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, 'pending', ?13, ?13, ?14, ?15, ?16)",
        params![
            n.id,
            n.site_id,
            n.attestor,
            n.machine_key,
            n.hardware_key,
            n.hardware_key_trusted as i64,
            n.seen.claims_json,
            n.mac,
            n.seen.ip,
            n.vouched_by,
            n.boot_lease_epoch,
            n.seen.csr_sha256,
            now,
            n.seen.expires_at,
            n.token_id,
            n.ek_certified.map(|b| b as i64)
        ],
    )?;
    Ok(())
}

/// The addresses of the pending `tpm` requests (the enrollment queue's bound).
pub fn pending_tpm_ips(tx: &Tx<'_>) -> ApiResult<Vec<Option<String>>> {
    Ok(crate::store::query_all(
        tx,
        "SELECT ip FROM join_requests WHERE attestor = 'tpm' AND state = 'pending'",
        [],
        |x| x.get::<_, Option<String>>(0),
    )?)
}

/// A request answered by a join: consumed, with the node it became.
pub fn consume(tx: &Tx<'_>, id: &str, node_id: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE join_requests SET state = 'consumed', consumed_at = ?2, node_id = ?3, updated_at = ?2 WHERE id = ?1",
        params![id, now, node_id],
    )?;
    Ok(())
}

/// The columns a request is shown with (the table is aliased `r`). The last is computed when
/// listed: a live node that holds the request's trusted hardware key outside the pool the request
/// was approved into (any pool while it is pending), which an approval could never join (the
/// retry is refused `join:reclaim`): the operator sees it before approving.
const COLS: &str = "id, site_id, pool_id, attestor, hardware_key, claims_json, mac, ip, vouched_by, boot_lease_epoch, csr_sha256,
    state, created_at, updated_at, expires_at, decided_at, decided_by, reason, consumed_at, node_id, ek_certified,
    (SELECT json_object('nodeId', n.id, 'tenantId', n.tenant_id, 'poolId', n.pool_id, 'role', n.role)
       FROM nodes n WHERE r.hardware_key_trusted = 1 AND n.hardware_key = r.hardware_key AND n.hardware_key_trusted = 1
        AND n.state != 'retired' AND r.state IN ('pending', 'approved') AND (r.pool_id IS NULL OR n.pool_id != r.pool_id))";

fn row(r: &crate::store::Row) -> crate::store::SqlResult<Value> {
    let claims: Value = serde_json::from_str(&r.get::<_, String>(5)?).unwrap_or(Value::Null);
    let t = |i: usize| -> crate::store::SqlResult<Value> {
        Ok(json!(r.get::<_, Option<i64>>(i)?.map(rfc3339)))
    };
    Ok(json!({
        "id": r.get::<_, String>(0)?, "siteId": r.get::<_, String>(1)?, "poolId": r.get::<_, Option<String>>(2)?,
        "attestor": r.get::<_, String>(3)?, "hardwareKey": r.get::<_, Option<String>>(4)?,
        "gpuCount": claims["gpuUuids"].as_array().map(|a| a.len()).unwrap_or(0),
        "claims": claims, "mac": r.get::<_, Option<String>>(6)?, "ip": r.get::<_, Option<String>>(7)?,
        "workflowId": null, "vouchedBy": r.get::<_, Option<String>>(8)?, "bootLeaseEpoch": r.get::<_, Option<i64>>(9)?,
        "csrSha256": r.get::<_, String>(10)?, "state": r.get::<_, String>(11)?,
        "createdAt": t(12)?, "updatedAt": t(13)?, "expiresAt": t(14)?, "decidedAt": t(15)?,
        "decidedBy": r.get::<_, Option<String>>(16)?, "reason": r.get::<_, Option<String>>(17)?,
        "consumedAt": t(18)?, "nodeId": r.get::<_, Option<String>>(19)?,
        "ekCertified": r.get::<_, Option<i64>>(20)?.map(|v| v == 1),
        "conflictingNode": r.get::<_, Option<String>>(21)?
            .and_then(|j| serde_json::from_str::<Value>(&j).ok()),
    }))
}

/// The requests a pool's operator sees (`joinRequests.list`): on `site`, those no pool claimed
/// and the pool's own (or, with no pool, every pool's of `tenant`), in `state` (or `all`), after
/// `cursor`, at most `limit`: `(id, request)`.
pub fn list(
    tx: &Tx<'_>,
    (site, pool, tenant): (&str, Option<&str>, &str),
    state: &str,
    cursor: &str,
    limit: i64,
) -> ApiResult<Vec<(String, Value)>> {
    let rows = crate::store::query_all(tx, &format!(
        "SELECT {COLS} FROM join_requests r WHERE site_id = ?1
         AND (pool_id IS NULL OR (CAST(?2 AS TEXT) IS NOT NULL AND pool_id = ?2)
              OR (CAST(?2 AS TEXT) IS NULL AND EXISTS (SELECT 1 FROM pools p WHERE p.id = r.pool_id AND p.tenant_id = ?3)))
         AND (?4 = 'all' OR state = ?4) AND id > ?5 ORDER BY id LIMIT ?6"
    ), params![site, pool, tenant, state, cursor, limit], row)?
        .into_iter()
        .map(|v| (v["id"].as_str().unwrap_or_default().to_string(), v))
        .collect();
    Ok(rows)
}

/// A request of `site`, as listed, or `NOT_FOUND`.
pub fn get(tx: &Tx<'_>, id: &str, site: &str) -> ApiResult<Value> {
    crate::store::found(
        crate::store::query_row(
            tx,
            &format!("SELECT {COLS} FROM join_requests r WHERE id = ?1 AND site_id = ?2"),
            [id, site],
            row,
        ),
        || format!("join request {id} not found"),
    )
}

/// An operator's decision: who, when, why.
pub type Decision<'a> = (i64, &'a str, Option<&'a str>);

/// Approved into `pool` until `expires_at`.
pub fn approve(
    tx: &Tx<'_>,
    id: &str,
    pool: &str,
    (now, by, reason): Decision<'_>,
    expires_at: i64,
) -> ApiResult<()> {
    crate::store::exec(tx,
        "UPDATE join_requests SET state = 'approved', pool_id = ?2, decided_at = ?3, decided_by = ?4, reason = ?5,
         expires_at = ?6, updated_at = ?3 WHERE id = ?1",
        params![id, pool, now, by, reason, expires_at],
    )?;
    Ok(())
}

/// Rejected (the pool recorded when none was).
pub fn reject(tx: &Tx<'_>, id: &str, pool: &str, (now, by, reason): Decision<'_>) -> ApiResult<()> {
    crate::store::exec(tx,
        "UPDATE join_requests SET state = 'rejected', pool_id = COALESCE(pool_id, ?2), decided_at = ?3, decided_by = ?4,
         reason = ?5, updated_at = ?3 WHERE id = ?1",
        params![id, pool, now, by, reason],
    )?;
    Ok(())
}
