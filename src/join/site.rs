//! The site as the JoinService and its attestors see it: the configuration, the store, the public
//! PKI, the root tenant and the live sessions. The serving appliance (`app::App`) is this plus
//! what serving adds (the gateway, the rotator, the boot server's state); code that needs only
//! the site takes a `Site`, so the JoinService never reaches into the appliance.

use crate::base::registry::Registry;
use crate::config::Config;
use crate::pki::PublicPki;
use crate::store::Store;
use std::path::PathBuf;
use std::sync::Arc;

pub struct Site {
    pub state_dir: PathBuf,
    pub config: Config,
    pub store: Arc<Store>,
    pub root_tenant: String,
    pub pki: PublicPki,
    /// The gateway's live node sessions.
    pub sessions: Arc<Registry>,
}
