"""Run the real kvroute-indexer for tests, benchmarks and demos.

    with IndexerProcess(["127.0.0.1:P1", ...], "--scrape-interval-ms=200") as idx:
        idx.address        # "127.0.0.1:H", for the Envoy cluster kvroute_indexer
        idx.zmq_endpoint   # "tcp://127.0.0.1:Z": vllm-sim --kv-events-endpoint (pods connect)
        idx.blocks("127.0.0.1:P1"), idx.metric("kvroute_indexer_seq_gaps_total")

`pods` become `--pod ADDRESS@MODEL` flags; any other flag is passed as given. Ports are free
ones chosen at construction and kept across stop()/start(), so a test can kill the indexer and
bring it back where the proxies expect it.

Learned writes need a bearer token: the indexer gets `--learned-token-file` holding
LEARNED_TOKEN, which is this process's $KVROUTE_INDEXER_TOKEN (generated when unset). Envoy
started from this process inherits the variable, and envoy/gateway-precise.yaml hands it to the
singleton VM (host_env_keys, plugin field indexer.token_env). `learned_token=None` starts an
indexer without a token (learned writes refused), or pass your own token. The binary is $KVROUTE_INDEXER_BIN, else
target/release/kvroute-indexer (built with cargo when missing). The process runs in its own
session and is stopped by its PID. Standard library only.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proctools import REPO, ManagedProcess, free_port, http_ok, stop_pid, wait_ready, workspace_binary  # noqa: E402

MODEL = "Qwen/Qwen3-32B"
TOKEN_ENV = "KVROUTE_INDEXER_TOKEN"
LEARNED_TOKEN = os.environ.setdefault(TOKEN_ENV, secrets.token_hex(32))


def indexer_binary() -> Path:
    return workspace_binary("KVROUTE_INDEXER_BIN", "kvroute-indexer")


class IndexerProcess(ManagedProcess):
    def __init__(self, pods: list[str] = (), *flags: str, model: str = MODEL, bind: bool = True,
                 zmq_port: int | None = None, startup_timeout: float = 30.0,
                 learned_token: str | None = LEARNED_TOKEN):
        self.pods = list(pods)
        self.flags = list(flags)
        self.learned_token = learned_token
        self.model = model
        self.bind = bind
        self.startup_timeout = startup_timeout
        self.http_port = free_port()
        self.zmq_port = zmq_port or free_port()
        self.proc: subprocess.Popen | None = None
        fd, name = tempfile.mkstemp(prefix="kvroute-indexer-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self.token_path: Path | None = None
        if learned_token is not None:
            fd, name = tempfile.mkstemp(prefix="kvroute-indexer-", suffix=".token")  # mode 0600
            with os.fdopen(fd, "w") as f:
                f.write(learned_token + "\n")
            self.token_path = Path(name)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    @property
    def zmq_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    def argv(self) -> list[str]:
        argv = [str(indexer_binary()), f"--listen={self.address}",
                f"--zmq-bind={self.zmq_endpoint if self.bind else 'none'}"]
        if self.token_path:
            argv.append(f"--learned-token-file={self.token_path}")
        return argv + [f"--pod={p}@{self.model}" for p in self.pods] + self.flags

    def start(self) -> "IndexerProcess":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), cwd=REPO, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(self.proc, self.healthy, self.startup_timeout, "kvroute-indexer", self.log_tail)
        except RuntimeError:
            self.stop()
            raise
        return self

    def healthy(self) -> bool:
        return http_ok(self.url + "/healthz")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_pid(self.proc, sig)

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log_path.unlink(missing_ok=True)
        if self.token_path:
            self.token_path.unlink(missing_ok=True)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return r.read()

    def post(self, path: str, body: bytes, token: str | None = None) -> tuple[int, bytes]:
        """POST with `authorization: Bearer <token>` when a token is given."""
        headers = {"authorization": f"Bearer {token}"} if token is not None else {}
        req = urllib.request.Request(self.url + path, data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def pods_debug(self) -> dict[str, dict]:
        """GET /v1/debug/pods, keyed by pod address."""
        return {p["address"]: p for p in json.loads(self.get("/v1/debug/pods"))}

    def blocks(self, address: str) -> int:
        return self.pods_debug().get(address, {}).get("blocks", 0)

    def metrics_text(self) -> str:
        return self.get("/metrics").decode()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels` (0 when absent)."""
        total = 0.0
        for line in self.metrics_text().splitlines():
            if line.startswith("#") or not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            metric, _, lab = head.partition("{")
            if metric == name and all(f'{k}="{v}"' in lab for k, v in labels.items()):
                total += float(value)
        return total

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0
