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
                crate::base::error::ApiError::invalid_input("mac must be a MAC address such as aa:bb:cc:dd:ee:ff")
            })?),
            None => None,
        };
        let before: i64 = match &i.cursor {
            Some(c) => c
                .parse()
                .map_err(|_| crate::base::error::ApiError::invalid_input("cursor must be a cursor returned by bootLeases.list"))?,
            None => i64::MAX,
        };
        store.read(|tx| {
            let mut st = tx.prepare(
                "SELECT epoch, mac, ip, arch, stage, file, created_at FROM boot_leases
                 WHERE epoch < ?1 AND (?2 IS NULL OR mac = ?2) ORDER BY epoch DESC LIMIT ?3",
            )?;
            let rows: Vec<(i64, serde_json::Value)> = st
                .query_map(rusqlite::params![before, mac, limit + 1], |r| {
                    Ok((r.get::<_, i64>(0)?, serde_json::json!({
                        "epoch": r.get::<_, i64>(0)?, "mac": r.get::<_, String>(1)?, "ip": r.get::<_, Option<String>>(2)?,
                        "arch": r.get::<_, Option<i64>>(3)?, "stage": r.get::<_, String>(4)?, "file": r.get::<_, Option<String>>(5)?,
                        "createdAt": crate::base::clock::rfc3339(r.get(6)?),
                    })))
                })?
                .collect::<Result<_, _>>()?;
            Ok(crate::admin::ctx::page(rows, limit, |epoch| epoch.to_string()))
        })
    }))
}
