"""RMSNorm and fused add+RMSNorm: ``RMSNorm.forward(x, residual=None)``.

vLLM's norms are CustomOps that pick their implementation when built, so the probe wraps
the class's ``forward``. With a residual the fused kernel may update ``x`` and ``residual``
in place: both are snapshotted before the call. Norm weights are replicated under TP, so
rank 0's call is the logical one.

Gemma-style norms (``GemmaRMSNorm``, Qwen3-Next's ``Qwen3NextRMSNorm``) scale by ``1 + w``
formed in float32 and pass it to vLLM's ``rms_norm`` as a float32 weight, so the product
is float32 and rounded once: the ``rmsnorm_offset`` family, whose ``weight`` input is the
stored ``w``; called with a residual (every decoder layer after the first),
``fused_add_rmsnorm_offset``.
"""

from __future__ import annotations

from typing import Any


from enginetap.capture.probe import Extracted, Probe, ProbeCall
from enginetap.dataset.schema import Definition
from enginetap.engines.vllm.probes.common import DTYPES, instantiate, is_writer, other_rank

__all__ = ["GEMMA_NORM_PROBES", "GEMMA_NORM_TARGETS", "NORM_PROBES", "NORM_TARGETS"]

_LAYERNORM = "vllm.model_executor.layers.layernorm"
NORM_TARGETS = (f"{_LAYERNORM}:RMSNorm.forward", f"{_LAYERNORM}:RMSNorm.forward_native")
GEMMA_NORM_TARGETS = (f"{_LAYERNORM}:GemmaRMSNorm.forward",
                      f"{_LAYERNORM}:GemmaRMSNorm.forward_native")
"""``forward_native`` holds the float32 ``1 + w`` the family relies on (vllm.ir's
``rms_norm`` is an op object with no pinnable source; replay checks its numerics)."""


def _plain(module: Any) -> bool:
    """A norm the rmsnorm families describe: full-width variance, a real weight."""
    return (getattr(module, "variance_size_override", None) is None
            and getattr(module, "has_weight", True))


def _bind(call: ProbeCall) -> tuple[Any, Any]:
    """``(x, residual)``: CustomOp.forward takes ``*args, **kwargs``, so they are named
    here as ``forward_native(x, residual=None)`` names them."""
    args = call.args
    if "args" in args or "kwargs" in args:
        positional, named = list(args.get("args", ())), dict(args.get("kwargs", {}))
        x = positional[0] if positional else named.get("x")
        residual = positional[1] if len(positional) > 1 else named.get("residual")
        return x, residual
    return args.get("x"), args.get("residual")


def _define(call: ProbeCall, fused: bool, offset: bool = False) -> Definition | None:
    """The family of this call: plain or fused (a residual given), and for Gemma-style
    norms (``offset``) the ``_offset`` forms, whose weight must be in the activation dtype."""
    x, residual = _bind(call)
    weight = getattr(call.instance, "weight", None)
    if (residual is not None) != fused or x is None or weight is None or weight.dim() != 1:
        return None
    dtype = DTYPES.get(x.dtype)
    if dtype is None or x.shape[-1] != weight.shape[0]:
        return None
    described = DTYPES.get(weight.dtype) == dtype if offset else _plain(call.instance)
    if not described:
        return None
    family = ("fused_add_rmsnorm" if fused else "rmsnorm") + ("_offset" if offset else "")
    return instantiate(family, hidden_size=int(weight.shape[0]), dtype=dtype)


def _before(call: ProbeCall) -> dict[str, Any]:
    x, residual = _bind(call)
    saved = {"x": x.detach().clone()}
    if residual is not None:
        saved["residual"] = residual.detach().clone()
    return saved


def _adapt(call: ProbeCall) -> Extracted:
    if not is_writer(call):
        return other_rank()
    x = call.before["x"]
    width = x.shape[-1]
    weight, notes = call.instance.weight.detach().to(x.dtype), []
    eps = float(call.instance.variance_epsilon)
    inputs: dict[str, Any] = {"hidden_states": x.reshape(-1, width), "weight": weight,
                              "eps": eps}
    if x.dim() > 2:
        notes.append(f"per-head norm: {x.shape[-2]} heads per token flattened into rows")
    if "residual" in call.before:
        output, residual_out = call.result
        inputs["residual"] = call.before["residual"].reshape(-1, width)
        outputs = {"output": output.reshape(-1, width),
                   "residual_out": residual_out.reshape(-1, width)}
        notes.append("x and residual snapshotted before the call (the fused kernel may "
                     "update them in place)")
    else:
        outputs = {"output": call.result.reshape(-1, width)}
    return Extracted(inputs, outputs, notes)


NORM_PROBES = [
    Probe("vllm.rmsnorm", "rmsnorm", lambda c: _define(c, False), _adapt,
          target=NORM_TARGETS[0], before=_before, description="RMSNorm.forward(x)"),
    Probe("vllm.rmsnorm.fused_add", "fused_add_rmsnorm", lambda c: _define(c, True), _adapt,
          target=NORM_TARGETS[0], before=_before, description="RMSNorm.forward(x, residual)"),
]


def _adapt_offset(call: ProbeCall) -> Extracted:
    """As :func:`_adapt`, with the stored ``w`` as the weight (no cast: it is what the
    family takes, and the engine forms ``1 + w`` in float32 from it)."""
    extracted = _adapt(call)
    if "weight" in extracted.inputs:  # rank 0 (other ranks return no inputs)
        extracted.inputs["weight"] = call.instance.weight.detach()
        extracted.notes.append("weight: the stored w; the engine scales by float32 1 + w "
                               "(rounded once)")
    return extracted


GEMMA_NORM_PROBES = [
    Probe("vllm.gemma_rmsnorm", "rmsnorm_offset", lambda c: _define(c, False, offset=True),
          _adapt_offset, target=GEMMA_NORM_TARGETS[0], before=_before,
          description="GemmaRMSNorm.forward(x) (Qwen3-Next's norms)"),
    Probe("vllm.gemma_rmsnorm.fused_add", "fused_add_rmsnorm_offset",
          lambda c: _define(c, True, offset=True), _adapt_offset, target=GEMMA_NORM_TARGETS[0],
          before=_before, description="GemmaRMSNorm.forward(x, residual)"),
]
