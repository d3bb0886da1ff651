//! What the HTTP side of boot lets through, decided in memory from values and the time:
//!
//! - **Sightings.** The DHCP side records, per MAC, the address the network itself saw it at (a
//!   limited broadcast on the boot interface, or a packet from a listed relay). A discovery token
//!   is minted, and its per-boot archive handed out, only to that address: an attacker who can
//!   reach the HTTP listener cannot mint for a MAC it names (docs/boot.md "What the network saw").
//! - **Rates.** `boot.ipxe` per source (an IPv6 /64 counts as one source) and per MAC, per minute.
//! - **Waiting archives.** At most so many per source (its own oldest gives way) and in all (the
//!   busiest source's oldest gives way), so one flooding source never makes a new machine wait.
//!
//! Nothing here touches the network or the database: `boot::http` and `boot::server` ask it.

use crate::config::BootConfig;
use std::collections::HashMap;
use std::net::IpAddr;
use zeroize::Zeroizing;

/// How long a per-boot archive waits to be fetched.
pub const ARCHIVE_TTL: i64 = 600;
/// Sightings remembered at most (a DHCP flood of made-up MACs costs this much memory at most).
const MAX_SIGHTINGS: usize = 65_536;
/// Rate windows kept before the stale ones are swept.
const SWEEP_WINDOWS: usize = 8_192;

/// The same address, whatever its spelling (an IPv4-mapped IPv6 address is its IPv4 address).
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The `[boot]` settings the gate applies.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub sighting_seconds: i64,
    pub scripts_per_source: u32,
    pub scripts_per_mac: u32,
    pub archives_per_source: usize,
    pub max_archives: usize,
}

impl From<&BootConfig> for Limits {
    fn from(b: &BootConfig) -> Self {
        Self {
            sighting_seconds: b.sighting_seconds as i64,
            scripts_per_source: b.scripts_per_source_per_minute,
            scripts_per_mac: b.scripts_per_mac_per_minute,
            archives_per_source: b.archives_per_source,
            max_archives: b.max_waiting_archives,
        }
    }
}

struct Waiting {
    archive: Zeroizing<Vec<u8>>,
    seq: u64,
    at: i64,
    mac: String,
    source: String,
    ip: IpAddr,
}

/// Why a `boot.ipxe` request was not served.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// Over a per-minute rate: the text says which.
    Rate(String),
}

#[derive(Default)]
pub struct Gate {
    sightings: HashMap<String, (IpAddr, i64)>,
    waiting: HashMap<String, Waiting>,
    windows: HashMap<String, (i64, u32)>,
    seq: u64,
    swept: i64,
}

impl Gate {
    /// Records that the network saw `mac` at `ip` now.
    pub fn sight(&mut self, mac: &str, ip: IpAddr, now: i64, l: &Limits) {
        if self.sightings.len() >= MAX_SIGHTINGS && !self.sightings.contains_key(mac) {
            // The expired ones go, at most once a second (a pass is the whole table).
            if self.swept != now {
                self.swept = now;
                self.sightings
                    .retain(|_, (_, at)| now - *at <= l.sighting_seconds);
            }
            if self.sightings.len() >= MAX_SIGHTINGS {
                // Still full of live sightings (a flood of made-up MACs): one gives way, in
                // constant time. A real machine's sighting lives MAX_SIGHTINGS floods long.
                if let Some(any) = self.sightings.keys().next().cloned() {
                    self.sightings.remove(&any);
                }
            }
        }
        self.sightings.insert(mac.to_string(), (canonical(ip), now));
    }

    /// Whether the network saw `mac` at `ip` within the sighting window.
    pub fn sighted(&self, mac: &str, ip: IpAddr, now: i64, l: &Limits) -> bool {
        self.sightings
            .get(mac)
            .is_some_and(|(seen, at)| *seen == canonical(ip) && now - *at <= l.sighting_seconds)
    }

