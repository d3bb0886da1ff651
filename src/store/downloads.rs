//! The agent downloads' recorded hashes.

use crate::domain::downloads::{valid_version, ARCHES};
use crate::store::Store;
use rusqlite::OptionalExtension;

/// The SHA-256 recorded when the file was added.
pub fn recorded_sha(store: &Store, version: &str, arch: &str) -> Option<String> {
    if !valid_version(version) || !ARCHES.contains(&arch) {
        return None;
    }
    store
        .read(|tx| {
            Ok(tx
                .query_row("SELECT sha256 FROM downloads WHERE product = 'bcd' AND version = ?1 AND arch = ?2", [version, arch], |r| r.get(0))
                .optional()?)
        })
        .ok()?
}
