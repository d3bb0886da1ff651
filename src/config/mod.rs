//! `config.toml` in the state directory: every key documented here and in `docs/config.md`.

use crate::base::net::url_host;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

mod boot;
mod retention;
pub use boot::BootConfig;
pub use retention::RetentionConfig;

/// How the appliance's private keys are protected at rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KeyProtection {
    /// Sealed under a passphrase (`BCA_SECRET` or a prompt): Argon2id, then AES-256-GCM.
    Passphrase,
    /// Plain 0600 files; for development only, with a warning on every start.
    File,
    /// Sealed to the box's TPM (not available yet).
    Tpm,
}

impl KeyProtection {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "passphrase" => Some(Self::Passphrase),
            "file" => Some(Self::File),
            "tpm" => Some(Self::Tpm),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The SPIFFE trust domain of every node certificate.
    pub trust_domain: String,
    /// This appliance's site id (`site_…`), fixed at init.
    pub site_id: String,
    /// The site's name, as given to `bca init --site`.
    pub site_name: String,
    /// The gateway URL agents dial, published in the well-known document's `gateway` section.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_url: Option<String>,
    /// The name agents expect on the gateway's certificate (default: the URL's host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway_server_name: Option<String>,
    /// `passphrase`, `file` or `tpm`.
    pub key_protection: KeyProtection,
    /// The TPM the keys are sealed to (`key_protection = "tpm"`), as `bca init --tpm` named it
    /// (`device:/dev/tpmrm0` when absent); `bca serve --tpm` overrides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<String>,
    /// The HTTP listener (well-known document; boot files later).
    #[serde(default = "default_http")]
    pub listen_http: String,
    /// The gateway's TLS listener.
    #[serde(default = "default_gateway")]
    pub listen_gateway: String,
    /// The admin socket; empty means `<state-dir>/admin.sock`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_socket: Option<PathBuf>,
    /// A group id whose members may use the admin socket (the socket is then 0660 in that group).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_group: Option<u32>,
    #[serde(default)]
    pub pki: PkiConfig,
    #[serde(default)]
    pub join: JoinConfig,
    #[serde(default)]
    pub sessions: SessionsConfig,
    #[serde(default)]
    pub discovery: DiscoveryConfig,
    #[serde(default)]
    pub tpm_attestor: TpmAttestorConfig,
    #[serde(default)]
    pub x509pop: X509PopConfig,
    #[serde(default)]
    pub boot: BootConfig,
    #[serde(default)]
    pub retention: RetentionConfig,
    #[serde(default)]
    pub health: HealthConfig,
    #[serde(default)]
    pub privsep: PrivsepConfig,
    #[serde(default, skip_serializing_if = "StoreConfig::is_embedded")]
    pub store: StoreConfig,
}

/// `[store]`: where the site's state lives. Absent: the embedded SQLite file `bca.db` in the
/// state directory. With `url`: a PostgreSQL database (`postgres://USER@HOST[:PORT]/DB`, never
/// with a password), its password read from `password_file` (0600) at each start.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct StoreConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_file: Option<PathBuf>,
}

impl StoreConfig {
    pub fn is_embedded(&self) -> bool {
        self.url.is_none()
    }

    /// The URL and the password file, as `store::Store::open_at` takes them.
    pub fn at(&self) -> (Option<&str>, Option<&std::path::Path>) {
        (self.url.as_deref(), self.password_file.as_deref())
    }
}

/// The `x509pop` attestor: a node whose certificate expired while it was offline comes back by
/// proving the key of its last certificate (docs/x509pop.md).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct X509PopConfig {
    /// Off by default: an expired certificate then has no way back but a new join.
    #[serde(default)]
    pub enabled: bool,
    /// How long after its certificate expired a node may still come back (at most 7 days).
    #[serde(default = "default_x509pop_window")]
    pub max_expired_seconds: u32,
}

fn default_x509pop_window() -> u32 {
    7 * 86_400
}

