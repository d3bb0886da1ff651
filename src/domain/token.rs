//! Join tokens: the `expect` binding, the token record, and the bearer form `bcjt_<id>.<secret>`.

use crate::base::clock::rfc3339;
use crate::base::error::{ApiError, ApiResult};
use crate::proto::claims::{normalize_gpu, normalize_mac, normalize_uuid, Identifiers};
use crate::{base::crypto, base::ids, domain::validate};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

/// A token's `expect` binding: every identifier named must be among the machine's claims.
#[derive(Deserialize, Serialize, Default, Clone, PartialEq, Eq, Debug)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Expect {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product_uuid: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mac: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_uuid: Option<String>,
}

impl Expect {
    pub fn validate(&self) -> ApiResult<()> {
        if let Some(v) = &self.product_uuid {
            validate::product_uuid("expect.productUuid", v)?;
        }
        if let Some(v) = &self.serial {
            validate::serial("expect.serial", v)?;
        }
        if let Some(v) = &self.mac {
            validate::mac("expect.mac", v)?;
        }
        if let Some(v) = &self.gpu_uuid {
            validate::gpu_uuid("expect.gpuUuid", v)?;
        }
        if *self == Expect::default() {
            return Err(ApiError::invalid_input(
                "expect must name at least one identifier (productUuid, serial, mac or gpuUuid)",
            ));
        }
        Ok(())
    }
}

/// A join-token row.
#[derive(Debug, Clone)]
pub struct TokenRow {
    pub id: String,
    pub tenant_id: String,
    pub pool_id: String,
    pub site_id: String,
    pub role: String,
    pub secret_sha256: Vec<u8>,
    pub max_uses: i64,
    pub uses_left: i64,
    pub expect: Option<Expect>,
    pub allow_reclaim: bool,
    pub hosted: Option<String>,
    pub created_at: i64,
    pub expires_at: i64,
    pub revoked_at: Option<i64>,
    /// A `provisioned` token's node: the only node it brings back.
    pub node_id: Option<String>,
}

impl TokenRow {
    /// The record the API returns; never the secret or its hash.
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "id": self.id, "tenantId": self.tenant_id, "poolId": self.pool_id, "siteId": self.site_id,
            "role": self.role, "maxUses": self.max_uses, "usesLeft": self.uses_left,
            "allowReclaim": self.allow_reclaim, "createdAt": rfc3339(self.created_at),
            "expiresAt": rfc3339(self.expires_at),
        });
        if let Some(e) = &self.expect {
            v["expect"] = json!(e);
        }
        if let Some(h) = &self.hosted {
            v["hosted"] = json!(h);
        }
        if let Some(n) = &self.node_id {
            v["nodeId"] = json!(n);
        }
        if let Some(r) = self.revoked_at {
            v["revokedAt"] = json!(rfc3339(r));
        }
        v
    }
}

/// A bearer token `bcjt_<id>.<secret>`: 256 random bits, base64url without padding.
pub struct Bearer {
    pub id: String,
    pub secret: zeroize::Zeroizing<[u8; 32]>,
}

impl Bearer {
    /// Parses the bearer form strictly. The secret is returned only to be hashed.
    pub fn parse(s: &str) -> Option<Self> {
        let rest = s.strip_prefix("bcjt_")?;
        let (id, secret) = rest.split_once('.')?;
        if !ids::is_id(id, "jt", 52) || secret.len() != 43 {
            return None;
        }
        let raw = zeroize::Zeroizing::new(crypto::b64url_decode(secret)?);
        let arr: [u8; 32] = raw.as_slice().try_into().ok()?;
        // Refuse non-canonical encodings (trailing bits set), so one secret has one spelling.
        if crypto::b64url(&arr) != secret {
            return None;
        }
        Some(Self {
            id: id.to_string(),
            secret: zeroize::Zeroizing::new(arr),
        })
    }

    pub fn render(&self) -> zeroize::Zeroizing<String> {
        zeroize::Zeroizing::new(format!(
            "bcjt_{}.{}",
            self.id,
            crypto::b64url(self.secret.as_ref())
        ))
    }
}

/// Whether the claims satisfy a token's `expect` binding: every identifier named must be among
/// the machine's surviving identifiers.
pub fn expect_matches(e: &Expect, ids: &Identifiers) -> bool {
    if let Some(u) = &e.product_uuid {
        match (normalize_uuid(u), &ids.product_uuid) {
            (Some(want), Some(have)) if want == *have => {}
            _ => return false,
        }
    }
    if let Some(s) = &e.serial {
        let want = s.trim().to_ascii_uppercase();
        if !ids.serials.contains(&want) {
            return false;
        }
    }
    if let Some(m) = &e.mac {
        match normalize_mac(m) {
            Some(want) if ids.macs.contains(&want) => {}
            _ => return false,
        }
    }
    if let Some(g) = &e.gpu_uuid {
        match normalize_gpu(g) {
            Some(want) if ids.gpu_uuids.contains(&want) => {}
            _ => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::claims::Claims;

    #[test]
    fn expect_rules() {
        let c: Claims = serde_json::from_str(
            r#"{"productUuid":"4C4C4544-004D-3610-804A-B4C04F564433","serials":{"product":"SN-1","board":"BRD-9","chassis":"CH-3"},
            "macs":["00-1B-21-3A-4F-5E","02:00:00:00:00:09"],"gpuUuids":["GPU-ABCDEF01-2345"]}"#,
        )
        .unwrap();
        let ids = Identifiers::from_claims(&c);
        let e = |j: &str| -> Expect { serde_json::from_str(j).unwrap() };
        assert!(expect_matches(
            &e(r#"{"productUuid":"4c4c4544004d3610804ab4c04f564433"}"#),
            &ids
        ));
        assert!(expect_matches(&e(r#"{"serial":"brd-9"}"#), &ids));
        assert!(expect_matches(&e(r#"{"serial":"ch-3"}"#), &ids));
        assert!(expect_matches(&e(r#"{"mac":"00:1b:21:3a:4f:5e"}"#), &ids));
        assert!(!expect_matches(&e(r#"{"mac":"02:00:00:00:00:09"}"#), &ids)); // not globally administered
        assert!(expect_matches(
            &e(r#"{"gpuUuid":"GPU-abcdef01-2345"}"#),
            &ids
        ));
        assert!(!expect_matches(&e(r#"{"serial":"SN-2"}"#), &ids));
        assert!(!expect_matches(
            &e(r#"{"serial":"SN-1","mac":"00:1b:21:3a:4f:5f"}"#),
            &ids
        ));
        let placeholder = Identifiers::from_claims(
            &serde_json::from_str(r#"{"productUuid":"00000000-0000-0000-0000-000000000000"}"#)
                .unwrap(),
        );
        assert!(!expect_matches(
            &e(r#"{"productUuid":"00000000-0000-0000-0000-000000000000"}"#),
            &placeholder
        ));
    }

    #[test]
    fn bearer_parses_only_the_canonical_form() {
        let b = Bearer {
            id: crate::base::ids::new_id("jt", 1),
            secret: zeroize::Zeroizing::new([7u8; 32]),
        };
        let s = b.render();
        let back = Bearer::parse(&s).unwrap();
        assert_eq!(back.id, b.id);
        assert_eq!(*back.secret, [7u8; 32]);
        assert!(Bearer::parse(&s[1..]).is_none());
        assert!(Bearer::parse(&format!("{}x", s.as_str())).is_none());
        assert!(Bearer::parse(&s.replace('.', "_")).is_none());
        assert!(Bearer::parse("bcjt_jt_x.y").is_none());
    }
}
