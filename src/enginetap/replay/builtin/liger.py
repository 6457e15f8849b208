"""Liger's Triton RMSNorm kernels as ``rmsnorm``, ``rmsnorm_offset`` and ``fused_add_rmsnorm``.

Liger's casting modes name the definitions' roundings: ``llama`` normalises in float32,
rounds the row to the input dtype and multiplies by the weight in that dtype (rounding
``twice``); ``gemma`` does everything in float32 and rounds once (rounding ``once``, and
``rmsnorm_offset``, whose scale ``1 + weight`` is Liger's ``offset=1``). Its fused add rounds
the sum to the input dtype before taking the variance, where the definition takes the
float32 sum: a difference the family's tolerance is there to absorb.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from enginetap.definitions.base import params_of
from enginetap.definitions.norms import FUSED_ADD_RMSNORM, RMSNORM

if TYPE_CHECKING:
    import torch

    from enginetap.dataset.schema import Definition

__all__ = ["fused_add_rmsnorm", "rmsnorm", "rmsnorm_offset"]

_MODES = {"twice": "llama", "once": "gemma"}


def rmsnorm(definition: Definition) -> Callable[..., Any]:
    """``run(hidden_states, weight, eps)`` over ``rms_norm_forward``."""
    mode = _MODES[params_of(definition, RMSNORM).get("rounding", "twice")]
    return _norm(mode, 0.0)


def rmsnorm_offset(definition: Definition) -> Callable[..., Any]:
    """``run(hidden_states, weight, eps)``, scale ``1 + weight``, one float32 rounding."""
    return _norm("gemma", 1.0)


def _norm(mode: str, offset: float) -> Callable[..., Any]:
    from liger_kernel.ops.rms_norm import rms_norm_forward

    def run(hidden_states: torch.Tensor, weight: torch.Tensor, eps: Any) -> torch.Tensor:
        return rms_norm_forward(hidden_states, weight, float(eps), offset, mode, None)[0]

    return run


def fused_add_rmsnorm(definition: Definition) -> Callable[..., Any]:
    """``run(hidden_states, residual, weight, eps)`` -> ``(output, residual_out)``."""
    from liger_kernel.ops.fused_add_rms_norm import fused_add_rms_norm_forward

    mode = _MODES[params_of(definition, FUSED_ADD_RMSNORM).get("rounding", "twice")]

    def run(hidden_states: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
            eps: Any) -> tuple[torch.Tensor, torch.Tensor]:
        output, summed = fused_add_rms_norm_forward(hidden_states, residual, weight,
                                                    float(eps), 0.0, mode)[:2]
        return output, summed

    return run
