//! A TPM 2.0 client in the binary. The static build cannot link libtss2 (ENVIRONMENT.md), so bca
//! speaks the protocol itself: `tpm2-protocol` (pinned to one exact version in `Cargo.toml`, its
//! API changed between releases; nothing outside this module names it) marshals the commands and
//! parses the responses, and this module carries them.
//!
//! Transports, chosen by a TCTI-style string as tpm2-tools and tss-esapi take them:
//! - `device:/dev/tpmrm0` (the default): the kernel's resource manager; `device` alone means it;
//! - `swtpm:host=127.0.0.1,port=2321`: swtpm's TCP server (raw commands, no framing); `host`
//!   defaults to 127.0.0.1 and `port` to 2321.
//!
//! Every transient object this module creates is flushed before the call that made it returns,
//! whatever happened: swtpm has no resource manager and few slots. A failing command is an error
//! that names the command, the TPM's response code by its specification name and what it usually
//! means.

pub mod attest;
pub mod credential;
pub mod der;
pub mod nodekey;
pub mod templates;

pub use der::PublicKey;
use der::*;
use templates::*;
pub use templates::{parse_pcrs, EkAlg, EK_CERT_ECC, EK_CERT_RSA};

use crate::base::error::{ApiError, ApiResult, Code};
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;
use tpm2_protocol::basic::{TpmHandle, TpmUint16, TpmUint32};
use tpm2_protocol::constant::{MAX_NV_BUFFER_SIZE, TPM_MAX_COMMAND_SIZE};
use tpm2_protocol::data::TpmtTkHashcheck;
use tpm2_protocol::data::{
    Tpm2bAuth, Tpm2bData, Tpm2bDigest, Tpm2bEncryptedSecret, Tpm2bIdObject, Tpm2bNonce,
    Tpm2bPrivate, Tpm2bPublic, Tpm2bSensitiveCreate, Tpm2bSensitiveData, TpmAlgId, TpmCap, TpmPt,
    TpmRc, TpmRcBase, TpmRh, TpmSe, TpmSt, TpmaSession, TpmlPcrSelection, TpmsAuthCommand,
    TpmsSensitiveCreate, TpmtPublic, TpmuCapabilities, TpmuPublicId,
};
use tpm2_protocol::frame::{
    tpm_marshal_command, TpmActivateCredentialCommand, TpmActivateCredentialResponse,
    TpmCertifyCommand, TpmCertifyResponse, TpmCreateCommand, TpmCreatePrimaryCommand,
    TpmCreatePrimaryResponse, TpmCreateResponse, TpmFlushContextCommand, TpmFlushContextResponse,
    TpmFrame, TpmGetCapabilityCommand, TpmGetCapabilityResponse, TpmLoadCommand, TpmLoadResponse,
    TpmNvReadCommand, TpmNvReadPublicCommand, TpmNvReadPublicResponse, TpmNvReadResponse,
    TpmPcrReadCommand, TpmPcrReadResponse, TpmPolicyPcrCommand, TpmPolicyPcrResponse,
    TpmPolicySecretCommand, TpmPolicySecretResponse, TpmResponse, TpmStartAuthSessionCommand,
    TpmStartAuthSessionResponse, TpmUnmarshalBody, TpmUnsealCommand, TpmUnsealResponse,
};
use tpm2_protocol::frame::{TpmPolicyCommandCodeCommand, TpmPolicyCommandCodeResponse};
use tpm2_protocol::frame::{TpmSignCommand, TpmSignResponse};
use tpm2_protocol::{TpmUnmarshal, TpmWriter};
use zeroize::Zeroizing;

/// The secret of a `TPM2_Unseal` response whose session had `encrypt` set: the response's first
/// parameter (`TPM2B_SENSITIVE_DATA`) is AES-128-CFB under `KDFa(sessionKey || authValue, "CFB",
/// nonceTPM, nonceCaller)` (Part 1, 21.3), with the sealed object's empty auth value and the
/// nonces of this command and its response.
fn decrypt_unseal_response(
    raw: &[u8],
    session_key: &[u8],
    nonce_caller: &[u8],
) -> Result<Zeroizing<Vec<u8>>, TpmFailure> {
    let fail = |m: &str| TpmFailure::new("TPM2_Unseal", m.to_string());
    let _: TpmUnsealResponse = parse("TPM2_Unseal", raw)?;
    let short = || fail("a short response");
    let slice = |from: usize, len: usize| -> Result<&[u8], TpmFailure> {
        from.checked_add(len)
            .and_then(|end| raw.get(from..end))
            .ok_or_else(short)
    };
    let u16_at = |i: usize| -> Result<usize, TpmFailure> {
        slice(i, 2).map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    };
    if slice(0, 2)? != [0x80, 0x02] {
        return Err(fail("a response without its session's answer"));
    }
    // Header (10), parameterSize (4), the parameters (TPM2B_SENSITIVE_DATA), then the session's
    // answer: nonceTPM, attributes, HMAC.
    let params_len = slice(10, 4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)?;
    let params = slice(14, params_len)?;
    let n = u16_at(14)?;
    if n.checked_add(2) != Some(params_len) {
        return Err(fail("a response whose parameters are not one TPM2B"));
    }
    let auth = 14 + params_len;
    let nn = u16_at(auth)?;
    let nonce_tpm = slice(auth + 2, nn)?;
    let attrs = slice(auth + 2 + nn, 1)?[0];
    let hn = u16_at(auth + 3 + nn)?;
    let hmac = slice(auth + 5 + nn, hn)?;
    // The TPM's HMAC over the response (Part 1, 19.6.16): rpHash = H(rc || TPM_CC_Unseal ||
    // parameters as sent, encrypted), then nonceTPM, nonceCaller and the attributes, keyed by
    // the session key. A changed answer is refused before it is decrypted.
    let mut rp = 0u32.to_be_bytes().to_vec();
    rp.extend_from_slice(&TPM_CC_UNSEAL.to_be_bytes());
    rp.extend_from_slice(params);
    let expected = credential::hmac_sha256(
        session_key,
        &[
            &crate::base::crypto::sha256(&rp),
            nonce_tpm,
            nonce_caller,
            &[attrs],
        ],
    );
    if !crate::base::crypto::ct_eq(&expected, hmac) {
        return Err(fail(
            "the TPM's answer does not carry the session's HMAC: it was changed on its way",
        ));
    }
    let mut data = Zeroizing::new(params[2..].to_vec());
    let material = Zeroizing::new(credential::kdfa(
        session_key,
        "CFB",
        nonce_tpm,
        nonce_caller,
        256,
    ));
    credential::aes128_cfb_iv(&material[..16], &material[16..32], &mut data, false)
        .map_err(|e| fail(&e))?;
    Ok(data)
}

pub const DEFAULT_TCTI: &str = "device:/dev/tpmrm0";

