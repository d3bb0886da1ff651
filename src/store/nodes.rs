//! Node certificates: revoking every live one of a node (a reclaim, `nodes/revoke-identity`,
//! `nodes/delete`), each with its `security.certificate-revoked` event.

use crate::base::clock::rfc3339;
use crate::base::error::ApiResult;
use crate::domain::admission::{HeldBy, KnownNode};
use crate::store::found;
use crate::store::Tx;
use crate::store::{params, OptionalExtension};
use serde_json::{json, Value};

/// Revokes every unrevoked certificate of `node_id` (`reason`, with a
/// `security.certificate-revoked` event for each).
pub fn revoke_all(
    tx: &Tx<'_>,
    tenant: &str,
    node_id: &str,
    reason: &str,
    now: i64,
) -> ApiResult<Vec<String>> {
    let serials: Vec<String> = crate::store::query_all(
        tx,
        "SELECT serial FROM node_certs WHERE node_id = ?1 AND revoked_at IS NULL",
        [node_id],
        |row| row.get(0),
    )?;
    for serial in &serials {
        crate::store::exec(
            tx,
            "UPDATE node_certs SET revoked_at = ?2, revoke_reason = ?3 WHERE serial = ?1",
            params![serial, now, reason],
        )?;
        crate::store::events::publish(
            tx,
            now,
            tenant,
            "security.certificate-revoked",
            json!({"nodeId": node_id, "serial": serial, "reason": reason}),
        )?;
    }
    Ok(serials)
}

/// No session outlives a restart of the appliance: every node disconnected.
/// (on a site of several appliances: the sessions this appliance held, and those no appliance
/// recorded).
pub fn disconnect_all(tx: &Tx<'_>) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE nodes SET connected = 0, session_appliance = NULL
         WHERE connected = 1 AND (session_appliance IS NULL OR session_appliance = ?1)",
        [crate::store::appliances::this()],
    )?;
    Ok(())
}

/// The sessions of appliances whose lease ran out (`heartbeat_at` before `stale_before`):
/// disconnected, with their nodes and tenants (for the events).
pub fn disconnect_dead(tx: &Tx<'_>, stale_before: i64) -> ApiResult<Vec<(String, String)>> {
    let rows: Vec<(String, String)> = crate::store::query_all(
        tx,
        "SELECT n.id, n.tenant_id FROM nodes n JOIN site_appliances a ON a.id = n.session_appliance
         WHERE n.connected = 1 AND (a.state = 'removed' OR COALESCE(a.heartbeat_at, 0) < ?1)",
        [stale_before],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )?;
    for (node, _) in &rows {
        crate::store::exec(
            tx,
            "UPDATE nodes SET connected = 0, session_appliance = NULL WHERE id = ?1",
            [node],
        )?;
    }
    Ok(rows)
}

/// The node holding a trusted hardware key (retired or not), as the token admission weighs it.
pub fn by_trusted_key(tx: &Tx<'_>, hex: &str) -> ApiResult<Option<KnownNode>> {
    Ok(crate::store::query_row(
        tx,
        "SELECT id, tenant_id, site_id, pool_id, role, state, trust, identity_generation FROM nodes
         WHERE hardware_key = ?1 AND hardware_key_trusted = 1",
        [hex],
        |row| {
            Ok(KnownNode {
                id: row.get(0)?,
                tenant_id: row.get(1)?,
                site_id: row.get(2)?,
                pool_id: row.get(3)?,
                role: row.get(4)?,
                state: row.get(5)?,
                trust: row.get(6)?,
                identity_generation: row.get(7)?,
            })
        },
    )
    .optional()?)
}

/// Whether any node holds this hardware key as trusted.
pub fn trusted_key_taken(tx: &Tx<'_>, hex: &str) -> ApiResult<bool> {
    Ok(by_trusted_key(tx, hex)?.is_some())
}

