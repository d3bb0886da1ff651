//! Join requests, as the `discovery` and `tpm` attestors keep them: a machine waiting for an
//! operator, its signed deferral, a rejection that refuses its CSR, and expiry.

use crate::base::crypto;
use crate::base::error::ApiResult;
use crate::join::issue::Signer;
use crate::join::site::Site;
use crate::proto::protocol::{JoinDeferral, JoinResponse, JOIN_DEFERRAL_PURPOSE};
use rusqlite::{params, OptionalExtension, Transaction};

/// Marks requests past their expiry `expired`.
pub fn expire(tx: &Transaction<'_>, now: i64) -> ApiResult<()> {
    crate::store::exec(tx,
        "UPDATE join_requests SET state = 'expired', updated_at = ?1 WHERE state IN ('pending', 'approved') AND expires_at <= ?1",
        [now],
    )?;
    Ok(())
}

pub(crate) fn deferral(
    site: &Site,
    signer: &Signer,
    request_id: &str,
    csr_sha256: &[u8; 32],
) -> JoinResponse {
    let body = JoinDeferral {
        request_id: request_id.to_string(),
        state: "pending".into(),
        retry_after_seconds: site.config.discovery.retry_after_seconds,
        csr_sha256: crypto::hex(csr_sha256),
        site_id: site.config.site_id.clone(),
    };
    signer.signed(JOIN_DEFERRAL_PURPOSE, &body)
}

/// Whether an operator rejected this machine's request for this CSR (a retry with it fails).
pub(crate) fn rejected(tx: &Transaction<'_>, machine_key: &str, csr_hex: &str) -> ApiResult<bool> {
    Ok(crate::store::query_row(tx,
            "SELECT id FROM join_requests WHERE machine_key = ?1 AND state = 'rejected' AND csr_sha256 = ?2",
            params![machine_key, csr_hex],
            |x| x.get::<_, String>(0),
        )
        .optional()?
        .is_some())
}

/// A machine's open request: id, state (`pending` or `approved`), pool, CSR hash.
pub(crate) type OpenRequest = (String, String, Option<String>, String);

/// A machine's newest open request.
pub(crate) fn open_request(
    tx: &Transaction<'_>,
    machine_key: &str,
) -> ApiResult<Option<OpenRequest>> {
    Ok(crate::store::query_row(tx,
            "SELECT id, state, pool_id, csr_sha256 FROM join_requests WHERE machine_key = ?1 AND state IN ('pending', 'approved')
             ORDER BY created_at DESC LIMIT 1",
            [machine_key],
            |x| Ok((x.get(0)?, x.get(1)?, x.get(2)?, x.get(3)?)),
        )
        .optional()?)
}
