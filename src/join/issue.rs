//! The JoinService's kernel, shared by every attestor and by renewal: the signer (the only holder
//! of the join-signing and join-encryption keys), what stage 1 proved ([`Ready`], [`Proof`]),
//! what stage 2 decided ([`Decided`]), the refusal events' rate limit, and issuing: signing a
//! node certificate and recording it ([`certify`]), revoking a node's certificates, adopting it.

use crate::base::crypto::{self, SigningKey};
use crate::base::error::ApiResult;
use crate::domain::admission::Reason;
use crate::domain::token::Bearer;
use crate::join::site::Site;
use crate::pki;
use crate::pki::bundle::KeyBundle;
use crate::proto::claims::{Claims, HardwareKey, Identifiers};
use crate::proto::protocol::{JoinResponse, JoinResponseBody, JOIN_RESPONSE_PURPOSE};
use crate::proto::x509::ak_statement;
use crate::store::Tx;
use serde_json::json;
use std::collections::HashMap;

/// The largest public area, certificate, attestation or signature TPM evidence may carry.
const MAX_FIELD: usize = 4096;
/// Refusal events per attestor and reason per minute.
const EVENTS_PER_MINUTE: u32 = 60;

pub(crate) struct Signer {
    pub(crate) node_ca: (rcgen::Certificate, rcgen::KeyPair),
    pub(crate) node_ca_pem: String,
    /// The keys a rotation replaces while serving (`rotation`).
    pub(crate) keys: std::sync::RwLock<SignerKeys>,
}

/// The join-signing key and the join-encryption keys in use.
pub(crate) struct SignerKeys {
    join_signing: SigningKey,
    signer_b64: String,
    /// The staged next join-signing key's pin, told to renewing agents (signed by the current key).
    next_pin: Option<String>,
    /// Current first, then a staged next or a promoted-away previous key.
    decrypt: Vec<aws_lc_rs::agreement::PrivateKey>,
}

impl SignerKeys {
    pub(crate) fn new(pki: &crate::pki::PublicPki, keys: &KeyBundle) -> Result<Self, String> {
        let mut decrypt = vec![crate::proto::jwe::decryption_key(
            keys.join_encryption.pkcs8(),
        )?];
        for k in [&keys.join_encryption_next, &keys.join_encryption_previous]
            .into_iter()
            .flatten()
        {
            decrypt.push(crate::proto::jwe::decryption_key(k.pkcs8())?);
        }
        Ok(Self {
            join_signing: SigningKey::from_pkcs8(keys.join_signing.pkcs8())?,
            signer_b64: crypto::b64(&pki.join_signing),
            next_pin: pki.pins()?.join_signing_next,
            decrypt,
        })
    }
}

impl Signer {
    pub(crate) fn keys(&self) -> std::sync::RwLockReadGuard<'_, SignerKeys> {
        self.keys.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Swaps in the keys of a rotation step; answers in flight finish with the old ones.
    pub(crate) fn replace_keys(&self, k: SignerKeys) {
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = k;
    }

