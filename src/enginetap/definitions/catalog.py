"""Which definitions a model runs: families instantiated from a Hugging Face config.

``instances_for_config(config)`` reads the model's own dimensions (heads, head sizes,
experts, latent ranks, linear-attention heads) and returns what its layers need, each as an
:class:`Instance`: the family's template, the constants it was bound with, and the
definition (named as FlashInfer names them, ``gqa_paged_decode_h4_kv2_d32_ps16``, ...).
``definitions_for_config`` returns just the definitions.

Engines disagree on where some constants act: vLLM builds DeepSeek's router with a
routed scaling factor of 1 and scales the combined expert output instead, while
transformers scales inside the router. ``engine`` selects which convention the router
definitions follow, so captured tensors map onto them unchanged.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from enginetap.dataset.schema import Definition
from enginetap.definitions.base import Template
from enginetap.definitions.registry import get_template
from enginetap.errors import DefinitionError

__all__ = ["Instance", "definitions_for_config", "definitions_for_model", "instances_for_config",
           "instances_for_model"]

Engine = Literal["transformers", "vllm"]


@dataclass(frozen=True)
class Instance:
    """One family bound to a model: ``template.instantiate(**values) == definition``."""

    template: Template
    values: Mapping[str, Any]
    """The const axes and params the definition was instantiated with."""
    definition: Definition


def instances_for_model(model_dir: str | Path, *, engine: Engine = "vllm",
                        page_size: int = 16) -> list[Instance]:
    """:func:`definitions_for_model` with each definition's template and constants."""
    return instances_for_config(_read_config(Path(model_dir)), engine=engine,
                                page_size=page_size)


def instances_for_config(config: Mapping[str, Any], *, engine: Engine = "vllm",
                         page_size: int = 16) -> list[Instance]:
    """:func:`definitions_for_config` with each definition's template and constants.

    Raises:
        DefinitionError: a field the model's layers need is missing from the config.
    """
    out = []
    for family, values in _wanted(_Config(config), engine, page_size):
        template = get_template(family)
        out.append(Instance(template, dict(values), template.instantiate(**values)))
    return out


def definitions_for_model(model_dir: str | Path, *, engine: Engine = "vllm",
                          page_size: int = 16) -> list[Definition]:
    """Definitions for the model whose ``config.json`` is in ``model_dir``.

    Raises:
        DefinitionError: no readable config.json, or the config lacks a needed field.
    """
    return definitions_for_config(_read_config(Path(model_dir)), engine=engine,
                                  page_size=page_size)


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DefinitionError(f"cannot read {path}", str(exc),
                              "point at a model directory holding a valid config.json") from None
    if not isinstance(config, dict):
        raise DefinitionError(f"cannot read {path}", "it holds no JSON object",
                              "point at a model directory holding a valid config.json")
    return config


def definitions_for_config(config: Mapping[str, Any], *, engine: Engine = "vllm",
                           page_size: int = 16) -> list[Definition]:
    """Definitions for a config dict (see the module docstring).

    Raises:
        DefinitionError: a field the model's layers need is missing from the config.
    """
    return [i.definition for i in instances_for_config(config, engine=engine,
                                                        page_size=page_size)]


_OFFSET_NORMS = {"qwen3_next"}
"""Model types whose RMSNorms scale by 1 + weight (Gemma-style)."""


def _wanted(cfg: _Config, engine: Engine, page_size: int) -> list[tuple[str, dict[str, Any]]]:
    dtype = _dtype(cfg)
    hidden = {"hidden_size": cfg.get("hidden_size")}
    if cfg.model_type in _OFFSET_NORMS or cfg.model_type.startswith("gemma"):
        wanted = [("rmsnorm_offset", hidden)]  # scale by 1 + w (no fused family of it)
    else:
        wanted = [("rmsnorm", hidden), ("fused_add_rmsnorm", hidden)]
    wanted += _attention(cfg, page_size)
    wanted += _linear_attention(cfg)
    # Families whose activation dtype is a parameter take the model's own.
    return [(family, {**values, "dtype": dtype} if "dtype" in get_template(family).params
             else values) for family, values in wanted] + _moe(cfg, engine)


def _dtype(cfg: _Config) -> str:
    """The activation dtype the model runs in (its config's torch_dtype/dtype, else bf16)."""
    raw = cfg.raw.get("dtype") or cfg.raw.get("torch_dtype") or "bfloat16"
    return raw if raw in ("bfloat16", "float16", "float32") else "bfloat16"


