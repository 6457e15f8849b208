"""What every job does to get an engine: find the model, arm the engine's processes, build
vLLM's ``LLM``.

A job arms engines that start their own processes (vLLM's engine core and workers,
SGLang's scheduler) through the environment: the arming config is written to a file and
``ENGINETAP_CONFIG`` points at it, so every process started from here arms itself from
it when the engine loads enginetap's plugin. The built-in engine takes the config directly.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from enginetap.config import ARMING_VARS, ArmConfig
from enginetap.errors import ConfigError

__all__ = ["arm_processes", "build_llm", "resolve_model", "write_arming"]


def resolve_model(model: str) -> Path:
    """The folder of ``model``: ``builtin:NAME`` built (once, then cached), else the folder
    given (``~`` expanded).

    Raises:
        ConfigError: an unknown built-in name, or a folder without a ``config.json``.
    """
    if model.startswith("builtin:"):
        from enginetap.models import build_model

        return Path(build_model(model.partition(":")[2]))
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError(f"no model at {model}", "the directory has no config.json",
                          "pass a model directory or builtin:NAME (`enginetap models list`)")
    return path


def write_arming(config: ArmConfig, path: Path) -> Path:
    """Save ``config`` (the arming config a run used, kept beside what it wrote)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.model_dump_json(indent=2) + "\n", encoding="utf-8")
    return path


def arm_processes(config_file: Path, tp: int = 1) -> None:
    """Arm every engine process started from this one (and this one) with the config in
    ``config_file``: the other arming variables are cleared so none overrides it. With
    ``tp > 1`` ``VLLM_CPU_OMP_THREADS_BIND`` defaults to ``nobind`` (vLLM CPU's binding
    needs a NUMA node per rank)."""
    for name in ARMING_VARS:
        os.environ.pop(name, None)
    os.environ["ENGINETAP_CONFIG"] = str(config_file)
    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def build_llm(model: Path, *, tp: int = 1, dtype: str = "auto", compile: bool = False,
              **engine_args: Any) -> Any:
    """``vllm.LLM`` of ``model`` as the jobs run it: eager (``enforce_eager``; ``compile``:
    vLLM's own compiled mode, where the tap places its checkpoints in the graph), seed 0, 30% of a GPU's
    memory on a GPU build; ``engine_args`` go to vLLM as they are. Check that vLLM
    imports first (:func:`~enginetap.jobs.device.require_vllm`, before anything is
    written), then arm (:func:`arm_processes`): its processes read the arming as they
    start."""
    from vllm import LLM

    return LLM(model=str(model), tensor_parallel_size=tp, gpu_memory_utilization=0.3,
               enforce_eager=not compile, seed=0, dtype=dtype, **engine_args)
