//! Seed rules with no test of their own until now, each through the real binary and appliance:
//! `reject` withdrawing an unused approval, `joinRequests.list` scoping, a request passing its
//! expiry, a machine of one identifier, `nodes.delete` freeing an EK, `join:tenant` and
//! `join:site` at the gateway, token files (0400, a read-only mount), the install script's
//! token on standard input, and the agent's checks of a signed join response.

use crate::common::*;
use crate::discovery::{appliance, boot, discovery_join, succeeded};
use crate::tpm::Swtpm;
use crate::tpmjoin::tpm_join;
use bca::base::crypto::{self, SigningKey};
use bca::base::error::Code;
use bca::proto::protocol::{JoinResponse, JoinResponseBody, Reply, JOIN_RESPONSE_PURPOSE};
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

// ---------------------------------------------------------------------------------------------
// Join requests: helpers
// ---------------------------------------------------------------------------------------------

/// A request in any state, by id, as `bca join-requests list --state all` shows it.
fn request(a: &Appliance, id: &str) -> Value {
    a.cli_json(&["join-requests", "list", "--state", "all"])["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("no request {id}"))
}

/// The ids of a list's items, sorted.
fn ids_of(v: &Value) -> Vec<String> {
    let mut ids: Vec<String> = v["items"]
        .as_array()
        .unwrap_or_else(|| panic!("no items: {v}"))
        .iter()
        .map(|r| r["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    ids
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// A machine that boots, asks once and stops waiting (`--wait-seconds 0`): its request stays
/// pending. Returns (its MAC, the request's id).
fn ask_once(a: &Appliance) -> (String, String) {
    let m = machine();
    let mac = m["macs"][0].as_str().unwrap().to_string();
    let (_, dir) = boot(a, &mac);
    let out = discovery_join(&dir, &write_claims(a, &m), 0)
        .wait_with_output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("still pending"), "{err}");
    let r = crate::discovery::pending(a, &mac)
        .unwrap_or_else(|| panic!("no pending request for {mac}"));
    (mac, r["id"].as_str().unwrap().to_string())
}

/// A discovery join that waits up to a minute and asks again every `retry` seconds, with the same
/// key and CSR: the decisions a test makes between two attempts all land before the next one.
fn discovery_agent(dir: &Path, claims: &Path, retry: u32) -> Child {
    crate::discovery::discovery_join_with(dir, claims, 60, retry)
}

/// Moves a request's expiry into the past. The clock is the appliance's (nothing in the API
/// shortens a pending request below `[discovery] pending_ttl_seconds`, 60 s at least, or an
/// approval below 60 s), so the row is edited, as `join.rs` does for an expired token.
fn expire_now(a: &Appliance, id: &str) {
    let n = a.live().execute_values(
        "UPDATE join_requests SET expires_at = ?1 WHERE id = ?2",
        &[V::Int(bca::base::clock::now() - 1), V::Text(id.into())],
    );
    assert_eq!(n, 1);
}

// ---------------------------------------------------------------------------------------------
// Join requests: the rules
// ---------------------------------------------------------------------------------------------

/// `reject` withdraws an approval the machine has not used yet: the machine's retry with the
/// approved CSR is refused (`discovery:rejected`), nothing is issued, the discovery token is not
/// spent, and the rejection is final.
#[test]
fn reject_withdraws_an_unused_approval() {
    let a = appliance("always");
    let pool = a.pool("intake");
    let m = machine();
    let mac = m["macs"][0].as_str().unwrap().to_string();
    let (_, dir) = boot(&a, &mac);
    // A long retry: the approval and its withdrawal both land before the machine asks again.
    let agent = discovery_agent(&dir, &write_claims(&a, &m), 8);
    let req = wait_for("a pending request", 20, || {
        crate::discovery::pending(&a, &mac)
    });
    let id = req["id"].as_str().unwrap().to_string();
    let approved = a.cli_json(&["join-requests", "approve", &id, "--pool", &pool]);
    assert_eq!(approved["state"], "approved");
    let rejected = a.cli_json(&[
        "join-requests",
        "reject",
        &id,
        "--pool",
        &pool,
        "--reason",
        "approved the wrong rack",
    ]);
    assert_eq!(rejected["state"], "rejected");
    assert_eq!(rejected["poolId"], json!(pool));
    assert_eq!(rejected["reason"], "approved the wrong rack");
    assert_eq!(rejected["csrSha256"], approved["csrSha256"]);
    let (tenant, ev) = a.last_event("security.join-request.rejected").unwrap();
    assert_eq!(tenant, a.root_tenant());
    assert_eq!(ev["requestId"], json!(id));
    let audit = a.cli_json(&["audit", "list", "--action", "joinRequests.reject"]);
    assert_eq!(audit["items"].as_array().unwrap().len(), 1, "{audit}");

    // The machine asks again with the CSR the approval was for: refused.
    let out = agent.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or_default()
            .trim(),
        "ACCESS_DENIED: Join refused"
    );
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "discovery:rejected"
    );
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 0);
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), 0);
    assert_eq!(
        a.count("SELECT count(*) FROM discovery_tokens WHERE spent_at IS NOT NULL"),
        0
    );
    assert!(!dir.join("data/identity.json").exists());
    assert_eq!(request(&a, &id)["state"], "rejected");
    // Final: rejecting again returns the rejection; approving it is INVALID_STATE.
    let again = a.cli_json(&["join-requests", "reject", &id, "--pool", &pool]);
    assert_eq!(again["decidedAt"], rejected["decidedAt"]);
    let (code, msg) = a.cli_err(&["join-requests", "approve", &id, "--pool", &pool]);
    assert_eq!(code, "INVALID_STATE", "{msg}");
    assert!(
        msg.contains("only a pending request can be approved"),
        "{msg}"
    );
}

