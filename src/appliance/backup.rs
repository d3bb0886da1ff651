//! `bca backup FILE` and `bca restore FILE`.
//!
//! A backup is a newc cpio archive (GNU cpio lists and unpacks it) holding `manifest.json` (format
//! version, site, time, key protection, and the SHA-256 of every other member), `bca.db` (a
//! consistent copy taken with SQLite's online backup while the server keeps serving),
//! `config.toml`, `pki/*` (public), `downloads/**` (the agent binaries the database lists) and the
//! keys **as they are protected on disk**: `keys/keys.sealed` (passphrase) as is. A key in clear
//! never enters a backup: with `key_protection = "file"` the keys are sealed under a passphrase
//! (`BCA_SECRET` or a prompt) for the backup, and the restored box uses `passphrase`. Keys sealed
//! to a TPM are useless on another box: such a backup carries the escrow copy when one was made
//! at init, and says so otherwise (README: operations). Boot files (`boot/`) are rebuilt by
//! `make image` and are not in the backup.
//!
//! Restore unpacks into a state directory that does not exist or is empty, checking every
//! member's hash and the database's `integrity_check` first; on any failure nothing is left.

use crate::base::cpio::{self, Cpio};
use crate::base::crypto;
use crate::base::error::{ApiError, ApiResult};
use crate::config::{Config, KeyProtection};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

pub const FORMAT: u32 = 1;

#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Manifest {
    pub format: u32,
    pub bca_version: String,
    pub site_id: String,
    pub site_name: String,
    pub created_at: String,
    pub key_protection: KeyProtection,
    /// Member name -> hex SHA-256.
    pub files: BTreeMap<String, String>,
}

fn collect(dir: &Path, prefix: &str, out: &mut Vec<(String, Vec<u8>)>) -> Result<(), String> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    let mut entries: Vec<_> = rd.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let name = format!("{prefix}/{}", e.file_name().to_string_lossy());
        let p = e.path();
        let m = std::fs::symlink_metadata(&p).map_err(|e| e.to_string())?;
        if m.is_dir() {
            collect(&p, &name, out)?;
        } else if m.is_file() {
            out.push((
                name,
                std::fs::read(&p).map_err(|e| format!("cannot read {}: {e}", p.display()))?,
            ));
        }
    }
    Ok(())
}

/// A consistent copy of the live database, taken page by page while the server writes.
/// The temporary copy lives beside the backup file (never in the state directory, where an
/// interrupted run would leave a stale copy of the database), 0600, removed on every exit.
fn copy_db(
    db: &Path,
    scratch: &Path,
    progress: &mut crate::base::progress::Progress,
) -> Result<Vec<u8>, String> {
    let tmp = tempfile::Builder::new()
        .prefix(".bca-backup-")
        .tempfile_in(scratch)
        .map_err(|e| {
            format!(
                "cannot create a temporary file in {}: {e}",
                scratch.display()
            )
        })?;
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o600))
        .map_err(|e| e.to_string())?;
    crate::store::maintenance::copy_online(db, tmp.path(), progress)?;
    std::fs::read(tmp.path()).map_err(|e| e.to_string())
}

