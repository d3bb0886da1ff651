//! The `discovery` attestor and its join requests: a PXE-booted ramdisk joins with a single-use,
//! MAC-bound discovery token. A known machine (its trusted hardware key is a node's) is admitted
//! at once under `approval = "unknown-machines"`; any other machine (every machine under
//! `always`) is recorded as a join request and answered with a signed deferral; nothing is issued
//! and no token spent. An approval admits exactly one join: the retry with the approved CSR.

use crate::admission::Reason;
use crate::api::{self, Bearer};
use crate::app::App;
use crate::crypto;
use crate::error::ApiResult;
use crate::joinservice::{certify, refused, Decided, Ready, Signer, Subject};
use crate::protocol::{JoinDeferral, JoinResponse, Outcome, JOIN_DEFERRAL_PURPOSE};
use rusqlite::{params, OptionalExtension, Transaction};
use serde_json::json;

/// A MAC with any separators and case as `aa:bb:cc:dd:ee:ff` (any address: the boot MAC of a VM
/// may be locally administered).
pub fn loose_mac(v: &str) -> Option<String> {
    let hex: String = v
        .trim()
        .chars()
        .filter(|c| !matches!(c, ':' | '-' | '.'))
        .collect::<String>()
        .to_ascii_lowercase();
    if hex.len() != 12 || !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    Some(
        (0..6)
            .map(|i| &hex[2 * i..2 * i + 2])
            .collect::<Vec<_>>()
            .join(":"),
    )
}

/// Marks requests past their expiry `expired`.
pub fn expire(tx: &Transaction<'_>, now: i64) -> ApiResult<()> {
    crate::store::exec(tx,
        "UPDATE join_requests SET state = 'expired', updated_at = ?1 WHERE state IN ('pending', 'approved') AND expires_at <= ?1",
        [now],
    )?;
    Ok(())
}

