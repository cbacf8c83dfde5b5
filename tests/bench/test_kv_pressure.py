"""`kv_pressure.py`: samples where a full pod sat beside one with room, counted over each
strategy's measured stages only, from a run directory and a published folder's archive alike."""

import json
import pathlib
import subprocess
import sys
import tarfile

REPO = pathlib.Path(__file__).resolve().parents[2]
TOOL = REPO / "integration" / "bench" / "kv_pressure.py"


def sample(t, kvs, waiting=0, preemptions=(0, 0)):
    pods = {f"pod{i}": {"vllm:kv_cache_usage_perc": kv, "vllm:num_requests_waiting": waiting,
                        "vllm:num_preemptions_total": preemptions[i]} for i, kv in enumerate(kvs)}
    return {"t": t, "pods": pods}


def write_run(root: pathlib.Path) -> None:
    stages = [{"stage": 0, "warmup": True, "t_start": 0.0, "t_end": 9.0},
              {"stage": 1, "warmup": False, "t_start": 10.0, "t_end": 19.0},
              {"stage": 2, "warmup": False, "t_start": 20.0, "t_end": 29.0}]
    (root / "results.json").write_text(json.dumps({"results": [{"strategy": "kvroute-precise", "stages": stages}]}))
    rows = [
        sample(5.0, [0.99, 0.1], waiting=40),           # warm-up: outside the window
        sample(10.0, [0.5, 0.5], preemptions=(2, 0)),   # window opens: preemptions counted from here
        sample(12.0, [0.99, 0.69], waiting=3),          # full beside room
        sample(14.0, [0.98, 0.75]),                     # full, the other has no room
        {"t": 16.0, "pods": {"pod0": {"error": "timed out"}, "pod1": {"vllm:kv_cache_usage_perc": 0.2}}},
        sample(29.0, [0.4, 0.99], preemptions=(5, 1)),  # full beside room; 3 + 1 preemptions
        sample(35.0, [1.0, 0.0], waiting=50),           # after the last stage: outside
    ]
    path = root / "raw" / "kvroute-precise"
    path.mkdir(parents=True)
    (path / "pod-samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_tool(run: pathlib.Path) -> str:
    return subprocess.run([sys.executable, str(TOOL), str(run)], capture_output=True, text=True, check=True).stdout


def test_full_pods_beside_room_over_the_measured_window(tmp_path):
    write_run(tmp_path)
    out = run_tool(tmp_path)
    # 5 samples in the window; 3 with a full pod, 2 of them beside one below 70 %; both pods filled;
    # longest queue 3 (the warm-up's 40 and the tail's 50 are outside); 4 preemptions.
    assert "| kvroute-precise | 5 | 3 | 2 | 2 | 3 | 4 |" in out, out


def test_the_same_from_a_published_folders_archive(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    write_run(run)
    published = tmp_path / "published"
    published.mkdir()
    (published / "results.json").write_text((run / "results.json").read_text())
    with tarfile.open(published / "raw.tar.gz", "w:gz") as tar:
        tar.add(run / "raw", arcname="raw")
    assert run_tool(published) == run_tool(run)


def test_a_folder_without_samples_is_refused(tmp_path):
    p = subprocess.run([sys.executable, str(TOOL), str(tmp_path)], capture_output=True, text=True)
    assert p.returncode != 0
    assert "no pod-samples.jsonl" in p.stderr
