//! Nodes: the admin API's `nodes.*` methods and `bca nodes`.

use crate::admin::ctx::parse;
use crate::admin::ctx::Ctx;
use crate::base::error::{ApiError, ApiResult};
use crate::domain::validate;
use crate::store::events::audit;
use crate::store::events::publish;
use crate::store::{Store, Tx};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RediscoverInput {
    tenant_id: String,
    node_id: String,
    #[serde(default = "yes")]
    rediscover: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListInput {
    tenant_id: String,
    pool_id: Option<String>,
    #[serde(default)]
    include_retired: bool,
    limit: Option<i64>,
    cursor: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NodeRef {
    tenant_id: String,
    node_id: String,
    reason: Option<String>,
}

fn validate_ref(i: &NodeRef) -> ApiResult<()> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    validate::id("nodeId", &i.node_id, "node")?;
    if let Some(r) = &i.reason {
        if r.len() > 512 {
            return Err(ApiError::invalid_input(
                "reason must be at most 512 characters",
            ));
        }
    }
    Ok(())
}

fn load(tx: &Tx<'_>, tenant: &str, node: &str) -> ApiResult<Value> {
    crate::store::nodes::shown(tx, tenant, node)
}

fn certs(tx: &Tx<'_>, node: &str) -> ApiResult<Vec<Value>> {
    crate::store::nodes::certificates(tx, node)
}

pub fn dispatch(store: &Store, ctx: &Ctx<'_>, path: &str, body: &[u8]) -> Option<ApiResult<Value>> {
    let out = match path {
        "nodes/list" => parse::<ListInput>(body).and_then(|i| store.read(|tx| list(tx, i))),
        "nodes/get" => parse::<NodeRef>(body).and_then(|i| {
            validate_ref(&i)?;
            store.read(|tx| {
                let mut v = load(tx, &i.tenant_id, &i.node_id)?;
                v["certificates"] = json!(certs(tx, &i.node_id)?);
                Ok(v)
            })
        }),
        "nodes/retire" => parse::<NodeRef>(body).and_then(|i| {
            validate_ref(&i)?;
            store.write(|tx| {
                let v = load(tx, &i.tenant_id, &i.node_id)?;
                if v["state"] != "retired" {
                    crate::store::nodes::retire(tx, &i.node_id, ctx.now)?;
                    let data = json!({"nodeId": i.node_id, "reason": i.reason});
                    publish(tx, ctx.now, &i.tenant_id, "node.retired", data.clone())?;
                    audit(tx, ctx.now, &i.tenant_id, "nodes.retire", ctx.caller, &i.node_id, data)?;
                }
                load(tx, &i.tenant_id, &i.node_id)
            })
        }),
        "nodes/delete" => parse::<NodeRef>(body).and_then(|i| {
            validate_ref(&i)?;
            store.write(|tx| {
                let v = load(tx, &i.tenant_id, &i.node_id)?;
                let revoked = crate::store::nodes::revoke_all(tx, &i.tenant_id, &i.node_id, "deleted", ctx.now)?;
                crate::store::nodes::delete(tx, &i.node_id)?;
                let data = json!({"nodeId": i.node_id, "hardwareKey": v["hardwareKey"], "revokedSerials": revoked});
                publish(tx, ctx.now, &i.tenant_id, "node.deleted", data.clone())?;
                audit(tx, ctx.now, &i.tenant_id, "nodes.delete", ctx.caller, &i.node_id, data)?;
                Ok(v)
            })
        }),
        "nodes/rediscover" => parse::<RediscoverInput>(body).and_then(|i| {
            validate::tenant_id("tenantId", &i.tenant_id)?;
            validate::id("nodeId", &i.node_id, "node")?;
            store.write(|tx| {
                load(tx, &i.tenant_id, &i.node_id)?;
                crate::store::nodes::set_rediscover(tx, &i.node_id, i.rediscover, ctx.now)?;
                audit(tx, ctx.now, &i.tenant_id, "nodes.rediscover", ctx.caller, &i.node_id, json!({"rediscover": i.rediscover}))?;
                load(tx, &i.tenant_id, &i.node_id)
            })
        }),
        "nodes/revokeIdentity" => parse::<NodeRef>(body).and_then(|i| {
            validate_ref(&i)?;
            store.write(|tx| {
                load(tx, &i.tenant_id, &i.node_id)?;
                let revoked = crate::store::nodes::revoke_all(tx, &i.tenant_id, &i.node_id, "revoked", ctx.now)?;
                let data = json!({"nodeId": i.node_id, "revokedSerials": revoked, "reason": i.reason});
                audit(tx, ctx.now, &i.tenant_id, "nodes.revokeIdentity", ctx.caller, &i.node_id, data)?;
                let mut v = load(tx, &i.tenant_id, &i.node_id)?;
                v["certificates"] = json!(certs(tx, &i.node_id)?);
                Ok(v)
            })
        }),
        _ => return None,
    };
    // A node whose identity is revoked, or that is retired or deleted, loses its session at once.
    if out.is_ok()
        && matches!(
            path,
            "nodes/retire" | "nodes/delete" | "nodes/revokeIdentity"
        )
    {
        if let (Some(sessions), Ok(i)) = (ctx.sessions, parse::<NodeRef>(body)) {
            sessions.close(&i.node_id);
        }
    }
    Some(out)
}

fn list(tx: &Tx<'_>, i: ListInput) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    if let Some(p) = &i.pool_id {
        validate::pool_id("poolId", p)?;
    }
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    if let Some(c) = &i.cursor {
        validate::id("cursor", c, "node")?;
    }
    let rows = crate::store::nodes::list(
        tx,
        (&i.tenant_id, i.pool_id.as_deref()),
        &i.cursor.unwrap_or_default(),
        i.include_retired,
        limit + 1,
    )?;
    Ok(crate::admin::ctx::page(rows, limit, |id| id.clone()))
}
