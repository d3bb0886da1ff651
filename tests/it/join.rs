//! The join: end to end with the real agent, every refusal reason on the wire, concurrency,
//! reclaims, and josekit as the JWE oracle.

use crate::common::*;
use bca::base::crypto::{self, SigningKey};
use bca::proto::agent_config::AgentConfig;
use bca::proto::protocol::{JoinRequest, Reply, Request};
use serde_json::{json, Value};
use std::process::Command;

#[test]
fn end_to_end_join_with_the_agent_and_openssl() {
    let a = Appliance::start();
    let pool = a.pool("rack-a");
    let (rec, token) = a.token(&pool, json!({"maxUses": 2, "expect": {"serial": "sn-1"}}));
    let dir = a.agent_dir();
    assert_eq!(
        std::fs::metadata(dir.join("config.toml"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    assert_eq!(
        std::fs::metadata(dir.join("join-encryption.jwk"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o644
    );
    let claims = write_claims(
        &a,
        &json!({"productUuid": "4C4C4544-004D-3610-804A-B4C04F564433", "serials": {"product": "SN-1"}, "hostname": "m1"}),
    );
    let out = agent_join(&dir, "data", &claims, &token, &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let node_id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(node_id.starts_with("node_"));
    let data = dir.join("data");
    for f in ["identity.json", "node.key"] {
        assert_eq!(
            std::fs::metadata(data.join(f))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o600,
            "{f}"
        );
    }
    let identity: Value =
        serde_json::from_slice(&std::fs::read(data.join("identity.json")).unwrap()).unwrap();
    assert_eq!(identity["nodeId"], json!(node_id));
    let chain = identity["certificateChain"].as_array().unwrap();
    std::fs::write(a.dir.path().join("leaf.pem"), chain[0].as_str().unwrap()).unwrap();
    // openssl verifies the chain to the node CA, for client auth.
    let v = Command::new("openssl")
        .args(["verify", "-purpose", "sslclient", "-CAfile"])
        .arg(a.state().join("pki/node-ca.pem"))
        .arg(a.dir.path().join("leaf.pem"))
        .output()
        .unwrap();
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stderr));
    let text = Command::new("openssl")
        .args(["x509", "-noout", "-text", "-in"])
        .arg(a.dir.path().join("leaf.pem"))
        .output()
        .unwrap();
    let text = String::from_utf8(text.stdout).unwrap();
    let site: String = a
        .db()
        .query_row("SELECT id FROM site", [], |r| r.get(0))
        .unwrap();
    let spiffe = format!("URI:spiffe://compute.example.com/site/{site}/node/{node_id}");
    assert_eq!(text.matches("URI:").count(), 1, "{text}");
    assert!(text.contains(&spiffe), "{text}");
    assert!(text.contains("Subject: OU = bc-role:node"), "{text}");
    assert!(text.contains("TLS Web Client Authentication"), "{text}");
    assert!(text.contains("ASN1 OID: prime256v1"), "{text}");
    assert!(!text.contains("tn_"), "a tenant appears in the certificate");
    assert!(!text.contains("1.3.6.1.4.1"), "a private-arc OID appears");
    // The node key in node.key is the certified key.
    let k = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl pkey -in {} -pubout | openssl pkey -pubin -outform DER | sha256sum",
            data.join("node.key").display()
        ))
        .output()
        .unwrap();
    let c = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl x509 -in {} -pubkey -noout | openssl pkey -pubin -outform DER | sha256sum",
            a.dir.path().join("leaf.pem").display()
        ))
        .output()
        .unwrap();
    assert_eq!(k.stdout, c.stdout);
    // The lifetime is certTtlSeconds (a day by default), the back-dating included.
    let nb: i64 = a
        .db()
        .query_row("SELECT not_after - not_before FROM node_certs", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(nb, 86_400);
    // Rows, events, audit.
    assert_eq!(a.uses_left(rec["id"].as_str().unwrap()), 1);
    let node = a.cli_json(&["nodes", "get", &node_id]);
    assert_eq!(node["state"], "adopted");
    assert_eq!(node["identityGeneration"], 1);
    assert_eq!(node["hostname"], "m1");
    assert_eq!(node["certificates"].as_array().unwrap().len(), 1);
    let (_, joined) = a.last_event("node.joined").unwrap();
    assert_eq!(joined["attestor"], "join-token");
    assert_eq!(joined["reclaim"], false);
    assert_eq!(joined["hardwareKeyTrusted"], true);
    assert_eq!(joined["nodeKey"], "unattested");
    assert_eq!(
        joined["certificateSerial"],
        node["certificates"][0]["serial"]
    );
    assert!(a.last_event("node.adopted").is_some());
    let (action, actor): (String, String) = a
        .db()
        .query_row(
            "SELECT action, actor FROM audit WHERE target = ?1",
            [&node_id],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!(action, "node.joined");
    assert!(actor.starts_with("join-token:jt_"));
    // Joining again: already joined, nothing spent.
    let again = agent_join(&dir, "data", &claims, &token, &[]);
    assert!(again.status.success());
    assert!(String::from_utf8_lossy(&again.stdout).contains("already joined"));
    assert_eq!(a.uses_left(rec["id"].as_str().unwrap()), 1);
    // --reset without --yes is refused; with it the old files are renamed and a new join runs
    // (here a reclaim without allowReclaim: refused, and the token keeps its use).
    let o = agent_join(&dir, "data", &claims, &token, &["--reset"]);
    assert_eq!(o.status.code(), Some(1));
    let o = agent_join(&dir, "data", &claims, &token, &["--reset", "--yes"]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&o.stderr).trim(),
        "ACCESS_DENIED: Join refused"
    );
    let names: Vec<String> = std::fs::read_dir(&data)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("identity.json.reset-")),
        "{names:?}"
    );
    assert_eq!(a.uses_left(rec["id"].as_str().unwrap()), 1);
}