    /// Opens a sealed token with the current join-encryption key, else a staged or previous one.
    pub(crate) fn open_seal(
        &self,
        sealed: &str,
        csr_sha256: &[u8; 32],
        now: i64,
        max_skew: i64,
    ) -> Result<zeroize::Zeroizing<String>, crate::proto::jwe::SealError> {
        let keys = self.keys();
        let mut first = None;
        for k in &keys.decrypt {
            match crate::proto::jwe::open(sealed, k, csr_sha256, now, max_skew) {
                Ok(t) => return Ok(t),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        Err(first.expect("at least one key"))
    }

    /// Signs a response body: `JoinResponse{ body, sig, signer }`.
    pub(crate) fn respond(&self, body: &JoinResponseBody) -> JoinResponse {
        self.signed(JOIN_RESPONSE_PURPOSE, body)
    }

    /// A signature over `bytes` under `purpose` with the join-signing key, and that key's
    /// certificate (base64 DER).
    pub(crate) fn sign_bytes(&self, purpose: &str, bytes: &[u8]) -> (String, String) {
        let keys = self.keys();
        (
            crypto::b64(&keys.join_signing.sign(purpose, bytes)),
            keys.signer_b64.clone(),
        )
    }

    /// `{ body, sig, signer }`: the JSON of `body`, signed under `purpose`.
    pub(crate) fn signed(&self, purpose: &str, body: &impl serde::Serialize) -> JoinResponse {
        let body = serde_json::to_vec(body).expect("serializes");
        let keys = self.keys();
        let sig = keys.join_signing.sign(purpose, &body);
        JoinResponse {
            body: crypto::b64(&body),
            sig: crypto::b64(&sig),
            signer: keys.signer_b64.clone(),
        }
    }
}

/// What the machine proved in stage 1: a bearer token (`join-token`, `discovery`) or its TPM.
pub(crate) enum Proof {
    Bearer(Bearer),
    Tpm(Box<crate::join::issue::TpmProof>),
    /// An `x509pop` re-join: the expired certificate and what stage 1 found of its proof.
    X509Pop(Box<X509PopProof>),
}

pub(crate) struct Ready {
    pub(crate) proof: Proof,
    pub(crate) csr: crate::proto::csr::VerifiedCsr,
    pub(crate) claims: Claims,
    pub(crate) ids: Identifiers,
    pub(crate) key: Option<HardwareKey>,
    pub(crate) role: String,
    /// `join-token`, `discovery` or `tpm`.
    pub(crate) attestor: &'static str,
    /// The peer's IP address, recorded in join requests.
    pub(crate) peer_ip: String,
    /// The node the agent says it is (`--node-id`, for a `provisioned` token).
    pub(crate) node_id: Option<String>,
}

/// Per (attestor, reason): the minute, events written in it, and events suppressed since the last.
/// (The seed: 60 events per attestor and reason per minute. Renewals count as the attestor
/// `renew`; a `join:` reason met by two attestors has a budget for each.)
#[derive(Default)]
pub(crate) struct RateLimit {
    buckets: HashMap<(&'static str, &'static str), (i64, u32, u64)>,
}

impl RateLimit {
    /// `Some(suppressed)` when an event for (`attestor`, `reason`) may be written now.
    pub(crate) fn admit(
        &mut self,
        attestor: &'static str,
        reason: &'static str,
        now: i64,
    ) -> Option<u64> {
        let b = self
            .buckets
            .entry((attestor, reason))
            .or_insert((now / 60, 0, 0));
        if b.0 != now / 60 {
            b.0 = now / 60;
            b.1 = 0;
        }
        if b.1 >= EVENTS_PER_MINUTE {
            b.2 += 1;
            return None;
        }
        b.1 += 1;
        let s = b.2;
        b.2 = 0;
        Some(s)
    }
}

pub(crate) struct Refusal {
    pub(crate) reason: Reason,
    /// The tenant whose stream gets the event: the token's once its secret verified, else root.
    pub(crate) tenant: Option<String>,
}

pub(crate) enum Decided {
    Issued(JoinResponse),
    Refused(Refusal),
    /// Waiting for an operator: the request was recorded (kept), nothing issued, nothing spent.
    Deferred(JoinResponse),
}

pub(crate) fn refused(reason: Reason, tenant: Option<&str>) -> ApiResult<Decided> {
    Ok(Decided::Refused(Refusal {
        reason,
        tenant: tenant.map(str::to_string),
    }))
}

/// No acceptance checks yet: a node that just joined (`adopting`) is adopted at once, with its
/// `node.adopted` event (a node that was not `adopting` publishes nothing).
pub(crate) fn adopt(
    tx: &Tx<'_>,
    tenant: &str,
    node_id: &str,
    pool_id: &str,
    now: i64,
) -> ApiResult<()> {
    if !crate::store::nodes::mark_adopted(tx, node_id)? {
        return Ok(());
    }
    crate::store::events::publish(
        tx,
        now,
        tenant,
        "node.adopted",
        json!({"nodeId": node_id, "poolId": pool_id}),
    )
}

/// A node certificate's lifetime, at a join and at every renewal: `[pki] cert_ttl_seconds`; a
/// `ramdisk`'s `[discovery] cert_ttl_seconds` (at most 2 hours); a `tpm` node's
/// `[tpm_attestor] cert_ttl_seconds` when set (at most the `[pki]` one).
pub(crate) fn cert_ttl(cfg: &crate::config::Config, role: &str, attestor: &str) -> i64 {
    let pki_ttl = cfg.pki.cert_ttl_seconds as i64;
    if role == "ramdisk" {
        (cfg.discovery.cert_ttl_seconds as i64).min(7200)
    } else if attestor == "tpm" {
        cfg.tpm_attestor
            .cert_ttl_seconds
            .map_or(pki_ttl, |t| (t as i64).min(pki_ttl))
    } else {
        pki_ttl
    }
}

/// Who a certificate is for: decided by the JoinService, never taken from the CSR.
pub(crate) struct Subject<'a> {
    pub node_id: &'a str,
    pub generation: i64,
    pub role: &'a str,
    pub statements: &'a [String],
    pub ttl: i64,
}

/// Signs a node certificate for the CSR's key, records it in `node_certs`, and returns the signed
/// response and the certificate's serial.
pub(crate) fn certify(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    who: &Subject<'_>,
    csr: &crate::proto::csr::VerifiedCsr,
    now: i64,
) -> ApiResult<(JoinResponse, String)> {
    let cfg = &site.config;
    let spiffe = format!(
        "spiffe://{}/site/{}/node/{}",
        cfg.trust_domain, cfg.site_id, who.node_id
    );
    // Set back for clocks a little behind ours; the span stays the attestor's limit (at most 24
    // hours, 2 for a ramdisk), so the back-dating comes off the end.
    let not_before = now - pki::backdate(who.ttl);
    let not_after = not_before + who.ttl;
    let (der, serial) = pki::issue_node_cert(
        &pki::NodeCertSpec {
            spiffe_id: &spiffe,
            statements: who.statements,
            role: who.role,
            not_before,
            not_after,
            public_point: &csr.public_point,
        },
        &signer.node_ca,
    )
    .map_err(crate::base::error::ApiError::internal)?;
    let spki_hash = crypto::hex(&crypto::sha256(&crypto::p256_spki_from_point(
        &csr.public_point,
    )));
    crate::store::nodes::insert_cert(
        tx,
        &crate::store::nodes::NewCert {
            serial: &serial,
            node_id: who.node_id,
            generation: who.generation,
            role: who.role,
            spki_sha256: &spki_hash,
            der: &der,
            not_before,
            not_after,
        },
        now,
    )?;
    Ok((
        answer(site, signer, who.node_id, who.role, &der, csr),
        serial,
    ))
}

/// The signed answer carrying a node certificate (`der`) for the CSR.
pub(crate) fn answer(
    site: &Site,
    signer: &Signer,
    node_id: &str,
    role: &str,
    der: &[u8],
    csr: &crate::proto::csr::VerifiedCsr,
) -> JoinResponse {
    let cfg = &site.config;
    let body = JoinResponseBody {
        node_id: node_id.to_string(),
        certificate_chain: vec![
            crate::proto::x509::pem("CERTIFICATE", der),
            signer.node_ca_pem.clone(),
        ],
        command_signing_trust_bundle: vec![],
        csr_sha256: crypto::hex(&csr.sha256),
        trust_domain: cfg.trust_domain.clone(),
        site_id: cfg.site_id.clone(),
        role: role.to_string(),
        join_signing_next_key_pin: signer.keys().next_pin.clone(),
    };
    signer.respond(&body)
}

/// What an `x509pop` re-join presented and stage 1 checked. Nothing in it names a node until
/// stage 2 has matched the certificate to a stored `node_certs` row.
pub(crate) struct X509PopProof {
    pub(crate) challenge_id: String,
    pub(crate) challenge_sha256: [u8; 32],
    pub(crate) leaf_der: Vec<u8>,
    pub(crate) leaf: crate::proto::x509::NodeLeaf,
    /// The signature verifies under the certificate's key, over this challenge, CSR and node.
    pub(crate) pop_ok: bool,
    /// The key attestation's verdict (the certificate's `urn:bc:tpm-ak:` statement).
    pub(crate) attestation: Result<(), KeyAttestationFailure>,
}

/// What a `tpm` join proved in stage 1: the EK, the AK, and the challenge it answered.
pub(crate) struct TpmProof {
    pub(crate) challenge_id: String,
    pub(crate) secret_sha256: [u8; 32],
    /// Hex SHA-256 of the EK's DER SubjectPublicKeyInfo, as the allow-list names it.
    pub(crate) ek_sha256: String,
    pub(crate) ak_name: Vec<u8>,
    /// The machine asked not to be queued for an operator (the ramdisk, which then uses its
    /// discovery token).
    pub(crate) no_enrollment: bool,
}

impl TpmProof {
    /// The certificate's statement about the node key: the AK's Name digest.
    pub(crate) fn statement(&self) -> String {
        ak_statement(&self.ak_name)
    }
}

/// Why a new key is not proven to live in the TPM a certificate's statement names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeyAttestationFailure {
    /// The statement is there and the request carries no attestation.
    Missing,
    /// The attestation's AK is not the one the statement names, or not an AK bca accepts.
    Ak,
    /// The AK's certification does not verify, is not over the CSR's SHA-256, or certifies a key
    /// that could leave its TPM.
    Certify,
    /// The certified key is not the CSR's.
    Mismatch,
}

