"""Self-check of `make bench-scale`'s own logic (integration/bench/: scale_fleet, envoy_meter,
feed_readings, scale_report), in seconds: the synthetic sequences the indexer is filled with, the
decision-header parser, the histogram arithmetic, one stub-pod fleet answering over real sockets
(its load still, then moving),
and the CPU readings' wrk load. The benchmark itself is not run here (it takes minutes)."""
from __future__ import annotations

import http.server
import json
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "integration" / "bench"))

import envoy_meter  # noqa: E402
import feed_readings  # noqa: E402
import scale_fleet  # noqa: E402
import scale_report  # noqa: E402


def test_sequences_are_8k_tokens_distinct_per_pod_and_sequence_and_one_msgpack_byte_per_token():
    heads = set()
    for pod in (0, 1, 127, 128, 999, 4999):
        for seq in (0, 1, 25, 200):
            tokens = scale_fleet.sequence_tokens(pod, seq)
            assert len(tokens) == scale_fleet.SEQUENCE_BLOCKS * scale_fleet.BLOCK_SIZE == 8192
            assert all(0 <= t < 128 for t in tokens)
            heads.add(tuple(tokens[:scale_fleet.BLOCK_SIZE]))
    assert len(heads) == 6 * 4, "every (pod, sequence) must start a chain of its own"
    assert len(scale_fleet.sequence_tokens(3, 4, blocks=7)) == 7 * scale_fleet.BLOCK_SIZE


def test_decision_header_parse():
    header = ("pod=127.0.0.1:8003; matched=512/512 blocks; cost=4.0 (prefill=4.0 decode=0.0 queue=0.0 kv=0.0); "
              "inflight=0 req/0 blocks; candidates=1000")
    assert scale_fleet.parse_decision(header) == {"pod": "127.0.0.1:8003", "matched": 512, "total": 512,
                                            "unit": "blocks"}
    assert scale_fleet.parse_decision("")["matched"] == 0


def test_histogram_difference_and_quantiles():
    before = [(10.0, 1.0, 5), (100.0, 10.0, 1)]
    after = [(10.0, 1.0, 5), (100.0, 10.0, 51), (2000.0, 100.0, 1)]
    samples = envoy_meter.bucket_diff(after, before)
    assert samples == [(100.0, 10.0, 50), (2000.0, 100.0, 1)]
    assert envoy_meter.bucket_quantile(samples, 0.5) == 110.0
    assert envoy_meter.bucket_quantile(samples, 0.98) == 110.0
    assert envoy_meter.bucket_quantile(samples, 0.99) == 2100.0, "the 51st of 51 samples"
    assert envoy_meter.bucket_quantile([], 0.5) is None


def test_chat_bodies_have_the_asked_size_and_differ():
    bodies = scale_fleet.chat_bodies(30 * 1024)
    assert len(set(bodies)) == 16
    assert all(29 * 1024 < len(b) < 31 * 1024 for b in bodies), [len(b) for b in bodies]
    assert json.loads(bodies[0])["messages"][0]["role"] == "system"


def test_stub_fleet_answers_every_pod_with_keep_alive():
    with scale_fleet.StubFleet(3) as fleet:
        assert len(set(fleet.addresses)) == 3
        for address in fleet.addresses:
            client = scale_fleet.Client(int(address.rsplit(":", 1)[1]))
            try:
                for body in (b"{}", scale_fleet.token_request(scale_fleet.sequence_tokens(0, 0))):
                    assert client.post(body) == (200, "")
            finally:
                client.close()
    assert fleet.proc.poll() is not None


