//! The harness: an appliance on a temporary state directory, the CLI, the admin API, the database.

#![allow(dead_code)]

use bca::base::crypto::{self, SigningKey};
use bca::base::error::ApiError;
use bca::cli::client::Client;
use bca::proto::agent_config::AgentConfig;
use bca::proto::protocol::{JoinRequest, JoinResponseBody, Reply, Request};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_bca")
}

pub const PASSPHRASE: &str = "correct horse battery staple";

pub struct Appliance {
    pub dir: tempfile::TempDir,
    pub child: Option<Child>,
    pub http: String,
    pub gateway: String,
    pub socket: PathBuf,
    pub init_stdout: String,
}

/// `bca init` on a new temporary directory.
/// The engine the suite runs the appliance on: `BCA_TEST_STORE=postgres` puts every site the
/// tests init into a new database of the test process's PostgreSQL cluster (`make test` runs the
/// admission, renewal, discovery, TPM, rotation and retention suites so, beside SQLite).
/// A test whose subject is the SQLite file itself (its backup, its pages) passes `SQLITE` in
/// its init arguments: it stays on SQLite whatever the suite's engine.
pub fn test_store_args(extra: &[&str]) -> Vec<String> {
    let on_pg = std::env::var("BCA_TEST_STORE").is_ok_and(|v| v == "postgres");
    if on_pg && !extra.contains(&"--store") && !extra.contains(&SQLITE) {
        let url = bca::store::pg_cluster::Cluster::shared().new_database();
        vec!["--store".into(), url]
    } else {
        Vec::new()
    }
}

pub use bca::store::sql::Value as V;

/// A site's database, live: SQLite's file or PostgreSQL's connection.
pub enum Live {
    Sqlite(rusqlite::Connection),
    Postgres(bca::store::pg::PgConn),
}

impl Live {
    /// The one integer `sql` answers.
    pub fn count(&self, sql: &str) -> i64 {
        match self {
            Live::Sqlite(c) => c.query_row(sql, [], |r| r.get(0)).unwrap(),
            Live::Postgres(p) => p.query(sql, Vec::new()).unwrap()[0].get(0).unwrap(),
        }
    }

    /// Runs `sql` with text parameters (`?1`, ...).
    pub fn execute(&self, sql: &str, params: &[&str]) -> usize {
        let values: Vec<V> = params.iter().map(|s| V::Text(s.to_string())).collect();
        self.execute_values(sql, &values)
    }

    /// Runs `sql` with parameters of any kind.
    pub fn execute_values(&self, sql: &str, params: &[V]) -> usize {
        match self {
            Live::Sqlite(c) => c
                .execute(sql, rusqlite::params_from_iter(params.iter()))
                .unwrap(),
            Live::Postgres(p) => p.exec(sql, params.to_vec()).unwrap(),
        }
    }
}

/// See [`test_store_args`].
pub const SQLITE: &str = "(sqlite)";

pub fn init_dir(protection: &str, extra: &[&str]) -> (tempfile::TempDir, Output) {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let store = test_store_args(extra);
    let extra: Vec<&str> = extra.iter().copied().filter(|a| *a != SQLITE).collect();
    let out = Command::new(bin())
        .args([
            "init",
            "--trust-domain",
            "compute.example.com",
            "--site",
            "rack1",
            "--key-protection",
            protection,
        ])
        .args(&extra)
        .args(&store)
        .arg("--state-dir")
        .arg(&state)
        .env("BCA_SECRET", PASSPHRASE)
        .output()
        .unwrap();
    (dir, out)
}

impl Appliance {
    pub fn start() -> Self {
        Self::start_with("file", &[])
    }

    pub fn start_with(protection: &str, extra: &[&str]) -> Self {
        Self::start_cfg(protection, extra, |c| c)
    }

