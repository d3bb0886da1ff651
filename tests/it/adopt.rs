//! Brownfield adopt: downloads, the install script in a scratch root, the well-known fallback,
//! token files, and `bca dev --sim`.

use crate::common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

fn sha256_of(p: &Path) -> String {
    bca::base::crypto::hex(&bca::base::crypto::sha256(&std::fs::read(p).unwrap()))
}

#[test]
fn downloads_are_recorded_served_and_checked() {
    let a = Appliance::start();
    let v = a.cli_json(&[
        "downloads",
        "add",
        bin(),
        "--version",
        "0.1.0",
        "--arch",
        "amd64",
    ]);
    assert_eq!(v["sha256"], json!(sha256_of(Path::new(bin()))));
    // Adding the same file again is fine; another file under the same version is CONFLICT.
    a.cli_json(&[
        "downloads",
        "add",
        bin(),
        "--version",
        "0.1.0",
        "--arch",
        "amd64",
    ]);
    let other = a.dir.path().join("other");
    std::fs::write(&other, b"not the same binary").unwrap();
    let snap = a.snapshot();
    let (code, _) = a.cli_err(&[
        "downloads",
        "add",
        other.to_str().unwrap(),
        "--version",
        "0.1.0",
        "--arch",
        "amd64",
    ]);
    assert_eq!(code, "CONFLICT");
    for (args, want) in [
        (
            vec!["--version", "0.1.0", "--arch", "riscv"],
            "INVALID_INPUT",
        ),
        (
            vec!["--version", "../0.1", "--arch", "amd64"],
            "INVALID_INPUT",
        ),
        (vec!["--version", "", "--arch", "amd64"], "INVALID_INPUT"),
    ] {
        let mut full = vec!["downloads", "add", other.to_str().unwrap()];
        full.extend(args.iter());
        let (code, err) = a.cli_err(&full);
        assert_eq!(code, want, "{args:?}: {err}");
    }
    let (code, _) = a.cli_err(&[
        "downloads",
        "add",
        "/nonexistent/file",
        "--version",
        "1",
        "--arch",
        "amd64",
    ]);
    assert_eq!(code, "INVALID_INPUT");
    assert_eq!(a.snapshot(), snap);
    assert_eq!(
        a.cli_json(&["downloads", "list"])["items"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    // Served over HTTP byte for byte; unknown versions and odd paths are 404.
    let got = a.dir.path().join("got");
    let o = Command::new("curl")
        .args([
            "-sf",
            "-o",
            got.to_str().unwrap(),
            &format!(
                "http://{}/api/compute/downloads/bcd/0.1.0/linux-amd64",
                a.http
            ),
        ])
        .status()
        .unwrap();
    assert!(o.success());
    assert_eq!(sha256_of(&got), sha256_of(Path::new(bin())));
    for path in [
        "0.2.0/linux-amd64",
        "0.1.0/linux-arm64",
        "../0.1.0/linux-amd64",
        "0.1.0/windows-amd64",
    ] {
        let o = Command::new("curl")
            .args([
                "-s",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
                "--path-as-is",
                &format!("http://{}/api/compute/downloads/bcd/{path}", a.http),
            ])
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&o.stdout), "404", "{path}");
    }
}

/// Records this `bca` as agent 0.1.0 for amd64 (`bca downloads add`): its SHA-256.
pub(crate) fn add_agent(a: &Appliance) -> String {
    a.cli_json(&[
        "downloads",
        "add",
        bin(),
        "--version",
        "0.1.0",
        "--arch",
        "amd64",
    ]);
    sha256_of(Path::new(bin()))
}

