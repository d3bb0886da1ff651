//! Records and pure rules: admission (the seed's decision table), acceptance, validation, pools, join tokens,
//! the downloads' names. No I/O, no store, no config.

pub mod acceptance;
pub mod admission;
pub mod downloads;
pub mod pool;
pub mod token;
pub mod validate;
