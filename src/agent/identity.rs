//! The node's identity on disk, as `bca agent run`, a renewal and an `x509pop` re-join read and
//! replace it: `identity.json` and the key it certifies (`node.key`).
//!
//! A new identity is written so that a crash at any point leaves a loadable one:
//! 1. the new key goes to `node.key.next` (atomically);
//! 2. `identity.json` is replaced atomically with the new chain;
//! 3. `node.key.next` is renamed over `node.key`.
//!
//! [`load_identity`] finishes step 3 when it finds an identity whose key is `node.key.next`.

use crate::agent::nodekey::NodeKey;
use crate::agent::{self, Identity};
use crate::base::crypto;
use crate::base::error::{ApiError, ApiResult};
use crate::proto::agent_config::AgentConfig;
use crate::proto::protocol::{JoinResponse, JoinResponseBody, KeyAttestation};
use std::path::Path;

/// A loaded identity: the record, its key, and the leaf's validity.
pub struct Loaded {
    pub identity: Identity,
    pub key: NodeKey,
    pub chain_der: Vec<Vec<u8>>,
    pub not_before: i64,
    pub not_after: i64,
}

/// The key in `p` when it is the one `want` (a SubjectPublicKeyInfo) names.
fn read_key(p: &Path, want: &[u8]) -> ApiResult<Option<NodeKey>> {
    Ok(NodeKey::load(p)?.filter(|k| k.spki_der() == want))
}

/// Loads `identity.json` and the key it certifies, completing an interrupted renewal.
pub fn load_identity(data_dir: &Path) -> ApiResult<Loaded> {
    let ip = data_dir.join("identity.json");
    let bytes = std::fs::read(&ip)
        .map_err(|_| ApiError::invalid_state("not joined: run bca agent join"))?;
    let identity: Identity = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::invalid_state(format!("{} does not load: {e}; join again as root: bca agent join --reset --yes, then bca agent join", ip.display())))?;
    let chain_der: Vec<Vec<u8>> = identity
        .certificate_chain
        .iter()
        .filter_map(|p| {
            crate::proto::x509::pem_decode_all(p, "CERTIFICATE")
                .into_iter()
                .next()
        })
        .collect();
    let leaf = chain_der.first().and_then(|d| crate::proto::x509::parse_node_leaf(d)).ok_or_else(|| {
        ApiError::invalid_state(format!("{} holds no node certificate; join again as root: bca agent join --reset --yes, then bca agent join", ip.display()))
    })?;
    let want = crypto::p256_spki_from_point(&leaf.public_point);
    let (kp, next) = (data_dir.join("node.key"), data_dir.join("node.key.next"));
    let key = match read_key(&kp, &want)? {
        Some(k) => k,
        None => {
            let k = read_key(&next, &want)?.ok_or_else(|| {
                ApiError::invalid_state("node.key does not match the identity's certificate; join again as root: bca agent join --reset --yes, then bca agent join")
            })?;
            std::fs::rename(&next, &kp)
                .map_err(|e| ApiError::invalid_state(format!("cannot finish the renewal: {e}")))?;
            k
        }
    };
    let not_before = {
        use x509_parser::prelude::*;
        X509Certificate::from_der(&chain_der[0])
            .map(|(_, c)| c.validity().not_before.timestamp())
            .unwrap_or(0)
    };
    Ok(Loaded {
        identity,
        key,
        chain_der,
        not_before,
        not_after: leaf.not_after,
    })
}

/// The next key, made where the current one lives (a TPM-held key's successor in that TPM).
pub fn next_key(cur: &Loaded) -> ApiResult<NodeKey> {
    match cur.key.tpm() {
        None => Ok(NodeKey::generate()),
        Some(k) => {
            let tcti: crate::tpm::Tcti = k.tcti().parse().map_err(ApiError::internal)?;
            NodeKey::generate_in(&tcti)
        }
    }
}