/// `joinRequests.list` shows a pool's operator the pool's own requests and the site's requests no
/// pool claimed yet, never another pool's (or another tenant's); with no pool, every pool of the
/// tenant's. A decision through a pool that does not hold the request is `NOT_FOUND`.
#[test]
fn join_requests_list_shows_the_pools_requests_and_the_sites_unclaimed_ones() {
    let a = appliance("always");
    let root = a.root_tenant();
    let pool_a = a.pool("rack-a");
    let pool_b = a.pool("rack-b");
    let tenant = a.api_ok("tenants/create", json!({"name": "acme"}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let pool_c = a.api_ok(
        "pools/create",
        json!({"tenantId": tenant, "name": "acme-c"}),
    )["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (_, unclaimed) = ask_once(&a);
    let (_, in_a) = ask_once(&a);
    let (_, in_b) = ask_once(&a);
    a.cli_json(&["join-requests", "approve", &in_a, "--pool", &pool_a]);
    a.cli_json(&["join-requests", "reject", &in_b, "--pool", &pool_b]);
    assert_eq!(request(&a, &in_b)["poolId"], json!(pool_b));

    let list = |tenant: &str, pool: Option<&str>, state: &str| -> Vec<String> {
        let mut body = json!({"tenantId": tenant, "state": state});
        if let Some(p) = pool {
            body["poolId"] = json!(p);
        }
        ids_of(&a.api_ok("joinRequests/list", body))
    };
    // A pool: its own and the unclaimed one.
    assert_eq!(
        list(&root, Some(pool_a.as_str()), "all"),
        sorted(vec![unclaimed.clone(), in_a.clone()])
    );
    assert_eq!(
        list(&root, Some(pool_b.as_str()), "all"),
        sorted(vec![unclaimed.clone(), in_b.clone()])
    );
    // The state filter applies within that scope: pending is the unclaimed one alone.
    assert_eq!(
        list(&root, Some(pool_a.as_str()), "pending"),
        vec![unclaimed.clone()]
    );
    assert_eq!(
        list(&root, Some(pool_a.as_str()), "approved"),
        vec![in_a.clone()]
    );
    assert!(list(&root, Some(pool_a.as_str()), "rejected").is_empty());
    // No pool: every pool of the tenant's, and the unclaimed one.
    assert_eq!(
        list(&root, None, "all"),
        sorted(vec![unclaimed.clone(), in_a.clone(), in_b.clone()])
    );
    // Another tenant: the site's unclaimed request only, with or without its pool.
    assert_eq!(
        list(&tenant, Some(pool_c.as_str()), "all"),
        vec![unclaimed.clone()]
    );
    assert_eq!(list(&tenant, None, "all"), vec![unclaimed.clone()]);
    // The CLI says the same.
    assert_eq!(
        ids_of(&a.cli_json(&["join-requests", "list", "--pool", &pool_b, "--state", "all"])),
        sorted(vec![unclaimed.clone(), in_b.clone()])
    );

    // Deciding another pool's request through this pool: NOT_FOUND, nothing changes.
    let before = a.snapshot();
    let (code, msg) = a.cli_err(&["join-requests", "reject", &in_a, "--pool", &pool_b]);
    assert_eq!(code, "NOT_FOUND", "{msg}");
    assert!(msg.contains("not found in pool"), "{msg}");
    let (code, msg) = a.cli_err(&[
        "join-requests",
        "approve",
        &in_b,
        "--pool",
        &pool_c,
        "--tenant",
        &tenant,
    ]);
    assert_eq!(code, "NOT_FOUND", "{msg}");
    assert_eq!(a.snapshot(), before);

    // Another site's unclaimed request is not this site's: listed nowhere, decided through no
    // pool here. (One appliance is one site: no API makes another site's request, so a request's
    // row is moved to a second site row, as a restore of another site's database would leave it.)
    let (_, elsewhere) = ask_once(&a);
    {
        let db = a.live();
        db.execute(
            "INSERT INTO site (id, name, trust_domain, created_at) VALUES ('site_elsewhere', 'rack2', 'compute.example.com', 0)",
            &[],
        );
        db.execute(
            "UPDATE join_requests SET site_id = 'site_elsewhere' WHERE id = ?1",
            &[elsewhere.as_str()],
        );
    }
    assert_eq!(
        list(&root, Some(pool_a.as_str()), "all"),
        sorted(vec![unclaimed.clone(), in_a.clone()])
    );
    assert!(!list(&root, None, "all").contains(&elsewhere));
    assert!(!list(&tenant, None, "all").contains(&elsewhere));
    let (code, msg) = a.cli_err(&["join-requests", "approve", &elsewhere, "--pool", &pool_a]);
    assert_eq!(code, "NOT_FOUND", "{msg}");
}

/// A request past its expiry is `expired`, whether it was pending or approved: it is no longer
/// listed as such, cannot be decided, and an expired approval admits nothing (the machine's
/// retry with the approved CSR opens a new request, which an operator decides afresh).
#[test]
fn a_request_past_its_expiry_expires_pending_or_approved() {
    let a = appliance("always");
    let pool = a.pool("intake");

    // Pending, then past its expiry.
    let (mac1, r1) = ask_once(&a);
    expire_now(&a, &r1);
    assert!(
        crate::discovery::pending(&a, &mac1).is_none(),
        "an expired request is listed as pending"
    );
    let expired = ids_of(&a.cli_json(&["join-requests", "list", "--state", "expired"]));
    assert_eq!(expired, vec![r1.clone()]);
    assert_eq!(request(&a, &r1)["state"], "expired");
    let before = a.snapshot();
    let (code, msg) = a.cli_err(&["join-requests", "approve", &r1, "--pool", &pool]);
    assert_eq!(code, "INVALID_STATE", "{msg}");
    assert!(msg.contains("is expired"), "{msg}");
    let (code, msg) = a.cli_err(&["join-requests", "reject", &r1, "--pool", &pool]);
    assert_eq!(code, "INVALID_STATE", "{msg}");
    assert!(msg.contains("is expired; it cannot be rejected"), "{msg}");
    assert_eq!(a.snapshot(), before);

    // Approved, then past its expiry before the machine came back.
    let m = machine();
    let mac2 = m["macs"][0].as_str().unwrap().to_string();
    let (_, dir) = boot(&a, &mac2);
    let agent = discovery_agent(&dir, &write_claims(&a, &m), 6);
    let req = wait_for("a pending request", 20, || {
        crate::discovery::pending(&a, &mac2)
    });
    let r2 = req["id"].as_str().unwrap().to_string();
    let approved = a.cli_json(&["join-requests", "approve", &r2, "--pool", &pool]);
    assert_eq!(approved["state"], "approved");
    expire_now(&a, &r2);
    assert!(
        !ids_of(&a.cli_json(&["join-requests", "list", "--state", "approved"])).contains(&r2),
        "an expired approval is listed as approved"
    );
    assert_eq!(request(&a, &r2)["state"], "expired");
    // The machine's retry, with the CSR the approval was for: not admitted; a new request waits.
    let fresh = wait_for("the machine's new request", 30, || {
        crate::discovery::pending(&a, &mac2).filter(|r| r["id"] != r2.as_str())
    });
    assert_eq!(fresh["csrSha256"], approved["csrSha256"]);
    assert_eq!(fresh["state"], "pending");
    assert!(fresh["poolId"].is_null());
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 0);
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), 0);
    assert_eq!(
        a.count("SELECT count(*) FROM discovery_tokens WHERE spent_at IS NOT NULL"),
        0
    );
    assert_eq!(request(&a, &r2)["state"], "expired");
    // Decided afresh, the machine joins; the expired approval stays expired.
    let fresh_id = fresh["id"].as_str().unwrap().to_string();
    a.cli_json(&["join-requests", "approve", &fresh_id, "--pool", &pool]);
    let node = succeeded(agent);
    assert!(node.starts_with("node_"), "{node}");
    assert_eq!(request(&a, &fresh_id)["state"], "consumed");
    assert_eq!(request(&a, &fresh_id)["nodeId"], json!(node));
    assert_eq!(request(&a, &r2)["state"], "expired");
    assert!(request(&a, &r2)["nodeId"].is_null());
}

