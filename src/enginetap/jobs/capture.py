"""The capture job: drive an engine with a traffic profile while capture is armed.

Everything is checked before the engine starts (model, profile, definition names, the
output directory), so bad input is one clear error and nothing is written. The dataset
root holds the FlashInfer-Trace files; the run's own files go under ``<root>/enginetap/``:

- ``capture-run.json``: the job's status (``running``, then ``complete`` or ``failed``
  with the reason) — a dataset whose last run did not complete is marked as such;
- ``arming.json``: the arming config used; ``capture-labels.json``: request labels;
- ``capture-summary-rank<r>.json``: what each rank captured, dropped and why;
- ``traffic.json``: the traffic run's receipts (one per request sent).

An existing dataset as ``out`` is refused unless the job says what to do with it
(``existing``): ``"append"`` adds this run's workloads to those already there (the same
traffic gives the same workloads again) and moves the previous run's files to
``<root>/enginetap/previous/run-<n>/`` (n = 1, 2, ...), so no run's record is overwritten;
``"replace"`` starts the dataset afresh: its ``definitions/``, ``workloads/``, ``blob/`` and
``enginetap/`` are removed first, anything else in the directory is left.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from enginetap.capture.labels import write_labels
from enginetap.capture.summary import CaptureSummary
from enginetap.config import ArmConfig
from enginetap.errors import ConfigError
from enginetap.jobs.device import require_vllm
from enginetap.jobs.engine import arm_processes, build_llm, resolve_model, write_arming

__all__ = ["CaptureJob", "CaptureResult", "RUN_DIR", "run_capture"]

RUN_DIR = "enginetap"
Engine = Literal["builtin", "vllm", "sglang"]


@dataclass
class CaptureJob:
    """What to capture: an engine, a model, a profile, an output dataset."""

    engine: Engine
    model: str
    """A model directory or ``builtin:NAME``."""
    profile: str
    """A profile file, ``builtin:NAME``, ``mooncake:FILE`` or ``agentx:FILE``."""
    out: Path
    definitions: list[str] = field(default_factory=list)
    policy: str = "default"
    tp: int = 1
    max_output_tokens: int = 32
    seed: int | None = None
    existing: Literal["refuse", "append", "replace"] = "refuse"
    """What to do when ``out`` already holds a dataset (see the module docstring)."""
    progress: bool | str = True
    """A progress bar (True), plain progress lines (``"lines"``) or nothing (False)."""
    device: str = "cpu"
    """Where the built-in engine runs its model (``cpu``, ``cuda``, ``cuda:N``); vLLM
    chooses its own (see :mod:`enginetap.jobs.device`)."""
    dtype: str | None = None
    """The engine's dtype: the built-in engine's default is bfloat16, vLLM's ``auto``."""


@dataclass
class CaptureResult:
    dataset: Path
    summaries: list[CaptureSummary]
    receipts: int
    status: str


def run_capture(job: CaptureJob, *, on_engine: Callable[[Any], None] | None = None
                ) -> CaptureResult:
    """Run ``job``; returns what was captured.

    Raises:
        ConfigError, TrafficError, DefinitionError: bad input, before anything is written.
    """
    model_dir = resolve_model(job.model)
    if job.engine == "sglang":
        from enginetap.engines.sglang.run import check_engine

        check_engine(model_dir)
    _check_definitions(job, model_dir)
    profile = _profile(job, model_dir)
    if job.engine == "vllm":
        require_vllm("capture")
    run_dir = _prepare_out(job.out, job.existing)
    config = ArmConfig(enabled=True, capabilities=["capture"], out_dir=run_dir, options={
        "capture": {"dataset": str(job.out.resolve()), "definitions": job.definitions,
                    "policy": job.policy, "labels_file": str(run_dir / "capture-labels.json")},
        # the step log of the captured steps only: a step capture skips costs nothing
        "step": {"record": "selected"}})
    write_arming(config, run_dir / "arming.json")
    _status(run_dir, "running", job)
    try:
        runner = {"builtin": _run_builtin, "sglang": _run_sglang}.get(job.engine, _run_vllm)
        report = runner(job, model_dir, profile, config, run_dir, on_engine)
    except BaseException as exc:
        _status(run_dir, "failed", job, f"{type(exc).__name__}: {exc}")
        raise
    (run_dir / "traffic.json").write_text(report.model_dump_json(indent=2) + "\n")
    summaries = _summaries(run_dir)
    failed = [s for s in summaries if s.write_error]
    status = "failed" if failed or not summaries else "complete"
    _status(run_dir, status, job, failed[0].write_error if failed else
            "" if summaries else "no capture summary was written")
    return CaptureResult(job.out, summaries, len(report.receipts), status)


