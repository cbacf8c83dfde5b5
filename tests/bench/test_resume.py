"""`run.py --resume`: a real two-strategy benchmark run stopped by SIGTERM during its second
strategy, refused when the code differs, then resumed (about a minute on 2 cores).

Runs the harness in .venv-bench (inference-perf needs Python 3.12); skipped without it
(`make bench-venv`). The two strategies are plain Envoy LBs, so no wasm or indexer is needed.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "integration"))

from proctools import stop_pid  # noqa: E402

BENCH_PY = REPO / ".venv-bench" / "bin" / "python"
RUN = REPO / "integration" / "bench" / "run.py"
TINY = ["--profile", "quick", "--strategies", "envoy-round-robin,envoy-random", "--set", "load.warmup=[4,2]",
        "--set", "load.stages=[[4,3]]", "--set", "workload.groups=4"]

pytestmark = pytest.mark.skipif(not BENCH_PY.exists(), reason="needs .venv-bench (make bench-venv)")


def results(out: pathlib.Path) -> dict:
    try:
        return json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}


def answers(address: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=1):
            return True
    except OSError:
        return False


def test_a_stopped_run_is_resumed(tmp_path):
    out = tmp_path / "run"
    with open(tmp_path / "session1.log", "wb") as log:
        p = subprocess.Popen([str(BENCH_PY), str(RUN), *TINY, "--out", str(out)], cwd=REPO, stdout=log,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            # Stop it once the first strategy is recorded and the second has begun.
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and p.poll() is None:
                if len(results(out).get("results", [])) == 1 and (out / "raw" / "envoy-random").is_dir():
                    break
                time.sleep(0.2)
            assert p.poll() is None, (tmp_path / "session1.log").read_text()
            p.send_signal(signal.SIGTERM)
            rc = p.wait(timeout=120)
        finally:
            stop_pid(p, grace=5)
    assert rc == 130, (tmp_path / "session1.log").read_text()
    first = results(out)
    assert [(r["strategy"], r["status"]) for r in first["results"]] == [("envoy-round-robin", "ok")]
    s1 = first["meta"]["sessions"][0]
    assert s1["finished_utc"] is None and s1["stopped_by"].startswith("KeyboardInterrupt")
    assert not any(answers(a) for a in s1["pods"]["addresses"]), "the stopped session's pods must be gone"

    # Another commit than session 1's: refused before anything starts.
    original = (out / "results.json").read_text()
    tampered = json.loads(original)
    tampered["meta"]["sessions"][0]["git"]["commit"] = "0" * 40
    (out / "results.json").write_text(json.dumps(tampered))
    r = subprocess.run([str(BENCH_PY), str(RUN), "--resume", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and "refusing to resume" in r.stderr and "000000000000" in r.stderr, r.stderr
    (out / "results.json").write_text(original)

    r = subprocess.run([str(BENCH_PY), str(RUN), "--resume", str(out)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    done = results(out)
    assert [(r["strategy"], r["status"], r["session"]) for r in done["results"]] == [
        ("envoy-round-robin", "ok", 1), ("envoy-random", "ok", 2)]
    assert done["results"][0]["t_start"] == first["results"][0]["t_start"], "a strategy recorded ok is kept"
    (attempt,) = done["results"][1]["earlier_attempts"]
    assert attempt["session"] == 1 and attempt["status"] == "interrupted"
    assert (out / attempt["raw_dir"]).is_dir() and attempt["raw_dir"] == os.path.join("raw", "envoy-random.before-session-2")
    s1, s2 = done["meta"]["sessions"]
    assert s2["finished_utc"] and s2["strategies"] == ["envoy-random"] and s2["git"] == s1["git"]
    assert s2["pods"]["addresses"] != s1["pods"]["addresses"], "a resumed session starts its own pods"
    report = (out / "report.md").read_text()
    assert "**Run in 2 sessions**" in report and "| 2 | " in report
    assert "Envoy random (session 1: interrupted)" in report
