//! `make bench` (second part): the boot storm. M simulated PXE clients (default 1000) inside a
//! network namespace do what a row of servers powering on does: DHCP (DISCOVER, OFFER, REQUEST,
//! ACK, full mode), TFTP of the iPXE binary, HTTP of the boot script, the kernel and the initrd
//! with its per-boot archive. `bca serve` runs in a second namespace (pinned to core 0), the
//! clients in the first (core 1), joined by a veth pair. Then the same TFTP transfer, same client
//! and options, against bca, dnsmasq and tftp-hpa side by side.
//!
//! Needs root (`ip netns`), `image/out` (`make image`) and dnsmasq; tftp-hpa's `in.tftpd` is taken
//! from Debian's package with `apt-get download` into `target/` when missing. Output lines are
//! `name: value unit`. Sizes: `BOOT_CLIENTS` (1000), `TFTP_CLIENTS` (200).
//!
//! Simplification, said here: the clients share one address for TFTP and HTTP (the one the
//! client namespace holds) and differ by port; each still gets its own lease by MAC.

mod support;
use dhcproto::v4::{Decoder, DhcpOption, Encoder, Message, MessageType, Opcode, OptionCode};
use dhcproto::{Decodable, Encodable};
use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{bin, env, line};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UdpSocket};

const SRV: &str = "10.77.0.1";
const ALT: &str = "10.77.0.2"; // dnsmasq's TFTP
const ALT2: &str = "10.77.0.3"; // tftp-hpa
const CLI: &str = "10.77.3.254";
const BLKSIZE: u16 = 1468;
/// The windowsize the last server granted in its OACK (1: it ignored the option, lock-step).
static GRANTED_WINDOW: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
const WINDOW: u16 = 16;

fn sh(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", cmd])
        .status()
        .is_ok_and(|s| s.success())
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Lab {
    srv: String,
    cli: String,
    dir: PathBuf,
    children: Vec<Child>,
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        sh(&format!("ip netns del {} 2>/dev/null", self.srv));
        sh(&format!("ip netns del {} 2>/dev/null", self.cli));
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn netns_cmd(ns: &str, core: &str, program: &Path) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, "taskset", "-c", core])
        .arg(program);
    c
}

/// tftp-hpa's server, from Debian's package, unpacked under target/ (never installed).
fn in_tftpd() -> Option<PathBuf> {
    if let Ok(p) = which("in.tftpd") {
        return Some(p);
    }
    let dir = root().join("target/tftpd-hpa");
    let p = dir.join("usr/sbin/in.tftpd");
    if p.exists() {
        return Some(p);
    }
    std::fs::create_dir_all(&dir).ok()?;
    // It links libwrap, which a machine without tcpd lacks: unpacked beside it.
    let ok = sh(&format!(
        "cd {} && apt-get download tftpd-hpa libwrap0 >/dev/null 2>&1 && for d in *.deb; do dpkg -x $d .; done",
        dir.display()
    ));
    (ok && p.exists()).then_some(p)
}

fn which(name: &str) -> Result<PathBuf, ()> {
    let o = Command::new("sh")
        .args(["-c", &format!("command -v {name}")])
        .output()
        .map_err(|_| ())?;
    let s = String::from_utf8_lossy(&o.stdout).trim().to_string();
    if o.status.success() && !s.is_empty() {
        Ok(PathBuf::from(s))
    } else {
        Err(())
    }
}

