//! Files with the modes secrets need.

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Creates `dir` (and parents) with mode 0700, or tightens an existing one to 0700.
pub fn create_private_dir(dir: &Path) -> Result<(), String> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
        .map_err(|e| format!("cannot set the mode of {}: {e}", dir.display()))
}

/// Writes a new file with `mode`, refusing to write over an existing one.
pub fn write_new(path: &Path, bytes: &[u8], mode: u32) -> Result<(), String> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                format!("{} already exists; it was not written over", path.display())
            } else {
                format!("cannot create {}: {e}", path.display())
            }
        })?;
    f.write_all(bytes)
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    // The umask may have narrowed the mode further; make it exact.
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).map_err(|e| e.to_string())
}

pub fn write_new_private(path: &Path, bytes: &[u8]) -> Result<(), String> {
    write_new(path, bytes, 0o600)
}

/// Replaces `path` atomically: a crash leaves either the old or the new contents.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> Result<(), String> {
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let _ = fs::remove_file(&tmp);
    write_new(&tmp, bytes, mode)?;
    fs::rename(&tmp, path).map_err(|e| format!("cannot replace {}: {e}", path.display()))?;
    if let Some(parent) = path.parent() {
        if let Ok(d) = fs::File::open(parent) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// The effective uid of this process (read from `/proc/self`, which needs no `unsafe`).
pub fn own_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX)
}

/// After root opened a database owned by the service user (`bca doctor`, `bca backup` on a
/// stopped appliance), SQLite may have created `-wal` and `-shm` files owned by root, which the
/// service could then not open. Gives them the database's owner.
pub fn align_db_sidecars(db: &Path) {
    use std::os::unix::fs::MetadataExt;
    if own_uid() != 0 {
        return;
    }
    let Ok(m) = fs::metadata(db) else {
        return;
    };
    for ext in ["-wal", "-shm"] {
        let mut p = db.as_os_str().to_owned();
        p.push(ext);
        let p = Path::new(&p);
        if fs::metadata(p).is_ok_and(|s| s.uid() != m.uid() || s.gid() != m.gid()) {
            let _ = std::os::unix::fs::chown(p, Some(m.uid()), Some(m.gid()));
        }
    }
}
