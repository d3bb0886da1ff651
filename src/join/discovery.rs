//! The `discovery` attestor and its join requests: a PXE-booted ramdisk joins with a single-use,
//! MAC-bound discovery token, minted only for the address the boot server's DHCP saw the MAC at
//! (`boot::gate`). A machine's claims identify it; they never prove who it is. So:
//!
//! - under `approval = "always"` (the default) every machine is recorded as a join request and
//!   answered with a signed deferral; nothing is issued and no token spent;
//! - under `approval = "unknown-machines"`, a machine whose trusted hardware key names a live node
//!   is admitted at once, as a reclaim of that node, only when [`HeldBy::reclaimable_unapproved`]
//!   holds: the token came from a sighting of the node's boot MAC, the node's identifiers were
//!   recorded by a discovery or `tpm` admission or an approval (never by a token join alone), its
//!   pool allows `discovery`, it has no open session, and it is a `ramdisk` node or marked for
//!   rediscovery. Any other machine waits for an operator;
//! - an approval admits exactly one join, the retry with the approved CSR: a new node, or the
//!   reclaim of the node holding the machine's key when the approval put it in that node's pool
//!   ([`HeldBy::reclaimable_approved`]); a node elsewhere is never joined (`join:reclaim`);
//! - an open request is refreshed only by a join from its own MAC (`discovery:mac-conflict`) and
//!   its own address (`discovery:address-conflict`), and the token of a request is not taken for
//!   another machine (`discovery:token-reused`).

use crate::base::crypto;
use crate::base::error::ApiResult;
use crate::domain::admission::Reason;
use crate::domain::admission::{owned_trust, HeldBy};
use crate::domain::token::Bearer;
use crate::join::admit::{write, Admission, Record, Target};
use crate::join::issue::refused;
use crate::join::issue::Decided;
use crate::join::issue::Ready;
use crate::join::issue::Signer;
use crate::join::requests::deferral;
use crate::join::requests::expire;
use crate::join::requests::open_request;
use crate::join::requests::rejected;
use crate::join::site::Site;
use crate::proto::claims::loose_mac;
use crate::proto::protocol::Outcome;
use crate::store::discovery::Token as TokenRow;
use crate::store::Tx;
use serde_json::json;

/// What the boot server asks of the JoinService for a `boot.ipxe` request.
pub(crate) struct Mint {
    pub mac: String,
    pub boot_lease_epoch: Option<i64>,
    /// The address the boot server's DHCP saw the MAC at (the request's own).
    pub sighted_ip: Option<String>,
    /// `false`: only whether the MAC boots its local disk; nothing is written.
    pub mint: bool,
}

/// A new discovery token for the MAC, voiding the MAC's earlier ones (never one whose request an
/// operator approved); or `LocalBoot` when the MAC's node boots its local disk
/// (`store::nodes::boots_local_disk`).
pub(crate) fn mint(tx: &Tx<'_>, site: &Site, m: &Mint, now: i64) -> ApiResult<Outcome> {
    let Some(mac) = loose_mac(&m.mac) else {
        return Ok(Outcome::Refused);
    };
    let epoch = m.boot_lease_epoch;
    if crate::store::nodes::boots_local_disk(tx, &mac, now)? {
        return Ok(Outcome::LocalBoot);
    }
    if !m.mint {
        return Ok(Outcome::Refused);
    }
    // The token of an approved request stays good: a boot of the same MAC (anyone's, a minute
    // later) must not void what an operator's approval is waiting for.
    crate::store::discovery::void_for_mac(tx, &mac, now)?;
    let mut secret = zeroize::Zeroizing::new([0u8; 32]);
    crypto::fill_random(secret.as_mut());
    let bearer = Bearer {
        id: crate::base::ids::new_id("jt", now * 1000),
        secret,
    };
    crate::store::discovery::insert(
        tx,
        &crate::store::discovery::NewToken {
            id: &bearer.id,
            site_id: &site.config.site_id,
            mac: &mac,
            secret_sha256: &crypto::sha256(bearer.secret.as_ref()),
            boot_lease_epoch: epoch,
            expires_at: now + site.config.discovery.pending_ttl_seconds as i64,
            sighted_ip: m.sighted_ip.as_deref(),
        },
        now,
    )?;
    Ok(Outcome::DiscoveryToken {
        token: bearer.render().to_string(),
    })
}

