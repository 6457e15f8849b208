"""The sharded decoder layer of vLLM's DeepSeek-V2/V3 (MLA attention, MoE or dense MLP).

Three seams beyond the dense models' (:mod:`.dense`):

- ``DeepseekV2DecoderLayer.forward``: the same sharded body, with attention called as
  ``self_attn(positions, rows, llama_4_scaling)`` (``self_attn(positions, rows)`` for MHA).
  Its float16 rescaling and its own sequence-parallel MoE branch are refused by the route
  (float16 models, ``use_sequence_parallel_moe``), so the body mirrors the bf16/fp32 path;
- ``DeepseekV2Model.forward``'s loop all-gathers ``[hidden | residual]`` before any layer
  whose input has fewer rows than ``positions`` (vLLM's own row-split MoE path). Inside a
  sharded plan the residual is meant to stay split, so that gather (the module's
  ``tensor_model_parallel_all_gather``) hands back its input: the loop's slice and split
  then return the same shards;
- ``DeepseekV2MoE.forward`` reshapes the experts' output to the input's row count; inside
  a sharded plan the experts' final reduction (``moe_runner``'s
  ``tensor_model_parallel_all_reduce``, rerouted like ``RowParallelLinear``'s) returns this
  rank's rows, so the reshape keeps the rows it gets.
"""

from __future__ import annotations

from typing import Any

from enginetap.patches.sp_prefill.dense import sharded_layer
from enginetap.patches.sp_prefill.plan import current_plan

MODULE = "vllm.model_executor.models.deepseek_v2"
LAYER_TARGET = f"{MODULE}:DeepseekV2DecoderLayer.forward"
MOE_TARGET = f"{MODULE}:DeepseekV2MoE.forward"
LOOP_GATHER = f"{MODULE}:tensor_model_parallel_all_gather"

__all__ = ["LAYER_TARGET", "LOOP_GATHER", "MOE_TARGET", "layer_wrapper", "loop_gather",
           "moe_wrapper", "refusal"]


def refusal(model: Any) -> str:
    """Why this DeepSeek model runs stock ('' when the sharded body covers it)."""
    import torch

    layers = model.layers[model.start_layer:model.end_layer]
    if getattr(model, "is_v32", False):
        return "unsupported_layers"  # DeepSeek-V3.2's indexer is not covered
    if any(getattr(layer, "use_sequence_parallel_moe", False) for layer in layers):
        return "engine_sequence_parallel"
    if model.embed_tokens.weight.dtype == torch.float16:
        return "float16"
    return ""


def layer_wrapper(wrapped: Any, layer: Any, args: tuple, kwargs: dict) -> Any:
    plan = current_plan()
    if plan is None or not plan.sharded:
        return wrapped(*args, **kwargs)
    names = ("positions", "hidden_states", "residual", "llama_4_scaling")
    values = {"llama_4_scaling": None, **dict(zip(names, args)), **kwargs}
    positions, scaling = values["positions"], values["llama_4_scaling"]

    def attend(rows: Any) -> Any:
        if layer.use_mha:
            return layer.self_attn(positions, rows)
        return layer.self_attn(positions, rows, scaling)

    return sharded_layer(layer, plan, positions, values["hidden_states"], values["residual"],
                         attend)


def loop_gather(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    plan = current_plan()
    if plan is None or not plan.sharded:
        return wrapped(*args, **kwargs)
    return args[0] if args else kwargs["input_"]


def moe_wrapper(wrapped: Any, moe: Any, args: tuple, kwargs: dict) -> Any:
    plan = current_plan()
    if plan is None or not plan.sharded:
        return wrapped(*args, **kwargs)
    hidden_states = args[0] if args else kwargs["hidden_states"]
    width = hidden_states.shape[-1]
    rows = hidden_states.view(-1, width)
    out = moe.experts(hidden_states=rows, router_logits=rows)
    return out.view(-1, width)
