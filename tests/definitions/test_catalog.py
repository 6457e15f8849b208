"""Definitions instantiated from the built-in models' configs."""

from __future__ import annotations

import json

import pytest

from enginetap.definitions import known_template
from enginetap.definitions.catalog import definitions_for_config, definitions_for_model
from enginetap.errors import DefinitionError
from enginetap.models import model_config

EXPECTED = {
    "llama": {"rmsnorm_h128_bfloat16_round_twice", "fused_add_rmsnorm_h128_bfloat16_round_twice",
              "gqa_ragged_prefill_causal_h4_kv2_d32_bfloat16",
              "gqa_paged_decode_h4_kv2_d32_ps16_bfloat16"},
    "qwen3_next": {"rmsnorm_offset_h128_bfloat16", "gqa_ragged_prefill_causal_h4_kv2_d64_bfloat16",
                   "gdn_prefill_qk2_v4_d64_bfloat16", "gdn_decode_qk2_v4_d64_bfloat16",
                   "moe_topk_softmax_e8_topk2_norm1_bfloat16_round_each_op",
                   "moe_experts_swiglu_e8_h128_i64_topk2_round_act"},
    "deepseek_v3": {"mla_paged_decode_h4_ckv512_kpe64_ps16_bfloat16",
                    "moe_topk_grouped_sigmoid_e8_topk2_ng4_kg2_norm1_rs1_float32"},
    "deepseek_v32": {"dsa_indexer_topk_h4_d128_topk16",
                     "dsa_sparse_attention_h4_ckv512_kpe64_topk16_ps16"},
}


@pytest.mark.parametrize("model", sorted(EXPECTED))
def test_model_configs_map_to_their_operators(model):
    definitions = definitions_for_config(model_config(model))
    names = {d.name for d in definitions}
    assert EXPECTED[model] <= names
    assert len(names) == len(definitions)
    assert all(known_template(d) is not None for d in definitions)


def test_full_attention_only_where_the_model_has_it():
    llama = {d.op_type for d in definitions_for_config(model_config("llama"))}
    deepseek = {d.op_type for d in definitions_for_config(model_config("deepseek_v3"))}
    assert "gqa_paged" in llama and "gdn" not in llama and "moe" not in llama
    assert "gqa_paged" not in deepseek and "mla_paged" in deepseek


def test_router_scaling_follows_the_engine_convention():
    config = model_config("deepseek_v3")
    vllm = {d.name for d in definitions_for_config(config, engine="vllm")}
    hf = {d.name for d in definitions_for_config(config, engine="transformers")}
    assert "moe_topk_grouped_sigmoid_e8_topk2_ng4_kg2_norm1_rs1_float32" in vllm
    assert "moe_topk_grouped_sigmoid_e8_topk2_ng4_kg2_norm1_rs2.5_float32" in hf


def test_missing_fields_and_unreadable_configs_are_explained(tmp_path):
    config = dict(model_config("llama"))
    del config["num_attention_heads"]
    with pytest.raises(DefinitionError, match="num_attention_heads"):
        definitions_for_config(config)
    with pytest.raises(DefinitionError, match="config.json"):
        definitions_for_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(model_config("qwen3_moe")))
    assert any(d.op_type == "moe_router" for d in definitions_for_model(tmp_path, page_size=32))
