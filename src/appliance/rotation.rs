//! Key rotation while serving: `bca pki rotate join-encryption|join-signing|gateway`.
//!
//! **join-signing** and **join-encryption** rotate with an overlap. `stage` makes the next key,
//! publishes it and its pin (the well-known document's `join.next*` fields, `bca pki show`, new
//! agent configs and install scripts), and schedules its promotion after the overlap (7 days by
//! default). Until then:
//! - joins sealed to the next encryption key are accepted as well as the current one (agent
//!   configs written now carry the next key and seal to it);
//! - answers are still signed by the current signing key, and carry the next key's pin inside the
//!   signed body, so renewing agents learn it from a source they already trust; agents accept a
//!   signer matching either pin.
//!
//! `promote` (at the scheduled time, or at once when asked) makes the next key current. A promoted
//! encryption key's predecessor stays accepted for one more overlap (`previous`), then is retired;
//! `retire-previous` retires it at once. An agent configured before the rotation began and never
//! renewed during the overlap knows only the old signing pin: after the promotion its joins fail
//! loudly, and it needs the new config (README: operations).
//!
//! **gateway** renews the TLS leaf (a new key, the same names, signed by the serving CA) and swaps
//! it in: new handshakes get the new leaf, live sessions carry on. Agents pin the serving CA, not
//! the leaf, so nothing else changes. The server renews it by itself when a third of its validity
//! is left.
//!
//! Crash safety: the key bundle is the commit point. Each step writes the new bundle (atomically),
//! then makes the public files agree with it; [`reconcile`] repeats that at every start, so a crash
//! between the two is finished, never half-applied.

use crate::appliance::app::App;
use crate::base::error::{ApiError, ApiResult};
use crate::config::Config;
use crate::keys::Vault;
use crate::pki::bundle::KeyBundle;
use crate::pki::{self, PublicPki};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::path::Path;
use std::sync::Mutex;

pub const DEFAULT_OVERLAP: i64 = 7 * 86_400;
const MIN_OVERLAP: i64 = 60;
const MAX_OVERLAP: i64 = 365 * 86_400;

/// `pki/rotation.json`: what is staged and when it changes.
#[derive(Serialize, Deserialize, Default, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Schedule {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_signing: Option<Staged>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_encryption: Option<Staged>,
    /// When the promoted-away join-encryption key stops being accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub previous_encryption_until: Option<i64>,
}

#[derive(Serialize, Deserialize, Debug, Clone, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Staged {
    pub staged_at: i64,
    pub promote_at: i64,
    pub overlap_seconds: i64,
}

fn schedule_path(state_dir: &Path) -> std::path::PathBuf {
    pki::pki_dir(state_dir).join("rotation.json")
}

