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
//!   behalf, so it rests on the same secret, and a new node CA ends every ticket.
//! - **Key periods of 24 hours.** A ticket is sealed (AES-256-GCM, a random nonce, the period in
//!   the clear and authenticated) under the key of the period it was made in and is accepted in
//!   that period and the next: 24 to 48 hours; it announces 24, which is never more than it
//!   opens. An agent reconnects with a full handshake after each renewal (at 60% of a
//!   certificate's life: 14.4 hours for a day's), so its ticket is younger than a day.
//! - **The network child holds keys, not the root.** It is given the keys of the period before,
//!   the current one and the next, and the next period's at each change of period: memory read
//!   out of it once opens and forges tickets for three days at most, not for the CA's life.
//! - **What resumption does not skip.** The handshake is `psk_dhe_ke` (rustls offers no other):
//!   fresh ECDHE, so traffic keys stay forward secret. A resumed connection carries the client
//!   certificate of the handshake that made the ticket, which webpki does not check again (and a
//!   resumed connection is given a new ticket, so that certificate was checked at the first
//!   one). What uses it checks it in the database as after a full handshake: `hello` looks the
//!   exact certificate up in `node_certs` and refuses it when revoked, superseded, expired or
//!   retired; `renew` requires it to be the very certificate renewed, which is looked up the same
//!   way. No early data is accepted.
//! - **What leaked keys allow.** Forged tickets: a connection claiming any node's certificate,
//!   which the network child can already claim to the parent, for a heartbeat; a renewal still
//!   needs the node key's signature. And reading a ticket sent in the clear in a resuming
//!   ClientHello gives its resumption secret: a man in the middle could then answer that one
//!   node's resumption as the gateway (bounded, again, by the three days).

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM, NONCE_LEN};
use aws_lc_rs::hkdf;
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::sync::{Arc, RwLock};
use zeroize::{Zeroize, Zeroizing};

/// How long one ticket key seals new tickets.
pub const PERIOD_SECONDS: i64 = 24 * 3600;

/// The period in the clear, then the nonce, then the sealed session and its tag.
const HEADER: usize = 8 + NONCE_LEN;
const TAG: usize = 16;

fn period_of(now: i64) -> i64 {
    now.div_euclid(PERIOD_SECONDS)
}

/// The secret every ticket key is derived from: it stays in the process that holds the keys.
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

    fn key(&self, period: i64) -> Zeroizing<[u8; 32]> {
        let mut k = Zeroizing::new([0u8; 32]);
        let info = period.to_be_bytes();
        hkdf::Salt::new(hkdf::HKDF_SHA256, b"bca gateway ticket key")
            .extract(&self.0[..])
            .expand(&[&info], hkdf::HKDF_SHA256)
            .and_then(|okm| okm.fill(&mut k[..]))
            .expect("32 bytes of HKDF-SHA256");
        k
    }

    /// The keys of the period before `now`'s, its own and the next: what the network child holds.
    pub fn ring_at(&self, now: i64) -> TicketKeys {
        let p = period_of(now);
        TicketKeys((p - 1..=p + 1).map(|q| (q, self.key(q))).collect())
    }

    /// Seconds from `now` to the next change of period, when the child's keys move on.
    pub fn next_change(now: i64) -> u64 {
        ((period_of(now) + 1) * PERIOD_SECONDS - now) as u64
    }
}

impl std::fmt::Debug for TicketRoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TicketRoot(..)")
    }
}

/// Ticket keys by period, as they cross the socketpair to the network child: `[[period,
/// "base64"], ...]` (the copies this module makes are zeroized).
pub struct TicketKeys(Vec<(i64, Zeroizing<[u8; 32]>)>);

impl Serialize for TicketKeys {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut keys: Vec<(i64, String)> = self
            .0
            .iter()
            .map(|(p, k)| (*p, crate::base::crypto::b64(&k[..])))
            .collect();
        let out = keys.serialize(s);
        keys.iter_mut().for_each(|(_, k)| k.zeroize());
        out
    }
}

