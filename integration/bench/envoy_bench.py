"""Envoy configs for the benchmark, all from the project's gateway (envoy/gateway.yaml).

- LB-only baselines: `render_gateway(endpoints, kvroute=False, lb_policy=...)` —
  the same Envoy (listener, route, cluster, buffer limits) with the kvroute
  filter removed and a plain Envoy LB policy (RANDOM, ROUND_ROBIN,
  LEAST_REQUEST = power of two choices).
- kvroute: `render_gateway(endpoints, plugin)`; precise mode renders
  envoy/gateway-precise.yaml instead (the singleton `wasm_service` polling
  kvroute-indexer, its cluster, and the `vllm_tokenizer` cluster = the pods'
  own `/tokenize` for the tokenizer call-out).

The same benchmark overlay is applied to every Envoy strategy, with or without
kvroute (the peers are not Envoy and keep their defaults):
- `stream_idle_timeout: 0s` — Envoy's default (5 min without a byte) would cut
  requests that wait in an overloaded pod's queue; the peers' own request
  timeouts are 30 min, and the load generator's per-request timeout is the
  one that counts;
- cluster circuit-breaker limits raised to 100,000 — Envoy's defaults (1,024
  requests/pending/connections) must not shed load the client sends (the
  client caps requests in flight; in the full profile at 640);
- with `access_log`, a file access log of when each request reached Envoy and
  how long until its body was read, its upstream request began, the pod's
  response headers came and its first body byte (the first token) came
  (ACCESS_LOG_FIELDS): the time to first token as Envoy sees it, without the
  load generator's own delays; and the pod that answered, with kvroute's
  decision header.
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


def _envoyctl():
    sys.path.insert(0, os.path.join(REPO, "integration"))
    try:
        import envoyctl  # type: ignore

        return envoyctl
    finally:
        sys.path.pop(0)


def _hcm(cfg: Dict[str, Any]) -> Dict[str, Any]:
    return cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


# One line per request: its arrival (Unix seconds), then microseconds from arrival to each point,
# the status, the pod that answered, and last, quoted, kvroute's decision header ("-" without it):
# which pod a request went to and why, to read a run's placement back.
ACCESS_LOG_FIELDS = ("start", "body_read_us", "upstream_sent_us", "headers_us", "first_byte_us", "status",
                     "upstream_host")
ACCESS_LOG_FORMAT = ("%START_TIME(%s.%6f)% %COMMON_DURATION(DS_RX_BEG:DS_RX_END:us)% "
                     "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% %COMMON_DURATION(DS_RX_BEG:US_RX_BEG:us)% "
                     "%COMMON_DURATION(DS_RX_BEG:US_RX_BODY_BEG:us)% %RESPONSE_CODE% %UPSTREAM_HOST% "
                     "\"%RESP(X-KVROUTE-DECISION)%\"\n")


def access_log_lines(sdir: str) -> List[str]:
    """Every line of a strategy's Envoy access logs (one per client's Envoy), in file-name order."""
    lines: List[str] = []
    for name in sorted(f for f in os.listdir(sdir) if f.startswith("envoy-access") and f.endswith(".log")):
        with open(os.path.join(sdir, name), encoding="utf-8", errors="replace") as fh:
            lines.extend(fh)
    return lines


def overlay(cfg: Dict[str, Any], access_log: Optional[str] = None) -> Dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    _hcm(cfg)["stream_idle_timeout"] = "0s"
    if access_log:
        _hcm(cfg)["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": access_log,
            "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}}]
    pods = cfg["static_resources"]["clusters"][0]
    pods["circuit_breakers"] = {"thresholds": [{
        "priority": "DEFAULT", "max_connections": 100000, "max_pending_requests": 100000,
        "max_requests": 100000, "max_retries": 3}]}
    return cfg


def baseline(endpoints: List[str], policy: str, access_log: Optional[str] = None) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown LB policy {policy!r}; known: {', '.join(POLICIES)}")
    text = _envoyctl().render_gateway(endpoints, kvroute=False, lb_policy=POLICIES[policy])
    return yaml.safe_dump(overlay(yaml.safe_load(text), access_log), sort_keys=False)


ORACLE_LUA = os.path.join(HERE, "oracle", "group_affinity.lua")


def group_affinity(endpoints: List[str], access_log: Optional[str] = None) -> str:
    """The group-affinity oracle (oracle/group_affinity.lua): kvroute's gateway with its override_host
    cluster, the wasm filter and singleton replaced by the Lua filter that names each group's pod."""
    cfg = overlay(yaml.safe_load(_envoyctl().render_gateway(endpoints, {})), access_log)
    cfg.pop("bootstrap_extensions", None)
    with open(ORACLE_LUA) as f:
        code = f"local PODS = {{{', '.join(json.dumps(a) for a in endpoints)}}}\n" + f.read()
    _hcm(cfg)["http_filters"][0] = {"name": "group_affinity", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
        "default_source_code": {"inline_string": code}}}
    return yaml.safe_dump(cfg, sort_keys=False)


def kvroute(endpoints: List[str], plugin: Dict[str, Any], indexer_address: Optional[str] = None,
            access_log: Optional[str] = None, wasm: Optional[str] = None) -> str:
    """kvroute gateway (envoy/gateway.yaml); with indexer_address the precise one (envoy/gateway-precise.yaml:
    singleton feed poller, kvroute_indexer cluster, vllm_tokenizer cluster = the pods' /tokenize).
    `plugin["indexer"]` (e.g. a scaled poll_ms) also reaches the singleton's own configuration.
    `wasm`: a kvroute.wasm other than the work tree's release build (overhead.py --wasm-variant)."""
    ctl = _envoyctl()
    module = wasm or ctl.WASM
    if indexer_address:
        text = ctl.render_gateway(endpoints, plugin, template=ctl.GATEWAY_PRECISE, indexer=indexer_address, wasm=module)
    else:
        text = ctl.render_gateway(endpoints, plugin, wasm=module)
    return yaml.safe_dump(overlay(yaml.safe_load(text), access_log), sort_keys=False)