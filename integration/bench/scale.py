#!/usr/bin/env python3
"""Fleet-scale yardstick (issue 10): what kvroute costs at 8, 100, 1,000 (and 5,000) pods.

    .venv/bin/python integration/bench/scale.py [--quick] [--results-dir DIR]     (make bench-scale)

The fleet is synthetic: N stub pods, one small asyncio process (`stub-pods`, started here and
stopped by its PID) listening on N ports of 127.0.0.1, answering every request with a tiny 200
chat completion (routed requests really complete: kvroute keeps what it learned only for pods
that answered) and `POST /tokenize` with token ids. Every pod states `capacity_blocks` 19,208
(one Qwen3-32B pod).

Approximate mode (plugin-config endpoints), per N and `--concurrency` 2 and 8:
  Envoy RSS once started (the filter's tables are sized from capacity at configure time) and
  startup time; `kvroute.decision_us` p50/p99 of decisions whose 8k-token prompt is really
  cached (each probe sent once to teach, then again: only the second pass is counted, from
  the difference of Envoy's histogram buckets); added Envoy CPU per request for 30 KB and
  128 KB chat bodies (Envoy CPU per request with kvroute minus the same Envoy without it, same
  load, sent by wrk: one thread, --connections keep-alive connections; 5,000 pods: c2 only).
  The Envoy without kvroute runs beside kvroute's, and each reading is --cpu-rounds rounds of
  both, alternated: the added CPU is the median of the rounds' differences. The Envoy without
  kvroute balances over as many pods as the load has prompt variants (CPU_VARIANTS), the most
  kvroute sends them to: both then reuse their upstream connections, and neither pays a new one
  per request. CPU is the on-CPU time of all Envoy's threads as the scheduler counts it
  (/proc/<pid>/task/*/schedstat, ns), reported to 0.1 µs per request.
Precise mode (kvroute-indexer with `--pod ADDRESS@MODEL` per pod), per N up to 1,000:
  the indexer filled to 70 % of capacity by synthetic vLLM KV events over ZMQ (BlockStored
  batches of 512-block sequences, built as tests/indexer/indexer_harness.py builds them); feed
  snapshot size, idle poll size, delta bytes per second while every pod stores and removes
  200 blocks/s (fewer when that exceeds --max-churn-blocks-s, then extrapolated); then per
  `--concurrency`: time for a new Envoy to route on the full index (from its process's start until the
  snapshot is loaded and published, `feed.snapshots` ≥ 1 with nothing deferred, and then an
  8k-token prompt of a random pod is fully matched on that pod; or the failure as the result), its RSS,
  `kvroute.index.blocks`, `kvroute.decision_us` p50/p99 of fully matched decisions, and added
  CPU per chat request including the tokenizer call-out (the workers' token memo, the plugin's
  default `tokenizer.memo_bytes` unless --token-memo-bytes says otherwise, recalls the variants'
  token blocks after their first call-outs; with 0 every request makes the call-out; the counts
  of each are checked). Both modes also record the CPU of
  Envoy's main thread, where the singleton (the index's one writer) runs: per request, and in
  precise mode from start until the index is routable (with the singleton's own share of it:
  `kvroute.feed.apply_us` and `kvroute.index.flush_us`).
Every RSS is read with Envoy's allocator figures (admin `GET /memory`: live heap, free memory
tcmalloc holds, memory returned to the OS); in precise mode both are read again after the CPU
readings and --settle-seconds of idle.
Every reading is checked (verify()): decisions fully matched on the right pod, histogram
samples = probes, `kvroute.blocks.matched` growth = the headers' matched blocks, the indexer
holding every entry sent, load all answered; a failed check exits non-zero. Everything binds
127.0.0.1 and stops by itself; failures (Envoy exiting, a feed that never loads) are recorded as
results. Results: results.json, table.md in --results-dir (default build/bench-scale/<UTC time>).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import http.client
import json
import os
import platform
import random
import re
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO / "integration"))
sys.path.insert(0, str(REPO / "tests" / "indexer"))

from envoyctl import GATEWAY_PRECISE, EnvoyProcess, render_gateway  # noqa: E402
from indexerctl import MODEL, IndexerProcess  # noqa: E402
from proctools import stop_pid, wait_ready  # noqa: E402

import wrk  # noqa: E402

CAPACITY_BLOCKS = 19_208  # one Qwen3-32B pod
# The plugin's default tokenizer.memo_bytes, so that a run reads the shipped setting.
PLUGIN_MEMO_BYTES = json.loads((REPO / "schema" / "plugin-config.schema.json").read_text())[
    "properties"]["tokenizer"]["properties"]["memo_bytes"]["default"]
FILL = 0.70
BLOCK_SIZE = 16
SEQUENCE_BLOCKS = 512  # an 8k-token prompt
DECISION_HEADER = "x-kvroute-decision"
# wrk's script of the CPU readings
LOAD_SCRIPT = HERE / "scale_load.lua"


def log(msg: str) -> None:
    print(f"[scale {dt.datetime.now(dt.timezone.utc).strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ stub pods


_COMPLETION = json.dumps({"id": "stub", "object": "chat.completion", "model": MODEL, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


def _tokenized(body: bytes) -> bytes:
    """A vLLM-shaped /tokenize answer: one token per 4 bytes of the call's body (the chat's
    messages), taken from those bytes, so different prompts give different token ids."""
    tokens = body[::4]
    return b'{"count":%d,"max_model_len":40960,"tokens":[%s]}' % (len(tokens), ",".join(map(str, tokens)).encode())


async def _serve_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 keep-alive: `POST /tokenize` gets token ids, any other request the completion
    (bodies read by content-length)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            answer = _tokenized(body) if head.split(b" ", 2)[1] == b"/tokenize" else _COMPLETION
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(answer), answer))
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError, IndexError):
        pass
    finally:
        writer.close()


async def _stub_pods(count: int, ports_file: Path) -> None:
    servers = [await asyncio.start_server(_serve_http, "127.0.0.1", 0, limit=1 << 20) for _ in range(count)]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    tmp = ports_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(ports))
    tmp.rename(ports_file)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


class StubFleet:
    """N stub pods in one child process; `addresses` are their 127.0.0.1:PORT."""

    def __init__(self, count: int):
        self.count = count
        self._dir = tempfile.mkdtemp(prefix="kvroute-scale-")
        self.ports_file = Path(self._dir) / "ports.json"
        self.proc: subprocess.Popen | None = None
        self.addresses: list[str] = []

    def __enter__(self) -> "StubFleet":
        self.proc = subprocess.Popen([sys.executable, __file__, "stub-pods", str(self.count), str(self.ports_file)],
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        wait_ready(self.proc, self.ports_file.exists, 60, "stub pods", lambda: "")
        self.addresses = [f"127.0.0.1:{p}" for p in json.loads(self.ports_file.read_text())]
        return self

    def __exit__(self, *exc) -> None:
        stop_pid(self.proc)
        self.ports_file.unlink(missing_ok=True)
        os.rmdir(self._dir)


# ------------------------------------------------------------------ prompts and requests


# Token ids stay below 128: one msgpack byte each, short JSON. A sequence's first block names
# its pod and number; the rest is shared text, yet its block hashes differ per sequence
# because every block hash chains from the previous one.
_SHARED_TAIL = [(i * 7) % 120 + 1 for i in range((SEQUENCE_BLOCKS - 1) * BLOCK_SIZE)]


def sequence_tokens(pod: int, seq: int, blocks: int = SEQUENCE_BLOCKS) -> list[int]:
    head = [pod % 128, (pod // 128) % 128, pod // 16384, seq % 128, (seq // 128) % 128, seq // 16384]
    head += [127] * (BLOCK_SIZE - len(head))
    return head + _SHARED_TAIL[:(blocks - 1) * BLOCK_SIZE]


def token_request(tokens: list[int]) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "probe"}],
                       "prompt_token_ids": tokens, "max_tokens": 1}).encode()


# Prompt variants of the CPU readings' load: kvroute sends each to one pod.
CPU_VARIANTS = 16


def chat_bodies(size: int, variants: int = CPU_VARIANTS) -> list[bytes]:
    """OpenAI chat bodies of about `size` bytes: a per-variant system prompt and a question."""
    out = []
    for v in range(variants):
        filler = f"variant {v}: " + " ".join(f"w{(v * 131 + i) % 9973}" for i in range(size // 6))
        body = {"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "system", "content": filler[:max(0, size - 200)]},
            {"role": "user", "content": f"question {v}"}]}
        out.append(json.dumps(body).encode())
    return out


class Client:
    """One keep-alive connection to Envoy's listener."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, body: bytes) -> tuple[int, str]:
        self.conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        resp = self.conn.getresponse()
        resp.read()
        return resp.status, resp.getheader(DECISION_HEADER, "")

    def close(self) -> None:
        self.conn.close()


