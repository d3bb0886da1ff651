//! The contract between the agent and the appliance: wire messages and the `Call`/`Outcome`
//! interface, claims, CSRs, JWE, X.509 reading, the agent's config. Imports only `base`.

pub mod agent_config;
pub mod claims;
pub mod csr;
pub mod jwe;
pub mod protocol;
pub mod x509;
