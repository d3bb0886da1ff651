//! The boot server on loopback: TFTP against curl's client (blksize, tsize), the path guard on the
//! wire, and the proxyDHCP port-4011 exchange with real packets.

use crate::common::*;
use dhcproto::v4::{Architecture, DhcpOption, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};
use std::process::Command;

/// An appliance with `[boot]` on loopback ports and an iPXE binary in its boot root.
fn boot_appliance(mode: &str) -> (Appliance, u16, u16) {
    boot_appliance_with(mode, true)
}

/// [`boot_appliance`], with the network edge in a confined child (`privsep`) or in one process.
pub fn boot_appliance_with(mode: &str, privsep: bool) -> (Appliance, u16, u16) {
    boot_appliance_init(mode, privsep, &[])
}

/// [`boot_appliance_with`], `bca init` given `init` too (`--store postgres://…`).
pub fn boot_appliance_init(mode: &str, privsep: bool, init: &[&str]) -> (Appliance, u16, u16) {
    let (dhcp, proxy, tftp) = (free_udp(), free_udp(), free_udp());
    let mut a = Appliance::start_with("file", init);
    let cfg = a.state().join("config.toml");
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    if !privsep {
        text = replace_table(&text, "privsep", "[privsep]\nenabled = false\n");
    }
    let boot = format!(
        "[boot]\nenabled = true\nmode = \"{mode}\"\nserver_ip = \"127.0.0.1\"\nlisten_dhcp = \"127.0.0.1:{dhcp}\"\n\
         listen_proxy = \"127.0.0.1:{proxy}\"\nlisten_tftp = \"127.0.0.1:{tftp}\"\nrange_start = \"127.0.0.100\"\nrange_end = \"127.0.0.110\"\n"
    );
    // Replace the [boot] table init wrote (defaults) with this one.
    std::fs::write(&cfg, replace_table(&text, "boot", &boot)).unwrap();
    let root = a.state().join("boot");
    std::fs::create_dir_all(&root).unwrap();
    let mut big = Vec::new();
    for i in 0..200_000u32 {
        big.extend_from_slice(&i.to_le_bytes());
    }
    std::fs::write(root.join("undionly.kpxe"), &big).unwrap();
    std::fs::write(root.join("snponly.efi"), b"efi").unwrap();
    a.restart();
    (a, proxy, tftp)
}

#[test]
fn curl_fetches_over_tftp_with_blksize_and_the_path_guard_holds() {
    let (a, _, tftp) = boot_appliance("proxy");
    let out = a.dir.path().join("got");
    let o = Command::new("curl")
        .args([
            "-sS",
            "--tftp-blksize",
            "1468",
            "-o",
            out.to_str().unwrap(),
            &format!("tftp://127.0.0.1:{tftp}/undionly.kpxe"),
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(a.state().join("boot/undionly.kpxe")).unwrap()
    );
    // curl negotiated the options: its trace shows our OACK's blksize and tsize.
    let o = Command::new("curl")
        .args([
            "-v",
            "-sS",
            "--tftp-blksize",
            "1468",
            "-o",
            "/dev/null",
            &format!("tftp://127.0.0.1:{tftp}/undionly.kpxe"),
        ])
        .output()
        .unwrap();
    let trace = String::from_utf8_lossy(&o.stderr);
    assert!(
        trace.contains("blksize") && trace.contains("1468"),
        "{trace}"
    );
    assert!(
        trace.contains("tsize") && trace.contains("800000"),
        "{trace}"
    );
    // Default block size too, and the chain script written for iPXE.
    let o = Command::new("curl")
        .args(["-sS", &format!("tftp://127.0.0.1:{tftp}/chain.ipxe")])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).contains("boot.ipxe?mac=${netX/mac}"));
    for bad in ["../config.toml", "%2e%2e/config.toml", "missing.bin"] {
        let o = Command::new("curl")
            .args([
                "-sS",
                "-o",
                "/dev/null",
                &format!("tftp://127.0.0.1:{tftp}/{bad}"),
            ])
            .output()
            .unwrap();
        assert!(!o.status.success(), "{bad} was served");
    }
}

