//! The database as a whole: the site's first rows, health, retention's pruning, and the file
//! itself (online copy for backups, integrity checks for `doctor` and restores).

use crate::base::error::ApiResult;
use crate::store::params;
use crate::store::OptionalExtension;
use crate::store::{Store, Tx};
use rusqlite::{Connection, OpenFlags};
use std::path::Path;

/// The site's row and its root tenant (`bca init`).
pub fn site_create(
    tx: &Tx<'_>,
    (site_id, name, trust_domain): (&str, &str, &str),
    root_tenant: &str,
    now: i64,
) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "INSERT INTO site (id, name, trust_domain, created_at) VALUES (?1, ?2, ?3, ?4)",
        params![site_id, name, trust_domain, now],
    )?;
    crate::store::exec(
        tx,
        "INSERT INTO tenants (id, name, is_root, created_at) VALUES (?1, 'root', 1, ?2)",
        params![root_tenant, now],
    )?;
    Ok(())
}

/// Whether the database already holds a site (an appliance initialised it).
pub fn has_site(store: &Store) -> ApiResult<bool> {
    store.read(|tx| {
        Ok(
            crate::store::query_row(tx, "SELECT count(*) FROM site", [], |r| r.get::<_, i64>(0))?
                > 0,
        )
    })
}

