//! `bca serve`: load the state directory once, unseal the keys, open the listeners, and stop
//! cleanly on SIGTERM or SIGINT.

use crate::appliance::app::App;
use crate::config::KeyProtection;
use crate::keys;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::watch;

#[derive(Default, Clone)]
pub struct ServeOptions {
    /// The TPM instead of `config.toml`'s (key protection `tpm`).
    pub tpm: Option<String>,
    pub listen_http: Option<String>,
    pub listen_gateway: Option<String>,
    pub admin_socket: Option<PathBuf>,
    /// Called once with the readiness line, after every listener is bound (`bca dev` prints
    /// what to try with the addresses actually bound).
    pub announce: Option<Announce>,
}

/// What [`ServeOptions::announce`] is given: the readiness line's JSON.
pub type Announce = Arc<dyn Fn(&serde_json::Value) + Send + Sync>;

/// Loads everything `serve` needs; every failure here is a clear message and changes nothing.
pub fn prepare(state_dir: &Path) -> Result<(App, crate::pki::bundle::KeyBundle), String> {
    prepare_vault(state_dir, None).map(|(app, keys, _)| (app, keys))
}

/// [`prepare`], keeping the vault (what can seal the keys again) for rotation.
pub fn prepare_vault(
    state_dir: &Path,
    tpm: Option<&str>,
) -> Result<(App, crate::pki::bundle::KeyBundle, keys::Vault), String> {
    let tcti: Option<crate::tpm::Tcti> = tpm
        .map(|t| t.parse().map_err(|e: String| format!("--tpm: {e}")))
        .transpose()?;
    // The keys first: a wrong passphrase must not even open the database.
    let config = crate::config::Config::load(state_dir)?;
    let passphrase = match config.key_protection {
        KeyProtection::Passphrase => Some(keys::passphrase_from_env_or_prompt(false)?),
        KeyProtection::File => {
            tracing::warn!(
                "the appliance's private keys are plain files (key_protection = \"file\"): for development only"
            );
            None
        }
        KeyProtection::Tpm => None,
    };
    if tcti.is_some() && config.key_protection != KeyProtection::Tpm {
        return Err("--tpm goes with key_protection = \"tpm\"".into());
    }
    // A joined appliance takes the site's keys once an operator approved it (it waits till then).
    if keys::awaits_site_keys(state_dir, config.key_protection) {
        crate::appliance::members::take_site_keys(
            state_dir,
            &config,
            passphrase.as_ref().map(|p| p.as_bytes()),
            tcti.as_ref(),
        )?;
    }
    let (vault, bundle) = keys::Vault::open_with_tpm(
        state_dir,
        config.key_protection,
        passphrase.as_ref().map(|p| p.as_bytes()),
        tcti.as_ref(),
    )?;
    // A rotation interrupted by a crash is finished here: the public files follow the keys.
    let fixed = crate::appliance::rotation::reconcile(
        state_dir,
        &config,
        &bundle,
        crate::base::clock::now(),
    )?;
    if !fixed.is_empty() {
        tracing::warn!(files = ?fixed, "pki: finished an interrupted rotation");
    }
    let app = App::load(state_dir)?;
    app.check_keys(&bundle)?;
    Ok((app, bundle, vault))
}

pub fn run(state_dir: &Path, opts: ServeOptions) -> Result<(), String> {
    // One `bca serve` per state directory (`bca store migrate` checks the same lock).
    let _serving = crate::base::fsutil::serve_lock(state_dir)?.ok_or_else(|| {
        format!(
            "another bca serve runs on {} (it holds the state directory's lock)",
            state_dir.display()
        )
    })?;
    let (app, keys, vault) = prepare_vault(state_dir, opts.tpm.as_deref())?;
    // And one per appliance of the site (a copy of this state directory serving elsewhere is
    // refused); then its row in the site's database, which its audit rows and sessions name.
    let id = crate::appliance::statedir::own_id(state_dir)?;
    app.store.claim_exclusive(&id)?;
    crate::appliance::members::register(&app, &keys, &id, crate::base::clock::now())?;
    crate::store::appliances::set_this(&id);
    let rotator = Arc::new(crate::appliance::rotation::Rotator::new(vault));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the runtime: {e}"))?;
    rt.block_on(serve(app, keys, opts, rotator))
}

