"""Fixtures for vllm-sim tests: the harness module, the binary, a ZMQ SUB collector."""

import pathlib
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "integration"))
sys.path.insert(0, str(HERE))

import simcluster  # noqa: E402
from vllmsim_zmq import Sub  # noqa: E402


@pytest.fixture(scope="session")
def sim_bin():
    return simcluster.sim_binary()


@pytest.fixture
def sub():
    s = Sub()
    yield s
    s.close()
