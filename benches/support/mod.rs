//! What both benches share: sizes from the environment, the `name: value unit` lines, the binary.

use std::path::PathBuf;

/// A size from the environment, else `default`.
pub fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `bca` binary beside the bench (target/release/deps/<bench>-… -> target/release/bca).
pub fn bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("bca")
}

/// One figure, `name: value unit`.
pub fn line(name: &str, value: f64, unit: &str) {
    if value >= 100.0 {
        println!("{name}: {value:.0} {unit}");
    } else {
        println!("{name}: {value:.3} {unit}");
    }
}
