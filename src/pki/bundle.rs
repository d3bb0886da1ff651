//! The key bundle: the appliance's private keys (node CA, serving CA, gateway, join-signing,
//! join-encryption, and a rotation's staged and previous keys), held together so that they are
//! loaded, sealed and checked as one. How they are sealed at rest is `keys`'s business.

use crate::base::crypto::{self, SigningKey};
use serde::{Deserialize, Serialize};
use zeroize::Zeroizing;

pub struct KeyBundle {
    pub node_ca: SigningKey,
    pub serving_ca: SigningKey,
    pub gateway: SigningKey,
    pub join_signing: SigningKey,
    pub join_encryption: SigningKey,
    /// A rotation's staged next join-signing key (see `rotation`).
    pub join_signing_next: Option<SigningKey>,
    /// A rotation's staged next join-encryption key.
    pub join_encryption_next: Option<SigningKey>,
    /// The join-encryption key a promotion replaced, still accepted until its overlap ends.
    pub join_encryption_previous: Option<SigningKey>,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct BundleFile {
    version: u32,
    node_ca: String,
    serving_ca: String,
    /// Absent in the site's keys wrapped to another appliance (each has its own gateway key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    gateway: Option<String>,
    join_signing: String,
    join_encryption: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    join_signing_next: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    join_encryption_next: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    join_encryption_previous: Option<String>,
}

impl KeyBundle {
    pub fn generate() -> Self {
        Self {
            node_ca: SigningKey::generate(),
            serving_ca: SigningKey::generate(),
            gateway: SigningKey::generate(),
            join_signing: SigningKey::generate(),
            join_encryption: SigningKey::generate(),
            join_signing_next: None,
            join_encryption_next: None,
            join_encryption_previous: None,
        }
    }

    pub(crate) fn to_json(&self) -> Zeroizing<Vec<u8>> {
        self.json(true)
    }

    /// The site's keys without this appliance's gateway key: what is wrapped to another
    /// appliance of the site (`appliance::members`).
    pub(crate) fn site_json(&self) -> Zeroizing<Vec<u8>> {
        self.json(false)
    }

    fn json(&self, with_gateway: bool) -> Zeroizing<Vec<u8>> {
        let f = BundleFile {
            version: 1,
            node_ca: crypto::b64(self.node_ca.pkcs8()),
            serving_ca: crypto::b64(self.serving_ca.pkcs8()),
            gateway: with_gateway.then(|| crypto::b64(self.gateway.pkcs8())),
            join_signing: crypto::b64(self.join_signing.pkcs8()),
            join_encryption: crypto::b64(self.join_encryption.pkcs8()),
            join_signing_next: self
                .join_signing_next
                .as_ref()
                .map(|k| crypto::b64(k.pkcs8())),
            join_encryption_next: self
                .join_encryption_next
                .as_ref()
                .map(|k| crypto::b64(k.pkcs8())),
            join_encryption_previous: self
                .join_encryption_previous
                .as_ref()
                .map(|k| crypto::b64(k.pkcs8())),
        };
        // Serialized into a buffer large enough up front: a growing Vec would free copies of the
        // keys without wiping them.
        let mut out = Zeroizing::new(Vec::with_capacity(16 * 1024));
        serde_json::to_writer_pretty(&mut *out, &f).expect("serializes");
        f.zeroize_strings();
        out
    }

    pub(crate) fn from_json(bytes: &[u8]) -> Result<Self, String> {
        Self::parse(bytes, None)
    }

    /// The site's keys [`Self::site_json`] wrote, with this appliance's own gateway key.
    pub(crate) fn from_site_json(bytes: &[u8], gateway: SigningKey) -> Result<Self, String> {
        Self::parse(bytes, Some(gateway))
    }

    fn parse(bytes: &[u8], own_gateway: Option<SigningKey>) -> Result<Self, String> {
        let f: BundleFile =
            serde_json::from_slice(bytes).map_err(|e| format!("the key file is damaged: {e}"))?;
        if f.version != 1 {
            return Err(format!(
                "the key file has version {}, this bca reads version 1",
                f.version
            ));
        }
        let one = |name: &str, s: &str| -> Result<SigningKey, String> {
            let der = Zeroizing::new(
                crypto::b64_decode(s).ok_or_else(|| format!("the {name} key is not base64"))?,
            );
            SigningKey::from_pkcs8(&der).map_err(|e| format!("the {name} key: {e}"))
        };
        let k = Self {
            node_ca: one("node CA", &f.node_ca)?,
            serving_ca: one("serving CA", &f.serving_ca)?,
            gateway: match (own_gateway, &f.gateway) {
                (Some(k), None) => k,
                (None, Some(g)) => one("gateway", g)?,
                (Some(_), Some(_)) => return Err("the site's keys carry a gateway key".into()),
                (None, None) => return Err("the key file has no gateway key".into()),
            },
            join_signing: one("join-signing", &f.join_signing)?,
            join_encryption: one("join-encryption", &f.join_encryption)?,
            join_signing_next: f
                .join_signing_next
                .as_deref()
                .map(|s| one("next join-signing", s))
                .transpose()?,
            join_encryption_next: f
                .join_encryption_next
                .as_deref()
                .map(|s| one("next join-encryption", s))
                .transpose()?,
            join_encryption_previous: f
                .join_encryption_previous
                .as_deref()
                .map(|s| one("previous join-encryption", s))
                .transpose()?,
        };
        f.zeroize_strings();
        Ok(k)
    }
}

impl BundleFile {
    /// Wipes the base64 copies of the keys.
    fn zeroize_strings(self) {
        let BundleFile {
            node_ca,
            serving_ca,
            gateway,
            join_signing,
            join_encryption,
            join_signing_next,
            join_encryption_next,
            join_encryption_previous,
            ..
        } = self;
        for s in [node_ca, serving_ca, join_signing, join_encryption]
            .into_iter()
            .chain(gateway)
            .chain(join_signing_next)
            .chain(join_encryption_next)
            .chain(join_encryption_previous)
        {
            drop(Zeroizing::new(s));
        }
    }
}
