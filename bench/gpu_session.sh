#!/usr/bin/env bash
# One run on a CUDA machine: the suite's GPU tests, then the benchmarks on the GPU.
# Usage: bash bench/gpu_session.sh OUTDIR   (enginetap importable: installed, or PYTHONPATH=src)
# Writes OUTDIR/gpu-tests.log and OUTDIR/bench-*.txt; prints a short summary last.
set -uo pipefail
out=${1:?usage: bench/gpu_session.sh OUTDIR}
mkdir -p "$out"
export ENGINETAP_CACHE=${ENGINETAP_CACHE:-/tmp/enginetap-cache} PYTHONUNBUFFERED=1
python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count(), "GPU(s):", torch.cuda.get_device_name())'
python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests 2>&1 | tee "$out/gpu-tests.log" | tail -15
python3 bench/bench_guard.py --device cuda --repeats 9 2>/dev/null | tee "$out/bench-guard-cuda.txt"
for model in llama qwen3_next deepseek_v3; do
  python3 bench/bench_patching.py --device cuda --model "$model" --repeats 7 2>/dev/null \
    | tee "$out/bench-patching-cuda-$model.txt"
done
ds=$(mktemp -d)/ds
python3 -m enginetap.cli.main definitions synth "$ds" --all --workloads 2 >/dev/null
COLUMNS=160 python3 -m enginetap.cli.main replay "$ds" --device cuda --warmup 3 --repeats 20 \
  --json "$out/replay-cuda.json" > "$out/replay-cuda.txt" 2>&1
tail -1 "$out/replay-cuda.txt"
