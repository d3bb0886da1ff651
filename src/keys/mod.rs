//! The appliance's private keys and how they rest on disk.
//!
//! All five keys are P-256: the node CA, the serving CA, the gateway's TLS leaf, the join-signing
//! key and the join-encryption key. They live together in one `KeyBundle` (`bundle`) so that they are loaded
//! once, at `serve`, and zeroized on drop. How the bundle rests is a [`KeyProtection`]:
//!
//! - `passphrase`: `keys/keys.sealed`, the bundle encrypted with AES-256-GCM under a key derived
//!   by Argon2id (64 MiB, 3 passes) from the passphrase;
//! - `file`: `keys/keys.json`, the bundle in clear in a 0600 file (development only);
//! - `tpm`: `keys/keys.tpm`, the bundle encrypted with AES-256-GCM under a random key that is
//!   sealed to the box's TPM (a sealed data object under the storage primary key, which is
//!   re-created from the TCG template at every start). The blob is useless on another TPM or after
//!   the owner hierarchy was cleared: the load fails, nothing is changed. Not yet: binding to PCRs,
//!   parameter encryption of the unsealed key on the bus (ARCHITECTURE.md's threat model), and an
//!   escrow copy.

use crate::base::crypto;
use crate::config::KeyProtection;
use crate::pki::bundle::KeyBundle;
use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use zeroize::Zeroizing;

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SealedFile {
    version: u32,
    kdf: String,
    m_kib: u32,
    t: u32,
    p: u32,
    salt: String,
    nonce: String,
    ciphertext: String,
}

/// `keys/keys.tpm`.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct TpmSealedFile {
    version: u32,
    /// The sealed data object holding the key-encryption key: TPM2B_PRIVATE's bytes and the
    /// marshaled TPM2B_PUBLIC, base64.
    tpm_private: String,
    tpm_public: String,
    /// The PCRs (SHA-256 bank) the object is bound to; none when absent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pcrs: Vec<u32>,
    /// Unsealed through a salted policy session with the secret encrypted on the bus (absent,
    /// false: a blob of the first version, opened with the empty password).
    #[serde(default)]
    unseal_policy: bool,
    /// The storage key's Name (base64) when sealed, checked at every unseal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    srk_name: Option<String>,
    nonce: String,
    ciphertext: String,
}

const AAD: &[u8] = b"bca keys v1";
const ARGON_M_KIB: u32 = 64 * 1024;
const ARGON_T: u32 = 3;

pub fn keys_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("keys")
}

fn file_for(state_dir: &Path, p: KeyProtection) -> PathBuf {
    keys_dir(state_dir).join(match p {
        KeyProtection::File => "keys.json",
        KeyProtection::Passphrase => "keys.sealed",
        KeyProtection::Tpm => "keys.tpm",
    })
}

/// The key a passphrase derived, kept by the server so that it can seal the bundle again after a
/// rotation without asking for the passphrase (zeroized on drop).
struct Kek {
    /// Set for `tpm` protection: the blob that holds `key` in the TPM.
    tpm: Option<crate::tpm::SealedBlob>,
    key: Zeroizing<[u8; 32]>,
    salt: Vec<u8>,
    m_kib: u32,
    t: u32,
    p: u32,
}

impl Kek {
    fn new(pass: &[u8]) -> Result<Self, String> {
        let mut salt = [0u8; 16];
        crypto::fill_random(&mut salt);
        Ok(Self {
            tpm: None,
            key: derive(pass, &salt, ARGON_M_KIB, ARGON_T, 1)?,
            salt: salt.to_vec(),
            m_kib: ARGON_M_KIB,
            t: ARGON_T,
            p: 1,
        })
    }

    /// A random key, sealed to the TPM (and to the current values of `pcrs`).
    fn new_tpm(tcti: &crate::tpm::Tcti, pcrs: &[u32]) -> Result<Self, String> {
        let mut key = Zeroizing::new([0u8; 32]);
        crypto::fill_random(key.as_mut());
        let blob = crate::tpm::Tpm::open(tcti)
            .and_then(|mut t| t.seal(key.as_slice(), pcrs))
            .map_err(|e| format!("sealing the keys to the TPM: {e}"))?;
        Ok(Self::held_by_tpm(blob, key))
    }

