//! Coming back after the certificate expired while the machine was offline: the `x509pop`
//! attestor. The agent asks the appliance for a challenge, makes a new key (in the TPM when the
//! old one was there, attested by the AK the certificate names, as at renewal), and signs with
//! the key of its expired certificate the challenge, the new CSR's SHA-256 and its node id. The
//! answer is a certificate for the same node and role; it is written as a renewal is
//! (`identity::install`), so a crash at any point leaves a loadable identity. The new key is
//! kept in `node.key.x509pop` from before the request until the new identity is written, so a
//! lost answer is retried with the same key (the appliance answers it again).
//!
//! `bca agent join --attestor x509pop` does it by hand; `bca agent run` does it by itself when
//! it finds its certificate expired.

use crate::agent;
use crate::agent::identity::{self, Loaded};
use crate::agent::nodekey::NodeKey;
use crate::base::crypto;
use crate::base::error::{ApiError, ApiResult};
use crate::proto::agent_config::AgentConfig;
use crate::proto::protocol::{
    x509pop_message, Empty, JoinRequest, Request, X509PopEvidence, X509POP_PURPOSE,
};
use std::path::Path;

/// How long after its expiry a certificate may still bring its node back (the seed's 7 days; an
/// appliance may allow less, `[x509pop] max_expired_seconds`).
pub const MAX_EXPIRED: i64 = 7 * 86_400;

/// Re-joins with the expired identity in `data_dir`; returns the node id. Pins the answer
/// teaches are saved as a renewal's are.
pub fn rejoin(cfg: &AgentConfig, data_dir: &Path) -> ApiResult<String> {
    let cur = identity::load_identity(data_dir)?;
    let now = crate::base::clock::now();
    if cur.not_after > now {
        return Err(ApiError::invalid_state(format!(
            "the certificate is valid until {}: it renews (bca agent run); x509pop is for one that expired",
            crate::base::clock::rfc3339(cur.not_after)
        )));
    }
    // The next key is made where the current one lives, and a TPM-held one is attested before
    // anything is sent. It is kept (`node.key.x509pop`) before it is sent: when the answer is
    // lost, the retry presents the same key and the appliance answers the certificate it issued
    // for it again, instead of refusing a second re-join (`not-newest`) for good.
    let pending = data_dir.join("node.key.x509pop");
    let key = match NodeKey::load(&pending)? {
        Some(k) => k,
        None => {
            let k = identity::next_key(&cur)?;
            crate::base::fsutil::write_atomic(&pending, &k.file_bytes(), 0o600)
                .map_err(ApiError::invalid_state)?;
            k
        }
    };
    let csr = key.csr()?;
    let key_attestation = identity::key_attestation(&cur, &key, &csr)?;
    let ask = Request {
        v: 1,
        x509pop_challenge: Some(Empty {}),
        ..Default::default()
    };
    let reply = agent::exchange(cfg, &serde_json::to_vec(&ask).expect("serializes"))?;
    if let Some(e) = reply.error {
        return Err(agent::wire_error(e));
    }
    let ch = reply
        .x509pop_challenge
        .ok_or_else(|| ApiError::internal("the gateway's answer carries no challenge"))?;
    let challenge = crypto::b64_decode(&ch.challenge)
        .filter(|c| c.len() == 32)
        .ok_or_else(|| ApiError::internal("the appliance's challenge is malformed"))?;
    let msg = x509pop_message(&challenge, &crypto::sha256(&csr), &cur.identity.node_id);
    let request = Request {
        v: 1,
        join: Some(JoinRequest {
            sealed_token: String::new(),
            csr: crypto::b64(&csr),
            claims: Default::default(),
            attestor: "x509pop".into(),
            role: cur.identity.role.clone(),
            tpm: None,
            x509pop: Some(X509PopEvidence {
                challenge_id: ch.challenge_id,
                challenge: ch.challenge,
                certificate: crypto::b64(&cur.chain_der[0]),
                signature: crypto::b64(&cur.key.sign(X509POP_PURPOSE, &msg)?),
                key_attestation,
            }),
            node_id: None,
        }),
        ..Default::default()
    };
    let reply = agent::exchange(cfg, &serde_json::to_vec(&request).expect("serializes"))?;
    if let Some(e) = reply.error {
        return Err(agent::wire_error(e));
    }
    let resp = reply
        .join_response
        .ok_or_else(|| ApiError::internal("the gateway's answer carries no response"))?;
    let (body, learned) =
        identity::install(cfg, data_dir, &cur, (&key, &csr), &resp, "the answer")?;
    if let Some(learned) = learned {
        agent::save_learned(data_dir, &learned)?;
    }
    // The key is `node.key` now.
    let _ = std::fs::remove_file(&pending);
    Ok(body.node_id)
}

/// What `doctor` and `run` say of an expired certificate: whether `x509pop` can still bring it
/// back, and the way back otherwise.
pub fn expired_advice(cur: &Loaded, now: i64) -> String {
    let at = crate::base::clock::rfc3339(cur.not_after);
    if now - cur.not_after <= MAX_EXPIRED {
        format!(
            "the certificate expired at {at} (until {}, bca agent run re-joins by itself where the appliance runs x509pop; by hand: bca agent join --attestor x509pop); join again as root: bca agent join --reset --yes, then bca agent join",
            crate::base::clock::rfc3339(cur.not_after + MAX_EXPIRED)
        )
    } else {
        format!(
            "the certificate expired at {at}, more than 7 days ago (too long for x509pop); join again as root: bca agent join --reset --yes, then bca agent join"
        )
    }
}
