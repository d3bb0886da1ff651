//! The gateway's TLS, checked by third parties: sslscan lists what it offers, openssl s_client
//! tries what it must refuse.

use crate::common::*;
use std::process::{Command, Stdio};

fn sslscan(target: &str) -> String {
    let o = Command::new("sslscan")
        .args([
            "--no-colour",
            "--no-check-certificate",
            "--no-heartbleed",
            target,
        ])
        .output()
        .expect("sslscan is installed by scripts/install-deps.sh");
    String::from_utf8_lossy(&o.stdout).to_string()
}

/// `openssl s_client` with `args`; (handshake completed, output).
fn s_client(gateway: &str, args: &[&str]) -> (bool, String) {
    let o = Command::new("openssl")
        .args(["s_client", "-connect", gateway, "-alpn", "bca/1", "-brief"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (text.contains("CONNECTION ESTABLISHED"), text)
}

#[test]
fn sslscan_sees_tls13_only_with_aead_suites_and_strong_groups() {
    let a = Appliance::start();
    let out = sslscan(&a.gateway);
    let proto = |name: &str| {
        out.lines()
            .find(|l| l.trim_start().starts_with(name))
            .unwrap_or_else(|| panic!("no {name} line in\n{out}"))
            .to_string()
    };
    assert!(proto("TLSv1.3").contains("enabled"), "{out}");
    for old in ["SSLv2", "SSLv3", "TLSv1.0", "TLSv1.1", "TLSv1.2"] {
        assert!(proto(old).contains("disabled"), "{old}: {out}");
    }
    // Every accepted suite is a TLS 1.3 AEAD suite.
    let accepted: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("Preferred") || l.starts_with("Accepted"))
        .collect();
    assert!(!accepted.is_empty(), "{out}");
    for l in &accepted {
        assert!(l.contains("TLSv1.3"), "{l}");
        assert!(
            [
                "TLS_AES_128_GCM_SHA256",
                "TLS_AES_256_GCM_SHA384",
                "TLS_CHACHA20_POLY1305_SHA256"
            ]
            .iter()
            .any(|s| l.contains(s)),
            "{l}"
        );
    }
    // Key exchange groups: no weak curve, no finite-field group below 2048 bits.
    let groups: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.contains("Server Key Exchange Group"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .collect();
    assert!(!groups.is_empty(), "{out}");
    for g in &groups {
        assert!(
            ["x25519", "secp256r1", "secp384r1", "X25519MLKEM768"]
                .iter()
                .any(|ok| g.contains(ok)),
            "unexpected group: {g}"
        );
    }
    // TLS 1.3 has no renegotiation; sslscan must not report it as supported.
    assert!(
        !out.contains("Insecure session renegotiation supported"),
        "{out}"
    );
    assert!(
        !out.contains("Session renegotiation supported") || out.contains("not supported"),
        "{out}"
    );
}

#[test]
fn the_gateway_refuses_old_protocols_and_a_client_certificate_from_another_ca() {
    let a = Appliance::start();
    // A join has no client certificate: the handshake completes.
    let (ok, out) = s_client(&a.gateway, &[]);
    assert!(ok, "{out}");
    assert!(out.contains("TLSv1.3"), "{out}");
    let (ok, out) = s_client(&a.gateway, &["-tls1_2"]);
    assert!(!ok, "TLS 1.2 was accepted: {out}");
    // A certificate from a CA that is not the node CA: refused in the handshake.
    let dir = a.dir.path();
    let run = |args: &[&str]| {
        output_ok(Command::new("openssl").args(args).current_dir(dir));
    };
    run(&[
        "ecparam",
        "-name",
        "prime256v1",
        "-genkey",
        "-noout",
        "-out",
        "ca.key",
    ]);
    run(&[
        "req",
        "-x509",
        "-new",
        "-key",
        "ca.key",
        "-subj",
        "/CN=other CA",
        "-days",
        "1",
        "-out",
        "ca.pem",
    ]);
    run(&[
        "ecparam",
        "-name",
        "prime256v1",
        "-genkey",
        "-noout",
        "-out",
        "leaf.key",
    ]);
    run(&[
        "req",
        "-new",
        "-key",
        "leaf.key",
        "-subj",
        "/CN=intruder",
        "-out",
        "leaf.csr",
    ]);
    run(&[
        "x509",
        "-req",
        "-in",
        "leaf.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-out",
        "leaf.pem",
    ]);
    let (ok, out) = s_client(
        &a.gateway,
        &[
            "-cert",
            dir.join("leaf.pem").to_str().unwrap(),
            "-key",
            dir.join("leaf.key").to_str().unwrap(),
            "-ign_eof",
        ],
    );
    // TLS 1.3 reports the client's refusal after the client's side finished: the server's alert
    // (unknown CA / bad certificate) must be in the output, and no request is served.
    assert!(
        !ok || out.to_lowercase().contains("alert"),
        "a foreign client certificate was accepted: {out}"
    );
    assert!(
        out.to_lowercase().contains("unknown ca")
            || out.to_lowercase().contains("bad certificate")
            || out.to_lowercase().contains("alert"),
        "{out}"
    );
}