/// The proof that a TPM-held next `key` lives in the TPM whose AK the current certificate names
/// ([`attest_key`]), checked before anything is sent; none for a key in a file.
pub fn key_attestation(
    cur: &Loaded,
    key: &NodeKey,
    csr: &[u8],
) -> ApiResult<Option<KeyAttestation>> {
    match key.tpm() {
        Some(_) => attest_key(cur, key, csr).map(Some),
        None => Ok(None),
    }
}

/// Takes a signed answer carrying the next certificate for `key` (a renewal's, an `x509pop`
/// re-join's): checked as every answer is, for this node, then written as the identity
/// ([`write_renewed`]). Returns the body and the pins it teaches, if any (the caller keeps them).
pub fn install(
    cfg: &AgentConfig,
    data_dir: &Path,
    cur: &Loaded,
    (key, csr): (&NodeKey, &[u8]),
    resp: &JoinResponse,
    what: &str,
) -> ApiResult<(JoinResponseBody, Option<AgentConfig>)> {
    let body = agent::verify_response_for(cfg, resp, csr, &key.spki_der(), &cur.identity.role)?;
    if body.node_id != cur.identity.node_id {
        return Err(ApiError::access_denied(format!(
            "{what} names another node"
        )));
    }
    let learned = agent::pins_learned(cfg, resp, &body);
    write_renewed(
        data_dir,
        key,
        Identity {
            certificate_chain: body.certificate_chain.clone(),
            ..cur.identity.clone()
        },
    )?;
    Ok((body, learned))
}

/// The AK's `TPM2_Certify` of the new TPM-held `key` over the CSR's SHA-256, once the TPM
/// derives the AK the current certificate names: otherwise the renewal fails here, unsent.
pub fn attest_key(
    cur: &Loaded,
    key: &NodeKey,
    csr: &[u8],
) -> ApiResult<crate::proto::protocol::KeyAttestation> {
    let tpm_key = key
        .tpm()
        .ok_or_else(|| ApiError::internal("the next key is not held by the TPM"))?;
    let (ak, ak_public) = tpm_key.with_tpm(|t| t.ak_public())?;
    let named = crate::proto::x509::parse_node_leaf(&cur.chain_der[0]).and_then(|l| {
        l.statements
            .iter()
            .find_map(|s| crate::proto::x509::statement_ak_name(s))
    });
    match named {
        Some(n) if n == ak.name => {}
        Some(n) => {
            return Err(ApiError::invalid_state(format!(
                "the TPM derives another AK ({}) than the certificate names ({}); it was cleared or replaced: join again as root: bca agent join --reset --yes --attestor tpm",
                crypto::hex(&ak.name),
                crypto::hex(&n)
            )))
        }
        // A TPM-held key from before a statement: nothing to prove, nothing sent.
        None => {}
    }
    let c = tpm_key.with_tpm(|t| t.certify(tpm_key.blob(), &crypto::sha256(csr)))?;
    Ok(crate::proto::protocol::KeyAttestation {
        ak_public: crypto::b64(&ak_public),
        key_public: crypto::b64(&tpm_key.blob().public),
        attest: crypto::b64(&c.attest),
        signature: crypto::b64(&c.signature),
    })
}

/// Writes a new identity: the three steps of the module's doc, each atomic.
pub fn write_renewed(data_dir: &Path, key: &NodeKey, identity: Identity) -> ApiResult<()> {
    let next = data_dir.join("node.key.next");
    crate::base::fsutil::write_atomic(&next, &key.file_bytes(), 0o600)
        .map_err(ApiError::invalid_state)?;
    crate::base::fsutil::write_atomic(
        &data_dir.join("identity.json"),
        &serde_json::to_vec_pretty(&identity).expect("serializes"),
        0o600,
    )
    .map_err(ApiError::invalid_state)?;
    std::fs::rename(&next, data_dir.join("node.key"))
        .map_err(|e| ApiError::invalid_state(e.to_string()))
}
