"""`make run`: four simulated vLLM pods behind Envoy with kvroute, on 127.0.0.1, ready for curl.

Starts `vllm-sim --pods 4` on ports 8001-8004 and Envoy with envoy/gateway.yaml (listener 10000,
admin 9901), prints what to try, and runs until Ctrl-C (or --seconds), then stops all by PID.
`--precise` (`make run-precise`): the pods publish KV events to kvroute-indexer (HTTP 8090,
ZMQ 5557, both on 127.0.0.1) and Envoy runs envoy/gateway-precise.yaml (singleton + /tokenize
call-out). Learned writes take a token made for this run (indexerctl: the indexer's
--learned-token-file, and $KVROUTE_INDEXER_TOKEN for Envoy's singleton).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from envoyctl import GATEWAY, GATEWAY_PRECISE, REPO, EnvoyProcess  # noqa: E402
from indexerctl import IndexerProcess  # noqa: E402
from simcluster import sim_binary  # noqa: E402

PODS = [8001, 8002, 8003, 8004]
MODEL = "Qwen/Qwen3-32B"
INDEXER_HTTP = 8090
INDEXER_ZMQ = 5557

TRY = f"""
kvroute is up: Envoy on http://127.0.0.1:10000 (admin :9901) in front of 4 simulated vLLM pods ({PODS[0]}-{PODS[-1]}).

Send the same long system prompt twice and watch both land on one pod:
  curl -s -D- http://127.0.0.1:10000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{{"model":"{MODEL}","max_tokens":16,"messages":[{{"role":"system","content":"'"$(printf 'You are a terse assistant. %.0s' $(seq 60))"'"}},{{"role":"user","content":"Hi"}}]}}' \\
    | grep -iE 'x-kvroute-decision|x-vllm-sim-pod'

Stats:  curl -s http://127.0.0.1:9901/stats | grep kvroute
Stop:   Ctrl-C (stops Envoy and the pods)
"""


def wait_healthy(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"pod on port {port} not healthy after {timeout}s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=0, help="stop after this long (0: until Ctrl-C)")
    parser.add_argument("--precise", action="store_true", help="KV events -> kvroute-indexer -> precise routing")
    args = parser.parse_args()
    sim_argv = [str(sim_binary()), "--host", "127.0.0.1", "--port", str(PODS[0]), "--pods", str(len(PODS)),
                "--model", MODEL]
    indexer = None
    if args.precise:
        indexer = IndexerProcess([f"127.0.0.1:{p}" for p in PODS])
        indexer.http_port, indexer.zmq_port = INDEXER_HTTP, INDEXER_ZMQ
        indexer.start()
        sim_argv += ["--kv-events-endpoint", indexer.zmq_endpoint]
    sims = subprocess.Popen(sim_argv, cwd=REPO, stdin=subprocess.DEVNULL, start_new_session=True)
    stop = {"now": False}

    def on_signal(_signum, _frame):
        stop["now"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for port in PODS:
            wait_healthy(port)
        with EnvoyProcess((GATEWAY_PRECISE if args.precise else GATEWAY).read_text()) as envoy:
            print(TRY, flush=True)
            if indexer:
                print(f"Precise mode: kvroute-indexer on http://{indexer.address} (/metrics, /v1/debug/pods), "
                      f"KV events on {indexer.zmq_endpoint}; POST /v1/learned takes the token in "
                      f"{indexer.token_path}.\n", flush=True)
            started = time.monotonic()
            while not stop["now"] and (args.seconds <= 0 or time.monotonic() - started < args.seconds):
                if envoy.proc.poll() is not None or sims.poll() is not None:
                    print("a process exited unexpectedly", file=sys.stderr)
                    print(envoy.log_tail(), file=sys.stderr)
                    return 1
                time.sleep(0.2)
    finally:
        if indexer:
            indexer.stop()
        if sims.poll() is None:
            os.kill(sims.pid, signal.SIGTERM)
            try:
                sims.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(sims.pid, signal.SIGKILL)
    print("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