// ---------------------------------------------------------------------------------------------
// Admission
// ---------------------------------------------------------------------------------------------

/// A machine with fewer than two identifiers (here one real serial) has an untrusted hardware
/// key: a bare token refuses it (`join:placeholder-hardware`); an `expect`-bound token admits it
/// as a new node, never a reclaim, even with `allowReclaim`. With a second identifier the same
/// machine's key is trusted, and a later join reclaims.
#[test]
fn a_machine_with_fewer_than_two_identifiers_joins_only_as_a_new_node() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("one-identifier");
    let serial = format!("SN-ONE-{}", rand_hex(4)).to_uppercase();
    let one = json!({"serials": {"product": serial}, "hostname": "one-id"});

    let (rec, plain) = a.token(&pool, json!({"allowReclaim": true}));
    let (raw, _, _) = sim.join(&plain, &one);
    assert_eq!(raw, refused_bytes());
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "join:placeholder-hardware"
    );
    assert_eq!(a.uses_left(rec["id"].as_str().unwrap()), 1);
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 0);

    let bound = json!({"expect": {"serial": serial}, "allowReclaim": true});
    let (_, t1) = a.token(&pool, bound.clone());
    let first = sim.admitted(&t1, &one);
    let node = a.cli_json(&["nodes", "get", &first.node_id]);
    assert_eq!(node["hardwareKeyTrusted"], false);
    let (_, joined) = a.last_event("node.joined").unwrap();
    assert_eq!(
        (
            joined["reclaim"].as_bool(),
            joined["hardwareKeyTrusted"].as_bool()
        ),
        (Some(false), Some(false))
    );
    // The same machine again: a new node; the first keeps its identity.
    let (_, t2) = a.token(&pool, bound);
    let second = sim.admitted(&t2, &one);
    assert_ne!(second.node_id, first.node_id);
    assert_eq!(a.last_event("node.joined").unwrap().1["reclaim"], false);
    for n in [&first.node_id, &second.node_id] {
        let v = a.cli_json(&["nodes", "get", n]);
        assert_eq!(v["identityGeneration"], 1, "{v}");
        assert_eq!(v["hardwareKeyTrusted"], false, "{v}");
    }
    assert_eq!(
        a.count("SELECT count(*) FROM node_certs WHERE revoked_at IS NOT NULL"),
        0
    );
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 2);

    // Two identifiers (the serial and a MAC): trusted, a bare token admits it, and a later join
    // with allowReclaim is a reclaim of that node.
    let h = rand_hex(3);
    let mut two = one.clone();
    two["macs"] = json!([format!("00:1b:21:{}:{}:{}", &h[0..2], &h[2..4], &h[4..6])]);
    let (_, t3) = a.token(&pool, json!({"allowReclaim": true}));
    let third = sim.admitted(&t3, &two);
    assert!(third.node_id != first.node_id && third.node_id != second.node_id);
    assert_eq!(
        a.cli_json(&["nodes", "get", &third.node_id])["hardwareKeyTrusted"],
        true
    );
    let (_, t4) = a.token(&pool, json!({"allowReclaim": true}));
    let again = sim.admitted(&t4, &two);
    assert_eq!(again.node_id, third.node_id);
    assert_eq!(a.last_event("node.joined").unwrap().1["reclaim"], true);
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 3);
}