/// The install script for `pool` and agent `version`, its digests given by `digests`
/// (`--sha256 …`, or `--release-manifest … --release-pins …`).
pub(crate) fn script_with(
    a: &Appliance,
    pool: &str,
    version: &str,
    digests: &[&str],
) -> std::path::PathBuf {
    let gateway = format!("https://{}", a.gateway);
    let base = format!("http://{}", a.http);
    let mut args = vec![
        "daemon",
        "install-script",
        "--pool",
        pool,
        "--gateway-url",
        &gateway,
        "--base-url",
        &base,
        "--bcd-version",
        version,
    ];
    args.extend_from_slice(digests);
    let o = a.cli(&args);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p = a.dir.path().join(format!("install-{}.sh", rand_hex(3)));
    std::fs::write(&p, &o.stdout).unwrap();
    p
}

/// The install script with the amd64 binary's SHA-256 written in.
pub(crate) fn script(a: &Appliance, pool: &str, sha: &str) -> std::path::PathBuf {
    script_with(a, pool, "0.1.0", &["--sha256", &format!("amd64={sha}")])
}

fn run_script(
    script: &Path,
    root: &Path,
    token: Option<&str>,
    claims: &Path,
) -> std::process::Output {
    let mut c = Command::new("sh");
    c.arg(script)
        .env("DESTDIR", root)
        .env("BCA_CLAIMS_FILE", claims)
        .env_remove("BCD_JOIN_TOKEN")
        .stdin(Stdio::null());
    if let Some(t) = token {
        c.env("BCD_JOIN_TOKEN", t);
    }
    c.output().unwrap()
}

#[test]
fn the_install_script_installs_joins_refuses_a_bad_digest_and_upgrades() {
    let a = Appliance::start();
    let pool = a.pool("brownfield");
    let (_, token) = a.token(&pool, json!({"maxUses": 2}));
    let sha = add_agent(&a);
    let claims = write_claims(&a, &machine());

    // A wrong SHA-256: refused, nothing installed.
    let bad = script(&a, &pool, &"0".repeat(64));
    let root_bad = a.dir.path().join("root-bad");
    let o = run_script(&bad, &root_bad, Some(&token), &claims);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("SHA-256"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!root_bad.join("usr/local/bin/bca").exists());
    assert!(!root_bad.join("etc/bca-agent/config.toml").exists());
    // Not a token: refused before anything is downloaded.
    let good = script(&a, &pool, &sha);
    let text = std::fs::read_to_string(&good).unwrap();
    assert!(!text.contains("bcjt_jt_"), "the script holds a secret");
    let o = run_script(&good, &root_bad, Some("hello"), &claims);
    assert!(String::from_utf8_lossy(&o.stderr).contains("must look like bcjt_"));
    assert!(!root_bad.join("usr/local/bin/bca").exists());

    // The real thing, into a scratch root.
    let root = a.dir.path().join("root");
    let o = run_script(&good, &root, Some(&token), &claims);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(mode(&root.join("usr/local/bin/bca")), 0o755);
    assert_eq!(sha256_of(&root.join("usr/local/bin/bca")), sha);
    assert_eq!(mode(&root.join("etc/bca-agent/config.toml")), 0o600);
    assert_eq!(mode(&root.join("etc/bca-agent/join-encryption.jwk")), 0o644);
    assert_eq!(mode(&root.join("var/lib/bca-agent")), 0o700);
    let unit = std::fs::read_to_string(root.join("etc/systemd/system/bca-agent.service")).unwrap();
    assert!(unit.contains("NoNewPrivileges=yes") && unit.contains("ProtectSystem=strict"));
    let id: Value = serde_json::from_slice(
        &std::fs::read(root.join("var/lib/bca-agent/identity.json")).unwrap(),
    )
    .unwrap();
    let node = a.cli_json(&["nodes", "get", id["nodeId"].as_str().unwrap()]);
    assert_eq!(node["poolId"], json!(pool));
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_ok()
    {
        let v = Command::new("systemd-analyze")
            .arg("verify")
            .arg(root.join("etc/systemd/system/bca-agent.service"))
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&v.stderr);
        assert!(!err.contains("Unknown key"), "{err}");
    }

    // Again with no token: an in-place upgrade; the identity stays.
    std::fs::write(root.join("usr/local/bin/bca"), b"old").unwrap();
    let o = run_script(&good, &root, None, &claims);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("upgraded"));
    assert_eq!(sha256_of(&root.join("usr/local/bin/bca")), sha);
    assert!(root.join("var/lib/bca-agent/identity.json").exists());
    // No token and no config: refused.
    let o = run_script(&good, &a.dir.path().join("root-empty"), None, &claims);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no token"));
}

