"""The patching layer on a real vLLM CPU layer (no engine started).

vLLM's CustomOp layers pick their forward method when they are built, so a patch has to be
in place before construction to see calls through ``module(x)``: this pins that rule.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers import layernorm  # noqa: E402

from enginetap.core.patching import Patch, bind_arguments  # noqa: E402

TARGET = "vllm.model_executor.layers.layernorm:RMSNorm.forward_native"


def _build() -> layernorm.RMSNorm:
    with set_current_vllm_config(VllmConfig()):
        norm = layernorm.RMSNorm(32, eps=1e-6)
    norm.weight.data.normal_(1.0, 0.1, generator=torch.Generator().manual_seed(1))
    return norm


def test_patch_before_build_sees_calls_and_keeps_outputs():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    residual = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    stock = _build()
    expected = stock(x.clone(), residual.clone())
    original = vars(layernorm.RMSNorm)["forward_native"]
    seen = []

    def spy(wrapped, instance, args, kwargs):
        seen.append(sorted(k for k, v in bind_arguments(wrapped, args, kwargs).items()
                           if v is not None))
        return wrapped(*args, **kwargs)

    patch = Patch(TARGET, spy).install()
    try:
        patched = _build()
        patched.load_state_dict(stock.state_dict())
        got = patched(x.clone(), residual.clone())
        late = stock(x.clone())  # built before the patch: keeps its bound stock method
    finally:
        patch.uninstall()
    assert seen == [["residual", "x"]]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert late.shape == x.shape
    assert vars(layernorm.RMSNorm)["forward_native"] is original
