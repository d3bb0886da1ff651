//! The appliance's side of an agent's files: the configuration and join-encryption key an agent
//! of this site needs (`bca daemon agent-config`, the install script, the per-boot archive).

use crate::base::error::{ApiError, ApiResult};
use crate::pki;
use crate::proto::agent_config::write_agent_files;
use crate::proto::agent_config::AgentConfig;
use std::path::Path;

/// The agent configuration and the join-encryption JWK (JSON) for this appliance's site.
/// `gateway_urls`: the site's gateways, the first dialled first (at least one).
pub fn agent_config_for(
    state_dir: &Path,
    gateway_urls: &[String],
) -> ApiResult<(AgentConfig, String)> {
    let cfg = crate::config::Config::load(state_dir).map_err(ApiError::invalid_config)?;
    let public =
        pki::PublicPki::load(&pki::pki_dir(state_dir)).map_err(ApiError::invalid_config)?;
    let pins = public.pins().map_err(ApiError::invalid_config)?;
    let Some(gateway_url) = gateway_urls.first() else {
        return Err(ApiError::invalid_input("--gateway-url is required"));
    };
    for u in gateway_urls {
        if !crate::base::net::url_is_plain(u) || crate::base::net::host_port(u).is_none() {
            return Err(ApiError::invalid_input(format!(
                "--gateway-url {u:?} must be https://host[:port]"
            )));
        }
    }
    // During a join-encryption overlap the agent gets the next key: the appliance accepts it from
    // the moment it is staged, and it stays good after the promotion.
    let (enc_pin, enc_jwk) = match (&pins.join_encryption_next, &public.join_encryption_next) {
        (Some(p), Some(j)) => (p.clone(), j),
        _ => (pins.join_encryption, &public.join_encryption),
    };
    let agent = AgentConfig {
        gateway_url: gateway_url.to_string(),
        gateway_urls: gateway_urls[1..].to_vec(),
        site: cfg.site_id,
        serving_ca_spki_pin: pins.serving_ca,
        join_signing_key_pin: pins.join_signing,
        join_encryption_key_pin: enc_pin,
        server_name: None,
        join_signing_next_key_pin: pins.join_signing_next,
    };
    let jwk = serde_json::to_string_pretty(enc_jwk).expect("serializes") + "\n";
    Ok((agent, jwk))
}

/// `bca daemon agent-config`: the agent's `config.toml` (0600) and `join-encryption.jwk` (0644).
pub fn write_agent_config(state_dir: &Path, gateway_urls: &[String], out: &Path) -> ApiResult<()> {
    let (agent, jwk) = agent_config_for(state_dir, gateway_urls)?;
    write_agent_files(&agent, &jwk, out)
}
