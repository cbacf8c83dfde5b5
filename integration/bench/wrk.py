"""wrk, the load generator of the CPU benchmarks (`overhead.py`, `scale.py`): one C thread on
epoll, so the load takes little of the two cores the Envoy under test is read on, where Python
clients take about one."""

from __future__ import annotations

import re
import shutil
import subprocess
from typing import Any

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def duration_seconds(text: str) -> float:
    """wrk's `180.00us`, `2.79ms`, `1.20s` in seconds."""
    m = re.match(r"([\d.]+)(us|ms|s|m)$", text.strip())
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse(out: str) -> dict[str, Any]:
    """wrk's summary: latency percentiles (s), requests answered, requests/s, non-2xx answers,
    socket errors."""
    r: dict[str, Any] = {}
    for pct in ("50", "75", "90", "99"):
        m = re.search(rf"^\s+{pct}%\s+(\S+)", out, re.M)
        if m:
            r[f"p{pct}"] = duration_seconds(m.group(1))
    m = re.search(r"(\d+) requests in ([\d.]+)(\w+)", out)
    if m:
        r["requests"] = int(m.group(1))
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if m:
        r["rps"] = float(m.group(1))
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    r["non2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    r["socket_errors"] = sum(int(x) for x in m.groups()) if m else 0
    return r


def require() -> None:
    if not shutil.which("wrk"):
        raise SystemExit("wrk not found (apt-get install wrk; the make targets of the benchmarks install it)")


def version() -> list[str]:
    return subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split()[1:2]


def run(url: str, script: str, env: dict[str, str], connections: int, duration: int) -> dict[str, Any]:
    """One wrk run of `duration` seconds (a script's `wrk.thread:stop()` does not end it sooner:
    wrk waits out `-d`), one thread, `connections` keep-alive connections: its parsed summary and
    exit code, with the end of its output when it failed."""
    argv = ["wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--latency", "--timeout", "10s", "-s", script, url]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=duration + 60)
    r = parse(p.stdout)
    r["rc"] = p.returncode
    if p.returncode != 0 or "p50" not in r:
        r["stderr"] = (p.stderr or p.stdout)[-500:]
    return r
