//! `bca doctor`: the appliance checked from its own box, one line per check
//! (`ok  `, `WARN` or `FAIL`), exit code 1 when any check fails.
//!
//! It reads the state directory directly (modes, config, keys, database) and asks the running
//! server, when there is one, for its health over the admin socket. It never changes anything:
//! the database is opened read-only.

use crate::config::{Config, KeyProtection};
use std::io::IsTerminal;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

#[derive(PartialEq, Eq, Clone, Copy)]
enum Level {
    Ok,
    Warn,
    Fail,
}

struct Report {
    failed: bool,
}

impl Report {
    fn line(&mut self, level: Level, what: &str, msg: impl std::fmt::Display) {
        let tag = match level {
            Level::Ok => "ok  ",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
        };
        println!("{tag} {what}: {msg}");
        self.failed |= level == Level::Fail;
    }
}

/// Files under `dir` whose mode lets anyone but the owner in. Exceptions: the admin socket may be
/// 0660 (an admin group), and `pki/`, `boot/` and `downloads/` hold only public files (certificates
/// and the JWK, boot files, agent binaries), readable by all
/// but writable by nobody else.
fn loose_files(dir: &Path, allow_group: &[&Path], public: bool, out: &mut Vec<String>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        // A link's own mode is always 0777 and says nothing; where it leads is checked apart
        // (`links_out`).
        if m.file_type().is_symlink() {
            continue;
        }
        let mode = m.permissions().mode() & 0o777;
        // Public by design: the certificates, the boot files and the agent downloads (the network
        // child, another user when `serve` runs as root, reads the last two).
        let public = public
            || (m.is_dir()
                && ["pki", "boot", "downloads"]
                    .iter()
                    .any(|d| e.file_name() == *d));
        let allowed = if public {
            0o055
        } else if allow_group.contains(&p.as_path()) {
            0o060
        } else {
            0
        };
        if mode & 0o077 & !allowed != 0 {
            out.push(format!("{} is {:04o}", p.display(), mode));
        }
        if m.is_dir() {
            loose_files(&p, allow_group, public, out);
        }
    }
}

