"""At each request of which the chosen pod held nothing (mostly a prefix group's first), per pod:
the groups started there so far, the requests routed there, and the prompt blocks it did not
hold (what its cache took in), from a bench run's access log.

    python3 groups_and_blocks.py w8-run-14          # a published results folder (its raw.tar.gz)
    python3 groups_and_blocks.py build/bench/RUN    # a run directory
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "2026-12-06-precise-quick-repeats"))
from decisions import routed  # noqa: E402
from placement import MATCHED  # noqa: E402  (decisions puts integration/bench on the path)


def decisions(where: str) -> list:
    """(decided at, pod, blocks matched, prompt blocks), in decision order."""
    out = []
    for decided, pod, header in routed(where):
        found = MATCHED.search(header)
        if found:
            out.append((decided, pod, int(found.group(1)), int(found.group(2))))
    return sorted(out)


def main() -> None:
    rows = decisions(sys.argv[1])
    pods = sorted({pod for _, pod, _, _ in rows})
    groups, requests, blocks = ({pod: 0 for pod in pods} for _ in range(3))
    t0 = rows[0][0]
    print("seconds  pod    per pod in address order: groups / requests / blocks not held")
    for decided, pod, matched, total in rows:
        groups[pod] += matched == 0
        requests[pod] += 1
        blocks[pod] += total - matched
        if matched == 0:
            state = "  ".join(f"{groups[p]:2d}/{requests[p]:3d}/{blocks[p]:5d}" for p in pods)
            print(f"{decided - t0:7.2f}  {pod.rsplit(':', 1)[-1]}  {state}")


if __name__ == "__main__":
    main()
