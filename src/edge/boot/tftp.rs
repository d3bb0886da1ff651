//! A read-only TFTP server: RFC 1350 with option negotiation (RFC 2347), `blksize` (RFC 2348,
//! clamped to what an Ethernet link carries), `tsize` (RFC 2349), `timeout` and `windowsize`
//! (RFC 7440). Each transfer gets a new port. Names are confined to the boot root. The packet
//! codec and the path guard are pure functions; the server streams files block by block.

use crate::base::fsutil::ReadRoot;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::UdpSocket;
use tokio::sync::Semaphore;

/// The largest block that fits an Ethernet frame: 1500 - 20 (IP) - 8 (UDP) - 4 (TFTP).
pub const MAX_BLKSIZE: usize = 1468;
pub const MAX_WINDOW: u16 = 64;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    pub filename: String,
    pub blksize: Option<usize>,
    pub tsize: bool,
    pub timeout: Option<u8>,
    pub windowsize: Option<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Packet {
    Rrq(ReadRequest),
    Ack(u16),
    Error(u16, String),
    /// Anything a read-only server refuses (WRQ, DATA, an unknown opcode).
    Other(u16),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TftpError {
    Malformed(&'static str),
    /// Only `octet` is served.
    Mode,
}

fn cstr(b: &[u8]) -> Option<(&str, &[u8])> {
    let n = b.iter().position(|c| *c == 0)?;
    Some((std::str::from_utf8(&b[..n]).ok()?, &b[n + 1..]))
}

/// Parses one packet. Unknown options are ignored (RFC 2347); bad values of known ones too.
pub fn parse(b: &[u8]) -> Result<Packet, TftpError> {
    if b.len() < 4 {
        return Err(TftpError::Malformed("short packet"));
    }
    let op = u16::from_be_bytes([b[0], b[1]]);
    match op {
        1 => {
            let (name, rest) = cstr(&b[2..]).ok_or(TftpError::Malformed("no file name"))?;
            let (mode, mut rest) = cstr(rest).ok_or(TftpError::Malformed("no mode"))?;
            if !mode.eq_ignore_ascii_case("octet") {
                return Err(TftpError::Mode);
            }
            let mut r = ReadRequest {
                filename: name.to_string(),
                blksize: None,
                tsize: false,
                timeout: None,
                windowsize: None,
            };
            let mut seen = 0;
            while !rest.is_empty() {
                let (k, after) = cstr(rest).ok_or(TftpError::Malformed("option name"))?;
                let (v, after) = cstr(after).ok_or(TftpError::Malformed("option value"))?;
                rest = after;
                seen += 1;
                if seen > 16 {
                    return Err(TftpError::Malformed("too many options"));
                }
                match k.to_ascii_lowercase().as_str() {
                    "blksize" => {
                        r.blksize = v.parse::<usize>().ok().filter(|n| (8..=65464).contains(n))
                    }
                    "tsize" => r.tsize = true,
                    "timeout" => r.timeout = v.parse::<u8>().ok().filter(|n| *n >= 1),
                    "windowsize" => {
                        r.windowsize = v.parse::<u16>().ok().filter(|n| (1..=65535).contains(n))
                    }
                    _ => {}
                }
            }
            Ok(Packet::Rrq(r))
        }
        4 => Ok(Packet::Ack(u16::from_be_bytes([b[2], b[3]]))),
        5 => Ok(Packet::Error(
            u16::from_be_bytes([b[2], b[3]]),
            cstr(&b[4..])
                .map(|(s, _)| s.to_string())
                .unwrap_or_default(),
        )),
        other => Ok(Packet::Other(other)),
    }
}

/// A name confined to the boot root, as a path relative to it: no `..`, no empty or hidden
/// components. A leading `/` names the boot root itself, as tftp-hpa's `--secure` and dnsmasq
/// read it (GRUB asks for `/grub/grub.cfg`).
pub fn confine(name: &str) -> Option<PathBuf> {
    let name = name.replace('\\', "/");
    let p = Path::new(name.trim_start_matches('/'));
    if name.is_empty() || name.len() > 255 || p.is_absolute() {
        return None;
    }
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::Normal(s) if !s.to_string_lossy().starts_with('.') => out.push(s),
            _ => return None,
        }
    }
    (!out.as_os_str().is_empty()).then_some(out)
}