fn setup() -> Result<Lab, String> {
    let image = root().join("image/out");
    for f in ["undionly.kpxe", "vmlinuz", "initrd.img"] {
        if !image.join(f).exists() {
            return Err(format!(
                "{} is missing: run make image",
                image.join(f).display()
            ));
        }
    }
    let tag = std::process::id() % 10_000;
    let (srv, cli) = (format!("bcab-s{tag}"), format!("bcab-c{tag}"));
    let dir = std::env::temp_dir().join(format!("bca-boot-bench-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    let mut lab = Lab {
        srv: srv.clone(),
        cli: cli.clone(),
        dir: dir.clone(),
        children: Vec::new(),
    };
    for cmd in [
        format!("ip netns add {srv}"),
        format!("ip netns add {cli}"),
        format!("ip -n {srv} link add bb0 type veth peer name bb1 netns {cli}"),
        format!("ip -n {srv} addr add {SRV}/22 dev bb0"),
        format!("ip -n {srv} addr add {ALT}/22 dev bb0"),
        format!("ip -n {srv} addr add {ALT2}/22 dev bb0"),
        format!("ip -n {cli} addr add {CLI}/22 dev bb1"),
        format!("ip -n {srv} link set bb0 up"),
        format!("ip -n {cli} link set bb1 up"),
        format!("ip -n {srv} link set lo up"),
        format!("ip -n {cli} link set lo up"),
    ] {
        if !sh(&cmd) {
            return Err(format!("`{cmd}` failed (root and iproute2 needed)"));
        }
    }
    let state = dir.join("state");
    let o = Command::new(bin())
        .args([
            "init",
            "--trust-domain",
            "boot.example.com",
            "--site",
            "boot",
            "--key-protection",
            "file",
            "--state-dir",
        ])
        .arg(&state)
        .output()
        .map_err(|e| e.to_string())?;
    if !o.status.success() {
        return Err(String::from_utf8_lossy(&o.stderr).into());
    }
    let boot = state.join("boot");
    std::fs::create_dir_all(&boot).map_err(|e| e.to_string())?;
    for f in ["undionly.kpxe", "vmlinuz", "initrd.img"] {
        std::fs::copy(image.join(f), boot.join(f)).map_err(|e| e.to_string())?;
    }
    let cfg = state.join("config.toml");
    let text = std::fs::read_to_string(&cfg).map_err(|e| e.to_string())?;
    let head = format!("gateway_url = \"https://{SRV}:8443\"\n");
    let i = text.find("[boot]").ok_or("no [boot] in config.toml")?;
    let end = text[i + 6..]
        .find("\n[")
        .map(|j| i + 6 + j + 1)
        .unwrap_or(text.len());
    let boot_section = format!(
        "[boot]\nenabled = true\nmode = \"dhcp\"\ninterface = \"bb0\"\nserver_ip = \"{SRV}\"\n\
         range_start = \"10.77.0.10\"\nrange_end = \"10.77.3.250\"\nnetmask = \"255.255.252.0\"\n\
         tftp_max_transfers = 4096\ntftp_max_per_source = 4096\nlisten_tftp = \"{SRV}:69\"\n"
    );
    // The simulated clients share one address (they differ by port): the per-source limit, 16
    // transfers by default, is lifted as it would not bind a real rack of machines.
    let text = format!("{head}{}{boot_section}{}", &text[..i], &text[end..]);
    std::fs::write(&cfg, text).map_err(|e| e.to_string())?;
    let mut serve = Command::new("ip");
    serve
        .args([
            "netns",
            "exec",
            &srv,
            "prlimit",
            "--nofile=20000:20000",
            "--",
            "taskset",
            "-c",
            "0",
        ])
        .arg(bin())
        .args([
            "serve",
            "--listen-http",
            &format!("{SRV}:8080"),
            "--listen-gateway",
            &format!("{SRV}:8443"),
        ])
        .env("BCA_STATE_DIR", &state)
        .env("BCA_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut child = serve.spawn().map_err(|e| e.to_string())?;
    let mut l = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut l,
    )
    .map_err(|e| e.to_string())?;
    lab.children.push(child);
    if !l.contains("\"ready\":true") {
        return Err(format!("bca serve did not start: {l:?}"));
    }
    Ok(lab)
}

fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("boot: run with `make bench`");
        return;
    }
    if std::env::var("BCA_BOOT_CLIENT").is_ok() {
        return client_main();
    }
    let m = env("BOOT_CLIENTS", 1000);
    let t = env("TFTP_CLIENTS", 200);
    println!("# bca boot storm: {m} PXE clients (DHCP, TFTP, HTTP), then {t} TFTP transfers against bca, dnsmasq and tftp-hpa; servers on core 0, clients on core 1");
    println!("{}", support::describe_bin());
    let lab = match setup() {
        Ok(l) => l,
        Err(e) => {
            println!("boot_storm: skipped ({e})");
            return;
        }
    };
    let mut lab = lab;
    let exe = std::env::current_exe().unwrap();
    let run_client = |mode: &str, server: &str, n: usize| -> String {
        let o = netns_cmd(&lab.cli, "1", &exe)
            .arg("--bench")
            .env("BCA_BOOT_CLIENT", mode)
            .env("BOOT_SERVER", server)
            .env("BOOT_N", n.to_string())
            .output()
            .unwrap();
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    print!("{}", run_client("storm", SRV, m));
    // UDP datagrams dropped for a full receive buffer, per side (the kernel's counters).
    for (side, ns) in [("server", &lab.srv), ("client", &lab.cli)] {
        let o = Command::new("ip")
            .args(["netns", "exec", ns, "cat", "/proc/net/snmp"])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&o.stdout);
        let udp: Vec<&str> = text.lines().filter(|l| l.starts_with("Udp:")).collect();
        if let [names, values] = udp[..] {
            let pairs: Vec<(&str, &str)> = names
                .split_whitespace()
                .zip(values.split_whitespace())
                .collect();
            if let Some((_, v)) = pairs.iter().find(|(n, _)| *n == "RcvbufErrors") {
                line(
                    &format!("boot_storm_udp_drops_{side}"),
                    v.parse().unwrap_or(0.0),
                    "",
                );
            }
        }
    }

    // TFTP side by side: the same file, client, options and concurrency. The other servers drop
    // privileges to nobody, so they serve a world-readable copy of the same file.
    let tftp_root = lab.dir.join("tftp");
    std::fs::create_dir_all(&tftp_root).unwrap();
    std::fs::copy(
        root().join("image/out/undionly.kpxe"),
        tftp_root.join("undionly.kpxe"),
    )
    .unwrap();
    sh(&format!(
        "chmod 0755 {} {} && chmod 0644 {}/undionly.kpxe",
        lab.dir.display(),
        tftp_root.display(),
        tftp_root.display()
    ));
    print!("{}", run_client("tftp:bca", SRV, t));
    let dnsmasq = Command::new("ip")
        .args([
            "netns",
            "exec",
            &lab.srv,
            "taskset",
            "-c",
            "0",
            "dnsmasq",
            "--keep-in-foreground",
            "--port=0",
            "--enable-tftp",
        ])
        .arg(format!("--tftp-root={}", tftp_root.display()))
        .args([
            &format!("--listen-address={ALT}"),
            "--bind-interfaces",
            "--tftp-max=4096",
            "--conf-file=/dev/null",
            "--pid-file=",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn();
    match dnsmasq {
        Ok(mut c) => {
            std::thread::sleep(Duration::from_millis(300));
            if c.try_wait().ok().flatten().is_some() {
                println!("tftp_dnsmasq: skipped (dnsmasq exited at start)");
            } else {
                lab.children.push(c);
                print!("{}", run_client("tftp:dnsmasq", ALT, t));
            }
        }
        Err(e) => println!("tftp_dnsmasq: skipped ({e})"),
    }
    match in_tftpd() {
        Some(p) => {
            let c = Command::new("ip")
                .args(["netns", "exec", &lab.srv, "taskset", "-c", "0"])
                .arg(&p)
                .env(
                    "LD_LIBRARY_PATH",
                    root().join("target/tftpd-hpa/usr/lib/x86_64-linux-gnu"),
                )
                .args(["-L", "-s", "-a", &format!("{ALT2}:69")])
                .arg(&tftp_root)
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn();
            if let Ok(mut c) = c {
                std::thread::sleep(Duration::from_millis(300));
                if c.try_wait().ok().flatten().is_some() {
                    println!("tftp_tftp_hpa: skipped (in.tftpd exited at start)");
                } else {
                    lab.children.push(c);
                    print!("{}", run_client("tftp:tftp-hpa", ALT2, t));
                }
            }
        }
        None => println!("tftp_tftp_hpa: skipped (in.tftpd not available)"),
    }
}

// ---------- the client side (inside the client namespace) ----------

type Waiters = Arc<Mutex<HashMap<u32, tokio::sync::mpsc::UnboundedSender<Message>>>>;

fn client_main() {
    let mode = std::env::var("BCA_BOOT_CLIENT").unwrap();
    let server: Ipv4Addr = std::env::var("BOOT_SERVER").unwrap().parse().unwrap();
    let n = env("BOOT_N", 1000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        if let Some(name) = mode.strip_prefix("tftp:") {
            // One machine at a time: the protocol's own speed (round trips per window).
            let t = Instant::now();
            let mut single = 0u64;
            for _ in 0..50 {
                single += tftp_get(server, "undionly.kpxe").await.unwrap_or(0);
            }
            let key = name.replace('-', "_");
            line(
                &format!("tftp_{key}_windowsize_granted"),
                GRANTED_WINDOW.load(std::sync::atomic::Ordering::Relaxed) as f64,
                "",
            );
            line(
                &format!("tftp_{key}_single"),
                single as f64 / t.elapsed().as_secs_f64() / 1e6,
                "MB/s",
            );
            let t = Instant::now();
            let mut hs = Vec::new();
            for _ in 0..n {
                hs.push(tokio::spawn(tftp_get(server, "undionly.kpxe")));
            }
            let (mut bytes, mut failed) = (0u64, 0usize);
            for h in hs {
                match h.await.unwrap() {
                    Ok(b) => bytes += b,
                    Err(_) => failed += 1,
                }
            }
            let wall = t.elapsed().as_secs_f64();
            line(
                &format!("tftp_{key}_throughput"),
                bytes as f64 / wall / 1e6,
                "MB/s",
            );
            line(&format!("tftp_{key}_failures"), failed as f64, "");
            return;
        }
        // The storm.
        let sock = Arc::new(dhcp_socket());
        let waiters: Waiters = Arc::default();
        let (s2, w2) = (sock.clone(), waiters.clone());
        tokio::spawn(async move {
            let mut buf = vec![0u8; 1500];
            while let Ok((len, _)) = s2.recv_from(&mut buf).await {
                if let Ok(m) = Message::decode(&mut Decoder::new(&buf[..len])) {
                    if let Some(tx) = w2.lock().unwrap().get(&m.xid()) {
                        let _ = tx.send(m);
                    }
                }
            }
        });
        let t = Instant::now();
        let mut hs = Vec::new();
        for i in 0..n {
            let (sock, waiters) = (sock.clone(), waiters.clone());
            hs.push(tokio::spawn(async move {
                pxe_boot(i, server, sock, waiters).await
            }));
        }
        let mut ok = 0usize;
        let mut bytes = 0u64;
        let mut errors: HashMap<String, usize> = HashMap::new();
        for h in hs {
            match h.await.unwrap() {
                Ok(b) => {
                    ok += 1;
                    bytes += b;
                }
                Err(e) => *errors.entry(e).or_default() += 1,
            }
        }
        let wall = t.elapsed().as_secs_f64();
        line("boot_storm_clients", n as f64, "");
        line("boot_storm_all_served_s", wall, "s");
        line("boot_storm_failures", (n - ok) as f64, "");
        line(
            "boot_storm_bytes_per_client",
            bytes as f64 / ok.max(1) as f64 / 1e6,
            "MB",
        );
        line("boot_storm_throughput", bytes as f64 / wall / 1e6, "MB/s");
        for (e, c) in errors {
            println!("# failure x{c}: {e}");
        }
    });
}

