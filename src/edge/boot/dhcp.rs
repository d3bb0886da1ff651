//! DHCP for network boot, on dhcproto's codec. The decisions are pure functions here: which
//! clients are PXE clients, which boot file an architecture gets, whether the client is already
//! iPXE (to break the chainload loop), and the reply for proxy and full DHCP.
//!
//! - `proxy` mode answers only PXE clients (option 60 `PXEClient` / `HTTPClient`), with boot
//!   information and no address, on port 67 (DISCOVER -> OFFER) and port 4011 (REQUEST -> ACK, the
//!   exchange UEFI firmware makes); it sets option 54, `siaddr` and option 43 with
//!   `PXE_DISCOVERY_CONTROL = 8` so clients skip boot server discovery.
//! - `dhcp` mode is a full server with a range for an isolated provisioning network; its leases
//!   are SQLite rows.

use dhcproto::v4::{DhcpOption, Message, MessageType, Opcode, OptionCode};
use std::net::Ipv4Addr;

/// What a PXE client said about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PxeClient {
    pub mac: String,
    /// RFC 4578 option 93 (0 when absent: a legacy BIOS client).
    pub arch: u16,
    /// Already running iPXE (user class `iPXE`, or option 175 present).
    pub ipxe: bool,
    /// An HTTP-boot client (`HTTPClient`).
    pub http: bool,
}

/// Decodes a DHCP packet from the wire. dhcproto checks some option lengths only with
/// `debug_assert!` (a hostile length panics a debug build; found when the fuzzer's corpus was
/// replayed in the tests) or subtracts from them unchecked: such packets are dropped before
/// decoding, like any other undecodable one. A panic that still escapes the decoder drops the
/// packet too (in debug builds; release builds abort on panic, which `make fuzz` guards).
pub fn decode(buf: &[u8]) -> Option<Message> {
    use dhcproto::{Decodable, Decoder};
    if hostile_option_lengths(buf) {
        return None;
    }
    std::panic::catch_unwind(|| Message::decode(&mut Decoder::new(buf)).ok())
        .ok()
        .flatten()
}

/// Options whose lengths dhcproto trusts: rapid commit (80) is empty, the client FQDN (81) has at
/// least 3 bytes, the client network interface (94) 3, the bulk lease query status (151) at least
/// 1 and its times (152-155) 4.
fn hostile_option_lengths(buf: &[u8]) -> bool {
    let mut i = 240; // after the fixed header and the magic cookie
    while i < buf.len() {
        let code = buf[i];
        match code {
            0 => {
                i += 1;
                continue;
            }
            255 => return false,
            _ => {}
        }
        let Some(&len) = buf.get(i + 1) else {
            return false;
        };
        let bad = match code {
            80 => len != 0,
            81 => len < 3,
            94 => len != 3,
            151 => len < 1,
            152..=155 => len != 4,
            _ => false,
        };
        if bad {
            return true;
        }
        i += 2 + len as usize;
    }
    false
}

pub fn mac_of(msg: &Message) -> Option<String> {
    // dhcproto's `chaddr()` slices by the packet's own `hlen`: a hostile hlen over 16 would
    // panic there. Such a packet is refused before anything reads its hardware address.
    if msg.hlen() as usize > 16 {
        return None;
    }
    let c = msg.chaddr();
    (c.len() >= 6).then(|| {
        c[..6]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<Vec<_>>()
            .join(":")
    })
}

/// `Some` for PXE and HTTP-boot clients, `None` for everyone else.
pub fn classify(msg: &Message) -> Option<PxeClient> {
    if msg.opcode() != Opcode::BootRequest {
        return None;
    }
    let class = match msg.opts().get(OptionCode::ClassIdentifier) {
        Some(DhcpOption::ClassIdentifier(v)) => v.clone(),
        _ => return None,
    };
    let (pxe, http) = (
        class.starts_with(b"PXEClient"),
        class.starts_with(b"HTTPClient"),
    );
    if !pxe && !http {
        return None;
    }
    let arch = match msg.opts().get(OptionCode::ClientSystemArchitecture) {
        Some(DhcpOption::ClientSystemArchitecture(a)) => u16::from(*a),
        _ => 0,
    };
    let user_class_ipxe = match msg.opts().get(OptionCode::UserClass) {
        Some(DhcpOption::UserClass(v)) => v.windows(4).any(|w| w == b"iPXE"),
        _ => false,
    };
    let ipxe = user_class_ipxe || msg.opts().get(OptionCode::from(175u8)).is_some();
    Some(PxeClient {
        mac: mac_of(msg)?,
        arch,
        ipxe,
        http,
    })
}

