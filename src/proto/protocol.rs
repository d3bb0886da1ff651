//! The gateway's wire protocol (see `docs/protocol.md`): TLS 1.3 with ALPN `bca/1`, frames of a
//! 4-byte big-endian length and that many bytes of JSON, one request and one answer per
//! connection for a join. Also the message interface between the gateway and the JoinService.

use crate::proto::claims::Claims;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const ALPN: &[u8] = b"bca/1";
/// The largest frame either side reads or writes.
pub const MAX_FRAME: usize = 64 * 1024;
/// The one message every refused join gets, byte for byte.
pub const JOIN_REFUSED: &str = "Join refused";
pub const CONFLICT: &str = "This machine joined concurrently; retry";

#[derive(Debug)]
pub enum FrameError {
    Io(std::io::Error),
    TooLarge(usize),
    Empty,
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Io(e) => write!(f, "{e}"),
            FrameError::TooLarge(n) => write!(f, "frame of {n} bytes exceeds {MAX_FRAME}"),
            FrameError::Empty => write!(f, "empty frame"),
        }
    }
}

pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len).await.map_err(FrameError::Io)?;
    let n = u32::from_be_bytes(len) as usize;
    if n == 0 {
        return Err(FrameError::Empty);
    }
    if n > MAX_FRAME {
        return Err(FrameError::TooLarge(n));
    }
    let mut buf = vec![0u8; n];
    r.read_exact(&mut buf).await.map_err(FrameError::Io)?;
    Ok(buf)
}

pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, body: &[u8]) -> Result<(), FrameError> {
    if body.is_empty() || body.len() > MAX_FRAME {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    w.write_all(&out).await.map_err(FrameError::Io)?;
    w.flush().await.map_err(FrameError::Io)
}

/// What an agent sends: the protocol version and exactly one operation.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Request {
    pub v: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join: Option<JoinRequest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew: Option<RenewRequest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hello: Option<Hello>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat: Option<Empty>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ping: Option<Empty>,
    /// The first round of a `tpm` join: the appliance's credential-activation challenge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm_challenge: Option<TpmChallengeRequest>,
    /// The first round of an `x509pop` re-join: a single-use challenge from the JoinService.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x509pop_challenge: Option<Empty>,
}

impl Request {
    /// How many operations the request names (exactly one is valid).
    pub fn operations(&self) -> usize {
        self.join.is_some() as usize
            + self.renew.is_some() as usize
            + self.hello.is_some() as usize
            + self.heartbeat.is_some() as usize
            + self.ping.is_some() as usize
            + self.tpm_challenge.is_some() as usize
            + self.x509pop_challenge.is_some() as usize
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Empty {}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinRequest {
    /// The compact JWE of the bearer token (empty for the `tpm` attestor, which has none).
    #[serde(default)]
    pub sealed_token: String,
    /// The PKCS#10 request, base64 DER.
    pub csr: String,
    #[serde(default)]
    pub claims: Claims,
    /// Empty means `join-token`.
    #[serde(default)]
    pub attestor: String,
    pub role: String,
    /// The `tpm` attestor's evidence (the second round of a `tpm` join).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<TpmEvidence>,
    /// The `x509pop` attestor's evidence (the second round of an `x509pop` re-join).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x509pop: Option<X509PopEvidence>,
    /// The node a `provisioned` token is for (the agent's `--node-id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
}

/// The JoinService's `x509pop` challenge: 32 random bytes, answered once within its life.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct X509PopChallenge {
    pub challenge_id: String,
    /// The 32 bytes, base64.
    pub challenge: String,
    pub expires_in_seconds: u32,
}

/// A machine coming back after its certificate expired: the certificate it last held, and the
/// signature of that certificate's key (purpose [`X509POP_PURPOSE`]) over [`x509pop_message`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct X509PopEvidence {
    pub challenge_id: String,
    /// The challenge's 32 bytes as the JoinService sent them, base64.
    pub challenge: String,
    /// The expired leaf, base64 DER.
    pub certificate: String,
    /// Base64 DER ECDSA signature.
    pub signature: String,
    /// Required when the certificate names a TPM AK (`urn:bc:tpm-ak:`), as at renewal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_attestation: Option<KeyAttestation>,
}

pub const X509POP_PURPOSE: &str = "bca x509pop v1";

