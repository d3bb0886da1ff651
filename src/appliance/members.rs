//! Several appliances serving one site (docs/scale-out.md): `bca join-site`, an operator's
//! approval on an appliance of the site (`bca site appliances approve`), the wrapped copy of the
//! site's keys a joined box opens with its own key, and the heartbeat that is each appliance's
//! lease on the sessions it holds.
//!
//! Who is trusted with what:
//! - a joining box proves nothing about itself; an operator compares the fingerprint it printed
//!   (over its wrapping and gateway public keys) with the one `approve` shows, and approves;
//! - the approving box wraps the site's keys (node CA, serving CA, join signing, join encryption,
//!   a rotation's staged or previous keys) to the joined box's wrapping key with ECDH-ES and
//!   AES-256-GCM (the JWE seal of `proto::jwe`, bound to the site and the appliance's id), and
//!   signs its gateway leaf for the names it asked for with the site's serving CA;
//! - the database holds only the wrapped copy: a reader of the database cannot open it.

use crate::appliance::app::App;
use crate::base::crypto;
use crate::base::error::{ApiError, ApiResult};
use crate::config::KeyProtection;
use crate::keys::{self, OwnKeys};
use crate::pki::bundle::KeyBundle;
use crate::store::appliances::{self as rows, Appliance};
use crate::store::Store;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// An appliance's heartbeat period; its lease on its sessions is [`LEASE_SECONDS`].
pub const HEARTBEAT_SECONDS: u64 = 5;
/// A live appliance renews its lease every [`HEARTBEAT_SECONDS`]; one silent this long is dead,
/// and the others mark the sessions it held closed.
pub const LEASE_SECONDS: i64 = 20;

/// The public PKI files a joined appliance receives (its own `gateway.pem` is made for it; no
/// rotation's files: an approval is refused while a rotation is under way).
const PUBLIC_FILES: &[&str] = &[
    "node-ca.pem",
    "serving-ca.pem",
    "join-signing.pem",
    "join-encryption.jwk",
];

/// What the approving appliance signs with the site's serving CA key: the public files, the
/// site's identity and the new box's leaf, for that box (`public_pki_json`).
const PUBLIC_PURPOSE: &str = "bca site public pki v1";

/// The fingerprint an operator compares before approving: SHA-256 over everything the approval
/// acts on (the wrapping key's and the gateway key's P-256 points, the names its leaf is signed
/// for, the URL agents are given), in groups of four hex digits. A row changed after the box
/// printed it has another fingerprint.
pub fn fingerprint(
    wrap: Option<&[u8]>,
    gateway: &[u8],
    names: &[String],
    gateway_url: Option<&str>,
) -> String {
    let mut m = Vec::with_capacity(256);
    m.extend_from_slice(b"bca appliance v2\0");
    let names = names.join("\n");
    for part in [
        wrap.unwrap_or_default(),
        gateway,
        names.as_bytes(),
        gateway_url.unwrap_or_default().as_bytes(),
    ] {
        m.extend_from_slice(&(part.len() as u32).to_be_bytes());
        m.extend_from_slice(part);
    }
    let h = crypto::hex(&crypto::sha256(&m));
    h.as_bytes()
        .chunks(4)
        .take(8)
        .map(|c| std::str::from_utf8(c).expect("hex"))
        .collect::<Vec<_>>()
        .join(":")
}

/// A row's fingerprint as computed from what it holds now (never the stored column).
fn fingerprint_of(a: &Appliance) -> Option<String> {
    Some(fingerprint(
        a.wrap_public.as_deref(),
        a.gateway_public.as_deref()?,
        &a.names,
        a.gateway_url.as_deref(),
    ))
}

