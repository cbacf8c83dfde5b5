"""A pod killed with requests in flight and started again empty on its address, through the real
Envoy with the shipped gateway config: the answers it cut fail it (a 200 at the headers is not a
confirmation when the stream is then cut), and the requests that died with it stop counting as its
load, so routing returns to it with nothing in flight (issue 11, the `restart` scenario)."""

import threading
import time

import pytest
import requests

from e2elib import MODEL, SERVED, chat, decision, gateway, unique_system, wait_for
from simcluster import PodFleet


@pytest.fixture(scope="module")
def pods():
    """Two pods, one process each, so that one can be killed and restarted alone."""
    with PodFleet(pods=2, time_scale=0.2) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def envoy(pods):
    with gateway(pods.addresses) as proxy:
        yield proxy


def open_stream(envoy, session: requests.Session) -> requests.Response:
    """A long streamed answer: its response has started (headers in) and stays in flight."""
    body = {"model": MODEL, "max_tokens": 4000, "stream": True,
            "messages": [{"role": "system", "content": unique_system(120)}, {"role": "user", "content": "long"}]}
    return session.post(envoy.url + "/v1/chat/completions", json=body, stream=True, timeout=30)


def test_answers_cut_by_a_dying_pod_fail_it_and_stop_counting_as_its_load(envoy, pods):
    address = pods.addresses[0]
    sessions, streams = [], []
    # Streams on both pods until at least two are on the victim (new prompts go to the least loaded).
    for _ in range(12):
        session = requests.Session()
        r = open_stream(envoy, session)
        assert r.status_code == 200
        sessions.append(session)
        streams.append(r)
        if sum(decision(s)["pod"] == address for s in streams) >= 2:
            break
    on_victim = [s for s in streams if decision(s)["pod"] == address]
    assert len(on_victim) >= 2, [decision(s)["raw"] for s in streams]
    failed_before = envoy.stats("kvroute.outcome.failed").get("wasmcustom.kvroute.outcome.failed", 0)
    # Reading them keeps them flowing while the victim dies under them.
    completed = []
    readers = [threading.Thread(target=lambda s=s: completed.append(_drain(s)), daemon=True) for s in on_victim]
    for t in readers:
        t.start()
    killed = pods.kill(0)
    for t in readers:
        t.join(timeout=30)
    assert completed == [False] * len(on_victim), "a stream on the victim was not cut by the kill"
    # Each cut answer is the victim's failure, judged when its stream ended.
    wait_for("the cut answers to be judged failures", lambda: envoy.stats("kvroute.outcome.failed").get(
        "wasmcustom.kvroute.outcome.failed", 0) >= failed_before + len(on_victim))
    for s in streams:
        s.close()
    for session in sessions:
        session.close()
    pods.start_again(0, killed)
    # Once Envoy stops ejecting the restarted pod and kvroute's cooldown ends, a new prompt goes to
    # it (both pods idle, so either is the least loaded) and the decision states its load: nothing
    # in flight. A request that died with the old process and still counted would keep it away.
    seen = []
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        r = chat(envoy, unique_system(40), "after the restart")
        assert r.status_code == 200
        d = decision(r)
        seen.append(d["raw"])
        if d["pod"] == address and r.headers.get(SERVED) == address and "inflight=0 req/0 blocks" in d["raw"]:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the restarted pod was never chosen with nothing in flight; decisions: {seen[-5:]}")
    print(f"\nrestart: the restarted pod was chosen, idle, after {len(seen)} requests")


def _drain(response: requests.Response) -> bool:
    """Reads a streamed answer to its end: whether it completed (its `[DONE]` came)."""
    tail = b""
    try:
        for chunk in response.iter_content(chunk_size=None):
            tail = (tail + chunk)[-64:]
    except requests.RequestException:
        return False
    return b"[DONE]" in tail
