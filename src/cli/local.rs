//! Commands that work on the state directory itself: `init`, `dev` (and its lines to try), `pki`.

use super::args::*;
use super::conn::*;
use super::output::*;
use crate::base::error::{ApiError, ApiResult};
use crate::config::KeyProtection;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// `--key-protection`, and the new passphrase it asks for (twice, on a terminal) when it is
/// `passphrase` and the state directory is new (`bca init`, `bca join-site`).
fn protection(
    name: &str,
    state_dir: &Path,
) -> ApiResult<(KeyProtection, Option<zeroize::Zeroizing<String>>)> {
    let kp = KeyProtection::parse(name).ok_or_else(|| {
        ApiError::invalid_input(format!(
            "--key-protection {name:?} must be passphrase, file or tpm"
        ))
    })?;
    let passphrase = match kp {
        KeyProtection::Passphrase if !crate::appliance::statedir::is_initialised(state_dir) => {
            Some(
                crate::keys::passphrase_from_env_or_prompt(true)
                    .map_err(ApiError::invalid_input)?,
            )
        }
        _ => None,
    };
    Ok((kp, passphrase))
}

pub(crate) fn cmd_init(a: InitArgs, conn: &Conn) -> ApiResult<()> {
    let state_dir = conn.state_dir();
    let (kp, passphrase) = protection(&a.key_protection, &state_dir)?;
    let escrow = match (&a.escrow, kp) {
        (Some(path), KeyProtection::Tpm)
            if !crate::appliance::statedir::is_initialised(&state_dir) =>
        {
            Some((
                path.clone(),
                crate::keys::passphrase_from_env_or_prompt(true)
                    .map_err(ApiError::invalid_input)?,
            ))
        }
        (Some(_), KeyProtection::Tpm) => None,
        (Some(_), _) => return Err(ApiError::invalid_input(
            "--escrow is the recovery copy of TPM-sealed keys: it goes with --key-protection tpm",
        )),
        (None, _) => None,
    };
    let out = crate::appliance::init::init(
        crate::appliance::init::InitOptions {
            state_dir: state_dir.clone(),
            trust_domain: a.trust_domain,
            site: a.site,
            gateway_sans: a.gateway_san,
            gateway_url: a.gateway_url,
            key_protection: kp,
            passphrase,
            tpm: a.tpm,
            tpm_pcrs: a.tpm_pcrs,
            escrow,
            listen_http: None,
            listen_gateway: None,
            store: store_config(a.store, a.store_password_file)?,
        },
        crate::base::clock::now(),
    )?;
    print_init(&state_dir, &out, conn.json);
    Ok(())
}

/// `bca join-site`: prints the new appliance's id and fingerprint, which an operator checks on
/// an appliance of the site before `bca site appliances approve ID`.
pub(crate) fn cmd_join_site(a: crate::cli::args::JoinSiteArgs, conn: &Conn) -> ApiResult<()> {
    let state_dir = conn.state_dir();
    let (kp, passphrase) = protection(&a.key_protection, &state_dir)?;
    let out = crate::appliance::members::join_site(
        crate::appliance::members::JoinSiteOptions {
            state_dir: state_dir.clone(),
            store: store_config(Some(a.store), a.store_password_file)?,
            serving_ca_pin: a.serving_ca_pin,
            gateway_sans: a.gateway_san,
            gateway_url: a.gateway_url,
            key_protection: kp,
            passphrase,
            tpm: a.tpm,
            tpm_pcrs: a.tpm_pcrs,
            listen_http: None,
            listen_gateway: None,
        },
        crate::base::clock::now(),
    )?;
    if conn.json {
        println!(
            "{}",
            serde_json::json!({"id": out.id, "fingerprint": out.fingerprint, "siteId": out.site_id, "trustDomain": out.trust_domain, "state": "pending"})
        );
    } else {
        println!("appliance:   {}", out.id);
        println!("fingerprint: {}", out.fingerprint);
        println!("site:        {} ({})", out.site_id, out.trust_domain);
        eprintln!(
            "pending: on an appliance of the site, run `bca site appliances approve {} --fingerprint {}` \
             (it is refused unless the database holds what this box sent); `bca serve` here waits until then",
            out.id, out.fingerprint
        );
    }
    Ok(())
}

