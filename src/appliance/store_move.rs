//! `bca store migrate --to postgres://…`: a SQLite appliance's whole state copied into an empty
//! PostgreSQL database, checked table by table, and the appliance pointed at it. The keys and
//! certificates stay on the box (only the database moves), so agents keep renewing against it
//! with nothing changed on their side. The SQLite file is kept beside, renamed, never deleted.

use crate::base::error::{ApiError, ApiResult};
use crate::config::{Config, StoreConfig};
use crate::store::Store;
use std::path::{Path, PathBuf};

/// What the move did: rows per table, and where the old file went.
pub struct Moved {
    pub copied: crate::store::maintenance::Copied,
    pub kept: PathBuf,
}

/// Moves the state directory's store to `to`. The appliance must be stopped (its admin socket
/// must not answer): rows written during the copy would be left behind.
pub fn migrate_to(state_dir: &Path, to: &StoreConfig, now: i64) -> ApiResult<Moved> {
    let mut config = Config::load(state_dir).map_err(ApiError::invalid_config)?;
    if !config.store.is_embedded() {
        return Err(ApiError::invalid_state(
            "the store is already PostgreSQL (config.toml [store]); nothing to migrate",
        ));
    }
    if to.is_embedded() {
        return Err(ApiError::invalid_input(
            "--to names the PostgreSQL database to move to (postgres://USER@HOST[:PORT]/DB)",
        ));
    }
    // Held for the whole move: no `bca serve` starts on this state directory meanwhile.
    let _lock = crate::base::fsutil::serve_lock(state_dir)
        .map_err(ApiError::internal)?
        .ok_or_else(|| {
            ApiError::invalid_state(
                "bca serve is running on this state directory (it holds the state directory's lock): stop it first, so that nothing is written during the copy",
            )
        })?;
    let db = state_dir.join("bca.db");
    let from = Store::open(&db, false).map_err(ApiError::invalid_state)?;
    let dest = Store::open_at(state_dir, to.at(), false).map_err(ApiError::unavailable)?;
    let copied = crate::store::maintenance::copy_all(&from, &dest)?;
    drop(from);
    config.store = to.clone();
    let text = config.to_file_text().map_err(ApiError::internal)?;
    crate::base::fsutil::write_atomic(&state_dir.join("config.toml"), text.as_bytes(), 0o600)
        .map_err(ApiError::internal)?;
    let kept = state_dir.join(format!("bca.db.migrated-{now}"));
    std::fs::rename(&db, &kept).map_err(ApiError::internal)?;
    for side in ["bca.db-wal", "bca.db-shm"] {
        let _ = std::fs::remove_file(state_dir.join(side));
    }
    Ok(Moved { copied, kept })
}
