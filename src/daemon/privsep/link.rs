//! The network child's side of the socketpair: [`Link`] carries its calls to the JoinService and
//! its questions to the core, and signs TLS handshakes with the gateway key the parent keeps
//! (`RemoteKey`): the child never holds a private key.

use super::wire::*;
use rustls::sign::{CertifiedKey, Signer, SigningKey};
use rustls::{SignatureAlgorithm, SignatureScheme};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::oneshot;

/// What a `Sign` request must start with: RFC 8446 section 4.4.3.
pub(super) const TLS13_SERVER_CV: &[u8] = b"TLS 1.3, server CertificateVerify\x00";

/// The child's side of the socketpair: calls and signatures to the parent.
pub struct Link {
    /// Frames for the parent, sent at once or through [`write_frames`]' thread: a runtime
    /// worker never waits on the socket itself.
    pub(super) out: Arc<Outbox>,
    pub(super) pending: Mutex<HashMap<u64, Waiter>>,
    pub(super) next: AtomicU64,
}

pub(super) enum Waiter {
    Blocking(Arc<Slot>),
    Async(oneshot::Sender<Vec<u8>>),
}

/// The answer a blocked runtime worker waits for (a TLS signature). The reader thread fills it
/// and wakes the worker after releasing the lock (see [`Outbox`] for why not a channel).
#[derive(Default)]
pub(super) struct Slot {
    pub(super) answer: Mutex<Option<Vec<u8>>>,
    pub(super) filled: std::sync::Condvar,
}

impl Slot {
    pub(super) fn fill(&self, answer: Vec<u8>) {
        *self.answer.lock().unwrap_or_else(|p| p.into_inner()) = Some(answer);
        self.filled.notify_one();
    }

    /// The answer, or `None` when none came within `wait`.
    pub(super) fn take(&self, wait: Duration) -> Option<Vec<u8>> {
        let guard = self.answer.lock().unwrap_or_else(|p| p.into_inner());
        let (mut guard, _) = self
            .filled
            .wait_timeout_while(guard, wait, |a| a.is_none())
            .unwrap_or_else(|p| p.into_inner());
        guard.take()
    }
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("privsep::Link")
    }
}

impl Link {
    /// Queues a frame for the parent; blocks only when [`CHILD_QUEUE`] frames wait already
    /// (the parent has stopped reading). An error when the writer is gone with the socketpair.
    pub(super) fn send(&self, id: u64, kind: Kind, payload: &[u8]) -> std::io::Result<()> {
        if self.out.push(id, kind, payload) {
            return Ok(());
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            "privsep: the socketpair to the parent is closed",
        ))
    }

    pub(super) fn wait(&self, kind: Kind, payload: &[u8], waiter: Waiter) -> Option<u64> {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, waiter);
        if self.send(id, kind, payload).is_err() {
            self.forget(id);
            return None;
        }
        Some(id)
    }

    pub(super) fn forget(&self, id: u64) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }

    /// A [`crate::proto::protocol::Call`] to the parent's JoinService; empty bytes (read as busy) when
    /// the parent is gone.
    pub async fn call(&self, msg: Vec<u8>) -> Vec<u8> {
        self.request(Kind::Call, &msg).await
    }

    /// One of the edge's questions ([`crate::edge::Ask`], JSON); empty bytes when the parent is
    /// gone.
    pub async fn ask(&self, msg: Vec<u8>) -> Vec<u8> {
        self.request(Kind::Ask, &msg).await
    }

    /// A message of `kind` and the parent's reply; empty bytes when the parent is gone.
    async fn request(&self, kind: Kind, msg: &[u8]) -> Vec<u8> {
        let (tx, rx) = oneshot::channel();
        if self.wait(kind, msg, Waiter::Async(tx)).is_none() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// A TLS signature by the parent. Blocking: rustls signs synchronously; the answer comes
    /// through the reader thread, never through the runtime, so a busy runtime cannot stall it.
    pub(super) fn sign(
        &self,
        leaf_sha256: &[u8; 32],
        scheme: SignatureScheme,
        msg: &[u8],
    ) -> Option<Vec<u8>> {
        let mut p = Vec::with_capacity(34 + msg.len());
        p.extend_from_slice(leaf_sha256);
        p.extend_from_slice(&u16::from(scheme).to_be_bytes());
        p.extend_from_slice(msg);
        let slot = Arc::new(Slot::default());
        let id = self.wait(Kind::Sign, &p, Waiter::Blocking(slot.clone()))?;
        // Waits on the worker itself: the parent answers in microseconds, and the wait is bounded.
        // `block_in_place` here (handing the worker's other tasks to another thread at every
        // handshake) cost joins 30% against 4% for this in the storm bench (2,000 joins each).
        let mut r = slot.take(Duration::from_secs(5));
        if r.is_none() {
            self.forget(id);
            // Answered between the wait's end and `forget`.
            r = slot.take(Duration::ZERO);
        }
        match r?.split_first() {
            Some((0, sig)) => Some(sig.to_vec()),
            _ => None,
        }
    }

    pub(super) fn answer(&self, id: u64, payload: Vec<u8>) {
        let w = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        match w {
            Some(Waiter::Blocking(slot)) => slot.fill(payload),
            Some(Waiter::Async(tx)) => {
                let _ = tx.send(payload);
            }
            None => {}
        }
    }
}

