//! The PostgreSQL engine: one connection (`tokio-postgres`, pure Rust: the static binary needs
//! no libpq), driven by a thread of its own with a single-threaded runtime. The store's callers
//! are synchronous and some run on the appliance's runtime's threads, where a nested `block_on`
//! would panic: they hand each statement to that thread and wait on a plain channel, as the
//! `postgres` crate's blocking client does inside its own runtime.
//!
//! Invariants:
//! - A statement of a transaction never runs on a connection the transaction did not begin on:
//!   when the connection is lost inside one, every statement fails (`UNAVAILABLE`) until the
//!   store rolls it back; the next transaction reconnects. Nothing half-written is committed.
//! - Every statement has a deadline (`statement_timeout`) and the connection one to be made
//!   (`connect_timeout`): a database that does not answer fails the call, it never hangs it.
//! - The password is never in the URL (refused there) nor in an error or log line.

use super::sql::{Row, SqlError, SqlResult, Value};
use std::collections::HashMap;
use std::sync::mpsc;
use std::time::Duration;
use tokio_postgres::types::{FromSql, IsNull, ToSql, Type};

/// How long a statement may run, and a connection take to be made.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(10);
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

enum Op {
    /// Hold this session-level advisory lock now and on every new connection.
    Exclusive(i64),
    Begin(&'static str),
    Commit,
    Rollback,
    Batch(String),
    Exec(String, Vec<Value>),
    Query(String, Vec<Value>),
}

enum Answer {
    Done(u64),
    Rows(Vec<Row>),
}

struct Job {
    op: Op,
    reply: mpsc::Sender<SqlResult<Answer>>,
}

/// A connection to PostgreSQL, usable from any thread.
pub struct PgConn {
    jobs: mpsc::Sender<Job>,
}

fn pg_err(e: tokio_postgres::Error) -> SqlError {
    // A value this side could not encode or decode is no fault of the connection.
    let text = e.to_string();
    let conversion =
        text.starts_with("error serializing") || text.starts_with("error deserializing");
    let unreachable = e.is_closed() || (e.code().is_none() && !conversion);
    let message = match e.as_db_error() {
        Some(db) => format!("{}: {}", db.code().code(), db.message()),
        None => e.to_string(),
    };
    SqlError::Postgres {
        message,
        unreachable,
    }
}

fn unreachable(why: &str) -> SqlError {
    SqlError::Postgres {
        message: why.to_string(),
        unreachable: true,
    }
}

/// The store's SQL (SQLite's dialect) as PostgreSQL reads it: `?N` parameters become `$N`
/// (outside quotes), `json_object(` is `json_build_object(`, and `LIMIT -1` is `LIMIT ALL`.
pub fn dialect(sql: &str) -> String {
    let mut out = String::with_capacity(sql.len() + 8);
    let mut chars = sql.chars().peekable();
    let (mut quoted, mut next) = (false, 1);
    while let Some(c) = chars.next() {
        if c == '\'' {
            quoted = !quoted;
        }
        if c == '?' && !quoted {
            out.push('$');
            if chars.peek().is_some_and(|d| d.is_ascii_digit()) {
                while let Some(d) = chars.peek().copied().filter(char::is_ascii_digit) {
                    out.push(d);
                    chars.next();
                }
            } else {
                out.push_str(&next.to_string());
                next += 1;
            }
            continue;
        }
        out.push(c);
    }
    out.replace("json_object(", "json_build_object(")
        .replace("LIMIT -1 OFFSET", "LIMIT ALL OFFSET")
}

/// Where and as whom to connect: `postgres://USER@HOST[:PORT]/DB`, whose host is a Unix socket's
/// folder (percent-encoded: `%2Frun%2Fpostgresql`), and the password from a file.
///
/// Only a Unix socket, in a folder other users cannot write: TLS to a database elsewhere is not
/// built yet (a password never goes out in clear), and a TCP port on this box (loopback
/// included) can be taken by any local user while PostgreSQL is down, who would then be sent the
/// password and could answer as the database.
pub fn config(url: &str, password: Option<&str>) -> Result<tokio_postgres::Config, String> {
    // The URL is never echoed: it may carry a password, which is refused below.
    let mut c: tokio_postgres::Config = url.parse().map_err(|e| {
        format!("the store URL is not a PostgreSQL URL (postgres://USER@HOST[:PORT]/DB): {e}")
    })?;
    if c.get_password().is_some() {
        return Err(
            "the store URL carries a password: give it in --store-password-file instead".into(),
        );
    }
    if c.get_user().is_none() {
        return Err("the store URL names no user (postgres://USER@HOST/DB)".into());
    }
    if c.get_dbname().is_none() {
        return Err("the store URL names no database (postgres://USER@HOST/DB)".into());
    }
    let unix_only = !c.get_hosts().is_empty()
        && c.get_hostaddrs().is_empty()
        && c.get_hosts()
            .iter()
            .all(|h| matches!(h, tokio_postgres::config::Host::Unix(_)));
    if !unix_only {
        return Err("the store's database must be reached through its Unix socket on this box \
             (postgres://USER@%2Frun%2Fpostgresql/DB): TLS to a database elsewhere is not built yet, \
             and a TCP port, loopback included, can be taken by any local user while PostgreSQL is down"
            .into());
    }
    if let Some(p) = password {
        c.password(p);
    }
    c.connect_timeout(CONNECT_TIMEOUT);
    c.options(format!(
        "-c statement_timeout={} -c lock_timeout={}",
        STATEMENT_TIMEOUT.as_millis(),
        STATEMENT_TIMEOUT.as_millis()
    ));
    c.application_name("bca");
    Ok(c)
}

/// The socket folders must not be writable by every user: in a folder anyone can write (`/tmp`),
/// another user could put a socket of their own in PostgreSQL's place while it is down.
pub fn check_socket_folders(c: &tokio_postgres::Config) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    for h in c.get_hosts() {
        if let tokio_postgres::config::Host::Unix(dir) = h {
            let mode = std::fs::metadata(dir)
                .map_err(|e| format!("the store's socket folder {}: {e}", dir.display()))?
                .permissions()
                .mode();
            if mode & 0o002 != 0 {
                return Err(format!(
                    "the store's socket folder {} is writable by other users (mode {:o}): another user could stand in for PostgreSQL there",
                    dir.display(),
                    mode & 0o7777
                ));
            }
        }
    }
    Ok(())
}

