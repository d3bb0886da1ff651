#!/usr/bin/env bash
# Installs what bca's build and tests need on a fresh Debian bookworm machine (idempotent).
set -euo pipefail
need=()
command -v openssl >/dev/null || need+=(openssl)
command -v musl-gcc >/dev/null || need+=(musl-tools)
command -v file >/dev/null || need+=(file)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v sqlite3 >/dev/null || need+=(sqlite3)
command -v curl >/dev/null || need+=(curl)
command -v cpio >/dev/null || need+=(cpio)
command -v systemd-analyze >/dev/null || need+=(systemd)   # verifies the packaged unit
command -v sslscan >/dev/null || need+=(sslscan)           # scans the gateway's TLS
command -v dpkg-deb >/dev/null || need+=(dpkg)
command -v swtpm >/dev/null || need+=(swtpm)               # a TPM for the TPM tests
command -v swtpm_setup >/dev/null || need+=(swtpm-tools)   # its EK certificates
command -v tpm2_createek >/dev/null || need+=(tpm2-tools)  # the reference bca is checked against
dpkg -s libssl-dev >/dev/null 2>&1 || need+=(libssl-dev)   # josekit, the JWE oracle in tests
# PostgreSQL 15 for the store's second engine: the tests start throwaway clusters themselves
# (initdb, on a Unix socket); the package must not make and start a cluster of its own.
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
command -v psql >/dev/null || need+=(postgresql-client)
if [ ${#need[@]} -gt 0 ]; then
  echo "installing: ${need[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  if [[ " ${need[*]} " == *" postgresql "* ]]; then
    $SUDO mkdir -p /etc/postgresql-common/createcluster.d
    echo "create_main_cluster = false" | $SUDO tee /etc/postgresql-common/createcluster.d/bca-tests.conf >/dev/null
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
rustup target list --installed 2>/dev/null | grep -q x86_64-unknown-linux-musl \
  || rustup target add x86_64-unknown-linux-musl
# Fuzzing (make fuzz, and make test's bounded run): cargo-fuzz from crates.io, the nightly toolchain.
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
rustup toolchain list | grep -q '^nightly' \
  || rustup toolchain install nightly --profile minimal \
  || echo "no nightly toolchain: make fuzz will not run" >&2
# pyca/cryptography, the strict DER parser the certificate tests check bca against (pinned).
PYCA=target/pyca
[ -x "$PYCA/bin/python" ] && "$PYCA/bin/python" -c 'import cryptography, sys; sys.exit(cryptography.__version__ != "51.0.1")' 2>/dev/null \
  || { python3 -m venv "$PYCA" && "$PYCA/bin/pip" install -q --disable-pip-version-check cryptography==51.0.1; }
