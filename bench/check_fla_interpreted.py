"""fla's recurrent GDN kernel on the CPU, through Triton's interpreter: the decode adapter
against the reference, and the positional call against the keyword call.

Usage (fla-core installed somewhere outside the test environment, see docs/replay.md):
    TRITON_INTERPRET=1 PYTHONPATH=src:/path/to/site python bench/check_fla_interpreted.py

``chunk_gated_delta_rule`` autotunes, which the interpreter cannot (it needs a driver), so
only ``fused_recurrent_gated_delta_rule`` runs here; the H200 probe covers both.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("set TRITON_INTERPRET=1 (fla's Triton kernels need a GPU otherwise)")
        return 2
    _adapter()
    _positional()
    return 0


def _adapter() -> None:
    from enginetap.definitions.base import compile_reference
    from enginetap.definitions.registry import get_template
    from enginetap.replay.builtin.fla import gdn_decode
    from enginetap.replay.compare import compare_outputs
    from enginetap.replay.solution import CallPlan

    template = get_template("gdn_decode")
    definition = template.instantiate(**{**template.example, "head_size": 32})
    reference = compile_reference(definition.reference, definition.name)
    run, plan = gdn_decode(definition), CallPlan(definition)
    for index in range(4):
        axes = template.axes_for(definition.const_axes, index)
        inputs = template.synthetic_inputs(definition, axes, index)
        args, kwargs = plan.prepare(inputs, axes, "cpu")
        expected = plan.collect(reference(*args, **kwargs), args, kwargs)
        args, kwargs = plan.prepare(inputs, axes, "cpu")
        actual = plan.collect(run(*args, **kwargs), args, kwargs)
        for name in definition.outputs:
            c = compare_outputs(template.rule(name), expected[name], actual[name])
            print(f"fla:gdn {definition.name} {axes} {name}: "
                  f"{'PASS' if c.passed else 'FAIL'} max abs {c.max_abs_error:.3g}, "
                  f"NaN/inf {c.nonfinite}")


def _positional() -> None:
    import torch
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    batch, qk, hv, size = 3, 2, 4, 32
    q, k = (torch.randn(batch, 1, qk, size, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(batch, 1, hv, size, generator=gen).bfloat16()
    g = -torch.rand(batch, 1, hv, generator=gen)
    beta = torch.rand(batch, 1, hv, generator=gen).sigmoid()
    common = {"scale": size ** -0.5, "initial_state": torch.randn(batch, hv, size, size,
                                                                   generator=gen) * 0.1,
              "output_final_state": True, "use_qk_l2norm_in_kernel": True}
    keyword, _ = fused_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **common)
    positional, _ = fused_recurrent_gated_delta_rule(q, k, v, g, beta, **common)
    for label, out in (("keywords (g=g, beta=beta)", keyword), ("positional (g, beta)", positional)):
        print(f"fused_recurrent_gated_delta_rule {label}: NaN {int(out.isnan().sum())} "
              f"of {out.numel()}")


if __name__ == "__main__":
    sys.exit(main())
