//! `events/list`: a tenant's event stream, newest first.

use crate::admin::ctx::{page, seq_cursor};
use crate::base::clock::rfc3339;
use crate::base::error::ApiResult;
use crate::domain::validate;
use rusqlite::{params, Transaction};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct EventsListInput {
    tenant_id: Option<String>,
    #[serde(rename = "type")]
    type_prefix: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

pub(super) fn events_list(tx: &Transaction<'_>, i: EventsListInput) -> ApiResult<Value> {
    if let Some(t) = &i.tenant_id {
        validate::tenant_id("tenantId", t)?;
    }
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    if let Some(p) = &i.type_prefix {
        validate::prefix("type", p, 0)?;
    }
    let before = seq_cursor(i.cursor.as_deref(), "events.list")?;
    let prefix = i.type_prefix.unwrap_or_default();
    let mut st = tx.prepare(
        "SELECT seq, id, tenant_id, type, data, created_at FROM events
         WHERE seq < ?1 AND (?2 IS NULL OR tenant_id = ?2) AND substr(type, 1, length(?3)) = ?3
         ORDER BY seq DESC LIMIT ?4",
    )?;
    let rows = st
        .query_map(params![before, i.tenant_id, prefix, limit + 1], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                json!({
                    "id": r.get::<_, String>(1)?,
                    "tenantId": r.get::<_, String>(2)?,
                    "type": r.get::<_, String>(3)?,
                    "data": serde_json::from_str::<Value>(&r.get::<_, String>(4)?).unwrap_or(Value::Null),
                    "createdAt": rfc3339(r.get(5)?),
                }),
            ))
        })?
        .collect::<Result<Vec<_>, _>>()?;
    Ok(page(rows, limit, |seq| seq.to_string()))
}
