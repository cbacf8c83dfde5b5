#!/usr/bin/env python3
"""kvroute benchmark: every routing strategy against the same simulated cluster, in one run.

    .venv-bench/bin/python integration/bench/run.py --profile quick        # make bench
    .venv-bench/bin/python integration/bench/run.py --profile full         # make bench-full
    .venv-bench/bin/python integration/bench/run.py --resume build/bench/<run>   # continue a stopped run

For each strategy, in a fixed order: wait until the pods are idle, flush them
(POST /admin/flush: prefix cache dropped, counters reset), start the router,
run inference-perf (warm-up stage + measured stages, same config and seeds for
everyone), sample the pods' /metrics every second, stop the router. A strategy
that cannot start or whose load run fails is recorded as failed with its
reason; nothing is dropped. Then report.py writes report.md and plot.png.

Output: build/bench/<UTC time>-<profile>/ (or --out): raw inference-perf
reports, pod samples, router logs and configs per strategy, results.json,
report.md, plot.png. results.json is rewritten after each strategy, so a run
stopped between strategies (or during one: SIGTERM/SIGHUP unwind cleanly) is
continued with --resume in another session (meta.sessions says which ran where).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gzip
import hashlib
import io
import json
import os
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchlog import logger  # noqa: E402
import envoy_timing  # noqa: E402
import placement  # noqa: E402
import podmetrics  # noqa: E402
import profiles  # noqa: E402
import strategies  # noqa: E402
from measurements import parse_ip_reports, parse_mesh_reports, pod_summary, router_stats  # noqa: E402
from pod_restart import PodRestart, restart_windows  # noqa: E402
from procs import Proc, http_post  # noqa: E402
from provenance import artifacts, git_rev, machine_info, sha256_prefix, versions  # noqa: E402

REPO = strategies.REPO
TOKENIZER_REL = os.path.join("litellm", "litellm_core_utils", "tokenizers", "deepseek_tokenizer.json")


log = logger("bench")


# ------------------------------------------------------------------ environment

def prepare_tokenizer(out: str) -> str:
    """Directory with the offline tokenizer shipped in the litellm wheel (no hub access)."""
    import importlib.util

    # Locate the wheel without importing litellm (its import reaches for the network).
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("litellm is not installed in this environment (make bench-venv)")
    site = os.path.dirname(list(spec.submodule_search_locations)[0])
    src = os.path.join(site, TOKENIZER_REL)
    if not os.path.exists(src):
        raise SystemExit(f"offline tokenizer not found at {src}")
    d = os.path.join(out, "tokenizer")
    os.makedirs(d, exist_ok=True)
    shutil.copyfile(src, os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1 << 20}, fh)
    return d


# ------------------------------------------------------------------ pods

@contextlib.contextmanager
def pods(profile: profiles.Profile, out: str, tokenizer_dir: str, external: Optional[List[str]]):
    """The cluster: vllm-sim pods via integration/simcluster.py (+ the KV-event relay), or --endpoints."""
    if external:
        if profile.sim.restart_pod >= 0:
            raise SystemExit("a pod restart (sim.restart_pod) needs the simulated pods: not with --endpoints")
        yield type("External", (), {"addresses": external, "kv_event_endpoints": None, "info": {"external": True},
                                    "argv": None, "version": None})()
        return
    import kvrelay

    simcluster = strategies._import_integration("simcluster")
    s = profile.sim
    ipc = kvrelay.make_ipc_base(out)
    # An earlier session's pods (run.py --resume) leave their socket files: vllm-sim will not bind over them.
    for ep in kvrelay.ipc_endpoints(ipc, s.pods):
        with contextlib.suppress(FileNotFoundError):
            os.remove(ep[len("ipc://"):])
    kw = dict(
        model=s.model,
        served_model_name=s.served_model_name,
        block_size=s.block_size,
        num_gpu_blocks=s.capacities() if s.pod_blocks else s.num_gpu_blocks,
        speed=s.speeds() if s.pod_speeds else None,
        max_num_seqs=s.max_num_seqs,
        max_num_batched_tokens=s.max_num_batched_tokens,
        max_model_len=s.max_model_len,
        tokenizer=os.path.join(tokenizer_dir, "tokenizer.json"),
        kv_events_endpoint=ipc,
        time_scale=s.time_scale,
    )
    for extra in s.extra_args:
        k, _, v = extra.partition("=")
        kw[k.lstrip("-").replace("-", "_")] = v
    # A pod that restarts mid-run needs its own process; otherwise all pods share one (as in every other profile).
    cluster = simcluster.PodFleet if s.restart_pod >= 0 else simcluster.SimCluster
    with cluster(pods=s.pods, startup_timeout=120.0, **kw) as c:
        c.argv = c._argv()
        binary = c.argv[0] if isinstance(c.argv[0], str) else c.argv[0][0]
        try:
            c.version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            c.version = None
        from procs import free_ports

        with kvrelay.Relay(kvrelay.ipc_endpoints(ipc, s.pods), free_ports(s.pods)) as relay:
            c.relay = relay
            c.kv_event_endpoints = dict(zip(c.addresses, relay.endpoints))
            time.sleep(0.5)  # let the relay's subscriptions reach the pods before any request
            try:
                yield c
            finally:
                with contextlib.suppress(OSError), open(os.path.join(out, "vllm-sim.log"), "w") as fh:
                    fh.write(c.log_text())


def machine_cpu() -> tuple[float, float, float]:
    """(busy, stolen, total) jiffies of all CPUs from /proc/stat. Busy includes stolen: time the
    hypervisor gave to other guests, which this machine's processes waited through."""
    with open("/proc/stat") as fh:
        vals = [float(x) for x in fh.readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    stolen = vals[7] if len(vals) > 7 else 0.0
    return sum(vals) - idle, stolen, sum(vals)


def children_cpu_seconds() -> float:
    """User + system CPU of this process's finished children (and their finished children)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def wait_pods_idle(addresses: List[str], timeout: float = 300.0) -> Dict[str, Any]:
    """Bounded wait until no pod runs or queues a request (leftovers of the previous strategy)."""
    t0 = time.monotonic()
    last: Dict[str, Any] = {}
    while time.monotonic() - t0 < timeout:
        busy = 0.0
        try:
            for a in addresses:
                m = podmetrics.scrape(a)
                busy += m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0)
            last = {"busy": busy}
            if busy == 0:
                return {"idle_after_s": round(time.monotonic() - t0, 1)}
        except Exception as e:
            last = {"error": str(e)}
        time.sleep(1.0)
    return {"idle_after_s": None, "timeout": timeout, "last": last}


def flush_pods(addresses: List[str]) -> Dict[str, Any]:
    res = {}
    for a in addresses:
        try:
            code, body = http_post(f"http://{a}/admin/flush", b"", timeout=10)
            res[a] = code
        except Exception as e:
            res[a] = f"error: {e}"
    return res


# ------------------------------------------------------------------ inference-perf

def data_config(profile: profiles.Profile) -> Dict[str, Any]:
    """inference-perf's `data` section: shared_prefix, or conversation_replay for a profile with conversations."""
    conv = profile.conversation
    if conv:
        def fixed(n: int) -> Dict[str, Any]:
            return {"type": "fixed", "mean": n, "min": n, "max": n}

        return {"type": "conversation_replay", "conversation_replay": {
            "seed": conv.seed,
            "num_conversations": conv.conversations,
            "shared_system_prompt_len": conv.shared_system_prompt_len,
            "dynamic_system_prompt_len": fixed(conv.system_prompt_len),
            "turns_per_conversation": fixed(conv.turns),
            "input_tokens_per_turn": fixed(conv.user_len),
            "output_tokens_per_turn": fixed(conv.output_len),
            # The pods' limit: conversations stay far below it, so inference-perf never truncates one.
            "max_model_len": profile.sim.max_model_len,
        }}
    w = profile.workload
    return {
        "type": "shared_prefix",
        "shared_prefix": {
            "num_groups": w.groups,
            "num_prompts_per_group": w.prompts_per_group,
            "system_prompt_len": w.system_prompt_len,
            "question_len": w.question_len,
            "output_len": w.output_len,
            "seed": w.seed,
        },
    }


def ip_config(profile: profiles.Profile, tokenizer_dir: str, base_url: str, out_dir: str) -> Dict[str, Any]:
    w, ld = profile.workload, profile.load
    stages = profile.wall_stages()
    return {
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": profile.sim.served_model_name, "base_url": base_url, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": tokenizer_dir},
        "data": data_config(profile),
        "load": {
            "type": "poisson",
            "interval": ld.interval,
            "stages": [{"rate": float(r), "duration": int(d)} for r, d in stages],
            "num_workers": ld.num_workers,
            "worker_max_concurrency": ld.worker_max_concurrency,
            "request_timeout": profile.wall_seconds(ld.request_timeout),
            "stage_teardown_grace_seconds": profile.wall_seconds(ld.stage_teardown_grace_seconds),
            "base_seed": w.arrival_seed,
        },
        "report": {
            "request_lifecycle": {
                "summary": True,
                "per_stage": True,
                "per_request": True,
                # The request body only when priorities are sent: its prompt names the request's class.
                "per_request_fields": {"request": w.critical_share > 0, "response": False, "info": False,
                                       "response_chunks": False, "computed_metrics": True},
                "percentiles": [10, 25, 50, 75, 90, 95, 99],
            },
            "prometheus": None,
        },
        "storage": {"local_storage": {"path": out_dir}},
    }


