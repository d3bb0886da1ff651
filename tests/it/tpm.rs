//! The TPM client against swtpm, checked by tpm2-tools and openssl.

use crate::common::*;
use serde_json::Value;
use std::path::Path;
use std::process::{Child, Command, Stdio};

/// A swtpm on loopback, killed when dropped.
pub struct Swtpm {
    child: Child,
    pub port: u16,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Swtpm {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Swtpm {
    /// A fresh TPM; `manufactured`: with EK certificates in NV, as `swtpm_setup` writes them.
    pub fn start(manufactured: bool) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut t = Self::start_at(dir.path(), manufactured);
        t._dir = Some(dir);
        t
    }

    /// A TPM whose state lives in `dir` (kept after it stops, for another swtpm to serve).
    pub fn start_at(dir: &Path, manufactured: bool) -> Self {
        if manufactured {
            let o = Command::new("swtpm_setup")
                .args(["--tpm2", "--create-ek-cert", "--lock-nvram", "--tpmstate"])
                .arg(dir)
                .output()
                .expect("swtpm_setup (apt-get install swtpm-tools; make test installs it)");
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        }
        let (port, ctrl) = loop {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let p = l.local_addr().unwrap().port();
            if p < 65_000 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
                break (p, p + 1);
            }
        };
        let child = Command::new("swtpm")
            .args(["socket", "--tpm2", "--server"])
            .arg(format!("type=tcp,port={port}"))
            .arg("--ctrl")
            .arg(format!("type=tcp,port={ctrl}"))
            .arg("--tpmstate")
            .arg(format!("dir={}", dir.display()))
            .args(["--flags", "not-need-init,startup-clear"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("swtpm (apt-get install swtpm; make test installs it)");
        wait_for("swtpm", 10, || {
            std::net::TcpStream::connect(("127.0.0.1", port)).ok()
        });
        Swtpm {
            child,
            port,
            _dir: None,
        }
    }

    pub fn tcti(&self) -> String {
        format!("swtpm:host=127.0.0.1,port={}", self.port)
    }

    /// No object and no session left loaded (swtpm has no resource manager: whoever leaves one
    /// takes one of its few slots).
    pub fn assert_nothing_loaded(&self, cwd: &Path) {
        for handles in ["handles-transient", "handles-loaded-session"] {
            let left = self.tool(&["tpm2_getcap", handles], cwd);
            assert!(left.trim().is_empty(), "{handles} left in the TPM: {left}");
        }
    }

    /// A tpm2-tools command against this TPM.
    pub fn tool(&self, args: &[&str], cwd: &Path) -> String {
        let o = output_ok(
            Command::new(args[0])
                .args(&args[1..])
                .env("TPM2TOOLS_TCTI", self.tcti())
                .current_dir(cwd),
        );
        String::from_utf8(o.stdout).unwrap()
    }
}

fn status(tcti: &str) -> std::process::Output {
    Command::new(bin())
        .args(["--json", "tpm", "status", "--tpm", tcti])
        .output()
        .unwrap()
}

#[test]
fn tpm_status_names_the_eks_as_tpm2_tools_does_and_checks_their_certificates() {
    let tpm = Swtpm::start(true);
    let out = status(&tpm.tcti());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["manufacturer"], "IBM");
    let dir = tempfile::tempdir().unwrap();
    for (alg, tool_alg) in [("rsa", "rsa"), ("ecc", "ecc")] {
        // tpm2-tools creates the same EK from the TCG template and reports its name.
        tpm.tool(
            &[
                "tpm2_createek",
                "-c",
                "ek.ctx",
                "-G",
                tool_alg,
                "-u",
                "ek.pub",
            ],
            dir.path(),
        );
        let public = tpm.tool(&["tpm2_readpublic", "-c", "ek.ctx"], dir.path());
        tpm.tool(&["tpm2_flushcontext", "-t"], dir.path());
        let name = public
            .lines()
            .find_map(|l| l.strip_prefix("name: "))
            .unwrap()
            .trim();
        assert_eq!(v["ek"][alg]["name"], name, "{alg}");
    }
    // The RSA EK certificate swtpm_setup wrote: bca read the same bytes as tpm2_nvread, and the
    // key openssl finds in it is the EK bca created.
    let cert = &v["ek"]["rsa"]["certificate"];
    assert_eq!(cert["nvIndex"], "0x01c00002");
    assert_eq!(cert["certifiesThisEk"], true);
    tpm.tool(
        &[
            "tpm2_nvread",
            "0x01c00002",
            "-C",
            "0x01c00002",
            "-o",
            "ek.der",
        ],
        dir.path(),
    );
    let der = std::fs::read(dir.path().join("ek.der")).unwrap();
    assert_eq!(
        cert["sha256"],
        bca::base::crypto::hex(&bca::base::crypto::sha256(&der))
    );
    let pubkey = Command::new("sh")
        .arg("-c")
        .arg(
            "openssl x509 -inform DER -in ek.der -noout -pubkey | openssl pkey -pubin -outform DER",
        )
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(pubkey.status.success());
    assert_eq!(
        v["ek"]["rsa"]["publicKeySha256"],
        bca::base::crypto::hex(&bca::base::crypto::sha256(&pubkey.stdout))
    );
    assert!(v["ek"]["ecc"]["certificate"].is_null());
    // Every handle bca created was flushed.
    let handles = tpm.tool(&["tpm2_getcap", "handles-transient"], dir.path());
    assert!(handles.trim().is_empty(), "left behind: {handles}");

    // The table is for people: the same facts.
    let o = Command::new(bin())
        .args(["tpm", "status", "--tpm", &tpm.tcti()])
        .output()
        .unwrap();
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.contains("certifies this EK"), "{text}");
    assert!(
        text.contains(v["ek"]["ecc"]["name"].as_str().unwrap()),
        "{text}"
    );
}

