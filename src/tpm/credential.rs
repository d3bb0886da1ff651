//! TPM 2.0 credential protection (TPM 2.0 Part 1, "Credential Protection"; Part 3,
//! `TPM2_MakeCredential`): the appliance wraps a secret so that only the TPM holding a given EK
//! can recover it, and only for a key of a given Name loaded beside it (the AK). Made here in
//! software, in process, for RSA 2048 and NIST P-256 EKs: no TPM on the appliance's side.
//!
//! - a seed: for an RSA EK, 32 random bytes encrypted with RSA-OAEP (SHA-256, label
//!   `IDENTITY\0`); for an ECC EK, `KDFe(Z, "IDENTITY", ephemeral.x, ek.x)` from an ephemeral
//!   ECDH key, whose public point is the encrypted secret;
//! - `KDFa(seed, "STORAGE", name)` keys AES-128-CFB (zero IV) over the credential (a
//!   `TPM2B_DIGEST`), `KDFa(seed, "INTEGRITY")` keys an HMAC over the ciphertext and the Name.
//!
//! The TPM's `TPM2_ActivateCredential` reverses it ([`super::Tpm::activate_credential`]);
//! tpm2-tools' `tpm2_activatecredential` and `tpm2_makecredential` check both sides.

use tpm2_protocol::data::{
    TpmAlgId, TpmEccCurve, TpmaObject, TpmtPublic, TpmuPublicId, TpmuPublicParms, TpmuSymKeyBits,
    TpmuSymMode,
};

/// A credential for one EK and one Name: `TPM2B_ID_OBJECT`'s and `TPM2B_ENCRYPTED_SECRET`'s
/// contents (without their size fields).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credential {
    pub id_object: Vec<u8>,
    pub encrypted_secret: Vec<u8>,
}

/// The largest credential: a SHA-256 digest's size.
pub const MAX_CREDENTIAL: usize = 32;

/// SP 800-108 counter-mode KDF with HMAC-SHA-256, as the TPM specifies it (Part 1, 11.4.10.2):
/// `HMAC(key, i || label || 0 || contextU || contextV || bits)` for i = 1, 2, …
pub fn kdfa(key: &[u8], label: &str, context_u: &[u8], context_v: &[u8], bits: u32) -> Vec<u8> {
    use aws_lc_rs::hmac;
    let k = hmac::Key::new(hmac::HMAC_SHA256, key);
    let want = bits.div_ceil(8) as usize;
    let mut out = Vec::with_capacity(want + 32);
    let mut i: u32 = 1;
    while out.len() < want {
        let mut ctx = hmac::Context::with_key(&k);
        ctx.update(&i.to_be_bytes());
        ctx.update(label.as_bytes());
        ctx.update(&[0]);
        ctx.update(context_u);
        ctx.update(context_v);
        ctx.update(&bits.to_be_bytes());
        out.extend_from_slice(ctx.sign().as_ref());
        i += 1;
    }
    out.truncate(want);
    out
}

/// SP 800-56A concatenation KDF with SHA-256, as the TPM specifies it (Part 1, 11.4.10.3):
/// `H(i || Z || label || 0 || partyU || partyV)` for i = 1, 2, …
pub fn kdfe(z: &[u8], label: &str, party_u: &[u8], party_v: &[u8], bits: u32) -> Vec<u8> {
    let want = bits.div_ceil(8) as usize;
    let mut out = Vec::with_capacity(want + 32);
    let mut i: u32 = 1;
    while out.len() < want {
        // Z, the ECDH shared secret, passes through this buffer.
        let mut m = zeroize::Zeroizing::new(i.to_be_bytes().to_vec());
        m.extend_from_slice(z);
        m.extend_from_slice(label.as_bytes());
        m.push(0);
        m.extend_from_slice(party_u);
        m.extend_from_slice(party_v);
        out.extend_from_slice(&crate::base::crypto::sha256(&m));
        i += 1;
    }
    out.truncate(want);
    out
}

fn aes128_cfb(key: &[u8], data: &mut [u8], encrypt: bool) -> Result<(), String> {
    aes128_cfb_iv(key, &[0u8; 16], data, encrypt)
}

