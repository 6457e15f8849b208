"""The CPU-path gaps of SGLang 0.5.23 without its kernel package, closed by patches.

Installed by the ``sglang.srt.plugins`` entry point (:mod:`enginetap.engines.sglang.plugin`)
in every SGLang process that runs on the CPU with enginetap's ``sgl_kernel`` stand-in,
armed or not (they make the engine run; they change no result SGLang computes where it
runs without them). Each names the place in SGLang that needs it:

- ``srt/layers/rotary_embedding/factory.py`` ``get_rope_cpu`` accepts only DeepSeek's yarn
  scaling (it asserts ``rope_scaling is not None``): plain RoPE goes to ``get_rope``, the
  same function every other device uses (its ``forward_cpu`` runs torch-native code
  without the AMX kernels);
- ``srt/models/deepseek_v2.py`` ``_is_layer_sparse`` reads ``config.moe_layer_freq``,
  which transformers 5's ``DeepseekV3Config`` no longer has: filled with DeepSeek's
  default, 1;
- ``srt/configs/qwen3_next.py`` ``Qwen3NextConfig`` places full-attention layers by
  ``full_attention_interval``, which transformers 5 no longer writes (it writes
  ``layer_types``): derived from ``layer_types`` where they are periodic;
- ``FusedRMSNormGated.forward`` (``kernels/ops/attention/fla/fused_norm_gate.py``, Qwen3-Next's
  gated norm) runs a Triton kernel where the CPU has no AMX, and Triton has no CPU driver:
  it goes to SGLang's own torch reference of the same norm, ``rms_norm_ref``
  (``kernels/ops/attention/fla/layernorm_gated.py``; silu gate after the norm);
- ``srt/models/deepseek_common/attention_backend_handler.py`` has no handler for the
  ``torch_native`` backend and falls back to Triton's, which sends prefill to MLA's MHA
  form; the torch-native backend then reads keys and values back from the latent cache
  and fails ("Expected size ... [4, 96] but got ... [4, 576]"). ``torch_native`` gets the
  absorbed MLA form (SGLang's own ``_dispatch_mla_subtype``), for prefill and decode;
- ``srt/models/qwen2_moe.py`` adds the gated shared expert with
  ``fused_gate_sigmoid_mul_add`` (a Triton kernel) unless the gate runs on AMX: the same
  sum in torch, ``final += sigmoid(hidden @ gate) * shared`` (what its unfused path does).

Nothing here touches SGLang's attention, MLA, MoE or norms' arithmetic.
"""

from __future__ import annotations

import logging
from typing import Any

from enginetap.core.patching import PatchSet, bind_arguments

logger = logging.getLogger("enginetap.sglang")

__all__ = ["FIXES", "cpu_fixes", "full_attention_interval"]

ROPE_CPU = "sglang.srt.layers.rotary_embedding.factory:get_rope_cpu"
ROPE_ANY = "sglang.srt.layers.rotary_embedding.factory:get_rope"
DEEPSEEK_SPARSE = "sglang.srt.models.deepseek_v2:DeepseekV2DecoderLayer._is_layer_sparse"
QWEN3_NEXT_CONFIG = "sglang.srt.configs.qwen3_next:Qwen3NextConfig.__init__"
GATED_NORM = "sglang.kernels.ops.attention.fla.fused_norm_gate:FusedRMSNormGated.forward"

SHARED_GATE = "sglang.srt.models.qwen2_moe:fused_gate_sigmoid_mul_add"
MLA_HANDLER = ("sglang.srt.models.deepseek_common.attention_backend_handler:"
               "AttentionBackendRegistry.get_handler")

FIXES = (ROPE_CPU, DEEPSEEK_SPARSE, QWEN3_NEXT_CONFIG, GATED_NORM, SHARED_GATE,
         MLA_HANDLER)
"""Every target the CPU fixes patch (the guard drift lock of the SGLang path covers them)."""


