"""The operator families enginetap offers, as one explicit list.

Adding a family means writing its module and naming its template here; nothing registers
itself on import, so importing a family module has no effect beyond defining it.
"""

from __future__ import annotations

from enginetap.definitions import (
    attention,
    dsa,
    gdn,
    mla,
    moe,
    norms,
    router_v4,
    seeded_mla,
    seeded_moe,
    seeded_sparse,
)
from enginetap.definitions.base import Template

__all__ = ["FAMILIES", "SEED_ONLY"]

SEED_ONLY: tuple[Template, ...] = (
    seeded_moe.MOE_GROUPED_GEMM_FP8_FP4,
    seeded_mla.MLA_DECODE_FP8_FP4_SINK,
    seeded_mla.SPARSE_MLA_PREFILL_SINK,
    seeded_sparse.COMPRESSED_SPARSE_TOPK,
    seeded_sparse.SPARSE_GQA_PAGED_DECODE,
)
"""Families of operators users capture from SGLang (DeepSeek, Qwen) that no engine here runs:
enginetap offers their definitions, references and synthetic workloads without a capture
adapter (``engines=()``). Their quantized formats: FP8 is e4m3fn with float32 scales; FP4 is
e2m1 packed two codes per int8 byte, element ``2i`` in the low nibble and ``2i + 1`` in the
high nibble, scaled per 32 elements by an E8M0 byte ``b`` (held in int8, read unsigned)
meaning ``2 ** (b - 127)``."""

FAMILIES: tuple[Template, ...] = (
    norms.RMSNORM,
    norms.FUSED_ADD_RMSNORM,
    attention.GQA_RAGGED_PREFILL,
    attention.GQA_PAGED_DECODE,
    mla.MLA_PAGED_DECODE,
    dsa.INDEXER_TOPK,
    dsa.SPARSE_MLA,
    gdn.GDN_PREFILL,
    gdn.GDN_DECODE,
    moe.TOPK_SOFTMAX,
    moe.TOPK_GROUPED_SIGMOID,
    router_v4.TOPK_SQRTSOFTPLUS,
    router_v4.TOPK_SQRTSOFTPLUS_HASH,
    moe.EXPERTS_SWIGLU,
    *SEED_ONLY,
)
"""Every family, in the order `enginetap definitions list` documents them."""
