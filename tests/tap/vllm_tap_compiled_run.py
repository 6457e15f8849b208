"""Drive vLLM CPU in its compiled mode (not ``enforce_eager``) through the tap checks.

``python vllm_tap_compiled_run.py MODEL OUT.json [--eager] [--faults] [--phases same,row,kv]
[--again]``; the arming comes from the environment the test gives (none: disarmed). The
prompts, phases and the KV / state overwrite are ``vllm_tap_run.py``'s (see its
docstring); this script differs where compiling makes it:

- the row fault (``--faults``): vLLM runs its traced graph, never the Python of a
  module's ``forward``, so a class-level patch would not run. Test code registers a
  forward hook on layer 1's MoE block when the model is loaded (before vLLM traces it),
  returning ``where(MASK, out + 0.5, out)``; ``MASK`` (a tensor the graph reads) is set
  before each forward, for ``f1``'s row at step ``ROW_STEP`` of the ``row`` phase only.
  The hook is installed with ``--faults`` armed or not, so both runs trace the same graph;
- ``--again``: the worker disarms after the phases and ``same`` runs again (the graph
  keeps the tap's op: vLLM never retraces; the engine must go on serving).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import vllm_tap_run as base

MOE_QUALNAME = "model.layers.1.mlp"
AFTER_LOADING = "vllm.model_executor.model_loader.base_loader:process_weights_after_loading"
FORWARD = "vllm.v1.worker.gpu_model_runner:GPUModelRunner._model_forward"
MASK: Any = None
"""``[max tokens, hidden]`` bool: where layer 1's MoE output gets 0.5 added."""


def _hook_moe(wrapped, instance, args, kwargs):
    import torch

    global MASK
    model = args[0] if args else kwargs["model"]
    block = dict(model.named_modules())[MOE_QUALNAME]
    MASK = torch.zeros((256, model.config.hidden_size), dtype=torch.bool)

    def corrupt(module, inputs, out):
        return torch.where(MASK[:out.shape[0]], out + 0.5, out)

    block.register_forward_hook(corrupt)
    return wrapped(*args, **kwargs)


def _mark_row(wrapped, runner, args, kwargs):
    from enginetap.core.context import current_step

    MASK.zero_()
    step = current_step()
    if base.FAULTS["phase"] == "row" and base.FAULTS["step"] == base.ROW_STEP \
            and step is not None:
        last = step.rows.rows_of_key("f1")[-1]
        MASK[step.rows.token_index[last], 0] = True
        base.FAULTS["written"]["row"] = {"key": "f1", "step": step.step,
                                         "position": step.rows.positions[last]}
    return wrapped(*args, **kwargs)


def install_faults() -> Any:
    from enginetap.core.patching import PatchSet

    faults = PatchSet("test-faults-compiled")
    faults.add(AFTER_LOADING, _hook_moe)
    faults.add(FORWARD, _mark_row)
    faults.add(base.SAMPLE, base._overwrite_between_steps)
    return faults.install()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--phases", default="same")
    parser.add_argument("--again", action="store_true")
    args = parser.parse_args()
    if args.faults:
        install_faults()
    engine = base.make_llm(args.model, 1, enforce_eager=args.eager, max_model_len=256,
                           max_num_batched_tokens=256, enable_prefix_caching=False).llm_engine
    texts = base.prompts()
    report: dict[str, Any] = {}
    for phase in args.phases.split(","):
        report[phase] = base.run_phase(engine, phase, texts)
    report["written"] = base.FAULTS["written"]
    report["compilation"] = engine.vllm_config.compilation_config.mode.name
    if args.again:
        from enginetap.engines.vllm.worker import disarm_worker

        disarm_worker()
        report["again"] = base.run_phase(engine, "same", texts, suffix="-again")
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main()
