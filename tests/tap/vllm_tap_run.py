"""Drive an armed vLLM CPU (tiny qwen3_next) through the tap checks; write what came out.

``python vllm_tap_run.py MODEL OUT.json [--tp N] [--faults | --compiled]``; the arming (``tap``) comes
from the environment the test gives. The engine core runs in this process, so each
``engine.step()`` is one scheduler step and batches are the same on every run. Phases,
one after the other in one engine (prefix caching off: identical prompts are computed):

- ``same``: three identical prompts and one other, batched together (never split);
- ``row`` (``--faults``): ``f1`` repeats ``f0``; at step ``ROW_STEP`` of the phase this
  test code adds 0.5 to one element of ``f1``'s row of layer 1's MoE output;
- ``kv`` (``--faults``): after step ``KV_STEP`` of the phase sampled, this test code
  writes random values into ``k0``'s newest KV row of layer 3 (full attention) and
  copies ``k0``'s recurrent state over ``k1``'s slot in layer 1;
- ``again`` (``--faults``, TP=1): the worker disarms and ``same`` runs again (armed vs
  disarmed tokens).

With ``--compiled`` the engine compiles the model (not ``enforce_eager``) and runs ``same``.

The injections live here, in test code, never in enginetap. vLLM's spawned processes
re-import ``__main__``, hence the guard (:mod:`vllm_child`).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/: vllm_child

from vllm_child import add, arguments, child_main, finish, make_llm, write_json  # noqa: E402

ROW_LAYER, ROW_STEP = "L1.moe", 2
KV_LAYER, STATE_LAYER, KV_STEP = 3, 1, 2
MOE = "vllm.model_executor.models.qwen3_next:Qwen3NextSparseMoeBlock.forward"
SAMPLE = "vllm.v1.worker.gpu_model_runner:GPUModelRunner.sample_tokens"


def prompts(seed: int = 3) -> dict[str, list[int]]:
    rng = random.Random(seed)

    def one(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    same, other, f, g, k0, k1 = one(40), one(23), one(30), one(12), one(36), one(20)
    return {"s0": same, "s1": same, "s2": other, "s3": same, "f0": f, "f1": f, "f2": g,
            "k0": k0, "k1": k1}


PHASES = {"same": ["s0", "s1", "s2", "s3"], "row": ["f0", "f1", "f2"], "kv": ["k0", "k1"]}
MAX_TOKENS = 5
FAULTS: dict[str, Any] = {"phase": None, "step": 0, "written": {}}


def _corrupt_row(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    from enginetap.core.context import current_step
    from enginetap.core.scope import SCOPE

    step = current_step()
    if FAULTS["phase"] == "row" and FAULTS["step"] == ROW_STEP and step is not None \
            and SCOPE.short(instance) == ROW_LAYER:
        row = step.rows.token_index[step.rows.rows_of_key("f1")[-1]]
        out = out.clone()
        out.view(-1, out.shape[-1])[row, 0] += 0.5
        position = step.rows.positions[step.rows.rows_of_key("f1")[-1]]
        FAULTS["written"]["row"] = {"key": "f1", "step": step.step, "position": position}
    return out


def _overwrite_between_steps(wrapped, runner, args, kwargs):
    result = wrapped(*args, **kwargs)
    from enginetap.core.context import current_step

    step = current_step()
    if FAULTS["phase"] == "kv" and FAULTS["step"] == KV_STEP and step is not None:
        _overwrite(runner, step)
    return result


def _overwrite(runner: Any, step: Any) -> None:
    import torch
    from vllm import _custom_ops as ops

    layers = runner.vllm_config.compilation_config.static_forward_context
    attn = layers[f"model.layers.{KV_LAYER}.self_attn.attn"]
    cache = attn.kv_cache[0] if isinstance(attn.kv_cache, list) else attn.kv_cache
    row = step.rows.rows_of_key("k0")[-1]
    slot = step.rows.kv_slots[row]
    blocks, heads, block_size, width = cache.shape
    key_cache, value_cache = cache.view(blocks, heads, 2 * block_size, width // 2).chunk(2, 2)
    noise = torch.randn(1, heads, width // 2, generator=torch.Generator().manual_seed(5))
    ops.cpu_attn_reshape_and_cache(noise.to(cache.dtype), noise.to(cache.dtype), key_cache,
                                   value_cache, torch.tensor([slot], dtype=torch.long),
                                   attn.isa)
    name = f"model.layers.{STATE_LAYER}.linear_attn"
    ssm = layers[name].kv_cache[1]
    group = next(i for i, g in enumerate(runner.kv_cache_config.kv_cache_groups)
                 if name in g.layer_names)
    slots = step.rows.state_groups[f"group{group}"]  # the layer's own cache group
    victim, donor = slots[step.rows.rows_of_key("k1")[-1]], slots[row]
    ssm[victim].copy_(ssm[donor])
    FAULTS["written"].update({"kv": {"key": "k0", "position": step.rows.positions[row],
                                "slot": slot, "step": step.step},
                         "state": {"key": "k1", "slot": victim, "step": step.step}})


def install_faults() -> Any:
    from enginetap.core.patching import PatchSet

    faults = PatchSet("test-faults")
    faults.add(MOE, _corrupt_row)
    faults.add(SAMPLE, _overwrite_between_steps)
    return faults.install()


def run_phase(engine: Any, name: str, texts: dict[str, list[int]], suffix: str = "") -> dict:
    for key in PHASES[name]:
        add(engine, key + suffix, texts[key], MAX_TOKENS)
    FAULTS["phase"], FAULTS["step"], done = name, 0, {}
    finish(engine, done, lambda out: list(out.outputs[0].token_ids), after_step=_count_step)
    FAULTS["phase"] = None
    return done


def _count_step() -> None:
    FAULTS["step"] += 1


def main() -> None:
    parser = arguments()
    parser.add_argument("--faults", action="store_true")
    parser.add_argument("--compiled", action="store_true")
    args = parser.parse_args()
    faults = install_faults() if args.faults else None
    engine = make_llm(args.model, args.tp, enforce_eager=not args.compiled, max_model_len=256,
                      max_num_batched_tokens=256, enable_prefix_caching=False).llm_engine
    texts = prompts()
    report: dict[str, Any] = {"same": run_phase(engine, "same", texts)}
    if faults is not None:
        report["row"] = run_phase(engine, "row", texts)
        report["kv"] = run_phase(engine, "kv", texts)
        report["written"] = FAULTS["written"]
        from enginetap.engines.vllm.worker import disarm_worker

        disarm_worker()
        report["again"] = run_phase(engine, "same", texts, suffix="-again")
    write_json(args.out, report)


if __name__ == "__main__":
    child_main(main)
