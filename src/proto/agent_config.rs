//! The contract of an agent's files: its `config.toml` as the seed's install script writes it, and
//! how a pair of agent files is written (never over existing ones).

use crate::base::crypto;
use crate::base::error::{ApiError, ApiResult};
use crate::proto::jwe::Jwk;
use serde::{Deserialize, Serialize};
use std::path::Path;

/// The agent's `config.toml`, as the seed's install script writes it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AgentConfig {
    /// The gateway the agent dials first.
    pub gateway_url: String,
    /// The site's other gateways (each appliance's), tried in turn when one cannot be reached
    /// (`agent join` and `agent run` fail over to the next); the old single `gateway_url` alone
    /// is still a whole configuration.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gateway_urls: Vec<String>,
    pub site: String,
    pub serving_ca_spki_pin: String,
    pub join_signing_key_pin: String,
    pub join_encryption_key_pin: String,
    /// The name to verify on the gateway's certificate (default: the URL's host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_name: Option<String>,
    /// During a join-signing rotation: the next key's pin, accepted as well as the current one.
    /// Written by `bca daemon agent-config` during the overlap, or learned from a renewal's
    /// signed answer; becomes the current pin when the appliance signs with it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_signing_next_key_pin: Option<String>,
}

impl AgentConfig {
    pub fn load(path: &Path) -> ApiResult<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ApiError::invalid_config(format!("cannot read {}: {e}", path.display()))
        })?;
        let c: AgentConfig = toml::from_str(&text)
            .map_err(|e| ApiError::invalid_config(format!("{}: {e}", path.display())))?;
        for (k, v) in [
            ("serving_ca_spki_pin", Some(&c.serving_ca_spki_pin)),
            ("join_signing_key_pin", Some(&c.join_signing_key_pin)),
            ("join_encryption_key_pin", Some(&c.join_encryption_key_pin)),
            (
                "join_signing_next_key_pin",
                c.join_signing_next_key_pin.as_ref(),
            ),
        ] {
            let Some(v) = v else { continue };
            let ok = v
                .strip_prefix("sha256/")
                .and_then(crypto::b64_decode)
                .is_some_and(|h| h.len() == 32);
            if !ok {
                return Err(ApiError::invalid_config(format!(
                    "{}: {k} must be sha256/<base64 of 32 bytes>",
                    path.display()
                )));
            }
        }
        if let Some(bad) = c
            .gateways()
            .into_iter()
            .find(|u| crate::base::net::host_port(u).is_none())
        {
            return Err(ApiError::invalid_config(format!(
                "{}: gateway {bad:?} must be https://host[:port]",
                path.display()
            )));
        }
        Ok(c)
    }

    /// Every gateway, in the order they are tried: `gateway_url`, then `gateway_urls` (each once).
    pub fn gateways(&self) -> Vec<&str> {
        let mut out: Vec<&str> = vec![self.gateway_url.as_str()];
        for u in &self.gateway_urls {
            if !out.contains(&u.as_str()) {
                out.push(u);
            }
        }
        out
    }

    /// The join-encryption key beside the config, used only when its SPKI hash equals the pin.
    pub fn join_encryption_point(&self, config_path: &Path) -> ApiResult<Vec<u8>> {
        let p = config_path.with_file_name("join-encryption.jwk");
        let text = std::fs::read_to_string(&p).map_err(|e| {
            ApiError::invalid_config(format!(
                "cannot read {}: {e} (run bca daemon agent-config again)",
                p.display()
            ))
        })?;
        let jwk: Jwk = serde_json::from_str(&text)
            .map_err(|e| ApiError::invalid_config(format!("{}: {e}", p.display())))?;
        let point = jwk.point().ok_or_else(|| {
            ApiError::invalid_config(format!("{} is not a P-256 key", p.display()))
        })?;
        if crypto::spki_pin(&crypto::p256_spki_from_point(&point)) != self.join_encryption_key_pin {
            return Err(ApiError::invalid_config(format!(
                "{} does not match join_encryption_key_pin; the key was rotated or the file replaced: write the agent config again",
                p.display()
            )));
        }
        Ok(point)
    }
}

/// Writes an agent's two files into `out`, never over existing ones.
pub fn write_agent_files(agent: &AgentConfig, jwk: &str, out: &Path) -> ApiResult<()> {
    // A folder it creates is the owner's alone, whatever the umask (it holds the agent's config,
    // and becomes its data directory too in `bca dev`'s lines); an existing one keeps its mode.
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(out)
        .map_err(|e| ApiError::invalid_state(format!("cannot create {}: {e}", out.display())))?;
    let cfg_path = out.join("config.toml");
    let jwk_path = out.join("join-encryption.jwk");
    for p in [&cfg_path, &jwk_path] {
        if p.exists() {
            return Err(ApiError::already_exists(format!(
                "{} exists; it was not written over",
                p.display()
            )));
        }
    }
    let text = format!(
        "# bca agent configuration\n{}",
        toml::to_string(agent).expect("serializes")
    );
    crate::base::fsutil::write_new(&cfg_path, text.as_bytes(), 0o600)
        .map_err(ApiError::already_exists)?;
    crate::base::fsutil::write_new(&jwk_path, jwk.as_bytes(), 0o644)
        .map_err(ApiError::already_exists)?;
    Ok(())
}
