"""Gated delta net families (Qwen3-Next linear attention): ``gdn_prefill`` and ``gdn_decode``.

Both take what the engines' kernels take, with the same conventions: q and k un-normalised
(the kernel L2-normalises them, eps 1e-6 as in transformers; the eps=1e-5 vLLM CPU's chunk
kernel takes differs far less than bf16 rounding for unit-scale vectors), ``num_qk_heads`` q/k
heads each shared by ``num_v_heads // num_qk_heads`` consecutive value heads, log-decay ``g``
and write strength ``beta`` per token and value head, and a float32 state laid out
``[..., num_v_heads, K, V]`` (vLLM CPU views its pool this way; transformers uses it too).

Gating: the engines derive ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``.
Both are float32 here: engines that hold ``beta`` in bf16 widen it without loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from enginetap.definitions.attention import indptr, random_input, split_lengths
from enginetap.definitions.base import CompareRule, Template, Tensor, const, dtype_param, var
from enginetap.errors import DefinitionError

if TYPE_CHECKING:
    import torch

    from enginetap.dataset.schema import Definition

__all__ = ["GDN_DECODE", "GDN_PREFILL"]


def _random_gating(shape: tuple[int, ...], gen: torch.Generator,
                  device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Realistic float32 ``(g, beta)``: g in about (-1.6, -0.02), beta in (0, 1)."""
    import torch

    g = -torch.exp(torch.rand(shape, generator=gen, device=device) * 4.5 - 4.0)
    beta = torch.sigmoid(torch.randn(shape, generator=gen, device=device) * 1.5)
    return g, beta


