//! The socketpair between the parent and the network child: length-prefixed frames (id, kind,
//! payload), batched writes from a bounded outbox, the init and ready messages, and descriptors
//! passed with `SCM_RIGHTS`.

use crate::config::SessionsConfig;
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Mutex;
use tokio::io::AsyncReadExt;

/// Largest frame across the boundary: a protocol frame and its envelope.
pub(super) const MAX: usize = crate::proto::protocol::MAX_FRAME + 4096;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[repr(u8)]
pub(super) enum Kind {
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
    pub(super) fn of(b: u8) -> Option<Self> {
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

pub(super) type Frame = (u64, Kind, Vec<u8>);

pub(super) fn encode(id: u64, kind: Kind, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(13 + payload.len());
    v.extend_from_slice(&((9 + payload.len()) as u32).to_be_bytes());
    v.extend_from_slice(&id.to_be_bytes());
    v.push(kind as u8);
    v.extend_from_slice(payload);
    v
}

pub(super) fn frame_len(len: [u8; 4]) -> std::io::Result<usize> {
    let n = u32::from_be_bytes(len) as usize;
    if !(9..=MAX).contains(&n) {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("privsep: a frame of {n} bytes"),
        ));
    }
    Ok(n)
}

pub(super) fn split(b: Vec<u8>) -> std::io::Result<Frame> {
    let id = u64::from_be_bytes(b[..8].try_into().expect("9 bytes at least"));
    let kind = Kind::of(b[8]).ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidData, "privsep: unknown kind")
    })?;
    Ok((id, kind, b[9..].to_vec()))
}

/// Bytes gathered into one write to the socketpair, and read at once from it.
pub(super) const BATCH: usize = 64 << 10;

/// Frames the child queues for the parent before a sender waits.
pub(super) const CHILD_QUEUE: usize = 4096;

/// The parent's out task: `first` and the frames queued behind it, up to [`BATCH`] bytes, as one
/// write: a storm's answers cross the socketpair in a few system calls instead of one each.
pub(super) fn gather(first: Vec<u8>, mut more: impl FnMut() -> Option<Vec<u8>>) -> Vec<u8> {
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
pub(super) struct Outbox {
    pub(super) sock: UnixStream,
    pub(super) state: Mutex<Queued>,
    /// The writer waits here for bytes.
    pub(super) ready: std::sync::Condvar,
    /// Senders wait here for room.
    pub(super) room: std::sync::Condvar,
}

#[derive(Default)]
pub(super) struct Queued {
    pub(super) bytes: Vec<u8>,
    pub(super) frames: usize,
    pub(super) writer_waits: bool,
    /// The writer holds bytes it has not written yet: a new frame must queue behind them.
    pub(super) writing: bool,
    /// The socketpair failed, or [`Outbox::close`]: nothing more is taken.
    pub(super) closed: bool,
}

impl Outbox {
    pub(super) fn new(sock: UnixStream) -> Self {
        Self {
            sock,
            state: Mutex::new(Queued::default()),
            ready: std::sync::Condvar::new(),
            room: std::sync::Condvar::new(),
        }
    }

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Queued> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends or queues a frame; blocks only while [`CHILD_QUEUE`] frames are queued or being
    /// written by the writer thread (the parent has stopped reading). False once the outbox is
    /// closed.
    pub(super) fn push(&self, id: u64, kind: Kind, payload: &[u8]) -> bool {
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
    pub(super) fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_one();
        self.room.notify_all();
    }
}

/// The child's writer thread: whatever the [`Outbox`] could not send at once, in one write each
/// time, until it is closed and empty or the socketpair fails (the reader thread then ends the
/// process).
pub(super) fn write_frames(outbox: &Outbox) {
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
pub(super) fn read_sync(r: &mut impl Read) -> std::io::Result<Option<Frame>> {
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

pub(super) async fn read_async(
    r: &mut (impl AsyncReadExt + Unpin),
) -> std::io::Result<Option<Frame>> {
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
pub(super) struct Init {
    pub(super) sessions: SessionsConfig,
    /// The gateway leaf and the serving CA, base64 DER.
    pub(super) chain: Vec<String>,
    pub(super) node_ca: String,
    /// The session-ticket keys of the period before, this one and the next (never the root;
    /// `broker` sends the next ones at each change of period).
    pub(super) tickets: crate::edge::tickets::TicketKeys,
    pub(super) scheme: u16,
    /// `(uid, gid)` to become, when the parent runs as root.
    pub(super) user: Option<(u32, u32)>,
    /// Files the child must fail to open.
    pub(super) probe: Vec<PathBuf>,
    pub(super) boot: crate::config::BootConfig,
    pub(super) metrics_public: bool,
    /// The boot root and the downloads directory, for messages (the child gets descriptors).
    pub(super) roots: (PathBuf, PathBuf),
    /// Whether DHCP (and proxyDHCP) and TFTP sockets follow the directories.
    pub(super) boot_sockets: bool,
}

/// What a child reports once confined.
#[derive(Serialize, Deserialize, Debug)]
pub(super) struct Ready {
    pub(super) uid: u32,
    pub(super) landlock: String,
    pub(super) seccomp: bool,
    /// `(path, what opening it gave)`; `"opened"` is a failure of the confinement.
    pub(super) probes: Vec<(PathBuf, String)>,
}

pub(super) const OPENED: &str = "opened";

/// The descriptors passed to a child: two listeners, two directories, three UDP sockets.
pub(super) const MAX_FDS: usize = 8;

pub(super) fn recv_fds(sock: &UnixStream) -> Result<Vec<OwnedFd>, String> {
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

pub(super) fn send_fds(
    sock: &UnixStream,
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> Result<(), String> {
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
    pub(super) fn fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
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
    pub(super) fn shared(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        let mut v = vec![self.gateway.as_fd(), self.http.as_fd()];
        v.extend(self.boot_fds());
        v
    }

    pub(super) fn boot_fds(&self) -> Vec<std::os::fd::BorrowedFd<'_>> {
        let Some(b) = &self.boot else {
            return Vec::new();
        };
        let mut v = vec![b.dhcp.as_fd()];
        v.extend(b.proxy.as_ref().map(|p| p.as_fd()));
        v.extend(b.tftp.as_ref().map(|t| t.as_fd()));
        v
    }
}