/// `--gateway-url`: `https://host[:port]`, no user or password in it, its host one of `names`.
fn check_gateway_url(u: &str, names: &[String]) -> Result<(), String> {
    let authority = u
        .strip_prefix("https://")
        .and_then(|r| r.split('/').next())
        .unwrap_or_default();
    if !crate::base::net::url_is_plain(u)
        || authority.contains('@')
        || crate::base::net::host_port(u).is_none()
    {
        return Err(format!(
            "--gateway-url {u:?} must be https://host[:port] (no user or password in it)"
        ));
    }
    let host = crate::base::net::url_host(u).unwrap_or_default();
    if !names.contains(&host) {
        return Err(format!(
            "--gateway-url {u:?}: its host {host:?} is not one of the appliance's names (--gateway-san)"
        ));
    }
    Ok(())
}

/// What the wrapped copy is bound to: the site and the appliance it was made for.
fn binding(site_id: &str, appliance_id: &str) -> Vec<u8> {
    format!("bca site keys v1 {site_id} {appliance_id}").into_bytes()
}

pub struct JoinSiteOptions {
    pub state_dir: PathBuf,
    /// The site's serving CA pin (`bca pki show` on an appliance of the site): what the site's
    /// keys, when they come, must be.
    pub serving_ca_pin: String,
    pub store: crate::config::StoreConfig,
    pub gateway_sans: Vec<String>,
    pub gateway_url: Option<String>,
    pub key_protection: KeyProtection,
    pub passphrase: Option<zeroize::Zeroizing<String>>,
    pub tpm: Option<String>,
    pub tpm_pcrs: Option<String>,
    pub listen_http: Option<String>,
    pub listen_gateway: Option<String>,
}

/// What `bca join-site` prints.
pub struct Joined {
    pub id: String,
    pub fingerprint: String,
    pub site_id: String,
    /// The site's trust domain as the database named it (checked again, signed, at approval).
    pub trust_domain: String,
}

const CREATED: &[&str] = &["config.toml", "keys", "appliance.id", "joined.json"];

/// What `bca join-site` keeps on the box of what it asked for, to check what the site gives it
/// against (`joined.json`): never taken from the database.
#[derive(serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct JoinedFile {
    serving_ca_pin: String,
    names: Vec<String>,
    gateway_url: Option<String>,
}

