//! Secret hygiene: after a run that touches every secret (a passphrase, join tokens minted one by
//! one and in bulk, an agent's join and renewal, a discovery token in a per-boot archive, a
//! backup), none of them (nor any private key) is in a log line at debug level, an event, an audit
//! row, any database column or file of the state directory, the backup, or the CLI's output; and
//! every file bca wrote has the mode it should.

use crate::common::*;
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

/// Every regular file under `dir`, with its bytes.
fn files(dir: &Path, out: &mut Vec<(std::path::PathBuf, Vec<u8>)>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        let m = std::fs::symlink_metadata(&p).unwrap();
        if m.is_dir() {
            files(&p, out);
        } else if m.is_file() {
            out.push((p.clone(), std::fs::read(&p).unwrap()));
        }
    }
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    !needle.is_empty() && hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn no_secret_is_left_anywhere_and_every_mode_is_tight() {
    let mut a = Appliance::start_with("passphrase", &[]);
    // Serve again with a debug log captured to a file.
    a.stop();
    let log = a.dir.path().join("serve.log");
    let (http, gw) = (a.http.clone(), a.gateway.clone());
    // The ramdisk's archive needs the gateway's URL.
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, format!("gateway_url = \"https://{gw}\"\n{text}")).unwrap();
    sightings_config(&a);
    a.serve_logging(
        PASSPHRASE,
        &http,
        &gw,
        "debug",
        Stdio::from(std::fs::File::create(&log).unwrap()),
    );
    let mut outputs: Vec<u8> = Vec::new();
    let mut secrets: Vec<(String, Vec<u8>)> = vec![("passphrase".into(), PASSPHRASE.into())];

    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, json!({"maxUses": 3}));
    secrets.push(("join token".into(), token.clone().into_bytes()));
    // The secret part alone, too (what follows the id).
    secrets.push((
        "token secret".into(),
        token.rsplit('.').next().unwrap().as_bytes().to_vec(),
    ));
    // Bulk intake.
    let csv = a.dir.path().join("rack.csv");
    std::fs::write(&csv, "serial\nSN-H-1\nSN-H-2\n").unwrap();
    let tokdir = a.dir.path().join("tokens");
    let o = a.cli(&[
        "join-tokens",
        "create",
        "--pool",
        &pool,
        "--ttl",
        "1h",
        "--key",
        "h",
        "--from-csv",
        csv.to_str().unwrap(),
        "--out-dir",
        tokdir.to_str().unwrap(),
    ]);
    assert!(o.status.success());
    outputs.extend(o.stdout);
    outputs.extend(o.stderr);
    for f in ["SN-H-1.token", "SN-H-2.token"] {
        let t = std::fs::read_to_string(tokdir.join(f))
            .unwrap()
            .trim()
            .to_string();
        secrets.push((format!("bulk token {f}"), t.into_bytes()));
    }
    // An agent joins with the real CLI.
    let agent = a.agent_dir();
    let claims = write_claims(&a, &machine());
    let o = agent_join(&agent, "data", &claims, &token, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    outputs.extend(o.stdout);
    outputs.extend(o.stderr);
    // A discovery token, minted into a per-boot archive for a machine the network saw.
    sight(&a, "52:54:00:00:00:77");
    let o = Command::new("curl")
        .args([
            "-s",
            &format!(
                "http://{}/api/compute/boot/boot.ipxe?mac=52:54:00:00:00:77",
                a.http
            ),
        ])
        .output()
        .unwrap();
    let script = String::from_utf8(o.stdout).unwrap();
    let url = script
        .lines()
        .find_map(|l| l.strip_prefix("initrd --name initrd.img "))
        .unwrap_or_else(|| panic!("{script}"));
    let cpio_path =
        format!("/api/{}", url.split_once("/api/").unwrap().1).replace("/initrd.img", ".cpio");
    let archive = Command::new("curl")
        .args(["-s", &format!("http://{}{cpio_path}", a.http)])
        .output()
        .unwrap()
        .stdout;
    let entries = bca::base::cpio::read(&archive).unwrap();
    let disc = entries
        .iter()
        .find(|e| e.name.ends_with("discovery-token"))
        .expect("the archive carries a discovery token");
    let disc_token = String::from_utf8(disc.data.clone())
        .unwrap()
        .trim()
        .to_string();
    secrets.push(("discovery token".into(), disc_token.into_bytes()));
    // A backup.
    let backup = a.dir.path().join("site.bcab");
    let o = a.cli(&["backup", backup.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    outputs.extend(o.stdout);
    outputs.extend(o.stderr);
    // Events, audit, nodes, tokens as the CLI shows them.
    for args in [
        vec!["events", "list", "--all-tenants", "--limit", "200"],
        vec!["audit", "list", "--all-tenants", "--limit", "200"],
        vec!["join-tokens", "list", "--pool", &pool, "--all"],
        vec!["nodes", "list"],
        vec!["join-requests", "list", "--state", "all"],
    ] {
        let mut args = args.clone();
        args.push("--json");
        let o = a.cli(&args);
        assert!(o.status.success(), "{args:?}");
        outputs.extend(o.stdout);
    }
    // Every private key: the appliance's five and the agent's.
    let keys = bca::keys::unseal(
        &a.state(),
        bca::config::KeyProtection::Passphrase,
        Some(PASSPHRASE.as_bytes()),
    )
    .unwrap();
    for (name, k) in [
        ("node CA key", &keys.node_ca),
        ("serving CA key", &keys.serving_ca),
        ("gateway key", &keys.gateway),
        ("join-signing key", &keys.join_signing),
        ("join-encryption key", &keys.join_encryption),
    ] {
        secrets.push((format!("{name} (DER)"), k.pkcs8().to_vec()));
        secrets.push((
            format!("{name} (base64)"),
            bca::base::crypto::b64(k.pkcs8()).into_bytes(),
        ));
    }
    let node_key = std::fs::read_to_string(agent.join("data/node.key")).unwrap();
    let node_der = bca::proto::x509::pem_decode_all(&node_key, "PRIVATE KEY").remove(0);
    secrets.push((
        "the node's key (base64)".into(),
        bca::base::crypto::b64(&node_der).into_bytes(),
    ));
    secrets.push(("the node's key (DER)".into(), node_der));

    a.stop();
    // Where to look: the log, the CLI's output, every file of the state directory (the database,
    // its WAL, config, pki, keys, downloads), the backup, the database's rows as text.
    let mut places: Vec<(String, Vec<u8>)> = vec![
        ("serve's log".into(), std::fs::read(&log).unwrap()),
        ("CLI output".into(), outputs),
        ("the backup".into(), std::fs::read(&backup).unwrap()),
        ("the database's rows".into(), a.snapshot().into_bytes()),
    ];
    let mut state_files = Vec::new();
    files(&a.state(), &mut state_files);
    assert!(state_files.len() >= 8, "{state_files:?}");
    for (p, b) in &state_files {
        places.push((p.display().to_string(), b.clone()));
    }
    let log_text = std::fs::read_to_string(&log).unwrap();
    // The log really is at debug level and saw the run.
    assert!(
        log_text.contains(" DEBUG ") && log_text.contains("boot: discovery ramdisk"),
        "{log_text}"
    );
    for (what, secret) in &secrets {
        for (place, bytes) in &places {
            assert!(!contains(bytes, secret), "the {what} is in {place}");
        }
    }

    // Modes: the state directory 0700; keys/ 0700 and its files 0600; pki/ and the boot root
    // (what the boot server serves anyone: chain.ipxe) public; everything else 0600; the
    // agent's files as documented.
    let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&a.state()), 0o700);
    assert_eq!(mode(&a.state().join("keys")), 0o700);
    for (p, _) in &state_files {
        let rel = p
            .strip_prefix(a.state())
            .unwrap()
            .to_string_lossy()
            .to_string();
        let want = if rel.starts_with("pki/") || rel.starts_with("boot/") {
            0o644
        } else {
            0o600
        };
        assert_eq!(mode(p), want, "{rel} is {:o}", mode(p));
    }
    assert_eq!(mode(&backup), 0o600);
    assert_eq!(mode(&tokdir), 0o700);
    for f in ["data/node.key", "data/identity.json", "config.toml"] {
        assert_eq!(mode(&agent.join(f)), 0o600, "{f}");
    }
    assert_eq!(mode(&agent.join("join-encryption.jwk")), 0o644);
}