#[test]
fn the_agent_refuses_bad_tokens_and_configs_locally() {
    let a = Appliance::start();
    let dir = a.agent_dir();
    let claims = write_claims(&a, &machine());
    for bad in ["hello", "bcjt_ with space", ""] {
        let o = agent_join(&dir, "data", &claims, bad, &[]);
        assert_eq!(o.status.code(), Some(1));
        assert!(
            String::from_utf8_lossy(&o.stderr)
                .starts_with("INVALID_INPUT: the join token must look like bcjt_"),
            "{bad:?}"
        );
    }
    // A join-encryption.jwk that does not match the pin is refused before anything is sent.
    let other = SigningKey::generate();
    std::fs::write(
        dir.join("join-encryption.jwk"),
        serde_json::to_string(&bca::proto::jwe::jwk(other.public_point())).unwrap(),
    )
    .unwrap();
    let o = agent_join(&dir, "data", &claims, "bcjt_x.y", &[]);
    assert!(
        String::from_utf8_lossy(&o.stderr).starts_with("INVALID_CONFIG:"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // A config with a bad pin.
    let cfg = std::fs::read_to_string(dir.join("config.toml")).unwrap();
    std::fs::write(
        dir.join("config.toml"),
        cfg.replace(
            "serving_ca_spki_pin = \"sha256/",
            "serving_ca_spki_pin = \"sha1/",
        ),
    )
    .unwrap();
    let o = agent_join(&dir, "data", &claims, "bcjt_x.y", &[]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("serving_ca_spki_pin"));
    // agent-config never writes over files.
    let o = a.cli(&[
        "daemon",
        "agent-config",
        "--gateway-url",
        "https://x",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).starts_with("ALREADY_EXISTS"));
}

#[test]
fn a_gateway_not_under_the_pinned_ca_is_refused_by_the_agent() {
    let a = Appliance::start();
    let b = Appliance::start();
    let sim = Sim::new(&a);
    // Point a's agent at b's gateway: b's serving CA does not hash to a's pin.
    let mut cfg = sim.cfg.clone();
    cfg.gateway_url = format!("https://{}", b.gateway);
    let e = bca::agent::exchange_raw(&cfg, b"{}").unwrap_err();
    assert!(e.message.contains("TLS"), "{e}");
    // The right gateway under a name its certificate does not carry is refused too.
    let mut cfg = sim.cfg.clone();
    cfg.server_name = Some("gw.elsewhere.example".into());
    let e = bca::agent::exchange_raw(&cfg, b"{}").unwrap_err();
    assert!(e.message.contains("TLS"), "{e}");
}

/// One test per refusal reason: identical bytes to the agent, the reason recorded, the token
/// unchanged.
#[test]
fn every_refusal_reason_is_the_same_on_the_wire() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let root = a.root_tenant();
    let pool = a.pool("rack-a");
    let refused = refused_bytes();
    assert_eq!(
        String::from_utf8_lossy(&refused),
        r#"{"v":1,"error":{"code":"ACCESS_DENIED","message":"Join refused"}}"#
    );

    // (reason, the tenant the event goes to, the token whose uses must not change)
    let check = |raw: &[u8], reason: &str, tenant: &str, token_id: Option<&str>, uses: i64| {
        assert_eq!(
            raw,
            refused.as_slice(),
            "{reason}: {}",
            String::from_utf8_lossy(raw)
        );
        let (t, ev) = a.last_event("security.join.refused").unwrap();
        assert_eq!(ev["reason"], reason);
        assert_eq!(ev["attestor"], "join-token");
        assert_eq!(t, tenant, "{reason} went to the wrong tenant");
        assert!(
            ev["csrSha256"].as_str().is_some_and(|h| h.len() == 64),
            "{reason}: {ev}"
        );
        assert!(ev.get("suppressed").is_some());
        let text = ev.to_string();
        assert!(!text.contains("bcjt_"), "a token leaked into the event");
        if let Some(id) = token_id {
            assert_eq!(a.uses_left(id), uses, "{reason} consumed the token");
        }
    };

    let (rec, token) = a.token(&pool, json!({"maxUses": 2}));
    let id = rec["id"].as_str().unwrap();

    // malformed: not a bearer token at all.
    let (raw, _, _) = sim.join("hello", &machine());
    check(&raw, "join-token:malformed", &root, Some(id), 2);
    // unknown: well formed, no such token.
    let unknown = format!(
        "bcjt_jt_0123456789abcdefghjkmnpqrs.{}",
        crypto::b64url(&[1u8; 32])
    );
    let (raw, _, _) = sim.join(&unknown, &machine());
    check(&raw, "join-token:unknown", &root, Some(id), 2);
    // secret-mismatch: our id, another secret; the event stays with the root tenant.
    let t2 = a.api_ok("tenants/create", json!({"name": "acme"}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let pool2 = a.api_ok("pools/create", json!({"tenantId": t2, "name": "p2"}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let r2 = a.api_ok(
        "joinTokens/create",
        json!({"tenantId": t2, "poolId": pool2, "ttlSeconds": 600, "idempotencyKey": "x"}),
    );
    let id2 = r2["id"].as_str().unwrap();
    let wrong = format!("bcjt_{id2}.{}", crypto::b64url(&[2u8; 32]));
    let (raw, _, _) = sim.join(&wrong, &machine());
    check(&raw, "join-token:secret-mismatch", &root, Some(id2), 1);
    // role-mismatch: a join-token admits role node only; the event goes to the token's tenant.
    let tok2 = r2["token"].as_str().unwrap();
    let (raw, _, _) = sim.join_with(tok2, &machine(), "ramdisk", None, bca::base::clock::now());
    check(&raw, "join-token:role-mismatch", &t2, Some(id2), 1);
    // token: sealed for another CSR, or too old.
    let (raw, _, _) = sim.join_with(
        &token,
        &machine(),
        "node",
        Some(b"another csr"),
        bca::base::clock::now(),
    );
    check(&raw, "join:token", &root, Some(id), 2);
    let (raw, _, _) = sim.join_with(
        &token,
        &machine(),
        "node",
        None,
        bca::base::clock::now() - 3600,
    );
    check(&raw, "join:token", &root, Some(id), 2);
    // expect.
    let (erec, etok) = a.token(&pool, json!({"expect": {"serial": "SN-EXPECTED"}}));
    let (raw, _, _) = sim.join(&etok, &machine());
    check(&raw, "join:expect", &root, erec["id"].as_str(), 1);
    // placeholder-hardware.
    let placeholder = json!({"productUuid": "00000000-0000-0000-0000-000000000000", "serials": {"product": "To Be Filled By O.E.M.", "board": "Default string"}, "macs": ["00:1b:21:00:00:01"]});
    let (raw, _, _) = sim.join(&token, &placeholder);
    check(&raw, "join:placeholder-hardware", &root, Some(id), 2);
    // reclaim: a known machine with a token without allowReclaim.
    let m = machine();
    sim.admitted(&token, &m);
    let (raw, _, _) = sim.join(&token, &m);
    check(&raw, "join:reclaim", &root, Some(id), 1);
    // exhausted.
    sim.admitted(&token, &machine());
    let (raw, _, _) = sim.join(&token, &machine());
    check(&raw, "join-token:exhausted", &root, Some(id), 0);
    // revoked.
    let (rrec, rtok) = a.token(&pool, json!({}));
    a.api_ok(
        "joinTokens/revoke",
        json!({"tenantId": root, "poolId": pool, "tokenId": rrec["id"]}),
    );
    let (raw, _, _) = sim.join(&rtok, &machine());
    check(&raw, "join-token:revoked", &root, rrec["id"].as_str(), 1);
    // expired (the clock is the appliance's: move the token's expiry into the past).
    let (xrec, xtok) = a.token(&pool, json!({}));
    a.live().execute(
        "UPDATE join_tokens SET expires_at = expires_at - 7200 WHERE id = ?1",
        &[xrec["id"].as_str().unwrap()],
    );
    let (raw, _, _) = sim.join(&xtok, &machine());
    check(&raw, "join-token:expired", &root, xrec["id"].as_str(), 1);
    // pool: archived after the token was minted.
    let pool3 = a.pool("rack-c");
    let (prec, ptok) = a.token(&pool3, json!({}));
    a.api_ok("pools/archive", json!({"tenantId": root, "poolId": pool3}));
    let (raw, _, _) = sim.join(&ptok, &machine());
    check(&raw, "join:pool", &root, prec["id"].as_str(), 1);
    // pool: the pool's machines run no daemon any more.
    let pool4 = a.pool("rack-d");
    let (nrec, ntok) = a.token(&pool4, json!({}));
    a.api_ok(
        "pools/update",
        json!({"tenantId": root, "poolId": pool4, "agent": "none"}),
    );
    let (raw, _, _) = sim.join(&ntok, &machine());
    check(&raw, "join:pool", &root, nrec["id"].as_str(), 1);
    // pool-attestor: the pool stops listing join-token.
    let pool5 = a.pool("rack-e");
    let (arec, atok) = a.token(&pool5, json!({}));
    a.api_ok(
        "pools/update",
        json!({"tenantId": root, "poolId": pool5, "policy": {"joinAttestors": ["tpm"]}}),
    );
    let (raw, _, _) = sim.join(&atok, &machine());
    check(&raw, "join:pool-attestor", &root, arec["id"].as_str(), 1);
    // (tenant and site cannot be reached on a one-site box: admission's unit tests cover them.)

    // Nothing was admitted by any refusal: two nodes only.
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 2);
    // No secret in the database or the log of events.
    let dump = a.db_bytes();
    let secret = token.split('.').nth(1).unwrap();
    assert!(!dump.windows(secret.len()).any(|w| w == secret.as_bytes()));
}

#[test]
fn malformed_requests_get_clear_errors() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let reply = |body: &[u8]| -> Value {
        serde_json::from_slice(&bca::agent::exchange_raw(&sim.cfg, body).unwrap()).unwrap()
    };
    let r = reply(b"not json");
    assert_eq!(r["error"]["code"], "INVALID_INPUT");
    let r = reply(br#"{"v": 9, "join": null}"#);
    assert!(r["error"]["message"]
        .as_str()
        .unwrap()
        .contains("protocol version 9"));
    let r = reply(br#"{"v": 1}"#);
    assert_eq!(r["error"]["code"], "INVALID_INPUT");
    // A bad CSR is a refusal like any other.
    let req = json!({"v": 1, "join": {"sealedToken": "x", "csr": "AAAA", "role": "node"}});
    let raw = bca::agent::exchange_raw(&sim.cfg, req.to_string().as_bytes()).unwrap();
    assert_eq!(raw, refused_bytes());
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "join:csr"
    );
}

#[test]
fn a_reclaim_keeps_the_node_id_and_revokes_the_old_certificate() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let m = machine();
    let (_, t1) = a.token(&pool, json!({}));
    let first = sim.admitted(&t1, &m);
    let old_serial: String = a
        .db()
        .query_row("SELECT serial FROM node_certs", [], |r| r.get(0))
        .unwrap();
    let (rrec, t2) = a.token(&pool, json!({"allowReclaim": true}));
    // The same machine with a new key (a reinstall), with MACs in another spelling.
    let mut m2 = m.clone();
    m2["macs"] = json!([m["macs"][0]
        .as_str()
        .unwrap()
        .to_uppercase()
        .replace(':', "-")]);
    let second = sim.admitted(&t2, &m2);
    assert_eq!(second.node_id, first.node_id);
    assert_eq!(a.uses_left(rrec["id"].as_str().unwrap()), 0);
    let node = a.cli_json(&["nodes", "get", &first.node_id]);
    assert_eq!(node["identityGeneration"], 2);
    let certs = node["certificates"].as_array().unwrap();
    assert_eq!(certs.len(), 2);
    let old = certs
        .iter()
        .find(|c| c["serial"] == json!(old_serial))
        .unwrap();
    assert_eq!(old["revokeReason"], "reclaimed");
    let (_, ev) = a.last_event("security.certificate-revoked").unwrap();
    assert_eq!(ev["serial"], json!(old_serial));
    assert_eq!(ev["reason"], "reclaimed");
    let (_, joined) = a.last_event("node.joined").unwrap();
    assert_eq!(joined["reclaim"], true);
    let action: String = a
        .db()
        .query_row(
            "SELECT action FROM audit WHERE target = ?1 ORDER BY seq DESC LIMIT 1",
            [&first.node_id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(action, "node.reclaimed");
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 1);

    // A retired node cannot reclaim; a deleted one frees its hardware key: the machine joins anew.
    a.cli_json(&["nodes", "retire", &first.node_id]);
    let (_, t3) = a.token(&pool, json!({"allowReclaim": true}));
    let (raw, _, _) = sim.join(&t3, &m);
    assert_eq!(raw, refused_bytes());
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "join:reclaim"
    );
    let (code, _) = a.cli_err(&["nodes", "delete", &first.node_id]);
    assert_eq!(code, "INVALID_INPUT");
    a.cli_json(&["nodes", "delete", &first.node_id, "--yes"]);
    let third = sim.admitted(&t3, &m);
    assert_ne!(third.node_id, first.node_id);
    // revoke-identity revokes every live certificate.
    let v = a.cli_json(&["nodes", "revoke-identity", &third.node_id]);
    assert!(v["certificates"]
        .as_array()
        .unwrap()
        .iter()
        .all(|c| c["revokeReason"] == "revoked"));
    let (code, _) = a.cli_err(&["nodes", "get", "node_0123456789abcdefghjkmnpqrs"]);
    assert_eq!(code, "NOT_FOUND");
    let (code, _) = a.cli_err(&["nodes", "get", "nonsense"]);
    assert_eq!(code, "INVALID_INPUT");
}

#[test]
fn hosted_tokens_make_tenant_controlled_nodes() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("k8s");
    let (_, tok) = a.token(&pool, json!({"hosted": "kubernetes"}));
    let body = sim.admitted(&tok, &machine());
    assert_eq!(body.role, "node-tenant");
    let node = a.cli_json(&["nodes", "get", &body.node_id]);
    assert_eq!(
        (node["trust"].as_str(), node["role"].as_str()),
        (Some("tenant-controlled"), Some("node-tenant"))
    );
    let (_, ev) = a.last_event("security.join-token.created").unwrap();
    assert_eq!(ev["hosted"], "kubernetes");
}

#[test]
fn fifty_agents_racing_on_ten_uses_make_ten_nodes() {
    let a = Appliance::start();
    let sim = std::sync::Arc::new(Sim::new(&a));
    let pool = a.pool("rack-a");
    let (rec, token) = a.token(&pool, json!({"maxUses": 10}));
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(50));
    let handles: Vec<_> = (0..50)
        .map(|_| {
            let (sim, token, barrier) = (sim.clone(), token.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let (raw, _, _) = sim.join(&token, &machine());
                serde_json::from_slice::<Reply>(&raw)
                    .unwrap()
                    .join_response
                    .is_some()
            })
        })
        .collect();
    let admitted = handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .filter(|x| *x)
        .count();
    assert_eq!(admitted, 10);
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 10);
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), 10);
    assert_eq!(a.uses_left(rec["id"].as_str().unwrap()), 0);
}

