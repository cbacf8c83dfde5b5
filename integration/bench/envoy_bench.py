"""Envoy configs for the benchmark, all from the project's gateway (envoy/gateway.yaml).

- LB-only baselines: `render_gateway(endpoints, kvroute=False, lb_policy=...)` —
  the same Envoy (listener, route, cluster, buffer limits) with the kvroute
  filter removed and a plain Envoy LB policy (RANDOM, ROUND_ROBIN,
  LEAST_REQUEST = power of two choices).
- kvroute: `render_gateway(endpoints, plugin)`; for precise mode this module
  adds what the mesh configs (envoy/mesh-gateway.yaml) add: the singleton
  `wasm_service` that polls kvroute-indexer, a cluster for the indexer, and a
  cluster for the tokenizer call-out (the pods' own `/tokenize`).

The same benchmark overlay is applied to every Envoy strategy, with or without
kvroute (the peers are not Envoy and keep their defaults):
- `stream_idle_timeout: 0s` — Envoy's default (5 min without a byte) would cut
  requests that wait in an overloaded pod's queue; the peers' own request
  timeouts are 30 min, and the load generator's per-request timeout is the
  one that counts;
- cluster circuit-breaker limits raised to 100,000 — Envoy's defaults (1,024
  requests/pending/connections) must not shed load the client sends (the
  client caps requests in flight; in the full profile at 640).
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any, Dict, List, Optional

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

POLICIES = {"random": "RANDOM", "round_robin": "ROUND_ROBIN", "least_request": "LEAST_REQUEST"}
INDEXER_CLUSTER = "kvroute_indexer"
TOKENIZER_CLUSTER = "kvroute_tokenizer"


def _envoyctl():
    sys.path.insert(0, os.path.join(REPO, "integration"))
    try:
        import envoyctl  # type: ignore

        return envoyctl
    finally:
        sys.path.pop(0)


def _hcm(cfg: Dict[str, Any]) -> Dict[str, Any]:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def overlay(cfg: Dict[str, Any]) -> Dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    _hcm(cfg)["stream_idle_timeout"] = "0s"
    pods = cfg["static_resources"]["clusters"][0]
    pods["circuit_breakers"] = {"thresholds": [{
        "priority": "DEFAULT", "max_connections": 100000, "max_pending_requests": 100000,
        "max_requests": 100000, "max_retries": 3}]}
    return cfg


def baseline(endpoints: List[str], policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown LB policy {policy!r}; known: {', '.join(POLICIES)}")
    text = _envoyctl().render_gateway(endpoints, kvroute=False, lb_policy=POLICIES[policy])
    return yaml.safe_dump(overlay(yaml.safe_load(text)), sort_keys=False)


def _static_cluster(name: str, addresses: List[str], lb: str = "ROUND_ROBIN") -> Dict[str, Any]:
    eps = []
    for a in addresses:
        host, _, port = a.rpartition(":")
        eps.append({"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}})
    return {"name": name, "type": "STATIC", "connect_timeout": "1s", "lb_policy": lb,
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": eps}]}}


def kvroute(endpoints: List[str], plugin: Dict[str, Any], indexer_address: Optional[str] = None,
            tokenizer_addresses: Optional[List[str]] = None, poll_ms: int = 100) -> str:
    """Gateway with kvroute; with indexer_address: the singleton and the indexer cluster too."""
    text = _envoyctl().render_gateway(endpoints, plugin)
    cfg = overlay(yaml.safe_load(text))
    if tokenizer_addresses:
        cfg["static_resources"]["clusters"].append(_static_cluster(TOKENIZER_CLUSTER, tokenizer_addresses))
    if indexer_address:
        cfg["static_resources"]["clusters"].append(_static_cluster(INDEXER_CLUSTER, [indexer_address]))
        wasm = _hcm(cfg)["http_filters"][0]["typed_config"]["config"]
        filt = json.loads(wasm["configuration"]["value"])
        singleton = {
            "role": "singleton",
            "indexer": dict(filt.get("indexer") or {}, poll_ms=poll_ms),
            "block_size": filt.get("block_size", 16),
        }
        cfg["bootstrap_extensions"] = [{
            "name": "envoy.bootstrap.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.wasm.v3.WasmService",
                "singleton": True,
                "config": {
                    "name": "kvroute-singleton",
                    "root_id": wasm["root_id"],
                    "vm_config": copy.deepcopy(wasm["vm_config"]),
                    "configuration": {"@type": "type.googleapis.com/google.protobuf.StringValue",
                                      "value": json.dumps(singleton)},
                },
            },
        }]
    return yaml.safe_dump(cfg, sort_keys=False)
