//! The ground floor: std-level helpers every layer may use (errors and their codes, the clock,
//! crypto primitives, ids, files, limits, metrics, text, HTTP/TLS helpers, the session registry,
//! cpio). Imports nothing else of the crate.

pub mod clock;
pub mod cpio;
pub mod crypto;
pub mod error;
pub mod fsutil;
pub mod ids;
pub mod limits;
pub mod metrics;
pub mod net;
pub mod progress;
pub mod registry;
pub mod text;
