//! `bca agent run` and `bca agent doctor`: a joined node keeps its session, renews at about 60%
//! of its certificate's lifetime, and reconnects with capped exponential backoff and full jitter.
//! A renewal writes the new identity as `agent::identity` says, so a crash at any point leaves a
//! loadable one.

use crate::agent::identity;
/// The identity on disk, as callers of `run` have always named it.
pub use crate::agent::identity::{load_identity, write_renewed, Loaded};
use crate::agent::nodekey::NodeKey;
use crate::agent::{self, GatewayStream};
use crate::base::crypto;
use crate::base::error::{ApiError, ApiResult, Code};
use crate::proto::agent_config::AgentConfig;
use crate::proto::claims::Claims;
use crate::proto::protocol::{
    renew_pop_message, Empty, Hello, RenewRequest, Reply, Request, RENEW_POP_PURPOSE,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Renews over an mTLS connection and writes the new identity; returns the new leaf's serial.
pub async fn renew(
    cfg: &AgentConfig,
    data_dir: &Path,
    cur: &Loaded,
    s: &mut GatewayStream,
) -> ApiResult<(String, Option<AgentConfig>)> {
    let key = identity::next_key(cur)?;
    let csr = key.csr()?;
    let key_attestation = identity::key_attestation(cur, &key, &csr)?;
    let now = crate::base::clock::now();
    let msg = renew_pop_message(&crypto::sha256(&csr), &cur.identity.node_id, now);
    let req = Request {
        v: 1,
        renew: Some(RenewRequest {
            csr: crypto::b64(&csr),
            chain: cur.identity.certificate_chain.clone(),
            client_time: now,
            pop_sig: crypto::b64(&cur.key.sign(RENEW_POP_PURPOSE, &msg)?),
            key_attestation,
        }),
        ..Default::default()
    };
    let raw = agent::roundtrip(cfg, s, &serde_json::to_vec(&req).expect("serializes")).await?;
    let reply: Reply = serde_json::from_slice(&raw)
        .map_err(|e| ApiError::internal(format!("malformed answer: {e}")))?;
    if let Some(e) = reply.error {
        return Err(ApiError::new(Code::AccessDenied, e.message));
    }
    let resp = reply
        .renew_response
        .ok_or_else(|| ApiError::internal("the answer carries no renewal"))?;
    let (body, learned) =
        identity::install(cfg, data_dir, cur, (&key, &csr), &resp, "the renewal")?;
    let serial = body
        .certificate_chain
        .first()
        .and_then(|p| {
            crate::proto::x509::pem_decode_all(p, "CERTIFICATE")
                .into_iter()
                .next()
        })
        .and_then(|d| crate::proto::x509::parse_node_leaf(&d))
        .map(|l| l.serial_hex)
        .unwrap_or_default();
    Ok((serial, learned))
}

/// Full jitter: a random delay in `[0, min(cap, base * 2^attempt)]`.
pub fn backoff(attempt: u32, base: Duration, cap: Duration) -> Duration {
    let ceiling = base.saturating_mul(1u32 << attempt.min(20)).min(cap);
    let mut r = [0u8; 8];
    crypto::fill_random(&mut r);
    let frac = (u64::from_le_bytes(r) >> 11) as f64 / (1u64 << 53) as f64;
    ceiling.mul_f64(frac)
}

pub struct RunOptions {
    pub config: PathBuf,
    pub data_dir: PathBuf,
    /// Claims from a JSON file instead of this machine's (simulated machines, tests).
    pub claims: Option<PathBuf>,
    pub backoff_base: Duration,
    pub backoff_cap: Duration,
}

enum End {
    /// With a configuration to save when the answer taught new join-signing pins.
    Renewed(Option<AgentConfig>),
    Lost(String),
}

/// `bca agent run`: until SIGTERM or SIGINT.
pub fn run(o: RunOptions) -> ApiResult<()> {
    let mut cfg = AgentConfig::load(&o.config)?;
    // What the hello reports for a pool's acceptance checks, read once.
    let claims = match &o.claims {
        Some(p) => crate::agent::read_claims(p)?,
        None => crate::agent::collect_claims(),
    };
    agent::apply_learned(&mut cfg, &o.data_dir);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ApiError::internal)?;
    rt.block_on(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(ApiError::internal)?;
        let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).map_err(ApiError::internal)?;
        let mut attempt = 0u32;
        // One TLS configuration per identity (and serving CA pin): it keeps the gateway's last
        // session ticket, so a reconnect resumes; a renewed identity starts a new one.
        let mut tls: Option<(Vec<Vec<u8>>, String, Arc<rustls::ClientConfig>)> = None;
        loop {
            let cur = load_identity(&o.data_dir)?;
            let now = crate::base::clock::now();
            if cur.not_after <= now {
                // Expired while offline: come back by `x509pop`, once; then the way back is a
                // new join, by hand.
                let advice = crate::agent::x509pop::expired_advice(&cur, now);
                let (c, d) = (cfg.clone(), o.data_dir.clone());
                match tokio::task::spawn_blocking(move || crate::agent::x509pop::rejoin(&c, &d)).await {
                    Ok(Ok(node)) => {
                        tracing::info!(%node, "the expired certificate was replaced by an x509pop re-join");
                        agent::apply_learned(&mut cfg, &o.data_dir);
                        continue;
                    }
                    // The network is down or the appliance busy: try again later, as a lost
                    // session does. A refusal ends here: the way back is then by hand.
                    Ok(Err(e)) if e.code == Code::Unavailable => {
                        let delay = backoff(attempt, o.backoff_base, o.backoff_cap);
                        tracing::warn!(node = %cur.identity.node_id, error = %e.message, attempt, delay_ms = delay.as_millis() as u64, "the certificate expired; the x509pop re-join did not reach the appliance; retrying");
                        attempt = attempt.saturating_add(1);
                        tokio::select! {
                            _ = tokio::time::sleep(delay) => {}
                            _ = term.recv() => return Ok(()),
                            _ = int.recv() => return Ok(()),
                        }
                        continue;
                    }
                    Ok(Err(e)) => {
                        return Err(ApiError::invalid_state(format!("{advice}; the x509pop re-join failed: {}", e.message)))
                    }
                    Err(e) => return Err(ApiError::internal(e)),
                }
            }
            let config = match &tls {
                Some((chain, pin, c)) if *chain == cur.chain_der && *pin == cfg.serving_ca_spki_pin => c.clone(),
                _ => {
                    let c = agent::identity_tls(&cfg, cur.chain_der.clone(), &cur.key)?;
                    tls = Some((cur.chain_der.clone(), cfg.serving_ca_spki_pin.clone(), c.clone()));
                    c
                }
            };
            let end = tokio::select! {
                e = session(&cfg, &o.data_dir, &cur, config, &mut attempt, &claims) => e,
                _ = term.recv() => return Ok(()),
                _ = int.recv() => return Ok(()),
            };
            match end {
                End::Renewed(None) => continue,
                End::Renewed(Some(learned)) => {
                    // In the data directory (the config's is read-only under the agent's unit);
                    // kept in memory even if that write fails.
                    if let Err(e) = agent::save_learned(&o.data_dir, &learned) {
                        tracing::warn!(error = %e, "cannot save the learned join-signing pins");
                    }
                    tracing::info!(
                        current = %learned.join_signing_key_pin,
                        next = ?learned.join_signing_next_key_pin,
                        "join-signing pins updated from a signed renewal"
                    );
                    cfg = learned;
                    continue;
                }
                End::Lost(why) => {
                    let delay = backoff(attempt, o.backoff_base, o.backoff_cap);
                    tracing::warn!(node = %cur.identity.node_id, reason = %why, attempt, delay_ms = delay.as_millis() as u64, "session lost; reconnecting");
                    attempt = attempt.saturating_add(1);
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = term.recv() => return Ok(()),
                        _ = int.recv() => return Ok(()),
                    }
                }
            }
        }
    })
}