pub fn error_packet(code: u16, msg: &str) -> Vec<u8> {
    let mut v = vec![0, 5];
    v.extend_from_slice(&code.to_be_bytes());
    v.extend_from_slice(msg.as_bytes());
    v.push(0);
    v
}

/// The OACK for what was accepted; `None` when no option was accepted.
pub fn oack(
    blksize: Option<usize>,
    tsize: Option<u64>,
    timeout: Option<u8>,
    windowsize: Option<u16>,
) -> Option<Vec<u8>> {
    let mut v = vec![0, 6];
    let mut any = false;
    let mut put = |k: &str, val: String| {
        v.extend_from_slice(k.as_bytes());
        v.push(0);
        v.extend_from_slice(val.as_bytes());
        v.push(0);
        any = true;
    };
    if let Some(b) = blksize {
        put("blksize", b.to_string());
    }
    if let Some(t) = tsize {
        put("tsize", t.to_string());
    }
    if let Some(t) = timeout {
        put("timeout", t.to_string());
    }
    if let Some(w) = windowsize {
        put("windowsize", w.to_string());
    }
    any.then_some(v)
}

/// A requested name as logs show it: a per-boot name's nonce (the one-time name of a discovery
/// token's archive) is left out.
pub fn shown(name: &str) -> String {
    // Whatever the spelling: case and backslashes do not hide a nonce.
    let norm = name.replace('\\', "/");
    match norm.to_ascii_lowercase().find("per-boot/") {
        Some(i) => {
            let rest = &norm[i + "per-boot/".len()..];
            let after = rest.find(['/', '.']).map_or("", |j| &rest[j..]);
            format!("{}per-boot/<nonce>{after}", &norm[..i])
        }
        None => name.to_string(),
    }
}

/// The transfers running, by client address and requested name.
type Flights = Arc<std::sync::Mutex<std::collections::HashSet<(std::net::SocketAddr, String)>>>;

/// A running transfer's place in [`Flights`], given back however it ends.
struct InFlight(Flights, (std::net::SocketAddr, String));

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.1);
    }
}

/// The longest a transfer may take, however its client acknowledges (the largest boot file, the
/// ramdisk, takes seconds).
const MAX_TRANSFER: Duration = Duration::from_secs(600);

/// Called after each complete transfer with the peer and the file name.
pub type OnTransfer = Arc<dyn Fn(std::net::SocketAddr, &str) + Send + Sync>;

/// What a transfer sends: a file's first `file_len` bytes, then `tail`; a file of the boot root
/// (no tail), or one made for one request (GRUB's per-machine configuration, a per-boot initrd:
/// a tail alone, or the ramdisk then the archive).
pub struct Made {
    file: Option<std::fs::File>,
    file_len: u64,
    tail: Vec<u8>,
}

impl Made {
    pub fn bytes(tail: Vec<u8>) -> Self {
        Made {
            file: None,
            file_len: 0,
            tail,
        }
    }

    pub fn file_then(file: std::fs::File, len: u64, tail: Vec<u8>) -> Self {
        Made {
            file: Some(file),
            file_len: len,
            tail,
        }
    }

    fn len(&self) -> u64 {
        self.file_len + self.tail.len() as u64
    }

    /// Positional read: the file's part with `pread`, the tail from memory.
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<usize> {
        if off < self.file_len {
            use std::os::unix::fs::FileExt;
            let room = (self.file_len - off).min(buf.len() as u64) as usize;
            return match &self.file {
                Some(f) => f.read_at(&mut buf[..room], off),
                None => Ok(0),
            };
        }
        let start = ((off - self.file_len) as usize).min(self.tail.len());
        let n = buf.len().min(self.tail.len() - start);
        buf[..n].copy_from_slice(&self.tail[start..start + n]);
        Ok(n)
    }
}

/// Makes the files the boot root does not hold: `None` for a name it does not make (the boot
/// root is read), `Some(Err((code, message)))` when it refuses (sent as that TFTP error: 1 not
/// found, 2 refused, with the message).
pub type Maker = Arc<
    dyn Fn(
            String,
            std::net::SocketAddr,
        ) -> std::pin::Pin<
            Box<dyn std::future::Future<Output = Option<Result<Made, (u16, String)>>> + Send>,
        > + Send
        + Sync,
>;

