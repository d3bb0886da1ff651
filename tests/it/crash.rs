//! Crash consistency: a storm of joins, renewals and approvals (and the joins approvals admit,
//! some racing their approval), with `bca agent run` processes renewing inside their sessions, is
//! cut by SIGKILL at random moments, 50 times, restarting the appliance each time.
//! Afterwards: no token admitted more joins than its `maxUses`, every certificate an agent
//! received (join or renewal) has its `node_certs` row and its node, no acknowledged join or
//! approval is lost, no join request is consumed twice, the uses spent equal the nodes admitted
//! by tokens, and `PRAGMA integrity_check` is `ok`.

use crate::common::*;
use bca::base::crypto::{self, SigningKey};
use bca::proto::protocol::{Reply, Request};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const KILLS: usize = 50;
/// Discovered machines waiting for an approval when the storm starts.
const WAITING: usize = 12;

fn kill9(a: &mut Appliance) {
    let mut c = a.child.take().unwrap();
    let _ = std::process::Command::new("kill")
        .args(["-KILL", &c.id().to_string()])
        .status();
    let _ = c.wait();
}

/// A node the test can renew: its current chain and key.
struct Held {
    node: String,
    chain_pem: Vec<String>,
    key: SigningKey,
}

/// A machine that PXE-booted the discovery ramdisk: its discovery token and the one CSR its
/// request (and so its approval) is pinned to.
pub(crate) struct Waiting {
    pub(crate) mac: String,
    token: String,
    key: SigningKey,
    csr: Vec<u8>,
    pub(crate) request: String,
}

/// A machine with `mac` boots the discovery ramdisk on `a` (a discovery appliance) and asks to
/// join: its request waits for an operator.
pub(crate) fn waiting_machine(a: &Appliance, mac: &str) -> Waiting {
    let mut m = booted_machine(a, mac);
    ask(&Sim::new(a), &m);
    m.request = a
        .db()
        .query_row("SELECT id FROM join_requests WHERE mac = ?1", [mac], |r| {
            r.get(0)
        })
        .unwrap();
    m
}

/// A machine with `mac` that booted the discovery ramdisk on `a`: its discovery token and the
/// one key and CSR it will ask with (no request yet).
pub(crate) fn booted_machine(a: &Appliance, mac: &str) -> Waiting {
    let (_, dir) = crate::discovery::boot(a, mac);
    let token = std::fs::read_to_string(dir.join("etc/bca-agent/discovery-token")).unwrap();
    let key = SigningKey::generate();
    let csr = bca::proto::csr::create(&key);
    Waiting {
        mac: mac.to_string(),
        token: token.trim().to_string(),
        key,
        csr,
        request: String::new(),
    }
}

/// The machine's first discovery join: it is told to wait (its request made).
pub(crate) fn ask(sim: &Sim, m: &Waiting) {
    let raw = discovery_join(sim, m).unwrap();
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    assert!(
        reply.join_deferred.is_some(),
        "{}",
        String::from_utf8_lossy(&raw)
    );
}

/// A discovery join of a waiting machine, always with its one CSR.
fn discovery_join(sim: &Sim, m: &Waiting) -> Result<Vec<u8>, bca::base::error::ApiError> {
    let claims = json!({"productUuid": "00000000-0000-0000-0000-000000000000", "macs": [m.mac], "hostname": "pxe"});
    let sealed =
        bca::proto::jwe::seal(&m.token, &sim.enc, &m.csr, bca::base::clock::now()).unwrap();
    let req = Sim::request(sealed, &m.csr, &claims, "discovery", "ramdisk");
    bca::agent::exchange_raw(&sim.cfg, &req)
}

