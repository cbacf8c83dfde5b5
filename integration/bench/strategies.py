"""The routing strategies the benchmark compares, and how each router is started.

Every strategy gets the same pods (flushed before it), the same inference-perf
config and the same warm-up; only the thing behind `base_url` changes. Flags
are the routers' defaults except those listed here (bind addresses, ports,
worker list, policy, log level, and for kv_aware the event sources); each run
records the exact argv in its raw data.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional

import envoy_bench
from procs import Proc, free_ports, http_get, wait_http_ok

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
VENV_BIN = os.path.dirname(sys.executable)
WASM = os.path.join(REPO, "target", "wasm32-wasip1", "release", "kvroute.wasm")


@dataclass
class Strategy:
    name: str  # id used in file names
    label: str  # row label in the report
    kind: str  # envoy_lb | kvroute | sglang | vllm_router
    params: Dict[str, Any]
    reference_row: Optional[str] = None  # llm-d row it corresponds to (random, load, approximate, precise)
    description: str = ""
    # Run when no strategy is named (`--strategies all` too); the oracle is run only by name.
    by_default: bool = True


STRATEGIES: List[Strategy] = [
    Strategy("envoy-random", "Envoy random", "envoy_lb", {"policy": "random"}, "random",
             "Envoy RANDOM LB, no kvroute"),
    Strategy("envoy-round-robin", "Envoy round robin", "envoy_lb", {"policy": "round_robin"}, None,
             "Envoy ROUND_ROBIN LB, no kvroute"),
    Strategy("envoy-least-request", "Envoy least request", "envoy_lb", {"policy": "least_request"}, None,
             "Envoy LEAST_REQUEST LB (P2C), no kvroute"),
    Strategy("kvroute-load", "kvroute load-only", "kvroute", {"mode": "load"}, "load",
             "kvroute with weights.prefill = 0: cost = in-flight prompt blocks and the running term per pod"),
    Strategy("kvroute-approx", "kvroute approximate", "kvroute", {"mode": "approximate"}, "approximate",
             "kvroute default config: learns block locations from its own decisions"),
    Strategy("kvroute-precise", "kvroute precise", "kvroute", {"mode": "precise"}, "precise",
             "kvroute + kvroute-indexer fed by the pods' KV events"),
    Strategy("sglang-cache-aware", "sglang-router cache_aware", "sglang", {"policy": "cache_aware"}, None,
             "sglang-router launch --policy cache_aware (defaults otherwise)"),
    Strategy("vllm-router-cache-aware", "vllm-router cache_aware", "vllm_router", {"policy": "cache_aware"}, None,
             "vllm-router --policy cache_aware (defaults otherwise)"),
    Strategy("vllm-router-kv-aware", "vllm-router kv_aware", "vllm_router", {"policy": "kv_aware"}, None,
             "vllm-router --policy kv_aware consuming the pods' ZMQ KV events"),
    Strategy("oracle-group-affinity", "group affinity (oracle)", "oracle", {}, None,
             "Envoy + oracle/group_affinity.lua: every prompt of a workload group to one pod, groups dealt "
             "round robin on first sight; knows the workload's groups, which no router can: a ceiling, not a peer",
             by_default=False),
]
BY_NAME = {s.name: s for s in STRATEGIES}


@dataclass
class RouterHandle:
    base_url: str
    base_urls: List[str] = field(default_factory=list)  # the mesh scenario: one router per client, in client order
    argv: List[List[str]] = field(default_factory=list)  # every process started for this strategy
    pids: List[int] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    config_files: Dict[str, str] = field(default_factory=dict)  # name -> text (kept with the raw data)
    stats: Callable[[], Dict[str, Any]] = lambda: {}


def pkg_version(name: str) -> Optional[str]:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def envoy_binary() -> str:
    cand = os.path.join(VENV_BIN, "envoy")
    return cand if os.path.exists(cand) else (shutil.which("envoy") or "envoy")


def envoy_version() -> str:
    try:
        out = subprocess.run([envoy_binary(), "--version"], capture_output=True, text=True, timeout=60).stdout
        m = re.search(r"version: \S+/(\d+\.\d+\.\d+)/", out)
        return m.group(1) if m else (out.strip() or "unknown")
    except Exception as e:
        return f"unknown ({e})"


# ---------------------------------------------------------------- Envoy (shared)

def _import_integration(mod: str):
    sys.path.insert(0, os.path.join(REPO, "integration"))
    try:
        return __import__(mod)
    finally:
        sys.path.pop(0)


def _envoy_stats(ep: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    try:
        out["cpu_seconds"] = ep.cpu_seconds()
    except Exception as e:
        out["cpu_error"] = str(e)
    try:
        out["kvroute"] = ep.stats("kvroute")
    except Exception as e:
        out["stats_error"] = str(e)
    # Envoy's own text stats, histograms included (upstream and downstream timings, kvroute.decision_us).
    try:
        out["envoy_stats_text"] = http_get(ep.admin_url + "/stats", timeout=5)[1]
    except Exception as e:
        out["envoy_stats_text_error"] = str(e)
    return out


def envoy_access_log_name(client: int) -> str:
    """The access log (envoy_bench.ACCESS_LOG_FIELDS) of the Envoy in front of client `client`."""
    return "envoy-access.log" if client == 0 else f"envoy-access-client-{client}.log"


@contextlib.contextmanager
def _plain_envoy(text: str, concurrency: int) -> Iterator[RouterHandle]:
    """An Envoy without kvroute (its own LB, or the oracle's Lua filter) running config `text`."""
    envoyctl = _import_integration("envoyctl")
    with envoyctl.EnvoyProcess(text, concurrency=concurrency) as ep:
        h = RouterHandle(
            base_url=ep.url,
            argv=[[envoy_binary(), "-c", "envoy.yaml", "--concurrency", str(ep.concurrency), "--disable-hot-restart"]],
            pids=[ep.pid],
            config_files={"envoy.yaml": text},
        )
        h.stats = lambda: _envoy_stats(ep)
        yield h


@contextlib.contextmanager
def start_envoy_lb(strategy: Strategy, endpoints: List[str], workdir: str, **_: Any) -> Iterator[RouterHandle]:
    text = envoy_bench.baseline(endpoints, strategy.params["policy"],
                                access_log=os.path.join(workdir, envoy_access_log_name(0)))
    with _plain_envoy(text, strategy.params.get("concurrency", 2)) as h:
        yield h


@contextlib.contextmanager
def start_oracle(strategy: Strategy, endpoints: List[str], workdir: str, **_: Any) -> Iterator[RouterHandle]:
    text = envoy_bench.group_affinity(endpoints, access_log=os.path.join(workdir, envoy_access_log_name(0)))
    # One worker: one Lua state, so one table of groups.
    with _plain_envoy(text, concurrency=1) as h:
        yield h


# ---------------------------------------------------------------- kvroute

# kvroute's shipped wall-clock timers (envoy/gateway-precise.yaml, schema/plugin-config.schema.json defaults),
# and kvroute-indexer's scrape of the pods' load (its --scrape-interval-ms / --scrape-timeout-ms defaults):
# the pods' running counts reach precise mode at that interval.
KVROUTE_TIMERS = {"poll_ms": 100, "ttl_seconds": 600, "flush_ms": 100, "scrape_interval_ms": 1000,
                  "scrape_timeout_ms": 500}
KVROUTE_TIMER_MINIMA = {"poll_ms": 10, "ttl_seconds": 1, "flush_ms": 10, "scrape_interval_ms": 10,
                        "scrape_timeout_ms": 10}


def kvroute_timers(time_scale: float) -> Dict[str, int]:
    """kvroute's timers in wall time for pods running at `time_scale` (wall s per simulated s): the shipped
    values times the scale (within the config's minima), so each keeps its shipped length in simulated time."""
    return {k: max(KVROUTE_TIMER_MINIMA[k], round(v * time_scale)) for k, v in KVROUTE_TIMERS.items()}


# The priority header the overload scenario sends (ipwrap.py) and kvroute reads.
PRIORITY_HEADER = "x-kvroute-priority"


def kvroute_priority() -> Dict[str, Any]:
    """Shedding for the overload scenario: requests without the header are sheddable. Saturation:
    the shipped pod-reported tests (waiting >= 4, KV usage >= 0.95; precise mode), and for
    approximate mode 48 requests in flight per pod instead of the shipped 64: the overload
    calibration ran ~45 per pod at the sustainable rate (profiles.OVERLOAD_SUSTAINABLE_QPS)."""
    return {"header": PRIORITY_HEADER, "default_class": "sheddable",
            "classes": {"critical": "critical", "sheddable": "sheddable"},
            "saturation": {"max_inflight_requests": 48, "max_running": 48}}


def kvroute_plugin_config(mode: str, endpoints: List[str], capacity_blocks: Any, block_size: int,
                          time_scale: float = 1.0, speeds: Optional[List[float]] = None,
                          priority: bool = False) -> Dict[str, Any]:
    """Plugin config per mode, merged over envoy/gateway.yaml (precise: envoy/gateway-precise.yaml).

    Only the pods, their KV capacity (the simulated pods' real one, one for all or one per pod),
    their relative speeds when they differ (each divided by the fastest pod's, as an operator
    would state GPU classes) and the block size are set for every mode; load-only sets
    weights.prefill = 0; the timers are scaled with the pods' clock (kvroute_timers); `priority`
    turns shedding on (kvroute_priority). Everything else is the shipped config."""
    t = kvroute_timers(time_scale)
    caps = capacity_blocks if isinstance(capacity_blocks, list) else [capacity_blocks] * len(endpoints)
    eps: List[Dict[str, Any]] = [{"address": a, "capacity_blocks": c} for a, c in zip(endpoints, caps)]
    if speeds and len(set(speeds)) > 1:
        top = max(speeds)
        for ep, sp in zip(eps, speeds):
            ep["speed"] = sp / top
    cfg: Dict[str, Any] = {
        "block_size": block_size,
        "endpoints": eps,
        "index": {"ttl_seconds": t["ttl_seconds"], "flush_ms": t["flush_ms"]},
    }
    if priority:
        cfg["priority"] = kvroute_priority()
    if mode == "load":
        cfg["weights"] = {"prefill": 0.0, "decode": 1.0}
    elif mode == "approximate":
        pass
    elif mode == "precise":
        cfg["indexer"] = {"poll_ms": t["poll_ms"]}  # else envoy/gateway-precise.yaml's indexer, tokenizer, weights
    else:
        raise ValueError(mode)
    return cfg


def kvroute_missing() -> Optional[str]:
    if not os.path.exists(WASM):
        return f"{os.path.relpath(WASM, REPO)} not built (make build)"
    if not os.path.exists(os.path.join(REPO, "integration", "envoyctl.py")):
        return "integration/envoyctl.py (EnvoyProcess, render_gateway) not present"
    return None


def indexer_binary() -> Optional[str]:
    for p in (os.path.join(REPO, "target", "release", "kvroute-indexer"), shutil.which("kvroute-indexer") or ""):
        if p and os.path.exists(p):
            return p
    return None


@contextlib.contextmanager
def start_indexer(endpoints: List[str], workdir: str, cluster: Any, model: str, block_size: int,
                  require_events: bool = True, time_scale: float = 1.0) -> Iterator[Dict[str, Any]]:
    """kvroute-indexer reading every pod's KV events (through the relay) and scraping their /metrics
    (at its shipped interval in simulated time: kvroute_timers)."""
    sources = kv_event_sources(cluster, endpoints) if cluster is not None else {}
    if not sources and require_events:
        raise RuntimeError("the pods expose no KV-event endpoints")
    (http_port,) = free_ports(1)
    # Learned writes need a bearer token: the indexer reads it from a file, and Envoy (started
    # after, inheriting this environment) hands $KVROUTE_INDEXER_TOKEN to the singleton VM
    # (envoy/gateway-precise.yaml: host_env_keys, indexer.token_env).
    token = os.environ.setdefault("KVROUTE_INDEXER_TOKEN", secrets.token_hex(32))
    token_file = os.path.join(workdir, "indexer.token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as fh:
        fh.write(token + "\n")
    argv = [indexer_binary() or "kvroute-indexer", f"--listen=127.0.0.1:{http_port}", "--zmq-bind", "none",
            f"--model={model}", f"--block-size={block_size}", f"--learned-token-file={token_file}"]
    t = kvroute_timers(time_scale)
    argv += [f"--scrape-interval-ms={t['scrape_interval_ms']}", f"--scrape-timeout-ms={t['scrape_timeout_ms']}"]
    for a in endpoints:
        argv += ["--pod", f"{a}@{model}"]
        if a in sources:
            argv += ["--zmq-connect", f"{sources[a]}={a}@{model}"]
    p = Proc("kvroute-indexer", argv, os.path.join(workdir, "indexer.log"))
    try:
        wait_http_ok(f"http://127.0.0.1:{http_port}/healthz", 60, p)
        yield {"argv": argv, "pid": p.pid, "address": f"127.0.0.1:{http_port}", "proc": p}
    finally:
        p.stop()


@contextlib.contextmanager
def start_kvroute(strategy: Strategy, endpoints: List[str], workdir: str, cluster: Any = None,
                  profile: Any = None, clients: int = 1, **_: Any) -> Iterator[RouterHandle]:
    """kvroute in Envoy; `clients` > 1 (the mesh scenario): that many Envoys, each with its own
    filter state, and in precise mode one kvroute-indexer feeding all of them."""
    envoyctl = _import_integration("envoyctl")
    mode = strategy.params["mode"]
    sim = profile.sim
    notes: List[str] = []
    with contextlib.ExitStack() as stack:
        argv: List[List[str]] = []
        pids: List[int] = []
        plugin = kvroute_plugin_config(mode, endpoints, sim.capacities(), sim.block_size, sim.time_scale,
                                       speeds=sim.speeds(), priority=profile.workload.critical_share > 0)
        if profile.kvroute_overrides:  # run.py --kvroute-set, validated against the config schema there
            plugin = envoyctl._merge(plugin, profile.kvroute_overrides)
            notes.append(f"plugin-config overrides (run.py --kvroute-set): {json.dumps(profile.kvroute_overrides)}")
        if strategy.params.get("plugin"):  # a target's own settings (overhead.py's envoy+kvroute-unrouted)
            plugin = envoyctl._merge(plugin, strategy.params["plugin"])
            notes.append(f"plugin-config settings of this target: {json.dumps(strategy.params['plugin'])}")
        t = kvroute_timers(sim.time_scale)
        notes.append(f"timers in wall time at time scale {sim.time_scale:g} (shipped simulated length): "
                     f"feed poll {t['poll_ms']} ms (100 ms), learned-entry TTL {t['ttl_seconds']} s (600 s), "
                     f"index flush {t['flush_ms']} ms (100 ms), indexer scrape of the pods' load "
                     f"{t['scrape_interval_ms']} ms (1,000 ms)")
        idx = None
        if mode == "precise":
            idx = stack.enter_context(start_indexer(endpoints, workdir, cluster, sim.served_model_name, sim.block_size,
                                                    require_events=strategy.params.get("require_events", True),
                                                    time_scale=sim.time_scale))
            notes.append("token ids: kvroute asks the pods' /tokenize (tokenizer call-out) for requests without them; "
                         "see the kvroute.tokenizer.ok / .failed counters below for how many it got")
        if clients > 1:
            notes.append(f"{clients} Envoys, one per client (sidecars), each with its own kvroute state"
                         + ("; every Envoy's singleton polls the same kvroute-indexer" if idx else "")
                         + f"; {MESH_NOTE}")
        texts, eps = [], []
        for k in range(clients):
            # Rendered one at a time: each render picks free ports, taken once its Envoy is up.
            text = envoy_bench.kvroute(endpoints, plugin, indexer_address=idx["address"] if idx else None,
                                       access_log=os.path.join(workdir, envoy_access_log_name(k)),
                                       wasm=strategy.params.get("wasm"))
            ep = stack.enter_context(envoyctl.EnvoyProcess(text, concurrency=strategy.params.get("concurrency", 2)))
            ep.wait_for_peers()
            texts.append(text)
            eps.append(ep)
            argv.append([envoy_binary(), "-c", "envoy.yaml", "--concurrency", str(ep.concurrency), "--disable-hot-restart"])
            pids.append(ep.pid)
        if idx:
            argv.append(idx["argv"])
            pids.append(idx["pid"])
        h = RouterHandle(
            base_url=eps[0].url,
            base_urls=[ep.url for ep in eps] if clients > 1 else [],
            argv=argv,
            pids=pids,
            notes=notes,
            config_files={"envoy.yaml": texts[0], "plugin.json": json.dumps(envoyctl.plugin_config(texts[0]), indent=2)},
        )

        def stats() -> Dict[str, Any]:
            st = merge_router_stats([_envoy_stats(ep) for ep in eps])
            if idx:
                try:
                    st["indexer_metrics"] = http_get(f"http://{idx['address']}/metrics", timeout=5)[1]
                except Exception as e:
                    st["indexer_metrics_error"] = str(e)
                st["indexer_cpu_seconds"] = idx["proc"].cpu_seconds()
            return st

        h.stats = stats
        yield h


# ---------------------------------------------------------------- peers

def _peer_stats(p: Proc, prom: int) -> Dict[str, Any]:
    st: Dict[str, Any] = {"cpu_seconds": p.cpu_seconds()}
    try:
        st["prometheus"] = http_get(f"http://127.0.0.1:{prom}/metrics", timeout=5)[1]
    except Exception as e:
        st["prometheus_error"] = str(e)
    return st


def _peer_common(port: int, prom: int, endpoints: List[str]) -> List[str]:
    return ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[f"http://{a}" for a in endpoints],
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom)]


