"""Drive a traffic profile through ``vllm.LLM`` in-process; write the run report as JSON.

Run as a script (vLLM's spawned processes re-import ``__main__``, hence the guard):
``python vllm_traffic_run.py MODEL PROFILE.json OUT.json`` (:mod:`vllm_child`).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # tests/: vllm_child

from vllm_child import child_main, make_llm  # noqa: E402


def main() -> None:
    from enginetap.traffic import VLLMDriver, load_profile, run_profile

    model, profile_path, out_path = sys.argv[1:4]
    llm = make_llm(model, max_model_len=512, enable_prefix_caching=True, block_size=32)
    report = run_profile(load_profile(profile_path), VLLMDriver(llm), progress=False)
    Path(out_path).write_text(report.model_dump_json(indent=2), encoding="utf-8")


if __name__ == "__main__":
    child_main(main)
