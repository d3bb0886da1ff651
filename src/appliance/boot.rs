//! The core's side of the boot server: what needs the database, the JoinService or the boot
//! gate. The boot scripts (a discovery token minted only for a sighted MAC), the per-boot
//! archive, boot lease rows, and full DHCP mode's leases (in memory, kept in step with SQLite).
//! The edge (`boot::server`, `boot::http`) parses the packets and asks for these.

use crate::appliance::app::App;
use crate::appliance::leases::DhcpState;
use crate::base::cpio::Cpio;
use crate::base::fsutil::ReadRoot;
use crate::edge::boot::templates;
use crate::proto::protocol::BASE_PATH;
use crate::proto::protocol::{Call, Outcome};
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;

pub fn boot_root(app: &App) -> PathBuf {
    app.config
        .boot
        .root
        .clone()
        .unwrap_or_else(|| app.state_dir.join("boot"))
}

/// The boot root, opened to read a template override beneath it.
fn script_root(app: &App) -> Result<ReadRoot, ScriptRefused> {
    ReadRoot::open(&boot_root(app)).map_err(ScriptRefused::Unavailable)
}

/// Records a boot lease row: who booted what, when. Returns its epoch.
pub fn lease(
    app: &App,
    mac: &str,
    (ip, relay): (Option<String>, Option<String>),
    arch: Option<u16>,
    stage: &str,
    file: Option<&str>,
) -> Option<i64> {
    let now = crate::base::clock::now();
    crate::store::boot::lease_insert(
        &app.store,
        (mac, ip.as_deref(), relay.as_deref()),
        arch,
        stage,
        file,
        now,
    )
    .ok()
}

/// A per-boot archive, once, and only to the address it was made for.
pub fn take_archive(app: &App, nonce: &str, peer: &str) -> Option<zeroize::Zeroizing<Vec<u8>>> {
    let peer = peer.parse::<std::net::IpAddr>().ok()?;
    app.boot_gate
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take(nonce, peer, crate::base::clock::now())
}

/// Why the core did not give a boot script.
pub enum ScriptRefused {
    /// 403: the network did not see this MAC at this address (nothing was written).
    NotSighted(String),
    /// 429: over a per-minute rate.
    Rate(String),
    /// 503: the core cannot answer now.
    Unavailable(String),
}