def workload_fingerprint(cfg: Dict[str, Any]) -> str:
    """sha256 of the inference-perf config without the per-strategy fields (base_url, output path)."""
    c = json.loads(json.dumps(cfg))
    c["server"].pop("base_url", None)
    c.pop("storage", None)
    return hashlib.sha256(json.dumps(c, sort_keys=True).encode()).hexdigest()[:16]


def planned_seconds(profile: profiles.Profile) -> float:
    """Wall seconds of arrivals (all stages, warm-up included)."""
    return sum(d for _, d in profile.wall_stages())


def _start_ipwrap(profile: profiles.Profile, cfg: Dict[str, Any], sdir: str, suffix: str = "",
                  arrival_seed: Optional[int] = None, extra_env: Optional[Dict[str, str]] = None) -> tuple:
    """Write inference-perf{suffix}.yaml and start ipwrap.py on it; returns (Proc, schedule path)."""
    import yaml

    cfg_path = os.path.join(sdir, f"inference-perf{suffix}.yaml")
    with open(cfg_path, "w") as fh:
        yaml.safe_dump(cfg, fh, sort_keys=False)
    sched = os.path.join(sdir, f"arrival-schedule{suffix}.jsonl")
    if os.path.exists(sched):
        os.remove(sched)
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "KVROUTE_BENCH_ARRIVAL_SEED": str(profile.workload.arrival_seed if arrival_seed is None else arrival_seed),
        "KVROUTE_BENCH_SCHEDULE_OUT": sched,
        "TOKENIZERS_PARALLELISM": "false",
    })
    if profile.workload.critical_share > 0:
        env["KVROUTE_BENCH_CRITICAL_SHARE"] = str(profile.workload.critical_share)
        env["KVROUTE_BENCH_PRIORITY_HEADER"] = strategies.PRIORITY_HEADER
    env.update(extra_env or {})
    argv = [sys.executable, os.path.join(HERE, "ipwrap.py"), "-c", cfg_path, "--log-level", "INFO"]
    return Proc(f"inference-perf{suffix}", argv, os.path.join(sdir, f"inference-perf{suffix}.log"), env=env), sched