impl Default for X509PopConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            max_expired_seconds: default_x509pop_window(),
        }
    }
}

/// Privilege separation (`privsep`): the gateway's TLS and frames are parsed in a child
/// process that holds no private key and cannot open a file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrivsepConfig {
    /// Off only to measure what the boundary costs, or on a kernel that can confine nothing (the
    /// child refuses to run unconfined).
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// The user the child runs as when `serve` starts as root (under the packaged unit, which
    /// starts as `bca`, the child keeps that user and Landlock takes away every file).
    #[serde(default = "default_privsep_user")]
    pub user: String,
}

fn default_true() -> bool {
    true
}
fn default_privsep_user() -> String {
    "nobody".into()
}

impl Default for PrivsepConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            user: default_privsep_user(),
        }
    }
}

/// Who may read `/metrics` and the full `/healthz` report on the HTTP listener.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct HealthConfig {
    /// Serve them to every peer (a Prometheus scraper on the network). Off: loopback only; others
    /// get `/healthz`'s status alone and no `/metrics`.
    #[serde(default)]
    pub metrics_public: bool,
}

/// The `discovery` attestor: machines that PXE-boot the discovery ramdisk.
/// The `tpm` attestor: machines that join with their TPM and no token.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TpmAttestorConfig {
    /// `true` (the default): a TPM whose EK is on no allow-list is recorded as a join request for
    /// an operator (the seed's `enrollment`); `false`: it is refused (`tpm:ek-unknown`).
    #[serde(default = "default_true")]
    pub enrollment: bool,
    /// Lifetime of a node certificate from a `tpm` join (at most `[pki] cert_ttl_seconds`;
    /// ramdisk certificates at most 7200).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cert_ttl_seconds: Option<u32>,
    /// A PEM bundle of the CAs trusted to issue EK certificates (an absolute path): a TPM whose
    /// EK certificate one of them issued is admitted into `ek_ca_pool` with no allow-list entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_ca_bundle: Option<String>,
    /// The pool (id) a TPM certified by the bundle joins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_ca_pool: Option<String>,
}

