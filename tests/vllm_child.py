"""What the vLLM child scripts share: seeded token prompts, ``vllm.LLM`` with the suite's
settings, greedy requests and the step loop, and the script's entry point.

vLLM never starts inside pytest: each script runs in a child process as
``python SCRIPT MODEL OUT.json ...`` with the arming its test gives in the environment.
The engine core runs in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so each
``engine.step()`` is one scheduler step and batches are the same on every run. vLLM's
spawned processes re-import ``__main__``: a script calls :func:`child_main` under the
``__name__ == "__main__"`` guard. A script finds this module with
``sys.path.append(<tests folder>)``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["SUITE_ENGINE", "add", "arguments", "child_main", "finish", "make_llm",
           "paged_block_size", "random_prompts", "staggered", "staggered_prompts", "write_json"]

SUITE_ENGINE: dict[str, Any] = {"gpu_memory_utilization": 0.25, "max_num_seqs": 8, "seed": 0}
"""Engine arguments every script shares (tiny models, a small KV cache, one seed)."""


def random_prompts(lengths: Mapping[str, int], seed: int, vocab: int = 512
                   ) -> dict[str, list[int]]:
    """A prompt of random token ids (3 and up: no special tokens) per name, by length."""
    rng = random.Random(seed)
    return {name: [rng.randrange(3, vocab) for _ in range(n)] for name, n in lengths.items()}


def paged_block_size(model: str) -> int:
    """CPU attention (and AMX MLA) page in multiples of 32 tokens; CPU MLA, which runs
    where the CPU lacks AMX, only in pages of 16."""
    import torch

    mla = "kv_lora_rank" in json.loads((Path(model) / "config.json").read_text())
    return 16 if mla and not torch.cpu._is_amx_tile_supported() else 32


def make_llm(model: str, tp: int = 1, *, enforce_eager: bool = True, **engine: Any) -> Any:
    """``vllm.LLM`` of ``model`` with the suite's settings and the script's own."""
    from vllm import LLM

    return LLM(model=model, tensor_parallel_size=tp, enforce_eager=enforce_eager,
               **SUITE_ENGINE, **engine)


def add(engine: Any, key: str, prompt_ids: list[int], max_tokens: int, **params: Any) -> None:
    """One greedy request (never stopped early by EOS) under its own ``key``."""
    from vllm import SamplingParams

    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                              **params)
    engine.add_request(key, {"prompt_token_ids": prompt_ids}, sampling)


def finish(engine: Any, done: dict[str, Any], result: Callable[[Any], Any],
           after_step: Callable[[], None] | None = None, steps: int | None = None) -> None:
    """Step until every request finished (or ``steps`` steps); ``done[id] = result(out)``
    of each finished one; ``after_step()`` after each step."""
    while engine.has_unfinished_requests() and steps != 0:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = result(out)
        if after_step is not None:
            after_step()
        steps = None if steps is None else steps - 1


def staggered_prompts(lengths: Mapping[str, int], seed: int) -> dict[str, list[int]]:
    """Prompts for :func:`staggered`: ``a``, ``b`` and ``c`` by length, ``a2`` = ``a``."""
    out = random_prompts(lengths, seed)
    out["a2"] = list(out["a"])
    return out


def staggered(engine: Any, prompts: Mapping[str, list[int]], max_tokens: Mapping[str, int],
              result: Callable[[Any], Any], idle: Callable[[], None] = lambda: None,
              **params: Any) -> dict[str, Any]:
    """``a`` and ``b`` start together, ``c`` joins two steps later (prefill and decode rows
    share steps), then, once they finished, ``a2`` (``a``'s prompt again: a prefix-cache
    hit where the engine caches prefixes). ``idle()`` runs before each of the two phases."""
    done: dict[str, Any] = {}

    def send(key: str) -> None:
        add(engine, key, prompts[key], max_tokens[key], **params)

    idle()
    send("a")
    send("b")
    finish(engine, done, result, steps=2)
    send("c")
    finish(engine, done, result)
    idle()
    send("a2")
    finish(engine, done, result)
    return done


def arguments(tp: int = 1) -> argparse.ArgumentParser:
    """The arguments every script takes: ``MODEL OUT.json [--tp N]``."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=tp)
    return parser


def write_json(path: str, data: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)


def child_main(main: Callable[[], None]) -> None:
    """Run a script's ``main`` with vLLM's engine core in this process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main()
