//! The `x509pop` attestor: a node whose certificate expired while it was offline comes back by
//! proving the key of that certificate, and every other claim is refused with its reason.

use crate::common::*;
use bca::base::crypto::{self, SigningKey};
use bca::proto::agent_config::AgentConfig;
use bca::proto::protocol::{
    x509pop_message, Empty, JoinRequest, JoinResponseBody, Reply, Request, X509PopEvidence,
    X509POP_PURPOSE,
};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// A node as the test holds it: its id, leaf (DER) and key.
struct Held {
    id: String,
    leaf: Vec<u8>,
    key: SigningKey,
}

fn held(sim: &Sim, token: &str, claims: &Value) -> Held {
    let (raw, csr, key) = sim.join(token, claims);
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    let body = bca::agent::verify_response(
        &sim.cfg,
        &reply
            .join_response
            .unwrap_or_else(|| panic!("{}", String::from_utf8_lossy(&raw))),
        &csr,
        &key,
        "node",
    )
    .unwrap();
    from_body(body, key)
}

fn from_body(body: JoinResponseBody, key: SigningKey) -> Held {
    Held {
        id: body.node_id,
        leaf: bca::proto::x509::pem_decode_all(&body.certificate_chain[0], "CERTIFICATE").remove(0),
        key,
    }
}

/// The appliance's challenge: (id, its 32 bytes), or the raw refusal.
fn challenge(cfg: &AgentConfig) -> Result<(String, Vec<u8>), Vec<u8>> {
    let ask = Request {
        v: 1,
        x509pop_challenge: Some(Empty {}),
        ..Default::default()
    };
    let raw = bca::agent::exchange_raw(cfg, &serde_json::to_vec(&ask).unwrap()).unwrap();
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    match reply.x509pop_challenge {
        Some(c) => {
            assert_eq!(c.expires_in_seconds, 60);
            Ok((c.challenge_id, crypto::b64_decode(&c.challenge).unwrap()))
        }
        None => Err(raw),
    }
}

/// An `x509pop` join presenting `leaf`, signed by `key` for `node` over `ch`: the reply's bytes,
/// the CSR and the new key.
fn rejoin_raw(
    cfg: &AgentConfig,
    leaf: &[u8],
    key: &SigningKey,
    node: &str,
    ch: &(String, Vec<u8>),
) -> (Vec<u8>, Vec<u8>, SigningKey) {
    rejoin_signed(cfg, leaf, &|m| key.sign(X509POP_PURPOSE, m), node, ch)
}

/// [`rejoin_raw`] with the proof made by `sign` (over the message, purpose included by it).
fn rejoin_signed(
    cfg: &AgentConfig,
    leaf: &[u8],
    sign: &dyn Fn(&[u8]) -> Vec<u8>,
    node: &str,
    ch: &(String, Vec<u8>),
) -> (Vec<u8>, Vec<u8>, SigningKey) {
    let new = SigningKey::generate();
    let raw = rejoin_keyed(cfg, leaf, sign, node, ch, &new);
    (raw, vec![], new)
}

/// [`rejoin_signed`] for the new key `new`: the reply's bytes.
fn rejoin_keyed(
    cfg: &AgentConfig,
    leaf: &[u8],
    sign: &dyn Fn(&[u8]) -> Vec<u8>,
    node: &str,
    ch: &(String, Vec<u8>),
    new: &SigningKey,
) -> Vec<u8> {
    let csr = bca::proto::csr::create(new);
    let msg = x509pop_message(&ch.1, &crypto::sha256(&csr), node);
    let req = Request {
        v: 1,
        join: Some(JoinRequest {
            sealed_token: String::new(),
            csr: crypto::b64(&csr),
            claims: Default::default(),
            attestor: "x509pop".into(),
            role: "node".into(),
            tpm: None,
            x509pop: Some(X509PopEvidence {
                challenge_id: ch.0.clone(),
                challenge: crypto::b64(&ch.1),
                certificate: crypto::b64(leaf),
                signature: crypto::b64(&sign(&msg)),
                key_attestation: None,
            }),
            node_id: None,
        }),
        ..Default::default()
    };
    bca::agent::exchange_raw(cfg, &serde_json::to_vec(&req).unwrap()).unwrap()
}

