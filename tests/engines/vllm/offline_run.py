"""Drive vLLM CPU in-process through a fixed workload; write what came out as JSON.

Run as a script (vLLM's spawned processes re-import ``__main__``, hence the guard):
``python offline_run.py MODEL OUT.json [--tp 2]``; the arming comes from the environment
the test gives. At TP=1 the model runner lives in this very process, so an armed and a
disarmed run need two processes.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so each
``engine.step()`` is one scheduler step and the batches are the same on every run:

- requests ``a`` (200 tokens) and ``b`` (45) start together; a small token budget chunks
  their prefills; ``c`` (9 tokens) arrives two steps later, so prefill and decode rows
  share steps (mixed);
- after they finish, ``a2`` repeats ``a``'s prompt: a prefix-cache hit where the engine
  caches prefixes.

Before each phase the workers run a dummy batch (what data-parallel ranks run when idle):
it calls the model but is no engine step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

LENGTHS = {"a": 200, "b": 45, "c": 9}
MAX_TOKENS = {"a": 6, "b": 8, "c": 5, "a2": 4}


def prompts(vocab: int = 512, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    out = {name: [rng.randrange(3, vocab) for _ in range(n)] for name, n in LENGTHS.items()}
    out["a2"] = list(out["a"])
    return out


def make_llm(model: str, tp: int):
    from vllm import LLM

    return LLM(model=model, tensor_parallel_size=tp, gpu_memory_utilization=0.25,
               enforce_eager=True, max_model_len=512, max_num_batched_tokens=32,
               max_num_seqs=8, enable_prefix_caching=True, enable_chunked_prefill=True,
               block_size=32, seed=0)


def run_workload(llm) -> dict[str, dict]:
    from vllm import SamplingParams

    engine = llm.llm_engine
    texts = prompts()
    done: dict[str, dict] = {}

    def add(name: str) -> None:
        params = SamplingParams(max_tokens=MAX_TOKENS[name], temperature=0.0, logprobs=2,
                                ignore_eos=True)
        engine.add_request(name, {"prompt_token_ids": texts[name]}, params)

    def step() -> None:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = _result(texts[out.request_id], out)

    engine.engine_core.execute_dummy_batch()
    add("a")
    add("b")
    step()
    step()
    add("c")
    while engine.has_unfinished_requests():
        step()
    engine.engine_core.execute_dummy_batch()
    add("a2")
    while engine.has_unfinished_requests():
        step()
    return done


def _result(prompt: list[int], out) -> dict:
    completion = out.outputs[0]
    logprobs = [sorted((int(t), float(lp.logprob)) for t, lp in position.items())
                for position in completion.logprobs]
    return {"prompt": prompt, "output": list(completion.token_ids), "logprobs": logprobs,
            "cached_tokens": out.num_cached_tokens}


def one_run(model: str, tp: int, path: str) -> None:
    started = time.monotonic()
    llm = make_llm(model, tp)
    loaded = time.monotonic()
    requests = run_workload(llm)
    config = llm.llm_engine.vllm_config
    report = {"requests": requests, "load_s": loaded - started,
              "run_s": time.monotonic() - loaded,
              "prefix_caching": bool(config.cache_config.enable_prefix_caching),
              "chunked_prefill": bool(config.scheduler_config.enable_chunked_prefill)}
    with open(path, "w") as f:
        json.dump(report, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("out")
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    one_run(args.model, args.tp, args.out)


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main()