/// Warnings that ask the caller to send the same command again (TPM 2.0 Part 2, 6.6.3).
const RC_YIELDED: u32 = 0x908;
const RC_TESTING: u32 = 0x90A;
const RC_RETRY: u32 = 0x922;

/// Where the TPM is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tcti {
    Device(PathBuf),
    Swtpm { host: String, port: u16 },
}

impl Default for Tcti {
    /// The kernel's resource manager, `/dev/tpmrm0`.
    fn default() -> Self {
        Tcti::Device(PathBuf::from("/dev/tpmrm0"))
    }
}

impl std::str::FromStr for Tcti {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let (kind, conf) = s.split_once(':').unwrap_or((s, ""));
        match kind {
            "device" => Ok(Tcti::Device(PathBuf::from(if conf.is_empty() {
                "/dev/tpmrm0"
            } else {
                conf
            }))),
            "swtpm" => {
                let (mut host, mut port) = ("127.0.0.1".to_string(), 2321u16);
                for kv in conf.split(',').filter(|kv| !kv.is_empty()) {
                    match kv.split_once('=') {
                        Some(("host", h)) if !h.is_empty() => host = h.to_string(),
                        Some(("port", p)) => {
                            port = p
                                .parse()
                                .ok()
                                .filter(|p| *p != 0)
                                .ok_or_else(|| format!("TCTI {s:?}: port {p:?} is not a port"))?
                        }
                        _ => return Err(format!(
                            "TCTI {s:?}: {kv:?} is not host=… or port=… (swtpm:host=127.0.0.1,port=2321)"
                        )),
                    }
                }
                Ok(Tcti::Swtpm { host, port })
            }
            _ => Err(format!(
                "TCTI {s:?}: the TPM is named device:/dev/tpmrm0 or swtpm:host=…,port=…"
            )),
        }
    }
}

impl std::fmt::Display for Tcti {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Tcti::Device(p) => write!(f, "device:{}", p.display()),
            Tcti::Swtpm { host, port } => write!(f, "swtpm:host={host},port={port}"),
        }
    }
}

enum Transport {
    Device(std::fs::File),
    Swtpm(std::net::TcpStream),
}

impl Transport {
    fn transact(&mut self, cmd: &[u8]) -> std::io::Result<Vec<u8>> {
        match self {
            // The resource manager takes one whole command per write and gives one whole
            // response per read.
            Transport::Device(f) => {
                f.write_all(cmd)?;
                let mut buf = vec![0u8; TPM_MAX_COMMAND_SIZE];
                let n = f.read(&mut buf)?;
                buf.truncate(n);
                Ok(buf)
            }
            Transport::Swtpm(s) => {
                s.write_all(cmd)?;
                let mut head = [0u8; 10];
                s.read_exact(&mut head)?;
                let size = u32::from_be_bytes([head[2], head[3], head[4], head[5]]) as usize;
                if !(10..=TPM_MAX_COMMAND_SIZE).contains(&size) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("a response of {size} bytes"),
                    ));
                }
                let mut buf = head.to_vec();
                buf.resize(size, 0);
                s.read_exact(&mut buf[10..])?;
                Ok(buf)
            }
        }
    }
}

/// A failed TPM operation: which command, the response code (if the TPM answered) and what to do.
#[derive(Debug)]
pub struct TpmFailure {
    pub command: &'static str,
    pub rc: Option<u32>,
    pub message: String,
}

impl TpmFailure {
    /// A failure bca found itself (no response code).
    fn new(command: &'static str, message: impl Into<String>) -> Self {
        Self {
            command,
            rc: None,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for TpmFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.command, self.message)
    }
}

impl From<TpmFailure> for ApiError {
    fn from(e: TpmFailure) -> Self {
        ApiError::new(Code::Unavailable, format!("TPM: {e}"))
    }
}

/// What a response code means to the person reading the error.
fn explain(rc: u32) -> String {
    let name = TpmRc::try_from(rc)
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "a vendor or resource-manager code".into());
    let hint = match TpmRc::try_from(rc).map(|r| r.base()) {
        Ok(TpmRcBase::Handle) => "no such object or index in this TPM",
        Ok(TpmRcBase::AuthFail) | Ok(TpmRcBase::BadAuth) => {
            "the authorization was refused (a hierarchy password is set?)"
        }
        Ok(TpmRcBase::PolicyFail) => "the object's policy is not met (the PCRs changed?)",
        Ok(TpmRcBase::Lockout) => "the TPM is in dictionary-attack lockout; wait or clear it",
        Ok(TpmRcBase::NvUninitialized) => "the NV index was never written",
        Ok(TpmRcBase::Integrity) => "the object was made by another TPM, or altered",
        Ok(TpmRcBase::Hierarchy) => "the hierarchy is disabled (firmware settings)",
        Ok(TpmRcBase::Initialize) => "the TPM was not started (TPM2_Startup)",
        Ok(TpmRcBase::ObjectMemory) | Ok(TpmRcBase::SessionMemory) => {
            "the TPM's object slots are full (another program leaks handles)"
        }
        Ok(TpmRcBase::Retry) | Ok(TpmRcBase::Yielded) | Ok(TpmRcBase::Testing) => {
            "the TPM is busy; retry"
        }
        _ => "",
    };
    if hint.is_empty() {
        format!("{name} (0x{rc:03x})")
    } else {
        format!("{name} (0x{rc:03x}): {hint}")
    }
}

/// A response as the TPM sent it: its code, then its parameters for command `R`.
pub(crate) fn parse<R: TpmUnmarshalBody>(name: &'static str, raw: &[u8]) -> Result<R, TpmFailure> {
    let fail = |message: String| TpmFailure::new(name, message);
    if raw.len() < 10 {
        return Err(fail(format!("a response of {} bytes", raw.len())));
    }
    let code = u32::from_be_bytes([raw[6], raw[7], raw[8], raw[9]]);
    if code != 0 {
        return Err(TpmFailure {
            rc: Some(code),
            ..fail(explain(code))
        });
    }
    let resp = TpmResponse::cast(raw).map_err(|e| fail(format!("a malformed response: {e:?}")))?;
    resp.unmarshal::<R>()
        .map_err(|e| fail(format!("a malformed response: {e:?}")))
}

