"""Gated delta rule prefill and decode (Qwen3-Next) on vLLM CPU.

``model_executor/layers/mamba/ops/cpu/gdn_attention.py`` calls the kernels through
``vllm._custom_ops`` at run time, so the probes wrap them there:
``chunk_gated_delta_rule_cpu`` (prefill, gates precomputed by ``fused_gdn_gating_cpu``)
and ``fused_sigmoid_gating_delta_rule_update_cpu`` (decode, gates computed inside from
``A_log``, ``a``, ``dt_bias``, ``b``). The recurrent state pool ``[slots, Hv, K, V]`` is
updated in place: the slots of the call are snapshotted before it (initial state) and read
after it (final state). Heads are sharded under TP and gathered on rank 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.vllm.probes.common import (DTYPES, gather, instantiate, other_rank,
                                                   tp_world)

__all__ = ["GDN_PROBES", "GDN_TARGETS"]

PREFILL = "vllm._custom_ops:chunk_gated_delta_rule_cpu"
DECODE = "vllm._custom_ops:fused_sigmoid_gating_delta_rule_update_cpu"
GDN_TARGETS = (PREFILL, DECODE, "vllm._custom_ops:fused_gdn_gating_cpu",
               "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:"
               "_cpu_gdn_attention_nonspec")


def _tokens_first(t: torch.Tensor) -> torch.Tensor:
    """``[1, T, H, D]`` (or ``[T, H, D]``) as ``[T, H, D]``; gates ``[1, T, H]`` as ``[T, H]``."""
    return t.reshape(-1, *t.shape[-2:]) if t.dim() == 4 else t.reshape(-1, t.shape[-1])


STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""State pool dtypes captured: float32, or the model's dtype where vLLM CPU keeps
``mamba_ssm_cache_dtype="auto"`` (it forces float32 only where the CPU has AVX-512 BF16, for
its accelerated kernels; elsewhere, e.g. AVX2 on AMD EPYC, the pool is bf16). A 16-bit
state is widened to float32 exactly; the definition's state tolerance (1e-2) holds the
engine's rounding of the state it writes (2**-9 relative for bf16)."""


def _define(call: ProbeCall, family: str, q: Any, v: Any, pool: Any) -> Definition | None:
    if q is None or v is None or DTYPES.get(q.dtype) is None or pool.dtype not in STATE_DTYPES:
        return None
    if not call.args.get("use_qk_l2norm_in_kernel") or call.args.get("head_first"):
        return None
    head = int(q.shape[-1])
    if v.shape[-1] != head or tuple(pool.shape[2:]) != (head, head):
        return None
    world = tp_world(call)
    return instantiate(family, num_qk_heads=int(q.shape[-2]) * world,
                       num_v_heads=int(v.shape[-2]) * world, head_size=head,
                       dtype=DTYPES[q.dtype])


def _define_prefill(call: ProbeCall) -> Definition | None:
    args = call.args
    if not args.get("output_final_state"):
        return None
    return _define(call, "gdn_prefill", args.get("query"), args.get("value"),
                   args["initial_state"])


def _define_decode(call: ProbeCall) -> Definition | None:
    args = call.args
    q = args.get("q")
    tokens = _tokens_first(q).shape[0] if q is not None else -1
    if tokens != args["initial_state_indices"].shape[0]:  # one token per sequence only
        return None
    return _define(call, "gdn_decode", q, args.get("v"), args["initial_state_source"])


def _slots(call: ProbeCall) -> torch.Tensor:
    return call.args["initial_state_indices"].to(torch.long)


def _before_prefill(call: ProbeCall) -> dict[str, Any]:
    return {"state": call.args["initial_state"][_slots(call)].clone()}


def _before_decode(call: ProbeCall) -> dict[str, Any]:
    return {"state": call.args["initial_state_source"][_slots(call)].clone()}


def _gathered(call: ProbeCall, named: dict[str, torch.Tensor]) -> dict[str, Any] | None:
    """Every tensor gathered along its head dimension (1), in a fixed order."""
    out = {name: gather(call, t, 1) for name, t in named.items()}
    return None if any(t is None for t in out.values()) else out


def _notes(call: ProbeCall, pool: torch.Tensor, extra: list[str]) -> list[str]:
    notes = ["state pool slots snapshotted before the call (initial) and read after it "
             "(final): the kernel updates them in place",
             "scale = head_size ** -0.5: the kernel applies it internally (not an argument)",
             *extra]
    if pool.dtype != torch.float32:
        notes.append(f"the engine keeps the state pool in {str(pool.dtype).split('.')[-1]} "
                     "(vLLM CPU's mamba_ssm_cache_dtype 'auto' on a CPU without AVX-512 "
                     "BF16): both states widened to float32 exactly; the state it wrote is "
                     "rounded to that dtype")
    if tp_world(call) > 1:
        notes.append(f"TP={tp_world(call)}: heads gathered from every rank in rank order")
    return notes


