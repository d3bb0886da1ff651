//! The foundation: init, keys and pins, serve, the admin API's constraints, the CLI.

use crate::common::*;
use serde_json::{json, Value};
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

fn mode(p: &std::path::Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

/// `sha256/<base64>` of a DER SubjectPublicKeyInfo computed by openssl from a PEM certificate.
fn openssl_pin_of_cert(pem: &std::path::Path) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl x509 -in {} -pubkey -noout | openssl pkey -pubin -outform DER | openssl dgst -sha256 -binary | openssl base64 -A",
            pem.display()
        ))
        .output()
        .unwrap();
    assert!(out.status.success());
    format!("sha256/{}", String::from_utf8(out.stdout).unwrap().trim())
}

fn pin_line(stdout: &str, key: &str) -> String {
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key} = \"")))
        .map(|r| r.trim_end_matches('"').to_string())
        .unwrap_or_else(|| panic!("no {key} in {stdout}"))
}

#[test]
fn init_prints_the_pins_openssl_computes_and_sets_modes() {
    let a = Appliance::start();
    let s = a.state();
    let pki = s.join("pki");
    assert_eq!(
        pin_line(&a.init_stdout, "serving_ca_spki_pin"),
        openssl_pin_of_cert(&pki.join("serving-ca.pem"))
    );
    assert_eq!(
        pin_line(&a.init_stdout, "join_signing_key_pin"),
        openssl_pin_of_cert(&pki.join("join-signing.pem"))
    );
    // The join-encryption key's pin, from its private key (keys.json holds PKCS#8 for `file`).
    let keys: Value =
        serde_json::from_slice(&std::fs::read(s.join("keys/keys.json")).unwrap()).unwrap();
    let der = bca::base::crypto::b64_decode(keys["joinEncryption"].as_str().unwrap()).unwrap();
    let kf = a.dir.path().join("je.der");
    std::fs::write(&kf, der).unwrap();
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl pkey -inform DER -in {} -pubout -outform DER | openssl dgst -sha256 -binary | openssl base64 -A",
            kf.display()
        ))
        .output()
        .unwrap();
    assert_eq!(
        pin_line(&a.init_stdout, "join_encryption_key_pin"),
        format!("sha256/{}", String::from_utf8(out.stdout).unwrap().trim())
    );
    // openssl accepts the gateway leaf under the serving CA, for the names given.
    let v = Command::new("openssl")
        .args(["verify", "-CAfile"])
        .arg(pki.join("serving-ca.pem"))
        .arg("-verify_hostname")
        .arg("localhost")
        .arg(pki.join("gateway.pem"))
        .output()
        .unwrap();
    assert!(v.status.success(), "{}", String::from_utf8_lossy(&v.stderr));
    // Modes.
    assert_eq!(mode(&s), 0o700);
    assert_eq!(mode(&s.join("config.toml")), 0o600);
    assert_eq!(mode(&s.join("bca.db")), 0o600);
    assert_eq!(mode(&s.join("keys")), 0o700);
    assert_eq!(mode(&s.join("keys/keys.json")), 0o600);
    assert_eq!(mode(&a.socket), 0o600);
    // pki show prints the same pins.
    let shown = a.cli_json(&["pki", "show"]);
    assert_eq!(
        shown["pins"]["servingCa"],
        json!(pin_line(&a.init_stdout, "serving_ca_spki_pin"))
    );
    // The database holds WAL and the numbered migrations.
    let v: i64 = a
        .db()
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .unwrap();
    assert_eq!(v as usize, bca::store::MIGRATIONS.len());
}

#[test]
fn init_refuses_an_initialised_directory_and_leaves_it_as_it_was() {
    let (dir, out) = init_dir("file", &[]);
    assert!(out.status.success());
    let before = sha256_file_tree(dir.path());
    let again = Command::new(bin())
        .args([
            "init",
            "--trust-domain",
            "other.example.com",
            "--site",
            "x",
            "--key-protection",
            "file",
            "--state-dir",
        ])
        .arg(dir.path().join("state"))
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&again.stderr).starts_with("ALREADY_EXISTS:"),
        "{}",
        String::from_utf8_lossy(&again.stderr)
    );
    assert_eq!(sha256_file_tree(dir.path()), before);
}

