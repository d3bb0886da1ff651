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

use crate::appliance::app::App;
use crate::config::SessionsConfig;
use crate::edge::gateway::{Gateway, GatewayCert};
use crate::join::service::JoinHandle;
use crate::proto::protocol::{Call, Outcome};
use rustls::sign::{CertifiedKey, Signer, SigningKey};
use rustls::{SignatureAlgorithm, SignatureScheme};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, watch};

/// Largest frame across the boundary: a protocol frame and its envelope.
const MAX: usize = crate::proto::protocol::MAX_FRAME + 4096;
/// What a `Sign` request must start with: RFC 8446 section 4.4.3.
const TLS13_SERVER_CV: &[u8] = b"TLS 1.3, server CertificateVerify\x00";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
enum Kind {
    Init = 1,
    Ready = 2,
    Call = 3,
    Sign = 4,
    Reply = 5,
    Close = 6,
    Cert = 7,
    Stop = 8,
    Ask = 9,
    Tickets = 10,
}

impl Kind {
    fn of(b: u8) -> Option<Self> {
        Some(match b {
            1 => Self::Init,
            2 => Self::Ready,
            3 => Self::Call,
            4 => Self::Sign,
            5 => Self::Reply,
            6 => Self::Close,
            7 => Self::Cert,
            8 => Self::Stop,
            9 => Self::Ask,
            10 => Self::Tickets,
            _ => return None,
        })
    }
}

type Frame = (u64, Kind, Vec<u8>);

fn encode(id: u64, kind: Kind, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(13 + payload.len());
    v.extend_from_slice(&((9 + payload.len()) as u32).to_be_bytes());
    v.extend_from_slice(&id.to_be_bytes());
    v.push(kind as u8);
    v.extend_from_slice(payload);
    v
}

fn frame_len(len: [u8; 4]) -> std::io::Result<usize> {
    let n = u32::from_be_bytes(len) as usize;
    if !(9..=MAX).contains(&n) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("privsep: a frame of {n} bytes"),
        ));
    }
    Ok(n)
}

fn split(b: Vec<u8>) -> std::io::Result<Frame> {
    let id = u64::from_be_bytes(b[..8].try_into().expect("9 bytes at least"));
    let kind = Kind::of(b[8]).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "privsep: unknown kind")
    })?;
    Ok((id, kind, b[9..].to_vec()))
}

/// Bytes gathered into one write to the socketpair, and read at once from it.
const BATCH: usize = 64 << 10;
/// Frames the child queues for the parent before a sender waits.
const CHILD_QUEUE: usize = 4096;

/// The parent's out task: `first` and the frames queued behind it, up to [`BATCH`] bytes, as one
/// write: a storm's answers cross the socketpair in a few system calls instead of one each.
fn gather(first: Vec<u8>, mut more: impl FnMut() -> Option<Vec<u8>>) -> Vec<u8> {
    let mut buf = first;
    while buf.len() < BATCH {
        match more() {
            Some(f) => buf.extend_from_slice(&f),
            None => break,
        }
    }
    buf
}

/// The child's frames for the parent: sent at once when nothing is queued before them, else
/// queued as the bytes of the writer thread's next write.
///
/// A frame goes straight to the socketpair from the thread that sends it, without waiting (the
/// socket's buffer takes it, or it is queued): handing each frame to the writer thread cost a
/// wake-up and two context switches on the appliance's one core. Only what the socket could not
/// take at once waits for the writer thread, which may block; a runtime worker never does.
///
/// Not a channel: `std::sync::mpsc` wakes its receiver while the sender still holds the channel's
/// lock, and on one core the woken thread ran at once, found the lock held and slept again (5
/// `futex` calls and 4 context switches per join on the writer thread in the join storm). Here
/// the writer is woken after the lock is released, and only when it waits.
struct Outbox {
    sock: UnixStream,
    state: Mutex<Queued>,
    /// The writer waits here for bytes.
    ready: std::sync::Condvar,
    /// Senders wait here for room.
    room: std::sync::Condvar,
}

