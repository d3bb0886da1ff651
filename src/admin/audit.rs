//! The audit trail: `audit/list` (`bca audit list`), filtered by action, actor, target and time.

use crate::admin::ctx::page;
use crate::admin::ctx::Ctx;
use crate::base::error::{ApiError, ApiResult};
use crate::domain::validate;
use crate::store::Store;
use crate::store::Tx;
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AuditListInput {
    tenant_id: Option<String>,
    /// Only actions starting with this (`joinTokens.`, `retention.pruned`).
    action: Option<String>,
    /// Only rows at or after this time (RFC 3339).
    since: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

pub fn dispatch(
    store: &Store,
    _ctx: &Ctx<'_>,
    path: &str,
    body: &[u8],
) -> Option<ApiResult<Value>> {
    match path {
        "audit/list" => {
            Some(crate::admin::ctx::parse(body).and_then(|i| store.read(|tx| list(tx, i))))
        }
        _ => None,
    }
}

/// An age such as `90m`, `24h` or `7d`, in seconds (for `--since`).
pub fn parse_age(s: &str) -> Option<i64> {
    let unit = s.chars().last()?;
    let n: i64 = s[..s.len() - unit.len_utf8()]
        .parse()
        .ok()
        .filter(|n| (1..=1_000_000).contains(n))?;
    Some(
        n * match unit {
            's' => 1,
            'm' => 60,
            'h' => 3_600,
            'd' => 86_400,
            _ => return None,
        },
    )
}

/// Parses an RFC 3339 time (`2026-12-03T10:00:00Z`, offsets allowed) into Unix seconds.
pub fn parse_time(field: &str, s: &str) -> ApiResult<i64> {
    time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .map(|t| t.unix_timestamp())
        .map_err(|_| {
            ApiError::invalid_input(format!(
                "{field} must be an RFC 3339 time such as 2026-12-03T10:00:00Z"
            ))
        })
}

fn list(tx: &Tx<'_>, i: AuditListInput) -> ApiResult<Value> {
    if let Some(t) = &i.tenant_id {
        validate::tenant_id("tenantId", t)?;
    }
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    if let Some(a) = &i.action {
        validate::prefix("action", a, 1)?;
    }
    let since = match &i.since {
        Some(s) => parse_time("since", s)?,
        None => i64::MIN,
    };
    let before = crate::admin::ctx::seq_cursor(i.cursor.as_deref(), "audit.list")?;
    let prefix = i.action.unwrap_or_default();
    let rows = crate::store::events::audit_list(
        tx,
        before,
        i.tenant_id.as_deref(),
        &prefix,
        since,
        limit + 1,
    )?;
    Ok(page(rows, limit, |seq| seq.to_string()))
}
