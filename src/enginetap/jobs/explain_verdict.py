"""The verdict of ``tap explain`` and its REPRO dataset.

Given the culprit op's call on each side (:class:`~enginetap.jobs.explain_calls.Caught`),
in this order:

1. the two sides' canonical inputs differ → **upstream**: the first differing input; where
   a side's input equals another request's of the same call, which request and slot;
2. the engine's function, called twice on the same batch (the original, or the request
   alone), gives other bytes → **nondeterministic**;
3. the request's output alone (batch 1) differs from its output at some position of a
   batch of the original size made of copies of it, or in the original batch →
   **batch-variant** (not batch-invariant): the function, the shapes, the positions;
4. else the recorded outputs differ though nothing above does → the reference names the
   **wrong row** (the one farther from it) and by how much.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from enginetap.jobs.explain_calls import Caught, call_again, first_tensor
from enginetap.jobs.explain_layout import Layout, common_rows, pick_slice, request_inputs
from enginetap.jobs.explain_result import ExplainResult
from enginetap.tap.analysis.culprit import Culprit

__all__ = ["judge", "side_output", "write_repro"]


@dataclass
class Config:
    """One call of the op made again: which side, which requests, what came out."""

    name: str
    side: int
    picks: list[int]
    sizes: list[int]
    """Canonical rows of each pick."""
    extracted: Any

    def output(self, p: int) -> dict[str, torch.Tensor]:
        """Pick ``p``'s slice of every output."""
        return {k: pick_slice(v, self.sizes, p) for k, v in self.extracted.outputs.items()}


