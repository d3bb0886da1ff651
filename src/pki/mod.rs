//! The appliance's PKI: the node CA, the serving CA with the gateway's leaf, the join-signing
//! certificate and the join-encryption key's JWK; pins; and node certificate issuance.
//!
//! CA subjects are derived from the site, so a CA's issuer object can be rebuilt from its key at
//! `serve` without parsing the stored certificate (the subject and key identifier are the same).

pub mod bundle;

use crate::base::crypto::{self, SigningKey};
use crate::config::Config;
use crate::pki::bundle::KeyBundle;
use crate::proto::jwe::jwk;
use crate::proto::jwe::jwk_pin;
use crate::proto::jwe::Jwk;
use crate::proto::x509::cert_spki;
use crate::proto::x509::pem;
use crate::proto::x509::pem_decode_all;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyUsagePurpose, SanType, SerialNumber,
};
use serde::Serialize;
use std::path::{Path, PathBuf};
use time::OffsetDateTime;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CaKind {
    Node,
    Serving,
}

pub fn pki_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("pki")
}

fn ts(unix: i64) -> OffsetDateTime {
    OffsetDateTime::from_unix_timestamp(unix).expect("time in range")
}

fn ca_params(kind: CaKind, cfg: &Config) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, cfg.trust_domain.clone());
    dn.push(
        DnType::CommonName,
        match kind {
            CaKind::Node => format!("bca node CA {}", cfg.site_id),
            CaKind::Serving => format!("bca serving CA {}", cfg.site_id),
        },
    );
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p
}

fn random_serial() -> SerialNumber {
    let mut b = [0u8; 16];
    crypto::fill_random(&mut b);
    b[0] &= 0x7f;
    b[0] |= 0x01; // positive and of fixed length
    SerialNumber::from_slice(&b)
}

/// The rcgen issuer for a CA, rebuilt from its key.
pub fn issuer(
    kind: CaKind,
    cfg: &Config,
    key: &SigningKey,
) -> (rcgen::Certificate, rcgen::KeyPair) {
    let kp = key.rcgen();
    let cert = ca_params(kind, cfg)
        .self_signed(&kp)
        .expect("CA parameters are valid");
    (cert, kp)
}

/// DER of the certificates `init` creates.
pub struct Issued {
    pub node_ca: Vec<u8>,
    pub serving_ca: Vec<u8>,
    pub gateway: Vec<u8>,
    pub join_signing: Vec<u8>,
}

/// Creates the CA certificates, the gateway leaf for `sans` and the join-signing certificate.
pub fn create(cfg: &Config, keys: &KeyBundle, sans: &[String], now: i64) -> Result<Issued, String> {
    let years = cfg.pki.ca_validity_years as i64;
    let mut node = ca_params(CaKind::Node, cfg);
    node.not_before = ts(now - 3600);
    node.not_after = ts(now + years * 365 * 86_400);
    node.serial_number = Some(random_serial());
    let node_ca = node
        .self_signed(&keys.node_ca.rcgen())
        .map_err(|e| e.to_string())?;

    let mut serving = ca_params(CaKind::Serving, cfg);
    serving.not_before = ts(now - 3600);
    serving.not_after = ts(now + years * 365 * 86_400);
    serving.serial_number = Some(random_serial());
    let serving_ca = serving
        .self_signed(&keys.serving_ca.rcgen())
        .map_err(|e| e.to_string())?;

    let gateway = gateway_leaf(cfg, keys, sans, now)?;

    Ok(Issued {
        node_ca: node_ca.der().to_vec(),
        serving_ca: serving_ca.der().to_vec(),
        gateway,
        join_signing: join_signing_cert(cfg, &keys.join_signing, now)?,
    })
}

