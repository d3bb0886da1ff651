//! The JoinService: the only part that holds the signing keys. It takes [`Call`] messages
//! (serialized, from the gateway): joins, renewals and session bookkeeping, and answers
//! [`Outcome`] messages.
//!
//! A join runs in two stages:
//! 1. **Outside the write transaction**, on the caller's task: the CSR's signature is verified,
//!    the seal opened (ECDH + AES), the bearer parsed, the claims normalised and the hardware key
//!    derived. A trusted hardware key is registered as in flight: a second join of the same machine
//!    arriving before the first is answered gets `CONFLICT` (whatever batch either lands in).
//! 2. **Inside one write transaction**, on the writer thread, a batch of joins at a time (group
//!    commit), each in its own savepoint: lock the token row, check it, consume a use, apply the
//!    admission rules, write the node, sign the certificate (it needs the node id decided here),
//!    write `node_certs`, events and audit. A refusal rolls its savepoint back (the token keeps its
//!    use) and records `security.join.refused`. Answers are sent only after the commit is durable.

use crate::base::crypto::{self, SigningKey};
use crate::base::error::ApiResult;
use crate::domain::admission::{self, AdmitInput, Kind, KnownNode, Reason};
use crate::domain::token::Bearer;
use crate::domain::token::TokenRow;
use crate::join::site::Site;
use crate::pki::bundle::KeyBundle;
use crate::pki::{self, CaKind};
use crate::proto::claims::{self, Claims, HardwareKey, Identifiers};
use crate::proto::protocol::{
    Call, JoinRequest, JoinResponse, JoinResponseBody, Outcome, JOIN_RESPONSE_PURPOSE,
};
use crate::store::tenancy::TOKEN_COLS;
use rusqlite::{params, OptionalExtension, Transaction};
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::sync::{mpsc, Arc, Mutex};
use tokio::sync::oneshot;

/// Joins committed together at most.
const MAX_BATCH: usize = 64;
/// How long the writer waits for more work once it found more than one job queued (never for a
/// lone one: a quiet appliance answers at once). The appliance's one core is shared by the
/// writer and the runtimes that prepare its work; taking only what was queued at that instant,
/// the renewal storm committed 1.5 renewals per transaction (6,500 `fsync`s for 10,000). With
/// this wait, 2.9 to 4.4: 1,844 renewals/s against 1,573 in four alternated runs of each
/// (`make bench`, 2026-12-05), the joins unchanged within the noise.
const GATHER: std::time::Duration = std::time::Duration::from_micros(300);
/// Refusal events per attestor and reason per minute.
const EVENTS_PER_MINUTE: u32 = 60;

pub(crate) struct Signer {
    pub(crate) node_ca: (rcgen::Certificate, rcgen::KeyPair),
    pub(crate) node_ca_pem: String,
    /// The keys a rotation replaces while serving (`rotation`).
    keys: std::sync::RwLock<SignerKeys>,
}

/// The join-signing key and the join-encryption keys in use.
pub(crate) struct SignerKeys {
    join_signing: SigningKey,
    signer_b64: String,
    /// The staged next join-signing key's pin, told to renewing agents (signed by the current key).
    next_pin: Option<String>,
    /// Current first, then a staged next or a promoted-away previous key.
    decrypt: Vec<aws_lc_rs::agreement::PrivateKey>,
}

impl SignerKeys {
    pub(crate) fn new(pki: &crate::pki::PublicPki, keys: &KeyBundle) -> Result<Self, String> {
        let mut decrypt = vec![crate::proto::jwe::decryption_key(
            keys.join_encryption.pkcs8(),
        )?];
        for k in [&keys.join_encryption_next, &keys.join_encryption_previous]
            .into_iter()
            .flatten()
        {
            decrypt.push(crate::proto::jwe::decryption_key(k.pkcs8())?);
        }
        Ok(Self {
            join_signing: SigningKey::from_pkcs8(keys.join_signing.pkcs8())?,
            signer_b64: crypto::b64(&pki.join_signing),
            next_pin: pki.pins()?.join_signing_next,
            decrypt,
        })
    }
}