async fn session(
    cfg: &AgentConfig,
    data_dir: &Path,
    cur: &Loaded,
    tls: Arc<rustls::ClientConfig>,
    attempt: &mut u32,
    claims: &Claims,
) -> End {
    let mut s = match agent::connect_with(cfg, tls).await {
        Ok(s) => s,
        Err(e) => return End::Lost(e.message),
    };
    let resumed = s.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
    let evidence = match hello_evidence(&cur.identity.node_id, &cur.key, claims) {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::warn!(error = %e, "cannot sign the hello's evidence; sending none");
            None
        }
    };
    let hello = Request {
        v: 1,
        hello: Some(Hello {
            node_id: cur.identity.node_id.clone(),
            evidence,
        }),
        ..Default::default()
    };
    let welcome = match agent::roundtrip(
        cfg,
        &mut s,
        &serde_json::to_vec(&hello).expect("serializes"),
    )
    .await
    {
        Ok(raw) => match serde_json::from_slice::<Reply>(&raw) {
            Ok(Reply {
                welcome: Some(w), ..
            }) => w,
            Ok(Reply { error: Some(e), .. }) => {
                return End::Lost(format!("{}: {}", e.code, e.message))
            }
            _ => return End::Lost("no welcome".into()),
        },
        Err(e) => return End::Lost(e.message),
    };
    *attempt = 0;
    tracing::info!(node = %welcome.node_id, skew = welcome.server_time - crate::base::clock::now(), resumed, "session open");
    let hb = Duration::from_secs(welcome.heartbeat_seconds.max(1) as u64);
    let lifetime = (cur.not_after - cur.not_before).max(1);
    let renew_at = cur.not_before + lifetime * 6 / 10;
    let mut next_renew = renew_at;
    loop {
        let now = crate::base::clock::now();
        if now >= next_renew {
            match renew(cfg, data_dir, cur, &mut s).await {
                Ok((serial, learned)) => {
                    tracing::info!(node = %cur.identity.node_id, serial = %serial, "renewed");
                    return End::Renewed(learned);
                }
                Err(e) if e.code == Code::AccessDenied => {
                    tracing::error!(node = %cur.identity.node_id, error = %e, "renewal refused; retrying later");
                    next_renew = now + hb.as_secs() as i64 * 4;
                }
                Err(e) => return End::Lost(e.message),
            }
        }
        let until_renew =
            Duration::from_secs((next_renew - crate::base::clock::now()).max(0) as u64);
        // Between heartbeats, watch the connection: the appliance sends nothing unasked, so any
        // read that completes is its close (a restart, a revocation): reconnect at once instead
        // of finding out at the next heartbeat.
        let mut probe = [0u8; 1];
        tokio::select! {
            _ = tokio::time::sleep(hb.min(until_renew.max(Duration::from_millis(10)))) => {}
            r = tokio::io::AsyncReadExt::read(&mut s, &mut probe) => {
                return End::Lost(match r {
                    Ok(0) => "the appliance closed the session".into(),
                    Ok(_) => "the appliance sent an unexpected frame".into(),
                    Err(e) => e.to_string(),
                });
            }
        }
        if crate::base::clock::now() >= next_renew {
            continue;
        }
        let beat = Request {
            v: 1,
            heartbeat: Some(Empty {}),
            ..Default::default()
        };
        match agent::roundtrip(cfg, &mut s, &serde_json::to_vec(&beat).expect("serializes")).await {
            Ok(raw) => match serde_json::from_slice::<Reply>(&raw) {
                Ok(Reply { ack: Some(_), .. }) => {}
                Ok(Reply { error: Some(e), .. }) => {
                    return End::Lost(format!("{}: {}", e.code, e.message))
                }
                _ => return End::Lost("unexpected answer to a heartbeat".into()),
            },
            Err(e) => return End::Lost(e.message),
        }
    }
}

