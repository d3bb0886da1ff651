//! The `tpm` attestor, the appliance's side: a machine joins with its TPM and no token.
//!
//! Two rounds, each one connection to the gateway:
//! 1. **Challenge** (`tpmChallenge`): the machine sends its EK's and bca's AK's public areas. The
//!    appliance checks the AK (fixedTPM, fixedParent, restricted, sign, P-256), computes its Name
//!    from the public area (never taking one from the machine), and answers a credential made in
//!    software (`TPM2_MakeCredential`) to that EK for that Name around 32 fresh random bytes. Only
//!    the TPM holding that EK, with that AK loaded, can activate it. The challenge row keeps the
//!    EK's hash, the AK's Name and the SHA-256 of the secret; it lives 60 s and is used once.
//! 2. **Join** (`join` with `attestor: "tpm"`, no token): the machine sends the activated secret,
//!    and the AK's `TPM2_Certify` of the node key, made in the TPM, over
//!    [`tpm_join_qualifying`](crate::proto::protocol::tpm_join_qualifying) (the secret bound to the CSR's
//!    SHA-256). Stage 1 checks the certification and that the certified key is the CSR's, a key
//!    made in the TPM that never leaves it; stage 2 spends the challenge (before the join's
//!    savepoint, so a refusal spends it too), then admits by the EK: on the allow-list
//!    (`tpm_eks`), into its pool; certified by the EK CA bundle, into `ek_ca_pool`; a known EK,
//!    into its node's pool; else, with `[tpm_attestor] enrollment` (the default), through a join
//!    request an operator decides, like a discovered machine (a bounded queue). A known EK
//!    reclaims its node.
//!    The certificate carries `urn:bc:tpm-ak:sha256:<hex>` (the AK's Name digest) after the SPIFFE
//!    ID, and the event and audit row say `nodeKey: tpm`.
//!
//! What this proves rests on the EK being a real TPM's: an allow-listed hash is the operator's
//! word that it is (read from the machine with `bca tpm status`), an approved request the
//! operator's decision, the EK CA bundle the manufacturers' word. An EK certificate the machine
//! sends counts only when it certifies its EK and a bundle CA issued it (`ekCertified`, shown
//! with a join request).

use crate::base::crypto;
use crate::base::error::ApiResult;
use crate::domain::admission::{owned_trust, tpm_pool, tpm_reclaims, Reason};
use crate::join::admit::{write, Admission, Record, Target};
use crate::join::issue::evidence_field;
use crate::join::issue::refused;
use crate::join::issue::Decided;
use crate::join::issue::Ready;
use crate::join::issue::Signer;
use crate::join::issue::TpmProof;
use crate::join::site::Site;
use crate::proto::protocol::{
    tpm_join_qualifying, Outcome, TpmChallenge, TpmChallengeRequest, TpmEvidence,
};
use crate::store::Tx;
use serde_json::json;

/// How long a challenge may be answered.
pub const CHALLENGE_TTL: i64 = 60;
/// Challenges open at once, at most, and from one source (an IPv4 address or an IPv6 /64): past
/// either, the oldest is evicted, so a flood never locks the attestor for everyone (a real
/// machine answers its challenge within a second).
const MAX_OPEN_CHALLENGES: i64 = 10_000;
const MAX_CHALLENGES_PER_SOURCE: i64 = 16;
/// Pending `tpm` join requests at most, in all and from one source: past either, an unknown EK is
/// refused (`tpm:enrollment-limit`) until an operator decides or they expire.
const MAX_PENDING_REQUESTS: usize = 1024;
const MAX_PENDING_PER_SOURCE: usize = 16;

/// What limits count by: an IPv4 address, or the /64 of an IPv6 one (one host holds a whole /64).
/// `peer` is `ip`, `ip:port` or `[ip]:port`.
pub(crate) fn source_key(peer: &str) -> String {
    let ip = peer
        .parse::<std::net::SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| peer.parse::<std::net::IpAddr>());
    match ip {
        Ok(ip) => crate::base::limits::source_label(ip),
        Err(_) => peer.to_string(),
    }
}

/// A checked challenge request, with its credential made (stage 1).
pub(crate) struct PreparedChallenge {
    /// The caller's [`source_key`], set by the caller.
    pub(crate) source: String,
    ek_sha256: String,
    /// The EK's certificate was issued by a CA of the EK CA bundle.
    ek_certified: bool,
    ak_name: Vec<u8>,
    secret_sha256: [u8; 32],
    credential: crate::tpm::credential::Credential,
}

