//! The gateway: the TLS 1.3 listener agents dial. It relays joins and renewals to the JoinService
//! through the message interface (a [`CallSink`]: bytes in, bytes out) and holds node
//! sessions. It never holds a signing key, never opens a seal, never parses a token.
//!
//! Client certificates are optional at the TLS layer (a join has none) and, when presented, must
//! chain to the node CA and be valid now (webpki); `renew` and `hello` require one, and the
//! JoinService then checks it against `node_certs`.
//!
//! Limits: at most `[sessions] max_connections` connections at once, and
//! `max_connections_per_source` from one address; `joins_per_source_per_minute` joins from one
//! address; a connection must finish its TLS handshake and send its first request within
//! `request_deadline_seconds`, and at most `max_handshakes` are in that phase at once (the rest
//! wait in the kernel's accept queue, so an overload is served in arrival order); frames are at most
//! [`protocol::MAX_FRAME`] bytes; a session silent for three heartbeats is closed.

use crate::base::net::provider;
use crate::proto::protocol::CallSink;
use crate::proto::protocol::PROTOCOL_MAX;
use crate::proto::protocol::PROTOCOL_MIN;
use crate::proto::protocol::{self, Call, Clock, Outcome, Reply, Request, Welcome};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio_rustls::server::TlsStream;

/// Per-source limits: connections open now, and a token bucket of joins.
#[derive(Default)]
struct Sources {
    open: Arc<crate::base::limits::PerSource>,
    joins: std::sync::Mutex<Buckets>,
}

/// The join buckets by source, and when the full ones were last forgotten.
#[derive(Default)]
struct Buckets {
    by_source: std::collections::HashMap<std::net::IpAddr, (f64, std::time::Instant)>,
    pruned: Option<std::time::Instant>,
}

/// Past this many sources, the buckets that are full again are forgotten, at most once a second:
/// a scan on every join would make each one cost the whole map (an address per join, from a
/// /64, keeps it full).
const BUCKETS_KEPT: usize = 65_536;

impl Sources {
    /// Takes one join from the source's bucket (`per_minute` tokens, refilled continuously).
    fn join_allowed(&self, ip: std::net::IpAddr, per_minute: u32) -> bool {
        self.join_allowed_at(ip, per_minute, std::time::Instant::now())
    }

    fn join_allowed_at(
        &self,
        ip: std::net::IpAddr,
        per_minute: u32,
        now: std::time::Instant,
    ) -> bool {
        if per_minute == 0 {
            return true;
        }
        let cap = per_minute as f64;
        let mut joins = self.joins.lock().unwrap_or_else(|p| p.into_inner());
        let due = joins
            .pruned
            .is_none_or(|p| now.duration_since(p) >= std::time::Duration::from_secs(1));
        if joins.by_source.len() > BUCKETS_KEPT && due {
            // Forget the sources whose buckets are full again.
            joins
                .by_source
                .retain(|_, (t, at)| *t + now.duration_since(*at).as_secs_f64() * cap / 60.0 < cap);
            joins.pruned = Some(now);
        }
        let (tokens, at) = joins.by_source.entry(ip).or_insert((cap, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * cap / 60.0).min(cap);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

pub struct Gateway {
    cfg: crate::config::SessionsConfig,
    registry: Arc<crate::base::registry::Registry>,
    tls: tokio_rustls::TlsAcceptor,
    /// Where joins and renewals go (`None`: no JoinService; every join answers `INVALID_CONFIG`).
    relay: Option<Arc<dyn CallSink>>,
    sources: Sources,
}

/// The gateway's certificate and key, swapped by a rotation while serving: new handshakes get the
/// new leaf, established connections and sessions carry on untouched.
///
/// The key-holding side keeps the previous leaf too, so that a handshake the network child began
/// under the old leaf is still signed by the key that leaf names.
#[derive(Debug)]
pub struct GatewayCert {
    current: std::sync::RwLock<Arc<rustls::sign::CertifiedKey>>,
    previous: std::sync::RwLock<Option<Arc<rustls::sign::CertifiedKey>>>,
    generation: watch::Sender<u64>,
}

fn certified(
    leaf: &[u8],
    ca: &[u8],
    key_pkcs8: &[u8],
) -> Result<rustls::sign::CertifiedKey, String> {
    let key = provider()
        .key_provider
        .load_private_key(PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
            key_pkcs8.to_vec(),
        )))
        .map_err(|e| format!("the gateway key: {e}"))?;
    let ck = rustls::sign::CertifiedKey::new(
        vec![
            CertificateDer::from(leaf.to_vec()),
            CertificateDer::from(ca.to_vec()),
        ],
        key,
    );
    ck.keys_match()
        .map_err(|e| format!("the gateway certificate: {e}"))?;
    Ok(ck)
}

impl GatewayCert {
    pub fn new(leaf: &[u8], ca: &[u8], key_pkcs8: &[u8]) -> Result<Self, String> {
        Ok(Self::from_certified(certified(leaf, ca, key_pkcs8)?))
    }