/// Which boot files the appliance has.
#[derive(Debug, Clone, Default)]
pub struct Files {
    pub undionly: bool,
    pub ipxe_efi: bool,
    pub snponly: bool,
    pub arm64: bool,
    /// The Secure Boot chain: `shimx64.efi` and `grubx64.efi` both there.
    pub shim: bool,
}

/// The boot file for a client: the chain script (over HTTP) for iPXE, an `http://` URL for
/// HTTP-boot clients, else the iPXE binary for its architecture over TFTP (RFC 4578: 0 BIOS, 7 and
/// 9 x64 UEFI, 11 arm64 UEFI, 16 and 19 HTTP boot). With `uefi_shim` (`[boot] uefi_chain =
/// "shim"`) x64 UEFI PXE clients get the signed chain instead, shim over TFTP (it loads
/// `grubx64.efi` from beside itself), and never unsigned iPXE, which Secure Boot would refuse.
/// Without TFTP (`listen_tftp = "off"`) only HTTP clients and iPXE get an answer. `None` when the
/// appliance has nothing for it.
pub fn boot_file(c: &PxeClient, ctx: &ReplyCtx<'_>) -> Option<String> {
    let (f, http_base) = (ctx.files, ctx.http_base);
    if c.ipxe {
        // iPXE fetches the chain script over HTTP, named in full (beside a site DHCP server,
        // next-server may be that server's): no TFTP after the first stage, none at all for a
        // machine that HTTP-booted iPXE. The script chains to the per-machine one.
        return Some(format!("{http_base}/api/compute/boot/chain.ipxe"));
    }
    match c.arch {
        16 | 19 if f.ipxe_efi => Some(format!("{http_base}/api/compute/boot/files/ipxe.efi")),
        _ if c.http || !ctx.tftp => None,
        7 | 9 if ctx.uefi_shim => f.shim.then(|| "shimx64.efi".into()),
        0 if f.undionly => Some("undionly.kpxe".into()),
        7 | 9 if f.snponly => Some("snponly.efi".into()),
        7 | 9 if f.ipxe_efi => Some("ipxe.efi".into()),
        11 if f.arm64 => Some("ipxe-arm64.efi".into()),
        _ => None,
    }
}

/// What the reply needs besides the request.
pub struct ReplyCtx<'a> {
    pub server_ip: Ipv4Addr,
    pub http_base: &'a str,
    pub files: &'a Files,
    /// `[boot] uefi_chain = "shim"`: x64 UEFI clients get the signed chain.
    pub uefi_shim: bool,
    /// TFTP is served (`[boot] listen_tftp` is not `"off"`).
    pub tftp: bool,
    /// For full DHCP: the address leased to this client, and the network's settings.
    pub lease: Option<Ipv4Addr>,
    pub netmask: Option<Ipv4Addr>,
    pub router: Option<Ipv4Addr>,
    pub dns: &'a [Ipv4Addr],
    pub lease_seconds: u32,
}

/// `PXE_DISCOVERY_CONTROL` (6) = 8: skip boot server discovery, boot the file named here.
const PXE_VENDOR_OPTIONS: [u8; 4] = [6, 1, 8, 255];