fn field(s: &str) -> Result<Vec<u8>, Reason> {
    evidence_field(s).ok_or(Reason::TpmMalformed)
}

/// The EK's public key and its hash, from its marshaled public area.
fn ek_of(ek_public: &[u8]) -> Result<(crate::tpm::PublicKey, String), Reason> {
    let ek = crate::tpm::public_key_of(ek_public).map_err(|_| Reason::TpmMalformed)?;
    let hash = crypto::hex(&crypto::sha256(&ek.spki));
    Ok((ek, hash))
}

/// The AK's Name, once it is an AK bca accepts.
fn ak_of(ak_public: &[u8]) -> Result<Vec<u8>, Reason> {
    let ak = crate::tpm::parse_public(ak_public).map_err(|_| Reason::TpmMalformed)?;
    crate::tpm::attest::check_ak(&ak).map_err(|_| Reason::TpmAk)?;
    Ok(crate::tpm::public_key_of(ak_public)
        .map_err(|_| Reason::TpmAk)?
        .name)
}

/// Stage 1 of a challenge: the EK and AK checked, the credential made.
pub(crate) fn prepare_challenge(
    r: &TpmChallengeRequest,
    cas: &EkCas,
) -> Result<PreparedChallenge, Reason> {
    let ek_public = field(&r.ek_public)?;
    let ak_public = field(&r.ak_public)?;
    let (ek, ek_sha256) = ek_of(&ek_public)?;
    // A certificate counts only when it certifies this EK (an encoding bca does not rebuild
    // byte for byte, an NV header: it certifies nothing, and the join goes on without it).
    let ek_certified = match &r.ek_certificate {
        Some(cert) => {
            let der = field(cert)?;
            crate::proto::x509::cert_spki(&der).ok().as_deref() == Some(&ek.spki[..])
                && cas.certifies(&der)
        }
        None => false,
    };
    let ak_name = ak_of(&ak_public)?;
    let mut secret = zeroize::Zeroizing::new([0u8; 32]);
    crypto::fill_random(secret.as_mut());
    let credential = crate::tpm::make_credential(&ek_public, &ak_name, secret.as_ref())
        .map_err(|_| Reason::TpmMalformed)?;
    Ok(PreparedChallenge {
        source: String::new(),
        ek_sha256,
        ek_certified,
        ak_name,
        secret_sha256: crypto::sha256(secret.as_ref()),
        credential,
    })
}

/// Stage 2 of a challenge: recorded, answered.
pub(crate) fn challenge(tx: &Tx<'_>, p: &PreparedChallenge, now: i64) -> ApiResult<Outcome> {
    let id = crate::base::ids::new_id("tpmc", now * 1000);
    crate::store::tpm::insert_challenge(
        tx,
        &crate::store::tpm::NewChallenge {
            id: &id,
            source: &p.source,
            ek_sha256: &p.ek_sha256,
            ak_name_hex: &crypto::hex(&p.ak_name),
            secret_sha256: &p.secret_sha256,
            ek_certified: p.ek_certified,
            expires_at: now + CHALLENGE_TTL,
        },
        (MAX_CHALLENGES_PER_SOURCE, MAX_OPEN_CHALLENGES),
        now,
    )?;
    Ok(Outcome::Challenge {
        challenge: TpmChallenge {
            challenge_id: id,
            credential_blob: crypto::b64(&p.credential.id_object),
            encrypted_secret: crypto::b64(&p.credential.encrypted_secret),
            expires_in_seconds: CHALLENGE_TTL as u32,
        },
    })
}

