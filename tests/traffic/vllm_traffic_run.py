"""Drive a traffic profile through ``vllm.LLM`` in-process; write the run report as JSON.

Run as a script (vLLM's spawned processes re-import ``__main__``, hence the guard):
``python vllm_traffic_run.py MODEL PROFILE.json OUT.json``.
"""

from __future__ import annotations

import os
import sys


def main(model: str, profile_path: str, out_path: str) -> None:
    from vllm import LLM

    from enginetap.traffic import VLLMDriver, load_profile, run_profile

    llm = LLM(model=model, gpu_memory_utilization=0.25, enforce_eager=True, max_model_len=512,
              max_num_seqs=8, enable_prefix_caching=True, block_size=32, seed=0)
    report = run_profile(load_profile(profile_path), VLLMDriver(llm), progress=False)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(report.model_dump_json(indent=2))


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    main(*sys.argv[1:4])