/// The live (not retired) node holding a trusted hardware key.
pub(crate) fn held_by(tx: &Tx<'_>, key: &str) -> ApiResult<Option<HeldBy>> {
    let row = crate::store::nodes::held_by(tx, key)?;
    let Some((mut h, claims)) = row else {
        return Ok(None);
    };
    h.claim_macs = serde_json::from_str::<serde_json::Value>(&claims)
        .ok()
        .and_then(|v| {
            v["macs"].as_array().map(|a| {
                a.iter()
                    .filter_map(|m| m.as_str().and_then(loose_mac))
                    .collect()
            })
        })
        .unwrap_or_default();
    h.pool_allows_discovery = crate::store::tenancy::pool_by_id(tx, &h.pool_id)?
        .is_some_and(|p| p.archived_at.is_none() && p.allows_attestor("discovery"));
    Ok(Some(h))
}

/// Stage 2 of a discovery join, inside its savepoint.
pub(crate) fn admit(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    now: i64,
) -> ApiResult<Decided> {
    let crate::join::issue::Proof::Bearer(bearer) = &r.proof else {
        return refused(Reason::Attestor, None);
    };
    expire(tx, now)?;
    let row = crate::store::discovery::get(tx, &bearer.id)?;
    let Some(t) = row else {
        return refused(Reason::DiscoveryUnknown, None);
    };
    if !crypto::ct_eq(&crypto::sha256(bearer.secret.as_ref()), &t.secret_sha256) {
        return refused(Reason::DiscoverySecretMismatch, None);
    }
    if t.spent || t.voided {
        return refused(Reason::DiscoverySpent, None);
    }
    if now >= t.expires_at {
        return refused(Reason::DiscoveryExpired, None);
    }
    if r.role != "ramdisk" {
        return refused(Reason::DiscoveryRoleMismatch, None);
    }
    if !r
        .claims
        .macs
        .iter()
        .filter_map(|m| loose_mac(m))
        .any(|m| m == t.mac)
    {
        return refused(Reason::DiscoveryMac, None);
    }
    let cfg = &site.config;
    let trusted = r.key.as_ref().filter(|k| k.trusted).map(|k| k.hex.clone());
    let machine_key = trusted
        .clone()
        .unwrap_or_else(|| format!("mac:{}:{}", cfg.site_id, t.mac));
    // A token that already stands for one machine's request is not taken for another's.
    if crate::store::requests::token_taken_by_other(tx, &bearer.id, &machine_key)? {
        return refused(Reason::DiscoveryTokenReused, None);
    }
    let known = match &trusted {
        Some(k) => held_by(tx, k)?,
        None => None,
    };
    let csr_hex = crypto::hex(&r.csr.sha256);
    if rejected(tx, &machine_key, &csr_hex)? {
        return refused(Reason::DiscoveryRejected, None);
    }
    let current = open_request(tx, &machine_key)?;
    // An open request is the machine that booted with its MAC: a join from another MAC (a
    // machine that claims the same identifiers) changes nothing.
    // And from its address: the gateway saw the request's joins come from one address, and a
    // machine that spoofs the MAC (a sighting is one UDP packet) from another changes nothing
    // either, not even an approved request's CSR.
    if let Some((id, ..)) = &current {
        let (mac, ip) = crate::store::requests::origin(tx, id)?;
        if mac.as_deref().is_some_and(|m| m != t.mac) {
            return refused(Reason::DiscoveryMacConflict, None);
        }
        if ip.as_deref().is_some_and(|ip| ip != r.peer_ip) {
            return refused(Reason::DiscoveryAddressConflict, None);
        }
    }
    let ttl = crate::join::issue::cert_ttl(cfg, "ramdisk", "discovery");
    let token = (bearer.id.as_str(), &t);
    if let Some((id, state, Some(pool_id), csr)) = &current {
        if state == "approved" && *csr == csr_hex {
            // The approved retry: admitted, the request consumed, the token spent.
            let pool = crate::store::tenancy::pool_by_id(tx, pool_id)?;
            let Some(pool) = pool.filter(|p| p.archived_at.is_none() && p.agent == "bcd") else {
                return refused(Reason::Pool, None);
            };
            if !pool.allows_attestor("discovery") {
                return refused(Reason::PoolAttestor, None);
            }
            return match &known {
                // The operator put it in the pool of the node holding its key: that node again.
                Some(k) if k.reclaimable_approved(&pool.id) => {
                    let by = Vouched::Approval(id);
                    reclaim(tx, site, signer, r, token, k, by, ttl, now)
                }
                // A node elsewhere (another tenant's, site's or pool's) is never joined.
                Some(_) => refused(Reason::Reclaim, None),
                None => {
                    let by = Vouched::Approval(id);
                    admit_new(tx, site, signer, r, token, &pool, by, ttl, now)
                }
            };
        }
    }
    if cfg.discovery.approval == "unknown-machines" {
        if let Some(k) = known
            .as_ref()
            .filter(|k| k.reclaimable_unapproved(&t.mac, t.sighted))
        {
            let by = Vouched::KnownMachine(current.as_ref().map(|c| c.0.as_str()));
            return reclaim(tx, site, signer, r, token, k, by, ttl, now);
        }
    }
    let claims_json = serde_json::to_string(&r.claims).expect("serializes");
    let pending_until = now + cfg.discovery.pending_ttl_seconds as i64;
    let seen = crate::store::requests::Seen {
        csr_sha256: &csr_hex,
        claims_json: &claims_json,
        ip: &r.peer_ip,
        expires_at: pending_until,
    };
    match current {
        Some((id, _, _, _)) => {
            // Pending, or approved for another CSR (the machine rebooted): pending again, refreshed.
            crate::store::requests::refresh_discovery(
                tx,
                &id,
                &seen,
                (&t.mac, t.boot_lease_epoch, &bearer.id),
                now,
            )?;
            Ok(Decided::Deferred(deferral(
                site,
                signer,
                &id,
                &r.csr.sha256,
            )))
        }
        None => {
            let id = crate::base::ids::new_id("jreq", now * 1000);
            let hardware_key = r.key.as_ref().map(|k| k.hex.as_str());
            let vouched_by = format!("boot-server:{}", cfg.site_id);
            crate::store::requests::insert(
                tx,
                &crate::store::requests::New {
                    id: &id,
                    site_id: &cfg.site_id,
                    attestor: "discovery",
                    machine_key: &machine_key,
                    hardware_key,
                    hardware_key_trusted: trusted.is_some(),
                    seen,
                    vouched_by: &vouched_by,
                    mac: Some(&t.mac),
                    boot_lease_epoch: t.boot_lease_epoch,
                    token_id: Some(&bearer.id),
                    ek_certified: None,
                },
                now,
            )?;
            crate::store::events::publish(
                tx,
                now,
                &site.root_tenant,
                "join-request.created",
                json!({"requestId": id, "attestor": "discovery", "mac": t.mac}),
            )?;
            Ok(Decided::Deferred(deferral(
                site,
                signer,
                &id,
                &r.csr.sha256,
            )))
        }
    }
}

