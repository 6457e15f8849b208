"""``enginetap tap``: record per-step fingerprints, report on a run, diff two runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from enginetap.errors import ConfigError

app = typer.Typer(help="Per-step sublayer fingerprints: record, report, diff.",
                  no_args_is_help=True)


@app.command("run")
def run(
    model: Annotated[str, typer.Option(help="builtin:NAME or a model folder.")],
    prompts: Annotated[str, typer.Option(help="A prompt FILE or builtin:NAME (pairs, short).")],
    out: Annotated[Path, typer.Option(help="Directory for the tap files.")],
    engine: Annotated[str, typer.Option(help="builtin (transformers), vllm or sglang.")
                      ] = "builtin",
    batch_size: Annotated[int, typer.Option(min=1)] = 8,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 8,
    max_rows: Annotated[int, typer.Option(min=1)] = 64,
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel size (vllm).")] = 1,
    dtype: Annotated[str, typer.Option(
        help="float32 or bfloat16 (builtin; vLLM takes the model's).")] = "float32",
    depth: Annotated[str, typer.Option(
        help="sublayers (every sublayer's output) or layers (decoder layers' input and "
             "output only: about a third of the checkpoints).")] = "sublayers",
) -> None:
    """Record a tap run of PROMPTS (request ids p0, p1, ... so runs align)."""
    from enginetap.tap.run import load_prompts, record_run, record_vllm_run

    if engine not in ("builtin", "vllm", "sglang"):
        raise ConfigError(f"unknown engine {engine!r}", "engines are builtin, vllm and sglang",
                          "pass --engine builtin, vllm or sglang")
    if tp > 1 and engine != "vllm":
        raise ConfigError("--tp needs --engine vllm", "the built-in engine runs one rank",
                          "pass --engine vllm, or drop --tp")
    if dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"unknown dtype {dtype!r}", "the built-in engine runs float32 or "
                          "bfloat16", "pass --dtype float32 or --dtype bfloat16")
    if depth not in ("sublayers", "layers"):
        raise ConfigError(f"unknown depth {depth!r}", "the tap records sublayers or layers",
                          "pass --depth sublayers or --depth layers")
    texts = load_prompts(prompts)
    tap = {"max_rows": max_rows, "depth": depth}
    if engine == "sglang":
        from enginetap.engines.sglang.run import record_sglang_run

        outputs = record_sglang_run(model, texts, out, batch_size=batch_size,
                                    max_new_tokens=max_new_tokens, tap=tap)
    elif engine == "vllm":
        outputs = record_vllm_run(model, texts, out, batch_size=batch_size,
                                  max_new_tokens=max_new_tokens, tap=tap, tp=tp)
    else:
        outputs = record_run(model, texts, out, batch_size=batch_size,
                             max_new_tokens=max_new_tokens, tap=tap, dtype=dtype)
    typer.echo(f"recorded {len(outputs)} request(s) in batches of {batch_size} to {out}")


@app.command("report")
def report(
    run_dir: Annotated[Path, typer.Argument(help="A tap run directory.")],
    html: Annotated[Path | None, typer.Option(help="Write one self-contained HTML page.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print findings as JSON.")] = False,
) -> None:
    """Pairs, continuity, metadata and sampler findings of one run."""
    from enginetap.tap.files import load_run
    from enginetap.tap.report import analyse, html_page, summary

    analysis = analyse(load_run(run_dir))
    if as_json:
        typer.echo(json.dumps({
            "ranks": [{"rank": r.rank, "pairs": [p.to_json() for p in r.pairs],
                       "continuity": [v.to_json() for v in r.continuity],
                       "metadata": [v.to_json() for v in r.metadata],
                       "metadata_checked": r.metadata_rows,
                       "sampler": [vars(f) for f in r.sampler]} for r in analysis.ranks],
            "cross_rank": [m.to_json() for m in analysis.cross_rank]}, indent=1))
    else:
        typer.echo("\n".join(summary(analysis)))
    if html is not None:
        html.write_text(html_page(analysis), encoding="utf-8")
        typer.echo(f"wrote {html}")


@app.command("diff")
def diff(
    run_a: Annotated[Path, typer.Argument(help="Tap run A.")],
    run_b: Annotated[Path, typer.Argument(help="Tap run B (same prompts).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the diff as JSON.")] = False,
    html: Annotated[Path | None, typer.Option(help="Write one self-contained HTML page.")] = None,
) -> None:
    """First diverging (step, layer, sublayer) per request and overall; exit 1 if any."""
    from enginetap.tap.diff import diff_runs
    from enginetap.tap.files import load_run
    from enginetap.tap.report import diff_page

    first = load_run(run_a)
    diffs = diff_runs(first, load_run(run_b))
    lines = [_describe(d) for d in diffs]
    typer.echo(json.dumps([d.to_json() for d in diffs], indent=1) if as_json
               else "\n".join(lines))
    if html is not None:
        html.write_text(diff_page(diffs, first, "\n".join(lines).splitlines()), encoding="utf-8")
        typer.echo(f"wrote {html}")
    raise typer.Exit(1 if any(d.diverged for d in diffs) else 0)


def _describe(d) -> str:
    where = (f"ranks merged (A {d.merged[0]}, B {d.merged[1]}; checkpoints whole on every "
             "rank compared)" if d.merged else f"rank {d.rank}")
    lines = [f"{where}: {d.rows_compared} aligned rows compared, {d.rows_diverged} "
             f"diverged, {d.rows_token_diverged} with different earlier tokens, "
             f"{d.only_a} only in A, {d.only_b} only in B"]
    if d.first is not None:
        f = d.first
        lines.append(f"  first divergence: step {f.step_a} (B: {f.step_b}) layer {f.layer} "
                     f"sublayer {f.sublayer} request {f.key} position {f.position}")
    for key, f in sorted(d.per_request.items()):
        lines.append(f"  {key}: position {f.position} step {f.step_a} {f.checkpoint}")
    for key, pos in sorted(d.first_token_split.items()):
        lines.append(f"  {key}: tokens differ from position {pos}")
    if not d.diverged:
        lines.append("  no divergence")
    return "\n".join(lines)
