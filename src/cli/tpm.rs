//! `bca tpm`: the box's TPM (status, escrow, resealing) and the `tpm` attestor's EK allow-list.

use super::args::*;
use super::conn::*;
use super::local::not_serving;
use super::output::*;
use crate::base::error::{ApiError, ApiResult, Code};
use crate::config::KeyProtection;
use serde_json::json;

pub(crate) fn cmd_tpm_status(conn: &Conn, tpm: Option<String>) -> ApiResult<()> {
    // On an appliance whose keys are sealed to a TPM: that TPM by default, and whether they load.
    let state_dir = conn.state_dir();
    let sealed = crate::config::Config::load(&state_dir)
        .ok()
        .filter(|c| c.key_protection == KeyProtection::Tpm);
    let tcti: crate::tpm::Tcti = tpm
        .as_deref()
        .or(sealed.as_ref().and_then(|c| c.tpm.as_deref()))
        .unwrap_or(crate::tpm::DEFAULT_TCTI)
        .parse()
        .map_err(|e: String| ApiError::new(Code::InvalidInput, &e))?;
    let mut v = crate::tpm::status(&tcti)?;
    if sealed.is_some() {
        let pcrs = crate::keys::sealed_pcrs(&state_dir).unwrap_or_default();
        let loaded =
            crate::keys::Vault::open_with_tpm(&state_dir, KeyProtection::Tpm, None, Some(&tcti));
        v["sealedKeys"] = serde_json::json!({
            "file": crate::keys::keys_dir(&state_dir).join("keys.tpm"),
            "pcrs": pcrs,
            "loadable": loaded.is_ok(),
            "error": loaded.err(),
        });
    }
    print(conn, &v, |v| {
        println!("TPM           {}", v["tcti"].as_str().unwrap_or(""));
        println!(
            "made by       {} ({}), firmware {}",
            v["manufacturer"].as_str().unwrap_or(""),
            v["vendor"].as_str().unwrap_or(""),
            v["firmware"].as_str().unwrap_or("")
        );
        for alg in ["rsa", "ecc"] {
            let ek = &v["ek"][alg];
            let cert = &ek["certificate"];
            let cert = if cert.is_null() {
                "no certificate in NV".to_string()
            } else {
                format!(
                    "certificate at {} ({} bytes{})",
                    cert["nvIndex"].as_str().unwrap_or(""),
                    cert["bytes"],
                    if cert["certifiesThisEk"] == true {
                        ", certifies this EK"
                    } else {
                        ", DOES NOT certify this EK"
                    }
                )
            };
            println!(
                "EK {alg}        name {}, {cert}",
                ek["name"].as_str().unwrap_or("")
            );
        }
        println!(
            "AK            name {}",
            v["ak"]["name"].as_str().unwrap_or("")
        );
        let s = &v["sealedKeys"];
        if !s.is_null() {
            let pcrs = s["pcrs"].as_array().map(|p| p.len()).unwrap_or(0);
            let bound = if pcrs == 0 {
                "bound to no PCR".to_string()
            } else {
                format!("bound to PCRs {}", s["pcrs"])
            };
            if s["loadable"] == true {
                println!(
                    "sealed keys   {}: {bound}, unseal",
                    s["file"].as_str().unwrap_or("")
                );
            } else {
                println!(
                    "sealed keys   {}: {bound}, DO NOT unseal: {}",
                    s["file"].as_str().unwrap_or(""),
                    s["error"].as_str().unwrap_or("")
                );
            }
        }
    });
    Ok(())
}

