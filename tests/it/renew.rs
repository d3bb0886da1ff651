//! Renewal, sessions, `bca agent run` and `doctor`.

use crate::common::*;
use bca::base::crypto::{self, SigningKey};
use bca::proto::agent_config::AgentConfig;
use bca::proto::protocol::{
    renew_pop_message, Empty, Hello, RenewRequest, Reply, Request, RENEW_POP_PURPOSE,
};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::Duration;

/// A joined node as the test holds it: its chain (PEM and DER) and key.
pub(crate) struct Node {
    pub(crate) id: String,
    pub(crate) chain_pem: Vec<String>,
    pub(crate) chain_der: Vec<Vec<u8>>,
    pub(crate) key: SigningKey,
}

pub(crate) fn join_node(sim: &Sim, token: &str, claims: &Value) -> Node {
    let (raw, csr, key) = sim.join(token, claims);
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    let body =
        bca::agent::verify_response(&sim.cfg, &reply.join_response.unwrap(), &csr, &key, "node")
            .unwrap();
    node_from(body.node_id, body.certificate_chain, key)
}

fn node_from(id: String, chain_pem: Vec<String>, key: SigningKey) -> Node {
    let chain_der = chain_pem
        .iter()
        .map(|p| bca::proto::x509::pem_decode_all(p, "CERTIFICATE").remove(0))
        .collect();
    Node {
        id,
        chain_pem,
        chain_der,
        key,
    }
}

/// A renewal request: `presented` is the chain sent in the body, `pop` the key proving it, over
/// an mTLS connection made with `mtls`.
pub(crate) fn renew_raw(
    cfg: &AgentConfig,
    mtls: &Node,
    presented: &[String],
    pop_node: &str,
    pop: &SigningKey,
    client_time: i64,
) -> (Vec<u8>, Request) {
    let key = SigningKey::generate();
    let csr = bca::proto::csr::create(&key);
    let msg = renew_pop_message(&crypto::sha256(&csr), pop_node, client_time);
    let req = Request {
        v: 1,
        renew: Some(RenewRequest {
            csr: crypto::b64(&csr),
            chain: presented.to_vec(),
            client_time,
            pop_sig: crypto::b64(&pop.sign(RENEW_POP_PURPOSE, &msg)),
            key_attestation: None,
        }),
        ..Default::default()
    };
    (send(cfg, mtls, &req), req)
}

pub(crate) fn send(cfg: &AgentConfig, mtls: &Node, req: &Request) -> Vec<u8> {
    rt().block_on(async {
        let mut s = bca::agent::connect(cfg, Some((mtls.chain_der.clone(), mtls.key.pkcs8())))
            .await
            .unwrap();
        bca::agent::roundtrip(cfg, &mut s, &serde_json::to_vec(req).unwrap())
            .await
            .unwrap()
    })
}

pub(crate) fn renew_refused() -> Vec<u8> {
    br#"{"v":1,"error":{"code":"ACCESS_DENIED","message":"Renew refused"}}"#.to_vec()
}