fn dhcp_socket() -> UdpSocket {
    let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None).unwrap();
    s.set_reuse_address(true).unwrap();
    s.set_broadcast(true).unwrap();
    s.set_nonblocking(true).unwrap();
    let _ = s.set_recv_buffer_size(8 << 20);
    // The namespace has no default route: broadcasts leave by the one link.
    s.bind_device(Some(b"bb1")).unwrap();
    s.bind(&SocketAddr::from((Ipv4Addr::UNSPECIFIED, 68)).into())
        .unwrap();
    UdpSocket::from_std(s.into()).unwrap()
}

fn mac(i: usize) -> [u8; 6] {
    [0x52, 0x54, 0x10, (i >> 16) as u8, (i >> 8) as u8, i as u8]
}

fn dhcp_msg(
    i: usize,
    xid: u32,
    kind: MessageType,
    requested: Option<(Ipv4Addr, Ipv4Addr)>,
) -> Vec<u8> {
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_xid(xid)
        .set_flags(dhcproto::v4::Flags::default().set_broadcast())
        .set_chaddr(&mac(i));
    m.opts_mut().insert(DhcpOption::MessageType(kind));
    m.opts_mut().insert(DhcpOption::ClassIdentifier(
        b"PXEClient:Arch:00000:UNDI:002001".to_vec(),
    ));
    m.opts_mut().insert(DhcpOption::ClientSystemArchitecture(
        dhcproto::v4::Architecture::from(0u16),
    ));
    if let Some((ip, server)) = requested {
        m.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
        m.opts_mut().insert(DhcpOption::ServerIdentifier(server));
    }
    let mut out = Vec::new();
    m.encode(&mut Encoder::new(&mut out)).unwrap();
    out
}

