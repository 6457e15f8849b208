"""Drive an armed SGLang CPU engine (tiny qwen3_next) through the tap checks; write what
came out.

``python sglang_tap_run.py MODEL OUT.json``; the arming (``tap``) comes from the
environment the test gives. Phases, one after the other in one engine (radix cache off:
identical prompts are computed):

- ``same``: three identical prompts and one other, batched together;
- ``row``: ``f1`` repeats ``f0``; at the ``ROW_STEP``-th step that holds ``f1``, this test
  code adds 0.5 to one element of ``f1``'s last row of layer 1's MoE block output;
- ``kv``: after the ``KV_STEP``-th step that holds ``k0`` sampled, this test code writes
  random values into ``k0``'s newest key row of layer 3 (full attention) in SGLang's token
  pool and copies ``k0``'s recurrent state over ``k1``'s slot in layer 1;
- ``again``: before the first step that holds an ``-again`` request this test code
  disarms the scheduler process, and ``same`` runs again (armed vs disarmed tokens).

The injections live here, in test code, never in enginetap: SGLang's scheduler is a
spawned process that re-imports this file as ``__mp_main__``, which installs them there
(and the ``__main__`` guard keeps the engine from starting twice).
"""

from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

ROW_LAYER, ROW_STEP = "L1.moe", 2
MAX_TOKENS = 5
PHASES = {"same": ["s0", "s1", "s2", "s3"], "row": ["f0", "f1", "f2"], "kv": ["k0", "k1"]}
KV_LAYER, STATE_LAYER, KV_STEP = 3, 1, 2
MOE = "sglang.srt.models.qwen2_moe:Qwen2MoeSparseMoeBlock.forward"
FORWARD = "sglang.srt.model_executor.model_runner:ModelRunner.forward"
WRITTEN = "ETTEST_SGLANG_WRITTEN"
SAMPLE = "sglang.srt.model_executor.model_runner:ModelRunner.sample"
SEEN: dict[str, Any] = {"f1": 0, "k0": 0, "disarmed": False}


def prompts(seed: int = 3) -> dict[str, list[int]]:
    rng = random.Random(seed)

    def one(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    same, other, f, g, k0, k1 = one(40), one(23), one(30), one(12), one(36), one(20)
    return {"s0": same, "s1": same, "s2": other, "s3": same, "f0": f, "f1": f, "f2": g,
            "k0": k0, "k1": k1}


def _corrupt_row(wrapped, instance, args, kwargs):
    out = wrapped(*args, **kwargs)
    from enginetap.core.context import current_step
    from enginetap.core.scope import SCOPE

    step = current_step()
    if step is None or SCOPE.short(instance) != ROW_LAYER or "f1" not in step.rows.keys \
            or SEEN["f1"] != ROW_STEP:
        return out
    row = step.rows.rows_of_key("f1")[-1]
    out = out.clone()
    out.view(-1, out.shape[-1])[step.rows.token_index[row], 0] += 0.5
    with open(os.environ[WRITTEN], "w") as f:
        json.dump({"key": "f1", "step": step.step, "position": step.rows.positions[row]}, f)
    return out


def _overwrite_after_sampling(wrapped, runner, args, kwargs):
    result = wrapped(*args, **kwargs)
    from enginetap.core.context import current_step

    step = current_step()
    if step is None or "k0" not in step.rows.keys:
        return result
    SEEN["k0"] += 1
    if SEEN["k0"] != KV_STEP:
        return result
    import torch

    row = step.rows.rows_of_key("k0")[-1]
    slot = step.rows.kv_slots[row]
    key = runner.token_to_kv_pool.get_key_buffer(KV_LAYER)
    noise = torch.randn(key[slot].shape, generator=torch.Generator().manual_seed(5))
    key[slot] = noise.to(key.dtype)
    ssm = runner.req_to_token_pool.mamba2_layer_cache(STATE_LAYER).temporal
    victim = step.rows.state_slots[step.rows.rows_of_key("k1")[-1]]
    ssm[victim].copy_(ssm[step.rows.state_slots[row]])
    with open(os.environ[WRITTEN] + ".kv", "w") as f:
        json.dump({"kv": {"key": "k0", "position": step.rows.positions[row], "slot": slot,
                          "step": step.step},
                   "state": {"key": "k1", "slot": victim, "step": step.step}}, f)
    return result


def _count_and_disarm(wrapped, runner, args, kwargs):
    batch = args[0] if args else kwargs["forward_batch"]
    rids = [str(r) for r in (batch.rids or [])]
    if "f1" in rids:
        SEEN["f1"] += 1
    if any(r.endswith("-again") for r in rids) and not SEEN["disarmed"]:
        from enginetap.engines.sglang.worker import disarm_worker

        disarm_worker()
        SEEN["disarmed"] = True
    return wrapped(*args, **kwargs)


def install_faults() -> Any:
    from enginetap.core.patching import PatchSet

    faults = PatchSet("test-faults")
    faults.add(MOE, _corrupt_row)
    faults.add(FORWARD, _count_and_disarm)
    faults.add(SAMPLE, _overwrite_after_sampling)
    return faults.install()


def run_phase(engine: Any, name: str, texts: dict[str, list[int]], suffix: str = "") -> dict:
    keys = PHASES[name]
    outs = engine.generate(input_ids=[texts[k] for k in keys], rid=[k + suffix for k in keys],
                           sampling_params={"max_new_tokens": MAX_TOKENS, "temperature": 0.0,
                                            "ignore_eos": True})
    return {k + suffix: o["output_ids"] for k, o in zip(keys, outs)}


def main() -> None:
    import sglang as sgl

    from enginetap.engines.sglang.launch import engine_kwargs
    from enginetap.engines.sglang.run import stop_engine

    model, out = sys.argv[1], sys.argv[2]
    os.environ[WRITTEN] = out + ".written"
    engine = sgl.Engine(**engine_kwargs(model))
    texts = prompts()
    report: dict[str, Any] = {"same": run_phase(engine, "same", texts),
                              "row": run_phase(engine, "row", texts),
                              "kv": run_phase(engine, "kv", texts),
                              "again": run_phase(engine, "same", texts, suffix="-again")}
    stop_engine(engine)  # the scheduler exits in order: its tap writer flushes
    with open(out + ".written") as f:
        report["written"] = json.load(f)
    with open(out + ".written.kv") as f:
        report["written"].update(json.load(f))
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # SGLang's spawned scheduler: the test-only injections
    install_faults()
