//! One integration-test binary (one link on 2 cores), a module per area. Every test runs the real
//! `bca` binary against a real `bca serve` on a temporary state directory.

#[path = "it/acceptance.rs"]
mod acceptance;
#[path = "it/adopt.rs"]
mod adopt;
#[path = "it/boot.rs"]
mod boot;
#[path = "it/common.rs"]
mod common;
#[path = "it/crash.rs"]
mod crash;
#[path = "it/discovery.rs"]
mod discovery;
#[path = "it/fastmem.rs"]
mod fastmem;
#[path = "it/faults.rs"]
mod faults;
#[path = "it/foundation.rs"]
mod foundation;
#[path = "it/fuzz_replay.rs"]
mod fuzz_replay;
#[path = "it/hostile.rs"]
mod hostile;
#[path = "it/house_attacks.rs"]
mod house_attacks;
#[path = "it/hygiene.rs"]
mod hygiene;
#[path = "it/install.rs"]
mod install;
#[path = "it/join.rs"]
mod join;
#[path = "it/layers.rs"]
mod layers;
#[path = "it/lossy.rs"]
mod lossy;
#[path = "it/operate.rs"]
mod operate;
#[path = "it/postgres.rs"]
mod postgres;
#[path = "it/privsep.rs"]
mod privsep;
#[path = "it/provision.rs"]
mod provision;
#[path = "it/pxe.rs"]
mod pxe;
#[path = "it/renew.rs"]
mod renew;
#[path = "it/rotate.rs"]
mod rotate;
#[path = "it/seed_rules.rs"]
mod seed_rules;
#[path = "it/sites.rs"]
mod sites;
#[path = "it/timing.rs"]
mod timing;
#[path = "it/tls.rs"]
mod tls;
#[path = "it/tpm.rs"]
mod tpm;
#[path = "it/tpmjoin.rs"]
mod tpmjoin;
#[path = "it/x509pop.rs"]
mod x509pop;