impl<'de> Deserialize<'de> for TicketKeys {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut keys = Vec::<(i64, String)>::deserialize(d)?;
        let out = keys
            .iter()
            .map(|(p, b)| {
                let raw = Zeroizing::new(crate::base::crypto::b64_decode(b).unwrap_or_default());
                let mut k = Zeroizing::new([0u8; 32]);
                if raw.len() != k.len() {
                    return Err(serde::de::Error::custom(
                        "a ticket key is not 32 bytes of base64",
                    ));
                }
                k.copy_from_slice(&raw);
                Ok((*p, k))
            })
            .collect::<Result<Vec<_>, D::Error>>();
        keys.iter_mut().for_each(|(_, k)| k.zeroize());
        out.map(Self)
    }
}

/// The gateway's ticketer (rustls' `ProducesTickets`): from the root where the keys are, or from
/// the keys it was given (the network child).
pub struct Tickets {
    root: Option<TicketRoot>,
    /// The keys of the periods in use (at most three).
    keys: RwLock<Vec<(i64, Arc<LessSafeKey>)>>,
    rng: SystemRandom,
}

impl std::fmt::Debug for Tickets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tickets(..)")
    }
}

fn aead(k: &[u8; 32]) -> Arc<LessSafeKey> {
    Arc::new(LessSafeKey::new(
        UnboundKey::new(&AES_256_GCM, &k[..]).expect("a 32-byte key"),
    ))
}

impl Tickets {
    /// Derives the key of each period as it comes.
    pub fn from_root(root: TicketRoot) -> Self {
        Self {
            root: Some(root),
            keys: RwLock::new(Vec::new()),
            rng: SystemRandom::new(),
        }
    }

    /// Only the keys given, here and by [`Self::replace`].
    pub fn from_keys(keys: &TicketKeys) -> Self {
        let t = Self {
            root: None,
            keys: RwLock::new(Vec::new()),
            rng: SystemRandom::new(),
        };
        t.replace(keys);
        t
    }

    /// The keys given next (the child's, at a change of period).
    pub fn replace(&self, keys: &TicketKeys) {
        *self.keys.write().unwrap_or_else(|p| p.into_inner()) =
            keys.0.iter().map(|(p, k)| (*p, aead(k))).collect();
    }