fn request(kind: MessageType, arch: u16) -> Message {
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_xid(0xb0a)
        .set_chaddr(&[0x52, 0x54, 0, 0xaa, 0xbb, 0xcc]);
    m.opts_mut().insert(DhcpOption::MessageType(kind));
    m.opts_mut().insert(DhcpOption::ClassIdentifier(
        b"PXEClient:Arch:00007:UNDI:003016".to_vec(),
    ));
    m.opts_mut()
        .insert(DhcpOption::ClientSystemArchitecture(Architecture::from(
            arch,
        )));
    m
}

#[test]
fn the_proxy_answers_the_uefi_boot_server_request_on_4011() {
    let (a, proxy, _) = boot_appliance("proxy");
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let mut buf = Vec::new();
    request(MessageType::Request, 7)
        .encode(&mut Encoder::new(&mut buf))
        .unwrap();
    s.send_to(&buf, ("127.0.0.1", proxy)).unwrap();
    let mut rb = [0u8; 1500];
    let n = s.recv(&mut rb).unwrap();
    let ack = Message::decode(&mut Decoder::new(&rb[..n])).unwrap();
    assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
    assert_eq!(ack.xid(), 0xb0a);
    assert_eq!(ack.siaddr(), std::net::Ipv4Addr::LOCALHOST);
    assert!(
        matches!(ack.opts().get(OptionCode::BootfileName), Some(DhcpOption::BootfileName(f)) if f == b"snponly.efi")
    );
    // Garbage and non-PXE requests get nothing; the server keeps answering.
    s.send_to(b"not dhcp", ("127.0.0.1", proxy)).unwrap();
    // The record of who booted what is written after the answer (in the background).
    let leases = wait_for("the boot record", 5, || {
        let l = a.cli_json(&["boot", "leases"]);
        (!l["items"].as_array()?.is_empty()).then_some(l)
    });
    assert_eq!(leases["items"][0]["mac"], "52:54:00:aa:bb:cc");
    assert_eq!(leases["items"][0]["file"], "snponly.efi");
    s.send_to(&buf, ("127.0.0.1", proxy)).unwrap();
    assert!(s.recv(&mut rb).is_ok());
}

/// A TFTP download by curl: the bytes, or curl's exit code (68: the server said "file not found").
fn tftp_get(port: u16, name: &str) -> Result<Vec<u8>, i32> {
    let o = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "10",
            &format!("tftp://127.0.0.1:{port}/{name}"),
        ])
        .output()
        .unwrap();
    if o.status.success() {
        Ok(o.stdout)
    } else {
        Err(o.status.code().unwrap_or(-1))
    }
}

/// A read request for `name` with plain UDP: the TFTP error's code and message, as the server
/// sent them (a client such as GRUB prints the message).
fn tftp_error(port: u16, name: &str) -> (u16, String) {
    let s = tftp_socket(5000);
    s.send_to(&rrq(name, &[]), ("127.0.0.1", port)).unwrap();
    let mut b = [0u8; 1024];
    let (n, _) = s.recv_from(&mut b).unwrap();
    assert_eq!(&b[..2], &[0, 5], "not an error packet: {:?}", &b[..n]);
    let code = u16::from_be_bytes([b[2], b[3]]);
    let msg = String::from_utf8_lossy(&b[4..n])
        .trim_end_matches('\0')
        .to_string();
    (code, msg)
}

