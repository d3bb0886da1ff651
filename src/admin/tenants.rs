//! `tenants/create` and `tenants/list`.

use crate::admin::ctx::Ctx;
use crate::base::clock::rfc3339;
use crate::base::error::{ApiError, ApiResult};
use crate::store::events::audit;
use crate::store::{tenancy, Tx};
use crate::{base::ids, domain::validate};
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
    tx: &Tx<'_>,
    ctx: &Ctx<'_>,
    i: TenantsCreateInput,
) -> ApiResult<Value> {
    validate::name("name", &i.name)?;
    let exists = tenancy::tenant_named(tx, &i.name)?;
    if let Some(id) = exists {
        return Err(ApiError::already_exists(format!(
            "a tenant named {} exists already ({id})",
            i.name
        )));
    }
    let id = ids::new_id("tn", ctx.now * 1000);
    tenancy::tenant_insert(tx, &id, &i.name, ctx.now)?;
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

pub(super) fn tenants_list(tx: &Tx<'_>, _: Empty) -> ApiResult<Value> {
    let items: Vec<Value> = tenancy::tenants(tx)?
        .into_iter()
        .map(|(id, name, root, created)| tenant_json(id, name, root, created))
        .collect();
    Ok(json!({"items": items, "cursor": null}))
}