    /// Starts an appliance whose `config.toml` is first passed through `edit`.
    pub fn start_cfg(protection: &str, extra: &[&str], edit: impl Fn(String) -> String) -> Self {
        let (dir, out) = init_dir(protection, extra);
        let cfg = dir.path().join("state/config.toml");
        if let Ok(text) = std::fs::read_to_string(&cfg) {
            std::fs::write(&cfg, edit(text)).unwrap();
        }
        assert!(
            out.status.success(),
            "init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut a = Appliance {
            dir,
            child: None,
            http: String::new(),
            gateway: String::new(),
            socket: PathBuf::new(),
            init_stdout: String::from_utf8(out.stdout).unwrap(),
        };
        a.serve(PASSPHRASE);
        a
    }

    pub fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Starts `bca serve` and waits for its readiness line.
    pub fn serve(&mut self, passphrase: &str) {
        self.serve_at(passphrase, "127.0.0.1:0", "127.0.0.1:0")
    }

    /// Stops and starts again on the same ports (agents keep their gateway URL).
    pub fn restart(&mut self) {
        self.stop();
        let (http, gw) = (self.http.clone(), self.gateway.clone());
        self.serve_at(PASSPHRASE, &http, &gw);
    }

    pub fn serve_at(&mut self, passphrase: &str, http: &str, gateway: &str) {
        self.serve_logging(passphrase, http, gateway, "warn", Stdio::inherit());
    }

    /// Starts `bca serve` with its log (at `level`) going to `stderr`.
    pub fn serve_logging(
        &mut self,
        passphrase: &str,
        http: &str,
        gateway: &str,
        level: &str,
        stderr: Stdio,
    ) {
        let mut child = Command::new(bin())
            .args(["serve", "--listen-http", http, "--listen-gateway", gateway])
            .env("BCA_STATE_DIR", self.state())
            .env("BCA_SECRET", passphrase)
            .env("BCA_LOG", level)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let ready: Value =
            serde_json::from_str(&line).unwrap_or_else(|_| panic!("serve did not start: {line:?}"));
        self.http = ready["http"].as_str().unwrap().into();
        self.gateway = ready["gateway"].as_str().unwrap().into();
        self.socket = PathBuf::from(ready["admin"].as_str().unwrap());
        self.child = Some(child);
    }

