"""Normalisation families: ``rmsnorm`` and ``fused_add_rmsnorm``.

Both reduce in float32 and round once to the activation dtype. vLLM and transformers round the
normalised row to the activation dtype before multiplying by the weight; that second rounding
stays within the default bf16/fp16 tolerances replay uses.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from enginetap.definitions.base import Template, Tensor, const, register, var

if TYPE_CHECKING:
    import torch

    from enginetap.dataset.schema import Definition

__all__ = ["FUSED_ADD_RMSNORM", "RMSNORM"]

_EPS = 1e-6


def _rows(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
          device: str, name: str) -> torch.Tensor:
    """Activations of input ``name``: N(0, 1) with a per-row scale so rows differ in RMS."""
    import torch

    rows, width = axes["batch_size"], definition.const_axes["hidden_size"]
    scale = torch.rand((rows, 1), generator=gen, device=device) * 3.0 + 0.25
    x = torch.randn((rows, width), generator=gen, device=device) * scale
    return x.to(getattr(torch, definition.inputs[name].dtype))


def _weight(definition: Definition, gen: torch.Generator, device: str) -> torch.Tensor:
    """A trained-looking gain: around 1, never 0."""
    import torch

    spec = definition.inputs["weight"]
    w = 1.0 + 0.2 * torch.randn(definition.const_axes["hidden_size"], generator=gen, device=device)
    return w.to(getattr(torch, spec.dtype))


def _generate_rmsnorm(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                      device: str) -> dict[str, Any]:
    return {"hidden_states": _rows(definition, axes, gen, device, "hidden_states"),
            "weight": _weight(definition, gen, device), "eps": _EPS}


def _generate_fused_add(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                        device: str) -> dict[str, Any]:
    return {"hidden_states": _rows(definition, axes, gen, device, "hidden_states"),
            "residual": _rows(definition, axes, gen, device, "residual"),
            "weight": _weight(definition, gen, device), "eps": _EPS}


_AXES = {"batch_size": var("rows (tokens) normalised in this call"),
         "hidden_size": const("model hidden size")}

RMSNORM = register(Template(
    family="rmsnorm",
    op_type="rmsnorm",
    name="rmsnorm_h{hidden_size}",
    description=(
        "Root-mean-square norm of each row: x / sqrt(mean(x^2) + eps) * weight. "
        "vLLM: RMSNorm.forward(x) (model_executor/layers/layernorm.py) with x -> hidden_states, "
        "self.weight -> weight, self.variance_epsilon -> eps. transformers: "
        "LlamaRMSNorm.forward(hidden_states) (also Qwen3/DeepSeek-V3 norms) with self.weight, "
        "self.variance_epsilon. Gemma-style norms that scale by (1 + w) map with weight = 1 + w."),
    axes=_AXES,
    inputs={"hidden_states": Tensor(("batch_size", "hidden_size"), "{dtype}"),
            "weight": Tensor(("hidden_size",), "{dtype}"),
            "eps": Tensor(None, "float32", "variance epsilon")},
    outputs={"output": Tensor(("batch_size", "hidden_size"), "{dtype}")},
    reference="rmsnorm.py",
    generate=_generate_rmsnorm,
    params={"dtype": "bfloat16"},
    engines=("transformers", "vllm"),
    example={"hidden_size": 128},
    example_axes={"batch_size": 5},
))

FUSED_ADD_RMSNORM = register(Template(
    family="fused_add_rmsnorm",
    op_type="rmsnorm",
    name="fused_add_rmsnorm_h{hidden_size}",
    description=(
        "Residual add then RMSNorm: s = hidden_states + residual; output = "
        "s / sqrt(mean(s^2) + eps) * weight; residual_out = s. vLLM: RMSNorm.forward(x, residual) "
        "with x -> hidden_states, residual -> residual; it returns (output, residual_out) in this "
        "order (the C kernel fused_add_rms_norm writes them into x and residual in place). "
        "transformers has no fused form (its decoder layers add, then call the plain norm), "
        "so only vLLM runs this family."),
    axes=_AXES,
    inputs={"hidden_states": Tensor(("batch_size", "hidden_size"), "{dtype}"),
            "residual": Tensor(("batch_size", "hidden_size"), "{dtype}"),
            "weight": Tensor(("hidden_size",), "{dtype}"),
            "eps": Tensor(None, "float32", "variance epsilon")},
    outputs={"output": Tensor(("batch_size", "hidden_size"), "{dtype}", "normalised sum"),
             "residual_out": Tensor(("batch_size", "hidden_size"), "{dtype}",
                                    "hidden_states + residual, the next layer's residual")},
    reference="fused_add_rmsnorm.py",
    generate=_generate_fused_add,
    params={"dtype": "bfloat16"},
    engines=("vllm",),
    example={"hidden_size": 128},
    example_axes={"batch_size": 5},
))
