"""Fixtures of the tests of the bench's analysis scripts, which read a run directory (`raw/`) or a
published results folder (`raw.tar.gz`) alike."""

import pathlib
import shutil
import subprocess
import sys
import tarfile

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "integration" / "bench"


@pytest.fixture
def analysis():
    """Runs `integration/bench/<script>` on a folder; (exit code, stdout, stderr)."""

    def run(script: str, folder: pathlib.Path):
        p = subprocess.run([sys.executable, str(BENCH / script), str(folder)], capture_output=True, text=True)
        return p.returncode, p.stdout, p.stderr

    return run


@pytest.fixture
def reads_archive_alike(tmp_path, analysis):
    """Asserts that `script` prints the same for a run directory written by `write_run(folder)`
    and for that run published the way `run.publish` does: results.json beside `raw/` packed into
    raw.tar.gz."""

    def check(script: str, write_run) -> None:
        run, folder = tmp_path / "run", tmp_path / "published"
        run.mkdir()
        folder.mkdir()
        write_run(run)
        if (run / "results.json").exists():
            shutil.copy(run / "results.json", folder / "results.json")
        with tarfile.open(folder / "raw.tar.gz", "w:gz") as tar:
            tar.add(run / "raw", arcname="raw")
        assert analysis(script, folder) == analysis(script, run)

    return check
