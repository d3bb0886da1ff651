//! Tenancy rows: tenants, pools and join tokens as the JoinService and the admin API read them.

use crate::base::error::{ApiError, ApiResult};
use crate::domain::pool::{KubernetesPolicy, Policy, Pool};
use crate::domain::token::TokenRow;
use crate::domain::validate;
use crate::store::found;
use crate::store::Tx;
use crate::store::{params, OptionalExtension};

pub const POOL_COLS: &str =
    "id, tenant_id, site_id, name, agent, join_attestors, k8s_platform_operated, archived_at, created_at, updated_at, acceptance";

pub fn pool_row(r: &crate::store::Row) -> crate::store::SqlResult<Pool> {
    let attestors: Option<String> = r.get(5)?;
    let k8s: i64 = r.get(6)?;
    Ok(Pool {
        id: r.get(0)?,
        tenant_id: r.get(1)?,
        site_id: r.get(2)?,
        name: r.get(3)?,
        agent: r.get(4)?,
        policy: Policy {
            join_attestors: attestors.and_then(|s| serde_json::from_str(&s).ok()),
            kubernetes: (k8s == 1).then_some(KubernetesPolicy {
                platform_operated: true,
            }),
            acceptance: r
                .get::<_, Option<String>>(10)?
                .and_then(|s| serde_json::from_str(&s).ok()),
        },
        archived_at: r.get(7)?,
        created_at: r.get(8)?,
        updated_at: r.get(9)?,
    })
}

/// The pool `pool` of `tenant`, or `NOT_FOUND` (also when it belongs to another tenant).
pub fn pool_load(tx: &Tx<'_>, tenant: &str, pool: &str) -> ApiResult<Pool> {
    validate::tenant_id("tenantId", tenant)?;
    validate::pool_id("poolId", pool)?;
    found(
        crate::store::query_row(
            tx,
            &format!("SELECT {POOL_COLS} FROM pools WHERE id = ?1 AND tenant_id = ?2"),
            [pool, tenant],
            pool_row,
        ),
        || format!("pool {pool} not found in tenant {tenant}"),
    )
}

/// The pool by id alone, for the JoinService (which then checks the tenant itself).
pub fn pool_by_id(tx: &Tx<'_>, pool: &str) -> ApiResult<Option<Pool>> {
    Ok(crate::store::query_row(
        tx,
        &format!("SELECT {POOL_COLS} FROM pools WHERE id = ?1"),
        [pool],
        pool_row,
    )
    .optional()?)
}

pub fn pool_save(tx: &Tx<'_>, p: &Pool) -> ApiResult<()> {
    crate::store::exec(tx,
        "UPDATE pools SET name = ?2, agent = ?3, join_attestors = ?4, k8s_platform_operated = ?5, archived_at = ?6, updated_at = ?7, acceptance = ?8 WHERE id = ?1",
        params![
            p.id,
            p.name,
            p.agent,
            p.policy.join_attestors.as_ref().map(|a| serde_json::to_string(a).expect("serializes")),
            p.policy.kubernetes.as_ref().is_some_and(|k| k.platform_operated) as i64,
            p.archived_at,
            p.updated_at,
            p.policy.acceptance.as_ref().map(|a| serde_json::to_string(a).expect("serializes"))
        ],
    )?;
    Ok(())
}

pub const TOKEN_COLS: &str = "id, tenant_id, pool_id, site_id, role, secret_sha256, max_uses, uses_left, expect_json, allow_reclaim, hosted, created_at, expires_at, revoked_at, node_id";

pub fn token_row(r: &crate::store::Row) -> crate::store::SqlResult<TokenRow> {
    let expect: Option<String> = r.get(8)?;
    Ok(TokenRow {
        id: r.get(0)?,
        tenant_id: r.get(1)?,
        pool_id: r.get(2)?,
        site_id: r.get(3)?,
        role: r.get(4)?,
        secret_sha256: r.get(5)?,
        max_uses: r.get(6)?,
        uses_left: r.get(7)?,
        expect: expect.and_then(|s| serde_json::from_str(&s).ok()),
        allow_reclaim: r.get::<_, i64>(9)? == 1,
        hosted: r.get(10)?,
        created_at: r.get(11)?,
        expires_at: r.get(12)?,
        revoked_at: r.get(13)?,
        node_id: r.get(14)?,
    })
}

pub fn tenant_must_exist(tx: &Tx<'_>, tenant: &str) -> ApiResult<()> {
    let n: i64 = crate::store::query_row(
        tx,
        "SELECT count(*) FROM tenants WHERE id = ?1",
        [tenant],
        |r| r.get(0),
    )?;
    if n == 0 {
        return Err(ApiError::not_found(format!("tenant {tenant} not found")));
    }
    Ok(())
}

/// A join token by id.
pub fn token_by_id(tx: &Tx<'_>, id: &str) -> ApiResult<Option<TokenRow>> {
    Ok(crate::store::query_row(
        tx,
        &format!("SELECT {TOKEN_COLS} FROM join_tokens WHERE id = ?1"),
        [id],
        token_row,
    )
    .optional()?)
}

/// One use of a token consumed: `false` when none was left to spend (another writer spent the
/// last one since the token was read: the join is refused, never admitted on a use it did not get).
pub fn token_spend_use(tx: &Tx<'_>, id: &str) -> ApiResult<bool> {
    Ok(crate::store::exec(
        tx,
        "UPDATE join_tokens SET uses_left = uses_left - 1 WHERE id = ?1 AND uses_left > 0",
        [id],
    )? == 1)
}