/// Every response bca parses, as the fuzzer drives it (the `tpm` fuzz target).
pub(crate) fn parse_any(raw: &[u8]) {
    if let Some(b) = raw.get(6..10) {
        let _ = explain(u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
    }
    let _ = parse::<TpmGetCapabilityResponse>("", raw);
    let _ = parse::<TpmNvReadPublicResponse>("", raw);
    let _ = parse::<TpmNvReadResponse>("", raw);
    let _ = parse::<TpmFlushContextResponse>("", raw);
    let _ = parse::<TpmPcrReadResponse>("", raw);
    let _ = parse::<TpmStartAuthSessionResponse>("", raw);
    let _ = parse::<TpmPolicyPcrResponse>("", raw);
    let _ = parse::<TpmUnsealResponse>("", raw);
    let _ = parse::<TpmCreateResponse>("", raw);
    let _ = parse::<TpmLoadResponse>("", raw);
    let _ = parse::<TpmPolicySecretResponse>("", raw);
    let _ = parse::<TpmPolicyCommandCodeResponse>("", raw);
    let _ = decrypt_unseal_response(raw, &[0u8; 32], &[0u8; 32]);
    let _ = parse::<TpmActivateCredentialResponse>("", raw);
    let _ = parse::<TpmCertifyResponse>("", raw);
    let _ = attest::verify_certify(raw, raw, raw, &[], raw);
    let _ = parse_public(raw);
    if let Ok(r) = parse::<TpmCreatePrimaryResponse>("", raw) {
        let _ = PublicKey::of(&r.out_public);
    }
}

/// An open TPM.
pub struct Tpm {
    tcti: Tcti,
    t: Transport,
}

/// The empty password session (TPM_RS_PW) on a hierarchy or index with no auth value set.
fn password() -> TpmsAuthCommand {
    TpmsAuthCommand {
        session_handle: TpmHandle::new(TpmRh::Pw.value()),
        nonce: Tpm2bNonce::default(),
        session_attributes: TpmaSession::empty(),
        hmac: Tpm2bAuth::default(),
    }
}

/// A policy session's authorization: a fresh nonce, no HMAC (no `PolicyAuthValue` in bca's
/// policies), the session ending with the command.
fn policy_auth(session: u32) -> TpmsAuthCommand {
    let mut nonce = [0u8; 32];
    crate::base::crypto::fill_random(&mut nonce);
    TpmsAuthCommand {
        session_handle: TpmHandle::new(session),
        nonce: Tpm2bNonce::try_from(&nonce[..]).expect("32 bytes fit a nonce"),
        session_attributes: TpmaSession::empty(),
        hmac: Tpm2bAuth::default(),
    }
}

/// A policy session as it started: its handle, and the nonces its key derives from.
struct PolicySession {
    handle: u32,
    nonce_caller: [u8; 32],
    nonce_tpm: Vec<u8>,
}

/// A key's record as `TPM2_Load` takes it: its private part and its `TPM2B_PUBLIC`, exactly.
fn load_parts(private: &[u8], public: &[u8]) -> Result<(Tpm2bPrivate, Tpm2bPublic), TpmFailure> {
    let fail = |m: String| TpmFailure::new("TPM2_Load", m);
    let private = Tpm2bPrivate::try_from(private)
        .map_err(|e| fail(format!("the key's private part: {e:?}")))?;
    let (public, rest) = Tpm2bPublic::unmarshal(public)
        .map_err(|e| fail(format!("the key's public part: {e:?}")))?;
    if !rest.is_empty() {
        return Err(fail("the key's public part has trailing bytes".into()));
    }
    Ok((private, public))
}

/// A key held by a TPM: its private part (wrapped by the storage key) and its marshaled
/// `TPM2B_PUBLIC`, which is all a node keeps of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyBlob {
    pub private: Vec<u8>,
    pub public: Vec<u8>,
}

/// A `TPM2_Certify`: the marshaled `TPMS_ATTEST` the AK signed, and its `TPMT_SIGNATURE`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Certification {
    pub attest: Vec<u8>,
    pub signature: Vec<u8>,
}

/// A marshaled public area (`TPM2B_PUBLIC`, as tpm2-tools writes `*.pub` files and as the
/// agent sends one): the structure, with nothing after it.
pub fn parse_public(marshaled: &[u8]) -> Result<TpmtPublic, String> {
    let (p, rest) =
        Tpm2bPublic::unmarshal(marshaled).map_err(|e| format!("not a TPM2B_PUBLIC: {e:?}"))?;
    if !rest.is_empty() {
        return Err("a TPM2B_PUBLIC with trailing bytes".into());
    }
    Ok(p.inner)
}

/// The key of a marshaled public area (`TPM2B_PUBLIC`): its Name, computed here, and its
/// SubjectPublicKeyInfo.
pub fn public_key_of(marshaled: &[u8]) -> Result<PublicKey, String> {
    PublicKey::of(&parse_public(marshaled)?)
}

/// `TPM2_MakeCredential` in software for an EK given as a marshaled `TPM2B_PUBLIC`.
pub fn make_credential(
    ek_public: &[u8],
    name: &[u8],
    secret: &[u8],
) -> Result<credential::Credential, String> {
    credential::make_credential(&parse_public(ek_public)?, name, secret)
}

/// A secret sealed to one TPM: its private part (encrypted and integrity-protected by the
/// TPM's storage key) and its public area, as the TPM returned them; `pcrs`, the PCRs of the
/// SHA-256 bank whose values at sealing time it is bound to (none: not bound).
#[derive(Debug, Clone)]
pub struct SealedBlob {
    pub private: Vec<u8>,
    pub public: Vec<u8>,
    pub pcrs: Vec<u32>,
    /// Opened through a salted policy session with the secret encrypted on its way back (every
    /// blob bca seals now); `false` for blobs of the first TPM version, opened with the empty
    /// password and the secret in clear on the bus.
    pub policy: bool,
    /// The Name of the storage key it was sealed under (absent for blobs of the first TPM
    /// version): the key the unseal session's salt is encrypted to must have it.
    pub srk_name: Option<Vec<u8>>,
}

/// What the TPM says about itself.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Identity {
    pub manufacturer: String,
    pub vendor: String,
    pub firmware: String,
}

impl Tpm {
    pub fn open(tcti: &Tcti) -> Result<Self, TpmFailure> {
        let fail = |e: std::io::Error| {
            TpmFailure::new("open", format!("cannot reach the TPM at {tcti}: {e}"))
        };
        let t = match tcti {
            Tcti::Device(p) => Transport::Device(
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(p)
                    .map_err(fail)?,
            ),
            Tcti::Swtpm { host, port } => {
                let s = std::net::TcpStream::connect((host.as_str(), *port)).map_err(fail)?;
                let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
                let _ = s.set_write_timeout(Some(Duration::from_secs(30)));
                Transport::Swtpm(s)
            }
        };
        Ok(Self {
            tcti: tcti.clone(),
            t,
        })
    }

    pub fn tcti(&self) -> &Tcti {
        &self.tcti
    }

    /// Sends one command and parses its response; a response code other than success is an
    /// error naming it.
    fn run<C: TpmFrame, R: TpmUnmarshalBody>(
        &mut self,
        name: &'static str,
        cmd: &C,
        sessions: &[TpmsAuthCommand],
    ) -> Result<R, TpmFailure> {
        let raw = self.run_raw(name, cmd, sessions)?;
        parse(name, &raw)
    }

