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
    engine: Annotated[str, typer.Option(help="builtin (transformers) or vllm.")] = "builtin",
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

    if engine not in ("builtin", "vllm"):
        raise ConfigError(f"unknown engine {engine!r}", "engines are builtin and vllm",
                          "pass --engine builtin or --engine vllm")
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
    if engine == "vllm":
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


# ---------------------------------------------------------------------- explain
@app.command("explain")
def explain(
    run_dir: Annotated[Path, typer.Argument(help="A tap run directory (`tap run --out`).")],
    out: Annotated[Path, typer.Option(help="REPRO: a new directory for the FlashInfer-Trace "
                                           "dataset of the culprit op.")],
    pair: Annotated[str | None, typer.Option(help="The pair to explain, A/B (default: the "
                                                  "first pair that split).")] = None,
    request: Annotated[str | None, typer.Option(help="A request key: its first split pair, "
                                                     "or with --diff its divergence.")] = None,
    diff_run: Annotated[Path | None, typer.Option(
        "--diff", help="Another run of the same prompts: explain a request's divergence "
                       "between the two runs.")] = None,
    device: Annotated[str | None, typer.Option(
        help="Where the built-in engine re-runs (cpu, cuda; default: the run's).")] = None,
    solution: Annotated[list[str] | None, typer.Option(
        help="A built-in solution (torch:sdpa, torch:flex...) to check for batch "
             "invariance on the same bytes; repeatable.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
) -> None:
    """Re-run a finding's prompts, catch the culprit op's calls, replay them alone, at
    other batch positions and twice, and say what kind of bug it is; write REPRO."""
    from enginetap.jobs.explain import explain as run_explain
    from enginetap.tap.culprit import find_culprit
    from enginetap.tap.files import load_run

    if pair is not None and (pair.count("/") != 1 or not all(pair.split("/"))):
        raise ConfigError(f"--pair {pair!r} is not A/B", "a pair is two request keys",
                          "pass --pair p0/p2 (keys from `enginetap tap report`)")
    if pair is not None and diff_run is not None:
        raise ConfigError("--pair and --diff together", "a pair is two requests of one run, "
                          "a diff one request in two runs", "pass one of them")
    keys = (pair.split("/")[0], pair.split("/")[1]) if pair is not None else None
    culprit = find_culprit(load_run(run_dir), pair=keys, request=request,
                           other=load_run(diff_run) if diff_run is not None else None)
    result = run_explain(culprit, out, device=device, solutions=list(solution or []))
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=1))
        return
    typer.echo(f"finding: {culprit.describe()}")
    typer.echo(f"op: {result.op}")
    typer.echo(f"verdict: {result.verdict}")
    for line in result.evidence:
        typer.echo(f"  {line}")
    for line in result.candidates:
        typer.echo(f"solution {line}")
    typer.echo(f"REPRO: {result.workloads} workload(s) of {result.definition} in {out} "
               f"(enginetap replay {out} --solution ...)")
