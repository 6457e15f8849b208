"""Every built-in solution on a GPU: synthetic workloads of every family it claims, a dataset
captured from the built-in engine, and the fla call-convention probe.

Usage:
    python bench/gpu_replay.py OUTDIR [--device cuda] [--skip-probe] [--skip-capture]
        [--solution NAME ...] [--repeats 10]

Steps, each reported as it ends (a later one still runs if an earlier one failed):

1. ``probe``: flash-linear-attention 0.6 on a 512-token, 32-value-head GDN sequence (16 q/k
   heads, head size 128, bf16) against a float64 recurrence: ``chunk_gated_delta_rule`` and
   ``fused_recurrent_gated_delta_rule`` called with keywords after ``v``, then the recurrent
   kernel called positionally like the chunk kernel ``(q, k, v, g, beta)`` — in a child
   process, since that call reads past the end of ``beta``.
2. ``synth``: per built-in solution and family, the family's example and a larger,
   model-sized variant, replayed with every built-in solution (one child process each).
3. ``capture``: the built-in qwen3_next model on the device under the tiny Mooncake profile,
   then the same replay of what it captured.

Writes OUTDIR/replay-*.json and OUTDIR/replay-*.txt; prints the tables.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

# Larger, model-sized variants per family (Qwen3-Next GDN per rank, Llama-ish norms and GQA,
# DeepSeek MLA). Everything else uses the family's example.
LARGE: dict[str, dict[str, Any]] = {
    "gdn_prefill": {"num_qk_heads": 16, "num_v_heads": 32, "head_size": 128},
    "gdn_decode": {"num_qk_heads": 16, "num_v_heads": 32, "head_size": 128},
    "rmsnorm": {"hidden_size": 4096},
    "fused_add_rmsnorm": {"hidden_size": 4096},
    "rmsnorm_offset": {"hidden_size": 2048},
    "gqa_ragged_prefill": {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128},
    "gqa_paged_decode": {"num_qo_heads": 32, "num_kv_heads": 8, "head_dim": 128},
    "mla_paged_decode": {"num_qo_heads": 16},
}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--skip-capture", action="store_true")
    parser.add_argument("--skip-probe", action="store_true")
    parser.add_argument("--solution", action="append",
                        help="Replay only this built-in solution (repeatable; default: all).")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--probe-positional", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe_positional:
        return _probe_positional()
    args.out.mkdir(parents=True, exist_ok=True)
    _environment()
    if not args.skip_probe:
        _step("probe", lambda: _probe(args.device))
    datasets = {}
    _step("synth", lambda: datasets.update(synth=_synth(args.out / "synth-ds")))
    if not args.skip_capture:
        _step("capture", lambda: datasets.update(
            capture=_capture(args.out / "capture-ds", args.device)))
    from enginetap.replay.builtin import BUILTINS

    # One solution at a time over the definitions it covers: torch:flex (compiled) last.
    chosen = [b for b in BUILTINS if not args.solution or b.name in args.solution]
    for builtin in chosen:
        for label, root in datasets.items():
            _step(f"replay {builtin.name} on {label}",
                  lambda b=builtin, n=label, r=root: _replay(r, n, b, args))
    return 0


def _step(name: str, body: Any) -> None:
    start = time.perf_counter()
    try:
        body()
        print(f"[{name}] done in {time.perf_counter() - start:.1f} s", flush=True)
    except Exception:
        print(f"[{name}] FAILED after {time.perf_counter() - start:.1f} s", flush=True)
        traceback.print_exc()


def _environment() -> None:
    import torch

    print("torch", torch.__version__, "cuda", torch.cuda.is_available(),
          torch.cuda.get_device_name() if torch.cuda.is_available() else "")
    for name in ("triton", "fla", "liger_kernel"):
        try:
            module = __import__(name)
            print(name, getattr(module, "__version__", "?"))
        except Exception as exc:  # report what is missing, keep going
            print(name, "not importable:", type(exc).__name__, exc)


# ------------------------------------------------------------------- 1. the fla probe

def _gdn_case(device: str) -> dict[str, Any]:
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    tokens, qk, hv, size = 512, 16, 32, 128

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    return {"q": randn(1, tokens, qk, size).bfloat16(), "k": randn(1, tokens, qk, size).bfloat16(),
            "v": randn(1, tokens, hv, size).bfloat16(),
            "g": -torch.exp(torch.rand(1, tokens, hv, generator=gen, device=device) * 4.5 - 4),
            "beta": torch.sigmoid(randn(1, tokens, hv) * 1.5),
            "h0": randn(1, hv, size, size) * 0.1, "scale": size ** -0.5}


def _recurrence64(c: dict[str, Any]) -> tuple[Any, Any]:
    """Token by token in float64: q/k L2-normalised (eps 1e-6), GVA by consecutive groups."""
    import torch

    group = c["v"].shape[2] // c["q"].shape[2]

    def norm(x: torch.Tensor) -> torch.Tensor:
        x = x.double().repeat_interleave(group, dim=2)[0]
        return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)

    q, k, v = norm(c["q"]) * c["scale"], norm(c["k"]), c["v"][0].double()
    g, beta, state = c["g"][0].double(), c["beta"][0].double(), c["h0"][0].double()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        state = state * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], state))
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], state)
    return out, state


def _errors(label: str, out: Any, state: Any, ref: tuple[Any, Any]) -> None:
    for name, got, want in (("output", out[0], ref[0]), ("final_state", state[0], ref[1])):
        got = got.double()
        nan = int(got.isnan().sum())
        finite = got.isfinite()
        err = (got - want).abs()[finite].max().item() if bool(finite.any()) else float("nan")
        first = ""
        if nan:
            index = [int(i) for i in got.isnan().nonzero()[0]]
            first = f"; first NaN at {index}"
        print(f"  {label:<44} {name:<12} NaN {nan:>8} of {got.numel():<9} "
              f"max|err| {err:.3g}{first}", flush=True)


def _probe(device: str) -> None:
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    c = _gdn_case(device)
    ref = tuple(x.to(device) for x in _recurrence64(c))
    common = {"scale": c["scale"], "initial_state": c["h0"], "output_final_state": True,
              "use_qk_l2norm_in_kernel": True}
    print("fla probe: T=512, 16 q/k heads, 32 v heads, head size 128, bf16; vs float64")
    out, state = chunk_gated_delta_rule(c["q"], c["k"], c["v"], g=c["g"], beta=c["beta"],
                                        **common)
    _errors("chunk_gated_delta_rule (keywords)", out, state, ref)
    out, state = fused_recurrent_gated_delta_rule(c["q"], c["k"], c["v"], g=c["g"],
                                                  beta=c["beta"], **common)
    _errors("fused_recurrent_gated_delta_rule (keywords)", out, state, ref)
    torch.cuda.synchronize()
    # Positional, as a prefill call is written: in a child, it may fault the CUDA context.
    run = subprocess.run([sys.executable, __file__, "-", "--probe-positional"],
                         capture_output=True, text=True, timeout=120)
    print(run.stdout.rstrip() or "  (no output)")
    if run.returncode:
        print(f"  positional call's process ended with {run.returncode}: "
              f"{run.stderr.strip().splitlines()[-1:] or ''}")


def _probe_positional() -> int:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    c = _gdn_case("cuda")
    ref = tuple(x.cuda() for x in _recurrence64(c))
    out, state = fused_recurrent_gated_delta_rule(
        c["q"], c["k"], c["v"], c["g"], c["beta"], scale=c["scale"], initial_state=c["h0"],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    _errors("fused_recurrent (q, k, v, g, beta) positional", out, state, ref)
    return 0


# ----------------------------------------------------------------- 2. synth, 3. capture

def _synth(root: Path) -> Path:
    from enginetap.dataset import Dataset
    from enginetap.definitions.registry import get_template
    from enginetap.replay.builtin import BUILTINS
    from enginetap.replay.synth import synthesize

    dataset = Dataset(root, create=True)
    families = dict.fromkeys(f for b in BUILTINS for f in b.adapters)
    for family in families:
        template = get_template(family)
        synthesize(dataset, template, workloads=2, seed=1)
        if family in LARGE:
            synthesize(dataset, template, LARGE[family], workloads=2, seed=11,
                       size_budget=1 << 30)
    return root


def _capture(root: Path, device: str) -> Path:
    from enginetap.jobs.capture import CaptureJob, run_capture
    from enginetap.models import build_model

    build_model("qwen3_next")
    job = CaptureJob("builtin", "builtin:qwen3_next", "builtin:mooncake-tiny", root,
                     max_output_tokens=4, progress=False, device=device)
    result = run_capture(job)
    print(f"captured {result.receipts} requests on {device}, status {result.status}")
    return root


def _replay(root: Path, label: str, builtin: Any, args: argparse.Namespace) -> None:
    from rich.console import Console

    from enginetap.dataset import Dataset
    from enginetap.definitions.base import family_of
    from enginetap.replay import replay_dataset
    from enginetap.replay.render import print_report, render_summary, summary_line

    covered = [name for name, d in Dataset(root).definitions().items()
               if family_of(d) in builtin.adapters]
    if not covered:
        print(f"{builtin.name}: the {label} dataset has no definition it covers")
        return
    report = replay_dataset(root, definitions=sorted(covered), solution=builtin.name,
                            device=args.device, warmup=2, repeats=args.repeats)
    stem = f"replay-{label}-{builtin.name.replace(':', '-')}"
    (args.out / f"{stem}.json").write_text(report.model_dump_json(indent=1))
    with (args.out / f"{stem}.txt").open("w") as handle:
        print_report(Console(file=handle, width=200), report)  # every row: to the file
    summary = render_summary(report)
    if summary is not None:
        Console(width=200).print(summary)
    print(f"{builtin.name} on {label}: {summary_line(report)}", flush=True)
    for line in [ln for ln in _problems(report)][:6]:
        print("  " + line)


def _problems(report: Any) -> list[str]:
    from enginetap.replay.render import problem_lines

    return problem_lines(report)


if __name__ == "__main__":
    sys.exit(main())
