"""Who may write learned entries: the real kvroute-indexer, POST /v1/learned with and without
the bearer token, the default without a token file, rotation, and token-domain hashes refused."""

import json
import subprocess
import urllib.error
import urllib.request

import indexer_harness as h
from indexer_harness import MODEL, batch, stored, topic, wait_for

POD = "127.0.0.1:18999"  # identities only: nothing listens there (scraping is off)
OTHER = "127.0.0.1:18998"
PODS = ("--pod", f"{POD}@{MODEL}", "--pod", f"{OTHER}@{MODEL}", "--scrape-interval-ms", "0")


def refused(ix, reason: str) -> float:
    return ix.metric("kvroute_indexer_learned_unauthorized_total", reason=reason)


def post_with_header(ix, body: bytes, authorization: str) -> int:
    req = urllib.request.Request(ix.url + "/v1/learned", data=body, method="POST",
                                 headers={"authorization": authorization})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        assert e.headers.get("www-authenticate") == "Bearer"
        return e.code


def test_only_the_right_bearer_token_writes():
    body = h.encode_learned([(POD, [1, 2, 3])])
    with h.Indexer(*PODS) as ix:
        feed = ix.feed()
        assert ix.post("/v1/learned", body)[0] == 401
        assert ix.post("/v1/learned", body, "x" * 64)[0] == 401
        assert ix.post("/v1/learned", body, ix.learned_token[:-1])[0] == 401
        assert post_with_header(ix, body, f"Basic {ix.learned_token}") == 401
        assert feed.of(POD) == {}, "nothing refused reached the feed"
        assert refused(ix, "missing_token") == 1
        assert refused(ix, "wrong_token") == 2
        assert refused(ix, "malformed_authorization") == 1
        assert ix.metric("kvroute_indexer_learned_accepted_total") == 0
        assert "refused: missing_token" in ix.log_text()
        status, answer = ix.post("/v1/learned", body, ix.learned_token)
        assert status == 200, answer
        assert json.loads(answer) == {"accepted": 3, "rejected": 0, "token_domain": 0}
        assert feed.of(POD) == {1: "learned", 2: "learned", 3: "learned"}
        # reads need no token
        assert ix.get("/healthz") == b"ok\n"


def test_without_a_token_file_writes_are_refused_unless_explicitly_open():
    body = h.encode_learned([(POD, [1])])
    with h.Indexer(*PODS, learned_token=None) as ix:
        status, answer = ix.post("/v1/learned", body, "anything-at-all-0123456789")
        assert status == 403 and b"--learned-token-file" in answer
        assert refused(ix, "writes_disabled") == 1
        assert ix.feed().of(POD) == {}
    with h.Indexer(*PODS, "--allow-unauthenticated-learned", learned_token=None) as ix:
        assert ix.post("/v1/learned", body)[0] == 200
        assert ix.feed().of(POD) == {1: "learned"}


def test_a_rotated_token_file_is_read_again():
    old, new = "old-" + "a" * 40, "new-" + "b" * 44  # different sizes: a new stamp on any clock
    body = h.encode_learned([(POD, [1])])
    with h.Indexer(*PODS, learned_token=old) as ix:
        assert ix.post("/v1/learned", body, old)[0] == 200
        ix.token_path.write_text(f"{old}\n{new}\n")  # both during the switch
        assert ix.post("/v1/learned", body, new)[0] == 200
        assert ix.post("/v1/learned", body, old)[0] == 200
        ix.token_path.write_text(f"{new}\n")
        assert ix.post("/v1/learned", body, old)[0] == 401
        assert ix.post("/v1/learned", body, new)[0] == 200


def test_an_unusable_token_file_stops_the_start(tmp_path):
    short = tmp_path / "token"
    short.write_text("short\n")
    run = subprocess.run([str(h.indexer_binary()), f"--listen=127.0.0.1:{h.free_port()}", "--zmq-bind=none",
                          f"--learned-token-file={short}"], capture_output=True, text=True, timeout=30)
    assert run.returncode != 0
    assert "--learned-token-file" in run.stderr and "at least 16 bytes" in run.stderr


def test_token_domain_hashes_are_not_taken_as_learned(ctx):
    """A hash a pod reports through KV events is a token block: a learned entry naming it (e.g.
    copied from the feed to claim another pod holds a hot prefix) is dropped and counted."""
    with h.Indexer(*PODS) as ix:
        pub = h.Publisher(ctx, ix.zmq_endpoint)
        h.wait_subscribed(ix, pub)
        feed = ix.feed()
        pub.send(topic(POD), 0, batch(stored([11, 12, 13, 14], None, range(64))))
        wait_for(lambda: len(feed.of(POD)) == 4, what="the pod's 4 blocks")
        token_blocks = h.TOKENS_0_63_QWEN
        byte_chunk = 0x1234_5678_9ABC_DEF0
        status, answer = ix.post("/v1/learned", h.encode_learned([(OTHER, token_blocks + [byte_chunk])]),
                                 ix.learned_token)
        assert status == 200
        assert json.loads(answer) == {"accepted": 1, "rejected": 0, "token_domain": 4}
        assert feed.of(OTHER) == {h.key(byte_chunk): "learned"}
        assert feed.of(POD) == {x: "gpu" for x in h.KEYS_0_63_QWEN}
        assert ix.metric("kvroute_indexer_learned_token_domain_total") == 4
        pub.close()