impl Signer {
    fn keys(&self) -> std::sync::RwLockReadGuard<'_, SignerKeys> {
        self.keys.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Swaps in the keys of a rotation step; answers in flight finish with the old ones.
    pub(crate) fn replace_keys(&self, k: SignerKeys) {
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) = k;
    }

    /// Opens a sealed token with the current join-encryption key, else a staged or previous one.
    fn open_seal(
        &self,
        sealed: &str,
        csr_sha256: &[u8; 32],
        now: i64,
        max_skew: i64,
    ) -> Result<zeroize::Zeroizing<String>, crate::proto::jwe::SealError> {
        let keys = self.keys();
        let mut first = None;
        for k in &keys.decrypt {
            match crate::proto::jwe::open(sealed, k, csr_sha256, now, max_skew) {
                Ok(t) => return Ok(t),
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        Err(first.expect("at least one key"))
    }

    /// Signs a response body: `JoinResponse{ body, sig, signer }`.
    pub(crate) fn respond(&self, body: &JoinResponseBody) -> JoinResponse {
        self.signed(JOIN_RESPONSE_PURPOSE, body)
    }

    /// `{ body, sig, signer }`: the JSON of `body`, signed under `purpose`.
    pub(crate) fn signed(&self, purpose: &str, body: &impl serde::Serialize) -> JoinResponse {
        let body = serde_json::to_vec(body).expect("serializes");
        let keys = self.keys();
        let sig = keys.join_signing.sign(purpose, &body);
        JoinResponse {
            body: crypto::b64(&body),
            sig: crypto::b64(&sig),
            signer: keys.signer_b64.clone(),
        }
    }
}

/// What stage 1 produced.
enum Prepared {
    Refused {
        /// The attestor the request named (`join-token` for one bca does not know).
        attestor: &'static str,
        reason: Reason,
        csr_sha256: Option<[u8; 32]>,
        hardware_key: Option<String>,
    },
    Ready(Box<Ready>),
}

/// What the machine proved in stage 1: a bearer token (`join-token`, `discovery`) or its TPM.
pub(crate) enum Proof {
    Bearer(Bearer),
    Tpm(Box<crate::join::tpm::TpmProof>),
}

pub(crate) struct Ready {
    pub(crate) proof: Proof,
    pub(crate) csr: crate::proto::csr::VerifiedCsr,
    pub(crate) claims: Claims,
    pub(crate) ids: Identifiers,
    pub(crate) key: Option<HardwareKey>,
    pub(crate) role: String,
    /// `join-token`, `discovery` or `tpm`.
    pub(crate) attestor: &'static str,
    /// The peer's IP address, recorded in join requests.
    pub(crate) peer_ip: String,
}

/// What the writer thread does for one call.
enum Work {
    Join(Prepared),
    TpmChallenge(Result<Box<crate::join::tpm::PreparedChallenge>, Reason>),
    Renew(Box<crate::join::renewal::Prepared>),
    SessionOpen(Vec<u8>),
    SessionSeen(String),
    SessionClosed(String),
    MintDiscovery(crate::join::discovery::Mint),
}

struct Job {
    work: Work,
    role: String,
    reply: oneshot::Sender<Outcome>,
}

/// The in-process handle the gateway holds: it can send messages, nothing else.
#[derive(Clone)]
pub struct JoinHandle {
    inner: Arc<Inner>,
}

struct Inner {
    site: Arc<Site>,
    signer: Arc<Signer>,
    jobs: Mutex<Option<mpsc::SyncSender<Job>>>,
    in_flight: Mutex<HashSet<String>>,
    renew_proofs: Mutex<crate::join::renewal::ReplayCache>,
    /// `[tpm_attestor] ek_ca_bundle`, read at start.
    ek_cas: crate::join::tpm::EkCas,
    /// False once the writer thread has ended (stopped or panicked).
    alive: Arc<std::sync::atomic::AtomicBool>,
}

/// Clears `alive` when the writer thread ends, however it ends.
struct Alive(Arc<std::sync::atomic::AtomicBool>);

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

pub struct JoinService {
    handle: JoinHandle,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl JoinService {
    pub fn start(site: Arc<Site>, keys: KeyBundle) -> Result<Self, String> {
        let node_ca = pki::issuer(CaKind::Node, &site.config, &keys.node_ca);
        let signer = Arc::new(Signer {
            node_ca,
            node_ca_pem: crate::proto::x509::pem("CERTIFICATE", &site.pki.node_ca),
            keys: std::sync::RwLock::new(SignerKeys::new(&site.pki, &keys)?),
        });
        drop(keys);
        let ek_cas = match &site.config.tpm_attestor.ek_ca_bundle {
            Some(p) => crate::join::tpm::EkCas::load(std::path::Path::new(p))?,
            None => crate::join::tpm::EkCas::default(),
        };
        // No session outlives a restart of the appliance.
        site.store
            .write(|tx| {
                Ok(crate::store::exec(
                    tx,
                    "UPDATE nodes SET connected = 0 WHERE connected = 1",
                    [],
                )?)
            })
            .map_err(|e| e.to_string())?;
        let (tx, rx) = mpsc::sync_channel::<Job>(4096);
        let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let guard = Alive(alive.clone());
        let inner = Arc::new(Inner {
            alive,
            site: site.clone(),
            signer: signer.clone(),
            jobs: Mutex::new(Some(tx)),
            in_flight: Mutex::default(),
            renew_proofs: Mutex::default(),
            ek_cas,
        });
        let writer = std::thread::Builder::new()
            .name("join-writer".into())
            .spawn(move || {
                let _alive = guard;
                writer_loop(site, signer, rx)
            })
            .map_err(|e| format!("cannot start the join writer: {e}"))?;
        Ok(Self {
            handle: JoinHandle { inner },
            writer: Some(writer),
        })
    }

    pub fn handle(&self) -> JoinHandle {
        self.handle.clone()
    }

    /// Stops taking joins and waits for the writer to finish what it has.
    pub async fn stop(mut self) {
        self.handle
            .inner
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(w) = self.writer.take() {
            let _ = tokio::task::spawn_blocking(move || w.join()).await;
        }
    }
}

/// Removes a machine from the in-flight set when its join is answered.
struct InFlight<'a> {
    set: &'a Mutex<HashSet<String>>,
    key: Option<String>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(k) = self.key.take() {
            self.set
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&k);
        }
    }
}