/// `join:tenant` and `join:site` through the real gateway. No API makes a token whose tenant or
/// site is not its pool's (`joinTokens.create` takes the pool from the tenant; one appliance is
/// one site), so the rows are edited as a restore of another database or a bug would leave them:
/// the gateway still refuses, with the one refusal on the wire, the reason recorded (in the
/// token's tenant), the token's use kept and nothing written.
#[test]
fn a_token_of_another_tenant_or_site_than_its_pool_is_refused_at_the_gateway() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let root = a.root_tenant();
    let pool = a.pool("rack-a");
    let acme = a.api_ok("tenants/create", json!({"name": "acme"}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let check = |token: &str, id: &str, reason: &str, tenant: &str| {
        let (raw, _, _) = sim.join(token, &machine());
        assert_eq!(raw, refused_bytes(), "{}", String::from_utf8_lossy(&raw));
        let (t, ev) = a.last_event("security.join.refused").unwrap();
        assert_eq!(ev["reason"], reason, "{ev}");
        assert_eq!(ev["attestor"], "join-token", "{ev}");
        assert_eq!(t, tenant, "{reason} went to the wrong tenant");
        assert_eq!(a.uses_left(id), 1, "{reason} consumed the token");
        assert_eq!(a.count("SELECT count(*) FROM nodes"), 0);
        assert_eq!(a.count("SELECT count(*) FROM node_certs"), 0);
    };

    // tenant: the token names another tenant than its pool's.
    let (rec, token) = a.token(&pool, json!({}));
    let id = rec["id"].as_str().unwrap().to_string();
    a.live().execute(
        "UPDATE join_tokens SET tenant_id = ?1 WHERE id = ?2",
        &[acme.as_str(), id.as_str()],
    );
    check(&token, &id, "join:tenant", &acme);

    // site: a second site row, then a token of that site for this site's pool, and a token whose
    // pool is that site's too (a token minted at another site, presented here).
    a.live().execute(
            "INSERT INTO site (id, name, trust_domain, created_at) VALUES ('site_elsewhere', 'rack2', 'compute.example.com', 0)",
            &[],
        );
    let (rec, token) = a.token(&pool, json!({}));
    let id = rec["id"].as_str().unwrap().to_string();
    a.live().execute(
        "UPDATE join_tokens SET site_id = 'site_elsewhere' WHERE id = ?1",
        &[id.as_str()],
    );
    check(&token, &id, "join:site", &root);
    let far = a.pool("rack-far");
    let (rec, token) = a.token(&far, json!({}));
    let id = rec["id"].as_str().unwrap().to_string();
    {
        let db = a.live();
        db.execute(
            "UPDATE pools SET site_id = 'site_elsewhere' WHERE id = ?1",
            &[far.as_str()],
        );
        db.execute(
            "UPDATE join_tokens SET site_id = 'site_elsewhere' WHERE id = ?1",
            &[id.as_str()],
        );
    }
    check(&token, &id, "join:site", &root);
    // The same machine with an untouched token of this site is admitted: the refusals were the
    // rows', not the machine's.
    let (_, good) = a.token(&pool, json!({}));
    sim.admitted(&good, &machine());
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 1);
}

