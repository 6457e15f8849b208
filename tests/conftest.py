"""Suite-wide fixtures: global enginetap state is reset around every test."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

VLLM_LOCK = Path("/tmp/enginetap-vllm.lock")
# Modules whose engine runs are TP=2: under ``make test`` (tests/run_suite.py) the engines
# process runs them last, when the other process has usually finished.
TP_MODULES = ("test_sp_prefill_vllm.py", "test_capture_vllm_tp.py", "test_vllm_tp.py")


def pytest_configure(config):
    # Tiny models on a shared 2-core machine: one intra-op thread per test process is
    # faster than two fighting for the cores (engine subprocesses set their own).
    import torch

    torch.set_num_threads(1)
    # vLLM CPU sizes its KV cache from free memory by default (5 GiB per worker here) and
    # allocates and zeroes all of it at every engine start: a third of a tiny model's
    # start-up. The suite's models need far less; engine children inherit this.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.hookimpl(trylast=True)  # after -m has deselected
def pytest_collection_modifyitems(config, items):
    role = os.environ.get("ETSUITE_ROLE")
    if role == "engines":
        items.sort(key=lambda item: item.path.name in TP_MODULES)  # stable: file order kept
    elif role == "rest":
        # the engines process holds the vLLM lock for its whole session
        unmarked = [item.nodeid for item in items if "vllm_lock" in item.fixturenames]
        if unmarked:
            raise pytest.UsageError("tests that start vLLM must be marked `vllm` (the lock "
                                    "is held by make test's other process): "
                                    + ", ".join(unmarked[:5]))


@pytest.fixture(autouse=True)
def _reset_enginetap_state():
    from enginetap import config
    from enginetap.core import context

    config.reset_arming()
    context.reset()
    yield
    config.reset_arming()
    context.reset()


@pytest.fixture(scope="session")
def vllm_lock() -> Iterator[None]:
    """Hold the machine-wide vLLM lock for the session: one vLLM engine at a time (each
    takes gigabytes of RAM). One session-wide holder, so tests never wait on themselves."""
    pytest.importorskip("vllm")
    with VLLM_LOCK.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
