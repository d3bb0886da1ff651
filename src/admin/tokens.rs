//! `joinTokens/create` (one, or many from a list), `list` and `revoke`.

use crate::admin::ctx::{page, Ctx};
use crate::base::error::{ApiError, ApiResult};
use crate::domain::token::Bearer;
use crate::domain::token::Expect;
use crate::domain::token::TokenRow;
use crate::store::events::audit;
use crate::store::events::publish;
use crate::store::tenancy::pool_load;
use crate::store::tenancy::tenant_must_exist;
use crate::store::{tenancy, Tx};
use crate::{base::crypto, base::ids, domain::validate};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinTokensCreateInput {
    tenant_id: String,
    pool_id: String,
    max_uses: Option<i64>,
    ttl_seconds: i64,
    expect: Option<Expect>,
    #[serde(default)]
    allow_reclaim: bool,
    hosted: Option<String>,
    idempotency_key: String,
}

pub(super) fn join_tokens_create(
    tx: &Tx<'_>,
    ctx: &Ctx<'_>,
    i: JoinTokensCreateInput,
) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    validate::pool_id("poolId", &i.pool_id)?;
    let max_uses = i.max_uses.unwrap_or(1);
    validate::range("maxUses", max_uses, 1, 10_000)?;
    validate::range("ttlSeconds", i.ttl_seconds, 60, 86_400)?;
    if let Some(e) = &i.expect {
        e.validate()?;
    }
    if let Some(h) = &i.hosted {
        if h != "kubernetes" {
            return Err(ApiError::invalid_input(format!(
                "hosted must be \"kubernetes\", got {h:?}"
            )));
        }
    }
    validate::idempotency_key("idempotencyKey", &i.idempotency_key)?;

    let id = ids::derived_id(
        "jt",
        "bca join token id v1",
        &[&i.tenant_id, ctx.caller, &i.idempotency_key],
    );
    let existing = tenancy::token_by_id(tx, &id)?;
    if let Some(t) = existing {
        if t.pool_id != i.pool_id
            || t.expect != i.expect
            || t.allow_reclaim != i.allow_reclaim
            || t.hosted != i.hosted
        {
            return Err(ApiError::conflict(format!(
                "idempotency key {} was used for a token with another pool, expect, allowReclaim or hosted ({})",
                i.idempotency_key, t.id
            )));
        }
        return Ok(t.to_json());
    }

    tenant_must_exist(tx, &i.tenant_id)?;
    let pool = pool_load(tx, &i.tenant_id, &i.pool_id)?;
    if pool.archived_at.is_some() {
        return Err(ApiError::invalid_state(format!(
            "pool {} is archived and mints no token",
            pool.id
        )));
    }
    if pool.agent != "bcd" {
        return Err(ApiError::invalid_state(format!(
            "pool {} has agent {}: its machines run no daemon, so no machine can join it with a token",
            pool.id, pool.agent
        )));
    }
    let (bearer, secret_sha256) = new_bearer(&id);
    let t = TokenRow {
        id: id.clone(),
        tenant_id: i.tenant_id,
        pool_id: pool.id.clone(),
        site_id: pool.site_id.clone(),
        role: "node".into(),
        secret_sha256,
        max_uses,
        uses_left: max_uses,
        expect: i.expect,
        allow_reclaim: i.allow_reclaim,
        hosted: i.hosted,
        created_at: ctx.now,
        expires_at: ctx.now + i.ttl_seconds,
        revoked_at: None,
        node_id: None,
    };
    tenancy::token_insert(tx, &t, &i.idempotency_key, ctx.caller)?;
    let mut data = json!({"tokenId": t.id, "poolId": t.pool_id, "pinned": t.expect.is_some()});
    if let Some(h) = &t.hosted {
        data["hosted"] = json!(h);
    }
    publish(
        tx,
        ctx.now,
        &t.tenant_id,
        "security.join-token.created",
        data.clone(),
    )?;
    audit(
        tx,
        ctx.now,
        &t.tenant_id,
        "joinTokens.create",
        ctx.caller,
        &t.id,
        data,
    )?;
    let mut v = t.to_json();
    v["token"] = json!(bearer.render().as_str());
    Ok(v)
}

/// A new bearer for token `id`: the secret, shown once, and its SHA-256, the only thing stored.
pub(super) fn new_bearer(id: &str) -> (Bearer, Vec<u8>) {
    let mut secret = zeroize::Zeroizing::new([0u8; 32]);
    crypto::fill_random(secret.as_mut());
    let sha = crypto::sha256(secret.as_ref()).to_vec();
    (
        Bearer {
            id: id.to_string(),
            secret,
        },
        sha,
    )
}

