//! Operating the appliance: health and metrics over HTTP, `bca doctor`, the audit trail and
//! retention.

use crate::common::*;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

fn metric(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(line_start)
                .map(|v| v.trim().parse().unwrap())
        })
        .unwrap_or_else(|| panic!("no {line_start} in\n{text}"))
}

#[test]
fn healthz_and_metrics_count_what_happened() {
    let a = Appliance::start();
    let (code, body) = curl(&a, "/healthz", "GET");
    assert_eq!(code, 200, "{body}");
    let h: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(h["status"], "ok", "{h}");
    assert_eq!(h["database"], true);
    assert_eq!(h["joinService"], true);
    assert_eq!(h["warnings"], json!([]));

    // One admitted join, one refused.
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 1}));
    let sim = Sim::new(&a);
    sim.admitted(&token, &machine());
    let (raw, _, _) = sim.join(&token, &machine());
    assert_eq!(raw, refused_bytes());

    let (code, text) = curl(&a, "/metrics", "GET");
    assert_eq!(code, 200);
    assert_eq!(metric(&text, "bca_joins_total{outcome=\"issued\"}"), 1.0);
    assert_eq!(metric(&text, "bca_joins_total{outcome=\"refused\"}"), 1.0);
    assert_eq!(
        metric(&text, "bca_refusals_total{reason=\"join-token:exhausted\"}"),
        1.0,
        "{text}"
    );
    assert!(metric(&text, "bca_commit_seconds_count") >= 2.0);
    assert_eq!(metric(&text, "bca_queue_depth"), 0.0);
    assert_eq!(metric(&text, "bca_sessions"), 0.0);
    // Every sample line is `name{labels} number` under a TYPE line: what Prometheus parses.
    for l in text.lines().filter(|l| !l.starts_with('#')) {
        let (name, v) = l.rsplit_once(' ').unwrap();
        assert!(name.starts_with("bca_"), "{l}");
        v.parse::<f64>().unwrap_or_else(|_| panic!("{l}"));
    }
    // No token secret in the metrics.
    assert!(!text.contains(token.split('.').next_back().unwrap()));

    // Wrong method: a clear error, nothing else.
    let (code, body) = curl(&a, "/healthz", "POST");
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("use GET for /healthz"), "{body}");

    // The same report on the admin socket, for `bca health`.
    let v = a.cli_json(&["health"]);
    assert_eq!(v["status"], "ok");
}