def client_time_limit(profile: profiles.Profile) -> float:
    """A guard against a hung client, not a budget: arrivals, one timeout, and every
    output token at 1,000 tok/s (a cache-blind router on the full profile does ~4,000)."""
    tokens = sum(profile.expected_requests()) * profile.workload.output_len
    return 3 * planned_seconds(profile) + profile.wall_seconds(profile.load.request_timeout + tokens / 1000.0) + 600


def _wait_client(p: Proc, timeout: float) -> tuple:
    """(rc, timed_out) of a client, stopped if it outlived `timeout`."""
    try:
        rc = p.wait(timeout=max(1.0, timeout))
    except BaseException:  # the run is being stopped (signal): take the client down with it
        p.stop(grace=5)
        raise
    timed_out = rc is None
    if timed_out:
        p.stop(grace=30)
        rc = p.poll()
    else:
        p.stop()
    return rc, timed_out


def run_inference_perf(profile: profiles.Profile, cfg: Dict[str, Any], sdir: str) -> Dict[str, Any]:
    limit = client_time_limit(profile)
    t0 = time.time()
    p, sched = _start_ipwrap(profile, cfg, sdir)
    rc, timed_out = _wait_client(p, limit)
    return {"argv": ["inference-perf (via ipwrap.py)", "-c", "inference-perf.yaml"], "rc": rc, "timed_out": timed_out,
            "limit_s": limit, "wall_s": round(time.time() - t0, 1), "schedule_sha": sha256_prefix(sched)}


def mesh_client_config(profile: profiles.Profile, cfg: Dict[str, Any], k: int, base_url: str, ip_dir: str) -> Dict[str, Any]:
    """Client k's inference-perf config in the mesh scenario: its own router, 1 / clients of every
    stage's rate (profile.client_stages), its own arrival seed and report directory."""
    c = json.loads(json.dumps(cfg))
    c["server"]["base_url"] = base_url
    c["load"]["stages"] = [{"rate": float(r), "duration": int(d)} for r, d in profile.client_stages()]
    c["load"]["base_seed"] = profile.workload.arrival_seed + k
    c["storage"]["local_storage"]["path"] = os.path.join(ip_dir, f"client-{k}")
    return c


def run_mesh_clients(profile: profiles.Profile, cfg: Dict[str, Any], sdir: str, base_urls: List[str]) -> Dict[str, Any]:
    """The mesh scenario's load: one inference-perf per router, all at once (ipwrap.py splits the data
    set between them: client k sends items k, k + K, ...; and starts each stage with the others: a
    file barrier in sdir/stage-barrier). The schedule digest covers every client's."""
    n = profile.load.clients
    if len(base_urls) != n:
        raise RuntimeError(f"{n} clients need {n} routers, got {len(base_urls)}")
    limit = client_time_limit(profile)
    barrier = os.path.join(sdir, "stage-barrier")
    shutil.rmtree(barrier, ignore_errors=True)
    os.makedirs(barrier)
    t0 = time.time()
    started = [_start_ipwrap(profile, mesh_client_config(profile, cfg, k, url, cfg["storage"]["local_storage"]["path"]),
                             sdir, suffix=f"-client{k}", arrival_seed=profile.workload.arrival_seed + k,
                             extra_env={"KVROUTE_BENCH_CLIENT": f"{k}/{n}", "KVROUTE_BENCH_STAGE_BARRIER": barrier})
               for k, url in enumerate(base_urls)]
    clients = []
    for k, (p, sched) in enumerate(started):
        rc, timed_out = _wait_client(p, limit - (time.time() - t0))
        clients.append({"client": k, "rc": rc, "timed_out": timed_out, "schedule_sha": sha256_prefix(sched)})
    digest = hashlib.sha256("".join(c["schedule_sha"] or "-" for c in clients).encode()).hexdigest()[:16]
    return {"argv": ["inference-perf (via ipwrap.py)", "-c", f"inference-perf-client<k>.yaml, k < {n}"],
            "rc": next((c["rc"] for c in clients if c["rc"] != 0), 0), "timed_out": any(c["timed_out"] for c in clients),
            "limit_s": limit, "wall_s": round(time.time() - t0, 1), "schedule_sha": digest, "clients": clients}


# ------------------------------------------------------------------ one strategy

def strategy_record(strategy: strategies.Strategy, status: str, **extra: Any) -> Dict[str, Any]:
    """A strategy's entry in results.json, before any measurement."""
    return {"strategy": strategy.name, "label": strategy.label, "kind": strategy.kind, "params": strategy.params,
            "reference_row": strategy.reference_row, "description": strategy.description, "status": status, **extra}


