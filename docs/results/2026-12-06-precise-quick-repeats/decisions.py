"""Per pod and per stage: how the router's decisions matched, from a bench run's access log
(`integration/bench/placement.py`'s kinds: a prefix group's first request, the whole prompt held,
or a part of it: the system prompt only, or a token-memo recall).

    python3 decisions.py low-run-decisions      # a published results folder (reads its raw.tar.gz)
    python3 decisions.py build/bench/RUN        # a run directory
"""

import gzip
import json
import os
import sys
from collections import Counter, defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "..", "integration", "bench"))
import placement  # noqa: E402
from envoy_bench import ACCESS_LOG_FIELDS  # noqa: E402
from pod_misses import read_member  # noqa: E402

ACCESS_LOG = "raw/kvroute-precise/envoy-access.log.gz"
SENT = ACCESS_LOG_FIELDS.index("upstream_sent_us")
POD = ACCESS_LOG_FIELDS.index("upstream_host")


def access_log(where: str) -> list:
    return gzip.decompress(read_member(where, ACCESS_LOG)).decode().splitlines()


def routed(where: str) -> list:
    """(decided at, pod, decision header) of each request sent upstream: the decision's time is
    its arrival plus the microseconds until the upstream request started."""
    out = []
    for line in access_log(where):
        fields = line.split(maxsplit=len(ACCESS_LOG_FIELDS))
        if len(fields) > len(ACCESS_LOG_FIELDS) and fields[SENT] != "-":
            out.append((float(fields[0]) + int(fields[SENT]) / 1e6, fields[POD], fields[-1]))
    return out


def stage_spans(where: str) -> list:
    with open(os.path.join(where, "results.json")) as f:
        row = json.load(f)["results"][0]
    return [(str(s["stage"]), s["t_start"], s["t_end"]) for s in row["stages"]]


def main() -> None:
    where = sys.argv[1]
    spans = stage_spans(where)
    parts = defaultdict(Counter)
    lines = access_log(where)
    for line in lines:
        decided = placement.parse_line(line)
        if decided and decided[1] == "part":
            start = float(line.split(" ", 1)[0])
            stage = next((name for name, t0, t1 in spans if t0 <= start <= t1 + 1.0), "-")
            parts[decided[0]][stage] += 1
    names = [name for name, _, _ in spans]
    print("pod              first whole part   part per stage (" + " ".join(names) + ")")
    for pod, kinds in placement.count(lines).items():
        per_stage = " ".join(f"{parts[pod][name]:4d}" for name in names)
        print(f"{pod:16s} {kinds['first']:5d} {kinds['whole']:5d} {kinds['part']:4d}   {per_stage}")


if __name__ == "__main__":
    main()