#[test]
fn doctor_checks_modes_keys_database_and_the_clock() {
    let a = Appliance::start();
    let o = a.cli(&["doctor"]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        o.status.success(),
        "{out}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for line in [
        "ok   state directory",
        "ok   file modes",
        "WARN keys: loadable, and plain files",
        "ok   gateway certificate: valid until",
        "ok   database",
        "ok   server: serving on",
        "ok   tpm",
        "ok   clock",
    ] {
        assert!(out.contains(line), "{line:?} not in\n{out}");
    }

    // A clock that went backwards (a row written a day ahead of now) is a warning, and /healthz
    // says degraded (still 200: the appliance serves).
    let tomorrow = bca::base::clock::now() + 86_400;
    a.live().execute_values(
        "INSERT INTO audit (tenant_id, action, actor, target, data, created_at) VALUES ('x', 'test', 'test', 'x', '{}', ?1)",
        &[V::Int(tomorrow)],
    );
    let o = a.cli(&["doctor"]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{out}");
    assert!(
        out.contains("WARN clock: the clock went backwards"),
        "{out}"
    );
    let (code, body) = curl(&a, "/healthz", "GET");
    assert_eq!(code, 200);
    assert!(
        body.contains("\"degraded\"") && body.contains("went backwards"),
        "{body}"
    );

    // A key file readable by others fails the check and names the file.
    let key = a.state().join("keys");
    let f = std::fs::read_dir(&key)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
    let o = a.cli(&["doctor"]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains(&format!("FAIL file modes: {} is 0644", f.display())),
        "{out}"
    );
    assert!(String::from_utf8_lossy(&o.stderr).contains("INVALID_STATE"));
}

#[test]
fn doctor_without_a_server_checks_the_ports() {
    let mut a = Appliance::start();
    a.stop();
    // Ports that nobody holds: the config's listeners point at free loopback ports.
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let text = text
        .lines()
        .map(|l| {
            if l.starts_with("listen_http") {
                "listen_http = \"127.0.0.1:0\"".to_string()
            } else if l.starts_with("listen_gateway") {
                "listen_gateway = \"127.0.0.1:0\"".to_string()
            } else {
                l.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("\n");
    std::fs::write(&cfg, text).unwrap();
    let o = a.cli(&["doctor"]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{out}");
    assert!(out.contains("WARN server: not answering"), "{out}");
    assert!(out.contains("ok   http: 127.0.0.1:0 is free"), "{out}");
    // A port someone else holds is a failure.
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().to_string();
    let text = std::fs::read_to_string(&cfg).unwrap().replace(
        "listen_gateway = \"127.0.0.1:0\"",
        &format!("listen_gateway = \"{port}\""),
    );
    std::fs::write(&cfg, text).unwrap();
    let o = a.cli(&["doctor"]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        out.contains(&format!("FAIL gateway: {port} cannot be bound")),
        "{out}"
    );
}

#[test]
fn audit_list_filters_by_action_and_time() {
    let a = Appliance::start();
    let pool = a.pool("p1");
    a.token(&pool, json!({}));
    let v = a.cli_json(&["audit", "list", "--action", "pools."]);
    let items = v["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{v}");
    assert_eq!(items[0]["action"], "pools.create");
    assert!(items[0]["actor"].as_str().unwrap().starts_with("uid:"));
    let v = a.cli_json(&["audit", "list", "--since", "1h"]);
    let actions: Vec<&str> = v["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["action"].as_str().unwrap())
        .collect();
    assert_eq!(actions, ["joinTokens.create", "pools.create", "site.init"]);
    let v = a.cli_json(&["audit", "list", "--since", "2099-01-01T00:00:00Z"]);
    assert_eq!(v["items"], json!([]));
    // The table names the columns.
    let o = a.cli(&["audit", "list"]);
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(
        table.starts_with("TIME") && table.contains("joinTokens.create"),
        "{table}"
    );

    // Bad values: named, exit 1.
    let (code, msg) = a.cli_err(&["audit", "list", "--since", "yesterday"]);
    assert_eq!(code, "INVALID_INPUT");
    assert!(msg.contains("since must be an RFC 3339 time"), "{msg}");
    let (code, msg) = a.cli_err(&["audit", "list", "--action", "a b"]);
    assert_eq!(code, "INVALID_INPUT");
    assert!(msg.contains("action must be"), "{msg}");
    let (code, msg) = a.cli_err(&["audit", "list", "--limit", "0"]);
    assert_eq!(code, "INVALID_INPUT");
    assert!(msg.contains("limit"), "{msg}");
}

fn old_rows(a: &Appliance, age_days: i64) {
    let t = bca::base::clock::now() - age_days * 86_400;
    let db = a.live();
    db.execute_values(
        "INSERT INTO events (id, tenant_id, type, data, created_at) VALUES ('ev_old1', 'x', 'node.joined', '{}', ?1)",
        &[V::Int(t)],
    );
    db.execute_values(
        "INSERT INTO events (id, tenant_id, type, data, created_at) VALUES ('ev_old2', 'x', 'security.join.refused', '{}', ?1)",
        &[V::Int(t)],
    );
    db.execute_values(
        "INSERT INTO boot_leases (mac, stage, created_at) VALUES ('52:54:00:00:00:01', 'dhcp', ?1)",
        &[V::Int(t)],
    );
}

#[test]
fn retention_prunes_at_start_and_records_it() {
    let mut a = Appliance::start_cfg("file", &[], |c| {
        replace_table(
            &c,
            "retention",
            "[retention]\nevents_days = 10\naudit_days = 100\nboot_leases_days = 10\n",
        )
    });
    old_rows(&a, 20);
    // Two nodes: A with a second, long-expired certificate (pruned), B whose only certificate is
    // long expired (kept: a node's newest is never pruned).
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 2}));
    let sim = Sim::new(&a);
    let na = sim.admitted(&token, &machine()).node_id;
    let nb = sim.admitted(&token, &machine()).node_id;
    let old = bca::base::clock::now() - 60 * 86_400;
    let db = a.live();
    db.execute_values(
        "INSERT INTO node_certs (serial, node_id, identity_generation, role, spki_sha256, der, not_before, not_after, created_at)
         SELECT 'aa' || serial, node_id, identity_generation, role, spki_sha256, der, ?2, ?2, ?2 FROM node_certs WHERE node_id = ?1",
        &[V::Text(na.clone()), V::Int(old)],
    );
    db.execute_values(
        "UPDATE node_certs SET not_after = ?2, created_at = ?2 WHERE node_id = ?1",
        &[V::Text(nb.clone()), V::Int(old)],
    );
    // A join request decided long ago (pruned) and one still pending from long ago (kept).
    for (id, state, decided) in [
        ("jreq_old", "rejected", Some(old)),
        ("jreq_wait", "pending", None),
    ] {
        let site = bca::config::Config::load(&a.state()).unwrap().site_id;
        db.execute_values(
            "INSERT INTO join_requests (id, site_id, attestor, machine_key, claims_json, csr_sha256, state, created_at, updated_at, expires_at, decided_at)
             VALUES (?1, ?6, 'discovery', ?7, '{}', '00', ?2, ?3, ?3, ?4, ?5)",
            &[
                V::Text(id.into()),
                V::Text(state.into()),
                V::Int(old),
                V::Int(bca::base::clock::now() + 3600),
                decided.map_or(V::Null, V::Int),
                V::Text(site),
                V::Text(format!("mac:{id}")),
            ],
        );
    }
    drop(db);
    a.restart();
    // The pass at start: the first server may already have pruned what was old when it started
    // (its first pass races this test's inserts), so count over every pruning row.
    let rows = wait_for("the retention rows", 10, || {
        let v = a.cli_json(&["audit", "list", "--action", "retention.pruned"]);
        let items = v["items"].as_array().unwrap().clone();
        let certs: i64 = items
            .iter()
            .map(|r| r["data"]["nodeCerts"].as_i64().unwrap())
            .sum();
        (certs > 0).then_some(items)
    });
    let sum = |k: &str| -> i64 { rows.iter().map(|r| r["data"][k].as_i64().unwrap()).sum() };
    let pruned = json!({"actor": rows[0]["actor"], "data": {"events": sum("events"),
        "bootLeases": sum("bootLeases"), "nodeCerts": sum("nodeCerts"), "joinRequests": sum("joinRequests")}});
    assert_eq!(pruned["data"]["events"], 1, "{pruned}");
    assert_eq!(pruned["data"]["bootLeases"], 1, "{pruned}");
    assert_eq!(pruned["actor"], "bca");
    // The ordinary event went; the security event stays for the audit period.
    assert_eq!(
        a.count("SELECT count(*) FROM events WHERE id = 'ev_old1'"),
        0
    );
    assert_eq!(
        a.count("SELECT count(*) FROM events WHERE id = 'ev_old2'"),
        1
    );
    assert_eq!(a.count("SELECT count(*) FROM boot_leases"), 0);
    assert_eq!(pruned["data"]["nodeCerts"], 1, "{pruned}");
    assert_eq!(pruned["data"]["joinRequests"], 1, "{pruned}");
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM node_certs WHERE node_id = '{na}'"
        )),
        1
    );
    assert_eq!(
        a.count(&format!(
            "SELECT count(*) FROM node_certs WHERE node_id = '{nb}'"
        )),
        1
    );
    assert_eq!(
        a.count("SELECT count(*) FROM join_requests WHERE id = 'jreq_wait'"),
        1
    );
    assert_eq!(
        a.count("SELECT count(*) FROM join_requests WHERE id = 'jreq_old'"),
        0
    );
}

