"""flash-linear-attention's gated delta rule kernels as ``gdn_prefill`` / ``gdn_decode``.

The definitions hold tokens packed without a batch dimension (``[T, H, D]``), q/k with
``num_qk_heads`` heads each shared by ``num_v_heads // num_qk_heads`` consecutive value
heads, float32 ``g`` (log decay) and ``beta`` (post-sigmoid), a float32 state ``[N, HV, K, V]``
and un-normalised q/k. fla 0.6 takes ``[B, T, H, D]`` with ``B = 1`` for variable lengths
(``cu_seqlens``, int64), GVA natively (``HV`` a multiple of ``H``, value head ``h`` reading
q/k head ``h // (HV // H)``: the same grouping), states ``[N, HV, K, V]`` (``state_v_first``
False), q/k L2-normalised in the kernel (``use_qk_l2norm_in_kernel``, eps 1e-6) and
``scale`` as a Python float. So the conversion is: add the batch dimension, widen
``cu_seqlens``, pass everything else as it is, and take the batch dimension off again.

Every argument after ``v`` is passed by keyword. The two kernels do not share a positional
order: ``chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, ...)`` but
``fused_recurrent_gated_delta_rule(q, k, v, g, gk, gv, beta, scale, initial_state, ...)``, so
a decode call written like a prefill call, ``(q, k, v, g, beta, ...)``, hands ``beta`` over as
``gk`` (per-key decay read as ``[B, T, HV, K]``: past the end of a ``[B, T, HV]`` tensor) and
leaves ``beta`` at its default of ones: garbage or NaN, from a call convention, not a kernel
bug (docs/replay.md has the measurement).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from enginetap.dataset.schema import Definition

__all__ = ["gdn_decode", "gdn_prefill"]

Kernel = Callable[..., Any]


def _chunk_kernel() -> Kernel:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


def _recurrent_kernel() -> Kernel:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule


def gdn_prefill(definition: Definition, kernel: Kernel | None = None) -> Callable[..., Any]:
    """``run(q, k, v, g, beta, initial_state, cu_seqlens, scale)`` over fla's chunk kernel.

    ``kernel`` replaces ``chunk_gated_delta_rule`` (same keyword signature), for tests.
    """
    call = kernel or _chunk_kernel()

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
            scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        out, final = call(q[None], k[None], v[None], g=g[None], beta=beta[None],
                          scale=float(scale), initial_state=initial_state.contiguous(),
                          output_final_state=True, use_qk_l2norm_in_kernel=True,
                          cu_seqlens=cu_seqlens.to(torch.long))
        return out[0].to(v.dtype), final.to(torch.float32)

    return run


def gdn_decode(definition: Definition, kernel: Kernel | None = None) -> Callable[..., Any]:
    """``run(q, k, v, g, beta, state, scale)`` over fla's fused recurrent kernel, one token.

    Each sequence is a batch row of length 1 (no ``cu_seqlens``). ``kernel`` replaces
    ``fused_recurrent_gated_delta_rule`` (same keyword signature), for tests.
    """
    call = kernel or _recurrent_kernel()

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor,
            scale: Any) -> tuple[torch.Tensor, torch.Tensor]:
        import torch

        out, new_state = call(q[:, None], k[:, None], v[:, None], g=g[:, None],
                              beta=beta[:, None], scale=float(scale),
                              initial_state=state.contiguous(), output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
        return out[:, 0].to(v.dtype), new_state.to(torch.float32)

    return run