#[test]
fn init_refuses_bad_values_and_creates_nothing() {
    for (args, want) in [
        (
            vec!["--trust-domain", "Bad_Domain", "--site", "s"],
            "INVALID_INPUT",
        ),
        (
            vec!["--trust-domain", "ok.example", "--site", "bad site"],
            "INVALID_INPUT",
        ),
        (
            vec![
                "--trust-domain",
                "ok.example",
                "--site",
                "s",
                "--key-protection",
                "rot13",
            ],
            "INVALID_INPUT",
        ),
        (
            vec![
                "--trust-domain",
                "ok.example",
                "--site",
                "s",
                "--key-protection",
                "tpm",
                "--tpm",
                "device:/nonexistent/tpmrm0",
            ],
            "UNAVAILABLE: --key-protection tpm: open: cannot reach the TPM",
        ),
        (
            vec![
                "--trust-domain",
                "ok.example",
                "--site",
                "s",
                "--gateway-url",
                "http://x",
            ],
            "INVALID_INPUT",
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let st = dir.path().join("state");
        let out = Command::new(bin())
            .arg("init")
            .args(&args)
            .arg("--state-dir")
            .arg(&st)
            .env("BCA_SECRET", PASSPHRASE)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with(want), "{args:?}: {err}");
        assert!(
            !st.join("config.toml").exists() && !st.join("bca.db").exists(),
            "{args:?} left files"
        );
    }
}

#[test]
fn passphrase_protection_refuses_a_wrong_passphrase_and_changes_nothing() {
    let mut a = Appliance::start_with("passphrase", &[]);
    assert!(!a.state().join("keys/keys.json").exists());
    let sealed = std::fs::read_to_string(a.state().join("keys/keys.sealed")).unwrap();
    assert!(sealed.contains("argon2id"));
    assert_eq!(a.stop().unwrap().code(), Some(0));
    let before = sha256_file_tree(&a.state());
    let out = serve_exit(&a.state(), "this is the wrong one");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("INVALID_CONFIG: wrong passphrase"), "{err}");
    assert_eq!(sha256_file_tree(&a.state()), before);
    // The right one serves again.
    a.serve(PASSPHRASE);
    a.api_ok("tenants/list", json!({}));
}

#[test]
fn serve_stops_cleanly_on_sigterm_and_removes_its_socket() {
    let mut a = Appliance::start();
    assert!(a.socket.exists());
    let status = a.stop().unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(!a.socket.exists());
}

#[test]
fn the_well_known_document_is_the_seeds() {
    let a = Appliance::start_with("file", &["--gateway-url", "https://gw.rack1.example:8443"]);
    let out = Command::new("curl")
        .args([
            "-sf",
            &format!("http://{}/api/compute/.well-known/better-compute", a.http),
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(doc["name"], "better-compute");
    assert_eq!(doc["basePath"], "/api/compute");
    assert_eq!(doc["protocol"], json!({"min": 1, "max": 1}));
    let pins = a.cli_json(&["pki", "show"])["pins"].clone();
    assert_eq!(doc["join"]["encryptionKeyPin"], pins["joinEncryption"]);
    assert_eq!(doc["join"]["signingKeyPin"], pins["joinSigning"]);
    assert_eq!(doc["join"]["encryptionJwk"]["crv"], "P-256");
    let cert =
        bca::base::crypto::b64_decode(doc["join"]["signingCertificate"].as_str().unwrap()).unwrap();
    assert_eq!(
        bca::base::crypto::spki_pin(&bca::proto::x509::cert_spki(&cert).unwrap()),
        pins["joinSigning"].as_str().unwrap()
    );
    assert_eq!(
        doc["gateway"],
        json!({"url": "https://gw.rack1.example:8443", "serverName": "gw.rack1.example", "servingCaPin": pins["servingCa"]})
    );
    // Without a gateway URL there is no gateway section; unknown paths are NOT_FOUND.
    let b = Appliance::start();
    let out = Command::new("curl")
        .args([
            "-s",
            &format!("http://{}/api/compute/.well-known/better-compute", b.http),
        ])
        .output()
        .unwrap();
    assert!(serde_json::from_slice::<Value>(&out.stdout)
        .unwrap()
        .get("gateway")
        .is_none());
    let out = Command::new("curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            &format!("http://{}/nope", b.http),
        ])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "404");
}

