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


def samples(where: str) -> list:
    archive = os.path.join(where, "raw.tar.gz")
    if os.path.exists(archive):
        with tarfile.open(archive) as tar:
            lines = tar.extractfile(MEMBER).read().decode().splitlines()
    else:
        with open(os.path.join(where, MEMBER)) as f:
            lines = f.read().splitlines()
    return [json.loads(line) for line in lines if line]


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