/// `bca agent doctor`: each check prints `ok` or `FAIL` with what to do; false when one failed.
/// `tpm` names the machine's TPM (default `/dev/tpmrm0`).
pub fn doctor(config: &Path, data_dir: &Path, tpm: Option<&crate::tpm::Tcti>) -> bool {
    let mut ok = true;
    let mut line = |good: bool, what: &str, msg: String| {
        println!("{} {what}: {msg}", if good { "ok  " } else { "FAIL" });
        ok &= good;
    };
    let cfg = match AgentConfig::load(config) {
        Ok(c) => {
            line(
                true,
                "config",
                format!(
                    "{} (gateway {}, site {})",
                    config.display(),
                    c.gateway_url,
                    c.site
                ),
            );
            c
        }
        Err(e) => {
            line(false, "config", e.message);
            return false;
        }
    };
    match cfg.join_encryption_point(config) {
        Ok(_) => line(
            true,
            "pins",
            "join-encryption.jwk matches join_encryption_key_pin".into(),
        ),
        Err(e) => line(false, "pins", e.message),
    }
    match load_identity(data_dir) {
        Ok(l) if l.not_after <= crate::base::clock::now() => line(
            false,
            "identity",
            crate::agent::x509pop::expired_advice(&l, crate::base::clock::now()),
        ),
        Ok(l) => line(
            true,
            "identity",
            format!(
                "node {} ({}), certificate valid until {}",
                l.identity.node_id,
                l.identity.role,
                crate::base::clock::rfc3339(l.not_after)
            ),
        ),
        Err(e) => line(false, "identity", e.message),
    }
    let ping = Request {
        v: 1,
        ping: Some(Empty {}),
        ..Default::default()
    };
    let sent = crate::base::clock::now();
    match agent::exchange_raw(&cfg, &serde_json::to_vec(&ping).expect("serializes"))
        .map(|r| serde_json::from_slice::<Reply>(&r))
    {
        Ok(Ok(Reply { pong: Some(c), .. })) => {
            line(
                true,
                "gateway",
                format!("{} answers under the pinned serving CA", cfg.gateway_url),
            );
            let skew = c.server_time - sent;
            if skew.abs() > 30 {
                line(false, "clock", format!("this machine's clock is {skew} s off the appliance's; renewals are refused beyond 60 s: fix NTP"));
            } else {
                line(
                    true,
                    "clock",
                    format!("within {} s of the appliance", skew.abs()),
                );
            }
        }
        Ok(_) => line(
            false,
            "gateway",
            "the gateway answered, but not a pong".into(),
        ),
        Err(e) => {
            line(false, "gateway", e.message);
            line(false, "clock", "unknown: the gateway did not answer".into());
        }
    }
    let (good, msg) = tpm_check(tpm);
    line(good, "tpm", msg);
    ok
}

