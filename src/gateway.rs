//! The gateway: the TLS 1.3 listener agents dial. It relays joins to the JoinService through the
//! message interface ([`JoinHandle::call`]: bytes in, bytes out), and never holds a signing key,
//! never opens a seal, never parses a token.
//!
//! Limits: at most [`MAX_CONNECTIONS`] connections at once; a connection must finish its TLS
//! handshake and send its request within [`REQUEST_DEADLINE`]; frames are at most
//! [`protocol::MAX_FRAME`] bytes.

use crate::app::{App, PROTOCOL_MAX, PROTOCOL_MIN};
use crate::joinservice::JoinHandle;
use crate::protocol::{self, JoinCall, JoinOutcome, Reply, Request};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

pub const MAX_CONNECTIONS: usize = 4096;
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(10);

pub struct Gateway {
    tls: tokio_rustls::TlsAcceptor,
    join: Option<JoinHandle>,
}

/// The rustls provider every TLS endpoint of bca uses: aws-lc-rs.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// TLS 1.3 only, the gateway leaf and the serving CA as its chain, ALPN `bca/1`.
pub fn server_config(
    leaf: &[u8],
    ca: &[u8],
    key_pkcs8: &[u8],
) -> Result<rustls::ServerConfig, String> {
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(
            vec![
                CertificateDer::from(leaf.to_vec()),
                CertificateDer::from(ca.to_vec()),
            ],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key_pkcs8.to_vec())),
        )
        .map_err(|e| format!("the gateway certificate: {e}"))?;
    cfg.alpn_protocols = vec![protocol::ALPN.to_vec()];
    Ok(cfg)
}

impl Gateway {
    /// `join` is `None` when no JoinService is configured: every join then answers `INVALID_CONFIG`.
    pub fn new(
        app: Arc<App>,
        gateway_key_pkcs8: &[u8],
        join: Option<JoinHandle>,
    ) -> Result<Self, String> {
        let cfg = server_config(&app.pki.gateway, &app.pki.serving_ca, gateway_key_pkcs8)?;
        Ok(Self {
            tls: tokio_rustls::TlsAcceptor::from(Arc::new(cfg)),
            join,
        })
    }

    pub async fn serve(self, listener: TcpListener, mut stop: watch::Receiver<bool>) {
        let limit = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let this = Arc::new(self);
        loop {
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
                    tokio::spawn(async move {
                        let _permit = permit;
                        match tokio::time::timeout(REQUEST_DEADLINE, this.connection(stream, peer.to_string())).await {
                            Ok(Err(e)) => tracing::debug!(%peer, error = %e, "gateway: connection ended"),
                            Err(_) => tracing::debug!(%peer, "gateway: connection too slow; closed"),
                            Ok(Ok(())) => {}
                        }
                    });
                }
            }
        }
    }

    async fn connection(&self, stream: tokio::net::TcpStream, peer: String) -> Result<(), String> {
        let mut tls = self
            .tls
            .accept(stream)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        let frame = match protocol::read_frame(&mut tls).await {
            Ok(f) => f,
            Err(protocol::FrameError::TooLarge(n)) => {
                let r = Reply::error(
                    "INVALID_INPUT",
                    &format!("frame of {n} bytes is larger than {}", protocol::MAX_FRAME),
                );
                let _ = protocol::write_frame(&mut tls, &r.to_bytes()).await;
                return Err("oversize frame".into());
            }
            Err(e) => return Err(e.to_string()),
        };
        let reply = self.answer(&frame, peer).await;
        protocol::write_frame(&mut tls, &reply.to_bytes())
            .await
            .map_err(|e| e.to_string())?;
        use tokio::io::AsyncWriteExt;
        let _ = tls.shutdown().await;
        Ok(())
    }

    async fn answer(&self, frame: &[u8], peer: String) -> Reply {
        let req: Request = match serde_json::from_slice(frame) {
            Ok(r) => r,
            Err(e) => return Reply::error("INVALID_INPUT", &format!("malformed request: {e}")),
        };
        if !(PROTOCOL_MIN..=PROTOCOL_MAX).contains(&req.v) {
            return Reply::error(
                "INVALID_INPUT",
                &format!("protocol version {} is not supported; this gateway speaks {PROTOCOL_MIN} to {PROTOCOL_MAX}", req.v),
            );
        }
        let Some(join) = req.join else {
            return Reply::error("INVALID_INPUT", "the request names no operation");
        };
        let Some(handle) = &self.join else {
            return Reply::from_outcome(JoinOutcome::InvalidConfig);
        };
        let msg = serde_json::to_vec(&JoinCall {
            request: join,
            peer,
        })
        .expect("serializes");
        let out = handle.call(&msg).await;
        Reply::from_outcome(serde_json::from_slice(&out).unwrap_or(JoinOutcome::Busy))
    }
}