pub fn load_schedule(state_dir: &Path) -> Schedule {
    std::fs::read(schedule_path(state_dir))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

fn save_schedule(state_dir: &Path, s: &Schedule) -> Result<(), String> {
    let text = serde_json::to_vec_pretty(s).expect("serializes");
    crate::base::fsutil::write_atomic(&schedule_path(state_dir), &text, 0o644)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    JoinSigning,
    JoinEncryption,
    Gateway,
}

impl Kind {
    pub fn parse(s: &str) -> ApiResult<Self> {
        match s {
            "join-signing" => Ok(Kind::JoinSigning),
            "join-encryption" => Ok(Kind::JoinEncryption),
            "gateway" => Ok(Kind::Gateway),
            _ => Err(ApiError::invalid_input(format!(
                "kind must be join-encryption, join-signing or gateway, got {s:?}"
            ))),
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Kind::JoinSigning => "join-signing",
            Kind::JoinEncryption => "join-encryption",
            Kind::Gateway => "gateway",
        }
    }
}

/// What the automatic pass should do now.
#[derive(Debug, PartialEq, Eq)]
pub enum Due {
    Promote(Kind),
    RetirePrevious,
    RenewGateway,
}

/// The steps that are due at `now` (pure; the server's hourly pass applies them).
pub fn due(s: &Schedule, gateway_validity: (i64, i64), now: i64) -> Vec<Due> {
    let mut out = Vec::new();
    if s.join_signing
        .as_ref()
        .is_some_and(|st| st.promote_at <= now)
    {
        out.push(Due::Promote(Kind::JoinSigning));
    }
    if s.join_encryption
        .as_ref()
        .is_some_and(|st| st.promote_at <= now)
    {
        out.push(Due::Promote(Kind::JoinEncryption));
    }
    if s.previous_encryption_until.is_some_and(|t| t <= now) {
        out.push(Due::RetirePrevious);
    }
    let (not_before, not_after) = gateway_validity;
    if not_after - now < (not_after - not_before) / 3 {
        out.push(Due::RenewGateway);
    }
    out
}

fn write_pem(dir: &Path, name: &str, text: String) -> Result<(), String> {
    crate::base::fsutil::write_atomic(&dir.join(name), text.as_bytes(), 0o644)
}

fn remove(dir: &Path, name: &str) -> Result<(), String> {
    match std::fs::remove_file(dir.join(name)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("cannot remove {}: {e}", dir.join(name).display())),
    }
}

fn jwk_text(key: &crate::base::crypto::SigningKey) -> String {
    serde_json::to_string_pretty(&crate::proto::jwe::jwk(key.public_point())).expect("serializes")
        + "\n"
}

fn jwk_matches(dir: &Path, name: &str, key: &crate::base::crypto::SigningKey) -> bool {
    std::fs::read_to_string(dir.join(name))
        .ok()
        .and_then(|t| serde_json::from_str::<crate::proto::jwe::Jwk>(&t).ok())
        .and_then(|j| j.point())
        .is_some_and(|p| p == key.public_point())
}

fn cert_matches(dir: &Path, name: &str, key: &crate::base::crypto::SigningKey) -> bool {
    std::fs::read_to_string(dir.join(name))
        .ok()
        .and_then(|t| {
            crate::proto::x509::pem_decode_all(&t, "CERTIFICATE")
                .into_iter()
                .next()
        })
        .and_then(|c| crate::proto::x509::cert_spki(&c).ok())
        .is_some_and(|s| s == key.spki_der())
}