pub(crate) fn last_renew_reason(a: &Appliance) -> String {
    a.last_event("security.renew.refused").unwrap().1["reason"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn renewal_keeps_role_and_san_and_refuses_every_bad_condition() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({"maxUses": 5, "allowReclaim": true}));
    let m = machine();
    let n = join_node(&sim, &token, &m);
    let now = bca::base::clock::now();

    // A good renewal: a new certificate, same SPIFFE ID and role, a new node_certs row.
    let (raw, req) = renew_raw(&sim.cfg, &n, &n.chain_pem, &n.id, &n.key, now);
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    let resp = reply
        .renew_response
        .unwrap_or_else(|| panic!("{}", String::from_utf8_lossy(&raw)));
    let body: bca::proto::protocol::JoinResponseBody =
        serde_json::from_slice(&crypto::b64_decode(&resp.body).unwrap()).unwrap();
    let new_leaf =
        bca::proto::x509::pem_decode_all(&body.certificate_chain[0], "CERTIFICATE").remove(0);
    let old_leaf = bca::proto::x509::parse_node_leaf(&n.chain_der[0]).unwrap();
    let nl = bca::proto::x509::parse_node_leaf(&new_leaf).unwrap();
    assert_eq!(nl.spiffe_id, old_leaf.spiffe_id);
    assert_ne!(nl.serial_hex, old_leaf.serial_hex);
    assert_eq!(bca::agent::cert_role(&new_leaf).as_deref(), Some("node"));
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), 2);
    assert!(a.last_event("node.renewed").is_some());

    // The same proof again: a replay.
    let raw = send(&sim.cfg, &n, &req);
    assert_eq!(raw, renew_refused());
    assert_eq!(last_renew_reason(&a), "renew:replay");

    // Client time 61 s off.
    let (raw, _) = renew_raw(&sim.cfg, &n, &n.chain_pem, &n.id, &n.key, now - 61);
    assert_eq!(raw, renew_refused());
    assert_eq!(last_renew_reason(&a), "renew:clock");

    // A proof by another key.
    let (raw, _) = renew_raw(
        &sim.cfg,
        &n,
        &n.chain_pem,
        &n.id,
        &SigningKey::generate(),
        now,
    );
    assert_eq!(raw, renew_refused());
    assert_eq!(last_renew_reason(&a), "renew:pop");
    assert_eq!(
        a.last_event("security.renew.refused").unwrap().0,
        a.root_tenant()
    );

    // Another node's mTLS identity presenting this node's chain and proof.
    let other = join_node(&sim, &token, &machine());
    let (raw, _) = renew_raw(&sim.cfg, &other, &n.chain_pem, &n.id, &n.key, now);
    assert_eq!(raw, renew_refused());
    assert_eq!(last_renew_reason(&a), "renew:identity");

    // A copied but unknown leaf: the same SPIFFE ID and key, signed by a CA of its own. It is not
    // the connection's certificate (TLS would not take it), which is the one a renewal renews.
    let rogue_ca = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let mut cap = rcgen::CertificateParams::default();
    cap.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let rogue = cap.self_signed(&rogue_ca).unwrap();
    let mut lp = rcgen::CertificateParams::default();
    lp.subject_alt_names = vec![rcgen::SanType::URI(
        old_leaf.spiffe_id.clone().try_into().unwrap(),
    )];
    let forged = lp.signed_by(&n.key.rcgen(), &rogue, &rogue_ca).unwrap();
    let (raw, _) = renew_raw(&sim.cfg, &n, &[forged.pem()], &n.id, &n.key, now);
    assert_eq!(raw, renew_refused());
    assert_eq!(last_renew_reason(&a), "renew:identity");

    // An old generation: the machine is reclaimed with a new key; the old certificate (still
    // valid for TLS) cannot renew.
    let _reclaimed = join_node(&sim, &token, &m);
    let (raw, _) = renew_raw(&sim.cfg, &n, &n.chain_pem, &n.id, &n.key, now);
    assert_eq!(raw, renew_refused());
    assert_eq!(last_renew_reason(&a), "renew:generation");
    // The caller proved the key: the event goes to the node's owner.
    let (tenant, ev) = a.last_event("security.renew.refused").unwrap();
    assert_eq!(tenant, a.root_tenant());
    assert_eq!(ev["nodeId"], json!(n.id));

    // A retired node.
    a.cli_json(&["nodes", "retire", &other.id]);
    let (raw, _) = renew_raw(
        &sim.cfg,
        &other,
        &other.chain_pem,
        &other.id,
        &other.key,
        now,
    );
    assert_eq!(raw, renew_refused());
    assert_eq!(last_renew_reason(&a), "renew:retired");
    // A deleted node: its certificate still passes TLS (under the node CA), its node is unknown.
    a.cli_json(&["nodes", "delete", &other.id, "--yes"]);
    let (raw, _) = renew_raw(
        &sim.cfg,
        &other,
        &other.chain_pem,
        &other.id,
        &other.key,
        now + 1,
    );
    assert_eq!(raw, renew_refused());
    assert_eq!(last_renew_reason(&a), "renew:unknown-certificate");

    // Without a client certificate there is nothing to renew.
    let raw = bca::agent::exchange_raw(&sim.cfg, &serde_json::to_vec(&req).unwrap()).unwrap();
    assert_eq!(raw, renew_refused());
}

