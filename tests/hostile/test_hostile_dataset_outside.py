"""A dataset reaching outside itself: ``blob/`` as a symlink out of the root, names holding
terminal escape sequences, and a synth asked for more workloads than fit anywhere."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import enginetap
from enginetap.dataset import Dataset, validate_dataset
from enginetap.definitions import get_template
from enginetap.replay.synth import synthesize

SRC = Path(enginetap.__file__).resolve().parents[1]
ENGINETAP = Path(sys.executable).parent / "enginetap"


def _enginetap(*args: str, cwd: Path, timeout: float = 120,
               memory: int | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(SRC), "COLUMNS": "200"}

    def bound() -> None:  # a run of the unfixed code must not take the machine with it
        if memory is not None:
            resource.setrlimit(resource.RLIMIT_DATA, (memory, memory))

    return subprocess.run([str(ENGINETAP), *args], cwd=cwd, env=env, capture_output=True,
                          timeout=timeout, preexec_fn=bound)


def test_a_blob_directory_linking_outside_is_not_walked_nor_called_orphans(tmp_path: Path
                                                                           ) -> None:
    outside = tmp_path / "home"
    (outside / "work").mkdir(parents=True)
    (outside / "work" / "thesis.tex").write_text("years of work")
    dataset = Dataset(tmp_path / "ds", create=True)
    dataset.write_definition(get_template("rmsnorm").example_definition())
    blob = dataset.root / "blob"
    if blob.exists():
        blob.rmdir()
    blob.symlink_to(outside)
    problems = validate_dataset(dataset.root)
    assert not any("thesis" in p for p in problems), problems
    assert not any("delete" in p for p in problems), problems
    assert any(p.startswith("blob: a symlink leading outside the dataset") for p in problems), \
        problems
    assert (outside / "work" / "thesis.tex").exists()


def test_a_blob_link_to_the_root_file_system_is_not_walked(tmp_path: Path) -> None:
    dataset = Dataset(tmp_path / "ds", create=True)
    dataset.write_definition(get_template("rmsnorm").example_definition())
    blob = dataset.root / "blob"
    if blob.exists():
        blob.rmdir()
    blob.symlink_to("/")
    start = time.monotonic()
    done = _enginetap("dataset", "validate", str(dataset.root), cwd=tmp_path, timeout=60)
    assert time.monotonic() - start < 30
    assert done.returncode == 1, done
    out = done.stdout.decode()
    assert out.startswith("blob: a symlink leading outside the dataset"), out[:2000]
    assert len(out.splitlines()) == 1 and b"Traceback" not in done.stderr


_ESC = "rms\x1b]0;pwned\x07\x1b[2Jnorm\u202e"


def test_escape_sequences_in_names_are_shown_escaped(tmp_path: Path) -> None:
    dataset = Dataset(tmp_path / "ds", create=True)
    synthesize(dataset, get_template("rmsnorm"), workloads=1, seed=1)
    (path,) = (dataset.root / "definitions").rglob("*.json")
    data = json.loads(path.read_text())
    data["name"] = _ESC
    path.write_text(json.dumps(data))
    for args in (("dataset", "show"), ("dataset", "validate"), ("replay",)):
        done = _enginetap(*args, str(dataset.root), cwd=tmp_path)
        assert done.returncode in (0, 1), done
        shown = done.stdout + done.stderr
        assert b"\x1b" not in shown and b"\x07" not in shown, (args, shown[-3000:])
        assert "\u202e".encode() not in shown, args
        if args != ("dataset", "validate"):
            assert b"rms\\x1b]0;pwned\\x07\\x1b[2Jnorm\\u202e" in shown, (args, shown[-3000:])


def test_synth_of_more_workloads_than_the_disk_holds_is_refused_at_once(tmp_path: Path
                                                                        ) -> None:
    start = time.monotonic()
    done = _enginetap("definitions", "synth", str(tmp_path / "ds"), "--family", "rmsnorm",
                      "--workloads", "100000000", cwd=tmp_path, timeout=60, memory=2 << 30)
    assert time.monotonic() - start < 45
    err = done.stderr.decode()
    assert done.returncode == 2, err[-2000:]
    assert "--workloads 100000000" in err and "free" in err and "Traceback" not in err
    assert not (tmp_path / "ds" / "workloads").exists() or \
        not any((tmp_path / "ds" / "workloads").rglob("*.jsonl"))


def test_synth_writes_as_it_goes(tmp_path: Path) -> None:
    """Workloads are written in batches, not all computed first: a failure late in a
    large synth still leaves nothing behind, and memory stays that of one batch."""
    from enginetap.replay import synth

    dataset = Dataset(tmp_path / "ds", create=True)
    seen: list[int] = []
    real = synth._write_batch

    def spy(*args, **kwargs):
        seen.append(len(args[2]))
        return real(*args, **kwargs)

    synth._write_batch = spy
    try:
        synthesize(dataset, get_template("rmsnorm"), workloads=3 * synth.BATCH + 1, seed=0)
    finally:
        synth._write_batch = real
    assert seen == [synth.BATCH] * 3 + [1]
    (name,) = dataset.definitions()
    assert len(dataset.workloads(name)) == 3 * synth.BATCH + 1
