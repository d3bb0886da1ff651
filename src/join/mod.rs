//! The JoinService: one writer thread, batches of joins in one durable transaction, and the
//! attestors whose evidence it turns into admissions (bearer tokens, discovery, TPM), renewal and
//! session rows. It sees the `Site`, never the serving appliance.
//!
//! `service` dispatches to the attestors (`token`, `discovery`, `tpm`, `x509pop`) and to `renewal` and
//! `sessions`; they share the kernel (`issue`), the one admission writer (`admit`), the join
//! requests (`requests`) and the `site`, and never import each other (`tests/it/layers.rs`).

pub mod acceptance;
pub mod admit;
pub mod discovery;
pub mod issue;
pub mod renewal;
pub mod requests;
pub mod service;
pub mod sessions;
pub mod site;
pub mod token;
pub mod tpm;
pub mod x509pop;
