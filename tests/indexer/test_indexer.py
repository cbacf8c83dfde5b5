"""kvroute-indexer end to end: the real binary, vLLM-shaped ZMQ traffic from
pyzmq (golden captures of vLLM's own publisher and hand-built messages), the
feed decoded in Python."""

import http.server
import json
import struct
import subprocess
import threading
import time

import indexer_harness as h
from indexer_harness import CLEARED, MODEL, batch, removed, stored, topic, wait_for

POD = "127.0.0.1:18999"  # an identity only: nothing listens there (scraping is off)


def test_golden_captures_over_zmq(ctx):
    """Every int_* and bytes_* capture of the 00..06 sequence, as vLLM sent them
    (frames from the .multipart.bin files, topic replaced by the pod convention)."""
    pod_b = "127.0.0.1:18998"
    with h.Indexer("--pod", f"{POD}@{MODEL}", "--pod", f"{pod_b}@{MODEL}", "--scrape-interval-ms", "0") as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        names = ["00_stored_4blocks_root", "01_stored_2blocks_with_parent", "02_stored_lora_extrakeys_session",
                 "03_removed_gpu", "04_removed_cpu_no_group", "05_all_cleared", "06_mixed_stored_removed_cleared"]
        for kind, pod in (("int", POD), ("bytes", pod_b)):
            for i, name in enumerate(names):
                t, seq, payload = h.golden_frames(f"{kind}_{name}")
                assert struct.unpack(">Q", seq)[0] == i
                pub.send_frames([topic(pod), seq, payload])
                if i == 0:
                    # The kvroute chain of tokens 0..63 for the model (vectors pinned in core/src/hash.rs).
                    got = wait_for(lambda: feed.of(pod) if len(feed.of(pod)) == 4 else None, what="4 blocks")
                    assert got == {x: "gpu" for x in h.KEYS_0_63_QWEN}
        wait_for(lambda: ix.metric("kvroute_indexer_events_total", type="AllBlocksCleared") == 4, what="clears")
        assert feed.of(POD) == {} and feed.of(pod_b) == {}
        assert ix.metric("kvroute_indexer_decode_errors_total") == 0
        assert ix.metric("kvroute_indexer_seq_gaps_total") == 0
        assert ix.metric("kvroute_indexer_events_total", type="BlockStored") == 8
        assert ix.metric("kvroute_indexer_events_total", type="BlockRemoved") == 6
        pods = ix.pods_debug()
        assert pods[POD]["sources"] == [{"rank": 0, "next_seq": 7, "blocks": 0, "replay_pending": False}]
        pub.close()


def test_array_encoded_events_and_data_parallel_rank(ctx):
    with h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0") as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        # vLLM <= 0.20 positional form, oldest shape (no rank, 6-element BlockStored, i64 hashes).
        old = h.msgpack.packb([1.0, [["BlockStored", [-1, -2], None, list(range(32)), 16, None]]])
        pub.send(topic(POD), 0, old)
        wait_for(lambda: len(feed.of(POD)) == 2, what="array-encoded blocks")
        assert set(feed.of(POD)) == set(h.KEYS_0_63_QWEN[:2])
        # Same pod, data-parallel rank 1 (its own sequence): the golden dp1 clear only clears rank 1.
        dp1 = h.golden_payload("int_tcp_dp1_topic_cleared")
        pub.send(topic(POD), 0, dp1)
        wait_for(lambda: {s["rank"] for s in ix.pods_debug()[POD]["sources"]} == {0, 1}, what="rank 1 source")
        assert len(feed.of(POD)) == 2
        # Rank 0 removes one block with the positional BlockRemoved (signed hash).
        pub.send(topic(POD), 1, h.msgpack.packb([1.0, [["BlockRemoved", [-2], "GPU", 0]], 0]))
        wait_for(lambda: len(feed.of(POD)) == 1, what="removal")
        pub.close()