/// `bca join-site`: a new state directory for an appliance of the site whose database `store`
/// names, with its own keys, recorded in the database as `pending`. Nothing of the site's keys is
/// given to it until an operator approves it; a failure leaves neither files nor a row.
pub fn join_site(o: JoinSiteOptions, now: i64) -> ApiResult<Joined> {
    if o.store.is_embedded() {
        return Err(ApiError::invalid_input(
            "--store: an appliance joins a site whose store is PostgreSQL (postgres://USER@HOST/DB); \
             a SQLite store is one appliance's own",
        ));
    }
    if o.gateway_sans.is_empty() {
        return Err(ApiError::invalid_input(
            "--gateway-san: name at least one name agents reach this appliance by",
        ));
    }
    for (i, s) in o.gateway_sans.iter().enumerate() {
        crate::pki::gateway_san(s)
            .map_err(|e| ApiError::invalid_input(format!("--gateway-san: {e}")))?;
        if o.gateway_sans[..i].contains(s) {
            return Err(ApiError::invalid_input(format!(
                "--gateway-san {s:?} is given twice"
            )));
        }
    }
    if let Some(u) = &o.gateway_url {
        check_gateway_url(u, &o.gateway_sans).map_err(ApiError::invalid_input)?;
    }
    let pin_ok = o
        .serving_ca_pin
        .strip_prefix("sha256/")
        .is_some_and(|b| crypto::b64_decode(b).is_some_and(|d| d.len() == 32));
    if !pin_ok {
        return Err(ApiError::invalid_input(format!(
            "--serving-ca-pin {:?} must be the site's serving CA pin, sha256/ and 44 base64 \
             characters (bca pki show, on an appliance of the site)",
            o.serving_ca_pin
        )));
    }
    if o.tpm.is_some() != (o.key_protection == KeyProtection::Tpm) && o.tpm.is_some() {
        return Err(ApiError::invalid_input(
            "--tpm names the TPM to seal to: it goes with --key-protection tpm",
        ));
    }
    if crate::appliance::statedir::is_initialised(&o.state_dir) {
        return Err(ApiError::already_exists(format!(
            "{} is already initialised; nothing was changed",
            o.state_dir.display()
        )));
    }
    let pcrs = crate::appliance::statedir::pcrs_arg(o.tpm_pcrs.as_deref())?;
    let tcti = match o.key_protection {
        KeyProtection::Tpm => Some(crate::appliance::statedir::tcti_arg(o.tpm.as_deref())?),
        _ => None,
    };
    // The database first: a wrong URL or password changes nothing on this box.
    let store = Store::open_at(&o.state_dir, o.store.at(), false).map_err(ApiError::unavailable)?;
    let Some((site_id, site_name, trust_domain)) = crate::store::maintenance::site(&store)? else {
        return Err(ApiError::invalid_state(
            "the store's database holds no site: the first appliance makes it with `bca init --store …`",
        ));
    };
    let made_dir = !o.state_dir.exists();
    crate::base::fsutil::create_private_dir(&o.state_dir).map_err(ApiError::invalid_input)?;
    let r = (|| {
        let own = OwnKeys::generate();
        let id = crate::base::ids::new_id("appl", now * 1000);
        let config = crate::appliance::statedir::site_config(
            (&site_id, &site_name, &trust_domain),
            &crate::appliance::statedir::BoxParts {
                gateway_url: o.gateway_url.clone(),
                key_protection: o.key_protection,
                tpm: tcti.as_ref().map(|t| t.to_string()),
                listen_http: o.listen_http.clone(),
                listen_gateway: o.listen_gateway.clone(),
                store: o.store.clone(),
            },
        );
        keys::seal_own(
            &o.state_dir,
            &own,
            o.key_protection,
            o.passphrase.as_ref().map(|p| p.as_bytes()),
            tcti.as_ref().map(|t| (t, pcrs.as_slice())),
        )
        .map_err(ApiError::unavailable)?;
        crate::appliance::statedir::write_id(&o.state_dir, &id).map_err(ApiError::internal)?;
        let joined = JoinedFile {
            serving_ca_pin: o.serving_ca_pin.clone(),
            names: o.gateway_sans.clone(),
            gateway_url: o.gateway_url.clone(),
        };
        crate::base::fsutil::write_new_private(
            &o.state_dir.join("joined.json"),
            &serde_json::to_vec_pretty(&joined).expect("serializes"),
        )
        .map_err(ApiError::internal)?;
        let text = config.to_file_text().map_err(ApiError::internal)?;
        crate::base::fsutil::write_new_private(&o.state_dir.join("config.toml"), text.as_bytes())
            .map_err(ApiError::internal)?;
        let row = new_row(
            (&id, "pending"),
            o.gateway_sans.clone(),
            o.gateway_url.clone(),
            (Some(own.wrap.public_point()), own.gateway.public_point()),
            now,
        );
        let fp = row.fingerprint.clone();
        // Last, the commit point: the row the operator approves.
        store.write(|tx| {
            rows::insert(tx, &row, now)?;
            crate::store::events::audit(
                tx,
                now,
                &crate::store::maintenance::root_tenant_in(tx)?,
                "site.appliance.join",
                "local:join-site",
                &id,
                json!({"names": o.gateway_sans, "fingerprint": fp}),
            )
        })?;
        Ok(Joined {
            id,
            fingerprint: fp,
            site_id: site_id.clone(),
            trust_domain: trust_domain.clone(),
        })
    })();
    if r.is_err() {
        for name in CREATED {
            let p = o.state_dir.join(name);
            let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
        }
        if made_dir {
            let _ = std::fs::remove_dir(&o.state_dir);
        }
    }
    r
}

