import sys
from pathlib import Path

import pytest
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))

import indexer_harness  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _binary():
    indexer_harness.indexer_binary()


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)
