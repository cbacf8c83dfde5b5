"""KV-event fan-out for the benchmark: one 127.0.0.1 PUB endpoint per simulated pod.

Why: the event consumers connect to publishers that bind (vllm-router's
`--kv-event-source WORKER=tcp://HOST:PORT` accepts only tcp:// and refuses
wildcard hosts; kvroute-indexer's `--zmq-connect`), while vllm-sim, like vLLM,
binds its publisher only for `tcp://*:P` (all interfaces — not allowed here)
or `ipc://` paths. So the pods bind `ipc://<dir>/ev` (pod i: `ev-i`), and this
relay subscribes to each and republishes every message unchanged (the same
multipart frames: topic, sequence, msgpack payload) on a PUB socket bound at
127.0.0.1:<port_i>. Both kvroute-indexer (kvroute precise) and vllm-router
(kv_aware) read the pods' events through it, so they see the same stream with
the same (sub-millisecond) delay. Message counts per pod are kept for the report.
"""

from __future__ import annotations

import os
import threading
from typing import Dict, List

import zmq


def ipc_endpoints(base: str, pods: int) -> List[str]:
    """vllm-sim's rule for a binding ipc endpoint: pod 0 uses it, pod i appends `-i`."""
    return [base if i == 0 else f"{base}-{i}" for i in range(pods)]


class Relay:
    def __init__(self, sources: List[str], ports: List[int]):
        assert len(sources) == len(ports)
        self.sources = sources
        self.ports = ports
        self.ctx = zmq.Context()
        self.counts: List[int] = [0] * len(sources)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.subs: List[zmq.Socket] = []
        self.pubs: List[zmq.Socket] = []

    @property
    def endpoints(self) -> List[str]:
        return [f"tcp://127.0.0.1:{p}" for p in self.ports]

    def start(self) -> "Relay":
        for src, port in zip(self.sources, self.ports):
            pub = self.ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.setsockopt(zmq.SNDHWM, 1_000_000)
            pub.bind(f"tcp://127.0.0.1:{port}")
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, 1_000_000)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(src)
            self.pubs.append(pub)
            self.subs.append(sub)
        self._thread = threading.Thread(target=self._run, name="kv-relay", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        poller = zmq.Poller()
        for s in self.subs:
            poller.register(s, zmq.POLLIN)
        index = {s: i for i, s in enumerate(self.subs)}
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                i = index[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.pubs[i].send_multipart(frames)
                    self.counts[i] += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        for s in self.subs + self.pubs:
            s.close(0)
        self.ctx.term()

    def stats(self) -> Dict[str, int]:
        return {ep: n for ep, n in zip(self.endpoints, self.counts)}

    def __enter__(self) -> "Relay":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def make_ipc_base(out_dir: str) -> str:
    d = os.path.join(out_dir, "kv-events")
    os.makedirs(d, exist_ok=True)
    return "ipc://" + os.path.join(d, "ev")