fn hello(
    cfg: &AgentConfig,
    n: &Node,
) -> (Reply, bca::agent::GatewayStream, tokio::runtime::Runtime) {
    let rt = rt();
    let (r, s) = rt.block_on(async {
        let mut s = bca::agent::connect(cfg, Some((n.chain_der.clone(), n.key.pkcs8())))
            .await
            .unwrap();
        let req = Request {
            v: 1,
            hello: Some(Hello::default()),
            ..Default::default()
        };
        let raw = bca::agent::roundtrip(cfg, &mut s, &serde_json::to_vec(&req).unwrap())
            .await
            .unwrap();
        (serde_json::from_slice::<Reply>(&raw).unwrap(), s)
    });
    (r, s, rt)
}

#[test]
fn sessions_show_connected_and_revocation_closes_them() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({"maxUses": 2}));
    let n = join_node(&sim, &token, &machine());
    let (r, mut s, rt) = hello(&sim.cfg, &n);
    let w = r.welcome.clone().unwrap_or_else(|| panic!("{r:?}"));
    assert_eq!(w.node_id, n.id);
    let node = a.cli_json(&["nodes", "get", &n.id]);
    assert_eq!(node["connected"], true);
    assert!(node["lastSeen"].is_string());
    assert!(a.last_event("node.connected").is_some());
    // Heartbeats are acknowledged.
    let beat = serde_json::to_vec(&Request {
        v: 1,
        heartbeat: Some(Empty {}),
        ..Default::default()
    })
    .unwrap();
    let raw = rt
        .block_on(bca::agent::roundtrip(&sim.cfg, &mut s, &beat))
        .unwrap();
    assert!(serde_json::from_slice::<Reply>(&raw).unwrap().ack.is_some());
    // revokeIdentity closes the live session at once.
    a.cli_json(&["nodes", "revoke-identity", &n.id]);
    let closed = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_secs(5),
            bca::proto::protocol::read_frame(&mut s),
        )
        .await
    });
    let frame = closed.expect("the session was not closed").unwrap();
    assert_eq!(
        serde_json::from_slice::<Reply>(&frame)
            .unwrap()
            .error
            .unwrap()
            .code,
        "ACCESS_DENIED"
    );
    wait_for("node.disconnected", 5, || {
        ({ a.cli_json(&["nodes", "get", &n.id])["connected"] == false }).then_some(())
    });
    assert!(a.last_event("node.disconnected").is_some());
    // A revoked certificate cannot open a session.
    let (r, _, _) = hello(&sim.cfg, &n);
    assert_eq!(r.error.unwrap().message, "Session refused");
    // Nor can a certificate from another appliance (the TLS layer refuses it).
    let b = Appliance::start();
    let sim_b = Sim::new(&b);
    let pool_b = b.pool("p");
    let (_, tb) = b.token(&pool_b, json!({}));
    let nb = join_node(&sim_b, &tb, &machine());
    let e = rt.block_on(async {
        let mut s =
            bca::agent::connect(&sim.cfg, Some((nb.chain_der.clone(), nb.key.pkcs8()))).await?;
        let req = Request {
            v: 1,
            hello: Some(Hello::default()),
            ..Default::default()
        };
        bca::agent::roundtrip(&sim.cfg, &mut s, &serde_json::to_vec(&req).unwrap()).await
    });
    assert!(e.is_err(), "a foreign certificate opened a session");
}