/// `--store` and `--store-password-file` as `[store]`, checked before anything is made.
pub(crate) fn store_config(
    url: Option<String>,
    password_file: Option<PathBuf>,
) -> ApiResult<crate::config::StoreConfig> {
    match (&url, &password_file) {
        (None, Some(_)) => Err(ApiError::invalid_input(
            "--store-password-file goes with --store postgres://…",
        )),
        (Some(u), _) => {
            crate::store::pg::config(u, None).map_err(ApiError::invalid_input)?;
            let password_file =
                match password_file {
                    Some(p) => {
                        crate::store::read_password_file(&p).map_err(ApiError::invalid_input)?;
                        Some(std::fs::canonicalize(&p).map_err(|e| {
                            ApiError::invalid_input(format!("{}: {e}", p.display()))
                        })?)
                    }
                    None => None,
                };
            Ok(crate::config::StoreConfig {
                url: url.clone(),
                password_file,
            })
        }
        (None, None) => Ok(Default::default()),
    }
}

pub(crate) fn print_init(dir: &Path, out: &crate::appliance::init::Initialised, as_json: bool) {
    if as_json {
        let v = json!({"stateDir": dir, "siteId": out.site_id, "rootTenantId": out.root_tenant, "pins": out.pins});
        println!("{}", serde_json::to_string_pretty(&v).expect("serializes"));
        return;
    }
    println!(
        "initialised {} (site {}, root tenant {})",
        dir.display(),
        out.site_id,
        out.root_tenant
    );
    println!("the pins agents embed:");
    println!("serving_ca_spki_pin = \"{}\"", out.pins.serving_ca);
    println!("join_signing_key_pin = \"{}\"", out.pins.join_signing);
    println!("join_encryption_key_pin = \"{}\"", out.pins.join_encryption);
}

pub(crate) fn cmd_dev(a: DevArgs, state_dir: PathBuf) -> ApiResult<()> {
    if let Some(n) = a.sim {
        return crate::cli::devsim::run(crate::cli::devsim::SimOptions {
            machines: n as usize,
            cert_ttl_seconds: a.sim_cert_ttl,
            keep: a.sim_keep,
        });
    }
    if !crate::appliance::statedir::is_initialised(&state_dir) {
        let out = crate::appliance::init::init(
            crate::appliance::init::InitOptions {
                state_dir: state_dir.clone(),
                trust_domain: "dev.bca.internal".into(),
                site: "dev".into(),
                gateway_sans: vec!["localhost".into(), "127.0.0.1".into()],
                gateway_url: Some(format!("https://{}", a.listen_gateway)),
                key_protection: KeyProtection::File,
                passphrase: None,
                tpm: None,
                tpm_pcrs: None,
                escrow: None,
                listen_http: Some(a.listen_http.clone()),
                listen_gateway: Some(a.listen_gateway.clone()),
                store: Default::default(),
            },
            crate::base::clock::now(),
        )?;
        print_init(&state_dir, &out, false);
    }
    let try_dir = dev_try_dir(&state_dir)?;
    let announce: crate::daemon::serve::Announce = std::sync::Arc::new(move |ready: &Value| {
        println!("{}", dev_try_lines(&try_dir, ready));
    });
    crate::daemon::serve::run(
        &state_dir,
        crate::daemon::serve::ServeOptions {
            tpm: None,
            listen_http: Some(a.listen_http),
            listen_gateway: Some(a.listen_gateway),
            admin_socket: None,
            announce: Some(announce),
        },
    )
    .map_err(ApiError::invalid_config)
}

