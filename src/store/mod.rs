//! The store: one SQLite database in WAL mode, migrated forward by the numbered files in
//! `migrations/`, with every write going through [`Store::write`].
//!
//! The code above the store never names the engine: it gets a [`Tx`] from [`Store::write`] or
//! [`Store::read`] and calls the operations the store's modules define on it (`store::nodes`,
//! `store::tenancy`, `store::requests`, ...). Every SQL statement of the appliance lives in this
//! folder, and a second engine slots in behind `Tx` without touching the callers (the layering
//! test, `tests/it/layers.rs`, fails on `rusqlite` or SQL anywhere else in `src/`).
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

pub mod boot;
pub mod discovery;
pub mod downloads;
pub mod events;
pub mod maintenance;
pub mod nodes;
pub mod requests;
pub mod tenancy;
pub mod tpm;
pub mod tpm_eks;
pub mod x509pop;

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
    (
        "0007_x509pop",
        include_str!("../../migrations/0007_x509pop.sql"),
    ),
    (
        "0008_acceptance",
        include_str!("../../migrations/0008_acceptance.sql"),
    ),
    (
        "0009_provisioned",
        include_str!("../../migrations/0009_provisioned.sql"),
    ),
];

pub struct Store {
    conn: Mutex<Connection>,
}

/// One transaction of the store: a write (`BEGIN IMMEDIATE`) or a read. The callers above the
/// store reach the database only through the operations defined on it.
pub struct Tx<'c>(Transaction<'c>);

impl<'c> Tx<'c> {
    /// The engine's transaction, for the store's own modules.
    pub(in crate::store) fn c(&self) -> &Transaction<'c> {
        &self.0
    }

    /// Runs `f` in a savepoint: kept when `keep` says so of its result, rolled back otherwise (a
    /// refused join keeps nothing it wrote, the rest of its batch commits). The outer `Err` is
    /// the savepoint's own failure; the inner result is `f`'s.
    pub fn savepoint<T>(
        &self,
        f: impl FnOnce(&Self) -> ApiResult<T>,
        keep: impl FnOnce(&ApiResult<T>) -> bool,
    ) -> ApiResult<ApiResult<T>> {
        exec(self, "SAVEPOINT one_join", [])?;
        let out = f(self);
        if !keep(&out) {
            exec(self, "ROLLBACK TO one_join", [])?;
        }
        exec(self, "RELEASE one_join", [])?;
        Ok(out)
    }
}

/// Why the last write failed, when it failed for the disk: `0` none (the last write committed),
/// [`DISK_FULL`] or [`DISK_IO`]. `/healthz` and `bca doctor` report it; the next commit clears it.
static WRITE_FAULT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
pub const DISK_FULL: u8 = 1;
pub const DISK_IO: u8 = 2;

/// The disk fault the last write met, if any (`DISK_FULL`, `DISK_IO`).
pub fn write_fault() -> Option<u8> {
    match WRITE_FAULT.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        f => Some(f),
    }
}

/// What an operator reads of a disk fault.
pub fn fault_message(f: u8) -> &'static str {
    if f == DISK_FULL {
        "the state directory's disk is full: nothing was written; free space and the appliance recovers by itself"
    } else {
        "the state directory's disk fails writes (I/O error): nothing was written; check the disk"
    }
}

impl From<rusqlite::Error> for ApiError {
    fn from(e: rusqlite::Error) -> Self {
        // A disk that is full or failing is no bug of the request: `UNAVAILABLE`, with why.
        let fault = match e.sqlite_error_code() {
            Some(rusqlite::ErrorCode::DiskFull) => Some(DISK_FULL),
            // An I/O error, or the file system remounted read-only after one.
            Some(rusqlite::ErrorCode::SystemIoFailure | rusqlite::ErrorCode::ReadOnly) => {
                Some(DISK_IO)
            }
            _ => None,
        };
        if let Some(f) = fault {
            let before = WRITE_FAULT.swap(f, std::sync::atomic::Ordering::Relaxed);
            if before != f {
                tracing::error!(error = %e, "{}", fault_message(f));
            }
            return ApiError::new(crate::base::error::Code::Unavailable, fault_message(f));
        }
        ApiError::internal(format!("sqlite: {e}"))
    }
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
    pub fn write<T>(&self, f: impl FnOnce(&Tx<'_>) -> ApiResult<T>) -> ApiResult<T> {
        let mut conn = self.lock();
        let tx = Tx(conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?);
        let out = f(&tx)?;
        tx.0.commit()?;
        // A load first: every commit passes here, and the flag is almost always clear.
        if WRITE_FAULT.load(std::sync::atomic::Ordering::Relaxed) != 0
            && WRITE_FAULT.swap(0, std::sync::atomic::Ordering::Relaxed) != 0
        {
            tracing::info!("the state directory's disk takes writes again");
        }
        Ok(out)
    }

    /// Runs `f` in a read transaction.
    pub fn read<T>(&self, f: impl FnOnce(&Tx<'_>) -> ApiResult<T>) -> ApiResult<T> {
        let mut conn = self.lock();
        let tx = Tx(conn.transaction_with_behavior(rusqlite::TransactionBehavior::Deferred)?);
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
pub(in crate::store) fn exec(
    tx: &Tx<'_>,
    sql: &str,
    params: impl rusqlite::Params,
) -> rusqlite::Result<usize> {
    tx.0.prepare_cached(sql)?.execute(params)
}

/// `query_row` through the statement cache.
pub(in crate::store) fn query_row<T>(
    tx: &Tx<'_>,
    sql: &str,
    params: impl rusqlite::Params,
    f: impl FnOnce(&rusqlite::Row<'_>) -> rusqlite::Result<T>,
) -> rusqlite::Result<T> {
    tx.0.prepare_cached(sql)?.query_row(params, f)
}

/// Maps "no row" to `NOT_FOUND` with the given message.
pub(in crate::store) fn found<T>(
    r: rusqlite::Result<T>,
    what: impl FnOnce() -> String,
) -> ApiResult<T> {
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
            .read(|tx| Ok(tx.c().query_row("PRAGMA user_version", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(v as usize, MIGRATIONS.len());
        let mode: String = s
            .read(|tx| Ok(tx.c().query_row("PRAGMA journal_mode", [], |r| r.get(0))?))
            .unwrap();
        assert_eq!(mode, "wal");
    }

    #[test]
    fn a_failed_write_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let s = Store::open(&dir.path().join("db"), true).unwrap();
        let r: ApiResult<()> = s.write(|tx| {
            tx.c()
                .execute("INSERT INTO site VALUES ('site_x','a','b',1)", [])?;
            Err(ApiError::invalid_input("no"))
        });
        assert!(r.is_err());
        let n: i64 = s
            .read(|tx| {
                Ok(tx
                    .c()
                    .query_row("SELECT count(*) FROM site", [], |r| r.get(0))?)
            })
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