pub fn run(state_dir: &Path, socket: Option<&Path>) -> bool {
    let mut r = Report { failed: false };
    match std::fs::metadata(state_dir) {
        // Root may check the service user's directory (the package's layout: bca:bca 0700).
        Ok(m)
            if m.permissions().mode() & 0o077 == 0
                && (m.uid() == crate::base::fsutil::own_uid()
                    || crate::base::fsutil::own_uid() == 0) =>
        {
            r.line(
                Level::Ok,
                "state directory",
                format!("{} is 0700, owner uid {}", state_dir.display(), m.uid()),
            )
        }
        Ok(m) => r.line(
            Level::Fail,
            "state directory",
            format!(
                "{} is {:04o}, owner uid {} (want 0700, owned by uid {})",
                state_dir.display(),
                m.permissions().mode() & 0o777,
                m.uid(),
                crate::base::fsutil::own_uid()
            ),
        ),
        Err(e) => {
            r.line(
                Level::Fail,
                "state directory",
                format!("{}: {e}", state_dir.display()),
            );
            return false;
        }
    }
    let config = match Config::load(state_dir) {
        Ok(c) => {
            r.line(
                Level::Ok,
                "config",
                format!(
                    "site {} ({}), keys {:?}",
                    c.site_name, c.site_id, c.key_protection
                )
                .to_lowercase(),
            );
            c
        }
        Err(e) => {
            r.line(Level::Fail, "config", e);
            return false;
        }
    };
    let socket_path = socket
        .map(Path::to_path_buf)
        .unwrap_or_else(|| config.admin_socket_path(state_dir));
    let mut loose = Vec::new();
    loose_files(state_dir, &[socket_path.as_path()], false, &mut loose);
    if loose.is_empty() {
        r.line(
            Level::Ok,
            "file modes",
            "nothing in the state directory is readable by others",
        );
    } else {
        r.line(Level::Fail, "file modes", loose.join(", "));
    }

    // A joined appliance waiting for an operator's approval holds no site keys yet.
    let awaiting = crate::keys::awaits_site_keys(state_dir, config.key_protection);
    if awaiting {
        let id = std::fs::read_to_string(state_dir.join("appliance.id")).unwrap_or_default();
        let id = id.trim();
        let state = crate::store::Store::inspect_at(state_dir, config.store.at()).and_then(|s| {
            s.read(|tx| crate::store::appliances::get(tx, id))
                .map_err(|e| e.to_string())
        });
        match state {
            Ok(Some(a)) if a.state == "pending" => r.line(
                Level::Warn,
                "site",
                format!(
                    "appliance {id} waits for an operator's approval (fingerprint {}): on an \
                     appliance of the site, run `bca site appliances approve {id}`",
                    a.fingerprint
                ),
            ),
            Ok(Some(a)) if a.state == "approved" => r.line(
                Level::Ok,
                "site",
                format!("appliance {id} is approved: bca serve takes the site's keys at its start"),
            ),
            Ok(Some(a)) => r.line(
                Level::Fail,
                "site",
                format!("appliance {id} is {}: it serves nothing", a.state),
            ),
            Ok(None) => r.line(
                Level::Fail,
                "site",
                format!("appliance {id} is not in the site's database: join the site again"),
            ),
            Err(e) => r.line(Level::Fail, "site", format!("the site's database: {e}")),
        }
    }

    // Keys: loadable, and the ones the certificates name.
    let pass = match config.key_protection {
        _ if awaiting => None,
        KeyProtection::Passphrase
            if std::env::var_os("BCA_SECRET").is_none() && !std::io::stdin().is_terminal() =>
        {
            r.line(
                Level::Warn,
                "keys",
                "not checked: set BCA_SECRET or run on a terminal to check the passphrase",
            );
            None
        }
        KeyProtection::Passphrase => match crate::keys::passphrase_from_env_or_prompt(false) {
            Ok(p) => Some(Some(p)),
            Err(e) => {
                r.line(Level::Fail, "keys", e);
                None
            }
        },
        KeyProtection::File => Some(None),
        KeyProtection::Tpm => Some(None),
    };
    if let Some(pass) = pass {
        let checked = crate::keys::unseal(
            state_dir,
            config.key_protection,
            pass.as_ref().map(|p| p.as_bytes()),
        )
        .and_then(|k| {
            let pki = crate::pki::PublicPki::load(&crate::pki::pki_dir(state_dir))?;
            crate::pki::check_keys_against(&pki, &k)?;
            Ok(pki)
        });
        match checked {
            Ok(pki) => {
                let warn = config.key_protection == KeyProtection::File;
                r.line(
                    if warn { Level::Warn } else { Level::Ok },
                    "keys",
                    if warn {
                        "loadable, and plain files (key_protection = \"file\"): for development only".to_string()
                    } else {
                        "unsealed and matching their certificates".to_string()
                    },
                );
                match crate::proto::x509::not_after(&pki.gateway) {
                    Some(t) if t - crate::base::clock::now() < 14 * 86_400 => r.line(
                        Level::Warn,
                        "gateway certificate",
                        format!(
                            "expires {}: rotate it (bca pki rotate gateway)",
                            crate::base::clock::rfc3339(t)
                        ),
                    ),
                    Some(t) => r.line(
                        Level::Ok,
                        "gateway certificate",
                        format!("valid until {}", crate::base::clock::rfc3339(t)),
                    ),
                    None => r.line(Level::Fail, "gateway certificate", "cannot be read"),
                }
            }
            Err(e) => r.line(Level::Fail, "keys", e),
        }
    }

    // The database, read-only.
    let db = state_dir.join("bca.db");
    let newest = if let Some(url) = config.store.url.clone() {
        // PostgreSQL: reachable, writable (not a standby), its schema, its standbys.
        match crate::store::Store::inspect_at(state_dir, config.store.at())
            .and_then(|s| crate::store::maintenance::pg_status(&s).map_err(|e| e.message))
        {
            Ok(st) => {
                let current = st.schema_version as usize == crate::store::PG_MIGRATIONS.len();
                r.line(
                    if !st.writable || !current {
                        Level::Fail
                    } else {
                        Level::Ok
                    },
                    "database",
                    format!(
                        "PostgreSQL {url}: reachable, {}, schema version {}{}, {} standby(s){}",
                        if st.writable {
                            "writable"
                        } else {
                            "read-only (a standby)"
                        },
                        st.schema_version,
                        if current {
                            String::new()
                        } else {
                            format!(
                                " (this bca's is {}: bca serve migrates a primary)",
                                crate::store::PG_MIGRATIONS.len()
                            )
                        },
                        st.standbys,
                        st.lag_bytes
                            .map(|b| format!(", replay lag {b} bytes"))
                            .unwrap_or_default()
                    ),
                );
                st.newest
            }
            Err(e) => {
                r.line(Level::Fail, "database", format!("PostgreSQL {url}: {e}"));
                None
            }
        }
    } else {
        match crate::store::maintenance::inspect(&db) {
            Ok((integrity, newest)) => {
                match integrity {
                    Ok(s) if s == "ok" => r.line(
                        Level::Ok,
                        "database",
                        format!("{}: integrity_check ok", db.display()),
                    ),
                    Ok(s) => r.line(
                        Level::Fail,
                        "database",
                        format!("{}: integrity_check says {s}", db.display()),
                    ),
                    Err(e) => r.line(Level::Fail, "database", format!("{}: {e}", db.display())),
                }
                newest
            }
            Err(e) => {
                r.line(Level::Fail, "database", format!("{}: {e}", db.display()));
                None
            }
        }
    };

    crate::base::fsutil::align_db_sidecars(&db);

    // The running server, if any.
    let server =
        crate::cli::client::Client::new(&socket_path).call("health/get", &serde_json::json!({}));
    let skew = match &server {
        Ok(h) => {
            let status = h["status"].as_str().unwrap_or("?");
            r.line(
                if status == "failing" {
                    Level::Fail
                } else {
                    Level::Ok
                },
                "server",
                format!(
                    "serving on {} ({status}; {} sessions, queue {})",
                    socket_path.display(),
                    h["sessions"],
                    h["queueDepth"]
                ),
            );
            h["clockSkew"]["medianSeconds"]
                .as_i64()
                .zip(h["clockSkew"]["samples"].as_u64().map(|n| n as usize))
        }
        Err(e) => {
            r.line(
                Level::Warn,
                "server",
                format!("not answering on {}: {}", socket_path.display(), e.message),
            );
            None
        }
    };

    // The state directory's disk: space, and what the server's last write met.
    let (mut disk_ok, free, mut problem) = crate::appliance::health::disk(state_dir);
    if let Ok(h) = &server {
        if h["disk"]["ok"] == false {
            disk_ok = false;
            problem = h["disk"]["problem"]
                .as_str()
                .map(str::to_string)
                .or(problem);
        }
    }
    match (disk_ok, problem) {
        (false, Some(p)) => r.line(Level::Fail, "disk", p),
        _ => r.line(
            Level::Ok,
            "disk",
            format!(
                "{} bytes free in {}",
                free.map_or("?".into(), |f| f.to_string()),
                state_dir.display()
            ),
        ),
    }

    // Ports: in use by the running server, else free to bind.
    let mut ports = vec![
        ("http", config.listen_http.clone()),
        ("gateway", config.listen_gateway.clone()),
    ];
    if config.boot.enabled {
        ports.push(("dhcp", "0.0.0.0:67".into()));
        ports.push(("tftp", "0.0.0.0:69".into()));
    }
    for (name, addr) in ports {
        let udp = name == "dhcp" || name == "tftp";
        let bound = if udp {
            std::net::UdpSocket::bind(&addr).map(drop)
        } else {
            std::net::TcpListener::bind(&addr).map(drop)
        };
        match (bound, server.is_ok()) {
            (Ok(()), false) => r.line(Level::Ok, name, format!("{addr} is free")),
            (Ok(()), true) => r.line(Level::Warn, name, format!("{addr} is free, though the server runs: it listens elsewhere (--listen-* flags?)")),
            (Err(_), true) => r.line(Level::Ok, name, format!("{addr} is in use (by the running server)")),
            (Err(e), false) => r.line(Level::Fail, name, format!("{addr} cannot be bound: {e}")),
        }
    }

    match config.key_protection {
        KeyProtection::Tpm => {
            let tcti = config.tpm.as_deref().unwrap_or(crate::tpm::DEFAULT_TCTI);
            match tcti
                .parse::<crate::tpm::Tcti>()
                .map_err(|e| e.to_string())
                .and_then(|t| {
                    crate::tpm::Tpm::open(&t)
                        .and_then(|mut t| t.identity())
                        .map_err(|e| e.to_string())
                }) {
                Ok(id) => r.line(
                    Level::Ok,
                    "tpm",
                    format!(
                        "{tcti}: {} {} (the keys are sealed to it)",
                        id.manufacturer, id.vendor
                    ),
                ),
                Err(e) => r.line(Level::Fail, "tpm", format!("{tcti}: {e}")),
            }
        }
        _ => r.line(Level::Ok, "tpm", "not used (keys are not sealed to a TPM)"),
    }

    // Boot files linked from outside the boot root are refused like missing ones.
    let boot_root = config
        .boot
        .root
        .clone()
        .unwrap_or_else(|| state_dir.join("boot"));
    let out = crate::base::fsutil::links_out(&boot_root);
    if out.is_empty() {
        r.line(
            Level::Ok,
            "boot files",
            format!("{}: no link out of it", boot_root.display()),
        );
    } else {
        let names: Vec<String> = out.iter().map(|(n, t)| format!("{n} -> {t}")).collect();
        r.line(
            Level::Warn,
            "boot files",
            format!(
                "not served, they lead out of {}: {} (copy the files in)",
                boot_root.display(),
                names.join(", ")
            ),
        );
    }

    let findings =
        crate::appliance::health::clock_findings(newest, skew, crate::base::clock::now());
    if findings.is_empty() {
        r.line(
            Level::Ok,
            "clock",
            crate::base::clock::rfc3339(crate::base::clock::now()),
        );
    }
    for f in findings {
        r.line(Level::Warn, "clock", f);
    }
    !r.failed
}
