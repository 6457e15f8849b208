"""Run by test_deferred.py in a child: ``deferred_checks.py cpu`` with TRITON_INTERPRET=1
(Triton's interpreter makes the deferred path run on the CPU), or ``deferred_checks.py
cuda`` on a GPU. The built-in engine tapped with deferred checkpoints
records exactly what the gather path records, and a tensor written after its checkpoint
is caught — by the first verification of its kind, by a periodic full verification, or by
its version counter (where the tensor has one) — and never recorded wrong. Quick steps
(checkpoints examined after the forward) record the same, leave out what they cannot
defer (a checkpoint new to the step's kind, a tensor whose version counter moved) and
name it in the record.

Prints one JSON line of findings; the test asserts on them."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers.models.llama import modeling_llama

from enginetap.config import ArmConfig
from enginetap.core.context import step_number
from enginetap.core.jsonl import close_all
from enginetap.engines.hf import HFEngine, Request
from enginetap.engines.hf.arming import disarm
from enginetap.tap.record import kernels
from enginetap.tap.record.deferred import DeferredHashes
from enginetap.tap.analysis.files import load_run

DEVICE = sys.argv[1] if len(sys.argv) > 1 else "cpu"
assert kernels.available(torch.zeros(1, device=DEVICE)), f"the kernels should run on {DEVICE}"

DEFERRED: list[int] = []
DEMOTED: list[str] = []
_hashes, _demote = DeferredHashes.hashes, DeferredHashes._demote


def counting_hashes(self: DeferredHashes, index: torch.Tensor) -> torch.Tensor:
    DEFERRED.append(len(self.tensors))
    return _hashes(self, index)


def noting_demote(self: DeferredHashes, name: str, why: str) -> None:
    if name not in self.demoted:
        DEMOTED.append(f"{name}: {why}")
    _demote(self, name, why)


DeferredHashes.hashes = counting_hashes  # type: ignore[method-assign]
DeferredHashes._demote = noting_demote  # type: ignore[method-assign]

MODE = {"what": "none"}
CALLS = {"n": 0}
QUICK: list[int] = []
PLANNED: list[int] = []
_mlp = modeling_llama.LlamaMLP.forward


def mlp_that_writes_its_input(self: Any, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's MLP, then a write into its input (the norm's checkpointed output) that
    changes no later result: behind the version counter (``.data``), or through it."""
    out = _mlp(self, x)
    if self is FIRST_MLP[0]:
        CALLS["n"] += 1
        if MODE["what"] == "hidden":  # every step: the first verification sees it
            x.data.mul_(2.0)
        elif MODE["what"] == "late" and step_number() == 4:  # only in a full verification
            x.data.mul_(2.0)
        elif MODE["what"] == "counted" and CALLS["n"] >= 4:
            x.mul_(1.0)  # same bytes, but the version counter moves
        elif MODE["what"] == "quick-counted" and step_number() >= 8:  # in quick steps
            x.mul_(1.0)
        elif MODE["what"] == "quick-new" and step_number() >= 6:
            FIRST_NORM[0](x)  # a checkpoint (L0.post_norm.out#2) new in a quick step
        elif MODE["what"] == "quick-strided":  # the same values, rows 2x their width apart
            wide = out.new_zeros(*out.shape[:-1], 2 * out.shape[-1])
            wide[..., :out.shape[-1]] = out
            return wide[..., :out.shape[-1]]
    return out


modeling_llama.LlamaMLP.forward = mlp_that_writes_its_input
FIRST_MLP: list[Any] = [None]
FIRST_NORM: list[Any] = [None]


def run(out: Path, defer: bool, what: str) -> tuple[list[list[int]], list[dict[str, Any]]]:
    MODE["what"], CALLS["n"] = what, 0
    quick = what.startswith("quick")  # longer runs, no periodic full verification
    tap = {"defer": defer, "continuity": False, "defer_verify_every": 0 if quick else 4}
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                       options={"tap": tap, "step": {"record": False}})
    try:
        engine = HFEngine.from_builtin("llama", dtype=torch.float32, prefix_cache_size=0,
                                       arm=config, device=DEVICE)
        FIRST_MLP[0] = engine.model.model.layers[0].mlp
        FIRST_NORM[0] = engine.model.model.layers[0].post_attention_layernorm
        if what == "quick-split":  # as sp_prefill notes it: rows may be split over ranks
            engine.arming.context.notes["rows_split"] = True  # type: ignore[union-attr]
        new = [14, 9 if what == "quick-shrink" else 14, 14] if quick else [6, 6, 6]
        reqs = [Request(request_id=f"r{i}", prompt=p, max_new_tokens=n)
                for i, (p, n) in enumerate(zip(["the cat sat", "on a mat", "the cat sat"], new))]
        tokens = [c.output_ids for c in engine.generate(reqs)]
        recorder = engine.arming.context.notes["tap"]  # type: ignore[union-attr]
        QUICK.append(recorder.quick_count)
        PLANNED.append(recorder.planned_count)
    finally:
        disarm()
        close_all()
    steps = [{"checkpoints": s.checkpoints, "hashes": s.hashes, "dropped": s.dropped,
              "rows": len(s.rows)} for s in load_run(out).rank(0).steps]
    return tokens, steps


def main() -> None:
    root = Path(tempfile.mkdtemp())
    found: dict[str, Any] = {}
    inference_mode = torch.inference_mode
    for what in ("none", "hidden", "late", "counted", "quick-none", "quick-new",
                 "quick-counted", "quick-strided", "quick-split", "quick-shrink"):
        DEFERRED.clear()
        DEMOTED.clear()
        QUICK.clear()
        PLANNED.clear()
        if what.endswith("counted"):  # tensors with version counters: the engine without
            torch.inference_mode = torch.no_grad  # type: ignore[assignment,misc]
        tokens_off, off = run(root / f"{what}-off", False, what)
        assert not DEFERRED, "defer=False must not defer"
        tokens_on, on = run(root / f"{what}-on", True, what)
        torch.inference_mode = inference_mode  # type: ignore[misc]
        found[what] = {"tokens_equal": tokens_on == tokens_off, "steps": len(on),
                       "quick": QUICK[1], "planned": PLANNED[1],
                       "rows": sorted({s["rows"] for s in on}),  # tapped rows per step
                       "deferred": sum(DEFERRED), "demoted": list(DEMOTED),
                       "dropped": [(i, s["dropped"]) for i, s in enumerate(on) if s["dropped"]],
                       "equal": [], "differ": []}
        for i, (a, b) in enumerate(zip(off, on)):
            gone = set(b["dropped"])
            kept = {n: h for n, h in zip(a["checkpoints"], a["hashes"]) if n not in gone}
            same = b["checkpoints"] == [n for n in a["checkpoints"] if n not in gone] \
                and dict(zip(b["checkpoints"], b["hashes"])) == kept
            found[what]["equal" if same else "differ"].append(i)
    print(json.dumps(found))


if __name__ == "__main__":
    sys.exit(main())
