//! The agent's side of TLS: the gateway is authenticated by verifying its presented chain up to
//! the CA whose SubjectPublicKeyInfo hash is the pinned `serving_ca_spki_pin` (signatures,
//! validity and the gateway's name, by webpki), not by finding the pin somewhere in the chain.

use crate::base::crypto;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, Error, SignatureScheme};
use std::sync::Arc;

#[derive(Debug)]
pub struct PinnedCaVerifier {
    pin: String,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl PinnedCaVerifier {
    pub fn new(pin: &str) -> Self {
        Self {
            pin: pin.to_string(),
            provider: crate::base::net::provider(),
        }
    }
}

impl ServerCertVerifier for PinnedCaVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, Error> {
        // The trust anchor is the presented certificate whose key hashes to the pin; the leaf must
        // then chain to it by signature, with every usual check.
        let anchor = intermediates
            .iter()
            .find(|c| {
                crate::proto::x509::cert_spki(c)
                    .map(|s| crypto::spki_pin(&s) == self.pin)
                    .unwrap_or(false)
            })
            .ok_or_else(|| {
                Error::General("the gateway presented no CA matching serving_ca_spki_pin".into())
            })?;
        let mut roots = rustls::RootCertStore::empty();
        roots.add(anchor.clone())?;
        let others: Vec<CertificateDer<'_>> = intermediates
            .iter()
            .filter(|c| *c != anchor)
            .cloned()
            .collect();
        let inner = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            self.provider.clone(),
        )
        .build()
        .map_err(|e| Error::General(e.to_string()))?;
        inner.verify_server_cert(end_entity, &others, server_name, ocsp, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A TLS 1.3 client configuration that trusts only the pinned serving CA.
pub fn client_config(serving_ca_pin: &str) -> Result<rustls::ClientConfig, String> {
    client_config_with(serving_ca_pin, None)
}

/// The same, presenting a node certificate chain and its key (PKCS#8) for mTLS.
pub fn client_config_with(
    serving_ca_pin: &str,
    identity: Option<(Vec<Vec<u8>>, &[u8])>,
) -> Result<rustls::ClientConfig, String> {
    let identity = match identity {
        None => None,
        Some((chain, pkcs8)) => {
            let key = crate::base::net::provider()
                .key_provider
                .load_private_key(rustls::pki_types::PrivateKeyDer::Pkcs8(
                    pkcs8.to_vec().into(),
                ))
                .map_err(|e| format!("the node identity: {e}"))?;
            Some((chain, key))
        }
    };
    client_config_signer(serving_ca_pin, identity)
}

/// A node's certificate chain (DER, leaf first) and the key that signs its handshakes.
pub type ClientIdentity = (Vec<Vec<u8>>, Arc<dyn rustls::sign::SigningKey>);

/// The same, with a key that signs through `key` (a TPM-held key signs in the TPM).
pub fn client_config_signer(
    serving_ca_pin: &str,
    identity: Option<ClientIdentity>,
) -> Result<rustls::ClientConfig, String> {
    let builder = rustls::ClientConfig::builder_with_provider(crate::base::net::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| e.to_string())?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedCaVerifier::new(serving_ca_pin)));
    let mut cfg = match identity {
        None => {
            // A join or a probe: nothing to resume, so it asks for no session ticket (RFC 9149),
            // which the gateway then does not make.
            let mut cfg = builder.with_no_client_auth();
            cfg.resumption = rustls::client::Resumption::disabled();
            cfg.send_ticket_request = Some(rustls::client::TicketRequest {
                new_session_count: 0,
                resumption_count: 0,
            });
            cfg
        }
        Some((chain, key)) => {
            let certified = rustls::sign::CertifiedKey::new(
                chain.into_iter().map(CertificateDer::from).collect(),
                key,
            );
            builder.with_client_cert_resolver(Arc::new(Always(Arc::new(certified))))
        }
    };
    cfg.alpn_protocols = vec![crate::proto::protocol::ALPN.to_vec()];
    Ok(cfg)
}

/// Presents the one node identity whatever the server asks.
#[derive(Debug)]
struct Always(Arc<rustls::sign::CertifiedKey>);

impl rustls::client::ResolvesClientCert for Always {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}
