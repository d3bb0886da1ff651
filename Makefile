# bca: build, run and test. `make run` and `make test` are the README's two quickstart commands.
MUSL := x86_64-unknown-linux-musl
STATIC := target/$(MUSL)/release/bca
export CC_x86_64_unknown_linux_musl := musl-gcc

.PHONY: build run sim image test bench deps check lint clean

## The static release binary (musl, mimalloc, no OpenSSL, no libtss2).
build: deps
	cargo build --release --locked --target $(MUSL)
	@file $(STATIC)
	@ls -l $(STATIC) | awk '{printf "size: %.1f MiB\n", $$5/1048576}'

## Build and run the appliance on its embedded defaults: state in ./.bca, loopback ports.
run:
	cargo build --release --locked
	./target/release/bca dev

## A throwaway appliance with five simulated machines (join, sessions, renewal).
sim:
	cargo build --release --locked
	./target/release/bca dev --sim 5 --sim-cert-ttl 30

## The discovery ramdisk (image/out/vmlinuz, initrd.img) and the checked iPXE binaries.
image: build
	./scripts/install-boot-deps.sh
	./image/build.sh

## Every test, after installing what the tests need (the network-boot tests boot the ramdisk).
test: deps image
	cargo test --locked --all-targets

## Join and renewal storms, sessions and cold start, per appliance core (see BENCHMARKS.md).
bench:
	cargo build --release --locked
	cargo bench --locked --bench storm

deps:
	./scripts/install-deps.sh
	./scripts/install-boot-deps.sh

lint:
	cargo fmt --all -- --check
	cargo clippy --locked --all-targets -- -D warnings

clean:
	cargo clean
