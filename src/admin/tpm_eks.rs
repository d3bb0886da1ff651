//! The EK allow-list of the `tpm` attestor: `bca tpm allow-ek HASH --pool P`, `bca tpm list`,
//! `bca tpm remove-ek HASH` (admin methods `tpmEks/allow`, `tpmEks/list`, `tpmEks/remove`).
//!
//! An EK is named by the SHA-256 of its DER SubjectPublicKeyInfo (`bca tpm status` prints it as
//! `publicKeySha256`, and `openssl x509 -pubkey | openssl pkey -pubin -outform DER | sha256sum`
//! gives it from an EK certificate), and allowed into exactly one pool, which must accept the
//! `tpm` attestor. Allowing it again into the same pool changes nothing; into another pool is a
//! conflict (remove it first: a machine never moves pools silently). Each change is audited.

use crate::admin::ctx::Ctx;
use crate::base::error::{ApiError, ApiResult};
use crate::domain::validate;
use crate::store::events::audit;
use crate::store::Store;
use crate::store::Tx;
use serde::Deserialize;
use serde_json::{json, Value};

/// An EK hash as the operator may write it: 64 hex digits, any case, optionally `sha256:`.
pub fn parse_hash(field: &str, s: &str) -> ApiResult<String> {
    let h = s.strip_prefix("sha256:").unwrap_or(s).to_ascii_lowercase();
    if h.len() != 64 || !h.bytes().all(|c| c.is_ascii_hexdigit()) {
        return Err(ApiError::invalid_input(format!(
            "{field} must be the SHA-256 of the EK's public key: 64 hex digits (bca tpm status \
             prints it as publicKeySha256)"
        )));
    }
    Ok(h)
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AllowInput {
    tenant_id: String,
    pool_id: String,
    ek_sha256: String,
    note: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListInput {
    tenant_id: String,
    pool_id: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct RemoveInput {
    tenant_id: String,
    ek_sha256: String,
}

pub fn dispatch(store: &Store, ctx: &Ctx<'_>, path: &str, body: &[u8]) -> Option<ApiResult<Value>> {
    Some(match path {
        "tpmEks/allow" => crate::admin::ctx::parse::<AllowInput>(body)
            .and_then(|i| store.write(|tx| allow(tx, ctx, i))),
        "tpmEks/list" => {
            crate::admin::ctx::parse::<ListInput>(body).and_then(|i| store.read(|tx| list(tx, i)))
        }
        "tpmEks/remove" => crate::admin::ctx::parse::<RemoveInput>(body)
            .and_then(|i| store.write(|tx| remove(tx, ctx, i))),
        _ => return None,
    })
}

fn load(tx: &Tx<'_>, hash: &str) -> ApiResult<Option<Value>> {
    crate::store::tpm_eks::get(tx, hash)
}

fn allow(tx: &Tx<'_>, ctx: &Ctx<'_>, i: AllowInput) -> ApiResult<Value> {
    let hash = parse_hash("ekSha256", &i.ek_sha256)?;
    if let Some(n) = &i.note {
        if n.chars().count() > 256 || n.chars().any(char::is_control) {
            return Err(ApiError::invalid_input(
                "note must be at most 256 characters, on one line",
            ));
        }
    }
    let pool = crate::store::tenancy::pool_load(tx, &i.tenant_id, &i.pool_id)?;
    if pool.archived_at.is_some() {
        return Err(ApiError::invalid_state(format!(
            "pool {} is archived: it admits no machine",
            pool.id
        )));
    }
    if !pool.allows_attestor("tpm") {
        return Err(ApiError::invalid_state(format!(
            "pool {} does not accept the tpm attestor (its policy.joinAttestors); allow it there first",
            pool.id
        )));
    }
    if let Some(existing) = load(tx, &hash)? {
        if existing["poolId"] == pool.id.as_str() && existing["tenantId"] == pool.tenant_id.as_str()
        {
            return Ok(existing);
        }
        return Err(ApiError::conflict(format!(
            "EK {hash} is already allowed into pool {} of tenant {}: remove it there first (bca tpm remove-ek --tenant {})",
            existing["poolId"].as_str().unwrap_or_default(),
            existing["tenantId"].as_str().unwrap_or_default(),
            existing["tenantId"].as_str().unwrap_or_default()
        )));
    }
    crate::store::tpm_eks::insert(
        tx,
        &hash,
        (&pool.tenant_id, &pool.id),
        i.note.as_deref(),
        (ctx.now, ctx.caller),
    )?;
    audit(
        tx,
        ctx.now,
        &pool.tenant_id,
        "tpm.ekAllowed",
        ctx.caller,
        &hash,
        json!({"poolId": pool.id}),
    )?;
    load(tx, &hash)?.ok_or_else(|| ApiError::internal("the row just written"))
}

fn list(tx: &Tx<'_>, i: ListInput) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    match &i.pool_id {
        // An unknown tenant or pool is named, not listed as empty.
        Some(p) => {
            crate::store::tenancy::pool_load(tx, &i.tenant_id, p)?;
        }
        None => crate::store::tenancy::tenant_must_exist(tx, &i.tenant_id)?,
    }
    let limit = i.limit.unwrap_or(100);
    validate::range("limit", limit, 1, 200)?;
    let after = match &i.cursor {
        Some(c) => parse_hash("cursor", c)?,
        None => String::new(),
    };
    let rows =
        crate::store::tpm_eks::list(tx, &i.tenant_id, i.pool_id.as_deref(), &after, limit + 1)?;
    Ok(crate::admin::ctx::page(rows, limit, |h| h.clone()))
}

fn remove(tx: &Tx<'_>, ctx: &Ctx<'_>, i: RemoveInput) -> ApiResult<Value> {
    validate::tenant_id("tenantId", &i.tenant_id)?;
    let hash = parse_hash("ekSha256", &i.ek_sha256)?;
    let existing = load(tx, &hash)?
        .filter(|e| e["tenantId"] == i.tenant_id.as_str())
        .ok_or_else(|| ApiError::not_found(format!("EK {hash} is not on the allow-list")))?;
    crate::store::tpm_eks::remove(tx, &hash)?;
    audit(
        tx,
        ctx.now,
        &i.tenant_id,
        "tpm.ekRemoved",
        ctx.caller,
        &hash,
        json!({"poolId": existing["poolId"]}),
    )?;
    Ok(existing)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ek_hashes_are_64_hex_digits() {
        let h = "AB".repeat(32);
        assert_eq!(parse_hash("x", &h).unwrap(), "ab".repeat(32));
        assert_eq!(
            parse_hash("x", &format!("sha256:{h}")).unwrap(),
            "ab".repeat(32)
        );
        for bad in ["", "ab", &"g".repeat(64), &"a".repeat(65), "sha1:00"] {
            let e = parse_hash("ekSha256", bad).unwrap_err();
            assert!(e.message.contains("64 hex digits"), "{bad}: {}", e.message);
        }
    }
}