/// Serves read requests on `socket` until it fails.
/// `limits`: transfers at once in all, and from one source address.
pub async fn serve(
    socket: UdpSocket,
    root: Arc<ReadRoot>,
    limits: (usize, usize),
    on_transfer: OnTransfer,
    made: Option<Maker>,
) {
    let (max_transfers, per_source) = limits;
    let limit = Arc::new(Semaphore::new(max_transfers));
    let sources = Arc::new(crate::base::limits::PerSource::default());
    let local_ip = socket.local_addr().map(|a| a.ip()).ok();
    let in_flight: Flights = Arc::default();
    let mut buf = vec![0u8; 2048];
    loop {
        let Ok((n, peer)) = socket.recv_from(&mut buf).await else {
            return;
        };
        let req = match parse(&buf[..n]) {
            Ok(Packet::Rrq(r)) => r,
            Ok(Packet::Other(2)) => {
                let _ = socket
                    .send_to(&error_packet(2, "this server is read-only"), peer)
                    .await;
                continue;
            }
            Ok(_) => continue,
            Err(TftpError::Mode) => {
                let _ = socket
                    .send_to(&error_packet(0, "only octet mode is served"), peer)
                    .await;
                continue;
            }
            Err(TftpError::Malformed(m)) => {
                let _ = socket.send_to(&error_packet(4, m), peer).await;
                continue;
            }
        };
        // A retransmitted request (the same client port, the same name) while its transfer runs
        // is the same request: a second transfer would race the first, and for a made file
        // (spent once) answer "not found" before the first's data.
        let key = (peer, req.filename.clone());
        if !in_flight
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key.clone())
        {
            continue;
        }
        let flight = InFlight(in_flight.clone(), key);
        // A place among all transfers, then among this source's; either full: "busy, retry".
        let places = match limit.clone().try_acquire_owned() {
            Err(_) => Err("tftp: too many transfers at once; refusing one"),
            Ok(permit) => sources
                .enter(peer.ip(), per_source)
                .map(|slot| (permit, slot))
                .ok_or("tftp: the source's transfer limit is reached; refusing one"),
        };
        let (permit, slot) = match places {
            Ok(p) => p,
            Err(why) => {
                tracing::warn!(%peer, file = %shown(&req.filename), max_transfers, per_source, "{why}");
                crate::base::metrics::get()
                    .tftp_refused_busy
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let _ = socket
                    .send_to(&error_packet(0, "server busy; retry"), peer)
                    .await;
                continue;
            }
        };
        let root = root.clone();
        let on_transfer = on_transfer.clone();
        let made = made.clone();
        tokio::spawn(async move {
            let _flight = flight;
            let _permit = permit;
            // The source's slot is given back however the transfer ends.
            let _slot = slot;
            let bind = std::net::SocketAddr::new(
                local_ip.unwrap_or(std::net::Ipv4Addr::UNSPECIFIED.into()),
                0,
            );
            let Ok(sock) = UdpSocket::bind(bind).await else {
                return;
            };
            if sock.connect(peer).await.is_err() {
                return;
            }
            let m = crate::base::metrics::get();
            let made = match &made {
                Some(m) => m(req.filename.clone(), peer).await,
                None => None,
            };
            match transfer(&sock, &root, &req, made).await {
                Ok(size) => {
                    m.tftp_transfers
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    m.tftp_bytes
                        .fetch_add(size, std::sync::atomic::Ordering::Relaxed);
                    on_transfer(peer, &shown(&req.filename))
                }
                Err(e) => {
                    m.tftp_failures
                        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    tracing::info!(%peer, file = %shown(&req.filename), error = %e, "tftp: transfer ended")
                }
            }
        });
    }
}

/// Sends one file; the number of file bytes sent when the last block is acknowledged.
async fn transfer(
    sock: &UdpSocket,
    root: &ReadRoot,
    req: &ReadRequest,
    made: Option<Result<Made, (u16, String)>>,
) -> Result<u64, String> {
    let source = match made {
        Some(Ok(m)) => m,
        Some(Err((code, message))) => {
            let _ = sock.send(&error_packet(code, &message)).await;
            return Err(message);
        }
        None => open_source(sock, root, req).await?,
    };
    send(sock, req, &source).await
}