@contextlib.contextmanager
def start_sglang(strategy: Strategy, endpoints: List[str], workdir: str, **_: Any) -> Iterator[RouterHandle]:
    port, prom = free_ports(2)
    argv = [os.path.join(VENV_BIN, "sglang-router"), "launch", *_peer_common(port, prom, endpoints),
            "--policy", strategy.params["policy"], "--log-level", "warn"]
    p = Proc(strategy.name, argv, os.path.join(workdir, "router.log"))
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/readiness", 120, p,
                     ok=lambda c, b: c == 200 and f'"healthy_workers":{len(endpoints)}' in b.replace(" ", ""))
        h = RouterHandle(base_url=f"http://127.0.0.1:{port}", argv=[argv], pids=[p.pid])
        h.stats = lambda: _peer_stats(p, prom)
        yield h
    finally:
        p.stop()


@contextlib.contextmanager
def start_vllm_router(strategy: Strategy, endpoints: List[str], workdir: str, cluster: Any = None,
                      profile: Any = None, **_: Any) -> Iterator[RouterHandle]:
    port, prom = free_ports(2)
    argv = [os.path.join(VENV_BIN, "vllm-router"), *_peer_common(port, prom, endpoints),
            "--policy", strategy.params["policy"], "--log-level", "warning"]
    notes: List[str] = []
    if strategy.params["policy"] == "kv_aware":
        sources = kv_event_sources(cluster, endpoints)
        if not sources:
            raise RuntimeError("the pods expose no ZMQ KV-event publisher endpoints for kv_aware")
        for addr, zmq in sources.items():
            argv += ["--kv-event-source", f"http://{addr}={zmq}"]
        argv += ["--kv-event-block-size", str(profile.sim.block_size), "--kv-event-model", profile.sim.served_model_name]
        notes.append("kv_aware subscribes to every pod's KV events (--kv-event-source, through the bench's "
                     "127.0.0.1 relay, integration/bench/kvrelay.py)")
    p = Proc(strategy.name, argv, os.path.join(workdir, "router.log"))
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/readiness", 120, p,
                     ok=lambda c, b: c == 200 and f'"healthy_workers":{len(endpoints)}' in b.replace(" ", ""))
        h = RouterHandle(base_url=f"http://127.0.0.1:{port}", argv=[argv], pids=[p.pid], notes=notes)
        h.stats = lambda: _peer_stats(p, prom)
        yield h
    finally:
        p.stop()


