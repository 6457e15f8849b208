"""The tap job: prompts in batches through one armed engine (built-in or vLLM CPU),
recorded to a folder that ``enginetap tap report``/``diff`` read.

Request ids are ``p<index>`` (index in the prompt list), so runs of the same prompts at
other batch sizes, TP sizes or on the other engine align request by request in
``enginetap tap diff``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from enginetap.config import ArmConfig
from enginetap.errors import ConfigError
from enginetap.jobs.device import require_vllm
from enginetap.jobs.engine import arm_processes, build_llm, resolve_model, write_arming
from enginetap.tap.schema import RUN_FILE

__all__ = ["BUILTIN_PROMPTS", "MAX_PROMPT_BYTES", "PROMPTS_ABOUT", "PROMPT_FILES", "RUN_FILE",
           "arm_tap_processes", "generate_batch", "load_prompts", "prepare_out", "record_run",
           "record_vllm_run", "run_facts", "save_run_command", "tap_config", "vector_options"]

MAX_PROMPT_BYTES = 64 << 20
"""Largest prompt file read."""


BUILTIN_PROMPTS: dict[str, list[str]] = {
    "pairs": ["the cache holds every key", "kernels and caches", "the cache holds every key",
              "a longer prompt about batching requests together", "kernels and caches",
              "decode", "the cache holds every key", "one more request"],
    "short": ["hello", "kernels and caches", "decode one token at a time", "batching"],
}
"""Built-in prompt sets; ``pairs`` repeats prompts so that same-prefix pairs exist."""

PROMPTS_ABOUT: dict[str, str] = {
    "pairs": "8 prompts, 3 of them repeated: same-prefix pairs for `tap report`",
    "short": "4 distinct short prompts: no pairs, a quick run for `tap diff`",
}
"""What each built-in prompt set is for (``enginetap traffic list``)."""

PROMPT_FILES = ('a text file, one prompt per line (blank lines skipped), or a .jsonl file '
                'of {"prompt": "..."} objects, one per line')
"""The prompt-file format ``--prompts FILE`` reads."""


def load_prompts(spec: str) -> list[str]:
    """``builtin:NAME``, a text file (one prompt per line) or a JSONL file of
    ``{"prompt": ...}`` objects.

    Raises:
        ConfigError: an unknown built-in set, an unreadable file, a bad JSONL line
            (named by file and line), or no prompts.
    """
    if spec.startswith("builtin:"):
        name = spec.partition(":")[2]
        if name not in BUILTIN_PROMPTS:
            raise ConfigError(f"unknown built-in prompt set {name!r}",
                              f"there are {', '.join(BUILTIN_PROMPTS)}", "pick one of those")
        return list(BUILTIN_PROMPTS[name])
    from enginetap.core.files import NotRegular, read_capped

    path = Path(spec)
    try:
        lines = read_capped(path, MAX_PROMPT_BYTES).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        why = (f"it {exc}" if isinstance(exc, NotRegular) else "it is not UTF-8 text"
               if isinstance(exc, UnicodeDecodeError) else exc.strerror or str(exc))
        raise ConfigError(f"cannot read prompts from {path}", why,
                          "pass a text file with one prompt per line, or builtin:NAME") from None
    prompts = [_prompt_of(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise ConfigError(f"{path} holds no prompts", "every line is empty",
                          "write one prompt per line")
    return prompts


def vector_options(out: Path, vectors: str, steps: str | None, checkpoints: str | None,
                   requests: str | None) -> dict[str, Any]:
    """``options.tap`` entries for ``tap run``'s vector flags. With checkpoints or requests
    the rows go through a control file written to ``<out>/vector-control.json``.

    Raises:
        ConfigError: an unknown mode, a malformed step window, or flags that do not go
            together.
    """
    if vectors not in ("off", "split"):
        raise ConfigError(f"unknown --vectors {vectors!r}", "vectors are off or split "
                          "(a step window is --vector-steps)", "pass --vectors split, or "
                          "--vector-steps FIRST:LAST")
    narrow = {"checkpoints": _names(checkpoints), "requests": _names(requests)}
    if steps is None:
        if any(narrow.values()):
            raise ConfigError("--vector-checkpoints/--vector-requests need --vector-steps",
                              "they narrow a window of steps", "add --vector-steps FIRST:LAST")
        return {} if vectors == "off" else {"vectors": "split"}
    if vectors != "off":
        raise ConfigError("--vectors split and --vector-steps do not go together",
                          "split writes where pairs split, a window writes those steps",
                          "pass one of them")
    first, sep, last = steps.partition(":")
    try:
        window = [int(first), int(last if sep else first)]
    except ValueError:
        window = []
    if len(window) != 2 or window[0] < 0 or window[1] < window[0]:
        raise ConfigError(f"bad --vector-steps {steps!r}", "it is FIRST:LAST (or one STEP), "
                          "0 ≤ FIRST ≤ LAST", "pass e.g. --vector-steps 3:5")
    if not any(narrow.values()):
        return {"vectors": "window", "vector_steps": window}
    control = out.resolve() / "vector-control.json"
    control.parent.mkdir(parents=True, exist_ok=True)
    control.write_text(json.dumps({"steps": window, **narrow}) + "\n", encoding="utf-8")
    return {"vectors": "control", "vector_control": str(control)}


def _names(text: str | None) -> list[str]:
    return [n.strip() for n in (text or "").split(",") if n.strip()]


def save_run_command(out: Path, command: dict[str, Any]) -> None:
    """Write :data:`RUN_FILE` in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps(command, indent=1) + "\n", encoding="utf-8")


