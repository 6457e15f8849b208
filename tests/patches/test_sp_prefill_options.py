"""sp_prefill's options, registration and lock, without starting vLLM."""

from __future__ import annotations

import pytest

from enginetap.capabilities import REGISTRY
from enginetap.config import ArmConfig
from pydantic import ValidationError
from enginetap.guard import GuardLock, check_lock
from enginetap.patches.sp_prefill import LOCK, SpPrefillOptions


def test_armed_by_name_with_defaults():
    config = ArmConfig(enabled=True, capabilities=["sp_prefill"])
    options = config.parsed_options()["sp_prefill"]
    assert isinstance(options, SpPrefillOptions)
    assert (options.mode, options.min_rows, options.tolerance) == ("exact", 2048, 0.0)
    assert REGISTRY.order(["sp_prefill"]) == ["step", "sp_prefill"]


@pytest.mark.parametrize("bad, field", [({"mode": "fast"}, "mode"),
                                        ({"min_rows": 0}, "min_rows"),
                                        ({"mode": "exact", "tolerance": 0.1}, "tolerance"),
                                        ({"rows": 4}, "rows")])
def test_bad_options_are_refused_when_the_config_is_parsed(bad, field):
    with pytest.raises(ValidationError, match=f"options.sp_prefill.*{field}"):
        ArmConfig(enabled=True, capabilities=["sp_prefill"], options={"sp_prefill": bad})


def test_shipped_lock_matches_the_installed_vllm():
    pytest.importorskip("vllm")
    from enginetap.patches.sp_prefill.patch import PINNED

    check_lock(LOCK)
    assert [e.target for e in GuardLock.load(LOCK).entries] == PINNED
