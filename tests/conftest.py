"""Suite-wide fixtures: global enginetap state is reset around every test."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _reset_enginetap_state():
    from enginetap import config
    from enginetap.core import context

    config.reset_arming()
    context.reset()
    yield
    config.reset_arming()
    context.reset()