impl JoinHandle {
    /// Swaps the join-signing and join-encryption keys (a rotation step).
    pub(crate) fn replace_keys(&self, k: SignerKeys) {
        self.inner.signer.replace_keys(k);
    }

    /// Whether the writer thread still takes work.
    pub fn is_running(&self) -> bool {
        self.inner.alive.load(std::sync::atomic::Ordering::SeqCst)
            && self
                .inner
                .jobs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_some()
    }

    /// The message interface: a serialized [`Call`] in, a serialized [`Outcome`] out.
    pub async fn call(&self, msg: &[u8]) -> Vec<u8> {
        let outcome = match serde_json::from_slice::<Call>(msg) {
            Ok(call) => self.dispatch(call).await,
            Err(_) => Outcome::Refused,
        };
        serde_json::to_vec(&outcome).expect("serializes")
    }

    /// [`Self::call`] for a message already parsed (the privilege-separation broker parses it to
    /// see which calls the network child may make).
    pub async fn dispatch(&self, call: Call) -> Outcome {
        match call {
            Call::Join { request, peer } => self.join(*request, &peer).await,
            Call::TpmChallenge { request, peer } => {
                tracing::debug!(%peer, "tpm challenge");
                let prepared = crate::join::tpm::prepare_challenge(&request, &self.inner.ek_cas)
                    .map(|mut p| {
                        p.source = crate::join::tpm::source_key(&peer);
                        Box::new(p)
                    });
                self.submit(Work::TpmChallenge(prepared), String::new())
                    .await
            }
            Call::Renew {
                request,
                peer_leaf,
                peer,
            } => {
                let now = crate::base::clock::now();
                let leaf = crypto::b64_decode(&peer_leaf).unwrap_or_default();
                let prepared = crate::join::renewal::prepare(
                    &request,
                    &leaf,
                    now,
                    &mut self
                        .inner
                        .renew_proofs
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()),
                );
                tracing::debug!(%peer, "renewal");
                self.submit(Work::Renew(Box::new(prepared)), String::new())
                    .await
            }
            Call::SessionOpen { peer_leaf, .. } => {
                let leaf = crypto::b64_decode(&peer_leaf).unwrap_or_default();
                self.submit(Work::SessionOpen(leaf), String::new()).await
            }
            Call::SessionSeen { node_id } => {
                self.submit(Work::SessionSeen(node_id), String::new()).await
            }
            Call::SessionClosed { node_id } => {
                self.submit(Work::SessionClosed(node_id), String::new())
                    .await
            }
            Call::MintDiscovery {
                mac,
                boot_lease_epoch,
                sighted_ip,
                mint,
            } => {
                let m = crate::join::discovery::Mint {
                    mac,
                    boot_lease_epoch,
                    sighted_ip,
                    mint,
                };
                self.submit(Work::MintDiscovery(m), String::new()).await
            }
        }
    }

    /// Hands work to the writer thread and waits for its answer (sent after the commit).
    async fn submit(&self, work: Work, role: String) -> Outcome {
        let (tx, rx) = oneshot::channel();
        let sender = self
            .inner
            .jobs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(sender) = sender else {
            return Outcome::Busy;
        };
        let depth = &crate::base::metrics::get().queue_depth;
        depth.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if sender
            .try_send(Job {
                work,
                role,
                reply: tx,
            })
            .is_err()
        {
            depth.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
            return Outcome::Busy;
        }
        rx.await.unwrap_or(Outcome::Busy)
    }

    async fn join(&self, request: JoinRequest, peer: &str) -> Outcome {
        let now = crate::base::clock::now();
        // Recorded in refusal events: a peer's control characters are kept inert (`text`).
        let role = crate::base::text::escape(&request.role.chars().take(32).collect::<String>())
            .into_owned();
        let prepared = prepare(
            &self.inner.signer,
            &request,
            peer,
            now,
            self.inner.site.config.join.seal_max_skew_seconds as i64,
        );
        let mut guard = InFlight {
            set: &self.inner.in_flight,
            key: None,
        };
        if let Prepared::Ready(r) = &prepared {
            // A machine is its trusted hardware key. A `tpm` join is keyed by its challenge, not
            // its EK: the EK is public and unproven until the challenge is spent, so keying by it
            // would let anyone who knows a machine's EK race its join into a conflict; two joins
            // of one EK with two challenges are serialised by the writer (the second reclaims).
            let machine = match &r.proof {
                Proof::Tpm(p) => Some(format!("tpm-challenge:{}", p.challenge_id)),
                Proof::Bearer(_) => r.key.as_ref().filter(|k| k.trusted).map(|k| k.hex.clone()),
            };
            if let Some(k) = machine {
                let mut set = self
                    .inner
                    .in_flight
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                if !set.insert(k.clone()) {
                    tracing::info!(%peer, "join: the same machine is joining concurrently");
                    return Outcome::Conflict;
                }
                guard.key = Some(k);
            }
        }
        let out = self.submit(Work::Join(prepared), role).await;
        drop(guard);
        out
    }
}

