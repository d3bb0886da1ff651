//! Sealed join tokens: compact JWE with `ECDH-ES+A256KW` and `A256GCM` (RFC 7516, RFC 7518), on
//! aws-lc-rs primitives (ECDH P-256, the Concat KDF on SHA-256, AES key wrap, AES-GCM).
//!
//! The protected header is exactly `alg`, `enc`, `typ` (`bcjt+jwe`), `iat` (Unix seconds), `csr`
//! (base64url of the SHA-256 of the CSR's DER, no padding) and `epk`; any other field (`zip`,
//! `crit`, `kid`, ...) is refused, and so is a duplicate one. [`open`] is a pure function of the
//! bytes, the key, the CSR hash the caller computed itself, and `now`.

use crate::base::crypto;
use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use aws_lc_rs::agreement::{self, EphemeralPrivateKey, PrivateKey, UnparsedPublicKey, ECDH_P256};
use aws_lc_rs::key_wrap::{KeyEncryptionKey, KeyWrap, AES_256};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

pub const ALG: &str = "ECDH-ES+A256KW";
pub const ENC: &str = "A256GCM";
pub const TYP: &str = "bcjt+jwe";
/// The largest compact serialization [`open`] reads.
pub const MAX_COMPACT_LEN: usize = 4096;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    alg: String,
    enc: String,
    typ: String,
    iat: i64,
    csr: String,
    epk: Epk,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Epk {
    kty: String,
    crv: String,
    x: String,
    y: String,
}

/// Why a seal did not open. The join answers every one the same; the reason is for the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SealError {
    Malformed,
    Header,
    Algorithm,
    EphemeralKey,
    CsrMismatch,
    Stale,
    Decrypt,
}

/// The Concat KDF of RFC 7518 §4.6.2 for a 256-bit key, with empty `apu` and `apv`.
fn concat_kdf(z: &[u8]) -> Zeroizing<[u8; 32]> {
    let mut input = Vec::with_capacity(4 + z.len() + 4 + ALG.len() + 12);
    input.extend_from_slice(&1u32.to_be_bytes());
    input.extend_from_slice(z);
    input.extend_from_slice(&(ALG.len() as u32).to_be_bytes());
    input.extend_from_slice(ALG.as_bytes());
    input.extend_from_slice(&0u32.to_be_bytes()); // PartyUInfo
    input.extend_from_slice(&0u32.to_be_bytes()); // PartyVInfo
    input.extend_from_slice(&256u32.to_be_bytes()); // SuppPubInfo: keydatalen in bits
    let out = Zeroizing::new(crypto::sha256(&input));
    zeroize::Zeroize::zeroize(&mut input);
    out
}

/// The `csr` header value for a CSR.
pub fn csr_claim(csr_der: &[u8]) -> String {
    crypto::b64url(&crypto::sha256(csr_der))
}

/// Seals `token` to the recipient's P-256 point (uncompressed), bound to the CSR and the time.
pub fn seal(
    token: &str,
    recipient_point: &[u8],
    csr_der: &[u8],
    iat: i64,
) -> Result<String, String> {
    let rng = aws_lc_rs::rand::SystemRandom::new();
    let eph = EphemeralPrivateKey::generate(&ECDH_P256, &rng)
        .map_err(|_| "ephemeral key generation failed")?;
    let eph_pub = eph
        .compute_public_key()
        .map_err(|_| "ephemeral public key")?;
    let p = eph_pub.as_ref();
    let header = Header {
        alg: ALG.into(),
        enc: ENC.into(),
        typ: TYP.into(),
        iat,
        csr: csr_claim(csr_der),
        epk: Epk {
            kty: "EC".into(),
            crv: "P-256".into(),
            x: crypto::b64url(&p[1..33]),
            y: crypto::b64url(&p[33..65]),
        },
    };
    let kek = agreement::agree_ephemeral(
        eph,
        UnparsedPublicKey::new(&ECDH_P256, recipient_point),
        "bad recipient key",
        |z| Ok(concat_kdf(z)),
    )?;
    let mut cek = Zeroizing::new([0u8; 32]);
    crypto::fill_random(cek.as_mut());
    let mut wrapped = [0u8; 40];
    KeyEncryptionKey::new(&AES_256, kek.as_ref())
        .and_then(|k| k.wrap(cek.as_ref(), &mut wrapped).map(|_| ()))
        .map_err(|_| "key wrap failed")?;
    let mut iv = [0u8; 12];
    crypto::fill_random(&mut iv);
    let h64 = crypto::b64url(&serde_json::to_vec(&header).expect("serializes"));
    let aead = LessSafeKey::new(UnboundKey::new(&AES_256_GCM, cek.as_ref()).map_err(|_| "cek")?);
    let mut buf = token.as_bytes().to_vec();
    let tag = aead
        .seal_in_place_separate_tag(
            Nonce::assume_unique_for_key(iv),
            Aad::from(h64.as_bytes()),
            &mut buf,
        )
        .map_err(|_| "encryption failed")?;
    Ok(format!(
        "{h64}.{}.{}.{}.{}",
        crypto::b64url(&wrapped),
        crypto::b64url(&iv),
        crypto::b64url(&buf),
        crypto::b64url(tag.as_ref())
    ))
}

