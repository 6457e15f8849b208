"""Starting SGLang the way enginetap's runs and tests do (in process or as a server).

On the CPU (no CUDA device) SGLang 0.5.23 needs ``SGLANG_USE_CPU_ENGINE=1`` and, without
its kernel package, enginetap's ``sgl_kernel`` stand-in (``make install-sglang``);
:func:`cpu_environment` sets the environment, :func:`engine_kwargs` the engine arguments:
torch-native attention (the AMX backend needs the real kernels), no CUDA graphs, no
overlap scheduling (SGLang's no-buffer mamba cache refuses it), Qwen3-Next's mamba radix
cache without state snapshots (``no_buffer``; CPU platforms have none), a small KV pool.

:func:`check_sglang` turns "SGLang is missing / another version" into one clear line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from enginetap.errors import ConfigError

__all__ = ["HYBRID", "check_sglang", "cpu_environment", "engine_kwargs", "server_args"]

HYBRID = ("Qwen3NextForCausalLM",)
"""Architectures with a recurrent-state (mamba) pool beside the KV cache."""

COVERED = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
           "Qwen3NextForCausalLM", "DeepseekV3ForCausalLM")
"""Architectures enginetap's SGLang CPU path and probes were written and tested for."""


def check_sglang() -> str:
    """SGLang's version. Raises ConfigError: not installed, or not a supported version."""
    from importlib.metadata import PackageNotFoundError, version

    from enginetap.engines.sglang.plugin import SUPPORTED

    try:
        found = version("sglang")
    except PackageNotFoundError:
        raise ConfigError("SGLang is not installed", "--engine sglang runs sglang.Engine",
                          "pip install enginetap[sglang] (GPU), or make install-sglang and "
                          "use .venv-sglang (CPU)") from None
    if found not in SUPPORTED:
        raise ConfigError(f"SGLang {found} is not a supported version",
                          f"enginetap's SGLang hooks were written for {', '.join(SUPPORTED)}",
                          f"install sglang=={SUPPORTED[-1]}; `enginetap guard check` on the "
                          "SGLang lock names the functions that changed")
    return found


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def cpu_environment() -> bool:
    """Set SGLang's CPU switches where there is no CUDA device; True if on the CPU."""
    os.environ.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "0")
    os.environ.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "0")
    if _cuda():
        return False
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    # moe/topk.py compiles its router with torch.compile: ~30 s on the first step here
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    return True


def architecture(model: str | Path) -> str:
    """The model folder's architecture (``config.json``). Raises ConfigError."""
    path = Path(model) / "config.json"
    try:
        return str(json.loads(path.read_text(encoding="utf-8"))["architectures"][0])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        raise ConfigError(f"{model} is not a model folder", f"cannot read {path}",
                          "pass a folder with a config.json (enginetap models build NAME)"
                          ) from None


def engine_kwargs(model: str | Path, *, max_running_requests: int = 8, dtype: str = "auto",
                  seed: int = 0, radix_cache: bool = False, tokenizer: bool = False
                  ) -> dict[str, Any]:
    """``sglang.Engine`` arguments for ``model`` on this machine (see the module doc)."""
    on_cpu = cpu_environment()
    arch = architecture(model)
    kwargs: dict[str, Any] = {
        "model_path": str(model), "skip_tokenizer_init": not tokenizer, "dtype": dtype,
        "random_seed": seed, "max_running_requests": max_running_requests,
        "disable_radix_cache": not radix_cache, "log_level": "error"}
    if on_cpu:
        kwargs.update(device="cpu", attention_backend="torch_native", disable_cuda_graph=True,
                      disable_overlap_schedule=True, mem_fraction_static=_cpu_fraction(),
                      max_total_tokens=4096)
        if arch in HYBRID:
            kwargs["mamba_radix_cache_strategy"] = "no_buffer"
    return kwargs


def _cpu_fraction() -> float:
    """SGLang's ``mem_fraction_static`` on the CPU: the fraction of the machine's memory
    the engine may hold, counted from the memory in use when it starts (other processes
    included), so it must exceed the share already taken; the KV pool itself is capped by
    ``max_total_tokens``."""
    try:
        info = dict(line.split(":", 1) for line in
                    Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        total = int(info["MemTotal"].split()[0])
        available = int(info["MemAvailable"].split()[0])
    except (OSError, KeyError, ValueError):
        return 0.5
    return round(min(0.95, max(0.1, 1 - available / total + 0.08)), 3)


def server_args(model: str | Path, port: int, **options: Any) -> list[str]:
    """``python -m sglang.launch_server`` arguments equal to :func:`engine_kwargs` (radix
    cache on: a server's prefix reuse is what traffic profiles exercise)."""
    args = ["--port", str(port), "--host", "127.0.0.1"]
    options.setdefault("radix_cache", True)
    for key, value in engine_kwargs(model, **options).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False:
            args += [flag, str(value)]
    return args