#[test]
fn two_joins_of_one_machine_racing_give_one_node_and_one_conflict() {
    let a = Appliance::start();
    let sim = std::sync::Arc::new(Sim::new(&a));
    let pool = a.pool("rack-a");
    let mut conflicts = 0;
    for round in 0..10 {
        let (_, token) = a.token(&pool, json!({"maxUses": 2, "allowReclaim": true}));
        let m = machine();
        let barrier = std::sync::Arc::new(std::sync::Barrier::new(2));
        let hs: Vec<_> = (0..2)
            .map(|_| {
                let (sim, token, m, barrier) =
                    (sim.clone(), token.clone(), m.clone(), barrier.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    serde_json::from_slice::<Reply>(&sim.join(&token, &m).0).unwrap()
                })
            })
            .collect();
        let replies: Vec<Reply> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let ok = replies.iter().filter(|r| r.join_response.is_some()).count();
        let conflict = replies
            .iter()
            .filter(|r| r.error.as_ref().is_some_and(|e| e.code == "CONFLICT"))
            .count();
        // Either they raced (one node, one CONFLICT) or the second came after the first
        // committed and was a reclaim of the same node.
        assert!(
            ok == 2 || (ok == 1 && conflict == 1),
            "round {round}: {replies:?}"
        );
        if conflict == 1 {
            let e = replies.iter().find_map(|r| r.error.clone()).unwrap();
            assert_eq!(e.message, "This machine joined concurrently; retry");
            conflicts += 1;
        }
        let n = a.count(&format!(
            "SELECT count(*) FROM nodes WHERE hostname = '{}'",
            m["hostname"].as_str().unwrap()
        ));
        assert_eq!(n, 1, "round {round}");
        if conflicts > 0 && round >= 2 {
            break;
        }
    }
    assert!(conflicts > 0, "no two joins ever overlapped");
}