/// Stage 1: every check that needs no database, in the seed's order.
fn prepare(signer: &Signer, r: &JoinRequest, peer: &str, now: i64, max_skew: i64) -> Prepared {
    let attestor = match r.attestor.as_str() {
        "" | "join-token" => "join-token",
        "discovery" => "discovery",
        "tpm" => "tpm",
        _ => {
            return Prepared::Refused {
                attestor: Reason::Attestor.attestor(),
                reason: Reason::Attestor,
                csr_sha256: None,
                hardware_key: None,
            }
        }
    };
    let refuse = |reason, csr_sha256, hardware_key| Prepared::Refused {
        attestor,
        reason,
        csr_sha256,
        hardware_key,
    };
    if !r.claims.within_limits() {
        return refuse(Reason::Claims, None, None);
    }
    let ids = Identifiers::from_claims(&r.claims);
    let key = claims::hardware_key(&ids);
    let hk = key.as_ref().map(|k| k.hex.clone());
    let Some(der) = crypto::b64_decode(&r.csr).filter(|d| d.len() <= crate::proto::csr::MAX_CSR)
    else {
        return refuse(Reason::Csr, None, hk);
    };
    let csr = match crate::proto::csr::verify(&der) {
        Ok(c) => c,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "join: bad CSR");
            return refuse(Reason::Csr, Some(crypto::sha256(&der)), hk);
        }
    };
    let proof = if attestor == "tpm" {
        match crate::join::tpm::prepare_join(r.tpm.as_ref(), &csr) {
            Ok(p) => Proof::Tpm(Box::new(p)),
            Err(reason) => return refuse(reason, Some(csr.sha256), hk),
        }
    } else {
        match open_bearer(signer, r, &csr, peer, now, max_skew) {
            Ok(b) => Proof::Bearer(b),
            Err(reason) => return refuse(reason, Some(csr.sha256), hk),
        }
    };
    Prepared::Ready(Box::new(Ready {
        proof,
        csr,
        claims: r.claims.clone(),
        ids,
        key,
        role: r.role.clone(),
        attestor,
        peer_ip: peer
            .rsplit_once(':')
            .map(|(h, _)| h.trim_matches(['[', ']']))
            .unwrap_or(peer)
            .to_string(),
    }))
}

/// The bearer token inside the seal, which must have been made for this CSR.
fn open_bearer(
    signer: &Signer,
    r: &JoinRequest,
    csr: &crate::proto::csr::VerifiedCsr,
    peer: &str,
    now: i64,
    max_skew: i64,
) -> Result<Bearer, Reason> {
    let token = match signer.open_seal(&r.sealed_token, &csr.sha256, now, max_skew) {
        Ok(t) => t,
        Err(e) => {
            tracing::debug!(%peer, error = ?e, "join: the seal did not open");
            return Err(Reason::Token);
        }
    };
    Bearer::parse(&token).ok_or(Reason::Malformed)
}

/// Per (attestor, reason): the minute, events written in it, and events suppressed since the last.
/// (The seed: 60 events per attestor and reason per minute. Renewals count as the attestor
/// `renew`; a `join:` reason met by two attestors has a budget for each.)
#[derive(Default)]
pub(crate) struct RateLimit {
    buckets: HashMap<(&'static str, &'static str), (i64, u32, u64)>,
}

impl RateLimit {
    /// `Some(suppressed)` when an event for (`attestor`, `reason`) may be written now.
    pub(crate) fn admit(
        &mut self,
        attestor: &'static str,
        reason: &'static str,
        now: i64,
    ) -> Option<u64> {
        let b = self
            .buckets
            .entry((attestor, reason))
            .or_insert((now / 60, 0, 0));
        if b.0 != now / 60 {
            b.0 = now / 60;
            b.1 = 0;
        }
        if b.1 >= EVENTS_PER_MINUTE {
            b.2 += 1;
            return None;
        }
        b.1 += 1;
        let s = b.2;
        b.2 = 0;
        Some(s)
    }
}

