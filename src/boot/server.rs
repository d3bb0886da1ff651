//! The boot server's sockets: DHCP on 67 (and 4011 in proxy mode) and TFTP on 69, bound to the
//! provisioning interface when one is configured. What to answer is decided in `dhcp` and `tftp`.

use crate::app::App;
use crate::boot::dhcp::{self, Files, ReplyCtx};
use dhcproto::{Decodable, Decoder, Encodable, Encoder};
use socket2::{Domain, Protocol, Socket, Type};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use tokio::net::UdpSocket;
use tokio::sync::watch;

fn udp(addr: &str, interface: Option<&str>, broadcast: bool) -> Result<UdpSocket, String> {
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
    s.bind(&addr.into())
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    UdpSocket::from_std(s.into()).map_err(|e| e.to_string())
}

fn files(app: &App) -> Files {
    let root = crate::boot::http::boot_root(app);
    Files {
        undionly: root.join("undionly.kpxe").is_file(),
        ipxe_efi: root.join("ipxe.efi").is_file(),
        snponly: root.join("snponly.efi").is_file(),
        arm64: root.join("ipxe-arm64.efi").is_file(),
    }
}

/// The address leased to `mac` (extended), or the first free one of the range.
fn allocate(app: &App, mac: &str, now: i64) -> Option<Ipv4Addr> {
    let b = &app.config.boot;
    let (start, end) = (u32::from(b.range_start?), u32::from(b.range_end?));
    let until = now + b.lease_seconds as i64;
    app.store
        .write(|tx| {
            let mine: Option<String> = rusqlite::OptionalExtension::optional(tx.query_row(
                "SELECT ip FROM dhcp_leases WHERE mac = ?1",
                [mac],
                |r| r.get(0),
            ))?;
            if let Some(ip) = mine.and_then(|s| s.parse::<Ipv4Addr>().ok()) {
                tx.execute(
                    "UPDATE dhcp_leases SET expires_at = ?2 WHERE mac = ?1",
                    rusqlite::params![mac, until],
                )?;
                return Ok(Some(ip));
            }
            let taken: std::collections::HashSet<String> = tx
                .prepare("SELECT ip FROM dhcp_leases WHERE expires_at > ?1")?
                .query_map([now], |r| r.get(0))?
                .collect::<Result<_, _>>()?;
            for n in start..=end {
                let ip = Ipv4Addr::from(n);
                if Some(ip) == b.server_ip || taken.contains(&ip.to_string()) {
                    continue;
                }
                tx.execute("DELETE FROM dhcp_leases WHERE ip = ?1", [ip.to_string()])?;
                tx.execute(
                    "INSERT INTO dhcp_leases (mac, ip, expires_at) VALUES (?1, ?2, ?3)",
                    rusqlite::params![mac, ip.to_string(), until],
                )?;
                return Ok(Some(ip));
            }
            tracing::warn!(%mac, "dhcp: the range is exhausted");
            Ok(None)
        })
        .ok()
        .flatten()
}

async fn answer(
    app: &Arc<App>,
    buf: &[u8],
    port_4011: bool,
    http_base: &str,
) -> Option<(Vec<u8>, dhcproto::v4::Message)> {
    let req = dhcproto::v4::Message::decode(&mut Decoder::new(buf)).ok()?;
    let b = &app.config.boot;
    let proxy = b.mode == "proxy";
    let mac = dhcp::mac_of(&req)?;
    let lease = if proxy {
        None
    } else {
        let app2 = app.clone();
        let mac2 = mac.clone();
        tokio::task::spawn_blocking(move || allocate(&app2, &mac2, crate::clock::now()))
            .await
            .ok()
            .flatten()
    };
    let files = files(app);
    let ctx = ReplyCtx {
        server_ip: b.server_ip?,
        http_base,
        files: &files,
        lease,
        netmask: b.netmask,
        router: b.router,
        dns: &b.dns,
        lease_seconds: b.lease_seconds,
    };
    let reply = dhcp::reply(&req, proxy, port_4011, &ctx)?;
    let mut out = Vec::new();
    reply.encode(&mut Encoder::new(&mut out)).ok()?;
    if let Some(c) = dhcp::classify(&req) {
        let file = reply
            .fname_str()
            .and_then(|r| r.ok())
            .map(|s| s.trim_end_matches('\0').to_string());
        let app2 = app.clone();
        let ip = lease.map(|l| l.to_string());
        tokio::task::spawn_blocking(move || {
            crate::boot::http::lease(
                &app2,
                &c.mac,
                ip,
                Some(c.arch),
                if c.ipxe { "dhcp-ipxe" } else { "dhcp" },
                file.as_deref(),
            )
        });
    }
    Some((out, req))
}

async fn dhcp_loop(app: Arc<App>, sock: UdpSocket, port_4011: bool, http_base: String) {
    let mut buf = vec![0u8; 1500];
    loop {
        let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
            return;
        };
        let m = crate::metrics::get();
        m.dhcp_requests
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some((out, req)) = answer(&app, &buf[..n], port_4011, &http_base).await else {
            continue;
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

/// Starts DHCP and TFTP when `[boot] enabled`; the HTTP side is served by the public listener.
pub fn start(
    app: Arc<App>,
    http_local: Option<SocketAddr>,
    stop: watch::Receiver<bool>,
) -> Result<(), String> {
    let b = app.config.boot.clone();
    if !b.enabled {
        return Ok(());
    }
    let iface = b.interface.as_deref();
    let http_base = crate::boot::http::http_url(&app, http_local);
    let mut tasks = Vec::new();
    let main = udp(&b.listen_dhcp, iface, true)?;
    tasks.push(tokio::spawn(dhcp_loop(
        app.clone(),
        main,
        false,
        http_base.clone(),
    )));
    if b.mode == "proxy" {
        let s = udp(&b.listen_proxy, iface, true)?;
        tasks.push(tokio::spawn(dhcp_loop(
            app.clone(),
            s,
            true,
            http_base.clone(),
        )));
    }
    let tftp = udp(&b.listen_tftp, iface, false)?;
    let root = crate::boot::http::boot_root(&app);
    std::fs::create_dir_all(&root)
        .map_err(|e| format!("cannot create the boot root {}: {e}", root.display()))?;
    // iPXE fetches this over TFTP; it chains to the per-machine script over HTTP.
    std::fs::write(
        root.join("chain.ipxe"),
        crate::boot::http::chain_script(&http_base),
    )
    .map_err(|e| format!("cannot write chain.ipxe: {e}"))?;
    let on_transfer: crate::boot::tftp::OnTransfer =
        Arc::new(|peer, file| tracing::info!(%peer, %file, "tftp: sent"));
    tasks.push(tokio::spawn(crate::boot::tftp::serve(
        tftp,
        root,
        b.tftp_max_transfers,
        on_transfer,
    )));
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