/// AES-128-CFB (full-block feedback) over `data` in place, with `iv`.
pub fn aes128_cfb_iv(key: &[u8], iv: &[u8], data: &mut [u8], encrypt: bool) -> Result<(), String> {
    let iv: [u8; 16] = iv
        .try_into()
        .map_err(|_| "an AES IV of 16 bytes".to_string())?;
    use aws_lc_rs::cipher::{
        DecryptingKey, DecryptionContext, EncryptingKey, EncryptionContext, UnboundCipherKey,
        AES_128,
    };
    use aws_lc_rs::iv::FixedLength;
    let unbound = || UnboundCipherKey::new(&AES_128, key).map_err(|_| "an AES-128 key".to_string());
    if encrypt {
        EncryptingKey::cfb128(unbound()?)
            .and_then(|k| {
                k.less_safe_encrypt(data, EncryptionContext::Iv128(FixedLength::from(iv)))
            })
            .map_err(|_| "AES-128-CFB".to_string())?;
    } else {
        DecryptingKey::cfb128(unbound()?)
            .and_then(|k| k.decrypt(data, DecryptionContext::Iv128(FixedLength::from(iv))))
            .map_err(|_| "AES-128-CFB".to_string())?;
    }
    Ok(())
}

/// HMAC-SHA-256 of `parts`, concatenated.
pub(super) fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> Vec<u8> {
    use aws_lc_rs::hmac;
    let mut ctx = hmac::Context::with_key(&hmac::Key::new(hmac::HMAC_SHA256, key));
    for p in parts {
        ctx.update(p);
    }
    ctx.sign().as_ref().to_vec()
}

/// An ECDH seed for a P-256 key of the TPM (TPM 2.0 Part 1, C.6.1): an ephemeral key, `Z` with
/// the TPM key's point, `KDFe(Z, label, ephemeral.x, tpm.x)`; and the ephemeral point as the
/// TPM reads it (`TPMS_ECC_POINT`), the "encrypted" seed.
pub fn ecdh_seed(
    label: &str,
    x: &[u8],
    y: &[u8],
) -> Result<(zeroize::Zeroizing<Vec<u8>>, Vec<u8>), String> {
    use aws_lc_rs::agreement::{self, PrivateKey, UnparsedPublicKey, ECDH_P256};
    let mut peer = vec![4u8];
    peer.extend_from_slice(x);
    peer.extend_from_slice(y);
    let ephemeral = PrivateKey::generate(&ECDH_P256).map_err(|_| "an ECDH key")?;
    let public = ephemeral.compute_public_key().map_err(|_| "an ECDH key")?;
    let public = public.as_ref();
    let (ux, uy) = (&public[1..33], &public[33..65]);
    let seed = agreement::agree(
        &ephemeral,
        UnparsedPublicKey::new(&ECDH_P256, &peer),
        "the TPM key's point is not on P-256".to_string(),
        |z| Ok(kdfe(z, label, ux, x, 256)),
    )?;
    let mut point = Vec::with_capacity(68);
    for c in [ux, uy] {
        point.extend_from_slice(&32u16.to_be_bytes());
        point.extend_from_slice(c);
    }
    Ok((zeroize::Zeroizing::new(seed), point))
}

/// Checks that `ek` is a storage key a credential can be made for: restricted, decrypting,
/// SHA-256 names, AES-128-CFB, RSA 2048 or NIST P-256.
fn check_ek(ek: &TpmtPublic) -> Result<(), String> {
    if ek.name_alg != TpmAlgId::Sha256 {
        return Err("the EK's name algorithm is not SHA-256".into());
    }
    let attrs = ek.object_attributes;
    if !attrs.contains(TpmaObject::RESTRICTED) || !attrs.contains(TpmaObject::DECRYPT) {
        return Err("the key is not a restricted decryption key (an EK)".into());
    }
    let symmetric = match &ek.parameters {
        TpmuPublicParms::Rsa(p) => &p.symmetric,
        TpmuPublicParms::Ecc(p) => &p.symmetric,
        _ => return Err("the EK is neither RSA nor ECC".into()),
    };
    let aes128_cfb = symmetric.algorithm == TpmAlgId::Aes
        && matches!(symmetric.key_bits, TpmuSymKeyBits::Aes(b) if b.value() == 128)
        && matches!(symmetric.mode, TpmuSymMode::Aes(TpmAlgId::Cfb));
    if !aes128_cfb {
        return Err("the EK's symmetric algorithm is not AES-128-CFB".into());
    }
    Ok(())
}