/// The core's side of `boot.ipxe` (and, with `grub`, of GRUB's `grub/<mac>.cfg`: the same
/// decisions, written for GRUB). A discovery token is minted, and the boot recorded, only for
/// a MAC the boot server's DHCP saw at `peer` (the address the edge saw the request come from)
/// within `[boot] sighting_seconds`; the local-disk answer needs no sighting. A refused request
/// writes nothing: no lease row, no token voided, no archive taken.
pub async fn script(
    app: &Arc<App>,
    mac: &str,
    peer: &str,
    base: &str,
    grub: bool,
) -> Result<String, ScriptRefused> {
    let (local_disk, discovery) = if grub {
        (templates::LOCAL_DISK_GRUB, templates::DISCOVERY_GRUB)
    } else {
        (templates::LOCAL_DISK, templates::DISCOVERY)
    };
    // The discovery answer, naming the per-boot archive `nonce`.
    let discovery_script = |nonce: &str| -> Result<String, ScriptRefused> {
        Ok(templates::render(
            &script_root(app)?,
            discovery,
            &[
                ("mac", mac),
                ("base", base),
                ("base_path", BASE_PATH),
                ("kernel_args", &app.config.boot.kernel_args),
                ("nonce", nonce),
            ],
        ))
    };
    let bad = |m: &str| ScriptRefused::Unavailable(m.to_string());
    let mac = crate::proto::claims::loose_mac(mac).ok_or_else(|| bad("not a MAC address"))?;
    let mac = mac.as_str();
    let peer_ip = peer
        .parse::<std::net::IpAddr>()
        .map_err(|_| bad("not an IP address"))?;
    let Some(join) = app.join.get() else {
        return Err(bad("the JoinService is not running"));
    };
    let b = &app.config.boot;
    let limits = crate::edge::boot::gate::Limits::from(b);
    let now = crate::base::clock::now();
    // GRUB asks over TFTP, whose source address can be forged blind: while this MAC's archive
    // waits for this address, the answer names that archive, and nothing is minted, voided or
    // counted (docs/boot.md "Secure Boot").
    if grub {
        let waiting = app
            .boot_gate
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waiting_for(mac, peer_ip, now);
        if let Some(nonce) = waiting {
            tracing::info!(%mac, "boot: discovery ramdisk (its archive still waits)");
            return discovery_script(&nonce);
        }
    }
    let sighted = {
        let mut gate = app.boot_gate.lock().unwrap_or_else(|p| p.into_inner());
        gate.admit_script(mac, peer_ip, now, &limits)
            .map_err(|crate::edge::boot::gate::Refused::Rate(m)| ScriptRefused::Rate(m))?;
        gate.sighted(mac, peer_ip, now, &limits)
    };
    let may_mint = sighted || !b.require_sighting;
    let ask = |epoch: Option<i64>, mint: bool| {
        let call = Call::MintDiscovery {
            mac: mac.to_string(),
            boot_lease_epoch: epoch,
            sighted_ip: (sighted && mint).then(|| peer_ip.to_string()),
            mint,
        };
        async move {
            let out = join
                .call(&serde_json::to_vec(&call).expect("serializes"))
                .await;
            serde_json::from_slice::<Outcome>(&out).ok()
        }
    };
    let record = |stage: &'static str| {
        let (app2, mac2, ip) = (app.clone(), mac.to_string(), peer_ip.to_string());
        async move {
            tokio::task::spawn_blocking(move || {
                lease(&app2, &mac2, (Some(ip), None), None, stage, None)
            })
            .await
            .ok()
            .flatten()
        }
    };
    if !may_mint {
        // Only the local-disk answer may be given: asked without minting, nothing is written.
        return match ask(None, false).await {
            Some(Outcome::LocalBoot) => {
                record("script").await;
                tracing::info!(%mac, "boot: local disk (an OS node, or its OS being installed)");
                Ok(templates::render(&script_root(app)?, local_disk, &[]))
            }
            Some(_) => {
                tracing::info!(%mac, %peer, "boot: no DHCP sighting of this MAC at this address; refused");
                Err(ScriptRefused::NotSighted(format!(
                    "bca: the boot server's DHCP did not see {mac} at {peer_ip} in the last {} s; \
                     boot through the provisioning network's DHCP (docs/boot.md)",
                    b.sighting_seconds
                )))
            }
            None => Err(bad("the JoinService gave no answer")),
        };
    }
    let epoch = record("script").await;
    match ask(epoch, true).await {
        Some(Outcome::LocalBoot) => {
            tracing::info!(%mac, "boot: local disk (an OS node, or its OS being installed)");
            Ok(templates::render(&script_root(app)?, local_disk, &[]))
        }
        Some(Outcome::DiscoveryToken { token }) => {
            let token = zeroize::Zeroizing::new(token);
            let archive = zeroize::Zeroizing::new(
                per_boot_archive(app, mac, epoch, &token).map_err(ScriptRefused::Unavailable)?,
            );
            let mut n = [0u8; 16];
            crate::base::crypto::fill_random(&mut n);
            let nonce = crate::base::crypto::hex(&n);
            let evicted = app
                .boot_gate
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .keep(nonce.clone(), archive, mac, peer_ip, now, &limits);
            if evicted > 0 {
                tracing::warn!(%mac, %peer, evicted, "boot: waiting per-boot archives gave way (a source at its cap, or all places taken)");
            }
            tracing::info!(%mac, "boot: discovery ramdisk");
            discovery_script(&nonce)
        }
        _ => Err(bad("no discovery token could be minted")),
    }
}

/// The second initrd: the agent's configuration and pins, the discovery token (0600) and the
/// boot facts, under `/etc/bca-agent`.
fn per_boot_archive(
    app: &App,
    mac: &str,
    epoch: Option<i64>,
    token: &str,
) -> Result<Vec<u8>, String> {
    let gateway = app
        .config
        .gateway_url
        .clone()
        .ok_or("the appliance has no gateway_url: the ramdisk would not know where to join")?;
    // This appliance first, then the site's other live appliances (the agent fails over to them).
    let mut gateways = vec![gateway];
    for u in app
        .store
        .read(crate::store::appliances::gateway_urls)
        .unwrap_or_default()
    {
        if !gateways.contains(&u) {
            gateways.push(u);
        }
    }
    let (cfg, jwk) = crate::appliance::agent_files::agent_config_for(&app.state_dir, &gateways)
        .map_err(|e| e.message)?;
    let boot = serde_json::json!({"mac": mac, "bootLeaseEpoch": epoch});
    let mut c = Cpio::new();
    c.dir("etc", 0o755)
        .dir("etc/bca-agent", 0o700)
        .file(
            "etc/bca-agent/config.toml",
            0o600,
            toml::to_string(&cfg).expect("serializes").as_bytes(),
        )
        .file("etc/bca-agent/join-encryption.jwk", 0o644, jwk.as_bytes())
        .file(
            "etc/bca-agent/discovery-token",
            0o600,
            format!("{token}\n").as_bytes(),
        )
        .file(
            "etc/bca-agent/boot.json",
            0o644,
            boot.to_string().as_bytes(),
        );
    Ok(c.finish())
}