/// The Secure Boot chain's GRUB reads everything over TFTP: `grub/grub.cfg` (written at start),
/// then its per-machine configuration and per-boot initrd, which the TFTP server makes per
/// request with the same rules as `boot.ipxe` over HTTP: refused by name, writing nothing, for a
/// MAC the boot server's DHCP did not see at the asking address; the per-boot initrd is the
/// ramdisk with the archive appended, served once.
#[test]
fn grubs_configuration_and_per_boot_initrd_over_tftp_follow_the_boot_script_rules() {
    let (mut a, _, tftp) = boot_appliance("dhcp");
    let root = a.state().join("boot");
    std::fs::write(root.join("vmlinuz"), b"kernel").unwrap();
    std::fs::write(root.join("initrd.img"), b"ramdisk").unwrap();
    let chain = String::from_utf8(tftp_get(tftp, "/grub/grub.cfg").unwrap()).unwrap();
    assert!(
        chain.contains("configfile (tftp,127.0.0.1)/grub/${net_default_mac}.cfg"),
        "{chain}"
    );
    let mac = "52:54:00:aa:bb:01";
    let before = a.snapshot();
    let (code, msg) = tftp_error(tftp, &format!("/grub/{mac}.cfg"));
    assert_eq!(code, 2);
    assert!(
        msg.contains(&format!(
            "the boot server's DHCP did not see {mac} at 127.0.0.1"
        )),
        "{msg}"
    );
    assert_eq!(
        a.snapshot(),
        before,
        "a refused configuration wrote something"
    );
    for bad in [
        "/grub/not-a-mac.cfg",
        "/per-boot/00ff/initrd.img",
        "/per-boot/x.cpio",
    ] {
        assert_eq!(tftp_get(tftp, bad), Err(68), "{bad}");
    }
    assert_eq!(
        tftp_get(tftp, &format!("/per-boot/{}/initrd.img", "ab".repeat(16))),
        Err(68)
    );
    assert_eq!(a.snapshot(), before);

    // With sightings not required (docs/config.md), the configuration is made: GRUB's words.
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    // (and a gateway for the ramdisk to join through).
    std::fs::write(
        &cfg,
        format!("gateway_url = \"https://127.0.0.1:8443\"\n{text}")
            .replace("[boot]\n", "[boot]\nrequire_sighting = false\n"),
    )
    .unwrap();
    a.restart();
    let got = tftp_get(tftp, &format!("/grub/{mac}.cfg"));
    if got.is_err() {
        panic!(
            "refused: {:?}",
            tftp_error(tftp, &format!("/grub/{mac}.cfg"))
        );
    }
    let grub = String::from_utf8(got.unwrap()).unwrap();
    assert!(grub.contains("linux (tftp,127.0.0.1)/vmlinuz "), "{grub}");
    let nonce = grub
        .split("per-boot/")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .unwrap()
        .to_string();
    // Asked again from the same address (a TFTP source address can be forged blind) while the
    // archive waits: the same archive, nothing minted, voided or counted, however often (past
    // the per-MAC rate of 12 a minute).
    for _ in 0..15 {
        let again =
            String::from_utf8(tftp_get(tftp, &format!("/grub/{mac}.cfg")).unwrap()).unwrap();
        assert_eq!(again, grub);
    }
    let name = format!("/per-boot/{nonce}/initrd.img");
    let initrd = tftp_get(tftp, &name).unwrap();
    // The ramdisk, zero padding to four bytes, then the newc archive with the token in it.
    assert_eq!(&initrd[..8], b"ramdisk\0");
    assert_eq!(&initrd[8..14], b"070701");
    assert!(initrd.windows(15).any(|w| w == b"discovery-token"));
    // Served once.
    assert_eq!(tftp_get(tftp, &name), Err(68));
}

/// A plain UDP socket toward the TFTP server at `port`, reads timing out after `ms`.
fn tftp_socket(ms: u64) -> std::net::UdpSocket {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_millis(ms)))
        .unwrap();
    s
}

fn rrq(name: &str, opts: &[(&str, &str)]) -> Vec<u8> {
    let mut v = vec![0, 1];
    v.extend_from_slice(name.as_bytes());
    v.extend_from_slice(b"\0octet\0");
    for (k, val) in opts {
        v.extend_from_slice(k.as_bytes());
        v.push(0);
        v.extend_from_slice(val.as_bytes());
        v.push(0);
    }
    v
}

