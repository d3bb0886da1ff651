//! The `tpm` attestor end to end: a machine with a swtpm joins with no token, its certificate
//! names its AK (as openssl reads it), renewals must carry the AK's attestation of the new key,
//! a known EK reclaims its node, and an unknown EK waits for an operator.

use crate::common::*;
use crate::tpm::Swtpm;
use bca::agent::nodekey::NodeKey;
use bca::base::crypto;
use bca::proto::agent_config::AgentConfig;
use bca::proto::protocol::{KeyAttestation, RenewRequest, Reply, Request};
use serde_json::Value;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

/// `bca agent join --attestor tpm` with no token anywhere, not yet run.
fn tpm_join_cmd(dir: &Path, claims: &Path, tpm: &Swtpm, extra: &[&str]) -> Command {
    let mut c = Command::new(bin());
    c.args([
        "agent",
        "join",
        "--attestor",
        "tpm",
        "--tpm",
        &tpm.tcti(),
        "--config",
    ])
    .arg(dir.join("config.toml"))
    .arg("--data-dir")
    .arg(dir.join("data"))
    .arg("--claims")
    .arg(claims)
    .args(extra)
    .env_remove("BCD_JOIN_TOKEN")
    .stdin(Stdio::null());
    c
}

/// The operator reads the machine's EK hash and AK Name with `bca tpm status` (on the machine,
/// TPM `tcti`) and allows the EK into `pool`: (EK hash, AK Name).
pub(crate) fn allow_ek(a: &Appliance, tcti: &str, pool: &str) -> (String, String) {
    let status = a.cli_json(&["tpm", "status", "--tpm", tcti]);
    let hash = status["ek"]["rsa"]["publicKeySha256"]
        .as_str()
        .unwrap()
        .to_string();
    let ak = status["ak"]["name"].as_str().unwrap().to_string();
    a.cli_json(&["tpm", "allow-ek", &hash, "--pool", pool]);
    (hash, ak)
}

/// The manufacturer's CAs as an EK CA bundle in the appliance's folder: here swtpm_setup's local
/// CA, its issuing CA and its root.
pub(crate) fn ek_ca_bundle(a: &Appliance) -> std::path::PathBuf {
    let bundle = a.dir.path().join("ek-cas.pem");
    let mut pem = std::fs::read_to_string("/var/lib/swtpm-localca/issuercert.pem").unwrap();
    pem.push_str(
        &std::fs::read_to_string("/var/lib/swtpm-localca/swtpm-localca-rootca-cert.pem").unwrap(),
    );
    std::fs::write(&bundle, pem).unwrap();
    bundle
}

/// [`tpm_join_cmd`], run to its end.
pub(crate) fn tpm_join(dir: &Path, claims: &Path, tpm: &Swtpm, extra: &[&str]) -> Output {
    tpm_join_cmd(dir, claims, tpm, extra).output().unwrap()
}

fn leaf_text(dir: &Path) -> String {
    let id: Value =
        serde_json::from_slice(&std::fs::read(dir.join("data/identity.json")).unwrap()).unwrap();
    let pem = id["certificateChain"][0].as_str().unwrap().to_string();
    let p = dir.join("leaf.pem");
    std::fs::write(&p, pem).unwrap();
    let o = output_ok(
        Command::new("openssl")
            .args(["x509", "-noout", "-text", "-in"])
            .arg(&p),
    );
    String::from_utf8(o.stdout).unwrap()
}

/// One renewal request over a fresh mTLS connection (the gateway closes after answering).
fn renew_raw(cfg: &AgentConfig, cur: &bca::agent::run::Loaded, req: RenewRequest) -> Reply {
    rt().block_on(async {
        let mut s = bca::agent::connect_as(cfg, cur.chain_der.clone(), &cur.key)
            .await
            .unwrap();
        let raw = bca::agent::roundtrip(
            cfg,
            &mut s,
            &serde_json::to_vec(&Request {
                v: 1,
                renew: Some(req),
                ..Default::default()
            })
            .unwrap(),
        )
        .await
        .unwrap();
        serde_json::from_slice(&raw).unwrap()
    })
}

