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
    /// TFTP's address, or `"off"`: no TFTP at all (an HTTP-boot-only network: UEFI HTTP boot
    /// and iPXE are answered, PXE clients that need TFTP get no boot file).
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
    /// The chain x64 UEFI clients get: `ipxe` (iPXE, unsigned: Secure Boot refuses it) or `shim`
    /// (Debian's signed shim, then signed network GRUB with a per-machine `grub.cfg`, then the
    /// signed kernel: boots with Secure Boot enforced). BIOS clients always get iPXE.
    #[serde(default = "default_uefi_chain")]
    pub uefi_chain: String,
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
    /// Full DHCP mode: provisioning networks behind a DHCP relay (`[[boot.subnets]]`), each
    /// with the relay's address (the `giaddr` its packets carry, listed in `relays`) and its range.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subnets: Vec<BootSubnet>,
}

/// A provisioning network behind a DHCP relay: full DHCP mode leases from `range_start` to
/// `range_end` to the machines whose packets the relay at `relay` forwards, and answers the relay.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BootSubnet {
    /// The relay's address on that network (the `giaddr` of the packets it forwards).
    pub relay: Ipv4Addr,
    pub range_start: Ipv4Addr,
    pub range_end: Ipv4Addr,
    pub netmask: Ipv4Addr,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub router: Option<Ipv4Addr>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dns: Vec<Ipv4Addr>,
}

/// Where full DHCP mode leases a client's address from, and what it tells the client.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AddressPool<'a> {
    pub range: (Ipv4Addr, Ipv4Addr),
    pub netmask: Option<Ipv4Addr>,
    pub router: Option<Ipv4Addr>,
    pub dns: &'a [Ipv4Addr],
}

impl BootConfig {
    /// The pool of a client: the boot interface's own range for a packet no relay forwarded
    /// (`relay` `None`), else the `[[boot.subnets]]` entry of that relay; `None` when there is
    /// none.
    pub fn pool_for(&self, relay: Option<Ipv4Addr>) -> Option<AddressPool<'_>> {
        match relay {
            None => Some(AddressPool {
                range: (self.range_start?, self.range_end?),
                netmask: self.netmask,
                router: self.router,
                dns: &self.dns,
            }),
            Some(r) => self
                .subnets
                .iter()
                .find(|s| s.relay == r)
                .map(|s| AddressPool {
                    range: (s.range_start, s.range_end),
                    netmask: Some(s.netmask),
                    router: s.router,
                    dns: &s.dns,
                }),
        }
    }
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
fn default_uefi_chain() -> String {
    "ipxe".into()
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
    /// Whether x64 UEFI clients get the signed chain (`uefi_chain = "shim"`).
    pub fn uefi_shim(&self) -> bool {
        self.uefi_chain == "shim"
    }

    /// Whether TFTP is served (`listen_tftp` is not `"off"`).
    pub fn tftp_on(&self) -> bool {
        self.listen_tftp != "off"
    }

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
            && self.subnets.is_empty()
        {
            return Err("boot.mode = \"dhcp\" needs boot.range_start and boot.range_end (or [[boot.subnets]])".into());
        }
        if let (Some(a), Some(b)) = (self.range_start, self.range_end) {
            if u32::from(a) > u32::from(b) || u32::from(b) - u32::from(a) > 65_535 {
                return Err("boot.range_start must not be after boot.range_end, and the range at most 65536 addresses".into());
            }
        }
        if self.uefi_chain != "ipxe" && self.uefi_chain != "shim" {
            return Err(format!(
                "boot.uefi_chain must be \"ipxe\" or \"shim\", not {:?}",
                self.uefi_chain
            ));
        }
        if self.uefi_shim() && !self.tftp_on() {
            return Err(
                "boot.uefi_chain = \"shim\" hands shim out over TFTP: boot.listen_tftp cannot be \"off\""
                    .into(),
            );
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
        self.validate_subnets()
    }

    fn validate_subnets(&self) -> Result<(), String> {
        let mut ranges: Vec<(u32, u32, String)> = Vec::new();
        if let (Some(a), Some(b)) = (self.range_start, self.range_end) {
            ranges.push((
                u32::from(a),
                u32::from(b),
                "boot.range_start..range_end".into(),
            ));
        }
        for s in &self.subnets {
            let name = format!("boot.subnets (relay {})", s.relay);
            if !self.relays.contains(&s.relay) {
                return Err(format!(
                    "{name}: the relay must be listed in boot.relays (its packets are trusted only then)"
                ));
            }
            let mask = u32::from(s.netmask);
            if mask.leading_ones() + mask.trailing_zeros() != 32 || mask == 0 {
                return Err(format!("{name}: netmask {} is not a netmask", s.netmask));
            }
            let (a, b) = (u32::from(s.range_start), u32::from(s.range_end));
            let net = u32::from(s.relay) & mask;
            if a > b || b - a > 65_535 {
                return Err(format!("{name}: range_start must not be after range_end, and the range at most 65536 addresses"));
            }
            if a & mask != net || b & mask != net {
                return Err(format!(
                    "{name}: the range {}-{} is not on the relay's network {}/{}",
                    s.range_start,
                    s.range_end,
                    Ipv4Addr::from(net),
                    mask.leading_ones()
                ));
            }
            if let Some((_, _, other)) = ranges.iter().find(|(x, y, _)| a <= *y && *x <= b) {
                return Err(format!("{name}: its range overlaps {other}'s"));
            }
            ranges.push((a, b, name));
        }
        Ok(())
    }
}