/// The live (not retired) node holding a trusted hardware key, as discovery weighs it, with its
/// recorded claims (JSON). `claim_macs` and `pool_allows_discovery` are left for the caller.
pub fn held_by(tx: &Tx<'_>, key: &str) -> ApiResult<Option<(HeldBy, String)>> {
    Ok(crate::store::query_row(tx,
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
        .optional()?)
}

/// A retired node that still holds a trusted hardware key gives it up (a new node takes it).
pub fn release_retired_key(tx: &Tx<'_>, hex: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE nodes SET hardware_key_trusted = 0, updated_at = ?2
         WHERE hardware_key = ?1 AND hardware_key_trusted = 1 AND state = 'retired'",
        params![hex, now],
    )?;
    Ok(())
}

/// The newest live node a TPM's EK admitted.
pub struct EkNode {
    pub id: String,
    pub tenant_id: String,
    pub pool_id: String,
    pub role: String,
    pub generation: i64,
}

pub fn by_ek(tx: &Tx<'_>, ek_sha256: &str) -> ApiResult<Option<EkNode>> {
    Ok(crate::store::query_row(
        tx,
        "SELECT id, tenant_id, pool_id, role, identity_generation FROM nodes
         WHERE tpm_ek_sha256 = ?1 AND state != 'retired' ORDER BY created_at DESC LIMIT 1",
        [ek_sha256],
        |x| {
            Ok(EkNode {
                id: x.get(0)?,
                tenant_id: x.get(1)?,
                pool_id: x.get(2)?,
                role: x.get(3)?,
                generation: x.get(4)?,
            })
        },
    )
    .optional()?)
}

/// Whether a retired node holds this EK.
pub fn ek_retired(tx: &Tx<'_>, ek_sha256: &str) -> ApiResult<bool> {
    Ok(crate::store::query_row(
        tx,
        "SELECT EXISTS(SELECT 1 FROM nodes WHERE tpm_ek_sha256 = ?1 AND state = 'retired')",
        [ek_sha256],
        |x| x.get::<_, bool>(0),
    )?)
}

/// Whether the MAC belongs to a node that boots its local disk, not marked for rediscovery: an
/// adopted OS node; a `node`-role node still `adopting` (its OS starting, or waiting for its
/// acceptance checks); a node with an unspent, unexpired `provisioned` token (its OS being
/// installed).
pub fn boots_local_disk(tx: &Tx<'_>, mac: &str, now: i64) -> ApiResult<bool> {
    Ok(crate::store::query_row(tx,
            "SELECT id FROM nodes n WHERE boot_mac = ?1 AND rediscover = 0 AND state != 'retired' AND (
               (state = 'adopted' AND role != 'ramdisk')
               OR (state = 'adopting' AND role = 'node')
               OR EXISTS (SELECT 1 FROM join_tokens t WHERE t.node_id = n.id AND t.role = 'provisioned'
                          AND t.revoked_at IS NULL AND t.uses_left > 0 AND t.expires_at > ?2))
             LIMIT 1",
            params![mac, now],
            |r| r.get::<_, String>(0),
        )
        .optional()?
        .is_some())
}

/// A new node's row, identity generation 1, `adopting`.
pub struct NewNode<'a> {
    pub id: &'a str,
    pub tenant_id: &'a str,
    pub site_id: &'a str,
    pub pool_id: &'a str,
    pub role: &'a str,
    pub trust: &'a str,
    pub hardware_key: Option<&'a str>,
    pub hardware_key_trusted: bool,
    pub attestor: &'a str,
    pub hostname: Option<&'a str>,
    pub claims_json: &'a str,
    pub boot_mac: Option<&'a str>,
    pub identifiers_by: &'a str,
    pub tpm_ek_sha256: Option<&'a str>,
}

