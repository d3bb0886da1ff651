//! Privilege separation: everything that parses what the network sends runs in a child process
//! of the same binary, `bca net-child`, that holds no private key, cannot open the database or a
//! key, and asks the key-holding parent for everything else over a socketpair: the gateway (TLS
//! handshakes, frames, sessions), DHCP, TFTP and the public HTTP listener (boot scripts and
//! files, the well-known document, `/healthz`, `/metrics`, downloads; see [`crate::edge`]).
//! The admin socket (local, callers identified by `SO_PEERCRED`) stays in the parent.
//!
//! # The child
//! `serve` binds every listener itself (the gateway, the HTTP listener, DHCP on 67 and 4011 and
//! TFTP on 69, which need the privilege to bind them) and opens the boot root and
//! `<state-dir>/downloads`; it passes all of them to the child (`SCM_RIGHTS`), so connections
//! wait in the kernel's backlog while a child restarts. Before it reads a byte from the network
//! the child confines itself, in this order:
//! 1. when `serve` runs as root: the `[privsep] user` (default `nobody`), its group and no other;
//!    every capability dropped, the ambient ones a unit grants too;
//! 2. Landlock: no file may be opened, written or listed except reading beneath the two
//!    directories it was handed, no TCP port bound or connected, no signal sent and no abstract
//!    socket reached outside the child;
//! 3. `no_new_privs` and a seccomp filter that allows the system calls a tokio + rustls server
//!    needs and kills the process on any other: no `execve`, no `socket` but UDP (TFTP's port per
//!    transfer), no `fork` (`clone` only with `CLONE_THREAD`), no `ptrace`, no `mount`; and on
//!    the sockets the parent shares with every child, no `connect`, `bind`, `shutdown`,
//!    `setsockopt` or copy, so that no child can break them for its successors;
//! 4. it then tries to open the database, `config.toml`, the state directory and every key file
//!    (the parent names them) and reports each result. The parent refuses a child that opened
//!    one: `serve` fails rather than run an unconfined child.
//!
//! # The messages
//! Frames are `u32` length, `u64` id, one kind byte, a payload. The child sends:
//! - `Call`: a [`crate::proto::protocol::Call`] as JSON, the join issue's message interface, answered
//!   with the JoinService's [`crate::proto::protocol::Outcome`] bytes. The parent relays only the calls
//!   the network may make (join, renew, session open, seen and closed: never a discovery token)
//!   and the JoinService checks them as it would any caller's; the child is not trusted more than
//!   the network. At most 8,192 calls are in flight; more are answered busy, and a child that
//!   does not read its answers is ended.
//! - `Ask`: one of the edge's questions ([`crate::edge::Ask`]: a DHCP address, a boot lease row,
//!   a boot script, a per-boot archive, the health report, the metrics, the well-known document,
//!   a download's recorded SHA-256), answered with an [`crate::edge::Answer`]. A boot script mints
//!   a discovery token in the parent, as it would for any machine fetching it; the child never
//!   sees a key or the database.
//! - `Sign`: the TLS 1.3 server `CertificateVerify` input for the gateway leaf (named by its
//!   SHA-256). The parent signs only that structure (64 spaces, the TLS 1.3 server context
//!   string, a transcript hash), so the key cannot be used by the child as a general signing
//!   oracle.
//!
//! The parent sends `Reply`, `Close` (a node's identity was revoked: close its session), `Cert`
//! (the gateway leaf was rotated) and `Stop`.
//!
//! The parent writes from one place, its out task, which gathers the frames queued behind the
//! first into one write of up to 64 KiB. The child sends a frame at once from the thread that
//! has it when nothing waits before it and the socket's buffer has room, without waiting; what
//! remains goes to its writer thread, which writes everything queued meanwhile at once (see
//! [`Outbox`]). Each side reads through a 64 KiB buffer: in a storm, answers cross in a few
//! system calls rather than one each, and a runtime worker never waits on the socket itself
//! (only, briefly, on the outbox's lock while another thread's frame goes to the socket).
//!
//! # Faults
//! A child that dies (a crash, the OOM killer, SIGKILL) is restarted with a backoff (100 ms,
//! doubling to 5 s); the sessions it held are recorded closed and agents reconnect. Nothing the
//! parent committed is lost: the database and the keys are only in the parent. A parent that dies
//! takes the child with it (end of the socketpair, and `PR_SET_PDEATHSIG`).

mod child;
mod link;
mod wire;

pub use child::child_main;
pub use link::Link;
use link::*;
pub use wire::Sockets;
use wire::*;

