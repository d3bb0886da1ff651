//! The TCG templates bca creates objects from (the EK templates of the TCG EK Credential
//! Profile, the AK, the node key, the storage primary key, the sealed object) and the policies
//! they carry (the EK policy, PCR and command-code policies).

use super::der::marshal;
use tpm2_protocol::basic::{TpmUint16, TpmUint32};
use tpm2_protocol::data::{
    Tpm2bDigest, Tpm2bEccParameter, Tpm2bPublicKeyRsa, TpmAlgId, TpmEccCurve, TpmaObject,
    TpmlPcrSelection, TpmsEccParms, TpmsEccPoint, TpmsKeyedhashParms, TpmsPcrSelect,
    TpmsPcrSelection, TpmsRsaParms, TpmsSchemeHash, TpmtEccScheme, TpmtKdfScheme,
    TpmtKeyedhashScheme, TpmtPublic, TpmtRsaScheme, TpmtSigScheme, TpmtSymDef, TpmuAsymScheme,
    TpmuPublicId, TpmuPublicParms, TpmuSigScheme, TpmuSymKeyBits, TpmuSymMode,
};

/// The TCG EK Credential Profile's policy for EKs of the low range: PolicySecret(endorsement).
pub(crate) const EK_POLICY: [u8; 32] = [
    0x83, 0x71, 0x97, 0x67, 0x44, 0x84, 0xB3, 0xF8, 0x1A, 0x90, 0xCC, 0x8D, 0x46, 0xA5, 0xD7, 0x24,
    0xFD, 0x52, 0xD7, 0x6E, 0x06, 0x52, 0x0B, 0x64, 0xF2, 0xA1, 0xDA, 0x1B, 0x33, 0x14, 0x69, 0xAA,
];

/// The EK certificates' NV indices (TCG EK Credential Profile, low range).
pub const EK_CERT_RSA: u32 = 0x01C0_0002;

pub const EK_CERT_ECC: u32 = 0x01C0_000A;

/// The two EKs of the low range: L-1 (RSA 2048) and L-2 (ECC NIST P-256).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EkAlg {
    Rsa,
    Ecc,
}

impl EkAlg {
    pub fn as_str(self) -> &'static str {
        match self {
            EkAlg::Rsa => "rsa",
            EkAlg::Ecc => "ecc",
        }
    }

    pub fn cert_index(self) -> u32 {
        match self {
            EkAlg::Rsa => EK_CERT_RSA,
            EkAlg::Ecc => EK_CERT_ECC,
        }
    }
}

pub(crate) fn ek_template(alg: EkAlg) -> Result<TpmtPublic, tpm2_protocol::TpmError> {
    let symmetric = TpmtSymDef {
        algorithm: TpmAlgId::Aes,
        key_bits: TpmuSymKeyBits::Aes(TpmUint16::new(128)),
        mode: TpmuSymMode::Aes(TpmAlgId::Cfb),
    };
    let (object_type, parameters, unique) = match alg {
        EkAlg::Ecc => (
            TpmAlgId::Ecc,
            TpmuPublicParms::Ecc(TpmsEccParms {
                symmetric,
                scheme: TpmtEccScheme::default(),
                curve_id: TpmEccCurve::NistP256,
                kdf: TpmtKdfScheme::default(),
            }),
            TpmuPublicId::Ecc(TpmsEccPoint {
                x: Tpm2bEccParameter::try_from(&[0u8; 32][..])?,
                y: Tpm2bEccParameter::try_from(&[0u8; 32][..])?,
            }),
        ),
        EkAlg::Rsa => (
            TpmAlgId::Rsa,
            TpmuPublicParms::Rsa(TpmsRsaParms {
                symmetric,
                scheme: TpmtRsaScheme::default(),
                key_bits: TpmUint16::new(2048),
                exponent: TpmUint32::new(0),
            }),
            TpmuPublicId::Rsa(Tpm2bPublicKeyRsa::try_from(&[0u8; 256][..])?),
        ),
    };
    Ok(TpmtPublic {
        object_type,
        name_alg: TpmAlgId::Sha256,
        object_attributes: TpmaObject::FIXED_TPM
            | TpmaObject::FIXED_PARENT
            | TpmaObject::SENSITIVE_DATA_ORIGIN
            | TpmaObject::ADMIN_WITH_POLICY
            | TpmaObject::RESTRICTED
            | TpmaObject::DECRYPT,
        auth_policy: Tpm2bDigest::try_from(&EK_POLICY[..])?,
        parameters,
        unique,
    })
}