fn dhcp_state(app: &App) -> std::sync::MutexGuard<'_, Option<DhcpState>> {
    let mut g = app.dhcp.lock().unwrap_or_else(|p| p.into_inner());
    if g.is_none() {
        match DhcpState::load(&app.store) {
            Ok(s) => *g = Some(s),
            Err(e) => tracing::error!(error = %e, "dhcp: cannot load the leases"),
        }
    }
    g
}

/// How long an offered address stays reserved for its MAC without a REQUEST.
const OFFER_SECONDS: i64 = 60;

/// An OFFER: the MAC's lease if it has one, else a free address reserved in memory for
/// [`OFFER_SECONDS`]. Nothing is written: a rack's DISCOVER burst is answered at memory speed, and
/// a machine that never asks again costs no disk write. The REQUEST makes it durable.
fn offer(app: &App, mac: &str, relay: Option<Ipv4Addr>, now: i64) -> Option<Ipv4Addr> {
    let b = &app.config.boot;
    let pool = b.pool_for(relay)?;
    let mut g = dhcp_state(app);
    let st = g.as_mut()?;
    st.offers.retain(|_, (_, t)| now - *t <= OFFER_SECONDS);
    let ip = st.address_for(b, pool.range, mac, now)?;
    if !st.leases.contains_key(mac) {
        st.offers.insert(mac.to_string(), (ip, now));
    }
    Some(ip)
}

/// Full DHCP mode's address for a MAC: an OFFER's (`discover`) or a REQUEST's durable lease.
/// `None` in proxy mode, where the site's DHCP server gives addresses.
/// `relay`: the listed relay that forwarded the packet, whose `[[boot.subnets]]` range the
/// address comes from (`None`: the boot interface's own range).
pub fn address(
    app: &App,
    mac: &str,
    discover: bool,
    relay: Option<Ipv4Addr>,
    now: i64,
) -> Option<Ipv4Addr> {
    if app.config.boot.mode != "dhcp" {
        return None;
    }
    if discover {
        offer(app, mac, relay, now)
    } else {
        allocate(app, mac, relay, now)
    }
}

/// A REQUEST: the durable lease, committed before the ACK goes out, on the address offered to
/// this MAC when it is still free.
fn allocate(app: &App, mac: &str, relay: Option<Ipv4Addr>, now: i64) -> Option<Ipv4Addr> {
    let b = &app.config.boot;
    let pool = b.pool_for(relay)?;
    let until = now + b.lease_seconds as i64;
    // The state's lock is held across the commit: two REQUESTs never take one address. Another
    // appliance of the site may have leased it meanwhile (the database refuses a second lease
    // of one address): this one's view is then read again, and the machine asks again.
    let mut g = dhcp_state(app);
    let st = g.as_mut()?;
    let ip = st.address_for(b, pool.range, mac, now)?;
    let committed = crate::store::boot::dhcp_lease(&app.store, mac, &ip.to_string(), until, now);
    if let Err(e) = committed {
        tracing::warn!(%mac, %ip, error = %e, "dhcp: the lease could not be committed (taken by another appliance, or the database is down); no ACK, the leases read again");
        st.offers.remove(mac);
        if let Ok(fresh) = DhcpState::load(&app.store) {
            st.leases = fresh.leases;
        }
        return None;
    }
    st.leases.retain(|m, (l, _)| m == mac || *l != ip);
    st.leases.insert(mac.to_string(), (ip, until));
    st.offers.remove(mac);
    Some(ip)
}

/// The core records a sighting: `mac` seen at `ip` by the boot server's DHCP. In full DHCP mode
/// the address must be the MAC's own lease (the edge cannot name another).
pub fn sighted(app: &App, mac: &str, ip: Ipv4Addr, now: i64) {
    if app.config.boot.mode == "dhcp" {
        let leased = dhcp_state(app)
            .as_ref()
            .and_then(|st| st.leases.get(mac).map(|(l, t)| (*l, *t)));
        if !leased.is_some_and(|(l, until)| l == ip && until > now) {
            tracing::debug!(%mac, %ip, "dhcp: a sighting that is not the MAC's lease; ignored");
            return;
        }
    }
    let limits = crate::edge::boot::gate::Limits::from(&app.config.boot);
    app.boot_gate
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .sight(mac, std::net::IpAddr::V4(ip), now, &limits);
    crate::base::metrics::get()
        .boot_sightings
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}
