//! The command line: `bca <command>`, following the seed's `better-compute` commands verb for verb.
//!
//! Raw arguments are parsed by clap, then turned into API calls; answers print as tables for
//! people or, with `--json`, as the API's JSON. Errors print as `CODE: message` on stderr and the
//! process exits 1 (clap's usage errors exit 2).

mod join_requests;
mod nodes;

use crate::client::Client;
use crate::config::KeyProtection;
use crate::error::{ApiError, ApiResult, Code};
use clap::{Args, CommandFactory, Parser, Subcommand};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

pub const DEFAULT_STATE_DIR: &str = "/var/lib/bca";

#[derive(Parser)]
#[command(
    name = "bca",
    version,
    about = "The rack-local appliance that admits bare-metal machines into compute pools"
)]
pub struct Cli {
    #[command(flatten)]
    pub conn: Conn,
    #[command(subcommand)]
    pub command: Command,
}

/// Where the appliance's state and admin socket are; every admin command takes these.
#[derive(Args, Clone)]
pub struct Conn {
    /// The state directory (default /var/lib/bca; ./.bca for `bca dev`).
    #[arg(long, global = true, env = "BCA_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// The admin socket (default: from the state directory's config, else <state-dir>/admin.sock).
    #[arg(long, global = true, env = "BCA_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

impl Conn {
    pub fn state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR))
    }

    pub fn client(&self) -> Client {
        let dir = self.state_dir();
        let path = self.socket.clone().unwrap_or_else(|| {
            crate::config::Config::load(&dir)
                .map(|c| c.admin_socket_path(&dir))
                .unwrap_or_else(|_| dir.join("admin.sock"))
        });
        Client::new(&path)
    }
}

#[derive(Subcommand)]
pub enum Command {
    /// Initialise a state directory: database, root tenant, site, PKI and keys.
    Init(InitArgs),
    /// Serve: the admin socket, the HTTP listener and the gateway.
    Serve(ServeArgs),
    /// The gateway's confined child process, started by `serve` only (privilege separation).
    #[command(name = "net-child", hide = true)]
    NetChild,
    /// Development: initialise ./.bca when needed (file keys) and serve on loopback ports.
    Dev(DevArgs),
    /// Tenants.
    #[command(subcommand)]
    Tenants(TenantsCmd),
    /// Pools.
    #[command(subcommand)]
    Pools(PoolsCmd),
    /// Join tokens.
    #[command(subcommand, name = "join-tokens")]
    JoinTokens(JoinTokensCmd),
    /// Events.
    #[command(subcommand)]
    Events(EventsCmd),
    /// Nodes.
    #[command(subcommand)]
    Nodes(nodes::NodesCmd),
    /// Network boot: who booted what, when.
    #[command(subcommand)]
    Boot(BootCmd),
    /// The join-request queue: machines waiting for an operator's approval.
    #[command(subcommand, name = "join-requests")]
    JoinRequests(join_requests::JoinRequestsCmd),
    /// The appliance's PKI.
    #[command(subcommand)]
    Pki(PkiCmd),
    /// The TPM: which one, its endorsement keys and their certificates.
    #[command(subcommand)]
    Tpm(TpmCmd),
    /// The machine side: join this machine.
    #[command(subcommand)]
    Agent(AgentCmd),
    /// What agents need from this appliance.
    #[command(subcommand)]
    Daemon(DaemonCmd),
    /// Agent binaries served to install scripts.
    #[command(subcommand)]
    Downloads(DownloadsCmd),
    /// A consistent backup of the state directory, taken while serving (keys stay sealed).
    Backup {
        /// The new backup file (0600; never written over).
        file: PathBuf,
    },
    /// Restore a backup into a new or empty state directory (--state-dir).
    Restore { file: PathBuf },
    /// The audit trail: who did what, when.
    #[command(subcommand)]
    Audit(AuditCmd),
    /// Check the appliance: state directory, modes, keys, database, server, ports, TPM, clock.
    Doctor,
    /// The running server's health (the admin socket's health/get).
    Health,
    /// Shell completions on stdout.
    Completions { shell: clap_complete::Shell },
    /// The man page (roff) on stdout.
    Man,
}

#[derive(Args)]
pub struct InitArgs {
    /// The SPIFFE trust domain (a lower-case DNS name).
    #[arg(long)]
    pub trust_domain: String,
    /// The site's name.
    #[arg(long)]
    pub site: String,
    /// A name (DNS or IP) for the gateway certificate; repeat for more (default: hostname, localhost, 127.0.0.1).
    #[arg(long = "gateway-san")]
    pub gateway_san: Vec<String>,
    /// The gateway URL agents dial (https://host[:port]).
    #[arg(long)]
    pub gateway_url: Option<String>,
    /// passphrase (default), file (development only) or tpm (sealed to the box's TPM).
    #[arg(long, default_value = "passphrase")]
    pub key_protection: String,
    /// With --key-protection tpm: the TPM to seal to (device:/dev/tpmrm0, the default, or
    /// swtpm:host=…,port=…); recorded in config.toml.
    #[arg(long)]
    pub tpm: Option<String>,
    /// With --key-protection tpm: also write the keys sealed under a passphrase (BCA_SECRET or a
    /// prompt) to this new file, the copy `bca tpm recover` takes when the TPM is gone. Keep it
    /// off the box.
    #[arg(long)]
    pub escrow: Option<PathBuf>,
    /// With --key-protection tpm: also bind the keys to these PCRs' values now (SHA-256 bank,
    /// e.g. 7 for Secure Boot's state, or 0,2,7); a firmware change that moves them needs
    /// `bca tpm reseal --escrow FILE`.
    #[arg(long, value_name = "LIST")]
    pub tpm_pcrs: Option<String>,
}

#[derive(Args, Default)]
pub struct ServeArgs {
    /// The TPM the keys are sealed to, instead of the one `config.toml` names (key protection
    /// `tpm`): device:/dev/tpmrm0 or swtpm:host=…,port=….
    #[arg(long)]
    pub tpm: Option<String>,
    #[arg(long)]
    pub listen_http: Option<String>,
    #[arg(long)]
    pub admin_socket: Option<PathBuf>,
    #[arg(long)]
    pub listen_gateway: Option<String>,
}

#[derive(Args)]
pub struct DevArgs {
    /// Run a throwaway appliance in a temporary directory with N simulated machines that join,
    /// hold sessions and renew.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=500))]
    pub sim: Option<u16>,
    /// The simulated machines' certificate lifetime, in seconds.
    #[arg(long, default_value = "60", value_parser = clap::value_parser!(u32).range(10..=86400))]
    pub sim_cert_ttl: u32,
    /// Keep the simulation's temporary directory.
    #[arg(long)]
    pub sim_keep: bool,
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen_http: String,
    #[arg(long, default_value = "127.0.0.1:8443")]
    pub listen_gateway: String,
}

#[derive(Subcommand)]
pub enum TenantsCmd {
    /// Create a tenant.
    Create {
        #[arg(long)]
        name: String,
    },
    /// List tenants.
    List {},
}