/// Where `bca dev`'s "try" lines put their files: `<state dir>/try`, with the example claims of
/// a simulated machine written once. A VM's or a laptop's own hardware identity is usually a
/// placeholder (`To Be Filled By O.E.M.`, all zeros) that the appliance refuses
/// (`join:placeholder-hardware`), so the example joins as a well-identified simulated machine.
pub(crate) fn dev_try_dir(state_dir: &Path) -> ApiResult<PathBuf> {
    let abs = std::fs::canonicalize(state_dir).map_err(|e| {
        ApiError::invalid_state(format!("cannot resolve {}: {e}", state_dir.display()))
    })?;
    let dir = abs.join("try");
    crate::base::fsutil::create_private_dir(&dir)
        .map_err(|e| ApiError::invalid_state(format!("{}: {e}", dir.display())))?;
    let claims = dir.join("claims.json");
    if !claims.exists() {
        let mut b = [0u8; 16];
        crate::base::crypto::fill_random(&mut b);
        let h = crate::base::crypto::hex(&b);
        let example = json!({
            "productUuid": format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32]),
            "serials": {"product": format!("DEV-{}", &h[0..8].to_uppercase())},
            "macs": [format!("02:00:00:{}:{}:{}", &h[0..2], &h[2..4], &h[4..6])],
            "hostname": format!("dev-{}", &h[0..6]),
        });
        let text = serde_json::to_string_pretty(&example).expect("serializes");
        crate::base::fsutil::write_new(&claims, text.as_bytes(), 0o600)
            .map_err(ApiError::invalid_state)?;
    }
    Ok(dir)
}

/// The lines `bca dev` prints to try next: each runs as pasted, one after another, in one new
/// shell anywhere (absolute paths, this very binary); only `<pool id>` is filled in by hand,
/// from the first line's output.
pub(crate) fn dev_try_lines(try_dir: &Path, ready: &Value) -> String {
    let bin = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "bca".into());
    let state = try_dir.parent().unwrap_or(try_dir);
    let q = |p: &str| shell_quote(p);
    let (bin, sd) = (q(&bin), q(&state.display().to_string()));
    let t = |name: &str| q(&try_dir.join(name).display().to_string());
    let (gw, http) = (
        ready["gateway"].as_str().unwrap_or_default(),
        ready["http"].as_str().unwrap_or_default(),
    );
    format!(
        "bca dev: serving {sd} (keys in plain files: development only). Try, in another shell:\n\
         \x20 {bin} --state-dir {sd} pools create --name rack-a\n\
         \x20 {bin} --state-dir {sd} join-tokens create --pool <pool id> --ttl 1h --key first --out {token}\n\
         \x20 {bin} --state-dir {sd} daemon agent-config --gateway-url https://{gw} --out {agent}\n\
         \x20 {bin} agent join --config {agent}/config.toml --data-dir {agent} --claims {claims} --token-file {token}\n\
         \x20 {bin} --state-dir {sd} nodes list\n\
         \x20 curl http://{http}/api/compute/.well-known/better-compute",
        token = t("join-token"),
        agent = t("agent"),
        claims = t("claims.json"),
    )
}

/// `s` as one shell word: as is when it holds only safe characters, else in single quotes.
pub(crate) fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-:@%+=,".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

