//! Nodes: the admin API's `nodes.*` methods and `bca nodes`.

use crate::api::Ctx;
use crate::error::ApiResult;
use crate::store::Store;
use clap::Subcommand;
use serde_json::Value;

#[derive(Subcommand)]
pub enum NodesCmd {}

pub fn dispatch(_store: &Store, _ctx: &Ctx<'_>, _path: &str, _body: &[u8]) -> Option<ApiResult<Value>> {
    None
}

pub fn run_cli(cmd: NodesCmd, _conn: &crate::cli::Conn) -> ApiResult<()> {
    match cmd {}
}
