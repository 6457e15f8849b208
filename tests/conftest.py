"""Suite-wide fixtures: global enginetap state is reset around every test."""

from __future__ import annotations

import pytest


def pytest_configure(config):
    # Tiny models on a shared 2-core machine: one intra-op thread per test process is
    # faster than two fighting for the cores (engine subprocesses set their own).
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reset_enginetap_state():
    from enginetap import config
    from enginetap.core import context

    config.reset_arming()
    context.reset()
    yield
    config.reset_arming()
    context.reset()
