//! The TPM's wire forms bca reads and writes: marshaling, an object's Name, and public keys as
//! the TPM returns them turned into DER SubjectPublicKeyInfo (RSA and P-256).

use tpm2_protocol::constant::TPM_MAX_COMMAND_SIZE;
use tpm2_protocol::data::{
    Tpm2bPublic, TpmAlgId, TpmEccCurve, TpmtPublic, TpmuPublicId, TpmuPublicParms,
};
use tpm2_protocol::{TpmMarshal, TpmWriter};

/// A public key as a TPM holds it, with what bca derives from it.
#[derive(Debug, Clone)]
pub struct PublicKey {
    /// The object's Name: `nameAlg` (2 bytes) and the SHA-256 of its marshaled `TPMT_PUBLIC`,
    /// computed here from the public area, never taken from the TPM's answer.
    pub name: Vec<u8>,
    /// The key as a DER SubjectPublicKeyInfo.
    pub spki: Vec<u8>,
}

impl PublicKey {
    pub(crate) fn of(public: &TpmtPublic) -> Result<Self, String> {
        let marshaled = marshal(public, "a public area")?;
        if public.name_alg != TpmAlgId::Sha256 {
            return Err("a public area whose name algorithm is not SHA-256".into());
        }
        let name = name_of(&marshaled);
        let spki = match (&public.parameters, &public.unique) {
            (TpmuPublicParms::Ecc(p), TpmuPublicId::Ecc(pt))
                if p.curve_id == TpmEccCurve::NistP256 =>
            {
                let mut point = vec![4u8];
                point.extend_from_slice(&left_pad(&pt.x, 32)?);
                point.extend_from_slice(&left_pad(&pt.y, 32)?);
                crate::base::crypto::p256_spki_from_point(&point)
            }
            (TpmuPublicParms::Rsa(p), TpmuPublicId::Rsa(n)) => {
                let e = match p.exponent.value() {
                    0 => 65_537,
                    e => e,
                };
                rsa_spki(n, e)
            }
            _ => return Err("a key that is neither NIST P-256 nor RSA".into()),
        };
        Ok(Self { name, spki })
    }
}

pub(crate) fn left_pad(b: &[u8], n: usize) -> Result<Vec<u8>, String> {
    if b.len() > n {
        return Err("a coordinate longer than its curve".into());
    }
    let mut v = vec![0u8; n - b.len()];
    v.extend_from_slice(b);
    Ok(v)
}

pub(crate) fn der_len(n: usize) -> Vec<u8> {
    if n < 0x80 {
        vec![n as u8]
    } else {
        let b: Vec<u8> = n
            .to_be_bytes()
            .into_iter()
            .skip_while(|b| *b == 0)
            .collect();
        let mut v = vec![0x80 | b.len() as u8];
        v.extend(b);
        v
    }
}

pub(crate) fn der(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut v = vec![tag];
    v.extend(der_len(body.len()));
    v.extend_from_slice(body);
    v
}

pub(crate) fn der_uint(b: &[u8]) -> Vec<u8> {
    let b: Vec<u8> = b.iter().copied().skip_while(|x| *x == 0).collect();
    let mut body = if b.first().is_some_and(|x| x & 0x80 != 0) {
        vec![0]
    } else {
        Vec::new()
    };
    body.extend(if b.is_empty() { vec![0] } else { b });
    der(0x02, &body)
}

/// `SubjectPublicKeyInfo { rsaEncryption, RSAPublicKey { n, e } }`.
pub(crate) fn rsa_spki(n: &[u8], e: u32) -> Vec<u8> {
    let alg = der(
        0x30,
        &[
            der(
                0x06,
                &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01],
            ),
            vec![0x05, 0x00],
        ]
        .concat(),
    );
    let key = der(0x30, &[der_uint(n), der_uint(&e.to_be_bytes())].concat());
    let bits = der(0x03, &[&[0u8][..], &key].concat());
    der(0x30, &[alg, bits].concat())
}

/// A public area marshaled as `TPM2B_PUBLIC`.
pub(crate) fn marshal_public(p: &TpmtPublic) -> Result<Vec<u8>, String> {
    marshal(&Tpm2bPublic::from(p.clone()), "a public area")
}

/// `v` in the TPM's wire format.
pub(crate) fn marshal(v: &impl TpmMarshal, what: &str) -> Result<Vec<u8>, String> {
    let mut buf = vec![0u8; TPM_MAX_COMMAND_SIZE];
    let mut w = TpmWriter::new(&mut buf);
    v.marshal(&mut w)
        .map_err(|e| format!("marshaling {what}: {e:?}"))?;
    Ok(w.as_bytes().to_vec())
}

/// An object's Name from its marshaled `TPMT_PUBLIC` (SHA-256 names only): `000b || H(area)`.
pub(crate) fn name_of(tpmt_public: &[u8]) -> Vec<u8> {
    [
        &TpmAlgId::Sha256.value().to_be_bytes()[..],
        &crate::base::crypto::sha256(tpmt_public),
    ]
    .concat()
}
