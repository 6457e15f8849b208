"""Where the default tap's cost goes through the built-in engine's loop on a GPU: step times
of ``disarmed``, the default ``tap``, the tap with its record written on the engine's thread
(``tap-syncsink``), with a 0.1 ms GIL switch interval (``tap-swi``) and ``tap-fp``,
interleaved over 3 rounds; then torch.profiler tables (by self CPU time: kernel launches,
copies, aten ops with their call counts) of one generate of ``tap`` and of ``disarmed``.
Random-weight bf16 Llama, hidden 5120, 48 layers, 512-token prompts, 40 new tokens.

    PYTHONPATH=src python3 bench/tap_profile_gpu.py 64     # the batch size
"""
import statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
import torch
import bench_tap_engine as B
from enginetap.tap.record import recorder as R
from enginetap.core.sink import RecordSink

B.DEVICE[0] = "cuda"
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
model = B.build(5120, 48, "cuda", torch.bfloat16)
gen = torch.Generator().manual_seed(batch)
prompts = torch.randint(3, 32000, (batch, 512), generator=gen).tolist()
reqs = [B.Request(request_id=f"q{i}", prompt_ids=p, max_new_tokens=40) for i, p in enumerate(prompts)]
out = Path(tempfile.mkdtemp())

def variant(name):
    if name == "tap-syncsink":
        R.RecordSink = lambda w, deferred, name: RecordSink(w, deferred=False, name=name)
        try:
            return B.run_variant("tap", model, reqs, out, 64, clock)
        finally:
            R.RecordSink = RecordSink
    if name == "tap-swi":
        old = sys.getswitchinterval(); sys.setswitchinterval(1e-4)
        try:
            return B.run_variant("tap", model, reqs, out, 64, clock)
        finally:
            sys.setswitchinterval(old)
    return B.run_variant(name, model, reqs, out, 64, clock)

names = ["disarmed", "tap", "tap-syncsink", "tap-swi", "tap-fp"]
res = {n: [] for n in names}
clock = B.Clock(); B.run_variant("disarmed", model, reqs, out, 64, clock)
for r in range(3):
    for n in names[r % len(names):] + names[:r % len(names)]:
        clock = B.Clock()
        variant(n)
        st = clock.steps()
        res[n].append((statistics.median(st) * 1e3, [round(s * 1e3, 1) for s in st]))
for n in names:
    meds = [m for m, _ in res[n]]
    print(f"b{batch} {n:14s} median/round {[round(m, 2) for m in meds]}  steps(last round) {res[n][-1][1]}")
from torch.profiler import profile, ProfilerActivity
for n in ("tap", "disarmed"):
    clock = B.Clock()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        variant(n)
    print(f"\n==== torch.profiler {n} b{batch}: by self CPU")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=28, max_name_column_width=60))
