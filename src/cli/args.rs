//! The command line's shape: every command, its arguments and their defaults (clap).

use super::conn::*;
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

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

#[derive(Subcommand)]
pub enum Command {
    /// Initialise a state directory: database, root tenant, site, PKI and keys.
    Init(InitArgs),
    /// Serve: the admin socket, the HTTP listener and the gateway.
    Serve(ServeArgs),
    /// Make this box another appliance of a site whose store is PostgreSQL: its own keys, recorded
    /// as pending until an operator approves it on an appliance of the site (docs/scale-out.md).
    #[command(name = "join-site")]
    JoinSite(JoinSiteArgs),
    /// The site's appliances.
    #[command(subcommand)]
    Site(SiteCmd),
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
    Nodes(super::nodes::NodesCmd),
    /// Network boot: who booted what, when.
    #[command(subcommand)]
    Boot(BootCmd),
    /// The join-request queue: machines waiting for an operator's approval.
    #[command(subcommand, name = "join-requests")]
    JoinRequests(super::join_requests::JoinRequestsCmd),
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
    /// The site's store: move a SQLite appliance's state into PostgreSQL.
    #[command(subcommand)]
    Store(StoreCmd),
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

/// A pool's `policy.acceptance` (docs/acceptance.md).
#[derive(Args, Default, Debug)]
pub struct AcceptanceArgs {
    /// Checks before a joined node is adopted, comma-separated: session, clock, claims, macs,
    /// tpm (`none`: no checks, adopted at once).
    #[arg(long, value_delimiter = ',')]
    pub acceptance: Option<Vec<String>>,
    /// For the macs check: permanent MACs the node must have (default 1).
    #[arg(long)]
    pub acceptance_min_macs: Option<u32>,
    /// Require a TPM-held node key (the tpm check).
    #[arg(long)]
    pub acceptance_require_tpm: bool,
    /// For the clock check: seconds the agent's clock may be off (default 30).
    #[arg(long)]
    pub acceptance_max_clock_skew: Option<u32>,
}

impl AcceptanceArgs {
    pub fn given(&self) -> bool {
        self.acceptance.is_some()
            || self.acceptance_min_macs.is_some()
            || self.acceptance_require_tpm
            || self.acceptance_max_clock_skew.is_some()
    }

