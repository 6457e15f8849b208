"""Gated delta rule probes of the built-in engine (Qwen3-Next linear attention).

``Qwen3NextGatedDeltaNet.forward`` calls the module-level functions
``torch_chunk_gated_delta_rule`` (prefill) and ``torch_recurrent_gated_delta_rule`` (one
cached token) by their global names, so patching those module attributes sees every call.
Both get ``query``/``key`` ``[B, T, Hv, K]`` (already repeated from the q/k heads to the
value heads), ``value [B, T, Hv, V]``, float32 ``g`` and bf16 ``beta`` ``[B, T, Hv]``, the
cached ``initial_state [B, Hv, K, V]`` (None on a fresh prefill) and return
``(output [B, T, Hv, V], final_state [B, Hv, K, V])``. The state goes back into the cache
after the call, so it is snapshotted before it (cloned, selected calls only).

A left-padded prefill row starts with pad tokens: the engine zeroes their hidden states,
so their keys and values are zero and a zero initial state stays zero through them; the
adapter checks exactly that before dropping them, and declines otherwise.
"""

from __future__ import annotations

from typing import Any

import torch

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.core.scope import current_module
from enginetap.dataset.schema import Definition
from enginetap.engines.hf.probes.common import DTYPES, PAD_NOTE, batch_requests, instantiate

__all__ = ["GDN_PROBES"]

_MODULE = "transformers.models.qwen3_next.modeling_qwen3_next"


def _define(call: ProbeCall) -> Definition | None:
    module = current_module()
    q, v = call.args["query"], call.args["value"]
    dtype = DTYPES.get(q.dtype)
    if module is None or dtype is None or not call.args.get("use_qk_l2norm_in_kernel"):
        return None
    qk_heads, v_heads = int(module.num_k_heads), int(module.num_v_heads)
    head = int(q.shape[-1])
    if v.shape[-1] != head or q.shape[2] != v_heads:
        return None
    family = "gdn_prefill" if call.step.mode == "prefill" else "gdn_decode"
    return instantiate(family, num_qk_heads=qk_heads, num_v_heads=v_heads, head_size=head,
                       dtype=dtype)


def _before(call: ProbeCall) -> dict[str, Any]:
    state = call.args.get("initial_state")
    return {"initial_state": None if state is None else state.detach().clone()}


def _common_notes(group: int) -> list[str]:
    return [PAD_NOTE,
            f"q/k: the engine repeated each q/k head {group} times to the value heads before "
            "the call; one of each kept (num_qk_heads heads)",
            "beta: bf16 as the engine passed it, widened to float32 without loss",
            "scale: head_size ** -0.5, applied inside the engine's function"]


def _group(call: ProbeCall) -> int:
    assert call.definition is not None
    consts = call.definition.const_axes
    return consts["num_v_heads"] // consts["num_qk_heads"]


def _pads_are_inert(call: ProbeCall, b: int, columns: list[int], state: Any) -> bool:
    """Pad tokens before a row's real ones leave its state unchanged: the state is zero and
    the pads' keys and values are zero (so each pad only decays a zero state)."""
    pads = sorted(set(range(call.args["key"].shape[1])) - set(columns))
    if not pads:
        return True
    if pads[-1] > columns[0] or (state is not None and bool(state[b].any())):
        return False
    return not (call.args["key"][b, pads].any() or call.args["value"][b, pads].any())


def _adapt_prefill(call: ProbeCall) -> Extracted | None:
    group = _group(call)
    a = call.args
    state = call.before.get("initial_state")
    requests = batch_requests(call)
    if not all(_pads_are_inert(call, r.batch_row, r.columns, state) for r in requests):
        return None
    pick = [(r.batch_row, r.columns) for r in requests]
    output, final = call.result

    def rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[b, cols] for b, cols in pick])

    lengths = [len(cols) for _, cols in pick]
    cu = torch.zeros(len(pick) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
    batch_rows = [b for b, _ in pick]
    v_heads, head = a["value"].shape[2], a["query"].shape[-1]
    initial = (torch.zeros(len(pick), v_heads, head, head, dtype=torch.float32)
               if state is None else state[batch_rows].float())
    notes = _common_notes(group) + [
        "sequences: one per request (its batch row's real tokens), packed by cu_seqlens",
        "initial_state: zeros (a fresh prefill: the engine passes none)" if state is None
        else "initial_state: the engine's cached state, snapshotted before the call",
        "final_state: the state the call returned for the request's batch row (float32)"]
    inputs = {"q": rows(a["query"])[:, ::group], "k": rows(a["key"])[:, ::group],
              "v": rows(a["value"]), "g": rows(a["g"]).float(), "beta": rows(a["beta"]).float(),
              "initial_state": initial, "cu_seqlens": cu,
              "scale": float(head) ** -0.5}
    return Extracted(inputs, {"output": rows(output), "final_state": final[batch_rows].float()},
                     notes)


def _adapt_decode(call: ProbeCall) -> Extracted | None:
    group = _group(call)
    a = call.args
    state = call.before.get("initial_state")
    requests = batch_requests(call)
    if state is None or a["query"].shape[1] != 1 or any(len(r.columns) != 1 for r in requests):
        return None
    rows = [r.batch_row for r in requests]
    output, final = call.result
    notes = _common_notes(group) + [
        "state: the engine's cached state of the request's batch row, snapshotted before "
        "the call; new_state: the state the call returned (float32)"]
    inputs = {"q": a["query"][rows, 0, ::group], "k": a["key"][rows, 0, ::group],
              "v": a["value"][rows, 0], "g": a["g"][rows, 0].float(),
              "beta": a["beta"][rows, 0].float(), "state": state[rows].float(),
              "scale": float(a["query"].shape[-1]) ** -0.5}
    return Extracted(inputs, {"output": output[rows, 0], "new_state": final[rows].float()},
                     notes)


GDN_PROBES: list[Probe] = [
    Probe("hf.gdn.prefill", "gdn_prefill", _define, _adapt_prefill,
          target=f"{_MODULE}:torch_chunk_gated_delta_rule", when="prefill",
          inside="GatedDeltaNet", before=_before,
          description="Qwen3-Next torch_chunk_gated_delta_rule (prefill)"),
    Probe("hf.gdn.decode", "gdn_decode", _define, _adapt_decode,
          target=f"{_MODULE}:torch_recurrent_gated_delta_rule", when="decode",
          inside="GatedDeltaNet", before=_before,
          description="Qwen3-Next torch_recurrent_gated_delta_rule (one cached token)"),
]
