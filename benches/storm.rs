//! `make bench`: join and renewal storms, sessions and cold start against the real binary over real
//! sockets, each printed beside a reference measured in the same run. `bca serve` is pinned to
//! core 0 and this load generator to core 1 (`taskset`), so figures are per appliance core.
//!
//! Output: one line per figure, `name: value unit`. Sizes: `BENCH_JOINS` (default 20000),
//! `BENCH_CONCURRENCY` (200), `BENCH_SESSIONS` (20000). After the join storm, every session
//! opens (resident memory per session), renews at once (the renewal storm), and the appliance is
//! restarted under them twice (the reconnect storm: time until all are back, attempts spent):
//! first every session comes back with a full handshake (`reconnect_*`, right after the
//! renewals, which no ticket covers), then each resumes with the ticket its last connection got
//! (`reconnect_resumed_*`, as `bca agent run` does). Each simulated machine connects from a
//! loopback address of its own, as machines on a network do: from one address the kernel's
//! search for a free ephemeral port took half of the load core at 19,800 connections.
//!
//! The references: `join_ceiling` and `renewal_ceiling`, the appliance's own cryptography of one
//! join and of one renewal in a tight loop, measured on core 0 (the appliance's core) at the
//! start, and again just before (`*_before_storm`) and just after (`*_after_storm`) the storm
//! they are the reference of; each `*_ceiling_fraction` is against the mean of the two around its
//! storm. The loop runs in this bench's own build of bca's code (the host's, glibc), whatever
//! binary is under test: the same aws-lc, whose cost per join the static binary matched within
//! 10% in profiles (docs/benchmarks-history.md, 2026-12-06). The ceilings after a storm share core 0 with the
//! appliance, idle by then (its sessions send nothing). `*_core_steal` is the part of core 0's
//! time the hypervisor gave to something else. `*_context_switches` counts the appliance's
//! threads' switches per join or renewal (both processes): a figure that, unlike the rates,
//! barely moves from one run to the next.

#[path = "storm/floor.rs"]
mod floor;
mod support;
use bca::agent::{self};
use bca::base::crypto::{self, SigningKey};
use bca::proto::agent_config::AgentConfig;
use bca::proto::protocol::{self, Hello, JoinRequest, RenewRequest, Reply, Request};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{bin, env, line};

fn pct(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

struct Appliance {
    dir: PathBuf,
    child: Child,
    http: String,
    gateway: String,
    socket: PathBuf,
}

impl Drop for Appliance {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `prlimit` (the open-file limit raised to the hard limit: room for the sessions) and `taskset`
/// on `core`, when present.
fn taskset(core: &str) -> Command {
    let mut c = Command::new("prlimit");
    let n = nofile_hard();
    c.arg(format!("--nofile={n}:{n}")).arg("--");
    if Command::new("taskset").arg("--version").output().is_ok() {
        c.args(["taskset", "-c", core]);
    }
    c
}

/// This process's hard limit on open files (/proc/self/limits).
fn nofile_hard() -> u64 {
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(4).map(str::to_string))
        })
        .and_then(|v| v.parse().ok())
        .unwrap_or(1024)
}

fn start_serve(state: &Path) -> (Child, Value, Duration) {
    start_serve_at(state, "127.0.0.1:0", "127.0.0.1:0")
}

