//! The join-request queue: `joinRequests.list/approve/reject` and `bca join-requests`.
//!
//! Decided on the pool, like join tokens. `list` shows the pool's requests and the site's requests
//! no pool claimed yet (`state` defaults to `pending`; `all` lists every state). `approve` assigns
//! the pool and admits exactly one join until `ttlSeconds` (60-86,400, one hour by default);
//! approving twice returns the approval; any other decided state, or an archived pool, is
//! `INVALID_STATE`. `reject` is final, and withdraws an approval not used yet.

use crate::admin::ctx::Ctx;
use crate::base::clock::rfc3339;
use crate::base::error::{ApiError, ApiResult};
use crate::domain::validate;
use crate::store::events::audit;
use crate::store::events::publish;
use crate::store::{found, Store};
use rusqlite::{params, Transaction};
use serde::Deserialize;
use serde_json::{json, Value};

const STATES: &[&str] = &["pending", "approved", "rejected", "expired", "consumed"];

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListInput {
    tenant_id: String,
    pool_id: Option<String>,
    state: Option<String>,
    #[serde(default)]
    all: bool,
    limit: Option<i64>,
    cursor: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct DecideInput {
    tenant_id: String,
    pool_id: String,
    request_id: String,
    ttl_seconds: Option<i64>,
    reason: Option<String>,
    /// The CSR the caller saw when it chose this request (bulk approval): if the machine has
    /// since asked again with another CSR, the decision is refused (`CONFLICT`).
    csr_sha256: Option<String>,
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

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Value> {
    let claims: Value = serde_json::from_str(&r.get::<_, String>(5)?).unwrap_or(Value::Null);
    let t = |i: usize| -> rusqlite::Result<Value> {
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

fn check_reason(r: &Option<String>) -> ApiResult<()> {
    if r.as_ref().is_some_and(|r| r.len() > 512) {
        return Err(ApiError::invalid_input(
            "reason must be at most 512 characters",
        ));
    }
    Ok(())
}

pub fn dispatch(store: &Store, ctx: &Ctx<'_>, path: &str, body: &[u8]) -> Option<ApiResult<Value>> {
    Some(match path {
        "joinRequests/list" => crate::admin::ctx::parse::<ListInput>(body)
            .and_then(|i| store.write(|tx| list(tx, ctx, i))),
        "joinRequests/approve" => crate::admin::ctx::parse::<DecideInput>(body)
            .and_then(|i| store.write(|tx| decide(tx, ctx, i, true))),
        "joinRequests/reject" => crate::admin::ctx::parse::<DecideInput>(body)
            .and_then(|i| store.write(|tx| decide(tx, ctx, i, false))),
        _ => return None,
    })
}

fn list(tx: &Transaction<'_>, ctx: &Ctx<'_>, i: ListInput) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    if let Some(c) = &i.cursor {
        validate::id("cursor", c, "jreq")?;
    }
    let state = if i.all {
        "all".to_string()
    } else {
        i.state.unwrap_or_else(|| "pending".into())
    };
    if state != "all" && !STATES.contains(&state.as_str()) {
        return Err(ApiError::invalid_input(format!(
            "state must be all or one of {}",
            STATES.join(", ")
        )));
    }
    let site = match &i.pool_id {
        Some(p) => crate::store::tenancy::pool_load(tx, &i.tenant_id, p)?.site_id,
        None => ctx.site_id.to_string(),
    };
    crate::join::requests::expire(tx, ctx.now)?;
    let mut st = tx.prepare(&format!(
        "SELECT {COLS} FROM join_requests r WHERE site_id = ?1
         AND (pool_id IS NULL OR (?2 IS NOT NULL AND pool_id = ?2)
              OR (?2 IS NULL AND EXISTS (SELECT 1 FROM pools p WHERE p.id = r.pool_id AND p.tenant_id = ?3)))
         AND (?4 = 'all' OR state = ?4) AND id > ?5 ORDER BY id LIMIT ?6"
    ))?;
    let rows: Vec<(String, Value)> = st
        .query_map(
            params![
                site,
                i.pool_id,
                i.tenant_id,
                state,
                i.cursor.unwrap_or_default(),
                limit + 1
            ],
            row,
        )?
        .map(|r| r.map(|v| (v["id"].as_str().unwrap_or_default().to_string(), v)))
        .collect::<Result<_, _>>()?;
    Ok(crate::admin::ctx::page(rows, limit, |id| id.clone()))
}

fn decide(tx: &Transaction<'_>, ctx: &Ctx<'_>, i: DecideInput, approve: bool) -> ApiResult<Value> {
    validate::id("requestId", &i.request_id, "jreq")?;
    check_reason(&i.reason)?;
    let ttl = i.ttl_seconds.unwrap_or(3600);
    validate::range("ttlSeconds", ttl, 60, 86_400)?;
    let pool = crate::store::tenancy::pool_load(tx, &i.tenant_id, &i.pool_id)?;
    crate::join::requests::expire(tx, ctx.now)?;
    let load = |tx: &Transaction<'_>| {
        found(
            tx.query_row(
                &format!("SELECT {COLS} FROM join_requests r WHERE id = ?1 AND site_id = ?2"),
                [&i.request_id, &pool.site_id],
                row,
            ),
            || format!("join request {} not found", i.request_id),
        )
    };
    let r = load(tx)?;
    let state = r["state"].as_str().unwrap_or_default().to_string();
    let pool_of = r["poolId"].as_str().map(str::to_string);
    if pool_of.as_ref().is_some_and(|p| *p != pool.id) {
        return Err(ApiError::not_found(format!(
            "join request {} not found in pool {}",
            i.request_id, pool.id
        )));
    }
    if let Some(seen) = &i.csr_sha256 {
        if r["csrSha256"].as_str() != Some(seen.as_str()) {
            return Err(ApiError::conflict(format!(
                "join request {} changed since it was listed (the machine asked again with another key); list it again",
                i.request_id
            )));
        }
    }
    let data = json!({"requestId": i.request_id, "poolId": pool.id, "reason": i.reason});
    if approve {
        match state.as_str() {
            "approved" => return Ok(r),
            "pending" => {}
            other => {
                return Err(ApiError::invalid_state(format!(
                    "join request {} is {other}; only a pending request can be approved",
                    i.request_id
                )))
            }
        }
        if pool.archived_at.is_some() || pool.agent != "bcd" {
            return Err(ApiError::invalid_state(format!(
                "pool {} is archived or runs no daemon; it admits no machine",
                pool.id
            )));
        }
        let attestor = r["attestor"].as_str().unwrap_or_default();
        if !pool.allows_attestor(attestor) {
            return Err(ApiError::invalid_state(format!(
                "pool {} does not allow the {attestor} attestor (policy.joinAttestors); it admits no machine this request's way",
                pool.id
            )));
        }
        tx.execute(
            "UPDATE join_requests SET state = 'approved', pool_id = ?2, decided_at = ?3, decided_by = ?4, reason = ?5,
             expires_at = ?6, updated_at = ?3 WHERE id = ?1",
            params![i.request_id, pool.id, ctx.now, ctx.caller, i.reason, ctx.now + ttl],
        )?;
        publish(
            tx,
            ctx.now,
            &pool.tenant_id,
            "security.join-request.approved",
            data.clone(),
        )?;
        audit(
            tx,
            ctx.now,
            &pool.tenant_id,
            "joinRequests.approve",
            ctx.caller,
            &i.request_id,
            data,
        )?;
    } else {
        match state.as_str() {
            "rejected" => return Ok(r),
            "pending" | "approved" => {}
            other => {
                return Err(ApiError::invalid_state(format!(
                    "join request {} is {other}; it cannot be rejected",
                    i.request_id
                )))
            }
        }
        tx.execute(
            "UPDATE join_requests SET state = 'rejected', pool_id = COALESCE(pool_id, ?2), decided_at = ?3, decided_by = ?4,
             reason = ?5, updated_at = ?3 WHERE id = ?1",
            params![i.request_id, pool.id, ctx.now, ctx.caller, i.reason],
        )?;
        publish(
            tx,
            ctx.now,
            &pool.tenant_id,
            "security.join-request.rejected",
            data.clone(),
        )?;
        audit(
            tx,
            ctx.now,
            &pool.tenant_id,
            "joinRequests.reject",
            ctx.caller,
            &i.request_id,
            data,
        )?;
    }
    load(tx)
}
