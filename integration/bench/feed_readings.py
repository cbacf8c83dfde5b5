"""The precise mode's indexer side of the scale benchmark: synthetic vLLM KV events over ZMQ
that fill the indexer, and a feed poller that counts what the feed costs (snapshot, idle polls,
deltas under churn) from the wire format itself."""
from __future__ import annotations

import struct
import threading
import time
import urllib.request
from typing import Any

# First: it puts integration/ (indexerctl, proctools) and tests/indexer/ (indexer_harness,
# imported below where used) on the path.
from scale_fleet import BLOCK_SIZE, CAPACITY_BLOCKS, FILL, SEQUENCE_BLOCKS, sequence_tokens
from indexerctl import IndexerProcess  # noqa: E402
from proctools import wait_for  # noqa: E402

class KvEventSource:
    """Synthetic vLLM KV events for every pod, on one PUB socket connected to the indexer."""

    def __init__(self, indexer: IndexerProcess, pods: list[str]):
        import zmq
        from indexer_harness import Publisher, wait_subscribed

        self.ctx = zmq.Context()
        self.pub = Publisher(self.ctx, indexer.zmq_endpoint)
        wait_subscribed(indexer, self.pub)
        self.pods = pods
        self.seq = [0] * len(pods)
        self.next_hash = [((p + 1) << 32) for p in range(len(pods))]

    def _send(self, pod: int, *events: dict) -> None:
        from indexer_harness import batch, topic

        self.seq[pod] += 1
        self.pub.send(topic(self.pods[pod]), self.seq[pod], batch(*events))

    def store(self, pod: int, tokens: list[int]) -> list[int]:
        """One BlockStored of a whole sequence; returns its vLLM block hashes."""
        from indexer_harness import stored

        n = len(tokens) // BLOCK_SIZE
        hashes = list(range(self.next_hash[pod], self.next_hash[pod] + n))
        self.next_hash[pod] += n
        self._send(pod, stored(hashes, None, tokens, BLOCK_SIZE))
        return hashes

    def store_and_remove(self, pod: int, tokens: list[int], remove: list[int]) -> list[int]:
        from indexer_harness import removed, stored

        n = len(tokens) // BLOCK_SIZE
        hashes = list(range(self.next_hash[pod], self.next_hash[pod] + n))
        self.next_hash[pod] += n
        events = [stored(hashes, None, tokens, BLOCK_SIZE)] + ([removed(remove)] if remove else [])
        self._send(pod, *events)
        return hashes

    def close(self) -> None:
        self.pub.close()
        self.ctx.term()


class FeedPoller:
    """A byte-counting feed consumer (feed version 3, docs/contracts.md): it sends back the
    versions each answer states, follows snapshot pages to the last, and counts the keys of the
    runs it receives without keeping them (13 M entries would not fit a Python dict cheaply)."""

    def __init__(self, indexer: IndexerProcess):
        self.indexer = indexer
        self.epoch = self.cursor = self.pods_version = self.load_version = 0

    def get(self, page: tuple[int, int, int | None] | None = None) -> dict:
        q = f"epoch={self.epoch}&cursor={self.cursor}&pods={self.pods_version}&load={self.load_version}"
        if page:
            q += f"&page={page[0]}&page_pod={page[1]}" + (f"&page_after={page[2]}" if page[2] is not None else "")
        body = self.indexer.get(f"/v1/feed?{q}")
        assert body[:6] == b"KVRF\x03\x00", "feed version 3"
        flags = struct.unpack_from("<H", body, 6)[0]
        self.epoch, self.cursor, self.pods_version, self.load_version = struct.unpack_from("<QQQQ", body, 8)
        at, answer = 40, {"bytes": len(body), "page": None, "next": None, "more": bool(flags & 8),
                          "pods_listed": bool(flags & 2), "keys": None}
        if flags & 1:
            answer["page"] = struct.unpack_from("<I", body, at)[0]
            at += 4
            if flags & 8:
                pod, has_after = struct.unpack_from("<QB", body, at)
                at += 9
                after = struct.unpack_from("<Q", body, at)[0] if has_after else None
                at += 8 if has_after else 0
                answer["next"] = (answer["page"] + 1, pod, after)
        if not flags & 6:  # no list in front of the runs: count their keys
            answer["keys"] = _run_keys(body, at)
        return answer

    def snapshot(self) -> dict:
        """The whole snapshot, page by page: bytes, pages, the largest page, seconds."""
        self.epoch = self.cursor = self.pods_version = self.load_version = 0
        t0 = time.monotonic()
        first = self.get()
        assert first["page"] == 0, "a fresh consumer gets a snapshot"
        answers = [first]
        while answers[-1]["next"]:
            answers.append(self.get(answers[-1]["next"]))
        return {"snapshot_bytes": sum(a["bytes"] for a in answers), "snapshot_pages": len(answers),
                "snapshot_largest_page_bytes": max(a["bytes"] for a in answers),
                "snapshot_s": round(time.monotonic() - t0, 2)}