/// Opens a sealed token with the join-encryption key (PKCS#8), checking every header rule, that
/// the seal was made for the CSR whose SHA-256 is `csr_sha256`, and that `iat` is within
/// `max_skew` seconds of `now`.
pub fn open(
    compact: &str,
    key: &PrivateKey,
    csr_sha256: &[u8; 32],
    now: i64,
    max_skew: i64,
) -> Result<Zeroizing<String>, SealError> {
    if compact.len() > MAX_COMPACT_LEN {
        return Err(SealError::Malformed);
    }
    let parts: Vec<&str> = compact.split('.').collect();
    let [h64, ek64, iv64, ct64, tag64] = parts[..] else {
        return Err(SealError::Malformed);
    };
    let hjson = crypto::b64url_decode(h64).ok_or(SealError::Malformed)?;
    let header: Header = serde_json::from_slice(&hjson).map_err(|_| SealError::Header)?;
    if header.alg != ALG || header.enc != ENC {
        return Err(SealError::Algorithm);
    }
    if header.typ != TYP {
        return Err(SealError::Header);
    }
    let claim = crypto::b64url_decode(&header.csr).ok_or(SealError::Header)?;
    if !crypto::ct_eq(&claim, csr_sha256) {
        return Err(SealError::CsrMismatch);
    }
    if (now - header.iat).abs() > max_skew {
        return Err(SealError::Stale);
    }
    if header.epk.kty != "EC" || header.epk.crv != "P-256" {
        return Err(SealError::EphemeralKey);
    }
    let x = crypto::b64url_decode(&header.epk.x)
        .filter(|v| v.len() == 32)
        .ok_or(SealError::EphemeralKey)?;
    let y = crypto::b64url_decode(&header.epk.y)
        .filter(|v| v.len() == 32)
        .ok_or(SealError::EphemeralKey)?;
    let mut point = Vec::with_capacity(65);
    point.push(4);
    point.extend_from_slice(&x);
    point.extend_from_slice(&y);
    // aws-lc checks that the point is on the curve and not the identity before agreeing.
    let kek = agreement::agree(
        key,
        UnparsedPublicKey::new(&ECDH_P256, &point),
        SealError::EphemeralKey,
        |z| Ok(concat_kdf(z)),
    )?;
    let ek = crypto::b64url_decode(ek64)
        .filter(|v| v.len() == 40)
        .ok_or(SealError::Malformed)?;
    let iv: [u8; 12] = crypto::b64url_decode(iv64)
        .and_then(|v| v.try_into().ok())
        .ok_or(SealError::Malformed)?;
    let tag = crypto::b64url_decode(tag64)
        .filter(|v| v.len() == 16)
        .ok_or(SealError::Malformed)?;
    let mut buf = Zeroizing::new(crypto::b64url_decode(ct64).ok_or(SealError::Malformed)?);
    let mut cek = Zeroizing::new([0u8; 32]);
    KeyEncryptionKey::new(&AES_256, kek.as_ref())
        .and_then(|k| k.unwrap(&ek, cek.as_mut()).map(|_| ()))
        .map_err(|_| SealError::Decrypt)?;
    let aead = LessSafeKey::new(
        UnboundKey::new(&AES_256_GCM, cek.as_ref()).map_err(|_| SealError::Decrypt)?,
    );
    buf.extend_from_slice(&tag);
    let plain = aead
        .open_in_place(
            Nonce::assume_unique_for_key(iv),
            Aad::from(h64.as_bytes()),
            &mut buf,
        )
        .map_err(|_| SealError::Decrypt)?;
    let s = std::str::from_utf8(plain).map_err(|_| SealError::Decrypt)?;
    Ok(Zeroizing::new(s.to_string()))
}

/// The join-encryption key as an ECDH private key.
pub fn decryption_key(pkcs8: &[u8]) -> Result<PrivateKey, String> {
    PrivateKey::from_private_key_der(&ECDH_P256, pkcs8)
        .map_err(|e| format!("the join-encryption key: {e}"))
}

/// A JWK for a P-256 public point.
pub fn jwk(point: &[u8]) -> Jwk {
    Jwk {
        kty: "EC".into(),
        crv: "P-256".into(),
        x: crypto::b64url(&point[1..33]),
        y: crypto::b64url(&point[33..65]),
    }
}

#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Jwk {
    pub kty: String,
    pub crv: String,
    pub x: String,
    pub y: String,
}

impl Jwk {
    /// The uncompressed point, if this is a P-256 key with 32-byte coordinates.
    pub fn point(&self) -> Option<Vec<u8>> {
        if self.kty != "EC" || self.crv != "P-256" {
            return None;
        }
        let x = crypto::b64url_decode(&self.x)?;
        let y = crypto::b64url_decode(&self.y)?;
        if x.len() != 32 || y.len() != 32 {
            return None;
        }
        let mut p = vec![4u8];
        p.extend_from_slice(&x);
        p.extend_from_slice(&y);
        Some(p)
    }
}

