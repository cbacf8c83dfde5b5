"""What real vLLM accepts, through the real Envoy (issue 12): `cache_salt` scopes prefix caches
(the same prompt under another salt must predict no hit), a request without `model` is served
by the pod's one served model, so kvroute routes it in that model's scope, multimodal chats are
not tokenized (their placeholder tokens are the same for every image), and tenant isolation
writes each tenant's salt into the body."""

import pytest
import requests

from e2elib import MODEL, POD, chat, decision, require_wasm, unique_system
from envoyctl import GATEWAY_PRECISE, EnvoyProcess, render_gateway
from indexerctl import IndexerProcess


@pytest.fixture(scope="module")
def scoped(sims):
    """The pods listed with the one model they serve."""
    require_wasm()
    endpoints = [{"address": a, "models": [MODEL]} for a in sims.addresses]
    config = render_gateway(sims.addresses, {"endpoints": endpoints, "max_body_bytes": 262144})
    with EnvoyProcess(config) as envoy:
        envoy.wait_for_peers()
        yield envoy


def completion(envoy, prompt, **extra) -> requests.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra}
    with requests.Session() as s:
        return s.post(envoy.url + "/v1/completions", json=body, timeout=30)


def test_the_same_chat_under_other_salts_never_matches(scoped):
    system = unique_system()
    first = decision(chat(scoped, system, "q", cache_salt="tenant-a"))
    scoped.wait_for_index_flush()
    again = decision(chat(scoped, system, "q", cache_salt="tenant-a"))
    assert (again["pod"], again["matched"]) == (first["pod"], first["total"]), again["raw"]
    assert again["domain"] == "bytes" and again["total"] > 10, again["raw"]
    for other in ({"cache_salt": "tenant-b"}, {}):
        d = decision(chat(scoped, system, "q", **other))
        assert d["matched"] == 0, (other, d["raw"])


def test_the_same_token_prompt_under_other_salts_never_matches(scoped):
    ids = [(i * 7919) % 40000 + 100 for i in range(16 * 12)]
    first = completion(scoped, ids, cache_salt="tenant-a")
    assert first.status_code == 200, first.text
    scoped.wait_for_index_flush()
    again = decision(completion(scoped, ids, cache_salt="tenant-a"))
    assert (again["domain"], again["matched"], again["total"]) == ("tokens", 12, 12), again["raw"]
    assert again["pod"] == decision(first)["pod"]
    other = decision(completion(scoped, ids, cache_salt="tenant-b"))
    assert other["matched"] == 0, other["raw"]


def test_a_request_without_model_sticks_to_its_prefix_pod(scoped):
    system = unique_system()
    body = {"max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "q"}]}
    pods = []
    for i in range(6):
        with requests.Session() as s:
            r = s.post(scoped.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        d = decision(r)
        assert d["pod"] == r.headers[POD], d["raw"]
        pods.append(d["pod"])
        if i > 0:
            assert d["matched"] == d["total"] > 10, d["raw"]
        else:
            scoped.wait_for_index_flush()
    assert len(set(pods)) == 1, pods
    # Routed in the served model's scope: the same prompt naming the model shares its blocks.
    named = decision(chat(scoped, system, "q", max_tokens=2))
    assert (named["pod"], named["matched"]) == (pods[0], named["total"]), named["raw"]


def test_without_model_and_no_single_served_model_fails_open(gateway):
    """The default gateway lists pods without models (each may serve any): nothing settles the
    scope, so the request fails open, and Envoy's own balancer still serves it."""
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": unique_system()}]}
    with requests.Session() as s:
        r = s.post(gateway.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvroute-decision"] == "fallback=no_model"


@pytest.fixture(scope="module")
def isolated(sims):
    """Tenant isolation on: the tenant comes from a header the mesh would set from the principal."""
    require_wasm()
    config = render_gateway(sims.addresses, {"tenant_header": "x-tenant", "max_body_bytes": 262144})
    with EnvoyProcess(config) as envoy:
        envoy.wait_for_peers()
        yield envoy


def test_tenants_get_their_own_salt_whatever_the_client_sends(isolated):
    system = unique_system()
    first = chat(isolated, system, "q", headers={"x-tenant": "spiffe://td/ns/a/sa/app"}, cache_salt="forged-1")
    assert first.status_code == 200, first.text
    isolated.wait_for_index_flush()
    # The body was rewritten and the pod accepted it; a client salt changes nothing.
    same = chat(isolated, system, "q", headers={"x-tenant": "spiffe://td/ns/a/sa/app"}, cache_salt="forged-2")
    assert same.status_code == 200, same.text
    d = decision(same)
    assert (d["pod"], d["matched"]) == (decision(first)["pod"], d["total"]), d["raw"]
    # Another tenant, or none, never matches tenant a's blocks, even sending the same salt.
    for headers in ({"x-tenant": "spiffe://td/ns/b/sa/app"}, {}):
        r = chat(isolated, system, "q", headers=headers, cache_salt="forged-1")
        assert r.status_code == 200, r.text
        assert decision(r)["matched"] == 0, (headers, decision(r)["raw"])


@pytest.fixture(scope="module")
def tokenizing(sims):
    """The precise template: the pods' /tokenize gives chats their token ids."""
    require_wasm()
    with IndexerProcess(sims.addresses, "--scrape-interval-ms=0") as indexer:
        config = render_gateway(sims.addresses, template=GATEWAY_PRECISE, indexer=indexer.address)
        with EnvoyProcess(config) as envoy:
            envoy.wait_for_peers()
            yield envoy


def tokenizer_calls(envoy) -> int:
    stats = envoy.stats("wasmcustom.kvroute.tokenizer.")
    return stats.get("wasmcustom.kvroute.tokenizer.ok", 0) + stats.get("wasmcustom.kvroute.tokenizer.failed", 0)


def test_multimodal_chats_route_on_bytes_without_a_tokenizer_call(tokenizing):
    system = unique_system()
    text = chat(tokenizing, system, "describe it")
    assert text.status_code == 200, text.text
    assert decision(text)["domain"] == "tokens", decision(text)["raw"]
    calls = tokenizer_calls(tokenizing)
    image = {"model": MODEL, "max_tokens": 2, "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": [{"type": "text", "text": "describe it"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    with requests.Session() as s:
        r = s.post(tokenizing.url + "/v1/chat/completions", json=image, timeout=30)
    # The simulated pod serves text only (400); kvroute decided before it answered.
    d = decision(r)
    assert d["domain"] == "bytes" and d["total"] > 10, d["raw"]
    assert tokenizer_calls(tokenizing) == calls, "a multimodal chat must not be tokenized"
