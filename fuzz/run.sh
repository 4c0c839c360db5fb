#!/usr/bin/env bash
# Runs each fuzz target for SECONDS (default 30) with a corpus seeded from fixtures/cultnet.
# Needs cargo-fuzz (`cargo install cargo-fuzz --locked`); on the stable toolchain it runs
# with RUSTC_BOOTSTRAP=1 (see ../shared/facts/toolchain.md). Longer by hand: SECONDS=600.
set -euo pipefail
cd "$(dirname "$0")"
secs="${FUZZ_SECONDS:-30}"
for target in decode hub; do
  mkdir -p "corpus/$target"
  for f in ../fixtures/cultnet/*.bin ../fixtures/cultnet/*.msgpack ../fixtures/cultnet/*.stream-frame; do
    if [ "$target" = hub ]; then
      # Frame each vector as one datagram: 2-byte length, 1-byte time step.
      python3 -c 'import sys; d=open(sys.argv[1],"rb").read(); sys.stdout.buffer.write(len(d).to_bytes(2,"big")+b"\x01"+d)' "$f" > "corpus/$target/$(basename "$f")"
    else
      cp "$f" "corpus/$target/"
    fi
  done
  echo "fuzz: $target for ${secs}s"
  RUSTC_BOOTSTRAP=1 cargo fuzz run "$target" "corpus/$target" -- -max_total_time="$secs" -rss_limit_mb=2048 2>&1 | tail -n 5
done
