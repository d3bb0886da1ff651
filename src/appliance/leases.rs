//! Full DHCP mode's leases, in memory.

use crate::store::Store;
use std::collections::{HashMap, HashSet};
use std::net::Ipv4Addr;

/// Full DHCP mode's view of the leases, in memory: the durable leases (loaded from SQLite once,
/// kept in step by every commit, which only `boot_core::allocate` makes) and the offers not yet requested.
/// A DISCOVER is answered from here without touching the database.
#[derive(Default)]
pub struct DhcpState {
    pub(crate) leases: HashMap<String, (Ipv4Addr, i64)>,
    pub(crate) offers: HashMap<String, (Ipv4Addr, i64)>,
}

impl DhcpState {
    pub fn load(store: &Store) -> Result<Self, String> {
        let leases = crate::store::boot::dhcp_leases(store)
            .map_err(|e| e.to_string())?
            .into_iter()
            .filter_map(|(m, ip, t)| Some((m, (ip.parse().ok()?, t))))
            .collect();
        Ok(Self {
            leases,
            offers: HashMap::new(),
        })
    }

    /// The MAC's address in `range`: its lease's, else a free one (the one offered to it
    /// first). A lease on another network (the machine moved behind another relay) gives way.
    pub(crate) fn address_for(
        &self,
        b: &crate::config::BootConfig,
        range: (Ipv4Addr, Ipv4Addr),
        mac: &str,
        now: i64,
    ) -> Option<Ipv4Addr> {
        let within =
            |ip: &Ipv4Addr| (u32::from(range.0)..=u32::from(range.1)).contains(&u32::from(*ip));
        if let Some((ip, _)) = self.leases.get(mac).filter(|(ip, _)| within(ip)) {
            return Some(*ip);
        }
        let prefer = self.offers.get(mac).map(|(ip, _)| *ip).filter(within);
        let ip = self.free(b, range, mac, prefer, now);
        if ip.is_none() {
            tracing::warn!(%mac, "dhcp: the range is exhausted");
        }
        ip
    }

    /// A free address: in the range, not the server's, not leased (unexpired) or offered to
    /// another MAC; `prefer` first.
    fn free(
        &self,
        b: &crate::config::BootConfig,
        range: (Ipv4Addr, Ipv4Addr),
        mac: &str,
        prefer: Option<Ipv4Addr>,
        now: i64,
    ) -> Option<Ipv4Addr> {
        let (start, end) = (u32::from(range.0), u32::from(range.1));
        let used: HashSet<Ipv4Addr> = self
            .leases
            .iter()
            .filter(|(m, (_, t))| *m != mac && *t > now)
            .map(|(_, (ip, _))| *ip)
            .chain(
                self.offers
                    .iter()
                    .filter(|(m, _)| *m != mac)
                    .map(|(_, (ip, _))| *ip),
            )
            .collect();
        prefer
            .into_iter()
            .chain((start..=end).map(Ipv4Addr::from))
            .find(|ip| {
                (start..=end).contains(&u32::from(*ip))
                    && Some(*ip) != b.server_ip
                    && !used.contains(ip)
            })
    }
}
