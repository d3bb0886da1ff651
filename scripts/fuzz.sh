#!/usr/bin/env bash
# `make fuzz`: every fuzz target of fuzz/ (cargo-fuzz, libFuzzer) for FUZZ_SECONDS each (default
# 30), starting from its committed corpus (fuzz/corpus/<target>.cpio, a newc archive: one file in
# git instead of thousands). Prints one line per target: the runs and what was found. The corpus
# is minimised (cmin) and packed back; a crash is copied into fuzz/regressions/<target>/, which
# the normal test suite replays, and fails the run. Needs the nightly toolchain and cargo-fuzz
# (scripts/install-deps.sh installs cargo-fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${FUZZ_SECONDS:-30}
targets=$(sed -n 's/^name = "\([a-z]*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^bca-fuzz$')
cargo +nightly fuzz build -O >/dev/null 2>&1 || cargo +nightly fuzz build -O
failed=0
for t in $targets; do
  work="fuzz/work/$t"
  rm -rf "$work"; mkdir -p "$work" "fuzz/regressions/$t"
  if [ -f "fuzz/corpus/$t.cpio" ]; then
    (cd "$work" && cpio -idm --quiet < "../../corpus/$t.cpio")
  fi
  before=$(ls "$work" | wc -l)
  log=$(mktemp)
  if cargo +nightly fuzz run -O "$t" "$work" -- -max_total_time="$secs" -max_len=8192 >"$log" 2>&1; then
    runs=$(sed -n 's/^Done \([0-9]*\) runs.*/\1/p' "$log" | tail -1)
    cargo +nightly fuzz cmin -O "$t" "$work" >/dev/null 2>&1 || true
    (cd "$work" && ls | cpio -o -H newc --quiet) > "fuzz/corpus/$t.cpio"
    echo "fuzz_$t: ${runs:-?} runs in ${secs} s, no crash (corpus $before -> $(ls "$work" | wc -l) inputs)"
  else
    failed=1
    echo "fuzz_$t: CRASH"
    grep -E "panicked|ERROR|SUMMARY" "$log" | head -5 || true
    for f in fuzz/artifacts/"$t"/*; do
      [ -e "$f" ] && cp "$f" "fuzz/regressions/$t/" && echo "  kept $f in fuzz/regressions/$t/"
    done
  fi
  rm -f "$log"
done
exit $failed
