//! What a new appliance's state directory starts with, shared by `bca init` and `bca join-site`:
//! its `config.toml`, its appliance id (`appliance.id`), whether a directory is one already, and
//! the TPM arguments both take.

use crate::base::error::{ApiError, ApiResult};
use crate::config::{Config, JoinConfig, KeyProtection, PkiConfig};
use std::path::{Path, PathBuf};

/// Whether `dir` holds an appliance already (a config, a database or keys): `init` and `join-site`
/// refuse it.
pub fn is_initialised(dir: &Path) -> bool {
    dir.join("config.toml").exists() || dir.join("bca.db").exists() || dir.join("keys").exists()
}

/// What one appliance's `config.toml` says of the box itself (the rest is the site's, or the
/// defaults an operator edits).
pub struct BoxParts {
    pub gateway_url: Option<String>,
    pub key_protection: KeyProtection,
    pub tpm: Option<String>,
    pub listen_http: Option<String>,
    pub listen_gateway: Option<String>,
    pub store: crate::config::StoreConfig,
}

/// A new appliance's configuration for the site `(id, name, trust domain)`: `bca init` and
/// `bca join-site`.
pub fn site_config((site_id, site_name, trust_domain): (&str, &str, &str), b: &BoxParts) -> Config {
    Config {
        trust_domain: trust_domain.to_string(),
        site_id: site_id.to_string(),
        site_name: site_name.to_string(),
        gateway_url: b.gateway_url.clone(),
        gateway_server_name: None,
        key_protection: b.key_protection,
        tpm: b.tpm.clone(),
        listen_http: b.listen_http.clone().unwrap_or_else(|| "0.0.0.0:80".into()),
        listen_gateway: b
            .listen_gateway
            .clone()
            .unwrap_or_else(|| "0.0.0.0:443".into()),
        admin_socket: None,
        admin_group: None,
        pki: PkiConfig::default(),
        join: JoinConfig::default(),
        sessions: Default::default(),
        discovery: Default::default(),
        tpm_attestor: Default::default(),
        x509pop: Default::default(),
        boot: Default::default(),
        retention: Default::default(),
        health: Default::default(),
        privsep: Default::default(),
        store: b.store.clone(),
    }
}

fn id_path(state_dir: &Path) -> PathBuf {
    state_dir.join("appliance.id")
}

/// This state directory's appliance id (`appliance.id`), made on first use by an appliance that
/// holds the site's keys itself (the one `bca init` made).
pub fn own_id(state_dir: &Path) -> Result<String, String> {
    let p = id_path(state_dir);
    match std::fs::read_to_string(&p) {
        Ok(s) => {
            let id = s.trim().to_string();
            if !crate::base::ids::is_id(&id, "appl", 26) {
                return Err(format!("{} does not hold an appliance id", p.display()));
            }
            Ok(id)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let id = crate::base::ids::new_id("appl", crate::base::clock::now() * 1000);
            crate::base::fsutil::write_new_private(&p, format!("{id}\n").as_bytes())?;
            Ok(id)
        }
        Err(e) => Err(format!("cannot read {}: {e}", p.display())),
    }
}

/// Writes `appliance.id` (a new state directory's).
pub fn write_id(state_dir: &Path, id: &str) -> Result<(), String> {
    crate::base::fsutil::write_new_private(&id_path(state_dir), format!("{id}\n").as_bytes())
}

/// `--tpm-pcrs` (none when absent); `bca join-site` reads it the same way.
pub fn pcrs_arg(list: Option<&str>) -> ApiResult<Vec<u32>> {
    list.map(crate::tpm::parse_pcrs)
        .transpose()
        .map(Option::unwrap_or_default)
        .map_err(|e| ApiError::invalid_input(format!("--tpm-pcrs: {e}")))
}

/// `--tpm` (the default TPM when absent); `bca join-site` reads it the same way.
pub fn tcti_arg(tpm: Option<&str>) -> ApiResult<crate::tpm::Tcti> {
    tpm.unwrap_or(crate::tpm::DEFAULT_TCTI)
        .parse()
        .map_err(|e: String| ApiError::invalid_input(format!("--tpm: {e}")))
}
