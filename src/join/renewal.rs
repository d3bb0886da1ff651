//! Renewal: a node proves possession of its current key over its mTLS connection and gets a new
//! certificate of the same role, SPIFFE ID and statements.
//!
//! Stage 1 ([`prepare`], outside the transaction): the CSR, the presented leaf, the proof of
//! possession (`renew-pop` over the CSR's SHA-256, the node id and the client time), the mTLS
//! identity, the clock (±60 s) and the replay cache (120 s). Stage 2 ([`process`], in the writer's
//! transaction): the leaf is byte for byte a `node_certs` row, the node is not retired, the row is
//! of the node's current generation, unrevoked and unexpired. Every refusal answers the same
//! `ACCESS_DENIED` "Renew refused" and publishes `security.renew.refused`.

use crate::base::crypto;
use crate::base::error::ApiResult;
use crate::join::issue::RateLimit;
use crate::join::issue::Signer;
use crate::join::site::Site;
use crate::proto::csr::VerifiedCsr;
use crate::proto::protocol::{renew_pop_message, Outcome, RenewRequest, RENEW_POP_PURPOSE};
use crate::store::nodes::Leaf;
use crate::store::Tx;
use serde_json::json;
use std::collections::HashMap;

/// How far the agent's clock may be from the appliance's.
pub const MAX_CLOCK_SKEW: i64 = 60;
/// How long a proof is remembered: the same proof within this window is a replay.
pub const REPLAY_WINDOW: i64 = 120;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RenewReason {
    Malformed,
    Csr,
    Pop,
    Identity,
    Clock,
    Replay,
    UnknownCertificate,
    Retired,
    Generation,
    Revoked,
    Expired,
    /// The leaf names a TPM AK and the request carries no `key_attestation`.
    KeyAttestationMissing,
    /// The attestation's AK is not the one the leaf names, or not an AK bca accepts.
    KeyAttestationAk,
    /// The AK's certification does not verify, or is not over the CSR's SHA-256, or certifies a
    /// key that could leave its TPM.
    NodeKeyAttestation,
    /// The certified key is not the CSR's.
    NodeKeyMismatch,
}

impl RenewReason {
    pub fn as_str(self) -> &'static str {
        match self {
            RenewReason::Malformed => "renew:malformed",
            RenewReason::Csr => "renew:csr",
            RenewReason::Pop => "renew:pop",
            RenewReason::Identity => "renew:identity",
            RenewReason::Clock => "renew:clock",
            RenewReason::Replay => "renew:replay",
            RenewReason::UnknownCertificate => "renew:unknown-certificate",
            RenewReason::Retired => "renew:retired",
            RenewReason::Generation => "renew:generation",
            RenewReason::Revoked => "renew:revoked",
            RenewReason::Expired => "renew:expired",
            RenewReason::KeyAttestationMissing => "renew:key-attestation-missing",
            RenewReason::KeyAttestationAk => "renew:key-attestation-ak",
            RenewReason::NodeKeyAttestation => "renew:node-key-attestation",
            RenewReason::NodeKeyMismatch => "renew:node-key-mismatch",
        }
    }
}

/// Proofs seen in the last [`REPLAY_WINDOW`] seconds, keyed by the SHA-256 of what was signed (not
/// of the signature, which an attacker could re-encode).
#[derive(Default)]
pub struct ReplayCache {
    seen: HashMap<[u8; 32], i64>,
    /// The proofs in the order they were seen, to forget the oldest first: each is looked at once
    /// more when it leaves the window. (Before, past 1,024 proofs every renewal scanned them all:
    /// 1% of the appliance's core in a 10,000-renewal storm, and quadratic in its size.)
    order: std::collections::VecDeque<(i64, [u8; 32])>,
}

impl ReplayCache {
    /// True when the proof is fresh; it is then remembered.
    pub fn fresh(&mut self, key: [u8; 32], now: i64) -> bool {
        while let Some(&(t, k)) = self.order.front() {
            if now - t <= REPLAY_WINDOW {
                break;
            }
            self.order.pop_front();
            // Unless the same proof was seen again later (then that later entry stays).
            if self.seen.get(&k) == Some(&t) {
                self.seen.remove(&k);
            }
        }
        match self.seen.get(&key) {
            Some(t) if now - *t <= REPLAY_WINDOW => false,
            _ => {
                self.seen.insert(key, now);
                self.order.push_back((now, key));
                true
            }
        }
    }
}

pub struct Ready {
    leaf: crate::proto::x509::NodeLeaf,
    csr: VerifiedCsr,
    /// The SHA-256 of what the proof signed: checked again in stage 2 against the window every
    /// appliance of the site shares (`renewal_proofs`).
    proof_sha256: [u8; 32],
}

