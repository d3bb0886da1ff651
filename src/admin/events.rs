//! `events/list`: a tenant's event stream, newest first.

use crate::admin::ctx::{page, seq_cursor};
use crate::base::error::ApiResult;
use crate::domain::validate;
use crate::store::Tx;
use serde::Deserialize;
use serde_json::Value;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub(super) struct EventsListInput {
    tenant_id: Option<String>,
    #[serde(rename = "type")]
    type_prefix: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

pub(super) fn events_list(tx: &Tx<'_>, i: EventsListInput) -> ApiResult<Value> {
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
    let rows = crate::store::events::list(tx, before, i.tenant_id.as_deref(), &prefix, limit + 1)?;
    Ok(page(rows, limit, |seq| seq.to_string()))
}
