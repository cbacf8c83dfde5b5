"""Precise mode end to end (issue 4): vllm-sim pods publish real KV events over ZMQ to the real
kvroute-indexer; the singleton in Envoy polls its feed and every worker routes on what the pods
truly hold — including after eviction (BlockRemoved), after a flush (AllBlocksCleared), through
the /tokenize call-out, and across an indexer outage. Learned entries are shared only by
holders of the indexer's token: a client without it cannot steer anyone's routing."""

import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import zmq

from e2elib import MODEL, POD, decision, require_wasm, wait_for
from envoyctl import GATEWAY, GATEWAY_PRECISE, EnvoyProcess, render_gateway
from indexerctl import TOKEN_ENV, IndexerProcess
from simcluster import SimCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "indexer"))
import indexer_harness as ih  # noqa: E402

CAPACITY = 256  # blocks per pod: small, so eviction is cheap to provoke


@pytest.fixture(scope="module")
def stack():
    require_wasm()
    indexer = IndexerProcess((), "--scrape-interval-ms=200")
    with SimCluster(pods=3, time_scale=0.2, num_gpu_blocks=CAPACITY, kv_events_endpoint=indexer.zmq_endpoint) as sims:
        indexer.pods = sims.addresses
        with indexer:
            config = render_gateway(sims.addresses, {"default_capacity_blocks": CAPACITY},
                                    template=GATEWAY_PRECISE, indexer=indexer.address)
            with EnvoyProcess(config) as envoy:
                envoy.wait_for_peers()
                yield sims, indexer, envoy


def feed_ok(envoy) -> int:
    return envoy.stats("wasmcustom.kvroute.feed.ok").get("wasmcustom.kvroute.feed.ok", 0)



def settle(envoy, polls=3):
    """Lets the singleton poll the feed a few more times and publish what it applied."""
    start = feed_ok(envoy)
    wait_for("feed polls", lambda: feed_ok(envoy) >= start + polls)
    envoy.wait_for_index_flush()


def tokens(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 100 for i in range(blocks * 16)]


def direct_completion(sims, pod: int, ids: list[int]) -> None:
    r = requests.post(sims.urls[pod] + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1},
                      timeout=30)
    assert r.status_code == 200, r.text