/// `bca site appliances approve ID`, on an appliance that holds the site's keys (`keys`): wraps
/// them to the pending appliance, signs its gateway leaf, and records both. Refused while a join
/// key rotation is staged or a previous key still accepted (finish it first: the joined box would
/// not know its schedule).
pub fn approve(
    app: &App,
    keys: &KeyBundle,
    (id, expected): (&str, &str),
    caller: &str,
    now: i64,
) -> ApiResult<Value> {
    check_id(id)?;
    if keys.join_signing_next.is_some()
        || keys.join_encryption_next.is_some()
        || keys.join_encryption_previous.is_some()
    {
        return Err(ApiError::invalid_state(
            "a join key rotation is under way (a staged next key or an accepted previous one): \
             finish it before approving an appliance (bca pki show)",
        ));
    }
    let Some(a) = app.store.read(|tx| rows::get(tx, id))? else {
        return Err(ApiError::not_found(format!(
            "no appliance {id} in this site"
        )));
    };
    if a.state != "pending" {
        return Err(ApiError::invalid_state(format!(
            "appliance {id} is {}, not pending: nothing was changed",
            a.state
        )));
    }
    let (Some(wrap), Some(gw)) = (&a.wrap_public, &a.gateway_public) else {
        return Err(ApiError::invalid_state(format!(
            "appliance {id} has no public keys recorded: it cannot be approved"
        )));
    };
    // The fingerprint is computed here from what the approval acts on, never taken from the
    // row's column: it must be the one the new box printed, which the operator gives.
    let fp = fingerprint(Some(wrap), gw, &a.names, a.gateway_url.as_deref());
    if fp != a.fingerprint || expected.trim() != fp {
        return Err(ApiError::invalid_state(format!(
            "appliance {id}'s row does not have the fingerprint {:?}: its keys, names or URL are \
             not what the box printed when it joined (changed in the database?); nothing was \
             approved",
            expected.trim()
        )));
    }
    if let Some(u) = &a.gateway_url {
        check_gateway_url(u, &a.names).map_err(ApiError::invalid_state)?;
    }
    if app.store.read(rows::list)?.iter().any(|o| {
        o.id != a.id && o.state != "removed" && o.wrap_public.as_deref() == Some(wrap.as_slice())
    }) {
        return Err(ApiError::invalid_state(format!(
            "appliance {id}'s wrapping key is another appliance's too: nothing was approved"
        )));
    }
    let site_json = keys.site_json();
    let text = std::str::from_utf8(&site_json).map_err(ApiError::internal)?;
    let wrapped = crate::proto::jwe::seal(text, wrap, &binding(&app.config.site_id, id), now)
        .map_err(|e| ApiError::invalid_state(format!("appliance {id}'s wrapping key: {e}")))?;
    let cert = crate::pki::gateway_leaf_for(&app.config, &keys.serving_ca, gw, &a.names, now)
        .map_err(|e| ApiError::invalid_state(format!("appliance {id}'s gateway leaf: {e}")))?;
    let public = signed_public(app, keys, id, &cert).map_err(ApiError::internal)?;
    app.store.write(|tx| {
        rows::approve(tx, id, (&wrapped, &cert, &public), caller, now)?;
        crate::store::events::audit(
            tx,
            now,
            &app.root_tenant,
            "site.appliance.approve",
            caller,
            id,
            json!({"names": a.names, "fingerprint": fp}),
        )
    })?;
    tracing::info!(appliance = id, fingerprint = %fp, "site: appliance approved");
    Ok(json!({"id": id, "state": "approved", "fingerprint": fp, "names": a.names}))
}

/// `bca site appliances remove ID`: its wrapped keys deleted and its row `removed`; the removed
/// appliance stops serving at its next heartbeat, and its sessions are marked closed.
pub fn remove(
    store: &Store,
    root_tenant: &str,
    id: &str,
    caller: &str,
    now: i64,
) -> ApiResult<Value> {
    check_id(id)?;
    let a = store.write(|tx| {
        let a = rows::remove(tx, id, now)?;
        crate::store::events::audit(
            tx,
            now,
            root_tenant,
            "site.appliance.remove",
            caller,
            id,
            json!({"names": a.names, "fingerprint": a.fingerprint}),
        )?;
        Ok(a)
    })?;
    Ok(json!({"id": a.id, "state": "removed"}))
}