pub(crate) fn cmd_pki_show(state_dir: &Path, as_json: bool) -> ApiResult<()> {
    let p = crate::pki::PublicPki::load(&crate::pki::pki_dir(state_dir))
        .map_err(ApiError::invalid_config)?;
    let pins = p.pins().map_err(ApiError::invalid_config)?;
    let summary = |der: &[u8]| -> Value {
        use x509_parser::prelude::*;
        match X509Certificate::from_der(der) {
            Ok((_, c)) => json!({
                "subject": c.subject().to_string(),
                "issuer": c.issuer().to_string(),
                "serial": c.raw_serial_as_string(),
                "notBefore": crate::base::clock::rfc3339(c.validity().not_before.timestamp()),
                "notAfter": crate::base::clock::rfc3339(c.validity().not_after.timestamp()),
            }),
            Err(e) => json!({"error": e.to_string()}),
        }
    };
    let rotation = crate::appliance::rotation::status(state_dir)?["rotation"].clone();
    let v = json!({
        "pins": pins,
        "rotation": rotation,
        "certificates": {
            "nodeCa": summary(&p.node_ca),
            "servingCa": summary(&p.serving_ca),
            "gateway": summary(&p.gateway),
            "joinSigning": summary(&p.join_signing),
        }
    });
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v).expect("serializes"));
    } else {
        println!("serving_ca_spki_pin = \"{}\"", pins.serving_ca);
        println!("join_signing_key_pin = \"{}\"", pins.join_signing);
        println!("join_encryption_key_pin = \"{}\"", pins.join_encryption);
        if let Some(p) = &pins.join_signing_next {
            println!(
                "join_signing_next_key_pin = \"{p}\"  # promoted at {}",
                s(&rotation["joinSigning"]["promoteAt"])
            );
        }
        if let Some(p) = &pins.join_encryption_next {
            // Not an agent's key: an agent given this pin (bca daemon agent-config does during
            // the overlap) has it as its join_encryption_key_pin.
            println!(
                "# the next join-encryption key's pin, {p}, promoted at {}: agents set up now use it as join_encryption_key_pin",
                s(&rotation["joinEncryption"]["promoteAt"])
            );
        }
        if !rotation["previousEncryptionAcceptedUntil"].is_null() {
            println!(
                "# the previous join-encryption key is accepted until {}",
                s(&rotation["previousEncryptionAcceptedUntil"])
            );
        }
        for (name, c) in v["certificates"].as_object().expect("object") {
            println!(
                "{name}: {} (serial {}), valid {} to {}",
                s(&c["subject"]),
                s(&c["serial"]),
                s(&c["notBefore"]),
                s(&c["notAfter"])
            );
        }
    }
    Ok(())
}

/// Refuses while `bca serve` answers on the state directory's admin socket.
pub(crate) fn not_serving(state_dir: &std::path::Path) -> ApiResult<()> {
    let admin = crate::config::Config::load(state_dir)
        .map(|c| c.admin_socket_path(state_dir))
        .map_err(ApiError::invalid_config)?;
    if std::os::unix::net::UnixStream::connect(&admin).is_ok() {
        return Err(ApiError::invalid_state(
            "bca serve is running on this state directory: stop it first",
        ));
    }
    Ok(())
}

/// `bca pki …`: the pins and key rotation.
pub fn pki(cmd: PkiCmd, conn: &Conn) -> ApiResult<()> {
    match cmd {
        PkiCmd::Show => cmd_pki_show(&conn.state_dir(), conn.json),
        PkiCmd::Rotate {
            kind,
            overlap,
            promote,
            retire_previous,
        } => {
            let overlap = overlap
                .map(|o| {
                    crate::admin::audit::parse_age(&o).ok_or_else(|| {
                        ApiError::invalid_input(format!(
                            "--overlap {o:?} is not a duration such as 24h or 7d"
                        ))
                    })
                })
                .transpose()?;
            let action = if promote {
                Some("promote")
            } else if retire_previous {
                Some("retire-previous")
            } else {
                None
            };
            let v = conn.client().call(
                "pki/rotate",
                &json!({"kind": kind, "action": action, "overlapSeconds": overlap}),
            )?;
            print(conn, &v, |v| {
                for (k, p) in v["pins"].as_object().into_iter().flatten() {
                    println!("{k:<20} {}", s(p));
                }
                for (k, r) in v["rotation"].as_object().into_iter().flatten() {
                    println!(
                        "{k:<20} {}",
                        if r.is_null() {
                            "-".into()
                        } else {
                            r.to_string()
                        }
                    );
                }
            });
            Ok(())
        }
    }
}
