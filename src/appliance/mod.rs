//! The key-holding process: the `App`, its answers to the edge's questions, the boot server's
//! database side, health, rotation, retention, the admin socket, init and backup.

pub mod admin_http;
pub mod agent_files;
pub mod answer;
pub mod app;
pub mod backup;
pub mod boot;
pub mod health;
pub mod init;
pub mod leases;
pub mod members;
pub mod retention;
pub mod rotation;
pub mod statedir;
pub mod store_move;