/// The reply to a request, or `None` to stay silent. `proxy` answers only PXE clients and gives no
/// address; `port_4011` is the proxy's boot-server port (REQUEST -> ACK).
pub fn reply(req: &Message, proxy: bool, port_4011: bool, ctx: &ReplyCtx<'_>) -> Option<Message> {
    let kind = req.opts().msg_type()?;
    let pxe = classify(req);
    let answer = match (kind, proxy, port_4011) {
        (MessageType::Discover, _, false) => MessageType::Offer,
        (MessageType::Request, true, true) => MessageType::Ack,
        (MessageType::Request, false, false) => MessageType::Ack,
        _ => return None,
    };
    if proxy && pxe.is_none() {
        return None;
    }
    if !proxy && ctx.lease.is_none() {
        return None;
    }
    if !proxy && answer == MessageType::Ack {
        // A full server ACKs only the address it leased to this client.
        let asked = match req.opts().get(OptionCode::RequestedIpAddress) {
            Some(DhcpOption::RequestedIpAddress(ip)) => *ip,
            _ => req.ciaddr(),
        };
        if Some(asked) != ctx.lease {
            return Some(nak(req, ctx.server_ip));
        }
    }
    let mut m = Message::default();
    m.set_opcode(Opcode::BootReply)
        .set_xid(req.xid())
        .set_flags(req.flags())
        .set_giaddr(req.giaddr())
        .set_chaddr(req.chaddr())
        .set_siaddr(ctx.server_ip);
    if !proxy {
        m.set_yiaddr(ctx.lease.expect("checked"));
    }
    let o = m.opts_mut();
    o.insert(DhcpOption::MessageType(answer));
    o.insert(DhcpOption::ServerIdentifier(ctx.server_ip));
    if !proxy {
        o.insert(DhcpOption::AddressLeaseTime(ctx.lease_seconds));
        if let Some(mask) = ctx.netmask {
            o.insert(DhcpOption::SubnetMask(mask));
        }
        if let Some(r) = ctx.router {
            o.insert(DhcpOption::Router(vec![r]));
        }
        if !ctx.dns.is_empty() {
            o.insert(DhcpOption::DomainNameServer(ctx.dns.to_vec()));
        }
    }
    if let Some(c) = &pxe {
        let class: &[u8] = if c.http { b"HTTPClient" } else { b"PXEClient" };
        o.insert(DhcpOption::ClassIdentifier(class.to_vec()));
        if !c.http {
            o.insert(DhcpOption::VendorExtensions(PXE_VENDOR_OPTIONS.to_vec()));
        }
        if let Some(file) = boot_file(c, ctx) {
            o.insert(DhcpOption::BootfileName(file.as_bytes().to_vec()));
            m.set_fname_str(&file);
        } else if proxy {
            return None;
        }
    }
    Some(m)
}

fn nak(req: &Message, server: Ipv4Addr) -> Message {
    let mut m = Message::default();
    m.set_opcode(Opcode::BootReply)
        .set_xid(req.xid())
        .set_chaddr(req.chaddr())
        .set_giaddr(req.giaddr());
    m.opts_mut()
        .insert(DhcpOption::MessageType(MessageType::Nak));
    m.opts_mut().insert(DhcpOption::ServerIdentifier(server));
    m
}

#[cfg(test)]
mod tests {
    use super::*;
    use dhcproto::v4::Architecture;
    use dhcproto::{Decodable, Decoder, Encodable, Encoder};

    #[test]
    fn hostile_option_lengths_are_dropped_before_decoding() {
        let mut m = Message::default();
        m.set_chaddr(&[0x52, 0x54, 0, 0, 0, 1]);
        m.opts_mut()
            .insert(DhcpOption::MessageType(MessageType::Discover));
        let mut raw = Vec::new();
        m.encode(&mut Encoder::new(&mut raw)).unwrap();
        assert!(decode(&raw).is_some());
        for (code, len) in [(152u8, 2u8), (94, 1), (80, 1), (151, 0), (81, 0)] {
            let mut bad = raw.clone();
            let end = bad.len() - 1; // before the End option
            let mut opt = vec![code, len];
            opt.extend(std::iter::repeat_n(0u8, len as usize));
            bad.splice(end..end, opt);
            assert!(decode(&bad).is_none(), "option {code} of length {len}");
        }
    }

    #[test]
    fn a_hostile_hardware_address_length_is_refused_not_a_panic() {
        let mut m = Message::default();
        m.set_chaddr(&[0x52, 0x54, 0, 0, 0, 1]);
        let mut raw = Vec::new();
        m.encode(&mut Encoder::new(&mut raw)).unwrap();
        for hlen in [17u8, 65, 255] {
            raw[2] = hlen;
            let Ok(decoded) = Message::decode(&mut Decoder::new(&raw)) else {
                continue;
            };
            assert_eq!(mac_of(&decoded), None, "hlen {hlen}");
            assert!(classify(&decoded).is_none());
        }
    }

