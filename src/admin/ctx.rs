//! What every admin method is given ([`Ctx`]: who calls, and when) and the helpers they share:
//! strict parsing of a body, and paging.

use crate::base::error::{ApiError, ApiResult};
use serde::de::DeserializeOwned;
use serde_json::{json, Value};

/// Who calls and when; passed in, never read from the environment.
pub struct Ctx<'a> {
    pub caller: &'a str,
    pub now: i64,
    pub site_id: &'a str,
    pub root_tenant: &'a str,
    /// The gateway's live sessions, closed when a node's identity is revoked.
    pub sessions: Option<&'a crate::base::registry::Registry>,
}

/// Parses a request body strictly; the error names the field (`expect.mac: invalid type ...`).
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> ApiResult<T> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        b"{}".as_slice()
    } else {
        body
    };
    // Nothing that could reach an operator's terminal raw is taken in (`text`).
    if let Some(path) = serde_json::from_slice::<Value>(body)
        .ok()
        .as_ref()
        .and_then(crate::base::text::first_control)
    {
        let field = if path.is_empty() {
            "the body"
        } else {
            path.trim_start_matches('.')
        };
        return Err(ApiError::invalid_input(format!(
            "invalid request body: {field} must be free of control characters (they could rewrite an operator's terminal)"
        )));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        if path == "." {
            ApiError::invalid_input(format!("invalid request body: {}", e.inner()))
        } else {
            ApiError::invalid_input(format!("invalid request body: {path}: {}", e.inner()))
        }
    })
}

/// The row sequence a list's cursor names (`None`: from the newest).
pub fn seq_cursor(cursor: Option<&str>, method: &str) -> ApiResult<i64> {
    match cursor {
        None => Ok(i64::MAX),
        Some(c) => c.parse().ok().filter(|v| *v > 0).ok_or_else(|| {
            ApiError::invalid_input(format!("cursor must be a cursor returned by {method}"))
        }),
    }
}

/// `{"items": [...], "cursor": ...}` from up to `limit + 1` rows.
pub fn page<K>(mut rows: Vec<(K, Value)>, limit: i64, cursor: impl Fn(&K) -> String) -> Value {
    let more = rows.len() as i64 > limit;
    rows.truncate(limit as usize);
    let next = if more {
        rows.last().map(|(k, _)| cursor(k))
    } else {
        None
    };
    json!({ "items": rows.into_iter().map(|(_, v)| v).collect::<Vec<_>>(), "cursor": next })
}