def test_stub_pods_load_stays_still_until_the_fleet_moves_it():
    """`scale.py --scrape-interval-ms`: the indexer scrapes the stub pods. Their load must not move
    while the feed's byte figures are read, and must move at every scrape afterwards."""
    import urllib.request

    def running(address: str) -> int:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
            text = r.read().decode()
        assert 'vllm:cache_config_info{num_gpu_blocks="%d"} 1' % scale_fleet.CAPACITY_BLOCKS in text
        return int(next(line for line in text.splitlines()
                        if line.startswith("vllm:num_requests_running")).split()[1])

    with scale_fleet.StubFleet(8) as fleet:
        assert {running(a) for a in fleet.addresses * 2} == {0}
        fleet.start_moving()
        # Scraped in turn, as the indexer scrapes a fleet: each pod's next load differs from its last.
        rounds = [[running(a) for a in fleet.addresses] for _ in range(3)]
        for before, after in zip(rounds, rounds[1:]):
            assert all(a != b for a, b in zip(before, after)), rounds


class _Unavailable(http.server.BaseHTTPRequestHandler):
    """Answers every POST 503, keeping the connection."""
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(503)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_wrk_load_counts_what_was_answered_and_what_was_not(tmp_path):
    """The CPU readings' load: wrk posts the file's bodies for the seconds asked; answers other
    than 200 are counted as failed."""
    body_file = tmp_path / "bodies.jsonl"
    body_file.write_bytes(b"".join(body + b"\n" for body in scale_fleet.chat_bodies(2048, variants=3)))
    with scale_fleet.StubFleet(1) as fleet:
        answered = envoy_meter.wrk_load(int(fleet.addresses[0].rsplit(":", 1)[1]), str(body_file), 1, 2)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        refused = envoy_meter.wrk_load(server.server_address[1], str(body_file), 1, 2)
    finally:
        server.shutdown()
        server.server_close()
    assert answered["ok"] > 100 and answered["failed"] == 0
    assert refused["ok"] == 0 and refused["failed"] > 10


def test_failure_cause_joins_the_vm_message_pieces():
    log = "\n".join([
        "[t][1][info][main] starting",
        "[t][1][error][wasm] [context.cc:1157] wasm log kvroute kvroute: memory allocation of ",
        "[t][1][error][wasm] [context.cc:1157] wasm log kvroute kvroute: 192088",
        "[t][1][error][wasm] [context.cc:1157] wasm log kvroute kvroute:  bytes failed",
        "[t][1][critical][main] [server.cc:449] error `Unable to create Wasm plugin kvroute`",
    ])
    lines = envoy_meter.failure_lines(log)
    assert "starting" not in "".join(lines)
    assert scale_report.cause(lines) == "memory allocation of 192088 bytes failed"
    assert scale_report.cause(["[t][1][warning][http] [a.cc:430] the buffer size limit for async client response body "
                        "has been exceeded, draining data"]).startswith("the buffer size limit")


def test_verify_flags_a_failed_start_a_decision_that_did_not_match_and_a_short_fill():
    decision = {"probes": 2, "fully_matched": 2, "samples": 2, "blocks_matched_header": 1024,
                "blocks_matched_counter": 1024}
    results = {"fleets": {"8": {
        "approximate": {"c2": {"started": True, "decision": dict(decision),
                               "cpu": {"30KB": {"ok": 5, "failed": 0, "index_work": {"blocks_total": 40}}}}},
        "precise": {"fill": {"indexed_entries": 10, "expected_entries": 10},
                    "c2": {"started": True, "routes_on_full_index": True, "decision": dict(decision)},
                    "c8": {"started": False}}}}}
    assert scale_report.verify(results)["failed"] == ["precise N=8 c8: Envoy started"]
    results["fleets"]["8"]["precise"]["c8"] = {"started": True, "routes_on_full_index": True}
    assert scale_report.verify(results) == {"made": 14, "failed": []}
    results["fleets"]["8"]["approximate"]["c2"]["decision"].update(fully_matched=1, blocks_matched_counter=0)
    results["fleets"]["8"]["precise"]["fill"]["indexed_entries"] = 9
    results["fleets"]["8"]["precise"]["c8"]["routes_on_full_index"] = False
    assert scale_report.verify(results)["failed"] == [
        "approximate N=8 c2: every probe fully matched on its pod",
        "approximate N=8 c2: kvroute.blocks.matched grew by the headers' matched blocks",
        "precise N=8 c8: routed on the full index",
        "precise N=8: indexer holds every entry sent"]


