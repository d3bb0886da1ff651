//! `downloads/add` and `downloads/list` (`bca downloads`): an agent binary brought to the site is
//! copied under `<state-dir>/downloads` and its SHA-256 recorded.

use crate::admin::ctx::Ctx;
use crate::base::error::{ApiError, ApiResult};
use crate::domain::downloads::{file_path, valid_version, ARCHES, MAX_SIZE};
use crate::store::events::audit;
use crate::store::Store;
use serde::Deserialize;
use serde_json::{json, Value};
use std::path::Path;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AddInput {
    path: String,
    version: String,
    arch: String,
}

pub fn dispatch(
    store: &Store,
    state_dir: &Path,
    ctx: &Ctx<'_>,
    path: &str,
    body: &[u8],
) -> Option<ApiResult<Value>> {
    Some(match path {
        "downloads/add" => {
            crate::admin::ctx::parse::<AddInput>(body).and_then(|i| add(store, state_dir, ctx, i))
        }
        "downloads/list" => store.read(|tx| {
            let items = crate::store::downloads::list(tx)?;
            Ok(json!({"items": items, "cursor": null}))
        }),
        _ => return None,
    })
}

fn add(store: &Store, state_dir: &Path, ctx: &Ctx<'_>, i: AddInput) -> ApiResult<Value> {
    if !valid_version(&i.version) {
        return Err(ApiError::invalid_input(
            "version must match ^[0-9A-Za-z][0-9A-Za-z.+-]{0,63}$",
        ));
    }
    if !ARCHES.contains(&i.arch.as_str()) {
        return Err(ApiError::invalid_input(format!(
            "arch must be one of {}",
            ARCHES.join(", ")
        )));
    }
    let src = Path::new(&i.path);
    if !src.is_absolute() {
        return Err(ApiError::invalid_input("path must be absolute"));
    }
    let meta = std::fs::metadata(src)
        .map_err(|e| ApiError::invalid_input(format!("path {}: {e}", src.display())))?;
    if !meta.is_file() || meta.len() == 0 || meta.len() > MAX_SIZE {
        return Err(ApiError::invalid_input(format!(
            "path {} must be a regular file of 1 byte to 256 MiB",
            src.display()
        )));
    }
    let bytes = std::fs::read(src)
        .map_err(|e| ApiError::invalid_input(format!("cannot read {}: {e}", src.display())))?;
    let sha = crate::base::crypto::hex(&crate::base::crypto::sha256(&bytes));
    let existing = store.read(|tx| crate::store::downloads::sha_of(tx, &i.version, &i.arch))?;
    match existing {
        Some(s) if s == sha => {}
        Some(s) => {
            return Err(ApiError::conflict(format!(
                "bcd {} for {} is already present with SHA-256 {s}; a version's file never changes",
                i.version, i.arch
            )))
        }
        None => {
            let dest = file_path(state_dir, &i.version, &i.arch);
            std::fs::create_dir_all(dest.parent().expect("has a parent"))
                .map_err(ApiError::internal)?;
            crate::base::fsutil::write_atomic(&dest, &bytes, 0o644).map_err(ApiError::internal)?;
            store.write(|tx| {
                crate::store::downloads::insert(
                    tx,
                    (&i.version, &i.arch),
                    (&sha, bytes.len() as i64),
                    (ctx.now, ctx.caller),
                )?;
                audit(
                    tx,
                    ctx.now,
                    ctx.root_tenant,
                    "downloads.add",
                    ctx.caller,
                    &format!("bcd/{}/linux-{}", i.version, i.arch),
                    json!({"sha256": sha}),
                )
            })?;
        }
    }
    Ok(
        json!({"product": "bcd", "version": i.version, "arch": i.arch, "sha256": sha, "size": bytes.len()}),
    )
}
