//! `tenants/create` and `tenants/list`.

use crate::admin::ctx::Ctx;
use crate::base::clock::rfc3339;
use crate::base::error::{ApiError, ApiResult};
use crate::store::events::audit;
use crate::{base::ids, domain::validate};
use rusqlite::{params, OptionalExtension, Transaction};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct TenantsCreateInput {
    name: String,
}

pub(super) fn tenant_json(id: String, name: String, root: bool, created: i64) -> Value {
    json!({"id": id, "name": name, "root": root, "createdAt": rfc3339(created)})
}

pub(super) fn tenants_create(
    tx: &Transaction<'_>,
    ctx: &Ctx<'_>,
    i: TenantsCreateInput,
) -> ApiResult<Value> {
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
pub(super) struct Empty {}

pub(super) fn tenants_list(tx: &Transaction<'_>, _: Empty) -> ApiResult<Value> {
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
