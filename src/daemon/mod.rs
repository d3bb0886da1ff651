//! The process model: `serve`, the privilege-separated parent and network child, confinement.

pub mod confine;
pub mod privsep;
pub mod serve;
