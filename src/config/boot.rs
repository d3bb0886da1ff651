//! `[boot]`: the boot server (DHCP, TFTP, the HTTP side), its rates and its limits.

use serde::{Deserialize, Serialize};
use std::net::Ipv4Addr;
use std::path::PathBuf;

/// The `[boot]` section of `config.toml`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BootConfig {
    /// Serve DHCP and TFTP (the HTTP side is always on).
    #[serde(default)]
    pub enabled: bool,
    /// `proxy` (coexist with the site's DHCP server) or `dhcp` (a full server with a range).
    #[serde(default = "default_mode")]
    pub mode: String,
    /// The provisioning network's interface: DHCP and TFTP bind to it (`SO_BINDTODEVICE`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<String>,
    /// The address machines reach this appliance at on the provisioning network.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_ip: Option<Ipv4Addr>,
    /// The URL iPXE fetches scripts and files from (default `http://<server_ip>:<listen_http port>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_url: Option<String>,
    #[serde(default = "default_dhcp")]
    pub listen_dhcp: String,
    #[serde(default = "default_proxy")]
    pub listen_proxy: String,
    #[serde(default = "default_tftp")]
    pub listen_tftp: String,
    /// The boot files: `undionly.kpxe`, `ipxe.efi`, `snponly.efi`, `vmlinuz`, `initrd.img`
    /// (default `<state-dir>/boot`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range_start: Option<Ipv4Addr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range_end: Option<Ipv4Addr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netmask: Option<Ipv4Addr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<Ipv4Addr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns: Vec<Ipv4Addr>,
    #[serde(default = "default_lease")]
    pub lease_seconds: u32,
    /// The discovery kernel's command line.
    #[serde(default = "default_args")]
    pub kernel_args: String,
    /// TFTP transfers at once; more are refused with a log line.
    #[serde(default = "default_transfers")]
    pub tftp_max_transfers: usize,
    /// TFTP transfers at once from one source address (a machine fetches one file at a time).
    #[serde(default = "default_per_source")]
    pub tftp_max_per_source: usize,
    /// How long a DHCP sighting (a MAC seen at an address) vouches for that MAC's boot script.
    #[serde(default = "default_sighting")]
    pub sighting_seconds: u32,
    /// DHCP relays (`giaddr` and source address both listed) whose relayed packets count as
    /// sightings; without them only a limited broadcast on the boot interface does.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub relays: Vec<Ipv4Addr>,
    /// Mint discovery tokens only for a MAC the boot server's DHCP saw at the asking address.
    /// `false` lets anyone who reaches the HTTP listener mint for any MAC (docs/config.md).
    #[serde(default = "default_true")]
    pub require_sighting: bool,
    /// `boot.ipxe` requests per minute from one source (an IPv6 /64 counts as one).
    #[serde(default = "default_scripts_per_source")]
    pub scripts_per_source_per_minute: u32,
    /// `boot.ipxe` requests per minute for one MAC.
    #[serde(default = "default_scripts_per_mac")]
    pub scripts_per_mac_per_minute: u32,
    /// Per-boot archives waiting to be fetched from one source; the source's oldest gives way.
    #[serde(default = "default_archives_per_source")]
    pub archives_per_source: usize,
    /// Per-boot archives waiting in all; when full, the busiest source's oldest gives way.
    #[serde(default = "default_max_archives")]
    pub max_waiting_archives: usize,
}

fn default_true() -> bool {
    true
}
fn default_sighting() -> u32 {
    300
}
fn default_scripts_per_source() -> u32 {
    120
}
fn default_scripts_per_mac() -> u32 {
    12
}
fn default_archives_per_source() -> usize {
    16
}
fn default_max_archives() -> usize {
    4096
}

fn default_per_source() -> usize {
    16
}

fn default_mode() -> String {
    "proxy".into()
}
fn default_dhcp() -> String {
    "0.0.0.0:67".into()
}
fn default_proxy() -> String {
    "0.0.0.0:4011".into()
}
fn default_tftp() -> String {
    "0.0.0.0:69".into()
}
fn default_lease() -> u32 {
    3600
}
fn default_args() -> String {
    "console=ttyS0 quiet".into()
}
fn default_transfers() -> usize {
    256
}

impl Default for BootConfig {
    fn default() -> Self {
        toml::from_str("").expect("defaults")
    }
}

impl BootConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.mode != "proxy" && self.mode != "dhcp" {
            return Err("boot.mode must be proxy or dhcp".into());
        }
        if self.enabled && self.server_ip.is_none() {
            return Err("boot.server_ip is required when boot.enabled".into());
        }
        if self.enabled
            && self.mode == "dhcp"
            && (self.range_start.is_none() || self.range_end.is_none())
        {
            return Err("boot.mode = \"dhcp\" needs boot.range_start and boot.range_end".into());
        }
        if let (Some(a), Some(b)) = (self.range_start, self.range_end) {
            if u32::from(a) > u32::from(b) || u32::from(b) - u32::from(a) > 65_535 {
                return Err("boot.range_start must not be after boot.range_end, and the range at most 65536 addresses".into());
            }
        }
        if self.kernel_args.contains(['\n', '\r']) {
            return Err("boot.kernel_args must be one line".into());
        }
        if !(1..=4096).contains(&self.tftp_max_per_source) {
            return Err("boot.tftp_max_per_source must be 1 to 4096".into());
        }
        if !(1..=4096).contains(&self.tftp_max_transfers) {
            return Err("boot.tftp_max_transfers must be 1 to 4096".into());
        }
        if !(10..=86_400).contains(&self.sighting_seconds) {
            return Err("boot.sighting_seconds must be 10 to 86400".into());
        }
        if let Some(r) = self
            .relays
            .iter()
            .find(|r| r.is_unspecified() || r.is_broadcast())
        {
            return Err(format!(
                "boot.relays: {r} is not a relay's address (0.0.0.0 and 255.255.255.255 are not)"
            ));
        }
        for (name, v) in [
            (
                "scripts_per_source_per_minute",
                self.scripts_per_source_per_minute as usize,
            ),
            (
                "scripts_per_mac_per_minute",
                self.scripts_per_mac_per_minute as usize,
            ),
            ("archives_per_source", self.archives_per_source),
        ] {
            if !(1..=100_000).contains(&v) {
                return Err(format!("boot.{name} must be 1 to 100000"));
            }
        }
        if !(16..=65_536).contains(&self.max_waiting_archives) {
            return Err("boot.max_waiting_archives must be 16 to 65536".into());
        }
        Ok(())
    }
}