    /// Sends one command and gives the raw response (retried while the TPM asks to).
    fn run_raw<C: TpmFrame>(
        &mut self,
        name: &'static str,
        cmd: &C,
        sessions: &[TpmsAuthCommand],
    ) -> Result<Zeroizing<Vec<u8>>, TpmFailure> {
        let tag = if sessions.is_empty() {
            TpmSt::NoSessions
        } else {
            TpmSt::Sessions
        };
        // Zeroized: a secret to seal passes through these buffers.
        let mut buf = Zeroizing::new(vec![0u8; TPM_MAX_COMMAND_SIZE]);
        let mut w = TpmWriter::new(&mut buf);
        tpm_marshal_command(cmd, tag, sessions, &mut w)
            .map_err(|e| TpmFailure::new(name, format!("cannot marshal the command: {e:?}")))?;
        let cmd_bytes = Zeroizing::new(w.as_bytes().to_vec());
        // A TPM may ask for the same command again (TPM_RC_RETRY, _YIELDED, _TESTING: swtpm does
        // for a signature now and then); a few tries, a few milliseconds apart.
        let mut tries = 0;
        loop {
            // Zeroized: an unsealed secret passes through this buffer.
            let raw = self
                .t
                .transact(&cmd_bytes)
                .map(Zeroizing::new)
                .map_err(|e| {
                    TpmFailure::new(
                        name,
                        format!("the TPM at {} did not answer: {e}", self.tcti),
                    )
                })?;
            let rc = raw
                .get(6..10)
                .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
            if matches!(rc, Some(RC_RETRY | RC_YIELDED | RC_TESTING)) && tries < 20 {
                tries += 1;
                std::thread::sleep(Duration::from_millis(5 * tries));
                continue;
            }
            return Ok(raw);
        }
    }

    /// Manufacturer, vendor string and firmware version.
    pub fn identity(&mut self) -> Result<Identity, TpmFailure> {
        let first = TpmPt::Manufacturer.value();
        let cmd = TpmGetCapabilityCommand {
            handles: [],
            cap: TpmCap::TpmProperties,
            property: TpmUint32::new(first),
            property_count: TpmUint32::new(8),
        };
        let r: TpmGetCapabilityResponse = self.run("TPM2_GetCapability", &cmd, &[])?;
        let mut props = std::collections::HashMap::new();
        if let TpmuCapabilities::TpmProperties(l) = &r.capability_data.data {
            for p in l.iter() {
                props.insert(p.property.value(), p.value.value());
            }
        }
        let text = |ids: &[u32]| -> String {
            ids.iter()
                .filter_map(|i| props.get(i))
                .flat_map(|v| v.to_be_bytes())
                .filter(|b| *b != 0)
                .map(|b| {
                    if b.is_ascii_graphic() || b == b' ' {
                        b as char
                    } else {
                        '?'
                    }
                })
                .collect::<String>()
                .trim()
                .to_string()
        };
        let fw1 = props
            .get(&TpmPt::FirmwareVersion1.value())
            .copied()
            .unwrap_or(0);
        let fw2 = props
            .get(&(TpmPt::FirmwareVersion1.value() + 1))
            .copied()
            .unwrap_or(0);
        Ok(Identity {
            manufacturer: text(&[first]),
            vendor: text(&[first + 1, first + 2, first + 3, first + 4]),
            // As tpm2_getcap prints the two properties: hexadecimal.
            firmware: format!("{fw1:08x}.{fw2:08x}"),
        })
    }

    /// Creates a primary key in `hierarchy` from `template`, runs `f` with it, and flushes it
    /// whatever `f` returned.
    fn with_primary<T>(
        &mut self,
        hierarchy: TpmRh,
        template: Result<TpmtPublic, tpm2_protocol::TpmError>,
        f: impl FnOnce(&mut Self, &TpmCreatePrimaryResponse) -> Result<T, TpmFailure>,
    ) -> Result<T, TpmFailure> {
        let template = template.map_err(|e| {
            TpmFailure::new("TPM2_CreatePrimary", format!("the key's template: {e:?}"))
        })?;
        let cmd = TpmCreatePrimaryCommand {
            handles: [TpmHandle::new(hierarchy.value())],
            in_sensitive: Tpm2bSensitiveCreate::default(),
            in_public: Tpm2bPublic::from(template),
            outside_info: Tpm2bData::default(),
            creation_pcr: TpmlPcrSelection::default(),
        };
        let r: TpmCreatePrimaryResponse = self.run("TPM2_CreatePrimary", &cmd, &[password()])?;
        let out = f(self, &r);
        self.flushed(r.handles[0].value(), out)
    }

    /// Flushes `handle`, then gives `out`: its error first, else the flush's.
    fn flushed<T>(&mut self, handle: u32, out: Result<T, TpmFailure>) -> Result<T, TpmFailure> {
        let flushed = self.flush(handle);
        let out = out?;
        flushed?;
        Ok(out)
    }

    /// Creates the EK of the low range under the endorsement hierarchy, reads what it needs and
    /// flushes it.
    pub fn ek_public(&mut self, alg: EkAlg) -> Result<PublicKey, TpmFailure> {
        self.with_primary(TpmRh::Endorsement, ek_template(alg), |_, r| {
            let k = PublicKey::of(&r.out_public)
                .map_err(|m| TpmFailure::new("TPM2_CreatePrimary", m))?;
            // The name the TPM reports must be the one computed from the public area it returned.
            if k.name[..] != r.name[..] {
                return Err(TpmFailure::new(
                    "TPM2_CreatePrimary",
                    "the TPM reported a name that is not its key's",
                ));
            }
            Ok(k)
        })
    }

    /// Makes a node key in the TPM ([`node_key_template`]) under the storage key.
    pub fn create_node_key(&mut self) -> Result<KeyBlob, TpmFailure> {
        let r: TpmCreateResponse = self.with_srk(|tpm, srk| {
            let cmd = TpmCreateCommand {
                handles: [TpmHandle::new(srk)],
                in_sensitive: Tpm2bSensitiveCreate::default(),
                in_public: Tpm2bPublic::from(node_key_template()),
                outside_info: Tpm2bData::default(),
                creation_pcr: TpmlPcrSelection::default(),
            };
            tpm.run("TPM2_Create", &cmd, &[password()])
        })?;
        Ok(KeyBlob {
            private: r.out_private.to_vec(),
            public: marshal_public(&r.out_public.inner)
                .map_err(|m| TpmFailure::new("TPM2_Create", m))?,
        })
    }

