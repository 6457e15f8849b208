"""The sharded decoder layer of vLLM's dense models (``LlamaDecoderLayer``,
``Qwen3DecoderLayer``): the stock ``forward`` with the residual stream split by rows.

Stock, per layer: norm (with the residual add) on every row -> attention -> all-reduce of
``o_proj`` -> norm on every row -> MLP -> all-reduce of ``down_proj``. Sharded: the norms
and residual adds run on this rank's rows; before attention and before the MLP the normed
rows are all-gathered, so both run on every row exactly as stock; ``o_proj`` and
``down_proj`` reduce through the plan (:meth:`Plan.reduce`) instead of all-reducing, which
hands back this rank's rows. The last layer of the loop gathers its outputs, so the
model's final norm sees every row as stock.

Layer 0 has no residual yet: stock takes the embeddings as the residual; here, this
rank's rows of them. The body mirrors the pinned stock ``forward`` line for line (the
lock refuses a vLLM whose ``forward`` changed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from enginetap.patches.sp_prefill.plan import Plan, current_plan

__all__ = ["LAYER_TARGETS", "finish_rows", "layer_wrapper", "sharded_layer"]

LAYER_TARGETS = (
    "vllm.model_executor.models.llama:LlamaDecoderLayer.forward",
    "vllm.model_executor.models.qwen3:Qwen3DecoderLayer.forward",
)
"""Decoder-layer ``forward`` methods :func:`layer_wrapper` is installed on."""


def layer_wrapper(wrapped: Any, layer: Any, args: tuple, kwargs: dict) -> Any:
    """Stock unless a sharded plan is active (``comm`` keeps the stock layer)."""
    plan = current_plan()
    if plan is None or not plan.sharded:
        return wrapped(*args, **kwargs)
    positions, hidden_states, residual = _layer_arguments(args, kwargs)
    return sharded_layer(layer, plan, positions, hidden_states, residual)


def _layer_arguments(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    names = ("positions", "hidden_states", "residual")
    values = dict(zip(names, args))
    values.update(kwargs)
    return values["positions"], values["hidden_states"], values["residual"]


def sharded_layer(layer: Any, plan: Plan, positions: torch.Tensor,
                  hidden_states: torch.Tensor, residual: torch.Tensor | None,
                  attend: Callable[[torch.Tensor], torch.Tensor] | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer on this rank's rows; returns (sublayer output, residual) shards,
    or every row after the last layer. ``attend(rows)`` calls the layer's attention where
    its signature is not ``self_attn(positions=, hidden_states=)``."""
    last = plan.enter_layer()
    if residual is None:
        residual = plan.own_rows(hidden_states)
        hidden_states = layer.input_layernorm(residual)
    else:
        hidden_states, residual = layer.input_layernorm(hidden_states, residual)
    plan.site = "attn"
    gathered = plan.gather(hidden_states)
    if attend is None:
        hidden_states = layer.self_attn(positions=positions, hidden_states=gathered)
    else:
        hidden_states = attend(gathered)

    hidden_states, residual = layer.post_attention_layernorm(hidden_states, residual)
    plan.site = "mlp"
    hidden_states = layer.mlp(plan.gather(hidden_states))
    if last:
        return finish_rows(plan, hidden_states, residual)
    return hidden_states, residual


def finish_rows(plan: Plan, hidden_states: torch.Tensor,
                residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """After the last layer: every rank's rows of the output and the residual."""
    plan.site = "exit"
    return plan.gather(hidden_states), plan.gather(residual)