    pub fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut c = self.child.take()?;
        let _ = Command::new("kill")
            .args(["-TERM", &c.id().to_string()])
            .status();
        Some(c.wait().unwrap())
    }

    /// Runs the CLI against this appliance.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(bin())
            .args(args)
            .env("BCA_STATE_DIR", self.state())
            .env_remove("BCA_SOCKET")
            .output()
            .unwrap()
    }

    /// The CLI with `--json`, which must succeed.
    pub fn cli_json(&self, args: &[&str]) -> Value {
        let mut a = args.to_vec();
        a.push("--json");
        let out = self.cli(&a);
        assert!(
            out.status.success(),
            "bca {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).unwrap()
    }

    /// The CLI, which must fail: (stderr's `CODE`, whole stderr).
    pub fn cli_err(&self, args: &[&str]) -> (String, String) {
        let out = self.cli(args);
        assert!(!out.status.success(), "bca {args:?} should have failed");
        assert_eq!(out.status.code(), Some(1), "bca {args:?} exit code");
        let err = String::from_utf8(out.stderr).unwrap();
        let code = err
            .lines()
            .last()
            .unwrap_or("")
            .split(':')
            .next()
            .unwrap_or("")
            .to_string();
        (code, err)
    }

    pub fn api(&self, method: &str, body: Value) -> Result<Value, ApiError> {
        Client::new(&self.socket).call(method, &body)
    }

    pub fn api_ok(&self, method: &str, body: Value) -> Value {
        self.api(method, body.clone())
            .unwrap_or_else(|e| panic!("{method} {body}: {e}"))
    }

    /// The site's database, for reading: the SQLite file, or (a site on PostgreSQL) a SQLite
    /// snapshot of it taken now, row for row (`store::maintenance::copy_all`). Writes to a
    /// snapshot go nowhere.
    pub fn db(&self) -> rusqlite::Connection {
        let cfg = bca::config::Config::load(&self.state()).unwrap();
        if cfg.store.is_embedded() {
            return rusqlite::Connection::open(self.state().join("bca.db")).unwrap();
        }
        let from = bca::store::Store::open_at(&self.state(), cfg.store.at(), false).unwrap();
        let snap = self.dir.path().join(format!("snapshot-{}.db", rand_hex(4)));
        let to = bca::store::Store::open(&snap, true).unwrap();
        bca::store::maintenance::copy_all(&from, &to).unwrap();
        drop(to);
        rusqlite::Connection::open(&snap).unwrap()
    }

    /// Every row of every table, to assert that a refused call changed nothing.
    pub fn snapshot(&self) -> String {
        self.snapshot_but(&[])
    }

    /// Every row of every table but `skip`'s.
    pub fn snapshot_but(&self, skip: &[&str]) -> String {
        let c = self.db();
        let tables: Vec<String> = c
            .prepare("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")
            .unwrap()
            .query_map([], |r| r.get(0))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let mut out = String::new();
        for t in tables.iter().filter(|t| !skip.contains(&t.as_str())) {
            // An appliance's heartbeat is its liveness, not the site's state.
            let rows = if t == "site_appliances" {
                query_rows(&c, "SELECT id, state, names_json, fingerprint, wrapped_keys, approved_at FROM site_appliances ORDER BY rowid")
            } else {
                query_rows(&c, &format!("SELECT * FROM {t} ORDER BY rowid"))
            };
            out.push_str(&format!("{t}:\n{rows}\n"));
        }
        out
    }

    /// The root tenant's id, as `tenants/list` shows it (whichever engine holds the site).
    pub fn root_tenant(&self) -> String {
        let v = self.api_ok("tenants/list", json!({}));
        let items = v["items"]
            .as_array()
            .or(v.as_array())
            .cloned()
            .unwrap_or_default();
        items
            .iter()
            .find(|t| t["root"] == true)
            .unwrap_or_else(|| panic!("no root tenant in {v}"))["id"]
            .as_str()
            .unwrap()
            .to_string()
    }

    pub fn pool(&self, name: &str) -> String {
        self.api_ok(
            "pools/create",
            json!({"tenantId": self.root_tenant(), "name": name}),
        )["id"]
            .as_str()
            .unwrap()
            .into()
    }

    /// A token for `pool`; `extra` adds or overrides fields. Returns (record, bearer).
    pub fn token(&self, pool: &str, extra: Value) -> (Value, String) {
        let mut body = json!({"tenantId": self.root_tenant(), "poolId": pool, "ttlSeconds": 3600,
            "idempotencyKey": format!("k-{}", rand_hex(8))});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let v = self.api_ok("joinTokens/create", body);
        let t = v["token"].as_str().unwrap().to_string();
        (v, t)
    }

    pub fn uses_left(&self, token_id: &str) -> i64 {
        self.db()
            .query_row(
                "SELECT uses_left FROM join_tokens WHERE id = ?1",
                [token_id],
                |r| r.get(0),
            )
            .unwrap()
    }

    pub fn count(&self, sql: &str) -> i64 {
        self.live().count(sql)
    }

    /// Every byte the site's database holds, to look for what must never be there: the SQLite
    /// file, or (on PostgreSQL) `pg_dump`'s dump of the database.
    pub fn db_bytes(&self) -> Vec<u8> {
        let cfg = bca::config::Config::load(&self.state()).unwrap();
        match &cfg.store.url {
            None => std::fs::read(self.state().join("bca.db")).unwrap(),
            Some(url) => {
                let o = Command::new("pg_dump")
                    .arg(url.replacen("postgres://", "postgresql://", 1))
                    .output()
                    .unwrap();
                assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
                o.stdout
            }
        }
    }

    /// The site's database itself (not a snapshot), for a count at a precise moment or a write
    /// a test makes behind the appliance's back.
    pub fn live(&self) -> Live {
        let cfg = bca::config::Config::load(&self.state()).unwrap();
        match &cfg.store.url {
            None => Live::Sqlite(self.db()),
            Some(url) => Live::Postgres(
                bca::store::pg::PgConn::connect(bca::store::pg::config(url, None).unwrap())
                    .unwrap(),
            ),
        }
    }

    /// The newest event of a type (any tenant).
    pub fn last_event(&self, kind: &str) -> Option<(String, Value)> {
        self.db()
            .query_row(
                "SELECT tenant_id, data FROM events WHERE type = ?1 ORDER BY seq DESC LIMIT 1",
                [kind],
                |r| {
                    Ok((
                        r.get::<_, String>(0)?,
                        serde_json::from_str(&r.get::<_, String>(1)?).unwrap(),
                    ))
                },
            )
            .ok()
    }

    /// An agent configuration directory written by `bca daemon agent-config`.
    pub fn agent_dir(&self) -> PathBuf {
        let d = self.dir.path().join(format!("agent-{}", rand_hex(6)));
        let out = self.cli(&[
            "daemon",
            "agent-config",
            "--gateway-url",
            &format!("https://{}", self.gateway),
            "--out",
            d.to_str().unwrap(),
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        d
    }

    pub fn agent_config(&self, dir: &Path) -> AgentConfig {
        AgentConfig::load(&dir.join("config.toml")).unwrap()
    }
}

impl Drop for Appliance {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

pub fn rand_hex(n: usize) -> String {
    let mut b = vec![0u8; n];
    bca::base::crypto::fill_random(&mut b);
    bca::base::crypto::hex(&b)
}

/// Claims of a distinct, well-identified machine.
pub fn machine() -> Value {
    let h = rand_hex(16);
    json!({
        "productUuid": format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32]),
        "serials": {"product": format!("SN-{}", &h[0..6]), "board": format!("BRD-{}", &h[6..12])},
        "macs": [format!("00:1b:21:{}:{}:{}", &h[0..2], &h[2..4], &h[4..6])],
        "hostname": format!("m-{}", &h[0..6]),
    })
}

pub fn sha256_file_tree(dir: &Path) -> Vec<(PathBuf, String, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let m = std::fs::symlink_metadata(&p).unwrap();
            if m.is_dir() {
                stack.push(p.clone());
                out.push((p, String::new(), m.permissions().mode()));
            } else {
                let h = bca::base::crypto::hex(&bca::base::crypto::sha256(
                    &std::fs::read(&p).unwrap_or_default(),
                ));
                out.push((p, h, m.permissions().mode()));
            }
        }
    }
    out.sort();
    out
}

