"""`ttft_floor.py`: the cold-prefill floor of a run and the share of each stage's requests at or
above it, from a run directory and from a published folder's raw.tar.gz alike."""

import gzip
import json
import pathlib


def request(stage, start, ttft, error=None):
    return {"stage": stage, "start": start, "end": start + 5, "ttft": ttft, "out": 100, "in": 1800, "error": error}


def write_run(root: pathlib.Path) -> None:
    # Warm-up: the first answered request (start 1.0; the one at 0.5 failed) is the cold prefill
    # alone on an idle pod.
    warmup = [request(0, 2.0, 1.5), request(0, 1.0, 1.2), request(0, 3.0, 1.9), request(0, 4.0, 1.3),
              request(0, 0.5, None, error="timeout")]
    # Stage 1: 3 of 10 at or above the floor; stage 2: 1 of 10, and a failed request not counted.
    stage1 = [request(1, 10 + i, t) for i, t in enumerate([0.2] * 7 + [1.2, 1.4, 2.0])]
    stage2 = [request(2, 30 + i, t) for i, t in enumerate([0.3] * 9 + [1.25])] + [request(2, 50, None, "reset")]
    path = root / "raw" / "kvroute-precise"
    path.mkdir(parents=True)
    with gzip.open(path / "requests.jsonl.gz", "wt") as fh:
        for r in warmup + stage1 + stage2:
            fh.write(json.dumps(r) + "\n")


def test_floor_and_shares_from_a_run_directory(tmp_path, analysis):
    write_run(tmp_path)
    code, out, err = analysis("ttft_floor.py", tmp_path)
    assert code == 0, err
    assert "| kvroute-precise | 1.200 s | 1 | 10 | " in out, out
    assert "| 30.0 % |" in out, out
    assert "| kvroute-precise | 1.200 s | 2 | 10 | " in out, out
    assert "| 10.0 % |" in out, out


def test_the_same_from_a_published_folders_archive(reads_archive_alike):
    reads_archive_alike("ttft_floor.py", write_run)