/// Binds a TCP listener, retrying for two seconds while the address is in use: the network child
/// of a `serve` that was just killed may still hold it (the gateway's and the HTTP listener are
/// both the child's) until its parent-death signal ends it.
async fn bind_tcp(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let mut tries = 0;
    loop {
        match listen_tcp(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 20 => {
                tries += 1;
                tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            }
            r => return r,
        }
    }
}

/// A TCP listener with a deep accept queue (4,096, the kernel's default `somaxconn`; tokio's own
/// is 1,024): when the gateway's handshake places are all taken (`[sessions] max_handshakes`),
/// connections wait there rather than have their SYNs dropped and retried a second later.
async fn listen_tcp(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let a = tokio::net::lookup_host(addr).await?.next().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, "the name has no address")
    })?;
    let s = if a.is_ipv4() {
        tokio::net::TcpSocket::new_v4()?
    } else {
        tokio::net::TcpSocket::new_v6()?
    };
    s.set_reuseaddr(true)?;
    s.bind(a)?;
    s.listen(4096)
}

async fn bind_admin(path: &Path, group: Option<u32>) -> Result<tokio::net::UnixListener, String> {
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        use std::os::unix::fs::FileTypeExt;
        if !meta.file_type().is_socket() {
            return Err(format!(
                "{} exists and is not a socket; not touching it",
                path.display()
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!("another bca is serving on {}", path.display()));
        }
        let _ = std::fs::remove_file(path);
    }
    let l = tokio::net::UnixListener::bind(path)
        .map_err(|e| format!("cannot bind {}: {e}", path.display()))?;
    let mode = if let Some(g) = group {
        std::os::unix::fs::chown(path, None, Some(g))
            .map_err(|e| format!("cannot chown {}: {e}", path.display()))?;
        0o660
    } else {
        0o600
    };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| e.to_string())?;
    Ok(l)
}

/// Retention at start and hourly; the clock checks at start and every ten minutes.
async fn housekeeping(
    app: Arc<App>,
    rotator: Arc<crate::appliance::rotation::Rotator>,
    mut stop: watch::Receiver<bool>,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(60));
    let mut minutes: u64 = 0;
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        let (app2, rotator) = (app.clone(), rotator.clone());
        let m = minutes;
        let _ = tokio::task::spawn_blocking(move || {
            if m % 10 == 0 {
                crate::appliance::health::log_clock(&app2);
            }
            if m % 60 == 0 {
                rotator.tick(&app2, crate::base::clock::now());
                // Re-read: an operator sets `hold` during an investigation without a restart.
                let retention = crate::config::Config::load(&app2.state_dir)
                    .map(|c| c.retention)
                    .unwrap_or_else(|e| {
                        tracing::warn!(error = %e, "retention: config.toml unreadable; using the settings from the start");
                        app2.config.retention.clone()
                    });
                crate::appliance::retention::apply(
                    &app2.store,
                    &retention,
                    &app2.root_tenant,
                    crate::base::clock::now(),
                );
            }
        })
        .await;
        minutes += 1;
    }
}

