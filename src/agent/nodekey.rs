//! The node's key as the agent holds it: a P-256 key of its own (`node.key` is the PKCS#8 PEM),
//! or a key made in the machine's TPM by a `tpm` join, of which `node.key` keeps only the record
//! (JSON: the TPM's address and the key's public and TPM-wrapped private parts, useless without
//! that TPM). Either signs the agent's proofs, CSRs and TLS handshakes.

use crate::base::crypto::{self, SigningKey};
use crate::base::error::{ApiError, ApiResult};
use crate::tpm::nodekey::TpmKey;
use crate::tpm::{KeyBlob, Tcti, Tpm};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use zeroize::Zeroizing;

pub enum NodeKey {
    Soft(SigningKey),
    Tpm(Arc<TpmKey>),
}

/// `node.key` for a TPM-held key.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TpmRecord {
    /// Always `tpm`.
    kind: String,
    /// The TPM, as `--tpm` names one.
    tpm: String,
    /// The key's `TPM2B_PUBLIC`, base64.
    public: String,
    /// The key's `TPM2B_PRIVATE` (wrapped by the TPM's storage key), base64.
    private: String,
}

impl NodeKey {
    pub fn generate() -> Self {
        NodeKey::Soft(SigningKey::generate())
    }

    /// A new key made in the TPM at `tcti`.
    pub fn generate_in(tcti: &Tcti) -> ApiResult<Self> {
        let mut tpm = Tpm::open(tcti)?;
        let blob = tpm.create_node_key()?;
        Ok(NodeKey::Tpm(Arc::new(
            TpmKey::new(tpm, blob).map_err(ApiError::internal)?,
        )))
    }

    /// The uncompressed public point.
    pub fn public_point(&self) -> Vec<u8> {
        match self {
            NodeKey::Soft(k) => k.public_point().to_vec(),
            NodeKey::Tpm(k) => k.public_point().to_vec(),
        }
    }

    pub fn spki_der(&self) -> Vec<u8> {
        crypto::p256_spki_from_point(&self.public_point())
    }

    /// An ECDSA signature (DER) over `purpose || 0 || message`, as [`SigningKey::sign`] makes.
    pub fn sign(&self, purpose: &str, message: &[u8]) -> ApiResult<Vec<u8>> {
        match self {
            NodeKey::Soft(k) => Ok(k.sign(purpose, message)),
            NodeKey::Tpm(k) => Ok(k.sign(&crypto::purposed(purpose, message))?),
        }
    }

    /// A PKCS#10 request for this key (no names: the JoinService decides them).
    pub fn csr(&self) -> ApiResult<Vec<u8>> {
        match self {
            NodeKey::Soft(k) => Ok(crate::proto::csr::create(k)),
            NodeKey::Tpm(k) => k.csr().map_err(ApiError::internal),
        }
    }

    /// The TPM-held key, when it is one.
    pub fn tpm(&self) -> Option<&Arc<TpmKey>> {
        match self {
            NodeKey::Tpm(k) => Some(k),
            NodeKey::Soft(_) => None,
        }
    }

    /// What `node.key` holds: the PKCS#8 PEM, or the TPM key's record.
    pub fn file_bytes(&self) -> Zeroizing<Vec<u8>> {
        match self {
            NodeKey::Soft(k) => {
                Zeroizing::new(crate::proto::x509::pem("PRIVATE KEY", k.pkcs8()).into_bytes())
            }
            NodeKey::Tpm(k) => {
                let blob = k.blob();
                let record = TpmRecord {
                    kind: "tpm".into(),
                    tpm: k.tcti(),
                    public: crypto::b64(&blob.public),
                    private: crypto::b64(&blob.private),
                };
                Zeroizing::new(serde_json::to_vec_pretty(&record).expect("serializes"))
            }
        }
    }

    /// Reads a key file: `Ok(None)` when it is missing or not a key; an error when it is a TPM
    /// key's record and that TPM cannot be opened (the node fails loudly rather than use
    /// another key).
    pub fn load(path: &Path) -> ApiResult<Option<Self>> {
        let Ok(text) = std::fs::read_to_string(path).map(Zeroizing::new) else {
            return Ok(None);
        };
        if text.trim_start().starts_with('{') {
            let Ok(r) = serde_json::from_str::<TpmRecord>(&text) else {
                return Ok(None);
            };
            let (Some(public), Some(private)) = (
                crypto::b64_decode(&r.public),
                crypto::b64_decode(&r.private),
            ) else {
                return Ok(None);
            };
            if r.kind != "tpm" {
                return Ok(None);
            }
            let tcti: Tcti = r.tpm.parse().map_err(|e: String| {
                ApiError::invalid_state(format!("{}: the TPM {:?}: {e}", path.display(), r.tpm))
            })?;
            // The TPM must answer now: a node whose TPM is gone fails here, loudly.
            Tpm::open(&tcti).map_err(|e| {
                ApiError::unavailable(format!(
                    "the node key is held by the TPM at {tcti}, which cannot be opened: {e}"
                ))
            })?;
            let key = TpmKey::at(tcti, KeyBlob { private, public })
                .map_err(|e| ApiError::invalid_state(format!("{}: {e}", path.display())))?;
            return Ok(Some(NodeKey::Tpm(Arc::new(key))));
        }
        let der = Zeroizing::new(
            match crate::proto::x509::pem_decode_all(&text, "PRIVATE KEY")
                .into_iter()
                .next()
            {
                Some(d) => d,
                None => return Ok(None),
            },
        );
        Ok(SigningKey::from_pkcs8(&der).ok().map(NodeKey::Soft))
    }

    /// The key as rustls signs a TLS 1.3 handshake with it.
    pub fn tls_key(&self) -> Result<Arc<dyn rustls::sign::SigningKey>, String> {
        match self {
            NodeKey::Soft(k) => crate::base::net::provider()
                .key_provider
                .load_private_key(rustls::pki_types::PrivateKeyDer::Pkcs8(
                    k.pkcs8().to_vec().into(),
                ))
                .map_err(|e| format!("the node key: {e}")),
            NodeKey::Tpm(k) => Ok(Arc::new(TlsTpmKey(k.clone()))),
        }
    }
}

/// A TPM-held key signing TLS 1.3 handshakes (`ecdsa_secp256r1_sha256` only).
#[derive(Debug)]
struct TlsTpmKey(Arc<TpmKey>);

impl rustls::sign::SigningKey for TlsTpmKey {
    fn choose_scheme(
        &self,
        offered: &[rustls::SignatureScheme],
    ) -> Option<Box<dyn rustls::sign::Signer>> {
        offered
            .contains(&rustls::SignatureScheme::ECDSA_NISTP256_SHA256)
            .then(|| Box::new(TlsTpmKey(self.0.clone())) as Box<dyn rustls::sign::Signer>)
    }

    fn algorithm(&self) -> rustls::SignatureAlgorithm {
        rustls::SignatureAlgorithm::ECDSA
    }
}

impl rustls::sign::Signer for TlsTpmKey {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        self.0
            .sign(message)
            .map_err(|e| rustls::Error::General(format!("the TPM: {e}")))
    }

    fn scheme(&self) -> rustls::SignatureScheme {
        rustls::SignatureScheme::ECDSA_NISTP256_SHA256
    }
}
