//! The store's statements, engine-neutral: values bound and read as one of four kinds (null,
//! integer, text, bytes), rows as owned values, and the few calls the store's modules make
//! (`exec`, `query_row`, `query_all`). Each engine (`rusqlite` here, PostgreSQL in
//! [`crate::store::pg`]) turns them into its own types; the statements are written in SQLite's
//! dialect and the PostgreSQL engine rewrites the little that differs (`pg::dialect`).

use crate::base::error::{ApiError, Code};

/// A value bound to a statement or read from a row.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Null,
    Int(i64),
    Text(String),
    Blob(Vec<u8>),
}

/// Why a statement failed.
#[derive(Debug)]
pub enum SqlError {
    /// `query_row` found no row.
    NoRows,
    /// A column was not of the type asked for.
    Type {
        col: usize,
        want: &'static str,
    },
    Sqlite(rusqlite::Error),
    /// PostgreSQL refused the statement, or the connection failed (`unreachable`).
    Postgres {
        message: String,
        unreachable: bool,
    },
}

pub type SqlResult<T> = Result<T, SqlError>;

impl std::fmt::Display for SqlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SqlError::NoRows => write!(f, "no row"),
            SqlError::Type { col, want } => write!(f, "column {col} is not {want}"),
            SqlError::Sqlite(e) => write!(f, "sqlite: {e}"),
            SqlError::Postgres { message, .. } => write!(f, "postgres: {message}"),
        }
    }
}

impl From<rusqlite::Error> for SqlError {
    fn from(e: rusqlite::Error) -> Self {
        match e {
            rusqlite::Error::QueryReturnedNoRows => SqlError::NoRows,
            e => SqlError::Sqlite(e),
        }
    }
}

/// What a transaction PostgreSQL chose to abort for a concurrent one (a deadlock, a
/// serialization failure) answers: nothing was written, and running it again is right.
pub const GAVE_WAY: &str =
    "the database aborted this transaction in favour of a concurrent one (deadlock or serialization failure): nothing was written";

/// Whether `e` is [`GAVE_WAY`]: the JoinService runs such a batch again rather than answer it.
pub fn gave_way(e: &ApiError) -> bool {
    e.code == Code::Unavailable && e.message == GAVE_WAY
}

impl From<SqlError> for ApiError {
    fn from(e: SqlError) -> Self {
        match e {
            SqlError::Sqlite(e) => e.into(),
            SqlError::Postgres { message, .. }
                if message.starts_with("40001:") || message.starts_with("40P01:") =>
            {
                ApiError::new(Code::Unavailable, GAVE_WAY)
            }
            SqlError::Postgres {
                unreachable: true,
                message,
            } if message.contains("is not known") => ApiError::new(
                Code::Unavailable,
                "the database did not confirm the commit: whether it was written is not known; the appliance reconnects by itself",
            ),
            SqlError::Postgres {
                unreachable: true, ..
            } => ApiError::new(
                Code::Unavailable,
                "the database is unreachable or busy: nothing was written; the appliance reconnects by itself",
            ),
            e => ApiError::internal(e.to_string()),
        }
    }
}

/// `query_row`'s "no row" as `None` (rusqlite's extension of the same name, for both engines).
pub trait OptionalExtension<T> {
    fn optional(self) -> SqlResult<Option<T>>;
}