/// Every appliance; the fingerprint shown is computed from the row's keys, names and URL, and a
/// row whose stored fingerprint differs is said to be `changed` (written behind bca's back).
pub fn list(store: &Store, now: i64) -> ApiResult<Value> {
    let all = store.read(rows::list)?;
    let items: Vec<Value> = all
        .iter()
        .map(|a| {
            let mut v = a.shown(LEASE_SECONDS, now);
            let fp = fingerprint_of(a);
            v["changed"] = json!(fp.as_deref() != Some(a.fingerprint.as_str()));
            v["fingerprint"] = json!(fp);
            v
        })
        .collect();
    Ok(json!({ "items": items }))
}

fn check_id(id: &str) -> ApiResult<()> {
    if crate::base::ids::is_id(id, "appl", 26) {
        Ok(())
    } else {
        Err(ApiError::invalid_input(format!(
            "{id:?} is not an appliance id (appl_ and 26 characters: bca site appliances list)"
        )))
    }
}

/// What a joined box receives besides its wrapped keys, signed by the site's serving CA key: the
/// public PKI files of this appliance, the site's id, name and trust domain, the box's own leaf,
/// and the box it is for. The box checks the signature under the serving CA it was given the pin
/// of, so nothing in it can come from a database writer.
fn signed_public(app: &App, keys: &KeyBundle, id: &str, leaf: &[u8]) -> Result<String, String> {
    let payload = json!({
        "appliance": id,
        "site": {
            "id": app.config.site_id,
            "name": app.config.site_name,
            "trustDomain": app.config.trust_domain,
        },
        "files": public_files(&app.state_dir)?,
        "gatewayCert": crypto::b64(leaf),
    });
    let bytes = serde_json::to_vec(&payload).expect("serializes");
    let sig = keys.serving_ca.sign(PUBLIC_PURPOSE, &bytes);
    Ok(json!({"payload": crypto::b64(&bytes), "signature": crypto::b64(&sig)}).to_string())
}

/// The public PKI files of this appliance, as a joined box receives them.
fn public_files(state_dir: &Path) -> Result<Value, String> {
    let dir = crate::pki::pki_dir(state_dir);
    let mut m = serde_json::Map::new();
    for name in PUBLIC_FILES {
        let p = dir.join(name);
        match std::fs::read_to_string(&p) {
            Ok(t) => {
                m.insert((*name).to_string(), Value::String(t));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("cannot read {}: {e}", p.display())),
        }
    }
    Ok(Value::Object(m))
}

/// The signed part of what a joined box received ([`signed_public`]), once its signature verifies
/// under the serving CA whose pin the box was given: the payload, and that CA's certificate.
fn verified_public(envelope: &str, pin: &str) -> Result<Value, String> {
    let e: Value = serde_json::from_str(envelope).map_err(|e| format!("not JSON: {e}"))?;
    let field = |k: &str| {
        e[k].as_str()
            .and_then(crypto::b64_decode)
            .ok_or_else(|| format!("no {k}"))
    };
    let (bytes, sig) = (field("payload")?, field("signature")?);
    let payload: Value =
        serde_json::from_slice(&bytes).map_err(|e| format!("the payload is not JSON: {e}"))?;
    let ca = payload["files"]["serving-ca.pem"]
        .as_str()
        .and_then(|t| {
            crate::proto::x509::pem_decode_all(t, "CERTIFICATE")
                .into_iter()
                .next()
        })
        .ok_or("it holds no serving CA certificate")?;
    let spki = crate::proto::x509::cert_spki(&ca)?;
    if crypto::spki_pin(&spki) != pin {
        return Err(format!(
            "its serving CA is {}, not the site's whose pin `bca join-site` was given ({pin})",
            crypto::spki_pin(&spki)
        ));
    }
    let point = crypto::p256_point_from_spki(&spki).ok_or("the serving CA's key is not P-256")?;
    if !crypto::verify(point, PUBLIC_PURPOSE, &bytes, &sig) {
        return Err("it is not signed by the site's serving CA".into());
    }
    Ok(payload)
}

