"""Local cluster of simulated vLLM pods (integration/vllm-sim), for tests, `make run` and the benchmark.

    with SimCluster(pods=4, time_scale=0.1, kv_events_endpoint="tcp://127.0.0.1:5557") as c:
        c.addresses   # ["127.0.0.1:P", ...]  (pod identities, as in x-vllm-sim-pod)
        c.urls        # ["http://127.0.0.1:P", ...]
        c.topics      # KV-event topics, "kv@127.0.0.1:P@<model>"

Every keyword option becomes the binary's `--flag value` (underscores to dashes; lists repeat the
values; None is left out), e.g. num_gpu_blocks=2000 (or a list, one capacity per pod), max_num_seqs=64, tokenizer=PATH,
served_model_name=["a", "b"]. A mixed fleet: speed=[1, 1, 0.5, 0.5] with num_gpu_blocks=[3072, 3072, 2304, 2304]
(one relative speed and one capacity per pod; `.speeds`, `.capacities`). `kv_events_replay=True` picks free replay ports
(`.replay_ports`); env={...} adds environment variables (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="0": 32-byte
hashes, as vLLM). Ports are chosen free at run time; the process runs in its own session and is
stopped by its PID. The binary is $KVROUTE_SIM_BIN, else target/release/vllm-sim, built with
`cargo build --release -p vllm-sim` when missing.

`PodFleet(pods=N, **opts)`: the same pods, one process each, so that `restart(i)` can kill pod i and start it
again on its address (the benchmark's `restart` profile).

Standard library only, so it runs in the test venv (3.11) and the benchmark venv (3.12).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from proctools import ManagedProcess, free_port, free_port_range, stop_pid, workspace_binary  # noqa: E402,F401  (free ports re-exported)

REPO = Path(__file__).resolve().parent.parent

# Offline tokenizer shipped inside the PyPI litellm wheel (see docs/benchmark-method.md).
LITELLM_VERSION = "1.110.2"
TOKENIZER_MEMBER = "litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json"
TOKENIZER_PATH = REPO / "build" / "tokenizers" / "deepseek_tokenizer.json"


def sim_binary() -> Path:
    """Path of the vllm-sim binary ($KVROUTE_SIM_BIN or target/release/vllm-sim, built when
    missing or older than its sources)."""
    return workspace_binary("KVROUTE_SIM_BIN", "vllm-sim", rebuild_if=_stale)


def _stale(binary: Path) -> bool:
    """True when a source of vllm-sim is newer than the binary (so a checkout never runs an old build)."""
    src = REPO / "integration" / "vllm-sim"
    built = binary.stat().st_mtime
    return any(p.stat().st_mtime > built for p in [src / "Cargo.toml", *src.glob("src/**/*.rs")])


def ensure_tokenizer() -> Path:
    """The DeepSeek tokenizer.json from the litellm wheel (pip download, no install), cached in build/."""
    if TOKENIZER_PATH.is_file():
        return TOKENIZER_PATH
    TOKENIZER_PATH.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "-d", d, f"litellm=={LITELLM_VERSION}"], check=True, stdin=subprocess.DEVNULL)
        wheels = list(Path(d).glob("litellm-*.whl"))
        if not wheels:
            raise FileNotFoundError("pip download litellm produced no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            data = z.read(TOKENIZER_MEMBER)
    tmp = TOKENIZER_PATH.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(TOKENIZER_PATH)
    return TOKENIZER_PATH


class SimCluster(ManagedProcess):
    def __init__(self, pods: int = 1, *, host: str = "127.0.0.1", startup_timeout: float = 60.0,
                 kv_events_replay: bool = False, env: dict[str, str] | None = None,
                 port: int | None = None, **opts):
        """`port`: the first pod's port (a restarted pod keeps its address); free ones when unset."""
        self.pods = pods
        self.host = host
        self.startup_timeout = startup_timeout
        self.kv_events_replay = kv_events_replay
        self.opts = dict(opts)
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.fixed_port = port
        self.port = 0
        self.replay_port: int | None = None
        self.log_path: Path | None = None
        self._log = None

    # ---------------------------------------------------------------- identity
    @property
    def ports(self) -> list[int]:
        return [self.port + i for i in range(self.pods)]

    @property
    def addresses(self) -> list[str]:
        return [f"{self.host}:{p}" for p in self.ports]

    @property
    def urls(self) -> list[str]:
        return [f"http://{a}" for a in self.addresses]

    @property
    def replay_ports(self) -> list[int]:
        return [self.replay_port + i for i in range(self.pods)] if self.replay_port else []

    @property
    def capacities(self) -> list[int]:
        """KV blocks of each pod (num_gpu_blocks: one value for all, or a list with one per pod)."""
        v = self.opts.get("num_gpu_blocks", 19208)
        if isinstance(v, (list, tuple)):
            return [int(x) for x in v] if len(v) == self.pods else [int(v[0])] * self.pods
        return [int(v)] * self.pods

    @property
    def speeds(self) -> list[float]:
        """Relative speed of each pod (speed: one value for all, or a list with one per pod; default 1)."""
        v = self.opts.get("speed", 1.0)
        if isinstance(v, (list, tuple)):
            return [float(x) for x in v] if len(v) == self.pods else [float(v[0])] * self.pods
        return [float(v)] * self.pods

    @property
    def model(self) -> str:
        names = self.opts.get("served_model_name")
        if names:
            return names[0] if isinstance(names, (list, tuple)) else names
        return self.opts.get("model", "Qwen/Qwen3-32B")

    @property
    def topics(self) -> list[str]:
        tmpl = self.opts.get("kv_events_topic_template", "kv@{host}:{port}@{model}")
        return [tmpl.replace("{host}", self.host).replace("{port}", str(p)).replace("{model}", self.model)
                for p in self.ports]

    # ---------------------------------------------------------------- lifecycle
    def _argv(self) -> list[str]:
        argv = [str(sim_binary()), "--host", self.host, "--port", str(self.port), "--pods", str(self.pods)]
        if self.replay_port:
            argv += ["--kv-events-replay-port", str(self.replay_port)]
        for k, v in self.opts.items():
            if v is None:
                continue
            flag = "--" + k.replace("_", "-")
            if isinstance(v, (list, tuple)):
                argv += [flag, *[str(x) for x in v]]
            else:
                argv += [flag, str(v)]
        return argv

    def start(self) -> "SimCluster":
        self.port = self.fixed_port or free_port_range(self.pods, self.host)
        if self.kv_events_replay:
            self.replay_port = free_port_range(self.pods, self.host)
        argv = self._argv()
        fd, name = tempfile.mkstemp(prefix="vllm-sim-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **self.env})
        deadline = time.monotonic() + self.startup_timeout
        pending = list(self.urls)
        while pending:
            if self.proc.poll() is not None:
                log = self.log_text()
                self.stop()
                raise RuntimeError(f"vllm-sim exited with {self.proc.returncode}: {log}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"vllm-sim pods not healthy: {pending}")
            try:
                with urllib.request.urlopen(pending[0] + "/health", timeout=2) as r:
                    if r.status == 200:
                        pending.pop(0)
                        continue
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        stop_pid(self.proc, grace=5)
        if self._log:
            self._log.close()
            self._log = None

    def __exit__(self, *exc) -> None:
        self.stop()
        if self.log_path:
            try:
                self.log_path.unlink()
            except OSError:
                pass

    # ---------------------------------------------------------------- helpers
    def flush(self) -> None:
        """POST /admin/flush on every pod: cold caches (AllBlocksCleared) and zeroed counters."""
        for u in self.urls:
            req = urllib.request.Request(u + "/admin/flush", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()

    def metrics_text(self, i: int) -> str:
        with urllib.request.urlopen(self.urls[i] + "/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, i: int, name: str) -> float:
        """Value of an unlabelled-by-us sample (first line starting with `name{` or `name `)."""
        for line in self.metrics_text(i).splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def cpu_seconds(self) -> float:
        """User + system CPU seconds the simulator process has used so far (Linux /proc)."""
        if not self.proc:
            return 0.0
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks


def pod_kv_events_endpoint(endpoint: str | None, i: int) -> str | None:
    """The KV-event endpoint pod i of one multi-pod vllm-sim process uses (vllm-sim's events::pod_endpoint):
    a binding endpoint gets `path-i` (ipc) or port + i (tcp); a connecting one is shared."""
    if not endpoint or i == 0:
        return endpoint
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-{i}"
    if "*" in endpoint or "::" in endpoint:
        head, _, port = endpoint.rpartition(":")
        if port.isdigit():
            return f"{head}:{int(port) + i}"
    return endpoint


class PodFleet:
    """The pods of SimCluster(pods=N, **opts), each in its own vllm-sim process, so that one can be killed and
    started again on the same address (`restart`): a restarted pod has an empty KV cache, zeroed counters and
    no queue, as a restarted vLLM. Per-pod options (num_gpu_blocks, speed lists) go to their pod; pod i's
    KV-event endpoint is the one pod i of a single process would use (pod_kv_events_endpoint), so
    subscribers, which reconnect by themselves, get the restarted pod's events on the same endpoint."""

    def __init__(self, pods: int = 1, *, host: str = "127.0.0.1", startup_timeout: float = 60.0,
                 env: dict[str, str] | None = None, **opts):
        self.pods = pods
        self.host = host
        self.startup_timeout = startup_timeout
        self.env = env
        self.opts = dict(opts)
        self.members: list[SimCluster] = []
        self.restarts: list[dict] = []
        self._logs: list[str] = []  # logs of the processes a restart replaced
        self._cpu_gone = 0.0  # CPU seconds of those processes

    def _pod_opts(self, i: int) -> dict:
        opts = dict(self.opts)
        for key in ("num_gpu_blocks", "speed"):
            v = opts.get(key)
            if isinstance(v, (list, tuple)):
                opts[key] = v[i] if len(v) == self.pods else v[0]
        opts["kv_events_endpoint"] = pod_kv_events_endpoint(opts.get("kv_events_endpoint"), i)
        return opts

    @property
    def addresses(self) -> list[str]:
        return [a for m in self.members for a in m.addresses]

    @property
    def urls(self) -> list[str]:
        return [f"http://{a}" for a in self.addresses]

    def _argv(self) -> list[list[str]]:
        """One argv per pod process."""
        return [m._argv() for m in self.members]

    def start(self) -> "PodFleet":
        base = free_port_range(self.pods, self.host)
        try:
            for i in range(self.pods):
                m = SimCluster(pods=1, host=self.host, startup_timeout=self.startup_timeout, env=self.env,
                               port=base + i, **self._pod_opts(i))
                self.members.append(m)
                m.start()
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, i: int, down_seconds: float = 0.0) -> dict:
        """Kill pod i's process (SIGKILL: a crash, nothing flushed or announced), wait `down_seconds` (wall), start it
        again on its address with the same options. Returns wall (time.time) and monotonic times of both ends."""
        killed = self.kill(i)
        time.sleep(down_seconds)
        return self.start_again(i, killed)

    def kill(self, i: int) -> dict:
        """Kill pod i's process (SIGKILL); returns the wall and monotonic times of the kill."""
        m = self.members[i]
        self._cpu_gone += m.cpu_seconds() if m.proc and m.proc.poll() is None else 0.0
        killed = {"wall": time.time(), "mono": time.monotonic()}
        stop_pid(m.proc, sig=signal.SIGKILL, grace=5)
        m.stop()
        self._logs.append(f"--- pod {m.addresses[0]} (until its restart) ---\n{m.log_text()}")
        self._remove_log(m)
        endpoint = m.opts.get("kv_events_endpoint")
        if endpoint and endpoint.startswith("ipc://"):
            # The killed process leaves its socket file behind, and vllm-sim does not bind over one.
            Path(endpoint[len("ipc://"):]).unlink(missing_ok=True)
        return killed

    def start_again(self, i: int, killed: dict) -> dict:
        """Start killed pod i again on its address, empty; records and returns the restart."""
        m = self.members[i]
        m.start()
        up = {"wall": time.time(), "mono": time.monotonic()}
        record = {"pod": m.addresses[0], "index": i, "killed": killed, "up": up, "pid": m.pid}
        self.restarts.append(record)
        return record

    def log_text(self) -> str:
        return "\n".join(self._logs + [f"--- pod {m.addresses[0]} ---\n{m.log_text()}" for m in self.members])

    def cpu_seconds(self) -> float:
        return self._cpu_gone + sum(m.cpu_seconds() for m in self.members if m.proc and m.proc.poll() is None)

    @staticmethod
    def _remove_log(m: SimCluster) -> None:
        if m.log_path:
            m.log_path.unlink(missing_ok=True)

    def stop(self) -> None:
        for m in self.members:
            m.stop()
            self._remove_log(m)

    def __enter__(self) -> "PodFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """`python integration/simcluster.py --pods 8 [--opt key=value ...]`: run a cluster until Ctrl-C / SIGTERM."""
    import argparse

    ap = argparse.ArgumentParser(description="Run simulated vLLM pods until interrupted; prints their addresses.")
    ap.add_argument("--pods", type=int, default=8)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--replay", action="store_true", help="open KV-event replay sockets")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                    help="any vllm-sim flag, e.g. num_gpu_blocks=19208, kv_events_endpoint=tcp://127.0.0.1:5557")
    a = ap.parse_args(argv)
    opts = {}
    for kv in a.opt:
        k, _, v = kv.partition("=")
        opts[k.replace("-", "_")] = v
    stop = {"now": False}

    def on_term(*_):
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_term)
    with SimCluster(pods=a.pods, host=a.host, kv_events_replay=a.replay, **opts) as c:
        print(json.dumps({"pid": c.pid, "addresses": c.addresses, "topics": c.topics, "replay_ports": c.replay_ports}),
              flush=True)
        try:
            while not stop["now"] and c.proc and c.proc.poll() is None:
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
