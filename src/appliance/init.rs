//! `bca init`: a new state directory with its database, root tenant, site, PKI and sealed keys.

use crate::base::error::{ApiError, ApiResult};
use crate::config::KeyProtection;
use crate::keys::{self};
use crate::pki::bundle::KeyBundle;
use crate::pki::{self, Pins, PublicPki};
use crate::store::Store;
use crate::{base::fsutil, base::ids};
use std::path::PathBuf;

pub struct InitOptions {
    pub state_dir: PathBuf,
    pub trust_domain: String,
    pub site: String,
    pub gateway_sans: Vec<String>,
    pub gateway_url: Option<String>,
    pub key_protection: KeyProtection,
    pub passphrase: Option<zeroize::Zeroizing<String>>,
    /// The TPM to seal to (`key_protection = tpm`); the default is `device:/dev/tpmrm0`.
    pub tpm: Option<String>,
    /// With `tpm`: the PCRs (SHA-256 bank) the keys are also bound to (`--tpm-pcrs`).
    pub tpm_pcrs: Option<String>,
    /// With `tpm`: an escrow copy of the keys sealed under this passphrase, written to this file.
    pub escrow: Option<(PathBuf, zeroize::Zeroizing<String>)>,
    pub listen_http: Option<String>,
    pub listen_gateway: Option<String>,
    /// Where the site's state lives (`--store`, `--store-password-file`): SQLite by default.
    pub store: crate::config::StoreConfig,
}

pub struct Initialised {
    pub site_id: String,
    pub root_tenant: String,
    pub pins: Pins,
}

/// The files and folders `init` creates; all of them go again when `init` fails half-way.
const CREATED: &[&str] = &[
    "config.toml",
    "appliance.id",
    "bca.db",
    "bca.db-wal",
    "bca.db-shm",
    "pki",
    "keys",
];

/// `trust_domain`: a lower-case DNS name, as SPIFFE requires.
pub fn check_trust_domain(td: &str) -> ApiResult<()> {
    let ok = !td.is_empty()
        && td.len() <= 253
        && td.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(ApiError::invalid_input(format!(
            "--trust-domain {td:?} must be a lower-case DNS name such as compute.example.com"
        )))
    }
}

pub fn default_sans() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(h) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        let h = h.trim().to_string();
        if !h.is_empty() && h != "localhost" {
            v.push(h);
        }
    }
    v.push("localhost".into());
    v.push("127.0.0.1".into());
    v
}

pub fn init(o: InitOptions, now: i64) -> ApiResult<Initialised> {
    check_trust_domain(&o.trust_domain)?;
    crate::domain::validate::name("--site", &o.site)?;
    if let Some(u) = &o.gateway_url {
        if !crate::base::net::url_is_plain(u) || crate::base::net::url_host(u).is_none() {
            return Err(ApiError::invalid_input(format!(
                "--gateway-url {u:?} must be an https:// URL with a host"
            )));
        }
    }
    if let Some((path, _)) = &o.escrow {
        if o.key_protection != KeyProtection::Tpm {
            return Err(ApiError::invalid_input(
                "--escrow is the recovery copy of TPM-sealed keys: it goes with --key-protection tpm",
            ));
        }
        if path.exists() {
            return Err(ApiError::already_exists(format!(
                "--escrow {}: the file exists; nothing was changed",
                path.display()
            )));
        }
    }
    if o.tpm.is_some() && o.key_protection != KeyProtection::Tpm {
        return Err(ApiError::invalid_input(
            "--tpm names the TPM to seal to: it goes with --key-protection tpm",
        ));
    }
    if o.tpm_pcrs.is_some() && o.key_protection != KeyProtection::Tpm {
        return Err(ApiError::invalid_input(
            "--tpm-pcrs binds TPM-sealed keys to PCRs: it goes with --key-protection tpm",
        ));
    }
    let pcrs = pcrs_of(&o)?;
    if crate::appliance::statedir::is_initialised(&o.state_dir) {
        return Err(ApiError::already_exists(format!(
            "{} is already initialised; nothing was changed",
            o.state_dir.display()
        )));
    }
    let mut sans = o.gateway_sans.clone();
    if sans.is_empty() {
        sans = default_sans();
    }
    if o.key_protection == KeyProtection::Tpm {
        // The TPM first: an unreachable or wrong one is an error before anything is written.
        let tcti = tcti_of(&o)?;
        crate::tpm::Tpm::open(&tcti)
            .and_then(|mut t| {
                t.identity()?;
                t.pcr_values(&pcrs)
            })
            .map_err(|e| ApiError::unavailable(format!("--key-protection tpm: {e}")))?;
    }
    fsutil::create_private_dir(&o.state_dir).map_err(ApiError::invalid_input)?;
    let r = build(&o, &sans, now);
    if r.is_err() {
        for name in CREATED {
            let p = o.state_dir.join(name);
            let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
        }
    }
    r
}