/// A renewal request for `csr` proving the current key, with `attestation`.
fn renewal(
    cur: &bca::agent::run::Loaded,
    csr: &[u8],
    attestation: Option<KeyAttestation>,
) -> RenewRequest {
    let now = bca::base::clock::now();
    let msg =
        bca::proto::protocol::renew_pop_message(&crypto::sha256(csr), &cur.identity.node_id, now);
    RenewRequest {
        csr: crypto::b64(csr),
        chain: cur.identity.certificate_chain.clone(),
        client_time: now,
        pop_sig: crypto::b64(
            &cur.key
                .sign(bca::proto::protocol::RENEW_POP_PURPOSE, &msg)
                .unwrap(),
        ),
        key_attestation: attestation,
    }
}

/// The AK's certification of `certified` over `qualifying`, as a renewal carries it.
fn attestation(key: &NodeKey, certified: &NodeKey, qualifying: &[u8]) -> KeyAttestation {
    let k = key.tpm().unwrap();
    let c = certified.tpm().unwrap();
    let (_, ak_public) = k.with_tpm(|t| t.ak_public()).unwrap();
    let cert = k.with_tpm(|t| t.certify(c.blob(), qualifying)).unwrap();
    KeyAttestation {
        ak_public: crypto::b64(&ak_public),
        key_public: crypto::b64(&c.blob().public),
        attest: crypto::b64(&cert.attest),
        signature: crypto::b64(&cert.signature),
    }
}

fn assert_renew_refused(a: &Appliance, reply: &Reply, reason: &str) {
    let e = reply.error.as_ref().expect("refused");
    assert_eq!(
        (e.code.as_str(), e.message.as_str()),
        ("ACCESS_DENIED", "Renew refused")
    );
    let (_, ev) = a.last_event("security.renew.refused").unwrap();
    assert_eq!(ev["reason"], reason, "{ev}");
}