/// The gateway key as the child sees it: every signature is the parent's.
#[derive(Debug)]
pub(super) struct RemoteKey {
    pub(super) link: Arc<Link>,
    pub(super) leaf_sha256: [u8; 32],
    pub(super) scheme: SignatureScheme,
}

#[derive(Debug)]
pub(super) struct RemoteSigner(pub(super) Arc<RemoteKey>);

impl SigningKey for RemoteKey {
    fn choose_scheme(&self, offered: &[SignatureScheme]) -> Option<Box<dyn Signer>> {
        offered.contains(&self.scheme).then(|| {
            Box::new(RemoteSigner(Arc::new(RemoteKey {
                link: self.link.clone(),
                leaf_sha256: self.leaf_sha256,
                scheme: self.scheme,
            }))) as Box<dyn Signer>
        })
    }

    fn algorithm(&self) -> SignatureAlgorithm {
        algorithm(self.scheme)
    }
}

impl Signer for RemoteSigner {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        self.0
            .link
            .sign(&self.0.leaf_sha256, self.0.scheme, message)
            .ok_or_else(|| rustls::Error::General("the key-holding process did not sign".into()))
    }

    fn scheme(&self) -> SignatureScheme {
        self.0.scheme
    }
}

pub(super) fn algorithm(scheme: SignatureScheme) -> SignatureAlgorithm {
    match scheme {
        SignatureScheme::ECDSA_NISTP256_SHA256
        | SignatureScheme::ECDSA_NISTP384_SHA384
        | SignatureScheme::ECDSA_NISTP521_SHA512 => SignatureAlgorithm::ECDSA,
        SignatureScheme::ED25519 => SignatureAlgorithm::ED25519,
        _ => SignatureAlgorithm::RSA,
    }
}

/// The schemes a gateway key may have, most preferred first.
pub(super) const SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ED25519,
    SignatureScheme::RSA_PSS_SHA256,
];

pub(super) fn remote_certified(
    chain: &[String],
    link: Arc<Link>,
    scheme: SignatureScheme,
) -> Result<CertifiedKey, String> {
    let chain: Vec<rustls::pki_types::CertificateDer<'static>> = chain
        .iter()
        .map(|c| crate::base::crypto::b64_decode(c).map(rustls::pki_types::CertificateDer::from))
        .collect::<Option<_>>()
        .ok_or("privsep: a certificate in the init message is not base64")?;
    let leaf = chain.first().ok_or("privsep: no gateway certificate")?;
    let key = RemoteKey {
        link,
        leaf_sha256: crate::base::crypto::sha256(leaf),
        scheme,
    };
    Ok(CertifiedKey::new(chain, Arc::new(key)))
}

impl crate::proto::protocol::CallSink for Link {
    fn call(&self, msg: Vec<u8>) -> crate::proto::protocol::Pending<'_, Vec<u8>> {
        Box::pin(Link::call(self, msg))
    }
    fn remote(&self) -> bool {
        true
    }
}

impl crate::edge::EdgeCore for Link {
    fn ask(&self, a: crate::edge::Ask) -> crate::proto::protocol::Pending<'_, crate::edge::Answer> {
        Box::pin(async move {
            let what = a.name();
            let bytes = Link::ask(self, serde_json::to_vec(&a).expect("serializes")).await;
            serde_json::from_slice(&bytes).unwrap_or_else(|_| crate::edge::Answer::Unavailable {
                message: format!("the core did not answer ({what})"),
            })
        })
    }
    fn remote(&self) -> bool {
        true
    }
}
