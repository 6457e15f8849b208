"""Hostile replays: dataset code on the path, candidates and references that end the process.

Each test runs the real ``enginetap`` command in a fresh process, as a user would, on a
dataset built in tmp_path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import enginetap
from enginetap.dataset import Dataset
from enginetap.definitions import get_template
from enginetap.replay.synth import synthesize
from tests.replay.replay_helpers import CANDIDATES, foreign_definition, receipt

SRC = Path(enginetap.__file__).resolve().parents[1]
ENGINETAP = Path(sys.executable).parent / "enginetap"


def _enginetap(*args: str, cwd: Path, path: tuple[Path, ...] = ()
               ) -> subprocess.CompletedProcess[str]:
    """The installed console script, with this checkout's sources first (as an absolute path:
    the command runs in another directory), then ``path``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (SRC, *path))), "COLUMNS": "200"}
    return subprocess.run([str(ENGINETAP), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _rmsnorm_dataset(root: Path) -> Dataset:
    dataset = Dataset(root, create=True)
    synthesize(dataset, get_template("rmsnorm"), workloads=2, seed=3)
    return dataset


def test_dataset_modules_never_run_when_the_solution_is_given_by_file(tmp_path: Path) -> None:
    ds = _rmsnorm_dataset(tmp_path / "ds").root
    ran = tmp_path / "dataset-code-ran"
    planted = f"open({str(ran)!r}, 'w').close()\nraise SystemExit(0)\n"
    for name in ("safetensors.py", "planted_kernels.py"):
        (ds / name).write_text(planted)
    done = _enginetap("replay", ".", "--repeats", "1", "--solution", f"{CANDIDATES}:correct",
                      cwd=ds)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok: 4 PASS" in done.stdout
    # By module name: imported from the user's sys.path only, which the dataset is not on.
    done = _enginetap("replay", ".", "--solution", "planted_kernels:run", cwd=ds)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "cannot import solution module 'planted_kernels'" in done.stderr
    assert not ran.exists()
    # A module on the user's own path (PYTHONPATH) is found, from any directory.
    done = _enginetap("replay", ".", "--repeats", "0", "--solution", "replay_candidates:correct",
                      cwd=ds, path=(CANDIDATES.parent,))
    assert done.returncode == 0 and "ok: 4 PASS" in done.stdout, done.stdout + done.stderr
    assert not ran.exists()


_ENDINGS = {  # what the candidate does, what its ERROR row says
    "sys_exit_0": ("import sys\n    sys.exit(0)", "candidate failed: SystemExit: 0"),
    "system_exit_3": ("raise SystemExit(3)", "candidate failed: SystemExit: 3"),
    "keyboard_interrupt": ("raise KeyboardInterrupt", "candidate failed: KeyboardInterrupt"),
    "os_exit_0": ("import os\n    os._exit(0)",
                  "candidate failed: the process running it ended with exit code 0"),
    "segfault": ("import ctypes\n    ctypes.string_at(0)",
                 "candidate failed: the process running it was killed by SIGSEGV"),
}


@pytest.mark.parametrize("ending", sorted(_ENDINGS))
def test_candidate_that_ends_its_process_is_an_error_row(tmp_path: Path, ending: str) -> None:
    ds = _rmsnorm_dataset(tmp_path / "ds").root
    cands = tmp_path / "cands.py"
    does, says = _ENDINGS[ending]
    cands.write_text(f"def run(hidden_states, weight, eps):\n    {does}\n")
    done = _enginetap("replay", str(ds), "--repeats", "1", "--solution", f"{cands}:run",
                      cwd=tmp_path)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    errors = [line for line in done.stdout.splitlines()
              if line.startswith("ERROR rmsnorm_h128_") and says in line]
    assert len(errors) == 2, output  # both workloads replayed, both report the candidate
    assert "not ok: 2 PASS, 2 ERROR" in done.stdout
    assert "Traceback" not in output


def test_solution_that_exits_while_imported_is_refused_with_one_line(tmp_path: Path) -> None:
    ds = _rmsnorm_dataset(tmp_path / "ds").root
    cands = tmp_path / "cands.py"
    for top in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
        cands.write_text(top + "def run(hidden_states, weight, eps):\n    return hidden_states\n")
        done = _enginetap("replay", str(ds), "--solution", f"{cands}:run", cwd=tmp_path)
        assert done.returncode == 2, done.stdout + done.stderr
        assert "error: cannot" in done.stderr and "Traceback" not in done.stderr


def _foreign_dataset(root: Path, reference: str, name: str = "scale_d16") -> Path:
    dataset = Dataset(root, create=True)
    definition = foreign_definition(root / "unused").model_copy(
        update={"reference": reference, "name": name})
    for rows in (3, 5):
        x = torch.randn(rows, 16)
        dataset.add_workload(definition, {"x": x, "factor": 1.5}, outputs={"y": x * 1.5},
                             receipt=receipt())
    return dataset.root


@pytest.mark.parametrize("reference, expected", [
    ("import os\nos._exit(0)\n\ndef run(x, factor):\n    return x * factor\n",
     "its reference cannot be loaded: the process running it ended with exit code 0"),
    ("def run(x, factor):\n    raise SystemExit(0)\n", "reference failed: SystemExit: 0"),
    ("def run(x, factor):\n    raise KeyboardInterrupt\n", "reference failed: KeyboardInterrupt"),
])
def test_trusted_reference_that_ends_its_process_is_reported(tmp_path: Path, reference: str,
                                                             expected: str) -> None:
    ds = _foreign_dataset(tmp_path / "ds", reference)
    done = _enginetap("replay", str(ds), "--repeats", "0", "--trust-dataset-code", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert expected in done.stdout and "not ok:" in done.stdout


def test_a_workload_with_nothing_to_compare_fails(tmp_path: Path) -> None:
    dataset = Dataset(tmp_path / "ds", create=True)
    definition = synthesize(dataset, get_template("rmsnorm"), workloads=1, seed=1)
    dataset.add_workload(definition, {"hidden_states": torch.randn(4, 128).bfloat16(),
                                      "weight": torch.randn(128).bfloat16(), "eps": 1e-6},
                         receipt=receipt())
    done = _enginetap("replay", str(dataset.root), "--repeats", "0", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "not ok: 1 PASS, 1 FAIL" in done.stdout
    assert "nothing compared: no engine outputs are stored" in " ".join(done.stdout.split())


def test_a_trusted_reference_that_exits_spares_the_next_definition(tmp_path: Path) -> None:
    # Trusted references share one child process: the next definition starts a new one.
    _foreign_dataset(tmp_path / "ds", "import os\nos._exit(0)\n\ndef run(x, factor):\n"
                     "    return x * factor\n", name="scale_a_d16")
    ds = _foreign_dataset(tmp_path / "ds", "def run(x, factor):\n    return x * factor\n",
                          name="scale_b_d16")
    done = _enginetap("replay", str(ds), "--repeats", "0", "--trust-dataset-code", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ERROR scale_a_d16: its reference cannot be loaded" in done.stdout
    assert "scale_b_d16  PASS  (reference: dataset)" in done.stdout
    assert "not ok: 2 PASS, 1 ERROR" in done.stdout