impl Default for TpmAttestorConfig {
    fn default() -> Self {
        Self {
            enrollment: true,
            cert_ttl_seconds: None,
            ek_ca_bundle: None,
            ek_ca_pool: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// `always` (the default): every discovered machine waits for an operator;
    /// `unknown-machines`: a machine whose trusted hardware key is a live `ramdisk` node's (or one
    /// marked for rediscovery) is admitted at once as that node, but only when the network saw it
    /// boot with that node's MAC and the node's identifiers were never the machine's word alone
    /// (docs/config.md says what that does and does not stop).
    #[serde(default = "default_approval")]
    pub approval: String,
    /// How long a join request waits for a decision, and how long a discovery token lives.
    #[serde(default = "default_pending_ttl")]
    pub pending_ttl_seconds: u32,
    /// Lifetime of a ramdisk certificate (at most 7200).
    #[serde(default = "default_ramdisk_ttl")]
    pub cert_ttl_seconds: u32,
    /// What the deferral tells the machine: retry after this many seconds.
    #[serde(default = "default_retry")]
    pub retry_after_seconds: u32,
}

fn default_approval() -> String {
    "always".into()
}
fn default_pending_ttl() -> u32 {
    86_400
}
fn default_ramdisk_ttl() -> u32 {
    7_200
}
fn default_retry() -> u32 {
    30
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            approval: default_approval(),
            pending_ttl_seconds: default_pending_ttl(),
            cert_ttl_seconds: default_ramdisk_ttl(),
            retry_after_seconds: default_retry(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SessionsConfig {
    /// How often agents send a heartbeat; a session silent for three of these is closed.
    #[serde(default = "default_heartbeat")]
    pub heartbeat_seconds: u32,
    /// Gateway connections at once (joins and sessions); each needs a file descriptor, so the
    /// process's open-file limit must be higher (the unit sets 65536).
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    /// Gateway connections at once from one source address (a rack's machines each have their
    /// own; a NAT in front of many needs more).
    #[serde(default = "default_per_source")]
    pub max_connections_per_source: u32,
    /// Joins per minute from one source address; more are answered `UNAVAILABLE` (retry later),
    /// the same answer as a full queue. 0: no limit.
    #[serde(default = "default_joins_per_source")]
    pub joins_per_source_per_minute: u32,
    /// A new connection must finish its TLS handshake and send its first request within this.
    #[serde(default = "default_request_deadline")]
    pub request_deadline_seconds: u32,
    /// New connections in their TLS handshake and first request at once. When all are taken the
    /// gateway stops accepting: further connections wait in the kernel's queue and are served in
    /// arrival order, instead of every handshake slowing down together past the request deadline
    /// (a restart under 20,000 sessions). See docs/config.md.
    #[serde(default = "default_max_handshakes")]
    pub max_handshakes: u32,
}

fn default_max_connections() -> u32 {
    32_768
}
fn default_per_source() -> u32 {
    256
}
fn default_joins_per_source() -> u32 {
    600
}
fn default_request_deadline() -> u32 {
    10
}
fn default_max_handshakes() -> u32 {
    4096
}

fn default_heartbeat() -> u32 {
    15
}

impl Default for SessionsConfig {
    fn default() -> Self {
        Self {
            heartbeat_seconds: default_heartbeat(),
            max_connections: default_max_connections(),
            max_connections_per_source: default_per_source(),
            joins_per_source_per_minute: default_joins_per_source(),
            request_deadline_seconds: default_request_deadline(),
            max_handshakes: default_max_handshakes(),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PkiConfig {
    /// Lifetime of the node CA and the serving CA, in years.
    #[serde(default = "default_ca_years")]
    pub ca_validity_years: u32,
    /// Lifetime of the gateway's TLS leaf, in days.
    #[serde(default = "default_gateway_days")]
    pub gateway_leaf_validity_days: u32,
    /// Lifetime of a node certificate, in seconds (at most 86,400).
    #[serde(default = "default_cert_ttl")]
    pub cert_ttl_seconds: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JoinConfig {
    /// How far a sealed token's `iat` may be from the appliance's clock, in seconds (both ways).
    #[serde(default = "default_seal_window")]
    pub seal_max_skew_seconds: u32,
}

fn default_http() -> String {
    "0.0.0.0:80".into()
}
fn default_gateway() -> String {
    "0.0.0.0:443".into()
}
fn default_ca_years() -> u32 {
    10
}
fn default_gateway_days() -> u32 {
    90
}
fn default_cert_ttl() -> u32 {
    86_400
}
fn default_seal_window() -> u32 {
    300
}

impl Default for PkiConfig {
    fn default() -> Self {
        Self {
            ca_validity_years: default_ca_years(),
            gateway_leaf_validity_days: default_gateway_days(),
            cert_ttl_seconds: default_cert_ttl(),
        }
    }
}

impl Default for JoinConfig {
    fn default() -> Self {
        Self {
            seal_max_skew_seconds: default_seal_window(),
        }
    }
}

impl Config {
    /// `config.toml` as bca writes it.
    pub fn to_file_text(&self) -> Result<String, String> {
        Ok(format!(
            "# bca configuration; every key is described in docs/config.md\n{}",
            toml::to_string_pretty(self).map_err(|e| e.to_string())?
        ))
    }

    pub fn load(state_dir: &Path) -> Result<Self, String> {
        let p = state_dir.join("config.toml");
        let text = std::fs::read_to_string(&p).map_err(|e| {
            format!(
                "cannot read {}: {e} (is this an initialised state directory? run bca init)",
                p.display()
            )
        })?;
        let c: Config = toml::from_str(&text).map_err(|e| format!("{}: {e}", p.display()))?;
        c.validate().map_err(|e| format!("{}: {e}", p.display()))?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<(), String> {
        if !(10..=86_400).contains(&self.pki.cert_ttl_seconds) {
            return Err("pki.cert_ttl_seconds must be 10 to 86400".into());
        }
        if self.pki.ca_validity_years == 0 || self.pki.ca_validity_years > 50 {
            return Err("pki.ca_validity_years must be 1 to 50".into());
        }
        if self.pki.gateway_leaf_validity_days == 0 || self.pki.gateway_leaf_validity_days > 825 {
            return Err("pki.gateway_leaf_validity_days must be 1 to 825".into());
        }
        self.boot.validate()?;
        if self.discovery.approval != "unknown-machines" && self.discovery.approval != "always" {
            return Err("discovery.approval must be unknown-machines or always".into());
        }
        if !(60..=7 * 86_400).contains(&self.discovery.pending_ttl_seconds) {
            return Err("discovery.pending_ttl_seconds must be 60 to 604800".into());
        }
        if !(10..=7_200).contains(&self.discovery.cert_ttl_seconds) {
            return Err("discovery.cert_ttl_seconds must be 10 to 7200".into());
        }
        if !(1..=600).contains(&self.discovery.retry_after_seconds) {
            return Err("discovery.retry_after_seconds must be 1 to 600".into());
        }
        match (&self.tpm_attestor.ek_ca_bundle, &self.tpm_attestor.ek_ca_pool) {
            (Some(b), Some(_)) if !b.starts_with('/') => {
                return Err("tpm_attestor.ek_ca_bundle must be an absolute path".into())
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err(
                    "tpm_attestor.ek_ca_bundle and tpm_attestor.ek_ca_pool go together: the bundle says which TPMs, the pool where they join"
                        .into(),
                )
            }
            _ => {}
        }
        if let Some(t) = self.tpm_attestor.cert_ttl_seconds {
            if !(10..=86_400).contains(&t) {
                return Err("tpm_attestor.cert_ttl_seconds must be 10 to 86400".into());
            }
        }
        if !(1..=1_000_000).contains(&self.sessions.max_connections_per_source) {
            return Err("sessions.max_connections_per_source must be 1 to 1000000".into());
        }
        if !(1..=60).contains(&self.sessions.request_deadline_seconds) {
            return Err("sessions.request_deadline_seconds must be 1 to 60".into());
        }
        if !(16..=1_000_000).contains(&self.sessions.max_connections) {
            return Err("sessions.max_connections must be 16 to 1000000".into());
        }
        if !(1..=65_536).contains(&self.sessions.max_handshakes) {
            return Err("sessions.max_handshakes must be 1 to 65536".into());
        }
        if !(1..=300).contains(&self.sessions.heartbeat_seconds) {
            return Err("sessions.heartbeat_seconds must be 1 to 300".into());
        }
        if !(1..=7 * 86_400).contains(&self.x509pop.max_expired_seconds) {
            return Err("x509pop.max_expired_seconds must be 1 to 604800".into());
        }
        self.retention.validate()?;
        if !(30..=900).contains(&self.join.seal_max_skew_seconds) {
            return Err("join.seal_max_skew_seconds must be 30 to 900".into());
        }
        Ok(())
    }

    pub fn admin_socket_path(&self, state_dir: &Path) -> PathBuf {
        self.admin_socket
            .clone()
            .unwrap_or_else(|| state_dir.join("admin.sock"))
    }

    /// The name agents verify on the gateway's certificate.
    pub fn gateway_name(&self) -> Option<String> {
        self.gateway_server_name
            .clone()
            .or_else(|| self.gateway_url.as_deref().and_then(url_host))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_hosts() {
        assert_eq!(
            url_host("https://gw.example.com:8443/x").as_deref(),
            Some("gw.example.com")
        );
        assert_eq!(url_host("https://127.0.0.1").as_deref(), Some("127.0.0.1"));
        assert_eq!(url_host("https://[::1]:443").as_deref(), Some("::1"));
        assert_eq!(url_host("http://gw"), None);
        assert_eq!(url_host("https://"), None);
    }
}
