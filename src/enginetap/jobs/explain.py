"""``enginetap tap explain``: from a tap finding to the kind of bug behind it.

1. The finding (:func:`enginetap.tap.analysis.culprit.find_culprit`) names a checkpoint, a step and
   two sides (two requests of one run, or one request in two runs).
2. Each run is recorded again from its header's ``options.run`` (same prompts, batch
   size, dtype, tap options) on the built-in engine, or on vLLM CPU in this process (a
   pair of a TP=1 run: vLLM arms once per process), with a :class:`~enginetap.jobs.
   explain_calls.Catcher` keeping every probed call inside the culprit module at that
   step: the finest op the capture probes describe (attention kernel, norm, experts,
   gated delta rule...), the whole batch's tensors.
3. The op (the first caught call whose two sides' outputs differ) is called again through
   the engine's own function: each side's request alone (batch 1), at every position of a
   batch of the original size (its own included), the original batch twice; and each
   workload goes through the definition's reference.
4. The verdict (:mod:`enginetap.jobs.explain_verdict`) and REPRO, a FlashInfer-Trace
   dataset of the definition and those workloads (``enginetap replay REPRO``).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from enginetap.errors import ConfigError
from enginetap.jobs.explain_result import ExplainResult
from enginetap.tap.analysis.culprit import Culprit, Side, recheck

__all__ = ["ExplainResult", "explain"]


def explain(culprit: Culprit, out: Path, *, device: str | None = None,
            solutions: list[str] | None = None) -> ExplainResult:
    """Re-run the finding's runs, replay the culprit op, write REPRO to ``out``; each
    built-in of ``solutions`` is checked for batch invariance on the same bytes.

    Raises:
        ConfigError: a run is of an engine not re-run here (or a vLLM finding other than
            a pair of a TP=1 run), ``out`` is not a new directory,
            an unknown solution, or no capture probe covers the culprit checkpoint's
            module on this model.
    """
    from enginetap.jobs.explain_candidates import check_names

    _check_out(out)
    check_names(solutions or [])
    fresh = not out.exists()
    try:
        return _explain(culprit, out, device, solutions or [])
    except BaseException:
        if fresh:  # a refusal after the re-run began leaves no half-written REPRO behind
            shutil.rmtree(out, ignore_errors=True)
        raise


def _explain(culprit: Culprit, out: Path, device: str | None,
             solutions: list[str]) -> ExplainResult:
    from enginetap.jobs.explain_candidates import check_candidates
    from enginetap.jobs.explain_verdict import judge, write_repro

    for side in culprit.sides:
        _check_engine(culprit, side)
    caught = _rerun_all(culprit, out, device)
    pick = _pick_op(culprit, caught)
    b_dir = out / "enginetap" / "rerun-b"
    again = recheck(culprit, out / "enginetap" / "rerun-a", b_dir if b_dir.is_dir() else None)
    result = judge(culprit, caught[0][pick[0]], caught[1][pick[1]], again)
    result.repro, result.workloads = write_repro(out, culprit, result, caught[0][pick[0]],
                                                 caught[1][pick[1]])
    if solutions:
        where = device or str(culprit.sides[0].facts.get("device") or "cpu")
        result.candidates = check_candidates(solutions, result.records,
                                             caught[0][pick[0]].definition, where)
    return result


def _check_engine(culprit: Culprit, side: Side) -> None:
    engine = side.facts.get("engine")
    if engine == "builtin":
        return
    if engine != "vllm":
        raise ConfigError(f"cannot explain a run of engine {engine!r}",
                          "tap explain re-runs the built-in engine and vLLM",
                          "record the run with `enginetap tap run`")
    a, b = culprit.sides
    if int(side.facts.get("tp") or 1) != 1 or a.run != b.run:
        raise ConfigError("cannot explain this vLLM finding",
                          "vLLM is re-run in this process, once, at TP=1 (its arming is "
                          "per process): a pair of one TP=1 run",
                          "explain a pair (--pair) of a run recorded with --tp 1")


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"cannot write REPRO to {out}", "it exists and is not an empty "
                          "directory", "pass a new directory as --out")


def _rerun_all(culprit: Culprit, out: Path, device: str | None) -> tuple[list, list]:
    a, b = culprit.sides
    first = _rerun(a, culprit, out / "enginetap" / "rerun-a", device)
    if a.run == b.run and a.step == b.step:
        return first, first
    return first, _rerun(b, culprit, out / "enginetap" / "rerun-b", device)


def _rerun(side: Side, culprit: Culprit, tap_dir: Path, device: str | None) -> list:
    """Record ``side``'s run again; returns the probed calls caught in the culprit module."""
    if side.facts.get("engine") == "vllm":
        return _rerun_vllm(side, culprit, tap_dir)
    return _rerun_builtin(side, culprit, tap_dir, device)


def _rerun_builtin(side: Side, culprit: Culprit, tap_dir: Path, device: str | None) -> list:
    """The built-in engine's re-run.

    Raises:
        ConfigError: no probe covers the culprit's module (checked before generating).
    """
    import torch

    from enginetap.config import ArmConfig
    from enginetap.core.jsonl import close_all
    from enginetap.engines.hf import HFEngine
    from enginetap.engines.hf.arming import disarm
    from enginetap.jobs.explain_calls import Catcher

    facts = side.facts
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=tap_dir,
                       options={"tap": {**side.tap, "run": facts}, "step": {"record": False}})
    model = str(facts["model"])
    kwargs = {"dtype": getattr(torch, str(facts.get("dtype") or "float32")),
              "device": device or str(facts.get("device") or "cpu"),
              "prefix_cache_size": 0, "arm": config}
    catcher: Catcher | None = None
    try:
        with _quiet():
            engine = (HFEngine.from_builtin(model.partition(":")[2], **kwargs)
                      if model.startswith("builtin:") else HFEngine(model, **kwargs))
        assert engine.arming is not None
        hooks = engine.arming.context.hooks
        catcher = Catcher(hooks.capture_probes(), side.step, culprit.module)
        if not catcher.covers(engine.model):
            raise _uncovered(culprit, model, f"no probed class or kernel runs inside "
                                             f"{culprit.module}")
        catcher.patches.install()
        catcher.add_model(engine.model, hooks.sublayer_targets(engine.model))
        _generate(engine, facts)
    finally:
        if catcher is not None:
            catcher.uninstall()
        disarm()
        close_all()
    return _caught(catcher, culprit, side, model)