/// Makes the public files and the schedule agree with the key bundle (the commit point); returns
/// what it changed. A no-op on a consistent state directory.
pub fn reconcile(
    state_dir: &Path,
    cfg: &Config,
    keys: &KeyBundle,
    now: i64,
) -> Result<Vec<String>, String> {
    let dir = pki::pki_dir(state_dir);
    let mut fixed = Vec::new();
    if !cert_matches(&dir, "join-signing.pem", &keys.join_signing) {
        write_pem(
            &dir,
            "join-signing.pem",
            crate::proto::x509::pem(
                "CERTIFICATE",
                &pki::join_signing_cert(cfg, &keys.join_signing, now)?,
            ),
        )?;
        fixed.push("join-signing.pem".to_string());
    }
    match &keys.join_signing_next {
        Some(k) if !cert_matches(&dir, "join-signing.next.pem", k) => {
            write_pem(
                &dir,
                "join-signing.next.pem",
                crate::proto::x509::pem("CERTIFICATE", &pki::join_signing_cert(cfg, k, now)?),
            )?;
            fixed.push("join-signing.next.pem".into());
        }
        None if dir.join("join-signing.next.pem").exists() => {
            remove(&dir, "join-signing.next.pem")?;
            fixed.push("join-signing.next.pem (removed)".into());
        }
        _ => {}
    }
    for (name, key) in [
        ("join-encryption.jwk", Some(&keys.join_encryption)),
        (
            "join-encryption.next.jwk",
            keys.join_encryption_next.as_ref(),
        ),
        (
            "join-encryption.previous.jwk",
            keys.join_encryption_previous.as_ref(),
        ),
    ] {
        match key {
            Some(k) if !jwk_matches(&dir, name, k) => {
                write_pem(&dir, name, jwk_text(k))?;
                fixed.push(name.into());
            }
            None if dir.join(name).exists() => {
                remove(&dir, name)?;
                fixed.push(format!("{name} (removed)"));
            }
            _ => {}
        }
    }
    if !cert_matches(&dir, "gateway.pem", &keys.gateway) {
        let old = PublicPki::load(&dir)?;
        let sans = crate::proto::x509::cert_sans(&old.gateway)?;
        let leaf = pki::gateway_leaf(cfg, keys, &sans, now)?;
        write_pem(
            &dir,
            "gateway.pem",
            crate::proto::x509::pem("CERTIFICATE", &leaf)
                + &crate::proto::x509::pem("CERTIFICATE", &old.serving_ca),
        )?;
        fixed.push("gateway.pem".into());
    }
    let mut s = load_schedule(state_dir);
    let before = s.clone();
    let staged = |st: Option<Staged>, has: bool| match (st, has) {
        (st @ Some(_), true) => st,
        (None, true) => Some(Staged {
            staged_at: now,
            promote_at: now + DEFAULT_OVERLAP,
            overlap_seconds: DEFAULT_OVERLAP,
        }),
        (_, false) => None,
    };
    s.join_signing = staged(s.join_signing.take(), keys.join_signing_next.is_some());
    s.join_encryption = staged(
        s.join_encryption.take(),
        keys.join_encryption_next.is_some(),
    );
    if keys.join_encryption_previous.is_none() {
        s.previous_encryption_until = None;
    } else if s.previous_encryption_until.is_none() {
        s.previous_encryption_until = Some(now + DEFAULT_OVERLAP);
    }
    if s != before {
        save_schedule(state_dir, &s)?;
        fixed.push("rotation.json".into());
    }
    Ok(fixed)
}

/// Rotation while serving: holds the vault that can seal the bundle again.
pub struct Rotator {
    vault: Vault,
    lock: Mutex<()>,
}

impl Rotator {
    pub fn new(vault: Vault) -> Self {
        Self {
            vault,
            lock: Mutex::new(()),
        }
    }

