//! Tenancy rows: tenants, pools and join tokens as the JoinService and the admin API read them.

use crate::base::error::{ApiError, ApiResult};
use crate::domain::pool::{KubernetesPolicy, Policy, Pool};
use crate::domain::token::TokenRow;
use crate::domain::validate;
use crate::store::found;
use rusqlite::{params, OptionalExtension, Transaction};

pub const POOL_COLS: &str =
    "id, tenant_id, site_id, name, agent, join_attestors, k8s_platform_operated, archived_at, created_at, updated_at";

pub fn pool_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Pool> {
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
        },
        archived_at: r.get(7)?,
        created_at: r.get(8)?,
        updated_at: r.get(9)?,
    })
}

/// The pool `pool` of `tenant`, or `NOT_FOUND` (also when it belongs to another tenant).
pub fn pool_load(tx: &Transaction<'_>, tenant: &str, pool: &str) -> ApiResult<Pool> {
    validate::tenant_id("tenantId", tenant)?;
    validate::pool_id("poolId", pool)?;
    found(
        tx.query_row(
            &format!("SELECT {POOL_COLS} FROM pools WHERE id = ?1 AND tenant_id = ?2"),
            [pool, tenant],
            pool_row,
        ),
        || format!("pool {pool} not found in tenant {tenant}"),
    )
}

/// The pool by id alone, for the JoinService (which then checks the tenant itself).
pub fn pool_by_id(tx: &Transaction<'_>, pool: &str) -> ApiResult<Option<Pool>> {
    Ok(crate::store::query_row(
        tx,
        &format!("SELECT {POOL_COLS} FROM pools WHERE id = ?1"),
        [pool],
        pool_row,
    )
    .optional()?)
}

pub fn pool_save(tx: &Transaction<'_>, p: &Pool) -> ApiResult<()> {
    tx.execute(
        "UPDATE pools SET name = ?2, agent = ?3, join_attestors = ?4, k8s_platform_operated = ?5, archived_at = ?6, updated_at = ?7 WHERE id = ?1",
        params![
            p.id,
            p.name,
            p.agent,
            p.policy.join_attestors.as_ref().map(|a| serde_json::to_string(a).expect("serializes")),
            p.policy.kubernetes.as_ref().is_some_and(|k| k.platform_operated) as i64,
            p.archived_at,
            p.updated_at
        ],
    )?;
    Ok(())
}

pub const TOKEN_COLS: &str = "id, tenant_id, pool_id, site_id, role, secret_sha256, max_uses, uses_left, expect_json, allow_reclaim, hosted, created_at, expires_at, revoked_at";

pub fn token_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<TokenRow> {
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
    })
}

pub fn tenant_must_exist(tx: &Transaction<'_>, tenant: &str) -> ApiResult<()> {
    let n: i64 = tx.query_row(
        "SELECT count(*) FROM tenants WHERE id = ?1",
        [tenant],
        |r| r.get(0),
    )?;
    if n == 0 {
        return Err(ApiError::not_found(format!("tenant {tenant} not found")));
    }
    Ok(())
}
