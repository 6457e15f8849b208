"""Built-in solutions' adapters against the definitions' references, on the CPU.

torch:sdpa and torch:flex run here as they are. fla's Triton kernels need a GPU (and fla is
not installed in CI: transformers' Qwen3-Next would pick its Triton kernels on the CPU), so
their adapters are checked with a token-by-token float32 recurrence standing in for the
kernel, behind the kernel's keyword signature and its documented contract (``[B, T, H, D]``,
GVA with value head ``h`` reading q/k head ``h // (HV // H)``, in-kernel L2 norm with eps
1e-6, ``cu_seqlens`` int64 with ``B = 1``, states ``[N, HV, K, V]`` float32, a float scale),
so that the conversions (batch dimension, head grouping, state layout, scale, dtypes) meet
the reference.
Tolerances are the families' own compare rules (bf16 outputs: 1e-2; GDN states: 1e-2).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from enginetap.definitions.base import compile_reference
from enginetap.definitions.registry import get_template
from enginetap.replay.builtin import BUILTINS, builtin_named
from enginetap.replay.builtin.fla import gdn_decode, gdn_prefill
from enginetap.replay.compare import compare_outputs
from enginetap.replay.solution import CallPlan

def _run_both(family: str, adapter: Any, index: int,
              values: dict[str, Any] | None = None) -> dict[str, Any]:
    """Reference and adapter on workload ``index`` of the family's example; comparisons."""
    template = get_template(family)
    definition = template.instantiate(**{**template.example, **(values or {})})
    axes = template.axes_for(definition.const_axes, index)
    inputs = template.synthetic_inputs(definition, axes, index)
    plan = CallPlan(definition)
    reference = compile_reference(definition.reference, definition.name)
    args, kwargs = plan.prepare(inputs, axes, "cpu")
    expected = plan.collect(reference(*args, **kwargs), args, kwargs)
    args, kwargs = plan.prepare(inputs, axes, "cpu")
    actual = plan.collect(adapter(definition)(*args, **kwargs), args, kwargs)
    return {name: compare_outputs(template.rule(name), expected[name], actual[name])
            for name in definition.outputs}


@pytest.mark.parametrize("solution", ["torch:sdpa", "torch:flex"])
@pytest.mark.parametrize("index", range(4))
def test_torch_attention_matches_references(solution: str, index: int) -> None:
    builtin = builtin_named(solution)
    assert builtin is not None
    for family in builtin.adapters:
        for name, comparison in _run_both(family, builtin.adapter, index).items():
            assert comparison.passed, (solution, family, index, name, comparison.reason)


def _l2(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)


def naive_fla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, g: torch.Tensor,
              beta: torch.Tensor, scale: float, initial_state: torch.Tensor,
              output_final_state: bool, use_qk_l2norm_in_kernel: bool,
              cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's kernel contract (keywords after v) as a plain recurrence, one sequence at a time."""
    assert output_final_state and use_qk_l2norm_in_kernel and isinstance(scale, float)
    assert initial_state.dtype == torch.float32 and initial_state.is_contiguous()
    group = v.shape[2] // q.shape[2]
    if use_qk_l2norm_in_kernel:
        q, k = _l2(q.float()), _l2(k.float())
    q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
    if cu_seqlens is None:  # equal lengths: one sequence per batch row
        bounds = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    else:
        assert cu_seqlens.dtype == torch.long and q.shape[0] == 1
        edges = cu_seqlens.tolist()
        bounds = [(0, edges[s], edges[s + 1]) for s in range(len(edges) - 1)]
    out = torch.empty(v.shape, dtype=torch.float32)
    final = torch.empty_like(initial_state)
    for n, (b, t0, t1) in enumerate(bounds):
        state = initial_state[n].clone()  # [HV, K, V]
        for t in range(t0, t1):
            state = state * g[b, t].exp()[:, None, None]
            recalled = torch.einsum("hk,hkv->hv", k[b, t], state)
            delta = beta[b, t][:, None] * (v[b, t].float() - recalled)
            state = state + k[b, t][:, :, None] * delta[:, None, :]
            out[b, t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, state)
        final[n] = state
    return out.to(v.dtype), final


def _with_kernel(factory: Any) -> Any:
    return lambda definition: factory(definition, kernel=naive_fla)


@pytest.mark.parametrize("index", range(4))
@pytest.mark.parametrize("heads", [(2, 4), (2, 2)])
def test_fla_prefill_conversion_meets_reference(index: int, heads: tuple[int, int]) -> None:
    values = {"num_qk_heads": heads[0], "num_v_heads": heads[1], "head_size": 32}
    for name, comparison in _run_both("gdn_prefill", _with_kernel(gdn_prefill), index,
                                      values).items():
        assert comparison.passed, (index, name, comparison.reason)


@pytest.mark.parametrize("index", range(4))
def test_fla_decode_conversion_meets_reference(index: int) -> None:
    for name, comparison in _run_both("gdn_decode", _with_kernel(gdn_decode), index).items():
        assert comparison.passed, (index, name, comparison.reason)


def test_fla_kernels_do_not_share_a_positional_order() -> None:
    """Why the decode adapter passes beta by keyword: positionally it would land on gk."""
    pytest.importorskip("fla")
    pytest.importorskip("triton")
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    chunk = list(inspect.signature(chunk_gated_delta_rule).parameters)
    recurrent = list(inspect.signature(fused_recurrent_gated_delta_rule).parameters)
    assert chunk[:5] == ["q", "k", "v", "g", "beta"]
    assert recurrent[4] == "gk" and recurrent.index("beta") == 6


def test_every_builtin_names_importable_adapters() -> None:
    from enginetap.core.patching import resolve
    from enginetap.definitions.registry import templates

    for builtin in BUILTINS:
        for family, target in builtin.adapters.items():
            assert family in templates(), (builtin.name, family)
            assert callable(resolve(target))
