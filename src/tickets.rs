//! TLS 1.3 session tickets that survive a restart of the appliance.
//!
//! A node's agent keeps its session open for as long as both sides run. When the appliance
//! restarts (an upgrade, a crash), every node reconnects at once; a full handshake costs the
//! gateway the client certificate's verification and a signature each (and the agent the same).
//! A resumed handshake skips both: the gateway issues one ticket per full handshake and accepts
//! it back, after a restart too, as long as the ticket's key period (or the next one) is current.
//!
//! Decisions:
//! - **No state on disk.** The ticket keys are derived (HKDF-SHA256) from the node CA's private
//!   key, which `serve` already loads: a ticket asserts a node's certificate on the node CA's
//!   behalf, so it rests on the same secret, and a new node CA ends every ticket. The network
//!   child receives only the derived root, never the CA key.
//! - **Key periods of 12 hours.** A ticket is sealed (AES-256-GCM, a random nonce, the period in
//!   the clear and authenticated) under the key of the period it was made in and is accepted in
//!   that period and the next: 12 to 24 hours, which the ticket's announced lifetime says
//!   exactly. An agent reconnects with a full handshake after each renewal, so its ticket is at
//!   most one renewal interval old when the appliance restarts.
//! - **What resumption does not skip.** The handshake is `psk_dhe_ke` (rustls offers no other):
//!   fresh ECDHE, so traffic keys stay forward secret. A resumed connection carries the client
//!   certificate of the handshake that made the ticket, unverified again by webpki; every request
//!   that uses it (`hello`, `renew`) looks the exact certificate up in `node_certs` and refuses
//!   it when revoked, superseded, expired or retired, as it does after a full handshake. No early
//!   data is accepted.
//! - **What a leaked root allows.** Forged tickets: a connection claiming any node certificate,
//!   which the network child can already claim to the parent. A renewal still needs the node key's
//!   proof of possession, so no certificate can be obtained with a ticket.

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use aws_lc_rs::hkdf;
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::sync::Mutex;
use zeroize::Zeroizing;

/// How long one ticket key seals new tickets.
pub const PERIOD_SECONDS: i64 = 12 * 3600;

/// The period in the clear, then the nonce, then the sealed session and its tag.
const HEADER: usize = 8 + NONCE_LEN;
const TAG: usize = 16;

/// The secret every ticket key is derived from.
#[derive(Clone)]
pub struct TicketRoot(Zeroizing<[u8; 32]>);

impl TicketRoot {
    /// The root of the node CA whose private key (PKCS#8) is `node_ca_pkcs8`.
    pub fn derive(node_ca_pkcs8: &[u8]) -> Self {
        let mut out = Zeroizing::new([0u8; 32]);
        hkdf::Salt::new(hkdf::HKDF_SHA256, b"bca gateway session tickets")
            .extract(node_ca_pkcs8)
            .expand(&[b"root v1"], hkdf::HKDF_SHA256)
            .and_then(|okm| okm.fill(&mut out[..]))
            .expect("32 bytes of HKDF-SHA256");
        Self(out)
    }

    fn key(&self, period: i64) -> LessSafeKey {
        let mut k = Zeroizing::new([0u8; 32]);
        let info = period.to_be_bytes();
        hkdf::Salt::new(hkdf::HKDF_SHA256, b"bca gateway ticket key")
            .extract(&self.0[..])
            .expand(&[&info], hkdf::HKDF_SHA256)
            .and_then(|okm| okm.fill(&mut k[..]))
            .expect("32 bytes of HKDF-SHA256");
        LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &k[..]).expect("a 32-byte key"))
    }
}

impl std::fmt::Debug for TicketRoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TicketRoot(..)")
    }
}

/// Base64 in the parent's init message to the network child (over their socketpair only).
impl Serialize for TicketRoot {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&Zeroizing::new(crate::crypto::b64(&self.0[..])))
    }
}

impl<'de> Deserialize<'de> for TicketRoot {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = Zeroizing::new(String::deserialize(d)?);
        let raw = Zeroizing::new(
            crate::crypto::b64_decode(&s)
                .ok_or_else(|| serde::de::Error::custom("the ticket root is not base64"))?,
        );
        let mut out = Zeroizing::new([0u8; 32]);
        if raw.len() != out.len() {
            return Err(serde::de::Error::custom("the ticket root is not 32 bytes"));
        }
        out.copy_from_slice(&raw);
        Ok(Self(out))
    }
}

/// The gateway's ticketer (rustls' `ProducesTickets`).
pub struct Tickets {
    root: TicketRoot,
    /// The keys of the periods in use, derived once each (at most three kept).
    keys: Mutex<Vec<(i64, std::sync::Arc<LessSafeKey>)>>,
    rng: SystemRandom,
}

impl std::fmt::Debug for Tickets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tickets(..)")
    }
}

fn period_of(now: i64) -> i64 {
    now.div_euclid(PERIOD_SECONDS)
}

impl Tickets {
    pub fn new(root: TicketRoot) -> Self {
        Self {
            root,
            keys: Mutex::new(Vec::new()),
            rng: SystemRandom::new(),
        }
    }

