"""Drive vLLM CPU in-process through a fixed workload; write what came out as JSON.

Run as a script: ``python offline_run.py MODEL OUT.json [--tp 2]``; the arming comes from
the environment the test gives. At TP=1 the model runner lives in this very process, so
an armed and a disarmed run need two processes. The batches are the same on every run
(:mod:`vllm_child`):

- requests ``a`` (200 tokens) and ``b`` (45) start together; a small token budget chunks
  their prefills; ``c`` (9 tokens) arrives two steps later, so prefill and decode rows
  share steps (mixed);
- after they finish, ``a2`` repeats ``a``'s prompt: a prefix-cache hit where the engine
  caches prefixes.

Before each phase the workers run a dummy batch (what data-parallel ranks run when idle):
it calls the model but is no engine step.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # tests/: vllm_child

from vllm_child import arguments, child_main, make_llm, staggered, staggered_prompts, write_json  # noqa: E402

LENGTHS = {"a": 200, "b": 45, "c": 9}
MAX_TOKENS = {"a": 6, "b": 8, "c": 5, "a2": 4}


def run_workload(llm) -> dict[str, dict]:
    engine, texts = llm.llm_engine, staggered_prompts(LENGTHS, seed=0)
    return staggered(engine, texts, MAX_TOKENS,
                     lambda out: _result(texts[out.request_id], out),
                     idle=engine.engine_core.execute_dummy_batch, logprobs=2)


def _result(prompt: list[int], out) -> dict:
    completion = out.outputs[0]
    logprobs = [sorted((int(t), float(lp.logprob)) for t, lp in position.items())
                for position in completion.logprobs]
    return {"prompt": prompt, "output": list(completion.token_ids), "logprobs": logprobs,
            "cached_tokens": out.num_cached_tokens}


def one_run(model: str, tp: int, path: str) -> None:
    started = time.monotonic()
    llm = make_llm(model, tp, max_model_len=512, max_num_batched_tokens=32,
                   enable_prefix_caching=True, enable_chunked_prefill=True, block_size=32)
    loaded = time.monotonic()
    requests = run_workload(llm)
    config = llm.llm_engine.vllm_config
    write_json(path, {"requests": requests, "load_s": loaded - started,
                      "run_s": time.monotonic() - loaded,
                      "prefix_caching": bool(config.cache_config.enable_prefix_caching),
                      "chunked_prefill": bool(config.scheduler_config.enable_chunked_prefill)})


def main() -> None:
    parser = arguments()
    args = parser.parse_args()
    one_run(args.model, args.tp, args.out)


if __name__ == "__main__":
    child_main(main)
