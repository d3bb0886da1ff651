//! `provisioned` tokens: a machine the discovery ramdisk brought in becomes an OS node when the
//! operating system a deploy installed joins with the token minted for that node.

use crate::common::*;
use crate::discovery::{appliance, discovered_node, get};
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;

fn script(a: &Appliance, mac: &str) -> String {
    sight(a, mac);
    let (code, body) = get(a, &format!("/api/compute/boot/boot.ipxe?mac={mac}"));
    assert_eq!(code, 200);
    String::from_utf8(body).unwrap()
}

const LOCAL: &str = "booting its local disk";

fn uses_left(a: &Appliance, token_id: &str) -> i64 {
    a.count(&format!(
        "SELECT uses_left FROM join_tokens WHERE id = '{token_id}'"
    ))
}

fn last_reason(a: &Appliance) -> String {
    a.last_event("security.join.refused").unwrap().1["reason"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A discovered machine's claims: a trusted hardware key (UUID and serial) and its boot MAC.
fn discovered_claims(mac: &str) -> Value {
    let h = rand_hex(16);
    json!({
        "productUuid": format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32]),
        "serials": {"product": format!("SN-{}", &h[0..6])},
        "macs": [mac],
        "hostname": "pxe",
    })
}

#[test]
fn a_discovered_machine_becomes_an_os_node_with_its_provisioned_token_and_nothing_else_does() {
    let a = appliance("always");
    let pool = a.pool("rack-b");
    let mac = "00:1b:21:0a:0b:01";
    let claims = discovered_claims(mac);
    let claims_file = write_claims(&a, &claims);
    let node = discovered_node(&a, &pool, mac, &claims_file);
    let n = a.cli_json(&["nodes", "get", &node]);
    assert_eq!(
        (n["role"].as_str(), n["identityGeneration"].as_i64()),
        (Some("ramdisk"), Some(1))
    );
    assert!(!script(&a, mac).contains(LOCAL));

    // The operator mints the OS's token: to a new 0600 file, its id on stdout, hash-only stored.
    let file = a.dir.path().join("provision-token");
    let o = a.cli(&["nodes", "provision-token", &node, "--ttl", "2h", "--out"]);
    assert_ne!(o.status.code(), Some(0), "--out needs a file");
    let o = a.cli(&[
        "nodes",
        "provision-token",
        &node,
        "--ttl",
        "2h",
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let token_id = String::from_utf8(o.stdout).unwrap().trim().to_string();
    assert!(token_id.starts_with("jt_"), "{token_id}");
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let token = std::fs::read_to_string(&file).unwrap().trim().to_string();
    assert!(token.starts_with("bcjt_"));
    assert!(!a.snapshot().contains(&token[5..]), "the secret is stored");
    // Written over: never.
    let o = a.cli(&[
        "nodes",
        "provision-token",
        &node,
        "--out",
        file.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--out never writes over a file"));
    // Listed with the pool's tokens, role provisioned, bound to the node.
    let list = a.cli_json(&["join-tokens", "list", "--pool", &pool, "--all"]);
    let t = list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["id"] == token_id.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("{list}"));
    assert_eq!(t["role"], "provisioned");
    assert_eq!(t["nodeId"], node.as_str());
    assert_eq!(t["maxUses"], 1);
    assert_eq!(t["expect"]["mac"], mac);
    // While the token is unspent, the machine boots its local disk (its OS being installed).
    assert!(script(&a, mac).contains(LOCAL));

    // Refusals, none spending the token: another --node-id, another machine, another role.
    let dir = a.agent_dir();
    let other = discovered_node(
        &a,
        &pool,
        "00:1b:21:0a:0b:02",
        &write_claims(&a, &discovered_claims("00:1b:21:0a:0b:02")),
    );
    let o = agent_join(&dir, "data", &claims_file, &token, &["--node-id", &other]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("Join refused"));
    assert_eq!(last_reason(&a), "join:provisioned-node");
    let o = agent_join(
        &dir,
        "data",
        &write_claims(&a, &machine()),
        &token,
        &["--node-id", &node],
    );
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(last_reason(&a), "join:expect");
    let o = agent_join(
        &dir,
        "data",
        &claims_file,
        &token,
        &["--node-id", &node, "--role", "ramdisk"],
    );
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(last_reason(&a), "join-token:role-mismatch");
    let o = agent_join(&dir, "data", &claims_file, &token, &[]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(last_reason(&a), "join:provisioned-node");
    assert_eq!(uses_left(&a, &token_id), 1);
    assert_eq!(a.cli_json(&["nodes", "get", &node])["role"], "ramdisk");

    // The installed OS joins as the same node: role node, the next generation, the ramdisk's
    // certificates revoked as reclaimed, node.joined, node.reclaimed, node.provisioned.
    let ramdisk_serials: Vec<String> = a.cli_json(&["nodes", "get", &node])["certificates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["serial"].as_str().unwrap().to_string())
        .collect();
    let o = agent_join(&dir, "data", &claims_file, &token, &["--node-id", &node]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), node);
    let n = a.cli_json(&["nodes", "get", &node]);
    assert_eq!(n["role"], "node");
    assert_eq!(n["identityGeneration"], 2);
    assert_eq!(n["state"], "adopted");
    for c in n["certificates"].as_array().unwrap() {
        if ramdisk_serials.contains(&c["serial"].as_str().unwrap().to_string()) {
            assert_eq!(c["revokeReason"], "reclaimed", "{c}");
        }
    }
    let (_, ev) = a.last_event("security.certificate-revoked").unwrap();
    assert_eq!(ev["reason"], "reclaimed");
    let (_, joined) = a.last_event("node.joined").unwrap();
    assert_eq!(joined["reclaim"], true);
    assert_eq!(joined["provisioned"], true);
    assert_eq!(joined["tokenId"], token_id.as_str());
    let (_, p) = a.last_event("node.provisioned").unwrap();
    assert_eq!(p["nodeId"], node.as_str());
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM audit WHERE action = 'node.reclaimed' AND target = '{node}'"
        )),
        1
    );
    assert_eq!(uses_left(&a, &token_id), 0);
    // Its certificate says role node; the machine keeps booting its disk.
    let id: Value =
        serde_json::from_slice(&std::fs::read(dir.join("data/identity.json")).unwrap()).unwrap();
    assert_eq!(id["role"], "node");
    assert!(script(&a, mac).contains(LOCAL));
    // Spent: again is refused; and an OS node gets no provisioned token.
    let o = agent_join(
        &a.agent_dir(),
        "data",
        &claims_file,
        &token,
        &["--node-id", &node],
    );
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(last_reason(&a), "join-token:exhausted");
    let o = a.cli(&["nodes", "provision-token", &node]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("INVALID_STATE") && err.contains("has role node"),
        "{err}"
    );

    // `nodes rediscover` voids a node's unspent token: revoked, refused, the ramdisk boots again.
    let o = a.cli(&["nodes", "provision-token", &other]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let other_token = String::from_utf8(o.stdout).unwrap().trim().to_string();
    assert!(script(&a, "00:1b:21:0a:0b:02").contains(LOCAL));
    let o = a.cli(&["nodes", "rediscover", &other]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!script(&a, "00:1b:21:0a:0b:02").contains(LOCAL));
    let (_, ev) = a.last_event("security.join-token.revoked").unwrap();
    assert_eq!(ev["nodeId"], other.as_str());
    let o = agent_join(
        &a.agent_dir(),
        "data",
        &write_claims(&a, &json!({"macs": ["00:1b:21:0a:0b:02"]})),
        &other_token,
        &["--node-id", &other],
    );
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(last_reason(&a), "join-token:revoked");
}

#[test]
fn provision_token_input_is_checked_and_changes_nothing() {
    let a = Appliance::start();
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({}));
    let sim = Sim::new(&a);
    let body = sim.admitted(&token, &machine());
    let before = a.snapshot();
    for (args, want) in [
        (vec!["nodes", "provision-token", "node_nope"], "nodeId"),
        (
            vec!["nodes", "provision-token", &body.node_id, "--ttl", "10s"],
            "--ttl 10s is 10 s",
        ),
        (
            vec!["nodes", "provision-token", &body.node_id, "--ttl", "2d"],
            "not a duration",
        ),
        (
            vec!["nodes", "provision-token", &body.node_id],
            "has role node",
        ),
    ] {
        let o = a.cli(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let e = a
        .api(
            "nodes/provisionToken",
            json!({"tenantId": a.root_tenant(), "nodeId": body.node_id, "ttlSeconds": 86_401}),
        )
        .unwrap_err();
    assert!(e.to_string().contains("ttlSeconds"), "{e}");
    assert_eq!(a.snapshot(), before);
}

/// From the review (2026-12-07): another tenant can neither mint a node's provisioned token nor
/// run its acceptance; a retired node gets none.
#[test]
fn provisioning_and_adoption_keep_to_the_nodes_tenant() {
    let a = appliance("always");
    let pool = a.pool("rack-c");
    let mac = "00:1b:21:0a:0c:01";
    let node = discovered_node(&a, &pool, mac, &write_claims(&a, &discovered_claims(mac)));
    let other = a.api_ok("tenants/create", json!({"name": "other"}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let before = a.snapshot();
    for method in ["nodes/provisionToken", "nodes/adopt"] {
        let e = a
            .api(method, json!({"tenantId": other, "nodeId": node}))
            .unwrap_err();
        assert_eq!(e.code, bca::base::error::Code::NotFound, "{method}: {e}");
    }
    assert_eq!(a.snapshot(), before);
    a.api_ok(
        "nodes/retire",
        json!({"tenantId": a.root_tenant(), "nodeId": node}),
    );
    let o = a.cli(&["nodes", "provision-token", &node]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("is retired"));
}
