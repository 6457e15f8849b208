"""The tap's real finding on a GPU, explained: a random-weight Llama at real width on the
built-in engine (bf16, batch 32, every prompt twice), recorded with ``enginetap tap run``,
reported, explained with ``enginetap tap explain`` and its REPRO replayed against
``torch:sdpa`` and ``torch:flex``. Everything goes through the CLI, as a user runs it.

Usage:
    python bench/gpu_explain.py OUTDIR [--hidden 5120] [--layers 8] [--batch 32]

Writes OUTDIR/explain-*.txt and OUTDIR/explain.json; prints each command and its output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path


def build(folder: Path, hidden: int, layers: int) -> None:
    """The built-in llama's tokenizer with a real-width config and random bf16 weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from enginetap.models import build_model

    tiny = build_model("llama")
    shutil.copytree(tiny, folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
    config = AutoConfig.from_pretrained(folder)
    heads = hidden // 128
    config.update({"hidden_size": hidden, "num_hidden_layers": layers,
                   "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 5),
                   "head_dim": 128, "intermediate_size": int(hidden * 2.7) // 256 * 256,
                   "torch_dtype": "bfloat16"})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()


def cli(out: Path, name: str, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "enginetap.cli.main", *args]
    print("$ enginetap " + " ".join(args), flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    text = done.stdout + done.stderr
    (out / f"explain-{name}.txt").write_text(f"$ enginetap {' '.join(args)}\n{text}"
                                            f"\nexit {done.returncode}, "
                                            f"{time.perf_counter() - start:.1f} s\n")
    print(text[-6000:], f"exit {done.returncode}", flush=True)
    return done


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu-explain"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = work / "model"
    build(model, args.hidden, args.layers)
    words = (Path(__file__).resolve().parents[1] / "src/enginetap/traffic/corpus.txt"
             ).read_text().split()
    rng = random.Random(0)
    distinct = [" ".join(rng.choice(words) for _ in range(rng.randint(60, 200)))
                for _ in range(args.batch // 2)]
    prompts = work / "prompts.txt"
    prompts.write_text("\n".join(distinct + distinct) + "\n")  # every prompt twice
    run = work / "run"
    cli(args.out, "run", "tap", "run", "--model", str(model), "--prompts", str(prompts),
        "--batch-size", str(args.batch), "--dtype", "bfloat16", "--device", "cuda",
        "--max-new-tokens", "8", "--out", str(run))
    cli(args.out, "report", "tap", "report", str(run))
    repro = work / "repro"
    done = cli(args.out, "explain", "tap", "explain", str(run), "--device", "cuda",
               "--solution", "torch:sdpa", "--solution", "torch:flex", "--out", str(repro),
               "--json")
    try:
        (args.out / "explain.json").write_text(json.dumps(json.loads(done.stdout), indent=1))
    except ValueError:
        pass
    if repro.is_dir():
        cli(args.out, "replay", "replay", str(repro), "--device", "cuda",
            "--solution", "torch:sdpa", "--solution", "torch:flex")
    return 0


if __name__ == "__main__":
    sys.exit(main())
