"""Helpers for the end-to-end tests: requests through the gateway and reading its decisions."""

import time
import uuid
from contextlib import contextmanager

import pytest
import requests
from envoyctl import WASM, EnvoyProcess, render_gateway

MODEL = "Qwen/Qwen3-32B"
# A worker's load reaches the other workers within about 40 ms, 60 ms through the singleton's sum
# (it publishes within 20 ms of a change, the singleton sums every 20 ms, they read at most every
# 20 ms, plus a tick's jitter): a test that needs every worker to count a request waits this long
# after starting it.
LOAD_BATCH_WAIT_S = 0.1
DECISION = "x-kvroute-decision"
POD = "x-vllm-sim-pod"
# The shipped gateway config names the pod that served a response in this header.
SERVED = "x-gateway-destination-endpoint-served"


def require_wasm() -> None:
    if not WASM.is_file():
        pytest.fail(f"{WASM} is missing: run `make build` (make test does)")


@contextmanager
def gateway(addresses: list[str], plugin: dict | None = None, *, log_level: str = "info",
            concurrency: int = 2):
    """A local Envoy running the shipped gateway config over these pods, its worker VMs registered."""
    require_wasm()
    with EnvoyProcess(render_gateway(addresses, plugin), log_level=log_level,
                      concurrency=concurrency) as proxy:
        proxy.wait_for_peers()
        yield proxy


def unique_system(words: int = 60) -> str:
    """A long system prompt nobody else uses (tests share pods and index)."""
    tag = uuid.uuid4().hex
    return f"[{tag}] " + " ".join(f"rule{i} of {tag}" for i in range(words))


def chat(envoy, system: str, question: str, *, max_tokens: int = 4, headers=None, **extra) -> requests.Response:
    body = {"model": MODEL, "max_tokens": max_tokens,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}], **extra}
    # A fresh connection per request, so requests land on both Envoy workers.
    with requests.Session() as s:
        return s.post(envoy.url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=30)


def decision(response: requests.Response) -> dict:
    """The decision header as a dict: pod, matched, total, domain, inflight_requests."""
    raw = response.headers[DECISION]
    fields = dict(part.split("=", 1) for part in raw.split("; ") if "=" in part)
    matched, rest = fields["matched"].split("/")
    total, domain = rest.split(" ")
    return {"raw": raw, "pod": fields["pod"], "matched": int(matched), "total": int(total), "domain": domain,
            "inflight_requests": int(fields["inflight"].split(" ")[0])}


def wait_for(what: str, condition, timeout: float = 15.0) -> None:
    """Polls `condition` every 50 ms until it holds; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