#[derive(Subcommand)]
pub enum PoolsCmd {
    /// Create a pool.
    Create {
        #[arg(long)]
        name: String,
        #[arg(long)]
        tenant: Option<String>,
        /// bcd (default) or none.
        #[arg(long)]
        agent: Option<String>,
        /// Comma-separated attestors allowed to admit machines (default: all).
        #[arg(long, value_delimiter = ',')]
        join_attestors: Option<Vec<String>>,
        /// policy.kubernetes.platformOperated.
        #[arg(long)]
        k8s_platform_operated: bool,
    },
    /// List pools.
    List {
        #[arg(long)]
        tenant: Option<String>,
        /// Include archived pools.
        #[arg(long)]
        all: bool,
    },
    /// Show a pool.
    Get {
        id: String,
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Change a pool's name, agent or policy.
    Update {
        id: String,
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        agent: Option<String>,
        #[arg(long, value_delimiter = ',')]
        join_attestors: Option<Vec<String>>,
        #[arg(long)]
        k8s_platform_operated: Option<bool>,
    },
    /// Archive a pool: it admits no join and mints no token.
    Archive {
        id: String,
        #[arg(long)]
        tenant: Option<String>,
    },
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process
pub enum JoinTokensCmd {
    /// Mint a join token for a pool; shown once.
    Create {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        tenant: Option<String>,
        /// Lifetime, 1m to 24h (e.g. 90m, 1h, 3600s, 1h30m).
        #[arg(long)]
        ttl: String,
        #[arg(long)]
        max_uses: Option<i64>,
        #[arg(long)]
        allow_reclaim: bool,
        #[arg(long)]
        expect_product_uuid: Option<String>,
        #[arg(long)]
        expect_serial: Option<String>,
        #[arg(long)]
        expect_mac: Option<String>,
        #[arg(long)]
        expect_gpu_uuid: Option<String>,
        /// kubernetes
        #[arg(long)]
        hosted: Option<String>,
        /// The idempotency key.
        #[arg(long)]
        key: String,
        /// Write the token to this new 0600 file instead of printing it (with --from-csv: one
        /// CSV of name,tokenId,token).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Bulk intake: one token per machine of this CSV (header: name,serial,mac,productUuid,
        /// gpuUuid; each row names at least one identifier). --key is the prefix of each token's key.
        #[arg(long, conflicts_with_all = ["expect_product_uuid", "expect_serial", "expect_mac", "expect_gpu_uuid", "hosted"])]
        from_csv: Option<PathBuf>,
        /// With --from-csv: write one 0600 file per machine, <name>.token, into this directory.
        #[arg(long, requires = "from_csv", conflicts_with = "out")]
        out_dir: Option<PathBuf>,
    },
    /// List a pool's tokens (never their secrets).
    List {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        tenant: Option<String>,
        /// Include revoked, expired and used-up tokens.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        limit: Option<i64>,
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Revoke a token by its id (jt_…).
    Revoke {
        id: String,
        #[arg(long)]
        pool: String,
        #[arg(long)]
        tenant: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum EventsCmd {
    /// List events, newest first.
    List {
        /// Only events whose type starts with this.
        #[arg(long = "type")]
        type_prefix: Option<String>,
        #[arg(long)]
        tenant: Option<String>,
        /// Every tenant's events.
        #[arg(long, conflicts_with = "tenant")]
        all_tenants: bool,
        #[arg(long)]
        limit: Option<i64>,
        #[arg(long)]
        cursor: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum AuditCmd {
    /// List audit rows, newest first.
    List {
        /// Only rows at or after this time: RFC 3339 (2026-12-03T10:00:00Z) or an age (24h, 7d).
        #[arg(long)]
        since: Option<String>,
        /// Only actions starting with this (joinTokens., nodes.retire, retention.pruned).
        #[arg(long)]
        action: Option<String>,
        #[arg(long)]
        tenant: Option<String>,
        /// Every tenant's rows.
        #[arg(long, conflicts_with = "tenant")]
        all_tenants: bool,
        #[arg(long)]
        limit: Option<i64>,
        #[arg(long)]
        cursor: Option<String>,
    },
}

// Parsed once per run: the size of a variant costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub enum AgentCmd {
    /// Join this machine with a join token read from standard input or BCD_JOIN_TOKEN.
    Join {
        #[arg(long, default_value = crate::agent::DEFAULT_CONFIG)]
        config: PathBuf,
        #[arg(long, default_value = crate::agent::DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// Claims from a JSON file instead of this machine (simulated machines, tests).
        #[arg(long)]
        claims: Option<PathBuf>,
        /// node (default) or ramdisk.
        #[arg(long, default_value = "node")]
        role: String,
        /// Move the current identity aside (renamed <name>.reset-<UTC time>) and join again.
        #[arg(long)]
        reset: bool,
        #[arg(long)]
        yes: bool,
        /// The appliance's HTTP URL: its well-known document supplies the join-encryption key
        /// when join-encryption.jwk is absent (only if it matches the pin), and the whole
        /// configuration, with the three pins below, when config.toml is absent.
        #[arg(long)]
        server: Option<String>,
        #[arg(long, requires_all = ["server", "join_signing_pin", "join_encryption_pin"])]
        serving_ca_pin: Option<String>,
        #[arg(long, requires = "serving_ca_pin")]
        join_signing_pin: Option<String>,
        #[arg(long, requires = "serving_ca_pin")]
        join_encryption_pin: Option<String>,
        /// Read the token from this file (owner-only, at most 4 KiB); it is deleted after the join.
        #[arg(long)]
        token_file: Option<PathBuf>,
        /// join-token (default), discovery (a PXE-booted ramdisk, with role ramdisk), or tpm (no
        /// token: the machine's TPM proves it, and holds the node key).
        #[arg(long, default_value = "join-token", value_parser = ["join-token", "discovery", "tpm"])]
        attestor: String,
        /// With --attestor tpm: the machine's TPM, device:/dev/tpmrm0 (the default) or
        /// swtpm:host=…,port=….
        #[arg(long)]
        tpm: Option<String>,
        /// With --attestor tpm: when the TPM's EK is on no allow-list, fail instead of waiting
        /// for an operator (the discovery ramdisk then uses its discovery token).
        #[arg(long)]
        no_enroll: bool,
        /// How long to keep retrying while the join waits for an operator's approval.
        #[arg(long, default_value = "86400")]
        wait_seconds: u32,
        /// Retry a waiting join after this many seconds instead of what the appliance says.
        #[arg(long, hide = true)]
        retry_seconds: Option<u32>,
    },
    /// Keep the node's session, renew its certificate, reconnect with backoff (until SIGTERM).
    Run {
        #[arg(long, default_value = crate::agent::DEFAULT_CONFIG)]
        config: PathBuf,
        #[arg(long, default_value = crate::agent::DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// The first reconnect waits up to this long; each further attempt doubles it.
        #[arg(long, default_value = "1000", hide = true)]
        backoff_base_ms: u64,
        /// Reconnects never wait longer than this.
        #[arg(long, default_value = "60000", hide = true)]
        backoff_cap_ms: u64,
    },
    /// Check the config, pins, identity, the gateway, the clock and the TPM; exit 1 when a
    /// check fails.
    Doctor {
        #[arg(long, default_value = crate::agent::DEFAULT_CONFIG)]
        config: PathBuf,
        #[arg(long, default_value = crate::agent::DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// The machine's TPM: device:/dev/tpmrm0 (the default) or swtpm:host=…,port=….
        #[arg(long)]
        tpm: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum BootCmd {
    /// List boot leases, newest first.
    Leases {
        #[arg(long)]
        mac: Option<String>,
        #[arg(long)]
        limit: Option<i64>,
        #[arg(long)]
        cursor: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum DownloadsCmd {
    /// Copy an agent binary into the appliance's store (the agent is bca itself).
    Add {
        file: PathBuf,
        #[arg(long)]
        version: String,
        /// amd64 or arm64.
        #[arg(long)]
        arch: String,
    },
    /// List the agent binaries the appliance serves.
    List,
}

#[derive(Subcommand)]
pub enum DaemonCmd {
    /// Print a POSIX sh install script for a brownfield server (it holds no secret).
    #[command(name = "install-script")]
    InstallScript {
        #[arg(long)]
        pool: String,
        #[arg(long)]
        tenant: Option<String>,
        /// The gateway URL agents dial.
        #[arg(long)]
        gateway_url: String,
        /// Where the script downloads the agent: this appliance's HTTP URL.
        #[arg(long)]
        base_url: String,
        /// The agent version to download (as added with `bca downloads add`).
        #[arg(long)]
        bcd_version: String,
        /// amd64=<hex>[,arm64=<hex>]: the SHA-256 of each binary.
        #[arg(long)]
        sha256: String,
    },
    /// Write an agent's config.toml (0600) and join-encryption.jwk (0644) into a new folder.
    #[command(name = "agent-config")]
    AgentConfig {
        #[arg(long)]
        gateway_url: String,
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Subcommand)]
pub enum TpmCmd {
    /// Write a new escrow copy of the TPM-sealed keys, sealed under a passphrase (BCA_SECRET or a
    /// prompt): after `bca init --escrow`, and again after every key rotation.
    Escrow {
        #[arg(long)]
        out: PathBuf,
    },
    /// When the TPM the keys were sealed to is gone (a replaced board, a cleared TPM): take the
    /// keys from the escrow copy `bca init --escrow` wrote; from then on they are protected by its
    /// passphrase. Run it with the server stopped.
    Recover {
        #[arg(long)]
        escrow: PathBuf,
    },
    /// After a firmware or boot change moved the PCRs the keys are bound to: seal them to the
    /// TPM again, to the PCRs' values now, from the escrow copy (its passphrase from BCA_SECRET or
    /// a prompt). Run it with the server stopped.
    Reseal {
        #[arg(long)]
        escrow: PathBuf,
        /// The PCRs to bind to from now on (e.g. 7 or 0,2,7; none: no binding); default: the
        /// ones the keys were bound to.
        #[arg(long, value_name = "LIST")]
        tpm_pcrs: Option<String>,
        /// The TPM, instead of the one config.toml names.
        #[arg(long)]
        tpm: Option<String>,
    },
    /// Allow a machine's TPM to join by the `tpm` attestor into a pool: its EK named by the
    /// SHA-256 of its public key (`publicKeySha256` in `bca tpm status` on that machine).
    AllowEk {
        /// 64 hex digits (or sha256:<hex>).
        hash: String,
        #[arg(long)]
        pool: String,
        #[arg(long)]
        tenant: Option<String>,
        /// What the machine is (at most 256 characters).
        #[arg(long)]
        note: Option<String>,
    },
    /// Take an EK off the allow-list.
    RemoveEk {
        hash: String,
        #[arg(long)]
        tenant: Option<String>,
    },
    /// The EKs allowed to join, by pool.
    List {
        #[arg(long)]
        pool: Option<String>,
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        limit: Option<i64>,
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Which TPM, its manufacturer and firmware, its endorsement keys (names as tpm2-tools
    /// prints them, public-key hashes) and whether their certificates certify them.
    Status {
        /// The TPM: device:/dev/tpmrm0 (the default) or swtpm:host=…,port=….
        #[arg(long)]
        tpm: Option<String>,
    },
}

#[derive(Subcommand)]
pub enum PkiCmd {
    /// Print the pins (and a rotation's next pins) and a summary of each certificate.
    Show,
    /// Rotate a key while serving: join-encryption or join-signing (stage the next key with an
    /// overlap, then promote), or gateway (renew the TLS leaf now).
    Rotate {
        /// join-encryption, join-signing or gateway.
        kind: String,
        /// How long the next key is published before it becomes current (e.g. 7d, 24h; default 7d).
        #[arg(long, conflicts_with_all = ["promote", "retire_previous"])]
        overlap: Option<String>,
        /// Make the staged next key current now.
        #[arg(long, conflicts_with = "retire_previous")]
        promote: bool,
        /// join-encryption: stop accepting the key the last promotion replaced, now.
        #[arg(long)]
        retire_previous: bool,
    },
}

/// The process's exit: prints the error as `CODE: message`.
pub fn main() -> i32 {
    let cli = Cli::parse();
    init_logging();
    match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{}: {}", e.code.as_str(), e.message);
            1
        }
    }
}

/// Logs go to stderr: `BCA_LOG` sets the filter (default `info`), `BCA_LOG_FORMAT=json` makes
/// every line a JSON object (for journald and log shippers). No secret is ever logged.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("BCA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("BCA_LOG_FORMAT").as_deref() == Ok("json") {
        let _ = builder.json().try_init();
        return;
    }
    let _ = builder
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

pub fn root_tenant(client: &Client) -> ApiResult<String> {
    let v = client.call("tenants/list", &json!({}))?;
    v["items"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["root"] == json!(true)))
        .and_then(|t| t["id"].as_str())
        .map(str::to_string)
        .ok_or_else(|| ApiError::new(Code::Internal, "the appliance reported no root tenant"))
}

pub fn tenant_or_root(client: &Client, t: Option<String>) -> ApiResult<String> {
    match t {
        Some(t) => Ok(t),
        None => root_tenant(client),
    }
}

/// The tenant a list is scoped to: every tenant (`--all-tenants`), the one named, else the root.
fn tenant_scope(client: &Client, t: Option<String>, all: bool) -> ApiResult<Option<String>> {
    if all {
        return Ok(None);
    }
    tenant_or_root(client, t).map(Some)
}

/// Parses `1m` .. `24h` style durations (`h`, `m`, `s` parts, e.g. `1h30m`) to whole seconds.
pub fn parse_duration(s: &str) -> Result<i64, String> {
    let bad = || format!("--ttl {s:?} is not a duration such as 30m, 1h or 1h30m");
    if s.is_empty() {
        return Err(bad());
    }
    let mut total: i64 = 0;
    let mut num = String::new();
    let mut units = 0;
    for c in s.chars() {
        if c.is_ascii_digit() {
            num.push(c);
            if num.len() > 6 {
                return Err(bad());
            }
        } else {
            let mult = match c {
                'h' => 3600,
                'm' => 60,
                's' => 1,
                _ => return Err(bad()),
            };
            let n: i64 = num.parse().map_err(|_| bad())?;
            total += n * mult;
            num.clear();
            units += 1;
        }
    }
    if !num.is_empty() || units == 0 {
        return Err(bad());
    }
    if !(60..=86_400).contains(&total) {
        return Err(format!("--ttl {s} is {total} s; it must be from 1m to 24h"));
    }
    Ok(total)
}

fn print(conn: &Conn, v: &Value, table: impl FnOnce(&Value)) {
    if conn.json {
        println!("{}", serde_json::to_string_pretty(v).expect("serializes"));
    } else {
        table(v);
    }
}

/// Prints rows as aligned columns.
pub fn print_table(headers: &[&str], rows: Vec<Vec<String>>) {
    // Stored values may come from a machine: their control characters are shown, not obeyed.
    let rows: Vec<Vec<String>> = rows
        .into_iter()
        .map(|r| {
            r.into_iter()
                .map(|c| crate::text::escape(&c).into_owned())
                .collect()
        })
        .collect();
    let mut w: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.len());
        }
    }
    let line = |cells: Vec<String>| {
        let s: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<width$}", width = w[i]))
            .collect();
        println!("{}", s.join("  ").trim_end());
    };
    line(headers.iter().map(|h| h.to_string()).collect());
    for r in rows {
        line(r);
    }
}

/// Prints a list answer: `--json` as the API's JSON, else a table of the given (header, field)
/// columns and the next cursor.
pub fn print_list(conn: &Conn, v: &Value, columns: &[(&str, &str)]) {
    print(conn, v, |v| {
        let headers: Vec<&str> = columns.iter().map(|(h, _)| *h).collect();
        print_table(
            &headers,
            items(v)
                .iter()
                .map(|item| columns.iter().map(|(_, k)| s(&item[*k])).collect())
                .collect(),
        );
        print_cursor(v);
    });
}

/// A value as the CLI prints it; a string's control characters escaped (`text`).
pub fn s(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => crate::text::escape(s).into_owned(),
        other => other.to_string(),
    }
}

fn items(v: &Value) -> Vec<Value> {
    v["items"].as_array().cloned().unwrap_or_default()
}

pub fn print_cursor(v: &Value) {
    if let Some(c) = v["cursor"].as_str() {
        println!("more: --cursor {c}");
    }
}

fn print_record(v: &Value) {
    if let Some(o) = v.as_object() {
        for (k, val) in o {
            println!("{k:<14} {}", s(val));
        }
    }
}

fn pool_table(v: &Value) {
    print_table(
        &["ID", "NAME", "AGENT", "ATTESTORS", "ARCHIVED"],
        items(v)
            .iter()
            .map(|p| {
                vec![
                    s(&p["id"]),
                    s(&p["name"]),
                    s(&p["agent"]),
                    p["policy"]["joinAttestors"]
                        .as_array()
                        .map(|a| a.iter().map(s).collect::<Vec<_>>().join(","))
                        .unwrap_or("all".into()),
                    s(&p["archivedAt"]),
                ]
            })
            .collect(),
    );
    print_cursor(v);
}

fn run(cli: Cli) -> ApiResult<()> {
    let conn = &cli.conn;
    match cli.command {
        Command::Init(a) => cmd_init(a, conn),
        Command::Serve(a) => {
            let opts = crate::serve::ServeOptions {
                tpm: a.tpm,
                listen_http: a.listen_http,
                listen_gateway: a.listen_gateway,
                admin_socket: a.admin_socket,
                announce: None,
            };
            crate::serve::run(&conn.state_dir(), opts).map_err(ApiError::invalid_config)
        }
        Command::NetChild => crate::privsep::child_main().map_err(ApiError::invalid_config),
        Command::Dev(a) => cmd_dev(
            a,
            conn.state_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("./.bca")),
        ),
        Command::Tenants(TenantsCmd::Create { name }) => {
            let v = conn
                .client()
                .call("tenants/create", &json!({"name": name}))?;
            print(conn, &v, print_record);
            Ok(())
        }
        Command::Tenants(TenantsCmd::List {}) => {
            let v = conn.client().call("tenants/list", &json!({}))?;
            print(conn, &v, |v| {
                print_table(
                    &["ID", "NAME", "ROOT"],
                    items(v)
                        .iter()
                        .map(|t| vec![s(&t["id"]), s(&t["name"]), s(&t["root"])])
                        .collect(),
                )
            });
            Ok(())
        }
        Command::Pools(cmd) => cmd_pools(cmd, conn),
        Command::JoinTokens(cmd) => cmd_join_tokens(cmd, conn),
        Command::Events(EventsCmd::List {
            type_prefix,
            tenant,
            all_tenants,
            limit,
            cursor,
        }) => {
            let c = conn.client();
            let tenant = tenant_scope(&c, tenant, all_tenants)?;
            let v = c.call(
                "events/list",
                &json!({"tenantId": tenant, "type": type_prefix, "limit": limit, "cursor": cursor}),
            )?;
            print(conn, &v, |v| {
                print_table(
                    &["TIME", "TYPE", "TENANT", "DATA"],
                    items(v)
                        .iter()
                        .map(|e| {
                            vec![
                                s(&e["createdAt"]),
                                s(&e["type"]),
                                s(&e["tenantId"]),
                                e["data"].to_string(),
                            ]
                        })
                        .collect(),
                );
                print_cursor(v);
            });
            Ok(())
        }
        Command::Audit(AuditCmd::List {
            since,
            action,
            tenant,
            all_tenants,
            limit,
            cursor,
        }) => {
            let c = conn.client();
            let tenant = tenant_scope(&c, tenant, all_tenants)?;
            // An age is turned into a time here; a time is passed on for the server to check.
            let since = since.map(|s| match crate::audit::parse_age(&s) {
                Some(age) => crate::clock::rfc3339(crate::clock::now() - age),
                None => s,
            });
            let v = c.call(
                "audit/list",
                &json!({"tenantId": tenant, "action": action, "since": since, "limit": limit, "cursor": cursor}),
            )?;
            print(conn, &v, |v| {
                print_table(
                    &["TIME", "ACTION", "ACTOR", "TARGET", "DATA"],
                    items(v)
                        .iter()
                        .map(|e| {
                            vec![
                                s(&e["createdAt"]),
                                s(&e["action"]),
                                s(&e["actor"]),
                                s(&e["target"]),
                                e["data"].to_string(),
                            ]
                        })
                        .collect(),
                );
                print_cursor(v);
            });
            Ok(())
        }
        Command::Backup { file } => {
            let m = crate::backup::backup(&conn.state_dir(), &file)?;
            eprintln!(
                "backup of site {} ({}) written to {} (keys {}; {} files)",
                m.site_name,
                m.site_id,
                file.display(),
                serde_json::to_value(m.key_protection)
                    .unwrap_or_default()
                    .as_str()
                    .unwrap_or_default(),
                m.files.len()
            );
            print(
                conn,
                &serde_json::to_value(&m).unwrap_or_default(),
                print_record,
            );
            Ok(())
        }
        Command::Restore { file } => {
            let dir = conn.state_dir();
            let m = crate::backup::restore(&file, &dir)?;
            eprintln!(
                "restored site {} ({}) from {} into {}; check config.toml (listeners, gateway_url) for this box, then run bca serve",
                m.site_name,
                m.site_id,
                m.created_at,
                dir.display()
            );
            print(
                conn,
                &serde_json::to_value(&m).unwrap_or_default(),
                print_record,
            );
            Ok(())
        }
        Command::Doctor => {
            if crate::doctor::run(&conn.state_dir(), conn.socket.as_deref()) {
                Ok(())
            } else {
                Err(ApiError::new(
                    Code::InvalidState,
                    "bca doctor found problems (FAIL lines above)",
                ))
            }
        }
        Command::Health => {
            let v = conn.client().call("health/get", &json!({}))?;
            print(conn, &v, print_record);
            if v["status"] == "failing" {
                return Err(ApiError::new(Code::Unavailable, "the appliance is failing"));
            }
            Ok(())
        }
        Command::Nodes(cmd) => nodes::run(cmd, conn),
        Command::JoinRequests(cmd) => join_requests::run(cmd, conn),
        Command::Boot(BootCmd::Leases { mac, limit, cursor }) => {
            let v = conn.client().call(
                "bootLeases/list",
                &json!({"mac": mac, "limit": limit, "cursor": cursor}),
            )?;
            print_list(
                conn,
                &v,
                &[
                    ("EPOCH", "epoch"),
                    ("TIME", "createdAt"),
                    ("MAC", "mac"),
                    ("IP", "ip"),
                    ("ARCH", "arch"),
                    ("STAGE", "stage"),
                    ("FILE", "file"),
                ],
            );
            Ok(())
        }
        Command::Tpm(TpmCmd::Status { tpm }) => cmd_tpm_status(conn, tpm),
        Command::Tpm(TpmCmd::AllowEk {
            hash,
            pool,
            tenant,
            note,
        }) => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "tpmEks/allow",
                &json!({"tenantId": tenant, "poolId": pool, "ekSha256": hash, "note": note}),
            )?;
            print(conn, &v, |v| {
                println!(
                    "allowed EK {} into pool {}",
                    s(&v["ekSha256"]),
                    s(&v["poolId"])
                )
            });
            Ok(())
        }
        Command::Tpm(TpmCmd::RemoveEk { hash, tenant }) => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "tpmEks/remove",
                &json!({"tenantId": tenant, "ekSha256": hash}),
            )?;
            print(conn, &v, |v| {
                println!(
                    "removed EK {} (was allowed into pool {})",
                    s(&v["ekSha256"]),
                    s(&v["poolId"])
                )
            });
            Ok(())
        }
        Command::Tpm(TpmCmd::List {
            pool,
            tenant,
            limit,
            cursor,
        }) => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "tpmEks/list",
                &json!({"tenantId": tenant, "poolId": pool, "limit": limit, "cursor": cursor}),
            )?;
            print(conn, &v, |v| {
                print_table(
                    &["EK SHA-256", "POOL", "NOTE", "ALLOWED", "BY"],
                    v["items"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|r| {
                            vec![
                                s(&r["ekSha256"]),
                                s(&r["poolId"]),
                                s(&r["note"]),
                                s(&r["createdAt"]),
                                s(&r["createdBy"]),
                            ]
                        })
                        .collect(),
                );
                print_cursor(v);
            });
            Ok(())
        }
        Command::Tpm(TpmCmd::Escrow { out }) => {
            let state_dir = conn.state_dir();
            if out.exists() {
                return Err(ApiError::already_exists(format!(
                    "{} exists; nothing was written",
                    out.display()
                )));
            }
            let bundle = crate::keys::unseal(&state_dir, KeyProtection::Tpm, None)
                .map_err(ApiError::invalid_state)?;
            let pass = crate::keys::passphrase_from_env_or_prompt(true)
                .map_err(ApiError::invalid_input)?;
            crate::keys::write_escrow(&out, &bundle, pass.as_bytes())
                .map_err(ApiError::invalid_input)?;
            println!("wrote {} (0600): keep it off this box", out.display());
            Ok(())
        }
        Command::Tpm(TpmCmd::Reseal {
            escrow,
            tpm_pcrs,
            tpm,
        }) => {
            let state_dir = conn.state_dir();
            let pcrs = tpm_pcrs
                .as_deref()
                .map(crate::tpm::parse_pcrs)
                .transpose()
                .map_err(|e| ApiError::invalid_input(format!("--tpm-pcrs: {e}")))?;
            let tcti: Option<crate::tpm::Tcti> = tpm
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: String| ApiError::invalid_input(format!("--tpm: {e}")))?;
            not_serving(&state_dir)?;
            let pass = crate::keys::passphrase_from_env_or_prompt(false)
                .map_err(ApiError::invalid_input)?;
            let bound = crate::keys::reseal_from_escrow(
                &state_dir,
                &escrow,
                pass.as_bytes(),
                tcti.as_ref(),
                pcrs,
            )
            .map_err(ApiError::invalid_state)?;
            if bound.is_empty() {
                println!("the keys are sealed to the TPM again, bound to no PCR; start bca serve");
            } else {
                println!(
                    "the keys are sealed to the TPM again, bound to PCRs {bound:?} as they are now; start bca serve"
                );
            }
            Ok(())
        }
        Command::Tpm(TpmCmd::Recover { escrow }) => {
            let state_dir = conn.state_dir();
            not_serving(&state_dir)?;
            let pass = crate::keys::passphrase_from_env_or_prompt(false)
                .map_err(ApiError::invalid_input)?;
            crate::keys::recover_from_escrow(&state_dir, &escrow, pass.as_bytes())
                .map_err(ApiError::invalid_state)?;
            println!(
                "the keys are back from {}, protected by its passphrase (key_protection = \"passphrase\"); start bca serve",
                escrow.display()
            );
            Ok(())
        }
        Command::Pki(PkiCmd::Show) => cmd_pki_show(&conn.state_dir(), conn.json),
        Command::Pki(PkiCmd::Rotate {
            kind,
            overlap,
            promote,
            retire_previous,
        }) => {
            let overlap = overlap
                .map(|o| {
                    crate::audit::parse_age(&o).ok_or_else(|| {
                        ApiError::invalid_input(format!(
                            "--overlap {o:?} is not a duration such as 24h or 7d"
                        ))
                    })
                })
                .transpose()?;
            let action = if promote {
                Some("promote")
            } else if retire_previous {
                Some("retire-previous")
            } else {
                None
            };
            let v = conn.client().call(
                "pki/rotate",
                &json!({"kind": kind, "action": action, "overlapSeconds": overlap}),
            )?;
            print(conn, &v, |v| {
                for (k, p) in v["pins"].as_object().into_iter().flatten() {
                    println!("{k:<20} {}", s(p));
                }
                for (k, r) in v["rotation"].as_object().into_iter().flatten() {
                    println!(
                        "{k:<20} {}",
                        if r.is_null() {
                            "-".into()
                        } else {
                            r.to_string()
                        }
                    );
                }
            });
            Ok(())
        }
        Command::Agent(AgentCmd::Join {
            config,
            data_dir,
            claims,
            role,
            reset,
            yes,
            server,
            serving_ca_pin,
            join_signing_pin,
            join_encryption_pin,
            token_file,
            attestor,
            tpm,
            no_enroll,
            wait_seconds,
            retry_seconds,
        }) => {
            let pins = match (serving_ca_pin, join_signing_pin, join_encryption_pin) {
                (Some(serving_ca), Some(join_signing), Some(join_encryption)) => {
                    Some(crate::agent::BootstrapPins {
                        serving_ca,
                        join_signing,
                        join_encryption,
                    })
                }
                _ => None,
            };
            let node = crate::agent::join(&crate::agent::JoinOptions {
                config,
                data_dir,
                claims,
                role,
                reset,
                yes,
                server,
                pins,
                token_file,
                token: None,
                attestor: if attestor == "join-token" {
                    String::new()
                } else {
                    attestor
                },
                tpm,
                no_enroll,
                wait_seconds,
                retry_seconds,
            })?;
            println!("{node}");
            Ok(())
        }
        Command::Agent(AgentCmd::Run {
            config,
            data_dir,
            backoff_base_ms,
            backoff_cap_ms,
        }) => crate::agent_run::run(crate::agent_run::RunOptions {
            config,
            data_dir,
            backoff_base: std::time::Duration::from_millis(backoff_base_ms),
            backoff_cap: std::time::Duration::from_millis(backoff_cap_ms.max(backoff_base_ms)),
        }),
        Command::Agent(AgentCmd::Doctor {
            config,
            data_dir,
            tpm,
        }) => {
            let tcti: Option<crate::tpm::Tcti> = tpm
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: String| ApiError::invalid_input(format!("--tpm: {e}")))?;
            if crate::agent_run::doctor(&config, &data_dir, tcti.as_ref()) {
                Ok(())
            } else {
                Err(ApiError::invalid_state("a check failed; see above"))
            }
        }
        Command::Downloads(DownloadsCmd::Add {
            file,
            version,
            arch,
        }) => {
            let path = std::fs::canonicalize(&file)
                .map_err(|e| ApiError::invalid_input(format!("{}: {e}", file.display())))?;
            let v = conn.client().call(
                "downloads/add",
                &json!({"path": path, "version": version, "arch": arch}),
            )?;
            print(conn, &v, print_record);
            Ok(())
        }
        Command::Downloads(DownloadsCmd::List) => {
            let v = conn.client().call("downloads/list", &json!({}))?;
            print_list(
                conn,
                &v,
                &[
                    ("PRODUCT", "product"),
                    ("VERSION", "version"),
                    ("ARCH", "arch"),
                    ("SHA-256", "sha256"),
                    ("SIZE", "size"),
                ],
            );
            Ok(())
        }
        Command::Daemon(DaemonCmd::InstallScript {
            pool,
            tenant,
            gateway_url,
            base_url,
            bcd_version,
            sha256,
        }) => {
            let (amd, arm) =
                crate::install_script::parse_sha256(&sha256).map_err(ApiError::invalid_input)?;
            if !crate::downloads::valid_version(&bcd_version) {
                return Err(ApiError::invalid_input(
                    "--bcd-version must match ^[0-9A-Za-z][0-9A-Za-z.+-]{0,63}$",
                ));
            }
            let base_ok = (base_url.starts_with("http://") || base_url.starts_with("https://"))
                && base_url.bytes().all(|c| {
                    c.is_ascii_graphic()
                        && c != b'\''
                        && c != b'"'
                        && c != b'\\'
                        && c != b'$'
                        && c != b'`'
                });
            if !base_ok {
                return Err(ApiError::invalid_input(format!(
                    "--base-url {base_url:?} must be an http:// or https:// URL"
                )));
            }
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let p = c.call("pools/get", &json!({"tenantId": tenant, "poolId": pool}))?;
            if p["agent"] != "bcd" || p.get("archivedAt").is_some() {
                return Err(ApiError::invalid_state(format!(
                    "pool {pool} admits no agent (agent none, or archived)"
                )));
            }
            let (cfg, jwk) = crate::agent_files::agent_config_for(&conn.state_dir(), &gateway_url)?;
            print!(
                "{}",
                crate::install_script::render(&crate::install_script::ScriptInput {
                    pool: &pool,
                    config: &cfg,
                    jwk_json: &jwk,
                    base_url: &base_url,
                    version: &bcd_version,
                    sha256_amd64: amd.as_deref(),
                    sha256_arm64: arm.as_deref(),
                })
            );
            Ok(())
        }
        Command::Daemon(DaemonCmd::AgentConfig { gateway_url, out }) => {
            crate::agent_files::write_agent_config(&conn.state_dir(), &gateway_url, &out)?;
            println!(
                "wrote {}/config.toml (0600) and {}/join-encryption.jwk (0644)",
                out.display(),
                out.display()
            );
            Ok(())
        }
        // Rendered into memory, then written: a closed pipe (`| head`) ends quietly.
        Command::Completions { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "bca", &mut out);
            let _ = std::io::Write::write_all(&mut std::io::stdout(), &out);
            Ok(())
        }
        Command::Man => {
            let mut out = Vec::new();
            clap_mangen::Man::new(Cli::command())
                .render(&mut out)
                .map_err(|e| ApiError::new(Code::Internal, e.to_string()))?;
            let _ = std::io::Write::write_all(&mut std::io::stdout(), &out);
            Ok(())
        }
    }
}

