//! Files with the modes secrets need, and a directory read only beneath itself (`ReadRoot`).

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};

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

/// A directory files are read beneath, held open: the network child cannot reach it by path.
#[derive(Debug)]
pub struct ReadRoot {
    dir: OwnedFd,
    path: PathBuf,
}

impl ReadRoot {
    /// Opens (creating it when missing) a directory to read beneath.
    pub fn open(path: &Path) -> Result<Self, String> {
        if !path.exists() {
            // Public files, read by the network child's user: 0755 whatever the umask.
            std::fs::create_dir_all(path)
                .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| format!("cannot set the mode of {}: {e}", path.display()))?;
        }
        let dir = std::fs::File::open(path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
        if !dir.metadata().map(|m| m.is_dir()).unwrap_or(false) {
            return Err(format!("{} is not a directory", path.display()));
        }
        Ok(Self {
            dir: dir.into(),
            path: path.to_path_buf(),
        })
    }

    /// A directory passed by the core; `path` is for messages only.
    pub fn from_fd(dir: OwnedFd, path: PathBuf) -> Self {
        Self { dir, path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.dir.as_fd()
    }

    /// Opens `rel` (relative, no `..`) for reading; only a regular file is returned.
    pub fn open_file(&self, rel: &Path) -> std::io::Result<std::fs::File> {
        let inside = !rel.as_os_str().is_empty()
            && rel.components().all(|c| matches!(c, Component::Normal(_)));
        if !inside {
            return Err(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                "names stay beneath the directory",
            ));
        }
        use rustix::fs::{Mode, OFlags, ResolveFlags};
        // The kernel keeps the lookup beneath the directory, symlinks included: a link in the
        // boot root to a key file is refused here, and by Landlock again in the network child.
        let fd = rustix::fs::openat2(
            &self.dir,
            rel,
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NOCTTY | OFlags::NONBLOCK,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        )?;
        let f = std::fs::File::from(fd);
        if !f.metadata()?.is_file() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "not a regular file",
            ));
        }
        Ok(f)
    }

    pub fn is_file(&self, rel: &str) -> bool {
        self.open_file(Path::new(rel)).is_ok()
    }
}

/// Symlinks in the boot root that lead out of it (or nowhere): the edge refuses them like
/// missing files, so `serve` and `doctor` name them. `(name, target)`, at the top level and one
/// level down.
pub fn links_out(root: &Path) -> Vec<(String, String)> {
    let Ok(canon) = std::fs::canonicalize(root) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let mut dirs = vec![(root.to_path_buf(), 0)];
    while let Some((dir, depth)) = dirs.pop() {
        let Ok(rd) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            let Ok(m) = std::fs::symlink_metadata(&p) else {
                continue;
            };
            if m.is_dir() && depth == 0 {
                dirs.push((p.clone(), 1));
            }
            if !m.file_type().is_symlink() {
                continue;
            }
            let target = std::fs::read_link(&p)
                .map(|t| t.display().to_string())
                .unwrap_or_default();
            let inside = std::fs::canonicalize(&p).is_ok_and(|t| t.starts_with(&canon));
            if !inside {
                let name = p.strip_prefix(root).unwrap_or(&p).display().to_string();
                out.push((name, target));
            }
        }
    }
    out.sort();
    out
}

/// The state directory's serve lock (an exclusive `flock` on the directory itself, held for as
/// long as the returned guard lives; no file is made): one `bca serve` per state directory, and
/// `bca store migrate` never copies under a running one (whatever admin socket it was given).
/// `None` when another process holds it.
pub fn serve_lock(state_dir: &Path) -> Result<Option<nix::fcntl::Flock<std::fs::File>>, String> {
    let p = state_dir;
    let f = std::fs::File::open(p).map_err(|e| format!("cannot open {}: {e}", p.display()))?;
    match nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(l) => Ok(Some(l)),
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => Ok(None),
        Err((_, e)) => Err(format!("cannot lock {}: {e}", p.display())),
    }
}
