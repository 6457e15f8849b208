"""Seed-only family ``moe_grouped_gemm_fp8_fp4``: the expert GEMM of FP4-weight MoE layers.

DeepSeek-style FP4 experts run one grouped GEMM over the rows routed to each expert: FP8
activations with float32 block scales times packed e2m1 weights with E8M0 group-32 scales.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from enginetap.dataset.schema import Definition
from enginetap.definitions.base import Template, Tensor, const, var

if TYPE_CHECKING:
    import torch

__all__ = ["MOE_GROUPED_GEMM_FP8_FP4", "seed_layout_to_indptr"]

FAMILY = "moe_grouped_gemm_fp8_fp4"


def seed_layout_to_indptr(a: torch.Tensor, a_scale_e8m0: torch.Tensor, expert_ids: torch.Tensor,
                          num_experts: int) -> dict[str, torch.Tensor]:
    """Inputs of this family from the seed's layout of the same GEMM.

    The seed gives each row of ``a`` (FP8 e4m3fn, ``[m, k]``) its expert in ``expert_ids``
    (``[m]``) and scales activations per 32 columns by E8M0 bytes ``a_scale_e8m0``
    (``[m, k // 32]``, int8 or uint8 holding the raw byte). Returns ``a``, ``a_scale``
    (float32 ``2 ** (byte - 127)``, so ``k_blocks = k // 32``), ``m_indptr`` and ``order``:
    the rows stably sorted by expert, so output row ``i`` of this family is seed row
    ``order[i]``. Nothing is rounded: the adapter is exact.

    Raises:
        ValueError: an expert id is outside ``[0, num_experts)`` or the shapes disagree.
    """
    import torch

    ids = expert_ids.long()
    if ids.dim() != 1 or ids.shape[0] != a.shape[0] or a_scale_e8m0.shape != (
            a.shape[0], a.shape[1] // 32) or bool(((ids < 0) | (ids >= num_experts)).any()):
        raise ValueError("need a [m, k], a_scale_e8m0 [m, k // 32] and expert_ids [m] "
                         f"with ids in [0, {num_experts})")
    order = torch.sort(ids, stable=True).indices
    exponent = (a_scale_e8m0.to(torch.int32) & 0xFF).to(torch.float32)
    scale = torch.where(exponent == 255, float("nan"), torch.exp2(exponent - 127.0))
    counts = torch.bincount(ids, minlength=num_experts)
    m_indptr = torch.zeros(num_experts + 1, dtype=torch.int32, device=a.device)
    m_indptr[1:] = counts.cumsum(0)
    return {"a": a[order], "a_scale": scale[order], "m_indptr": m_indptr, "order": order}


def _expert_rows(total_m: int, experts: int, gen: torch.Generator, device: str) -> list[int]:
    """Rows per expert: random, with one expert (when there are several) given none."""
    import torch

    weights = torch.rand(experts, generator=gen, device=device) + 0.1
    if experts > 1:
        weights[int(torch.randint(0, experts, (1,), generator=gen, device=device))] = 0.0
    picks = torch.multinomial(weights, total_m, replacement=True, generator=gen)
    return torch.bincount(picks, minlength=experts).tolist()


def _generate(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
              device: str) -> dict[str, Any]:
    import torch

    from enginetap.definitions.seeded_quant import (
        e8m0_bytes, fp4_bytes, normal, quantize_fp8, require, spread)

    c = definition.const_axes
    experts, total_m = c["num_experts"], axes["total_m"]
    require(FAMILY, axes, axes["len_indptr"] == experts + 1, "len_indptr == num_experts + 1")
    rows = _expert_rows(total_m, experts, gen, device)
    m_indptr = torch.tensor([0, *rows], device=device).cumsum(0).to(torch.int32)
    x = normal((total_m, c["k"]), gen, device) * spread((total_m, 1), gen, device)
    a, a_scale = quantize_fp8(x, c["k_blocks"], gen)
    return {
        "a": a, "a_scale": a_scale,
        "w": fp4_bytes((experts, c["n"], c["k_packed"]), gen, device),
        "w_scale": e8m0_bytes((experts, c["n"], c["k_groups"]), gen, device),
        "m_indptr": m_indptr,
    }


def _axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    """Row counts vary; len_indptr follows num_experts, whatever it is set to."""
    return {"total_m": (24, 1, 50, 7)[index % 4], "len_indptr": consts["num_experts"] + 1}


MOE_GROUPED_GEMM_FP8_FP4 = Template(
    family=FAMILY,
    op_type="grouped_gemm",
    name="moe_grouped_gemm_fp8_fp4_e{num_experts}_n{n}_k{k}_kb{k_blocks}",
    description=(
        "Grouped GEMM of MoE experts: rows m_indptr[e]:m_indptr[e+1] of the FP8 e4m3fn "
        "activations a (one float32 scale per row and per block of k/k_blocks columns) "
        "multiply expert e's FP4 e2m1 weights w[e] (n x k), output bf16 [total_m, n]. Each "
        "int8 byte of w packs two e2m1 codes, element 2i in the low nibble and 2i+1 in the "
        "high nibble; each run of 32 weight elements along k is scaled by 2**(b-127), b the "
        "unsigned E8M0 byte held in w_scale (255 is NaN). m_indptr[0] == 0 and "
        "m_indptr[-1] == total_m: every row belongs to exactly one expert (a layout leaving "
        "rows uncovered is refused). The seed's layout (per-row expert ids, group-32 E8M0 "
        "activation scales) maps onto this one exactly with seed_layout_to_indptr (this "
        "module): rows stably sorted by expert id, k_blocks = k // 32, a_scale = "
        "2**(byte - 127); the output rows come back in that sorted order."),
    axes={
        "total_m": var("rows of all experts together (tokens x routed experts)"),
        "len_indptr": var("num_experts + 1"),
        "num_experts": const("experts on this rank"),
        "n": const("output features"),
        "k": const("input features"),
        "k_blocks": const("activation scales per row: 1 per row, k // 128 for 1x128 blocks"),
        "k_packed": const("k // 2: bytes per packed FP4 weight row"),
        "k_groups": const("k // 32: E8M0 scales per weight row"),
    },
    inputs={
        "a": Tensor(("total_m", "k"), "float8_e4m3fn", "activations, grouped by expert"),
        "a_scale": Tensor(("total_m", "k_blocks"), "float32", "activation block scales"),
        "w": Tensor(("num_experts", "n", "k_packed"), "int8", "packed e2m1 weight pairs"),
        "w_scale": Tensor(("num_experts", "n", "k_groups"), "int8", "E8M0 bytes, group 32"),
        "m_indptr": Tensor(("len_indptr",), "int32", "first row of each expert, then total_m"),
    },
    outputs={"output": Tensor(("total_m", "n"), "bfloat16")},
    reference="seed_moe_grouped_gemm_fp8_fp4.py",
    generate=_generate,
    constraints=("len_indptr == num_experts + 1", "k % k_blocks == 0", "k_packed * 2 == k",
                 "k_groups * 32 == k"),
    tags=("seed-only", "quant:fp8_e4m3", "quant:fp4_e2m1"),
    example={"num_experts": 4, "n": 48, "k": 256, "k_blocks": 2, "k_packed": 128,
             "k_groups": 8},
    example_axes={"total_m": 24, "len_indptr": 5},
    workload_axes=_axes,
)
