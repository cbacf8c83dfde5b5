"""Readings of an Envoy under test: RSS and allocator figures, kvroute's histograms, decision
latency of probe requests, and CPU per request under wrk load (all threads and the main thread,
paired against a plain Envoy)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import wrk
from benchlog import logger
# First: it puts integration/ on the path, where envoyctl and proctools live.
from scale_fleet import Client, parse_decision, post_each
from envoyctl import EnvoyProcess  # noqa: E402
from proctools import wait_for  # noqa: E402

log = logger("scale")

# wrk's script of the CPU readings
LOAD_SCRIPT = Path(__file__).resolve().parent / "scale_load.lua"


IDLE_READING_S = 1.0


# The index writer's work during a CPU reading (the singleton's gauges, recorded at its flushes).
INDEX_WORK = {"read_back": "wasmcustom.kvroute.index.read_back",
              "written_back_early": "wasmcustom.kvroute.index.written_back_early",
              "blocks_already_taught": "wasmcustom.kvroute.blocks.already_taught",
              "blocks_total": "wasmcustom.kvroute.blocks.total",
              "lookup_reads": "wasmcustom.kvroute.index.lookup_reads",
              "lookup_reused": "wasmcustom.kvroute.index.lookup_reused"}


_FAILURE = re.compile(r"memory allocation|panicked|unexpected status|buffer size limit|exited with|"
                      r"\]\[critical\]\[main\]")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def allocator_memory(envoy: EnvoyProcess) -> dict[str, float]:
    """Envoy's tcmalloc figures (admin `GET /memory`) in MB, read next to RSS: `allocated` is live
    heap data (shared data, buffers, stats; not the VMs' wasm memory, which V8 maps itself);
    `pageheap_free` and `total_thread_cache` are freed memory tcmalloc still holds (resident);
    `pageheap_unmapped` was returned to the OS."""
    with urllib.request.urlopen(envoy.admin_url + "/memory", timeout=5) as r:
        data = json.load(r)
    return {k: round(int(data.get(k, 0)) / 2**20, 1) for k in (
        "allocated", "heap_size", "pageheap_unmapped", "pageheap_free", "total_thread_cache", "total_physical_bytes")}


def histogram_buckets(envoy: EnvoyProcess, name: str) -> list[tuple[float, float, int]]:
    """Cumulative (lower_bound, width, count) buckets of a histogram from the admin endpoint."""
    url = f"{envoy.admin_url}/stats?format=json&histogram_buckets=detailed&filter={name}$"
    with urllib.request.urlopen(url, timeout=10) as r:
        data = json.load(r)
    for entry in data.get("stats", []):
        for detail in entry.get("histograms", {}).get("details", []) if isinstance(entry.get("histograms"), dict) \
                else []:
            if detail.get("name", "").endswith(name):
                return [(b["lower_bound"], b["width"], b["count"]) for b in detail.get("totals", [])]
    return []


def bucket_diff(after: list, before: list) -> list[tuple[float, float, int]]:
    prior = {(lb, w): c for lb, w, c in before}
    return [(lb, w, c - prior.get((lb, w), 0)) for lb, w, c in after if c - prior.get((lb, w), 0) > 0]


def bucket_quantile(buckets: list[tuple[float, float, int]], q: float) -> float | None:
    """Quantile of bucketed samples (upper edge of the bucket holding it: conservative)."""
    total = sum(c for _, _, c in buckets)
    if not total:
        return None
    seen = 0
    for lb, w, c in sorted(buckets):
        seen += c
        if seen >= q * total:
            return round(lb + w, 1)
    return None


def settled_buckets(envoy: EnvoyProcess, name: str) -> list[tuple[float, float, int]]:
    """The histogram once it holds every decision made so far: the workers add their decision
    counters to Envoy's stats at their duty tick, and their histograms reach the admin endpoint
    only at Envoy's stats flush."""
    counters = envoy.settled_stats("kvroute.decision.")
    decisions = sum(counters.get(f"wasmcustom.kvroute.decision.{k}", 0) for k in ("prefix", "load"))

    def read() -> list | None:
        buckets = histogram_buckets(envoy, name)
        return buckets if sum(c for _, _, c in buckets) >= decisions else None
    return wait_for(read, 30) or histogram_buckets(envoy, name)


def decision_latency(envoy: EnvoyProcess, probes: list[tuple[bytes, str | None]]) -> dict[str, Any]:
    """Sends probes whose prefix is cached on the named pod (None: on the pod the previous,
    teaching pass chose) and reads `kvroute.decision_us` for exactly these decisions."""
    name = "kvroute.decision_us"
    before = settled_buckets(envoy, name)
    matched_before = envoy.settled_stats("kvroute.blocks.matched").get("wasmcustom.kvroute.blocks.matched", 0)
    client = Client(envoy.listener_port)
    full, blocks = 0, 0
    try:
        for body, pod in probes:
            status, header = client.post(body)
            d = parse_decision(header)
            blocks += d["matched"]
            if status == 200 and d["total"] and d["matched"] == d["total"] and (pod is None or d["pod"] == pod):
                full += 1
    finally:
        client.close()
    after = settled_buckets(envoy, name)
    samples = bucket_diff(after, before)
    matched_after = envoy.settled_stats("kvroute.blocks.matched").get("wasmcustom.kvroute.blocks.matched", 0)
    return {"probes": len(probes), "fully_matched": full, "blocks_matched_header": blocks,
            "blocks_matched_counter": matched_after - matched_before,
            "samples": sum(c for _, _, c in samples),
            "p50_us": bucket_quantile(samples, 0.50), "p99_us": bucket_quantile(samples, 0.99)}


def task_cpu_ns(pid: int, task: int) -> int:
    """On-CPU nanoseconds of one thread: the first field of its schedstat, the scheduler's own
    account (ns), where /proc/<pid>/stat rounds user and system time to clock ticks (10 ms:
    50 µs per request over 200 requests, as large as issue 10's target)."""
    try:
        return int(Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()[0])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return 0  # the thread ended between the listing and the read


def process_cpu_ns(pid: int) -> int:
    """On-CPU nanoseconds of every thread of the process (Envoy's threads live as long as it)."""
    return sum(task_cpu_ns(pid, int(task.name)) for task in Path(f"/proc/{pid}/task").iterdir())


def main_thread_cpu_seconds(pid: int) -> float:
    """CPU of Envoy's main thread (the task whose id is the process id): kvroute's singleton, the
    index's one writer, runs there, besides Envoy's own admin and stats work."""
    return task_cpu_ns(pid, pid) / 1e9


def wrk_load(port: int, body_file: str, seconds: int, connections: int) -> dict[str, int]:
    """wrk POSTing the bodies of `body_file` in turn over `connections` keep-alive connections for
    `seconds`: Python clients would take about one of the machine's two cores from the Envoy
    being read."""
    env = dict(os.environ, BODY_FILE=body_file)
    r = wrk.run(f"http://127.0.0.1:{port}/", str(LOAD_SCRIPT), env, connections, seconds)
    if r["rc"] != 0 or "requests" not in r:
        log(f"wrk failed (exit {r['rc']}): {r.get('stderr', '')}")
        return {"ok": 0, "failed": 1}
    return {"ok": r["requests"] - r["non2xx"], "failed": r["non2xx"] + r["socket_errors"]}


def load_reading(envoy: EnvoyProcess, body_file: str, seconds: int, connections: int) -> dict:
    """One reading: the load's answers, its seconds, and the on-CPU ns of all Envoy's threads and
    of its main thread meanwhile, with the upstream connections it opened."""
    connections0 = envoy.stats(".upstream_cx_total")
    cpu0, main0 = process_cpu_ns(envoy.pid), task_cpu_ns(envoy.pid, envoy.pid)
    t0 = time.monotonic()
    counts = wrk_load(envoy.listener_port, body_file, seconds, connections)
    elapsed = time.monotonic() - t0
    cpu, main = process_cpu_ns(envoy.pid) - cpu0, task_cpu_ns(envoy.pid, envoy.pid) - main0
    connections1 = envoy.stats(".upstream_cx_total")
    return {**counts, "seconds": elapsed, "cpu_ns": cpu, "main_ns": main,
            "opened": {name: value - connections0.get(name, 0) for name, value in connections1.items()}}


def pooled(readings: list[dict]) -> dict:
    """Readings of one Envoy taken together: CPU per answered request."""
    answered = max(1, sum(r["ok"] for r in readings))
    opened: dict[str, int] = {}
    for r in readings:
        for name, n in r["opened"].items():
            opened[name] = opened.get(name, 0) + n
    return {"ok": sum(r["ok"] for r in readings),
            "failed": sum(r["failed"] for r in readings),
            "seconds": round(sum(r["seconds"] for r in readings), 2),
            "cpu_us_per_request": round(sum(r["cpu_ns"] for r in readings) / answered / 1e3, 1),
            "main_thread_cpu_us_per_request": round(sum(r["main_ns"] for r in readings) / answered / 1e3, 1),
            # schedstat counts ns; the figures are rounded to 0.1 µs (ticks gave 1e6 / CLK_TCK / requests)
            "cpu_resolution_us": 0.1,
            # new upstream connections (pods, tokenizer call-outs): each costs Envoy a connect
            "upstream_connections_opened": {
                name.removeprefix("cluster.").removesuffix(".upstream_cx_total"): n
                for name, n in opened.items() if n > 0}}


def paired_added(kvroute: list[dict], plain: list[dict]) -> list[float]:
    """Per round, kvroute's Envoy CPU per answered request minus the plain Envoy's (µs)."""
    def per_request(reading: dict) -> float:
        return reading["cpu_ns"] / max(1, reading["ok"]) / 1e3
    return [round(per_request(k) - per_request(p), 1) for k, p in zip(kvroute, plain)]


def envoy_cpu_per_request(envoy: EnvoyProcess, bodies: list[bytes], seconds: int, connections: int,
                          plain: EnvoyProcess | None, rounds: int) -> dict:
    """Envoy's CPU per request in `rounds` readings of `seconds` each, and the index
    writer's work meanwhile. With `plain` (the same load's Envoy without kvroute, running beside
    it), each round reads both, in alternating order, and the added CPU is the median over rounds
    of kvroute's reading minus plain's: both see the same moment of the machine, which readings
    of each taken minutes apart did not (plain Envoy's 30 KB reading at 1,000 pods and c2 moved
    from 101 to 302 µs between runs)."""
    for e in (envoy, plain):
        if e is not None:
            post_each(e.listener_port, bodies)  # warm: every variant once
    envoy.wait_for_index_flush()
    before = envoy.settled_stats("kvroute.")
    # The idle Envoy's own CPU (timers, the singleton's polls and flushes), for scale: it is part
    # of every reading, in proportion to its duration.
    idle0, t_idle = process_cpu_ns(envoy.pid), time.monotonic()
    time.sleep(IDLE_READING_S)
    idle_ns_per_s = (process_cpu_ns(envoy.pid) - idle0) / (time.monotonic() - t_idle)
    with_kvroute: list[dict] = []
    without: list[dict] = []
    with tempfile.NamedTemporaryFile("wb", suffix=".jsonl") as body_file:
        body_file.write(b"".join(body + b"\n" for body in bodies))
        body_file.flush()
        for r in range(rounds):
            pair = [(envoy, with_kvroute), (plain, without)]
            for e, readings in (pair if r % 2 == 0 else pair[::-1]):
                if e is not None:
                    readings.append(load_reading(e, body_file.name, seconds, connections))
    out = pooled(with_kvroute)
    out["idle_cpu_us_per_s"] = round(idle_ns_per_s / 1e3, 1)
    out["idle_cpu_us_per_request"] = round(idle_ns_per_s * out["seconds"] / max(1, out["ok"]) / 1e3, 1)
    if without:
        out["without_kvroute"] = pooled(without)
        out["without_kvroute_cpu_us_per_request"] = out["without_kvroute"]["cpu_us_per_request"]
        out["added_rounds_us"] = paired_added(with_kvroute, without)
        out["added_cpu_us_per_request"] = round(statistics.median(out["added_rounds_us"]), 1)
    envoy.wait_for_index_flush()
    after = envoy.settled_stats("kvroute.")
    out["index_work"] = {k: after.get(name, 0) - before.get(name, 0) for k, name in INDEX_WORK.items()}
    return out


def per_request(cpu: dict, work: str) -> str:
    """A counter of the reading's index work per request, or — without one."""
    count = cpu.get("index_work", {}).get(work)
    return "—" if count is None or not cpu.get("ok") else f"{count / cpu['ok']:.2f}"


def failure_lines(log_text: str) -> list[str]:
    """The lines of an Envoy log that say why kvroute failed: allocation failures, panics (and
    the line after: the message), async-client limits, the exit."""
    lines = log_text.splitlines()
    picked = [i for i, line in enumerate(lines) if _FAILURE.search(line)]
    keep = sorted({j for i in picked for j in (i, i + 1, i + 2) if j < len(lines)})
    return list(dict.fromkeys(lines[j][:300] for j in keep))[:12]


@contextlib.contextmanager
def envoy_running(config: str, concurrency: int, timeout: float, result: dict):
    """Yields the started Envoy, or None when it did not start: the failure (exit, log lines)
    goes into `result` as the measurement. Stops it by its PID on the way out."""
    envoy = EnvoyProcess(config, concurrency=concurrency, startup_timeout=timeout)
    try:
        envoy.start()
    except RuntimeError as e:
        result.update(started=False, failure=failure_lines(str(e) + "\n" + envoy.log_text()))
        envoy.__exit__(None, None, None)
        yield None
        return
    result.update(started=True, startup_s=round(time.monotonic() - envoy.started_at, 2))
    try:
        yield envoy
    finally:
        envoy.__exit__(None, None, None)