def kv_event_sources(cluster: Any, endpoints: List[str]) -> Dict[str, str]:
    """pod address -> ZMQ endpoint its KV events are published on (bound by the pod)."""
    src = getattr(cluster, "kv_event_endpoints", None)
    if isinstance(src, dict):
        return dict(src)
    if isinstance(src, list) and len(src) == len(endpoints):
        return dict(zip(endpoints, src))
    return {}


STARTERS = {
    "envoy_lb": start_envoy_lb,
    "kvroute": start_kvroute,
    "sglang": start_sglang,
    "vllm_router": start_vllm_router,
    "oracle": start_oracle,
}


def missing_prerequisite(strategy: Strategy, cluster: Any = None) -> Optional[str]:
    """Why this strategy cannot run here (None if it can)."""
    if strategy.kind in ("envoy_lb", "oracle"):
        if not os.path.exists(os.path.join(REPO, "integration", "envoyctl.py")):
            return "integration/envoyctl.py (EnvoyProcess, render_gateway) not present"
        return None
    if strategy.kind == "kvroute":
        m = kvroute_missing()
        if m:
            return m
        if strategy.params["mode"] == "precise":
            if not indexer_binary():
                return "kvroute-indexer binary not built (target/release/kvroute-indexer)"
            if (strategy.params.get("require_events", True) and cluster is not None
                    and not kv_event_sources(cluster, cluster.addresses)):
                return "pods publish no KV events the indexer can subscribe to"
        return None
    if strategy.kind == "sglang":
        return None if pkg_version("sglang-router") else "sglang-router not installed in .venv-bench"
    if strategy.kind == "vllm_router":
        if not pkg_version("vllm-router"):
            return "vllm-router not installed in .venv-bench"
        if strategy.params["policy"] == "kv_aware" and cluster is not None and not kv_event_sources(cluster, cluster.addresses):
            return "pods publish no ZMQ KV events the router can subscribe to"
        return None
    return f"unknown kind {strategy.kind}"