/// What stage 1 learnt. Nothing in it names a node until stage 2 has matched the presented leaf,
/// which is the connection's own certificate, to a stored `node_certs` row.
pub struct Prepared {
    /// The presented leaf (DER, serial), once it is byte for byte the connection's client
    /// certificate.
    leaf_der: Option<(Vec<u8>, String)>,
    /// Whether the proof of possession verifies under that leaf's key.
    pop_ok: bool,
    csr_sha256: Option<[u8; 32]>,
    result: Result<Ready, RenewReason>,
}

/// Stage 1. The checks run in the seed's order of trust: the presented leaf must be the
/// connection's certificate before anything in it is read; the proof is verified under its key;
/// only then the clock, the replay cache and the key attestation. Which node the caller is, and
/// so whose event stream a refusal goes to, is decided in stage 2 from the stored row alone.
pub fn prepare(r: &RenewRequest, peer_leaf: &[u8], now: i64, cache: &mut ReplayCache) -> Prepared {
    let mut p = Prepared {
        leaf_der: None,
        pop_ok: false,
        csr_sha256: None,
        result: Err(RenewReason::Malformed),
    };
    let csr = match crypto::b64_decode(&r.csr)
        .ok_or(())
        .and_then(|d| crate::proto::csr::verify(&d).map_err(|_| ()))
    {
        Ok(c) => c,
        Err(()) => {
            p.result = Err(RenewReason::Csr);
            return p;
        }
    };
    p.csr_sha256 = Some(csr.sha256);
    let Some(leaf_der) = r.chain.first().and_then(|pem| {
        crate::proto::x509::pem_decode_all(pem, "CERTIFICATE")
            .into_iter()
            .next()
    }) else {
        return p;
    };
    // The connection's certificate is the one renewed (a resumed connection's is not checked by
    // webpki again: `tickets`), and nothing the leaf says is read before it is that certificate.
    if peer_leaf != leaf_der.as_slice() {
        p.result = Err(RenewReason::Identity);
        return p;
    }
    let Some(leaf) = crate::proto::x509::parse_node_leaf(&leaf_der) else {
        return p;
    };
    p.leaf_der = Some((leaf_der, leaf.serial_hex.clone()));
    let message = renew_pop_message(&csr.sha256, &leaf.node_id, r.client_time);
    let sig = crypto::b64_decode(&r.pop_sig).unwrap_or_default();
    if !crypto::verify(&leaf.public_point, RENEW_POP_PURPOSE, &message, &sig) {
        p.result = Err(RenewReason::Pop);
        return p;
    }
    p.pop_ok = true;
    crate::base::metrics::get().skew(&leaf.node_id, r.client_time - now);
    if (r.client_time - now).abs() > MAX_CLOCK_SKEW {
        p.result = Err(RenewReason::Clock);
        return p;
    }
    let proof_sha256 = crypto::sha256(&message);
    if !cache.fresh(proof_sha256, now) {
        p.result = Err(RenewReason::Replay);
        return p;
    }
    if let Err(reason) = check_key_attestation(r, &leaf, &csr) {
        p.result = Err(reason);
        return p;
    }
    p.result = Ok(Ready {
        leaf,
        csr,
        proof_sha256,
    });
    p
}

/// The renewal's reasons for a failing key attestation.
fn check_key_attestation(
    r: &RenewRequest,
    leaf: &crate::proto::x509::NodeLeaf,
    csr: &VerifiedCsr,
) -> Result<(), RenewReason> {
    use crate::join::issue::KeyAttestationFailure as F;
    crate::join::issue::check_key_attestation(&leaf.statements, r.key_attestation.as_ref(), csr)
        .map_err(|f| match f {
            F::Missing => RenewReason::KeyAttestationMissing,
            F::Ak => RenewReason::KeyAttestationAk,
            F::Certify => RenewReason::NodeKeyAttestation,
            F::Mismatch => RenewReason::NodeKeyMismatch,
        })
}

/// Who a refused renewal's event is about: the node whose stored certificate was presented and
/// whose key signed the proof (`node`), and whether that was its current key, which routes the
/// event to the node's owner (`owner`); the root tenant's stream gets every other refusal.
#[derive(Default)]
struct Caller {
    node: Option<String>,
    owner: Option<String>,
}

