"""Small process helpers for the benchmark: free ports, HTTP waits, processes stopped by PID."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Dict, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from proctools import free_port  # noqa: E402


def free_ports(n: int) -> List[int]:
    """n distinct free ports, from the picker the tests use (integration/proctools.py): below the
    kernel's ephemeral range, so no outgoing connection takes one before its server binds it."""
    return [free_port() for _ in range(n)]


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def http_post(url: str, body: bytes = b"", timeout: float = 5.0, headers: Optional[Dict[str, str]] = None) -> tuple[int, str]:
    req = urllib.request.Request(url, data=body, method="POST", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")


def wait_http_ok(url: str, timeout: float, proc: Optional["Proc"] = None, ok=lambda code, body: code == 200) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.poll()} before {url} was ready; log: {proc.log_path}\n{proc.tail()}")
        try:
            code, body = http_get(url, timeout=2.0)
            if ok(code, body):
                return
            last = f"{code} {body[:200]}"
        except Exception as e:  # not up yet
            last = str(e)
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout:.0f}s (last: {last})")


class Proc:
    """A child process in its own session, logged to a file, stopped by its PID (and its group)."""

    def __init__(self, name: str, argv: List[str], log_path: str, env: Optional[Dict[str, str]] = None, cwd: Optional[str] = None):
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=cwd,
        )
        self.pid = self.p.pid

    def poll(self) -> Optional[int]:
        return self.p.poll()

    def tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return b"\n".join(fh.read().splitlines()[-n:]).decode("utf-8", "replace")
        except OSError:
            return ""

    def wait(self, timeout: Optional[float] = None) -> Optional[int]:
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace: float = 10.0) -> None:
        if self.p.poll() is None:
            for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(self.pid, sig)  # the group this child leads (start_new_session)
                except ProcessLookupError:
                    break
                try:
                    self.p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._log.close()

    def cpu_seconds(self) -> Optional[float]:
        """utime+stime of this process (and reaped children) from /proc, seconds."""
        return proc_cpu_seconds(self.pid)

    def __enter__(self) -> "Proc":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def proc_cpu_seconds(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    # fields[11]=utime, [12]=stime, [13]=cutime, [14]=cstime (after pid and comm)
    ticks = sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> Optional[float]:
    """CPU seconds of pid plus its live descendants (for routers that fork helpers)."""
    total = proc_cpu_seconds(pid)
    if total is None:
        return None
    try:
        kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        kids = []
    for k in kids:
        c = tree_cpu_seconds(int(k))
        if c:
            total += c
    return total