/// Sends `msg` until an answer of type `want` comes back (retries as PXE ROMs do: 4, 8, 16 s).
async fn exchange(
    sock: &UdpSocket,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Message>,
    msg: &[u8],
    want: MessageType,
) -> Result<Message, String> {
    let dest = SocketAddr::from((Ipv4Addr::BROADCAST, 67));
    for wait in [4, 8, 16] {
        sock.send_to(msg, dest).await.map_err(|e| e.to_string())?;
        let deadline = tokio::time::sleep(Duration::from_secs(wait));
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = &mut deadline => break,
                m = rx.recv() => {
                    let m = m.ok_or("the receiver ended")?;
                    if matches!(m.opts().get(OptionCode::MessageType), Some(DhcpOption::MessageType(t)) if *t == want) {
                        return Ok(m);
                    }
                }
            }
        }
    }
    Err(format!("dhcp: no {want:?}"))
}

async fn pxe_boot(
    i: usize,
    server: Ipv4Addr,
    sock: Arc<UdpSocket>,
    waiters: Waiters,
) -> Result<u64, String> {
    let xid = 0x5000_0000 | i as u32;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    waiters.lock().unwrap().insert(xid, tx);
    let offer = exchange(
        &sock,
        &mut rx,
        &dhcp_msg(i, xid, MessageType::Discover, None),
        MessageType::Offer,
    )
    .await?;
    let yiaddr = offer.yiaddr();
    let ack = exchange(
        &sock,
        &mut rx,
        &dhcp_msg(i, xid, MessageType::Request, Some((yiaddr, server))),
        MessageType::Ack,
    )
    .await?;
    waiters.lock().unwrap().remove(&xid);
    let file = ack
        .fname_str()
        .and_then(|r| r.ok())
        .map(|s| s.trim_end_matches('\0').to_string())
        .filter(|s| !s.is_empty())
        .ok_or("dhcp: no boot file in the ACK")?;
    let tftp_server = if ack.siaddr().is_unspecified() {
        server
    } else {
        ack.siaddr()
    };
    let mut bytes = tftp_get(tftp_server, &file).await?;
    // What iPXE does next: the chained script, then the per-machine script and its files.
    let m = mac(i)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":");
    let (_, script) = http_get(
        server,
        &format!("/api/compute/boot/boot.ipxe?mac={m}"),
        true,
    )
    .await?;
    let script = String::from_utf8(script).map_err(|_| "script: not UTF-8")?;
    let mut fetched = 0;
    for l in script.lines() {
        let url = l
            .strip_prefix("kernel ")
            .or_else(|| l.strip_prefix("initrd --name initrd.img "))
            .and_then(|r| r.split_whitespace().next());
        if let Some(url) = url {
            let path = url
                .split_once("8080")
                .map(|(_, p)| p)
                .ok_or("script: a URL without the port")?;
            let (n, _) = http_get(server, path, false).await?;
            bytes += n;
            fetched += 1;
        }
    }
    if fetched != 2 {
        return Err(format!(
            "script: {fetched} files instead of kernel and initrd"
        ));
    }
    Ok(bytes)
}