#[test]
fn the_admin_socket_refuses_other_users() {
    let a = Appliance::start();
    // Open the way to the socket; the appliance itself must still refuse the caller.
    std::fs::set_permissions(a.dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::set_permissions(a.state(), std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::set_permissions(&a.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            bin(),
            "tenants",
            "list",
            "--socket",
        ])
        .arg(&a.socket)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&out.stderr).starts_with("ACCESS_DENIED: uid 65534"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn tenants_and_pools() {
    let a = Appliance::start();
    let t = a.cli_json(&["tenants", "create", "--name", "acme"]);
    assert!(t["id"].as_str().unwrap().starts_with("tn_"));
    let (code, _) = a.cli_err(&["tenants", "create", "--name", "acme"]);
    assert_eq!(code, "ALREADY_EXISTS");
    let (code, _) = a.cli_err(&["tenants", "create", "--name", "bad name"]);
    assert_eq!(code, "INVALID_INPUT");
    assert_eq!(
        a.cli_json(&["tenants", "list"])["items"]
            .as_array()
            .unwrap()
            .len(),
        2
    );

    let p = a.cli_json(&[
        "pools",
        "create",
        "--name",
        "rack-a",
        "--join-attestors",
        "join-token,tpm",
    ]);
    let id = p["id"].as_str().unwrap().to_string();
    assert_eq!(p["agent"], "bcd");
    assert_eq!(p["policy"]["joinAttestors"], json!(["join-token", "tpm"]));
    let (code, _) = a.cli_err(&["pools", "create", "--name", "rack-a"]);
    assert_eq!(code, "ALREADY_EXISTS");
    let snap = a.snapshot();
    for args in [
        vec!["pools", "create", "--name", "x", "--agent", "ssh"],
        vec![
            "pools",
            "create",
            "--name",
            "x",
            "--join-attestors",
            "magic",
        ],
        vec![
            "pools",
            "create",
            "--name",
            "x",
            "--join-attestors",
            "tpm,tpm",
        ],
        vec!["pools", "create", "--name=-x"],
    ] {
        let (code, err) = a.cli_err(&args);
        assert_eq!(code, "INVALID_INPUT", "{args:?}: {err}");
    }
    let (code, _) = a.cli_err(&["pools", "create", "--name", "x", "--tenant", "tn_nope"]);
    assert_eq!(code, "NOT_FOUND");
    assert_eq!(a.snapshot(), snap);

    let got = a.cli_json(&["pools", "get", &id]);
    assert_eq!(got["name"], "rack-a");
    let up = a.cli_json(&[
        "pools", "update", &id, "--name", "rack-b", "--agent", "none",
    ]);
    assert_eq!(
        (up["name"].as_str(), up["agent"].as_str()),
        (Some("rack-b"), Some("none"))
    );
    // Another tenant cannot see it.
    let (code, _) = a.cli_err(&["pools", "get", &id, "--tenant", t["id"].as_str().unwrap()]);
    assert_eq!(code, "NOT_FOUND");
    let ar = a.cli_json(&["pools", "archive", &id]);
    assert!(ar["archivedAt"].is_string());
    assert_eq!(
        a.cli_json(&["pools", "archive", &id])["archivedAt"],
        ar["archivedAt"]
    );
    let (code, _) = a.cli_err(&["pools", "update", &id, "--name", "c"]);
    assert_eq!(code, "INVALID_STATE");
    assert_eq!(
        a.cli_json(&["pools", "list"])["items"]
            .as_array()
            .unwrap()
            .len(),
        0
    );
    assert_eq!(
        a.cli_json(&["pools", "list", "--all"])["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    // Unknown fields and methods.
    let e = a
        .api(
            "pools/create",
            json!({"tenantId": a.root_tenant(), "name": "y", "colour": "red"}),
        )
        .unwrap_err();
    assert_eq!(e.code.as_str(), "INVALID_INPUT");
    assert!(e.message.contains("colour"), "{e}");
    let e = a.api("pools/explode", json!({})).unwrap_err();
    assert_eq!(e.code.as_str(), "NOT_FOUND");
}

/// Every constraint of the API reference, with a bad value: `INVALID_INPUT` and nothing changed.
#[test]
fn join_token_create_constraints() {
    let a = Appliance::start();
    let pool = a.pool("rack-a");
    let root = a.root_tenant();
    let base =
        json!({"tenantId": root, "poolId": pool, "ttlSeconds": 3600, "idempotencyKey": "k1"});
    let snap = a.snapshot();
    let long = "a".repeat(129);
    let cases: Vec<(&str, Value)> = vec![
        ("tenantId", json!("")),
        ("tenantId", json!(long)),
        ("tenantId", json!("tn x")),
        ("tenantId", json!(5)),
        ("poolId", json!("")),
        ("poolId", json!("-pool")),
        ("poolId", json!(format!("p{long}"))),
        ("maxUses", json!(0)),
        ("maxUses", json!(10_001)),
        ("maxUses", json!(1.5)),
        ("maxUses", json!("3")),
        ("ttlSeconds", json!(59)),
        ("ttlSeconds", json!(86_401)),
        ("ttlSeconds", json!(-1)),
        ("ttlSeconds", Value::Null),
        ("expect", json!({})),
        ("expect", json!({"serial": "SN 1"})),
        ("expect", json!({"serial": long})),
        ("expect", json!({"productUuid": "1234567"})),
        ("expect", json!({"productUuid": "g2345678"})),
        ("expect", json!({"productUuid": "1".repeat(65)})),
        ("expect", json!({"mac": "aa-bb-cc-dd-ee-ff"})),
        ("expect", json!({"mac": "aa:bb:cc:dd:ee"})),
        ("expect", json!({"mac": "aa:bb:cc:dd:ee:fff"})),
        ("expect", json!({"gpuUuid": "12345678"})),
        ("expect", json!({"gpuUuid": "GPU-1234567"})),
        (
            "expect",
            json!({"gpuUuid": format!("GPU-{}", "a".repeat(65))}),
        ),
        ("expect", json!({"cpu": "x"})),
        ("allowReclaim", json!("yes")),
        ("hosted", json!("openshift")),
        ("idempotencyKey", json!("")),
        ("idempotencyKey", json!("a b")),
        ("idempotencyKey", json!(long)),
        ("extra", json!(1)),
    ];
    for (field, bad) in cases {
        let mut body = base.clone();
        body[field] = bad.clone();
        let e = a
            .api("joinTokens/create", body)
            .expect_err(&format!("{field} = {bad}"));
        assert_eq!(e.code.as_str(), "INVALID_INPUT", "{field} = {bad}: {e}");
        assert!(
            e.message.contains(field) || e.message.contains("missing") || field == "expect",
            "{field}: {}",
            e.message
        );
        assert_eq!(a.snapshot(), snap, "{field} = {bad} changed the database");
    }
    for missing in ["tenantId", "poolId", "ttlSeconds", "idempotencyKey"] {
        let mut body = base.clone();
        body.as_object_mut().unwrap().remove(missing);
        let e = a.api("joinTokens/create", body).unwrap_err();
        assert_eq!(e.code.as_str(), "INVALID_INPUT");
        assert!(e.message.contains(missing), "{e}");
    }
    // The edges of every range are accepted.
    for (i, (f, v)) in [
        ("maxUses", 1),
        ("maxUses", 10_000),
        ("ttlSeconds", 60),
        ("ttlSeconds", 86_400),
    ]
    .into_iter()
    .enumerate()
    {
        let mut body = base.clone();
        body[f] = json!(v);
        body["idempotencyKey"] = json!(format!("edge-{i}"));
        a.api_ok("joinTokens/create", body);
    }
    let mut body = base.clone();
    body["expect"] = json!({"productUuid": "4C4C4544-004D-3610-804A-B4C04F564433", "serial": "SN-7701/a+b", "mac": "00:1B:21:3A:4F:5E", "gpuUuid": "GPU-ABCDEF01-2345"});
    body["hosted"] = json!("kubernetes");
    body["idempotencyKey"] = json!("full~key:/+=.-");
    let v = a.api_ok("joinTokens/create", body);
    assert_eq!(v["hosted"], "kubernetes");
    assert_eq!(v["role"], "node");
}

#[test]
fn join_tokens_idempotency_conflict_tenants_state_paging_and_revoke() {
    let a = Appliance::start();
    let root = a.root_tenant();
    let pool = a.pool("rack-a");
    let body = json!({"tenantId": root, "poolId": pool, "ttlSeconds": 3600, "idempotencyKey": "adopt-1", "maxUses": 2,
        "expect": {"serial": "SN-7701"}});
    let first = a.api_ok("joinTokens/create", body.clone());
    let token = first["token"].as_str().unwrap();
    assert!(token.starts_with(&format!("bcjt_{}.", first["id"].as_str().unwrap())));
    let secret = token.split('.').nth(1).unwrap();
    assert_eq!(secret.len(), 43);
    // Only the SHA-256 of the secret is stored.
    let dump = std::fs::read(a.state().join("bca.db")).unwrap();
    assert!(!dump.windows(secret.len()).any(|w| w == secret.as_bytes()));
    let stored: Vec<u8> = a
        .db()
        .query_row("SELECT secret_sha256 FROM join_tokens", [], |r| r.get(0))
        .unwrap();
    assert_eq!(
        stored,
        bca::base::crypto::sha256(&bca::base::crypto::b64url_decode(secret).unwrap()).to_vec()
    );
    // The event says pinned.
    let (tenant, ev) = a.last_event("security.join-token.created").unwrap();
    assert_eq!(
        (tenant.as_str(), ev["pinned"].as_bool()),
        (root.as_str(), Some(true))
    );
    // A retry returns the record without the token; nothing new.
    let snap = a.snapshot();
    let again = a.api_ok("joinTokens/create", body.clone());
    assert!(again.get("token").is_none());
    assert_eq!(again["id"], first["id"]);
    assert_eq!(a.snapshot(), snap);
    // The same key with another expect, allowReclaim, hosted or pool is CONFLICT.
    let other_pool = a.pool("rack-b");
    for (k, v) in [
        ("expect", json!({"serial": "SN-2"})),
        ("allowReclaim", json!(true)),
        ("hosted", json!("kubernetes")),
        ("poolId", json!(other_pool)),
    ] {
        let mut b = body.clone();
        b[k] = v;
        let snap = a.snapshot();
        assert_eq!(
            a.api("joinTokens/create", b).unwrap_err().code.as_str(),
            "CONFLICT",
            "{k}"
        );
        assert_eq!(a.snapshot(), snap);
    }
    // Another tenant: NOT_FOUND for the pool; a pool with agent none: INVALID_STATE; archived: INVALID_STATE.
    let t2 = a.api_ok("tenants/create", json!({"name": "acme"}))["id"]
        .as_str()
        .unwrap()
        .to_string();
    let snap = a.snapshot();
    let e = a
        .api(
            "joinTokens/create",
            json!({"tenantId": t2, "poolId": pool, "ttlSeconds": 60, "idempotencyKey": "x"}),
        )
        .unwrap_err();
    assert_eq!(e.code.as_str(), "NOT_FOUND");
    let e = a
        .api("joinTokens/list", json!({"tenantId": t2, "poolId": pool}))
        .unwrap_err();
    assert_eq!(e.code.as_str(), "NOT_FOUND");
    let e = a
        .api(
            "joinTokens/revoke",
            json!({"tenantId": t2, "poolId": pool, "tokenId": first["id"]}),
        )
        .unwrap_err();
    assert_eq!(e.code.as_str(), "NOT_FOUND");
    assert_eq!(a.snapshot(), snap);
    let none = a.api_ok(
        "pools/create",
        json!({"tenantId": root, "name": "provider", "agent": "none"}),
    )["id"]
        .clone();
    let e = a
        .api(
            "joinTokens/create",
            json!({"tenantId": root, "poolId": none, "ttlSeconds": 60, "idempotencyKey": "y"}),
        )
        .unwrap_err();
    assert_eq!(e.code.as_str(), "INVALID_STATE");
    a.api_ok(
        "pools/archive",
        json!({"tenantId": root, "poolId": other_pool}),
    );
    let e = a.api("joinTokens/create", json!({"tenantId": root, "poolId": other_pool, "ttlSeconds": 60, "idempotencyKey": "z"})).unwrap_err();
    assert_eq!(e.code.as_str(), "INVALID_STATE");

    // Paging: 5 tokens, pages of 2, in id order, never a secret.
    for i in 0..4 {
        a.api_ok("joinTokens/create", json!({"tenantId": root, "poolId": pool, "ttlSeconds": 60, "idempotencyKey": format!("p{i}")}));
    }
    let mut seen = Vec::new();
    let mut cursor = Value::Null;
    loop {
        let page = a.api_ok(
            "joinTokens/list",
            json!({"tenantId": root, "poolId": pool, "limit": 2, "cursor": cursor}),
        );
        let items = page["items"].as_array().unwrap();
        assert!(items.len() <= 2);
        for t in items {
            assert!(t.get("token").is_none() && t.get("secretSha256").is_none());
            seen.push(t["id"].as_str().unwrap().to_string());
        }
        cursor = page["cursor"].clone();
        if cursor.is_null() {
            break;
        }
    }
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(seen, sorted);
    assert_eq!(seen.len(), 5);
    let long_id = format!("jt_{}", "0".repeat(62));
    for (k, v) in [
        ("limit", json!(0)),
        ("limit", json!(201)),
        ("cursor", json!("jt_short")),
        ("cursor", json!("pool_0123456789abcdefghjkmnpqrs")),
        ("cursor", json!(long_id)),
        ("tenantId", json!("bad tenant")),
        ("poolId", json!("_pool")),
        ("includeInactive", json!("yes")),
    ] {
        let mut body = json!({"tenantId": root, "poolId": pool});
        body[k] = v;
        let e = a.api("joinTokens/list", body).unwrap_err();
        assert_eq!(e.code.as_str(), "INVALID_INPUT", "{k}");
        assert!(e.message.contains(k), "{k}: {e}");
    }
    let snap = a.snapshot();
    for (k, v) in [
        ("tokenId", json!("jt_short")),
        ("tokenId", json!(long_id)),
        ("tokenId", json!("jt_0123456789ABCDEFGHJKMNPQRS")),
        ("tenantId", json!("")),
        ("poolId", json!("")),
    ] {
        let mut body = json!({"tenantId": root, "poolId": pool, "tokenId": first["id"]});
        body[k] = v;
        let e = a.api("joinTokens/revoke", body).unwrap_err();
        assert_eq!(e.code.as_str(), "INVALID_INPUT", "{k}");
        assert!(e.message.contains(k), "{k}: {e}");
    }
    assert_eq!(a.snapshot(), snap);

    // Revoke: once publishes, twice is not an error and publishes nothing.
    let id = first["id"].as_str().unwrap();
    let r1 = a.cli_json(&["join-tokens", "revoke", id, "--pool", &pool]);
    assert!(r1["revokedAt"].is_string());
    let n = a.count("SELECT count(*) FROM events WHERE type = 'security.join-token.revoked'");
    let r2 = a.cli_json(&["join-tokens", "revoke", id, "--pool", &pool]);
    assert_eq!(r1["revokedAt"], r2["revokedAt"]);
    assert_eq!(n, 1);
    assert_eq!(
        a.count("SELECT count(*) FROM events WHERE type = 'security.join-token.revoked'"),
        1
    );
    // Revoked tokens leave the default list and come back with --all.
    let live = a.cli_json(&["join-tokens", "list", "--pool", &pool]);
    assert!(live["items"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["id"] != first["id"]));
    let all = a.cli_json(&["join-tokens", "list", "--pool", &pool, "--all"]);
    assert!(all["items"]
        .as_array()
        .unwrap()
        .iter()
        .any(|t| t["id"] == first["id"]));
    let (code, _) = a.cli_err(&[
        "join-tokens",
        "revoke",
        "jt_0123456789abcdefghjkmnpqrs",
        "--pool",
        &pool,
    ]);
    assert_eq!(code, "NOT_FOUND");
    // A pasted token is refused before anything is sent.
    let (code, err) = a.cli_err(&["join-tokens", "revoke", token, "--pool", &pool]);
    assert_eq!(code, "INVALID_INPUT");
    assert!(!err.contains(secret));
    // Audit rows name the caller.
    let actor: String = a
        .db()
        .query_row(
            "SELECT actor FROM audit WHERE action = 'joinTokens.revoke'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(actor, "uid:0");
}

#[test]
fn join_tokens_create_cli_out_ttl_and_replayed_key() {
    let a = Appliance::start();
    let pool = a.pool("rack-a");
    let out = a.dir.path().join("join-token");
    let o = a.cli(&[
        "join-tokens",
        "create",
        "--pool",
        &pool,
        "--ttl",
        "1h",
        "--key",
        "k1",
        "--expect-serial",
        "SN-7701",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(mode(&out), 0o600);
    let tok = std::fs::read_to_string(&out).unwrap();
    assert!(tok.starts_with("bcjt_jt_"));
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains(tok.trim()),
        "the token was printed too"
    );
    // --out never writes over a file.
    let snap = a.snapshot();
    let (code, _) = a.cli_err(&[
        "join-tokens",
        "create",
        "--pool",
        &pool,
        "--ttl",
        "1h",
        "--key",
        "k2",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, "ALREADY_EXISTS");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), tok);
    assert_eq!(a.snapshot(), snap);
    // A replayed --key with --out: its answer carries no token.
    let out2 = a.dir.path().join("join-token-2");
    let (code, err) = a.cli_err(&[
        "join-tokens",
        "create",
        "--pool",
        &pool,
        "--ttl",
        "1h",
        "--key",
        "k1",
        "--expect-serial",
        "SN-7701",
        "--out",
        out2.to_str().unwrap(),
    ]);
    assert_eq!(code, "INVALID_STATE", "{err}");
    assert!(!out2.exists());
    // --ttl bounds.
    for bad in ["59s", "25h", "1.5h", "90", "soon"] {
        let (code, _) = a.cli_err(&[
            "join-tokens",
            "create",
            "--pool",
            &pool,
            "--ttl",
            bad,
            "--key",
            "k3",
        ]);
        assert_eq!(code, "INVALID_INPUT", "{bad}");
    }
    let v = a.cli_json(&[
        "join-tokens",
        "create",
        "--pool",
        &pool,
        "--ttl",
        "1h30m",
        "--key",
        "k4",
        "--max-uses",
        "5",
    ]);
    assert_eq!(v["usesLeft"], 5);
    let created = time::OffsetDateTime::parse(
        v["createdAt"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    let expires = time::OffsetDateTime::parse(
        v["expiresAt"].as_str().unwrap(),
        &time::format_description::well_known::Rfc3339,
    )
    .unwrap();
    assert_eq!((expires - created).whole_seconds(), 5400);
    // Errors print as CODE: message and exit 1; usage errors exit 2.
    let o = a.cli(&["join-tokens", "create", "--pool", &pool]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn events_list_filters_and_pages_newest_first() {
    let a = Appliance::start();
    let pool = a.pool("rack-a");
    for i in 0..3 {
        a.token(&pool, json!({"idempotencyKey": format!("e{i}")}));
    }
    let v = a.cli_json(&["events", "list", "--type", "security.join-token"]);
    let items = v["items"].as_array().unwrap();
    assert_eq!(items.len(), 3);
    assert!(items[0]["createdAt"].as_str() >= items[2]["createdAt"].as_str());
    let p1 = a.cli_json(&["events", "list", "--limit", "2"]);
    assert_eq!(p1["items"].as_array().unwrap().len(), 2);
    let p2 = a.cli_json(&[
        "events",
        "list",
        "--limit",
        "2",
        "--cursor",
        p1["cursor"].as_str().unwrap(),
    ]);
    assert_eq!(p2["items"].as_array().unwrap().len(), 1);
    assert!(a.cli_json(&["events", "list", "--type", "node."])["items"]
        .as_array()
        .unwrap()
        .is_empty());
    let (code, _) = a.cli_err(&["events", "list", "--limit", "0"]);
    assert_eq!(code, "INVALID_INPUT");
    let (code, _) = a.cli_err(&["events", "list", "--cursor", "abc"]);
    assert_eq!(code, "INVALID_INPUT");
}

#[test]
fn completions_and_man_page() {
    let o = Command::new(bin())
        .args(["completions", "bash"])
        .output()
        .unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains("join-tokens"));
    let o = Command::new(bin()).arg("man").output().unwrap();
    assert!(o.status.success() && String::from_utf8_lossy(&o.stdout).contains(".TH bca"));
}

/// The front door: every line `bca dev` prints under "Try, in another shell:" works when pasted,
/// one after another, into one new shell with nothing set up by hand; only `<pool id>` is filled
/// in, from the first line's output.
#[test]
fn bca_dev_prints_lines_that_work_as_pasted_into_one_new_shell() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::{Command, Stdio};
    let checkout = tempfile::tempdir().unwrap();
    let mut dev = Command::new(bin())
        .args([
            "dev",
            "--listen-http",
            "127.0.0.1:0",
            "--listen-gateway",
            "127.0.0.1:0",
        ])
        .current_dir(checkout.path())
        .env_remove("BCA_STATE_DIR")
        .env_remove("BCA_SOCKET")
        .env("BCA_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(dev.stdout.take().unwrap());
    let mut lines = Vec::new();
    let mut heading = false;
    loop {
        let mut l = String::new();
        assert!(
            out.read_line(&mut l).unwrap() > 0,
            "bca dev ended before its lines"
        );
        if heading {
            match l.strip_prefix("  ") {
                Some(cmd) => lines.push(cmd.trim_end().to_string()),
                None => break,
            }
            if lines.len() == 6 {
                break;
            }
        } else if l.contains("Try, in another shell:") {
            heading = true;
        }
    }
    assert_eq!(lines.len(), 6, "{lines:?}");
    // One new shell: no environment beyond what a login gives, in the checkout.
    let mut shell = Command::new("bash")
        .args(["--norc", "--noprofile"])
        .current_dir(checkout.path())
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", checkout.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = shell.stdin.take().unwrap();
    let mut sout = BufReader::new(shell.stdout.take().unwrap());
    let mut paste = |line: &str| -> (i32, String) {
        writeln!(stdin, "{line}\necho \"__rc=$?\"").unwrap();
        let mut text = String::new();
        loop {
            let mut l = String::new();
            assert!(sout.read_line(&mut l).unwrap() > 0, "the shell ended");
            if let Some(rc) = l.trim_end().strip_prefix("__rc=") {
                return (rc.parse().unwrap(), text);
            }
            text.push_str(&l);
        }
    };
    let mut pool = None;
    let mut outputs = Vec::new();
    for line in &lines {
        assert!(!line.contains("./"), "a relative path: {line}");
        let line = match line.contains("<pool id>") {
            true => line.replace("<pool id>", pool.as_deref().expect("a pool id was printed")),
            false => line.clone(),
        };
        assert!(
            !line.contains('<'),
            "a placeholder besides <pool id>: {line}"
        );
        let (rc, text) = paste(&line);
        assert_eq!(rc, 0, "`{line}` failed: {text}");
        if pool.is_none() {
            if let Some(i) = text.find("pool_") {
                pool = Some(text[i..i + 31].to_string());
            }
        }
        outputs.push(text);
    }
    drop(stdin);
    let mut err = String::new();
    shell
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    shell.wait().unwrap();
    assert!(outputs[4].contains("node_"), "nodes list: {}", outputs[4]);
    assert!(outputs[5].contains("signingKeyPin"), "{}", outputs[5]);
    // The token file was spent by the join; the example claims stay, owner-only.
    let state = checkout.path().join(".bca");
    assert!(!state.join("try/join-token").exists());
    assert_eq!(mode(&state.join("try/claims.json")), 0o600);
    let _ = Command::new("kill")
        .args(["-TERM", &dev.id().to_string()])
        .status();
    assert!(dev.wait().unwrap().success());
}
