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

pub mod appliances;
pub mod boot;
pub mod discovery;
pub mod downloads;
pub mod events;
pub mod maintenance;
pub mod nodes;
pub mod pg;
pub mod pg_cluster;
pub mod requests;
pub mod sql;
pub mod tenancy;
pub mod tpm;
pub mod tpm_eks;
pub mod x509pop;

pub(crate) use sql::params;
pub use sql::{OptionalExtension, Row, SqlError, SqlResult};

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
    (
        "0010_relays",
        include_str!("../../migrations/0010_relays.sql"),
    ),
    (
        "0011_appliances",
        include_str!("../../migrations/0011_appliances.sql"),
    ),
];

/// The engine under the store: SQLite (the embedded default) or PostgreSQL (a site that outgrew
/// one box).
enum Conn {
    Sqlite(Connection),
    Postgres(pg::PgConn),
}

/// PostgreSQL's migrations, numbered as SQLite's (`migrations/postgres/`): the same tables,
/// columns and constraints in PostgreSQL's types (checked by `tests/it/postgres.rs`).
pub const PG_MIGRATIONS: &[(&str, &str)] = &[
    (
        "0001_initial",
        include_str!("../../migrations/postgres/0001_initial.sql"),
    ),
    (
        "0002_sessions_downloads",
        include_str!("../../migrations/postgres/0002_sessions_downloads.sql"),
    ),
    (
        "0003_discovery",
        include_str!("../../migrations/postgres/0003_discovery.sql"),
    ),
    (
        "0004_tpm_eks",
        include_str!("../../migrations/postgres/0004_tpm_eks.sql"),
    ),
    (
        "0005_tpm_attestor",
        include_str!("../../migrations/postgres/0005_tpm_attestor.sql"),
    ),
    (
        "0006_discovery_trust",
        include_str!("../../migrations/postgres/0006_discovery_trust.sql"),
    ),
    (
        "0007_x509pop",
        include_str!("../../migrations/postgres/0007_x509pop.sql"),
    ),
    (
        "0008_acceptance",
        include_str!("../../migrations/postgres/0008_acceptance.sql"),
    ),
    (
        "0009_provisioned",
        include_str!("../../migrations/postgres/0009_provisioned.sql"),
    ),
    (
        "0010_relays",
        include_str!("../../migrations/postgres/0010_relays.sql"),
    ),
    (
        "0011_appliances",
        include_str!("../../migrations/postgres/0011_appliances.sql"),
    ),
];

pub struct Store {
    conn: Mutex<Conn>,
}

/// How long `serve` waits for an appliance's lock a killed predecessor's session still holds.
const CLAIM_GRACE: std::time::Duration = std::time::Duration::from_secs(8);

/// One transaction of the store: a write or a read. The callers above the store reach the
/// database only through the operations defined on it.
pub struct Tx<'c>(TxInner<'c>);