/// Stage 1 of a `tpm` join: the evidence well-formed, the AK one bca accepts, its certification
/// of the CSR's key valid over the nonce bound to the CSR.
pub(crate) fn prepare_join(
    ev: Option<&TpmEvidence>,
    csr: &crate::proto::csr::VerifiedCsr,
) -> Result<TpmProof, Reason> {
    let ev = ev.ok_or(Reason::TpmMalformed)?;
    // Exactly the shape the appliance minted (`tpmc_` and 26 base32 characters): anything else
    // (a NUL byte, which PostgreSQL refuses outright) never reaches the store.
    if !crate::base::ids::is_id(&ev.challenge_id, "tpmc", 26) {
        return Err(Reason::TpmMalformed);
    }
    let nonce = zeroize::Zeroizing::new(field(&ev.credential)?);
    if nonce.len() != 32 {
        return Err(Reason::TpmChallenge);
    }
    let (_, ek_sha256) = ek_of(&field(&ev.ek_public)?)?;
    let ak_public = field(&ev.ak_public)?;
    let ak_name = ak_of(&ak_public)?;
    let certified = crate::tpm::attest::verify_certify(
        &ak_public,
        &field(&ev.attest)?,
        &field(&ev.signature)?,
        &tpm_join_qualifying(&nonce, &csr.sha256),
        &field(&ev.key_public)?,
    )
    .map_err(|e| {
        tracing::debug!(error = %e, "tpm join: the certification fails");
        Reason::TpmCertify
    })?;
    if certified.spki != crypto::p256_spki_from_point(&csr.public_point) {
        return Err(Reason::TpmCertify);
    }
    Ok(TpmProof {
        challenge_id: ev.challenge_id.clone(),
        secret_sha256: crypto::sha256(&nonce),
        ek_sha256,
        ak_name,
        no_enrollment: ev.no_enrollment,
    })
}

/// Spends the challenge the join answers: it must be open, for this EK and AK, and its secret
/// the one the machine activated. Runs before the join's savepoint: a refused join spends it too.
/// `Ok(true)` when the challenge found the EK certified by the EK CA bundle.
pub(crate) fn spend_challenge(
    tx: &Tx<'_>,
    p: &TpmProof,
    now: i64,
) -> ApiResult<Result<bool, Reason>> {
    // Spent means gone: a second answer finds nothing.
    let Some(c) = crate::store::tpm::take_challenge(tx, &p.challenge_id)? else {
        return Ok(Err(Reason::TpmChallenge));
    };
    let ok = now < c.expires_at
        && c.ek_sha256 == p.ek_sha256
        && c.ak_name_hex == crypto::hex(&p.ak_name)
        && crypto::ct_eq(&c.secret_sha256, &p.secret_sha256);
    Ok(if ok {
        Ok(c.ek_certified)
    } else {
        Err(Reason::TpmChallenge)
    })
}

/// Where an EK on no allow-list stands with the operator.
enum Enrollment {
    /// Approved into this pool for this CSR: the join goes ahead and consumes the request.
    Approved {
        pool_id: String,
        request_id: String,
    },
    Decided(Decided),
}

