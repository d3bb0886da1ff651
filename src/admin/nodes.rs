//! Nodes: the admin API's `nodes.*` methods and `bca nodes`.

use crate::admin::ctx::parse;
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

const COLS: &str = "id, tenant_id, site_id, pool_id, role, state, trust, hardware_key, hardware_key_trusted, identity_generation,
    attestor, hostname, claims_json, created_at, updated_at, retired_at, connected, last_seen, rediscover, boot_mac";

fn row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Value> {
    let mut v = json!({
        "id": r.get::<_, String>(0)?, "tenantId": r.get::<_, String>(1)?, "siteId": r.get::<_, String>(2)?,
        "poolId": r.get::<_, String>(3)?, "role": r.get::<_, String>(4)?, "state": r.get::<_, String>(5)?,
        "trust": r.get::<_, String>(6)?, "hardwareKey": r.get::<_, Option<String>>(7)?,
        "hardwareKeyTrusted": r.get::<_, i64>(8)? == 1, "identityGeneration": r.get::<_, i64>(9)?,
        "attestor": r.get::<_, String>(10)?, "hostname": r.get::<_, Option<String>>(11)?,
        "claims": serde_json::from_str::<Value>(&r.get::<_, String>(12)?).unwrap_or(Value::Null),
        "createdAt": rfc3339(r.get(13)?), "updatedAt": rfc3339(r.get(14)?),
    });
    if let Some(t) = r.get::<_, Option<i64>>(15)? {
        v["retiredAt"] = json!(rfc3339(t));
    }
    v["connected"] = json!(r.get::<_, i64>(16)? == 1);
    v["rediscover"] = json!(r.get::<_, i64>(18)? == 1);
    v["bootMac"] = json!(r.get::<_, Option<String>>(19)?);
    v["lastSeen"] = json!(r.get::<_, Option<i64>>(17)?.map(rfc3339));
    Ok(v)
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

fn load(tx: &Transaction<'_>, tenant: &str, node: &str) -> ApiResult<Value> {
    found(
        tx.query_row(
            &format!("SELECT {COLS} FROM nodes WHERE id = ?1 AND tenant_id = ?2"),
            [node, tenant],
            row,
        ),
        || format!("node {node} not found in tenant {tenant}"),
    )
}

fn certs(tx: &Transaction<'_>, node: &str) -> ApiResult<Vec<Value>> {
    let mut st = tx.prepare(
        "SELECT serial, identity_generation, role, not_before, not_after, revoked_at, revoke_reason FROM node_certs
         WHERE node_id = ?1 ORDER BY created_at, serial",
    )?;
    let out = st
        .query_map([node], |r| {
            Ok(json!({
                "serial": r.get::<_, String>(0)?, "identityGeneration": r.get::<_, i64>(1)?, "role": r.get::<_, String>(2)?,
                "notBefore": rfc3339(r.get(3)?), "notAfter": rfc3339(r.get(4)?),
                "revokedAt": r.get::<_, Option<i64>>(5)?.map(rfc3339), "revokeReason": r.get::<_, Option<String>>(6)?,
            }))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(out)
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
                    tx.execute("UPDATE nodes SET state = 'retired', retired_at = ?2, updated_at = ?2 WHERE id = ?1", params![i.node_id, ctx.now])?;
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
                tx.execute("DELETE FROM nodes WHERE id = ?1", [&i.node_id])?;
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
                tx.execute(
                    "UPDATE nodes SET rediscover = ?2, updated_at = ?3 WHERE id = ?1",
                    params![i.node_id, i.rediscover as i64, ctx.now],
                )?;
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

fn list(tx: &Transaction<'_>, i: ListInput) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    if let Some(p) = &i.pool_id {
        validate::pool_id("poolId", p)?;
    }
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    if let Some(c) = &i.cursor {
        validate::id("cursor", c, "node")?;
    }
    let mut st = tx.prepare(&format!(
        "SELECT {COLS} FROM nodes WHERE tenant_id = ?1 AND (?2 IS NULL OR pool_id = ?2) AND id > ?3
         AND (?4 OR state != 'retired') ORDER BY id LIMIT ?5"
    ))?;
    let rows: Vec<(String, Value)> = st
        .query_map(
            params![
                i.tenant_id,
                i.pool_id,
                i.cursor.unwrap_or_default(),
                i.include_retired,
                limit + 1
            ],
            row,
        )?
        .map(|r| r.map(|v| (v["id"].as_str().unwrap_or_default().to_string(), v)))
        .collect::<Result<_, _>>()?;
    Ok(crate::admin::ctx::page(rows, limit, |id| id.clone()))
}
