"""The operator families enginetap offers, as one explicit list.

Adding a family means writing its module and naming its template here; nothing registers
itself on import, so importing a family module has no effect beyond defining it.
"""

from __future__ import annotations

from enginetap.definitions.attention import GQA_PAGED_DECODE, GQA_RAGGED_PREFILL
from enginetap.definitions.dsa import INDEXER_TOPK, SPARSE_MLA
from enginetap.definitions.gdn import GDN_DECODE, GDN_PREFILL
from enginetap.definitions.mla import MLA_PAGED_DECODE, MLA_PAGED_PREFILL
from enginetap.definitions.moe import EXPERTS_SWIGLU, TOPK_GROUPED_SIGMOID, TOPK_SOFTMAX
from enginetap.definitions.norms import (
    FUSED_ADD_RMSNORM,
    FUSED_ADD_RMSNORM_OFFSET,
    RMSNORM,
    RMSNORM_OFFSET,
)
from enginetap.definitions.router_v4 import TOPK_SQRTSOFTPLUS, TOPK_SQRTSOFTPLUS_HASH
from enginetap.definitions.seeded_mla import MLA_DECODE_FP8_FP4_SINK, SPARSE_MLA_PREFILL_SINK
from enginetap.definitions.seeded_moe import MOE_GROUPED_GEMM_FP8_FP4
from enginetap.definitions.seeded_sparse import COMPRESSED_SPARSE_TOPK, SPARSE_GQA_PAGED_DECODE
from enginetap.definitions.base import Template

__all__ = ["FAMILIES", "SEED_ONLY"]

SEED_ONLY: tuple[Template, ...] = (
    MOE_GROUPED_GEMM_FP8_FP4,
    MLA_DECODE_FP8_FP4_SINK,
    SPARSE_MLA_PREFILL_SINK,
    COMPRESSED_SPARSE_TOPK,
    SPARSE_GQA_PAGED_DECODE,
)
"""Families of operators users capture from SGLang (DeepSeek, Qwen) that no engine here runs:
enginetap offers their definitions, references and synthetic workloads without a capture
adapter (``engines=()``). Their quantized formats: FP8 is e4m3fn with float32 scales; FP4 is
e2m1 packed two codes per int8 byte, element ``2i`` in the low nibble and ``2i + 1`` in the
high nibble, scaled per 32 elements by an E8M0 byte ``b`` (held in int8, read unsigned)
meaning ``2 ** (b - 127)``."""

FAMILIES: tuple[Template, ...] = (
    RMSNORM,
    RMSNORM_OFFSET,
    FUSED_ADD_RMSNORM,
    FUSED_ADD_RMSNORM_OFFSET,
    GQA_RAGGED_PREFILL,
    GQA_PAGED_DECODE,
    MLA_PAGED_DECODE,
    MLA_PAGED_PREFILL,
    INDEXER_TOPK,
    SPARSE_MLA,
    GDN_PREFILL,
    GDN_DECODE,
    TOPK_SOFTMAX,
    TOPK_GROUPED_SIGMOID,
    TOPK_SQRTSOFTPLUS,
    TOPK_SQRTSOFTPLUS_HASH,
    EXPERTS_SWIGLU,
    *SEED_ONLY,
)
"""Every family, in the order `enginetap definitions list` documents them."""
