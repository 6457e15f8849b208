"""Run the guarded RMSNorm example inside vLLM CPU: disarmed vs armed greedy tokens.

    flock /tmp/enginetap-vllm.lock python -m enginetap.guard.examples.vllm_demo MODEL_DIR \\
        --out result.json

The engine core and the worker run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
so the patch installed here, before the model is built, is the one the model calls. The
model is loaded once: the same prompts are generated with the guard ``off`` (stock path
only) and then in ``check`` mode, and the script reports both token lists and every
decision the guard took.

With ``--plugin`` it installs nothing and keeps vLLM's own processes: the enginetap vLLM
plugin arms the worker from the environment, and the decisions land in
``<out_dir>/guard-rank0.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any


def _prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    # Lengths on both sides of SPLIT_ROWS, so one batch has a long prefill and short decodes.
    rng = random.Random(seed)
    lengths = [5, 9, 23, 41][:count] + [rng.randint(3, 40) for _ in range(max(0, count - 4))]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def run(model: Path, max_tokens: int, prompts: int) -> dict[str, Any]:
    """Load vLLM once; generate with the guard off, then in check mode."""
    from enginetap.guard.examples.vllm_rmsnorm import install
    from enginetap.guard.keys import describe_key

    patch = install()  # before the engine: CustomOp binds forward_native at build time
    patch.mode = "off"
    from vllm import LLM

    llm = LLM(model=str(model), enforce_eager=True, gpu_memory_utilization=0.3,
              max_model_len=512, seed=0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    batch = _prompts(prompts, vocab, seed=0)
    disarmed = _generate(llm, batch, max_tokens)
    patch.mode = "check"
    armed = _generate(llm, batch, max_tokens)
    decisions = [{"key": describe_key(d.key), "rows": _rows(d.key), "patched": d.patched,
                  "reason": d.reason} for d in patch.decisions.values()]
    return {"disarmed": disarmed, "armed": armed, "identical": disarmed == armed,
            "decisions": decisions, "errors": [e.error for e in patch.errors]}


def run_plugin_armed(model: Path, max_tokens: int, prompts: int) -> dict[str, Any]:
    """Generate once with vLLM's default processes; arming is the plugin's (environment)."""
    from vllm import LLM

    llm = LLM(model=str(model), enforce_eager=True, gpu_memory_utilization=0.3,
              max_model_len=512, seed=0)
    batch = _prompts(prompts, llm.llm_engine.model_config.get_vocab_size(), seed=0)
    return {"armed": _generate(llm, batch, max_tokens)}


def _rows(key: Any) -> int | None:
    first = key[0] if isinstance(key, tuple) and key else None
    return int(first[0][0]) if isinstance(first, tuple) and first and first[0] else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="model folder (e.g. enginetap models build llama)")
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--plugin", action="store_true",
                        help="install nothing here: the enginetap vLLM plugin arms the worker "
                             "(ENGINETAP=1, ENGINETAP_CAPABILITIES=guard, ENGINETAP_CONFIG)")
    args = parser.parse_args(argv)
    if args.plugin:
        result = run_plugin_armed(args.model, args.max_tokens, args.prompts)
        if args.out is not None:
            args.out.write_text(json.dumps(result, indent=2))
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # before vLLM is imported
    result = run(args.model, args.max_tokens, args.prompts)
    for d in result["decisions"]:
        print(f"{'patched' if d['patched'] else 'stock  '} {d['key']}: {d['reason']}")
    print(f"greedy tokens identical (off vs check): {result['identical']}")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return 0 if result["identical"] and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
