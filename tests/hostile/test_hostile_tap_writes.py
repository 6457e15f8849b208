"""`tap report --html` and `tap diff --html` never destroy what they read, and a failed
write (a full disk, for real) leaves the previous page whole: one error line, exit 2."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from .tap_helpers import enginetap, one_error_line, record_tap


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tap-writes")
    return record_tap(root / "a"), record_tap(root / "b", max_new_tokens=2)


def _snapshot(*runs: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for run in runs for p in sorted(run.rglob("*"))
            if p.is_file()}


@pytest.mark.parametrize("target", ["own", "link.html", "hard.html", "directory", "rank1"])
def test_report_html_never_replaces_the_run_it_reads(runs: tuple[Path, Path],
                                                     tmp_path: Path, target: str) -> None:
    run = shutil.copytree(runs[0], tmp_path / "a")
    (tmp_path / "link.html").symlink_to(run / "tap-rank0.jsonl")
    os.link(run / "tap-rank0.jsonl", tmp_path / "hard.html")
    before = _snapshot(run)
    html = {"own": run / "tap-rank0.jsonl", "directory": run,
            "rank1": run / "tap-rank1.jsonl"}.get(target, tmp_path / target)
    for given in (run, run / "tap-rank0.jsonl"):  # a run is a directory or one rank's file
        done = enginetap("tap", "report", str(given), "--html", str(html))
        one_error_line(done, "error: ", "--html")
        assert _snapshot(run) == before


@pytest.mark.parametrize("side", ["a", "b"])
def test_diff_html_never_replaces_either_run(runs: tuple[Path, Path], tmp_path: Path,
                                             side: str) -> None:
    a, b = (shutil.copytree(r, tmp_path / r.name) for r in runs)
    before = _snapshot(a, b)
    target = (a if side == "a" else b) / "tap-rank0.jsonl"
    one_error_line(enginetap("tap", "diff", str(a), str(b), "--html", str(target)),
                   "error: ", "--html", str(target))
    assert _snapshot(a, b) == before


def test_report_html_still_writes_a_new_page_and_replaces_an_old_one(
        runs: tuple[Path, Path], tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text("old page")
    done = enginetap("tap", "report", str(runs[0]), "--html", str(page))
    assert done.returncode == 0, done.stderr
    assert page.read_text().startswith("<!DOCTYPE html>")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]


_FULL_DISK = r"""
import json, os, subprocess, sys
mount, run, old = sys.argv[1], sys.argv[2], sys.argv[3]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", mount], check=True)
page = os.path.join(mount, "report.html")
with open(page, "w") as f:
    f.write(old)
try:  # fill the file system to its last byte
    with open(os.path.join(mount, "fill"), "wb", buffering=0) as f:
        while True:
            f.write(b"\0" * 512)
except OSError as exc:
    full = exc.strerror
done = subprocess.run([sys.executable, "-m", "enginetap.cli.main", *sys.argv[4:],
                       "--html", page], capture_output=True, text=True)
print(json.dumps({"full": full, "rc": done.returncode, "stderr": done.stderr,
                  "page": open(page).read(), "files": sorted(os.listdir(mount))}))
"""


def _unshare() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _unshare(), reason="no unprivileged mount namespace for a tmpfs")
def test_a_full_tmpfs_leaves_the_previous_page_whole(runs: tuple[Path, Path],
                                                     tmp_path: Path) -> None:
    """A real 64 KiB tmpfs filled to its last byte (in a private mount namespace). The
    new page is larger than the one block the previous page holds: written in place, it
    would be cut short."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    old = "<p>the previous report</p>\n"
    args = ["tap", "report", str(runs[0])]
    done = subprocess.run(["unshare", "-rm", sys.executable, "-c", _FULL_DISK, str(mount),
                           str(runs[0]), old, *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ,
                                            "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["full"] == "No space left on device"
    assert result["rc"] == 2, result
    assert "Traceback" not in result["stderr"]
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: cannot write the HTML page"), lines
    assert "No space left on device" in lines[0]
    assert result["page"] == old
    assert result["files"] == ["fill", "report.html"]  # no temporary file left behind


def test_a_file_size_limit_leaves_the_previous_page_whole(runs: tuple[Path, Path],
                                                          tmp_path: Path) -> None:
    """The same through RLIMIT_FSIZE (writes past 1 KiB fail with EFBIG), for machines
    without mount namespaces."""
    page = tmp_path / "report.html"
    old = "previous page\n"
    page.write_text(old)

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    done = enginetap("tap", "diff", str(runs[0]), str(runs[1]), "--html", str(page),
                     preexec=limit)
    one_error_line(done, "error: cannot write the HTML page", str(page))
    assert page.read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.html"]