/// `nodes.delete` frees the node's EK: while the node exists its EK admits the machine as that
/// node (with no allow-list entry: a known EK); once it is deleted the EK is unknown again (its
/// join waits for an operator), and allowed again it joins as a new node.
#[test]
fn deleting_a_node_frees_its_ek() {
    let tpm = Swtpm::start(false);
    let a = Appliance::start();
    let pool = a.pool("tpm-rack");
    let (hash, _) = crate::tpmjoin::allow_ek(&a, &tpm.tcti(), &pool);
    let claims = write_claims(&a, &machine());
    let join = |extra: &[&str]| tpm_join(&a.agent_dir(), &claims, &tpm, extra);
    let o = join(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let first = String::from_utf8(o.stdout).unwrap().trim().to_string();
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM nodes WHERE id = '{first}' AND tpm_ek_sha256 = '{hash}'"
        )),
        1
    );

    // Off the allow-list, the EK still names its node: the machine comes back as that node.
    a.cli_json(&["tpm", "remove-ek", &hash]);
    let o = join(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8(o.stdout).unwrap().trim(), first);
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(
        (ev["reclaim"].as_bool(), ev["admittedBy"].as_str()),
        (Some(true), Some("known-ek")),
        "{ev}"
    );

    // Deleted: the EK is free. The machine is unknown again and waits for an operator.
    a.cli_json(&["nodes", "delete", &first, "--yes"]);
    let (_, ev) = a.last_event("node.deleted").unwrap();
    assert_eq!(ev["nodeId"], first.as_str());
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM nodes WHERE tpm_ek_sha256 = '{hash}'"
        )),
        0
    );
    let o = join(&["--wait-seconds", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("still pending"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 0);
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM join_requests WHERE attestor = 'tpm' AND state = 'pending' AND vouched_by = 'tpm-ek:{hash}'"
        )),
        1
    );
    // Allowed again: a new node, not the deleted one's identity.
    a.cli_json(&["tpm", "allow-ek", &hash, "--pool", &pool]);
    let o = join(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let second = String::from_utf8(o.stdout).unwrap().trim().to_string();
    assert_ne!(second, first);
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(
        (ev["reclaim"].as_bool(), ev["admittedBy"].as_str()),
        (Some(false), Some("allow-list")),
        "{ev}"
    );
    let node = a.cli_json(&["nodes", "get", &second]);
    assert_eq!(node["identityGeneration"], 1);
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM nodes WHERE id = '{second}' AND tpm_ek_sha256 = '{hash}'"
        )),
        1
    );
}

