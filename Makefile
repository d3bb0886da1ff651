# bca: build, run and test. `make run` and `make test` are the README's two quickstart commands.
MUSL := x86_64-unknown-linux-musl
STATIC := target/$(MUSL)/release/bca
export CC_x86_64_unknown_linux_musl := musl-gcc

.PHONY: build run sim image test bench deps check lint clean install deb fuzz soak

# `make install`: PREFIX /usr/local, which dpkg never touches (the Debian package, `make deb`,
# installs into /usr); every directory below is on systemd's, man's and the shells' search paths.
# DESTDIR stages the tree elsewhere. BIN installs that binary instead of building the static one
# (the tests use it: no cargo). The state directory is always /var/lib/bca (the unit names it).
PREFIX ?= /usr/local
BINDIR ?= $(PREFIX)/bin
UNITDIR ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
MANDIR ?= $(PREFIX)/share/man
BASHDIR ?= $(PREFIX)/share/bash-completion/completions
ZSHDIR ?= $(if $(filter /usr,$(PREFIX)),$(PREFIX)/share/zsh/vendor-completions,$(PREFIX)/share/zsh/site-functions)
FISHDIR ?= $(PREFIX)/share/fish/vendor_completions.d
BIN ?=
INSTALL_BIN = $(if $(BIN),$(BIN),$(STATIC))
# Completions and the man page come from the binary itself, in a clean environment: nothing of
# the caller's (BCA_STATE_DIR and the like, which clap's help shows) can leak into them.
GEN = env -i PATH=/usr/bin:/bin LC_ALL=C $(INSTALL_BIN)

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

## Every test, after installing what the tests need (the network-boot tests boot the ramdisk),
## then every fuzz target for a bounded time (FUZZ_SECONDS each, 10 here).
## The suites that admit, renew, discover, approve, rotate and prune run a second time with the
## site in PostgreSQL (BCA_TEST_STORE=postgres: a throwaway cluster the tests start themselves).
PG_SUITES := join:: renew:: discovery:: tpmjoin:: rotate:: operate:: seed_rules:: x509pop::
test: deps image
	cargo test --locked --all-targets
	BCA_TEST_STORE=postgres cargo test --locked --test tests -- $(PG_SUITES)
	FUZZ_SECONDS=$${FUZZ_SECONDS:-10} ./scripts/fuzz.sh

## The long fault runs, outside CI: 20 power cuts of a VM running bca serve under a join and
## renewal storm (make test makes 5); 20 SIGKILLs of two appliances on one PostgreSQL and 5
## restarts of the database under a storm through both (make test makes 6 and 2).
soak: deps image
	BCA_POWER_CUTS=$${BCA_POWER_CUTS:-20} cargo test --locked --test tests -- faults::power_cuts --nocapture
	BCA_SITE_KILLS=$${BCA_SITE_KILLS:-20} BCA_SITE_DB_RESTARTS=$${BCA_SITE_DB_RESTARTS:-5} cargo test --locked --test tests -- sites::two_appliances_under --nocapture

## The fuzz targets (fuzz/, cargo-fuzz on the nightly toolchain), FUZZ_SECONDS each (default 30).
fuzz:
	./scripts/fuzz.sh

## Join and renewal storms, sessions and cold start, per appliance core (see BENCHMARKS.md), of
## the static binary an appliance runs (BCA_BENCH_BIN; unset, the benches use target/release/bca).
bench: build
	BCA_BENCH_BIN=$(CURDIR)/$(STATIC) cargo bench --locked --bench storm
	BCA_BENCH_BIN=$(CURDIR)/$(STATIC) cargo bench --locked --bench boot
	BCA_BENCH_ENGINES=1 BENCH_JOINS=$${BENCH_ENGINE_JOINS:-5000} BCA_BENCH_BIN=$(CURDIR)/$(STATIC) cargo bench --locked --bench storm

## Install the static binary, the hardened unit, the sysusers.d entry, completions, the man page
## and /var/lib/bca (0700). Without DESTDIR it also creates the bca user and tells systemd; it never
## starts bca (docs/install.md: `bca init` first).
install: $(if $(BIN),,build)
	install -D -m 0755 $(INSTALL_BIN) $(DESTDIR)$(BINDIR)/bca
	install -d -m 0755 $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSUSERSDIR) $(DESTDIR)$(MANDIR)/man1 \
		$(DESTDIR)$(BASHDIR) $(DESTDIR)$(ZSHDIR) $(DESTDIR)$(FISHDIR)
	sed 's|^ExecStart=/usr/bin/bca |ExecStart=$(BINDIR)/bca |' packaging/bca.service > $(DESTDIR)$(UNITDIR)/bca.service
	install -m 0644 packaging/bca.sysusers $(DESTDIR)$(SYSUSERSDIR)/bca.conf
	$(GEN) completions bash > $(DESTDIR)$(BASHDIR)/bca
	$(GEN) completions zsh > $(DESTDIR)$(ZSHDIR)/_bca
	$(GEN) completions fish > $(DESTDIR)$(FISHDIR)/bca.fish
	$(GEN) man > $(DESTDIR)$(MANDIR)/man1/bca.1
	gzip -9nf $(DESTDIR)$(MANDIR)/man1/bca.1
	chmod 0644 $(DESTDIR)$(UNITDIR)/bca.service $(DESTDIR)$(BASHDIR)/bca $(DESTDIR)$(ZSHDIR)/_bca \
		$(DESTDIR)$(FISHDIR)/bca.fish $(DESTDIR)$(MANDIR)/man1/bca.1.gz
	install -d -m 0700 $(DESTDIR)/var/lib/bca
	chmod 0700 $(DESTDIR)/var/lib/bca
	@if [ -z "$(DESTDIR)" ]; then \
		if command -v systemd-sysusers >/dev/null; then systemd-sysusers $(SYSUSERSDIR)/bca.conf; \
		else getent group tss >/dev/null || addgroup --system tss; \
			getent passwd bca >/dev/null || adduser --system --group --home /var/lib/bca \
				--no-create-home --shell /usr/sbin/nologin bca; \
			adduser --quiet bca tss; fi; \
		chown bca:bca /var/lib/bca; \
		if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi; \
		echo "installed, not started: bca init first (docs/install.md)"; \
	fi

## The Debian package target/deb/bca_<version>_amd64.deb, around the static binary.
deb: build
	./scripts/build-deb.sh $(STATIC) target/deb

deps:
	./scripts/install-deps.sh
	./scripts/install-boot-deps.sh

lint:
	cargo fmt --all -- --check
	cargo clippy --locked --all-targets -- -D warnings

clean:
	cargo clean
