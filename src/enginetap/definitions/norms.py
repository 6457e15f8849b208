"""Normalisation families: ``rmsnorm``, ``fused_add_rmsnorm`` and their Gemma-style
(scale by ``1 + w``) forms ``rmsnorm_offset``, ``fused_add_rmsnorm_offset``.

Where an RMSNorm rounds to the activation dtype is part of its semantics, so it is a
parameter and part of the name (``rounding``):

* ``twice``: the normalised row is rounded, then multiplied by the weight and rounded again.
  transformers' ``LlamaRMSNorm`` (``weight * x.to(input_dtype)``) and vLLM 0.32 on CPU, whose
  ``RMSNorm.forward`` runs ``vllm.ir.ops.rms_norm`` / ``fused_add_rms_norm`` with the CPU
  platform's default op priority ``["native"]`` (the ``vllm_c`` kernels are registered for
  GPU-like devices only).
* ``once``: float32 throughout, one rounding at the end: vLLM's C kernels
  ``_C.rms_norm`` / ``_C.fused_add_rms_norm`` (what GPUs run; vLLM CPU builds carry them too)
  and FlashInfer's rmsnorm definitions. The fused kernel takes the variance of the float32
  sum but normalises the *rounded* residual it writes back.

The two differ by one unit in the last place (ulp) on about a quarter of bf16 elements.
Both take the variance in float32 from the float32 inputs (for the fused form, of the float32
sum, never of the rounded residual).

Engine spread, measured against vLLM 0.32's three CPU builds (``tests/definitions/
test_norms.py`` loads each one the CPU can run; a build computes the same bits on any CPU
that runs it, so this machine reproduces the others' numerics): the build for AVX512-BF16/AMX
CPUs rounds float32 to bf16 to nearest even, like torch and this reference, and matches it to
1 ulp (a different summation order of the variance flips a rounding on rare elements). The
AVX-512F build without BF16 and the AVX2 build (older Xeons, AMD EPYC before Zen 4) convert
by *truncation*: ``residual_out`` is up to 1 ulp smaller in magnitude, and ``output``, which
normalises that residual and truncates again, is off by up to 3 ulps (2 of 896 elements by
0.03125 at |x| ~ 2 on such a machine). Bound, relative to the value: each truncation errs by
less than ``2**-7`` (a bf16 ulp is at most that fraction of the value) and the reference's own
rounding by at most ``2**-8``, so engines stay below ``2.5 * 2**-7`` (measured: 1.97 * 2**-7).
The compare rule is therefore ``|actual - expected| <= 3 * 2**-7 * |expected|``: the engines'
own spread, where bf16's default ``1e-2 + 1e-2 * |x|`` (0.03 at |x| = 2) refuses them. For
float16/float32 instances the same bound is looser than their own rounding, never tighter.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from enginetap.definitions.base import (
    FLOAT_DTYPES, CompareRule, Template, Tensor, const, dtype_param, var,
)

if TYPE_CHECKING:
    import torch

    from enginetap.dataset.schema import Definition

__all__ = ["FUSED_ADD_RMSNORM", "FUSED_ADD_RMSNORM_OFFSET", "RMSNORM", "RMSNORM_OFFSET"]

_EPS = 1e-6
_ROUNDING = ("twice", "once")
# The engines' spread, relative (see the module docstring); zeros stay zeros in every engine.
_SPREAD = CompareRule(atol=2.0 ** -24, rtol=3 * 2.0 ** -7)


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


def _axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    """Token counts of decode (1), small and odd batches, so workloads differ in shape."""
    return {"batch_size": (5, 1, 17, 3)[index % 4]}


_AXES = {"batch_size": var("rows (tokens) normalised in this call"),
         "hidden_size": const("model hidden size")}
_ROW = Tensor(("batch_size", "hidden_size"), "{dtype}")
_WEIGHT = Tensor(("hidden_size",), "{dtype}")
_OFFSET_WEIGHT = Tensor(("hidden_size",), "{dtype}", "the stored weight w; scale 1 + w")
_VARIANCE_EPS = Tensor(None, "float32", "variance epsilon")
_FUSED_OUTPUTS = {"output": Tensor(("batch_size", "hidden_size"), "{dtype}", "normalised sum"),
                  "residual_out": Tensor(("batch_size", "hidden_size"), "{dtype}",
                                         "hidden_states + residual, the next layer's residual")}
# What every norm family shares: rows of hidden_size, the same example and workloads.
_ROWS_FAMILY: dict[str, Any] = {"axes": _AXES, "example": {"hidden_size": 128},
                                "example_axes": {"batch_size": 5}, "workload_axes": _axes}
_DTYPE_AND_ROUNDING = {"params": {"dtype": "bfloat16", "rounding": "twice"},
            "choices": {"dtype": FLOAT_DTYPES, "rounding": _ROUNDING}}
_INPUT_MAP = ("vLLM: RMSNorm.forward (model_executor/layers/layernorm.py) with x -> "
              "hidden_states, self.weight -> weight, self.variance_epsilon -> eps")
_ROUNDING_DOC = (
    " Rounding (the name's last part): 'twice' rounds the normalised row r = x * "
    "rsqrt(mean(x^2) + eps) (float32) to dtype, then rounds r * weight again (transformers "
    "LlamaRMSNorm, vLLM 0.32 CPU's RMSNorm); 'once' rounds only x * rsqrt(...) * weight "
    "(vLLM's C kernel rms_norm, FlashInfer). Engines of the same rounding agree within a "
    "relative 3 * 2^-7 (bf16: vLLM CPU builds for CPUs without AVX512-BF16 truncate instead "
    "of rounding to nearest), which is the compare rule.")

RMSNORM = Template(
    family="rmsnorm",
    op_type="rmsnorm",
    name="rmsnorm_h{hidden_size}_{dtype}_round_{rounding}",
    description=(
        "Root-mean-square norm of each row: x / sqrt(mean(x^2) + eps) * weight, the mean "
        "taken in float32. " + _INPUT_MAP + ". transformers: LlamaRMSNorm.forward("
        "hidden_states) (also Qwen3/DeepSeek-V3 norms) with self.weight, "
        "self.variance_epsilon. Gemma-style norms (scale by 1 + w, multiplied in float32 and "
        "rounded once) are not this family: weight = 1 + w rounded to dtype loses what their "
        "float32 1 + w keeps." + _ROUNDING_DOC),
    inputs={"hidden_states": _ROW, "weight": _WEIGHT, "eps": _VARIANCE_EPS},
    outputs={"output": _ROW},
    reference="rmsnorm.py",
    generate=_generate_rmsnorm,
    compare={"output": _SPREAD},
    engines=("transformers", "vllm"),
    **_DTYPE_AND_ROUNDING,
    **_ROWS_FAMILY,
)

RMSNORM_OFFSET = Template(
    family="rmsnorm_offset",
    op_type="rmsnorm",
    name="rmsnorm_offset_h{hidden_size}_{dtype}",
    description=(
        "Gemma-style RMSNorm, scaling by (1 + weight): output = round(x * rsqrt(mean(x^2) + "
        "eps) * (1 + weight)), everything in float32 and one rounding to dtype at the end; "
        "weight is the stored parameter (zero-initialised), 1 + weight is formed in float32. "
        "transformers: Qwen3NextRMSNorm.forward(x) (and GemmaRMSNorm) with self.weight, "
        "self.eps. vLLM: GemmaRMSNorm.forward(x) without a residual (Qwen3-Next's "
        "Qwen3NextRMSNorm), which passes the float32 1 + w to vllm.ir rms_norm as its "
        "weight. Engines agree within a relative 3 * 2^-7 (the rmsnorm family's spread)."),
    inputs={"hidden_states": _ROW, "weight": _OFFSET_WEIGHT, "eps": _VARIANCE_EPS},
    outputs={"output": _ROW},
    reference="rmsnorm_offset.py",
    generate=_generate_rmsnorm,
    compare={"output": _SPREAD},
    engines=("transformers", "vllm"),
    **dtype_param(),
    **_ROWS_FAMILY,
)

FUSED_ADD_RMSNORM = Template(
    family="fused_add_rmsnorm",
    op_type="rmsnorm",
    name="fused_add_rmsnorm_h{hidden_size}_{dtype}_round_{rounding}",
    description=(
        "Residual add then RMSNorm: s = hidden_states + residual in float32; residual_out = "
        "s rounded to dtype; the variance is mean(s^2) of the float32 s. Rounding 'twice' "
        "(vLLM 0.32 CPU's RMSNorm.forward(x, residual), i.e. vllm.ir fused_add_rms_norm "
        "native): output = round(round(s * rsqrt(var + eps)) * weight), normalising the "
        "float32 s. Rounding 'once' (vLLM's C kernel fused_add_rms_norm, GPUs): output = "
        "round(residual_out * rsqrt(var + eps) * weight), normalising the rounded residual. "
        + _INPUT_MAP + ", residual -> residual; it returns (output, residual_out) in this "
        "order (the C kernel writes them into x and residual in place). transformers has no "
        "fused form (its decoder layers add in dtype, then call the plain norm), so only vLLM "
        "runs this family. Engines of the same rounding agree within a relative 3 * 2^-7 (vLLM "
        "CPU builds for CPUs without AVX512-BF16 truncate: residual_out 1 ulp, output up to 3 "
        "ulps), which is the compare rule."),
    inputs={"hidden_states": _ROW, "residual": _ROW, "weight": _WEIGHT, "eps": _VARIANCE_EPS},
    outputs=_FUSED_OUTPUTS,
    reference="fused_add_rmsnorm.py",
    generate=_generate_fused_add,
    compare={"output": _SPREAD, "residual_out": _SPREAD},
    engines=("vllm",),
    **_DTYPE_AND_ROUNDING,
    **_ROWS_FAMILY,
)

FUSED_ADD_RMSNORM_OFFSET = Template(
    family="fused_add_rmsnorm_offset",
    op_type="rmsnorm",
    name="fused_add_rmsnorm_offset_h{hidden_size}_{dtype}",
    description=(
        "Residual add then Gemma-style RMSNorm: s = hidden_states + residual in float32; "
        "residual_out = s rounded to dtype; output = round(s * rsqrt(mean(s^2) + eps) * "
        "(1 + weight)), the float32 s normalised, 1 + weight formed in float32, one rounding. "
        "weight is the stored parameter w. vLLM: GemmaRMSNorm.forward(x, residual) "
        "(Qwen3-Next's Qwen3NextRMSNorm in every decoder layer after the first), which "
        "passes the float32 1 + w to vllm.ir fused_add_rms_norm as its weight; x -> "
        "hidden_states, residual -> residual; returns (output, residual_out). transformers "
        "adds in dtype and calls the plain norm, so only vLLM runs this family. Engines "
        "agree within a relative 3 * 2^-7 (the rmsnorm families' spread)."),
    inputs={"hidden_states": _ROW, "residual": _ROW, "weight": _OFFSET_WEIGHT,
            "eps": _VARIANCE_EPS},
    outputs=_FUSED_OUTPUTS,
    reference="fused_add_rmsnorm_offset.py",
    generate=_generate_fused_add,
    compare={"output": _SPREAD, "residual_out": _SPREAD},
    engines=("vllm",),
    **dtype_param(),
    **_ROWS_FAMILY,
)
