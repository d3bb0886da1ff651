//! Checking a `TPM2_Certify` in software (the appliance's side): an AK vouches that a key was
//! made in its TPM and cannot leave it.
//!
//! The AK's public area must be bca's kind of AK (fixedTPM, fixedParent, restricted, a signing
//! key on NIST P-256); its signature over the attestation must verify; the attestation must be a
//! `TPM_ST_ATTEST_CERTIFY` made by the TPM (`TPM_GENERATED`), carry the expected qualifying data
//! (the appliance's nonce), and name the key whose public area is given, computed here from that
//! area; and the key must have been made in the TPM and be fixed to it (fixedTPM, fixedParent,
//! sensitiveDataOrigin), an unrestricted signing key on P-256. What passes is the key's
//! SubjectPublicKeyInfo, for the caller to compare with the CSR's.

use super::{der, der_uint, parse_public, PublicKey};
use tpm2_protocol::data::{
    TpmAlgId, TpmEccCurve, TpmSt, TpmaObject, TpmsAttest, TpmtPublic, TpmtSignature, TpmuAttest,
    TpmuPublicParms, TpmuSignature,
};
use tpm2_protocol::TpmUnmarshal;

/// What a certification proved: the certified key's Name and SubjectPublicKeyInfo.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Certified {
    pub name: Vec<u8>,
    pub spki: Vec<u8>,
}

fn p256(p: &TpmtPublic) -> bool {
    matches!(&p.parameters, TpmuPublicParms::Ecc(e) if e.curve_id == TpmEccCurve::NistP256)
}

/// Every attribute of `need` set, else an error naming the first missing one.
fn require(a: TpmaObject, need: &[(TpmaObject, &str)], key: &str) -> Result<(), String> {
    match need.iter().find(|(flag, _)| !a.contains(*flag)) {
        Some((_, what)) => Err(format!("{key} is not {what}")),
        None => Ok(()),
    }
}

/// An AK as bca accepts one: restricted, signing only, fixed to its TPM, on P-256.
pub fn check_ak(ak: &TpmtPublic) -> Result<(), String> {
    let a = ak.object_attributes;
    let need = [
        (TpmaObject::FIXED_TPM, "fixedTPM"),
        (TpmaObject::FIXED_PARENT, "fixedParent"),
        (TpmaObject::RESTRICTED, "restricted"),
        (TpmaObject::SIGN_ENCRYPT, "sign"),
    ];
    require(a, &need, "the AK")?;
    if a.contains(TpmaObject::DECRYPT) {
        return Err("the AK also decrypts: an AK only signs".into());
    }
    if !p256(ak) {
        return Err("the AK is not a NIST P-256 key".into());
    }
    Ok(())
}

/// A key made in the TPM and fixed to it: unrestricted, signing, on P-256.
fn check_certified_key(k: &TpmtPublic) -> Result<(), String> {
    let a = k.object_attributes;
    let need = [
        (TpmaObject::FIXED_TPM, "fixedTPM (it could leave its TPM)"),
        (
            TpmaObject::FIXED_PARENT,
            "fixedParent (it could be duplicated)",
        ),
        (
            TpmaObject::SENSITIVE_DATA_ORIGIN,
            "sensitiveDataOrigin (it was imported, not made in the TPM)",
        ),
        (TpmaObject::SIGN_ENCRYPT, "a signing key"),
    ];
    require(a, &need, "the certified key")?;
    if a.contains(TpmaObject::RESTRICTED) {
        return Err("the certified key is restricted: it cannot sign a CSR or a handshake".into());
    }
    if a.contains(TpmaObject::DECRYPT) {
        return Err("the certified key also decrypts: a node key only signs".into());
    }
    if !p256(k) {
        return Err("the certified key is not a NIST P-256 key".into());
    }
    Ok(())
}

/// A `TPMT_SIGNATURE` (ECDSA with SHA-256) as a DER `ECDSA-Sig-Value`.
pub fn ecdsa_der(tpmt_signature: &[u8]) -> Result<Vec<u8>, String> {
    let (sig, rest) = TpmtSignature::unmarshal(tpmt_signature)
        .map_err(|e| format!("not a TPMT_SIGNATURE: {e:?}"))?;
    if !rest.is_empty() {
        return Err("a TPMT_SIGNATURE with trailing bytes".into());
    }
    match (sig.sig_alg, &sig.signature) {
        (TpmAlgId::Ecdsa, TpmuSignature::Ecdsa(e)) if e.hash == TpmAlgId::Sha256 => {
            let mut body = der_uint(&e.signature_r);
            body.extend(der_uint(&e.signature_s));
            Ok(der(0x30, &body))
        }
        _ => Err("the signature is not ECDSA with SHA-256".into()),
    }
}

/// Checks a `TPM2_Certify` of the key `key_public` (a marshaled `TPM2B_PUBLIC`) by the AK
/// `ak_public`: `attest` is the marshaled `TPMS_ATTEST` the TPM signed, `signature` its
/// `TPMT_SIGNATURE`, `qualifying` what the attestation's `extraData` must be.
pub fn verify_certify(
    ak_public: &[u8],
    attest: &[u8],
    signature: &[u8],
    qualifying: &[u8],
    key_public: &[u8],
) -> Result<Certified, String> {
    let ak = parse_public(ak_public).map_err(|e| format!("the AK's public area: {e}"))?;
    check_ak(&ak)?;
    let ak_key = PublicKey::of(&ak)?;
    let point = crate::base::crypto::p256_point_from_spki(&ak_key.spki).ok_or("the AK's point")?;
    let der_sig = ecdsa_der(signature)?;
    aws_lc_rs::signature::UnparsedPublicKey::new(
        &aws_lc_rs::signature::ECDSA_P256_SHA256_ASN1,
        point,
    )
    .verify(attest, &der_sig)
    .map_err(|_| "the AK's signature over the attestation does not verify".to_string())?;
    let (a, rest) = TpmsAttest::unmarshal(attest)
        .map_err(|e| format!("the attestation is not a TPMS_ATTEST made by a TPM: {e:?}"))?;
    if !rest.is_empty() {
        return Err("the attestation has trailing bytes".into());
    }
    if a.attest_type != TpmSt::AttestCertify {
        return Err("the attestation is not a certification of a key".into());
    }
    if !crate::base::crypto::ct_eq(&a.extra_data, qualifying) {
        return Err("the attestation's qualifying data is not the nonce it was asked for".into());
    }
    let TpmuAttest::Certify(info) = &a.attested else {
        return Err("the attestation is not a certification of a key".into());
    };
    let key = parse_public(key_public).map_err(|e| format!("the key's public area: {e}"))?;
    let certified = PublicKey::of(&key)?;
    if info.name[..] != certified.name[..] {
        return Err("the attestation certifies another key than the one given".into());
    }
    check_certified_key(&key)?;
    Ok(Certified {
        name: certified.name,
        spki: certified.spki,
    })
}