/// What admitted a discovery join: an operator's approval of a request, or (under
/// `unknown-machines`) the machine's being a known node, with the request it may have had open.
enum Vouched<'a> {
    Approval(&'a str),
    KnownMachine(Option<&'a str>),
}

impl Vouched<'_> {
    fn request(&self) -> Option<&str> {
        match self {
            Vouched::Approval(r) => Some(r),
            Vouched::KnownMachine(r) => *r,
        }
    }

    /// The audit row's actor suffix.
    fn label(&self) -> &str {
        match self {
            Vouched::Approval(r) => r,
            Vouched::KnownMachine(_) => "known-machine",
        }
    }
}

/// The node holding the machine's key, again: identity generation + 1, every older certificate
/// revoked (`reclaimed`), role `ramdisk`, the rediscovery mark cleared, its sessions ended, its
/// open request closed, `node.reclaimed` audited. Its recorded MACs and boot MAC change only
/// with an approval.
#[allow(clippy::too_many_arguments)]
fn reclaim(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    (token_id, t): (&str, &TokenRow),
    k: &HeldBy,
    by: Vouched<'_>,
    ttl: i64,
    now: i64,
) -> ApiResult<Decided> {
    let approved = matches!(by, Vouched::Approval(_));
    let record = Record {
        claims: approved,
        identifiers_by: approved.then_some("approval"),
        boot_mac: approved.then(|| t.mac.clone()),
        clear_rediscover: true,
        ..Default::default()
    };
    let target = Target::Again {
        node_id: k.id.clone(),
        generation: k.generation + 1,
        trust: None,
    };
    // The node's own pool (a node's pool always exists).
    let pool = crate::store::tenancy::pool_by_id(tx, &k.pool_id)?
        .ok_or_else(|| crate::base::error::ApiError::internal("a node's pool is missing"))?;
    issue(
        tx,
        site,
        signer,
        r,
        token_id,
        (&k.tenant_id, &pool, target, record),
        &by,
        ttl,
        now,
    )
}