    /// The key `blob` holds in the TPM.
    fn held_by_tpm(blob: crate::tpm::SealedBlob, key: Zeroizing<[u8; 32]>) -> Self {
        Self {
            tpm: Some(blob),
            key,
            salt: Vec::new(),
            m_kib: 0,
            t: 0,
            p: 0,
        }
    }

    /// Opens a passphrase-sealed file (`keys/keys.sealed`, or an escrow copy at `path`): the
    /// bundle, and the key that seals it again.
    fn open_passphrase(
        f: &SealedFile,
        pass: &[u8],
        path: &Path,
    ) -> Result<(Zeroizing<Vec<u8>>, Self), String> {
        if f.version != 1
            || f.kdf != "argon2id"
            || f.p != 1
            || f.m_kib > 4 * 1024 * 1024
            || f.t > 64
        {
            return Err(format!(
                "{} has parameters this bca does not read",
                path.display()
            ));
        }
        let salt = crypto::b64_decode(&f.salt).ok_or("damaged salt")?;
        let key = derive(pass, &salt, f.m_kib, f.t, f.p)?;
        let bundle = open_raw(&f.nonce, &f.ciphertext, &key)?;
        Ok((
            bundle,
            Self {
                tpm: None,
                key,
                salt,
                m_kib: f.m_kib,
                t: f.t,
                p: f.p,
            },
        ))
    }

    fn seal(&self, bundle: &KeyBundle) -> Result<Zeroizing<Vec<u8>>, String> {
        self.seal_bytes(&bundle.to_json())
    }

    /// Seals `clear` (a bundle's or an appliance's own keys' JSON) into the file format of this
    /// protection.
    fn seal_bytes(&self, clear: &[u8]) -> Result<Zeroizing<Vec<u8>>, String> {
        let mut nonce = [0u8; 12];
        crypto::fill_random(&mut nonce);
        let aead = LessSafeKey::new(
            UnboundKey::new(&AES_256_GCM, self.key.as_slice()).map_err(|_| "AES key")?,
        );
        // Room for the tag up front: sealing must not reallocate (and free unwiped) the clear JSON.
        let mut buf = Zeroizing::new(Vec::with_capacity(clear.len() + AES_256_GCM.tag_len()));
        buf.extend_from_slice(clear);
        aead.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(AAD),
            &mut *buf,
        )
        .map_err(|_| "sealing failed")?;
        if let Some(blob) = &self.tpm {
            let f = TpmSealedFile {
                version: 1,
                tpm_private: crypto::b64(&blob.private),
                tpm_public: crypto::b64(&blob.public),
                pcrs: blob.pcrs.clone(),
                unseal_policy: blob.policy,
                srk_name: blob.srk_name.as_deref().map(crypto::b64),
                nonce: crypto::b64(&nonce),
                ciphertext: crypto::b64(&buf),
            };
            return Ok(Zeroizing::new(
                serde_json::to_vec_pretty(&f).expect("serializes"),
            ));
        }
        let f = SealedFile {
            version: 1,
            kdf: "argon2id".into(),
            m_kib: self.m_kib,
            t: self.t,
            p: self.p,
            salt: crypto::b64(&self.salt),
            nonce: crypto::b64(&nonce),
            ciphertext: crypto::b64(&buf),
        };
        Ok(Zeroizing::new(
            serde_json::to_vec_pretty(&f).expect("serializes"),
        ))
    }
}

/// Where the bundle rests and how to read and write it again while serving.
pub struct Vault {
    state_dir: PathBuf,
    protection: KeyProtection,
    kek: Option<Kek>,
}

impl Vault {
    /// Unseals the bundle and keeps what is needed to seal it again.
    pub fn open(
        state_dir: &Path,
        p: KeyProtection,
        passphrase: Option<&[u8]>,
    ) -> Result<(Vault, KeyBundle), String> {
        Self::open_with_tpm(state_dir, p, passphrase, None)
    }

