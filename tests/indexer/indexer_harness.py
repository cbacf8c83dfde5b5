"""Harness for kvroute-indexer integration tests: start the real binary on free
ports, publish vLLM-shaped ZMQ messages with pyzmq, read the feed (decoded here
in Python from the wire format pinned in docs/contracts.md / core/src/feed.rs).

The process is integration/indexerctl.py's IndexerProcess (binary, ports, stop by PID).
"""

from __future__ import annotations

import struct
import sys
import threading
import urllib.request
from pathlib import Path

import msgpack
import zmq

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "integration"))

import proctools  # noqa: E402
from indexerctl import LEARNED_TOKEN, IndexerProcess, free_port, indexer_binary  # noqa: E402,F401  (re-exported)

GOLDEN = REPO / "testdata" / "vllm-golden" / "frames"
MODEL = "Qwen/Qwen3-32B"

# kvroute hashes of tokens 0..63 (block 16) for MODEL, pinned in core/src/hash.rs.
TOKENS_0_63_QWEN = [0xB2B79674517D8D36, 0xA8E1D591ABB22B2D, 0xEBE25CDFBC418710, 0x6B2B308C32DE0F48]

TIERS = {0: "gpu", 1: "cpu", 2: "disk", 3: "learned"}

# The feed carries each hash's index key: its low 40 bits (core/src/hash.rs index_key).
KEY_MASK = (1 << 40) - 1


def key(h: int) -> int:
    return h & KEY_MASK


KEYS_0_63_QWEN = [key(x) for x in TOKENS_0_63_QWEN]


# ----------------------------------------------------------------- feed codec