fn cmd_init(a: InitArgs, conn: &Conn) -> ApiResult<()> {
    let state_dir = conn.state_dir();
    let kp = KeyProtection::parse(&a.key_protection).ok_or_else(|| {
        ApiError::invalid_input(format!(
            "--key-protection {:?} must be passphrase, file or tpm",
            a.key_protection
        ))
    })?;
    let passphrase = match kp {
        KeyProtection::Passphrase if !crate::init::is_initialised(&state_dir) => Some(
            crate::keys::passphrase_from_env_or_prompt(true).map_err(ApiError::invalid_input)?,
        ),
        _ => None,
    };
    let escrow = match (&a.escrow, kp) {
        (Some(path), KeyProtection::Tpm) if !crate::init::is_initialised(&state_dir) => Some((
            path.clone(),
            crate::keys::passphrase_from_env_or_prompt(true).map_err(ApiError::invalid_input)?,
        )),
        (Some(_), KeyProtection::Tpm) => None,
        (Some(_), _) => return Err(ApiError::invalid_input(
            "--escrow is the recovery copy of TPM-sealed keys: it goes with --key-protection tpm",
        )),
        (None, _) => None,
    };
    let out = crate::init::init(
        crate::init::InitOptions {
            state_dir: state_dir.clone(),
            trust_domain: a.trust_domain,
            site: a.site,
            gateway_sans: a.gateway_san,
            gateway_url: a.gateway_url,
            key_protection: kp,
            passphrase,
            tpm: a.tpm,
            tpm_pcrs: a.tpm_pcrs,
            escrow,
            listen_http: None,
            listen_gateway: None,
        },
        crate::clock::now(),
    )?;
    print_init(&state_dir, &out, conn.json);
    Ok(())
}

