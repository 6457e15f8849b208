"""Drive vLLM CPU in-process through a small fixed workload for capture tests.

``python vllm_capture_run.py MODEL OUT.json [--tp N]``; the arming (capture or none) comes
from the environment the test gives. Requests ``a`` (70 tokens) and ``b`` (23) start
together, ``c`` (9) joins two steps later (mixed steps), then ``a2`` repeats ``a``'s prompt
(a prefix-cache hit); greedy, a handful of decode steps each (:func:`vllm_child.staggered`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/: vllm_child

from vllm_child import (  # noqa: E402
    arguments,
    child_main,
    make_llm,
    paged_block_size,
    staggered,
    staggered_prompts,
    write_json,
)

LENGTHS = {"a": 70, "b": 23, "c": 9}
MAX_TOKENS = {"a": 6, "b": 5, "c": 4, "a2": 4}


def run(model: str, tp: int, ssm_dtype: str = "auto") -> dict[str, dict]:
    llm = make_llm(model, tp, block_size=paged_block_size(model), max_model_len=256,
                   max_num_batched_tokens=64, enable_prefix_caching=True,
                   enable_chunked_prefill=True, mamba_ssm_cache_dtype=ssm_dtype)
    return staggered(llm.llm_engine, staggered_prompts(LENGTHS, seed=1), MAX_TOKENS,
                     lambda out: {"output": list(out.outputs[0].token_ids),
                                  "cached_tokens": out.num_cached_tokens})


def main() -> None:
    parser = arguments()
    parser.add_argument("--hide-amx", action="store_true",
                        help="make vLLM believe the CPU lacks AMX (TP=1, in-process only): "
                             "it then takes the kernels an AMD AVX-512 machine runs")
    parser.add_argument("--ssm-dtype", default="auto",
                        help="vLLM's mamba_ssm_cache_dtype (the gated-delta state pool's dtype: "
                             "auto keeps the model's on CPUs without AVX-512 BF16, float32 on "
                             "the others)")
    args = parser.parse_args()
    if args.hide_amx:
        import torch

        torch.cpu._is_amx_tile_supported = lambda: False
    write_json(args.out, {"requests": run(args.model, args.tp, args.ssm_dtype)})


if __name__ == "__main__":
    child_main(main)