def routed_completion(envoy, ids: list[int]) -> requests.Response:
    r = requests.post(envoy.url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_routes_to_the_pod_that_truly_holds_the_prefix(stack):
    sims, indexer, envoy = stack
    for pod in range(3):
        ids = tokens(100 + pod, 20)
        direct_completion(sims, pod, ids)  # only the KV events can tell Envoy about this
        wait_for("indexer sees the blocks", lambda: indexer.blocks(sims.addresses[pod]) >= 20)
        settle(envoy)
        d = decision(routed_completion(envoy, ids + [1, 2, 3]))
        assert (d["pod"], d["matched"], d["domain"]) == (sims.addresses[pod], 20, "tokens"), d["raw"]


def test_a_load_change_reaches_the_workers_without_the_pod_list(stack):
    """The indexer scrapes the pods every 200 ms here. When only their load changes, the singleton
    forwards the load alone (`feed.forwarded_loads`) and every worker applies it by the pod's
    place in the list it holds: two streams started on a pod directly, past Envoy, show in the
    running term of the next decision for a prompt that pod holds, and leave it once they end.
    (Workers that ignored the load alone would see it only with the list, every 10 s.)"""
    sims, indexer, envoy = stack
    pod = sims.addresses[1]
    ids = tokens(43, 20)
    direct_completion(sims, 1, ids)
    wait_for("indexer sees the blocks", lambda: indexer.blocks(pod) >= 20)
    settle(envoy)

    def running_term() -> float:
        d = decision(routed_completion(envoy, ids + [7]))
        assert d["pod"] == pod and d["matched"] == 20, d["raw"]
        m = re.search(r" running=([0-9.]+)", d["raw"])
        return float(m.group(1)) if m else 0.0

    def forwarded_loads() -> int:
        name = "wasmcustom.kvroute.feed.forwarded_loads"
        return envoy.stats(name).get(name, 0)

    def reported_running() -> int:
        return indexer.pods_debug()[pod]["running"]

    stop = threading.Event()

    def stream():
        body = {"model": MODEL, "max_tokens": 3000, "stream": True, "ignore_eos": True,
                "messages": [{"role": "user", "content": "write"}]}
        with requests.post(sims.urls[1] + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    break

    before = forwarded_loads()
    streams = [threading.Thread(target=stream) for _ in range(2)]
    for t in streams:
        t.start()
    try:
        wait_for("the indexer scrapes both streams", lambda: reported_running() == 2, timeout=5)
        # A poll (100 ms) and the forward; no request is in flight on the pod when the load lands.
        time.sleep(0.5)
        # 0.07 (running_per_block) × 20 blocks × 2 running; a single request would be 1.4.
        assert running_term() >= 2.5
    finally:
        stop.set()
        for t in streams:
            t.join(timeout=60)
    wait_for("the indexer sees them end", lambda: reported_running() == 0, timeout=15)
    time.sleep(0.5)
    assert running_term() == 0.0
    assert forwarded_loads() >= before + 2


def test_eviction_and_flush_remove_entries(stack):
    sims, indexer, envoy = stack
    ids = tokens(200, 20)
    direct_completion(sims, 1, ids)
    wait_for("indexer sees the blocks", lambda: indexer.blocks(sims.addresses[1]) >= 20)
    settle(envoy)
    assert decision(routed_completion(envoy, ids))["matched"] == 20
    # Other prompts on pod 1 evict ours (LRU): BlockRemoved events remove them everywhere.
    for seed in range(300, 300 + 2 * CAPACITY // 20 + 2):
        direct_completion(sims, 1, tokens(seed, 20))
    settle(envoy)
    d = decision(routed_completion(envoy, ids))
    assert d["matched"] == 0, d["raw"]
    # A flushed pod (AllBlocksCleared) holds nothing.
    fresh = tokens(400, 12)
    direct_completion(sims, 2, fresh)
    wait_for("indexer sees the blocks", lambda: indexer.blocks(sims.addresses[2]) >= 12)
    settle(envoy)
    assert decision(routed_completion(envoy, fresh))["pod"] == sims.addresses[2]
    requests.post(sims.urls[2] + "/admin/flush", timeout=10).raise_for_status()
    wait_for("indexer drops the pod's blocks", lambda: indexer.blocks(sims.addresses[2]) == 0)
    settle(envoy)
    d = decision(routed_completion(envoy, fresh))
    assert d["matched"] == 0, d["raw"]


def test_chat_requests_get_token_ids_from_the_tokenizer_call_out(stack):
    sims, indexer, envoy = stack
    body = {"model": MODEL, "max_tokens": 1,
            "messages": [{"role": "system", "content": "precise chat " * 200}, {"role": "user", "content": "hi"}]}
    r = requests.post(sims.urls[0] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200
    settle(envoy, polls=5)
    r = requests.post(envoy.url + "/v1/chat/completions", json=body, timeout=30)
    d = decision(r)
    assert (d["pod"], d["domain"]) == (sims.addresses[0], "tokens"), d["raw"]
    assert d["matched"] >= d["total"] - 1 > 10, d["raw"]
    stats = envoy.stats("wasmcustom.kvroute.tokenizer")
    assert stats["wasmcustom.kvroute.tokenizer.ok"] >= 1


def test_indexer_outage_fails_open_and_recovers(stack):
    sims, indexer, envoy = stack
    errors = lambda: envoy.stats("wasmcustom.kvroute.feed.errors").get("wasmcustom.kvroute.feed.errors", 0)  # noqa: E731
    before = errors()
    indexer.stop(signal.SIGKILL)
    for i in range(10):
        assert routed_completion(envoy, tokens(500 + i, 4)).headers[POD] in sims.addresses
    wait_for("feed errors counted", lambda: errors() > before)
    indexer.start()  # same ports; a new epoch: the singleton gets a snapshot
    # The pods' publishers reconnect; events published before the new subscription reaches
    # them are lost (ZMQ slow joiner), so wait until one gets through.
    seed = iter(range(700, 800))
    wait_for("events flow again", lambda: direct_completion(sims, 2, tokens(next(seed), 2)) or
             indexer.pods_debug()[sims.addresses[2]]["sources"], timeout=15)
    ids = tokens(600, 16)
    direct_completion(sims, 2, ids)
    wait_for("indexer sees the blocks", lambda: indexer.blocks(sims.addresses[2]) >= 16)
    settle(envoy)
    d = decision(routed_completion(envoy, ids))
    assert (d["pod"], d["matched"]) == (sims.addresses[2], 16), d["raw"]


def test_gateway_replicas_learn_as_one(stack):
    """Byte-fallback decisions of one proxy reach the others through the indexer (POST /v1/learned
    → feed), so a second gateway sends the same prefix to the same pod without ever seeing it.
    (No tokenizer call-out here, so string prompts route on bytes.)"""
    sims, indexer, _ = stack
    config = lambda: render_gateway(sims.addresses, {"default_capacity_blocks": CAPACITY, "tokenizer": None},  # noqa: E731
                                    template=GATEWAY_PRECISE, indexer=indexer.address)
    with EnvoyProcess(config()) as one, EnvoyProcess(config()) as other:
        one.wait_for_peers()
        other.wait_for_peers()
        for i in range(3):
            prompt = f"replica-{i} " + "a shared preamble for every replica " * 40
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            first = decision(requests.post(one.url + "/v1/completions", json=body, timeout=30))
            assert first["domain"] == "bytes"
            settle(one)  # the singleton reports it
            settle(other)  # the other proxy's singleton reads it from the feed
            d = decision(requests.post(other.url + "/v1/completions", json=body, timeout=30))
            assert (d["pod"], d["matched"]) == (first["pod"], first["total"]), (first["raw"], d["raw"])


def test_a_prompt_routed_on_tokens_teaches_its_bytes_for_a_failed_tokenizer_call(stack):
    """A prompt routed on its token ids also teaches its byte chunks on the pod (shared through the
    indexer once confirmed): when a later request of the same prompt cannot get token ids (its
    tokenizer call fails, or, as here, a proxy has none), it routes on bytes and still finds the
    pod that holds the prefix, instead of treating it as a new prompt."""
    sims, indexer, envoy = stack
    config = render_gateway(sims.addresses, {"default_capacity_blocks": CAPACITY, "tokenizer": None},
                            template=GATEWAY_PRECISE, indexer=indexer.address)
    with EnvoyProcess(config) as untokenized:
        untokenized.wait_for_peers()
        for i in range(3):
            body = {"model": MODEL, "max_tokens": 1,
                    "messages": [{"role": "system", "content": f"fallback {i} " + "a long shared system prompt " * 60},
                                 {"role": "user", "content": "hi"}]}
            first = decision(requests.post(envoy.url + "/v1/chat/completions", json=body, timeout=30))
            assert first["domain"] == "tokens", first["raw"]
            settle(envoy)  # the confirmed byte chunks reach the indexer
            settle(untokenized)  # and its feed
            d = decision(requests.post(untokenized.url + "/v1/chat/completions", json=body, timeout=30))
            assert d["domain"] == "bytes", d["raw"]
            assert (d["pod"], d["matched"]) == (first["pod"], d["total"]), (first["raw"], d["raw"])


@pytest.mark.parametrize("routed_on", ["bytes", "tokens"])
def test_repeats_of_a_prompt_report_nothing_they_did_not_teach(stack, routed_on):
    """A confirmed request reports to the indexer only the byte chunks it taught itself: repeats of
    a prompt within an epoch (index.ttl_seconds / 16, 38 s here) find its chunks already taught and
    add no learned entries, whether the prompt routes on bytes or on token ids (its byte-fallback
    chunks). Before, every repeat re-posted its whole chain. One epoch boundary may fall inside the
    test, so the repeats may report the chain once more, not four times."""
    sims, indexer, envoy = stack
    untokenized = None
    if routed_on == "bytes":
        untokenized = EnvoyProcess(render_gateway(sims.addresses, {"default_capacity_blocks": CAPACITY, "tokenizer": None},
                                                  template=GATEWAY_PRECISE, indexer=indexer.address))
        proxy = untokenized.__enter__()
        proxy.wait_for_peers()
    else:
        proxy = envoy
    try:
        body = {"model": MODEL, "max_tokens": 1,
                "messages": [{"role": "system", "content": f"repeats on {routed_on} " + "a long system prompt " * 60},
                             {"role": "user", "content": "hi"}]}

        def reported(times):
            """Learned entries the indexer accepted for `times` requests of the prompt."""
            before = indexer.metric("kvroute_indexer_learned_accepted_total")
            sent = []
            for _ in range(times):
                proxy.wait_for_index_flush()  # the index shows what the previous one taught
                sent.append(decision(requests.post(proxy.url + "/v1/chat/completions", json=body, timeout=30)))
                assert sent[-1]["domain"] == routed_on, sent[-1]["raw"]
            settle(proxy)  # the singleton posts what was confirmed
            return indexer.metric("kvroute_indexer_learned_accepted_total") - before, sent

        chain, [first] = reported(1)
        assert chain > 0, first["raw"]
        again, repeats = reported(4)
        assert all((d["pod"], d["matched"]) == (first["pod"], d["total"]) for d in repeats), [d["raw"] for d in repeats]
        assert again <= chain, (chain, again)
    finally:
        if untokenized is not None:
            untokenized.__exit__(None, None, None)


def test_completion_prompts_get_token_ids_from_the_tokenizer_call_out(stack):
    sims, indexer, envoy = stack
    body = {"model": MODEL, "prompt": "a completion prompt " * 100, "max_tokens": 1}
    assert requests.post(sims.urls[1] + "/v1/completions", json=body, timeout=30).status_code == 200
    settle(envoy, polls=5)
    d = decision(requests.post(envoy.url + "/v1/completions", json=body, timeout=30))
    assert (d["pod"], d["domain"]) == (sims.addresses[1], "tokens"), d["raw"]
    assert d["matched"] >= d["total"] - 1 > 10, d["raw"]


def test_prompts_sharing_an_earlier_prompts_text_skip_the_call_out(stack):
    """The token memo: once two call-outs of a worker show where prompts of a shared prefix part,
    the worker recalls that prefix's token blocks for the next such prompt without a call-out,
    and routes it like the call-out did; an equal prompt recalls every block."""
    sims, indexer, envoy = stack
    system = " ".join(f"memo{i % 97} word{i}" for i in range(400))
    direct = {"model": MODEL, "prompt": system + " held by pod two", "max_tokens": 1}
    assert requests.post(sims.urls[2] + "/v1/completions", json=direct, timeout=30).status_code == 200
    settle(envoy, polls=5)
    counters = lambda: envoy.settled_stats("wasmcustom.kvroute.tokenizer")  # noqa: E731
    before = counters()
    decisions = []
    for i in range(10):
        body = {"model": MODEL, "prompt": f"{system} question {i}: why {i * 7}?", "max_tokens": 1}
        decisions.append(decision(requests.post(envoy.url + "/v1/completions", json=body, timeout=30)))
    after = counters()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    recalled = [d for d in decisions if "tokens=memo (shared prefix)" in d["raw"]]
    assert recalled, [d["raw"] for d in decisions]
    assert delta["wasmcustom.kvroute.tokenizer.recalled"] == len(recalled)
    assert delta["wasmcustom.kvroute.tokenizer.ok"] + len(recalled) == len(decisions), delta
    called = [d for d in decisions if "tokens=memo" not in d["raw"]]
    shared = min(d["matched"] for d in called)
    assert shared > 20, [d["raw"] for d in called]
    for d in decisions:
        assert (d["pod"], d["domain"]) == (sims.addresses[2], "tokens"), d["raw"]
    for d in recalled:
        # The memo keeps back the blocks near where prompts part (chunk_bytes / block_size + 1).
        assert shared - 6 <= d["matched"] <= shared, d["raw"]
        assert d["total"] >= d["matched"], d["raw"]
    # An equal prompt: every block, once the worker that takes it has seen it.
    body = {"model": MODEL, "prompt": f"{system} question 0: why 0?", "max_tokens": 1}
    settle(envoy, polls=5)
    for _ in range(8):
        d = decision(requests.post(envoy.url + "/v1/completions", json=body, timeout=30))
        if "tokens=memo (whole prompt)" in d["raw"]:
            break
    else:
        raise AssertionError(f"no whole-prompt recall: {d['raw']}")
    assert d["pod"] == sims.addresses[2] and d["matched"] == d["total"] >= shared, d["raw"]


def token_block_hashes(prompts: list[list[int]]) -> list[list[int]]:
    """kvroute's token-domain block hashes of each prompt, as an attacker computes them (the hash
    is public): here with kvroute's own code, a scratch indexer re-hashing one BlockStored event
    per prompt, each for a pod of its own that exists nowhere else."""
    pods = [f"127.0.0.1:{i + 1}" for i in range(len(prompts))]
    flags = [f for p in pods for f in ("--pod", f"{p}@{MODEL}")] + ["--scrape-interval-ms", "0"]
    ctx = zmq.Context()
    try:
        with ih.Indexer(*flags) as oracle:
            pub = ih.Publisher(ctx, oracle.zmq_endpoint)
            ih.wait_subscribed(oracle, pub)
            for pod, ids in zip(pods, prompts):
                n = len(ids) // 16
                pub.send(ih.topic(pod), 0, ih.batch(ih.stored(range(1, n + 1), None, ids[:16 * n])))
            feed = oracle.feed()
            ih.wait_for(lambda: all(len(feed.of(p)) == len(ids) // 16 for p, ids in zip(pods, prompts)),
                        what="the scratch indexer hashed every prompt")
            pub.close()
            return [list(feed.of(p)) for p in pods]
    finally:
        ctx.destroy(linger=0)


def test_a_client_without_the_token_cannot_steer_fresh_prompts(stack):
    """Issue 13's attack: a client posts learned entries claiming that a chosen pod holds prompts
    nobody has sent yet (~300 bytes per prompt). Without the indexer's token (none, or a wrong
    one) the posts are refused and every fresh prompt is routed on load, no prefix match. The
    control: the same posts with the token are taken and steer every prompt, which is also
    what a leaked token can still do (a fresh prompt's token hashes cannot be told from byte
    chunks), so the token belongs to the gateways alone."""
    sims, indexer, envoy = stack
    victim = sims.addresses[2]
    blocks = 20
    attempts = {"no token": (None, 2000), "wrong token": ("f" * 64, 2100), "the token": (indexer.learned_token, 2200)}
    steered = {}
    for who, (token, seed) in attempts.items():
        prompts = [tokens(seed + i, blocks) for i in range(10)]
        statuses = set()
        for ids, hashes in zip(prompts, token_block_hashes(prompts)):
            statuses.add(indexer.post("/v1/learned", ih.encode_learned([(victim, hashes)]), token)[0])
        settle(envoy)
        decisions = [decision(routed_completion(envoy, ids)) for ids in prompts]
        steered[who] = (statuses, sum(d["pod"] == victim and d["matched"] == blocks for d in decisions),
                        sum(d["matched"] for d in decisions))
    assert steered == {"no token": ({401}, 0, 0), "wrong token": ({401}, 0, 0),
                       "the token": ({200}, 10, 10 * blocks)}, steered
    assert indexer.metric("kvroute_indexer_learned_unauthorized_total", reason="missing_token") >= 10
    assert indexer.metric("kvroute_indexer_learned_unauthorized_total", reason="wrong_token") >= 10


def test_token_domain_decisions_are_not_shared(stack):
    """Pod-reported (token) blocks posted as learned for another pod are dropped and counted;
    the proxy keeps routing them to the pod that truly holds them."""
    sims, indexer, envoy = stack
    ids = tokens(2300, 12)
    direct_completion(sims, 0, ids)
    wait_for("indexer sees the blocks", lambda: indexer.blocks(sims.addresses[0]) >= 12)
    (hashes,) = token_block_hashes([ids])
    before = indexer.metric("kvroute_indexer_learned_token_domain_total")
    status, body = indexer.post("/v1/learned", ih.encode_learned([(sims.addresses[1], hashes)]),
                                indexer.learned_token)
    assert status == 200 and b'"token_domain":12' in body, body
    assert indexer.metric("kvroute_indexer_learned_token_domain_total") == before + 12
    settle(envoy)
    d = decision(routed_completion(envoy, ids + [1, 2, 3]))
    assert (d["pod"], d["matched"]) == (sims.addresses[0], 12), d["raw"]


@pytest.mark.parametrize("token", [None, "", "a-token-for-the-singleton-0123"])
def test_the_singleton_refuses_a_token_variable_missing_from_its_vm(monkeypatch, token):
    """indexer.token_env names a variable Envoy must pass to the singleton's VM (host_env_keys):
    unset or empty, the configuration is refused at load, naming the field, and Envoy does not
    start (as for any refused bootstrap configuration; `envoy --mode validate` does not load the
    singleton, so this starts Envoy)."""
    require_wasm()
    if token is None:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(TOKEN_ENV, token)
    envoy = EnvoyProcess(render_gateway(["127.0.0.1:18001"], template=GATEWAY_PRECISE, indexer="127.0.0.1:18090"))
    try:
        if token:
            envoy.start()
            assert envoy.proc.poll() is None
        else:
            with pytest.raises(RuntimeError):
                envoy.start()
            log = envoy.log_text()
            assert f"field `indexer.token_env`: environment variable {TOKEN_ENV} is unset or empty" in log, \
                envoy.log_tail()
    finally:
        envoy.__exit__(None, None, None)


@pytest.mark.parametrize("precise", [False, True], ids=["approximate", "precise"])
def test_hot_restart_loses_the_proxy_index_and_the_feed_refills_it(stack, precise):
    """Envoy's hot restart does not hand Wasm VMs or their shared data to the new process: in
    approximate mode every learned prefix is gone (the next request of each routes by load and is
    learned again); in precise mode the new singleton's first feed snapshot brings back what the
    gateways shared (byte-domain decisions here, no tokenizer) and the prefixes stay on their pods.
    docs/operator-guide.md, section 10."""
    sims, indexer, _ = stack
    if precise:
        config = render_gateway(sims.addresses, {"default_capacity_blocks": CAPACITY, "tokenizer": None},
                                template=GATEWAY_PRECISE, indexer=indexer.address)
    else:
        config = render_gateway(sims.addresses, {"default_capacity_blocks": CAPACITY}, template=GATEWAY)
    prompts = [f"hot-restart-{precise}-{i} " + "a long shared preamble of this tenant " * 30 for i in range(10)]
    with EnvoyProcess(config, hot_restart=True) as envoy:

        def route(prompt):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            return decision(requests.post(envoy.url + "/v1/completions", json=body, timeout=30))

        envoy.wait_for_peers()
        accepted = indexer.metric("kvroute_indexer_learned_accepted_total")
        before, reported = {}, 0
        for p in prompts:
            reported += route(p)["total"]  # the repeat below reports nothing it did not teach
            envoy.wait_for_index_flush()  # the singleton publishes what the first taught
            d = route(p)
            assert d["matched"] == d["total"] > 0, d["raw"]
            before[p] = d["pod"]
        if precise:
            wait_for("the decisions reach the indexer",
                     lambda: indexer.metric("kvroute_indexer_learned_accepted_total") >= accepted + reported)
        envoy.hot_restart()
        envoy.wait_for_peers()
        if precise:
            settle(envoy)  # the new singleton's first polls, published
        after = [route(p) for p in prompts]
        if precise:
            assert [(d["pod"], d["matched"] == d["total"]) for d in after] == [(before[p], True) for p in prompts]
        else:
            assert [d["matched"] for d in after] == [0] * len(prompts)
            envoy.wait_for_index_flush()
            assert all(route(p)["matched"] > 0 for p in prompts), "learned again"


def test_a_snapshot_of_many_pages_loads_whole_into_a_new_gateway():
    """A new gateway takes the indexer's snapshot page by page (`--feed-max-hashes` 16 here: a
    dozen pages), asking for each next page before it applies the one in hand, then routes every
    prompt on the blocks its pod truly holds, those of the last pages included."""
    require_wasm()
    indexer = IndexerProcess((), "--scrape-interval-ms=200", "--feed-max-hashes", "16")
    with SimCluster(pods=2, time_scale=0.2, num_gpu_blocks=CAPACITY, kv_events_endpoint=indexer.zmq_endpoint) as sims:
        indexer.pods = sims.addresses
        with indexer:
            prompts = [(pod, tokens(300 + 10 * pod + i, 24)) for pod in range(2) for i in range(4)]
            for pod, ids in prompts:
                direct_completion(sims, pod, ids)
            for pod in range(2):
                wait_for("indexer sees the blocks", lambda pod=pod: indexer.blocks(sims.addresses[pod]) >= 4 * 24)
            config = render_gateway(sims.addresses, {"default_capacity_blocks": CAPACITY},
                                    template=GATEWAY_PRECISE, indexer=indexer.address)
            with EnvoyProcess(config) as envoy:
                envoy.wait_for_peers()
                wait_for("the snapshot loaded", lambda: envoy.stats("wasmcustom.kvroute.feed.snapshots").get(
                    "wasmcustom.kvroute.feed.snapshots", 0) >= 1)
                envoy.wait_for_index_flush()
                pages = envoy.stats("wasmcustom.kvroute.feed.pages")["wasmcustom.kvroute.feed.pages"]
                assert pages >= 12, f"{pages} pages: the snapshot must come in many"
                for pod, ids in prompts:
                    d = decision(routed_completion(envoy, ids + [1, 2, 3]))
                    assert (d["pod"], d["matched"], d["domain"]) == (sims.addresses[pod], 24, "tokens"), d["raw"]
                applied = envoy.stats("wasmcustom.kvroute.feed.apply_us")["wasmcustom.kvroute.feed.apply_us"]
                assert applied > 0, "the singleton counts the time it spends on feed answers"
