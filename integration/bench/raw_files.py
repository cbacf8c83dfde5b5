"""One file of every strategy's raw records, read from a run directory (`raw/<strategy>/<name>`)
or from a published results folder (the same paths inside `raw.tar.gz`)."""

from __future__ import annotations

import gzip
import json
import os
import tarfile
from typing import Dict, List


def _text(data: bytes, name: str) -> str:
    return (gzip.decompress(data) if name.endswith(".gz") else data).decode()


def read_raw(run: str, name: str) -> Dict[str, str]:
    """The text of `raw/<strategy>/<name>` by strategy name (gzip undone for `.gz` names)."""
    found: Dict[str, str] = {}
    tar_path = os.path.join(run, "raw.tar.gz")
    if os.path.exists(tar_path):
        with tarfile.open(tar_path, "r:gz") as tar:
            for member in tar.getmembers():
                parts = member.name.split("/")
                if len(parts) == 3 and parts[0] == "raw" and parts[2] == name:
                    raw = tar.extractfile(member)
                    if raw is not None:
                        found[parts[1]] = _text(raw.read(), name)
        return found
    raw_dir = os.path.join(run, "raw")
    for strategy in sorted(os.listdir(raw_dir)) if os.path.isdir(raw_dir) else []:
        path = os.path.join(raw_dir, strategy, name)
        if os.path.exists(path):
            with open(path, "rb") as fh:
                found[strategy] = _text(fh.read(), name)
    return found


def json_lines(text: str) -> List[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