#[derive(Default)]
struct Queued {
    bytes: Vec<u8>,
    frames: usize,
    writer_waits: bool,
    /// The writer holds bytes it has not written yet: a new frame must queue behind them.
    writing: bool,
    /// The socketpair failed, or [`Outbox::close`]: nothing more is taken.
    closed: bool,
}

impl Outbox {
    fn new(sock: UnixStream) -> Self {
        Self {
            sock,
            state: Mutex::new(Queued::default()),
            ready: std::sync::Condvar::new(),
            room: std::sync::Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queued> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends or queues a frame; blocks only while [`CHILD_QUEUE`] frames are queued or being
    /// written by the writer thread (the parent has stopped reading). False once the outbox is
    /// closed.
    fn push(&self, id: u64, kind: Kind, payload: &[u8]) -> bool {
        let mut q = self.lock();
        while q.frames >= CHILD_QUEUE && !q.closed {
            q = self.room.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        if q.closed {
            return false;
        }
        let first = q.bytes.is_empty() && !q.writing;
        q.bytes
            .extend_from_slice(&((9 + payload.len()) as u32).to_be_bytes());
        q.bytes.extend_from_slice(&id.to_be_bytes());
        q.bytes.push(kind as u8);
        q.bytes.extend_from_slice(payload);
        if first {
            // Under the lock, so that no other frame can come between its parts. An error
            // other than a full buffer is the writer's to find (it closes the outbox).
            let flags = rustix::net::SendFlags::DONTWAIT | rustix::net::SendFlags::NOSIGNAL;
            if let Ok(n) = rustix::net::send(&self.sock, &q.bytes, flags) {
                q.bytes.drain(..n);
            }
            if q.bytes.is_empty() {
                return true;
            }
        }
        q.frames += 1;
        let wake = std::mem::take(&mut q.writer_waits);
        drop(q);
        if wake {
            self.ready.notify_one();
        }
        true
    }

    /// Takes nothing more; the writer ends once it has written what was queued.
    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_one();
        self.room.notify_all();
    }
}

/// The child's writer thread: whatever the [`Outbox`] could not send at once, in one write each
/// time, until it is closed and empty or the socketpair fails (the reader thread then ends the
/// process).
fn write_frames(outbox: &Outbox) {
    let mut writing = Vec::new();
    // The frames of the last write: they count against [`CHILD_QUEUE`] until they are written.
    let mut taken = 0;
    loop {
        let mut q = outbox.lock();
        q.writing = false;
        let was_full = q.frames >= CHILD_QUEUE;
        q.frames -= taken;
        if was_full && q.frames < CHILD_QUEUE {
            // Rare (the parent stopped reading for a while): woken under the lock.
            outbox.room.notify_all();
        }
        while q.bytes.is_empty() && !q.closed {
            q.writer_waits = true;
            q = outbox.ready.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        q.writer_waits = false;
        if q.bytes.is_empty() {
            return;
        }
        std::mem::swap(&mut q.bytes, &mut writing);
        q.writing = true;
        taken = q.frames;
        drop(q);
        if (&outbox.sock).write_all(&writing).is_err() {
            outbox.close();
            return;
        }
        // A backlog's buffer is not kept for the life of the child (the next swap hands this
        // one to the senders).
        if writing.capacity() > 4 * BATCH {
            writing = Vec::new();
        } else {
            writing.clear();
        }
    }
}

/// One frame, or `None` at the end of the stream.
fn read_sync(r: &mut impl Read) -> std::io::Result<Option<Frame>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut b = vec![0u8; frame_len(len)?];
    r.read_exact(&mut b)?;
    split(b).map(Some)
}

async fn read_async(r: &mut (impl AsyncReadExt + Unpin)) -> std::io::Result<Option<Frame>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let mut b = vec![0u8; frame_len(len)?];
    r.read_exact(&mut b).await?;
    split(b).map(Some)
}

/// What the parent tells a new child.
#[derive(Serialize, Deserialize)]
struct Init {
    sessions: SessionsConfig,
    /// The gateway leaf and the serving CA, base64 DER.
    chain: Vec<String>,
    node_ca: String,
    /// The session-ticket keys of the period before, this one and the next (never the root;
    /// `broker` sends the next ones at each change of period).
    tickets: crate::edge::tickets::TicketKeys,
    scheme: u16,
    /// `(uid, gid)` to become, when the parent runs as root.
    user: Option<(u32, u32)>,
    /// Files the child must fail to open.
    probe: Vec<PathBuf>,
    boot: crate::config::BootConfig,
    metrics_public: bool,
    /// The boot root and the downloads directory, for messages (the child gets descriptors).
    roots: (PathBuf, PathBuf),
    /// Whether DHCP (and proxyDHCP) and TFTP sockets follow the directories.
    boot_sockets: bool,
}

/// What a child reports once confined.
#[derive(Serialize, Deserialize, Debug)]
struct Ready {
    uid: u32,
    landlock: String,
    seccomp: bool,
    /// `(path, what opening it gave)`; `"opened"` is a failure of the confinement.
    probes: Vec<(PathBuf, String)>,
}

const OPENED: &str = "opened";

// ---------------------------------------------------------------------------------------------
// The child.

/// The child's side of the socketpair: calls and signatures to the parent.
pub struct Link {
    /// Frames for the parent, sent at once or through [`write_frames`]' thread: a runtime
    /// worker never waits on the socket itself.
    out: Arc<Outbox>,
    pending: Mutex<HashMap<u64, Waiter>>,
    next: AtomicU64,
}

enum Waiter {
    Blocking(Arc<Slot>),
    Async(oneshot::Sender<Vec<u8>>),
}

/// The answer a blocked runtime worker waits for (a TLS signature). The reader thread fills it
/// and wakes the worker after releasing the lock (see [`Outbox`] for why not a channel).
#[derive(Default)]
struct Slot {
    answer: Mutex<Option<Vec<u8>>>,
    filled: std::sync::Condvar,
}

impl Slot {
    fn fill(&self, answer: Vec<u8>) {
        *self.answer.lock().unwrap_or_else(|p| p.into_inner()) = Some(answer);
        self.filled.notify_one();
    }