/// The appliance's one node `INSERT`.
pub fn insert(tx: &Tx<'_>, n: &NewNode<'_>, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "INSERT INTO nodes (id, tenant_id, site_id, pool_id, role, state, trust, hardware_key,
         hardware_key_trusted, identity_generation, attestor, hostname, claims_json, created_at,
         updated_at, boot_mac, identifiers_by, tpm_ek_sha256)
         VALUES (?1, ?2, ?3, ?4, ?5, 'adopting', ?6, ?7, ?8, 1, ?9, ?10, ?11, ?12, ?12, ?13, ?14, ?15)",
        params![
            n.id,
            n.tenant_id,
            n.site_id,
            n.pool_id,
            n.role,
            n.trust,
            n.hardware_key,
            n.hardware_key_trusted as i64,
            n.attestor,
            n.hostname,
            n.claims_json,
            now,
            n.boot_mac,
            n.identifiers_by,
            n.tpm_ek_sha256,
        ],
    )?;
    Ok(())
}

/// A node again (a reclaim): its next generation, `adopting`; `None` (or `false`) keeps what
/// the row had.
pub struct Again<'a> {
    pub node_id: &'a str,
    pub generation: i64,
    pub role: &'a str,
    pub trust: Option<&'a str>,
    pub clear_rediscover: bool,
    /// The join's hostname and claims (JSON), to record.
    pub claims: Option<(Option<&'a str>, &'a str)>,
    pub identifiers_by: Option<&'a str>,
    pub boot_mac: Option<&'a str>,
}

/// The reclaim's `UPDATE` (its certificates are revoked by [`revoke_all`]).
pub fn again(tx: &Tx<'_>, a: &Again<'_>, now: i64) -> ApiResult<()> {
    let (hostname, claims_json) = a.claims.unwrap_or((None, ""));
    crate::store::exec(
        tx,
        "UPDATE nodes SET identity_generation = ?2, state = 'adopting', role = ?3,
         trust = COALESCE(?4, trust),
         rediscover = CASE WHEN ?5 THEN 0 ELSE rediscover END,
         hostname = CASE WHEN ?6 THEN ?7 ELSE hostname END,
         claims_json = CASE WHEN ?6 THEN ?8 ELSE claims_json END,
         identifiers_by = COALESCE(?9, identifiers_by),
         boot_mac = COALESCE(?10, boot_mac),
         conditions = NULL, hello_facts = NULL,
         updated_at = ?11
         WHERE id = ?1",
        params![
            a.node_id,
            a.generation,
            a.role,
            a.trust,
            a.clear_rediscover,
            a.claims.is_some(),
            hostname,
            claims_json,
            a.identifiers_by,
            a.boot_mac,
            now,
        ],
    )?;
    Ok(())
}

/// An `adopting` node adopted; `false` when it was not `adopting`.
pub fn mark_adopted(tx: &Tx<'_>, node_id: &str) -> ApiResult<bool> {
    Ok(crate::store::exec(
        tx,
        "UPDATE nodes SET state = 'adopted' WHERE id = ?1 AND state = 'adopting'",
        [node_id],
    )? == 1)
}

/// A certificate issued to a node.
pub struct NewCert<'a> {
    pub serial: &'a str,
    pub node_id: &'a str,
    pub generation: i64,
    pub role: &'a str,
    pub spki_sha256: &'a str,
    pub der: &'a [u8],
    pub not_before: i64,
    pub not_after: i64,
}

pub fn insert_cert(tx: &Tx<'_>, c: &NewCert<'_>, now: i64) -> ApiResult<()> {
    crate::store::exec(tx,
        "INSERT INTO node_certs (serial, node_id, identity_generation, role, spki_sha256, der, not_before, not_after, created_at)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)",
        params![c.serial, c.node_id, c.generation, c.role, c.spki_sha256, c.der, c.not_before, c.not_after, now],
    )?;
    Ok(())
}

