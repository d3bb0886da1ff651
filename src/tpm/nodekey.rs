//! A node's key held by the TPM, as the agent uses it: it signs (`TPM2_Sign`, ECDSA P-256 with
//! SHA-256) the PKCS#10 request the join sends, and later whatever the node signs. The agent keeps
//! only the key's record ([`super::KeyBlob`]); the private key never leaves the TPM.

use super::{KeyBlob, PublicKey, Tcti, Tpm, TpmFailure};

/// A TPM-held P-256 key, loaded for each signature and flushed after it. The TPM is opened for
/// each use and closed after it: swtpm serves one connection at a time, and a node must still be
/// able to make its next key, or let `bca agent doctor` in, while it holds this one.
pub struct TpmKey {
    tcti: Tcti,
    blob: KeyBlob,
    point: Vec<u8>,
}

impl std::fmt::Debug for TpmKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpmKey")
            .field("point", &crate::base::crypto::hex(&self.point))
            .finish_non_exhaustive()
    }
}

impl TpmKey {
    /// The key `blob` on `tpm` (closed here; reopened for each use); its public point is read
    /// from the record.
    pub fn new(tpm: Tpm, blob: KeyBlob) -> Result<Self, String> {
        Self::at(tpm.tcti().clone(), blob)
    }

    /// The key `blob` on the TPM at `tcti`.
    pub fn at(tcti: Tcti, blob: KeyBlob) -> Result<Self, String> {
        let public = super::parse_public(&blob.public)?;
        let key = PublicKey::of(&public)?;
        let point = crate::base::crypto::p256_point_from_spki(&key.spki)
            .ok_or("the TPM key is not a P-256 key")?
            .to_vec();
        Ok(Self { tcti, blob, point })
    }

    /// The uncompressed public point.
    pub fn public_point(&self) -> &[u8] {
        &self.point
    }

    pub fn blob(&self) -> &KeyBlob {
        &self.blob
    }

    /// Runs `f` with the TPM that holds the key (to certify a key or derive the AK), opened for
    /// it and closed after.
    pub fn with_tpm<T>(
        &self,
        f: impl FnOnce(&mut Tpm) -> Result<T, TpmFailure>,
    ) -> Result<T, TpmFailure> {
        f(&mut Tpm::open(&self.tcti)?)
    }

    /// The TPM's address, as the key's record names it.
    pub fn tcti(&self) -> String {
        self.tcti.to_string()
    }

    /// An ECDSA P-256 signature (DER) over SHA-256 of `msg`, made by the TPM.
    pub fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, TpmFailure> {
        let digest = crate::base::crypto::sha256(msg);
        self.with_tpm(|t| t.sign(&self.blob, &digest))
    }

    /// A PKCS#10 request for this key with no names (the JoinService decides them), signed by
    /// the TPM.
    pub fn csr(self: &std::sync::Arc<Self>) -> Result<Vec<u8>, String> {
        let remote = rcgen::KeyPair::from_remote(Box::new(Remote(self.clone())))
            .map_err(|e| format!("the TPM key: {e}"))?;
        let mut p = rcgen::CertificateParams::default();
        p.distinguished_name = rcgen::DistinguishedName::new();
        p.serialize_request(&remote)
            .map(|c| c.der().to_vec())
            .map_err(|e| format!("a CSR signed by the TPM: {e}"))
    }
}

struct Remote(std::sync::Arc<TpmKey>);

impl rcgen::RemoteKeyPair for Remote {
    fn public_key(&self) -> &[u8] {
        &self.0.point
    }

    fn sign(&self, msg: &[u8]) -> Result<Vec<u8>, rcgen::Error> {
        self.0.sign(msg).map_err(|_| rcgen::Error::RemoteKeyError)
    }

    fn algorithm(&self) -> &'static rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}