use crate::appliance::app::App;
use crate::edge::gateway::GatewayCert;
use crate::join::service::JoinHandle;
use crate::proto::protocol::{Call, Outcome};
use rustls::SignatureScheme;
use std::collections::HashMap;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio::sync::{mpsc, watch};

// ---------------------------------------------------------------------------------------------
// The child.

// ---------------------------------------------------------------------------------------------
// The parent.

/// A network child told to stop, still running: it holds its sessions' connections until this
/// is dropped (which kills it) or the parent exits (its end of the socketpair closes).
pub struct Stopped {
    _child: tokio::process::Child,
    _link: std::os::fd::OwnedFd,
}

/// The running boundary, as `serve` holds it.
pub struct Supervisor {
    task: tokio::task::JoinHandle<Option<Stopped>>,
}

impl Supervisor {
    /// Starts the first child (as `user`, which [`user`] looked up) and waits until it reports
    /// itself confined; a child that is not is an error and `serve` does not start.
    pub async fn start(
        app: Arc<App>,
        join: JoinHandle,
        sockets: Sockets,
        tickets: crate::edge::tickets::TicketRoot,
        user: Option<(u32, u32)>,
        stop: watch::Receiver<bool>,
    ) -> Result<Self, String> {
        let cert = app
            .gateway_cert
            .get()
            .cloned()
            .ok_or("privsep: no gateway certificate")?;
        let scheme = SCHEMES
            .iter()
            .copied()
            .find(|s| cert.current().key.choose_scheme(&[*s]).is_some())
            .ok_or("privsep: the gateway key signs with no TLS 1.3 scheme")?;
        let init = Init {
            sessions: app.config.sessions.clone(),
            chain: chain(&cert),
            node_ca: crate::base::crypto::b64(&app.pki.node_ca),
            tickets: tickets.ring_at(crate::base::clock::now()),
            scheme: u16::from(scheme),
            user,
            probe: probe_paths(&app.state_dir),
            boot: app.config.boot.clone(),
            metrics_public: app.config.health.metrics_public,
            roots: (
                sockets.boot_root.path().to_path_buf(),
                sockets.downloads.path().to_path_buf(),
            ),
            boot_sockets: sockets.boot.is_some(),
        };
        let (close_tx, close_rx) = mpsc::unbounded_channel();
        app.sessions.set_forward(close_tx);
        let first = spawn(&init, &sockets).await?;
        let task = tokio::spawn(supervise(
            app, join, sockets, tickets, init, first, close_rx, stop,
        ));
        Ok(Self { task })
    }

    /// Returns once told to stop (the `stop` given to [`Self::start`] was sent) and the child's
    /// sessions are recorded closed: the child, stopped but still holding their connections.
    /// Dropping it ends it (and them): `serve` does so last, as it exits.
    pub async fn wait(self) -> Option<Stopped> {
        self.task.await.ok().flatten()
    }
}

fn chain(cert: &GatewayCert) -> Vec<String> {
    cert.current()
        .cert
        .iter()
        .map(|c| crate::base::crypto::b64(c))
        .collect()
}

/// The user to become, when running as root; checked by `serve` before it binds anything.
pub fn user(name: &str) -> Result<Option<(u32, u32)>, String> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    let u = nix::unistd::User::from_name(name)
        .map_err(|e| format!("privsep: looking up the user {name:?}: {e}"))?
        .ok_or_else(|| {
            format!("privsep: the user {name:?} ([privsep] user) does not exist on this machine")
        })?;
    if u.uid.is_root() {
        return Err(format!(
            "privsep: [privsep] user {name:?} is root; name an unprivileged user"
        ));
    }
    Ok(Some((u.uid.as_raw(), u.gid.as_raw())))
}

/// What the child must not be able to open: the database, the config, the state directory and
/// every file under `keys/`.
fn probe_paths(state_dir: &std::path::Path) -> Vec<PathBuf> {
    let mut v = vec![
        state_dir.to_path_buf(),
        state_dir.join("bca.db"),
        state_dir.join("config.toml"),
    ];
    let keys = crate::keys::keys_dir(state_dir);
    if let Ok(rd) = std::fs::read_dir(&keys) {
        v.extend(rd.flatten().map(|e| e.path()));
    }
    v
}

type Child = (tokio::process::Child, tokio::net::UnixStream);

