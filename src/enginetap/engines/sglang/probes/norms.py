"""RMSNorm and residual-add RMSNorm at SGLang's ``RMSNorm`` / ``GemmaRMSNorm``
(``srt/layers/layernorm.py``).

Without AMX kernels SGLang's CPU path runs the norms' ``forward_native(x, residual=None,
post_residual_addition=None)``, which the probes wrap (on CUDA ``forward_cuda`` runs
instead: see docs/sglang.md). ``RMSNorm`` scales by its weight (``rmsnorm`` /
``fused_add_rmsnorm``); Qwen3-Next's ``GemmaRMSNorm`` by ``1 + w`` formed in float32
(``rmsnorm_offset`` / ``fused_add_rmsnorm_offset``, weight: the stored ``w``). Nothing is
updated in place by ``forward_native``: the outputs are its return values. TP=1 only.
"""

from __future__ import annotations

from typing import Any

from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.sglang.probes.common import DTYPES, instantiate, single_rank

__all__ = ["NORM_PROBES", "NORM_TARGETS"]

_LAYERNORM = "sglang.srt.layers.layernorm"
PLAIN = f"{_LAYERNORM}:RMSNorm.forward_native"
GEMMA = f"{_LAYERNORM}:GemmaRMSNorm.forward_native"
NORM_TARGETS = (PLAIN, GEMMA, f"{_LAYERNORM}:RMSNorm.forward_cpu",
                f"{_LAYERNORM}:GemmaRMSNorm.forward_cpu")


def _define(call: ProbeCall, fused: bool, offset: bool) -> Definition | None:
    norm, args = call.instance, call.args
    x, residual, weight = args.get("x"), args.get("residual"), getattr(call.instance,
                                                                       "weight", None)
    if (residual is not None) != fused or x is None or weight is None or weight.dim() != 1 \
            or args.get("post_residual_addition") is not None or call.step.world_size != 1:
        return None
    if not offset and (getattr(norm, "variance_size_override", None) is not None
                       or getattr(norm, "override_orig_dtype", None) is not None
                       or getattr(norm, "fp32_residual", False)
                       or getattr(norm, "cast_x_before_out_mul", False)):
        return None
    dtype = DTYPES.get(x.dtype)
    if dtype is None or x.shape[-1] != weight.shape[0]:
        return None
    family = ("fused_add_rmsnorm" if fused else "rmsnorm") + ("_offset" if offset else "")
    return instantiate(family, hidden_size=int(weight.shape[0]), dtype=dtype)


def _adapt(call: ProbeCall, offset: bool) -> Extracted:
    single_rank(call)
    x = call.args["x"]
    width = x.shape[-1]
    weight = call.instance.weight.detach()
    inputs: dict[str, Any] = {"hidden_states": x.reshape(-1, width),
                              "weight": weight if offset else weight.to(x.dtype),
                              "eps": float(call.instance.variance_epsilon)}
    notes = ["weight: the stored w; the engine scales by float32 1 + w"] if offset else []
    if call.args.get("residual") is not None:
        output, residual_out = call.result
        inputs["residual"] = call.args["residual"].reshape(-1, width)
        outputs = {"output": output.reshape(-1, width),
                   "residual_out": residual_out.reshape(-1, width)}
    else:
        outputs = {"output": call.result.reshape(-1, width)}
    return Extracted(inputs, outputs, notes)


NORM_PROBES = [
    Probe("sglang.rmsnorm", "rmsnorm", lambda c: _define(c, False, False),
          lambda c: _adapt(c, False), target=PLAIN, description="RMSNorm.forward_native(x)"),
    Probe("sglang.rmsnorm.fused_add", "fused_add_rmsnorm", lambda c: _define(c, True, False),
          lambda c: _adapt(c, False), target=PLAIN,
          description="RMSNorm.forward_native(x, residual)"),
    Probe("sglang.gemma_rmsnorm", "rmsnorm_offset", lambda c: _define(c, False, True),
          lambda c: _adapt(c, True), target=GEMMA,
          description="GemmaRMSNorm.forward_native(x) (Qwen3-Next's norms)"),
    Probe("sglang.gemma_rmsnorm.fused_add", "fused_add_rmsnorm_offset",
          lambda c: _define(c, True, True), lambda c: _adapt(c, True), target=GEMMA,
          description="GemmaRMSNorm.forward_native(x, residual)"),
]
