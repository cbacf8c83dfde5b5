"""Phase timers of a kvroute build with phase-timers.diff applied: precise mode, 8 stub pods
(scale.py's), kvroute-indexer without KV events, wrk posting the scale benchmark's 30 KB chat
bodies over 8 connections for 10 s after 3 s of warm-up. Prints each timer's wall time per
request (kvroute.prof.<name>_ns / requests answered).

    .venv/bin/python docs/results/2026-12-05-c8-phases/phases.py PATH/TO/kvroute.wasm CONCURRENCY
"""
import os, sys, time, urllib.request, tempfile
from pathlib import Path
REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "integration"), str(REPO / "integration" / "bench")]
from envoyctl import GATEWAY_PRECISE, EnvoyProcess, render_gateway  # noqa: E402
from indexerctl import IndexerProcess  # noqa: E402
import envoy_meter  # noqa: E402
import scale_fleet  # noqa: E402

wasm = Path(sys.argv[1]); conc = int(sys.argv[2]) if len(sys.argv) > 2 else 8
size = int(sys.argv[3]) if len(sys.argv) > 3 else 30720
fleet = scale_fleet.StubFleet(8).__enter__()
PODS = fleet.addresses
indexer = IndexerProcess(PODS); indexer.start()
bodies = scale_fleet.chat_bodies(size)
bf = tempfile.NamedTemporaryFile("wb", delete=False, suffix=".txt")
bf.write(b"\n".join(bodies) + b"\n"); bf.close()
def stats(envoy):
    with urllib.request.urlopen(envoy.admin_url + "/stats?filter=kvroute.prof") as r:
        out = {}
        for line in r.read().decode().splitlines():
            k, _, v = line.partition(": ")
            out[k.replace("wasmcustom.kvroute.prof.", "")] = int(v)
        return out
try:
    plugin = {"default_capacity_blocks": 19208, "tokenizer": {"timeout_ms": 1000, "memo_bytes": 67108864}}
    text = render_gateway(PODS, plugin, template=GATEWAY_PRECISE, wasm=wasm, indexer=indexer.address)
    with EnvoyProcess(text, concurrency=conc) as envoy:
        time.sleep(3)
        envoy_meter.wrk_load(envoy.listener_port, bf.name, 3, 8)  # warm-up
        a = stats(envoy)
        r = envoy_meter.wrk_load(envoy.listener_port, bf.name, 10, 8)
        b = stats(envoy)
        n = r["ok"]
        print("requests", r)
        rows = []
        for k in b:
            if k.endswith("_ns"):
                name = k[:-3]
                dn = b[k] - a.get(k, 0); dc = b.get(name + "_n", 0) - a.get(name + "_n", 0)
                rows.append((name, dn / 1e3 / max(n, 1), dc / max(n, 1), dn / 1e3 / max(dc, 1)))
        for name, per_req, calls, per_call in sorted(rows, key=lambda x: -x[1]):
            print(f"{name:14s} {per_req:7.2f} us/req  {calls:6.2f} calls/req  {per_call:7.2f} us/call")
finally:
    indexer.stop(); fleet.__exit__(); os.unlink(bf.name)
