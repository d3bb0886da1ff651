//! The `x509pop` attestor's rows: its challenges (60 s, used once, only a hash kept).

use crate::base::error::ApiResult;
use crate::store::Tx;
use crate::store::{params, OptionalExtension};

/// Records a challenge, first making room under the limits (`tpm::make_room`).
pub fn insert_challenge(
    tx: &Tx<'_>,
    (id, source, secret_sha256): (&str, &str, &[u8]),
    expires_at: i64,
    (per_source, open): (i64, i64),
    now: i64,
) -> ApiResult<()> {
    crate::store::tpm::make_room(tx, "x509pop_challenges", source, (per_source, open), now)?;
    crate::store::exec(
        tx,
        "INSERT INTO x509pop_challenges (id, source, secret_sha256, created_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, ?5)",
        params![id, source, secret_sha256, now, expires_at],
    )?;
    Ok(())
}

/// Takes a challenge: read and deleted (spent means gone). `(secret_sha256, expires_at)`.
pub fn take_challenge(tx: &Tx<'_>, id: &str) -> ApiResult<Option<(Vec<u8>, i64)>> {
    // One statement: a challenge two writers race for is taken by one of them only.
    Ok(crate::store::query_row(
        tx,
        "DELETE FROM x509pop_challenges WHERE id = ?1 RETURNING secret_sha256, expires_at",
        [id],
        |x| Ok((x.get(0)?, x.get(1)?)),
    )
    .optional()?)
}
