//! The HTTP side of network boot, on the public listener:
//!
//! - `GET /api/compute/boot/chain.ipxe`: what DHCP points iPXE at; it chains to the per-machine
//!   script with the booting NIC's MAC;
//! - `GET /api/compute/boot/boot.ipxe?mac=…`: the per-machine script. A MAC whose node is adopted
//!   and not marked for rediscovery boots its local disk; any other gets the discovery ramdisk and
//!   a per-boot archive carrying the pins and a fresh discovery token (minted through the
//!   JoinService; fetching again voids the earlier token);
//! - `GET /api/compute/boot/per-boot/<nonce>/initrd.img`: the ramdisk's initramfs with that
//!   archive appended (or `<nonce>.cpio`, the archive alone), served once;
//! - `GET /api/compute/boot/files/<name>`: the ramdisk's kernel and initramfs and the iPXE binaries.
//!
//! The discovery token never appears in a URL, a log line or a boot lease row.

use crate::base::fsutil::ReadRoot;
use crate::edge::boot::templates;
use crate::edge::{Answer, Ask, Edge};
use crate::proto::protocol::BASE_PATH;
use std::net::SocketAddr;

pub enum BootAnswer {
    Text(String),
    /// Refused (403): the text says why; nothing was written.
    Forbidden(String),
    /// Over a rate (429).
    TooMany(String),
    Bytes(Vec<u8>),
    /// A boot file streamed from disk, then `suffix` (a per-boot archive): never read whole into
    /// memory, so a thousand machines fetching a ramdisk cost a chunk buffer each.
    Stream(FileBody),
    NotFound,
    Unavailable(String),
}

/// The chunk a streamed boot file is read in.
const CHUNK: usize = 64 * 1024;

