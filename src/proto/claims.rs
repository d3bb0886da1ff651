//! A machine's hardware claims, their normalisation, the placeholder filter and the hardware key.
//! Pure functions; the derivation is written down in `docs/hardware-key.md`.

use crate::base::crypto;
use serde::{Deserialize, Serialize};

/// The claims an agent sends, exactly the shape `--claims FILE` takes. Any field may be absent.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Claims {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product_uuid: Option<String>,
    #[serde(default)]
    pub serials: Serials,
    #[serde(default)]
    pub macs: Vec<String>,
    #[serde(default)]
    pub gpu_uuids: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hostname: Option<String>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Serials {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub board: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chassis: Option<String>,
}

/// Limits on what a peer may claim.
pub const MAX_FIELD: usize = 128;
pub const MAX_LIST: usize = 64;

impl Claims {
    /// Refuses claims too large to be a machine's, or carrying a control character (which could
    /// rewrite an operator's terminal: `text`); the join answers such a request as refused.
    pub fn within_limits(&self) -> bool {
        let clean = [
            &self.product_uuid,
            &self.serials.product,
            &self.serials.board,
            &self.serials.chassis,
            &self.hostname,
        ]
        .into_iter()
        .flatten()
        .chain(&self.macs)
        .chain(&self.gpu_uuids)
        .all(|v| !crate::base::text::has_control(v));
        let s = |v: &Option<String>| v.as_ref().is_none_or(|x| x.len() <= MAX_FIELD);
        clean
            && s(&self.product_uuid)
            && s(&self.serials.product)
            && s(&self.serials.board)
            && s(&self.serials.chassis)
            && self.hostname.as_ref().is_none_or(|h| h.len() <= 253)
            && self.macs.len() <= MAX_LIST
            && self.gpu_uuids.len() <= MAX_LIST
            && self.macs.iter().all(|m| m.len() <= MAX_FIELD)
            && self.gpu_uuids.iter().all(|g| g.len() <= MAX_FIELD)
    }
}

/// Placeholder strings firmware reports instead of identifiers (compared case-insensitively).
const PLACEHOLDERS: &[&str] = &[
    "to be filled by o.e.m.",
    "to be filled by oem",
    "default string",
    "system serial number",
    "system product name",
    "chassis serial number",
    "base board serial number",
    "not specified",
    "not applicable",
    "not available",
    "none",
    "n/a",
    "na",
    "null",
    "unknown",
    "invalid",
    "empty",
    "o.e.m.",
    "oem",
    "serial",
    "0123456789",
    "123456789",
    "1234567890",
    "03000200-0400-0500-0006-000700080009",
];

/// True for values that identify no machine: listed placeholders, empty, one repeated character.
pub fn is_placeholder(v: &str) -> bool {
    let t = v.trim();
    if t.is_empty() {
        return true;
    }
    let lower = t.to_ascii_lowercase();
    if PLACEHOLDERS.contains(&lower.as_str()) {
        return true;
    }
    let significant: Vec<char> = lower.chars().filter(|c| *c != '-' && *c != ' ').collect();
    significant
        .first()
        .is_none_or(|c0| significant.iter().all(|c| c == c0))
}

/// A product UUID in canonical form (lower case, dashed 8-4-4-4-12), unless it is a placeholder.
pub fn normalize_uuid(v: &str) -> Option<String> {
    let hex: String = v
        .trim()
        .chars()
        .filter(|c| *c != '-')
        .collect::<String>()
        .to_ascii_lowercase();
    if hex.len() != 32 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let dashed = format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    );
    if is_placeholder(&dashed) {
        return None;
    }
    Some(dashed)
}

/// A serial in canonical form (trimmed, upper case), unless it is a placeholder.
pub fn normalize_serial(v: &str) -> Option<String> {
    let t = v.trim();
    if is_placeholder(t) || t.len() > MAX_FIELD {
        return None;
    }
    Some(t.to_ascii_uppercase())
}

