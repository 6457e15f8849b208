"""A new user's first hour, from the command line in a pipe (not a TTY, ``COLUMNS`` unset):
the demo's "next" hint runs as printed with a one-family kernel, nothing printed is cut,
and a subtle kernel bug does not pass without a hint."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from enginetap.dataset import Dataset
from enginetap.definitions.base import family_of
from enginetap.definitions.registry import get_template

RMSNORM_TWICE = """\
import torch


def {name}(hidden_states, weight, eps):
    x = hidden_states.to(torch.float32)
    row = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps{eps})
    row = row.to(hidden_states.dtype).to(torch.float32)
    out = (row * weight.to(torch.float32)).to(hidden_states.dtype)
    {extra}return out
"""


def _kernel(name: str, eps: str = "", extra: str = "") -> str:
    return RMSNORM_TWICE.format(name=name, eps=eps, extra=extra)


def _enginetap(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # A pipe, as in a log or CI: stdout is not a terminal and no width is asked for.
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLUMNS", "FORCE_TERMINAL", "TTY_COMPATIBLE")}
    return subprocess.run([sys.executable, "-m", "enginetap.cli.main", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The demo on the built-in llama: its dataset and what it printed."""
    out = tmp_path_factory.mktemp("first-hour") / "demo out"  # a space: the hint quotes it
    done = _enginetap("demo", "--out", str(out), "--models", "llama", "--max-output-tokens",
                      "2", cwd=out.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    # progress lines instead of silence while the traffic runs
    assert re.search(r"traffic mooncake-tiny: \d+/\d+ prompts done", done.stderr)
    return out / "dataset" / "llama", done.stdout


def _tables(text: str, first: str) -> list[dict[str, str]]:
    """The rows of every plain table whose header starts with column ``first``, by column
    name (columns are where the dashed line under the header says)."""
    lines, rows = text.splitlines(), []
    for at, line in enumerate(lines[:-1]):
        dashes = lines[at + 1]
        if line.split()[:1] != [first] or not _dashed(dashes):
            continue
        spans = [m.start() for m in re.finditer(r"-+", dashes)]
        names = [line[a:b].strip() for a, b in zip(spans, [*spans[1:], None])]
        for k, row in enumerate(lines[at + 2:], at + 2):
            after = lines[k + 1] if k + 1 < len(lines) else ""
            if not row.strip() or row.startswith(_NOT_ROWS) or _dashed(after):
                break  # the end, or the header of the next table
            rows.append({n: row[a:b].strip() for n, a, b in zip(names, spans,
                                                                 [*spans[1:], None])})
    return rows


def _dashed(line: str) -> bool:
    return bool(line.strip()) and not set(line) - {"-", " "}


_NOT_ROWS = ("PROBLEM ", "FAIL ", "ERROR ", "SKIPPED ", "REFUSED ", "NOTE ", "ok:", "not ok:",
             "definition x solution")


def _assert_nothing_cut(text: str, names: list[str]) -> None:
    assert "…" not in text and "Traceback" not in text
    for name in names:
        # whole: not glued to more of an identifier on either side ("name:" ends a line head)
        assert re.search(rf"(?<![\w.:/-]){re.escape(name)}(?![\w./-]|:\w)", text), name


def test_the_demos_hint_runs_a_one_family_kernel_in_a_pipe(demo: tuple[Path, str],
                                                          tmp_path: Path) -> None:
    root, printed = demo
    definitions = Dataset(root).definitions()
    families = {name: family_of(d) for name, d in definitions.items()}
    _assert_nothing_cut(printed, list(definitions))
    lines = printed.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("demo ok: next"))
    assert "fn(hidden_states, weight, eps) returning output" in lines[at]
    hint = lines[at + 1].strip()  # the command on a line of its own, whole
    argv = shlex.split(hint)
    assert argv[:2] == ["enginetap", "replay"] and Path(argv[2]) == root
    assert argv[3:] == ["--family", "rmsnorm", "--solution", "my_kernels.py:fn"]
    (tmp_path / "my_kernels.py").write_text(_kernel("fn"))

    done = _enginetap(*argv[1:], cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    others = sorted(n for n, f in families.items() if f != "rmsnorm")
    mine = sorted(n for n, f in families.items() if f == "rmsnorm")
    assert others and mine
    for name in others:  # every other family is SKIPPED with the reason, one line each
        assert (f"SKIPPED {name}: not replayed: its family {families[name]} is not in "
                "--family rmsnorm") in done.stdout.splitlines()
    summary = _tables(done.stdout, "definition")
    assert sorted(r["definition"] for r in summary) == mine
    assert all((r["solution"], r["status"], r["agreement"]) == ("my_kernels.py:fn", "PASS",
                                                                "exact") for r in summary)
    _assert_nothing_cut(output, [*definitions, "my_kernels.py:fn", "PASS", "SKIPPED"])
    count = sum(len(Dataset(root).workloads(n)) for n in mine)
    assert done.stdout.splitlines()[-1] == f"ok: {2 * count} PASS, {len(others)} SKIPPED"


def test_a_kernel_within_tolerance_is_told_apart_from_an_exact_one(demo: tuple[Path, str],
                                                                 tmp_path: Path) -> None:
    """eps x 10 beside a correct kernel: each line says exact / within tolerance / failing,
    with max abs, max rel and the tolerance; the engine was exact, and that is said."""
    root, _ = demo
    name = next(n for n, d in Dataset(root).definitions().items() if family_of(d) == "rmsnorm")
    (tmp_path / "kernels.py").write_text(
        'ENGINETAP_IMPLEMENTS = "rmsnorm"\n' + _kernel("rms_good") + "\n\n"
        + _kernel("rms_eps10", eps=" * 10") + "\n\n"
        + _kernel("rms_broken", extra="out[0, 0] += 1.0\n    "))
    solutions = ["kernels.py:rms_good", "kernels.py:rms_eps10", "kernels.py:rms_broken"]
    done = _enginetap("replay", str(root), *[a for s in solutions for a in ("--solution", s)],
                      "--repeats", "1", cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output  # rms_broken fails
    _assert_nothing_cut(output, [name, *solutions])
    rule = get_template("rmsnorm").rule("output")
    atol, rtol = rule.atol, rule.rtol
    assert atol is not None and rtol is not None
    tol = f"atol={atol:.3g} rtol={rtol:.3g}"
    summary = {r["solution"]: r for r in _tables(done.stdout, "definition")
               if r["definition"] == name}
    good, eps10, broken = (summary[s] for s in solutions)
    assert (good["status"], good["agreement"], good["max abs"], good["max rel"],
            good["tolerance"]) == ("PASS", "exact", "0", "0", tol)
    assert eps10["status"] in ("PASS", "FAIL") and eps10["tolerance"] == tol
    assert eps10["agreement"] in ("within tolerance (engine: exact)", "failing (engine: exact)")
    assert float(eps10["max abs"]) > 0 and float(eps10["max rel"]) > 0
    assert (broken["status"], broken["agreement"]) == ("FAIL", "failing (engine: exact)")
    assert float(broken["max abs"]) >= 1.0 and broken["tolerance"] == tol
    notes = [line for line in done.stdout.splitlines() if line.startswith("NOTE ")]
    assert any(line.startswith(f"NOTE kernels.py:rms_eps10 on {name}: ") and
               "the engine's own output matched the reference exactly" in line and tol in line
               for line in notes)
    assert not any("rms_good" in line for line in notes)
    # every per-workload row says how close it came, with its numbers and tolerance
    rows = [r for r in _tables(done.stdout, "workload") if re.fullmatch(r"[0-9a-f]{8}",
                                                                        r["workload"])]
    mine = [r for r in rows if r["check"] in solutions]
    assert len(mine) == 3 * len(Dataset(root).workloads(name))
    assert all(r["tolerance"] == tol and r["max abs"] != "-" for r in mine)
    assert {r["agreement"] for r in mine if r["check"] == "kernels.py:rms_good"} == {"exact"}
    assert {r["agreement"] for r in rows if r["check"] == "engine" and r["output"] == "output"
            and r["workload"] in {m["workload"] for m in mine}} == {"exact"}
    assert all(r["agreement"].endswith("(engine: exact)") for r in mine
               if r["check"] != "kernels.py:rms_good" and r["agreement"] != "exact")
    # a FAIL line has the max errors and tolerance too, and says the engine was exact
    fails = [line for line in done.stdout.splitlines()
             if line.startswith(f"FAIL {name} ") and "(kernels.py:rms_broken)" in line]
    assert fails and all(
        re.search(r"; max abs [\d.e+-]+, max rel [\d.e+-]+ \(tolerance " + re.escape(tol)
                  + r"\); the engine's own output matched the reference exactly$", line)
        for line in fails)


def test_what_a_kernel_implements_and_names_that_match_nothing(demo: tuple[Path, str],
                                                               tmp_path: Path) -> None:
    root, _ = demo
    definitions = Dataset(root).definitions()
    (tmp_path / "claimed.py").write_text(
        "from enginetap.replay import implements\n"
        + _kernel("run").replace("def run(", "@implements('rmsnorm')\ndef run("))
    (tmp_path / "silent.py").write_text(_kernel("run"))
    (tmp_path / "elsewhere.py").write_text('ENGINETAP_IMPLEMENTS = ["mla_paged_decode"]\n'
                                           + _kernel("run"))

    # A function that says what it implements runs there only; the rest is SKIPPED.
    done = _enginetap("replay", str(root), "--solution", "claimed.py:run", "--repeats", "0",
                      cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = {r["definition"]: r for r in _tables(done.stdout, "definition")}
    assert set(summary) == set(definitions)
    for name, definition in definitions.items():
        family, row = family_of(definition), summary[name]
        if family == "rmsnorm":
            assert (row["status"], row["agreement"]) == ("PASS", "exact")
        else:
            assert row["status"] == "SKIPPED" and row["why"] == (
                f"claimed.py:run implements rmsnorm (its enginetap_implements), not {family}")

    # One that says nothing, over several families: refused up front, with the fix.
    done = _enginetap("replay", str(root), "--solution", "silent.py:run", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert "silent.py:run does not say which definitions it implements" in done.stderr
    assert "pass --family FAMILY" in done.stderr and "ENGINETAP_IMPLEMENTS" in done.stderr
    # ... and fine once told with --family or -d.
    rms = next(n for n, d in definitions.items() if family_of(d) == "rmsnorm")
    done = _enginetap("replay", str(root), "-d", rms, "--solution", "silent.py:run",
                      "--repeats", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr

    # One whose claim matches nothing here would check nothing: refused.
    done = _enginetap("replay", str(root), "--solution", "elsewhere.py:run", cwd=tmp_path)
    assert done.returncode == 2
    assert "elsewhere.py:run implements mla_paged_decode" in done.stderr

    # -d / --family that match nothing list what they could have been, closest first.
    done = _enginetap("replay", str(root), "-d", "rmsnorm_h128", cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"-d rmsnorm_h128: no such definition in {root}: it could have been {rms}, " \
        in done.stderr
    done = _enginetap("replay", str(root), "--family", "gqa_paged", cwd=tmp_path)
    assert done.returncode == 2
    assert "--family gqa_paged: no definition of that family" in done.stderr
    assert "its families are gqa_paged_decode, " in done.stderr