    /// One step, asked for by an operator (`action` None: the kind's usual step).
    pub fn rotate(
        &self,
        app: &App,
        kind: Kind,
        action: Option<&str>,
        overlap: Option<i64>,
        caller: &str,
        now: i64,
    ) -> ApiResult<Value> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let action = action.unwrap_or(match kind {
            Kind::Gateway => "renew",
            _ => "stage",
        });
        if let Some(o) = overlap {
            if !(MIN_OVERLAP..=MAX_OVERLAP).contains(&o) {
                return Err(ApiError::invalid_input(format!(
                    "overlapSeconds must be {MIN_OVERLAP} to {MAX_OVERLAP}"
                )));
            }
            if action != "stage" {
                return Err(ApiError::invalid_input("overlapSeconds goes with stage"));
            }
        }
        if kind != Kind::Gateway && crate::appliance::members::several_hold_keys(&app.store)? {
            return Err(ApiError::invalid_state(
                "several appliances of this site hold its keys: a join key rotation is not carried \
                 to the others yet (docs/scale-out.md); nothing was changed",
            ));
        }
        let mut keys = self.vault.load().map_err(ApiError::internal)?;
        let mut s = load_schedule(&app.state_dir);
        let overlap = overlap.unwrap_or(DEFAULT_OVERLAP);
        match (kind, action) {
            (Kind::JoinSigning | Kind::JoinEncryption, "stage") => {
                let slot = match kind {
                    Kind::JoinSigning => &mut keys.join_signing_next,
                    _ => &mut keys.join_encryption_next,
                };
                if slot.is_some() {
                    return Err(ApiError::invalid_state(format!(
                        "a next {} key is already staged: promote it first (bca pki rotate {} --promote)",
                        kind.as_str(),
                        kind.as_str()
                    )));
                }
                if kind == Kind::JoinEncryption && keys.join_encryption_previous.is_some() {
                    return Err(ApiError::invalid_state(
                        "the previous join-encryption key is still accepted: retire it first (bca pki rotate join-encryption --retire-previous)",
                    ));
                }
                *slot = Some(crate::base::crypto::SigningKey::generate());
                let st = Some(Staged {
                    staged_at: now,
                    promote_at: now + overlap,
                    overlap_seconds: overlap,
                });
                match kind {
                    Kind::JoinSigning => s.join_signing = st,
                    _ => s.join_encryption = st,
                }
            }
            (Kind::JoinSigning, "promote") => {
                let next = keys.join_signing_next.take().ok_or_else(|| {
                    ApiError::invalid_state("no next join-signing key is staged")
                })?;
                keys.join_signing = next;
                s.join_signing = None;
            }
            (Kind::JoinEncryption, "promote") => {
                let next = keys.join_encryption_next.take().ok_or_else(|| {
                    ApiError::invalid_state("no next join-encryption key is staged")
                })?;
                let overlap = s
                    .join_encryption
                    .take()
                    .map(|st| st.overlap_seconds)
                    .unwrap_or(DEFAULT_OVERLAP);
                keys.join_encryption_previous = Some(std::mem::replace(&mut keys.join_encryption, next));
                s.previous_encryption_until = Some(now + overlap);
            }
            (Kind::JoinEncryption, "retire-previous") => {
                if keys.join_encryption_previous.take().is_none() {
                    return Err(ApiError::invalid_state(
                        "no previous join-encryption key is accepted",
                    ));
                }
                s.previous_encryption_until = None;
            }
            (Kind::Gateway, "renew") => {
                keys.gateway = crate::base::crypto::SigningKey::generate();
            }
            (k, a) => {
                return Err(ApiError::invalid_input(format!(
                    "{} has no action {a:?} (join keys: stage, promote; join-encryption also retire-previous; gateway: renew)",
                    k.as_str()
                )))
            }
        }
        // The schedule first (reconcile corrects it against the bundle whichever way a crash
        // falls, and keeps the chosen overlap), then the commit point: the bundle. Then the
        // public files, the audit row, and the live keys.
        save_schedule(&app.state_dir, &s).map_err(ApiError::internal)?;
        self.vault.store(&keys).map_err(ApiError::internal)?;
        reconcile(&app.state_dir, &app.config, &keys, now).map_err(ApiError::internal)?;
        let data = json!({"kind": kind.as_str(), "action": action, "schedule": s});
        app.store.write(|tx| {
            crate::store::events::audit(
                tx,
                now,
                &app.root_tenant,
                "pki.rotate",
                caller,
                kind.as_str(),
                data.clone(),
            )
        })?;
        self.go_live(app, &keys)?;
        tracing::info!(kind = kind.as_str(), action, "pki: rotated");
        status(&app.state_dir)
    }

    /// Runs `f` with the bundle as it rests now, no rotation running meanwhile (an appliance's
    /// approval wraps it).
    pub fn with_keys<T>(&self, f: impl FnOnce(&KeyBundle) -> ApiResult<T>) -> ApiResult<T> {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let keys = self.vault.load().map_err(ApiError::internal)?;
        f(&keys)
    }

    /// Applies what is due (the server's hourly pass).
    pub fn tick(&self, app: &App, now: i64) {
        let s = load_schedule(&app.state_dir);
        let gw = std::fs::read_to_string(pki::pki_dir(&app.state_dir).join("gateway.pem"))
            .ok()
            .and_then(|t| {
                crate::proto::x509::pem_decode_all(&t, "CERTIFICATE")
                    .into_iter()
                    .next()
            })
            .and_then(|c| crate::proto::x509::validity(&c));
        if gw.is_none() {
            tracing::error!("pki: cannot read gateway.pem; its renewal is not scheduled");
        }
        // Unreadable: treated as fresh, so the promotions and retirements still happen.
        for d in due(&s, gw.unwrap_or((now, now + 3)), now) {
            let (kind, action) = match d {
                Due::Promote(k) => (k, "promote"),
                Due::RetirePrevious => (Kind::JoinEncryption, "retire-previous"),
                Due::RenewGateway => (Kind::Gateway, "renew"),
            };
            if let Err(e) = self.rotate(app, kind, Some(action), None, "bca", now) {
                tracing::error!(kind = kind.as_str(), action, error = %e, "pki: automatic rotation failed");
            }
        }
    }

    /// Swaps the new keys into the running JoinService and gateway and republishes the
    /// well-known document.
    fn go_live(&self, app: &App, keys: &KeyBundle) -> ApiResult<()> {
        let public = PublicPki::load(&pki::pki_dir(&app.state_dir)).map_err(ApiError::internal)?;
        crate::pki::check_keys_against(&public, keys).map_err(ApiError::internal)?;
        if let Some(j) = app.join.get() {
            j.replace_keys(
                crate::join::issue::SignerKeys::new(&public, keys).map_err(ApiError::internal)?,
            );
        }
        if let Some(g) = app.gateway_cert.get() {
            g.replace(&public.gateway, &public.serving_ca, keys.gateway.pkcs8())
                .map_err(ApiError::internal)?;
        }
        let doc =
            crate::appliance::app::well_known(&app.config, &public).map_err(ApiError::internal)?;
        *app.well_known.write().unwrap_or_else(|p| p.into_inner()) = doc;
        Ok(())
    }
}