/// A file beneath the boot root, or the error packet sent and the reason.
async fn open_source(sock: &UdpSocket, root: &ReadRoot, req: &ReadRequest) -> Result<Made, String> {
    let Some(path) = confine(&req.filename) else {
        let _ = sock
            .send(&error_packet(
                2,
                "access violation: names stay inside the boot root",
            ))
            .await;
        return Err("path refused".into());
    };
    // Blocks are read with positional reads of one window at a time: boot files sit in the page
    // cache, where a `pread` costs microseconds (tokio's async file would hop to a blocking thread
    // for every block).
    let file = match root.open_file(&path) {
        Ok(f) => f,
        Err(_) => {
            let _ = sock.send(&error_packet(1, "file not found")).await;
            return Err("not found".into());
        }
    };
    let meta = file.metadata().map_err(|e| e.to_string())?;
    if !meta.is_file() {
        let _ = sock.send(&error_packet(1, "file not found")).await;
        return Err("not a file".into());
    }
    Ok(Made::file_then(file, meta.len(), Vec::new()))
}

/// Sends `source`; the number of bytes sent when the last block is acknowledged.
async fn send(sock: &UdpSocket, req: &ReadRequest, source: &Made) -> Result<u64, String> {
    let size = source.len();
    let blksize = req.blksize.map(|b| b.min(MAX_BLKSIZE));
    let window = req.windowsize.map(|w| w.min(MAX_WINDOW));
    // A timeout past 10 s is not honoured, so not echoed either (RFC 2349: the client then
    // keeps its default).
    let asked_timeout = req.timeout.filter(|t| (1..=10).contains(t));
    let timeout = Duration::from_secs(asked_timeout.unwrap_or(1) as u64);
    let bs = blksize.unwrap_or(512);
    let win = window.unwrap_or(1) as u64;
    let mut ack = vec![0u8; 516];
    if let Some(o) = oack(blksize, req.tsize.then_some(size), asked_timeout, window) {
        wait_ack(sock, &o, 0, timeout, &mut ack).await?;
    }
    let blocks = size / bs as u64 + 1; // the last block is short (possibly empty)
    let mut next: u64 = 1; // first block not yet acknowledged
    let mut data = vec![0u8; 4 + bs];
    // One window of the file, read with one positional read.
    let mut window_buf = vec![0u8; bs * win as usize];
    let mut retries = 0;
    let started = std::time::Instant::now();
    while next <= blocks {
        let last = (next + win - 1).min(blocks);
        let start = (next - 1) * bs as u64;
        let want = (((last - next + 1) * bs as u64).min(size.saturating_sub(start))) as usize;
        let mut got = 0;
        while got < want {
            let n = source
                .read_at(&mut window_buf[got..want], start + got as u64)
                .map_err(|e| e.to_string())?;
            if n == 0 {
                return Err("the file shrank while being sent".into());
            }
            got += n;
        }
        for b in next..=last {
            let off = ((b - next) * bs as u64) as usize;
            let len = bs.min(want.saturating_sub(off));
            data[0..2].copy_from_slice(&3u16.to_be_bytes());
            data[2..4].copy_from_slice(&((b & 0xffff) as u16).to_be_bytes());
            data[4..4 + len].copy_from_slice(&window_buf[off..off + len]);
            sock.send(&data[..4 + len])
                .await
                .map_err(|e| e.to_string())?;
        }
        let progressed = match tokio::time::timeout(timeout, sock.recv(&mut ack)).await {
            Ok(Ok(n)) => match parse(&ack[..n]) {
                Ok(Packet::Ack(a)) => {
                    // The acknowledged block, unwrapped into this window's range.
                    let acked = (next..=last).rev().find(|b| (b & 0xffff) as u16 == a);
                    if let Some(b) = acked {
                        next = b + 1;
                    }
                    acked.is_some()
                }
                Ok(Packet::Error(..)) => return Err("the client aborted".into()),
                _ => false,
            },
            _ => false,
        };
        // A silence, a stale ACK or anything else that does not move the transfer on counts
        // alike: a client repeating an old ACK cannot hold its place for ever.
        if progressed {
            retries = 0;
        } else {
            retries += 1;
            if retries > 5 {
                return Err("the client stopped acknowledging new blocks".into());
            }
        }
        if started.elapsed() > MAX_TRANSFER {
            return Err("the transfer took longer than 10 minutes".into());
        }
    }
    Ok(size)
}

