//! Sessions: a node's live mTLS connection to the gateway (`Hello` / `Welcome`, heartbeats).
//!
//! The gateway keeps the live connections in a `Registry` (`base::registry`); the JoinService's writer records
//! `connected` and `last_seen` in the node's row and publishes `node.connected` /
//! `node.disconnected`. Revoking a node's identity (or retiring or deleting it, or a reclaim that
//! replaces it) closes its session at once through the registry.

use crate::base::error::ApiResult;
use crate::proto::protocol::Outcome;
use crate::store::Tx;
use serde_json::json;

/// A `Hello` over mTLS with `leaf`: the certificate must be byte for byte a `node_certs` row,
/// unrevoked, unexpired, of the node's current generation, and the node not retired.
/// An `adopting` node's `Hello` then starts its pool's acceptance (`join::acceptance`), with the
/// evidence the agent signed.
pub fn open(
    tx: &Tx<'_>,
    leaf: &[u8],
    hello: Option<&crate::proto::protocol::HelloEvidence>,
    now: i64,
) -> ApiResult<Outcome> {
    let Some(l) = crate::proto::x509::parse_node_leaf(leaf) else {
        return Ok(Outcome::Refused);
    };
    let row = crate::store::nodes::leaf(tx, &l.serial_hex, leaf)?;
    let Some(c) = row else {
        tracing::info!(serial = %l.serial_hex, "session refused: unknown certificate");
        return Ok(Outcome::Refused);
    };
    if c.revoked
        || c.not_after <= now
        || c.generation != c.current_generation
        || c.state == "retired"
    {
        tracing::info!(node = %c.node_id, "session refused: the certificate is revoked, expired or superseded, or the node retired");
        return Ok(Outcome::Refused);
    }
    let (node, tenant, connected) = (c.node_id, c.tenant, c.connected);
    crate::store::nodes::mark_connected(tx, &node, now)?;
    if !connected {
        crate::store::events::publish(tx, now, &tenant, "node.connected", json!({"nodeId": node}))?;
    }
    if c.state == "adopting" {
        crate::join::acceptance::on_hello(tx, &l, hello, now)?;
    }
    Ok(Outcome::SessionOpened { node_id: node })
}

pub fn seen(tx: &Tx<'_>, node: &str, now: i64) -> ApiResult<Outcome> {
    crate::store::nodes::mark_seen(tx, node, now)?;
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

pub fn closed(tx: &Tx<'_>, node: &str, now: i64) -> ApiResult<Outcome> {
    if let Some(t) = crate::store::nodes::mark_disconnected(tx, node, now)? {
        crate::store::events::publish(tx, now, &t, "node.disconnected", json!({"nodeId": node}))?;
    }
    Ok(Outcome::Done)
}
