//! bca: the rack-local appliance that admits bare-metal machines into compute pools and gives each
//! a short-lived X.509 identity. See `ARCHITECTURE.md` for the parts and their invariants.
//!
//! The modules are layers, top to bottom; each imports only from the layers its rule names
//! (`tests/it/layers.rs` reads every `crate::` path and fails on any other):
//! `cli` > `daemon` > `appliance` > `admin` > `join` > `store` | `edge` | `agent` > `keys` >
//! `pki` > `domain` | `tpm` | `config` > `proto` > `base`.
#![forbid(unsafe_code)]

pub mod admin;
pub mod agent;
pub mod appliance;
pub mod base;
pub mod cli;
pub mod config;
pub mod daemon;
pub mod domain;
pub mod edge;
pub mod fuzzing;
pub mod join;
pub mod keys;
pub mod pki;
pub mod proto;
pub mod store;
pub mod tpm;
