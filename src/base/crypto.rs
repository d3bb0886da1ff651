//! Small cryptographic helpers on aws-lc-rs: randomness, hashes, pins, and ECDSA P-256 signatures
//! bound to a purpose string so that a signature made for one use can never be replayed for another.

use aws_lc_rs::{digest, rand, signature};
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use base64::Engine as _;
use signature::{EcdsaKeyPair, KeyPair as _, UnparsedPublicKey};
use zeroize::Zeroizing;

/// Fills `buf` from the system's CSPRNG. Panics only if the kernel cannot give randomness, in which
/// case nothing the appliance does would be safe anyway.
pub fn fill_random(buf: &mut [u8]) {
    rand::fill(buf).expect("the system random number generator failed");
}

pub fn sha256(data: &[u8]) -> [u8; 32] {
    let d = digest::digest(&digest::SHA256, data);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// Lower- or upper-case hex to bytes; `None` for an odd length or a non-hex digit.
pub fn hex_decode(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

pub fn hex(data: &[u8]) -> String {
    let mut s = String::with_capacity(data.len() * 2);
    for b in data {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

pub fn b64(data: &[u8]) -> String {
    STANDARD.encode(data)
}

pub fn b64_decode(s: &str) -> Option<Vec<u8>> {
    STANDARD.decode(s).ok()
}

pub fn b64url(data: &[u8]) -> String {
    URL_SAFE_NO_PAD.encode(data)
}

pub fn b64url_decode(s: &str) -> Option<Vec<u8>> {
    URL_SAFE_NO_PAD.decode(s).ok()
}

/// `sha256/<base64 of the SHA-256 of the SubjectPublicKeyInfo>`, the form every pin takes.
pub fn spki_pin(spki_der: &[u8]) -> String {
    format!("sha256/{}", b64(&sha256(spki_der)))
}

/// Constant-time equality of two byte strings.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    #[allow(deprecated)]
    aws_lc_rs::constant_time::verify_slices_are_equal(a, b).is_ok()
}

/// The DER SubjectPublicKeyInfo of an uncompressed P-256 point.
pub fn p256_spki_from_point(point: &[u8]) -> Vec<u8> {
    // SEQUENCE { SEQUENCE { id-ecPublicKey, prime256v1 }, BIT STRING point }
    const PREFIX: [u8; 26] = [
        0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08,
        0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
    ];
    let mut v = PREFIX.to_vec();
    v.extend_from_slice(point);
    v
}

/// The uncompressed point of a P-256 SubjectPublicKeyInfo, if it is one.
pub fn p256_point_from_spki(spki: &[u8]) -> Option<&[u8]> {
    if spki.len() == 91 && spki[..26] == p256_spki_from_point(&[])[..26] && spki[26] == 4 {
        Some(&spki[26..])
    } else {
        None
    }
}

/// A P-256 signing key held in memory; the PKCS#8 bytes it came from are zeroized on drop.
pub struct SigningKey {
    pair: EcdsaKeyPair,
    pkcs8: Zeroizing<Vec<u8>>,
}

impl SigningKey {
    pub fn generate() -> Self {
        let rng = rand::SystemRandom::new();
        let doc = EcdsaKeyPair::generate_pkcs8(&signature::ECDSA_P256_SHA256_ASN1_SIGNING, &rng)
            .expect("P-256 key generation failed");
        Self::from_pkcs8(doc.as_ref()).expect("a fresh key parses")
    }

    pub fn from_pkcs8(der: &[u8]) -> Result<Self, String> {
        let pair = EcdsaKeyPair::from_pkcs8(&signature::ECDSA_P256_SHA256_ASN1_SIGNING, der)
            .map_err(|e| format!("not a P-256 PKCS#8 key: {e}"))?;
        Ok(Self {
            pair,
            pkcs8: Zeroizing::new(der.to_vec()),
        })
    }

    pub fn pkcs8(&self) -> &[u8] {
        &self.pkcs8
    }

    /// The uncompressed public point.
    pub fn public_point(&self) -> &[u8] {
        self.pair.public_key().as_ref()
    }

    pub fn spki_der(&self) -> Vec<u8> {
        p256_spki_from_point(self.public_point())
    }

    /// ASN.1 DER ECDSA signature over `purpose || 0x00 || message`.
    pub fn sign(&self, purpose: &str, message: &[u8]) -> Vec<u8> {
        let rng = rand::SystemRandom::new();
        let msg = purposed(purpose, message);
        self.pair
            .sign(&rng, &msg)
            .expect("ECDSA signing failed")
            .as_ref()
            .to_vec()
    }

    /// An rcgen key pair for certificate signing (same key).
    pub fn rcgen(&self) -> rcgen::KeyPair {
        rcgen::KeyPair::from_pkcs8_der_and_sign_algo(
            &rustls::pki_types::PrivatePkcs8KeyDer::from(self.pkcs8.as_slice()),
            &rcgen::PKCS_ECDSA_P256_SHA256,
        )
        .expect("a valid P-256 key converts")
    }
}

pub(crate) fn purposed(purpose: &str, message: &[u8]) -> Vec<u8> {
    let mut msg = Vec::with_capacity(purpose.len() + 1 + message.len());
    msg.extend_from_slice(purpose.as_bytes());
    msg.push(0);
    msg.extend_from_slice(message);
    msg
}

/// Verifies a purpose-bound signature made by [`SigningKey::sign`] under the given public point.
pub fn verify(public_point: &[u8], purpose: &str, message: &[u8], sig: &[u8]) -> bool {
    UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_ASN1, public_point)
        .verify(&purposed(purpose, message), sig)
        .is_ok()
}

/// Verifies an ECDSA P-256 SHA-256 signature (DER) over `message` as X.509 makes them (no
/// purpose prefix): a certificate's signature over its `tbsCertificate`.
pub fn verify_x509(public_point: &[u8], message: &[u8], sig: &[u8]) -> bool {
    UnparsedPublicKey::new(&signature::ECDSA_P256_SHA256_ASN1, public_point)
        .verify(message, sig)
        .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_are_bound_to_their_purpose() {
        let k = SigningKey::generate();
        let sig = k.sign("join-response", b"body");
        assert!(verify(k.public_point(), "join-response", b"body", &sig));
        assert!(!verify(k.public_point(), "renew-pop", b"body", &sig));
        assert!(!verify(k.public_point(), "join-response", b"bodx", &sig));
    }

    #[test]
    fn spki_round_trips() {
        let k = SigningKey::generate();
        let spki = k.spki_der();
        assert_eq!(p256_point_from_spki(&spki), Some(k.public_point()));
        assert_eq!(k.rcgen().public_key_der(), spki);
    }
}
