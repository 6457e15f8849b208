"""Torch implementations of the kernels SGLang's CPU path calls unconditionally.

SGLang 0.5.23 on the CPU (``SGLANG_USE_CPU_ENGINE=1``) binds Qwen3-Next's gated-delta and
causal-convolution kernels at import, from its kernel package's CPU build
(``srt/layers/attention/linear/gdn_backend.py`` and ``.../kernels/gdn_triton.py``):

- ``sgl_kernel.mamba.causal_conv1d_fn_cpu`` / ``causal_conv1d_update_cpu``: the short
  convolution over ``[conv_dim]`` channels of prefill and decode, whose state pool
  ``[slots, conv_dim, width - 1]`` is updated in place;
- ``sgl_kernel.mamba.chunk_gated_delta_rule_cpu``: prefill, packed variable-length
  sequences, gates precomputed by ``torch.ops.sgl_kernel.fused_gdn_gating_cpu``;
- ``torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu``: decode, gates
  computed inside from ``A_log``, ``a``, ``dt_bias``, ``b``.

The recurrent state pool is ``[slots, Hv, K, V]`` and is updated in place at the call's
slots. Per value head (q/k head ``h // (Hv // Hk)``), with q and k L2-normalised (eps 1e-6)
and q scaled by ``K ** -0.5``: ``S = exp(g) S;  S += k (beta (v - k^T S))^T;  o = q^T S``,
token by token in float32 (tiny models: clarity over speed). These are enginetap's own
implementations; SGLang's attention, MoE, MLA and norms run unpatched.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu",
           "delta_rule", "gdn_gating", "register_ops", "sigmoid_gating_delta_rule_update"]

_EPS = 1e-6


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + _EPS)


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor,
               softplus_beta: float = 1.0, softplus_threshold: float = 20.0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``g = -exp(A_log) * softplus(a + dt_bias)`` (float32) and ``beta = sigmoid(b)``
    (``b``'s dtype), both ``[1, T, Hv]`` as SGLang's fused gating returns them."""
    x = a.to(torch.float32) + dt_bias.to(torch.float32)
    soft = F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    g = -torch.exp(A_log.to(torch.float32)) * soft
    beta = torch.sigmoid(b.to(torch.float32)).to(b.dtype)
    return g.reshape(1, *g.shape[-2:]), beta.reshape(1, *beta.shape[-2:])


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, state: torch.Tensor, l2norm: bool = True
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q/k ``[T, Hk, K]``, v ``[T, Hv, V]``, g/beta ``[T, Hv]``, state
    ``[Hv, K, V]``; returns the output ``[T, Hv, V]`` (float32) and the final state."""
    group = v.shape[1] // q.shape[1]
    qf, kf = q.to(torch.float32), k.to(torch.float32)
    if l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    qf = (qf * q.shape[-1] ** -0.5).repeat_interleave(group, dim=1)
    kf = kf.repeat_interleave(group, dim=1)
    vf, gf, bf = v.to(torch.float32), g.to(torch.float32), beta.to(torch.float32)
    s = state.to(torch.float32).clone()
    out = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    for t in range(q.shape[0]):
        s = s * torch.exp(gf[t])[:, None, None]
        delta = bf[t][:, None] * (vf[t] - torch.einsum("hk,hkv->hv", kf[t], s))
        s = s + kf[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", qf[t], s)
    return out, s


def chunk_gated_delta_rule_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor,
                               cu_seqlens: torch.Tensor, head_first: bool = False,
                               use_qk_l2norm_in_kernel: bool = True,
                               initial_state_indices: torch.Tensor | None = None,
                               **unused: Any) -> tuple[torch.Tensor, torch.Tensor, None]:
    """Prefill: q/k ``[1, T, Hk, K]``, v ``[1, T, Hv, V]``, g/beta ``[1, T, Hv]``; sequence
    ``s`` spans ``cu_seqlens[s]:cu_seqlens[s+1]`` and starts from (and writes back)
    ``initial_state[initial_state_indices[s]]``. Returns ``(out [1, T, Hv, V], final
    states [N, Hv, K, V], None)``."""
    if head_first:
        raise NotImplementedError("enginetap's CPU gated-delta prefill takes tokens first "
                                  "(head_first=False), as SGLang's CPU path passes them")
    bounds = [int(x) for x in cu_seqlens.tolist()]
    slots = (list(range(len(bounds) - 1)) if initial_state_indices is None
             else [int(x) for x in initial_state_indices.tolist()])
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    finals = []
    for s, slot in enumerate(slots):
        a, e = bounds[s], bounds[s + 1]
        o, state = delta_rule(q[0, a:e], k[0, a:e], v[0, a:e], g[0, a:e], beta[0, a:e],
                              initial_state[slot], use_qk_l2norm_in_kernel)
        out[0, a:e] = o.to(q.dtype)
        initial_state[slot] = state.to(initial_state.dtype)
        finals.append(state)
    final = (torch.stack(finals) if finals
             else initial_state.new_empty((0, *initial_state.shape[1:])))
    return out, final, None


def sigmoid_gating_delta_rule_update(A_log: torch.Tensor, dt_bias: torch.Tensor,
                                     q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     a: torch.Tensor, b: torch.Tensor,
                                     initial_state_source: torch.Tensor,
                                     initial_state_indices: torch.Tensor,
                                     cu_seqlens: torch.Tensor | None = None,
                                     use_qk_l2norm_in_kernel: bool = True,
                                     softplus_beta: float = 1.0,
                                     softplus_threshold: float = 20.0) -> torch.Tensor:
    """Decode: one token per request (q/k ``[1, B, Hk, K]``, v ``[1, B, Hv, V]``, a/b
    ``[B, Hv]``), gates computed here, the state of ``initial_state_indices[i]`` updated
    in place. Returns ``[1, B, Hv, V]`` in q's dtype."""
    g, beta = gdn_gating(A_log, a, b, dt_bias, softplus_beta, softplus_threshold)
    if cu_seqlens is not None and cu_seqlens.numel() == q.shape[1] + 1:
        bounds = [int(x) for x in cu_seqlens.tolist()]
    else:
        bounds = list(range(q.shape[1] + 1))
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for i, slot in enumerate(int(x) for x in initial_state_indices.tolist()):
        a0, e0 = bounds[i], bounds[i + 1]
        if slot < 0:  # a padded row: SGLang's kernels skip it
            out[0, a0:e0] = 0
            continue
        o, state = delta_rule(q[0, a0:e0], k[0, a0:e0], v[0, a0:e0], g[0, a0:e0],
                              beta[0, a0:e0], initial_state_source[slot],
                              use_qk_l2norm_in_kernel)
        out[0, a0:e0] = o.to(q.dtype)
        initial_state_source[slot] = state.to(initial_state_source.dtype)
    return out


