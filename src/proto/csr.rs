//! PKCS#10 requests: parsed with x509-parser, the signature verified with aws-lc-rs. Only the key
//! is taken from a CSR; names and extensions in it are ignored (they come from the JoinService).

use crate::base::crypto;

/// The largest CSR accepted, in DER bytes.
pub const MAX_CSR: usize = 4096;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedCsr {
    /// The uncompressed P-256 point the CSR's own signature proves possession of.
    pub public_point: Vec<u8>,
    pub sha256: [u8; 32],
}

/// Accepts only a DER ECDSA P-256 / SHA-256 request with no trailing bytes, signed by its key.
pub fn verify(der: &[u8]) -> Result<VerifiedCsr, String> {
    use x509_parser::prelude::*;
    if der.len() > MAX_CSR {
        return Err("the CSR is too large".into());
    }
    let (rest, csr) = X509CertificationRequest::from_der(der)
        .map_err(|e| format!("not a PKCS#10 request: {e}"))?;
    if !rest.is_empty() {
        return Err("trailing bytes after the CSR".into());
    }
    if csr.signature_algorithm.algorithm != x509_parser::oid_registry::OID_SIG_ECDSA_WITH_SHA256 {
        return Err("the CSR is not signed with ECDSA and SHA-256".into());
    }
    let info = &csr.certification_request_info;
    let point = crypto::p256_point_from_spki(info.subject_pki.raw)
        .ok_or("the CSR's key is not a P-256 key")?;
    let sig = &csr.signature_value.data;
    aws_lc_rs::signature::UnparsedPublicKey::new(
        &aws_lc_rs::signature::ECDSA_P256_SHA256_ASN1,
        point,
    )
    .verify(info.raw, sig)
    .map_err(|_| "the CSR's signature does not verify".to_string())?;
    Ok(VerifiedCsr {
        public_point: point.to_vec(),
        sha256: crypto::sha256(der),
    })
}

/// A CSR for `key`, with no names (the JoinService decides them).
pub fn create(key: &crypto::SigningKey) -> Vec<u8> {
    let mut p = rcgen::CertificateParams::default();
    p.distinguished_name = rcgen::DistinguishedName::new();
    p.serialize_request(&key.rcgen())
        .expect("a CSR serializes")
        .der()
        .to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_csr_verifies_and_a_tampered_one_does_not() {
        let k = crypto::SigningKey::generate();
        let der = create(&k);
        let v = verify(&der).unwrap();
        assert_eq!(v.public_point, k.public_point());
        let mut bad = der.clone();
        let n = bad.len();
        bad[n - 5] ^= 1;
        assert!(verify(&bad).is_err());
        let mut trailing = der.clone();
        trailing.push(0);
        assert!(verify(&trailing).is_err());
        assert!(verify(b"garbage").is_err());
    }
}
