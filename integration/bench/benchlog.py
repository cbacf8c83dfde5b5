"""Progress lines of the benchmark scripts: `[<tool> HH:MM:SS] message`, UTC, flushed at once so
a log read while a run goes on is current."""

from __future__ import annotations

import datetime as dt
from typing import Callable


def logger(tool: str) -> Callable[[str], None]:
    def log(msg: str) -> None:
        print(f"[{tool} {dt.datetime.now(dt.timezone.utc).strftime('%H:%M:%S')}] {msg}", flush=True)
    return log
