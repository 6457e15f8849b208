"""Recording a tap run: prompts in batches, one armed engine (built-in or vLLM CPU).

Request ids are ``p<index>`` (index in the prompt list), so runs of the same prompts at
other batch sizes, TP sizes or on the other engine align request by request in
``enginetap tap diff``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from enginetap.errors import ConfigError

__all__ = ["BUILTIN_PROMPTS", "load_prompts", "record_run", "record_vllm_run", "run_facts"]

BUILTIN_PROMPTS: dict[str, list[str]] = {
    "pairs": ["the cache holds every key", "kernels and caches", "the cache holds every key",
              "a longer prompt about batching requests together", "kernels and caches",
              "decode", "the cache holds every key", "one more request"],
    "short": ["hello", "kernels and caches", "decode one token at a time", "batching"],
}
"""Built-in prompt sets; ``pairs`` repeats prompts so that same-prefix pairs exist."""


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
    path = Path(spec)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read prompts from {path}", exc.strerror or str(exc),
                          "pass a text file with one prompt per line, or builtin:NAME") from None
    prompts = [_prompt_of(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not prompts:
        raise ConfigError(f"{path} holds no prompts", "every line is empty",
                          "write one prompt per line")
    return prompts


def _prompt_of(path: Path, number: int, line: str) -> str:
    if path.suffix != ".jsonl":
        return line
    try:
        prompt = json.loads(line)["prompt"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ConfigError(f"{path}:{number}: not a prompt line",
                          'a .jsonl prompt file holds {"prompt": "..."} objects',
                          "fix the line or use a plain text file") from None
    return str(prompt)


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
               dtype: str = "float32") -> list[list[int]]:
    """Generate ``prompts`` in batches of ``batch_size`` on an armed built-in engine,
    writing the tap files to ``out``; returns the output tokens in prompt order.

    Raises:
        ConfigError: the model or the tap options are invalid.
    """
    import torch

    from enginetap.config import ArmConfig
    from enginetap.core.jsonl import close_all
    from enginetap.engines.hf import HFEngine, Request
    from enginetap.engines.hf.arming import disarm

    tap = {"run": run_facts("builtin", model, prompts, batch_size=batch_size,
                            max_new_tokens=max_new_tokens, dtype=dtype), **(tap or {})}
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                       options={"tap": tap, "step": {"record": False}})
    kwargs = {"dtype": getattr(torch, dtype), "prefix_cache_size": 0, "arm": config}
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
                    tp: int = 1) -> list[list[int]]:
    """The same on vLLM CPU (``vllm.LLM`` in this process, greedy, eager, no prefix
    caching, at most ``batch_size`` requests at once): every vLLM process is armed through
    ``ENGINETAP_CONFIG`` (``<out>/arming.json``), one tap file per rank. With ``tp > 1``
    ``VLLM_CPU_OMP_THREADS_BIND`` defaults to ``nobind`` (vLLM's binding needs a NUMA node
    per rank).

    Raises:
        ConfigError: the model or the tap options are invalid, or vLLM is not installed.
    """
    model_dir = _model_dir(model)
    tap = {"run": run_facts("vllm", model, prompts, batch_size=batch_size,
                            max_new_tokens=max_new_tokens, dtype="model", tp=tp), **(tap or {})}
    _arm_vllm_processes(out, tap, tp)
    try:
        from vllm import LLM, SamplingParams
    except ImportError:
        raise ConfigError("vLLM is not installed", "--engine vllm runs vllm.LLM",
                          "pip install enginetap[vllm]") from None
    llm = LLM(model=str(model_dir), tensor_parallel_size=tp, gpu_memory_utilization=0.3,
              enforce_eager=True, enable_prefix_caching=False, max_num_seqs=batch_size,
              seed=0)
    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0)
    try:
        done: dict[str, list[int]] = {}
        for start in range(0, len(prompts), batch_size):
            _generate_batch(llm.llm_engine, prompts, start, batch_size, params, done)
        return [done[f"p{i}"] for i in range(len(prompts))]
    finally:
        del llm  # shuts the engine core and its workers down: they flush their writers
        import gc

        gc.collect()


def _arm_vllm_processes(out: Path, tap: dict[str, Any], tp: int) -> None:
    """This process's environment arms every vLLM process it starts (and itself)."""
    from enginetap.config import ARMING_VARS, ArmConfig

    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                       options={"tap": tap, "step": {"record": False}})
    out.mkdir(parents=True, exist_ok=True)
    (out / "arming.json").write_text(config.model_dump_json(), encoding="utf-8")
    for name in ARMING_VARS:
        os.environ.pop(name, None)
    os.environ["ENGINETAP_CONFIG"] = str(out / "arming.json")
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def _model_dir(model: str) -> Path:
    if model.startswith("builtin:"):
        from enginetap.models import build_model

        return Path(build_model(model.partition(":")[2]))
    return Path(model)


def _generate_batch(engine: Any, prompts: list[str], start: int, size: int, params: Any,
                    done: dict[str, list[int]]) -> None:
    """Requests ``p<start>``... as one batch, stepped until all finished (ids like the
    built-in engine's, so runs align across engines)."""
    for i, prompt in enumerate(prompts[start:start + size], start):
        engine.add_request(f"p{i}", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