/// What a refusal must leave as it was: the nodes and their certificates.
fn nodes_and_certs(a: &Appliance) -> String {
    let c = a.db();
    let nodes = query_rows(
        &c,
        "SELECT id, state, identity_generation, role, pool_id, tenant_id FROM nodes ORDER BY id",
    );
    let certs = query_rows(
        &c,
        "SELECT serial, node_id, identity_generation, not_after, revoked_at FROM node_certs ORDER BY serial",
    );
    format!("{nodes}\n{certs}\n")
}

/// An `x509pop` join presenting `leaf`, signed by `key` for `node` over a fresh challenge, is
/// refused with `reason` ([`assert_refused`]).
fn refuses(
    a: &Appliance,
    cfg: &AgentConfig,
    (leaf, key, node): (&[u8], &SigningKey, &str),
    reason: &str,
    tenant: &str,
) {
    let before = nodes_and_certs(a);
    let ch = challenge(cfg).unwrap();
    let (raw, _, _) = rejoin_raw(cfg, leaf, key, node, &ch);
    assert_refused(a, &raw, reason, tenant, &before);
}

/// The refusal is the uniform one, recorded with `reason` in `tenant`'s stream, and nothing of
/// the nodes changed.
fn assert_refused(a: &Appliance, raw: &[u8], reason: &str, tenant: &str, before: &str) {
    assert_eq!(
        raw,
        refused_bytes().as_slice(),
        "{reason}: {}",
        String::from_utf8_lossy(raw)
    );
    let (t, data) = a.last_event("security.join.refused").unwrap();
    assert_eq!(data["reason"], reason, "{data}");
    assert_eq!(data["attestor"], "x509pop", "{data}");
    assert_eq!(t, tenant, "{reason}: the event's tenant");
    assert_eq!(
        nodes_and_certs(a),
        before,
        "{reason}: a refusal changed a node"
    );
}