/// A stopping appliance records every session closed at once, and its nodes see their sessions
/// end only after that (as it exits): a node that reconnects at once meets the next appliance,
/// not this one's closing listener.
#[test]
fn a_stopping_appliance_records_its_sessions_closed_before_its_nodes_see_them_end() {
    let mut a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({"maxUses": 3}));
    let nodes: Vec<Node> = (0..3)
        .map(|_| join_node(&sim, &token, &machine()))
        .collect();
    let sessions: Vec<_> = nodes.iter().map(|n| hello(&sim.cfg, n)).collect();
    assert!(sessions.iter().all(|(r, _, _)| r.welcome.is_some()));
    assert_eq!(connected(&a), 3);
    // Each node waits on its session; when it ends, what the database says at that moment.
    let watchers: Vec<_> = sessions
        .into_iter()
        .map(|(_, mut s, rt)| {
            let db = a.live();
            std::thread::spawn(move || {
                let r = rt.block_on(async {
                    tokio::time::timeout(
                        Duration::from_secs(20),
                        bca::proto::protocol::read_frame(&mut s),
                    )
                    .await
                });
                let count = |sql: &str| -> i64 { db.count(sql) };
                (
                    match r {
                        Ok(Err(_)) => Ok(()),
                        Ok(Ok(frame)) => {
                            Err(format!("a frame: {}", String::from_utf8_lossy(&frame)))
                        }
                        Err(_) => Err("still open after 20 s".to_string()),
                    },
                    count("SELECT COUNT(*) FROM nodes WHERE connected = 1"),
                    count("SELECT COUNT(*) FROM events WHERE type = 'node.disconnected'"),
                )
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        a.count("SELECT COUNT(*) FROM events WHERE type = 'node.disconnected'"),
        0
    );
    let status = a.stop().unwrap();
    assert!(status.success(), "{status}");
    for w in watchers {
        let (ended_without_a_frame, still_connected, disconnected) = w.join().unwrap();
        if let Err(e) = ended_without_a_frame {
            panic!("the session did not end with the appliance: {e}");
        }
        assert_eq!(
            still_connected, 0,
            "a node saw its session end before it was recorded"
        );
        assert_eq!(disconnected, 3);
    }
}

#[test]
fn agent_run_reconnects_after_a_restart_spread_over_time() {
    let mut a = Appliance::start_cfg("file", &[], |c| {
        c.replace("heartbeat_seconds = 15", "heartbeat_seconds = 1")
    });
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({"maxUses": 4}));
    let dirs: Vec<PathBuf> = (0..4).map(|_| joined_agent_dir(&a, &token)).collect();
    let mut agents: Vec<Child> = dirs.iter().map(|d| agent_run(d)).collect();
    wait_for("4 connected nodes", 20, || {
        (connected(&a) == 4).then_some(())
    });
    let identities: Vec<Vec<u8>> = dirs
        .iter()
        .map(|d| std::fs::read(d.join("data/identity.json")).unwrap())
        .collect();
    a.restart();
    let restarted = bca::base::clock::now_ms();
    wait_for("4 reconnected nodes", 30, || {
        (connected(&a) == 4).then_some(())
    });
    for c in &mut agents {
        let _ = c.kill();
    }
    // Each agent logged its sessions; the reconnects after the restart are spread by jitter.
    let mut reconnects = Vec::new();
    let mut delays = Vec::new();
    for c in agents {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stderr);
        let opens: Vec<Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["fields"]["message"] == "session open")
            .collect();
        assert!(opens.len() >= 2, "an agent did not reconnect: {text}");
        // The first session made a full handshake; after the restart the agent resumed it with
        // the gateway's ticket (its identity unchanged).
        assert_eq!(opens[0]["fields"]["resumed"], false, "{text}");
        assert_eq!(opens.last().unwrap()["fields"]["resumed"], true, "{text}");
        let t = time::OffsetDateTime::parse(
            opens.last().unwrap()["timestamp"].as_str().unwrap(),
            &time::format_description::well_known::Rfc3339,
        )
        .unwrap();
        reconnects.push((t.unix_timestamp_nanos() / 1_000_000) as i64 - restarted);
        assert!(text.contains("session lost; reconnecting"), "{text}");
        // The jitter itself: the delay each agent chose before its first reconnect. (When the
        // agents reach the gateway is a poor measure of it: their hellos can land in one group
        // commit of the JoinService and be welcomed together.)
        let first_delay = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["fields"]["message"] == "session lost; reconnecting")
            .and_then(|v| v["fields"]["delay_ms"].as_i64())
            .unwrap_or_else(|| panic!("no reconnect delay logged: {text}"));
        delays.push(first_delay);
    }
    reconnects.sort();
    delays.sort();
    eprintln!("reconnect times after the restart (ms): {reconnects:?}; first delays: {delays:?}");
    assert!(
        delays.last().unwrap() - delays.first().unwrap() >= 20,
        "every node chose the same reconnect delay: {delays:?}"
    );
    // No identity was lost or changed by the restart.
    for (d, before) in dirs.iter().zip(identities) {
        assert_eq!(std::fs::read(d.join("data/identity.json")).unwrap(), before);
    }
}

