//! The store: one SQLite database in WAL mode, migrated forward by the numbered files in
//! `migrations/`, with every write going through [`Store::write`].
//!
//! Invariants:
//! - A write runs inside one transaction that rolls back when dropped and commits only when the
//!   closure returns `Ok` (the kanidm pattern): an error leaves the database as it was.
//! - `synchronous=FULL`: an acknowledged write survives a power cut.
//! - Crypto does not run while the write lock is held, except signing a certificate whose
//!   contents are decided inside the transaction (see `join::service`).

use crate::base::error::{ApiError, ApiResult};
use rusqlite::{Connection, OpenFlags, Transaction};
use std::path::Path;
use std::sync::{Mutex, MutexGuard};

pub mod downloads;
pub mod events;
pub mod nodes;
pub mod tenancy;

/// Every migration, in order. A migration is never edited once released: add a new file.
pub const MIGRATIONS: &[(&str, &str)] = &[
    (
        "0001_initial",
        include_str!("../../migrations/0001_initial.sql"),
    ),
    (
        "0002_sessions_downloads",
        include_str!("../../migrations/0002_sessions_downloads.sql"),
    ),
    (
        "0003_discovery",
        include_str!("../../migrations/0003_discovery.sql"),
    ),
    (
        "0004_tpm_eks",
        include_str!("../../migrations/0004_tpm_eks.sql"),
    ),
    (
        "0005_tpm_attestor",
        include_str!("../../migrations/0005_tpm_attestor.sql"),
    ),
    (
        "0006_discovery_trust",
        include_str!("../../migrations/0006_discovery_trust.sql"),
    ),
];

pub struct Store {
    conn: Mutex<Connection>,
}

impl Store {
    /// Opens (and creates, when `create`) the database, applying pending migrations.
    pub fn open(path: &Path, create: bool) -> Result<Self, String> {
        let mut flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        if create {
            flags |= OpenFlags::SQLITE_OPEN_CREATE;
            // Create the file 0600 first: SQLite would make it 0644, and its -wal and -shm files
            // copy the database's mode.
            if !path.exists() {
                crate::base::fsutil::write_new_private(path, b"")?;
            }
        }
        let mut conn = Connection::open_with_flags(path, flags)
            .map_err(|e| format!("cannot open the database {}: {e}", path.display()))?;
        // `temp_store=MEMORY`: the savepoint that keeps each join of a group commit atomic on its
        // own journals every page it touches first; on disk, that sub-journal cost a join 16
        // `pwrite`s of a temporary file (the storm bench, 2026-12-04). It only ever serves a
        // rollback to the savepoint inside the open transaction; the WAL alone makes a commit
        // durable. Its memory is bounded by one batch (64 joins).
        conn.execute_batch(
            "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL; PRAGMA foreign_keys=ON; PRAGMA busy_timeout=5000;
             PRAGMA temp_store=MEMORY;",
        )
        .map_err(|e| format!("cannot configure the database: {e}"))?;
        migrate(&mut conn)?;
        // Hot paths reuse their prepared statements (see `exec` and `query_row`).
        conn.set_prepared_statement_cache_capacity(128);
        Ok(Self {
            conn: Mutex::new(conn),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` in one write transaction (`BEGIN IMMEDIATE`): committed when `f` returns `Ok`,
    /// rolled back otherwise.
    pub fn write<T>(&self, f: impl FnOnce(&Transaction<'_>) -> ApiResult<T>) -> ApiResult<T> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
        let out = f(&tx)?;
        tx.commit()?;
        Ok(out)
    }

    /// Runs `f` in a read transaction.
    pub fn read<T>(&self, f: impl FnOnce(&Transaction<'_>) -> ApiResult<T>) -> ApiResult<T> {
        let mut conn = self.lock();
        let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Deferred)?;
        f(&tx)
    }
}

/// Applies the migrations past `PRAGMA user_version`, each in its own transaction.
fn migrate(conn: &mut Connection) -> Result<(), String> {
    let current: usize = conn
        .query_row("PRAGMA user_version", [], |r| r.get::<_, i64>(0))
        .map_err(|e| e.to_string())? as usize;
    if current > MIGRATIONS.len() {
        return Err(format!(
            "the database is at schema version {current}, newer than this bca knows ({}); run a newer bca",
            MIGRATIONS.len()
        ));
    }
    for (i, (name, sql)) in MIGRATIONS.iter().enumerate().skip(current) {
        let tx = conn.transaction().map_err(|e| e.to_string())?;
        tx.execute_batch(sql)
            .map_err(|e| format!("migration {name} failed: {e}"))?;
        tx.pragma_update(None, "user_version", (i + 1) as i64)
            .map_err(|e| e.to_string())?;
        tx.commit().map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// `execute` through the connection's statement cache: the hot paths (joins, renewals, sessions,
/// events) do not parse their SQL again for every row.
pub fn exec(
    tx: &Transaction<'_>,
    sql: &str,
    params: impl rusqlite::Params,
) -> rusqlite::Result<usize> {
    tx.prepare_cached(sql)?.execute(params)
}

/// `query_row` through the statement cache.
pub fn query_row<T>(
    tx: &Transaction<'_>,
    sql: &str,
    params: impl rusqlite::Params,
    f: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    tx.prepare_cached(sql)?.query_row(params, f)
}

/// Maps "no row" to `NOT_FOUND` with the given message.
pub fn found<T>(r: rusqlite::Result<T>, what: impl FnOnce() -> String) -> ApiResult<T> {
    match r {
        Ok(v) => Ok(v),
        Err(rusqlite::Error::QueryReturnedNoRows) => Err(ApiError::not_found(what())),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn migrations_are_numbered_in_order_and_apply_twice_safely() {
        for (i, (name, _)) in MIGRATIONS.iter().enumerate() {
            assert!(
                name.starts_with(&format!("{:04}_", i + 1)),
                "{name} is out of order"
            );
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("db");
        drop(Store::open(&p, true).unwrap());
        let s = Store::open(&p, false).unwrap();
        let v: i64 = s
            .read(|tx| Ok(tx.query_row("PRAGMA user_version", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(v as usize, MIGRATIONS.len());
        let mode: String = s
            .read(|tx| Ok(tx.query_row("PRAGMA journal_mode", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(mode, "wal");
    }

    #[test]
    fn a_failed_write_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db"), true).unwrap();
        let r: ApiResult<()> = s.write(|tx| {
            tx.execute("INSERT INTO site VALUES ('site_x','a','b',1)", [])?;
            Err(ApiError::invalid_input("no"))
        });
        assert!(r.is_err());
        let n: i64 = s
            .read(|tx| Ok(tx.query_row("SELECT count(*) FROM site", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(n, 0);
    }

    #[test]
    fn a_newer_database_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("db");
        {
            let c = Connection::open(&p).unwrap();
            c.pragma_update(None, "user_version", 999).unwrap();
        }
        let e = Store::open(&p, false).err().unwrap();
        assert!(e.contains("newer than this bca knows"), "{e}");
    }
}