async fn spawn(init: &Init, sockets: &Sockets) -> Result<Child, String> {
    let (ours, theirs) = UnixStream::pair().map_err(|e| format!("privsep: a socketpair: {e}"))?;
    // `/proc/self/exe`: the same binary even when a package upgrade has replaced the file.
    let mut cmd = tokio::process::Command::new("/proc/self/exe");
    cmd.arg("net-child")
        .env_clear()
        .stdin(std::process::Stdio::from(OwnedFd::from(theirs)))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true);
    for k in ["BCA_LOG", "BCA_LOG_FORMAT"] {
        if let Ok(v) = std::env::var(k) {
            cmd.env(k, v);
        }
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("privsep: starting the network child: {e}"))?;
    // Our copy of the child's end: without it, a child that dies early is an end of stream.
    drop(cmd);
    let started = async {
        send_fds(&ours, &sockets.fds())?;
        // The init message carries the ticket root: its copies are zeroized once sent.
        let message = zeroize::Zeroizing::new(serde_json::to_vec(init).expect("serializes"));
        (&ours)
            .write_all(&zeroize::Zeroizing::new(encode(0, Kind::Init, &message)))
            .map_err(|e| format!("privsep: the init message: {e}"))?;
        ours.set_nonblocking(true).map_err(|e| e.to_string())?;
        let mut s = tokio::net::UnixStream::from_std(ours).map_err(|e| e.to_string())?;
        let ready = match tokio::time::timeout(Duration::from_secs(10), read_async(&mut s)).await {
            Ok(Ok(Some((_, Kind::Ready, p)))) => serde_json::from_slice::<Ready>(&p)
                .map_err(|e| format!("privsep: the child's report: {e}"))?,
            Ok(Ok(_)) | Ok(Err(_)) => {
                return Err(
                    "privsep: the network child ended before it reported (its error is above)"
                        .to_string(),
                )
            }
            Err(_) => return Err("privsep: the network child did not report within 10 s".into()),
        };
        if let Some((p, _)) = ready.probes.iter().find(|(_, r)| r == OPENED) {
            return Err(format!(
                "privsep: the network child could open {}: it is not confined, and bca does not \
                 serve with an unconfined child (a kernel without Landlock, not started as root?); \
                 [privsep] enabled = false serves without the separation",
                p.display()
            ));
        }
        tracing::info!(
            pid = child.id().unwrap_or(0),
            uid = ready.uid,
            landlock = %ready.landlock,
            seccomp = ready.seccomp,
            refused = ready.probes.len(),
            "privsep: the network child is confined"
        );
        for (p, r) in &ready.probes {
            tracing::debug!(path = %p.display(), result = %r, "privsep: probe");
        }
        Ok(s)
    };
    match started.await {
        Ok(s) => Ok((child, s)),
        Err(e) => {
            let _ = child.kill().await;
            Err(e)
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn supervise(
    app: Arc<App>,
    join: JoinHandle,
    sockets: Sockets,
    tickets: crate::edge::tickets::TicketRoot,
    mut init: Init,
    first: Child,
    mut close_rx: mpsc::UnboundedReceiver<String>,
    mut stop: watch::Receiver<bool>,
) -> Option<Stopped> {
    let cert = app.gateway_cert.get().cloned().expect("checked at start");
    let mut cert_rx = cert.subscribe();
    let mut next = Some(first);
    let mut backoff = Duration::from_millis(100);
    loop {
        let (mut child, stream) = match next.take() {
            Some(c) => c,
            None => match respawn(&mut init, &cert, &tickets, &sockets).await {
                Ok(c) => c,
                Err(e) => {
                    tracing::error!(error = %e, "privsep: the network child did not start; retrying");
                    if pause(&mut stop, &mut backoff).await {
                        return None;
                    }
                    continue;
                }
            },
        };
        // The child has the chain of its init message; a rotation since is pushed by `broker`.
        let init_chain = init.chain.clone();
        cert_rx.borrow_and_update();
        let started = std::time::Instant::now();
        // The parent's end of the socketpair, kept past `broker` when stopping: the child ends
        // itself when that end closes.
        let link = std::os::fd::AsFd::as_fd(&stream).try_clone_to_owned();
        let stopping = broker(
            &app,
            &join,
            &cert,
            &tickets,
            stream,
            &init_chain,
            &mut close_rx,
            &mut cert_rx,
            &mut stop,
        )
        .await;
        if stopping {
            // Its sessions are recorded closed (`broker`); it still holds their connections, to
            // be ended as the appliance exits (see `Supervisor::wait`).
            return link.ok().map(|link| Stopped {
                _child: child,
                _link: link,
            });
        }
        let status = match tokio::time::timeout(Duration::from_secs(5), child.wait()).await {
            Ok(s) => s.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string()),
            Err(_) => {
                let _ = child.kill().await;
                "killed after 5 s".into()
            }
        };
        tracing::warn!(%status, "privsep: the network child ended; restarting it");
        crate::base::metrics::count_privsep_restart();
        if started.elapsed() > Duration::from_secs(30) {
            backoff = Duration::from_millis(100);
        }
        if pause(&mut stop, &mut backoff).await {
            return None;
        }
    }
}

/// A new child, given the chain and ticket keys of now: the gateway leaf may have been rotated
/// since the start, and the period may have changed.
async fn respawn(
    init: &mut Init,
    cert: &GatewayCert,
    tickets: &crate::edge::tickets::TicketRoot,
    sockets: &Sockets,
) -> Result<Child, String> {
    init.chain = chain(cert);
    init.tickets = tickets.ring_at(crate::base::clock::now());
    spawn(init, sockets).await
}

/// Waits out the backoff and doubles it; true when told to stop meanwhile.
async fn pause(stop: &mut watch::Receiver<bool>, backoff: &mut Duration) -> bool {
    if *stop.borrow() {
        return true;
    }
    let stopped = tokio::select! {
        r = stop.changed() => r.is_err() || *stop.borrow(),
        _ = tokio::time::sleep(*backoff) => false,
    };
    *backoff = (*backoff * 2).min(Duration::from_secs(5));
    stopped
}

/// Serves one child until its end of the socketpair closes; true when it was told to stop.
#[allow(clippy::too_many_arguments)]
async fn broker(
    app: &Arc<App>,
    join: &JoinHandle,
    cert: &Arc<GatewayCert>,
    tickets: &crate::edge::tickets::TicketRoot,
    stream: tokio::net::UnixStream,
    sent_chain: &[String],
    close_rx: &mut mpsc::UnboundedReceiver<String>,
    cert_rx: &mut watch::Receiver<u64>,
    stop: &mut watch::Receiver<bool>,
) -> bool {
    let (rd, mut wr) = stream.into_split();
    // Bounded: a child that sends without reading is ended, not queued for without limit.
    let (out_tx, mut out_rx) = mpsc::channel::<Vec<u8>>(OUT_QUEUE);
    tokio::spawn(async move {
        while let Some(b) = out_rx.recv().await {
            let b = gather(b, || out_rx.try_recv().ok());
            if wr.write_all(&b).await.is_err() {
                break;
            }
        }
        // Dropped, a write half would shut the socket down, and a stopping child would take
        // that for its parent's end and exit with its sessions before they are recorded
        // closed. It ends with the parent's end of the socketpair instead (`Stopped`).
        wr.forget();
    });
    let (in_tx, mut in_rx) = mpsc::channel::<Frame>(1024);
    let reader = tokio::spawn(async move {
        // Buffered: a storm's calls arrive many to a read.
        let mut rd = tokio::io::BufReader::with_capacity(BATCH, rd);
        while let Ok(Some(f)) = read_async(&mut rd).await {
            if in_tx.send(f).await.is_err() {
                break;
            }
        }
    });
    // The sessions this child holds, by node: recorded closed if it dies. `None` once it has.
    let held: Held = Arc::new(Mutex::new(Some(HashMap::new())));
    let mut refusals = Refusals::default();
    let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
    let asks = Arc::new(tokio::sync::Semaphore::new(ASKS_AT_ONCE));
    let send = |b: Vec<u8>| out_tx.try_send(b).is_ok();
    if chain(cert) != sent_chain {
        send(encode(
            0,
            Kind::Cert,
            &serde_json::to_vec(&chain(cert)).expect("json"),
        ));
    }
    let mut stopping = *stop.borrow();
    if stopping {
        send(encode(0, Kind::Stop, &[]));
    }
    // The child's ticket keys move on at each change of period (a second after it).
    let keys_due = |now| {
        tokio::time::Instant::now()
            + Duration::from_secs(crate::edge::tickets::TicketRoot::next_change(now) + 1)
    };
    let refresh = tokio::time::sleep_until(keys_due(crate::base::clock::now()));
    tokio::pin!(refresh);
    while !stopping {
        tokio::select! {
            () = &mut refresh => {
                let now = crate::base::clock::now();
                let keys = zeroize::Zeroizing::new(
                    serde_json::to_vec(&tickets.ring_at(now)).expect("json"),
                );
                send(encode(0, Kind::Tickets, &keys));
                refresh.as_mut().reset(keys_due(now));
            }
            f = in_rx.recv() => {
                let Some((id, kind, p)) = f else { break };
                match kind {
                    Kind::Call => {
                        // What the network may ask, and nothing else (no discovery tokens).
                        let call = match serde_json::from_slice::<Call>(&p) {
                            Ok(c @ (Call::Join { .. }
                            | Call::TpmChallenge { .. }
                            | Call::X509PopChallenge { .. }
                            | Call::Renew { .. }
                            | Call::SessionOpen { .. }
                            | Call::SessionSeen { .. }
                            | Call::SessionClosed { .. })) => c,
                            Ok(_) => {
                                if refusals.note() {
                                    tracing::warn!("privsep: the network child made a call it may not make; refused");
                                }
                                send(encode(id, Kind::Reply, &outcome(&Outcome::Refused)));
                                continue;
                            }
                            Err(_) => {
                                send(encode(id, Kind::Reply, &outcome(&Outcome::Refused)));
                                continue;
                            }
                        };
                        // A session call names a node: only one whose session this child
                        // opened (and still holds). Anything else could mark any tenant's node
                        // disconnected or rewrite its last-seen time.
                        {
                            if !session_call_allowed(&held, &call) {
                                if refusals.note() {
                                    tracing::warn!("privsep: the network child named a session it does not hold; refused");
                                }
                                send(encode(id, Kind::Reply, &outcome(&Outcome::Refused)));
                                continue;
                            }
                        }
                        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                            send(encode(id, Kind::Reply, &outcome(&Outcome::Busy)));
                            continue;
                        };
                        let (app, join, out, held) =
                            (app.clone(), join.clone(), out_tx.clone(), held.clone());
                        tokio::spawn(async move {
                            let _permit = permit;
                            let session = match &call {
                                Call::SessionOpen { .. } => Some(None),
                                Call::SessionClosed { node_id } => Some(Some(node_id.clone())),
                                _ => None,
                            };
                            let reply = join.dispatch(call).await;
                            if let Some(closed) = session {
                                track(&app, &join, &held, closed, &reply);
                            }
                            let _ = out.try_send(encode(id, Kind::Reply, &outcome(&reply)));
                        });
                    }
                    Kind::Ask => {
                        let Ok(ask) = serde_json::from_slice::<crate::edge::Ask>(&p) else {
                            if refusals.note() {
                                tracing::warn!("privsep: the network child asked something unknown; refused");
                            }
                            send(answer_frame(id, &crate::edge::Answer::Unavailable { message: "not a question".into() }));
                            continue;
                        };
                        let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                            send(answer_frame(id, &crate::edge::Answer::Unavailable { message: "busy".into() }));
                            continue;
                        };
                        let (app, out, asks) = (app.clone(), out_tx.clone(), asks.clone());
                        tokio::spawn(async move {
                            let _permit = permit;
                            // Waits its turn: the child's questions never hold more than a few
                            // of the parent's blocking threads (the admin API needs them too).
                            let Ok(_running) = asks.acquire().await else { return };
                            let a = crate::appliance::answer::answer(&app, ask).await;
                            let _ = out.try_send(answer_frame(id, &a));
                        });
                    }
                    Kind::Sign => {
                        let r = match sign(cert, &p) {
                            Ok(sig) => [&[0u8][..], &sig].concat(),
                            Err(e) => {
                                tracing::warn!(error = %e, "privsep: refused to sign for the network child");
                                vec![1]
                            }
                        };
                        if !send(encode(id, Kind::Reply, &r)) {
                            tracing::warn!("privsep: the network child does not read its answers; ending it");
                            break;
                        }
                    }
                    other => {
                        tracing::warn!(kind = ?other, "privsep: an unexpected message from the network child");
                    }
                }
            }
            Some(node) = close_rx.recv() => {
                send(encode(0, Kind::Close, node.as_bytes()));
            }
            Ok(()) = cert_rx.changed() => {
                send(encode(0, Kind::Cert, &serde_json::to_vec(&chain(cert)).expect("json")));
            }
            r = stop.changed(), if !stopping => {
                stopping = r.is_err() || *stop.borrow();
                if stopping {
                    send(encode(0, Kind::Stop, &[]));
                }
            }
        }
    }
    reader.abort();
    // The child is gone, or stopping: its sessions are over. A session whose open is still in
    // flight is closed as soon as it is answered (`track`).
    let held = held.lock().unwrap_or_else(|p| p.into_inner()).take();
    let closed: Vec<String> = held
        .unwrap_or_default()
        .into_iter()
        .filter(|(node, sid)| app.sessions.unregister(node, *sid))
        .map(|(node, _)| node)
        .collect();
    if stopping {
        // All in one transaction, before the caller ends the child (which still holds the
        // connections): the nodes see their sessions end only as the appliance exits.
        let app = app.clone();
        let n = closed.len();
        match tokio::task::spawn_blocking(move || crate::join::sessions::closed_all(&app, &closed))
            .await
        {
            Ok(Ok(())) => {
                tracing::info!(sessions = n, "stopping: the sessions were recorded closed")
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "stopping: the sessions could not be recorded closed; the next start clears them")
            }
            Err(e) => tracing::warn!(error = %e, "stopping: recording the sessions closed failed"),
        }
    } else {
        // Recorded in the background, so that the child's restart does not wait for them.
        let join = join.clone();
        tokio::spawn(async move {
            for node in closed {
                join.dispatch(Call::SessionClosed { node_id: node }).await;
            }
        });
    }
    stopping
}

