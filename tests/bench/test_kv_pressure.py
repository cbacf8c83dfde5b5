"""`kv_pressure.py`: samples where a full pod sat beside one with room, counted over each
strategy's measured stages only, from a run directory and a published folder's archive alike."""

import json
import pathlib


def sample(t, kvs, waiting=0, preemptions=(0, 0), running=(0, 0)):
    pods = {f"pod{i}": {"vllm:kv_cache_usage_perc": kv, "vllm:num_requests_waiting": waiting,
                        "vllm:num_preemptions_total": preemptions[i], "vllm:num_requests_running": running[i]}
            for i, kv in enumerate(kvs)}
    return {"t": t, "pods": pods}


def write_run(root: pathlib.Path) -> None:
    stages = [{"stage": 0, "warmup": True, "t_start": 0.0, "t_end": 9.0},
              {"stage": 1, "warmup": False, "t_start": 10.0, "t_end": 19.0},
              {"stage": 2, "warmup": False, "t_start": 20.0, "t_end": 29.0}]
    (root / "results.json").write_text(json.dumps({"results": [{"strategy": "kvroute-precise", "stages": stages}]}))
    rows = [
        sample(5.0, [0.99, 0.1], waiting=40),           # warm-up: outside the window
        sample(10.0, [0.5, 0.5], preemptions=(2, 0)),   # window opens: preemptions counted from here
        sample(12.0, [0.99, 0.69], waiting=3, running=(20, 5)),  # full beside room
        sample(14.0, [0.98, 0.75], running=(30, 10)),   # full, the other has no room
        {"t": 16.0, "pods": {"pod0": {"error": "timed out"}, "pod1": {"vllm:kv_cache_usage_perc": 0.2}}},
        sample(29.0, [0.4, 0.99], preemptions=(5, 1), running=(3, 8)),  # full beside room; 3 + 1 preemptions
        sample(35.0, [1.0, 0.0], waiting=50),           # after the last stage: outside
    ]
    path = root / "raw" / "kvroute-precise"
    path.mkdir(parents=True)
    (path / "pod-samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_full_pods_beside_room_over_the_measured_window(tmp_path, analysis):
    write_run(tmp_path)
    code, out, err = analysis("kv_pressure.py", tmp_path)
    assert code == 0, err
    # 5 samples in the window; 3 with a full pod, 2 of them beside one below 70 %; both pods filled;
    # longest queue 3 (the warm-up's 40 and the tail's 50 are outside); 4 preemptions.
    # Sequences on the full pod against the other: 23 / 8, 30 / 10, 8 / 3 (means 20 / 7); KV per
    # running sequence, full ÷ other: 0.0495 / 0.138, 0.0327 / 0.075, 0.124 / 0.133 (mean 0.57).
    assert "| kvroute-precise | 5 | 3 | 2 | 2 | 3 | 4 | 20 / 7 | 0.57 |" in out, out


def test_the_same_from_a_published_folders_archive(reads_archive_alike):
    reads_archive_alike("kv_pressure.py", write_run)

