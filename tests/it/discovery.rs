//! Discovery without a VM: the boot scripts, the per-boot archive (unpacked by GNU cpio), the
//! `discovery` attestor, the join-request queue and its decisions.

use crate::common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// An appliance whose config names its gateway (the ramdisk needs it) and retries quickly, with
/// the boot server's DHCP on loopback so that tests can make sightings (`sight`).
pub(crate) fn appliance(approval: &str) -> Appliance {
    appliance_with(approval, &[])
}

/// [`appliance`], `bca init` given `extra` too.
pub(crate) fn appliance_with(approval: &str, extra: &[&str]) -> Appliance {
    let mut a = Appliance::start_cfg("file", extra, |c| c);
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let text = format!("gateway_url = \"https://{}\"\n{text}", a.gateway)
        .replace(
            "approval = \"always\"",
            &format!("approval = \"{approval}\""),
        )
        .replace("retry_after_seconds = 30", "retry_after_seconds = 1");
    assert!(text.contains(&format!("approval = \"{approval}\"")));
    std::fs::write(&cfg, text).unwrap();
    enable_sightings(&mut a);
    a
}

pub(crate) fn get(a: &Appliance, path: &str) -> (u16, Vec<u8>) {
    let o = Command::new("curl")
        .args([
            "-s",
            "-w",
            "\n%{http_code}",
            &format!("http://{}{path}", a.http),
        ])
        .output()
        .unwrap();
    let mut body = o.stdout;
    let nl = body.iter().rposition(|c| *c == b'\n').unwrap();
    let code = String::from_utf8_lossy(&body[nl + 1..]).parse().unwrap();
    body.truncate(nl);
    (code, body)
}

/// The network sees the machine's DHCP, then it fetches the per-machine script and its archive,
/// unpacked by cpio into a new folder.
pub(crate) fn boot(a: &Appliance, mac: &str) -> (String, PathBuf) {
    sight(a, mac);
    let (code, script) = get(a, &format!("/api/compute/boot/boot.ipxe?mac={mac}"));
    assert_eq!(code, 200);
    let script = String::from_utf8(script).unwrap();
    let url = script
        .lines()
        .find_map(|l| l.strip_prefix("initrd --name initrd.img "))
        .unwrap_or_else(|| panic!("{script}"))
        .to_string();
    // The archive alone (the script's URL serves it appended to the ramdisk's initramfs).
    let path = url
        .split_once("/api/")
        .map(|(_, p)| format!("/api/{p}"))
        .unwrap()
        .replace("/initrd.img", ".cpio");
    let (code, cpio) = get(a, &path);
    assert_eq!(code, 200);
    // Served once.
    assert_eq!(get(a, &path).0, 404);
    let dir = a.dir.path().join(format!("ramdisk-{}", rand_hex(4)));
    std::fs::create_dir_all(&dir).unwrap();
    let mut child = Command::new("cpio")
        .args(["-idm", "--quiet"])
        .current_dir(&dir)
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child.stdin.take().unwrap().write_all(&cpio).unwrap();
    assert!(child.wait().unwrap().success());
    (script, dir)
}

