"""The synthetic fleet of the scale benchmark: its size (one Qwen3-32B pod's blocks, the fill),
stub pods that answer any request at once (one asyncio process for all of them), the token
sequences each pod holds, and the requests sent to the fleet through Envoy.

    python integration/bench/scale_fleet.py stub-pods N PORTS_FILE     (what StubFleet starts)
"""
from __future__ import annotations

import asyncio
import http.client
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(REPO / "integration"))
sys.path.insert(0, str(REPO / "tests" / "indexer"))

from indexerctl import MODEL  # noqa: E402
from proctools import stop_pid, wait_ready  # noqa: E402

CAPACITY_BLOCKS = 19_208  # one Qwen3-32B pod


FILL = 0.70


BLOCK_SIZE = 16


SEQUENCE_BLOCKS = 512  # an 8k-token prompt


DECISION_HEADER = "x-kvroute-decision"


# Prompt variants of the CPU readings' load: kvroute sends each to one pod.
CPU_VARIANTS = 16


# Token ids stay below 128: one msgpack byte each, short JSON. A sequence's first block names
# its pod and number; the rest is shared text, yet its block hashes differ per sequence
# because every block hash chains from the previous one.
_SHARED_TAIL = [(i * 7) % 120 + 1 for i in range((SEQUENCE_BLOCKS - 1) * BLOCK_SIZE)]


_COMPLETION = json.dumps({"id": "stub", "object": "chat.completion", "model": MODEL, "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}).encode()


def _tokenized(body: bytes) -> bytes:
    """A vLLM-shaped /tokenize answer: one token per 4 bytes of the call's body (the chat's
    messages), taken from those bytes, so different prompts give different token ids."""
    tokens = body[::4]
    return b'{"count":%d,"max_model_len":40960,"tokens":[%s]}' % (len(tokens), ",".join(map(str, tokens)).encode())


_SCRAPES: dict[int, itertools.count] = {}
# The stub-pods process's flag file (_moving_flag): once it exists, their load moves.
_moving: Path | None = None


def _moving_flag(ports_file: Path) -> Path:
    """The file StubFleet.start_moving() creates beside the fleet's ports file."""
    return ports_file.with_name("moving")


def _metrics(port: int) -> bytes:
    """A vLLM-shaped `/metrics` (scale.py's --scrape-interval-ms) of the pod on `port`. Once the
    fleet's load moves, its requests running cycle through 0-7 by its own scrape count, so each
    scrape changes its load and the feed carries a load change; before, they stay 0. The capacity
    is the fleet's, so the pod list itself stays the same."""
    scrapes = _SCRAPES.setdefault(port, itertools.count())
    running = next(scrapes) % 8 if _moving is not None and _moving.exists() else 0
    return (b'vllm:num_requests_running %d\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0.5\n'
            b'vllm:cache_config_info{num_gpu_blocks="%d"} 1\n' % (running, CAPACITY_BLOCKS))


async def _serve_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """HTTP/1.1 keep-alive: `POST /tokenize` gets token ids, `GET /metrics` a moving load, any
    other request the completion (bodies read by content-length)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = await reader.readexactly(length) if length else b""
            path = head.split(b" ", 2)[1]
            if path == b"/tokenize":
                answer = _tokenized(body)
            elif path == b"/metrics":
                answer = _metrics(writer.get_extra_info("sockname")[1])
            else:
                answer = _COMPLETION
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                         % (len(answer), answer))
            await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, ValueError, IndexError):
        pass
    finally:
        writer.close()


async def _stub_pods(count: int, ports_file: Path) -> None:
    global _moving
    _moving = _moving_flag(ports_file)
    servers = [await asyncio.start_server(_serve_http, "127.0.0.1", 0, limit=1 << 20) for _ in range(count)]
    ports = [s.sockets[0].getsockname()[1] for s in servers]
    tmp = ports_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(ports))
    tmp.rename(ports_file)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


class StubFleet:
    """N stub pods in one child process; `addresses` are their 127.0.0.1:PORT."""

    def __init__(self, count: int):
        self.count = count
        self._dir = tempfile.mkdtemp(prefix="kvroute-scale-")
        self.ports_file = Path(self._dir) / "ports.json"
        self.proc: subprocess.Popen | None = None
        self.addresses: list[str] = []

    def __enter__(self) -> "StubFleet":
        self.proc = subprocess.Popen([sys.executable, __file__, "stub-pods", str(self.count), str(self.ports_file)],
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        wait_ready(self.proc, self.ports_file.exists, 60, "stub pods", lambda: "")
        self.addresses = [f"127.0.0.1:{p}" for p in json.loads(self.ports_file.read_text())]
        return self

    def start_moving(self) -> None:
        """From now on every scrape of a pod's /metrics reports a load other than the last."""
        _moving_flag(self.ports_file).touch()

    def __exit__(self, *exc) -> None:
        stop_pid(self.proc)
        self.ports_file.unlink(missing_ok=True)
        _moving_flag(self.ports_file).unlink(missing_ok=True)
        os.rmdir(self._dir)


def sequence_tokens(pod: int, seq: int, blocks: int = SEQUENCE_BLOCKS) -> list[int]:
    head = [pod % 128, (pod // 128) % 128, pod // 16384, seq % 128, (seq // 128) % 128, seq // 16384]
    head += [127] * (BLOCK_SIZE - len(head))
    return head + _SHARED_TAIL[:(blocks - 1) * BLOCK_SIZE]


def token_request(tokens: list[int]) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "probe"}],
                       "prompt_token_ids": tokens, "max_tokens": 1}).encode()


def chat_bodies(size: int, variants: int = CPU_VARIANTS) -> list[bytes]:
    """OpenAI chat bodies of about `size` bytes: a per-variant system prompt and a question."""
    out = []
    for v in range(variants):
        filler = f"variant {v}: " + " ".join(f"w{(v * 131 + i) % 9973}" for i in range(size // 6))
        body = {"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "system", "content": filler[:max(0, size - 200)]},
            {"role": "user", "content": f"question {v}"}]}
        out.append(json.dumps(body).encode())
    return out


class Client:
    """One keep-alive connection to Envoy's listener."""

    def __init__(self, port: int):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, body: bytes) -> tuple[int, str]:
        self.conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
        resp = self.conn.getresponse()
        resp.read()
        return resp.status, resp.getheader(DECISION_HEADER, "")

    def close(self) -> None:
        self.conn.close()


def parse_decision(header: str) -> dict[str, Any]:
    """`pod=A; matched=M/T blocks; ...` -> {"pod": A, "matched": M, "total": T, "unit": "blocks"}."""
    fields = dict(part.strip().split("=", 1) for part in header.split(";") if "=" in part)
    matched = fields.get("matched", "0/0 none").split()
    m, _, t = matched[0].partition("/")
    return {"pod": fields.get("pod", ""), "matched": int(m or 0), "total": int(t or 0),
            "unit": matched[1] if len(matched) > 1 else ""}


def post_each(port: int, bodies: list[bytes]) -> dict[str, int]:
    """Sends each body once, in order, over one keep-alive connection."""
    client = Client(port)
    counts = {"ok": 0, "failed": 0}
    try:
        for body in bodies:
            status, _ = client.post(body)
            counts["ok" if status == 200 else "failed"] += 1
    finally:
        client.close()
    return counts


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "stub-pods":
        asyncio.run(_stub_pods(int(sys.argv[2]), Path(sys.argv[3])))
    else:
        sys.exit(__doc__)
