#!/bin/bash
# One reading of a build at 1,000 pods, precise mode, --concurrency 8: scale.py's CPU readings
# (10,000 requests each) and then 25 s idle, with every Envoy thread's CPU sampled each second
# (thread_cpu_sampler.sh of docs/results/2026-12-04-feed-forward).
# Usage, from the repository's top: idle_ab.sh NAME BUILD.wasm OUT_DIR
# The build is copied over target/wasm32-wasip1/release/kvroute.wasm (what scale.py loads).
set -u
name=$1 wasm=$2 out=$3
mkdir -p "$out"
cp "$wasm" target/wasm32-wasip1/release/kvroute.wasm
bash docs/results/2026-12-04-feed-forward/thread_cpu_sampler.sh "$out/$name.threads" &
sampler=$!
.venv/bin/python integration/bench/scale.py --pods 1000 --approximate-only-pods= --precise-only \
    --concurrency 8 --cpu-requests 10000 --token-memo-bytes 67108864 --settle-seconds 25 \
    --results-dir "$out/$name" > "$out/$name.log" 2>&1
kill "$sampler"