impl PgConn {
    /// Connects (once now, to say at once what is wrong, and again by itself whenever the
    /// connection was lost).
    pub fn connect(config: tokio_postgres::Config) -> Result<Self, String> {
        check_socket_folders(&config)?;
        let (jobs, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
        std::thread::Builder::new()
            .name("bca-postgres".into())
            .spawn(move || worker(config, rx, ready_tx))
            .map_err(|e| e.to_string())?;
        ready_rx
            .recv()
            .map_err(|_| "the database thread ended".to_string())??;
        Ok(PgConn { jobs })
    }

    fn call(&self, op: Op) -> SqlResult<Answer> {
        let (reply, rx) = mpsc::channel();
        self.jobs
            .send(Job { op, reply })
            .map_err(|_| unreachable("the database thread ended"))?;
        rx.recv()
            .map_err(|_| unreachable("the database thread ended"))?
    }

    /// Claims the database for this process alone: the session-level advisory lock `key`, held
    /// for the connection's life and taken again on every new connection before anything else.
    /// `false` when another session holds it.
    pub fn claim(&self, key: i64) -> SqlResult<bool> {
        match self.call(Op::Exclusive(key))? {
            Answer::Done(n) => Ok(n == 1),
            Answer::Rows(_) => Ok(false),
        }
    }

    pub fn begin(&self, write: bool) -> SqlResult<()> {
        self.call(Op::Begin(if write {
            "BEGIN"
        } else {
            "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"
        }))
        .map(|_| ())
    }
    pub fn commit(&self) -> SqlResult<()> {
        self.call(Op::Commit).map(|_| ())
    }
    pub fn rollback(&self) -> SqlResult<()> {
        self.call(Op::Rollback).map(|_| ())
    }
    pub fn batch(&self, sql: &str) -> SqlResult<()> {
        self.call(Op::Batch(sql.to_string())).map(|_| ())
    }
    pub fn exec(&self, sql: &str, params: Vec<Value>) -> SqlResult<usize> {
        match self.call(Op::Exec(sql.to_string(), params))? {
            Answer::Done(n) => Ok(n as usize),
            Answer::Rows(r) => Ok(r.len()),
        }
    }
    pub fn query(&self, sql: &str, params: Vec<Value>) -> SqlResult<Vec<Row>> {
        match self.call(Op::Query(sql.to_string(), params))? {
            Answer::Rows(r) => Ok(r),
            Answer::Done(_) => Ok(Vec::new()),
        }
    }
}

/// The connection's state, on the database thread.
struct Link {
    config: tokio_postgres::Config,
    client: Option<tokio_postgres::Client>,
    /// Prepared statements of this connection, by the store's SQL.
    prepared: HashMap<String, tokio_postgres::Statement>,
    /// Inside a transaction: whether it is still on the connection it began on.
    in_tx: Option<bool>,
    /// A statement of the open transaction failed: its COMMIT must fail too (PostgreSQL would
    /// answer an aborted transaction's COMMIT with a ROLLBACK, which looks like success).
    tx_failed: bool,
    /// The session-level advisory lock this connection must hold (`bca serve`'s claim to be the
    /// database's one writer), taken again on every new connection before anything else.
    exclusive: Option<i64>,
}

/// Errors PostgreSQL gives when a deadline passed or a lock could not be had in time: the
/// database is busy, not the request wrong (`UNAVAILABLE`, worth a retry).
fn busy(message: &str) -> bool {
    ["57014:", "55P03:", "40001:", "40P01:"]
        .iter()
        .any(|code| message.starts_with(code))
}

/// Set when this process, reconnecting, found its appliance's lock taken by another process (a
/// copy of its state directory serving): `serve` stops rather than serve beside it.
static LOST_EXCLUSIVE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

pub fn lost_exclusive() -> bool {
    LOST_EXCLUSIVE.load(std::sync::atomic::Ordering::SeqCst)
}

/// The session-level advisory lock `key`, if no other session holds it.
async fn try_lock(c: &tokio_postgres::Client, key: i64) -> SqlResult<bool> {
    Ok(c.query_one("SELECT pg_try_advisory_lock($1)", &[&key])
        .await
        .map_err(pg_err)?
        .get(0))
}

impl Link {
    /// The connection, made again when it was lost; never inside a transaction (a statement of a
    /// transaction goes on the connection the transaction began on, or nowhere).
    async fn client(&mut self) -> SqlResult<&tokio_postgres::Client> {
        let closed = self.client.as_ref().is_none_or(|c| c.is_closed());
        if closed && self.in_tx.is_some() {
            self.in_tx = Some(false);
            return Err(unreachable(
                "the connection to the database was lost inside a transaction",
            ));
        }
        if closed {
            self.prepared.clear();
            self.client = None;
            let (client, conn) = self
                .config
                .connect(tokio_postgres::NoTls)
                .await
                .map_err(pg_err)?;
            tokio::spawn(async move {
                let _ = conn.await;
            });
            if let Some(key) = self.exclusive {
                if !try_lock(&client, key).await? {
                    LOST_EXCLUSIVE.store(true, std::sync::atomic::Ordering::SeqCst);
                    return Err(SqlError::Postgres {
                        message: "another bca serve runs as this appliance on the database (it holds the appliance's lock): one serve per appliance".into(),
                        unreachable: true,
                    });
                }
            }
            self.client = Some(client);
        }
        Ok(self.client.as_ref().expect("connected"))
    }

