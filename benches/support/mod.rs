//! What both benches share: sizes from the environment, the `name: value unit` lines, the binary.

use std::path::PathBuf;

/// A size from the environment, else `default`.
pub fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `bca` under test: `BCA_BENCH_BIN` when set (`make bench` sets it to the static release
/// binary, the one an appliance runs: its libc is musl, whose allocator and string functions are
/// not glibc's), else the build beside the bench (target/release/deps/<bench>-… ->
/// target/release/bca).
pub fn bin() -> PathBuf {
    if let Some(p) = std::env::var_os("BCA_BENCH_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("bca")
}

/// A header line naming the binary under test and how it is linked.
pub fn describe_bin() -> String {
    let b = bin();
    let linked = match std::process::Command::new("file")
        .arg("-L")
        .arg(&b)
        .output()
    {
        Ok(o) if String::from_utf8_lossy(&o.stdout).contains("static") => "static",
        Ok(_) => "dynamic",
        Err(_) => "unknown",
    };
    format!("# bca under test: {} ({linked})", b.display())
}

/// One figure, `name: value unit`.
pub fn line(name: &str, value: f64, unit: &str) {
    if value >= 100.0 {
        println!("{name}: {value:.0} {unit}");
    } else {
        println!("{name}: {value:.3} {unit}");
    }
}