def run_strategy(strategy: strategies.Strategy, profile: profiles.Profile, cluster: Any, out: str,
                 tokenizer_dir: str) -> Dict[str, Any]:
    sdir = os.path.join(out, "raw", strategy.name)
    os.makedirs(sdir, exist_ok=True)
    res = strategy_record(strategy, "failed")
    addresses = list(cluster.addresses)
    why = strategies.missing_prerequisite(strategy, cluster)
    if why:
        res.update(status="not run", reason=why)
        log(f"{strategy.name}: NOT RUN — {why}")
        return res
    res["idle_before"] = wait_pods_idle(addresses)
    if res["idle_before"].get("idle_after_s") is None:
        res.setdefault("warnings", []).append(f"pods still busy after {res['idle_before'].get('timeout')} s before the flush")
    res["flush"] = flush_pods(addresses)
    if any(v != 200 for v in res["flush"].values()):
        res.setdefault("warnings", []).append(f"flush did not answer 200 on every pod: {res['flush']}")
    time.sleep(1.0)
    cpu0 = machine_cpu()
    sim_cpu0 = cluster.cpu_seconds() if hasattr(cluster, "cpu_seconds") else None
    before = podmetrics.scrape_all(addresses)
    res["t_start"] = time.time()
    try:
        with strategies.start(strategy, addresses, sdir, cluster=cluster, profile=profile) as h:
            res["router"] = {"base_url": h.base_url, "argv": [[shlex.quote(a) for a in argv] for argv in h.argv],
                             "notes": h.notes}
            for name, text in h.config_files.items():
                with open(os.path.join(sdir, name), "w") as fh:
                    fh.write(text)
            cfg = ip_config(profile, tokenizer_dir, h.base_url, os.path.join(sdir, "inference-perf"))
            res["workload_fingerprint"] = workload_fingerprint(cfg)
            relay0 = dict(cluster.relay.stats()) if getattr(cluster, "relay", None) else None
            router_cpu0 = h.stats().get("cpu_seconds")
            log(f"{strategy.name}: router at {h.base_url}; running inference-perf "
                f"({planned_seconds(profile):.0f}s planned, cap {profile.load.inflight_cap} in flight)")
            restart = (PodRestart(cluster, profile.sim, os.path.join(sdir, "arrival-schedule.jsonl"), log)
                       if profile.sim.restart_pod >= 0 else None)
            with podmetrics.Sampler(addresses, os.path.join(sdir, "pod-samples.jsonl"), interval=1.0) as sampler, \
                    restart or contextlib.nullcontext():
                client_cpu0 = children_cpu_seconds()
                if profile.load.clients > 1:
                    ipres = run_mesh_clients(profile, cfg, sdir, h.base_urls)
                else:
                    ipres = run_inference_perf(profile, cfg, sdir)
                # The load generator shares this machine's CPUs with the pods and the router.
                ipres["cpu_s"] = round(children_cpu_seconds() - client_cpu0, 1)
            if restart:
                res["restart"] = restart.record
            res["inference_perf"] = ipres
            res["pod_scrape_errors"] = sampler.scrape_errors
            st = h.stats()
            router_cpu1 = st.get("cpu_seconds")
            if router_cpu0 is not None and router_cpu1 is not None:
                res["router_cpu_s"] = round(router_cpu1 - router_cpu0, 2)
            res["router_stats"] = router_stats(st, sdir)
            if relay0 is not None:
                relay1 = cluster.relay.stats()
                res["kv_events_relayed"] = sum(relay1.values()) - sum(relay0.values())
    except Exception as e:
        res.update(status="failed", reason=f"{type(e).__name__}: {e}")
        res["traceback"] = traceback.format_exc()
        log(f"{strategy.name}: FAILED — {e}")
    res["t_end"] = time.time()
    cpu1 = machine_cpu()
    if cpu1[2] > cpu0[2]:
        res["machine_cpu_busy"] = round((cpu1[0] - cpu0[0]) / (cpu1[2] - cpu0[2]), 3)
        res["machine_cpu_stolen"] = round((cpu1[1] - cpu0[1]) / (cpu1[2] - cpu0[2]), 3)
    if sim_cpu0 is not None:
        res["sim_cpu_s"] = round(cluster.cpu_seconds() - sim_cpu0, 1)
    try:
        after = podmetrics.scrape_all(addresses)
    except Exception as e:
        after = {}
        res["after_scrape_error"] = str(e)
    ip_dir = os.path.join(sdir, "inference-perf")
    if os.path.isdir(ip_dir):
        parsed = parse_mesh_reports(ip_dir, profile) if profile.load.clients > 1 else parse_ip_reports(ip_dir, profile)
        res["stages"] = parsed["stages"]
        with gzip.open(os.path.join(sdir, "requests.jsonl.gz"), "wt") as fh:
            for r in parsed["requests"]:
                fh.write(json.dumps(r) + "\n")
        res["requests_file"] = os.path.relpath(os.path.join(sdir, "requests.jsonl.gz"), out)
        res["pods"] = pod_summary(os.path.join(sdir, "pod-samples.jsonl"), before, after, parsed["stages"])
        timing = envoy_timing.summarize(sdir, parsed["stages"], profile.sim.time_scale)
        if timing:
            res["envoy_timing"] = timing
        placed = placement.summarize(sdir)
        if placed:
            res["placement"] = placed
        if (res.get("restart") or {}).get("status") == "done":
            res["restart"]["windows"] = restart_windows(res["restart"], parsed["requests"],
                                                        os.path.join(sdir, "pod-samples.jsonl"), profile.sim.time_scale)
        # The big per-request files (every inter-token gap, Envoy's access logs) are summarised above; keep a gzip.
        bigs = [os.path.join(d, "per_request_lifecycle_metrics.json")
                for d in [ip_dir] + [os.path.join(ip_dir, f"client-{k}") for k in range(profile.load.clients)]]
        bigs += [os.path.join(sdir, strategies.envoy_access_log_name(k)) for k in range(profile.load.clients)]
        for big in bigs:
            if os.path.exists(big):
                with open(big, "rb") as src, gzip.open(big + ".gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.remove(big)
        ipres = res.get("inference_perf", {})
        if res.get("reason") is None:
            if ipres.get("rc") == 0 and not ipres.get("timed_out"):
                res["status"] = "ok"
            else:
                res["reason"] = f"inference-perf rc={ipres.get('rc')} timed_out={ipres.get('timed_out')}"
    elif res.get("reason") is None:
        res["reason"] = "inference-perf wrote no reports"
    with open(os.path.join(sdir, "result.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    log(f"{strategy.name}: {res['status']}" + (f" ({res.get('reason')})" if res.get("reason") else ""))
    return res


# ------------------------------------------------------------------ main

# envoy-stats.txt: Envoy's own counters and histograms (tokenizer call-out connections and
# timeouts, downstream vs upstream request time) say where a request's time went before the pod;
# envoy-access.log.gz times each request at Envoy (envoy_timing.py).
RAW_KEEP = ("result.json", "requests.jsonl.gz", "pod-samples.jsonl", "arrival-schedule.jsonl", "inference-perf.yaml",
            "envoy.yaml", "plugin.json", "router-metrics.txt", "indexer-metrics.txt", "envoy-stats.txt",
            "envoy-access.log.gz")


def repo_relative(data: bytes) -> bytes:
    """A published file's text with paths inside the repository made relative to it (the
    repository names no machine's folders)."""
    return data.replace((REPO + os.sep).encode(), b"")


def publish(out: str, dst: str) -> None:
    """Copy report.md, plot.png, results.json and a compact raw archive (raw.tar.gz) to dst."""
    import tarfile

    os.makedirs(dst, exist_ok=True)
    for f in ("report.md", "results.json"):
        if os.path.exists(os.path.join(out, f)):
            with open(os.path.join(out, f), "rb") as src, open(os.path.join(dst, f), "wb") as copy:
                copy.write(repo_relative(src.read()))
    if os.path.exists(os.path.join(out, "plot.png")):
        shutil.copyfile(os.path.join(out, "plot.png"), os.path.join(dst, "plot.png"))
    raw = os.path.join(out, "raw")
    with tarfile.open(os.path.join(dst, "raw.tar.gz"), "w:gz") as tar:
        def add(path: str, arcname: str) -> None:
            with open(path, "rb") as f:
                data = f.read()
            if not path.endswith(".gz"):
                data = repo_relative(data)
            info = tar.gettarinfo(path, arcname=arcname)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        for strat in sorted(os.listdir(raw)) if os.path.isdir(raw) else []:
            sd = os.path.join(raw, strat)
            for f in RAW_KEEP:
                if os.path.exists(os.path.join(sd, f)):
                    add(os.path.join(sd, f), f"raw/{strat}/{f}")
            for f in sorted(os.listdir(sd)):  # the mesh scenario's clients: one config and schedule each
                if f.startswith(("inference-perf-client", "arrival-schedule-client", "envoy-access-client")) \
                        and not f.endswith(".log"):
                    add(os.path.join(sd, f), f"raw/{strat}/{f}")
            ipd = os.path.join(sd, "inference-perf")
            for root, _, files in sorted(os.walk(ipd)):
                for f in sorted(files):
                    if f.endswith(".json") or f.endswith(".yaml"):
                        rel = os.path.relpath(os.path.join(root, f), sd)
                        add(os.path.join(root, f), f"raw/{strat}/{rel}")
    log(f"published report.md, plot.png, results.json, raw.tar.gz to {dst}")


def close_run(out: str, reason: str) -> None:
    """Finish a run that was stopped between strategies (results.json is written after each one):
    the strategies its command named but did not reach are recorded as *not run* with `reason`,
    then the report is rendered."""
    data = load_results(out)
    reached = {r["strategy"] for r in data["results"]}
    for s in strategies.selected(recorded_args(data["meta"]).strategies):
        if s.name not in reached:
            data["results"].append(strategy_record(s, "not run", reason=reason))
    data["meta"]["finished_utc"] = utc_stamp()
    data["meta"]["stopped"] = reason
    write_results(out, data["meta"], data["results"])
    import report

    report.write(out)


def prime_tokenizer(profile: profiles.Profile, tokenizer_dir: str, cluster: Any, out: str) -> Dict[str, Any]:
    """Every workload prompt through the simulator's tokenizer once, so no strategy pays its cold cache (prime.py)."""
    import yaml

    import prime

    path = os.path.join(out, "prime-inference-perf.yaml")
    with open(path, "w") as fh:
        yaml.safe_dump(ip_config(profile, tokenizer_dir, f"http://{cluster.addresses[0]}", os.path.join(out, "prime")), fh,
                       sort_keys=False)
    os.environ.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    done = prime.prime(cluster.addresses[0], profile.sim.served_model_name, path)
    log(f"tokenizer primed: {done['tokenized']}/{done['prompts']} workload prompts in {done['seconds']} s")
    return done


# ------------------------------------------------------------------ sessions (a run, and its resumptions)

def utc_stamp() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="quick", choices=sorted(profiles.PROFILES))
    ap.add_argument("--strategies", default="all", help="comma list (default all: every strategy but the oracle, which runs only by name): "
                    + ",".join(strategies.BY_NAME))
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=JSON",
                    help="override a profile field, e.g. --set load.stages='[[5,10]]' (recorded in the report)")
    ap.add_argument("--kvroute-set", action="append", default=[], metavar="PATH=JSON",
                    help="set a field of every kvroute strategy's plugin config, e.g. --kvroute-set weights.running=0.5 "
                         "(dotted path into schema/plugin-config.schema.json; repeatable; recorded in the report)")
    ap.add_argument("--out", help="output directory (default build/bench/<UTC>-<profile>)")
    ap.add_argument("--endpoints", help="use these already-running OpenAI-compatible pods (host:port,...) "
                                        "instead of starting vllm-sim; the report says so")
    ap.add_argument("--results-dir", help="after the report, copy report.md, plot.png and results.json here")
    ap.add_argument("--resume", metavar="RUN_DIR", help="continue a run stopped between strategies: same profile, "
                                                        "overrides and strategies as its results.json records; "
                                                        "strategies recorded ok are kept, the others run on fresh pods")
    ap.add_argument("--resume-at-other-commit", action="store_true",
                    help="with --resume: run the rest even though the commit, work-tree state or binaries differ "
                         "from the earlier sessions' (refused otherwise; the report then flags the mix)")
    ap.add_argument("--close", metavar="RUN_DIR", help="finish a run stopped between strategies: record the ones it "
                                                       "did not reach as not run (--reason), render, publish")
    ap.add_argument("--reason", default="the run was stopped before this strategy", help="with --close")
    return ap


PLUGIN_SCHEMA = os.path.join(REPO, "schema", "plugin-config.schema.json")


def kvroute_overrides(items: List[str]) -> Dict[str, Any]:
    """`--kvroute-set PATH=JSON` values as one nested dict, each path checked against the plugin-config schema
    (it must name a field, through objects only) and each value against that field's schema."""
    import jsonschema

    with open(PLUGIN_SCHEMA) as fh:
        schema = json.load(fh)
    out: Dict[str, Any] = {}
    for item in items:
        path, eq, raw = item.partition("=")
        if not eq or not path:
            raise SystemExit(f"--kvroute-set {item!r}: expected PATH=JSON, e.g. weights.running=0.5")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare word is a string, as with --set
        node, keys = schema, path.split(".")
        for depth, key in enumerate(keys):
            fields = node.get("properties") or {}
            if key not in fields:
                where = ".".join(keys[:depth]) or "the top level"
                raise SystemExit(f"--kvroute-set {item!r}: {path!r} is not in the plugin-config schema "
                                 f"({os.path.relpath(PLUGIN_SCHEMA, REPO)}); fields at {where}: "
                                 f"{', '.join(sorted(fields)) or 'none (not an object)'}")
            node = fields[key]
        try:
            jsonschema.validate(value, node)
        except jsonschema.ValidationError as e:
            raise SystemExit(f"--kvroute-set {item!r}: {value!r} is not a valid {path}: {e.message}")
        target = out
        for key in keys[:-1]:
            target = target.setdefault(key, {})
        target[keys[-1]] = value
    return out


def profile_of(args: argparse.Namespace) -> profiles.Profile:
    """The run's profile: --profile with its --set overrides and the --kvroute-set plugin-config values."""
    prof = profiles.get(args.profile, args.set)
    prof.kvroute_overrides = kvroute_overrides(args.kvroute_set)
    return prof


def recorded_args(meta: Dict[str, Any]) -> argparse.Namespace:
    """The arguments of the command that started a run (results.json meta.command), parsed as run.py parses them."""
    return build_parser().parse_args(shlex.split(meta["command"])[2:])


def load_results(out: str) -> Dict[str, Any]:
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        raise SystemExit(f"{path} does not exist: nothing to resume or close")
    with open(path) as fh:
        return json.load(fh)


def write_results(out: str, meta: Dict[str, Any], results: List[Dict[str, Any]]) -> None:
    """results.json, replaced atomically (a run killed while writing keeps the previous complete file)."""
    path = os.path.join(out, "results.json")
    with open(path + ".tmp", "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1, default=str)
    os.replace(path + ".tmp", path)


def sessions_of(meta: Dict[str, Any], results: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """meta["sessions"], or for a run recorded before sessions existed, its one session rebuilt from meta."""
    if meta.get("sessions"):
        return meta["sessions"]
    ends = [r["t_end"] for r in results if r.get("t_end")]
    return [{"session": 1, "started_utc": meta.get("started_utc"),
             "finished_utc": meta.get("finished_utc") or (dt.datetime.fromtimestamp(max(ends), dt.timezone.utc)
                                                          .strftime("%Y%m%dT%H%M%SZ") if ends else None),
             "git": meta.get("git"), "artifacts": meta.get("artifacts"), "command": meta.get("command"),
             "strategies": [r["strategy"] for r in results if r.get("status") != "not run"]}]


def code_differences(earlier: List[Dict[str, Any]], git: Dict[str, Any], arts: Dict[str, Any]) -> List[str]:
    """How the code about to run differs from what the earlier sessions ran (commit, dirty tree, binaries)."""
    out: List[str] = []
    for s in earlier:
        g = s.get("git") or {}
        if g.get("commit") != git.get("commit"):
            out.append(f"session {s['session']} ran commit {str(g.get('commit'))[:12]}, this is {git.get('commit', '')[:12]}")
        elif bool(g.get("dirty")) != bool(git.get("dirty")):
            out.append(f"session {s['session']}'s work tree was {'dirty' if g.get('dirty') else 'clean'}, "
                       f"this one is {'dirty' if git.get('dirty') else 'clean'}")
        for name, a in sorted((s.get("artifacts") or {}).items()):
            if (arts.get(name) or {}).get("sha256") != a.get("sha256"):
                out.append(f"{name} differs from session {s['session']}'s (sha256 {a.get('sha256')} -> "
                           f"{(arts.get(name) or {}).get('sha256')})")
    return out


def _still_running(session: Dict[str, Any]) -> bool:
    """True when the process that ran `session` is alive and is run.py (a resume must not race it)."""
    pid = session.get("pid")
    if not pid or session.get("finished_utc"):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return b"run.py" in fh.read()
    except OSError:
        return False


def _set_aside(out: str, name: str, session: int) -> Optional[str]:
    """Move an earlier attempt's raw/<name> out of the way (kept, not overwritten) before the strategy runs again."""
    src = os.path.join(out, "raw", name)
    if not os.path.isdir(src):
        return None
    dst = f"{src}.before-session-{session}"
    os.replace(src, dst)
    return os.path.relpath(dst, out)


def _stop_on_signal(signum: int, _frame: Any) -> None:
    """SIGTERM/SIGHUP (a killed job, a closed session) unwind like Ctrl-C: routers, client and pods are stopped
    and results.json keeps every finished strategy, so `--resume` can continue."""
    raise KeyboardInterrupt(f"signal {signum}")


def run_session(out: str, meta: Dict[str, Any], results: List[Dict[str, Any]], prof: profiles.Profile,
                order: List[strategies.Strategy], todo: List[strategies.Strategy], endpoints: Optional[str],
                command: str) -> List[Dict[str, Any]]:
    """One session: fresh pods, the tokenizer primed, each strategy in `todo` run and stored in `results` (in
    `order`), results.json rewritten after each. Returns the updated results."""
    sessions = meta.setdefault("sessions", [])
    n = len(sessions) + 1
    session: Dict[str, Any] = {"session": n, "started_utc": utc_stamp(), "finished_utc": None, "command": command,
                               "pid": os.getpid(), "git": git_rev(), "artifacts": artifacts(),
                               "strategies": [s.name for s in todo], "loadavg_start": open("/proc/loadavg").read().strip()}
    sessions.append(session)
    rank = {s.name: i for i, s in enumerate(order)}
    by_name = {r["strategy"]: r for r in results}
    tok = prepare_tokenizer(out)
    write_results(out, meta, results)
    try:
        with pods(prof, out, tok, endpoints.split(",") if endpoints else None) as cluster:
            _run_strategies(out, meta, session, by_name, rank, prof, todo, cluster, endpoints, tok)
    except BaseException as e:  # stopped (signal, Ctrl-C) or broken: the session says when and why
        session["stopped_utc"] = utc_stamp()
        session["stopped_by"] = f"{type(e).__name__}: {e}"
        write_results(out, meta, _ordered(by_name, rank))
        raise
    session["finished_utc"] = utc_stamp()
    session["loadavg_end"] = open("/proc/loadavg").read().strip()
    meta["finished_utc"] = session["finished_utc"]
    meta["machine"]["loadavg_end"] = session["loadavg_end"]
    results = _ordered(by_name, rank)
    write_results(out, meta, results)
    return results


def _run_strategies(out: str, meta: Dict[str, Any], session: Dict[str, Any], by_name: Dict[str, Dict[str, Any]],
                    rank: Dict[str, int], prof: profiles.Profile, todo: List[strategies.Strategy], cluster: Any,
                    endpoints: Optional[str], tok: str) -> None:
    """The session's strategies on `cluster`; each record replaces the strategy's earlier one in `by_name`
    (which it lists under earlier_attempts, with where its raw data was set aside)."""
    n = session["session"]
    pods_info = {"addresses": list(cluster.addresses), "info": getattr(cluster, "info", None),
                 "argv": getattr(cluster, "argv", None)}
    session["pods"] = pods_info
    meta.setdefault("pods", pods_info)
    meta["versions"].setdefault("vllm-sim", getattr(cluster, "version", None))
    if not endpoints:
        session["tokenizer_prime"] = prime_tokenizer(prof, tok, cluster, out)
        meta.setdefault("tokenizer_prime", session["tokenizer_prime"])
    for s in todo:
        earlier = by_name.get(s.name) or {}
        aside = _set_aside(out, s.name, n)
        rec = run_strategy(s, prof, cluster, out, tok)
        rec["session"] = n
        if earlier or aside:
            rec["earlier_attempts"] = earlier.get("earlier_attempts", []) + [{
                "session": earlier.get("session", n - 1), "status": earlier.get("status", "interrupted"),
                "reason": earlier.get("reason", "the process stopped during this strategy"), "raw_dir": aside}]
        by_name[s.name] = rec
        write_results(out, meta, _ordered(by_name, rank))


def _ordered(by_name: Dict[str, Dict[str, Any]], rank: Dict[str, int]) -> List[Dict[str, Any]]:
    return sorted(by_name.values(), key=lambda r: rank.get(r["strategy"], len(rank)))


def resume_plan(out: str, allow_other_commit: bool) -> tuple:
    """What a resumed run re-runs, after the checks that make it the same experiment: the profile as recorded,
    the same code (commit, work-tree state, binaries) unless allowed, no session of it still running."""
    data = load_results(out)
    meta, results = data["meta"], data["results"]
    meta["sessions"] = sessions_of(meta, results)
    for r in results:
        r.setdefault("session", 1)
    if _still_running(meta["sessions"][-1]):
        raise SystemExit(f"session {meta['sessions'][-1]['session']} of {out} is still running "
                         f"(pid {meta['sessions'][-1]['pid']}): stop it first")
    args = recorded_args(meta)
    prof = profile_of(args)
    if json.loads(json.dumps(prof.to_dict())) != meta["profile"]:
        raise SystemExit(f"refusing to resume {out}: profile {args.profile!r} with {args.set} {args.kvroute_set} no "
                         "longer gives the recorded profile (profiles.py changed?); the rest would be another experiment")
    diffs = code_differences(meta["sessions"], git_rev(), artifacts())
    if diffs and not allow_other_commit:
        raise SystemExit("refusing to resume: the code differs from what the earlier sessions ran: " + "; ".join(diffs)
                         + ". Rebuild/check out what they ran, or pass --resume-at-other-commit (the report then "
                           "says which strategies ran at which commit).")
    order = strategies.selected(args.strategies)
    done = {r["strategy"] for r in results if r.get("status") == "ok"}
    todo = [s for s in order if s.name not in done]
    if meta.get("stopped"):
        meta["sessions"][-1]["closed"] = meta.pop("stopped")
    return meta, results, prof, args, order, todo, diffs


def finish(out: str, results: List[Dict[str, Any]], results_dir: Optional[str]) -> int:
    import report

    report.write(out)
    log(f"report: {os.path.join(out, 'report.md')}")
    if results_dir:
        publish(out, os.path.abspath(results_dir))
    ok = sum(1 for r in results if r["status"] == "ok")
    log(f"{ok}/{len(results)} strategies ran to completion")
    return 0 if ok == len(results) else 1


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.close:
        close_run(os.path.abspath(args.close), args.reason)
        if args.results_dir:
            publish(os.path.abspath(args.close), os.path.abspath(args.results_dir))
        return 0
    command = " ".join(shlex.quote(a) for a in ([os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO) else sys.executable,
                                                  os.path.relpath(__file__, REPO)] + (argv if argv is not None else sys.argv[1:])))
    signal.signal(signal.SIGTERM, _stop_on_signal)
    signal.signal(signal.SIGHUP, _stop_on_signal)
    if args.resume:
        defaults = build_parser().parse_args([])
        extra = [k for k in ("profile", "strategies", "set", "kvroute_set", "out", "endpoints", "close")
                 if getattr(args, k) != getattr(defaults, k)]
        if extra:
            raise SystemExit(f"--resume runs the stopped run's own recorded arguments; not with "
                             f"{', '.join('--' + k.replace('_', '-') for k in extra)}")
        out = os.path.abspath(args.resume)
        meta, results, prof, rec, order, todo, diffs = resume_plan(out, args.resume_at_other_commit)
        for d in diffs:
            log(f"WARNING: {d} (--resume-at-other-commit)")
        kept = [r["strategy"] for r in results if r["status"] == "ok"]
        log(f"resuming {out} (session {len(meta['sessions']) + 1}): kept {', '.join(kept) or 'nothing'}; "
            f"running {', '.join(s.name for s in todo) or 'nothing'}")
        try:
            results = run_session(out, meta, results, prof, order, todo, rec.endpoints, command)
        except KeyboardInterrupt as e:
            log(f"stopped ({e}); continue with: run.py --resume {out}")
            return 130
        return finish(out, results, args.results_dir)

    prof = profile_of(args)
    stamp = utc_stamp()
    out = os.path.abspath(args.out or os.path.join(REPO, "build", "bench", f"{stamp}-{prof.name}"))
    os.makedirs(out, exist_ok=True)
    if os.path.exists(os.path.join(out, "results.json")):
        raise SystemExit(f"{out} already holds a run (results.json): --resume it, or choose another --out")
    sel = strategies.selected(args.strategies)
    log(f"profile {prof.name}: {prof.description}; resident set {prof.resident_fraction():.0%} of cluster KV; "
        f"strategies: {', '.join(s.name for s in sel)}; out {out}")
    meta: Dict[str, Any] = {
        "command": command,
        "profile": prof.to_dict(),
        "overrides": args.set,
        "kvroute_overrides": args.kvroute_set,
        "expected_requests": prof.expected_requests(),
        "resident_fraction": prof.resident_fraction(),
        "started_utc": stamp,
        "machine": machine_info(),
        "git": git_rev(),
        "versions": versions(),
        "artifacts": artifacts(),
        "pods_external": bool(args.endpoints),
    }
    try:
        results = run_session(out, meta, [], prof, sel, sel, args.endpoints, command)
    except KeyboardInterrupt as e:
        log(f"stopped ({e}); continue with: run.py --resume {out}")
        return 130
    return finish(out, results, args.results_dir)


if __name__ == "__main__":
    sys.exit(main())