    async fn statement(&mut self, sql: &str) -> SqlResult<tokio_postgres::Statement> {
        if let Some(s) = self.prepared.get(sql) {
            return Ok(s.clone());
        }
        let text = dialect(sql);
        let s = self.client().await?.prepare(&text).await.map_err(pg_err)?;
        self.prepared.insert(sql.to_string(), s.clone());
        Ok(s)
    }

    async fn run(&mut self, op: Op) -> SqlResult<Answer> {
        let in_tx = self.in_tx.is_some();
        let out = self.run_op(op).await;
        if in_tx && self.in_tx.is_some() && out.is_err() {
            self.tx_failed = true;
        }
        out.map_err(|e| match e {
            SqlError::Postgres { message, .. } if busy(&message) => SqlError::Postgres {
                message,
                unreachable: true,
            },
            e => e,
        })
    }

    async fn run_op(&mut self, op: Op) -> SqlResult<Answer> {
        // A transaction whose connection was lost fails until it is rolled back.
        if self.in_tx == Some(false) && !matches!(op, Op::Rollback) {
            return Err(unreachable(
                "the connection to the database was lost inside a transaction",
            ));
        }
        match op {
            Op::Exclusive(key) => {
                self.exclusive = Some(key);
                let held = try_lock(self.client().await?, key).await?;
                Ok(Answer::Done(u64::from(held)))
            }
            Op::Begin(sql) => {
                self.tx_failed = false;
                let mut r = self
                    .client()
                    .await?
                    .batch_execute(sql)
                    .await
                    .map_err(pg_err);
                if matches!(
                    &r,
                    Err(SqlError::Postgres {
                        unreachable: true,
                        ..
                    })
                ) {
                    // The connection died while idle (a restart of PostgreSQL): nothing was
                    // begun on it; once more on a new one.
                    self.client = None;
                    r = self
                        .client()
                        .await?
                        .batch_execute(sql)
                        .await
                        .map_err(pg_err);
                }
                if r.is_ok() {
                    self.in_tx = Some(true);
                }
                r.map(|_| Answer::Done(0))
            }
            Op::Commit => {
                self.in_tx = None;
                let c = self
                    .client
                    .as_ref()
                    .ok_or_else(|| unreachable("no connection"))?;
                if std::mem::take(&mut self.tx_failed) {
                    let _ = c.batch_execute("ROLLBACK").await;
                    return Err(SqlError::Postgres {
                        message: "a statement of the transaction failed: rolled back".into(),
                        unreachable: false,
                    });
                }
                c.batch_execute("COMMIT")
                    .await
                    .map(|_| Answer::Done(0))
                    .map_err(|e| {
                        // The COMMIT was sent: whether it took is not known.
                        let e = pg_err(e);
                        match e {
                            SqlError::Postgres { unreachable: true, message } => SqlError::Postgres {
                                message: format!("the database did not confirm the commit ({message}): whether it was written is not known"),
                                unreachable: true,
                            },
                            e => e,
                        }
                    })
            }
            Op::Rollback => {
                let live = self.in_tx == Some(true);
                self.in_tx = None;
                self.tx_failed = false;
                match self.client.as_ref().filter(|c| live && !c.is_closed()) {
                    Some(c) => {
                        let _ = c.batch_execute("ROLLBACK").await;
                    }
                    None => {
                        self.client = None;
                    }
                }
                Ok(Answer::Done(0))
            }
            Op::Batch(sql) => self
                .client()
                .await?
                .batch_execute(&sql)
                .await
                .map(|_| Answer::Done(0))
                .map_err(pg_err),
            Op::Exec(sql, params) => {
                let st = self.statement(&sql).await?;
                let refs: Vec<&(dyn ToSql + Sync)> =
                    params.iter().map(|v| v as &(dyn ToSql + Sync)).collect();
                let c = self.client().await?;
                c.execute(&st, &refs)
                    .await
                    .map(Answer::Done)
                    .map_err(pg_err)
            }
            Op::Query(sql, params) => {
                let st = self.statement(&sql).await?;
                let refs: Vec<&(dyn ToSql + Sync)> =
                    params.iter().map(|v| v as &(dyn ToSql + Sync)).collect();
                let c = self.client().await?;
                let rows = c.query(&st, &refs).await.map_err(pg_err)?;
                let mut out = Vec::with_capacity(rows.len());
                for r in rows {
                    let mut vals = Vec::with_capacity(r.len());
                    for i in 0..r.len() {
                        vals.push(r.try_get::<_, Value>(i).map_err(pg_err)?);
                    }
                    out.push(Row(vals));
                }
                Ok(Answer::Rows(out))
            }
        }
    }
}

fn worker(
    config: tokio_postgres::Config,
    jobs: mpsc::Receiver<Job>,
    ready: mpsc::Sender<Result<(), String>>,
) {
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            let _ = ready.send(Err(e.to_string()));
            return;
        }
    };
    let mut link = Link {
        config,
        client: None,
        prepared: HashMap::new(),
        in_tx: None,
        tx_failed: false,
        exclusive: None,
    };
    let first = rt.block_on(async { link.client().await.map(|_| ()) });
    if let Err(e) = first {
        let _ = ready.send(Err(format!("cannot reach the store's database: {e}")));
        return;
    }
    let _ = ready.send(Ok(()));
    while let Ok(job) = jobs.recv() {
        let answer = rt.block_on(async {
            match tokio::time::timeout(STATEMENT_TIMEOUT + CONNECT_TIMEOUT, link.run(job.op)).await
            {
                Ok(a) => a,
                Err(_) => {
                    // The database stopped answering: drop the connection (the transaction on
                    // it is lost) and say so.
                    link.client = None;
                    if link.in_tx.is_some() {
                        link.in_tx = Some(false);
                    }
                    Err(unreachable("the database did not answer in time"))
                }
            }
        });
        let _ = job.reply.send(answer);
    }
}

