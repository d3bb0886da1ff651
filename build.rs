//! Compiles `csrc/fastmem.c` (see there): on x86_64 always as `bca_memcpy` and `bca_memmove`
//! (tested by `tests/it/fastmem.rs`); for the static musl build also as `memcpy` and `memmove`,
//! linked whole so that they take the place of musl's `rep movsq` ones.

fn main() {
    println!("cargo:rerun-if-changed=csrc/fastmem.c");
    println!("cargo:rerun-if-changed=build.rs");
    let target = |k: &str| std::env::var(k).unwrap_or_default();
    if target("CARGO_CFG_TARGET_ARCH") != "x86_64" {
        return;
    }
    let mut b = cc::Build::new();
    b.file("csrc/fastmem.c")
        .opt_level(2)
        .flag("-ffreestanding")
        .flag("-fno-builtin")
        .flag("-fno-stack-protector")
        // GCC's; clang makes no library calls of loops under -ffreestanding / -fno-builtin.
        .flag_if_supported("-fno-tree-loop-distribute-patterns")
        .warnings(true)
        .extra_warnings(true);
    if target("CARGO_CFG_TARGET_ENV") == "musl" {
        b.define("BCA_LIBC_MEM", None)
            .link_lib_modifier("+whole-archive");
    }
    b.compile("bcafastmem");
}
