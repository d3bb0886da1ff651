//! The agent, the machine side in the same binary: `bca agent join` and the claims it collects.
//!
//! Files (under `--data-dir`, default `/var/lib/bca-agent`): `node.key` (0600, PKCS#8 PEM) and
//! `identity.json` (0600: node id, site, trust domain, role, certificate chain). The config (the
//! seed's `config.toml`) and `join-encryption.jwk` lie beside each other (default `/etc/bca-agent`).

pub mod identity;
pub mod nodekey;
pub mod run;
pub mod tlsclient;
pub mod x509pop;

use crate::agent::nodekey::NodeKey;
use crate::base::crypto::{self, SigningKey};
use crate::base::error::{ApiError, ApiResult, Code};
use crate::proto::agent_config::write_agent_files;
use crate::proto::agent_config::AgentConfig;
use crate::proto::claims::Claims;
use crate::proto::jwe::Jwk;
use crate::proto::protocol::{
    self, JoinRequest, JoinResponseBody, Reply, Request, JOIN_RESPONSE_PURPOSE,
};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use zeroize::Zeroizing;

pub const DEFAULT_CONFIG: &str = "/etc/bca-agent/config.toml";
pub const DEFAULT_DATA_DIR: &str = "/var/lib/bca-agent";

/// What a node keeps after joining.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Identity {
    pub node_id: String,
    pub site_id: String,
    pub trust_domain: String,
    pub role: String,
    /// PEM, leaf first.
    pub certificate_chain: Vec<String>,
}

pub struct JoinOptions {
    pub config: PathBuf,
    pub data_dir: PathBuf,
    pub claims: Option<PathBuf>,
    pub role: String,
    pub reset: bool,
    pub yes: bool,
    /// The appliance's HTTP URL, for the well-known fallback.
    pub server: Option<String>,
    /// Pins given on the command line, to build a configuration from the well-known document.
    pub pins: Option<BootstrapPins>,
    /// Read the token from this file (0600 or 0400, at most 4 KiB) and delete it after the join.
    pub token_file: Option<PathBuf>,
    /// The token itself (for in-process callers such as `bca dev --sim`).
    pub token: Option<Zeroizing<String>>,
    /// Empty (`join-token`), `discovery`, `tpm` or `x509pop` (an expired identity comes back).
    pub attestor: String,
    /// With `tpm`: the machine's TPM (default `device:/dev/tpmrm0`).
    pub tpm: Option<String>,
    /// With `tpm`: an EK on no list is refused instead of waiting for an operator.
    pub no_enroll: bool,
    /// How long to keep retrying a deferred join.
    pub wait_seconds: u32,
    /// Retry a deferred join after this many seconds instead of what the appliance says.
    pub retry_seconds: Option<u32>,
    /// The node a `provisioned` token is for (`--node-id`): the join must answer for it.
    pub node_id: Option<String>,
}

/// The body of a `{ body, sig, signer }` answer, once the signer is the pinned join-signing key
/// and the signature (under `purpose`) verifies; else what failed.
fn signed_body(
    cfg: &AgentConfig,
    r: &protocol::JoinResponse,
    purpose: &str,
) -> Result<Vec<u8>, &'static str> {
    let signer = crypto::b64_decode(&r.signer).ok_or("signer")?;
    let spki = crate::proto::x509::cert_spki(&signer).map_err(|_| "signer")?;
    let pin = crypto::spki_pin(&spki);
    if pin != cfg.join_signing_key_pin && Some(&pin) != cfg.join_signing_next_key_pin.as_ref() {
        return Err("not signed by the pinned join-signing key");
    }
    let point = crypto::p256_point_from_spki(&spki).ok_or("signer key")?;
    let body = crypto::b64_decode(&r.body).ok_or("body")?;
    let sig = crypto::b64_decode(&r.sig).ok_or("sig")?;
    if !crypto::verify(point, purpose, &body, &sig) {
        return Err("bad signature");
    }
    Ok(body)
}

/// What a verified answer teaches about the join-signing pins: the appliance now signs with the
/// next key (it becomes the current pin), or a next key is staged (its pin, inside the body the
/// current key signed). `Some` when the configuration should change.
pub fn pins_learned(
    cfg: &AgentConfig,
    r: &protocol::JoinResponse,
    body: &JoinResponseBody,
) -> Option<AgentConfig> {
    let mut next = cfg.clone();
    let signer_pin = crypto::b64_decode(&r.signer)
        .and_then(|d| crate::proto::x509::cert_spki(&d).ok())
        .map(|s| crypto::spki_pin(&s));
    if let Some(p) = signer_pin.filter(|p| Some(p) == cfg.join_signing_next_key_pin.as_ref()) {
        next.join_signing_key_pin = p;
        next.join_signing_next_key_pin = None;
    }
    if let Some(p) = &body.join_signing_next_key_pin {
        if *p != next.join_signing_key_pin {
            next.join_signing_next_key_pin = Some(p.clone());
        }
    }
    (next != *cfg).then_some(next)
}

