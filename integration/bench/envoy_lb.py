"""Render the LB-only Envoy config (integration/bench/envoy/lb-only.yaml)."""

from __future__ import annotations

import os
from string import Template
from typing import List

HERE = os.path.dirname(os.path.abspath(__file__))
TEMPLATE = os.path.join(HERE, "envoy", "lb-only.yaml")

# Envoy's own policy names; LEAST_REQUEST is Envoy's default power-of-two-choices
# least request (choice_count 2), unchanged.
POLICIES = {"random": "RANDOM", "round_robin": "ROUND_ROBIN", "least_request": "LEAST_REQUEST"}


def render(policy: str, endpoints: List[str], listen_port: int, admin_port: int) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown LB policy {policy!r}; known: {', '.join(POLICIES)}")
    lines = []
    for ep in endpoints:
        host, _, port = ep.rpartition(":")
        lines.append(
            "        - endpoint: {address: {socket_address: {address: %s, port_value: %d}}}" % (host, int(port))
        )
    with open(TEMPLATE) as fh:
        tmpl = Template(fh.read())
    return tmpl.substitute(
        ADMIN_PORT=admin_port,
        LISTEN_PORT=listen_port,
        LB_POLICY=POLICIES[policy],
        ENDPOINTS="\n".join(lines),
    )