# ---------------------------------------------------------------------- checks
def _check_definitions(job: CaptureJob, model_dir: Path) -> None:
    """Every ``--definitions`` entry must name a family or definition this model runs."""
    from enginetap.definitions.base import family_of
    from enginetap.definitions.catalog import definitions_for_model

    engine = "transformers" if job.engine == "builtin" else "vllm"
    known = definitions_for_model(model_dir, engine=engine)
    names = {d.name for d in known} | {family_of(d) or "" for d in known}
    unknown = [n for n in job.definitions if n not in names]
    if unknown:
        raise ConfigError(f"unknown definition(s) {', '.join(unknown)} for this model",
                          f"it runs {', '.join(sorted(n for n in names if n))}",
                          "name families or definitions from that list")


VLLM_MAX_LEN = 2048


def _profile(job: CaptureJob, model_dir: Path) -> Any:
    """The traffic profile, fit to the model's context (read from its config.json)."""
    from enginetap.traffic.scaling import fit_to_context
    from enginetap.traffic.sources import resolve_profile

    try:
        config = json.loads((model_dir / "config.json").read_text())
        context = int(config["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read the context length of {model_dir}", repr(exc),
                          "give a model whose config.json has max_position_embeddings"
                          ) from None
    if job.engine in ("vllm", "sglang"):
        context = min(context, VLLM_MAX_LEN)
    profile = resolve_profile(job.profile, max_context=context,
                              max_output_tokens=job.max_output_tokens, seed=job.seed)
    # built-in profiles come fitted with their own output cap: apply the job's too
    return fit_to_context(profile, context, job.max_output_tokens)


def _prepare_out(out: Path, existing: str = "refuse") -> Path:
    """The run directory under ``out``; ``out`` is new, empty, or an enginetap dataset
    (then ``existing`` says whether to append to it or replace it; see the module doc)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"cannot capture into {out}", "it is a link or not a directory",
                          "pass a new directory (or an existing dataset) as --out")
    is_dataset = (out / "definitions").is_dir() or (out / RUN_DIR).is_dir()
    if out.exists() and any(out.iterdir()) and not is_dataset:
        raise ConfigError(f"cannot capture into {out}",
                          "it is a non-empty directory that is not a dataset",
                          "pass a new directory, or a dataset to add workloads to")
    run_dir = out / RUN_DIR
    if is_dataset:
        _make_room(out, run_dir, existing)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"cannot write to {out}", exc.strerror or str(exc),
                          "choose a writable --out directory") from None
    return run_dir


def _make_room(out: Path, run_dir: Path, existing: str) -> None:
    """Refuse an existing dataset, or make room in it for this run (append or replace)."""
    if existing == "refuse":
        count = sum(1 for _ in (out / "definitions").glob("*/*.json"))
        last = _last_status(run_dir)
        raise ConfigError(
            f"--out {out} is an existing dataset ({count} definition(s){last})",
            "capturing again would add this run's workloads to those already there (the same "
            "traffic gives the same workloads again) and replace the previous run's records",
            "pass --append to add to it (the previous run's records are kept under "
            f"{RUN_DIR}/previous/), --force to start it afresh, or another --out")
    try:
        if existing == "replace":
            for name in ("definitions", "workloads", "blob", RUN_DIR):
                if (out / name).is_dir() and not (out / name).is_symlink():
                    shutil.rmtree(out / name)
        elif run_dir.is_dir():
            _keep_previous_run(run_dir)
    except OSError as exc:
        raise ConfigError(f"cannot prepare {out} for this capture", exc.strerror or str(exc),
                          "check the directory's permissions") from None


def _last_status(run_dir: Path) -> str:
    try:
        return f", last capture {json.loads((run_dir / 'capture-run.json').read_text())['status']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def _keep_previous_run(run_dir: Path) -> None:
    """Move the previous run's files to ``previous/run-<n>/`` (the next free n)."""
    files = [p for p in run_dir.iterdir() if p.name != "previous"]
    if not files:
        return
    n = 1
    while (run_dir / "previous" / f"run-{n}").exists():
        n += 1
    kept = run_dir / "previous" / f"run-{n}"
    kept.mkdir(parents=True)
    for path in files:
        path.rename(kept / path.name)


def _status(run_dir: Path, status: str, job: CaptureJob, reason: str = "") -> None:
    record = {"status": status, "reason": reason, "engine": job.engine, "model": job.model,
              "profile": job.profile, "policy": job.policy, "definitions": job.definitions,
              "tp": job.tp, "device": job.device if job.engine == "builtin" else None,
              "dtype": job.dtype,
              "command_line": list(sys.argv),
              "at": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    partial = run_dir / ".capture-run.json.partial"
    partial.write_text(json.dumps(record, indent=2) + "\n")
    partial.replace(run_dir / "capture-run.json")


def _summaries(run_dir: Path) -> list[CaptureSummary]:
    return [CaptureSummary.read(p) for p in sorted(run_dir.glob("capture-summary-rank*.json"))]


# ---------------------------------------------------------------------- engines
def _labeller(run_dir: Path, profile_name: str) -> Callable[[str, Sequence[Any]], None]:
    labels: dict[str, dict[str, Any]] = {}

    def on_send(unit: str, batch: Sequence[Any]) -> None:
        for sub in batch:
            labels[sub.key] = {"label": sub.label, "unit": unit, "role": sub.role,
                               "profile": profile_name, "source": sub.source,
                               "input_tokens": len(sub.prompt_ids),
                               "output_tokens": sub.max_tokens}
        write_labels(run_dir / "capture-labels.json", labels)

    return on_send


def _run_builtin(job: CaptureJob, model_dir: Path, profile: Any, config: ArmConfig,
                 run_dir: Path, on_engine: Callable[[Any], None] | None) -> Any:
    import torch

    from enginetap.engines.hf import HFEngine
    from enginetap.engines.hf.arming import disarm
    from enginetap.traffic.drivers import BuiltinDriver
    from enginetap.traffic.runner import run_profile

    dtype = getattr(torch, job.dtype or "bfloat16")
    engine = HFEngine(model_dir, device=job.device, dtype=dtype, arm=config)
    try:
        runtime = engine.arming.context.notes.get("capture") if engine.arming else None
        if runtime is None or not runtime.installed_targets:
            raise ConfigError(f"no capture probe matches the model in {model_dir}",
                              "the built-in engine's probes do not cover its layers",
                              "capture a model of a supported architecture "
                              "(`enginetap models list`)")
        if on_engine is not None:
            on_engine(engine)
        return run_profile(profile, BuiltinDriver(engine), progress=job.progress,
                           on_send=_labeller(run_dir, profile.name))
    finally:
        disarm()


def _run_vllm(job: CaptureJob, model_dir: Path, profile: Any, config: ArmConfig,
              run_dir: Path, on_engine: Callable[[Any], None] | None) -> Any:
    from enginetap.traffic.drivers import VLLMDriver
    from enginetap.traffic.runner import run_profile

    arm_processes(run_dir / "arming.json", job.tp)
    llm = build_llm(model_dir, tp=job.tp, dtype=job.dtype or "auto",
                    max_model_len=VLLM_MAX_LEN, enable_prefix_caching=True)
    try:
        if on_engine is not None:
            on_engine(llm)
        return run_profile(profile, VLLMDriver(llm), progress=job.progress,
                           on_send=_labeller(run_dir, profile.name))
    finally:
        del llm  # shuts the engine core and its workers down: they flush their writers
        import gc

        gc.collect()


def _run_sglang(job: CaptureJob, model_dir: Path, profile: Any, config: ArmConfig,
                run_dir: Path, on_engine: Callable[[Any], None] | None) -> Any:
    """``sglang.Engine`` in this process (radix cache on), its scheduler armed through
    ``ENGINETAP_CONFIG`` (SGLang's plugin entry point)."""
    from enginetap.engines.sglang.run import start_engine, stop_engine
    from enginetap.traffic.drivers import SGLangDriver
    from enginetap.traffic.runner import run_profile

    if job.tp > 1:
        raise ConfigError("--tp needs --engine vllm", "enginetap's SGLang probes capture TP=1",
                          "drop --tp")
    arm_processes(run_dir / "arming.json")
    engine = start_engine(model_dir, dtype=job.dtype or "auto")
    try:
        if on_engine is not None:
            on_engine(engine)
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        return run_profile(profile, SGLangDriver(engine, VLLM_MAX_LEN, vocab),
                           progress=job.progress, on_send=_labeller(run_dir, profile.name))
    finally:
        stop_engine(engine)  # the scheduler exits in order: its capture writer flushes
