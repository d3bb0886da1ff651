//! The network child's `main`: it reads its init message and descriptors, confines itself, and
//! runs the gateway and the edge with a [`Link`] to the parent.

use super::link::*;
use super::wire::*;
use crate::edge::gateway::{Gateway, GatewayCert};
use rustls::SignatureScheme;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use tokio::sync::watch;

/// `bca net-child`: started by `serve` only, with the socketpair as its standard input.
pub fn child_main() -> Result<(), String> {
    // A session of its own: no controlling terminal to push input into (TIOCSTI).
    let _ = rustix::process::setsid();
    // No core dump and no ptrace by its own user: it holds the session-ticket keys.
    let _ = rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable);
    let sock = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map(UnixStream::from)
        .map_err(|e| format!("privsep: standard input: {e}"))?;
    let mut fds = recv_fds(&sock)?.into_iter();
    let init: Init = match read_sync(&mut &sock).map_err(|e| e.to_string())? {
        Some((_, Kind::Init, p)) => {
            let p = zeroize::Zeroizing::new(p);
            serde_json::from_slice(&p).map_err(|e| format!("privsep: the init message: {e}"))?
        }
        _ => return Err("privsep: no init message".into()),
    };
    let mut next = |what: &str| {
        fds.next().ok_or_else(|| {
            format!("privsep: no {what} was passed (bca net-child is started by bca serve only)")
        })
    };
    // In the order `Sockets::fds` passes them.
    let sockets = Sockets {
        gateway: std::net::TcpListener::from(next("gateway listener")?),
        http: std::net::TcpListener::from(next("HTTP listener")?),
        boot_root: crate::base::fsutil::ReadRoot::from_fd(next("boot root")?, init.roots.0.clone()),
        downloads: crate::base::fsutil::ReadRoot::from_fd(
            next("downloads directory")?,
            init.roots.1.clone(),
        ),
        boot: if init.boot_sockets {
            let dhcp = std::net::UdpSocket::from(next("DHCP socket")?);
            let proxy = (init.boot.mode == "proxy")
                .then(|| next("proxyDHCP socket").map(std::net::UdpSocket::from))
                .transpose()?;
            let tftp = init
                .boot
                .tftp_on()
                .then(|| next("TFTP socket").map(std::net::UdpSocket::from))
                .transpose()?;
            Some(crate::edge::boot::server::BootSockets { dhcp, proxy, tftp })
        } else {
            None
        },
    };
    // Before the filter, which allows no copy of a descriptor.
    let out = sock.try_clone().map_err(|e| e.to_string())?;
    let dhcp_fds: Vec<std::os::fd::BorrowedFd<'_>> = sockets
        .boot
        .as_ref()
        .map(|b| {
            std::iter::once(b.dhcp.as_fd())
                .chain(b.proxy.as_ref().map(|p| p.as_fd()))
                .collect()
        })
        .unwrap_or_default();
    let (uid, landlock) = crate::daemon::confine::confine(
        init.user,
        &[sockets.boot_root.fd(), sockets.downloads.fd()],
        &sockets.shared(),
        &dhcp_fds,
    )?;
    drop(dhcp_fds);
    let Sockets {
        gateway: listener,
        http,
        boot_root,
        downloads,
        boot: boot_sockets,
    } = sockets;
    let probes = init
        .probe
        .iter()
        .map(|p| {
            let r = match std::fs::File::open(p) {
                Ok(_) => OPENED.to_string(),
                Err(e) => format!("refused: {e}"),
            };
            (p.clone(), r)
        })
        .collect();
    let ready = Ready {
        uid,
        landlock,
        seccomp: true,
        probes,
    };

    let outbox = Arc::new(Outbox::new(out));
    {
        let outbox = outbox.clone();
        std::thread::Builder::new()
            .name("privsep-out".into())
            .spawn(move || write_frames(&outbox))
            .map_err(|e| format!("privsep: the writer thread: {e}"))?;
    }
    let link = Arc::new(Link {
        out: outbox,
        pending: Default::default(),
        next: AtomicU64::new(0),
    });
    let scheme = SignatureScheme::from(init.scheme);
    let cert = Arc::new(GatewayCert::from_certified(remote_certified(
        &init.chain,
        link.clone(),
        scheme,
    )?));
    let node_ca = crate::base::crypto::b64_decode(&init.node_ca).ok_or("privsep: the node CA")?;
    let tickets = Arc::new(crate::edge::tickets::Tickets::from_keys(&init.tickets));
    let tls = crate::edge::gateway::server_config_with(cert.clone(), &node_ca, tickets.clone())?;
    let registry = Arc::new(crate::base::registry::Registry::default());
    let (stop_tx, stop_rx) = watch::channel(false);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("privsep: the runtime: {e}"))?;

    // The parent's messages, on a thread of their own.
    {
        let (link, registry, cert) = (link.clone(), registry.clone(), cert.clone());
        let tickets = tickets.clone();
        // Buffered: a storm's answers arrive many to a read.
        let mut rd = std::io::BufReader::with_capacity(BATCH, sock);
        let reader = std::thread::Builder::new().name("privsep-in".into());
        let spawned = reader.spawn(move || loop {
            match read_sync(&mut rd) {
                Ok(Some((id, Kind::Reply, p))) => link.answer(id, p),
                Ok(Some((_, Kind::Close, p))) => registry.close(&String::from_utf8_lossy(&p)),
                Ok(Some((_, Kind::Cert, p))) => {
                    match serde_json::from_slice::<Vec<String>>(&p)
                        .map_err(|e| e.to_string())
                        .and_then(|c| remote_certified(&c, link.clone(), scheme))
                    {
                        Ok(ck) => cert.replace_certified(ck),
                        Err(e) => tracing::error!(error = %e, "privsep: a new gateway certificate"),
                    }
                }
                Ok(Some((_, Kind::Stop, _))) => {
                    let _ = stop_tx.send(true);
                }
                Ok(Some((_, Kind::Tickets, p))) => {
                    let p = zeroize::Zeroizing::new(p);
                    match serde_json::from_slice::<crate::edge::tickets::TicketKeys>(&p) {
                        Ok(keys) => tickets.replace(&keys),
                        Err(e) => tracing::error!(error = %e, "privsep: the next ticket keys"),
                    }
                }
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => {
                    // The parent is gone: so are we.
                    std::process::exit(0);
                }
            }
        });
        spawned.map_err(|e| format!("privsep: the reader thread: {e}"))?;
    }
    link.send(
        0,
        Kind::Ready,
        &serde_json::to_vec(&ready).expect("serializes"),
    )
    .map_err(|e| format!("privsep: reporting to the parent: {e}"))?;

    // Everything runs in a task on the runtime's workers, the accept loop too: run by `block_on`
    // itself, on this thread, every accepted connection crossed from it to a worker and every
    // readiness back to it, two threads woken per connection (5.7 `futex` calls per join on this
    // thread alone in the join storm). The main thread only waits.
    let served = rt.spawn(async move {
        // The parent decides when we stop: an operator's ^C or systemd's SIGTERM reach it too.
        let _term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
        let _int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt());
        listener
            .set_nonblocking(true)
            .map_err(|e| format!("privsep: the listener: {e}"))?;
        let listener = tokio::net::TcpListener::from_std(listener)
            .map_err(|e| format!("privsep: the listener: {e}"))?;
        http.set_nonblocking(true)
            .map_err(|e| format!("privsep: the HTTP listener: {e}"))?;
        let http = tokio::net::TcpListener::from_std(http)
            .map_err(|e| format!("privsep: the HTTP listener: {e}"))?;
        let http_base = crate::edge::boot::http::http_url(&init.boot, http.local_addr().ok());
        let edge = Arc::new(crate::edge::Edge {
            core: link.clone(),
            boot: init.boot,
            metrics_public: init.metrics_public,
            boot_root: Arc::new(boot_root),
            downloads,
        });
        if let Some(s) = boot_sockets {
            crate::edge::boot::server::run(edge.clone(), s, http_base, stop_rx.clone())?;
        }
        let public = tokio::spawn(crate::edge::http::serve_public(http, edge, stop_rx.clone()));
        let gw = Gateway::with_parts(init.sessions, registry.clone(), tls, Some(link));
        gw.serve(listener, stop_rx).await;
        let _ = public.await;
        // Stopped: the sessions stay open, answering nothing, until the parent has recorded them
        // closed and ends this process (or exits: the socketpair's end, then the parent-death
        // signal, end it too). Their nodes notice all at once, as the appliance exits.
        std::future::pending::<()>().await;
        Ok::<_, String>(())
    });
    rt.block_on(served)
        .map_err(|e| format!("privsep: the network child's task: {e}"))?
}