    /// [`Self::open`] with the TPM named (`bca serve --tpm`), not the one in `config.toml`.
    pub fn open_with_tpm(
        state_dir: &Path,
        p: KeyProtection,
        passphrase: Option<&[u8]>,
        tcti: Option<&crate::tpm::Tcti>,
    ) -> Result<(Vault, KeyBundle), String> {
        let (bundle, kek) = unseal_inner(state_dir, p, passphrase, tcti)?;
        Ok((
            Vault {
                state_dir: state_dir.to_path_buf(),
                protection: p,
                kek,
            },
            bundle,
        ))
    }

    /// Reads the bundle from disk again.
    pub fn load(&self) -> Result<KeyBundle, String> {
        let path = file_for(&self.state_dir, self.protection);
        let raw = Zeroizing::new(
            std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?,
        );
        match (&self.kek, self.protection) {
            (_, KeyProtection::File) => KeyBundle::from_json(&raw),
            (Some(k), KeyProtection::Passphrase) => {
                let f: SealedFile = serde_json::from_slice(&raw)
                    .map_err(|e| format!("{} is damaged: {e}", path.display()))?;
                open_ciphertext(&f.nonce, &f.ciphertext, &k.key)
            }
            (Some(k), KeyProtection::Tpm) => {
                let f: TpmSealedFile = serde_json::from_slice(&raw)
                    .map_err(|e| format!("{} is damaged: {e}", path.display()))?;
                open_ciphertext(&f.nonce, &f.ciphertext, &k.key)
            }
            _ => Err("the key vault cannot read its protection".into()),
        }
    }

    /// Replaces the bundle on disk, atomically (a crash leaves the old or the new file).
    pub fn store(&self, bundle: &KeyBundle) -> Result<(), String> {
        let bytes = match (&self.kek, self.protection) {
            (_, KeyProtection::File) => bundle.to_json(),
            (Some(k), KeyProtection::Passphrase) => k.seal(bundle)?,
            (Some(k), KeyProtection::Tpm) => {
                tracing::warn!(
                    "keys: the key bundle changed; an escrow copy made before is out of date: \
                     make a new one with `bca tpm escrow --out FILE`"
                );
                k.seal(bundle)?
            }
            _ => return Err("the key vault cannot write its protection".into()),
        };
        crate::base::fsutil::write_atomic(
            &file_for(&self.state_dir, self.protection),
            &bytes,
            0o600,
        )
    }
}

/// Writes the bundle under the given protection. `passphrase` is required for `Passphrase`.
pub fn seal(
    state_dir: &Path,
    bundle: &KeyBundle,
    p: KeyProtection,
    passphrase: Option<&[u8]>,
) -> Result<(), String> {
    let dir = keys_dir(state_dir);
    crate::base::fsutil::create_private_dir(&dir)?;
    let bytes: Zeroizing<Vec<u8>> = match p {
        KeyProtection::File => bundle.to_json(),
        KeyProtection::Passphrase => {
            Kek::new(passphrase.ok_or("a passphrase is required")?)?.seal(bundle)?
        }
        KeyProtection::Tpm => return Err("sealing to a TPM needs the TPM: seal_to_tpm".into()),
    };
    crate::base::fsutil::write_new_private(&file_for(state_dir, p), &bytes)
}

/// Writes the bundle sealed to the TPM at `tcti` (`keys/keys.tpm`), bound to `pcrs` when any.
pub fn seal_to_tpm(
    state_dir: &Path,
    bundle: &KeyBundle,
    tcti: &crate::tpm::Tcti,
    pcrs: &[u32],
) -> Result<(), String> {
    let dir = keys_dir(state_dir);
    crate::base::fsutil::create_private_dir(&dir)?;
    let bytes = Kek::new_tpm(tcti, pcrs)?.seal(bundle)?;
    crate::base::fsutil::write_new_private(&file_for(state_dir, KeyProtection::Tpm), &bytes)
}