class Reader:
    def __init__(self, b: bytes):
        self.b, self.i = b, 0

    def take(self, n: int) -> bytes:
        if self.i + n > len(self.b):
            raise ValueError("truncated")
        v = self.b[self.i:self.i + n]
        self.i += n
        return v

    def u8(self):
        return self.take(1)[0]

    def u16(self):
        return struct.unpack("<H", self.take(2))[0]

    def u32(self):
        return struct.unpack("<I", self.take(4))[0]

    def u64(self):
        return struct.unpack("<Q", self.take(8))[0]

    def f32(self):
        return struct.unpack("<f", self.take(4))[0]

    def varint(self):
        v, shift = 0, 0
        while True:
            b = self.u8()
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return v

    def s(self):
        return self.take(self.varint()).decode()

    def keys(self):
        """A run's keys: ascending, packed (feed version 3, core/src/feed.rs)."""
        n = self.varint()
        low = packed_low_bits(n)
        bits = packed_bits(n, low)
        raw = self.take((bits + 7) // 8)

        def bit(pos: int) -> int:
            return raw[pos >> 3] >> (pos & 7) & 1

        def field(pos: int) -> int:  # the `low` bits from pos
            chunk = int.from_bytes(raw[pos >> 3:(pos + low + 7 >> 3) + 1], "little")
            return chunk >> (pos & 7) & ((1 << low) - 1)

        keys = [field(i * low) for i in range(n)]
        pos, high = n * low, 0
        for i in range(n) if low < 40 else ():
            while not bit(pos):
                high, pos = high + 1, pos + 1
            keys[i] |= high << low
            pos += 1
        assert all(not bit(p) for p in range(pos, 8 * len(raw))), "bits past the last key"
        assert keys == sorted(keys), "ascending"
        return keys

    def load(self):
        return {"waiting": self.varint(), "running": self.varint(), "kv_usage": self.f32()}


def packed_bits(n: int, low: int) -> int:
    high = 40 - low
    return n * low + (n + (1 << high) - 1 if high else 0)


def packed_low_bits(n: int) -> int:
    """Low bits per key of n packed keys: the fewest bytes, ties to more low bits."""
    return min(range(40, 7, -1), key=lambda low: (packed_bits(n, low) + 7) // 8)


def decode_feed(b: bytes) -> dict:
    """One answer of GET /v1/feed, version 3 (docs/contracts.md)."""
    r = Reader(b)
    assert r.take(4) == b"KVRF", "magic"
    assert r.u16() == 3, "version"
    flags = r.u16()
    page, pods, load, more = flags & 1, flags & 2, flags & 4, flags & 8
    out = {"epoch": r.u64(), "cursor": r.u64(), "pods_version": r.u64(), "load_version": r.u64(),
           "page": None, "next": None, "more": bool(more), "pods": None, "load": None, "ops": []}
    if page:
        out["page"] = r.u32()
        if more:
            pod = r.u64()
            out["next"] = (pod, r.u64() if r.u8() else None)
    out["snapshot"] = out["page"] == 0
    if pods:
        out["pods"] = []
        for _ in range(r.varint()):
            addr = r.s()
            models = [r.s() for _ in range(r.varint())]
            out["pods"].append({"address": addr, "models": models, "capacity_blocks": r.varint(),
                                "speed": r.f32(), **r.load()})
    elif load:
        out["load"] = [r.load() for _ in range(r.varint())]
    for _ in range(r.varint()):
        op_pod = r.varint()
        op, pod = op_pod & 7, op_pod >> 3
        if op <= 3:
            out["ops"].append(("stored", pod, TIERS[op], r.keys()))
        elif op == 4:
            out["ops"].append(("removed", pod, None, r.keys()))
        elif op == 5:
            out["ops"].append(("cleared", pod, None, []))
        else:
            raise ValueError(f"op {op}")
    assert r.i == len(b), "trailing bytes"
    return out


def encode_learned(entries: list[tuple[str, list[int]]]) -> bytes:
    out = bytearray(b"KVRL" + struct.pack("<HHI", 1, 0, len(entries)))
    for addr, hashes in entries:
        a = addr.encode()
        out += struct.pack("<I", len(a)) + a + struct.pack(f"<I{len(hashes)}Q", len(hashes), *hashes)
    return bytes(out)


class FeedClient:
    """A consumer that follows the feed contract: pages of a snapshot in order (the first
    replaces all state), deltas after them, the pod list and the load kept between answers."""

    def __init__(self, base: str):
        self.base, self.epoch, self.cursor = base, 0, 0
        self.pods_version, self.load_version = 0, 0
        self.entries: dict[tuple[str, int], str] = {}
        self.pods: list[dict] = []

    def _get(self, page: tuple[int, tuple[int, int | None]] | None) -> dict:
        q = f"epoch={self.epoch}&cursor={self.cursor}&pods={self.pods_version}&load={self.load_version}"
        if page:
            number, (pod, after) = page
            q += f"&page={number}&page_pod={pod}" + (f"&page_after={after}" if after is not None else "")
        with urllib.request.urlopen(f"{self.base}/v1/feed?{q}", timeout=5) as r:
            assert r.headers["Content-Type"] == "application/octet-stream"
            return decode_feed(r.read())

    def _apply(self, u: dict) -> None:
        if u["snapshot"]:
            self.entries.clear()
        if u["pods"] is not None:
            self.pods, self.pods_version = u["pods"], u["pods_version"]
            self.load_version = u["load_version"]
        elif u["load"] is not None:
            for p, load in zip(self.pods, u["load"]):
                p.update(load)
            self.load_version = u["load_version"]
        assert (self.pods_version, self.load_version) == (u["pods_version"], u["load_version"]), "lists kept"
        live = {p["address"] for p in self.pods}
        self.entries = {k: v for k, v in self.entries.items() if k[0] in live}
        for kind, pod, tier, keys in u["ops"]:
            addr = self.pods[pod]["address"]
            if kind == "stored":
                for k in keys:
                    self.entries[(addr, k)] = tier
            elif kind == "removed":
                for k in keys:
                    self.entries.pop((addr, k), None)
            else:
                self.entries = {k: v for k, v in self.entries.items() if k[0] != addr}
        self.epoch, self.cursor = u["epoch"], u["cursor"]

    def poll(self) -> dict:
        """One poll; a snapshot is read page by page to its end."""
        u = self._get(None)
        self._apply(u)
        while u["next"] is not None:
            u = self._get((u["page"] + 1, u["next"]))
            assert u["page"] is not None, "a snapshot goes on with its pages"
            self._apply(u)
        return u

    def of(self, addr: str) -> dict[int, str]:
        """The pod's entries: index key -> tier."""
        self.poll()
        return {k: t for (a, k), t in self.entries.items() if a == addr}


# ----------------------------------------------------------------- process


class Indexer(IndexerProcess):
    """The real kvroute-indexer with exactly the given flags (tests name every pod themselves)."""

    def __init__(self, *flags: str, bind: bool = True, zmq_port: int | None = None,
                 learned_token: str | None = LEARNED_TOKEN):
        super().__init__((), *flags, bind=bind, zmq_port=zmq_port, learned_token=learned_token)

    def feed(self) -> FeedClient:
        return FeedClient(self.url)


def wait_for(cond, timeout: float = 10.0, what: str = "condition"):
    """proctools.wait_for, failing the test on a timeout."""
    last = proctools.wait_for(cond, timeout, interval=0.05)
    if not last:
        raise AssertionError(f"timed out waiting for {what} (last: {last!r})")
    return last


# ----------------------------------------------------------------- publishers


def topic(addr: str, model: str = MODEL) -> bytes:
    return f"kv@{addr}@{model}".encode()


def batch(*events, rank: int | None = 0, ts: float = 1700000000.5) -> bytes:
    b = [ts, list(events)] + ([rank] if rank is not None else [])
    return msgpack.packb(b, use_bin_type=True)


def stored(hashes, parent, tokens, block_size=16, medium="GPU", lora_name=None) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": lora_name, "group_idx": 0}


def removed(hashes, medium="GPU") -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium, "group_idx": 0}


CLEARED = {"type": "AllBlocksCleared"}


class Publisher:
    """A vLLM-style PUB socket: connects to the indexer's SUB (vLLM's default when
    the endpoint has no '*') or binds for the indexer to connect."""

    def __init__(self, ctx: zmq.Context, endpoint: str, bind: bool = False):
        self.sock = ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        if bind:
            self.sock.bind(endpoint)
        else:
            self.sock.connect(endpoint)

    def send(self, topic: bytes, seq: int, payload: bytes) -> None:
        self.sock.send_multipart([topic, struct.pack(">Q", seq), payload])

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def close(self):
        self.sock.close(0)


def wait_subscribed(ix: Indexer, pub: Publisher, timeout: float = 10.0) -> None:
    """PUB drops messages until the SUB's subscription arrives: send probes
    without a pod identity (rejected, counted) until the indexer has counted one."""
    before = ix.metric("kvroute_indexer_messages_rejected_total", reason="no_identity")

    def probe():
        pub.send(b"probe", 0, batch())
        return ix.metric("kvroute_indexer_messages_rejected_total", reason="no_identity") > before

    wait_for(probe, timeout, "subscription to reach the publisher")


def golden_payload(name: str) -> bytes:
    return (GOLDEN / f"{name}.payload.msgpack").read_bytes()


def golden_frames(name: str) -> list[bytes]:
    data = (GOLDEN / f"{name}.multipart.bin").read_bytes()
    frames, i = [], 0
    while i < len(data):
        (n,) = struct.unpack(">I", data[i:i + 4])
        frames.append(data[i + 4:i + 4 + n])
        i += 4 + n
    return frames


class ReplayRouter:
    """vLLM's replay socket: a ROUTER that, for ["", start_seq], answers one
    message per buffered batch with seq >= start, then an end marker
    (framing of vLLM >= 0.26: ["", topic, seq, payload]; <= 0.20 without topic)."""

    def __init__(self, ctx: zmq.Context, port: int, buffered: list[tuple[int, bytes]], topic: bytes = b"",
                 old_framing: bool = False):
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.buffered, self.topic, self.old = buffered, topic, old_framing
        self.requests: list[int] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _frames(self, seq: int, payload: bytes) -> list[bytes]:
        s = struct.pack(">Q", seq)
        return [b"", s, payload] if self.old else [b"", self.topic, s, payload]

    def _run(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            ident, empty, start = self.sock.recv_multipart()
            (start_seq,) = struct.unpack(">Q", start)
            self.requests.append(start_seq)
            for seq, payload in self.buffered:
                if seq >= start_seq:
                    self.sock.send_multipart([ident] + self._frames(seq, payload))
            self.sock.send_multipart([ident] + self._frames(0xFFFFFFFFFFFFFFFF, b""))

    def close(self):
        self._stop.set()
        self.thread.join(timeout=2)
        self.sock.close(0)