#[test]
fn agent_run_renews_at_sixty_percent_and_a_crash_mid_write_leaves_a_loadable_identity() {
    let a = Appliance::start_cfg("file", &[], |c| {
        c.replace("cert_ttl_seconds = 86400", "cert_ttl_seconds = 10")
            .replace("heartbeat_seconds = 15", "heartbeat_seconds = 1")
    });
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({}));
    let dir = joined_agent_dir(&a, &token);
    let data = dir.join("data");
    let first = std::fs::read(data.join("identity.json")).unwrap();
    let mut agent = agent_run(&dir);
    // 60% of 10 s (1 s of it set back) after notBefore: the renewal comes within seconds.
    wait_for("a renewal", 20, || {
        ({ a.count("SELECT count(*) FROM node_certs") >= 2 }).then_some(())
    });
    wait_for("the renewed identity on disk", 10, || {
        ({ std::fs::read(data.join("identity.json")).unwrap() != first }).then_some(())
    });
    wait_for("the renewed session", 10, || {
        (connected(&a) == 1).then_some(())
    });
    let _ = agent.kill();
    let out = agent.wait_with_output().unwrap();
    // The session after the renewal is a new identity's: a full handshake, not the old ticket's.
    let text = String::from_utf8_lossy(&out.stderr);
    let logged: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect();
    let renewed = logged
        .iter()
        .position(|v| v["fields"]["message"] == "renewed")
        .unwrap_or_else(|| panic!("no renewal logged: {text}"));
    let after = logged[renewed..]
        .iter()
        .find(|v| v["fields"]["message"] == "session open")
        .unwrap_or_else(|| panic!("no session after the renewal: {text}"));
    assert_eq!(after["fields"]["resumed"], false, "{text}");
    let loaded = bca::agent::run::load_identity(&data).unwrap();
    assert_eq!(
        bca::proto::x509::parse_node_leaf(&loaded.chain_der[0])
            .unwrap()
            .public_point,
        loaded.key.public_point()
    );
    assert!(!data.join("node.key.next").exists());

    // A crash between writing identity.json and renaming node.key.next: the loader finishes it.
    let cur = bca::agent::run::load_identity(&data).unwrap();
    let old_key = std::fs::read(data.join("node.key")).unwrap();
    let cfg = AgentConfig::load(&dir.join("config.toml")).unwrap();
    rt().block_on(async {
        let mut s = bca::agent::connect_as(&cfg, cur.chain_der.clone(), &cur.key)
            .await
            .unwrap();
        bca::agent::run::renew(&cfg, &data, &cur, &mut s)
            .await
            .unwrap();
    });
    std::fs::rename(data.join("node.key"), data.join("node.key.next")).unwrap();
    std::fs::write(data.join("node.key"), &old_key).unwrap();
    let l = bca::agent::run::load_identity(&data).unwrap();
    assert_eq!(
        bca::proto::x509::parse_node_leaf(&l.chain_der[0])
            .unwrap()
            .public_point,
        l.key.public_point()
    );
    assert!(!data.join("node.key.next").exists());
    // A crash after writing only node.key.next: the old identity still loads.
    let before = std::fs::read(data.join("identity.json")).unwrap();
    std::fs::write(data.join("node.key.next"), b"half-written").unwrap();
    let l = bca::agent::run::load_identity(&data).unwrap();
    assert_eq!(std::fs::read(data.join("identity.json")).unwrap(), before);
    assert_eq!(
        bca::proto::x509::parse_node_leaf(&l.chain_der[0])
            .unwrap()
            .public_point,
        l.key.public_point()
    );
}

