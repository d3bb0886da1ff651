//! The boot server's sockets: DHCP on 67 (and 4011 in proxy mode) and TFTP on 69, bound to the
//! provisioning interface when one is configured. What to answer is decided in `dhcp` and `tftp`.

use crate::base::fsutil::ReadRoot;
use crate::config::BootConfig;
use crate::edge::boot::dhcp::{self, Files, ReplyCtx};
use crate::edge::boot::templates;
use crate::edge::boot::tftp::Made;
use crate::edge::{Answer, Ask, Edge};
use dhcproto::{Encodable, Encoder};
use socket2::{Domain, Protocol, Socket, Type};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::path::Path;
use std::sync::Arc;
use tokio::net::UdpSocket;
use tokio::sync::watch;

fn udp(
    addr: &str,
    interface: Option<&str>,
    broadcast: bool,
) -> Result<std::net::UdpSocket, String> {
    let addr: SocketAddr = addr.parse().map_err(|e| format!("{addr}: {e}"))?;
    let s =
        Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).map_err(|e| e.to_string())?;
    s.set_reuse_address(true).map_err(|e| e.to_string())?;
    if broadcast {
        s.set_broadcast(true).map_err(|e| e.to_string())?;
    }
    if let Some(i) = interface {
        s.bind_device(Some(i.as_bytes()))
            .map_err(|e| format!("cannot bind to interface {i}: {e}"))?;
    }
    s.set_nonblocking(true).map_err(|e| e.to_string())?;
    // Each datagram's destination address (`IP_PKTINFO`): a sighting counts only from a limited
    // broadcast (or a listed relay), which a unicast from anywhere cannot pass for.
    nix::sys::socket::setsockopt(&s, nix::sys::socket::sockopt::Ipv4PacketInfo, &true)
        .map_err(|e| format!("cannot ask for IP_PKTINFO on {addr}: {e}"))?;
    // Room for a rack's burst (the kernel caps it at net.core.rmem_max).
    let _ = s.set_recv_buffer_size(4 << 20);
    s.bind(&addr.into())
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    Ok(s.into())
}

/// The Secure Boot chain's files in the boot root: Debian's signed shim, and its signed network
/// GRUB under the name shim loads (`make image` puts both in `image/out/`).
pub const SHIM: &str = "shimx64.efi";
pub const GRUB: &str = "grubx64.efi";
/// Where GRUB looks for its configuration on the TFTP server (Debian's network image's prefix).
pub const GRUB_CFG: &str = "grub/grub.cfg";

/// GRUB's name for this appliance's TFTP server. GRUB fetches everything over TFTP: Debian's signed
/// network image has no HTTP module built in, and under Secure Boot GRUB may load no module.
fn grub_device(server: Ipv4Addr) -> String {
    format!("(tftp,{server})")
}

/// TFTP's "file not found" (error 1).
fn not_found() -> (u16, String) {
    (1, "file not found".to_string())
}