#[test]
fn a_tpm_without_certificates_still_has_its_eks_and_bad_tctis_are_clear_errors() {
    let tpm = Swtpm::start(false);
    let v: Value = serde_json::from_slice(&status(&tpm.tcti()).stdout).unwrap();
    for alg in ["rsa", "ecc"] {
        assert!(v["ek"][alg]["certificate"].is_null());
        assert_eq!(v["ek"][alg]["name"].as_str().unwrap().len(), 68);
    }
    let closed = free_udp();
    for (tcti, says) in [
        ("mssim:port=2321", "INVALID_INPUT: TCTI \"mssim:port=2321\""),
        ("swtpm:port=0", "is not a port"),
        (
            "device:/nonexistent/tpmrm0",
            "cannot reach the TPM at device:/nonexistent/tpmrm0",
        ),
        (
            &format!("swtpm:port={closed}"),
            "UNAVAILABLE: TPM: open: cannot reach the TPM",
        ),
    ] {
        let out = status(tcti);
        assert_eq!(out.status.code(), Some(1), "{tcti}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(says), "{tcti}: {err}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn keys_sealed_to_a_tpm_unseal_at_every_start_and_not_on_another_tpm() {
    let tpm = Swtpm::start(false);
    let escrow_dir = tempfile::tempdir().unwrap();
    let escrow = escrow_dir.path().join("escrow.json");
    let mut a = Appliance::start_with(
        "tpm",
        &["--tpm", &tpm.tcti(), "--escrow", escrow.to_str().unwrap()],
    );
    let state = a.state();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(&escrow).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let cfg = std::fs::read_to_string(state.join("config.toml")).unwrap();
    assert!(cfg.contains("key_protection = \"tpm\""), "{cfg}");
    assert!(cfg.contains(&format!("tpm = \"{}\"", tpm.tcti())), "{cfg}");
    let sealed = state.join("keys/keys.tpm");
    assert_eq!(
        std::fs::metadata(&sealed).unwrap().permissions().mode() & 0o777,
        0o600
    );
    assert!(!state.join("keys/keys.json").exists() && !state.join("keys/keys.sealed").exists());
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, serde_json::json!({"maxUses": 5}));
    Sim::new(&a).admitted(&token, &machine());
    // Restart: the keys unseal again from the same TPM; no handle is left in it.
    a.restart();
    Sim::new(&a).admitted(&token, &machine());
    let dir = tempfile::tempdir().unwrap();
    assert!(tpm
        .tool(&["tpm2_getcap", "handles-transient"], dir.path())
        .trim()
        .is_empty());
    // A rotation changes the bundle: the escrow made at init is out of date, a new one is not.
    let rotated = a.cli(&["pki", "rotate", "gateway"]);
    assert!(
        rotated.status.success(),
        "{}",
        String::from_utf8_lossy(&rotated.stderr)
    );
    let fresh = escrow_dir.path().join("escrow-2.json");
    let out = std::process::Command::new(bin())
        .args(["tpm", "escrow", "--out"])
        .arg(&fresh)
        .env("BCA_STATE_DIR", &state)
        .env("BCA_SECRET", PASSPHRASE)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doctor = a.cli(&["doctor"]);
    let text = String::from_utf8_lossy(&doctor.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains("tpm") && l.contains(&tpm.tcti())),
        "{text}"
    );
    a.stop();

    // Another TPM (a fresh swtpm): a clear error, and nothing in the state directory changes.
    let other = Swtpm::start(false);
    let before = sha256_file_tree(&state);
    let out = std::process::Command::new(bin())
        .args(["serve", "--tpm", &other.tcti()])
        .args([
            "--listen-http",
            "127.0.0.1:0",
            "--listen-gateway",
            "127.0.0.1:0",
        ])
        .env("BCA_STATE_DIR", &state)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!(
            "could not be unsealed by the TPM at {}",
            other.tcti()
        )),
        "{err}"
    );
    assert!(err.contains("TPM2_Load"), "{err}");
    assert_eq!(before, sha256_file_tree(&state));
    // The TPM recorded at init, gone: a clear error too.
    drop(tpm);
    let out = serve_exit(&state, PASSPHRASE);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("cannot reach the TPM"), "{err}");
    assert_eq!(before, sha256_file_tree(&state));

    // The way back: the escrow copy, under its passphrase. A wrong one changes nothing.
    let recover_with = |file: &std::path::Path, pass: &str| {
        std::process::Command::new(bin())
            .args(["tpm", "recover", "--escrow"])
            .arg(file)
            .env("BCA_STATE_DIR", &state)
            .env("BCA_SECRET", pass)
            .output()
            .unwrap()
    };
    let out = recover_with(&escrow, PASSPHRASE);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("made before a key rotation"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(before, sha256_file_tree(&state));
    let recover = |pass: &str| recover_with(&fresh, pass);
    let out = recover("not the passphrase");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("wrong passphrase"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(before, sha256_file_tree(&state));
    let out = recover(PASSPHRASE);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!state.join("keys/keys.tpm").exists());
    let cfg = std::fs::read_to_string(state.join("config.toml")).unwrap();
    assert!(
        cfg.contains("key_protection = \"passphrase\"") && !cfg.contains("tpm ="),
        "{cfg}"
    );
    // Serving again, on the passphrase: the token minted before still admits.
    a.serve(PASSPHRASE);
    Sim::new(&a).admitted(&token, &machine());
    // Recovering twice: nothing to recover.
    a.stop();
    let out = recover(PASSPHRASE);
    assert!(String::from_utf8_lossy(&out.stderr).contains("not sealed to a TPM"));
}