/// The PCRs the state directory's TPM-sealed keys are bound to (none when not bound).
pub fn sealed_pcrs(state_dir: &Path) -> Result<Vec<u32>, String> {
    let path = file_for(state_dir, KeyProtection::Tpm);
    let raw = std::fs::read(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let f: TpmSealedFile =
        serde_json::from_slice(&raw).map_err(|e| format!("{} is damaged: {e}", path.display()))?;
    Ok(f.pcrs)
}

/// `bca tpm reseal --escrow FILE [--tpm-pcrs LIST]`: the keys sealed again to the TPM, to the
/// PCRs' values of now (after a firmware update moved them), from the escrow copy: a new
/// key-encryption key, a new sealed object, `keys/keys.tpm` replaced in one rename. The escrow
/// must open with its passphrase and hold the keys the public PKI names; `pcrs` `None` keeps
/// the PCRs the keys were bound to. Returns the PCRs now bound.
pub fn reseal_from_escrow(
    state_dir: &Path,
    escrow: &Path,
    passphrase: &[u8],
    tcti: Option<&crate::tpm::Tcti>,
    pcrs: Option<Vec<u32>>,
) -> Result<Vec<u32>, String> {
    let config = tpm_sealed_config(state_dir, "reseal")?;
    let pcrs = match pcrs {
        Some(p) => p,
        None => sealed_pcrs(state_dir)?,
    };
    let (bundle, _) = open_escrow(state_dir, escrow, passphrase)?;
    let named = tcti.cloned();
    let tcti = match tcti {
        Some(t) => t.clone(),
        None => configured_tpm(state_dir)?,
    };
    let bytes = Kek::new_tpm(&tcti, &pcrs)?.seal(&bundle)?;
    crate::base::fsutil::write_atomic(&file_for(state_dir, KeyProtection::Tpm), &bytes, 0o600)?;
    // Sealed to another TPM than config.toml named: config.toml names it from now on (a crash
    // between the two writes leaves keys that `serve --tpm` opens).
    if let Some(t) = named.filter(|t| config.tpm.as_deref() != Some(t.to_string().as_str())) {
        let mut config = config;
        config.tpm = Some(t.to_string());
        crate::base::fsutil::write_atomic(
            &state_dir.join("config.toml"),
            config.to_file_text()?.as_bytes(),
            0o600,
        )?;
    }
    Ok(pcrs)
}

/// An escrow copy's bundle and raw bytes, once it opened with `passphrase` and holds the keys
/// this appliance's public PKI names.
fn open_escrow(
    state_dir: &Path,
    escrow: &Path,
    passphrase: &[u8],
) -> Result<(KeyBundle, Zeroizing<Vec<u8>>), String> {
    let raw = Zeroizing::new(
        std::fs::read(escrow).map_err(|e| format!("cannot read {}: {e}", escrow.display()))?,
    );
    let f: SealedFile = serde_json::from_slice(&raw).map_err(|e| {
        format!(
            "{} is not an escrow copy of bca's keys: {e}",
            escrow.display()
        )
    })?;
    let (clear, _) = Kek::open_passphrase(&f, passphrase, escrow)?;
    let bundle = KeyBundle::from_json(&clear)?;
    let pki = crate::pki::PublicPki::load(&crate::pki::pki_dir(state_dir))?;
    crate::pki::check_keys_against(&pki, &bundle).map_err(|e| {
        format!(
            "{} holds other keys than this appliance's now ({e}): another appliance's copy, or one \
             made before a key rotation (make a new one after each: bca tpm escrow)",
            escrow.display()
        )
    })?;
    Ok((bundle, raw))
}

/// Writes the bundle sealed under a passphrase to `path` (which must not exist): the escrow copy
/// of TPM-sealed keys, in the format of `keys/keys.sealed`.
pub fn write_escrow(path: &Path, bundle: &KeyBundle, passphrase: &[u8]) -> Result<(), String> {
    let bytes = Kek::new(passphrase)?.seal(bundle)?;
    crate::base::fsutil::write_new_private(path, &bytes)
}

/// `bca tpm recover --escrow FILE`: the state directory's keys taken from the escrow copy and
/// protected by its passphrase from now on, for when the TPM they were sealed to is gone. The
/// escrow must open with the passphrase and hold the keys the public PKI names; then
/// `keys/keys.sealed` is written, `config.toml` says `passphrase`, and `keys/keys.tpm` goes, in
/// that order (a crash in between leaves a directory `serve` still opens one way or the other).
pub fn recover_from_escrow(
    state_dir: &Path,
    escrow: &Path,
    passphrase: &[u8],
) -> Result<(), String> {
    let mut config = tpm_sealed_config(state_dir, "recover")?;
    let (_, raw) = open_escrow(state_dir, escrow, passphrase)?;
    let sealed = file_for(state_dir, KeyProtection::Passphrase);
    crate::base::fsutil::write_atomic(&sealed, &raw, 0o600)?;
    config.key_protection = KeyProtection::Passphrase;
    config.tpm = None;
    crate::base::fsutil::write_atomic(
        &state_dir.join("config.toml"),
        config.to_file_text()?.as_bytes(),
        0o600,
    )?;
    let _ = std::fs::remove_file(file_for(state_dir, KeyProtection::Tpm));
    Ok(())
}

/// `config.toml` of a state directory whose keys are sealed to a TPM; else an error saying there
/// is nothing to `what`.
fn tpm_sealed_config(state_dir: &Path, what: &str) -> Result<crate::config::Config, String> {
    let config = crate::config::Config::load(state_dir)?;
    if config.key_protection != KeyProtection::Tpm {
        return Err(format!(
            "{}'s keys are not sealed to a TPM (key_protection = {:?}): nothing to {what}",
            state_dir.display(),
            config.key_protection
        ));
    }
    Ok(config)
}

/// The TPM the state directory's keys are sealed to: `config.toml`'s `tpm`, else the default.
fn configured_tpm(state_dir: &Path) -> Result<crate::tpm::Tcti, String> {
    let cfg = crate::config::Config::load(state_dir)?;
    cfg.tpm
        .as_deref()
        .unwrap_or(crate::tpm::DEFAULT_TCTI)
        .parse()
}

pub fn tpm_not_available() -> String {
    "a backup of keys sealed to a TPM is not available in this version of bca: the sealed blob \
     opens only on this box's TPM; the escrow copy (bca init --escrow) is the keys' backup"
        .into()
}

/// Reads the bundle back. A wrong passphrase is an error that names it; nothing is changed.
pub fn unseal(
    state_dir: &Path,
    p: KeyProtection,
    passphrase: Option<&[u8]>,
) -> Result<KeyBundle, String> {
    unseal_inner(state_dir, p, passphrase, None).map(|(b, _)| b)
}

fn open_ciphertext(nonce: &str, ciphertext: &str, key: &[u8; 32]) -> Result<KeyBundle, String> {
    KeyBundle::from_json(&open_raw(nonce, ciphertext, key)?)
}

/// Opens AES-256-GCM `ciphertext` (base64) under `key`: the clear JSON, wiped when dropped.
fn open_raw(nonce: &str, ciphertext: &str, key: &[u8; 32]) -> Result<Zeroizing<Vec<u8>>, String> {
    let nonce: [u8; 12] = crypto::b64_decode(nonce)
        .and_then(|n| n.try_into().ok())
        .ok_or("damaged nonce")?;
    let mut ct = Zeroizing::new(crypto::b64_decode(ciphertext).ok_or("damaged ciphertext")?);
    let aead =
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, key.as_slice()).map_err(|_| "AES key")?);
    let plain = aead
        .open_in_place(Nonce::assume_unique_for_key(nonce), Aad::from(AAD), &mut ct)
        .map_err(|_| {
            "wrong passphrase: the appliance's keys could not be unsealed (nothing was changed)"
                .to_string()
        })?;
    Ok(Zeroizing::new(plain.to_vec()))
}