async fn wait_ack(
    sock: &UdpSocket,
    packet: &[u8],
    block: u16,
    timeout: Duration,
    buf: &mut [u8],
) -> Result<(), String> {
    for _ in 0..6 {
        sock.send(packet).await.map_err(|e| e.to_string())?;
        if let Ok(Ok(n)) = tokio::time::timeout(timeout, sock.recv(buf)).await {
            match parse(&buf[..n]) {
                Ok(Packet::Ack(b)) if b == block => return Ok(()),
                Ok(Packet::Error(..)) => return Err("the client refused the options".into()),
                _ => {}
            }
        }
    }
    Err("no acknowledgement of the options".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rrq(parts: &[&str]) -> Vec<u8> {
        let mut v = vec![0, 1];
        for p in parts {
            v.extend_from_slice(p.as_bytes());
            v.push(0);
        }
        v
    }

    #[test]
    fn read_requests_and_options() {
        let r = parse(&rrq(&[
            "undionly.kpxe",
            "octet",
            "blksize",
            "1468",
            "tsize",
            "0",
            "windowsize",
            "8",
            "x-unknown",
            "1",
        ]))
        .unwrap();
        assert_eq!(
            r,
            Packet::Rrq(ReadRequest {
                filename: "undionly.kpxe".into(),
                blksize: Some(1468),
                tsize: true,
                timeout: None,
                windowsize: Some(8)
            })
        );
        // Out-of-range values are ignored, not fatal.
        let Packet::Rrq(r) =
            parse(&rrq(&["f", "OCTET", "blksize", "4", "windowsize", "0"])).unwrap()
        else {
            panic!()
        };
        assert_eq!((r.blksize, r.windowsize), (None, None));
        assert_eq!(parse(&rrq(&["f", "netascii"])), Err(TftpError::Mode));
        assert!(parse(&[0, 1, b'f']).is_err());
        assert!(parse(&[0]).is_err());
        let many: Vec<&str> = std::iter::once("f")
            .chain(std::iter::once("octet"))
            .chain(std::iter::repeat_n("a", 40))
            .collect();
        assert!(parse(&rrq(&many)).is_err());
        assert_eq!(parse(&[0, 4, 0, 7]), Ok(Packet::Ack(7)));
        assert_eq!(parse(&[0, 2, b'f', 0, b'o', 0]), Ok(Packet::Other(2)));
    }

    #[test]
    fn a_per_boot_nonce_is_not_logged() {
        assert_eq!(
            shown("/per-boot/9ee4150d127dc68e9ab5a2b4903de5ff/initrd.img"),
            "/per-boot/<nonce>/initrd.img"
        );
        assert_eq!(
            shown("per-boot/9ee4150d127dc68e9ab5a2b4903de5ff.cpio"),
            "per-boot/<nonce>.cpio"
        );
        assert_eq!(shown("/grub/grub.cfg"), "/grub/grub.cfg");
        for odd in [
            "PER-BOOT/9ee4150d127dc68e9ab5a2b4903de5ff.cpio",
            "per-boot\\9ee4150d127dc68e9ab5a2b4903de5ff\\initrd.img",
        ] {
            assert!(!shown(odd).contains("9ee4150d"), "{odd}: {}", shown(odd));
        }
    }

    #[test]
    fn the_path_guard() {
        assert_eq!(
            confine("undionly.kpxe"),
            Some(PathBuf::from("undionly.kpxe"))
        );
        assert_eq!(confine("efi/ipxe.efi"), Some(PathBuf::from("efi/ipxe.efi")));
        // Absolute is relative to the boot root: never the host's root.
        assert_eq!(
            confine("/grub/grub.cfg"),
            Some(PathBuf::from("grub/grub.cfg"))
        );
        assert_eq!(confine("/etc/passwd"), Some(PathBuf::from("etc/passwd")));
        for bad in [
            "../etc/passwd",
            "/../etc/passwd",
            "//",
            "a/../../b",
            "..",
            "",
            ".hidden",
            "..\\x",
            "a\\..\\..\\b",
        ] {
            assert_eq!(confine(bad), None, "{bad}");
        }
    }

    #[test]
    fn oack_carries_what_was_accepted() {
        assert_eq!(oack(None, None, None, None), None);
        let o = oack(Some(1468), Some(1234), None, Some(8)).unwrap();
        assert_eq!(&o[..2], &[0, 6]);
        assert_eq!(
            &o[2..],
            b"blksize\x001468\x00tsize\x001234\x00windowsize\x008\x00"
        );
    }
}
