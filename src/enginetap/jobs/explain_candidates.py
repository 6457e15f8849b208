"""Built-in solutions on the bytes that diverged: batch-invariant or not, deterministic or not.

``enginetap replay REPRO --solution NAME`` checks a candidate against the reference within
tolerance, workload by workload. What a batch-variant finding asks of a fix is stricter:
the same bytes for a request alone and at every position of a batch. For each built-in
named with ``tap explain --solution``, this calls it on each side's ``alone`` and
``copies`` workloads (the exact bytes the engine saw) and compares its outputs bit for bit:
alone vs every position, and the copies batch twice.
"""

from __future__ import annotations

from typing import Any

import torch

from enginetap.errors import ConfigError
from enginetap.jobs.explain_layout import pick_slice

__all__ = ["check_candidates", "check_names"]


def check_names(names: list[str]) -> None:
    """Raises: ConfigError: a name is not a built-in solution."""
    from enginetap.replay.builtin import BUILTINS, builtin_named

    unknown = [n for n in names if builtin_named(n) is None]
    if unknown:
        raise ConfigError(f"unknown built-in solution(s) {', '.join(unknown)}",
                          f"tap explain runs the built-ins in this process: "
                          f"{', '.join(b.name for b in BUILTINS)}",
                          "name one of those (check your own kernel with `enginetap replay "
                          "REPRO --solution file.py:function`)")


def check_candidates(names: list[str], configs: list[Any], definition: Any,
                     device: str) -> list[str]:
    """One line per solution: what its outputs did across ``configs`` (the calls made
    again, :class:`~enginetap.jobs.explain_verdict.Config`)."""
    from enginetap.replay.builtin import builtin_named

    lines = []
    for name in names:
        solution = builtin_named(name)
        assert solution is not None
        why = solution.skip_reason(definition, device)
        if why is not None:
            lines.append(f"{name}: not run ({why})")
            continue
        function = solution.adapter(definition)
        lines.append(f"{name}: " + _judge(function, definition, configs, device))
    return lines


def _call(function: Any, definition: Any, inputs: dict[str, Any],
          device: str) -> dict[str, torch.Tensor]:
    from enginetap.replay.solution import CallPlan

    plan = CallPlan(definition)
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    args, kwargs = plan.prepare(moved, {}, device)
    with torch.inference_mode():
        outputs = plan.collect(function(*args, **kwargs), args, kwargs)
    return {k: v.detach().to("cpu") for k, v in outputs.items()}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float | None:
    found = [float((v.double() - b[k].double()).abs().max()) for k, v in a.items()
             if k in b and not torch.equal(v, b[k])]
    return max(found) if found else None


def _judge(function: Any, definition: Any, configs: list[Any], device: str) -> str:
    variant: list[str] = []
    unstable: list[str] = []
    for side in sorted({c.side for c in configs}):
        alone = next(c for c in configs if c.side == side and c.name == "alone")
        copies = next(c for c in configs if c.side == side and c.name == "copies")
        base = _call(function, definition, alone.extracted.inputs, device)
        first = _call(function, definition, copies.extracted.inputs, device)
        again = _call(function, definition, copies.extracted.inputs, device)
        base_row = {k: pick_slice(v, alone.sizes, 0) for k, v in base.items()}
        for p in range(len(copies.picks)):
            d = _differ(base_row, {k: pick_slice(v, copies.sizes, p) for k, v in first.items()})
            if d is not None:
                variant.append(f"position {p} ({d:.3g})")
        if (d := _differ(first, again)) is not None:
            unstable.append(f"{d:.3g}")
    n = len(next(c for c in configs if c.name == "copies").picks)
    parts = [("batch-invariant on these bytes (alone = every one of "
              f"{n} positions, bit for bit)") if not variant else
             f"not batch-invariant on these bytes: alone vs {', '.join(variant[:8])}"]
    parts.append("deterministic (the batch twice: equal)" if not unstable else
                 f"nondeterministic (the batch twice: max abs {unstable[0]})")
    return "; ".join(parts)
