"""The scale benchmark's results checked (every reading measured what it claims) and rendered
as table.md."""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from envoy_meter import per_request

REPO = Path(__file__).resolve().parent.parent.parent

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
