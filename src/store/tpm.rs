//! The `tpm` attestor's rows: its challenges (60 s, used once) and the EK allow-list's pool.

use crate::base::error::ApiResult;
use crate::store::Tx;
use crate::store::{params, OptionalExtension};

pub struct NewChallenge<'a> {
    pub id: &'a str,
    /// What limits count by (an address, or an IPv6 /64).
    pub source: &'a str,
    pub ek_sha256: &'a str,
    pub ak_name_hex: &'a str,
    pub secret_sha256: &'a [u8],
    pub ek_certified: bool,
    pub expires_at: i64,
}

/// Records a challenge, first dropping the expired ones and making room under the limits: the
/// source's oldest past `per_source`, then the oldest of all past `open`.
pub fn insert_challenge(
    tx: &Tx<'_>,
    c: &NewChallenge<'_>,
    (per_source, open): (i64, i64),
    now: i64,
) -> ApiResult<()> {
    make_room(tx, "tpm_challenges", c.source, (per_source, open), now)?;
    crate::store::exec(tx,
        "INSERT INTO tpm_challenges (id, source, ek_sha256, ak_name, secret_sha256, ek_certified, created_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        params![c.id, c.source, c.ek_sha256, c.ak_name_hex, c.secret_sha256, c.ek_certified as i64, now, c.expires_at],
    )?;
    Ok(())
}

/// Before a challenge is recorded in `table` (`tpm_challenges`, `x509pop_challenges`): the
/// expired ones dropped, then the source's oldest past `per_source`, then the oldest of all past
/// `open`, so a flood never locks the attestor for everyone.
pub(in crate::store) fn make_room(
    tx: &Tx<'_>,
    table: &'static str,
    source: &str,
    (per_source, open): (i64, i64),
    now: i64,
) -> ApiResult<()> {
    crate::store::exec(
        tx,
        &format!("DELETE FROM {table} WHERE expires_at <= ?1"),
        [now],
    )?;
    crate::store::exec(
        tx,
        &format!(
            "DELETE FROM {table} WHERE id IN (SELECT id FROM {table} WHERE source = ?1
             ORDER BY rowid DESC LIMIT -1 OFFSET ?2)"
        ),
        params![source, per_source - 1],
    )?;
    crate::store::exec(
        tx,
        &format!(
            "DELETE FROM {table} WHERE id IN (SELECT id FROM {table}
             ORDER BY rowid DESC LIMIT -1 OFFSET ?1)"
        ),
        [open - 1],
    )?;
    Ok(())
}

/// An open challenge as recorded.
pub struct Challenge {
    pub ek_sha256: String,
    pub ak_name_hex: String,
    pub secret_sha256: Vec<u8>,
    pub expires_at: i64,
    pub ek_certified: bool,
}

/// Takes a challenge: read and deleted (spent means gone), or `None`.
pub fn take_challenge(tx: &Tx<'_>, id: &str) -> ApiResult<Option<Challenge>> {
    // One statement: a challenge two writers race for is taken by one of them only.
    Ok(crate::store::query_row(tx,
            "DELETE FROM tpm_challenges WHERE id = ?1 RETURNING ek_sha256, ak_name, secret_sha256, expires_at, ek_certified",
            [id],
            |x| Ok(Challenge {
                ek_sha256: x.get(0)?,
                ak_name_hex: x.get(1)?,
                secret_sha256: x.get(2)?,
                expires_at: x.get(3)?,
                ek_certified: x.get::<_, i64>(4)? == 1,
            }),
        )
        .optional()?)
}

/// The pool an allow-listed EK joins.
pub fn allowed_pool(tx: &Tx<'_>, ek_sha256: &str) -> ApiResult<Option<String>> {
    Ok(crate::store::query_row(
        tx,
        "SELECT pool_id FROM tpm_eks WHERE ek_sha256 = ?1",
        [ek_sha256],
        |x| x.get(0),
    )
    .optional()?)
}