fn unseal_inner(
    state_dir: &Path,
    p: KeyProtection,
    passphrase: Option<&[u8]>,
    tcti: Option<&crate::tpm::Tcti>,
) -> Result<(KeyBundle, Option<Kek>), String> {
    let (clear, kek) = unseal_path(state_dir, &file_for(state_dir, p), p, passphrase, tcti)?;
    Ok((KeyBundle::from_json(&clear)?, kek))
}

/// Opens the sealed file at `path` (the bundle, or an appliance's own keys): its clear JSON and
/// the key that seals it again.
fn unseal_path(
    state_dir: &Path,
    path: &Path,
    p: KeyProtection,
    passphrase: Option<&[u8]>,
    tcti: Option<&crate::tpm::Tcti>,
) -> Result<(Zeroizing<Vec<u8>>, Option<Kek>), String> {
    let raw = Zeroizing::new(
        std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?,
    );
    match p {
        KeyProtection::File => Ok((raw, None)),
        KeyProtection::Passphrase => {
            let pass = passphrase
                .ok_or("a passphrase is required (set BCA_SECRET or run on a terminal)")?;
            let f: SealedFile = serde_json::from_slice(&raw)
                .map_err(|e| format!("{} is damaged: {e}", path.display()))?;
            Kek::open_passphrase(&f, pass, path).map(|(b, k)| (b, Some(k)))
        }
        KeyProtection::Tpm => {
            let tcti = match tcti {
                Some(t) => t.clone(),
                None => configured_tpm(state_dir)?,
            };
            let f: TpmSealedFile = serde_json::from_slice(&raw)
                .map_err(|e| format!("{} is damaged: {e}", path.display()))?;
            if f.version != 1 {
                return Err(format!(
                    "{} is of version {}, which this bca does not read",
                    path.display(),
                    f.version
                ));
            }
            let blob = crate::tpm::SealedBlob {
                private: crypto::b64_decode(&f.tpm_private).ok_or("damaged TPM blob")?,
                public: crypto::b64_decode(&f.tpm_public).ok_or("damaged TPM blob")?,
                pcrs: f.pcrs.clone(),
                policy: f.unseal_policy,
                srk_name: match &f.srk_name {
                    Some(h) => Some(crypto::b64_decode(h).ok_or("damaged TPM blob")?),
                    None => None,
                },
            };
            let secret = crate::tpm::Tpm::open(&tcti)
                .and_then(|mut t| t.unseal(&blob))
                .map_err(|e| {
                    if e.to_string().contains("TPM_RC_POLICY_FAIL") {
                        return format!(
                            "the appliance's keys could not be unsealed by the TPM at {tcti} ({e}). \
                             They are bound to PCRs {:?} of the SHA-256 bank, whose values changed \
                             since they were sealed (a firmware, bootloader or Secure Boot change). \
                             Nothing was changed; seal them to the PCRs of now with `bca tpm reseal \
                             --escrow FILE` (docs/tpm.md)",
                            f.pcrs
                        );
                    }
                    format!(
                        "the appliance's keys could not be unsealed by the TPM at {tcti} ({e}). \
                         They are sealed to the TPM that `bca init` used: another TPM, a cleared \
                         one, or a TPM that is not reachable cannot open them. Nothing was \
                         changed; name the right TPM with --tpm, or recover the state directory \
                         from a backup (docs/tpm.md)"
                    )
                })?;
            let key: Zeroizing<[u8; 32]> = Zeroizing::new(
                secret
                    .as_slice()
                    .try_into()
                    .map_err(|_| "the TPM returned a key of the wrong size")?,
            );
            let clear = open_raw(&f.nonce, &f.ciphertext, &key).map_err(|_| {
                format!(
                    "{} is damaged: it does not open with its TPM's key",
                    path.display()
                )
            })?;
            Ok((clear, Some(Kek::held_by_tpm(blob, key))))
        }
    }
}