/// Stage 2, inside the writer's transaction: the presented leaf (already the connection's
/// certificate) must be a stored `node_certs` row before the proof counts; then the node's and
/// the row's state, then what stage 1 found past the proof.
pub(crate) fn process(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    p: &Prepared,
    now: i64,
    limits: &mut RateLimit,
) -> ApiResult<Outcome> {
    let mut caller = Caller::default();
    let Some((leaf_der, leaf_serial)) = &p.leaf_der else {
        let reason = p
            .result
            .as_ref()
            .err()
            .copied()
            .unwrap_or(RenewReason::Malformed);
        return refuse(tx, site, p, &caller, reason, now, limits);
    };
    // The row and its node at once: a certificate of a node that no longer exists is unknown.
    let row = crate::store::nodes::leaf(tx, leaf_serial, leaf_der)?;
    let Some(Leaf {
        node_id,
        serial,
        generation,
        role,
        not_after,
        revoked,
        state,
        current_generation,
        attestor,
        tenant,
        ..
    }) = row
    else {
        return refuse(
            tx,
            site,
            p,
            &caller,
            RenewReason::UnknownCertificate,
            now,
            limits,
        );
    };
    if !p.pop_ok {
        return refuse(tx, site, p, &caller, RenewReason::Pop, now, limits);
    }
    caller.node = Some(node_id.clone());
    if !revoked && generation == current_generation {
        caller.owner = Some(tenant.clone());
    }
    let reason = if state == "retired" {
        Some(RenewReason::Retired)
    } else if generation != current_generation {
        Some(RenewReason::Generation)
    } else if revoked {
        Some(RenewReason::Revoked)
    } else if not_after <= now {
        Some(RenewReason::Expired)
    } else {
        None
    };
    if let Some(reason) = reason {
        return refuse(tx, site, p, &caller, reason, now, limits);
    }
    let r = match &p.result {
        Ok(r) => r,
        Err(reason) => return refuse(tx, site, p, &caller, *reason, now, limits),
    };
    // This appliance's cache saw the proof first; another appliance of the site may have too.
    if !crate::store::appliances::remember_proof(tx, &r.proof_sha256, now + REPLAY_WINDOW, now)? {
        return refuse(tx, site, p, &caller, RenewReason::Replay, now, limits);
    }
    let (response, new_serial) = crate::join::issue::certify(
        tx,
        site,
        signer,
        &crate::join::issue::Subject {
            node_id: &node_id,
            generation,
            role: &role,
            statements: &r.leaf.statements,
            ttl: crate::join::issue::cert_ttl(&site.config, &role, &attestor),
        },
        &r.csr,
        now,
    )?;
    crate::store::events::publish(
        tx,
        now,
        &tenant,
        "node.renewed",
        json!({"nodeId": node_id, "certificateSerial": new_serial, "previousSerial": serial}),
    )?;
    Ok(Outcome::Issued { response })
}

fn refuse(
    tx: &Tx<'_>,
    site: &Site,
    p: &Prepared,
    caller: &Caller,
    reason: RenewReason,
    now: i64,
    limits: &mut RateLimit,
) -> ApiResult<Outcome> {
    tracing::info!(reason = reason.as_str(), node = ?caller.node, "renewal refused");
    crate::base::metrics::get().refused(reason.as_str());
    if let Some(suppressed) = limits.admit("renew", reason.as_str(), now) {
        crate::store::events::publish(
            tx,
            now,
            caller.owner.as_deref().unwrap_or(&site.root_tenant),
            "security.renew.refused",
            json!({
                "reason": reason.as_str(),
                "nodeId": caller.node,
                "csrSha256": p.csr_sha256.map(|h| crypto::hex(&h)),
                "suppressed": suppressed,
            }),
        )?;
    }
    Ok(Outcome::Refused)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_is_fresh_once_per_window() {
        let mut c = ReplayCache::default();
        assert!(c.fresh([1; 32], 1000));
        assert!(!c.fresh([1; 32], 1100));
        assert!(c.fresh([2; 32], 1100));
        assert!(c.fresh([1; 32], 1121));
        // The second sighting of [1] is remembered in its own right.
        assert!(!c.fresh([1; 32], 1200));
    }

    #[test]
    fn a_clock_stepped_back_never_forgets_a_proof_early() {
        let mut c = ReplayCache::default();
        assert!(c.fresh([9; 32], 10_000));
        // An hour back: the proof is still remembered (and not evicted by a clock that went
        // backwards), so its replay is refused.
        assert!(!c.fresh([9; 32], 10_000 - 3_600));
        assert!(c.fresh([8; 32], 10_000 - 3_600));
        assert!(!c.fresh([9; 32], 10_000 - 3_500));
        // Forward past the window of the first sighting: it may be used again (its signed client
        // time is then far off the clock, which the renewal refuses on its own).
        assert!(c.fresh([9; 32], 10_000 + 121));
    }

    #[test]
    fn proofs_that_left_the_window_are_forgotten_and_others_kept() {
        let mut c = ReplayCache::default();
        for i in 0..5_000u32 {
            let mut k = [0u8; 32];
            k[..4].copy_from_slice(&i.to_be_bytes());
            assert!(c.fresh(k, 1000 + (i / 1000) as i64));
        }
        assert_eq!(c.seen.len(), 5_000);
        // At 1122 the proofs of 1000 and 1001 left the window; those of 1002-1004 are still refused.
        assert!(c.fresh([0xff; 32], 1122));
        assert_eq!(c.seen.len(), 3_001);
        assert_eq!(c.order.len(), 3_001);
        let mut k = [0u8; 32];
        k[..4].copy_from_slice(&2_500u32.to_be_bytes());
        assert!(!c.fresh(k, 1122), "a proof still in its window is a replay");
        k[..4].copy_from_slice(&500u32.to_be_bytes());
        assert!(
            c.fresh(k, 1122),
            "a proof that left its window is not remembered"
        );
    }
}