def _state(shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    import torch

    return torch.randn(shape, generator=gen, device=device) * 0.1


def _qkv(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
         device: str) -> dict[str, torch.Tensor]:
    return {n: random_input(definition, n, axes, gen, device) for n in ("q", "k", "v")}


def _generate_prefill(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                      device: str) -> dict[str, Any]:
    consts = definition.const_axes
    seqs, tokens = axes["num_seqs"], axes["total_seq_len"]
    if axes["len_cu_seqlens"] != seqs + 1:
        raise DefinitionError(
            "inconsistent var axes", f"len_cu_seqlens={axes['len_cu_seqlens']}, num_seqs={seqs}",
            "set len_cu_seqlens = num_seqs + 1")
    lengths = split_lengths(tokens, seqs, gen, device)
    g, beta = _random_gating((tokens, consts["num_v_heads"]), gen, device)
    state_shape = (seqs, consts["num_v_heads"], consts["head_size"], consts["head_size"])
    return {**_qkv(definition, axes, gen, device), "g": g, "beta": beta,
            "initial_state": _state(state_shape, gen, device),
            "cu_seqlens": indptr(lengths, device), "scale": consts["head_size"] ** -0.5}


def _generate_decode(definition: Definition, axes: Mapping[str, int], gen: torch.Generator,
                     device: str) -> dict[str, Any]:
    consts = definition.const_axes
    batch, heads, size = axes["batch_size"], consts["num_v_heads"], consts["head_size"]
    g, beta = _random_gating((batch, heads), gen, device)
    return {**_qkv(definition, axes, gen, device), "g": g, "beta": beta,
            "state": _state((batch, heads, size, size), gen, device), "scale": size ** -0.5}


def _prefill_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    """Several sequences, one token, a sequence across a 64-token chunk, many short ones."""
    tokens, seqs = ((90, 3), (1, 1), (130, 2), (5, 5))[index % 4]
    return {"total_seq_len": tokens, "len_cu_seqlens": seqs + 1, "num_seqs": seqs}


def _decode_axes(consts: Mapping[str, int], index: int) -> dict[str, int]:
    return {"batch_size": (3, 1, 8, 2)[index % 4]}


_HEADS = {"num_qk_heads": const("query/key heads (per rank)"),
          "num_v_heads": const("value heads (per rank), a multiple of num_qk_heads"),
          "head_size": const("key and value head size")}
_GATING = {"g": "log-decay per token and value head (<= 0): -exp(A_log) * softplus(a + dt_bias)",
           "beta": "write strength in (0, 1): sigmoid(b)"}
_CONSTRAINTS = ("num_v_heads % num_qk_heads == 0",)
# The state is float32, but vLLM's CPU kernels build each update from bf16-rounded q/k/v and
# beta: one decode step already moves state elements by ~3e-3 against float32 math (measured
# in tests/definitions/test_gdn.py), so the float32 default (1e-5) would fail every capture.
_STATE_RULE = CompareRule("float", atol=1e-2, rtol=1e-2)

GDN_PREFILL = Template(
    family="gdn_prefill",
    op_type="gdn",
    name="gdn_prefill_qk{num_qk_heads}_v{num_v_heads}_d{head_size}_{dtype}",
    description=(
        "Gated delta rule over packed sequences (cu_seqlens), each from its own initial state: "
        "per value head, S = exp(g) S; S += k (beta (v - k^T S))^T; o = scale q^T S with q, k "
        "L2-normalised as x * rsqrt(sum(x^2) + 1e-6) (transformers' eps; vLLM CPU's chunk "
        "kernel takes 1e-5, far below bf16 rounding for unit-scale rows). Rounding: all in "
        "float32 (the state stays float32), the output rounded once to dtype. Reference: "
        "chunked form, 64 tokens a chunk. vLLM CPU "
        "(model_executor/layers/mamba/ops/cpu/gdn_attention.py): ops.chunk_gated_delta_rule_cpu("
        "query, key, value, g, beta, initial_state, output_final_state, cu_seqlens, head_first, "
        "use_qk_l2norm_in_kernel, initial_state_indices): query/key/value[0] -> q/k/v, g[0] -> g, "
        "beta[0] -> beta, initial_state[initial_state_indices] (read before the call; the pool "
        "is updated in place) -> initial_state and, after it, -> final_state, its first result "
        "[0] -> output, cu_seqlens -> cu_seqlens, scale = head_size ** -0.5 (fixed inside the "
        "kernel). transformers: "
        "torch_chunk_gated_delta_rule(query, key, value, g, beta, initial_state=...) per batch "
        "row; its q/k are already repeated to num_v_heads, so take every group-th head."),
    axes={"total_seq_len": var("tokens of all sequences"),
          "len_cu_seqlens": var("sequences + 1"), "num_seqs": var("sequences"), **_HEADS},
    inputs={"q": Tensor(("total_seq_len", "num_qk_heads", "head_size"), "{dtype}"),
            "k": Tensor(("total_seq_len", "num_qk_heads", "head_size"), "{dtype}"),
            "v": Tensor(("total_seq_len", "num_v_heads", "head_size"), "{dtype}"),
            "g": Tensor(("total_seq_len", "num_v_heads"), "float32", _GATING["g"]),
            "beta": Tensor(("total_seq_len", "num_v_heads"), "float32", _GATING["beta"]),
            "initial_state": Tensor(("num_seqs", "num_v_heads", "head_size", "head_size"),
                                    "float32", "per-sequence state [K, V] (zeros: fresh)"),
            "cu_seqlens": Tensor(("len_cu_seqlens",), "int32", "token offsets per sequence"),
            "scale": Tensor(None, "float32", "query scale, head_size ** -0.5 in Qwen3-Next")},
    outputs={"output": Tensor(("total_seq_len", "num_v_heads", "head_size"), "{dtype}"),
             "final_state": Tensor(("num_seqs", "num_v_heads", "head_size", "head_size"),
                                   "float32", "state after each sequence's last token")},
    reference="gdn_prefill.py",
    generate=_generate_prefill,
    compare={"final_state": _STATE_RULE},
    **dtype_param(),
    constraints=("len_cu_seqlens == num_seqs + 1", *_CONSTRAINTS),
    engines=("transformers", "vllm"),
    example={"num_qk_heads": 2, "num_v_heads": 4, "head_size": 64},
    example_axes={"total_seq_len": 90, "len_cu_seqlens": 4, "num_seqs": 3},
    workload_axes=_prefill_axes,
)

GDN_DECODE = Template(
    family="gdn_decode",
    op_type="gdn",
    name="gdn_decode_qk{num_qk_heads}_v{num_v_heads}_d{head_size}_{dtype}",
    description=(
        "One gated-delta-rule step per sequence: per value head, S' = exp(g) S + k (beta (v - "
        "k^T exp(g) S))^T, output = scale q^T S' with q, k L2-normalised as x * rsqrt(sum(x^2) "
        "+ 1e-6). Rounding: all in float32 (new_state stays float32), the output rounded "
        "once to dtype. vLLM CPU: "
        "ops.fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, "
        "initial_state_source, initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel): "
        "q/k/v[0] -> q/k/v, g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b) in "
        "float32 (the kernel gates internally), initial_state_source[initial_state_indices] "
        "before the call -> state and after it -> new_state, its result[:, 0] -> output, "
        "scale = head_size ** -0.5. "
        "transformers: torch_recurrent_gated_delta_rule(query, key, value, g, beta, "
        "initial_state) with sequence length 1 (q/k repeated to num_v_heads: take every "
        "group-th head)."),
    axes={"batch_size": var("sequences, one token each"), **_HEADS},
    inputs={"q": Tensor(("batch_size", "num_qk_heads", "head_size"), "{dtype}"),
            "k": Tensor(("batch_size", "num_qk_heads", "head_size"), "{dtype}"),
            "v": Tensor(("batch_size", "num_v_heads", "head_size"), "{dtype}"),
            "g": Tensor(("batch_size", "num_v_heads"), "float32", _GATING["g"]),
            "beta": Tensor(("batch_size", "num_v_heads"), "float32", _GATING["beta"]),
            "state": Tensor(("batch_size", "num_v_heads", "head_size", "head_size"), "float32",
                            "per-sequence state [K, V] before this token"),
            "scale": Tensor(None, "float32", "query scale, head_size ** -0.5 in Qwen3-Next")},
    outputs={"output": Tensor(("batch_size", "num_v_heads", "head_size"), "{dtype}"),
             "new_state": Tensor(("batch_size", "num_v_heads", "head_size", "head_size"),
                                 "float32", "state after this token")},
    reference="gdn_decode.py",
    generate=_generate_decode,
    compare={"new_state": _STATE_RULE},
    **dtype_param(),
    constraints=_CONSTRAINTS,
    engines=("transformers", "vllm"),
    example={"num_qk_heads": 2, "num_v_heads": 4, "head_size": 64},
    example_axes={"batch_size": 3},
    workload_axes=_decode_axes,
)