def test_restart_drops_stale_entries(ctx):
    with h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0") as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        for seq in range(5):
            pub.send(topic(POD), seq, batch(stored([100 + seq], None, range(1000 * (seq + 1), 1000 * (seq + 1) + 16))))
        wait_for(lambda: len(feed.of(POD)) == 5, what="5 blocks")
        stale = set(feed.of(POD))
        # The pod restarts: its sequence is back at 0.
        pub.send(topic(POD), 0, batch(stored([7], None, range(16))))
        wait_for(lambda: ix.metric("kvroute_indexer_restarts_total") == 1, what="restart detected")
        now = feed.of(POD)
        assert now == {h.KEYS_0_63_QWEN[0]: "gpu"}
        assert not stale & set(now)
        pub.close()


def test_garbage_and_truncated_messages_are_counted_and_dropped(ctx):
    with h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0") as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        good = h.golden_payload("int_00_stored_4blocks_root")
        pub.send(topic(POD), 0, good[: len(good) // 2])  # truncated
        pub.send(topic(POD), 0, b"\xc1\xff\x00garbage")  # not msgpack
        pub.send(topic(POD), 0, h.msgpack.packb({"not": "a batch"}))  # wrong shape
        pub.send_frames([topic(POD), b"\x00\x01", good])  # bad seq frame
        pub.send_frames([topic(POD), good])  # two frames
        pub.send_frames([topic(POD), struct.pack(">Q", 0), good, b"extra"])  # four frames
        wait_for(lambda: ix.metric("kvroute_indexer_decode_errors_total") == 6, what="6 decode errors")
        # The stream goes on.
        pub.send(topic(POD), 0, good)
        wait_for(lambda: len(feed.of(POD)) == 4, what="valid message after garbage")
        assert ix.metric("kvroute_indexer_decode_errors_total", kind="frame_count") == 2
        assert ix.metric("kvroute_indexer_decode_errors_total", kind="bad_seq_frame") == 1
        assert ix.metric("kvroute_indexer_seq_gaps_total") == 0
        assert ix.proc.poll() is None
        pub.close()


def _gap_replay(ctx, old_framing: bool):
    rport = h.free_port()
    tokens = list(range(64))
    msgs = [(0, batch(stored([10], None, tokens[0:16])))]
    msgs += [(i, batch(stored([10 + i], 10 + i - 1, tokens[16 * i:16 * i + 16]))) for i in (1, 2, 3)]
    router = h.ReplayRouter(ctx, rport, msgs, topic=topic(POD), old_framing=old_framing)
    try:
        with h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0",
                       "--replay-endpoint", f"{POD}=tcp://127.0.0.1:{rport}") as ix:
            pub = h.Publisher(ctx, ix.zmq_endpoint)
            h.wait_subscribed(ix, pub)
            feed = ix.feed()
            pub.send(topic(POD), 0, msgs[0][1])
            wait_for(lambda: len(feed.of(POD)) == 1, what="first block")
            # seq 1 and 2 are lost on the way; 3 arrives (its parent is unknown until replayed).
            pub.send(topic(POD), 3, msgs[3][1])
            wait_for(lambda: ix.metric("kvroute_indexer_replays_total", result="ok") == 1, what="replay")
            assert router.requests == [1]
            assert feed.of(POD) == {x: "gpu" for x in h.KEYS_0_63_QWEN}
            assert ix.metric("kvroute_indexer_seq_gaps_total") == 1
            assert ix.metric("kvroute_indexer_seq_missed_total") == 2
            assert ix.metric("kvroute_indexer_replayed_messages_total") == 2
            assert ix.metric("kvroute_indexer_seq_gaps_unrecovered_total") == 0
            assert ix.metric("kvroute_indexer_stored_unknown_parent_total") == 0
            pub.close()
    finally:
        router.close()


def test_gap_filled_from_replay_socket(ctx):
    _gap_replay(ctx, old_framing=False)


def test_gap_filled_from_replay_socket_old_framing(ctx):
    _gap_replay(ctx, old_framing=True)


def test_gap_without_replay_and_replay_failure_are_counted(ctx):
    dead = h.free_port()  # nothing listens: the replay times out
    with h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0", "--replay-timeout-ms", "300",
                   "--replay-endpoint", f"{POD}=tcp://127.0.0.1:{dead}") as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        pub.send(topic(POD), 0, batch(stored([1], None, range(16))))
        pub.send(topic(POD), 5, batch(stored([2], None, range(100, 116))))
        wait_for(lambda: ix.metric("kvroute_indexer_replays_total", result="failed") == 1, what="failed replay")
        # The buffered live message is applied all the same.
        wait_for(lambda: len(feed.of(POD)) == 2, what="buffered message applied")
        assert ix.metric("kvroute_indexer_seq_gaps_unrecovered_total") == 1
        pub.close()