/// `TPM2_MakeCredential` in software: `credential` (1 to 32 bytes) for the object named `name`
/// (its Name: `000b` and a SHA-256), recoverable only by the TPM that holds `ek`.
pub fn make_credential(
    ek: &TpmtPublic,
    name: &[u8],
    credential: &[u8],
) -> Result<Credential, String> {
    check_ek(ek)?;
    if credential.is_empty() || credential.len() > MAX_CREDENTIAL {
        return Err(format!(
            "a credential of {} bytes (1 to {MAX_CREDENTIAL})",
            credential.len()
        ));
    }
    if name.len() != 34 || name[..2] != [0x00, 0x0b] {
        return Err("the object's Name is not a SHA-256 Name".into());
    }
    let (seed, encrypted_secret) = match (&ek.parameters, &ek.unique) {
        (TpmuPublicParms::Rsa(p), TpmuPublicId::Rsa(n)) => {
            use aws_lc_rs::rsa::{
                OaepPublicEncryptingKey, PublicEncryptingKey, OAEP_SHA256_MGF1SHA256,
            };
            let e = match p.exponent.value() {
                0 => 65_537,
                e => e,
            };
            let key = PublicEncryptingKey::from_der(&super::rsa_spki(n, e))
                .map_err(|e| format!("the EK's RSA key: {e}"))
                .and_then(|k| {
                    OaepPublicEncryptingKey::new(k).map_err(|_| "the EK's RSA key".to_string())
                })?;
            let mut seed = zeroize::Zeroizing::new(vec![0u8; 32]);
            crate::base::crypto::fill_random(&mut seed);
            let mut out = vec![0u8; key.ciphertext_size()];
            let n = key
                .encrypt(
                    &OAEP_SHA256_MGF1SHA256,
                    &seed,
                    &mut out,
                    Some(b"IDENTITY\0"),
                )
                .map_err(|_| "RSA-OAEP encryption failed".to_string())?
                .len();
            out.truncate(n);
            (seed, out)
        }
        (TpmuPublicParms::Ecc(p), TpmuPublicId::Ecc(pt)) if p.curve_id == TpmEccCurve::NistP256 => {
            let (ex, ey) = (super::left_pad(&pt.x, 32)?, super::left_pad(&pt.y, 32)?);
            ecdh_seed("IDENTITY", &ex, &ey)?
        }
        _ => return Err("the EK is neither RSA 2048 nor NIST P-256".into()),
    };
    let sym = zeroize::Zeroizing::new(kdfa(&seed, "STORAGE", name, &[], 128));
    let mut enc = (credential.len() as u16).to_be_bytes().to_vec();
    enc.extend_from_slice(credential);
    aes128_cfb(&sym, &mut enc, true)?;
    let hmac_key = zeroize::Zeroizing::new(kdfa(&seed, "INTEGRITY", &[], &[], 256));
    let integrity = hmac_sha256(&hmac_key, &[&enc, name]);
    let mut id_object = 32u16.to_be_bytes().to_vec();
    id_object.extend_from_slice(&integrity);
    id_object.extend_from_slice(&enc);
    Ok(Credential {
        id_object,
        encrypted_secret,
    })
}

/// Opens a credential with its seed, as the TPM would: for the unit tests' round trip.
#[cfg(test)]
fn open_with_seed(seed: &[u8], name: &[u8], id_object: &[u8]) -> Result<Vec<u8>, String> {
    let (hmac, enc) = id_object.split_at(34);
    let hmac_key = kdfa(seed, "INTEGRITY", &[], &[], 256);
    if hmac[2..] != hmac_sha256(&hmac_key, &[enc, name])[..] {
        return Err("integrity".into());
    }
    let mut enc = enc.to_vec();
    aes128_cfb(&kdfa(seed, "STORAGE", name, &[], 128), &mut enc, false)?;
    Ok(enc[2..].to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kdfa_matches_a_known_answer() {
        // HMAC-SHA256("key", 00000001 || "label" || 00 || "u" || "v" || 00000100), computed
        // independently (python3 hmac).
        let k = kdfa(b"key", "label", b"u", b"v", 256);
        assert_eq!(k.len(), 32);
        let mut m = 1u32.to_be_bytes().to_vec();
        m.extend(b"label\0uv");
        m.extend(256u32.to_be_bytes());
        assert_eq!(k, hmac_sha256(b"key", &[&m]));
        // Longer than one block: two HMACs, truncated.
        assert_eq!(kdfa(b"key", "l", &[], &[], 400).len(), 50);
    }

    #[test]
    fn a_credential_opens_with_its_seed_and_not_with_another_name() {
        // The symmetric layers, with a known seed: what the TPM undoes after recovering it.
        let seed = [7u8; 32];
        let name = [[0u8, 0x0b].as_slice(), &[1u8; 32]].concat();
        let sym = kdfa(&seed, "STORAGE", &name, &[], 128);
        let mut enc = vec![0, 3, b'a', b'b', b'c'];
        aes128_cfb(&sym, &mut enc, true).unwrap();
        let integrity = hmac_sha256(&kdfa(&seed, "INTEGRITY", &[], &[], 256), &[&enc, &name]);
        let id = [&[0u8, 32][..], &integrity, &enc].concat();
        assert_eq!(open_with_seed(&seed, &name, &id).unwrap(), b"abc");
        let other = [[0u8, 0x0b].as_slice(), &[2u8; 32]].concat();
        assert!(open_with_seed(&seed, &other, &id).is_err());
    }
}