/// The files the TFTP server makes per request rather than reads from the boot root, for GRUB:
/// `grub/<mac>.cfg` (the per-machine configuration, the same decisions as `boot.ipxe`, asked
/// from the address the request came from) and `per-boot/<nonce>/initrd.img` (the ramdisk with
/// its per-boot archive, served once, to the address it was made for). `None` for any other name.
fn tftp_made(edge: Arc<Edge>, server: Ipv4Addr) -> crate::edge::boot::tftp::Maker {
    Arc::new(move |name: String, peer: SocketAddr| {
        let edge = edge.clone();
        Box::pin(async move {
            let name = name.trim_start_matches('/');
            if let Some(mac) = name
                .strip_prefix("grub/")
                .and_then(|r| r.strip_suffix(".cfg"))
                .filter(|m| *m != "grub")
            {
                let Some(mac) = crate::proto::claims::loose_mac(mac) else {
                    return Some(Err(not_found()));
                };
                let ask = Ask::BootScript {
                    mac,
                    peer: peer.ip().to_string(),
                    base: grub_device(server),
                    grub: true,
                };
                return Some(match edge.core.ask(ask).await {
                    Answer::Text { text } => Ok(Made::bytes(text.into_bytes())),
                    Answer::Forbidden { message }
                    | Answer::TooMany { message }
                    | Answer::Unavailable { message } => Err((2, message)),
                    _ => Err((2, "the core gave no configuration".to_string())),
                });
            }
            let (nonce, combined) =
                crate::edge::boot::http::per_boot_name(name.strip_prefix("per-boot/")?)?;
            // The ramdisk is opened before the archive is taken (taken, it is spent).
            let ramdisk = if combined {
                let Ok(file) = edge.boot_root.open_file(std::path::Path::new("initrd.img")) else {
                    return Some(Err(not_found()));
                };
                let Ok(len) = file.metadata().map(|m| m.len()) else {
                    return Some(Err(not_found()));
                };
                Some((file, len))
            } else {
                None
            };
            let Some(archive) = crate::edge::boot::http::take_archive(&edge, nonce, peer).await
            else {
                return Some(Err(not_found()));
            };
            let Some((file, len)) = ramdisk else {
                return Some(Ok(Made::bytes(archive)));
            };
            let suffix = crate::edge::boot::http::archive_suffix(len, &archive);
            Some(Ok(Made::file_then(file, len, suffix)))
        })
    })
}

fn files(root: &ReadRoot) -> Files {
    Files {
        undionly: root.is_file("undionly.kpxe"),
        ipxe_efi: root.is_file("ipxe.efi"),
        snponly: root.is_file("snponly.efi"),
        arm64: root.is_file("ipxe-arm64.efi"),
        shim: root.is_file(SHIM) && root.is_file(GRUB),
    }
}

/// How a DHCP packet reached the boot server: its source and the destination in its IP header
/// (`IP_PKTINFO`; unknown when the kernel did not say).
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    pub src: SocketAddr,
    pub dst: Option<Ipv4Addr>,
}

/// Whether a packet counts as what the network saw: a limited broadcast with no relay in
/// between, or a packet a listed relay sent (its source and `giaddr` both listed). Any host that
/// reaches the port could send a unicast naming any address, or a made-up `giaddr`.
pub fn counts_as_sighting(b: &BootConfig, req: &dhcproto::v4::Message, how: Arrival) -> bool {
    let giaddr = req.giaddr();
    if giaddr.is_unspecified() {
        return how.dst == Some(Ipv4Addr::BROADCAST);
    }
    let src = match how.src.ip() {
        std::net::IpAddr::V4(v4) => v4,
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4,
            None => return false,
        },
    };
    b.relays.contains(&src) && b.relays.contains(&giaddr)
}

/// The address a REQUEST is for: option 50 (the broadcast REQUEST of BIOS and UEFI PXE ROMs and
/// iPXE), else `ciaddr` (a renewing client's, or UEFI's and iPXE's unicast to port 4011).
pub fn requested_address(req: &dhcproto::v4::Message) -> Option<Ipv4Addr> {
    use dhcproto::v4::{DhcpOption, MessageType, OptionCode};
    if !matches!(
        req.opts().get(OptionCode::MessageType),
        Some(DhcpOption::MessageType(MessageType::Request))
    ) {
        return None;
    }
    let asked = match req.opts().get(OptionCode::RequestedIpAddress) {
        Some(DhcpOption::RequestedIpAddress(ip)) => Some(*ip),
        _ => None,
    };
    asked
        .or_else(|| Some(req.ciaddr()))
        .filter(|ip| !ip.is_unspecified() && !ip.is_broadcast())
}