    /// Counts a `boot.ipxe` request of `mac` from `ip` against the per-minute rates: every
    /// request against its source's, and only a request from where the network saw the MAC
    /// against the MAC's (else anyone could spend a machine's budget with refused requests).
    pub fn admit_script(
        &mut self,
        mac: &str,
        ip: IpAddr,
        now: i64,
        l: &Limits,
    ) -> Result<(), Refused> {
        let count_mac = self.sighted(mac, ip, now, l);
        let minute = now / 60;
        if self.windows.len() > SWEEP_WINDOWS {
            self.windows.retain(|_, (m, _)| *m == minute);
        }
        let source = crate::base::limits::source_label(ip);
        let over = |w: &HashMap<String, (i64, u32)>, k: &str, cap: u32| {
            w.get(k).is_some_and(|(m, n)| *m == minute && *n >= cap)
        };
        let (ks, km) = (format!("src:{source}"), format!("mac:{mac}"));
        if over(&self.windows, &ks, l.scripts_per_source) {
            return Err(Refused::Rate(format!(
                "more than {} boot scripts a minute from {source}; retry in a minute",
                l.scripts_per_source
            )));
        }
        if count_mac && over(&self.windows, &km, l.scripts_per_mac) {
            return Err(Refused::Rate(format!(
                "more than {} boot scripts a minute for {mac}; retry in a minute",
                l.scripts_per_mac
            )));
        }
        for k in std::iter::once(ks).chain(count_mac.then_some(km)) {
            let w = self.windows.entry(k).or_insert((minute, 0));
            if w.0 != minute {
                *w = (minute, 0);
            }
            w.1 += 1;
        }
        Ok(())
    }

    fn expire(&mut self, now: i64) {
        self.waiting.retain(|_, w| now - w.at <= ARCHIVE_TTL);
    }

    /// The oldest waiting archive of `source` (any source when `None`).
    fn oldest_of(&self, source: Option<&str>) -> Option<String> {
        self.waiting
            .iter()
            .filter(|(_, w)| source.is_none_or(|s| w.source == s))
            .min_by_key(|(_, w)| w.seq)
            .map(|(n, _)| n.clone())
    }

    /// Keeps `archive` for one fetch from `ip`. An earlier archive of the same MAC goes (its
    /// token was voided by this one's minting); a source at its cap loses its oldest; when every
    /// place is taken, the busiest source's oldest gives way. Returns how many were evicted.
    pub fn keep(
        &mut self,
        nonce: String,
        archive: Zeroizing<Vec<u8>>,
        mac: &str,
        ip: IpAddr,
        now: i64,
        l: &Limits,
    ) -> usize {
        self.expire(now);
        self.waiting.retain(|_, w| w.mac != mac);
        let source = crate::base::limits::source_label(ip);
        let mut evicted = 0;
        while self.waiting.values().filter(|w| w.source == source).count() >= l.archives_per_source
        {
            let Some(n) = self.oldest_of(Some(&source)) else {
                break;
            };
            self.waiting.remove(&n);
            evicted += 1;
        }
        while self.waiting.len() >= l.max_archives {
            let mut counts: HashMap<&str, usize> = HashMap::new();
            for w in self.waiting.values() {
                *counts.entry(w.source.as_str()).or_default() += 1;
            }
            let busiest = counts
                .into_iter()
                .max_by_key(|(_, n)| *n)
                .map(|(s, _)| s.to_string());
            let Some(n) = busiest.and_then(|s| self.oldest_of(Some(&s))) else {
                break;
            };
            self.waiting.remove(&n);
            evicted += 1;
        }
        self.seq += 1;
        self.waiting.insert(
            nonce,
            Waiting {
                archive,
                seq: self.seq,
                at: now,
                mac: mac.to_string(),
                source,
                ip: canonical(ip),
            },
        );
        evicted
    }

