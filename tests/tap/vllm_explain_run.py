"""``python vllm_explain_run.py record|explain OUT``: a vLLM CPU tap run with a planted
batch-position-dependent norm, then ``enginetap tap explain`` on it (two processes: vLLM's
arming is per process). The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the plant, test code, is under every call.

The plant: ``RMSNorm.forward(x)`` (no residual: the first layer's input norm) adds
``0.01 * i`` to token row ``i`` of the flat batch, so identical prompts at other offsets
differ there.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SAME = ["the cache holds every key", "the cache holds every key", "kernels and caches"]
NORM = "vllm.model_executor.layers.layernorm:RMSNorm.forward"


def by_token_row(wrapped, instance, args, kwargs):
    import torch

    out = wrapped(*args, **kwargs)
    if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] > 1:
        out = out + 0.01 * torch.arange(out.shape[0], dtype=out.dtype)[:, None]
    return out


def main(phase: str, out: Path) -> None:
    from enginetap.core.patching import PatchSet

    plant = PatchSet("test-plant")
    plant.add(NORM, by_token_row)
    plant.install()
    if phase == "record":
        from enginetap.tap.run import record_vllm_run

        record_vllm_run("builtin:llama", SAME, out / "run", batch_size=3, max_new_tokens=2)
        return
    from enginetap.cli.main import main as cli

    sys.argv = ["enginetap", "tap", "explain", str(out / "run"), "--out", str(out / "repro"),
                "--json"]
    cli()


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main(sys.argv[1], Path(sys.argv[2]))
