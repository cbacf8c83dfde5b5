import sys
from pathlib import Path

# meshlib.py and oci tooling live next to / above this file; pytest runs with --import-mode=importlib.
_here = Path(__file__).resolve().parent
for p in (_here, _here.parents[1] / "integration"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
