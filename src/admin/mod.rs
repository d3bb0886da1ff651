//! The admin API: `POST /api/compute/<group>/<method>` with a JSON body, decided here.
//!
//! Every method parses its input strictly (unknown fields are refused), checks every constraint of
//! the API reference, and runs in one store transaction: an error leaves the database as it was.
//! Mutations write an audit row naming the caller (`uid:<n>` from the socket's peer credentials).

pub mod audit;
pub mod boot_leases;
pub mod ctx;
pub mod downloads;
pub mod events;
pub mod join_requests;
pub mod nodes;
pub mod pools;
pub mod tenants;
pub mod tokens;
pub mod tpm_eks;

use ctx::{parse, Ctx};
use events::*;
use pools::*;
use tenants::*;
use tokens::*;

use crate::base::error::{ApiError, ApiResult};
use crate::store::tenancy::pool_load;
use crate::store::Store;
use serde_json::Value;

/// Runs one method. `path` is `<group>/<method>`.
pub fn dispatch(store: &Store, ctx: &Ctx<'_>, path: &str, body: &[u8]) -> ApiResult<Value> {
    match path {
        "tenants/create" => {
            let i = parse(body)?;
            store.write(|tx| tenants_create(tx, ctx, i))
        }
        "tenants/list" => {
            let i = parse(body)?;
            store.read(|tx| tenants_list(tx, i))
        }
        "pools/create" => {
            let i = parse(body)?;
            store.write(|tx| pools_create(tx, ctx, i))
        }
        "pools/list" => {
            let i = parse(body)?;
            store.read(|tx| pools_list(tx, i))
        }
        "pools/get" => {
            let i: PoolRef = parse(body)?;
            store.read(|tx| Ok(pool_load(tx, &i.tenant_id, &i.pool_id)?.to_json()))
        }
        "pools/update" => {
            let i = parse(body)?;
            store.write(|tx| pools_update(tx, ctx, i))
        }
        "pools/archive" => {
            let i = parse(body)?;
            store.write(|tx| pools_archive(tx, ctx, i))
        }
        "joinTokens/create" => {
            let i = parse(body)?;
            store.write(|tx| join_tokens_create(tx, ctx, i))
        }
        "joinTokens/createMany" => {
            let i = parse(body)?;
            store.write(|tx| join_tokens_create_many(tx, ctx, i))
        }
        "joinTokens/list" => {
            let i = parse(body)?;
            store.read(|tx| join_tokens_list(tx, ctx, i))
        }
        "joinTokens/revoke" => {
            let i = parse(body)?;
            store.write(|tx| join_tokens_revoke(tx, ctx, i))
        }
        "events/list" => {
            let i = parse(body)?;
            store.read(|tx| events_list(tx, i))
        }
        _ => crate::admin::nodes::dispatch(store, ctx, path, body)
            .or_else(|| crate::admin::audit::dispatch(store, ctx, path, body))
            .or_else(|| crate::admin::join_requests::dispatch(store, ctx, path, body))
            .or_else(|| crate::admin::tpm_eks::dispatch(store, ctx, path, body))
            .or_else(|| crate::admin::boot_leases::dispatch(store, path, body))
            .unwrap_or_else(|| Err(ApiError::not_found(format!("no method {path}")))),
    }
}

#[cfg(test)]
mod parse_tests {
    use super::*;
    use crate::admin::tokens::JoinTokensCreateInput;

    #[test]
    fn parse_errors_name_the_field() {
        let e = parse::<JoinTokensCreateInput>(br#"{"tenantId": 5}"#)
            .err()
            .unwrap();
        assert!(e.message.contains("tenantId"), "{}", e.message);
        let e = parse::<JoinTokensCreateInput>(br#"{"expect": {"mac": 1}}"#)
            .err()
            .unwrap();
        assert!(e.message.contains("expect.mac"), "{}", e.message);
    }
}