/// Writes the backup of `state_dir` to `out` (a new 0600 file).
pub fn backup(state_dir: &Path, out: &Path) -> ApiResult<Manifest> {
    if std::fs::symlink_metadata(out).is_ok() {
        return Err(ApiError::already_exists(format!(
            "{} exists; a backup never writes over a file",
            out.display()
        )));
    }
    let config = Config::load(state_dir).map_err(ApiError::invalid_config)?;
    let mut members: Vec<(String, Vec<u8>)> = Vec::new();
    let keys_dir = crate::keys::keys_dir(state_dir);
    let protection = match config.key_protection {
        KeyProtection::Passphrase => {
            let f = keys_dir.join("keys.sealed");
            members.push((
                "keys/keys.sealed".into(),
                std::fs::read(&f).map_err(|e| {
                    ApiError::invalid_state(format!("cannot read {}: {e}", f.display()))
                })?,
            ));
            KeyProtection::Passphrase
        }
        KeyProtection::File => {
            // Never a key in clear: seal them for the backup.
            eprintln!("key_protection is \"file\": the backup seals the keys under a passphrase");
            let pass = crate::keys::passphrase_from_env_or_prompt(true)
                .map_err(ApiError::invalid_input)?;
            let bundle = crate::keys::unseal(state_dir, KeyProtection::File, None)
                .map_err(ApiError::invalid_state)?;
            let tmp = tempfile::tempdir().map_err(ApiError::internal)?;
            crate::keys::seal(
                tmp.path(),
                &bundle,
                KeyProtection::Passphrase,
                Some(pass.as_bytes()),
            )
            .map_err(ApiError::internal)?;
            let sealed = std::fs::read(crate::keys::keys_dir(tmp.path()).join("keys.sealed"))
                .map_err(ApiError::internal)?;
            members.push(("keys/keys.sealed".into(), sealed));
            KeyProtection::Passphrase
        }
        KeyProtection::Tpm => {
            return Err(ApiError::invalid_state(crate::keys::tpm_not_available()))
        }
    };
    let mut cfg = config.clone();
    cfg.key_protection = protection;
    members.push((
        "config.toml".into(),
        toml::to_string_pretty(&cfg)
            .map_err(ApiError::internal)?
            .into_bytes(),
    ));
    // Which appliance of the site this box is (a restored box is the same appliance).
    if let Ok(id) = std::fs::read(state_dir.join("appliance.id")) {
        members.push(("appliance.id".into(), id));
    }
    let mut public = Vec::new();
    collect(&crate::pki::pki_dir(state_dir), "pki", &mut public).map_err(ApiError::internal)?;
    collect(&state_dir.join("downloads"), "downloads", &mut public).map_err(ApiError::internal)?;
    members.extend(public);
    if !config.store.is_embedded() {
        // The site's rows live in PostgreSQL: its own tools back them up, consistently and
        // while it serves. The rest of the box (config, keys, PKI) is in this file.
        eprintln!(
            "the store is PostgreSQL ({}): back its database up with PostgreSQL's own tools (pg_dump, or base backups with WAL archiving); this backup holds the rest of the box",
            config.store.url.as_deref().unwrap_or_default()
        );
        return finish(out, &config, protection, members);
    }
    let db = state_dir.join("bca.db");
    let pages = crate::store::maintenance::page_count(&db).map_err(ApiError::invalid_state)?;
    let mut progress = crate::base::progress::Progress::new("copying the database (pages)", pages);
    let scratch = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let db_bytes = copy_db(&db, scratch, &mut progress).map_err(ApiError::invalid_state)?;
    progress.set(pages);
    crate::base::fsutil::align_db_sidecars(&db);
    members.push(("bca.db".into(), db_bytes));
    finish(out, &config, protection, members)
}

/// The manifest, then the archive written (0600, never over a file).
fn finish(
    out: &Path,
    config: &Config,
    protection: KeyProtection,
    members: Vec<(String, Vec<u8>)>,
) -> ApiResult<Manifest> {
    let manifest = Manifest {
        format: FORMAT,
        bca_version: env!("CARGO_PKG_VERSION").into(),
        site_id: config.site_id.clone(),
        site_name: config.site_name.clone(),
        created_at: crate::base::clock::rfc3339(crate::base::clock::now()),
        key_protection: protection,
        files: members
            .iter()
            .map(|(n, d)| (n.clone(), crypto::hex(&crypto::sha256(d))))
            .collect(),
    };
    let mut c = Cpio::new();
    c.file(
        "manifest.json",
        0o600,
        &serde_json::to_vec_pretty(&manifest).map_err(ApiError::internal)?,
    );
    for (name, data) in &members {
        c.file(name, 0o600, data);
    }
    crate::base::fsutil::write_new_private(out, &c.finish()).map_err(ApiError::invalid_input)?;
    Ok(manifest)
}

