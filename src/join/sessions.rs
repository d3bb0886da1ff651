//! Sessions: a node's live mTLS connection to the gateway (`Hello` / `Welcome`, heartbeats).
//!
//! The gateway keeps the live connections in a `Registry` (`base::registry`); the JoinService's writer records
//! `connected` and `last_seen` in the node's row and publishes `node.connected` /
//! `node.disconnected`. Revoking a node's identity (or retiring or deleting it, or a reclaim that
//! replaces it) closes its session at once through the registry.

use crate::base::error::ApiResult;
use crate::proto::protocol::Outcome;
use rusqlite::{params, OptionalExtension, Transaction};
use serde_json::json;

struct CertRow {
    node: String,
    generation: i64,
    revoked: bool,
    not_after: i64,
    current_generation: i64,
    state: String,
    tenant: String,
    connected: bool,
}

/// A `Hello` over mTLS with `leaf`: the certificate must be byte for byte a `node_certs` row,
/// unrevoked, unexpired, of the node's current generation, and the node not retired.
pub fn open(tx: &Transaction<'_>, leaf: &[u8], now: i64) -> ApiResult<Outcome> {
    let Some(l) = crate::proto::x509::parse_node_leaf(leaf) else {
        return Ok(Outcome::Refused);
    };
    let row = crate::store::query_row(tx,
            "SELECT c.node_id, c.identity_generation, c.revoked_at, c.not_after, n.identity_generation, n.state,
                    n.tenant_id, n.connected
             FROM node_certs c JOIN nodes n ON n.id = c.node_id WHERE c.serial = ?1 AND c.der = ?2",
            params![l.serial_hex, leaf],
            |x| {
                Ok(CertRow {
                    node: x.get(0)?,
                    generation: x.get(1)?,
                    revoked: x.get::<_, Option<i64>>(2)?.is_some(),
                    not_after: x.get(3)?,
                    current_generation: x.get(4)?,
                    state: x.get(5)?,
                    tenant: x.get(6)?,
                    connected: x.get::<_, i64>(7)? == 1,
                })
            },
        )
        .optional()?;
    let Some(c) = row else {
        tracing::info!(serial = %l.serial_hex, "session refused: unknown certificate");
        return Ok(Outcome::Refused);
    };
    if c.revoked
        || c.not_after <= now
        || c.generation != c.current_generation
        || c.state == "retired"
    {
        tracing::info!(node = %c.node, "session refused: the certificate is revoked, expired or superseded, or the node retired");
        return Ok(Outcome::Refused);
    }
    let (node, tenant, connected) = (c.node, c.tenant, c.connected);
    crate::store::exec(
        tx,
        "UPDATE nodes SET connected = 1, last_seen = ?2 WHERE id = ?1",
        params![node, now],
    )?;
    if !connected {
        crate::store::events::publish(tx, now, &tenant, "node.connected", json!({"nodeId": node}))?;
    }
    Ok(Outcome::SessionOpened { node_id: node })
}

pub fn seen(tx: &Transaction<'_>, node: &str, now: i64) -> ApiResult<Outcome> {
    crate::store::exec(
        tx,
        "UPDATE nodes SET last_seen = ?2 WHERE id = ?1",
        params![node, now],
    )?;
    Ok(Outcome::Done)
}

/// Records the sessions of `nodes` closed in one transaction (the appliance is stopping).
pub fn closed_all(site: &crate::join::site::Site, nodes: &[String]) -> ApiResult<()> {
    if nodes.is_empty() {
        return Ok(());
    }
    let now = crate::base::clock::now();
    site.store.write(|tx| {
        for node in nodes {
            closed(tx, node, now)?;
        }
        Ok(())
    })
}

pub fn closed(tx: &Transaction<'_>, node: &str, now: i64) -> ApiResult<Outcome> {
    let tenant: Option<String> = crate::store::query_row(
        tx,
        "SELECT tenant_id FROM nodes WHERE id = ?1 AND connected = 1",
        [node],
        |x| x.get(0),
    )
    .optional()?;
    if let Some(t) = tenant {
        crate::store::exec(
            tx,
            "UPDATE nodes SET connected = 0, last_seen = ?2 WHERE id = ?1",
            params![node, now],
        )?;
        crate::store::events::publish(tx, now, &t, "node.disconnected", json!({"nodeId": node}))?;
    }
    Ok(Outcome::Done)
}
