"""Per second and per pod: prompt tokens the pod's prefix cache missed / prompt tokens queried,
and its KV usage, from a bench run's precise-mode pod samples.

    python3 pod_misses.py low-run-1          # a published results folder (reads its raw.tar.gz)
    python3 pod_misses.py build/bench/RUN    # a run directory
"""

import json
import os
import sys
import tarfile

MEMBER = "raw/kvroute-precise/pod-samples.jsonl"


def read_member(where: str, member: str) -> bytes:
    """A file of a run: from a published folder's raw.tar.gz, else from the run directory."""
    archive = os.path.join(where, "raw.tar.gz")
    if os.path.exists(archive):
        with tarfile.open(archive) as tar:
            return tar.extractfile(member).read()
    with open(os.path.join(where, member), "rb") as f:
        return f.read()


def samples(where: str) -> list:
    return [json.loads(line) for line in read_member(where, MEMBER).decode().splitlines() if line]


def main() -> None:
    rows = samples(sys.argv[1])
    t0 = rows[0]["t"]
    for prev, row in zip(rows, rows[1:]):
        cells = []
        for pod, m in sorted(row["pods"].items()):
            p = prev["pods"][pod]
            queried = m["vllm:prefix_cache_queries_total"] - p["vllm:prefix_cache_queries_total"]
            hit = m["vllm:prefix_cache_hits_total"] - p["vllm:prefix_cache_hits_total"]
            cells.append(f"{int(queried - hit):6d}/{int(queried):6d} kv {m['vllm:kv_cache_usage_perc']:.2f}")
        print(f"{row['t'] - t0:5.0f}  " + " | ".join(cells))


if __name__ == "__main__":
    main()