    fn key(&self, period: i64) -> std::sync::Arc<LessSafeKey> {
        let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, k)) = keys.iter().find(|(p, _)| *p == period) {
            return k.clone();
        }
        let k = std::sync::Arc::new(self.root.key(period));
        keys.push((period, k.clone()));
        if keys.len() > 3 {
            // Forget the oldest period's key.
            let oldest = keys
                .iter()
                .enumerate()
                .min_by_key(|(_, (p, _))| *p)
                .map(|(i, _)| i)
                .expect("not empty");
            keys.swap_remove(oldest);
        }
        k
    }

    /// Seconds a ticket sealed at `now` is accepted for: to the end of the next period.
    pub fn lifetime_at(now: i64) -> u32 {
        ((period_of(now) + 2) * PERIOD_SECONDS - now) as u32
    }

    pub fn seal_at(&self, plain: &[u8], now: i64) -> Option<Vec<u8>> {
        let period = period_of(now);
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(HEADER + plain.len() + TAG);
        out.extend_from_slice(&period.to_be_bytes());
        out.extend_from_slice(&nonce);
        let mut body = plain.to_vec();
        self.key(period)
            .seal_in_place_append_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(&out[..HEADER]),
                &mut body,
            )
            .ok()?;
        out.extend_from_slice(&body);
        Some(out)
    }

    /// The session a ticket sealed, when its key's period is current or the one before, and
    /// nothing in it was changed.
    pub fn open_at(&self, ticket: &[u8], now: i64) -> Option<Vec<u8>> {
        if ticket.len() < HEADER + TAG {
            return None;
        }
        let period = i64::from_be_bytes(ticket[..8].try_into().ok()?);
        let current = period_of(now);
        if period != current && period.checked_add(1) != Some(current) {
            return None;
        }
        let nonce = Nonce::try_assume_unique_for_key(&ticket[8..HEADER]).ok()?;
        let mut body = ticket[HEADER..].to_vec();
        let plain = self
            .key(period)
            .open_in_place(nonce, Aad::from(&ticket[..HEADER]), &mut body)
            .ok()?
            .len();
        body.truncate(plain);
        Some(body)
    }
}

impl rustls::server::ProducesTickets for Tickets {
    fn enabled(&self) -> bool {
        true
    }

    fn lifetime(&self) -> u32 {
        Self::lifetime_at(crate::clock::now())
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        self.seal_at(plain, crate::clock::now())
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.open_at(cipher, crate::clock::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tickets(ca_key: &[u8]) -> Tickets {
        Tickets::new(TicketRoot::derive(ca_key))
    }

    #[test]
    fn a_ticket_opens_in_its_period_and_the_next_and_never_after() {
        let t = tickets(b"node ca key");
        let start = 1_800_000_000 - 1_800_000_000 % PERIOD_SECONDS;
        let sealed = t.seal_at(b"session", start + 5).unwrap();
        assert_eq!(t.open_at(&sealed, start + 5).unwrap(), b"session");
        assert_eq!(
            t.open_at(&sealed, start + 2 * PERIOD_SECONDS - 1).unwrap(),
            b"session"
        );
        assert_eq!(t.open_at(&sealed, start + 2 * PERIOD_SECONDS), None);
        assert_eq!(
            t.open_at(&sealed, start - 1),
            None,
            "not before it was made"
        );
        // What the ticket announces is exactly how long it opens.
        assert_eq!(
            Tickets::lifetime_at(start + 5) as i64,
            2 * PERIOD_SECONDS - 5
        );
    }

    #[test]
    fn a_ticket_survives_a_restart_and_no_other_node_ca_opens_it() {
        let sealed = tickets(b"node ca key").seal_at(b"session", 1_800_000_000);
        let sealed = sealed.unwrap();
        // A new process derives the same keys from the same CA key.
        let again = tickets(b"node ca key");
        assert_eq!(again.open_at(&sealed, 1_800_000_000).unwrap(), b"session");
        assert_eq!(
            tickets(b"another node ca").open_at(&sealed, 1_800_000_000),
            None
        );
        // The root crosses the socketpair to the network child and comes back the same.
        let json = serde_json::to_string(&TicketRoot::derive(b"node ca key")).unwrap();
        let root: TicketRoot = serde_json::from_str(&json).unwrap();
        assert_eq!(
            Tickets::new(root).open_at(&sealed, 1_800_000_000).unwrap(),
            b"session"
        );
        assert!(serde_json::from_str::<TicketRoot>("\"c2hvcnQ=\"").is_err());
    }

    #[test]
    fn a_changed_or_truncated_ticket_opens_nothing() {
        let t = tickets(b"node ca key");
        let now = 1_800_000_000;
        let sealed = t.seal_at(b"session", now).unwrap();
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x01;
            assert_eq!(t.open_at(&bad, now), None, "byte {i} changed");
        }
        for n in 0..sealed.len() {
            assert_eq!(t.open_at(&sealed[..n], now), None, "{n} bytes");
        }
        assert_eq!(t.open_at(&[0xff; 64], now), None);
        // Two tickets of one session differ (a fresh nonce each).
        assert_ne!(t.seal_at(b"session", now).unwrap(), sealed);
    }
}