/// When a certificate names a TPM AK (`urn:bc:tpm-ak:`), a new key for it (a renewal's, an
/// `x509pop` re-join's) must be certified by that AK over the CSR's SHA-256, a key made in the
/// TPM that never leaves it. The statements come from the stored certificate, never from the
/// request, so they can be neither dropped nor downgraded.
pub(crate) fn check_key_attestation(
    statements: &[String],
    attestation: Option<&crate::proto::protocol::KeyAttestation>,
    csr: &crate::proto::csr::VerifiedCsr,
) -> Result<(), KeyAttestationFailure> {
    use KeyAttestationFailure as F;
    let Some(want_ak) = statements
        .iter()
        .find(|s| s.starts_with("urn:bc:tpm-ak:"))
        .map(|s| crate::proto::x509::statement_ak_name(s).ok_or(F::Ak))
    else {
        return Ok(());
    };
    let want_ak = want_ak?;
    let a = attestation.ok_or(F::Missing)?;
    let ak_public = evidence_field(&a.ak_public).ok_or(F::Ak)?;
    let ak = crate::tpm::public_key_of(&ak_public).map_err(|_| F::Ak)?;
    if ak.name != want_ak {
        return Err(F::Ak);
    }
    crate::tpm::parse_public(&ak_public)
        .and_then(|p| crate::tpm::attest::check_ak(&p))
        .map_err(|_| F::Ak)?;
    let field = |s: &str| evidence_field(s).ok_or(F::Certify);
    let certified = crate::tpm::attest::verify_certify(
        &ak_public,
        &field(&a.attest)?,
        &field(&a.signature)?,
        &csr.sha256,
        &field(&a.key_public)?,
    )
    .map_err(|e| {
        tracing::debug!(error = %e, "the key attestation fails");
        F::Certify
    })?;
    if certified.spki != crypto::p256_spki_from_point(&csr.public_point) {
        return Err(F::Mismatch);
    }
    Ok(())
}

