//! The `x509pop` attestor: a node whose certificate expired while it was offline comes back by
//! proving the key of that certificate (SPIFFE's `x509pop` node attestor is the reference design;
//! the seed: "the machine re-joins with it within 7 days"). Off unless `[x509pop] enabled`.
//!
//! Two rounds, each one connection to the gateway:
//! 1. **Challenge** (`x509popChallenge`, no client certificate): the JoinService (never the
//!    gateway, the untrusted hop) answers 32 fresh random bytes; it keeps their SHA-256 for 60 s,
//!    to be answered once.
//! 2. **Join** (`join` with `attestor: "x509pop"`, no token): the certificate the machine last
//!    held, and its key's signature (purpose `bca x509pop v1`) over the challenge, the new CSR's
//!    SHA-256 and the node id, so a relaying hop can neither swap the CSR nor replay the answer.
//!    Stage 1 verifies the signature under the certificate's key and, when the certificate names
//!    a TPM AK, the new key's attestation (as at renewal). Stage 2 spends the challenge (before
//!    the join's savepoint: a refused join spends it too), then matches the certificate byte for
//!    byte to its `node_certs` row before anything it says counts, and applies the seed's rules
//!    (`domain::admission::x509pop_check`) and the pool's `joinAttestors`.
//!
//! The answer is a certificate for the same node, role and `urn:bc:` statements, of the same
//! identity generation: nothing of the node's row changes. The request's `role` and claims are
//! not read: who the machine is comes from the stored certificate alone.

use crate::base::crypto;
use crate::base::error::ApiResult;
use crate::domain::admission::{x509pop_check, Reason, X509PopCert, X509PopVerdict};
use crate::join::admit::{write, Admission, Record, Target};
use crate::join::issue::{
    check_key_attestation, evidence_field, refused, Decided, Ready, Signer, X509PopProof,
};
use crate::join::site::Site;
use crate::proto::protocol::{
    x509pop_message, Outcome, X509PopChallenge, X509PopEvidence, X509POP_PURPOSE,
};
use crate::store::Tx;
use serde_json::json;

/// How long a challenge may be answered.
pub const CHALLENGE_TTL: i64 = 60;
/// Challenges open at once, at most, and from one source: past either, the oldest is evicted,
/// so a flood never locks the attestor for everyone (a real machine answers within a second).
const MAX_OPEN_CHALLENGES: i64 = 10_000;
const MAX_CHALLENGES_PER_SOURCE: i64 = 16;

/// A challenge made (stage 1): its bytes and the caller's source.
pub(crate) struct PreparedChallenge {
    source: String,
    challenge: zeroize::Zeroizing<[u8; 32]>,
}

/// Stage 1 of a challenge: refused when the attestor is off.
pub(crate) fn prepare_challenge(
    enabled: bool,
    source: String,
) -> Result<PreparedChallenge, Reason> {
    if !enabled {
        return Err(Reason::X509PopDisabled);
    }
    let mut challenge = zeroize::Zeroizing::new([0u8; 32]);
    crypto::fill_random(challenge.as_mut());
    Ok(PreparedChallenge { source, challenge })
}

/// Stage 2 of a challenge: its hash recorded, its bytes answered.
pub(crate) fn challenge(tx: &Tx<'_>, p: &PreparedChallenge, now: i64) -> ApiResult<Outcome> {
    let id = crate::base::ids::new_id("x5pc", now * 1000);
    crate::store::x509pop::insert_challenge(
        tx,
        (&id, &p.source, &crypto::sha256(p.challenge.as_ref())),
        now + CHALLENGE_TTL,
        (MAX_CHALLENGES_PER_SOURCE, MAX_OPEN_CHALLENGES),
        now,
    )?;
    Ok(Outcome::X509PopChallenge {
        challenge: X509PopChallenge {
            challenge_id: id,
            challenge: crypto::b64(p.challenge.as_ref()),
            expires_in_seconds: CHALLENGE_TTL as u32,
        },
    })
}

/// Stage 1 of an `x509pop` join: the evidence well-formed, the signature checked under the
/// presented certificate's key, the new key's attestation checked against its statements.
/// Neither verdict names a node yet: stage 2 decides once the certificate is a stored row.
pub(crate) fn prepare_join(
    enabled: bool,
    ev: Option<&X509PopEvidence>,
    csr: &crate::proto::csr::VerifiedCsr,
) -> Result<X509PopProof, Reason> {
    if !enabled {
        return Err(Reason::X509PopDisabled);
    }
    let ev = ev.ok_or(Reason::X509PopMalformed)?;
    // Exactly the shape the appliance minted (`x5pc_` and 26 base32 characters): anything else
    // (a NUL byte, which PostgreSQL refuses outright) never reaches the store.
    if !crate::base::ids::is_id(&ev.challenge_id, "x5pc", 26) {
        return Err(Reason::X509PopMalformed);
    }
    let challenge = crypto::b64_decode(&ev.challenge)
        .filter(|c| c.len() == 32)
        .ok_or(Reason::X509PopMalformed)?;
    let leaf_der = evidence_field(&ev.certificate).ok_or(Reason::X509PopMalformed)?;
    let signature = evidence_field(&ev.signature).ok_or(Reason::X509PopMalformed)?;
    // Not a node certificate: not one of ours.
    let leaf = crate::proto::x509::parse_node_leaf(&leaf_der).ok_or(Reason::X509PopUnknown)?;
    let message = x509pop_message(&challenge, &csr.sha256, &leaf.node_id);
    let pop_ok = crypto::verify(&leaf.public_point, X509POP_PURPOSE, &message, &signature);
    let attestation = check_key_attestation(&leaf.statements, ev.key_attestation.as_ref(), csr);
    Ok(X509PopProof {
        challenge_id: ev.challenge_id.clone(),
        challenge_sha256: crypto::sha256(&challenge),
        leaf_der,
        leaf,
        pop_ok,
        attestation,
    })
}

