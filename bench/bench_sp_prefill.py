"""Sequence-parallel prefill at TP=2 on vLLM CPU: stock vs comm vs shard (and exact).

    flock /tmp/enginetap-vllm.lock python bench/bench_sp_prefill.py [--rows 512] [--repeats 15]

One run, one vLLM engine with sp_prefill armed: prefill-only requests (``--rows`` tokens,
one output token, one request per step), the mode switched on both workers before each
request (``collective_rpc``), round-robin over ``stock`` (mode ``off``: the stock path; the
armed wrappers only count the all-reduce's bytes), ``comm``, ``shard`` and ``exact``, so
machine noise hits every mode alike. The first round (each mode's proof, which runs both
paths, and warm-up) is not reported; then ``--repeats`` rounds. Per mode it reports the
median prefill step time, its ratio to stock, the bytes handed to each collective per
chunk and the time inside them (both from the patch's per-chunk records), and the rows
each rank's norms and residual adds ran on.
Separately it times one vLLM ``RMSNorm`` with residual add on all rows and on half of them:
the row-local work a rank saves per sublayer.

The model is the built-in llama made wider (``--hidden``, 4 layers, random weights), so
the GEMMs are not all overhead; ``VLLM_CPU_OMP_THREADS_BIND=nobind``, two workers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("stock", "comm", "shard", "exact")


def wide_llama(folder: Path, hidden: int) -> Path:
    """The built-in llama's files with a wider config and fresh random weights."""
    from safetensors.torch import save_file

    from enginetap.models import build_model
    from enginetap.models.weights import checkpoint_layout, draw_weights

    if (folder / "model.safetensors").exists():
        return folder
    shutil.copytree(build_model("llama"), folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=4,
                  num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                  head_dim=64)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = draw_weights(checkpoint_layout(folder), config, seed=0)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def child(model: str, rows: int, repeats: int, out: str) -> None:
    """In the vLLM process: one engine, modes switched on every worker between requests
    (``collective_rpc``), interleaved so machine noise hits every mode alike. The first
    round (each mode's proof, and warm-up) is not reported."""
    import random

    from vllm import LLM, SamplingParams

    from enginetap.patches.sp_prefill.patch import set_worker_mode

    llm = LLM(model=model, tensor_parallel_size=2, block_size=32, enforce_eager=True,
              gpu_memory_utilization=0.25, max_model_len=rows + 64,
              max_num_batched_tokens=rows, max_num_seqs=2, enable_prefix_caching=False, seed=0)
    engine, rng = llm.llm_engine, random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for i in range(repeats + 1):
        for mode in MODES:
            llm.collective_rpc(set_worker_mode, args=(_MODE[mode],))
            engine.add_request(f"{mode}{i}", {"prompt_token_ids": [
                rng.randrange(3, 500) for _ in range(rows)]}, params)
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            times[mode].append(time.perf_counter() - start)
    Path(out).write_text(json.dumps({mode: t[1:] for mode, t in times.items()}))


_MODE = {"stock": "off", "comm": "comm", "shard": "shard", "exact": "exact"}


def run_all(model: Path, rows: int, repeats: int, work: Path) -> dict:
    """One engine for every mode; per mode the median step time and chunk statistics."""
    config = {"enabled": True, "capabilities": ["sp_prefill"], "out_dir": str(work),
              "options": {"sp_prefill": {"mode": "shard", "min_rows": rows},
                          "step": {"record": False}}}
    (work / "arming.json").write_text(json.dumps(config))
    if not (work / "times.json").exists():  # --work DIR of an earlier run: report it again
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind",
               "ENGINETAP_CONFIG": str(work / "arming.json"),
               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        cmd = [sys.executable, __file__, "--child", str(model), "--rows", str(rows),
               "--repeats", str(repeats), "--out", str(work / "times.json")]
        with (work / "run.log").open("wb") as log:
            done = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  check=False)
        if done.returncode != 0:
            sys.exit(f"vLLM exited {done.returncode}; see {work / 'run.log'}")
    times = json.loads((work / "times.json").read_text())
    return {mode: {"median": statistics.median(times[mode]),
                   **_chunk_stats(work, rows, _MODE[mode])} for mode in MODES}


def _chunk_stats(out: Path, rows: int, mode: str) -> dict:
    """Bytes and collective time per served chunk of ``rows`` rows, rank 0 (medians)."""
    lines = (out / "sp_prefill-rank0.jsonl").read_text().splitlines()
    chunks = [r for r in map(json.loads, lines)
              if r["rows"] == rows and r["mode"] == mode and r["path"] in ("sp", "stock")]
    ops = sorted({op for r in chunks for op in r["bytes"]})
    return {"paths": sorted({r["path"] for r in chunks}),
            "bytes": {op: statistics.median(r["bytes"].get(op, 0) for r in chunks) for op in ops},
            "comm_s": statistics.median(sum(r["seconds"].values()) for r in chunks),
            "row_local_rows": chunks[-1]["row_local_rows"]}


def norm_times(rows: int, hidden: int, repeats: int = 50) -> tuple[float, float]:
    """Median seconds of vLLM's RMSNorm with residual add on ``rows`` and ``rows/2`` rows."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    with set_current_vllm_config(VllmConfig()):
        norm = RMSNorm(hidden).to(torch.bfloat16)
    inputs = {n: [torch.randn(n, hidden, dtype=torch.bfloat16) for _ in range(2)]
              for n in (rows, rows // 2)}
    samples: dict[int, list[float]] = {n: [] for n in inputs}
    for i in range(repeats + 5):  # interleaved; the first 5 rounds warm up
        for n, (x, r) in inputs.items():
            residual = r.clone()
            start = time.perf_counter()
            norm.forward_native(x, residual)
            if i >= 5:
                samples[n].append(time.perf_counter() - start)
    return statistics.median(samples[rows]), statistics.median(samples[rows // 2])


def report(results: dict, rows: int, hidden: int, norms: tuple[float, float]) -> None:
    stock = results["stock"]["median"]
    print(f"\nprefill chunk of {rows} rows, hidden {hidden}, 4 layers, TP=2 (vLLM CPU)")
    print("| mode | path | prefill step | ratio to stock | bytes per chunk (rank 0) "
          "| in collectives | norm rows per rank |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        moved = ", ".join(f"{op} {b / 2**20:.2f} MiB" for op, b in r["bytes"].items())
        print(f"| {mode} | {'/'.join(r['paths'])} | {r['median'] * 1e3:.1f} ms | "
              f"{r['median'] / stock:.2f} | {moved} | {r['comm_s'] * 1e3:.1f} ms | "
              f"{r['row_local_rows']} |")
    full, half = norms
    print(f"\nRMSNorm + residual add, {rows}×{hidden} bf16: {full * 1e6:.0f} µs; "
          f"{rows // 2} rows: {half * 1e6:.0f} µs (ratio {half / full:.2f}); per chunk the "
          f"stock path runs {4 * 2} of them on every rank, plus the final norm")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--work", type=Path, help="folder for models and runs (default: a "
                        "new temporary one); runs already there are reported, not re-run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.rows, args.repeats, args.out)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-sp-prefill-"))
    model = wide_llama(work / "model", args.hidden)
    results = run_all(model, args.rows, args.repeats, work)
    report(results, args.rows, args.hidden, norm_times(args.rows, args.hidden))
    print(f"\nraw: {work}")


if __name__ == "__main__":
    main()