/// What an `x509pop` signature signs: the challenge, the new CSR's SHA-256 and the node id, so a
/// relaying hop can neither swap the CSR nor replay the answer for another node.
pub fn x509pop_message(challenge: &[u8], csr_sha256: &[u8; 32], node_id: &str) -> Vec<u8> {
    let mut m = Vec::with_capacity(challenge.len() + 34 + node_id.len());
    m.extend_from_slice(challenge);
    m.push(0);
    m.extend_from_slice(csr_sha256);
    m.push(0);
    m.extend_from_slice(node_id.as_bytes());
    m
}

/// What a machine sends to be challenged: its EK and bca's AK, each a marshaled `TPM2B_PUBLIC`
/// (base64), and the EK's certificate from NV when it has one (base64 DER).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TpmChallengeRequest {
    pub ek_public: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ek_certificate: Option<String>,
    pub ak_public: String,
}

/// The appliance's challenge: a credential (`TPM2_MakeCredential` to the EK, for the AK's Name)
/// that only that TPM, holding that AK, can activate. Its secret is the join's nonce.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TpmChallenge {
    pub challenge_id: String,
    /// `TPM2B_ID_OBJECT`'s contents, base64.
    pub credential_blob: String,
    /// `TPM2B_ENCRYPTED_SECRET`'s contents, base64.
    pub encrypted_secret: String,
    pub expires_in_seconds: u32,
}

/// The second round: the activated credential, and the AK's `TPM2_Certify` of the CSR's key over
/// [`tpm_join_qualifying`]. Public areas are marshaled `TPM2B_PUBLIC`, all fields base64.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TpmEvidence {
    pub challenge_id: String,
    /// The credential's secret, as `TPM2_ActivateCredential` returned it.
    pub credential: String,
    pub ek_public: String,
    pub ak_public: String,
    pub key_public: String,
    /// The `TPMS_ATTEST` the AK signed, and its `TPMT_SIGNATURE`.
    pub attest: String,
    pub signature: String,
    /// An EK on no list is refused instead of queued for an operator (the discovery ramdisk,
    /// which then joins with its discovery token).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_enrollment: bool,
}

/// The qualifying data of a `tpm` join's certification: the appliance's nonce (the credential's
/// secret) bound to the CSR, `SHA-256("bca tpm-join v1" || 0 || nonce || csr_sha256)`.
pub fn tpm_join_qualifying(nonce: &[u8], csr_sha256: &[u8; 32]) -> [u8; 32] {
    let mut m = b"bca tpm-join v1\0".to_vec();
    m.extend_from_slice(nonce);
    m.extend_from_slice(csr_sha256);
    crate::base::crypto::sha256(&m)
}

/// A renewal's proof that the new key lives in the TPM whose AK the certificate names: that
/// AK's `TPM2_Certify` of the CSR's key with `extraData` = the CSR's SHA-256.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct KeyAttestation {
    pub ak_public: String,
    pub key_public: String,
    pub attest: String,
    pub signature: String,
}

/// `Renew`, sent over mTLS with the node's current certificate.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RenewRequest {
    /// The new PKCS#10 request, base64 DER.
    pub csr: String,
    /// The current chain, PEM, leaf first.
    pub chain: Vec<String>,
    /// The agent's clock, Unix seconds.
    pub client_time: i64,
    /// The current key's signature (purpose `renew-pop`) over [`renew_pop_message`], base64 DER.
    pub pop_sig: String,
    /// Required when the presented leaf names a TPM AK (`urn:bc:tpm-ak:`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_attestation: Option<KeyAttestation>,
}

pub const RENEW_POP_PURPOSE: &str = "renew-pop";

/// What `pop_sig` signs: the CSR's SHA-256, the node id and the client time.
pub fn renew_pop_message(csr_sha256: &[u8; 32], node_id: &str, client_time: i64) -> Vec<u8> {
    let mut m = csr_sha256.to_vec();
    m.push(0);
    m.extend_from_slice(node_id.as_bytes());
    m.push(0);
    m.extend_from_slice(client_time.to_string().as_bytes());
    m
}

/// `Hello`, the first message of a session, over mTLS.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Hello {
    #[serde(default)]
    pub node_id: String,
    /// What a pool's acceptance checks read (its clock, its claims), signed by the node key so
    /// that the gateway, which relays it, cannot change it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evidence: Option<HelloEvidence>,
}