/// A simulated machine talking the protocol below the CLI.
pub struct Sim {
    pub cfg: AgentConfig,
    pub enc: Vec<u8>,
}

impl Sim {
    pub fn new(a: &Appliance) -> Self {
        let d = a.agent_dir();
        let cfg = a.agent_config(&d);
        let enc = cfg.join_encryption_point(&d.join("config.toml")).unwrap();
        Sim { cfg, enc }
    }

    /// A join with a fresh key; `seal_csr` lets a test seal for another CSR.
    pub fn join_with(
        &self,
        token: &str,
        claims: &Value,
        role: &str,
        seal_csr: Option<&[u8]>,
        iat: i64,
    ) -> (Vec<u8>, Vec<u8>, SigningKey) {
        self.try_join_with(token, claims, role, seal_csr, iat)
            .unwrap_or_else(|e| panic!("the join did not get an answer: {e}"))
    }

    /// A join whose connection may fail (the appliance killed under it).
    pub fn try_join(
        &self,
        token: &str,
        claims: &Value,
    ) -> Result<(Vec<u8>, Vec<u8>, SigningKey), ApiError> {
        self.try_join_with(token, claims, "node", None, bca::base::clock::now())
    }

    fn try_join_with(
        &self,
        token: &str,
        claims: &Value,
        role: &str,
        seal_csr: Option<&[u8]>,
        iat: i64,
    ) -> Result<(Vec<u8>, Vec<u8>, SigningKey), ApiError> {
        let (req, csr, key) = self.join_request(token, claims, role, seal_csr, iat);
        let raw = bca::agent::exchange_raw(&self.cfg, &req)?;
        Ok((raw, csr, key))
    }