    pub fn from_certified(ck: rustls::sign::CertifiedKey) -> Self {
        Self {
            current: std::sync::RwLock::new(Arc::new(ck)),
            previous: Default::default(),
            generation: watch::channel(0).0,
        }
    }

    pub fn replace(&self, leaf: &[u8], ca: &[u8], key_pkcs8: &[u8]) -> Result<(), String> {
        self.replace_certified(certified(leaf, ca, key_pkcs8)?);
        Ok(())
    }

    pub fn replace_certified(&self, ck: rustls::sign::CertifiedKey) {
        let old = std::mem::replace(
            &mut *self.current.write().unwrap_or_else(|p| p.into_inner()),
            Arc::new(ck),
        );
        *self.previous.write().unwrap_or_else(|p| p.into_inner()) = Some(old);
        self.generation.send_modify(|g| *g += 1);
    }

    pub fn current(&self) -> Arc<rustls::sign::CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Told of every [`Self::replace`].
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// Signs a handshake for the leaf whose SHA-256 is `leaf_sha256` (the current or the previous
    /// one), with `scheme`.
    pub fn sign(
        &self,
        leaf_sha256: &[u8],
        scheme: rustls::SignatureScheme,
        message: &[u8],
    ) -> Result<Vec<u8>, String> {
        let previous = self
            .previous
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let ck = std::iter::once(self.current())
            .chain(previous)
            .find(|ck| {
                ck.cert
                    .first()
                    .is_some_and(|c| crate::base::crypto::sha256(c).as_slice() == leaf_sha256)
            })
            .ok_or("no such gateway certificate")?;
        let signer = ck
            .key
            .choose_scheme(&[scheme])
            .ok_or("the gateway key does not sign with that scheme")?;
        signer.sign(message).map_err(|e| e.to_string())
    }
}

impl rustls::server::ResolvesServerCert for GatewayCert {
    fn resolve(
        &self,
        _: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.current())
    }
}

/// TLS 1.3 only, the gateway leaf and the serving CA as its chain, ALPN `bca/1`, optional client
/// certificates under the node CA, one session ticket per handshake (see [`crate::edge::tickets`]).
pub fn server_config(
    leaf: &[u8],
    ca: &[u8],
    key_pkcs8: &[u8],
    node_ca: &[u8],
    tickets: Arc<crate::edge::tickets::Tickets>,
) -> Result<rustls::ServerConfig, String> {
    server_config_with(
        Arc::new(GatewayCert::new(leaf, ca, key_pkcs8)?),
        node_ca,
        tickets,
    )
}

/// [`server_config`] around a swappable certificate.
pub fn server_config_with(
    cert: Arc<GatewayCert>,
    node_ca: &[u8],
    tickets: Arc<crate::edge::tickets::Tickets>,
) -> Result<rustls::ServerConfig, String> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from(node_ca.to_vec()))
        .map_err(|e| format!("the node CA: {e}"))?;
    let clients =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
            .allow_unauthenticated()
            .build()
            .map_err(|e| e.to_string())?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(clients)
        .with_cert_resolver(cert);
    cfg.alpn_protocols = vec![protocol::ALPN.to_vec()];
    cfg.ignore_client_order = true;
    // One ticket per handshake, which an agent resumes its session with after a restart; no
    // server-side session cache and no early data.
    cfg.ticketer = tickets;
    cfg.send_tls13_tickets = 1;
    // At most one when a client asks (RFC 9149): an agent's join asks for none.
    cfg.max_tls13_tickets = 1;
    cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    Ok(cfg)
}

enum Next {
    Close,
    Session(String),
}

impl Gateway {
    /// A gateway from its parts: what the network child builds from its init message.
    pub fn with_parts(
        cfg: crate::config::SessionsConfig,
        registry: Arc<crate::base::registry::Registry>,
        tls: rustls::ServerConfig,
        relay: Option<Arc<dyn CallSink>>,
    ) -> Self {
        Self {
            cfg,
            registry,
            tls: tokio_rustls::TlsAcceptor::from(Arc::new(tls)),
            relay,
            sources: Sources::default(),
        }
    }

