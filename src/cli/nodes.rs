//! `bca nodes`: list, get, adopt, retire, delete, revoke-identity and rediscover through the admin API.

use crate::base::error::{ApiError, ApiResult};
use crate::cli::{print_cursor, print_table, s, tenant_or_root, Conn};
use clap::Subcommand;
use serde_json::{json, Value};

#[derive(Subcommand)]
pub enum NodesCmd {
    /// List nodes.
    List {
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        pool: Option<String>,
        /// Include retired nodes.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        limit: Option<i64>,
        #[arg(long)]
        cursor: Option<String>,
    },
    /// Show a node and its certificates.
    Get {
        id: String,
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Mint a single-use provisioned token for a ramdisk node: the OS a deploy installs joins
    /// with it as that node (bca agent join --node-id NODE). Shown once.
    #[command(name = "provision-token")]
    ProvisionToken {
        id: String,
        #[arg(long)]
        tenant: Option<String>,
        /// Lifetime, 1m to 24h (e.g. 2h, the default).
        #[arg(long, default_value = "2h")]
        ttl: String,
        /// Write the token to this new file (0600) instead of printing it.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Run an `adopting` node's acceptance checks again (after a fix); adopted when they pass.
    Adopt {
        id: String,
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Retire a node: it can neither renew nor reclaim.
    Retire {
        id: String,
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Delete a node: its certificates are revoked and its hardware key freed.
    Delete {
        id: String,
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        yes: bool,
    },
    /// Revoke every certificate of a node.
    #[command(name = "revoke-identity")]
    RevokeIdentity {
        id: String,
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        reason: Option<String>,
    },
    /// Send the node back to the discovery ramdisk at its next network boot (`--off` to stop).
    Rediscover {
        id: String,
        #[arg(long)]
        tenant: Option<String>,
        #[arg(long)]
        off: bool,
    },
}

pub fn run(cmd: NodesCmd, conn: &Conn) -> ApiResult<()> {
    let c = conn.client();
    let out = |v: &Value, table: &dyn Fn(&Value)| {
        if conn.json {
            println!("{}", serde_json::to_string_pretty(v).expect("serializes"));
        } else {
            table(v);
        }
    };
    let record = |v: &Value| {
        for k in [
            "id",
            "poolId",
            "role",
            "state",
            "trust",
            "identityGeneration",
            "hostname",
            "hardwareKeyTrusted",
            "createdAt",
        ] {
            println!("{k:<20} {}", s(&v[k]));
        }
        for c in v["conditions"].as_array().cloned().unwrap_or_default() {
            println!(
                "condition            {} ({}) since {}: {}",
                s(&c["type"]),
                s(&c["reason"]),
                s(&c["since"]),
                s(&c["message"])
            );
        }
        if let Some(cs) = v["certificates"].as_array() {
            for c in cs {
                println!(
                    "certificate          {} gen {} until {}{}",
                    s(&c["serial"]),
                    s(&c["identityGeneration"]),
                    s(&c["notAfter"]),
                    c["revokedAt"]
                        .as_str()
                        .map(|r| format!(" revoked {r} ({})", s(&c["revokeReason"])))
                        .unwrap_or_default()
                );
            }
        }
    };
    match cmd {
        NodesCmd::List {
            tenant,
            pool,
            all,
            limit,
            cursor,
        } => {
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "nodes/list",
                &json!({"tenantId": tenant, "poolId": pool, "includeRetired": all, "limit": limit, "cursor": cursor}),
            )?;
            out(&v, &|v| {
                print_table(
                    &[
                        "ID",
                        "POOL",
                        "STATE",
                        "ROLE",
                        "GEN",
                        "CONNECTED",
                        "LAST SEEN",
                        "HOSTNAME",
                    ],
                    v["items"]
                        .as_array()
                        .cloned()
                        .unwrap_or_default()
                        .iter()
                        .map(|n| {
                            vec![
                                s(&n["id"]),
                                s(&n["poolId"]),
                                s(&n["state"]),
                                s(&n["role"]),
                                s(&n["identityGeneration"]),
                                s(&n["connected"]),
                                s(&n["lastSeen"]),
                                s(&n["hostname"]),
                            ]
                        })
                        .collect(),
                );
                print_cursor(v);
            });
        }
        NodesCmd::Get { id, tenant } => {
            let tenant = tenant_or_root(&c, tenant)?;
            out(
                &c.call("nodes/get", &json!({"tenantId": tenant, "nodeId": id}))?,
                &record,
            );
        }
        NodesCmd::ProvisionToken {
            id,
            tenant,
            ttl,
            out: file,
        } => {
            let ttl = super::duration::parse_duration(&ttl).map_err(ApiError::invalid_input)?;
            if let Some(f) = &file {
                crate::cli::output::refuse_existing_out(f)?;
            }
            let tenant = tenant_or_root(&c, tenant)?;
            let mut v = c.call(
                "nodes/provisionToken",
                &json!({"tenantId": tenant, "nodeId": id, "ttlSeconds": ttl}),
            )?;
            let token = zeroize::Zeroizing::new(s(&v["token"]));
            if let Some(o) = v.as_object_mut() {
                o.remove("token");
            }
            match &file {
                Some(f) => {
                    crate::cli::output::write_token_file(f, &token, &s(&v["id"]))?;
                    if conn.json {
                        println!("{}", serde_json::to_string_pretty(&v).expect("serializes"));
                    } else {
                        println!("{}", s(&v["id"]));
                    }
                    eprintln!(
                        "provisioned token {} for node {id} written to {} (0600); it expires at {}",
                        s(&v["id"]),
                        f.display(),
                        s(&v["expiresAt"])
                    );
                }
                None => {
                    if conn.json {
                        v["token"] = json!(token.as_str());
                        println!("{}", serde_json::to_string_pretty(&v).expect("serializes"));
                    } else {
                        println!("{}", token.as_str());
                    }
                    eprintln!("provisioned token {} for node {id}; it expires at {}: hand it to the deployed OS (bca agent join --node-id {id} --token-file FILE)", s(&v["id"]), s(&v["expiresAt"]));
                }
            }
        }
        NodesCmd::Adopt { id, tenant } => {
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call("nodes/adopt", &json!({"tenantId": tenant, "nodeId": id}))?;
            out(&v, &record);
            if v["state"] != "adopted" {
                return Err(ApiError::invalid_state(format!(
                    "node {id} is still adopting: {}",
                    s(&v["conditions"][0]["message"])
                )));
            }
        }
        NodesCmd::Retire { id, tenant, reason } => {
            let tenant = tenant_or_root(&c, tenant)?;
            out(
                &c.call(
                    "nodes/retire",
                    &json!({"tenantId": tenant, "nodeId": id, "reason": reason}),
                )?,
                &record,
            );
        }
        NodesCmd::Delete { id, tenant, yes } => {
            if !yes {
                return Err(ApiError::invalid_input("deleting a node revokes its certificates and frees its hardware key; confirm with --yes"));
            }
            let tenant = tenant_or_root(&c, tenant)?;
            out(
                &c.call("nodes/delete", &json!({"tenantId": tenant, "nodeId": id}))?,
                &record,
            );
        }
        NodesCmd::Rediscover { id, tenant, off } => {
            let tenant = tenant_or_root(&c, tenant)?;
            out(
                &c.call(
                    "nodes/rediscover",
                    &json!({"tenantId": tenant, "nodeId": id, "rediscover": !off}),
                )?,
                &record,
            );
        }
        NodesCmd::RevokeIdentity { id, tenant, reason } => {
            let tenant = tenant_or_root(&c, tenant)?;
            out(
                &c.call(
                    "nodes/revokeIdentity",
                    &json!({"tenantId": tenant, "nodeId": id, "reason": reason}),
                )?,
                &record,
            );
        }
    }
    Ok(())
}