/// Stage 2 of a `tpm` join, inside its savepoint (the challenge already spent).
pub(crate) fn admit(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    p: &TpmProof,
    ek_certified: bool,
    now: i64,
) -> ApiResult<Decided> {
    let cfg = &site.config;
    if r.role != "node" && r.role != "ramdisk" {
        return refused(Reason::TpmRoleMismatch, None);
    }
    let allowed = crate::store::tpm::allowed_pool(tx, &p.ek_sha256)?;
    let known = crate::store::nodes::by_ek(tx, &p.ek_sha256)?;
    // A machine whose node was retired is cut off from the bundle's blanket trust: its EK goes
    // to an operator (an allow-list entry, the operator's own word, still admits it; deleting
    // the retired node lifts the block).
    let retired = known.is_none() && crate::store::nodes::ek_retired(tx, &p.ek_sha256)?;
    // The allow-list first, then the EK CA bundle's pool, then the node this EK already is
    // (admitted once, by whichever way: retire it to cut the machine off), then an operator.
    let ca_pool = cfg
        .tpm_attestor
        .ek_ca_pool
        .clone()
        .filter(|_| ek_certified && !retired);
    let chosen = tpm_pool(allowed, ca_pool, known.as_ref().map(|k| k.pool_id.as_str()));
    let (pool_id, request, admitted_by) = match chosen {
        Some((pool, by)) => (pool, None, by),
        None => match enroll(tx, site, signer, r, p, ek_certified, now)? {
            Enrollment::Approved {
                pool_id,
                request_id,
            } => (pool_id, Some(request_id), "join-request"),
            Enrollment::Decided(d) => return Ok(d),
        },
    };
    // The allow-list has no foreign key: the pool is checked again here.
    let Some(pool) = crate::store::tenancy::pool_by_id(tx, &pool_id)?
        .filter(|p| p.archived_at.is_none() && p.agent == "bcd")
    else {
        return refused(Reason::Pool, None);
    };
    let tenant = Some(pool.tenant_id.as_str());
    if pool.site_id != cfg.site_id {
        return refused(Reason::Site, tenant);
    }
    if !pool.allows_attestor("tpm") {
        return refused(Reason::PoolAttestor, tenant);
    }
    let trusted = r.key.as_ref().filter(|k| k.trusted).map(|k| k.hex.clone());
    let target = match known {
        Some(k) => {
            let known = (k.tenant_id.as_str(), k.pool_id.as_str(), k.role.as_str());
            if !tpm_reclaims(known, (&pool.tenant_id, &pool.id), &r.role) {
                return refused(Reason::Reclaim, tenant);
            }
            Target::Again {
                node_id: k.id,
                generation: k.generation + 1,
                trust: None,
            }
        }
        None => {
            // A machine whose hardware key is already another node's joins as that node only by
            // a token reclaim; here it is refused rather than given a second identity.
            if let Some(h) = &trusted {
                let taken = crate::store::nodes::trusted_key_taken(tx, h)?;
                if taken {
                    return refused(Reason::Reclaim, tenant);
                }
            }
            Target::New {
                trust: owned_trust(&pool.tenant_id, &site.root_tenant),
            }
        }
    };
    let new = matches!(target, Target::New { .. });
    let admission = Admission {
        attestor: "tpm",
        actor: format!("tpm:{}", p.ek_sha256),
        tenant_id: &pool.tenant_id,
        site_id: &cfg.site_id,
        pool: &pool,
        role: &r.role,
        target,
        record: Record {
            claims: true,
            identifiers_by: Some("tpm"),
            tpm_ek_sha256: new.then(|| p.ek_sha256.clone()),
            ..Default::default()
        },
        // The EK is the machine's key: the claims' hardware key is recorded, never trusted (no
        // token reclaim or discovery shortcut reaches this node by it).
        hardware_key_trusted: false,
        statements: vec![p.statement()],
        ttl: crate::join::issue::cert_ttl(cfg, &r.role, "tpm"),
        node_key: "tpm",
        consumes: request.as_deref(),
        event: json!({
            "ekSha256": p.ek_sha256,
            "akName": crypto::hex(&p.ak_name),
            "ekCertified": ek_certified,
            "admittedBy": admitted_by,
            "joinRequestId": request,
        }),
    };
    write(tx, site, signer, r, admission, now)
}

/// An EK on no allow-list: a join request keyed by the EK's hash, decided by an operator.
fn enroll(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    p: &TpmProof,
    ek_certified: bool,
    now: i64,
) -> ApiResult<Enrollment> {
    let cfg = &site.config;
    if !cfg.tpm_attestor.enrollment || p.no_enrollment {
        return refused(Reason::TpmEkUnknown, None).map(Enrollment::Decided);
    }
    crate::join::requests::expire(tx, now)?;
    let machine_key = format!("ek:{}", p.ek_sha256);
    let csr_hex = crypto::hex(&r.csr.sha256);
    if crate::join::requests::rejected(tx, &machine_key, &csr_hex)? {
        return refused(Reason::TpmRejected, None).map(Enrollment::Decided);
    }
    let current = crate::join::requests::open_request(tx, &machine_key)?;
    let claims_json = serde_json::to_string(&r.claims).expect("serializes");
    let pending_until = now + cfg.discovery.pending_ttl_seconds as i64;
    let trusted = r.key.as_ref().is_some_and(|k| k.trusted);
    let seen = crate::store::requests::Seen {
        csr_sha256: &csr_hex,
        claims_json: &claims_json,
        ip: &r.peer_ip,
        expires_at: pending_until,
    };
    let id = match current {
        Some((id, state, Some(pool_id), csr)) if state == "approved" && csr == csr_hex => {
            return Ok(Enrollment::Approved {
                pool_id,
                request_id: id,
            });
        }
        Some((id, _, _, _)) => {
            crate::store::requests::refresh_tpm(tx, &id, &seen, ek_certified, now)?;
            id
        }
        None => {
            // Unknown EKs cost an operator's attention: a bounded queue, in all and per source.
            let pending: Vec<String> = crate::store::requests::pending_tpm_ips(tx)?
                .into_iter()
                .map(|ip| ip.map(|ip| source_key(&ip)).unwrap_or_default())
                .collect();
            let mine = source_key(&r.peer_ip);
            if pending.len() >= MAX_PENDING_REQUESTS
                || pending.iter().filter(|s| **s == mine).count() >= MAX_PENDING_PER_SOURCE
            {
                return refused(Reason::TpmEnrollmentLimit, None).map(Enrollment::Decided);
            }
            let id = crate::base::ids::new_id("jreq", now * 1000);
            let hardware_key = r.key.as_ref().map(|k| k.hex.as_str());
            let vouched_by = format!("tpm-ek:{}", p.ek_sha256);
            crate::store::requests::insert(
                tx,
                &crate::store::requests::New {
                    id: &id,
                    site_id: &cfg.site_id,
                    attestor: "tpm",
                    machine_key: &machine_key,
                    hardware_key,
                    hardware_key_trusted: trusted,
                    seen,
                    vouched_by: &vouched_by,
                    mac: None,
                    boot_lease_epoch: None,
                    token_id: None,
                    ek_certified: Some(ek_certified),
                },
                now,
            )?;
            crate::store::events::publish(
                tx,
                now,
                &site.root_tenant,
                "join-request.created",
                json!({"requestId": id, "attestor": "tpm", "ekSha256": p.ek_sha256}),
            )?;
            id
        }
    };
    Ok(Enrollment::Decided(Decided::Deferred(
        crate::join::requests::deferral(site, signer, &id, &r.csr.sha256),
    )))
}