def _caught(catcher: Any, culprit: Culprit, side: Side, model: str) -> list:
    if not catcher.caught:
        declined = f" (declined: {', '.join(catcher.declined)})" if catcher.declined else ""
        raise _uncovered(culprit, model, f"no probed op ran inside {culprit.module} at step "
                                         f"{side.step}{declined}")
    return catcher.caught


def _rerun_vllm(side: Side, culprit: Culprit, tap_dir: Path) -> list:
    """vLLM CPU's re-run, its engine core and model runner in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the catcher wraps the probes' targets here."""
    import gc
    import os

    from enginetap.core.capability import current_arming
    from enginetap.core.jsonl import close_all
    from enginetap.jobs.explain_calls import Catcher
    from enginetap.jobs.engine import build_llm, resolve_model
    from enginetap.jobs.tap import arm_tap_processes, generate_batch

    facts, model = side.facts, str(side.facts["model"])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    arm_tap_processes(tap_dir, {**side.tap, "run": facts}, 1)
    try:
        from vllm import SamplingParams
    except ImportError:
        raise ConfigError("vLLM is not installed", "the run was recorded on vLLM",
                          "pip install enginetap[vllm]") from None
    size = int(facts.get("batch_size") or 8)
    with _quiet():
        llm = build_llm(resolve_model(model), dtype=_vllm_dtype(facts),
                        enable_prefix_caching=False, max_num_seqs=size)
    arming = current_arming()
    hooks = arming.hooks if arming is not None else None
    loaded: list[Any] = []  # the model vLLM loaded in this process (the engine core's)
    if hooks is not None:
        hooks.on_model_loaded(loaded.append)
    catcher = Catcher(hooks.capture_probes() if hooks is not None else [], side.step,
                      culprit.module)
    try:
        catcher.patches.install()
        for network in loaded:  # its sublayers name the running module, as capture's do
            assert hooks is not None
            if not catcher.covers(network):
                raise _uncovered(culprit, model, f"no probed class or kernel runs inside "
                                                 f"{culprit.module}")
            catcher.add_model(network, hooks.sublayer_targets(network))
        params = SamplingParams(max_tokens=int(facts.get("max_new_tokens") or 8),
                                temperature=0.0)
        prompts, done = list(facts["prompts"]), {}
        for start in range(0, len(prompts), size):
            generate_batch(llm.llm_engine, prompts, start, size, params, done)
    finally:
        catcher.uninstall()
        loaded.clear()
        del llm
        gc.collect()
        close_all()
    return _caught(catcher, culprit, side, model)


def _uncovered(culprit: Culprit, model: str, why: str) -> ConfigError:
    return ConfigError(f"no capture probe covers {culprit.checkpoint} on {model}", why,
                       "explain a finding at a checkpoint whose module has a probe (attention, "
                       "norms, MoE, gated delta rule; docs/capture.md lists them), or record "
                       "with `--depth sublayers` to name a finer checkpoint")


def _generate(engine: Any, facts: dict[str, Any]) -> None:
    """The run's prompts in its batches, request ids ``p<index>`` (as ``tap run``)."""
    from enginetap.engines.hf import Request

    prompts, size = list(facts["prompts"]), int(facts.get("batch_size") or 8)
    new = int(facts.get("max_new_tokens") or 8)
    for start in range(0, len(prompts), size):
        engine.generate([Request(request_id=f"p{start + i}", prompt=p, max_new_tokens=new)
                         for i, p in enumerate(prompts[start:start + size])])


@contextmanager
def _quiet() -> Iterator[None]:
    """No arming notice or weight-loading bar: the command's output is its result."""
    from transformers.utils import logging as hf_logging

    logger = logging.getLogger("enginetap")
    level, bars = logger.level, hf_logging.is_progress_bar_enabled()
    logger.setLevel(logging.WARNING)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


def _pick_op(culprit: Culprit, caught: tuple[list, list]) -> tuple[int, int]:
    """The first caught call (in execution order) whose two sides differ in output."""
    from enginetap.jobs.explain_verdict import side_output

    from enginetap.jobs.explain_layout import common_rows

    a, b = culprit.sides
    pairs = list(zip(range(len(caught[0])), range(len(caught[1]))))
    for i, j in pairs:
        if caught[0][i].definition.name != caught[1][j].definition.name:
            continue
        limit = common_rows(caught[0][i].step, a.key, caught[1][j].step, b.key)
        out_a = side_output(caught[0][i], a.key, limit)
        out_b = side_output(caught[1][j], b.key, limit)
        if any(not _same(out_a[k], out_b.get(k)) for k in out_a):
            return i, j
    return pairs[0] if pairs else (0, 0)


def _same(x: Any, y: Any) -> bool:
    import torch

    return y is not None and x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)


def _vllm_dtype(facts: dict) -> str:
    """vLLM's dtype of the recorded run (``auto``: the model's; older headers said ``model``)."""
    dtype = str(facts.get("dtype") or "auto")
    return "auto" if dtype == "model" else dtype
