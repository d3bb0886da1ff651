//! The join-request queue: `joinRequests.list/approve/reject` and `bca join-requests`.
//!
//! Decided on the pool, like join tokens. `list` shows the pool's requests and the site's requests
//! no pool claimed yet (`state` defaults to `pending`; `all` lists every state). `approve` assigns
//! the pool and admits exactly one join until `ttlSeconds` (60-86,400, one hour by default);
//! approving twice returns the approval; any other decided state, or an archived pool, is
//! `INVALID_STATE`. `reject` is final, and withdraws an approval not used yet.

use crate::admin::ctx::Ctx;
use crate::base::error::{ApiError, ApiResult};
use crate::domain::validate;
use crate::store::events::audit;
use crate::store::events::publish;
use crate::store::{Store, Tx};
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

fn list(tx: &Tx<'_>, ctx: &Ctx<'_>, i: ListInput) -> ApiResult<Value> {
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
    let rows = crate::store::requests::list(
        tx,
        (&site, i.pool_id.as_deref(), &i.tenant_id),
        &state,
        &i.cursor.unwrap_or_default(),
        limit + 1,
    )?;
    Ok(crate::admin::ctx::page(rows, limit, |id| id.clone()))
}

fn decide(tx: &Tx<'_>, ctx: &Ctx<'_>, i: DecideInput, approve: bool) -> ApiResult<Value> {
    validate::id("requestId", &i.request_id, "jreq")?;
    check_reason(&i.reason)?;
    let ttl = i.ttl_seconds.unwrap_or(3600);
    validate::range("ttlSeconds", ttl, 60, 86_400)?;
    let pool = crate::store::tenancy::pool_load(tx, &i.tenant_id, &i.pool_id)?;
    crate::join::requests::expire(tx, ctx.now)?;
    let load = |tx: &Tx<'_>| crate::store::requests::get(tx, &i.request_id, &pool.site_id);
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
        crate::store::requests::approve(
            tx,
            &i.request_id,
            &pool.id,
            (ctx.now, ctx.caller, i.reason.as_deref()),
            ctx.now + ttl,
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
        crate::store::requests::reject(
            tx,
            &i.request_id,
            &pool.id,
            (ctx.now, ctx.caller, i.reason.as_deref()),
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