    /// `TPM2_Certify` of `key` by bca's AK, with `qualifying` (at most 64 bytes) as the
    /// attestation's `extraData`; every handle flushed after.
    pub fn certify(
        &mut self,
        key: &KeyBlob,
        qualifying: &[u8],
    ) -> Result<Certification, TpmFailure> {
        let fail = |m: String| TpmFailure::new("TPM2_Certify", m);
        let qualifying = Tpm2bData::try_from(qualifying)
            .map_err(|e| fail(format!("the qualifying data: {e:?}")))?;
        self.with_key(key, |tpm, object| {
            tpm.with_primary(TpmRh::Endorsement, ak_template(), |tpm, ak| {
                let cmd = TpmCertifyCommand {
                    handles: [TpmHandle::new(object), ak.handles[0]],
                    qualifying_data: qualifying,
                    in_scheme: ecdsa_sha256(),
                };
                let r: TpmCertifyResponse =
                    tpm.run("TPM2_Certify", &cmd, &[password(), password()])?;
                Ok(Certification {
                    attest: marshal(&r.certify_info.inner, "the attestation").map_err(fail)?,
                    signature: marshal(&r.signature, "the signature").map_err(fail)?,
                })
            })
        })
    }

    /// Loads `key` under the storage key, runs `f` with its handle, and flushes it.
    fn with_key<T>(
        &mut self,
        key: &KeyBlob,
        f: impl FnOnce(&mut Self, u32) -> Result<T, TpmFailure>,
    ) -> Result<T, TpmFailure> {
        let (private, public) = load_parts(&key.private, &key.public)?;
        self.with_srk(|tpm, srk| {
            let object = tpm.load(srk, private, public)?;
            let out = f(tpm, object);
            tpm.flushed(object, out)
        })
    }

    /// `TPM2_Load` of an object under `parent` (with its empty auth): the object's handle, which
    /// the caller flushes.
    fn load(
        &mut self,
        parent: u32,
        in_private: Tpm2bPrivate,
        in_public: Tpm2bPublic,
    ) -> Result<u32, TpmFailure> {
        let cmd = TpmLoadCommand {
            handles: [TpmHandle::new(parent)],
            in_private,
            in_public,
        };
        let r: TpmLoadResponse = self.run("TPM2_Load", &cmd, &[password()])?;
        Ok(r.handles[0].value())
    }

    /// `TPM2_Sign` of a SHA-256 `digest` with `key` (ECDSA): the signature as DER.
    pub fn sign(&mut self, key: &KeyBlob, digest: &[u8; 32]) -> Result<Vec<u8>, TpmFailure> {
        self.with_key(key, |tpm, object| {
            let cmd = TpmSignCommand {
                handles: [TpmHandle::new(object)],
                digest: Tpm2bDigest::try_from(&digest[..]).expect("32 bytes fit a digest"),
                in_scheme: ecdsa_sha256(),
                // An unrestricted key needs no proof that the TPM hashed the message itself.
                validation: TpmtTkHashcheck {
                    tag: TpmSt::HashCheck,
                    hierarchy: TpmRh::Null,
                    digest: Tpm2bDigest::default(),
                },
            };
            let r: TpmSignResponse = tpm.run("TPM2_Sign", &cmd, &[password()])?;
            marshal(&r.signature, "the signature")
                .and_then(|sig| attest::ecdsa_der(&sig))
                .map_err(|m| TpmFailure::new("TPM2_Sign", m))
        })
    }

    /// The EK's public area, marshaled (`TPM2B_PUBLIC`).
    pub fn ek_public_area(&mut self, alg: EkAlg) -> Result<Vec<u8>, TpmFailure> {
        self.with_primary(TpmRh::Endorsement, ek_template(alg), |_, r| {
            marshal_public(&r.out_public).map_err(|m| TpmFailure::new("TPM2_CreatePrimary", m))
        })
    }

    /// bca's AK ([`ak_template`]): its Name (computed from the public area, checked against the
    /// TPM's) and its marshaled public area.
    pub fn ak_public(&mut self) -> Result<(PublicKey, Vec<u8>), TpmFailure> {
        self.with_primary(TpmRh::Endorsement, ak_template(), |_, r| {
            let fail = |m: String| TpmFailure::new("TPM2_CreatePrimary", m);
            let k = PublicKey::of(&r.out_public).map_err(fail)?;
            if k.name[..] != r.name[..] {
                return Err(fail("the TPM reported a name that is not its key's".into()));
            }
            Ok((k, marshal_public(&r.out_public).map_err(fail)?))
        })
    }

    /// `TPM2_ActivateCredential`: the secret of a credential made for this TPM's EK (of `alg`)
    /// and bca's AK, which are both created for the command and flushed after it. The EK is used
    /// through a policy session satisfying its policy (`PolicySecret` of the endorsement
    /// hierarchy), the AK with its empty password. A credential made for another EK or another
    /// Name fails (`TPM_RC_INTEGRITY`, or a bad seed).
    pub fn activate_credential(
        &mut self,
        alg: EkAlg,
        cred: &credential::Credential,
    ) -> Result<Zeroizing<Vec<u8>>, TpmFailure> {
        let fail = |m: String| TpmFailure::new("TPM2_ActivateCredential", m);
        let blob = Tpm2bIdObject::try_from(&cred.id_object[..])
            .map_err(|e| fail(format!("the credential: {e:?}")))?;
        let secret = Tpm2bEncryptedSecret::try_from(&cred.encrypted_secret[..])
            .map_err(|e| fail(format!("the credential's secret: {e:?}")))?;
        self.with_primary(TpmRh::Endorsement, ak_template(), |tpm, ak| {
            let ak = ak.handles[0].value();
            tpm.with_primary(TpmRh::Endorsement, ek_template(alg), |tpm, ek| {
                let ek = ek.handles[0].value();
                tpm.with_policy_session(None, |tpm, session| {
                    let session = session.handle;
                    let policy = TpmPolicySecretCommand {
                        handles: [
                            TpmHandle::new(TpmRh::Endorsement.value()),
                            TpmHandle::new(session),
                        ],
                        nonce_tpm: Tpm2bNonce::default(),
                        cp_hash_a: Tpm2bDigest::default(),
                        policy_ref: Tpm2bNonce::default(),
                        expiration: tpm2_protocol::basic::TpmInt32::new(0),
                    };
                    let _: TpmPolicySecretResponse =
                        tpm.run("TPM2_PolicySecret", &policy, &[password()])?;
                    let cmd = TpmActivateCredentialCommand {
                        handles: [TpmHandle::new(ak), TpmHandle::new(ek)],
                        credential_blob: blob,
                        secret,
                    };
                    let r: TpmActivateCredentialResponse = tpm.run(
                        "TPM2_ActivateCredential",
                        &cmd,
                        &[password(), policy_auth(session)],
                    )?;
                    Ok(Zeroizing::new(r.cert_info.to_vec()))
                })
            })
        })
    }