/// A MAC with any separators (`:`, `-`, `.`, none) and any case, as `aa:bb:cc:dd:ee:ff`, only
/// when it is a globally administered unicast address (not locally administered, not multicast,
/// not all zeros).
pub fn normalize_mac(v: &str) -> Option<String> {
    let hex: String = v
        .trim()
        .chars()
        .filter(|c| !matches!(c, ':' | '-' | '.'))
        .collect();
    if hex.len() != 12 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let bytes: Vec<u8> = (0..6)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex"))
        .collect();
    if bytes[0] & 0x03 != 0 || bytes.iter().all(|b| *b == 0) {
        return None;
    }
    Some(
        bytes
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":"),
    )
}

/// A GPU UUID (`GPU-…`) in canonical form (lower case after the prefix), unless a placeholder.
pub fn normalize_gpu(v: &str) -> Option<String> {
    let t = v.trim();
    let rest = t
        .get(..4)
        .filter(|p| p.eq_ignore_ascii_case("gpu-"))
        .map(|_| &t[4..])?;
    if rest.len() < 8
        || !rest.bytes().all(|c| c.is_ascii_hexdigit() || c == b'-')
        || is_placeholder(rest)
    {
        return None;
    }
    Some(format!("GPU-{}", rest.to_ascii_lowercase()))
}

/// The identifiers that survived normalisation and the placeholder filter.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Identifiers {
    pub product_uuid: Option<String>,
    /// Distinct serials, sorted (a board serial equal to the product serial counts once).
    pub serials: Vec<String>,
    pub macs: Vec<String>,
    pub gpu_uuids: Vec<String>,
}

impl Identifiers {
    pub fn from_claims(c: &Claims) -> Self {
        let mut serials: Vec<String> = [&c.serials.product, &c.serials.board, &c.serials.chassis]
            .into_iter()
            .flatten()
            .filter_map(|s| normalize_serial(s))
            .collect();
        serials.sort();
        serials.dedup();
        let mut macs: Vec<String> = c.macs.iter().filter_map(|m| normalize_mac(m)).collect();
        macs.sort();
        macs.dedup();
        let mut gpus: Vec<String> = c
            .gpu_uuids
            .iter()
            .filter_map(|g| normalize_gpu(g))
            .collect();
        gpus.sort();
        gpus.dedup();
        Self {
            product_uuid: c.product_uuid.as_deref().and_then(normalize_uuid),
            serials,
            macs,
            gpu_uuids: gpus,
        }
    }

    pub fn count(&self) -> usize {
        self.product_uuid.iter().count()
            + self.serials.len()
            + self.macs.len()
            + self.gpu_uuids.len()
    }

    /// Whether a product UUID or a serial survived.
    pub fn has_primary(&self) -> bool {
        self.product_uuid.is_some() || !self.serials.is_empty()
    }
}

/// The machine's hardware key: hex SHA-256 over its primary identifiers (product UUID and
/// serials) when any survived, else over its MACs and GPU UUIDs; trusted with two or more
/// identifiers in all.
#[derive(Debug, Clone, PartialEq)]
pub struct HardwareKey {
    pub hex: String,
    pub trusted: bool,
}

pub fn hardware_key(ids: &Identifiers) -> Option<HardwareKey> {
    let mut material: Vec<String> = Vec::new();
    if ids.has_primary() {
        if let Some(u) = &ids.product_uuid {
            material.push(format!("uuid={u}"));
        }
        material.extend(ids.serials.iter().map(|s| format!("serial={s}")));
    } else {
        material.extend(ids.macs.iter().map(|m| format!("mac={m}")));
        material.extend(ids.gpu_uuids.iter().map(|g| format!("gpu={g}")));
    }
    if material.is_empty() {
        return None;
    }
    let text = format!("bca hardware key v1\n{}", material.join("\n"));
    Some(HardwareKey {
        hex: crypto::hex(&crypto::sha256(text.as_bytes())),
        trusted: ids.count() >= 2,
    })
}