async fn answer(
    edge: &Edge,
    buf: &[u8],
    port_4011: bool,
    http_base: &str,
    how: Arrival,
) -> Option<(Vec<u8>, dhcproto::v4::Message)> {
    let req = dhcp::decode(buf)?;
    let b = &edge.boot;
    let proxy = b.mode == "proxy";
    let mac = dhcp::mac_of(&req)?;
    let discover = matches!(
        req.opts().get(dhcproto::v4::OptionCode::MessageType),
        Some(dhcproto::v4::DhcpOption::MessageType(
            dhcproto::v4::MessageType::Discover
        ))
    );
    // The relay that forwarded the packet: its `giaddr`, believed only from a listed relay (the
    // packet's source and its `giaddr` both in `relays`); anyone could write a `giaddr`.
    let relay = Some(req.giaddr()).filter(|g| !g.is_unspecified());
    let seen = counts_as_sighting(b, &req, how);
    if !proxy && relay.is_some() && !seen {
        tracing::debug!(%mac, giaddr = %req.giaddr(), "dhcp: relayed by no listed relay; no lease");
        return None;
    }
    let lease = if proxy {
        None
    } else {
        let ask = Ask::DhcpAddress {
            mac: mac.clone(),
            discover,
            relay,
        };
        match edge.core.ask(ask).await {
            Answer::Address { ip } => ip,
            _ => None,
        }
    };
    // What the network saw, recorded before any decision to answer: in proxy mode the address
    // the REQUEST names (the site's DHCP server gave it; a proxy never answers a REQUEST on port
    // 67), in full DHCP mode the MAC's lease once the REQUEST made it durable.
    let seen_at = if proxy {
        requested_address(&req)
    } else {
        lease.filter(|_| !discover)
    };
    if let Some(ip) = seen_at.filter(|_| seen) {
        let _ = edge
            .core
            .ask(Ask::Sighting {
                mac: mac.clone(),
                ip,
            })
            .await;
    }
    let files = files(&edge.boot_root);
    // The network's settings: the relay's subnet's, or the boot interface's own.
    let pool = b.pool_for(relay);
    let ctx = ReplyCtx {
        server_ip: b.server_ip?,
        http_base,
        files: &files,
        uefi_shim: b.uefi_shim(),
        tftp: b.tftp_on(),
        lease,
        netmask: pool.map_or(b.netmask, |p| p.netmask),
        router: pool.map_or(b.router, |p| p.router),
        dns: pool.map_or(&b.dns[..], |p| p.dns),
        lease_seconds: b.lease_seconds,
    };
    let reply = dhcp::reply(&req, proxy, port_4011, &ctx)?;
    let mut out = Vec::new();
    reply.encode(&mut Encoder::new(&mut out)).ok()?;
    // Who booted what: on the REQUEST in full DHCP mode (a DISCOVER burst writes nothing), on
    // every answer in proxy mode (the site's DHCP server sees the REQUEST).
    if let Some(c) = dhcp::classify(&req).filter(|_| proxy || !discover) {
        let file = reply
            .fname_str()
            .and_then(|r| r.ok())
            .map(|s| s.trim_end_matches('\0').to_string());
        let ask = Ask::BootLease {
            mac: c.mac,
            ip: lease.map(|l| l.to_string()),
            relay: relay.map(|r| r.to_string()),
            arch: Some(c.arch),
            stage: if c.ipxe { "dhcp-ipxe" } else { "dhcp" }.into(),
            file,
        };
        let core = edge.core.clone();
        tokio::spawn(async move { core.ask(ask).await });
    }
    Some((out, req))
}

/// DHCP packets answered at once; the socket keeps being drained while REQUESTs wait for their
/// lease's commit, so a burst is not lost to a full receive buffer.
const DHCP_IN_FLIGHT: usize = 512;