/// A new discovery token for `mac`, voiding the MAC's earlier ones; or `LocalBoot` when the MAC
/// belongs to an adopted node not marked for rediscovery.
pub(crate) fn mint(
    tx: &Transaction<'_>,
    app: &App,
    mac: &str,
    epoch: Option<i64>,
    now: i64,
) -> ApiResult<Outcome> {
    let Some(mac) = loose_mac(mac) else {
        return Ok(Outcome::Refused);
    };
    let local: Option<String> = crate::store::query_row(tx,
            "SELECT id FROM nodes WHERE boot_mac = ?1 AND state = 'adopted' AND rediscover = 0 AND role != 'ramdisk'",
            [&mac],
            |r| r.get(0),
        )
        .optional()?;
    if local.is_some() {
        return Ok(Outcome::LocalBoot);
    }
    crate::store::exec(tx,
        "UPDATE discovery_tokens SET voided_at = ?2 WHERE mac = ?1 AND spent_at IS NULL AND voided_at IS NULL",
        params![mac, now],
    )?;
    let mut secret = zeroize::Zeroizing::new([0u8; 32]);
    crypto::fill_random(secret.as_mut());
    let bearer = Bearer {
        id: crate::ids::new_id("jt", now * 1000),
        secret,
    };
    crate::store::exec(tx,
        "INSERT INTO discovery_tokens (id, site_id, mac, secret_sha256, boot_lease_epoch, created_at, expires_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            bearer.id,
            app.config.site_id,
            mac,
            crypto::sha256(bearer.secret.as_ref()).to_vec(),
            epoch,
            now,
            now + app.config.discovery.pending_ttl_seconds as i64
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
}

pub(crate) fn deferral(
    app: &App,
    signer: &Signer,
    request_id: &str,
    csr_sha256: &[u8; 32],
) -> JoinResponse {
    let body = JoinDeferral {
        request_id: request_id.to_string(),
        state: "pending".into(),
        retry_after_seconds: app.config.discovery.retry_after_seconds,
        csr_sha256: crypto::hex(csr_sha256),
        site_id: app.config.site_id.clone(),
    };
    signer.signed(JOIN_DEFERRAL_PURPOSE, &body)
}

/// Stage 2 of a discovery join, inside its savepoint.
pub(crate) fn admit(
    tx: &Transaction<'_>,
    app: &App,
    signer: &Signer,
    r: &Ready,
    now: i64,
) -> ApiResult<Decided> {
    let crate::joinservice::Proof::Bearer(bearer) = &r.proof else {
        return refused(Reason::Attestor, None);
    };
    expire(tx, now)?;
    let row = crate::store::query_row(tx,
            "SELECT mac, secret_sha256, boot_lease_epoch, expires_at, spent_at, voided_at FROM discovery_tokens WHERE id = ?1",
            [&bearer.id],
            |x| {
                Ok(TokenRow {
                    mac: x.get(0)?,
                    secret_sha256: x.get(1)?,
                    boot_lease_epoch: x.get(2)?,
                    expires_at: x.get(3)?,
                    spent: x.get::<_, Option<i64>>(4)?.is_some(),
                    voided: x.get::<_, Option<i64>>(5)?.is_some(),
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
    let cfg = &app.config;
    let trusted = r.key.as_ref().filter(|k| k.trusted).map(|k| k.hex.clone());
    let machine_key = trusted
        .clone()
        .unwrap_or_else(|| format!("mac:{}:{}", cfg.site_id, t.mac));
    let known: Option<(String, String, String, i64)> = match &trusted {
        Some(k) => crate::store::query_row(tx,
                "SELECT id, tenant_id, pool_id, identity_generation FROM nodes WHERE hardware_key = ?1 AND hardware_key_trusted = 1 AND state != 'retired'",
                [k],
                |x| Ok((x.get(0)?, x.get(1)?, x.get(2)?, x.get(3)?)),
            )
            .optional()?,
        None => None,
    };
    let ttl = cfg.discovery.cert_ttl_seconds.min(7200) as i64;
    if cfg.discovery.approval == "unknown-machines" {
        if let Some((node, tenant, pool, generation)) = &known {
            let (response, serial) = certify(
                tx,
                app,
                signer,
                &Subject {
                    node_id: node,
                    generation: *generation,
                    role: "ramdisk",
                    statements: &[],
                    ttl,
                },
                &r.csr,
                now,
            )?;
            spend(tx, &bearer.id, now)?;
            crate::store::exec(
                tx,
                "UPDATE nodes SET boot_mac = ?2, updated_at = ?3 WHERE id = ?1",
                params![node, t.mac, now],
            )?;
            joined(
                tx,
                now,
                tenant,
                node,
                pool,
                &serial,
                r,
                "known-machine",
                true,
            )?;
            return Ok(Decided::Issued(response));
        }
    }
    let csr_hex = crypto::hex(&r.csr.sha256);
    if rejected(tx, &machine_key, &csr_hex)? {
        return refused(Reason::DiscoveryRejected, None);
    }
    let current = open_request(tx, &machine_key)?;
    let claims_json = serde_json::to_string(&r.claims).expect("serializes");
    let pending_until = now + cfg.discovery.pending_ttl_seconds as i64;
    match current {
        Some((id, state, Some(pool_id), csr)) if state == "approved" && csr == csr_hex => {
            // The approved retry: admitted, the request consumed, the token spent.
            let pool = api::pool_by_id(tx, &pool_id)?;
            let Some(pool) = pool.filter(|p| p.archived_at.is_none() && p.agent == "bcd") else {
                return refused(Reason::Pool, None);
            };
            let (node, generation) = match &known {
                Some((node, _, _, generation)) => (node.clone(), *generation),
                None => {
                    let node = crate::ids::new_id("node", now * 1000);
                    crate::store::exec(tx,
                        "INSERT INTO nodes (id, tenant_id, site_id, pool_id, role, state, trust, hardware_key, hardware_key_trusted,
                         identity_generation, attestor, hostname, claims_json, created_at, updated_at, boot_mac)
                         VALUES (?1, ?2, ?3, ?4, 'ramdisk', 'adopting', ?5, ?6, ?7, 1, 'discovery', ?8, ?9, ?10, ?10, ?11)",
                        params![
                            node,
                            pool.tenant_id,
                            cfg.site_id,
                            pool.id,
                            if pool.tenant_id == app.root_tenant { "platform" } else { "tenant-owned" },
                            r.key.as_ref().map(|k| k.hex.clone()),
                            trusted.is_some() as i64,
                            r.claims.hostname,
                            claims_json,
                            now,
                            t.mac
                        ],
                    )?;
                    (node, 1)
                }
            };
            let (response, serial) = certify(
                tx,
                app,
                signer,
                &Subject {
                    node_id: &node,
                    generation,
                    role: "ramdisk",
                    statements: &[],
                    ttl,
                },
                &r.csr,
                now,
            )?;
            spend(tx, &bearer.id, now)?;
            crate::store::exec(tx,
                "UPDATE join_requests SET state = 'consumed', consumed_at = ?2, node_id = ?3, updated_at = ?2 WHERE id = ?1",
                params![id, now, node],
            )?;
            joined(
                tx,
                now,
                &pool.tenant_id,
                &node,
                &pool.id,
                &serial,
                r,
                &id,
                known.is_some(),
            )?;
            crate::joinservice::adopt(tx, &pool.tenant_id, &node, &pool.id, now)?;
            Ok(Decided::Issued(response))
        }
        Some((id, _, _, _)) => {
            // Pending, or approved for another CSR (the machine rebooted): pending again, refreshed.
            crate::store::exec(tx,
                "UPDATE join_requests SET state = 'pending', pool_id = NULL, decided_at = NULL, decided_by = NULL, reason = NULL,
                 csr_sha256 = ?2, claims_json = ?3, ip = ?4, mac = ?5, boot_lease_epoch = ?6, updated_at = ?7, expires_at = ?8
                 WHERE id = ?1",
                params![id, csr_hex, claims_json, r.peer_ip, t.mac, t.boot_lease_epoch, now, pending_until],
            )?;
            Ok(Decided::Deferred(deferral(app, signer, &id, &r.csr.sha256)))
        }
        None => {
            let id = crate::ids::new_id("jreq", now * 1000);
            crate::store::exec(tx,
                "INSERT INTO join_requests (id, site_id, attestor, machine_key, hardware_key, hardware_key_trusted, claims_json, mac, ip,
                 vouched_by, boot_lease_epoch, csr_sha256, state, created_at, updated_at, expires_at)
                 VALUES (?1, ?2, 'discovery', ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, 'pending', ?12, ?12, ?13)",
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
                    pending_until
                ],
            )?;
            api::publish(
                tx,
                now,
                &app.root_tenant,
                "join-request.created",
                json!({"requestId": id, "attestor": "discovery", "mac": t.mac}),
            )?;
            Ok(Decided::Deferred(deferral(app, signer, &id, &r.csr.sha256)))
        }
    }
}

/// Whether an operator rejected this machine's request for this CSR (a retry with it fails).
pub(crate) fn rejected(tx: &Transaction<'_>, machine_key: &str, csr_hex: &str) -> ApiResult<bool> {
    Ok(crate::store::query_row(tx,
            "SELECT id FROM join_requests WHERE machine_key = ?1 AND state = 'rejected' AND csr_sha256 = ?2",
            params![machine_key, csr_hex],
            |x| x.get::<_, String>(0),
        )
        .optional()?
        .is_some())
}

/// A machine's open request: id, state (`pending` or `approved`), pool, CSR hash.
pub(crate) type OpenRequest = (String, String, Option<String>, String);

/// A machine's newest open request.
pub(crate) fn open_request(
    tx: &Transaction<'_>,
    machine_key: &str,
) -> ApiResult<Option<OpenRequest>> {
    Ok(crate::store::query_row(tx,
            "SELECT id, state, pool_id, csr_sha256 FROM join_requests WHERE machine_key = ?1 AND state IN ('pending', 'approved')
             ORDER BY created_at DESC LIMIT 1",
            [machine_key],
            |x| Ok((x.get(0)?, x.get(1)?, x.get(2)?, x.get(3)?)),
        )
        .optional()?)
}

fn spend(tx: &Transaction<'_>, token: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE discovery_tokens SET spent_at = ?2 WHERE id = ?1 AND spent_at IS NULL",
        params![token, now],
    )?;
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn joined(
    tx: &Transaction<'_>,
    now: i64,
    tenant: &str,
    node: &str,
    pool: &str,
    serial: &str,
    r: &Ready,
    vouched: &str,
    known: bool,
) -> ApiResult<()> {
    let data = json!({
        "nodeId": node,
        "poolId": pool,
        "attestor": "discovery",
        "reclaim": false,
        "knownMachine": known,
        "hardwareKeyTrusted": r.key.as_ref().is_some_and(|k| k.trusted),
        "certificateSerial": serial,
        "nodeKey": "unattested",
        "role": "ramdisk",
    });
    api::publish(tx, now, tenant, "node.joined", data.clone())?;
    api::audit(
        tx,
        now,
        tenant,
        "node.joined",
        &format!("discovery:{vouched}"),
        node,
        data,
    )
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
