"""``python vllm_explain_run.py record|explain OUT [CASE]``: a vLLM CPU tap run with a
planted cause, then ``enginetap tap explain`` on it (two processes: vLLM's arming is per
process). The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so
the plant, test code, is under every call.

The plants (CASE):

- ``batch`` (the default): ``RMSNorm.forward(x)`` (no residual: the first layer's input
  norm) adds ``0.01 * i`` to token row ``i`` of the flat batch, so identical prompts at
  other offsets differ there;
- ``noise``: the same norm adds fresh noise on every call of more than one token row;
- ``slot``: on ``builtin:qwen3_next``, at decode step ``FAULT``, the step's first
  gated-delta layer (``_cpu_gdn_attention_nonspec``, given the layer and its metadata)
  copies the third request's recurrent state slot into the second's before running: the
  second request reads another's slot.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SAME = ["the cache holds every key", "the cache holds every key", "kernels and caches"]
NORM = "vllm.model_executor.layers.layernorm:RMSNorm.forward"
GDN = "vllm.model_executor.layers.mamba.ops.cpu.gdn_attention:_cpu_gdn_attention_nonspec"
FAULT = 2


def by_token_row(wrapped, instance, args, kwargs):
    import torch

    out = wrapped(*args, **kwargs)
    if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] > 1:
        out = out + 0.01 * torch.arange(out.shape[0], dtype=out.dtype)[:, None]
    return out


def noisy(wrapped, instance, args, kwargs):
    import torch

    out = wrapped(*args, **kwargs)
    if isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] > 1:
        out = out + 0.01 * torch.randn_like(out)
    return out


_FAULTED: set[int] = set()


def wrong_slot(wrapped, instance, args, kwargs):
    from enginetap.core.context import current_step

    layer, meta = args[0], args[1]
    step = current_step()
    if (step is not None and step.step == FAULT and step.step not in _FAULTED
            and meta.num_prefills == 0 and meta.num_decodes == 3):
        _FAULTED.add(step.step)  # the step's first gated-delta layer only
        slots = meta.non_spec_state_indices_tensor
        states = layer.kv_cache[1]
        states[int(slots[1])].copy_(states[int(slots[2])])  # p1 reads p2's slot
    return wrapped(*args, **kwargs)


CASES = {"batch": ("builtin:llama", NORM, by_token_row, 2),
         "noise": ("builtin:llama", NORM, noisy, 2),
         "slot": ("builtin:qwen3_next", GDN, wrong_slot, FAULT + 2)}


def main(phase: str, out: Path, case: str) -> None:
    from enginetap.core.patching import PatchSet

    model, target, wrapper, new = CASES[case]
    plant = PatchSet("test-plant")
    plant.add(target, wrapper)
    plant.install()
    if phase == "record":
        from enginetap.tap.run import record_vllm_run

        record_vllm_run(model, SAME, out / "run", batch_size=3, max_new_tokens=new)
        return
    from enginetap.cli.main import main as cli

    sys.argv = ["enginetap", "tap", "explain", str(out / "run"), "--pair", "p0/p1", "--out",
                str(out / "repro"), "--json"]
    cli()


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "batch")
