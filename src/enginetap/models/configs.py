"""The built-in tiny model configurations (random weights, real architectures).

Each config is the ``config.json`` content minus the fields every model shares
(:data:`COMMON`). Sizes are the smallest that both transformers and vLLM CPU accept:
vLLM CPU wants attention head sizes in a fixed set (32, 64, ...), MLA needs
``kv_lora_rank`` 512 with a rope head of 64, and the gated delta net a head dim of 64.
"""

from __future__ import annotations

from typing import Any

__all__ = ["COMMON", "CONFIGS", "MODEL_NAMES", "model_config"]

COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "use_cache": True,
    "dtype": "bfloat16",
}

_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}

_QWEN3: dict[str, Any] = {
    **_LLAMA,
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 32,
}

_QWEN3_MOE: dict[str, Any] = {
    **_QWEN3,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 64,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
}

_QWEN3_NEXT: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention",
                    "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "mlp_only_layers": [],
}

_DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 0,
    # vLLM reads these two to pick grouped sigmoid routing with the correction bias.
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
}

_GLM4_MOE: dict[str, Any] = {
    "architectures": ["Glm4MoeForCausalLM"],
    "model_type": "glm4_moe",
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "norm_topk_prob": True,
    "use_qk_norm": True,
    "num_nextn_predict_layers": 0,
}

_DEEPSEEK_V32: dict[str, Any] = {
    **_DEEPSEEK_V3,
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 16,
    "index_head_dim": 128,
    "index_n_heads": 4,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA,
    "qwen3": _QWEN3,
    "qwen3_moe": _QWEN3_MOE,
    "qwen3_next": _QWEN3_NEXT,
    "deepseek_v3": _DEEPSEEK_V3,
    "glm4_moe": _GLM4_MOE,
    "deepseek_v32": _DEEPSEEK_V32,
}

MODEL_NAMES: tuple[str, ...] = tuple(CONFIGS)
"""Built-in model names, in a stable order."""


def model_config(name: str) -> dict[str, Any]:
    """The full ``config.json`` content of built-in model ``name`` (a fresh dict).

    Raises:
        KeyError: ``name`` is not a built-in model (callers turn it into a boundary error).
    """
    return {**COMMON, **CONFIGS[name]}
