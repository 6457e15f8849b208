"""Test-only guard patches loaded in vLLM's workers (``options.guard.patches``).

- :func:`fail_rank1`: rank 1's sharded path adds 1 to one output element of every chunk of
  ``SP_INJECT_ROWS`` rows, so its self-check for that shape fails on rank 1 only;
- :func:`drift_llama_layer`: replaces ``LlamaDecoderLayer.forward`` with a copy of its own
  source whose comment was edited (same behaviour, different source), written to
  ``SP_DRIFT_DIR`` and imported from there, so the drift lock sees a changed function.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import textwrap
from pathlib import Path
from typing import Any

from enginetap.core.patching import Patch

FINISH = "enginetap.patches.sp_prefill.dense:finish_rows"


def fail_rank1() -> Patch:
    import torch.distributed as dist

    rows = int(os.environ["SP_INJECT_ROWS"])

    def finish(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        plan = args[0]
        hidden, residual = wrapped(*args, **kwargs)
        if dist.get_rank() == 1 and plan.rows == rows:
            hidden = hidden.clone()
            hidden[0, 0] += 1.0
        return hidden, residual

    return Patch(FINISH, finish).install()


def drift_llama_layer() -> None:
    from vllm.model_executor.models import llama

    source = textwrap.dedent(inspect.getsource(llama.LlamaDecoderLayer.forward))
    edited = source.replace("# Self Attention", "# Self Attention (an edited copy)", 1)
    assert edited != source, "the comment this test edits is gone from vLLM's source"
    path = Path(os.environ["SP_DRIFT_DIR"]) / "drifted_llama_layer.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("from typing import *\nimport torch\n\n" + edited)
    spec = importlib.util.spec_from_file_location("drifted_llama_layer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    llama.LlamaDecoderLayer.forward = module.forward
