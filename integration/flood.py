"""Cache-flooding attack on the approximate index, measured through the real Envoy.

Victims: 16 conversations whose long system prompts stick to their pods. The attacker then sends
N huge prompts (262 KB each, 4,096 byte chunks: a whole max_blocks) and the victims are probed
once: a victim still sticks when its next request is routed to its pod with its prefix matched.
Two attacker kinds: requests the pods refuse (an unknown model: 404, nearly free for the
attacker) and requests they serve (the attacker pays for prefill). A fresh Envoy per N.

    .venv/bin/python integration/flood.py --requests 8,24,64 --out build/flood.json
"""
from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from envoyctl import EnvoyProcess, render_gateway  # noqa: E402
from simcluster import SimCluster  # noqa: E402

VICTIMS = 16
ATTACK_BYTES = 262_144


def chat(url: str, model: str, system: str, question: str) -> requests.Response:
    body = {"model": model, "max_tokens": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    with requests.Session() as s:  # a fresh connection: requests land on every worker
        return s.post(url + "/v1/chat/completions", json=body, timeout=120)


def routed_to(r: requests.Response) -> tuple[str, int]:
    fields = dict(p.split("=", 1) for p in r.headers.get("x-kvroute-decision", "").split("; ") if "=" in p)
    return fields.get("pod", ""), int(fields.get("matched", "0/0").split("/")[0])


def attack(sims: SimCluster, n: int, attacker_model: str) -> dict:
    with EnvoyProcess(render_gateway(sims.addresses)) as envoy:
        envoy.wait_for_peers()
        victims = {}
        for v in range(VICTIMS):
            system = f"[victim {v} {uuid.uuid4().hex}] " + " ".join(f"policy {i} of tenant {v}" for i in range(400))
            first, _ = routed_to(chat(envoy.url, sims.model, system, "hello"))
            victims[system] = first
        statuses: dict[int, int] = {}
        for i in range(n):
            junk = f"[attack {i} {uuid.uuid4().hex}] " + "z" * ATTACK_BYTES
            r = chat(envoy.url, attacker_model, junk, "?")
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        sticky = 0
        for system, pod in victims.items():
            now_pod, matched = routed_to(chat(envoy.url, sims.model, system, "again"))
            sticky += now_pod == pod and matched > 0
        return {"attack_requests": n, "attack_bytes": n * ATTACK_BYTES, "attacker_statuses": statuses,
                "victims": VICTIMS, "victims_still_sticky": sticky}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", default="8,24,64", help="attack sizes to try, comma-separated")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    results = []
    with SimCluster(pods=4, time_scale=0.2) as sims:
        for kind, model in (("refused", "no-such-model"), ("served", sims.model)):
            for n in (int(x) for x in args.requests.split(",")):
                sims.flush()
                row = {"attacker": kind, **attack(sims, n, model)}
                print(json.dumps(row), flush=True)
                results.append(row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