/// The join-signing pins an agent learned from signed answers, kept in its data directory
/// (`pins.json`, 0600): the config directory is read-only under the agent's unit.
#[derive(Serialize, Deserialize, Debug, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct LearnedPins {
    join_signing_key_pin: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    join_signing_next_key_pin: Option<String>,
}

/// Writes what `cfg` knows of the join-signing pins to `<data_dir>/pins.json`.
pub fn save_learned(data_dir: &Path, cfg: &AgentConfig) -> ApiResult<()> {
    let p = LearnedPins {
        join_signing_key_pin: cfg.join_signing_key_pin.clone(),
        join_signing_next_key_pin: cfg.join_signing_next_key_pin.clone(),
    };
    crate::base::fsutil::write_atomic(
        &data_dir.join("pins.json"),
        &serde_json::to_vec_pretty(&p).expect("serializes"),
        0o600,
    )
    .map_err(ApiError::invalid_state)
}

/// Applies `<data_dir>/pins.json` to a loaded config: a learned promotion (the learned current pin
/// is the config's next) or a learned next pin (same current pin). Learned pins from before the
/// operator replaced the config with other pins are ignored.
pub fn apply_learned(cfg: &mut AgentConfig, data_dir: &Path) {
    let Some(l) = std::fs::read(data_dir.join("pins.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<LearnedPins>(&b).ok())
    else {
        return;
    };
    let valid = |p: &str| {
        p.strip_prefix("sha256/")
            .and_then(crypto::b64_decode)
            .is_some_and(|h| h.len() == 32)
    };
    if !valid(&l.join_signing_key_pin)
        || l.join_signing_next_key_pin
            .as_deref()
            .is_some_and(|p| !valid(p))
    {
        return;
    }
    if Some(&l.join_signing_key_pin) == cfg.join_signing_next_key_pin.as_ref() {
        cfg.join_signing_key_pin = l.join_signing_key_pin;
        cfg.join_signing_next_key_pin = l.join_signing_next_key_pin;
    } else if l.join_signing_key_pin == cfg.join_signing_key_pin
        && l.join_signing_next_key_pin.is_some()
    {
        cfg.join_signing_next_key_pin = l.join_signing_next_key_pin;
    }
}

/// A deferral is accepted only under the pinned join-signing key and for this CSR.
pub fn verify_deferral(
    cfg: &AgentConfig,
    d: &protocol::JoinResponse,
    csr: &[u8],
) -> ApiResult<protocol::JoinDeferral> {
    let bad = |m: &str| ApiError::access_denied(format!("the deferral failed verification: {m}"));
    let body = signed_body(cfg, d, protocol::JOIN_DEFERRAL_PURPOSE).map_err(&bad)?;
    let d: protocol::JoinDeferral = serde_json::from_slice(&body).map_err(|_| bad("body"))?;
    if d.csr_sha256 != crypto::hex(&crypto::sha256(csr)) {
        return Err(bad("it answers another CSR"));
    }
    Ok(d)
}

#[derive(Clone, Debug)]
pub struct BootstrapPins {
    pub serving_ca: String,
    pub join_signing: String,
    pub join_encryption: String,
}

/// Reads a token file: a regular file of at most 4 KiB that only its owner can read.
pub fn read_token_file(p: &Path) -> ApiResult<Zeroizing<String>> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let m = std::fs::symlink_metadata(p)
        .map_err(|e| ApiError::invalid_input(format!("--token-file {}: {e}", p.display())))?;
    if !m.is_file() {
        return Err(ApiError::invalid_input(format!(
            "--token-file {} is not a regular file",
            p.display()
        )));
    }
    if m.len() > 4096 {
        return Err(ApiError::invalid_input(format!(
            "--token-file {} is larger than 4 KiB",
            p.display()
        )));
    }
    // The seed: 0600 or 0400 exactly (an executable bit, or a set-id or sticky bit, is refused too).
    let mode = m.permissions().mode() & 0o7777;
    if !matches!(mode, 0o600 | 0o400) || m.uid() != crate::base::fsutil::own_uid() {
        return Err(ApiError::invalid_input(format!(
            "--token-file {} must be readable by its owner alone (0600 or 0400, owned by this user); it is {mode:04o}",
            p.display()
        )));
    }
    let t = Zeroizing::new(
        std::fs::read_to_string(p)
            .map_err(|e| ApiError::invalid_input(format!("--token-file: {e}")))?,
    );
    check_token(t.trim())
}

fn check_token(t: &str) -> ApiResult<Zeroizing<String>> {
    if !t.starts_with("bcjt_") || t.len() > 512 || t.contains(char::is_whitespace) {
        return Err(ApiError::invalid_input(
            "the join token must look like bcjt_<id>.<secret>, on standard input or in BCD_JOIN_TOKEN",
        ));
    }
    Ok(Zeroizing::new(t.to_string()))
}

/// `GET <server>/api/compute/.well-known/better-compute` over plain HTTP: nothing in it is trusted
/// unless it matches a pin.
pub fn fetch_document(server: &str) -> ApiResult<serde_json::Value> {
    use std::io::{Read, Write};
    let rest = server
        .strip_prefix("http://")
        .ok_or_else(|| ApiError::invalid_input("--server must be an http:// URL"))?;
    let authority = rest.split('/').next().unwrap_or("");
    let addr = if authority.contains(':') {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let fail = |e: String| {
        ApiError::new(
            Code::InvalidState,
            format!("cannot read the well-known document from {server}: {e}"),
        )
    };
    let mut s = std::net::TcpStream::connect(&addr).map_err(|e| fail(e.to_string()))?;
    let _ = s.set_read_timeout(Some(std::time::Duration::from_secs(10)));
    let req = format!("GET {}/.well-known/better-compute HTTP/1.1\r\nhost: {authority}\r\nconnection: close\r\n\r\n", crate::proto::protocol::BASE_PATH);
    s.write_all(req.as_bytes())
        .map_err(|e| fail(e.to_string()))?;
    let mut raw = Vec::new();
    s.take(1 << 20)
        .read_to_end(&mut raw)
        .map_err(|e| fail(e.to_string()))?;
    let (status, body) =
        crate::base::net::split_response(&raw).ok_or_else(|| fail("malformed answer".into()))?;
    if status != 200 {
        return Err(fail(format!("HTTP {status}")));
    }
    serde_json::from_slice(body).map_err(|e| fail(e.to_string()))
}

/// The join-encryption key from the document, only when it matches the pin.
fn document_jwk(doc: &serde_json::Value, pin: &str) -> ApiResult<(Vec<u8>, String)> {
    // During a rotation the pin may name the next key.
    let field = if doc["join"]["nextEncryptionKeyPin"].as_str() == Some(pin) {
        "nextEncryptionJwk"
    } else {
        "encryptionJwk"
    };
    let jwk: Jwk = serde_json::from_value(doc["join"][field].clone()).map_err(|_| {
        ApiError::invalid_config("the well-known document has no join.encryptionJwk")
    })?;
    let point = jwk
        .point()
        .ok_or_else(|| ApiError::invalid_config("join.encryptionJwk is not a P-256 key"))?;
    if crypto::spki_pin(&crypto::p256_spki_from_point(&point)) != pin {
        return Err(ApiError::invalid_config(
            "the well-known document's join-encryption key does not match join_encryption_key_pin; refusing it",
        ));
    }
    Ok((
        point,
        serde_json::to_string_pretty(&jwk).expect("serializes") + "\n",
    ))
}

/// The configuration to join with, the join-encryption point, and the JWK to write after the
/// join when the configuration was built from the well-known document.
fn resolve_config(o: &JoinOptions) -> ApiResult<(AgentConfig, Vec<u8>, Option<String>)> {
    if o.config.exists() {
        let cfg = AgentConfig::load(&o.config)?;
        let jwk_path = o.config.with_file_name("join-encryption.jwk");
        if jwk_path.exists() || o.server.is_none() {
            // A key file that is present but does not match the pin fails the join.
            let point = cfg.join_encryption_point(&o.config)?;
            return Ok((cfg, point, None));
        }
        let doc = fetch_document(o.server.as_deref().expect("checked"))?;
        let (point, _) = document_jwk(&doc, &cfg.join_encryption_key_pin)?;
        return Ok((cfg, point, None));
    }
    let (Some(server), Some(pins)) = (&o.server, &o.pins) else {
        return Err(ApiError::invalid_config(format!(
            "{} does not exist: write it with bca daemon agent-config, or pass --server with --serving-ca-pin, --join-signing-pin and --join-encryption-pin",
            o.config.display()
        )));
    };
    let doc = fetch_document(server)?;
    // During a join-encryption overlap the pin given may be the staged next key's (what
    // `bca daemon agent-config` hands out then).
    let enc = serde_json::json!(pins.join_encryption);
    let same = (doc["join"]["encryptionKeyPin"] == enc
        || doc["join"]["nextEncryptionKeyPin"] == enc)
        && doc["join"]["signingKeyPin"] == serde_json::json!(pins.join_signing)
        && doc["gateway"]["servingCaPin"] == serde_json::json!(pins.serving_ca);
    if !same {
        return Err(ApiError::invalid_config(
            "the well-known document's pins differ from the ones given; refusing it",
        ));
    }
    let (point, jwk) = document_jwk(&doc, &pins.join_encryption)?;
    let url = doc["gateway"]["url"]
        .as_str()
        .ok_or_else(|| ApiError::invalid_config("the document has no gateway.url"))?;
    let cfg = AgentConfig {
        gateway_url: url.to_string(),
        gateway_urls: Vec::new(),
        site: String::new(),
        serving_ca_spki_pin: pins.serving_ca.clone(),
        join_signing_key_pin: pins.join_signing.clone(),
        join_encryption_key_pin: pins.join_encryption.clone(),
        server_name: doc["gateway"]["serverName"].as_str().map(str::to_string),
        join_signing_next_key_pin: None,
    };
    Ok((cfg, point, Some(jwk)))
}

/// Reads the bearer token from `BCD_JOIN_TOKEN` (or `BCA_JOIN_TOKEN`), else standard input.
pub fn read_token() -> ApiResult<Zeroizing<String>> {
    let raw = match std::env::var("BCD_JOIN_TOKEN").or_else(|_| std::env::var("BCA_JOIN_TOKEN")) {
        Ok(t) => Zeroizing::new(t),
        Err(_) => {
            use std::io::Read;
            let mut buf = Zeroizing::new(String::new());
            std::io::stdin()
                .take(4096)
                .read_to_string(&mut buf)
                .map_err(|e| {
                    ApiError::invalid_input(format!(
                        "cannot read the token from standard input: {e}"
                    ))
                })?;
            buf
        }
    };
    check_token(raw.trim())
}

fn read_file_string(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The claims of this machine: DMI, permanent MACs of physical NICs, NVIDIA GPU UUIDs, hostname.
pub fn collect_claims() -> Claims {
    let dmi = Path::new("/sys/class/dmi/id");
    let mut macs = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/sys/class/net") {
        for e in rd.flatten() {
            let p = e.path();
            // A physical NIC has a device; addr_assign_type 0 is a permanent address.
            if p.join("device").exists()
                && read_file_string(&p.join("addr_assign_type")).as_deref() == Some("0")
            {
                if let Some(a) = read_file_string(&p.join("address")) {
                    macs.push(a);
                }
            }
        }
    }
    let mut gpus = Vec::new();
    if let Ok(rd) = std::fs::read_dir("/proc/driver/nvidia/gpus") {
        for e in rd.flatten() {
            if let Some(info) = read_file_string(&e.path().join("information")) {
                for line in info.lines() {
                    if let Some(u) = line.strip_prefix("GPU UUID:") {
                        gpus.push(u.trim().to_string());
                    }
                }
            }
        }
    }
    Claims {
        product_uuid: read_file_string(&dmi.join("product_uuid")),
        serials: crate::proto::claims::Serials {
            product: read_file_string(&dmi.join("product_serial")),
            board: read_file_string(&dmi.join("board_serial")),
            chassis: read_file_string(&dmi.join("chassis_serial")),
        },
        macs,
        gpu_uuids: gpus,
        hostname: read_file_string(Path::new("/proc/sys/kernel/hostname")),
    }
}

/// Claims from a JSON file (`--claims`: simulated machines, tests).
pub fn read_claims(p: &Path) -> ApiResult<Claims> {
    let text = std::fs::read_to_string(p)
        .map_err(|e| ApiError::invalid_input(format!("cannot read {}: {e}", p.display())))?;
    serde_json::from_str::<Claims>(&text)
        .map_err(|e| ApiError::invalid_input(format!("{}: {e}", p.display())))
}

fn utc_stamp(now: i64) -> String {
    crate::base::clock::rfc3339(now).replace(':', "")
}

/// `bca agent join`. Returns the node id (or the existing one when already joined).
pub fn join(o: &JoinOptions) -> ApiResult<String> {
    let identity_path = o.data_dir.join("identity.json");
    let key_path = o.data_dir.join("node.key");
    if o.reset && !o.yes {
        return Err(ApiError::invalid_input(
            "--reset moves the current identity aside; confirm with --yes",
        ));
    }
    if o.role != "node" && o.role != "ramdisk" {
        return Err(ApiError::invalid_input(format!(
            "--role must be node or ramdisk, got {:?}",
            o.role
        )));
    }
    if o.attestor == "x509pop" {
        return rejoin_x509pop(o);
    }
    if identity_path.exists() && !o.reset {
        if let Some(id) = std::fs::read(&identity_path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Identity>(&b).ok())
        {
            println!(
                "already joined (node {}); to join again: bca agent join --reset --yes",
                id.node_id
            );
            return Ok(id.node_id);
        }
    }
    let (mut cfg, enc_point, bootstrap_jwk) = resolve_config(o)?;
    let claims = match &o.claims {
        Some(p) => read_claims(p)?,
        None => collect_claims(),
    };
    let tpm = o.attestor == "tpm";
    let tcti: Option<crate::tpm::Tcti> = match (&o.tpm, tpm) {
        (Some(_), false) => {
            return Err(ApiError::invalid_input(
                "--tpm names the TPM of --attestor tpm; other attestors use none",
            ))
        }
        (None, false) if o.no_enroll => {
            return Err(ApiError::invalid_input(
                "--no-enroll is for --attestor tpm: other attestors have no EK to enroll",
            ))
        }
        (Some(t), true) => Some(
            t.parse()
                .map_err(|e: String| ApiError::invalid_input(format!("--tpm: {e}")))?,
        ),
        (None, true) => Some(crate::tpm::Tcti::default()),
        (None, false) => None,
    };
    // The `tpm` attestor needs no token: the TPM is the proof.
    let token = match (&o.token, &o.token_file, tpm) {
        (_, _, true) => Zeroizing::new(String::new()),
        (Some(t), _, _) => check_token(t)?,
        (None, Some(f), _) => read_token_file(f)?,
        (None, None, _) => read_token()?,
    };
    // The key is made before anything is moved aside: a TPM that cannot make one stops here.
    let key = match &tcti {
        Some(t) => NodeKey::generate_in(t)?,
        None => NodeKey::generate(),
    };
    if o.reset {
        let stamp = utc_stamp(crate::base::clock::now());
        for name in [
            "identity.json",
            "node.key",
            "node.key.next",
            "node.key.x509pop",
        ] {
            let p = o.data_dir.join(name);
            if p.exists() {
                let to = o.data_dir.join(format!("{name}.reset-{stamp}"));
                std::fs::rename(&p, &to).map_err(|e| {
                    ApiError::invalid_state(format!("cannot move {}: {e}", p.display()))
                })?;
            }
        }
    }
    crate::base::fsutil::create_private_dir(&o.data_dir).map_err(ApiError::invalid_state)?;

    let csr = key.csr()?;
    // A deferred join (waiting for an operator) is retried with the same key and CSR, sealed
    // anew each time; the token is spent only when the join is admitted.
    let started = crate::base::clock::now();
    let resp = loop {
        // A `tpm` join answers a fresh challenge each attempt; a token is sealed anew.
        let (sealed, evidence) = if tpm {
            (
                String::new(),
                Some(tpm_evidence(&cfg, &key, &csr, o.no_enroll)?),
            )
        } else {
            let sealed =
                crate::proto::jwe::seal(&token, &enc_point, &csr, crate::base::clock::now())
                    .map_err(ApiError::internal)?;
            (sealed, None)
        };
        let request = Request {
            v: 1,
            join: Some(JoinRequest {
                sealed_token: sealed,
                csr: crypto::b64(&csr),
                claims: claims.clone(),
                attestor: o.attestor.clone(),
                role: o.role.clone(),
                tpm: evidence,
                x509pop: None,
                node_id: o.node_id.clone(),
            }),
            ..Default::default()
        };
        let reply = exchange(&cfg, &serde_json::to_vec(&request).expect("serializes"))?;
        if let Some(e) = reply.error {
            return Err(wire_error(e));
        }
        if let Some(d) = reply.join_deferred {
            let deferral = verify_deferral(&cfg, &d, &csr)?;
            let waited = crate::base::clock::now() - started;
            if waited >= o.wait_seconds as i64 {
                return Err(ApiError::invalid_state(format!(
                    "join request {} is still pending after {waited} s; an operator approves it with bca join-requests approve",
                    deferral.request_id
                )));
            }
            let retry = o
                .retry_seconds
                .unwrap_or(deferral.retry_after_seconds)
                .max(1);
            eprintln!(
                "pending: join request {} waits for an operator's approval; retrying in {retry} s",
                deferral.request_id
            );
            std::thread::sleep(std::time::Duration::from_secs(retry as u64));
            continue;
        }
        break reply
            .join_response
            .ok_or_else(|| ApiError::internal("the gateway's answer carries no response"))?;
    };
    drop(token);
    let body = verify_response_for(&cfg, &resp, &csr, &key.spki_der(), &o.role)?;
    if let Some(want) = &o.node_id {
        if &body.node_id != want {
            return Err(ApiError::access_denied(format!(
                "the answer names node {}, not --node-id {want}",
                body.node_id
            )));
        }
    }
    let learned = pins_learned(&cfg, &resp, &body);
    let pins_changed = learned.is_some();
    if let Some(l) = learned {
        cfg = l;
    }
    if let Some(jwk) = bootstrap_jwk {
        // Built from the document: the signed response named the site; keep the configuration.
        cfg.site = body.site_id.clone();
        write_agent_files(&cfg, &jwk, o.config.parent().unwrap_or(Path::new(".")))?;
    }
    if let Some(f) = &o.token_file {
        if let Err(e) = std::fs::remove_file(f) {
            tracing::warn!(file = %f.display(), error = %e, "the token file could not be deleted (a read-only mount?)");
        }
    }
    // The key first, then the identity that names it; each write is atomic.
    crate::base::fsutil::write_atomic(&key_path, &key.file_bytes(), 0o600)
        .map_err(ApiError::invalid_state)?;
    let identity = Identity {
        node_id: body.node_id.clone(),
        site_id: body.site_id,
        trust_domain: body.trust_domain,
        role: body.role,
        certificate_chain: body.certificate_chain,
    };
    crate::base::fsutil::write_atomic(
        &identity_path,
        &serde_json::to_vec_pretty(&identity).expect("serializes"),
        0o600,
    )
    .map_err(ApiError::invalid_state)?;
    if pins_changed {
        save_learned(&o.data_dir, &cfg)?;
    }
    Ok(body.node_id)
}

/// `bca agent join --attestor x509pop`: the identity in the data directory, expired, comes back
/// (`x509pop`); nothing else of a join applies.
fn rejoin_x509pop(o: &JoinOptions) -> ApiResult<String> {
    if o.reset
        || o.token_file.is_some()
        || o.token.is_some()
        || o.claims.is_some()
        || o.tpm.is_some()
        || o.no_enroll
    {
        return Err(ApiError::invalid_input(
            "--attestor x509pop brings back the identity in --data-dir with the key of its expired certificate: it takes no token, claims, --tpm, --no-enroll or --reset",
        ));
    }
    let mut cfg = AgentConfig::load(&o.config)?;
    apply_learned(&mut cfg, &o.data_dir);
    crate::agent::x509pop::rejoin(&cfg, &o.data_dir)
}

/// The gateway's error as the agent reports it.
pub(crate) fn wire_error(e: protocol::WireError) -> ApiError {
    let code = serde_json::from_value::<Code>(serde_json::Value::String(e.code.clone()))
        .unwrap_or(Code::Internal);
    ApiError::new(code, e.message)
}

/// The `tpm` attestor's evidence for one attempt: the appliance's challenge for this TPM's EK
/// and bca's AK, activated in the TPM, and the AK's certification of the node key over the
/// challenge's secret bound to the CSR.
pub fn tpm_evidence(
    cfg: &AgentConfig,
    key: &NodeKey,
    csr: &[u8],
    no_enrollment: bool,
) -> ApiResult<protocol::TpmEvidence> {
    use crate::tpm::EkAlg;
    let k = key
        .tpm()
        .ok_or_else(|| ApiError::internal("a tpm join's key is not held by the TPM"))?;
    // The EK whose certificate in NV certifies it (RSA first, as most TPMs carry one), else the
    // RSA EK with no certificate. A certificate that cannot be read or certifies another key
    // is not sent.
    let (alg, cert, ek_public) = k.with_tpm(|t| -> Result<_, crate::tpm::TpmFailure> {
        for alg in [EkAlg::Rsa, EkAlg::Ecc] {
            let Ok(Some(c)) = t.nv_read(alg.cert_index()) else {
                continue;
            };
            let ek = t.ek_public_area(alg)?;
            let spki = crate::tpm::public_key_of(&ek).map(|p| p.spki).ok();
            if spki.is_some() && crate::proto::x509::cert_spki(&c).ok() == spki && c.len() <= 4096 {
                return Ok((alg, Some(c), ek));
            }
        }
        Ok((EkAlg::Rsa, None, t.ek_public_area(EkAlg::Rsa)?))
    })?;
    let (_, ak_public) = k.with_tpm(|t| t.ak_public())?;
    let ask = Request {
        v: 1,
        tpm_challenge: Some(protocol::TpmChallengeRequest {
            ek_public: crypto::b64(&ek_public),
            ek_certificate: cert.as_deref().map(crypto::b64),
            ak_public: crypto::b64(&ak_public),
        }),
        ..Default::default()
    };
    let reply = exchange(cfg, &serde_json::to_vec(&ask).expect("serializes"))?;
    if let Some(e) = reply.error {
        return Err(wire_error(e));
    }
    let ch = reply
        .tpm_challenge
        .ok_or_else(|| ApiError::internal("the gateway's answer carries no challenge"))?;
    let bad = || ApiError::internal("the appliance's challenge is malformed");
    let cred = crate::tpm::credential::Credential {
        id_object: crypto::b64_decode(&ch.credential_blob).ok_or_else(bad)?,
        encrypted_secret: crypto::b64_decode(&ch.encrypted_secret).ok_or_else(bad)?,
    };
    let secret = k.with_tpm(|t| t.activate_credential(alg, &cred))?;
    let qualifying = protocol::tpm_join_qualifying(&secret, &crypto::sha256(csr));
    let c = k.with_tpm(|t| t.certify(k.blob(), &qualifying))?;
    Ok(protocol::TpmEvidence {
        challenge_id: ch.challenge_id,
        credential: crypto::b64(&secret),
        ek_public: crypto::b64(&ek_public),
        ak_public: crypto::b64(&ak_public),
        key_public: crypto::b64(&k.blob().public),
        attest: crypto::b64(&c.attest),
        signature: crypto::b64(&c.signature),
        no_enrollment,
    })
}

/// One request and its parsed reply over TLS to the gateway.
pub fn exchange(cfg: &AgentConfig, request: &[u8]) -> ApiResult<Reply> {
    let frame = exchange_raw(cfg, request)?;
    serde_json::from_slice::<Reply>(&frame)
        .map_err(|e| ApiError::internal(format!("the gateway's answer is malformed: {e}")))
}

/// One request and the reply's bytes, exactly as the gateway sent them.
pub fn exchange_raw(cfg: &AgentConfig, request: &[u8]) -> ApiResult<Vec<u8>> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ApiError::internal)?;
    rt.block_on(async move {
        let mut s = connect(cfg, None).await?;
        roundtrip(cfg, &mut s, request).await
    })
}