impl ToSql for Value {
    fn to_sql(
        &self,
        ty: &Type,
        out: &mut bytes::BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        match self {
            Value::Null => Ok(IsNull::Yes),
            Value::Int(i) => match *ty {
                Type::INT8 => i.to_sql(ty, out),
                Type::INT4 => i32::try_from(*i)?.to_sql(ty, out),
                Type::INT2 => i16::try_from(*i)?.to_sql(ty, out),
                Type::BOOL => (*i != 0).to_sql(ty, out),
                _ => Err(format!("an integer cannot be bound to {ty}").into()),
            },
            // PostgreSQL refuses a NUL in text and aborts the whole transaction for it: refused
            // here, before it is sent, the transaction goes on (SQLite stores it).
            Value::Text(s) if s.contains('\0') => Err("text with a NUL byte".into()),
            Value::Text(s) => match *ty {
                Type::INT8 => s.parse::<i64>()?.to_sql(ty, out),
                Type::JSON => {
                    out.extend_from_slice(s.as_bytes());
                    Ok(IsNull::No)
                }
                Type::JSONB => {
                    out.extend_from_slice(&[1]);
                    out.extend_from_slice(s.as_bytes());
                    Ok(IsNull::No)
                }
                Type::TEXT | Type::VARCHAR | Type::BPCHAR | Type::NAME | Type::UNKNOWN => {
                    s.as_str().to_sql(ty, out)
                }
                _ => Err(format!("text cannot be bound to {ty}").into()),
            },
            Value::Blob(b) => match *ty {
                Type::BYTEA => b.as_slice().to_sql(ty, out),
                _ => Err(format!("bytes cannot be bound to {ty}").into()),
            },
        }
    }