    fn key(&self, period: i64) -> Option<Arc<LessSafeKey>> {
        if let Some((_, k)) = self
            .keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|(p, _)| *p == period)
        {
            return Some(k.clone());
        }
        let root = self.root.as_ref()?;
        let k = aead(&root.key(period));
        let mut keys = self.keys.write().unwrap_or_else(|p| p.into_inner());
        keys.retain(|(p, _)| *p >= period - 1);
        keys.push((period, k.clone()));
        Some(k)
    }

    pub fn seal_at(&self, plain: &[u8], now: i64) -> Option<Vec<u8>> {
        let period = period_of(now);
        let key = self.key(period)?;
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).ok()?;
        let mut out = Vec::with_capacity(HEADER + plain.len() + TAG);
        out.extend_from_slice(&period.to_be_bytes());
        out.extend_from_slice(&nonce);
        let mut body = plain.to_vec();
        key.seal_in_place_append_tag(
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
            .key(period)?
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

    /// A ticket opens for 24 to 48 hours from when it was sealed: 24 is never too long.
    fn lifetime(&self) -> u32 {
        PERIOD_SECONDS as u32
    }

    fn encrypt(&self, plain: &[u8]) -> Option<Vec<u8>> {
        self.seal_at(plain, crate::base::clock::now())
    }

    fn decrypt(&self, cipher: &[u8]) -> Option<Vec<u8>> {
        self.open_at(cipher, crate::base::clock::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tickets(ca_key: &[u8]) -> Tickets {
        Tickets::from_root(TicketRoot::derive(ca_key))
    }

    const NOW: i64 = 1_800_000_000;

    #[test]
    fn a_ticket_opens_in_its_period_and_the_next_and_never_after() {
        let t = tickets(b"node ca key");
        let start = NOW - NOW % PERIOD_SECONDS;
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
        // What a ticket announces is never more than it opens, sealed at any time of a period.
        let late = t.seal_at(b"session", start + PERIOD_SECONDS - 1).unwrap();
        let announced = rustls::server::ProducesTickets::lifetime(&t) as i64;
        assert!(t
            .open_at(&late, start + PERIOD_SECONDS - 1 + announced)
            .is_some());
    }

    #[test]
    fn a_ticket_survives_a_restart_and_no_other_node_ca_opens_it() {
        let sealed = tickets(b"node ca key").seal_at(b"session", NOW).unwrap();
        // A new process derives the same keys from the same CA key.
        let again = tickets(b"node ca key");
        assert_eq!(again.open_at(&sealed, NOW).unwrap(), b"session");
        assert_eq!(tickets(b"another node ca").open_at(&sealed, NOW), None);
    }

    #[test]
    fn the_child_holds_three_periods_keys_and_moves_on_when_given_the_next() {
        let root = TicketRoot::derive(b"node ca key");
        let parent = Tickets::from_root(root.clone());
        // The keys cross the socketpair as JSON and come back the same.
        let json = serde_json::to_string(&root.ring_at(NOW)).unwrap();
        assert!(!json.contains("node ca key"));
        let child = Tickets::from_keys(&serde_json::from_str(&json).unwrap());
        let sealed = parent.seal_at(b"session", NOW).unwrap();
        assert_eq!(child.open_at(&sealed, NOW).unwrap(), b"session");
        let by_child = child.seal_at(b"session", NOW).unwrap();
        assert_eq!(parent.open_at(&by_child, NOW).unwrap(), b"session");
        // In the next period the child still seals (it holds that key) and opens the last one's.
        let next = NOW + PERIOD_SECONDS;
        let sealed_next = child.seal_at(b"session", next).unwrap();
        assert_eq!(parent.open_at(&sealed_next, next).unwrap(), b"session");
        assert_eq!(child.open_at(&by_child, next).unwrap(), b"session");
        // Two periods on, it has no key to seal with until it is given the next ones (it still
        // opens the last period's tickets), and three on it opens nothing.
        let later = NOW + 2 * PERIOD_SECONDS;
        assert_eq!(child.seal_at(b"session", later), None);
        assert_eq!(child.open_at(&sealed_next, later).unwrap(), b"session");
        let sealed_later = parent.seal_at(b"session", later).unwrap();
        assert_eq!(child.open_at(&sealed_later, later + PERIOD_SECONDS), None);
        child.replace(&root.ring_at(later));
        assert_eq!(child.open_at(&sealed_next, later).unwrap(), b"session");
        assert!(child.seal_at(b"session", later).is_some());
        // Malformed keys are refused, not truncated or padded.
        for bad in [
            r#"[[1,"c2hvcnQ="]]"#,
            r#"[[1,"not base64!"]]"#,
            r#"{"k":1}"#,
        ] {
            assert!(serde_json::from_str::<TicketKeys>(bad).is_err(), "{bad}");
        }
        assert_eq!(
            TicketRoot::next_change(NOW - NOW % PERIOD_SECONDS),
            PERIOD_SECONDS as u64
        );
    }

    #[test]
    fn a_changed_or_truncated_ticket_opens_nothing() {
        let t = tickets(b"node ca key");
        let sealed = t.seal_at(b"session", NOW).unwrap();
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x01;
            assert_eq!(t.open_at(&bad, NOW), None, "byte {i} changed");
        }
        for n in 0..sealed.len() {
            assert_eq!(t.open_at(&sealed[..n], NOW), None, "{n} bytes");
        }
        assert_eq!(t.open_at(&[0xff; 64], NOW), None);
        // Two tickets of one session differ (a fresh nonce each).
        assert_ne!(t.seal_at(b"session", NOW).unwrap(), sealed);
    }
}