/// The site the database holds: `(id, name, trust_domain)` (`bca join-site` reads it).
pub fn site(store: &Store) -> ApiResult<Option<(String, String, String)>> {
    store.read(|tx| {
        Ok(crate::store::query_row(
            tx,
            "SELECT id, name, trust_domain FROM site ORDER BY created_at LIMIT 1",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .optional()?)
    })
}

/// What `doctor` and `/healthz` read of a PostgreSQL store.
pub struct PgStatus {
    pub schema_version: i64,
    /// Not a standby in recovery: writes are taken.
    pub writable: bool,
    /// Streaming standbys attached to this server, and the largest replay lag among them.
    pub standbys: i64,
    pub lag_bytes: Option<i64>,
    pub newest: Option<i64>,
}

/// A PostgreSQL store's state (an error on SQLite).
pub fn pg_status(store: &Store) -> ApiResult<PgStatus> {
    if store.engine() != "postgres" {
        return Err(crate::base::error::ApiError::invalid_state(
            "the store is SQLite",
        ));
    }
    let (schema_version, in_recovery, standbys, lag) = store.read(|tx| {
        Ok(crate::store::query_row(
            tx,
            "SELECT (SELECT max(version) FROM bca_schema), pg_is_in_recovery(),
                    (SELECT count(*) FROM pg_stat_replication),
                    (SELECT max(pg_wal_lsn_diff(sent_lsn, replay_lsn))::bigint FROM pg_stat_replication)",
            [],
            |r| Ok((r.get::<_, i64>(0)?, r.get::<_, bool>(1)?, r.get::<_, i64>(2)?, r.get::<_, Option<i64>>(3)?)),
        )?)
    })?;
    Ok(PgStatus {
        schema_version,
        writable: !in_recovery,
        standbys,
        lag_bytes: lag,
        newest: newest_row(store),
    })
}

/// The root tenant's id.
pub fn root_tenant(store: &Store) -> ApiResult<String> {
    store.read(root_tenant_in)
}

/// The root tenant, in a transaction.
pub fn root_tenant_in(tx: &Tx<'_>) -> ApiResult<String> {
    Ok(crate::store::query_row(
        tx,
        "SELECT id FROM tenants WHERE is_root = 1",
        [],
        |r| r.get(0),
    )?)
}

/// Whether the database answers.
pub fn ping(store: &Store) -> bool {
    store
        .read(|tx| {
            Ok(crate::store::query_row(tx, "SELECT 1", [], |r| {
                r.get::<_, i64>(0)
            })?)
        })
        .is_ok()
}

/// The time of the newest event and audit row (by their sequence: two index lookups, no scan).
const NEWEST_ROW_SQL: &str = "SELECT CASE WHEN e > a THEN e ELSE a END FROM
     (SELECT coalesce((SELECT created_at FROM events ORDER BY seq DESC LIMIT 1), 0) AS e,
             coalesce((SELECT created_at FROM audit ORDER BY seq DESC LIMIT 1), 0) AS a) AS newest";

/// The newest time the appliance wrote into its own tables.
pub fn newest_row(store: &Store) -> Option<i64> {
    store
        .read(|tx| {
            Ok(crate::store::query_row(tx, NEWEST_ROW_SQL, [], |r| {
                r.get::<_, i64>(0)
            })?)
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
    let mut p = Pruned::default();
    if let Some(c) = c.events {
        p.events += crate::store::exec(
            tx,
            "DELETE FROM events WHERE created_at < ?1 AND substr(type, 1, 9) != 'security.'",
            params![c],
        )?;
    }
    if let Some(c) = c.audit {
        p.events += crate::store::exec(
            tx,
            "DELETE FROM events WHERE created_at < ?1 AND substr(type, 1, 9) = 'security.'",
            params![c],
        )?;
        p.audit += crate::store::exec(tx, "DELETE FROM audit WHERE created_at < ?1", params![c])?;
    }
    if let Some(c) = c.join_requests {
        p.join_requests += crate::store::exec(
            tx,
            "DELETE FROM join_requests WHERE state != 'pending'
               AND coalesce(consumed_at, decided_at, expires_at) < ?1",
            params![c],
        )?;
    }
    if let Some(c) = c.node_certs {
        p.node_certs += crate::store::exec(
            tx,
            "DELETE FROM node_certs WHERE not_after < ?1
               AND serial NOT IN (SELECT serial FROM node_certs n
                                  WHERE n.created_at = (SELECT max(created_at) FROM node_certs m
                                                        WHERE m.node_id = n.node_id))",
            params![c],
        )?;
    }
    if let Some(c) = c.boot_leases {
        p.boot_leases += crate::store::exec(
            tx,
            "DELETE FROM boot_leases WHERE created_at < ?1",
            params![c],
        )?;
    }
    if let Some(c) = c.discovery_tokens {
        // Spent, voided or expired before the cut-off; a live token is never pruned.
        p.discovery_tokens += crate::store::exec(
            tx,
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

/// The tables of the schema in the order they were made (each after those it references), with
/// their columns, read off SQLite's own schema (PostgreSQL's is the same: `the_two_schemas_are_one`).
pub fn tables() -> Result<Vec<(String, Vec<String>)>, String> {
    let c = Connection::open_in_memory().map_err(|e| e.to_string())?;
    for (_, sql) in crate::store::MIGRATIONS {
        c.execute_batch(sql).map_err(|e| e.to_string())?;
    }
    let names: Vec<String> = c
        .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY rowid")
        .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
        .map_err(|e| e.to_string())?;
    names
        .into_iter()
        .map(|t| {
            let cols: Vec<String> = c
                .prepare("SELECT name FROM pragma_table_info(?1) ORDER BY cid")
                .and_then(|mut s| s.query_map([&t], |r| r.get(0))?.collect())
                .map_err(|e| e.to_string())?;
            Ok((t, cols))
        })
        .collect()
}

/// Columns PostgreSQL numbers itself (`BIGSERIAL`): their sequences follow the copied rows.
const SERIALS: &[(&str, &str)] = &[
    ("events", "seq"),
    ("audit", "seq"),
    ("boot_leases", "epoch"),
    ("node_certs", "rowid"),
    ("tpm_challenges", "rowid"),
    ("x509pop_challenges", "rowid"),
];

/// What one copy moved: rows per table.
pub type Copied = Vec<(String, usize)>;

/// Copies every row of `from` into `to` (which must hold no site), table by table in one write
/// transaction of `to`, in the order the rows were written; then checks that every table holds
/// as many rows on both sides. Used by `bca store migrate --to` (SQLite to PostgreSQL).
pub fn copy_all(from: &Store, to: &Store) -> ApiResult<Copied> {
    use crate::base::error::ApiError;
    let tables = tables().map_err(ApiError::internal)?;
    if has_site(to)? {
        return Err(ApiError::invalid_state(
            "the destination database already holds a site: copy into an empty one",
        ));
    }
    let ordered = |tx: &Tx<'_>, t: &str| {
        tx.engine() == "sqlite" || SERIALS.iter().any(|(s, c)| *s == t && *c == "rowid")
    };
    let copied = from.read(|src| {
        to.write(|dst| {
            let mut copied = Vec::new();
            for (t, cols) in &tables {
                let list = cols.join(", ");
                let order = if ordered(src, t) { " ORDER BY rowid" } else { "" };
                let rows = crate::store::query_all(src, &format!("SELECT {list} FROM {t}{order}"), [], |r| {
                    Ok(r.clone())
                })?;
                let marks: Vec<String> = (1..=cols.len()).map(|i| format!("?{i}")).collect();
                let insert = format!("INSERT INTO {t} ({list}) VALUES ({})", marks.join(", "));
                for r in &rows {
                    crate::store::exec(dst, &insert, r.0.as_slice())?;
                }
                copied.push((t.clone(), rows.len()));
            }
            if dst.engine() == "postgres" {
                for (t, c) in SERIALS {
                    crate::store::query_row(
                        dst,
                        &format!("SELECT setval(pg_get_serial_sequence('{t}', '{c}'), COALESCE((SELECT max({c}) FROM {t}), 0) + 1, false)"),
                        [],
                        |r| r.get::<_, i64>(0),
                    )?;
                }
            }
            // Row for row: every table holds on the destination what the source holds.
            for (t, n) in &copied {
                let m: i64 = crate::store::query_row(dst, &format!("SELECT count(*) FROM {t}"), [], |r| r.get(0))?;
                if m as usize != *n {
                    return Err(ApiError::internal(format!(
                        "the copy of {t} holds {m} rows, the source {n}: nothing was kept"
                    )));
                }
            }
            Ok(copied)
        })
    })?;
    Ok(copied)
}
