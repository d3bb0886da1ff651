//! Two appliances serving one site from one PostgreSQL database (docs/scale-out.md): the second
//! joined with `bca join-site`, approved by an operator with `bca site appliances approve` on the
//! first; every single-use thing used once whichever appliance a machine reaches.

use crate::common::*;
use crate::renew::{join_node, last_renew_reason, renew_raw, renew_refused, send};
use bca::proto::protocol::Reply;
use bca::store::pg_cluster::Cluster;
use serde_json::{json, Value};
use std::process::{Command, Stdio};

/// A state directory made by `bca join-site` (not yet serving).
struct Joining {
    dir: tempfile::TempDir,
}

impl Joining {
    fn state(&self) -> std::path::PathBuf {
        self.dir.path().join("state")
    }

    fn cli(&self, args: &[&str]) -> std::process::Output {
        Command::new(bin())
            .args(args)
            .env("BCA_STATE_DIR", self.state())
            .env_remove("BCA_SOCKET")
            .output()
            .unwrap()
    }
}

fn join_site(url: &str, extra: &[&str]) -> (Joining, std::process::Output) {
    let j = Joining {
        dir: tempfile::tempdir().unwrap(),
    };
    let out = j.cli(
        &[
            &["join-site", "--store", url, "--key-protection", "file"][..],
            extra,
            &["--json"],
        ]
        .concat(),
    );
    (j, out)
}

/// A free TCP port on loopback (for an appliance whose URL must be known before it serves).
fn free_tcp() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn admitted(raw: &[u8]) -> bool {
    serde_json::from_slice::<Reply>(raw)
        .map(|r| r.join_response.is_some())
        .unwrap_or(false)
}

