"""POST /v1/lookup over HTTP: open to any client (read-only, like the feed), answers JSON, refuses
bad bodies with 400 and counts every request in /metrics. What the answer holds is tested
natively (indexer/tests/lookup.rs) and end to end (tests/e2e/test_remote_lookup.py)."""

import json
import urllib.request

import indexer_harness as h
from indexer_harness import MODEL

PODS = ["10.0.0.1:8000", "10.0.0.2:8000"]


def test_lookup_answers_without_a_token_and_counts():
    with h.Indexer(*[f"--pod={p}@{MODEL}" for p in PODS]) as ix:
        status, body = ix.post("/v1/lookup", json.dumps({"model": MODEL, "hashes": [1, 2, 3]}).encode())
        assert status == 200, body
        answer = json.loads(body)
        assert sorted(c["address"] for c in answer["candidates"]) == PODS
        assert all(c["held"] == {"gpu_blocks": 0, "cpu_blocks": 0, "blocks": 0} for c in answer["candidates"])
        assert ix.metric("kvroute_indexer_lookups_total", result="answered") == 1
        assert ix.metric("kvroute_indexer_lookup_seconds_count") == 1


def test_bad_lookups_are_refused_and_counted():
    with h.Indexer(*[f"--pod={p}@{MODEL}" for p in PODS]) as ix:
        for body, says in [(b"{", "bad lookup request"), (b'{"model":"","hashes":[]}', "model is empty"),
                           (b'{"model":"m","hashes":[1.5]}', "bad lookup request")]:
            status, text = ix.post("/v1/lookup", body)
            assert (status, says in text.decode()) == (400, True), text
        status, _ = ix.post("/v1/lookup", b" " * (3 << 20))
        assert status == 413
        assert ix.metric("kvroute_indexer_lookups_total", result="bad_request") == 4
        req = urllib.request.Request(ix.url + "/v1/lookup", method="GET")
        try:
            urllib.request.urlopen(req, timeout=5)
            raise AssertionError("GET /v1/lookup answered")
        except urllib.error.HTTPError as e:
            assert e.code == 405