/// Spent, voided and expired discovery tokens go after `discovery_tokens_days` (a boot flood
/// mints many); a live one stays, however old.
#[test]
fn retention_prunes_spent_voided_and_expired_discovery_tokens() {
    let mut a = Appliance::start();
    let now = bca::base::clock::now();
    let old = now - 3 * 86_400;
    let db = a.live();
    let site = bca::config::Config::load(&a.state()).unwrap().site_id;
    for (id, spent, voided, expires) in [
        ("jt_spent", Some(old), None, now + 3600),
        ("jt_voided", None, Some(old), now + 3600),
        ("jt_expired", None, None, old),
        ("jt_live", None, None, now + 3600),
    ] {
        let opt = |t: Option<i64>| t.map_or(V::Null, V::Int);
        db.execute_values(
            "INSERT INTO discovery_tokens (id, site_id, mac, secret_sha256, created_at, expires_at, spent_at, voided_at)
             VALUES (?1, ?2, '52:54:00:00:00:01', ?3, ?4, ?5, ?6, ?7)",
            &[
                V::Text(id.into()),
                V::Text(site.clone()),
                V::Blob(vec![0]),
                V::Int(old),
                V::Int(expires),
                opt(spent),
                opt(voided),
            ],
        );
    }
    drop(db);
    a.restart();
    let rows = wait_for("the retention row", 10, || {
        let v = a.cli_json(&["audit", "list", "--action", "retention.pruned"]);
        let items = v["items"].as_array().unwrap().clone();
        let n: i64 = items
            .iter()
            .map(|r| r["data"]["discoveryTokens"].as_i64().unwrap_or(0))
            .sum();
        (n > 0).then_some(n)
    });
    assert_eq!(rows, 3);
    let left: Vec<String> = a
        .db()
        .prepare("SELECT id FROM discovery_tokens")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(left, vec!["jt_live".to_string()]);
}

