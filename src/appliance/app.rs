//! The running appliance: what `serve` loads once and every listener shares.

use crate::config::Config;
use crate::join::site::Site;
use crate::pki::bundle::KeyBundle;
use crate::pki::check_keys_against;
use crate::pki::PublicPki;
use crate::proto::protocol::BASE_PATH;
use crate::proto::protocol::PROTOCOL_MAX;
use crate::proto::protocol::PROTOCOL_MIN;
use crate::store::Store;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Arc;

/// The serving appliance: the [`Site`] (what the JoinService sees) plus what serving adds. It
/// dereferences to its site, so `app.config` and `app.store` read as before.
pub struct App {
    pub site: Arc<Site>,
    /// The document served at `GET /api/compute/.well-known/better-compute`.
    pub well_known: std::sync::RwLock<Value>,
    /// The message handle to the JoinService, once it runs (the boot server mints discovery
    /// tokens through it).
    pub join: std::sync::OnceLock<crate::join::service::JoinHandle>,
    /// The gateway's swappable certificate (set when the gateway starts).
    pub gateway_cert: std::sync::OnceLock<Arc<crate::edge::gateway::GatewayCert>>,
    /// Full DHCP mode: the leases and the pending offers, in memory (loaded on first use).
    pub dhcp: std::sync::Mutex<Option<crate::appliance::leases::DhcpState>>,
    /// DHCP sightings, `boot.ipxe` rates and the per-boot archives waiting to be fetched once
    /// (each holds a discovery token: wiped when dropped).
    pub boot_gate: std::sync::Mutex<crate::edge::boot::gate::Gate>,
}

impl std::ops::Deref for App {
    type Target = Site;
    fn deref(&self) -> &Site {
        &self.site
    }
}

impl App {
    /// Loads the config, the store and the public PKI of an initialised state directory.
    pub fn load(state_dir: &Path) -> Result<Self, String> {
        let config = Config::load(state_dir)?;
        let db = state_dir.join("bca.db");
        if config.store.is_embedded() && !db.exists() {
            return Err(format!(
                "{} is missing: the state directory is incomplete",
                db.display()
            ));
        }
        let store = Arc::new(Store::open_at(state_dir, config.store.at(), false)?);
        let root_tenant = crate::store::maintenance::root_tenant(&store)
            .map_err(|e| format!("the database has no root tenant: {e}"))?;
        let pki = PublicPki::load(&crate::pki::pki_dir(state_dir))?;
        let well_known = well_known(&config, &pki)?;
        Ok(Self {
            site: Arc::new(Site {
                state_dir: state_dir.to_path_buf(),
                config,
                store,
                root_tenant,
                pki,
                sessions: Default::default(),
            }),
            well_known: std::sync::RwLock::new(well_known),
            join: Default::default(),
            gateway_cert: Default::default(),
            dhcp: Default::default(),
            boot_gate: Default::default(),
        })
    }

    /// Checks that the unsealed keys are the ones the public PKI names.
    pub fn check_keys(&self, keys: &KeyBundle) -> Result<(), String> {
        check_keys_against(&self.pki, keys)
            .map_err(|e| format!("{e} (in {})", self.state_dir.display()))
    }
}

pub fn well_known(config: &Config, pki: &PublicPki) -> Result<Value, String> {
    let pins = pki.pins()?;
    let mut doc = json!({
        "name": "better-compute",
        "version": env!("CARGO_PKG_VERSION"),
        "basePath": BASE_PATH,
        "protocol": {"min": PROTOCOL_MIN, "max": PROTOCOL_MAX},
        "join": {
            "encryptionJwk": pki.join_encryption,
            "encryptionKeyPin": pins.join_encryption,
            "signingCertificate": crate::base::crypto::b64(&pki.join_signing),
            "signingKeyPin": pins.join_signing,
        },
    });
    // A rotation publishes the next keys and pins before they become current.
    if let (Some(cert), Some(pin)) = (&pki.join_signing_next, &pins.join_signing_next) {
        doc["join"]["nextSigningCertificate"] = json!(crate::base::crypto::b64(cert));
        doc["join"]["nextSigningKeyPin"] = json!(pin);
    }
    if let (Some(jwk), Some(pin)) = (&pki.join_encryption_next, &pins.join_encryption_next) {
        doc["join"]["nextEncryptionJwk"] = json!(jwk);
        doc["join"]["nextEncryptionKeyPin"] = json!(pin);
    }
    if let Some(url) = &config.gateway_url {
        doc["gateway"] = json!({
            "url": url,
            "serverName": config.gateway_name(),
            "servingCaPin": pins.serving_ca,
        });
    }
    Ok(doc)
}
