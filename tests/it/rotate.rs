//! Key rotation while serving: join-signing and join-encryption with an overlap, the gateway leaf
//! swapped under live sessions, and agents that joined (or were configured) before and after.

use crate::common::*;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

fn well_known(a: &Appliance) -> Value {
    let o = Command::new("curl")
        .args(["-sf"])
        .arg(format!(
            "http://{}/api/compute/.well-known/better-compute",
            a.http
        ))
        .output()
        .unwrap();
    assert!(o.status.success());
    serde_json::from_slice(&o.stdout).unwrap()
}

fn rotate(a: &Appliance, args: &[&str]) -> Value {
    let mut all = vec!["pki", "rotate"];
    all.extend_from_slice(args);
    a.cli_json(&all)
}

#[test]
fn join_signing_rotates_with_an_overlap_and_agents_follow() {
    let a = Appliance::start_cfg("file", &[], |c| {
        c.replace("cert_ttl_seconds = 86400", "cert_ttl_seconds = 10")
            .replace("heartbeat_seconds = 15", "heartbeat_seconds = 1")
    });
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 10}));
    let old_pin = well_known(&a)["join"]["signingKeyPin"]
        .as_str()
        .unwrap()
        .to_string();
    // Configured before the rotation, never renewed: knows only the old pin.
    let stale = Sim::new(&a);
    // Joined before the rotation and running: it renews every six seconds.
    let live = joined_agent_dir(&a, &token);
    let mut agent = agent_run(&live);

    let v = rotate(&a, &["join-signing", "--overlap", "1d"]);
    let next_pin = v["pins"]["joinSigningNext"].as_str().unwrap().to_string();
    assert_ne!(next_pin, old_pin);
    assert!(v["rotation"]["joinSigning"]["promoteAt"].is_string(), "{v}");
    // Published before it is current: the well-known document, pki show, new agent configs.
    let doc = well_known(&a);
    assert_eq!(doc["join"]["signingKeyPin"], old_pin.as_str());
    assert_eq!(doc["join"]["nextSigningKeyPin"], next_pin.as_str());
    let show = String::from_utf8(a.cli(&["pki", "show"]).stdout).unwrap();
    assert!(
        show.contains(&format!("join_signing_next_key_pin = \"{next_pin}\"")),
        "{show}"
    );
    let during = Sim::new(&a);
    assert_eq!(
        during.cfg.join_signing_next_key_pin.as_deref(),
        Some(next_pin.as_str())
    );
    // Staging twice is refused and changes nothing.
    let (code, msg) = a.cli_err(&["pki", "rotate", "join-signing"]);
    assert_eq!(code, "INVALID_STATE");
    assert!(msg.contains("already staged"), "{msg}");
    // Answers are still signed by the current key and carry the next pin.
    let body = stale.admitted(&token, &machine());
    assert_eq!(
        body.join_signing_next_key_pin.as_deref(),
        Some(next_pin.as_str())
    );
    // The running agent learns the next pin from a signed renewal and keeps it in its data
    // directory (its config directory is read-only under its unit): the config is unchanged.
    let live_cfg = live.join("config.toml");
    let cfg_before = std::fs::read(&live_cfg).unwrap();
    let pins = live.join("data/pins.json");
    let learned = |p: &std::path::Path| -> Option<Value> {
        serde_json::from_slice(&std::fs::read(p).ok()?).ok()
    };
    wait_for("the live agent to learn the next pin", 20, || {
        (learned(&pins)?["joinSigningNextKeyPin"] == next_pin.as_str()).then_some(())
    });
    assert_eq!(std::fs::read(&live_cfg).unwrap(), cfg_before);
    assert_eq!(
        std::fs::metadata(&pins).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // It restarts across the promotion: what it learned survives.
    let _ = agent.kill();
    let _ = agent.wait();

    let v = rotate(&a, &["join-signing", "--promote"]);
    assert_eq!(v["pins"]["joinSigning"], next_pin.as_str());
    assert!(v["pins"].get("joinSigningNext").is_none(), "{v}");
    let doc = well_known(&a);
    assert_eq!(doc["join"]["signingKeyPin"], next_pin.as_str());
    assert!(doc["join"].get("nextSigningKeyPin").is_none());
    // Configured during the overlap: accepts the new signer.
    during.admitted(&token, &machine());
    // Configured after: the new pin only.
    let after = Sim::new(&a);
    assert_eq!(after.cfg.join_signing_key_pin, next_pin);
    after.admitted(&token, &machine());
    // The agent, started again after the promotion, renews under the new key and makes it its
    // current pin.
    let renewed = a.count("SELECT count(*) FROM node_certs");
    let mut agent = agent_run(&live);
    wait_for("the live agent to promote its pin", 20, || {
        let l = learned(&pins)?;
        (l["joinSigningKeyPin"] == next_pin.as_str() && l.get("joinSigningNextKeyPin").is_none())
            .then_some(())
    });
    wait_for("another renewal under the new key", 20, || {
        (a.count("SELECT count(*) FROM node_certs") > renewed).then_some(())
    });
    let _ = agent.kill();
    let _ = agent.wait();
    // Configured before and never renewed: its join fails loudly on the signature.
    let (raw, csr, key) = stale.join(&token, &machine());
    let reply: bca::proto::protocol::Reply = serde_json::from_slice(&raw).unwrap();
    let e = bca::agent::verify_response(
        &stale.cfg,
        &reply.join_response.unwrap(),
        &csr,
        &key,
        "node",
    )
    .unwrap_err();
    assert!(
        e.message
            .contains("not signed by the pinned join-signing key"),
        "{e}"
    );
    // Audited, step by step.
    let rows = a.cli_json(&["audit", "list", "--action", "pki.rotate"]);
    let actions: Vec<&str> = rows["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["data"]["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["promote", "stage"]);
}

