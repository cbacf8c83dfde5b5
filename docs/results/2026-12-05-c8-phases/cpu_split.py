"""Envoy's user and system CPU, context switches and minor faults per request, plain Envoy against
kvroute (precise), alternating twice: 8 stub pods, kvroute-indexer without KV events, wrk posting
the scale benchmark's 30 KB bodies for 8 s after 2 s of warm-up. BATCH=1 sets every Envoy thread
to SCHED_BATCH before the load.

    .venv/bin/python docs/results/2026-12-05-c8-phases/cpu_split.py PATH/TO/kvroute.wasm CONCURRENCY [CONNECTIONS]
"""
import os, sys, time, tempfile, subprocess
from pathlib import Path
REPO = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(REPO / "integration"), str(REPO / "integration" / "bench")]
from envoyctl import GATEWAY_PRECISE, EnvoyProcess, render_gateway  # noqa: E402
from indexerctl import IndexerProcess  # noqa: E402
import envoy_meter  # noqa: E402
import scale_fleet  # noqa: E402

wasm = Path(sys.argv[1]); conc = int(sys.argv[2]); pods = 8; conns = int(sys.argv[3]) if len(sys.argv) > 3 else 8
TCK = os.sysconf("SC_CLK_TCK")
def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    ut, st = int(f[11]) / TCK, int(f[12]) / TCK
    flt = int(f[7])
    vol = invol = 0
    for t in os.listdir(f"/proc/{pid}/task"):
        for line in open(f"/proc/{pid}/task/{t}/status"):
            if line.startswith("voluntary_ctxt_switches"): vol += int(line.split()[1])
            if line.startswith("nonvoluntary_ctxt_switches"): invol += int(line.split()[1])
    return ut, st, vol, invol, flt
fleet = scale_fleet.StubFleet(pods).__enter__()
indexer = IndexerProcess(fleet.addresses); indexer.start()
bodies = scale_fleet.chat_bodies(30720)
bf = tempfile.NamedTemporaryFile("wb", delete=False, suffix=".txt"); bf.write(b"\n".join(bodies) + b"\n"); bf.close()
try:
    plugin = {"default_capacity_blocks": 19208, "tokenizer": {"timeout_ms": 1000, "memo_bytes": 67108864}}
    configs = {"plain": render_gateway(fleet.addresses, kvroute=False),
               "kvroute": render_gateway(fleet.addresses, plugin, template=GATEWAY_PRECISE, wasm=wasm, indexer=indexer.address)}
    for rnd in range(2):
        for name, text in configs.items():
            with EnvoyProcess(text, concurrency=conc) as envoy:
                time.sleep(2)
                if os.environ.get("BATCH"):
                    subprocess.run(["chrt", "-b", "-a", "-p", "0", str(envoy.proc.pid)], check=True)
                envoy_meter.wrk_load(envoy.listener_port, bf.name, 2, conns)
                a = cpu(envoy.proc.pid)
                r = envoy_meter.wrk_load(envoy.listener_port, bf.name, 8, conns)
                b = cpu(envoy.proc.pid)
                n = r["ok"]
                print(f"{name:8s} n={n} user {1e6*(b[0]-a[0])/n:6.1f} sys {1e6*(b[1]-a[1])/n:6.1f} us/req  vol-cs {(b[2]-a[2])/n:5.2f} invol-cs {(b[3]-a[3])/n:5.2f} minflt {(b[4]-a[4])/n:6.2f} /req", flush=True)
finally:
    indexer.stop(); fleet.__exit__(); os.unlink(bf.name)