fn print_init(dir: &Path, out: &crate::init::Initialised, as_json: bool) {
    if as_json {
        let v = json!({"stateDir": dir, "siteId": out.site_id, "rootTenantId": out.root_tenant, "pins": out.pins});
        println!("{}", serde_json::to_string_pretty(&v).expect("serializes"));
        return;
    }
    println!(
        "initialised {} (site {}, root tenant {})",
        dir.display(),
        out.site_id,
        out.root_tenant
    );
    println!("the pins agents embed:");
    println!("serving_ca_spki_pin = \"{}\"", out.pins.serving_ca);
    println!("join_signing_key_pin = \"{}\"", out.pins.join_signing);
    println!("join_encryption_key_pin = \"{}\"", out.pins.join_encryption);
}

fn cmd_dev(a: DevArgs, state_dir: PathBuf) -> ApiResult<()> {
    if let Some(n) = a.sim {
        return crate::devsim::run(crate::devsim::SimOptions {
            machines: n as usize,
            cert_ttl_seconds: a.sim_cert_ttl,
            keep: a.sim_keep,
        });
    }
    if !crate::init::is_initialised(&state_dir) {
        let out = crate::init::init(
            crate::init::InitOptions {
                state_dir: state_dir.clone(),
                trust_domain: "dev.bca.internal".into(),
                site: "dev".into(),
                gateway_sans: vec!["localhost".into(), "127.0.0.1".into()],
                gateway_url: Some(format!("https://{}", a.listen_gateway)),
                key_protection: KeyProtection::File,
                passphrase: None,
                tpm: None,
                tpm_pcrs: None,
                escrow: None,
                listen_http: Some(a.listen_http.clone()),
                listen_gateway: Some(a.listen_gateway.clone()),
            },
            crate::clock::now(),
        )?;
        print_init(&state_dir, &out, false);
    }
    let try_dir = dev_try_dir(&state_dir)?;
    let announce: crate::serve::Announce = std::sync::Arc::new(move |ready: &Value| {
        println!("{}", dev_try_lines(&try_dir, ready));
    });
    crate::serve::run(
        &state_dir,
        crate::serve::ServeOptions {
            tpm: None,
            listen_http: Some(a.listen_http),
            listen_gateway: Some(a.listen_gateway),
            admin_socket: None,
            announce: Some(announce),
        },
    )
    .map_err(ApiError::invalid_config)
}