/// A retired node's EK is cut off from the EK CA bundle's trust (its joins wait for an
/// operator); deleting the retired node lifts that: the certified EK joins the bundle's pool
/// again, as a new node.
#[test]
fn deleting_a_retired_tpm_node_gives_its_ek_back_to_the_ek_ca_bundle() {
    let tpm = Swtpm::start(true);
    let mut a = Appliance::start();
    let pool = a.pool("certified");
    let bundle = crate::tpmjoin::ek_ca_bundle(&a);
    a.stop();
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let section = format!(
        "[tpm_attestor]\nenrollment = true\nek_ca_bundle = \"{}\"\nek_ca_pool = \"{pool}\"\n\n",
        bundle.display()
    );
    std::fs::write(&cfg, replace_table(&text, "tpm_attestor", &section)).unwrap();
    a.serve(PASSPHRASE);

    let claims = write_claims(&a, &machine());
    let join = |extra: &[&str]| tpm_join(&a.agent_dir(), &claims, &tpm, extra);
    let o = join(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let first = String::from_utf8(o.stdout).unwrap().trim().to_string();
    assert_eq!(
        a.last_event("node.joined").unwrap().1["admittedBy"],
        "ek-ca"
    );

    a.cli_json(&["nodes", "retire", &first]);
    let o = join(&["--wait-seconds", "0"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("still pending"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 1);

    a.cli_json(&["nodes", "delete", &first, "--yes"]);
    let o = join(&[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let second = String::from_utf8(o.stdout).unwrap().trim().to_string();
    assert_ne!(second, first);
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(
        (
            ev["admittedBy"].as_str(),
            ev["reclaim"].as_bool(),
            ev["poolId"].as_str()
        ),
        (Some("ek-ca"), Some(false), Some(pool.as_str())),
        "{ev}"
    );
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 1);
}

// ---------------------------------------------------------------------------------------------
// Token files and the install script
// ---------------------------------------------------------------------------------------------

fn token_file(path: &Path, token: &str, mode: u32) {
    std::fs::write(path, format!("{token}\n")).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// `bca agent join --token-file FILE` for a fresh agent directory, with warnings on stderr.
fn join_with_token_file(a: &Appliance, dir: &Path, file: &Path) -> Output {
    Command::new(bin())
        .args(["agent", "join", "--config"])
        .arg(dir.join("config.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--claims")
        .arg(write_claims(a, &machine()))
        .arg("--token-file")
        .arg(file)
        .env("BCA_LOG", "warn")
        .env_remove("BCA_LOG_FORMAT")
        .env_remove("BCD_JOIN_TOKEN")
        .env_remove("BCA_JOIN_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// A token file of mode 0400 joins and is deleted; one others can read (0440, 0404) is refused,
/// kept, and spends nothing.
#[test]
fn a_0400_token_file_joins_and_is_deleted() {
    let a = Appliance::start();
    let pool = a.pool("token-files");
    let (rec, token) = a.token(&pool, json!({"maxUses": 2}));
    let id = rec["id"].as_str().unwrap().to_string();
    for mode in [0o440, 0o404] {
        let dir = a.agent_dir();
        let tf = dir.join("join-token");
        token_file(&tf, &token, mode);
        let o = join_with_token_file(&a, &dir, &tf);
        assert_eq!(o.status.code(), Some(1));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("readable by its owner alone")
                && err.contains(&format!("it is {mode:04o}")),
            "{err}"
        );
        assert!(tf.exists());
        assert!(!dir.join("data/identity.json").exists());
    }
    assert_eq!(a.uses_left(&id), 2);

    let dir = a.agent_dir();
    let tf = dir.join("join-token");
    token_file(&tf, &token, 0o400);
    let o = join_with_token_file(&a, &dir, &tf);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let node = String::from_utf8(o.stdout).unwrap().trim().to_string();
    assert!(node.starts_with("node_"), "{node}");
    assert!(!tf.exists(), "the 0400 token file was not deleted");
    assert!(dir.join("data/identity.json").exists());
    assert_eq!(a.uses_left(&id), 1);
    assert_eq!(a.cli_json(&["nodes", "get", &node])["poolId"], json!(pool));
}

/// A token file on a read-only mount: the join succeeds, the agent warns that it could not delete
/// the file, and the file stays. The tests run as root, whom no mode bit stops from deleting, so
/// the mount is a real read-only bind mount, in a private mount namespace (`unshare -m`) that
/// ends with the agent: the host's mounts are untouched and there is nothing to clean up.
#[test]
fn a_token_file_on_a_read_only_mount_joins_with_a_warning() {
    let a = Appliance::start();
    let pool = a.pool("token-files-ro");
    let (rec, token) = a.token(&pool, json!({}));
    let ro = a.dir.path().join("ro-mount");
    std::fs::create_dir(&ro).unwrap();
    let tf = ro.join("join-token");
    token_file(&tf, &token, 0o400);
    let dir = a.agent_dir();
    let o = Command::new("unshare")
        .args([
            "-m",
            "sh",
            "-c",
            r#"mount --bind -o ro "$1" "$1" && shift && exec "$@""#,
            "sh",
        ])
        .arg(&ro)
        .arg(bin())
        .args(["agent", "join", "--config"])
        .arg(dir.join("config.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--claims")
        .arg(write_claims(&a, &machine()))
        .arg("--token-file")
        .arg(&tf)
        .env("BCA_LOG", "warn")
        .env_remove("BCA_LOG_FORMAT")
        .env_remove("BCD_JOIN_TOKEN")
        .env_remove("BCA_JOIN_TOKEN")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(
        err.contains("the token file could not be deleted (a read-only mount?)"),
        "{err}"
    );
    assert!(err.contains("Read-only file system"), "{err}");
    assert!(err.contains("WARN"), "{err}");
    assert!(!err.contains(&token), "the token is in the log: {err}");
    let node = String::from_utf8(o.stdout).unwrap().trim().to_string();
    assert!(node.starts_with("node_"), "{node}");
    assert!(tf.exists(), "the token file on the read-only mount is gone");
    assert!(dir.join("data/identity.json").exists());
    assert_eq!(a.uses_left(rec["id"].as_str().unwrap()), 0);
}

/// The install script for `pool`, its binary download recorded (amd64).
fn install_script(a: &Appliance, pool: &str) -> PathBuf {
    let sha = crate::adopt::add_agent(a);
    crate::adopt::script(a, pool, &sha)
}

/// `sh SCRIPT` into the scratch root `root`, with `input` on standard input and no token in the
/// environment.
fn run_script_stdin(script: &Path, root: &Path, claims: &Path, input: &str) -> Output {
    let mut child = Command::new("sh")
        .arg(script)
        .env("DESTDIR", root)
        .env("BCA_CLAIMS_FILE", claims)
        .env_remove("BCD_JOIN_TOKEN")
        .env_remove("BCA_JOIN_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        // The script may exit before reading everything: a closed pipe is not the test's error.
        let _ = child.stdin.take().unwrap().write_all(input.as_bytes());
    }
    child.wait_with_output().unwrap()
}

/// The install script reads the token from standard input when `BCD_JOIN_TOKEN` is unset: it
/// installs, joins the pool, and leaves the token in no file; a line that is not a token is
/// refused before anything is installed.
#[test]
fn the_install_script_reads_the_token_from_standard_input() {
    let a = Appliance::start();
    let pool = a.pool("brownfield-stdin");
    let (rec, token) = a.token(&pool, json!({}));
    let script = install_script(&a, &pool);
    assert!(!std::fs::read_to_string(&script).unwrap().contains(&token));
    let claims = write_claims(&a, &machine());

    let bad = a.dir.path().join("root-bad");
    let o = run_script_stdin(&script, &bad, &claims, "hello\n");
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("must look like bcjt_"), "{err}");
    assert!(!bad.join("usr/local/bin/bca").exists());
    assert!(!bad.join("etc/bca-agent/config.toml").exists());
    assert_eq!(a.uses_left(rec["id"].as_str().unwrap()), 1);

    let root = a.dir.path().join("root-stdin");
    let o = run_script_stdin(&script, &root, &claims, &format!("{token}\n"));
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("install-bca: joined"),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let id: Value = serde_json::from_slice(
        &std::fs::read(root.join("var/lib/bca-agent/identity.json")).unwrap(),
    )
    .unwrap();
    let node = a.cli_json(&["nodes", "get", id["nodeId"].as_str().unwrap()]);
    assert_eq!(node["poolId"], json!(pool));
    assert_eq!(a.uses_left(rec["id"].as_str().unwrap()), 0);
    // The token is in no file the script wrote (the binary aside).
    let secret = token.split('.').nth(1).unwrap();
    for sub in ["etc", "var"] {
        // Regular files only (mode S_IFREG).
        for (f, _, mode) in sha256_file_tree(&root.join(sub)) {
            if mode & 0o170000 != 0o100000 {
                continue;
            }
            let bytes = std::fs::read(&f).unwrap();
            assert!(
                !bytes.windows(secret.len()).any(|w| w == secret.as_bytes()),
                "the token is in {}",
                f.display()
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The agent's checks of a signed join response
// ---------------------------------------------------------------------------------------------

/// The appliance's join-signing key, from `keys/keys.json` (key protection `file`).
fn join_signing_key(a: &Appliance) -> SigningKey {
    let v: Value =
        serde_json::from_slice(&std::fs::read(a.state().join("keys/keys.json")).unwrap()).unwrap();
    let der = crypto::b64_decode(v["joinSigning"].as_str().unwrap()).unwrap();
    SigningKey::from_pkcs8(&der).unwrap()
}

/// The agent refuses a join response whose CSR hash, leaf key, SPIFFE SAN or role is wrong, each
/// alone, even signed by the pinned join-signing key; the error names what failed. A real
/// response is re-signed with the appliance's own join-signing key after one field is changed
/// (an unchanged body re-signed verifies, so each refusal is the field's).
#[test]
fn the_agent_refuses_a_signed_response_with_a_wrong_csr_hash_leaf_key_san_or_role() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("verify");
    let (_, token) = a.token(&pool, json!({"maxUses": 2}));
    let (raw, csr, key) = sim.join(&token, &machine());
    let reply: Reply = serde_json::from_slice(&raw).unwrap();
    let resp = reply
        .join_response
        .unwrap_or_else(|| panic!("refused: {}", String::from_utf8_lossy(&raw)));
    let good = bca::agent::verify_response(&sim.cfg, &resp, &csr, &key, "node").unwrap();
    // Another node, another key: its certificate and node id to swap in.
    let other = sim.admitted(&token, &machine());
    assert_ne!(other.node_id, good.node_id);
    let other_csr = bca::proto::csr::create(&SigningKey::generate());

    let signing = join_signing_key(&a);
    assert_eq!(
        crypto::spki_pin(&signing.spki_der()),
        sim.cfg.join_signing_key_pin,
        "keys.json's join-signing key is not the pinned one"
    );
    let resign = |b: &JoinResponseBody| -> JoinResponse {
        let bytes = serde_json::to_vec(b).unwrap();
        JoinResponse {
            body: crypto::b64(&bytes),
            sig: crypto::b64(&signing.sign(JOIN_RESPONSE_PURPOSE, &bytes)),
            signer: resp.signer.clone(),
        }
    };
    let tampered = |f: &dyn Fn(&mut JoinResponseBody)| -> JoinResponse {
        let mut b = good.clone();
        f(&mut b);
        resign(&b)
    };
    let verify = |r: &JoinResponse, role: &str| {
        bca::agent::verify_response_for(&sim.cfg, r, &csr, &key.spki_der(), role)
    };
    let refused = |r: &JoinResponse, role: &str, why: &str| {
        let e = verify(r, role).expect_err(why);
        assert_eq!(e.code, Code::AccessDenied, "{e}");
        assert_eq!(
            e.message,
            format!("the join response failed verification: {why}")
        );
    };

    // The control: the unchanged body, re-signed, verifies.
    assert_eq!(verify(&resign(&good), "node").unwrap(), good);
    // A changed body under the original signature: the signature fails first.
    let mut unsigned = tampered(&|b| b.node_id = other.node_id.clone());
    unsigned.sig = resp.sig.clone();
    refused(&unsigned, "node", "bad signature");

    // The CSR hash: another CSR's.
    refused(
        &tampered(&|b| b.csr_sha256 = crypto::hex(&crypto::sha256(&other_csr))),
        "node",
        "it answers another CSR",
    );
    // The leaf key: another machine's certificate, the body naming its node (so that its SPIFFE
    // ID and role would pass): only the key is wrong.
    refused(
        &tampered(&|b| {
            b.certificate_chain = other.certificate_chain.clone();
            b.node_id = other.node_id.clone();
        }),
        "node",
        "the certificate does not certify this machine's key",
    );
    // The SPIFFE SAN: the body names another node, trust domain or site than the certificate.
    let san = "the certificate's SPIFFE ID is not this site's node";
    refused(
        &tampered(&|b| b.node_id = other.node_id.clone()),
        "node",
        san,
    );
    refused(
        &tampered(&|b| b.trust_domain = "elsewhere.example.com".into()),
        "node",
        san,
    );
    refused(
        &tampered(&|b| b.site_id = "site_elsewhere".into()),
        "node",
        san,
    );
    // The role: a `node` certificate for an agent that asked for `ramdisk`; a body that says
    // `ramdisk` or `node-tenant` over a `node` certificate.
    let role = "the certificate has another role";
    refused(&resign(&good), "ramdisk", role);
    refused(&tampered(&|b| b.role = "ramdisk".into()), "ramdisk", role);
    refused(&tampered(&|b| b.role = "node-tenant".into()), "node", role);
    // And the real, untouched response still verifies.
    assert_eq!(verify(&resp, "node").unwrap(), good);
}