def test_rogue_publisher_is_rejected_unless_explicitly_enabled(ctx):
    rogue = "127.0.0.1:18997"
    with h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0") as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        before = ix.metric("kvroute_indexer_messages_rejected_total", reason="no_identity")
        pub.send(topic(rogue), 0, batch(stored([1], None, range(16))))
        pub.send(b"", 0, batch(stored([1], None, range(16))))  # vLLM's default topic: no identity
        wait_for(lambda: ix.metric("kvroute_indexer_messages_rejected_total", reason="unknown_pod") == 1,
                 what="rogue rejected")
        wait_for(lambda: ix.metric("kvroute_indexer_messages_rejected_total", reason="no_identity") == before + 1,
                 what="no identity rejected")
        feed = ix.feed()
        feed.poll()
        assert [p["address"] for p in feed.pods] == [POD]
        assert feed.entries == {}
        pub.close()
    with h.Indexer("--accept-unknown-publishers", "--scrape-interval-ms", "0") as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        pub.send(topic(rogue), 0, batch(stored([1], None, range(16))))
        feed = ix.feed()
        wait_for(lambda: len(feed.of(rogue)) == 1, what="pod discovered from events")
        assert feed.pods[0]["models"] == [MODEL]
        assert ix.pods_debug()[rogue]["origins"] == ["events"]
        pub.close()


def test_connect_mode_identity_from_configuration(ctx):
    """A pod that binds its publisher (endpoint with '*'): the indexer connects;
    identity from --zmq-connect even with vLLM's default empty topic."""
    port = h.free_port()
    pub = h.Publisher(ctx, f"tcp://127.0.0.1:{port}", bind=True)
    try:
        with h.Indexer("--zmq-connect", f"tcp://127.0.0.1:{port}={POD}@{MODEL}", "--scrape-interval-ms", "0",
                       bind=False) as ix:
            feed = ix.feed()

            def probe():
                pub.send(b"", 0, batch(stored([1], None, range(16))))
                return len(feed.of(POD)) == 1

            wait_for(probe, what="connected SUB receives")
            assert feed.of(POD) == {h.KEYS_0_63_QWEN[0]: "gpu"}
            assert ix.pods_debug()[POD]["origins"] == ["connect"]
    finally:
        pub.close()


def test_learned_entries_are_shared_with_a_ttl(ctx):
    with h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0", "--learned-ttl-seconds", "1") as ix:
        feed = ix.feed()
        token = ix.learned_token
        status, body = ix.post("/v1/learned", h.encode_learned([(POD, [1, 2, 3]), ("10.9.9.9:80", [4])]), token)
        assert status == 200 and json.loads(body) == {"accepted": 3, "rejected": 1, "token_domain": 0}
        assert feed.of(POD) == {1: "learned", 2: "learned", 3: "learned"}
        status, body = ix.post("/v1/learned", b"KVRL\x01\x00\x00\x00\xff\xff\xff\xff", token)
        assert status == 400 and b"count" in body
        status, _ = ix.post("/v1/learned", b"nope", token)
        assert status == 400
        wait_for(lambda: feed.of(POD) == {}, timeout=5, what="learned entries expire")
        assert ix.metric("kvroute_indexer_learned_accepted_total") == 3


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):  # noqa: N802
        self.send_response(200 if self.path == "/metrics" else 404)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


