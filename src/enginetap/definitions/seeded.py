"""Seed-only operator families: operators users capture from SGLang (DeepSeek, Qwen) that
no engine here runs, so enginetap offers their definitions, references and synthetic
workloads without a capture adapter (``engines=()``).

* ``moe_grouped_gemm_fp8_fp4`` (:mod:`~enginetap.definitions.seeded_moe`): FP8 x FP4 MoE
  grouped GEMM.
* ``mla_decode_fp8_fp4_sink``, ``sparse_mla_prefill_sink``
  (:mod:`~enginetap.definitions.seeded_mla`): MLA over quantized or sparse latent caches,
  with an attention sink.
* ``compressed_sparse_topk``, ``sparse_gqa_paged_decode``
  (:mod:`~enginetap.definitions.seeded_sparse`): block indexer and block-sparse GQA decode.

Quantized formats shared by these families: FP8 is e4m3fn with float32 scales; FP4 is
e2m1 packed two codes per int8 byte, element ``2i`` in the low nibble (bits 0-3) and
``2i + 1`` in the high nibble, scaled per 32 elements by an E8M0 byte ``b`` (held in int8,
read unsigned) meaning ``2 ** (b - 127)``.
"""

from __future__ import annotations

from enginetap.definitions import seeded_mla, seeded_moe, seeded_sparse

__all__ = ["FAMILIES"]

FAMILIES = (seeded_moe.FAMILY, seeded_mla.DECODE, seeded_mla.PREFILL, seeded_sparse.TOPK,
            seeded_sparse.DECODE)
"""The families this module registers."""
