//! Admin commands that are one API call each: pools, join tokens, downloads, agent files.

use super::args::*;
use super::conn::*;
use super::duration::parse_duration;
use super::output::*;
use crate::base::error::{ApiError, ApiResult};
use serde_json::{json, Value};

pub(crate) fn cmd_pools(cmd: PoolsCmd, conn: &Conn) -> ApiResult<()> {
    match cmd {
        PoolsCmd::Create {
            name,
            tenant,
            agent,
            join_attestors,
            k8s_platform_operated,
            acceptance,
        } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let mut policy = json!({});
            if let Some(a) = join_attestors {
                policy["joinAttestors"] = json!(a);
            }
            if k8s_platform_operated {
                policy["kubernetes"] = json!({"platformOperated": true});
            }
            acceptance.apply(&mut policy);
            let v = c.call(
                "pools/create",
                &json!({"tenantId": tenant, "name": name, "agent": agent, "policy": policy}),
            )?;
            print(conn, &v, print_record);
        }
        PoolsCmd::List { tenant, all } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "pools/list",
                &json!({"tenantId": tenant, "includeArchived": all}),
            )?;
            print(conn, &v, pool_table);
        }
        PoolsCmd::Get { id, tenant } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call("pools/get", &json!({"tenantId": tenant, "poolId": id}))?;
            print(conn, &v, print_record);
        }
        PoolsCmd::Update {
            id,
            tenant,
            name,
            agent,
            join_attestors,
            k8s_platform_operated,
            acceptance,
        } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let mut body = json!({"tenantId": tenant, "poolId": id, "name": name, "agent": agent});
            if join_attestors.is_some() || k8s_platform_operated.is_some() || acceptance.given() {
                let cur = c.call("pools/get", &json!({"tenantId": tenant, "poolId": id}))?;
                let mut policy = cur["policy"].clone();
                if let Some(a) = join_attestors {
                    policy["joinAttestors"] = json!(a);
                }
                if let Some(k) = k8s_platform_operated {
                    policy["kubernetes"] = json!({"platformOperated": k});
                }
                acceptance.apply(&mut policy);
                body["policy"] = policy;
            }
            let v = c.call("pools/update", &body)?;
            print(conn, &v, print_record);
        }
        PoolsCmd::Archive { id, tenant } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call("pools/archive", &json!({"tenantId": tenant, "poolId": id}))?;
            print(conn, &v, print_record);
        }
    }
    Ok(())
}

pub(crate) fn cmd_join_tokens(cmd: JoinTokensCmd, conn: &Conn) -> ApiResult<()> {
    match cmd {
        JoinTokensCmd::Create {
            pool,
            tenant,
            ttl,
            max_uses,
            allow_reclaim,
            expect_product_uuid,
            expect_serial,
            expect_mac,
            expect_gpu_uuid,
            hosted,
            key,
            out,
            from_csv,
            out_dir,
        } => {
            let ttl = parse_duration(&ttl).map_err(ApiError::invalid_input)?;
            if let Some(csv) = from_csv {
                let output = match (out_dir, out) {
                    (Some(d), _) => crate::cli::intake::Output::Dir(d),
                    (None, Some(f)) => crate::cli::intake::Output::Csv(f),
                    (None, None) => {
                        return Err(ApiError::invalid_input(
                            "--from-csv needs --out-dir DIR or --out FILE: bulk secrets are never printed",
                        ))
                    }
                };
                let c = conn.client();
                let tenant = tenant_or_root(&c, tenant)?;
                let mut base = json!({"tenantId": tenant, "poolId": pool, "ttlSeconds": ttl, "allowReclaim": allow_reclaim});
                if let Some(m) = max_uses {
                    base["maxUses"] = json!(m);
                }
                let v = crate::cli::intake::create_from_csv(&c, &csv, output, base, &key)?;
                print(conn, &v, |v| {
                    print_table(
                        &["NAME", "ID", "EXPECT", "EXPIRES"],
                        items(v)
                            .iter()
                            .map(|t| {
                                vec![
                                    s(&t["name"]),
                                    s(&t["id"]),
                                    t["expect"].to_string(),
                                    s(&t["expiresAt"]),
                                ]
                            })
                            .collect(),
                    )
                });
                return Ok(());
            }
            if let Some(o) = &out {
                refuse_existing_out(o)?;
            }
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let mut body = json!({"tenantId": tenant, "poolId": pool, "ttlSeconds": ttl, "idempotencyKey": key,
                "allowReclaim": allow_reclaim});
            if let Some(m) = max_uses {
                body["maxUses"] = json!(m);
            }
            if let Some(h) = hosted {
                body["hosted"] = json!(h);
            }
            let mut expect = serde_json::Map::new();
            for (k, v) in [
                ("productUuid", expect_product_uuid),
                ("serial", expect_serial),
                ("mac", expect_mac),
                ("gpuUuid", expect_gpu_uuid),
            ] {
                if let Some(v) = v {
                    expect.insert(k.into(), json!(v));
                }
            }
            if !expect.is_empty() {
                body["expect"] = Value::Object(expect);
            }
            let mut v = c.call("joinTokens/create", &body)?;
            if let Some(o) = &out {
                let Some(token) = v
                    .get("token")
                    .and_then(Value::as_str)
                    .map(|t| zeroize::Zeroizing::new(t.to_string()))
                else {
                    return Err(ApiError::invalid_state(format!(
                        "--key {key} was used before: the answer carries no token (it is shown only once); revoke {} and create a new one",
                        s(&v["id"])
                    )));
                };
                write_token_file(o, &token, &s(&v["id"]))?;
                if let Some(o) = v.as_object_mut() {
                    o.remove("token");
                }
                eprintln!(
                    "the token is in {} (0600); it is not shown again",
                    o.display()
                );
            }
            print(conn, &v, print_record);
        }
        JoinTokensCmd::List {
            pool,
            tenant,
            all,
            limit,
            cursor,
        } => {
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "joinTokens/list",
                &json!({"tenantId": tenant, "poolId": pool, "includeInactive": all, "limit": limit, "cursor": cursor}),
            )?;
            print(conn, &v, |v| {
                print_table(
                    &["ID", "USES LEFT", "EXPIRES", "EXPECT", "RECLAIM", "REVOKED"],
                    items(v)
                        .iter()
                        .map(|t| {
                            vec![
                                s(&t["id"]),
                                format!("{}/{}", s(&t["usesLeft"]), s(&t["maxUses"])),
                                s(&t["expiresAt"]),
                                t.get("expect").map(|e| e.to_string()).unwrap_or("-".into()),
                                s(&t["allowReclaim"]),
                                s(&t["revokedAt"]),
                            ]
                        })
                        .collect(),
                );
                print_cursor(v);
            });
        }
        JoinTokensCmd::Revoke { id, pool, tenant } => {
            if id.contains('.') {
                return Err(ApiError::invalid_input(
                    "that looks like a bearer token: revoke takes the token id (jt_…), never the secret; nothing was sent",
                ));
            }
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let v = c.call(
                "joinTokens/revoke",
                &json!({"tenantId": tenant, "poolId": pool, "tokenId": id}),
            )?;
            print(conn, &v, print_record);
        }
    }
    Ok(())
}

