"""Gated delta rule prefill and decode (Qwen3-Next) at SGLang's GDN dispatcher.

``srt/layers/attention/linear/gdn_backend.py``: ``GDNKernelDispatcher.extend(q, k, v, g,
beta, *, ssm_states, cache_indices, query_start_loc, ...)`` (prefill, gates computed by
``fused_gdn_gating`` before it) and ``GDNKernelDispatcher.decode(q, k, v, a, b, *, A_log,
dt_bias, ssm_states, cache_indices, query_start_loc)`` (decode, gates fused into the
kernel). The dispatcher is where SGLang picks its kernel (Triton or FlashInfer on CUDA,
the CPU kernels here), so the same probe holds on every device. The state pool
``[slots, Hv, K, V]`` is updated in place at ``cache_indices``: those slots are
snapshotted before the call (initial state) and read after it (final state). TP=1 only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.sglang.probes.common import DTYPES, instantiate, single_rank

__all__ = ["GDN_PROBES", "GDN_TARGETS"]

_BACKEND = "sglang.srt.layers.attention.linear.gdn_backend"
EXTEND = f"{_BACKEND}:GDNKernelDispatcher.extend"
DECODE = f"{_BACKEND}:GDNKernelDispatcher.decode"
GDN_TARGETS = (EXTEND, DECODE, f"{_BACKEND}:GDNAttnBackend.forward_extend",
               f"{_BACKEND}:GDNAttnBackend.forward_decode",
               "sglang.kernels.ops.attention.linear.fused_gdn_gating:fused_gdn_gating")
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _tokens_first(t: torch.Tensor) -> torch.Tensor:
    """``[1, T, H, D]`` as ``[T, H, D]``; gates ``[1, T, H]`` (or ``[T, H]``) as ``[T, H]``."""
    return t.reshape(-1, *t.shape[-2:]) if t.dim() == 4 else t.reshape(-1, t.shape[-1])


def _define(call: ProbeCall, family: str) -> Definition | None:
    args = call.args
    q, v, pool = args.get("q"), args.get("v"), args.get("ssm_states")
    if q is None or v is None or pool is None or DTYPES.get(q.dtype) is None \
            or pool.dtype not in STATE_DTYPES or call.step.world_size != 1:
        return None
    head = int(q.shape[-1])
    if v.shape[-1] != head or tuple(pool.shape[2:]) != (head, head):
        return None
    if family == "gdn_decode" and _tokens_first(q).shape[0] != args["cache_indices"].shape[0]:
        return None  # one token per sequence only
    return instantiate(family, num_qk_heads=int(q.shape[-2]), num_v_heads=int(v.shape[-2]),
                       head_size=head, dtype=DTYPES[q.dtype])


def _slots(call: ProbeCall) -> torch.Tensor:
    return call.args["cache_indices"].to(torch.long)


def _before(call: ProbeCall) -> dict[str, Any]:
    return {"state": call.args["ssm_states"][_slots(call)].clone()}


def _notes(pool: torch.Tensor, extra: list[str]) -> list[str]:
    notes = ["state pool slots (cache_indices) snapshotted before the call (initial) and "
             "read after it (final): the kernel updates them in place",
             "scale = head_size ** -0.5: the kernel applies it internally (not an argument)",
             *extra]
    if pool.dtype != torch.float32:
        notes.append(f"the state pool is {str(pool.dtype).split('.')[-1]}: both states "
                     "widened to float32 exactly")
    return notes


def _adapt_extend(call: ProbeCall) -> Extracted:
    single_rank(call)
    args = call.args
    output = call.result[0] if isinstance(call.result, tuple) else call.result
    pool = args["ssm_states"]
    q = _tokens_first(args["q"])
    inputs = {"q": q, "k": _tokens_first(args["k"]), "v": _tokens_first(args["v"]),
              "g": _tokens_first(args["g"]).float(), "beta": _tokens_first(args["beta"]).float(),
              "initial_state": call.before["state"].float(),
              "cu_seqlens": args["query_start_loc"].to(torch.int32),
              "scale": float(q.shape[-1]) ** -0.5}
    outputs = {"output": _tokens_first(output), "final_state": pool[_slots(call)].float()}
    return Extracted(inputs, outputs, _notes(pool, [
        "g and beta as SGLang's fused_gdn_gating computed them for this call"]))


def _gates(args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's gates in float32: g = -exp(A_log) * softplus(a + dt_bias),
    beta = sigmoid(b) (softplus beta 1, threshold 20, as SGLang passes them)."""
    raw = _tokens_first(args["a"]).float() + args["dt_bias"].float()
    g = -torch.exp(args["A_log"].float()) * F.softplus(raw, beta=1.0, threshold=20.0)
    return g, torch.sigmoid(_tokens_first(args["b"]).float())


def _adapt_decode(call: ProbeCall) -> Extracted:
    single_rank(call)
    args = call.args
    g, beta = _gates(args)
    pool = args["ssm_states"]
    q = _tokens_first(args["q"])
    heads_v = _tokens_first(args["v"]).shape[1]
    inputs = {"q": q, "k": _tokens_first(args["k"]), "v": _tokens_first(args["v"]), "g": g,
              "beta": beta, "state": call.before["state"].float(),
              "scale": float(q.shape[-1]) ** -0.5}
    outputs = {"output": call.result.reshape(-1, heads_v, call.result.shape[-1]),
               "new_state": pool[_slots(call)].float()}
    return Extracted(inputs, outputs, _notes(pool, [
        "g and beta computed from the call's A_log, a, dt_bias, b in float32 (the decode "
        "kernel fuses its gating)"]))


GDN_PROBES = [
    Probe("sglang.gdn.extend", "gdn_prefill", lambda c: _define(c, "gdn_prefill"),
          _adapt_extend, target=EXTEND, when="prefill", before=_before,
          description="GDNKernelDispatcher.extend (gdn_backend.py)"),
    Probe("sglang.gdn.decode", "gdn_decode", lambda c: _define(c, "gdn_decode"),
          _adapt_decode, target=DECODE, when="decode", before=_before,
          description="GDNKernelDispatcher.decode (gdn_backend.py)"),
]
