//! Per-source counters: how many connections or transfers one address holds at once. Shared by
//! the gateway (`max_connections_per_source`) and TFTP (`tftp_max_per_source`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

/// The source a per-source limit counts: an IPv4 address (an IPv4-mapped IPv6 address is its
/// IPv4 address), or the /64 of an IPv6 address: one host holds a whole /64, so counting its
/// addresses would count nothing. (An IPv6 site whose machines share one /64 raises the
/// per-source limits: docs/config.md.)
pub fn source_of(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(_) => ip,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(std::net::Ipv6Addr::from(
                u128::from(v6) & !((1u128 << 64) - 1),
            )),
        },
    }
}

/// [`source_of`] as a key and as messages name it: `a.b.c.d`, or `x:x:x:x::/64`.
pub fn source_label(ip: IpAddr) -> String {
    match source_of(ip) {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => format!("{v6}/64"),
    }
}

#[derive(Default)]
pub struct PerSource {
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One held place of a source, given back on drop (however the work ends).
pub struct Slot {
    counts: Arc<PerSource>,
    ip: IpAddr,
}

impl PerSource {
    /// A place for `ip`, unless it already holds `max`.
    pub fn enter(self: &Arc<Self>, ip: IpAddr, max: usize) -> Option<Slot> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_default();
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(Slot {
            counts: self.clone(),
            ip,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.counts.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_sources_are_their_64() {
        let a: IpAddr = "2001:db8:0:1::5".parse().unwrap();
        let b: IpAddr = "2001:db8:0:1:ffff::9".parse().unwrap();
        let c: IpAddr = "2001:db8:0:2::5".parse().unwrap();
        assert_eq!(source_of(a), source_of(b));
        assert_ne!(source_of(a), source_of(c));
        let m: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert_eq!(source_of(m), "10.0.0.1".parse::<IpAddr>().unwrap());
        let v4: IpAddr = "10.0.0.2".parse().unwrap();
        assert_eq!(source_of(v4), v4);
        assert_eq!(source_label(b), "2001:db8:0:1::/64");
        assert_eq!(source_label(m), "10.0.0.1");
    }

    #[test]
    fn a_source_holds_at_most_max_and_gets_its_places_back() {
        let p = Arc::new(PerSource::default());
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let s1 = p.enter(a, 2).unwrap();
        let _s2 = p.enter(a, 2).unwrap();
        assert!(p.enter(a, 2).is_none());
        assert!(p.enter(b, 2).is_some());
        drop(s1);
        assert!(p.enter(a, 2).is_some());
    }
}
