//! Acceptance: a pool's checks before a joined node is adopted (`policy.acceptance`), started by
//! the node's first `Hello`, failures kept as an `AcceptanceFailed` condition, `nodes adopt`
//! running them again after a fix.

use crate::common::*;
use bca::base::crypto::{self, SigningKey};
use bca::proto::protocol::{hello_message, Hello, HelloEvidence, Reply, Request, HELLO_PURPOSE};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Child;

/// The event types about `node`, oldest first.
fn node_events(a: &Appliance, node: &str) -> Vec<String> {
    let c = a.db();
    let mut st = c
        .prepare("SELECT type, data FROM events ORDER BY seq")
        .unwrap();
    st.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
        .unwrap()
        .map(|r| r.unwrap())
        .filter(|(_, d)| serde_json::from_str::<Value>(d).unwrap()["nodeId"] == node)
        .map(|(t, _)| t)
        .collect()
}

fn node(a: &Appliance, id: &str) -> Value {
    a.cli_json(&["nodes", "get", id])
}

fn pool_with(a: &Appliance, name: &str, flags: &[&str]) -> String {
    let mut args = vec!["pools", "create", "--name", name];
    args.extend_from_slice(flags);
    let v = a.cli_json(&args);
    v["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"))
        .to_string()
}

/// Joins by the CLI with `claims`: (agent dir, node id).
fn join_with(a: &Appliance, token: &str, claims: &Path) -> (std::path::PathBuf, String) {
    let dir = a.agent_dir();
    let o = agent_join(&dir, "data", claims, token, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (dir, String::from_utf8(o.stdout).unwrap().trim().to_string())
}

fn run_with(dir: &Path, claims: &Path) -> Child {
    std::process::Command::new(bin())
        .args(["agent", "run", "--config"])
        .arg(dir.join("config.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--claims")
        .arg(claims)
        .args(["--backoff-base-ms", "400", "--backoff-cap-ms", "3000"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

fn stop(mut c: Child) {
    let _ = c.kill();
    let _ = c.wait();
}

fn wait_event(a: &Appliance, node: &str, kind: &str) {
    wait_for(kind, 20, || {
        node_events(a, node).iter().any(|t| t == kind).then_some(())
    });
}

#[test]
fn a_pool_with_checks_adopts_only_after_they_pass_in_the_seeds_order() {
    let a = Appliance::start();
    let pool = pool_with(
        &a,
        "checked",
        &[
            "--acceptance",
            "session,clock,claims,macs",
            "--acceptance-min-macs",
            "1",
        ],
    );
    let got = a.cli_json(&["pools", "get", &pool]);
    assert_eq!(
        got["policy"]["acceptance"],
        json!({"checks": ["session", "clock", "claims", "macs"], "maxClockSkewSeconds": 30, "minMacs": 1, "requireTpm": false})
    );
    let (_, token) = a.token(&pool, json!({"maxUses": 5, "allowReclaim": true}));
    let m = machine();
    let claims = write_claims(&a, &m);
    let (dir, id) = join_with(&a, &token, &claims);

    // Joined, not adopted: it waits for its Hello.
    let n = node(&a, &id);
    assert_eq!(n["state"], "adopting");
    assert_eq!(n["conditions"], json!([]));
    assert_eq!(node_events(&a, &id), ["node.joined"]);

    // Its session starts acceptance; the checks pass; adopted, in the seed's order.
    let run = run_with(&dir, &claims);
    wait_event(&a, &id, "node.adopted");
    stop(run);
    assert_eq!(
        node_events(&a, &id)[..4],
        [
            "node.joined",
            "node.connected",
            "node.acceptance.started",
            "node.adopted"
        ]
    );
    assert_eq!(node(&a, &id)["state"], "adopted");
    // Adopted: `nodes adopt` has nothing to run.
    let o = a.cli(&["nodes", "adopt", &id]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("INVALID_STATE")
            && err.contains("only an adopting node runs its acceptance checks"),
        "{err}"
    );

    // A reclaim runs acceptance again: adopting until its next Hello.
    let other = write_claims(&a, &machine());
    let dir2 = a.agent_dir();
    let o = agent_join(&dir2, "data", &claims, &token, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), id);
    assert_eq!(node(&a, &id)["state"], "adopting");
    assert_eq!(node(&a, &id)["identityGeneration"], 2);

    // This time the machine reports other claims than it joined with: the claims check fails,
    // the node stays adopting with the condition, and the event says why.
    let run = run_with(&dir2, &other);
    wait_event(&a, &id, "node.acceptance.failed");
    let n = node(&a, &id);
    assert_eq!(n["state"], "adopting");
    let c = &n["conditions"][0];
    assert_eq!(c["type"], "AcceptanceFailed");
    assert_eq!(c["reason"], "claims");
    assert_eq!(
        c["message"],
        "the claims the agent reported in its Hello differ from those it joined with"
    );
    assert!(c["since"].as_str().unwrap().ends_with('Z'));
    let (_, ev) = a.last_event("node.acceptance.failed").unwrap();
    assert_eq!(ev["reason"], "claims");
    // `nodes adopt` before the fix: still adopting, exit 1, the reason printed.
    let o = a.cli(&["nodes", "adopt", &id]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stdout)
            .contains("condition            AcceptanceFailed (claims)"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    stop(run);
    // The fix: the machine's own claims again; its next Hello runs the checks and adopts it,
    // and the condition is gone.
    let run = run_with(&dir2, &claims);
    wait_for("adopted after the fix", 20, || {
        (node(&a, &id)["state"] == "adopted").then_some(())
    });
    stop(run);
    assert_eq!(node(&a, &id)["conditions"], json!([]));
    assert!(a.count("SELECT count(*) FROM audit WHERE action = 'nodes.adopt'") >= 1);
}

#[test]
fn each_check_fails_with_its_reason_and_nodes_adopt_retries_after_a_fix() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    // tpm: a token-joined node's key is not TPM-held.
    let tpm_pool = pool_with(&a, "tpm-only", &["--acceptance-require-tpm"]);
    let (_, token) = a.token(&tpm_pool, json!({"maxUses": 5}));
    let claims = write_claims(&a, &machine());
    let (dir, id) = join_with(&a, &token, &claims);
    let run = run_with(&dir, &claims);
    wait_event(&a, &id, "node.acceptance.failed");
    stop(run);
    assert_eq!(node(&a, &id)["conditions"][0]["reason"], "tpm");
    // The operator drops the requirement and runs the checks again: adopted.
    let o = a.cli(&["pools", "update", &tpm_pool, "--acceptance", "none"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let o = a.cli(&["nodes", "adopt", &id]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(node(&a, &id)["state"], "adopted");
    assert_eq!(node(&a, &id)["conditions"], json!([]));

    // macs: one permanent MAC where the pool wants two.
    let macs_pool = pool_with(
        &a,
        "two-macs",
        &["--acceptance", "macs", "--acceptance-min-macs", "2"],
    );
    let (_, token) = a.token(&macs_pool, json!({"maxUses": 5}));
    let (dir, id) = join_with(&a, &token, &write_claims(&a, &machine()));
    let _ = dir;
    // No session needed for `macs`: `nodes adopt` runs it.
    let o = a.cli(&["nodes", "adopt", &id]);
    assert_eq!(o.status.code(), Some(1));
    let c = &node(&a, &id)["conditions"][0];
    assert_eq!(c["reason"], "macs");
    assert_eq!(
        c["message"],
        "the node reported 1 permanent MACs; the pool requires 2"
    );

    // session: checked while the node has none.
    let s_pool = pool_with(&a, "session", &["--acceptance", "session"]);
    let (_, token) = a.token(&s_pool, json!({"maxUses": 5}));
    let (_, id) = join_with(&a, &token, &write_claims(&a, &machine()));
    let o = a.cli(&["nodes", "adopt", &id]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(node(&a, &id)["conditions"][0]["reason"], "session");

    // clock: a Hello whose signed clock is 100 s ahead; then one whose evidence another key
    // signed (ignored: no signed clock); then a good one.
    let c_pool = pool_with(
        &a,
        "clock",
        &["--acceptance", "clock", "--acceptance-max-clock-skew", "30"],
    );
    let (_, token) = a.token(&c_pool, json!({"maxUses": 5}));
    let m = machine();
    let (raw, csr, key) = sim.join(&token, &m);
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    let body =
        bca::agent::verify_response(&sim.cfg, &reply.join_response.unwrap(), &csr, &key, "node")
            .unwrap();
    let chain: Vec<Vec<u8>> = body
        .certificate_chain
        .iter()
        .map(|p| bca::proto::x509::pem_decode_all(p, "CERTIFICATE").remove(0))
        .collect();
    let hello = |signer: &SigningKey, skew: i64| {
        let claims = serde_json::to_vec(&m).unwrap();
        let t = bca::base::clock::now() + skew;
        let msg = hello_message(&body.node_id, t, &crypto::sha256(&claims));
        let req = Request {
            v: 1,
            hello: Some(Hello {
                node_id: body.node_id.clone(),
                evidence: Some(HelloEvidence {
                    client_time: t,
                    claims: crypto::b64(&claims),
                    sig: crypto::b64(&signer.sign(HELLO_PURPOSE, &msg)),
                }),
            }),
            ..Default::default()
        };
        rt().block_on(async {
            let mut s = bca::agent::connect(&sim.cfg, Some((chain.clone(), key.pkcs8())))
                .await
                .unwrap();
            let raw = bca::agent::roundtrip(&sim.cfg, &mut s, &serde_json::to_vec(&req).unwrap())
                .await
                .unwrap();
            let r: Reply = serde_json::from_slice(&raw).unwrap();
            assert!(r.welcome.is_some(), "{}", String::from_utf8_lossy(&raw));
        });
    };
    let id = body.node_id.clone();
    hello(&key, 100);
    let c = &node(&a, &id)["conditions"][0];
    assert_eq!(c["reason"], "clock");
    assert_eq!(
        c["message"],
        "the agent's clock is 100 s off the appliance's; the pool allows 30 s: fix NTP on the machine"
    );
    hello(&SigningKey::generate(), 0);
    let c = &node(&a, &id)["conditions"][0];
    assert_eq!(c["reason"], "clock");
    assert!(
        c["message"].as_str().unwrap().contains("no signed clock"),
        "{c}"
    );
    hello(&key, 0);
    wait_for("adopted with a good clock", 10, || {
        (node(&a, &id)["state"] == "adopted").then_some(())
    });
}

#[test]
fn a_bad_acceptance_policy_is_refused_and_changes_nothing() {
    let a = Appliance::start();
    let before = a.snapshot();
    for (flags, want) in [
        (
            vec!["--acceptance", "sessions"],
            "unknown check \"sessions\"",
        ),
        (vec!["--acceptance", "clock,clock"], "names clock twice"),
        (
            vec!["--acceptance", "clock", "--acceptance-max-clock-skew", "0"],
            "maxClockSkewSeconds must be 1 to 3600",
        ),
        (
            vec!["--acceptance", "macs", "--acceptance-min-macs", "65"],
            "minMacs must be 1 to 64",
        ),
    ] {
        let mut args = vec!["pools", "create", "--name", "bad"];
        args.extend(flags);
        let o = a.cli(&args);
        assert_eq!(o.status.code(), Some(1));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("INVALID_INPUT") && err.contains(want), "{err}");
    }
    assert_eq!(a.snapshot(), before);
}
