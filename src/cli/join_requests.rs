//! `bca join-requests`: list, approve and reject through the admin API.

use crate::base::error::{ApiError, ApiResult};
use crate::cli::{print_cursor, print_table, s, tenant_or_root, Conn};
use clap::Subcommand;
use serde_json::{json, Value};

#[derive(Subcommand)]
pub enum JoinRequestsCmd {
    /// List join requests (pending by default).
    List {
        #[arg(long)]
        pool: Option<String>,
        #[arg(long)]
        tenant: Option<String>,
        /// pending (default), approved, rejected, expired, consumed, or all.
        #[arg(long, default_value = "pending")]
        state: String,
        #[arg(long)]
        limit: Option<i64>,
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Approve a request into a pool: it admits one join with the CSR it was made for. With
    /// --all-matching, every pending request whose serial (or MAC) matches, each audited on its own.
    Approve {
        #[arg(
            required_unless_present = "all_matching",
            conflicts_with = "all_matching"
        )]
        id: Option<String>,
        /// Approve every pending request matching --serial-prefix and/or --mac-prefix (needs --reason).
        #[arg(long, requires = "reason")]
        all_matching: bool,
        /// With --all-matching: a product, board or chassis serial starting with this.
        #[arg(long, requires = "all_matching")]
        serial_prefix: Option<String>,
        /// With --all-matching: a boot MAC starting with this (aa:bb:cc).
        #[arg(long, requires = "all_matching")]
        mac_prefix: Option<String>,
        /// With --all-matching: list what would be approved, approve nothing.
        #[arg(long, requires = "all_matching")]
        dry_run: bool,
        #[arg(long)]
        pool: String,
        #[arg(long)]
        tenant: Option<String>,
        /// Seconds the approval stays usable (60 to 86400; one hour by default).
        #[arg(long)]
        ttl: Option<i64>,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Reject a request (final; also withdraws an unused approval).
    Reject {
        id: String,
        #[arg(long)]
        pool: String,
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        reason: Option<String>,
    },
}

/// A conflicting node as the table shows it: `<node> in <pool> (<tenant>)`.
fn conflict(v: &Value) -> String {
    if v.is_null() {
        return "-".into();
    }
    format!(
        "{} in {} ({})",
        s(&v["nodeId"]),
        s(&v["poolId"]),
        s(&v["tenantId"])
    )
}

pub fn run(cmd: JoinRequestsCmd, conn: &Conn) -> ApiResult<()> {
    let c = conn.client();
    let out = |v: &Value| {
        if conn.json {
            println!("{}", serde_json::to_string_pretty(v).expect("serializes"));
        } else if let Some(items) = v["items"].as_array() {
            print_table(
                &[
                    "ID",
                    "STATE",
                    "MAC",
                    "PRODUCT UUID",
                    "SERIALS",
                    "GPUS",
                    "IP",
                    "FIRST ASKED",
                    "POOL",
                    "CONFLICTING NODE",
                ],
                items
                    .iter()
                    .map(|r| {
                        let serials = &r["claims"]["serials"];
                        vec![
                            s(&r["id"]),
                            s(&r["state"]),
                            s(&r["mac"]),
                            s(&r["claims"]["productUuid"]),
                            ["product", "board", "chassis"]
                                .iter()
                                .filter(|k| serials[**k].is_string())
                                .map(|k| s(&serials[*k]))
                                .collect::<Vec<_>>()
                                .join(","),
                            s(&r["gpuCount"]),
                            s(&r["ip"]),
                            s(&r["createdAt"]),
                            s(&r["poolId"]),
                            conflict(&r["conflictingNode"]),
                        ]
                    })
                    .collect(),
            );
            print_cursor(v);
        } else {
            for k in [
                "id",
                "state",
                "poolId",
                "mac",
                "decidedBy",
                "decidedAt",
                "reason",
                "expiresAt",
            ] {
                println!("{k:<10} {}", s(&v[k]));
            }
            if !v["conflictingNode"].is_null() {
                println!(
                    "{:<10} {} (its retry is refused: join:reclaim)",
                    "conflict",
                    conflict(&v["conflictingNode"])
                );
            }
        }
    };
    match cmd {
        JoinRequestsCmd::List {
            pool,
            tenant,
            state,
            limit,
            cursor,
        } => {
            let tenant = tenant_or_root(&c, tenant)?;
            out(&c.call("joinRequests/list", &json!({"tenantId": tenant, "poolId": pool, "state": state, "limit": limit, "cursor": cursor}))?);
        }
        JoinRequestsCmd::Approve {
            id: None,
            pool,
            tenant,
            ttl,
            reason,
            serial_prefix,
            mac_prefix,
            dry_run,
            ..
        } => {
            if serial_prefix.is_none() && mac_prefix.is_none() {
                return Err(ApiError::invalid_input(
                    "--all-matching needs --serial-prefix or --mac-prefix: it never approves every request",
                ));
            }
            if serial_prefix.as_deref() == Some("") || mac_prefix.as_deref() == Some("") {
                return Err(ApiError::invalid_input("a prefix must not be empty"));
            }
            let tenant = tenant_or_root(&c, tenant)?;
            let found = crate::cli::intake::matching_requests(
                &c,
                &tenant,
                serial_prefix.as_deref(),
                mac_prefix.as_deref(),
            )?;
            if found.is_empty() {
                return Err(ApiError::not_found("no pending join request matches"));
            }
            if dry_run {
                out(&json!({"items": found}));
                return Ok(());
            }
            let mut progress =
                crate::base::progress::Progress::new("approving", found.len() as u64);
            let mut approved = Vec::new();
            let mut failed = Vec::new();
            for r in &found {
                let id = r["id"].as_str().unwrap_or_default();
                // Approves the request as it was matched: a machine that asked again since (new
                // key, new claims) is refused and reported, not approved blind.
                match c.call(
                    "joinRequests/approve",
                    &json!({"tenantId": tenant, "poolId": pool, "requestId": id, "ttlSeconds": ttl,
                        "reason": reason, "csrSha256": r["csrSha256"]}),
                ) {
                    Ok(v) => approved.push(v),
                    Err(e) => {
                        eprintln!("{id}: {}: {}", e.code.as_str(), e.message);
                        failed.push(id.to_string());
                    }
                }
                progress.inc();
            }
            out(&json!({"items": approved}));
            if !failed.is_empty() {
                return Err(ApiError::invalid_state(format!(
                    "{} of {} approvals failed: {}",
                    failed.len(),
                    found.len(),
                    failed.join(", ")
                )));
            }
        }
        JoinRequestsCmd::Approve {
            id: Some(id),
            pool,
            tenant,
            ttl,
            reason,
            ..
        } => {
            let tenant = tenant_or_root(&c, tenant)?;
            out(&c.call(
                "joinRequests/approve",
                &json!({"tenantId": tenant, "poolId": pool, "requestId": id, "ttlSeconds": ttl, "reason": reason}),
            )?);
        }
        JoinRequestsCmd::Reject {
            id,
            pool,
            tenant,
            reason,
        } => {
            let tenant = tenant_or_root(&c, tenant)?;
            out(&c.call(
                "joinRequests/reject",
                &json!({"tenantId": tenant, "poolId": pool, "requestId": id, "reason": reason}),
            )?);
        }
    }
    Ok(())
}