def _adapt_prefill(call: ProbeCall) -> Extracted:
    args = call.args
    output = call.result[0] if isinstance(call.result, tuple) else call.result
    named = {"q": _tokens_first(args["query"]), "k": _tokens_first(args["key"]),
             "v": _tokens_first(args["value"]), "g": _tokens_first(args["g"]).float(),
             "beta": _tokens_first(args["beta"]).float(),
             "initial_state": call.before["state"].float(),
             "final_state": args["initial_state"][_slots(call)].float(),
             "output": _tokens_first(output)}
    parts = _gathered(call, named)
    if parts is None:
        return other_rank()
    inputs = {k: parts[k] for k in ("q", "k", "v", "g", "beta", "initial_state")}
    inputs["cu_seqlens"] = args["cu_seqlens"].to(torch.int32)
    inputs["scale"] = float(parts["q"].shape[-1]) ** -0.5
    outputs = {"output": parts["output"], "final_state": parts["final_state"]}
    return Extracted(inputs, outputs, _notes(call, args["initial_state"],
                                             ["g and beta as fused_gdn_gating_cpu computed "
                                              "them for this call"]))


def _gates(args: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode kernel's gates, computed outside it in float32 for the definition:
    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    a = _tokens_first(args["a"]).float()
    raw = a + args["dt_bias"].float()
    softplus = F.softplus(raw, beta=float(args.get("softplus_beta", 1.0)),
                          threshold=float(args.get("softplus_threshold", 20.0)))
    g = -torch.exp(args["A_log"].float()) * softplus
    return g, torch.sigmoid(_tokens_first(args["b"]).float())


def _adapt_decode(call: ProbeCall) -> Extracted:
    args = call.args
    g, beta = _gates(args)
    heads_v = _tokens_first(args["v"]).shape[1]
    named = {"q": _tokens_first(args["q"]), "k": _tokens_first(args["k"]),
             "v": _tokens_first(args["v"]), "g": g, "beta": beta,
             "state": call.before["state"].float(),
             "new_state": args["initial_state_source"][_slots(call)].float(),
             "output": call.result.reshape(-1, heads_v, call.result.shape[-1])}
    parts = _gathered(call, named)
    if parts is None:
        return other_rank()
    inputs = {k: parts[k] for k in ("q", "k", "v", "g", "beta", "state")}
    inputs["scale"] = float(parts["q"].shape[-1]) ** -0.5
    outputs = {"output": parts["output"], "new_state": parts["new_state"]}
    note = ("g and beta computed from the kernel's A_log, a, dt_bias, b in float32 "
            "(the decode kernel fuses its gating)")
    return Extracted(inputs, outputs, _notes(call, args["initial_state_source"], [note]))


def _regroup_decode(args: dict[str, Any], picks: list[int]) -> dict[str, Any]:
    """The decode call for its requests ``picks`` (one token each; the call's decodes are
    the step's first requests): their tokens, gates and initial states, each pick in a slot
    of its own in a private pool (a repeated request must not update one slot twice)."""
    index = torch.tensor(picks, dtype=torch.long, device=args["q"].device)
    slots = args["initial_state_indices"].to(torch.long)[index]
    out = dict(args)
    for name in ("q", "k", "v", "a", "b"):
        t = args[name]
        out[name] = t.index_select(1 if t.dim() == 4 else 0, index)
    out["initial_state_source"] = args["initial_state_source"][slots].clone()
    out["initial_state_indices"] = torch.arange(len(picks), device=index.device,
                                                dtype=args["initial_state_indices"].dtype)
    cu = args["cu_seqlens"]
    out["cu_seqlens"] = torch.arange(len(picks) + 1, device=cu.device, dtype=cu.dtype)
    return out


GDN_PROBES = [
    Probe("vllm.gdn.prefill", "gdn_prefill", _define_prefill, _adapt_prefill, target=PREFILL,
          when="prefill", before=_before_prefill,
          description="vllm._custom_ops.chunk_gated_delta_rule_cpu"),
    Probe("vllm.gdn.decode", "gdn_decode", _define_decode, _adapt_decode, target=DECODE,
          when="decode", before=_before_decode, regroup=_regroup_decode,
          description="vllm._custom_ops.fused_sigmoid_gating_delta_rule_update_cpu"),
]