/// At `serve` of a joined appliance whose bundle is not there yet: waits (saying so) until an
/// operator approves it, then opens the wrapped copy with its own key, writes the public PKI and
/// its gateway leaf, and seals the bundle as its own keys are (the commit point). Refuses when
/// the appliance was removed or its row is gone.
pub fn take_site_keys(
    state_dir: &Path,
    config: &crate::config::Config,
    passphrase: Option<&[u8]>,
    tcti: Option<&crate::tpm::Tcti>,
) -> Result<(), String> {
    let (own, vault) = keys::open_own(state_dir, config.key_protection, passphrase, tcti)?;
    let id = crate::appliance::statedir::own_id(state_dir)?;
    let store = Store::open_at(state_dir, config.store.at(), false)?;
    let mut said = None::<std::time::Instant>;
    let a = loop {
        let a = store
            .read(|tx| rows::get(tx, &id))
            .map_err(|e| format!("the site's database: {e}"))?
            .ok_or_else(|| {
                format!(
                    "appliance {id} is not in the site's database any more: join the site again \
                     (bca join-site) in a new state directory"
                )
            })?;
        match a.state.as_str() {
            "approved" => break a,
            "pending" => {
                if said.is_none_or(|t| t.elapsed().as_secs() >= 60) {
                    tracing::warn!(
                        appliance = %id,
                        fingerprint = %a.fingerprint,
                        "waiting for an operator's approval: on an appliance of the site, check the \
                         fingerprint and run `bca site appliances approve {id}`"
                    );
                    said = Some(std::time::Instant::now());
                }
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
            other => {
                return Err(format!(
                    "appliance {id} is {other}: it was removed from the site and serves nothing"
                ))
            }
        }
    };
    let (Some(wrapped), Some(_), Some(public)) =
        (&a.wrapped_keys, &a.gateway_cert, &a.public_pki_json)
    else {
        return Err(format!(
            "appliance {id} is approved but its keys are missing from its row"
        ));
    };
    let key = crate::proto::jwe::decryption_key(own.wrap.pkcs8())?;
    let clear = crate::proto::jwe::open(
        wrapped,
        &key,
        &crypto::sha256(&binding(&config.site_id, &id)),
        crate::base::clock::now(),
        i64::MAX / 4,
    )
    .map_err(|e| {
        format!("the site's keys wrapped to appliance {id} do not open with its key ({e:?})")
    })?;
    let bundle = KeyBundle::from_site_json(clear.as_bytes(), own.gateway)?;
    drop(clear);
    // Checked against what this box asked for, kept on its own disk: the site's serving CA by
    // its pin, then everything else against it. The public files go into place only once they
    // are checked, in one rename, then the bundle (a crash in between: the next start does it
    // again).
    let joined: JoinedFile = std::fs::read(state_dir.join("joined.json"))
        .map_err(|e| {
            format!(
                "cannot read {}: {e}",
                state_dir.join("joined.json").display()
            )
        })
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| format!("joined.json: {e}")))?;
    // The signature first: nothing of it is used, or written, before it verifies.
    let payload = verified_public(public, &joined.serving_ca_pin)
        .map_err(|e| format!("what the site gave appliance {id} is refused: {e}"))?;
    let site = &payload["site"];
    if payload["appliance"] != id.as_str()
        || site["id"] != config.site_id.as_str()
        || site["trustDomain"] != config.trust_domain.as_str()
        || site["name"] != config.site_name.as_str()
    {
        return Err(format!(
            "what the site gave appliance {id} is for {} of site {} ({}), but this box's config.toml \
             says site {} ({}): the database named another site when it joined; join the site again \
             in a new state directory",
            payload["appliance"], site["id"], site["trustDomain"], config.site_id, config.trust_domain
        ));
    }
    let cert = payload["gatewayCert"]
        .as_str()
        .and_then(crypto::b64_decode)
        .ok_or_else(|| format!("what the site gave appliance {id} holds no gateway certificate"))?;
    let files = payload["files"].as_object().cloned().unwrap_or_default();
    let staging = state_dir.join("pki.new");
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging)
        .map_err(|e| format!("cannot create {}: {e}", staging.display()))?;
    let checked = (|| {
        let mut serving_ca = None;
        for (name, text) in &files {
            let (Some(name), Some(text)) =
                (PUBLIC_FILES.iter().find(|n| **n == name), text.as_str())
            else {
                return Err(format!(
                    "appliance {id}'s public PKI names a file {name:?} bca does not write"
                ));
            };
            if *name == "serving-ca.pem" {
                serving_ca = Some(text.to_string());
            }
            crate::base::fsutil::write_new(&staging.join(name), text.as_bytes(), 0o644)?;
        }
        let serving_ca = serving_ca.ok_or("the site's public PKI has no serving CA")?;
        crate::base::fsutil::write_new(
            &staging.join("gateway.pem"),
            (crate::proto::x509::pem("CERTIFICATE", &cert) + &serving_ca).as_bytes(),
            0o644,
        )?;
        let public = crate::pki::PublicPki::load(&staging)?;
        crate::pki::check_keys_against(&public, &bundle).map_err(|e| {
            format!("the site's keys given to appliance {id} are not the site's: {e}")
        })?;
        check_leaf(
            &cert,
            &bundle,
            &joined.names,
            config,
            crate::base::clock::now(),
        )
        .map_err(|e| format!("appliance {id}'s gateway certificate: {e}"))
    })();
    if let Err(e) = checked {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    let dir = crate::pki::pki_dir(state_dir);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&staging, &dir)
        .map_err(|e| format!("cannot move {} into place: {e}", staging.display()))?;
    vault.store_bundle(&bundle)?;
    tracing::info!(appliance = %id, "site: approved; the site's keys are taken");
    Ok(())
}