fn derive(
    pass: &[u8],
    salt: &[u8],
    m_kib: u32,
    t: u32,
    p: u32,
) -> Result<Zeroizing<[u8; 32]>, String> {
    let params = argon2::Params::new(m_kib, t, p, Some(32))
        .map_err(|e| format!("argon2 parameters: {e}"))?;
    let a = argon2::Argon2::new(argon2::Algorithm::Argon2id, argon2::Version::V0x13, params);
    let mut out = Zeroizing::new([0u8; 32]);
    a.hash_password_into(pass, salt, out.as_mut())
        .map_err(|e| format!("argon2: {e}"))?;
    Ok(out)
}

/// The passphrase from a systemd credential (`$CREDENTIALS_DIRECTORY/bca-passphrase`, as
/// `LoadCredential=bca-passphrase:…` provides), else `BCA_SECRET` (removed from the environment
/// once read, so that it is not inherited or left in `/proc/<pid>/environ`), else a prompt on the
/// terminal (twice when `confirm`).
pub fn passphrase_from_env_or_prompt(confirm: bool) -> Result<Zeroizing<String>, String> {
    if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY") {
        let p = Path::new(&dir).join("bca-passphrase");
        if p.exists() {
            let s = Zeroizing::new(
                std::fs::read_to_string(&p)
                    .map_err(|e| format!("cannot read the credential {}: {e}", p.display()))?,
            );
            let s = Zeroizing::new(s.trim_end_matches(['\n', '\r']).to_string());
            if s.is_empty() {
                return Err(format!("the credential {} is empty", p.display()));
            }
            return Ok(s);
        }
    }
    if let Ok(s) = std::env::var("BCA_SECRET") {
        std::env::remove_var("BCA_SECRET");
        if s.is_empty() {
            return Err("BCA_SECRET is empty".into());
        }
        return Ok(Zeroizing::new(s));
    }
    let a = Zeroizing::new(
        rpassword::prompt_password("bca passphrase: ")
            .map_err(|e| format!("no passphrase: set BCA_SECRET or run on a terminal ({e})"))?,
    );
    if a.len() < 12 {
        return Err("the passphrase must be at least 12 characters".into());
    }
    if confirm {
        let b = Zeroizing::new(rpassword::prompt_password("again: ").map_err(|e| e.to_string())?);
        if *a != *b {
            return Err("the two passphrases differ".into());
        }
    }
    Ok(a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passphrase_seal_round_trips_and_refuses_a_wrong_passphrase() {
        let dir = tempfile::tempdir().unwrap();
        let b = KeyBundle::generate();
        seal(
            dir.path(),
            &b,
            KeyProtection::Passphrase,
            Some(b"correct horse battery"),
        )
        .unwrap();
        let back = unseal(
            dir.path(),
            KeyProtection::Passphrase,
            Some(b"correct horse battery"),
        )
        .unwrap();
        assert_eq!(
            back.join_signing.public_point(),
            b.join_signing.public_point()
        );
        let e = unseal(
            dir.path(),
            KeyProtection::Passphrase,
            Some(b"wrong horse battery"),
        )
        .err()
        .unwrap();
        assert!(e.contains("wrong passphrase"), "{e}");
        let raw = std::fs::read_to_string(dir.path().join("keys/keys.sealed")).unwrap();
        assert!(!raw.contains(&crypto::b64(b.node_ca.pkcs8())));
    }
}

