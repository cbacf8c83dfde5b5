"""Envoy's CPU with no traffic, without and with kvroute (the shipped approximate gateway, one
unreachable pod): what the filter's VMs and the singleton cost per second of their own.

    .venv-bench/bin/python docs/results/2026-12-04-overhead-unrouted/idle_cpu.py [CONCURRENCY ...]
"""

import os
import sys
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[:0] = [os.path.join(REPO, "integration"), os.path.join(REPO, "integration", "bench")]

import envoyctl  # noqa: E402
from procs import tree_cpu_seconds  # noqa: E402

SETTLE_S, MEASURE_S = 5, 20

for concurrency in [int(c) for c in sys.argv[1:]] or [8]:
    for with_kvroute in (False, True):
        text = envoyctl.render_gateway(["127.0.0.1:1"], {}, kvroute=with_kvroute)
        with envoyctl.EnvoyProcess(text, concurrency=concurrency) as envoy:
            time.sleep(SETTLE_S)
            before = tree_cpu_seconds(envoy.pid)
            time.sleep(MEASURE_S)
            used = tree_cpu_seconds(envoy.pid) - before
        name = "Envoy + kvroute" if with_kvroute else "Envoy"
        print(f"--concurrency {concurrency}: {name}: {1000 * used / MEASURE_S:.1f} ms of CPU per second, idle")
