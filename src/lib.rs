//! bca: the rack-local appliance that admits bare-metal machines into compute pools and gives each
//! a short-lived X.509 identity. See `ARCHITECTURE.md` for the parts and their invariants.
#![forbid(unsafe_code)]

pub mod admission;
pub mod agent;
pub mod agent_run;
pub mod api;
pub mod app;
pub mod audit;
pub mod backup;
pub mod boot;
pub mod claims;
pub mod cli;
pub mod client;
pub mod clock;
pub mod config;
pub mod crypto;
pub mod csr;
pub mod devsim;
pub mod discovery;
pub mod doctor;
pub mod downloads;
pub mod error;
pub mod fsutil;
pub mod gateway;
pub mod health;
pub mod http;
pub mod ids;
pub mod init;
pub mod install_script;
pub mod intake;
pub mod joinrequests;
pub mod joinservice;
pub mod jwe;
pub mod keys;
pub mod metrics;
pub mod nodes;
pub mod pki;
pub mod progress;
pub mod protocol;
pub mod renewal;
pub mod rotation;
pub mod serve;
pub mod sessions;
pub mod store;
pub mod tlsclient;
pub mod validate;