def side_output(caught: Caught, key: str, limit: int | None = None,
                outputs: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Request ``key``'s part (its first ``limit`` token rows) of the caught call's
    recorded ``outputs`` (or of ``outputs``, laid out like them)."""
    layout = Layout.of(caught.step)
    j = layout.request(key)
    found = {k: layout.slice(v, j, limit) for k, v in
             (caught.extracted.outputs if outputs is None else outputs).items()}
    return {k: v for k, v in found.items() if v is not None}


def _same(x: Any, y: Any) -> bool:
    return (isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype
            and torch.equal(x, y))


def _max_abs(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.shape != y.shape:
        return float("inf")
    return float((x.double() - y.double()).abs().max()) if x.numel() else 0.0


def _outputs_differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float | None:
    """Max abs difference over the outputs, None when every one is bit for bit equal."""
    found = [_max_abs(v, b[k]) for k, v in a.items() if k in b and not _same(v, b[k])]
    return max(found) if found else None


def _shape(caught: Caught) -> str:
    tensor = first_tensor(caught.args)
    return "x".join(str(d) for d in tensor.shape) if tensor is not None else "?"


# ---------------------------------------------------------------------- judging
def judge(culprit: Culprit, ca: Caught, cb: Caught,
          again: tuple[bool, str] = (True, "")) -> ExplainResult:
    """The verdict on one op; ``result.records`` are REPRO's workloads. ``again``: whether
    the re-run split the same way, and how (:func:`~enginetap.tap.analysis.culprit.recheck`)."""
    a, b = culprit.sides
    limit = common_rows(ca.step, a.key, cb.step, b.key)
    layouts = (Layout.of(ca.step), Layout.of(cb.step))
    js = (layouts[0].request(a.key), layouts[1].request(b.key))
    op = f"{ca.definition.name} ({ca.probe.name}: {ca.target}) in {ca.module}"
    result = ExplainResult(culprit, op, ca.definition.name, "")
    if again[1]:
        result.evidence.append(again[1])
    calls = (ca, cb) if ca is not cb else (ca,)
    configs = _configs(calls, layouts, js)
    result.records = configs
    result.evidence += [f"{culprit.label(i)}: {layouts[i].where(js[i])} at step "
                        f"{culprit.sides[i].step}, {limit} row(s) shared" for i in (0, 1)]
    result.evidence += _reference_evidence(culprit, (ca, cb), limit)
    upstream = _upstream(culprit, (ca, cb), layouts, js, limit)
    if upstream is not None:
        result.kind, result.verdict = "upstream", upstream
        return result
    for judge_step in (_nondeterministic, _batch_variant):
        found = judge_step(culprit, (ca, cb), configs, result.evidence)
        if found is not None:
            result.kind, result.verdict = found
            return result
    result.kind, result.verdict = _wrong_row(culprit, (ca, cb), limit, again[0])
    return result


def _configs(calls: tuple[Caught, ...], layouts: tuple[Layout, Layout],
             js: tuple[int, int]) -> list[Config]:
    """Alone twice, at every position of a batch of copies, the original batch twice."""
    out: list[Config] = []
    for side, j in enumerate(js):
        caught = calls[min(side, len(calls) - 1)]
        layout = layouts[side]
        n = len(layout.rows)
        for name, picks in (("alone", [j]), ("alone again", [j]), ("copies", [j] * n)):
            out.append(Config(name, side, picks, [len(layout.rows[p]) for p in picks],
                              call_again(caught, picks)))
        if side == 0 or len(calls) > 1:
            for name in ("batch", "batch again"):
                picks = list(range(n))
                out.append(Config(name, side, picks, [len(r) for r in layout.rows],
                                  call_again(caught, picks)))
    return out


def _upstream(culprit: Culprit, calls: tuple[Caught, Caught], layouts: tuple[Layout, Layout],
              js: tuple[int, int], limit: int) -> str | None:
    a_in = request_inputs(calls[0].extracted.inputs, layouts[0], js[0], limit)
    b_in = request_inputs(calls[1].extracted.inputs, layouts[1], js[1], limit)
    for name in calls[0].definition.inputs:
        if name in a_in and name in b_in and not _same(a_in[name], b_in[name]):
            where = [w for side in (0, 1) if (w := _read_from(culprit, calls, layouts, js,
                                                               side, name, limit))]
            detail = "; ".join(where) if where else (
                f"the bytes changed after the tap's last agreeing checkpoint "
                f"({culprit.agreeing_input or 'before it'}), inside {calls[0].module} or "
                "between the taps, in an op no probe covers (e.g. its input projections)")
            return (f"inputs differ -> upstream of {calls[0].definition.name} in "
                    f"{calls[0].module}: first differing input `{name}` "
                    f"(max abs {_max_abs(a_in[name], b_in[name]):.3g}); {detail}")
    return None


def _read_from(culprit: Culprit, calls: tuple[Caught, Caught], layouts: tuple[Layout, Layout],
               js: tuple[int, int], side: int, name: str, limit: int) -> str | None:
    """Which other request of the same call holds the same input as ``side``'s request."""
    layout, caught, j = layouts[side], calls[side], js[side]
    own = request_inputs(caught.extracted.inputs, layout, j, limit)[name]
    skip = {js[0], js[1]} if calls[0] is calls[1] else {j}
    # a request of the same prompt holds the same state by right: no evidence of a slot mix
    prompt = _prompt_of(culprit, side, layout.keys[j])
    skip |= {k for k, key in enumerate(layout.keys)
             if prompt is not None and _prompt_of(culprit, side, key) == prompt}
    for k in range(len(layout.rows)):
        other = request_inputs(caught.extracted.inputs, layout, k, limit).get(name)
        if k not in skip and other is not None and _same(own, other):
            slots = _slots(caught, layout, name)
            where = (f" (slot {slots[k]}, not its own slot {slots[j]})" if slots else "")
            return f"{culprit.label(side)}'s `{name}` is {layout.keys[k]}'s{where}"
    return None


def _prompt_of(culprit: Culprit, side: int, key: str) -> str | None:
    """The prompt of request ``p<i>`` of the side's run (ids as `tap run` gives them)."""
    prompts = culprit.sides[side].facts.get("prompts") or []
    index = key[1:]
    return prompts[int(index)] if key[:1] == "p" and index.isdigit() \
        and int(index) < len(prompts) else None


def _slots(caught: Caught, layout: Layout, name: str) -> list[int] | None:
    rows = caught.step.rows
    column = rows.state_slots if "state" in name or "conv" in name else rows.kv_slots
    if column is None:
        return None
    return [column[r[0]] for r in layout.rows]


def _nondeterministic(culprit: Culprit, calls: tuple[Caught, Caught], configs: list[Config],
                      evidence: list[str]) -> tuple[str, str] | None:
    for first, second in (("alone", "alone again"), ("batch", "batch again")):
        for side in (0, 1):
            x = next((c for c in configs if c.name == first and c.side == side), None)
            y = next((c for c in configs if c.name == second and c.side == side), None)
            if x is None or y is None:
                continue
            d = _outputs_differ({k: v for k, v in x.extracted.outputs.items()},
                                y.extracted.outputs)
            evidence.append(f"{culprit.label(side)}: {first} twice: "
                            + ("bit for bit equal" if d is None else f"max abs {d:.3g}"))
            if d is not None:
                caught = calls[side]
                return "nondeterministic", (
                    f"same inputs, same position, output differs run to run -> "
                    f"{caught.target} ({calls[0].definition.name} in {caught.module}) is "
                    f"nondeterministic: two calls on the same batch of {len(x.picks)} "
                    f"request(s) ({first}; the original call's input {_shape(caught)}) "
                    f"differ by max abs {d:.3g}")
    return None


def _batch_variant(culprit: Culprit, calls: tuple[Caught, Caught], configs: list[Config],
                   evidence: list[str]) -> tuple[str, str] | None:
    for side in (0, 1):
        alone = next((c for c in configs if c.name == "alone" and c.side == side), None)
        copies = next((c for c in configs if c.name == "copies" and c.side == side), None)
        if alone is None or copies is None:
            continue
        base = alone.output(0)
        differ = [(p, d) for p in range(len(copies.picks))
                  if (d := _outputs_differ(base, copies.output(p))) is not None]
        key = culprit.label(side)
        j = Layout.of(calls[side].step).request(culprit.sides[side].key)
        evidence.append(f"{key}: alone (batch 1) vs each of {len(copies.picks)} positions of "
                        f"a batch of copies: {len(differ)} position(s) differ")
        if differ:
            worst = max(d for _, d in differ)
            positions = ", ".join(str(p) for p, _ in differ[:12])
            own = " (its own position among them)" if j in {p for p, _ in differ} else ""
            caught = calls[side]
            return "batch-variant", (
                f"same inputs, output depends on batch position/size -> {caught.target} "
                f"({calls[0].definition.name} in {caught.module}) is not batch-invariant: "
                f"{key}'s inputs alone (batch 1) vs at positions {positions} of a batch of "
                f"{len(copies.picks)} copies{own} differ by max abs {worst:.3g} "
                f"(input {_shape(caught)})")
    return None


def _reference(caught: Caught) -> dict[str, torch.Tensor]:
    from enginetap.definitions.base import compile_reference
    from enginetap.replay.solution import CallPlan

    definition = caught.definition
    plan = CallPlan(definition)
    args, kwargs = plan.prepare(caught.extracted.inputs, {}, "cpu")
    function = compile_reference(definition.reference, definition.name)
    with torch.inference_mode():
        return plan.collect(function(*args, **kwargs), args, kwargs)


def _reference_errors(culprit: Culprit, calls: tuple[Caught, Caught],
                      limit: int) -> list[float]:
    errors = []
    for side, caught in enumerate(calls):
        key = culprit.sides[side].key
        ref = side_output(caught, key, limit, _reference(caught))
        recorded = side_output(caught, key, limit)
        errors.append(max((_max_abs(v, ref[k].to(v.dtype))
                           for k, v in recorded.items() if k in ref), default=0.0))
    return errors


def _reference_evidence(culprit: Culprit, calls: tuple[Caught, Caught],
                        limit: int) -> list[str]:
    errors = _reference_errors(culprit, calls, limit)
    return [f"{culprit.label(i)} (step {culprit.sides[i].step}): recorded output vs the "
            f"definition's reference: max abs {e:.3g}" for i, e in enumerate(errors)]


def _wrong_row(culprit: Culprit, calls: tuple[Caught, Caught],
               limit: int, reproduced: bool) -> tuple[str, str]:
    a, b = culprit.sides
    d = _outputs_differ(side_output(calls[0], a.key, limit),
                        side_output(calls[1], b.key, limit))
    op = f"{calls[0].definition.name} in {calls[0].module}"
    if d is None and reproduced:
        return "after-op", (f"same inputs, same outputs at {op}, yet the re-run split at "
                            f"{culprit.checkpoint} again -> the difference arises inside "
                            f"{culprit.module} after the probed op, in an op no probe covers "
                            "(e.g. an output projection)")
    if d is None:
        return "none", (f"same inputs, same outputs at {op} in the re-run, which did not "
                        "split the same way: the split did not reproduce (run it again, or "
                        "diff the run against the re-run under REPRO/enginetap)")
    errors = _reference_errors(culprit, calls, limit)
    good, bad = (0, 1) if errors[0] <= errors[1] else (1, 0)
    keys = (culprit.label(0), culprit.label(1))
    return "wrong-row", (
        f"same inputs, the op called again agrees with itself everywhere; the reference "
        f"agrees with {keys[good]} (max abs {errors[good]:.3g}) -> {keys[bad]} is wrong by "
        f"max abs {errors[bad]:.3g} ({calls[0].definition.name} in {calls[0].module}; the "
        f"two recorded rows differ by {d:.3g})")


# ---------------------------------------------------------------------- REPRO
def write_repro(out: Path, culprit: Culprit, result: ExplainResult, ca: Caught,
                cb: Caught) -> tuple[Path, int]:
    """REPRO: the definition, each side's recorded call and every call made again."""
    from enginetap import __version__
    from enginetap.dataset import Dataset
    from enginetap.dataset.writer import WorkloadRecord

    calls = (ca, cb)
    records = []
    recorded = [(0, ca)] + ([(1, cb)] if cb is not ca else [])
    for side, caught in recorded:
        records.append(_record(caught, caught.extracted, culprit, side, "recorded",
                               Layout.of(caught.step).keys, __version__, WorkloadRecord))
    for config in result.records:
        caught = calls[config.side]
        keys = [Layout.of(caught.step).keys[p] for p in config.picks]
        records.append(_record(caught, config.extracted, culprit, config.side, config.name,
                               keys, __version__, WorkloadRecord))
    Dataset(out, create=True).add_workloads(records)
    return out, len(records)


def _record(caught: Caught, extracted: Any, culprit: Culprit, side: int, config: str,
            keys: list[str], version: str, record: Any) -> Any:
    facts = culprit.sides[side].facts
    engine = str(facts.get("engine") or "builtin")  # the re-run's engine (vllm's too)
    return record(definition=caught.definition, inputs=extracted.inputs,
                  outputs=extracted.outputs, receipt={
                      "source": f"explain:{engine}", "engine": engine,
                      "model": str(facts.get("model")), "request_ids": keys,
                      "step": caught.step.step, "mode": caught.step.mode,
                      "layer": caught.module, "enginetap_version": version,
                      "notes": {"config": config, "side": culprit.sides[side].key,
                                "finding": culprit.describe(),
                                "adapter": list(extracted.notes)}})