/// A joined box's gateway leaf: signed by the site's serving CA, for exactly the names it asked
/// for, valid now and for no longer than `[pki] gateway_leaf_validity_days`.
fn check_leaf(
    cert: &[u8],
    bundle: &KeyBundle,
    names: &[String],
    config: &crate::config::Config,
    now: i64,
) -> Result<(), String> {
    if !crate::proto::x509::signed_by(cert, bundle.serving_ca.public_point()) {
        return Err("not signed by the site's serving CA".into());
    }
    let mut got = crate::proto::x509::cert_sans(cert)?;
    let mut want = names.to_vec();
    got.sort();
    want.sort();
    if got != want {
        return Err(format!("it names {got:?}, this box asked for {want:?}"));
    }
    let (nb, na) = crate::proto::x509::validity(cert).ok_or("its validity cannot be read")?;
    let most = config.pki.gateway_leaf_validity_days as i64 * 86_400 + 3_600;
    if na <= now || nb > now + 300 || na - nb > most {
        return Err(format!(
            "valid from {} to {}: not now, or longer than [pki] gateway_leaf_validity_days",
            crate::base::clock::rfc3339(nb),
            crate::base::clock::rfc3339(na)
        ));
    }
    Ok(())
}

/// The row of an appliance that holds the site's keys on its own disk (`bca init` made it).
pub fn origin(
    id: &str,
    names: Vec<String>,
    gateway_url: Option<String>,
    gateway_point: &[u8],
    now: i64,
) -> Appliance {
    new_row(
        (id, "origin"),
        names,
        gateway_url,
        (None, gateway_point),
        now,
    )
}