/// Where `bca dev`'s "try" lines put their files: `<state dir>/try`, with the example claims of
/// a simulated machine written once. A VM's or a laptop's own hardware identity is usually a
/// placeholder (`To Be Filled By O.E.M.`, all zeros) that the appliance refuses
/// (`join:placeholder-hardware`), so the example joins as a well-identified simulated machine.
fn dev_try_dir(state_dir: &Path) -> ApiResult<PathBuf> {
    let abs = std::fs::canonicalize(state_dir).map_err(|e| {
        ApiError::invalid_state(format!("cannot resolve {}: {e}", state_dir.display()))
    })?;
    let dir = abs.join("try");
    crate::fsutil::create_private_dir(&dir)
        .map_err(|e| ApiError::invalid_state(format!("{}: {e}", dir.display())))?;
    let claims = dir.join("claims.json");
    if !claims.exists() {
        let mut b = [0u8; 16];
        crate::crypto::fill_random(&mut b);
        let h = crate::crypto::hex(&b);
        let example = json!({
            "productUuid": format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32]),
            "serials": {"product": format!("DEV-{}", &h[0..8].to_uppercase())},
            "macs": [format!("02:00:00:{}:{}:{}", &h[0..2], &h[2..4], &h[4..6])],
            "hostname": format!("dev-{}", &h[0..6]),
        });
        let text = serde_json::to_string_pretty(&example).expect("serializes");
        crate::fsutil::write_new(&claims, text.as_bytes(), 0o600)
            .map_err(ApiError::invalid_state)?;
    }
    Ok(dir)
}

