//! X.509 and PEM as both sides read them: PEM blocks, a certificate's key, validity and SANs, a
//! node certificate's identity and statements (the TPM AK statement among them).

use crate::base::crypto;

pub fn pem(label: &str, der: &[u8]) -> String {
    let b = crypto::b64(der);
    let mut s = format!("-----BEGIN {label}-----\n");
    for chunk in b.as_bytes().chunks(64) {
        s.push_str(std::str::from_utf8(chunk).expect("base64 is ASCII"));
        s.push('\n');
    }
    s.push_str(&format!("-----END {label}-----\n"));
    s
}

/// The DER blocks of every `label` block in a PEM text.
pub fn pem_decode_all(text: &str, label: &str) -> Vec<Vec<u8>> {
    let begin = format!("-----BEGIN {label}-----");
    let end = format!("-----END {label}-----");
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(&begin) {
        let after = &rest[i + begin.len()..];
        let Some(j) = after.find(&end) else { break };
        let body: String = after[..j].chars().filter(|c| !c.is_whitespace()).collect();
        if let Some(der) = crypto::b64_decode(&body) {
            out.push(der);
        }
        rest = &after[j + end.len()..];
    }
    out
}

/// The SubjectPublicKeyInfo DER of a certificate.
pub fn cert_spki(der: &[u8]) -> Result<Vec<u8>, String> {
    use x509_parser::prelude::*;
    let (_, c) = X509Certificate::from_der(der).map_err(|e| format!("not a certificate: {e}"))?;
    Ok(c.public_key().raw.to_vec())
}

/// A certificate's (notBefore, notAfter), in Unix seconds.
/// Whether `der` is one certificate (nothing after it) signed (ECDSA P-256 with SHA-256) by the
/// key whose P-256 point is `issuer`.
pub fn signed_by(der: &[u8], issuer: &[u8]) -> bool {
    let Ok((rest, c)) = x509_parser::parse_x509_certificate(der) else {
        return false;
    };
    if !rest.is_empty() {
        return false;
    }
    // ecdsa-with-SHA256
    c.signature_algorithm.algorithm.to_id_string() == "1.2.840.10045.4.3.2"
        && crate::base::crypto::verify_x509(
            issuer,
            c.tbs_certificate.as_ref(),
            &c.signature_value.data,
        )
}

pub fn validity(der: &[u8]) -> Option<(i64, i64)> {
    use x509_parser::prelude::*;
    let (_, c) = X509Certificate::from_der(der).ok()?;
    Some((
        c.validity().not_before.timestamp(),
        c.validity().not_after.timestamp(),
    ))
}

/// A certificate's notAfter, in Unix seconds.
pub fn not_after(der: &[u8]) -> Option<i64> {
    use x509_parser::prelude::*;
    let (_, c) = X509Certificate::from_der(der).ok()?;
    Some(c.validity().not_after.timestamp())
}

/// The DNS names and IP addresses of a certificate's subjectAltName (to renew the gateway leaf
/// for the same names).
pub fn cert_sans(der: &[u8]) -> Result<Vec<String>, String> {
    use x509_parser::extensions::GeneralName;
    use x509_parser::prelude::*;
    let (_, c) = X509Certificate::from_der(der).map_err(|e| format!("not a certificate: {e}"))?;
    let mut out = Vec::new();
    if let Ok(Some(san)) = c.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                GeneralName::DNSName(d) => out.push(d.to_string()),
                GeneralName::IPAddress(b) if b.len() == 4 => out.push(
                    std::net::Ipv4Addr::from(<[u8; 4]>::try_from(*b).expect("4")).to_string(),
                ),
                GeneralName::IPAddress(b) if b.len() == 16 => out.push(
                    std::net::Ipv6Addr::from(<[u8; 16]>::try_from(*b).expect("16")).to_string(),
                ),
                _ => {}
            }
        }
    }
    Ok(out)
}

/// The URI SANs of a certificate, in order (`None` without a SAN extension).
pub fn uri_sans<'a>(c: &'a x509_parser::certificate::X509Certificate<'_>) -> Option<Vec<&'a str>> {
    use x509_parser::extensions::GeneralName;
    let san = c.subject_alternative_name().ok()??;
    Some(
        san.value
            .general_names
            .iter()
            .filter_map(|g| {
                if let GeneralName::URI(u) = g {
                    Some(*u)
                } else {
                    None
                }
            })
            .collect(),
    )
}

/// Parses a node certificate: its SPIFFE ID (`…/node/<id>`), serial, key and statements.
pub fn parse_node_leaf(der: &[u8]) -> Option<NodeLeaf> {
    use x509_parser::prelude::*;
    let (rest, c) = X509Certificate::from_der(der).ok()?;
    if !rest.is_empty() {
        return None;
    }
    let uris = uri_sans(&c)?;
    let spiffe = uris.first().filter(|u| u.starts_with("spiffe://"))?;
    let node_id = spiffe.rsplit_once("/node/")?.1.to_string();
    let point = crypto::p256_point_from_spki(c.public_key().raw)?.to_vec();
    Some(NodeLeaf {
        spiffe_id: spiffe.to_string(),
        node_id,
        serial_hex: crypto::hex(c.raw_serial()),
        public_point: point,
        statements: uris[1..]
            .iter()
            .filter(|u| u.starts_with("urn:bc:"))
            .map(|u| u.to_string())
            .collect(),
        not_after: c.validity().not_after.timestamp(),
    })
}

/// What the JoinService reads back from a node certificate it issued.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeLeaf {
    pub spiffe_id: String,
    pub node_id: String,
    pub serial_hex: String,
    pub public_point: Vec<u8>,
    /// `urn:bc:` statements, in order.
    pub statements: Vec<String>,
    pub not_after: i64,
}

/// `urn:bc:tpm-ak:<nameAlg>:<digest>` for an AK Name (`000b` and a SHA-256 digest).
pub fn ak_statement(ak_name: &[u8]) -> String {
    format!("urn:bc:tpm-ak:sha256:{}", crypto::hex(&ak_name[2..]))
}

/// The AK Name a statement names, when it is one.
pub fn statement_ak_name(statement: &str) -> Option<Vec<u8>> {
    let hex = statement.strip_prefix("urn:bc:tpm-ak:sha256:")?;
    let digest = crypto::hex_decode(hex).filter(|d| d.len() == 32)?;
    Some([&[0x00, 0x0b][..], &digest].concat())
}