# ---------------------------------------------------------------- mesh (one router per client)

MESH_NOTE = ("the configs differ only in ports (client 0's is kept); counters are summed over the routers, "
             "kvroute's gauges (index size, peers, feed pods) are the largest, Envoy's stats text is client 0's")
# kvroute's gauges (src/metrics.rs): summing them over routers would mean nothing.
KVROUTE_GAUGES = ("kvroute.index.", "kvroute.peers", "kvroute.feed.pods")


def _sum_prometheus(texts: List[str]) -> str:
    """One exposition with every sample summed over the routers (their metric names are the same)."""
    total: Dict[str, float] = {}
    for text in texts:
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, _, val = line.rpartition(" ")
            try:
                total[key] = total.get(key, 0.0) + float(val)
            except ValueError:
                continue
    return "\n".join(f"{k} {v:g}" for k, v in total.items()) + "\n"


def merge_router_stats(stats: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Several routers' stats (one per client) as one router's: CPU and counters summed, kvroute's
    gauges the largest, the first router's Envoy stats text; a single router's stats unchanged."""
    if len(stats) == 1:
        return stats[0]
    out: Dict[str, Any] = {"routers": len(stats)}
    cpu = [st.get("cpu_seconds") for st in stats]
    if all(c is not None for c in cpu):
        out["cpu_seconds"] = sum(cpu)
    if all("kvroute" in st for st in stats):
        merged: Dict[str, Any] = {}
        for st in stats:
            for k, v in st["kvroute"].items():
                if not isinstance(v, (int, float)):
                    continue
                merged[k] = max(merged.get(k, v), v) if any(g in k for g in KVROUTE_GAUGES) else merged.get(k, 0) + v
        out["kvroute"] = merged
    if stats[0].get("envoy_stats_text"):
        out["envoy_stats_text"] = stats[0]["envoy_stats_text"]
    texts = [st["prometheus"] for st in stats if st.get("prometheus")]
    if texts:
        out["prometheus"] = _sum_prometheus(texts)
    errors = {k: v for st in stats for k, v in st.items() if k.endswith("_error")}
    out.update(errors)
    return out


@contextlib.contextmanager
def start_mesh(strategy: Strategy, endpoints: List[str], workdir: str, profile: Any = None,
               **kw: Any) -> Iterator[RouterHandle]:
    """One router per client (profile.load.clients), every one in front of all the pods: kvroute as
    that many Envoys (start_kvroute: precise mode shares one indexer), the others as that many
    instances of their own starter, each in workdir/client-k."""
    n = profile.load.clients
    if strategy.kind == "kvroute":
        with start_kvroute(strategy, endpoints, workdir, profile=profile, clients=n, **kw) as h:
            yield h
        return
    with contextlib.ExitStack() as stack:
        hs = []
        for k in range(n):
            d = os.path.join(workdir, f"client-{k}")
            os.makedirs(d, exist_ok=True)
            hs.append(stack.enter_context(STARTERS[strategy.kind](strategy, endpoints, d, profile=profile, **kw)))
        h = RouterHandle(base_url=hs[0].base_url, base_urls=[x.base_url for x in hs],
                         argv=[a for x in hs for a in x.argv], pids=[p for x in hs for p in x.pids],
                         notes=[f"{n} routers, one per client (sidecars); {MESH_NOTE}"] + hs[0].notes,
                         config_files=hs[0].config_files)
        h.stats = lambda: merge_router_stats([x.stats() for x in hs])
        yield h


def start(strategy: Strategy, endpoints: List[str], workdir: str, **kw: Any):
    profile = kw.get("profile")
    if profile is not None and profile.load.clients > 1:
        return start_mesh(strategy, endpoints, workdir, **kw)
    return STARTERS[strategy.kind](strategy, endpoints, workdir, **kw)


def selected(names: Optional[str]) -> List[Strategy]:
    if not names or names == "all":
        return [s for s in STRATEGIES if s.by_default]
    out = []
    for n in names.split(","):
        n = n.strip()
        if n not in BY_NAME:
            raise SystemExit(f"unknown strategy {n!r}; known: {', '.join(BY_NAME)}")
        out.append(BY_NAME[n])
    return out