/// The agent's clock and claims at `Hello`, signed by its node key (purpose [`HELLO_PURPOSE`])
/// over [`hello_message`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HelloEvidence {
    /// The agent's clock, Unix seconds.
    pub client_time: i64,
    /// The claims JSON the agent reports (as it would send them to join), base64.
    pub claims: String,
    /// Base64 DER ECDSA signature.
    pub sig: String,
}

pub const HELLO_PURPOSE: &str = "bca hello v1";

/// What a `Hello`'s evidence signs: the node id, the client time and the SHA-256 of the claims
/// bytes.
pub fn hello_message(node_id: &str, client_time: i64, claims_sha256: &[u8; 32]) -> Vec<u8> {
    let mut m = node_id.as_bytes().to_vec();
    m.push(0);
    m.extend_from_slice(client_time.to_string().as_bytes());
    m.push(0);
    m.extend_from_slice(claims_sha256);
    m
}

/// What the gateway answers.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Reply {
    pub v: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_response: Option<JoinResponse>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_response: Option<JoinResponse>,
    /// A signed deferral: the join is waiting for an operator's approval.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_deferred: Option<JoinResponse>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub welcome: Option<Welcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack: Option<Clock>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pong: Option<Clock>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm_challenge: Option<TpmChallenge>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub x509pop_challenge: Option<X509PopChallenge>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<WireError>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Welcome {
    pub node_id: String,
    /// How often the agent sends `heartbeat`; the gateway closes a session silent for 3 of these.
    pub heartbeat_seconds: u32,
    pub server_time: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Clock {
    pub server_time: i64,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WireError {
    pub code: String,
    pub message: String,
}

/// `JoinResponse{ body, sig }`: `body` is base64 of the JSON of [`JoinResponseBody`], `sig` the
/// join-signing key's ECDSA signature (purpose `join-response`) over those bytes, and `signer`
/// the join-signing certificate (base64 DER), which the agent accepts only under its pin.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct JoinResponse {
    pub body: String,
    pub sig: String,
    pub signer: String,
}

pub const JOIN_RESPONSE_PURPOSE: &str = "bca join-response v1";
pub const JOIN_DEFERRAL_PURPOSE: &str = "bca join-deferral v1";

/// The body of a signed deferral (`joinDeferred`): nothing was issued and no token spent; the
/// machine retries with the same CSR.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinDeferral {
    pub request_id: String,
    pub state: String,
    pub retry_after_seconds: u32,
    pub csr_sha256: String,
    pub site_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JoinResponseBody {
    pub node_id: String,
    /// PEM, leaf first, then the node CA.
    pub certificate_chain: Vec<String>,
    pub command_signing_trust_bundle: Vec<String>,
    /// Hex SHA-256 of the CSR this answers.
    pub csr_sha256: String,
    pub trust_domain: String,
    pub site_id: String,
    pub role: String,
    /// During a join-signing rotation: the next key's pin, vouched for by the current key's
    /// signature over this body. Agents add it to the pins they accept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub join_signing_next_key_pin: Option<String>,
}

/// The gateway's calls into the JoinService: serializable messages, no shared state.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", tag = "call")]
pub enum Call {
    #[serde(rename_all = "camelCase")]
    Join {
        request: Box<JoinRequest>,
        peer: String,
    },
    #[serde(rename_all = "camelCase")]
    TpmChallenge {
        request: TpmChallengeRequest,
        peer: String,
    },
    #[serde(rename_all = "camelCase")]
    X509PopChallenge { peer: String },
    /// `peer_leaf`: the mTLS client certificate the gateway verified (base64 DER).
    #[serde(rename_all = "camelCase")]
    Renew {
        request: RenewRequest,
        peer_leaf: String,
        peer: String,
    },
    /// `hello`: the `Hello`'s signed evidence, when the agent sent it.
    #[serde(rename_all = "camelCase")]
    SessionOpen {
        peer_leaf: String,
        peer: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        hello: Option<HelloEvidence>,
    },
    #[serde(rename_all = "camelCase")]
    SessionSeen { node_id: String },
    #[serde(rename_all = "camelCase")]
    SessionClosed { node_id: String },
    /// The boot server asks for a discovery token for a MAC (voiding the MAC's earlier ones),
    /// or, with `mint` false, only whether the MAC boots its local disk (nothing is written).
    /// `sighted_ip`: the address the boot server's DHCP saw the MAC at, which the request came
    /// from (none when minting without a sighting is allowed).
    #[serde(rename_all = "camelCase")]
    MintDiscovery {
        mac: String,
        boot_lease_epoch: Option<i64>,
        #[serde(default)]
        sighted_ip: Option<String>,
        #[serde(default = "yes")]
        mint: bool,
    },
}