/// The self-signed certificate that carries the join-signing key (its SPKI is what agents pin).
pub fn join_signing_cert(cfg: &Config, key: &SigningKey, now: i64) -> Result<Vec<u8>, String> {
    let years = cfg.pki.ca_validity_years as i64;
    let mut js = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, cfg.trust_domain.clone());
    dn.push(
        DnType::CommonName,
        format!("bca join signing {}", cfg.site_id),
    );
    js.distinguished_name = dn;
    // No Basic Constraints on a leaf: `cA FALSE` is the default, which DER never encodes (X.690
    // 11.5; rcgen 0.13's `ExplicitNoCa` writes it, and strict parsers refuse that). rcgen writes
    // the extensions only when one of a few is set, key usage not among them: the authority key
    // identifier (its own key's, on a self-signed certificate) brings the key usage along.
    js.is_ca = IsCa::NoCa;
    js.use_authority_key_identifier_extension = true;
    js.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    js.not_before = ts(now - 3600);
    js.not_after = ts(now + years * 365 * 86_400);
    js.serial_number = Some(random_serial());
    let c = js.self_signed(&key.rcgen()).map_err(|e| e.to_string())?;
    Ok(c.der().to_vec())
}

/// A gateway leaf for `sans` (DNS names or IP addresses), signed by the serving CA.
pub fn gateway_leaf(
    cfg: &Config,
    keys: &KeyBundle,
    sans: &[String],
    now: i64,
) -> Result<Vec<u8>, String> {
    gateway_leaf_for(
        cfg,
        &keys.serving_ca,
        keys.gateway.public_point(),
        sans,
        now,
    )
}

/// A name of a gateway leaf: an IP address, else a DNS name.
pub fn gateway_san(s: &str) -> Result<SanType, String> {
    match s.parse::<std::net::IpAddr>() {
        Ok(ip) => Ok(SanType::IpAddress(ip)),
        Err(_) if is_dns_name(s) => s
            .to_string()
            .try_into()
            .map(SanType::DnsName)
            .map_err(|_| format!("{s:?} is neither a DNS name nor an IP address")),
        Err(_) => Err(format!("{s:?} is neither a DNS name nor an IP address")),
    }
}

/// Letters, digits and hyphens in dot-separated labels of 1 to 63 (none starting or ending with
/// a hyphen), at most 253 in all.
fn is_dns_name(s: &str) -> bool {
    // A last label of digits only reads as a (bad) IP address, not a host name.
    !s.is_empty()
        && !s
            .rsplit('.')
            .next()
            .unwrap_or_default()
            .bytes()
            .all(|c| c.is_ascii_digit())
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
        })
}

/// A gateway leaf for the P-256 point `subject` (another appliance's gateway key), signed by the
/// serving CA `serving_ca`.
pub fn gateway_leaf_for(
    cfg: &Config,
    serving_ca: &SigningKey,
    subject: &[u8],
    sans: &[String],
    now: i64,
) -> Result<Vec<u8>, String> {
    if sans.is_empty() {
        return Err("the gateway certificate needs at least one name".into());
    }
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, cfg.trust_domain.clone());
    dn.push(DnType::CommonName, sans[0].clone());
    p.distinguished_name = dn;
    p.subject_alt_names = sans
        .iter()
        .map(|s| gateway_san(s))
        .collect::<Result<_, _>>()?;
    p.is_ca = IsCa::NoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    p.use_authority_key_identifier_extension = true;
    p.not_before = ts(now - 3600);
    p.not_after = ts(now + cfg.pki.gateway_leaf_validity_days as i64 * 86_400);
    p.serial_number = Some(random_serial());
    let (ca, ca_key) = issuer(CaKind::Serving, cfg, serving_ca);
    let leaf = p
        .signed_by(&CsrKey(subject), &ca, &ca_key)
        .map_err(|e| e.to_string())?;
    Ok(leaf.der().to_vec())
}

