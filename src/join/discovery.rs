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
use rusqlite::{params, OptionalExtension, Transaction};
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
/// operator approved); or `LocalBoot` when the MAC belongs to an adopted node not marked for
/// rediscovery.
pub(crate) fn mint(tx: &Transaction<'_>, site: &Site, m: &Mint, now: i64) -> ApiResult<Outcome> {
    let Some(mac) = loose_mac(&m.mac) else {
        return Ok(Outcome::Refused);
    };
    let epoch = m.boot_lease_epoch;
    let local: Option<String> = crate::store::query_row(tx,
            "SELECT id FROM nodes WHERE boot_mac = ?1 AND state = 'adopted' AND rediscover = 0 AND role != 'ramdisk'",
            [&mac],
            |r| r.get(0),
        )
        .optional()?;
    if local.is_some() {
        return Ok(Outcome::LocalBoot);
    }
    if !m.mint {
        return Ok(Outcome::Refused);
    }
    // The token of an approved request stays good: a boot of the same MAC (anyone's, a minute
    // later) must not void what an operator's approval is waiting for.
    crate::store::exec(tx,
        "UPDATE discovery_tokens SET voided_at = ?2 WHERE mac = ?1 AND spent_at IS NULL AND voided_at IS NULL
         AND id NOT IN (SELECT token_id FROM join_requests WHERE state = 'approved' AND token_id IS NOT NULL)",
        params![mac, now],
    )?;
    let mut secret = zeroize::Zeroizing::new([0u8; 32]);
    crypto::fill_random(secret.as_mut());
    let bearer = Bearer {
        id: crate::base::ids::new_id("jt", now * 1000),
        secret,
    };
    crate::store::exec(tx,
        "INSERT INTO discovery_tokens (id, site_id, mac, secret_sha256, boot_lease_epoch, created_at, expires_at, sighted_ip)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
        params![
            bearer.id,
            site.config.site_id,
            mac,
            crypto::sha256(bearer.secret.as_ref()).to_vec(),
            epoch,
            now,
            now + site.config.discovery.pending_ttl_seconds as i64,
            m.sighted_ip
        ],
    )?;
    Ok(Outcome::DiscoveryToken {
        token: bearer.render().to_string(),
    })
}

struct TokenRow {
    mac: String,
    secret_sha256: Vec<u8>,
    boot_lease_epoch: Option<i64>,
    expires_at: i64,
    spent: bool,
    voided: bool,
    /// Minted for an address the network saw the MAC at.
    sighted: bool,
}