#[test]
fn the_well_known_fallback_and_token_files() {
    let a = Appliance::start_with("file", &["--gateway-url", "https://127.0.0.1:1"]);
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, json!({"maxUses": 3}));
    let server = format!("http://{}", a.http);
    let pins = a.cli_json(&["pki", "show"])["pins"].clone();

    // join-encryption.jwk absent: the document's key is used, since it matches the pin.
    let dir = a.agent_dir();
    std::fs::remove_file(dir.join("join-encryption.jwk")).unwrap();
    let claims = write_claims(&a, &machine());
    let o = agent_join(&dir, "data", &claims, &token, &["--server", &server]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // A key file present but not matching the pin fails, --server or not.
    let dir2 = a.agent_dir();
    let other = bca::base::crypto::SigningKey::generate();
    std::fs::write(
        dir2.join("join-encryption.jwk"),
        serde_json::to_string(&bca::proto::jwe::jwk(other.public_point())).unwrap(),
    )
    .unwrap();
    let o = agent_join(
        &dir2,
        "data",
        &write_claims(&a, &machine()),
        &token,
        &["--server", &server],
    );
    assert!(
        String::from_utf8_lossy(&o.stderr).starts_with("INVALID_CONFIG"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );

    // No config at all: built from the document's gateway section with the pins given. The
    // gateway URL in the document is wrong here (port 1), so point the document at the real one.
    let b = Appliance::start();
    let b_pins = b.cli_json(&["pki", "show"])["pins"].clone();
    let b_pool = b.pool("p");
    let (_, b_token) = b.token(&b_pool, json!({}));
    let cfg = b.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        format!("gateway_url = \"https://{}\"\n{text}", b.gateway),
    )
    .unwrap();
    let mut b = b;
    b.restart();
    let bare = b.dir.path().join("bare");
    std::fs::create_dir_all(&bare).unwrap();
    let tf = bare.join("token");
    std::fs::write(&tf, format!("{b_token}\n")).unwrap();
    std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o644)).unwrap();
    let pin_args = |p: &Value| {
        vec![
            "--serving-ca-pin".to_string(),
            p["servingCa"].as_str().unwrap().to_string(),
            "--join-signing-pin".into(),
            p["joinSigning"].as_str().unwrap().to_string(),
            "--join-encryption-pin".into(),
            p["joinEncryption"].as_str().unwrap().to_string(),
        ]
    };
    let run = |pins: &Value, tf: &Path| {
        Command::new(bin())
            .args(["agent", "join", "--config"])
            .arg(bare.join("etc/config.toml"))
            .arg("--data-dir")
            .arg(bare.join("data"))
            .arg("--claims")
            .arg(&claims)
            .args(["--server", &format!("http://{}", b.http), "--token-file"])
            .arg(tf)
            .args(pin_args(pins))
            .stdin(Stdio::null())
            .output()
            .unwrap()
    };
    // A token file others can read is refused and kept.
    let o = run(&b_pins, &tf);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("readable by its owner alone"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(tf.exists());
    // Owner-only but executable (0700) is not what the seed allows either: 0600 or 0400 only.
    std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o700)).unwrap();
    let o = run(&b_pins, &tf);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("readable by its owner alone") && err.contains("it is 0700"),
        "{err}"
    );
    assert!(tf.exists());
    assert!(!bare.join("data/identity.json").exists());
    // 0400 reads.
    std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o400)).unwrap();
    assert_eq!(
        bca::agent::read_token_file(&tf).unwrap().as_str(),
        b_token.trim()
    );
    std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o600)).unwrap();
    // Pins that differ from the document's: refused.
    let o = run(&pins, &tf);
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("differ"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(!bare.join("etc/config.toml").exists());
    // The right pins: joined, the configuration written, the token file deleted.
    std::fs::create_dir_all(bare.join("etc")).unwrap();
    let o = run(&b_pins, &tf);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!tf.exists(), "the token file was not deleted");
    let written =
        bca::proto::agent_config::AgentConfig::load(&bare.join("etc/config.toml")).unwrap();
    assert_eq!(written.gateway_url, format!("https://{}", b.gateway));
    assert!(written.site.starts_with("site_"));
    assert_eq!(mode(&bare.join("etc/config.toml")), 0o600);
    assert_eq!(mode(&bare.join("etc/join-encryption.jwk")), 0o644);
    // Oversize and non-regular token files.
    let big = bare.join("big");
    std::fs::write(&big, "x".repeat(5000)).unwrap();
    std::fs::set_permissions(&big, std::fs::Permissions::from_mode(0o600)).unwrap();
    let e = bca::agent::read_token_file(&big).err().unwrap();
    assert!(e.message.contains("4 KiB"));
    let e = bca::agent::read_token_file(&bare).err().unwrap();
    assert!(e.message.contains("regular file"));
}