def _prompt_of(path: Path, number: int, line: str) -> str:
    if path.suffix != ".jsonl":
        return line
    from enginetap.core.untrusted_json import BadJson, loads_bounded

    fix = "fix the line or use a plain text file"
    try:
        record = loads_bounded(line)
    except BadJson as exc:
        raise ConfigError(f"bad record at {path}:{number}", str(exc), fix) from None
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        raise ConfigError(f"bad record at {path}:{number}",
                          'a .jsonl prompt file holds {"prompt": "..."} objects', fix)
    return record["prompt"]


def prepare_out(out: Path, *, force: bool = False, name: str = "tap") -> None:
    """Make ``out`` ready for a new run: refuse to replace a previous run's tap files
    unless ``force``, which deletes them (every rank's, so no stale rank is left behind),
    the run's raw-row folders and its ``tap-run.json``, and nothing else in the folder.

    Raises:
        ConfigError: ``out`` is not a directory, or holds a run's tap files and not ``force``.
    """
    if out.exists() and not out.is_dir():
        raise ConfigError(f"cannot record a tap run into {out}", "it is not a directory",
                          "pass a new or existing directory as --out")
    found = sorted(out.glob(f"{name}-rank*.jsonl")) if out.is_dir() else []
    if found and not force:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        raise ConfigError(f"--out {out} holds a previous tap run ({names})",
                          "recording there would replace that run",
                          "pass another --out, or --force to replace that run's tap files "
                          "(nothing else in the folder is touched)")
    for path in found:
        path.unlink()
    if found:  # the replaced run's raw rows and command would be read as the new run's
        import shutil

        for stale in sorted(out.glob(f"{name}-vectors-rank*")):
            if stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale)
        (out / RUN_FILE).unlink(missing_ok=True)


def run_facts(engine: str, model: str, prompts: list[str], *, batch_size: int,
              max_new_tokens: int, dtype: str, device: str = "cpu", tp: int = 1
              ) -> dict[str, Any]:
    """``options.tap.run``: what a run of ``prompts`` was asked, kept in every tap file's
    header so ``enginetap tap explain`` can run it again (a model folder as an absolute
    path: the re-run may start elsewhere)."""
    if not model.startswith("builtin:"):
        model = str(Path(model).expanduser().resolve())
    return {"engine": engine, "model": model, "dtype": dtype, "device": device, "tp": tp,
            "batch_size": batch_size, "max_new_tokens": max_new_tokens,
            "prompts": list(prompts)}


def record_run(model: str, prompts: list[str], out: Path, *, batch_size: int = 8,
               max_new_tokens: int = 8, tap: dict[str, Any] | None = None,
               dtype: str = "float32", device: str = "cpu",
               compile: bool = False, mode: str = "eager") -> list[list[int]]:
    """Generate ``prompts`` in batches of ``batch_size`` on an armed built-in engine on
    ``device`` (``compile``: its decoder stack torch.compiled; ``mode``: HFEngine's),
    writing the tap files to
    ``out``; returns the output tokens in prompt order.

    Raises:
        ConfigError: the model or the tap options are invalid.
    """
    import torch

    from enginetap.core.jsonl import close_all
    from enginetap.engines.hf import HFEngine, Request
    from enginetap.engines.hf.arming import disarm

    tap = {"run": run_facts("builtin", model, prompts, batch_size=batch_size,
                            max_new_tokens=max_new_tokens, dtype=dtype, device=device),
           **(tap or {})}
    kwargs = {"dtype": getattr(torch, dtype), "device": device, "prefix_cache_size": 0,
              "arm": tap_config(out, tap), "compile": compile, "mode": mode}
    try:
        engine = (HFEngine.from_builtin(model.partition(":")[2], **kwargs)
                  if model.startswith("builtin:") else HFEngine(model, **kwargs))
        outputs: list[list[int]] = []
        for start in range(0, len(prompts), batch_size):
            batch = [Request(request_id=f"p{start + i}", prompt=p, max_new_tokens=max_new_tokens)
                     for i, p in enumerate(prompts[start:start + batch_size])]
            outputs.extend(c.output_ids for c in engine.generate(batch))
    finally:
        disarm()
        close_all()
    return outputs