/// The lines `bca dev` prints to try next: each runs as pasted, one after another, in one new
/// shell anywhere (absolute paths, this very binary); only `<pool id>` is filled in by hand,
/// from the first line's output.
fn dev_try_lines(try_dir: &Path, ready: &Value) -> String {
    let bin = std::env::current_exe()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|_| "bca".into());
    let state = try_dir.parent().unwrap_or(try_dir);
    let q = |p: &str| shell_quote(p);
    let (bin, sd) = (q(&bin), q(&state.display().to_string()));
    let t = |name: &str| q(&try_dir.join(name).display().to_string());
    let (gw, http) = (
        ready["gateway"].as_str().unwrap_or_default(),
        ready["http"].as_str().unwrap_or_default(),
    );
    format!(
        "bca dev: serving {sd} (keys in plain files: development only). Try, in another shell:\n\
         \x20 {bin} --state-dir {sd} pools create --name rack-a\n\
         \x20 {bin} --state-dir {sd} join-tokens create --pool <pool id> --ttl 1h --key first --out {token}\n\
         \x20 {bin} --state-dir {sd} daemon agent-config --gateway-url https://{gw} --out {agent}\n\
         \x20 {bin} agent join --config {agent}/config.toml --data-dir {agent} --claims {claims} --token-file {token}\n\
         \x20 {bin} --state-dir {sd} nodes list\n\
         \x20 curl http://{http}/api/compute/.well-known/better-compute",
        token = t("join-token"),
        agent = t("agent"),
        claims = t("claims.json"),
    )
}