#[test]
fn init_refuses_an_unreachable_tpm_and_a_tpm_without_tpm_protection() {
    let closed = free_udp();
    let (dir, out) = init_dir("tpm", &["--tpm", &format!("swtpm:port={closed}")]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("UNAVAILABLE") && err.contains("cannot reach the TPM"),
        "{err}"
    );
    assert!(!dir.path().join("state/config.toml").exists());
    let (_, out) = init_dir("file", &["--tpm", "swtpm:port=2321"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("INVALID_INPUT") && err.contains("--key-protection tpm"),
        "{err}"
    );
    let (_, out) = init_dir("tpm", &["--tpm", "tcp:2321"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("INVALID_INPUT: --tpm: TCTI"), "{err}");
}

#[test]
fn keys_bound_to_a_pcr_unseal_until_it_moves_and_reseal_from_the_escrow() {
    let tpm = Swtpm::start(false);
    let work = tempfile::tempdir().unwrap();
    let escrow = work.path().join("escrow.json");
    let mut a = Appliance::start_with(
        "tpm",
        &[
            "--tpm",
            &tpm.tcti(),
            "--tpm-pcrs",
            "16",
            "--escrow",
            escrow.to_str().unwrap(),
        ],
    );
    let state = a.state();
    let sealed: Value =
        serde_json::from_slice(&std::fs::read(state.join("keys/keys.tpm")).unwrap()).unwrap();
    assert_eq!(sealed["pcrs"], serde_json::json!([16]));
    assert_eq!(sealed["unsealPolicy"], true);
    // tpm2-tools computes the same policy (PolicyPCR, then PolicyCommandCode(Unseal), in a
    // trial session on the TPM): it is the sealed object's authPolicy.
    for step in [
        &["tpm2_startauthsession", "-S", "trial.ctx"][..],
        &["tpm2_policypcr", "-S", "trial.ctx", "-l", "sha256:16"],
        &[
            "tpm2_policycommandcode",
            "-S",
            "trial.ctx",
            "-L",
            "policy.bin",
            "TPM2_CC_Unseal",
        ],
        &["tpm2_flushcontext", "trial.ctx"],
    ] {
        tpm.tool(step, work.path());
    }
    let policy = std::fs::read(work.path().join("policy.bin")).unwrap();
    assert_eq!(policy.len(), 32);
    let public = bca::base::crypto::b64_decode(sealed["tpmPublic"].as_str().unwrap()).unwrap();
    assert!(
        public
            .windows(34)
            .any(|w| w[..2] == [0, 32] && w[2..] == policy[..]),
        "the sealed object's public area does not carry tpm2-tools' policy digest"
    );
    let pool = a.pool("p1");
    let (_, token) = a.token(&pool, serde_json::json!({"maxUses": 5}));
    Sim::new(&a).admitted(&token, &machine());
    a.restart();
    Sim::new(&a).admitted(&token, &machine());
    a.stop();

    // A firmware update moves the PCR: serve refuses with what happened and what to do, and
    // leaves nothing behind, in the state directory or in the TPM.
    tpm.tool(
        &["tpm2_pcrextend", &format!("16:sha256={}", "ab".repeat(32))],
        work.path(),
    );
    let before = sha256_file_tree(&state);
    let out = serve_exit(&state, PASSPHRASE);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("TPM_RC_POLICY_FAIL")
            && err.contains("bound to PCRs [16]")
            && err.contains("bca tpm reseal --escrow"),
        "{err}"
    );
    assert_eq!(before, sha256_file_tree(&state));
    tpm.assert_nothing_loaded(work.path());
    // `bca tpm status` on the state directory: the TPM config.toml names, the binding, and
    // that the keys do not unseal, with why.
    let status = a.cli_json(&["tpm", "status"]);
    assert_eq!(status["tcti"], tpm.tcti(), "{status}");
    assert_eq!(status["sealedKeys"]["pcrs"], serde_json::json!([16]));
    assert_eq!(status["sealedKeys"]["loadable"], false, "{status}");
    assert!(status["sealedKeys"]["error"]
        .as_str()
        .unwrap()
        .contains("TPM_RC_POLICY_FAIL"));
    assert_eq!(before, sha256_file_tree(&state));

    // Reseal: a bad PCR list and a wrong passphrase change nothing; the escrow's passphrase
    // seals the keys to the PCR as it is now.
    let reseal = |pass: &str, extra: &[&str]| {
        std::process::Command::new(bin())
            .args(["tpm", "reseal", "--escrow"])
            .arg(&escrow)
            .args(extra)
            .env("BCA_STATE_DIR", &state)
            .env("BCA_SECRET", pass)
            .output()
            .unwrap()
    };
    let out = reseal(PASSPHRASE, &["--tpm-pcrs", "16,99"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("INVALID_INPUT: --tpm-pcrs: PCR 99 does not exist"),
        "{err}"
    );
    let out = reseal("not the passphrase", &[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("wrong passphrase"));
    assert_eq!(before, sha256_file_tree(&state));
    let out = reseal(PASSPHRASE, &[]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("bound to PCRs [16]"), "{said}");
    assert_eq!(
        a.cli_json(&["tpm", "status"])["sealedKeys"]["loadable"],
        true
    );
    a.serve(PASSPHRASE);
    Sim::new(&a).admitted(&token, &machine());
    a.stop();
    // The PCR moves again; the old blob would not open, the new one did: the binding holds.
    tpm.tool(
        &["tpm2_pcrextend", &format!("16:sha256={}", "cd".repeat(32))],
        work.path(),
    );
    assert!(!serve_exit(&state, PASSPHRASE).status.success());

    // Onto another TPM (a replaced board), bound to no PCR: config.toml names it from now on.
    let other = Swtpm::start(false);
    let out = reseal(PASSPHRASE, &["--tpm", &other.tcti(), "--tpm-pcrs", "none"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("bound to no PCR"));
    let cfg = std::fs::read_to_string(state.join("config.toml")).unwrap();
    assert!(
        cfg.contains(&format!("tpm = \"{}\"", other.tcti())),
        "{cfg}"
    );
    a.serve(PASSPHRASE);
    Sim::new(&a).admitted(&token, &machine());
    a.stop();

    // --tpm-pcrs goes with TPM protection only.
    let (dir, out) = init_dir("file", &["--tpm-pcrs", "7"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("INVALID_INPUT") && err.contains("--tpm-pcrs"),
        "{err}"
    );
    assert!(!dir.path().join("state/config.toml").exists());
}

/// tpm2-tools' credential file: magic `BADCC0DE`, version 1, `TPM2B_ID_OBJECT`,
/// `TPM2B_ENCRYPTED_SECRET` (tpm2_makecredential's `-o`, tpm2_activatecredential's `-i`).
fn credential_file(c: &bca::tpm::credential::Credential) -> Vec<u8> {
    let mut v = 0xBADC_C0DEu32.to_be_bytes().to_vec();
    v.extend(1u32.to_be_bytes());
    for part in [&c.id_object, &c.encrypted_secret] {
        v.extend((part.len() as u16).to_be_bytes());
        v.extend(part.iter());
    }
    v
}

fn parse_credential_file(b: &[u8]) -> bca::tpm::credential::Credential {
    assert_eq!(
        &b[..8],
        &[0xba, 0xdc, 0xc0, 0xde, 0, 0, 0, 1],
        "a tpm2-tools credential"
    );
    let take = |b: &[u8]| {
        let n = u16::from_be_bytes([b[0], b[1]]) as usize;
        (b[2..2 + n].to_vec(), b[2 + n..].to_vec())
    };
    let (id_object, rest) = take(&b[8..]);
    let (encrypted_secret, rest) = take(&rest);
    assert!(rest.is_empty());
    bca::tpm::credential::Credential {
        id_object,
        encrypted_secret,
    }
}

#[test]
fn credentials_bca_makes_are_activated_by_tpm2_tools_and_the_reverse() {
    let tpm = Swtpm::start(true);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let file = |n: &str| d.join(n);
    let tcti: bca::tpm::Tcti = tpm.tcti().parse().unwrap();
    for (alg, ek_alg) in [("rsa", bca::tpm::EkAlg::Rsa), ("ecc", bca::tpm::EkAlg::Ecc)] {
        // bca makes, in software, a credential for tpm2-tools' EK and AK; the TPM recovers it.
        tpm.tool(
            &["tpm2_createek", "-c", "ek.ctx", "-G", alg, "-u", "ek.pub"],
            d,
        );
        // With no resource manager, every tool leaves its objects loaded: flushed after each
        // (their saved contexts load again).
        tpm.tool(&["tpm2_flushcontext", "-t"], d);
        tpm.tool(
            &[
                "tpm2_createak",
                "-C",
                "ek.ctx",
                "-c",
                "ak.ctx",
                "-G",
                "ecc",
                "-g",
                "sha256",
                "-s",
                "ecdsa",
                "-u",
                "ak.pub",
                "-n",
                "ak.name",
            ],
            d,
        );
        tpm.tool(&["tpm2_flushcontext", "-t"], d);
        let secret = format!("the secret for the {alg} EK: 32 b.");
        assert_eq!(secret.len(), 32);
        let ek_pub = std::fs::read(file("ek.pub")).unwrap();
        let ak_name = std::fs::read(file("ak.name")).unwrap();
        let cred = bca::tpm::make_credential(&ek_pub, &ak_name, secret.as_bytes()).unwrap();
        std::fs::write(file("cred.out"), credential_file(&cred)).unwrap();
        tpm.tool(
            &["tpm2_startauthsession", "--policy-session", "-S", "s.ctx"],
            d,
        );
        tpm.tool(&["tpm2_policysecret", "-S", "s.ctx", "-c", "e"], d);
        tpm.tool(
            &[
                "tpm2_activatecredential",
                "-c",
                "ak.ctx",
                "-C",
                "ek.ctx",
                "-i",
                "cred.out",
                "-o",
                "act.out",
                "-P",
                "session:s.ctx",
            ],
            d,
        );
        tpm.tool(&["tpm2_flushcontext", "s.ctx"], d);
        assert_eq!(
            std::fs::read(file("act.out")).unwrap(),
            secret.as_bytes(),
            "{alg}"
        );
        tpm.tool(&["tpm2_flushcontext", "-t"], d);

        // tpm2-tools makes (in software, -T none) a credential for bca's EK and AK; bca's
        // TPM2_ActivateCredential recovers it.
        let mut t = bca::tpm::Tpm::open(&tcti).unwrap();
        let (ak, _) = t.ak_public().unwrap();
        std::fs::write(file("bca-ek.pub"), t.ek_public_area(ek_alg).unwrap()).unwrap();
        std::fs::write(file("secret.bin"), b"tpm2-tools' secret").unwrap();
        output_ok(
            std::process::Command::new("tpm2_makecredential")
                // tpm2-tools 5 takes the Name as hex on the command line.
                .args([
                    "-T",
                    "none",
                    "-u",
                    "bca-ek.pub",
                    "-s",
                    "secret.bin",
                    "-o",
                    "cred2.out",
                ])
                .args(["-n", &bca::base::crypto::hex(&ak.name)])
                .current_dir(d),
        );
        let cred = parse_credential_file(&std::fs::read(file("cred2.out")).unwrap());
        let got = t.activate_credential(ek_alg, &cred).unwrap();
        assert_eq!(&got[..], b"tpm2-tools' secret", "{alg}");
        // Made for another Name (tpm2-tools' AK): the TPM refuses; nothing is left loaded.
        let other = bca::tpm::make_credential(
            &std::fs::read(file("bca-ek.pub")).unwrap(),
            &ak_name,
            b"not for bca's AK",
        )
        .unwrap();
        let err = t
            .activate_credential(ek_alg, &other)
            .unwrap_err()
            .to_string();
        assert!(err.contains("TPM2_ActivateCredential"), "{err}");
        // The same AK at every run: derived from the endorsement seed and a fixed template.
        assert_eq!(t.ak_public().unwrap().0.name, ak.name);
        drop(t);
        tpm.assert_nothing_loaded(d);
    }
    // Bad inputs are named, not panics: a public area that is no EK, a bad Name, a long secret.
    let ek_pub = std::fs::read(file("ek.pub")).unwrap();
    let ak_pub = std::fs::read(file("ak.pub")).unwrap();
    let name = std::fs::read(file("ak.name")).unwrap();
    for (ek, name, secret, says) in [
        (
            &ak_pub[..],
            &name[..],
            &b"s"[..],
            "not a restricted decryption key",
        ),
        (&ek_pub[..], &name[..10], &b"s"[..], "not a SHA-256 Name"),
        (
            &ek_pub[..],
            &name[..],
            &[7u8; 33][..],
            "a credential of 33 bytes",
        ),
        (
            &ek_pub[..ek_pub.len() - 1],
            &name[..],
            &b"s"[..],
            "not a TPM2B_PUBLIC",
        ),
    ] {
        let e = bca::tpm::make_credential(ek, name, secret).unwrap_err();
        assert!(e.contains(says), "{e}");
    }
}

#[test]
fn a_key_made_in_the_tpm_is_certified_by_the_ak_as_openssl_and_tpm2_tools_read_it() {
    use bca::tpm::attest::{ecdsa_der, verify_certify};
    let tpm = Swtpm::start(false);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let file = |n: &str| d.join(n);
    let mut t = bca::tpm::Tpm::open(&tpm.tcti().parse().unwrap()).unwrap();
    let key = t.create_node_key().unwrap();
    let (ak, ak_pub) = t.ak_public().unwrap();
    let nonce = [0x5au8; 32];
    let c = t.certify(&key, &nonce).unwrap();
    let certified = verify_certify(&ak_pub, &c.attest, &c.signature, &nonce, &key.public).unwrap();
    assert_eq!(certified.spki.len(), 91, "a P-256 SubjectPublicKeyInfo");

    // openssl verifies the AK's signature over the attestation (tpm2_print of tpm2-tools 5.4
    // does not print certifications; the reverse check below has tpm2-tools make one).
    std::fs::write(file("ak.der"), &ak.spki).unwrap();
    std::fs::write(file("attest.bin"), &c.attest).unwrap();
    std::fs::write(file("sig.der"), ecdsa_der(&c.signature).unwrap()).unwrap();
    output_ok(
        Command::new("openssl")
            .args([
                "pkey", "-pubin", "-inform", "DER", "-in", "ak.der", "-out", "ak.pem",
            ])
            .current_dir(d),
    );
    let o = output_ok(
        Command::new("openssl")
            .args([
                "dgst",
                "-sha256",
                "-verify",
                "ak.pem",
                "-signature",
                "sig.der",
                "attest.bin",
            ])
            .current_dir(d),
    );
    assert!(String::from_utf8_lossy(&o.stdout).contains("Verified OK"));

    // What does not pass, each by name: another nonce, another key, a changed attestation, a
    // key that is no AK.
    let other = t.create_node_key().unwrap();
    let ek_pub = t.ek_public_area(bca::tpm::EkAlg::Ecc).unwrap();
    let mut changed = c.attest.clone();
    let last = changed.len() - 1;
    changed[last] ^= 1;
    for (ak_pub, attest, nonce, key, says) in [
        (
            &ak_pub,
            &c.attest,
            &[0u8; 32][..],
            &key.public,
            "not the nonce",
        ),
        (&ak_pub, &c.attest, &nonce[..], &other.public, "another key"),
        (
            &ak_pub,
            &changed,
            &nonce[..],
            &key.public,
            "does not verify",
        ),
        (
            &ek_pub,
            &c.attest,
            &nonce[..],
            &key.public,
            "the AK is not sign",
        ),
    ] {
        let e = verify_certify(ak_pub, attest, &c.signature, nonce, key).unwrap_err();
        assert!(e.contains(says), "{says}: {e}");
    }
    drop(t);

    // The reverse: tpm2-tools' AK certifies tpm2-tools' key; bca's check accepts it, and
    // refuses a key tpm2-tools made without fixedTPM (one that may be duplicated out).
    let tool = |args: &[&str]| {
        tpm.tool(args, d);
        // No resource manager: each tool's objects are flushed after it.
        tpm.tool(&["tpm2_flushcontext", "-t"], d);
    };
    tool(&["tpm2_createek", "-c", "ek.ctx", "-G", "rsa", "-u", "ek.pub"]);
    tool(&[
        "tpm2_createak",
        "-C",
        "ek.ctx",
        "-c",
        "ak.ctx",
        "-G",
        "ecc",
        "-g",
        "sha256",
        "-s",
        "ecdsa",
        "-u",
        "tak.pub",
        "-n",
        "tak.name",
    ]);
    tool(&["tpm2_createprimary", "-C", "o", "-c", "prim.ctx"]);
    for (name, attrs) in [
        (
            "fixed",
            "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|sign",
        ),
        ("loose", "sensitivedataorigin|userwithauth|sign"),
        (
            "both",
            "fixedtpm|fixedparent|sensitivedataorigin|userwithauth|sign|decrypt",
        ),
    ] {
        tool(&[
            "tpm2_create",
            "-C",
            "prim.ctx",
            "-G",
            "ecc",
            "-a",
            attrs,
            "-u",
            &format!("{name}.pub"),
            "-r",
            &format!("{name}.priv"),
        ]);
        tool(&[
            "tpm2_load",
            "-C",
            "prim.ctx",
            "-u",
            &format!("{name}.pub"),
            "-r",
            &format!("{name}.priv"),
            "-c",
            &format!("{name}.ctx"),
        ]);
        tool(&[
            "tpm2_certify",
            "-C",
            "ak.ctx",
            "-c",
            &format!("{name}.ctx"),
            "-g",
            "sha256",
            "-o",
            &format!("{name}.attest"),
            "-s",
            &format!("{name}.sig"),
        ]);
    }
    // tpm2_certify of tpm2-tools 5.4 takes no qualifying data and always sends 00ff55aa: checked
    // against that, it passes; against the appliance's nonce, it is refused (a replay).
    let fixed = [0x00u8, 0xff, 0x55, 0xaa];
    let read = |n: &str| std::fs::read(file(n)).unwrap();
    let ok = verify_certify(
        &read("tak.pub"),
        &read("fixed.attest"),
        &read("fixed.sig"),
        &fixed,
        &read("fixed.pub"),
    )
    .unwrap();
    let e = verify_certify(
        &read("tak.pub"),
        &read("fixed.attest"),
        &read("fixed.sig"),
        &nonce,
        &read("fixed.pub"),
    )
    .unwrap_err();
    assert!(e.contains("not the nonce"), "{e}");
    assert_eq!(ok.name.len(), 34);
    let e = verify_certify(
        &read("tak.pub"),
        &read("loose.attest"),
        &read("loose.sig"),
        &fixed,
        &read("loose.pub"),
    )
    .unwrap_err();
    assert!(e.contains("not fixedTPM"), "{e}");
    let e = verify_certify(
        &read("tak.pub"),
        &read("both.attest"),
        &read("both.sig"),
        &fixed,
        &read("both.pub"),
    )
    .unwrap_err();
    assert!(e.contains("also decrypts"), "{e}");
    tpm.assert_nothing_loaded(d);
}

#[test]
fn a_csr_signed_by_the_tpm_verifies_and_its_key_is_the_certified_one() {
    let tpm = Swtpm::start(false);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let tcti: bca::tpm::Tcti = tpm.tcti().parse().unwrap();
    let mut t = bca::tpm::Tpm::open(&tcti).unwrap();
    let blob = t.create_node_key().unwrap();
    let (_, ak_pub) = t.ak_public().unwrap();
    let nonce = [0x11u8; 32];
    let c = t.certify(&blob, &nonce).unwrap();
    let key = std::sync::Arc::new(bca::tpm::nodekey::TpmKey::new(t, blob.clone()).unwrap());
    let csr = key.csr().unwrap();
    // bca's own CSR check (what the JoinService runs) and openssl's.
    let verified = bca::proto::csr::verify(&csr).unwrap();
    assert_eq!(verified.public_point, key.public_point());
    std::fs::write(d.join("csr.der"), &csr).unwrap();
    let o = output_ok(
        Command::new("openssl")
            .args([
                "req", "-verify", "-noout", "-inform", "DER", "-in", "csr.der",
            ])
            .current_dir(d),
    );
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(said.to_lowercase().contains("verify ok"), "{said}");
    // The AK certified the very key the CSR carries.
    let certified =
        bca::tpm::attest::verify_certify(&ak_pub, &c.attest, &c.signature, &nonce, &blob.public)
            .unwrap();
    assert_eq!(
        bca::base::crypto::p256_point_from_spki(&certified.spki).unwrap(),
        key.public_point()
    );
    // Signatures come from the TPM: each verifies under the key's point, and a record of another
    // TPM's key does not load here.
    let sig = key.sign(b"a message").unwrap();
    aws_lc_rs::signature::UnparsedPublicKey::new(
        &aws_lc_rs::signature::ECDSA_P256_SHA256_ASN1,
        key.public_point(),
    )
    .verify(b"a message", &sig)
    .unwrap();
    let other = Swtpm::start(false);
    let foreign = bca::tpm::nodekey::TpmKey::new(
        bca::tpm::Tpm::open(&other.tcti().parse().unwrap()).unwrap(),
        blob,
    )
    .unwrap();
    let e = foreign.sign(b"a message").unwrap_err().to_string();
    assert!(
        e.contains("TPM2_Load") && e.contains("TPM_RC_INTEGRITY"),
        "{e}"
    );
    drop(key);
    tpm.assert_nothing_loaded(d);
}

#[test]
fn agent_doctor_checks_the_machines_tpm() {
    let tpm = Swtpm::start(false);
    let a = Appliance::start();
    let pool = a.pool("rack-a");
    let (_, token) = a.token(&pool, serde_json::json!({}));
    let dir = joined_agent_dir(&a, &token);
    let doctor = |tcti: &str| {
        Command::new(bin())
            .args(["agent", "doctor", "--tpm", tcti, "--config"])
            .arg(dir.join("config.toml"))
            .arg("--data-dir")
            .arg(dir.join("data"))
            .output()
            .unwrap()
    };
    let o = doctor(&tpm.tcti());
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{text}");
    // The AK doctor derives is the one `bca tpm status` names: the same TPM, the same template.
    let status = a.cli_json(&["tpm", "status", "--tpm", &tpm.tcti()]);
    let ak = status["ak"]["name"].as_str().unwrap();
    assert_eq!(ak.len(), 68);
    assert!(
        text.contains(&format!("ok   tpm: {} answers", tpm.tcti())) && text.contains(ak),
        "{text}"
    );
    // A TPM named but not answering fails the check, by name; a bad TCTI is refused.
    let closed = free_udp();
    let o = doctor(&format!("swtpm:port={closed}"));
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        text.contains("FAIL tpm: open: cannot reach the TPM"),
        "{text}"
    );
    let o = doctor("tcp:1");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("INVALID_INPUT: --tpm: TCTI"), "{err}");
}

#[test]
fn the_ek_allow_list_takes_a_tpms_hash_into_one_pool_and_refuses_bad_input() {
    let tpm = Swtpm::start(true);
    let a = Appliance::start();
    let pool = a.pool("tpm-rack");
    let other = a.pool("other");
    let tokens_only = a.api_ok(
        "pools/create",
        serde_json::json!({"tenantId": a.root_tenant(), "name": "tokens-only",
            "policy": {"joinAttestors": ["join-token"]}}),
    )["id"]
        .as_str()
        .unwrap()
        .to_string();
    // The hash the operator reads on the machine with `bca tpm status`.
    let status = a.cli_json(&["tpm", "status", "--tpm", &tpm.tcti()]);
    let hash = status["ek"]["ecc"]["publicKeySha256"]
        .as_str()
        .unwrap()
        .to_string();

    let before = a.snapshot();
    let long = "n".repeat(257);
    for (args, code, says) in [
        (
            vec!["abc", "--pool", &pool],
            "INVALID_INPUT",
            "64 hex digits",
        ),
        (vec![&hash, "--pool", "pool_nope"], "NOT_FOUND", "pool_nope"),
        (
            vec![&hash, "--pool", &tokens_only],
            "INVALID_STATE",
            "does not accept the tpm attestor",
        ),
        (
            vec![&hash, "--pool", &pool, "--note", &long],
            "INVALID_INPUT",
            "note must be",
        ),
        (
            vec![&hash, "--pool", &pool, "--note", "two\nlines"],
            "INVALID_INPUT",
            "note must be",
        ),
    ] {
        let mut full = vec!["tpm", "allow-ek"];
        full.extend(args);
        let (c, err) = a.cli_err(&full);
        assert_eq!(c, code, "{err}");
        assert!(err.contains(says), "{err}");
    }
    assert_eq!(a.snapshot(), before);

    // Allowed, whatever the case and with the sha256: prefix; again into the same pool: the
    // same row and no second audit row; into another pool: a conflict.
    let v = a.cli_json(&[
        "tpm",
        "allow-ek",
        &format!("sha256:{}", hash.to_uppercase()),
        "--pool",
        &pool,
        "--note",
        "rack 4, U12",
    ]);
    assert_eq!(v["ekSha256"], hash.as_str());
    assert_eq!(v["poolId"], pool.as_str());
    let again = a.cli_json(&["tpm", "allow-ek", &hash, "--pool", &pool]);
    assert_eq!(again, v);
    let (c, err) = a.cli_err(&["tpm", "allow-ek", &hash, "--pool", &other]);
    assert_eq!(c, "CONFLICT", "{err}");
    assert!(
        err.contains("remove it there first") && err.contains("of tenant"),
        "{err}"
    );
    assert_eq!(
        a.count("SELECT COUNT(*) FROM audit WHERE action = 'tpm.ekAllowed'"),
        1
    );
    let listed = a.cli_json(&["tpm", "list"]);
    assert_eq!(listed["items"].as_array().unwrap().len(), 1);
    assert_eq!(listed["items"][0]["note"], "rack 4, U12");
    let text = String::from_utf8(a.cli(&["tpm", "list"]).stdout).unwrap();
    assert!(text.contains(&hash) && text.contains(&pool), "{text}");
    assert!(a.cli_json(&["tpm", "list", "--pool", &other])["items"]
        .as_array()
        .unwrap()
        .is_empty());

    // Removed, audited; removing again names what is missing.
    a.cli_json(&["tpm", "remove-ek", &hash]);
    assert_eq!(
        a.count("SELECT COUNT(*) FROM audit WHERE action = 'tpm.ekRemoved'"),
        1
    );
    let (c, err) = a.cli_err(&["tpm", "remove-ek", &hash]);
    assert_eq!(c, "NOT_FOUND", "{err}");
    assert!(a.cli_json(&["tpm", "list"])["items"]
        .as_array()
        .unwrap()
        .is_empty());
}

/// What a relay saw: (to the TPM, from the TPM).
type Recording = std::sync::Arc<std::sync::Mutex<(Vec<u8>, Vec<u8>)>>;

/// A TCP relay to `port` that records both directions.
fn recording_relay(port: u16) -> (u16, Recording) {
    use std::io::{Read, Write};
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let relay = l.local_addr().unwrap().port();
    let seen = std::sync::Arc::new(std::sync::Mutex::new((Vec::new(), Vec::new())));
    let rec = seen.clone();
    std::thread::spawn(move || {
        let (client, _) = l.accept().unwrap();
        let server = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        let pump = |mut from: std::net::TcpStream, mut to: std::net::TcpStream, up: bool| {
            let rec = rec.clone();
            std::thread::spawn(move || {
                let mut b = [0u8; 4096];
                while let Ok(n) = from.read(&mut b) {
                    if n == 0 || to.write_all(&b[..n]).is_err() {
                        break;
                    }
                    let mut r = rec.lock().unwrap();
                    if up { &mut r.0 } else { &mut r.1 }.extend_from_slice(&b[..n]);
                }
                let _ = to.shutdown(std::net::Shutdown::Both);
            })
        };
        let a = pump(
            client.try_clone().unwrap(),
            server.try_clone().unwrap(),
            true,
        );
        let b = pump(server, client, false);
        let _ = (a.join(), b.join());
    });
    (relay, seen)
}

#[test]
fn an_unsealed_secret_crosses_the_wire_encrypted() {
    let tpm = Swtpm::start(false);
    let (relay, seen) = recording_relay(tpm.port);
    let mut secret = [0u8; 32];
    bca::base::crypto::fill_random(&mut secret);
    let mut t = bca::tpm::Tpm::open(&format!("swtpm:port={relay}").parse().unwrap()).unwrap();
    let blob = t.seal(&secret, &[]).unwrap();
    assert!(blob.policy);
    let got = t.unseal(&blob).unwrap();
    assert_eq!(&got[..], &secret[..]);
    drop(t);
    std::thread::sleep(std::time::Duration::from_millis(200));
    let (to_tpm, from_tpm) = seen.lock().unwrap().clone();
    let has = |hay: &[u8]| hay.windows(32).any(|w| w == secret);
    // The recorder does see a secret in clear when one is there: sealing sends it to the TPM in
    // TPM2_Create's sensitive data (once, at init: see docs/tpm.md).
    assert!(has(&to_tpm), "the recording missed the sealing command");
    // What the TPM answered to TPM2_Unseal was encrypted under the salted session's key.
    assert!(!has(&from_tpm), "the secret crossed the wire in clear");
}
