"""``enginetap tap run --engine sglang``: prompts through ``sglang.Engine`` in this
process, every SGLang process armed through ``ENGINETAP_CONFIG`` (``<out>/arming.json``).

Request ids are ``p<index>`` (SGLang keeps the caller's ``rid``), so runs of the same
prompts on the built-in engine or vLLM align request by request in ``tap diff``.
Greedy, radix cache off (identical prompts are computed), at most ``batch_size``
requests at once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from enginetap.errors import ConfigError

__all__ = ["SGLangDriver", "check_engine", "record_sglang_run", "start_engine", "stop_engine"]


def record_sglang_run(model: str, prompts: list[str], out: Path, *, batch_size: int = 8,
                      max_new_tokens: int = 8, tap: dict[str, Any] | None = None,
                      dtype: str = "auto") -> list[list[int]]:
    """Generate ``prompts`` on an armed SGLang engine (``dtype``: SGLang's, ``auto`` the
    model's); returns the output tokens.

    Raises:
        ConfigError: SGLang is missing or another version, the model is not a folder of
            an architecture enginetap covers on SGLang, or the tap options are invalid.
    """
    from enginetap.config import ARMING_VARS, ArmConfig
    from enginetap.engines.sglang.launch import (COVERED, architecture, check_sglang,
                                                 engine_kwargs)

    check_sglang()
    model_dir = _model_dir(model)
    arch = architecture(model_dir)
    if arch not in COVERED:
        raise ConfigError(f"{arch} is not covered by enginetap on SGLang",
                          f"enginetap's SGLang path covers {', '.join(COVERED)}",
                          "use one of those models, or --engine builtin")
    config = ArmConfig(enabled=True, capabilities=["tap"], out_dir=out,
                       options={"tap": tap or {}, "step": {"record": False}})
    out.mkdir(parents=True, exist_ok=True)
    (out / "arming.json").write_text(config.model_dump_json(), encoding="utf-8")
    for name in ARMING_VARS:
        os.environ.pop(name, None)
    os.environ["ENGINETAP_CONFIG"] = str(out / "arming.json")
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


def _model_dir(model: str) -> Path:
    if model.startswith("builtin:"):
        from enginetap.models import build_model

        return Path(build_model(model.partition(":")[2]))
    return Path(model)


class SGLangDriver:
    """``sglang.Engine`` in this process as a traffic driver (greedy, ``ignore_eos``): a
    batch is one ``generate`` call with the submissions' keys as request ids (SGLang keeps
    them, so step records and capture receipts name the profile's requests);
    ``flush_cache`` between profiles."""

    name = "sglang"

    def __init__(self, engine: Any, max_context: int, vocab_size: int) -> None:
        self.engine, self.max_context, self.vocab_size = engine, max_context, vocab_size

    def prompts(self, seed: int) -> Any:
        from enginetap.traffic.prompts import PromptBuilder

        return PromptBuilder(seed, vocab_size=self.vocab_size)

    def reset_prefix_cache(self, attempts: int = 40) -> None:
        import time

        from enginetap.errors import TrafficError

        for _ in range(attempts):  # SGLang flushes only once its scheduler is idle
            if getattr(self.engine.flush_cache(), "success", True) is not False:
                return
            time.sleep(0.25)
        raise TrafficError("SGLang did not flush its radix cache",
                           f"its scheduler was busy {attempts} times",
                           "let running requests finish before the next profile")

    def submit(self, batch: Any) -> list[Any]:
        import time

        from enginetap.traffic.drivers import Outcome

        started = time.time()
        params = [{"max_new_tokens": s.max_tokens, "temperature": 0.0, "ignore_eos": True}
                  for s in batch]
        done = self.engine.generate(input_ids=[s.prompt_ids for s in batch],
                                    rid=[s.key for s in batch], sampling_params=params)
        finished = time.time()
        out = []
        for s, d in zip(batch, done):
            meta = d.get("meta_info") or {}
            reason = meta.get("finish_reason")
            out.append(Outcome(s.key, list(d["output_ids"]),
                               reason.get("type") if isinstance(reason, dict) else reason,
                               started, finished, meta.get("cached_tokens")))
        return out


def stop_engine(engine: Any, grace: float = 30.0) -> None:
    """Shut ``engine`` down so that its scheduler processes flush what enginetap armed there.

    ``Engine.shutdown`` ends its processes with SIGKILL: a capture writer in the scheduler
    would lose what it had not written, and its summary. The scheduler processes this
    engine started get SIGTERM first (the capture runtime turns it into an orderly exit
    that flushes the writer and writes the summary), up to ``grace`` seconds; then the
    engine shuts down as usual."""
    import signal
    import time

    import psutil

    schedulers = [p for p in psutil.Process().children(recursive=True)
                  if "scheduler" in " ".join(_names(p))]
    for proc in schedulers:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            continue
    deadline = time.monotonic() + grace
    for proc in schedulers:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except (psutil.TimeoutExpired, psutil.NoSuchProcess):
            continue
    engine.shutdown()


def _names(proc: Any) -> list[str]:
    import psutil

    try:
        return [proc.name(), *proc.cmdline()]
    except psutil.Error:  # it ended meanwhile, or is not ours to read
        return []


def check_engine(model_dir: Path) -> None:
    """One clear line before anything starts: SGLang missing or another version, or a
    model whose architecture enginetap's SGLang path does not cover.

    Raises:
        ConfigError: as said.
    """
    from enginetap.engines.sglang.launch import COVERED, architecture, check_sglang

    check_sglang()
    arch = architecture(model_dir)
    if arch not in COVERED:
        raise ConfigError(f"{arch} is not covered by enginetap on SGLang",
                          f"enginetap's SGLang path covers {', '.join(COVERED)}",
                          "use one of those models, or another engine")


def start_engine(model_dir: Path, *, max_running_requests: int = 8,
                 radix_cache: bool = True, dtype: str = "auto") -> Any:
    """``sglang.Engine`` for ``model_dir`` with enginetap's CPU settings (after
    :func:`check_engine`)."""
    from enginetap.engines.sglang.launch import engine_kwargs

    check_engine(model_dir)
    import sglang

    return sglang.Engine(**engine_kwargs(model_dir, max_running_requests=max_running_requests,
                                         radix_cache=radix_cache, dtype=dtype))
