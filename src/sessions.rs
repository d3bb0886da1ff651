//! Sessions: a node's live mTLS connection to the gateway (`Hello` / `Welcome`, heartbeats).
//!
//! The gateway keeps the live connections in a [`Registry`]; the JoinService's writer records
//! `connected` and `last_seen` in the node's row and publishes `node.connected` /
//! `node.disconnected`. Revoking a node's identity (or retiring or deleting it) closes its session
//! at once through the registry.

use crate::error::ApiResult;
use crate::protocol::Outcome;
use rusqlite::{params, OptionalExtension, Transaction};
use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use tokio::sync::watch;

/// The live sessions of the gateway, by node id.
#[derive(Default)]
pub struct Registry {
    live: Mutex<HashMap<String, (u64, watch::Sender<bool>)>>,
    next: AtomicU64,
    /// Where [`Registry::close`] is also sent: the network child holds the live connections when
    /// the gateway runs there ([`crate::privsep`]).
    forward: std::sync::OnceLock<tokio::sync::mpsc::UnboundedSender<String>>,
}

impl Registry {
    /// Registers a session; an older session of the same node is told to close.
    pub fn register(&self, node: &str) -> (u64, watch::Receiver<bool>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = watch::channel(false);
        let old = self
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.to_string(), (id, tx));
        if let Some((_, old)) = old {
            let _ = old.send(true);
        }
        (id, rx)
    }

    /// Removes the session if it is still the node's current one; true when it was.
    pub fn unregister(&self, node: &str, id: u64) -> bool {
        let mut live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        if live.get(node).is_some_and(|(i, _)| *i == id) {
            live.remove(node);
            true
        } else {
            false
        }
    }

    /// Sends every later [`Registry::close`] to `tx` as well.
    pub fn set_forward(&self, tx: tokio::sync::mpsc::UnboundedSender<String>) {
        let _ = self.forward.set(tx);
    }

    /// Closes the node's live session, if any.
    pub fn close(&self, node: &str) {
        if let Some(tx) = self.forward.get() {
            let _ = tx.send(node.to_string());
        }
        if let Some((_, tx)) = self
            .live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(node)
        {
            let _ = tx.send(true);
        }
    }

    pub fn len(&self) -> usize {
        self.live.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

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
    let Some(l) = crate::x509::parse_node_leaf(leaf) else {
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
pub fn closed_all(app: &crate::app::App, nodes: &[String]) -> ApiResult<()> {
    if nodes.is_empty() {
        return Ok(());
    }
    let now = crate::clock::now();
    app.store.write(|tx| {
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
