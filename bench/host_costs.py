"""Host cost of each operation on the engine thread's armed hot paths, on this machine.

    PYTHONPATH=src python bench/host_costs.py [--device cuda] [--rows 32]

The tap's checkpoint and capture's step listeners are a few dozen Python-level operations
each; on some hosts they cost several times what they cost on others. This prints, per
operation, the median host time of one call over many, and its ratio to an empty Python
function call measured in the same run (a machine-independent figure): the tensor
attribute reads a checkpoint makes, the compile/graph-capture checks, a call through a
wrapt wrapper and through an enginetap patch, and the core step recorder's line split
into its parts (the step as JSON-ready data, its encoding, the ``write`` to a file in the
temporary directory and in ``/dev/shm``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import wrapt

from enginetap.core.context import Step
from enginetap.core.jsonl import encode_line_bytes
from enginetap.core.patching import Patch, Target
from enginetap.core.recorder import StepRecorder


def per_call_us(call: Callable[[], Any], calls: int, repeats: int = 7) -> float:
    """Median over ``repeats`` of the mean host microseconds of ``call`` in a loop."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - began) / calls * 1e6)
    return statistics.median(times)


class Module:
    def forward(self, x: Any) -> Any:
        return x


def _through(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    return wrapped(*args, **kwargs)


def wrapper_costs(calls: int) -> dict[str, float]:
    module, found = Module(), {}
    found["method call, unwrapped"] = per_call_us(lambda: module.forward(1), calls)
    Module.forward = wrapt.FunctionWrapper(Module.__dict__["forward"], _through)
    found["method call through wrapt"] = per_call_us(lambda: module.forward(1), calls)
    Module.forward = Module.forward.__wrapped__
    patch = Patch(Target.parse(f"{__name__}:Module.forward"), _through).install()
    try:
        found["method call through an enginetap Patch"] = per_call_us(
            lambda: module.forward(1), calls)
    finally:
        patch.uninstall()
    return found


def tensor_costs(device: str, calls: int) -> dict[str, float]:
    with torch.inference_mode():
        tensor = torch.zeros(64, 5120, dtype=torch.bfloat16, device=device)
    found = {
        "tensor.get_device()": per_call_us(lambda: tensor.get_device(), calls),
        "tensor.is_contiguous()": per_call_us(lambda: tensor.is_contiguous(), calls),
        "tensor.requires_grad": per_call_us(lambda: tensor.requires_grad, calls),
        "tensor.shape": per_call_us(lambda: tensor.shape, calls),
        "tensor.nbytes": per_call_us(lambda: tensor.nbytes, calls),
        "tensor.data_ptr()": per_call_us(lambda: tensor.data_ptr(), calls),
        "tensor.is_inference()": per_call_us(lambda: tensor.is_inference(), calls),
        "torch.compiler.is_compiling()": per_call_us(torch.compiler.is_compiling, calls),
    }
    if device.startswith("cuda"):
        found["torch.cuda.is_current_stream_capturing()"] = per_call_us(
            torch.cuda.is_current_stream_capturing, calls)
    return found


def decode_step(rows: int) -> Step:
    """A decode step of ``rows`` requests, as the built-in engine published it (tiny
    built-in llama, armed with the step recorder only, 512-token prompts)."""
    from transformers import AutoModelForCausalLM

    from enginetap.core import context
    from enginetap.engines.hf.engine import HFEngine
    from enginetap.engines.hf.requests import Request
    from enginetap.models import build_model

    model = AutoModelForCausalLM.from_pretrained(build_model("llama")).eval()
    seen: list[Step] = []
    context.subscribe(on_end=seen.append)
    try:
        HFEngine.from_loaded(model).generate([
            Request(request_id=f"agent-{i}", prompt_ids=[3 + (i * 7 + j) % 200
                                                         for j in range(512)],
                    max_new_tokens=3) for i in range(rows)])
    finally:
        context.unsubscribe(seen.append)
    return [s for s in seen if s.mode == "decode"][-1]


def recorder_costs(rows: int, calls: int) -> dict[str, float]:
    step, found = decode_step(rows), {}
    record = step.to_json()
    stamped = {"step": 7, "rank": 0, **record}
    line = encode_line_bytes(stamped, True)
    found[f"step.to_json() ({rows} rows)"] = per_call_us(step.to_json, calls)
    found[f"orjson line ({len(line)} bytes)"] = per_call_us(
        lambda: encode_line_bytes(stamped, True), calls)
    found["json line (no orjson)"] = per_call_us(lambda: encode_line_bytes(stamped), calls)
    places = [("temporary directory", Path(tempfile.gettempdir()))]
    if Path("/dev/shm").is_dir():
        places.append(("/dev/shm", Path("/dev/shm")))
    for label, where in places:
        with tempfile.TemporaryDirectory(dir=where) as tmp:
            fd = os.open(Path(tmp) / "lines.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                found[f"os.write of the line ({label})"] = per_call_us(
                    lambda fd=fd: os.write(fd, line), calls)
            finally:
                os.close(fd)
            recorder = StepRecorder(Path(tmp) / "rec", 0)
            found[f"StepRecorder.write, whole ({label})"] = per_call_us(
                lambda recorder=recorder: recorder.write(step), calls)
            recorder.uninstall()
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", type=int, default=32, help="requests in the recorded step")
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    empty = per_call_us(lambda: None, args.calls * 5)
    table = {**wrapper_costs(args.calls), **tensor_costs(args.device, args.calls),
             **recorder_costs(args.rows, max(1, args.calls // 20))}
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, device {args.device}; "
          f"an empty Python call: {empty:.3f} us")
    width = max(map(len, table))
    for name, us in table.items():
        print(f"  {name:<{width}}  {us:9.3f} us  {us / empty:8.1f} x empty call")


if __name__ == "__main__":
    main()