#[test]
fn join_encryption_rotates_and_the_previous_key_is_retired() {
    let mut a = Appliance::start_with("passphrase", &[]);
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 10}));
    let before = Sim::new(&a);
    let v = rotate(&a, &["join-encryption"]);
    let next_pin = v["pins"]["joinEncryptionNext"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(
        well_known(&a)["join"]["nextEncryptionKeyPin"],
        next_pin.as_str()
    );
    // A config written during the overlap seals to the next key; both are accepted.
    let during = Sim::new(&a);
    assert_eq!(during.cfg.join_encryption_key_pin, next_pin);
    before.admitted(&token, &machine());
    during.admitted(&token, &machine());
    // The rotation survives a restart (the bundle is sealed again under the same passphrase).
    a.restart();
    during.admitted(&token, &machine());
    before.admitted(&token, &machine());
    rotate(&a, &["join-encryption", "--promote"]);
    let doc = well_known(&a);
    assert_eq!(doc["join"]["encryptionKeyPin"], next_pin.as_str());
    assert!(a.state().join("pki/join-encryption.previous.jwk").exists());
    // After the promotion: both still join (the old key is the previous one, for an overlap).
    before.admitted(&token, &machine());
    during.admitted(&token, &machine());
    let (code, msg) = a.cli_err(&["pki", "rotate", "join-encryption"]);
    assert_eq!(code, "INVALID_STATE");
    assert!(msg.contains("retire it first"), "{msg}");
    let v = rotate(&a, &["join-encryption", "--retire-previous"]);
    assert!(
        v["rotation"]["previousEncryptionAcceptedUntil"].is_null(),
        "{v}"
    );
    assert!(!a.state().join("pki/join-encryption.previous.jwk").exists());
    // Retired: a join sealed to the old key is refused (uniformly); the new one is admitted.
    let (raw, _, _) = before.join(&token, &machine());
    assert_eq!(raw, refused_bytes());
    during.admitted(&token, &machine());
    // Bad requests change nothing.
    let snap = a.snapshot();
    let (code, _) = a.cli_err(&["pki", "rotate", "join-encryption", "--retire-previous"]);
    assert_eq!(code, "INVALID_STATE");
    let (code, msg) = a.cli_err(&["pki", "rotate", "node-ca"]);
    assert_eq!(code, "INVALID_INPUT");
    assert!(
        msg.contains("join-encryption, join-signing or gateway"),
        "{msg}"
    );
    let (code, _) = a.cli_err(&["pki", "rotate", "join-signing", "--overlap", "10s"]);
    assert_eq!(code, "INVALID_INPUT");
    let (code, _) = a.cli_err(&["pki", "rotate", "join-signing", "--overlap", "soon"]);
    assert_eq!(code, "INVALID_INPUT");
    assert_eq!(a.snapshot(), snap);
}

fn gateway_serial(a: &Appliance) -> String {
    let o = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect {} -alpn bca/1 </dev/null 2>/dev/null | openssl x509 -noout -serial",
            a.gateway
        ))
        .output()
        .unwrap();
    String::from_utf8(o.stdout).unwrap().trim().to_string()
}

#[test]
fn the_gateway_leaf_is_renewed_under_live_sessions() {
    let a = Appliance::start_cfg("file", &[], |c| {
        c.replace("heartbeat_seconds = 15", "heartbeat_seconds = 1")
    });
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 5}));
    let before = joined_agent_dir(&a, &token);
    let mut agent = agent_run(&before);
    wait_for("the session", 20, || (connected(&a) == 1).then_some(()));
    let serial = gateway_serial(&a);
    assert!(serial.starts_with("serial="), "{serial}");
    let v = rotate(&a, &["gateway"]);
    assert!(v["rotation"]["gatewayNotAfter"].is_string());
    let renewed = gateway_serial(&a);
    assert_ne!(renewed, serial, "new handshakes get the new leaf");
    // The live session was not dropped: no disconnect, still connected after heartbeats.
    std::thread::sleep(std::time::Duration::from_secs(3));
    assert_eq!(connected(&a), 1);
    assert!(a.last_event("node.disconnected").is_none());
    // The new leaf chains to the same serving CA, which agents pin: new agents join.
    let after = joined_agent_dir(&a, &token);
    assert!(after.join("data/identity.json").exists());
    let _ = agent.kill();
    let _ = agent.wait();
    // `pki show` reads the renewed leaf from disk.
    let shown = a.cli_json(&["pki", "show"]);
    assert_eq!(
        format!(
            "serial={}",
            shown["certificates"]["gateway"]["serial"]
                .as_str()
                .unwrap()
                .replace(':', "")
                .to_uppercase()
        ),
        renewed
    );
}

#[test]
fn an_interrupted_rotation_is_finished_at_start() {
    let mut a = Appliance::start();
    rotate(&a, &["join-signing"]);
    a.stop();
    // A crash after the bundle was written but before the public file: the file is gone.
    std::fs::remove_file(a.state().join("pki/join-signing.next.pem")).unwrap();
    std::fs::remove_file(a.state().join("pki/rotation.json")).unwrap();
    a.restart();
    let v = a.cli_json(&["pki", "show"]);
    assert!(v["pins"]["joinSigningNext"].is_string(), "{v}");
    assert!(v["rotation"]["joinSigning"]["promoteAt"].is_string(), "{v}");
    assert!(a.state().join("pki/join-signing.next.pem").exists());
    // And it still promotes.
    rotate(&a, &["join-signing", "--promote"]);
    Sim::new(&a);
}
