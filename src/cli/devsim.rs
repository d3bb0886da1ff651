//! `bca dev --sim N`: a throwaway appliance in a temporary directory, a pool, a token, and N
//! simulated machines (distinct claims) that join, hold sessions and renew on a short certificate
//! lifetime, each a real `bca agent run` process talking TLS to the real gateway.

use crate::base::error::{ApiError, ApiResult};
use crate::cli::client::Client;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub struct SimOptions {
    pub machines: usize,
    pub cert_ttl_seconds: u32,
    /// Keep the temporary directory when stopping.
    pub keep: bool,
}

struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
        }
        for c in &mut self.0 {
            let _ = c.wait();
        }
    }
}

fn free_port() -> ApiResult<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(ApiError::internal)?;
    Ok(l.local_addr().map_err(ApiError::internal)?.to_string())
}

/// Claims of simulated machine `i`: a product UUID, two serials and a MAC of its own.
pub fn sim_claims(i: usize) -> crate::proto::claims::Claims {
    let mut r = [0u8; 4];
    crate::base::crypto::fill_random(&mut r);
    let tag = crate::base::crypto::hex(&r);
    serde_json::from_value(json!({
        "productUuid": format!("5e0c{i:04x}-{}-4000-8000-{:012x}", &tag[..4], i),
        "serials": {"product": format!("SIM-{tag}-{i}"), "board": format!("SIMB-{tag}-{i}")},
        "macs": [format!("00:1b:21:{:02x}:{:02x}:{:02x}", (i >> 16) & 0xff, (i >> 8) & 0xff, i & 0xff)],
        "hostname": format!("sim-{i}"),
    }))
    .expect("valid claims")
}

pub fn run(o: SimOptions) -> ApiResult<()> {
    let exe = std::env::current_exe().map_err(ApiError::internal)?;
    let mut rnd = [0u8; 4];
    crate::base::crypto::fill_random(&mut rnd);
    let dir = std::env::temp_dir().join(format!("bca-sim-{}", crate::base::crypto::hex(&rnd)));
    crate::base::fsutil::create_private_dir(&dir).map_err(ApiError::internal)?;
    let result = simulate(&o, &exe, &dir);
    if !o.keep {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn simulate(o: &SimOptions, exe: &Path, dir: &Path) -> ApiResult<()> {
    let state = dir.join("state");
    let (http, gateway) = (free_port()?, free_port()?);
    crate::appliance::init::init(
        crate::appliance::init::InitOptions {
            state_dir: state.clone(),
            trust_domain: "sim.bca.internal".into(),
            site: "sim".into(),
            gateway_sans: vec!["127.0.0.1".into()],
            gateway_url: Some(format!("https://{gateway}")),
            key_protection: crate::config::KeyProtection::File,
            passphrase: None,
            tpm: None,
            tpm_pcrs: None,
            escrow: None,
            listen_http: Some(http.clone()),
            listen_gateway: Some(gateway.clone()),
            store: Default::default(),
        },
        crate::base::clock::now(),
    )?;
    let cfg_path = state.join("config.toml");
    let text = std::fs::read_to_string(&cfg_path).map_err(ApiError::internal)?;
    let text = text
        .replace(
            "cert_ttl_seconds = 86400",
            &format!("cert_ttl_seconds = {}", o.cert_ttl_seconds),
        )
        .replace("heartbeat_seconds = 15", "heartbeat_seconds = 2");
    std::fs::write(&cfg_path, text).map_err(ApiError::internal)?;

    let mut children = Children(Vec::new());
    let mut serve = Command::new(exe)
        .args(["serve", "--state-dir"])
        .arg(&state)
        .env("BCA_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .map_err(ApiError::internal)?;
    let mut ready = String::new();
    BufReader::new(serve.stdout.take().expect("piped"))
        .read_line(&mut ready)
        .map_err(ApiError::internal)?;
    children.0.push(serve);
    let ready: Value = serde_json::from_str(&ready)
        .map_err(|_| ApiError::internal("the appliance did not start"))?;
    let client = Client::new(Path::new(ready["admin"].as_str().unwrap_or_default()));
    let root = crate::cli::root_tenant(&client)?;
    let pool = client.call("pools/create", &json!({"tenantId": root, "name": "sim"}))?;
    let pool_id = pool["id"].as_str().unwrap_or_default().to_string();
    let tok = client.call(
        "joinTokens/create",
        &json!({"tenantId": root, "poolId": pool_id, "ttlSeconds": 3600, "maxUses": o.machines, "idempotencyKey": "sim"}),
    )?;
    let token = zeroize::Zeroizing::new(tok["token"].as_str().unwrap_or_default().to_string());

    println!("state dir: {}", state.display());
    println!(
        "appliance: http {http}, gateway {gateway}; pool {pool_id}; {} machines",
        o.machines
    );
    println!("watch it: bca --state-dir {} nodes list", state.display());
    let mut agents: Vec<PathBuf> = Vec::new();
    for i in 0..o.machines {
        let adir = dir.join("agents").join(format!("m{i}"));
        crate::appliance::agent_files::write_agent_config(
            &state,
            &[format!("https://{gateway}")],
            &adir,
        )?;
        let claims = adir.join("claims.json");
        std::fs::write(
            &claims,
            serde_json::to_vec(&sim_claims(i)).expect("serializes"),
        )
        .map_err(ApiError::internal)?;
        let node = crate::agent::join(&crate::agent::JoinOptions {
            config: adir.join("config.toml"),
            data_dir: adir.join("data"),
            claims: Some(claims),
            role: "node".into(),
            reset: false,
            yes: false,
            server: None,
            pins: None,
            token_file: None,
            token: Some(token.clone()),
            attestor: String::new(),
            tpm: None,
            no_enroll: false,
            wait_seconds: 0,
            retry_seconds: None,
            node_id: None,
        })?;
        println!("machine {i} joined as {node}");
        agents.push(adir);
    }
    for adir in &agents {
        let log = std::fs::File::create(adir.join("agent.log")).map_err(ApiError::internal)?;
        let child = Command::new(exe)
            .args([
                "agent",
                "run",
                "--backoff-base-ms",
                "500",
                "--backoff-cap-ms",
                "5000",
                "--config",
            ])
            .arg(adir.join("config.toml"))
            .arg("--data-dir")
            .arg(adir.join("data"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .map_err(ApiError::internal)?;
        children.0.push(child);
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ApiError::internal)?;
    rt.block_on(async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).map_err(ApiError::internal)?;
        let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).map_err(ApiError::internal)?;
        let start = std::time::Instant::now();
        loop {
            tokio::select! {
                _ = term.recv() => break,
                _ = int.recv() => break,
                _ = tokio::time::sleep(Duration::from_secs(2)) => {
                    let nodes = client.call("nodes/list", &json!({"tenantId": root, "limit": 200}))?;
                    let items = nodes["items"].as_array().cloned().unwrap_or_default();
                    let connected = items.iter().filter(|n| n["connected"] == true).count();
                    let renewed = client
                        .call("events/list", &json!({"tenantId": root, "type": "node.renewed", "limit": 200}))?["items"]
                        .as_array()
                        .map(|a| a.len())
                        .unwrap_or(0);
                    println!("t={:>4}s  nodes {}  connected {}  renewals {}", start.elapsed().as_secs(), items.len(), connected, renewed);
                }
            }
        }
        Ok::<(), ApiError>(())
    })?;
    println!("stopping the simulation");
    drop(children);
    Ok(())
}