impl<T> OptionalExtension<T> for SqlResult<T> {
    fn optional(self) -> SqlResult<Option<T>> {
        match self {
            Ok(v) => Ok(Some(v)),
            Err(SqlError::NoRows) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// What can be bound to a statement.
pub trait ToValue {
    fn to_value(&self) -> Value;
}

impl<T: ToValue + ?Sized> ToValue for &T {
    fn to_value(&self) -> Value {
        (**self).to_value()
    }
}
impl<T: ToValue> ToValue for Option<T> {
    fn to_value(&self) -> Value {
        self.as_ref().map_or(Value::Null, ToValue::to_value)
    }
}
impl ToValue for Value {
    fn to_value(&self) -> Value {
        self.clone()
    }
}
impl ToValue for str {
    fn to_value(&self) -> Value {
        Value::Text(self.to_string())
    }
}
impl ToValue for String {
    fn to_value(&self) -> Value {
        Value::Text(self.clone())
    }
}
impl ToValue for [u8] {
    fn to_value(&self) -> Value {
        Value::Blob(self.to_vec())
    }
}
impl ToValue for Vec<u8> {
    fn to_value(&self) -> Value {
        Value::Blob(self.clone())
    }
}
impl ToValue for bool {
    fn to_value(&self) -> Value {
        Value::Int(i64::from(*self))
    }
}
macro_rules! int_to_value {
    ($($t:ty),*) => {$(
        impl ToValue for $t {
            fn to_value(&self) -> Value {
                Value::Int(*self as i64)
            }
        }
    )*};
}
int_to_value!(i64, i32, i16, u8, u16, u32, usize, u64);

/// What a column can be read as.
pub trait FromValue: Sized {
    fn from_value(v: &Value, col: usize) -> SqlResult<Self>;
}

impl FromValue for Value {
    fn from_value(v: &Value, _: usize) -> SqlResult<Self> {
        Ok(v.clone())
    }
}
impl<T: FromValue> FromValue for Option<T> {
    fn from_value(v: &Value, col: usize) -> SqlResult<Self> {
        match v {
            Value::Null => Ok(None),
            v => T::from_value(v, col).map(Some),
        }
    }
}
impl FromValue for String {
    fn from_value(v: &Value, col: usize) -> SqlResult<Self> {
        match v {
            Value::Text(s) => Ok(s.clone()),
            _ => Err(SqlError::Type { col, want: "text" }),
        }
    }
}
impl FromValue for Vec<u8> {
    fn from_value(v: &Value, col: usize) -> SqlResult<Self> {
        match v {
            Value::Blob(b) => Ok(b.clone()),
            _ => Err(SqlError::Type { col, want: "bytes" }),
        }
    }
}
impl FromValue for bool {
    fn from_value(v: &Value, col: usize) -> SqlResult<Self> {
        i64::from_value(v, col).map(|i| i != 0)
    }
}
macro_rules! int_from_value {
    ($($t:ty),*) => {$(
        impl FromValue for $t {
            fn from_value(v: &Value, col: usize) -> SqlResult<Self> {
                match v {
                    Value::Int(i) => <$t>::try_from(*i).map_err(|_| SqlError::Type {
                        col,
                        want: stringify!($t),
                    }),
                    _ => Err(SqlError::Type { col, want: "an integer" }),
                }
            }
        }
    )*};
}
int_from_value!(i64, i32, u8, u16, u32, usize, u64);

/// A row read: its values, owned.
#[derive(Debug, Clone)]
pub struct Row(pub(in crate::store) Vec<Value>);

/// A column's index (as rusqlite's, so that `row.get(0)` reads the same with either engine).
pub trait RowIndex {
    fn index(self) -> usize;
}
impl RowIndex for usize {
    fn index(self) -> usize {
        self
    }
}
impl RowIndex for i32 {
    fn index(self) -> usize {
        self as usize
    }
}

impl Row {
    pub fn get<I: RowIndex, T: FromValue>(&self, i: I) -> SqlResult<T> {
        let i = i.index();
        match self.0.get(i) {
            Some(v) => T::from_value(v, i),
            None => Err(SqlError::Type {
                col: i,
                want: "a column of the row",
            }),
        }
    }
}

/// A statement's parameters: `[]`, an array of one kind, or `params![a, b, ...]`.
pub trait Params {
    fn values(&self) -> Vec<Value>;
}

impl Params for [&dyn ToValue; 0] {
    fn values(&self) -> Vec<Value> {
        Vec::new()
    }
}
impl Params for &[Value] {
    fn values(&self) -> Vec<Value> {
        self.to_vec()
    }
}
impl Params for &[&dyn ToValue] {
    fn values(&self) -> Vec<Value> {
        self.iter().map(|v| v.to_value()).collect()
    }
}
macro_rules! array_params {
    ($($n:literal),*) => {$(
        impl<T: ToValue> Params for [T; $n] {
            fn values(&self) -> Vec<Value> {
                self.iter().map(ToValue::to_value).collect()
            }
        }
    )*};
}
array_params!(1, 2, 3, 4, 5, 6, 7, 8);

/// Parameters of several kinds, as rusqlite's `params!`.
macro_rules! params {
    () => { &[] as &[&dyn $crate::store::sql::ToValue] };
    ($($x:expr),+ $(,)?) => { &[$(&$x as &dyn $crate::store::sql::ToValue),+] as &[&dyn $crate::store::sql::ToValue] };
}
pub(crate) use params;

impl rusqlite::ToSql for Value {
    fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
        use rusqlite::types::{ToSqlOutput, ValueRef};
        Ok(ToSqlOutput::Borrowed(match self {
            Value::Null => ValueRef::Null,
            Value::Int(i) => ValueRef::Integer(*i),
            Value::Text(s) => ValueRef::Text(s.as_bytes()),
            Value::Blob(b) => ValueRef::Blob(b),
        }))
    }
}

/// A SQLite row's values.
pub(in crate::store) fn sqlite_row(r: &rusqlite::Row<'_>, n: usize) -> rusqlite::Result<Row> {
    use rusqlite::types::ValueRef;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(match r.get_ref(i)? {
            ValueRef::Null => Value::Null,
            ValueRef::Integer(i) => Value::Int(i),
            // No column of the schema is REAL; an aggregate that gives one is read whole.
            ValueRef::Real(f) => Value::Int(f as i64),
            ValueRef::Text(t) => Value::Text(String::from_utf8_lossy(t).into_owned()),
            ValueRef::Blob(b) => Value::Blob(b.to_vec()),
        });
    }
    Ok(Row(out))
}
