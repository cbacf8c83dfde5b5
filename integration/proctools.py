"""Process plumbing shared by the harnesses (simcluster, envoyctl, indexerctl): free ports,
workspace binaries, readiness waits, stopping a process by its PID, and the base of their process
classes. Standard library only, so it runs in the test venv (3.11) and the benchmark venv (3.12)."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent


# Ports are handed out below the kernel's ephemeral range: a port the kernel picks for bind(0) is
# also where it picks the source ports of outgoing connections, so between our choosing it and a
# server binding it, any client (Envoy dialling an upstream, a test's HTTP call) could take it.
_LISTEN_PORTS_LOW = 10000
_handed_out: set[int] = set()
_rng = random.Random()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _port_free(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port_range(n: int, host: str = "127.0.0.1") -> int:
    """First of n consecutive ports, free now and never handed out before by this process, chosen at
    random below the ephemeral range (so outgoing connections cannot take them before the server binds)."""
    high = max(_ephemeral_low(), _LISTEN_PORTS_LOW + 1000)
    for _ in range(1000):
        base = _rng.randrange(_LISTEN_PORTS_LOW, high - n)
        ports = range(base, base + n)
        if any(p in _handed_out for p in ports):
            continue
        if all(_port_free(p, host) for p in ports):
            _handed_out.update(ports)
            return base
    raise RuntimeError(f"no {n} consecutive free ports found in {_LISTEN_PORTS_LOW}..{high}")


def free_port() -> int:
    """One port, as free_port_range(1)."""
    return free_port_range(1)


def workspace_binary(env_var: str, package: str, binary: str | None = None,
                     rebuild_if: Callable[[Path], bool] = lambda _: False) -> Path:
    """$env_var when set (it must exist), else target/release/<binary>, built with
    `cargo build --release -p <package>` when missing (or when `rebuild_if` says so)."""
    override = os.environ.get(env_var)
    if override:
        path = Path(override)
        if not path.is_file():
            raise FileNotFoundError(f"{env_var}={override} does not exist")
        return path
    path = REPO / "target" / "release" / (binary or package)
    if not path.is_file() or rebuild_if(path):
        env = dict(os.environ, CARGO_TARGET_DIR=str(REPO / "target"))
        subprocess.run(["cargo", "build", "--release", "-p", package], cwd=REPO, env=env, check=True,
                       stdin=subprocess.DEVNULL)
    return path


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """True when GET url answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, OSError):
        return False


def wait_ready(proc: subprocess.Popen, ready: Callable[[], bool], timeout: float, what: str,
               log_tail: Callable[[], str]) -> None:
    """Polls `ready` until it holds; raises with the log when the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log_tail()}")
        if ready():
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready after {timeout}s:\n{log_tail()}")


def wait_for(cond: Callable[[], Any], timeout: float, interval: float = 0.2) -> Any:
    """Polls `cond` until it returns something true or `timeout` seconds pass; its last value."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(interval)
    return last


def stop_pid(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, grace: float = 10.0) -> None:
    """Stops a process we started, by its PID: `sig`, then SIGKILL after `grace` seconds."""
    if not proc or proc.poll() is not None:
        return
    try:
        os.kill(proc.pid, sig)
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)
    except ProcessLookupError:
        pass


class ManagedProcess:
    """A server process a harness starts, logs to a file and stops by its PID. Subclasses set
    `proc` in `start()` and `log_path` to where the process writes its log."""
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def start(self) -> "ManagedProcess":
        raise NotImplementedError

    def stop(self) -> None:
        stop_pid(self.proc)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace") if self.log_path else ""
        except OSError:
            return ""

    def __enter__(self):
        return self.start()