    /// Runs `f` with a new policy session (unbound, SHA-256): unsalted, or salted to
    /// `salt = (the TPM key's handle, the salt encrypted to it)`, and then with AES-128-CFB for
    /// parameter encryption. The session ends with `f`'s last command when that succeeds, and is
    /// flushed when anything failed.
    fn with_policy_session<T>(
        &mut self,
        salt: Option<(u32, &[u8])>,
        f: impl FnOnce(&mut Self, &PolicySession) -> Result<T, TpmFailure>,
    ) -> Result<T, TpmFailure> {
        let mut nonce_caller = [0u8; 32];
        crate::base::crypto::fill_random(&mut nonce_caller);
        let null = TpmHandle::new(TpmRh::Null.value());
        let start = TpmStartAuthSessionCommand {
            handles: [salt.map_or(null, |(key, _)| TpmHandle::new(key)), null],
            nonce_caller: Tpm2bNonce::try_from(&nonce_caller[..]).expect("32 bytes fit a nonce"),
            encrypted_salt: match salt {
                Some((_, encrypted)) => Tpm2bEncryptedSecret::try_from(encrypted).map_err(|e| {
                    TpmFailure::new(
                        "TPM2_StartAuthSession",
                        format!("the encrypted salt: {e:?}"),
                    )
                })?,
                None => Tpm2bEncryptedSecret::default(),
            },
            session_type: TpmSe::Policy,
            symmetric: if salt.is_some() {
                aes128_cfb()
            } else {
                no_symmetric()
            },
            auth_hash: TpmAlgId::Sha256,
        };
        let r: TpmStartAuthSessionResponse = self.run("TPM2_StartAuthSession", &start, &[])?;
        let session = PolicySession {
            handle: r.handles[0].value(),
            nonce_caller,
            nonce_tpm: r.nonce_tpm.to_vec(),
        };
        match f(self, &session) {
            Ok(v) => Ok(v),
            Err(e) => {
                let _ = self.flush(session.handle);
                Err(e)
            }
        }
    }

    /// Runs `f` with the storage primary key loaded, and flushes it whatever `f` returned.
    fn with_srk<T>(
        &mut self,
        f: impl FnOnce(&mut Self, u32) -> Result<T, TpmFailure>,
    ) -> Result<T, TpmFailure> {
        self.with_primary(TpmRh::Owner, srk_template(), |tpm, r| {
            f(tpm, r.handles[0].value())
        })
    }

    /// The values of `pcrs` in the SHA-256 bank, in index order.
    pub fn pcr_values(&mut self, pcrs: &[u32]) -> Result<Vec<Vec<u8>>, TpmFailure> {
        let (selection, _) =
            pcr_selection(pcrs).map_err(|e| TpmFailure::new("TPM2_PCR_Read", e))?;
        let cmd = TpmPcrReadCommand {
            handles: [],
            pcr_selection_in: selection,
        };
        let r: TpmPcrReadResponse = self.run("TPM2_PCR_Read", &cmd, &[])?;
        let values: Vec<Vec<u8>> = r.pcr_values.iter().map(|d| d.to_vec()).collect();
        if r.pcr_selection_out != selection || values.len() != pcrs.len() {
            return Err(TpmFailure::new(
                "TPM2_PCR_Read",
                format!(
                    "the TPM has no SHA-256 bank with PCRs {pcrs:?} (it answered {} of them)",
                    values.len()
                ),
            ));
        }
        Ok(values)
    }

    /// Seals `secret` (at most 128 bytes) to this TPM; with `pcrs`, also to those PCRs' values
    /// now (SHA-256 bank).
    pub fn seal(&mut self, secret: &[u8], pcrs: &[u32]) -> Result<SealedBlob, TpmFailure> {
        let fail = |m: String| TpmFailure::new("TPM2_Create", m);
        let data = Tpm2bSensitiveData::try_from(secret)
            .map_err(|e| fail(format!("a secret of {} bytes: {e:?}", secret.len())))?;
        let mut policy = [0u8; 32];
        if !pcrs.is_empty() {
            let (_, selection) = pcr_selection(pcrs).map_err(fail)?;
            policy = pcr_policy(&selection, &self.pcr_values(pcrs)?);
        }
        let policy = Some(command_code_policy(&policy, TPM_CC_UNSEAL));
        let cmd_of = |srk: u32| TpmCreateCommand {
            handles: [TpmHandle::new(srk)],
            in_sensitive: Tpm2bSensitiveCreate {
                inner: TpmsSensitiveCreate {
                    user_auth: Tpm2bAuth::default(),
                    data,
                },
            },
            in_public: Tpm2bPublic::from(sealed_template(policy)),
            outside_info: Tpm2bData::default(),
            creation_pcr: TpmlPcrSelection::default(),
        };
        let (r, srk_name) = self.with_primary(TpmRh::Owner, srk_template(), |tpm, srk| {
            // The storage key's Name, pinned: unsealing checks the TPM presents the same key
            // (the session's salt is encrypted to it).
            let name = PublicKey::of(&srk.out_public).map_err(&fail)?.name;
            let cmd = cmd_of(srk.handles[0].value());
            let r: TpmCreateResponse = tpm.run("TPM2_Create", &cmd, &[password()])?;
            Ok((r, name))
        })?;
        Ok(SealedBlob {
            private: r.out_private.to_vec(),
            public: marshal(&r.out_public, "the sealed object's public area").map_err(fail)?,
            pcrs: pcrs.to_vec(),
            policy: true,
            srk_name: Some(srk_name),
        })
    }

    /// Loads a sealed blob under this TPM's storage key and reads its secret back. On another
    /// TPM (or after the owner hierarchy was cleared) the load fails: the blob's integrity is
    /// keyed to the storage key's seed.
    pub fn unseal(&mut self, blob: &SealedBlob) -> Result<Zeroizing<Vec<u8>>, TpmFailure> {
        let fail = |m: String| TpmFailure::new("TPM2_Load", m);
        let (private, public) = load_parts(&blob.private, &blob.public)?;
        // The object's Name, from the record (the cpHash of the command HMAC names it).
        let name = name_of(blob.public.get(2..).unwrap_or_default());
        self.with_primary(TpmRh::Owner, srk_template(), |tpm, srk| {
            if let Some(pinned) = &blob.srk_name {
                let presented = PublicKey::of(&srk.out_public).map_err(&fail)?.name;
                if presented != *pinned {
                    return Err(fail(
                        "the storage key this TPM presents is not the one the keys were sealed \
                         under: another TPM, a cleared one, or something between bca and the TPM"
                            .into(),
                    ));
                }
            }
            let srk_point = match &srk.out_public.unique {
                TpmuPublicId::Ecc(p) => (left_pad(&p.x, 32), left_pad(&p.y, 32)),
                _ => return Err(fail("the storage key is not an ECC key".into())),
            };
            let srk = srk.handles[0].value();
            let item = tpm.load(srk, private, public)?;
            let cmd = TpmUnsealCommand {
                handles: [TpmHandle::new(item)],
            };
            // PCR-bound blobs of before PolicyCommandCode carry PolicyPCR alone.
            let out = if blob.policy || !blob.pcrs.is_empty() {
                match srk_point {
                    (Ok(x), Ok(y)) => {
                        tpm.unseal_encrypted(&cmd, &name, &blob.pcrs, blob.policy, srk, (&x, &y))
                    }
                    _ => Err(fail("the storage key's point".into())),
                }
            } else {
                tpm.run::<_, TpmUnsealResponse>("TPM2_Unseal", &cmd, &[password()])
                    .map(|r| Zeroizing::new(r.out_data.to_vec()))
            };
            tpm.flushed(item, out)
        })
    }

