//! The admin API: `POST /api/compute/<group>/<method>` with a JSON body, decided here.
//!
//! Every method parses its input strictly (unknown fields are refused), checks every constraint of
//! the API reference, and runs in one store transaction: an error leaves the database as it was.
//! Mutations write an audit row naming the caller (`uid:<n>` from the socket's peer credentials).

pub mod audit;
pub mod boot_leases;
pub mod downloads;
pub mod join_requests;
pub mod nodes;
pub mod tpm_eks;

use crate::base::clock::rfc3339;
use crate::base::error::{ApiError, ApiResult};
use crate::domain::pool::Policy;
use crate::domain::pool::Pool;
use crate::domain::token::Bearer;
use crate::domain::token::Expect;
use crate::domain::token::TokenRow;
use crate::store::events::audit;
use crate::store::events::publish;
use crate::store::tenancy::pool_load;
use crate::store::tenancy::pool_row;
use crate::store::tenancy::pool_save;
use crate::store::tenancy::tenant_must_exist;
use crate::store::tenancy::token_row;
use crate::store::tenancy::POOL_COLS;
use crate::store::tenancy::TOKEN_COLS;
use crate::store::{found, Store};
use crate::{base::crypto, base::ids, domain::validate};
use rusqlite::{params, OptionalExtension, Transaction};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

/// Who calls and when; passed in, never read from the environment.
pub struct Ctx<'a> {
    pub caller: &'a str,
    pub now: i64,
    pub site_id: &'a str,
    pub root_tenant: &'a str,
    /// The gateway's live sessions, closed when a node's identity is revoked.
    pub sessions: Option<&'a crate::base::registry::Registry>,
}

/// Parses a request body strictly; the error names the field (`expect.mac: invalid type ...`).
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> ApiResult<T> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    // Nothing that could reach an operator's terminal raw is taken in (`text`).
    if let Some(path) = serde_json::from_slice::<Value>(body)
        .ok()
        .as_ref()
        .and_then(crate::base::text::first_control)
    {
        let field = if path.is_empty() {
            "the body"
        } else {
            path.trim_start_matches('.')
        };
        return Err(ApiError::invalid_input(format!(
            "invalid request body: {field} must be free of control characters (they could rewrite an operator's terminal)"
        )));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            ApiError::invalid_input(format!("invalid request body: {}", e.inner()))
        } else {
            ApiError::invalid_input(format!("invalid request body: {path}: {}", e.inner()))
        }
    })
}

/// Runs one method. `path` is `<group>/<method>`.
pub fn dispatch(store: &Store, ctx: &Ctx<'_>, path: &str, body: &[u8]) -> ApiResult<Value> {
    match path {
        "tenants/create" => {
            let i = parse(body)?;
            store.write(|tx| tenants_create(tx, ctx, i))
        }
        "tenants/list" => {
            let i = parse(body)?;
            store.read(|tx| tenants_list(tx, i))
        }
        "pools/create" => {
            let i = parse(body)?;
            store.write(|tx| pools_create(tx, ctx, i))
        }
        "pools/list" => {
            let i = parse(body)?;
            store.read(|tx| pools_list(tx, i))
        }
        "pools/get" => {
            let i: PoolRef = parse(body)?;
            store.read(|tx| Ok(pool_load(tx, &i.tenant_id, &i.pool_id)?.to_json()))
        }
        "pools/update" => {
            let i = parse(body)?;
            store.write(|tx| pools_update(tx, ctx, i))
        }
        "pools/archive" => {
            let i = parse(body)?;
            store.write(|tx| pools_archive(tx, ctx, i))
        }
        "joinTokens/create" => {
            let i = parse(body)?;
            store.write(|tx| join_tokens_create(tx, ctx, i))
        }
        "joinTokens/createMany" => {
            let i = parse(body)?;
            store.write(|tx| join_tokens_create_many(tx, ctx, i))
        }
        "joinTokens/list" => {
            let i = parse(body)?;
            store.read(|tx| join_tokens_list(tx, ctx, i))
        }
        "joinTokens/revoke" => {
            let i = parse(body)?;
            store.write(|tx| join_tokens_revoke(tx, ctx, i))
        }
        "events/list" => {
            let i = parse(body)?;
            store.read(|tx| events_list(tx, i))
        }
        _ => crate::admin::nodes::dispatch(store, ctx, path, body)
            .or_else(|| crate::admin::audit::dispatch(store, ctx, path, body))
            .or_else(|| crate::admin::join_requests::dispatch(store, ctx, path, body))
            .or_else(|| crate::admin::tpm_eks::dispatch(store, ctx, path, body))
            .or_else(|| crate::admin::boot_leases::dispatch(store, path, body))
            .unwrap_or_else(|| Err(ApiError::not_found(format!("no method {path}")))),
    }
}

