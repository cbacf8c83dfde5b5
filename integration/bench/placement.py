"""Where kvroute put the prefix groups, per pod, from the bench Envoys' access logs.

Each line ends with the `x-kvroute-decision` header (envoy_bench.ACCESS_LOG_FORMAT), whose
`matched=M/N` says how many of the prompt's N blocks the chosen pod held:
- first (M = 0): the chosen pod held no block of the prompt. Mostly a prefix group's first
  request (no pod held any), so these counts show how the groups were spread over the pods; a
  request sent away from its group's pod counts here too (in the quick profile's runs the four
  pods' counts add up to 48 or 49 for 48 groups);
- whole (M = N);
- part (0 < M < N): a shared prefix without the rest (a system prompt whose question the pod does
  not hold), or a token-memo recall.
A pod given more groups than its cache holds keeps them, evicts their later blocks and shows many
partial matches and a prefix-cache hit rate below the others'
(docs/results/2026-12-06-precise-quick-repeats).
"""

from __future__ import annotations

import re
from typing import Dict, Iterable, Optional, Tuple

from envoy_bench import ACCESS_LOG_FIELDS, access_log_lines

MATCHED = re.compile(r"\bmatched=(\d+)/(\d+)")
KINDS = ("first", "whole", "part")


def parse_line(line: str) -> Optional[Tuple[str, str]]:
    """One access-log line → (pod, kind); None for a request without a routing decision."""
    parts = line.split(maxsplit=len(ACCESS_LOG_FIELDS))
    if len(parts) <= len(ACCESS_LOG_FIELDS):
        return None
    found = MATCHED.search(parts[-1])
    if not found:
        return None
    matched, blocks = int(found.group(1)), int(found.group(2))
    kind = "first" if matched == 0 else "whole" if matched >= blocks else "part"
    return parts[len(ACCESS_LOG_FIELDS) - 1], kind


def count(lines: Iterable[str]) -> Dict[str, Dict[str, int]]:
    """Per pod (address order): its decisions of each kind, warm-up included (groups start there)."""
    out: Dict[str, Dict[str, int]] = {}
    for decided in filter(None, map(parse_line, lines)):
        pod, kind = decided
        out.setdefault(pod, dict.fromkeys(KINDS, 0))[kind] += 1
    return dict(sorted(out.items(), key=lambda kv: _address_order(kv[0])))


def _address_order(pod: str) -> Tuple[str, int]:
    host, _, port = pod.rpartition(":")
    return host, int(port) if port.isdigit() else 0


def summarize(sdir: str) -> Optional[Dict[str, Dict[str, int]]]:
    """The placement of a strategy's run directory, or None when no line carries a decision."""
    return count(access_log_lines(sdir)) or None