    /// The answer, or `None` when none came within `wait`.
    fn take(&self, wait: Duration) -> Option<Vec<u8>> {
        let guard = self.answer.lock().unwrap_or_else(|p| p.into_inner());
        let (mut guard, _) = self
            .filled
            .wait_timeout_while(guard, wait, |a| a.is_none())
            .unwrap_or_else(|p| p.into_inner());
        guard.take()
    }
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("privsep::Link")
    }
}

impl Link {
    /// Queues a frame for the parent; blocks only when [`CHILD_QUEUE`] frames wait already
    /// (the parent has stopped reading). An error when the writer is gone with the socketpair.
    fn send(&self, id: u64, kind: Kind, payload: &[u8]) -> std::io::Result<()> {
        if self.out.push(id, kind, payload) {
            return Ok(());
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::BrokenPipe,
            "privsep: the socketpair to the parent is closed",
        ))
    }

    fn wait(&self, kind: Kind, payload: &[u8], waiter: Waiter) -> Option<u64> {
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id, waiter);
        if self.send(id, kind, payload).is_err() {
            self.forget(id);
            return None;
        }
        Some(id)
    }

    fn forget(&self, id: u64) {
        self.pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
    }

    /// A [`crate::proto::protocol::Call`] to the parent's JoinService; empty bytes (read as busy) when
    /// the parent is gone.
    pub async fn call(&self, msg: Vec<u8>) -> Vec<u8> {
        self.request(Kind::Call, &msg).await
    }

    /// One of the edge's questions ([`crate::edge::Ask`], JSON); empty bytes when the parent is
    /// gone.
    pub async fn ask(&self, msg: Vec<u8>) -> Vec<u8> {
        self.request(Kind::Ask, &msg).await
    }

    /// A message of `kind` and the parent's reply; empty bytes when the parent is gone.
    async fn request(&self, kind: Kind, msg: &[u8]) -> Vec<u8> {
        let (tx, rx) = oneshot::channel();
        if self.wait(kind, msg, Waiter::Async(tx)).is_none() {
            return Vec::new();
        }
        rx.await.unwrap_or_default()
    }

    /// A TLS signature by the parent. Blocking: rustls signs synchronously; the answer comes
    /// through the reader thread, never through the runtime, so a busy runtime cannot stall it.
    fn sign(&self, leaf_sha256: &[u8; 32], scheme: SignatureScheme, msg: &[u8]) -> Option<Vec<u8>> {
        let mut p = Vec::with_capacity(34 + msg.len());
        p.extend_from_slice(leaf_sha256);
        p.extend_from_slice(&u16::from(scheme).to_be_bytes());
        p.extend_from_slice(msg);
        let slot = Arc::new(Slot::default());
        let id = self.wait(Kind::Sign, &p, Waiter::Blocking(slot.clone()))?;
        // Waits on the worker itself: the parent answers in microseconds, and the wait is bounded.
        // `block_in_place` here (handing the worker's other tasks to another thread at every
        // handshake) cost joins 30% against 4% for this in the storm bench (2,000 joins each).
        let mut r = slot.take(Duration::from_secs(5));
        if r.is_none() {
            self.forget(id);
            // Answered between the wait's end and `forget`.
            r = slot.take(Duration::ZERO);
        }
        match r?.split_first() {
            Some((0, sig)) => Some(sig.to_vec()),
            _ => None,
        }
    }

    fn answer(&self, id: u64, payload: Vec<u8>) {
        let w = self
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        match w {
            Some(Waiter::Blocking(slot)) => slot.fill(payload),
            Some(Waiter::Async(tx)) => {
                let _ = tx.send(payload);
            }
            None => {}
        }
    }
}