/// A node certificate's contents, all decided by the JoinService.
pub struct NodeCertSpec<'a> {
    pub spiffe_id: &'a str,
    pub statements: &'a [String],
    pub role: &'a str,
    pub not_before: i64,
    pub not_after: i64,
    /// The uncompressed P-256 point the certificate certifies (from the verified CSR).
    pub public_point: &'a [u8],
}

struct CsrKey<'a>(&'a [u8]);

impl rcgen::PublicKeyData for CsrKey<'_> {
    fn der_bytes(&self) -> &[u8] {
        self.0
    }
    fn algorithm(&self) -> &rcgen::SignatureAlgorithm {
        &rcgen::PKCS_ECDSA_P256_SHA256
    }
}

/// Signs a node certificate: exactly one SPIFFE URI SAN first, then `urn:bc:` statements, one
/// subject attribute `OU=bc-role:<role>`, client-auth only, no private-arc OID. Returns (DER, serial hex).
pub fn issue_node_cert(
    spec: &NodeCertSpec<'_>,
    node_ca: &(rcgen::Certificate, rcgen::KeyPair),
) -> Result<(Vec<u8>, String), String> {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::OrganizationalUnitName,
        format!("bc-role:{}", spec.role),
    );
    p.distinguished_name = dn;
    let mut sans = vec![SanType::URI(
        spec.spiffe_id
            .to_string()
            .try_into()
            .map_err(|_| "bad SPIFFE id")?,
    )];
    for s in spec.statements {
        sans.push(SanType::URI(
            s.clone().try_into().map_err(|_| "bad statement")?,
        ));
    }
    p.subject_alt_names = sans;
    p.is_ca = IsCa::NoCa;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    p.use_authority_key_identifier_extension = true;
    p.not_before = ts(spec.not_before);
    p.not_after = ts(spec.not_after);
    let serial = random_serial();
    let serial_hex = crypto::hex(&serial.to_bytes());
    p.serial_number = Some(serial);
    let cert = p
        .signed_by(&CsrKey(spec.public_point), &node_ca.0, &node_ca.1)
        .map_err(|e| format!("signing the node certificate failed: {e}"))?;
    Ok((cert.der().to_vec(), serial_hex))
}

/// The three pins agents embed.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Pins {
    pub serving_ca: String,
    pub join_signing: String,
    pub join_encryption: String,
    /// During a rotation: the staged next join-signing key's pin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join_signing_next: Option<String>,
    /// During a rotation: the staged next join-encryption key's pin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub join_encryption_next: Option<String>,
}

/// The public half of the PKI as it lies in `<state>/pki/`.
pub struct PublicPki {
    pub node_ca: Vec<u8>,
    pub serving_ca: Vec<u8>,
    pub gateway: Vec<u8>,
    pub join_signing: Vec<u8>,
    pub join_encryption: Jwk,
    /// `join-signing.next.pem`: a rotation's staged certificate.
    pub join_signing_next: Option<Vec<u8>>,
    /// `join-encryption.next.jwk`: a rotation's staged key.
    pub join_encryption_next: Option<Jwk>,
    /// `join-encryption.previous.jwk`: the key a promotion replaced, accepted until its overlap ends.
    pub join_encryption_previous: Option<Jwk>,
}