#[test]
fn dev_sim_shows_five_connected_nodes() {
    let mut child = Command::new(bin())
        .args(["dev", "--sim", "5", "--sim-cert-ttl", "20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut state = None;
    let mut lines = Vec::new();
    let t = Instant::now();
    while state.is_none() && t.elapsed() < Duration::from_secs(30) {
        let mut line = String::new();
        if out.read_line(&mut line).unwrap() == 0 {
            break;
        }
        if let Some(s) = line.trim().strip_prefix("state dir: ") {
            state = Some(s.to_string());
        }
        lines.push(line);
    }
    let state = state.unwrap_or_else(|| panic!("no state dir: {lines:?}"));
    let list = || {
        let o = Command::new(bin())
            .args(["--state-dir", &state, "nodes", "list", "--json"])
            .output()
            .unwrap();
        serde_json::from_slice::<Value>(&o.stdout).unwrap_or(Value::Null)
    };
    let t = Instant::now();
    loop {
        let v = list();
        let items = v["items"].as_array().cloned().unwrap_or_default();
        if items.len() == 5 && items.iter().all(|n| n["connected"] == true) {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "not 5 connected nodes: {v}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    // The simulation prints its progress; it stops cleanly and removes its directory.
    let mut line = String::new();
    while !line.contains("connected 5") && t.elapsed() < Duration::from_secs(60) {
        line.clear();
        out.read_line(&mut line).unwrap();
    }
    assert!(line.contains("nodes 5"), "{line}");
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().unwrap();
    assert!(status.success());
    assert!(!Path::new(&state).exists());
}

/// An install script made with `--release-manifest` and `--release-pins`: the digest comes from
/// the appliance's signed manifest, trusted only when a pinned key signed it.
fn manifest_script(
    a: &Appliance,
    pool: &str,
    url: &str,
    pins: &str,
    version: &str,
) -> std::path::PathBuf {
    script_with(
        a,
        pool,
        version,
        &["--release-manifest", url, "--release-pins", pins],
    )
}

#[test]
fn the_install_script_trusts_a_release_manifest_only_under_its_pins() {
    let a = Appliance::start();
    let pool = a.pool("brownfield");
    let (_, token) = a.token(&pool, json!({"maxUses": 3}));
    let sha = add_agent(&a);
    let cfg = a.agent_config(&a.agent_dir());
    let claims = write_claims(&a, &machine());
    let url = format!("http://{}/api/compute/downloads/manifest", a.http);

    // The manifest: its lines, signed by the join-signing key.
    let o = Command::new("curl").args(["-fsS", &url]).output().unwrap();
    assert!(o.status.success());
    let manifest = String::from_utf8(o.stdout).unwrap();
    let lines: Vec<&str> = manifest.lines().collect();
    assert_eq!(lines[0], "bca-release-manifest v1");
    assert_eq!(lines[1], format!("site {}", cfg.site));
    assert_eq!(lines[2], format!("agent 0.1.0 amd64 {sha}"));
    assert!(lines[3].starts_with("signer ") && lines[4].starts_with("signature "));
    let (sig_b64, signer_b64) = (&lines[4][10..], &lines[3][7..]);
    let body = format!("{}\n{}\n{}\n", lines[0], lines[1], lines[2]);
    let signer = bca::base::crypto::b64_decode(signer_b64).unwrap();
    let spki = bca::proto::x509::cert_spki(&signer).unwrap();
    assert_eq!(
        format!(
            "sha256/{}",
            bca::base::crypto::b64(&bca::base::crypto::sha256(&spki))
        ),
        cfg.join_signing_key_pin
    );
    let point = bca::base::crypto::p256_point_from_spki(&spki).unwrap();
    assert!(bca::base::crypto::verify(
        point,
        "bca release-manifest v1",
        body.as_bytes(),
        &bca::base::crypto::b64_decode(sig_b64).unwrap()
    ));

    // Under the join-signing pin: installed and joined.
    let good = manifest_script(&a, &pool, &url, &cfg.join_signing_key_pin, "0.1.0");
    let root = a.dir.path().join("root-good");
    let o = run_script(&good, &root, Some(&token), &claims);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(sha256_of(&root.join("usr/local/bin/bca")), sha);

    // Another key pinned (the serving CA's): refused, nothing installed.
    let other = manifest_script(&a, &pool, &url, &cfg.serving_ca_spki_pin, "0.1.0");
    let root_bad = a.dir.path().join("root-bad");
    let o = run_script(&other, &root_bad, Some(&token), &claims);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("not a pinned key; nothing was installed"),
        "{err}"
    );
    assert!(!root_bad.join("usr/local/bin/bca").exists());

    // A manifest changed on the way (another digest): its signature fails.
    let tampered = a.dir.path().join("tampered-manifest");
    std::fs::write(&tampered, manifest.replace(&sha, &"0".repeat(64))).unwrap();
    let script = manifest_script(
        &a,
        &pool,
        &format!("file://{}", tampered.display()),
        &cfg.join_signing_key_pin,
        "0.1.0",
    );
    let o = run_script(&script, &root_bad, Some(&token), &claims);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("signature does not verify"), "{err}");
    assert!(!root_bad.join("usr/local/bin/bca").exists());

    // A version the manifest does not list: no digest, nothing installed.
    let script = manifest_script(&a, &pool, &url, &cfg.join_signing_key_pin, "9.9.9");
    let o = run_script(&script, &root_bad, Some(&token), &claims);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("carries no SHA-256 for amd64"));
    assert!(!root_bad.join("usr/local/bin/bca").exists());

    // Versions are compared as strings, and a version is listed once: a script for 1.2 never
    // takes 1.20's digest (a reviewer's finding: awk compared them as numbers).
    let other_file = a.dir.path().join("other-agent");
    std::fs::write(&other_file, b"not the agent").unwrap();
    a.cli_json(&[
        "downloads",
        "add",
        other_file.to_str().unwrap(),
        "--version",
        "1.20",
        "--arch",
        "amd64",
    ]);
    let script = manifest_script(&a, &pool, &url, &cfg.join_signing_key_pin, "1.2");
    let o = run_script(&script, &root_bad, Some(&token), &claims);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("carries no SHA-256 for amd64"));
    assert!(!root_bad.join("usr/local/bin/bca").exists());

    // A gateway URL that would end the script's heredoc (a reviewer's finding): refused by every
    // command that writes it.
    let evil = "https://gw.example\nBCA_CONFIG\ntouch /tmp/pwned\n";
    for args in [
        vec![
            "daemon",
            "install-script",
            "--pool",
            &pool,
            "--gateway-url",
            evil,
            "--base-url",
            "http://bca.example",
            "--bcd-version",
            "0.1.0",
            "--sha256",
            &format!("amd64={sha}"),
        ],
        vec![
            "daemon",
            "agent-config",
            "--gateway-url",
            evil,
            "--out",
            "/tmp/never-written",
        ],
    ] {
        let o = a.cli(&args);
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            err.contains("INVALID_INPUT") && err.contains("must be https://host[:port]"),
            "{err}"
        );
    }
    assert!(!Path::new("/tmp/never-written").exists());

    // Bad flags: a pin that is not one, both ways at once, a pinless manifest.
    for (args, want) in [
        (
            vec![
                "--release-manifest",
                url.as_str(),
                "--release-pins",
                "sha256/nope",
            ],
            "is not sha256/",
        ),
        (
            vec![
                "--release-manifest",
                url.as_str(),
                "--release-pins",
                &cfg.join_signing_key_pin,
                "--sha256",
                &format!("amd64={sha}"),
            ],
            "cannot be used with",
        ),
        (vec!["--release-manifest", url.as_str()], "--release-pins"),
        (
            vec![
                "--release-manifest",
                "ftp://x",
                "--release-pins",
                &cfg.join_signing_key_pin,
            ],
            "must be an http://",
        ),
    ] {
        let mut all = vec![
            "daemon",
            "install-script",
            "--pool",
            &pool,
            "--gateway-url",
            "https://gw.example",
            "--base-url",
            "http://bca.example",
            "--bcd-version",
            "0.1.0",
        ];
        all.extend(args.iter().copied());
        let o = a.cli(&all);
        assert_ne!(o.status.code(), Some(0), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// During a join-encryption overlap `bca daemon agent-config` hands out the staged next key's
/// pin; a machine bootstrapping with `--server` and that pin joins (a reviewer found it refused
/// as "pins differ").
#[test]
fn a_server_bootstrap_with_the_next_encryption_pin_joins_during_a_rotation() {
    let mut b = Appliance::start();
    let cfg = b.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(
        &cfg,
        format!("gateway_url = \"https://{}\"\n{text}", b.gateway),
    )
    .unwrap();
    b.restart();
    let pool = b.pool("p");
    let (_, token) = b.token(&pool, json!({}));
    let o = b.cli(&["pki", "rotate", "join-encryption"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pins = b.cli_json(&["pki", "show"])["pins"].clone();
    let next = pins["joinEncryptionNext"].as_str().unwrap().to_string();
    assert_ne!(pins["joinEncryption"], next.as_str());
    // `pki show` prints the next encryption pin as a comment, never as an agent's key.
    let shown = String::from_utf8_lossy(&b.cli(&["pki", "show"]).stdout).to_string();
    assert!(!shown.contains("join_encryption_next_key_pin ="), "{shown}");
    assert!(shown.contains(&next), "{shown}");
    let bare = b.dir.path().join("bare");
    std::fs::create_dir_all(bare.join("etc")).unwrap();
    let tf = bare.join("token");
    std::fs::write(&tf, format!("{token}\n")).unwrap();
    std::fs::set_permissions(&tf, std::fs::Permissions::from_mode(0o600)).unwrap();
    let o = Command::new(bin())
        .args(["agent", "join", "--config"])
        .arg(bare.join("etc/config.toml"))
        .arg("--data-dir")
        .arg(bare.join("data"))
        .arg("--claims")
        .arg(write_claims(&b, &machine()))
        .args(["--server", &format!("http://{}", b.http), "--token-file"])
        .arg(&tf)
        .args([
            "--serving-ca-pin",
            pins["servingCa"].as_str().unwrap(),
            "--join-signing-pin",
            pins["joinSigning"].as_str().unwrap(),
            "--join-encryption-pin",
            &next,
        ])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let written =
        bca::proto::agent_config::AgentConfig::load(&bare.join("etc/config.toml")).unwrap();
    assert_eq!(written.join_encryption_key_pin, next);
}