    /// A join request's frame body (with a fresh key), its CSR and the key.
    pub fn join_request(
        &self,
        token: &str,
        claims: &Value,
        role: &str,
        seal_csr: Option<&[u8]>,
        iat: i64,
    ) -> (Vec<u8>, Vec<u8>, SigningKey) {
        let key = SigningKey::generate();
        let csr = bca::proto::csr::create(&key);
        let sealed =
            bca::proto::jwe::seal(token, &self.enc, seal_csr.unwrap_or(&csr), iat).unwrap();
        (Self::request(sealed, &csr, claims, "", role), csr, key)
    }

    /// A join request's frame body for a sealed token and a CSR.
    pub fn request(
        sealed: String,
        csr: &[u8],
        claims: &Value,
        attestor: &str,
        role: &str,
    ) -> Vec<u8> {
        let req = Request {
            v: 1,
            join: Some(JoinRequest {
                sealed_token: sealed,
                csr: crypto::b64(csr),
                claims: serde_json::from_value(claims.clone()).unwrap(),
                attestor: attestor.into(),
                role: role.into(),
                tpm: None,
                x509pop: None,
                node_id: None,
            }),
            ..Default::default()
        };
        serde_json::to_vec(&req).unwrap()
    }

    pub fn join(&self, token: &str, claims: &Value) -> (Vec<u8>, Vec<u8>, SigningKey) {
        self.join_with(token, claims, "node", None, bca::base::clock::now())
    }

    /// A join that must be admitted; returns the verified body.
    pub fn admitted(&self, token: &str, claims: &Value) -> JoinResponseBody {
        let (raw, csr, key) = self.join(token, claims);
        let reply: Reply = serde_json::from_slice(&raw).unwrap();
        let resp = reply
            .join_response
            .unwrap_or_else(|| panic!("refused: {}", String::from_utf8_lossy(&raw)));
        bca::agent::verify_response(&self.cfg, &resp, &csr, &key, "node").unwrap()
    }
}

pub fn refused_bytes() -> Vec<u8> {
    Reply::from_outcome(bca::proto::protocol::Outcome::Refused).to_bytes()
}

pub fn write_claims(a: &Appliance, claims: &Value) -> std::path::PathBuf {
    let p = a.dir.path().join(format!("claims-{}.json", rand_hex(4)));
    std::fs::write(&p, claims.to_string()).unwrap();
    p
}

/// `bca agent join` with the token on standard input.
pub fn agent_join(
    agent_dir: &std::path::Path,
    data: &str,
    claims: &std::path::Path,
    token: &str,
    extra: &[&str],
) -> std::process::Output {
    let mut child = Command::new(bin())
        .args(["agent", "join", "--config"])
        .arg(agent_dir.join("config.toml"))
        .arg("--data-dir")
        .arg(agent_dir.join(data))
        .arg("--claims")
        .arg(claims)
        .args(extra)
        .env_remove("BCD_JOIN_TOKEN")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    // The agent may exit before reading its input (already joined, a refused flag): a closed pipe
    // is not an error of the test.
    let _ = child
        .stdin
        .take()
        .unwrap()
        .write_all(format!("{token}\n").as_bytes());
    child.wait_with_output().unwrap()
}

/// Replaces the `[table]` section of a TOML text (as `bca init` wrote it) with `section`.
pub fn replace_table(text: &str, table: &str, section: &str) -> String {
    let head = format!("[{table}]");
    let i = text
        .find(&head)
        .unwrap_or_else(|| panic!("no {head} in config.toml"));
    let end = text[i + head.len()..]
        .find("\n[")
        .map(|j| i + head.len() + j + 1)
        .unwrap_or(text.len());
    format!("{}{section}{}", &text[..i], &text[end..])
}