enum TxInner<'c> {
    Sqlite(Transaction<'c>),
    Postgres(&'c pg::PgConn),
}

impl<'c> Tx<'c> {
    /// The SQLite transaction, for what only SQLite has (its online backup, `PRAGMA`s); `None`
    /// on PostgreSQL.
    #[cfg(test)]
    pub(in crate::store) fn sqlite(&self) -> Option<&Transaction<'c>> {
        match &self.0 {
            TxInner::Sqlite(t) => Some(t),
            TxInner::Postgres(_) => None,
        }
    }

    /// Which engine runs this transaction (`sqlite` or `postgres`).
    pub fn engine(&self) -> &'static str {
        match &self.0 {
            TxInner::Sqlite(_) => "sqlite",
            TxInner::Postgres(_) => "postgres",
        }
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
            conn: Mutex::new(Conn::Sqlite(conn)),
        })
    }

    /// Opens the state directory's store as `[store]` says: the embedded SQLite file `bca.db`,
    /// or PostgreSQL with the password from its file (which must be the owner's alone).
    /// (`url` and `password_file` are `[store]`'s keys.)
    pub fn open_at(
        state_dir: &Path,
        (url, password_file): (Option<&str>, Option<&Path>),
        create: bool,
    ) -> Result<Self, String> {
        match url {
            None => Self::open(&state_dir.join("bca.db"), create),
            Some(url) => Self::migrated(connect_at(url, password_file)?),
        }
    }

    /// Opens the store on PostgreSQL (`postgres://USER@HOST[:PORT]/DB`, the password from a
    /// file, never the URL), applying pending migrations under an advisory lock: one appliance
    /// migrates at a time.
    pub fn open_postgres(url: &str, password: Option<&str>) -> Result<Self, String> {
        Self::migrated(pg::PgConn::connect(pg::config(url, password)?)?)
    }

    /// The store on a PostgreSQL connection, its schema migrated first.
    fn migrated(conn: pg::PgConn) -> Result<Self, String> {
        migrate_postgres(&conn)?;
        Ok(Self {
            conn: Mutex::new(Conn::Postgres(conn)),
        })
    }

    /// The state directory's store as it is, for looking at it (`bca doctor`): PostgreSQL's schema
    /// is read, never migrated (SQLite's file is opened as [`Store::open_at`] does).
    pub fn inspect_at(
        state_dir: &Path,
        (url, password_file): (Option<&str>, Option<&Path>),
    ) -> Result<Self, String> {
        match url {
            None => Self::open(&state_dir.join("bca.db"), false),
            Some(url) => Ok(Self {
                conn: Mutex::new(Conn::Postgres(connect_at(url, password_file)?)),
            }),
        }
    }

    /// Makes this process the one `bca serve` of its appliance: on PostgreSQL, a session advisory
    /// lock keyed by the appliance's id, held for the connection's life and taken again on every
    /// new connection before anything else; refused while another process holds it (a copy of
    /// the state directory serving too). Other appliances of the site take their own. (A SQLite
    /// file is one state directory's, which `bca serve` locks.)
    pub fn claim_exclusive(&self, appliance_id: &str) -> Result<(), String> {
        let Conn::Postgres(p) = &*self.lock() else {
            return Ok(());
        };
        let h = crate::base::crypto::sha256(format!("bca appliance {appliance_id}").as_bytes());
        let key = i64::from_be_bytes(h[..8].try_into().expect("8 bytes"));
        // A serve that was just killed holds the lock until the database notices its session is
        // gone: a few seconds' grace before a second serve is told it is one.
        let until = std::time::Instant::now() + CLAIM_GRACE;
        loop {
            match p.claim(key) {
                Ok(true) => return Ok(()),
                Ok(false) if std::time::Instant::now() < until => {
                    std::thread::sleep(std::time::Duration::from_millis(200))
                }
                Ok(false) => return Err(format!(
                    "another bca serve runs as appliance {appliance_id} on this database (it holds the appliance's lock): one serve per appliance"
                )),
                Err(e) => return Err(format!("cannot claim the store's database: {e}")),
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` in one write transaction (SQLite's `BEGIN IMMEDIATE`): committed when `f`
    /// returns `Ok`, rolled back otherwise.
    pub fn write<T>(&self, f: impl FnOnce(&Tx<'_>) -> ApiResult<T>) -> ApiResult<T> {
        let mut conn = self.lock();
        match &mut *conn {
            Conn::Sqlite(c) => {
                let tx = Tx(TxInner::Sqlite(c.transaction_with_behavior(
                    rusqlite::TransactionBehavior::Immediate,
                )?));
                let out = f(&tx)?;
                if let TxInner::Sqlite(t) = tx.0 {
                    t.commit()?;
                }
                // A load first: every commit passes here, and the flag is almost always clear.
                if WRITE_FAULT.load(std::sync::atomic::Ordering::Relaxed) != 0
                    && WRITE_FAULT.swap(0, std::sync::atomic::Ordering::Relaxed) != 0
                {
                    tracing::info!("the state directory's disk takes writes again");
                }
                Ok(out)
            }
            Conn::Postgres(p) => pg_transaction(p, true, f),
        }
    }

    /// Runs `f` in a read transaction.
    pub fn read<T>(&self, f: impl FnOnce(&Tx<'_>) -> ApiResult<T>) -> ApiResult<T> {
        let mut conn = self.lock();
        match &mut *conn {
            Conn::Sqlite(c) => {
                let tx = Tx(TxInner::Sqlite(c.transaction_with_behavior(
                    rusqlite::TransactionBehavior::Deferred,
                )?));
                f(&tx)
            }
            Conn::Postgres(p) => pg_transaction(p, false, f),
        }
    }

    /// Which engine the store runs on (`sqlite` or `postgres`).
    pub fn engine(&self) -> &'static str {
        match &*self.lock() {
            Conn::Sqlite(_) => "sqlite",
            Conn::Postgres(_) => "postgres",
        }
    }
}

/// A connection to `[store]`'s database, with the password from its file.
fn connect_at(url: &str, password_file: Option<&Path>) -> Result<pg::PgConn, String> {
    let password = password_file.map(read_password_file).transpose()?;
    pg::PgConn::connect(pg::config(url, password.as_deref().map(|p| p.as_str()))?)
}

/// The database password from its file: the file must be readable by its owner alone (0600 or
/// 0400); its first line is the password.
pub fn read_password_file(p: &Path) -> Result<zeroize::Zeroizing<String>, String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(p)
        .map_err(|e| format!("cannot read the store's password file {}: {e}", p.display()))?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(format!(
            "the store's password file {} is readable by others (mode {:o}): chmod 600 it",
            p.display(),
            meta.permissions().mode() & 0o777
        ));
    }
    let text = zeroize::Zeroizing::new(
        std::fs::read_to_string(p)
            .map_err(|e| format!("cannot read the store's password file {}: {e}", p.display()))?,
    );
    let line = text.lines().next().unwrap_or_default();
    if line.is_empty() {
        return Err(format!(
            "the store's password file {} is empty",
            p.display()
        ));
    }
    Ok(zeroize::Zeroizing::new(line.to_string()))
}

/// A PostgreSQL transaction around `f`: committed on `Ok`, rolled back on `Err` or a panic.
fn pg_transaction<T>(
    p: &pg::PgConn,
    write: bool,
    f: impl FnOnce(&Tx<'_>) -> ApiResult<T>,
) -> ApiResult<T> {
    struct Open<'a>(&'a pg::PgConn, bool);
    impl Drop for Open<'_> {
        fn drop(&mut self) {
            if self.1 {
                let _ = self.0.rollback();
            }
        }
    }
    p.begin(write)?;
    let mut open = Open(p, true);
    let out = f(&Tx(TxInner::Postgres(p)))?;
    open.1 = false;
    if let Err(e) = p.commit() {
        let _ = p.rollback();
        return Err(e.into());
    }
    Ok(out)
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

/// The schema version of a PostgreSQL store (0 before the first migration).
fn pg_version(conn: &pg::PgConn) -> SqlResult<usize> {
    let rows = conn.query("SELECT max(version) FROM bca_schema", Vec::new())?;
    Ok(rows
        .first()
        .and_then(|r| r.get::<_, Option<i64>>(0).ok().flatten())
        .unwrap_or(0) as usize)
}

/// PostgreSQL's migrations (`migrations/postgres/`, the same numbers as SQLite's), each in its own
/// transaction holding the advisory lock `bca-migrate`: two appliances starting at once migrate
/// one after the other, and the second finds nothing left to do.
fn migrate_postgres(conn: &pg::PgConn) -> Result<(), String> {
    let fail = |e: SqlError| format!("cannot migrate the store's database: {e}");
    // A standby (in recovery) takes no DDL: its schema is the primary's, checked, not migrated.
    let standby = conn
        .query("SELECT pg_is_in_recovery()", Vec::new())
        .map_err(fail)?
        .first()
        .and_then(|r| r.get::<_, bool>(0).ok())
        .unwrap_or(false);
    if standby {
        let v = pg_version(conn).map_err(fail)?;
        if v != PG_MIGRATIONS.len() {
            return Err(format!(
                "the database is a standby at schema version {v}, and this bca needs {}: migrate its primary",
                PG_MIGRATIONS.len()
            ));
        }
        return Ok(());
    }
    loop {
        conn.begin(true).map_err(fail)?;
        let step = (|| -> SqlResult<Option<String>> {
            conn.query("SELECT pg_advisory_xact_lock(7262034211)", Vec::new())?;
            conn.batch("CREATE TABLE IF NOT EXISTS bca_schema (version BIGINT PRIMARY KEY, name TEXT NOT NULL, applied_at BIGINT NOT NULL)")?;
            let current = pg_version(conn)?;
            if current > PG_MIGRATIONS.len() {
                return Ok(Some(format!(
                    "the database is at schema version {current}, newer than this bca knows ({}); run a newer bca",
                    PG_MIGRATIONS.len()
                )));
            }
            let Some((name, sql)) = PG_MIGRATIONS.get(current) else {
                return Ok(None);
            };
            conn.batch(sql)?;
            conn.exec(
                "INSERT INTO bca_schema (version, name, applied_at) VALUES (?1, ?2, ?3)",
                vec![
                    sql::Value::Int(current as i64 + 1),
                    sql::Value::Text(name.to_string()),
                    sql::Value::Int(crate::base::clock::now()),
                ],
            )?;
            Ok(Some(String::new()))
        })();
        match step {
            Ok(Some(refused)) if !refused.is_empty() => {
                let _ = conn.rollback();
                return Err(refused);
            }
            Ok(Some(_)) => conn.commit().map_err(fail)?,
            Ok(None) => {
                conn.commit().map_err(fail)?;
                return Ok(());
            }
            Err(e) => {
                let _ = conn.rollback();
                return Err(fail(e));
            }
        }
    }
}

/// Runs a statement; the rows it changed.
pub(in crate::store) fn exec(tx: &Tx<'_>, sql: &str, params: impl sql::Params) -> SqlResult<usize> {
    match &tx.0 {
        TxInner::Sqlite(t) => Ok(t
            .prepare_cached(sql)?
            .execute(rusqlite::params_from_iter(params.values()))?),
        TxInner::Postgres(p) => p.exec(sql, params.values()),
    }
}

/// Every row of a query, each turned into a `T` by `f`.
pub(in crate::store) fn query_all<T>(
    tx: &Tx<'_>,
    sql: &str,
    params: impl sql::Params,
    mut f: impl FnMut(&Row) -> SqlResult<T>,
) -> SqlResult<Vec<T>> {
    match &tx.0 {
        TxInner::Sqlite(t) => {
            let mut st = t.prepare_cached(sql)?;
            let n = st.column_count();
            let mut rows = st.query(rusqlite::params_from_iter(params.values()))?;
            let mut out = Vec::new();
            while let Some(r) = rows.next()? {
                out.push(f(&sql::sqlite_row(r, n)?)?);
            }
            Ok(out)
        }
        TxInner::Postgres(p) => p.query(sql, params.values())?.iter().map(f).collect(),
    }
}

/// The first row of a query turned into a `T` by `f`; `SqlError::NoRows` when there is none.
pub(in crate::store) fn query_row<T>(
    tx: &Tx<'_>,
    sql: &str,
    params: impl sql::Params,
    f: impl FnOnce(&Row) -> SqlResult<T>,
) -> SqlResult<T> {
    match &tx.0 {
        TxInner::Sqlite(t) => {
            let mut st = t.prepare_cached(sql)?;
            let n = st.column_count();
            let mut rows = st.query(rusqlite::params_from_iter(params.values()))?;
            match rows.next()? {
                Some(r) => f(&sql::sqlite_row(r, n)?),
                None => Err(SqlError::NoRows),
            }
        }
        TxInner::Postgres(p) => match p.query(sql, params.values())?.first() {
            Some(r) => f(r),
            None => Err(SqlError::NoRows),
        },
    }
}

/// Maps "no row" to `NOT_FOUND` with the given message.
pub(in crate::store) fn found<T>(r: SqlResult<T>, what: impl FnOnce() -> String) -> ApiResult<T> {
    match r {
        Ok(v) => Ok(v),
        Err(SqlError::NoRows) => Err(ApiError::not_found(what())),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A new store on each engine: SQLite in a temporary folder, PostgreSQL in a new database of
    /// the test process's throwaway cluster.
    fn engines() -> Vec<(tempfile::TempDir, Store)> {
        let dir = tempfile::tempdir().unwrap();
        let sqlite = Store::open(&dir.path().join("db"), true).unwrap();
        let url = pg_cluster::Cluster::shared().new_database();
        let postgres = Store::open_postgres(&url, None).unwrap();
        vec![(dir, sqlite), (tempfile::tempdir().unwrap(), postgres)]
    }

    #[test]
    fn migrations_are_numbered_in_order_and_apply_twice_safely() {
        for list in [MIGRATIONS, PG_MIGRATIONS] {
            assert_eq!(list.len(), MIGRATIONS.len());
            for (i, (name, _)) in list.iter().enumerate() {
                assert!(
                    name.starts_with(&format!("{:04}_", i + 1)),
                    "{name} is out of order"
                );
                assert_eq!(*name, MIGRATIONS[i].0);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("db");
        drop(Store::open(&p, true).unwrap());
        let s = Store::open(&p, false).unwrap();
        let v: i64 = s
            .read(|tx| {
                Ok(tx
                    .sqlite()
                    .unwrap()
                    .query_row("PRAGMA user_version", [], |r| r.get(0))?)
            })
            .unwrap();
        assert_eq!(v as usize, MIGRATIONS.len());
        let mode: String = s
            .read(|tx| {
                Ok(tx
                    .sqlite()
                    .unwrap()
                    .query_row("PRAGMA journal_mode", [], |r| r.get(0))?)
            })
            .unwrap();
        assert_eq!(mode, "wal");

        // PostgreSQL: twice, and two appliances at once (the advisory lock), end at the same
        // version, each migration applied once.
        let url = pg_cluster::Cluster::shared().new_database();
        let both: Vec<_> = (0..2)
            .map(|_| {
                let url = url.clone();
                std::thread::spawn(move || Store::open_postgres(&url, None).map(|_| ()))
            })
            .collect();
        for t in both {
            t.join().unwrap().unwrap();
        }
        let s = Store::open_postgres(&url, None).unwrap();
        let (n, max): (i64, i64) = s
            .read(|tx| {
                Ok(query_row(
                    tx,
                    "SELECT count(*), max(version) FROM bca_schema",
                    [],
                    |r| Ok((r.get(0)?, r.get(1)?)),
                )?)
            })
            .unwrap();
        assert_eq!(
            (n as usize, max as usize),
            (PG_MIGRATIONS.len(), PG_MIGRATIONS.len())
        );
    }

    #[test]
    fn a_failed_write_changes_nothing() {
        for (_dir, s) in engines() {
            let r: ApiResult<()> = s.write(|tx| {
                exec(tx, "INSERT INTO site VALUES ('site_x','a','b',1)", [])?;
                Err(ApiError::invalid_input("no"))
            });
            assert!(r.is_err());
            let n: i64 = s
                .read(|tx| {
                    Ok(query_row(tx, "SELECT count(*) FROM site", [], |r| {
                        r.get(0)
                    })?)
                })
                .unwrap();
            assert_eq!(n, 0, "{}", s.engine());
            // A savepoint rolled back keeps nothing; the transaction around it commits.
            s.write(|tx| {
                exec(tx, "INSERT INTO site VALUES ('site_a','a','b',1)", [])?;
                let inner = tx.savepoint(
                    |tx| {
                        exec(tx, "INSERT INTO site VALUES ('site_b','a','b',1)", [])?;
                        Err::<(), _>(ApiError::invalid_input("refused"))
                    },
                    |r| r.is_ok(),
                )?;
                assert!(inner.is_err());
                Ok(())
            })
            .unwrap();
            let ids: Vec<String> = s
                .read(|tx| {
                    Ok(query_all(tx, "SELECT id FROM site ORDER BY id", [], |r| {
                        r.get(0)
                    })?)
                })
                .unwrap();
            assert_eq!(ids, ["site_a"], "{}", s.engine());
        }
    }

    #[test]
    fn values_round_trip_alike_on_both_engines() {
        for (_dir, s) in engines() {
            let row = s
                .write(|tx| {
                    exec(
                        tx,
                        "INSERT INTO site VALUES (?1, ?2, ?3, ?4)",
                        params!["site_v", "n\u{e9}", "td", i64::MAX],
                    )?;
                    Ok(query_row(
                        tx,
                        "SELECT id, name, created_at, NULL FROM site WHERE id = ?1",
                        ["site_v"],
                        |r| {
                            Ok((
                                r.get::<_, String>(0)?,
                                r.get::<_, String>(1)?,
                                r.get::<_, i64>(2)?,
                                r.get::<_, Option<String>>(3)?,
                            ))
                        },
                    )?)
                })
                .unwrap();
            assert_eq!(
                row,
                ("site_v".into(), "n\u{e9}".into(), i64::MAX, None),
                "{}",
                s.engine()
            );
            let none = s
                .read(|tx| {
                    Ok(
                        query_row(tx, "SELECT id FROM site WHERE id = ?1", ["nope"], |r| {
                            r.get::<_, String>(0)
                        })
                        .optional()?,
                    )
                })
                .unwrap();
            assert_eq!(none, None);
        }
    }

    /// The two engines' schemas have the same tables, columns (name, order, nullability),
    /// named indexes and row counts after the same writes; PostgreSQL's only extra column is
    /// `rowid` where the store orders by SQLite's rowid.
    #[test]
    fn the_two_schemas_are_one() {
        let engines = engines();
        let shape = |s: &Store| -> Vec<String> {
            s.read(|tx| {
                let mut out = Vec::new();
                let tables: Vec<String> = match tx.engine() {
                    "sqlite" => query_all(
                        tx,
                        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name",
                        [],
                        |r| r.get(0),
                    )?,
                    _ => query_all(
                        tx,
                        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public'
                         AND table_name != 'bca_schema' ORDER BY table_name",
                        [],
                        |r| r.get(0),
                    )?,
                };
                for t in tables {
                    let cols: Vec<String> = match tx.engine() {
                        "sqlite" => query_all(
                            tx,
                            "SELECT name, \"notnull\" OR pk FROM pragma_table_info(?1) ORDER BY cid",
                            [&t],
                            |r| Ok(format!("{}.{} {}", t, r.get::<_, String>(0)?, r.get::<_, i64>(1)?)),
                        )?,
                        _ => query_all(
                            tx,
                            "SELECT column_name::text, CASE WHEN is_nullable = 'NO' THEN 1 ELSE 0 END
                             FROM information_schema.columns WHERE table_name = ?1 AND column_name != 'rowid'
                             ORDER BY ordinal_position",
                            [&t],
                            |r| Ok(format!("{}.{} {}", t, r.get::<_, String>(0)?, r.get::<_, i64>(1)?)),
                        )?,
                    };
                    out.extend(cols);
                }
                let indexes: Vec<String> = match tx.engine() {
                    "sqlite" => query_all(
                        tx,
                        "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL ORDER BY name",
                        [],
                        |r| r.get(0),
                    )?,
                    _ => query_all(
                        tx,
                        "SELECT indexname::text FROM pg_indexes WHERE schemaname = 'public'
                         AND indexname NOT IN (SELECT conname FROM pg_constraint) ORDER BY indexname",
                        [],
                        |r| r.get(0),
                    )?,
                };
                out.extend(indexes.into_iter().map(|i| format!("index {i}")));
                Ok(out)
            })
            .unwrap()
        };
        let (sqlite, postgres) = (shape(&engines[0].1), shape(&engines[1].1));
        assert!(sqlite.len() > 100, "{sqlite:?}");
        assert_eq!(sqlite, postgres);
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

        let url = pg_cluster::Cluster::shared().new_database();
        let s = Store::open_postgres(&url, None).unwrap();
        s.write(|tx| {
            Ok(exec(
                tx,
                "INSERT INTO bca_schema (version, name, applied_at) VALUES (999, 'future', 0)",
                [],
            )?)
        })
        .unwrap();
        drop(s);
        let e = Store::open_postgres(&url, None).err().unwrap();
        assert!(e.contains("newer than this bca knows"), "{e}");
    }

    #[test]
    fn a_password_file_others_can_read_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("pw");
        std::fs::write(&p, "s3cret\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = read_password_file(&p).err().unwrap();
        assert!(
            e.contains("readable by others") && !e.contains("s3cret"),
            "{e}"
        );
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_password_file(&p).unwrap().as_str(), "s3cret");
        std::fs::write(&p, "").unwrap();
        assert!(read_password_file(&p).err().unwrap().contains("is empty"));
    }
}
