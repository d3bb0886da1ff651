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

use crate::base::crypto::{self};
use crate::base::error::ApiResult;
use crate::domain::admission::Reason;
use crate::domain::token::Bearer;
use crate::join::issue::refused;
use crate::join::issue::Decided;
use crate::join::issue::Proof;
use crate::join::issue::RateLimit;
use crate::join::issue::Ready;
use crate::join::issue::Refusal;
use crate::join::issue::Signer;
use crate::join::issue::SignerKeys;
use crate::join::site::Site;
use crate::pki::bundle::KeyBundle;
use crate::pki::{self, CaKind};
use crate::proto::claims::{self, Identifiers};
use crate::proto::protocol::{Call, JoinRequest, Outcome};
use crate::store::Tx;
use serde_json::json;
use std::collections::HashSet;
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

/// What the writer thread does for one call.
enum Work {
    Join(Prepared),
    TpmChallenge(Result<Box<crate::join::tpm::PreparedChallenge>, Reason>),
    X509PopChallenge(Result<Box<crate::join::x509pop::PreparedChallenge>, Reason>),
    Renew(Box<crate::join::renewal::Prepared>),
    SessionOpen(Vec<u8>, Option<crate::proto::protocol::HelloEvidence>),
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
            .write(crate::store::nodes::disconnect_all)
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

    /// The release manifest's signature and signer (`domain::downloads::manifest_body`): only the
    /// appliance's own process asks, never the network child (it is no [`Call`]).
    pub fn sign_release_manifest(&self, body: &str) -> (String, String) {
        self.inner.signer.sign_bytes(
            crate::domain::downloads::RELEASE_MANIFEST_PURPOSE,
            body.as_bytes(),
        )
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
            Call::X509PopChallenge { peer } => {
                tracing::debug!(%peer, "x509pop challenge");
                let prepared = crate::join::x509pop::prepare_challenge(
                    self.inner.site.config.x509pop.enabled,
                    crate::join::tpm::source_key(&peer),
                )
                .map(Box::new);
                self.submit(Work::X509PopChallenge(prepared), String::new())
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
            Call::SessionOpen {
                peer_leaf, hello, ..
            } => {
                let leaf = crypto::b64_decode(&peer_leaf).unwrap_or_default();
                self.submit(Work::SessionOpen(leaf, hello), String::new())
                    .await
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
        let cfg = &self.inner.site.config;
        let prepared = prepare(
            &self.inner.signer,
            &request,
            peer,
            now,
            (cfg.join.seal_max_skew_seconds as i64, cfg.x509pop.enabled),
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
                // Two re-joins of one node are serialised by the writer: the second finds the
                // first's certificate newer and live.
                Proof::X509Pop(_) => None,
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

/// Stage 1: every check that needs no database, in the seed's order. `(max_skew, x509pop)`: the
/// seal's clock window and whether the `x509pop` attestor runs.
fn prepare(
    signer: &Signer,
    r: &JoinRequest,
    peer: &str,
    now: i64,
    (max_skew, x509pop): (i64, bool),
) -> Prepared {
    let attestor = match r.attestor.as_str() {
        "" | "join-token" => "join-token",
        "discovery" => "discovery",
        "tpm" => "tpm",
        "x509pop" => "x509pop",
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
    } else if attestor == "x509pop" {
        match crate::join::x509pop::prepare_join(x509pop, r.x509pop.as_ref(), &csr) {
            Ok(p) => Proof::X509Pop(Box::new(p)),
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
        node_id: r.node_id.clone().filter(|n| n.len() <= 64),
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

/// How often a batch PostgreSQL aborted for a concurrent one is run again before its calls are
/// answered `UNAVAILABLE`.
const MAX_GIVE_WAY: u64 = 5;

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
        // On PostgreSQL another appliance's batch may hold rows this one needs in another order:
        // the database aborts one of the two, which is run again (an agent never sees it).
        let mut tries = 0;
        let result = loop {
            let r = site.store.write(|tx| {
                let mut outs = Vec::with_capacity(batch.len());
                for job in &batch {
                    outs.push(process(tx, &site, &signer, job, now, &mut limits)?);
                }
                Ok(outs)
            });
            match r {
                Err(e) if crate::store::sql::gave_way(&e) && tries < MAX_GIVE_WAY => {
                    tries += 1;
                    tracing::info!(
                        joins = batch.len(),
                        tries,
                        "join batch gave way to another appliance's; running it again"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(5 * tries));
                }
                r => break r,
            }
        };
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
    tx: &Tx<'_>,
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
        Work::X509PopChallenge(Ok(p)) => return crate::join::x509pop::challenge(tx, p, now),
        Work::X509PopChallenge(Err(reason)) => {
            return refusal(tx, site, job, *reason, None, None, None, now, limits)
        }
        Work::Renew(p) => return crate::join::renewal::process(tx, site, signer, p, now, limits),
        Work::SessionOpen(leaf, hello) => {
            return crate::join::sessions::open(tx, leaf, hello.as_ref(), now)
        }
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
            // A `tpm` or `x509pop` join spends its challenge whatever the outcome.
            let spent = match &r.proof {
                Proof::Tpm(p) => crate::join::tpm::spend_challenge(tx, p, now)?,
                Proof::X509Pop(p) => {
                    crate::join::x509pop::spend_challenge(tx, p, now)?.map(|()| false)
                }
                Proof::Bearer(_) => Ok(false),
            };
            // A deferral keeps what it wrote (the join request); a refusal keeps nothing.
            let d = tx.savepoint(
                |tx| match (spent, &r.proof) {
                    (Err(reason), _) => refused(reason, None),
                    (Ok(certified), Proof::Tpm(p)) => {
                        crate::join::tpm::admit(tx, site, signer, r, p, certified, now)
                    }
                    (Ok(_), Proof::X509Pop(p)) => {
                        crate::join::x509pop::admit(tx, site, signer, r, p, now)
                    }
                    (Ok(_), _) if r.attestor == "discovery" => {
                        crate::join::discovery::admit(tx, site, signer, r, now)
                    }
                    (Ok(_), _) => crate::join::token::admit(tx, site, signer, r, now),
                },
                |d| matches!(d, Ok(Decided::Issued(_)) | Ok(Decided::Deferred(_))),
            )?;
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
    tx: &Tx<'_>,
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
        Work::X509PopChallenge(_) => "x509pop",
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

impl crate::proto::protocol::CallSink for JoinHandle {
    fn call(&self, msg: Vec<u8>) -> crate::proto::protocol::Pending<'_, Vec<u8>> {
        Box::pin(async move { JoinHandle::call(self, &msg).await })
    }
}