#[test]
fn retention_on_hold_prunes_nothing() {
    let mut a = Appliance::start_cfg("file", &[], |c| {
        replace_table(
            &c,
            "retention",
            "[retention]\nevents_days = 1\nhold = true\n",
        )
    });
    old_rows(&a, 20);
    a.restart();
    // Give the start-up pass time to run, then check nothing went.
    wait_for("the server", 5, || a.api("health/get", json!({})).ok());
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert_eq!(
        a.count("SELECT count(*) FROM events WHERE id LIKE 'ev_old%'"),
        2
    );
    assert_eq!(a.count("SELECT count(*) FROM boot_leases"), 1);
    assert_eq!(
        a.count("SELECT count(*) FROM audit WHERE action = 'retention.pruned'"),
        0
    );
}

/// `bca serve` on a fresh state directory whose `[name]` table is `table`: exits 1 naming the
/// problem in `msg`, and starts nothing (no admin socket).
fn serve_refuses_config(name: &str, table: &str, msg: &str) {
    let (dir, out) = init_dir("file", &[]);
    assert!(out.status.success());
    let cfg = dir.path().join("state/config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, replace_table(&text, name, table)).unwrap();
    let o = Command::new(bin())
        .args(["serve", "--state-dir"])
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(msg), "{err}");
    assert!(!dir.path().join("state/admin.sock").exists());
}

#[test]
fn bad_retention_settings_are_named() {
    serve_refuses_config(
        "retention",
        "[retention]\nevents_days = 99999\n",
        "retention.events_days must be 0 (keep) to 36500",
    );
}

#[test]
fn bad_gateway_limits_are_named_and_nothing_starts() {
    for bad in [0, 65_537] {
        serve_refuses_config(
            "sessions",
            &format!("[sessions]\nmax_handshakes = {bad}\n"),
            "sessions.max_handshakes must be 1 to 65536",
        );
    }
}

/// `[boot] uefi_chain = "shim"` is refused at start, by name, when shim or GRUB is missing from
/// the boot root, or when TFTP (which hands shim out) is off; and any other chain's name too.
#[test]
fn a_shim_chain_that_cannot_boot_is_named_and_nothing_starts() {
    let boot = |extra: &str| {
        format!(
            "[boot]\nenabled = true\nmode = \"proxy\"\nserver_ip = \"127.0.0.1\"\n\
             listen_dhcp = \"127.0.0.1:{}\"\nlisten_proxy = \"127.0.0.1:{}\"\n{extra}",
            free_udp(),
            free_udp()
        )
    };
    serve_refuses_config(
        "boot",
        &boot(&format!(
            "listen_tftp = \"127.0.0.1:{}\"\nuefi_chain = \"shim\"\n",
            free_udp()
        )),
        "boot.uefi_chain = \"shim\" needs shimx64.efi in the boot root",
    );
    serve_refuses_config(
        "boot",
        &boot("listen_tftp = \"off\"\nuefi_chain = \"shim\"\n"),
        "boot.uefi_chain = \"shim\" hands shim out over TFTP: boot.listen_tftp cannot be \"off\"",
    );
    serve_refuses_config(
        "boot",
        &boot("uefi_chain = \"grub\"\n"),
        "boot.uefi_chain must be \"ipxe\" or \"shim\", not \"grub\"",
    );
}

