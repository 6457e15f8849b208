"""enginetap's torch kernels for SGLang's CPU path (``engines/sglang/cpu/kernels.py``)
against the definitions' references (the chunked gated-delta prefill form and the
one-token decode) and a direct causal convolution; the ``sgl_kernel`` stand-in's names
raise a clear error. Plain torch: runs in every venv, no engine."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from enginetap.definitions import compile_reference, get_template
from enginetap.engines.sglang.cpu import kernels

HK, HV, D = 2, 4, 64


def _reference(family: str):
    definition = get_template(family).instantiate(num_qk_heads=HK, num_v_heads=HV,
                                                  head_size=D, dtype="float32")
    return compile_reference(definition.reference, family)


def _inputs(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, tokens, HK, D, generator=g) for _ in range(2))
    v = torch.randn(1, tokens, HV, D, generator=g)
    a, b = torch.randn(tokens, HV, generator=g), torch.randn(tokens, HV, generator=g)
    A_log, dt_bias = torch.randn(HV, generator=g) * 0.5, torch.randn(HV, generator=g) * 0.5
    return q, k, v, a, b, A_log, dt_bias


def test_prefill_matches_the_chunked_reference_and_writes_the_state_back() -> None:
    q, k, v, a, b, A_log, dt_bias = _inputs(90)
    g, beta = kernels.gdn_gating(A_log, a, b, dt_bias)
    cu = torch.tensor([0, 70, 90], dtype=torch.int32)  # 70 tokens: two chunks of the reference
    pool = torch.randn(5, HV, D, D, generator=torch.Generator().manual_seed(1)) * 0.1
    slots = torch.tensor([3, 1])
    initial = pool[slots].clone()
    out, final, h = kernels.chunk_gated_delta_rule_cpu(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=pool, cu_seqlens=cu,
        head_first=False, use_qk_l2norm_in_kernel=True, initial_state_indices=slots)
    want_out, want_state = _reference("gdn_prefill")(
        q[0], k[0], v[0], g[0], beta[0], initial, cu, D ** -0.5)
    assert h is None
    torch.testing.assert_close(out[0], want_out, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(final, want_state, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(pool[slots], want_state, atol=2e-4, rtol=2e-4)


def test_decode_op_matches_the_reference_and_updates_its_slots_in_place() -> None:
    kernels.register_ops()
    q, k, v, a, b, A_log, dt_bias = _inputs(3, seed=2)
    pool = torch.randn(6, HV, D, D, generator=torch.Generator().manual_seed(3)) * 0.1
    slots = torch.tensor([5, 0, 2])
    before = pool[slots].clone()
    untouched = pool[[1, 3, 4]].clone()
    out = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=pool,
        initial_state_indices=slots, cu_seqlens=torch.arange(4, dtype=torch.int32),
        use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0)
    g, beta = kernels.gdn_gating(A_log, a, b, dt_bias)
    want_out, want_state = _reference("gdn_decode")(q[0], k[0], v[0], g[0], beta[0], before,
                                                    D ** -0.5)
    torch.testing.assert_close(out[0], want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[slots], want_state, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool[[1, 3, 4]], untouched)


def test_causal_conv_prefill_then_decode_equals_one_convolution_of_the_whole() -> None:
    gen = torch.Generator().manual_seed(4)
    dim, width, tokens = 6, 4, 9
    weight, bias = torch.randn(dim, width, generator=gen), torch.randn(dim, generator=gen)
    x = torch.randn(tokens + 2, dim, generator=gen)
    states = torch.zeros(3, dim, width - 1)
    out = kernels.causal_conv1d_fn_cpu(
        x[:tokens].t(), weight, bias, activation="silu", conv_states=states,
        has_initial_state=torch.tensor([False]), cache_indices=torch.tensor([2]),
        query_start_loc=torch.tensor([0, tokens]))
    step1 = kernels.causal_conv1d_update_cpu(x[tokens:tokens + 1], states, weight, bias,
                                             "silu", torch.tensor([2]))
    step2 = kernels.causal_conv1d_update_cpu(x[tokens + 1:], states, weight, bias, "silu",
                                             torch.tensor([2]))
    whole = F.silu(F.conv1d(F.pad(x.t()[None], (width - 1, 0)), weight[:, None, :], bias,
                            groups=dim))[0]
    torch.testing.assert_close(out, whole[:, :tokens], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step1[0], whole[:, tokens], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step2[0], whole[:, tokens + 1], atol=1e-5, rtol=1e-5)
    assert torch.equal(states[2], x[-(width - 1):].t())
    assert torch.count_nonzero(states[:2]) == 0


def test_standin_names_raise_a_clear_error() -> None:
    import importlib
    import sys
    import types

    import pytest

    from enginetap.engines.sglang.cpu.standin import MissingKernel, fill_package

    name = "enginetap_test_sgl_kernel"
    package = types.ModuleType(name)
    package.__path__ = []  # a package, as the shim's sgl_kernel
    sys.modules[name] = package
    try:
        fill_package(name)
        module = importlib.import_module(f"{name}.kvcacheio")
        with pytest.raises(MissingKernel, match="kvcacheio.transfer_kv_all_layer was called"):
            module.transfer_kv_all_layer(1)
        assert not hasattr(torch.ops.sgl_kernel, "fused_qk_norm_cpu")  # feature probes fail
    finally:
        for key in [k for k in sys.modules if k.startswith(name)]:
            del sys.modules[key]
        sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "root", None) != name]