#[test]
fn josekit_seals_are_accepted_and_bca_seals_open_in_josekit() {
    use josekit::jwe::{JweHeader, ECDH_ES_A256KW};
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({}));
    // josekit seals to the published JWK.
    let jwk_text = std::fs::read_to_string(a.state().join("pki/join-encryption.jwk")).unwrap();
    let jwk = josekit::jwk::Jwk::from_bytes(jwk_text.as_bytes()).unwrap();
    let key = SigningKey::generate();
    let csr = bca::proto::csr::create(&key);
    let mut header = JweHeader::new();
    header.set_token_type("bcjt+jwe");
    header.set_content_encryption("A256GCM");
    header
        .set_claim("iat", Some(json!(bca::base::clock::now())))
        .unwrap();
    header
        .set_claim("csr", Some(json!(bca::proto::jwe::csr_claim(&csr))))
        .unwrap();
    let encrypter = ECDH_ES_A256KW.encrypter_from_jwk(&jwk).unwrap();
    let sealed = josekit::jwe::serialize_compact(token.as_bytes(), &header, &encrypter).unwrap();
    let req = Request {
        v: 1,
        join: Some(JoinRequest {
            sealed_token: sealed,
            csr: crypto::b64(&csr),
            claims: serde_json::from_value(machine()).unwrap(),
            attestor: "join-token".into(),
            role: "node".into(),
            tpm: None,
            x509pop: None,
            node_id: None,
        }),
        ..Default::default()
    };
    let raw = bca::agent::exchange_raw(&sim.cfg, &serde_json::to_vec(&req).unwrap()).unwrap();
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    let resp = reply.join_response.unwrap_or_else(|| {
        panic!(
            "josekit's seal was refused: {}",
            String::from_utf8_lossy(&raw)
        )
    });
    bca::agent::verify_response(&sim.cfg, &resp, &csr, &key, "node").unwrap();

    // josekit opens bca's seal with the join-encryption private key.
    let keys: Value =
        serde_json::from_slice(&std::fs::read(a.state().join("keys/keys.json")).unwrap()).unwrap();
    let der = crypto::b64_decode(keys["joinEncryption"].as_str().unwrap()).unwrap();
    let decrypter = ECDH_ES_A256KW.decrypter_from_der(&der).unwrap();
    let sealed = bca::proto::jwe::seal("bcjt_example", &sim.enc, &csr, 1234).unwrap();
    let (payload, h) = josekit::jwe::deserialize_compact(&sealed, &decrypter).unwrap();
    assert_eq!(payload, b"bcjt_example");
    assert_eq!(h.token_type(), Some("bcjt+jwe"));
    assert_eq!(h.claim("iat"), Some(&json!(1234)));
    assert_eq!(
        h.claim("csr"),
        Some(&json!(bca::proto::jwe::csr_claim(&csr)))
    );
}