/// Refused messages from a child, logged at most once a second: a child gone wrong must not
/// flood the log.
#[derive(Default)]
struct Refusals {
    last: Option<std::time::Instant>,
}

impl Refusals {
    /// True when this refusal should be logged.
    fn note(&mut self) -> bool {
        let now = std::time::Instant::now();
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < Duration::from_secs(1))
        {
            return false;
        }
        self.last = Some(now);
        true
    }
}

/// In-flight calls from one child; more are answered busy at once.
const MAX_IN_FLIGHT: usize = 8192;
/// The child's questions ([`crate::edge::Ask`]) answered at once; the others wait (within
/// [`MAX_IN_FLIGHT`]).
const ASKS_AT_ONCE: usize = 32;
/// Messages waiting to be written to the child.
const OUT_QUEUE: usize = 2 * MAX_IN_FLIGHT;

type Held = Arc<Mutex<Option<HashMap<String, u64>>>>;

/// An answer to an `Ask`; one too large for a frame is answered unavailable instead (the child
/// ends on a frame it cannot read).
fn answer_frame(id: u64, a: &crate::edge::Answer) -> Vec<u8> {
    let b = serde_json::to_vec(a).expect("serializes");
    if b.len() + 9 > MAX {
        let too = crate::edge::Answer::Unavailable {
            message: "the answer is too large to pass to the network child".into(),
        };
        return encode(
            id,
            Kind::Reply,
            &serde_json::to_vec(&too).expect("serializes"),
        );
    }
    encode(id, Kind::Reply, &b)
}