def test_load_is_scraped_from_pod_metrics():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MetricsHandler)
    _MetricsHandler.body = (
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
        b'vllm:num_requests_running{engine="0",model_name="m"} 9.0\n'
        b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.375\n'
        b'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="19208"} 1.0\n'
    )
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    pod = f"127.0.0.1:{server.server_address[1]}"
    try:
        with h.Indexer("--pod", f"{pod}@{MODEL}", "--scrape-interval-ms", "100") as ix:
            feed = ix.feed()

            def loaded():
                feed.poll()
                return feed.pods and feed.pods[0]["waiting"] == 4

            wait_for(loaded, what="scraped load")
            p = feed.pods[0]
            assert (p["running"], p["kv_usage"], p["capacity_blocks"]) == (9, 0.375, 19208)
            assert ix.metric("kvroute_indexer_scrapes_total") >= 1
    finally:
        server.shutdown()
        server.server_close()


def test_dns_discovery_and_silent_pod_timeout(ctx):
    port = h.free_port()
    with h.Indexer("--dns-service", f"localhost:{port}", "--dns-interval-ms", "200", "--model", MODEL,
                   "--scrape-interval-ms", "0", "--pod-timeout-seconds", "1") as ix:
        pod = f"127.0.0.1:{port}"
        wait_for(lambda: pod in ix.pods_debug(), what="pod from DNS")
        assert ix.pods_debug()[pod]["origins"] == ["dns"]
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        pub.send(topic(pod), 0, batch(stored([1], None, range(16))))
        wait_for(lambda: len(feed.of(pod)) == 1, what="block on DNS pod")
        # The pod goes silent: after the timeout its entries are dropped (it stays listed: DNS has it).
        wait_for(lambda: feed.of(pod) == {}, timeout=5, what="silent pod dropped")
        assert ix.metric("kvroute_indexer_pods_expired_total") >= 1
        assert pod in [p["address"] for p in feed.pods]
        pub.close()


def test_several_headless_services_give_their_pods_their_speeds():
    """One --dns-service per pool of one speed (issue 15.1): each record becomes a pod at its
    Service's speed, sent in the feed's pod list; a pod no Service resolves to any more goes."""
    fast, slow = h.free_port(), h.free_port()
    with h.Indexer("--dns-service", f"127.0.0.1:{fast},speed=2", "--dns-service", f"127.0.0.2:{slow}@other,speed=0.5",
                   "--dns-interval-ms", "200", "--model", MODEL, "--scrape-interval-ms", "0") as ix:
        pods = {f"127.0.0.1:{fast}": (2.0, [MODEL]), f"127.0.0.2:{slow}": (0.5, ["other"])}
        wait_for(lambda: set(ix.pods_debug()) == set(pods), what="both Services' pods")
        debug = ix.pods_debug()
        assert {a: (p["speed"], p["models"]) for a, p in debug.items()} == pods
        feed = ix.feed()
        feed.poll()
        assert {p["address"]: p["speed"] for p in feed.pods} == {a: s for a, (s, _) in pods.items()}