#[test]
fn doctor_checks_config_identity_gateway_and_clock() {
    let mut a = Appliance::start();
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({}));
    let dir = joined_agent_dir(&a, &token);
    let doctor = |dir: &Path| {
        Command::new(bin())
            .args(["agent", "doctor", "--config"])
            .arg(dir.join("config.toml"))
            .arg("--data-dir")
            .arg(dir.join("data"))
            .output()
            .unwrap()
    };
    let o = doctor(&dir);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{text}");
    for check in [
        "ok   config",
        "ok   pins",
        "ok   identity",
        "ok   gateway",
        "ok   clock",
        // No TPM on this machine (CI has none at /dev/tpmrm0): not a failure for a token join.
        "ok   tpm: none at /dev/tpmrm0",
    ] {
        assert!(text.contains(check), "{check}: {text}");
    }
    // The appliance down: the gateway check fails (the expired case has a test of its own).
    a.stop();
    let o = doctor(&dir);
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(text.contains("FAIL gateway"), "{text}");
    // Not joined.
    let fresh = a.dir.path().join("fresh");
    std::fs::create_dir_all(&fresh).unwrap();
    std::fs::copy(dir.join("config.toml"), fresh.join("config.toml")).unwrap();
    std::fs::copy(
        dir.join("join-encryption.jwk"),
        fresh.join("join-encryption.jwk"),
    )
    .unwrap();
    let o = doctor(&fresh);
    assert!(String::from_utf8_lossy(&o.stdout)
        .contains("FAIL identity: not joined: run bca agent join"));
}

