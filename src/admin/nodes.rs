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
struct ProvisionInput {
    tenant_id: String,
    node_id: String,
    /// Default 7200 (2 hours), 60 to 86400.
    ttl_seconds: Option<i64>,
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
        "nodes/provisionToken" => parse::<ProvisionInput>(body).and_then(|i| {
            validate::tenant_id("tenantId", &i.tenant_id)?;
            validate::id("nodeId", &i.node_id, "node")?;
            let ttl = i.ttl_seconds.unwrap_or(7200);
            validate::range("ttlSeconds", ttl, 60, 86_400)?;
            store.write(|tx| provision_token(tx, ctx, &i.tenant_id, &i.node_id, ttl))
        }),
        "nodes/rediscover" => parse::<RediscoverInput>(body).and_then(|i| {
            validate::tenant_id("tenantId", &i.tenant_id)?;
            validate::id("nodeId", &i.node_id, "node")?;
            store.write(|tx| {
                load(tx, &i.tenant_id, &i.node_id)?;
                if i.rediscover {
                    // Back to the ramdisk: a deploy's token for this node is void.
                    void_provisioned(tx, ctx, &i.node_id)?;
                }
                crate::store::nodes::set_rediscover(tx, &i.node_id, i.rediscover, ctx.now)?;
                audit(tx, ctx.now, &i.tenant_id, "nodes.rediscover", ctx.caller, &i.node_id, json!({"rediscover": i.rediscover}))?;
                load(tx, &i.tenant_id, &i.node_id)
            })
        }),
        "nodes/adopt" => parse::<NodeRef>(body).and_then(|i| {
            validate_ref(&i)?;
            store.write(|tx| {
                let v = load(tx, &i.tenant_id, &i.node_id)?;
                if v["state"] != "adopting" {
                    return Err(ApiError::invalid_state(format!(
                        "node {} is {}: only an adopting node runs its acceptance checks",
                        i.node_id,
                        v["state"].as_str().unwrap_or_default()
                    )));
                }
                let result = crate::join::acceptance::run(tx, &i.node_id, ctx.now)?;
                let data = json!({
                    "nodeId": i.node_id,
                    "adopted": matches!(result, Some(Ok(()))),
                    "failedCheck": result.and_then(|r| r.err()).map(|f| f.check),
                });
                audit(tx, ctx.now, &i.tenant_id, "nodes.adopt", ctx.caller, &i.node_id, data)?;
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

/// Revokes the node's spendable `provisioned` tokens, each with its event and audit row.
fn void_provisioned(tx: &Tx<'_>, ctx: &Ctx<'_>, node: &str) -> ApiResult<()> {
    for (id, tenant) in crate::store::tenancy::revoke_provisioned(tx, node, ctx.now)? {
        let data = json!({"tokenId": id, "nodeId": node, "role": "provisioned"});
        crate::admin::tokens::record_revoked(tx, ctx, &tenant, &id, data)?;
    }
    Ok(())
}

/// `nodes.provisionToken`: a single-use token of role `provisioned` for a `ramdisk` node whose
/// hardware key is trusted, bound by `expect` to its product UUID, serial and boot MAC. The
/// deploy hands it to the installed OS (`bca agent join --node-id`), which joins as this node,
/// role `node`. A node holds one such token at a time: minting voids the earlier one. Shown once;
/// only its hash is stored.
fn provision_token(
    tx: &Tx<'_>,
    ctx: &Ctx<'_>,
    tenant: &str,
    node: &str,
    ttl: i64,
) -> ApiResult<Value> {
    use crate::domain::token::{Expect, TokenRow};
    let v = load(tx, tenant, node)?;
    if v["state"] == "retired" {
        return Err(ApiError::invalid_state(format!("node {node} is retired")));
    }
    if v["role"] != "ramdisk" {
        return Err(ApiError::invalid_state(format!(
            "node {node} has role {}: a provisioned token turns a ramdisk node (a machine the discovery ramdisk brought in) into an OS node",
            v["role"].as_str().unwrap_or_default()
        )));
    }
    if v["hardwareKeyTrusted"] != true {
        return Err(ApiError::invalid_state(format!(
            "node {node}'s hardware key is not trusted (placeholder identifiers): nothing would bind the token to this machine"
        )));
    }
    let claims: crate::proto::claims::Claims =
        serde_json::from_value(v["claims"].clone()).unwrap_or_default();
    let ids = crate::proto::claims::Identifiers::from_claims(&claims);
    let expect = Expect {
        product_uuid: ids.product_uuid.clone(),
        serial: ids.serials.first().cloned(),
        // A MAC counts only when permanent (a locally administered one, as a VM's, binds nothing:
        // `expect` matches the permanent MACs alone).
        mac: v["bootMac"]
            .as_str()
            .and_then(crate::proto::claims::normalize_mac)
            .or_else(|| ids.macs.first().cloned()),
        gpu_uuid: None,
    };
    expect.validate()?;
    let pool =
        crate::store::tenancy::pool_load(tx, tenant, v["poolId"].as_str().unwrap_or_default())?;
    void_provisioned(tx, ctx, node)?;
    let id = crate::base::ids::new_id("jt", ctx.now * 1000);
    let (bearer, secret_sha256) = crate::admin::tokens::new_bearer(&id);
    let t = TokenRow {
        id: id.clone(),
        tenant_id: tenant.to_string(),
        pool_id: pool.id.clone(),
        site_id: pool.site_id.clone(),
        role: "provisioned".into(),
        secret_sha256,
        max_uses: 1,
        uses_left: 1,
        expect: Some(expect),
        allow_reclaim: false,
        hosted: None,
        created_at: ctx.now,
        expires_at: ctx.now + ttl,
        revoked_at: None,
        node_id: Some(node.to_string()),
    };
    crate::store::tenancy::token_insert(tx, &t, &format!("provision:{id}"), ctx.caller)?;
    let data = json!({"tokenId": id, "poolId": pool.id, "pinned": true, "role": "provisioned", "nodeId": node});
    publish(
        tx,
        ctx.now,
        tenant,
        "security.join-token.created",
        data.clone(),
    )?;
    audit(
        tx,
        ctx.now,
        tenant,
        "nodes.provisionToken",
        ctx.caller,
        node,
        data,
    )?;
    let mut out = t.to_json();
    out["token"] = json!(bearer.render().as_str());
    Ok(out)
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