/// `s` as one shell word: as is when it holds only safe characters, else in single quotes.
fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-:@%+=,".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

fn cmd_pools(cmd: PoolsCmd, conn: &Conn) -> ApiResult<()> {
    match cmd {
        PoolsCmd::Create {
            name,
            tenant,
            agent,
            join_attestors,
            k8s_platform_operated,
        } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let mut policy = json!({});
            if let Some(a) = join_attestors {
                policy["joinAttestors"] = json!(a);
            }
            if k8s_platform_operated {
                policy["kubernetes"] = json!({"platformOperated": true});
            }
            let v = c.call(
                "pools/create",
                &json!({"tenantId": tenant, "name": name, "agent": agent, "policy": policy}),
            )?;
            print(conn, &v, print_record);
        }
        PoolsCmd::List { tenant, all } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "pools/list",
                &json!({"tenantId": tenant, "includeArchived": all}),
            )?;
            print(conn, &v, pool_table);
        }
        PoolsCmd::Get { id, tenant } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call("pools/get", &json!({"tenantId": tenant, "poolId": id}))?;
            print(conn, &v, print_record);
        }
        PoolsCmd::Update {
            id,
            tenant,
            name,
            agent,
            join_attestors,
            k8s_platform_operated,
        } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let mut body = json!({"tenantId": tenant, "poolId": id, "name": name, "agent": agent});
            if join_attestors.is_some() || k8s_platform_operated.is_some() {
                let cur = c.call("pools/get", &json!({"tenantId": tenant, "poolId": id}))?;
                let mut policy = cur["policy"].clone();
                if let Some(a) = join_attestors {
                    policy["joinAttestors"] = json!(a);
                }
                if let Some(k) = k8s_platform_operated {
                    policy["kubernetes"] = json!({"platformOperated": k});
                }
                body["policy"] = policy;
            }
            let v = c.call("pools/update", &body)?;
            print(conn, &v, print_record);
        }
        PoolsCmd::Archive { id, tenant } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call("pools/archive", &json!({"tenantId": tenant, "poolId": id}))?;
            print(conn, &v, print_record);
        }
    }
    Ok(())
}

fn cmd_join_tokens(cmd: JoinTokensCmd, conn: &Conn) -> ApiResult<()> {
    match cmd {
        JoinTokensCmd::Create {
            pool,
            tenant,
            ttl,
            max_uses,
            allow_reclaim,
            expect_product_uuid,
            expect_serial,
            expect_mac,
            expect_gpu_uuid,
            hosted,
            key,
            out,
            from_csv,
            out_dir,
        } => {
            let ttl = parse_duration(&ttl).map_err(ApiError::invalid_input)?;
            if let Some(csv) = from_csv {
                let output = match (out_dir, out) {
                    (Some(d), _) => crate::intake::Output::Dir(d),
                    (None, Some(f)) => crate::intake::Output::Csv(f),
                    (None, None) => {
                        return Err(ApiError::invalid_input(
                            "--from-csv needs --out-dir DIR or --out FILE: bulk secrets are never printed",
                        ))
                    }
                };
                let c = conn.client();
                let tenant = tenant_or_root(&c, tenant)?;
                let mut base = json!({"tenantId": tenant, "poolId": pool, "ttlSeconds": ttl, "allowReclaim": allow_reclaim});
                if let Some(m) = max_uses {
                    base["maxUses"] = json!(m);
                }
                let v = crate::intake::create_from_csv(&c, &csv, output, base, &key)?;
                print(conn, &v, |v| {
                    print_table(
                        &["NAME", "ID", "EXPECT", "EXPIRES"],
                        items(v)
                            .iter()
                            .map(|t| {
                                vec![
                                    s(&t["name"]),
                                    s(&t["id"]),
                                    t["expect"].to_string(),
                                    s(&t["expiresAt"]),
                                ]
                            })
                            .collect(),
                    )
                });
                return Ok(());
            }
            if let Some(o) = &out {
                if std::fs::symlink_metadata(o).is_ok() {
                    return Err(ApiError::already_exists(format!(
                        "{} exists; --out never writes over a file",
                        o.display()
                    )));
                }
            }
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let mut body = json!({"tenantId": tenant, "poolId": pool, "ttlSeconds": ttl, "idempotencyKey": key,
                "allowReclaim": allow_reclaim});
            if let Some(m) = max_uses {
                body["maxUses"] = json!(m);
            }
            if let Some(h) = hosted {
                body["hosted"] = json!(h);
            }
            let mut expect = serde_json::Map::new();
            for (k, v) in [
                ("productUuid", expect_product_uuid),
                ("serial", expect_serial),
                ("mac", expect_mac),
                ("gpuUuid", expect_gpu_uuid),
            ] {
                if let Some(v) = v {
                    expect.insert(k.into(), json!(v));
                }
            }
            if !expect.is_empty() {
                body["expect"] = Value::Object(expect);
            }
            let mut v = c.call("joinTokens/create", &body)?;
            if let Some(o) = &out {
                let Some(token) = v
                    .get("token")
                    .and_then(Value::as_str)
                    .map(|t| zeroize::Zeroizing::new(t.to_string()))
                else {
                    return Err(ApiError::invalid_state(format!(
                        "--key {key} was used before: the answer carries no token (it is shown only once); revoke {} and create a new one",
                        s(&v["id"])
                    )));
                };
                crate::fsutil::write_new_private(o, format!("{}\n", token.as_str()).as_bytes())
                    .map_err(|e| {
                        ApiError::already_exists(format!(
                            "{e}; the token {} was minted: revoke it",
                            s(&v["id"])
                        ))
                    })?;
                if let Some(o) = v.as_object_mut() {
                    o.remove("token");
                }
                eprintln!(
                    "the token is in {} (0600); it is not shown again",
                    o.display()
                );
            }
            print(conn, &v, print_record);
        }
        JoinTokensCmd::List {
            pool,
            tenant,
            all,
            limit,
            cursor,
        } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "joinTokens/list",
                &json!({"tenantId": tenant, "poolId": pool, "includeInactive": all, "limit": limit, "cursor": cursor}),
            )?;
            print(conn, &v, |v| {
                print_table(
                    &["ID", "USES LEFT", "EXPIRES", "EXPECT", "RECLAIM", "REVOKED"],
                    items(v)
                        .iter()
                        .map(|t| {
                            vec![
                                s(&t["id"]),
                                format!("{}/{}", s(&t["usesLeft"]), s(&t["maxUses"])),
                                s(&t["expiresAt"]),
                                t.get("expect").map(|e| e.to_string()).unwrap_or("-".into()),
                                s(&t["allowReclaim"]),
                                s(&t["revokedAt"]),
                            ]
                        })
                        .collect(),
                );
                print_cursor(v);
            });
        }
        JoinTokensCmd::Revoke { id, pool, tenant } => {
            if id.contains('.') {
                return Err(ApiError::invalid_input(
                    "that looks like a bearer token: revoke takes the token id (jt_…), never the secret; nothing was sent",
                ));
            }
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "joinTokens/revoke",
                &json!({"tenantId": tenant, "poolId": pool, "tokenId": id}),
            )?;
            print(conn, &v, print_record);
        }
    }
    Ok(())
}