fn tenant_pool(a: &Appliance, name: &str, attestors: Option<&[&str]>) -> (String, String) {
    let t = a.api_ok("tenants/create", json!({"name": name}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut body = json!({"tenantId": t, "name": name});
    if let Some(list) = attestors {
        body["policy"] = json!({"joinAttestors": list});
    }
    let pool = a.api_ok("pools/create", body)["id"]
        .as_str()
        .unwrap()
        .to_string();
    (t, pool)
}

fn x509pop_on(text: String, window: u32) -> String {
    let text = text.replace("cert_ttl_seconds = 86400", "cert_ttl_seconds = 10");
    replace_table(
        &text,
        "x509pop",
        &format!("[x509pop]\nenabled = true\nmax_expired_seconds = {window}\n\n"),
    )
}

fn agent_cmd(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(bin())
        .args(["agent"])
        .args(args)
        .arg("--config")
        .arg(dir.join("config.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .output()
        .unwrap()
}

fn leaf_of(dir: &Path) -> (String, Vec<u8>) {
    let id: Value =
        serde_json::from_slice(&std::fs::read(dir.join("data/identity.json")).unwrap()).unwrap();
    let pem = id["certificateChain"][0].as_str().unwrap();
    (
        id["nodeId"].as_str().unwrap().to_string(),
        bca::proto::x509::pem_decode_all(pem, "CERTIFICATE").remove(0),
    )
}

#[test]
fn an_expired_node_comes_back_by_x509pop_and_every_bad_claim_is_refused() {
    let a = Appliance::start_cfg("file", &[], |c| x509pop_on(c, 604_800));
    let sim = Sim::new(&a);
    let root = a.root_tenant();
    let (t, pool) = tenant_pool(&a, "tenant-a", None);
    let (_, token) = a.token(
        &pool,
        json!({"tenantId": t, "maxUses": 20, "allowReclaim": true}),
    );
    let (t2, pool2) = tenant_pool(&a, "tenant-b", Some(&["join-token"]));
    let (_, token2) = a.token(&pool2, json!({"tenantId": t2}));

    // By the CLI: one comes back by hand, one by `agent run`.
    let by_hand = joined_agent_dir(&a, &token);
    let by_run = joined_agent_dir(&a, &token);
    let (hand_id, hand_leaf) = leaf_of(&by_hand);
    let hand_key = std::fs::read(by_hand.join("data/node.key")).unwrap();
    // Below the CLI: one for each refusal that needs its own node.
    let wrong_pop = held(&sim, &token, &machine());
    let revoked = held(&sim, &token, &machine());
    let retired = held(&sim, &token, &machine());
    let m = machine();
    let reclaimed = held(&sim, &token, &m);
    let other_pool = held(&sim, &token2, &machine());

    std::thread::sleep(Duration::from_secs(11));
    // A node that joins now holds a live certificate: it renews, it is never brought back.
    let live = held(&sim, &token, &machine());

    // `doctor` names the way back.
    let o = agent_cmd(&by_hand, &["doctor"]);
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(1), "{text}");
    assert!(
        text.contains("FAIL identity: the certificate expired at ")
            && text.contains("bca agent join --attestor x509pop")
            && text.contains(
                "; join again as root: bca agent join --reset --yes, then bca agent join"
            ),
        "{text}"
    );

    let hand_old_key = {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("node.key"), &hand_key).unwrap();
        bca::agent::nodekey::NodeKey::load(&dir.path().join("node.key"))
            .unwrap()
            .unwrap()
    };
    // A first attempt whose answer is lost: the agent had kept its new key (node.key.x509pop)
    // before sending, and its retry presents it again.
    let certs = a.count("SELECT count(*) FROM node_certs");
    let pending = SigningKey::generate();
    let pending_file = by_hand.join("data/node.key.x509pop");
    std::fs::write(
        &pending_file,
        bca::proto::x509::pem("PRIVATE KEY", pending.pkcs8()),
    )
    .unwrap();
    let ch = challenge(&sim.cfg).unwrap();
    let lost = rejoin_keyed(
        &sim.cfg,
        &hand_leaf,
        &|m| hand_old_key.sign(X509POP_PURPOSE, m).unwrap(),
        &hand_id,
        &ch,
        &pending,
    );
    let lost: Reply = serde_json::from_slice(&lost).unwrap();
    let lost = lost.join_response.expect("the first attempt was issued");
    let lost_body: JoinResponseBody =
        serde_json::from_slice(&crypto::b64_decode(&lost.body).unwrap()).unwrap();
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), certs + 1);
    // Another key after that: refused (the node has a newer, live certificate).
    let before = nodes_and_certs(&a);
    let ch = challenge(&sim.cfg).unwrap();
    let (raw, _, _) = rejoin_signed(
        &sim.cfg,
        &hand_leaf,
        &|m| hand_old_key.sign(X509POP_PURPOSE, m).unwrap(),
        &hand_id,
        &ch,
    );
    assert_refused(&a, &raw, "x509pop:not-newest", &t, &before);

    // By hand: the retry with the kept key gets the certificate issued for it again; the same
    // node, the same generation, the event says x509pop.
    let o = agent_cmd(&by_hand, &["join", "--attestor", "x509pop"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), hand_id);
    let (id, new_leaf) = leaf_of(&by_hand);
    assert_eq!(id, hand_id);
    assert_ne!(new_leaf, hand_leaf);
    assert_ne!(
        std::fs::read(by_hand.join("data/node.key")).unwrap(),
        hand_key
    );
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), certs + 1);
    assert_eq!(
        bca::proto::x509::pem_decode_all(&lost_body.certificate_chain[0], "CERTIFICATE")[0],
        new_leaf,
        "the retry got the lost answer's certificate"
    );
    assert!(!pending_file.exists());
    let (tenant, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(tenant, t);
    assert_eq!(ev["attestor"], "x509pop");
    assert_eq!(ev["nodeId"], hand_id.as_str());
    assert_eq!(ev["reclaim"], false);
    let old = bca::proto::x509::parse_node_leaf(&hand_leaf).unwrap();
    let new = bca::proto::x509::parse_node_leaf(&new_leaf).unwrap();
    assert_eq!(ev["previousSerial"], old.serial_hex.as_str());
    assert_eq!(new.spiffe_id, old.spiffe_id);
    assert_eq!(bca::agent::cert_role(&new_leaf).as_deref(), Some("node"));
    let gen: i64 = a
        .db()
        .query_row(
            "SELECT identity_generation FROM nodes WHERE id = ?1",
            [&hand_id],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(gen, 1);
    // The agent loads the new identity as valid.
    let o = agent_cmd(&by_hand, &["doctor"]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("ok   identity: node "),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    // Again with the same expired certificate: refused, not the newest.
    let before = nodes_and_certs(&a);
    let ch = challenge(&sim.cfg).unwrap();
    let (raw, _, _) = rejoin_signed(
        &sim.cfg,
        &hand_leaf,
        &|m| hand_old_key.sign(X509POP_PURPOSE, m).unwrap(),
        &hand_id,
        &ch,
    );
    assert_refused(&a, &raw, "x509pop:not-newest", &t, &before);

    // A live certificate: not expired (renew instead).
    refuses(
        &a,
        &sim.cfg,
        (&live.leaf, &live.key, &live.id),
        "x509pop:not-expired",
        &t,
    );

    // The wrong key: the proof fails, and the event goes to the root tenant.
    refuses(
        &a,
        &sim.cfg,
        (&wrong_pop.leaf, &live.key, &wrong_pop.id),
        "x509pop:pop",
        &root,
    );
    // Signed for another node id than the certificate's: the same.
    refuses(
        &a,
        &sim.cfg,
        (&wrong_pop.leaf, &wrong_pop.key, &live.id),
        "x509pop:pop",
        &root,
    );
    // That refusal spent its challenge: answered again, properly, it is refused.
    let (raw, _, _) = rejoin_raw(
        &sim.cfg,
        &wrong_pop.leaf,
        &wrong_pop.key,
        &wrong_pop.id,
        &ch,
    );
    assert_refused(&a, &raw, "x509pop:challenge", &root, &before);
    // A challenge nobody issued, and one whose bytes are not the issued ones.
    let (raw, _, _) = rejoin_raw(
        &sim.cfg,
        &wrong_pop.leaf,
        &wrong_pop.key,
        &wrong_pop.id,
        &("x5pc_00000000000000000000000000".into(), vec![7; 32]),
    );
    assert_refused(&a, &raw, "x509pop:challenge", &root, &before);
    // An id of another shape than the minted ones never reaches the store: a NUL byte (which
    // PostgreSQL refuses, failing the batch it was in) or a short one is malformed.
    for id in ["x5pc_\u{0}0000000000000000000000000", "x5pc_nope"] {
        let (raw, _, _) = rejoin_raw(
            &sim.cfg,
            &wrong_pop.leaf,
            &wrong_pop.key,
            &wrong_pop.id,
            &(id.into(), vec![7; 32]),
        );
        assert_refused(&a, &raw, "x509pop:malformed", &root, &before);
    }
    let ch = challenge(&sim.cfg).unwrap();
    let (raw, _, _) = rejoin_raw(
        &sim.cfg,
        &wrong_pop.leaf,
        &wrong_pop.key,
        &wrong_pop.id,
        &(ch.0, vec![7; 32]),
    );
    assert_refused(&a, &raw, "x509pop:challenge", &root, &before);
    // A certificate that is not byte for byte ours (its signature altered): unknown.
    let mut forged = wrong_pop.leaf.clone();
    let n = forged.len();
    forged[n - 3] ^= 1;
    refuses(
        &a,
        &sim.cfg,
        (&forged, &wrong_pop.key, &wrong_pop.id),
        "x509pop:unknown",
        &root,
    );
    // A self-made certificate naming a real node, for the caller's own key: unknown.
    let own = SigningKey::generate();
    let self_made = {
        let kp = rcgen::KeyPair::try_from(own.pkcs8()).unwrap();
        let mut p = rcgen::CertificateParams::default();
        p.subject_alt_names = vec![rcgen::SanType::URI(
            rcgen::Ia5String::try_from(format!(
                "spiffe://compute.example.com/site/x/node/{}",
                wrong_pop.id
            ))
            .unwrap(),
        )];
        p.self_signed(&kp).unwrap().der().to_vec()
    };
    refuses(
        &a,
        &sim.cfg,
        (&self_made, &own, &wrong_pop.id),
        "x509pop:unknown",
        &root,
    );
    // Evidence that is not well-formed.
    refuses(
        &a,
        &sim.cfg,
        (b"not a certificate", &own, &wrong_pop.id),
        "x509pop:unknown",
        &root,
    );

    // Revoked by an operator.
    a.api_ok(
        "nodes/revokeIdentity",
        json!({"tenantId": t, "nodeId": revoked.id}),
    );
    // A revoked certificate proves no current identity: the event goes to the root tenant.
    refuses(
        &a,
        &sim.cfg,
        (&revoked.leaf, &revoked.key, &revoked.id),
        "x509pop:revoked",
        &root,
    );

    // Retired.
    a.api_ok("nodes/retire", json!({"tenantId": t, "nodeId": retired.id}));
    refuses(
        &a,
        &sim.cfg,
        (&retired.leaf, &retired.key, &retired.id),
        "x509pop:retired",
        &t,
    );

    // Reclaimed since (the machine joined again): an earlier identity generation.
    let again = held(&sim, &token, &m);
    assert_eq!(again.id, reclaimed.id);
    refuses(
        &a,
        &sim.cfg,
        (&reclaimed.leaf, &reclaimed.key, &reclaimed.id),
        "x509pop:generation",
        &root,
    );

    // A pool that does not allow x509pop.
    refuses(
        &a,
        &sim.cfg,
        (&other_pool.leaf, &other_pool.key, &other_pool.id),
        "join:pool-attestor",
        &t2,
    );

    // `agent run` on an expired identity comes back by itself and opens its session.
    let (run_id, run_leaf) = leaf_of(&by_run);
    let mut child = agent_run(&by_run);
    let t0 = std::time::Instant::now();
    let session = || {
        a.count(&format!(
            "SELECT count(*) FROM nodes WHERE id = '{run_id}' AND connected = 1"
        ))
    };
    while !(leaf_of(&by_run).1 != run_leaf && session() == 1) {
        if t0.elapsed() > Duration::from_secs(30) || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            let o = child.wait_with_output().unwrap();
            panic!(
                "no re-join and session: {}",
                String::from_utf8_lossy(&o.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(leaf_of(&by_run).0, run_id);
    let _ = child.kill();
    let _ = child.wait();
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(ev["nodeId"], run_id.as_str());
    assert_eq!(ev["attestor"], "x509pop");
}

#[test]
fn x509pop_is_off_by_default_and_bounded_by_its_window() {
    // Off (the default): the challenge itself is refused, and recorded.
    let mut a = Appliance::start_cfg("file", &[], |c| {
        c.replace("cert_ttl_seconds = 86400", "cert_ttl_seconds = 10")
    });
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({"maxUses": 5}));
    let n = held(&sim, &token, &machine());
    let dir = joined_agent_dir(&a, &token);
    let before = nodes_and_certs(&a);
    let raw = challenge(&sim.cfg).unwrap_err();
    assert_refused(&a, &raw, "x509pop:disabled", &a.root_tenant(), &before);
    assert_eq!(a.count("SELECT count(*) FROM x509pop_challenges"), 0);
    // A join naming x509pop is refused the same way.
    let (raw, _, _) = rejoin_raw(&sim.cfg, &n.leaf, &n.key, &n.id, &("x".into(), vec![1; 32]));
    assert_refused(&a, &raw, "x509pop:disabled", &a.root_tenant(), &before);
    std::thread::sleep(Duration::from_secs(11));
    // `agent run` tries, is refused, and says the way back.
    let o = agent_cmd(&dir, &["run"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        err.contains("the certificate expired at")
            && err.contains("the x509pop re-join failed: Join refused"),
        "{err}"
    );
    // `agent join --attestor x509pop` takes no token, claims or reset.
    let o = agent_cmd(&dir, &["join", "--attestor", "x509pop", "--reset", "--yes"]);
    assert_eq!(
        o.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("takes no token, claims"));

    // On, with a window of 1 s: a certificate expired 10 s ago is too long gone.
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        replace_table(
            &text,
            "x509pop",
            "[x509pop]\nenabled = true\nmax_expired_seconds = 1\n\n",
        ),
    )
    .unwrap();
    a.restart();
    let before = nodes_and_certs(&a);
    let ch = challenge(&sim.cfg).unwrap();
    let (raw, _, _) = rejoin_raw(&sim.cfg, &n.leaf, &n.key, &n.id, &ch);
    let root = a.root_tenant();
    assert_refused(&a, &raw, "x509pop:expired-too-long", &root, &before);
    // A window past 7 days is refused at start.
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        replace_table(
            &text,
            "x509pop",
            "[x509pop]\nenabled = true\nmax_expired_seconds = 604801\n\n",
        ),
    )
    .unwrap();
    a.stop();
    let o = serve_exit(&a.state(), PASSPHRASE);
    assert_ne!(o.status.code(), Some(0));
    assert!(
        String::from_utf8_lossy(&o.stderr)
            .contains("x509pop.max_expired_seconds must be 1 to 604800"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// A TPM-bound node (its certificate names its AK) comes back only with a new key that AK
/// certifies, as at renewal; the statement stays on the new certificate.
#[test]
fn a_tpm_bound_node_comes_back_only_with_its_aks_attestation_of_the_new_key() {
    let tpm = crate::tpm::Swtpm::start(true);
    let a = Appliance::start_cfg("file", &[], |c| x509pop_on(c, 604_800));
    let sim = Sim::new(&a);
    let pool = a.pool("tpm-rack");
    let (_, ak) = crate::tpmjoin::allow_ek(&a, &tpm.tcti(), &pool);
    let dir = a.agent_dir();
    let claims = write_claims(&a, &machine());
    let o = crate::tpmjoin::tpm_join(&dir, &claims, &tpm, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let node = String::from_utf8(o.stdout).unwrap().trim().to_string();
    let statement = format!("urn:bc:tpm-ak:sha256:{}", &ak[4..]);
    let cur = bca::agent::run::load_identity(&dir.join("data")).unwrap();
    let old = bca::proto::x509::parse_node_leaf(&cur.chain_der[0]).unwrap();
    assert_eq!(old.statements, vec![statement.clone()]);
    wait_for("the certificate to expire", 15, || {
        (cur.not_after < bca::base::clock::now()).then_some(())
    });

    // The right key's proof, but a new key outside the TPM with no attestation: refused.
    let before = nodes_and_certs(&a);
    let ch = challenge(&sim.cfg).unwrap();
    let (raw, _, _) = rejoin_signed(
        &sim.cfg,
        &cur.chain_der[0],
        &|m| cur.key.sign(X509POP_PURPOSE, m).unwrap(),
        &node,
        &ch,
    );
    assert_refused(
        &a,
        &raw,
        "x509pop:key-attestation",
        &a.root_tenant(),
        &before,
    );

    // The agent makes the next key in the TPM and has the AK certify it: admitted, the
    // statement kept, the node key still `tpm`.
    let o = agent_cmd(&dir, &["join", "--attestor", "x509pop"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let now = bca::agent::run::load_identity(&dir.join("data")).unwrap();
    let new = bca::proto::x509::parse_node_leaf(&now.chain_der[0]).unwrap();
    assert_eq!(new.node_id, node);
    assert_eq!(new.statements, vec![statement]);
    assert!(now.key.tpm().is_some());
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(ev["attestor"], "x509pop");
    assert_eq!(ev["nodeKey"], "tpm");
    assert_eq!(ev["previousSerial"], old.serial_hex.as_str());
}

/// The attacks a fresh-eyes review tried against the running appliance (2026-12-07), each kept:
/// a replayed answer, a race of re-joins, the appliance's own certificates presented, a proof
/// made under another purpose, a deleted node, an archived pool.
#[test]
fn the_reviews_attacks_on_x509pop_are_refused() {
    let a = Appliance::start_cfg("file", &[], |c| x509pop_on(c, 604_800));
    let sim = Sim::new(&a);
    let root = a.root_tenant();
    let pool = a.pool("rack-a");
    let pool2 = a.pool("rack-b");
    let (_, token) = a.token(&pool, json!({"maxUses": 10}));
    let (_, token2) = a.token(&pool2, json!({"maxUses": 2}));
    let replayed = held(&sim, &token, &machine());
    let raced = held(&sim, &token, &machine());
    let purpose = held(&sim, &token, &machine());
    let deleted = held(&sim, &token, &machine());
    let archived = held(&sim, &token2, &machine());
    std::thread::sleep(Duration::from_secs(11));

    // A captured good request, sent again: its challenge is spent.
    let ch = challenge(&sim.cfg).unwrap();
    let new = SigningKey::generate();
    let sign = |m: &[u8]| replayed.key.sign(X509POP_PURPOSE, m);
    let first = rejoin_keyed(&sim.cfg, &replayed.leaf, &sign, &replayed.id, &ch, &new);
    assert!(serde_json::from_slice::<Reply>(&first)
        .unwrap()
        .join_response
        .is_some());
    let before = nodes_and_certs(&a);
    let again = rejoin_keyed(&sim.cfg, &replayed.leaf, &sign, &replayed.id, &ch, &new);
    assert_refused(&a, &again, "x509pop:challenge", &root, &before);

    // Eight re-joins of one node at once, each with its own challenge and key: one certificate.
    let certs = a.count("SELECT count(*) FROM node_certs");
    let chs: Vec<_> = (0..8).map(|_| challenge(&sim.cfg).unwrap()).collect();
    let issued = std::thread::scope(|s| {
        let hs: Vec<_> = chs
            .iter()
            .map(|ch| {
                let (cfg, r) = (&sim.cfg, &raced);
                s.spawn(move || {
                    let (raw, _, _) = rejoin_raw(cfg, &r.leaf, &r.key, &r.id, ch);
                    serde_json::from_slice::<Reply>(&raw)
                        .unwrap()
                        .join_response
                        .is_some()
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .filter(|x| *x)
            .count()
    });
    assert_eq!(issued, 1);
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), certs + 1);

    // The appliance's own certificates are not a node's.
    let before = nodes_and_certs(&a);
    for f in [
        "node-ca.pem",
        "serving-ca.pem",
        "gateway.pem",
        "join-signing.pem",
    ] {
        let pem = std::fs::read_to_string(a.state().join("pki").join(f)).unwrap();
        let der = bca::proto::x509::pem_decode_all(&pem, "CERTIFICATE").remove(0);
        let ch = challenge(&sim.cfg).unwrap();
        let (raw, _, _) = rejoin_raw(&sim.cfg, &der, &purpose.key, &purpose.id, &ch);
        assert_refused(&a, &raw, "x509pop:unknown", &root, &before);
    }

    // The right key, but under the renewal's purpose: no proof.
    let ch = challenge(&sim.cfg).unwrap();
    let (raw, _, _) = rejoin_signed(
        &sim.cfg,
        &purpose.leaf,
        &|m| purpose.key.sign(bca::proto::protocol::RENEW_POP_PURPOSE, m),
        &purpose.id,
        &ch,
    );
    assert_refused(&a, &raw, "x509pop:pop", &root, &before);

    // A deleted node: its certificates are gone with it.
    a.api_ok(
        "nodes/delete",
        json!({"tenantId": root, "nodeId": deleted.id}),
    );
    refuses(
        &a,
        &sim.cfg,
        (&deleted.leaf, &deleted.key, &deleted.id),
        "x509pop:unknown",
        &root,
    );

    // An archived pool admits no one.
    a.api_ok("pools/archive", json!({"tenantId": root, "poolId": pool2}));
    refuses(
        &a,
        &sim.cfg,
        (&archived.leaf, &archived.key, &archived.id),
        "join:pool",
        &root,
    );
}