#[test]
fn refusal_events_are_rate_limited() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    for _ in 0..65 {
        let (raw, _, _) = sim.join("hello", &machine());
        assert_eq!(raw, refused_bytes());
    }
    let n = a.count("SELECT count(*) FROM events WHERE type = 'security.join.refused'");
    // 60 per attestor and reason per minute; a minute boundary in the run allows up to all 65.
    assert!((60..=65).contains(&n), "{n} events");
}

/// The budget is per attestor **and** reason: a `join:` reason that two attestors meet has one
/// budget each, so a flood through one attestor does not silence the other's refusals.
#[test]
fn refusal_events_are_rate_limited_per_attestor_and_reason() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let bad_csr = |attestor: &str, role: &str| {
        let req = Sim::request("x".into(), b"not a CSR", &machine(), attestor, role);
        bca::agent::exchange_raw(&sim.cfg, &req).unwrap()
    };
    for _ in 0..65 {
        assert_eq!(bad_csr("", "node"), refused_bytes());
    }
    for _ in 0..65 {
        assert_eq!(bad_csr("discovery", "ramdisk"), refused_bytes());
    }
    let count = |attestor: &str| {
        a.db()
            .query_row(
                "SELECT count(*) FROM events WHERE type = 'security.join.refused'
                 AND json_extract(data, '$.reason') = 'join:csr' AND json_extract(data, '$.attestor') = ?1",
                [attestor],
                |r| r.get::<_, i64>(0),
            )
            .unwrap()
    };
    let (t, d) = (count("join-token"), count("discovery"));
    assert!((60..=65).contains(&t), "{t} join-token events");
    assert!((60..=65).contains(&d), "{d} discovery events");
}