fn claims_with(serial: &str, mac: &str) -> Value {
    let mut m = machine();
    m["serials"]["product"] = json!(serial);
    m["macs"] = json!([mac]);
    m
}

#[test]
fn bulk_intake_mints_one_pinned_token_per_machine() {
    let a = Appliance::start();
    let pool = a.pool("rack-b7");
    let csv = a.dir.path().join("rack.csv");
    std::fs::write(
        &csv,
        "# rack B7, delivered today\nname,serial,mac\nu01,SN-B7-01,\nu02,SN-B7-02,00:1b:21:00:00:02\n,SN-B7-03,\n",
    )
    .unwrap();
    let out = a.dir.path().join("tokens");
    let o = a.cli(&[
        "--json",
        "join-tokens",
        "create",
        "--pool",
        &pool,
        "--ttl",
        "24h",
        "--key",
        "rack-b7",
        "--from-csv",
        csv.to_str().unwrap(),
        "--out-dir",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    let items = v["items"].as_array().unwrap();
    assert_eq!(items.len(), 3);
    assert!(items.iter().all(|t| t.get("token").is_none()), "{v}");
    assert_eq!(items[2]["name"], "SN-B7-03");
    assert_eq!(
        items[1]["expect"],
        json!({"serial": "SN-B7-02", "mac": "00:1b:21:00:00:02"})
    );
    // Progress went to stderr as plain lines (not a terminal).
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("writing token files: 3/3 (100%)"), "{err}");
    assert_eq!(
        std::fs::metadata(&out).unwrap().permissions().mode() & 0o777,
        0o700
    );
    let mut files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(files, ["SN-B7-03.token", "u01.token", "u02.token"]);
    for f in &files {
        let m = std::fs::metadata(out.join(f)).unwrap();
        assert_eq!(m.permissions().mode() & 0o777, 0o600, "{f}");
    }
    // Each audited on its own.
    assert_eq!(
        a.count("SELECT count(*) FROM audit WHERE action = 'joinTokens.create'"),
        3
    );
    // A token joins its machine only.
    let t2 = std::fs::read_to_string(out.join("u02.token")).unwrap();
    let sim = Sim::new(&a);
    let (raw, _, _) = sim.join(t2.trim(), &claims_with("SN-B7-01", "00:1b:21:00:00:02"));
    assert_eq!(raw, refused_bytes());
    sim.admitted(t2.trim(), &claims_with("SN-B7-02", "00:1b:21:00:00:02"));

    // One CSV of secrets instead (0600).
    std::fs::write(&csv, "serial\nSN-B7-09\n").unwrap();
    let secrets = a.dir.path().join("secrets.csv");
    let o = a.cli(&[
        "join-tokens",
        "create",
        "--pool",
        &pool,
        "--ttl",
        "1h",
        "--key",
        "rack-b7",
        "--from-csv",
        csv.to_str().unwrap(),
        "--out",
        secrets.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(&secrets).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("name,tokenId,token"));
    let row: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(row[0], "SN-B7-09");
    assert!(
        row[1].starts_with("jt_") && row[2].starts_with("bcjt_"),
        "{row:?}"
    );
    assert_eq!(
        std::fs::metadata(&secrets).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // The table does not print secrets either.
    assert!(!String::from_utf8_lossy(&o.stdout).contains(row[2]));
}

#[test]
fn bad_bulk_intake_mints_nothing() {
    let a = Appliance::start();
    let pool = a.pool("rack-b7");
    let csv = a.dir.path().join("rack.csv");
    let out = a.dir.path().join("tokens");
    let run = |text: &str, extra: &[&str]| {
        std::fs::write(&csv, text).unwrap();
        let mut args = vec![
            "join-tokens",
            "create",
            "--pool",
            &pool,
            "--ttl",
            "24h",
            "--key",
            "k",
            "--from-csv",
            csv.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        a.cli_err(&args)
    };
    let dir = ["--out-dir", out.to_str().unwrap()];
    let before = a.snapshot();
    // The server's check (a MAC) comes back as the CSV's line, and nothing was minted.
    let (code, msg) = run("serial,mac\nSN-1,\nSN-2,not-a-mac\n", &dir);
    assert_eq!(code, "INVALID_INPUT");
    assert!(msg.contains("rack.csv line 3 (SN-2): expect.mac"), "{msg}");
    assert!(msg.contains("nothing was minted"), "{msg}");
    let (code, msg) = run("serial,colour\n", &dir);
    assert_eq!(code, "INVALID_INPUT");
    assert!(msg.contains("unknown column \"colour\""), "{msg}");
    let (code, msg) = run("name,serial\nx,SN-1\nx,SN-2\n", &dir);
    assert_eq!(code, "INVALID_INPUT");
    assert!(msg.contains("line 3: name x is also on line 2"), "{msg}");
    let (code, msg) = run("serial\nSN-1\n", &[]);
    assert_eq!(code, "INVALID_INPUT");
    assert!(msg.contains("--out-dir DIR or --out FILE"), "{msg}");
    // An output file that exists: refused before minting.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("SN-1.token"), "keep me").unwrap();
    let (code, msg) = run("serial\nSN-1\n", &dir);
    assert_eq!(code, "ALREADY_EXISTS");
    assert!(msg.contains("nothing was minted"), "{msg}");
    assert_eq!(
        std::fs::read_to_string(out.join("SN-1.token")).unwrap(),
        "keep me"
    );
    // A key used before fails the whole batch.
    assert_eq!(a.snapshot(), before);
    a.token(
        &pool,
        json!({"idempotencyKey": "k-SN-5", "expect": {"serial": "SN-5"}}),
    );
    let mid = a.snapshot();
    let (code, msg) = run(
        "serial\nSN-4\nSN-5\n",
        &["--out-dir", a.dir.path().join("t2").to_str().unwrap()],
    );
    assert_eq!(code, "ALREADY_EXISTS");
    assert!(msg.contains("line 3 (SN-5)"), "{msg}");
    assert_eq!(a.snapshot(), mid);
    assert_ne!(before, mid);
}

/// `bca backup FILE` with the passphrase a file-key appliance's backup seals its keys under.
fn backup_with_passphrase(a: &Appliance, file: &std::path::Path) -> std::process::Output {
    Command::new(bin())
        .args(["backup"])
        .arg(file)
        .env("BCA_STATE_DIR", a.state())
        .env("BCA_SECRET", PASSPHRASE)
        .output()
        .unwrap()
}

/// An appliance restored from `backup` into a new directory (not started).
fn restored(backup: &std::path::Path) -> (Appliance, std::process::Output) {
    let dir = tempfile::tempdir().unwrap();
    let o = Command::new(bin())
        .args(["restore"])
        .arg(backup)
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    let b = Appliance {
        dir,
        child: None,
        http: String::new(),
        gateway: String::new(),
        socket: Default::default(),
        init_stdout: String::new(),
    };
    (b, o)
}

#[test]
fn a_backup_taken_while_serving_restores_and_admits() {
    let mut a = Appliance::start_with("passphrase", &[SQLITE]);
    let pool = a.pool("p1");
    let (t, token) = a.token(&pool, json!({"maxUses": 2}));
    let sim = Sim::new(&a);
    let first = sim.admitted(&token, &machine());
    let file = a.dir.path().join("site.bcab");
    let o = a.cli(&["backup", file.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains("copying the database (pages):"));
    assert_eq!(
        std::fs::metadata(&file).unwrap().permissions().mode() & 0o777,
        0o600
    );
    // GNU cpio reads it.
    let o = Command::new("cpio")
        .args(["-it", "--quiet", "-F"])
        .arg(&file)
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&o.stdout);
    for m in [
        "manifest.json",
        "bca.db",
        "config.toml",
        "keys/keys.sealed",
        "pki/node-ca.pem",
    ] {
        assert!(listing.lines().any(|l| l == m), "{m} not in\n{listing}");
    }
    // Never a key in clear, never the passphrase or a token secret: the unsealed keys' bytes
    // (PKCS#8 DER, and its base64 as the clear bundle holds it) are nowhere in the file.
    let raw = std::fs::read(&file).unwrap();
    let text = String::from_utf8_lossy(&raw);
    let keys = bca::keys::unseal(
        &a.state(),
        bca::config::KeyProtection::Passphrase,
        Some(PASSPHRASE.as_bytes()),
    )
    .unwrap();
    for k in [
        &keys.node_ca,
        &keys.serving_ca,
        &keys.gateway,
        &keys.join_signing,
        &keys.join_encryption,
    ] {
        let der = k.pkcs8();
        assert!(
            !raw.windows(der.len()).any(|w| w == der),
            "a key's DER is in the backup"
        );
        assert!(
            !text.contains(&bca::base::crypto::b64(der)),
            "a key's base64 is in the backup"
        );
    }
    assert!(!text.contains(PASSPHRASE));
    assert!(!text.contains(token.rsplit('.').next().unwrap()));
    // A backup never writes over a file.
    let (code, _) = a.cli_err(&["backup", file.to_str().unwrap()]);
    assert_eq!(code, "ALREADY_EXISTS");
    a.stop();

    let (mut b, o) = restored(&file);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::metadata(b.state()).unwrap().permissions().mode() & 0o777,
        0o700
    );
    // The restored box needs the same passphrase.
    let out = serve_exit(&b.state(), "not the passphrase at all");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("wrong passphrase"));
    b.serve(PASSPHRASE);
    let nodes = b.cli_json(&["nodes", "list", "--pool", &pool]);
    assert_eq!(nodes["items"][0]["id"], first.node_id.as_str(), "{nodes}");
    assert_eq!(b.uses_left(t["id"].as_str().unwrap()), 1);
    // The token minted before the backup admits its second machine on the new box.
    Sim::new(&b).admitted(&token, &machine());
    assert_eq!(b.uses_left(t["id"].as_str().unwrap()), 0);
}

#[test]
fn a_backup_of_file_keys_seals_them() {
    let mut a = Appliance::start();
    let file = a.dir.path().join("site.bcab");
    let o = backup_with_passphrase(&a, &file);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let raw = String::from_utf8_lossy(&std::fs::read(&file).unwrap()).to_string();
    let clear = std::fs::read_to_string(a.state().join("keys/keys.json")).unwrap();
    let clear: Value = serde_json::from_str(&clear).unwrap();
    // No value of the clear key file is in the backup.
    for (_, v) in clear.as_object().unwrap() {
        if let Some(s) = v.as_str().filter(|s| s.len() > 20) {
            assert!(!raw.contains(s), "a clear key is in the backup");
        }
    }
    let (mut b, o) = restored(&file);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let cfg = std::fs::read_to_string(b.state().join("config.toml")).unwrap();
    assert!(cfg.contains("key_protection = \"passphrase\""), "{cfg}");
    // The restored box takes over (on PostgreSQL both would name one database: one serves it).
    a.stop();
    b.serve(PASSPHRASE);
    assert_eq!(b.cli_json(&["health"])["status"], "ok");
    // Without a passphrase the file-key backup refuses (no prompt without a terminal).
    let o = Command::new(bin())
        .args(["backup"])
        .arg(a.dir.path().join("other.bcab"))
        .env("BCA_STATE_DIR", a.state())
        .env_remove("BCA_SECRET")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(!a.dir.path().join("other.bcab").exists());
}

#[test]
fn a_damaged_backup_restores_nothing() {
    let a = Appliance::start_with("file", &[SQLITE]);
    let file = a.dir.path().join("site.bcab");
    let o = backup_with_passphrase(&a, &file);
    assert!(o.status.success());
    let good = std::fs::read(&file).unwrap();
    // One flipped byte inside the database member.
    let at = good
        .windows(15)
        .position(|w| w == b"SQLite format 3")
        .unwrap()
        + 200;
    let mut bad = good.clone();
    bad[at] ^= 0x55;
    let damaged = a.dir.path().join("damaged.bcab");
    std::fs::write(&damaged, &bad).unwrap();
    let (b, o) = restored(&damaged);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("bca.db does not match its SHA-256"), "{err}");
    assert!(!b.state().exists());
    // Truncated, and not a backup at all.
    std::fs::write(&damaged, &good[..good.len() / 2]).unwrap();
    let (b, o) = restored(&damaged);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a usable bca backup"));
    assert!(!b.state().exists());
    std::fs::write(&damaged, b"hello").unwrap();
    let (_, o) = restored(&damaged);
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a usable bca backup"));
    // A state directory that is not empty is left alone.
    let o = Command::new(bin())
        .args(["restore"])
        .arg(&file)
        .arg("--state-dir")
        .arg(a.state())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("ALREADY_EXISTS"));
    assert_eq!(a.cli_json(&["health"])["status"], "ok");
}