/// The pin of a JWK's P-256 key.
pub fn jwk_pin(j: &Jwk) -> Result<String, String> {
    let point = j.point().ok_or("the JWK is not a P-256 key")?;
    Ok(crypto::spki_pin(&crypto::p256_spki_from_point(&point)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::crypto::SigningKey;

    fn setup() -> (SigningKey, PrivateKey) {
        let k = SigningKey::generate();
        let d = decryption_key(k.pkcs8()).unwrap();
        (k, d)
    }

    fn reseal_header(compact: &str, f: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut parts: Vec<String> = compact.split('.').map(str::to_string).collect();
        let mut h: serde_json::Value =
            serde_json::from_slice(&crypto::b64url_decode(&parts[0]).unwrap()).unwrap();
        f(&mut h);
        parts[0] = crypto::b64url(h.to_string().as_bytes());
        parts.join(".")
    }

    #[test]
    fn round_trip() {
        let (k, d) = setup();
        let csr = b"csr bytes";
        let s = seal("bcjt_secret", k.public_point(), csr, 1000).unwrap();
        let t = open(&s, &d, &crypto::sha256(csr), 1010, 300).unwrap();
        assert_eq!(t.as_str(), "bcjt_secret");
    }

    #[test]
    fn refusals() {
        let (k, d) = setup();
        let csr = b"csr bytes";
        let h = crypto::sha256(csr);
        let s = seal("tok", k.public_point(), csr, 1000).unwrap();
        assert_eq!(
            open(&s, &d, &crypto::sha256(b"other csr"), 1000, 300).unwrap_err(),
            SealError::CsrMismatch
        );
        assert_eq!(open(&s, &d, &h, 1301, 300).unwrap_err(), SealError::Stale);
        assert_eq!(open(&s, &d, &h, 699, 300).unwrap_err(), SealError::Stale);
        assert_eq!(
            open("a.b.c", &d, &h, 1000, 300).unwrap_err(),
            SealError::Malformed
        );
        assert_eq!(
            open(&"a".repeat(5000), &d, &h, 1000, 300).unwrap_err(),
            SealError::Malformed
        );
        // Another recipient's key cannot open it.
        let (_, d2) = setup();
        assert_eq!(
            open(&s, &d2, &h, 1000, 300).unwrap_err(),
            SealError::Decrypt
        );
        // Header tampering: the header is the AAD, and unknown or changed fields are refused.
        let zip = reseal_header(&s, |h| h["zip"] = "DEF".into());
        assert_eq!(
            open(&zip, &d, &h, 1000, 300).unwrap_err(),
            SealError::Header
        );
        let crit = reseal_header(&s, |h| h["crit"] = serde_json::json!(["x"]));
        assert_eq!(
            open(&crit, &d, &h, 1000, 300).unwrap_err(),
            SealError::Header
        );
        let alg = reseal_header(&s, |h| h["alg"] = "ECDH-ES+A128KW".into());
        assert_eq!(
            open(&alg, &d, &h, 1000, 300).unwrap_err(),
            SealError::Algorithm
        );
        let enc = reseal_header(&s, |h| h["enc"] = "A128GCM".into());
        assert_eq!(
            open(&enc, &d, &h, 1000, 300).unwrap_err(),
            SealError::Algorithm
        );
        let typ = reseal_header(&s, |h| h["typ"] = "JWT".into());
        assert_eq!(
            open(&typ, &d, &h, 1000, 300).unwrap_err(),
            SealError::Header
        );
        let iat = reseal_header(&s, |h| h["iat"] = 1001.into());
        assert_eq!(
            open(&iat, &d, &h, 1000, 300).unwrap_err(),
            SealError::Decrypt
        );
        // An epk that is not a point on P-256.
        let bad = reseal_header(&s, |h| h["epk"]["y"] = crypto::b64url(&[1u8; 32]).into());
        assert_eq!(
            open(&bad, &d, &h, 1000, 300).unwrap_err(),
            SealError::EphemeralKey
        );
        let short = reseal_header(&s, |h| h["epk"]["x"] = crypto::b64url(&[1u8; 31]).into());
        assert_eq!(
            open(&short, &d, &h, 1000, 300).unwrap_err(),
            SealError::EphemeralKey
        );
        // A duplicate header field.
        let mut parts: Vec<String> = s.split('.').map(str::to_string).collect();
        let hj = String::from_utf8(crypto::b64url_decode(&parts[0]).unwrap()).unwrap();
        parts[0] = crypto::b64url(hj.replacen('{', "{\"typ\":\"bcjt+jwe\",", 1).as_bytes());
        assert_eq!(
            open(&parts.join("."), &d, &h, 1000, 300).unwrap_err(),
            SealError::Header
        );
    }

    #[test]
    fn concat_kdf_matches_rfc7518_appendix_c_shape() {
        // Deterministic: the same Z gives the same key; another Z another.
        assert_eq!(*concat_kdf(&[1u8; 32]), *concat_kdf(&[1u8; 32]));
        assert_ne!(*concat_kdf(&[1u8; 32]), *concat_kdf(&[2u8; 32]));
    }
}
