//! The command line: `bca <command>`, following the seed's `better-compute` commands verb for verb.
//!
//! Raw arguments are parsed by clap, then turned into API calls; answers print as tables for
//! people or, with `--json`, as the API's JSON. Errors print as `CODE: message` on stderr and the
//! process exits 1 (clap's usage errors exit 2).

pub mod client;
pub mod devsim;
pub mod doctor;
pub mod install_script;
pub mod intake;

mod admin;
mod agent;
mod args;
mod conn;
mod duration;
mod join_requests;
mod local;
mod nodes;
mod output;
mod tpm;

use admin::*;
use agent::agent;
pub use args::*;
use conn::tenant_scope;
pub use conn::{root_tenant, tenant_or_root, Conn};
pub use duration::parse_duration;
use local::*;
use output::*;
pub use output::{print_cursor, print_list, print_table, s};
use tpm::tpm;

use crate::base::error::{ApiError, ApiResult, Code};
use clap::{CommandFactory, Parser};
use serde_json::json;
use std::path::PathBuf;

/// The process's exit: prints the error as `CODE: message`.
pub fn main() -> i32 {
    let cli = Cli::parse();
    init_logging();
    match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{}: {}", e.code.as_str(), e.message);
            1
        }
    }
}

/// Logs go to stderr: `BCA_LOG` sets the filter (default `info`), `BCA_LOG_FORMAT=json` makes
/// every line a JSON object (for journald and log shippers). No secret is ever logged.
fn init_logging() {
    // The PostgreSQL client logs every bound parameter (hashes, certificates, claims) at debug:
    // never below warn, whatever BCA_LOG asks.
    let filter = tracing_subscriber::EnvFilter::try_from_env("BCA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
        .add_directive("tokio_postgres=warn".parse().expect("a directive"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("BCA_LOG_FORMAT").as_deref() == Ok("json") {
        let _ = builder.json().try_init();
        return;
    }
    let _ = builder
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

fn run(cli: Cli) -> ApiResult<()> {
    let conn = &cli.conn;
    match cli.command {
        Command::Init(a) => cmd_init(a, conn),
        Command::JoinSite(a) => local::cmd_join_site(a, conn),
        Command::Site(SiteCmd::Appliances(cmd)) => {
            let (method, body) = match &cmd {
                AppliancesCmd::List => ("site/appliances/list", json!({})),
                AppliancesCmd::Approve { id, fingerprint } => (
                    "site/appliances/approve",
                    json!({"id": id, "fingerprint": fingerprint}),
                ),
                AppliancesCmd::Remove { id } => ("site/appliances/remove", json!({"id": id})),
            };
            let v = conn.client().call(method, &body)?;
            match cmd {
                AppliancesCmd::List => print_list(
                    conn,
                    &v,
                    &[
                        ("ID", "id"),
                        ("STATE", "state"),
                        ("NAMES", "names"),
                        ("FINGERPRINT", "fingerprint"),
                        ("ALIVE", "alive"),
                        ("LAST HEARTBEAT", "lastHeartbeat"),
                    ],
                ),
                _ => print(conn, &v, print_record),
            }
            Ok(())
        }
        Command::Serve(a) => {
            let opts = crate::daemon::serve::ServeOptions {
                tpm: a.tpm,
                listen_http: a.listen_http,
                listen_gateway: a.listen_gateway,
                admin_socket: a.admin_socket,
                announce: None,
            };
            crate::daemon::serve::run(&conn.state_dir(), opts).map_err(ApiError::invalid_config)
        }
        Command::NetChild => crate::daemon::privsep::child_main().map_err(ApiError::invalid_config),
        Command::Dev(a) => cmd_dev(
            a,
            conn.state_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("./.bca")),
        ),
        Command::Tenants(TenantsCmd::Create { name }) => {
            let v = conn
                .client()
                .call("tenants/create", &json!({"name": name}))?;
            print(conn, &v, print_record);
            Ok(())
        }
        Command::Tenants(TenantsCmd::List {}) => {
            let v = conn.client().call("tenants/list", &json!({}))?;
            print(conn, &v, |v| {
                print_table(
                    &["ID", "NAME", "ROOT"],
                    items(v)
                        .iter()
                        .map(|t| vec![s(&t["id"]), s(&t["name"]), s(&t["root"])])
                        .collect(),
                )
            });
            Ok(())
        }
        Command::Pools(cmd) => cmd_pools(cmd, conn),
        Command::JoinTokens(cmd) => cmd_join_tokens(cmd, conn),
        Command::Events(EventsCmd::List {
            type_prefix,
            tenant,
            all_tenants,
            limit,
            cursor,
        }) => {
            let c = conn.client();
            let tenant = tenant_scope(&c, tenant, all_tenants)?;
            let v = c.call(
                "events/list",
                &json!({"tenantId": tenant, "type": type_prefix, "limit": limit, "cursor": cursor}),
            )?;
            print(conn, &v, |v| {
                print_table(
                    &["TIME", "TYPE", "TENANT", "DATA"],
                    items(v)
                        .iter()
                        .map(|e| {
                            vec![
                                s(&e["createdAt"]),
                                s(&e["type"]),
                                s(&e["tenantId"]),
                                e["data"].to_string(),
                            ]
                        })
                        .collect(),
                );
                print_cursor(v);
            });
            Ok(())
        }
        Command::Audit(AuditCmd::List {
            since,
            action,
            tenant,
            all_tenants,
            limit,
            cursor,
        }) => {
            let c = conn.client();
            let tenant = tenant_scope(&c, tenant, all_tenants)?;
            // An age is turned into a time here; a time is passed on for the server to check.
            let since = since.map(|s| match crate::admin::audit::parse_age(&s) {
                Some(age) => crate::base::clock::rfc3339(crate::base::clock::now() - age),
                None => s,
            });
            let v = c.call(
                "audit/list",
                &json!({"tenantId": tenant, "action": action, "since": since, "limit": limit, "cursor": cursor}),
            )?;
            print(conn, &v, |v| {
                print_table(
                    &["TIME", "ACTION", "ACTOR", "TARGET", "DATA"],
                    items(v)
                        .iter()
                        .map(|e| {
                            vec![
                                s(&e["createdAt"]),
                                s(&e["action"]),
                                s(&e["actor"]),
                                s(&e["target"]),
                                e["data"].to_string(),
                            ]
                        })
                        .collect(),
                );
                print_cursor(v);
            });
            Ok(())
        }
        Command::Backup { file } => {
            let m = crate::appliance::backup::backup(&conn.state_dir(), &file)?;
            eprintln!(
                "backup of site {} ({}) written to {} (keys {}; {} files)",
                m.site_name,
                m.site_id,
                file.display(),
                serde_json::to_value(m.key_protection)
                    .unwrap_or_default()
                    .as_str()
                    .unwrap_or_default(),
                m.files.len()
            );
            print(
                conn,
                &serde_json::to_value(&m).unwrap_or_default(),
                print_record,
            );
            Ok(())
        }
        Command::Restore { file } => {
            let dir = conn.state_dir();
            let m = crate::appliance::backup::restore(&file, &dir)?;
            eprintln!(
                "restored site {} ({}) from {} into {}; check config.toml (listeners, gateway_url) for this box, then run bca serve",
                m.site_name,
                m.site_id,
                m.created_at,
                dir.display()
            );
            print(
                conn,
                &serde_json::to_value(&m).unwrap_or_default(),
                print_record,
            );
            Ok(())
        }
        Command::Store(StoreCmd::Migrate {
            to,
            store_password_file,
        }) => {
            let dir = conn.state_dir();
            let cfg = crate::cli::local::store_config(Some(to), store_password_file)?;
            let m =
                crate::appliance::store_move::migrate_to(&dir, &cfg, crate::base::clock::now())?;
            for (t, n) in &m.copied {
                eprintln!("{t}: {n} rows");
            }
            eprintln!(
                "the store is now {} (checked row for row); the SQLite file is kept as {}; start bca serve",
                cfg.url.as_deref().unwrap_or_default(),
                m.kept.display()
            );
            Ok(())
        }
        Command::Doctor => {
            if crate::cli::doctor::run(&conn.state_dir(), conn.socket.as_deref()) {
                Ok(())
            } else {
                Err(ApiError::new(
                    Code::InvalidState,
                    "bca doctor found problems (FAIL lines above)",
                ))
            }
        }
        Command::Health => {
            let v = conn.client().call("health/get", &json!({}))?;
            print(conn, &v, print_record);
            if v["status"] == "failing" {
                return Err(ApiError::new(Code::Unavailable, "the appliance is failing"));
            }
            Ok(())
        }
        Command::Nodes(cmd) => nodes::run(cmd, conn),
        Command::JoinRequests(cmd) => join_requests::run(cmd, conn),
        Command::Boot(BootCmd::Leases { mac, limit, cursor }) => {
            let v = conn.client().call(
                "bootLeases/list",
                &json!({"mac": mac, "limit": limit, "cursor": cursor}),
            )?;
            print_list(
                conn,
                &v,
                &[
                    ("EPOCH", "epoch"),
                    ("TIME", "createdAt"),
                    ("MAC", "mac"),
                    ("IP", "ip"),
                    ("ARCH", "arch"),
                    ("STAGE", "stage"),
                    ("FILE", "file"),
                ],
            );
            Ok(())
        }
        Command::Tpm(cmd) => tpm(cmd, conn),
        Command::Pki(cmd) => pki(cmd, conn),
        Command::Agent(cmd) => agent(cmd, conn),
        Command::Downloads(cmd) => downloads(cmd, conn),
        Command::Daemon(cmd) => daemon(cmd, conn),
        Command::Completions { shell } => {
            let mut out = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "bca", &mut out);
            let _ = std::io::Write::write_all(&mut std::io::stdout(), &out);
            Ok(())
        }
        Command::Man => {
            let mut out = Vec::new();
            clap_mangen::Man::new(Cli::command())
                .render(&mut out)
                .map_err(|e| ApiError::new(Code::Internal, e.to_string()))?;
            let _ = std::io::Write::write_all(&mut std::io::stdout(), &out);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1h"), Ok(3600));
        assert_eq!(parse_duration("1m"), Ok(60));
        assert_eq!(parse_duration("24h"), Ok(86_400));
        assert_eq!(parse_duration("1h30m"), Ok(5400));
        assert_eq!(parse_duration("3600s"), Ok(3600));
        assert!(parse_duration("59s").is_err());
        assert!(parse_duration("25h").is_err());
        assert!(parse_duration("1.5h").is_err());
        assert!(parse_duration("60").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("h").is_err());
    }

    #[test]
    fn the_cli_is_well_formed() {
        Cli::command().debug_assert();
    }
}