/// The gateway key as the child sees it: every signature is the parent's.
#[derive(Debug)]
struct RemoteKey {
    link: Arc<Link>,
    leaf_sha256: [u8; 32],
    scheme: SignatureScheme,
}

#[derive(Debug)]
struct RemoteSigner(Arc<RemoteKey>);

impl SigningKey for RemoteKey {
    fn choose_scheme(&self, offered: &[SignatureScheme]) -> Option<Box<dyn Signer>> {
        offered.contains(&self.scheme).then(|| {
            Box::new(RemoteSigner(Arc::new(RemoteKey {
                link: self.link.clone(),
                leaf_sha256: self.leaf_sha256,
                scheme: self.scheme,
            }))) as Box<dyn Signer>
        })
    }

    fn algorithm(&self) -> SignatureAlgorithm {
        algorithm(self.scheme)
    }
}

impl Signer for RemoteSigner {
    fn sign(&self, message: &[u8]) -> Result<Vec<u8>, rustls::Error> {
        self.0
            .link
            .sign(&self.0.leaf_sha256, self.0.scheme, message)
            .ok_or_else(|| rustls::Error::General("the key-holding process did not sign".into()))
    }

    fn scheme(&self) -> SignatureScheme {
        self.0.scheme
    }
}

fn algorithm(scheme: SignatureScheme) -> SignatureAlgorithm {
    match scheme {
        SignatureScheme::ECDSA_NISTP256_SHA256
        | SignatureScheme::ECDSA_NISTP384_SHA384
        | SignatureScheme::ECDSA_NISTP521_SHA512 => SignatureAlgorithm::ECDSA,
        SignatureScheme::ED25519 => SignatureAlgorithm::ED25519,
        _ => SignatureAlgorithm::RSA,
    }
}

/// The schemes a gateway key may have, most preferred first.
const SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ED25519,
    SignatureScheme::RSA_PSS_SHA256,
];