#[test]
fn doctor_reports_an_expired_certificate_with_the_way_back() {
    let a = Appliance::start_cfg("file", &[], |c| {
        c.replace("cert_ttl_seconds = 86400", "cert_ttl_seconds = 10")
    });
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({}));
    let dir = joined_agent_dir(&a, &token);
    std::thread::sleep(Duration::from_secs(11));
    let o = Command::new(bin())
        .args(["agent", "doctor", "--config"])
        .arg(dir.join("config.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        text.contains("FAIL identity: the certificate expired at "),
        "{text}"
    );
    assert!(
        text.contains("; join again as root: bca agent join --reset --yes, then bca agent join"),
        "{text}"
    );
    // `agent run` refuses to start on it with the same message.
    let o = Command::new(bin())
        .args(["agent", "run", "--config"])
        .arg(dir.join("config.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("the certificate expired at"));
}

/// Connects under `tls` and says hello: (how the handshake went, the answer, the stream).
fn hello_with(
    rt: &tokio::runtime::Runtime,
    cfg: &AgentConfig,
    tls: &std::sync::Arc<rustls::ClientConfig>,
) -> (
    Option<rustls::HandshakeKind>,
    Reply,
    bca::agent::GatewayStream,
) {
    rt.block_on(async {
        let mut s = bca::agent::connect_with(cfg, tls.clone()).await.unwrap();
        let kind = s.get_ref().1.handshake_kind();
        let req = Request {
            v: 1,
            hello: Some(Hello::default()),
            ..Default::default()
        };
        let raw = bca::agent::roundtrip(cfg, &mut s, &serde_json::to_vec(&req).unwrap())
            .await
            .unwrap();
        (kind, serde_json::from_slice::<Reply>(&raw).unwrap(), s)
    })
}

/// `openssl s_client` as node `n`, sending one frame that the gateway answers and closes after;
/// the session is written to (or read from) `sess`. Its output.
fn s_client_as(a: &Appliance, n: &Node, dir: &Path, sess: (&str, &Path)) -> String {
    std::fs::write(dir.join("leaf.pem"), &n.chain_pem[0]).unwrap();
    std::fs::write(
        dir.join("leaf.key"),
        bca::proto::x509::pem("PRIVATE KEY", n.key.pkcs8()),
    )
    .unwrap();
    // A ping outside a session: answered with a pong, then the connection is closed.
    let body = br#"{"v":1,"ping":{}}"#;
    let mut frame = (body.len() as u32).to_be_bytes().to_vec();
    frame.extend_from_slice(body);
    std::fs::write(dir.join("frame"), frame).unwrap();
    let o = Command::new("openssl")
        .args([
            "s_client", "-connect", &a.gateway, "-alpn", "bca/1", "-ign_eof",
        ])
        .arg("-cert")
        .arg(dir.join("leaf.pem"))
        .arg("-key")
        .arg(dir.join("leaf.key"))
        .arg(sess.0)
        .arg(sess.1)
        .stdin(std::fs::File::open(dir.join("frame")).unwrap())
        .output()
        .unwrap();
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// A node resumes its session after the appliance restarts, with the ticket of its last full
/// handshake (sealed under a key derived from the node CA, so no restart forgets it); openssl
/// resumes the same way. A resumed connection is no shortcut past revocation: the node's hello
/// is refused as after a full handshake.
#[test]
fn a_node_resumes_its_session_after_a_restart_and_a_revoked_one_is_still_refused() {
    let mut a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({"maxUses": 1}));
    let n = join_node(&sim, &token, &machine());
    let tls = std::sync::Arc::new(
        bca::agent::tlsclient::client_config_with(
            &sim.cfg.serving_ca_spki_pin,
            Some((n.chain_der.clone(), n.key.pkcs8())),
        )
        .unwrap(),
    );
    let rt = rt();
    let (kind, r, s) = hello_with(&rt, &sim.cfg, &tls);
    assert_eq!(kind, Some(rustls::HandshakeKind::Full));
    assert!(r.welcome.is_some(), "{r:?}");
    assert_eq!(s.get_ref().1.tls13_tickets_received(), 1);
    // A join's connection asks for no ticket (RFC 9149) and gets none.
    let ping = serde_json::to_vec(&Request {
        v: 1,
        ping: Some(Empty {}),
        ..Default::default()
    })
    .unwrap();
    let join_like = rt.block_on(async {
        let mut j = bca::agent::connect(&sim.cfg, None).await.unwrap();
        let raw = bca::agent::roundtrip(&sim.cfg, &mut j, &ping)
            .await
            .unwrap();
        assert!(serde_json::from_slice::<Reply>(&raw)
            .unwrap()
            .pong
            .is_some());
        j.get_ref().1.tls13_tickets_received()
    });
    assert_eq!(join_like, 0);
    let dir = tempfile::tempdir().unwrap();
    let sess = dir.path().join("openssl.session");
    let out = s_client_as(&a, &n, dir.path(), ("-sess_out", &sess));
    assert!(out.contains("New, TLSv1.3"), "{out}");
    assert!(out.contains(r#""pong":{"serverTime""#), "{out}");
    drop(s);

    a.restart();
    let (kind, r, s) = hello_with(&rt, &sim.cfg, &tls);
    assert_eq!(kind, Some(rustls::HandshakeKind::Resumed));
    assert_eq!(r.welcome.map(|w| w.node_id), Some(n.id.clone()));
    // And a new ticket for the next time (the one it used is spent).
    assert_eq!(s.get_ref().1.tls13_tickets_received(), 1);
    wait_for("the resumed session", 5, || {
        (connected(&a) == 1).then_some(())
    });
    let out = s_client_as(&a, &n, dir.path(), ("-sess_in", &sess));
    assert!(out.contains("Reused, TLSv1.3"), "{out}");

    // Revoked: the live session ends, and a resumed connection's hello is refused.
    a.cli_json(&["nodes", "revoke-identity", &n.id]);
    drop(s);
    let (kind, r, _s) = hello_with(&rt, &sim.cfg, &tls);
    assert_eq!(kind, Some(rustls::HandshakeKind::Resumed));
    assert_eq!(r.error.unwrap().message, "Session refused");
    assert_eq!(connected(&a), 0);
}

/// A tenant's pool and a token for it: (tenant, bearer).
fn tenant_token(a: &Appliance, name: &str) -> (String, String) {
    let t = a.api_ok("tenants/create", json!({"name": name}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let pool = a.api_ok("pools/create", json!({"tenantId": t, "name": name}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (_, token) = a.token(&pool, json!({"tenantId": t}));
    (t, token)
}

fn tenant_events(a: &Appliance, tenant: &str) -> i64 {
    a.db()
        .query_row(
            "SELECT count(*) FROM events WHERE tenant_id = ?1",
            [tenant],
            |r| r.get(0),
        )
        .unwrap()
}

/// The caller is proven before the request is believed: a real node of tenant A that presents a
/// leaf naming tenant B's node (self-signed with its own key, or B's real certificate copied) and
/// signs the proof with its own key is refused, and the event goes to the root tenant with no
/// node named: B's stream is untouched.
#[test]
fn a_node_forging_another_tenants_leaf_writes_nothing_into_that_tenants_stream() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let (ta, token_a) = tenant_token(&a, "tenant-a");
    let (tb, token_b) = tenant_token(&a, "tenant-b");
    let na = join_node(&sim, &token_a, &machine());
    let nb = join_node(&sim, &token_b, &machine());
    let b_events = tenant_events(&a, &tb);
    let a_events = tenant_events(&a, &ta);
    let now = bca::base::clock::now();

    // A self-signed leaf with B's SPIFFE ID and A's key; the proof names B's node.
    let b_leaf = bca::proto::x509::parse_node_leaf(&nb.chain_der[0]).unwrap();
    let mut lp = rcgen::CertificateParams::default();
    lp.subject_alt_names = vec![rcgen::SanType::URI(
        b_leaf.spiffe_id.clone().try_into().unwrap(),
    )];
    let forged = lp.self_signed(&na.key.rcgen()).unwrap();
    let (raw, _) = renew_raw(&sim.cfg, &na, &[forged.pem()], &nb.id, &na.key, now);
    assert_eq!(raw, renew_refused());
    let (tenant, ev) = a.last_event("security.renew.refused").unwrap();
    assert_eq!(ev["reason"], "renew:identity");
    assert_eq!(tenant, a.root_tenant());
    assert_eq!(ev["nodeId"], Value::Null);

    // B's real certificate, copied, with a proof by A's key.
    let (raw, _) = renew_raw(&sim.cfg, &na, &nb.chain_pem, &nb.id, &na.key, now);
    assert_eq!(raw, renew_refused());
    let (tenant, ev) = a.last_event("security.renew.refused").unwrap();
    assert_eq!(ev["reason"], "renew:identity");
    assert_eq!(tenant, a.root_tenant());
    assert_eq!(ev["nodeId"], Value::Null);

    // A's own certificate with a proof by another key: the certificate is stored, the proof
    // fails, so the caller proved nothing and the event is the root tenant's.
    let (raw, _) = renew_raw(
        &sim.cfg,
        &na,
        &na.chain_pem,
        &na.id,
        &SigningKey::generate(),
        now,
    );
    assert_eq!(raw, renew_refused());
    let (tenant, ev) = a.last_event("security.renew.refused").unwrap();
    assert_eq!(ev["reason"], "renew:pop");
    assert_eq!(tenant, a.root_tenant());
    assert_eq!(ev["nodeId"], Value::Null);

    assert_eq!(
        tenant_events(&a, &tb),
        b_events,
        "tenant B's stream changed"
    );
    assert_eq!(tenant_events(&a, &ta), a_events);

    // A's own proof of its current key, with a clock a minute off: now the caller is proven and
    // the refusal is A's own.
    let (raw, _) = renew_raw(&sim.cfg, &na, &na.chain_pem, &na.id, &na.key, now - 61);
    assert_eq!(raw, renew_refused());
    let (tenant, ev) = a.last_event("security.renew.refused").unwrap();
    assert_eq!(ev["reason"], "renew:clock");
    assert_eq!(tenant, ta);
    assert_eq!(ev["nodeId"], json!(na.id));
    // And a good renewal of A's is A's.
    let (raw, _) = renew_raw(&sim.cfg, &na, &na.chain_pem, &na.id, &na.key, now);
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    assert!(
        reply.renew_response.is_some(),
        "{}",
        String::from_utf8_lossy(&raw)
    );
    assert_eq!(a.last_event("node.renewed").unwrap().0, ta);
    assert_eq!(
        tenant_events(&a, &tb),
        b_events,
        "tenant B's stream changed"
    );
}