pub(crate) struct Refusal {
    pub(crate) reason: Reason,
    /// The tenant whose stream gets the event: the token's once its secret verified, else root.
    pub(crate) tenant: Option<String>,
}

pub(crate) enum Decided {
    Issued(JoinResponse),
    Refused(Refusal),
    /// Waiting for an operator: the request was recorded (kept), nothing issued, nothing spent.
    Deferred(JoinResponse),
}

fn writer_loop(site: Arc<Site>, signer: Arc<Signer>, rx: mpsc::Receiver<Job>) {
    let mut limits = RateLimit::default();
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        batch.extend(rx.try_iter().take(MAX_BATCH - 1));
        // More than one waiting: a storm. Let the runtime queue a few more before committing.
        if batch.len() > 1 && batch.len() < MAX_BATCH {
            std::thread::sleep(GATHER);
            batch.extend(rx.try_iter().take(MAX_BATCH - batch.len()));
        }
        crate::base::metrics::get()
            .queue_depth
            .fetch_sub(batch.len() as i64, std::sync::atomic::Ordering::Relaxed);
        let now = crate::base::clock::now();
        let started = std::time::Instant::now();
        let result = site.store.write(|tx| {
            let mut outs = Vec::with_capacity(batch.len());
            for job in &batch {
                outs.push(process(tx, &site, &signer, job, now, &mut limits)?);
            }
            Ok(outs)
        });
        crate::base::metrics::get().commit(started.elapsed().as_micros() as u64);
        match result {
            Ok(outs) => {
                for (job, out) in batch.into_iter().zip(outs) {
                    count(&job.work, &out);
                    let _ = job.reply.send(out);
                }
            }
            Err(e) => {
                tracing::error!(error = %e, joins = batch.len(), "join batch failed; nothing was admitted");
                for job in batch {
                    count(&job.work, &Outcome::Busy);
                    let _ = job.reply.send(Outcome::Busy);
                }
            }
        }
    }
}

/// Counts an answered join or renewal for `/metrics`.
fn count(work: &Work, out: &Outcome) {
    use std::sync::atomic::Ordering::Relaxed;
    let m = crate::base::metrics::get();
    let c = match (work, out) {
        (Work::Join(_), Outcome::Issued { .. }) => &m.joins_issued,
        (Work::Join(_), Outcome::Deferred { .. }) => &m.joins_deferred,
        (Work::Join(_), Outcome::Refused) => &m.joins_refused,
        (Work::Join(_), _) => &m.joins_busy,
        (Work::Renew(_), Outcome::Issued { .. }) => &m.renewals_issued,
        (Work::Renew(_), _) => &m.renewals_refused,
        _ => return,
    };
    c.fetch_add(1, Relaxed);
}

fn process(
    tx: &Transaction<'_>,
    site: &Site,
    signer: &Signer,
    job: &Job,
    now: i64,
    limits: &mut RateLimit,
) -> ApiResult<Outcome> {
    let prepared = match &job.work {
        Work::Join(p) => p,
        Work::TpmChallenge(Ok(p)) => return crate::join::tpm::challenge(tx, p, now),
        Work::TpmChallenge(Err(reason)) => {
            return refusal(tx, site, job, *reason, None, None, None, now, limits)
        }
        Work::Renew(p) => return crate::join::renewal::process(tx, site, signer, p, now, limits),
        Work::SessionOpen(leaf) => return crate::join::sessions::open(tx, leaf, now),
        Work::SessionSeen(node) => return crate::join::sessions::seen(tx, node, now),
        Work::SessionClosed(node) => return crate::join::sessions::closed(tx, node, now),
        Work::MintDiscovery(m) => return crate::join::discovery::mint(tx, site, m, now),
    };
    let (decided, csr_sha, hk) = match prepared {
        Prepared::Refused {
            reason,
            csr_sha256,
            hardware_key,
            ..
        } => (
            Decided::Refused(Refusal {
                reason: *reason,
                tenant: None,
            }),
            *csr_sha256,
            hardware_key.clone(),
        ),
        Prepared::Ready(r) => {
            // A `tpm` join spends its challenge whatever the outcome.
            let spent = match &r.proof {
                Proof::Tpm(p) => crate::join::tpm::spend_challenge(tx, p, now)?,
                Proof::Bearer(_) => Ok(false),
            };
            crate::store::exec(tx, "SAVEPOINT one_join", [])?;
            let d = match (spent, &r.proof) {
                (Err(reason), _) => refused(reason, None),
                (Ok(certified), Proof::Tpm(p)) => {
                    crate::join::tpm::admit(tx, site, signer, r, p, certified, now)
                }
                (Ok(_), _) if r.attestor == "discovery" => {
                    crate::join::discovery::admit(tx, site, signer, r, now)
                }
                (Ok(_), _) => admit_one(tx, site, signer, r, now),
            };
            match &d {
                // A deferral keeps what it wrote (the join request); a refusal keeps nothing.
                Ok(Decided::Issued(_)) | Ok(Decided::Deferred(_)) => {
                    crate::store::exec(tx, "RELEASE one_join", [])?;
                }
                _ => {
                    crate::store::exec(tx, "ROLLBACK TO one_join", [])?;
                    crate::store::exec(tx, "RELEASE one_join", [])?;
                }
            }
            // One join's failure (a constraint its writes broke) is its own: its savepoint is
            // rolled back and it is answered `UNAVAILABLE`; the rest of the batch commits.
            let d = match d {
                Ok(d) => d,
                Err(e) => {
                    tracing::error!(error = %e, attestor = r.attestor, "join failed; rolled back alone");
                    return Ok(Outcome::Busy);
                }
            };
            (d, Some(r.csr.sha256), r.key.as_ref().map(|k| k.hex.clone()))
        }
    };
    match decided {
        Decided::Issued(response) => Ok(Outcome::Issued { response }),
        Decided::Deferred(response) => Ok(Outcome::Deferred { response }),
        Decided::Refused(r) => refusal(tx, site, job, r.reason, r.tenant, csr_sha, hk, now, limits),
    }
}

