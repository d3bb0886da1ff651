//! The gateway's live node sessions: which nodes hold one, and how to end them. Kept by the
//! process that runs the gateway (the network child under privilege separation, which reports
//! them); read by the JoinService (a reclaim never takes a node that is connected).

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
    /// the gateway runs there (`privsep`).
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