/// The EK CA bundle (`[tpm_attestor] ek_ca_bundle`): the certificates trusted to issue EK
/// certificates, the TPM manufacturers' issuing CAs (and their roots, which changes nothing:
/// every certificate in the bundle is an anchor). An EK certificate whose signature one of them
/// verifies, issued by its subject, certifies its EK; the EK certificate's own validity dates are
/// not checked (TPMs keep their EK certificates for life, and many carry dates long past).
#[derive(Default)]
pub struct EkCas {
    cas: Vec<EkCa>,
}

struct EkCa {
    subject: Vec<u8>,
    key: CaKey,
}

enum CaKey {
    /// The `RSAPublicKey` DER.
    Rsa(Vec<u8>),
    /// The curve's OID and the uncompressed point.
    Ec(String, Vec<u8>),
}

const OID_RSA: &str = "1.2.840.113549.1.1.1";
const OID_EC: &str = "1.2.840.10045.2.1";
const OID_P256: &str = "1.2.840.10045.3.1.7";
const OID_P384: &str = "1.3.132.0.34";

impl EkCas {
    /// Reads a PEM bundle; every certificate must be a CA with an RSA, P-256 or P-384 key.
    pub fn load(path: &std::path::Path) -> Result<Self, String> {
        use x509_parser::prelude::*;
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("the EK CA bundle {}: {e}", path.display()))?;
        let ders = crate::proto::x509::pem_decode_all(&text, "CERTIFICATE");
        if ders.is_empty() {
            return Err(format!(
                "the EK CA bundle {} holds no PEM certificate",
                path.display()
            ));
        }
        let mut cas = Vec::new();
        for (i, der) in ders.iter().enumerate() {
            let bad = |m: &str| {
                format!(
                    "the EK CA bundle {}: certificate {}: {m}",
                    path.display(),
                    i + 1
                )
            };
            let (_, c) = X509Certificate::from_der(der).map_err(|_| bad("not X.509"))?;
            let is_ca = c
                .basic_constraints()
                .ok()
                .flatten()
                .is_some_and(|b| b.value.ca);
            if !is_ca {
                return Err(bad("not a CA (basicConstraints CA:TRUE)"));
            }
            let spki = c.public_key();
            let key = match spki.algorithm.algorithm.to_id_string().as_str() {
                OID_RSA => CaKey::Rsa(spki.subject_public_key.data.to_vec()),
                OID_EC => {
                    let curve = spki
                        .algorithm
                        .parameters
                        .as_ref()
                        .and_then(|p| p.as_oid().ok())
                        .map(|o| o.to_id_string())
                        .unwrap_or_default();
                    if curve != OID_P256 && curve != OID_P384 {
                        return Err(bad("an EC key on a curve other than P-256 or P-384"));
                    }
                    CaKey::Ec(curve, spki.subject_public_key.data.to_vec())
                }
                _ => return Err(bad("a key that is neither RSA nor EC")),
            };
            cas.push(EkCa {
                subject: c.subject().as_raw().to_vec(),
                key,
            });
        }
        Ok(Self { cas })
    }

    pub fn is_empty(&self) -> bool {
        self.cas.is_empty()
    }

    /// Whether a CA of the bundle issued `ek_cert` (DER): its issuer is the CA's subject and the
    /// CA's key verifies its signature (RSA PKCS#1 v1.5 or ECDSA, with SHA-256/384/512; SHA-1
    /// is refused).
    pub fn certifies(&self, ek_cert: &[u8]) -> bool {
        use aws_lc_rs::signature as sig;
        use x509_parser::prelude::*;
        let Ok((_, c)) = X509Certificate::from_der(ek_cert) else {
            return false;
        };
        // An EK certificate certifies a TPM's key, never another CA.
        if c.basic_constraints()
            .ok()
            .flatten()
            .is_some_and(|b| b.value.ca)
        {
            return false;
        }
        let alg = c.signature_algorithm.algorithm.to_id_string();
        let tbs: &[u8] = c.tbs_certificate.as_ref();
        let signature = &c.signature_value.data;
        self.cas
            .iter()
            .filter(|ca| ca.subject == c.issuer().as_raw())
            .any(|ca| {
                let algorithm: &dyn sig::VerificationAlgorithm = match (&ca.key, alg.as_str()) {
                    (CaKey::Rsa(_), "1.2.840.113549.1.1.11") => &sig::RSA_PKCS1_2048_8192_SHA256,
                    (CaKey::Rsa(_), "1.2.840.113549.1.1.12") => &sig::RSA_PKCS1_2048_8192_SHA384,
                    (CaKey::Rsa(_), "1.2.840.113549.1.1.13") => &sig::RSA_PKCS1_2048_8192_SHA512,
                    (CaKey::Ec(curve, _), "1.2.840.10045.4.3.2") if curve == OID_P256 => {
                        &sig::ECDSA_P256_SHA256_ASN1
                    }
                    (CaKey::Ec(curve, _), "1.2.840.10045.4.3.3") if curve == OID_P256 => {
                        &sig::ECDSA_P256_SHA384_ASN1
                    }
                    (CaKey::Ec(curve, _), "1.2.840.10045.4.3.2") if curve == OID_P384 => {
                        &sig::ECDSA_P384_SHA256_ASN1
                    }
                    (CaKey::Ec(curve, _), "1.2.840.10045.4.3.3") if curve == OID_P384 => {
                        &sig::ECDSA_P384_SHA384_ASN1
                    }
                    _ => return false,
                };
                let key = match &ca.key {
                    CaKey::Rsa(k) | CaKey::Ec(_, k) => k,
                };
                sig::UnparsedPublicKey::new(algorithm, key)
                    .verify(tbs, signature)
                    .is_ok()
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca(cn: &str) -> (rcgen::Certificate, rcgen::KeyPair) {
        let key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.distinguished_name.push(rcgen::DnType::CommonName, cn);
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        (p.self_signed(&key).unwrap(), key)
    }

    fn bundle(certs: &[&rcgen::Certificate]) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let pem: String = certs.iter().map(|c| c.pem()).collect();
        std::fs::write(f.path(), pem).unwrap();
        f
    }

    #[test]
    fn the_bundle_certifies_what_its_cas_signed_and_nothing_that_only_copies_their_names() {
        let (real, real_key) = ca("TPM Manufacturer EK CA");
        let (forged, forged_key) = ca("TPM Manufacturer EK CA");
        let ek_key = rcgen::KeyPair::generate().unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        let issued = p.clone().signed_by(&ek_key, &real, &real_key).unwrap();
        let copied = p.signed_by(&ek_key, &forged, &forged_key).unwrap();

        let f = bundle(&[&real]);
        let cas = EkCas::load(f.path()).unwrap();
        assert!(cas.certifies(issued.der()));
        assert!(
            !cas.certifies(copied.der()),
            "same issuer name, another key"
        );
        assert!(!cas.certifies(b"not a certificate"));
        // The CA itself is no EK certificate it issued.
        assert!(!EkCas::load(bundle(&[&forged]).path())
            .unwrap()
            .certifies(issued.der()));

        // A leaf in the bundle is refused at load, by name.
        let e = match EkCas::load(bundle(&[&real, &issued]).path()) {
            Err(e) => e,
            Ok(_) => panic!("a leaf was taken as a CA"),
        };
        assert!(e.contains("certificate 2: not a CA"), "{e}");
    }
}