use std::os::unix::fs::PermissionsExt;

#[test]
fn a_gateway_without_a_joinservice_answers_invalid_config() {
    let (dir, out) = init_dir("file", &[]);
    assert!(out.status.success());
    let state = dir.path().join("state");
    let (app, keys) = bca::daemon::serve::prepare(&state).unwrap();
    let app = std::sync::Arc::new(app);
    let tickets = bca::edge::tickets::TicketRoot::derive(keys.node_ca.pkcs8());
    let gw = bca::daemon::serve::build_gateway(&app, keys.gateway.pkcs8(), tickets, None).unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    rt.spawn(gw.serve(listener, stop_rx));
    let out = Command::new(bin())
        .args([
            "daemon",
            "agent-config",
            "--gateway-url",
            &format!("https://{addr}"),
            "--out",
        ])
        .arg(dir.path().join("agent"))
        .env("BCA_STATE_DIR", &state)
        .output()
        .unwrap();
    assert!(out.status.success());
    let cfg = AgentConfig::load(&dir.path().join("agent/config.toml")).unwrap();
    let req = json!({"v": 1, "join": {"sealedToken": "x", "csr": "AAAA", "role": "node"}});
    let reply: Value = serde_json::from_slice(
        &bca::agent::exchange_raw(&cfg, req.to_string().as_bytes()).unwrap(),
    )
    .unwrap();
    assert_eq!(reply["error"]["code"], "INVALID_CONFIG");
}

/// The strict DER parser of pyca/cryptography (pinned, installed by `make test` into
/// `target/pyca`), or `BCA_PYCA_PYTHON`.
fn pyca_python() -> String {
    std::env::var("BCA_PYCA_PYTHON").unwrap_or_else(|_| {
        format!(
            "{}/target/pyca/bin/python",
            env!("CARGO_MANIFEST_DIR").trim_end_matches('/')
        )
    })
}

/// Every kind of certificate bca makes (node CA, serving CA, gateway leaf, join-signing
/// certificate, node and node-tenant leaves) is strict DER: pyca/cryptography 51, which refuses
/// an encoded default (`cA FALSE` written out: X.690 11.5), reads every extension of each, and so
/// does openssl. The leaves say they are no CA by leaving Basic Constraints out.
#[test]
fn every_certificate_kind_parses_with_pyca_cryptography_and_openssl() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let (_, tok) = a.token(&pool, json!({}));
    let node = sim.admitted(&tok, &machine());
    let (_, hosted) = a.token(&pool, json!({"hosted": "kubernetes"}));
    let tenant_leaf = sim.admitted(&hosted, &machine());
    let dir = a.dir.path().join("pyca");
    std::fs::create_dir_all(&dir).unwrap();
    let mut files = Vec::new();
    for name in ["node-ca", "serving-ca", "gateway", "join-signing"] {
        let p = a.state().join("pki").join(format!("{name}.pem"));
        let pem = std::fs::read_to_string(&p).unwrap();
        let first = bca::proto::x509::pem_decode_all(&pem, "CERTIFICATE").remove(0);
        let out = dir.join(format!("{name}.pem"));
        std::fs::write(&out, bca::proto::x509::pem("CERTIFICATE", &first)).unwrap();
        files.push((name.to_string(), out));
    }
    for (name, body) in [("node-leaf", &node), ("node-tenant-leaf", &tenant_leaf)] {
        let out = dir.join(format!("{name}.pem"));
        std::fs::write(&out, &body.certificate_chain[0]).unwrap();
        files.push((name.to_string(), out));
    }
    let script = r#"