/// A joined appliance's own keys (`bca join-site`): the key the site's keys are wrapped to, and
/// its gateway's TLS key. They rest in `keys/appliance.*` under the appliance's own protection,
/// as the bundle does.
pub struct OwnKeys {
    pub wrap: crypto::SigningKey,
    pub gateway: crypto::SigningKey,
}

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct OwnFile {
    version: u32,
    wrap: String,
    gateway: String,
}

impl OwnKeys {
    pub fn generate() -> Self {
        Self {
            wrap: crypto::SigningKey::generate(),
            gateway: crypto::SigningKey::generate(),
        }
    }

    fn to_json(&self) -> Zeroizing<Vec<u8>> {
        let f = OwnFile {
            version: 1,
            wrap: crypto::b64(self.wrap.pkcs8()),
            gateway: crypto::b64(self.gateway.pkcs8()),
        };
        let mut out = Zeroizing::new(Vec::with_capacity(4096));
        serde_json::to_writer_pretty(&mut *out, &f).expect("serializes");
        drop(Zeroizing::new(f.wrap));
        drop(Zeroizing::new(f.gateway));
        out
    }

    fn from_json(bytes: &[u8]) -> Result<Self, String> {
        let f: OwnFile = serde_json::from_slice(bytes)
            .map_err(|e| format!("the appliance's own key file is damaged: {e}"))?;
        if f.version != 1 {
            return Err(format!(
                "the appliance's own key file has version {}, this bca reads version 1",
                f.version
            ));
        }
        let one = |name: &str, s: &str| -> Result<crypto::SigningKey, String> {
            let der = Zeroizing::new(
                crypto::b64_decode(s).ok_or_else(|| format!("the {name} key is not base64"))?,
            );
            crypto::SigningKey::from_pkcs8(&der).map_err(|e| format!("the {name} key: {e}"))
        };
        let k = Self {
            wrap: one("wrapping", &f.wrap)?,
            gateway: one("gateway", &f.gateway)?,
        };
        drop(Zeroizing::new(f.wrap));
        drop(Zeroizing::new(f.gateway));
        Ok(k)
    }
}

