//! The boot server's rows: boot leases (who booted what, when) and full DHCP mode's leases.

use crate::base::clock::rfc3339;
use crate::base::error::ApiResult;
use crate::store::params;
use crate::store::{Store, Tx};
use serde_json::{json, Value};

/// One boot lease row: who booted what, when. Returns its epoch.
pub fn lease_insert(
    store: &Store,
    (mac, ip, relay): (&str, Option<&str>, Option<&str>),
    arch: Option<u16>,
    stage: &str,
    file: Option<&str>,
    now: i64,
) -> ApiResult<i64> {
    store.write(|tx| {
        Ok(crate::store::query_row(
            tx,
            "INSERT INTO boot_leases (mac, ip, arch, stage, file, created_at, relay) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
             RETURNING epoch",
            params![mac, ip, arch, stage, file, now, relay],
            |r| r.get(0),
        )?)
    })
}

/// Boot leases before `before` (an epoch), of one MAC or all, newest first, at most `limit`:
/// `(epoch, row)` as `bootLeases.list` shows it.
pub fn leases(
    tx: &Tx<'_>,
    before: i64,
    mac: Option<&str>,
    limit: i64,
) -> ApiResult<Vec<(i64, Value)>> {
    let rows = crate::store::query_all(
        tx,
        "SELECT epoch, mac, ip, arch, stage, file, created_at, relay FROM boot_leases
         WHERE epoch < ?1 AND (CAST(?2 AS TEXT) IS NULL OR mac = ?2) ORDER BY epoch DESC LIMIT ?3",
        params![before, mac, limit],
        |r| {
            Ok((
                r.get::<_, i64>(0)?,
                json!({
                    "epoch": r.get::<_, i64>(0)?, "mac": r.get::<_, String>(1)?, "ip": r.get::<_, Option<String>>(2)?,
                    "arch": r.get::<_, Option<i64>>(3)?, "stage": r.get::<_, String>(4)?, "file": r.get::<_, Option<String>>(5)?,
                    "createdAt": rfc3339(r.get(6)?), "relay": r.get::<_, Option<String>>(7)?,
                }),
            ))
        },
    )?;
    Ok(rows)
}

/// Every DHCP lease: MAC, address, expiry.
pub fn dhcp_leases(store: &Store) -> ApiResult<Vec<(String, String, i64)>> {
    store.read(|tx| {
        Ok(crate::store::query_all(
            tx,
            "SELECT mac, ip, expires_at FROM dhcp_leases",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )?)
    })
}

/// A MAC's durable lease on `ip` until `until`; an expired lease of another MAC on the address
/// gives way, an unexpired one does not (the address's uniqueness refuses the lease: another
/// appliance of the site gave it first). Committed before the caller answers.
pub fn dhcp_lease(store: &Store, mac: &str, ip: &str, until: i64, now: i64) -> ApiResult<()> {
    store.write(|tx| {
        crate::store::exec(
            tx,
            "DELETE FROM dhcp_leases WHERE ip = ?1 AND mac != ?2 AND expires_at <= ?3",
            params![ip, mac, now],
        )?;
        crate::store::exec(
            tx,
            "INSERT INTO dhcp_leases (mac, ip, expires_at) VALUES (?1, ?2, ?3)
             ON CONFLICT (mac) DO UPDATE SET ip = excluded.ip, expires_at = excluded.expires_at",
            params![mac, ip, until],
        )?;
        Ok(())
    })
}