/// A response body that reads a file in [`CHUNK`]s and then sends a suffix.
pub struct FileBody {
    file: Option<tokio::fs::File>,
    remaining: u64,
    suffix: Option<bytes::Bytes>,
    buf: Vec<u8>,
    /// A place among the downloads served at once, given back when the body ends or is dropped.
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl FileBody {
    /// Opens `name` beneath `root` (a regular file only).
    pub fn open(root: &crate::base::fsutil::ReadRoot, name: &str) -> Option<Self> {
        let file = root.open_file(std::path::Path::new(name)).ok()?;
        Self::from_file(file, None)
    }

    /// Streams an open file (from where it stands: the start), holding `permit` until done.
    pub fn from_file(
        file: std::fs::File,
        permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Option<Self> {
        let len = file.metadata().ok()?.len();
        Some(Self {
            file: Some(tokio::fs::File::from_std(file)),
            remaining: len,
            suffix: None,
            buf: Vec::new(),
            permit,
        })
    }

    /// The whole body's length (the Content-Length).
    pub fn len(&self) -> u64 {
        self.remaining + self.suffix.as_ref().map_or(0, |s| s.len() as u64)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl hyper::body::Body for FileBody {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, std::io::Error>>> {
        use std::task::Poll;
        use tokio::io::AsyncRead;
        let this = &mut *self;
        if this.remaining > 0 {
            if let Some(file) = this.file.as_mut() {
                let want = CHUNK.min(this.remaining as usize);
                this.buf.resize(want, 0);
                let mut rb = tokio::io::ReadBuf::new(&mut this.buf);
                match std::pin::Pin::new(file).poll_read(cx, &mut rb) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(e)) => return Poll::Ready(Some(Err(e))),
                    Poll::Ready(Ok(())) => {
                        let n = rb.filled().len();
                        if n == 0 {
                            // The file shrank under us: end with an error, never a short body.
                            return Poll::Ready(Some(Err(std::io::Error::new(
                                std::io::ErrorKind::UnexpectedEof,
                                "the boot file shrank while being served",
                            ))));
                        }
                        this.remaining -= n as u64;
                        let chunk = bytes::Bytes::copy_from_slice(&this.buf[..n]);
                        return Poll::Ready(Some(Ok(hyper::body::Frame::data(chunk))));
                    }
                }
            }
        }
        this.file = None;
        this.permit = None;
        Poll::Ready(this.suffix.take().map(|s| Ok(hyper::body::Frame::data(s))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0 && self.suffix.is_none()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.len())
    }
}

/// The URL iPXE reaches the HTTP listener at.
pub fn http_url(boot: &crate::config::BootConfig, local: Option<SocketAddr>) -> String {
    if let Some(u) = &boot.http_url {
        return u.trim_end_matches('/').to_string();
    }
    let port = local.map(|a| a.port()).unwrap_or(80);
    match boot.server_ip {
        Some(ip) => format!("http://{ip}:{port}"),
        None => format!(
            "http://{}",
            local
                .map(|a| a.to_string())
                .unwrap_or_else(|| "127.0.0.1".into())
        ),
    }
}

/// The script iPXE gets first: it chains to the per-machine script with the MAC of the NIC that
/// did DHCP (`netX`, iPXE's last opened device: not always `net0` on a machine with several).
pub fn chain_script(root: &ReadRoot, base: &str) -> String {
    templates::render(
        root,
        templates::CHAIN,
        &[("base", base), ("base_path", BASE_PATH)],
    )
}

/// A per-boot name beneath `per-boot/`: `<nonce>.cpio` (the archive alone) or
/// `<nonce>/initrd.img` (the ramdisk with the archive appended, `true`); the nonce is 32 hex
/// digits. Over HTTP and, for GRUB, over TFTP.
pub fn per_boot_name(r: &str) -> Option<(&str, bool)> {
    let (nonce, combined) = match (r.strip_suffix(".cpio"), r.strip_suffix("/initrd.img")) {
        (Some(n), _) => (n, false),
        (None, Some(n)) => (n, true),
        _ => return None,
    };
    (nonce.len() == 32 && nonce.bytes().all(|c| c.is_ascii_hexdigit())).then_some((nonce, combined))
}

/// What follows a ramdisk of `len` bytes to make it the per-boot initrd: zero padding to a
/// multiple of four (the kernel skips it between concatenated archives), then the archive.
pub fn archive_suffix(len: u64, archive: &[u8]) -> Vec<u8> {
    let mut suffix = vec![0u8; ((4 - len % 4) % 4) as usize];
    suffix.extend_from_slice(archive);
    suffix
}

/// The per-boot archive `nonce`, taken (spent) for `peer`: `None` when there is none for that
/// address. Over HTTP and, for GRUB, over TFTP.
pub async fn take_archive(edge: &Edge, nonce: &str, peer: SocketAddr) -> Option<Vec<u8>> {
    match edge
        .core
        .ask(Ask::BootArchive {
            nonce: nonce.into(),
            peer: peer.ip().to_string(),
        })
        .await
    {
        Answer::Bytes { b64: Some(b) } => crate::base::crypto::b64_decode(&b),
        _ => None,
    }
}

/// The length of the boot file `name` (`files/<name>`), for a HEAD request.
pub fn file_len(edge: &Edge, name: &str) -> Option<u64> {
    if !valid_file_name(name) {
        return None;
    }
    FileBody::open(&edge.boot_root, name).map(|b| b.len())
}

fn valid_file_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && !n.starts_with('.')
        && n.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
}

/// The network side of the boot HTTP paths: parses the request, reads files beneath the boot
/// root, and asks the core for what needs the database (the script, a per-boot archive).
pub async fn handle(
    edge: &Edge,
    rest: &str,
    query: &str,
    peer: SocketAddr,
    local: Option<SocketAddr>,
) -> BootAnswer {
    let base = http_url(&edge.boot, local);
    if rest == "chain.ipxe" {
        return BootAnswer::Text(chain_script(&edge.boot_root, &base));
    }
    if rest == "boot.ipxe" {
        let mac = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("mac="))
            .map(|m| m.replace("%3A", ":").replace("%3a", ":"));
        let Some(mac) = mac.as_deref().and_then(crate::proto::claims::loose_mac) else {
            return BootAnswer::Text(templates::render(
                &edge.boot_root,
                templates::NEEDS_MAC,
                &[],
            ));
        };
        let ask = Ask::BootScript {
            mac,
            peer: peer.ip().to_string(),
            base,
            grub: false,
        };
        return match edge.core.ask(ask).await {
            Answer::Text { text } => BootAnswer::Text(text),
            Answer::Forbidden { message } => BootAnswer::Forbidden(message),
            Answer::TooMany { message } => BootAnswer::TooMany(message),
            Answer::Unavailable { message } => BootAnswer::Unavailable(message),
            _ => BootAnswer::Unavailable("the core gave no script".into()),
        };
    }
    if let Some(r) = rest.strip_prefix("per-boot/") {
        // `<nonce>.cpio` is the archive alone; `<nonce>/initrd.img` the ramdisk with the archive
        // appended (one initrd works with every firmware's way of loading initrds). Either is
        // served once.
        let Some((nonce, combined)) = per_boot_name(r) else {
            return BootAnswer::NotFound;
        };
        // The ramdisk is opened before the archive is taken (taken, it is spent).
        let body = if combined {
            match FileBody::open(&edge.boot_root, "initrd.img") {
                Some(b) => Some(b),
                None => return BootAnswer::NotFound,
            }
        } else {
            None
        };
        let Some(archive) = take_archive(edge, nonce, peer).await else {
            return BootAnswer::NotFound;
        };
        let Some(mut body) = body else {
            return BootAnswer::Bytes(archive);
        };
        body.suffix = Some(bytes::Bytes::from(archive_suffix(body.remaining, &archive)));
        return BootAnswer::Stream(body);
    }
    if let Some(name) = rest.strip_prefix("files/") {
        if !valid_file_name(name) {
            return BootAnswer::NotFound;
        }
        return match FileBody::open(&edge.boot_root, name) {
            Some(b) => BootAnswer::Stream(b),
            None => BootAnswer::NotFound,
        };
    }
    BootAnswer::NotFound
}
