//! The network edge besides the gateway: the public HTTP listener (boot scripts and files, the
//! well-known document, `/healthz`, `/metrics`, agent downloads), DHCP and TFTP. With privilege
//! separation on, all of it runs in the network child (`privsep`), which parses every
//! byte those sockets receive; what needs the database or a key is asked of the core as one of a
//! few structured questions ([`Ask`]), answered in the key-holding process (`appliance::answer`) and reached only through
//! [`EdgeCore`].
//!
//! Files are read beneath two directories the core opens and hands over as descriptors
//! ([`ReadRoot`]): the boot root and `<state-dir>/downloads`. The child's Landlock rules allow
//! reading beneath those two and nothing else, so a name that escapes them (a symlink to a key, a
//! `..` the path guard missed) is refused by the kernel. Boot files are therefore copied into the
//! boot root, not linked from elsewhere.

pub mod boot;
pub mod gateway;
pub mod http;
pub mod tickets;

use crate::base::fsutil::ReadRoot;
use crate::config::BootConfig;
use serde::{Deserialize, Serialize};
use std::net::Ipv4Addr;
use std::sync::Arc;

/// What the edge asks of the core. Each is checked there as any caller's would be: the child is
/// trusted no more than the network it parses. Some fields only the edge can know are taken on
/// its word: `Health::trusted` (whether the peer is loopback or a named scraper: the full report
/// shows counts, never a secret), the peers of `BootScript` and `BootArchive` and the
/// `Sighting`s. The last three are what the network itself saw, and the edge is the part that
/// sees the network: a compromised edge can already answer any machine's DHCP and HTTP, so it
/// gains nothing by lying about them that the network would not give it (docs/boot.md).
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "ask", rename_all = "camelCase")]
pub enum Ask {
    /// Full DHCP mode: an OFFER's address (`discover`) or a REQUEST's durable lease.
    DhcpAddress {
        mac: String,
        discover: bool,
        /// The listed relay that forwarded the packet (its `giaddr`): the address comes from
        /// that relay's `[[boot.subnets]]` range. `None`: the boot interface's own range.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        relay: Option<std::net::Ipv4Addr>,
    },
    /// Who booted what (a boot lease row).
    BootLease {
        mac: String,
        ip: Option<String>,
        /// The relay that forwarded the client's packets (`giaddr`), when one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        relay: Option<String>,
        arch: Option<u16>,
        stage: String,
        file: Option<String>,
    },
    /// The per-machine iPXE script, or with `grub` the per-machine GRUB configuration (for a
    /// discovery boot, with a fresh per-boot archive).
    BootScript {
        mac: String,
        peer: String,
        base: String,
        #[serde(default)]
        grub: bool,
    },
    /// A per-boot archive, served once, to the address it was made for.
    BootArchive {
        nonce: String,
        peer: String,
    },
    /// The boot server's DHCP saw `mac` at `ip`: a limited broadcast on the boot interface, or a
    /// packet from a listed relay (the edge checked which; in full DHCP mode the core also checks
    /// that `ip` is the MAC's lease).
    Sighting {
        mac: String,
        ip: Ipv4Addr,
    },
    /// `/healthz`: the full report when `trusted`, the status alone otherwise.
    Health {
        trusted: bool,
    },
    /// `/metrics`, with the edge's own counters when it runs apart.
    Metrics {
        edge: Option<crate::base::metrics::EdgeCounts>,
    },
    WellKnown,
    /// The recorded SHA-256 of an agent download.
    DownloadSha {
        version: String,
        arch: String,
    },
    /// The signed release manifest (the downloads and their SHA-256s).
    ReleaseManifest,
}

impl Ask {
    pub fn name(&self) -> &'static str {
        match self {
            Ask::DhcpAddress { .. } => "dhcpAddress",
            Ask::BootLease { .. } => "bootLease",
            Ask::BootScript { .. } => "bootScript",
            Ask::BootArchive { .. } => "bootArchive",
            Ask::Sighting { .. } => "sighting",
            Ask::Health { .. } => "health",
            Ask::Metrics { .. } => "metrics",
            Ask::WellKnown => "wellKnown",
            Ask::DownloadSha { .. } => "downloadSha",
            Ask::ReleaseManifest => "releaseManifest",
        }
    }
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "answer", rename_all = "camelCase")]
pub enum Answer {
    Address {
        ip: Option<Ipv4Addr>,
    },
    Done,
    /// A text body (an iPXE script).
    Text {
        text: String,
    },
    /// Base64 bytes, or none (not found).
    Bytes {
        b64: Option<String>,
    },
    /// A page: its status and body.
    Page {
        status: u16,
        body: String,
    },
    Json {
        value: serde_json::Value,
    },
    Sha {
        sha256: Option<String>,
    },
    /// The core cannot answer now (the message says why; never a secret).
    Unavailable {
        message: String,
    },
    /// Refused (the message says why; nothing was written).
    Forbidden {
        message: String,
    },
    /// Over a rate.
    TooMany {
        message: String,
    },
}

/// Who answers the edge's questions: the core in this process, or the core across the
/// socketpair (the network child's link). The edge reaches the core through nothing else.
pub trait EdgeCore: Send + Sync {
    fn ask(&self, a: Ask) -> crate::proto::protocol::Pending<'_, Answer>;
    /// True when the core is another process (the edge then reports its own counters).
    fn remote(&self) -> bool {
        false
    }
}

/// What the edge needs to run: who answers it, the `[boot]` settings and the two directories.
pub struct Edge {
    pub core: Arc<dyn EdgeCore>,
    pub boot: BootConfig,
    pub metrics_public: bool,
    pub boot_root: Arc<ReadRoot>,
    pub downloads: ReadRoot,
}