def _conv(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          silu: bool) -> torch.Tensor:
    """Depthwise causal convolution of ``window [dim, W - 1 + L]`` → ``[dim, L]``."""
    width = weight.shape[-1]
    out = F.conv1d(window.to(torch.float32)[None], weight.to(torch.float32)[:, None, :],
                   None if bias is None else bias.to(torch.float32),
                   groups=weight.shape[0])[0]
    assert out.shape[-1] == window.shape[-1] - width + 1
    return F.silu(out) if silu else out


def causal_conv1d_fn_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         activation: str | None = "silu", conv_states: torch.Tensor | None = None,
                         has_initial_state: torch.Tensor | None = None,
                         cache_indices: torch.Tensor | None = None,
                         query_start_loc: torch.Tensor | None = None,
                         seq_lens_cpu: Any = None, **unused: Any) -> torch.Tensor:
    """Prefill: ``x [dim, T]`` (packed sequences by ``query_start_loc``), weight
    ``[dim, W]``; sequence ``s`` starts from ``conv_states[cache_indices[s]]`` (``[dim,
    W - 1]``) where ``has_initial_state[s]``, else from zeros, and leaves its last
    ``W - 1`` inputs there. Returns ``[dim, T]`` in x's dtype."""
    if conv_states is None or cache_indices is None or query_start_loc is None:
        raise NotImplementedError("enginetap's CPU causal conv needs conv_states, "
                                  "cache_indices and query_start_loc, as SGLang passes them")
    silu = activation in ("silu", "swish", True)
    width = weight.shape[-1]
    bounds = [int(t) for t in query_start_loc.tolist()]
    initial = (None if has_initial_state is None
               else [bool(t) for t in has_initial_state.tolist()])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for s, slot in enumerate(int(t) for t in cache_indices.tolist()):
        a, e = bounds[s], bounds[s + 1]
        if slot < 0:
            continue
        prior = conv_states[slot].to(x.dtype)
        if initial is not None and not initial[s]:
            prior = torch.zeros_like(prior)
        window = torch.cat([prior, x[:, a:e]], dim=-1)
        out[:, a:e] = _conv(window, weight, bias, silu).to(x.dtype)
        conv_states[slot] = window[:, -(width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update_cpu(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None, activation: str | None = "silu",
                             conv_state_indices: torch.Tensor | None = None,
                             intermediate_conv_window: Any = None, **unused: Any) -> torch.Tensor:
    """Decode: one token per request, ``x [B, dim]``; the state of
    ``conv_state_indices[i]`` shifts by one. Returns ``[B, dim]`` in x's dtype."""
    if x.dim() != 2 or intermediate_conv_window is not None:
        raise NotImplementedError("enginetap's CPU causal conv update runs one token per "
                                  "request (no speculative decoding on the CPU path)")
    silu = activation in ("silu", "swish", True)
    slots = (list(range(x.shape[0])) if conv_state_indices is None
             else [int(t) for t in conv_state_indices.tolist()])
    out = torch.empty_like(x)
    for i, slot in enumerate(slots):
        if slot < 0:
            out[i] = 0
            continue
        window = torch.cat([conv_states[slot].to(x.dtype), x[i][:, None]], dim=-1)
        out[i] = _conv(window, weight, bias, silu)[:, -1].to(x.dtype)
        conv_states[slot] = window[:, 1:].to(conv_states.dtype)
    return out


_REGISTERED = False


def register_ops() -> None:
    """``torch.ops.sgl_kernel.fused_gdn_gating_cpu`` and
    ``fused_sigmoid_gating_delta_rule_update_cpu`` (SGLang reads both at import); once."""
    global _REGISTERED
    if _REGISTERED or hasattr(torch.ops.sgl_kernel, "fused_gdn_gating_cpu"):
        _REGISTERED = True
        return

    @torch.library.custom_op("sgl_kernel::fused_gdn_gating_cpu", mutates_args=())
    def fused_gdn_gating_cpu(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gdn_gating(A_log, a, b, dt_bias)

    @torch.library.custom_op("sgl_kernel::fused_sigmoid_gating_delta_rule_update_cpu",
                             mutates_args=("initial_state_source",))
    def fused_sigmoid_gating_delta_rule_update_cpu(
            A_log: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
            initial_state_source: torch.Tensor, initial_state_indices: torch.Tensor,
            cu_seqlens: torch.Tensor | None = None, use_qk_l2norm_in_kernel: bool = True,
            softplus_beta: float = 1.0, softplus_threshold: float = 20.0) -> torch.Tensor:
        return sigmoid_gating_delta_rule_update(
            A_log, dt_bias, q, k, v, a, b, initial_state_source, initial_state_indices,
            cu_seqlens, use_qk_l2norm_in_kernel, softplus_beta, softplus_threshold)

    _REGISTERED = True