    /// Unseals through a policy session salted to the storage key (the salt travels encrypted
    /// to it by ECDH, so only this TPM and bca know the session key), whose policy asserts the
    /// PCRs (when any) and the command (`TPM2_PolicyCommandCode(TPM2_Unseal)`); the TPM encrypts
    /// the secret in the response with the session key (AES-128-CFB), so it never crosses the
    /// bus in clear. A PCR that moved is `TPM_RC_POLICY_FAIL`.
    #[allow(clippy::too_many_arguments)]
    fn unseal_encrypted(
        &mut self,
        cmd: &TpmUnsealCommand,
        name: &[u8],
        pcrs: &[u32],
        command_code: bool,
        srk: u32,
        srk_point: (&[u8], &[u8]),
    ) -> Result<Zeroizing<Vec<u8>>, TpmFailure> {
        let (salt, encrypted_salt) = credential::ecdh_seed("SECRET", srk_point.0, srk_point.1)
            .map_err(|m| TpmFailure::new("TPM2_StartAuthSession", m))?;
        self.with_policy_session(Some((srk, &encrypted_salt)), |tpm, s| {
            let session = s.handle;
            // The session key (Part 1, 19.6.8): KDFa(salt, "ATH", nonceTPM, nonceCaller); the
            // bind entity is TPM_RH_NULL, whose auth value is empty.
            let session_key = Zeroizing::new(credential::kdfa(
                &salt,
                "ATH",
                &s.nonce_tpm,
                &s.nonce_caller,
                256,
            ));
            if !pcrs.is_empty() {
                let (selection, _) =
                    pcr_selection(pcrs).map_err(|e| TpmFailure::new("TPM2_PolicyPCR", e))?;
                let policy = TpmPolicyPcrCommand {
                    handles: [TpmHandle::new(session)],
                    pcr_digest: Tpm2bDigest::default(),
                    pcrs: selection,
                };
                let _: TpmPolicyPcrResponse = tpm.run("TPM2_PolicyPCR", &policy, &[])?;
            }
            if command_code {
                let code = TpmPolicyCommandCodeCommand {
                    handles: [TpmHandle::new(session)],
                    code: tpm2_protocol::data::TpmCc::Unseal,
                };
                let _: TpmPolicyCommandCodeResponse =
                    tpm.run("TPM2_PolicyCommandCode", &code, &[])?;
            }
            let mut nonce = [0u8; 32];
            crate::base::crypto::fill_random(&mut nonce);
            // A salted session's command carries an HMAC (Part 1, 19.6.13): keyed by the
            // session key (no PolicyAuthValue: no auth value appended), over
            // cpHash = H(TPM_CC_Unseal || the object's Name), nonceCaller, the session's last
            // nonceTPM (StartAuthSession's: the policy commands did not use it as an
            // authorization) and the attributes.
            let mut cp = TPM_CC_UNSEAL.to_be_bytes().to_vec();
            cp.extend_from_slice(name);
            let attrs = TpmaSession::ENCRYPT;
            let hmac = credential::hmac_sha256(
                &session_key,
                &[
                    &crate::base::crypto::sha256(&cp),
                    &nonce,
                    &s.nonce_tpm,
                    &[0x40],
                ],
            );
            let auth = TpmsAuthCommand {
                session_handle: TpmHandle::new(session),
                nonce: Tpm2bNonce::try_from(&nonce[..]).expect("32 bytes fit a nonce"),
                session_attributes: attrs,
                hmac: Tpm2bAuth::try_from(&hmac[..]).expect("32 bytes fit an HMAC"),
            };
            // A session without continueSession ends with its command's success.
            let raw = tpm.run_raw("TPM2_Unseal", cmd, &[auth])?;
            decrypt_unseal_response(&raw, &session_key, &nonce)
        })
    }

    pub fn flush(&mut self, handle: u32) -> Result<(), TpmFailure> {
        let cmd = TpmFlushContextCommand {
            handles: [],
            flush_handle: TpmHandle::new(handle),
        };
        let _: TpmFlushContextResponse = self.run("TPM2_FlushContext", &cmd, &[])?;
        Ok(())
    }