/// The live (not retired) node holding a trusted hardware key.
pub(crate) fn held_by(tx: &Transaction<'_>, key: &str) -> ApiResult<Option<HeldBy>> {
    let row = crate::store::query_row(tx,
            "SELECT id, tenant_id, pool_id, role, identity_generation, boot_mac, claims_json, identifiers_by, connected, rediscover
             FROM nodes WHERE hardware_key = ?1 AND hardware_key_trusted = 1 AND state != 'retired'",
            [key],
            |x| {
                Ok((
                    HeldBy {
                        id: x.get(0)?,
                        tenant_id: x.get(1)?,
                        pool_id: x.get(2)?,
                        role: x.get(3)?,
                        generation: x.get(4)?,
                        boot_mac: x.get(5)?,
                        claim_macs: Vec::new(),
                        identifiers_by: x.get(7)?,
                        connected: x.get::<_, i64>(8)? != 0,
                        rediscover: x.get::<_, i64>(9)? != 0,
                        pool_allows_discovery: false,
                    },
                    x.get::<_, String>(6)?,
                ))
            },
        )
        .optional()?;
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
    tx: &Transaction<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    now: i64,
) -> ApiResult<Decided> {
    let crate::join::issue::Proof::Bearer(bearer) = &r.proof else {
        return refused(Reason::Attestor, None);
    };
    expire(tx, now)?;
    let row = crate::store::query_row(tx,
            "SELECT mac, secret_sha256, boot_lease_epoch, expires_at, spent_at, voided_at, sighted_ip FROM discovery_tokens WHERE id = ?1",
            [&bearer.id],
            |x| {
                Ok(TokenRow {
                    mac: x.get(0)?,
                    secret_sha256: x.get(1)?,
                    boot_lease_epoch: x.get(2)?,
                    expires_at: x.get(3)?,
                    spent: x.get::<_, Option<i64>>(4)?.is_some(),
                    voided: x.get::<_, Option<i64>>(5)?.is_some(),
                    sighted: x.get::<_, Option<String>>(6)?.is_some(),
                })
            },
        )
        .optional()?;
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
    let reused: Option<String> = crate::store::query_row(
        tx,
        "SELECT id FROM join_requests WHERE token_id = ?1 AND machine_key != ?2 LIMIT 1",
        params![bearer.id, machine_key],
        |x| x.get(0),
    )
    .optional()?;
    if reused.is_some() {
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
        let (mac, ip): (Option<String>, Option<String>) = crate::store::query_row(
            tx,
            "SELECT mac, ip FROM join_requests WHERE id = ?1",
            [id],
            |x| Ok((x.get(0)?, x.get(1)?)),
        )?;
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
    match current {
        Some((id, _, _, _)) => {
            // Pending, or approved for another CSR (the machine rebooted): pending again, refreshed.
            crate::store::exec(tx,
                "UPDATE join_requests SET state = 'pending', pool_id = NULL, decided_at = NULL, decided_by = NULL, reason = NULL,
                 csr_sha256 = ?2, claims_json = ?3, ip = ?4, mac = ?5, boot_lease_epoch = ?6, updated_at = ?7, expires_at = ?8,
                 token_id = ?9 WHERE id = ?1",
                params![id, csr_hex, claims_json, r.peer_ip, t.mac, t.boot_lease_epoch, now, pending_until, bearer.id],
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
            crate::store::exec(tx,
                "INSERT INTO join_requests (id, site_id, attestor, machine_key, hardware_key, hardware_key_trusted, claims_json, mac, ip,
                 vouched_by, boot_lease_epoch, csr_sha256, state, created_at, updated_at, expires_at, token_id)
                 VALUES (?1, ?2, 'discovery', ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, 'pending', ?12, ?12, ?13, ?14)",
                params![
                    id,
                    cfg.site_id,
                    machine_key,
                    r.key.as_ref().map(|k| k.hex.clone()),
                    trusted.is_some() as i64,
                    claims_json,
                    t.mac,
                    r.peer_ip,
                    format!("boot-server:{}", cfg.site_id),
                    t.boot_lease_epoch,
                    csr_hex,
                    now,
                    pending_until,
                    bearer.id
                ],
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
    tx: &Transaction<'_>,
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
    issue(
        tx,
        site,
        signer,
        r,
        token_id,
        (&k.tenant_id, &k.pool_id, target, record),
        &by,
        ttl,
        now,
    )
}

/// A new `ramdisk` node in the approved pool. A retired node that still holds the machine's
/// trusted key gives it up: the operator approved this machine, and the key names one node.
#[allow(clippy::too_many_arguments)]
fn admit_new(
    tx: &Transaction<'_>,
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
        crate::store::exec(
            tx,
            "UPDATE nodes SET hardware_key_trusted = 0, updated_at = ?2
             WHERE hardware_key = ?1 AND hardware_key_trusted = 1 AND state = 'retired'",
            params![k.hex, now],
        )?;
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
        (&pool.tenant_id, &pool.id, target, record),
        &by,
        ttl,
        now,
    )
}

/// What every discovery admission is: a `ramdisk` node (new or again) written by the one
/// admission path, the token spent, the request it answers consumed.
#[allow(clippy::too_many_arguments)]
fn issue(
    tx: &Transaction<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    token_id: &str,
    (tenant_id, pool_id, target, record): (&str, &str, Target<'_>, Record),
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
        pool_id,
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

fn spend(tx: &Transaction<'_>, token: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE discovery_tokens SET spent_at = ?2 WHERE id = ?1 AND spent_at IS NULL",
        params![token, now],
    )?;
    Ok(())
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
