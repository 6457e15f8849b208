"""Run a fixed workload on SGLang CPU (armed or not by the environment the test gives);
write each request's output tokens.

``python sglang_capture_run.py MODEL OUT.json [radix]``: two batches of greedy requests
("b" and "d" share a 24-token prefix, one in each batch), 6 new tokens each; with
``radix`` the radix cache is on, so "d"'s extend runs over "b"'s cached prefix. SGLang spawns its scheduler and re-imports
``__main__``, hence the guard. The engine is stopped with ``stop_engine`` (the scheduler
gets SIGTERM first and flushes its capture writer; ``Engine.shutdown`` alone kills it).
"""

from __future__ import annotations

import json
import random
import sys


def prompts(seed: int = 11) -> dict[str, list[int]]:
    rng = random.Random(seed)

    def one(n: int) -> list[int]:
        return [rng.randrange(3, 512) for _ in range(n)]

    shared = one(24)
    return {"a": one(17), "b": shared + one(9), "c": one(40), "d": shared + one(5)}


def main() -> None:
    import sglang as sgl

    from enginetap.engines.sglang.launch import engine_kwargs
    from enginetap.engines.sglang.run import stop_engine

    model, out = sys.argv[1], sys.argv[2]
    radix = sys.argv[3:] == ["radix"]
    engine = sgl.Engine(**engine_kwargs(model, radix_cache=radix))
    texts = prompts()
    outputs = {}
    for batch in (["a", "b"], ["c", "d"]):
        done = engine.generate(input_ids=[texts[k] for k in batch], rid=batch,
                               sampling_params={"max_new_tokens": 6, "temperature": 0.0,
                                                "ignore_eos": True})
        outputs.update({k: d["output_ids"] for k, d in zip(batch, done)})
    stop_engine(engine)
    with open(out, "w") as f:
        json.dump(outputs, f)


if __name__ == "__main__":
    main()