/// GET over HTTP/1.1; the body's length (and the body when `keep`). Fails on a non-200 answer or
/// a body shorter than its Content-Length.
async fn http_get(server: Ipv4Addr, path: &str, keep: bool) -> Result<(u64, Vec<u8>), String> {
    let mut s = TcpStream::connect((server, 8080))
        .await
        .map_err(|e| format!("http connect: {e}"))?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {server}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut head = Vec::new();
    let (status, length, mut got, mut body) = loop {
        let n = s.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("http: closed before the headers".into());
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(p) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            let text = String::from_utf8_lossy(&head[..p]).to_lowercase();
            let status = text.split_whitespace().nth(1).unwrap_or("").to_string();
            let length: Option<u64> = text
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok());
            let rest = head[p + 4..].to_vec();
            break (
                status,
                length,
                rest.len() as u64,
                if keep { rest } else { Vec::new() },
            );
        }
    };
    loop {
        let n = s.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        got += n as u64;
        if keep {
            body.extend_from_slice(&buf[..n]);
        }
    }
    if status != "200" {
        return Err(format!("http {path}: status {status}"));
    }
    if length.is_some_and(|l| l != got) {
        return Err(format!("http {path}: {got} of {length:?} bytes"));
    }
    Ok((got, body))
}