/// `bca downloads …`: agent binaries the appliance serves.
pub fn downloads(cmd: DownloadsCmd, conn: &Conn) -> ApiResult<()> {
    match cmd {
        DownloadsCmd::Add {
            file,
            version,
            arch,
        } => {
            let path = std::fs::canonicalize(&file)
                .map_err(|e| ApiError::invalid_input(format!("{}: {e}", file.display())))?;
            let v = conn.client().call(
                "downloads/add",
                &json!({"path": path, "version": version, "arch": arch}),
            )?;
            print(conn, &v, print_record);
            Ok(())
        }
        DownloadsCmd::List => {
            let v = conn.client().call("downloads/list", &json!({}))?;
            print_list(
                conn,
                &v,
                &[
                    ("PRODUCT", "product"),
                    ("VERSION", "version"),
                    ("ARCH", "arch"),
                    ("SHA-256", "sha256"),
                    ("SIZE", "size"),
                ],
            );
            Ok(())
        }
    }
}

/// `bca daemon …`: files for agents (install script, agent config).
pub fn daemon(cmd: DaemonCmd, conn: &Conn) -> ApiResult<()> {
    match cmd {
        DaemonCmd::InstallScript {
            pool,
            tenant,
            gateway_url,
            base_url,
            bcd_version,
            sha256,
            release_manifest,
            release_pins,
        } => {
            let (amd, arm) = match &sha256 {
                Some(s) => {
                    crate::cli::install_script::parse_sha256(s).map_err(ApiError::invalid_input)?
                }
                None => (None, None),
            };
            let pins = match &release_pins {
                Some(p) => {
                    crate::cli::install_script::parse_pins(p).map_err(ApiError::invalid_input)?
                }
                None => Vec::new(),
            };
            let url_ok = |u: &str| {
                (u.starts_with("http://") || u.starts_with("https://") || u.starts_with("file://"))
                    && crate::base::net::url_is_plain(u)
            };
            if let Some(m) = &release_manifest {
                if !url_ok(m) {
                    return Err(ApiError::invalid_input(format!(
                        "--release-manifest {m:?} must be an http://, https:// or file:// URL"
                    )));
                }
            }
            if !crate::domain::downloads::valid_version(&bcd_version) {
                return Err(ApiError::invalid_input(
                    "--bcd-version must match ^[0-9A-Za-z][0-9A-Za-z.+-]{0,63}$",
                ));
            }
            let base_ok = (base_url.starts_with("http://") || base_url.starts_with("https://"))
                && crate::base::net::url_is_plain(&base_url);
            if !base_ok {
                return Err(ApiError::invalid_input(format!(
                    "--base-url {base_url:?} must be an http:// or https:// URL"
                )));
            }
            let c = conn.client();
            let tenant = tenant_or_root(&c, tenant)?;
            let p = c.call("pools/get", &json!({"tenantId": tenant, "poolId": pool}))?;
            if p["agent"] != "bcd" || p.get("archivedAt").is_some() {
                return Err(ApiError::invalid_state(format!(
                    "pool {pool} admits no agent (agent none, or archived)"
                )));
            }
            let (cfg, jwk) =
                crate::appliance::agent_files::agent_config_for(&conn.state_dir(), &gateway_url)?;
            print!(
                "{}",
                crate::cli::install_script::render(&crate::cli::install_script::ScriptInput {
                    pool: &pool,
                    config: &cfg,
                    jwk_json: &jwk,
                    base_url: &base_url,
                    version: &bcd_version,
                    sha256_amd64: amd.as_deref(),
                    sha256_arm64: arm.as_deref(),
                    release: release_manifest.as_deref().map(|m| (m, pins.as_slice())),
                })
            );
            Ok(())
        }
        DaemonCmd::AgentConfig { gateway_url, out } => {
            crate::appliance::agent_files::write_agent_config(
                &conn.state_dir(),
                &gateway_url,
                &out,
            )?;
            println!(
                "wrote {}/config.toml (0600) and {}/join-encryption.jwk (0644)",
                out.display(),
                out.display()
            );
            Ok(())
        } // Rendered into memory, then written: a closed pipe (`| head`) ends quietly.
    }
}
