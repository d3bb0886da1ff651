#![forbid(unsafe_code)]

// musl's allocator is slow under threads; mimalloc is the appliance's allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    std::process::exit(bca::cli::main());
}