/// The agent's exit: it must have succeeded (its stderr says why not); its stdout, the node id.
pub(crate) fn succeeded(agent: Child) -> String {
    let out = agent.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// `bca agent join --attestor discovery` from an unpacked per-boot archive.
pub(crate) fn discovery_join(dir: &Path, claims: &Path, wait: u32) -> Child {
    discovery_join_with(dir, claims, wait, 1)
}

/// [`discovery_join`] asking again every `retry` seconds, with the same key and CSR.
pub(crate) fn discovery_join_with(dir: &Path, claims: &Path, wait: u32, retry: u32) -> Child {
    let etc = dir.join("etc/bca-agent");
    Command::new(bin())
        .args([
            "agent",
            "join",
            "--attestor",
            "discovery",
            "--role",
            "ramdisk",
            "--config",
        ])
        .arg(etc.join("config.toml"))
        .arg("--token-file")
        .arg(etc.join("discovery-token"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--claims")
        .arg(claims)
        .args([
            "--wait-seconds",
            &wait.to_string(),
            "--retry-seconds",
            &retry.to_string(),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

pub(crate) fn vm_claims(a: &Appliance, mac: &str) -> PathBuf {
    write_claims(
        a,
        &json!({"productUuid": "00000000-0000-0000-0000-000000000000", "macs": [mac], "hostname": "pxe"}),
    )
}

/// The pending join request of a MAC, as `bca join-requests list` shows it.
pub(crate) fn pending(a: &Appliance, mac: &str) -> Option<Value> {
    a.cli_json(&["join-requests", "list"])["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["mac"] == mac)
        .cloned()
}

#[test]
fn a_discovered_machine_waits_for_approval_and_joins_as_ramdisk() {
    let a = appliance("unknown-machines");
    let pool = a.pool("intake");
    let (code, chain) = get(&a, "/api/compute/boot/chain.ipxe");
    assert_eq!(code, 200);
    // The MAC of the NIC that did DHCP (`netX`), not always the first one's.
    assert!(String::from_utf8_lossy(&chain).contains("/api/compute/boot/boot.ipxe?mac=${netX/mac}"));

    let mac = "52:54:00:12:34:56";
    let (script, dir) = boot(&a, mac);
    assert!(
        script.contains("kernel ") && script.contains("initrd --name initrd.img"),
        "{script}"
    );
    let etc = dir.join("etc/bca-agent");
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(etc.join("discovery-token"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    let token = std::fs::read_to_string(etc.join("discovery-token")).unwrap();
    assert!(token.starts_with("bcjt_jt_"));
    assert!(!script.contains(token.trim()), "the token is in the script");

    // A second fetch voids the first token.
    let (_, dir2) = boot(&a, mac);
    let claims = vm_claims(&a, mac);
    let old = discovery_join(&dir, &claims, 5).wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&old.stderr).trim(),
        "ACCESS_DENIED: Join refused"
    );
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "discovery:spent"
    );

    // The fresh token: the machine asks, and waits.
    let agent = discovery_join(&dir2, &claims, 60);
    let req = wait_for("a pending request", 20, || pending(&a, mac));
    assert_eq!(req["attestor"], "discovery");
    assert_eq!(req["state"], "pending");
    assert!(req["csrSha256"].as_str().unwrap().len() == 64);
    assert!(req["ip"].is_string());
    assert!(req["bootLeaseEpoch"].is_i64());
    // Waiting spends nothing: the token is still unspent.
    assert_eq!(
        a.count("SELECT count(*) FROM discovery_tokens WHERE spent_at IS NOT NULL"),
        0
    );
    let id = req["id"].as_str().unwrap().to_string();
    let approved = a.cli_json(&[
        "join-requests",
        "approve",
        &id,
        "--pool",
        &pool,
        "--ttl",
        "900",
        "--reason",
        "rack B7 intake, ticket 4411",
    ]);
    assert_eq!(approved["state"], "approved");
    assert_eq!(approved["decidedBy"], "uid:0");
    // Approving twice returns the approval.
    assert_eq!(
        a.cli_json(&["join-requests", "approve", &id, "--pool", &pool])["decidedAt"],
        approved["decidedAt"]
    );
    let node_id = succeeded(agent);
    let node = a.cli_json(&["nodes", "get", &node_id]);
    assert_eq!(node["role"], "ramdisk");
    assert_eq!(node["poolId"], json!(pool));
    let ttl: i64 = a
        .db()
        .query_row(
            "SELECT not_after - created_at FROM node_certs WHERE node_id = ?1",
            [&node_id],
            |r| r.get(0),
        )
        .unwrap();
    assert!(ttl <= 7200);
    let identity: Value =
        serde_json::from_slice(&std::fs::read(dir2.join("data/identity.json")).unwrap()).unwrap();
    let leaf = bca::proto::x509::pem_decode_all(
        identity["certificateChain"][0].as_str().unwrap(),
        "CERTIFICATE",
    )
    .remove(0);
    assert_eq!(bca::agent::cert_role(&leaf).as_deref(), Some("ramdisk"));
    let all = a.cli_json(&["join-requests", "list", "--state", "all"]);
    let consumed = all["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == json!(id))
        .unwrap()
        .clone();
    assert_eq!(consumed["state"], "consumed");
    assert_eq!(consumed["nodeId"], json!(node_id));
    assert!(a.last_event("security.join-request.approved").is_some());
    // A consumed request cannot be decided again; the token file was deleted; the token is spent.
    let (code, _) = a.cli_err(&["join-requests", "reject", &id, "--pool", &pool]);
    assert_eq!(code, "INVALID_STATE");
    assert!(!dir2.join("etc/bca-agent/discovery-token").exists());

    // A ramdisk node (nothing installed yet) boots the ramdisk again; once its node runs an OS
    // (role node) it boots its local disk; marked for rediscovery it gets the ramdisk again.
    let (_, s) = get(&a, &format!("/api/compute/boot/boot.ipxe?mac={mac}"));
    assert!(
        String::from_utf8_lossy(&s).contains("per-boot/"),
        "{}",
        String::from_utf8_lossy(&s)
    );
    a.live()
        .execute("UPDATE nodes SET role = 'node' WHERE id = ?1", &[&node_id]);
    let (_, s) = get(&a, &format!("/api/compute/boot/boot.ipxe?mac={mac}"));
    assert!(String::from_utf8_lossy(&s).contains("sanboot"));
    a.cli_json(&["nodes", "rediscover", &node_id]);
    let (_, s) = get(&a, &format!("/api/compute/boot/boot.ipxe?mac={mac}"));
    assert!(String::from_utf8_lossy(&s).contains("per-boot/"));
    // Boot leases record who booted what; the token appears nowhere.
    let leases = a.cli_json(&["boot", "leases", "--mac", mac]);
    assert!(leases["items"].as_array().unwrap().len() >= 3);
    let dump = a.db_bytes();
    let t = token.trim();
    assert!(
        !dump.windows(t.len()).any(|w| w == t.as_bytes()),
        "the discovery token is in the database"
    );
    let secret = t.split('.').nth(1).unwrap();
    assert!(!a.snapshot().contains(secret));
}

#[test]
fn a_rejected_machine_is_refused_and_another_waiting_one_is_unaffected() {
    let a = appliance("always");
    let pool = a.pool("intake");
    let (m1, m2) = ("52:54:00:00:00:01", "52:54:00:00:00:02");
    let (_, d1) = boot(&a, m1);
    let (_, d2) = boot(&a, m2);
    let (c1, c2) = (vm_claims(&a, m1), vm_claims(&a, m2));
    let j1 = discovery_join(&d1, &c1, 60);
    let mut j2 = discovery_join(&d2, &c2, 60);
    let r1 = wait_for("m1's request", 20, || pending(&a, m1));
    wait_for("m2's request", 20, || pending(&a, m2));
    let rej = a.cli_json(&[
        "join-requests",
        "reject",
        r1["id"].as_str().unwrap(),
        "--pool",
        &pool,
        "--reason",
        "unknown serial",
    ]);
    assert_eq!(rej["state"], "rejected");
    let out = j1.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).lines().last().unwrap(),
        "ACCESS_DENIED: Join refused"
    );
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "discovery:rejected"
    );
    assert!(a.last_event("security.join-request.rejected").is_some());
    // Rejected is final: approving it is INVALID_STATE.
    let (code, _) = a.cli_err(&[
        "join-requests",
        "approve",
        r1["id"].as_str().unwrap(),
        "--pool",
        &pool,
    ]);
    assert_eq!(code, "INVALID_STATE");
    // m2 still waits.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(j2.try_wait().unwrap().is_none(), "m2 stopped waiting");
    let r2 = pending(&a, m2).unwrap();
    // An archived pool approves nothing.
    let archived = a.pool("old");
    a.cli_json(&["pools", "archive", &archived]);
    let (code, _) = a.cli_err(&[
        "join-requests",
        "approve",
        r2["id"].as_str().unwrap(),
        "--pool",
        &archived,
    ]);
    assert_eq!(code, "INVALID_STATE");
    for bad in [vec!["--ttl", "59"], vec!["--ttl", "86401"]] {
        let mut args = vec![
            "join-requests",
            "approve",
            r2["id"].as_str().unwrap(),
            "--pool",
            &pool,
        ];
        args.extend(bad.iter());
        let (code, _) = a.cli_err(&args);
        assert_eq!(code, "INVALID_INPUT");
    }
    let (code, _) = a.cli_err(&["join-requests", "approve", "jreq_bad", "--pool", &pool]);
    assert_eq!(code, "INVALID_INPUT");
    let (code, _) = a.cli_err(&["join-requests", "list", "--state", "odd"]);
    assert_eq!(code, "INVALID_INPUT");
    a.cli_json(&[
        "join-requests",
        "approve",
        r2["id"].as_str().unwrap(),
        "--pool",
        &pool,
    ]);
    succeeded(j2);
}

/// Under `unknown-machines`, a machine an operator approved once (a `ramdisk` node) that boots
/// again, seen by the network with its own boot MAC, is admitted at once: a reclaim of its node
/// (a new identity generation, its older certificates revoked), with no new request.
#[test]
fn a_known_machine_is_admitted_at_once_under_unknown_machines() {
    let a = appliance("unknown-machines");
    let pool = a.pool("rack-a");
    let m = machine();
    let mac = m["macs"][0].as_str().unwrap().to_string();
    let claims = write_claims(&a, &m);
    // First boot: an unknown machine waits, and is approved.
    let (_, dir) = boot(&a, &mac);
    let agent = discovery_join(&dir, &claims, 60);
    let req = wait_for("a pending request", 20, || pending(&a, &mac));
    a.cli_json(&[
        "join-requests",
        "approve",
        req["id"].as_str().unwrap(),
        "--pool",
        &pool,
    ]);
    let node_id = succeeded(agent);
    let first_serial: String = a
        .db()
        .query_row(
            "SELECT serial FROM node_certs WHERE node_id = ?1",
            [&node_id],
            |r| r.get(0),
        )
        .unwrap();
    // It reboots into the ramdisk: admitted at once as the same node, a reclaim.
    let (_, dir) = boot(&a, &mac);
    let out = discovery_join(&dir, &claims, 10)
        .wait_with_output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), node_id);
    assert_eq!(a.count("SELECT count(*) FROM join_requests"), 1);
    let node = a.cli_json(&["nodes", "get", &node_id]);
    assert_eq!(node["identityGeneration"], 2);
    assert_eq!(node["role"], "ramdisk");
    let revoked: Option<String> = a
        .db()
        .query_row(
            "SELECT revoke_reason FROM node_certs WHERE serial = ?1",
            [&first_serial],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(revoked.as_deref(), Some("reclaimed"));
    let (_, ev) = a.last_event("node.joined").unwrap();
    assert_eq!(
        (ev["reclaim"].as_bool(), ev["knownMachine"].as_bool()),
        (Some(true), Some(true))
    );
    let audit = a.cli_json(&["audit", "list", "--action", "node.reclaimed"]);
    assert_eq!(audit["items"].as_array().unwrap().len(), 1, "{audit}");
    // A claimed MAC that is not the token's: refused.
    let (_, dir2) = boot(&a, "52:54:00:99:99:99");
    let out = discovery_join(&dir2, &claims, 5)
        .wait_with_output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "discovery:mac"
    );
}

#[test]
fn a_rack_is_approved_at_once_by_serial_prefix_each_audited() {
    let a = appliance("always");
    let pool = a.pool("rack-b7");
    let macs = [
        "52:54:00:00:b7:01",
        "52:54:00:00:b7:02",
        "52:54:00:00:c1:01",
    ];
    let serials = ["SN-B7-01", "SN-B7-02", "SN-C1-01"];
    let mut joins = Vec::new();
    for (mac, serial) in macs.iter().zip(serials) {
        let (_, d) = boot(&a, mac);
        let claims = write_claims(
            &a,
            &json!({"productUuid": "00000000-0000-0000-0000-000000000000", "macs": [mac],
                    "serials": {"product": serial}, "hostname": "pxe"}),
        );
        joins.push(discovery_join(&d, &claims, 60));
    }
    for mac in macs {
        wait_for("the requests", 20, || pending(&a, mac));
    }
    // A dry run lists and approves nothing.
    let v = a.cli_json(&[
        "join-requests",
        "approve",
        "--all-matching",
        "--serial-prefix",
        "SN-B7-",
        "--pool",
        &pool,
        "--reason",
        "rack B7 delivered",
        "--dry-run",
    ]);
    assert_eq!(v["items"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(
        a.count("SELECT count(*) FROM join_requests WHERE state = 'pending'"),
        3
    );
    // Refusals that name the problem.
    let o = a.cli(&[
        "join-requests",
        "approve",
        "--all-matching",
        "--serial-prefix",
        "SN-",
        "--pool",
        &pool,
    ]);
    assert_eq!(o.status.code(), Some(2), "a bulk approval needs --reason");
    let (code, msg) = a.cli_err(&[
        "join-requests",
        "approve",
        "--all-matching",
        "--pool",
        &pool,
        "--reason",
        "x",
    ]);
    assert_eq!(code, "INVALID_INPUT");
    assert!(msg.contains("never approves every request"), "{msg}");
    let (code, _) = a.cli_err(&[
        "join-requests",
        "approve",
        "--all-matching",
        "--serial-prefix",
        "SN-Z9-",
        "--pool",
        &pool,
        "--reason",
        "x",
    ]);
    assert_eq!(code, "NOT_FOUND");

    let o = a.cli(&[
        "--json",
        "join-requests",
        "approve",
        "--all-matching",
        "--serial-prefix",
        "SN-B7-",
        "--pool",
        &pool,
        "--reason",
        "rack B7 delivered",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("approving: 2/2 (100%)"));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(
        v["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["state"] == "approved"),
        "{v}"
    );
    // One audit row per approval, with the reason.
    let rows = a.cli_json(&["audit", "list", "--action", "joinRequests.approve"]);
    let rows = rows["items"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    assert!(
        rows.iter()
            .all(|r| r["data"]["reason"] == "rack B7 delivered"),
        "{rows:?}"
    );
    // The two B7 machines join; the C1 machine still waits.
    for j in joins.drain(..2) {
        succeeded(j);
    }
    // A decision on a request that changed since it was listed is refused.
    let r = pending(&a, macs[2]).unwrap();
    let e = a
        .api(
            "joinRequests/approve",
            json!({"tenantId": a.root_tenant(), "poolId": pool, "requestId": r["id"],
                   "csrSha256": "00".repeat(32)}),
        )
        .unwrap_err();
    assert_eq!(e.code, bca::base::error::Code::Conflict, "{e}");
    assert!(pending(&a, macs[2]).is_some());
    let mut last = joins.pop().unwrap();
    let _ = last.kill();
    let _ = last.wait();
}

#[test]
fn boot_files_stream_from_disk_and_the_combined_initrd_is_padded() {
    let a = appliance("always");
    let root = a.state().join("boot");
    std::fs::create_dir_all(&root).unwrap();
    // Sizes that are not multiples of the 64 KiB chunk or of 4.
    let kernel: Vec<u8> = (0..300_001u32).map(|i| (i * 7 % 251) as u8).collect();
    let initrd: Vec<u8> = (0..200_003u32).map(|i| (i * 13 % 253) as u8).collect();
    std::fs::write(root.join("vmlinuz"), &kernel).unwrap();
    std::fs::write(root.join("initrd.img"), &initrd).unwrap();
    let (code, got) = get(&a, "/api/compute/boot/files/vmlinuz");
    assert_eq!(code, 200);
    assert!(got == kernel, "vmlinuz differs ({} bytes)", got.len());
    let (code, _) = get(&a, "/api/compute/boot/files/..%2Fbca.db");
    assert_eq!(code, 404);
    let (code, _) = get(&a, "/api/compute/boot/files/missing");
    assert_eq!(code, 404);

    sight(&a, "52:54:00:00:00:aa");
    let (code, script) = get(&a, "/api/compute/boot/boot.ipxe?mac=52:54:00:00:00:aa");
    assert_eq!(code, 200);
    let script = String::from_utf8(script).unwrap();
    let url = script
        .lines()
        .find_map(|l| l.strip_prefix("initrd --name initrd.img "))
        .unwrap();
    let path = format!("/api/{}", url.split_once("/api/").unwrap().1);
    let o = Command::new("curl")
        .args(["-s", "-D", "-", "-o"])
        .arg(a.dir.path().join("combined"))
        .arg(format!("http://{}{path}", a.http))
        .output()
        .unwrap();
    let headers = String::from_utf8_lossy(&o.stdout).to_lowercase();
    let combined = std::fs::read(a.dir.path().join("combined")).unwrap();
    assert!(
        headers.contains(&format!("content-length: {}", combined.len())),
        "{headers}"
    );
    assert_eq!(&combined[..initrd.len()], &initrd[..]);
    // Zero padding to a multiple of four, then the newc archive.
    assert_eq!(&combined[initrd.len()..200_004], &[0u8]);
    assert!(combined[200_004..].starts_with(b"070701"));
    // Served once.
    assert_eq!(get(&a, &path).0, 404);
}

/// `curl` from a given loopback source address: (status, body).
fn get_from(a: &Appliance, source: &str, path: &str) -> (u16, Vec<u8>) {
    let o = Command::new("curl")
        .args([
            "-s",
            "--interface",
            source,
            "-w",
            "\n%{http_code}",
            &format!("http://{}{path}", a.http),
        ])
        .output()
        .unwrap();
    let mut body = o.stdout;
    let nl = body.iter().rposition(|c| *c == b'\n').unwrap();
    let code = String::from_utf8_lossy(&body[nl + 1..]).parse().unwrap();
    body.truncate(nl);
    (code, body)
}

/// The per-boot archive path (`.cpio`) a boot script names.
fn archive_path(script: &str) -> String {
    let url = script
        .lines()
        .find_map(|l| l.strip_prefix("initrd --name initrd.img "))
        .unwrap_or_else(|| panic!("{script}"));
    format!("/api/{}", url.split_once("/api/").unwrap().1).replace("/initrd.img", ".cpio")
}

/// Events in a tenant's stream that name a node.
fn events_naming(a: &Appliance, tenant: &str, node: &str) -> i64 {
    a.db()
        .query_row(
            "SELECT count(*) FROM events WHERE tenant_id = ?1 AND instr(data, ?2) > 0",
            [tenant, node],
            |r| r.get(0),
        )
        .unwrap()
}

/// A machine approved once, then approved: its node (a `ramdisk` node whose identifiers an
/// operator's approval recorded).
pub(crate) fn discovered_node(a: &Appliance, pool: &str, mac: &str, claims: &Path) -> String {
    let (_, dir) = boot(a, mac);
    let agent = discovery_join(&dir, claims, 60);
    let req = wait_for("a pending request", 20, || pending(a, mac));
    a.cli_json(&[
        "join-requests",
        "approve",
        req["id"].as_str().unwrap(),
        "--pool",
        pool,
    ]);
    succeeded(agent)
}

/// Reproduction 1 (security review): with HTTP access only, nothing is minted for a MAC the
/// network did not see, and nothing is written; and a machine that names a victim's identifiers
/// with a MAC of its own (even one the network saw) is never admitted as the victim's node.
#[test]
fn an_http_only_attacker_mints_nothing_and_claims_never_make_a_known_node() {
    let a = appliance("unknown-machines");
    let pool = a.pool("rack-a");
    let victim = machine();
    let victim_mac = victim["macs"][0].as_str().unwrap().to_string();
    let node = discovered_node(&a, &pool, &victim_mac, &write_claims(&a, &victim));

    // No sighting: 403 with the reason, and nothing written (no lease, no token, no archive).
    let before = a.snapshot();
    let (code, body) = get(&a, "/api/compute/boot/boot.ipxe?mac=52:54:00:66:66:66");
    assert_eq!(code, 403);
    let body = String::from_utf8_lossy(&body);
    assert!(body.contains("did not see 52:54:00:66:66:66"), "{body}");
    // The victim's own MAC, asked from an address the network did not see it at.
    let (code, _) = get_from(
        &a,
        "127.0.0.9",
        &format!("/api/compute/boot/boot.ipxe?mac={victim_mac}"),
    );
    assert_eq!(code, 403);
    assert_eq!(
        a.snapshot(),
        before,
        "a refused boot script wrote something"
    );

    // An attacker on the L2 segment gets a sighting for a MAC of its own, and claims the
    // victim's UUID and serials with it: a join request, never the victim's node.
    let mut forged = victim.clone();
    forged["macs"] = json!(["52:54:00:66:66:66"]);
    let (_, dir) = boot(&a, "52:54:00:66:66:66");
    let out = discovery_join(&dir, &write_claims(&a, &forged), 3)
        .wait_with_output()
        .unwrap();
    assert!(
        !out.status.success(),
        "admitted: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    let n = a.cli_json(&["nodes", "get", &node]);
    assert_eq!(n["identityGeneration"], 1);
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), 1);
    let boot_mac: String = a
        .db()
        .query_row("SELECT boot_mac FROM nodes WHERE id = ?1", [&node], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(boot_mac, victim_mac);
    // The request shows the node its claims conflict with.
    let req = pending(&a, "52:54:00:66:66:66").unwrap();
    assert_eq!(req["conflictingNode"]["nodeId"], json!(node), "{req}");
    let table = a.cli(&["join-requests", "list"]);
    assert!(String::from_utf8_lossy(&table.stdout).contains(&node));
}

/// Reproduction 2: a tenant that token-joins a fake machine with a new machine's identifiers
/// does not get that machine when it PXE-boots (it waits for an operator), and an approval into
/// another tenant's pool never certifies it as the squatter's node; no event about one tenant's
/// node reaches the other's stream.
#[test]
fn a_token_joined_squatter_never_takes_a_discovered_machine() {
    let a = appliance("unknown-machines");
    let tb = a.api_ok("tenants/create", json!({"name": "tenant-b"}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let pool_b = a.api_ok("pools/create", json!({"tenantId": tb, "name": "b"}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let (_, token_b) = a.token(&pool_b, json!({"tenantId": tb}));
    let real = machine();
    let mac = real["macs"][0].as_str().unwrap().to_string();
    let squat = Sim::new(&a).admitted(&token_b, &real);
    let squat_certs = a.count("SELECT count(*) FROM node_certs");
    let root = a.root_tenant();
    // The real machine boots: it waits, its request naming the squatting node.
    let pool_a = a.pool("rack-a");
    let (_, dir) = boot(&a, &mac);
    let agent = discovery_join(&dir, &write_claims(&a, &real), 8);
    let req = wait_for("a pending request", 20, || pending(&a, &mac));
    assert_eq!(
        req["conflictingNode"]["nodeId"],
        json!(squat.node_id),
        "{req}"
    );
    assert_eq!(req["conflictingNode"]["tenantId"], json!(tb));
    // Approved into the root tenant's pool: its retry is refused, nothing is issued.
    let approved = a.cli_json(&[
        "join-requests",
        "approve",
        req["id"].as_str().unwrap(),
        "--pool",
        &pool_a,
    ]);
    assert_eq!(approved["conflictingNode"]["nodeId"], json!(squat.node_id));
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
    assert_eq!(a.count("SELECT count(*) FROM node_certs"), squat_certs);
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 1);
    assert_eq!(
        events_naming(&a, &root, &squat.node_id),
        0,
        "tenant B's node in the root tenant's stream"
    );
    let n = a.cli_json(&["nodes", "get", &squat.node_id, "--tenant", &tb]);
    assert_eq!(n["identityGeneration"], 1);
}

/// Item 8: an open request is refreshed only from its own MAC, its token is not taken for
/// another machine, and a new boot of the MAC does not void the token an approval waits for.
#[test]
fn requests_cannot_be_hijacked() {
    let a = appliance("always");
    let pool = a.pool("intake");
    let m = machine();
    let mac = m["macs"][0].as_str().unwrap().to_string();
    let claims = write_claims(&a, &m);
    let (_, dir) = boot(&a, &mac);
    let agent = discovery_join(&dir, &claims, 60);
    let req = wait_for("a pending request", 20, || pending(&a, &mac));
    // Another machine, the network saw it with its own MAC, claims the same identifiers.
    let mut thief = m.clone();
    thief["macs"] = json!(["52:54:00:77:77:77"]);
    let (_, tdir) = boot(&a, "52:54:00:77:77:77");
    let out = discovery_join(&tdir, &write_claims(&a, &thief), 3)
        .wait_with_output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "discovery:mac-conflict"
    );
    let same = pending(&a, &mac).unwrap();
    assert_eq!(
        (same["csrSha256"].clone(), same["mac"].clone()),
        (req["csrSha256"].clone(), req["mac"].clone())
    );
    // The machine's token, taken for another machine (whose claims carry the token's MAC).
    let token = std::fs::read_to_string(dir.join("etc/bca-agent/discovery-token")).unwrap();
    let other = json!({"productUuid": "11111111-2222-3333-4444-555555555555", "serials": {"product": "SN-OTHER"}, "macs": [mac]});
    let odir = a.dir.path().join(format!("other-{}", rand_hex(4)));
    std::fs::create_dir_all(odir.join("etc/bca-agent")).unwrap();
    for f in ["config.toml", "join-encryption.jwk"] {
        std::fs::copy(
            dir.join("etc/bca-agent").join(f),
            odir.join("etc/bca-agent").join(f),
        )
        .unwrap();
    }
    let tf = odir.join("etc/bca-agent/discovery-token");
    std::fs::write(&tf, &token).unwrap();
    std::fs::set_permissions(&tf, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let out = discovery_join(&odir, &write_claims(&a, &other), 3)
        .wait_with_output()
        .unwrap();
    assert!(!out.status.success());
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "discovery:token-reused"
    );
    // Approved; then anyone boots the MAC again: the approved request's token stays good, and
    // the machine's retry is admitted.
    a.cli_json(&[
        "join-requests",
        "approve",
        req["id"].as_str().unwrap(),
        "--pool",
        &pool,
    ]);
    sight(&a, &mac);
    assert_eq!(
        get(&a, &format!("/api/compute/boot/boot.ipxe?mac={mac}")).0,
        200
    );
    succeeded(agent);
}

/// Reproduction 3: one source flooding `boot.ipxe` keeps at most its own share of waiting
/// archives and meets its rate; a machine that is really booting, elsewhere, is served. An
/// archive goes only to the address it was made for.
#[test]
fn a_flooding_source_cannot_stop_a_real_machines_boot() {
    let a = appliance("always");
    let mut scripts = Vec::new();
    for i in 0..20u8 {
        let mac = format!("52:54:00:f1:00:{i:02x}");
        sight(&a, &mac);
        let (code, s) = get(&a, &format!("/api/compute/boot/boot.ipxe?mac={mac}"));
        assert_eq!(code, 200);
        scripts.push(String::from_utf8(s).unwrap());
    }
    // The flooder's oldest archives gave way to its newest (16 per source by default).
    assert_eq!(get(&a, &archive_path(&scripts[0])).0, 404);
    // A real machine at another address is served, its archive to it alone.
    let real = "52:54:00:0e:a1:01";
    sight_at(&a, real, "127.0.0.2".parse().unwrap());
    let (code, s) = get_from(
        &a,
        "127.0.0.2",
        &format!("/api/compute/boot/boot.ipxe?mac={real}"),
    );
    assert_eq!(code, 200);
    let path = archive_path(&String::from_utf8(s).unwrap());
    assert_eq!(get(&a, &path).0, 404, "served to another address");
    assert_eq!(get_from(&a, "127.0.0.2", &path).0, 200);
    // The flooder meets its per-MAC rate, then its per-source rate: 429, nothing minted. (The
    // rates are per clock minute: 25 asks meet the MAC's 12 even when a minute ends among them.)
    let mac = "52:54:00:f1:00:00";
    let codes: Vec<u16> = (0..25)
        .map(|_| get(&a, &format!("/api/compute/boot/boot.ipxe?mac={mac}")).0)
        .collect();
    assert!(codes.contains(&429), "{codes:?}");
    let tokens = a.count("SELECT count(*) FROM discovery_tokens");
    assert_eq!(
        get(&a, &format!("/api/compute/boot/boot.ipxe?mac={mac}")).0,
        429
    );
    assert_eq!(a.count("SELECT count(*) FROM discovery_tokens"), tokens);
}

/// Reproduction 4: control characters from a machine never reach a terminal raw: refused at
/// intake (a join's claims, an API body), and escaped when a stored value is printed.
#[test]
fn control_characters_never_reach_the_operators_terminal() {
    let a = appliance("always");
    let sim = Sim::new(&a);
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({"maxUses": 3}));
    let mut m = machine();
    m["hostname"] = json!("m\u{1b}]0;owned\u{7}\u{1b}[2K");
    let (raw, _, _) = sim.join(&token, &m);
    assert_eq!(raw, refused_bytes());
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "join:claims"
    );
    m["hostname"] = json!("bidi\u{202e}cod.exe");
    let (raw, _, _) = sim.join(&token, &m);
    assert_eq!(raw, refused_bytes());
    let before = a.snapshot();
    let e = a
        .api(
            "pools/create",
            json!({"tenantId": a.root_tenant(), "name": "x\u{1b}[31m"}),
        )
        .unwrap_err();
    assert_eq!(e.code, bca::base::error::Code::InvalidInput);
    assert!(
        e.message
            .contains("name must be free of control characters"),
        "{}",
        e.message
    );
    assert_eq!(a.snapshot(), before);
    // A value stored before the rule (written here by hand) is printed escaped.
    let (_, dir) = boot(&a, "52:54:00:e5:c0:01");
    let j = discovery_join(&dir, &vm_claims(&a, "52:54:00:e5:c0:01"), 3);
    wait_for("a pending request", 20, || pending(&a, "52:54:00:e5:c0:01"));
    let db = a.live();
    let set = match db {
        Live::Sqlite(_) => {
            "UPDATE join_requests SET claims_json = json_set(claims_json, '$.productUuid', ?1)"
        }
        Live::Postgres(_) => {
            "UPDATE join_requests SET claims_json = jsonb_set(claims_json::jsonb, '{productUuid}', to_jsonb(?1::text))::text"
        }
    };
    db.execute(set, &["\u{1b}]0;title\u{7}\u{1b}[1A\u{1b}[2Kforged"]);
    let o = a.cli(&["join-requests", "list"]);
    assert!(o.status.success());
    assert!(
        !o.stdout.contains(&0x1b) && !o.stdout.contains(&0x07),
        "raw control bytes printed"
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("\\u{1b}]0;title"));
    let _ = j.wait_with_output();
}

/// From the attack review: refused `boot.ipxe` requests (from where the MAC was not seen) spend
/// no budget of the MAC's, so nobody can stop a machine's boot with them.
#[test]
fn refused_boot_scripts_do_not_spend_a_machines_budget() {
    let a = appliance("always");
    let victim = "52:54:00:0d:05:01";
    for _ in 0..15 {
        let (code, _) = get_from(
            &a,
            "127.0.0.9",
            &format!("/api/compute/boot/boot.ipxe?mac={victim}"),
        );
        assert_eq!(code, 403);
    }
    sight_at(&a, victim, "127.0.0.5".parse().unwrap());
    let (code, body) = get_from(
        &a,
        "127.0.0.5",
        &format!("/api/compute/boot/boot.ipxe?mac={victim}"),
    );
    assert_eq!(code, 200, "{}", String::from_utf8_lossy(&body));
}

/// From the attack review: an attacker that spoofs a waiting machine's MAC (its sighting is one
/// UDP packet) and claims its identifiers, from another address, cannot reset an approved
/// request to its own CSR; the machine's retry is then admitted.
#[test]
fn an_approved_request_is_not_reset_from_another_address() {
    let a = appliance("always");
    let pool = a.pool("intake");
    let m = machine();
    let mac = m["macs"][0].as_str().unwrap().to_string();
    let claims = write_claims(&a, &m);
    let (_, dir) = boot(&a, &mac);
    let agent = discovery_join(&dir, &claims, 60);
    let req = wait_for("a pending request", 20, || pending(&a, &mac));
    let approved = a.cli_json(&[
        "join-requests",
        "approve",
        req["id"].as_str().unwrap(),
        "--pool",
        &pool,
    ]);
    // The attacker at 127.0.0.9: the victim's MAC sighted there, its archive, the victim's
    // claims, a CSR of its own.
    sight_at(&a, &mac, "127.0.0.9".parse().unwrap());
    let (code, script) = get_from(
        &a,
        "127.0.0.9",
        &format!("/api/compute/boot/boot.ipxe?mac={mac}"),
    );
    assert_eq!(code, 200);
    let (code, cpio) = get_from(
        &a,
        "127.0.0.9",
        &archive_path(&String::from_utf8(script).unwrap()),
    );
    assert_eq!(code, 200);
    let entries = bca::base::cpio::read(&cpio).unwrap();
    let token = entries
        .iter()
        .find(|e| e.name.ends_with("discovery-token"))
        .unwrap();
    let token = String::from_utf8(token.data.clone())
        .unwrap()
        .trim()
        .to_string();
    let sim = Sim::new(&a);
    let key = bca::base::crypto::SigningKey::generate();
    let csr = bca::proto::csr::create(&key);
    let sealed = bca::proto::jwe::seal(&token, &sim.enc, &csr, bca::base::clock::now()).unwrap();
    let raw = send_from(
        &a,
        "127.0.0.9",
        Sim::request(sealed, &csr, &m, "discovery", "ramdisk"),
    );
    assert_eq!(raw, refused_bytes());
    assert_eq!(
        a.last_event("security.join.refused").unwrap().1["reason"],
        "discovery:address-conflict"
    );
    let all = a.cli_json(&["join-requests", "list", "--state", "all"]);
    let now = all["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == req["id"])
        .unwrap()
        .clone();
    assert_eq!(
        (now["state"].as_str(), now["csrSha256"].clone()),
        (Some("approved"), approved["csrSha256"].clone())
    );
    // The machine's retry, from where it asked, is admitted.
    succeeded(agent);
}

/// From the attack review: a join's `role` is the peer's too; its control characters reach no
/// event raw.
#[test]
fn a_joins_role_reaches_no_event_raw() {
    let a = appliance("always");
    let sim = Sim::new(&a);
    let req = Sim::request(
        "x".into(),
        b"not a CSR",
        &machine(),
        "",
        "\u{1b}]0;PWNED\u{7}\u{9b}1A\u{202e}",
    );
    let raw = bca::agent::exchange_raw(&sim.cfg, &req).unwrap();
    assert_eq!(raw, refused_bytes());
    let (_, ev) = a.last_event("security.join.refused").unwrap();
    let role = ev["role"].as_str().unwrap();
    assert!(!bca::base::text::has_control(role), "{role:?}");
    assert!(role.contains("\\u{1b}]0;PWNED"), "{role:?}");
}

/// `pxe/`'s templates are built in; an operator's file of the same name under
/// `<boot root>/templates/` replaces one at its next use, and the values are filled in. The
/// chain script TFTP serves is rendered at start.
#[test]
fn an_operators_template_under_the_boot_root_replaces_the_built_in_script() {
    let mut a = appliance("always");
    let root = a.state().join("boot");
    let templates = root.join("templates");
    std::fs::create_dir_all(&templates).unwrap();
    std::fs::write(
        templates.join("discovery.ipxe"),
        "#!ipxe\necho site override for {{mac}}\nkernel {{base}}{{base_path}}/boot/files/vmlinuz {{kernel_args}}\ninitrd --name initrd.img {{base}}{{base_path}}/boot/per-boot/{{nonce}}/initrd.img\nboot\n",
    )
    .unwrap();
    std::fs::write(
        templates.join("chain.ipxe"),
        "#!ipxe\n# site chain\nchain {{base}}{{base_path}}/boot/boot.ipxe?mac=${net0/mac}\n",
    )
    .unwrap();
    let mac = "52:54:00:7e:01:01";
    let (script, _) = boot(&a, mac);
    assert!(
        script.contains(&format!("echo site override for {mac}")),
        "{script}"
    );
    assert!(
        script.contains(&format!("http://{}/api/compute/boot/files/vmlinuz", a.http)),
        "{script}"
    );
    assert!(!script.contains("{{"), "{script}");
    let (code, chain) = get(&a, "/api/compute/boot/chain.ipxe");
    assert_eq!(code, 200);
    let chain = String::from_utf8(chain).unwrap();
    assert!(
        chain.contains("# site chain") && chain.contains("${net0/mac}"),
        "{chain}"
    );
    // Restarted, the boot server writes the chain script TFTP serves from the override.
    a.restart();
    let written = std::fs::read_to_string(root.join("chain.ipxe")).unwrap();
    assert!(written.contains("# site chain"), "{written}");
    // Removed, the built-in one is back at once. (A link out of the root: `boot::templates`'s
    // unit tests.)
    std::fs::remove_file(templates.join("discovery.ipxe")).unwrap();
    let (script, _) = boot(&a, "52:54:00:7e:01:02");
    assert!(
        script.contains("echo bca: discovery ramdisk for 52:54:00:7e:01:02"),
        "{script}"
    );
    let (_, missing) = get(&a, "/api/compute/boot/boot.ipxe");
    let missing = String::from_utf8(missing).unwrap();
    assert!(missing.contains("needs ?mac="), "{missing}");
}

/// Issue 28, item 8: discovery honours the pool's `policy.joinAttestors`. Approving a machine
/// into a pool whose attestors exclude `discovery` is `INVALID_STATE`; a pool that stops
/// allowing it after the approval refuses the join (`join:pool-attestor`), and the token and
/// the approval are left as they were.
#[test]
fn discovery_honours_the_pools_join_attestors() {
    let a = appliance("always");
    let pool = a.pool("intake");
    let tokens_only = a.cli_json(&[
        "pools",
        "create",
        "--name",
        "tokens-only",
        "--join-attestors",
        "join-token",
    ])["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mac = "52:54:00:5e:a7:01";
    let (_, dir) = boot(&a, mac);
    let claims = vm_claims(&a, mac);
    // A long retry: the decisions below are all made before the agent asks again.
    let etc = dir.join("etc/bca-agent");
    let agent = Command::new(bin())
        .args([
            "agent",
            "join",
            "--attestor",
            "discovery",
            "--role",
            "ramdisk",
            "--config",
        ])
        .arg(etc.join("config.toml"))
        .arg("--token-file")
        .arg(etc.join("discovery-token"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .arg("--claims")
        .arg(&claims)
        .args(["--wait-seconds", "60", "--retry-seconds", "6"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let req = wait_for("a pending request", 20, || pending(&a, mac));
    let id = req["id"].as_str().unwrap().to_string();
    let (code, msg) = a.cli_err(&["join-requests", "approve", &id, "--pool", &tokens_only]);
    assert_eq!(code, "INVALID_STATE", "{msg}");
    assert!(
        msg.contains("does not allow the discovery attestor"),
        "{msg}"
    );
    assert_eq!(pending(&a, mac).unwrap()["state"], "pending");
    let approved = a.cli_json(&["join-requests", "approve", &id, "--pool", &pool]);
    assert_eq!(approved["state"], "approved");
    a.cli_json(&[
        "pools",
        "update",
        &pool,
        "--join-attestors",
        "join-token,tpm",
    ]);
    let out = agent.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .last()
            .unwrap_or_default()
            .trim(),
        "ACCESS_DENIED: Join refused"
    );
    let (_, ev) = a.last_event("security.join.refused").unwrap();
    assert_eq!(ev["reason"], "join:pool-attestor");
    assert_eq!(ev["attestor"], "discovery");
    assert_eq!(a.count("SELECT count(*) FROM nodes"), 0);
    assert_eq!(
        a.count("SELECT count(*) FROM discovery_tokens WHERE spent_at IS NOT NULL"),
        0
    );
    let all = a.cli_json(&["join-requests", "list", "--state", "approved"]);
    assert!(all["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|r| r["id"] == json!(id)));
}
