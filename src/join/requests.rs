//! Join requests, as the `discovery` and `tpm` attestors keep them: a machine waiting for an
//! operator, its signed deferral, a rejection that refuses its CSR, and expiry.

use crate::base::crypto;
use crate::join::issue::Signer;
use crate::join::site::Site;
use crate::proto::protocol::{JoinDeferral, JoinResponse, JOIN_DEFERRAL_PURPOSE};

pub use crate::store::requests::{expire, open as open_request, rejected};

pub(crate) fn deferral(
    site: &Site,
    signer: &Signer,
    request_id: &str,
    csr_sha256: &[u8; 32],
) -> JoinResponse {
    let body = JoinDeferral {
        request_id: request_id.to_string(),
        state: "pending".into(),
        retry_after_seconds: site.config.discovery.retry_after_seconds,
        csr_sha256: crypto::hex(csr_sha256),
        site_id: site.config.site_id.clone(),
    };
    signer.signed(JOIN_DEFERRAL_PURPOSE, &body)
}
