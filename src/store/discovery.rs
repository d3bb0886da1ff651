//! Discovery tokens: minted by the boot server for a MAC, spent by the ramdisk's join.

use crate::base::error::ApiResult;
use crate::store::Tx;
use crate::store::{params, OptionalExtension};

/// A MAC's unspent tokens voided, except one whose request an operator approved.
pub fn void_for_mac(tx: &Tx<'_>, mac: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(tx,
        "UPDATE discovery_tokens SET voided_at = ?2 WHERE mac = ?1 AND spent_at IS NULL AND voided_at IS NULL
         AND id NOT IN (SELECT token_id FROM join_requests WHERE state = 'approved' AND token_id IS NOT NULL)",
        params![mac, now],
    )?;
    Ok(())
}

pub struct NewToken<'a> {
    pub id: &'a str,
    pub site_id: &'a str,
    pub mac: &'a str,
    pub secret_sha256: &'a [u8],
    pub boot_lease_epoch: Option<i64>,
    pub expires_at: i64,
    pub sighted_ip: Option<&'a str>,
}

pub fn insert(tx: &Tx<'_>, t: &NewToken<'_>, now: i64) -> ApiResult<()> {
    crate::store::exec(tx,
        "INSERT INTO discovery_tokens (id, site_id, mac, secret_sha256, boot_lease_epoch, created_at, expires_at, sighted_ip)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        params![t.id, t.site_id, t.mac, t.secret_sha256, t.boot_lease_epoch, now, t.expires_at, t.sighted_ip],
    )?;
    Ok(())
}

pub struct Token {
    pub mac: String,
    pub secret_sha256: Vec<u8>,
    pub boot_lease_epoch: Option<i64>,
    pub expires_at: i64,
    pub spent: bool,
    pub voided: bool,
    /// Minted for an address the network saw the MAC at.
    pub sighted: bool,
}

pub fn get(tx: &Tx<'_>, id: &str) -> ApiResult<Option<Token>> {
    Ok(crate::store::query_row(tx,
            "SELECT mac, secret_sha256, boot_lease_epoch, expires_at, spent_at, voided_at, sighted_ip FROM discovery_tokens WHERE id = ?1",
            [id],
            |x| {
                Ok(Token {
                    mac: x.get(0)?,
                    secret_sha256: x.get(1)?,
                    boot_lease_epoch: x.get(2)?,
                    expires_at: x.get(3)?,
                    spent: x.get::<_, Option<i64>>(4)?.is_some(),
                    voided: x.get::<_, Option<i64>>(5)?.is_some(),
                    sighted: x.get::<_, Option<String>>(6)?.is_some(),
                })
            },
        )
        .optional()?)
}

pub fn spend(tx: &Tx<'_>, id: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE discovery_tokens SET spent_at = ?2 WHERE id = ?1 AND spent_at IS NULL",
        params![id, now],
    )?;
    Ok(())
}