/// A waiting machine's join with its approved CSR: `(serial, node id)` when admitted; nothing when
/// refused or when the appliance died under it.
pub(crate) fn admitted_join(sim: &Sim, m: &Waiting) -> Option<(String, String)> {
    let raw = discovery_join(sim, m).ok()?;
    let resp = serde_json::from_slice::<Reply>(&raw).ok()?.join_response?;
    let (serial, node, _) = issued(sim, &resp, &m.csr, &m.key, "ramdisk");
    Some((serial, node))
}

/// Adds `i` to the list unless it is there.
fn push_once(list: &Mutex<Vec<usize>>, i: usize) {
    let mut l = list.lock().unwrap();
    if !l.contains(&i) {
        l.push(i);
    }
}

/// `(serial, node id)` of the certificate in a verified answer.
fn issued(
    sim: &Sim,
    resp: &bca::proto::protocol::JoinResponse,
    csr: &[u8],
    key: &SigningKey,
    role: &str,
) -> (String, String, Vec<String>) {
    let body = bca::agent::verify_response(&sim.cfg, resp, csr, key, role)
        .expect("an answer that is not refused verifies");
    let der = bca::proto::x509::pem_decode_all(&body.certificate_chain[0], "CERTIFICATE").remove(0);
    let serial = bca::proto::x509::parse_node_leaf(&der).unwrap().serial_hex;
    (serial, body.node_id, body.certificate_chain)
}

/// One renewal over mTLS with the node's current certificate; the new chain and key on success.
fn renew(sim: &Sim, h: &Held) -> Option<(String, Vec<String>, SigningKey)> {
    let key = SigningKey::generate();
    let csr = bca::proto::csr::create(&key);
    let now = bca::base::clock::now();
    let msg = bca::proto::protocol::renew_pop_message(&crypto::sha256(&csr), &h.node, now);
    let req = Request {
        v: 1,
        renew: Some(bca::proto::protocol::RenewRequest {
            csr: crypto::b64(&csr),
            chain: h.chain_pem.clone(),
            client_time: now,
            pop_sig: crypto::b64(&h.key.sign(bca::proto::protocol::RENEW_POP_PURPOSE, &msg)),
            key_attestation: None,
        }),
        ..Default::default()
    };
    let der: Vec<Vec<u8>> = h
        .chain_pem
        .iter()
        .map(|p| bca::proto::x509::pem_decode_all(p, "CERTIFICATE").remove(0))
        .collect();
    let raw = rt().block_on(async {
        let mut s = bca::agent::connect(&sim.cfg, Some((der, h.key.pkcs8())))
            .await
            .ok()?;
        bca::agent::roundtrip(&sim.cfg, &mut s, &serde_json::to_vec(&req).unwrap())
            .await
            .ok()
    })?;
    let resp = serde_json::from_slice::<Reply>(&raw).ok()?.renew_response?;
    let (serial, _, chain) = issued(sim, &resp, &csr, &key, "node");
    Some((serial, chain, key))
}