/// Spends the challenge the join answers (it must be open and be the one signed). Runs before
/// the join's savepoint: a refused join spends it too.
pub(crate) fn spend_challenge(
    tx: &Tx<'_>,
    p: &X509PopProof,
    now: i64,
) -> ApiResult<Result<(), Reason>> {
    let Some((secret_sha256, expires_at)) =
        crate::store::x509pop::take_challenge(tx, &p.challenge_id)?
    else {
        return Ok(Err(Reason::X509PopChallenge));
    };
    Ok(
        if now < expires_at && crypto::ct_eq(&secret_sha256, &p.challenge_sha256) {
            Ok(())
        } else {
            Err(Reason::X509PopChallenge)
        },
    )
}

/// Stage 2 of an `x509pop` join, inside its savepoint (the challenge already spent): the
/// certificate is a stored row before its proof counts; the refusal's event goes to the node's
/// owner only once the caller proved the key of that node's current identity.
pub(crate) fn admit(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    p: &X509PopProof,
    now: i64,
) -> ApiResult<Decided> {
    let Some(row) = crate::store::nodes::leaf(tx, &p.leaf.serial_hex, &p.leaf_der)? else {
        return refused(Reason::X509PopUnknown, None);
    };
    if !p.pop_ok {
        return refused(Reason::X509PopPop, None);
    }
    let owner =
        (!row.revoked && row.generation == row.current_generation).then_some(row.tenant.as_str());
    let last = crate::store::nodes::newest_certs(tx, &row.node_id)?;
    let csr_spki = crypto::hex(&crypto::sha256(&crypto::p256_spki_from_point(
        &r.csr.public_point,
    )));
    // The last certificate answered a re-join from this one, for this same new key, and is live.
    let lost = match (last.first(), last.get(1)) {
        (Some(n), Some(prev)) if prev.serial == row.serial => {
            !n.revoked
                && n.not_after > now
                && n.generation == row.current_generation
                && n.spki_sha256 == csr_spki
        }
        _ => false,
    };
    let cert = X509PopCert {
        retired: row.state == "retired",
        generation: row.generation,
        current_generation: row.current_generation,
        revoked: row.revoked,
        not_after: row.not_after,
        newest: last.first().map(|c| c.serial.as_str()) == Some(row.serial.as_str()),
        node_has_live: crate::store::nodes::has_live_cert(tx, &row.node_id, now)?,
        lost_answer: lost,
    };
    let window = site.config.x509pop.max_expired_seconds as i64;
    let verdict = match x509pop_check(&cert, now, window) {
        Ok(v) => v,
        Err(reason) => return refused(reason, owner),
    };
    if p.attestation.is_err() {
        return refused(Reason::X509PopKeyAttestation, owner);
    }
    if verdict == X509PopVerdict::AnswerAgain {
        let n = &last[0];
        tracing::info!(node = %row.node_id, serial = %n.serial, "x509pop: a retry with the same new key; its certificate answered again");
        let response =
            crate::join::issue::answer(site, signer, &row.node_id, &n.role, &n.der, &r.csr);
        return Ok(Decided::Issued(response));
    }
    let pool = crate::store::tenancy::pool_by_id(tx, &row.pool_id)?;
    let Some(pool) = pool.filter(|p| p.archived_at.is_none()) else {
        return refused(Reason::Pool, owner);
    };
    if !pool.allows_attestor("x509pop") {
        return refused(Reason::PoolAttestor, owner);
    }
    let tpm_bound = p
        .leaf
        .statements
        .iter()
        .any(|s| s.starts_with("urn:bc:tpm-ak:"));
    write(
        tx,
        site,
        signer,
        r,
        Admission {
            attestor: "x509pop",
            actor: format!("x509pop:{}", row.serial),
            tenant_id: &row.tenant,
            site_id: &pool.site_id,
            pool: &pool,
            role: &row.role,
            target: Target::Same {
                node_id: row.node_id.clone(),
                generation: row.generation,
            },
            record: Record::default(),
            hardware_key_trusted: row.key_trusted,
            statements: p.leaf.statements.clone(),
            ttl: crate::join::issue::cert_ttl(&site.config, &row.role, &row.attestor),
            node_key: if tpm_bound { "tpm" } else { "unattested" },
            consumes: None,
            event: json!({"previousSerial": row.serial}),
        },
        now,
    )
}
