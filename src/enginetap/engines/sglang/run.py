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

__all__ = ["record_sglang_run"]


def record_sglang_run(model: str, prompts: list[str], out: Path, *, batch_size: int = 8,
                      max_new_tokens: int = 8, tap: dict[str, Any] | None = None
                      ) -> list[list[int]]:
    """Generate ``prompts`` on an armed SGLang engine; returns the output tokens.

    Raises:
        ConfigError: SGLang is missing or another version, the model is not a folder of
            an architecture enginetap covers on SGLang, or the tap options are invalid.
    """
    from enginetap.config import ARMING_VARS, ArmConfig
    from enginetap.engines.sglang.launch import COVERED, architecture, check_sglang, engine_kwargs

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
                                           tokenizer=True))
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
        engine.shutdown()  # the scheduler exits: its writers flush


def _model_dir(model: str) -> Path:
    if model.startswith("builtin:"):
        from enginetap.models import build_model

        return Path(build_model(model.partition(":")[2]))
    return Path(model)
