"""The tap report page for a newcomer: findings ordered by what matters, each with its next
commands (which, run, write the raw rows whose size the page then states), a legend for
the layer x step picture, no stray status text, no "None" in empty cells. Runs the CLI
end to end and opens the page in headless Chromium."""

from __future__ import annotations

import html
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from enginetap.errors import ConfigError
from enginetap.tap.analysis.files import load_run
from enginetap.tap.analysis.report import analyse, html_page, next_commands
from enginetap.jobs.tap import vector_options

from .conftest import Recorder, requests

# qwen3_moe in float32 over builtin:pairs at batch 8: same-prefix pairs split where their
# batch shapes differ (attention over padded rows, the experts' grouping)
RUN = ["tap", "run", "--model", "builtin:qwen3_moe", "--prompts", "builtin:pairs",
       "--max-new-tokens", "4"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "COLUMNS": "400"}
    done = subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def _findings(page: str) -> list[str]:
    return re.findall(r"<div class='finding'>(.*?)</div>", page, re.S)


def _commands(finding: str) -> list[str]:
    block = re.search(r"<pre class='next'>(.*?)</pre>", finding, re.S).group(1)
    return html.unescape(block).splitlines()


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str]:
    cwd = tmp_path_factory.mktemp("report")
    _cli(*RUN, "--out", "run", cwd=cwd)
    _cli("tap", "report", "run", "--html", "run.html", cwd=cwd)
    return cwd, cwd / "run", (cwd / "run.html").read_text(encoding="utf-8")


def test_findings_come_earliest_split_first_with_equal_pairs_folded(cli_run) -> None:
    _, run, page = cli_run
    pairs = analyse(load_run(run)).ranks[0].pairs
    assert pairs.splits and pairs.pairs_compared > pairs.pairs_split
    findings = _findings(page)
    assert len(findings) == len(pairs.splits)  # one block per split, none for equal pairs
    steps = [int(re.search(r"first split at step (\d+)", f).group(1)) for f in findings]
    assert steps == sorted(steps) and steps[0] == min(s.step for s in pairs.splits)
    # pairs that never split are counted below the findings, not listed first
    equal = re.search(r"(\d+) of (\d+) same-prefix row pair\(s\) stayed equal", page)
    assert equal and page.index(equal.group(0)) > page.rindex("<div class='finding'>")
    assert int(equal.group(1)) == pairs.pairs_compared - pairs.pairs_split


def test_the_page_has_no_stray_status_and_no_none(cli_run) -> None:
    _, _, page = cli_run
    text = re.sub(r"<(script|style)>.*?</\1>", "", page, flags=re.S)
    text = re.sub(r"<[^>]+>", " ", text)
    assert "rendered" not in text and "static" not in text
    assert not re.search(r"\bNone\b", text)


def test_next_commands_run_and_the_page_then_says_the_split_size(cli_run) -> None:
    cwd, run, page = cli_run
    first = _findings(page)[0]
    assert "no raw rows were written at this split" in first
    dump, report, alone, diff = _commands(first)
    assert dump.startswith("enginetap tap run ") and "--vector-steps" in dump
    assert "--batch-size 1" in alone and diff == "enginetap tap diff run run-b1"
    _cli(*shlex.split(dump)[1:], cwd=cwd)   # the run again, writing the split's raw rows
    _cli(*shlex.split(report)[1:], cwd=cwd)
    again = (cwd / shlex.split(report)[-1]).read_text(encoding="utf-8")
    keys = re.search(r"<b>1\. (\S+) / (\S+)</b>", first).groups()
    sized = next(f for f in _findings(again) if f"<b>{keys[0]} / {keys[1]}</b>" in
                 re.sub(r"<b>\d+\. ", "<b>", f))
    size = re.search(r"Size: (\d+) of (\d+) elements differ, max \|a - b\| ([0-9.e+-]+)",
                     html.unescape(sized))
    assert size is not None, sized
    differing, width, largest = int(size.group(1)), int(size.group(2)), float(size.group(3))
    assert 0 < differing <= width and largest > 0


@pytest.mark.skipif(shutil.which("chromium") is None, reason="chromium is not installed")
def test_chromium_shows_the_legend_and_the_first_findings_next_command(cli_run) -> None:
    cwd, run, page = cli_run
    done = subprocess.run(["chromium", "--headless", "--no-sandbox", "--disable-gpu",
                           "--dump-dom", (cwd / "run.html").as_uri()],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert 'data-rendered="yes"' in dom  # the script ran to its end
    legend = re.search(r'<p class="legend grid-legend">(.*?)</p>', dom, re.S)
    assert legend and "one row per decoder layer" in legend.group(1)
    assert "one column per recorded engine step" in legend.group(1)
    first = re.search(r'<div class="finding">(.*?)</div>', dom, re.S).group(1)
    block = html.unescape(re.search(r'<pre class="next">(.*?)</pre>', first, re.S).group(1))
    assert block.splitlines() == _commands(_findings(page)[0])
    assert block.startswith("enginetap tap run --engine builtin --model builtin:qwen3_moe")


def test_a_run_armed_without_the_cli_gets_placeholder_commands(record: Recorder) -> None:
    _, run = record("qwen3_moe", requests(["the cache holds every key", "kernels",
                                            "the cache holds every key", "a longer prompt "
                                            "about batching", "kernels"], max_new_tokens=3))
    page = html_page(analyse(run), run.root)
    split = analyse(run).ranks[0].pairs.splits
    if split:
        assert "--model MODEL --prompts PROMPTS" in page and "put its model and prompts" in page
        assert next_commands(split[0], "R", None)[0].startswith(
            "enginetap tap run --model MODEL --prompts PROMPTS --out R-split")


def test_vector_flags_are_checked(tmp_path: Path) -> None:
    assert vector_options(tmp_path, "off", None, None, None) == {}
    assert vector_options(tmp_path, "split", None, None, None) == {"vectors": "split"}
    assert vector_options(tmp_path, "off", "3:5", None, None) == {
        "vectors": "window", "vector_steps": [3, 5]}
    control = vector_options(tmp_path, "off", "2", "L0.mlp, L1", "p0,p6")
    assert control["vectors"] == "control"
    assert Path(control["vector_control"]).read_text() == (
        '{"steps": [2, 2], "checkpoints": ["L0.mlp", "L1"], "requests": ["p0", "p6"]}\n')
    for args, message in [(("all", None, None, None), "unknown --vectors"),
                          (("off", None, "L1", None), "need --vector-steps"),
                          (("split", "1:2", None, None), "do not go together"),
                          (("off", "5:2", None, None), "bad --vector-steps"),
                          (("off", "a:b", None, None), "bad --vector-steps")]:
        with pytest.raises(ConfigError, match=message):
            vector_options(tmp_path, *args)