/// One base64 field of TPM evidence (a join's or a renewal's): not empty, at most 4 KiB decoded.
pub(crate) fn evidence_field(s: &str) -> Option<Vec<u8>> {
    crypto::b64_decode(s).filter(|b| !b.is_empty() && b.len() <= MAX_FIELD)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_events_are_rate_limited_with_a_suppressed_count() {
        let mut rl = RateLimit::default();
        for _ in 0..60 {
            assert_eq!(
                rl.admit("join-token", Reason::Unknown.as_str(), 120),
                Some(0)
            );
        }
        assert_eq!(rl.admit("join-token", Reason::Unknown.as_str(), 121), None);
        assert_eq!(rl.admit("join-token", Reason::Unknown.as_str(), 122), None);
        // Another reason has its own budget, and so has the same reason under another attestor.
        assert_eq!(
            rl.admit("join-token", Reason::Expired.as_str(), 122),
            Some(0)
        );
        assert_eq!(
            rl.admit("discovery", Reason::Unknown.as_str(), 122),
            Some(0)
        );
        // The next minute: the first event carries what was dropped.
        assert_eq!(
            rl.admit("join-token", Reason::Unknown.as_str(), 180),
            Some(2)
        );
        assert_eq!(
            rl.admit("join-token", Reason::Unknown.as_str(), 181),
            Some(0)
        );
    }
}