/// A stored certificate (found byte for byte) and its node, as a session or a renewal weighs it.
pub struct Leaf {
    pub node_id: String,
    pub serial: String,
    pub generation: i64,
    pub role: String,
    pub not_after: i64,
    pub revoked: bool,
    pub state: String,
    pub current_generation: i64,
    pub attestor: String,
    pub tenant: String,
    pub pool_id: String,
    pub key_trusted: bool,
    pub connected: bool,
}

/// The `node_certs` row with this serial and exactly these bytes, with its node; `None` when the
/// certificate (or its node) is unknown.
pub fn leaf(tx: &Tx<'_>, serial: &str, der: &[u8]) -> ApiResult<Option<Leaf>> {
    Ok(crate::store::query_row(
        tx,
        "SELECT c.node_id, c.serial, c.identity_generation, c.role, c.not_after, c.revoked_at,
                n.state, n.identity_generation, n.attestor, n.tenant_id, n.connected, n.pool_id,
                n.hardware_key_trusted
         FROM node_certs c JOIN nodes n ON n.id = c.node_id WHERE c.serial = ?1 AND c.der = ?2",
        params![serial, der],
        |x| {
            Ok(Leaf {
                node_id: x.get(0)?,
                serial: x.get(1)?,
                generation: x.get(2)?,
                role: x.get(3)?,
                not_after: x.get(4)?,
                revoked: x.get::<_, Option<i64>>(5)?.is_some(),
                state: x.get(6)?,
                current_generation: x.get(7)?,
                attestor: x.get(8)?,
                tenant: x.get(9)?,
                connected: x.get::<_, i64>(10)? == 1,
                pool_id: x.get(11)?,
                key_trusted: x.get::<_, i64>(12)? == 1,
            })
        },
    )
    .optional()?)
}

/// A node's certificate as `x509pop` weighs it.
pub struct IssuedCert {
    pub serial: String,
    pub generation: i64,
    pub role: String,
    pub spki_sha256: String,
    pub der: Vec<u8>,
    pub not_after: i64,
    pub revoked: bool,
}

/// The node's last two certificates issued, newest first, whatever their state.
pub fn newest_certs(tx: &Tx<'_>, node_id: &str) -> ApiResult<Vec<IssuedCert>> {
    let out = crate::store::query_all(tx, "SELECT serial, identity_generation, role, spki_sha256, der, not_after, revoked_at FROM node_certs
         WHERE node_id = ?1 ORDER BY created_at DESC, rowid DESC LIMIT 2", [node_id], |x| {
            Ok(IssuedCert {
                serial: x.get(0)?,
                generation: x.get(1)?,
                role: x.get(2)?,
                spki_sha256: x.get(3)?,
                der: x.get(4)?,
                not_after: x.get(5)?,
                revoked: x.get::<_, Option<i64>>(6)?.is_some(),
            })
        })?;
    Ok(out)
}

/// Whether the node holds a certificate that is neither revoked nor expired at `now`.
pub fn has_live_cert(tx: &Tx<'_>, node_id: &str, now: i64) -> ApiResult<bool> {
    Ok(crate::store::query_row(
        tx,
        "SELECT EXISTS (SELECT 1 FROM node_certs WHERE node_id = ?1 AND revoked_at IS NULL AND not_after > ?2)",
        params![node_id, now],
        |x| x.get::<_, i64>(0),
    )? == 1)
}

/// What acceptance reads of a node.
pub struct AcceptanceRow {
    pub tenant: String,
    pub pool_id: String,
    pub state: String,
    pub connected: bool,
    pub claims_json: String,
    /// `domain::acceptance::HelloFacts` as JSON, from the last signed `Hello`.
    pub hello_facts: Option<String>,
    /// The DER of its newest unrevoked certificate.
    pub newest_der: Option<Vec<u8>>,
}