/// Pins (current and next) and the schedule, as `pki/status` and `bca pki show` report them.
pub fn status(state_dir: &Path) -> ApiResult<Value> {
    let public = PublicPki::load(&pki::pki_dir(state_dir)).map_err(ApiError::invalid_config)?;
    let pins = public.pins().map_err(ApiError::invalid_config)?;
    let s = load_schedule(state_dir);
    let t = |v: Option<i64>| v.map(crate::base::clock::rfc3339);
    Ok(json!({
        "pins": pins,
        "rotation": {
            "joinSigning": s.join_signing.as_ref().map(|st| json!({"stagedAt": t(Some(st.staged_at)), "promoteAt": t(Some(st.promote_at))})),
            "joinEncryption": s.join_encryption.as_ref().map(|st| json!({"stagedAt": t(Some(st.staged_at)), "promoteAt": t(Some(st.promote_at))})),
            "previousEncryptionAcceptedUntil": t(s.previous_encryption_until),
            "gatewayNotAfter": t(crate::proto::x509::not_after(&public.gateway)),
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_due() {
        let staged = |at| {
            Some(Staged {
                staged_at: 0,
                promote_at: at,
                overlap_seconds: at,
            })
        };
        let s = Schedule {
            join_signing: staged(100),
            join_encryption: staged(200),
            previous_encryption_until: Some(300),
        };
        let gw = (0, 90 * 86_400);
        assert_eq!(due(&s, gw, 99), vec![]);
        assert_eq!(due(&s, gw, 100), vec![Due::Promote(Kind::JoinSigning)]);
        assert_eq!(
            due(&s, gw, 300),
            vec![
                Due::Promote(Kind::JoinSigning),
                Due::Promote(Kind::JoinEncryption),
                Due::RetirePrevious
            ]
        );
        // The gateway leaf is renewed with a third of its life left.
        let empty = Schedule::default();
        assert_eq!(due(&empty, gw, 59 * 86_400), vec![]);
        assert_eq!(due(&empty, gw, 61 * 86_400), vec![Due::RenewGateway]);
    }
}
