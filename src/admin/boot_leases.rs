//! `bootLeases/list` (`bca boot leases`): who booted what, when, newest first.

use serde::Deserialize;

/// `bootLeases.list`: who booted what, when (newest first).
pub fn dispatch(
    store: &crate::store::Store,
    path: &str,
    body: &[u8],
) -> Option<crate::base::error::ApiResult<serde_json::Value>> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase", deny_unknown_fields)]
    struct ListInput {
        mac: Option<String>,
        limit: Option<i64>,
        cursor: Option<String>,
    }
    if path != "bootLeases/list" {
        return None;
    }
    Some(crate::admin::ctx::parse::<ListInput>(body).and_then(|i| {
        let limit = i.limit.unwrap_or(100);
        crate::domain::validate::range("limit", limit, 1, 200)?;
        let mac = match &i.mac {
            Some(m) => Some(crate::proto::claims::loose_mac(m).ok_or_else(|| {
                crate::base::error::ApiError::invalid_input(
                    "mac must be a MAC address such as aa:bb:cc:dd:ee:ff",
                )
            })?),
            None => None,
        };
        let before: i64 = match &i.cursor {
            Some(c) => c.parse().map_err(|_| {
                crate::base::error::ApiError::invalid_input(
                    "cursor must be a cursor returned by bootLeases.list",
                )
            })?,
            None => i64::MAX,
        };
        store.read(|tx| {
            let rows = crate::store::boot::leases(tx, before, mac.as_deref(), limit + 1)?;
            Ok(crate::admin::ctx::page(rows, limit, |epoch| {
                epoch.to_string()
            }))
        })
    }))
}