/// `bca tpm …`: the box's TPM, the EK allow-list, escrow and resealing.
pub fn tpm(cmd: TpmCmd, conn: &Conn) -> ApiResult<()> {
    match cmd {
        TpmCmd::Status { tpm } => cmd_tpm_status(conn, tpm),
        TpmCmd::AllowEk {
            hash,
            pool,
            tenant,
            note,
        } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "tpmEks/allow",
                &json!({"tenantId": tenant, "poolId": pool, "ekSha256": hash, "note": note}),
            )?;
            print(conn, &v, |v| {
                println!(
                    "allowed EK {} into pool {}",
                    s(&v["ekSha256"]),
                    s(&v["poolId"])
                )
            });
            Ok(())
        }
        TpmCmd::RemoveEk { hash, tenant } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "tpmEks/remove",
                &json!({"tenantId": tenant, "ekSha256": hash}),
            )?;
            print(conn, &v, |v| {
                println!(
                    "removed EK {} (was allowed into pool {})",
                    s(&v["ekSha256"]),
                    s(&v["poolId"])
                )
            });
            Ok(())
        }
        TpmCmd::List {
            pool,
            tenant,
            limit,
            cursor,
        } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "tpmEks/list",
                &json!({"tenantId": tenant, "poolId": pool, "limit": limit, "cursor": cursor}),
            )?;
            print(conn, &v, |v| {
                print_table(
                    &["EK SHA-256", "POOL", "NOTE", "ALLOWED", "BY"],
                    v["items"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .map(|r| {
                            vec![
                                s(&r["ekSha256"]),
                                s(&r["poolId"]),
                                s(&r["note"]),
                                s(&r["createdAt"]),
                                s(&r["createdBy"]),
                            ]
                        })
                        .collect(),
                );
                print_cursor(v);
            });
            Ok(())
        }
        TpmCmd::Escrow { out } => {
            let state_dir = conn.state_dir();
            if out.exists() {
                return Err(ApiError::already_exists(format!(
                    "{} exists; nothing was written",
                    out.display()
                )));
            }
            let bundle = crate::keys::unseal(&state_dir, KeyProtection::Tpm, None)
                .map_err(ApiError::invalid_state)?;
            let pass = crate::keys::passphrase_from_env_or_prompt(true)
                .map_err(ApiError::invalid_input)?;
            crate::keys::write_escrow(&out, &bundle, pass.as_bytes())
                .map_err(ApiError::invalid_input)?;
            println!("wrote {} (0600): keep it off this box", out.display());
            Ok(())
        }
        TpmCmd::Reseal {
            escrow,
            tpm_pcrs,
            tpm,
        } => {
            let state_dir = conn.state_dir();
            let pcrs = tpm_pcrs
                .as_deref()
                .map(crate::tpm::parse_pcrs)
                .transpose()
                .map_err(|e| ApiError::invalid_input(format!("--tpm-pcrs: {e}")))?;
            let tcti: Option<crate::tpm::Tcti> = tpm
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: String| ApiError::invalid_input(format!("--tpm: {e}")))?;
            not_serving(&state_dir)?;
            let pass = crate::keys::passphrase_from_env_or_prompt(false)
                .map_err(ApiError::invalid_input)?;
            let bound = crate::keys::reseal_from_escrow(
                &state_dir,
                &escrow,
                pass.as_bytes(),
                tcti.as_ref(),
                pcrs,
            )
            .map_err(ApiError::invalid_state)?;
            if bound.is_empty() {
                println!("the keys are sealed to the TPM again, bound to no PCR; start bca serve");
            } else {
                println!(
                    "the keys are sealed to the TPM again, bound to PCRs {bound:?} as they are now; start bca serve"
                );
            }
            Ok(())
        }
        TpmCmd::Recover { escrow } => {
            let state_dir = conn.state_dir();
            not_serving(&state_dir)?;
            let pass = crate::keys::passphrase_from_env_or_prompt(false)
                .map_err(ApiError::invalid_input)?;
            crate::keys::recover_from_escrow(&state_dir, &escrow, pass.as_bytes())
                .map_err(ApiError::invalid_state)?;
            println!(
                "the keys are back from {}, protected by its passphrase (key_protection = \"passphrase\"); start bca serve",
                escrow.display()
            );
            Ok(())
        }
    }
}
