//! Hostile input over the network, with well-behaved clients in the same test that must keep being
//! served: the gateway against slow, oversize, truncated and garbage clients, a connection flood
//! and a join flood from one source; DHCP and TFTP against malformed, oversize and flooding
//! packets. The limits are per source (the attacker's traffic comes from 127.0.0.2/.3, the good
//! clients' from 127.0.0.1) and set here in config.toml.

use crate::common::*;
use bca::proto::protocol::Reply;
use serde_json::json;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn hostile_appliance() -> Appliance {
    Appliance::start_cfg("file", &[], |c| {
        replace_table(
            &c,
            "sessions",
            "[sessions]\nmax_connections_per_source = 8\njoins_per_source_per_minute = 10\nrequest_deadline_seconds = 2\n",
        )
    })
}

/// A TCP connection to `to` from the loopback address `from`.
fn tcp_from(from: &str, to: &str) -> TcpStream {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    s.bind(&format!("{from}:0").parse::<SocketAddr>().unwrap().into())
        .unwrap();
    s.connect(&to.parse::<SocketAddr>().unwrap().into())
        .unwrap();
    s.into()
}

/// Whether the server closed `s` within `within` (a read returns 0 or an error).
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 64];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// A join sent from the source address `from` over TLS; the reply's bytes.
fn join_from(a: &Appliance, from: &str, token: &str) -> Vec<u8> {
    let sim = Sim::new(a);
    let (req, _, _) = sim.join_request(token, &machine(), "node", None, bca::base::clock::now());
    send_from(a, from, req)
}

#[test]
fn the_gateway_survives_slow_garbage_oversize_and_flooding_clients() {
    let a = hostile_appliance();
    let pool = a.pool("p1");
    let (_, good_token) = a.token(&pool, json!({"maxUses": 10}));
    let good = Sim::new(&a);

    // Slowloris: the attacker holds connections open and sends nothing. Past the per-source limit
    // (8) they are closed at once; the rest are closed at the request deadline (2 s).
    let mut held: Vec<TcpStream> = (0..12).map(|_| tcp_from("127.0.0.2", &a.gateway)).collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut over = 0;
    for s in held.iter_mut() {
        if closed_within(s, Duration::from_millis(200)) {
            over += 1;
        }
    }
    assert_eq!(
        over, 4,
        "connections past the per-source limit are closed at accept"
    );
    // Meanwhile the well-behaved client joins.
    good.admitted(&good_token, &machine());
    let t = Instant::now();
    for s in held.iter_mut() {
        assert!(
            closed_within(s, Duration::from_secs(4)),
            "a silent connection outlived the deadline"
        );
    }
    assert!(t.elapsed() < Duration::from_secs(4));

    // Garbage before the handshake, a TLS client that never finishes, and bytes after close.
    let mut g = tcp_from("127.0.0.2", &a.gateway);
    g.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert!(closed_within(&mut g, Duration::from_secs(3)));
    let mut g = tcp_from("127.0.0.2", &a.gateway);
    g.write_all(&[0x16, 0x03, 0x01, 0xff, 0xff, 0x01]).unwrap(); // a ClientHello header, cut
    assert!(closed_within(&mut g, Duration::from_secs(4)));
    good.admitted(&good_token, &machine());

    // Oversize and truncated frames over a real TLS session.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        use tokio::io::AsyncWriteExt;
        let mut s = bca::agent::connect(&good.cfg, None).await.unwrap();
        s.write_all(&(10u32 << 20).to_be_bytes()).await.unwrap();
        s.flush().await.unwrap();
        let reply = bca::proto::protocol::read_frame(&mut s).await.unwrap();
        let r: Reply = serde_json::from_slice(&reply).unwrap();
        let e = r.error.unwrap();
        assert_eq!(e.code, "INVALID_INPUT");
        assert!(e.message.contains("larger than 65536"), "{}", e.message);
        let mut s = bca::agent::connect(&good.cfg, None).await.unwrap();
        s.write_all(&100u32.to_be_bytes()).await.unwrap();
        s.write_all(b"{\"v\":1").await.unwrap();
        s.shutdown().await.unwrap();
        let r = bca::proto::protocol::read_frame(&mut s).await;
        assert!(r.is_err(), "a truncated frame got an answer");
    });
    good.admitted(&good_token, &machine());

    // A join flood from one source: past 10 a minute it is told to retry (UNAVAILABLE, the same
    // bytes as a full queue), while the good client from another source is admitted.
    let (_, flood_token) = a.token(&pool, json!({"maxUses": 100}));
    let busy = Reply::from_outcome(bca::proto::protocol::Outcome::Busy).to_bytes();
    let mut refused_busy = 0;
    for _ in 0..14 {
        let raw = join_from(&a, "127.0.0.3", &flood_token);
        if raw == busy {
            refused_busy += 1;
        } else {
            let r: Reply = serde_json::from_slice(&raw).unwrap();
            assert!(
                r.join_response.is_some(),
                "{}",
                String::from_utf8_lossy(&raw)
            );
        }
    }
    assert_eq!(
        refused_busy, 4,
        "joins past the source's rate are answered UNAVAILABLE"
    );
    good.admitted(&good_token, &machine());
    assert_eq!(a.cli_json(&["health"])["status"], "ok");
}