    /// Writes what was given into `policy` (a pool's policy JSON), keeping what was not.
    pub fn apply(&self, policy: &mut serde_json::Value) {
        if !self.given() {
            return;
        }
        if self.acceptance.as_deref() == Some(&["none".to_string()][..]) {
            if let Some(o) = policy.as_object_mut() {
                o.remove("acceptance");
            }
            return;
        }
        let mut a = policy
            .get("acceptance")
            .cloned()
            .filter(|a| a.is_object())
            .unwrap_or_else(|| serde_json::json!({}));
        if let Some(c) = &self.acceptance {
            a["checks"] = serde_json::json!(c);
        }
        if let Some(n) = self.acceptance_min_macs {
            a["minMacs"] = serde_json::json!(n);
        }
        if self.acceptance_require_tpm {
            a["requireTpm"] = serde_json::json!(true);
        }
        if let Some(s) = self.acceptance_max_clock_skew {
            a["maxClockSkewSeconds"] = serde_json::json!(s);
        }
        policy["acceptance"] = a;
    }
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
    /// Keep the site's state in PostgreSQL instead of the embedded SQLite file:
    /// postgres://USER@HOST[:PORT]/DB (no password in it; HOST is the Unix socket's folder, percent-encoded:
    /// %2Frun%2Fpostgresql). The database must hold no site yet.
    #[arg(long, value_name = "URL")]
    pub store: Option<String>,
    /// With --store: the file holding the database user's password (mode 0600), kept by path in
    /// config.toml and read at each start.
    #[arg(long, value_name = "FILE")]
    pub store_password_file: Option<PathBuf>,
}

#[derive(Args)]
pub struct JoinSiteArgs {
    /// The site's database: postgres://USER@HOST[:PORT]/DB (no password in it).
    #[arg(long, value_name = "URL")]
    pub store: String,
    /// The file holding the database user's password (mode 0600).
    #[arg(long, value_name = "FILE")]
    pub store_password_file: Option<PathBuf>,
    /// The site's serving CA pin (sha256/…, `bca pki show` on an appliance of the site): the
    /// site's keys this box receives must be the ones it names.
    #[arg(long, value_name = "PIN")]
    pub serving_ca_pin: String,
    /// A name (DNS or IP) this appliance's gateway certificate carries; repeat for more.
    #[arg(long = "gateway-san", required = true)]
    pub gateway_san: Vec<String>,
    /// The gateway URL agents dial for this appliance (https://host[:port]).
    #[arg(long)]
    pub gateway_url: Option<String>,
    /// passphrase (default), file (development only) or tpm: how this box's own keys rest.
    #[arg(long, default_value = "passphrase")]
    pub key_protection: String,
    /// With --key-protection tpm: the TPM to seal to.
    #[arg(long)]
    pub tpm: Option<String>,
    /// With --key-protection tpm: also bind to these PCRs (SHA-256 bank).
    #[arg(long, value_name = "LIST")]
    pub tpm_pcrs: Option<String>,
}

#[derive(Subcommand)]
pub enum SiteCmd {
    /// The appliances of the site: approve, list, remove.
    #[command(subcommand)]
    Appliances(AppliancesCmd),
}

#[derive(Subcommand)]
pub enum AppliancesCmd {
    /// Every appliance of the site: its state, names, fingerprint and last heartbeat.
    List,
    /// Give a pending appliance the site's keys (check its fingerprint first: bca join-site
    /// printed it on that box).
    Approve {
        id: String,
        /// The fingerprint `bca join-site` printed on that box: the approval is refused unless the
        /// appliance's keys, names and URL in the database give the same one.
        #[arg(long)]
        fingerprint: String,
    },
    /// Remove an appliance from the site: its wrapped keys deleted; it stops serving.
    Remove { id: String },
}

#[derive(Subcommand)]
pub enum StoreCmd {
    /// Copy the whole state (tokens, nodes, certificates, requests, events, audit) into an
    /// empty PostgreSQL database, check it row for row, and point config.toml at it. Stop bca
    /// serve first; bca.db is kept, renamed.
    Migrate {
        /// postgres://USER@HOST[:PORT]/DB (no password in it).
        #[arg(long, value_name = "URL")]
        to: String,
        /// The file holding the database user's password (mode 0600).
        #[arg(long, value_name = "FILE")]
        store_password_file: Option<PathBuf>,
    },
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
        #[command(flatten)]
        acceptance: AcceptanceArgs,
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
        #[command(flatten)]
        acceptance: AcceptanceArgs,
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
        /// join-token (default), discovery (a PXE-booted ramdisk, with role ramdisk), tpm (no
        /// token: the machine's TPM proves it, and holds the node key), or x509pop (no token: the
        /// identity in --data-dir, whose certificate expired while offline, comes back by proving
        /// its key, within 7 days of the expiry, where the appliance runs x509pop).
        #[arg(long, default_value = "join-token", value_parser = ["join-token", "discovery", "tpm", "x509pop"])]
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
        /// The node a provisioned token (bca nodes provision-token) is for: the installed OS
        /// joins as that node, role node.
        #[arg(long)]
        node_id: Option<String>,
    },
    /// Keep the node's session, renew its certificate, reconnect with backoff (until SIGTERM).
    Run {
        #[arg(long, default_value = crate::agent::DEFAULT_CONFIG)]
        config: PathBuf,
        #[arg(long, default_value = crate::agent::DEFAULT_DATA_DIR)]
        data_dir: PathBuf,
        /// Claims from a JSON file instead of this machine, reported (signed) in the session's
        /// hello for a pool's acceptance checks (simulated machines, tests).
        #[arg(long)]
        claims: Option<PathBuf>,
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
        /// The gateway URL agents dial; repeat for each appliance of the site (tried in turn).
        #[arg(long, required = true)]
        gateway_url: Vec<String>,
        /// Where the script downloads the agent: this appliance's HTTP URL.
        #[arg(long)]
        base_url: String,
        /// The agent version to download (as added with `bca downloads add`).
        #[arg(long)]
        bcd_version: String,
        /// amd64=<hex>[,arm64=<hex>]: the SHA-256 of each binary.
        #[arg(
            long,
            required_unless_present = "release_manifest",
            conflicts_with = "release_manifest"
        )]
        sha256: Option<String>,
        /// Instead of --sha256: the signed release manifest's URL
        /// (<base-url>/api/compute/downloads/manifest); the script checks its signature against
        /// --release-pins before it trusts a digest.
        #[arg(long, requires = "release_pins")]
        release_manifest: Option<String>,
        /// Comma-separated sha256/… SPKI pins of the keys allowed to sign the manifest (the
        /// join-signing key's pin, and its next key's during a rotation: bca pki show).
        #[arg(long, requires = "release_manifest")]
        release_pins: Option<String>,
    },
    /// Write an agent's config.toml (0600) and join-encryption.jwk (0644) into a new folder.
    #[command(name = "agent-config")]
    AgentConfig {
        /// The gateway agents dial; repeat for each appliance of the site (tried in turn).
        #[arg(long, required = true)]
        gateway_url: Vec<String>,
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
