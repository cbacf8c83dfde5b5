"""Loading kvroute.wasm as the guide documents (docs/operator-guide.md, section 6 and 9):
`http(s)://` with sha256 through an Envoy cluster, what a wrong digest does under each failure
policy, and a missing local file. Real Envoy, simulated pods, free ports on 127.0.0.1."""

import hashlib
import http.server
import threading
import time

import pytest
import requests
import yaml

import meshlib
from envoyctl import EnvoyProcess, free_port, validate
from simcluster import SimCluster

MODEL = "Qwen/Qwen3-32B"


@pytest.fixture(scope="module")
def module_bytes():
    meshlib.require_module()
    return meshlib.WASM_PATH.read_bytes()


@pytest.fixture(scope="module")
def origin(module_bytes):
    """An HTTP server that serves the module and counts the downloads."""
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            if self.path != "/kvroute.wasm":
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("content-type", "application/wasm")
            self.send_header("content-length", str(len(module_bytes)))
            self.end_headers()
            self.wfile.write(module_bytes)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1], hits
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def sims():
    with SimCluster(pods=2, time_scale=0.2) as cluster:
        yield cluster


def config(sims, *, code, failure_policy="FAIL_OPEN", origin_port=None, singleton_code=None):
    """envoy/mesh-gateway.yaml with free ports, these pods, and this code source for the filter
    (and for the singleton when given)."""
    (cfg,) = meshlib.load_yaml_docs(meshlib.ENVOY_DIR / "mesh-gateway.yaml")
    cfg["admin"]["address"]["socket_address"]["port_value"] = free_port()
    (listener,) = cfg["static_resources"]["listeners"]
    listener["address"]["socket_address"]["port_value"] = free_port()
    vllm = cfg["static_resources"]["clusters"][0]
    vllm["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": int(a.rsplit(":", 1)[1])}}}}
        for a in sims.addresses]}]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (wasm,) = [f for f in hcm["http_filters"] if f["name"] == "kvroute"]
    wasm["typed_config"]["config"]["vm_config"]["code"] = code
    wasm["typed_config"]["config"]["failure_policy"] = failure_policy
    if singleton_code:
        (svc,) = cfg["bootstrap_extensions"]
        svc["typed_config"]["config"]["vm_config"]["code"] = singleton_code
    if origin_port:
        cfg["static_resources"]["clusters"].append({
            "name": "wasm_origin", "type": "STATIC", "connect_timeout": "1s",
            "load_assignment": {"cluster_name": "wasm_origin", "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": origin_port}}}}]}]}})
    text = yaml.safe_dump(cfg, sort_keys=False)
    return text.replace("target/wasm32-wasip1/release/kvroute.wasm", str(meshlib.WASM_PATH))


def remote(port, sha256):
    return {"remote": {"http_uri": {"uri": f"http://127.0.0.1:{port}/kvroute.wasm", "cluster": "wasm_origin",
                                    "timeout": "10s"},
                       "sha256": sha256, "retry_policy": {"num_retries": 3}}}


def feed_errors(envoy):
    return envoy.stats("kvroute.feed").get("wasmcustom.kvroute.feed.errors", 0)


def post(envoy):
    with requests.Session() as s:
        return s.post(envoy.url + "/v1/completions", json={"model": MODEL, "prompt": "hello there", "max_tokens": 1},
                      timeout=30)


def test_http_module_with_sha256_runs_filter_and_singleton(sims, origin, module_bytes):
    port, hits = origin
    sha = hashlib.sha256(module_bytes).hexdigest()
    n = len(hits)
    text = config(sims, code=remote(port, sha), origin_port=port, singleton_code=remote(port, sha))
    assert str(meshlib.WASM_PATH) not in text, "no local module left: both come over HTTP"
    with EnvoyProcess(text) as envoy:
        assert hits[n:] and all(h == "/kvroute.wasm" for h in hits[n:]), "Envoy fetched the module"
        r = post(envoy)
        assert r.status_code == 200
        assert "x-vllm-sim-pod" in r.headers
        assert envoy.settled_stats("kvroute").get("wasmcustom.kvroute.requests") == 1, "the filter ran"
        # no indexer and no static endpoints: no pod is known, the request failed open
        assert envoy.stats("kvroute").get("wasmcustom.kvroute.fallback.no_endpoints") == 1
        assert r.headers["x-kvroute-decision"] == "fallback=no_endpoints"
        # the singleton runs too: it polls the (absent) indexer and counts the failures
        deadline = time.monotonic() + 10
        while feed_errors(envoy) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert feed_errors(envoy) > 0, "the singleton polled the indexer"


@pytest.mark.parametrize("policy,served", [("FAIL_OPEN", True), ("FAIL_CLOSED", False)])
def test_wrong_sha256_refuses_the_module(sims, origin, policy, served):
    """A digest mismatch never runs the downloaded code. FAIL_OPEN (shipped) serves the request
    without kvroute; FAIL_CLOSED answers 503."""
    port, _ = origin
    with EnvoyProcess(config(sims, code=remote(port, "f" * 64), failure_policy=policy, origin_port=port)) as envoy:
        r = post(envoy)
        assert "wasmcustom.kvroute.requests" not in envoy.stats("kvroute")
        if served:
            assert r.status_code == 200 and "x-vllm-sim-pod" in r.headers
            assert "x-kvroute-decision" not in r.headers
        else:
            assert r.status_code == 503 and "x-vllm-sim-pod" not in r.headers


def test_missing_local_module_rejects_the_config(sims):
    res = validate(config(sims, code={"local": {"filename": "/nonexistent/kvroute/plugin.wasm"}}))
    assert res.returncode != 0
    assert "/nonexistent/kvroute/plugin.wasm" in res.stdout + res.stderr
