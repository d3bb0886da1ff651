//! The `join-token` attestor: a bearer token an operator minted for a pool (single or multiple
//! use, bound by `expect` or not, `hosted` or not), checked in the seed's order, then the
//! admission rules (`domain::admission`).

use crate::base::error::ApiResult;
use crate::domain::admission::{self, AdmitInput, Kind, Reason};
use crate::domain::token::TokenRow;
use crate::join::admit::{write, Admission, Record, Target};
use crate::join::issue::{refused, Decided, Proof, Ready, Signer};
use crate::join::site::Site;
use crate::store::Tx;
use serde_json::json;

/// Stage 2 of a `join-token` join, inside its savepoint: the token checked and one use
/// consumed, the admission rules applied, the node written and its certificate issued.
pub(crate) fn admit(
    tx: &Tx<'_>,
    site: &Site,
    signer: &Signer,
    r: &Ready,
    now: i64,
) -> ApiResult<Decided> {
    let cfg = &site.config;
    let Proof::Bearer(bearer) = &r.proof else {
        return refused(Reason::Attestor, None);
    };
    let token: Option<TokenRow> = crate::store::tenancy::token_by_id(tx, &bearer.id)?;
    let Some(token) = token else {
        return refused(Reason::Unknown, None);
    };
    if let Err(reason) = admission::check_token(&token, &bearer.secret, &r.role, now) {
        let tenant = (reason != Reason::SecretMismatch).then_some(token.tenant_id.as_str());
        return refused(reason, tenant);
    }
    let tenant = Some(token.tenant_id.as_str());
    if !crate::store::tenancy::token_spend_use(tx, &token.id)? {
        return refused(Reason::Exhausted, tenant);
    }
    let pool = crate::store::tenancy::pool_by_id(tx, &token.pool_id)?;
    let known = match r
        .key
        .as_ref()
        .filter(|_| admission::key_counts(r.key.as_ref(), &r.ids))
    {
        Some(k) => crate::store::nodes::by_trusted_key(tx, &k.hex)?,
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
        node_id: r.node_id.as_deref(),
    });
    let adm = match decision {
        Ok(a) => a,
        Err(reason) => return refused(reason, tenant),
    };
    let pool = pool.expect("admission checked the pool");
    let target = match &adm.kind {
        Kind::New => Target::New { trust: &adm.trust },
        Kind::Reclaim {
            node_id,
            generation,
        } => Target::Again {
            node_id: node_id.clone(),
            generation: *generation,
            trust: Some(&adm.trust),
        },
    };
    let admission = Admission {
        attestor: "join-token",
        actor: format!("join-token:{}", token.id),
        tenant_id: &token.tenant_id,
        site_id: &token.site_id,
        pool: &pool,
        role: &adm.role,
        target,
        record: Record {
            claims: true,
            identifiers_by: Some("token"),
            ..Default::default()
        },
        hardware_key_trusted: adm.key_trusted,
        statements: Vec::new(),
        ttl: crate::join::issue::cert_ttl(cfg, &adm.role, "join-token"),
        node_key: "unattested",
        consumes: None,
        event: if token.role == "provisioned" {
            json!({"tokenId": token.id, "provisioned": true})
        } else {
            json!({"tokenId": token.id})
        },
    };
    let decided = write(tx, site, signer, r, admission, now)?;
    if token.role == "provisioned" {
        // The deployed OS is the node now: its ramdisk identity was revoked as reclaimed.
        crate::store::events::publish(
            tx,
            now,
            &token.tenant_id,
            "node.provisioned",
            json!({"nodeId": token.node_id, "tokenId": token.id, "poolId": pool.id}),
        )?;
    }
    Ok(decided)
}