#[cfg(test)]
mod subnet_tests {
    use super::*;

    fn with(subnets: &str, relays: &str) -> Result<BootConfig, String> {
        let c: BootConfig = toml::from_str(&format!(
            "enabled = true\nmode = \"dhcp\"\nserver_ip = \"10.0.0.1\"\nrange_start = \"10.0.0.100\"\n\
             range_end = \"10.0.0.200\"\nrelays = [{relays}]\n{subnets}"
        ))
        .map_err(|e| e.to_string())?;
        c.validate().map(|_| c)
    }

    #[test]
    fn a_relay_subnet_gives_its_own_range_and_settings() {
        let c = with(
            "[[subnets]]\nrelay = \"10.1.0.1\"\nrange_start = \"10.1.0.50\"\nrange_end = \"10.1.0.60\"\n\
             netmask = \"255.255.255.0\"\nrouter = \"10.1.0.1\"\ndns = [\"10.1.0.2\"]\n",
            "\"10.1.0.1\"",
        )
        .unwrap();
        let own = c.pool_for(None).unwrap();
        assert_eq!(
            own.range,
            ("10.0.0.100".parse().unwrap(), "10.0.0.200".parse().unwrap())
        );
        let relayed = c.pool_for(Some("10.1.0.1".parse().unwrap())).unwrap();
        assert_eq!(
            relayed.range,
            ("10.1.0.50".parse().unwrap(), "10.1.0.60".parse().unwrap())
        );
        assert_eq!(relayed.netmask, Some("255.255.255.0".parse().unwrap()));
        assert_eq!(relayed.router, Some("10.1.0.1".parse().unwrap()));
        assert_eq!(relayed.dns, ["10.1.0.2".parse::<Ipv4Addr>().unwrap()]);
        assert!(c.pool_for(Some("10.9.0.1".parse().unwrap())).is_none());
    }

    #[test]
    fn the_uefi_chain_is_ipxe_by_default_and_anything_but_ipxe_or_shim_is_refused() {
        assert_eq!(with("", "").unwrap().uefi_chain, "ipxe");
        assert_eq!(
            with("uefi_chain = \"shim\"\n", "").unwrap().uefi_chain,
            "shim"
        );
        let e = with("uefi_chain = \"grub\"\n", "").unwrap_err();
        assert_eq!(
            e,
            "boot.uefi_chain must be \"ipxe\" or \"shim\", not \"grub\""
        );
        let e = with("uefi_chain = \"shim\"\nlisten_tftp = \"off\"\n", "").unwrap_err();
        assert!(e.contains("boot.listen_tftp cannot be \"off\""), "{e}");
        assert!(!with("listen_tftp = \"off\"\n", "").unwrap().tftp_on());
    }

    #[test]
    fn a_bad_relay_subnet_is_refused_by_name() {
        let subnet = |relay: &str, start: &str, end: &str, mask: &str| {
            format!(
                "[[subnets]]\nrelay = \"{relay}\"\nrange_start = \"{start}\"\nrange_end = \"{end}\"\nnetmask = \"{mask}\"\n"
            )
        };
        for (subnets, relays, says) in [
            (
                subnet("10.1.0.1", "10.1.0.50", "10.1.0.60", "255.255.255.0"),
                "",
                "must be listed in boot.relays",
            ),
            (
                subnet("10.1.0.1", "10.2.0.50", "10.2.0.60", "255.255.255.0"),
                "\"10.1.0.1\"",
                "not on the relay's network 10.1.0.0/24",
            ),
            (
                subnet("10.1.0.1", "10.1.0.60", "10.1.0.50", "255.255.255.0"),
                "\"10.1.0.1\"",
                "must not be after",
            ),
            (
                subnet("10.1.0.1", "10.1.0.50", "10.1.0.60", "255.0.255.0"),
                "\"10.1.0.1\"",
                "is not a netmask",
            ),
            (
                subnet("10.0.0.1", "10.0.0.150", "10.0.0.250", "255.255.255.0"),
                "\"10.0.0.1\"",
                "overlaps boot.range_start..range_end",
            ),
            (
                subnet("10.1.0.1", "10.1.0.50", "10.1.0.60", "255.255.0.0")
                    + &subnet("10.1.0.2", "10.1.0.55", "10.1.0.70", "255.255.0.0"),
                "\"10.1.0.1\", \"10.1.0.2\"",
                "overlaps boot.subnets (relay 10.1.0.1)",
            ),
        ] {
            let e = with(&subnets, relays).err().unwrap_or_default();
            assert!(e.contains(says), "{subnets}: {e}");
        }
    }
}