fn outcome(o: &Outcome) -> Vec<u8> {
    serde_json::to_vec(o).expect("serializes")
}

/// Whether the child may make `call`: a session call (`sessionSeen`, `sessionClosed`) names a
/// node, and only a node whose session this child opened and still holds.
fn session_call_allowed(held: &Held, call: &Call) -> bool {
    match call {
        Call::SessionSeen { node_id } | Call::SessionClosed { node_id } => held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|h| h.contains_key(node_id)),
        _ => true,
    }
}

/// Keeps the parent's registry of sessions (for `/metrics`, `/healthz` and revocation) in step
/// with the child's: `closed` is `None` for an open, the node for a close.
fn track(app: &App, join: &JoinHandle, held: &Held, closed: Option<String>, reply: &Outcome) {
    let mut guard = held.lock().unwrap_or_else(|p| p.into_inner());
    match (closed, reply) {
        (None, Outcome::SessionOpened { node_id }) => match guard.as_mut() {
            Some(h) => {
                let (sid, _) = app.sessions.register(node_id);
                // A session of this node the child replaced closes without a message of its own.
                h.insert(node_id.clone(), sid);
            }
            None => {
                // The child died while this open was in flight: the session is already over.
                let (join, node_id) = (join.clone(), node_id.clone());
                tokio::spawn(async move {
                    join.dispatch(Call::SessionClosed { node_id }).await;
                });
            }
        },
        (Some(node), _) => {
            if let Some(sid) = guard.as_mut().and_then(|h| h.remove(&node)) {
                app.sessions.unregister(&node, sid);
            }
        }
        _ => {}
    }
}

