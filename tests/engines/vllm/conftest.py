"""Fixtures for tests that start vLLM CPU: one engine at a time, tiny built-in models."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

# The suite imports test files by path (importlib mode); this folder's helper modules
# (run scripts, step checks, probe patches) are imported by name, here and in workers.
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
pytest.register_assert_rewrite("step_checks")


@pytest.fixture(scope="session")
def tiny_model(vllm_lock: None):
    """``tiny_model(name)``: the built-in model's folder (built once, then cached)."""
    from enginetap.models import build_model

    return build_model
