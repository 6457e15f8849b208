"""Capture probes of the built-in transformers engine: one table, small adapters per family.

The built-in engine runs a padded batch (``[batch, columns, ...]``, left-padded); every
adapter keeps only the step's real token rows (``rows.token_index``) and says so in its
notes. Classes are matched by name suffix in the loaded model, so one entry covers Llama,
Qwen3, Qwen3-Next, GLM-4-MoE and DeepSeek alike where their code agrees.

Families and hook points (transformers 5.x):

- ``rmsnorm``: every ``*RMSNorm.forward``;
- ``gqa_ragged_prefill`` / ``gqa_paged_decode``: the SDPA kernel inside ``*Attention``;
- ``moe_topk_softmax`` / ``moe_topk_grouped_sigmoid``: ``*TopKRouter`` / ``*TopkRouter``;
- ``moe_experts_swiglu``: ``*Experts.forward``;
- ``gdn_prefill`` / ``gdn_decode``: Qwen3-Next's chunked / recurrent gated delta rule;
- ``mla_paged_decode``: ``DeepseekV3Attention.forward`` on decode steps (see
  :mod:`enginetap.engines.hf.probes.mla` for what is and is not the engine's own output);
- ``dsa_indexer_topk`` / ``dsa_sparse_mla``: DeepSeek-V3.2's indexer and sparse attention
  (:mod:`enginetap.engines.hf.probes.dsa`).
"""

from __future__ import annotations

from enginetap.capture.probe import Probe
from enginetap.engines.hf.probes.attention import ATTENTION_PROBES
from enginetap.engines.hf.probes.common import token_rows
from enginetap.engines.hf.probes.dsa import DSA_PROBES
from enginetap.engines.hf.probes.gdn import GDN_PROBES
from enginetap.engines.hf.probes.mla import MLA_PROBES
from enginetap.engines.hf.probes.moe import MOE_PROBES
from enginetap.engines.hf.probes.norms import NORM_PROBES

__all__ = ["PROBES", "token_rows"]

PROBES: list[Probe] = [*NORM_PROBES, *ATTENTION_PROBES, *MOE_PROBES, *GDN_PROBES, *MLA_PROBES,
                     *DSA_PROBES]