import json, sys, cryptography
from cryptography import x509
out = {"version": cryptography.__version__}
for path in sys.argv[1:]:
    c = x509.load_pem_x509_certificate(open(path, "rb").read())
    exts = list(c.extensions)  # parses every extension, strictly
    try:
        bc = c.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        bc = None
    out[path] = {"ca": bc, "extensions": len(exts), "serial": c.serial_number > 0}
print(json.dumps(out))
"#;
    let o = Command::new(pyca_python())
        .arg("-c")
        .arg(script)
        .args(files.iter().map(|(_, p)| p))
        .output()
        .expect("pyca/cryptography's python (make test installs it into target/pyca)");
    assert!(
        o.status.success(),
        "pyca/cryptography refused a certificate: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["version"], "51.0.1");
    for (name, p) in &files {
        let got = &v[p.to_str().unwrap()];
        let is_ca = name.ends_with("-ca");
        assert_eq!(
            got["ca"],
            if is_ca { json!(true) } else { Value::Null },
            "{name}: {got}"
        );
        assert!(got["extensions"].as_u64().unwrap() >= 2, "{name}: {got}");
        let text = Command::new("openssl")
            .args(["x509", "-noout", "-text", "-in"])
            .arg(p)
            .output()
            .unwrap();
        assert!(text.status.success(), "openssl refused {name}");
        let text = String::from_utf8_lossy(&text.stdout);
        assert_eq!(text.contains("CA:TRUE"), is_ca, "{name}: {text}");
        assert!(!text.contains("CA:FALSE"), "{name}: {text}");
    }
}

/// Issue 28, item 7: a machine whose UUID and serials are placeholders but which has two MACs is
/// admitted only by its token's `expect` binding, with an untrusted key: a later join of the
/// same machine, even with `allowReclaim`, is a new node, never a reclaim of the first.
#[test]
fn placeholder_hardware_under_expect_joins_untrusted_and_never_reclaims() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("placeholders");
    let m = json!({
        "productUuid": "03000200-0400-0500-0006-000700080009",
        "serials": {"product": "To Be Filled By O.E.M.", "board": "Default string"},
        "macs": ["00:1b:21:aa:00:01", "00:1b:21:aa:00:02"],
        "hostname": "placeholder-1",
    });
    // Without a binding, placeholder hardware is refused, and nothing is written.
    let (_, plain) = a.token(&pool, json!({}));
    let (raw, _, _) = sim.join(&plain, &m);
    assert_eq!(raw, refused_bytes());
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "join:placeholder-hardware"
    );
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 0);
    let expect = json!({"expect": {"mac": "00:1b:21:aa:00:01"}, "allowReclaim": true});
    let (_, t1) = a.token(&pool, expect.clone());
    let first = sim.admitted(&t1, &m);
    let node = a.cli_json(&["nodes", "get", &first.node_id]);
    assert_eq!(node["hardwareKeyTrusted"], false);
    let (_, joined) = a.last_event("node.joined").unwrap();
    assert_eq!(joined["hardwareKeyTrusted"], false);
    let (_, t2) = a.token(&pool, expect);
    let second = sim.admitted(&t2, &m);
    assert_ne!(second.node_id, first.node_id);
    assert_eq!(a.last_event("node.joined").unwrap().1["reclaim"], false);
    // The first node keeps its identity: nothing of it was revoked.
    assert_eq!(
        a.count("SELECT count(*) FROM node_certs WHERE revoked_at IS NOT NULL"),
        0
    );
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 2);
}

