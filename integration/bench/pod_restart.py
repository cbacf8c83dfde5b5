"""The `restart` profile's pod restart: a pod killed at the same point of the same request
sequence for every strategy, started again on its address, and its stage split at the kill."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import podmetrics
import profiles
from measurements import answered_ttfts, nearest_rank


class PodRestart:
    """Kills pod `sim.restart_pod` `sim.restart_after` simulated seconds into stage `sim.restart_stage` and starts it
    again on its address `sim.restart_down` simulated seconds later (simcluster.PodFleet.restart). The stage's start
    is its first arrival, as ipwrap.py writes it to the arrival schedule (one timer per stage, in order), so the
    restart falls at the same point of the same request sequence for every strategy. `record` says when it
    happened, in wall time and in the per-request records' clock (monotonic ÷ time scale)."""

    def __init__(self, cluster: Any, sim: profiles.SimSpec, schedule_path: str, log: Callable[[str], None]) -> None:
        self.cluster, self.sim, self.schedule_path, self.log = cluster, sim, schedule_path, log
        self.record: Dict[str, Any] = {"pod": cluster.addresses[sim.restart_pod], "pod_index": sim.restart_pod,
                                       "stage": sim.restart_stage, "after_s": sim.restart_after,
                                       "down_s": sim.restart_down, "status": "not reached",
                                       "reason": f"the load ended before stage {sim.restart_stage}'s first arrival"}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._relayed_at_up: Optional[int] = None

    def _stage_started(self) -> Optional[float]:
        """Wall time stage `restart_stage`'s first arrival is seen in the schedule (None when stopped first)."""
        want = self.sim.restart_stage
        while not os.path.exists(self.schedule_path):
            if self._stop.wait(0.05):
                return None
        with open(self.schedule_path, "rb") as fh:
            while not self._stop.is_set():
                line = fh.readline()
                if not line.endswith(b"\n"):  # nothing new yet (or a line still being written): read it again
                    fh.seek(-len(line), os.SEEK_CUR)
                    self._stop.wait(0.05)
                    continue
                if json.loads(line).get("timer") == want:
                    return time.time()
        return None

    def _run(self) -> None:
        try:
            seen = self._stage_started()
            scale = self.sim.time_scale
            if seen is None or self._stop.wait(self.sim.restart_after * scale):
                return
            done = self.cluster.restart(self.sim.restart_pod, self.sim.restart_down * scale)
            self.record.update(status="done", reason=None, stage_first_arrival_wall=seen,
                               killed_wall=done["killed"]["wall"], up_wall=done["up"]["wall"],
                               killed_t=done["killed"]["mono"] / scale, up_t=done["up"]["mono"] / scale,
                               down_measured_s=round((done["up"]["mono"] - done["killed"]["mono"]) / scale, 3),
                               after_measured_s=round((done["killed"]["wall"] - seen) / scale, 3))
            self._relayed_at_up = self._relayed()
            self.log(f"pod {self.record['pod']} killed {self.record['after_measured_s']} s into stage {self.sim.restart_stage}, "
                f"back after {self.record['down_measured_s']} s")
        except Exception as e:  # recorded: the strategy's numbers then say nothing about a restart
            self.record.update(status="failed", reason=f"{type(e).__name__}: {e}")
            self.log(f"pod restart FAILED — {e}")

    def __enter__(self) -> "PodRestart":
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.schedule_path)
        self._thread = threading.Thread(target=self._run, name="pod-restart", daemon=True)
        self._thread.start()
        return self

    def _relayed(self) -> Optional[int]:
        """KV-event messages the relay has passed on from the restarting pod so far."""
        relay = getattr(self.cluster, "relay", None)
        if relay is None:
            return None
        return relay.stats().get(self.cluster.kv_event_endpoints[self.record["pod"]])

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()  # a restart under way completes: the next strategy needs every pod
        if self.record["status"] == "done" and self._relayed_at_up is not None:
            # The subscriptions outlive the process: the new one's events reach the relay, and through it the
            # indexer and kv_aware.
            self.record["kv_events_after_restart"] = self._relayed() - self._relayed_at_up


def restart_windows(record: Dict[str, Any], requests: List[Dict[str, Any]], samples_path: str,
                    time_scale: float) -> Dict[str, Any]:
    """The restart's stage split at the kill: its requests that started before and after it (TTFT p50/p90 of the
    answered ones, errors), and the restarted pod's mean running sequences and KV use in each part."""
    stage = [r for r in requests if r["stage"] == record["stage"]]
    rows = podmetrics.load_samples(samples_path) if os.path.exists(samples_path) else []
    kill, up = record["killed_t"], record["up_t"]
    # Per-request times are monotonic ÷ scale, pod samples wall time: kill_wall is the kill on the second clock.
    kill_wall = record["killed_wall"]
    t0 = min((r["start"] for r in stage), default=kill)
    t1 = max((r["end"] or r["start"] for r in stage), default=kill)
    out: Dict[str, Any] = {}
    for name, lo, hi in (("before", t0, kill), ("after", kill, t1)):
        mine = [r for r in stage if (r["start"] < kill) == (name == "before")]
        ok = answered_ttfts(mine)
        w0 = kill_wall + (lo - kill) * time_scale
        w1 = kill_wall + (hi - kill) * time_scale
        pod = podmetrics.per_pod(rows, w0, w1).get(record["pod"], {})
        out[name] = {"seconds": round(hi - lo, 1), "requests": len(mine), "errors": len(mine) - len(ok),
                     "ttft_p50": nearest_rank(ok, 50), "ttft_p90": nearest_rank(ok, 90),
                     "pod_running": pod.get("vllm:num_requests_running"), "pod_kv_usage": pod.get("vllm:kv_cache_usage_perc")}
    out["in_flight_at_kill"] = sum(1 for r in stage if r["start"] < kill <= (r["end"] or kill))
    out["down_window_requests"] = sum(1 for r in stage if kill <= r["start"] < up)
    return out