/// A TFTP read with blksize, tsize and windowsize asked for; servers that ignore windowsize run
/// lock-step. The number of file bytes received.
async fn tftp_get(server: Ipv4Addr, file: &str) -> Result<u64, String> {
    let sock = UdpSocket::bind((CLI.parse::<Ipv4Addr>().unwrap(), 0))
        .await
        .map_err(|e| e.to_string())?;
    let mut rrq = vec![0u8, 1];
    for part in [
        file,
        "octet",
        "blksize",
        &BLKSIZE.to_string(),
        "tsize",
        "0",
        "windowsize",
        &WINDOW.to_string(),
    ] {
        rrq.extend_from_slice(part.as_bytes());
        rrq.push(0);
    }
    let dest = SocketAddr::from((server, 69));
    let mut buf = vec![0u8; 65_536];
    let (mut bs, mut win) = (512usize, 1u16);
    let mut peer: Option<SocketAddr> = None;
    let mut expected: u16 = 1; // next block wanted (wrapping)
    let mut total = 0u64;
    let mut since_ack = 0u16;
    let mut retries = 0;
    sock.send_to(&rrq, dest).await.map_err(|e| e.to_string())?;
    let mut last_sent: Vec<u8> = rrq.clone();
    let mut last_dest = dest;
    loop {
        let r = tokio::time::timeout(Duration::from_secs(2), sock.recv_from(&mut buf)).await;
        let (n, from) = match r {
            Ok(Ok(x)) => x,
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => {
                retries += 1;
                if retries > 6 {
                    return Err("tftp: timed out".into());
                }
                sock.send_to(&last_sent, last_dest)
                    .await
                    .map_err(|e| e.to_string())?;
                continue;
            }
        };
        if peer.is_some_and(|p| p != from) {
            continue;
        }
        peer = Some(from);
        let p = &buf[..n];
        match u16::from_be_bytes([p[0], p[1]]) {
            6 => {
                // OACK: what the server granted.
                let fields: Vec<&[u8]> = p[2..].split(|b| *b == 0).collect();
                for kv in fields.chunks(2) {
                    if kv.len() < 2 {
                        continue;
                    }
                    let v: usize = std::str::from_utf8(kv[1])
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or(0);
                    match std::str::from_utf8(kv[0])
                        .unwrap_or("")
                        .to_ascii_lowercase()
                        .as_str()
                    {
                        "blksize" => bs = v,
                        "windowsize" => {
                            win = v as u16;
                            GRANTED_WINDOW.store(v, std::sync::atomic::Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }
                last_sent = vec![0, 4, 0, 0];
                last_dest = from;
                sock.send_to(&last_sent, from)
                    .await
                    .map_err(|e| e.to_string())?;
            }
            3 => {
                let block = u16::from_be_bytes([p[2], p[3]]);
                if block == expected {
                    retries = 0;
                    total += (n - 4) as u64;
                    since_ack += 1;
                    let last = n - 4 < bs;
                    if since_ack >= win || last {
                        last_sent = vec![0, 4, p[2], p[3]];
                        last_dest = from;
                        sock.send_to(&last_sent, from)
                            .await
                            .map_err(|e| e.to_string())?;
                        since_ack = 0;
                    }
                    expected = expected.wrapping_add(1);
                    if last {
                        return Ok(total);
                    }
                } else {
                    // Out of order: acknowledge what we have; the server resends from there.
                    let have = expected.wrapping_sub(1).to_be_bytes();
                    last_sent = vec![0, 4, have[0], have[1]];
                    last_dest = from;
                    sock.send_to(&last_sent, from)
                        .await
                        .map_err(|e| e.to_string())?;
                    since_ack = 0;
                }
            }
            5 => return Err(format!("tftp error: {}", String::from_utf8_lossy(&p[4..]))),
            _ => {}
        }
    }
}