    /// The archive for `nonce`, once, and only to the address it was made for: any other
    /// address is answered as if it did not exist, and leaves it waiting.
    pub fn take(&mut self, nonce: &str, peer: IpAddr, now: i64) -> Option<Zeroizing<Vec<u8>>> {
        self.expire(now);
        if self.waiting.get(nonce)?.ip != canonical(peer) {
            return None;
        }
        self.waiting.remove(nonce).map(|w| w.archive)
    }

    /// The nonce of the archive waiting for `mac` at `ip`, if one is: GRUB's per-machine
    /// configuration comes over TFTP, whose source address anyone can forge without an answer,
    /// so a request for it while the machine's archive waits is answered with that archive
    /// rather than a new one (which would void the machine's token and drop its archive).
    pub fn waiting_for(&mut self, mac: &str, ip: IpAddr, now: i64) -> Option<String> {
        self.expire(now);
        let ip = canonical(ip);
        self.waiting
            .iter()
            .find(|(_, w)| w.mac == mac && w.ip == ip)
            .map(|(n, _)| n.clone())
    }

    /// Archives waiting now.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_archive_waiting_for_a_mac_is_found_only_at_its_address() {
        let mut g = Gate::default();
        let l = Limits {
            sighting_seconds: 300,
            scripts_per_source: 10,
            scripts_per_mac: 10,
            archives_per_source: 4,
            max_archives: 16,
        };
        let ip: IpAddr = "10.0.0.5".parse().unwrap();
        let mac = "52:54:00:00:00:01";
        assert_eq!(g.waiting_for(mac, ip, 0), None);
        g.keep("aa".into(), Zeroizing::new(vec![1]), mac, ip, 0, &l);
        assert_eq!(g.waiting_for(mac, ip, 10).as_deref(), Some("aa"));
        assert_eq!(g.waiting_for(mac, "10.0.0.6".parse().unwrap(), 10), None);
        assert_eq!(g.waiting_for("52:54:00:00:00:02", ip, 10), None);
        // Gone once taken, or once expired.
        assert!(g.take("aa", ip, 20).is_some());
        assert_eq!(g.waiting_for(mac, ip, 30), None);
        g.keep("bb".into(), Zeroizing::new(vec![1]), mac, ip, 100, &l);
        assert_eq!(g.waiting_for(mac, ip, 100 + ARCHIVE_TTL + 1), None);
    }

    fn limits() -> Limits {
        Limits {
            sighting_seconds: 300,
            scripts_per_source: 5,
            scripts_per_mac: 3,
            archives_per_source: 2,
            max_archives: 4,
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn a_sighting_vouches_for_its_address_only_and_only_for_a_while() {
        let mut g = Gate::default();
        let l = limits();
        g.sight("52:54:00:00:00:01", ip("10.0.0.5"), 1000, &l);
        assert!(g.sighted("52:54:00:00:00:01", ip("10.0.0.5"), 1300, &l));
        assert!(g.sighted("52:54:00:00:00:01", ip("::ffff:10.0.0.5"), 1300, &l));
        assert!(!g.sighted("52:54:00:00:00:01", ip("10.0.0.6"), 1000, &l));
        assert!(!g.sighted("52:54:00:00:00:02", ip("10.0.0.5"), 1000, &l));
        assert!(!g.sighted("52:54:00:00:00:01", ip("10.0.0.5"), 1301, &l));
    }

    #[test]
    fn scripts_are_rated_per_source_and_per_mac_per_minute() {
        let mut g = Gate::default();
        let l = limits();
        g.sight("m1", ip("10.0.0.1"), 600, &l);
        for _ in 0..3 {
            g.admit_script("m1", ip("10.0.0.1"), 600, &l).unwrap();
        }
        assert!(matches!(
            g.admit_script("m1", ip("10.0.0.1"), 600, &l),
            Err(Refused::Rate(m)) if m.contains("for m1")
        ));
        g.admit_script("m2", ip("10.0.0.1"), 600, &l).unwrap();
        g.admit_script("m3", ip("10.0.0.1"), 600, &l).unwrap();
        assert!(matches!(
            g.admit_script("m4", ip("10.0.0.1"), 600, &l),
            Err(Refused::Rate(m)) if m.contains("from 10.0.0.1")
        ));
        // Refused requests from where the MAC was not seen spend only their source's budget:
        // nobody can spend a machine's with them.
        g.sight("m9", ip("10.0.0.50"), 600, &l);
        for i in 0..3 {
            g.admit_script("m9", ip(&format!("10.0.1.{i}")), 600, &l)
                .unwrap();
        }
        g.admit_script("m9", ip("10.0.0.50"), 600, &l).unwrap();
        // Another /64 is another source; the next minute starts afresh.
        g.admit_script("m4", ip("10.0.0.9"), 600, &l).unwrap();
        g.admit_script("m4", ip("10.0.0.1"), 660, &l).unwrap();
    }

    #[test]
    fn a_flooding_source_evicts_its_own_archives_and_a_full_gate_the_busiest_sources() {
        let mut g = Gate::default();
        let l = limits();
        let a = |n: u8| Zeroizing::new(vec![n]);
        // The flooder keeps at most two waiting; its oldest gives way.
        for i in 0..5u8 {
            g.keep(
                format!("f{i}"),
                a(i),
                &format!("f-mac-{i}"),
                ip("10.9.9.9"),
                100,
                &l,
            );
        }
        assert_eq!(g.waiting(), 2);
        assert!(g.take("f4", ip("10.9.9.9"), 100).is_some());
        assert!(g.take("f0", ip("10.9.9.9"), 100).is_none());
        // Real machines are kept; when every place is taken, the busiest source's oldest goes.
        g.keep("r1".into(), a(10), "r-mac-1", ip("10.0.0.1"), 101, &l);
        g.keep("r2".into(), a(11), "r-mac-2", ip("10.0.0.2"), 101, &l);
        g.keep("f9".into(), a(12), "f-mac-9", ip("10.9.9.9"), 102, &l);
        assert_eq!(g.waiting(), 4);
        g.keep("r3".into(), a(13), "r-mac-3", ip("10.0.0.3"), 103, &l);
        assert_eq!(g.waiting(), 4);
        assert!(
            g.take("f3", ip("10.9.9.9"), 103).is_none(),
            "the busiest's oldest stays"
        );
        for (n, who) in [("r1", "10.0.0.1"), ("r2", "10.0.0.2"), ("r3", "10.0.0.3")] {
            assert!(g.take(n, ip(who), 103).is_some(), "{n} was evicted");
        }
    }

    #[test]
    fn an_archive_is_taken_once_by_its_own_address_and_a_new_boot_replaces_it() {
        let mut g = Gate::default();
        let l = limits();
        g.keep(
            "n1".into(),
            Zeroizing::new(vec![1]),
            "m",
            ip("10.0.0.1"),
            0,
            &l,
        );
        assert!(g.take("n1", ip("10.0.0.2"), 1).is_none());
        assert_eq!(g.waiting(), 1, "a wrong address leaves it waiting");
        g.keep(
            "n2".into(),
            Zeroizing::new(vec![2]),
            "m",
            ip("10.0.0.1"),
            2,
            &l,
        );
        assert!(
            g.take("n1", ip("10.0.0.1"), 3).is_none(),
            "replaced by the MAC's new boot"
        );
        assert_eq!(g.take("n2", ip("10.0.0.1"), 3).unwrap().as_slice(), &[2]);
        assert!(g.take("n2", ip("10.0.0.1"), 3).is_none());
        g.keep(
            "n3".into(),
            Zeroizing::new(vec![3]),
            "m",
            ip("10.0.0.1"),
            10,
            &l,
        );
        assert!(g.take("n3", ip("10.0.0.1"), 10 + ARCHIVE_TTL + 1).is_none());
    }
}