def record_vllm_run(model: str, prompts: list[str], out: Path, *, batch_size: int = 8,
                    max_new_tokens: int = 8, tap: dict[str, Any] | None = None,
                    tp: int = 1, dtype: str = "auto", compile: bool = False) -> list[list[int]]:
    """The same on vLLM CPU (``vllm.LLM`` in this process, greedy, eager (``compile``:
    vLLM's own compiled mode, not ``enforce_eager``), no prefix caching, at most
    ``batch_size`` requests at once): every vLLM process is armed through
    ``ENGINETAP_CONFIG`` (``<out>/arming.json``), one tap file per rank. With ``tp > 1``
    ``VLLM_CPU_OMP_THREADS_BIND`` defaults to ``nobind`` (vLLM's binding needs a NUMA node
    per rank). ``dtype`` is vLLM's (``auto``: the model's).

    Raises:
        ConfigError: the model or the tap options are invalid, or vLLM is not installed
            (checked before anything is written to ``out``).
    """
    require_vllm("tap")  # before anything is written to ``out``
    folder = resolve_model(model)
    tap = {"run": run_facts("vllm", model, prompts, batch_size=batch_size,
                            max_new_tokens=max_new_tokens, dtype=dtype, tp=tp), **(tap or {})}
    from vllm import SamplingParams

    arm_tap_processes(out, tap, tp)
    llm = build_llm(folder, tp=tp, dtype=dtype, enable_prefix_caching=False,
                    max_num_seqs=batch_size, compile=compile)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    try:
        done: dict[str, list[int]] = {}
        for start in range(0, len(prompts), batch_size):
            generate_batch(llm.llm_engine, prompts, start, batch_size, params, done)
        return [done[f"p{i}"] for i in range(len(prompts))]
    finally:
        del llm  # shuts the engine core and its workers down: they flush their writers
        import gc

        gc.collect()


def tap_config(out: Path, tap: dict[str, Any]) -> ArmConfig:
    """The arming config of a tap run: the tap alone (``tap``: its options), no step log.

    Raises:
        pydantic.ValidationError: the tap options are invalid.
    """
    return ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                     options={"tap": tap, "step": {"record": False}})


def arm_tap_processes(out: Path, tap: dict[str, Any], tp: int = 1) -> None:
    """Every engine process started from this one (and this one) taps into ``out``,
    armed through ``<out>/arming.json``."""
    arm_processes(write_arming(tap_config(out, tap), out / "arming.json"), tp)


def generate_batch(engine: Any, prompts: list[str], start: int, size: int, params: Any,
                   done: dict[str, list[int]]) -> None:
    """Requests ``p<start>``... as one batch, stepped until all finished (ids like the
    built-in engine's, so runs align across engines)."""
    for i, prompt in enumerate(prompts[start:start + size], start):
        engine.add_request(f"p{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)


def record_sglang_run(model: str, prompts: list[str], out: Path, *, batch_size: int = 8,
                      max_new_tokens: int = 8, tap: dict[str, Any] | None = None,
                      dtype: str = "auto") -> list[list[int]]:
    """``enginetap tap run --engine sglang``: ``prompts`` through ``sglang.Engine`` in this
    process, every SGLang process armed through ``ENGINETAP_CONFIG``
    (``<out>/arming.json``); request ids are ``p<index>`` (SGLang keeps the caller's
    ``rid``), so runs of the same prompts on the built-in engine or vLLM align request by
    request in ``tap diff``. Greedy, radix cache off (identical prompts are computed), at
    most ``batch_size`` requests at once (``dtype``: SGLang's, ``auto`` the model's);
    returns the output tokens.

    Raises:
        ConfigError: SGLang is missing or another version, the model is not a folder of
            an architecture enginetap covers on SGLang, or the tap options are invalid.
    """
    from enginetap.engines.sglang.launch import check_sglang, engine_kwargs
    from enginetap.engines.sglang.run import check_engine, stop_engine

    check_sglang()  # before the model is resolved (a built-in one is built)
    model_dir = resolve_model(model)
    check_engine(model_dir)
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                       options={"tap": tap or {}, "step": {"record": False}})
    arm_processes(write_arming(config, out / "arming.json"))
    import sglang

    engine = sglang.Engine(**engine_kwargs(model_dir, max_running_requests=batch_size,
                                           tokenizer=True, dtype=dtype))
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    try:
        outputs: list[list[int]] = []
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            done = engine.generate(prompt=chunk, sampling_params=params,
                                   rid=[f"p{start + i}" for i in range(len(chunk))])
            outputs.extend(list(d["output_ids"]) for d in done)
        return outputs
    finally:
        stop_engine(engine)  # the scheduler exits in order: its writers flush
