//! `pools/create`, `list`, `get`, `update` and `archive`.

use crate::admin::ctx::{page, Ctx};
use crate::base::error::{ApiError, ApiResult};
use crate::domain::pool::Policy;
use crate::domain::pool::Pool;
use crate::store::events::audit;
use crate::store::tenancy::pool_load;
use crate::store::tenancy::pool_save;
use crate::store::tenancy::tenant_must_exist;
use crate::store::{tenancy, Tx};
use crate::{base::ids, domain::validate};
use serde::Deserialize;
use serde_json::{json, Value};

pub(super) fn agent_value(a: Option<String>) -> ApiResult<String> {
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
pub(super) struct PoolsCreateInput {
    tenant_id: String,
    name: String,
    agent: Option<String>,
    #[serde(default)]
    policy: Policy,
}

pub(super) fn pools_create(tx: &Tx<'_>, ctx: &Ctx<'_>, i: PoolsCreateInput) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    validate::name("name", &i.name)?;
    let agent = agent_value(i.agent)?;
    i.policy.validate()?;
    tenant_must_exist(tx, &i.tenant_id)?;
    let dup = tenancy::pool_named(tx, &i.tenant_id, &i.name)?;
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
    tenancy::pool_insert(tx, &p)?;
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
pub(super) struct PoolsListInput {
    tenant_id: String,
    #[serde(default)]
    include_archived: bool,
    limit: Option<i64>,
    cursor: Option<String>,
}

pub(super) fn pools_list(tx: &Tx<'_>, i: PoolsListInput) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    if let Some(c) = &i.cursor {
        validate::id("cursor", c, "pool")?;
    }
    tenant_must_exist(tx, &i.tenant_id)?;
    let rows = tenancy::pools(
        tx,
        &i.tenant_id,
        &i.cursor.unwrap_or_default(),
        i.include_archived,
        limit + 1,
    )?
    .into_iter()
    .map(|p| (p.id.clone(), p.to_json()))
    .collect();
    Ok(page(rows, limit, |id| id.clone()))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct PoolRef {
    pub(super) tenant_id: String,
    pub(super) pool_id: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct PoolsUpdateInput {
    tenant_id: String,
    pool_id: String,
    name: Option<String>,
    agent: Option<String>,
    policy: Option<Policy>,
}

pub(super) fn pools_update(tx: &Tx<'_>, ctx: &Ctx<'_>, i: PoolsUpdateInput) -> ApiResult<Value> {
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
            let dup = tenancy::pool_named(tx, &p.tenant_id, &n)?;
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

pub(super) fn pools_archive(tx: &Tx<'_>, ctx: &Ctx<'_>, i: PoolRef) -> ApiResult<Value> {
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
