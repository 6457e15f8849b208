"""Fixtures for traffic tests: the real Mooncake sample beside the repository, our fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = Path(__file__).resolve().parents[2]
# CI clones the repository with shared/ beside it; a worktree under ../wt/NAME of the main
# checkout finds the same folder one level further up.
_CANDIDATES = [ROOT.parent / "shared/traces", ROOT.parent.parent / "shared/traces"]
REAL_TRACE = next((c for c in _CANDIDATES if c.is_dir()), _CANDIDATES[0]) / \
    "mooncake_conversation_500.jsonl"


@pytest.fixture
def real_trace_path() -> Path:
    """The 500-request Mooncake sample in ../shared/traces (skipped where it is absent)."""
    if not REAL_TRACE.is_file():
        pytest.skip(f"the Mooncake sample is not at {REAL_TRACE} (shared/ beside the repo)")
    return REAL_TRACE


@pytest.fixture
def agentx_path() -> Path:
    """Our own small AgentX-format fixture."""
    return HERE / "data" / "agentx_shapes.json"