def test_verify_flags_cpu_readings_not_routed_or_not_paired():
    reading = {"ok": 5, "failed": 0, "index_work": {"blocks_total": 0},
               "without_kvroute": {"ok": 5, "failed": 1}, "added_rounds_us": [90.0, 95.0]}
    results = {"cpu_rounds": 5, "fleets": {"8": {"approximate": {"c2": {"started": True, "cpu": {"30KB": reading}}}}}}
    assert scale_report.verify(results)["failed"] == [
        "approximate N=8 c2: 30KB load routed by kvroute",
        "approximate N=8 c2: 30KB Envoy without kvroute answered all 200, every round paired"]
    reading.update(index_work={"blocks_total": 40}, without_kvroute={"ok": 5, "failed": 0},
                   added_rounds_us=[90.0, 95.0, 80.0, 99.0, 101.0])
    assert scale_report.verify(results)["failed"] == []


def test_feed_poller_pages_a_snapshot_and_counts_the_keys_of_deltas(ctx):
    """The bench's byte-counting feed consumer against the real indexer: 5 blocks at 2 per
    answer are 3 to 5 pages (key ranges); a delta of one stored and one removed block is 2 keys in 2 runs."""
    import indexer_harness as h

    pod = "10.0.0.1:8000"
    with h.Indexer("--pod", f"{pod}@{h.MODEL}", "--scrape-interval-ms", "0", "--feed-max-hashes", "2") as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        pub.send(h.topic(pod), 0, h.batch(h.stored([1, 2, 3, 4, 5], None, range(80))))
        h.wait_for(lambda: ix.metric("kvroute_indexer_blocks") == 5, what="5 blocks")
        poller = feed_readings.FeedPoller(ix)
        snap = poller.snapshot()
        assert 3 <= snap["snapshot_pages"] <= 5, snap
        assert snap["snapshot_largest_page_bytes"] < snap["snapshot_bytes"]
        idle = poller.get()
        assert (idle["bytes"], idle["keys"], idle["page"]) == (41, 0, None)
        pub.send(h.topic(pod), 1, h.batch(h.stored([6], 5, range(80, 96)), h.removed([1])))
        h.wait_for(lambda: ix.metric("kvroute_indexer_blocks") == 5 and ix.metric("kvroute_indexer_feed_cursor") == 3,
                   what="one stored, one removed")
        delta = poller.get()
        # Each run: a 1-byte op and pod, a 1-byte count, one 5-byte key.
        assert delta["keys"] == 2 and delta["bytes"] == 41 + 2 * (2 + 5)
        pub.close()


def test_index_reads_per_request_only_where_counted():
    assert envoy_meter.per_request({"ok": 4, "index_work": {"lookup_reads": 2}}, "lookup_reads") == "0.50"
    assert envoy_meter.per_request({"ok": 4}, "lookup_reads") == "—"
    assert envoy_meter.per_request({"ok": 0, "index_work": {"lookup_reads": 2}}, "lookup_reads") == "—"


def test_added_cpu_is_paired_by_round():
    def reading(us_per_request: float, ok: int = 100) -> dict:
        return {"ok": ok, "failed": 0, "seconds": 0.1, "cpu_ns": us_per_request * 1e3 * ok, "main_ns": 0,
                "opened": {}}
    kvroute = [reading(300), reading(210), reading(250)]
    plain = [reading(200), reading(110), reading(145)]
    assert envoy_meter.paired_added(kvroute, plain) == [100.0, 100.0, 105.0]
    together = envoy_meter.pooled(kvroute)
    assert (together["ok"], together["cpu_us_per_request"]) == (300, 253.3)
