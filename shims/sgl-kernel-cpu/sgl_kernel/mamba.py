"""Gated-delta and causal-conv entry points of SGLang's CPU path, in torch
(:mod:`enginetap.engines.sglang.cpu.kernels`)."""

from enginetap.engines.sglang.cpu.kernels import (  # noqa: F401
    causal_conv1d_fn_cpu,
    causal_conv1d_update_cpu,
    chunk_gated_delta_rule_cpu,
)