    /// The bytes of an NV index, or `None` when the index is not defined.
    pub fn nv_read(&mut self, index: u32) -> Result<Option<Vec<u8>>, TpmFailure> {
        let cmd = TpmNvReadPublicCommand {
            handles: [TpmHandle::new(index)],
        };
        let size = match self.run::<_, TpmNvReadPublicResponse>("TPM2_NV_ReadPublic", &cmd, &[]) {
            Ok(r) => r.nv_public.data_size.value() as usize,
            // TPM_RC_HANDLE on the first handle: no such index.
            Err(e) if e.rc == Some(0x18b) => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut data = Vec::with_capacity(size);
        while data.len() < size {
            let chunk = (size - data.len()).min(MAX_NV_BUFFER_SIZE).min(768);
            let cmd = TpmNvReadCommand {
                handles: [TpmHandle::new(index), TpmHandle::new(index)],
                size: TpmUint16::new(chunk as u16),
                offset: TpmUint16::new(data.len() as u16),
            };
            let r: TpmNvReadResponse = self.run("TPM2_NV_Read", &cmd, &[password()])?;
            if r.data.is_empty() {
                break;
            }
            data.extend_from_slice(&r.data);
        }
        Ok(Some(data))
    }
}

/// `bca tpm status`: which TPM, its EKs (their names and key hashes), whether their
/// certificates are present and certify those keys.
pub fn status(tcti: &Tcti) -> ApiResult<serde_json::Value> {
    let mut tpm = Tpm::open(tcti)?;
    let identity = tpm.identity()?;
    let mut eks = serde_json::Map::new();
    for alg in [EkAlg::Rsa, EkAlg::Ecc] {
        let key = tpm.ek_public(alg)?;
        let cert = tpm.nv_read(alg.cert_index())?;
        let cert_json = match &cert {
            None => serde_json::Value::Null,
            Some(der) => {
                let spki = x509_parser::parse_x509_certificate(der)
                    .ok()
                    .map(|(_, c)| c.tbs_certificate.subject_pki.raw.to_vec());
                serde_json::json!({
                    "nvIndex": format!("0x{:08x}", alg.cert_index()),
                    "sha256": hex(&crate::base::crypto::sha256(der)),
                    "bytes": der.len(),
                    "parses": spki.is_some(),
                    "certifiesThisEk": spki.as_deref() == Some(&key.spki[..]),
                })
            }
        };
        eks.insert(
            alg.as_str().into(),
            serde_json::json!({
                "name": hex(&key.name),
                "publicKeySha256": hex(&crate::base::crypto::sha256(&key.spki)),
                "certificate": cert_json,
            }),
        );
    }
    let (ak, _) = tpm.ak_public()?;
    Ok(serde_json::json!({
        "tcti": tcti.to_string(),
        "manufacturer": identity.manufacturer,
        "vendor": identity.vendor,
        "firmware": identity.firmware,
        "ek": eks,
        "ak": {"name": hex(&ak.name)},
    }))
}

use crate::base::crypto::hex;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcti_strings_parse_or_say_what_is_wrong() {
        assert_eq!(
            "device:/dev/tpmrm0".parse::<Tcti>().unwrap(),
            Tcti::Device("/dev/tpmrm0".into())
        );
        assert_eq!("device".parse::<Tcti>().unwrap().to_string(), DEFAULT_TCTI);
        assert_eq!(
            "swtpm:host=10.0.0.1,port=2400".parse::<Tcti>().unwrap(),
            Tcti::Swtpm {
                host: "10.0.0.1".into(),
                port: 2400
            }
        );
        assert_eq!(
            "swtpm:".parse::<Tcti>().unwrap().to_string(),
            "swtpm:host=127.0.0.1,port=2321"
        );
        for (bad, says) in [
            ("mssim:port=2321", "device:/dev/tpmrm0 or swtpm"),
            ("swtpm:port=0", "is not a port"),
            ("swtpm:port=70000", "is not a port"),
            ("swtpm:host=", "host=… or port=…"),
            ("swtpm:bogus", "host=… or port=…"),
        ] {
            let e = bad.parse::<Tcti>().unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    /// An Unseal response as a TPM makes it for a session with `encrypt` set.
    fn encrypted_unseal_response(key: &[u8], nonce_caller: &[u8], secret: &[u8]) -> Vec<u8> {
        let nonce_tpm = [3u8; 32];
        let material = credential::kdfa(key, "CFB", &nonce_tpm, nonce_caller, 256);
        let mut enc = secret.to_vec();
        credential::aes128_cfb_iv(&material[..16], &material[16..], &mut enc, true).unwrap();
        let mut params = (enc.len() as u16).to_be_bytes().to_vec();
        params.extend(enc);
        let mut rp = 0u32.to_be_bytes().to_vec();
        rp.extend(TPM_CC_UNSEAL.to_be_bytes());
        rp.extend(&params);
        let hmac = {
            use aws_lc_rs::hmac;
            let mut ctx = hmac::Context::with_key(&hmac::Key::new(hmac::HMAC_SHA256, key));
            ctx.update(&crate::base::crypto::sha256(&rp));
            ctx.update(&nonce_tpm);
            ctx.update(nonce_caller);
            ctx.update(&[0x40]);
            ctx.sign().as_ref().to_vec()
        };
        let mut body = (params.len() as u32).to_be_bytes().to_vec();
        body.extend(&params);
        body.extend(32u16.to_be_bytes());
        body.extend(nonce_tpm);
        body.push(0x40);
        body.extend(32u16.to_be_bytes());
        body.extend(hmac);
        let mut raw = vec![0x80, 0x02];
        raw.extend(((10 + body.len()) as u32).to_be_bytes());
        raw.extend(0u32.to_be_bytes());
        raw.extend(body);
        raw
    }

    #[test]
    fn an_encrypted_unseal_answer_opens_only_whole_and_with_its_session() {
        let (key, nonce) = ([9u8; 32], [5u8; 32]);
        let raw = encrypted_unseal_response(&key, &nonce, b"the key-encryption key");
        assert_eq!(
            &decrypt_unseal_response(&raw, &key, &nonce).unwrap()[..],
            b"the key-encryption key"
        );
        // A bit flipped on the way (in the ciphertext, the nonce or the HMAC), another session,
        // or a cut answer: refused, never garbage.
        for i in [16, 30, raw.len() - 40, raw.len() - 1] {
            let mut bad = raw.clone();
            bad[i] ^= 1;
            let e = decrypt_unseal_response(&bad, &key, &nonce).unwrap_err();
            assert!(e.to_string().contains("TPM2_Unseal"), "{i}: {e}");
        }
        assert!(decrypt_unseal_response(&raw, &[8u8; 32], &nonce).is_err());
        for cut in [0, 12, 20, raw.len() - 1] {
            assert!(
                decrypt_unseal_response(&raw[..cut], &key, &nonce).is_err(),
                "{cut}"
            );
        }
    }

    #[test]
    fn pcr_lists_parse_or_say_what_is_wrong() {
        assert_eq!(parse_pcrs("7"), Ok(vec![7]));
        assert_eq!(parse_pcrs("7, 0,2,7"), Ok(vec![0, 2, 7]));
        assert_eq!(parse_pcrs("none"), Ok(vec![]));
        for (bad, says) in [
            ("24", "does not exist"),
            ("x", "not a PCR number"),
            ("", "not a PCR number"),
            ("1,2,3,4,5,6,7,8,9", "at most 8"),
            ("-1", "not a PCR number"),
        ] {
            let e = parse_pcrs(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
        // The selection as the TPM marshals it: one bank, SHA-256, three bytes of bitmap.
        let (_, sel) = pcr_selection(&[0, 7, 16]).unwrap();
        assert_eq!(sel, [0, 0, 0, 1, 0x00, 0x0b, 3, 0x81, 0x00, 0x01]);
    }

    #[test]
    fn response_codes_read_as_their_names() {
        assert!(explain(0x18b).contains("TPM_RC_HANDLE"));
        assert!(explain(0x18b).contains("no such object"));
        assert!(explain(0x98e).contains("TPM_RC_AUTH_FAIL"));
        assert!(explain(0x14a).contains("never written"));
        assert!(explain(0x0000_0901).contains("0x901"));
    }

    #[test]
    fn an_rsa_key_is_a_subject_public_key_info_openssl_would_read() {
        let n = [0xc5u8; 256];
        let spki = rsa_spki(&n, 65_537);
        let (_, parsed) = <x509_parser::x509::SubjectPublicKeyInfo as x509_parser::prelude::FromDer<_>>::from_der(&spki).unwrap();
        assert_eq!(
            parsed.algorithm.algorithm.to_id_string(),
            "1.2.840.113549.1.1.1"
        );
        match parsed.parsed().unwrap() {
            x509_parser::public_key::PublicKey::RSA(k) => {
                assert_eq!(k.modulus.len(), 257); // a leading zero: the top bit is set
                assert_eq!(k.exponent, &[1, 0, 1]);
            }
            other => panic!("{other:?}"),
        }
    }
}