    fn request(
        kind: MessageType,
        class: Option<&[u8]>,
        arch: Option<u16>,
        user_class: Option<&[u8]>,
    ) -> Message {
        let mut m = Message::default();
        m.set_opcode(Opcode::BootRequest)
            .set_xid(42)
            .set_chaddr(&[0x52, 0x54, 0, 0x12, 0x34, 0x56]);
        m.opts_mut().insert(DhcpOption::MessageType(kind));
        if let Some(c) = class {
            m.opts_mut().insert(DhcpOption::ClassIdentifier(c.to_vec()));
        }
        if let Some(a) = arch {
            m.opts_mut()
                .insert(DhcpOption::ClientSystemArchitecture(Architecture::from(a)));
        }
        if let Some(u) = user_class {
            m.opts_mut().insert(DhcpOption::UserClass(u.to_vec()));
        }
        m
    }

    fn all_files() -> Files {
        Files {
            undionly: true,
            ipxe_efi: true,
            snponly: true,
            arm64: false,
            shim: true,
        }
    }

    fn ctx<'a>(files: &'a Files, lease: Option<Ipv4Addr>) -> ReplyCtx<'a> {
        ReplyCtx {
            server_ip: Ipv4Addr::new(10, 0, 0, 1),
            http_base: "http://10.0.0.1:8080",
            files,
            uefi_shim: false,
            tftp: true,
            lease,
            netmask: Some(Ipv4Addr::new(255, 255, 255, 0)),
            router: None,
            dns: &[],
            lease_seconds: 600,
        }
    }

    fn file_of(m: &Message) -> Option<String> {
        match m.opts().get(OptionCode::BootfileName) {
            Some(DhcpOption::BootfileName(v)) => Some(String::from_utf8(v.clone()).unwrap()),
            _ => None,
        }
    }

    fn boot_file_t(c: &PxeClient, base: &str, f: &Files) -> Option<String> {
        let c2 = ReplyCtx {
            http_base: base,
            ..ctx(f, None)
        };
        boot_file(c, &c2)
    }

    #[test]
    fn the_shim_chain_goes_to_x64_uefi_pxe_clients_only() {
        let f = all_files();
        let shim = |arch, ipxe, http, f: &Files| {
            let c = PxeClient {
                mac: "m".into(),
                arch,
                ipxe,
                http,
            };
            let x = ReplyCtx {
                uefi_shim: true,
                http_base: "http://h",
                ..ctx(f, None)
            };
            boot_file(&c, &x)
        };
        assert_eq!(shim(7, false, false, &f).as_deref(), Some("shimx64.efi"));
        assert_eq!(shim(9, false, false, &f).as_deref(), Some("shimx64.efi"));
        // BIOS clients always get iPXE; iPXE itself still gets its script; HTTP clients are not
        // changed by it.
        assert_eq!(shim(0, false, false, &f).as_deref(), Some("undionly.kpxe"));
        assert_eq!(
            shim(7, true, false, &f).as_deref(),
            Some("http://h/api/compute/boot/chain.ipxe")
        );
        assert_eq!(
            shim(16, false, true, &f).as_deref(),
            Some("http://h/api/compute/boot/files/ipxe.efi")
        );
        // Chosen but missing: nothing, never the unsigned binary Secure Boot would refuse.
        let none = Files {
            shim: false,
            ..all_files()
        };
        assert_eq!(shim(7, false, false, &none), None);
        // And the whole reply: a DISCOVER from x64 UEFI gets shim by name, from the TFTP server.
        let req = request(
            MessageType::Discover,
            Some(b"PXEClient:Arch:00007:UNDI:003016"),
            Some(7),
            None,
        );
        let c = ReplyCtx {
            uefi_shim: true,
            ..ctx(&f, Some(Ipv4Addr::new(10, 0, 0, 50)))
        };
        let m = reply(&req, false, false, &c).unwrap();
        assert_eq!(file_of(&m).as_deref(), Some("shimx64.efi"));
        assert_eq!(m.siaddr(), Ipv4Addr::new(10, 0, 0, 1));
    }

    #[test]
    fn boot_files_by_architecture() {
        let f = all_files();
        let base = "http://h";
        let c = |arch, ipxe, http| PxeClient {
            mac: "m".into(),
            arch,
            ipxe,
            http,
        };
        assert_eq!(
            boot_file_t(&c(0, false, false), base, &f).as_deref(),
            Some("undionly.kpxe")
        );
        assert_eq!(
            boot_file_t(&c(7, false, false), base, &f).as_deref(),
            Some("snponly.efi")
        );
        assert_eq!(
            boot_file_t(&c(9, false, false), base, &f).as_deref(),
            Some("snponly.efi")
        );
        let no_snp = Files {
            snponly: false,
            ..all_files()
        };
        assert_eq!(
            boot_file_t(&c(7, false, false), base, &no_snp).as_deref(),
            Some("ipxe.efi")
        );
        assert_eq!(boot_file_t(&c(11, false, false), base, &f), None);
        let arm = Files {
            arm64: true,
            ..all_files()
        };
        assert_eq!(
            boot_file_t(&c(11, false, false), base, &arm).as_deref(),
            Some("ipxe-arm64.efi")
        );
        assert_eq!(
            boot_file_t(&c(16, false, true), base, &f).as_deref(),
            Some("http://h/api/compute/boot/files/ipxe.efi")
        );
        assert_eq!(
            boot_file_t(&c(19, false, true), base, &f).as_deref(),
            Some("http://h/api/compute/boot/files/ipxe.efi")
        );
        // iPXE itself gets the script, over HTTP: the chainload loop is broken.
        assert_eq!(
            boot_file_t(&c(0, true, false), base, &f).as_deref(),
            Some("http://h/api/compute/boot/chain.ipxe")
        );
        assert_eq!(
            boot_file_t(&c(7, true, false), base, &f).as_deref(),
            Some("http://h/api/compute/boot/chain.ipxe")
        );
        // Without TFTP only HTTP clients and iPXE are answered.
        let no_tftp = |cl: &PxeClient| {
            boot_file(
                cl,
                &ReplyCtx {
                    tftp: false,
                    http_base: base,
                    ..ctx(&f, None)
                },
            )
        };
        assert_eq!(no_tftp(&c(0, false, false)), None);
        assert_eq!(no_tftp(&c(7, false, false)), None);
        assert_eq!(
            no_tftp(&c(16, false, true)).as_deref(),
            Some("http://h/api/compute/boot/files/ipxe.efi")
        );
        assert_eq!(
            no_tftp(&c(7, true, false)).as_deref(),
            Some("http://h/api/compute/boot/chain.ipxe")
        );
    }

    #[test]
    fn classify_pxe_and_ipxe() {
        assert!(classify(&request(MessageType::Discover, None, None, None)).is_none());
        assert!(classify(&request(
            MessageType::Discover,
            Some(b"MSFT 5.0"),
            None,
            None
        ))
        .is_none());
        let c = classify(&request(
            MessageType::Discover,
            Some(b"PXEClient:Arch:00000:UNDI:002001"),
            Some(0),
            None,
        ))
        .unwrap();
        assert_eq!(
            (c.arch, c.ipxe, c.http, c.mac.as_str()),
            (0, false, false, "52:54:00:12:34:56")
        );
        let c = classify(&request(
            MessageType::Discover,
            Some(b"PXEClient"),
            Some(7),
            Some(b"iPXE"),
        ))
        .unwrap();
        assert!(c.ipxe);
        let mut m = request(MessageType::Discover, Some(b"PXEClient"), Some(0), None);
        m.opts_mut()
            .insert(DhcpOption::Unknown(dhcproto::v4::UnknownOption::new(
                OptionCode::from(175u8),
                vec![1, 1, 1],
            )));
        assert!(classify(&m).unwrap().ipxe);
        assert!(
            classify(&request(
                MessageType::Discover,
                Some(b"HTTPClient:Arch:00016"),
                Some(16),
                None
            ))
            .unwrap()
            .http
        );
    }

    #[test]
    fn proxy_mode_answers_pxe_clients_only_without_an_address() {
        let f = all_files();
        let c = ctx(&f, None);
        assert!(reply(
            &request(MessageType::Discover, None, None, None),
            true,
            false,
            &c
        )
        .is_none());
        let r = reply(
            &request(MessageType::Discover, Some(b"PXEClient"), Some(0), None),
            true,
            false,
            &c,
        )
        .unwrap();
        assert_eq!(r.opts().msg_type(), Some(MessageType::Offer));
        assert_eq!(r.yiaddr(), Ipv4Addr::UNSPECIFIED);
        assert_eq!(r.siaddr(), Ipv4Addr::new(10, 0, 0, 1));
        assert_eq!(r.xid(), 42);
        assert_eq!(file_of(&r).as_deref(), Some("undionly.kpxe"));
        assert!(
            matches!(r.opts().get(OptionCode::ServerIdentifier), Some(DhcpOption::ServerIdentifier(ip)) if *ip == Ipv4Addr::new(10, 0, 0, 1))
        );
        assert!(
            matches!(r.opts().get(OptionCode::VendorExtensions), Some(DhcpOption::VendorExtensions(v)) if v == &PXE_VENDOR_OPTIONS)
        );
        // A REQUEST on 67 is the site server's business; on 4011 the proxy ACKs.
        assert!(reply(
            &request(MessageType::Request, Some(b"PXEClient"), Some(7), None),
            true,
            false,
            &c
        )
        .is_none());
        let ack = reply(
            &request(MessageType::Request, Some(b"PXEClient"), Some(7), None),
            true,
            true,
            &c,
        )
        .unwrap();
        assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
        assert_eq!(file_of(&ack).as_deref(), Some("snponly.efi"));
        // Nothing to boot for arm64 here: silence.
        assert!(reply(
            &request(MessageType::Discover, Some(b"PXEClient"), Some(11), None),
            true,
            false,
            &c
        )
        .is_none());
    }

    #[test]
    fn full_dhcp_leases_and_naks() {
        let f = all_files();
        let ip = Ipv4Addr::new(10, 0, 0, 50);
        let c = ctx(&f, Some(ip));
        let offer = reply(
            &request(MessageType::Discover, None, None, None),
            false,
            false,
            &c,
        )
        .unwrap();
        assert_eq!(offer.yiaddr(), ip);
        assert!(
            file_of(&offer).is_none(),
            "a non-PXE client gets no boot file"
        );
        let mut req = request(MessageType::Request, Some(b"PXEClient"), Some(0), None);
        req.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
        let ack = reply(&req, false, false, &c).unwrap();
        assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
        assert_eq!(file_of(&ack).as_deref(), Some("undionly.kpxe"));
        let mut other = request(MessageType::Request, None, None, None);
        other
            .opts_mut()
            .insert(DhcpOption::RequestedIpAddress(Ipv4Addr::new(10, 0, 0, 99)));
        assert_eq!(
            reply(&other, false, false, &c).unwrap().opts().msg_type(),
            Some(MessageType::Nak)
        );
    }

    #[test]
    fn replies_round_trip_through_the_codec() {
        let f = all_files();
        let r = reply(
            &request(
                MessageType::Discover,
                Some(b"PXEClient"),
                Some(7),
                Some(b"iPXE"),
            ),
            true,
            false,
            &ctx(&f, None),
        )
        .unwrap();
        let mut buf = Vec::new();
        r.encode(&mut Encoder::new(&mut buf)).unwrap();
        let back = Message::decode(&mut Decoder::new(&buf)).unwrap();
        let mut again = Vec::new();
        back.encode(&mut Encoder::new(&mut again)).unwrap();
        assert_eq!(again, buf, "decode -> encode changed the bytes");
        assert_eq!(Message::decode(&mut Decoder::new(&again)).unwrap(), back);
        assert_eq!(
            file_of(&back).as_deref(),
            Some("http://10.0.0.1:8080/api/compute/boot/chain.ipxe")
        );
        // Garbage does not decode into anything we would answer.
        assert!(Message::decode(&mut Decoder::new(&[1, 2, 3])).is_err());
    }
}
