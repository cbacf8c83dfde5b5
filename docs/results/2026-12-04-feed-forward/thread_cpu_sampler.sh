#!/bin/bash
# Every second, each running Envoy's threads' CPU in clock ticks (utime, stime from
# /proc/<pid>/task/<tid>/stat), one line per thread: "unix-seconds pid tid name utime stime".
# Run beside a benchmark, stop it by its PID; per-thread CPU per second is the difference of
# two seconds' lines. Usage: thread_cpu_sampler.sh OUTPUT_FILE
out=${1:?output file}
: > "$out"
while true; do
  for pid in $(pgrep -x envoy); do
    ts=$(date +%s)
    for task in /proc/"$pid"/task/*; do
      read -r -a stat < "$task"/stat 2>/dev/null || continue
      echo "$ts $pid ${task##*/} $(cat "$task"/comm 2>/dev/null) ${stat[13]} ${stat[14]}" >> "$out"
    done
  done
  sleep 1
done
