"""Per-thread idle CPU of the last Envoy in a thread_cpu_sampler.sh file: ms of CPU per second
over the 20 s that end 2 s before its last sample (the --settle-seconds idle window). On a busy
host the sampler skips a second now and then; the window then runs from its first to its last
sample. Usage: idle_threads.py FILE..."""
import collections
import sys

for path in sys.argv[1:]:
    ticks = collections.defaultdict(dict)  # (pid, tid, name) -> {unix second: utime+stime ticks}
    for line in open(path):
        f = line.split()
        ticks[(f[1], f[2], " ".join(f[3:-2]))][int(f[0])] = int(f[-2]) + int(f[-1])
    last_pid = max((max(v), k[0]) for k, v in ticks.items())[1]
    end = max(max(v) for k, v in ticks.items() if k[0] == last_pid)
    seconds = sorted({s for k, v in ticks.items() if k[0] == last_pid for s in v if end - 22 <= s <= end - 2})
    lo, hi = seconds[0], seconds[-1]
    total = main = workers = 0.0
    for (pid, tid, name), at in ticks.items():
        if pid != last_pid or lo not in at or hi not in at:
            continue
        ms_per_s = (at[hi] - at[lo]) * 10 / (hi - lo)  # a tick is 10 ms
        total += ms_per_s
        if pid == tid:
            main = ms_per_s
        elif name.startswith("wrk:"):
            workers += ms_per_s
    print(f"{path}: Envoy {total:.1f} ms/s, main thread {main:.1f}, workers {workers:.1f}")