/// The attacks of the boot review on the TFTP transfer itself: a retransmitted request starts no
/// second transfer; a client repeating a stale ACK loses its place after a few rounds instead of
/// holding it for ever; a timeout the server does not honour is not echoed in the OACK.
#[test]
fn tftp_retransmissions_stale_acks_and_long_timeouts_hold_nothing() {
    let (_a, _, tftp) = boot_appliance("proxy");
    // The same request twice from one port: one transfer answers (one server port), no error.
    let s = tftp_socket(1500);
    let req = rrq("undionly.kpxe", &[]);
    s.send_to(&req, ("127.0.0.1", tftp)).unwrap();
    s.send_to(&req, ("127.0.0.1", tftp)).unwrap();
    let mut ports = std::collections::HashSet::new();
    let mut b = [0u8; 2048];
    while let Ok((n, from)) = s.recv_from(&mut b) {
        assert_ne!(
            &b[..2],
            &[0, 5],
            "an error: {:?}",
            String::from_utf8_lossy(&b[4..n])
        );
        ports.insert(from.port());
        if ports.len() > 1 {
            break;
        }
    }
    assert_eq!(
        ports.len(),
        1,
        "a retransmitted request started a second transfer"
    );

    // A stale ACK (block 0) again and again: the server gives up within six rounds.
    let s = tftp_socket(500);
    s.send_to(&rrq("undionly.kpxe", &[]), ("127.0.0.1", tftp))
        .unwrap();
    let (_, from) = s.recv_from(&mut b).unwrap();
    let mut data_after = 0;
    for i in 0..12 {
        s.send_to(&[0, 4, 0, 0], from).unwrap();
        while let Ok((_, f)) = s.recv_from(&mut b) {
            if f == from && i >= 7 {
                data_after += 1;
            }
        }
    }
    assert_eq!(data_after, 0, "stale ACKs kept the transfer alive");

    // timeout=255 is not echoed (the server waits 10 s at most); timeout=5 is.
    let oack_of = |t: &str| {
        let s = tftp_socket(3000);
        s.send_to(
            &rrq("snponly.efi", &[("timeout", t), ("tsize", "0")]),
            ("127.0.0.1", tftp),
        )
        .unwrap();
        let mut b = [0u8; 2048];
        let (n, _) = s.recv_from(&mut b).unwrap();
        assert_eq!(&b[..2], &[0, 6], "not an OACK");
        String::from_utf8_lossy(&b[2..n]).replace('\0', " ")
    };
    let o = oack_of("255");
    assert!(!o.contains("timeout") && o.contains("tsize 3"), "{o}");
    let o = oack_of("5");
    assert!(o.contains("timeout 5"), "{o}");
}