def _varint(body: bytes, at: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = body[at]
        at += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, at


def _packed_len(n: int) -> int:
    """Bytes of n packed keys (core/src/feed.rs: Elias-Fano, the low bits giving the fewest bytes)."""
    def bits(low: int) -> int:
        high = 40 - low
        return n * low + (n + (1 << high) - 1 if high else 0)
    return min((bits(low) + 7) // 8 for low in range(40, 7, -1))


def _run_keys(body: bytes, at: int) -> int:
    """Keys in the runs from `at` (run: varint pod << 3 | op, then for stored/removed n varint, n packed keys)."""
    runs, at = _varint(body, at)
    keys = 0
    for _ in range(runs):
        op_pod, at = _varint(body, at)
        if op_pod & 7 != 5:
            n, at = _varint(body, at)
            keys += n
            at += _packed_len(n)
    assert at == len(body), "runs end the message"
    return keys


def fill(indexer: IndexerProcess, source: KvEventSource, pods: int) -> dict[str, Any]:
    per_pod = int(CAPACITY_BLOCKS * FILL)
    full_sequences, rest = divmod(per_pod, SEQUENCE_BLOCKS)
    t0 = time.monotonic()
    for seq in range(full_sequences + (1 if rest else 0)):
        blocks = SEQUENCE_BLOCKS if seq < full_sequences else rest
        for pod in range(pods):
            source.store(pod, sequence_tokens(pod, seq, blocks))
    sent = time.monotonic() - t0
    expected = per_pod * pods

    def indexed() -> int:
        """(block, pod) entries, counted per publisher (the feed's keys can be fewer: see index_keys).
        0 while the indexer is too busy applying the burst to answer in time (5,000 pods)."""
        try:
            return sum(s.get("blocks", 0) for p in indexer.pods_debug().values() for s in p.get("sources", []))
        except (TimeoutError, urllib.error.URLError):
            return 0

    held = wait_for(lambda: (n := indexed()) >= expected and n, 600, interval=1.0) or indexed()
    # Distinct 40-bit index keys per pod, what the feed serves: two blocks of one pod may share one.
    keys = sum(p.get("blocks", 0) for p in indexer.pods_debug().values())
    return {"blocks_per_pod": per_pod, "sequences_per_pod": full_sequences, "expected_entries": expected,
            "indexed_entries": held, "index_keys": keys, "send_s": round(sent, 1),
            "indexed_s": round(time.monotonic() - t0, 1),
            "indexer_rss_mb": round(indexer.rss_bytes() / 2**20, 1),
            "indexer_rss_bytes_per_entry": round(indexer.rss_bytes() / max(1, held), 1)}


def feed_bytes(indexer: IndexerProcess, source: KvEventSource, pods: int, rate: int, seconds: float) -> dict:
    """Snapshot (in pages) and idle poll sizes, then delta bytes/s while every pod stores and
    removes `rate` blocks/s (in 20-block messages), polled every 100 ms as the singleton does."""
    poller = FeedPoller(indexer)
    snapshot = poller.snapshot()
    idle = poller.get()
    assert idle["page"] is None and idle["keys"] == 0, "an idle poll after the snapshot"
    polled = {"bytes": 0, "polls": 0, "keys": 0, "snapshots": 0, "lists": 0}
    stop = threading.Event()

    def poller_loop() -> None:
        while not stop.is_set():
            answer = poller.get()
            polled["bytes"] += answer["bytes"]
            polled["polls"] += 1
            polled["keys"] += answer["keys"] or 0
            polled["snapshots"] += answer["page"] == 0
            polled["lists"] += answer["keys"] is None
            if not answer["more"]:
                stop.wait(0.1)

    thread = threading.Thread(target=poller_loop, daemon=True)
    chunk = 20
    churn: list[list[int]] = [[] for _ in range(pods)]
    messages = rate * pods // chunk  # per second
    interval = 1.0 / messages if messages else 1.0
    sent_blocks = 0
    thread.start()
    t0 = time.monotonic()
    i = 0
    while time.monotonic() - t0 < seconds:
        pod = i % pods
        tokens = sequence_tokens(pod, 10_000 + i // pods, chunk)
        removing = len(churn[pod])
        churn[pod] = source.store_and_remove(pod, tokens, churn[pod])
        sent_blocks += chunk + removing
        i += 1
        lag = t0 + i * interval - time.monotonic()
        if lag > 0:
            time.sleep(lag)
    elapsed = time.monotonic() - t0
    time.sleep(0.5)  # the last poll picks up the tail
    stop.set()
    thread.join()
    elapsed_with_tail = time.monotonic() - t0
    polls_per_s = polled["polls"] / elapsed_with_tail
    # Without lists, an answer is the 41-byte idle poll plus its runs: what grows with the events.
    event_bytes = polled["bytes"] - polled["polls"] * idle["bytes"]
    bytes_per_event = event_bytes / max(1, polled["keys"])
    target = 2 * 200 * pods  # 200 stored + 200 removed blocks/s per pod
    return {**snapshot, "idle_poll_bytes": idle["bytes"],
            "churn_blocks_per_pod_s": rate, "churn_seconds": round(elapsed, 1),
            "block_events_sent": sent_blocks, "block_events_per_s": round(sent_blocks / elapsed),
            "block_events_polled": polled["keys"], "answers_with_lists": polled["lists"],
            "polls": polled["polls"], "polls_per_s": round(polls_per_s, 2), "delta_snapshots": polled["snapshots"],
            "delta_bytes_per_s": round(polled["bytes"] / elapsed_with_tail),
            "bytes_per_block_event": round(bytes_per_event, 2),
            "bytes_per_block_event_all_in": round(polled["bytes"] / max(1, polled["keys"]), 2),
            "delta_bytes_per_s_at_200_per_pod": round(idle["bytes"] * 10 + bytes_per_event * target),
            "extrapolated": rate < 200}