pub fn acceptance_row(tx: &Tx<'_>, node: &str) -> ApiResult<Option<AcceptanceRow>> {
    Ok(crate::store::query_row(
        tx,
        "SELECT n.tenant_id, n.pool_id, n.state, n.connected, n.claims_json, n.hello_facts,
                (SELECT der FROM node_certs c WHERE c.node_id = n.id AND c.revoked_at IS NULL
                 ORDER BY c.created_at DESC, c.rowid DESC LIMIT 1)
         FROM nodes n WHERE n.id = ?1",
        [node],
        |x| {
            Ok(AcceptanceRow {
                tenant: x.get(0)?,
                pool_id: x.get(1)?,
                state: x.get(2)?,
                connected: x.get::<_, i64>(3)? == 1,
                claims_json: x.get(4)?,
                hello_facts: x.get(5)?,
                newest_der: x.get(6)?,
            })
        },
    )
    .optional()?)
}

/// The node's conditions (a JSON array), or none.
pub fn set_conditions(tx: &Tx<'_>, node: &str, conditions: Option<&Value>) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE nodes SET conditions = ?2 WHERE id = ?1",
        params![node, conditions.map(|c| c.to_string())],
    )?;
    Ok(())
}

/// What the node's last `Hello` showed (JSON), or nothing when it carried no evidence its node
/// key signed.
pub fn set_hello_facts(tx: &Tx<'_>, node: &str, facts: Option<&str>) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE nodes SET hello_facts = ?2 WHERE id = ?1",
        params![node, facts],
    )?;
    Ok(())
}

/// A session opened: connected, seen now.
pub fn mark_connected(tx: &Tx<'_>, node: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE nodes SET connected = 1, last_seen = ?2, session_appliance = ?3 WHERE id = ?1",
        params![node, now, crate::store::appliances::this()],
    )?;
    Ok(())
}

/// A heartbeat: seen now.
pub fn mark_seen(tx: &Tx<'_>, node: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE nodes SET last_seen = ?2 WHERE id = ?1",
        params![node, now],
    )?;
    Ok(())
}

/// A session closed: the node's tenant when it was connected (and is now not), else `None`.
pub fn mark_disconnected(tx: &Tx<'_>, node: &str, now: i64) -> ApiResult<Option<String>> {
    let tenant: Option<String> = crate::store::query_row(
        tx,
        "SELECT tenant_id FROM nodes WHERE id = ?1 AND connected = 1
           AND (session_appliance IS NULL OR session_appliance = ?2)",
        params![node, crate::store::appliances::this()],
        |x| x.get(0),
    )
    .optional()?;
    if tenant.is_some() {
        crate::store::exec(
            tx,
            "UPDATE nodes SET connected = 0, last_seen = ?2, session_appliance = NULL WHERE id = ?1",
            params![node, now],
        )?;
    }
    Ok(tenant)
}

const SHOWN: &str = "id, tenant_id, site_id, pool_id, role, state, trust, hardware_key, hardware_key_trusted, identity_generation,
    attestor, hostname, claims_json, created_at, updated_at, retired_at, connected, last_seen, rediscover, boot_mac, conditions";

fn shown_row(r: &crate::store::Row) -> crate::store::SqlResult<Value> {
    let mut v = json!({
        "id": r.get::<_, String>(0)?, "tenantId": r.get::<_, String>(1)?, "siteId": r.get::<_, String>(2)?,
        "poolId": r.get::<_, String>(3)?, "role": r.get::<_, String>(4)?, "state": r.get::<_, String>(5)?,
        "trust": r.get::<_, String>(6)?, "hardwareKey": r.get::<_, Option<String>>(7)?,
        "hardwareKeyTrusted": r.get::<_, i64>(8)? == 1, "identityGeneration": r.get::<_, i64>(9)?,
        "attestor": r.get::<_, String>(10)?, "hostname": r.get::<_, Option<String>>(11)?,
        "claims": serde_json::from_str::<Value>(&r.get::<_, String>(12)?).unwrap_or(Value::Null),
        "createdAt": rfc3339(r.get(13)?), "updatedAt": rfc3339(r.get(14)?),
    });
    if let Some(t) = r.get::<_, Option<i64>>(15)? {
        v["retiredAt"] = json!(rfc3339(t));
    }
    v["connected"] = json!(r.get::<_, i64>(16)? == 1);
    v["rediscover"] = json!(r.get::<_, i64>(18)? == 1);
    v["bootMac"] = json!(r.get::<_, Option<String>>(19)?);
    v["lastSeen"] = json!(r.get::<_, Option<i64>>(17)?.map(rfc3339));
    v["conditions"] = r
        .get::<_, Option<String>>(20)?
        .and_then(|c| serde_json::from_str::<Value>(&c).ok())
        .unwrap_or_else(|| json!([]));
    Ok(v)
}