def _rope_cpu(wrapped: Any, _: Any, args: tuple, kwargs: dict) -> Any:
    call = bind_arguments(wrapped, args, kwargs)
    if call.get("rope_scaling") is not None:
        return wrapped(*args, **kwargs)
    from sglang.srt.layers.rotary_embedding import factory

    return factory.get_rope(call["head_size"], call["rotary_dim"], call["max_position"],
                            call["base"], call["is_neox_style"], None, call["dtype"],
                            call["partial_rotary_factor"])


def _deepseek_sparse(wrapped: Any, _: Any, args: tuple, kwargs: dict) -> Any:
    config = bind_arguments(wrapped, args, kwargs)["config"]
    if not hasattr(config, "moe_layer_freq"):
        config.moe_layer_freq = 1
    return wrapped(*args, **kwargs)


def full_attention_interval(layer_types: list[str]) -> int | None:
    """The period ``n`` with layer ``i`` full attention iff ``(i + 1) % n == 0``, or None
    where ``layer_types`` follow no such period."""
    full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
    if not full:
        return None
    n = full[0] + 1
    expected = [i for i in range(len(layer_types)) if (i + 1) % n == 0]
    return n if full == expected else None


def _qwen3_next_config(wrapped: Any, config: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    layer_types = kwargs.get("layer_types")
    if getattr(config, "full_attention_interval", None) is None and layer_types:
        interval = full_attention_interval(list(layer_types))
        if interval is None:
            raise ValueError("Qwen3-Next config: layer_types are not periodic (SGLang 0.5.23 "
                             "places full attention every full_attention_interval layers); "
                             "set full_attention_interval in config.json")
        config.full_attention_interval = interval
    return result


def _gated_norm_cpu(wrapped: Any, norm: Any, args: tuple, kwargs: dict) -> Any:
    from sglang.kernels.ops.attention.fla import fused_norm_gate
    from sglang.kernels.ops.attention.fla.layernorm_gated import rms_norm_ref

    call = bind_arguments(wrapped, args, kwargs)
    if getattr(fused_norm_gate, "_use_cpu", False) or call.get("residual") is not None \
            or call.get("prenorm") or norm.activation not in ("swish", "silu"):
        return wrapped(*args, **kwargs)  # SGLang's AMX kernel, or a form without reference
    return rms_norm_ref(call["x"], norm.weight, norm.bias, z=call["g"], eps=norm.eps,
                        group_size=None, norm_before_gate=True)


def _shared_gate(wrapped: Any, _: Any, args: tuple, kwargs: dict) -> None:
    import torch

    call = bind_arguments(wrapped, args, kwargs)
    hidden, weight = call["hidden_states"], call["gate_weight"]
    gate = torch.sigmoid(torch.nn.functional.linear(hidden, weight.reshape(1, -1)))
    call["final_hidden_states"].add_(gate * call["shared_output"])


def _mla_handler(wrapped: Any, registry: Any, args: tuple, kwargs: dict) -> Any:
    name = bind_arguments(wrapped, args, kwargs)["backend_name"]
    if name == "torch_native" and name not in getattr(registry, "_handlers", {}):
        from sglang.srt.models.deepseek_common import attention_backend_handler

        return attention_backend_handler._dispatch_mla_subtype
    return wrapped(*args, **kwargs)


def cpu_fixes() -> PatchSet:
    """The patches (installed now, or when each SGLang module is imported)."""
    fixes = PatchSet("sglang-cpu-fixes")
    fixes.add(ROPE_CPU, _rope_cpu)
    fixes.add(DEEPSEEK_SPARSE, _deepseek_sparse)
    fixes.add(QWEN3_NEXT_CONFIG, _qwen3_next_config)
    fixes.add(GATED_NORM, _gated_norm_cpu)
    fixes.add(SHARED_GATE, _shared_gate)
    fixes.add(MLA_HANDLER, _mla_handler)
    return fixes
