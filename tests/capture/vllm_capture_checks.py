"""Shared by the vLLM capture tests: run the capture script in a child, replay a dataset.

vLLM never starts inside pytest (its spawned processes re-import ``__main__``): each run
is a child process with an explicit arming in ``ENGINETAP_CONFIG`` (capture, or nothing).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from enginetap.config import ARMING_VARS

RUN_SCRIPT = Path(__file__).with_name("vllm_capture_run.py")


@dataclass(frozen=True)
class CaptureRun:
    out: Path
    tokens: dict[str, list[int]]
    cached: dict[str, int]
    log: str

    @property
    def dataset(self) -> Path:
        return self.out / "dataset"

    def summary(self, rank: int = 0) -> dict:
        return json.loads((self.out / f"capture-summary-rank{rank}.json").read_text())


def run_capture(model: Path, out: Path, *, armed: bool = True, tp: int = 1,
                hide_amx: bool = False, timeout: float = 400,
                capture: dict | None = None, ssm_dtype: str = "auto") -> CaptureRun:
    """Run the fixed workload on vLLM CPU in a child process (armed with capture, with
    ``capture`` options, or not)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ARMING_VARS}
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # TP=2 on a 2-core, 1-NUMA-node machine
    if armed:
        config = {"enabled": True, "capabilities": ["capture"], "out_dir": str(out),
                  "options": {"capture": capture or {}}}
        (out / "arming.json").write_text(json.dumps(config))
        env["ENGINETAP_CONFIG"] = str(out / "arming.json")
    args = [sys.executable, str(RUN_SCRIPT), str(model), str(out / "report.json"),
            "--tp", str(tp), *(["--hide-amx"] if hide_amx else []), "--ssm-dtype", ssm_dtype]
    log_path = out / "run.log"
    with log_path.open("wb") as sink:
        proc = subprocess.run(args, env=env, stdout=sink, stderr=subprocess.STDOUT,
                              timeout=timeout, check=False)
    log = log_path.read_text(errors="replace")
    assert proc.returncode == 0, f"vLLM capture run exited {proc.returncode}:\n{log[-4000:]}"
    requests = json.loads((out / "report.json").read_text())["requests"]
    return CaptureRun(out, {k: r["output"] for k, r in requests.items()},
                      {k: r["cached_tokens"] for k, r in requests.items()}, log)


def replay_failures(dataset: Path) -> tuple[dict[str, str], list[str]]:
    """Every replayed definition's status, and a line per workload that did not PASS."""
    from enginetap.replay.runner import replay_dataset

    report = replay_dataset(dataset, warmup=0, repeats=1)
    statuses = {d.name: d.status for d in report.definitions}
    failures = [f"problem: {p}" for p in report.problems]
    for definition in report.definitions:
        if definition.message:
            failures.append(f"{definition.name}: {definition.message}")
        for workload in definition.workloads:
            if workload.status != "PASS":
                bad = [c for c in workload.checks if c.status != "PASS"]
                failures.append(f"{definition.name} {workload.uuid}: {workload.status} "
                                f"{workload.message or ''} {bad}")
    return statuses, failures


def families(dataset: Path) -> set[str]:
    """The definition families the dataset holds workloads of."""
    from enginetap.dataset import Dataset
    from enginetap.definitions.base import family_of

    store = Dataset(dataset)
    return {family_of(d) or name for name, d in store.definitions().items()
            if store.workloads(name)}


def definition_of(dataset: Path, family: str) -> str:
    """The name of the (one) definition of ``family`` the dataset holds."""
    from enginetap.dataset import Dataset
    from enginetap.definitions.base import family_of

    names = [n for n, d in Dataset(dataset).definitions().items() if family_of(d) == family]
    assert len(names) == 1, f"{family}: {names}"
    return names[0]


def const_axes(dataset: Path, family: str) -> dict[str, int]:
    """The const axes of the dataset's definition of ``family``."""
    from enginetap.dataset import Dataset

    definition = Dataset(dataset).definition(definition_of(dataset, family))
    return {k: a.value for k, a in definition.axes.items() if hasattr(a, "value")}


def receipts(dataset: Path, family: str) -> list[dict]:
    """The provenance receipts of the workloads of ``family``'s definition, as dicts."""
    from enginetap.dataset import Dataset

    lines = Dataset(dataset).workloads(definition_of(dataset, family))
    return [line.enginetap.receipt.model_dump() for line in lines]
