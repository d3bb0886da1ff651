//! The `join-token` attestor: a bearer token an operator minted for a pool (single or multiple
//! use, bound by `expect` or not, `hosted` or not), checked in the seed's order, then the
//! admission rules (`domain::admission`).

use crate::base::error::ApiResult;
use crate::domain::admission::{self, AdmitInput, Kind, KnownNode, Reason};
use crate::domain::token::TokenRow;
use crate::join::issue::{
    adopt, certify, refused, revoke_all, Decided, Proof, Ready, Signer, Subject,
};
use crate::join::site::Site;
use crate::store::tenancy::TOKEN_COLS;
use rusqlite::{params, OptionalExtension, Transaction};
use serde_json::json;

/// Stage 2 of a `join-token` join, inside its savepoint: the token checked and one use
/// consumed, the admission rules applied, the node written and its certificate issued.
pub(crate) fn admit(
    tx: &Transaction<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    now: i64,
) -> ApiResult<Decided> {
    let cfg = &site.config;
    let Proof::Bearer(bearer) = &r.proof else {
        return refused(Reason::Attestor, None);
    };
    let token: Option<TokenRow> = crate::store::query_row(
        tx,
        &format!("SELECT {TOKEN_COLS} FROM join_tokens WHERE id = ?1"),
        [&bearer.id],
        crate::store::tenancy::token_row,
    )
    .optional()?;
    let Some(token) = token else {
        return refused(Reason::Unknown, None);
    };
    if let Err(reason) = admission::check_token(&token, &bearer.secret, &r.role, now) {
        let tenant = (reason != Reason::SecretMismatch).then_some(token.tenant_id.as_str());
        return refused(reason, tenant);
    }
    let tenant = Some(token.tenant_id.as_str());
    crate::store::exec(
        tx,
        "UPDATE join_tokens SET uses_left = uses_left - 1 WHERE id = ?1 AND uses_left > 0",
        [&token.id],
    )?;
    let pool = crate::store::tenancy::pool_by_id(tx, &token.pool_id)?;
    let known = match r.key.as_ref().filter(|k| k.trusted) {
        Some(k) => crate::store::query_row(tx,
                "SELECT id, tenant_id, site_id, pool_id, role, state, trust, identity_generation FROM nodes
                 WHERE hardware_key = ?1 AND hardware_key_trusted = 1",
                [&k.hex],
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
            .optional()?,
        None => None,
    };
    let decision = admission::admit(&AdmitInput {
        token: &token,
        pool: pool.as_ref(),
        site_id: &cfg.site_id,
        root_tenant: &site.root_tenant,
        ids: &r.ids,
        key: r.key.as_ref(),
        known: known.as_ref(),
    });
    let adm = match decision {
        Ok(a) => a,
        Err(reason) => return refused(reason, tenant),
    };
    let pool = pool.expect("admission checked the pool");
    let claims_json = serde_json::to_string(&r.claims).expect("serializes");
    let (node_id, generation, reclaim) = match &adm.kind {
        Kind::New => {
            let id = crate::base::ids::new_id("node", now * 1000);
            crate::store::exec(tx,
                "INSERT INTO nodes (id, tenant_id, site_id, pool_id, role, state, trust, hardware_key, hardware_key_trusted,
                 identity_generation, attestor, hostname, claims_json, created_at, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, 'adopting', ?6, ?7, ?8, 1, 'join-token', ?9, ?10, ?11, ?11)",
                params![
                    id,
                    token.tenant_id,
                    token.site_id,
                    pool.id,
                    adm.role,
                    adm.trust,
                    r.key.as_ref().map(|k| k.hex.clone()),
                    r.key.as_ref().is_some_and(|k| k.trusted) as i64,
                    r.claims.hostname,
                    claims_json,
                    now
                ],
            )?;
            (id, 1, false)
        }
        Kind::Reclaim {
            node_id,
            generation,
        } => {
            crate::store::exec(tx,
                "UPDATE nodes SET identity_generation = ?2, state = 'adopting', trust = ?3, hostname = ?4, claims_json = ?5,
                 updated_at = ?6, identifiers_by = 'token' WHERE id = ?1",
                params![node_id, generation, adm.trust, r.claims.hostname, claims_json, now],
            )?;
            revoke_all(tx, &token.tenant_id, node_id, "reclaimed", now)?;
            (node_id.clone(), *generation, true)
        }
    };
    let (response, serial) = certify(
        tx,
        site,
        signer,
        &Subject {
            node_id: &node_id,
            generation,
            role: &adm.role,
            statements: &[],
            ttl: cfg.pki.cert_ttl_seconds as i64,
        },
        &r.csr,
        now,
    )?;
    let data = json!({
        "nodeId": node_id,
        "poolId": pool.id,
        "tokenId": token.id,
        "attestor": "join-token",
        "reclaim": reclaim,
        "hardwareKeyTrusted": r.key.as_ref().is_some_and(|k| k.trusted),
        "certificateSerial": serial,
        "nodeKey": "unattested",
        "role": adm.role,
    });
    crate::store::events::publish(tx, now, &token.tenant_id, "node.joined", data.clone())?;
    let action = if reclaim {
        "node.reclaimed"
    } else {
        "node.joined"
    };
    crate::store::events::audit(
        tx,
        now,
        &token.tenant_id,
        action,
        &format!("join-token:{}", token.id),
        &node_id,
        data,
    )?;
    adopt(tx, &token.tenant_id, &node_id, &pool.id, now)?;
    Ok(Decided::Issued(response))
}