fn remote_certified(
    chain: &[String],
    link: Arc<Link>,
    scheme: SignatureScheme,
) -> Result<CertifiedKey, String> {
    let chain: Vec<rustls::pki_types::CertificateDer<'static>> = chain
        .iter()
        .map(|c| crate::base::crypto::b64_decode(c).map(rustls::pki_types::CertificateDer::from))
        .collect::<Option<_>>()
        .ok_or("privsep: a certificate in the init message is not base64")?;
    let leaf = chain.first().ok_or("privsep: no gateway certificate")?;
    let key = RemoteKey {
        link,
        leaf_sha256: crate::base::crypto::sha256(leaf),
        scheme,
    };
    Ok(CertifiedKey::new(chain, Arc::new(key)))
}

/// The descriptors passed to a child: two listeners, two directories, three UDP sockets.
const MAX_FDS: usize = 8;

fn recv_fds(sock: &UnixStream) -> Result<Vec<OwnedFd>, String> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut cmsg = RecvAncillaryBuffer::new(&mut space);
    let mut b = [0u8; 1];
    rustix::net::recvmsg(
        sock,
        &mut [std::io::IoSliceMut::new(&mut b)],
        &mut cmsg,
        RecvFlags::CMSG_CLOEXEC,
    )
    .map_err(|e| format!("privsep: receiving the listener: {e}"))?;
    let mut fds = Vec::new();
    for m in cmsg.drain() {
        if let RecvAncillaryMessage::ScmRights(r) = m {
            fds.extend(r);
        }
    }
    Ok(fds)
}

fn send_fds(sock: &UnixStream, fds: &[std::os::fd::BorrowedFd<'_>]) -> Result<(), String> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut cmsg = SendAncillaryBuffer::new(&mut space);
    if !cmsg.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err("privsep: too many descriptors".into());
    }
    rustix::net::sendmsg(
        sock,
        &[std::io::IoSlice::new(b"F")],
        &mut cmsg,
        SendFlags::empty(),
    )
    .map_err(|e| format!("privsep: passing the listener: {e}"))?;
    Ok(())
}

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
            let tftp = std::net::UdpSocket::from(next("TFTP socket")?);
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

// ---------------------------------------------------------------------------------------------
// The parent.

/// What the child serves, opened by `serve`: kept by the parent across restarts.
pub struct Sockets {
    pub gateway: std::net::TcpListener,
    pub http: std::net::TcpListener,
    pub boot_root: crate::base::fsutil::ReadRoot,
    pub downloads: crate::base::fsutil::ReadRoot,
    pub boot: Option<crate::edge::boot::server::BootSockets>,
}

impl Sockets {
    /// In the order the child takes them.
    fn fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        let mut v = vec![
            self.gateway.as_fd(),
            self.http.as_fd(),
            self.boot_root.fd(),
            self.downloads.fd(),
        ];
        v.extend(self.boot_fds());
        v
    }

    /// The sockets every child gets in turn: no child may reconfigure them
    /// ([`crate::daemon::confine::confine`]).
    fn shared(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        let mut v = vec![self.gateway.as_fd(), self.http.as_fd()];
        v.extend(self.boot_fds());
        v
    }

    fn boot_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        let Some(b) = &self.boot else {
            return Vec::new();
        };
        let mut v = vec![b.dhcp.as_fd()];
        v.extend(b.proxy.as_ref().map(|p| p.as_fd()));
        v.push(b.tftp.as_fd());
        v
    }
}

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

impl crate::proto::protocol::CallSink for Link {
    fn call(&self, msg: Vec<u8>) -> crate::proto::protocol::Pending<'_, Vec<u8>> {
        Box::pin(Link::call(self, msg))
    }
    fn remote(&self) -> bool {
        true
    }
}

impl crate::edge::EdgeCore for Link {
    fn ask(&self, a: crate::edge::Ask) -> crate::proto::protocol::Pending<'_, crate::edge::Answer> {
        Box::pin(async move {
            let what = a.name();
            let bytes = Link::ask(self, serde_json::to_vec(&a).expect("serializes")).await;
            serde_json::from_slice(&bytes).unwrap_or_else(|_| crate::edge::Answer::Unavailable {
                message: format!("the core did not answer ({what})"),
            })
        })
    }
    fn remote(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