fn appliances(a: &Appliance) -> Vec<Value> {
    a.cli_json(&["site", "appliances", "list"])["items"]
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn two_appliances_on_one_postgres_share_the_site_and_spend_nothing_twice() {
    let c = Cluster::shared();
    let url = c.new_database();
    // A: the site's first appliance, with DHCP sightings on loopback and its gateway named.
    let mut a = crate::discovery::appliance_with("always", &["--store", &url]);

    // Bad joins change nothing: a SQLite store, no name, a bad name, a database with no site.
    let before = a.count("SELECT count(*) FROM site_appliances");
    for (args, want) in [
        (vec!["--gateway-san", "b.example"], "postgres"),
        (vec!["--gateway-san", "not a name!"], "neither a DNS name"),
    ] {
        let store = if want == "postgres" {
            "/tmp/bca.db"
        } else {
            &url
        };
        let j = Joining {
            dir: tempfile::tempdir().unwrap(),
        };
        let o = j.cli(
            &[
                &["join-site", "--store", store, "--key-protection", "file"][..],
                &args,
            ]
            .concat(),
        );
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{err}");
        assert!(!j.state().join("keys").exists(), "nothing made: {err}");
    }
    let empty = c.new_database();
    let (j, o) = join_site(&empty, &["--gateway-san", "127.0.0.1"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("holds no site"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!j.state().join("config.toml").exists());
    assert_eq!(a.count("SELECT count(*) FROM site_appliances"), before);

    // B joins: its own keys, pending, its fingerprint printed.
    let b_gw = free_tcp();
    let b_url = format!("https://127.0.0.1:{b_gw}");
    let (b_dir, o) = join_site(
        &url,
        &["--gateway-san", "127.0.0.1", "--gateway-url", &b_url],
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let joined: Value = serde_json::from_slice(&o.stdout).unwrap();
    let b_id = joined["id"].as_str().unwrap().to_string();
    let fp = joined["fingerprint"].as_str().unwrap().to_string();
    assert_eq!(joined["state"], "pending");
    let keys_dir = b_dir.state().join("keys");
    assert!(keys_dir.join("appliance.json").exists());
    assert!(
        !keys_dir.join("keys.json").exists(),
        "no site keys before approval"
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(keys_dir.join("appliance.json"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );

    // A lists itself (origin) and B (pending, the same fingerprint).
    let list = appliances(&a);
    let b_row = list.iter().find(|x| x["id"] == b_id.as_str()).unwrap();
    assert_eq!(b_row["state"], "pending");
    assert_eq!(b_row["fingerprint"], fp.as_str());
    assert_eq!(b_row["holdsKeys"], false);
    let a_row = list.iter().find(|x| x["state"] == "origin").unwrap();
    let a_id = a_row["id"].as_str().unwrap().to_string();
    assert_eq!(a_row["alive"], true);

    // B's serve waits for the approval, and its doctor says so.
    let b_serve = Command::new(bin())
        .args([
            "serve",
            "--listen-http",
            "127.0.0.1:0",
            "--listen-gateway",
            &format!("127.0.0.1:{b_gw}"),
        ])
        .env("BCA_STATE_DIR", b_dir.state())
        .env("BCA_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let doctor = b_dir.cli(&["doctor"]);
    let text = String::from_utf8_lossy(&doctor.stdout).to_string()
        + &String::from_utf8_lossy(&doctor.stderr);
    assert!(
        text.contains("waits for an operator's approval") && text.contains(&fp),
        "{text}"
    );

    // Bad approvals change nothing: not an id, an unknown id, the origin removed.
    let (code, err) = a.cli_err(&["site", "appliances", "approve", "appl_nope"]);
    assert_eq!(code, "INVALID_INPUT", "{err}");
    let unknown = format!("appl_{}", "0".repeat(26));
    let (code, err) = a.cli_err(&["site", "appliances", "approve", &unknown]);
    assert_eq!(code, "NOT_FOUND", "{err}");
    let (code, err) = a.cli_err(&["site", "appliances", "remove", &a_id]);
    assert_eq!(code, "INVALID_STATE", "{err}");
    assert_eq!(
        a.count("SELECT count(*) FROM site_appliances WHERE state = 'pending'"),
        1
    );

    // The operator approves B on A.
    let ok = a.cli_json(&["site", "appliances", "approve", &b_id]);
    assert_eq!(ok["state"], "approved");
    assert_eq!(ok["fingerprint"], fp.as_str());
    let (code, _) = a.cli_err(&["site", "appliances", "approve", &b_id]);
    assert_eq!(code, "INVALID_STATE", "approved once");
    // The audit row names the appliance that wrote it.
    let audit = a.cli_json(&["audit", "list"]);
    let row = audit["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["action"] == "site.appliance.approve")
        .unwrap()
        .clone();
    assert_eq!(row["target"], b_id.as_str());
    assert_eq!(row["applianceId"], a_id.as_str());

    // B takes the site's keys and serves.
    let mut b_serve = b_serve;
    let mut line = String::new();
    use std::io::BufRead;
    std::io::BufReader::new(b_serve.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let ready: Value = serde_json::from_str(&line).unwrap_or_else(|_| panic!("B: {line:?}"));
    let mut b = Appliance {
        dir: b_dir.dir,
        child: Some(b_serve),
        http: ready["http"].as_str().unwrap().into(),
        gateway: ready["gateway"].as_str().unwrap().into(),
        socket: ready["admin"].as_str().unwrap().into(),
        init_stdout: String::new(),
    };
    let site_of = |dir: std::path::PathBuf| -> String {
        let v: toml::Value =
            toml::from_str(&std::fs::read_to_string(dir.join("config.toml")).unwrap()).unwrap();
        v["site_id"].as_str().unwrap().to_string()
    };
    assert_eq!(ready["site"], site_of(a.state()).as_str());
    assert_eq!(site_of(b.state()), site_of(a.state()));
    // Its leaf is signed by the site's serving CA for its name (openssl checks it), and its keys
    // are the site's: the same pins.
    let chain = b.state().join("pki/gateway.pem");
    let o = Command::new("openssl")
        .args(["verify", "-CAfile"])
        .arg(a.state().join("pki/serving-ca.pem"))
        .args(["-verify_ip", "127.0.0.1"])
        .arg(&chain)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read(a.state().join("pki/node-ca.pem")).unwrap(),
        std::fs::read(b.state().join("pki/node-ca.pem")).unwrap()
    );
    assert_eq!(
        std::fs::metadata(b.state().join("keys/keys.json"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    // No key is in the database in a form a reader opens: the wrapped copy is a JWE, and none of
    // the site's private keys appears in any row.
    let a_keys: Value =
        serde_json::from_slice(&std::fs::read(a.state().join("keys/keys.json")).unwrap()).unwrap();
    let dump = Command::new("pg_dump")
        .arg("-h")
        .arg(&c.dir)
        .args(["-p", &c.port.to_string(), "-U", c.user, "--data-only"])
        .arg(url.rsplit('/').next().unwrap())
        .output()
        .unwrap();
    assert!(dump.status.success());
    let dump = String::from_utf8_lossy(&dump.stdout);
    for k in [
        "nodeCa",
        "servingCa",
        "joinSigning",
        "joinEncryption",
        "gateway",
    ] {
        let v = a_keys[k].as_str().unwrap();
        assert!(!dump.contains(&v[40..80]), "{k} is in the database");
    }
    let wrapped = dump
        .split(|c: char| c.is_whitespace())
        .find(|w| w.starts_with("eyJ") && w.split('.').count() == 5)
        .expect("the wrapped copy is a compact JWE");
    let header = bca::base::crypto::b64url_decode(wrapped.split('.').next().unwrap()).unwrap();
    let header: Value = serde_json::from_slice(&header).unwrap();
    assert_eq!(header["alg"], "ECDH-ES+A256KW", "{header}");
    assert_eq!(header["enc"], "A256GCM", "{header}");

    // 20 machines race through both appliances for a token with 5 uses.
    let pool = a.pool("p1");
    let (t, token) = a.token(&pool, json!({"maxUses": 5}));
    let (sa, sb) = (Sim::new(&a), Sim::new(&b));
    let answers: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..20)
            .map(|i| {
                let sim = if i % 2 == 0 { &sa } else { &sb };
                let token = &token;
                s.spawn(move || sim.join(token, &machine()).0)
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ok = answers.iter().filter(|r| admitted(r)).count();
    let refused = answers.iter().filter(|r| **r == refused_bytes()).count();
    assert_eq!((ok, refused), (5, 15));
    assert_eq!(a.uses_left(t["id"].as_str().unwrap()), 0);
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 5);

    // A renewal proof used at A, replayed to B: refused there.
    let (_, t2) = a.token(&pool, json!({"maxUses": 1}));
    let n = join_node(&sa, &t2, &machine());
    let now = bca::base::clock::now();
    let (raw, req) = renew_raw(&sa.cfg, &n, &n.chain_pem, &n.id, &n.key, now);
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    assert!(
        reply.renew_response.is_some(),
        "{}",
        String::from_utf8_lossy(&raw)
    );
    assert_eq!(send(&sb.cfg, &n, &req), renew_refused());
    assert_eq!(last_renew_reason(&a), "renew:replay");

    // The same node renews through B with a proof of its own.
    let (raw, _) = renew_raw(&sb.cfg, &n, &n.chain_pem, &n.id, &n.key, now + 1);
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    assert!(
        reply.renew_response.is_some(),
        "{}",
        String::from_utf8_lossy(&raw)
    );

    // A join key rotation is not carried to the other appliances yet: refused, nothing changed.
    let (code, err) = a.cli_err(&["pki", "rotate", "join-signing"]);
    assert_eq!(code, "INVALID_STATE", "{err}");
    assert!(err.contains("several appliances"), "{err}");
    assert!(!a.state().join("pki/join-signing.next.pem").exists());

    // An agent configured with both gateways holds its session on A; A is killed: the session
    // moves to B.
    let d = a.dir.path().join("agent-both");
    let o = a.cli(&[
        "daemon",
        "agent-config",
        "--gateway-url",
        &format!("https://{}", a.gateway),
        "--gateway-url",
        &b_url,
        "--out",
        d.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let (_, t3) = a.token(&pool, json!({"maxUses": 1}));
    let o = agent_join(&d, "data", &write_claims(&a, &machine()), &t3, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let node3 = String::from_utf8_lossy(&o.stdout).trim().to_string();
    let mut agent3 = agent_run(&d);
    let held_by = |x: &Appliance, by: &str| {
        x.count(&format!(
            "SELECT count(*) FROM nodes WHERE id = '{node3}' AND connected = 1 AND session_appliance = '{by}'"
        )) == 1
    };
    wait_for("the session on A", 30, || held_by(&a, &a_id).then_some(()));
    let (a_http, a_gw) = (a.http.clone(), a.gateway.clone());
    let mut killed = a.child.take().unwrap();
    killed.kill().unwrap();
    killed.wait().unwrap();
    wait_for("the session on B", 60, || held_by(&b, &b_id).then_some(()));
    let _ = agent3.kill();
    let _ = agent3.wait();
    a.serve_at(PASSPHRASE, &a_http, &a_gw);

    // A machine asks through A (its archive lists both gateways), the operator approves on A,
    // A goes down: the machine fails over to B and is admitted there.
    let mac = "52:54:00:5a:17:e5";
    let (_, ramdisk) = crate::discovery::boot(&a, mac);
    let cfg = std::fs::read_to_string(ramdisk.join("etc/bca-agent/config.toml")).unwrap();
    assert!(cfg.contains(&b_url), "the archive lists B: {cfg}");
    let claims = crate::discovery::vm_claims(&a, mac);
    let agent = crate::discovery::discovery_join_with(&ramdisk, &claims, 120, 1);
    let req = wait_for("the request", 30, || crate::discovery::pending(&a, mac));
    let rid = req["id"].as_str().unwrap().to_string();
    a.cli_json(&["join-requests", "approve", &rid, "--pool", &pool]);
    a.stop();
    let node = crate::discovery::succeeded(agent);
    assert!(node.starts_with("node_"), "{node}");
    let consumed = b.cli_json(&["join-requests", "list", "--state", "all"]);
    let r = consumed["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == rid.as_str())
        .unwrap()
        .clone();
    assert_eq!(r["state"], "consumed", "{r}");

    // A starts again; the operator removes B: its wrapped keys go and it stops serving.
    a.restart();
    let gone = a.cli_json(&["site", "appliances", "remove", &b_id]);
    assert_eq!(gone["state"], "removed");
    let status = wait_for("B to stop", 30, || {
        b.child.as_mut().unwrap().try_wait().unwrap()
    });
    assert!(!status.success(), "B ends with an error");
    b.child = None;
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM site_appliances WHERE id = '{b_id}' AND wrapped_keys IS NULL AND state = 'removed'"
        )),
        1
    );
    let o = serve_exit(&b.state(), PASSPHRASE);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("removed from the site"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}