    pub async fn serve(self, listener: TcpListener, mut stop: watch::Receiver<bool>) {
        let limit = Arc::new(Semaphore::new(self.cfg.max_connections as usize));
        // A place among the connections in their handshake is taken before `accept`: when all
        // are taken, new connections wait in the kernel's queue (in arrival order, their deadline
        // not yet running) rather than sharing the core with every other handshake until all of
        // them miss the deadline together and the work is lost (the reconnect storm).
        let handshakes = Arc::new(Semaphore::new(self.cfg.max_handshakes as usize));
        let this = Arc::new(self);
        loop {
            let handshake = tokio::select! {
                _ = stop.changed() => return,
                p = handshakes.clone().acquire_owned() => p.expect("the semaphore is never closed"),
            };
            tokio::select! {
                _ = stop.changed() => return,
                acc = listener.accept() => {
                    let Ok((stream, peer)) = acc else { continue };
                    let Ok(permit) = limit.clone().try_acquire_owned() else {
                        tracing::warn!(%peer, "gateway: connection limit reached; dropping a connection");
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let this = this.clone();
                    let stop = stop.clone();
                    tokio::spawn(async move {
                        let _permit = permit;
                        let per_source = this.cfg.max_connections_per_source;
                        let Some(_slot) = this.sources.open.enter(crate::base::limits::source_of(peer.ip()), per_source as usize) else {
                            tracing::debug!(%peer, "gateway: the source's connection limit is reached; closing");
                            return;
                        };
                        if let Err(e) = this.connection(stream, peer, stop, handshake).await {
                            tracing::debug!(%peer, error = %e, "gateway: connection ended");
                        }
                    });
                }
            }
        }
    }

    async fn connection(
        &self,
        stream: tokio::net::TcpStream,
        peer_addr: std::net::SocketAddr,
        stop: watch::Receiver<bool>,
        handshake: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<(), String> {
        let peer = peer_addr.to_string();
        let deadline = Duration::from_secs(self.cfg.request_deadline_seconds as u64);
        let first = tokio::time::timeout(deadline, async {
            let mut tls = self
                .tls
                .accept(stream)
                .await
                .map_err(|e| format!("TLS: {e}"))?;
            let frame = self.read(&mut tls).await?;
            Ok::<_, String>((tls, frame))
        })
        .await
        .map_err(|_| "too slow: no request within the deadline".to_string());
        drop(handshake);
        let first = first?;
        let (mut tls, frame) = first?;
        let (reply, next) = self.answer(&frame, &tls, peer, peer_addr.ip()).await;
        protocol::write_frame(&mut tls, &reply.to_bytes())
            .await
            .map_err(|e| e.to_string())?;
        if let Next::Session(node) = next {
            self.session(&mut tls, node, stop).await;
        }
        use tokio::io::AsyncWriteExt;
        let _ = tls.shutdown().await;
        Ok(())
    }

    /// Reads one frame; an oversize one is answered before the connection closes.
    async fn read(&self, tls: &mut TlsStream<tokio::net::TcpStream>) -> Result<Vec<u8>, String> {
        match protocol::read_frame(tls).await {
            Ok(f) => Ok(f),
            Err(protocol::FrameError::TooLarge(n)) => {
                let r = Reply::error(
                    "INVALID_INPUT",
                    &format!("frame of {n} bytes is larger than {}", protocol::MAX_FRAME),
                );
                let _ = protocol::write_frame(tls, &r.to_bytes()).await;
                Err("oversize frame".into())
            }
            Err(e) => Err(e.to_string()),
        }
    }

    fn parse(frame: &[u8]) -> Result<Request, Box<Reply>> {
        let req: Request = serde_json::from_slice(frame).map_err(|e| {
            Box::new(Reply::error(
                "INVALID_INPUT",
                &format!("malformed request: {e}"),
            ))
        })?;
        if !(PROTOCOL_MIN..=PROTOCOL_MAX).contains(&req.v) {
            return Err(Box::new(Reply::error(
                "INVALID_INPUT",
                &format!("protocol version {} is not supported; this gateway speaks {PROTOCOL_MIN} to {PROTOCOL_MAX}", req.v),
            )));
        }
        if req.operations() != 1 {
            return Err(Box::new(Reply::error(
                "INVALID_INPUT",
                "a request names exactly one operation",
            )));
        }
        Ok(req)
    }

    async fn call(&self, call: Call) -> Option<Outcome> {
        let msg = serde_json::to_vec(&call).expect("serializes");
        let out = self.relay.as_ref()?.call(msg).await;
        Some(serde_json::from_slice(&out).unwrap_or(Outcome::Busy))
    }

    fn peer_leaf(tls: &TlsStream<tokio::net::TcpStream>) -> Option<String> {
        tls.get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| crate::base::crypto::b64(c))
    }

    async fn answer(
        &self,
        frame: &[u8],
        tls: &TlsStream<tokio::net::TcpStream>,
        peer: String,
        source: std::net::IpAddr,
    ) -> (Reply, Next) {
        let req = match Self::parse(frame) {
            Ok(r) => r,
            Err(reply) => return (*reply, Next::Close),
        };
        let now = crate::base::clock::now();
        if req.ping.is_some() {
            return (
                Reply {
                    v: 1,
                    pong: Some(Clock { server_time: now }),
                    ..Default::default()
                },
                Next::Close,
            );
        }
        // A join, and the first round of a `tpm` or `x509pop` join, count against the source's
        // join rate.
        if (req.join.is_some() || req.tpm_challenge.is_some() || req.x509pop_challenge.is_some())
            && !self.sources.join_allowed(
                crate::base::limits::source_of(source),
                self.cfg.joins_per_source_per_minute,
            )
        {
            tracing::info!(%peer, "gateway: the source's join rate is exceeded");
            return (Reply::from_outcome(Outcome::Busy), Next::Close);
        }
        if let Some(join) = req.join {
            let out = self
                .call(Call::Join {
                    request: Box::new(join),
                    peer,
                })
                .await
                .unwrap_or(Outcome::InvalidConfig);
            return (Reply::from_outcome(out), Next::Close);
        }
        if let Some(challenge) = req.tpm_challenge {
            let out = self
                .call(Call::TpmChallenge {
                    request: challenge,
                    peer,
                })
                .await
                .unwrap_or(Outcome::InvalidConfig);
            return (Reply::from_challenge_outcome(out), Next::Close);
        }
        if req.x509pop_challenge.is_some() {
            // Issued by the JoinService, never here: the gateway is the untrusted hop.
            let out = self
                .call(Call::X509PopChallenge { peer })
                .await
                .unwrap_or(Outcome::InvalidConfig);
            return (Reply::from_x509pop_challenge_outcome(out), Next::Close);
        }
        if let Some(renew) = req.renew {
            return (self.renew(renew, tls, peer).await, Next::Close);
        }
        if let Some(hello) = req.hello {
            let refused = (
                Reply::error("ACCESS_DENIED", protocol::SESSION_REFUSED),
                Next::Close,
            );
            let Some(leaf) = Self::peer_leaf(tls) else {
                return refused;
            };
            return match self
                .call(Call::SessionOpen {
                    peer_leaf: leaf,
                    peer,
                    hello: hello.evidence,
                })
                .await
            {
                Some(Outcome::SessionOpened { node_id }) => {
                    let welcome = Welcome {
                        node_id: node_id.clone(),
                        heartbeat_seconds: self.cfg.heartbeat_seconds,
                        server_time: now,
                    };
                    (
                        Reply {
                            v: 1,
                            welcome: Some(welcome),
                            ..Default::default()
                        },
                        Next::Session(node_id),
                    )
                }
                Some(Outcome::Busy) => (
                    Reply::error("UNAVAILABLE", "the appliance is busy; retry"),
                    Next::Close,
                ),
                _ => refused,
            };
        }
        (
            Reply::error("INVALID_INPUT", "heartbeat outside a session"),
            Next::Close,
        )
    }

    async fn renew(
        &self,
        renew: protocol::RenewRequest,
        tls: &TlsStream<tokio::net::TcpStream>,
        peer: String,
    ) -> Reply {
        let Some(leaf) = Self::peer_leaf(tls) else {
            return Reply::error("ACCESS_DENIED", protocol::RENEW_REFUSED);
        };
        let out = self
            .call(Call::Renew {
                request: renew,
                peer_leaf: leaf,
                peer,
            })
            .await
            .unwrap_or(Outcome::InvalidConfig);
        Reply::from_renew_outcome(out)
    }

    /// A live session: heartbeats and renewals until the node goes quiet, leaves, or its identity
    /// is revoked.
    async fn session(
        &self,
        tls: &mut TlsStream<tokio::net::TcpStream>,
        node: String,
        mut stop: watch::Receiver<bool>,
    ) {
        let (id, mut closed) = self.registry.register(&node);
        let hb = self.cfg.heartbeat_seconds.max(1) as u64;
        let idle = Duration::from_secs(hb * 3);
        let mut last_seen = crate::base::clock::now();
        loop {
            tokio::select! {
                _ = closed.changed() => {
                    let r = Reply::error("ACCESS_DENIED", "the session was closed: the node's identity was revoked or replaced");
                    let _ = protocol::write_frame(tls, &r.to_bytes()).await;
                    break;
                }
                _ = stop.changed() => {
                    if self.relay.as_ref().is_some_and(|r| r.remote()) {
                        // In the network child: the session stays open, answering nothing,
                        // until the parent has recorded every session closed at once and ends
                        // the child. Its node then notices with all the others, just before
                        // the next appliance listens, instead of reconnecting into the
                        // stopping one (a restart under 19,800 sessions: 3,672 attempts reset).
                        std::future::pending::<()>().await;
                    }
                    break;
                }
                f = tokio::time::timeout(idle, self.read(tls)) => {
                    let Ok(Ok(frame)) = f else { break };
                    let reply = match Self::parse(&frame) {
                        Err(r) => *r,
                        Ok(req) if req.heartbeat.is_some() || req.ping.is_some() => {
                            let now = crate::base::clock::now();
                            if now - last_seen >= hb as i64 {
                                last_seen = now;
                                let _ = self.call(Call::SessionSeen { node_id: node.clone() }).await;
                            }
                            let c = Clock { server_time: now };
                            if req.ping.is_some() {
                                Reply { v: 1, pong: Some(c), ..Default::default() }
                            } else {
                                Reply { v: 1, ack: Some(c), ..Default::default() }
                            }
                        }
                        Ok(req) if req.renew.is_some() => {
                            self.renew(req.renew.expect("checked"), tls, node.clone()).await
                        }
                        Ok(_) => Reply::error("INVALID_INPUT", "a session carries heartbeat, ping and renew only"),
                    };
                    if protocol::write_frame(tls, &reply.to_bytes()).await.is_err() {
                        break;
                    }
                }
            }
        }
        if self.registry.unregister(&node, id) {
            let _ = self.call(Call::SessionClosed { node_id: node }).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{IpAddr, Ipv6Addr};
    use std::time::{Duration, Instant};

    fn addr(i: u32) -> IpAddr {
        IpAddr::V6(Ipv6Addr::new(
            0x2001,
            0xdb8,
            0,
            0,
            0,
            0,
            (i >> 16) as u16,
            i as u16,
        ))
    }

    #[test]
    fn a_sources_joins_are_limited_and_full_buckets_forgotten_at_most_once_a_second() {
        let s = Sources::default();
        let t0 = Instant::now();
        // Two a minute: the third join within the minute is refused, one more after 30 s.
        assert!(s.join_allowed_at(addr(0), 2, t0));
        assert!(s.join_allowed_at(addr(0), 2, t0));
        assert!(!s.join_allowed_at(addr(0), 2, t0));
        assert!(s.join_allowed_at(addr(0), 2, t0 + Duration::from_secs(31)));
        // Past BUCKETS_KEPT sources, one pass forgets the full buckets, then none for a second.
        for i in 1..=(BUCKETS_KEPT as u32 + 1) {
            assert!(s.join_allowed_at(addr(i), 600, t0));
        }
        let len = |s: &Sources| s.joins.lock().unwrap().by_source.len();
        // The pass made when the map grew past BUCKETS_KEPT found no full bucket.
        assert_eq!(len(&s), BUCKETS_KEPT + 2);
        // A second on, every bucket of 600 a minute is full again; the next pass forgets them.
        let t1 = t0 + Duration::from_millis(1_100);
        assert!(s.join_allowed_at(addr(1_000_000), 600, t1));
        assert!(len(&s) <= 2, "{}", len(&s));
        for i in 2_000_000..(2_000_000 + BUCKETS_KEPT as u32 + 10) {
            assert!(s.join_allowed_at(addr(i), 600, t1 + Duration::from_millis(500)));
        }
        assert!(len(&s) > BUCKETS_KEPT, "no second pass within the second");
        assert!(s.join_allowed_at(addr(3_000_000), 600, t1 + Duration::from_millis(1_800)));
        assert!(len(&s) <= 2, "{}", len(&s));
        // A source that spent its bucket is not forgotten by a pass: still refused.
        let t2 = t1 + Duration::from_millis(1_800);
        for _ in 0..2 {
            s.join_allowed_at(addr(7), 2, t2);
        }
        assert!(!s.join_allowed_at(addr(7), 2, t2));
    }
}
