//! The database as a whole: the site's first rows, health, retention's pruning, and the file
//! itself (online copy for backups, integrity checks for `doctor` and restores).

use crate::base::error::ApiResult;
use crate::store::{Store, Tx};
use rusqlite::{params, Connection, OpenFlags};
use std::path::Path;

/// The site's row and its root tenant (`bca init`).
pub fn site_create(
    tx: &Tx<'_>,
    (site_id, name, trust_domain): (&str, &str, &str),
    root_tenant: &str,
    now: i64,
) -> ApiResult<()> {
    tx.c().execute(
        "INSERT INTO site (id, name, trust_domain, created_at) VALUES (?1, ?2, ?3, ?4)",
        params![site_id, name, trust_domain, now],
    )?;
    tx.c().execute(
        "INSERT INTO tenants (id, name, is_root, created_at) VALUES (?1, 'root', 1, ?2)",
        params![root_tenant, now],
    )?;
    Ok(())
}

/// The root tenant's id.
pub fn root_tenant(store: &Store) -> ApiResult<String> {
    store.read(|tx| {
        Ok(tx
            .c()
            .query_row("SELECT id FROM tenants WHERE is_root = 1", [], |r| r.get(0))?)
    })
}

/// Whether the database answers.
pub fn ping(store: &Store) -> bool {
    store
        .read(|tx| Ok(tx.c().query_row("SELECT 1", [], |r| r.get::<_, i64>(0))?))
        .is_ok()
}

/// The time of the newest event and audit row (by their sequence: two index lookups, no scan).
const NEWEST_ROW_SQL: &str =
    "SELECT max(coalesce((SELECT created_at FROM events ORDER BY seq DESC LIMIT 1), 0),
                coalesce((SELECT created_at FROM audit ORDER BY seq DESC LIMIT 1), 0))";

/// The newest time the appliance wrote into its own tables.
pub fn newest_row(store: &Store) -> Option<i64> {
    store
        .read(|tx| {
            Ok(tx
                .c()
                .query_row(NEWEST_ROW_SQL, [], |r| r.get::<_, i64>(0))?)
        })
        .ok()
        .filter(|t| *t > 0)
}

/// What retention prunes: rows older than each cut-off (`None` keeps them).
#[derive(Debug, Default)]
pub struct Cutoffs {
    pub events: Option<i64>,
    /// Audit rows and `security.*` events.
    pub audit: Option<i64>,
    pub join_requests: Option<i64>,
    pub node_certs: Option<i64>,
    pub boot_leases: Option<i64>,
    pub discovery_tokens: Option<i64>,
}

/// What one pruning removed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Pruned {
    pub events: usize,
    pub audit: usize,
    pub join_requests: usize,
    pub node_certs: usize,
    pub boot_leases: usize,
    pub discovery_tokens: usize,
}

impl Pruned {
    pub fn total(&self) -> usize {
        self.events
            + self.audit
            + self.join_requests
            + self.node_certs
            + self.boot_leases
            + self.discovery_tokens
    }
}

/// Deletes what is past the cut-offs. A pending join request, a live discovery token and a
/// node's newest certificate are never pruned.
pub fn prune(tx: &Tx<'_>, c: &Cutoffs) -> ApiResult<Pruned> {
    let tx = tx.c();
    let mut p = Pruned::default();
    if let Some(c) = c.events {
        p.events += tx.execute(
            "DELETE FROM events WHERE created_at < ?1 AND substr(type, 1, 9) != 'security.'",
            params![c],
        )?;
    }
    if let Some(c) = c.audit {
        p.events += tx.execute(
            "DELETE FROM events WHERE created_at < ?1 AND substr(type, 1, 9) = 'security.'",
            params![c],
        )?;
        p.audit += tx.execute("DELETE FROM audit WHERE created_at < ?1", params![c])?;
    }
    if let Some(c) = c.join_requests {
        p.join_requests += tx.execute(
            "DELETE FROM join_requests WHERE state != 'pending'
               AND coalesce(consumed_at, decided_at, expires_at) < ?1",
            params![c],
        )?;
    }
    if let Some(c) = c.node_certs {
        p.node_certs += tx.execute(
            "DELETE FROM node_certs WHERE not_after < ?1
               AND serial NOT IN (SELECT serial FROM node_certs n
                                  WHERE n.created_at = (SELECT max(created_at) FROM node_certs m
                                                        WHERE m.node_id = n.node_id))",
            params![c],
        )?;
    }
    if let Some(c) = c.boot_leases {
        p.boot_leases += tx.execute("DELETE FROM boot_leases WHERE created_at < ?1", params![c])?;
    }
    if let Some(c) = c.discovery_tokens {
        // Spent, voided or expired before the cut-off; a live token is never pruned.
        p.discovery_tokens += tx.execute(
            "DELETE FROM discovery_tokens WHERE spent_at < ?1 OR voided_at < ?1 OR expires_at < ?1",
            params![c],
        )?;
    }
    Ok(p)
}

fn open_read_only(db: &Path) -> Result<Connection, String> {
    Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(|e| format!("cannot open {}: {e}", db.display()))
}

/// The database file's size in pages.
pub fn page_count(db: &Path) -> Result<u64, String> {
    open_read_only(db)?
        .query_row("PRAGMA page_count", [], |r| r.get::<_, i64>(0))
        .map(|n| n as u64)
        .map_err(|e| format!("cannot open {}: {e}", db.display()))
}

/// A consistent copy of the live database file `db` into `dst` (a new, empty file), taken page
/// by page while the server writes; one file, no WAL beside it.
pub fn copy_online(
    db: &Path,
    dst: &Path,
    progress: &mut crate::base::progress::Progress,
) -> Result<(), String> {
    let src = open_read_only(db)?;
    let mut dst = Connection::open(dst).map_err(|e| e.to_string())?;
    let b = rusqlite::backup::Backup::new(&src, &mut dst).map_err(|e| e.to_string())?;
    // 256 pages a step; the server's writers go on between steps.
    loop {
        use rusqlite::backup::StepResult;
        match b
            .step(256)
            .map_err(|e| format!("the online backup failed: {e}"))?
        {
            StepResult::Done => break,
            StepResult::More => {}
            _ => std::thread::sleep(std::time::Duration::from_millis(5)),
        }
        let p = b.progress();
        progress.set((p.pagecount - p.remaining).max(0) as u64);
    }
    drop(b);
    dst.execute_batch("PRAGMA journal_mode=DELETE;")
        .map_err(|e| e.to_string())
}

/// A restored database file put back in WAL mode and checked: SQLite's `integrity_check`
/// answer (`ok` when sound).
pub fn restore_check(db: &Path) -> Result<String, String> {
    Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_WRITE)
        .and_then(|c| {
            c.execute_batch("PRAGMA journal_mode=WAL;")?;
            c.query_row("PRAGMA integrity_check", [], |r| r.get::<_, String>(0))
        })
        .map_err(|e| e.to_string())
}

/// What `doctor` reads of a database file it opens read-only: `integrity_check`'s answer (or
/// the error), and the newest row's time.
pub fn inspect(db: &Path) -> Result<(Result<String, String>, Option<i64>), String> {
    let c = Connection::open_with_flags(db, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(|e| e.to_string())?;
    let integrity = c
        .query_row("PRAGMA integrity_check", [], |row| row.get::<_, String>(0))
        .map_err(|e| e.to_string());
    let newest = c
        .query_row(NEWEST_ROW_SQL, [], |row| row.get::<_, i64>(0))
        .ok()
        .filter(|t| *t > 0);
    Ok((integrity, newest))
}
