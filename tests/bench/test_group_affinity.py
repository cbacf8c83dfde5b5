"""The group-affinity oracle (integration/bench/oracle/group_affinity.lua) in a real Envoy: every
prompt of a group reaches one backend, groups are dealt to the backends round robin in the order
first seen, and a request without a prompt still reaches a backend (Envoy's fallback LB)."""

import json
import os
import pathlib
import sys
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "integration"))
sys.path.insert(0, str(REPO / "integration" / "bench"))

import envoy_bench  # noqa: E402
import envoyctl  # noqa: E402


def have_envoy() -> bool:
    try:
        return os.path.exists(envoyctl.envoy_binary())
    except FileNotFoundError:
        return False


pytestmark = pytest.mark.skipif(not have_envoy(), reason="needs Envoy (make venv)")


class Backend:
    """An HTTP server on 127.0.0.1 that answers 200 and keeps the prompts it was sent."""

    def __init__(self):
        prompts = self.prompts = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                prompts.append(json.loads(body).get("prompt"))
                self.send_response(200)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def post(url: str, body: dict) -> int:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status


def test_each_group_goes_to_one_backend_dealt_round_robin():
    backends = [Backend(), Backend()]
    try:
        config = envoy_bench.group_affinity([b.address for b in backends])
        # Three groups, each a ~470-byte shared prefix (longer than the 200 bytes the oracle keys on), four questions each.
        prefix = {g: f"group {g} " + " ".join(f"w{(g * 7 + i) % 101}" for i in range(120)) for g in range(3)}
        order = [0, 1, 0, 2, 1, 2, 0, 1, 2, 0, 1, 2]
        with envoyctl.EnvoyProcess(config, concurrency=1) as envoy:
            for n, g in enumerate(order):
                assert post(envoy.url, {"model": "m", "prompt": f"{prefix[g]} question {n}?"}) == 200
            assert post(envoy.url, {"model": "m", "messages_missing": True}) == 200
        served = [[p for p in b.prompts if p] for b in backends]
        groups = [{g for g in prefix if any(p.startswith(prefix[g]) for p in s)} for s in served]
        # First seen: group 0, then 1, then 2 -> backends 0, 1, 0.
        assert groups == [{0, 2}, {1}], served
        assert sum(len(s) for s in served) == len(order)
        assert sum(len(b.prompts) for b in backends) == len(order) + 1
    finally:
        for b in backends:
            b.close()


def test_the_oracle_config_validates():
    config = envoy_bench.group_affinity(["127.0.0.1:8001", "127.0.0.1:8002"])
    res = envoyctl.validate(config)
    assert res.returncode == 0, res.stdout + res.stderr