// ---------- events and audit ----------

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct EventsListInput {
    tenant_id: Option<String>,
    #[serde(rename = "type")]
    type_prefix: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

fn events_list(tx: &Transaction<'_>, i: EventsListInput) -> ApiResult<Value> {
    if let Some(t) = &i.tenant_id {
        validate::tenant_id("tenantId", t)?;
    }
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    if let Some(p) = &i.type_prefix {
        validate::prefix("type", p, 0)?;
    }
    let before = seq_cursor(i.cursor.as_deref(), "events.list")?;
    let prefix = i.type_prefix.unwrap_or_default();
    let mut st = tx.prepare(
        "SELECT seq, id, tenant_id, type, data, created_at FROM events
         WHERE seq < ?1 AND (?2 IS NULL OR tenant_id = ?2) AND substr(type, 1, length(?3)) = ?3
         ORDER BY seq DESC LIMIT ?4",
    )?;
    let rows = st
        .query_map(params![before, i.tenant_id, prefix, limit + 1], |r| {
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
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(page(rows, limit, |seq| seq.to_string()))
}

/// The row sequence a list's cursor names (`None`: from the newest).
pub fn seq_cursor(cursor: Option<&str>, method: &str) -> ApiResult<i64> {
    match cursor {
        None => Ok(i64::MAX),
        Some(c) => c.parse().ok().filter(|v| *v > 0).ok_or_else(|| {
            ApiError::invalid_input(format!("cursor must be a cursor returned by {method}"))
        }),
    }
}

/// `{"items": [...], "cursor": ...}` from up to `limit + 1` rows.
pub fn page<K>(mut rows: Vec<(K, Value)>, limit: i64, cursor: impl Fn(&K) -> String) -> Value {
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = if more {
        rows.last().map(|(k, _)| cursor(k))
    } else {
        None
    };
    json!({ "items": rows.into_iter().map(|(_, v)| v).collect::<Vec<_>>(), "cursor": next })
}

// ---------- tenants ----------

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TenantsCreateInput {
    name: String,
}

fn tenant_json(id: String, name: String, root: bool, created: i64) -> Value {
    json!({"id": id, "name": name, "root": root, "createdAt": rfc3339(created)})
}

fn tenants_create(tx: &Transaction<'_>, ctx: &Ctx<'_>, i: TenantsCreateInput) -> ApiResult<Value> {
    validate::name("name", &i.name)?;
    let exists: Option<String> = tx
        .query_row("SELECT id FROM tenants WHERE name = ?1", [&i.name], |r| {
            r.get(0)
        })
        .optional()?;
    if let Some(id) = exists {
        return Err(ApiError::already_exists(format!(
            "a tenant named {} exists already ({id})",
            i.name
        )));
    }
    let id = ids::new_id("tn", ctx.now * 1000);
    tx.execute(
        "INSERT INTO tenants (id, name, is_root, created_at) VALUES (?1, ?2, 0, ?3)",
        params![id, i.name, ctx.now],
    )?;
    audit(
        tx,
        ctx.now,
        &id,
        "tenants.create",
        ctx.caller,
        &id,
        json!({"name": i.name}),
    )?;
    Ok(tenant_json(id, i.name, false, ctx.now))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

fn tenants_list(tx: &Transaction<'_>, _: Empty) -> ApiResult<Value> {
    let mut st = tx.prepare("SELECT id, name, is_root, created_at FROM tenants ORDER BY id")?;
    let items = st
        .query_map([], |r| {
            Ok(tenant_json(
                r.get(0)?,
                r.get(1)?,
                r.get::<_, i64>(2)? == 1,
                r.get(3)?,
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(json!({"items": items, "cursor": null}))
}

// ---------- pools ----------

fn agent_value(a: Option<String>) -> ApiResult<String> {
    let a = a.unwrap_or_else(|| "bcd".into());
    if a != "bcd" && a != "none" {
        return Err(ApiError::invalid_input(format!(
            "agent must be bcd or none, got {a:?}"
        )));
    }
    Ok(a)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolsCreateInput {
    tenant_id: String,
    name: String,
    agent: Option<String>,
    #[serde(default)]
    policy: Policy,
}

fn pools_create(tx: &Transaction<'_>, ctx: &Ctx<'_>, i: PoolsCreateInput) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    validate::name("name", &i.name)?;
    let agent = agent_value(i.agent)?;
    i.policy.validate()?;
    tenant_must_exist(tx, &i.tenant_id)?;
    let dup: Option<String> = tx
        .query_row(
            "SELECT id FROM pools WHERE tenant_id = ?1 AND name = ?2",
            [&i.tenant_id, &i.name],
            |r| r.get(0),
        )
        .optional()?;
    if let Some(id) = dup {
        return Err(ApiError::already_exists(format!(
            "tenant {} has a pool named {} already ({id})",
            i.tenant_id, i.name
        )));
    }
    let p = Pool {
        id: ids::new_id("pool", ctx.now * 1000),
        tenant_id: i.tenant_id,
        site_id: ctx.site_id.into(),
        name: i.name,
        agent,
        policy: i.policy,
        archived_at: None,
        created_at: ctx.now,
        updated_at: ctx.now,
    };
    tx.execute(
        "INSERT INTO pools (id, tenant_id, site_id, name, agent, created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6)",
        params![p.id, p.tenant_id, p.site_id, p.name, p.agent, p.created_at],
    )?;
    pool_save(tx, &p)?;
    audit(
        tx,
        ctx.now,
        &p.tenant_id,
        "pools.create",
        ctx.caller,
        &p.id,
        p.to_json(),
    )?;
    Ok(p.to_json())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolsListInput {
    tenant_id: String,
    #[serde(default)]
    include_archived: bool,
    limit: Option<i64>,
    cursor: Option<String>,
}

fn pools_list(tx: &Transaction<'_>, i: PoolsListInput) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    if let Some(c) = &i.cursor {
        validate::id("cursor", c, "pool")?;
    }
    tenant_must_exist(tx, &i.tenant_id)?;
    let mut st = tx.prepare(&format!(
        "SELECT {POOL_COLS} FROM pools WHERE tenant_id = ?1 AND id > ?2 AND (?3 OR archived_at IS NULL) ORDER BY id LIMIT ?4"
    ))?;
    let rows = st
        .query_map(
            params![
                i.tenant_id,
                i.cursor.unwrap_or_default(),
                i.include_archived,
                limit + 1
            ],
            pool_row,
        )?
        .map(|p| p.map(|p| (p.id.clone(), p.to_json())))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(page(rows, limit, |id| id.clone()))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolRef {
    tenant_id: String,
    pool_id: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct PoolsUpdateInput {
    tenant_id: String,
    pool_id: String,
    name: Option<String>,
    agent: Option<String>,
    policy: Option<Policy>,
}

fn pools_update(tx: &Transaction<'_>, ctx: &Ctx<'_>, i: PoolsUpdateInput) -> ApiResult<Value> {
    if let Some(n) = &i.name {
        validate::name("name", n)?;
    }
    let agent = i.agent.map(|a| agent_value(Some(a))).transpose()?;
    if let Some(p) = &i.policy {
        p.validate()?;
    }
    let mut p = pool_load(tx, &i.tenant_id, &i.pool_id)?;
    if p.archived_at.is_some() {
        return Err(ApiError::invalid_state(format!(
            "pool {} is archived and cannot change",
            p.id
        )));
    }
    if let Some(n) = i.name {
        if n != p.name {
            let dup: Option<String> = tx
                .query_row(
                    "SELECT id FROM pools WHERE tenant_id = ?1 AND name = ?2",
                    [&p.tenant_id, &n],
                    |r| r.get(0),
                )
                .optional()?;
            if let Some(id) = dup {
                return Err(ApiError::already_exists(format!(
                    "tenant {} has a pool named {n} already ({id})",
                    p.tenant_id
                )));
            }
        }
        p.name = n;
    }
    if let Some(a) = agent {
        p.agent = a;
    }
    if let Some(pol) = i.policy {
        p.policy = pol;
    }
    p.updated_at = ctx.now;
    pool_save(tx, &p)?;
    audit(
        tx,
        ctx.now,
        &p.tenant_id,
        "pools.update",
        ctx.caller,
        &p.id,
        p.to_json(),
    )?;
    Ok(p.to_json())
}

fn pools_archive(tx: &Transaction<'_>, ctx: &Ctx<'_>, i: PoolRef) -> ApiResult<Value> {
    let mut p = pool_load(tx, &i.tenant_id, &i.pool_id)?;
    if p.archived_at.is_none() {
        p.archived_at = Some(ctx.now);
        p.updated_at = ctx.now;
        pool_save(tx, &p)?;
        audit(
            tx,
            ctx.now,
            &p.tenant_id,
            "pools.archive",
            ctx.caller,
            &p.id,
            json!({}),
        )?;
    }
    Ok(p.to_json())
}

// ---------- join tokens ----------

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

fn join_tokens_create(
    tx: &Transaction<'_>,
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
    let existing = tx
        .query_row(
            &format!("SELECT {TOKEN_COLS} FROM join_tokens WHERE id = ?1"),
            [&id],
            token_row,
        )
        .optional()?;
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
    let mut secret = zeroize::Zeroizing::new([0u8; 32]);
    crypto::fill_random(secret.as_mut());
    let bearer = Bearer {
        id: id.clone(),
        secret,
    };
    let t = TokenRow {
        id: id.clone(),
        tenant_id: i.tenant_id,
        pool_id: pool.id.clone(),
        site_id: pool.site_id.clone(),
        role: "node".into(),
        secret_sha256: crypto::sha256(bearer.secret.as_ref()).to_vec(),
        max_uses,
        uses_left: max_uses,
        expect: i.expect,
        allow_reclaim: i.allow_reclaim,
        hosted: i.hosted,
        created_at: ctx.now,
        expires_at: ctx.now + i.ttl_seconds,
        revoked_at: None,
    };
    tx.execute(
        "INSERT INTO join_tokens (id, tenant_id, pool_id, site_id, role, secret_sha256, max_uses, uses_left, expect_json,
         allow_reclaim, hosted, idempotency_key, created_by, created_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
        params![
            t.id,
            t.tenant_id,
            t.pool_id,
            t.site_id,
            t.role,
            t.secret_sha256,
            t.max_uses,
            t.expect.as_ref().map(|e| serde_json::to_string(e).expect("serializes")),
            t.allow_reclaim as i64,
            t.hosted,
            i.idempotency_key,
            ctx.caller,
            t.created_at,
            t.expires_at
        ],
    )?;
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

/// The most tokens one `createMany` mints.
pub const MAX_BATCH_TOKENS: usize = 1000;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JoinTokensCreateManyInput {
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
struct BatchToken {
    idempotency_key: String,
    expect: Expect,
}

/// Bulk intake: one pinned token per machine, all minted in one transaction or none. Each is
/// audited and published on its own, as if created one by one. A key used before fails the whole
/// batch (`ALREADY_EXISTS`): a bulk run must hand out a secret for every machine it names.
fn join_tokens_create_many(
    tx: &Transaction<'_>,
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
struct JoinTokensListInput {
    tenant_id: String,
    pool_id: String,
    #[serde(default)]
    include_inactive: bool,
    limit: Option<i64>,
    cursor: Option<String>,
}

fn join_tokens_list(
    tx: &Transaction<'_>,
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
    let mut st = tx.prepare(&format!(
        "SELECT {TOKEN_COLS} FROM join_tokens WHERE tenant_id = ?1 AND pool_id = ?2 AND id > ?3
         AND (?4 OR (revoked_at IS NULL AND uses_left > 0 AND expires_at > ?5)) ORDER BY id LIMIT ?6"
    ))?;
    let rows = st
        .query_map(
            params![
                i.tenant_id,
                i.pool_id,
                i.cursor.unwrap_or_default(),
                i.include_inactive,
                ctx.now,
                limit + 1
            ],
            token_row,
        )?
        .map(|t| t.map(|t| (t.id.clone(), t.to_json())))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(page(rows, limit, |id| id.clone()))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JoinTokensRevokeInput {
    tenant_id: String,
    pool_id: String,
    token_id: String,
}

fn join_tokens_revoke(
    tx: &Transaction<'_>,
    ctx: &Ctx<'_>,
    i: JoinTokensRevokeInput,
) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    validate::pool_id("poolId", &i.pool_id)?;
    validate::id("tokenId", &i.token_id, "jt")?;
    let mut t = found(
        tx.query_row(
            &format!("SELECT {TOKEN_COLS} FROM join_tokens WHERE id = ?1 AND tenant_id = ?2 AND pool_id = ?3"),
            [&i.token_id, &i.tenant_id, &i.pool_id],
            token_row,
        ),
        || format!("join token {} not found in tenant {} and pool {}", i.token_id, i.tenant_id, i.pool_id),
    )?;
    if t.revoked_at.is_none() {
        tx.execute(
            "UPDATE join_tokens SET revoked_at = ?2 WHERE id = ?1",
            params![t.id, ctx.now],
        )?;
        t.revoked_at = Some(ctx.now);
        let data = json!({"tokenId": t.id, "poolId": t.pool_id});
        publish(
            tx,
            ctx.now,
            &t.tenant_id,
            "security.join-token.revoked",
            data.clone(),
        )?;
        audit(
            tx,
            ctx.now,
            &t.tenant_id,
            "joinTokens.revoke",
            ctx.caller,
            &t.id,
            data,
        )?;
    }
    Ok(t.to_json())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_parses_only_the_canonical_form() {
        let b = Bearer {
            id: ids::new_id("jt", 1),
            secret: zeroize::Zeroizing::new([7u8; 32]),
        };
        let s = b.render();
        let back = Bearer::parse(&s).unwrap();
        assert_eq!(back.id, b.id);
        assert_eq!(*back.secret, [7u8; 32]);
        assert!(Bearer::parse(&s[1..]).is_none());
        assert!(Bearer::parse(&format!("{}x", s.as_str())).is_none());
        assert!(Bearer::parse(&s.replace('.', "_")).is_none());
        assert!(Bearer::parse("bcjt_jt_x.y").is_none());
    }
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    #[test]
    fn parse_errors_name_the_field() {
        let e = parse::<JoinTokensCreateInput>(br#"{"tenantId": 5}"#)
            .err()
            .unwrap();
        assert!(e.message.contains("tenantId"), "{}", e.message);
        let e = parse::<JoinTokensCreateInput>(br#"{"expect": {"mac": 1}}"#)
            .err()
            .unwrap();
        assert!(e.message.contains("expect.mac"), "{}", e.message);
    }
}
