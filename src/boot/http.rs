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

use crate::app::{App, BASE_PATH};
use crate::boot::cpio::Cpio;
use crate::edge::{Answer, Ask, Edge};
use crate::protocol::{Call, Outcome};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

/// How long a per-boot archive waits to be fetched.
const ARCHIVE_TTL: i64 = 600;

pub enum BootAnswer {
    Text(String),
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
}

impl FileBody {
    /// Opens `name` beneath `root` (a regular file only).
    pub fn open(root: &crate::edge::ReadRoot, name: &str) -> Option<Self> {
        let file = root.open_file(std::path::Path::new(name)).ok()?;
        let len = file.metadata().ok()?.len();
        Some(Self {
            file: Some(tokio::fs::File::from_std(file)),
            remaining: len,
            suffix: None,
            buf: Vec::new(),
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
        Poll::Ready(this.suffix.take().map(|s| Ok(hyper::body::Frame::data(s))))
    }

    fn is_end_stream(&self) -> bool {
        self.remaining == 0 && self.suffix.is_none()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.len())
    }
}

pub fn boot_root(app: &App) -> PathBuf {
    app.config
        .boot
        .root
        .clone()
        .unwrap_or_else(|| app.state_dir.join("boot"))
}

/// The URL iPXE reaches the HTTP listener at.
pub fn http_url(boot: &crate::boot::BootConfig, local: Option<SocketAddr>) -> String {
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

/// The script iPXE gets first: it chains to the per-machine script with the booting NIC's MAC.
pub fn chain_script(base: &str) -> String {
    format!("#!ipxe\nchain {base}{BASE_PATH}/boot/boot.ipxe?mac=${{net0/mac}}\n")
}

fn valid_file_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && !n.starts_with('.')
        && n.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
}

/// Records a boot lease row: who booted what, when. Returns its epoch.
pub fn lease(
    app: &App,
    mac: &str,
    ip: Option<String>,
    arch: Option<u16>,
    stage: &str,
    file: Option<&str>,
) -> Option<i64> {
    let now = crate::clock::now();
    app.store
        .write(|tx| {
            tx.execute(
                "INSERT INTO boot_leases (mac, ip, arch, stage, file, created_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                rusqlite::params![mac, ip, arch, stage, file, now],
            )?;
            Ok(tx.last_insert_rowid())
        })
        .ok()
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
        return BootAnswer::Text(chain_script(&base));
    }
    if rest == "boot.ipxe" {
        let mac = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("mac="))
            .map(|m| m.replace("%3A", ":").replace("%3a", ":"));
        let Some(mac) = mac.as_deref().and_then(crate::discovery::loose_mac) else {
            return BootAnswer::Text(
                "#!ipxe\necho bca: this script needs ?mac=<the booting NIC's MAC>\nexit 1\n".into(),
            );
        };
        let ask = Ask::BootScript {
            mac,
            peer: peer.ip().to_string(),
            base,
        };
        return match edge.core.ask(ask).await {
            Answer::Text { text } => BootAnswer::Text(text),
            Answer::Unavailable { message } => BootAnswer::Unavailable(message),
            _ => BootAnswer::Unavailable("the core gave no script".into()),
        };
    }
    if let Some(r) = rest.strip_prefix("per-boot/") {
        // `<nonce>.cpio` is the archive alone; `<nonce>/initrd.img` the ramdisk with the archive
        // appended (one initrd works with every firmware's way of loading initrds). Either is
        // served once.
        let (nonce, combined) = match (r.strip_suffix(".cpio"), r.strip_suffix("/initrd.img")) {
            (Some(n), _) => (n, false),
            (None, Some(n)) => (n, true),
            _ => return BootAnswer::NotFound,
        };
        if nonce.len() != 32 || !nonce.bytes().all(|c| c.is_ascii_hexdigit()) {
            return BootAnswer::NotFound;
        }
        let archive = match edge
            .core
            .ask(Ask::BootArchive {
                nonce: nonce.into(),
            })
            .await
        {
            Answer::Bytes { b64: Some(b) } => crate::crypto::b64_decode(&b),
            _ => None,
        };
        let Some(archive) = archive else {
            return BootAnswer::NotFound;
        };
        if !combined {
            return BootAnswer::Bytes(archive);
        }
        let Some(mut body) = FileBody::open(&edge.boot_root, "initrd.img") else {
            return BootAnswer::NotFound;
        };
        // The kernel skips zero padding between concatenated archives; the padding is computed
        // from the length of the file as opened.
        let mut suffix = vec![0u8; ((4 - body.remaining % 4) % 4) as usize];
        suffix.extend_from_slice(&archive);
        body.suffix = Some(bytes::Bytes::from(suffix));
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

/// Per-boot archives waiting to be fetched, at most (each holds a discovery token).
const MAX_WAITING_ARCHIVES: usize = 4096;

/// The waiting archives, the expired ones dropped (and wiped: they hold discovery tokens).
fn waiting(app: &App) -> std::sync::MutexGuard<'_, crate::app::BootArchives> {
    let now = crate::clock::now();
    let mut map = app.boot_archives.lock().unwrap_or_else(|p| p.into_inner());
    map.retain(|_, (_, t)| now - *t <= ARCHIVE_TTL);
    map
}