/// A refused join (or `tpm` challenge): logged, counted, and published as
/// `security.join.refused` within the rate limit; the caller learns nothing more.
#[allow(clippy::too_many_arguments)]
fn refusal(
    tx: &Transaction<'_>,
    site: &Site,
    job: &Job,
    reason: Reason,
    tenant: Option<String>,
    csr_sha: Option<[u8; 32]>,
    hk: Option<String>,
    now: i64,
    limits: &mut RateLimit,
) -> ApiResult<Outcome> {
    tracing::info!(reason = reason.as_str(), "join refused");
    crate::base::metrics::get().refused(reason.as_str());
    // The join's own attestor, also for the `join:` reasons any attestor may meet.
    let attestor = match &job.work {
        Work::Join(Prepared::Ready(r)) => r.attestor,
        Work::Join(Prepared::Refused { attestor, .. }) => attestor,
        Work::TpmChallenge(_) => "tpm",
        _ => reason.attestor(),
    };
    if let Some(suppressed) = limits.admit(attestor, reason.as_str(), now) {
        let tenant = tenant.unwrap_or_else(|| site.root_tenant.clone());
        crate::store::events::publish(
            tx,
            now,
            &tenant,
            "security.join.refused",
            json!({
                "attestor": attestor,
                "reason": reason.as_str(),
                "role": job.role,
                "csrSha256": csr_sha.map(|h| crypto::hex(&h)),
                "hardwareKey": hk,
                "suppressed": suppressed,
            }),
        )?;
    }
    Ok(Outcome::Refused)
}

pub(crate) fn refused(reason: Reason, tenant: Option<&str>) -> ApiResult<Decided> {
    Ok(Decided::Refused(Refusal {
        reason,
        tenant: tenant.map(str::to_string),
    }))
}

