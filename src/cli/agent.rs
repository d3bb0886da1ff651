//! `bca agent`: the machine side of the same binary.

use super::args::*;
use super::conn::*;
use crate::base::error::{ApiError, ApiResult};

/// `bca agent …`: the machine side (join, run, doctor).
pub fn agent(cmd: AgentCmd, _conn: &Conn) -> ApiResult<()> {
    match cmd {
        AgentCmd::Join {
            config,
            data_dir,
            claims,
            role,
            reset,
            yes,
            server,
            serving_ca_pin,
            join_signing_pin,
            join_encryption_pin,
            token_file,
            attestor,
            tpm,
            no_enroll,
            wait_seconds,
            retry_seconds,
            node_id,
        } => {
            let pins = match (serving_ca_pin, join_signing_pin, join_encryption_pin) {
                (Some(serving_ca), Some(join_signing), Some(join_encryption)) => {
                    Some(crate::agent::BootstrapPins {
                        serving_ca,
                        join_signing,
                        join_encryption,
                    })
                }
                _ => None,
            };
            let node = crate::agent::join(&crate::agent::JoinOptions {
                config,
                data_dir,
                claims,
                role,
                reset,
                yes,
                server,
                pins,
                token_file,
                token: None,
                attestor: if attestor == "join-token" {
                    String::new()
                } else {
                    attestor
                },
                tpm,
                no_enroll,
                wait_seconds,
                retry_seconds,
                node_id,
            })?;
            println!("{node}");
            Ok(())
        }
        AgentCmd::Run {
            config,
            data_dir,
            claims,
            backoff_base_ms,
            backoff_cap_ms,
        } => crate::agent::run::run(crate::agent::run::RunOptions {
            config,
            data_dir,
            claims,
            backoff_base: std::time::Duration::from_millis(backoff_base_ms),
            backoff_cap: std::time::Duration::from_millis(backoff_cap_ms.max(backoff_base_ms)),
        }),
        AgentCmd::Doctor {
            config,
            data_dir,
            tpm,
        } => {
            let tcti: Option<crate::tpm::Tcti> = tpm
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: String| ApiError::invalid_input(format!("--tpm: {e}")))?;
            if crate::agent::run::doctor(&config, &data_dir, tcti.as_ref()) {
                Ok(())
            } else {
                Err(ApiError::invalid_state("a check failed; see above"))
            }
        }
    }
}