fn cmd_pki_show(state_dir: &Path, as_json: bool) -> ApiResult<()> {
    let p = crate::pki::PublicPki::load(&crate::pki::pki_dir(state_dir))
        .map_err(ApiError::invalid_config)?;
    let pins = p.pins().map_err(ApiError::invalid_config)?;
    let summary = |der: &[u8]| -> Value {
        use x509_parser::prelude::*;
        match X509Certificate::from_der(der) {
            Ok((_, c)) => json!({
                "subject": c.subject().to_string(),
                "issuer": c.issuer().to_string(),
                "serial": c.raw_serial_as_string(),
                "notBefore": crate::clock::rfc3339(c.validity().not_before.timestamp()),
                "notAfter": crate::clock::rfc3339(c.validity().not_after.timestamp()),
            }),
            Err(e) => json!({"error": e.to_string()}),
        }
    };
    let rotation = crate::rotation::status(state_dir)?["rotation"].clone();
    let v = json!({
        "pins": pins,
        "rotation": rotation,
        "certificates": {
            "nodeCa": summary(&p.node_ca),
            "servingCa": summary(&p.serving_ca),
            "gateway": summary(&p.gateway),
            "joinSigning": summary(&p.join_signing),
        }
    });
    if as_json {
        println!("{}", serde_json::to_string_pretty(&v).expect("serializes"));
    } else {
        println!("serving_ca_spki_pin = \"{}\"", pins.serving_ca);
        println!("join_signing_key_pin = \"{}\"", pins.join_signing);
        println!("join_encryption_key_pin = \"{}\"", pins.join_encryption);
        if let Some(p) = &pins.join_signing_next {
            println!(
                "join_signing_next_key_pin = \"{p}\"  # promoted at {}",
                s(&rotation["joinSigning"]["promoteAt"])
            );
        }
        if let Some(p) = &pins.join_encryption_next {
            println!(
                "join_encryption_next_key_pin = \"{p}\"  # promoted at {}",
                s(&rotation["joinEncryption"]["promoteAt"])
            );
        }
        if !rotation["previousEncryptionAcceptedUntil"].is_null() {
            println!(
                "# the previous join-encryption key is accepted until {}",
                s(&rotation["previousEncryptionAcceptedUntil"])
            );
        }
        for (name, c) in v["certificates"].as_object().expect("object") {
            println!(
                "{name}: {} (serial {}), valid {} to {}",
                s(&c["subject"]),
                s(&c["serial"]),
                s(&c["notBefore"]),
                s(&c["notAfter"])
            );
        }
    }
    Ok(())
}

/// Refuses while `bca serve` answers on the state directory's admin socket.
fn not_serving(state_dir: &std::path::Path) -> ApiResult<()> {
    let admin = crate::config::Config::load(state_dir)
        .map(|c| c.admin_socket_path(state_dir))
        .map_err(ApiError::invalid_config)?;
    if std::os::unix::net::UnixStream::connect(&admin).is_ok() {
        return Err(ApiError::invalid_state(
            "bca serve is running on this state directory: stop it first",
        ));
    }
    Ok(())
}

fn cmd_tpm_status(conn: &Conn, tpm: Option<String>) -> ApiResult<()> {
    // On an appliance whose keys are sealed to a TPM: that TPM by default, and whether they load.
    let state_dir = conn.state_dir();
    let sealed = crate::config::Config::load(&state_dir)
        .ok()
        .filter(|c| c.key_protection == KeyProtection::Tpm);
    let tcti: crate::tpm::Tcti = tpm
        .as_deref()
        .or(sealed.as_ref().and_then(|c| c.tpm.as_deref()))
        .unwrap_or(crate::tpm::DEFAULT_TCTI)
        .parse()
        .map_err(|e: String| ApiError::new(Code::InvalidInput, &e))?;
    let mut v = crate::tpm::status(&tcti)?;
    if sealed.is_some() {
        let pcrs = crate::keys::sealed_pcrs(&state_dir).unwrap_or_default();
        let loaded =
            crate::keys::Vault::open_with_tpm(&state_dir, KeyProtection::Tpm, None, Some(&tcti));
        v["sealedKeys"] = serde_json::json!({
            "file": crate::keys::keys_dir(&state_dir).join("keys.tpm"),
            "pcrs": pcrs,
            "loadable": loaded.is_ok(),
            "error": loaded.err(),
        });
    }
    print(conn, &v, |v| {
        println!("TPM           {}", v["tcti"].as_str().unwrap_or(""));
        println!(
            "made by       {} ({}), firmware {}",
            v["manufacturer"].as_str().unwrap_or(""),
            v["vendor"].as_str().unwrap_or(""),
            v["firmware"].as_str().unwrap_or("")
        );
        for alg in ["rsa", "ecc"] {
            let ek = &v["ek"][alg];
            let cert = &ek["certificate"];
            let cert = if cert.is_null() {
                "no certificate in NV".to_string()
            } else {
                format!(
                    "certificate at {} ({} bytes{})",
                    cert["nvIndex"].as_str().unwrap_or(""),
                    cert["bytes"],
                    if cert["certifiesThisEk"] == true {
                        ", certifies this EK"
                    } else {
                        ", DOES NOT certify this EK"
                    }
                )
            };
            println!(
                "EK {alg}        name {}, {cert}",
                ek["name"].as_str().unwrap_or("")
            );
        }
        println!(
            "AK            name {}",
            v["ak"]["name"].as_str().unwrap_or("")
        );
        let s = &v["sealedKeys"];
        if !s.is_null() {
            let pcrs = s["pcrs"].as_array().map(|p| p.len()).unwrap_or(0);
            let bound = if pcrs == 0 {
                "bound to no PCR".to_string()
            } else {
                format!("bound to PCRs {}", s["pcrs"])
            };
            if s["loadable"] == true {
                println!(
                    "sealed keys   {}: {bound}, unseal",
                    s["file"].as_str().unwrap_or("")
                );
            } else {
                println!(
                    "sealed keys   {}: {bound}, DO NOT unseal: {}",
                    s["file"].as_str().unwrap_or(""),
                    s["error"].as_str().unwrap_or("")
                );
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1h"), Ok(3600));
        assert_eq!(parse_duration("1m"), Ok(60));
        assert_eq!(parse_duration("24h"), Ok(86_400));
        assert_eq!(parse_duration("1h30m"), Ok(5400));
        assert_eq!(parse_duration("3600s"), Ok(3600));
        assert!(parse_duration("59s").is_err());
        assert!(parse_duration("25h").is_err());
        assert!(parse_duration("1.5h").is_err());
        assert!(parse_duration("60").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("h").is_err());
    }

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
    }
}