/// A MAC with any separators and case as `aa:bb:cc:dd:ee:ff` (any address: the boot MAC of a VM
/// may be locally administered).
pub fn loose_mac(v: &str) -> Option<String> {
    let hex: String = v
        .trim()
        .chars()
        .filter(|c| !matches!(c, ':' | '-' | '.'))
        .collect::<String>()
        .to_ascii_lowercase();
    if hex.len() != 12 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    Some(
        (0..6)
            .map(|i| &hex[2 * i..2 * i + 2])
            .collect::<Vec<_>>()
            .join(":"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(json: &str) -> Claims {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn placeholders_are_dropped() {
        for p in [
            "To Be Filled By O.E.M.",
            "Default string",
            "System Serial Number",
            "",
            "  ",
            "0000000",
            "XXXXXXXX",
            "n/a",
        ] {
            assert!(normalize_serial(p).is_none(), "{p:?}");
        }
        assert!(normalize_uuid("00000000-0000-0000-0000-000000000000").is_none());
        assert!(normalize_uuid("FFFFFFFF-FFFF-FFFF-FFFF-FFFFFFFFFFFF").is_none());
        assert!(normalize_uuid("03000200-0400-0500-0006-000700080009").is_none());
        assert_eq!(
            normalize_uuid("4C4C4544004D3610804AB4C04F564433").as_deref(),
            Some("4c4c4544-004d-3610-804a-b4c04f564433")
        );
        assert_eq!(normalize_serial(" sn-7701 ").as_deref(), Some("SN-7701"));
    }

    #[test]
    fn macs_normalise_and_only_global_unicast_survive() {
        assert_eq!(normalize_mac("AA-BB-CC-DD-EE-FF").as_deref(), None); // 0xaa is locally administered
        assert_eq!(
            normalize_mac("00-1B-21-3A-4F-5E").as_deref(),
            Some("00:1b:21:3a:4f:5e")
        );
        assert_eq!(
            normalize_mac("001b.213a.4f5e").as_deref(),
            Some("00:1b:21:3a:4f:5e")
        );
        assert_eq!(
            normalize_mac("001B213A4F5E").as_deref(),
            Some("00:1b:21:3a:4f:5e")
        );
        assert_eq!(normalize_mac("01:00:5e:00:00:01"), None); // multicast
        assert_eq!(normalize_mac("02:00:00:00:00:01"), None); // locally administered
        assert_eq!(normalize_mac("00:00:00:00:00:00"), None);
        assert_eq!(normalize_mac("00:1b:21:3a:4f"), None);
    }

    #[test]
    fn the_key_is_stable_and_ignores_added_nics_and_gpus() {
        let a = claims(
            r#"{"productUuid":"4C4C4544-004D-3610-804A-B4C04F564433","serials":{"product":"SN-1"},"macs":["00:1b:21:3a:4f:5e"]}"#,
        );
        let mut b = a.clone();
        b.macs.push("00:1b:21:3a:4f:5f".into());
        b.gpu_uuids.push("GPU-12345678-aaaa".into());
        b.product_uuid = Some("4c4c4544004d3610804ab4c04f564433".into());
        b.serials.product = Some("sn-1".into());
        let ka = hardware_key(&Identifiers::from_claims(&a)).unwrap();
        let kb = hardware_key(&Identifiers::from_claims(&b)).unwrap();
        assert_eq!(ka, kb);
        assert!(ka.trusted);
    }

    #[test]
    fn trust_needs_two_identifiers() {
        let one =
            claims(r#"{"serials":{"product":"SN-1","board":"SN-1","chassis":"Default string"}}"#);
        let k = hardware_key(&Identifiers::from_claims(&one)).unwrap();
        assert!(!k.trusted);
        let none = claims(
            r#"{"productUuid":"00000000-0000-0000-0000-000000000000","serials":{"product":"To Be Filled By O.E.M."}}"#,
        );
        assert!(hardware_key(&Identifiers::from_claims(&none)).is_none());
        let macs = claims(r#"{"macs":["00:1b:21:3a:4f:5e","00:1b:21:3a:4f:5f"]}"#);
        let ids = Identifiers::from_claims(&macs);
        assert!(!ids.has_primary());
        assert!(hardware_key(&ids).unwrap().trusted);
    }

    #[test]
    fn limits() {
        let mut c = Claims::default();
        assert!(c.within_limits());
        c.macs = vec!["00:1b:21:3a:4f:5e".into(); 65];
        assert!(!c.within_limits());
    }
}