async fn serve(
    app: App,
    keys: crate::pki::bundle::KeyBundle,
    opts: ServeOptions,
    rotator: Arc<crate::appliance::rotation::Rotator>,
) -> Result<(), String> {
    let http_addr = opts
        .listen_http
        .clone()
        .unwrap_or_else(|| app.config.listen_http.clone());
    let gw_addr = opts
        .listen_gateway
        .clone()
        .unwrap_or_else(|| app.config.listen_gateway.clone());
    let admin_path = opts
        .admin_socket
        .clone()
        .unwrap_or_else(|| app.config.admin_socket_path(&app.state_dir));

    // The network child's user, looked up before anything is bound: a bad one changes nothing.
    let child_user = if app.config.privsep.enabled {
        crate::daemon::privsep::user(&app.config.privsep.user)?
    } else {
        None
    };
    let http = bind_tcp(&http_addr)
        .await
        .map_err(|e| format!("cannot listen on {http_addr} (--listen-http): {e}"))?;
    let gateway = bind_tcp(&gw_addr)
        .await
        .map_err(|e| format!("cannot listen on {gw_addr} (--listen-gateway): {e}"))?;
    let gw_local = gateway.local_addr().ok();
    let http_local = http.local_addr().ok();
    // The edge reads files beneath these two only (the network child by Landlock's leave).
    let boot_root = crate::base::fsutil::ReadRoot::open(&crate::appliance::boot::boot_root(&app))?;
    for (name, target) in crate::base::fsutil::links_out(boot_root.path()) {
        tracing::warn!(
            file = %name,
            %target,
            "boot: a link out of the boot root is not served (files are read beneath it only): copy the file in"
        );
    }
    let downloads = crate::base::fsutil::ReadRoot::open(&app.state_dir.join("downloads"))?;
    let http_base = crate::edge::boot::http::http_url(&app.config.boot, http_local);
    let boot_sockets =
        crate::edge::boot::server::bind(&app.config.boot, &http_base, boot_root.path())?;
    let admin = bind_admin(&admin_path, app.config.admin_group).await?;

    let app = Arc::new(app);
    let (stop_tx, stop_rx) = watch::channel(false);
    // The gateway gets its TLS key and a message handle; the signing keys go to the JoinService.
    let gateway_key = zeroize::Zeroizing::new(keys.gateway.pkcs8().to_vec());
    let tickets = crate::edge::tickets::TicketRoot::derive(keys.node_ca.pkcs8());
    let join = crate::join::service::JoinService::start(app.site.clone(), keys)?;
    let _ = app.join.set(join.handle());
    let gw = build_gateway(&app, &gateway_key, tickets.clone(), Some(join.handle()))?;
    drop(gateway_key);
    let mut tasks = tokio::task::JoinSet::new();
    // The network edge (gateway, HTTP, DHCP, TFTP) runs in a confined child unless privilege
    // separation is off; the parent keeps the sockets, so connections wait in their backlogs
    // while a child restarts.
    let mut supervisor = None;
    if app.config.privsep.enabled {
        let into_std = |l: tokio::net::TcpListener, what: &str| {
            l.into_std()
                .map_err(|e| format!("the {what} listener: {e}"))
        };
        let sockets = crate::daemon::privsep::Sockets {
            gateway: into_std(gateway, "gateway")?,
            http: into_std(http, "HTTP")?,
            boot_root,
            downloads,
            boot: boot_sockets,
        };
        let sup = crate::daemon::privsep::Supervisor::start(
            app.clone(),
            join.handle(),
            sockets,
            tickets,
            child_user,
            stop_rx.clone(),
        )
        .await;
        match sup {
            Ok(sup) => supervisor = Some(sup),
            Err(e) => {
                join.stop().await;
                return Err(e);
            }
        }
    } else {
        let edge = Arc::new(crate::edge::Edge {
            core: Arc::new(crate::appliance::answer::LocalCore(app.clone())),
            boot: app.config.boot.clone(),
            metrics_public: app.config.health.metrics_public,
            boot_root: Arc::new(boot_root),
            downloads,
        });
        if let Some(s) = boot_sockets {
            crate::edge::boot::server::run(edge.clone(), s, http_base, stop_rx.clone())?;
        }
        tasks.spawn(crate::edge::http::serve_public(http, edge, stop_rx.clone()));
        tasks.spawn(gw.serve(gateway, stop_rx.clone()));
    }
    // Signal handlers first: whoever reads the readiness line may stop us at once.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| e.to_string())?;
    let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(|e| e.to_string())?;
    let ready = serde_json::json!({
        "ready": true,
        "http": http_local.map(|a| a.to_string()).unwrap_or_default(),
        "gateway": gw_local.map(|a| a.to_string()).unwrap_or_default(),
        "admin": admin_path.display().to_string(),
        "site": app.config.site_id,
    });
    tracing::info!(http = %ready["http"], gateway = %ready["gateway"], admin = %admin_path.display(), "serving");
    println!("{ready}");
    if let Some(announce) = &opts.announce {
        announce(&ready);
    }

    tasks.spawn(crate::appliance::admin_http::serve_admin(
        admin,
        app.clone(),
        rotator.clone(),
        stop_rx.clone(),
    ));
    tasks.spawn(housekeeping(app.clone(), rotator, stop_rx.clone()));
    // Only a site on PostgreSQL can have several appliances: a SQLite box needs no lease.
    let (removed_tx, removed_rx) = tokio::sync::oneshot::channel::<String>();
    if !app.config.store.is_embedded() {
        tasks.spawn(heartbeat(app.clone(), removed_tx, stop_rx.clone()));
    }

    let mut outcome = Ok(());
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: stopping"),
        _ = int.recv() => tracing::info!("SIGINT: stopping"),
        Ok(why) = removed_rx => {
            tracing::error!("{why}");
            outcome = Err(why);
        }
    }
    let _ = stop_tx.send(true);
    let (stopped, _) = tokio::join!(
        async {
            match supervisor {
                Some(s) => tokio::time::timeout(std::time::Duration::from_secs(5), s.wait())
                    .await
                    .ok()
                    .flatten(),
                None => None,
            }
        },
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while tasks.join_next().await.is_some() {}
        })
    );
    join.stop().await;
    let _ = std::fs::remove_file(&admin_path);
    // Last: the network child, stopped, still holds the sessions' connections (recorded closed
    // already); ending it closes them as the appliance exits, so their nodes reconnect to the
    // next start rather than into this one's listener.
    drop(stopped);
    tracing::info!("stopped");
    outcome
}

