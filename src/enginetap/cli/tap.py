"""``enginetap tap``: record per-step fingerprints, report on a run, diff two runs."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer

from enginetap.errors import ConfigError
from enginetap.jobs.tap import PROMPT_FILES, PROMPTS_ABOUT

PROMPTS_HELP = ("builtin:NAME — " + "; ".join(f"{n}: {a}" for n, a in PROMPTS_ABOUT.items())
                + f" — or a FILE: {PROMPT_FILES} (`enginetap traffic list` lists them all).")

app = typer.Typer(help="Per-step sublayer fingerprints: record, report, diff.",
                  no_args_is_help=True)


@app.command("run")
def run(
    model: Annotated[str, typer.Option(help="builtin:NAME or a model folder.")],
    prompts: Annotated[str, typer.Option(help=PROMPTS_HELP)],
    out: Annotated[Path, typer.Option(help="Directory for the tap files.")],
    engine: Annotated[str, typer.Option(help="builtin (transformers), vllm or sglang.")
                      ] = "builtin",
    batch_size: Annotated[int, typer.Option(min=1)] = 8,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 8,
    max_rows: Annotated[int, typer.Option(min=1)] = 64,
    tp: Annotated[int, typer.Option(min=1, help="Tensor-parallel size (vllm).")] = 1,
    dtype: Annotated[str | None, typer.Option(
        help="Built-in engine: float32 (default), bfloat16 or float16; "
             "vLLM: auto (default: the model's), float32, bfloat16 or float16.")] = None,
    device: Annotated[str | None, typer.Option(
        help="Built-in engine: cpu (default), cuda or cuda:N. vLLM runs where its build does.")
    ] = None,
    depth: Annotated[str, typer.Option(
        help="sublayers (every sublayer's output) or layers (decoder layers' input and "
             "output only: about a third of the checkpoints).")] = "sublayers",
    mode: Annotated[str, typer.Option(
        help="Built-in engine: eager (default), compile (torch.compile of the decoder "
             "stack, checkpoints hashed in the graph) or graphs (CUDA-graph decode over a "
             "static KV cache, checkpoints hashed in the graphs; needs --device cuda). vLLM: "
             "eager (default) or compile (not enforce_eager: vLLM's own compilation config).")
    ] = "eager",
    force: Annotated[bool, typer.Option(
        "--force", help="Replace a previous run's tap files in --out (refused without).")
    ] = False,
    vectors: Annotated[str, typer.Option(
        help="off, or split: also write the raw rows (safetensors) at each same-prefix "
             "pair's first split.")] = "off",
    vector_steps: Annotated[str | None, typer.Option(
        help="FIRST:LAST (or STEP): write the raw rows of those steps.")] = None,
    vector_checkpoints: Annotated[str | None, typer.Option(
        help="With --vector-steps: only these checkpoints (names or prefixes, comma-"
             "separated, e.g. L0.mlp,L1).")] = None,
    vector_requests: Annotated[str | None, typer.Option(
        help="With --vector-steps: only rows of these requests (comma-separated, e.g. "
             "p0,p6).")] = None,
) -> None:
    """Record a tap run of PROMPTS (request ids p0, p1, ... so runs align)."""
    from enginetap.jobs.device import check_device, check_dtype, require_vllm
    from enginetap.jobs.tap import (load_prompts, prepare_out, record_run, record_vllm_run,
                                   save_run_command, vector_options)

    if engine not in ("builtin", "vllm", "sglang"):
        raise ConfigError(f"unknown engine {engine!r}", "engines are builtin, vllm and sglang",
                          "pass --engine builtin, vllm or sglang")
    if tp > 1 and engine != "vllm":
        raise ConfigError("--tp needs --engine vllm", "the built-in engine runs one rank",
                          "pass --engine vllm, or drop --tp")
    device = check_device(device, engine)
    dtype = check_dtype(dtype, engine, "float32" if engine == "builtin" else "auto")
    if depth not in ("sublayers", "layers"):
        raise ConfigError(f"unknown depth {depth!r}", "the tap records sublayers or layers",
                          "pass --depth sublayers or --depth layers")
    if mode not in ("eager", "compile", "graphs"):
        raise ConfigError(f"unknown mode {mode!r}", "the built-in engine runs eager, "
                          "compiled or by CUDA graphs", "pass --mode eager, compile or graphs")
    if mode == "graphs" and device != "cuda":
        raise ConfigError("--mode graphs needs --device cuda", "CUDA graphs replay on a "
                          "CUDA device", "add --device cuda, or pass --mode eager")
    if mode != "eager" and engine != "builtin" and (engine, mode) != ("vllm", "compile"):
        raise ConfigError(f"--mode {mode} needs --engine builtin", f"{engine} is tapped in "
                          "its own (eager) mode here", "drop --mode, or pass --engine builtin")
    if mode != "eager" and (vectors != "off" or vector_steps):
        raise ConfigError(f"--mode {mode} writes no raw rows", "its checkpoints are hashed "
                          "inside the compiled graph, no rows are staged",
                          "drop --vectors / --vector-steps, or run --mode eager")
    texts = load_prompts(prompts)
    if engine == "vllm":
        require_vllm("tap")
    prepare_out(out, force=force)
    command = {"engine": engine, "model": model, "prompts": prompts, "batch_size": batch_size,
               "max_new_tokens": max_new_tokens, "max_rows": max_rows, "tp": tp,
               "dtype": dtype, "device": device, "depth": depth, "mode": mode}
    tap = {"max_rows": max_rows, "depth": depth,
           **vector_options(out, vectors, vector_steps, vector_checkpoints, vector_requests)}
    if engine == "sglang":
        from enginetap.jobs.tap import record_sglang_run

        outputs = record_sglang_run(model, texts, out, batch_size=batch_size,
                                    max_new_tokens=max_new_tokens, tap=tap, dtype=dtype)
    elif engine == "vllm":
        outputs = record_vllm_run(model, texts, out, batch_size=batch_size,
                                  max_new_tokens=max_new_tokens, tap=tap, tp=tp, dtype=dtype,
                                  compile=mode == "compile")
    else:
        outputs = record_run(model, texts, out, batch_size=batch_size,
                             max_new_tokens=max_new_tokens, tap=tap, dtype=dtype, device=device,
                             compile=mode == "compile", mode=mode)
    save_run_command(out, command)
    typer.echo(f"recorded {len(outputs)} request(s) in batches of {batch_size} to {out}")


@app.command("report")
def report(
    run_dir: Annotated[Path, typer.Argument(help="A tap run directory.")],
    html: Annotated[Path | None, typer.Option(help="Write one self-contained HTML page.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print findings as JSON.")] = False,
) -> None:
    """Pairs, continuity, metadata and sampler findings of one run."""
    from enginetap.tap.analysis.files import load_run
    from enginetap.tap.analysis.report import analyse, html_page, summary

    run = load_run(run_dir)
    if html is not None:
        _refuse_page_target(html, [run])
    analysis = analyse(run)
    if as_json:
        typer.echo(json.dumps({
            "ranks": [{"rank": r.rank, "pairs_compared": r.pairs.pairs_compared,
                       "pairs_split": r.pairs.pairs_split,
                       "splits": [p.to_json() for p in r.pairs.splits],
                       "continuity": [v.to_json() for v in r.continuity],
                       "metadata": [v.to_json() for v in r.metadata],
                       "metadata_checked": r.metadata_rows,
                       "sampler": [f.to_json() for f in r.sampler]} for r in analysis.ranks],
            "cross_rank": [m.to_json() for m in analysis.cross_rank]}, indent=1))
    else:
        typer.echo("\n".join(summary(analysis)))
    if html is not None:
        _write_page(html, html_page(analysis, run_dir))


@app.command("diff")
def diff(
    run_a: Annotated[Path, typer.Argument(help="Tap run A.")],
    run_b: Annotated[Path, typer.Argument(help="Tap run B (same prompts).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the diff as JSON.")] = False,
    html: Annotated[Path | None, typer.Option(help="Write one self-contained HTML page.")] = None,
) -> None:
    """First diverging (step, layer, sublayer) per request and overall; exit 1 if any."""
    from enginetap.tap.analysis.diff import check_comparable, diff_runs, nothing_compared
    from enginetap.tap.analysis.files import TapError, load_run
    from enginetap.tap.analysis.report import diff_page

    first, second = load_run(run_a), load_run(run_b)
    if html is not None:
        _refuse_page_target(html, [first, second])
    warnings = check_comparable(first, second)
    diffs = diff_runs(first, second)
    why = nothing_compared(first, second, diffs)
    if why is not None:
        raise TapError(f"nothing compared between {run_a} and {run_b}", why,
                       "diff two runs of the same prompts recorded with the same tap depth")
    for warning in warnings:
        typer.echo(f"warning: {warning}", err=True)
    lines = [_describe(d) for d in diffs]
    typer.echo(json.dumps([d.to_json() for d in diffs], indent=1) if as_json
               else "\n".join(lines))
    if html is not None:
        said = [f"warning: {w}" for w in warnings] + "\n".join(lines).splitlines()
        _write_page(html, diff_page(diffs, first, said))
    raise typer.Exit(1 if any(d.diverged for d in diffs) else 0)


def _refuse_page_target(html: Path, runs: list[Any]) -> None:
    """The page must not replace a file it was made from (a rank file, through a link or
    not), nor a directory, nor take a rank file's name in a run's directory (the next
    reading of the run would take the page for a rank).

    Raises:
        TapError: ``html`` is a directory or one of the runs' files.
    """
    import re

    from enginetap.tap.analysis.files import TapError

    if html.is_dir():
        raise TapError(f"--html {html} is a directory", "the page is one file",
                       "pass a file path, e.g. --html report.html")
    for run in runs:
        for rank in run.ranks.values():
            if os.path.abspath(html) == os.path.abspath(rank.path) or (
                    html.exists() and html.samefile(rank.path)):
                raise TapError(f"--html {html} is the recorded file {rank.path}",
                               "writing the page there would destroy the run",
                               "pass another path, e.g. --html report.html")
            if os.path.abspath(html.parent) == os.path.abspath(rank.path.parent) \
                    and re.fullmatch(r".*-rank\d+\.jsonl", html.name):
                raise TapError(f"--html {html} takes a rank file's name in the run's "
                               "directory", "the run would then hold a page as a rank",
                               "pass another path, e.g. --html report.html")


def _write_page(html: Path, page: str) -> None:
    """Write the page atomically: a full disk or a crash leaves the previous page whole.

    Raises:
        TapError: the write failed (the previous page, if any, is left as it was).
    """
    from enginetap.dataset.atomic import replace_text
    from enginetap.tap.analysis.files import TapError

    try:
        replace_text(html, page)
    except OSError as exc:
        raise TapError(f"cannot write the HTML page to {html}", exc.strerror or str(exc),
                       "free some space or pass --html a writable path; any previous page "
                       "there is unchanged") from None
    typer.echo(f"wrote {html}")


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
    from enginetap.tap.analysis.culprit import find_culprit
    from enginetap.tap.analysis.files import load_run

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