/// `[sessions] max_handshakes`: when every handshake place is taken, a new connection waits in
/// the kernel's accept queue (its deadline not yet running) and is served once a place frees; it
/// is neither refused nor timed out.
#[test]
fn a_gateway_with_every_handshake_place_taken_makes_new_connections_wait_not_fail() {
    let a = Appliance::start_cfg("file", &[], |c| {
        replace_table(
            &c,
            "sessions",
            "[sessions]\nmax_handshakes = 2\nrequest_deadline_seconds = 30\n",
        )
    });
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 10}));
    let good = Arc::new(Sim::new(&a));
    // Two silent connections hold both places.
    let mut held: Vec<TcpStream> = (0..2).map(|_| tcp_from("127.0.0.2", &a.gateway)).collect();
    std::thread::sleep(Duration::from_millis(300));
    let (tx, rx) = std::sync::mpsc::channel();
    {
        let (good, token) = (good.clone(), token.clone());
        std::thread::spawn(move || {
            let body = good.admitted(&token, &machine());
            let _ = tx.send(body.node_id);
        });
    }
    assert!(
        rx.recv_timeout(Duration::from_millis(1500)).is_err(),
        "a join was served while every handshake place was held"
    );
    assert_eq!(a.count("SELECT COUNT(*) FROM nodes"), 0);
    // One holder leaves: its place goes to the waiting join, which is admitted.
    drop(held.remove(0));
    let node = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("the waiting join was answered once a place was free");
    assert_eq!(
        a.count(&format!("SELECT COUNT(*) FROM nodes WHERE id = '{node}'")),
        1
    );
    // The remaining holder still has its place; the freed one serves joins one after another.
    good.admitted(&token, &machine());
    assert!(!closed_within(&mut held[0], Duration::from_millis(100)));
    assert_eq!(a.count("SELECT COUNT(*) FROM nodes"), 2);
}

