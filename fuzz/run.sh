#!/usr/bin/env bash
# Runs each fuzz target for SECONDS (default 30) with a corpus seeded from fixtures/cultnet.
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`); on the stable toolchain it runs
# with RUSTC_BOOTSTRAP=1 (see ../shared/facts/toolchain.md). Longer by hand: SECONDS=600.
set -euo pipefail
cd "$(dirname "$0")"
secs="${FUZZ_SECONDS:-30}"
for target in decode hub frames; do
  mkdir -p "corpus/$target"
  for f in ../fixtures/cultnet/*.bin ../fixtures/cultnet/*.msgpack ../fixtures/cultnet/*.stream-frame; do
    if [ "$target" = frames ]; then
      # One piece: a length byte, then the vector's bytes.
      python3 -c 'import sys; d=open(sys.argv[1],"rb").read()[:255]; sys.stdout.buffer.write(bytes([len(d)])+d)' "$f" > "corpus/$target/$(basename "$f")"
    elif [ "$target" = hub ]; then
      # Frame each vector as one datagram: 2-byte length, 1-byte time step.
      python3 -c 'import sys; d=open(sys.argv[1],"rb").read(); sys.stdout.buffer.write(len(d).to_bytes(2,"big")+b"\x01"+d)' "$f" > "corpus/$target/$(basename "$f")"
    else
      cp "$f" "corpus/$target/"
    fi
  done
  echo "fuzz: $target for ${secs}s"
  RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" "corpus/$target" -- -max_total_time="$secs" -rss_limit_mb=2048 2>&1 | tail -n 5
done

# The service target builds the whole gateway, so it lives in its own crate (fuzz/service) and
# runs without a sanitizer (safe Rust; a sanitizer build of matrix-sdk costs many minutes).
# libFuzzer ends the run with exit(), so the target's state directory outlives it: give the run
# a temp directory of its own and remove that afterwards.
mkdir -p service/corpus/service
scratch=$(mktemp -d "${TMPDIR:-/tmp}/fuzz-service.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
echo "fuzz: service for ${secs}s"
(cd service && TMPDIR="$scratch" RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir . -s none service corpus/service -- -max_total_time="$secs" -rss_limit_mb=2048 2>&1 | tail -n 5)