/// Stage 2 for one join, inside its savepoint.
fn admit_one(
    tx: &Transaction<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    now: i64,
) -> ApiResult<Decided> {
    let cfg = &site.config;
    let Proof::Bearer(bearer) = &r.proof else {
        return refused(Reason::Attestor, None);
    };
    let token: Option<TokenRow> = crate::store::query_row(
        tx,
        &format!("SELECT {TOKEN_COLS} FROM join_tokens WHERE id = ?1"),
        [&bearer.id],
        crate::store::tenancy::token_row,
    )
    .optional()?;
    let Some(token) = token else {
        return refused(Reason::Unknown, None);
    };
    if let Err(reason) = admission::check_token(&token, &bearer.secret, &r.role, now) {
        let tenant = (reason != Reason::SecretMismatch).then_some(token.tenant_id.as_str());
        return refused(reason, tenant);
    }
    let tenant = Some(token.tenant_id.as_str());
    crate::store::exec(
        tx,
        "UPDATE join_tokens SET uses_left = uses_left - 1 WHERE id = ?1 AND uses_left > 0",
        [&token.id],
    )?;
    let pool = crate::store::tenancy::pool_by_id(tx, &token.pool_id)?;
    let known = match r.key.as_ref().filter(|k| k.trusted) {
        Some(k) => crate::store::query_row(tx,
                "SELECT id, tenant_id, site_id, pool_id, role, state, trust, identity_generation FROM nodes
                 WHERE hardware_key = ?1 AND hardware_key_trusted = 1",
                [&k.hex],
                |row| {
                    Ok(KnownNode {
                        id: row.get(0)?,
                        tenant_id: row.get(1)?,
                        site_id: row.get(2)?,
                        pool_id: row.get(3)?,
                        role: row.get(4)?,
                        state: row.get(5)?,
                        trust: row.get(6)?,
                        identity_generation: row.get(7)?,
                    })
                },
            )
            .optional()?,
        None => None,
    };
    let decision = admission::admit(&AdmitInput {
        token: &token,
        pool: pool.as_ref(),
        site_id: &cfg.site_id,
        root_tenant: &site.root_tenant,
        ids: &r.ids,
        key: r.key.as_ref(),
        known: known.as_ref(),
    });
    let adm = match decision {
        Ok(a) => a,
        Err(reason) => return refused(reason, tenant),
    };
    let pool = pool.expect("admission checked the pool");
    let claims_json = serde_json::to_string(&r.claims).expect("serializes");
    let (node_id, generation, reclaim) = match &adm.kind {
        Kind::New => {
            let id = crate::base::ids::new_id("node", now * 1000);
            crate::store::exec(tx,
                "INSERT INTO nodes (id, tenant_id, site_id, pool_id, role, state, trust, hardware_key, hardware_key_trusted,
                 identity_generation, attestor, hostname, claims_json, created_at, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, 'adopting', ?6, ?7, ?8, 1, 'join-token', ?9, ?10, ?11, ?11)",
                params![
                    id,
                    token.tenant_id,
                    token.site_id,
                    pool.id,
                    adm.role,
                    adm.trust,
                    r.key.as_ref().map(|k| k.hex.clone()),
                    r.key.as_ref().is_some_and(|k| k.trusted) as i64,
                    r.claims.hostname,
                    claims_json,
                    now
                ],
            )?;
            (id, 1, false)
        }
        Kind::Reclaim {
            node_id,
            generation,
        } => {
            crate::store::exec(tx,
                "UPDATE nodes SET identity_generation = ?2, state = 'adopting', trust = ?3, hostname = ?4, claims_json = ?5,
                 updated_at = ?6, identifiers_by = 'token' WHERE id = ?1",
                params![node_id, generation, adm.trust, r.claims.hostname, claims_json, now],
            )?;
            revoke_all(tx, &token.tenant_id, node_id, "reclaimed", now)?;
            (node_id.clone(), *generation, true)
        }
    };
    let (response, serial) = certify(
        tx,
        site,
        signer,
        &Subject {
            node_id: &node_id,
            generation,
            role: &adm.role,
            statements: &[],
            ttl: cfg.pki.cert_ttl_seconds as i64,
        },
        &r.csr,
        now,
    )?;
    let data = json!({
        "nodeId": node_id,
        "poolId": pool.id,
        "tokenId": token.id,
        "attestor": "join-token",
        "reclaim": reclaim,
        "hardwareKeyTrusted": r.key.as_ref().is_some_and(|k| k.trusted),
        "certificateSerial": serial,
        "nodeKey": "unattested",
        "role": adm.role,
    });
    crate::store::events::publish(tx, now, &token.tenant_id, "node.joined", data.clone())?;
    let action = if reclaim {
        "node.reclaimed"
    } else {
        "node.joined"
    };
    crate::store::events::audit(
        tx,
        now,
        &token.tenant_id,
        action,
        &format!("join-token:{}", token.id),
        &node_id,
        data,
    )?;
    adopt(tx, &token.tenant_id, &node_id, &pool.id, now)?;
    Ok(Decided::Issued(response))
}

/// No acceptance checks yet: a node that just joined (`adopting`) is adopted at once, with its
/// `node.adopted` event.
pub(crate) fn adopt(
    tx: &Transaction<'_>,
    tenant: &str,
    node_id: &str,
    pool_id: &str,
    now: i64,
) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE nodes SET state = 'adopted' WHERE id = ?1 AND state = 'adopting'",
        [node_id],
    )?;
    crate::store::events::publish(
        tx,
        now,
        tenant,
        "node.adopted",
        json!({"nodeId": node_id, "poolId": pool_id}),
    )
}

/// Revokes every unrevoked certificate of `node_id` (`reason`, with a
/// `security.certificate-revoked` event for each).
pub(crate) fn revoke_all(
    tx: &Transaction<'_>,
    tenant: &str,
    node_id: &str,
    reason: &str,
    now: i64,
) -> ApiResult<()> {
    let serials: Vec<String> = tx
        .prepare("SELECT serial FROM node_certs WHERE node_id = ?1 AND revoked_at IS NULL")?
        .query_map([node_id], |row| row.get(0))?
        .collect::<Result<_, _>>()?;
    for serial in serials {
        crate::store::exec(
            tx,
            "UPDATE node_certs SET revoked_at = ?2, revoke_reason = ?3 WHERE serial = ?1",
            params![serial, now, reason],
        )?;
        crate::store::events::publish(
            tx,
            now,
            tenant,
            "security.certificate-revoked",
            json!({"nodeId": node_id, "serial": serial, "reason": reason}),
        )?;
    }
    Ok(())
}

