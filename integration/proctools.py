"""Process plumbing shared by the harnesses (simcluster, envoyctl, indexerctl): free ports,
workspace binaries, readiness waits, and stopping a process by its PID. Standard library only,
so it runs in the test venv (3.11) and the benchmark venv (3.12)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