def parse_decision(header: str) -> dict[str, Any]:
    """`pod=A; matched=M/T blocks; ...` -> {"pod": A, "matched": M, "total": T, "unit": "blocks"}."""
    fields = dict(part.strip().split("=", 1) for part in header.split(";") if "=" in part)
    matched = fields.get("matched", "0/0 none").split()
    m, _, t = matched[0].partition("/")
    return {"pod": fields.get("pod", ""), "matched": int(m or 0), "total": int(t or 0),
            "unit": matched[1] if len(matched) > 1 else ""}


def post_each(port: int, bodies: list[bytes]) -> dict[str, int]:
    """Sends each body once, in order, over one keep-alive connection."""
    client = Client(port)
    counts = {"ok": 0, "failed": 0}
    try:
        for body in bodies:
            status, _ = client.post(body)
            counts["ok" if status == 200 else "failed"] += 1
    finally:
        client.close()
    return counts


# ------------------------------------------------------------------ Envoy readings


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


def wait_for(cond: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    return last


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


IDLE_READING_S = 1.0

# The index writer's work during a CPU reading (the singleton's gauges, recorded at its flushes).
INDEX_WORK = {"read_back": "wasmcustom.kvroute.index.read_back",
              "written_back_early": "wasmcustom.kvroute.index.written_back_early",
              "blocks_already_taught": "wasmcustom.kvroute.blocks.already_taught",
              "blocks_total": "wasmcustom.kvroute.blocks.total",
              "lookup_reads": "wasmcustom.kvroute.index.lookup_reads",
              "lookup_reused": "wasmcustom.kvroute.index.lookup_reused"}


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


_FAILURE = re.compile(r"memory allocation|panicked|unexpected status|buffer size limit|exited with|"
                      r"\]\[critical\]\[main\]")


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


# ------------------------------------------------------------------ approximate mode


def approximate(fleet: StubFleet, concurrency: int, args) -> dict[str, Any]:
    pods = fleet.addresses
    plugin = {"endpoints": [{"address": a, "capacity_blocks": CAPACITY_BLOCKS} for a in pods]}
    result: dict[str, Any] = {}
    base: dict[str, Any] = {}
    result["envoy_without_kvroute"] = base
    with plain_envoy(pods, concurrency, args, base) as plain, \
            envoy_running(render_gateway(pods, plugin), concurrency, args.startup_timeout, result) as envoy:
        if envoy is None:
            return result
        envoy.wait_for_peers(timeout=60)
        result["rss_after_start_mb"] = round(rss_bytes(envoy.pid) / 2**20, 1)
        result["memory_after_start"] = allocator_memory(envoy)
        # Teach, then probe: each sequence is learned on the pod of its first decision.
        taught = [token_request(sequence_tokens(i, 0)) for i in range(args.probes)]
        teach = post_each(envoy.listener_port, taught)
        result["teach"] = teach
        envoy.wait_for_index_flush()  # the singleton publishes what the teaching pass taught
        result["decision"] = decision_latency(envoy, [(body, None) for body in taught])
        gauges = envoy.stats("kvroute.index")
        result["index_blocks"] = gauges.get("wasmcustom.kvroute.index.blocks")
        result["index_bytes"] = gauges.get("wasmcustom.kvroute.index.bytes")
        result["rss_after_probes_mb"] = round(rss_bytes(envoy.pid) / 2**20, 1)
        result["memory_after_probes"] = allocator_memory(envoy)
        result["cpu"] = {f"{kb}KB": envoy_cpu_per_request(envoy, chat_bodies(kb * 1024), args.cpu_seconds,
                                                          args.connections, plain, args.cpu_rounds)
                         for kb in (30, 128)}
    return result


@contextlib.contextmanager
def plain_envoy(pods: list[str], concurrency: int, args, result: dict):
    """The same load's Envoy without kvroute, run beside kvroute's for paired CPU readings (None
    when it did not start: the failure goes into `result`)."""
    # Over the whole fleet, least-request sends nearly every request to a pod it has no
    # connection to yet: the baseline would pay a connect per request that kvroute does not.
    baseline_pods = pods[:CPU_VARIANTS]
    with envoy_running(render_gateway(baseline_pods, kvroute=False), concurrency, args.startup_timeout,
                       result) as plain:
        if plain is not None:
            result["rss_mb"] = round(rss_bytes(plain.pid) / 2**20, 1)
        yield plain


# ------------------------------------------------------------------ precise mode


class KvEventSource:
    """Synthetic vLLM KV events for every pod, on one PUB socket connected to the indexer."""

    def __init__(self, indexer: IndexerProcess, pods: list[str]):
        import zmq
        from indexer_harness import Publisher, wait_subscribed

        self.ctx = zmq.Context()
        self.pub = Publisher(self.ctx, indexer.zmq_endpoint)
        wait_subscribed(indexer, self.pub)
        self.pods = pods
        self.seq = [0] * len(pods)
        self.next_hash = [((p + 1) << 32) for p in range(len(pods))]

    def _send(self, pod: int, *events: dict) -> None:
        from indexer_harness import batch, topic

        self.seq[pod] += 1
        self.pub.send(topic(self.pods[pod]), self.seq[pod], batch(*events))

    def store(self, pod: int, tokens: list[int]) -> list[int]:
        """One BlockStored of a whole sequence; returns its vLLM block hashes."""
        from indexer_harness import stored

        n = len(tokens) // BLOCK_SIZE
        hashes = list(range(self.next_hash[pod], self.next_hash[pod] + n))
        self.next_hash[pod] += n
        self._send(pod, stored(hashes, None, tokens, BLOCK_SIZE))
        return hashes

    def store_and_remove(self, pod: int, tokens: list[int], remove: list[int]) -> list[int]:
        from indexer_harness import removed, stored

        n = len(tokens) // BLOCK_SIZE
        hashes = list(range(self.next_hash[pod], self.next_hash[pod] + n))
        self.next_hash[pod] += n
        events = [stored(hashes, None, tokens, BLOCK_SIZE)] + ([removed(remove)] if remove else [])
        self._send(pod, *events)
        return hashes

    def close(self) -> None:
        self.pub.close()
        self.ctx.term()


class FeedPoller:
    """A byte-counting feed consumer (feed version 3, docs/contracts.md): it sends back the
    versions each answer states, follows snapshot pages to the last, and counts the keys of the
    runs it receives without keeping them (13 M entries would not fit a Python dict cheaply)."""

    def __init__(self, indexer: IndexerProcess):
        self.indexer = indexer
        self.epoch = self.cursor = self.pods_version = self.load_version = 0

    def get(self, page: tuple[int, int, int | None] | None = None) -> dict:
        q = f"epoch={self.epoch}&cursor={self.cursor}&pods={self.pods_version}&load={self.load_version}"
        if page:
            q += f"&page={page[0]}&page_pod={page[1]}" + (f"&page_after={page[2]}" if page[2] is not None else "")
        body = self.indexer.get(f"/v1/feed?{q}")
        assert body[:6] == b"KVRF\x03\x00", "feed version 3"
        flags = struct.unpack_from("<H", body, 6)[0]
        self.epoch, self.cursor, self.pods_version, self.load_version = struct.unpack_from("<QQQQ", body, 8)
        at, answer = 40, {"bytes": len(body), "page": None, "next": None, "more": bool(flags & 8),
                          "pods_listed": bool(flags & 2), "keys": None}
        if flags & 1:
            answer["page"] = struct.unpack_from("<I", body, at)[0]
            at += 4
            if flags & 8:
                pod, has_after = struct.unpack_from("<QB", body, at)
                at += 9
                after = struct.unpack_from("<Q", body, at)[0] if has_after else None
                at += 8 if has_after else 0
                answer["next"] = (answer["page"] + 1, pod, after)
        if not flags & 6:  # no list in front of the runs: count their keys
            answer["keys"] = _run_keys(body, at)
        return answer

    def snapshot(self) -> dict:
        """The whole snapshot, page by page: bytes, pages, the largest page, seconds."""
        self.epoch = self.cursor = self.pods_version = self.load_version = 0
        t0 = time.monotonic()
        first = self.get()
        assert first["page"] == 0, "a fresh consumer gets a snapshot"
        answers = [first]
        while answers[-1]["next"]:
            answers.append(self.get(answers[-1]["next"]))
        return {"snapshot_bytes": sum(a["bytes"] for a in answers), "snapshot_pages": len(answers),
                "snapshot_largest_page_bytes": max(a["bytes"] for a in answers),
                "snapshot_s": round(time.monotonic() - t0, 2)}


def _varint(body: bytes, at: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = body[at]
        at += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, at


def _packed_len(n: int) -> int:
    """Bytes of n packed keys (core/src/feed.rs: Elias-Fano, the low bits giving the fewest bytes)."""
    def bits(low: int) -> int:
        high = 40 - low
        return n * low + (n + (1 << high) - 1 if high else 0)
    return min((bits(low) + 7) // 8 for low in range(40, 7, -1))


def _run_keys(body: bytes, at: int) -> int:
    """Keys in the runs from `at` (run: varint pod << 3 | op, then for stored/removed n varint, n packed keys)."""
    runs, at = _varint(body, at)
    keys = 0
    for _ in range(runs):
        op_pod, at = _varint(body, at)
        if op_pod & 7 != 5:
            n, at = _varint(body, at)
            keys += n
            at += _packed_len(n)
    assert at == len(body), "runs end the message"
    return keys


def fill(indexer: IndexerProcess, source: KvEventSource, pods: int) -> dict[str, Any]:
    per_pod = int(CAPACITY_BLOCKS * FILL)
    full_sequences, rest = divmod(per_pod, SEQUENCE_BLOCKS)
    t0 = time.monotonic()
    for seq in range(full_sequences + (1 if rest else 0)):
        blocks = SEQUENCE_BLOCKS if seq < full_sequences else rest
        for pod in range(pods):
            source.store(pod, sequence_tokens(pod, seq, blocks))
    sent = time.monotonic() - t0
    expected = per_pod * pods

    def indexed() -> int:
        """(block, pod) entries, counted per publisher (the feed's keys can be fewer: see index_keys).
        0 while the indexer is too busy applying the burst to answer in time (5,000 pods)."""
        try:
            return sum(s.get("blocks", 0) for p in indexer.pods_debug().values() for s in p.get("sources", []))
        except (TimeoutError, urllib.error.URLError):
            return 0

    held = wait_for(lambda: (n := indexed()) >= expected and n, 600, interval=1.0) or indexed()
    # Distinct 40-bit index keys per pod, what the feed serves: two blocks of one pod may share one.
    keys = sum(p.get("blocks", 0) for p in indexer.pods_debug().values())
    return {"blocks_per_pod": per_pod, "sequences_per_pod": full_sequences, "expected_entries": expected,
            "indexed_entries": held, "index_keys": keys, "send_s": round(sent, 1),
            "indexed_s": round(time.monotonic() - t0, 1),
            "indexer_rss_mb": round(indexer.rss_bytes() / 2**20, 1),
            "indexer_rss_bytes_per_entry": round(indexer.rss_bytes() / max(1, held), 1)}


def feed_bytes(indexer: IndexerProcess, source: KvEventSource, pods: int, rate: int, seconds: float) -> dict:
    """Snapshot (in pages) and idle poll sizes, then delta bytes/s while every pod stores and
    removes `rate` blocks/s (in 20-block messages), polled every 100 ms as the singleton does."""
    poller = FeedPoller(indexer)
    snapshot = poller.snapshot()
    idle = poller.get()
    assert idle["page"] is None and idle["keys"] == 0, "an idle poll after the snapshot"
    polled = {"bytes": 0, "polls": 0, "keys": 0, "snapshots": 0, "lists": 0}
    stop = threading.Event()

    def poller_loop() -> None:
        while not stop.is_set():
            answer = poller.get()
            polled["bytes"] += answer["bytes"]
            polled["polls"] += 1
            polled["keys"] += answer["keys"] or 0
            polled["snapshots"] += answer["page"] == 0
            polled["lists"] += answer["keys"] is None
            if not answer["more"]:
                stop.wait(0.1)

    thread = threading.Thread(target=poller_loop, daemon=True)
    chunk = 20
    churn: list[list[int]] = [[] for _ in range(pods)]
    messages = rate * pods // chunk  # per second
    interval = 1.0 / messages if messages else 1.0
    sent_blocks = 0
    thread.start()
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < seconds:
        pod = i % pods
        tokens = sequence_tokens(pod, 10_000 + i // pods, chunk)
        removing = len(churn[pod])
        churn[pod] = source.store_and_remove(pod, tokens, churn[pod])
        sent_blocks += chunk + removing
        i += 1
        lag = t0 + i * interval - time.monotonic()
        if lag > 0:
            time.sleep(lag)
    elapsed = time.monotonic() - t0
    time.sleep(0.5)  # the last poll picks up the tail
    stop.set()
    thread.join()
    elapsed_with_tail = time.monotonic() - t0
    polls_per_s = polled["polls"] / elapsed_with_tail
    # Without lists, an answer is the 41-byte idle poll plus its runs: what grows with the events.
    event_bytes = polled["bytes"] - polled["polls"] * idle["bytes"]
    bytes_per_event = event_bytes / max(1, polled["keys"])
    target = 2 * 200 * pods  # 200 stored + 200 removed blocks/s per pod
    return {**snapshot, "idle_poll_bytes": idle["bytes"],
            "churn_blocks_per_pod_s": rate, "churn_seconds": round(elapsed, 1),
            "block_events_sent": sent_blocks, "block_events_per_s": round(sent_blocks / elapsed),
            "block_events_polled": polled["keys"], "answers_with_lists": polled["lists"],
            "polls": polled["polls"], "polls_per_s": round(polls_per_s, 2), "delta_snapshots": polled["snapshots"],
            "delta_bytes_per_s": round(polled["bytes"] / elapsed_with_tail),
            "bytes_per_block_event": round(bytes_per_event, 2),
            "bytes_per_block_event_all_in": round(polled["bytes"] / max(1, polled["keys"]), 2),
            "delta_bytes_per_s_at_200_per_pod": round(idle["bytes"] * 10 + bytes_per_event * target),
            "extrapolated": rate < 200}


def precise_envoy(fleet: StubFleet, indexer: IndexerProcess, concurrency: int, sequences: int,
                  args) -> dict:
    pods = fleet.addresses
    # The tokenizer call-out's 50 ms timeout is widened: the stub pods tokenize in Python on a
    # busy 2-core machine, and a timed-out call-out would measure the byte fallback instead.
    plugin = {"default_capacity_blocks": CAPACITY_BLOCKS,
              "tokenizer": {"timeout_ms": 1000, "memo_bytes": args.token_memo_bytes}}
    config = render_gateway(pods, plugin, template=GATEWAY_PRECISE, indexer=indexer.address)
    rng = random.Random(concurrency)
    # Snapshot pages go by key range, so a full match on one pod can come before the index is
    # whole: "routes on the full index" waits until the snapshot is loaded and published, then
    # checks a full match on the right pod, on a pod apart from the measured probes (a probe
    # teaches its own decision locally, so a measured one is never repeated).
    last = max(2, len(pods) // 25)
    check = (rng.randrange(len(pods) - last, len(pods)), rng.randrange(sequences))
    order = [(rng.randrange(len(pods) - last), rng.randrange(sequences)) for _ in range(args.probes)]
    probes = iter(order)
    result: dict[str, Any] = {}
    with envoy_running(config, concurrency, args.startup_timeout, result) as envoy:
        if envoy is None:
            return result
        # from the process's start (not the harness's own work before it)
        t0 = envoy.started_at
        client = Client(envoy.listener_port)

        def loaded() -> bool:
            stats = envoy.stats("kvroute.")
            return (stats.get("wasmcustom.kvroute.feed.snapshots", 0) >= 1
                    and stats.get("wasmcustom.kvroute.index.deferred", 1) == 0)

        def routed() -> bool:
            pod, seq = check
            status, header = client.post(token_request(sequence_tokens(pod, seq)))
            d = parse_decision(header)
            return status == 200 and d["pod"] == pods[pod] and d["matched"] == d["total"] == SEQUENCE_BLOCKS

        loaded_at = wait_for(loaded, args.route_timeout, interval=0.05)
        result["snapshot_loaded_s"] = round(time.monotonic() - t0, 2) if loaded_at else None
        result["main_thread_cpu_s_to_load"] = round(main_thread_cpu_seconds(envoy.pid), 2)
        # of which the singleton's own wasm work: feed answers decoded and applied, and flushes
        singleton_us = envoy.stats("kvroute.")
        result["singleton_s_to_load"] = {
            "feed_apply": round(singleton_us.get("wasmcustom.kvroute.feed.apply_us", 0) / 1e6, 2),
            "index_flush": round(singleton_us.get("wasmcustom.kvroute.index.flush_us", 0) / 1e6, 2),
        }
        ok = bool(loaded_at) and routed()
        client.close()
        result["routes_on_full_index"] = ok
        result["time_to_route_s"] = round(time.monotonic() - t0, 2) if ok else None
        feed = envoy.stats("kvroute.feed")
        result["feed"] = {k.rsplit(".", 1)[-1]: v for k, v in feed.items()}
        result["rss_mb"] = round(rss_bytes(envoy.pid) / 2**20, 1)
        result["memory"] = allocator_memory(envoy)
        result["writer_memory_mb"] = round(envoy.stats("kvroute.index.writer_memory_bytes").get(
            "wasmcustom.kvroute.index.writer_memory_bytes", 0) / 2**20, 1)
        if ok:
            chosen = [next(probes) for _ in range(args.probes)]
            result["decision"] = decision_latency(
                envoy, [(token_request(sequence_tokens(p, s)), pods[p]) for p, s in chosen])
        else:
            result["failure"] = failure_lines(envoy.log_text())
        # the singleton records the gauge at its flush
        result["index_blocks"] = wait_for(
            lambda: envoy.stats("kvroute.index.blocks").get("wasmcustom.kvroute.index.blocks"), 10)
        result["index_bytes"] = envoy.stats("kvroute.index.bytes").get("wasmcustom.kvroute.index.bytes")
        # chat bodies without token ids: each request also makes the tokenizer call-out, or
        # (--token-memo-bytes) recalls its variant's token blocks
        result["cpu"] = {}
        # started only now: it must not share the machine with the snapshot's load
        base: dict[str, Any] = {}
        result["envoy_without_kvroute"] = base
        with plain_envoy(pods, concurrency, args, base) as plain:
            for kb in (30, 128):
                before = envoy.stats("kvroute.tokenizer.")
                cpu = envoy_cpu_per_request(envoy, chat_bodies(kb * 1024), args.cpu_seconds, args.connections,
                                            plain, args.cpu_rounds)
                after = envoy.stats("kvroute.tokenizer.")
                for outcome in ("ok", "failed", "recalled"):
                    key = f"wasmcustom.kvroute.tokenizer.{outcome}"
                    cpu[f"tokenizer_{outcome}"] = after.get(key, 0) - before.get(key, 0)
                result["cpu"][f"{kb}KB"] = cpu
        # again after the probes and the CPU readings (and --settle-seconds more): what the
        # allocator, which returns freed pages at a bounded rate (memory_allocator_manager), gave back
        time.sleep(args.settle_seconds)
        result["settle_s"] = args.settle_seconds
        result["rss_end_mb"] = round(rss_bytes(envoy.pid) / 2**20, 1)
        result["memory_end"] = allocator_memory(envoy)
    return result


def precise(fleet: StubFleet, args) -> dict[str, Any]:
    pods = fleet.addresses
    flags = [f"--max-pods={max(1024, len(pods))}", "--pod-timeout-seconds=0", "--scrape-interval-ms=0",
             "--queue-capacity=1000000"]
    result: dict[str, Any] = {}
    with IndexerProcess(pods, *flags) as indexer:
        source = KvEventSource(indexer, pods)
        try:
            log(f"precise N={len(pods)}: filling the indexer to {FILL:.0%}")
            result["fill"] = fill(indexer, source, len(pods))
            log(f"precise N={len(pods)}: {result['fill']}")
            rate = 200 if len(pods) * 200 <= args.max_churn_blocks_s else args.max_churn_blocks_s // len(pods)
            result["feed"] = feed_bytes(indexer, source, len(pods), rate, args.churn_seconds)
            log(f"precise N={len(pods)}: feed {result['feed']}")
            result["fill_after_churn"] = sum(p.get("blocks", 0) for p in indexer.pods_debug().values())
            for c in ([] if args.no_envoy else args.concurrency):
                log(f"precise N={len(pods)} c{c}: Envoy")
                result[f"c{c}"] = precise_envoy(fleet, indexer, c, result["fill"]["sequences_per_pod"], args)
                log(f"precise N={len(pods)} c{c}: {summary(result[f'c{c}'])}")
            result["indexer_rss_mb"] = round(indexer.rss_bytes() / 2**20, 1)
            result["indexer_metrics"] = {k: indexer.metric(k) for k in (
                "kvroute_indexer_feed_requests_total", "kvroute_indexer_messages_rejected_total",
                "kvroute_indexer_seq_gaps_total", "kvroute_indexer_queue_dropped_total")}
        finally:
            source.close()
    return result


# ------------------------------------------------------------------ report


def summary(r: dict) -> str:
    keep = ("started", "startup_s", "rss_after_start_mb", "rss_mb", "routes_on_full_index", "time_to_route_s",
            "index_blocks", "failure")
    d = r.get("decision", {})
    return json.dumps({**{k: r[k] for k in keep if k in r},
                       **({"decision_p50_us": d.get("p50_us"), "decision_p99_us": d.get("p99_us"),
                           "fully_matched": f"{d.get('fully_matched')}/{d.get('probes')}"} if d else {})})


def verify(results: dict) -> dict[str, Any]:
    """Every reported number must come from real work: decisions fully matched on the pod
    holding the prefix (headers, `kvroute.blocks.matched` and histogram samples agree), the
    indexer holding every entry sent, load requests all answered. Returns the checks made and
    the ones that failed (a failed check makes the run exit non-zero)."""
    checks: list[tuple[str, bool]] = []
    for n, by_mode in results["fleets"].items():
        for mode, runs in by_mode.items():
            for c, r in runs.items():
                if not c.startswith("c") or not isinstance(r, dict):
                    continue
                where = f"{mode} N={n} {c}"
                checks.append((f"{where}: Envoy started", r.get("started") is True))
                if mode == "precise" and r.get("started"):
                    checks.append((f"{where}: routed on the full index", r.get("routes_on_full_index") is True))
                d = r.get("decision")
                if d:
                    checks.append((f"{where}: every probe fully matched on its pod", d["fully_matched"] == d["probes"]))
                    checks.append((f"{where}: one decision_us sample per probe", d["samples"] == d["probes"]))
                    checks.append((f"{where}: kvroute.blocks.matched grew by the headers' matched blocks",
                                   d["blocks_matched_counter"] == d["blocks_matched_header"] > 0))
                for size, cpu in r.get("cpu", {}).items():
                    checks.append((f"{where}: {size} load all answered 200",
                                   cpu["failed"] == 0 and cpu["ok"] > 0))
                    checks.append((f"{where}: {size} load routed by kvroute",
                                   cpu.get("index_work", {}).get("blocks_total", 0) > 0))
                    plain = cpu.get("without_kvroute")
                    if plain is not None:
                        checks.append((f"{where}: {size} Envoy without kvroute answered all 200, every round paired",
                                       plain["failed"] == 0 and plain["ok"] > 0
                                       and len(cpu.get("added_rounds_us", [])) == results.get("cpu_rounds")))
                    if "tokenizer_ok" in cpu:
                        recalled = cpu.get("tokenizer_recalled", 0)
                        checks.append((f"{where}: {size} requests all got token ids (call-out or token memo)",
                                       cpu["tokenizer_failed"] == 0 and cpu["tokenizer_ok"] + recalled >= cpu["ok"]))
                        checks.append((f"{where}: {size} token memo used only when configured",
                                       (recalled > 0) == (results.get("token_memo_bytes", 0) > 0)))
            if mode == "precise" and "fill" in runs:
                fill = runs["fill"]
                checks.append((f"precise N={n}: indexer holds every entry sent",
                               fill["indexed_entries"] == fill["expected_entries"]))
            if mode == "precise" and "feed" in runs:
                f = runs["feed"]
                checks.append((f"precise N={n}: every block event sent reached the poller",
                               f["block_events_polled"] == f["block_events_sent"]))
                checks.append((f"precise N={n}: deltas needed no snapshot and no pod list",
                               f["delta_snapshots"] == 0 and f["answers_with_lists"] == 0))
    failed = [name for name, ok in checks if not ok]
    return {"made": len(checks), "failed": failed}


def machine() -> dict[str, Any]:
    mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1]
    return {"cpus": os.cpu_count(), "mem_gib": round(int(mem) / 2**20, 1), "kernel": platform.release(),
            "python": platform.python_version(), "loadavg_at_start": os.getloadavg()}


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                          text=True).stdout.strip()


def fmt(v: Any, unit: str = "") -> str:
    return "—" if v is None else f"{v}{unit}"


_WASM_LOG = "wasm log kvroute kvroute: "


def cause(failure: list[str]) -> str:
    """The most telling failure line, shortened for a table cell. The VM writes a panic message
    in pieces, one log line each: they are joined back."""
    for pattern in ("memory allocation", "buffer size limit", "unexpected status", "panicked", "exited with"):
        for i, line in enumerate(failure):
            if pattern in line:
                text = line.split(_WASM_LOG)[-1] if _WASM_LOG in line else line.split("] ")[-1]
                for more in failure[i + 1:i + 3]:
                    if _WASM_LOG not in line or _WASM_LOG not in more:
                        break
                    text += more.split(_WASM_LOG)[-1]
                return text.replace("|", "/")[:110]
    return (failure[-1:] or ["?"])[0].split("] ")[-1].replace("|", "/")[:110]


def envoy_readings(results: dict):
    """(pods, mode, concurrency, reading, the fleet's readings by mode) of every Envoy run, in the
    tables' order."""
    for n, by_mode in results["fleets"].items():
        for mode in ("approximate", "precise"):
            for c in results["concurrency"]:
                r = by_mode.get(mode, {}).get(f"c{c}")
                if r is not None:
                    yield n, mode, c, r, by_mode


def render(results: dict) -> str:
    rows = ["| mode | pods | c | Envoy RSS MB | index MB (the singleton's) | start s / routes on full index s |"
            " decision_us p50 / p99 (fully matched / probes) | Envoy CPU µs/req 30 KB / 128 KB: added, paired (without kvroute);"
            " schedstat, 0.1 µs resolution |",
            "|---|---:|---:|---:|---:|---|---|---|"]
    for n, mode, c, r, by_mode in envoy_readings(results):
        if not r.get("started", False):
            rows.append(f"| {mode} | {n} | {c} | Envoy exits at start: `{cause(r.get('failure', []))}` "
                        "| | | | |")
            continue
        d = r.get("decision", {})
        if d:
            dec = f"{fmt(d.get('p50_us'))} / {fmt(d.get('p99_us'))} ({d.get('fully_matched')}/{d.get('probes')})"
        else:
            feed = r.get("feed", {})
            dec = (f"never routed on the index in {results['route_timeout_s']} s (feed ok {feed.get('ok')}, "
                   f"snapshots {feed.get('snapshots')}): `{cause(r.get('failure', []))}`")
        cpu = r.get("cpu", {})
        cpu_s = " / ".join((f"+{cpu[k].get('added_cpu_us_per_request')} "
                            f"({cpu[k].get('without_kvroute_cpu_us_per_request')})")
                           if "added_cpu_us_per_request" in cpu[k]
                           else f"{cpu[k].get('cpu_us_per_request')} (with kvroute, no baseline run)"
                           for k in ("30KB", "128KB") if k in cpu) or "—"
        rss = r.get("rss_after_start_mb", r.get("rss_mb"))
        index_mb = round(r["index_bytes"] / 2**20, 1) if r.get("index_bytes") else "—"
        when = (f"{r.get('startup_s')}" if mode == "approximate" else
                f"{r.get('startup_s')} / {fmt(r.get('time_to_route_s'))}")
        rows.append(f"| {mode} | {n} | {c} | {rss} | {index_mb} | {when} | {dec} | {cpu_s} |")
    feed = ["| pods | indexed / expected entries | indexer RSS MB (B/entry) | snapshot bytes in pages (largest page) |"
            " idle poll bytes | churn blocks/s sent (per pod) | delta B/s measured | B per block event (all in) |"
            " delta B/s per poller at 200+200 blocks/s/pod |",
            "|---:|---|---|---|---:|---|---:|---:|---|"]
    for n, by_mode in results["fleets"].items():
        p = by_mode.get("precise")
        if not p or "feed" not in p:
            continue
        f, fl = p["feed"], p["fill"]
        extrapolated = " (extrapolated)" if f["extrapolated"] else " (measured rate)"
        feed.append(f"| {n} | {fl['indexed_entries']} / {fl['expected_entries']} |"
                    f" {fl['indexer_rss_mb']} ({fl['indexer_rss_bytes_per_entry']}) | {f['snapshot_bytes']} in"
                    f" {f['snapshot_pages']} ({f['snapshot_largest_page_bytes']}) |"
                    f" {f['idle_poll_bytes']} | {f['block_events_per_s']} ({f['churn_blocks_per_pod_s']}+"
                    f"{f['churn_blocks_per_pod_s']}) | {f['delta_bytes_per_s']} | {f['bytes_per_block_event']}"
                    f" ({f['bytes_per_block_event_all_in']}) | {f['delta_bytes_per_s_at_200_per_pod']}{extrapolated} |")
    writer = ["| mode | pods | c | snapshot loaded and published s | main thread CPU s until then:"
              " all / feed answers decoded and applied / index flushes | the singleton's wasm memory MB |"
              " Envoy main thread µs/req 30 KB / 128 KB |"
              " buckets read back 30 KB / 128 KB | blocks not re-taught / prompt blocks, 30 KB / 128 KB |",
              "|---|---:|---:|---|---|---|---|---|---|"]
    for n, mode, c, r, by_mode in envoy_readings(results):
        if not r.get("cpu"):
            continue
        split = r.get("singleton_s_to_load", {})
        load_cpu = (f"{fmt(r.get('main_thread_cpu_s_to_load'))} / {fmt(split.get('feed_apply'))} /"
                    f" {fmt(split.get('index_flush'))}" if mode == "precise" else "—")
        cpu = [r["cpu"][k] for k in ("30KB", "128KB") if k in r["cpu"]]
        work = [x.get("index_work", {}) for x in cpu]
        taught = [f"{fmt(w.get('blocks_already_taught'))} / {fmt(w.get('blocks_total'))}" for w in work]
        writer.append(
            f"| {mode} | {n} | {c} | {fmt(r.get('snapshot_loaded_s')) if mode == 'precise' else '—'} |"
            f" {load_cpu} | {fmt(r.get('writer_memory_mb')) if mode == 'precise' else '—'} |"
            f" {' / '.join(fmt(x.get('main_thread_cpu_us_per_request')) for x in cpu)} |"
            f" {' / '.join(fmt(w.get('read_back')) for w in work)} |"
            f" {' / '.join(taught)} |")
    cpu_rows = ["| mode | pods | c | body | Envoy CPU µs/req | without kvroute | added: median of the paired rounds"
                " (lowest to highest) | of which the idle Envoy's"
                " (µs/s × s / req) | main thread | new upstream connections: pods / tokenizer (without kvroute) | token ids: call-out / memo |"
                " workers' index reads per request: from shared data / kept copies |",
                "|---|---:|---:|---|---:|---:|---:|---|---:|---|---|---|"]
    for n, mode, c, r, by_mode in envoy_readings(results):
        if not r.get("cpu"):
            continue
        for size, x in r["cpu"].items():
            opened = x.get("upstream_connections_opened", {})
            base = x.get("without_kvroute", {}).get("upstream_connections_opened", {})
            rounds = x.get("added_rounds_us")
            spread = f" ({fmt(min(rounds))} to {fmt(max(rounds))})" if rounds else ""
            cpu_rows.append(
                f"| {mode} | {n} | {c} | {size} | {fmt(x.get('cpu_us_per_request'))} |"
                f" {fmt(x.get('without_kvroute_cpu_us_per_request'))} | {fmt(x.get('added_cpu_us_per_request'))}{spread} |"
                f" {fmt(x.get('idle_cpu_us_per_request'))} ({fmt(x.get('idle_cpu_us_per_s'))} × {x.get('seconds')}"
                f" / {x.get('ok')}) | {fmt(x.get('main_thread_cpu_us_per_request'))} |"
                f" {opened.get('vllm', 0)} / {opened.get('vllm_tokenizer', 0)} ({base.get('vllm', '—')}) |"
                f" {x.get('tokenizer_ok', '—')} / {x.get('tokenizer_recalled', '—')} |"
                f" {per_request(x, 'lookup_reads')} / {per_request(x, 'lookup_reused')} |")
    memory = ["| mode | pods | c | when | Envoy RSS MB | tcmalloc allocated MB | held free: pageheap_free +"
              " thread caches MB | returned (pageheap_unmapped) MB | resident outside tcmalloc (V8, VMs' wasm"
              " memory, binary) MB | the singleton's wasm memory MB |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    for n, mode, c, r, by_mode in envoy_readings(results):
        readings = ([("after start", "rss_after_start_mb", "memory_after_start"),
                     ("after the probes", "rss_after_probes_mb", "memory_after_probes")]
                    if mode == "approximate" else [("index loaded and published", "rss_mb", "memory"),
                                            (f"after the probes, CPU readings and {r.get('settle_s', 0):g} s idle", "rss_end_mb", "memory_end")])
        for when, rss_key, mem_key in readings:
            m = r.get(mem_key)
            if not m:
                continue
            held = round(m["pageheap_free"] + m["total_thread_cache"], 1)
            outside = round(r[rss_key] - (m["heap_size"] - m["pageheap_unmapped"]), 1)
            memory.append(f"| {mode} | {n} | {c} | {when} | {r[rss_key]} | {m['allocated']} | {held} |"
                          f" {m['pageheap_unmapped']} | {outside} |"
                          f" {fmt(r.get('writer_memory_mb')) if mode == 'precise' else '—'} |")
    return "\n".join(rows) + "\n\nEnvoy CPU per request (schedstat, 0.1 µs resolution):\n\n" + \
        "\n".join(cpu_rows) + "\n\nEnvoy's memory (RSS and admin `GET /memory`, read together):\n\n" + \
        "\n".join(memory) + "\n\nPrecise-mode feed (kvroute-indexer filled to 70 % by synthetic KV events):\n\n" + \
        "\n".join(feed) + "\n\nThe index writer (the singleton, Envoy's main thread) during the CPU readings:\n\n" + \
        "\n".join(writer) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 and 100 pods, fewer requests: a few minutes")
    ap.add_argument("--pods", default=None, help="comma list of fleet sizes (default 8,100,1000; quick 8,100)")
    ap.add_argument("--approximate-only-pods", default=None,
                    help="fleet sizes run in approximate mode at --concurrency 2 only (default 5000; quick none)")
    ap.add_argument("--concurrency", default="2,8")
    ap.add_argument("--probes", type=int, default=None, help="fully cached decisions measured per Envoy")
    ap.add_argument("--cpu-seconds", type=int, default=None,
                    help="seconds of load per round of a CPU reading, for each Envoy (default 2; quick 1)")
    ap.add_argument("--cpu-rounds", type=int, default=5,
                    help="rounds per CPU reading: each reads kvroute's Envoy and the one without, alternated,"
                         " and the added CPU is the median of the rounds' differences")
    ap.add_argument("--connections", type=int, default=4, help="wrk's keep-alive connections in the CPU readings")
    ap.add_argument("--churn-seconds", type=float, default=None)
    ap.add_argument("--max-churn-blocks-s", type=int, default=20_000,
                    help="cap on generated stored blocks/s over the fleet (above: a lower per-pod rate, extrapolated)")
    ap.add_argument("--precise-only", action="store_true",
                    help="skip approximate mode for the --pods fleets")
    ap.add_argument("--no-envoy", action="store_true",
                    help="precise mode: fill the indexer and measure the feed only, start no Envoy")
    ap.add_argument("--settle-seconds", type=float, default=0,
                    help="precise mode: idle this long after the CPU readings before the last RSS reading")
    ap.add_argument("--startup-timeout", type=float, default=180)
    ap.add_argument("--route-timeout", type=float, default=60)
    ap.add_argument("--token-memo-bytes", type=int, default=PLUGIN_MEMO_BYTES,
                    help="precise mode: the workers' tokenizer.memo_bytes (default: the plugin's, "
                         f"{PLUGIN_MEMO_BYTES}; "
                         "0: every chat request makes the call-out)")
    ap.add_argument("--results-dir", default=None)
    args = ap.parse_args()
    wrk.require()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    sizes = [int(n) for n in (args.pods or ("8,100" if args.quick else "8,100,1000")).split(",")]
    big = [int(n) for n in (args.approximate_only_pods if args.approximate_only_pods is not None
                            else ("" if args.quick else "5000")).split(",") if n]
    # p99 of 400 decisions rests on the 4 slowest; of 100 (three runs at 1,000 pods read 290,
    # 680 and 990 us where 400 read 160 and 200) on the one or two a preemption hit.
    args.probes = args.probes or (100 if args.quick else 400)
    args.cpu_seconds = args.cpu_seconds or (1 if args.quick else 2)
    args.churn_seconds = args.churn_seconds or (5 if args.quick else 10)
    stamp = dt.datetime.now(dt.timezone.utc)
    out = Path(args.results_dir or REPO / "build" / "bench-scale" / stamp.strftime("%Y%m%dT%H%M%SZ"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"commit": git_commit(), "started": stamp.isoformat(timespec="seconds"),
                               "argv": sys.argv[1:], "machine": machine(), "capacity_blocks": CAPACITY_BLOCKS,
                               "fill": FILL, "sequence_blocks": SEQUENCE_BLOCKS, "concurrency": args.concurrency,
                               "route_timeout_s": args.route_timeout, "cpu_seconds_per_round": args.cpu_seconds,
                               "cpu_rounds": args.cpu_rounds,
                               "cpu_load": {"generator": "wrk " + " ".join(wrk.version()), "threads": 1,
                                            "connections": args.connections},
                               "token_memo_bytes": args.token_memo_bytes,
                               "fleets": {}}
    log(f"Envoy CPU per request: on-CPU ns of its threads (schedstat) over {args.cpu_rounds} rounds of "
        f"{args.cpu_seconds} s of wrk load on {args.connections} connections, reported to 0.1 µs")
    t0 = time.monotonic()
    for n in sizes + big:
        runs: dict[str, Any] = {"approximate": {}}
        results["fleets"][str(n)] = runs
        with StubFleet(n) as fleet:
            for c in ([] if args.precise_only and n not in big else [2] if n in big else args.concurrency):
                log(f"approximate N={n} c{c}")
                runs["approximate"][f"c{c}"] = approximate(fleet, c, args)
                log(f"approximate N={n} c{c}: {summary(runs['approximate'][f'c{c}'])}")
            if n not in big:
                runs["precise"] = precise(fleet, args)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    results["seconds"] = round(time.monotonic() - t0)
    results["checks"] = verify(results)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = render(results)
    (out / "table.md").write_text(table)
    print(table)
    checks = results["checks"]
    log(f"{checks['made'] - len(checks['failed'])}/{checks['made']} checks passed"
        + "".join(f"\n  FAILED: {name}" for name in checks["failed"]))
    log(f"results in {out} ({results['seconds']} s)")
    if checks["failed"]:
        sys.exit(1)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "stub-pods":
        asyncio.run(_stub_pods(int(sys.argv[2]), Path(sys.argv[3])))
    else:
        main()