    fn accepts(_: &Type) -> bool {
        true
    }

    tokio_postgres::types::to_sql_checked!();
}

impl<'a> FromSql<'a> for Value {
    fn from_sql(
        ty: &Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(match *ty {
            Type::INT8 => Value::Int(i64::from_sql(ty, raw)?),
            Type::INT4 => Value::Int(i32::from_sql(ty, raw)? as i64),
            Type::INT2 => Value::Int(i16::from_sql(ty, raw)? as i64),
            Type::BOOL => Value::Int(bool::from_sql(ty, raw)? as i64),
            Type::BYTEA => Value::Blob(raw.to_vec()),
            Type::JSONB => Value::Text(String::from_utf8(raw.get(1..).unwrap_or(&[]).to_vec())?),
            Type::NUMERIC => return Err("a NUMERIC column: cast it to bigint".into()),
            _ => Value::Text(String::from_utf8(raw.to_vec())?),
        })
    }

    fn from_sql_null(_: &Type) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(Value::Null)
    }

    fn accepts(_: &Type) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dialect_numbers_parameters_outside_quotes_only() {
        assert_eq!(
            dialect("SELECT a FROM t WHERE b = ?1 AND c = '?2' AND d = ?12 LIMIT -1 OFFSET ?3"),
            "SELECT a FROM t WHERE b = $1 AND c = '?2' AND d = $12 LIMIT ALL OFFSET $3"
        );
        assert_eq!(dialect("VALUES (?, ?)"), "VALUES ($1, $2)");
        assert_eq!(
            dialect("SELECT json_object('a', x)"),
            "SELECT json_build_object('a', x)"
        );
    }

    #[test]
    fn a_url_with_a_password_or_without_user_or_database_is_refused() {
        for (url, says) in [
            ("postgres://bca:secret@localhost/bca", "carries a password"),
            ("postgres://localhost/bca", "names no user"),
            ("postgres://bca@localhost", "names no database"),
            ("mysql://x", "not a PostgreSQL URL"),
        ] {
            let e = config(url, None).err().unwrap();
            assert!(e.contains(says), "{url}: {e}");
            assert!(!e.contains("secret"), "{e}");
        }
        // Only a Unix socket: a TCP host (loopback too), a hostaddr, no host at all.
        for url in [
            "postgres://bca@127.0.0.1:5433/site",
            "postgres://bca@localhost/site",
            "postgres://bca@db.example/site",
            "postgres://bca@%2Frun%2Fpostgresql/site?hostaddr=192.0.2.2",
            "postgres://bca@/site?hostaddr=192.0.2.2&port=5432",
        ] {
            let e = config(url, Some("pw")).err().unwrap_or_default();
            assert!(e.contains("through its Unix socket"), "{url}: {e}");
        }
        assert!(config("postgres://bca@%2Frun%2Fpostgresql:5433/site", Some("pw")).is_ok());
        // A URL that does not parse is never echoed (it may hold a password).
        for url in [
            "postgres://bca:s3cretPW@localhost:99999/bca",
            "postgres://bca@localhost/bca?password=s3cretPW&port=x",
            "host=localhost password=s3cretPW port=x",
        ] {
            let e = config(url, None).err().unwrap_or_default();
            assert!(!e.is_empty() && !e.contains("s3cretPW"), "{e}");
        }
    }
}