/// Issue 28, item 6: a reclaim through a hosted token lowers an existing `platform` node to
/// `tenant-controlled` with a `node-tenant` certificate (same node, next generation, the old
/// certificate revoked); in the root tenant's `platformOperated` pool it keeps `platform`; in
/// another tenant's pool, `platformOperated` or not, it never yields `platform`. All through the
/// real gateway.
#[test]
fn a_hosted_reclaim_lowers_a_platform_node_unless_the_platform_operates_the_pool() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let hosted = json!({"hosted": "kubernetes", "allowReclaim": true});

    // The root tenant's pool: a platform node, then a hosted reclaim.
    let pool = a.pool("k8s-reclaim");
    let m = machine();
    let (_, t1) = a.token(&pool, json!({}));
    let first = sim.admitted(&t1, &m);
    assert_eq!(first.role, "node");
    let node = a.cli_json(&["nodes", "get", &first.node_id]);
    assert_eq!(node["trust"], "platform");
    let (_, t2) = a.token(&pool, hosted.clone());
    let second = sim.admitted(&t2, &m);
    assert_eq!(second.node_id, first.node_id);
    assert_eq!(second.role, "node-tenant");
    let node = a.cli_json(&["nodes", "get", &first.node_id]);
    assert_eq!(
        (node["trust"].as_str(), node["role"].as_str()),
        (Some("tenant-controlled"), Some("node-tenant"))
    );
    assert_eq!(node["identityGeneration"], 2);
    let certs = node["certificates"].as_array().unwrap();
    let old = certs.iter().find(|c| c["identityGeneration"] == 1).unwrap();
    let new = certs.iter().find(|c| c["identityGeneration"] == 2).unwrap();
    assert_eq!(old["revokeReason"], "reclaimed");
    assert_eq!(
        (new["role"].as_str(), new["revokedAt"].is_null()),
        (Some("node-tenant"), true)
    );
    let (_, joined) = a.last_event("node.joined").unwrap();
    assert_eq!(
        (joined["reclaim"].as_bool(), joined["role"].as_str()),
        (Some(true), Some("node-tenant"))
    );
    // A plain token's reclaim never raises it back.
    let (_, t3) = a.token(&pool, json!({"allowReclaim": true}));
    let third = sim.admitted(&t3, &m);
    assert_eq!(
        (third.node_id.as_str(), third.role.as_str()),
        (first.node_id.as_str(), "node-tenant")
    );

    // The root tenant's platformOperated pool: the hosted reclaim keeps `platform`.
    let operated = a.cli_json(&[
        "pools",
        "create",
        "--name",
        "k8s-operated",
        "--k8s-platform-operated",
    ])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let m2 = machine();
    let (_, t4) = a.token(&operated, json!({}));
    let n2 = sim.admitted(&t4, &m2);
    let (_, t5) = a.token(&operated, hosted.clone());
    let again = sim.admitted(&t5, &m2);
    assert_eq!(
        (again.node_id.as_str(), again.role.as_str()),
        (n2.node_id.as_str(), "node")
    );
    let node = a.cli_json(&["nodes", "get", &n2.node_id]);
    assert_eq!(
        (node["trust"].as_str(), node["identityGeneration"].as_i64()),
        (Some("platform"), Some(2))
    );

    // Another tenant's platformOperated pool never yields `platform`.
    let tenant = a.cli_json(&["tenants", "create", "--name", "acme-k8s"])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let tpool = a.cli_json(&[
        "pools",
        "create",
        "--tenant",
        &tenant,
        "--name",
        "acme-k8s",
        "--k8s-platform-operated",
    ])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mint = |extra: Value| {
        let mut body = json!({"tenantId": tenant, "poolId": tpool, "ttlSeconds": 3600,
            "idempotencyKey": format!("k-{}", rand_hex(8))});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        a.api_ok("joinTokens/create", body)["token"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let m3 = machine();
    let n3 = sim.admitted(&mint(json!({})), &m3);
    let node = a.cli_json(&["nodes", "get", &n3.node_id, "--tenant", &tenant]);
    assert_eq!(node["trust"], "tenant-owned");
    let again = sim.admitted(&mint(hosted), &m3);
    assert_eq!(
        (again.node_id.as_str(), again.role.as_str()),
        (n3.node_id.as_str(), "node-tenant")
    );
    let node = a.cli_json(&["nodes", "get", &n3.node_id, "--tenant", &tenant]);
    assert_eq!(node["trust"], "tenant-controlled");
}

/// An agent with several gateways (`bca daemon agent-config --gateway-url` repeated) fails over:
/// a gateway that refuses connections, then one that answers TLS under another site's serving CA
/// (an impostor: its certificate fails the pin, so it is skipped, never trusted), then this
/// site's. `agent join` joins through the third and `agent run` holds its session there.
#[test]
fn an_agent_fails_over_past_dead_and_impostor_gateways() {
    let a = Appliance::start();
    let other = Appliance::start();
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 1}));
    let dir = a.dir.path().join("agent-failover");
    let urls = [
        format!("https://127.0.0.1:{dead}"),
        format!("https://{}", other.gateway),
        format!("https://{}", a.gateway),
    ];
    let o = a.cli(&[
        "daemon",
        "agent-config",
        "--gateway-url",
        &urls[0],
        "--gateway-url",
        &urls[1],
        "--gateway-url",
        &urls[2],
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cfg = a.agent_config(&dir);
    assert_eq!(cfg.gateway_url, urls[0]);
    assert_eq!(cfg.gateway_urls, urls[1..]);
    // A bad gateway among them is refused by name.
    let o = a.cli(&[
        "daemon",
        "agent-config",
        "--gateway-url",
        &urls[2],
        "--gateway-url",
        "http://plain.example",
        "--out",
        a.dir.path().join("agent-bad").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("\"http://plain.example\" must be https://host[:port]"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!a.dir.path().join("agent-bad").exists());

    let claims = write_claims(&a, &machine());
    let o = agent_join(&dir, "data", &claims, &token, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 1);
    assert_eq!(other.count("SELECT count(*) FROM nodes"), 0);
    let mut run = agent_run(&dir);
    wait_for("the session on the third gateway", 30, || {
        (connected(&a) == 1).then_some(())
    });
    let _ = run.kill();
    let _ = run.wait();
}