/// Polls `f` until it gives a value, failing the test after `secs` seconds.
pub fn wait_for<T>(what: &str, secs: u64, mut f: impl FnMut() -> Option<T>) -> T {
    let t = std::time::Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            t.elapsed() < std::time::Duration::from_secs(secs),
            "timed out waiting for {what}"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `bca agent run` as a child process with JSON logs.
pub fn agent_run(dir: &Path) -> Child {
    Command::new(bin())
        .args(["agent", "run", "--config"])
        .arg(dir.join("config.toml"))
        .arg("--data-dir")
        .arg(dir.join("data"))
        .args(["--backoff-base-ms", "400", "--backoff-cap-ms", "3000"])
        .env("BCA_LOG_FORMAT", "json")
        .env("BCA_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

pub fn joined_agent_dir(a: &Appliance, token: &str) -> PathBuf {
    let dir = a.agent_dir();
    let claims = write_claims(a, &machine());
    let o = agent_join(&dir, "data", &claims, token, &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    dir
}

pub fn connected(a: &Appliance) -> usize {
    a.cli_json(&["nodes", "list"])["items"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["connected"] == true)
        .count()
}

/// A free UDP port on loopback.
pub fn free_udp() -> u16 {
    // A port is released before the appliance binds it, and the boot server binds with
    // SO_REUSEADDR: two tests handed the same port would share it (one answering for the other).
    // Never hand out one port twice in this process.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    loop {
        let port = std::net::UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut given = GIVEN.lock().unwrap();
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

/// `bca serve` on a state directory with this passphrase, run to its exit (one that fails).
pub fn serve_exit(state: &Path, passphrase: &str) -> Output {
    serve_exit_with(state, passphrase, &[])
}

/// [`serve_exit`] with more `bca serve` arguments.
pub fn serve_exit_with(state: &Path, passphrase: &str, extra: &[&str]) -> Output {
    Command::new(bin())
        .args([
            "serve",
            "--listen-http",
            "127.0.0.1:0",
            "--listen-gateway",
            "127.0.0.1:0",
        ])
        .args(extra)
        .env("BCA_STATE_DIR", state)
        .env("BCA_SECRET", passphrase)
        .output()
        .unwrap()
}

/// `curl` on the appliance's HTTP listener: the status and the body.
pub fn curl(a: &Appliance, path: &str, method: &str) -> (u16, String) {
    let o = Command::new("curl")
        .args(["-s", "-X", method, "-w", "\n%{http_code}"])
        .arg(format!("http://{}{path}", a.http))
        .output()
        .unwrap();
    let text = String::from_utf8(o.stdout).unwrap();
    let (body, code) = text.rsplit_once('\n').unwrap();
    (code.parse().unwrap(), body.to_string())
}

/// A runtime for a test's async client calls.
pub fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Runs a command that must succeed; its output (the failure shows the command and its stderr).
pub fn output_ok(cmd: &mut Command) -> Output {
    let o = cmd.output().unwrap();
    assert!(
        o.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// Turns on the boot server's DHCP (proxy mode) on a loopback port, with 127.0.0.1 a listed
/// relay, so that a test can make DHCP sightings on loopback (`sight`); restarts the appliance.
pub fn enable_sightings(a: &mut Appliance) {
    sightings_config(a);
    a.restart();
}

/// `enable_sightings`'s configuration, for the next start.
pub fn sightings_config(a: &Appliance) {
    let cfg = a.state().join("config.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    let (dhcp, proxy, tftp) = (free_udp(), free_udp(), free_udp());
    let boot = format!(
        "[boot]\nenabled = true\nmode = \"proxy\"\nserver_ip = \"127.0.0.1\"\nlisten_dhcp = \"127.0.0.1:{dhcp}\"\n\
         listen_proxy = \"127.0.0.1:{proxy}\"\nlisten_tftp = \"127.0.0.1:{tftp}\"\nrelays = [\"127.0.0.1\"]\n"
    );
    std::fs::write(&cfg, replace_table(&text, "boot", &boot)).unwrap();
}

/// The appliance's DHCP port (from its config).
pub fn dhcp_port(a: &Appliance) -> u16 {
    let text = std::fs::read_to_string(a.state().join("config.toml")).unwrap();
    let v: toml::Value = toml::from_str(&text).unwrap();
    v["boot"]["listen_dhcp"]
        .as_str()
        .unwrap()
        .rsplit_once(':')
        .unwrap()
        .1
        .parse()
        .unwrap()
}

/// A DHCP REQUEST from `mac` for `ip`, as relayed by `giaddr` (unspecified: none).
pub fn dhcp_request(mac: &str, ip: std::net::Ipv4Addr, giaddr: std::net::Ipv4Addr) -> Vec<u8> {
    use dhcproto::v4::{DhcpOption, Message, MessageType, Opcode};
    use dhcproto::{Encodable, Encoder};
    let chaddr: Vec<u8> = mac
        .split(':')
        .map(|h| u8::from_str_radix(h, 16).unwrap())
        .collect();
    let mut m = Message::default();
    m.set_opcode(Opcode::BootRequest)
        .set_xid(0x5167)
        .set_chaddr(&chaddr)
        .set_giaddr(giaddr);
    m.opts_mut()
        .insert(DhcpOption::MessageType(MessageType::Request));
    m.opts_mut().insert(DhcpOption::RequestedIpAddress(ip));
    m.opts_mut().insert(DhcpOption::ClassIdentifier(
        b"PXEClient:Arch:00000:UNDI:002001".to_vec(),
    ));
    let mut buf = Vec::new();
    m.encode(&mut Encoder::new(&mut buf)).unwrap();
    buf
}

/// The appliance's count of recorded sightings (from `/metrics`).
pub fn sightings(a: &Appliance) -> u64 {
    let (_, body) = curl(a, "/metrics", "GET");
    body.lines()
        .find_map(|l| l.strip_prefix("bca_boot_sightings_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0) as u64
}

/// What the network would see when `mac` boots at 127.0.0.1: a DHCP REQUEST for 127.0.0.1,
/// relayed by 127.0.0.1 (a listed relay: `enable_sightings`). Waits until it is recorded.
pub fn sight(a: &Appliance, mac: &str) {
    sight_at(a, mac, std::net::Ipv4Addr::LOCALHOST);
}

/// [`sight`], for a machine at `ip` (a listed relay, 127.0.0.1, relays what it saw).
pub fn sight_at(a: &Appliance, mac: &str, ip: std::net::Ipv4Addr) {
    let before = sightings(a);
    let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let relay = std::net::Ipv4Addr::LOCALHOST;
    s.send_to(&dhcp_request(mac, ip, relay), ("127.0.0.1", dhcp_port(a)))
        .unwrap();
    wait_for("the sighting", 10, || (sightings(a) > before).then_some(()));
}

/// A request's frame sent to the gateway from the loopback address `from`; the reply's bytes.
pub fn send_from(a: &Appliance, from: &str, req: Vec<u8>) -> Vec<u8> {
    let sim = Sim::new(a);
    let (gw, from) = (a.gateway.clone(), from.to_string());
    rt().block_on(async move {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
        let stream = sock.connect(gw.parse().unwrap()).await.unwrap();
        let tls = bca::agent::tlsclient::client_config(&sim.cfg.serving_ca_spki_pin).unwrap();
        let mut s = tokio_rustls::TlsConnector::from(std::sync::Arc::new(tls))
            .connect(
                rustls::pki_types::ServerName::try_from("localhost").unwrap(),
                stream,
            )
            .await
            .unwrap();
        bca::proto::protocol::write_frame(&mut s, &req)
            .await
            .unwrap();
        bca::proto::protocol::read_frame(&mut s).await.unwrap()
    })
}

/// One QEMU VM at a time across the test binary: a TCG VM takes a whole core, and two at once on
/// a 2-core machine starve the timing-sensitive tests running beside them. Held for a VM test's
/// whole run (a failed test's poisoned lock is taken over).
pub fn vm_lock() -> std::sync::MutexGuard<'static, ()> {
    static VM: std::sync::Mutex<()> = std::sync::Mutex::new(());
    VM.lock().unwrap_or_else(|p| p.into_inner())
}

/// The rows `sql` selects, a line each, their cells `|`-separated as SQLite holds them.
pub fn query_rows(c: &rusqlite::Connection, sql: &str) -> String {
    let mut st = c.prepare(sql).unwrap();
    let n = st.column_count();
    let rows = st
        .query_map([], |r| {
            Ok((0..n)
                .map(|i| format!("{:?}", r.get_ref(i).unwrap()))
                .collect::<Vec<_>>()
                .join("|"))
        })
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .unwrap();
    rows.join("\n")
}