fn start_serve_at(state: &Path, http: &str, gateway: &str) -> (Child, Value, Duration) {
    let t = Instant::now();
    let mut child = taskset("0")
        .arg(bin())
        .args(["serve", "--listen-http", http, "--listen-gateway", gateway])
        .env("BCA_STATE_DIR", state)
        .env("BCA_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut l = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut l)
        .unwrap();
    let took = t.elapsed();
    (
        child,
        serde_json::from_str(&l).expect("serve started"),
        took,
    )
}

/// A fresh appliance; `privsep: false` serves the gateway in the one process, to measure what the
/// boundary costs.
fn appliance(name: &str, privsep: bool) -> Appliance {
    appliance_with(name, privsep, &[])
}

/// [`appliance`], with more `bca init` arguments (`--store postgres://…`).
fn appliance_with(name: &str, privsep: bool, init: &[&str]) -> Appliance {
    let dir = std::env::temp_dir().join(format!("bca-bench-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let state = dir.join("state");
    let o = Command::new(bin())
        .args([
            "init",
            "--trust-domain",
            "bench.example.com",
            "--site",
            "bench",
            "--key-protection",
            "file",
            "--state-dir",
        ])
        .arg(&state)
        .args(init)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Every simulated machine comes from 127.0.0.1: the per-source limits, meant for a rack
    // where each machine has its own address, would refuse most of the storm.
    let cfg = state.join("config.toml");
    let mut doc: toml::Table = toml::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    let sessions = doc["sessions"].as_table_mut().unwrap();
    sessions.insert("joins_per_source_per_minute".into(), 0.into());
    sessions.insert("max_connections_per_source".into(), 1_000_000.into());
    doc["privsep"]
        .as_table_mut()
        .unwrap()
        .insert("enabled".into(), privsep.into());
    std::fs::write(&cfg, toml::to_string(&doc).unwrap()).unwrap();
    let (child, ready, _) = start_serve(&state);
    Appliance {
        dir,
        child,
        http: ready["http"].as_str().unwrap().into(),
        gateway: ready["gateway"].as_str().unwrap().into(),
        socket: PathBuf::from(ready["admin"].as_str().unwrap()),
    }
}

fn api(a: &Appliance, m: &str, body: Value) -> Value {
    bca::cli::client::Client::new(&a.socket)
        .call(m, &body)
        .unwrap()
}

/// The process and its live children (`serve`'s network child).
fn tree(pid: u32) -> Vec<u32> {
    let mut v = vec![pid];
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for t in tasks.flatten() {
            if let Ok(c) = std::fs::read_to_string(t.path().join("children")) {
                v.extend(c.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
            }
        }
    }
    v
}

/// CPU seconds (user + system) a process and its children have used.
fn cpu_seconds(pid: u32) -> f64 {
    tree(pid).into_iter().map(cpu_seconds_of).sum()
}

fn cpu_seconds_of(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 of stat (utime, stime), in clock ticks of 1/100 s.
    (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0
}

/// Context switches (voluntary and not) of the live threads of a process and its children: on
/// the appliance's one core, each is a hand-off between its threads or its two processes.
fn context_switches(pid: u32) -> u64 {
    tree(pid)
        .into_iter()
        .filter_map(|p| std::fs::read_dir(format!("/proc/{p}/task")).ok())
        .flat_map(|tasks| tasks.flatten())
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter_map(|l| {
                    l.strip_prefix("voluntary_ctxt_switches:")
                        .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                })
                .collect::<Vec<_>>()
        })
        .sum()
}

/// Resident memory of a process and its children.
fn rss_kib(pid: u32) -> u64 {
    tree(pid)
        .into_iter()
        .filter_map(|p| {
            std::fs::read_to_string(format!("/proc/{p}/status"))
                .ok()?
                .lines()
                .find_map(|l| {
                    l.strip_prefix("VmRSS:").map(|v| {
                        v.trim()
                            .trim_end_matches(" kB")
                            .trim()
                            .parse::<u64>()
                            .unwrap()
                    })
                })
        })
        .sum()
}

/// One machine, prepared as a real one would be before the clock starts.
struct Machine {
    key: SigningKey,
    csr: Vec<u8>,
    request: Vec<u8>,
}

fn machine(i: usize, token: &str, enc: &[u8]) -> Machine {
    let key = SigningKey::generate();
    let csr = bca::proto::csr::create(&key);
    let sealed = bca::proto::jwe::seal(token, enc, &csr, bca::base::clock::now()).unwrap();
    let claims = bca::cli::devsim::sim_claims(i);
    let req = Request {
        v: 1,
        join: Some(JoinRequest {
            sealed_token: sealed,
            csr: crypto::b64(&csr),
            claims,
            attestor: String::new(),
            role: "node".into(),
            tpm: None,
            x509pop: None,
            node_id: None,
        }),
        ..Default::default()
    };
    Machine {
        key,
        csr,
        request: serde_json::to_vec(&req).unwrap(),
    }
}

/// An appliance's keys and configuration for the ceilings' tight loops.
fn ceiling_setup() -> (bca::pki::bundle::KeyBundle, bca::config::Config) {
    let keys = bca::pki::bundle::KeyBundle::generate();
    let cfg: bca::config::Config = toml::from_str(
        "trust_domain = \"b.example\"\nsite_id = \"site_x\"\nsite_name = \"x\"\nkey_protection = \"file\"\n",
    )
    .unwrap();
    (keys, cfg)
}

/// Signs a node certificate for `public_point` and the response over it, as the JoinService
/// does for a join and for a renewal.
fn ceiling_issue(
    keys: &bca::pki::bundle::KeyBundle,
    node_ca: &(rcgen::Certificate, rcgen::KeyPair),
    public_point: &[u8],
) -> Vec<u8> {
    let (der, _) = bca::pki::issue_node_cert(
        &bca::pki::NodeCertSpec {
            spiffe_id: "spiffe://b.example/site/site_x/node/node_x",
            statements: &[],
            role: "node",
            not_before: 0,
            not_after: 86_400,
            public_point,
        },
        node_ca,
    )
    .unwrap();
    keys.join_signing
        .sign(protocol::JOIN_RESPONSE_PURPOSE, &der)
}

/// The appliance's own cryptography of one renewal, in a tight loop on this core: verifying the
/// new CSR and the proof signed by the current key, signing the certificate and the response.
fn renewal_ceiling(n: usize) -> f64 {
    let (keys, cfg) = ceiling_setup();
    let node_ca = bca::pki::issuer(bca::pki::CaKind::Node, &cfg, &keys.node_ca);
    // (CSR, the proof's message, its signature, the current key's public point)
    type Renewal = (Vec<u8>, Vec<u8>, Vec<u8>, Vec<u8>);
    let inputs: Vec<Renewal> = (0..n)
        .map(|_| {
            let (old, new) = (SigningKey::generate(), SigningKey::generate());
            let csr = bca::proto::csr::create(&new);
            let msg = protocol::renew_pop_message(&crypto::sha256(&csr), "node_x", 0);
            let sig = old.sign(protocol::RENEW_POP_PURPOSE, &msg);
            (csr, msg, sig, old.public_point().to_vec())
        })
        .collect();
    let t = Instant::now();
    for (csr, msg, sig, old) in &inputs {
        let v = bca::proto::csr::verify(csr).unwrap();
        assert!(crypto::verify(old, protocol::RENEW_POP_PURPOSE, msg, sig));
        let _ = ceiling_issue(&keys, &node_ca, &v.public_point);
    }
    let per = t.elapsed().as_secs_f64() / n as f64;
    line("renewal_ceiling_us", per * 1e6, "us");
    1.0 / per
}

/// The appliance's own cryptography of one join, in a tight loop on this core: the TLS handshake's
/// server side, opening the seal, verifying the CSR, signing the certificate and the response.
fn ceiling(n: usize) -> f64 {
    let (keys, cfg) = ceiling_setup();
    let issued =
        bca::pki::create(&cfg, &keys, &["localhost".into()], bca::base::clock::now()).unwrap();
    let server_cfg = Arc::new(
        bca::edge::gateway::server_config(
            &issued.gateway,
            &issued.serving_ca,
            keys.gateway.pkcs8(),
            &issued.node_ca,
            Arc::new(bca::edge::tickets::Tickets::from_root(
                bca::edge::tickets::TicketRoot::derive(keys.node_ca.pkcs8()),
            )),
        )
        .unwrap(),
    );
    let pin = crypto::spki_pin(&keys.serving_ca.spki_der());
    let client_cfg = Arc::new(bca::agent::tlsclient::client_config(&pin).unwrap());
    let dec = bca::proto::jwe::decryption_key(keys.join_encryption.pkcs8()).unwrap();
    let node_ca = bca::pki::issuer(bca::pki::CaKind::Node, &cfg, &keys.node_ca);
    let inputs: Vec<(Vec<u8>, String)> = (0..n)
        .map(|_| {
            let k = SigningKey::generate();
            let csr = bca::proto::csr::create(&k);
            let s = bca::proto::jwe::seal(
                "bcjt_jt_0123456789abcdefghjkmnpqrs.x",
                keys.join_encryption.public_point(),
                &csr,
                bca::base::clock::now(),
            )
            .unwrap();
            (csr, s)
        })
        .collect();
    let mut server_time = Duration::ZERO;
    let mut rest = Duration::ZERO;
    for (csr, sealed) in &inputs {
        // The handshake, in memory: only the server's calls are timed.
        let mut client =
            rustls::ClientConnection::new(client_cfg.clone(), "localhost".try_into().unwrap())
                .unwrap();
        let mut server = rustls::ServerConnection::new(server_cfg.clone()).unwrap();
        let mut buf = Vec::new();
        while client.is_handshaking() || server.is_handshaking() {
            buf.clear();
            while client.wants_write() {
                client.write_tls(&mut buf).unwrap();
            }
            let t = Instant::now();
            let mut rd = &buf[..];
            while !rd.is_empty() {
                server.read_tls(&mut rd).unwrap();
                server.process_new_packets().unwrap();
            }
            let mut out = Vec::new();
            while server.wants_write() {
                server.write_tls(&mut out).unwrap();
            }
            server_time += t.elapsed();
            let mut rd = &out[..];
            while !rd.is_empty() {
                client.read_tls(&mut rd).unwrap();
                client.process_new_packets().unwrap();
            }
            if out.is_empty() && !client.wants_write() {
                break;
            }
        }
        let t = Instant::now();
        let v = bca::proto::csr::verify(csr).unwrap();
        let _ =
            bca::proto::jwe::open(sealed, &dec, &v.sha256, bca::base::clock::now(), 300).unwrap();
        let _ = ceiling_issue(&keys, &node_ca, &v.public_point);
        rest += t.elapsed();
    }
    let per = (server_time + rest).as_secs_f64() / n as f64;
    line(
        "join_ceiling_tls_server_us",
        server_time.as_secs_f64() / n as f64 * 1e6,
        "us",
    );
    line(
        "join_ceiling_rest_us",
        rest.as_secs_f64() / n as f64 * 1e6,
        "us",
    );
    1.0 / per
}

/// The ceilings measured on core 0, the appliance's own core: this bench again, pinned there, in
/// its ceiling-only mode (`BCA_BENCH_CEILING` = `join`, `renewal` or `both`). The load generator
/// runs on core 1, and on a shared virtual machine the two cores need not be equally fast, nor one
/// core equally fast from one minute to the next: a storm is compared with the ceiling measured
/// just before it and just after it, on its core. The lines are printed with `suffix` after
/// their names; a ceiling not asked for is 0.
fn appliance_core_ceilings(which: &str, suffix: &str) -> (f64, f64) {
    let out = taskset("0")
        .arg(std::env::current_exe().unwrap())
        .arg("--bench")
        .env("BCA_BENCH_PINNED", "1")
        .env("BCA_BENCH_CEILING", which)
        .output()
        .unwrap();
    assert!(out.status.success(), "the ceiling run failed");
    let (mut join, mut renewal) = (0.0, 0.0);
    for l in String::from_utf8(out.stdout).unwrap().lines() {
        let Some((name, rest)) = l.split_once(": ") else {
            continue;
        };
        let value: f64 = rest.split_whitespace().next().unwrap().parse().unwrap();
        match name {
            "join_ceiling" => join = value,
            "renewal_ceiling" => renewal = value,
            _ => {}
        }
        println!("{name}{suffix}: {rest}");
    }
    (join, renewal)
}

/// The agent's reconnect backoff (`bca agent run`'s defaults): full jitter, 1 s base, 60 s cap.
const BACKOFF_BASE_MS: u64 = 1000;
const BACKOFF_CAP_MS: u64 = 60_000;

/// A live session and the identity it renewed into.
struct Live {
    stream: agent::GatewayStream,
    /// The TLS configuration of that identity, made at its first reconnect (as `bca agent run`
    /// makes one after a renewal) and kept: it holds the ticket the next reconnect resumes with.
    tls: Option<Arc<rustls::ClientConfig>>,
    /// The machine's address.
    src: std::net::IpAddr,
    chain: Vec<Vec<u8>>,
    key: Vec<u8>,
}

/// A node's TLS configuration: its chain and key, the pinned serving CA, a ticket cache.
fn identity_tls(cfg: &AgentConfig, chain: Vec<Vec<u8>>, key: &[u8]) -> Arc<rustls::ClientConfig> {
    Arc::new(
        bca::agent::tlsclient::client_config_with(&cfg.serving_ca_spki_pin, Some((chain, key)))
            .unwrap(),
    )
}

/// Restarts the appliance under `lives`; every session reconnects with the agent's backoff under
/// its identity's TLS configuration (resuming when it holds a ticket). Prints the `name_*` lines
/// and returns the sessions that came back.
fn reconnect_storm(
    rt: &tokio::runtime::Runtime,
    a: &mut Appliance,
    cfg: &AgentConfig,
    lives: Vec<Live>,
    name: &str,
) -> Vec<Live> {
    let n_live = lives.len();
    let back = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let attempts = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let given_up = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let failures = Arc::new(std::sync::Mutex::new(std::collections::BTreeMap::<
        &'static str,
        usize,
    >::new()));
    let resumed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let keepers: Vec<_> = lives
        .into_iter()
        .map(|l| {
            let (cfg, back, attempts, given_up, failures, resumed) = (
                cfg.clone(),
                back.clone(),
                attempts.clone(),
                given_up.clone(),
                failures.clone(),
                resumed.clone(),
            );
            rt.spawn(async move {
                let Live {
                    mut stream,
                    tls,
                    src,
                    chain,
                    key,
                } = l;
                let mut probe = [0u8; 1];
                let _ = tokio::io::AsyncReadExt::read(&mut stream, &mut probe).await;
                drop(stream);
                let tls = tls.unwrap_or_else(|| identity_tls(&cfg, chain.clone(), &key));
                let t = Instant::now();
                for attempt in 0u32.. {
                    tokio::time::sleep(bca::agent::run::backoff(
                        attempt,
                        Duration::from_millis(BACKOFF_BASE_MS),
                        Duration::from_millis(BACKOFF_CAP_MS),
                    ))
                    .await;
                    attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    match open_session(&cfg, tls.clone(), src).await {
                        Ok(s) => {
                            if s.get_ref().1.handshake_kind()
                                == Some(rustls::HandshakeKind::Resumed)
                            {
                                resumed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            }
                            back.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            return Some(Live {
                                stream: s,
                                tls: Some(tls),
                                src,
                                chain,
                                key,
                            });
                        }
                        Err(e) => {
                            // Why attempts fail: the backoff's cost is in them.
                            let why = if e.contains("refused") {
                                "refused"
                            } else if e.contains("timed out") {
                                "timed_out"
                            } else if e.contains("TLS") {
                                "tls"
                            } else {
                                "other"
                            };
                            let mut f = failures.lock().unwrap();
                            let n = f.entry(why).or_insert(0);
                            *n += 1;
                            if *n <= 2 {
                                eprintln!("# a reconnect attempt failed ({why}): {e}");
                            }
                        }
                    }
                    if t.elapsed() > Duration::from_secs(120) {
                        given_up.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        return None;
                    }
                }
                None
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let (http_addr, gw_addr) = (a.http.clone(), a.gateway.clone());
    let load0 = cpu_seconds_of(std::process::id());
    let steal0 = core_ticks(0);
    let kill_at = Instant::now();
    let _ = Command::new("kill")
        .args(["-TERM", &a.child.id().to_string()])
        .status();
    let _ = a.child.wait();
    let (c, _, _) = start_serve_at(&a.dir.join("state"), &http_addr, &gw_addr);
    let ready_after = kill_at.elapsed();
    a.child = c;
    let deadline = Instant::now() + Duration::from_secs(150);
    while back.load(std::sync::atomic::Ordering::Relaxed)
        + given_up.load(std::sync::atomic::Ordering::Relaxed)
        < n_live
        && Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    let all_back = kill_at.elapsed();
    let load_busy = (cpu_seconds_of(std::process::id()) - load0) / all_back.as_secs_f64();
    // The restarted appliance's CPU over the time from its readiness to the last session back.
    let reconnect_busy = cpu_seconds(a.child.id()) / (all_back - ready_after).as_secs_f64();
    let reconnected = back.load(std::sync::atomic::Ordering::Relaxed);
    line(&format!("{name}_sessions"), n_live as f64, "");
    line(&format!("{name}_restart_s"), ready_after.as_secs_f64(), "s");
    line(&format!("{name}_all_back_s"), all_back.as_secs_f64(), "s");
    line(&format!("{name}_appliance_core_busy"), reconnect_busy, "");
    line(&format!("{name}_load_core_busy"), load_busy, "");
    line(
        &format!("{name}_core_steal"),
        core_ticks(0).since(&steal0).steal,
        "",
    );
    line(
        &format!("{name}_attempts_per_session"),
        attempts.load(std::sync::atomic::Ordering::Relaxed) as f64 / n_live.max(1) as f64,
        "",
    );
    line(
        &format!("{name}_given_up"),
        (n_live - reconnected) as f64,
        "",
    );
    line(
        &format!("{name}_handshakes_resumed"),
        resumed.load(std::sync::atomic::Ordering::Relaxed) as f64,
        "",
    );
    for why in ["refused", "timed_out", "tls", "other"] {
        let n = failures.lock().unwrap().get(why).copied().unwrap_or(0);
        line(&format!("{name}_failed_{why}"), n as f64, "attempts");
    }
    rt.block_on(async {
        let mut live = Vec::new();
        for k in keepers {
            if let Ok(Some(l)) = k.await {
                live.push(l);
            }
        }
        live
    })
}

fn chain_der(pems: &[String]) -> Vec<Vec<u8>> {
    pems.iter()
        .map(|p| bca::proto::x509::pem_decode_all(p, "CERTIFICATE").remove(0))
        .collect()
}

/// Machine `i`'s own address on loopback. A site's machines have an address each; from one
/// address, every connect to the gateway's port searched the ports in use (the kernel's
/// `__inet_check_established` and `__inet_hash_connect`: 46% of the load generator's core while
/// 19,800 sessions reconnected).
fn machine_addr(i: usize) -> std::net::IpAddr {
    std::net::Ipv4Addr::new(127, 1 + (i >> 16) as u8, (i >> 8) as u8, i as u8).into()
}

/// A TCP connection from machine address `src` to `dst`, as an agent makes one: 10 s for the
/// connect, Nagle off.
async fn tcp_from(
    src: std::net::IpAddr,
    dst: std::net::SocketAddr,
) -> Result<tokio::net::TcpStream, String> {
    let socket = tokio::net::TcpSocket::new_v4().map_err(|e| e.to_string())?;
    socket
        .bind(std::net::SocketAddr::new(src, 0))
        .map_err(|e| format!("bind {src}: {e}"))?;
    let stream = tokio::time::timeout(Duration::from_secs(10), socket.connect(dst))
        .await
        .map_err(|_| "cannot reach the gateway: timed out".to_string())?
        .map_err(|e| format!("cannot reach the gateway: {e}"))?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// What `agent::connect_with` does (10 s for the TCP connect, then TLS), from `src`.
async fn connect_from(
    cfg: &AgentConfig,
    tls: Arc<rustls::ClientConfig>,
    src: std::net::IpAddr,
) -> Result<agent::GatewayStream, String> {
    let (host, port) = bca::base::net::host_port(&cfg.gateway_url).ok_or("gateway_url")?;
    let dst = std::net::SocketAddr::new(host.parse().map_err(|_| "not an address")?, port);
    let stream = tcp_from(src, dst).await?;
    let name = rustls::pki_types::ServerName::try_from(cfg.server_name.clone().unwrap_or(host))
        .map_err(|e| e.to_string())?;
    tokio_rustls::TlsConnector::from(tls)
        .connect(name, stream)
        .await
        .map_err(|e| format!("TLS: {e}"))
}

/// An mTLS session from machine address `src`: connect with the node's identity, Hello, Welcome.
async fn open_session(
    cfg: &AgentConfig,
    tls: Arc<rustls::ClientConfig>,
    src: std::net::IpAddr,
) -> Result<agent::GatewayStream, String> {
    let mut s = connect_from(cfg, tls, src).await?;
    let hello = Request {
        v: 1,
        hello: Some(Hello::default()),
        ..Default::default()
    };
    let raw = agent::roundtrip(cfg, &mut s, &serde_json::to_vec(&hello).unwrap())
        .await
        .map_err(|e| e.message)?;
    serde_json::from_slice::<Reply>(&raw)
        .ok()
        .and_then(|r| r.welcome)
        .ok_or("no welcome")?;
    Ok(s)
}

async fn one_join(
    cfg: Arc<AgentConfig>,
    m: Arc<Machine>,
) -> (Duration, Option<protocol::JoinResponse>) {
    let t = Instant::now();
    let mut s = agent::connect(&cfg, None).await.unwrap();
    let raw = agent::roundtrip(&cfg, &mut s, &m.request).await.unwrap();
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    (t.elapsed(), reply.join_response)
}

/// A core's ticks from `/proc/stat` at one instant.
#[derive(Clone, Copy)]
struct CoreTicks {
    /// user, nice, system, irq, softirq, steal (guest time is inside user).
    busy: u64,
    iowait: u64,
    all: u64,
    /// The time the hypervisor ran something else while this virtual core wanted to run.
    steal: u64,
}

/// What a core did between two instants, as fractions of its time.
struct CoreShares {
    busy: f64,
    iowait: f64,
    steal: f64,
}

impl CoreTicks {
    fn since(&self, before: &CoreTicks) -> CoreShares {
        let all = (self.all - before.all).max(1) as f64;
        CoreShares {
            busy: (self.busy - before.busy) as f64 / all,
            iowait: (self.iowait - before.iowait) as f64 / all,
            steal: (self.steal - before.steal) as f64 / all,
        }
    }
}

fn core_ticks(core: usize) -> CoreTicks {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let f: Vec<u64> = stat
        .lines()
        .find_map(|l| l.strip_prefix(&format!("cpu{core} ")))
        .unwrap()
        .split_whitespace()
        .map(|v| v.parse().unwrap())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is inside user).
    let busy = f[0] + f[1] + f[2] + f[5] + f[6] + f[7];
    CoreTicks {
        busy,
        iowait: f[4],
        all: busy + f[3] + f[4],
        steal: f[7],
    }
}

/// The join writer's `bca_commit_seconds_count` and `_sum` from `/metrics` (served to loopback).
fn commit_metrics(http: &str) -> (f64, f64) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(http).unwrap();
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: bca\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut page = String::new();
    s.read_to_string(&mut page).unwrap();
    let value = |name: &str| {
        page.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("no {name} in /metrics"))
    };
    (
        value("bca_commit_seconds_count "),
        value("bca_commit_seconds_sum "),
    )
}

/// Exec to the readiness line with file keys, the median of five starts (each stopped with
/// SIGTERM, as an operator's restart does); leaves the appliance serving on its addresses.
fn cold_start(a: &mut Appliance) -> f64 {
    let state = a.dir.join("state");
    let (http, gateway) = (a.http.clone(), a.gateway.clone());
    let mut starts = Vec::new();
    for i in 0..6 {
        let _ = Command::new("kill")
            .args(["-TERM", &a.child.id().to_string()])
            .status();
        let _ = a.child.wait();
        let (c, _, took) = start_serve_at(&state, &http, &gateway);
        a.child = c;
        // The first start after the storms also closes every session the last run left open.
        if i > 0 {
            starts.push(took);
        }
    }
    starts.sort();
    starts[2].as_secs_f64() * 1000.0
}

/// Joins per second through a fresh appliance, `n` joins at `conc` at once.
fn quick_storm(name: &str, privsep: bool, n: usize, conc: usize) -> f64 {
    let mut a = appliance(name, privsep);
    let (cfg, machines) = prepare_machines(&a, n);
    let rt = load_runtime();
    let t = Instant::now();
    let ok = join_storm(&rt, &cfg, &machines, conc)
        .iter()
        .filter(|r| r.1.is_some())
        .count();
    let rate = ok as f64 / t.elapsed().as_secs_f64();
    let _ = a.child.kill();
    let _ = a.child.wait();
    let _ = std::fs::remove_dir_all(&a.dir);
    rate
}

/// The same join storm, then a renewal storm of every admitted machine, through one appliance on
/// SQLite (the reference), one on PostgreSQL and two on one PostgreSQL (the second joined with
/// `join-site` and approved; machines alternate between them), in the same run: joins and
/// renewals per second, the appliances' CPU per join, and the PostgreSQL server's own CPU per join
/// and per renewal. On this 2-core machine the appliances share core 0 and PostgreSQL floats:
/// the two-appliance figure measures what sharing the database costs, not what a second box adds.
fn engines(n: usize, conc: usize) {
    let cluster = bca::store::pg_cluster::Cluster::start().expect("PostgreSQL");
    let postmaster: u32 = std::fs::read_to_string(cluster.dir.join("data/postmaster.pid"))
        .unwrap()
        .lines()
        .next()
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut joins = Vec::new();
    for name in ["sqlite", "postgres", "two_postgres"] {
        let url = cluster.new_database();
        let init: Vec<&str> = match name {
            "sqlite" => vec![],
            _ => vec!["--store", url.as_str()],
        };
        let a = appliance_with(&format!("engine-{name}"), true, &init);
        let b = (name == "two_postgres").then(|| second_appliance(&a, &url));
        let (cfg_a, machines) = prepare_machines(&a, n);
        let cfgs: Vec<Arc<AgentConfig>> = match &b {
            Some(b) => vec![cfg_a.clone(), agent_config_for(b)],
            None => vec![cfg_a.clone()],
        };
        let pids: Vec<u32> = std::iter::once(a.child.id())
            .chain(b.as_ref().map(|b| b.child.id()))
            .collect();
        let cpu = || pids.iter().map(|p| cpu_seconds(*p)).sum::<f64>();
        let rt = load_runtime();
        let (cpu0, pg0) = (cpu(), cpu_seconds(postmaster));
        let t = Instant::now();
        let answers = spread_storm(&rt, &cfgs, &machines, conc);
        let wall = t.elapsed().as_secs_f64();
        let (cpu1, pg1) = (cpu(), cpu_seconds(postmaster));
        let admitted: Vec<(Arc<Machine>, protocol::JoinResponseBody)> = machines
            .iter()
            .zip(answers)
            .filter_map(|(m, r)| {
                let body =
                    agent::verify_response(&cfg_a, r.as_ref()?, &m.csr, &m.key, "node").ok()?;
                Some((m.clone(), body))
            })
            .collect();
        let ok = admitted.len();
        let rate = ok as f64 / wall;
        line(&format!("engine_{name}_joins"), rate, "joins/s");
        line(
            &format!("engine_{name}_appliance_cpu_per_join"),
            (cpu1 - cpu0) * 1000.0 / ok.max(1) as f64,
            "ms",
        );
        if name != "sqlite" {
            line(
                &format!("engine_{name}_server_cpu_per_join"),
                (pg1 - pg0) * 1000.0 / ok.max(1) as f64,
                "ms",
            );
        }
        line(&format!("engine_{name}_failures"), (n - ok) as f64, "");
        // Every admitted machine renews once, each on a new mTLS connection.
        let (pg2, t) = (cpu_seconds(postmaster), Instant::now());
        let renewed = renew_storm(&rt, &cfgs, &admitted, conc);
        let wall = t.elapsed().as_secs_f64();
        line(
            &format!("engine_{name}_renewals"),
            renewed as f64 / wall,
            "renewals/s",
        );
        if name != "sqlite" {
            line(
                &format!("engine_{name}_server_cpu_per_renewal"),
                (cpu_seconds(postmaster) - pg2) * 1000.0 / renewed.max(1) as f64,
                "ms",
            );
        }
        line(
            &format!("engine_{name}_renewal_failures"),
            (ok - renewed) as f64,
            "",
        );
        joins.push(rate);
        drop(b);
        drop(a);
    }
    line("engine_postgres_to_sqlite", joins[1] / joins[0], "");
    line("engine_two_postgres_to_one", joins[2] / joins[1], "");
}

/// A second appliance of `a`'s site on the database `url`: `bca join-site`, approved on `a`, then
/// serving.
fn second_appliance(a: &Appliance, url: &str) -> Appliance {
    let dir = a.dir.with_file_name(format!(
        "{}-second",
        a.dir.file_name().unwrap().to_string_lossy()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    let state = dir.join("state");
    let show = Command::new(bin())
        .args(["pki", "show", "--json"])
        .env("BCA_STATE_DIR", a.dir.join("state"))
        .output()
        .unwrap();
    let pin = serde_json::from_slice::<Value>(&show.stdout).unwrap()["pins"]["servingCa"]
        .as_str()
        .unwrap()
        .to_string();
    let o = Command::new(bin())
        .args([
            "join-site",
            "--store",
            url,
            "--serving-ca-pin",
            &pin,
            "--key-protection",
            "file",
            "--gateway-san",
            "127.0.0.1",
            "--json",
            "--state-dir",
        ])
        .arg(&state)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let joined: Value = serde_json::from_slice(&o.stdout).unwrap();
    let (id, fp) = (joined["id"].clone(), joined["fingerprint"].clone());
    let cfg = state.join("config.toml");
    let mut doc: toml::Table = toml::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    let sessions = doc["sessions"].as_table_mut().unwrap();
    sessions.insert("joins_per_source_per_minute".into(), 0.into());
    sessions.insert("max_connections_per_source".into(), 1_000_000.into());
    std::fs::write(&cfg, toml::to_string(&doc).unwrap()).unwrap();
    api(
        a,
        "site/appliances/approve",
        json!({"id": id, "fingerprint": fp}),
    );
    let (child, ready, _) = start_serve(&state);
    Appliance {
        dir,
        child,
        http: ready["http"].as_str().unwrap().into(),
        gateway: ready["gateway"].as_str().unwrap().into(),
        socket: PathBuf::from(ready["admin"].as_str().unwrap()),
    }
}

/// The agent configuration of `a`'s gateway.
fn agent_config_for(a: &Appliance) -> Arc<AgentConfig> {
    let adir = a.dir.join("agent");
    bca::appliance::agent_files::write_agent_config(
        &a.dir.join("state"),
        &[format!("https://{}", a.gateway)],
        &adir,
    )
    .unwrap();
    Arc::new(AgentConfig::load(&adir.join("config.toml")).unwrap())
}

/// A renewal of an admitted machine, made as the machine would before it asks: its new key, the
/// CSR, and the request's bytes (the proof signed with its current key at `now`).
fn renew_request(
    m: &Machine,
    body: &protocol::JoinResponseBody,
    now: i64,
) -> (SigningKey, Vec<u8>, Vec<u8>) {
    let key = SigningKey::generate();
    let csr = bca::proto::csr::create(&key);
    let msg = protocol::renew_pop_message(&crypto::sha256(&csr), &body.node_id, now);
    let req = Request {
        v: 1,
        renew: Some(RenewRequest {
            csr: crypto::b64(&csr),
            chain: body.certificate_chain.clone(),
            client_time: now,
            pop_sig: crypto::b64(&m.key.sign(protocol::RENEW_POP_PURPOSE, &msg)),
            key_attestation: None,
        }),
        ..Default::default()
    };
    (key, csr, serde_json::to_vec(&req).unwrap())
}

/// [`join_storm`] with the machines spread over the gateways of `cfgs` in turn.
fn spread_storm(
    rt: &tokio::runtime::Runtime,
    cfgs: &[Arc<AgentConfig>],
    machines: &[Arc<Machine>],
    conc: usize,
) -> Vec<Option<protocol::JoinResponse>> {
    let sem = Arc::new(tokio::sync::Semaphore::new(conc));
    rt.block_on(async {
        let mut hs = Vec::new();
        for (i, m) in machines.iter().enumerate() {
            let (cfg, m, sem) = (cfgs[i % cfgs.len()].clone(), m.clone(), sem.clone());
            hs.push(tokio::spawn(async move {
                let _p = sem.acquire_owned().await.unwrap();
                one_join(cfg, m).await.1
            }));
        }
        let mut out = Vec::new();
        for h in hs {
            out.push(h.await.unwrap());
        }
        out
    })
}

/// Each admitted machine renews once over a new mTLS connection, through the gateways of `cfgs`
/// in turn (its proof and new key made before the clock starts); how many were renewed.
fn renew_storm(
    rt: &tokio::runtime::Runtime,
    cfgs: &[Arc<AgentConfig>],
    admitted: &[(Arc<Machine>, protocol::JoinResponseBody)],
    conc: usize,
) -> usize {
    let now = bca::base::clock::now();
    // Each: the chain the connection presents (DER), the machine (its key), the request.
    type Prepared = (Vec<Vec<u8>>, Arc<Machine>, Vec<u8>);
    let prepared: Vec<Prepared> = admitted
        .iter()
        .map(|(m, body)| {
            let (_, _, req) = renew_request(m, body, now);
            (chain_der(&body.certificate_chain), m.clone(), req)
        })
        .collect();
    let sem = Arc::new(tokio::sync::Semaphore::new(conc));
    rt.block_on(async {
        let mut hs = Vec::new();
        for (i, (chain, m, req)) in prepared.into_iter().enumerate() {
            let (cfg, sem) = (cfgs[i % cfgs.len()].clone(), sem.clone());
            hs.push(tokio::spawn(async move {
                let _p = sem.acquire_owned().await.unwrap();
                let Ok(mut s) = agent::connect(&cfg, Some((chain, m.key.pkcs8()))).await else {
                    return false;
                };
                let Ok(raw) = agent::roundtrip(&cfg, &mut s, &req).await else {
                    return false;
                };
                serde_json::from_slice::<Reply>(&raw)
                    .map(|r| r.renew_response.is_some())
                    .unwrap_or(false)
            }));
        }
        let mut n = 0;
        for h in hs {
            n += h.await.unwrap() as usize;
        }
        n
    })
}

/// A pool, tokens (10,000 uses each) and `n` machines prepared as real ones would be before the
/// clock starts, with the agent configuration they join with.
fn prepare_machines(a: &Appliance, n: usize) -> (Arc<AgentConfig>, Vec<Arc<Machine>>) {
    prepare_machines_in(a, "bench", n)
}

fn prepare_machines_in(
    a: &Appliance,
    pool_name: &str,
    n: usize,
) -> (Arc<AgentConfig>, Vec<Arc<Machine>>) {
    let root = api(a, "tenants/list", json!({}))["items"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let pool = api(
        a,
        "pools/create",
        json!({"tenantId": root, "name": pool_name}),
    )["id"]
        .as_str()
        .unwrap()
        .to_string();
    let tokens: Vec<String> = (0..n.div_ceil(10_000))
        .map(|i| {
            let t = api(
                a,
                "joinTokens/create",
                json!({"tenantId": root, "poolId": pool, "ttlSeconds": 3600, "maxUses": 10_000, "idempotencyKey": format!("{pool_name}{i}")}),
            );
            t["token"].as_str().unwrap().to_string()
        })
        .collect();
    let adir = a.dir.join(format!("agent-{pool_name}"));
    bca::appliance::agent_files::write_agent_config(
        &a.dir.join("state"),
        &[format!("https://{}", a.gateway)],
        &adir,
    )
    .unwrap();
    let cfg = Arc::new(AgentConfig::load(&adir.join("config.toml")).unwrap());
    let enc = cfg
        .join_encryption_point(&adir.join("config.toml"))
        .unwrap();
    let machines = (0..n)
        .map(|i| Arc::new(machine(i, &tokens[i / 10_000], &enc)))
        .collect();
    (cfg, machines)
}

/// The load generator's runtime: two workers.
fn load_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// Every machine joins, `conc` at once, each on a new connection; latency and answer of each.
fn join_storm(
    rt: &tokio::runtime::Runtime,
    cfg: &Arc<AgentConfig>,
    machines: &[Arc<Machine>],
    conc: usize,
) -> Vec<(Duration, Option<protocol::JoinResponse>)> {
    let sem = Arc::new(tokio::sync::Semaphore::new(conc));
    rt.block_on(async {
        let mut hs = Vec::new();
        for m in machines {
            let (cfg, m, sem) = (cfg.clone(), m.clone(), sem.clone());
            hs.push(tokio::spawn(async move {
                let _p = sem.acquire_owned().await.unwrap();
                one_join(cfg, m).await
            }));
        }
        let mut out = Vec::new();
        for h in hs {
            out.push(h.await.unwrap());
        }
        out
    })
}

/// Joins offered at a steady `rate` (one new connection each, started on schedule whatever the
/// answers): the latency a join meets when the appliance is not saturated, unlike the storm's
/// burst. Returns the latencies and the failures.
fn paced_joins(
    rt: &tokio::runtime::Runtime,
    cfg: &Arc<AgentConfig>,
    machines: &[Arc<Machine>],
    rate: f64,
) -> (Vec<Duration>, usize) {
    rt.block_on(async {
        let start = tokio::time::Instant::now();
        let mut hs = Vec::new();
        for (i, m) in machines.iter().enumerate() {
            tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / rate)).await;
            let (cfg, m) = (cfg.clone(), m.clone());
            hs.push(tokio::spawn(one_join(cfg, m)));
        }
        let mut lat = Vec::new();
        let mut failed = 0;
        for h in hs {
            match h.await.unwrap() {
                (d, Some(_)) => lat.push(d),
                _ => failed += 1,
            }
        }
        lat.sort();
        (lat, failed)
    })
}

/// What privilege separation costs a join: the same storm with the gateway in the confined child
/// and in the one process, alternated, the best of each.
fn privsep_cost(conc: usize) {
    let n = env("BENCH_PRIVSEP_JOINS", 4_000);
    let (mut on, mut off) = (0f64, 0f64);
    for round in 0..2 {
        on = on.max(quick_storm(&format!("on{round}"), true, n, conc));
        off = off.max(quick_storm(&format!("off{round}"), false, n, conc));
    }
    line("join_storm_privsep", on, "joins/s/core");
    line("join_storm_one_process", off, "joins/s/core");
    line("privsep_join_cost", 1.0 - on / off, "");
}

fn main() {
    // `cargo test --all-targets` builds and runs benches too; only `cargo bench` (which passes
    // `--bench`) runs the storm.
    if !std::env::args().any(|a| a == "--bench") {
        println!("storm: run with `make bench`");
        return;
    }
    if std::env::var_os("BCA_BENCH_FLOOR").is_some() {
        // The floor's server, run by `floor::measure` on the appliance's core.
        floor::serve();
        return;
    }
    if let Ok(which) = std::env::var("BCA_BENCH_CEILING") {
        // Ceiling-only mode, run by `appliance_core_ceilings` on the appliance's core.
        if which != "renewal" {
            line("join_ceiling", ceiling(500), "joins/s/core");
        }
        if which != "join" {
            line("renewal_ceiling", renewal_ceiling(500), "renewals/s/core");
        }
        return;
    }
    if std::env::var("BCA_BENCH_PINNED").is_err()
        && Command::new("taskset").arg("--version").output().is_ok()
    {
        // Re-run this load generator on core 1, leaving core 0 to the appliance.
        let status = taskset("1")
            .arg(std::env::current_exe().unwrap())
            .args(std::env::args().skip(1))
            .env("BCA_BENCH_PINNED", "1")
            .status()
            .unwrap();
        std::process::exit(status.code().unwrap_or(1));
    }
    let joins = env("BENCH_JOINS", 20_000);
    let conc = env("BENCH_CONCURRENCY", 200);
    if std::env::var_os("BCA_BENCH_ENGINES").is_some() {
        println!("# bca engines bench: {joins} joins then as many renewals, {conc} concurrent: one appliance on SQLite, one on PostgreSQL, two on one PostgreSQL");
        println!("{}", support::describe_bin());
        engines(joins, conc);
        return;
    }
    // Each session is a file descriptor on both sides: the hard limit (20,000 on these machines,
    // not raisable without CAP_SYS_RESOURCE) bounds how many fit, less a margin for the rest.
    let sessions = env("BENCH_SESSIONS", 20_000)
        .min(joins)
        .min(nofile_hard().saturating_sub(200) as usize);
    println!("# bca storm bench: {joins} joins, {conc} concurrent, {sessions} sessions; bca serve on core 0, load on core 1");
    println!("{}", support::describe_bin());

    let (join_ceil_before, renewal_ceil_start) = appliance_core_ceilings("both", "");
    floor::measure(
        joins.min(20_000),
        conc,
        join_ceil_before,
        renewal_ceil_start,
    );

    privsep_cost(conc);

    let mut a = appliance("main", true);
    // Cold start on an empty state directory; again after the storms (20,000 nodes), below.
    line("cold_start_empty", cold_start(&mut a), "ms");
    let (cfg, machines) = prepare_machines(&a, joins);
    let rt = load_runtime();
    // Join storm.
    let cpu0 = cpu_seconds(a.child.id());
    let switches0 = context_switches(a.child.id());
    let join_ticks0 = core_ticks(0);
    // A mark for a profiler started alongside, as for the renewal storm below.
    println!("# join storm: the clock starts");
    let join_lo0 = floor::loopback();
    let t = Instant::now();
    let results = join_storm(&rt, &cfg, &machines, conc);
    let join_steal = core_ticks(0).since(&join_ticks0).steal;
    // The sessions below open at the same concurrency.
    let sem = Arc::new(tokio::sync::Semaphore::new(conc));
    let wall = t.elapsed();
    let join_cpu = cpu_seconds(a.child.id()) - cpu0;
    let join_switches = context_switches(a.child.id()) - switches0;
    let ok = results.iter().filter(|r| r.1.is_some()).count();
    let mut lat: Vec<Duration> = results.iter().map(|r| r.0).collect();
    lat.sort();
    let rate = ok as f64 / wall.as_secs_f64();
    line("join_storm", rate, "joins/s/core");
    let (join_ceil_after, _) = appliance_core_ceilings("join", "_after_storm");
    let ceil = (join_ceil_before + join_ceil_after) / 2.0;
    line("join_ceiling_fraction", rate / ceil, "");
    // How busy the appliance's core was: below 1, the load generator's core is the bound.
    line(
        "join_storm_appliance_core_busy",
        join_cpu / wall.as_secs_f64(),
        "",
    );
    line(
        "join_per_appliance_cpu_second",
        ok as f64 / join_cpu.max(0.01),
        "joins/cpu-s",
    );
    line("join_storm_core_steal", join_steal, "");
    line(
        "join_storm_context_switches",
        join_switches as f64 / ok.max(1) as f64,
        "per join",
    );
    line("join_p50", pct(&lat, 0.5), "ms");
    line("join_p99", pct(&lat, 0.99), "ms");
    line("join_failures", (joins - ok) as f64, "");
    floor::loopback_lines("join_storm", join_lo0, joins, "join");

    // The same joins offered at 75% of the storm's rate, for 5 seconds.
    let offered = rate * 0.75;
    let (pcfg, paced) = prepare_machines_in(&a, "paced", (offered * 5.0) as usize);
    let (plat, pfailed) = paced_joins(&rt, &pcfg, &paced, offered);
    line("join_paced_offered", offered, "joins/s");
    line("join_paced_p50", pct(&plat, 0.5), "ms");
    line("join_paced_p99", pct(&plat, 0.99), "ms");
    line("join_paced_failures", pfailed as f64, "");
    drop(paced);

    // Sessions and renewals: the first `sessions` nodes open mTLS sessions, then renew over them.
    let rss0 = rss_kib(a.child.id());
    let nodes: Vec<(Arc<Machine>, protocol::JoinResponseBody)> = machines
        .iter()
        .zip(results)
        .take(sessions)
        .filter_map(|(m, (_, r))| {
            let body = agent::verify_response(&cfg, r.as_ref()?, &m.csr, &m.key, "node").ok()?;
            Some((m.clone(), body))
        })
        .collect();
    drop(machines);
    let cpu_open0 = cpu_seconds(a.child.id());
    let t = Instant::now();
    let streams = rt.block_on(async {
        let mut hs = Vec::new();
        for (i, (m, body)) in nodes.iter().enumerate() {
            let (cfg, sem, src) = (cfg.clone(), sem.clone(), machine_addr(i));
            let tls = identity_tls(&cfg, chain_der(&body.certificate_chain), m.key.pkcs8());
            hs.push(tokio::spawn(async move {
                let _p = sem.acquire_owned().await.unwrap();
                open_session(&cfg, tls, src).await.ok()
            }));
        }
        let mut out = Vec::new();
        for h in hs {
            out.push(h.await.unwrap());
        }
        out
    });
    let open = streams.iter().filter(|s| s.is_some()).count();
    line("sessions_open", open as f64, "");
    line("sessions_open_s", t.elapsed().as_secs_f64(), "s");
    line(
        "sessions_open_appliance_core_busy",
        (cpu_seconds(a.child.id()) - cpu_open0) / t.elapsed().as_secs_f64(),
        "",
    );
    std::thread::sleep(Duration::from_millis(500));
    let rss1 = rss_kib(a.child.id());
    line("sessions_rss", rss1 as f64 / 1024.0, "MiB");
    line(
        "session_rss",
        (rss1.saturating_sub(rss0)) as f64 / open.max(1) as f64,
        "KiB/session",
    );

    // Renewal storm: every session renews at once; the sessions stay open with the new identity.
    // Each machine's new key, CSR and proof are made before the clock starts (a real machine
    // computes them on its own hardware); every answer is still read and checked on the clock.
    let now = bca::base::clock::now();
    let prepared: Vec<(SigningKey, Vec<u8>, Vec<u8>)> = nodes
        .iter()
        .map(|(m, body)| renew_request(m, body, now))
        .collect();
    let (_, renewal_ceil_before) = appliance_core_ceilings("renewal", "_before_storm");
    let cpu0 = cpu_seconds(a.child.id());
    let switches0 = context_switches(a.child.id());
    let load0 = cpu_seconds_of(std::process::id());
    let commits0 = commit_metrics(&a.http);
    let core0 = core_ticks(0);
    // A mark for a profiler started alongside (`perf`, a sampler of thread states).
    println!("# renewal storm: the clock starts");
    let renewal_lo0 = floor::loopback();
    let t = Instant::now();
    let renewed: Vec<(Option<Duration>, Option<Live>)> = rt.block_on(async {
        let mut hs = Vec::new();
        for (i, (s, (key, csr, bytes))) in streams.into_iter().zip(prepared).enumerate() {
            let (cfg, src) = (cfg.clone(), machine_addr(i));
            hs.push(tokio::spawn(async move {
                let Some(mut s) = s else {
                    return (None, None);
                };
                let t = Instant::now();
                let Ok(raw) = agent::roundtrip(&cfg, &mut s, &bytes).await else {
                    return (None, None);
                };
                let Some(r) = serde_json::from_slice::<Reply>(&raw)
                    .ok()
                    .and_then(|r| r.renew_response)
                else {
                    return (None, None);
                };
                let took = t.elapsed();
                let live = agent::verify_response(&cfg, &r, &csr, &key, "node")
                    .ok()
                    .map(|b| Live {
                        stream: s,
                        tls: None,
                        src,
                        chain: chain_der(&b.certificate_chain),
                        key: key.pkcs8().to_vec(),
                    });
                (Some(took), live)
            }));
        }
        let mut out = Vec::new();
        for h in hs {
            out.push(h.await.unwrap());
        }
        out
    });
    let wall = t.elapsed();
    let commits1 = commit_metrics(&a.http);
    let core1 = core_ticks(0);
    let renew_cpu = cpu_seconds(a.child.id()) - cpu0;
    let renew_switches = context_switches(a.child.id()) - switches0;
    let load_cpu = cpu_seconds_of(std::process::id()) - load0;
    let mut rl: Vec<Duration> = renewed.iter().filter_map(|r| r.0).collect();
    rl.sort();
    floor::loopback_lines("renewal_storm", renewal_lo0, rl.len(), "renewal");
    let (_, renewal_ceil_after) = appliance_core_ceilings("renewal", "_after_storm");
    let renewal_ceil = (renewal_ceil_before + renewal_ceil_after) / 2.0;
    line(
        "renewal_storm",
        rl.len() as f64 / wall.as_secs_f64(),
        "renewals/s/core",
    );
    line(
        "renewal_ceiling_fraction",
        rl.len() as f64 / wall.as_secs_f64() / renewal_ceil,
        "",
    );
    line(
        "renewal_storm_appliance_core_busy",
        renew_cpu / wall.as_secs_f64(),
        "",
    );
    // The load generator's own core: near 1, it is what bounds the figure.
    line(
        "renewal_storm_load_core_busy",
        load_cpu / wall.as_secs_f64(),
        "",
    );
    // The appliance's core as the kernel counts it: anything that ran on it (the kernel's own
    // threads and interrupts too), and the time it sat idle waiting for a disk write.
    let core = core1.since(&core0);
    line("renewal_storm_core_busy_all", core.busy, "");
    line("renewal_storm_core_iowait", core.iowait, "");
    line("renewal_storm_core_steal", core.steal, "");
    line(
        "renewal_storm_context_switches",
        renew_switches as f64 / rl.len().max(1) as f64,
        "per renewal",
    );
    // The join writer's thread: how many durable transactions, and the fraction of the storm it
    // spent in them (its SQL and the commit's `fsync`); near 1, the writer bounds the figure.
    let commits = commits1.0 - commits0.0;
    line("renewal_storm_commits", commits, "");
    line(
        "renewal_storm_writer_busy",
        (commits1.1 - commits0.1) / wall.as_secs_f64(),
        "",
    );
    line(
        "renewal_per_appliance_cpu_second",
        rl.len() as f64 / renew_cpu.max(0.01),
        "renewals/cpu-s",
    );
    line("renewal_p50", pct(&rl, 0.5), "ms");
    line("renewal_p99", pct(&rl, 0.99), "ms");
    line("renewal_failures", (renewed.len() - rl.len()) as f64, "");

    // Reconnect storm: the appliance restarts under every live session. Each client notices the
    // close at once (as `bca agent run` does), then reconnects with the agent's backoff. The
    // sessions renewed their identities, so the first restart meets full handshakes (as after a
    // renewal or an agent's own restart); the second, the tickets of those handshakes.
    let lives: Vec<Live> = renewed.into_iter().filter_map(|r| r.1).collect();
    let lives = reconnect_storm(&rt, &mut a, &cfg, lives, "reconnect");
    let sessions_back = reconnect_storm(&rt, &mut a, &cfg, lives, "reconnect_resumed");
    std::thread::sleep(Duration::from_millis(300));
    line(
        "sessions_rss_after_reconnect",
        rss_kib(a.child.id()) as f64 / 1024.0,
        "MiB",
    );
    drop(sessions_back);
    drop(rt);

    line("cold_start", cold_start(&mut a), "ms");
    // With passphrase protection, start also pays the key derivation (Argon2id, 64 MiB, 3
    // passes), printed apart: it is the price of the protection, not of the start.
    let kdf_dir = a.dir.join("kdf");
    let bundle = bca::pki::bundle::KeyBundle::generate();
    bca::keys::seal(
        &kdf_dir,
        &bundle,
        bca::config::KeyProtection::Passphrase,
        Some(b"a bench passphrase"),
    )
    .unwrap();
    let t = Instant::now();
    bca::keys::unseal(
        &kdf_dir,
        bca::config::KeyProtection::Passphrase,
        Some(b"a bench passphrase"),
    )
    .unwrap();
    line("passphrase_kdf", t.elapsed().as_secs_f64() * 1000.0, "ms");
}
