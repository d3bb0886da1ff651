//! The boot server: proxyDHCP or full DHCP, TFTP for the iPXE binaries, and the HTTP side (iPXE
//! scripts, the discovery ramdisk's files and the per-boot archive with the discovery token).

pub mod dhcp;
pub mod gate;
pub mod http;
pub mod server;
pub mod templates;
pub mod tftp;