#[test]
fn boot_files_are_read_beneath_the_boot_root_and_links_out_of_it_are_refused() {
    for privsep in [true, false] {
        let (a, _, tftp) = boot_appliance_with("proxy", privsep);
        let root = a.state().join("boot");
        // Links out of the boot root, to the database and the config, and one that stays inside.
        std::os::unix::fs::symlink(a.state().join("bca.db"), root.join("db.bin")).unwrap();
        std::os::unix::fs::symlink("../config.toml", root.join("up.bin")).unwrap();
        std::os::unix::fs::symlink("snponly.efi", root.join("inside.bin")).unwrap();
        let before = a.snapshot();
        assert_eq!(
            tftp_get(tftp, "inside.bin").unwrap(),
            b"efi",
            "privsep {privsep}"
        );
        assert_eq!(
            curl(&a, "/api/compute/boot/files/inside.bin", "GET"),
            (200, "efi".into())
        );
        // Refused as a missing file is: nothing says what the link pointed at.
        for bad in ["db.bin", "up.bin", "missing.bin"] {
            assert_eq!(tftp_get(tftp, bad), Err(68), "{bad}");
            let (status, body) = curl(&a, &format!("/api/compute/boot/files/{bad}"), "GET");
            assert_eq!(status, 404, "{bad}: {body}");
            assert!(body.contains("NOT_FOUND"), "{body}");
        }
        // The server keeps serving, and nothing changed.
        assert_eq!(tftp_get(tftp, "snponly.efi").unwrap(), b"efi");
        assert_eq!(a.snapshot(), before);
        // doctor names the links that lead out, and not the one inside.
        let o = a.cli(&["doctor"]);
        let text = String::from_utf8_lossy(&o.stdout);
        let line = text
            .lines()
            .find(|l| l.starts_with("WARN boot files"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(
            line.contains("db.bin -> ") && line.contains("up.bin -> ../config.toml"),
            "{line}"
        );
        assert!(!line.contains("inside.bin"), "{line}");
    }
}

/// Full DHCP behind a relay (`[[boot.subnets]]`): a DISCOVER and a REQUEST the listed relay
/// forwards (`giaddr`) get an address from the relay's subnet, with its netmask and router,
/// answered to the relay's port 67 (the relay here is 127.0.0.1, which listens there); the boot
/// lease records the relay. A packet naming a relay that is not listed gets nothing.
#[test]
fn a_relayed_discover_gets_an_address_from_the_relays_subnet_answered_to_the_relay() {
    let (a, _, _) = boot_appliance_with("dhcp", true);
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let boot = text
        .split("[boot]")
        .nth(1)
        .unwrap()
        .split("\n[")
        .next()
        .unwrap();
    let boot = format!(
        "[boot]{boot}\nrelays = [\"127.0.0.1\"]\n\n[[boot.subnets]]\nrelay = \"127.0.0.1\"\n\
         range_start = \"127.0.5.10\"\nrange_end = \"127.0.5.20\"\nnetmask = \"255.255.0.0\"\n\
         router = \"127.0.0.1\"\n"
    );
    std::fs::write(&cfg, replace_table(&text, "boot", &boot)).unwrap();
    let mut a = a;
    a.restart();
    // The relay: 127.0.0.1:67, where a relay's server answers go.
    let relay = std::net::UdpSocket::bind("127.0.0.1:67").expect("port 67 (the tests run as root)");
    relay
        .set_read_timeout(Some(std::time::Duration::from_secs(5)))
        .unwrap();
    let server = ("127.0.0.1", dhcp_port(&a));
    let relayed = |kind: MessageType, giaddr: &str, ip: Option<std::net::Ipv4Addr>| {
        let mut m = request(kind, 7);
        m.set_giaddr(giaddr.parse::<std::net::Ipv4Addr>().unwrap());
        if let Some(ip) = ip {
            m.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
        }
        let mut buf = Vec::new();
        m.encode(&mut Encoder::new(&mut buf)).unwrap();
        buf
    };
    relay
        .send_to(&relayed(MessageType::Discover, "127.0.0.1", None), server)
        .unwrap();
    let mut rb = [0u8; 1500];
    let n = relay.recv(&mut rb).expect("the OFFER, sent to the relay");
    let offer = Message::decode(&mut Decoder::new(&rb[..n])).unwrap();
    assert_eq!(offer.opts().msg_type(), Some(MessageType::Offer));
    let ip = offer.yiaddr();
    assert!(
        (u32::from("127.0.5.10".parse::<std::net::Ipv4Addr>().unwrap())
            ..=u32::from("127.0.5.20".parse::<std::net::Ipv4Addr>().unwrap()))
            .contains(&u32::from(ip)),
        "{ip} is not from the relay's subnet"
    );
    assert_eq!(offer.giaddr().to_string(), "127.0.0.1");
    assert!(matches!(
        offer.opts().get(OptionCode::SubnetMask),
        Some(DhcpOption::SubnetMask(m)) if m.to_string() == "255.255.0.0"
    ));
    relay
        .send_to(
            &relayed(MessageType::Request, "127.0.0.1", Some(ip)),
            server,
        )
        .unwrap();
    let n = relay.recv(&mut rb).expect("the ACK, sent to the relay");
    let ack = Message::decode(&mut Decoder::new(&rb[..n])).unwrap();
    assert_eq!(ack.opts().msg_type(), Some(MessageType::Ack));
    assert_eq!(ack.yiaddr(), ip);
    let leases = wait_for("the boot record", 5, || {
        let l = a.cli_json(&["boot", "leases"]);
        (!l["items"].as_array()?.is_empty()).then_some(l)
    });
    assert_eq!(leases["items"][0]["relay"], "127.0.0.1", "{leases}");
    assert_eq!(leases["items"][0]["ip"], ip.to_string(), "{leases}");

    // A relay nobody listed: no OFFER (counted on /metrics: no answer went out).
    let answers = |a: &Appliance| {
        let (_, body) = curl(a, "/metrics", "GET");
        body.lines()
            .find_map(|l| l.strip_prefix("bca_dhcp_answers_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(-1.0)
    };
    let before = answers(&a);
    let mut m = request(MessageType::Discover, 7);
    m.set_chaddr(&[0x52, 0x54, 0, 0xaa, 0xbb, 0xcd]);
    m.set_giaddr("10.66.0.1".parse::<std::net::Ipv4Addr>().unwrap());
    let mut buf = Vec::new();
    m.encode(&mut Encoder::new(&mut buf)).unwrap();
    relay.send_to(&buf, server).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        answers(&a),
        before,
        "a packet from an unlisted relay was answered"
    );
}