fn yes() -> bool {
    true
}

/// The JoinService's answer to a [`Call`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", tag = "outcome")]
pub enum Outcome {
    Issued {
        response: JoinResponse,
    },
    Refused,
    Conflict,
    InvalidConfig,
    Busy,
    #[serde(rename_all = "camelCase")]
    SessionOpened {
        node_id: String,
    },
    Deferred {
        response: JoinResponse,
    },
    /// A fresh discovery token, in clear for the per-boot archive; only its hash is stored.
    DiscoveryToken {
        token: String,
    },
    /// The machine's node is adopted and not marked for rediscovery: boot the local disk.
    LocalBoot,
    Challenge {
        challenge: TpmChallenge,
    },
    X509PopChallenge {
        challenge: X509PopChallenge,
    },
    Done,
}

pub const RENEW_REFUSED: &str = "Renew refused";
pub const SESSION_REFUSED: &str = "Session refused";

impl Reply {
    pub fn error(code: &str, message: &str) -> Self {
        Reply {
            v: 1,
            error: Some(WireError {
                code: code.into(),
                message: message.into(),
            }),
            ..Default::default()
        }
    }

    /// The answer to a join.
    pub fn from_outcome(o: Outcome) -> Self {
        match o {
            Outcome::Issued { response } => Reply {
                v: 1,
                join_response: Some(response),
                ..Default::default()
            },
            Outcome::Deferred { response } => Reply {
                v: 1,
                join_deferred: Some(response),
                ..Default::default()
            },
            Outcome::Refused => Reply::error("ACCESS_DENIED", JOIN_REFUSED),
            other => Reply::from_common(other),
        }
    }

    /// The answer to a `tpm` challenge request: refused like a join.
    pub fn from_challenge_outcome(o: Outcome) -> Self {
        match o {
            Outcome::Challenge { challenge } => Reply {
                v: 1,
                tpm_challenge: Some(challenge),
                ..Default::default()
            },
            other => Reply::from_outcome(other),
        }
    }

    /// The answer to an `x509pop` challenge request: refused like a join.
    pub fn from_x509pop_challenge_outcome(o: Outcome) -> Self {
        match o {
            Outcome::X509PopChallenge { challenge } => Reply {
                v: 1,
                x509pop_challenge: Some(challenge),
                ..Default::default()
            },
            other => Reply::from_outcome(other),
        }
    }

    /// The answer to a renewal.
    pub fn from_renew_outcome(o: Outcome) -> Self {
        match o {
            Outcome::Issued { response } => Reply {
                v: 1,
                renew_response: Some(response),
                ..Default::default()
            },
            Outcome::Refused => Reply::error("ACCESS_DENIED", RENEW_REFUSED),
            other => Reply::from_common(other),
        }
    }

    fn from_common(o: Outcome) -> Self {
        match o {
            Outcome::Conflict => Reply::error("CONFLICT", CONFLICT),
            Outcome::InvalidConfig => Reply::error(
                "INVALID_CONFIG",
                "the appliance has no JoinService configuration; every join fails until it has",
            ),
            _ => Reply::error("UNAVAILABLE", "the appliance is busy; retry"),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("serializes")
    }
}

pub const BASE_PATH: &str = "/api/compute";

pub const PROTOCOL_MIN: u32 = 1;

pub const PROTOCOL_MAX: u32 = 1;

/// A boxed future, what the boundaries' traits return (a `dyn` trait has no `async fn`).
pub type Pending<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

/// Where the gateway sends a [`Call`]: the JoinService's message interface, bytes in and bytes
/// out. The JoinService's handle implements it in one process; the network child's link to the
/// key-holding parent implements it under privilege separation.
pub trait CallSink: Send + Sync {
    /// The JoinService's answer to one message (empty bytes, read as busy, when it is gone).
    fn call(&self, msg: Vec<u8>) -> Pending<'_, Vec<u8>>;
    /// True when the JoinService is in another process (the network child's link).
    fn remote(&self) -> bool {
        false
    }
}