pub type GatewayStream = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// The gateway could not be reached or did not answer: `UNAVAILABLE`, worth a retry.
fn unreachable(url: &str, e: impl std::fmt::Display) -> ApiError {
    ApiError::new(
        Code::Unavailable,
        format!("cannot reach the gateway {url}: {e}"),
    )
}

/// The gateway that answered last (an index into `AgentConfig::gateways`): the next connection
/// tries it first, so an agent that failed over stays where it is until that one fails too.
static LAST_GATEWAY: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A TLS connection to the gateway under the pinned serving CA, presenting `identity` (chain DER,
/// key PKCS#8) for mTLS when given.
pub async fn connect(
    cfg: &AgentConfig,
    identity: Option<(Vec<Vec<u8>>, &[u8])>,
) -> ApiResult<GatewayStream> {
    let tls = crate::agent::tlsclient::client_config_with(&cfg.serving_ca_spki_pin, identity)
        .map_err(ApiError::internal)?;
    connect_with(cfg, Arc::new(tls)).await
}

/// A connection under `tls`: one configuration kept for one identity holds the session ticket
/// the gateway gave its last full handshake, so the next connection resumes (after an appliance
/// restart too; see `tickets`).
///
/// With several gateways (`gateway_urls`), each is tried once, from the one that answered last:
/// a gateway that cannot be reached, or fails the TLS handshake under the pinned serving CA, gives
/// way to the next. The error is the last one's when none answers (the caller's backoff retries).
pub async fn connect_with(
    cfg: &AgentConfig,
    tls: Arc<rustls::ClientConfig>,
) -> ApiResult<GatewayStream> {
    let gateways = cfg.gateways();
    let first = LAST_GATEWAY.load(std::sync::atomic::Ordering::Relaxed) % gateways.len();
    let mut last = None;
    for i in (0..gateways.len()).map(|k| (first + k) % gateways.len()) {
        match connect_one(cfg, gateways[i], tls.clone()).await {
            Ok(s) => {
                LAST_GATEWAY.store(i, std::sync::atomic::Ordering::Relaxed);
                return Ok(s);
            }
            Err(e) if e.code == Code::Unavailable => {
                tracing::debug!(gateway = gateways[i], error = %e.message, "trying the next gateway");
                last = Some(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(last.unwrap_or_else(|| unreachable(&cfg.gateway_url, "no gateway")))
}

/// One gateway: TCP (10 s at most), then TLS under the pinned serving CA.
async fn connect_one(
    cfg: &AgentConfig,
    url: &str,
    tls: Arc<rustls::ClientConfig>,
) -> ApiResult<GatewayStream> {
    let (host, port) = crate::base::net::host_port(url)
        .ok_or_else(|| ApiError::invalid_config("gateway_url must be https://host[:port]"))?;
    let name = cfg.server_name.clone().unwrap_or(host.clone());
    let stream = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        tokio::net::TcpStream::connect((host.as_str(), port)),
    )
    .await
    .map_err(|_| unreachable(url, "timed out"))?
    .map_err(|e| unreachable(url, e))?;
    let _ = stream.set_nodelay(true);
    let server_name = rustls::pki_types::ServerName::try_from(name.clone())
        .map_err(|_| ApiError::invalid_config(format!("{name:?} is not a valid server name")))?;
    tokio_rustls::TlsConnector::from(tls)
        .connect(server_name, stream)
        .await
        .map_err(|e| unreachable(url, format!("TLS: {e}")))
}

/// [`connect`] presenting the node's certificate chain and its key, wherever the key lives.
pub async fn connect_as(
    cfg: &AgentConfig,
    chain: Vec<Vec<u8>>,
    key: &crate::agent::nodekey::NodeKey,
) -> ApiResult<GatewayStream> {
    connect_with(cfg, identity_tls(cfg, chain, key)?).await
}

/// The TLS configuration that presents the node's certificate chain and its key.
pub fn identity_tls(
    cfg: &AgentConfig,
    chain: Vec<Vec<u8>>,
    key: &crate::agent::nodekey::NodeKey,
) -> ApiResult<Arc<rustls::ClientConfig>> {
    crate::agent::tlsclient::client_config_signer(
        &cfg.serving_ca_spki_pin,
        Some((chain, key.tls_key().map_err(ApiError::internal)?)),
    )
    .map(Arc::new)
    .map_err(ApiError::internal)
}

/// Sends one frame and reads the answer's bytes (60 s at most).
pub async fn roundtrip(
    cfg: &AgentConfig,
    s: &mut GatewayStream,
    request: &[u8],
) -> ApiResult<Vec<u8>> {
    // The gateway this stream reached (the one that answered last).
    let gateways = cfg.gateways();
    let url = gateways[LAST_GATEWAY.load(std::sync::atomic::Ordering::Relaxed) % gateways.len()];
    protocol::write_frame(s, request)
        .await
        .map_err(|e| unreachable(url, e))?;
    tokio::time::timeout(std::time::Duration::from_secs(60), protocol::read_frame(s))
        .await
        .map_err(|_| unreachable(url, "no answer in 60 s"))?
        .map_err(|e| unreachable(url, e))
}

/// The seed's checks, in its order: the signature under the pinned key, `csr_sha256`, that the
/// leaf certifies this key, the SPIFFE SAN, and the role.
pub fn verify_response(
    cfg: &AgentConfig,
    resp: &protocol::JoinResponse,
    csr: &[u8],
    key: &SigningKey,
    role: &str,
) -> ApiResult<JoinResponseBody> {
    verify_response_for(cfg, resp, csr, &key.spki_der(), role)
}

/// [`verify_response`] for the key whose SubjectPublicKeyInfo is `key_spki`.
pub fn verify_response_for(
    cfg: &AgentConfig,
    resp: &protocol::JoinResponse,
    csr: &[u8],
    key_spki: &[u8],
    role: &str,
) -> ApiResult<JoinResponseBody> {
    let bad =
        |m: &str| ApiError::access_denied(format!("the join response failed verification: {m}"));
    let body_bytes = signed_body(cfg, resp, JOIN_RESPONSE_PURPOSE).map_err(&bad)?;
    let body: JoinResponseBody = serde_json::from_slice(&body_bytes).map_err(|_| bad("body"))?;
    if body.csr_sha256 != crypto::hex(&crypto::sha256(csr)) {
        return Err(bad("it answers another CSR"));
    }
    let leaf_pem = body
        .certificate_chain
        .first()
        .ok_or_else(|| bad("no certificate"))?;
    let leaf = crate::proto::x509::pem_decode_all(leaf_pem, "CERTIFICATE")
        .into_iter()
        .next()
        .ok_or_else(|| bad("certificate"))?;
    if crate::proto::x509::cert_spki(&leaf).map_err(|_| bad("certificate"))? != key_spki {
        return Err(bad("the certificate does not certify this machine's key"));
    }
    let want = format!(
        "spiffe://{}/site/{}/node/{}",
        body.trust_domain, body.site_id, body.node_id
    );
    // An empty site is a configuration being built from the well-known document: the signed
    // response names it.
    let site_ok = cfg.site.is_empty() || body.site_id == cfg.site;
    if !site_ok || spiffe_sans(&leaf).as_deref() != Some(want.as_str()) {
        return Err(bad("the certificate's SPIFFE ID is not this site's node"));
    }
    let role_ok = body.role == role || (role == "node" && body.role == "node-tenant");
    if !role_ok || cert_role(&leaf).as_deref() != Some(body.role.as_str()) {
        return Err(bad("the certificate has another role"));
    }
    Ok(body)
}

/// The one SPIFFE URI SAN, when the URI SANs are exactly it (first) and `urn:bc:` statements.
pub fn spiffe_sans(der: &[u8]) -> Option<String> {
    use x509_parser::prelude::*;
    let (_, c) = X509Certificate::from_der(der).ok()?;
    let uris = crate::proto::x509::uri_sans(&c)?;
    let first = *uris.first()?;
    if !first.starts_with("spiffe://") || uris[1..].iter().any(|u| !u.starts_with("urn:bc:")) {
        return None;
    }
    Some(first.to_string())
}

/// The role in the certificate's one `OU=bc-role:<role>`.
pub fn cert_role(der: &[u8]) -> Option<String> {
    use x509_parser::prelude::*;
    let (_, c) = X509Certificate::from_der(der).ok()?;
    let ous: Vec<&str> = c
        .subject()
        .iter_organizational_unit()
        .filter_map(|a| a.as_str().ok())
        .collect();
    match ous.as_slice() {
        [one] => one.strip_prefix("bc-role:").map(str::to_string),
        _ => None,
    }
}