/// A node certificate's lifetime, at a join and at every renewal: `[pki] cert_ttl_seconds`; a
/// `ramdisk`'s `[discovery] cert_ttl_seconds` (at most 2 hours); a `tpm` node's
/// `[tpm_attestor] cert_ttl_seconds` when set (at most the `[pki]` one).
pub(crate) fn cert_ttl(cfg: &crate::config::Config, role: &str, attestor: &str) -> i64 {
    let pki_ttl = cfg.pki.cert_ttl_seconds as i64;
    if role == "ramdisk" {
        (cfg.discovery.cert_ttl_seconds as i64).min(7200)
    } else if attestor == "tpm" {
        cfg.tpm_attestor
            .cert_ttl_seconds
            .map_or(pki_ttl, |t| (t as i64).min(pki_ttl))
    } else {
        pki_ttl
    }
}

/// Who a certificate is for: decided by the JoinService, never taken from the CSR.
pub(crate) struct Subject<'a> {
    pub node_id: &'a str,
    pub generation: i64,
    pub role: &'a str,
    pub statements: &'a [String],
    pub ttl: i64,
}

/// Signs a node certificate for the CSR's key, records it in `node_certs`, and returns the signed
/// response and the certificate's serial.
pub(crate) fn certify(
    tx: &Transaction<'_>,
    site: &Site,
    signer: &Signer,
    who: &Subject<'_>,
    csr: &crate::proto::csr::VerifiedCsr,
    now: i64,
) -> ApiResult<(JoinResponse, String)> {
    let cfg = &site.config;
    let spiffe = format!(
        "spiffe://{}/site/{}/node/{}",
        cfg.trust_domain, cfg.site_id, who.node_id
    );
    // Set back for clocks a little behind ours; the span stays the attestor's limit (at most 24
    // hours, 2 for a ramdisk), so the back-dating comes off the end.
    let not_before = now - pki::backdate(who.ttl);
    let not_after = not_before + who.ttl;
    let (der, serial) = pki::issue_node_cert(
        &pki::NodeCertSpec {
            spiffe_id: &spiffe,
            statements: who.statements,
            role: who.role,
            not_before,
            not_after,
            public_point: &csr.public_point,
        },
        &signer.node_ca,
    )
    .map_err(crate::base::error::ApiError::internal)?;
    let spki_hash = crypto::hex(&crypto::sha256(&crypto::p256_spki_from_point(
        &csr.public_point,
    )));
    crate::store::exec(tx,
        "INSERT INTO node_certs (serial, node_id, identity_generation, role, spki_sha256, der, not_before, not_after, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![serial, who.node_id, who.generation, who.role, spki_hash, der, not_before, not_after, now],
    )?;
    let body = JoinResponseBody {
        node_id: who.node_id.to_string(),
        certificate_chain: vec![
            crate::proto::x509::pem("CERTIFICATE", &der),
            signer.node_ca_pem.clone(),
        ],
        command_signing_trust_bundle: vec![],
        csr_sha256: crypto::hex(&csr.sha256),
        trust_domain: cfg.trust_domain.clone(),
        site_id: cfg.site_id.clone(),
        role: who.role.to_string(),
        join_signing_next_key_pin: signer.keys().next_pin.clone(),
    };
    Ok((signer.respond(&body), serial))
}

impl crate::proto::protocol::CallSink for JoinHandle {
    fn call(&self, msg: Vec<u8>) -> crate::proto::protocol::Pending<'_, Vec<u8>> {
        Box::pin(async move { JoinHandle::call(self, &msg).await })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_events_are_rate_limited_with_a_suppressed_count() {
        let mut rl = RateLimit::default();
        for _ in 0..60 {
            assert_eq!(
                rl.admit("join-token", Reason::Unknown.as_str(), 120),
                Some(0)
            );
        }
        assert_eq!(rl.admit("join-token", Reason::Unknown.as_str(), 121), None);
        assert_eq!(rl.admit("join-token", Reason::Unknown.as_str(), 122), None);
        // Another reason has its own budget, and so has the same reason under another attestor.
        assert_eq!(
            rl.admit("join-token", Reason::Expired.as_str(), 122),
            Some(0)
        );
        assert_eq!(
            rl.admit("discovery", Reason::Unknown.as_str(), 122),
            Some(0)
        );
        // The next minute: the first event carries what was dropped.
        assert_eq!(
            rl.admit("join-token", Reason::Unknown.as_str(), 180),
            Some(2)
        );
        assert_eq!(
            rl.admit("join-token", Reason::Unknown.as_str(), 181),
            Some(0)
        );
    }
}
