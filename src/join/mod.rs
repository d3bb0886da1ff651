//! The JoinService: one writer thread, batches of joins in one durable transaction, and the
//! attestors whose evidence it turns into admissions (bearer tokens, discovery, TPM), renewal and
//! session rows. It sees the `Site`, never the serving appliance.

pub mod discovery;
pub mod renewal;
pub mod service;
pub mod sessions;
pub mod site;
pub mod tpm;
