"""Two kvroute-indexer replicas behind one Envoy (issue 10).

Both replicas subscribe to every vllm-sim pod. The pods bind their publishers, so both replicas
can connect to each of them; a pod that connects can reach only one subscriber. Envoy's indexer
cluster lists the replicas in priority order, health-checked (integration/envoyctl.py
INDEXER_REPLICAS).

The test kills the replica the singleton polls while clients keep sending requests, and checks
that:
- no request fails;
- every decision is still made on the index (the pod holding the prompt, all its blocks matched);
- blocks published after the kill reach Envoy through the other replica.

The singleton needs no change for the failover. The other replica's epoch differs, so its first
answer to the old cursor is a snapshot."""

import signal
import threading
import time

import pytest
import requests

from e2elib import DECISION, MODEL, decision, require_wasm, wait_for
from envoyctl import GATEWAY_PRECISE, EnvoyProcess, render_gateway
from indexerctl import IndexerProcess
from simcluster import SimCluster

PODS = 3
BLOCKS = 20  # blocks per prompt
CAPACITY = 1024  # blocks per pod: room for every prompt of the test



@pytest.fixture
def stack(tmp_path):
    require_wasm()
    endpoint = f"ipc://{tmp_path}/kv"  # pod i binds <endpoint>-i (pod 0: <endpoint>)
    with SimCluster(pods=PODS, time_scale=0.2, num_gpu_blocks=CAPACITY, kv_events_endpoint=endpoint) as sims:
        connects = [f"--zmq-connect={endpoint}" + (f"-{i}" if i else "") for i in range(PODS)]
        replicas = [IndexerProcess(sims.addresses, "--scrape-interval-ms=200", *connects, bind=False)
                    for _ in range(2)]
        with replicas[0], replicas[1]:
            for r in replicas:
                wait_for("a replica subscribed to every pod",
                         lambda r=r: r.log_text().count("zmq SUB connected") == PODS)
            config = render_gateway(sims.addresses, {"default_capacity_blocks": CAPACITY},
                                    template=GATEWAY_PRECISE, indexer=[r.address for r in replicas])
            with EnvoyProcess(config) as envoy:
                envoy.wait_for_peers()
                yield sims, replicas, envoy


def tokens(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 100 for i in range(BLOCKS * 16)]


def feed_requests(replica) -> float:
    return replica.metric("kvroute_indexer_feed_requests_total")


def feed_polls(envoy) -> int:
    return envoy.stats("wasmcustom.kvroute.feed.ok").get("wasmcustom.kvroute.feed.ok", 0)


def settle(envoy, polls=3):
    """A few more feed polls, and the singleton's publication of what they brought."""
    start = feed_polls(envoy)
    wait_for("feed polls", lambda: feed_polls(envoy) >= start + polls)
    envoy.wait_for_index_flush()


def published(sims, replicas, pod: int, seed: int) -> list[int]:
    """A prompt sent straight to `pod`, once every replica indexes its blocks. Events published
    before a new subscription reaches a publisher are lost (ZMQ slow joiner): take another
    prompt then."""
    for attempt in range(20):
        ids = tokens(seed + attempt)
        before = [r.blocks(sims.addresses[pod]) for r in replicas]
        r = requests.post(sims.urls[pod] + "/v1/completions",
                          json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=30)
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if all(r.blocks(sims.addresses[pod]) >= b + BLOCKS for r, b in zip(replicas, before)):
                return ids
            time.sleep(0.05)
    raise AssertionError(f"pod {pod}'s events never reached every replica")


def test_killing_the_polled_replica_under_load_fails_no_request_and_keeps_routing_on_the_index(stack):
    sims, (first, second), envoy = stack
    prompts = [published(sims, (first, second), pod, 100 * (pod + 1)) for pod in range(PODS)]
    settle(envoy)
    # Priority 0 answers while it is healthy (the second may have answered while Envoy's first
    # health checks were pending): the second replica serves no feed now.
    polled_first, polled_second = feed_requests(first), feed_requests(second)
    settle(envoy, polls=5)
    assert feed_requests(first) >= polled_first + 5
    assert feed_requests(second) == polled_second
    snapshots = envoy.stats("wasmcustom.kvroute.feed.snapshots")["wasmcustom.kvroute.feed.snapshots"]

    answers = []  # (pod holding the prompt, status or exception, decision)
    stop = threading.Event()

    def client(k: int) -> None:
        i = k
        while not stop.is_set():
            pod = i % PODS
            i += 1
            body = {"model": MODEL, "prompt": prompts[pod] + [k + 1, i % 97 + 1], "max_tokens": 1}
            try:
                r = requests.post(envoy.url + "/v1/completions", json=body, timeout=30)
                answers.append((pod, r.status_code, decision(r) if DECISION in r.headers else None))
            except requests.RequestException as e:
                answers.append((pod, repr(e), None))

    clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in clients:
        t.start()
    try:
        wait_for("load before the kill", lambda: len(answers) >= 40)
        first.stop(signal.SIGKILL)
        killed_at = len(answers)
        wait_for("the singleton polls the second replica", lambda: feed_requests(second) > polled_second)
        wait_for("a snapshot from the second replica",
                 lambda: envoy.stats("wasmcustom.kvroute.feed.snapshots")["wasmcustom.kvroute.feed.snapshots"]
                 > snapshots)
        # Blocks published after the kill reach Envoy only through the second replica.
        fresh = published(sims, (second,), 1, 900)
        settle(envoy)
        wait_for("load after the failover", lambda: len(answers) >= killed_at + 80)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=30)

    print(f"{len(answers)} answers, {len(answers) - killed_at} after the kill")
    failed = [a for a in answers if a[1] != 200]
    assert not failed, failed[:5]
    for pod, _, d in answers:
        assert d is not None and (d["pod"], d["matched"]) == (sims.addresses[pod], BLOCKS), d
    d = decision(requests.post(envoy.url + "/v1/completions",
                               json={"model": MODEL, "prompt": fresh + [1], "max_tokens": 1}, timeout=30))
    assert (d["pod"], d["matched"], d["domain"]) == (sims.addresses[1], BLOCKS, "tokens"), d["raw"]