#[test]
fn dhcp_and_tftp_survive_malformed_oversize_and_flooding_packets() {
    let (dhcp, proxy, tftp) = (free_udp(), free_udp(), free_udp());
    let a = Appliance::start_cfg("file", &[], |c| {
        replace_table(
            &c,
            "boot",
            &format!(
                "[boot]\nenabled = true\nmode = \"proxy\"\nserver_ip = \"127.0.0.1\"\nlisten_dhcp = \"127.0.0.1:{dhcp}\"\n\
                 listen_proxy = \"127.0.0.1:{proxy}\"\nlisten_tftp = \"127.0.0.1:{tftp}\"\ntftp_max_per_source = 4\n"
            ),
        )
    });
    let root = a.state().join("boot");
    std::fs::create_dir_all(&root).unwrap();
    let file: Vec<u8> = (0..400_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(root.join("undionly.kpxe"), &file).unwrap();
    std::fs::write(root.join("snponly.efi"), b"efi").unwrap();
    let mut a = a;
    a.restart();

    // DHCP: garbage, an oversize datagram with a hostile hardware-address length, a request with
    // hundreds of options; to both ports. Nothing crashes; the proxy port then still answers a
    // well-formed request.
    let u = std::net::UdpSocket::bind("127.0.0.2:0").unwrap();
    let mut flood = pxe_request(0x11);
    flood.truncate(flood.len() - 1); // drop the End option
    for i in 0..300u32 {
        flood.extend_from_slice(&[224 + (i % 30) as u8, 2, 0, 0]);
    }
    flood.push(255);
    let mut hostile_hlen = pxe_request(0x12);
    hostile_hlen[2] = 65; // hlen
    for port in [dhcp, proxy] {
        let to = format!("127.0.0.1:{port}");
        u.send_to(b"\x01\x02garbage", &to).unwrap();
        u.send_to(&vec![0x41u8; 4000], &to).unwrap();
        u.send_to(&hostile_hlen, &to).unwrap();
        u.send_to(&flood, &to).unwrap();
    }
    let mut buf = [0u8; 1500];
    let good = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    good.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    good.send_to(&pxe_request(0x22), format!("127.0.0.1:{proxy}"))
        .unwrap();
    let (n, _) = good
        .recv_from(&mut buf)
        .expect("a well-formed request is answered");
    let m = <dhcproto::v4::Message as dhcproto::Decodable>::decode(&mut dhcproto::Decoder::new(
        &buf[..n],
    ))
    .unwrap();
    assert_eq!(m.xid(), 0x22);

    // TFTP: malformed and oversize requests get an error or nothing; a write is refused; past 4
    // transfers from one source the rest are told the server is busy; another source still gets
    // its file whole.
    let to = format!("127.0.0.1:{tftp}");
    let t = std::net::UdpSocket::bind("127.0.0.2:0").unwrap();
    t.set_read_timeout(Some(Duration::from_millis(800)))
        .unwrap();
    t.send_to(b"\x00\x01no-terminator", &to).unwrap();
    t.recv_from(&mut buf).unwrap();
    assert_eq!(&buf[..2], &[0, 5], "a malformed request gets a TFTP error");
    t.send_to(&vec![0u8; 3000], &to).unwrap();
    t.send_to(b"\x00\x02x\x00octet\x00", &to).unwrap();
    let (n, _) = t.recv_from(&mut buf).unwrap();
    assert!(
        String::from_utf8_lossy(&buf[4..n]).contains("read-only"),
        "{:?}",
        &buf[..n]
    );
    // Five RRQs from one source, never acknowledged: the fifth is refused.
    let holders: Vec<std::net::UdpSocket> = (0..5)
        .map(|_| std::net::UdpSocket::bind("127.0.0.2:0").unwrap())
        .collect();
    let mut busy = 0;
    for h in &holders {
        h.set_read_timeout(Some(Duration::from_millis(800)))
            .unwrap();
        h.send_to(b"\x00\x01undionly.kpxe\x00octet\x00", &to)
            .unwrap();
        let (n, _) = h.recv_from(&mut buf).unwrap();
        if buf[..2] == [0, 5] && String::from_utf8_lossy(&buf[4..n]).contains("busy") {
            busy += 1;
        }
    }
    assert_eq!(busy, 1, "the fifth transfer from one source is refused");
    let o = std::process::Command::new("curl")
        .args([
            "-s",
            "--tftp-blksize",
            "1428",
            &format!("tftp://127.0.0.1:{tftp}/undionly.kpxe"),
        ])
        .output()
        .unwrap();
    assert!(
        o.stdout == file,
        "the good client's file differs ({} bytes)",
        o.stdout.len()
    );
    assert_eq!(a.cli_json(&["health"])["status"], "ok");
}

/// A UEFI PXE client's request to the proxy's port 4011.
fn pxe_request(xid: u32) -> Vec<u8> {
    use dhcproto::v4::{DhcpOption, Message, MessageType, Opcode};
    use dhcproto::Encodable;
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_xid(xid)
        .set_chaddr(&[0x52, 0x54, 0, 0xaa, 0xbb, xid as u8]);
    m.opts_mut()
        .insert(DhcpOption::MessageType(MessageType::Request));
    m.opts_mut().insert(DhcpOption::ClassIdentifier(
        b"PXEClient:Arch:00007:UNDI:003016".to_vec(),
    ));
    m.opts_mut().insert(DhcpOption::ClientSystemArchitecture(
        dhcproto::v4::Architecture::from(7u16),
    ));
    let mut out = Vec::new();
    m.encode(&mut dhcproto::Encoder::new(&mut out)).unwrap();
    out
}
