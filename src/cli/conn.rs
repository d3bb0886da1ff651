//! Where the appliance is (`--state-dir`, `--socket`) and the tenant a command acts in.

use crate::base::error::{ApiError, ApiResult, Code};
use crate::cli::client::Client;
use clap::Args;
use serde_json::json;
use std::path::PathBuf;

/// Where the appliance's state and admin socket are; every admin command takes these.
#[derive(Args, Clone)]
pub struct Conn {
    /// The state directory (default /var/lib/bca; ./.bca for `bca dev`).
    #[arg(long, global = true, env = "BCA_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// The admin socket (default: from the state directory's config, else <state-dir>/admin.sock).
    #[arg(long, global = true, env = "BCA_SOCKET")]
    pub socket: Option<PathBuf>,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    pub json: bool,
}

impl Conn {
    pub fn state_dir(&self) -> PathBuf {
        self.state_dir
            .clone()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR))
    }

    pub fn client(&self) -> Client {
        let dir = self.state_dir();
        let path = self.socket.clone().unwrap_or_else(|| {
            crate::config::Config::load(&dir)
                .map(|c| c.admin_socket_path(&dir))
                .unwrap_or_else(|_| dir.join("admin.sock"))
        });
        Client::new(&path)
    }
}

pub fn root_tenant(client: &Client) -> ApiResult<String> {
    let v = client.call("tenants/list", &json!({}))?;
    v["items"]
        .as_array()
        .and_then(|a| a.iter().find(|t| t["root"] == json!(true)))
        .and_then(|t| t["id"].as_str())
        .map(str::to_string)
        .ok_or_else(|| ApiError::new(Code::Internal, "the appliance reported no root tenant"))
}

pub fn tenant_or_root(client: &Client, t: Option<String>) -> ApiResult<String> {
    match t {
        Some(t) => Ok(t),
        None => root_tenant(client),
    }
}

/// The tenant a list is scoped to: every tenant (`--all-tenants`), the one named, else the root.
pub(crate) fn tenant_scope(
    client: &Client,
    t: Option<String>,
    all: bool,
) -> ApiResult<Option<String>> {
    if all {
        return Ok(None);
    }
    tenant_or_root(client, t).map(Some)
}

pub const DEFAULT_STATE_DIR: &str = "/var/lib/bca";