/// A per-boot archive, once: taken out of the waiting ones.
pub fn take_archive(app: &App, nonce: &str) -> Option<zeroize::Zeroizing<Vec<u8>>> {
    waiting(app).remove(nonce).map(|(a, _)| a)
}

/// The core's side of `boot.ipxe`: records the boot, mints the discovery token through the
/// JoinService and keeps the per-boot archive for one fetch. `peer` is the client's address as
/// the edge saw it.
pub async fn script(app: &Arc<App>, mac: &str, peer: &str, base: &str) -> Result<String, String> {
    let mac = crate::discovery::loose_mac(mac).ok_or("not a MAC address")?;
    let mac = mac.as_str();
    let ip = peer
        .parse::<std::net::IpAddr>()
        .map_err(|_| "not an IP address")?
        .to_string();
    let Some(join) = app.join.get() else {
        return Err("the JoinService is not running".into());
    };
    // Before a token is minted: one that could not be kept would void the machine's last one.
    if waiting(app).len() >= MAX_WAITING_ARCHIVES {
        return Err(format!(
            "{MAX_WAITING_ARCHIVES} per-boot archives wait to be fetched; retry in a minute"
        ));
    }
    let app2 = app.clone();
    let mac2 = mac.to_string();
    let epoch =
        tokio::task::spawn_blocking(move || lease(&app2, &mac2, Some(ip), None, "script", None))
            .await
            .ok()
            .flatten();
    let call = Call::MintDiscovery {
        mac: mac.to_string(),
        boot_lease_epoch: epoch,
    };
    let out = join
        .call(&serde_json::to_vec(&call).expect("serializes"))
        .await;
    match serde_json::from_slice::<Outcome>(&out) {
        Ok(Outcome::LocalBoot) => {
            tracing::info!(%mac, "boot: adopted node; local disk");
            Ok("#!ipxe\necho bca: this machine is an adopted node; booting its local disk\nsanboot --no-describe --drive 0x80 || exit\n".into())
        }
        Ok(Outcome::DiscoveryToken { token }) => {
            let token = zeroize::Zeroizing::new(token);
            let archive = zeroize::Zeroizing::new(per_boot_archive(app, mac, epoch, &token)?);
            let mut n = [0u8; 16];
            crate::crypto::fill_random(&mut n);
            let nonce = crate::crypto::hex(&n);
            app.boot_archives
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(nonce.clone(), (archive, crate::clock::now()));
            tracing::info!(%mac, "boot: discovery ramdisk");
            let args = &app.config.boot.kernel_args;
            Ok(format!(
                "#!ipxe\necho bca: discovery ramdisk for {mac}\n\
                 kernel {base}{BASE_PATH}/boot/files/vmlinuz {args} initrd=initrd.img\n\
                 initrd --name initrd.img {base}{BASE_PATH}/boot/per-boot/{nonce}/initrd.img\n\
                 boot\n"
            ))
        }
        _ => Err("no discovery token could be minted".into()),
    }
}

/// The second initrd: the agent's configuration and pins, the discovery token (0600) and the
/// boot facts, under `/etc/bca-agent`.
fn per_boot_archive(
    app: &App,
    mac: &str,
    epoch: Option<i64>,
    token: &str,
) -> Result<Vec<u8>, String> {
    let gateway = app
        .config
        .gateway_url
        .clone()
        .ok_or("the appliance has no gateway_url: the ramdisk would not know where to join")?;
    let (cfg, jwk) =
        crate::agent::agent_config_for(&app.state_dir, &gateway).map_err(|e| e.message)?;
    let boot = serde_json::json!({"mac": mac, "bootLeaseEpoch": epoch});
    let mut c = Cpio::new();
    c.dir("etc", 0o755)
        .dir("etc/bca-agent", 0o700)
        .file(
            "etc/bca-agent/config.toml",
            0o600,
            toml::to_string(&cfg).expect("serializes").as_bytes(),
        )
        .file("etc/bca-agent/join-encryption.jwk", 0o644, jwk.as_bytes())
        .file(
            "etc/bca-agent/discovery-token",
            0o600,
            format!("{token}\n").as_bytes(),
        )
        .file(
            "etc/bca-agent/boot.json",
            0o644,
            boot.to_string().as_bytes(),
        );
    Ok(c.finish())
}