async fn dhcp_loop(edge: Arc<Edge>, sock: UdpSocket, port_4011: bool, http_base: String) {
    let sock = Arc::new(sock);
    let http_base: Arc<str> = http_base.into();
    let limit = Arc::new(tokio::sync::Semaphore::new(DHCP_IN_FLIGHT));
    let mut buf = vec![0u8; 1500];
    loop {
        let Ok((n, how)) = recv_with_destination(&sock, &mut buf).await else {
            return;
        };
        crate::base::metrics::get()
            .dhcp_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Ok(permit) = limit.clone().acquire_owned().await else {
            return;
        };
        let packet = buf[..n].to_vec();
        let (edge, sock, http_base) = (edge.clone(), sock.clone(), http_base.clone());
        tokio::spawn(async move {
            let _permit = permit;
            answer_one(&edge, &sock, &packet, how, port_4011, &http_base).await;
        });
    }
}

/// One datagram, with its source and the destination address of its IP header.
async fn recv_with_destination(
    sock: &UdpSocket,
    buf: &mut [u8],
) -> std::io::Result<(usize, Arrival)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags, SockaddrIn};
    use std::os::fd::AsRawFd;
    let fd = sock.as_raw_fd();
    sock.async_io(tokio::io::Interest::READABLE, || {
        let mut cmsg = nix::cmsg_space!(libc::in_pktinfo);
        let mut iov = [std::io::IoSliceMut::new(buf)];
        let msg = recvmsg::<SockaddrIn>(fd, &mut iov, Some(&mut cmsg), MsgFlags::MSG_DONTWAIT)
            .map_err(std::io::Error::from)?;
        let src = msg
            .address
            .map(|a| SocketAddr::V4(SocketAddrV4::new(a.ip(), a.port())))
            .ok_or_else(|| std::io::Error::other("a datagram with no source"))?;
        let mut dst = None;
        if let Ok(cmsgs) = msg.cmsgs() {
            for c in cmsgs {
                if let ControlMessageOwned::Ipv4PacketInfo(pi) = c {
                    dst = Some(Ipv4Addr::from(u32::from_be(pi.ipi_addr.s_addr)));
                }
            }
        }
        Ok((msg.bytes, Arrival { src, dst }))
    })
    .await
}

async fn answer_one(
    edge: &Edge,
    sock: &UdpSocket,
    packet: &[u8],
    how: Arrival,
    port_4011: bool,
    http_base: &str,
) {
    let m = crate::base::metrics::get();
    let peer = how.src;
    {
        let Some((out, req)) = answer(edge, packet, port_4011, http_base, how).await else {
            return;
        };
        m.dhcp_answers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dest = if port_4011 {
            peer
        } else if !req.giaddr().is_unspecified() {
            SocketAddr::V4(SocketAddrV4::new(req.giaddr(), 67))
        } else if !req.ciaddr().is_unspecified() {
            SocketAddr::V4(SocketAddrV4::new(req.ciaddr(), 68))
        } else {
            SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::BROADCAST, 68))
        };
        if let Err(e) = sock.send_to(&out, dest).await {
            tracing::warn!(%dest, error = %e, "dhcp: cannot answer");
        }
    }
}

/// The boot server's sockets, bound by the core (ports 67 and 69 need the privilege to bind
/// them, the interface `SO_BINDTODEVICE`) and served by the edge.
pub struct BootSockets {
    pub dhcp: std::net::UdpSocket,
    pub proxy: Option<std::net::UdpSocket>,
    /// `None` with `listen_tftp = "off"` (an HTTP-boot-only network).
    pub tftp: Option<std::net::UdpSocket>,
}

