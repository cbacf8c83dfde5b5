"""simcluster.PodFleet (the benchmark's `restart` profile): one vllm-sim process per pod, so one pod can be
killed and started again on its address — empty — while a subscriber connected to its KV-event endpoint
keeps receiving, from the new process, without reconnecting by hand."""

import queue

import requests

import simcluster
from vllmsim_zmq import Sub

MODEL = "Qwen/Qwen3-32B"


def complete(url, prompt):
    r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text


def hits(fleet, i):
    return fleet.members[i].metric(0, "vllm:prefix_cache_hits_total")


def next_message(sub, url, first_token, attempts=20):
    """The next KV-event message, sending new 40-token prompts until one arrives (a SUB that is (re)joining
    misses the first ones; each prompt is new, so each stores blocks and publishes)."""
    for k in range(attempts):
        complete(url, list(range(first_token + 1000 * k, first_token + 1000 * k + 40)))
        try:
            return sub.get(timeout=1.0)
        except queue.Empty:
            continue
    raise AssertionError("no KV event arrived")


def test_a_restarted_pod_comes_back_empty_on_its_address_and_event_endpoint(sim_bin, tmp_path):
    base = f"ipc://{tmp_path / 'kv'}"
    with simcluster.PodFleet(pods=2, time_scale=0.02, num_gpu_blocks=[64, 128], kv_events_endpoint=base) as fleet:
        assert [m.capacities for m in fleet.members] == [[64], [128]], "per-pod options reach their pod"
        assert fleet.addresses[1].rsplit(":", 1)[1] == str(int(fleet.addresses[0].rsplit(":", 1)[1]) + 1)
        sub = Sub(bind=False, connect=simcluster.pod_kv_events_endpoint(base, 1))
        try:
            topic, seq, _ = next_message(sub, fleet.urls[1], 0)
            assert topic == f"kv@{fleet.addresses[1]}@{MODEL}"
            prompt = list(range(40))
            complete(fleet.urls[1], prompt)
            assert hits(fleet, 1) > 0, "the repeat hit the cache"
            address, pid0, pid1 = fleet.addresses[1], fleet.members[0].pid, fleet.members[1].pid

            rec = fleet.restart(1)

            assert rec["pod"] == address and fleet.addresses[1] == address
            assert fleet.members[1].pid != pid1 and fleet.members[0].pid == pid0, "only pod 1 restarted"
            assert rec["up"]["mono"] > rec["killed"]["mono"] and fleet.restarts == [rec]
            assert hits(fleet, 1) == 0, "counters start again from zero"
            while not sub.q.empty():  # what the old process published before it died
                sub.q.get_nowait()
            topic, seq, batch = next_message(sub, fleet.urls[1], 100)
            assert topic == f"kv@{address}@{MODEL}"
            assert batch[1][0]["type"] == "BlockStored" and batch[1][0]["token_ids"][0] >= 100, \
                "blocks of a prompt sent only to the new process"
            complete(fleet.urls[1], prompt)
            assert hits(fleet, 1) == 0, "the cache is gone: the old prompt misses"
            assert "until its restart" in fleet.log_text()
        finally:
            sub.close()