fn pcrs_of(o: &InitOptions) -> ApiResult<Vec<u32>> {
    crate::appliance::statedir::pcrs_arg(o.tpm_pcrs.as_deref())
}

fn tcti_of(o: &InitOptions) -> ApiResult<crate::tpm::Tcti> {
    crate::appliance::statedir::tcti_arg(o.tpm.as_deref())
}

fn build(o: &InitOptions, sans: &[String], now: i64) -> ApiResult<Initialised> {
    let site_id = ids::new_id("site", now * 1000);
    let root_tenant = ids::new_id("tn", now * 1000);
    let appliance = ids::new_id("appl", now * 1000);
    let config = crate::appliance::statedir::site_config(
        (&site_id, &o.site, &o.trust_domain),
        &crate::appliance::statedir::BoxParts {
            gateway_url: o.gateway_url.clone(),
            key_protection: o.key_protection,
            tpm: match o.key_protection {
                KeyProtection::Tpm => Some(tcti_of(o)?.to_string()),
                _ => None,
            },
            listen_http: o.listen_http.clone(),
            listen_gateway: o.listen_gateway.clone(),
            store: o.store.clone(),
        },
    );
    let keys = KeyBundle::generate();
    let issued = pki::create(&config, &keys, sans, now).map_err(ApiError::internal)?;

    let store = Store::open_at(&o.state_dir, o.store.at(), true).map_err(ApiError::internal)?;
    if !o.store.is_embedded() && crate::store::maintenance::has_site(&store)? {
        return Err(ApiError::invalid_state(
            "the store's database already holds a site: another appliance joins it with `bca join-site`, it does not init it again",
        ));
    }
    store.write(|tx| {
        crate::store::maintenance::site_create(
            tx,
            (&site_id, &o.site, &o.trust_domain),
            &root_tenant,
            now,
        )?;
        crate::store::appliances::insert(
            tx,
            &crate::appliance::members::origin(
                &appliance,
                sans.to_vec(),
                o.gateway_url.clone(),
                keys.gateway.public_point(),
                now,
            ),
            now,
        )?;
        crate::store::events::audit(
            tx,
            now,
            &root_tenant,
            "site.init",
            "local:init",
            &site_id,
            serde_json::json!({"trustDomain": o.trust_domain}),
        )
    })?;
    drop(store);

    PublicPki::write(
        &pki::pki_dir(&o.state_dir),
        &issued,
        keys.join_encryption.public_point(),
    )
    .map_err(ApiError::internal)?;
    match o.key_protection {
        KeyProtection::Tpm => {
            keys::seal_to_tpm(&o.state_dir, &keys, &tcti_of(o)?, &pcrs_of(o)?)
                .map_err(ApiError::unavailable)?;
            if let Some((path, pass)) = &o.escrow {
                keys::write_escrow(path, &keys, pass.as_bytes())
                    .map_err(|e| ApiError::invalid_input(format!("--escrow: {e}")))?;
            }
        }
        p => keys::seal(
            &o.state_dir,
            &keys,
            p,
            o.passphrase.as_ref().map(|p| p.as_bytes()),
        )
        .map_err(ApiError::internal)?,
    }
    crate::appliance::statedir::write_id(&o.state_dir, &appliance).map_err(ApiError::internal)?;
    let text = config.to_file_text().map_err(ApiError::internal)?;
    fsutil::write_new_private(&o.state_dir.join("config.toml"), text.as_bytes())
        .map_err(ApiError::internal)?;
    let pins = PublicPki::load(&pki::pki_dir(&o.state_dir))
        .and_then(|p| p.pins())
        .map_err(ApiError::internal)?;
    Ok(Initialised {
        site_id,
        root_tenant,
        pins,
    })
}
