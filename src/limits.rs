//! Per-source counters: how many connections or transfers one address holds at once. Shared by
//! the gateway (`max_connections_per_source`) and TFTP (`tftp_max_per_source`).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

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