/// Checks a backup archive and returns its manifest and members (hashes verified).
pub fn open(file: &Path) -> ApiResult<(Manifest, Vec<cpio::Entry>)> {
    let raw = std::fs::read(file)
        .map_err(|e| ApiError::invalid_input(format!("cannot read {}: {e}", file.display())))?;
    let bad = |m: String| {
        ApiError::invalid_input(format!(
            "{} is not a usable bca backup: {m}",
            file.display()
        ))
    };
    let mut entries = cpio::read(&raw).map_err(bad)?;
    if entries.first().map(|e| e.name.as_str()) != Some("manifest.json") {
        return Err(bad("it does not start with manifest.json".into()));
    }
    let m: Manifest = serde_json::from_slice(&entries.remove(0).data)
        .map_err(|e| bad(format!("manifest.json: {e}")))?;
    if m.format != FORMAT {
        return Err(bad(format!(
            "format {} (this bca reads {FORMAT})",
            m.format
        )));
    }
    let mut names: Vec<&str> = Vec::new();
    for e in &entries {
        let safe = !e.name.is_empty()
            && !e.name.starts_with('/')
            && e.name
                .split('/')
                .all(|p| !p.is_empty() && p != "." && p != "..");
        if !safe {
            return Err(bad(format!(
                "member name {:?} leaves the state directory",
                e.name
            )));
        }
        if names.contains(&e.name.as_str()) {
            return Err(bad(format!("{} appears twice", e.name)));
        }
        match m.files.get(&e.name) {
            Some(h) if *h == crypto::hex(&crypto::sha256(&e.data)) => {}
            Some(_) => {
                return Err(bad(format!(
                    "{} does not match its SHA-256 in the manifest (damaged)",
                    e.name
                )))
            }
            None => return Err(bad(format!("{} is not in the manifest", e.name))),
        }
        names.push(&e.name);
    }
    for need in m.files.keys() {
        if !names.contains(&need.as_str()) {
            return Err(bad(format!("{need} is missing")));
        }
    }
    // A site on PostgreSQL has no database file here (its database has its own backups).
    let on_postgres = entries
        .iter()
        .find(|e| e.name == "config.toml")
        .and_then(|e| std::str::from_utf8(&e.data).ok())
        .and_then(|t| toml::from_str::<Config>(t).ok())
        .is_some_and(|c| !c.store.is_embedded());
    for need in ["bca.db", "config.toml", "keys/keys.sealed"] {
        if need == "bca.db" && on_postgres {
            continue;
        }
        if !m.files.contains_key(need) {
            return Err(bad(format!("{need} is missing")));
        }
    }
    Ok((m, entries))
}