#[test]
fn a_machine_joins_with_its_tpm_renews_only_with_its_ak_and_reclaims_its_node() {
    let tpm = Swtpm::start(true);
    let a = Appliance::start();
    let pool = a.pool("tpm-rack");
    // The operator reads the machine's EK hash and AK with `bca tpm status` on the machine.
    let (hash, ak) = allow_ek(&a, &tpm.tcti(), &pool);

    let dir = a.agent_dir();
    let claims = write_claims(&a, &machine());
    let o = tpm_join(&dir, &claims, &tpm, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let node = String::from_utf8(o.stdout).unwrap().trim().to_string();
    assert!(node.starts_with("node_"), "{node}");

    // node.key holds only the key's record: no private key a thief could use elsewhere.
    let key_file = dir.join("data/node.key");
    assert_eq!(
        std::fs::metadata(&key_file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let record: Value = serde_json::from_slice(&std::fs::read(&key_file).unwrap()).unwrap();
    assert_eq!(record["kind"], "tpm");
    assert_eq!(record["tpm"], tpm.tcti());
    assert!(!String::from_utf8_lossy(&std::fs::read(&key_file).unwrap()).contains("PRIVATE KEY"));

    // The certificate: the SPIFFE ID first, then the AK statement, as openssl reads them.
    let text = leaf_text(&dir);
    let statement = format!("urn:bc:tpm-ak:sha256:{}", &ak[4..]);
    let spiffe = text.find(&format!("/node/{node}")).expect(&text);
    let urn = text.find(&format!("URI:{statement}")).expect(&text);
    assert!(spiffe < urn, "{text}");

    let (tenant, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(tenant, a.root_tenant());
    assert_eq!(ev["attestor"], "tpm");
    assert_eq!(ev["nodeKey"], "tpm");
    assert_eq!(ev["reclaim"], false);
    assert_eq!(ev["ekSha256"], hash.as_str());
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM audit WHERE action = 'node.joined' AND target = '{node}' AND actor = 'tpm:{hash}'"
        )),
        1
    );
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM nodes WHERE id = '{node}' AND attestor = 'tpm' AND tpm_ek_sha256 = '{hash}' AND state = 'adopted'"
        )),
        1
    );
    tpm.assert_nothing_loaded(a.dir.path());

    // Renewals: the leaf names the AK, so the new key must be certified by it.
    let data = dir.join("data");
    let cfg = AgentConfig::load(&dir.join("config.toml")).unwrap();
    let cur = bca::agent::run::load_identity(&data).unwrap();
    let tcti: bca::tpm::Tcti = tpm.tcti().parse().unwrap();
    // A new key and CSR for each attempt (the same proof twice is a replay).
    let fresh = || {
        let k = NodeKey::generate_in(&tcti).unwrap();
        let csr = k.csr().unwrap();
        (k, csr)
    };
    let certs = a.count("SELECT count(*) FROM node_certs");

    let (_, csr) = fresh();
    let r = renew_raw(&cfg, &cur, renewal(&cur, &csr, None));
    assert_renew_refused(&a, &r, "renew:key-attestation-missing");

    // Another AK: the EK's public area where the AK's belongs.
    let (next, csr) = fresh();
    let mut wrong_ak = attestation(&cur.key, &next, &crypto::sha256(&csr));
    let ek = next
        .tpm()
        .unwrap()
        .with_tpm(|t| t.ek_public_area(bca::tpm::EkAlg::Ecc))
        .unwrap();
    wrong_ak.ak_public = crypto::b64(&ek);
    let r = renew_raw(&cfg, &cur, renewal(&cur, &csr, Some(wrong_ak)));
    assert_renew_refused(&a, &r, "renew:key-attestation-ak");

    // The certification of another TPM key than the CSR's.
    let (_, csr) = fresh();
    let (other, _) = fresh();
    let r = renew_raw(
        &cfg,
        &cur,
        renewal(
            &cur,
            &csr,
            Some(attestation(&cur.key, &other, &crypto::sha256(&csr))),
        ),
    );
    assert_renew_refused(&a, &r, "renew:node-key-mismatch");

    // Over another nonce than the CSR's hash.
    let (next, csr) = fresh();
    let r = renew_raw(
        &cfg,
        &cur,
        renewal(&cur, &csr, Some(attestation(&cur.key, &next, &[7u8; 32]))),
    );
    assert_renew_refused(&a, &r, "renew:node-key-attestation");

    // A key outside the TPM, with a valid-looking attestation of a TPM key: refused too.
    let soft = NodeKey::generate();
    let soft_csr = soft.csr().unwrap();
    let r = renew_raw(
        &cfg,
        &cur,
        renewal(
            &cur,
            &soft_csr,
            Some(attestation(&cur.key, &next, &crypto::sha256(&soft_csr))),
        ),
    );
    assert_renew_refused(&a, &r, "renew:node-key-mismatch");
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), certs);

    // The agent's own renewal: attested, accepted, the statement kept, the key still in the TPM.
    rt().block_on(async {
        let mut s = bca::agent::connect_as(&cfg, cur.chain_der.clone(), &cur.key)
            .await
            .unwrap();
        bca::agent::run::renew(&cfg, &data, &cur, &mut s)
            .await
            .unwrap();
    });
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), certs + 1);
    let text = leaf_text(&dir);
    assert!(text.contains(&format!("URI:{statement}")), "{text}");
    let renewed = bca::agent::run::load_identity(&data).unwrap();
    assert!(renewed.key.tpm().is_some());
    assert_ne!(renewed.key.public_point(), cur.key.public_point());
    tpm.assert_nothing_loaded(a.dir.path());

    // The session runs on the TPM-held key (mTLS signed in the TPM).
    let mut agent = agent_run(&dir);
    wait_for("the session", 20, || (connected(&a) == 1).then_some(()));
    let _ = agent.kill();
    let _ = agent.wait();

    // Joining again with the same EK reclaims the node: same id, next generation, old
    // certificates revoked.
    let o = tpm_join(&dir, &claims, &tpm, &["--reset", "--yes"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8(o.stdout).unwrap().trim(), node);
    assert_eq!(
        a.count(&format!(
            "SELECT identity_generation FROM nodes WHERE id = '{node}'"
        )),
        2
    );
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM node_certs WHERE node_id = '{node}' AND revoked_at IS NULL"
        )),
        1
    );
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(ev["reclaim"], true);
    assert_eq!(
        a.count("SELECT count(*) FROM audit WHERE action = 'node.reclaimed'"),
        1
    );

    // A TPM that derives another AK (a fresh TPM at the same address) fails the renewal loudly,
    // before sending anything.
    drop(agent);
    let cur = bca::agent::run::load_identity(&data).unwrap();
    let before = a.count("SELECT count(*) FROM events WHERE type LIKE 'security.renew%'");
    drop(tpm);
    let fresh = Swtpm::start(false);
    let moved = dir.join("data-moved");
    std::fs::create_dir(&moved).unwrap();
    let record = std::fs::read_to_string(data.join("node.key")).unwrap();
    let old_tcti = cur.key.tpm().unwrap().tcti();
    // The record points at the fresh TPM; the key inside it does not load there.
    std::fs::write(
        moved.join("node.key"),
        record.replace(&old_tcti, &fresh.tcti()),
    )
    .unwrap();
    std::fs::copy(data.join("identity.json"), moved.join("identity.json")).unwrap();
    let loaded = bca::agent::run::load_identity(&moved).unwrap();
    let e = rt()
        .block_on(async {
            let mut s = bca::agent::connect(&cfg, None).await.unwrap();
            bca::agent::run::renew(&cfg, &moved, &loaded, &mut s).await
        })
        .unwrap_err();
    assert!(
        e.message.contains("another AK") && e.message.contains("--attestor tpm"),
        "{e}"
    );
    assert_eq!(
        a.count("SELECT count(*) FROM events WHERE type LIKE 'security.renew%'"),
        before
    );
    // A TPM that is gone: the identity does not load, so `bca agent run` stops with the reason.
    let gone = fresh.tcti();
    drop(fresh);
    std::fs::write(moved.join("node.key"), record.replace(&old_tcti, &gone)).unwrap();
    let e = match bca::agent::run::load_identity(&moved) {
        Err(e) => e,
        Ok(_) => panic!("a node key whose TPM is gone loaded"),
    };
    assert!(e.message.contains("cannot be opened"), "{e}");
    let o = Command::new(bin())
        .args(["agent", "run", "--config"])
        .arg(dir.join("config.toml"))
        .arg("--data-dir")
        .arg(&moved)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("cannot be opened"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn an_unknown_ek_waits_for_an_operator_and_bad_evidence_is_refused_alike() {
    // A TPM without certificates: its RSA EK's public area stands for it.
    let tpm = Swtpm::start(false);
    let a = Appliance::start();
    let pool = a.pool("tpm-rack");
    let dir = a.agent_dir();
    let claims = write_claims(&a, &machine());
    let cfg = a.agent_config(&dir);

    // Bad evidence on the wire: each answered with the one refusal, each recorded with its reason.
    let refused = |req: &Request, reason: &str| {
        let raw = bca::agent::exchange_raw(&cfg, &serde_json::to_vec(req).unwrap()).unwrap();
        assert_eq!(raw, refused_bytes(), "{}", String::from_utf8_lossy(&raw));
        let (_, ev) = a.last_event("security.join.refused").unwrap();
        assert_eq!(ev["reason"], reason, "{ev}");
        assert_eq!(ev["attestor"], "tpm", "{ev}");
    };
    let nodes = a.count("SELECT count(*) FROM nodes");
    refused(
        &Request {
            v: 1,
            tpm_challenge: Some(bca::proto::protocol::TpmChallengeRequest {
                ek_public: crypto::b64(b"not a public area"),
                ek_certificate: None,
                ak_public: crypto::b64(b"nor this"),
            }),
            ..Default::default()
        },
        "tpm:malformed",
    );
    let tcti: bca::tpm::Tcti = tpm.tcti().parse().unwrap();
    let key = NodeKey::generate_in(&tcti).unwrap();
    let csr = key.csr().unwrap();
    let join = |ev: Option<bca::proto::protocol::TpmEvidence>, csr: &[u8]| Request {
        v: 1,
        join: Some(bca::proto::protocol::JoinRequest {
            sealed_token: String::new(),
            csr: crypto::b64(csr),
            claims: serde_json::from_value(machine()).unwrap(),
            attestor: "tpm".into(),
            role: "node".into(),
            tpm: ev,
            x509pop: None,
            node_id: None,
        }),
        ..Default::default()
    };
    refused(&join(None, &csr), "tpm:malformed");
    // An AK that is no AK: the EK (a decryption key) in its place.
    let ek = key
        .tpm()
        .unwrap()
        .with_tpm(|t| t.ek_public_area(bca::tpm::EkAlg::Rsa))
        .unwrap();
    refused(
        &Request {
            v: 1,
            tpm_challenge: Some(bca::proto::protocol::TpmChallengeRequest {
                ek_public: crypto::b64(&ek),
                ek_certificate: None,
                ak_public: crypto::b64(&ek),
            }),
            ..Default::default()
        },
        "tpm:ak",
    );
    // A certification made for another CSR.
    let good = bca::agent::tpm_evidence(&cfg, &key, &csr, false).unwrap();
    let other = NodeKey::generate_in(&tcti).unwrap().csr().unwrap();
    refused(&join(Some(good.clone()), &other), "tpm:certify");
    // A secret the TPM did not activate: the certification is bound to the real one.
    let good = bca::agent::tpm_evidence(&cfg, &key, &csr, false).unwrap();
    let mut wrong = good.clone();
    wrong.credential = crypto::b64(&[9u8; 32]);
    refused(&join(Some(wrong), &csr), "tpm:certify");
    // A machine that asked not to be queued (the ramdisk's --no-enroll): refused, no request.
    let quiet = bca::agent::tpm_evidence(&cfg, &key, &csr, true).unwrap();
    refused(&join(Some(quiet), &csr), "tpm:ek-unknown");
    // A flood of challenges from one source evicts that source's oldest, never the attestor:
    // the first challenge, 16 challenges later, is gone; a fresh one still works (below).
    let evicted = bca::agent::tpm_evidence(&cfg, &key, &csr, false).unwrap();
    let (_, ak_public) = key.tpm().unwrap().with_tpm(|t| t.ak_public()).unwrap();
    for _ in 0..16 {
        let ask = Request {
            v: 1,
            tpm_challenge: Some(bca::proto::protocol::TpmChallengeRequest {
                ek_public: crypto::b64(&ek),
                ek_certificate: None,
                ak_public: crypto::b64(&ak_public),
            }),
            ..Default::default()
        };
        let raw = bca::agent::exchange_raw(&cfg, &serde_json::to_vec(&ask).unwrap()).unwrap();
        let reply: Reply = serde_json::from_slice(&raw).unwrap();
        assert!(
            reply.tpm_challenge.is_some(),
            "{}",
            String::from_utf8_lossy(&raw)
        );
    }
    assert_eq!(a.count("SELECT count(*) FROM tpm_challenges"), 16);
    refused(&join(Some(evicted), &csr), "tpm:challenge");
    let good = bca::agent::tpm_evidence(&cfg, &key, &csr, false).unwrap();
    assert_eq!(a.count("SELECT count(*) FROM nodes"), nodes);
    assert_eq!(a.count("SELECT count(*) FROM join_requests"), 0);
    // The right evidence: the EK is on no allow-list, so the answer is a signed deferral and a
    // join request; the same evidence again is refused, its challenge spent.
    let raw = bca::agent::exchange_raw(
        &cfg,
        &serde_json::to_vec(&join(Some(good.clone()), &csr)).unwrap(),
    )
    .unwrap();
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    let d = reply.join_deferred.expect("deferred");
    bca::agent::verify_deferral(&cfg, &d, &csr).unwrap();
    refused(&join(Some(good), &csr), "tpm:challenge");
    assert_eq!(a.count("SELECT count(*) FROM nodes"), nodes);
    assert_eq!(
        a.count("SELECT count(*) FROM join_requests WHERE state = 'pending'"),
        1
    );

    // The machine joins; its EK is on no allow-list, so it waits for an operator.
    let mut agent = tpm_join_cmd(
        &dir,
        &claims,
        &tpm,
        &["--retry-seconds", "1", "--wait-seconds", "60"],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let hash = a.cli_json(&["tpm", "status", "--tpm", &tpm.tcti()])["ek"]["rsa"]["publicKeySha256"]
        .as_str()
        .unwrap()
        .to_string();
    // The machine's attempt refreshes the pending request with its own CSR (a newer attempt
    // replaces an older one's).
    let mine = crypto::hex(&crypto::sha256(&csr));
    let request = wait_for("the machine's join request", 20, || {
        a.cli_json(&["join-requests", "list"])["items"]
            .as_array()
            .unwrap()
            .first()
            .filter(|r| r["csrSha256"] != mine.as_str())
            .cloned()
    });
    assert_eq!(request["attestor"], "tpm");
    assert_eq!(request["vouchedBy"], format!("tpm-ek:{hash}"));
    // A TPM without an EK certificate: nothing vouches for its EK but the operator.
    assert_eq!(request["ekCertified"], false);
    let id = request["id"].as_str().unwrap().to_string();
    assert_eq!(a.count("SELECT count(*) FROM nodes"), nodes);
    a.cli_json(&["join-requests", "approve", &id, "--pool", &pool]);
    let t = std::time::Instant::now();
    while agent.try_wait().unwrap().is_none() && t.elapsed().as_secs() < 30 {
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let _ = agent.kill();
    let o = agent.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "{}\n{:?}",
        String::from_utf8_lossy(&o.stderr),
        a.last_event("security.join.refused")
    );
    let node = String::from_utf8(o.stdout).unwrap().trim().to_string();
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(ev["nodeId"], node.as_str());
    assert_eq!(ev["nodeKey"], "tpm");
    assert_eq!(ev["joinRequestId"], id.as_str());
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM join_requests WHERE id = '{id}' AND state = 'consumed' AND node_id = '{node}'"
        )),
        1
    );
    tpm.assert_nothing_loaded(a.dir.path());
}