class _Config:
    def __init__(self, config: Mapping[str, Any]) -> None:
        self.raw = config
        self.model_type = str(config.get("model_type", "?"))

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key, default)
        if value is None:
            raise DefinitionError(f"config of {self.model_type!r} lacks {key!r}",
                                  "the model's layers need it to size their operators",
                                  "use the model's complete config.json")
        return value

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None


def _attention(cfg: _Config, page_size: int) -> list[tuple[str, dict[str, Any]]]:
    heads = cfg.get("num_attention_heads")
    if cfg.has("kv_lora_rank"):
        mla = {"num_qo_heads": heads, "head_dim_ckv": cfg.get("kv_lora_rank"),
               "head_dim_kpe": cfg.get("qk_rope_head_dim")}
        out = [("mla_paged_decode", {**mla, "page_size": page_size})]
        if cfg.has("index_topk"):
            out += [("dsa_indexer_topk", {"index_n_heads": cfg.get("index_n_heads"),
                                          "index_head_dim": cfg.get("index_head_dim"),
                                          "index_topk": cfg.get("index_topk")}),
                    ("dsa_sparse_mla", {**mla, "topk": cfg.get("index_topk"),
                                        "page_size": page_size})]
        return out
    layer_types = cfg.raw.get("layer_types") or ["full_attention"]
    if "full_attention" not in layer_types:
        return []
    gqa = {"num_qo_heads": heads, "num_kv_heads": cfg.get("num_key_value_heads", heads),
           "head_dim": cfg.get("head_dim", cfg.get("hidden_size") // heads)}
    return [("gqa_ragged_prefill", gqa), ("gqa_paged_decode", {**gqa, "page_size": page_size})]


def _linear_attention(cfg: _Config) -> list[tuple[str, dict[str, Any]]]:
    if "linear_attention" not in (cfg.raw.get("layer_types") or []):
        return []
    key_dim, value_dim = cfg.get("linear_key_head_dim"), cfg.get("linear_value_head_dim")
    if key_dim != value_dim:
        raise DefinitionError(
            f"{cfg.model_type}: linear key head dim {key_dim} != value head dim {value_dim}",
            "the gated-delta-rule families describe square per-head states",
            "capture this model's linear attention with a family that has separate K/V dims")
    gdn = {"num_qk_heads": cfg.get("linear_num_key_heads"),
           "num_v_heads": cfg.get("linear_num_value_heads"), "head_size": key_dim}
    return [("gdn_prefill", gdn), ("gdn_decode", gdn)]


def _moe(cfg: _Config, engine: Engine) -> list[tuple[str, dict[str, Any]]]:
    experts = cfg.raw.get("num_experts") or cfg.raw.get("n_routed_experts")
    if not experts:
        return []
    top_k = cfg.get("num_experts_per_tok")
    renormalize = bool(cfg.raw.get("norm_topk_prob", True))
    inter = cfg.get("moe_intermediate_size")
    experts_values = {"num_experts": experts, "hidden_size": cfg.get("hidden_size"),
                      "intermediate_size": inter, "gemm1_out_size": 2 * inter, "top_k": top_k,
                      "rounding": "act"}
    grouped = cfg.has("n_group") or cfg.raw.get("scoring_func") == "sigmoid"
    if engine == "transformers":
        # Its default (grouped_mm) experts weight in the routing weights' dtype: float32
        # from the sigmoid router, the model's dtype from the softmax one.
        experts_values["rounding"] = "each_op_f32_weighting" if grouped else "each_op"
    if grouped:
        scale = 1.0 if engine == "vllm" else float(cfg.raw.get("routed_scaling_factor", 1.0))
        router = ("moe_topk_grouped_sigmoid", {
            "num_experts": experts, "top_k": top_k, "n_group": cfg.raw.get("n_group") or 1,
            "topk_group": cfg.raw.get("topk_group") or 1, "renormalize": renormalize,
            "routed_scaling_factor": scale})
    else:
        router = ("moe_topk_softmax", {"num_experts": experts, "top_k": top_k,
                                       "renormalize": renormalize,
                                       "rounding": "output" if engine == "transformers"
                                       else "each_op"})
    return [router, ("moe_experts_swiglu", experts_values)]