/// A token revoked: `security.join-token.revoked` and the `joinTokens.revoke` audit row, in its
/// tenant.
pub(super) fn record_revoked(
    tx: &Tx<'_>,
    ctx: &Ctx<'_>,
    tenant: &str,
    token_id: &str,
    data: Value,
) -> ApiResult<()> {
    publish(
        tx,
        ctx.now,
        tenant,
        "security.join-token.revoked",
        data.clone(),
    )?;
    audit(
        tx,
        ctx.now,
        tenant,
        "joinTokens.revoke",
        ctx.caller,
        token_id,
        data,
    )
}

/// The most tokens one `createMany` mints.
pub const MAX_BATCH_TOKENS: usize = 1000;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct JoinTokensCreateManyInput {
    tenant_id: String,
    pool_id: String,
    max_uses: Option<i64>,
    ttl_seconds: i64,
    #[serde(default)]
    allow_reclaim: bool,
    tokens: Vec<BatchToken>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct BatchToken {
    idempotency_key: String,
    expect: Expect,
}

/// Bulk intake: one pinned token per machine, all minted in one transaction or none. Each is
/// audited and published on its own, as if created one by one. A key used before fails the whole
/// batch (`ALREADY_EXISTS`): a bulk run must hand out a secret for every machine it names.
pub(super) fn join_tokens_create_many(
    tx: &Tx<'_>,
    ctx: &Ctx<'_>,
    i: JoinTokensCreateManyInput,
) -> ApiResult<Value> {
    if i.tokens.is_empty() || i.tokens.len() > MAX_BATCH_TOKENS {
        return Err(ApiError::invalid_input(format!(
            "tokens must list 1 to {MAX_BATCH_TOKENS} tokens, got {}",
            i.tokens.len()
        )));
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(i.tokens.len());
    for (n, t) in i.tokens.into_iter().enumerate() {
        let at = |e: ApiError| ApiError::new(e.code, format!("tokens[{n}]: {}", e.message));
        if !seen.insert(t.idempotency_key.clone()) {
            return Err(at(ApiError::invalid_input(format!(
                "idempotencyKey {} appears twice",
                t.idempotency_key
            ))));
        }
        let v = join_tokens_create(
            tx,
            ctx,
            JoinTokensCreateInput {
                tenant_id: i.tenant_id.clone(),
                pool_id: i.pool_id.clone(),
                max_uses: i.max_uses,
                ttl_seconds: i.ttl_seconds,
                expect: Some(t.expect),
                allow_reclaim: i.allow_reclaim,
                hosted: None,
                idempotency_key: t.idempotency_key.clone(),
            },
        )
        .map_err(at)?;
        if v.get("token").is_none() {
            return Err(at(ApiError::already_exists(format!(
                "idempotencyKey {} was used before ({}); its secret is not shown again: revoke it or use another key",
                t.idempotency_key,
                v["id"].as_str().unwrap_or_default()
            ))));
        }
        out.push(v);
    }
    Ok(json!({ "items": out }))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct JoinTokensListInput {
    tenant_id: String,
    pool_id: String,
    #[serde(default)]
    include_inactive: bool,
    limit: Option<i64>,
    cursor: Option<String>,
}

pub(super) fn join_tokens_list(
    tx: &Tx<'_>,
    ctx: &Ctx<'_>,
    i: JoinTokensListInput,
) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    validate::pool_id("poolId", &i.pool_id)?;
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    if let Some(c) = &i.cursor {
        validate::id("cursor", c, "jt")?;
    }
    pool_load(tx, &i.tenant_id, &i.pool_id)?;
    let rows = tenancy::tokens(
        tx,
        (&i.tenant_id, &i.pool_id),
        &i.cursor.unwrap_or_default(),
        i.include_inactive,
        ctx.now,
        limit + 1,
    )?
    .into_iter()
    .map(|t| (t.id.clone(), t.to_json()))
    .collect();
    Ok(page(rows, limit, |id| id.clone()))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct JoinTokensRevokeInput {
    tenant_id: String,
    pool_id: String,
    token_id: String,
}

pub(super) fn join_tokens_revoke(
    tx: &Tx<'_>,
    ctx: &Ctx<'_>,
    i: JoinTokensRevokeInput,
) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    validate::pool_id("poolId", &i.pool_id)?;
    validate::id("tokenId", &i.token_id, "jt")?;
    let mut t = tenancy::token_load(tx, &i.tenant_id, &i.pool_id, &i.token_id)?;
    if t.revoked_at.is_none() {
        tenancy::token_revoke(tx, &t.id, ctx.now)?;
        t.revoked_at = Some(ctx.now);
        let data = json!({"tokenId": t.id, "poolId": t.pool_id});
        record_revoked(tx, ctx, &t.tenant_id, &t.id, data)?;
    }
    Ok(t.to_json())
}