#[test]
fn without_enrollment_an_unknown_ek_is_refused_and_the_pool_is_checked_at_every_join() {
    let tpm = Swtpm::start(true);
    let mut a = Appliance::start_cfg("file", &[], |c| {
        replace_table(&c, "tpm_attestor", "[tpm_attestor]\nenrollment = false\n\n")
    });
    let dir = a.agent_dir();
    let claims = write_claims(&a, &machine());
    let o = tpm_join(&dir, &claims, &tpm, &[]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("Join refused"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let (_, ev) = a.last_event("security.join.refused").unwrap();
    assert_eq!(ev["reason"], "tpm:ek-unknown");
    assert_eq!(a.count("SELECT count(*) FROM join_requests"), 0);
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 0);
    assert!(!dir.join("data/identity.json").exists());

    // The allow-list has no foreign key: a pool that stopped accepting the attestor, or was
    // archived, refuses the EK at the join.
    let pool = a.pool("tpm-rack");
    allow_ek(&a, &tpm.tcti(), &pool);
    a.api_ok(
        "pools/update",
        serde_json::json!({"tenantId": a.root_tenant(), "poolId": pool,
            "policy": {"joinAttestors": ["join-token"]}}),
    );
    let o = tpm_join(&dir, &claims, &tpm, &[]);
    assert_eq!(o.status.code(), Some(1));
    let (tenant, ev) = a.last_event("security.join.refused").unwrap();
    assert_eq!(ev["reason"], "join:pool-attestor");
    assert_eq!(tenant, a.root_tenant());
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 0);

    // A bad [tpm_attestor] value: serve names it and starts nothing.
    a.stop();
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        replace_table(
            &text,
            "tpm_attestor",
            "[tpm_attestor]\nenrollment = false\ncert_ttl_seconds = 5\n\n",
        ),
    )
    .unwrap();
    let out = serve_exit(&a.state(), PASSPHRASE);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("tpm_attestor.cert_ttl_seconds must be 10 to 86400"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A `tpm` join from a fresh agent directory that does not wait: it exits 1, its request still
/// pending.
fn join_waits(a: &Appliance, tpm: &Swtpm) {
    let o = tpm_join(
        &a.agent_dir(),
        &write_claims(a, &machine()),
        tpm,
        &["--wait-seconds", "0"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("still pending"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn an_ek_the_ek_ca_bundle_certifies_joins_its_pool_and_others_wait() {
    let tpm = Swtpm::start(true);
    let bare = Swtpm::start(false);
    let mut a = Appliance::start();
    let pool = a.pool("certified");
    let bundle = ek_ca_bundle(&a);

    a.stop();
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let section = |b: &str, p: Option<&str>| {
        let mut s = format!("[tpm_attestor]\nenrollment = true\nek_ca_bundle = \"{b}\"\n");
        if let Some(p) = p {
            s.push_str(&format!("ek_ca_pool = \"{p}\"\n"));
        }
        s.push('\n');
        s
    };
    let b = bundle.to_str().unwrap();
    let not_pem = cfg.to_str().unwrap();
    for (sec, says) in [
        (section(b, None), "go together"),
        (
            section("ek-cas.pem", Some(&pool)),
            "must be an absolute path",
        ),
        (section(not_pem, Some(&pool)), "holds no PEM certificate"),
    ] {
        std::fs::write(&cfg, replace_table(&text, "tpm_attestor", &sec)).unwrap();
        let out = serve_exit(&a.state(), PASSPHRASE);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{says}: {err}");
    }
    std::fs::write(
        &cfg,
        replace_table(&text, "tpm_attestor", &section(b, Some(&pool))),
    )
    .unwrap();
    a.serve(PASSPHRASE);

    // A TPM whose EK certificate the bundle's CA issued joins the bundle's pool, on no list.
    let dir = a.agent_dir();
    let o = tpm_join(&dir, &write_claims(&a, &machine()), &tpm, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(ev["admittedBy"], "ek-ca");
    assert_eq!(ev["ekCertified"], true);
    assert_eq!(ev["poolId"], pool.as_str());
    assert_eq!(a.count("SELECT count(*) FROM tpm_eks"), 0);

    // Retired, the machine is cut off from the bundle's trust: its next join waits for an
    // operator instead of becoming a new node.
    let node = ev["nodeId"].as_str().unwrap().to_string();
    a.cli_json(&["nodes", "retire", &node]);
    join_waits(&a, &tpm);
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 1);
    assert_eq!(
        a.count("SELECT count(*) FROM join_requests WHERE attestor = 'tpm' AND state = 'pending'"),
        1
    );

    // A TPM with no EK certificate: nothing vouches for it, so it waits for an operator.
    join_waits(&a, &bare);
    assert_eq!(
        a.count("SELECT count(*) FROM join_requests WHERE attestor = 'tpm' AND state = 'pending'"),
        2
    );
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 1);
}