#[test]
fn fifty_kills_lose_nothing_and_overspend_nothing() {
    let mut a = crate::discovery::appliance("unknown-machines");
    let pool = a.pool("p1");
    let intake = a.pool("intake");
    let root = a.root_tenant();
    let waiting: Arc<Vec<Waiting>> = Arc::new(
        (0..WAITING)
            .map(|i| waiting_machine(&a, &format!("52:54:00:cc:00:{i:02x}")))
            .collect(),
    );
    // Indexes into `waiting` whose approval the admin API acknowledged, and those admitted.
    let approved: Arc<Mutex<Vec<usize>>> = Arc::default();
    let admitted: Arc<Mutex<Vec<usize>>> = Arc::default();
    let held: Arc<Mutex<Vec<Held>>> = Arc::default();
    let renewals = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // Tokens with few uses, so that racing joins hit the limit.
    let mut tokens: Vec<(String, String, i64)> = (0..60)
        .map(|i| {
            let max = 1 + (i % 4) as i64;
            let (t, tok) = a.token(&pool, json!({"maxUses": max}));
            (t["id"].as_str().unwrap().to_string(), tok, max)
        })
        .collect();
    // Nodes whose `bca agent run` keeps its session through every kill and renews inside it: 20 s
    // certificates, renewed at about 12 s (8 s of slack for a renewal the kills interrupt).
    a.stop();
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        text.replace("cert_ttl_seconds = 86400", "cert_ttl_seconds = 20"),
    )
    .unwrap();
    let (http, gw) = (a.http.clone(), a.gateway.clone());
    a.serve_at(PASSPHRASE, &http, &gw);
    let (t, agent_token) = a.token(&pool, json!({"maxUses": 3}));
    tokens.push((t["id"].as_str().unwrap().to_string(), String::new(), 3));
    let agent_dirs: Vec<std::path::PathBuf> =
        (0..3).map(|_| joined_agent_dir(&a, &agent_token)).collect();
    let agents: Vec<std::process::Child> = agent_dirs.iter().map(|d| agent_run(d)).collect();
    let agent_serial = |d: &std::path::Path| {
        let id: serde_json::Value =
            serde_json::from_slice(&std::fs::read(d.join("data/identity.json")).unwrap()).unwrap();
        let pem = id["certificateChain"][0].as_str().unwrap().to_string();
        let der = bca::proto::x509::pem_decode_all(&pem, "CERTIFICATE").remove(0);
        (
            id["nodeId"].as_str().unwrap().to_string(),
            bca::proto::x509::parse_node_leaf(&der).unwrap().serial_hex,
        )
    };
    let first_serials: Vec<(String, String)> = agent_dirs.iter().map(|d| agent_serial(d)).collect();
    // (certificate serial, node id) of every acknowledged join or renewal.
    let acked: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15 ^ std::process::id() as u64;
    let mut rand = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for round in 0..KILLS {
        let sim = Arc::new(Sim::new(&a));
        let mut hs = Vec::new();
        for k in 0..6 {
            let (sim, acked, held) = (sim.clone(), acked.clone(), held.clone());
            // Two joins per token in each round: they race for its last use.
            let token = tokens[(round * 3 + k / 2) % 60].1.clone();
            hs.push(std::thread::spawn(move || {
                let claims = machine();
                let Ok(raw) = sim.try_join(&token, &claims) else {
                    return; // the appliance died under this join
                };
                let (raw, csr, key) = raw;
                let Ok(reply) = serde_json::from_slice::<Reply>(&raw) else {
                    return;
                };
                let Some(resp) = reply.join_response else {
                    return;
                };
                let (serial, node, chain_pem) = issued(&sim, &resp, &csr, &key, "node");
                acked.lock().unwrap().push((serial, node.clone()));
                held.lock().unwrap().push(Held {
                    node,
                    chain_pem,
                    key,
                });
            }));
        }
        // Renewals of nodes admitted in earlier rounds, over mTLS.
        for k in 0..2 {
            let (sim, acked, held, renewals) =
                (sim.clone(), acked.clone(), held.clone(), renewals.clone());
            hs.push(std::thread::spawn(move || {
                let pick = {
                    let mut h = held.lock().unwrap();
                    if h.is_empty() {
                        return;
                    }
                    let i = (round * 2 + k) % h.len();
                    h.swap_remove(i)
                };
                // Cut mid-way, whether it committed is unknown: that node is not renewed again
                // (its chain may be the superseded one).
                if let Some((serial, chain_pem, key)) = renew(&sim, &pick) {
                    acked.lock().unwrap().push((serial, pick.node.clone()));
                    renewals.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    held.lock().unwrap().push(Held {
                        node: pick.node,
                        chain_pem,
                        key,
                    });
                }
            }));
        }
        // An approval through the admin API, and the join of a machine approved earlier.
        {
            let (socket, approved, root, intake) = (
                a.socket.clone(),
                approved.clone(),
                root.clone(),
                intake.clone(),
            );
            let waiting = waiting.clone();
            let i = round % WAITING;
            hs.push(std::thread::spawn(move || {
                if approved.lock().unwrap().contains(&i) {
                    return;
                }
                let r = bca::cli::client::Client::new(&socket).call(
                    "joinRequests/approve",
                    &json!({"tenantId": root, "poolId": intake, "requestId": waiting[i].request}),
                );
                if let Ok(v) = r {
                    assert_eq!(v["state"], "approved", "{v}");
                    push_once(&approved, i);
                }
            }));
        }
        // The machine retrying with its approved CSR while its approval is being written: admitted
        // only once the approval committed (then the approval counts as acknowledged, whatever
        // became of the operator's answer), and only once.
        {
            let (sim, acked, approved, admitted) = (
                sim.clone(),
                acked.clone(),
                approved.clone(),
                admitted.clone(),
            );
            let waiting = waiting.clone();
            let i = round % WAITING;
            hs.push(std::thread::spawn(move || {
                if admitted.lock().unwrap().contains(&i) {
                    return;
                }
                if let Some(a) = admitted_join(&sim, &waiting[i]) {
                    acked.lock().unwrap().push(a);
                    let mut ad = admitted.lock().unwrap();
                    assert!(!ad.contains(&i), "request {i} admitted twice");
                    ad.push(i);
                    push_once(&approved, i);
                }
            }));
        }
        {
            let (sim, acked, approved, admitted) = (
                sim.clone(),
                acked.clone(),
                approved.clone(),
                admitted.clone(),
            );
            let waiting = waiting.clone();
            hs.push(std::thread::spawn(move || {
                let next = {
                    let (ap, ad) = (approved.lock().unwrap(), admitted.lock().unwrap());
                    ap.iter().copied().find(|i| !ad.contains(i))
                };
                let Some(i) = next else { return };
                if let Some(a) = admitted_join(&sim, &waiting[i]) {
                    acked.lock().unwrap().push(a);
                    admitted.lock().unwrap().push(i);
                }
            }));
        }
        // Cut the power somewhere in the storm.
        std::thread::sleep(Duration::from_millis(rand() % 120));
        kill9(&mut a);
        for h in hs {
            let _ = h.join();
        }
        let (http, gw) = (a.http.clone(), a.gateway.clone());
        a.serve_at(PASSPHRASE, &http, &gw);
    }
    // More kills until every `agent run` has renewed inside its session at least once.
    let t = std::time::Instant::now();
    while agent_dirs
        .iter()
        .zip(&first_serials)
        .any(|(d, (_, s0))| agent_serial(d).1 == *s0)
    {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "an agent run never renewed across the kills"
        );
        // Slower than the storm's kills: a renewal needs the appliance up for a moment.
        std::thread::sleep(Duration::from_millis(500 + rand() % 1000));
        kill9(&mut a);
        let (http, gw) = (a.http.clone(), a.gateway.clone());
        a.serve_at(PASSPHRASE, &http, &gw);
    }
    // Every acknowledged approval survived; the machines approved and not yet admitted join now,
    // with the CSR their approval is pinned to.
    let sim = Sim::new(&a);
    let approved = approved.lock().unwrap().clone();
    assert!(!approved.is_empty(), "no approval was ever acknowledged");
    for &i in &approved {
        let m = &waiting[i];
        let state: String = a
            .db()
            .query_row(
                "SELECT state FROM join_requests WHERE id = ?1",
                [&m.request],
                |r| r.get(0),
            )
            .unwrap();
        assert!(
            state == "approved" || state == "consumed",
            "the acknowledged approval of {} is {state}",
            m.request
        );
        if admitted.lock().unwrap().contains(&i) {
            continue;
        }
        let raw = discovery_join(&sim, m).unwrap();
        let reply: Reply = serde_json::from_slice(&raw).unwrap();
        if let Some(resp) = reply.join_response {
            let (serial, node, _) = issued(&sim, &resp, &m.csr, &m.key, "ramdisk");
            acked.lock().unwrap().push((serial, node));
        } else {
            // Admitted by a join whose answer died with the process: consumed already.
            assert_eq!(state, "consumed", "{}", String::from_utf8_lossy(&raw));
        }
    }
    // Consumed once: one node per request, and a consumed request admits nothing more.
    for &i in &approved {
        let m = &waiting[i];
        let (state, node): (String, Option<String>) = a
            .db()
            .query_row(
                "SELECT state, node_id FROM join_requests WHERE id = ?1",
                [&m.request],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .unwrap();
        assert_eq!(state, "consumed");
        let node = node.unwrap();
        assert_eq!(
            a.count(&format!(
                "SELECT count(*) FROM join_requests WHERE node_id = '{node}'"
            )),
            1
        );
        let raw = discovery_join(&sim, m).unwrap();
        assert_eq!(raw, refused_bytes(), "a consumed request admitted again");
    }
    let ramdisks = a.count("SELECT count(*) FROM nodes WHERE role = 'ramdisk'");
    assert_eq!(ramdisks, approved.len() as i64);
    let acked = acked.lock().unwrap().clone();
    assert!(
        !acked.is_empty(),
        "no join was ever acknowledged: the test measured nothing"
    );
    let db = a.db();
    let integrity: String = db
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(integrity, "ok");
    for (serial, node) in &acked {
        let n: i64 = db
            .query_row(
                "SELECT count(*) FROM node_certs c JOIN nodes n ON n.id = c.node_id WHERE c.serial = ?1 AND n.id = ?2",
                [serial, node],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(n, 1, "acknowledged certificate {serial} of {node} was lost");
    }
    for (id, _, max) in &tokens {
        let uses_left: i64 = db
            .query_row(
                "SELECT uses_left FROM join_tokens WHERE id = ?1",
                [id],
                |r| r.get(0),
            )
            .unwrap();
        assert!(
            (0..=*max).contains(&uses_left),
            "{id}: uses_left {uses_left} of {max}"
        );
    }
    // Every node's certificates are a node's; no acknowledged join spent more than the tokens had.
    let total_max: i64 = tokens.iter().map(|t| t.2).sum();
    let nodes: i64 = db
        .query_row("SELECT count(*) FROM nodes WHERE role = 'node'", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert!(
        nodes <= total_max,
        "{nodes} nodes from tokens worth {total_max} joins"
    );
    let spent: i64 = db
        .query_row(
            "SELECT sum(max_uses - uses_left) FROM join_tokens",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(spent, nodes, "uses spent and nodes admitted disagree");
    let renewed = renewals.load(std::sync::atomic::Ordering::Relaxed);
    assert!(renewed > 0, "no renewal was ever acknowledged");
    // What each `agent run` holds was acknowledged to it: its certificate has its row and node.
    let mut agent_renewals = 0;
    for (d, (node0, serial0)) in agent_dirs.iter().zip(&first_serials) {
        let (node, serial) = agent_serial(d);
        assert_eq!(&node, node0);
        let n: i64 = db
            .query_row(
                "SELECT count(*) FROM node_certs WHERE serial = ?1 AND node_id = ?2",
                [&serial, &node],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(n, 1, "the certificate agent run holds ({serial}) was lost");
        if &serial != serial0 {
            agent_renewals += 1;
        }
    }
    for mut c in agents {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert_eq!(
        agent_renewals, 3,
        "an agent run never renewed across the kills"
    );
    eprintln!(
        "{KILLS} kills survived; {} certificates acknowledged ({renewed} renewals); {nodes} nodes \
         by token; {} approvals acknowledged, {ramdisks} machines admitted by them; \
         {agent_renewals} of 3 agent run sessions renewed",
        acked.len(),
        approved.len()
    );
}