/// bca's attestation key: a restricted ECDSA P-256 (SHA-256) signing key, a primary of the
/// endorsement hierarchy from this fixed template, so that the same TPM derives the same AK at
/// every run (from the endorsement seed, which only a factory reset changes) and nothing is
/// stored. `fixedTPM` and `fixedParent`: it never leaves the TPM; `restricted`: it signs only
/// what the TPM itself produced (attestations), never an outside digest that looks like one.
pub(crate) fn ak_template() -> Result<TpmtPublic, tpm2_protocol::TpmError> {
    Ok(ecdsa_p256_template(TpmaObject::RESTRICTED))
}

/// A node's key made in the TPM: an unrestricted ECDSA P-256 (SHA-256) signing key under the
/// storage key, `fixedTPM`, `fixedParent`, `sensitiveDataOrigin`: made inside, never exported.
pub(crate) fn node_key_template() -> TpmtPublic {
    ecdsa_p256_template(TpmaObject::NO_DA)
}

/// An ECDSA P-256 (SHA-256) signing key made in the TPM and fixed to it, with the empty user auth,
/// and `extra` attributes.
pub(crate) fn ecdsa_p256_template(extra: TpmaObject) -> TpmtPublic {
    TpmtPublic {
        object_type: TpmAlgId::Ecc,
        name_alg: TpmAlgId::Sha256,
        object_attributes: TpmaObject::FIXED_TPM
            | TpmaObject::FIXED_PARENT
            | TpmaObject::SENSITIVE_DATA_ORIGIN
            | TpmaObject::USER_WITH_AUTH
            | TpmaObject::SIGN_ENCRYPT
            | extra,
        auth_policy: Tpm2bDigest::default(),
        parameters: TpmuPublicParms::Ecc(TpmsEccParms {
            symmetric: no_symmetric(),
            scheme: TpmtEccScheme {
                scheme: TpmAlgId::Ecdsa,
                details: TpmuAsymScheme::Hash(TpmsSchemeHash {
                    hash_alg: TpmAlgId::Sha256,
                }),
            },
            curve_id: TpmEccCurve::NistP256,
            kdf: TpmtKdfScheme::default(),
        }),
        unique: TpmuPublicId::Ecc(TpmsEccPoint {
            x: Tpm2bEccParameter::default(),
            y: Tpm2bEccParameter::default(),
        }),
    }
}

/// No symmetric algorithm: a signing key's, or an unsalted session's.
pub(crate) fn no_symmetric() -> TpmtSymDef {
    TpmtSymDef {
        algorithm: TpmAlgId::Null,
        key_bits: TpmuSymKeyBits::Null,
        mode: TpmuSymMode::Null,
    }
}

/// The signature scheme of bca's keys: ECDSA with SHA-256.
pub(crate) fn ecdsa_sha256() -> TpmtSigScheme {
    TpmtSigScheme {
        scheme: TpmAlgId::Ecdsa,
        details: TpmuSigScheme::Hash(TpmsSchemeHash {
            hash_alg: TpmAlgId::Sha256,
        }),
    }
}

pub(crate) fn aes128_cfb() -> TpmtSymDef {
    TpmtSymDef {
        algorithm: TpmAlgId::Aes,
        key_bits: TpmuSymKeyBits::Aes(TpmUint16::new(128)),
        mode: TpmuSymMode::Aes(TpmAlgId::Cfb),
    }
}

/// The storage primary key bca seals under: the TCG's ECC P-256 SRK template in the owner
/// hierarchy, re-created identically from the TPM's seed at every start (nothing persistent).
pub(crate) fn srk_template() -> Result<TpmtPublic, tpm2_protocol::TpmError> {
    Ok(TpmtPublic {
        object_type: TpmAlgId::Ecc,
        name_alg: TpmAlgId::Sha256,
        object_attributes: TpmaObject::FIXED_TPM
            | TpmaObject::FIXED_PARENT
            | TpmaObject::SENSITIVE_DATA_ORIGIN
            | TpmaObject::USER_WITH_AUTH
            | TpmaObject::NO_DA
            | TpmaObject::RESTRICTED
            | TpmaObject::DECRYPT,
        auth_policy: Tpm2bDigest::default(),
        parameters: TpmuPublicParms::Ecc(TpmsEccParms {
            symmetric: aes128_cfb(),
            scheme: TpmtEccScheme::default(),
            curve_id: TpmEccCurve::NistP256,
            kdf: TpmtKdfScheme::default(),
        }),
        unique: TpmuPublicId::Ecc(TpmsEccPoint {
            x: Tpm2bEccParameter::try_from(&[0u8; 32][..])?,
            y: Tpm2bEccParameter::try_from(&[0u8; 32][..])?,
        }),
    })
}