impl PublicPki {
    pub fn write(dir: &Path, issued: &Issued, join_encryption_point: &[u8]) -> Result<(), String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let w = |name: &str, text: String| {
            crate::base::fsutil::write_new(&dir.join(name), text.as_bytes(), 0o644)
        };
        w("node-ca.pem", pem("CERTIFICATE", &issued.node_ca))?;
        w("serving-ca.pem", pem("CERTIFICATE", &issued.serving_ca))?;
        w(
            "gateway.pem",
            pem("CERTIFICATE", &issued.gateway) + &pem("CERTIFICATE", &issued.serving_ca),
        )?;
        w("join-signing.pem", pem("CERTIFICATE", &issued.join_signing))?;
        w(
            "join-encryption.jwk",
            serde_json::to_string_pretty(&jwk(join_encryption_point)).expect("serializes") + "\n",
        )
    }

    pub fn load(dir: &Path) -> Result<Self, String> {
        let one = |name: &str| -> Result<Vec<u8>, String> {
            let p = dir.join(name);
            let t = std::fs::read_to_string(&p)
                .map_err(|e| format!("cannot read {}: {e}", p.display()))?;
            pem_decode_all(&t, "CERTIFICATE")
                .into_iter()
                .next()
                .ok_or_else(|| format!("{} holds no certificate", p.display()))
        };
        let jwk_file = |name: &str| -> Result<Jwk, String> {
            let jp = dir.join(name);
            let jt = std::fs::read_to_string(&jp)
                .map_err(|e| format!("cannot read {}: {e}", jp.display()))?;
            serde_json::from_str(&jt).map_err(|e| format!("{}: {e}", jp.display()))
        };
        let optional = |name: &str| dir.join(name).exists();
        Ok(Self {
            node_ca: one("node-ca.pem")?,
            serving_ca: one("serving-ca.pem")?,
            gateway: one("gateway.pem")?,
            join_signing: one("join-signing.pem")?,
            join_encryption: jwk_file("join-encryption.jwk")?,
            join_signing_next: optional("join-signing.next.pem")
                .then(|| one("join-signing.next.pem"))
                .transpose()?,
            join_encryption_next: optional("join-encryption.next.jwk")
                .then(|| jwk_file("join-encryption.next.jwk"))
                .transpose()?,
            join_encryption_previous: optional("join-encryption.previous.jwk")
                .then(|| jwk_file("join-encryption.previous.jwk"))
                .transpose()?,
        })
    }

    pub fn pins(&self) -> Result<Pins, String> {
        Ok(Pins {
            serving_ca: crypto::spki_pin(&cert_spki(&self.serving_ca)?),
            join_signing: crypto::spki_pin(&cert_spki(&self.join_signing)?),
            join_encryption: jwk_pin(&self.join_encryption)
                .map_err(|e| format!("join-encryption.jwk: {e}"))?,
            join_signing_next: self
                .join_signing_next
                .as_ref()
                .map(|c| cert_spki(c).map(|s| crypto::spki_pin(&s)))
                .transpose()?,
            join_encryption_next: self
                .join_encryption_next
                .as_ref()
                .map(jwk_pin)
                .transpose()?,
        })
    }
}

/// Checks that the unsealed keys are the ones the certificates and the JWK name.
pub fn check_keys_against(pki: &PublicPki, keys: &KeyBundle) -> Result<(), String> {
    let pairs = [
        ("node CA", &pki.node_ca, &keys.node_ca),
        ("serving CA", &pki.serving_ca, &keys.serving_ca),
        ("gateway", &pki.gateway, &keys.gateway),
        ("join-signing", &pki.join_signing, &keys.join_signing),
    ];
    for (name, cert, key) in pairs {
        if crate::proto::x509::cert_spki(cert)? != key.spki_der() {
            return Err(format!("the {name} key does not match its certificate"));
        }
    }
    if pki.join_encryption.point().as_deref() != Some(keys.join_encryption.public_point()) {
        return Err("the join-encryption key does not match join-encryption.jwk".into());
    }
    Ok(())
}

/// How far a node certificate's `notBefore` is set back, for relying parties whose clocks lag:
/// a minute, or a tenth of a short lifetime (so 60% of the lifetime stays in the future).
pub fn backdate(ttl_seconds: i64) -> i64 {
    (ttl_seconds / 10).min(60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pem_round_trips() {
        let der = vec![1u8, 2, 3, 4, 5];
        let text = pem("CERTIFICATE", &der) + &pem("CERTIFICATE", &[9u8; 100]);
        let all = pem_decode_all(&text, "CERTIFICATE");
        assert_eq!(all, vec![der, vec![9u8; 100]]);
    }
}
