"""Added CPU per request in cpu_split.py outputs run back to back ("== BUILD time" before each):
(user + system of kvroute) minus (user + system of the plain Envoy run just before it), per
reading, sorted, with the median per build. Usage: added.py FILE..."""
import re
import statistics
import sys

for path in sys.argv[1:]:
    added: dict[str, list[float]] = {}
    build, plain = "", 0.0
    for line in open(path):
        if line.startswith("=="):
            build = line.split()[1]
            continue
        m = re.match(r"(\w+)\s+n=\d+ user\s+([\d.]+) sys\s+([\d.]+)", line)
        if not m:
            continue
        total = float(m.group(2)) + float(m.group(3))
        if m.group(1) == "plain":
            plain = total
        else:
            added.setdefault(build, []).append(round(total - plain, 1))
    for build, values in added.items():
        print(f"{path}: {build}: {sorted(values)} median {statistics.median(values):.1f}")
