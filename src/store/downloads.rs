//! The agent downloads' recorded hashes.

use crate::base::clock::rfc3339;
use crate::base::error::ApiResult;
use crate::domain::downloads::{valid_version, ARCHES};
use crate::store::{params, OptionalExtension};
use crate::store::{Store, Tx};
use serde_json::{json, Value};

/// The SHA-256 recorded when the file was added.
pub fn recorded_sha(store: &Store, version: &str, arch: &str) -> Option<String> {
    if !valid_version(version) || !ARCHES.contains(&arch) {
        return None;
    }
    store
        .read(|tx| {
            Ok(crate::store::query_row(
                tx,
                "SELECT sha256 FROM downloads WHERE product = 'bcd' AND version = ?1 AND arch = ?2",
                [version, arch],
                |r| r.get(0),
            )
            .optional()?)
        })
        .ok()?
}

/// Every recorded download, as `downloads.list` shows it.
pub fn list(tx: &Tx<'_>) -> ApiResult<Vec<Value>> {
    let items = crate::store::query_all(tx, "SELECT product, version, arch, sha256, size, added_at FROM downloads ORDER BY product, version, arch", [], |r| {
            Ok(json!({"product": r.get::<_, String>(0)?, "version": r.get::<_, String>(1)?, "arch": r.get::<_, String>(2)?,
                "sha256": r.get::<_, String>(3)?, "size": r.get::<_, i64>(4)?, "addedAt": rfc3339(r.get(5)?)}))
        })?;
    Ok(items)
}

/// The recorded SHA-256 of `bcd` `version` for `arch`, in a transaction.
pub fn sha_of(tx: &Tx<'_>, version: &str, arch: &str) -> ApiResult<Option<String>> {
    Ok(crate::store::query_row(
        tx,
        "SELECT sha256 FROM downloads WHERE product = 'bcd' AND version = ?1 AND arch = ?2",
        [version, arch],
        |r| r.get(0),
    )
    .optional()?)
}

/// A `bcd` file added: its version, arch, SHA-256 and size, by whom.
pub fn insert(
    tx: &Tx<'_>,
    (version, arch): (&str, &str),
    (sha256, size): (&str, i64),
    (now, by): (i64, &str),
) -> ApiResult<()> {
    crate::store::exec(tx,
        "INSERT INTO downloads (product, version, arch, sha256, size, added_at, added_by) VALUES ('bcd', ?1, ?2, ?3, ?4, ?5, ?6)",
        params![version, arch, sha256, size, now, by],
    )?;
    Ok(())
}