/// Binds DHCP and TFTP when `[boot] enabled`, and writes `chain.ipxe` (and GRUB's `grub.cfg`)
/// into the boot root. `uefi_chain = "shim"` without shim and GRUB in the boot root is refused
/// here, by name, rather than leaving every UEFI machine without a boot file.
pub fn bind(b: &BootConfig, http_base: &str, root: &Path) -> Result<Option<BootSockets>, String> {
    if !b.enabled {
        return Ok(None);
    }
    let read_root = crate::base::fsutil::ReadRoot::open(root)?;
    if b.uefi_shim() {
        if let Some(missing) = [SHIM, GRUB].into_iter().find(|f| !read_root.is_file(f)) {
            return Err(format!(
                "boot.uefi_chain = \"shim\" needs {missing} in the boot root {} (make image puts \
                 shimx64.efi and grubx64.efi in image/out/; docs/boot.md)",
                root.display()
            ));
        }
    }
    let iface = b.interface.as_deref();
    let dhcp = udp(&b.listen_dhcp, iface, true)?;
    let proxy = (b.mode == "proxy")
        .then(|| udp(&b.listen_proxy, iface, true))
        .transpose()?;
    let tftp = b
        .tftp_on()
        .then(|| udp(&b.listen_tftp, iface, false))
        .transpose()?;
    // iPXE fetches this (over HTTP, or TFTP when an operator's DHCP names it so); it chains to
    // the per-machine script over HTTP.
    let script = crate::edge::boot::http::chain_script(&read_root, http_base);
    crate::base::fsutil::write_atomic(&root.join("chain.ipxe"), script.as_bytes(), 0o644)
        .map_err(|e| format!("cannot write chain.ipxe: {e}"))?;
    // GRUB (the shim chain) reads grub/grub.cfg over TFTP, then its per-machine configuration
    // (made per request: `tftp_made`). Written whatever the chain, like chain.ipxe: an operator
    // who switches to shim needs no other step.
    if let Some(ip) = b.server_ip {
        let cfg = templates::render(
            &read_root,
            templates::CHAIN_GRUB,
            &[("base", &grub_device(ip))],
        );
        let dir = root.join("grub");
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        crate::base::fsutil::write_atomic(&root.join(GRUB_CFG), cfg.as_bytes(), 0o644)
            .map_err(|e| format!("cannot write {GRUB_CFG}: {e}"))?;
    }
    Ok(Some(BootSockets { dhcp, proxy, tftp }))
}

/// Serves DHCP and TFTP on the bound sockets until `stop`; the HTTP side is served by the public
/// listener.
pub fn run(
    edge: Arc<Edge>,
    sockets: BootSockets,
    http_base: String,
    stop: watch::Receiver<bool>,
) -> Result<(), String> {
    let b = edge.boot.clone();
    let tokio_udp = |s: std::net::UdpSocket| {
        s.set_nonblocking(true)
            .and_then(|_| UdpSocket::from_std(s))
            .map_err(|e| format!("the boot server's socket: {e}"))
    };
    let mut tasks = vec![tokio::spawn(dhcp_loop(
        edge.clone(),
        tokio_udp(sockets.dhcp)?,
        false,
        http_base.clone(),
    ))];
    if let Some(p) = sockets.proxy {
        tasks.push(tokio::spawn(dhcp_loop(
            edge.clone(),
            tokio_udp(p)?,
            true,
            http_base.clone(),
        )));
    }
    if let Some(t) = sockets.tftp {
        let on_transfer: crate::edge::boot::tftp::OnTransfer =
            Arc::new(|peer, file| tracing::info!(%peer, %file, "tftp: sent"));
        let made = b.server_ip.map(|ip| tftp_made(edge.clone(), ip));
        tasks.push(tokio::spawn(crate::edge::boot::tftp::serve(
            tokio_udp(t)?,
            edge.boot_root.clone(),
            (b.tftp_max_transfers, b.tftp_max_per_source),
            on_transfer,
            made,
        )));
    }
    tracing::info!(mode = %b.mode, dhcp = %b.listen_dhcp, tftp = %b.listen_tftp, %http_base, "boot server up");
    tokio::spawn(async move {
        let mut stop = stop;
        let _ = stop.changed().await;
        for t in tasks {
            t.abort();
        }
    });
    Ok(())
}