/// A sealed data object: the secret comes from bca and never leaves the TPM's parent. With no
/// `policy` it is read back with the (empty) user auth; with one (PCRs), only through a policy
/// session that satisfies it: `USER_WITH_AUTH` is off, so no password opens it.
pub(crate) fn sealed_template(policy: Option<[u8; 32]>) -> TpmtPublic {
    let mut attributes = TpmaObject::FIXED_TPM | TpmaObject::FIXED_PARENT | TpmaObject::NO_DA;
    if policy.is_none() {
        attributes |= TpmaObject::USER_WITH_AUTH;
    }
    TpmtPublic {
        object_type: TpmAlgId::KeyedHash,
        name_alg: TpmAlgId::Sha256,
        object_attributes: attributes,
        auth_policy: match policy {
            Some(p) => Tpm2bDigest::try_from(&p[..]).expect("32 bytes fit a digest"),
            None => Tpm2bDigest::default(),
        },
        parameters: TpmuPublicParms::KeyedHash(TpmsKeyedhashParms {
            scheme: TpmtKeyedhashScheme::default(),
        }),
        unique: TpmuPublicId::KeyedHash(Tpm2bDigest::default()),
    }
}

pub(crate) const TPM_CC_UNSEAL: u32 = 0x0000_015E;

/// `TPM2_PolicyCommandCode`'s policy digest after `prev` (TPM 2.0 Part 3, 23.11):
/// `H(prev || TPM_CC_PolicyCommandCode || code)`.
pub(crate) fn command_code_policy(prev: &[u8; 32], code: u32) -> [u8; 32] {
    const TPM_CC_POLICY_COMMAND_CODE: u32 = 0x0000_016C;
    let mut m = prev.to_vec();
    m.extend_from_slice(&TPM_CC_POLICY_COMMAND_CODE.to_be_bytes());
    m.extend_from_slice(&code.to_be_bytes());
    crate::base::crypto::sha256(&m)
}

/// The largest PCR index, and how many PCRs a binding may name (one `TPML_DIGEST` of answers).
pub(crate) const MAX_PCR: u32 = 23;

pub(crate) const MAX_BOUND_PCRS: usize = 8;

/// `--tpm-pcrs`: PCR indices of the SHA-256 bank, comma-separated (`7`, `0,2,7`), or `none`.
pub fn parse_pcrs(s: &str) -> Result<Vec<u32>, String> {
    if s.trim() == "none" {
        return Ok(Vec::new());
    }
    let mut v = Vec::new();
    for part in s.split(',') {
        let n: u32 = part.trim().parse().map_err(|_| {
            format!("{part:?} is not a PCR number: give indices 0 to {MAX_PCR}, comma-separated (7 or 0,2,7), or none")
        })?;
        if n > MAX_PCR {
            return Err(format!("PCR {n} does not exist: PCRs are 0 to {MAX_PCR}"));
        }
        v.push(n);
    }
    v.sort_unstable();
    v.dedup();
    if v.len() > MAX_BOUND_PCRS {
        return Err(format!("at most {MAX_BOUND_PCRS} PCRs may be named"));
    }
    Ok(v)
}

/// The selection of `pcrs` in the SHA-256 bank, and its marshaled bytes (part of the policy).
pub(crate) fn pcr_selection(pcrs: &[u32]) -> Result<(TpmlPcrSelection, Vec<u8>), String> {
    let mut bitmap = [0u8; 3];
    for p in pcrs {
        bitmap[(*p / 8) as usize] |= 1 << (p % 8);
    }
    let select = TpmsPcrSelect::try_from(&bitmap[..]).map_err(|e| format!("{e:?}"))?;
    let mut list = TpmlPcrSelection::default();
    list.try_push(TpmsPcrSelection {
        hash: TpmAlgId::Sha256,
        pcr_select: select,
    })
    .map_err(|e| format!("{e:?}"))?;
    let bytes = marshal(&list, "a PCR selection")?;
    Ok((list, bytes))
}

/// TPM2_PolicyPCR's policy digest from an empty one (TPM 2.0 Part 3, 23.7):
/// `H(0^32 || TPM_CC_PolicyPCR || pcrs || H(the selected PCRs' values, in order))`.
pub(crate) fn pcr_policy(selection: &[u8], values: &[Vec<u8>]) -> [u8; 32] {
    const TPM_CC_POLICY_PCR: u32 = 0x0000_017F;
    let pcr_digest = crate::base::crypto::sha256(&values.concat());
    let mut m = vec![0u8; 32];
    m.extend_from_slice(&TPM_CC_POLICY_PCR.to_be_bytes());
    m.extend_from_slice(selection);
    m.extend_from_slice(&pcr_digest);
    crate::base::crypto::sha256(&m)
}