/// This appliance's lease in the site's database, renewed every few seconds; the sessions of
/// appliances found dead are marked closed. Says why when this appliance was removed.
async fn heartbeat(
    app: Arc<App>,
    removed: tokio::sync::oneshot::Sender<String>,
    mut stop: watch::Receiver<bool>,
) {
    let Some(id) = crate::store::appliances::this() else {
        return;
    };
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(
        crate::appliance::members::HEARTBEAT_SECONDS,
    ));
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            _ = tick.tick() => {}
        }
        let app2 = app.clone();
        let r = tokio::task::spawn_blocking(move || {
            crate::appliance::members::heartbeat(&app2, id, crate::base::clock::now())
        })
        .await;
        if let Ok(Err(why)) = r {
            let _ = removed.send(why);
            return;
        }
    }
}

/// The gateway of this process: its certificate (kept in the App for rotation), its tickets,
/// and its relay to the JoinService (`None`: every join answers `INVALID_CONFIG`).
pub fn build_gateway(
    app: &Arc<App>,
    gateway_key_pkcs8: &[u8],
    tickets: crate::edge::tickets::TicketRoot,
    join: Option<crate::join::service::JoinHandle>,
) -> Result<crate::edge::gateway::Gateway, String> {
    use crate::edge::gateway::{server_config_with, Gateway, GatewayCert};
    let cert = Arc::new(GatewayCert::new(
        &app.pki.gateway,
        &app.pki.serving_ca,
        gateway_key_pkcs8,
    )?);
    let _ = app.gateway_cert.set(cert.clone());
    let tickets = Arc::new(crate::edge::tickets::Tickets::from_root(tickets));
    let cfg = server_config_with(cert, &app.pki.node_ca, tickets)?;
    let relay = join.map(|j| Arc::new(j) as Arc<dyn crate::proto::protocol::CallSink>);
    Ok(Gateway::with_parts(
        app.config.sessions.clone(),
        app.sessions.clone(),
        cfg,
        relay,
    ))
}
