"""kvroute-indexer against the event shapes real vLLM sends beyond the plain case (issue 12),
hand-built with msgpack and published over ZMQ to the real binary: CPU-offload placeholders
in the GPU pool's batch, an invalid event amid valid ones, cache_salt in extra_keys, and the
KV-cache groups of hybrid models."""

import indexer_harness as h
from indexer_harness import MODEL, batch, removed, stored, topic, wait_for

POD = "127.0.0.1:18997"  # an identity only: nothing listens there (scraping is off)

# kvroute hashes of tokens 0..63 (block 16) for MODEL with block 0's extra keys ["tenant-a"],
# pinned in core/src/hash.rs (computed independently with Python's xxhash).
TOKENS_0_63_QWEN_SALT_A = [0x769738A1A2A3170F, 0x16B6CF6BC3874FF8, 0x2F877728C12151C8, 0x5EA88B848750F30D]


def indexer():
    return h.Indexer("--pod", f"{POD}@{MODEL}", "--scrape-interval-ms", "0")


def placeholder(hashes) -> dict:
    """What vLLM's OffloadingConnector publishes for blocks copied to CPU memory."""
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": None, "token_ids": [],
            "block_size": 0, "lora_id": None, "medium": "CPU", "lora_name": None}


def test_offload_placeholders_in_the_gpu_batch(ctx):
    with indexer() as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        pub.send(topic(POD), 0, batch(stored([1, 2], None, range(32)), placeholder([1, 777]),
                                      stored([3, 4], 2, range(32, 64))))
        got = wait_for(lambda: feed.of(POD) if len(feed.of(POD)) == 4 else None, what="the batch's GPU blocks")
        assert got == {x: "gpu" for x in h.KEYS_0_63_QWEN}
        assert ix.metric("kvroute_indexer_placeholder_blocks_total", result="applied") == 1
        assert ix.metric("kvroute_indexer_placeholder_blocks_total", result="unknown") == 1
        # Evicted from the GPU, block 1 is still in CPU memory, as the placeholder said.
        pub.send(topic(POD), 1, batch(removed([1])))
        wait_for(lambda: feed.of(POD).get(h.KEYS_0_63_QWEN[0]) == "cpu", what="block 1 served from CPU")
        for name in ("decode_errors_total", "events_skipped_total", "seq_gaps_total", "joined_midstream_total"):
            assert ix.metric(f"kvroute_indexer_{name}") == 0, name
        pub.close()


def test_an_invalid_event_is_skipped_and_its_neighbours_apply(ctx):
    with indexer() as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        bad = {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": "not tokens",
               "block_size": 16}
        pub.send(topic(POD), 0, batch(stored([1, 2], None, range(32)), bad, stored([3, 4], 2, range(32, 64))))
        wait_for(lambda: len(feed.of(POD)) == 4, what="both good events")
        assert ix.metric("kvroute_indexer_events_skipped_total", reason="invalid") == 1
        assert ix.metric("kvroute_indexer_decode_errors_total") == 0
        pub.send(topic(POD), 1, batch(removed([4])))
        wait_for(lambda: len(feed.of(POD)) == 3, what="the next message")
        assert ix.metric("kvroute_indexer_seq_gaps_total") == 0
        pub.close()


def test_cache_salt_in_extra_keys_scopes_the_rehash(ctx):
    with indexer() as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        salted = stored([1, 2, 3, 4], None, range(64))
        salted["extra_keys"] = [["tenant-a"], None, None, None]
        pub.send(topic(POD), 0, batch(salted))
        got = wait_for(lambda: feed.of(POD) if len(feed.of(POD)) == 4 else None, what="salted blocks")
        assert got == {h.key(x): "gpu" for x in TOKENS_0_63_QWEN_SALT_A}
        # The same tokens without salt are other blocks (vLLM would not share them either).
        pub.send(topic(POD), 1, batch(stored([11, 12, 13, 14], None, range(64))))
        wait_for(lambda: len(feed.of(POD)) == 8, what="unsalted blocks beside them")
        assert set(h.KEYS_0_63_QWEN) <= set(feed.of(POD))
        pub.close()


def test_hybrid_groups_evict_on_their_own_and_only_full_attention_routes(ctx):
    with indexer() as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        full = stored([1, 2], None, range(32)) | {"kv_cache_spec_kind": "full_attention", "group_idx": 0}
        window = stored([1, 2], None, range(32)) | {"kv_cache_spec_kind": "sliding_window", "group_idx": 1}
        pub.send(topic(POD), 0, batch(full, window))
        wait_for(lambda: len(feed.of(POD)) == 2, what="full-attention blocks")
        assert ix.metric("kvroute_indexer_blocks_not_routed_total") == 2
        # The window slides past block 1: the full-attention group still holds it.
        pub.send(topic(POD), 1, batch(removed([1]) | {"group_idx": 1}, removed([2]) | {"group_idx": 0}))
        wait_for(lambda: ix.metric("kvroute_indexer_blocks_not_routed_total") == 3, what="the window's removal")
        wait_for(lambda: len(feed.of(POD)) == 1, what="group 0's removal")
        assert feed.of(POD) == {h.KEYS_0_63_QWEN[0]: "gpu"}
        assert ix.metric("kvroute_indexer_removed_unknown_total") == 0
        pub.close()
