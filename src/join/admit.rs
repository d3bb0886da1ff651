//! The one admission path's writing half. Each attestor weighs its own evidence (a token, an
//! approval or a known machine, a TPM's EK) with the rules in `domain::admission` and hands the
//! result here as one [`Admission`]: which node (new, or one again), its tenant, pool, role and
//! trust, what vouched for it, what its row records. [`write`] is then the only code that
//! writes a node: the row (the one node `INSERT`, or the reclaim's `UPDATE` with its older
//! certificates revoked and its live session ended), the certificate and its `node_certs` row, the join request it
//! answers, `node.joined` with its `node.joined` or `node.reclaimed` audit row, and the
//! adoption (at once, unless the pool runs acceptance checks: `join::acceptance`).

use crate::base::error::ApiResult;
use crate::join::issue::{adopt, certify, Decided, Ready, Signer, Subject};
use crate::join::site::Site;
use crate::store::nodes::{revoke_all, Again, NewNode};
use crate::store::Tx;
use serde_json::{json, Value};

/// Which node an admission lands on.
pub(crate) enum Target<'a> {
    /// A new node, identity generation 1, with this trust.
    New { trust: &'a str },
    /// A node again (a reclaim): its next identity generation, its older certificates revoked;
    /// its trust set, or kept (`None`).
    Again {
        node_id: String,
        generation: i64,
        trust: Option<&'a str>,
    },
    /// The same node and identity generation, its row unchanged (an `x509pop` re-join after
    /// its certificate expired: nothing else of it is live, so nothing is revoked).
    Same { node_id: String, generation: i64 },
}

/// What the node's row records of the machine at this admission. On a reclaim, `None` (or
/// `false`) keeps what the row had.
#[derive(Default)]
pub(crate) struct Record {
    /// Write the claims and hostname of this join (a new node always records them).
    pub claims: bool,
    /// Who vouched for the identifiers: `token`, `approval` or `tpm`.
    pub identifiers_by: Option<&'static str>,
    /// The MAC the machine booted with (discovery).
    pub boot_mac: Option<String>,
    /// The TPM's EK (hex SHA-256), for a new node admitted by its TPM.
    pub tpm_ek_sha256: Option<String>,
    /// Clear an operator's rediscovery mark.
    pub clear_rediscover: bool,
}

/// An attestor's decision to admit, ready to be written.
pub(crate) struct Admission<'a> {
    /// `join-token`, `discovery` or `tpm`: the node's `attestor` and the event's.
    pub attestor: &'static str,
    /// The audit row's actor: `join-token:<token>`, `discovery:<request>|known-machine`,
    /// `tpm:<ek>`.
    pub actor: String,
    pub tenant_id: &'a str,
    pub site_id: &'a str,
    /// The pool it joins (its policy decides whether it is adopted at once).
    pub pool: &'a crate::domain::pool::Pool,
    /// The certificate's (and the node's) role.
    pub role: &'a str,
    pub target: Target<'a>,
    pub record: Record,
    /// The node's hardware key is trusted (recorded for a new node, and told in the event).
    pub hardware_key_trusted: bool,
    /// The certificate's `urn:bc:` statements (the TPM AK's name).
    pub statements: Vec<String>,
    /// The certificate's lifetime (`issue::cert_ttl`).
    pub ttl: i64,
    /// How the node key is held: `unattested` or `tpm` (the event's `nodeKey`).
    pub node_key: &'static str,
    /// The join request this admission answers: consumed.
    pub consumes: Option<&'a str>,
    /// The attestor's own fields of `node.joined` (`tokenId`, `ekSha256`, …).
    pub event: Value,
}

/// Writes an admission (inside the join's savepoint) and issues its certificate.
pub(crate) fn write(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    a: Admission<'_>,
    now: i64,
) -> ApiResult<Decided> {
    let claims_json = serde_json::to_string(&r.claims).expect("serializes");
    let (node_id, generation, reclaim) = match a.target {
        Target::New { trust } => {
            let id = crate::base::ids::new_id("node", now * 1000);
            crate::store::nodes::insert(
                tx,
                &NewNode {
                    id: &id,
                    tenant_id: a.tenant_id,
                    site_id: a.site_id,
                    pool_id: &a.pool.id,
                    role: a.role,
                    trust,
                    hardware_key: r.key.as_ref().map(|k| k.hex.as_str()),
                    hardware_key_trusted: a.hardware_key_trusted,
                    attestor: a.attestor,
                    hostname: r.claims.hostname.as_deref(),
                    claims_json: &claims_json,
                    boot_mac: a.record.boot_mac.as_deref(),
                    identifiers_by: a.record.identifiers_by.unwrap_or("token"),
                    tpm_ek_sha256: a.record.tpm_ek_sha256.as_deref(),
                },
                now,
            )?;
            (id, 1, false)
        }
        Target::Again {
            node_id,
            generation,
            trust,
        } => {
            crate::store::nodes::again(
                tx,
                &Again {
                    node_id: &node_id,
                    generation,
                    role: a.role,
                    trust,
                    clear_rediscover: a.record.clear_rediscover,
                    claims: a
                        .record
                        .claims
                        .then_some((r.claims.hostname.as_deref(), claims_json.as_str())),
                    identifiers_by: a.record.identifiers_by,
                    boot_mac: a.record.boot_mac.as_deref(),
                },
                now,
            )?;
            // The identity it replaces is revoked, and its live session ends with it.
            revoke_all(tx, a.tenant_id, &node_id, "reclaimed", now)?;
            site.sessions.close(&node_id);
            (node_id, generation, true)
        }
        Target::Same {
            node_id,
            generation,
        } => (node_id, generation, false),
    };
    let (response, serial) = certify(
        tx,
        site,
        signer,
        &Subject {
            node_id: &node_id,
            generation,
            role: a.role,
            statements: &a.statements,
            ttl: a.ttl,
        },
        &r.csr,
        now,
    )?;
    if let Some(req) = a.consumes {
        crate::store::requests::consume(tx, req, &node_id, now)?;
    }
    let mut data = json!({
        "nodeId": node_id,
        "poolId": a.pool.id,
        "attestor": a.attestor,
        "reclaim": reclaim,
        "hardwareKeyTrusted": a.hardware_key_trusted,
        "certificateSerial": serial,
        "nodeKey": a.node_key,
        "role": a.role,
    });
    if let (Some(d), Some(extra)) = (data.as_object_mut(), a.event.as_object()) {
        d.extend(extra.clone());
    }
    crate::store::events::publish(tx, now, a.tenant_id, "node.joined", data.clone())?;
    let action = if reclaim {
        "node.reclaimed"
    } else {
        "node.joined"
    };
    crate::store::events::audit(tx, now, a.tenant_id, action, &a.actor, &node_id, data)?;
    // Adopted at once, unless the pool runs acceptance checks: then at its `Hello`
    // (`join::acceptance`).
    if a.pool.policy.acceptance().is_none() {
        adopt(tx, a.tenant_id, &node_id, &a.pool.id, now)?;
    }
    Ok(Decided::Issued(response))
}