/// Signs a TLS 1.3 server CertificateVerify for the child, and nothing else.
fn sign(cert: &GatewayCert, p: &[u8]) -> Result<Vec<u8>, String> {
    if p.len() < 34 {
        return Err("a short request".into());
    }
    let (leaf, rest) = p.split_at(32);
    let scheme = SignatureScheme::from(u16::from_be_bytes([rest[0], rest[1]]));
    let msg = &rest[2..];
    let well_formed = msg.len() > 64 + TLS13_SERVER_CV.len()
        && msg[..64].iter().all(|b| *b == 0x20)
        && msg[64..].starts_with(TLS13_SERVER_CV)
        && matches!(msg.len() - 64 - TLS13_SERVER_CV.len(), 32 | 48);
    if !well_formed {
        return Err("not a TLS 1.3 server CertificateVerify".into());
    }
    cert.sign(leaf, scheme, msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn the_child_names_only_sessions_it_holds() {
        let held: Held = Arc::new(Mutex::new(Some(HashMap::new())));
        let seen = |n: &str| Call::SessionSeen { node_id: n.into() };
        let closed = |n: &str| Call::SessionClosed { node_id: n.into() };
        assert!(!session_call_allowed(&held, &seen("node_a")));
        assert!(!session_call_allowed(&held, &closed("node_a")));
        held.lock()
            .unwrap()
            .as_mut()
            .unwrap()
            .insert("node_a".into(), 1);
        assert!(session_call_allowed(&held, &seen("node_a")));
        assert!(session_call_allowed(&held, &closed("node_a")));
        assert!(
            !session_call_allowed(&held, &closed("node_b")),
            "another tenant's node"
        );
        // A child that died holds nothing.
        *held.lock().unwrap() = None;
        assert!(!session_call_allowed(&held, &seen("node_a")));
    }

    #[test]
    fn frames_round_trip_and_bad_lengths_are_refused() {
        let f = encode(7, Kind::Call, b"{}");
        let (id, kind, p) = read_sync(&mut &f[..]).unwrap().unwrap();
        assert_eq!((id, kind, p.as_slice()), (7, Kind::Call, &b"{}"[..]));
        assert!(read_sync(&mut &[][..]).unwrap().is_none());
        for bad in [0u32, 8, (MAX + 1) as u32] {
            let mut b = bad.to_be_bytes().to_vec();
            b.extend([0u8; 16]);
            assert!(read_sync(&mut &b[..]).is_err(), "{bad}");
        }
        let mut unknown = encode(1, Kind::Stop, b"");
        unknown[12] = 99;
        assert!(read_sync(&mut &unknown[..]).is_err());
    }

    #[test]
    fn frames_sent_at_once_or_queued_read_back_in_order_and_a_full_outbox_holds_its_senders() {
        // Through a real socketpair and the child's writer thread, read buffered as the
        // reader thread reads them. Nobody reads until all are pushed: the first go straight
        // into the socket's buffer, the rest queue behind them for the writer thread.
        let (a, b) = UnixStream::pair().unwrap();
        // Small, whatever the host's default: the frames below overflow it.
        rustix::net::sockopt::set_socket_send_buffer_size(&a, 4096).unwrap();
        let outbox = Arc::new(Outbox::new(a));
        let writer = {
            let outbox = outbox.clone();
            std::thread::spawn(move || write_frames(&outbox))
        };
        let big = vec![0x5a; 40 << 10];
        for i in 0..400u64 {
            let p = if i % 25 == 0 { &big[..] } else { &b"{}"[..] };
            assert!(outbox.push(i, Kind::Reply, p));
        }
        let q = outbox.lock();
        assert!(q.frames > 0 || q.writing, "some were queued");
        drop(q);
        outbox.close();
        assert!(
            !outbox.push(400, Kind::Reply, b"{}"),
            "closed: nothing more"
        );
        let mut rd = std::io::BufReader::with_capacity(BATCH, b);
        for i in 0..400u64 {
            let (id, kind, p) = read_sync(&mut rd).unwrap().unwrap();
            assert_eq!((id, kind), (i, Kind::Reply));
            assert_eq!(p.len(), if i % 25 == 0 { 40 << 10 } else { 2 }, "{i}");
        }
        writer.join().unwrap();
        drop(outbox);
        assert!(read_sync(&mut rd).unwrap().is_none(), "all was written");

        // Nobody reads: the socket's buffer fills, CHILD_QUEUE frames queue and the next sender
        // waits, until the writer has written them; or until the outbox closes, which refuses it.
        let full = || {
            let (a, b) = UnixStream::pair().unwrap();
            let outbox = Arc::new(Outbox::new(a));
            let mut pushed = 0u64;
            while outbox.lock().frames < CHILD_QUEUE {
                assert!(outbox.push(pushed, Kind::Call, b"{}"));
                pushed += 1;
            }
            let (tx, rx) = std::sync::mpsc::channel();
            let sender = {
                let outbox = outbox.clone();
                std::thread::spawn(move || tx.send(outbox.push(pushed, Kind::Call, b"{}")).unwrap())
            };
            assert!(
                rx.recv_timeout(Duration::from_millis(200)).is_err(),
                "a full outbox holds its sender"
            );
            (outbox, b, pushed + 1, rx, sender)
        };
        let (outbox, b, frames, rx, sender) = full();
        let writer = {
            let outbox = outbox.clone();
            std::thread::spawn(move || write_frames(&outbox))
        };
        let reader = std::thread::spawn(move || {
            let mut rd = std::io::BufReader::with_capacity(BATCH, b);
            (0..frames)
                .map(|_| read_sync(&mut rd).unwrap().unwrap().0)
                .collect::<Vec<_>>()
        });
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(true));
        sender.join().unwrap();
        outbox.close();
        assert_eq!(reader.join().unwrap(), (0..frames).collect::<Vec<_>>());
        writer.join().unwrap();

        let (outbox, _b, _, rx, sender) = full();
        outbox.close();
        assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(false));
        sender.join().unwrap();

        // While the writer holds bytes it has not written, a frame queues behind them even when
        // the socket has room: the parent reads frames whole and in order.
        let (a, b) = UnixStream::pair().unwrap();
        let outbox = Outbox::new(a);
        outbox.lock().writing = true;
        assert!(outbox.push(1, Kind::Call, b"{}"));
        assert_eq!(outbox.lock().frames, 1);
        b.set_nonblocking(true).unwrap();
        let mut byte = [0u8; 1];
        assert_eq!(
            (&b).read(&mut byte).unwrap_err().kind(),
            std::io::ErrorKind::WouldBlock,
            "nothing was sent"
        );
        outbox.lock().writing = false;
        assert!(outbox.push(2, Kind::Call, b"{}"), "queued behind the first");
        assert_eq!(outbox.lock().frames, 2);

        // A socketpair that fails closes the outbox: its senders learn it at once.
        let (a, b) = UnixStream::pair().unwrap();
        drop(b);
        let outbox = Outbox::new(a);
        assert!(
            outbox.push(1, Kind::Call, b"{}"),
            "queued for the writer to find"
        );
        write_frames(&outbox);
        assert!(!outbox.push(2, Kind::Call, b"{}"));
    }

    #[test]
    fn a_slot_hands_its_answer_to_the_waiting_thread_or_times_out_empty() {
        let slot = Arc::new(Slot::default());
        let filler = {
            let slot = slot.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                slot.fill(b"sig".to_vec());
            })
        };
        assert_eq!(slot.take(Duration::from_secs(5)), Some(b"sig".to_vec()));
        filler.join().unwrap();
        let t = std::time::Instant::now();
        assert_eq!(Slot::default().take(Duration::from_millis(100)), None);
        assert!(t.elapsed() >= Duration::from_millis(100));
    }

    #[test]
    fn a_batch_for_the_child_takes_what_is_queued_and_stops_once_it_holds_batch_bytes() {
        let mut queued = (0..100u64).map(|i| encode(i, Kind::Call, &[1u8; 1000]));
        let first = queued.next().unwrap();
        let one = gather(first, || queued.next());
        assert!(
            one.len() >= BATCH && one.len() < BATCH + 1013,
            "{}",
            one.len()
        );
        assert_eq!(queued.count(), 100 - one.len() / 1013);
    }

    #[test]
    fn the_parent_signs_only_a_tls13_server_certificate_verify() {
        let key = rcgen::KeyPair::generate().unwrap();
        let params = rcgen::CertificateParams::new(vec!["gw".into()]).unwrap();
        let c = params.self_signed(&key).unwrap();
        let cert = GatewayCert::new(c.der(), c.der(), &key.serialize_der()).unwrap();
        let leaf = crate::base::crypto::sha256(c.der());
        let req = |leaf: &[u8], msg: &[u8]| {
            let mut p = leaf.to_vec();
            p.extend(u16::from(SignatureScheme::ECDSA_NISTP256_SHA256).to_be_bytes());
            p.extend(msg);
            p
        };
        let mut good = vec![0x20u8; 64];
        good.extend(TLS13_SERVER_CV);
        good.extend([9u8; 32]);
        assert!(sign(&cert, &req(&leaf, &good)).is_ok());
        // Anything else the child might want signed: a token body, a client context, short.
        assert!(sign(&cert, &req(&leaf, b"{\"sub\":\"node\"}")).is_err());
        let mut client = vec![0x20u8; 64];
        client.extend(b"TLS 1.3, client CertificateVerify\x00");
        client.extend([9u8; 32]);
        assert!(sign(&cert, &req(&leaf, &client)).is_err());
        let mut long = good.clone();
        long.extend([1u8; 100]);
        assert!(sign(&cert, &req(&leaf, &long)).is_err());
        assert!(sign(&cert, &req(&[0u8; 32], &good)).is_err());
        assert!(sign(&cert, &leaf[..20]).is_err());
    }
}