/// A new `ramdisk` node in the approved pool. A retired node that still holds the machine's
/// trusted key gives it up: the operator approved this machine, and the key names one node.
#[allow(clippy::too_many_arguments)]
fn admit_new(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    (token_id, t): (&str, &TokenRow),
    pool: &crate::domain::pool::Pool,
    by: Vouched<'_>,
    ttl: i64,
    now: i64,
) -> ApiResult<Decided> {
    if let Some(k) = r.key.as_ref().filter(|k| k.trusted) {
        crate::store::nodes::release_retired_key(tx, &k.hex, now)?;
    }
    let record = Record {
        claims: true,
        identifiers_by: Some("approval"),
        boot_mac: Some(t.mac.clone()),
        ..Default::default()
    };
    let target = Target::New {
        trust: owned_trust(&pool.tenant_id, &site.root_tenant),
    };
    issue(
        tx,
        site,
        signer,
        r,
        token_id,
        (&pool.tenant_id, pool, target, record),
        &by,
        ttl,
        now,
    )
}

/// What every discovery admission is: a `ramdisk` node (new or again) written by the one
/// admission path, the token spent, the request it answers consumed.
#[allow(clippy::too_many_arguments)]
fn issue(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    token_id: &str,
    (tenant_id, pool, target, record): (&str, &crate::domain::pool::Pool, Target<'_>, Record),
    by: &Vouched<'_>,
    ttl: i64,
    now: i64,
) -> ApiResult<Decided> {
    let reclaim = matches!(target, Target::Again { .. });
    let admission = Admission {
        attestor: "discovery",
        actor: format!("discovery:{}", by.label()),
        tenant_id,
        site_id: &site.config.site_id,
        pool,
        role: "ramdisk",
        target,
        record,
        hardware_key_trusted: r.key.as_ref().is_some_and(|k| k.trusted),
        statements: Vec::new(),
        ttl,
        node_key: "unattested",
        consumes: by.request(),
        event: json!({"knownMachine": reclaim}),
    };
    let decided = write(tx, site, signer, r, admission, now)?;
    spend(tx, token_id, now)?;
    Ok(decided)
}

fn spend(tx: &Tx<'_>, token: &str, now: i64) -> ApiResult<()> {
    crate::store::discovery::spend(tx, token, now)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loose_macs() {
        assert_eq!(
            loose_mac("52-54-00-AB-CD-EF").as_deref(),
            Some("52:54:00:ab:cd:ef")
        );
        assert_eq!(
            loose_mac("5254.00ab.cdef").as_deref(),
            Some("52:54:00:ab:cd:ef")
        );
        assert_eq!(loose_mac("52:54:00:ab:cd"), None);
        assert_eq!(loose_mac("zz:54:00:ab:cd:ef"), None);
    }
}