/// A node of `tenant` as `nodes.get` shows it, or `NOT_FOUND`.
pub fn shown(tx: &Tx<'_>, tenant: &str, node: &str) -> ApiResult<Value> {
    found(
        crate::store::query_row(
            tx,
            &format!("SELECT {SHOWN} FROM nodes WHERE id = ?1 AND tenant_id = ?2"),
            [node, tenant],
            shown_row,
        ),
        || format!("node {node} not found in tenant {tenant}"),
    )
}

/// A node's certificates, as `nodes.get` shows them.
pub fn certificates(tx: &Tx<'_>, node: &str) -> ApiResult<Vec<Value>> {
    let out = crate::store::query_all(tx, "SELECT serial, identity_generation, role, not_before, not_after, revoked_at, revoke_reason FROM node_certs
         WHERE node_id = ?1 ORDER BY created_at, serial", [node], |r| {
            Ok(json!({
                "serial": r.get::<_, String>(0)?, "identityGeneration": r.get::<_, i64>(1)?, "role": r.get::<_, String>(2)?,
                "notBefore": rfc3339(r.get(3)?), "notAfter": rfc3339(r.get(4)?),
                "revokedAt": r.get::<_, Option<i64>>(5)?.map(rfc3339), "revokeReason": r.get::<_, Option<String>>(6)?,
            }))
        })?;
    Ok(out)
}

/// A tenant's nodes (of one pool, or all; retired ones too when asked) after `cursor`, at most
/// `limit`: `(id, node)` as `nodes.list` shows them.
pub fn list(
    tx: &Tx<'_>,
    (tenant, pool): (&str, Option<&str>),
    cursor: &str,
    include_retired: bool,
    limit: i64,
) -> ApiResult<Vec<(String, Value)>> {
    let rows = crate::store::query_all(tx, &format!(
        "SELECT {SHOWN} FROM nodes WHERE tenant_id = ?1 AND (CAST(?2 AS TEXT) IS NULL OR pool_id = ?2) AND id > ?3
         AND (?4 = 1 OR state != 'retired') ORDER BY id LIMIT ?5"
    ),
            params![tenant, pool, cursor, include_retired, limit],
            shown_row,
        )?
        .into_iter()
        .map(|v| (v["id"].as_str().unwrap_or_default().to_string(), v))
        .collect();
    Ok(rows)
}

pub fn retire(tx: &Tx<'_>, node: &str, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE nodes SET state = 'retired', retired_at = ?2, updated_at = ?2 WHERE id = ?1",
        params![node, now],
    )?;
    Ok(())
}

/// A node's row gone (its certificates with it).
pub fn delete(tx: &Tx<'_>, node: &str) -> ApiResult<()> {
    crate::store::exec(tx, "DELETE FROM nodes WHERE id = ?1", [node])?;
    Ok(())
}

/// An operator's rediscovery mark set or cleared.
pub fn set_rediscover(tx: &Tx<'_>, node: &str, on: bool, now: i64) -> ApiResult<()> {
    crate::store::exec(
        tx,
        "UPDATE nodes SET rediscover = ?2, updated_at = ?3 WHERE id = ?1",
        params![node, on as i64, now],
    )?;
    Ok(())
}