/// A new row `(id, state)` with the box's names, URL and `(wrapping, gateway)` public keys, its
/// fingerprint computed from them.
fn new_row(
    (id, state): (&str, &str),
    names: Vec<String>,
    gateway_url: Option<String>,
    (wrap, gateway): (Option<&[u8]>, &[u8]),
    now: i64,
) -> Appliance {
    Appliance {
        id: id.to_string(),
        state: state.to_string(),
        fingerprint: fingerprint(wrap, gateway, &names, gateway_url.as_deref()),
        names,
        gateway_url,
        wrap_public: wrap.map(<[u8]>::to_vec),
        gateway_public: Some(gateway.to_vec()),
        wrapped_keys: None,
        gateway_cert: None,
        public_pki_json: None,
        created_at: now,
        approved_at: None,
        approved_by: None,
        heartbeat_at: None,
    }
}

/// At every `serve`: this appliance's row, recorded as `origin` when it holds the site's keys
/// itself and has none yet; refused when it was removed.
pub fn register(app: &App, keys: &KeyBundle, id: &str, now: i64) -> Result<(), String> {
    let names = crate::proto::x509::cert_sans(&app.pki.gateway).unwrap_or_default();
    let gw = keys.gateway.public_point().to_vec();
    let state = app
        .store
        .write(|tx| {
            let existing = rows::get(tx, id)?;
            match existing.as_ref().map(|a| a.state.as_str()) {
                None | Some("origin") => rows::insert(
                    tx,
                    &origin(id, names.clone(), app.config.gateway_url.clone(), &gw, now),
                    now,
                )?,
                _ => {
                    rows::heartbeat(tx, id, now)?;
                }
            }
            Ok(existing.map(|a| a.state))
        })
        .map_err(|e| format!("recording this appliance in the site's database: {e}"))?;
    match state.as_deref() {
        Some("removed") => Err(format!(
            "appliance {id} was removed from the site (bca site appliances remove): it serves nothing"
        )),
        Some("pending") => Err(format!(
            "appliance {id} is still pending in the site's database but holds keys: its state \
             directory is not the one that joined"
        )),
        _ => Ok(()),
    }
}

/// One heartbeat: this appliance's lease renewed, the sessions of dead appliances marked closed.
/// `Err` when this appliance was removed from the site (it must stop serving).
pub fn heartbeat(app: &App, id: &str, now: i64) -> Result<(), String> {
    let r = app.store.write(|tx| {
        let state = rows::heartbeat(tx, id, now)?;
        let dead = crate::store::nodes::disconnect_dead(tx, now - LEASE_SECONDS)?;
        for (node, tenant) in &dead {
            crate::store::events::publish(
                tx,
                now,
                tenant,
                "node.disconnected",
                json!({"nodeId": node}),
            )?;
        }
        Ok((state, dead.len()))
    });
    if crate::store::pg::lost_exclusive() {
        return Err(format!(
            "another bca serve took appliance {id}'s lock on the database while this one was \
             reconnecting (a copy of this state directory serving): stopping"
        ));
    }
    match r {
        Ok((Some(s), dead)) if s != "removed" => {
            if dead > 0 {
                tracing::warn!(
                    sessions = dead,
                    "site: closed the sessions of an appliance found dead"
                );
            }
            Ok(())
        }
        Ok(_) => Err(format!(
            "appliance {id} was removed from the site (bca site appliances remove): stopping"
        )),
        Err(e) => {
            tracing::warn!(error = %e, "site: heartbeat failed; trying again");
            Ok(())
        }
    }
}

/// Whether several appliances of the site hold its keys: an appliance joined and approved (a join
/// key rotation is then refused: it is not carried to the others yet).
pub fn several_hold_keys(store: &Store) -> ApiResult<bool> {
    Ok(store
        .read(rows::list)?
        .iter()
        .any(|a| a.state == "approved"))
}
