//! Test support: a throwaway PostgreSQL cluster, made with the host's `initdb` and started on a
//! Unix socket in a temporary folder (no TCP), as the unprivileged `postgres` user when the tests
//! run as root (`initdb` refuses root). One cluster serves a test process; each test takes a new
//! database of its own. The cluster stops when the process that started it is gone (a watchdog
//! beside the server), and its folder is removed with it.
//!
//! Not used by the appliance: `make test` installs Debian's `postgresql` package for it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// A running cluster: its folder (data and socket) and port (the socket's name).
pub struct Cluster {
    pub dir: PathBuf,
    pub port: u16,
    /// The role the tests connect as (a superuser of the cluster, no password, local trust).
    pub user: &'static str,
}

/// PostgreSQL's programs: the newest `/usr/lib/postgresql/N/bin`, else the `PATH`.
fn bin(name: &str) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    dirs.sort();
    dirs.into_iter()
        .rev()
        .map(|d| d.join(name))
        .find(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from(name))
}

fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| std::os::unix::fs::MetadataExt::uid(&m) == 0)
        .unwrap_or(false)
}

/// A command run as the cluster's owner.
fn as_owner(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// The server's options: its socket alone (no TCP), in the cluster's folder, its owner's only.
fn server_options(dir: &Path, port: u16) -> String {
    format!(
        "-k '{}' -p {port} -c listen_addresses='' -c fsync=on -c max_connections=200 \
         -c shared_buffers=32MB -c unix_socket_permissions=0700",
        dir.display()
    )
}

impl Cluster {
    /// Stops the server at once, as a crash would (`pg_ctl stop -m immediate`); the cluster's
    /// folder stays, for [`Cluster::restart`].
    pub fn stop(&self) -> Result<(), String> {
        self.pg_ctl(&["-m", "immediate", "-w", "stop"])
    }

    /// Starts the stopped server again, on the same socket (the watchdog stops it with the test
    /// process as before).
    pub fn restart(&self) -> Result<(), String> {
        let options = server_options(&self.dir, self.port);
        let log = self.dir.join("log2");
        self.pg_ctl(&[
            "-o",
            &options,
            "-l",
            &log.display().to_string(),
            "-w",
            "start",
        ])
    }

    fn pg_ctl(&self, args: &[&str]) -> Result<(), String> {
        let o = as_owner(&bin("pg_ctl"))
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(args)
            .output()
            .map_err(|e| format!("pg_ctl: {e}"))?;
        if !o.status.success() {
            return Err(format!("pg_ctl: {}", String::from_utf8_lossy(&o.stderr)));
        }
        Ok(())
    }

    /// The process's cluster, started on first use.
    pub fn shared() -> &'static Cluster {
        static C: OnceLock<Cluster> = OnceLock::new();
        C.get_or_init(|| Cluster::start().unwrap_or_else(|e| panic!("PostgreSQL: {e}")))
    }

    /// Makes and starts a new cluster.
    pub fn start() -> Result<Cluster, String> {
        let mut r = [0u8; 6];
        crate::base::crypto::fill_random(&mut r);
        let dir = std::env::temp_dir().join(format!("bca-pg-{}", crate::base::crypto::hex(&r)));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        // The cluster trusts whoever reaches its socket: the folder is its owner's alone.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(|e| e.to_string())?;
        if is_root() {
            let o = Command::new("chown")
                .arg("postgres:postgres")
                .arg(&dir)
                .output()
                .map_err(|e| e.to_string())?;
            if !o.status.success() {
                return Err(format!(
                    "cannot give {} to the postgres user: {}",
                    dir.display(),
                    String::from_utf8_lossy(&o.stderr)
                ));
            }
        }
        let data = dir.join("data");
        let o = as_owner(&bin("initdb"))
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                "bca",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-instructions",
            ])
            .output()
            .map_err(|e| format!("initdb: {e} (is Debian's postgresql package installed?)"))?;
        if !o.status.success() {
            return Err(format!("initdb: {}", String::from_utf8_lossy(&o.stderr)));
        }
        let port = 5432;
        // The server, and beside it a watchdog that stops it once this process is gone.
        let script = format!(
            "'{postgres}' -D '{data}' {options} >'{dir}/log' 2>&1 & \
             while [ -d /proc/{me} ]; do sleep 1; done; \
             '{pg_ctl}' -D '{data}' -m immediate stop >/dev/null 2>&1; rm -rf '{dir}'",
            postgres = bin("postgres").display(),
            options = server_options(&dir, port),
            pg_ctl = bin("pg_ctl").display(),
            data = data.display(),
            dir = dir.display(),
            me = std::process::id(),
        );
        as_owner(Path::new("/bin/sh"))
            .args(["-c", &script])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        let c = Cluster {
            dir,
            port,
            user: "bca",
        };
        let t = std::time::Instant::now();
        while crate::store::pg::PgConn::connect(
            crate::store::pg::config(&c.url("postgres"), None).map_err(|e| e.to_string())?,
        )
        .is_err()
        {
            if t.elapsed() > std::time::Duration::from_secs(30) {
                return Err(format!(
                    "the cluster did not start: {}",
                    std::fs::read_to_string(c.dir.join("log")).unwrap_or_default()
                ));
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        Ok(c)
    }

    /// The URL of database `db` (its socket's folder percent-encoded as the host).
    pub fn url(&self, db: &str) -> String {
        let host = self.dir.display().to_string().replace('/', "%2F");
        format!("postgres://{}@{host}:{}/{db}", self.user, self.port)
    }

    /// A new, empty database: its URL.
    pub fn new_database(&self) -> String {
        let mut r = [0u8; 6];
        crate::base::crypto::fill_random(&mut r);
        let name = format!("t_{}", crate::base::crypto::hex(&r));
        let admin = crate::store::pg::PgConn::connect(
            crate::store::pg::config(&self.url("postgres"), None).expect("the cluster's URL"),
        )
        .expect("the cluster answers");
        admin
            .batch(&format!("CREATE DATABASE {name}"))
            .expect("CREATE DATABASE");
        self.url(&name)
    }
}