fn own_file_for(state_dir: &Path, p: KeyProtection) -> PathBuf {
    keys_dir(state_dir).join(match p {
        KeyProtection::File => "appliance.json",
        KeyProtection::Passphrase => "appliance.sealed",
        KeyProtection::Tpm => "appliance.tpm",
    })
}

/// Whether the state directory is a joined appliance's whose site keys it has not received yet:
/// its own keys rest there, the bundle not.
pub fn awaits_site_keys(state_dir: &Path, p: KeyProtection) -> bool {
    own_file_for(state_dir, p).exists() && !file_for(state_dir, p).exists()
}

/// Writes a joined appliance's own keys under `p` (`passphrase` for `Passphrase`; the TPM at
/// `tcti`, bound to `pcrs`, for `Tpm`).
pub fn seal_own(
    state_dir: &Path,
    own: &OwnKeys,
    p: KeyProtection,
    passphrase: Option<&[u8]>,
    tpm: Option<(&crate::tpm::Tcti, &[u32])>,
) -> Result<(), String> {
    crate::base::fsutil::create_private_dir(&keys_dir(state_dir))?;
    let clear = own.to_json();
    let bytes = match p {
        KeyProtection::File => clear,
        KeyProtection::Passphrase => {
            Kek::new(passphrase.ok_or("a passphrase is required")?)?.seal_bytes(&clear)?
        }
        KeyProtection::Tpm => {
            let (tcti, pcrs) = tpm.ok_or("sealing to a TPM needs the TPM")?;
            Kek::new_tpm(tcti, pcrs)?.seal_bytes(&clear)?
        }
    };
    crate::base::fsutil::write_new_private(&own_file_for(state_dir, p), &bytes)
}

/// A joined appliance's own keys, opened, and what seals its bundle under the same protection
/// once the site's keys are given to it.
pub struct OwnVault {
    state_dir: PathBuf,
    protection: KeyProtection,
    kek: Option<Kek>,
}

pub fn open_own(
    state_dir: &Path,
    p: KeyProtection,
    passphrase: Option<&[u8]>,
    tcti: Option<&crate::tpm::Tcti>,
) -> Result<(OwnKeys, OwnVault), String> {
    let (clear, kek) = unseal_path(state_dir, &own_file_for(state_dir, p), p, passphrase, tcti)?;
    Ok((
        OwnKeys::from_json(&clear)?,
        OwnVault {
            state_dir: state_dir.to_path_buf(),
            protection: p,
            kek,
        },
    ))
}

impl OwnVault {
    /// Writes the appliance's bundle (the site's keys with its own gateway key) where `serve`
    /// reads it, sealed as its own keys are: the commit point of taking the site's keys.
    pub fn store_bundle(&self, bundle: &KeyBundle) -> Result<(), String> {
        let bytes = match (&self.kek, self.protection) {
            (_, KeyProtection::File) => bundle.to_json(),
            (Some(k), _) => k.seal(bundle)?,
            (None, _) => return Err("the key vault cannot write its protection".into()),
        };
        crate::base::fsutil::write_atomic(
            &file_for(&self.state_dir, self.protection),
            &bytes,
            0o600,
        )
    }
}