def test_a_bad_speed_is_refused_at_start_naming_the_flag():
    r = subprocess.run([str(h.indexer_binary()), "--pod=127.0.0.1:8000,speed=0"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode != 0
    assert "--pod" in r.stderr and "speed 0 is not in (0, 1000]" in r.stderr, r.stderr


def test_event_flood_is_bounded_and_measured(ctx):
    """A flood through a tiny queue: drops are counted, every message is
    accounted for, memory stays bounded, and the stream recovers."""
    with h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0", "--queue-capacity", "8",
                   "--max-blocks-per-pod", "5000", "--feed-log-hashes", "20000") as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        base = ix.metric("kvroute_indexer_messages_received_total")
        rss0 = ix.rss_bytes()
        n = 20000
        # Encode first, then send in a tight loop: the publisher outruns the applier.
        payloads = [batch(stored([seq * 64 + i for i in range(32)], None, range(seq, seq + 16 * 32)))
                    for seq in range(n)]
        t = topic(POD)
        for seq, payload in enumerate(payloads):
            pub.send(t, seq, payload)
        def settled():
            got = ix.metric("kvroute_indexer_messages_received_total") - base
            return got if got >= n else None
        wait_for(settled, timeout=60, what="all messages received")
        dropped = ix.metric("kvroute_indexer_messages_dropped_total", reason="queue_full")
        stored_events = ix.metric("kvroute_indexer_events_total", type="BlockStored")
        assert dropped + stored_events == n, (dropped, stored_events)
        print(f"flood: {n} sent, {stored_events:.0f} applied, {dropped:.0f} dropped (queue full)")
        assert dropped > 0, "an 8-slot queue under a 20k-message burst must drop"
        # Drops show up as sequence gaps (what a replay socket would fill).
        assert ix.metric("kvroute_indexer_seq_gaps_total") > 0
        assert ix.metric("kvroute_indexer_blocks") <= 5000
        assert ix.metric("kvroute_indexer_feed_log_hashes") <= 20000
        assert ix.rss_bytes() - rss0 < 200 << 20
        # Recovery: a restart at seq 0 clears and the next message applies.
        feed = ix.feed()
        pub.send(topic(POD), 0, batch(CLEARED, stored([1], None, range(16))))
        wait_for(lambda: feed.of(POD) == {h.KEYS_0_63_QWEN[0]: "gpu"}, what="recovery after flood")
        pub.close()


def test_a_snapshot_is_served_in_pages(ctx):
    """--feed-max-hashes bounds every answer: a snapshot of 5 blocks at 2 per answer comes
    in 3 to 5 pages (key ranges sized to about 15/16 of a page, cut where one overflows),
    counted in /metrics, and the consumer ends with all 5."""
    with h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0", "--feed-max-hashes", "2") as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        pub.send(topic(POD), 0, batch(stored([1, 2, 3, 4, 5], None, range(80))))
        wait_for(lambda: ix.metric("kvroute_indexer_blocks") == 5, what="5 blocks indexed")
        pages_before = ix.metric("kvroute_indexer_feed_requests_total", kind="snapshot_page")
        feed = ix.feed()
        assert len(feed.of(POD)) == 5
        follow_ups = ix.metric("kvroute_indexer_feed_requests_total", kind="snapshot_page") - pages_before
        assert 2 <= follow_ups <= 4, follow_ups
        assert all(len(k) <= 2 for _, _, _, k in h.decode_feed(ix.get("/v1/feed"))["ops"])
        pub.close()


def test_http_api_surface():
    with h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0") as ix:
        assert ix.get("/healthz") == b"ok\n"
        text = ix.get("/metrics").decode()
        for name in ["kvroute_indexer_events_total", "kvroute_indexer_decode_errors_total",
                     "kvroute_indexer_seq_gaps_total", "kvroute_indexer_replays_total", "kvroute_indexer_pods",
                     "kvroute_indexer_blocks", "kvroute_indexer_memory_bytes", "kvroute_indexer_feed_lag_ops",
                     "kvroute_indexer_apply_lag_seconds"]:
            assert f"# TYPE {name}" in text or f"# TYPE {name.removesuffix('_total')}" in text, name
        f = ix.feed()
        u = f.poll()
        assert u["snapshot"] and u["epoch"] != 0
        u2 = f.poll()
        assert not u2["snapshot"] and u2["ops"] == [] and u2["cursor"] == u["cursor"]
        # An idle poll carries no pod list: the consumer keeps the one it has.
        assert u2["pods"] is None and u2["load"] is None and f.pods[0]["address"] == POD
        q = f"epoch={f.epoch}&cursor={f.cursor}&pods={f.pods_version}&load={f.load_version}"
        assert len(ix.get(f"/v1/feed?{q}")) == 41
        # Unknown epoch -> snapshot again.
        raw = ix.get(f"/v1/feed?epoch={u['epoch'] + 1}&cursor=0")
        assert h.decode_feed(raw)["snapshot"]
        for path in ["/v1/feed?epoch=x", "/nope"]:
            try:
                ix.get(path)
                raise AssertionError(path)
            except h.urllib.error.HTTPError as e:
                assert e.code in (400, 404)
        status, _ = ix.post("/v1/feed", b"")
        assert status == 405