/// The id of the tenant with this name.
pub fn tenant_named(tx: &Tx<'_>, name: &str) -> ApiResult<Option<String>> {
    Ok(
        crate::store::query_row(tx, "SELECT id FROM tenants WHERE name = ?1", [name], |r| {
            r.get(0)
        })
        .optional()?,
    )
}

/// A new (not root) tenant.
pub fn tenant_insert(tx: &Tx<'_>, id: &str, name: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "INSERT INTO tenants (id, name, is_root, created_at) VALUES (?1, ?2, 0, ?3)",
        params![id, name, now],
    )?;
    Ok(())
}

/// A tenant as listed: id, name, root or not, created at.
pub type TenantRow = (String, String, bool, i64);

pub fn tenants(tx: &Tx<'_>) -> ApiResult<Vec<TenantRow>> {
    let items = crate::store::query_all(
        tx,
        "SELECT id, name, is_root, created_at FROM tenants ORDER BY id",
        [],
        |r| Ok((r.get(0)?, r.get(1)?, r.get::<_, i64>(2)? == 1, r.get(3)?)),
    )?;
    Ok(items)
}

/// The id of the tenant's pool with this name.
pub fn pool_named(tx: &Tx<'_>, tenant: &str, name: &str) -> ApiResult<Option<String>> {
    Ok(crate::store::query_row(
        tx,
        "SELECT id FROM pools WHERE tenant_id = ?1 AND name = ?2",
        [tenant, name],
        |r| r.get(0),
    )
    .optional()?)
}

/// A new pool (its policy written by [`pool_save`]).
pub fn pool_insert(tx: &Tx<'_>, p: &Pool) -> ApiResult<()> {
    crate::store::exec(tx,
        "INSERT INTO pools (id, tenant_id, site_id, name, agent, created_at, updated_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?6)",
        params![p.id, p.tenant_id, p.site_id, p.name, p.agent, p.created_at],
    )?;
    pool_save(tx, p)
}

/// A tenant's pools after `cursor`, archived ones too when asked, at most `limit`.
pub fn pools(
    tx: &Tx<'_>,
    tenant: &str,
    cursor: &str,
    include_archived: bool,
    limit: i64,
) -> ApiResult<Vec<Pool>> {
    let rows = crate::store::query_all(tx, &format!(
        "SELECT {POOL_COLS} FROM pools WHERE tenant_id = ?1 AND id > ?2 AND (?3 = 1 OR archived_at IS NULL) ORDER BY id LIMIT ?4"
    ), params![tenant, cursor, include_archived, limit], pool_row)?;
    Ok(rows)
}

/// A new join token (its secret's hash only), minted by `created_by` under `idempotency_key`.
pub fn token_insert(
    tx: &Tx<'_>,
    t: &TokenRow,
    idempotency_key: &str,
    created_by: &str,
) -> ApiResult<()> {
    crate::store::exec(tx,
        "INSERT INTO join_tokens (id, tenant_id, pool_id, site_id, role, secret_sha256, max_uses, uses_left, expect_json,
         allow_reclaim, hosted, idempotency_key, created_by, created_at, expires_at, node_id)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15)",
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
            idempotency_key,
            created_by,
            t.created_at,
            t.expires_at,
            t.node_id
        ],
    )?;
    Ok(())
}

/// A pool's tokens after `cursor` (the inactive ones too when asked), at most `limit`.
pub fn tokens(
    tx: &Tx<'_>,
    (tenant, pool): (&str, &str),
    cursor: &str,
    include_inactive: bool,
    now: i64,
    limit: i64,
) -> ApiResult<Vec<TokenRow>> {
    let rows = crate::store::query_all(tx, &format!(
        "SELECT {TOKEN_COLS} FROM join_tokens WHERE tenant_id = ?1 AND pool_id = ?2 AND id > ?3
         AND (?4 = 1 OR (revoked_at IS NULL AND uses_left > 0 AND expires_at > ?5)) ORDER BY id LIMIT ?6"
    ),
            params![tenant, pool, cursor, include_inactive, now, limit],
            token_row,
        )?;
    Ok(rows)
}

/// A token of this tenant and pool, or `NOT_FOUND`.
pub fn token_load(tx: &Tx<'_>, tenant: &str, pool: &str, id: &str) -> ApiResult<TokenRow> {
    found(
        crate::store::query_row(tx,
            &format!("SELECT {TOKEN_COLS} FROM join_tokens WHERE id = ?1 AND tenant_id = ?2 AND pool_id = ?3"),
            [id, tenant, pool],
            token_row,
        ),
        || format!("join token {id} not found in tenant {tenant} and pool {pool}"),
    )
}

pub fn token_revoke(tx: &Tx<'_>, id: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE join_tokens SET revoked_at = ?2 WHERE id = ?1",
        params![id, now],
    )?;
    Ok(())
}

/// The `provisioned` tokens of `node` that could still be spent, revoked: their ids.
pub fn revoke_provisioned(tx: &Tx<'_>, node: &str, now: i64) -> ApiResult<Vec<(String, String)>> {
    let ids: Vec<(String, String)> = crate::store::query_all(
        tx,
        "SELECT id, tenant_id FROM join_tokens WHERE node_id = ?1 AND role = 'provisioned'
             AND revoked_at IS NULL AND uses_left > 0 AND expires_at > ?2",
        params![node, now],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    for (id, _) in &ids {
        token_revoke(tx, id, now)?;
    }
    Ok(ids)
}