/// The machine's TPM for `doctor`: none is fine (token and discovery joins need none); one that
/// is there must answer and derive bca's AK.
fn tpm_check(tpm: Option<&crate::tpm::Tcti>) -> (bool, String) {
    let default: crate::tpm::Tcti = crate::tpm::DEFAULT_TCTI
        .parse()
        .expect("the default parses");
    let tcti = tpm.unwrap_or(&default);
    if let (None, crate::tpm::Tcti::Device(p)) = (tpm, tcti) {
        if !p.exists() {
            return (
                true,
                format!(
                    "none at {} (joins with a token or by discovery need none; --attestor tpm \
                     would)",
                    p.display()
                ),
            );
        }
    }
    let checked = crate::tpm::Tpm::open(tcti).and_then(|mut t| {
        let id = t.identity()?;
        let (ak, _) = t.ak_public()?;
        Ok((id, ak))
    });
    match checked {
        Ok((id, ak)) => (
            true,
            format!(
                "{tcti} answers ({} {}, firmware {}); bca's AK {}",
                id.manufacturer,
                id.vendor,
                id.firmware,
                crate::base::crypto::hex(&ak.name)
            ),
        ),
        Err(e) => (false, format!("{e}")),
    }
}

/// Sends one heartbeat-free `Hello` and returns the reply (for tests and doctor-like probes).
/// The hello's evidence: this clock and `claims`, signed by the node key (purpose
/// `bca hello v1`), which a pool's acceptance checks read.
pub fn hello_evidence(
    node_id: &str,
    key: &NodeKey,
    claims: &Claims,
) -> ApiResult<crate::proto::protocol::HelloEvidence> {
    let bytes = serde_json::to_vec(claims).expect("serializes");
    let now = crate::base::clock::now();
    let msg = crate::proto::protocol::hello_message(node_id, now, &crypto::sha256(&bytes));
    Ok(crate::proto::protocol::HelloEvidence {
        client_time: now,
        claims: crypto::b64(&bytes),
        sig: crypto::b64(&key.sign(crate::proto::protocol::HELLO_PURPOSE, &msg)?),
    })
}

/// A session's `Hello` with no evidence (tests of the session itself).
pub async fn hello(cfg: &AgentConfig, cur: &Loaded) -> ApiResult<(Reply, GatewayStream)> {
    let mut s = agent::connect_as(cfg, cur.chain_der.clone(), &cur.key).await?;
    let hello = Request {
        v: 1,
        hello: Some(Hello::default()),
        ..Default::default()
    };
    let raw = agent::roundtrip(
        cfg,
        &mut s,
        &serde_json::to_vec(&hello).expect("serializes"),
    )
    .await?;
    let r = serde_json::from_slice(&raw).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((r, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_is_capped_and_jittered() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(2);
        let mut seen = std::collections::HashSet::new();
        for attempt in 0..30 {
            let d = backoff(attempt, base, cap);
            assert!(d <= cap);
            assert!(d <= base * 2u32.pow(attempt.min(20)));
            seen.insert(d.as_micros());
        }
        assert!(seen.len() > 20, "no jitter");
    }
}
