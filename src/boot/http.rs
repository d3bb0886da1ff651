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

use crate::app::App;
use crate::boot::cpio::Cpio;
use crate::boot::templates;
use crate::edge::{Answer, Ask, Edge};
use crate::fsutil::ReadRoot;
use crate::protocol::BASE_PATH;
use crate::protocol::{Call, Outcome};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

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
    pub fn open(root: &crate::fsutil::ReadRoot, name: &str) -> Option<Self> {
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

pub fn boot_root(app: &App) -> PathBuf {
    app.config
        .boot
        .root
        .clone()
        .unwrap_or_else(|| app.state_dir.join("boot"))
}

/// The boot root, opened to read a template override beneath it.
fn script_root(app: &App) -> Result<ReadRoot, ScriptRefused> {
    ReadRoot::open(&boot_root(app)).map_err(ScriptRefused::Unavailable)
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
        return BootAnswer::Text(chain_script(&edge.boot_root, &base));
    }
    if rest == "boot.ipxe" {
        let mac = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("mac="))
            .map(|m| m.replace("%3A", ":").replace("%3a", ":"));
        let Some(mac) = mac.as_deref().and_then(crate::claims::loose_mac) else {
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
                peer: peer.ip().to_string(),
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

/// A per-boot archive, once, and only to the address it was made for.
pub fn take_archive(app: &App, nonce: &str, peer: &str) -> Option<zeroize::Zeroizing<Vec<u8>>> {
    let peer = peer.parse::<std::net::IpAddr>().ok()?;
    app.boot_gate
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take(nonce, peer, crate::clock::now())
}

/// Why the core did not give a boot script.
pub enum ScriptRefused {
    /// 403: the network did not see this MAC at this address (nothing was written).
    NotSighted(String),
    /// 429: over a per-minute rate.
    Rate(String),
    /// 503: the core cannot answer now.
    Unavailable(String),
}

/// The core's side of `boot.ipxe`. A discovery token is minted, and the boot recorded, only for
/// a MAC the boot server's DHCP saw at `peer` (the address the edge saw the request come from)
/// within `[boot] sighting_seconds`; the local-disk answer needs no sighting. A refused request
/// writes nothing: no lease row, no token voided, no archive taken.
pub async fn script(
    app: &Arc<App>,
    mac: &str,
    peer: &str,
    base: &str,
) -> Result<String, ScriptRefused> {
    let bad = |m: &str| ScriptRefused::Unavailable(m.to_string());
    let mac = crate::claims::loose_mac(mac).ok_or_else(|| bad("not a MAC address"))?;
    let mac = mac.as_str();
    let peer_ip = peer
        .parse::<std::net::IpAddr>()
        .map_err(|_| bad("not an IP address"))?;
    let Some(join) = app.join.get() else {
        return Err(bad("the JoinService is not running"));
    };
    let b = &app.config.boot;
    let limits = crate::boot::gate::Limits::from(b);
    let now = crate::clock::now();
    let sighted = {
        let mut gate = app.boot_gate.lock().unwrap_or_else(|p| p.into_inner());
        gate.admit_script(mac, peer_ip, now, &limits)
            .map_err(|crate::boot::gate::Refused::Rate(m)| ScriptRefused::Rate(m))?;
        gate.sighted(mac, peer_ip, now, &limits)
    };
    let may_mint = sighted || !b.require_sighting;
    let ask = |epoch: Option<i64>, mint: bool| {
        let call = Call::MintDiscovery {
            mac: mac.to_string(),
            boot_lease_epoch: epoch,
            sighted_ip: (sighted && mint).then(|| peer_ip.to_string()),
            mint,
        };
        async move {
            let out = join
                .call(&serde_json::to_vec(&call).expect("serializes"))
                .await;
            serde_json::from_slice::<Outcome>(&out).ok()
        }
    };
    let record = |stage: &'static str| {
        let (app2, mac2, ip) = (app.clone(), mac.to_string(), peer_ip.to_string());
        async move {
            tokio::task::spawn_blocking(move || lease(&app2, &mac2, Some(ip), None, stage, None))
                .await
                .ok()
                .flatten()
        }
    };
    if !may_mint {
        // Only the local-disk answer may be given: asked without minting, nothing is written.
        return match ask(None, false).await {
            Some(Outcome::LocalBoot) => {
                record("script").await;
                tracing::info!(%mac, "boot: adopted node; local disk");
                Ok(templates::render(
                    &script_root(app)?,
                    templates::LOCAL_DISK,
                    &[],
                ))
            }
            Some(_) => {
                tracing::info!(%mac, %peer, "boot: no DHCP sighting of this MAC at this address; refused");
                Err(ScriptRefused::NotSighted(format!(
                    "bca: the boot server's DHCP did not see {mac} at {peer_ip} in the last {} s; \
                     boot through the provisioning network's DHCP (docs/boot.md)",
                    b.sighting_seconds
                )))
            }
            None => Err(bad("the JoinService gave no answer")),
        };
    }
    let epoch = record("script").await;
    match ask(epoch, true).await {
        Some(Outcome::LocalBoot) => {
            tracing::info!(%mac, "boot: adopted node; local disk");
            Ok(templates::render(
                &script_root(app)?,
                templates::LOCAL_DISK,
                &[],
            ))
        }
        Some(Outcome::DiscoveryToken { token }) => {
            let token = zeroize::Zeroizing::new(token);
            let archive = zeroize::Zeroizing::new(
                per_boot_archive(app, mac, epoch, &token).map_err(ScriptRefused::Unavailable)?,
            );
            let mut n = [0u8; 16];
            crate::crypto::fill_random(&mut n);
            let nonce = crate::crypto::hex(&n);
            let evicted = app
                .boot_gate
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .keep(nonce.clone(), archive, mac, peer_ip, now, &limits);
            if evicted > 0 {
                tracing::warn!(%mac, %peer, evicted, "boot: waiting per-boot archives gave way (a source at its cap, or all places taken)");
            }
            tracing::info!(%mac, "boot: discovery ramdisk");
            Ok(templates::render(
                &script_root(app)?,
                templates::DISCOVERY,
                &[
                    ("mac", mac),
                    ("base", base),
                    ("base_path", BASE_PATH),
                    ("kernel_args", &app.config.boot.kernel_args),
                    ("nonce", &nonce),
                ],
            ))
        }
        _ => Err(bad("no discovery token could be minted")),
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
        crate::agent_files::agent_config_for(&app.state_dir, &gateway).map_err(|e| e.message)?;
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