/// Restores `file` into `state_dir` (absent or empty). Nothing is left behind on failure.
pub fn restore(file: &Path, state_dir: &Path) -> ApiResult<Manifest> {
    let (m, entries) = open(file)?;
    let existed = state_dir.exists();
    if existed
        && std::fs::read_dir(state_dir)
            .map_err(|e| ApiError::invalid_input(format!("{}: {e}", state_dir.display())))?
            .next()
            .is_some()
    {
        return Err(ApiError::already_exists(format!(
            "{} is not empty; restore only into a new or empty state directory",
            state_dir.display()
        )));
    }
    // Unpack beside the target, check, then rename into place.
    let parent = state_dir
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent)
        .map_err(|e| ApiError::invalid_input(format!("{}: {e}", parent.display())))?;
    let staging = tempfile::Builder::new()
        .prefix(".bca-restore-")
        .tempdir_in(parent)
        .map_err(|e| {
            ApiError::invalid_input(format!(
                "cannot create a directory in {}: {e}",
                parent.display()
            ))
        })?;
    std::fs::set_permissions(staging.path(), std::fs::Permissions::from_mode(0o700))
        .map_err(ApiError::internal)?;
    let mut progress =
        crate::base::progress::Progress::new("restoring files", entries.len() as u64);
    for e in &entries {
        let p: PathBuf = staging.path().join(&e.name);
        if let Some(dir) = p.parent() {
            std::fs::create_dir_all(dir).map_err(ApiError::internal)?;
            let public = e.name.starts_with("pki/") || e.name.starts_with("downloads/");
            std::fs::set_permissions(
                dir,
                std::fs::Permissions::from_mode(if public { 0o755 } else { 0o700 }),
            )
            .map_err(ApiError::internal)?;
        }
        let mode = if e.name.starts_with("pki/") {
            0o644
        } else {
            0o600
        };
        crate::base::fsutil::write_new(&p, &e.data, mode).map_err(ApiError::internal)?;
        progress.inc();
    }
    let db = staging.path().join("bca.db");
    let check = if db.exists() {
        crate::store::maintenance::restore_check(&db).map_err(|e| {
            ApiError::invalid_input(format!("the backup's database does not open: {e}"))
        })?
    } else {
        "ok".to_string()
    };
    if check != "ok" {
        return Err(ApiError::invalid_input(format!(
            "the backup's database fails integrity_check: {check}"
        )));
    }
    // The config and the public PKI must load as `serve` will load them.
    let restored = Config::load(staging.path()).map_err(ApiError::invalid_config)?;
    if let Some(url) = &restored.store.url {
        eprintln!(
            "this backup's config.toml names the PostgreSQL database {url}: one appliance serves it at a time (a second bca serve on it is refused); point [store] elsewhere for a copy of the site"
        );
    }
    crate::pki::PublicPki::load(&crate::pki::pki_dir(staging.path()))
        .map_err(ApiError::invalid_input)?;
    if existed {
        std::fs::remove_dir(state_dir)
            .map_err(|e| ApiError::invalid_input(format!("{}: {e}", state_dir.display())))?;
    }
    let kept = staging.keep();
    std::fs::rename(&kept, state_dir).map_err(|e| {
        let _ = std::fs::remove_dir_all(&kept);
        ApiError::invalid_input(format!(
            "cannot move the restored state into {}: {e}",
            state_dir.display()
        ))
    })?;
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn archive(members: &[(&str, &[u8])], manifest_names: &[&str]) -> Vec<u8> {
        let m = Manifest {
            format: FORMAT,
            bca_version: "0".into(),
            site_id: "site_x".into(),
            site_name: "x".into(),
            created_at: "2026-12-03T00:00:00Z".into(),
            key_protection: KeyProtection::Passphrase,
            files: manifest_names
                .iter()
                .map(|n| {
                    let d = members
                        .iter()
                        .find(|(m, _)| m == n)
                        .map(|(_, d)| *d)
                        .unwrap_or(b"");
                    (n.to_string(), crypto::hex(&crypto::sha256(d)))
                })
                .collect(),
        };
        let mut c = Cpio::new();
        c.file("manifest.json", 0o600, &serde_json::to_vec(&m).unwrap());
        for (n, d) in members {
            c.file(n, 0o600, d);
        }
        c.finish()
    }

    #[test]
    fn member_names_stay_inside_and_appear_once() {
        let dir = tempfile::tempdir().unwrap();
        let base: [(&str, &[u8]); 3] = [
            ("bca.db", b"db"),
            ("config.toml", b"c"),
            ("keys/keys.sealed", b"k"),
        ];
        let f = dir.path().join("b");
        for bad in ["../evil", "/etc/passwd", "pki/./x", "pki//x", "pki/../../x"] {
            let mut members = base.to_vec();
            members.push((bad, b"x"));
            let names: Vec<&str> = members.iter().map(|(n, _)| *n).collect();
            std::fs::write(&f, archive(&members, &names)).unwrap();
            let e = open(&f).err().expect(bad);
            assert!(
                e.message.contains("leaves the state directory"),
                "{bad}: {e}"
            );
        }
        let names: Vec<&str> = base.iter().map(|(n, _)| *n).collect();
        let mut members = base.to_vec();
        members.push(("config.toml", b"c"));
        std::fs::write(&f, archive(&members, &names)).unwrap();
        assert!(open(&f).err().unwrap().message.contains("appears twice"));
        // A member the manifest does not list, and a listed member that is missing.
        let mut members = base.to_vec();
        members.push(("extra", b"x"));
        std::fs::write(&f, archive(&members, &names)).unwrap();
        assert!(open(&f)
            .err()
            .unwrap()
            .message
            .contains("extra is not in the manifest"));
        let mut names2 = names.clone();
        names2.push("pki/node-ca.pem");
        std::fs::write(&f, archive(&base, &names2)).unwrap();
        assert!(open(&f)
            .err()
            .unwrap()
            .message
            .contains("pki/node-ca.pem is missing"));
        std::fs::write(&f, archive(&base, &names)).unwrap();
        assert!(open(&f).is_ok());
    }
}
